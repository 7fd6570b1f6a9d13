"""Logging set-up of the command-line entry points, in one place: warnings as one stderr line each
(``warning: ...``), notices too (``note: ...``: an INFO record logged with ``extra=NOTICE``, for what a user waits on
once though nothing is wrong, such as the CPU kernels' first build), no transformers chatter or progress bars; and
the live streams' trace (`trace_streams`: one line per re-decode result the streaming policy takes, to a file). The
library itself never configures logging."""

from __future__ import annotations

import logging
import os
import sys
import warnings
from typing import Any

__all__ = ["NOTICE", "configure_logging", "trace_streams"]
STREAM_TRACE_LOGGER = "asr_spec.stream.policy"  # its DEBUG lines: `StreamPolicy.accept`


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is when a message comes (the CLI may be run in-process under redirection)."""

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


# `extra=NOTICE` on an INFO record: the command-line entry points show it (``note: ...``)
_NOTICE_KEY = "notice"  # the record attribute that marks a notice
NOTICE = {_NOTICE_KEY: True}


def _shown(record: logging.LogRecord) -> bool:
    """What the entry points print: warnings and errors, and notices."""
    return record.levelno >= logging.WARNING or bool(getattr(record, _NOTICE_KEY, False))


class _Prefixed(logging.Formatter):
    """``warning: MESSAGE`` (a warning or an error), ``note: MESSAGE`` (a notice)."""

    def format(self, record: logging.LogRecord) -> str:
        return ("warning: " if record.levelno >= logging.WARNING else "note: ") + super().format(record)


_HANDLER = _StderrHandler()
_HANDLER.setFormatter(_Prefixed("%(message)s"))
_HANDLER.addFilter(_shown)


def configure_logging() -> None:
    """Idempotent: calling it again changes nothing."""
    package = logging.getLogger("asr_spec")
    if _HANDLER not in package.handlers:
        package.addHandler(_HANDLER)
    package.setLevel(logging.INFO)  # INFO records reach the handler, which shows the notices among them
    package.propagate = False
    warnings.formatwarning = lambda message, *args, **kwargs: f"warning: {message}\n"
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:  # pragma: no cover - transformers is a dependency
        pass


def trace_streams(path: str | os.PathLike) -> None:
    """Append every live stream's trace to the file `path` (its folder made if need be): one line per re-decode
    result, "<ms since start> ms stream policy N decode K (kind) of A-B s, heard H s: <hypothesis with timestamps>
    | committed '...', buffer from S s" (the logger `asr_spec.stream.policy` at DEBUG; not on stderr). A second
    call moves the trace to its file."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(relativeCreated)d ms %(message)s"))
    logger = logging.getLogger(STREAM_TRACE_LOGGER)
    for old in [h for h in logger.handlers if isinstance(h, logging.FileHandler)]:  # one trace file at a time
        logger.removeHandler(old)
        old.close()
    logger.setLevel(logging.DEBUG)
    logger.addHandler(handler)
    logger.propagate = False  # the CLI's stderr handler shows warnings only
