"""The encoder's linear products in int8, and the one decision where (`int8_encoder_usable`): in bf16 on CPUs with
AVX-512 VNNI but no AMX, and in fp32 where the run's precision is "int8" (`models.cpu`: `auto` on an AVX2-only CPU,
or `--dtype int8`), which the loader marks on the encoder module (`request`).

Why: on such a CPU (an AMD EPYC with AVX-512-BF16, 2 cores) the bf16 encoder was half of a long file's wall time,
its products at ~300 GFLOP/s, about oneDNN's bf16 rate there; oneDNN's u8 x s8 products (vpdpbusd) run the same
shapes at 400-630 GOP/s with bf16 output. Measured end to end and for WER in docs/cpu.md ("The encoder's products
in int8").

What is quantized: the four products of every encoder layer (q/k/v as one, the attention's output projection, fc1
then GELU, fc2); not the convolutions, not the decoder; the attention itself through its own int8 products wherever
the linear products are int8 (`int8_attention_usable`). (The int8 precision's fp32
decoders, target and draft, hold the audio's keys and values in int8: `audio_dtype`.) Weights per output
channel, symmetric int8 (scale = max |w| / 127 of the channel; 63 steps on AVX2: `levels`), made once per weight
tensor. Activations per row
(each position of each window: `cpu_int8.h`, max |x| / 127, an asymmetric uint8 with zero point 128), the product's
output in bf16 then scaled by its row's scale, the bias and residual added (`cpu_int8.h`'s `rescale_rows`, one
pass): per-row scales keep the encoder output ~5 % from fp32's (relative norm, long_75s) where one scale a window
left ~20 % (Whisper's activations have outliers ~15x their RMS). A row's output depends on that row alone (the
integer sums are exact, the rest per element), so a window's encoder output does not depend on the windows encoded
with it, and the target and its draft read the same encoder output (speculative == greedy, as in every precision).

On an AVX2-only CPU (an AMD EPYC, 2 cores, sixteenth session) the same products in fp32: oneDNN's u8 x s8 kernels
ran whisper-base's encoder products of 8 windows 1.88x faster than the fastest fp32 product (2.0 against 3.75 s,
`python -m benchmarks.bench_int8 --threads 2 --encoder-batches 8`, the "qlinear kernel only" path). Without VNNI
the weights are 7-bit (`levels`: AVX2 sums a pair of u8 x s8 products in int16 with saturation; the sixteenth
session had the activations 7-bit instead, less accurate), the product's output fp32, the epilogue in fp32. q/k/v
in int8 too since the seventeenth session (with 8-bit activations the encoder output stays closer to fp32's than
the sixteenth session's with q/k/v fp32).

Shapes: x (N windows, S positions, d_in) -> (N, S, d_out), both in the model's dtype (bf16 or fp32).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from asr_spec.engine import cpu_attention, cpu_linear
from asr_spec.engine.kernels import shared

DISABLE_ENV = "ASR_SPEC_NO_INT8_ENCODER"
ATTENTION_ENV = "ASR_SPEC_NO_INT8_ATTENTION"  # an int8 encoder attends in its dtype (SDPA / the bf16 kernel)
AUDIO_ENV = "ASR_SPEC_NO_BF16_AUDIO"  # the int8 precision's decoder keeps its audio keys/values fp32
INT8_AUDIO_ENV = "ASR_SPEC_NO_INT8_AUDIO"  # ... in bf16 instead of int8
WEIGHTS_ENV = "ASR_SPEC_NO_BF16_WEIGHTS"  # the int8 precision's decoder keeps its step's weights fp32
LEVELS = 127  # 8-bit steps on each side of zero (activations; weights where the CPU has VNNI: `levels`)
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


def int8_attention_usable(device: torch.device, dtype: torch.dtype, asked: bool = False) -> bool:
    """The one decision: whether an encoder's self-attention runs through the kernel's int8 products
    (`cpu_int8_attention.h`: q per query, k per key, v per channel, the softmax numerators in 8 bits, all around
    an fp32 softmax): wherever its linear products are int8 (`int8_encoder_usable`: the "int8" precision's fp32
    encoder, `asked`; a bf16 encoder on an AVX-512 VNNI CPU without AMX), unless `ASR_SPEC_NO_INT8_ATTENTION=1`.
    Why: on an AVX2-only EPYC (2 cores) the int8 precision's fp32 attention (torch's flash kernel) was ~45 % of its
    encoder once its products were int8 (docs/cpu.md, "The int8 encoder's attention"); the same words as fp32
    attention on the long fixtures. On an AVX-512-BF16 EPYC with VNNI (2 cores) the bf16 kernel's attention was
    about half of the bf16 encoder whose products were int8, and the int8 kernel (8-bit keys and values there:
    vpdpbusd) attends in 11.2 against 14.6 ms a window's layer, with the same words as the bf16 attention on the
    long fixtures (docs/cpu.md, "The bf16 encoder's attention in int8 with VNNI")."""
    return not cpu_attention.switched_on(ATTENTION_ENV) and int8_encoder_usable(device, dtype, asked)


def audio_dtype(device: torch.device, dtype: torch.dtype, asked: bool = False) -> torch.dtype:
    """The one decision: the dtype a decoder holds the audio's keys and values in (its cross-attention cache, written
    once a chunk), where the CPU attention kernel runs its cross-attention (`cpu_attention.fused_attention_usable`:
    the kernel widens each key and value to fp32 as it loads it, its arithmetic fp32's; torch's products would not
    take them); elsewhere the decoder's own dtype. Target and draft alike:
    - a bf16 decoder: int8 with a scale a channel (`quantize_channels`; its queries widened to fp32 for them, the
      output rounded once to bf16), or bf16 where `ASR_SPEC_NO_INT8_AUDIO=1`;
    - an fp32 decoder of the "int8" precision (`asked`, as `requested` says of the target's encoder): int8, or bf16
      where `ASR_SPEC_NO_INT8_AUDIO=1`, or fp32 where `ASR_SPEC_NO_BF16_AUDIO=1`;
    - any other: its own dtype.
    Why: a step reads every row's audio keys/values once a layer, the most of its bytes: at batch 8 a greedy step of
    whisper-base reads 147 MB of them in bf16, 295 MB in fp32. On an AVX2-only EPYC (2 cores) the int8 precision's
    fp32 cross-attention took 10 of its 23 ms, 7.3 in bf16 (docs/cpu.md, "The int8 precision again"), and in int8
    (74 MB) the 6 layers' cross-attention of 8 rows 3.7 against 4.7-5.2 ms in bf16, the steps of three long files
    1.11x faster, the same words and WER (docs/cpu.md, "The int8 precision's audio keys/values in int8"). On an
    AVX-512-BF16 EPYC (Zen 4, 2 cores) the bf16 decoder's 6 layers' cross-attention of 8 rows 2.76 against 5.45 ms
    at 1 query a row, 5.42 against 6.67 at 4 (docs/cpu.md, "The bf16 decoder's audio keys and values in int8")."""
    if not cpu_attention.fused_attention_usable(device, dtype):  # a CPU among its conditions
        return dtype
    if dtype == torch.bfloat16 or (asked and dtype == torch.float32 and not cpu_attention.switched_on(AUDIO_ENV)):
        return torch.bfloat16 if cpu_attention.switched_on(INT8_AUDIO_ENV) else torch.int8
    return dtype


def quantize_channels(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., C, S) fp32 or bf16 -> (int8 (..., C, S), fp32 scales (..., C)): each channel's S values (an audio key's or
    value's head_dim element over a chunk's positions) in `LEVELS` steps a side of zero, scale = max |x| / LEVELS
    (1 where all are 0), rounded to nearest even (`cpu_int8.h`'s rows, their zero point taken off)."""
    shape = x.shape
    q, scales = quantize(x.reshape(-1, shape[-1]), LEVELS)  # uint8 with zero point LEVELS + 1 = 128
    return q.bitwise_xor_(128).view(torch.int8).view(shape), scales.view(shape[:-1])  # in place: less 128


def bf16_weights_usable(device: torch.device, dtype: torch.dtype, asked: bool = False) -> bool:
    """The one decision: whether a decoder's step products read bf16 copies of its weights (q/k/v, the attention
    output projections, the cross-attention query, fc1, fc2 and the output head) under its fp32 rows and
    arithmetic (`cpu_linear.h`'s `MixedPanels`: each weight widened exactly, fp32 multiply-adds). In the "int8"
    precision (`asked`; target and draft alike), for an fp32 decoder whose step products run through the thin
    kernel (`cpu_linear.fused_linear_usable`), unless `ASR_SPEC_NO_BF16_WEIGHTS=1`. The head is then read in bf16
    as it is, not certified: the precision's decisions are its own (lossless means speculative == its greedy).
    Why: a step reads its weights once a pass; whisper-base's are 88 MB in fp32 and its head 106 MB, and on an
    AVX2-only EPYC (2 cores) the products of a step's layers and head took 3.34 + 2.75 ms at 8 rows against 4.79 +
    4.34 in fp32, 1.61 + 1.46 against 3.26 + 3.24 at 1 row (docs/cpu.md, "The int8 precision's decoder weights
    in bf16")."""
    return (asked and dtype == torch.float32 and not cpu_attention.switched_on(WEIGHTS_ENV)
            and cpu_linear.fused_linear_usable(device, dtype))


@dataclass(frozen=True)
class Levels:
    """The steps on each side of zero of a product's activations (their zero point is one more: `cpu_int8.h`)
    and of its weights."""

    activations: int
    weights: int


def levels() -> Levels:
    """The one decision of the products' levels: 8-bit activations and weights where the CPU has VNNI (exact
    u8 x s8 dot products); elsewhere 8-bit activations and 7-bit weights, since AVX2 sums a pair of u8 x s8
    products in int16 with saturation (2 * 255 * 63 fits, 2 * 255 * 127 does not). Of the two ways to fit, the
    activations keep their 8 bits: quantized per row they carry the outliers (~15x a row's RMS), the weights per
    channel do not. whisper-base's encoder output, 6 windows of long_75s, against fp32's (relative norm): 4.9 %
    with 8-bit activations and 7-bit weights, 6.7 % the other way round (the sixteenth session's choice); per
    product 1.5-2.5 % against 1.9-4.1 % (docs/cpu.md, "The int8 precision again")."""
    flags = cpu_attention.cpu_flags().split()
    return Levels(LEVELS, LEVELS if "avx512_vnni" in flags or "avx_vnni" in flags else 63)


def _onednn_int8() -> bool:
    """Whether this torch has oneDNN's int8 linear (the ops Inductor's x86 quantisation lowers to)."""
    try:
        return hasattr(torch.ops.onednn, "qlinear_pointwise") and hasattr(torch.ops.onednn, "qlinear_prepack")
    except (AttributeError, RuntimeError):
        return False


class Int8Weight:
    """One linear layer's weight (d_out, d_in) as oneDNN's packed int8 with its per-channel scales (fp32), in
    `levels` steps on each side of zero (`Levels.weights`), and the layer's bias in fp32 (zeros without one)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, levels: int = LEVELS):
        w = weight.detach().float()
        self.scales = (w.abs().amax(1) / levels).clamp(min=torch.finfo(torch.float32).tiny)
        quantized = torch.round(w / self.scales[:, None]).clamp(-levels, levels).to(torch.int8)
        self.packed = torch.ops.onednn.qlinear_prepack(quantized, None)
        self.zero_points = torch.zeros(len(self.scales), dtype=torch.int64)
        self.bias = torch.zeros(weight.shape[0]) if bias is None else bias.detach().float().contiguous()
        self.d_out = weight.shape[0]


def int8_weight(*layers: torch.nn.Linear, levels: int = LEVELS) -> Int8Weight:
    """The layers' weights stacked along the output (q, k, v as one product), quantized once in `levels` steps a
    side and shared per weight tensors and levels (`kernels.shared`)."""
    weights = tuple(layer.weight for layer in layers)
    biases = [layer.bias for layer in layers]

    def make() -> Int8Weight:  # a layer without a bias (Whisper's k_proj) adds zeros
        bias = None if all(b is None for b in biases) else torch.cat(
            [w.new_zeros(w.shape[0]) if b is None else b.detach() for w, b in zip(weights, biases)])
        return Int8Weight(torch.cat([w.detach() for w in weights]), bias, levels)

    return shared(("int8", len(weights), levels), weights, make)


def quantize(x: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., K) activations -> (uint8 (M, K), fp32 scales (M,)), M the rows, one scale a row, `levels` steps on each
    side of the zero point levels + 1 (`cpu_int8.h`)."""
    return cpu_attention.extension().quantize_rows(x.reshape(-1, x.shape[-1]).contiguous(), levels)


def int8_linear(x: torch.Tensor, weight: Int8Weight, levels: int, post: str = "none",
                residual: torch.Tensor | None = None) -> torch.Tensor:
    """(residual +) post(x W^T + b) with x quantized per row in `levels` steps a side (`quantize`; the encoder
    asks `levels()` once) and W per channel (`Int8Weight`): x (N, S, d_in) bf16 or fp32 -> (N, S, d_out)
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
