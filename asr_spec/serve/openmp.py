"""The server's OpenMP threads: the engine thread's team, without a second pool beside it.

torch's CPU kernels (and this project's kernel extension) run their parallel loops on OpenMP teams, one pool of
worker threads per thread that starts a parallel region. The server decodes on its own engine thread, while the
thread that loaded the models keeps its pool. GNU OpenMP (the runtime torch ships on Linux) counts every pool's
threads, and once they outnumber the CPUs it stops spinning between parallel regions: each of the hundreds of
regions of a decode step then waits for its workers to be woken by the kernel. Measured on 2 cores (whisper-base
bf16, the same engine on another thread while the main thread's pool was alive): greedy steps 2.6x slower at batch
1 (16.35 vs 6.37 ms), 2.3x at batch 8, speculative 2.9x; with the main thread's pool released first, as fast as on
the main thread (docs/live.md, "One OpenMP team").

So the server (`app.create_app`'s lifespan) releases the calling thread's pool before it starts the engine thread
(`release_pool`). The event loop's worker threads keep torch's thread count: on a single-team variant (each worker
thread without a team) an HTTP transcription of a 159 s file took ~1 s longer (its voice activity and assembly run
there), so it was not kept. A runtime that is not found (not Linux, or torch without OpenMP) leaves everything as
it is.
"""

from __future__ import annotations

import ctypes
import logging
from functools import lru_cache
from pathlib import Path

log = logging.getLogger(__name__)

__all__ = ["release_pool", "runtime", "runtime_path"]

MAPS = Path("/proc/self/maps")
# the OpenMP runtimes torch builds link: GNU's (Linux wheels), LLVM's (macOS), Intel's
RUNTIMES = ("libgomp", "libomp", "libiomp5")
_NAME_STARTS = tuple(f"{name}{sep}" for name in RUNTIMES for sep in ".-")  # libgomp.so.1, libgomp-a34b3233.so.1
OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: free the threads, keep the settings


def runtime_path(maps: str, own_dir: str = "") -> str | None:
    """The file of the OpenMP runtime (`RUNTIMES`) mapped in a /proc/<pid>/maps text: the first one under
    `own_dir` (torch's library folder: other packages bring their own copy, ctranslate2 for one, mapped first), else
    the first one; None without any. Pure."""
    found = []
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) < 6:  # an anonymous mapping
            continue
        path = fields[5].strip()
        if Path(path).name.startswith(_NAME_STARTS):
            found.append(path)
    own = [path for path in found if own_dir and Path(path).parent == Path(own_dir)]
    return (own or found or [None])[0]


@lru_cache(maxsize=1)
def runtime() -> ctypes.CDLL | None:
    """The OpenMP runtime this process has loaded (torch's: the same library, opened again by its path), when it
    has what `release_pool` calls; None elsewhere."""
    import torch  # torch loads its runtime

    try:
        path = runtime_path(MAPS.read_text(errors="replace"), str(Path(torch.__file__).parent / "lib"))
    except OSError:
        return None
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(path)
    except OSError:
        return None
    if not hasattr(lib, "omp_pause_resource_all"):
        return None
    lib.omp_pause_resource_all.argtypes = [ctypes.c_int]
    return lib


def release_pool() -> bool:
    """Free the calling thread's OpenMP worker threads (`omp_pause_resource_all`, soft: its settings kept; a later
    parallel region of this thread starts a pool again). Returns whether it did."""
    lib = runtime()
    if lib is None:
        return False
    done = lib.omp_pause_resource_all(OMP_PAUSE_SOFT) == 0
    if not done:
        log.warning("the OpenMP runtime refused to release the main thread's workers; decode steps may be slower")
    return done
