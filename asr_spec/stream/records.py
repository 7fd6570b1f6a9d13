"""What a stream's policy asks for and what it gives back (`policy.StreamPolicy`): a `Decode` to run, an `Update`
per result. Plain records, no behaviour; `asr_spec.stream.policy` re-exports both."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Decode", "Update"]


@dataclass(frozen=True, eq=False)
class Decode:
    """A decode the stream asks for: `audio` from stream time `start_s`, `prefix` forced after <|0.00|> (the
    committed words of the buffer: `ChunkRequest.prefix`), `hypothesis` offered as the draft of what follows.

    kind: "step" (a periodic re-decode), "overflow" (the buffer is full: trimmed by force after it) or "close"
    (silence or the end of the input: everything it returns is committed). heard_s: the stream's audio received
    when it was asked for (the time its update describes).
    """

    serial: int
    audio: np.ndarray
    hypothesis: tuple[int, ...]
    kind: str
    start_s: float
    heard_s: float
    prefix: tuple[int, ...] = ()


@dataclass(frozen=True)
class Update:
    """What one result changed. delta: text newly committed (Whisper's spacing, a leading space per word);
    tentative: the rest of the latest hypothesis, not committed (may change); text: everything committed so far;
    final: the stream is over and `text` is its whole transcript; heard_s: stream audio heard when asked."""

    delta: str
    tentative: str
    text: str
    final: bool
    heard_s: float
