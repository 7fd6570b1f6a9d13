"""Catching up (stream/catchup.py) without a model or a clock: streams fed in simulated time through the server's
real re-decode queue (`StreamQueue`: one re-decode per stream, oldest first) into a fake engine that takes a fixed
time per re-decode whatever it covers (as the encoder's window does), each stream's policy fed from its backlog by
`catch_up` as the realtime session feeds it, the scripted decoder of test_stream_policy hearing the words.

With more streams than the engine re-decodes every step: with catching up every stream is re-decoded less often
and its lag stays bounded, none starves, all finish with every word committed once, in order; without it the lag
grows with the audio. A sender at 10x real time gets the same text as one at 1x."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from test_stream_policy import EOT, KINDS, TS, WORD_SAMPLES, detokenize, energy, hear_given, speech, words_of

from asr_spec.engine import ChunkResult, ChunkStats
from asr_spec.serve.stream_jobs import StreamQueue
from asr_spec.stream.catchup import Backlog, BacklogFull, catch_up, next_action, renewed
from asr_spec.stream.policy import StreamOptions, StreamPolicy
from asr_spec.transcribe.inflight import InFlight

SR = 16_000
TICK_S = 0.1  # the simulated clock's step: the sessions' and the engine's turns
BLOCK = 1600  # the session's block (RealtimeOptions.block_s 0.1 s)


@dataclass(eq=False)
class Sim:
    """One simulated session: its audio, policy, backlog and what it saw."""

    audio: np.ndarray
    policy: StreamPolicy
    backlog: Backlog
    sent: int = 0
    decode: object = None
    inbox: list = field(default_factory=list)
    n_decodes: int = 0
    lags_s: list[float] = field(default_factory=list)  # backlog when each result came back
    committed_at: list[float] = field(default_factory=list)  # the simulated time each committed word was sent
    final: object = None
    ended: bool = False
    forced: list = field(default_factory=list)  # the prefix of each of its re-decodes' engine requests



def _as_features(samples: list) -> list:
    """The fake featuriser: each re-decode's samples as a (1, n) float tensor, read back by `_samples_of`."""
    return [torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))[None] for x in samples]


def _samples_of(request) -> np.ndarray:
    return request.features[0].numpy()

def simulate(words: list[list[int | None]], rows: int, decode_s: float, speed: float = 1.0, enabled: bool = True,
             voice=None, step_s: float = 1.0, committed_prefix: bool = True, encoder: tuple[float, float] | None = None,
             group_wait_s: float = 0.0, encodes: list | None = None, stagger_s: float = 0.0,
             renew: bool = False) -> tuple[list[Sim], float]:
    """Stream each word list (speech()) at `speed` x real time; an engine of `rows` rows takes `decode_s` per re-decode
    (the scripted decoder, its forced prefix kept: `hear_given`); each stream is re-decoded every `step_s` when it
    keeps up. With `encoder` (seconds per encoder call: fixed, per window) the engine takes the waiting re-decodes
    as the server does (`take_group`, held up to `group_wait_s`) and encodes each group in one call, its rows
    waiting meanwhile, and a re-decode's steps take `decode_s` per 10 tokens it generates (its forced prefix not
    counted); `encodes` gets each call's windows. Stream i starts sending i * `stagger_s` after the first. renew: a
    waiting re-decode is brought up to date as it is taken, as the server's sessions do. Returns the sessions and
    the simulated time when the last one finished."""
    now = 0.0
    queue = StreamQueue(_Session(), _as_features, threading.Condition(), len(words), group_wait_s,
                        clock=lambda: now)
    sims, lives = [], []
    for w in words:
        options = StreamOptions(step_s=step_s, committed_prefix=committed_prefix)
        sim = Sim(speech(w), StreamPolicy(KINDS, detokenize, options, voice), Backlog(3600 * SR))
        sims.append(sim)
        lives.append(queue.open(sim.inbox.append))
    running: list[tuple[float, object]] = []  # (done at, request)
    busy_until = 0.0  # the engine encodes until then
    while not all(s.final for s in sims):
        assert now < 600, "the streams never finished"
        for i, sim in enumerate(sims):  # the clients' appends
            n = int(round(speed * TICK_S * SR))
            if sim.sent < len(sim.audio) and now >= i * stagger_s:
                sim.backlog.append(sim.audio[sim.sent:sim.sent + n])
                sim.sent += n
        for done_at, request in [r for r in running if r[0] <= now]:  # the engine's results
            running.remove((done_at, request))
            tokens = hear_given(_samples_of(request), request.prefix)
            queue.deliver(ChunkResult(request.id, tuple(tokens), (), "eos", ChunkStats(chunks=1)))
        for sim, live in zip(sims, lives):  # the sessions
            serve(sim, live, queue, enabled, now, renew)
        taken = []
        if encoder is None:
            while len(running) < rows and (request := queue.take()) is not None:
                running.append((now + decode_s, request))
                taken.append(request)
        elif now >= busy_until and len(running) < rows and (taken := queue.take_group(rows - len(running))):
            cost_s = encoder[0] + encoder[1] * len(taken)
            busy_until = now + cost_s
            running = [(done_at + cost_s, r) for done_at, r in running]
            running += [(busy_until + decode_s * steps(r) / 10, r) for r in taken]
            if encodes is not None:
                encodes.append(len(taken))
        for request in taken:
            sims[lives.index(next(s for s in lives if s.in_engine == request.id))].forced.append(request.prefix)
        now += TICK_S
    return sims, now


class _Session:
    """The engine session's side the queue uses (`withdraw`, `in_flight`); this fake engine decodes every
    re-decode to its end, so a withdrawn one only stops counting."""

    def __init__(self) -> None:
        self.in_flight = InFlight()

    def withdraw(self, chunk_id) -> None:
        self.in_flight.done(chunk_id)


def steps(request) -> int:
    """The tokens the scripted decoder generates for a request (its forced <|0.00|> and prefix not counted)."""
    forced = 1 + len(request.prefix) if request.prefix else 0
    return len(hear_given(_samples_of(request), request.prefix)) - forced


def serve(sim: Sim, live, queue: StreamQueue, enabled: bool, now: float = 0.0, renew: bool = False) -> None:
    """The realtime session's turn (realtime.Session._on_result / _pump, synchronously) at simulated time `now`;
    renew: its re-decodes are brought up to date as they are taken (`Session._renewal`)."""
    for result in sim.inbox:
        sim.lags_s.append(sim.backlog.n_samples / SR)
        update = sim.policy.accept(sim.decode, result.tokens)
        sim.committed_at += [now] * len(words_of(update.delta))
        sim.decode, sim.final = None, update if update.final else sim.final
    sim.inbox.clear()
    at_end = sim.sent >= len(sim.audio)
    while sim.decode is None and not sim.final:
        action = next_action(sim.policy, sim.backlog, BLOCK, at_end, sim.ended, enabled)
        if action == "decode":
            sim.decode = sim.policy.request()
            sim.n_decodes += 1
            queue.submit(live, sim.decode.audio, sim.decode.hypothesis, sim.decode.prefix,
                         renewal(sim) if renew and enabled else None)
        elif action == "feed":
            catch_up(sim.policy, sim.backlog, BLOCK, at_end, enabled)
        elif action == "finish":
            sim.ended = True
            sim.final = sim.policy.finish()
        else:
            break


def renewal(sim: Sim):
    """The session's renew of a waiting re-decode (`Session._renewal`): `catchup.renewed` in its place."""

    def renew():
        decode = renewed(sim.policy, sim.backlog, BLOCK, sim.decode)
        if decode is None:
            return None
        sim.decode = decode
        return decode.audio, decode.hypothesis, decode.prefix

    return renew


def talk(seed: int, n_words: int, pauses: bool = False) -> list[int | None]:
    """n_words words (ids < 25, no word twice in a row: speech() would merge them), with pauses if asked."""
    rng = np.random.default_rng(seed)
    out: list[int | None] = []
    for _ in range(n_words):
        choices = [w for w in range(1, 25) if not out or w != out[-1]]
        out.append(int(rng.choice(choices)))
        if pauses and rng.random() < 0.1:
            out += [None, None]
    return out


@pytest.mark.parametrize("voice", [None, energy])
def test_more_streams_than_capacity_are_each_redecoded_less_often_and_none_starves(voice):
    """8 streams of 20 s; the engine re-decodes 2 a second (real time needs 8 a second: one a step each)."""
    words = [talk(seed, 40, pauses=voice is not None) for seed in range(8)]
    sims, end_s = simulate(words, rows=1, decode_s=0.5, voice=voice)
    audio_s = max(len(s.audio) for s in sims) / SR
    for sim, said in zip(sims, words):
        assert words_of(sim.final.text) == [f"w{w}" for w in said if w is not None]  # all, once, in order
        assert sim.n_decodes >= 4  # none starves
        assert max(sim.lags_s) <= 8 * 0.5 + 1.0  # one round of the queue (8 re-decodes): bounded, not growing
    counts = [s.n_decodes for s in sims]
    assert max(counts) <= 2 * min(counts)  # shared fairly
    assert sum(counts) <= (end_s / 0.5) + 1  # the engine's capacity was the limit...
    assert sum(counts) < 8 * audio_s / 2  # ...so each stream was re-decoded far less often than every step
    assert end_s <= audio_s + 2 * 8 * 0.5 + 0.5  # all finish within two rounds after their audio ends

    behind, end_behind = simulate(words, rows=1, decode_s=0.5, enabled=False, voice=voice)
    assert max(max(s.lags_s) for s in behind) > 3 * max(max(s.lags_s) for s in sims)  # without: lag grows
    assert end_behind > end_s + audio_s  # and the streams end long after their audio


@pytest.mark.parametrize("voice", [None, energy])
def test_a_fast_sender_gets_the_same_text_as_a_real_time_one(voice):
    words = talk(7, 60, pauses=voice is not None)
    texts = []
    for speed in (1.0, 4.0, 10.0):
        (sim,), _ = simulate([words], rows=1, decode_s=0.8, speed=speed, voice=voice)
        texts.append(sim.final.text)
        if speed == 10.0:
            assert sim.n_decodes < len(sim.audio) / SR / 2  # it did catch up: far fewer re-decodes than steps
    assert texts[0] == texts[1] == texts[2]
    assert words_of(texts[0]) == [f"w{w}" for w in words if w is not None]


def test_redecodes_reach_the_engine_with_their_committed_words_forced_and_the_text_is_the_same_without():
    """Through the server's queue: a re-decode's engine request carries its stream's committed words as its prefix
    (`ChunkRequest.prefix`), and the streams' texts are the same with and without it, catching up or not."""
    words = [talk(seed, 30, pauses=True) for seed in range(4)]
    for enabled in (True, False):
        texts = {}
        for on in (True, False):
            sims, _ = simulate(words, rows=1, decode_s=0.4, enabled=enabled, voice=energy, committed_prefix=on)
            texts[on] = [sim.final.text for sim in sims]
            n_forced = sum(bool(p) for sim in sims for p in sim.forced)
            assert (n_forced >= sum(s.n_decodes for s in sims) // 4) if on else n_forced == 0, n_forced
        assert texts[True] == texts[False]
        assert [words_of(t) for t in texts[True]] == [[f"w{w}" for w in said if w is not None] for said in words]


def test_waiting_redecodes_encoded_together_let_eight_streams_keep_up_where_one_at_a_time_does_not():
    """The server's grouping (`StreamDecodes.take_group`) with an engine whose encoder costs 0.13 s a call plus 0.12 s
    a window (alone 0.25 s, 0.14 s each at 8: whisper-base bf16 on the 2-core CPU) and whose rows wait while it
    encodes, 8 rows, 0.5 s of steps per 10 tokens generated: 8 streams, started 0.3 s apart. Taken one at a time (as
    each row frees) each window is encoded alone; held up to 1 s while another stream's is decoding, the streams
    fall into step and are encoded several at a time: more re-decodes a stream, a shorter commit latency, and the
    same text."""
    words = [talk(seed, 40) for seed in range(8)]
    runs = {}
    for wait_s in (0.0, 1.0):
        encodes: list[int] = []
        sims, _ = simulate(words, rows=8, decode_s=0.5, encoder=(0.13, 0.12), group_wait_s=wait_s, encodes=encodes,
                           stagger_s=0.3)
        for sim, said in zip(sims, words):
            assert words_of(sim.final.text) == [f"w{w}" for w in said]
        runs[wait_s] = (np.mean(encodes), sum(s.n_decodes for s in sims),
                        np.median(np.concatenate([commit_latencies(s) for s in sims])))
    alone, grouped = runs[0.0], runs[1.0]
    assert alone[0] < 1.5 and grouped[0] >= 3, runs  # windows per encoder call
    assert grouped[1] > alone[1] and grouped[2] < alone[2], runs  # re-decodes, median commit latency


def test_a_waiting_redecode_brought_up_to_date_as_it_is_taken_commits_sooner_with_the_same_text():
    """8 streams through the server's grouping as above, held up to 3 s: a re-decode that waited for the engine's
    turn is brought up to date as it is taken (the audio that arrived meanwhile fed, the policy asked again), so it
    covers the stream up to that turn: every word committed once, in order, as without, and sooner (median and
    95th percentile), on as many re-decodes."""
    words = [talk(seed, 40) for seed in range(8)]
    runs = {}
    for renew in (False, True):
        sims, _ = simulate(words, rows=8, decode_s=0.5, encoder=(0.13, 0.12), group_wait_s=3.0, stagger_s=0.3,
                           renew=renew)
        for sim, said in zip(sims, words):
            assert words_of(sim.final.text) == [f"w{w}" for w in said]
        latency = np.concatenate([commit_latencies(s) for s in sims])
        runs[renew] = (np.median(latency), np.percentile(latency, 95), sum(s.n_decodes for s in sims))
    assert runs[True][0] < runs[False][0] and runs[True][1] < runs[False][1], runs
    assert abs(runs[True][2] - runs[False][2]) <= 4, runs


def test_a_waiting_step_is_renewed_over_what_arrived_and_a_waiting_close_is_left_as_it_is():
    """`catchup.renewed` as the engine takes a waiting re-decode: a step is replaced by one over every whole block
    that arrived (the same kind of decode, never None, whenever it was asked); a close is left as it is, since new
    speech after its pause removes its close point and a step need not be due yet (a withdrawn close asked 0.2-0.5 s
    after the last step came back as no decode at all); fewer than a whole block waiting: left as it is."""
    audio = speech([1, 2, 3, 4, None, None, None, 5, 6])  # 2 s of words, a 1.5 s pause (closes at 0.8 s), 1 s
    for asked_s in (1.0, 1.3, 1.6, 1.9):  # a step asked with this much audio fed
        policy, backlog = StreamPolicy(KINDS, detokenize, StreamOptions(step_s=1.0), energy), Backlog(60 * SR)
        policy.feed(audio[:int(asked_s * SR)])
        step = policy.request()
        assert step.kind == "step"
        backlog.append(audio[int(asked_s * SR):int(asked_s * SR) + BLOCK // 2])
        assert renewed(policy, backlog, BLOCK, step) is None  # half a block: as it is
        backlog.append(audio[int(asked_s * SR) + BLOCK // 2:int(asked_s * SR) + 5 * BLOCK])
        fresh = renewed(policy, backlog, BLOCK, step)
        assert fresh is not None and fresh.kind == "step" and len(fresh.audio) == len(step.audio) + 5 * BLOCK
        assert backlog.n_samples == 0
        policy.accept(fresh, hear_given(fresh.audio, fresh.prefix))
    for lag_s in (0.2, 0.3, 0.4, 0.5):  # a close asked this long after the last step
        policy, backlog = StreamPolicy(KINDS, detokenize, StreamOptions(step_s=1.0), energy), Backlog(60 * SR)
        fed = 0
        for end in (1.0, 2.0):  # steps at 1 s and 2 s
            policy.feed(audio[fed:int(end * SR)])
            fed = int(end * SR)
            decode = policy.request()
            policy.accept(decode, hear_given(decode.audio, decode.prefix))
        policy.feed(audio[fed:int((2.8 + lag_s) * SR)])  # into the pause, past silence_s
        close = policy.request()
        assert close.kind == "close"
        backlog.append(audio[int((2.8 + lag_s) * SR):int(3.9 * SR)])  # the next word's onset arrives meanwhile
        assert renewed(policy, backlog, BLOCK, close) is None
        policy.accept(close, hear_given(close.audio, close.prefix))  # still the one in flight


def test_a_stream_behind_asks_for_a_shorter_close_at_once_not_once_its_buffer_is_full():
    """A close decode that said three words over 12 of them (none of it timed) is decoded again shorter
    (`hearing.shorter_close`): its audio is fed already, so a stream that is behind asks for it at once; a pause's
    close or a step waits while blocks are left (the next decode covers them)."""
    words = [w for i, x in enumerate(range(1, 16)) for w in ((x, None) if i % 3 == 2 else (x,))]
    policy, backlog = StreamPolicy(KINDS, detokenize, StreamOptions(step_s=1.0), energy), Backlog(60 * SR)
    policy.feed(speech(words + [None] * 2))  # fed at once (behind): the utterance and a pause that closes it
    close = policy.request()
    assert close.kind == "close"
    text = [t for t in hear_given(close.audio) if t < EOT]
    policy.accept(close, [TS, *text[:6], TS + len(close.audio) // 320, EOT])  # <|0.00|> w1 w2 w3 <|end|>
    assert policy.closing_short and policy.due() == "close"
    backlog.append(np.zeros(10 * BLOCK, np.float32))  # more audio waits
    assert next_action(policy, backlog, BLOCK, finishing=False, ended=False) == "decode"
    shorter = policy.request()
    assert shorter.kind == "close" and len(shorter.audio) < len(close.audio)
    policy.accept(shorter, hear_given(shorter.audio))
    assert not policy.closing_short


def test_the_queue_takes_a_waiting_redecode_as_its_renew_brings_it_up_to_date():
    """`StreamQueue.submit(..., renew)`: renew is called as the re-decode is taken, and what it gives (samples,
    hypothesis, prefix) is what is featurised and requested; None from it keeps the re-decode as submitted."""
    featurised = []
    queue = StreamQueue(_Session(), lambda samples: featurised.append(samples) or _as_features(samples),
                        threading.Condition())
    a, b = queue.open(lambda outcome: None), queue.open(lambda outcome: None)
    fresh = np.ones(3 * BLOCK, np.float32)
    queue.submit(a, np.zeros(BLOCK, np.float32), (1,), (2,), renew=lambda: (fresh, (3,), (4,)))
    queue.submit(b, np.zeros(BLOCK, np.float32), (5,), (6,), renew=lambda: None)
    first, second = queue.take_group(8)
    assert featurised[0][0] is fresh and (first.hypothesis, first.prefix) == ((3,), (4,))
    assert len(featurised[0][1]) == BLOCK and (second.hypothesis, second.prefix) == ((5,), (6,))
    assert queue.counts.renewed == 1 and queue.counts.taken == 2


def test_a_renew_that_raises_fails_its_stream_only():
    """A renew raised in the engine's source: the run failed (every upload and stream with it), and the streams
    whose re-decodes had been taken, counted in no lost set, waited for a result forever."""
    outcomes = {}
    queue = StreamQueue(_Session(), _as_features, threading.Condition())
    a = queue.open(lambda outcome: outcomes.setdefault("a", outcome))
    b = queue.open(lambda outcome: outcomes.setdefault("b", outcome))

    def broken():
        raise RuntimeError("policy state")

    queue.submit(a, np.zeros(BLOCK, np.float32), (1,), (2,), renew=broken)
    queue.submit(b, np.zeros(BLOCK, np.float32), (5,), (6,))
    (taken,) = queue.take_group(8)
    assert taken.hypothesis == (5,) and a.in_engine is None and b.in_engine is not None
    assert outcomes == {"a": "decoding failed (RuntimeError: policy state)"}


def commit_latencies(sim: Sim) -> np.ndarray:
    """Seconds from each word's end (speech(): 0.5 s a word, no pauses) to the delta that committed it, for the
    words committed by agreement while the audio was still coming (the final commit excluded)."""
    audio_s = len(sim.audio) / SR
    ends = (np.arange(len(sim.committed_at)) + 1) * WORD_SAMPLES / SR
    at = np.array(sim.committed_at)
    return (at - ends)[at <= audio_s]


def test_with_catching_up_a_shorter_step_spends_spare_capacity_on_latency_and_costs_little_without():
    """What sets a stream's commit latency (fake clock; an engine that takes decode_s per re-decode whatever it
    covers, as the encoder's 30 s window does). A word is committed when two decodes agree on it: the one asked at
    the first step after it was heard and the next one, so latency is about step_s + decode_s while the engine
    keeps up (here, words ending on step boundaries: 1.8 s at step_s 1, decode_s 0.6). With catching up a step due
    while a block waits waits for the next result, so step_s is only the least spacing of a stream's decodes: a
    step shorter than a decode makes them back to back, 2 x decode_s (1.4 s). When the engine is the limit (8
    streams, one row, 2 re-decodes a second) the spacing is its round whatever step_s says: the same re-decodes,
    latency about 2.4 rounds, a little more at the shorter step (its first tiny re-decodes take turns: 10.8 s
    against 9.7 s here)."""
    words = talk(3, 60)
    latency = {}
    for step_s in (1.0, 0.3):
        (sim,), _ = simulate([words], rows=1, decode_s=0.6, step_s=step_s)
        assert words_of(sim.final.text) == [f"w{w}" for w in words]
        latency[step_s] = np.median(commit_latencies(sim))
    assert latency[0.3] <= latency[1.0] - 0.3, latency

    loaded = {}
    many = [talk(seed, 30) for seed in range(8)]
    for step_s in (1.0, 0.3):
        sims, _ = simulate(many, rows=1, decode_s=0.5, step_s=step_s)
        for sim, said in zip(sims, many):
            assert words_of(sim.final.text) == [f"w{w}" for w in said]
        loaded[step_s] = (np.median(np.concatenate([commit_latencies(s) for s in sims])),
                          sum(s.n_decodes for s in sims))
    assert loaded[0.3][0] <= 1.15 * loaded[1.0][0], loaded  # the round sets it
    assert abs(loaded[0.3][1] - loaded[1.0][1]) <= 8, loaded  # and the engine ran as many re-decodes


def test_the_backlog_is_bounded_and_hands_out_blocks_however_appends_were_cut():
    backlog = Backlog(5 * BLOCK)
    backlog.append(np.arange(1000, dtype=np.float32))
    backlog.append(np.arange(1000, 4000, dtype=np.float32))
    assert backlog.take(BLOCK) is not None and backlog.n_samples == 4000 - BLOCK
    with pytest.raises(BacklogFull, match="audio backlog full: 0.8 s received and not yet decoded, the limit is 0.5 s"):
        backlog.append(np.zeros(10_000, np.float32))
    assert backlog.n_samples == 4000 - BLOCK  # the refused append was not kept
    assert backlog.take(BLOCK).tolist() == list(range(BLOCK, 2 * BLOCK))
    assert backlog.take(BLOCK) is None  # 800 left: not a whole block
    assert backlog.take(BLOCK, at_end=True).tolist() == list(range(3200, 4000))
    assert backlog.take(BLOCK, at_end=True) is None and backlog.seconds == 0
