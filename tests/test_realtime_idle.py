"""`/v1/realtime`'s idle timeout (`RealtimeOptions.idle_timeout_s`, `asr-spec serve --idle-timeout-s`): a
connection that appends nothing for that long, while none of its audio is being decoded, gets an error event
(idle_timeout) and a normal close (1000), and its stream is free for the next client; a connection that keeps
appending, or waits for its own re-decode, is not idle. Short timeouts (0.5 s), the tiny real-vocabulary Whisper."""

from __future__ import annotations

import asyncio
import base64
import json
import threading
import time

import pytest

pytest.importorskip("fastapi", reason="needs the asr-spec[serve] extra")
websockets = pytest.importorskip("websockets", reason="needs the asr-spec[serve] extra")

from conftest import no_uvicorn, wait_until_async  # noqa: E402
from test_realtime import (  # noqa: E402
    TIMEOUT_S,
    pcm16,
    realtime_transcriber,
    stream,
    streaming_api,
    ws_url,
)
from test_serve import running, serving  # noqa: E402
from test_transcribe import SHORT  # noqa: E402

from asr_spec.engine.capture import StepRunner  # noqa: E402
from asr_spec.errors import InputError  # noqa: E402
from asr_spec.serve.app import create_app  # noqa: E402
from asr_spec.serve.batcher import Batcher  # noqa: E402
from asr_spec.serve.realtime import RealtimeOptions  # noqa: E402

IDLE_S = 0.5


@pytest.fixture(scope="module")
def greedy():
    return realtime_transcriber()


def append(samples) -> str:
    return json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(samples.tobytes()).decode()})


async def closed_for_idleness(ws, timeout_s: float = TIMEOUT_S) -> tuple[dict, int]:
    """The next event (the idle_timeout error) and the close code that follows it."""
    event = json.loads(await asyncio.wait_for(ws.recv(), timeout_s))
    with pytest.raises(websockets.ConnectionClosed) as closed:
        await asyncio.wait_for(ws.recv(), timeout_s)
    return event, closed.value.rcvd.code


async def keep_updating(ws) -> None:
    """session.update every 0.1 s (no audio) until the connection is closed."""
    while True:
        await asyncio.sleep(0.1)
        try:
            await ws.send(json.dumps({"type": "session.update", "tentative": True}))
        except websockets.ConnectionClosed:
            return


def test_idle_connections_are_closed_and_give_their_streams_back(greedy):
    """max_streams 2: two clients connect and append nothing (one starts an input and sends session.update every
    0.1 s: no audio); each gets idle_timeout and 1000 after idle_timeout_s, and a third client then streams."""
    batcher = Batcher(greedy, batch_size=2, max_streams=2)

    async def scenario(uri: str):
        started = time.monotonic()  # before the server's idle clocks start (at its accepting each connection)
        silent, chatty = await websockets.connect(uri), await websockets.connect(uri)
        for ws in (silent, chatty):
            assert json.loads(await ws.recv())["type"] == "session.created"
        await chatty.send(json.dumps({"type": "input_audio_buffer.commit"}))  # an input started, then no audio
        updating = asyncio.ensure_future(keep_updating(chatty))
        closes = [await closed_for_idleness(ws, 20 * IDLE_S) for ws in (silent, chatty)]
        waited_s = time.monotonic() - started
        await updating
        await wait_until_async(lambda: batcher.streams.n_open == 0)
        return closes, waited_s, await stream(uri, pcm16(SHORT[3])[:16000])

    with serving(create_app(batcher, realtime=RealtimeOptions(catch_up=False, idle_timeout_s=IDLE_S))) as base_url:
        closes, waited_s, (done, deltas, errors) = asyncio.run(scenario(ws_url(base_url)))
    for event, code in closes:
        assert event["type"] == "error" and event["code"] == "idle_timeout" and code == 1000, (event, code)
        assert "no audio for 0.5 s" in event["error"] and "\n" not in event["error"]
    assert waited_s >= IDLE_S
    assert not errors and done["type"] == "transcription.done" and done["text"] == "".join(deltas)


def gated_transcriber(gate: threading.Event, steps: list[float]):
    """The tiny transcriber whose decoder steps wait for `gate` (a re-decode held in the engine while it is shut)."""
    held = realtime_transcriber()

    def wrap(fn):
        def gated(*args):
            steps.append(time.monotonic())
            gate.wait(TIMEOUT_S)
            fn(*args)
        return gated

    held.engine.runner = StepRunner("wrapped", wrap)
    return held


def test_appending_or_waiting_for_its_redecode_is_not_idle():
    """One connection: small appends every 0.1 s for three timeouts (too little audio for a re-decode), then a
    second of audio and the final commit, its re-decode held in the engine for three timeouts; it gets its
    transcription.done and no error, and only then, after a timeout's quiet, idle_timeout and 1000."""
    gate, steps = threading.Event(), []
    batcher = Batcher(gated_transcriber(gate, steps), batch_size=2)
    pcm = pcm16(SHORT[0])

    async def scenario(uri: str):
        async with websockets.connect(uri) as ws:
            assert json.loads(await ws.recv())["type"] == "session.created"
            for start in range(0, 160 * 15, 160):  # 0.01 s per 0.1 s
                await ws.send(append(pcm[start:start + 160]))
                await asyncio.sleep(0.1)
            decoded_while_appending = len(steps)
            await ws.send(append(pcm[160 * 15:16000]))
            await ws.send(json.dumps({"type": "input_audio_buffer.commit", "final": True}))
            await asyncio.sleep(3 * IDLE_S)
            held = bool(steps)
            gate.set()
            events = []
            while not events or events[-1]["type"] not in ("transcription.done", "error"):
                events.append(json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT_S)))
            done_at = time.monotonic()
            idle, code = await closed_for_idleness(ws)
            return decoded_while_appending, held, events, time.monotonic() - done_at, idle, code

    try:
        with serving(create_app(batcher, realtime=RealtimeOptions(catch_up=False, idle_timeout_s=IDLE_S))) as url:
            decoded, held, events, quiet_s, idle, code = asyncio.run(scenario(ws_url(url)))
    finally:
        gate.set()
    assert decoded == 0 and held  # not idle for having nothing in the engine, then for having its re-decode there
    assert events[-1]["type"] == "transcription.done", events[-1]
    assert idle["code"] == "idle_timeout" and code == 1000
    assert quiet_s >= IDLE_S * 0.8


def test_an_idle_input_holding_audio_is_finished_before_the_close(greedy):
    """A client appends a clip and then nothing, with no final commit: its input is finished as a final commit
    would finish it (the same text as `Transcriber.stream` gives, in its deltas and a transcription.done), then
    idle_timeout and 1000 (the heard words not yet committed were dropped with the connection, and no done came)."""
    batcher = Batcher(greedy, batch_size=2)
    pcm = pcm16(SHORT[0])[:32000]

    async def scenario(uri: str):
        async with websockets.connect(uri, max_size=None) as ws:
            assert json.loads(await ws.recv())["type"] == "session.created"
            for start in range(0, len(pcm), 1600):
                await ws.send(append(pcm[start:start + 1600]))
            events = []
            while not events or events[-1]["type"] not in ("transcription.done", "error"):
                events.append(json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT_S)))
            return events, *await closed_for_idleness(ws)

    with serving(create_app(batcher, realtime=RealtimeOptions(catch_up=False, idle_timeout_s=IDLE_S))) as base_url:
        events, idle, code = asyncio.run(scenario(ws_url(base_url)))
    done, deltas = events[-1], [e["delta"] for e in events if e["type"] == "transcription.delta"]
    assert done["type"] == "transcription.done", events
    assert done["text"] == "".join(deltas) == streaming_api(greedy, pcm) and done["text"].strip()
    assert idle["code"] == "idle_timeout" and code == 1000


def test_an_idle_input_that_cannot_finish_still_closes():
    """An idle input held up in the engine (its decoder steps wait on a gate) is given one more timeout to finish,
    then the session is closed all the same, idle_timeout and 1000 (it waited for ever, holding its stream's
    place); an append meanwhile is refused naming the idle timeout, not a final commit the client never sent."""
    gate, steps = threading.Event(), []
    batcher = Batcher(gated_transcriber(gate, steps), batch_size=2)
    pcm = pcm16(SHORT[0])[:8000]  # 0.5 s: less than a step's 0.75 s, so nothing is decoded before it is idle

    async def scenario(uri: str):
        async with websockets.connect(uri, max_size=None) as ws:
            assert json.loads(await ws.recv())["type"] == "session.created"
            await ws.send(append(pcm))
            started = time.monotonic()
            # idle after a timeout: its input finished, the close decode held in the engine
            await wait_until_async(lambda: bool(steps))
            await ws.send(append(pcm[:1600]))
            refused = json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT_S))
            idle, code = await closed_for_idleness(ws)
            waited_s = time.monotonic() - started
            gate.set()  # the engine's held decode ends before the server stops
            return refused, idle, code, waited_s

    try:
        with serving(create_app(batcher, realtime=RealtimeOptions(catch_up=False, idle_timeout_s=IDLE_S))) as url:
            refused, idle, code, waited_s = asyncio.run(scenario(ws_url(url)))
    finally:
        gate.set()
    assert refused["code"] == "input_finished" and "ended by the idle timeout" in refused["error"], refused
    assert idle["code"] == "idle_timeout" and code == 1000 and waited_s < 10 * IDLE_S


def test_the_idle_timeout_is_checked():
    for bad in (0, -1.0, float("inf"), float("nan"), True, "60"):
        with pytest.raises(InputError, match="idle_timeout_s must be a positive number of seconds"):
            RealtimeOptions(idle_timeout_s=bad)
    assert RealtimeOptions().idle_timeout_s == 60.0


def test_serve_passes_its_idle_timeout_to_the_sessions(monkeypatch, greedy, capsys, tmp_path):
    """`asr-spec serve --idle-timeout-s S`: the app's realtime options (models and uvicorn replaced); a bad value
    fails before the models load, in one line."""
    import asr_spec.serve.app as app_module
    from asr_spec.cli import main
    from asr_spec.transcribe import Transcriber

    made: dict = {}
    create_app_itself = app_module.create_app

    def recording_create_app(batcher, options, realtime):
        made["realtime"] = realtime
        return create_app_itself(batcher, options, realtime)

    with pytest.raises(SystemExit) as info:
        main(["serve", "--model", str(tmp_path / "absent"), "--idle-timeout-s", "0"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "idle_timeout_s must be a positive number of seconds" in err, err
    assert len(err.strip().splitlines()) == 1
    monkeypatch.setattr(Transcriber, "from_preset", classmethod(lambda cls, *args, **kwargs: greedy))
    monkeypatch.setattr(app_module, "create_app", recording_create_app)
    no_uvicorn(monkeypatch, lambda app: None)
    with pytest.raises(SystemExit) as info:
        main(["serve", "--preset", "base", "--idle-timeout-s", "15"])
    assert info.value.code == 0 and made["realtime"].idle_timeout_s == 15.0


def test_a_server_shutting_down_finishes_each_live_input_before_closing():
    """SIGTERM (uvicorn's should_exit) with a live stream mid-input: uvicorn closed it with 1012 at once, and the
    audio heard so far was never transcribed. Now the input is finished as a final commit finishes it (its
    transcription.done, the same text as a final commit gives), then an error event (server_shutdown) and 1012;
    an append sent after the shutdown began is refused; a connection with no input closes at once."""
    gate, steps = threading.Event(), []
    gate.set()
    batcher = Batcher(gated_transcriber(gate, steps), batch_size=2)
    pcm = pcm16(SHORT[0])

    async def scenario(uri: str, server) -> tuple[list[dict], int, list[dict], int, dict]:
        reference, _, _ = await stream(uri, pcm)  # a final commit's text, the server running
        async with websockets.connect(uri) as live, websockets.connect(uri) as empty:
            for ws in (live, empty):
                assert json.loads(await ws.recv())["type"] == "session.created"
            gate.clear()  # its re-decodes held in the engine until the shutdown has begun
            for start in range(0, len(pcm), 16000):
                await live.send(append(pcm[start:start + 16000]))
            await asyncio.sleep(0.5)
            server.should_exit = True  # what SIGTERM and Ctrl-C do
            empty_events = []
            with pytest.raises(websockets.ConnectionClosed) as empty_closed:
                while True:
                    empty_events.append(json.loads(await asyncio.wait_for(empty.recv(), TIMEOUT_S)))
            await live.send(append(pcm[:1600]))  # too late: refused
            events = [json.loads(await asyncio.wait_for(live.recv(), TIMEOUT_S))]
            gate.set()
            with pytest.raises(websockets.ConnectionClosed) as closed:
                while True:
                    events.append(json.loads(await asyncio.wait_for(live.recv(), TIMEOUT_S)))
        return events, closed.value.rcvd.code, empty_events, empty_closed.value.rcvd.code, reference

    try:
        with running(create_app(batcher, realtime=RealtimeOptions(catch_up=False))) as (server, base_url):
            events, code, empty_events, empty_code, reference = asyncio.run(scenario(ws_url(base_url), server))
    finally:
        gate.set()
    assert [e["code"] for e in empty_events] == ["server_shutdown"] and empty_code == 1012
    assert events[0]["type"] == "error" and events[0]["code"] == "server_shutdown", events[0]  # the late append
    assert "shutting down" in events[0]["error"]
    done = [e for e in events if e["type"] == "transcription.done"]
    assert len(done) == 1 and done[0]["text"] == reference["text"] and done[0]["text"].strip(), events
    assert done[0]["text"] == "".join(e["delta"] for e in events if e["type"] == "transcription.delta")
    assert events[-1]["type"] == "error" and events[-1]["code"] == "server_shutdown" and code == 1012
