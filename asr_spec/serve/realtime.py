"""`/v1/realtime`: live transcription over a WebSocket, vLLM's realtime protocol (events: realtime_events.py).

    client ──append (PCM16 16 kHz)──► backlog (bounded: past it the server stops reading, TCP holds the client)
    ──0.1 s blocks──► the stream's policy ──re-decode due──► StreamQueue.submit (stream_jobs.py)
    ──the server's one engine run, rows shared with uploads──► result ──policy.accept──► transcription.delta
    (newly committed text) [+ transcription.tentative] ... commit final ──► the policy's last re-decodes ──►
    transcription.done (the whole text, usage)

A connection holds one stream (`--max-streams` in all; past it the connection gets an error event and is closed
with code 1013, "try again later"). The policy (the streaming policy of `asr_spec.stream`) decides what to
re-decode and what is committed; it is fed in audio time, one `block_s` of samples after another, never more than
one re-decode in flight, so what it commits depends neither on how the client cuts its appends, nor on how fast
they arrive, nor on the engine's load: the text equals `Transcriber.stream`'s fed the same samples in the same
blocks. A session's memory is bounded: the backlog (`max_backlog_s`), one
append (`max_append_s`), the policy's one window. A malformed event gets an error event and the connection goes
on. When the client goes away, its stream closes at once: its waiting re-decode is dropped and its engine row freed
(`StreamQueue.close`). After `transcription.done` the connection may stream the next input.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from starlette.websockets import WebSocket, WebSocketDisconnect

from asr_spec.audio.loading import SAMPLE_RATE
from asr_spec.checks import positive_seconds
from asr_spec.engine import ChunkResult
from asr_spec.errors import InputError, one_line
from asr_spec.serve import realtime_events as events
from asr_spec.serve.batcher import Batcher
from asr_spec.serve.params import MODEL_ALIASES
from asr_spec.serve.stream_jobs import LiveStream, TooManyStreams

__all__ = ["STATIC_DIR", "RealtimeOptions", "add_realtime_routes"]

log = logging.getLogger(__name__)
TRY_AGAIN_LATER = 1013  # WebSocket close code: the server is at --max-streams
UNSUPPORTED = 1003  # WebSocket close code: this server cannot stream (its decoding has no timestamps)
STATIC_DIR = Path(__file__).parent / "static"  # the page at / and its scripts
SUBPROTOCOL = "realtime"  # answered when offered (a browser offering subprotocols needs one chosen)


@dataclass(frozen=True)
class RealtimeOptions:
    """How a realtime session takes audio (what a re-decode is: the policy's)."""

    model_id: str = "asr-spec"  # what session.update's `model` may name (or an alias)
    max_backlog_s: float = 30.0  # audio received and not yet given to the policy, in seconds; past it: not read
    max_append_s: float = 10.0  # the most audio one append event may carry, in seconds
    block_s: float = 0.1  # the policy is fed this much audio at a time (so as the streaming API feeds it)
    vad: bool = True  # the default policy closes utterances at silence (silero-vad), as Transcriber.stream does
    # () -> a new stream's policy; None: the streaming policy of `asr_spec.stream` over the server's transcriber
    policy: Callable[[], Any] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        for name in ("max_backlog_s", "max_append_s", "block_s"):
            positive_seconds(getattr(self, name), name, finite_only=False)
        if self.max_backlog_s < self.block_s:  # the backlog must hold a whole block, or the session would stall
            raise InputError(f"max_backlog_s ({self.max_backlog_s:g}) must be at least block_s ({self.block_s:g})")
        if not isinstance(self.vad, bool):
            raise InputError(f"vad must be true or false, got {self.vad!r}")

    @property
    def max_append_samples(self) -> int:
        return int(self.max_append_s * SAMPLE_RATE)

    @property
    def block_samples(self) -> int:
        return max(1, int(round(self.block_s * SAMPLE_RATE)))


class _Input:
    """One input (utterance) of a session: its policy, its backlog, its usage so far."""

    def __init__(self, policy: Any):
        self.policy = policy
        self.backlog: deque[np.ndarray] = deque()  # (n,) float32 16 kHz blocks not yet fed to the policy
        self.backlog_samples = 0
        self.finishing = False  # commit final received
        self.ended = False  # the policy was told (`finish`)
        self.decode: Any = None  # the policy's Decode in the engine (or waiting for it)
        self.prompt_tokens = 0
        self.completion_tokens = 0

    def next_block(self, n_samples: int) -> np.ndarray | None:
        """The backlog's next `n_samples` samples, however the client cut its appends (the policy is fed blocks of
        one size, as the streaming API feeds it); None until that many are in, but at the end of the input the
        rest, shorter."""
        if self.backlog_samples < n_samples and not (self.finishing and self.backlog_samples):
            return None
        parts, wanted = [], n_samples
        while self.backlog and wanted:
            block = self.backlog.popleft()
            if len(block) > wanted:
                self.backlog.appendleft(block[wanted:])
                block = block[:wanted]
            parts.append(block)
            wanted -= len(block)
        block = np.concatenate(parts)
        self.backlog_samples -= len(block)
        return block


class Session:
    """The state of one connection; runs in the event loop (results hop to it from the engine thread)."""

    def __init__(self, websocket: WebSocket, batcher: Batcher, options: RealtimeOptions,
                 make_policy: Callable[[], Any]):
        self.ws, self.batcher, self.options, self.make_policy = websocket, batcher, options, make_policy
        self.results: asyncio.Queue[ChunkResult | str] = asyncio.Queue()
        self.stream: LiveStream | None = None
        self.input: _Input | None = None
        self.tentative = False  # send transcription.tentative events (session.update)
        self._loop: asyncio.AbstractEventLoop | None = None

    def on_result(self, outcome: ChunkResult | str) -> None:  # the engine thread
        self._loop.call_soon_threadsafe(self.results.put_nowait, outcome)

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
            await self._send(events.created())
            await self._serve()
        finally:
            self.batcher.streams.close(self.stream)

    async def _serve(self) -> None:
        """Read events while the backlog has room, take results as they come, until the client goes away."""
        receiving: asyncio.Future | None = None
        result: asyncio.Future | None = None
        try:
            while True:
                if receiving is None and self._backlog_room():
                    receiving = asyncio.ensure_future(self.ws.receive())
                if result is None:
                    result = asyncio.ensure_future(self.results.get())
                waits = {task for task in (receiving, result) if task is not None}
                finished, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                if receiving in finished:
                    message, receiving = receiving.result(), None
                    if message["type"] == "websocket.disconnect":
                        raise WebSocketDisconnect(message.get("code", 1000))
                    await self._on_message(message.get("text", message.get("bytes")))
                if result in finished:
                    outcome, result = result.result(), None
                    await self._on_result(outcome)
                await self._pump()
        finally:
            for task in (receiving, result):
                if task is not None:
                    task.cancel()

    def _backlog_room(self) -> bool:
        backlog = 0 if self.input is None else self.input.backlog_samples
        return backlog < self.options.max_backlog_s * SAMPLE_RATE

    async def _on_message(self, message: str | bytes | None) -> None:
        try:
            self._apply(events.parse(message, self.options.max_append_samples))
        except events.ProtocolError as err:
            await self._send(events.error(one_line(err), err.code))

    def _apply(self, event: events.Event) -> None:
        if isinstance(event, events.SessionUpdate):
            served = (self.options.model_id, *MODEL_ALIASES)
            if event.model is not None and event.model not in served:
                raise events.ProtocolError(f"session.update: model {event.model!r} is not served here (serving: "
                                           f"{', '.join(served)})", "model_not_found")
            if event.tentative is not None:
                self.tentative = event.tentative
            return
        if self.input is not None and self.input.finishing:
            raise events.ProtocolError(f"{_name(event)}: this input was ended by a final commit; wait for its "
                                       "transcription.done", "input_finished")
        if self.input is None:
            self.input = _Input(self.make_policy())
        if isinstance(event, events.Append):
            self.input.backlog.append(event.samples)
            self.input.backlog_samples += len(event.samples)
        elif event.final:
            self.input.finishing = True
        # a commit without final starts an input (vLLM's "ready to start"); while one runs it changes nothing

    async def _on_result(self, outcome: ChunkResult | str) -> None:
        current = self.input
        if current is None or current.decode is None:
            return
        decode, current.decode = current.decode, None
        if isinstance(outcome, str):  # the engine lost it: this input cannot go on
            self.input = None
            await self._send(events.error(f"transcription failed: {outcome}", "processing_error"))
            return
        current.prompt_tokens += len(outcome.prompt)
        current.completion_tokens += len(outcome.tokens)
        await self._send_update(current.policy.accept(decode, outcome.tokens))

    async def _pump(self) -> None:
        """Feed the policy one block of audio at a time until it asks for a re-decode (then submitted: the next
        block waits for its result) or nothing is left; tell it when a finished input's audio is all in."""
        current = self.input
        while current is not None and current.decode is None and self.input is current:
            decode = current.policy.request()
            block = None if decode is not None else current.next_block(self.options.block_samples)
            if decode is not None:
                current.decode = decode
                self.batcher.streams.submit(self.stream, decode.audio, decode.hypothesis)
            elif block is not None:  # in a worker thread: the policy's voice activity model runs on it
                await asyncio.to_thread(current.policy.feed, block)
            elif current.finishing and not current.ended:
                current.ended = True
                update = current.policy.finish()
                if update is not None:
                    await self._send_update(update)
            else:
                break

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
        make_policy = options.policy or default_policy(batcher.transcriber, options.vad)
    except InputError as err:
        refusal, make_policy = one_line(err), None

    @app.websocket("/v1/realtime")
    async def realtime(websocket: WebSocket) -> None:
        with contextlib.suppress(WebSocketDisconnect):
            if refusal is not None:
                await websocket.accept()
                await websocket.send_json(events.error(refusal, "streaming_unavailable"))
                await websocket.close(UNSUPPORTED, "streaming unavailable")
                return
            await Session(websocket, batcher, options, make_policy).run()

    @app.get("/", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html")

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")


def default_policy(transcriber: Any, vad: bool = True) -> Callable[[], Any]:
    """() -> a new stream's policy, made as `Transcriber.stream` makes it (`StreamRunner.new_policy`: default
    `StreamOptions`; vad: utterances closed at silence by silero-vad), for re-decodes by `transcriber`'s own
    engine, which must decode in Whisper's timestamp mode (else `InputError`: the streams could not share it)."""
    if not transcriber.engine.options.timestamps:
        raise InputError("/v1/realtime needs the server to decode in Whisper's timestamp mode (the preset's "
                         "timestamps = true)")
    runner = transcriber.streams(vad=vad)
    return runner.new_policy
