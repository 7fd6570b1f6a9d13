"""Live streams in one process (`asr-spec stream`, `Transcriber.streams` / `stream`): every stream's due decode goes
through the many-streams runner (decodes.py, the server's too) into one engine run (rows shared), the results go
back to each stream's policy, and the updates come out.

    runner = asr.streams()            # asr: a Transcriber; a live EngineSession decodes (session.py)
    stream = runner.open()            # as many as wanted
    stream.feed(samples)              # (n,) float32 16 kHz blocks, as they arrive
    for stream, update in runner.pump():   # decodes what is due now, all streams in one batch
        print(stream.id, update.delta, update.tentative)
    stream.finish()                   # then pump() until stream.done

Each decode offers the stream's previous hypothesis as the engine's draft (`ChunkRequest.hypothesis`, unless
`offer_hypothesis` is off: plain re-decoding, the same text). The engine decodes in Whisper's timestamp mode.
"""

from __future__ import annotations

import copy
import itertools
import weakref
from collections.abc import Callable, Hashable
from typing import Any

import numpy as np

from asr_spec.audio.features import FeatureBatcher
from asr_spec.engine import ChunkRequest, ChunkResult, ChunkStats, Engine
from asr_spec.errors import InputError, interrupts_held
from asr_spec.stream.agreement import TokenKinds, starts_word
from asr_spec.stream.decodes import LiveStream, StreamDecodes
from asr_spec.stream.frames import VoiceFn
from asr_spec.stream.options import stream_options
from asr_spec.stream.policy import Decode, StreamOptions, StreamPolicy, Update


def token_kinds(tokenizer: Any, eot: int, timestamp_begin: int, max_prefix: int) -> TokenKinds:
    """The `TokenKinds` of a Whisper tokenizer: a text token starts a word by the rule of word times and seams
    (`agreement.starts_word` on its decoded text: a leading space, or a character of a script written without
    spaces, so that Chinese or Japanese text is agreed on and committed word by word, not as one word up to a
    pause); max_prefix: the model's limit on a forced prefix (`WhisperTokens.max_prompt_tokens`)."""
    return TokenKinds(eot, timestamp_begin, _word_starts(tokenizer, eot), max_prefix)


_WORD_STARTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> {eot: (eot + 1,) bool}


def _word_starts(tokenizer: Any, eot: int) -> np.ndarray:
    """(eot + 1,) bool: whether each token below `eot` starts a word (`starts_word` of its decoded text; eot
    does not); decoded once per tokenizer (~0.4 s for whisper's 50,257), not at every stream runner."""
    known = _WORD_STARTS.setdefault(tokenizer, {})
    if eot not in known:
        texts = tokenizer.batch_decode([[token_id] for token_id in range(eot)])
        known[eot] = np.array([starts_word(text) for text in texts] + [False], dtype=bool)
    return known[eot]


class Stream:
    """One live stream of a `StreamRunner`: feed it audio blocks, finish it; its updates come from `pump`."""

    def __init__(self, stream_id: Hashable, policy: StreamPolicy, decodes: StreamDecodes):
        self.id, self.policy = stream_id, policy
        self.stats = ChunkStats(chunks=0)  # the engine's counts over every decode of this stream
        self.text = ""  # committed so far
        self._pending: list[Update] = []
        self._results: list[ChunkResult | str] = []  # its decodes' results, as the runner delivers them
        self.live: LiveStream = decodes.open(self._results.append)

    def feed(self, samples: np.ndarray) -> None:
        """Append (n,) float32 16 kHz mono samples."""
        self._check_open()
        self.policy.feed(samples)

    def finish(self) -> None:
        """End of input: the final update comes from the next `pump` (at once when nothing is left to decode)."""
        self._check_open()
        final = self.policy.finish()
        if final is not None:
            self._pending.append(final)

    @property
    def done(self) -> bool:
        """No update comes from it any more: its final one was returned, or it was closed (`StreamRunner.close`)."""
        return self.live.closed or (self.policy.done and not self._pending)

    def _check_open(self) -> None:
        """A closed stream takes no audio: it would be dropped, and its final update would never come."""
        if self.live.closed:
            raise InputError(f"stream {self.id!r} is closed")


class StreamRunner:
    """Streams sharing one engine (see the module docstring).

    session: the engine session that decodes (`asr_spec.transcribe.session.EngineSession`, live: its `engine`
    decodes in timestamp mode, its `run(requests, batch_size)` yields the results); features: the target's
    `FeatureBatcher`; tokenizer: the target's; voice: a factory of per-stream speech-probability functions
    (None: no voice activity, a stream is only trimmed by its segments and closed at its end); batch_size: engine
    rows.
    """

    def __init__(self, session: Any, features: FeatureBatcher, tokenizer: Any, options: StreamOptions | None = None,
                 voice: Callable[[], VoiceFn] | None = None, batch_size: int = 8, offer_hypothesis: bool = True):
        engine: Engine = session.engine
        if not engine.options.timestamps:
            raise InputError("streaming decodes in Whisper's timestamp mode: the engine's options.timestamps is off")
        self.session, self.engine, self.features, self.tokenizer = session, engine, features, tokenizer
        self.options = stream_options(options)
        self.voice, self.batch_size, self.offer_hypothesis = voice, batch_size, offer_hypothesis
        tokens = engine.tokens
        self.kinds = token_kinds(tokenizer, tokens.eot, tokens.timestamp_begin, tokens.max_prompt_tokens)
        self.streams: dict[Hashable, Stream] = {}
        self.decodes = StreamDecodes(session, features)  # the streams' decodes on their way through the session
        self._ids = itertools.count()
        self.stats = ChunkStats(chunks=0)  # over every decode of every stream

    def detokenize(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens)

    def open(self, stream_id: Hashable | None = None) -> Stream:
        """A new stream (its id: the next integer unless given)."""
        key = next(self._ids) if stream_id is None else stream_id
        if key in self.streams:
            raise InputError(f"stream {key!r} is open already")
        stream = Stream(key, self.new_policy(f"stream {key}"), self.decodes)
        self.streams[key] = stream
        return stream

    def new_policy(self, label: str | None = None) -> StreamPolicy:
        """The policy of one more stream, as `open` makes each (its own voice state), for a caller that runs the
        decodes itself (the server's /v1/realtime); `label` names it in the trace (`StreamPolicy.label`)."""
        voice = None if self.voice is None else self.voice()
        return StreamPolicy(self.kinds, self.detokenize, self.options, voice, label)

    def close(self, stream: Stream) -> None:
        """Forget a stream (finished or abandoned): it takes no row from now on."""
        self.streams.pop(stream.id, None)
        self.decodes.close(stream.live)

    def pump(self) -> list[tuple[Stream, Update]]:
        """Decode every stream's due decode in one engine run, until none is due; returns the updates, in order.
        A finished stream is forgotten once its final update is returned. A pump that raises (Ctrl-C, or the
        engine's run failed) loses nothing: the decodes of that run are withdrawn from their streams (`_withdraw`:
        the next pump asks for them again) and the updates it had collected come from the next pump."""
        out = [(s, u) for s in self.streams.values() for u in s._pending]
        for stream, _ in out:
            stream._pending = []
        try:
            while due := self.due():
                self.deliver(due, self._run(due), out)
        except BaseException:
            for stream, update in out:  # each stream's in their order
                stream._pending.append(update)
            raise
        for stream, update in out:
            if update.final:
                self.close(stream)
        return out

    def _run(self, due: list[tuple[Stream, Decode]]) -> list[ChunkResult]:
        """The engine's results of `due`'s decodes, in its order (one engine run); raising, their decodes are
        withdrawn first."""
        try:
            requests = self.requests(due)
            source = self.session.source(requests)
            results = {r.id: r for r in self.session.run(source, min(self.batch_size, len(requests)))}
        except BaseException as err:
            self._withdraw(due, err)
            raise
        return [results[r.id] for r in requests]

    def _withdraw(self, due: list[tuple[Stream, Decode]], err: BaseException) -> None:
        """A run that raised (or was interrupted) lost `due`'s decodes: the session's counts start clean, the
        decodes' streams are told as a failed run's are (`StreamDecodes.fail`, their owners' too: one interrupted
        before the engine took it), and each decode is withdrawn from its policy, to be asked for again."""
        owners = self.session.lost() | {stream.live.owner for stream, _ in due}
        self.decodes.fail(owners, f"{type(err).__name__}: {err}")
        for stream, decode in due:
            stream._results.clear()  # that failure, told to it: no result of this run comes
            stream.policy.withdraw(decode)

    # -- the three parts of a pump, public for a benchmark that decodes the same requests two ways ----------------
    def due(self) -> list[tuple[Stream, Decode]]:
        """Every open stream's decode due now (`StreamPolicy.request`)."""
        return [(s, d) for s in list(self.streams.values()) if (d := s.policy.request()) is not None]

    def requests(self, due: list[tuple[Stream, Decode]]) -> list[ChunkRequest]:
        """The engine requests of `due`, in its order (`StreamDecodes.submit`, then `take_all`: the buffers'
        features made together), each with its stream's previous hypothesis unless offer_hypothesis is off."""
        for stream, decode in due:
            self.decodes.submit(stream.live, decode.audio, decode.hypothesis if self.offer_hypothesis else (),
                                decode.prefix)
        return self.decodes.take_all()

    def deliver(self, due: list[tuple[Stream, Decode]], results: list[ChunkResult],
                out: list[tuple[Stream, Update]] | None = None) -> list[tuple[Stream, Update]]:
        """Hand each decode's result (`results` in the order of `due`) to its stream through the runner
        (`StreamDecodes.deliver`); returns the updates, in that order, appended to `out` (a new list if None) as
        each comes (`pump` forgets a stream once its final update is returned). A Ctrl-C while it runs is held
        until every result is handed out (`errors.interrupts_held`, in the main thread); interrupted part-way all the
        same (elsewhere, or by another exception), nothing is lost: an update its policy made is in `out`, and a
        decode not yet accepted is withdrawn from its policy (`_settle`), to be asked for again."""
        out = [] if out is None else out
        first = len(out)
        try:
            with interrupts_held():  # a Ctrl-C inside `accept` would leave its policy half changed
                for result in results:
                    self.decodes.deliver(result)
                for stream, decode in due:
                    result = stream._results.pop(0)
                    if isinstance(result, str):  # lost by the engine (`_run` raises then): a bug if it comes here
                        raise RuntimeError(f"stream {stream.id!r}: {result}")
                    update = stream.policy.accept(decode, result.tokens)
                    out.append((stream, update))
                    stream.text = update.text
                    stream.stats = stream.stats.add(result.stats)
                    self.stats = self.stats.add(result.stats)
        except BaseException:
            self._settle(due, out, first)
            raise
        return out

    @staticmethod
    def _settle(due: list[tuple[Stream, Decode]], out: list[tuple[Stream, Update]], first: int) -> None:
        """After `deliver` was interrupted: each of `due`'s decodes its policy still has in flight is withdrawn
        (its result dropped: the stream asks for it again, with what arrived since); one accepted whose update did
        not reach `out` (the interrupt came as `accept` returned) has it taken from its policy
        (`StreamPolicy.last_accepted`). (One interrupted inside `accept`, outside the main thread, is neither: its
        policy is left as the interrupt found it.)"""
        delivered = {id(stream) for stream, _ in out[first:]}
        for stream, decode in due:
            accepted = stream.policy.last_accepted
            if stream.policy.in_flight is decode:
                stream._results.clear()
                stream.policy.withdraw(decode)
            elif id(stream) not in delivered and accepted is not None and accepted[0] is decode:
                out.append((stream, accepted[1]))
                stream.text = accepted[1].text


def silero_voices() -> Callable[[], VoiceFn]:
    """A factory of per-stream silero-vad probability functions sharing one model (each its own state)."""
    from asr_spec.audio.silero import SileroVad

    base = SileroVad()

    def make() -> VoiceFn:
        voice = copy.copy(base)
        voice.reset()
        return voice

    return make
