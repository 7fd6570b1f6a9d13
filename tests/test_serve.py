"""`asr-spec serve`: the OpenAI-compatible server, in-process (FastAPI's TestClient) and on a real 127.0.0.1 port
(uvicorn in a thread, the official `openai` client), with the tiny real-vocabulary Whisper of test_transcribe."""

from __future__ import annotations

import dataclasses
import io
import json
import socket
import threading
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

pytest.importorskip("fastapi", reason="needs the asr-spec[serve] extra")
from conftest import wait_until  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402
from test_transcribe import LONG, SHORT, auto_precision_words, transcriber  # noqa: E402

from asr_spec.chunk_id import ChunkId  # noqa: E402
from asr_spec.errors import InputError  # noqa: E402
from asr_spec.serve.app import ServeOptions, create_app  # noqa: E402
from asr_spec.serve.batcher import Batcher, Refused  # noqa: E402
from asr_spec.transcribe.outputs import render_srt, render_vtt  # noqa: E402

FILES = [LONG, SHORT[0], SHORT[1]]
FORMATS = ("json", "text", "srt", "vtt", "verbose_json")
TIMEOUT_S = 120


@pytest.fixture(scope="module")
def greedy():
    return transcriber(speculative=False, timestamps=True)


@pytest.fixture(scope="module")
def expected(greedy):
    return {path.name: t for path, t in zip(FILES, greedy.transcribe([str(p) for p in FILES], progress=False))}


@pytest.fixture(scope="module")
def client(greedy):
    app = create_app(Batcher(greedy, batch_size=4), ServeOptions(model_id="tiny", max_file_mb=2))
    with TestClient(app) as client:  # runs the lifespan: the engine thread starts and stops with it
        yield client


def post(client, path: Path, **fields):
    files = {"file": (path.name, path.read_bytes(), "audio/flac")}
    return client.post("/v1/audio/transcriptions", files=files, data={"model": "tiny", **fields})


def check_format(fmt: str, body, want) -> None:
    """`body`: the response's text (or the openai client's parsed object) in format `fmt`; `want`: the
    Transcriber's `Transcription` of the same file."""
    if fmt == "json":
        text = body.text if hasattr(body, "text") else json.loads(body)["text"]
        assert text == want.text
    elif fmt == "text":
        assert body == want.text + "\n"
    elif fmt == "srt":
        assert body == render_srt(want)
    elif fmt == "vtt":
        assert body == render_vtt(want)
    else:
        data = body.model_dump() if hasattr(body, "model_dump") else json.loads(body)
        assert data["text"] == want.text and data["language"] == "english"
        assert data["duration"] == pytest.approx(want.audio_s)
        assert [(s["start"], s["end"], s["text"]) for s in data["segments"]] == [
            (s.start_s, s.end_s, s.text) for s in want.segments]


# -- in-process ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_equals_the_transcriber(client, expected, fmt):
    for path in FILES:
        response = post(client, path, response_format=fmt)
        assert response.status_code == 200, response.text
        check_format(fmt, response.text, expected[path.name])
    assert expected[LONG.name].text and len(expected[LONG.name].chunks) == 4  # a real long-form case


def test_a_translating_server_answers_translations_and_a_transcribing_one_says_where_to_go(client):
    """OpenAI's `client.audio.translations.create` got a bare 404 (no route): now `asr-spec serve --task translate`
    answers /v1/audio/translations with the transcriber's translation, and each server refuses the other task's
    route with a 400 that names what to do (the task is the engine's: one a server)."""
    translating = transcriber(speculative=False, timestamps=True, task="translate")
    want = translating.transcribe([str(SHORT[0])], progress=False)[0]
    files = {"file": (SHORT[0].name, SHORT[0].read_bytes(), "audio/flac")}
    with TestClient(create_app(Batcher(translating, batch_size=2), ServeOptions(model_id="tiny"))) as other:
        answer = other.post("/v1/audio/translations", files=files,
                            data={"model": "tiny", "response_format": "verbose_json"})
        assert answer.status_code == 200, answer.text
        assert answer.json()["task"] == "translate" and answer.json()["text"] == want.text
        refused = other.post("/v1/audio/transcriptions", files=files, data={"model": "tiny"})
        assert refused.status_code == 400 and "this server translates" in refused.json()["error"]["message"]
    refused = client.post("/v1/audio/translations", files=files, data={"model": "tiny"})
    assert refused.status_code == 400 and "--task translate" in refused.json()["error"]["message"]


@pytest.mark.parametrize("fields, status, needle", [
    ({"temperature": "1.5"}, 400, "must be a number in [0, 1]"),
    ({"temperature": "hot"}, 400, "must be a number in [0, 1]"),
    ({"timestamp_granularities[]": "word", "response_format": "verbose_json"}, 400,
     "word timestamps are off on this server"),
    ({"timestamp_granularities[]": "phoneme"}, 400, "is not segment or word"),
    ({"response_format": "xml"}, 400, "response_format 'xml'"),
    ({"model": "gpt-4o-transcribe"}, 400, "not served here"),
    ({"language": "fr"}, 400, "per-request language is not supported"),
    ({"prompt": "x" * 10_001}, 400, "prompt: 10001 characters, over this server's limit"),
    ({"stream": "true"}, 400, "unknown field(s) 'stream'"),
    # form.get took the last one: an srt request answered json
    ({"response_format": ["srt", "json"]}, 400, "response_format: given 2 times"),
    ({"model": ["gpt-4o-transcribe", "tiny"]}, 400, "model: given 2 times"),
])
def test_bad_options_get_400_with_the_reason(client, fields, status, needle):
    """The error in OpenAI's shape; its `code` a string or null, as OpenAI's (it held the HTTP status, an integer
    that a client typed after OpenAI's, with a string there, fails to read)."""
    response = post(client, SHORT[0], **fields)
    assert response.status_code == status
    error = response.json()["error"]
    assert needle in error["message"] and error["type"] == "invalid_request_error" and error["code"] is None


def test_accepted_options(client, expected):
    response = post(client, SHORT[0], language="english", prompt="", **{"timestamp_granularities[]": "segment"})
    assert response.status_code == 200 and response.json()["text"] == expected[SHORT[0].name].text


def test_not_audio_missing_file_and_oversize(client):
    response = client.post("/v1/audio/transcriptions", files={"file": ("notes.txt", b"hello, not audio")},
                           data={"model": "tiny"})
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert message.startswith("notes.txt: not a readable audio file") and "\n" not in message
    assert client.post("/v1/audio/transcriptions", data={"model": "tiny"}).status_code == 400
    big = client.post("/v1/audio/transcriptions", files={"file": ("big.flac", b"\0" * 2_100_000)})
    assert big.status_code == 413 and "2 MB" in big.json()["error"]["message"]
    # a file just under the limit with prompt and hotwords at their 10,000 characters is no 413 (the allowance for
    # form fields was 64 KiB)
    near = io.BytesIO()
    sf.write(near, np.zeros(990_000, np.float32), 16_000, format="WAV", subtype="PCM_16")
    fields = {"model": "tiny", "prompt": "é" * 10_000, "hotwords": "é" * 10_000}
    response = client.post("/v1/audio/transcriptions", files={"file": ("near.wav", near.getvalue())}, data=fields)
    assert len(near.getvalue()) < 2_000_000 and response.status_code == 200, response.text[:200]
    playlist = f"#EXTM3U\n#EXT-X-TARGETDURATION:100\n#EXTINF:20,\n{SHORT[0]}\n#EXT-X-ENDLIST\n".encode()
    followed = client.post("/v1/audio/transcriptions", files={"file": ("x.wav", playlist)}, data={"model": "tiny"})
    assert followed.status_code == 400 and "text, not audio" in followed.json()["error"]["message"]


def test_models_health_and_metrics(client):
    assert client.get("/v1/models").json()["data"][0]["id"] == "tiny"
    assert client.get("/health").json()["status"] == "ok"
    post(client, SHORT[1])
    metrics = client.get("/metrics").text
    for name in ("asr_spec_requests_total{outcome=\"ok\"}", "asr_spec_audio_seconds_total", "asr_spec_queue_depth",
                 "asr_spec_batch_occupancy", "asr_spec_tokens_per_target_pass",
                 "asr_spec_request_latency_seconds_bucket{le=\"+Inf\"}"):
        assert name in metrics
    ok = next(line for line in metrics.splitlines() if line.startswith('asr_spec_requests_total{outcome="ok"}'))
    assert float(ok.split()[-1]) >= 1


def test_a_busy_server_answers_503_with_retry_after(greedy, expected):
    """Requests and seconds of audio in flight are bounded server-wide; an idle server takes any one request."""
    batcher = Batcher(greedy, batch_size=4, max_requests=2, max_audio_in_flight_s=100)
    with TestClient(create_app(batcher, ServeOptions(model_id="tiny"))) as client:
        batcher.admit(30.0)  # another request in flight, holding 30 s
        over = post(client, LONG)  # 77.7 s more: over 100 s
        assert over.status_code == 503 and over.headers["Retry-After"] == "1"
        assert "--max-audio-in-flight-s 100" in over.json()["error"]["message"]
        fits = post(client, SHORT[0])
        assert fits.status_code == 200 and fits.json()["text"] == expected[SHORT[0].name].text
        batcher.admit(1.0)  # two in flight now
        crowded = post(client, SHORT[0])
        assert crowded.status_code == 503 and "--max-requests 2" in crowded.json()["error"]["message"]
        batcher.release(1.0)
        batcher.release(30.0)
        assert batcher.in_flight == (0, 0.0)
        alone = Batcher(greedy, batch_size=4, max_requests=1, max_audio_in_flight_s=10)
    with TestClient(create_app(alone, ServeOptions(model_id="tiny"))) as client:
        response = post(client, LONG)  # longer than the whole budget, but the server is idle
        assert response.status_code == 200 and response.json()["text"] == expected[LONG.name].text
    assert alone.in_flight == (0, 0.0)  # its budget given back


def drain(job) -> list:
    """Every engine request of a prepared job (reading its whole input)."""
    requests = [job.pending, *job.requests]
    job.pending = None
    return requests


# -- voice-activity chunks and word timestamps ----------------------------------------------------------------

@pytest.fixture(scope="module")
def vad_words():
    """A VAD-chunked transcriber with word timestamps, and its transcripts of the files (words computed)."""
    pytest.importorskip("silero_vad")
    model = transcriber(speculative=False, timestamps=True, chunking="vad", word_timestamps=True)
    return model, {p.name: t for p, t in zip(FILES, model.transcribe([str(p) for p in FILES], progress=False))}


@pytest.fixture(scope="module")
def vad_plain():
    """The same transcriber's transcripts without words: what a request that asks for none gets (a segment with
    words spans them, `assembly.word_bounds`; one without keeps its timestamps)."""
    pytest.importorskip("silero_vad")
    model = transcriber(speculative=False, timestamps=True, chunking="vad")
    return {p.name: t for p, t in zip(FILES, model.transcribe([str(p) for p in FILES], progress=False))}


def words_of(result) -> list[tuple[str, float, float]]:
    return [(w.word.strip(), w.start, w.end) for s in result.segments for w in s.words]


def test_srt_and_vtt_answers_are_cut_and_laid_out_as_the_served_options_say():
    """A preset's caption settings (cues of at most 3 words, lines of 12 characters) were taken by `serve` and left
    out of its srt/vtt answers: one unwrapped cue a segment, where `transcribe` wrote them as asked. Cues cut from
    word times get their words aligned for such a request."""
    pytest.importorskip("silero_vad")
    model = transcriber(speculative=False, timestamps=True, chunking="vad", word_timestamps=True,
                        max_words_per_cue=3, max_line_width=12)
    want = model.transcribe([str(SHORT[0])], progress=False)[0]
    assert any(s.words for s in want.segments)
    with TestClient(create_app(Batcher(model, batch_size=2), ServeOptions(model_id="tiny"))) as served:
        for fmt, render_as in (("srt", render_srt), ("vtt", render_vtt)):
            response = post(served, SHORT[0], response_format=fmt)
            assert response.status_code == 200, response.text
            assert response.text == render_as(want, model.options.cues) != render_as(want)


def test_vad_server_chunks_and_stitches_as_the_transcriber(vad_words, vad_plain):
    """The server prepares requests with the transcriber's own front half (`Transcriber.prepare`: VAD chunks
    here), so its chunks and text are the Transcriber's; concurrent prepares each get their own VAD state."""
    from concurrent.futures import ThreadPoolExecutor

    model, want = vad_words
    batcher = Batcher(model, batch_size=4)
    with ThreadPoolExecutor(3) as pool:
        prepared = list(pool.map(batcher.prepare, [str(LONG)] * 3))
        requests = list(pool.map(drain, prepared))
    spans = [(c.start_s, c.end_s) for c in want[LONG.name].chunks]
    assert len(spans) > 1  # a multi-chunk file
    for job, reqs in zip(prepared, requests):
        assert [(s.start_sample / 16_000, s.end_sample / 16_000) for s in job.spans] == spans
        assert [r.id for r in reqs] == [ChunkId(job.id, i) for i in range(len(spans))]
        assert not any(r.keep_encoded for r in reqs)  # no words asked: no encoder output kept
    assert len({job.id for job in prepared}) == 3
    worded = drain(batcher.prepare(SHORT[0].read_bytes(), words=True))
    assert worded and all(r.keep_encoded for r in worded)  # the engine keeps what it encodes
    with TestClient(create_app(batcher, ServeOptions(model_id="tiny"))) as client:
        for path in FILES:
            for fmt in ("json", "verbose_json"):
                response = post(client, path, response_format=fmt)
                assert response.status_code == 200, response.text
                check_format(fmt, response.text, vad_plain[path.name])
                assert "words" not in response.json()


def test_word_timestamps_equal_the_transcriber(vad_words, vad_plain):
    from concurrent.futures import ThreadPoolExecutor

    model, want = vad_words
    asked = [(LONG, ["word"]), (SHORT[0], ["segment", "word"]), (SHORT[1], [])]
    with TestClient(create_app(Batcher(model, batch_size=3), ServeOptions(model_id="tiny"))) as client:
        with ThreadPoolExecutor(3) as pool:  # requests with and without words share the batch
            futures = [pool.submit(post, client, path, response_format="verbose_json",
                                   **{"timestamp_granularities[]": granularities}) for path, granularities in asked]
            answers = [future.result(timeout=TIMEOUT_S) for future in futures]
        refused = post(client, SHORT[0], response_format="json", **{"timestamp_granularities[]": "word"})
    for (path, granularities), response in zip(asked, answers):
        assert response.status_code == 200, response.text
        check_format("verbose_json", response.text, (want if "word" in granularities else vad_plain)[path.name])
        body = response.json()
        if "word" in granularities:
            assert [(w["word"], w["start"], w["end"]) for w in body["words"]] == words_of(want[path.name])
        else:
            assert "words" not in body
    assert words_of(want[LONG.name]) and len(want[LONG.name].chunks) > 1
    assert refused.status_code == 400
    assert "word needs response_format verbose_json" in refused.json()["error"]["message"]


def test_word_timestamps_need_the_aligner(greedy):
    batcher = Batcher(greedy, batch_size=2)
    with pytest.raises(InputError, match="word timestamps are off"):
        batcher.prepare(SHORT[0].read_bytes(), words=True)
    assert batcher.queue_depth == 0


# -- the batcher ----------------------------------------------------------------------------------------------

def wait_for(jobs, timeout_s: float = TIMEOUT_S) -> None:
    assert wait_until(lambda: all(job.finished for job in jobs), timeout_s, 0.02), "jobs did not finish in time"


def test_jobs_are_read_lazily_and_take_turns(greedy, expected):
    """A prepared job has read one chunk (its first) and nothing more; the engine reads the rest one chunk at a
    time, the jobs taking turns, so the short request is done long before the long one."""
    batcher = Batcher(greedy, batch_size=1)
    long_job = batcher.prepare(str(LONG))
    short_job = batcher.prepare(str(SHORT[0]))
    assert len(long_job.spans) == 1 and long_job.audio_s < 77 and not long_job.input.read_done
    finished = []
    long_job.on_done = short_job.on_done = lambda job: finished.append((job, len(long_job.results)))
    batcher.submit(long_job)
    batcher.submit(short_job)
    batcher.start()
    try:
        wait_for([long_job, short_job])
    finally:
        batcher.stop()
    assert [job for job, _ in finished] == [short_job, long_job]
    assert finished[0][1] < 4  # the long job was not fully decoded when the short one was done
    for job, path in ((long_job, LONG), (short_job, SHORT[0])):
        assert greedy.assemble("x", job.spans, job.ordered_results(), 0, 0).text == expected[path.name].text


def run_alone(batcher: Batcher, job):
    """`job` submitted to `batcher`, which runs until it has ended; the job."""
    batcher.submit(job)
    batcher.start()
    try:
        wait_for([job])
    finally:
        batcher.stop()
    return job


def test_a_request_longer_than_the_limit_is_refused_while_read(greedy):
    """Without a duration from the container (bytes here) the samples are counted as they are read: 413."""
    batcher = Batcher(greedy, batch_size=2)
    with pytest.raises(Refused, match=r"long\.flac: longer than this server's limit of 20 s") as info:
        batcher.prepare(LONG.read_bytes(), "long.flac", max_audio_s=20, reserved_s=None)
    assert info.value.status == 413
    job = run_alone(batcher, batcher.prepare(str(LONG), max_audio_s=65))  # 60 s fits, the second block (77.7 s) not
    assert job.status == 413 and "refused after reading" in job.error and job.ended


def test_silence_past_the_limit_is_refused_as_it_is_read_not_at_the_next_chunk(greedy, tmp_path):
    """3 s of speech, then 10 min of silence, in a file whose length is not known before reading: silence makes no
    chunk, and the limit was checked only as chunks came out, so the whole file was read (in the engine's thread,
    every other request waiting): "refused after reading 603 s" where the limit was 60 s."""
    speech, rate = sf.read(SHORT[0], dtype="float32")
    audio = np.concatenate([speech, np.zeros(600 * rate, np.float32)])
    encoded = io.BytesIO()
    sf.write(encoded, audio, rate, format="FLAC")
    batcher = Batcher(greedy, batch_size=2)
    job = run_alone(batcher, batcher.prepare(encoded.getvalue(), "quiet.flac", max_audio_s=60))
    assert job.status == 413 and "refused after reading 120 s" in job.error and job.input.audio_s <= 120


def test_a_cancelled_job_frees_its_reader_and_budget(greedy, expected):
    batcher = Batcher(greedy, batch_size=2)
    done = []
    batcher.admit(77.7)
    gone = batcher.prepare(str(LONG), reserved_s=77.7)
    kept = batcher.prepare(str(SHORT[0]))
    gone.on_done = kept.on_done = done.append
    batcher.submit(gone)
    batcher.submit(kept)
    assert batcher.queue_depth == 2 and batcher.in_flight == (1, 77.7)
    batcher.cancel(gone)
    assert batcher.queue_depth == 1 and batcher.in_flight == (0, 0.0)
    assert gone.ended and gone.requests.gi_frame is None  # its reader is closed: no block of it stays in memory
    batcher.start()
    try:
        wait_for([kept])
    finally:
        batcher.stop()
    assert done == [kept] and not gone.finished and not gone.results
    text = greedy.assemble("x", kept.spans, kept.ordered_results(), kept.audio_s, 0.0).text
    assert text == expected[SHORT[0].name].text


def test_the_budget_is_exactly_zero_once_every_request_ended(greedy):
    """Seconds reserved and given back float by float left 2.8e-17 s (1.1e-13 s on a server's gauge) in flight
    on an idle server."""
    batcher = Batcher(greedy, batch_size=2)
    for seconds in (0.1, 0.2, 0.3):
        batcher.admit(seconds)
    for seconds in (0.1, 0.2):
        batcher.release(seconds)
    assert batcher.in_flight[0] == 1 and batcher.in_flight[1] > 0
    batcher.release(0.3)
    assert batcher.in_flight == (0, 0.0)


def test_an_engine_error_fails_only_its_request_and_serving_goes_on(greedy, expected):
    batcher = Batcher(greedy, batch_size=2)
    broken = batcher.prepare(SHORT[1].read_bytes())
    # 7 frames instead of 3000: the encoder raises on this request's chunks
    broken.requests = iter([dataclasses.replace(r, features=torch.randn(80, 7)) for r in drain(broken)])
    batcher.start()
    try:
        batcher.submit(broken)
        wait_for([broken])
        good = batcher.prepare(SHORT[0].read_bytes())
        batcher.submit(good)
        wait_for([good])
        assert batcher.alive
    finally:
        batcher.stop()
    assert broken.error is not None and "decoding failed" in broken.error
    assert good.error is None
    assert greedy.assemble("x", good.spans, good.ordered_results(), 0, 0).text == expected[SHORT[0].name].text


def test_a_request_the_engine_refuses_fails_only_its_job(greedy, expected):
    """A chunk the model cannot take (a prompt over its limit) is refused by the engine alone (engine/refusals.py):
    its job failed with the cause, the job decoded beside it kept; before, the job waited for ever."""
    batcher = Batcher(greedy, batch_size=2)
    refused = batcher.prepare(SHORT[1].read_bytes())
    refused.requests = iter([dataclasses.replace(r, prompt=(5,) * 300) for r in drain(refused)])
    good = batcher.prepare(SHORT[0].read_bytes())
    batcher.start()
    try:
        batcher.submit(refused)
        batcher.submit(good)
        wait_for([refused, good])
        assert batcher.alive
    finally:
        batcher.stop()
    assert refused.status == 500 and "prompt of 300 tokens, more than the model's" in refused.error
    assert good.error is None
    assert greedy.assemble("x", good.spans, good.ordered_results(), 0, 0).text == expected[SHORT[0].name].text


# -- a real port and the official openai client ----------------------------------------------------------------

@contextmanager
def serving(app, **config):
    """The app on a free 127.0.0.1 port (uvicorn in a thread, as `asr-spec serve` runs it: `uvicorn_server`;
    `config`: more uvicorn.Config settings)."""
    with running(app, **config) as (server, url):
        yield url


@contextmanager
def running(app, **config):
    """`serving`, giving (the uvicorn server, the base URL): a test can shut the server down itself."""
    from asr_spec.serve import uvicorn_server

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn_server(app, host="127.0.0.1", port=port, log_level="warning", **config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        assert wait_until(lambda: server.started, interval_s=0.05), "uvicorn did not start"
        yield server, f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(30)


class PausedBatcher(Batcher):
    """A batcher whose engine never starts: what is queued stays queued."""

    def start(self) -> None:
        pass


def test_a_client_that_hangs_up_has_its_queued_chunks_dropped(greedy):
    batcher = PausedBatcher(greedy, batch_size=2)
    body, boundary = LONG.read_bytes(), "asrspecboundary"
    payload = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"long.flac\"\r\n"
               f"Content-Type: audio/flac\r\n\r\n").encode() + body + f"\r\n--{boundary}--\r\n".encode()
    head = (f"POST /v1/audio/transcriptions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(payload)}\r\n"
            f"Content-Type: multipart/form-data; boundary={boundary}\r\n\r\n").encode()
    with serving(create_app(batcher)) as base_url:
        port = int(base_url.rsplit(":", 1)[1].split("/")[0])
        with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
            conn.sendall(head + payload)
            # the long file's job is waiting
            assert wait_until(lambda: batcher.queue_depth == 1, TIMEOUT_S, 0.02), "the request was never queued"
        # the handler notices the hang-up
        assert wait_until(lambda: not batcher.queue_depth and batcher.in_flight == (0, 0.0), 30, 0.02), (
            "the job of a gone client stayed queued")
    assert 'outcome="disconnected"' in batcher.metrics.render()


def openai_client(base_url: str):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=base_url, api_key="dummy", timeout=TIMEOUT_S, max_retries=0)


def test_openai_client_on_a_real_port(greedy, expected):
    from concurrent.futures import ThreadPoolExecutor

    app = create_app(Batcher(greedy, batch_size=4), ServeOptions(model_id="tiny"))
    with serving(app) as base_url:
        client = openai_client(base_url)

        def ask(path: Path, fmt: str):
            with open(path, "rb") as audio:
                return client.audio.transcriptions.create(model="whisper-1", file=audio, response_format=fmt)

        with ThreadPoolExecutor(4) as pool:  # concurrent requests share the batch; each gets its own text
            asked = [(path, fmt, pool.submit(ask, path, fmt)) for fmt in FORMATS for path in FILES]
            for path, fmt, future in asked:
                check_format(fmt, future.result(timeout=TIMEOUT_S), expected[path.name])
        openai = pytest.importorskip("openai")
        with pytest.raises(openai.BadRequestError, match=r"must be a number in \[0, 1\]"):
            with open(SHORT[0], "rb") as audio:
                client.audio.transcriptions.create(model="whisper-1", file=audio, temperature=1.7)


def test_a_draft_changes_nothing(greedy):
    """The same requests, sent concurrently (so their chunks share rows), to a greedy and a speculative server:
    the same answers, and the speculative server really drafted (its /metrics count the drafted tokens)."""
    from concurrent.futures import ThreadPoolExecutor

    speculative = transcriber(speculative=True, timestamps=True)
    assert speculative.draft is not None
    asked = [(LONG, "verbose_json"), (SHORT[1], "json")] + [(SHORT[0], fmt) for fmt in FORMATS]
    answers, drafted, per_pass = {}, {}, {}
    for name, model in (("greedy", greedy), ("draft", speculative)):
        app = create_app(Batcher(model, batch_size=3), ServeOptions(model_id="tiny"))
        with TestClient(app) as client, ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(post, client, path, response_format=fmt) for path, fmt in asked]
            answers[name] = [future.result(timeout=TIMEOUT_S) for future in futures]
            metrics = client.get("/metrics").text
        drafted[name] = metric(metrics, "asr_spec_drafted_tokens_total")
        per_pass[name] = metric(metrics, "asr_spec_tokens_per_target_pass")
    assert all(r.status_code == 200 for r in answers["greedy"])
    assert [r.text for r in answers["draft"]] == [r.text for r in answers["greedy"]]
    assert drafted["greedy"] == 0 and drafted["draft"] > 0  # the draft ran: not a silent greedy fallback
    assert per_pass["greedy"] == 1.0 and per_pass["draft"] > 1.0


def metric(text: str, name: str) -> float:
    """The value of the unlabelled sample `name` in Prometheus text."""
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))


# -- the command line -----------------------------------------------------------------------------------------

def test_cli_refuses_bad_options_in_one_line_before_loading(capsys, tmp_path):
    from asr_spec.cli import main

    stride = tmp_path / "stride.toml"
    stride.write_text(f'model = "{tmp_path / "absent"}"\nchunking = "stride"\n')
    cases = [(["--no-draft", "--draft", "x"], "contradict"),
             (["--model", str(tmp_path / "absent"), "--batch-size", "0"], "batch_size must be an integer >= 1"),
             (["--model", str(tmp_path / "absent"), "--max-file-mb", "0"], "max_file_mb must be a positive"),
             (["--model", str(tmp_path / "absent"), "--max-audio-s", "-1"], "max_audio_s must be a positive"),
             # inf: every request a 500 (an OverflowError counting the limit in bytes or samples)
             (["--model", str(tmp_path / "absent"), "--max-file-mb", "inf"], "max_file_mb must be a positive"),
             (["--model", str(tmp_path / "absent"), "--max-audio-s", "inf"], "max_audio_s must be a positive"),
             (["--model", str(tmp_path / "absent"), "--max-requests", "0"], "max_requests must be an integer"),
             (["--model", str(tmp_path / "absent"), "--api-key", " "], "api_key must not be empty"),
             (["--model", str(tmp_path)], "not a Whisper model directory"),
             (["--preset", str(stride), "--word-timestamps"], "word_timestamps need chunking 'vad'")]
    for args, needle in cases:
        with pytest.raises(SystemExit) as info:
            main(["serve", *args])
        err = capsys.readouterr().err
        assert info.value.code == 2 and needle in err and len(err.strip().splitlines()) == 1, err


def test_build_app_loads_a_model_directory(tmp_path, expected, caplog):
    from test_transcribe import save_tiny_models

    from asr_spec.serve import build_app

    target_dir, _ = save_tiny_models(tmp_path)
    with caplog.at_level("INFO", logger="asr_spec.serve"):
        app = build_app("base", model=str(target_dir), language="en", batch_size=2, chunk_length_s=30.0,
                        word_timestamps=True)  # what `asr-spec serve --word-timestamps` passes (base chunks by vad)
    # two notices at start: the model and what it runs on (the CPU class conftest pins; unpinned, this CPU's), then
    # the engine warmed up for its rows (`serve.warm_up`), whose state it now holds
    notes = [r.getMessage() for r in caplog.records if getattr(r, "notice", False)]
    assert len(notes) == 2 and notes[0] == f"serving {target_dir}: {auto_precision_words()}", notes
    assert "attention: " in notes[0]
    assert notes[1].startswith("engine ready: 2 rows, ") and " MB of state, warmed up in " in notes[1], notes
    with TestClient(app) as client:
        assert client.get("/v1/models").json()["data"][0]["id"] == str(target_dir)
        response = post(client, SHORT[0], model=str(target_dir))
        worded = post(client, SHORT[0], model=str(target_dir), response_format="verbose_json",
                      **{"timestamp_granularities[]": "word"})
    assert response.status_code == 200 and isinstance(response.json()["text"], str)
    assert worded.status_code == 200 and worded.json()["text"] == response.json()["text"]
    words = worded.json()["words"]
    assert words and all(w["start"] <= w["end"] for w in words)
