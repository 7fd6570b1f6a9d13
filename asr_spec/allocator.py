"""glibc's malloc set for a process whose big buffers come and go (the encoder's activations, a decode step's logits
and attention scores), every call: a long-running server (`asr-spec serve`), and an offline run in a process of its
own (`asr-spec transcribe` and `asr-spec stream`, and `benchmarks/bench.py` as they run). Not the library's to
set for a program that imports it: `Transcriber` leaves malloc alone.

Where those buffers come from decides both the server's speed and its memory:
- **mmapped** (above glibc's mmap threshold): each is mapped, page-faulted in (zeroed by the kernel) and unmapped on
  every call. With the threshold pinned at 4 MiB (the setting before this one) the encoder's activations and a
  step's larger tensors were: about a third of the engine's time, 8 streams x 60 s got 192 re-decodes and a commit
  latency p95 of 15.3 s; with them in the heap, 286 and 6.7 s (docs/live.md, "fifth session").
- **from the heap arenas**, never trimmed: the first calls grow the heap to what the largest call needs (an encoder
  batch of the engine's rows, a step over all its rows), later calls reuse those pages: no page fault, no system
  call, and the resident set is the high-water mark of one call's transient memory, which does not grow with time
  or with the number of streams (the engine's rows bound both batches). That is what `pin` sets:
  `MMAP_THRESHOLD_BYTES` above any one tensor of whisper-base's largest batch, `TRIM_THRESHOLD_BYTES` so the heap's
  freed top is kept for the next call, not given back and faulted in again.
- glibc as it is does neither: it raises its threshold to the size of each mmapped block freed (up to 32 MiB) and
  trims the heap's top past twice that, so the first big blocks are mmapped, later ones come from the heap and it
  trims and regrows; each server thread (the engine's, the event loop, the voice-activity workers) may also get its
  own arena, each keeping what it freed: `MAX_ARENAS` bounds them.

The price is resident memory held between calls: 16 streams and the hour sender peak at the ratio to one stream's that
docs/live.md measures (issue 37's bound: 1.5x). Offline, where one process transcribes its files and exits, there is no
such price: peak RSS is the largest call's either way (1.47-1.58 GB both ways for the three long fixtures at batch 8 in
the int8 precision, AVX2-only EPYC, 2 threads), and the faults go: 11.95 / 11.72 s against 12.26 / 12.03 s in two
alternated pairs of runs (1.03x; docs/cpu.md, "The offline run's malloc"). Setting the thresholds with `mallopt` turns
glibc's dynamic adjustment off. A thread arena's heap is at most 64 MiB: a larger block there is mmapped whatever the
threshold.

`pin` does it once for the process (the server and the CLI's commands call it before loading the models); it changes
nothing where libc is not glibc, or where the user chose through glibc's own environment variables (`USER_SETTINGS`),
which then win.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

__all__ = ["MAX_ARENAS", "MMAP_THRESHOLD_BYTES", "TRIM_THRESHOLD_BYTES", "USER_SETTINGS", "pin"]

log = logging.getLogger(__name__)
# blocks above it are mmapped and returned on free: none of the engine's (whisper-base's encoder at 8 windows: 12-49
# MB a tensor); glibc's own ceiling for its dynamic threshold is 32 MiB
MMAP_THRESHOLD_BYTES = 256 * 1024 * 1024
# the heap's free top past this is given back to the system: never, in practice (the heap is what one call needs)
TRIM_THRESHOLD_BYTES = 1024 * 1024 * 1024
MAX_ARENAS = 2  # malloc arenas shared by all threads (glibc's default: 8 per core)
_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
_SETTINGS = ((_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES), (_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES),
             (_M_ARENA_MAX, MAX_ARENAS))
# glibc's environment variables for what `pin` sets (or that change how it acts): any of them set, `pin` stands aside
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_",
                 "MALLOC_ARENA_MAX", "MALLOC_ARENA_TEST", "GLIBC_TUNABLES")


def pin(environ: dict[str, str] | None = None) -> bool:
    """Set glibc's mmap threshold at `MMAP_THRESHOLD_BYTES`, its trim threshold at `TRIM_THRESHOLD_BYTES` and its
    arenas at `MAX_ARENAS`; returns whether it did (False: not glibc, or the environment sets malloc itself).
    environ: default os.environ."""
    environ = os.environ if environ is None else environ
    if any(name in environ for name in USER_SETTINGS):
        return False
    libc = _glibc()
    if libc is None:
        return False
    done = all(libc.mallopt(parameter, value) == 1 for parameter, value in _SETTINGS)
    if not done:
        log.warning("mallopt refused the malloc settings; the engine's buffers may be mapped every call")
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
