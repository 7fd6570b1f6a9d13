"""One engine, one continuous batch, many requests: the engine thread and the jobs whose chunks feed it.

    upload ──prepare (a worker thread: opens it, Transcriber.prepare's first chunk)──► Job(lazy requests)
    ──submit──► rotation of jobs ──live source (engine thread: next chunk of the next job, decoded and
    featurised now)──► EngineSession (tails, prompts, fallback around Engine.run; finish per result) ──► the
    job's input (`Input.keep`) ──last one──► done ──Transcriber.assemble (app.py)──► transcript

Memory is bounded per request and in all. A job holds its input's lazy front half (`Transcriber.prepare`,
featurising one chunk at a time): its audio is read one block at a time and a chunk's features are made only when
the engine is about to take it, so a 2-hour upload costs one block, one chunk and its features, not 2 hours of
samples. Jobs take turns, one chunk each (round robin), so a short request is not queued behind a long one. What
may be in flight is admitted up front (`admit`): at most `max_requests` jobs and `max_audio_in_flight_s` seconds
of audio (a request's header duration, or `max_audio_s` when the container does not say), else `Busy` (a 503);
a single request is always admitted into an idle server. A request longer than its `max_audio_s` is refused while
it is read (`Job.status` 413), and the part already read is dropped.

The source yields None when no job has a chunk ready (after waiting briefly when nothing is in the engine, so an
idle server does not spin). A job is done when its input is read and its last chunk is. A job that wants word
timestamps has its chunks keep their encoder output in the engine (`keep_encoded`), and each chunk is aligned in
the engine thread as it finishes (`Transcriber.finish_chunk`), as `Transcriber.transcribe` does. Cancelling a job
(a client went away) ends it at once when none of its chunks is being read: its reader is closed, its upload
removed, its budget given back; its chunks already in the engine finish there and are ignored. A run that fails
(an `EngineError`, or a bug around the engine) fails the jobs and streams whose chunks it held (the session says
which: `EngineSession.lost`) and the engine starts a new run. What each job and stream has in the engine is the
session's count (`EngineSession.in_flight`), read here, never kept by hand.

Tail repair and temperature fallback are the engine session's (session.py), as for `Transcriber.transcribe`: a
tail is fed to the engine before the next job's chunk, unless its job ended meanwhile (`_tail_wanted`); the job is
complete when its tails are in too, and assembled with them. A job and the errors a request ends in are jobs.py's.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from collections import deque
from collections.abc import Iterator
from typing import Any

from asr_spec.audio.loading import SAMPLE_RATE
from asr_spec.chunk_id import ChunkId
from asr_spec.engine import ChunkRequest, ChunkResult, EngineError
from asr_spec.errors import AudioError, AudioTooLong, InputError, one_line
from asr_spec.serve.jobs import Busy, Job, Refused, check_limits, close_reader
from asr_spec.serve.metrics import Metrics
from asr_spec.serve.stream_jobs import GROUP_WAIT_S, StreamQueue, is_stream_id
from asr_spec.transcribe.inputs import Input
from asr_spec.transcribe.prompts import InputPrompt
from asr_spec.transcribe.session import EngineSession

__all__ = ["Batcher", "Busy", "Job", "Refused", "check_limits"]

log = logging.getLogger(__name__)
IDLE_WAIT_S = 0.05  # how long the source waits for a chunk when the engine is idle, before it says None
_job_ids = itertools.count()


class Batcher:
    """Feeds the chunks of many jobs to one `Engine` running in its own thread.

    transcriber: an `asr_spec.transcribe.Transcriber`: its front half reads the jobs, its engine decodes them,
                 its `finish_chunk` aligns their words and its `assemble` makes their transcripts.
    batch_size:  engine rows (default the transcriber's options.batch_size).
    max_requests, max_audio_in_flight_s: what `admit` lets in at once (requests; seconds of audio).
    max_streams: live streams (`/v1/realtime`) open at once; their re-decodes come from `streams` (stream_jobs.py)
                 in groups (encoded together) and alternate with the uploads' chunks (neither starves the other).
    group_wait_s: the longest a stream's waiting re-decode is held for others to join its group
                 (`StreamDecodes.take_group`; 0: never held).
    """

    def __init__(self, transcriber: Any, batch_size: int | None = None, max_requests: int = 32,
                 max_audio_in_flight_s: float = 12 * 3600.0, metrics: Metrics | None = None, max_streams: int = 16,
                 group_wait_s: float = GROUP_WAIT_S):
        check_limits(max_requests, max_audio_in_flight_s)
        self.transcriber = transcriber
        self.batch_size = transcriber.batch_rows(batch_size)
        self.max_requests = max_requests
        self.max_audio_in_flight_s = float(max_audio_in_flight_s)
        self.metrics = Metrics(self.batch_size) if metrics is None else metrics
        self._active: deque[Job] = deque()  # jobs with chunks still to read, in turn
        self._jobs: dict[Any, Job] = {}  # submitted jobs not ended
        self._admitted = 0  # requests admitted and not ended
        self._reserved_s = 0.0  # seconds of audio they hold
        self._cond = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._upload_turn = False  # the last chunk pulled ended a group of re-decodes: an upload's goes next
        # re-decodes taken as a group and not yet pulled by the engine (kept here, not in the source: a run that
        # fails before pulling them all leaves them to the next run's source)
        self._group: deque[ChunkRequest] = deque()
        # a group is what the engine encodes in one call (4 windows on a CPU): a group of 8 is encoded in two calls
        # before any of its rows decodes, and every one of its results comes back at the end of the round; in
        # groups of 4, taken in turn, half of them come back in half the time, on as much engine time a round (8
        # real-time streams on the AVX-512-BF16 EPYC, docs/live.md "Groups of one encoder call": commit latency p95
        # 6.60-8.16 s in five runs against 7.83-10.57 s in three, interleaved)
        self._group_rows = transcriber.engine.encode_batch(self.batch_size)
        # the engine's runs, with tail repair (None: stride chunks, no timestamps, off) and the requests'
        # temperature fallback wrapped around them; what is in the engine, by job and stream (`in_flight`)
        self.session = EngineSession(transcriber, schedule=self._schedule)
        self.streams = StreamQueue(self.session, transcriber.frontend.features, self._cond, max_streams, group_wait_s)
        # the server's own initial prompt and hotwords, on every re-decode of every stream (the realtime protocol
        # has no field for a session's own)
        self.streams.prompt = transcriber.stream_prompt()
        self.metrics.refresh = self._gauges

    # -- admission (any thread) ---------------------------------------------------------------------------------
    def admit(self, audio_s: float) -> None:
        """Reserve room for one request of `audio_s` seconds, else `Busy`; given back by `release` (or when the
        job `prepare` makes of it ends). An idle server admits any one request."""
        with self._cond:
            if self._admitted >= self.max_requests:
                raise Busy(f"{self._admitted} requests are in flight (--max-requests {self.max_requests})")
            if self._admitted and self._reserved_s + audio_s > self.max_audio_in_flight_s:
                raise Busy(f"{self._reserved_s:.0f} s of audio are in flight and this request adds {audio_s:.0f} s "
                           f"(--max-audio-in-flight-s {self.max_audio_in_flight_s:g})")
            self._admitted += 1
            self._reserved_s += audio_s
            self._publish()

    def release(self, audio_s: float) -> None:
        with self._cond:
            self._give_back(audio_s)
            self._publish()

    def _give_back(self, audio_s: float) -> None:
        """Under the lock: one admitted request and its `audio_s` seconds of budget ended (the sum is exactly 0
        once none is left: subtracted float by float it drifted to 1e-13 s on an idle server's gauge)."""
        self._admitted -= 1
        self._reserved_s = max(0.0, self._reserved_s - audio_s) if self._admitted else 0.0

    # -- preparing a request (any thread but the engine's) ----------------------------------------------------
    def prepare(self, source: Any, name: str = "upload", *, words: bool = False, max_audio_s: float | None = None,
                reserved_s: float | None = None, temperature: tuple[float, ...] | None = None,
                prompts: Any = None) -> Job:
        """The job of one upload (`source`: a file path, streamed, or its bytes), opened by reading its first chunk
        (`Transcriber.prepare`, one chunk featurised at a time); words: align its chunks' words (needs the
        transcriber's word_timestamps, else `InputError`). reserved_s: what `admit` reserved for it (given back
        when the job ends, or now if this raises); temperature: its schedule (`Job.temperature`); prompts: its
        `PromptOptions` (None: the transcriber's own). A file that is not audio raises `AudioError` naming `name`."""
        label = name  # what the reader's messages call it: the path of a file, replaced by `name` in job.error
        if isinstance(source, (bytes, bytearray, memoryview)):  # a {bytes, path} row: `path` names it in errors
            source = {"bytes": bytes(source), "path": name}
        else:
            label = os.fspath(source)
        job = None
        try:
            max_samples = None if max_audio_s is None else int(max_audio_s * SAMPLE_RATE)
            item = Input(next(_job_ids), label, source, word_timestamps=words, prompt=self._prompt(prompts, name),
                         max_samples=max_samples)
            job = Job(item, iter(()), reserved_s=reserved_s, temperature=temperature)
            job.requests = self.transcriber.prepare([item], 1, self.session.keep_samples)
            job.pending = next(job.requests, None)
            self._check_read(job)
            if job.status == 500:  # not the upload's fault: the server's
                raise item.exception  # type: ignore[misc]
            if job.error is not None:
                raise Refused(f"{name}: {job.error}", job.status) from item.exception
        except BaseException:  # the one way out of a failed open: its reader closed, its reservation given back
            if job is not None:
                close_reader(job.requests)
                self._let_go(job.pending)
            if reserved_s is not None:
                self.release(reserved_s)
            raise
        return job

    def _prompt(self, prompts: Any, name: str) -> InputPrompt | None:
        """The prompt tokens of an upload's `PromptOptions` (`Transcriber.prompt_tokens`); one the model cannot
        take (a prompt for a model without <|startofprev|>) is the request's fault: a 400 naming `name`."""
        try:
            return self.transcriber.prompt_tokens(prompts)
        except InputError as err:
            raise Refused(f"{name}: {one_line(err)}", 400) from err

    def _check_read(self, job: Job) -> None:
        """Mark the job failed when its input could not be read (400, or 500 for an error that is not the
        upload's) or was read past its max_samples (413: `Input.max_samples`, checked as each block is read)."""
        item = job.input
        if item.exception is not None and job.error is None:
            if isinstance(item.exception, AudioTooLong):
                job.status = 413
                job.error = (f"longer than this server's limit of {item.exception.limit_s:g} s of audio "
                             f"(--max-audio-s; refused after reading {item.exception.read_s:.0f} s)")
                return
            job.status = 400 if isinstance(item.exception, AudioError) else 500
            job.error = item.error or ""
            if isinstance(item.source, str):  # a spooled upload: its temporary path means nothing to the client
                job.error = job.error.replace(item.name, "the upload")

    # -- the rotation ---------------------------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        """Give the job its turns with every other job's."""
        with self._cond:
            self._jobs[job.id] = job
            if job.complete:  # no chunks at all (e.g. no speech found)
                self._end(job)
            else:
                self._active.append(job)
            self._publish()
            self._cond.notify_all()
        if job.complete:
            self._finish(job)

    def cancel(self, job: Job) -> None:
        """The client went away: end the job now unless the engine thread is reading its next chunk (then it
        ends the job when that read returns) or has read all of it (then it ends the job when the first of its
        chunks in the engine comes back, `_deliver`). Its chunks in the engine finish there and are ignored."""
        with self._cond:
            job.cancelled = True
            if job in self._active:
                self._active.remove(job)
                self._end(job)
            self._publish()

    @property
    def alive(self) -> bool:
        """The engine thread is running."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def queue_depth(self) -> int:
        """Requests with chunks still to read."""
        return len(self._active)

    @property
    def in_flight(self) -> tuple[int, float]:
        """(requests admitted and not ended, seconds of audio they hold)."""
        return self._admitted, self._reserved_s

    def _source(self) -> Iterator[ChunkRequest | None]:
        """The jobs' and streams' live source (the session feeds the queued tails in before each of its requests):
        the next chunk of the next job in turn, or None when none is ready now."""
        while True:
            with self._cond:
                if not self._active and not self._stopping and not self.session.in_flight and self.streams.idle:
                    self._cond.wait(IDLE_WAIT_S)
                if self._stopping:
                    return
            # a group of the streams' waiting re-decodes (featurised now, pulled one after another: the engine
            # encodes them together) and an upload's chunk take turns when both wait
            if not self._group and not self._upload_turn:
                self._group.extend(self.streams.take_group(self._group_rows))
            if self._group:
                redecode = self._group.popleft()
                self._upload_turn = not self._group and bool(self._active)
                yield redecode
                continue
            self._upload_turn = False  # this is the uploads' turn: the streams' next group goes after it
            with self._cond:
                job = self._active.popleft() if self._active else None
            if job is None:
                yield None
                continue
            request = self._next_chunk(job)  # outside the lock: reads and featurises one chunk
            with self._cond:
                failed = job.error is not None
                if failed or job.cancelled:
                    self._let_go(request)
                    request = None
                    self._end(job)
                elif request is not None:  # counted in flight by the session as the engine pulls it
                    self._active.append(job)
                elif job.complete:
                    self._end(job)
                self._publish()
            if (failed or job.complete) and not job.cancelled:
                self._finish(job)
            if request is not None:
                yield request

    def _tail_wanted(self, tail_id: ChunkId) -> bool:
        """Whether a queued tail goes to the engine: not when its job ended meanwhile (it is then dropped), nor
        once the server is stopping (`stop` fails its job)."""
        with self._cond:
            if self._stopping:
                return False
            job = self._jobs.get(tail_id.owner)
            alive = job is not None and not (job.ended or job.cancelled or job.error is not None)
            if job is not None and not alive:  # cancelled or failed while its tail waited
                job.input.repairs.pending -= 1
                self._end(job)
        return alive

    def _prompt_of(self, owner: Any) -> InputPrompt | None:
        """The prompts of a job's chunks and tails (prompts.py); None for a stream's re-decode (it carries its
        stream's prompt, and its prefix is the stream's committed words: stream/decodes.py)."""
        job = self._jobs.get(owner)
        return None if job is None else job.input.prompt

    def _let_go(self, request: ChunkRequest | None) -> None:
        """Drop the samples held for a request that will not reach the engine."""
        samples = self.session.keep_samples
        if request is not None and samples is not None:
            samples.pop(request.id, None)

    def _next_chunk(self, job: Job) -> ChunkRequest | None:
        """The job's next request (None when its input is read or failed), checked against its limits."""
        request, job.pending = job.pending, None
        try:
            if request is None:
                request = next(job.requests, None)
        except Exception as err:  # not the upload's fault: fail this request, keep serving the others
            log.exception("job %s: reading its audio", job.id)
            job.status, job.error = 500, f"reading the audio failed ({type(err).__name__}: {one_line(err)})"
            return None
        self._check_read(job)
        return None if job.error is not None else request

    def _end(self, job: Job) -> None:
        """Under the lock: close the job's reader, give back its budget, forget it unless chunks are in the engine."""
        if not job.ended:
            job.ended = True
            close_reader(job.requests)
            self._let_go(job.pending)
            job.pending = None
            if job.reserved_s is not None:
                self._give_back(job.reserved_s)
        if not self.session.in_flight.of(job.id):
            self._jobs.pop(job.id, None)

    def _publish(self) -> None:
        self.metrics.queue_depth = len(self._active)
        self.metrics.requests_in_flight = self._admitted
        self.metrics.audio_in_flight_s = self._reserved_s

    def _gauges(self) -> None:
        """The metrics' gauges as they are now (`Metrics.refresh`, before each rendering): the batcher's, and what
        the session counts in the engine."""
        with self._cond:
            self._publish()
            self.metrics.streams_open = self.streams.n_open
            self.metrics.stream_redecodes = self.streams.n_in_engine
            self.metrics.engine_chunks = self.session.in_flight.total() - self.metrics.stream_redecodes

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
            self._active.clear()
            for job in left:
                self._end(job)
                job.status, job.error = 503, "the server is shutting down"
            self._publish()
        self.streams.stop("the server is shutting down")
        for job in left:
            self._finish(job)

    def _serve(self) -> None:
        while not self._stopping:
            source = self.session.source(self._source(), self._prompt_of, self._tail_wanted)
            try:
                for result in self.session.run(source, self.batch_size):
                    self._deliver(result)
            except EngineError as err:
                log.error("%s", err)
                self._fail(self.session.lost(), str(err.__cause__ or err))
            except Exception as err:  # a bug outside the engine's own work: fail what is in flight, keep serving
                log.exception("engine thread")
                self._fail(self.session.lost(), f"{type(err).__name__}: {err}")

    def _schedule(self, chunk_id: Any) -> tuple[float, ...]:
        """The temperature schedule of a chunk's job (the request's, else the server's options); a stream's
        re-decode is greedy only (its policy compares greedy hypotheses, and its hypothesis drafts greedy rows)."""
        if is_stream_id(chunk_id):
            return (0.0,)
        job = self._jobs.get(chunk_id.owner)
        if job is None or job.temperature is None:
            return self.transcriber.options.temperature
        return job.temperature

    def _deliver(self, result: ChunkResult) -> None:
        if self.streams.deliver(result):
            self.metrics.chunk_done(result.stats)
            return
        job = self._jobs.get(result.id.owner)
        alive = job is not None and not job.cancelled and job.error is None
        finished = self.session.finish(result, job.input if alive else None)  # in the engine thread
        if alive and result.error is not None:  # the engine refused this chunk (engine/refusals.py): its job alone
            self._fail({result.id.owner}, result.error)
            return
        with self._cond:
            job = self._jobs.get(result.id.owner)
            if job is None:
                return
            if finished is not None:
                finished.keep(job.input)
            self.metrics.chunk_done(result.stats)
            done = job.complete and job.error is None
            # a job cancelled once its audio was read (out of the rotation, so `cancel` left it to this thread) ends
            # with its first result back: its budget given back, forgotten once its last chunk is out of the engine
            if done or job.ended or job.cancelled:
                self._end(job)
            self._publish()
        if done and not job.cancelled:
            self._finish(job)

    def _fail(self, owners: set, cause: str) -> None:
        """Fail every job and stream in `owners`: their chunks were lost in the engine (`EngineSession.lost`; the
        run is over), or the engine refused one of them (the run goes on)."""
        self.streams.fail(owners, cause)
        with self._cond:
            failed = [self._jobs[owner] for owner in owners if owner in self._jobs]
            for job in failed:
                if job in self._active:
                    self._active.remove(job)
                self._end(job)
                job.status, job.error = 500, f"decoding failed ({cause})"
            for job in [job for job in self._jobs.values() if job.ended]:
                self._end(job)  # ended jobs that waited only for their chunks in the engine
            self._publish()
        for job in failed:
            self._finish(job)

    @staticmethod
    def _finish(job: Job) -> None:
        """Mark the job done and tell its owner (nobody is listening to a cancelled one)."""
        if job.cancelled or job.finished:
            return
        job.finished = True
        try:
            job.on_done(job)
        except Exception:  # a callback's bug must not stop the engine thread
            log.exception("job %s: completion callback failed", job.id)
