"""`asr-spec serve`: an OpenAI-compatible transcription server whose concurrent requests share one speculative
batch (app.py: routes and formats; batcher.py: the engine thread and its queue; metrics.py: Prometheus text).

FastAPI, uvicorn and python-multipart come with the `asr-spec[serve]` extra; they are imported only here.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["build_app", "run_server"]


def build_app(preset: str | os.PathLike = "base", *, batch_size: int = 8, max_queue: int = 256,
              max_file_mb: float = 25.0, **overrides: Any) -> Any:
    """Load the models (`Transcriber.from_preset(preset, batch_size=batch_size, **overrides)`) and return the
    FastAPI app serving them, batch_size engine rows shared by all requests. The model id it answers to is the
    preset's name, or the model given in `overrides`."""
    from asr_spec.serve.app import ServeOptions, create_app
    from asr_spec.serve.batcher import Batcher, check_queue
    from asr_spec.transcribe import Transcriber

    check_queue(max_queue)  # bad sizes fail before the models load (batch_size: in from_preset, before loading)
    options = ServeOptions(model_id=str(overrides.get("model") or preset), max_file_mb=max_file_mb)
    transcriber = Transcriber.from_preset(preset, batch_size=batch_size, **overrides)
    return create_app(Batcher(transcriber, max_queue=max_queue), options)


def run_server(preset: str | os.PathLike = "base", *, host: str = "127.0.0.1", port: int = 8000,
               batch_size: int = 8, max_queue: int = 256, max_file_mb: float = 25.0, **overrides: Any) -> None:
    """Serve until interrupted (what `asr-spec serve` calls)."""
    import uvicorn

    app = build_app(preset, batch_size=batch_size, max_queue=max_queue, max_file_mb=max_file_mb, **overrides)
    uvicorn.run(app, host=host, port=port, log_level="info")
