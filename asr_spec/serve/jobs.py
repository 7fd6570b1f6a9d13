"""A request's job in the server: the chunks of one upload, what came back for them, and the errors a request
can end in (`Busy`, `Refused`); the batcher (batcher.py) feeds jobs to the engine."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from asr_spec.audio.chunking import ChunkSpan
from asr_spec.checks import int_at_least, positive_seconds
from asr_spec.engine import ChunkRequest, ChunkResult
from asr_spec.errors import AudioError, InputError
from asr_spec.transcribe.inputs import Input

__all__ = ["Busy", "Job", "Refused", "check_limits", "close_reader"]

log = logging.getLogger(__name__)


class Busy(InputError):
    """The server has `max_requests` jobs or `max_audio_in_flight_s` seconds of audio in flight: retry later."""


class Refused(AudioError):
    """An upload the server will not transcribe; `status` is the HTTP answer (400 unreadable, 413 too long)."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


def close_reader(requests: Iterator[ChunkRequest]) -> None:
    """Close a job's reader (its file handle, its VAD state); not while another thread runs it."""
    close = getattr(requests, "close", None)
    if close is not None:
        try:
            close()
        except ValueError:  # "generator already executing": the engine thread is in it, it ends the job itself
            log.warning("a reader was still running when its job ended")


@dataclass(eq=False)
class Job:
    """The chunks of one request and what came back for them.

    input:      what the front half fills in (spans so far, samples read, read_done, error) and what came back
                for its chunks and tails (`Input.keep`); its word_timestamps: the request asked for words.
    requests:   the input's lazy engine requests (`Transcriber.prepare`), pulled one chunk at a time; `pending` is
                the one `Batcher.prepare` pulled to open the upload.
    status:     the HTTP status of `error`: 400 unreadable audio, 413 too long, 500 the engine failed.
    reserved_s: seconds of the server's audio budget this job holds until it ends.
    on_done:    called once, from the engine thread (or `submit`, for an input without chunks), when the job is
                complete or failed; it must not block.
    temperature: its windows' temperature schedule (fallback.py); None: the transcriber's options.temperature.
    """

    input: Input
    requests: Iterator[ChunkRequest]
    pending: ChunkRequest | None = None
    reserved_s: float | None = None  # None: not admitted (a caller of `prepare` that skipped `admit`)
    on_done: Callable[[Job], None] = field(default=lambda job: None)
    error: str | None = None
    status: int = 200
    cancelled: bool = False
    finished: bool = False
    ended: bool = False  # its reader closed and its budget given back
    started: float = field(default_factory=time.perf_counter)
    temperature: tuple[float, ...] | None = None

    @property
    def id(self) -> Any:
        return self.input.key

    @property
    def spans(self) -> list[ChunkSpan]:
        return self.input.spans

    @property
    def audio_s(self) -> float:
        return self.input.audio_s

    @property
    def results(self) -> dict[int, ChunkResult]:
        """Its chunks' results so far, by chunk index."""
        return self.input.results

    @property
    def complete(self) -> bool:
        """Every chunk read and decoded."""
        return self.input.read_done and self.pending is None and self.input.decoded

    def ordered_results(self) -> list[ChunkResult]:
        return [self.results[i] for i in range(len(self.spans))]

    def in_order(self) -> tuple[list[ChunkSpan], list[ChunkResult], list | None, list[bool]]:
        """`Transcriber.assemble`'s spans, results, chunk_words and continues: its chunks with their tails."""
        return self.input.in_order()


def check_limits(max_requests: int, max_audio_in_flight_s: float) -> None:
    """max_requests is an integer >= 1 and max_audio_in_flight_s a positive number of seconds, else `InputError`."""
    int_at_least(max_requests, "max_requests", 1)
    positive_seconds(max_audio_in_flight_s, "max_audio_in_flight_s", finite_only=False)
