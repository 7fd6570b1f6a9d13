"""Thin fp32 and bf16 products on CPU through the kernel extension (`cpu_linear.h`, built with the attention kernel by
`cpu_attention`): the decoder's step and verify products, x W^T + b (+ a residual), with W packed once into panels
of output columns, and the one decision whether a decoder uses them (`fused_linear_usable`).

Why: on an AVX2-only AMD EPYC (2 cores, 17.6 GB/s) oneDNN's packed fp32 products at the step's 8 rows ran at 2-3.4x
their bytes-read floor (the MLP 9.7 ms against 2.9, the head 12.8 against 6.1); the kernel streams each weight
once a call (docs/cpu.md, "Thin fp32 products"). And they are row-invariant by construction: each output is the
same fused multiply-adds in the same order whatever the number of rows, so an fp32 (K+1)-token verify pass gives
every position the products a 1-token step gives it. In bf16 the same holds (weights in k pairs, summed by
AVX-512-BF16's vdpbf16ps where the CPU has it): on an AVX-512-BF16 EPYC, whose oneDNN bf16 products give a row the
same bits only up to 4 rows, that is what makes bf16 decoding lossless (docs/cpu.md, "Thin bf16 products").
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from asr_spec.engine import cpu_attention
from asr_spec.engine.kernels import shared

__all__ = ["PANEL_DTYPES", "Panels", "fused_linear_usable", "linear", "pack_panels", "pack_panels_bf16", "packers"]

# the dtypes the kernel's panels come in
PANEL_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class Panels:
    """A (N, K) weight packed for the kernel: fp32 data (P, K, NB), bf16 data (P, ceil(K / 2), NB, 2) (k in pairs),
    P = ceil(N / NB) panels of NB output columns (zeros past N and past an odd K). `shape` is the weight's own, as
    callers of a linear's weight read it."""

    data: torch.Tensor
    n_out: int
    n_in: int

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.n_out, self.n_in))


def fused_linear_usable(device: torch.device, dtype: torch.dtype) -> bool:
    """The one decision: whether a decoder on `device` in `dtype` runs its step products through the kernel
    (a CPU, float32 or bfloat16, the extension built here and not disabled: `cpu_attention.fused_attention_usable`),
    bfloat16 except on a CPU with AMX tiles (`cpu_attention.amx_tiles`): there oneDNN's bf16
    products, row-invariant up to 32 rows by the probe, run a batch-8 verify pass of 32 rows for about a 1-row
    step's cost (the measured speculative gain on the AMX Xeon), which the kernel's AVX-512 dot products, compute-
    bound at 32 rows, cannot; the thin bf16 products were measured on an AVX-512-BF16 EPYC only."""
    if dtype == torch.bfloat16 and cpu_attention.amx_tiles():
        return False
    return dtype in PANEL_DTYPES and cpu_attention.fused_attention_usable(device, dtype)


def panel_columns() -> int:
    """NB: output columns a panel, two vectors of the instruction set the extension was built for."""
    return int(cpu_attention.extension().panel_columns())


def panels_of(weight: torch.Tensor, nb: int) -> torch.Tensor:
    """(N, K) -> (ceil(N / nb), K, nb): column n of the weight's transpose in panel n // nb, lane n % nb, zeros
    past N. Pure (no kernel): the layout `linear` reads."""
    n, k = weight.shape
    count = -(-n // nb)
    padded = weight.new_zeros(count * nb, k)
    padded[:n] = weight
    return padded.view(count, nb, k).transpose(1, 2).contiguous()


def pair_panels_of(weight: torch.Tensor, nb: int) -> torch.Tensor:
    """(N, K) -> (ceil(N / nb), ceil(K / 2), nb, 2): `panels_of` with k in pairs side by side (element [p, i, c, e]
    is W[p * nb + c, 2 i + e]), zeros past N and past an odd K. Pure: the bf16 layout `linear` reads."""
    n, k = weight.shape
    even = weight if k % 2 == 0 else torch.cat([weight, weight.new_zeros(n, 1)], dim=1)
    panels = panels_of(even, nb)
    return panels.view(panels.shape[0], -1, 2, nb).transpose(2, 3).contiguous()


def repack(weight: torch.Tensor) -> Panels:
    """The packing itself, unshared (for a copy derived from several tensors, made through `kernels.shared`): a
    bf16 weight in bf16 pairs, any other in fp32."""
    w = weight.detach()
    if w.dtype == torch.bfloat16:
        return Panels(pair_panels_of(w, panel_columns()), *w.shape)
    return Panels(panels_of(w.float(), panel_columns()), *w.shape)


def pack_panels(weight: torch.Tensor) -> Panels:
    """`repack(weight)`, made once per weight tensor and shared (`kernels.shared`)."""
    return shared("panels", (weight,), functools.partial(repack, weight))


def repack_bf16(weight: torch.Tensor) -> Panels:
    """`repack` of the weight rounded to bf16 (bf16 pairs under fp32 rows: `linear` of an fp32 x widens each
    weight exactly), unshared."""
    return repack(weight.detach().bfloat16())


def pack_panels_bf16(weight: torch.Tensor) -> Panels:
    """`repack_bf16(weight)`, made once per weight tensor and shared (`kernels.shared`)."""
    return shared("panels-bf16", (weight,), functools.partial(repack_bf16, weight))


def packers(bf16: bool) -> tuple[Callable[[torch.Tensor], Panels], Callable[[torch.Tensor], Panels]]:
    """(pack, repack) for a decoder's thin products: `pack_panels` / `repack`, or their bf16 copies where `bf16`
    (`int8.bf16_weights_usable`): the shared packing of a weight tensor, and the unshared one of a tensor derived
    from several (`kernels.shared` keys the latter by it)."""
    return (pack_panels_bf16, repack_bf16) if bf16 else (pack_panels, repack)


def linear(x: torch.Tensor, weight: Panels, bias: torch.Tensor | None, post: str = "none",
           algorithm: str = "") -> torch.Tensor:
    """F.linear through the kernel with its post-op; the signature of `kernels.onednn_linear`. "gelu" with
    algorithm "none" (erf GELU, Whisper's) runs in the product's epilogue (`gelu_erf`: in fp32, before the one
    rounding to x's dtype); the tanh form after it, through torch. x in the panels' dtype (fp32 or bf16), or fp32
    over bf16 panels; bias in x's dtype. (..., K) -> (..., N)"""
    if post not in ("none", "gelu"):
        raise ValueError(f"post-op {post!r} is not one the thin products run")
    fused = post == "gelu" and algorithm != "tanh"
    y = _run()(_rows(x), weight.data, bias, None, weight.n_out, fused)
    if post == "gelu" and not fused:
        y = F.gelu(y, approximate="tanh")
    return y.view(*x.shape[:-1], weight.n_out)


def linear_add(x: torch.Tensor, weight: Panels, bias: torch.Tensor | None, residual: torch.Tensor) -> torch.Tensor:
    """`residual + F.linear(x, weight, bias)` in one kernel call (the add in the product's epilogue, in fp32 before
    the one rounding). x: (..., K); residual: (..., N), same leading shape -> (..., N)"""
    flat = residual.reshape(-1, weight.n_out)
    y = _run()(_rows(x), weight.data, bias, flat, weight.n_out, False)
    return y.view(residual.shape)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """(..., K) as the kernel's (M, K) with K contiguous (rows may be apart: a slice of a wider output is read in
    place)."""
    flat = x.reshape(-1, x.shape[-1])
    return flat if flat.stride(-1) == 1 else flat.contiguous()


def _run():
    """The kernel's entry: traced (torch.compile), the custom op below, opaque to the tracer; eager, the
    extension's function itself (no dispatcher round trip, ~20 calls a pass)."""
    return _linear_op if torch.compiler.is_compiling() else cpu_attention.extension().linear


@torch.library.custom_op("asr_spec::cpu_linear", mutates_args=())
def _linear_op(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None,
               n_out: int, gelu: bool) -> torch.Tensor:
    """The kernel as a torch op: x (M, K), panels (P, K, NB), bias (N,) or None, residual (M, N) or None, gelu
    (the erf GELU in the epilogue) -> (M, N)."""
    return cpu_attention.extension().linear(x, panels, bias, residual, n_out, gelu)


@_linear_op.register_fake
def _(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None,
      n_out: int, gelu: bool) -> torch.Tensor:
    return x.new_empty((x.shape[0], n_out))
