"""How a `Decoder` holds what it reads, chosen once when it is built: its step weights (packed for oneDNN or the thin
kernel, q/k/v fused, the query scale folded in), the layouts of its caches (audio keys/values transposed or as
shaped, their dtype), its output head (certified, packed, plain or transposed) and the row-invariant blocks of its
products; and the two places those layouts are written: a new cache (`new_cache`) and a chunk's audio keys/values
(`write_audio`). `Decoder` (decoder.py) runs the passes over them."""

from __future__ import annotations

import torch

from asr_spec.engine import cpu_linear, int8
from asr_spec.engine.cache import KVCache, channel_scaled
from asr_spec.engine.head import CertifiedHead, approximate_product, head_packed, head_rows, head_transposed
from asr_spec.engine.kernels import (
    ANY_ROWS,
    POST_OPS,
    decoder_blocks,
    decoder_rows,
    fused_qkv,
    key_buckets,
    pack,
    reorder,
    scaled,
    transposed_product,
    values_transposed,
)


class DecoderLayout:
    """The layout half of `Decoder`: the choices `Decoder.__init__` makes through these methods (each reads the
    attributes set before it there) and the writes into the layouts chosen."""

    @property
    def device(self) -> torch.device:
        return self.pos_table.device

    @property
    def dtype(self) -> torch.dtype:
        return self.pos_table.dtype

    @property
    def min_cache_positions(self) -> int:
        """The self-attention positions a cache of this decoder holds at least (`new_cache`; the memory check
        counts them too): `key_count` where its passes are row-invariant through torch's products (`query_rows`:
        each pass reads that many), else 0."""
        return self.key_count if self.query_rows else 0

    def new_cache(self, n_rows: int, n_positions: int, n_audio_ctx: int) -> KVCache:
        """A cache of n_rows slots. On CPU the audio keys are stored transposed where `keys_t`, and the audio values
        where `values_t`: the layouts `kernels.attention` reads in place. With the CPU kernel (`fused`) the audio
        values (head_dim, positions) and the keys so in fp32 (as shaped in bf16: `_audio_keys_transposed`), each
        streamed whole, the self-attention's (positions, head_dim): a query's
        few dozen keys are contiguous rows (transposed they span head_dim separate lines: the fp32 batch-8
        self-attention stage 2.4x slower). Row-invariant through torch's products: of at least `key_count`
        positions (what each pass reads), keys (and values where `values_t`) stored transposed, so that the
        self-attention products read every layer's keys and values in place (where n_positions <= key_count:
        K <= 14 in the scheduler's caches). The audio's keys and values in `audio_dtype`."""
        n_positions = max(n_positions, self.min_cache_positions)
        self_t = bool(self.query_rows)
        return KVCache.empty(
            self.n_layers, n_rows, self.n_heads, self.head_dim, n_positions, n_audio_ctx,
            device=self.device, dtype=self.dtype, cross_k_transposed=self.keys_t,
            cross_v_transposed=self.values_t, self_k_transposed=self_t, self_v_transposed=self_t and self.values_t,
            audio_dtype=self.audio_dtype,
        )

    @torch.inference_mode()
    def write_audio(self, cache: KVCache, audio: torch.Tensor) -> None:
        """Compute R new chunks' cross-attention keys/values (once per chunk) into `cache`, a view of the R batch
        slots they are admitted to (`KVCache.rows`): written in place, no copy (products in the decoder's dtype,
        rounded to `audio_dtype` as they are stored; in int8 quantized per channel, `int8.quantize_channels`, from
        a scratch of the R chunks in the decoder's dtype: a bf16 decoder's keys/values are rounded to bf16 first,
        then to their int8 levels).

        audio: (R, n_audio_ctx, d_encoder) the encoder output its cross-attention reads.
        """
        audio = audio.to(self.dtype)
        r, s, _ = audio.shape
        scratch = audio.new_empty(r, self.n_heads, self.head_dim, s) if channel_scaled(self.audio_dtype) else None
        for i, layer in enumerate(self.layers):
            attn = layer.encoder_attn
            # with the values stored transposed, each of them stored so written by a product of that layout
            for proj, stored, scales, by_product in (
                    (attn.k_proj, cache.cross_k[i], cache.cross_k_scales, self.values_t and self.keys_t),
                    (attn.v_proj, cache.cross_v[i], cache.cross_v_scales, self.values_t)):
                if scratch is not None:  # int8: scales a channel over positions; a plain copy where stored
                    # (head_dim, positions), as the kernel's fp32 layout stores both (`_audio_keys_transposed`)
                    transposed_product(audio, proj, scratch)
                    quantized, scales[i] = int8.quantize_channels(scratch)
                    stored.transpose(-1, -2).copy_(quantized)
                elif by_product:
                    transposed_product(audio, proj, stored.transpose(-1, -2))
                else:  # into the layout `new_cache` chose
                    out = self.wide_linear(audio, proj.weight, proj.bias).view(r, s, self.n_heads, self.head_dim)
                    stored.copy_(out.transpose(1, 2))

    def _step_weights(self, packed: bool, int8_precision: bool) -> None:
        """The copies the step's products read: `weights` per projection, and where packed (oneDNN's `packed`
        copies, or the thin kernel's panels) the fused q, k, v (`qkv`) and scaled cross-attention q (`cross_q`)
        instead of those projections' own weights (no other packed copy of them is held), and the activation
        fused into fc1's product (`post`). The thin kernel's panels hold bf16 copies where `bf16_weights` (the int8
        precision's fp32 decoder: `int8.bf16_weights_usable`, read by `_head_layout` too)."""
        self.bf16_weights = int8.bf16_weights_usable(self.device, self.dtype, int8_precision)
        packs = packed or self.thin
        step_layers = [proj for layer in self.layers
                       for proj in (layer.self_attn.out_proj, layer.encoder_attn.out_proj, layer.fc1, layer.fc2)]
        if not packs:
            step_layers += [proj for layer in self.layers for proj in (
                layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.encoder_attn.q_proj)]
        if self.thin:  # bf16 copies under fp32 rows where `bf16_weights`
            weight_of, repack = cpu_linear.packers(self.bf16_weights)
        else:
            weight_of, repack = pack if packed else (lambda w: w), reorder
        self.weights = {proj: weight_of(proj.weight) for proj in step_layers}
        self.qkv = [fused_qkv(layer.self_attn, self.scaling, repack) for layer in self.layers] if packs else None
        self.cross_q = ([scaled(layer.encoder_attn.q_proj, self.scaling, repack) for layer in self.layers]
                        if packs else None)
        self.post = POST_OPS.get(self.decoder.config.activation_function) if packs else None

    def _attention_layout(self) -> tuple[bool, tuple[int, ...]]:
        """(values_t, key_buckets): whether attention values are stored (head_dim, positions): always with the
        CPU kernel (its layout), else where it pays (bf16): in a row-invariant decoder where the probe still finds
        enough queries in that layout (`kernels.values_transposed`), in any other CPU one for speed alone; and the
        self-attention key counts a row-invariant pass of torch's products may read, the smallest covering its
        positions (none elsewhere: the kernel reads each query's own count)."""
        if self.fused:
            return True, ()
        n_audio = self.decoder.config.max_source_positions
        values_t = self.cpu_layout and self.dtype != torch.float32 and (
            not self.query_rows or values_transposed(self.n_heads, self.head_dim, n_audio, self.dtype))
        if not self.query_rows:
            return values_t, ()
        return values_t, key_buckets(self.n_heads, self.head_dim, self.key_count, self.query_rows, self.dtype,
                                     values_t)

    def _audio_dtype(self, int8_precision: bool) -> torch.dtype:
        """The dtype the audio's keys/values are held in (`new_cache`, `write_audio`): int8 under a bf16 decoder,
        int8 or bf16 under an fp32 decoder of the int8 precision, as `int8.audio_dtype` decides (the kernel widens
        them as it reads them), else the decoder's own."""
        return int8.audio_dtype(self.device, self.dtype, int8_precision)

    def _audio_keys_transposed(self) -> bool:
        """Whether the audio keys are stored (head_dim, positions): on a CPU, except with the kernel in bf16 over bf16
        audio, where they are stored as shaped (positions, head_dim), a (row, head)'s keys one front-to-back stream
        instead of head_dim lines read side by side (AVX-512-BF16 EPYC, batch 8, 6 layers: a 1-query pass's
        cross-attention 1.07-1.23x faster, a 4-query verify pass's even; in fp32 1.07x faster at 1 query but 1.07x
        slower at 4). int8 audio keys are read through the kernel's fp32 arithmetic, in its fp32 layout."""
        return self.cpu_layout and not (self.fused and self.dtype == torch.bfloat16
                                        and self.audio_dtype == torch.bfloat16)

    def _head_layout(self, full: torch.Tensor, vocab_ids: torch.Tensor | None, packed: bool,
                     certify: tuple[int, tuple[int, ...]] | None) -> None:
        """The head's copies `_head` reads (see `__init__`): certified, packed (oneDNN's or the thin kernel's),
        plain or transposed. full: the (vocab, d_model) head weight."""
        weight = head_rows(full, vocab_ids)
        # the certified head reads bf16 rows through the product `approximate_product` names (oneDNN's where bf16
        # is native, else the thin kernel's fp32 rows over bf16 panels), None where neither runs; with bf16
        # weights (`bf16_weights`) the head is read in bf16 as it is
        fp32 = packed and self.dtype == torch.float32 and not self.bf16_weights
        product = approximate_product(self.device) if fp32 else None
        certified = certify is not None and vocab_ids is None and product is not None
        self.certified = CertifiedHead(weight, *certify, product=product) if certified else None
        self.head_packed = (head_packed(full, vocab_ids, self.thin, self.bf16_weights)
                            if packed and self.certified is None else None)
        self.head_weight = None if packed else weight
        self.head_weight_t = (head_transposed(full, vocab_ids)
                              if self.cpu_layout and not packed and not self.row_rows else None)

    def row_invariance(self, n_vocab: int, packed: bool) -> tuple[int, int]:
        """(rows, queries): on a CPU in bf16/fp16, the most rows each of this decoder's products and the most
        queries its attention may take at once and still give every row, bit for bit, what one row alone gets
        (`kernels.row_block`, `kernels.query_block`: measured once per shape); (0, 0) elsewhere (fp32, CUDA),
        where products run whole and a verify pass matches a step up to rounding. A rows figure of 0 on a
        CPU in bf16 means even 1-row products do not repeat: then products run whole too. With the CPU attention
        kernel (`fused`), invariant by construction, queries is 0: only the linear products are probed, and with
        the thin products too (`thin`) none: (`kernels.ANY_ROWS`, 0)."""
        if not self.cpu_layout or self.dtype == torch.float32:
            return 0, 0
        if self.thin and self.fused:
            return ANY_ROWS, 0
        d_ffn = self.layers[0].fc1.weight.shape[0]
        if self.fused:
            return decoder_rows(self.d_model, d_ffn, n_vocab, self.dtype, packed), 0
        return decoder_blocks(self.d_model, d_ffn, n_vocab, self.n_heads,
                              self.key_count, self.decoder.config.max_source_positions, self.dtype, packed)
