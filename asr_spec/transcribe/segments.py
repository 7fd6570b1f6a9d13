"""The one segment type of a transcript, and the word timing a segment may carry (plain frozen dataclasses).

A `Segment` is made by stitching (`stitch.py`: file times and the merged text token ids), given its decoded text
and, with word timestamps, its words by the transcriber (`assembly.py`), returned in a `Transcription`
(`results.py`) and rendered by the writers (`outputs.py`). The writers read its times, text and words; the token
ids stay out of the transcript files (each chunk's ids are in `Transcription.chunk_tokens`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

__all__ = ["Segment", "TranscriptSegment", "WordTiming", "transcript_dict"]


@dataclass(frozen=True)
class WordTiming:
    """One word with file times in seconds (Whisper's json names)."""

    word: str  # as decoded, with its leading space
    start: float
    end: float
    probability: float  # mean probability of its tokens


@dataclass(frozen=True)
class Segment:
    """A stretch of transcript with file times in seconds; ``start_s <= end_s``.

    The field order is the json output's (start_s, end_s, text, words); token_ids come last and are not written.
    """

    start_s: float
    end_s: float
    text: str = ""  # the decoded text ("" straight out of stitching, which works on token ids only)
    words: tuple[WordTiming, ...] = ()  # with word timestamps: its words in order; else empty
    token_ids: tuple[int, ...] = ()  # its text tokens (no control or timestamp tokens)


def transcript_dict(segment: Segment) -> dict[str, Any]:
    """The segment as transcripts hold it (json files, the distributed runner's records): `dataclasses.asdict`
    without its token ids."""
    out = dataclasses.asdict(segment)
    del out["token_ids"]
    return out


# The name `asr_spec` exports for the segments of a `Transcription`: the same type.
TranscriptSegment = Segment
