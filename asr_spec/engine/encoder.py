"""The Whisper encoder run once per batch of chunks: transformers' `WhisperEncoder` weights, on CPU fp32 (and bf16
where oneDNN has bf16 products: `kernels.onednn_usable`) through oneDNN, elsewhere the module itself.

On the oneDNN path every product is a oneDNN linear: in bf16 the two convolutions as products over their taps
(`conv_rows`: time-major rows, a strided view of the padded input that oneDNN copies into an im2col matrix of
kernel x the input, 37 MB at 8 windows of whisper-base; bias and GELU fused), q/k/v/out and the MLP with bias
and GELU fused, and each residual add fused into the product that feeds it (`onednn_linear_add`). The hidden state
stays (N, n_audio_ctx, d_model) contiguous from the stem on: the module's `conv(...).permute(0, 2, 1)` layout,
carried through the layers, made every residual add, LayerNorm and product input pay a strided pass or a copy.
Attention in bf16 runs through the CPU kernel extension where it is built (`cpu_attention.encoder_attention`: the
thin products' loops around a vectorised softmax, 2.5x torch's flash attention on an AVX-512-BF16 EPYC), elsewhere
`F.scaled_dot_product_attention` (the CPU flash kernel): explicit q k^T / softmax / p v products through torch in
blocks of queries measured 3.5-4x slower at whisper-base's shapes in bf16, the softmax over 1,500 keys dominating.
On a bf16 run of an AVX-512 VNNI CPU without AMX, and in the "int8" precision (fp32 weights: `auto` on an AVX2-only
CPU), the four linear products of each layer run in int8 instead (`engine/int8.py`: rows quantized by their own
maximum, one decision, `int8.int8_encoder_usable`), and the attention through the kernel's int8 products with them
(`cpu_attention.encoder_attention_int8`, `int8.int8_attention_usable`).
Stage times and their share of the matmul rate: `python -m benchmarks.bench_encoder` (docs/cpu.md, "Encoder").
Weights are used as they are, except, in bf16, the convolutions' (d_out, d_in, 3) reordered once into
(d_out, 3 * d_in) (shared per weight tensor: 1.8 MB for whisper-base).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from asr_spec.engine import cpu_attention, int8
from asr_spec.engine.kernels import POST_OPS, onednn_linear, onednn_linear_add, onednn_usable, shared


def tap_major(weight: torch.Tensor) -> torch.Tensor:
    """A Conv1d weight (d_out, d_in, kernel) as a linear weight (d_out, kernel * d_in) over rows that hold the
    kernel's input frames one after another (tap-major, as `conv_rows` reads them). Shared per weight tensor."""
    return shared("tap-major", (weight,), lambda: weight.detach().permute(0, 2, 1).reshape(weight.shape[0], -1)
                  .contiguous())


def conv_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride: int, padding: int,
              post: tuple[str, str] = ("none", "")) -> torch.Tensor:
    """Conv1d over time as one oneDNN product, time-major in and out: (N, T, d_in) -> (N, T_out, d_out) with
    T_out = (T + 2 * padding - kernel) // stride + 1, then the post-op (e.g. ("gelu", "none"): erf GELU).

    weight: `tap_major(conv.weight)`, (d_out, kernel * d_in). The input is zero-padded in time (and at the end to a
    multiple of `stride` frames); output frame t of window n reads the `kernel * d_in` consecutive values from
    padded frame t * stride on, so the rows of all windows are one strided matrix over the padded input (row
    n * T_pad / stride + t; the rows past T_out, which straddle two windows, are computed and dropped), which
    oneDNN's linear copies into a contiguous (rows, kernel * d_in) matrix before its product.
    (N, T_out, d_out), a view of a (N, T_pad / stride, d_out) product."""
    n, t, d_in = x.shape
    kernel = weight.shape[1] // d_in
    t_pad = t + 2 * padding
    t_pad += -t_pad % stride
    t_out = (t + 2 * padding - kernel) // stride + 1
    # `kernel` spare frames at the end: every window's last rows, dropped, stay inside the buffer
    buffer = x.new_empty(n * t_pad + kernel, d_in)
    padded = buffer[:n * t_pad].view(n, t_pad, d_in)
    padded[:, :padding].zero_()
    padded[:, padding + t:].zero_()
    buffer[n * t_pad:].zero_()
    padded[:, padding:padding + t] = x
    per_window = t_pad // stride
    rows = buffer.as_strided((n * per_window, kernel * d_in), (stride * d_in, 1))
    return onednn_linear(rows, weight, bias, *post).view(n, per_window, -1)[:, :t_out]


class Encoder:
    """Callable: (N, n_mels, 2 * n_audio_ctx) log-mel features -> (N, n_audio_ctx, d_model) encoder output.

    encoder: a transformers `WhisperEncoder` in eval mode. The oneDNN path computes the same layers as its
    forward (conv1, conv2, positions, pre-LN self-attention and MLP blocks, final LayerNorm), one method a stage
    (`stem`, `attention`, `mlp`: what `benchmarks.bench_encoder` times).
    """

    def __init__(self, encoder: nn.Module):
        self.module = encoder
        first = encoder.conv1.weight
        self.fast = (first.dtype in (torch.float32, torch.bfloat16) and onednn_usable(first.device, first.dtype)
                     and not encoder.training)
        if not self.fast:
            return
        attn = encoder.layers[0].self_attn
        self.n_heads, self.head_dim, self.scaling = attn.num_heads, attn.head_dim, attn.scaling
        self.post = POST_OPS.get(encoder.config.activation_function)
        # self-attention through the CPU kernel extension where it is built, in bf16 (`cpu_attention`)
        self.kernel_attention = cpu_attention.encoder_attention_usable(first.device, first.dtype)
        # the convolutions as products in bf16 (3x faster than oneDNN's bf16 convolution with its layout copies,
        # whisper-base, batch 4), the module's convolutions in fp32 (5-10 % faster there than the products)
        self.conv_products = first.dtype == torch.bfloat16
        # the layers' linear products in int8 where `int8.int8_encoder_usable` says so (engine/int8.py: bf16 with
        # AVX-512 VNNI around the kernel's attention; fp32 where the module was marked by the "int8" precision)
        self.int8 = int8.int8_encoder_usable(first.device, first.dtype, int8.requested(encoder))
        self.int8_levels = int8.levels()  # 8-bit activations; 8-bit weights with VNNI, 7-bit without
        # and its self-attention through the kernel's int8 products (`int8.int8_attention_usable`)
        self.int8_attention = int8.int8_attention_usable(first.device, first.dtype, int8.requested(encoder))

    @torch.inference_mode()
    def __call__(self, features: torch.Tensor) -> torch.Tensor:
        enc = self.module
        if not self.fast:
            return enc(input_features=features).last_hidden_state
        x = self.stem(features)
        for layer in enc.layers:
            x = self.attention(layer, x)
            x = self.mlp(layer, x)
        return enc.layer_norm(x)

    def stem(self, features: torch.Tensor) -> torch.Tensor:
        """conv1, GELU, conv2 (stride 2), GELU, plus the positions: (N, n_mels, 2 * n_audio_ctx) ->
        (N, n_audio_ctx, d_model), contiguous."""
        enc = self.module
        expected = enc.config.max_source_positions * enc.conv1.stride[0] * enc.conv2.stride[0]
        if features.shape[-1] != expected:
            raise ValueError(f"the encoder expects {expected} mel frames, got {features.shape[-1]}")
        # each window alone, in either dtype: a window's stem never depends on the batch it is encoded in (the
        # module's fp32 convolution of a batch rounded with it at some shapes, 3e-6 on a tiny model, which an int8
        # encoder's row quantizer can turn into a step; oneDNN's bf16 product may pick its kernel by the number of
        # rows), and it was faster: 8 whisper-base windows alone 0.20-0.24 s against 0.28-0.32 batched in fp32,
        # 72 against 90 ms in bf16 (the Zen 4 EPYC, 2 threads; even at 1 and 3 windows)
        positions = enc.embed_positions.weight
        out = positions.new_empty(features.shape[0], *positions.shape)  # contiguous, the model's dtype
        for window, into in zip(features, out):
            torch.add(self._window_stem(window[None])[0], positions, out=into)
        return out

    def _window_stem(self, window: torch.Tensor) -> torch.Tensor:
        """conv1, GELU, conv2, GELU of one window: (1, n_mels, 2 * n_audio_ctx) -> (1, n_audio_ctx, d_model), as
        products in bf16 (`conv_products`), else the module's convolutions."""
        enc = self.module
        if not self.conv_products:
            return F.gelu(enc.conv2(F.gelu(enc.conv1(window)))).transpose(1, 2)
        x = window.transpose(1, 2)
        for conv in (enc.conv1, enc.conv2):
            x = conv_rows(x, tap_major(conv.weight), conv.bias, conv.stride[0], conv.padding[0], ("gelu", "none"))
        return x

    def attention(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """x + self-attention(LayerNorm(x)), the residual add fused into the output projection.
        (N, S, d_model) -> (N, S, d_model)"""
        attn = layer.self_attn
        h = layer.self_attn_layer_norm(x)
        if self.int8:
            out = self.attend(*self._int8(h, attn.q_proj, attn.k_proj, attn.v_proj).split(x.shape[-1], -1))
            return self._int8(out, attn.out_proj, residual=x)
        out = self.attend(*(onednn_linear(h, p.weight, p.bias) for p in (attn.q_proj, attn.k_proj, attn.v_proj)))
        return onednn_linear_add(out, attn.out_proj.weight, attn.out_proj.bias, x)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """softmax(scale q k^T) v per window and head: the kernel's int8 products where `int8_attention`, its
        bf16 products where `kernel_attention`, else SDPA.
        q, k, v: (N, S, d_model), the last dimension contiguous -> (N, S, d_model) contiguous"""
        if self.int8_attention:
            return cpu_attention.encoder_attention_int8(q, k, v, self.n_heads, self.scaling)
        if self.kernel_attention:
            return cpu_attention.encoder_attention(q, k, v, self.n_heads, self.scaling)
        n, s, d = q.shape
        q, k, v = (t.view(n, s, self.n_heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v, scale=self.scaling).transpose(1, 2).reshape(n, s, d)

    def _int8(self, x: torch.Tensor, *layers: nn.Linear, post: str = "none",
              residual: torch.Tensor | None = None) -> torch.Tensor:
        """`int8.int8_linear` of x through the layers' weights stacked (one product), at this encoder's levels.
        (N, S, d_in) -> (N, S, sum of the layers' d_out)"""
        weight = int8.int8_weight(*layers, levels=self.int8_levels.weights)
        return int8.int8_linear(x, weight, self.int8_levels.activations, post, residual)

    def mlp(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """x + fc2(act(fc1(LayerNorm(x)))): GELU fused into fc1 where oneDNN has it, the residual add into fc2.
        (N, S, d_model) -> (N, S, d_model)"""
        h = layer.final_layer_norm(x)
        if self.int8 and self.post == ("gelu", "none"):
            return self._int8(self._int8(h, layer.fc1, post="gelu"), layer.fc2, residual=x)
        if self.post is not None:
            h = onednn_linear(h, layer.fc1.weight, layer.fc1.bias, *self.post)
        else:
            h = layer.activation_fn(onednn_linear(h, layer.fc1.weight, layer.fc1.bias))
        return onednn_linear_add(h, layer.fc2.weight, layer.fc2.bias, x)
