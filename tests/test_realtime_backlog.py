"""/v1/realtime with clients faster than the server decodes, on 127.0.0.1 with the tiny real-vocabulary Whisper made
as slow per step as a real model (a re-decode takes about a second): the server's keepalive pings every second,
the clients are the `websockets` package with its default keepalive, sending and reading at once as a real
client does. A client at 10x real time gets its final text, with the stream re-decoded less often than every step
(it caught up: transcription.lag events said it was behind); one sending an hour of audio as fast as it can gets
an error event (backlog_full) and a clean close (1008) with the backlog never past its bound; no connection ends
with 1011 (a keepalive timeout: a server that stops reading the socket never sees the pongs)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import time

import numpy as np
import pytest

pytest.importorskip("fastapi", reason="needs the asr-spec[serve] extra")
websockets = pytest.importorskip("websockets", reason="needs the asr-spec[serve] extra")

from conftest import wait_until  # noqa: E402
from test_realtime import BLOCK_BYTES, pcm16, realtime_transcriber, ws_url  # noqa: E402
from test_serve import serving  # noqa: E402
from test_transcribe import LONG  # noqa: E402

from asr_spec.engine.capture import StepRunner  # noqa: E402
from asr_spec.serve.app import create_app  # noqa: E402
from asr_spec.serve.batcher import Batcher  # noqa: E402
from asr_spec.serve.realtime import POLICY_VIOLATION, RealtimeOptions  # noqa: E402

KEEPALIVE = dict(ws_ping_interval=1.0, ws_ping_timeout=5.0)  # the server pings every second (uvicorn: 20 s)
STEP_SLEEP_S = 0.05  # per decoder step: ~12 steps a re-decode, as slow as whisper-base on two shared cores
TIMEOUT_S = 120
SAMPLES_PER_APPEND = BLOCK_BYTES // 2


@pytest.fixture(scope="module")
def slow():
    model = realtime_transcriber()

    def wrap(fn):
        def paced(m, rules, st, *args):
            time.sleep(STEP_SLEEP_S)
            fn(m, rules, st, *args)
        return paced

    model.engine.runner = StepRunner("wrapped", wrap)
    return model


def appends(pcm: np.ndarray, n_samples: int):
    """The append events of `n_samples` of `pcm` looped, 4 KB of PCM16 each (vLLM's example client's size)."""
    looped = itertools.chain.from_iterable(itertools.repeat(pcm))
    for _ in range(0, n_samples, SAMPLES_PER_APPEND):
        block = np.fromiter(itertools.islice(looped, SAMPLES_PER_APPEND), dtype="<i2")
        yield json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(block.tobytes()).decode()})


async def client(uri: str, messages, speed: float | None) -> tuple[list[dict], int | None, float]:
    """Send `messages` (appends) then a final commit, at `speed` times real time (None: as fast as it can), while
    reading events; returns (the events read, the close code if the server closed, the audio seconds sent)."""
    seen: list[dict] = []
    sent_s = 0.0
    async with websockets.connect(uri, max_size=None) as ws:
        assert json.loads(await ws.recv())["type"] == "session.created"
        await ws.send(json.dumps({"type": "session.update", "lag": True}))

        async def send() -> None:
            nonlocal sent_s
            started = time.monotonic()
            for message in messages:
                await ws.send(message)
                sent_s += SAMPLES_PER_APPEND / 16000
                if speed is not None:
                    await asyncio.sleep(max(0.0, started + sent_s / speed - time.monotonic()))
                else:
                    await asyncio.sleep(0)  # let the reader run, as a real client's event loop does
            await ws.send(json.dumps({"type": "input_audio_buffer.commit", "final": True}))

        sender = asyncio.create_task(send())
        try:
            while not seen or seen[-1]["type"] != "transcription.done":
                seen.append(json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT_S)))
        except websockets.ConnectionClosed as closed:
            return seen, closed.rcvd.code if closed.rcvd else None, sent_s
        finally:
            sender.cancel()
            with contextlib.suppress(asyncio.CancelledError, websockets.ConnectionClosed):
                await sender
    return seen, None, sent_s


def test_a_client_at_ten_times_real_time_gets_its_text(slow):
    pcm = pcm16(LONG)[: 60 * 16000]
    batcher = Batcher(slow, batch_size=2)
    with serving(create_app(batcher), **KEEPALIVE) as base_url:
        seen, code, sent_s = asyncio.run(client(ws_url(base_url), appends(pcm, len(pcm)), speed=10.0))
        redecodes = batcher.metrics.stats.chunks
    assert code is None, f"the connection was closed ({code}): {seen[-3:]}"
    done = seen[-1]
    assert done["type"] == "transcription.done" and done["text"].strip()
    assert "".join(e["delta"] for e in seen if e["type"] == "transcription.delta") == done["text"]
    assert not [e for e in seen if e["type"] == "error"]
    lags = [e["behind_s"] for e in seen if e["type"] == "transcription.lag"]
    assert lags and max(lags) >= 1.0  # the server really was behind (the test is not vacuous)
    assert max(lags) <= RealtimeOptions().max_backlog_s  # the bound held
    # caught up: fewer re-decodes than one per step_s (1 s) of audio, as at real time
    assert redecodes < sent_s / 1.0 * 0.7, (redecodes, sent_s)


def test_an_hour_sent_as_fast_as_possible_gets_a_clear_error_and_a_clean_close(slow):
    pcm = pcm16(LONG)
    options = RealtimeOptions(max_backlog_s=20.0)
    batcher = Batcher(slow, batch_size=2)
    with serving(create_app(batcher, realtime=options), **KEEPALIVE) as base_url:
        uri = ws_url(base_url)
        seen, code, sent_s = asyncio.run(client(uri, appends(pcm, 3600 * 16000), speed=None))
        wait_until(lambda: batcher.streams.n_open == 0)  # the server notices the close
        n_open = batcher.streams.n_open
        after, after_code, _ = asyncio.run(client(uri, appends(pcm, 16000), speed=None))  # the server goes on
    errors = [e for e in seen if e["type"] == "error"]
    assert code == POLICY_VIOLATION, f"closed with {code}, not for a full backlog: {seen[-3:]}"
    assert [e["code"] for e in errors] == ["backlog_full"] and "20 s" in errors[0]["error"]
    assert sent_s < 3600  # it did not take the hour in
    assert all(e["behind_s"] <= options.max_backlog_s for e in seen if e["type"] == "transcription.lag")
    assert n_open == 0  # its stream (and engine row) went with it
    assert after_code is None and after[-1]["type"] == "transcription.done"


def stream_bytes_bound(options: RealtimeOptions) -> int:
    """The most a session holds as numpy arrays beyond its engine row, in bytes: a full backlog, its policy's
    buffer (at most one 30 s window) and one append being applied, as float32 16 kHz samples. (A waiting
    re-decode's features, 80 x 3000 float32 = 0.96 MB, are torch tensors: at most one waiting and one in the
    engine per stream, `StreamQueue`.)"""
    from asr_spec.stream.policy import WINDOW_S

    samples = options.max_backlog_samples + int(WINDOW_S * 16000) + options.max_append_samples
    return 4 * samples


def test_sixteen_streams_and_an_hour_sender_hold_bounded_memory(slow):
    """16 streams and a client sending an hour as fast as it can, on a server whose engine is slower than real
    time: the numpy bytes the process holds at its peak (tracemalloc: numpy reports its buffers to it; counted,
    not timed, not RSS) stay within 17 sessions' bound, whatever the hour sender sent, and the hour sender ends
    with backlog_full. The engine's own memory is its rows' (`--batch-size`), not the streams': they share it."""
    import tracemalloc

    pcm = pcm16(LONG)
    options = RealtimeOptions(max_backlog_s=10.0)
    batcher = Batcher(slow, batch_size=2, max_streams=17)

    async def all_clients(uri: str):
        streams = [client(uri, appends(pcm[i * 8000:], 6 * 16000), speed=4.0) for i in range(16)]
        return await asyncio.gather(client(uri, appends(pcm, 3600 * 16000), speed=None), *streams)

    with serving(create_app(batcher, realtime=options), **KEEPALIVE) as base_url:
        tracemalloc.start()
        try:
            baseline, _ = tracemalloc.get_traced_memory()
            outcomes = asyncio.run(all_clients(ws_url(base_url)))
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    (hour, hour_code, hour_sent_s), streams = outcomes[0], outcomes[1:]
    assert hour_code == POLICY_VIOLATION and hour_sent_s > options.max_backlog_s  # it sent past the bound
    assert [e["code"] for e in hour if e["type"] == "error"] == ["backlog_full"]
    for seen, code, _ in streams:
        assert code is None and seen[-1]["type"] == "transcription.done", seen[-3:]
    held = peak - baseline
    bound = 17 * stream_bytes_bound(options)
    assert held <= bound, f"{held / 1e6:.1f} MB held at the peak, bound {bound / 1e6:.1f} MB"
    assert held >= 16 * 6 * 16000 * 2  # the count sees the streams' audio (at least the clients' own PCM)
