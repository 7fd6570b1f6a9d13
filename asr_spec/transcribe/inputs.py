"""The inputs of a transcription and the progress over them: what each source is called, where its transcript
files go, how much audio it holds (for the bar), and what is known about it while its chunks are decoded.

`Input` is what the front half (`Transcriber.prepare`) reads and fills in, and what came back for its chunks (the
engine session, session.py, keeps it); the server makes one per request. `RunInput` adds what
`Transcriber.iter_transcribe` keeps for its outputs and progress bar.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from asr_spec.audio.chunking import ChunkSpan
from asr_spec.audio.loading import SAMPLE_RATE, audio_duration_s
from asr_spec.audio.vad import SpeechSpan
from asr_spec.chunk_id import ChunkId
from asr_spec.engine import ChunkResult
from asr_spec.errors import AsrSpecError, InputError
from asr_spec.transcribe.outputs import output_stems
from asr_spec.transcribe.prompts import InputPrompt
from asr_spec.transcribe.segments import WordTiming
from asr_spec.transcribe.tail_runs import TailBook

__all__ = ["INPUT_ERRORS", "Input", "Progress", "ProgressCallback", "RunInput", "expected_s", "name_outputs",
           "run_inputs"]

# Errors caused by one input (unreadable, corrupt, NaN, unwritable output): reported on it; anything else propagates.
INPUT_ERRORS = (AsrSpecError, ValueError, OSError)
ProgressCallback = Callable[[float, float], None]  # (done_s, total_s), seconds of audio


@dataclass(eq=False)
class Input:
    """One source as the front half reads it (`Transcriber.prepare` fills in `spans` .. `exception`) and what came
    back for its chunks (`keep`)."""

    key: Hashable  # its chunks' request ids are `ChunkId(key, chunk index)`
    name: str  # the path as given, or "<array 3>"; error causes leave it out (the caller names the input)
    source: Any  # a path (streamed block by block), an array, a tensor or a dict (see `load_audio`)
    word_timestamps: bool = False  # its chunks keep their encoder output for the alignment (keep_encoded)
    prompt: InputPrompt | None = None  # its prompts as token ids (`Transcriber.prompt_tokens`); None: none
    spans: list[ChunkSpan] = field(default_factory=list)  # its chunks so far, in order
    n_samples: int = 0  # 16 kHz samples read so far
    # reading stops with `AudioTooLong` once more than this many samples are read (None: no limit): a server's
    # --max-audio-s for a file whose header does not say its length (checked as each block is read, not as each
    # chunk comes out: hours of silence make no chunk, and were read to the end in the engine's thread)
    max_samples: int | None = None
    started: float = 0.0  # time.perf_counter() when its first block was asked for
    read_done: bool = False  # every chunk made (or reading failed)
    error: str | None = None  # the cause, one line, when it could not be read; its chunks are to be ignored
    exception: BaseException | None = None  # the exception behind `error`
    results: dict[int, ChunkResult] = field(default_factory=dict)  # by chunk index, without encoder outputs
    words: dict[int, list[list[WordTiming]]] = field(default_factory=dict)  # by chunk index, per segment
    repairs: TailBook = field(default_factory=TailBook)  # its re-decoded tails (tail_runs.py)

    @property
    def audio_s(self) -> float:
        """Seconds of audio read (all of it, unless reading failed part-way)."""
        return self.n_samples / SAMPLE_RATE

    @property
    def decoded(self) -> bool:
        """Every chunk made so far, and every tail queued, is back."""
        return len(self.results) == len(self.spans) and self.repairs.pending == 0

    def keep(self, chunk_id: ChunkId, result: ChunkResult, words: list[list[WordTiming]] | None,
             tail: SpeechSpan | None) -> bool:
        """Keep a finished chunk's (or tail's) result and words (`Transcriber.finish_result`'s), and note the tail
        to decode after it; True when it was a chunk (not a tail)."""
        if tail is not None:
            self.repairs.add(chunk_id.index, tail)
        if self.repairs.arrived(chunk_id, result, words):
            return False
        self.results[chunk_id.index] = result
        if words is not None:
            self.words[chunk_id.index] = words
        return True

    def in_order(self) -> tuple[list[ChunkSpan], list[ChunkResult], list | None, list[bool]]:
        """`Transcriber.assemble`'s spans, results, chunk_words (None without word timestamps) and continues:
        its chunks, in order, each followed by its re-decoded tails."""
        n = len(self.spans)
        words = [self.words.get(i) for i in range(n)] if self.word_timestamps else None
        ordered, continues = self.repairs.in_order(self.spans, [self.results[i] for i in range(n)], words)
        ordered_words = None if words is None else [w for _, _, w in ordered]
        return [d[0] for d in ordered], [d[1] for d in ordered], ordered_words, continues


@dataclass(eq=False)
class RunInput(Input):
    """An input of one `iter_transcribe` run: its outputs' name and what came back for its chunks."""

    stem: str = ""  # output files are <stem>.<format>
    expected_s: float = 0.0  # progress estimate (header duration); 0 when unknown
    progress_s: float = 0.0  # seconds of it already counted into the progress bar

    @property
    def complete(self) -> bool:
        return self.read_done and (self.error is not None or self.decoded)

    @property
    def file(self) -> str | None:
        """The file it names (a path, or a dict's "path"); None for audio in memory ("<array 3>")."""
        return None if self.name.startswith("<") else self.name


def run_inputs(audio: Any, word_timestamps: bool = False) -> list[RunInput]:
    """One `RunInput` per source: a path, array, tensor or dict is one input; a list or tuple holds several.
    Input i has key i and stem "input-i" (see `name_outputs`)."""
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
        out.append(RunInput(i, name, src, word_timestamps, stem=f"input-{i}"))
    return out


def name_outputs(inputs: list[RunInput]) -> None:
    """Give every input a distinct output stem (see `output_stems`); InputError for the same file twice. An input
    in memory keeps "input-i" unless a file has that stem; then it is "input-i-memory" (a file "input-1.wav" and
    an array as the second input both wrote input-1.txt: one transcript lost, both reported done)."""
    stems = output_stems([item.file for item in inputs])
    taken = {stem for stem in stems if stem is not None}
    for item, stem in zip(inputs, stems):
        if stem is not None:
            item.stem = stem
            continue
        while item.stem in taken:
            item.stem += "-memory"
        taken.add(item.stem)


class Progress:
    """Seconds of audio done: a tqdm bar on stderr (by default only when stderr is a terminal) or a callback."""

    def __init__(self, progress: bool | ProgressCallback | None, inputs: list[RunInput]):
        if not (progress is None or isinstance(progress, bool) or callable(progress)):
            raise InputError(f"progress must be None, True, False or a callable, got {type(progress).__name__} "
                             f"{progress!r:.40}")  # "yes" or 1 ran with no bar, said nothing
        self.callback = progress if callable(progress) else None
        if progress is None:
            show_bar = sys.stderr.isatty()
        else:
            show_bar = progress is True
        self.done_s = 0.0
        self.total_s = 0.0
        self.bar = None
        if show_bar or self.callback is not None:
            for item in inputs:
                item.expected_s = expected_s(item.source)
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

    def settle(self, item: RunInput) -> None:
        """Count the rest of an input's expected share once it is done (a failed or mis-estimated input)."""
        self.advance(item.expected_s - item.progress_s)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def expected_s(source: Any) -> float:
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
