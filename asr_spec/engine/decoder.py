"""Whisper decoder forward over a ragged KV cache, using the weights of a transformers decoder as they are.

transformers' Whisper decoder keeps one cache length for the whole batch; speculative decoding with per-row
rollback needs each row at its own position. This module runs the same layers (pre-LN self-attention,
cross-attention, MLP, final LayerNorm, tied output head) with every row writing at its own offsets.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from asr_spec.engine.cache import KVCache


def full_vocab_logits(logits: torch.Tensor, vocab_ids: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """The restricted draft head, in one place: `logits` (..., len(vocab_ids)) scored over `vocab_ids` only ->
    (..., vocab_size) with -inf outside them. vocab_ids None: `logits` already cover the whole vocabulary."""
    if vocab_ids is None:
        return logits
    full = logits.new_full((*logits.shape[:-1], vocab_size), float("-inf"))
    return full.index_copy_(-1, vocab_ids, logits)


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear through oneDNN (the kernel inductor's CPU backend calls). (..., d_in) -> (..., d_out)"""
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), weight, bias, "none", [], "")
    return y.view(*x.shape[:-1], weight.shape[0])


def onednn_linear_usable(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the decoder's layer projections go through oneDNN: CPU fp32 with oneDNN built in. Measured on this
    project's CPU (2 threads, weights streamed from memory as in a real step, whisper-base shapes): 1.5-3x faster
    than F.linear (MKL) for 1-8 rows, e.g. 512 -> 2048 at 3 rows 0.26 vs 0.77 ms. Rounding differs from MKL's by
    ~1e-4 relative, as any other kernel's would."""
    if device.type != "cpu" or dtype != torch.float32 or not torch.backends.mkldnn.is_available():
        return False
    try:
        x, w = torch.randn(3, 8), torch.randn(4, 8)
        return torch.allclose(_onednn_linear(x, w, None), F.linear(x, w), atol=1e-5)
    except (RuntimeError, AttributeError):  # an op missing from this build of torch
        return False


class Decoder:
    """A transformers `WhisperDecoder` plus its output projection, run over a `KVCache`.

    Works for the decoder of `WhisperForConditionalGeneration` (target, or draft with its own encoder) and of
    `WhisperForCausalLM` (a distil-whisper style decoder that reads the target's encoder output).
    """

    def __init__(self, decoder: nn.Module, proj_out: nn.Module, vocab_ids: torch.Tensor | None = None):
        self.decoder = decoder
        self.layers = list(decoder.layers)
        first = self.layers[0].self_attn
        self.n_heads: int = first.num_heads
        self.head_dim: int = first.head_dim
        self.d_model: int = first.embed_dim
        self.scaling: float = first.scaling
        self.n_layers: int = len(self.layers)
        self.max_positions: int = decoder.embed_positions.weight.shape[0]
        self.cross_width: int = self.layers[0].encoder_attn.k_proj.in_features
        self.embed = decoder.embed_tokens
        self.pos_table = decoder.embed_positions.weight
        self.vocab_size: int = proj_out.weight.shape[0]
        # A draft may score only a subset of the vocabulary (the output head dominates a small decoder's cost):
        # its logits are scattered into the full vocabulary with -inf elsewhere. The target always scores all.
        self.vocab_ids = vocab_ids
        weight = proj_out.weight if vocab_ids is None else proj_out.weight[vocab_ids]
        # On CPU a step is bound by memory traffic, and two layouts read faster (measured, whisper-base shapes, one
        # thread): the head as a contiguous (d_model, vocab) matrix (x @ W^T: ~20 % faster than F.linear) and the
        # cross-attention keys stored transposed, attended with two matmuls (~2x faster than SDPA for 1-13
        # queries over 1500 keys). On CUDA the fused kernels are used as they are.
        # The output head, measured on this CPU (scripts/bench_engine.py --head): for one row x @ W^T with W^T
        # stored contiguous (d_model, vocab) is fastest; from 2 rows on, W (vocab, d_model) @ x^T is 1.5-2x faster
        # than both x @ W^T and F.linear (MKL runs thin x @ W^T products badly). Both layouts are kept on CPU.
        self.cpu_layout = self.device.type == "cpu"
        self.head_weight = weight
        self.head_weight_t = weight.t().contiguous() if self.cpu_layout else None
        self.linear = _onednn_linear if onednn_linear_usable(self.device, self.dtype) else F.linear

    def _proj(self, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x, layer.weight, layer.bias)

    @property
    def device(self) -> torch.device:
        return self.pos_table.device

    @property
    def dtype(self) -> torch.dtype:
        return self.pos_table.dtype

    def new_cache(self, n_rows: int, n_positions: int, n_audio_ctx: int) -> KVCache:
        return KVCache.empty(
            self.n_layers, n_rows, self.n_heads, self.head_dim, n_positions, n_audio_ctx,
            device=self.device, dtype=self.dtype, cross_k_transposed=self.cpu_layout,
        )

    @torch.inference_mode()
    def stage(self, audio: torch.Tensor, n_positions: int) -> KVCache:
        """A staging cache for R new chunks: their cross-attention keys/values (computed once per chunk) and an
        empty self-attention part of n_positions, to prefill the prompt in before `KVCache.commit` stores it in
        the batch slots. Language detection reads this cache: no copy of the batch's cache is made.

        audio: (R, n_audio_ctx, cross_width) encoder output.
        """
        audio = audio.to(self.dtype)
        r, s, _ = audio.shape
        staged = self.new_cache(r, max(n_positions, 1), s)
        for i, layer in enumerate(self.layers):
            attn = layer.encoder_attn
            k = attn.k_proj(audio).view(r, s, self.n_heads, self.head_dim)
            staged.cross_k[i] = k.permute(0, 2, 3, 1) if self.cpu_layout else k.transpose(1, 2)
            staged.cross_v[i] = attn.v_proj(audio).view(r, s, self.n_heads, self.head_dim).transpose(1, 2)
        return staged

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        """(B, P, d_model) -> (B, P, V') logits, in the layout measured fastest for B * P rows."""
        if not self.cpu_layout:
            return F.linear(x, self.head_weight)
        b, p, d = x.shape
        if b * p == 1:
            return x @ self.head_weight_t
        return (self.head_weight @ x.reshape(b * p, d).t()).t().reshape(b, p, -1)

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)

    @torch.no_grad()  # not inference_mode: inference tensors cannot be traced by torch.compile's AOT backends
    def forward(
        self,
        cache: KVCache,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        n_keys: int,
        logit_index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Feed `tokens` at their positions, write their keys/values into the cache, return logits.

        tokens, positions: (B, T) long. Positions are absolute token indices of each row; entries past a row's
            real input (right padding) may hold any position > the row's last real one: they write into the
            stale area and their outputs are ignored.
        n_keys: attend to cache positions [0, n_keys); must exceed every real position in `positions`.
        logit_index: (B, P) long indices into T of the positions whose logits are needed (None = all T).
        returns: (B, P, vocab) logits in the model dtype (-inf outside a restricted draft vocabulary).
        """
        b, t = tokens.shape
        x = self.embed(tokens) + self.pos_table[positions.clamp(max=self.max_positions - 1)]
        write_pos = positions.clamp(max=cache.n_positions - 1)
        key_pos = torch.arange(n_keys, device=tokens.device)
        mask = (key_pos[None, None, None, :] <= positions[:, None, :, None])  # (B, 1, T, n_keys)
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = layer.self_attn_layer_norm(x)
            q = self._split_heads(self._proj(attn.q_proj, h))
            k, v = self._proj(attn.k_proj, h), self._proj(attn.v_proj, h)
            cache.write_self(i, self._split_heads(k), self._split_heads(v), write_pos)
            out = F.scaled_dot_product_attention(
                q, cache.self_k[i, :, :, :n_keys], cache.self_v[i, :, :, :n_keys], attn_mask=mask, scale=self.scaling
            )
            x = x + self._proj(attn.out_proj, out.transpose(1, 2).reshape(b, t, self.d_model))

            xattn = layer.encoder_attn
            h = layer.encoder_attn_layer_norm(x)
            q = self._split_heads(self._proj(xattn.q_proj, h))
            if self.cpu_layout:
                out = torch.softmax((q * self.scaling) @ cache.cross_k[i], dim=-1) @ cache.cross_v[i]
            else:
                out = F.scaled_dot_product_attention(q, cache.cross_k[i], cache.cross_v[i], scale=self.scaling)
            x = x + self._proj(xattn.out_proj, out.transpose(1, 2).reshape(b, t, self.d_model))

            h = layer.final_layer_norm(x)
            x = x + self._proj(layer.fc2, layer.activation_fn(self._proj(layer.fc1, h)))
        if logit_index is not None:
            x = x.gather(1, logit_index[:, :, None].expand(-1, -1, self.d_model))
        x = self.decoder.layer_norm(x)
        return full_vocab_logits(self._head(x), self.vocab_ids, self.vocab_size)

    def step_ms(self, n_rows: int, n_audio_ctx: int, repeats: int = 20) -> float:
        """Milliseconds of one single-token step at `n_rows` rows, position 40, cross-attention over `n_audio_ctx`
        frames of random keys/values, after 3 warm-up steps. Host clock, no device sync: for CPU benchmarks."""
        import time

        cache = self.new_cache(n_rows, 64, n_audio_ctx)
        cache.cross_k.normal_()
        cache.cross_v.normal_()
        tokens = torch.zeros(n_rows, 1, dtype=torch.long, device=self.device)
        positions = torch.full((n_rows, 1), 40, device=self.device)
        for _ in range(3):
            self.forward(cache, tokens, positions, 41)
        start = time.perf_counter()
        for _ in range(repeats):
            self.forward(cache, tokens, positions, 41)
        return (time.perf_counter() - start) / repeats * 1e3
