"""Exception types shared by every stage of asr-spec.

Both are ``ValueError`` subclasses, so callers that already catch ``ValueError`` keep working, and both derive
from :class:`AsrSpecError`, so the CLI can tell "this input is bad" (report it, move on to the next file) from a
bug (let it propagate). Messages name the input first, then the cause: ``"talk.flac: corrupt or truncated audio
(flac decoder lost sync)"``.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any, TextIO

__all__ = ["EXIT_FAILED", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_USAGE", "AsrSpecError", "AudioError", "InputError",
           "ModelLoadError", "interrupts_held", "one_line", "show_warning_line"]

# the command line's exit codes (here, the lightest module, for `asr_spec.__main__.run` too)
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


class AsrSpecError(Exception):
    """Base class of the errors asr-spec raises on purpose (bad input, unreadable audio)."""


class AudioError(AsrSpecError, ValueError):
    """An audio source cannot be read or is not usable audio (missing, corrupt, empty, NaN samples...)."""


class AudioTooLong(AudioError):
    """An input read past the most audio its caller takes (`transcribe.inputs.Input.max_samples`): `limit_s`
    seconds, found after reading `read_s`."""

    def __init__(self, limit_s: float, read_s: float):
        super().__init__(f"longer than the limit of {limit_s:g} s of audio (refused after reading {read_s:.0f} s)")
        self.limit_s, self.read_s = limit_s, read_s


class InputError(AsrSpecError, ValueError):
    """A caller-supplied argument or option is invalid (negative length, unknown format, bad shape...)."""


class ModelLoadError(AsrSpecError, ValueError):
    """A model, draft or processor cannot be loaded (missing, truncated or corrupt weights, bad config.json,
    no tokenizer); the message names the path and the cause."""


def one_line(err: BaseException, name: str | None = None) -> str:
    """The cause of `err` on one line, without a leading "<name>: " (when the caller names the input itself; taken
    off before the lines are split: a file name holding a newline left only the name's first part)."""
    text = str(err)
    if name and text.startswith(f"{name}: "):
        text = text[len(name) + 2:]
    return next((line.strip() for line in text.splitlines() if line.strip()), type(err).__name__)


def show_warning_line(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                      file: TextIO | None = None, line: str | None = None, **_: Any) -> None:
    """A `warnings.showwarning` that prints ``warning: <message>`` on one stderr line (no category, no source)."""
    print(f"warning: {one_line(message) if isinstance(message, BaseException) else message}",
          file=sys.stderr if file is None else file)


@contextlib.contextmanager
def interrupts_held() -> Iterator[None]:
    """Ctrl-C (SIGINT) held back while the block runs, then sent again once the handler in place before is back
    (Python's raises KeyboardInterrupt; an application's own is called): for a few renames that must not stop half
    done. In the main thread only (the one Python runs signal handlers in), and only where SIGINT has a handler
    set from Python that does not ignore it; elsewhere the block runs as it is."""
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or previous in (signal.SIG_IGN, None):
        yield
        return
    caught: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught:
            signal.raise_signal(signal.SIGINT)
