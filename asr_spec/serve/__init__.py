"""`asr-spec serve`: an OpenAI-compatible transcription server whose concurrent requests share one speculative
batch (app.py: routes; params.py: the form fields; responses.py: formats and errors; uploads.py: receiving an
upload within limits; auth.py: API keys; schema.py: the OpenAPI description; batcher.py: the engine thread and
the jobs feeding it; metrics.py: Prometheus text), and live streams over WebSocket /v1/realtime, whose re-decodes
share that batch (realtime.py: the session; realtime_events.py: the events; stream_jobs.py: the many-streams
runner under the batcher's lock; static/: the page at /).

FastAPI, uvicorn and python-multipart come with the `asr-spec[serve]` extra; they are imported only here.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

__all__ = ["DRAIN_S", "build_app", "run_server", "uvicorn_server", "warm_up"]

# the longest a shutdown waits for the live streams to finish their inputs (`uvicorn_server`): a close decode or
# two of a 24 s buffer, behind whatever the engine holds
DRAIN_S = 15.0


def build_app(preset: str | os.PathLike = "base", *, batch_size: int = 8, max_requests: int = 32,
              max_streams: int = 16, max_audio_in_flight_s: float = 12 * 3600.0, max_file_mb: float = 25.0,
              max_audio_s: float = 7200.0, upload_timeout_s: float = 120.0, api_keys: Sequence[str] = (),
              max_backlog_s: float | None = None, catch_up: bool | None = None, step_s: float | None = None,
              hypothesis: bool | None = None, committed_prefix: bool | None = None, context_s: float | None = None,
              group_wait_s: float | None = None, idle_timeout_s: float | None = None, **overrides: Any) -> Any:
    """Load the models (`Transcriber.from_preset(preset, batch_size=batch_size, **overrides)`) and return the
    FastAPI app serving them, batch_size engine rows shared by all requests; a notice names the model and what it
    runs on (`models.cpu.precision_line`). The model id it answers to is the
    preset's name, or the model given in `overrides`. api_keys: with ASR_SPEC_API_KEY's, the keys every route but
    /health (and the page at /) requires (none: open). max_streams: live streams (/v1/realtime) open at once;
    max_backlog_s, catch_up, hypothesis, idle_timeout_s: `RealtimeOptions`' (None: its default); step_s,
    committed_prefix, context_s: the live streams' `StreamOptions` (None: the default); group_wait_s: the
    batcher's (None: `GROUP_WAIT_S`)."""
    from asr_spec.checks import int_at_least, seconds_at_least_zero
    from asr_spec.logs import NOTICE
    from asr_spec.models.cpu import precision_line, run_of
    from asr_spec.serve.app import ServeOptions, create_app
    from asr_spec.serve.auth import api_keys as all_keys
    from asr_spec.serve.batcher import Batcher, check_limits
    from asr_spec.serve.realtime import RealtimeOptions
    from asr_spec.stream.decodes import GROUP_WAIT_S
    from asr_spec.stream.policy import StreamOptions
    from asr_spec.transcribe import Transcriber

    # bad values fail before the models load (batch_size: in from_preset, before loading)
    check_limits(max_requests, max_audio_in_flight_s)
    int_at_least(max_streams, "max_streams", 1)
    group_wait_s = GROUP_WAIT_S if group_wait_s is None else seconds_at_least_zero(group_wait_s, "group_wait_s")
    options = ServeOptions(model_id=str(overrides.get("model") or preset), max_file_mb=max_file_mb,
                           max_audio_s=max_audio_s, upload_timeout_s=upload_timeout_s, api_keys=all_keys(api_keys))
    given_stream = {"step_s": step_s, "committed_prefix": committed_prefix, "context_s": context_s}
    stream = StreamOptions(**{k: v for k, v in given_stream.items() if v is not None})
    given = {"max_backlog_s": max_backlog_s, "catch_up": catch_up, "hypothesis": hypothesis, "stream": stream,
             "idle_timeout_s": idle_timeout_s}
    realtime = RealtimeOptions(model_id=options.model_id, **{k: v for k, v in given.items() if v is not None})
    transcriber = Transcriber.from_preset(preset, batch_size=batch_size, **overrides)
    # what it runs on, once at start (the CLI's summary line says it per run; a server has none)
    logging.getLogger(__name__).info("serving %s: %s", options.model_id, precision_line(*run_of(transcriber)),
                                     extra=NOTICE)
    batcher = Batcher(transcriber, max_requests=max_requests, max_audio_in_flight_s=max_audio_in_flight_s,
                      max_streams=max_streams, group_wait_s=group_wait_s)
    warm_up(transcriber, batcher.batch_size)
    return create_app(batcher, options, realtime)


def warm_up(transcriber: Any, rows: int) -> None:
    """The engine run once before the first request (`Engine.warm_up`): the server holds its `rows` rows' memory
    from its start, as servers hold their caches (or fails there, saying what fits, where a request would
    otherwise fail later), so its memory does not grow with the streams and requests it takes. Measured (whisper-base,
    bf16, 2 cores of an AVX-512-BF16 EPYC, 8 rows): RSS after start 1,109-1,116 MiB against 823-827, start-up
    0.5-0.7 s longer, the first request as fast either way. Logs what it took."""
    import time

    from asr_spec.logs import NOTICE

    started = time.perf_counter()
    transcriber.engine.warm_up(rows)
    held = transcriber.engine.states.held
    logging.getLogger(__name__).info("engine ready: %d rows, %.0f MB of state, warmed up in %.1f s", rows,
                                     (held.nbytes() if held is not None else 0) / 1e6, time.perf_counter() - started,
                                     extra=NOTICE)


def run_server(preset: str | os.PathLike = "base", *, host: str = "127.0.0.1", port: int = 8000,
               **settings: Any) -> None:
    """Serve until interrupted (what `asr-spec serve` calls); `settings`: `build_app`'s. Warns when listening
    beyond this machine without an API key. Pins glibc's malloc for a long-running server first
    (`allocator.pin`: the engine's transient buffers kept in the heap and reused, not mapped every call)."""
    import uvicorn  # noqa: F401  (the serve extra is there: said before the models load)

    from asr_spec import allocator
    from asr_spec.serve.auth import api_keys, warn_if_exposed

    warn_if_exposed(host, api_keys(settings.get("api_keys")))
    allocator.pin()
    app = build_app(preset, **settings)
    uvicorn_server(app, host=host, port=port, log_level="info").run()


def uvicorn_server(app: Any, **config: Any) -> Any:
    """uvicorn's server for `app` (`config`: `uvicorn.Config`'s settings) whose shutdown (Ctrl-C, SIGTERM) first
    stops taking connections and lets the live streams finish (`realtime.drain_sessions`, at most DRAIN_S): each
    gets its transcription.done, then a close (1012); then uvicorn's own shutdown (uploads in flight finish)."""
    import uvicorn

    from asr_spec.serve.realtime import drain_sessions

    class Server(uvicorn.Server):
        async def shutdown(self, sockets: Any = None) -> None:
            for server in self.servers:
                server.close()  # no new connection while the streams finish
            await drain_sessions(app, DRAIN_S)
            await super().shutdown(sockets)

    return Server(uvicorn.Config(app, **config))
