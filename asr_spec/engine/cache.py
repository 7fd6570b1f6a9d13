"""Ragged key/value cache: preallocated, one length per row.

Rollback is moving a row's length back (gpt-fast's `input_pos`, but per row): entries past a row's length are
stale, never attended to (queries only see keys at positions <= their own) and overwritten by the next writes.
Cross-attention keys/values depend only on the audio, so they are computed once per chunk and stored per slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def channel_scaled(audio_dtype: torch.dtype) -> bool:
    """The one rule of a cache's audio scales: audio keys/values held in int8 carry an fp32 scale a channel (a
    (row, head, head_dim element) over the chunk's positions: `KVCache.cross_k_scales`); in any other dtype none.
    `KVCache.empty` allocates by it, `DecoderLayout.write_audio` quantizes by it, `engine.memory` counts by it."""
    return audio_dtype == torch.int8


@dataclass
class KVCache:
    """Self- and cross-attention caches of one decoder for `n_rows` batch slots.

    self_k, self_v:   (n_layers, n_rows, n_heads, n_positions, head_dim); each a transposed view of a tensor
                      stored (n_layers, n_rows, n_heads, head_dim, n_positions) when `self_k_transposed` /
                      `self_v_transposed` (a product reading every position then reads each layer's keys and
                      values in place: `Decoder._self_attention`, `kernels.attention`)
    cross_k, cross_v: (n_layers, n_rows, n_heads, n_audio_ctx, head_dim); each stored as
                      (n_layers, n_rows, n_heads, head_dim, n_audio_ctx) when `cross_k_transposed` /
                      `cross_v_transposed`; in `audio_dtype` (`engine.int8.audio_dtype`: int8 under a bf16
                      decoder or an fp32 decoder of the int8 precision where the CPU attention kernel runs, or bf16
                      there by switch), else the decoder's dtype
    lengths:          (n_rows,) long — tokens of each row held in the self-attention cache
    cross_k_scales, cross_v_scales: (n_layers, n_rows, n_heads, head_dim) float32 where the audio keys/values are
                      int8, else None: each channel's scale over the chunk's positions (a key is
                      cross_k * cross_k_scales, as `engine.int8.quantize_channels` made them)
    """

    self_k: torch.Tensor
    self_v: torch.Tensor
    cross_k: torch.Tensor
    cross_v: torch.Tensor
    lengths: torch.Tensor
    cross_k_scales: torch.Tensor | None = None
    cross_v_scales: torch.Tensor | None = None

    @classmethod
    def empty(
        cls,
        n_layers: int,
        n_rows: int,
        n_heads: int,
        head_dim: int,
        n_positions: int,
        n_audio_ctx: int,
        *,
        device: torch.device,
        dtype: torch.dtype,
        cross_k_transposed: bool = False,
        self_k_transposed: bool = False,
        cross_v_transposed: bool = False,
        self_v_transposed: bool = False,
        audio_dtype: torch.dtype | None = None,
    ) -> KVCache:
        def tensor(make, n: int, transposed: bool, dtype: torch.dtype) -> torch.Tensor:
            """(n_layers, n_rows, n_heads, n, head_dim), a transposed view of (..., head_dim, n) if `transposed`."""
            if transposed:
                return make((n_layers, n_rows, n_heads, head_dim, n), device=device, dtype=dtype).transpose(-1, -2)
            return make((n_layers, n_rows, n_heads, n, head_dim), device=device, dtype=dtype)

        audio = dtype if audio_dtype is None else audio_dtype

        def scales() -> torch.Tensor | None:
            """(n_layers, n_rows, n_heads, head_dim) channel scales where the audio has them (`channel_scaled`)."""
            return torch.ones((n_layers, n_rows, n_heads, head_dim), device=device) if channel_scaled(audio) else None

        return cls(
            self_k=tensor(torch.zeros, n_positions, self_k_transposed, dtype),
            self_v=tensor(torch.zeros, n_positions, self_v_transposed, dtype),
            cross_k=tensor(torch.empty, n_audio_ctx, cross_k_transposed, audio),  # always written before it is read
            cross_v=tensor(torch.empty, n_audio_ctx, cross_v_transposed, audio),
            lengths=torch.zeros(n_rows, device=device, dtype=torch.long),
            cross_k_scales=scales(),
            cross_v_scales=scales(),
        )

    @property
    def n_rows(self) -> int:
        return self.self_k.shape[1]

    @property
    def n_positions(self) -> int:
        return self.self_k.shape[3]

    def write_self(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """Store new keys/values at each row's own positions.

        k, v: (n_rows, n_heads, T, head_dim); positions: (n_rows, T) long, already clamped to the cache.
        Writes the n_rows x T new entries only, in either key layout (a bf16 `scatter_` on CPU copied the whole
        layer twice per call).
        """
        rows = torch.arange(k.shape[0], device=k.device)[:, None]  # (n_rows, 1), broadcast against positions
        self.self_k[layer][rows, :, positions] = k.transpose(1, 2)  # indexed: (n_rows, T, n_heads, head_dim)
        self.self_v[layer][rows, :, positions] = v.transpose(1, 2)

    def rows(self, n_rows: int, first: int = 0) -> KVCache:
        """Slots [first, first + n_rows), as views (no copy; writes reach this cache): the first n_rows for the
        step of a batch whose live rows are packed first, a run of free slots for admission to prefill into."""
        s = slice(first, first + n_rows)
        return KVCache(self.self_k[:, s], self.self_v[:, s], self.cross_k[:, s], self.cross_v[:, s], self.lengths[s],
                       *self._indexed_scales((slice(None), s)))

    @property
    def audio_scales(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(cross_k_scales, cross_v_scales): int8 audio keys/values' channel scales, (None, None) otherwise."""
        return self.cross_k_scales, self.cross_v_scales

    def layer_audio_scales(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """`audio_scales` of one layer: (n_rows, n_heads, head_dim) each, or (None, None)."""
        return self._indexed_scales(layer)

    def _indexed_scales(self, index) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Both audio scales indexed by `index` (views), None kept."""
        k, v = self.audio_scales
        return (None if k is None else k[index]), (None if v is None else v[index])

    def move_row(self, src: int, dst: int, n_positions: int) -> None:
        """Copy slot `src` into slot `dst` (its first n_positions self-attention entries and its audio): keeps the
        live rows first when a row finishes and no chunk waits for its slot. One row moves, not the whole cache."""
        self.self_k[:, dst, :, :n_positions] = self.self_k[:, src, :, :n_positions]
        self.self_v[:, dst, :, :n_positions] = self.self_v[:, src, :, :n_positions]
        self.cross_k[:, dst] = self.cross_k[:, src]
        self.cross_v[:, dst] = self.cross_v[:, src]
        for scales in self.audio_scales:
            if scales is not None:
                scales[:, dst] = scales[:, src]
        self.lengths[dst] = self.lengths[src]

    def write_rows(self, rows: torch.Tensor, source: KVCache) -> None:
        """Copy a cache of R rows into slots `rows` ((R,) long): its audio keys/values, its self-attention part
        (source.n_positions positions) and its lengths. Admission of chunks to slots apart uses it."""
        n = source.n_positions
        self.self_k[:, rows, :, :n] = source.self_k
        self.self_v[:, rows, :, :n] = source.self_v
        self.cross_k[:, rows] = source.cross_k
        self.cross_v[:, rows] = source.cross_v
        for scales, given in zip(self.audio_scales, source.audio_scales):
            if scales is not None:
                scales[:, rows] = given
        self.lengths[rows] = source.lengths
