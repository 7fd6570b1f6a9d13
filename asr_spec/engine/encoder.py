"""The Whisper encoder run once per batch of chunks: transformers' `WhisperEncoder` weights, on CPU fp32 (and bf16
where oneDNN has bf16 products: `kernels.onednn_usable`) through oneDNN (bias and GELU fused into the products),
elsewhere the module itself. Measured on this project's CPU, 2
threads, 3 chunks of whisper-base: 1.50 s against 1.93 s for the module (MKL's `addmm` also copies each bias into
its output first). The weights are used as they are: packed or fused copies (as the decoder step holds) measured
no faster at 4,500 rows, so the encoder costs no memory beyond the model's."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from asr_spec.engine.kernels import POST_OPS, onednn_linear, onednn_usable


class Encoder:
    """Callable: (N, n_mels, 2 * n_audio_ctx) log-mel features -> (N, n_audio_ctx, d_model) encoder output.

    encoder: a transformers `WhisperEncoder` in eval mode. The oneDNN path computes the same layers as its
    forward (conv1, conv2, positions, pre-LN self-attention and MLP blocks, final LayerNorm).
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

    @torch.inference_mode()
    def __call__(self, features: torch.Tensor) -> torch.Tensor:
        enc = self.module
        if not self.fast:
            return enc(input_features=features).last_hidden_state
        expected = enc.config.max_source_positions * enc.conv1.stride[0] * enc.conv2.stride[0]
        if features.shape[-1] != expected:
            raise ValueError(f"the encoder expects {expected} mel frames, got {features.shape[-1]}")
        x = F.gelu(enc.conv2(F.gelu(enc.conv1(features)))).permute(0, 2, 1) + enc.embed_positions.weight
        n, s, d = x.shape
        for layer in enc.layers:
            attn = layer.self_attn
            h = layer.self_attn_layer_norm(x)
            q, k, v = (onednn_linear(h, p.weight, p.bias).view(n, s, self.n_heads, self.head_dim).transpose(1, 2)
                       for p in (attn.q_proj, attn.k_proj, attn.v_proj))
            out = F.scaled_dot_product_attention(q, k, v, scale=self.scaling)
            x = x + onednn_linear(out.transpose(1, 2).reshape(n, s, d), attn.out_proj.weight, attn.out_proj.bias)
            h = layer.final_layer_norm(x)
            if self.post is not None:
                h = onednn_linear(h, layer.fc1.weight, layer.fc1.bias, *self.post)
            else:
                h = layer.activation_fn(onednn_linear(h, layer.fc1.weight, layer.fc1.bias))
            x = x + onednn_linear(h, layer.fc2.weight, layer.fc2.bias)
        return enc.layer_norm(x)
