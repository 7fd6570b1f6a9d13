"""The OpenAI-compatible HTTP layer: routes, request checks, response formats.

    POST /v1/audio/transcriptions   multipart: file, model, language, prompt, response_format, temperature,
                                    timestamp_granularities[]   -> json | text | srt | vtt | verbose_json
                                    (word: verbose_json gains `words`; needs `serve --word-timestamps`)
    GET  /v1/models                 the one model served
    GET  /health                    200 while the engine thread runs
    GET  /metrics                   Prometheus text (asr_spec.serve.metrics)

A request's audio is decoded, chunked and featurised in a worker thread (`Batcher.prepare`: the transcriber's own
front half); its chunks join the one engine queue (`Batcher`) and the handler awaits the job without blocking the
event loop, checking meanwhile whether the client went away (then its queued chunks are dropped). Errors use
OpenAI's shape, {"error": {"message", "type", "param", "code"}}: 400 bad request (not audio, bad option), 413 upload
too large, 503 queue full (with Retry-After), 500 the engine failed on this request's chunks.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from asr_spec.errors import AudioError, InputError, one_line
from asr_spec.serve.batcher import Batcher, Job, QueueFull
from asr_spec.transcribe.outputs import render_srt, render_vtt

__all__ = ["RESPONSE_FORMATS", "ServeOptions", "create_app"]

RESPONSE_FORMATS = ("json", "text", "srt", "vtt", "verbose_json")
MODEL_ALIASES = ("whisper-1",)  # what OpenAI's examples send; served by the one model here
DISCONNECT_POLL_S = 0.25  # how often a waiting handler checks whether its client is still there
MULTIPART_OVERHEAD_BYTES = 64 * 1024  # form fields and boundaries allowed on top of the file itself


@dataclass(frozen=True)
class ServeOptions:
    """How the server takes requests (the decoding options are the transcriber's)."""

    model_id: str = "asr-spec"  # the id /v1/models lists and `model` may name
    max_file_mb: float = 25.0  # largest upload accepted, in MB (10**6 bytes); OpenAI's own limit is 25 MB
    retry_after_s: int = 1  # Retry-After of a 503 (queue full)

    def __post_init__(self) -> None:
        if isinstance(self.max_file_mb, bool) or not isinstance(self.max_file_mb, (int, float)) or self.max_file_mb <= 0:
            raise InputError(f"max_file_mb must be a positive number of MB, got {self.max_file_mb!r}")
        if not self.model_id:
            raise InputError("model_id must not be empty")

    @property
    def max_file_bytes(self) -> int:
        return int(self.max_file_mb * 1_000_000)


class HTTPError(Exception):
    """An answer other than 200, in OpenAI's error shape."""

    def __init__(self, status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        body = {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.status}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


@dataclass(frozen=True)
class _Params:
    """The form fields of one transcription request, checked."""

    upload: Any
    response_format: str
    words: bool  # timestamp_granularities[] holds "word"


def create_app(batcher: Batcher, options: ServeOptions = ServeOptions()) -> FastAPI:
    """The FastAPI app over `batcher` (started and stopped with the app's lifespan)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):  # noqa: ANN202
        batcher.start()
        try:
            yield
        finally:
            await asyncio.to_thread(batcher.stop)

    app = FastAPI(title="asr-spec", lifespan=lifespan)
    metrics = batcher.metrics

    @app.post("/v1/audio/transcriptions")
    async def transcriptions(request: Request) -> Response:
        started = time.perf_counter()
        try:
            response, audio_s = await _transcribe(request, batcher, options)
        except HTTPError as err:
            metrics.request_done({400: "bad_request", 413: "too_large", 503: "queue_full"}.get(err.status, "failed"))
            return err.response()
        if response.status_code == 200:
            metrics.request_done("ok", time.perf_counter() - started, audio_s)
        else:
            metrics.request_done("disconnected")
        return response

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": options.model_id, "object": "model", "created": 0,
                                            "owned_by": "asr-spec"}]}

    @app.get("/health")
    async def health() -> Response:
        alive = batcher.alive
        body = {"status": "ok" if alive else "engine stopped", "queue_depth": batcher.queue_depth}
        return JSONResponse(body, status_code=200 if alive else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    return app


async def _transcribe(request: Request, batcher: Batcher, options: ServeOptions) -> tuple[Response, float]:
    """Check, prepare, queue and await one request; its response and seconds of audio."""
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > options.max_file_bytes + MULTIPART_OVERHEAD_BYTES:
        raise _too_large(int(length), options)
    params = _check_params(await request.form(), batcher, options)
    if params.upload.size is not None and params.upload.size > options.max_file_bytes:
        raise _too_large(params.upload.size, options)
    if batcher.queue_depth >= batcher.max_queue:  # refuse before decoding the upload
        raise _queue_full(batcher, options)
    data = await params.upload.read()
    name = params.upload.filename or "file"
    try:
        job = await asyncio.to_thread(batcher.prepare, data, name, words=params.words)
    except AudioError as err:
        raise HTTPError(400, one_line(err), "file") from err
    done = _completion(job)
    try:
        batcher.submit(job)
    except QueueFull as err:
        raise _queue_full(batcher, options) from err
    while not done.done():
        await asyncio.wait({done}, timeout=DISCONNECT_POLL_S)
        if not done.done() and await request.is_disconnected():
            batcher.cancel(job)
            return Response(status_code=499), job.audio_s  # nginx's "client closed request": nobody reads it
    if job.error is not None:
        raise HTTPError(500, f"{name}: {job.error}")
    wall_s = time.perf_counter() - job.started
    transcriber = batcher.transcriber
    result = await asyncio.to_thread(transcriber.assemble, name, job.spans, job.ordered_results(), job.audio_s,
                                     wall_s, job.ordered_words())
    return _render(result, params.response_format, transcriber.options.decode.task, params.words), job.audio_s


def _completion(job: Job) -> asyncio.Future:
    """A future of the running event loop, set when `job` is done (its `on_done` runs in the engine thread)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()

    def settle() -> None:  # in the loop's thread
        if not done.done():
            done.set_result(job)

    def on_done(_: Job) -> None:  # in the engine thread
        loop.call_soon_threadsafe(settle)

    job.on_done = on_done
    return done


def _check_params(form: Any, batcher: Batcher, options: ServeOptions) -> _Params:
    upload = form.get("file")
    if upload is None or isinstance(upload, str):
        raise HTTPError(400, "file: missing (send the audio as a multipart file field named 'file')", "file")
    model = form.get("model")
    if model and model not in (options.model_id, *MODEL_ALIASES):
        served = ", ".join((options.model_id, *MODEL_ALIASES))
        raise HTTPError(400, f"model {model!r} is not served here (serving: {served})", "model")
    response_format = form.get("response_format") or "json"
    if response_format not in RESPONSE_FORMATS:
        raise HTTPError(400, f"response_format {response_format!r} is not one of {', '.join(RESPONSE_FORMATS)}",
                        "response_format")
    _check_temperature(form.get("temperature"))
    _check_language(form.get("language"), batcher.transcriber.options.decode.language)
    words = _wants_words(form, response_format, batcher.transcriber.options.word_timestamps)
    return _Params(upload, response_format, words)  # `prompt` is accepted and ignored (see the docs)


def _wants_words(form: Any, response_format: str, words_on: bool) -> bool:
    """Whether timestamp_granularities[] asks for words (OpenAI: only with verbose_json); 400 when this server
    cannot give them (started without --word-timestamps) or for a granularity other than segment and word."""
    granularities = form.getlist("timestamp_granularities[]") + form.getlist("timestamp_granularities")
    for granularity in granularities:
        if granularity not in ("segment", "word"):
            raise HTTPError(400, f"timestamp_granularities: {granularity!r} is not segment or word",
                            "timestamp_granularities")
    if "word" not in granularities:
        return False
    if not words_on:
        raise HTTPError(400, "timestamp_granularities: word timestamps are off on this server (start it with "
                        "`asr-spec serve --word-timestamps`, which needs chunking 'vad')", "timestamp_granularities")
    if response_format != "verbose_json":
        raise HTTPError(400, f"timestamp_granularities: word needs response_format verbose_json, got "
                        f"{response_format!r}", "timestamp_granularities")
    return True


def _check_temperature(value: Any) -> None:
    if value in (None, ""):
        return
    try:
        temperature = float(value)
    except ValueError:
        temperature = None
    if temperature != 0.0:
        raise HTTPError(400, f"temperature {value!r}: only 0 is supported (greedy/lossless only: the transcript "
                        "is the model's own greedy decoding)", "temperature")


def _check_language(value: Any, served: str | None) -> None:
    """A request may name the language the server decodes (e.g. "en"), nothing else: one batch, one language."""
    if not value:
        return
    if served is None or _language_code(value) != _language_code(served):
        mode = "detects the language per chunk" if served is None else f"decodes {served!r}"
        raise HTTPError(400, f"language {value!r}: this server {mode} (set with `asr-spec serve --language`); "
                        "a per-request language is not supported", "language")


def _language_code(value: str) -> str:
    from transformers.models.whisper.tokenization_whisper import TO_LANGUAGE_CODE

    code = value.strip().strip("<|>").lower()
    return TO_LANGUAGE_CODE.get(code, code)


def _render(result: Any, response_format: str, task: str, words: bool = False) -> Response:
    if response_format == "json":
        return JSONResponse({"text": result.text})
    if response_format == "text":
        return PlainTextResponse(result.text + "\n")
    if response_format == "srt":
        return PlainTextResponse(render_srt(result))
    if response_format == "vtt":
        return PlainTextResponse(render_vtt(result), media_type="text/vtt")
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    segments = [{"id": i, "start": s.start_s, "end": s.end_s, "text": s.text} for i, s in enumerate(result.segments)]
    body = {"task": task, "language": LANGUAGES.get(result.language or "", result.language or ""),
            "duration": result.audio_s, "text": result.text, "segments": segments}
    if words:  # OpenAI's shape: the words of the whole file, text without the leading space
        body["words"] = [{"word": w.word.strip(), "start": w.start, "end": w.end}
                         for s in result.segments for w in s.words]
    return JSONResponse(body)


def _too_large(n_bytes: int, options: ServeOptions) -> HTTPError:
    return HTTPError(413, f"file: {n_bytes / 1e6:.1f} MB is over this server's limit of {options.max_file_mb:g} MB "
                     "(--max-file-mb)", "file")


def _queue_full(batcher: Batcher, options: ServeOptions) -> HTTPError:
    return HTTPError(503, f"server busy: {batcher.queue_depth} chunks are waiting (--max-queue {batcher.max_queue});"
                     " retry later", headers={"Retry-After": str(options.retry_after_s)})
