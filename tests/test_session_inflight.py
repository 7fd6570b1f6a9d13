"""What the engine session counts in the engine (transcribe/inflight.py, `EngineSession.in_flight`), without a model:
a fake engine pulls a batch from the session's source, then finishes, drops (withdrawn) or loses (raises) what it
holds. The counts follow the feeding and finishing per owner, and go back to zero after withdrawals and failures;
the many-streams runner (stream/decodes.py) reads them. Then the same with the tiny random Whisper through the
server's batcher: an engine error and a closed stream leave nothing counted."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch
from conftest import wait_until

from asr_spec.chunk_id import ChunkId, StreamKey
from asr_spec.engine import ChunkRequest, ChunkResult, ChunkStats, EngineError
from asr_spec.stream.decodes import StreamDecodes
from asr_spec.transcribe.inflight import FINISHED_KEPT, InFlight
from asr_spec.transcribe.session import EngineSession


class FakeEngine:
    """Pulls up to batch_size requests, then gives each one's result in pull order: none for a withdrawn one, and
    `EngineError` naming all it holds when it reaches an id of `fail_on`. `seen` records the counts the session
    reports at each result (read through `probe`)."""

    def __init__(self, fail_on: tuple = (), probe=None):
        self.fail_on, self.probe = set(fail_on), probe
        self.withdrawn: set = set()
        self.seen: list = []

    def withdraw(self, chunk_id) -> None:
        self.withdrawn.add(chunk_id)

    def run(self, source, batch_size):
        source = iter(source)
        while True:
            held = [r for r in (next(source, None) for _ in range(batch_size)) if r is not None]
            if not held:
                return
            for request in held:
                if request.id in self.fail_on:
                    raise EngineError(tuple(r.id for r in held), RuntimeError("broken chunk"))
                if self.probe is not None:
                    self.seen.append(self.probe())
                if request.id not in self.withdrawn:
                    yield ChunkResult(request.id, (1, 2), (), "eos", ChunkStats(chunks=1))


def request(owner, index: int) -> ChunkRequest:
    return ChunkRequest(ChunkId(owner, index), torch.zeros(80, 3000))


def session_over(engine: FakeEngine) -> EngineSession:
    return EngineSession(SimpleNamespace(), engine=engine, live=True)


def test_counts_follow_feeding_and_finishing_per_owner():
    engine = FakeEngine()
    session = session_over(engine)
    engine.probe = lambda: (session.in_flight.of("a"), session.in_flight.of("b"))
    requests = [request("a", 0), request("b", 0), request("a", 1), request("a", 2)]
    results = list(session.run(session.source(requests), 3))
    assert [r.id for r in results] == [r.id for r in requests]
    # first batch: a0, b0, a1 pulled; each result counted out before the next one is read
    assert engine.seen == [(2, 1), (1, 1), (1, 0), (1, 0)]
    assert session.in_flight.total() == 0 and not session.in_flight


def test_withdrawn_requests_stop_counting_and_give_no_result():
    engine = FakeEngine()
    session = session_over(engine)
    requests = [request("a", 0), request("a", 1), request("b", 0)]
    run = session.run(session.source(requests), 3)
    first = next(run)  # the engine holds all three now
    assert first.id == ChunkId("a", 0) and session.in_flight.of("a") == 1 and session.in_flight.of("b") == 1
    session.withdraw(ChunkId("a", 1))
    assert session.in_flight.of("a") == 0 and engine.withdrawn == {ChunkId("a", 1)}
    assert [r.id for r in run] == [ChunkId("b", 0)]
    session.withdraw(ChunkId("b", 0))  # finished already: a late withdrawal counts nothing twice
    assert session.in_flight.total() == 0


def test_a_request_withdrawn_on_its_way_into_the_engine_is_never_counted():
    """A live stream closed after its re-decode was taken from the queue and before the engine pulled it: the
    withdrawal comes first, then the feed, and the engine drops it without a result. It must not count in flight
    (it stayed counted for good: the server's loop then never waited, spinning a core on an idle server)."""
    engine = FakeEngine()
    session = session_over(engine)
    on_its_way = request("s", 1)
    session.withdraw(on_its_way.id)  # not fed yet
    run = session.run(session.source([on_its_way, request("t", 0)]), 2)
    assert [r.id for r in run] == [ChunkId("t", 0)]  # the engine dropped the withdrawn one
    assert session.in_flight.total() == 0 and session.in_flight.of("s") == 0
    counts = InFlight()  # fed again later (a result that beat its withdrawal): counted as any other
    counts.withdrawn(ChunkId("u", 0))
    counts.fed(ChunkId("u", 0))
    counts.fed(ChunkId("u", 0))
    assert counts.of("u") == 1 and counts.done(ChunkId("u", 0)) and not counts


def test_a_withdrawal_of_a_request_that_just_finished_is_not_remembered():
    """A stream closed before it read its last result withdraws an id that has finished: nothing is on its way, so
    nothing is kept for it (one id a race was kept until a run failed); an older finished id, past the ones
    known, is remembered as one that may be on its way."""
    counts = InFlight()
    for i in range(FINISHED_KEPT + 1):
        counts.fed(ChunkId("s", i))
        assert counts.done(ChunkId("s", i))
    counts.withdrawn(ChunkId("s", FINISHED_KEPT))
    counts.withdrawn(ChunkId("s", 1))
    assert counts._withdrawn_early == set()
    counts.withdrawn(ChunkId("s", 0))  # no longer known as finished
    counts.fed(ChunkId("s", 0))
    assert counts._withdrawn_early == set() and not counts


def test_a_failed_run_names_the_owners_it_lost_and_counts_start_clean():
    engine = FakeEngine(fail_on={ChunkId("b", 0)})
    session = session_over(engine)
    requests = [request("a", 0), request("b", 0), request("c", 0), request("d", 0)]
    source = session.source(requests)
    with pytest.raises(EngineError):
        list(session.run(source, 3))
    assert session.in_flight.total() == 2  # b and c held when it raised (a had finished)
    assert session.lost() == {"b", "c"}
    assert session.in_flight.total() == 0 and session.in_flight.of("b") == 0
    engine.fail_on = set()
    assert [r.id for r in session.run(source, 3)] == [ChunkId("d", 0)]  # the next run carries on
    assert session.in_flight.total() == 0


def test_the_stream_runner_reads_the_sessions_count_through_withdrawals_and_failures():
    engine = FakeEngine()
    session = session_over(engine)
    decodes = StreamDecodes(session, lambda samples: torch.zeros(len(samples), 80, 3000))
    got: dict = {}
    streams = [decodes.open(lambda outcome, i=i: got.setdefault(i, []).append(outcome)) for i in range(3)]
    for stream in streams:
        decodes.submit(stream, torch.zeros(16000).numpy(), (5,))
    decodes.submit(streams[0], torch.zeros(8000).numpy())  # replaces its waiting one, now the newest
    assert decodes.n_waiting == 3 and decodes.idle is False
    requests = decodes.take_all()
    assert [r.id for r in requests] == [ChunkId(StreamKey(streams[i].id), n) for i, n in ((1, 1), (2, 1), (0, 2))]
    run = session.run(session.source(requests), 3)
    decodes.deliver(next(run))  # stream 1's
    assert decodes.n_in_engine == 2
    decodes.close(streams[2])  # its client went away: withdrawn from the engine
    assert decodes.n_in_engine == 1
    for result in run:
        decodes.deliver(result)
    assert sorted(got) == [0, 1] and decodes.n_in_engine == 0 and decodes.idle
    # a failed run: the stream it held is told, and nothing stays counted
    engine.fail_on = {ChunkId(StreamKey(streams[0].id), 3)}
    decodes.submit(streams[0], torch.zeros(16000).numpy())
    with pytest.raises(EngineError):
        list(session.run(session.source(decodes.take_all()), 3))
    decodes.fail(session.lost(), "broken chunk")
    assert got[0][-1] == "decoding failed (broken chunk)" and decodes.n_in_engine == 0


def test_a_redecode_asks_the_engine_for_no_more_tokens_than_its_audio_holds():
    """Each request the runner makes carries its `hearing.token_budget` (12 tokens a second of its audio and 16
    more, its forced prefix counted): a loop past the audio is cut there, not at the model's 448 positions."""
    decodes = StreamDecodes(session_over(FakeEngine()), lambda samples: torch.zeros(len(samples), 80, 3000))
    short, long = decodes.open(lambda outcome: None), decodes.open(lambda outcome: None)
    decodes.submit(short, torch.zeros(32000).numpy(), (), tuple(range(10)))  # 2 s, 10 committed tokens forced
    decodes.submit(long, torch.zeros(20 * 16000).numpy())
    assert [r.max_new_tokens for r in decodes.take_all()] == [24 + 16 - 10, 240 + 16]


def test_a_streams_budget_grows_with_what_it_says_and_after_a_cut():
    """The runner's per-stream rate (`hearing.budget_rate`): a stream whose re-decode ran out (finish_reason
    "length") gets twice the budget next time; one whose finished re-decodes say 20 tokens a second gets twice that
    rate; another stream's is its own."""
    engine = FakeEngine()
    session = session_over(engine)
    decodes = StreamDecodes(session, lambda samples: torch.zeros(len(samples), 80, 3000))
    dense, plain = decodes.open(lambda outcome: None), decodes.open(lambda outcome: None)
    ten_s = torch.zeros(10 * 16000).numpy()

    def budgets(results):
        for stream in (dense, plain):
            decodes.submit(stream, ten_s)
        requests = decodes.take_all()
        for request, (n_tokens, reason) in zip(requests, results):
            said = tuple(range(100, 100 + n_tokens))  # ids that do not loop (`hearing.ids_loop`)
            decodes.deliver(ChunkResult(request.id, said, (), reason, ChunkStats(chunks=1)))
        return [r.max_new_tokens for r in requests]

    assert budgets([(136, "length"), (40, "eos")]) == [136, 136]  # 12 a second and 16
    assert budgets([(200, "eos"), (40, "eos")]) == [256, 136]  # after the cut: twice the rate
    assert budgets([(200, "eos"), (40, "eos")]) == [416, 136]  # 20 a second said: 40


def test_the_stream_runner_counts_what_became_of_each_redecode():
    """`StreamDecodes.counts`: every submitted re-decode is replaced while waiting, taken, or still waiting; every
    taken one delivered or withdrawn (stale when its stream's newer one is taken, or its stream closed) once the
    run is over; waits and times in the engine are never negative and the longest wait bounds the mean."""
    engine = FakeEngine()
    session = session_over(engine)
    decodes = StreamDecodes(session, lambda samples: torch.zeros(len(samples), 80, 3000))
    streams = [decodes.open(lambda outcome: None) for _ in range(3)]
    for stream in streams:
        decodes.submit(stream, torch.zeros(16000).numpy())
    decodes.submit(streams[0], torch.zeros(8000).numpy())  # replaces its waiting one
    first = decodes.take_all()
    decodes.submit(streams[1], torch.zeros(16000).numpy())  # taken while its older one is in the engine: stale
    second = decodes.take_all()
    run = session.run(session.source(first + second), 4)
    decodes.deliver(next(run))  # stream 2's (stream 1's stale one was withdrawn when its newer one was taken)
    decodes.close(streams[0])  # its re-decode still in the engine: withdrawn
    for result in run:
        decodes.deliver(result)
    c = decodes.counts
    assert (c.submitted, c.replaced, c.taken, c.withdrawn, c.delivered) == (5, 1, 4, 2, 2)
    assert c.submitted == c.replaced + c.taken + decodes.n_waiting
    assert c.taken == c.delivered + c.withdrawn  # the run is over: nothing of theirs is left in the engine
    assert 0.0 <= c.wait_s / c.taken <= c.max_wait_s and c.engine_s >= 0.0


def test_in_flight_is_counted_once_per_id_from_many_threads():
    counts = InFlight()
    ids = [ChunkId(owner, i) for owner in range(4) for i in range(200)]

    def feed_and_finish(part):
        for chunk_id in part:
            counts.fed(chunk_id)
            counts.fed(chunk_id)  # fed twice: counted once
        for chunk_id in part:
            assert counts.done(chunk_id)
            assert not counts.done(chunk_id)  # done twice: counted out once

    threads = [threading.Thread(target=feed_and_finish, args=(ids[i::4],)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert counts.total() == 0 and not counts and all(counts.of(owner) == 0 for owner in range(4))


def _gated_batcher():
    """A server's batcher over the tiny random Whisper (greedy, 2 rows) whose engine steps wait on the returned
    event (closed: set it to let them run)."""
    pytest.importorskip("fastapi", reason="needs the asr-spec[serve] extra")
    from test_transcribe import transcriber

    from asr_spec.engine.capture import StepRunner
    from asr_spec.serve.batcher import Batcher

    gate = threading.Event()

    def gated(fn):
        def step(*args):
            assert gate.wait(300), "the test never opened the gate"
            fn(*args)
        return step

    model = transcriber(speculative=False)
    model.engine.runner = StepRunner("wrapped", gated)
    return Batcher(model, batch_size=2), gate


def test_the_servers_counts_go_back_to_zero_after_an_engine_error_and_a_cancel():
    """The tiny random Whisper through the server's batcher: a job whose chunks break the encoder fails, a job
    cancelled while its chunks decode is forgotten, another is served; the session then counts nothing, and the
    metrics' gauges (read from it) say so."""
    import dataclasses

    from test_transcribe import LONG, SHORT

    batcher, gate = _gated_batcher()  # the long job cannot finish before it is cancelled
    gate.set()
    broken = batcher.prepare(SHORT[1].read_bytes())
    requests = [broken.pending, *broken.requests]
    broken.pending = None  # 7 frames instead of 3000: the encoder raises on this job's chunks
    broken.requests = iter([dataclasses.replace(r, features=torch.randn(80, 7)) for r in requests])
    gone, good = batcher.prepare(str(LONG)), batcher.prepare(str(SHORT[0]))
    batcher.start()
    try:
        batcher.submit(broken)  # alone: an encoder batch shared with another job would fail that one too
        assert wait_until(lambda: broken.finished, 300, 0.02), "the broken job did not fail in time"
        assert batcher.session.in_flight.total() == 0
        gate.clear()  # from here the steps wait: the long job's chunks stay in the engine until it is cancelled
        batcher.submit(gone)
        batcher.submit(good)
        assert wait_until(lambda: batcher.session.in_flight.of(gone.id), 300), \
            "the long job's chunks never reached the engine"
        batcher.cancel(gone)
        gate.set()
        assert wait_until(lambda: broken.finished and good.finished and not batcher.session.in_flight, 300, 0.02), \
            "the jobs did not finish in time"
    finally:
        batcher.stop()
    assert "decoding failed" in broken.error and good.error is None and gone.cancelled and not gone.finished
    assert batcher.session.in_flight.total() == 0 and batcher.streams.n_in_engine == 0
    assert "asr_spec_engine_chunks 0\n" in batcher.metrics.render()


def test_a_job_cancelled_after_its_audio_was_read_gives_back_its_budget():
    """A client gone while its upload's last chunk decodes (the job read to its end, out of the rotation): the
    server's admission budget comes back and the job is forgotten once that chunk is out of the engine (the budget
    stayed taken: 32 such requests and the server answered 503 to everyone)."""
    from test_transcribe import SHORT

    batcher, gate = _gated_batcher()  # the chunk cannot finish before the job is cancelled
    batcher.admit(30.0)
    job = batcher.prepare(str(SHORT[0]), reserved_s=30.0)
    assert batcher.in_flight == (1, 30.0)
    batcher.start()
    try:
        batcher.submit(job)
        assert wait_until(lambda: job.input.read_done and batcher.session.in_flight.of(job.id)
                          and batcher.queue_depth == 0, 300), "the job's chunk never reached the engine"
        batcher.cancel(job)
        gate.set()
        assert wait_until(lambda: batcher.in_flight == (0, 0.0) and not batcher.session.in_flight, 300, 0.02), \
            f"the cancelled job kept its budget: {batcher.in_flight}"
    finally:
        gate.set()
        batcher.stop()
    assert job.cancelled and job.ended and not job.finished and job.id not in batcher._jobs


def test_waiting_redecodes_are_held_while_another_streams_is_decoding_and_then_taken_as_one_group():
    """`StreamDecodes.take_group`: while a stream's re-decode is in the engine the others wait (their windows are
    then encoded together), for at most group_wait_s after the oldest was submitted; then all go in one group. A
    lone stream, or group_wait_s 0, is never held."""
    engine = FakeEngine()
    session = session_over(engine)
    decodes = StreamDecodes(session, lambda samples: torch.zeros(len(samples), 80, 3000), group_wait_s=2.0)
    streams = [decodes.open(lambda outcome: None) for _ in range(3)]
    decodes.submit(streams[0], torch.zeros(16000).numpy())
    (first,) = decodes.take_group(8)  # nothing else in the engine: not held
    run = session.run(session.source([first]), 3)
    decodes.submit(streams[1], torch.zeros(16000).numpy())
    decodes.submit(streams[2], torch.zeros(16000).numpy())
    submitted_s = time.monotonic()
    assert decodes.take_group(8) == [] and decodes.n_waiting == 2  # stream 0's is in the engine
    assert decodes.held(submitted_s + 1.9) and not decodes.held(submitted_s + 2.1)  # at most group_wait_s
    decodes.deliver(next(run))  # stream 0's result: none of the others' is in the engine now
    assert not decodes.held(time.monotonic())
    group = decodes.take_group(8)
    assert [r.id.owner for r in group] == [streams[1].owner, streams[2].owner]  # one group, oldest first
    decodes.submit(streams[0], torch.zeros(16000).numpy())
    assert decodes.held(time.monotonic())  # its peers are in the engine now
    eager = StreamDecodes(session, lambda samples: torch.zeros(len(samples), 80, 3000), group_wait_s=0)
    a, b = eager.open(lambda outcome: None), eager.open(lambda outcome: None)
    eager.submit(a, torch.zeros(16000).numpy())
    assert len(eager.take_group(8)) == 1
    eager.submit(b, torch.zeros(16000).numpy())
    assert len(eager.take_group(8)) == 1  # group_wait_s 0: never held
    c = eager.open(lambda outcome: None)
    eager.submit(a, torch.zeros(16000).numpy())
    eager.submit(c, torch.zeros(16000).numpy())
    assert [r.id.owner for r in eager.take_group(1)] == [a.owner] and eager.n_waiting == 1  # at most n, oldest
    with pytest.raises(ValueError, match="group_wait_s"):
        StreamDecodes(session, lambda samples: samples, group_wait_s=-1)
