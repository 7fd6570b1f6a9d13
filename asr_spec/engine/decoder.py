"""Whisper decoder forward over a ragged KV cache, using the weights of a transformers decoder as they are.

transformers' Whisper decoder keeps one cache length for the whole batch; speculative decoding with per-row
rollback needs each row at its own position. This module runs the same layers (pre-LN self-attention,
cross-attention, MLP, final LayerNorm, tied output head) with every row writing at its own offsets.
"""

from __future__ import annotations

import copy
import functools

import torch
import torch.nn.functional as F
from torch import nn

from asr_spec.engine import cpu_attention, cpu_layers, cpu_linear
from asr_spec.engine.cache import KVCache
from asr_spec.engine.decoder_layout import DecoderLayout
from asr_spec.engine.kernels import (
    attention,
    blocked,
    mask_bias,
    onednn_linear,
    onednn_usable,
    shared,
)

# Positions past max_positions that every row-invariant pass reads (`Decoder.key_count`), and that its caches hold
# at least (`Decoder.new_cache`): room for a pass's writes past the last position (the scheduler's K + 2: up to
# K = 14 the cache is exactly key_count positions, read in place); greedy and speculative engines read the same
# number of keys, so their passes round alike
KEY_SPARE = 16


def full_vocab_logits(logits: torch.Tensor, vocab_ids: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """The restricted draft head, in one place: `logits` (..., len(vocab_ids)) scored over `vocab_ids` only ->
    (..., vocab_size) with -inf outside them. vocab_ids None: `logits` already cover the whole vocabulary."""
    if vocab_ids is None:
        return logits
    full = logits.new_full((*logits.shape[:-1], vocab_size), float("-inf"))
    return full.index_copy_(-1, vocab_ids, logits)


def bf16_copy(draft: nn.Module) -> tuple[nn.Module, nn.Module]:
    """A draft's decoder and output projection copied into bf16 (the model itself, and a target whose tensors it
    shares, are left as they are): a draft's precision changes only its proposals, never the output. One copy per
    draft (`kernels.shared`), whatever the number of engines using it, and so one set of its packed weights."""
    modules = (draft.model.decoder, draft.proj_out)

    def make() -> tuple[nn.Module, nn.Module]:
        decoder, proj_out = copy.deepcopy(modules)  # one copy: a tied head stays tied
        return decoder.to(torch.bfloat16), proj_out.to(torch.bfloat16)

    # the draft's own layers first: the entry is kept by its first source (the embeddings may be the target's)
    sources = (*draft.model.decoder.layers.parameters(), *(p for module in modules for p in module.parameters()))
    return shared("bf16-copy", sources, make)


def _layer_norm(norm: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    """`norm(x)` without the module call's overhead (~20 LayerNorms a step)."""
    return F.layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps)


class Decoder(DecoderLayout):
    """A transformers `WhisperDecoder` plus its output projection, run over a `KVCache`.

    Works for the decoder of `WhisperForConditionalGeneration` (target, or draft with its own encoder) and of
    `WhisperForCausalLM` (a distil-whisper style decoder that reads the target's encoder output).
    """

    def __init__(self, decoder: nn.Module, proj_out: nn.Module, vocab_ids: torch.Tensor | None = None,
                 certify: tuple[int, tuple[int, ...]] | None = None, *,
                 int8_precision: bool = False):
        """certify: (exact_from, protected) of a target whose head may be certified (`head.CertifiedHead`: read in
        bf16 where `head.approximate_product` names a product, Whisper's rules taking fp32's decisions).
        int8_precision: the run's precision is "int8" (`int8.requested` of the target's encoder): its fp32 decoders'
        audio keys/values are then held as `int8.audio_dtype` says (`audio_dtype`; a bf16 decoder's int8 in every
        precision), and the step's weights read in bf16 where `int8.bf16_weights_usable` says so (`bf16_weights`)."""
        self.decoder = decoder
        self.layers = list(decoder.layers)
        first = self.layers[0].self_attn
        self.n_heads: int = first.num_heads
        self.head_dim: int = first.head_dim
        self.d_model: int = first.embed_dim
        self.scaling: float = first.scaling
        self.n_layers: int = len(self.layers)
        self.max_positions: int = decoder.embed_positions.weight.shape[0]
        self.embed = decoder.embed_tokens
        self.pos_table = decoder.embed_positions.weight
        self.vocab_size: int = proj_out.weight.shape[0]
        # A draft may score only a subset of the vocabulary (the output head dominates a small decoder's cost):
        # its logits are scattered into the full vocabulary with -inf elsewhere. The target always scores all.
        self.vocab_ids = vocab_ids
        # On CPU a step is bound by memory traffic; measured on this project's CPU (whisper-base shapes, weights and
        # caches streamed from memory as in a real step):
        # - the cross-attention keys stored transposed (head_dim, n_audio_ctx), attended with two matrix products
        #   (~2x faster than SDPA for 1-13 queries over 1500 keys);
        # - CPU fp32 with oneDNN: the step's projections and the head through oneDNN with their weights reordered
        #   once into its blocked layout (`kernels.pack`; q, k, v fused into one product): 1.4-2x faster than MKL's
        #   layouts at 2-32 rows. The packed copies are taken here, shared with every other Decoder over the same
        #   tensors (`kernels.shared`): a Decoder reads its module's weights as they were when it was built;
        # - otherwise (CPU bf16/fp16) the head as a contiguous (d_model, vocab) matrix for one row (x @ W^T) and
        #   W (vocab, d_model) @ x^T from 2 rows on (MKL runs thin x @ W^T products badly).
        # On CUDA the fused kernels are used as they are.
        self.cpu_layout = self.device.type == "cpu"
        # CPU attention through the few-query kernel where it is built (`cpu_attention`: invariant by construction,
        # per-query key counts instead of buckets and masks; the layouts `new_cache` says)
        self.fused = cpu_attention.fused_attention_usable(self.device, self.dtype)
        self.audio_dtype = self._audio_dtype(int8_precision)
        # CPU fp32 / bf16: the step's products through the thin kernel where it is built (`cpu_linear`: each weight
        # read once a call, row-invariant by construction); the audio's keys/values (1,500 rows a chunk) stay oneDNN's
        self.thin = cpu_linear.fused_linear_usable(self.device, self.dtype)
        packed = onednn_usable(self.device, self.dtype)
        self.linear = self.wide_linear = onednn_linear if packed else F.linear
        # CPU bf16/fp16: every product of a pass gives each row what a 1-row step gives it (`row_invariance`), so
        # a (K+1)-token verify pass scores each position exactly as greedy's 1-token step does (lossless speculation),
        # and a draft's q, which a sampled row's draw reads, is the same whatever the batch (a draft run whole on
        # AMX rounded its >32-row prefill otherwise: docs/cpu.md, "Sampled windows (temperature fallback)")
        n_vocab = proj_out.weight.shape[0] if vocab_ids is None else len(vocab_ids)
        self.key_count = self.max_positions + KEY_SPARE
        self.row_rows, self.query_rows = self.row_invariance(n_vocab, packed)
        if self.thin:
            self.linear = cpu_linear.linear
        elif self.row_rows:
            self.linear = functools.partial(blocked, self.wide_linear, self.row_rows)
        self.values_t, self.key_buckets = self._attention_layout()
        self.keys_t = self._audio_keys_transposed()
        self._step_weights(packed, int8_precision)
        self._head_layout(proj_out.weight, vocab_ids, packed or self.thin, certify)
        self.layer_loop = cpu_layers.layer_loop(self)  # every layer of a pass in one extension call, or None

    def _proj(self, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x, self.weights[layer], layer.bias)

    def _proj_add(self, layer: nn.Linear, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x + layer(h), a block's output on its residual: with the thin products one kernel call (the add in the
        product's epilogue, rounded once), else the product and an add."""
        if self.thin:
            return cpu_linear.linear_add(h, self.weights[layer], layer.bias, x)
        return x + self._proj(layer, h)

    def _head(self, x: torch.Tensor, exact: bool = False) -> torch.Tensor:
        """(B, P, d_model) -> (B, P, V') logits, in the layout measured fastest for B * P rows. With a certified
        head: decisions-exact logits in an eager step, all of them in fp32 when `exact` or traced."""
        if self.certified is not None:
            b, p, d = x.shape
            flat = x.reshape(b * p, d)
            exact = exact or torch.compiler.is_compiling()
            return (self.certified.exact(flat) if exact else self.certified(flat)).view(b, p, -1)
        if self.head_packed is not None:
            return self.linear(x, self.head_packed, None)
        if self.row_rows:  # blocked
            return self.linear(x, self.head_weight, None)
        if not self.cpu_layout:
            return F.linear(x, self.head_weight)
        b, p, d = x.shape
        if b * p == 1:
            return x @ self.head_weight_t
        return (self.head_weight @ x.reshape(b * p, d).t()).t().reshape(b, p, -1)

    def _self_attention(self, i: int, layer: nn.Module, x: torch.Tensor, cache: KVCache, write_pos: torch.Tensor,
                        mask: torch.Tensor, n_keys: int) -> torch.Tensor:
        """x + self-attention block i over the cache, after writing this pass's keys/values. x: (B, T, d_model)"""
        b, t, _ = x.shape
        attn = layer.self_attn
        h = _layer_norm(layer.self_attn_layer_norm, x)
        if self.qkv is not None:  # packed, q scaled by 1/sqrt(head_dim) already
            q, k, v = self.linear(h, *self.qkv[i]).split(self.d_model, dim=-1)
            scale = 1.0
        else:
            q, k, v = self._proj(attn.q_proj, h), self._proj(attn.k_proj, h), self._proj(attn.v_proj, h)
            scale = self.scaling
        cache.write_self(i, self._split_heads(k), self._split_heads(v), write_pos)
        if self.fused:  # `mask`: each query's key count (`pass_keys`)
            out = cpu_attention.attend(q.view(b, t, self.n_heads, self.head_dim), cache.self_k[i], cache.self_v[i],
                                       mask, scale)
            return self._proj_add(attn.out_proj, out, x)
        keys, values = cache.self_k[i, :, :, :n_keys], cache.self_v[i, :, :, :n_keys]
        if self.query_rows:  # over a probed bucket of keys (`pass_keys`), in pieces of `query_rows` queries:
            # keys^T (B, H, head_dim, n_keys) and values (stored as `new_cache` chose) read in place where n_keys
            # is all the cache's positions, else copied by the products (~2x a product's time)
            q = self._split_heads(q) if scale == 1.0 else self._split_heads(q) * scale
            out = self._attend(q, keys.transpose(-1, -2), values, mask)
        else:
            out = F.scaled_dot_product_attention(self._split_heads(q), keys, values, attn_mask=mask, scale=scale)
        return self._proj_add(attn.out_proj, out.transpose(1, 2).reshape(b, t, self.d_model), x)

    def _cross_attention(self, i: int, layer: nn.Module, x: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """x + cross-attention block i over the cached audio keys/values. x: (B, T, d_model)"""
        b, t, _ = x.shape
        xattn = layer.encoder_attn
        h = _layer_norm(layer.encoder_attn_layer_norm, x)
        if self.fused:  # every query over all audio keys, q scaled in the kernel unless packed (scaled already)
            q, scale = ((self.linear(h, *self.cross_q[i]), 1.0) if self.cross_q is not None
                        else (self._proj(xattn.q_proj, h), self.scaling))
            out = cpu_attention.attend(q.view(b, t, self.n_heads, self.head_dim), cache.cross_k[i], cache.cross_v[i],
                                       None, scale, *cache.layer_audio_scales(i))  # scales: int8 audio only
            return self._proj_add(xattn.out_proj, out, x)
        if self.cross_q is not None:  # packed, scaled by 1/sqrt(head_dim) already
            q = self._split_heads(self.linear(h, *self.cross_q[i]))
        else:
            q = self._split_heads(self._proj(xattn.q_proj, h)) * self.scaling
        if self.cpu_layout:
            out = self._attend(q, cache.cross_k[i].transpose(-1, -2), cache.cross_v[i])
        else:
            out = F.scaled_dot_product_attention(q, cache.cross_k[i], cache.cross_v[i], scale=1.0)
        return self._proj_add(xattn.out_proj, out.transpose(1, 2).reshape(b, t, self.d_model), x)

    def _attend(self, q: torch.Tensor, keys_t: torch.Tensor, values: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """`kernels.attention` in pieces of `query_rows` queries (all at once where that is 0), a lone query's
        scores from several copies where row-invariant (as `query_block` probed it). Shapes as there."""
        return attention(q, keys_t, values, mask, self.query_rows, lone=bool(self.query_rows))

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
        exact: bool = False,
        full_vocab: bool = True,
    ) -> torch.Tensor:
        """Feed `tokens` at their positions, write their keys/values into the cache, return logits.

        tokens, positions: (B, T) long. Positions are absolute token indices of each row; entries past a row's
            real input (right padding) may hold any position > the row's last real one: they write into the
            stale area and their outputs are ignored.
        n_keys: attend to cache positions [0, n_keys); must exceed every real position in `positions`.
        logit_index: (B, P) long indices into T of the positions whose logits are needed (None = all T).
        exact: every logit in fp32 even with a certified head (whose other values are only decisions-exact).
        full_vocab: False: a restricted draft's logits over its `vocab_ids` only (B, P, len(vocab_ids)), not
            scattered into the vocabulary (the same as True without a restricted vocabulary).
        returns: (B, P, vocab) logits in the model dtype (-inf outside a restricted draft vocabulary).
        """
        x = self.embed(tokens) + self.pos_table[positions.clamp(max=self.max_positions - 1)]
        x = self.run_layers(x, cache, positions, n_keys)
        if logit_index is not None:
            x = x.gather(1, logit_index[:, :, None].expand(-1, -1, self.d_model))
        return self.logits(_layer_norm(self.decoder.layer_norm, x), exact, full_vocab)

    @torch.no_grad()
    def features(self, cache: KVCache, tokens: torch.Tensor, positions: torch.Tensor, n_keys: int) -> torch.Tensor:
        """`forward` without the head: (B, T, d_model) final (LayerNormed) states, the features a feature-conditioned
        draft reads (`engine/features.py`); `logits(features(...))` is `forward(...)`."""
        x = self.embed(tokens) + self.pos_table[positions.clamp(max=self.max_positions - 1)]
        return _layer_norm(self.decoder.layer_norm, self.run_layers(x, cache, positions, n_keys))

    def logits(self, x: torch.Tensor, exact: bool = False, full_vocab: bool = True) -> torch.Tensor:
        """(B, P, d_model) final states -> (B, P, vocab) logits (-inf outside a restricted draft vocabulary);
        full_vocab False: (B, P, len(vocab_ids)) over a restricted vocabulary only."""
        logits = self._head(x, exact)
        return full_vocab_logits(logits, self.vocab_ids, self.vocab_size) if full_vocab else logits

    def run_layers(self, x: torch.Tensor, cache: KVCache, positions: torch.Tensor, n_keys: int) -> torch.Tensor:
        """(B, T, d_model) inputs (embeddings + positions) through every layer over the cache, writing this pass's
        keys/values at `positions` ((B, T) long, as in `forward`) -> (B, T, d_model) before the final LayerNorm."""
        write_pos, mask, n_keys = self.pass_keys(cache, positions, n_keys)
        if self.layer_loop is not None and not torch.compiler.is_compiling():  # traced: the ops below, opaque ones
            return self.layer_loop(x, cache, write_pos, mask)
        for i, layer in enumerate(self.layers):
            x = self._self_attention(i, layer, x, cache, write_pos, mask, n_keys)
            x = self._cross_attention(i, layer, x, cache)
            x = self._mlp(layer, x)
        return x

    def pass_keys(self, cache: KVCache, positions: torch.Tensor, n_keys: int
                  ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """What a pass feeding `positions` ((B, T) long) writes and reads: (write positions (B, T) clamped to the
        cache, mask (B, 1, T, n_keys') of the keys each query sees, n_keys' the keys it reads). The mask is bool
        (True: seen) for SDPA, a `kernels.mask_bias` (0 / -inf) for a row-invariant decoder's `attention`; with the
        CPU kernel (`fused`) it is each query's key count instead, (B, T) int32: its position + 1, at most n_keys
        (a padding entry past a row's input may see fewer keys than its position: its output is ignored)."""
        write_pos = positions.clamp(max=cache.n_positions - 1)
        if self.fused:
            n_keys = min(n_keys, cache.n_positions)
            return write_pos, (positions + 1).clamp(max=n_keys).to(torch.int32), n_keys
        if self.query_rows:
            # row-invariant: the smallest of `key_buckets` (probed: each query's output is the same over any of
            # them covering its position) at or above n_keys, else all `key_count` positions (a cache from
            # `new_cache` holds them all but at K > 14; masked past each query). Other key counts change the
            # kernels' rounding (a 32-query piece over 400 keys vs 416 parted on random data)
            n_keys = next((b for b in self.key_buckets if b >= n_keys), self.key_count)
        key_pos = torch.arange(n_keys, device=positions.device)
        seen = key_pos[None, None, None, :] <= positions[:, None, :, None]
        # row-invariant passes add the mask to their scores (`kernels.attention`), SDPA takes it as it is
        return write_pos, mask_bias(seen, self.dtype) if self.query_rows else seen, n_keys

    def _mlp(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """x + the MLP block of `layer`. x: (B, T, d_model)"""
        h = _layer_norm(layer.final_layer_norm, x)
        if self.post is not None:  # the activation fused into fc1's product
            h = self.linear(h, self.weights[layer.fc1], layer.fc1.bias, *self.post)
        else:
            h = layer.activation_fn(self._proj(layer.fc1, h))
        return self._proj_add(layer.fc2, h, x)
