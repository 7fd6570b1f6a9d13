"""A decoder's layers in one call into the kernel extension (`cpu_decoder.h`), and the one decision whether a
decoder runs them so (`layer_loop`).

Where a decoder's attention runs through the few-query kernel (`cpu_attention`) and its products through the thin
kernel (`cpu_linear`) or oneDNN over packed weights (in row-invariant pieces: bf16 on a CPU with AMX tiles), a layer
is ~20 small calls from Python (three LayerNorms, five products, the cache writes' index views, two attention
calls): ~150 us a layer on two cores whatever the widths, ~1 ms of a 6-layer step of 12-15 ms. The extension's
`decoder_layers` runs the same kernels in the same order from C++: its output and the cache it writes are the
Python loop's, bit for bit (tests/test_cpu_layers.py), in one call a pass.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from asr_spec.engine import cpu_attention, cpu_linear
from asr_spec.engine.cache import KVCache
from asr_spec.engine.kernels import POST_OPS, onednn_linear

# `Decoder` (engine/decoder.py) builds its `LayerLoop` here: it is named in annotations, not imported (no cycle)
Decoder = Any

__all__ = ["LayerLoop", "layer_loop"]


def layer_loop(dec: Decoder) -> LayerLoop | None:
    """The one decision: a decoder runs its layers in one extension call where its attention is the kernel's
    (`fused`), its products the thin kernel's (`thin`) or oneDNN's over packed weights (`wide_linear` is
    `onednn_linear`: a bf16 decoder on a CPU with AMX tiles, or where the thin products are off), with q/k/v fused
    and the cross-attention q scaled in them, its activation the erf GELU the products' epilogue applies, and every
    LayerNorm affine; None elsewhere (the decoder's Python layer loop)."""
    products = dec.thin or dec.wide_linear is onednn_linear
    if not (dec.fused and products and dec.qkv is not None and dec.cross_q is not None
            and dec.post == POST_OPS["gelu"]):
        return None
    norms = [norm for layer in dec.layers
             for norm in (layer.self_attn_layer_norm, layer.encoder_attn_layer_norm, layer.final_layer_norm)]
    if not all(isinstance(norm, nn.LayerNorm) and norm.weight is not None and norm.bias is not None
               for norm in norms):
        return None
    return LayerLoop(dec)


def _tensor(t: torch.Tensor | None) -> torch.Tensor:
    """An operand as the extension takes it: detached, an absent bias as an empty tensor."""
    return torch.empty(0) if t is None else t.detach()


def _weight(w: cpu_linear.Panels | torch.Tensor) -> torch.Tensor:
    """A product's weight as the extension takes it: the thin kernel's panels' data, or oneDNN's packed tensor."""
    return w.data if isinstance(w, cpu_linear.Panels) else w


class LayerLoop:
    """The operands of `decoder_layers` for one decoder, gathered once: per layer its three LayerNorms, the fused
    q/k/v, self-attention out, cross-attention q (scaled), cross-attention out, fc1 and fc2 weights and biases (the
    decoder's own packed copies, `Decoder._step_weights`: the thin kernel's panels or oneDNN's packed tensors),
    their output widths, the LayerNorms' epsilons and how the products run (`rows`)."""

    def __init__(self, dec: Decoder):
        self.n_heads = dec.n_heads
        # the products: -1 the thin kernel's; else oneDNN's in pieces of the decoder's row-invariant rows (0: whole)
        self.rows = -1 if dec.thin else dec.row_rows
        self.weights: list[torch.Tensor] = []
        self.n_out: list[int] = []
        self.eps: list[float] = []
        def own(proj: nn.Linear) -> tuple[object, torch.Tensor | None]:
            return dec.weights[proj], proj.bias  # the decoder's packed copy of a projection, and its bias

        for i, layer in enumerate(dec.layers):
            blocks = ((layer.self_attn_layer_norm, (dec.qkv[i], own(layer.self_attn.out_proj))),
                      (layer.encoder_attn_layer_norm, (dec.cross_q[i], own(layer.encoder_attn.out_proj))),
                      (layer.final_layer_norm, (own(layer.fc1), own(layer.fc2))))
            for norm, products in blocks:  # a block: its LayerNorm, then its two products
                self.weights += [_tensor(norm.weight), _tensor(norm.bias)]
                for weight, bias in products:
                    self.weights += [_weight(weight), _tensor(bias)]
                    self.n_out.append(weight.shape[0])
                self.eps.append(norm.eps)

    def __call__(self, x: torch.Tensor, cache: KVCache, write_pos: torch.Tensor, n_seen: torch.Tensor
                 ) -> torch.Tensor:
        """(B, T, d_model) inputs through every layer over `cache` (its B rows), writing this pass's keys/values
        at `write_pos` ((B, T) long, clamped to the cache); n_seen: (B, T) int32, each query's self-attention key
        count (`Decoder.pass_keys`) -> (B, T, d_model) before the final LayerNorm."""
        return cpu_attention.extension().decoder_layers(
            x.contiguous(), self.weights, self.n_out, self.eps, cache.self_k, cache.self_v, cache.cross_k,
            cache.cross_v, *cache.audio_scales, write_pos, n_seen, self.n_heads, self.rows)
