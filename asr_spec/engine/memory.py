"""How much memory a run will take, known before anything is allocated (pure arithmetic, plus one probe of what
the device has free).

A run holds, per batch row (slot): each decoder's self-attention cache (keys and values for every layer and
position), its cross-attention cache (keys and values over the encoder's positions), the encoded chunk waiting
for the slot, and the step's transient tensors (the (k + 1) x vocabulary scores the rules make, in float32).
The models themselves are already loaded when a run starts: they are reported, and what is free is measured
after them. A batch that cannot fit is refused at once with the largest batch size that does.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass

import torch

from asr_spec.engine.cache import channel_scaled

MAX_ENCODE_BATCH = 16  # chunks featurised / encoded at once, whatever the decode batch (bounds the activations)
# On a CPU the engine encodes at most this many windows a call (`encode_batch`): whisper-base's 8-window call holds
# 49 MB fc1 outputs, above glibc's 32 MiB dynamic mmap ceiling (faulted afresh each call offline), and a server
# that keeps its transient buffers in the heap (asr_spec/allocator.py) keeps the largest call's. Measured on the AMX
# Xeon (2 threads, fifth session): three long files 5.51 / 5.48 s at 4 against 5.47 / 5.58 s at 16 (encoder 1.58 /
# 1.49 vs 1.64 / 1.61 s); 16 live streams + an hour sender peak at 1,698 MiB against 1,932 (one stream: 1,222), and
# 8 streams' commit latency p95 6.7 s against 8.7
MAX_ENCODE_BATCH_CPU = 4
FLOAT32_BYTES = 4
# Fraction of the free memory a run may plan to use: the rest is for activations not counted here (the
# encoder's micro-batch, attention scores of one step), the allocator's slack and the rest of the process.
USABLE_FRACTION = 0.8


class ResourceError(MemoryError):
    """A run cannot fit the machine (its caches would exceed the free memory); the message says what fits."""


@dataclass(frozen=True)
class DecoderShape:
    """What a decoder's caches are made of (read from `engine.decoder.Decoder`)."""

    n_layers: int
    n_heads: int
    head_dim: int
    dtype_bytes: int
    # of the audio keys/values (the cross-attention cache: `Decoder.audio_dtype`); None: the decoder's own
    audio_dtype: torch.dtype | None = None
    # the self-attention positions its cache holds at least, whatever the run's (`Decoder.min_cache_positions`)
    min_positions: int = 0


@dataclass(frozen=True)
class RunShape:
    """Everything the per-row memory of a run depends on."""

    target: DecoderShape
    draft: DecoderShape | None
    n_positions: int  # self-attention cache positions per row (max_target_positions + K + 2)
    n_audio_ctx: int  # encoder positions (1500 for Whisper)
    d_model: int  # target encoder width (an encoded chunk waiting for a slot)
    vocab_size: int
    k_max: int  # draft tokens per step (0 greedy)
    model_bytes: int  # parameters of the target and draft, already resident


def _cache_bytes(shape: DecoderShape, n_positions: int, n_audio_ctx: int) -> int:
    """Bytes of one row of one decoder's KV cache: (self + cross) x (keys + values) x layers x heads x dims, and
    the audio keys/values' fp32 channel scales where they have them (`cache.channel_scaled`)."""
    per_position = 2 * shape.n_layers * shape.n_heads * shape.head_dim
    audio_bytes = shape.dtype_bytes if shape.audio_dtype is None else shape.audio_dtype.itemsize
    scaled = shape.audio_dtype is not None and channel_scaled(shape.audio_dtype)
    scales = per_position * FLOAT32_BYTES if scaled else 0
    positions = max(n_positions, shape.min_positions)
    return per_position * (positions * shape.dtype_bytes + n_audio_ctx * audio_bytes) + scales


def row_bytes(run: RunShape) -> int:
    """Bytes one batch row needs for the whole run."""
    caches = _cache_bytes(run.target, run.n_positions, run.n_audio_ctx)
    if run.draft is not None:
        caches += _cache_bytes(run.draft, run.n_positions, run.n_audio_ctx)
    encoded = run.n_audio_ctx * run.d_model * run.target.dtype_bytes
    # scores, their logsumexp / softmax temporaries and the forbid mask of the rules: ~4 (k + 1, V) float32 copies
    step = 4 * (run.k_max + 1) * run.vocab_size * FLOAT32_BYTES
    return caches + encoded + step


def run_bytes(run: RunShape, n_rows: int) -> int:
    """Bytes of caches and per-row tensors of a run of `n_rows` rows (the models excluded)."""
    return n_rows * row_bytes(run)


def largest_batch(run: RunShape, free_bytes: int) -> int:
    """The largest number of rows whose run fits in `free_bytes` (0: not even one)."""
    return max(0, int(free_bytes * USABLE_FRACTION) // row_bytes(run))


def free_bytes(device: torch.device) -> int | None:
    """Memory free for a new allocation on `device` now (None when it cannot be known)."""
    if device.type == "cuda":  # free on the device, plus what PyTorch's allocator holds but does not use
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    if device.type == "cpu":
        found = [n for n in (_host_available(), cgroup_headroom()) if n is not None]
        return min(found) if found else None
    return None


def _host_available() -> int | None:
    """The machine's available memory (MemAvailable; else the free pages)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def cgroup_headroom(root: str = "/sys/fs/cgroup", membership: str = "/proc/self/cgroup") -> int | None:
    """What this process's memory cgroup (a container's limit: Docker, Kubernetes) still lets it allocate: its
    limit less its usage, reclaimable file cache not counted (as `docker stats` reads it); None without a limit.
    /proc/meminfo shows the host's memory inside a container: a batch over the container's limit passed the check
    and the process was killed instead of told. cgroup v2 (memory.max) and v1 (memory.limit_in_bytes)."""
    try:
        with open(membership, encoding="utf-8") as handle:
            lines = [line.strip().split(":", 2) for line in handle if line.count(":") >= 2]
    except OSError:
        return None
    for _, controllers, path in lines:
        if controllers == "":  # v2: one hierarchy
            base, files = root, ("memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):  # v1: the memory controller's own hierarchy
            base, files = os.path.join(root, "memory"), ("memory.limit_in_bytes", "memory.usage_in_bytes",
                                                         "total_inactive_file")
        else:
            continue
        found = _headroom_in([os.path.join(base, path.lstrip("/")), base], files)  # its own group, else the root's
        if found is not None:
            return found
    return None


def _headroom_in(folders: list[str], files: tuple[str, str, str]) -> int | None:
    """limit - (usage - inactive file cache) from the first of `folders` whose limit file reads; None when it
    says no limit ("max", or v1's 2^63-ish) or none reads."""
    limit_name, usage_name, inactive_name = files
    for folder in folders:
        try:
            with open(os.path.join(folder, limit_name), encoding="ascii") as handle:
                limit = handle.read().strip()
            with open(os.path.join(folder, usage_name), encoding="ascii") as handle:
                usage = int(handle.read().strip())
        except (OSError, ValueError):
            continue
        if limit == "max" or not limit.isdigit() or int(limit) >= 1 << 60:
            return None
        inactive = 0
        try:
            with open(os.path.join(folder, "memory.stat"), encoding="ascii") as handle:
                for line in handle:
                    key, _, value = line.partition(" ")
                    if key == inactive_name:
                        inactive = int(value)
        except (OSError, ValueError):
            pass
        return max(0, int(limit) - max(0, usage - inactive))
    return None


def gib(n_bytes: float) -> str:
    return f"{n_bytes / 2**30:.2f} GiB"


def check_fits(run: RunShape, n_rows: int, free: int | None) -> str | None:
    """None when `n_rows` rows fit in `free` bytes (or nothing is known), else the one-line reason."""
    if free is None:
        return None
    need = run_bytes(run, n_rows)
    if need <= free * USABLE_FRACTION:
        return None
    fits = largest_batch(run, free)
    advice = f"--batch-size {fits} fits" if fits else "not even --batch-size 1 fits: use a smaller model or dtype"
    return (f"batch of {n_rows} needs {gib(need)} for its caches (models {gib(run.model_bytes)} already loaded) "
            f"but {gib(free)} is free: {advice}")


def fits_now(run: RunShape, n_rows: int, device: torch.device, releasable: int = 0) -> str | None:
    """`check_fits` against the memory free on `device` now plus `releasable` bytes (a held state the run would
    replace). Where it does not fit, unreachable objects are collected first and it is asked again: an engine
    let go keeps its caches until Python's cyclic collector runs (it references its own methods), so a benchmark
    building engine after engine on a GPU saw tens of GiB of dropped engines as used and stopped."""
    def reason() -> str | None:
        free = free_bytes(device)
        return check_fits(run, n_rows, None if free is None else free + releasable)

    if reason() is None:
        return None
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return reason()


def encode_batch(batch_size: int, device: torch.device) -> int:
    """How many windows the engine encodes in one call for a run of `batch_size` rows on `device`: at most
    `MAX_ENCODE_BATCH_CPU` on a CPU, `MAX_ENCODE_BATCH` elsewhere."""
    return min(batch_size, MAX_ENCODE_BATCH_CPU if device.type == "cpu" else MAX_ENCODE_BATCH)
