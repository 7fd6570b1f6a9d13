"""glibc's malloc set for a long-running server whose big buffers come and go (the encoder's activations).

glibc serves a request above its mmap threshold with its own mmap, unmapped when freed; but each time such a
block is freed it raises the threshold to that block's size (up to 32 MiB on 64-bit), so after the first encoder
batch its activations (megabytes each) come from the heap arenas instead, which keep freed memory and fragment. On
whisper-base an encoder batch of 8 windows then peaks 256 MB above one of 1 and leaves 130-250 MB resident after
it; with the threshold pinned at its initial 128 KiB the peak is 147 MB above and what it leaves is 6 MB
(docs/live.md, "Memory"). Pinned at `MMAP_THRESHOLD_BYTES` (4 MiB: above a decode step's tensors, below the
encoder's), 16 streams and the hour sender peak at 1.39x one stream's RSS. Setting the threshold with `mallopt`
turns the dynamic adjustment off. Each server
thread (the engine's, the event loop, the voice-activity workers) would also get its own arena, each keeping
what it freed: `MAX_ARENAS` bounds them.

`pin` does both once for the process (the server calls it before loading the models); it changes nothing where
libc is not glibc, or where the user chose through glibc's own environment variables (MALLOC_MMAP_THRESHOLD_,
MALLOC_ARENA_MAX, or GLIBC_TUNABLES), which then win.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

__all__ = ["MAX_ARENAS", "MMAP_THRESHOLD_BYTES", "pin"]

log = logging.getLogger(__name__)
# blocks above it are mmapped and returned on free: the encoder's activations (whisper-base, one 30 s window: 1.5-6
# MB; a batch of 8: 12-49 MB) but not a decode step's tensors (under ~2 MB at 8 rows), whose mmap, page faults and
# munmap on every step cost the 128 KiB setting first tried 1.6x fewer re-decodes a minute with 8 streams
MMAP_THRESHOLD_BYTES = 4 * 1024 * 1024
MAX_ARENAS = 2  # malloc arenas shared by all threads (glibc's default: 8 per core)
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter numbers (malloc.h)
_M_ARENA_MAX = -8
_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_ARENA_MAX", "GLIBC_TUNABLES")


def pin(environ: dict[str, str] | None = None) -> bool:
    """Pin glibc's mmap threshold at `MMAP_THRESHOLD_BYTES` and its arenas at `MAX_ARENAS`; returns whether it
    did (False: not glibc, or the environment sets malloc itself). environ: default os.environ."""
    environ = os.environ if environ is None else environ
    if any(name in environ for name in _USER_SETTINGS):
        return False
    libc = _glibc()
    if libc is None:
        return False
    done = libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1 and libc.mallopt(_M_ARENA_MAX, MAX_ARENAS) == 1
    if not done:
        log.warning("mallopt refused the server's malloc settings; the encoder's transient memory may stay resident")
    return done


def _glibc() -> ctypes.CDLL | None:
    """The process's C library when it is glibc (it has `gnu_get_libc_version`), else None."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    return libc if hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "mallopt") else None
