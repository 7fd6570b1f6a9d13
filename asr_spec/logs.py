"""Logging set-up of the command-line entry points, in one place: warnings as one stderr line each
(``warning: ...``), no transformers chatter or progress bars. The library itself never configures logging."""

from __future__ import annotations

import logging
import sys
import warnings
from typing import Any

__all__ = ["configure_logging"]


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is when a message comes (the CLI may be run in-process under redirection)."""

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


_HANDLER = _StderrHandler()


def configure_logging() -> None:
    """Idempotent: calling it again changes nothing."""
    package = logging.getLogger("asr_spec")
    if _HANDLER not in package.handlers:
        _HANDLER.setFormatter(logging.Formatter("warning: %(message)s"))
        package.addHandler(_HANDLER)
    package.setLevel(logging.WARNING)
    package.propagate = False
    warnings.formatwarning = lambda message, *args, **kwargs: f"warning: {message}\n"
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:  # pragma: no cover - transformers is a dependency
        pass
