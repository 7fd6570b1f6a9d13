"""What the CPU can do, detected in one place, and the dtype `auto` picks from it.

A CPU's class decides the precision a run is fastest in and whether a draft pays (`presets.plan_models`):

- ``amx-bf16``: Intel AMX tiles (Sapphire Rapids and later Xeons): bf16 products at 1.1-1.6 TFLOP/s on two cores
  (fp32: 0.22-0.31), a (K+1)-token verify pass nearly as cheap as a 1-token step;
- ``avx512-bf16``: AVX-512 bf16 dot products (Cooper Lake, AMD Zen 4 and later): bf16 native, no tiles;
- ``avx2``: no native bf16 (bf16 products emulated, slower than fp32): fp32 weights with the encoder's linear
  products in int8 and the decoder's audio keys/values in bf16 (the "int8" precision, `engine.int8`), where the
  kernel extension is built, else fp32;
- ``other``: none of the above (an old x86 CPU, or a non-x86 one): fp32.

The flags come from ``/proc/cpuinfo``; where that file is absent (macOS, Windows, some containers), from torch's
cpuid probe (``torch.cpu.get_capabilities()``, the same flag names: `engine.kernels.hardware_flags`), and where
this torch has none, from its dispatch capability (``torch.backends.cpu.get_cpu_capability()``: "AMX"?, "AVX512",
"AVX2", "DEFAULT"), which does not tell AVX-512 bf16 apart, so there a CPU reporting AVX512 is taken as
``avx512-bf16`` only when torch also finds oneDNN's bf16 path usable. ``ASR_SPEC_CPU_FLAGS`` (a flags string, as
in /proc/cpuinfo) replaces the detected flags: the test suite pins it so that its dtype decisions do not depend on
the CPU it runs on, and it lets a user try another class's decisions.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from asr_spec.errors import InputError

__all__ = ["CPU_CLASSES", "DTYPES", "INT8", "CpuCapabilities", "auto_choice", "auto_dtype", "bf16_row_block",
           "detect_cpu", "parse_cpu_flags", "parse_cpuinfo", "resolve_dtype", "resolve_precision", "torch_dtype"]

log = logging.getLogger(__name__)

CPUINFO = Path("/proc/cpuinfo")
FLAGS_ENV = "ASR_SPEC_CPU_FLAGS"
CPU_CLASSES = ("amx-bf16", "avx512-bf16", "avx2", "other")  # best first
# dtype names a preset or --dtype may use -> the precision's name ("auto" besides: `auto_choice`). The one table:
# `resolve_precision` reads it, and presets' checks. A precision is a torch dtype's name, or INT8.
DTYPES = {"float32": "float32", "fp32": "float32", "float16": "float16", "fp16": "float16",
          "bfloat16": "bfloat16", "bf16": "bfloat16", "int8": "int8"}
# fp32 weights, the encoder's linear products in int8 (`engine.int8`: rows quantized by their own maximum) and the
# decoder's audio keys/values in int8 (`engine.int8.audio_dtype`)
INT8 = "int8"


@dataclass(frozen=True)
class CpuCapabilities:
    """The instruction-set features that decide a CPU run's precision and drafting."""

    amx_bf16: bool = False  # AMX tiles with bf16 products
    avx512_bf16: bool = False  # AVX-512 bf16 dot products (vdpbf16ps)
    avx512_vnni: bool = False  # AVX-512 int8 dot products
    avx_vnni: bool = False  # 256-bit VNNI (Alder Lake, Zen 5)
    avx2: bool = False
    model_name: str = ""  # "model name" of /proc/cpuinfo, "" where unknown
    source: str = "cpuinfo"  # where the flags came from: "cpuinfo", "torch" or "env" (ASR_SPEC_CPU_FLAGS)

    @property
    def native_bf16(self) -> bool:
        """bf16 products run natively (AMX or AVX-512 bf16): faster than fp32, not emulated."""
        return self.amx_bf16 or self.avx512_bf16

    @property
    def vnni(self) -> bool:
        return self.avx512_vnni or self.avx_vnni

    @property
    def cpu_class(self) -> str:
        """One of `CPU_CLASSES`: the best feature the CPU has, the key of the per-class decisions."""
        if self.amx_bf16:
            return "amx-bf16"
        if self.avx512_bf16:
            return "avx512-bf16"
        return "avx2" if self.avx2 else "other"

    def describe(self) -> str:
        """One line: the class, then the features present, e.g. "amx-bf16 (avx512-bf16, avx512-vnni, avx2)"."""
        names = [name.replace("_", "-") for name in ("amx_bf16", "avx512_bf16", "avx512_vnni", "avx_vnni", "avx2")
                 if getattr(self, name)]
        rest = [n for n in names if n != self.cpu_class]
        return self.cpu_class + (f" ({', '.join(rest)})" if rest else "")

    def as_dict(self) -> dict[str, object]:
        """The run summary's / --json's view: the class, the features and where they came from."""
        return {"class": self.cpu_class, "model_name": self.model_name, "native_bf16": self.native_bf16,
                "vnni": self.vnni, "amx_bf16": self.amx_bf16, "avx512_bf16": self.avx512_bf16, "avx2": self.avx2,
                "source": self.source}


def parse_cpu_flags(flags: str, model_name: str = "", source: str = "cpuinfo") -> CpuCapabilities:
    """A whitespace-separated flags string (the ``flags`` line of /proc/cpuinfo, after the colon) -> capabilities."""
    present = set(flags.split())
    return CpuCapabilities(amx_bf16="amx_bf16" in present, avx512_bf16="avx512_bf16" in present,
                           avx512_vnni="avx512_vnni" in present, avx_vnni="avx_vnni" in present,
                           avx2="avx2" in present, model_name=model_name, source=source)


def parse_cpuinfo(text: str) -> CpuCapabilities | None:
    """The text of /proc/cpuinfo -> the first processor's capabilities; None when it has no flags line (an ARM
    kernel writes "Features")."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        key = key.strip()
        if sep and key in ("flags", "model name") and key not in fields:
            fields[key] = value.strip()
    if "flags" not in fields:
        return None
    return parse_cpu_flags(fields["flags"], fields.get("model name", ""))


def _from_torch() -> CpuCapabilities:
    """The fallback where /proc/cpuinfo is absent: torch's cpuid probe (`kernels.hardware_flags`, the same flag
    names), else its dispatch capability and its oneDNN bf16 check."""
    from asr_spec.engine.kernels import hardware_flags

    flags = hardware_flags()
    if flags is not None:
        return parse_cpu_flags(" ".join(sorted(flags)), source="torch")
    capability = torch.backends.cpu.get_cpu_capability().upper()
    wide = capability.startswith(("AVX512", "AMX"))
    bf16 = wide and torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return CpuCapabilities(amx_bf16=capability.startswith("AMX"), avx512_bf16=bf16, avx512_vnni=wide,
                           avx2=wide or capability.startswith("AVX2"), source="torch")


@functools.cache
def detect_cpu() -> CpuCapabilities:
    """This machine's capabilities (once per process): ``ASR_SPEC_CPU_FLAGS`` if set, else /proc/cpuinfo, else
    torch's view (see the module docstring)."""
    forced = os.environ.get(FLAGS_ENV)
    if forced is not None:
        return parse_cpu_flags(forced, source="env")
    try:
        parsed = parse_cpuinfo(CPUINFO.read_text(encoding="utf-8", errors="replace"))
    except OSError:
        parsed = None
    return parsed if parsed is not None else _from_torch()


# whisper-base's decoder (the default preset's), the shapes `bf16_row_block` probes: d_model, d_ffn, vocabulary,
# heads, text positions (max_positions; a pass reads `decoder.KEY_SPARE` more), audio positions
PROBE_SHAPES = (512, 2048, 51865, 8, 448, 1500)
# bf16 is `auto` only where a greedy step of the default batch (8 rows) is one product whose every row is what a
# 1-row product gives (fewer: still lossless, the products in smaller blocks, and slower)
LOSSLESS_MIN_ROWS = 8


def bf16_row_block() -> tuple[int, int]:
    """(rows, queries) of `kernels.decoder_blocks` in bf16 on this machine, at `PROBE_SHAPES`: how many rows a bf16
    product and how many queries an attention product take here with every row's result bit for bit a lone row's.
    Where the CPU attention kernel runs the attention (`attention_path`; query-invariant by construction) only the
    products are probed and queries is 0, as `Decoder.row_invariance` says. Measured once per process (~2 s on two
    cores: the head's product at 1-32 rows); a decoder of other shapes measures its own when built. Where the
    kernel extension runs the products too (`cpu_linear`) nothing is probed: (`kernels.ANY_ROWS`, 0)."""
    from asr_spec.engine.cpu_linear import fused_linear_usable
    from asr_spec.engine.decoder import KEY_SPARE
    from asr_spec.engine.kernels import ANY_ROWS, decoder_blocks, decoder_rows, onednn_usable

    d_model, d_ffn, n_vocab, n_heads, n_text, n_audio = PROBE_SHAPES
    cpu = torch.device("cpu")
    packed = onednn_usable(cpu, torch.bfloat16)
    if attention_path(cpu, torch.bfloat16) == "cpu kernel":
        if fused_linear_usable(cpu, torch.bfloat16):  # the thin products: row-invariant by construction
            return ANY_ROWS, 0
        return decoder_rows(d_model, d_ffn, n_vocab, torch.bfloat16, packed), 0
    return decoder_blocks(d_model, d_ffn, n_vocab, n_heads, n_text + KEY_SPARE, n_audio, torch.bfloat16, packed)


def auto_choice(device: torch.device, cpu: CpuCapabilities | None = None,
                bf16_blocks: tuple[int, int] | None = None,
                attention_kernel: bool | None = None) -> tuple[str, str]:
    """The precision ``auto`` means and why, decided here only: "float16" on CUDA; on a CPU "bfloat16" where bf16
    products are native (AMX, AVX-512 bf16) and lossless (`bf16_row_block`: a step's and a verify pass's products
    give each row the same bits, so speculative == bf16 greedy token for token and a row's tokens do not depend on
    the batch); on an AVX2 CPU without them `INT8` where the encoder's int8 products run here
    (`engine.int8.int8_encoder_usable`); "float32" otherwise and on other devices (mps, ...). cpu: the
    capabilities (None: this machine's); bf16_blocks: the probe's (rows, queries) (None: measured here when the
    CPU's bf16 is native); attention_kernel: whether the CPU attention kernel runs bf16 attention, query-invariant
    by construction, so that the queries figure does not matter (None: `attention_path` here)."""
    if device.type == "cuda":
        return "float16", "cuda"
    if device.type != "cpu":
        return "float32", device.type
    from asr_spec.engine.int8 import int8_encoder_usable
    from asr_spec.engine.kernels import ANY_ROWS

    caps = detect_cpu() if cpu is None else cpu
    if not caps.native_bf16:
        if caps.cpu_class == "avx2" and int8_encoder_usable(device, torch.float32, asked=True):
            return INT8, "no native bf16 products; the encoder's products in int8, the decoder fp32"
        return "float32", "no native bf16 products"
    rows, queries = bf16_row_block() if bf16_blocks is None else bf16_blocks
    if attention_kernel is None:
        attention_kernel = attention_path(device, torch.bfloat16) == "cpu kernel"
    attention = "the query-invariant attention kernel" if attention_kernel else f"{queries} queries"
    if rows < LOSSLESS_MIN_ROWS or (queries < 1 and not attention_kernel):
        return "float32", (f"bf16 products here give a row the same bits only up to {rows} rows, attention "
                           f"up to {queries} queries: not lossless at batch {LOSSLESS_MIN_ROWS}")
    products = "every product row-invariant by construction" if rows >= ANY_ROWS else f"row-invariant up to {rows} rows"
    return "bfloat16", f"native bf16, {products} and {attention}: lossless"


def dtype_name(dtype: torch.dtype) -> str:
    """A torch dtype's name as precisions, summaries and configs spell it: "float32", "bfloat16"."""
    return str(dtype).removeprefix("torch.")


def torch_dtype(precision: str) -> torch.dtype:
    """The dtype a precision loads its models in: `INT8`'s weights are fp32."""
    return torch.float32 if precision == INT8 else getattr(torch, precision)


def auto_dtype(device: torch.device, cpu: CpuCapabilities | None = None,
               bf16_blocks: tuple[int, int] | None = None) -> torch.dtype:
    """The dtype `auto_choice`'s precision loads its models in."""
    return torch_dtype(auto_choice(device, cpu, bf16_blocks)[0])


def resolve_precision(dtype: str | torch.dtype | None, device: torch.device,
                      cpu: CpuCapabilities | None = None) -> str:
    """The precision a run decodes in (a torch dtype's name, or `INT8`); every caller (CLI, API, server, eval,
    benchmarks) comes through here or `resolve_dtype`. "auto" / None: `auto_choice` (fp16 on CUDA; on a CPU bf16
    where native and lossless, int8 on AVX2, else fp32), logged once with the CPU's class and the reason. cpu: the
    capabilities to decide from (None: this machine's)."""
    if isinstance(dtype, torch.dtype):
        return dtype_name(dtype)
    if dtype in (None, "auto"):
        chosen, why = auto_choice(device, cpu)
        log_decision(device, dtype, chosen, why)
        return chosen
    if dtype not in DTYPES:
        raise InputError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)} or auto")
    return DTYPES[dtype]


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device,
                  cpu: CpuCapabilities | None = None) -> torch.dtype:
    """The dtype a run loads its models in: `resolve_precision`'s (`torch_dtype`)."""
    return torch_dtype(resolve_precision(dtype, device, cpu))


def log_decision(device: torch.device, requested: str | torch.dtype | None, chosen: str, why: str) -> None:
    """The start-of-run line, once per (device, request, choice): "cpu: amx-bf16 (...), dtype auto -> bfloat16
    (native bf16, row-invariant up to 32 rows and the query-invariant attention kernel: lossless)" ("... and 32
    queries" where torch's attention products run instead)."""
    _log_once(device.type, str(requested if requested is not None else "auto"), chosen, why)


@functools.cache
def _log_once(device_type: str, requested: str, chosen: str, why: str) -> None:
    where = f"cpu: {detect_cpu().describe()}" if device_type == "cpu" else device_type
    log.info("%s, dtype %s -> %s (%s)", where, requested, chosen, why)


def attention_path(device: torch.device, dtype: torch.dtype) -> str:
    """Which attention a decoder on `device` in `dtype` runs: "cpu kernel" (`engine.cpu_attention`, its one
    decision) or "torch" (torch's products: CUDA, float16, or the kernel disabled or not built here)."""
    from asr_spec.engine.cpu_attention import fused_attention_usable

    return "cpu kernel" if fused_attention_usable(device, dtype) else "torch"


def encoder_products(device: torch.device, dtype: torch.dtype, int8_asked: bool = False) -> str:
    """The precision of the encoder's linear products: "int8" where `engine.int8.int8_encoder_usable` (its one
    decision: bf16 on an AVX-512 VNNI CPU without AMX; fp32 where the `INT8` precision asked for it: `int8_asked`),
    else the dtype's name."""
    from asr_spec.engine.int8 import int8_encoder_usable

    return INT8 if int8_encoder_usable(device, dtype, int8_asked) else dtype_name(dtype)


def encoder_attention(device: torch.device, dtype: torch.dtype, int8_asked: bool = False) -> str:
    """The precision of the encoder's self-attention products: "int8" where `engine.int8.int8_attention_usable`
    (its one decision: wherever the encoder's linear products are int8, `encoder_products`), else the dtype's
    name."""
    from asr_spec.engine.int8 import int8_attention_usable

    return INT8 if int8_attention_usable(device, dtype, int8_asked) else dtype_name(dtype)


def audio_precision(device: torch.device, dtype: torch.dtype, int8_asked: bool = False) -> str:
    """The dtype the target decoder holds the audio's keys/values in, by name: `engine.int8.audio_dtype`'s (its one
    decision: where the attention kernel runs the decoder's cross-attention, "int8" in a bf16 decoder, "int8" or
    "bfloat16" in the `INT8` precision's fp32 decoder, `int8_asked`; else the dtype's own)."""
    from asr_spec.engine.int8 import audio_dtype

    return dtype_name(audio_dtype(device, dtype, int8_asked))


def decoder_weights(device: torch.device, dtype: torch.dtype, int8_asked: bool = False) -> str:
    """The dtype the target decoder's step reads its weights in: "bfloat16" where `engine.int8.bf16_weights_usable`
    says so (its one decision: the `INT8` precision's fp32 decoder, `int8_asked`, on the thin kernel's products),
    else the dtype's name."""
    from asr_spec.engine.int8 import bf16_weights_usable

    return "bfloat16" if bf16_weights_usable(device, dtype, int8_asked) else dtype_name(dtype)


def run_precision(device: torch.device, dtype: torch.dtype, int8_asked: bool = False) -> dict[str, object]:
    """What a run summary and --json say about the hardware a run decoded on: the device, the dtype (the models'), the
    precision (`INT8` where the run asked for it, `int8_asked`, and its encoder's products run in int8; else the
    dtype's name), and on a CPU its capabilities (`CpuCapabilities.as_dict`), its decoder's attention
    (`attention_path`), its encoder's products (`encoder_products`; `int8_asked`: the model's encoder was marked by
    the `INT8` precision, `engine.int8.requested`), its encoder's attention (`encoder_attention`), its audio
    keys/values (`audio_precision`) and its decoder's weights (`decoder_weights`). In bf16 the row invariance:
    "by_construction" where the kernel extension's products run (then "rows" is None: any number), else the probe's
    rows and queries."""
    from asr_spec.engine.kernels import ANY_ROWS

    info: dict[str, object] = {"device": str(device), "dtype": dtype_name(dtype), "precision": dtype_name(dtype)}
    if device.type == "cpu":
        info["cpu"] = detect_cpu().as_dict()
        info["attention"] = attention_path(device, dtype)
        info["encoder_products"] = encoder_products(device, dtype, int8_asked)
        if int8_asked and info["encoder_products"] == INT8:  # asked, and its defining part runs (the extension)
            info["precision"] = INT8
        info["encoder_attention"] = encoder_attention(device, dtype, int8_asked)
        info["audio_keys_values"] = audio_precision(device, dtype, int8_asked)
        info["decoder_weights"] = decoder_weights(device, dtype, int8_asked)
        if dtype == torch.bfloat16:
            rows, queries = bf16_row_block()
            by_construction = rows >= ANY_ROWS
            info["bf16_row_invariant"] = {"rows": None if by_construction else rows, "queries": queries,
                                          "by_construction": by_construction, "lossless": rows > 0}
    return info


def run_of(transcriber: Any) -> tuple[torch.device, torch.dtype, bool]:
    """(device, dtype, int8_asked) of a loaded `Transcriber`, as `run_precision` and `precision_line` take them:
    its device, its target's dtype, and whether the `INT8` precision marked its encoder (`engine.int8.requested`)."""
    from asr_spec.engine.int8 import requested

    return transcriber.device, transcriber.target.dtype, requested(transcriber.target.model.encoder)


def precision_line(device: torch.device, dtype: torch.dtype, int8_asked: bool = False) -> str:
    """The run summary's words for `run_precision`, read from its dict (each decision asked once, there): "cpu
    amx-bf16, bfloat16, lossless, attention: cpu kernel" / "cuda:0, float16" / "cpu avx2, int8 precision (float32
    arithmetic), attention: cpu kernel, ..." (bf16 on a CPU: "lossless" where its products are row-invariant, else
    "up to near-ties"; on a CPU, the attention path, then ", encoder products int8" where the encoder's products
    are int8 (", encoder products and attention int8" where its attention is too), and ", decoder weights bf16" /
    ", audio keys/values int8" (or bf16) where they are held in another dtype than the run's (", decoder weights and
    audio keys/values bf16" where both are bf16)."""
    return precision_words(run_precision(device, dtype, int8_asked))


def precision_words(info: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> str:
    """`precision_line`'s words from a `run_precision` dict (as a JSON summary keeps it), or from a list of them (a
    Ray run's workers, where they differed), each one's words joined by " | "."""
    if not isinstance(info, Mapping):
        return " | ".join(precision_words(kind) for kind in info)
    if "cpu" not in info:
        return f"{info['device']}, {info['dtype']}"
    precision = f"int8 precision ({info['dtype']} arithmetic)" if info.get("precision") == INT8 else info["dtype"]
    line = f"cpu {info['cpu']['class']}, {precision}"
    if "bf16_row_invariant" in info:
        line += ", lossless" if info["bf16_row_invariant"]["lossless"] else ", up to near-ties"
    line += f", attention: {info['attention']}"
    if info["encoder_products"] == INT8:
        both = info["encoder_attention"] == INT8
        line += ", encoder products and attention int8" if both else ", encoder products int8"
    held = (("decoder weights", "decoder_weights"), ("audio keys/values", "audio_keys_values"))
    for name, short in (("bfloat16", "bf16"), (INT8, "int8")):  # those held in another dtype than the models'
        parts = [part for part, key in held if info[key] == name != info["dtype"]]
        if parts:
            line += f", {' and '.join(parts)} {short}"
    return line


# The classes a CPU run's draft decision is keyed by (`presets.plan_models`): where a verify pass of K+1 tokens
# costs about what a 1-token step does (bf16 on native bf16 products: memory-bound up to several rows, as on a GPU)
# and where it does not (fp32, or bf16 emulated: compute-bound from a few rows on); "int8", the `INT8` precision's
# fp32 decoder over bf16 weights, between them: its verify pass as compute-bound as fp32's, its 1-token step
# cheaper, so the draft pays over fewer rows (docs/cpu.md). A table without "int8" gives it the "fp32" entry.
DECODE_CLASSES = ("amx-bf16", "avx512-bf16", INT8, "fp32")


def decode_class(precision: str | torch.dtype, cpu: CpuCapabilities | None = None) -> str:
    """The decode class of a CPU run in `precision` (`resolve_precision`'s, or a torch dtype): "int8" for the
    `INT8` precision, the CPU's class when it decodes in bf16 on native bf16 products, "fp32" otherwise (fp32, or a
    half precision without native products). cpu: None = this machine's."""
    if precision == INT8:
        return INT8
    dtype = precision if isinstance(precision, torch.dtype) else torch_dtype(precision)
    caps = detect_cpu() if cpu is None else cpu
    return caps.cpu_class if dtype == torch.bfloat16 and caps.native_bf16 else "fp32"


def class_entry(table: Mapping[str, int], run_class: str) -> int | None:
    """A {decode class: value} table's entry for `run_class` (None where it has none); the "int8" class takes the
    "fp32" entry where the table has no "int8" one (its decoder is fp32)."""
    if run_class in table:
        return table[run_class]
    return table.get("fp32") if run_class == INT8 else None
