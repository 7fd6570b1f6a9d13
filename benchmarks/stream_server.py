"""The server side of `benchmarks.bench_stream --server`: the app in this process on 127.0.0.1 (uvicorn in a
thread), the real-time clients and the fast sender over its WebSocket, and where its engine's time went."""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import numpy as np

from asr_spec import Transcriber
from asr_spec.audio.loading import SAMPLE_RATE
from asr_spec.stream.decodes import GROUP_WAIT_S
from asr_spec.stream.policy import StreamOptions

APPEND_S = 0.1  # seconds of audio per append event


async def ws_client(uri: str, audio: np.ndarray, speed: float) -> dict:
    """One stream through /v1/realtime: sends `audio` at `speed` x real time while reading events; returns the
    wall times (from its start) of each delta and of the end of each append sent, the done text, the largest
    lag reported, and how the connection ended."""
    import asyncio
    import base64

    import websockets

    pcm = np.clip(np.round(audio * 32768), -32768, 32767).astype("<i2").tobytes()
    step = int(APPEND_S * SAMPLE_RATE) * 2
    out = {"deltas": [], "behind_s": 0.0, "text": None, "error": None, "closed": None, "last_sent": None}
    async with websockets.connect(uri, max_size=None) as ws:
        await ws.recv()  # session.created
        await ws.send(json.dumps({"type": "session.update", "lag": True}))
        start = time.perf_counter()

        async def send() -> None:
            for i in range(0, len(pcm), step):
                await asyncio.sleep(max(0.0, start + i / 2 / SAMPLE_RATE / speed - time.perf_counter()))
                await ws.send(json.dumps({"type": "input_audio_buffer.append",
                                          "audio": base64.b64encode(pcm[i:i + step]).decode()}))
            await ws.send(json.dumps({"type": "input_audio_buffer.commit", "final": True}))
            out["last_sent"] = time.perf_counter() - start

        sender = asyncio.create_task(send())
        try:
            async for message in ws:
                event, now = json.loads(message), time.perf_counter() - start
                if event["type"] == "transcription.delta":
                    out["deltas"].append((event["delta"], now))
                elif event["type"] == "transcription.lag":
                    out["behind_s"] = max(out["behind_s"], event["behind_s"])
                elif event["type"] == "error":
                    out["error"] = event["code"]
                elif event["type"] == "transcription.done":
                    out["text"], out["done"] = event["text"], now
                    break
        except websockets.ConnectionClosed as closed:
            out["closed"] = closed.rcvd.code if closed.rcvd else "no close frame"
        await sender
    return out


async def ws_flood(uri: str, audio: np.ndarray, seconds: float) -> dict:
    """The fast sender: `seconds` of `audio` looped (never held whole: an hour is 115 MB of PCM16), sent as fast
    as the connection takes it; returns the seconds sent and how it ended (the server's error code and close
    code: backlog_full and 1008 past --max-backlog-s, or its text)."""
    import asyncio
    import base64

    import websockets

    block = np.clip(np.round(audio * 32768), -32768, 32767).astype("<i2")
    step = int(APPEND_S * SAMPLE_RATE)
    out = {"sent_s": 0.0, "error": None, "closed": None, "text": None}
    async with websockets.connect(uri, max_size=None) as ws:
        await ws.recv()  # session.created

        async def send() -> None:
            at = 0
            while out["sent_s"] < seconds:
                piece = np.take(block, np.arange(at, at + step), mode="wrap")
                at = (at + step) % len(block)
                await ws.send(json.dumps({"type": "input_audio_buffer.append",
                                          "audio": base64.b64encode(piece.tobytes()).decode()}))
                out["sent_s"] += APPEND_S
                await asyncio.sleep(0)  # let the reader run, as a real client's event loop does
            await ws.send(json.dumps({"type": "input_audio_buffer.commit", "final": True}))

        sender = asyncio.create_task(send())
        try:
            async for message in ws:
                event = json.loads(message)
                if event["type"] == "error":
                    out["error"] = event["code"]
                elif event["type"] == "transcription.done":
                    out["text"] = event["text"]
                    break
        except websockets.ConnectionClosed as closed:
            out["closed"] = closed.rcvd.code if closed.rcvd else "no close frame"
        sender.cancel()
        with contextlib.suppress(asyncio.CancelledError, websockets.ConnectionClosed):
            await sender
    return out


def run_server(asr: Transcriber, items, speed: float, rows: int, stream: StreamOptions, flood_s: float = 0.0,
               hypothesis: bool = True, group_wait_s: float = GROUP_WAIT_S) -> dict:
    """All slices at once through a server of `rows` engine rows (the streams share them, as `asr-spec serve
    --batch-size` rows do) on a free 127.0.0.1 port, each stream's policy set by `stream` (its previous
    hypothesis offered as the draft unless `hypothesis` is off), its waiting re-decodes held up to `group_wait_s`
    to be encoded together, with one more client sending `flood_s` seconds as fast as it can when flood_s > 0;
    returns each stream's ws_client result, the fast sender's, the run's peak RSS and where the engine's time went
    (`engine_counts`)."""
    import asyncio
    import socket
    import threading

    import uvicorn

    from asr_spec.serve import openmp, warm_up
    from asr_spec.serve.app import create_app
    from asr_spec.serve.batcher import Batcher
    from asr_spec.serve.realtime import RealtimeOptions

    batcher = Batcher(asr, batch_size=rows, max_streams=len(items) + 1, group_wait_s=group_wait_s)
    realtime = RealtimeOptions(model_id="bench", stream=stream, hypothesis=hypothesis)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    app = create_app(batcher, realtime=realtime)
    warm_up(asr, batcher.batch_size)  # as `asr-spec serve` does before it serves (its rows' memory held from the start)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    # `asr-spec serve` runs the app on the thread that loaded the models, and its lifespan releases that thread's
    # OpenMP workers; here that thread is this one (serve/openmp.py)
    openmp.release_pool()
    thread.start()
    while not server.started:
        time.sleep(0.05)
    Path("/proc/self/clear_refs").write_text("5")  # peak RSS from here (VmHWM)
    times_before = asr.engine.times.copy()

    async def all_streams():
        uri = f"ws://127.0.0.1:{port}/v1/realtime"
        flood = [ws_flood(uri, items[0][1], flood_s)] if flood_s > 0 else []
        return await asyncio.gather(*(ws_client(uri, audio, speed) for _, audio in items), *flood)

    try:
        results = asyncio.run(all_streams())
        flooded = results.pop() if flood_s > 0 else None
        peak_mib = int(next(line.split()[1] for line in Path("/proc/self/status").read_text().splitlines()
                            if line.startswith("VmHWM:"))) / 1024
    finally:
        server.should_exit = True
        thread.join(30)
    # read once the server has stopped its engine thread: a stream hears its last result before the engine thread
    # adds that result's stats to the metrics
    engine = engine_counts(batcher.metrics.stats, asr.engine.times.minus(times_before), batcher.streams.counts)
    return {"streams": dict(zip((name for name, _ in items), results)), "peak_rss_mib": peak_mib,
            "redecodes": engine["redecodes"], "engine": engine, "fast_sender": flooded}


def engine_counts(stats, times, counts) -> dict:
    """Where a server run's engine capacity went: re-decodes scheduled / replaced while waiting / taken (and of
    those brought up to date as taken) / withdrawn / delivered (`DecodeCounts`), tokens generated and target passes
    per re-decode (a pass counted once per row in it; a forced prefix is not generated: `ChunkStats`), hypothesis
    tokens offered and accepted, rows per decoding step (row-passes / steps), encoder, step and admission (prompts
    and prefixes prefilled) seconds per re-decode (`Engine.times`, wall: ratios only on a loaded machine), encoder
    calls and the windows each encoded on average, and the mean and longest wait of a re-decode before the engine
    took it and its mean time in the engine."""
    n = max(stats.chunks, 1)
    return {"redecodes": stats.chunks, "submitted": counts.submitted, "replaced": counts.replaced,
            "taken": counts.taken, "renewed": counts.renewed, "withdrawn": counts.withdrawn,
            "delivered": counts.delivered,
            "tokens_per_redecode": stats.generated_tokens / n, "passes_per_redecode": stats.target_passes / n,
            "target_passes": stats.target_passes, "hypothesis_offered": stats.hypothesis_offered,
            "hypothesis_accepted": stats.hypothesis_accepted, "steps": times.steps,
            "rows_per_step": stats.target_passes / max(times.steps, 1),
            "encoder_s_per_redecode": times.encoder_s / n, "steps_s_per_redecode": times.steps_s / n,
            "admit_s_per_redecode": times.admit_s / n, "encoder_calls": times.encoder_calls,
            "windows_per_encoder_call": times.encoder_windows / max(times.encoder_calls, 1),
            "encoder_share": times.encoder_s / max(times.encoder_s + times.steps_s, 1e-9),
            "wait_mean_s": counts.wait_s / max(counts.taken, 1), "wait_max_s": counts.max_wait_s,
            "in_engine_mean_s": counts.engine_s / max(counts.delivered, 1)}
