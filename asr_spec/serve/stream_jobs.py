"""The server's side of live streams (`/v1/realtime`): the many-streams runner (`asr_spec.stream.decodes`) under
the batcher's lock, with the server's limit on open streams. Their re-decodes join the uploads' chunks in the
server's one engine run, so streams and uploads share rows (continuous batch).

    session (event loop: policy fed with audio) ──submit(stream, audio, hypothesis)──► StreamQueue
    ──take (engine thread: featurised now)──► EngineSession.run ──ChunkResult──► deliver
    ──stream.on_result (engine thread; the session hops back to its loop)──► policy.accept ──► events

`open` refuses past `max_streams` (`TooManyStreams`). The batcher takes the waiting re-decodes as a group
(`take_group`: encoded together) and alternates them with the uploads' chunks when both wait, so neither starves
the other; what is in the engine is the engine session's count.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from asr_spec.checks import int_at_least
from asr_spec.engine import ChunkResult
from asr_spec.errors import InputError
from asr_spec.stream.decodes import GROUP_WAIT_S, LiveStream, StreamDecodes, is_stream_id

__all__ = ["LiveStream", "StreamQueue", "TooManyStreams", "is_stream_id"]


class TooManyStreams(InputError):
    """The server has `max_streams` streams open: retry later."""


class StreamQueue(StreamDecodes):
    """The live streams of a server (see `StreamDecodes`), at most `max_streams` open at once.

    session:     the batcher's `EngineSession` (withdrawals, the count in flight).
    featurise:   (samples list) -> (B, n_mels, n_frames) features (the transcriber's `FeatureBatcher`).
    cond:        the batcher's condition: a submission wakes its idle source.
    max_streams: open streams allowed at once.
    group_wait_s: the longest a waiting re-decode is held for others to be encoded with it (`take_group`).
    clock:       seconds, for waits and holds (time.monotonic; a test's simulated clock).
    """

    def __init__(self, session: Any, featurise: Callable[[list[np.ndarray]], Any], cond: threading.Condition,
                 max_streams: int = 16, group_wait_s: float = GROUP_WAIT_S,
                 clock: Callable[[], float] = time.monotonic):
        int_at_least(max_streams, "max_streams", 1)
        super().__init__(session, featurise, cond, group_wait_s, clock)
        self.max_streams = max_streams

    def open(self, on_result: Callable[[ChunkResult | str], None]) -> LiveStream:
        """A new stream, else `TooManyStreams` naming the limit (--max-streams)."""
        with self._cond:
            if self.n_open >= self.max_streams:
                raise TooManyStreams(f"{self.n_open} streams are open (--max-streams {self.max_streams})")
            return super().open(on_result)
