"""Transcriber: wires the stages together for many (long) inputs at once; no maths of its own.

    inputs (inputs.py) ──prepare (frontend.py: decode, chunk, featurise)──► ChunkRequest(ChunkId(input, chunk),
    features) ──EngineSession (session.py: tails, prompts, fallback around Engine.run; finish_result per result)──►
    Input.keep, per input ──assemble (assembly.py: no-speech rule, stitch, text, language)──► Transcription
    [──write_outputs (outputs.py), when given an output folder]

The chunks of *all* inputs go through one lazy generator into one engine run, so the batch stays full across
file boundaries and a 2-hour file is never held whole: the engine pulls chunks as rows free up, and the generator
reads audio one block and computes features one batch at a time. Results come back in the order chunks finish;
they are kept per input, put back in chunk order and assembled once an input's last chunk (and tail) is in.
Transcriptions are yielded in input order. An input that cannot be read gets `error` set; the others carry on.

The engine session (session.py) is the one place that composes a run's source (tail repair, tails.py; prompts,
prompts.py; temperature fallback, fallback.py) and finishes each result; this class is one of its clients (the
server's batcher and the live streams are the others) and keeps only its inputs, progress bar and outputs. Its
stages are public because the session and the server call them: `prepare`, `finish_result` (`finish_chunk`, then
`tail_of`: the one tail decision), `tail_source`, `fallback`, `assemble`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import Any

import numpy as np
import torch

from asr_spec.audio.chunking import ChunkSpan
from asr_spec.audio.features import FeatureBatcher
from asr_spec.audio.loading import SAMPLE_RATE
from asr_spec.audio.vad import SPEECH_FRAME_S, SpeechSpan
from asr_spec.engine import ChunkRequest, ChunkResult, Engine
from asr_spec.errors import AudioError, InputError, one_line
from asr_spec.models.presets import DEFAULT_PRESET, ModelPlan
from asr_spec.stream.decodes import StreamPrompt
from asr_spec.stream.driver import StreamRunner
from asr_spec.stream.policy import StreamOptions
from asr_spec.stream.policy import Update as StreamUpdate
from asr_spec.transcribe.alignment import Aligner, spoken_until_s
from asr_spec.transcribe.assembly import Assembler
from asr_spec.transcribe.fallback import Fallback
from asr_spec.transcribe.frontend import FrontEnd
from asr_spec.transcribe.inputs import (
    INPUT_ERRORS,
    Input,
    Progress,
    ProgressCallback,
    RunInput,
    name_outputs,
    run_inputs,
)
from asr_spec.transcribe.options import TranscribeOptions, check_batch_size
from asr_spec.transcribe.outputs import check_not_replacing, prepare_output_dir, write_outputs
from asr_spec.transcribe.prompts import InputPrompt, PromptOptions, encode_prompt, per_input, with_prompts
from asr_spec.transcribe.results import Transcription
from asr_spec.transcribe.segments import WordTiming
from asr_spec.transcribe.session import EngineSession, Finished
from asr_spec.transcribe.stitch import ChunkTokens
from asr_spec.transcribe.tail_runs import TailSource
from asr_spec.transcribe.tails import next_window_from, plan_tail, stride_tail
from asr_spec.transcribe.word_times import words_until

__all__ = ["Transcriber"]


class Transcriber:
    """Long-form transcription with lossless batched speculative decoding.

    target:    `WhisperForConditionalGeneration`, eval mode.
    draft:     None (greedy), a `WhisperForCausalLM` or a full Whisper model (see `Engine`); which runs it decodes
               is `options.decode.draft_max_rows` (see `asr_spec.models.presets.plan_models`).
    processor: `WhisperProcessor` of the target (tokenizer for text, feature extractor for log-mels).
    device:    where to run; default the target's device (the models are moved there).
    """

    def __init__(self, target: Any, draft: Any = None, processor: Any = None,
                 options: TranscribeOptions | None = None, device: str | torch.device | None = None):
        if processor is None or not hasattr(processor, "tokenizer") or not hasattr(processor, "feature_extractor"):
            raise InputError("processor must be the target's WhisperProcessor (tokenizer + feature extractor)")
        if options is None:
            options = TranscribeOptions()
        if not isinstance(options, TranscribeOptions):
            raise InputError(f"options must be a TranscribeOptions, got {type(options).__name__}")
        self.options = options
        if device is None:
            self.device = target.device
        else:
            self.device = torch.device(device)
        self.target = target.to(self.device)
        self.draft = None if draft is None else draft.to(self.device)
        self.processor = processor
        self.tokenizer = processor.tokenizer
        n_mels, wanted = processor.feature_extractor.feature_size, target.config.num_mel_bins
        if n_mels != wanted:
            raise InputError(f"the processor makes {n_mels} mel bins but the target expects {wanted}")
        features = FeatureBatcher(processor.feature_extractor, device=self.device, dtype=target.dtype)
        self.frontend = FrontEnd(self.options, features)
        try:  # checks the pair, the language and max_new_tokens against this model now
            self.engine = Engine(self.target, self.draft, self.options.decode)
        except ValueError as err:  # the engine's (it imports nothing of ours): what the caller asked of the model
            raise InputError(one_line(err)) from err
        self.tokens = self.engine.tokens
        self.assembler = Assembler(self.tokenizer, self.tokens, self.options)
        self._stream_engine: Engine | None = None  # live streams' engine (`streams`), made when first asked for
        self.aligner = None  # word timestamps: the teacher-forced pass over each finished chunk
        if self.options.word_timestamps:
            self.aligner = Aligner(self.target, self.tokens.eot, self.tokens.no_timestamps, self.assembler.pieces)

    # -- construction ---------------------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, model: str | os.PathLike, draft: str | os.PathLike | None = None, *,
                        device: str | torch.device | None = None, dtype: str | torch.dtype | None = None,
                        options: TranscribeOptions | None = None, share_encoder: bool | None = None,
                        **option_values: Any) -> Transcriber:
        """Load the target `model` (hub id, local or CTranslate2 directory, "embedded:whisper-base"), its processor
        and an optional `draft` (same forms). dtype None or "auto": `models.resolve_precision` (fp16 on CUDA; on a
        CPU bf16, int8 or fp32 by its class).
        `option_values` are flat `TranscribeOptions` names applied over `options`; share_encoder: see
        `asr_spec.models.loading.load_draft`."""
        from asr_spec.models import loading as models

        opts = TranscribeOptions.from_values(options, **option_values)  # bad options fail before any loading
        dev = models.resolve_device(device)
        precision = models.resolve_precision(dtype, dev)  # a torch dtype's name, or "int8" (fp32 weights)
        dt = models.torch_dtype(precision)
        target = models.load_model(model, dev, precision)
        processor = models.load_processor(model, target)
        draft_model = None if draft is None else models.load_draft(draft, target, dev, dt, share_encoder)
        return cls(target, draft_model, processor, opts, dev)

    @classmethod
    def from_preset(cls, name: str | os.PathLike = DEFAULT_PRESET, **overrides: Any) -> Transcriber:
        """Load the preset `name` (see `asr_spec.models.presets`) with overrides: `model`, `draft`, `dtype`,
        `device`, or any `TranscribeOptions` name (chunk_length_s, language, batch_size, ...).

        The preset's draft belongs to its model: overriding `model` without `draft` runs greedy decoding.
        `draft=None` turns the draft off. Which runs the draft decodes: `plan_models`.
        """
        plan, options = cls.plan_preset(name, **overrides)
        return cls.from_pretrained(plan.model, plan.draft, device=overrides.get("device"), dtype=plan.dtype,
                                   options=options, share_encoder=plan.share_encoder)

    @staticmethod
    def plan_preset(name: str | os.PathLike = DEFAULT_PRESET, **overrides: Any) -> tuple[ModelPlan, TranscribeOptions]:
        """What `from_preset(name, **overrides)` loads and the options it runs with, loading nothing: an unknown
        preset, option or device and a bad option value are found here (`InputError`), before any model loads."""
        from asr_spec.models.loading import resolve_device
        from asr_spec.models.presets import MODEL_KEYS, load_preset, plan_models

        preset = load_preset(name)
        unknown = sorted(set(overrides) - set(MODEL_KEYS) - set(TranscribeOptions.keys()))
        if unknown:
            known = ", ".join(MODEL_KEYS + TranscribeOptions.keys())
            raise InputError(f"unknown option(s) {', '.join(unknown)} (known: {known})")
        try:  # the one check of a preset's option values
            base = TranscribeOptions.from_values(**preset.option_values())
        except InputError as err:  # a value of the preset's own: name its file
            raise InputError(f"{preset.path or 'preset ' + preset.name}: {one_line(err)}") from err
        plan = plan_models(preset, resolve_device(overrides.get("device")).type, overrides)
        values = {key: value for key, value in overrides.items() if key not in MODEL_KEYS}
        values["draft_max_rows"] = plan.draft_max_rows
        if plan.num_draft_tokens is not None:  # the preset's K for this run's decode class; the caller's K wins
            values.setdefault("num_draft_tokens", plan.num_draft_tokens)
        return plan, TranscribeOptions.from_values(base, **values)  # the caller's values: their message as is

    # -- public entry points -------------------------------------------------------------------------------------
    def transcribe(self, audio: Any, *, batch_size: int | None = None, progress: bool | ProgressCallback | None = None,
                   output_dir: str | os.PathLike | None = None, **prompts: Any) -> list[Transcription]:
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
        prompts:    initial_prompt, hotwords, prefix (see `asr_spec.transcribe.prompts`) for this call, over the
                    options' own: a text for every input, or a list of one per input (None: the options' value;
                    "": none).
        """
        return list(self.iter_transcribe(audio, batch_size=batch_size, progress=progress, output_dir=output_dir,
                                         **prompts))

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
                        output_dir: str | os.PathLike | None = None, **prompts: Any) -> Iterator[Transcription]:
        """`transcribe`, yielding each input's transcript (in input order) as soon as it and those before it are
        done: a long archive shows results, and writes files, while later inputs are still decoding."""
        rows = self.batch_rows(batch_size)
        inputs = run_inputs(audio, word_timestamps=self.aligner is not None)
        for item, options in zip(inputs, per_input(self.options.prompts, len(inputs), **prompts)):
            item.prompt = self.prompt_tokens(options)
        if output_dir is not None:  # before any work: names resolved, the folder usable, stale temp files gone
            name_outputs(inputs)
            check_not_replacing(output_dir, [item.stem for item in inputs], [item.file for item in inputs])
            prepare_output_dir(output_dir)
        bar = Progress(progress, inputs)
        next_out = 0
        session = EngineSession(self)
        requests = self.prepare(inputs, rows, session.keep_samples)
        if session.tails is not None:  # tails go into the same engine run: no more rows than chunks for them
            requests, rows = TailSource.rows(requests, rows)
        source = session.source(requests, {item.key: item.prompt for item in inputs}.get)
        if session.fallback is not None:  # failing windows are decoded again, best_of rows side by side
            rows = max(rows, min(self.batch_rows(batch_size), self.options.best_of))
        try:
            for result in session.run(source, rows):
                item = inputs[result.id.owner]
                alive = item is not None and item.error is None  # None: yielded already; error: reported
                self._collect(item, session.finish(result, item if alive else None), bar)
                while next_out < len(inputs) and inputs[next_out].complete:
                    yield self._finish(inputs[next_out], bar, output_dir)
                    # free its spans and results; `prepare`, reading the same list, is past it (it is complete)
                    inputs[next_out] = None  # type: ignore[call-overload]
                    next_out += 1
            for index in range(next_out, len(inputs)):  # inputs with no chunk left in the engine (failed ones)
                yield self._finish(inputs[index], bar, output_dir)
        finally:
            bar.close()

    def batch_rows(self, batch_size: int | None = None) -> int:
        """The engine rows of a run: `batch_size` (checked as the option is) or, when None, options.batch_size."""
        if batch_size is None:
            return self.options.batch_size
        check_batch_size(batch_size)
        return batch_size

    # -- live transcription (asr_spec/stream/) ---------------------------------------------------------------------
    def streams(self, options: StreamOptions | None = None, *, vad: bool = True, batch_size: int | None = None,
                offer_hypothesis: bool = True) -> StreamRunner:
        """Live streams sharing one engine (`asr_spec.stream.driver.StreamRunner`): open streams, feed them audio
        blocks, `pump()` for the updates. Decodes in timestamp mode (an engine of its own when this transcriber's
        options have timestamps off); vad: close utterances at silence (silero-vad); offer_hypothesis: offer each
        stream's previous hypothesis as the draft (off: plain re-decoding, the same text). Every re-decode carries
        the options' initial prompt and hotwords (`stream_prompt`)."""
        from asr_spec.stream.driver import silero_voices

        if self._stream_engine is None:
            decode = self.options.decode
            self._stream_engine = self.engine if decode.timestamps else Engine(
                self.target, self.draft, dataclasses.replace(decode, timestamps=True))
        session = EngineSession(self, self._stream_engine, live=True)
        runner = StreamRunner(session, self.frontend.features, self.tokenizer, options,
                              silero_voices() if vad else None, self.batch_rows(batch_size), offer_hypothesis)
        runner.decodes.prompt = self.stream_prompt()
        return runner

    def stream_prompt(self) -> StreamPrompt:
        """The previous text every live re-decode carries (`StreamDecodes.prompt`; the streams of `streams` and of
        the server): the options' initial prompt and hotwords as `prompt_tokens` gives them to an input's first
        window (one without a prefix: a stream forces its own committed words), with the model's limit they share
        with each re-decode's prefix. `InputError` for a prompt the model takes none of (see `prompt_tokens`)."""
        prompt = self.prompt_tokens()
        return StreamPrompt(() if prompt is None else prompt.previous, self.tokens.max_prompt_tokens)

    def stream(self, blocks: Iterable[Any], options: StreamOptions | None = None, *,
               vad: bool = True) -> Iterator[StreamUpdate]:
        """One live stream: each of `blocks` ((n,) float32 16 kHz mono, as it arrives) is fed, what is due decoded,
        and every update yielded (delta: newly committed text; the last one final, with the whole text)."""
        runner = self.streams(options, vad=vad, batch_size=1)
        stream = runner.open()
        for block in blocks:
            stream.feed(block)
            yield from (update for _, update in runner.pump())
        stream.finish()
        while not stream.done:
            updates = runner.pump()
            if not updates:
                raise RuntimeError("stream: finished but no final update came")  # a bug of the policy
            yield from (update for _, update in updates)

    # -- the pipeline's stages, public: the server runs them too --------------------------------------------------
    def prepare(self, inputs: Iterable[Input], batch_size: int | None = None,
                keep_samples: dict | None = None) -> Iterator[ChunkRequest]:
        """The front half, lazily: every input decoded, chunked and featurised (see `FrontEnd.prepare`), batched
        as `transcribe` batches it for `batch_size` rows (default options.batch_size). Request ids are
        (input.key, chunk index); an input with word_timestamps has its chunks keep their encoder output, and one
        with a `prompt` (`prompt_tokens`) has its chunks carry it (prompts.py: which chunk gets what).
        keep_samples: each chunk's samples are put there under its request id (a `TailSource`'s samples, for
        tail repair)."""
        prompts: dict = {}

        def noted(items: Iterable[Input]) -> Iterator[Input]:
            for item in items:
                prompts[item.key] = item.prompt
                yield item

        requests = self.frontend.prepare(noted(inputs), self.batch_rows(batch_size), keep_samples)
        return with_prompts(requests, prompts.get)

    def prompt_tokens(self, options: PromptOptions | None = None) -> InputPrompt | None:
        """An input's prompts as token ids for `Input.prompt` (`options` None: the options' own); None when there
        are none."""
        options = self.options.prompts if options is None else options
        if options.empty:
            return None
        if self.tokens.sot_prev is None and (options.initial_prompt or options.hotwords):
            raise InputError("initial_prompt/hotwords: the model's generation config has no prev_sot_token_id "
                             "(<|startofprev|>), so it takes no prompt")
        return encode_prompt(options, self.tokenizer, self.tokens.max_prompt_tokens)

    def finish_chunk(self, result: ChunkResult,
                     span: ChunkSpan) -> tuple[ChunkResult, list[list[WordTiming]] | None]:
        """A finished chunk, ready to keep until its input is assembled: the result without its encoder output
        (n_audio_ctx x d_model values a chunk, not held longer than needed) and, when its request kept that
        output (word timestamps), the words of each of its segments in file time (`assemble`'s chunk_words).
        Call it from the engine's thread (the alignment pass hooks the target's decoder)."""
        if result.encoded is None:
            return result, None
        if self.aligner is None:
            raise InputError("word timestamps are off: set word_timestamps (with chunking 'vad')")
        segments = self.assembler.stitch([ChunkTokens(result.tokens, span)]).segments
        speech = (span.speech, SPEECH_FRAME_S) if isinstance(span, SpeechSpan) else None
        words = self.aligner.align(result.encoded, result.prompt, [s.token_ids for s in segments], span.n_samples,
                                   span.start_sample / SAMPLE_RATE, speech, result.tokens)
        return dataclasses.replace(result, encoded=None), words

    def assemble(self, source: str, spans: list[ChunkSpan], results: list[ChunkResult], audio_s: float,
                 wall_s: float, chunk_words: list[list[list[WordTiming]]] | None = None,
                 continues: list[bool] | None = None) -> Transcription:
        """The `Transcription` of one input from its chunks' spans and results, both in chunk order (see
        `Assembler.assemble`); chunk_words: per chunk, what `finish_chunk` gave, or None without words;
        continues: per chunk, whether it is a re-decoded tail of the one before (`tail_runs.with_tails`)."""
        return self.assembler.assemble(source, spans, results, audio_s, wall_s, chunk_words, continues)

    def tail_of(self, span: ChunkSpan, result: ChunkResult,
                samples: np.ndarray | None = None) -> tuple[SpeechSpan, tuple[int, ...]] | None:
        """The one tail-repair decision (tails.py): the part of a finished chunk (or tail) to decode again, as a
        span of its input, with the chunk's tokens before it; or None. result.id.attempt is the attempt that
        made it (at most options.tail_repairs per chunk); word timestamps do not enter it (the same
        chunks are repaired with and without them, tails.py). samples: the chunk's, for a stride window (its speech
        frames are computed from them only when its text ends early, `tails.stride_tail`); without them a stride
        window gets no tail."""
        if not self.options.decode.timestamps or result.id.attempt >= self.options.tail_repairs:
            return None
        margin_s, context_s = self.options.tail_margin_s, self.options.tail_context_s
        if result.id.attempt + 1 == self.options.tail_repairs:  # the last: no rewind into text twice decoded
            context_s = 0.0
        before = next_window_from(span, self.options.chunking.stride_left_samples)  # a stride window's (or tail's)
        if not isinstance(span, SpeechSpan):
            if samples is None:
                return None
            looping = self.options.no_speech.loops(self.assembler.decode(result.tokens))
            return stride_tail(span, result.tokens, self.tokens.eot, self.tokens.timestamp_begin, margin_s,
                               context_s, lambda: self.frontend.window_speech(samples), looping, before)
        return plan_tail(span, result.tokens, self.tokens.eot, self.tokens.timestamp_begin, margin_s, context_s,
                         before=before)

    def finish_result(self, result: ChunkResult, span: ChunkSpan, samples: np.ndarray | None = None,
                     ) -> tuple[ChunkResult, list[list[WordTiming]] | None, SpeechSpan | None]:
        """`finish_chunk`, then the tail decision (`tail_of`; samples: the chunk's, see there): the result to keep
        (when a tail follows, its tokens cut before it and its words to match, none timed past the timestamp
        closing its kept text: `word_times`), its words, and the tail to decode next (None: none). The engine
        session (`EngineSession.finish`) calls it for every finished chunk and tail of every client."""
        finished, words = self.finish_chunk(result, span)
        planned = self.tail_of(span, result, samples)
        if planned is None:
            return finished, words, None
        tail, kept = planned
        finished = dataclasses.replace(finished, tokens=kept)
        if words is not None:  # the parent keeps the words of the segments it keeps, up to where its kept text closes
            words = words[: len(self.assembler.stitch([ChunkTokens(kept, span)]).segments)]
            until_s = spoken_until_s(kept, self.tokens.eot, self.tokens.timestamp_begin)
            words = words_until(words, span.start_sample / SAMPLE_RATE + until_s)
        return finished, words, tail

    def fallback(self, schedule: Callable[[Hashable], tuple[float, ...]] | None = None) -> Fallback | None:
        """The temperature fallback of one engine run (fallback.py): `Fallback.run` wraps the run's source and
        `Fallback.resolve` filters its results. schedule: a window's temperatures from its request id (the server
        gives each request's); default options.temperature for every window, and then None when that is greedy
        only ((0,): nothing to wrap)."""
        if schedule is None:
            if self.options.temperature == (0.0,):
                return None
            schedule = functools.partial(_same_schedule, self.options.temperature)
        return Fallback(schedule, self.options.no_speech, self.assembler.decode, self.tokens.eot,
                        self.options.best_of, self.options.seed, self.tokens.language_in)

    # -- one run's bookkeeping ------------------------------------------------------------------------------------
    def tail_source(self) -> TailSource | None:
        """A source of re-decoded tails (tails.py) for one engine run, when they apply (timestamp mode,
        tail_repairs > 0), else None; an `EngineSession` keeps one for all its runs."""
        if not self.options.decode.timestamps or not self.options.tail_repairs:
            return None
        return TailSource(self.frontend.features, self.tokens.language_in)

    @staticmethod
    def _collect(item: RunInput | None, finished: Finished | None, bar: Progress) -> None:
        """Keep a finished chunk's (or tail's) result and words with its input (None: the input failed and was
        reported) and count a chunk's audio as done."""
        if finished is not None and finished.keep(item):
            item.progress_s += finished.kept_s
            bar.advance(finished.kept_s)

    def _finish(self, item: RunInput, bar: Progress, output_dir: str | os.PathLike | None) -> Transcription:
        """The transcript of a complete input (or its error), written to `output_dir` when given."""
        bar.settle(item)
        wall_s = time.perf_counter() - item.started
        if item.error is not None:
            return Transcription(item.name, "", (), None, None, item.audio_s, wall_s, (), error=item.error)
        spans, results, words, continues = item.in_order()
        transcription = self.assemble(item.name, spans, results, item.audio_s, wall_s, words, continues)
        if output_dir is None:
            return transcription
        try:
            write_outputs(transcription, output_dir, item.stem, self.options.formats, self.options.cues,
                          source=item.file)
        except INPUT_ERRORS as err:
            cause = one_line(err)
            return dataclasses.replace(transcription, error=f"cannot write outputs to {output_dir} ({cause})")
        return transcription


def _same_schedule(schedule: tuple[float, ...], _chunk_id: Hashable) -> tuple[float, ...]:
    """Every window's temperatures: `schedule` (a run of one `TranscribeOptions`)."""
    return schedule
