"""A few-query attention kernel for CPU (C++, `cpu_attention.cpp`), built at first use, and the one decision
whether a decoder's attention runs through it (`fused_attention_usable`); its vector layer is
`cpu_attention_simd.h`.

softmax(scale q k^T) v for each of a row's 1..~32 queries against that row's keys and values, read in place from
a `KVCache` (per row and head stored (head_dim, positions), as the decoder holds the audio's, or (positions,
head_dim), as it holds the self-attention's), each query over its own number of keys (`n_seen`:
self-attention sees the positions up to its own, cross-attention all audio keys), accumulated in fp32 and rounded
once to the dtype. Each (row, head, query) output comes from the same code in the same order whatever the other
rows, queries and threads: row- and query-invariant by construction on every CPU, so a (K+1)-token verify pass
gives each position exactly what a 1-token greedy step gives it, with no probe, key bucket or mask.

Built with torch's `cpp_extension.load` (g++ and ninja, -O3 -march=native -fopenmp; x86-64-v3 where
`ASR_SPEC_CPU_FLAGS` forces an AVX2 machine's flags, and with the AVX-512 paths emulated where it forces AVX-512
this CPU lacks: `target_options`) into torch's extension cache
(`TORCH_EXTENSIONS_DIR`, by default ~/.cache/torch_extensions) under a name that carries a digest of this CPU's
flags, so that a home directory shared by CPUs of different kinds never loads a build for another. Where it
cannot be built (no compiler, no ninja, a build error) one warning is logged and the decoder runs torch's
products (`kernels.attention`, SDPA); `ASR_SPEC_NO_CPU_KERNELS=1` asks for that fallback without trying. Never
built or used for CUDA tensors.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import subprocess
import time
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

DISABLE_ENV = "ASR_SPEC_NO_CPU_KERNELS"
SOURCE = Path(__file__).with_name("cpu_attention.cpp")
# included by SOURCE: its vector layer, its sums in bf16 pairs (AVX-512-BF16), the thin fp32 / bf16 products
# (`engine.cpu_linear`), the encoder's attention (`encoder_attention`) and its int8 activations (`engine.int8`),
# the rules' row reductions (`max_logsumexp`, `engine.rules`), a decoder's layers in one call (`engine.cpu_layers`),
# built into the same extension
HEADERS = tuple(Path(__file__).with_name(name) for name in ("cpu_attention_simd.h", "cpu_attention_pairs.h",
                                                            "cpu_attention_sums.h", "cpu_linear.h",
                                                            "cpu_encoder_attention.h", "cpu_int8.h",
                                                            "cpu_int8_attention.h", "cpu_reduce.h", "cpu_decoder.h",
                                                            "cpu_emulated_avx512.h", "cpu_lstm.h"))
CPUINFO = Path("/proc/cpuinfo")
# a flags string (as in /proc/cpuinfo) that replaces this CPU's for every CPU decision (`models.cpu.FLAGS_ENV`;
# `benchmarks.bench --emulate-isa avx2` sets it): the kernel is then built for an AVX2 machine's where they are
# one's, with AVX-512 emulated where they claim AVX-512 this CPU lacks, and for this CPU's own (-march=native)
# where it has AVX-512 itself (`target_options`: forced flags without avx512_bf16 on a CPU with it still build
# its bf16 paths; the Python decisions follow the forced flags)
FLAGS_ENV = "ASR_SPEC_CPU_FLAGS"
# the dtypes the kernel reads and writes (keys, values, queries and output all in one of them)
KERNEL_DTYPES = (torch.bfloat16, torch.float32)


def switched_on(name: str) -> bool:
    """Whether environment variable `name` is set to anything but "" / "0": how every switch of the kernels reads
    (`ASR_SPEC_NO_CPU_KERNELS` here, `ASR_SPEC_NO_INT8_ENCODER` in `engine.int8`)."""
    return os.environ.get(name, "") not in ("", "0")


def disabled() -> bool:
    """Whether `ASR_SPEC_NO_CPU_KERNELS` asks for torch's products instead of the kernel (`switched_on`)."""
    return switched_on(DISABLE_ENV)


def fused_attention_usable(device: torch.device, dtype: torch.dtype) -> bool:
    """The one decision: whether a decoder on `device` in `dtype` runs its attention through the kernel (a CPU,
    a dtype it reads, not disabled, and built here; the build is tried once per process)."""
    return device.type == "cpu" and dtype in KERNEL_DTYPES and not disabled() and _extension() is not None


def cpu_flags() -> str:
    """The instruction-set flags the kernel is built for: `ASR_SPEC_CPU_FLAGS` where set, else /proc/cpuinfo's
    flags line, else torch's probe's (the file read once a process: `_cpuinfo_flags`)."""
    forced = os.environ.get(FLAGS_ENV)
    if forced is not None:
        return forced
    return _cpuinfo_flags(CPUINFO)


@functools.cache
def _cpuinfo_flags(path: Path) -> str:
    """The flags line of `path` (/proc/cpuinfo); where it is absent or unreadable, the names of torch's cpuid probe
    (`kernels.hardware_flags`, the same names; `models.cpu.detect_cpu` falls back to it too), "" where neither
    says: read once per path (every decoder, encoder and decision asks)."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        from asr_spec.engine.kernels import hardware_flags

        return " ".join(sorted(hardware_flags() or ()))
    return next((line for line in lines if line.startswith(("flags", "Features"))), "")


AVX512 = frozenset({"avx512f", "avx512bw"})  # the flags of the kernel's 16-lane paths (`CPU_AVX512`)


def target_options(flags: str, forced: bool, own: str) -> tuple[str, ...]:
    """g++'s target options for a kernel built for `flags` (`cpu_flags()`): this CPU's own (-march=native) unless
    they are forced (`FLAGS_ENV`) to another kind's. Forced to an AVX2 machine's (no avx512f, as `--emulate-isa
    avx2` gives them): -march=x86-64-v3, so that an emulated AVX2 run times the kernel an AVX2-only CPU builds.
    Forced to AVX-512 (avx512f and avx512bw, with avx512_bf16 and avx512_vnni or not) that this CPU's own flags
    `own` lack: x86-64-v3 with the AVX-512 paths emulated through SIMDe (`cpu_emulated_avx512.h`, libsimde-dev;
    `emulated_macros`): slow, for tests only (tests/test_native_kernels.py), so that an AVX2 machine runs the code
    an AVX-512 CPU builds."""
    names, own_names = set(flags.replace(":", " ").split()), set(own.replace(":", " ").split())
    if not forced:
        return ("-march=native",)
    if AVX512 <= names and "avx512f" not in own_names:
        return ("-march=x86-64-v3", "-Wno-psabi", *(f"-D{macro}" for macro in emulated_macros(names)))
    return ("-march=x86-64-v3",) if "avx2" in names and "avx512f" not in names else ("-march=native",)


def emulated_macros(names: set[str] | frozenset[str]) -> tuple[str, ...]:
    """The macros of a build emulating AVX-512 through SIMDe (`cpu_emulated_avx512.h`) for a CPU with the flags
    `names`: its F / BW paths, and its BF16 (vdpbf16ps) and VNNI (vpdpbusd: `cpu_int8_attention.h`) ones where the
    flags claim them (`load`'s defines, or -D options)."""
    extra = {"avx512_bf16": "CPU_KERNELS_EMULATE_AVX512_BF16", "avx512_vnni": "CPU_KERNELS_EMULATE_AVX512_VNNI"}
    return ("CPU_KERNELS_EMULATE_AVX512", *(macro for flag, macro in extra.items() if flag in names))


def _target() -> tuple[str, ...]:
    """`target_options` for this process: the flags the kernel is built for, forced or not, and this CPU's own."""
    return target_options(cpu_flags(), FLAGS_ENV in os.environ, _cpuinfo_flags(CPUINFO))


def build_name() -> str:
    """The extension's name in torch's cache: one per CPU kind (machine, instruction-set flags and -march),
    since code built for one CPU may not run on another, and per text of the source and its headers (torch's own
    version check reads the listed source alone; one name a version also lets `built` tell a first build from a
    load), and per place of the source: ninja rebuilds a build whose compile command changed, and the command
    names the source's path, so two copies of the package (a checkout and a worktree, or an install) under one
    name rebuilt it in turn, ~25 s at each switch (a models reviewer's `--dtype auto` loads of 26-32 s)."""
    flags, target = cpu_flags(), " ".join(_target())
    header = "".join(path.read_text() for path in (SOURCE, *HEADERS) if path.exists())
    digest = hashlib.sha1(f"{platform.machine()} {flags} {target} {SOURCE.resolve()}\n{header}".encode()
                          ).hexdigest()[:12]
    return f"asr_spec_cpu_attention_{digest}"


# seconds after which a build lock in torch's extension cache was left by a process killed mid-build (builds take
# ~20-65 s here): torch waits on such a lock for ever, and every later run hung at its first kernel
STALE_LOCK_S = 600.0


def clear_stale_lock(name: str) -> bool:
    """Remove the build lock of `name` in torch's extension cache when it is older than STALE_LOCK_S (one warning);
    whether one was removed."""
    from torch.utils import cpp_extension

    try:
        lock = Path(cpp_extension._get_build_directory(name, verbose=False)) / "lock"
        age_s = time.time() - lock.stat().st_mtime
    except (AttributeError, OSError):  # no such helper, no cache, or no lock
        return False
    if age_s <= STALE_LOCK_S:
        return False
    log.warning("removing the CPU kernels' build lock %s (%.0f s old: a build killed before it ended)", lock, age_s)
    lock.unlink(missing_ok=True)
    return True


def built(name: str) -> bool:
    """Whether torch's extension cache already holds a build called `name` (then `_extension` only loads it)."""
    from torch.utils import cpp_extension

    try:
        build_dir = Path(cpp_extension._get_build_directory(name, verbose=False))
    except (AttributeError, OSError):  # a torch without that helper, or a cache it cannot create: say "building"
        return False
    return (build_dir / f"{name}.so").exists()


# `logs.NOTICE`, spelled here since the engine imports nothing else from the package (tests/test_layout.py): an INFO
# record logged with it is a line the command line shows (tests/test_cli.py checks the two agree)
NOTICE = {"notice": True}
# the notice before a build (the command line shows it as `note: ...`)
BUILD_NOTICE = "building the CPU kernels for this CPU (once for this CPU and version, ~20-60 s)"
# seconds each build of this process took (`build_seconds`)
_BUILDS_S: list[float] = []


def build_seconds() -> float:
    """Seconds this process spent building the kernel, a failed build's too (0 where it loaded a build): a one-time
    cost that `asr-spec transcribe`'s summary reports apart from its speed."""
    return sum(_BUILDS_S)


@functools.cache
def _extension() -> ModuleType | None:
    """The built kernel module, or None (one warning) where it cannot be built; one notice before a build (the
    command line shows it: a first run waits ~20-60 s on it)."""
    name = build_name()  # reads the source and headers: once
    fresh, started = not built(name), time.perf_counter()
    try:
        if fresh:
            log.info(BUILD_NOTICE, extra=NOTICE)
        return load(name)
    except (ImportError, OSError, RuntimeError, subprocess.CalledProcessError) as err:
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        log.warning("cpu attention kernel not built (%s): attention runs through torch's products", reason)
        return None
    finally:  # a build that failed after compiling a while took that time too
        if fresh:
            _BUILDS_S.append(time.perf_counter() - started)


def load(name: str, defines: tuple[str, ...] = ()) -> ModuleType:
    """Build (once) or load the extension as `name`, with extra -D `defines` (a benchmark's variants); raises
    where it cannot be built."""
    from torch.utils import cpp_extension

    clear_stale_lock(name)
    # -fopenmp: at::parallel_for's OpenMP pragma (at run time the loader binds libgomp.so.1 to torch's own,
    # already loaded, so torch.set_num_threads governs it); without it the kernel runs on one thread
    return cpp_extension.load(name=name, sources=[str(SOURCE)],
                              extra_cflags=["-O3", *_target(), "-fopenmp", *(f"-D{d}" for d in defines)],
                              extra_ldflags=["-fopenmp"], verbose=False)


def extension() -> ModuleType:
    """The built extension module (its `attend`, `linear`, `panel_columns`, `encoder_attention`); only where
    `fused_attention_usable` says it is built."""
    module = _extension()
    if module is None:
        raise RuntimeError("the CPU kernel extension is not built here (see the warning logged at its build)")
    return module


def encoder_attention_usable(device: torch.device, dtype: torch.dtype) -> bool:
    """The one decision: whether an encoder on `device` in `dtype` runs its self-attention through the kernel's
    `encoder_attention` (a CPU, bfloat16, the extension built here and not disabled, no AMX tiles). Only bf16:
    there it ran whisper-base's encoder attention 2.5x faster than torch's flash attention (AVX-512-BF16 EPYC,
    2 cores, 4 windows a layer: 77 vs 194 ms); in fp32 the two were even (161 vs 167 ms), and the module's SDPA
    stays. Not with AMX tiles, where torch's bf16 products have them and the kernel's dot products were not
    measured against them (as `cpu_linear.fused_linear_usable`)."""
    return dtype == torch.bfloat16 and not amx_tiles() and fused_attention_usable(device, dtype)


def amx_tiles() -> bool:
    """Whether the flags the kernel is built for (`cpu_flags`) have AMX bf16 tiles: where oneDNN's and torch's bf16
    products use them, and the kernel's own bf16 products, measured without AMX only, are not used."""
    return "amx_bf16" in cpu_flags().split()


def encoder_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, scale: float) -> torch.Tensor:
    """softmax(scale q k^T) v per window and head over all its positions (`cpu_encoder_attention.h`): q, k, v
    (B, N, heads * head_dim), the last dimension contiguous, one dtype -> (B, N, heads * head_dim) contiguous.
    A window's output does not depend on the other windows of the call. Only where `encoder_attention_usable`."""
    return extension().encoder_attention(q, k, v, heads, scale)


def encoder_attention_int8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int,
                           scale: float) -> torch.Tensor:
    """softmax(scale q k^T) v per window and head through int8 products (`cpu_int8_attention.h`): q, k, v
    (B, N, heads * head_dim) fp32 or bf16, one dtype, the last dimension contiguous, alike -> (B, N, heads *
    head_dim) in their dtype, contiguous. A window's output does not depend on the other windows of the call. Only
    where `int8.int8_attention_usable`."""
    return extension().encoder_attention_int8(q, k, v, heads, scale)


def int8_attention_levels() -> tuple[int, int, int, int]:
    """The steps `encoder_attention_int8` quantizes with as built here: (query, key, softmax numerator, value); keys
    and values 127 where the build has AVX-512 VNNI, else 63 (`cpu_int8_attention.h`)."""
    return tuple(extension().int8_attention_levels())


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, n_seen: torch.Tensor | None,
           scale: float = 1.0, key_scales: torch.Tensor | None = None,
           value_scales: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(scale q k^T) v per row, head and query, each query over its row's first n_seen[b, t] keys.

    q: (B, T, H, head_dim), head_dim contiguous (a view of a projection's (B, T, H * head_dim) output);
    keys, values: (B, H, S, head_dim), each with head_dim or S contiguous (a `KVCache`'s views, stored either way),
    in q's dtype, or bf16 or int8 under fp32 queries (widened as they are loaded: fp32 attention over their values);
    key_scales, value_scales: int8 keys/values only, (B, H, head_dim) fp32, each channel's scale (the keys and values
    attended are int8 x scale: `KVCache.cross_k_scales`);
    n_seen: (B, T) integer counts in [1, S], or None for all S keys -> (B, T, H * head_dim) in q's dtype.
    Only where `fused_attention_usable` says so.
    """
    b, t, h, d = q.shape
    if n_seen is None:
        n_seen = torch.full((b, t), keys.shape[2], dtype=torch.int32)
    n_seen = n_seen.to(torch.int32)
    # traced (torch.compile, `engine/capture.py`): as the custom op below, opaque to the tracer; eager: the
    # extension's function itself (no dispatcher round trip, ~12 calls a pass)
    run = _attend_op if torch.compiler.is_compiling() else _extension().attend
    return run(q, keys, values, n_seen, scale, key_scales, value_scales).view(b, t, h * d)


@torch.library.custom_op("asr_spec::cpu_attend", mutates_args=())
def _attend_op(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, n_seen: torch.Tensor,
               scale: float, key_scales: torch.Tensor | None, value_scales: torch.Tensor | None) -> torch.Tensor:
    """The kernel as a torch op (what a traced step calls): `attend`'s operands, n_seen (B, T) int32 ->
    (B, T, H, head_dim) contiguous."""
    return _extension().attend(q, keys, values, n_seen, scale, key_scales, value_scales)


@_attend_op.register_fake
def _(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, n_seen: torch.Tensor,
      scale: float, key_scales: torch.Tensor | None, value_scales: torch.Tensor | None) -> torch.Tensor:
    return q.new_empty(q.shape)
