"""The engine-thread side of live streams (`/v1/realtime`): their re-decodes join the uploads' chunks in the
server's one engine run, so streams and uploads share rows (continuous batch).

    session (event loop: policy fed with audio) ──submit(stream, audio, hypothesis)──► StreamQueue: one pending
    re-decode per stream ──take (engine thread: featurised now)──► Engine.run ──ChunkResult──► deliver
    ──stream.on_result (engine thread; the session hops back to its loop)──► policy.accept ──► events

A stream holds at most one re-decode waiting and one in the engine: a newer one replaces the waiting one (the
policy's buffer has grown; the old request is stale), so memory per stream is one window of samples and its
features. `open` refuses past `max_streams` (`TooManyStreams`). `close` (the client went away, or the stream
ended) drops its waiting re-decode and withdraws the one in the engine, whose row the engine frees before its next
step (`Engine.withdraw`); a result that still comes back for it is ignored. The batcher alternates re-decodes
with the uploads' chunks when both wait, so neither starves the other.

Request ids are `ChunkId(StreamKey(stream id), re-decode number)`: `deliver` routes results by that owner, so
the batcher's upload jobs never see them.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from asr_spec.checks import int_at_least
from asr_spec.chunk_id import ChunkId, StreamKey
from asr_spec.engine import ChunkRequest, ChunkResult
from asr_spec.errors import InputError

__all__ = ["LiveStream", "StreamQueue", "TooManyStreams", "is_stream_id"]

log = logging.getLogger(__name__)
_stream_ids = itertools.count()


class TooManyStreams(InputError):
    """The server has `max_streams` streams open: retry later."""


@dataclass(eq=False)
class LiveStream:
    """One open stream as the engine thread sees it.

    on_result: called from the engine thread with each re-decode's `ChunkResult`, or with an error message (str)
               when the engine lost it; it must not block (the session hands it to its event loop).
    """

    on_result: Callable[[ChunkResult | str], None]
    id: int = field(default_factory=lambda: next(_stream_ids))
    n_submitted: int = 0  # re-decodes submitted so far (the last element of their ids)
    in_engine: Any = None  # the request id of its re-decode in the engine, if any
    closed: bool = False


@dataclass(frozen=True)
class _Pending:
    stream: LiveStream
    request_id: ChunkId
    samples: np.ndarray  # (n_samples,) float32 16 kHz, at most one window
    hypothesis: tuple[int, ...]  # token ids offered as the re-decode's draft


class StreamQueue:
    """The streams' re-decodes waiting for the engine, and which stream each one in the engine belongs to.

    cond:        the batcher's condition: a submission wakes its idle source.
    featurise:   (samples list) -> (B, n_mels, n_frames) features (the transcriber's `FeatureBatcher`).
    withdraw:    the engine's `withdraw(request id)`: frees a row now.
    max_streams: open streams allowed at once.
    metrics:     the server's `Metrics`, whose stream gauges this keeps (None: none kept).
    """

    def __init__(self, cond: threading.Condition, featurise: Callable[[list[np.ndarray]], Any],
                 withdraw: Callable[[Any], None], max_streams: int = 16, metrics: Any = None):
        int_at_least(max_streams, "max_streams", 1)
        self.max_streams = max_streams
        self._cond = cond
        self._featurise = featurise
        self._withdraw = withdraw
        self._metrics = metrics
        self._n_in_engine = 0  # re-decodes taken by the engine and not yet back, withdrawn or lost
        self._open: dict[int, LiveStream] = {}
        self._waiting: OrderedDict[int, _Pending] = OrderedDict()  # by stream id, oldest first

    # -- the sessions' side (event loop thread) -------------------------------------------------------------
    def open(self, on_result: Callable[[ChunkResult | str], None]) -> LiveStream:
        """A new stream, else `TooManyStreams` naming the limit (--max-streams)."""
        with self._cond:
            if len(self._open) >= self.max_streams:
                raise TooManyStreams(f"{len(self._open)} streams are open (--max-streams {self.max_streams})")
            stream = LiveStream(on_result)
            self._open[stream.id] = stream
            self._publish()
            return stream

    def submit(self, stream: LiveStream, samples: np.ndarray, hypothesis: tuple[int, ...] = ()) -> None:
        """Queue a re-decode of `samples` ((n,) float32, 16 kHz, at most one window) for `stream`, replacing its
        waiting one if any; hypothesis: the stream's previous hypothesis of that audio, offered to the engine as
        the draft of the re-decode's first tokens (`ChunkRequest.hypothesis`)."""
        with self._cond:
            if stream.closed:
                return
            stream.n_submitted += 1
            request_id = ChunkId(StreamKey(stream.id), stream.n_submitted)
            self._waiting.pop(stream.id, None)
            self._waiting[stream.id] = _Pending(stream, request_id, samples, tuple(hypothesis))
            self._cond.notify_all()

    def close(self, stream: LiveStream) -> None:
        """The stream is over (ended, or its client went away): drop its waiting re-decode, free its engine row
        now, and give back its place under max_streams."""
        with self._cond:
            stream.closed = True
            self._waiting.pop(stream.id, None)
            self._open.pop(stream.id, None)
            in_engine, stream.in_engine = stream.in_engine, None
            if in_engine is not None:
                self._n_in_engine -= 1
            self._publish()
        if in_engine is not None:
            self._withdraw(in_engine)

    @property
    def n_open(self) -> int:
        return len(self._open)

    @property
    def n_waiting(self) -> int:
        return len(self._waiting)

    @property
    def n_in_engine(self) -> int:
        return self._n_in_engine

    @property
    def idle(self) -> bool:
        """No re-decode waits or is in the engine (the batcher's source may then wait for work)."""
        return not self._waiting and not self._n_in_engine

    # -- the engine thread's side ---------------------------------------------------------------------------
    def take(self) -> ChunkRequest | None:
        """The oldest waiting re-decode as an engine request (featurised now), or None when none waits."""
        with self._cond:
            if not self._waiting:
                return None
            _, pending = self._waiting.popitem(last=False)
            stale, pending.stream.in_engine = pending.stream.in_engine, pending.request_id
            self._n_in_engine += 1 if stale is None else 0  # a newer re-decode takes the place of a stale one
            self._publish()
        if stale is not None:
            self._withdraw(stale)
        features = self._featurise([pending.samples])[0]
        return ChunkRequest(pending.request_id, features, hypothesis=pending.hypothesis)

    def deliver(self, result: ChunkResult) -> bool:
        """Hand a result to its stream; False when `result` is not a stream's (an upload chunk's)."""
        if not is_stream_id(result.id):
            return False
        stream = self._in_engine(result.id)
        if stream is not None:
            _notify(stream, result)
        return True

    def fail(self, cause: str) -> None:
        """The engine's run failed: every re-decode in it is lost; tell their streams."""
        with self._cond:
            lost = [stream for stream in self._open.values() if stream.in_engine is not None]
            for stream in lost:
                stream.in_engine = None
            self._n_in_engine = 0
            self._publish()
        for stream in lost:
            _notify(stream, f"decoding failed ({cause})")

    def _in_engine(self, request_id: ChunkId) -> LiveStream | None:
        """The open stream whose re-decode in the engine is `request_id` (no longer in the engine after this)."""
        with self._cond:
            stream = self._open.get(request_id.owner.stream)
            if stream is None or stream.in_engine != request_id:
                return None
            stream.in_engine = None
            self._n_in_engine -= 1
            self._publish()
            return stream

    def stop(self, cause: str) -> None:
        """The server is going: tell every open stream."""
        with self._cond:
            streams = list(self._open.values())
            self._waiting.clear()
        for stream in streams:
            _notify(stream, cause)


    def _publish(self) -> None:
        """Under the lock: the stream gauges of the server's metrics."""
        if self._metrics is not None:
            self._metrics.streams_open = len(self._open)
            self._metrics.stream_redecodes = self._n_in_engine


def is_stream_id(request_id: Any) -> bool:
    """Whether an engine request id is a live stream's re-decode."""
    return isinstance(request_id, ChunkId) and isinstance(request_id.owner, StreamKey)


def _notify(stream: LiveStream, outcome: ChunkResult | str) -> None:
    try:
        stream.on_result(outcome)
    except Exception:  # a callback's bug must not stop the engine thread
        log.exception("stream %s: result callback failed", stream.id)
