"""The encoder's linear products in int8, and the one decision where (`int8_encoder_usable`): in bf16 on CPUs with
AVX-512 VNNI but no AMX, and in fp32 where the run's precision is "int8" (`models.cpu`: `auto` on an AVX2-only CPU,
or `--dtype int8`), which the loader marks on the encoder module (`request`).

Why: on such a CPU (an AMD EPYC with AVX-512-BF16, 2 cores) the bf16 encoder was half of a long file's wall time,
its products at ~300 GFLOP/s, about oneDNN's bf16 rate there; oneDNN's u8 x s8 products (vpdpbusd) run the same
shapes at 400-630 GOP/s with bf16 output. Measured end to end and for WER in docs/cpu.md ("The encoder's products
in int8").

What is quantized: the four products of every encoder layer (q/k/v as one, the attention's output projection,
fc1 then GELU, fc2); not the convolutions, not the attention itself (bf16), not the decoder. Weights per output
channel, symmetric int8 (scale = max |w| / 127 of the channel), made once per weight tensor. Activations per row
(each position of each window: `cpu_int8.h`, max |x| / 127, an asymmetric uint8 with zero point 128), the
product's output in bf16 then scaled by its row's scale, the bias and residual added (`cpu_int8.h`'s
`rescale_rows`, one pass): per-row scales keep the encoder output ~5 % from fp32's (relative norm, long_75s) where
one scale a window left ~20 % (Whisper's activations have outliers ~15x their RMS). A row's output depends on that
row alone (the integer sums are exact, the rest per element), so a window's encoder output does not depend on the
windows encoded with it, and the target and its draft read the same encoder output (speculative == greedy, as in
every precision).

On an AVX2-only CPU (an AMD EPYC, 2 cores, sixteenth session) the same products in fp32: oneDNN's u8 x s8 kernels
ran whisper-base's encoder products of 8 windows 1.88x faster than the fastest fp32 product (2.0 against 3.75 s,
`python -m benchmarks.bench_int8 --threads 2 --encoder-batches 8`, the "qlinear kernel only" path). Without VNNI
the activations are 7-bit (`activation_levels`: AVX2 sums a pair of u8 x s8 products in int16 with saturation),
the product's output fp32, the epilogue in fp32.

Shapes: x (N windows, S positions, d_in) -> (N, S, d_out), both in the model's dtype (bf16 or fp32).
"""

from __future__ import annotations

import torch
from torch import nn

from asr_spec.engine import cpu_attention
from asr_spec.engine.kernels import shared

DISABLE_ENV = "ASR_SPEC_NO_INT8_ENCODER"
LEVELS = 127  # the weights' int8 steps on each side of zero
REQUEST = "asr_spec_int8_products"  # the attribute `request` sets on an encoder module


def request(encoder: nn.Module) -> nn.Module:
    """Mark an fp32 encoder module as asking for int8 products (the "int8" precision; the loader calls it); whether
    they run is still `int8_encoder_usable`'s decision. Returns the module."""
    setattr(encoder, REQUEST, True)
    return encoder


def requested(encoder: nn.Module) -> bool:
    """Whether `request` marked this encoder module."""
    return bool(getattr(encoder, REQUEST, False))


def int8_encoder_usable(device: torch.device, dtype: torch.dtype, asked: bool = False) -> bool:
    """The one decision: whether an encoder on `device` in `dtype` runs its linear products in int8. Never where
    `ASR_SPEC_NO_INT8_ENCODER=1` switches it off or this torch lacks oneDNN's int8 linear. In bf16: where its
    attention runs through the kernel extension (`cpu_attention.encoder_attention_usable`: a CPU, the extension
    built here, no AMX tiles, whose own int8 and bf16 tiles were not measured against this) and the CPU has
    AVX-512 VNNI. In fp32: where the run asked for it (`asked`: the "int8" precision, `requested`) on a CPU with
    the extension built (its row quantizer and epilogue)."""
    if cpu_attention.switched_on(DISABLE_ENV) or not _onednn_int8():
        return False
    if dtype == torch.float32:
        return asked and cpu_attention.fused_attention_usable(device, dtype)
    return ("avx512_vnni" in cpu_attention.cpu_flags().split()
            and cpu_attention.encoder_attention_usable(device, dtype))


def activation_levels() -> int:
    """The activations' steps on each side of zero: 127 where the CPU has VNNI (exact u8 x s8 dot products), 63
    elsewhere (AVX2 sums a pair of u8 x s8 products in int16 with saturation: 2 * 127 * 127 fits, 2 * 255 * 127
    does not). The zero point is one more (`cpu_int8.h`)."""
    flags = cpu_attention.cpu_flags().split()
    return LEVELS if "avx512_vnni" in flags or "avx_vnni" in flags else 63


def _onednn_int8() -> bool:
    """Whether this torch has oneDNN's int8 linear (the ops Inductor's x86 quantisation lowers to)."""
    try:
        return hasattr(torch.ops.onednn, "qlinear_pointwise") and hasattr(torch.ops.onednn, "qlinear_prepack")
    except (AttributeError, RuntimeError):
        return False


class Int8Weight:
    """One linear layer's weight (d_out, d_in) as oneDNN's packed int8 with its per-channel scales (fp32), and the
    layer's bias in fp32 (zeros without one)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        w = weight.detach().float()
        self.scales = (w.abs().amax(1) / LEVELS).clamp(min=torch.finfo(torch.float32).tiny)
        quantized = torch.round(w / self.scales[:, None]).clamp(-LEVELS, LEVELS).to(torch.int8)
        self.packed = torch.ops.onednn.qlinear_prepack(quantized, None)
        self.zero_points = torch.zeros(len(self.scales), dtype=torch.int64)
        self.bias = torch.zeros(weight.shape[0]) if bias is None else bias.detach().float().contiguous()
        self.d_out = weight.shape[0]


def int8_weight(*layers: torch.nn.Linear) -> Int8Weight:
    """The layers' weights stacked along the output (q, k, v as one product), quantized once and shared per weight
    tensors (`kernels.shared`)."""
    weights = tuple(layer.weight for layer in layers)
    biases = [layer.bias for layer in layers]

    def make() -> Int8Weight:  # a layer without a bias (Whisper's k_proj) adds zeros
        bias = None if all(b is None for b in biases) else torch.cat(
            [w.new_zeros(w.shape[0]) if b is None else b.detach() for w, b in zip(weights, biases)])
        return Int8Weight(torch.cat([w.detach() for w in weights]), bias)

    return shared(("int8", len(weights)), weights, make)


def int8_qkv(levels: int) -> bool:
    """Whether an int8 encoder's q/k/v product is int8 too: only with 8-bit activations (`levels`, from
    `activation_levels`; the
    bf16 path on AVX-512 VNNI, as measured in the eighth session). With AVX2's 7-bit ones q/k/v stay in the
    model's dtype: whisper-base's encoder output came 6.8 % from fp32's instead of 8.3 % (relative norm, 6 windows
    of long_75s), the int8 q/k/v product gained only 1.4x (102 against 145 ms a layer of 8 windows, quantizer and
    epilogue included: 0.26 s an 8-window call), and the prompt fixture's third name was spelled as prompted
    again ("Kaitlynn", "Kaitlyn" with q/k/v int8)."""
    return levels == LEVELS


def quantize(x: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., K) activations -> (uint8 (M, K), fp32 scales (M,)), M the rows, one scale a row, `levels` steps on each
    side of the zero point levels + 1 (`cpu_int8.h`)."""
    return cpu_attention.extension().quantize_rows(x.reshape(-1, x.shape[-1]).contiguous(), levels)


def int8_linear(x: torch.Tensor, weight: Int8Weight, levels: int, post: str = "none",
                residual: torch.Tensor | None = None) -> torch.Tensor:
    """(residual +) post(x W^T + b) with x quantized per row in `levels` steps a side (`quantize`; the encoder
    asks `activation_levels` once) and W per channel (`Int8Weight`): x (N, S, d_in) bf16 or fp32 -> (N, S, d_out)
    in x's dtype; post "none" or "gelu" (erf); residual (N, S, d_out) in x's dtype, or None (not with "gelu")."""
    if post not in ("none", "gelu") or (post == "gelu" and residual is not None):
        raise ValueError(f"int8_linear: post {post!r} (with a residual: {residual is not None}) is not supported")
    q, scales = quantize(x, levels)
    # sum_k (q - zero point) w_q * w_scale in x's dtype; the row's scale, the bias and the residual or the GELU
    # after, in one pass
    raw = torch.ops.onednn.qlinear_pointwise(q, 1.0, levels + 1, weight.packed, weight.scales, weight.zero_points,
                                             None, 1.0, 0, x.dtype, "none", [], "")
    flat = None if residual is None else residual.reshape(-1, weight.d_out).contiguous()
    y = cpu_attention.extension().rescale_rows(raw, scales, weight.bias, flat, post == "gelu")
    return y.view(*x.shape[:-1], weight.d_out)
