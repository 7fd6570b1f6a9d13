"""Transcriber: wires the stages together for many (long) inputs at once; no maths of its own.

    paths / arrays ──stream_audio──► blocks ──ChunkingOptions.iter / iter_vad_chunks──► (span, samples)
    ──FeatureBatcher──► ChunkRequest((file, chunk), features) ──Engine.run──► ChunkResult ──regroup per file──►
    stitch_chunks (stride: overlapping windows) / concat_chunks (vad: disjoint speech chunks) ──► text
    [word timestamps: each finished chunk's text, teacher-forced once more through the target (Aligner)]

The chunks of *all* inputs go through one lazy generator into one `Engine.run`, so the batch stays full across
file boundaries and a 2-hour file is never held whole: the engine pulls chunks as rows free up, and the generator
reads audio one block and computes features one batch at a time. Results come back in the order chunks finish;
they are regrouped per file, put back in chunk order and stitched once a file's last chunk is in. Transcriptions
are yielded in input order. A file that cannot be read gets `error` set; the others carry on.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from asr_spec.audio.chunking import ChunkSpan
from asr_spec.audio.features import FeatureBatcher
from asr_spec.audio.loading import SAMPLE_RATE, audio_duration_s, load_audio, stream_audio
from asr_spec.audio.vad import SPEECH_FRAME_S, SileroVad, SpeechSpan, iter_vad_chunks
from asr_spec.engine import ChunkRequest, ChunkResult, ChunkStats, Engine
from asr_spec.engine.memory import MAX_ENCODE_BATCH
from asr_spec.engine.options import check_int
from asr_spec.errors import AsrSpecError, AudioError, InputError, one_line
from asr_spec.models.presets import DEFAULT_PRESET
from asr_spec.transcribe.options import TranscribeOptions
from asr_spec.transcribe.nospeech import NO_SPEECH
from asr_spec.transcribe.outputs import TranscriptSegment, output_stems, prepare_output_dir, write_outputs
from asr_spec.transcribe.results import ChunkReport, Transcription
from asr_spec.transcribe.alignment import Aligner, WordTiming
from asr_spec.transcribe.stitch import ChunkTokens, concat_chunks, stitch_chunks

__all__ = ["Transcriber"]

# Errors caused by one input (unreadable, corrupt, NaN, unwritable output): reported on it; anything else propagates.
INPUT_ERRORS = (AsrSpecError, ValueError, OSError)
ProgressCallback = Callable[[float, float], None]  # (done_s, total_s), seconds of audio


# -- bookkeeping of one input during a run -------------------------------------------------------------------------

@dataclass
class _Input:
    index: int
    name: str
    source: Any
    stem: str
    expected_s: float = 0.0  # progress estimate (header duration); 0 when unknown
    spans: list[ChunkSpan] = field(default_factory=list)
    results: dict[int, ChunkResult] = field(default_factory=dict)
    words: dict[int, list[list[WordTiming]]] = field(default_factory=dict)  # per chunk, per segment
    n_samples: int = 0
    read_done: bool = False
    error: str | None = None
    started: float = 0.0
    progress_s: float = 0.0

    @property
    def complete(self) -> bool:
        return self.read_done and (self.error is not None or len(self.results) == len(self.spans))


def _inputs(audio: Any) -> list[_Input]:
    """One `_Input` per source: a path, array, tensor or dict is one input; a list or tuple holds several."""
    single = (str, os.PathLike, np.ndarray, torch.Tensor, Mapping)
    if isinstance(audio, single):
        audio = [audio]
    elif not isinstance(audio, (list, tuple)):
        raise InputError(f"expected an audio path, array, dict or a list of them, got {type(audio).__name__}")
    out = []
    for i, src in enumerate(audio):
        if isinstance(src, (str, os.PathLike)):
            name = os.fspath(src)
        elif isinstance(src, Mapping) and src.get("path"):
            name = str(src["path"])
        else:
            kind = "array" if isinstance(src, (np.ndarray, torch.Tensor)) else type(src).__name__
            name = f"<{kind} {i}>"
        out.append(_Input(i, name, src, f"input-{i}"))
    return out


def _name_outputs(inputs: list[_Input]) -> None:
    """Give every input a distinct output stem (see `output_stems`); InputError for the same file twice."""
    paths = [None if item.name.startswith("<") else item.name for item in inputs]
    for item, stem in zip(inputs, output_stems(paths)):
        if stem is not None:
            item.stem = stem


# -- progress ---------------------------------------------------------------------------------------------------

class _Progress:
    """Seconds of audio done: a tqdm bar on stderr (by default only when stderr is a terminal) or a callback."""

    def __init__(self, progress: bool | ProgressCallback | None, inputs: list[_Input]):
        self.callback = progress if callable(progress) else None
        show_bar = sys.stderr.isatty() if progress is None else progress is True
        self.done_s, self.total_s, self.bar = 0.0, 0.0, None
        if show_bar or self.callback is not None:
            for item in inputs:
                item.expected_s = _expected_s(item.source)
            self.total_s = sum(item.expected_s for item in inputs)
        if show_bar:
            from tqdm import tqdm

            self.bar = tqdm(total=self.total_s, unit="s", file=sys.stderr, dynamic_ncols=True,
                            bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f} s audio [{elapsed}<{remaining}]")

    def advance(self, seconds: float) -> None:
        if seconds <= 0:
            return
        self.done_s += seconds
        self.total_s = max(self.total_s, self.done_s)  # an input whose length was unknown
        if self.bar is not None:
            self.bar.total = self.total_s
            self.bar.update(seconds)
        if self.callback is not None:
            self.callback(self.done_s, self.total_s)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# -- the transcriber ---------------------------------------------------------------------------------------------

class Transcriber:
    """Long-form transcription with lossless batched speculative decoding.

    target:    `WhisperForConditionalGeneration`, eval mode.
    draft:     None (greedy), a `WhisperForCausalLM` or a full Whisper model (see `Engine`).
    processor: `WhisperProcessor` of the target (tokenizer for text, feature extractor for log-mels).
    device:    where to run; default the target's device (the models are moved there).
    draft_max_batch: the draft decodes batches of at most this many chunks, greedy above; None: every batch.
    """

    def __init__(self, target: Any, draft: Any = None, processor: Any = None,
                 options: TranscribeOptions | None = None, device: str | torch.device | None = None,
                 draft_max_batch: int | None = None):
        if processor is None or not hasattr(processor, "tokenizer") or not hasattr(processor, "feature_extractor"):
            raise InputError("processor must be the target's WhisperProcessor (tokenizer + feature extractor)")
        self.options = TranscribeOptions() if options is None else options
        if not isinstance(self.options, TranscribeOptions):
            raise InputError(f"options must be a TranscribeOptions, got {type(self.options).__name__}")
        self.device = target.device if device is None else torch.device(device)
        self.target = target.to(self.device)
        self.draft = None if draft is None else draft.to(self.device)
        self.processor, self.tokenizer = processor, processor.tokenizer
        n_mels, wanted = processor.feature_extractor.feature_size, target.config.num_mel_bins
        if n_mels != wanted:
            raise InputError(f"the processor makes {n_mels} mel bins but the target expects {wanted}")
        self.features = FeatureBatcher(processor.feature_extractor, device=self.device, dtype=target.dtype)
        self.engine = Engine(self.target, self.draft, self.options.decode)  # checks the pair and language now
        check_int(0 if draft_max_batch is None else draft_max_batch, "draft_max_batch", 0, InputError)
        self.draft_max_batch, self._greedy_engine = draft_max_batch, None  # greedy engine: made when first needed
        self.tokens = self.engine.tokens
        self._vads: list[SileroVad] = []  # idle VAD states, loaded when first needed (see chunk_audio)
        self._vad_lock = threading.Lock()
        self._encoded: dict[tuple[int, int], torch.Tensor] = {}  # word timestamps: encoder outputs in flight
        self.aligner = None if not self.options.word_timestamps else Aligner(
            self.target, self.tokens.eot, self.tokens.no_timestamps,
            lambda token: self.tokenizer.decode([token], skip_special_tokens=False))
        self._code_of = {token_id: token.strip("<|>") for token, token_id in self.tokens.lang_to_id.items()}

    # -- construction ---------------------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, model: str | os.PathLike, draft: str | os.PathLike | None = None, *,
                        device: str | torch.device | None = None, dtype: str | torch.dtype | None = None,
                        options: TranscribeOptions | None = None, share_encoder: bool | None = None,
                        draft_max_batch: int | None = None, **option_values: Any) -> Transcriber:
        """Load the target `model` (hub id, local or CTranslate2 directory, "embedded:whisper-base"), its processor
        and an optional `draft` (same forms). dtype None or "auto": float16 on CUDA, float32 elsewhere.
        `option_values` are flat `TranscribeOptions` names applied over `options`; share_encoder: see
        `asr_spec.models.loading.load_draft`; draft_max_batch: see `engine_for` (None: the draft at every batch)."""
        from asr_spec.models import loading as models

        opts = TranscribeOptions.from_values(options, **option_values)  # bad options fail before any loading
        dev = models.resolve_device(device)
        dt = models.resolve_dtype(dtype, dev)
        target = models.load_model(model, dev, dt)
        processor = models.load_processor(model)
        draft_model = None if draft is None else models.load_draft(draft, target, dev, dt, share_encoder)
        return cls(target, draft_model, processor, opts, dev, draft_max_batch)

    @classmethod
    def from_preset(cls, name: str | os.PathLike = DEFAULT_PRESET, **overrides: Any) -> Transcriber:
        """Load the preset `name` (see `asr_spec.models.presets`) with overrides: `model`, `draft`, `dtype`,
        `device`, or any `TranscribeOptions` name (chunk_length_s, language, batch_size, ...).

        The preset's draft belongs to its model: overriding `model` without `draft` runs greedy decoding.
        `draft=None` turns the draft off.
        """
        from asr_spec.models.loading import resolve_device
        from asr_spec.models.presets import MODEL_KEYS, load_preset, plan_models

        preset = load_preset(name)  # its option values are checked here, naming its file
        unknown = sorted(set(overrides) - set(MODEL_KEYS) - set(TranscribeOptions.keys()))
        if unknown:
            known = ", ".join(MODEL_KEYS + TranscribeOptions.keys())
            raise InputError(f"unknown option(s) {', '.join(unknown)} (known: {known})")
        try:
            base = TranscribeOptions.from_values(**preset.option_values())
        except InputError as err:  # a value of the preset's own: name its file
            raise InputError(f"{preset.path or 'preset ' + preset.name}: {one_line(err)}") from err
        plan = plan_models(preset, resolve_device(overrides.get("device")).type, overrides)
        values = {key: value for key, value in overrides.items() if key not in MODEL_KEYS}
        values["draft_max_rows"] = plan.draft_max_rows
        options = TranscribeOptions.from_values(base, **values)  # the caller's values: their message as is
        return cls.from_pretrained(plan.model, plan.draft, device=overrides.get("device"), dtype=plan.dtype,
                                   options=options, share_encoder=plan.share_encoder)

    # -- public entry points -------------------------------------------------------------------------------------
    def transcribe(self, audio: Any, *, batch_size: int | None = None, progress: bool | ProgressCallback | None = None,
                   output_dir: str | os.PathLike | None = None) -> list[Transcription]:
        """Transcribe one input or a list of them; one `Transcription` per input, in input order.

        audio:      a path, a 16 kHz array/tensor, a {"array", "sampling_rate"} / {"bytes"} / {"path"} dict, or a
                    list of those.
        batch_size: chunks decoded together (default: options.batch_size).
        progress:   None = a bar on stderr when it is a terminal; True/False force it; a callable gets
                    (done_s, total_s) seconds of audio instead.
        output_dir: also write each transcript there (atomically, as `<stem>.<format>` for options.formats) as
                    soon as it is done; a failed write sets that input's `error`. Checked before any work (a file,
                    or a folder that cannot be created or written: `InputError`). Inputs with the same name in
                    different folders are written as `<folder>__<stem>.*`; the same file twice is refused.
        """
        return list(self.iter_transcribe(audio, batch_size=batch_size, progress=progress, output_dir=output_dir))

    def __call__(self, audio: Any, *, batch_size: int | None = None) -> dict[str, Any] | list[dict[str, Any]]:
        """Transcribe like transformers' ASR pipeline: {"text", "chunks": [{"timestamp": (start_s, end_s), "text"}]}
        (a list of those for a list input). A failed input raises `AudioError`."""
        results = self.transcribe(audio, batch_size=batch_size, progress=False)
        for t in results:
            if t.error is not None:
                raise AudioError(f"{t.source}: {t.error}")
        shaped = [{"text": t.text, "chunks": [{"timestamp": (s.start_s, s.end_s), "text": s.text} for s in t.segments]}
                  for t in results]
        return shaped if isinstance(audio, (list, tuple)) else shaped[0]

    def iter_transcribe(self, audio: Any, *, batch_size: int | None = None,
                        progress: bool | ProgressCallback | None = None,
                        output_dir: str | os.PathLike | None = None) -> Iterator[Transcription]:
        """`transcribe`, yielding each input's transcript (in input order) as soon as it and those before it are
        done: a long archive shows results, and writes files, while later inputs are still decoding."""
        rows = (self.options.batch_size if batch_size is None
                else TranscribeOptions.from_values(self.options, batch_size=batch_size).batch_size)
        inputs = _inputs(audio)
        if output_dir is not None:  # before any work: names resolved, the folder usable, stale temp files gone
            _name_outputs(inputs)
            prepare_output_dir(output_dir)
        bar = _Progress(progress, inputs)
        next_out = 0
        try:
            for result in self.engine_for(rows).run(self._requests(inputs, rows), rows):
                item = inputs[result.id[0]]
                encoded = self._encoded.pop(result.id, None)
                if item is not None and item.error is None:  # None: failed and already reported
                    item.results[result.id[1]] = result
                    span = item.spans[result.id[1]]
                    if self.aligner is not None:
                        item.words[result.id[1]] = self.align_chunk(result, span, encoded)
                    seconds = (span.keep_end_sample - span.keep_start_sample) / SAMPLE_RATE
                    item.progress_s += seconds
                    bar.advance(seconds)
                while next_out < len(inputs) and inputs[next_out].complete:
                    yield self._finish(inputs[next_out], bar, output_dir)
                    inputs[next_out] = None  # type: ignore[call-overload]  # free its spans and results
                    next_out += 1
            for index in range(next_out, len(inputs)):  # inputs with no chunk left in the engine (failed ones)
                yield self._finish(inputs[index], bar, output_dir)
        finally:
            bar.close()

    def engine_for(self, rows: int) -> Engine:
        """The engine for batches of `rows` chunks: the draft's, or a greedy one above `draft_max_batch`."""
        if self.draft is not None and self.draft_max_batch is not None and rows > self.draft_max_batch:
            # its packed weights are the speculative engine's (shared per weight tensor)
            self._greedy_engine = self._greedy_engine or Engine(self.target, None, self.options.decode)
            return self._greedy_engine
        return self.engine

    # -- stages ---------------------------------------------------------------------------------------------------
    def _requests(self, inputs: list[_Input], batch_size: int) -> Iterator[ChunkRequest]:
        """Chunks of every input in order, featurised `batch_size` at a time (maybe across inputs). Runs lazily
        inside `Engine.run`: an input that fails is marked and skipped, its chunks already sent are ignored."""
        pending: list[tuple[tuple[int, int], np.ndarray]] = []
        for item in inputs:
            item.started = time.perf_counter()
            try:
                for span, samples in self.chunk_audio(self._blocks(item)):
                    pending.append(((item.index, len(item.spans)), samples))
                    item.spans.append(span)
                    if len(pending) == min(batch_size, MAX_ENCODE_BATCH):  # bounded features in flight
                        yield from self._featurise(pending)
                        pending = []
            except INPUT_ERRORS as err:
                item.error = one_line(err, item.name)
            item.read_done = True
        if pending:
            yield from self._featurise(pending)

    def _blocks(self, item: _Input) -> Iterator[np.ndarray]:
        """16 kHz mono blocks of one input (files stream, in-memory sources come as one block), counted into
        `item.n_samples`."""
        if isinstance(item.source, (str, os.PathLike)):
            blocks = stream_audio(item.source, self.options.block_s)
        else:
            blocks = iter([load_audio(item.source)])
        for block in blocks:
            item.n_samples += len(block)
            yield block

    def chunk_audio(self, blocks: Iterable[np.ndarray]) -> Iterator[tuple[ChunkSpan, np.ndarray]]:
        """(span, samples) of one 16 kHz mono signal given as blocks: overlapping windows (`options.vad` None) or
        speech chunks found by the VAD; what `transcribe` decodes and `assemble` stitches. Used by the server too:
        concurrent calls are safe (each takes its own VAD state, loaded at the first call that needs one)."""
        if self.options.vad is None:
            yield from self.options.chunking.iter(blocks)
            return
        with self._vad_lock:
            vad = self._vads.pop() if self._vads else None
        vad = SileroVad() if vad is None else vad
        vad.reset()
        try:
            yield from iter_vad_chunks(blocks, self.options.vad, vad)
        finally:
            with self._vad_lock:
                self._vads.append(vad)

    def _featurise(self, pending: list[tuple[tuple[int, int], np.ndarray]]) -> Iterator[ChunkRequest]:
        features = self.features([samples for _, samples in pending])  # (B, n_mels, 3000)
        if self.aligner is None:
            yield from (ChunkRequest(chunk_id, row) for (chunk_id, _), row in zip(pending, features))
            return
        encoded = self.engine.encode(features, len(pending))  # kept for the alignment pass after decoding
        for (chunk_id, _), row, enc in zip(pending, features, encoded):
            self._encoded[chunk_id] = enc
            yield ChunkRequest(chunk_id, row, enc)

    def align_chunk(self, result: ChunkResult, span: ChunkSpan, encoded: torch.Tensor) -> list[list[WordTiming]]:
        """Words of each segment of one finished chunk (the segments `concat_chunks` gives it), in file time, for
        `assemble`'s chunk_words. encoded: (n_audio_ctx, d_model) the chunk's target encoder output (the one it
        was decoded from). Needs options.word_timestamps (the aligner); call it from the engine's thread (the
        alignment pass hooks the target's decoder)."""
        if self.aligner is None:
            raise InputError("word timestamps are off: set word_timestamps (with chunking 'vad')")
        segments = self._stitch([ChunkTokens(result.tokens, span)]).segments
        speech = (span.speech, SPEECH_FRAME_S) if isinstance(span, SpeechSpan) else None
        return self.aligner.align(encoded, result.prompt, [s.token_ids for s in segments], span.n_samples,
                                  span.start_sample / SAMPLE_RATE, speech)

    def _stitch(self, chunks: list[ChunkTokens]) -> Any:
        join = stitch_chunks if self.options.vad is None else concat_chunks
        return join(chunks, eot_id=self.tokens.eot, timestamp_begin_id=self.tokens.timestamp_begin,
                    sampling_rate=SAMPLE_RATE)

    def _finish(self, item: _Input, bar: _Progress, output_dir: str | os.PathLike | None) -> Transcription:
        bar.advance(item.expected_s - item.progress_s)  # a failed or mis-estimated input: settle its share
        wall_s = time.perf_counter() - item.started
        audio_s = item.n_samples / SAMPLE_RATE
        if item.error is not None:
            return Transcription(item.name, "", (), None, None, audio_s, wall_s, (), error=item.error)
        results = [item.results[i] for i in range(len(item.spans))]
        words = [item.words[i] for i in range(len(item.spans))] if self.aligner is not None else None
        transcription = self.assemble(item.name, item.spans, results, audio_s, wall_s, words)
        if output_dir is not None:
            try:
                write_outputs(transcription, output_dir, item.stem, self.options.formats,
                              self.options.max_words_per_cue)
            except INPUT_ERRORS as err:
                cause = one_line(err)
                return dataclasses.replace(transcription, error=f"cannot write outputs to {output_dir} ({cause})")
        return transcription

    def assemble(self, source: str, spans: Sequence[ChunkSpan], results: Sequence[ChunkResult], audio_s: float,
                 wall_s: float, chunk_words: Sequence[Sequence[Sequence[WordTiming]]] | None = None) -> Transcription:
        """The `Transcription` of one input from its chunks' spans and engine results (both in chunk order):
        stitched text and segments, language, summed statistics. Used per file here and per request by the
        server (`asr_spec.serve`). chunk_words: per chunk, the words of each of its segments (word timestamps)."""
        # a window dropped by the no-speech rule contributes no text, no segment and no word
        dropped = [self.options.no_speech.drops(r.no_speech_prob, r.avg_logprob, self._decode(r.tokens))
                   for r in results]
        stitched = self._stitch([ChunkTokens(() if drop else r.tokens, span)
                                 for r, span, drop in zip(results, spans, dropped)])
        if chunk_words is None:
            words: list[Sequence[WordTiming]] = [()] * len(stitched.segments)
        else:  # one list per segment, chunk by chunk: the order concat_chunks gives the segments
            words = [w for chunk, drop in zip(chunk_words, dropped) if not drop for w in chunk]
        languages = [self._language(r) for r in results]
        reports = tuple(ChunkReport(span.start_sample / SAMPLE_RATE, span.end_sample / SAMPLE_RATE, lang,
                                    r.finish_reason, r.stats, r.no_speech_prob, r.avg_logprob,
                                    NO_SPEECH if drop else None)
                        for r, span, lang, drop in zip(results, spans, languages, dropped))
        spoken = [lang for lang, drop in zip(languages, dropped) if not drop] or languages
        return Transcription(
            source=source,
            text=self._decode(stitched.token_ids),
            segments=tuple(TranscriptSegment(s.start_s, s.end_s, self._decode(s.token_ids), tuple(w))
                           for s, w in zip(stitched.segments, words)),
            language=Counter(spoken).most_common(1)[0][0] if spoken else None,
            stats=ChunkStats.total(r.stats for r in results),
            audio_s=audio_s, wall_s=wall_s, chunks=reports, timestamped=stitched.timestamped,
            chunk_tokens=tuple(r.tokens for r in results),
        )

    def _decode(self, token_ids: Sequence[int]) -> str:
        """The text of `token_ids` (control and timestamp tokens left out)."""
        text_ids = [t for t in token_ids if t < self.tokens.eot]
        return self.tokenizer.decode(text_ids, skip_special_tokens=True).strip()

    def _language(self, result: ChunkResult) -> str | None:
        """The language of a chunk from its prompt (sot, language, task, ...); "en" for English-only models."""
        if not self._code_of:
            return "en"
        return self._code_of.get(result.prompt[1]) if len(result.prompt) > 1 else None


def _expected_s(source: Any) -> float:
    """Duration for the progress bar without decoding: header of a file, length of an array; 0 when unknown."""
    try:
        if isinstance(source, (str, os.PathLike)):
            return audio_duration_s(source)
        if isinstance(source, Mapping) and source.get("array") is not None and source.get("sampling_rate"):
            return max(np.shape(source["array"])) / float(source["sampling_rate"])
        if isinstance(source, (np.ndarray, torch.Tensor)) and source.ndim:
            return max(source.shape) / SAMPLE_RATE
    except INPUT_ERRORS:
        pass  # the real error is reported when the input is read
    return 0.0

