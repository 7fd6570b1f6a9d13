"""One engine, one continuous batch, many requests: the engine thread and the queue of chunks that feeds it.

    request bytes ──prepare (a worker thread: Transcriber.prepare)──► Job(requests) ──submit──► queue of chunks
    queue ──live source──► Engine.run (its own thread) ──ChunkResult──► Transcriber.finish_chunk ──► the job's
    results ──last one──► done ──Transcriber.assemble (app.py)──► transcript

Each request's audio is decoded, chunked and featurised off the event loop by the transcriber's own front half
(`Transcriber.prepare`, batched as `transcribe` batches it); its chunks then wait in one queue with every other
request's, and the engine pulls them as rows free up, so a row that finishes takes the next chunk, whoever sent
it. The queue is the engine's live source: it yields None when empty (after waiting briefly when no chunk is in
the engine, so an idle server does not spin). A job is done when its last chunk is; the caller gets the results
in chunk order and assembles the transcript. A job that wants word timestamps has its chunks keep their encoder
output in the engine (`keep_encoded`), and each chunk is aligned in the engine thread as it finishes
(`Transcriber.finish_chunk`), as `Transcriber.transcribe` does. Cancelling a job drops its chunks still queued;
an engine error fails the jobs whose chunks it lost (`EngineError.chunk_ids`) and the engine starts a new run.
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

from asr_spec.audio.chunking import ChunkSpan
from asr_spec.engine import ChunkRequest, ChunkResult, EngineError, check_int
from asr_spec.errors import AsrSpecError, AudioError, InputError
from asr_spec.serve.metrics import Metrics
from asr_spec.transcribe.inputs import Input
from asr_spec.transcribe.segments import WordTiming

__all__ = ["Batcher", "Job", "QueueFull", "check_queue"]

log = logging.getLogger(__name__)
IDLE_WAIT_S = 0.05  # how long the source waits for a chunk when the engine is idle, before it says None
_job_ids = itertools.count()


class QueueFull(AsrSpecError):
    """The queue of chunks is full: try again later (HTTP 503 with Retry-After)."""


@dataclass(eq=False)
class Job:
    """One request: its input as the front half read it, its chunks' engine requests, and what came back.

    input:    the `Input` (`input.key` is the job's id; spans, seconds of audio).
    requests: one `ChunkRequest` per span, id (job id, chunk index), made by `Batcher.prepare`.
    words:    None, or the words of each finished chunk (`Transcriber.finish_chunk`) by chunk index, when the
              request asked for word timestamps.
    on_done:  called once, from the engine thread (or `submit` for an input without chunks), when the job is
              complete or failed; it must not block.
    """

    input: Input
    requests: list[ChunkRequest] = field(default_factory=list)
    words: dict[int, list[list[WordTiming]]] | None = None
    on_done: Callable[[Job], None] = field(default=lambda job: None)
    results: dict[int, ChunkResult] = field(default_factory=dict)
    error: str | None = None
    cancelled: bool = False
    finished: bool = False
    in_engine: int = 0  # chunks pulled by the engine and not finished
    started: float = field(default_factory=time.perf_counter)

    @property
    def id(self) -> Any:
        return self.input.key

    @property
    def spans(self) -> list[ChunkSpan]:
        return self.input.spans

    @property
    def audio_s(self) -> float:
        return self.input.audio_s

    def ordered_results(self) -> list[ChunkResult]:
        return [self.results[i] for i in range(len(self.spans))]

    def ordered_words(self) -> list[list[list[WordTiming]]] | None:
        """`Transcriber.assemble`'s chunk_words: per chunk, the words of each of its segments; None without."""
        if self.words is None:
            return None
        return [self.words[i] for i in range(len(self.spans))]


def check_queue(max_queue: int) -> None:
    """max_queue (chunks that may wait for a row) is an integer >= 1, else `InputError`."""
    check_int(max_queue, "max_queue", 1, InputError)


class Batcher:
    """Feeds the chunks of many jobs to one `Engine` running in its own thread.

    transcriber: an `asr_spec.transcribe.Transcriber`: its front half prepares the jobs, its engine decodes them,
                 its `finish_chunk` aligns their words and its `assemble` makes their transcripts.
    batch_size:  engine rows (default the transcriber's options.batch_size); max_queue: chunks that may wait for
                 a row before `submit` refuses a job.
    """

    def __init__(self, transcriber: Any, batch_size: int | None = None, max_queue: int = 256,
                 metrics: Metrics | None = None):
        check_queue(max_queue)
        self.transcriber = transcriber
        self.batch_size = transcriber.batch_rows(batch_size)
        self.max_queue = max_queue
        self.metrics = Metrics(self.batch_size) if metrics is None else metrics
        self._queue: deque[tuple[Job, int]] = deque()  # (job, chunk index)
        self._jobs: dict[Any, Job] = {}  # jobs with a chunk queued or in the engine
        self._in_engine = 0  # chunks pulled by the engine and not yet finished
        self._cond = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None

    # -- preparing a request (any thread but the engine's) ----------------------------------------------------
    def prepare(self, data: bytes, name: str = "upload", *, words: bool = False) -> Job:
        """The job of one upload: its audio decoded, chunked and featurised by `Transcriber.prepare`, as the
        transcriber does it; words: align its chunks' words (needs the transcriber's word_timestamps, else
        `InputError`). A file that is not audio raises `AudioError` (one line, naming `name`)."""
        # a datasets-style {"bytes", "path"} row: the bytes are decoded, the path names them in error messages
        item = Input(next(_job_ids), name, {"bytes": data, "path": name}, word_timestamps=words)
        requests = list(self.transcriber.prepare([item], self.batch_size))
        if isinstance(item.exception, AudioError):
            raise AudioError(f"{name}: {item.error}") from item.exception
        if item.exception is not None:  # not the upload's fault: the server's (a 500)
            raise item.exception
        return Job(item, requests, words={} if words else None)

    # -- the queue ------------------------------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        """Queue the job's chunks behind everyone else's; `QueueFull` when max_queue chunks already wait."""
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
            if job is None:
                yield None
            else:
                yield job.requests[index]

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
        engine = self.transcriber.engine
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
        words = None
        if job is not None and not job.cancelled:  # in the engine thread, like transcribe
            result, words = self.transcriber.finish_chunk(result, job.spans[index])
        with self._cond:
            self._in_engine -= 1
            self.metrics.engine_chunks = self._in_engine
            job = self._jobs.get(job_id)
            if job is None:
                return
            job.in_engine -= 1
            job.results[index] = result
            if words is not None:
                job.words[index] = words
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
