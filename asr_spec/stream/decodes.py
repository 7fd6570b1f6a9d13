"""Many live streams through one engine session: the one many-streams runner, for `asr-spec stream` (driver.py)
and the server's `/v1/realtime` (serve/stream_jobs.py) alike.

    a stream's policy ──submit(stream, audio, hypothesis, prefix)──► one waiting re-decode per stream (a newer one
    replaces it) ──take / take_all / take_group (featurised now)──► the engine session's run ──ChunkResult──► deliver
    ──stream.on_result──► the caller hands it to the stream's policy

A stream holds at most one re-decode waiting and one in the engine: a newer one taken while an older one is still
decoding withdraws the stale one (`EngineSession.withdraw`: its row freed before the next step), so memory per
stream is one window of samples and its features.

A server takes the waiting re-decodes as a group (`take_group`) of at most what the engine encodes in one call (4
windows on a CPU: the batcher's `Engine.encode_batch`): on an AMX Xeon a window encoded alone costs more than one of
a batch (whisper-base, bf16: about 0.25 s alone, 0.14 s each at 8); and while another stream's re-decode is in the
engine (its result comes back soon, and its stream then submits its next one) the waiting ones are held, at most
`group_wait_s` after the oldest of them was submitted, so that no group's encoding stalls another's rows mid-way:
streams fall into step, each group decoded to its end before the next is encoded (unless that one has waited
`group_wait_s`). A re-decode submitted with a `renew` is brought up to date as it is taken (the server's sessions:
the audio that arrived while it waited, so a held or queued re-decode covers the stream up to the engine's turn, not
only up to its submit).

Each re-decode carries its stream's prompt (`StreamPrompt`: the previous text the transcriber gives an input's
first window offline, its initial prompt and hotwords, computed once per stream runner or server): fitted beside
the re-decode's forced prefix, so the two hold at most the model's `max_prompt_tokens`, as they do offline.

A re-decode generates no more tokens than its audio can hold (`hearing.token_budget`: a loop past the audio, which
would run to the model's 448 positions while the other rows of its group wait, is cut there), at its stream's rate
(`hearing.budget_rate`, from what its finished re-decodes said: a script of more tokens a second gets more).

`close` drops the stream's waiting re-decode and withdraws the one in the engine; a result that still comes back
for it is ignored. What is in the engine is the session's count (`EngineSession.in_flight`), read here, not kept.

Request ids are `ChunkId(StreamKey(stream id), re-decode number)`: this module is the only one that makes them
(tests/test_layout.py), and `deliver` routes results by that owner. Thread-safe: the streams' side (submit,
close) and the engine's side (take, deliver) may run in different threads.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from asr_spec.checks import seconds_at_least_zero
from asr_spec.chunk_id import ChunkId, StreamKey
from asr_spec.engine import ChunkRequest, ChunkResult
from asr_spec.stream.hearing import RATE_HISTORY, budget_rate, hypothesis_rate, ids_loop, token_budget

__all__ = ["GROUP_WAIT_S", "NO_PROMPT", "DecodeCounts", "LiveStream", "StreamDecodes", "StreamPrompt", "is_stream_id"]

log = logging.getLogger(__name__)
_stream_ids = itertools.count()
# the longest a waiting re-decode is held for others to be encoded with it (`take_group`); it is held only while
# another stream's is in the engine, and brought up to date when taken (`submit`'s renew), so a long hold costs a
# word no staleness: 8 real-time streams through the server, AVX-512-BF16 EPYC (docs/live.md, "A waiting
# re-decode brought up to date"), commit latency p95 7.40-9.61 s at 10 s (median 8.43 s, eight runs), 8.24-9.42 s
# at 3 s (four), 9.23-9.81 s at 1 s (four)
GROUP_WAIT_S = 10.0


@dataclass(frozen=True)
class StreamPrompt:
    """The previous text every re-decode of a stream carries (`ChunkRequest.prompt`, after <|startofprev|>).

    tokens:     the token ids the transcriber gives an input's first window offline (`Transcriber.stream_prompt`:
                hotwords, then the initial prompt's last tokens); () = none.
    max_tokens: the most a re-decode's prompt and forced prefix hold together (`WhisperTokens.max_prompt_tokens`,
                as an offline first window's prompt and prefix do: `prompts.encode_prompt`).
    """

    tokens: tuple[int, ...]
    max_tokens: int

    def fitted(self, n_prefix: int) -> tuple[int, ...]:
        """The prompt of a re-decode that forces `n_prefix` tokens (its committed words): the last
        `max_tokens - n_prefix` of `tokens`, () when the prefix leaves no room. The committed words are the
        stream's transcript, so the prompt gives way; its first tokens go (the hotwords, then the initial prompt's
        words farthest from the audio), as `encode_prompt` keeps a prompt's last tokens beside a prefix."""
        room = self.max_tokens - n_prefix
        return self.tokens[-room:] if room > 0 else ()


NO_PROMPT = StreamPrompt((), 0)  # streams of a transcriber with no initial prompt or hotwords


@dataclass(eq=False)
class LiveStream:
    """One open stream as the engine's side sees it.

    on_result: called (from the thread that runs the engine) with each re-decode's `ChunkResult`, or with an error
               message (str) when the engine lost it; it must not block.
    """

    on_result: Callable[[ChunkResult | str], None]
    id: int = field(default_factory=lambda: next(_stream_ids))
    n_submitted: int = 0  # re-decodes submitted so far (the last element of their ids)
    in_engine: ChunkId | None = None  # the request id of its re-decode taken for the engine, if any
    taken_s: float = 0.0  # the clock's time when that re-decode was taken
    taken_samples: int = 0  # the audio it holds
    closed: bool = False
    # tokens a second of audio its recent re-decodes said, of those that ended (`hearing.budget_rate`)
    rates: deque[float] = field(default_factory=lambda: deque(maxlen=RATE_HISTORY))
    n_cut: int = 0  # its re-decodes in a row, up to the last, that ran out of their token budget
    prompt: StreamPrompt = NO_PROMPT  # the previous text each of its re-decodes carries

    @property
    def owner(self) -> StreamKey:
        """The owner of its requests (`ChunkId.owner`)."""
        return StreamKey(self.id)


# () -> (samples, hypothesis, prefix) of a stream's re-decode brought up to date, in place of the waiting one, or
# None to keep that one; called (by the thread that takes it) as the engine takes it, outside the queue's lock
Renew = Callable[[], "tuple[np.ndarray, tuple[int, ...], tuple[int, ...]] | None"]


@dataclass(frozen=True)
class _Pending:
    stream: LiveStream
    request_id: ChunkId
    samples: np.ndarray  # (n_samples,) float32 16 kHz, at most one window
    hypothesis: tuple[int, ...]  # token ids offered as the re-decode's draft
    prefix: tuple[int, ...]  # token ids forced as the start of its transcript (its committed words)
    submitted_s: float  # the clock's time at submit
    renew: Renew | None = None  # () -> the stream's re-decode brought up to date when taken, or None: as it is


@dataclass
class DecodeCounts:
    """What happened to the streams' re-decodes since the queue was made (benchmarks read `StreamDecodes.counts`).
    Every submitted re-decode is replaced while waiting, dropped by `close`, still waiting, or taken; every taken
    one is delivered, withdrawn (stale, or its stream closed), lost with a run, or still in the engine."""

    submitted: int = 0
    replaced: int = 0  # a waiting re-decode replaced by its stream's newer one before the engine took it
    taken: int = 0  # handed to the engine
    withdrawn: int = 0  # taken, then withdrawn from the engine (a newer one of its stream was taken, or it closed)
    delivered: int = 0  # results handed to their stream
    renewed: int = 0  # taken brought up to date: the audio that arrived while it waited added (`submit`'s renew)
    wait_s: float = 0.0  # summed over the taken: seconds from submit to take (waiting for the engine)
    max_wait_s: float = 0.0
    engine_s: float = 0.0  # summed over the delivered: seconds from take to result (encoder, rows, steps)


class StreamDecodes:
    """The streams' re-decodes waiting for the engine, and which stream each one in the engine belongs to.

    session:   the engine session that decodes them (`asr_spec.transcribe.session.EngineSession`): its
               `withdraw(chunk id)` and its `in_flight` count are used.
    featurise: (samples list) -> (B, n_mels, n_frames) features (the transcriber's `FeatureBatcher`).
    lock:      the lock (a `threading.Condition`) everything here happens under; a submission notifies it (the
               server passes its batcher's, whose idle source waits on it). Default: one of its own.
    group_wait_s: the longest `take_group` holds a waiting re-decode for others to join it (0: never held).
    clock:     seconds, for waits and holds (time.monotonic; a test's simulated clock).

    prompt:    the `StreamPrompt` of each stream opened from now on (NO_PROMPT until its owner sets it:
               `Transcriber.streams`, the server's `Batcher`, each from `Transcriber.stream_prompt`).
    """

    def __init__(self, session: Any, featurise: Callable[[list[np.ndarray]], Any],
                 lock: threading.Condition | None = None, group_wait_s: float = GROUP_WAIT_S,
                 clock: Callable[[], float] = time.monotonic):
        seconds_at_least_zero(group_wait_s, "group_wait_s")
        self.group_wait_s = float(group_wait_s)
        self._clock = clock
        self.session = session
        self._featurise = featurise
        self._cond = threading.Condition() if lock is None else lock
        self._open: dict[int, LiveStream] = {}
        self._waiting: OrderedDict[int, _Pending] = OrderedDict()  # by stream id, oldest first
        self.counts = DecodeCounts()
        self.prompt = NO_PROMPT

    # -- the streams' side -----------------------------------------------------------------------------------
    def open(self, on_result: Callable[[ChunkResult | str], None]) -> LiveStream:
        """A new stream, its re-decodes carrying `prompt`."""
        with self._cond:
            stream = LiveStream(on_result, prompt=self.prompt)
            self._open[stream.id] = stream
            return stream

    def submit(self, stream: LiveStream, samples: np.ndarray, hypothesis: tuple[int, ...] = (),
               prefix: tuple[int, ...] = (), renew: Renew | None = None) -> None:
        """Queue a re-decode of `samples` ((n,) float32, 16 kHz, at most one window) for `stream`, replacing its
        waiting one if any; prefix: token ids forced after <|0.00|> (the stream's committed words of that audio:
        `ChunkRequest.prefix`, generated no more); hypothesis: the stream's previous hypothesis of what follows,
        offered to the engine as the draft of the re-decode's first generated tokens (`ChunkRequest.hypothesis`);
        renew: called when the engine takes it, for the same re-decode over the audio that arrived while it waited
        (its stream must not change it meanwhile); None from it, or no renew: taken as submitted."""
        with self._cond:
            if stream.closed:
                return
            stream.n_submitted += 1
            request_id = ChunkId(stream.owner, stream.n_submitted)
            self.counts.submitted += 1
            self.counts.replaced += self._waiting.pop(stream.id, None) is not None
            self._waiting[stream.id] = _Pending(stream, request_id, samples, tuple(hypothesis), tuple(prefix),
                                                self._clock(), renew)
            self._cond.notify_all()

    def close(self, stream: LiveStream) -> None:
        """The stream is over (ended, or its client went away): drop its waiting re-decode and withdraw the one in
        the engine (its row freed now)."""
        with self._cond:
            stream.closed = True
            self._waiting.pop(stream.id, None)
            self._open.pop(stream.id, None)
            in_engine, stream.in_engine = stream.in_engine, None
            self.counts.withdrawn += in_engine is not None
        if in_engine is not None:
            self.session.withdraw(in_engine)

    @property
    def n_open(self) -> int:
        return len(self._open)

    @property
    def n_waiting(self) -> int:
        return len(self._waiting)

    @property
    def n_in_engine(self) -> int:
        """The streams' re-decodes in the engine (the session's count)."""
        return self.session.in_flight.total(_is_stream_owner)

    @property
    def idle(self) -> bool:
        """No re-decode waits or is in the engine."""
        return not self._waiting and not self.n_in_engine

    # -- the engine's side -----------------------------------------------------------------------------------
    def take(self) -> ChunkRequest | None:
        """The oldest waiting re-decode as an engine request (featurised now), or None when none waits."""
        requests = self._take(1)
        return requests[0] if requests else None

    def take_all(self) -> list[ChunkRequest]:
        """Every waiting re-decode as engine requests, oldest first, featurised together."""
        return self._take(None)

    def take_group(self, n: int) -> list[ChunkRequest]:
        """Up to `n` waiting re-decodes (the oldest; n: the windows the engine encodes at once, or its rows) as
        engine requests, featurised together, for the engine to encode together; [] when none waits or while they
        are held for more to join them (`held`)."""
        with self._cond:
            if self.held(self._clock()):
                return []
        return self._take(n)

    def held(self, now_s: float) -> bool:
        """Whether `take_group` holds the waiting re-decodes at the clock's time `now_s`: some wait, another
        stream's re-decode is in the engine (its stream submits its next one when its result comes back), and the
        oldest waiting was submitted less than `group_wait_s` ago."""
        with self._cond:
            if not self._waiting or now_s - next(iter(self._waiting.values())).submitted_s >= self.group_wait_s:
                return False
            return any(s.in_engine is not None and s.id not in self._waiting for s in self._open.values())

    def _take(self, n: int | None) -> list[ChunkRequest]:
        """Up to n (None: all) waiting re-decodes, each marked as its stream's one in the engine; a stale one
        that stream still had there is withdrawn."""
        with self._cond:
            n = len(self._waiting) if n is None else min(n, len(self._waiting))
            taken = [self._waiting.popitem(last=False)[1] for _ in range(n)]
            stale = []
            now = self._clock()
            for pending in taken:
                if pending.stream.in_engine is not None:
                    stale.append(pending.stream.in_engine)
                pending.stream.in_engine, pending.stream.taken_s = pending.request_id, now
                self.counts.wait_s += now - pending.submitted_s
                self.counts.max_wait_s = max(self.counts.max_wait_s, now - pending.submitted_s)
            self.counts.taken += len(taken)
            self.counts.withdrawn += len(stale)
        for chunk_id in stale:
            self.session.withdraw(chunk_id)
        renewed = [self._renewed(pending) for pending in taken]
        with self._cond:
            self.counts.renewed += sum(new is not old for new, old in zip(renewed, taken))
            taken = [pending for pending in renewed if pending is not None]
            budgets = [_budget(pending) for pending in taken]
        if not taken:
            return []
        features = self._featurise([pending.samples for pending in taken])  # (B, n_mels, n_frames)
        return [_request(pending, features[i], budget) for i, (pending, budget) in enumerate(zip(taken, budgets))]

    def _renewed(self, pending: _Pending) -> _Pending | None:
        """A taken re-decode brought up to date (`_renewed`); None when its renew raised: that stream is told its
        decoding failed and nothing of it goes to the engine (it raised in the engine's source, failing the run
        of every upload and stream; the streams whose re-decode it had taken, in no lost set, waited forever)."""
        try:
            return _renewed(pending)
        except Exception as err:
            log.exception("stream %s: bringing its re-decode up to date failed", pending.stream.id)
            with self._cond:
                if pending.stream.in_engine == pending.request_id:
                    pending.stream.in_engine = None
            _notify(pending.stream, f"decoding failed ({type(err).__name__}: {err})")
            return None

    def deliver(self, result: ChunkResult) -> bool:
        """Hand a result to its stream; False when `result` is not a stream's (an upload chunk's). A result of a
        closed stream, or a stale re-decode, is dropped; a refused one (`ChunkResult.error`) fails its stream."""
        if not is_stream_id(result.id):
            return False
        with self._cond:
            stream = self._open.get(result.id.owner.stream)
            if stream is None or stream.in_engine != result.id:
                return True
            stream.in_engine = None
            self.counts.delivered += 1
            self.counts.engine_s += self._clock() - stream.taken_s
            _observe(stream, result)
        # a re-decode the engine refused (engine/refusals.py) fails its stream as a lost one does (`fail`)
        _notify(stream, result if result.error is None else f"decoding failed ({result.error})")
        return True

    def fail(self, owners: set[Hashable], cause: str) -> None:
        """The engine's run failed and lost the requests of `owners` (`EngineSession.lost`): tell those streams."""
        with self._cond:
            lost = [s for s in self._open.values() if s.in_engine is not None and s.owner in owners]
            for stream in lost:
                stream.in_engine = None
        for stream in lost:
            _notify(stream, f"decoding failed ({cause})")

    def stop(self, cause: str) -> None:
        """No more decoding (the server is going): drop what waits and tell every open stream."""
        with self._cond:
            streams = list(self._open.values())
            self._waiting.clear()
        for stream in streams:
            _notify(stream, cause)


def _renewed(pending: _Pending) -> _Pending:
    """A taken re-decode brought up to date by its `renew` (then without one), else as it is."""
    fresh = pending.renew() if pending.renew is not None else None
    if fresh is None:
        return pending
    samples, hypothesis, prefix = fresh
    return replace(pending, samples=samples, hypothesis=tuple(hypothesis), prefix=tuple(prefix), renew=None)


def _request(pending: _Pending, features: Any, budget: int) -> ChunkRequest:
    """The engine request of a taken re-decode: its features ((n_mels, n_frames)), its stream's prompt fitted
    beside its prefix (`StreamPrompt.fitted`), its prefix and hypothesis, at most `budget` new tokens."""
    prompt = pending.stream.prompt.fitted(len(pending.prefix))
    return ChunkRequest(pending.request_id, features, prompt=prompt, prefix=pending.prefix,
                        hypothesis=pending.hypothesis, max_new_tokens=budget)


def _budget(pending: _Pending) -> int:
    """The most tokens a taken re-decode may generate (`hearing.token_budget` at its stream's `budget_rate`); its
    audio noted for the rate its result gives (`_observe`)."""
    stream = pending.stream
    stream.taken_samples = len(pending.samples)
    return token_budget(len(pending.samples), len(pending.prefix), budget_rate(stream.rates, stream.n_cut))


def _observe(stream: LiveStream, result: ChunkResult) -> None:
    """What a delivered re-decode says of its stream's token rate (`hearing.budget_rate`): one that ran out of its
    budget (finish_reason "length") counts a cut, unless its ids loop (`hearing.ids_loop`); one that ended, its
    tokens a second of audio (`hearing.hypothesis_rate`)."""
    if result.finish_reason == "length":
        stream.n_cut += int(not ids_loop(result.tokens))  # a loop says nothing of the speech's rate
        return
    stream.n_cut = 0
    stream.rates.append(hypothesis_rate(len(result.tokens), stream.taken_samples))


def is_stream_id(request_id: Any) -> bool:
    """Whether an engine request id is a live stream's re-decode."""
    return isinstance(request_id, ChunkId) and isinstance(request_id.owner, StreamKey)


def _is_stream_owner(owner: Hashable) -> bool:
    return isinstance(owner, StreamKey)


def _notify(stream: LiveStream, outcome: ChunkResult | str) -> None:
    try:
        stream.on_result(outcome)
    except Exception:  # a callback's bug must not stop the engine's thread
        log.exception("stream %s: result callback failed", stream.id)
