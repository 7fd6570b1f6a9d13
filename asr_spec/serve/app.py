"""The OpenAI-compatible HTTP layer: routes, request checks, response formats.

    POST /v1/audio/transcriptions   multipart: file, model, language, prompt, response_format, temperature,
                                    timestamp_granularities[], hotwords, prefix
                                    -> json | text | srt | vtt | verbose_json
                                    (word: verbose_json gains `words`; needs `serve --word-timestamps`)
    GET  /v1/models                 the one model served
    GET  /health                    200 while the engine thread runs (open without a key)
    GET  /metrics                   Prometheus text (asr_spec.serve.metrics)
    WS   /v1/realtime               live transcription, vLLM's realtime protocol (realtime.py)
    GET  /                          the live transcription page (static/: microphone or file, over /v1/realtime)

A request's body is read within a byte limit and a time limit and its file spooled to disk (uploads.py); its
duration is read from the container before decoding and refused past `max_audio_s` (413); it is admitted into the
server's budget (`Batcher.admit`, else 503 with Retry-After); then its first chunk is read in a worker thread
(`Batcher.prepare`: a file that is not audio is a 400 now) and the job joins the engine's rotation, which reads
the rest one chunk at a time. The handler awaits the job without blocking the event loop, checking meanwhile
whether the client went away (then its job ends and its memory is freed). Errors use OpenAI's shape,
{"error": {"message", "type", "param", "code"}}, with the statuses the schema lists (schema.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from asr_spec.audio.loading import header_duration_s
from asr_spec.checks import int_at_least, non_empty_str, positive
from asr_spec.errors import AudioError, InputError, one_line
from asr_spec.serve import openmp, uploads
from asr_spec.serve.auth import ApiKeyMiddleware
from asr_spec.serve.batcher import Batcher, Busy, Job, Refused
from asr_spec.serve.params import MAX_PROMPT_CHARS, MODEL_ALIASES, Params, check_params
from asr_spec.serve.realtime import RealtimeOptions, add_realtime_routes
from asr_spec.serve.responses import RESPONSE_FORMATS, HTTPError, render
from asr_spec.serve.schema import models_responses, transcription_openapi, transcription_responses

__all__ = ["RESPONSE_FORMATS", "HTTPError", "ServeOptions", "create_app"]

log = logging.getLogger(__name__)
DISCONNECT_POLL_S = 0.25  # how often a waiting handler checks whether its client is still there
# form fields and boundaries allowed on top of the file itself: the three text fields at their limit of characters
# (up to 4 bytes each in UTF-8) and 64 KiB for the rest (a request with 10,000-character prompt and hotwords beside
# a file just under the limit was a 413 that blamed the file)
MULTIPART_OVERHEAD_BYTES = 3 * 4 * MAX_PROMPT_CHARS + 64 * 1024


@dataclass(frozen=True)
class ServeOptions:
    """How the server takes requests (the decoding options are the transcriber's; what is admitted at once, the
    batcher's)."""

    model_id: str = "asr-spec"  # the id /v1/models lists and `model` may name
    max_file_mb: float = 25.0  # largest upload accepted, in MB (10**6 bytes); OpenAI's own limit is 25 MB
    max_audio_s: float = 7200.0  # longest audio accepted, in seconds (2 h): a byte limit does not bound audio
    upload_timeout_s: float = 120.0  # the whole body must have arrived by then (a trickling upload: 408)
    api_keys: tuple[str, ...] = ()  # with keys, every route but /health needs `Authorization: Bearer <key>`
    retry_after_s: int = 1  # Retry-After of a 503 (busy), in whole seconds (HTTP's delay-seconds: an integer >= 0)

    def __post_init__(self) -> None:
        non_empty_str(self.model_id, "model_id")  # what /v1/models lists and a request's `model` is compared with
        for name in ("max_file_mb", "max_audio_s"):  # limits counted in bytes and samples (inf: a 500 each request)
            positive(getattr(self, name), name, "MB" if name == "max_file_mb" else "seconds")
        positive(self.upload_timeout_s, "upload_timeout_s", "seconds", finite_only=False)
        # the header's value is str(retry_after_s): -5 or 1.5 would be no delay-seconds a client can read
        int_at_least(self.retry_after_s, "retry_after_s", 0)
        self._verify_keys()

    def _verify_keys(self) -> None:
        """api_keys: a tuple of keys, each one a request can send (the messages name no key: they reach logs)."""
        # a str iterates as its characters: api_keys="secret" let in any request whose key was "s"
        if not isinstance(self.api_keys, tuple):
            raise InputError(f"api_keys must be a tuple of strings, got a {type(self.api_keys).__name__}")
        for key in self.api_keys:
            if not isinstance(key, str):
                raise InputError(f"api_keys must be a tuple of strings, got a key of type {type(key).__name__}")
            if not key.strip():  # "Bearer " would match it
                raise InputError("api_keys must not hold an empty key")
            if key != key.strip():  # a bearer token is read stripped: no request could send it
                raise InputError("api_keys must not hold a key with spaces around it (no request could match it)")

    @property
    def max_file_bytes(self) -> int:
        return int(self.max_file_mb * 1_000_000)


OUTCOMES = {400: "bad_request", 408: "timeout", 413: "too_large", 503: "busy"}


def create_app(batcher: Batcher, options: ServeOptions = ServeOptions(),
               realtime: RealtimeOptions | None = None) -> FastAPI:
    """The FastAPI app over `batcher` (started and stopped with the app's lifespan); realtime: how
    /v1/realtime takes audio (default: RealtimeOptions with the served model id)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):  # noqa: ANN202
        await asyncio.to_thread(capture_ahead, batcher)
        openmp.release_pool()  # the pool this thread made loading the models: no second team beside the engine's
        batcher.start()
        try:
            yield
        finally:
            await asyncio.to_thread(batcher.stop)

    app = FastAPI(title="asr-spec", lifespan=lifespan)
    metrics = batcher.metrics
    keys = bool(options.api_keys)
    _add_audio_routes(app, batcher, options)

    @app.get("/v1/models", responses=models_responses(keys))
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": options.model_id, "object": "model", "created": 0,
                                            "owned_by": "asr-spec"}]}

    health_503 = {503: {"description": "The engine thread has stopped.",
                        "content": {"application/json": {"schema": {"type": "object"}}}}}

    @app.get("/health", responses=health_503)
    async def health() -> Response:
        alive = batcher.alive
        body = {"status": "ok" if alive else "engine stopped", "queue_depth": batcher.queue_depth}
        return JSONResponse(body, status_code=200 if alive else 503)

    @app.get("/metrics", response_class=PlainTextResponse, responses=models_responses(keys))
    async def prometheus() -> Response:
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    add_realtime_routes(app, batcher, RealtimeOptions(model_id=options.model_id) if realtime is None else realtime)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> Response:  # 404, 405: OpenAI's shape
        return HTTPError(err.status_code, str(err.detail), headers=dict(err.headers or {})).response()

    if keys:
        app.add_middleware(ApiKeyMiddleware, keys=options.api_keys)
        _document_bearer(app)
    return app


def capture_ahead(batcher: Batcher) -> int:
    """Capture the engine's step graphs for the server's rows before its first request, so that no request waits
    for a capture (`Engine.capture_ahead`: CUDA graphs only; an eager engine has nothing to capture, 0). Returns
    the steps run."""
    n_steps = batcher.transcriber.engine.capture_ahead(batcher.batch_size)
    if n_steps:
        log.info("captured the step graphs of %d rows ahead of the first request (%d steps)", batcher.batch_size,
                 n_steps)
    return n_steps


def _document_bearer(app: FastAPI) -> None:
    """Declare the bearer key in the schema, on every route but /health."""
    plain_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = plain_openapi()
            schema.setdefault("components", {})["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
            for path, operations in schema["paths"].items():
                if path != "/health":
                    for operation in operations.values():
                        operation["security"] = [{"bearer": []}]
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


async def _answer(request: Request, batcher: Batcher, options: ServeOptions, task: str) -> Response:
    """The answer to one transcription or translation request (`task`: the route's), counted in the metrics by
    outcome."""
    metrics = batcher.metrics
    started = time.perf_counter()
    try:
        _check_task(task, batcher.transcriber.options.decode.task)
        response, audio_s = await _transcribe(request, batcher, options)
    except HTTPError as err:
        metrics.request_done(OUTCOMES.get(err.status, "failed"))
        return err.response()
    except StarletteHTTPException as err:  # starlette's own answer to a malformed body (400)
        metrics.request_done(OUTCOMES.get(err.status_code, "failed"))
        return HTTPError(err.status_code, f"{err.detail}", headers=dict(err.headers or {})).response()
    except Exception as err:  # the server's bug, not the request's: a 500 in OpenAI's shape, logged
        log.exception("transcription request")
        metrics.request_done("failed")
        return HTTPError(500, f"internal error ({type(err).__name__}: {one_line(err)})").response()
    if response.status_code == 200:
        metrics.request_done("ok", time.perf_counter() - started, audio_s)
    else:
        metrics.request_done("disconnected")
    return response


def _add_audio_routes(app: FastAPI, batcher: Batcher, options: ServeOptions) -> None:
    """POST /v1/audio/transcriptions and /v1/audio/translations; the schema lists the served task's only (the
    other answers 400 naming it, `_check_task`)."""
    keys = bool(options.api_keys)
    decode = batcher.transcriber.options
    body = transcription_openapi((options.model_id, *MODEL_ALIASES), RESPONSE_FORMATS, decode.decode.language,
                                 decode.word_timestamps)
    served = decode.decode.task

    @app.post("/v1/audio/transcriptions", responses=transcription_responses(keys), openapi_extra=body,
              include_in_schema=served == "transcribe")
    async def transcriptions(request: Request) -> Response:
        return await _answer(request, batcher, options, "transcribe")

    @app.post("/v1/audio/translations", responses=transcription_responses(keys), openapi_extra=body,
              include_in_schema=served == "translate")
    async def translations(request: Request) -> Response:
        return await _answer(request, batcher, options, "translate")


def _check_task(asked: str, served: str) -> None:
    """A route's task is the server's, which is its engine's (`asr-spec serve --task`: one task a server, as its
    decoder's prompt is one for every row): a 400 naming the route that serves it, before the upload is read."""
    if asked == served:
        return
    if served == "translate":
        raise HTTPError(400, "this server translates into English (started with --task translate): POST "
                        "/v1/audio/translations, or start a server without --task translate to transcribe")
    raise HTTPError(400, "this server transcribes: POST /v1/audio/transcriptions, or start a server with --task "
                    "translate to translate into English")


async def _transcribe(request: Request, batcher: Batcher, options: ServeOptions) -> tuple[Response, float]:
    """Receive, check, admit, prepare, queue and await one request; its response and seconds of audio."""
    length = request.headers.get("content-length", "")
    max_bytes = options.max_file_bytes + MULTIPART_OVERHEAD_BYTES
    if length.isdigit() and int(length) > max_bytes:
        raise _too_large(int(length), options, "the request body")
    try:
        form = await uploads.read_form(uploads.limited_request(request, max_bytes, options.upload_timeout_s))
    except uploads.UploadTooLarge as err:
        raise _too_large(err.n_bytes, options, "the request body") from err
    except uploads.UploadTimeout as err:
        raise HTTPError(408, f"file: the upload did not arrive within {options.upload_timeout_s:g} s "
                        "(--upload-timeout-s)", "file", {"Connection": "close"}) from err
    except uploads.ClientDisconnect:
        return Response(status_code=499), 0.0
    try:
        params = check_params(form, batcher.transcriber.options, options.model_id)
        if params.upload.size is not None and params.upload.size > options.max_file_bytes:
            raise _too_large(params.upload.size, options)
        path = await asyncio.to_thread(uploads.spool, params.upload)
    finally:
        await form.close()
    try:
        return await _decode(request, batcher, options, params, path)
    finally:
        uploads.remove(path)


async def _decode(request: Request, batcher: Batcher, options: ServeOptions, params: Params,
                  path: str) -> tuple[Response, float]:
    name = params.upload.filename or "file"
    try:
        duration_s = await asyncio.to_thread(header_duration_s, path)
    except AudioError as err:
        raise HTTPError(400, f"{name}: {one_line(err, path).replace(path, 'the upload')}", "file") from err
    if duration_s is not None and duration_s > options.max_audio_s:  # refused before any decoding
        raise HTTPError(413, f"{name}: {duration_s:.0f} s of audio (the container says) is over this server's "
                        f"limit of {options.max_audio_s:g} s (--max-audio-s)", "file")
    reserved_s = options.max_audio_s if duration_s is None else duration_s  # unknown: the most it may be
    try:
        batcher.admit(reserved_s)
    except Busy as err:
        raise HTTPError(503, f"server busy: {err}; retry later",
                        headers={"Retry-After": str(options.retry_after_s)}) from err
    try:
        job = await asyncio.to_thread(batcher.prepare, path, name, words=params.words,
                                      max_audio_s=options.max_audio_s, reserved_s=reserved_s,
                                      temperature=params.temperature, prompts=params.prompts)
    except Refused as err:
        raise HTTPError(err.status, one_line(err), "file") from err
    done = _completion(job)
    batcher.submit(job)
    while not done.done():
        await asyncio.wait({done}, timeout=DISCONNECT_POLL_S)
        if not done.done() and await request.is_disconnected():
            batcher.cancel(job)
            return Response(status_code=499), job.audio_s  # nginx's "client closed request": nobody reads it
    if job.error is not None:
        raise HTTPError(job.status, f"{name}: {job.error}", "file" if job.status < 500 else None)
    wall_s = time.perf_counter() - job.started
    transcriber = batcher.transcriber
    spans, results, words, continues = job.in_order()  # its chunks with their re-decoded tails
    result = await asyncio.to_thread(transcriber.assemble, name, spans, results, job.audio_s, wall_s, words,
                                     continues)
    return render(result, params.response_format, transcriber.options.decode.task, params.words,
                  transcriber.options.cues), job.audio_s


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


def _too_large(n_bytes: int, options: ServeOptions, what: str = "the file") -> HTTPError:
    """413 for `what` ("the file", or "the request body": the file and its form fields) of `n_bytes`."""
    return HTTPError(413, f"file: {what} of {n_bytes / 1e6:.1f} MB is over this server's limit of "
                     f"{options.max_file_mb:g} MB (--max-file-mb)", "file")
