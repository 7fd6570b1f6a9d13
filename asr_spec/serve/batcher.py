"""One engine, one continuous batch, many requests: the engine thread and the queue of chunks that feeds it.

    request bytes ──prepare (a worker thread)──► Job(spans, features) ──submit──► queue of chunks
    queue ──live source──► Engine.run (its own thread) ──ChunkResult──► the job's results ──last one──► done

Each request's audio is decoded, chunked and featurised off the event loop (`prepare`); its chunks then wait in one
queue with every other request's, and the engine pulls them as rows free up, so a row that finishes takes the next
chunk, whoever sent it. The queue is the engine's live source: it yields None when empty (after waiting briefly
when no chunk is in the engine, so an idle server does not spin). A job is done when its last chunk is; the caller
gets the results in chunk order and assembles the transcript. A job that wants word timestamps has its chunks
encoded in the engine thread when its first chunk is pulled (the encoder output is kept), and each chunk is
aligned there as it finishes, as `Transcriber.transcribe` does. Cancelling a job drops its chunks still queued; an
engine error fails the jobs whose chunks it lost (`EngineError.chunk_ids`) and the engine starts a new run.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from asr_spec.audio.chunking import ChunkSpan
from asr_spec.audio.loading import SAMPLE_RATE, load_audio
from asr_spec.engine import ChunkRequest, ChunkResult, EngineError
from asr_spec.engine.memory import MAX_ENCODE_BATCH
from asr_spec.errors import AsrSpecError, AudioError, InputError, one_line
from asr_spec.serve.metrics import Metrics
from asr_spec.transcribe.alignment import WordTiming

__all__ = ["Batcher", "Job", "QueueFull"]

log = logging.getLogger(__name__)
IDLE_WAIT_S = 0.05  # how long the source waits for a chunk when the engine is idle, before it says None


class QueueFull(AsrSpecError):
    """The queue of chunks is full: try again later (HTTP 503 with Retry-After)."""


@dataclass(eq=False)
class Job:
    """One request: its chunks' spans and features, and what came back for them.

    features: (n_chunks, n_mels, n_frames) log-mel, one row per span.
    words:    None, or the words of each finished chunk (`Transcriber.align_chunk`) by chunk index: set it to {}
              to have them computed (needs the transcriber's word_timestamps).
    on_done:  called once, from the engine thread (or `submit` for an empty input), when the job is complete or
              failed; it must not block.
    """

    spans: list[ChunkSpan]
    features: Any
    audio_s: float
    on_done: Callable[[Job], None] = lambda job: None
    words: dict[int, list[list[WordTiming]]] | None = None
    encoded: Any = None  # (n_chunks, n_audio_ctx, d_model) target encoder output, kept for the alignment
    id: int = field(default_factory=itertools.count().__next__)
    results: dict[int, ChunkResult] = field(default_factory=dict)
    error: str | None = None
    cancelled: bool = False
    finished: bool = False
    in_engine: int = 0  # chunks pulled by the engine and not finished
    started: float = field(default_factory=time.perf_counter)

    def ordered_results(self) -> list[ChunkResult]:
        return [self.results[i] for i in range(len(self.spans))]

    def ordered_words(self) -> list[list[list[WordTiming]]] | None:
        """`Transcriber.assemble`'s chunk_words: per chunk, the words of each of its segments; None without."""
        return None if self.words is None else [self.words[i] for i in range(len(self.spans))]


def check_sizes(batch_size: int, max_queue: int) -> None:
    """batch_size (engine rows) and max_queue (chunks waiting) are integers >= 1, else `InputError`."""
    for name, value in (("batch_size", batch_size), ("max_queue", max_queue)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InputError(f"{name} must be an integer >= 1, got {value!r}")


class Batcher:
    """Feeds the chunks of many jobs to one `Engine` running in its own thread.

    transcriber: an `asr_spec.transcribe.Transcriber` (its engine, chunking options and feature batcher are used).
    batch_size:  engine rows; max_queue: chunks that may wait for a row before `submit` refuses a job.
    """

    def __init__(self, transcriber: Any, batch_size: int = 8, max_queue: int = 256, metrics: Metrics | None = None):
        check_sizes(batch_size, max_queue)
        self.transcriber, self.batch_size, self.max_queue = transcriber, batch_size, max_queue
        self.metrics = Metrics(batch_size) if metrics is None else metrics
        self._queue: deque[tuple[Job, int]] = deque()  # (job, chunk index)
        self._jobs: dict[int, Job] = {}  # jobs with a chunk queued or in the engine
        self._in_engine = 0  # chunks pulled by the engine and not yet finished
        self._cond = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None

    # -- preparing a request (any thread but the engine's) ----------------------------------------------------
    def prepare(self, data: bytes, name: str = "upload") -> tuple[list[ChunkSpan], Any, float]:
        """Decode, chunk (as the transcriber does: `Transcriber.chunk_audio`) and featurise encoded audio:
        (spans, (n_chunks, n_mels, n_frames) features, seconds). A file that is not audio raises `AudioError`
        (one line, naming `name`)."""
        try:
            samples = load_audio({"bytes": data})
        except AudioError as err:  # load_audio calls a bytes source "<dict>": name the upload instead
            raise AudioError(f"{name}: {one_line(err, '<dict>')}") from err
        pieces = list(self.transcriber.chunk_audio([samples]))
        spans = [span for span, _ in pieces]
        if not pieces:
            return [], None, 0.0
        features = torch.cat([self.transcriber.features([s for _, s in pieces[i:i + self.batch_size]])
                              for i in range(0, len(pieces), self.batch_size)])
        return spans, features, len(samples) / SAMPLE_RATE

    # -- the queue ------------------------------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        """Queue the job's chunks behind everyone else's; `QueueFull` when max_queue chunks already wait."""
        if job.words is not None and self.transcriber.aligner is None:
            raise InputError("word timestamps are off on this server (they need the transcriber's word_timestamps)")
        if not job.spans:
            self._finish(job)
            return
        with self._cond:
            if self._queue and len(self._queue) + len(job.spans) > self.max_queue:
                raise QueueFull(f"{len(self._queue)} chunks are waiting (max {self.max_queue}): try again later")
            self._jobs[job.id] = job
            self._queue.extend((job, i) for i in range(len(job.spans)))
            self.metrics.queue_depth = len(self._queue)
            self._cond.notify_all()

    def cancel(self, job: Job) -> int:
        """Drop the job's chunks still waiting (a client went away); returns how many. Its chunks already in the
        engine finish there and are ignored."""
        with self._cond:
            job.cancelled = True
            before = len(self._queue)
            self._queue = deque(item for item in self._queue if item[0] is not job)
            self.metrics.queue_depth = len(self._queue)
            if job.id in self._jobs and not job.in_engine:  # nothing of it in the engine either
                del self._jobs[job.id]
            return before - len(self._queue)

    @property
    def alive(self) -> bool:
        """The engine thread is running."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    def _source(self) -> Iterator[ChunkRequest | None]:
        """The engine's live source: the next queued chunk, or None when there is none right now."""
        while True:
            with self._cond:
                if not self._queue and not self._stopping and self._in_engine == 0:
                    self._cond.wait(IDLE_WAIT_S)
                if self._stopping:
                    return
                job = None
                if self._queue:
                    job, index = self._queue.popleft()
                    job.in_engine += 1
                    self._in_engine += 1
                    self.metrics.queue_depth = len(self._queue)
                self.metrics.engine_chunks = self._in_engine
            yield None if job is None else self._request(job, index)

    def _request(self, job: Job, index: int) -> ChunkRequest:
        """The engine's request for chunk `index` of `job` (in the engine thread); a job that wants words has all
        its chunks encoded at its first (`Engine.encode`), as `Transcriber` does, and keeps the output."""
        if job.words is not None and job.encoded is None:
            job.encoded = self.transcriber.engine.encode(job.features, MAX_ENCODE_BATCH)
        encoded = None if job.encoded is None else job.encoded[index]
        return ChunkRequest((job.id, index), job.features[index], encoded)

    # -- the engine thread ----------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="asr-spec-engine", daemon=True)
            self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Let the engine finish the chunks it holds, then fail the jobs still waiting (the server is going)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)
        with self._cond:
            left = list(self._jobs.values())
            self._jobs.clear()
            self._queue.clear()
        for job in left:
            job.error = "the server is shutting down"
            self._finish(job)

    def _serve(self) -> None:
        engine = self.transcriber.engine_for(self.batch_size)
        while not self._stopping:
            try:
                for result in engine.run(self._source(), self.batch_size):
                    self._deliver(result)
            except EngineError as err:
                log.error("%s", err)
                self._fail(set(err.chunk_ids), str(err.__cause__ or err))
            except Exception as err:  # a bug outside the engine's own work: fail what is in flight, keep serving
                log.exception("engine thread")
                with self._cond:
                    lost = {(job.id, i) for job in self._jobs.values() for i in range(len(job.spans))
                            if i not in job.results}
                    lost -= {(job.id, i) for job, i in self._queue}
                self._fail(lost, f"{type(err).__name__}: {err}")

    def _deliver(self, result: ChunkResult) -> None:
        job_id, index = result.id
        job = self._jobs.get(job_id)
        if job is not None and job.words is not None and not job.cancelled:  # in the engine thread, like transcribe
            job.words[index] = self.transcriber.align_chunk(result, job.spans[index], job.encoded[index])
        with self._cond:
            self._in_engine -= 1
            self.metrics.engine_chunks = self._in_engine
            job = self._jobs.get(job_id)
            if job is None:
                return
            job.in_engine -= 1
            job.results[index] = result
            self.metrics.chunk_done(result.stats)
            done = len(job.results) == len(job.spans)
            if done or (job.cancelled and not job.in_engine):
                del self._jobs[job_id]
        if done and not job.cancelled:
            self._finish(job)

    def _fail(self, chunk_ids: set, cause: str) -> None:
        """Fail every job that lost a chunk in `chunk_ids`; its chunks still queued are dropped."""
        with self._cond:
            failed = {self._jobs[job_id] for job_id, _ in chunk_ids if job_id in self._jobs}
            self._in_engine = 0  # the run is over: nothing is in the engine any more
            self._queue = deque(item for item in self._queue if item[0] not in failed)
            self.metrics.queue_depth = len(self._queue)
            for job in failed:
                del self._jobs[job.id]
                job.error = f"decoding failed ({cause})"
        for job in failed:
            self._finish(job)

    @staticmethod
    def _finish(job: Job) -> None:
        """Mark the job done and tell its owner (nobody is listening to a cancelled one)."""
        if job.cancelled:
            return
        job.finished = True
        try:
            job.on_done(job)
        except Exception:  # a callback's bug must not stop the engine thread
            log.exception("job %s: completion callback failed", job.id)
