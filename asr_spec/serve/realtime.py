"""`/v1/realtime`: live transcription over a WebSocket, vLLM's realtime protocol (events: realtime_events.py).

    client ──append (PCM16 16 kHz)──► backlog (bounded: past it an error event, code backlog_full, and a close)
    ──0.1 s blocks, caught up (stream/catchup.py)──► the stream's policy ──re-decode due──► StreamQueue.submit
    ──the server's one engine run, rows shared with uploads──► result ──policy.accept──► transcription.delta
    (newly committed text) [+ transcription.tentative] ... commit final ──► the policy's last re-decodes ──►
    transcription.done (the whole text, usage)

A connection holds one stream (`--max-streams` in all; past it the connection gets an error event and is closed
with code 1013, "try again later"); a connection with no audio appended for `idle_timeout_s` (60 s), while none
of its audio is being decoded, gets an error event (idle_timeout) and is closed (1000), so an idle client does not
keep a stream from others. The policy (the streaming policy of `asr_spec.stream`) decides what to
re-decode and what is committed; it is fed in audio time, one `block_s` of samples after another, never more than
one re-decode in flight, so what it commits does not depend on how the client cuts its appends. The session reads
the socket all the time (so the keepalive's pongs are seen however fast the client sends): what the policy has
not taken yet waits in the backlog. A stream that is behind (a whole block waits when a step re-decode is due: a
fast sender, or more streams than the engine's capacity) catches up: its next re-decode covers all that arrived
(`catchup.catch_up`; pauses and a full buffer are decoded where they fall), so it is re-decoded less often and
its text is the policy's over those re-decodes; a re-decode that waits for the engine is brought up to date as
the engine takes it (the audio that arrived meanwhile fed, the policy asked again: `StreamPolicy.withdraw`), so a
word waits for no more than the engine's turn. With `catch_up` off every step is decoded (the text equals
`Transcriber.stream`'s fed the same samples in the same blocks, whatever the send rate or the load). A session's
memory is bounded: the backlog (`max_backlog_s`; an append past it gets an error event, code backlog_full, and
the connection is closed with code 1008), one append (`max_append_s`), the policy's one window. A session that
asked for it (session.update `lag`) gets a transcription.lag event with each result while it is behind, and one
when it has caught up. A malformed event gets an error event and the connection goes on. When the client goes
away, its stream closes at once: its waiting re-decode is dropped and its engine row freed (`StreamQueue.close`).
After `transcription.done` the connection may stream the next input.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from starlette.websockets import WebSocket, WebSocketDisconnect

from asr_spec.engine import ChunkResult
from asr_spec.errors import InputError, one_line
from asr_spec.serve import realtime_events as events
from asr_spec.serve.batcher import Batcher
from asr_spec.serve.params import MODEL_ALIASES
from asr_spec.serve.realtime_options import MIN_BLOCK_S, RealtimeOptions
from asr_spec.serve.stream_jobs import LiveStream, TooManyStreams
from asr_spec.stream.catchup import Backlog, BacklogFull, catch_up, next_action, renewed
from asr_spec.stream.policy import StreamOptions, StreamPolicy

__all__ = ["MIN_BLOCK_S", "STATIC_DIR", "RealtimeOptions", "add_realtime_routes", "drain_sessions"]

log = logging.getLogger(__name__)
TRY_AGAIN_LATER = 1013  # WebSocket close code: the server is at --max-streams
UNSUPPORTED = 1003  # WebSocket close code: this server cannot stream (its decoding has no timestamps)
POLICY_VIOLATION = 1008  # WebSocket close code: the client sent more audio than the backlog holds
IDLE_CLOSED = 1000  # WebSocket close code (normal closure) of a connection idle for idle_timeout_s
SHUTTING_DOWN = 1012  # WebSocket close code (service restart) of a session the server's shutdown ended (`drain`)
_DRAIN = object()  # put in a session's results to wake it when the server starts shutting down
BEHIND_S = 1.0  # audio waiting when a result comes back, in seconds, from which a stream is behind (lag events)
STATIC_DIR = Path(__file__).parent / "static"  # the page at / and its scripts
SUBPROTOCOL = "realtime"  # answered when offered (a browser offering subprotocols needs one chosen)


class _Input:
    """One input (utterance) of a session: its policy, its backlog, its usage so far."""

    def __init__(self, policy: Any, max_backlog_samples: int):
        self.policy = policy
        self.backlog = Backlog(max_backlog_samples)  # audio received, not yet fed to the policy
        self.finishing = False  # commit final received (or the session went idle with audio heard)
        self.appended = 0  # samples appended
        self.ended = False  # the policy was told (`finish`)
        self.decode: Any = None  # the policy's Decode in the engine (or waiting for it)
        self.behind = False  # the last lag event said the stream is behind
        self.prompt_tokens = 0
        self.completion_tokens = 0


class Session:
    """The state of one connection; runs in the event loop (results hop to it from the engine thread)."""

    def __init__(self, websocket: WebSocket, batcher: Batcher, options: RealtimeOptions,
                 make_policy: Callable[[], Any]):
        self.ws, self.batcher, self.options, self.make_policy = websocket, batcher, options, make_policy
        self.results: asyncio.Queue[ChunkResult | str] = asyncio.Queue()
        self.stream: LiveStream | None = None
        self.input: _Input | None = None
        self.tentative = False  # send transcription.tentative events (session.update)
        self.lag = False  # send transcription.lag events (session.update)
        self.id = ""  # its session.created event's id
        self.inputs = 0  # inputs started so far
        self.active_at = time.monotonic()  # its last append, or result of its re-decodes (from which it is idle)
        # it went idle with an input holding audio: that input is finished, then it is closed, at this monotonic
        # time even if its transcription.done has not come (None: it has not gone idle so)
        self.idle_until: float | None = None
        self.draining = False  # the server is shutting down (`drain`): its input is finished, then it is closed
        self._loop: asyncio.AbstractEventLoop | None = None

    def on_result(self, outcome: ChunkResult | str) -> None:  # the engine thread
        self._loop.call_soon_threadsafe(self.results.put_nowait, outcome)

    def drain(self) -> None:
        """The server is shutting down (`drain_sessions`, in the event loop): an input holding audio is finished as
        a final commit would finish it (its heard words committed, its transcription.done sent), then the session
        gets an error event (server_shutdown) and is closed (1012); without one, at once. Its client's appends are
        refused from now on. (uvicorn closed every connection with 1012 at once: a live caption lost its last
        seconds without a word.)"""
        self.draining = True
        current = self.input
        if current is not None and not current.finishing and not current.appended:
            self.input = None  # nothing heard: nothing to finish
        elif current is not None:
            current.finishing = True
        self.results.put_nowait(_DRAIN)

    async def run(self) -> None:
        self._loop = asyncio.get_running_loop()
        offered = self.ws.scope.get("subprotocols", ())
        await self.ws.accept(SUBPROTOCOL if SUBPROTOCOL in offered else None)
        try:
            self.stream = self.batcher.streams.open(self.on_result)
        except TooManyStreams as err:
            await self._send(events.error(f"server busy: {err}; retry later", "too_many_streams"))
            await self.ws.close(TRY_AGAIN_LATER, "too many streams")
            return
        try:
            created = events.created()
            self.id = created["id"]
            await self._send(created)
            await self._serve()
        finally:
            self.batcher.streams.close(self.stream)

    async def _serve(self) -> None:
        """Read events all the time (a fast client's pings are answered), take results as they come, until the
        client goes away, sends more than the backlog holds, or is idle for `idle_timeout_s`."""
        receiving: asyncio.Future | None = None
        result: asyncio.Future | None = None
        try:
            while True:
                if receiving is None:
                    receiving = asyncio.ensure_future(self.ws.receive())
                if result is None:
                    result = asyncio.ensure_future(self.results.get())
                finished, _ = await asyncio.wait({receiving, result}, timeout=self._idle_left_s(),
                                                 return_when=asyncio.FIRST_COMPLETED)
                if not finished and not self._finish_when_idle():
                    await self._close_idle()
                    return
                if receiving in finished:
                    message, receiving = receiving.result(), None
                    if message["type"] == "websocket.disconnect":
                        raise WebSocketDisconnect(message.get("code", 1000))
                    if not await self._on_message(message.get("text", message.get("bytes"))):
                        return
                if result in finished:
                    outcome, result = result.result(), None
                    if outcome is not _DRAIN:
                        self.active_at = time.monotonic()
                        await self._on_result(outcome)
                await self._pump()
                if self.draining and self.input is None:  # its last input's done is sent
                    await self._close_drained()
                    return
                if self.idle_until is not None and self.input is None:  # the idle input's done is sent
                    await self._close_idle()
                    return
        finally:
            for task in (receiving, result):
                if task is not None:
                    task.cancel()

    def _idle_left_s(self) -> float | None:
        """Seconds left until the session is idle (`idle_timeout_s` after its last append or result); None
        while it waits for its own work (a re-decode in flight, an input the client ended): not idle then."""
        current = self.input
        if self.idle_until is not None:  # its idle input is finishing: one more timeout to say its done
            return max(0.0, self.idle_until - time.monotonic())
        if current is not None and (current.decode is not None or current.finishing):
            return None
        return max(0.0, self.active_at + self.options.idle_timeout_s - time.monotonic())

    def _finish_when_idle(self) -> bool:
        """The session went idle: an input holding audio is finished as a final commit would finish it (its heard
        words committed, its transcription.done sent; `_serve` closes the connection then), rather than its
        uncommitted words dropped with the connection (a caption client that stopped sending, with no final
        commit, kept " ...comes in and" for ever, without the words heard after them). False where there is none."""
        current = self.input
        if self.idle_until is not None or current is None or current.finishing or not current.appended:
            return False
        current.finishing = True
        self.idle_until = time.monotonic() + self.options.idle_timeout_s
        return True

    async def _close_idle(self) -> None:
        """An error event (idle_timeout) and a normal close: the connection sent no audio for `idle_timeout_s`."""
        timeout_s = self.options.idle_timeout_s
        await self._send(events.error(f"no audio for {timeout_s:g} s (the server's idle timeout): the connection is "
                                      "closed; reconnect to stream again", "idle_timeout"))
        await self.ws.close(IDLE_CLOSED, "idle timeout")

    async def _close_drained(self) -> None:
        """An error event (server_shutdown) and a close (1012, service restart): the server is going."""
        await self._send(events.error("the server is shutting down: the connection is closed; reconnect to stream "
                                      "again", "server_shutdown"))
        await self.ws.close(SHUTTING_DOWN, "server shutting down")

    async def _on_message(self, message: str | bytes | None) -> bool:
        """Apply one client event; False when the connection is over (its backlog is full: error event, close)."""
        try:
            self._apply(events.parse(message, self.options.max_append_samples))
        except events.ProtocolError as err:
            await self._send(events.error(one_line(err), err.code))
        except BacklogFull as err:
            await self._send(events.error(one_line(err), "backlog_full"))
            await self.ws.close(POLICY_VIOLATION, "audio backlog full")
            return False
        return True

    def _apply(self, event: events.Event) -> None:
        if isinstance(event, events.SessionUpdate):
            served = (self.options.model_id, *MODEL_ALIASES)
            if event.model is not None and event.model not in served:
                raise events.ProtocolError(f"session.update: model {event.model!r} is not served here (serving: "
                                           f"{', '.join(served)})", "model_not_found")
            if event.tentative is not None:
                self.tentative = event.tentative
            if event.lag is not None:
                self.lag = event.lag
            return
        if self.draining:
            raise events.ProtocolError(f"{_name(event)}: the server is shutting down", "server_shutdown")
        if self.input is not None and self.input.finishing:
            ended = "a final commit" if self.idle_until is None else "the idle timeout"
            raise events.ProtocolError(f"{_name(event)}: this input was ended by {ended}; wait for its "
                                       "transcription.done", "input_finished")
        if self.input is None:
            self.input = _Input(self._new_policy(), self.options.max_backlog_samples)
        if isinstance(event, events.Append):
            self.input.backlog.append(event.samples)
            self.input.appended += len(event.samples)
            self.active_at = time.monotonic()  # audio came: the session is not idle
        elif event.final:
            self.input.finishing = True
        # a commit without final starts an input (vLLM's "ready to start"); while one runs it changes nothing

    def _new_policy(self) -> Any:
        """A new input's policy; the streaming policy's trace lines (`--trace-streams`) name the session, the input
        and the client: "sess-... input 2 (127.0.0.1:50312)"."""
        policy = self.make_policy()
        self.inputs += 1
        if isinstance(policy, StreamPolicy):
            client = self.ws.client
            policy.label = f"{self.id} input {self.inputs}" + (f" ({client.host}:{client.port})" if client else "")
        return policy

    async def _on_result(self, outcome: ChunkResult | str) -> None:
        current = self.input
        if current is None or current.decode is None:
            return
        decode, current.decode = current.decode, None
        if isinstance(outcome, str):  # the engine lost it: this input cannot go on
            self.input = None
            await self._send(events.error(f"transcription failed: {outcome}", "processing_error"))
            return
        generated = outcome.stats.generated_tokens  # the forced <|0.00|> and prefix count as prompt
        current.prompt_tokens += len(outcome.prompt) + len(outcome.tokens) - generated
        current.completion_tokens += generated
        await self._send_lag(current)
        await self._send_update(current.policy.accept(decode, outcome.tokens))

    async def _send_lag(self, current: _Input) -> None:
        """A transcription.lag event (when asked for) while the stream is behind, and once when it caught up."""
        behind_s = current.backlog.seconds
        behind = behind_s >= BEHIND_S
        if self.lag and (behind or current.behind):
            await self._send(events.lag(behind_s))
        current.behind = behind

    async def _pump(self) -> None:
        """Feed the policy from the backlog until it asks for a re-decode (then submitted: the backlog waits for
        its result, and catches up then) or nothing is left; tell it when a finished input's audio is all in
        (`catchup.next_action` decides which)."""
        current = self.input
        block = self.options.block_samples
        while current is not None and current.decode is None and self.input is current:
            action = next_action(current.policy, current.backlog, block, current.finishing, current.ended,
                                 self.options.catch_up)
            if action == "decode":
                self.batcher.streams.submit(self.stream, *self._ask(current), renew=self._renewal(current))
            elif action == "feed":  # in a worker thread: the policy's voice activity model runs there
                await asyncio.to_thread(catch_up, current.policy, current.backlog, block, current.finishing,
                                        self.options.catch_up)
            elif action == "finish":
                current.ended = True
                update = current.policy.finish()
                if update is not None:
                    await self._send_update(update)
            else:
                break

    def _ask(self, current: _Input) -> tuple[Any, tuple[int, ...], tuple[int, ...]]:
        """The policy's due decode, now in flight: its (audio, hypothesis offered, prefix) for the queue."""
        current.decode = current.policy.request()
        return self._offered(current.decode)

    def _offered(self, decode: Any) -> tuple[Any, tuple[int, ...], tuple[int, ...]]:
        """A decode as the queue takes it: (audio, hypothesis offered, prefix)."""
        return decode.audio, decode.hypothesis if self.options.hypothesis else (), decode.prefix

    def _renewal(self, current: _Input) -> Callable[[], Any] | None:
        """What brings the input's waiting re-decode up to date when the engine takes it (`StreamQueue.submit`'s
        renew; in the engine's thread): with catching up, a step re-decode is replaced by one over the audio that
        arrived while it waited (`catchup.renewed`), so its text is as fresh as the engine's turn allows. The
        session leaves the policy alone while its decode waits or runs (`_pump` feeds none then)."""
        if not self.options.catch_up or not hasattr(current.policy, "withdraw"):
            return None

        def renew() -> tuple[Any, tuple[int, ...], tuple[int, ...]] | None:
            decode = renewed(current.policy, current.backlog, self.options.block_samples, current.decode)
            if decode is None:
                return None
            current.decode = decode
            return self._offered(decode)

        return renew

    async def _send_update(self, update: Any) -> None:
        """The events of one policy `Update`: its committed delta, its tentative rest (when asked for), and at
        the end of the input transcription.done (the input is over: the next append starts a new one)."""
        if update.delta:
            await self._send(events.delta(update.delta))
        if self.tentative and not update.final:
            await self._send(events.tentative(update.tentative))
        if update.final:
            current, self.input = self.input, None
            await self._send(events.done(update.text, current.prompt_tokens, current.completion_tokens))

    async def _send(self, event: dict[str, Any]) -> None:
        await self.ws.send_json(event)


def _name(event: events.Event) -> str:
    return "input_audio_buffer.append" if isinstance(event, events.Append) else "input_audio_buffer.commit"


def add_realtime_routes(app: Any, batcher: Batcher, options: RealtimeOptions) -> None:
    """Add WS /v1/realtime, the page at / and its files (/static/) to the FastAPI `app`."""
    from fastapi.responses import FileResponse
    from fastapi.staticfiles import StaticFiles

    refusal = None  # why this server cannot stream, if it cannot (its uploads are served all the same)
    try:
        make_policy = options.policy or default_policy(batcher.transcriber, options.vad, options.stream)
    except InputError as err:
        refusal, make_policy = one_line(err), None

    sessions: set[Session] = set()  # the sessions running (`drain_sessions`)
    app.state.live_sessions = sessions

    @app.websocket("/v1/realtime")
    async def realtime(websocket: WebSocket) -> None:
        with contextlib.suppress(WebSocketDisconnect):
            if refusal is not None:
                await websocket.accept()
                await websocket.send_json(events.error(refusal, "streaming_unavailable"))
                await websocket.close(UNSUPPORTED, "streaming unavailable")
                return
            session = Session(websocket, batcher, options, make_policy)
            sessions.add(session)
            try:
                await session.run()
            finally:
                sessions.discard(session)

    @app.get("/", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html")

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")


async def drain_sessions(app: Any, timeout_s: float) -> None:
    """Let the app's live sessions finish before the server closes its connections (`Session.drain`: each input
    holding audio gets its transcription.done, then the session closes with 1012); waits until all have closed, or
    `timeout_s`."""
    sessions = getattr(app.state, "live_sessions", set())
    for session in list(sessions):
        session.drain()
    deadline = time.monotonic() + timeout_s
    while sessions and time.monotonic() < deadline:
        await asyncio.sleep(0.05)


def default_policy(transcriber: Any, vad: bool = True, options: StreamOptions | None = None) -> Callable[[], Any]:
    """() -> a new stream's policy, made as `Transcriber.stream` makes it (`StreamRunner.new_policy`: `options`,
    None: default `StreamOptions`; vad: utterances closed at silence by silero-vad), for re-decodes by
    `transcriber`'s own engine, which must decode in Whisper's timestamp mode (else `InputError`: the streams
    could not share it)."""
    if not transcriber.engine.options.timestamps:
        raise InputError("/v1/realtime needs the server to decode in Whisper's timestamp mode (the preset's "
                         "timestamps = true)")
    runner = transcriber.streams(options, vad=vad)
    return runner.new_policy
