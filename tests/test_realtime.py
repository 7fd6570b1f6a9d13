"""WS /v1/realtime on a real 127.0.0.1 port (uvicorn in a thread), driven as vLLM's realtime example client drives
it (the `websockets` package: session.created, commit, appends, commit final, deltas, done), with the tiny
real-vocabulary Whisper of test_transcribe: each stream's text equals the streaming API's (`Transcriber.stream`)
for the same samples (every step re-decoded); 8 streams and an upload at once; a malformed event;
--max-streams; a client that goes away; API keys."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import re
import threading
import time

import numpy as np
import pytest

pytest.importorskip("fastapi", reason="needs the asr-spec[serve] extra")
websockets = pytest.importorskip("websockets", reason="needs the asr-spec[serve] extra")

from conftest import no_uvicorn, wait_until_async  # noqa: E402
from test_serve import serving  # noqa: E402
from test_transcribe import LONG, SHORT, transcriber  # noqa: E402

from asr_spec.audio.loading import load_audio  # noqa: E402
from asr_spec.engine.capture import StepRunner  # noqa: E402
from asr_spec.errors import InputError  # noqa: E402
from asr_spec.serve.app import ServeOptions, create_app  # noqa: E402
from asr_spec.serve.batcher import Batcher  # noqa: E402
from asr_spec.serve.realtime import RealtimeOptions  # noqa: E402
from asr_spec.stream.decodes import GROUP_WAIT_S  # noqa: E402
from asr_spec.stream.policy import StreamOptions  # noqa: E402

TIMEOUT_S = 120
BLOCK_BYTES = 4096  # vLLM's example client sends 4 KB of PCM16 per append
KEY = "realtime-test-key"


MAX_NEW = 12  # tokens per re-decode: the tiny random model never says <|endoftext|>, so this bounds each decode
# every step re-decoded however fast the client sends: the text is then exactly the streaming API's (catching up
# re-decodes a stream that is behind less often: tests/test_realtime_backlog.py)
EVERY_STEP = RealtimeOptions(catch_up=False)


def realtime_transcriber():
    return transcriber(speculative=False, timestamps=True, max_new_tokens=MAX_NEW)


@pytest.fixture(scope="module")
def greedy():
    return realtime_transcriber()


def pcm16(path) -> np.ndarray:
    """The file as the client sends it: 16 kHz mono int16."""
    samples = load_audio(str(path))
    return np.clip(np.round(samples * 32768), -32768, 32767).astype("<i2")


_STREAMED: dict[tuple[int, bytes], str] = {}


def streaming_api(transcriber, pcm: np.ndarray, block_samples: int = 1600) -> str:
    """The final text of `Transcriber.stream` (the streaming API) fed `pcm` in 0.1 s blocks: what the server must
    give for the same samples whatever else shares its engine (kept per transcriber and samples)."""
    key = (id(transcriber), pcm.tobytes())
    if key not in _STREAMED:
        _STREAMED[key] = _stream_alone(transcriber, pcm, block_samples)
    return _STREAMED[key]


def _stream_alone(transcriber, pcm: np.ndarray, block_samples: int) -> str:
    samples = pcm.astype(np.float32) / 32768.0
    blocks = [samples[i:i + block_samples] for i in range(0, len(samples), block_samples)]
    updates = list(transcriber.stream(blocks))
    assert updates and updates[-1].final
    return updates[-1].text


async def stream(uri: str, pcm: np.ndarray, headers=None, subprotocols=None, pace_s: float = 0.0,
                 before=()) -> tuple[dict, list[str], list[dict]]:
    """vLLM's example client: (the done event, the deltas, the error events) of streaming `pcm`; `before`: raw
    messages sent first."""
    async with websockets.connect(uri, additional_headers=headers, subprotocols=subprotocols,
                                  max_size=None) as ws:
        created = json.loads(await ws.recv())
        assert created["type"] == "session.created" and created["id"]
        for message in before:
            await ws.send(message)
        await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
        raw = pcm.tobytes()
        for start in range(0, len(raw), BLOCK_BYTES):
            audio = base64.b64encode(raw[start:start + BLOCK_BYTES]).decode()
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": audio}))
            if pace_s:
                await asyncio.sleep(pace_s)
        await ws.send(json.dumps({"type": "input_audio_buffer.commit", "final": True}))
        deltas, errors = [], []
        while True:
            event = json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT_S))
            if event["type"] == "transcription.delta":
                deltas.append(event["delta"])
            elif event["type"] == "error":
                errors.append(event)
            elif event["type"] == "transcription.done":
                return event, deltas, errors


def ws_url(base_url: str) -> str:
    return base_url.replace("http://", "ws://").replace("/v1", "/v1/realtime")


def check(done: dict, deltas: list[str], want: str) -> None:
    assert done["text"] == want and "".join(deltas) == want
    usage = done["usage"]
    assert usage["completion_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_a_stream_equals_the_streaming_api(greedy):
    pcm = pcm16(SHORT[0])
    with serving(create_app(Batcher(greedy, batch_size=4), realtime=EVERY_STEP)) as base_url:
        done, deltas, errors = asyncio.run(stream(ws_url(base_url), pcm))
    assert not errors
    want = streaming_api(greedy, pcm)
    assert want.strip()  # the tiny model says something: the comparison is not of two empty strings
    check(done, deltas, want)


@pytest.mark.parametrize("hypothesis", [True, False])
def test_the_hypothesis_switch_changes_the_drafts_offered_not_the_text(greedy, hypothesis):
    """RealtimeOptions(hypothesis=...) (`asr-spec serve --hypothesis/--no-hypothesis`): on, re-decodes after the
    first offer the stream's previous hypothesis; off, none offers one; the text is the streaming API's either way."""
    pcm = pcm16(SHORT[0])
    batcher = Batcher(greedy, batch_size=4)
    offered: list[tuple[int, ...]] = []
    submit = batcher.streams.submit

    def recording_submit(stream, samples, hypothesis=(), prefix=(), renew=None):
        offered.append(tuple(hypothesis))
        submit(stream, samples, hypothesis, prefix, renew)

    batcher.streams.submit = recording_submit
    options = RealtimeOptions(catch_up=False, hypothesis=hypothesis)
    with serving(create_app(batcher, realtime=options)) as base_url:
        done, deltas, errors = asyncio.run(stream(ws_url(base_url), pcm))
    assert not errors and len(offered) > 2
    assert any(offered) is hypothesis
    check(done, deltas, streaming_api(greedy, pcm))


@pytest.mark.slow
def test_eight_streams_and_an_upload_at_once(greedy):
    import httpx

    clips = [*SHORT, *SHORT][:8]
    pcms = [pcm16(path) for path in clips]
    upload_want = greedy.transcribe([str(SHORT[1])], progress=False)[0].text
    batcher = Batcher(greedy, batch_size=4, max_streams=8)
    realtime = RealtimeOptions(model_id="tiny", catch_up=False)
    with serving(create_app(batcher, ServeOptions(model_id="tiny"), realtime)) as base_url:
        upload: dict = {}

        def post() -> None:
            files = {"file": (SHORT[1].name, SHORT[1].read_bytes(), "audio/flac")}
            upload["text"] = httpx.post(f"{base_url}/audio/transcriptions", files=files, data={"model": "tiny"},
                                        timeout=TIMEOUT_S).json()["text"]

        async def all_streams():
            return await asyncio.gather(*(stream(ws_url(base_url), pcm, pace_s=0.002) for pcm in pcms))

        poster = threading.Thread(target=post)
        poster.start()
        outcomes = asyncio.run(all_streams())
        poster.join(TIMEOUT_S)
        chunks = batcher.metrics.stats.chunks
    assert upload["text"] == upload_want
    for pcm, (done, deltas, errors) in zip(pcms, outcomes):
        assert not errors
        check(done, deltas, streaming_api(greedy, pcm))
    assert chunks >= 8 * 3  # every stream re-decoded several times, through the server's one engine


def test_a_malformed_event_gets_an_error_event_and_the_connection_goes_on(greedy):
    pcm = pcm16(SHORT[2])
    bad = ["not json", json.dumps({"type": "input_audio_buffer.append", "audio": "%%%"}),
           json.dumps({"type": "session.update", "model": "gpt-4o"}), json.dumps({"type": "response.create"})]
    realtime = RealtimeOptions(model_id="tiny", catch_up=False)
    with serving(create_app(Batcher(greedy, batch_size=2), ServeOptions(model_id="tiny"), realtime)) as base_url:
        done, deltas, errors = asyncio.run(stream(ws_url(base_url), pcm, before=bad))
    assert [e["code"] for e in errors] == ["invalid_json", "invalid_audio", "model_not_found", "unknown_event"]
    assert all("\n" not in e["error"] and e["error"] for e in errors)
    check(done, deltas, streaming_api(greedy, pcm))


def test_streams_past_max_streams_are_refused_cleanly(greedy):
    batcher = Batcher(greedy, batch_size=2, max_streams=2)

    async def scenario(uri: str):
        first = await websockets.connect(uri)
        second = await websockets.connect(uri)
        for ws in (first, second):
            assert json.loads(await ws.recv())["type"] == "session.created"
        third = await websockets.connect(uri)
        refusal = json.loads(await third.recv())
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await third.recv()
        gauges = batcher.metrics.render()
        await first.close()
        await wait_until_async(lambda: batcher.streams.n_open < 2)  # the server notices the close
        done = await stream(uri, pcm16(SHORT[3]))
        await second.close()
        return refusal, closed.value.rcvd.code, done, gauges

    with serving(create_app(batcher)) as base_url:
        refusal, code, (done, deltas, errors), gauges = asyncio.run(scenario(ws_url(base_url)))
    assert "asr_spec_streams_open 2\n" in gauges  # /metrics counts the open streams
    assert refusal["type"] == "error" and refusal["code"] == "too_many_streams"
    assert "--max-streams 2" in refusal["error"] and code == 1013
    assert not errors and done["text"] == "".join(deltas)


def test_a_client_that_goes_away_frees_its_row_at_once():
    slow = realtime_transcriber()
    steps: list[float] = []

    def wrap(fn):
        def paced(m, rules, st, *args):
            steps.append(time.monotonic())
            time.sleep(0.05)  # a step as slow as a real model's: a re-decode takes seconds
            fn(m, rules, st, *args)
        return paced

    slow.engine.runner = StepRunner("wrapped", wrap)
    batcher = Batcher(slow, batch_size=2, max_streams=1)

    async def scenario(uri: str) -> float:
        ws = await websockets.connect(uri)
        await ws.recv()
        raw = pcm16(LONG)[: 16000 * 3].tobytes()
        await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(raw).decode()}))
        await wait_until_async(lambda: bool(batcher.streams.n_in_engine and steps))
        assert batcher.streams.n_in_engine == 1, "the stream's re-decode never reached the engine"
        await ws.close()
        gone = time.monotonic()
        await wait_until_async(lambda: batcher.streams.n_open == 0)
        await asyncio.sleep(0.5)  # ten steps' time: a row still decoding would have stepped meanwhile
        return gone

    with serving(create_app(batcher)) as base_url:
        gone = asyncio.run(scenario(ws_url(base_url)))
        assert batcher.streams.n_open == 0 and batcher.streams.n_in_engine == 0
        late = [t for t in steps if t > gone + 0.2]
        assert not late, f"{len(late)} steps ran after the client left"
        done, deltas, errors = asyncio.run(stream(ws_url(base_url), pcm16(SHORT[4])[:16000]))  # its place is free
    assert not errors and done["type"] == "transcription.done"


def test_api_keys_apply_to_the_websocket_and_the_page_is_open(greedy):
    import httpx

    pcm = pcm16(SHORT[5])[:16000]
    app = create_app(Batcher(greedy, batch_size=2), ServeOptions(model_id="tiny", api_keys=(KEY,)),
                     RealtimeOptions(model_id="tiny", catch_up=False))
    with serving(app) as base_url:
        uri = ws_url(base_url)
        with pytest.raises(websockets.InvalidStatus) as refused:
            asyncio.run(stream(uri, pcm))
        assert refused.value.response.status_code == 403
        with pytest.raises(websockets.InvalidStatus):
            asyncio.run(stream(uri, pcm, headers={"Authorization": "Bearer wrong"}))
        by_header = asyncio.run(stream(uri, pcm, headers={"Authorization": f"Bearer {KEY}"}))
        by_subprotocol = asyncio.run(stream(uri, pcm, subprotocols=["realtime", f"openai-insecure-api-key.{KEY}"]))
        root = base_url[: -len("/v1")]
        page = httpx.get(f"{root}/")
        script = httpx.get(f"{root}/static/pcm-worklet.js")
    assert by_header[0]["text"] == by_subprotocol[0]["text"]
    assert page.status_code == 200 and 'id="tentative"' in page.text
    assert script.status_code == 200 and "registerProcessor" in script.text


def test_realtime_options_are_checked():
    from asr_spec.errors import InputError

    with pytest.raises(InputError, match="max_backlog_s must be a positive number of seconds"):
        RealtimeOptions(max_backlog_s=0)
    with pytest.raises(InputError, match=r"max_backlog_s \(0.05\) must be at least block_s \(0.1\)"):
        RealtimeOptions(max_backlog_s=0.05)
    with pytest.raises(InputError, match=r"max_backlog_s \(5\) must be at least max_append_s \(10\)"):
        RealtimeOptions(max_backlog_s=5)  # a legal 6 s append would be refused by an empty backlog
    with pytest.raises(InputError, match="max_backlog_s must be a positive number of seconds"):
        RealtimeOptions(max_backlog_s=float("inf"))  # counted in samples: int(inf) raised at the first append
    with pytest.raises(InputError, match="catch_up must be true or false"):
        RealtimeOptions(catch_up="yes")
    with pytest.raises(InputError, match="hypothesis must be true or false"):
        RealtimeOptions(hypothesis=1)


def test_one_input_after_another_on_a_connection(greedy, caplog):
    """After transcription.done the same connection streams the next input; an append after a final commit is an
    error (input_finished), and the connection goes on. The trace (`--trace-streams`: the policy's DEBUG lines)
    names the session, each input and the client."""
    first, second = pcm16(SHORT[1])[:24000], pcm16(SHORT[2])[:20000]
    options = RealtimeOptions(model_id="asr-spec", catch_up=False)

    async def two_inputs(uri: str):
        async with websockets.connect(uri) as ws:
            assert json.loads(await ws.recv())["type"] == "session.created"
            outcomes = []
            for pcm in (first, second):
                raw = pcm.tobytes()
                for start in range(0, len(raw), BLOCK_BYTES):
                    audio = base64.b64encode(raw[start:start + BLOCK_BYTES]).decode()
                    await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": audio}))
                await ws.send(json.dumps({"type": "input_audio_buffer.commit", "final": True}))
                await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": audio}))
                events_seen = []
                while not events_seen or events_seen[-1]["type"] != "transcription.done":
                    events_seen.append(json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT_S)))
                outcomes.append(events_seen)
            return outcomes

    with caplog.at_level(logging.DEBUG, logger="asr_spec.stream.policy"):
        with serving(create_app(Batcher(greedy, batch_size=2), realtime=options)) as base_url:
            outcomes = asyncio.run(two_inputs(ws_url(base_url)))
    named = {re.match(r"(sess-\w+) input (\d) \(127\.0\.0\.1:\d+\) decode \d+ ", r.getMessage()).group(1, 2)
             for r in caplog.records if r.name == "asr_spec.stream.policy"}
    assert len(named) == 2 and {n for _, n in named} == {"1", "2"} and len({s for s, _ in named}) == 1, named
    for pcm, seen in zip((first, second), outcomes):
        errors = [e for e in seen if e["type"] == "error"]
        assert [e["code"] for e in errors] == ["input_finished"]
        deltas = [e["delta"] for e in seen if e["type"] == "transcription.delta"]
        check(seen[-1], deltas, streaming_api(greedy, pcm))


def test_cli_refuses_a_bad_max_streams_before_loading(capsys, tmp_path):
    from asr_spec.cli import main

    with pytest.raises(SystemExit) as info:
        main(["serve", "--model", str(tmp_path / "absent"), "--max-streams", "0"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "max_streams must be an integer >= 1" in err, err
    assert len(err.strip().splitlines()) == 1


def test_a_server_without_timestamp_mode_refuses_streams_and_still_serves_uploads():
    plain = transcriber(speculative=False, timestamps=False, max_new_tokens=MAX_NEW)

    async def refused(uri: str):
        async with websockets.connect(uri) as ws:
            event = json.loads(await ws.recv())
            with pytest.raises(websockets.ConnectionClosed) as closed:
                await ws.recv()
            return event, closed.value.rcvd.code

    import httpx

    with serving(create_app(Batcher(plain, batch_size=2))) as base_url:
        event, code = asyncio.run(refused(ws_url(base_url)))
        files = {"file": (SHORT[0].name, SHORT[0].read_bytes(), "audio/flac")}
        upload = httpx.post(f"{base_url}/audio/transcriptions", files=files, timeout=TIMEOUT_S)
    assert event["type"] == "error" and event["code"] == "streaming_unavailable" and code == 1003
    assert "timestamp mode" in event["error"]
    assert upload.status_code == 200


@pytest.mark.parametrize(("flags", "message"), [(["--max-backlog-s", "0"], "max_backlog_s must be a positive "
                                                  "number of seconds"),
                                                 (["--step-s", "0.01"], "stream step_s must be in [0.1, 10] seconds"),
                                                 (["--context-s", "-1"], "stream context_s must be in"),
                                                 (["--group-wait-s", "-1"], "group_wait_s must be a finite number "
                                                  "of seconds >= 0"),
                                                 (["--trace-streams", "/proc/version/trace.log"],
                                                  "--trace-streams /proc/version/trace.log: cannot write there")])
def test_cli_refuses_a_bad_backlog_or_step_before_loading(capsys, tmp_path, flags, message):
    from asr_spec.cli import main

    with pytest.raises(SystemExit) as info:
        main(["serve", "--model", str(tmp_path / "absent"), *flags])
    err = capsys.readouterr().err
    assert info.value.code == 2 and message in err, err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(("flags", "backlog_s", "catch_up", "step_s", "hypothesis", "prefix", "context_s",
                          "group_wait_s"),
                         [([], RealtimeOptions().max_backlog_s, True, StreamOptions().step_s, False, True,
                           StreamOptions().context_s, GROUP_WAIT_S),
                          (["--max-backlog-s", "30", "--no-catch-up", "--step-s", "2", "--no-hypothesis",
                            "--no-committed-prefix", "--context-s", "3", "--group-wait-s", "0"], 30.0, False, 2.0,
                           False, False, 3.0, 0.0),
                          (["--catch-up", "--hypothesis", "--committed-prefix", "--context-s", "0",
                            "--group-wait-s", "0.5"], RealtimeOptions().max_backlog_s, True, StreamOptions().step_s,
                           True, True, 0.0, 0.5)])
def test_serve_passes_its_backlog_catch_up_and_step_options_to_the_sessions(monkeypatch, greedy, flags, backlog_s,
                                                                            catch_up, step_s, hypothesis, prefix,
                                                                            context_s, group_wait_s):
    """`asr-spec serve --max-backlog-s S --catch-up/--no-catch-up --step-s S --hypothesis/--no-hypothesis
    --committed-prefix/--no-committed-prefix --context-s S --group-wait-s S`: the app's realtime options and its
    batcher's stream queue (models and uvicorn replaced by the tiny transcriber and a recorder)."""
    import asr_spec.serve.app as app_module
    from asr_spec.cli import main
    from asr_spec.transcribe import Transcriber

    made: dict = {}
    create_app_itself = app_module.create_app

    def recording_create_app(batcher, options, realtime):
        made["realtime"], made["batcher"] = realtime, batcher
        return create_app_itself(batcher, options, realtime)

    monkeypatch.setattr(Transcriber, "from_preset", classmethod(lambda cls, *args, **kwargs: greedy))
    monkeypatch.setattr(app_module, "create_app", recording_create_app)
    no_uvicorn(monkeypatch, lambda app: made.setdefault("app", app))
    with pytest.raises(SystemExit) as info:
        main(["serve", "--preset", "base", *flags])
    assert info.value.code == 0 and made["app"] is not None
    assert made["realtime"].max_backlog_s == backlog_s and made["realtime"].catch_up is catch_up
    assert made["realtime"].model_id == "base" and made["realtime"].stream.step_s == step_s
    assert made["realtime"].hypothesis is hypothesis
    assert made["realtime"].stream.committed_prefix is prefix and made["batcher"].streams.group_wait_s == group_wait_s
    assert made["realtime"].stream.context_s == context_s


def test_a_server_started_with_a_prompt_gives_it_to_its_streams(monkeypatch):
    """`asr-spec serve --initial-prompt T --hotwords H` gave them to uploads only: every re-decode of a live stream
    now carries the prompt an upload's first window gets (the realtime protocol has no field for a session's own),
    and the stream's text is `Transcriber.stream`'s with the same prompts."""
    from test_stream import PROMPTS, first_window_prompt, recorded_requests

    from asr_spec.cli import main
    from asr_spec.stream.decodes import is_stream_id
    from asr_spec.transcribe import Transcriber

    made: dict = {}

    def from_preset(cls, preset, **overrides):  # the tiny model, with the prompts the CLI passes
        prompts = {key: overrides[key] for key in PROMPTS if key in overrides}
        return made.setdefault("asr", transcriber(speculative=False, timestamps=True, max_new_tokens=MAX_NEW,
                                                  **prompts))

    monkeypatch.setattr(Transcriber, "from_preset", classmethod(from_preset))
    no_uvicorn(monkeypatch, lambda app: made.setdefault("app", app))
    with pytest.raises(SystemExit) as info:
        main(["serve", "--preset", "base", "--no-catch-up", "--initial-prompt", PROMPTS["initial_prompt"],
              "--hotwords", PROMPTS["hotwords"]])
    assert info.value.code == 0 and made["app"] is not None
    monkeypatch.undo()  # the app it built is served for real below
    asr, pcm = made["asr"], pcm16(SHORT[0])
    want = first_window_prompt(asr, SHORT[0])
    assert want == asr.prompt_tokens().first_previous and len(want) > 5
    seen = recorded_requests(asr.engine)
    with serving(made["app"]) as base_url:
        done, deltas, errors = asyncio.run(stream(ws_url(base_url), pcm))
    assert not errors
    redecodes = [r for r in seen if is_stream_id(r.id)]
    assert len(redecodes) > 2 and all(r.prompt == want for r in redecodes)
    del asr.engine.run  # the streaming API's decodes below go unrecorded
    check(done, deltas, streaming_api(asr, pcm))


def test_the_server_captures_its_step_graphs_before_the_engine_starts(monkeypatch):
    """The app's startup calls `Engine.capture_ahead(rows)` once, before the engine thread starts (a CUDA-graph
    engine captures then; an eager one returns 0, as here)."""
    from fastapi.testclient import TestClient

    model = realtime_transcriber()
    calls: list = []
    capture_ahead = model.engine.capture_ahead

    def spy(batch_size: int) -> int:
        calls.append(("capture_ahead", batch_size))
        return capture_ahead(batch_size)

    class Started(Batcher):
        def start(self) -> None:
            calls.append(("start",))
            super().start()

    monkeypatch.setattr(model.engine, "capture_ahead", spy)
    batcher = Started(model, batch_size=3)
    with TestClient(create_app(batcher)) as client:
        assert client.get("/health").status_code == 200
    assert calls == [("capture_ahead", 3), ("start",)]


def test_the_sessions_policies_take_the_servers_stream_options(greedy):
    from asr_spec.serve.realtime import default_policy
    from asr_spec.stream.policy import StreamOptions

    assert default_policy(greedy, vad=False, options=StreamOptions(step_s=2.5))().options.step_s == 2.5
    assert default_policy(greedy, vad=False)().options == StreamOptions()
    with pytest.raises(InputError, match="stream must be a StreamOptions"):
        RealtimeOptions(stream={"step_s": 2})


def test_a_group_of_redecodes_and_an_upload_chunk_take_turns(greedy):
    """The batcher's source (no engine thread: its requests pulled by hand): a group of the streams' waiting
    re-decodes, then an upload's chunk when one waits, then the streams' next group, and so on; neither waits for
    the other to run dry."""
    from asr_spec.stream.decodes import is_stream_id

    batcher = Batcher(greedy, batch_size=4, group_wait_s=0)
    job = batcher.prepare(str(SHORT[0]))
    batcher.submit(job)
    streams = [batcher.streams.open(lambda outcome: None) for _ in range(3)]
    samples = load_audio(str(SHORT[1]))[:32000]
    source = batcher._source()
    for stream in streams[:2]:
        batcher.streams.submit(stream, samples)
    pulled = [next(source), next(source), next(source)]
    assert [is_stream_id(r.id) for r in pulled] == [True, True, False]  # the group of two, then the upload
    batcher.streams.submit(streams[2], samples)
    assert is_stream_id(next(source).id)  # the streams' turn again
    batcher.cancel(job)


def test_the_server_takes_the_streams_waiting_redecodes_in_groups_of_one_encoder_call(greedy):
    """Eight streams' re-decodes wait: the server's source pulls the four oldest (what the engine encodes in one call
    on a CPU: a group of 8 would be encoded in two calls before any of its rows decoded, and every result would
    come back at the round's end) and nothing more while they are in the engine; the other four wait for the next
    group (docs/live.md, "Groups of one encoder call")."""
    batcher = Batcher(greedy, batch_size=8)
    streams = [batcher.streams.open(lambda outcome: None) for _ in range(8)]
    for stream in streams:
        batcher.streams.submit(stream, np.zeros(16000, np.float32))
    source = batcher._source()
    group = [next(source) for _ in range(4)]
    assert greedy.engine.encode_batch(8) == 4 and [r.id.owner for r in group] == [s.owner for s in streams[:4]]
    assert next(source) is None and batcher.streams.n_waiting == 4  # held while the first four are in the engine
