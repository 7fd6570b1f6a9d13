"""What a transcription returns: per input a `Transcription`, per chunk a `ChunkReport` (plain frozen dataclasses,
serialised as they are into the json output)."""

from __future__ import annotations

from dataclasses import dataclass

from asr_spec.engine import ChunkStats
from asr_spec.transcribe.segments import Segment

__all__ = ["ChunkReport", "Transcription"]


@dataclass(frozen=True)
class ChunkReport:
    """Where one chunk lies in its input and how its decoding went."""

    start_s: float  # file time of the chunk's first sample
    end_s: float  # file time one past its last sample
    language: str | None  # the language it was decoded in ("en"), detected or given
    finish_reason: str  # "eos", or "length" when the token limit cut it
    stats: ChunkStats
    no_speech_prob: float = float("nan")  # the target's P(<|nospeech|>) at the window's start; NaN: not computed
    avg_logprob: float = float("nan")  # mean log-probability of its tokens (Whisper's avg_logprob)
    dropped: str | None = None  # why its text was left out ("no speech": Whisper's no-speech rule); None: kept
    tail: bool = False  # a re-decoded tail of the chunk before it (tails.py): its speech went on past its text
    temperature: float = 0.0  # the temperature its kept text was decoded at (0: greedy; fallback.py)


@dataclass(frozen=True)
class Transcription:
    """The transcript of one input, or why there is none (`error`)."""

    source: str  # the path as given, or "<array 3>" for the fourth input when it is not a file
    text: str
    segments: tuple[Segment, ...]  # file times in seconds, non-overlapping, in order
    language: str | None  # the language most chunks were decoded in
    stats: ChunkStats | None  # summed over the chunks; None when the input failed
    audio_s: float  # seconds of audio read (all of it, unless it failed part-way)
    wall_s: float  # seconds from reading the input's first block to its transcript (its latency in the batch)
    chunks: tuple[ChunkReport, ...]
    timestamped: bool = False  # segment times from Whisper's timestamp tokens, not from chunk boundaries
    error: str | None = None  # the cause, one line, when the input could not be transcribed
    chunk_tokens: tuple[tuple[int, ...], ...] = ()  # each chunk's generated token ids, exactly as decoded
    redecoded_tails: int = 0  # chunk tails decoded again because their speech went on past their text (tails.py)
    # temperature fallback (fallback.py): (temperature, windows decoded again at it) for each temperature of the
    # schedule after its first; empty without fallback
    fallback_windows: tuple[tuple[float, int], ...] = ()

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def n_dropped(self) -> int:
        """Windows whose text was left out by the no-speech rule."""
        return sum(chunk.dropped is not None for chunk in self.chunks)
