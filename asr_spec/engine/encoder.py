"""The Whisper encoder run once per batch of chunks: transformers' `WhisperEncoder` weights, on CPU fp32 through
oneDNN (packed weights; q, k, v fused into one product; bias and GELU fused into theirs), elsewhere the module
itself. Measured on this project's CPU, 2 threads, 3 chunks of whisper-base: see `kernels`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from asr_spec.engine.kernels import POST_OPS, fused_qkv, onednn_linear, onednn_usable, pack


class Encoder:
    """Callable: (N, n_mels, 2 * n_audio_ctx) log-mel features -> (N, n_audio_ctx, d_model) encoder output.

    encoder: a transformers `WhisperEncoder` in eval mode. The oneDNN path computes the same layers as its
    forward (conv1, conv2, positions, pre-LN self-attention and MLP blocks, final LayerNorm) with packed copies of
    the weights taken here: it reads the module's weights as they were when built.
    """

    def __init__(self, encoder: nn.Module):
        self.module = encoder
        first = encoder.conv1.weight
        self.fast = onednn_usable(first.device, first.dtype) and not encoder.training
        if not self.fast:
            return
        attn = encoder.layers[0].self_attn
        self.n_heads, self.head_dim, self.scaling = attn.num_heads, attn.head_dim, attn.scaling
        self.post = POST_OPS.get(encoder.config.activation_function)
        self.layers = [(layer, fused_qkv(layer.self_attn), pack(layer.self_attn.out_proj.weight),
                        pack(layer.fc1.weight), pack(layer.fc2.weight)) for layer in encoder.layers]

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
        for layer, (w_qkv, b_qkv), w_out, w_fc1, w_fc2 in self.layers:
            h = layer.self_attn_layer_norm(x)
            qkv = onednn_linear(h, w_qkv, b_qkv).view(n, s, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
            out = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], scale=self.scaling)
            x = x + onednn_linear(out.transpose(1, 2).reshape(n, s, d), w_out, layer.self_attn.out_proj.bias)
            h = layer.final_layer_norm(x)
            if self.post is not None:
                h = onednn_linear(h, w_fc1, layer.fc1.bias, *self.post)
            else:
                h = layer.activation_fn(onednn_linear(h, w_fc1, layer.fc1.bias))
            x = x + onednn_linear(h, w_fc2, layer.fc2.bias)
        return enc.layer_norm(x)
