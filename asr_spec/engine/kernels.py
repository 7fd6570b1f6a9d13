"""CPU fp32 matrix products through oneDNN, the kernels the decoder step and the encoder use on CPU.

Measured on this project's CPU (AMD EPYC, 2 threads; `benchmarks/bench_engine.py --steps`): MKL runs the thin
products of a decode step (1-32 rows against a weight streamed from memory) at 5-17 GB/s, and the encoder's
(4,500 rows) at ~180 GFLOP/s with a separate pass to broadcast the bias; oneDNN with weights reordered once into
its blocked layout (`pack`) reads 1.4-2x faster at 2-32 rows, and on plain weights runs the encoder's products
~10 % faster, bias and GELU fused. Rounding differs from MKL's by ~1e-6 relative, as any other kernel's would.

Packed copies are made once per weight tensor (`shared`): any number of decoders over the same model (a greedy
engine beside a speculative one, a benchmark's configurations) read the same copies, and a weight modified in
place gets a fresh copy the next time one is asked for.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Hashable
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

T = TypeVar("T")

# first source tensor -> {(recipe, the other sources' ids): (weak refs to the other sources, versions, value)};
# an entry lives as long as all its sources (values never refer to their sources, so nothing keeps them alive)
_SHARED: WeakIdKeyDictionary = WeakIdKeyDictionary()

# oneDNN post-ops, by the name of a transformers activation: erf GELU ("gelu") fuses into the product
POST_OPS = {"gelu": ("gelu", "none")}


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, post: str = "none",
                  algorithm: str = "") -> torch.Tensor:
    """F.linear (then the post-op, e.g. "gelu" with algorithm "none" = erf) through oneDNN; `weight` plain or
    `pack`ed. (..., d_in) -> (..., d_out)"""
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), weight, bias, post, [], algorithm)
    return y.view(*x.shape[:-1], weight.shape[0])


def shared(recipe: Hashable, sources: tuple[torch.Tensor, ...], make: Callable[[], T]) -> T:
    """`make()`, a copy derived from the `sources` tensors by `recipe`, made once and then shared: the same object
    for every caller asking with the same recipe and the same tensors (not equal ones: the tensors themselves),
    for as long as the sources live, until a source is modified in place (its `_version` moves on).

    make: must not return (or hold) a source itself, else the entry would keep it alive. Inference tensors keep
    no version counter: for them the copy is made afresh.
    """
    if any(s.is_inference() for s in sources):
        return make()
    first, others = sources[0], sources[1:]
    entries = _SHARED.setdefault(first, {})
    key = (recipe, tuple(id(s) for s in others))
    versions = tuple(s._version for s in sources)
    hit = entries.get(key)
    if hit is not None:
        refs, made_at, value = hit
        if made_at == versions and all(ref() is s for ref, s in zip(refs, others)):
            return value
    value = make()
    entries[key] = (tuple(weakref.ref(s, _forget(entries, key)) for s in others), versions, value)
    return value


def _forget(entries: dict, key: Hashable) -> Callable[[weakref.ref], None]:
    """A weak reference's callback dropping an entry once one of its other sources is gone."""

    def callback(_: weakref.ref) -> None:
        entries.pop(key, None)

    return callback


def reorder(weight: torch.Tensor) -> torch.Tensor:
    """The packing itself (see `pack`), unshared: for a copy derived from several tensors, made through `shared`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 32)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """A (d_out, d_in) weight reordered once into oneDNN's blocked layout (an opaque mkldnn tensor, valid for
    `onednn_linear` at any number of rows), shared per weight tensor (`shared`). The layout hint of 32 rows measured
    best for 1-32 rows (whisper-base shapes, weights streamed from memory): 512 x 512 at 3 rows 54 vs 77 us
    unpacked, 2048 x 512 157 vs 247 us, the 51865 x 512 head at 32 rows 8.7 vs 16.6 ms (MKL, W @ x^T). From 2 rows
    on, values equal the unpacked kernel's."""
    return shared("pack", (weight,), functools.partial(reorder, weight))


def fused_qkv(attn: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """One packed (3 * d_model, d_model) weight and its bias for an attention's q, k and v projections (k has no
    bias in Whisper): one product instead of three, 147 vs 190 us at 3 rows for whisper-base's 512 x 512. Shared
    per set of projection tensors."""
    projs = (attn.q_proj, attn.k_proj, attn.v_proj)

    def make() -> tuple[torch.Tensor, torch.Tensor]:
        bias = [p.bias if p.bias is not None else torch.zeros_like(p.weight[:, 0]) for p in projs]
        return reorder(torch.cat([p.weight for p in projs])), torch.cat(bias).detach()

    return shared("fused-qkv", _tensors(projs), make)


def scaled(proj: nn.Linear, scale: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A projection's packed weight and bias multiplied by `scale` (attention's 1/sqrt(head_dim) folded into the
    query projection: one op less a layer; the same values up to rounding). Shared per projection and scale."""

    def make() -> tuple[torch.Tensor, torch.Tensor | None]:
        bias = None if proj.bias is None else (proj.bias * scale).detach()
        return reorder(proj.weight * scale), bias

    return shared(("scaled", scale), _tensors([proj]), make)


def _tensors(projs) -> tuple[torch.Tensor, ...]:
    """The weights and biases (those that exist) of linear layers, in order: the sources of a copy made of them."""
    return tuple(t for p in projs for t in (p.weight, p.bias) if t is not None)


@functools.cache
def onednn_usable(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether products go through oneDNN: CPU fp32, or bf16 where the CPU has native bf16 instructions, with
    oneDNN built in and its linear ops present (probed once per device and dtype, not by every decoder built)."""
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16) or not torch.backends.mkldnn.is_available():
        return False
    try:
        if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return False  # emulated bf16 products are slower than fp32 ones
        x, w = torch.randn(3, 8, dtype=dtype), torch.randn(4, 8, dtype=dtype)
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        return torch.allclose(onednn_linear(x, pack(w), None).float(), F.linear(x.float(), w.float()), atol=tol,
                              rtol=tol)
    except (RuntimeError, AttributeError):  # an op missing from this build of torch
        return False
