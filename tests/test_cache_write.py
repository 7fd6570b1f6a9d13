"""KVCache.write_self: only the new (row, position) entries change, with keys and values in either layout."""

from __future__ import annotations

import pytest
import torch

from asr_spec.engine.cache import KVCache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_self_touches_only_each_rows_own_positions_in_both_layouts(dtype):
    gen = torch.Generator().manual_seed(0)
    caches = [KVCache.empty(2, 3, 2, 4, 10, 5, device=torch.device("cpu"), dtype=dtype, self_k_transposed=t,
                            self_v_transposed=t, cross_k_transposed=t, cross_v_transposed=t) for t in (False, True)]
    k, v = (torch.randn(3, 2, 2, 4, generator=gen).to(dtype) for _ in range(2))  # (rows, heads, T, head_dim)
    positions = torch.tensor([[0, 1], [4, 5], [8, 9]])  # ragged rows: each writes at its own offsets
    for cache in caches:
        cache.write_self(1, k, v, positions)
    plain, transposed = caches
    for name in ("self_k", "self_v", "cross_k", "cross_v"):  # views of tensors stored (.., head_dim, n)
        assert getattr(transposed, name).stride()[-2] == 1 and getattr(plain, name).stride()[-1] == 1
        assert getattr(transposed, name).shape == getattr(plain, name).shape
    for cache in caches:
        assert not cache.self_k[0].any() and not cache.self_v[0].any()  # the other layer untouched
        for row in range(3):
            for j, pos in enumerate(positions[row].tolist()):
                assert torch.equal(cache.self_k[1, row, :, pos], k[row, :, j])
                assert torch.equal(cache.self_v[1, row, :, pos], v[row, :, j])
            untouched = [p for p in range(10) if p not in positions[row].tolist()]
            assert not cache.self_k[1, row, :, untouched].any() and not cache.self_v[1, row, :, untouched].any()
    assert torch.equal(plain.self_k, transposed.self_k) and torch.equal(plain.self_v, transposed.self_v)
    moved = transposed.rows(2, 1)  # a rows view writes into its slots of the same cache
    moved.write_self(0, k[:2], v[:2], positions[:2])
    assert torch.equal(transposed.self_k[0, 1, :, 0], k[0, :, 0]) and not transposed.self_k[0, 0].any()
    assert torch.equal(transposed.self_v[0, 1, :, 0], v[0, :, 0]) and not transposed.self_v[0, 0].any()


def test_int8_audio_scales_go_with_their_rows():
    """An int8 audio cache holds a scale a channel (layer, row, head, head_dim); a rows view, a moved row and rows
    written from another cache carry theirs, a cache in any other dtype holds none."""
    cpu = torch.device("cpu")
    assert KVCache.empty(2, 3, 2, 4, 10, 5, device=cpu, dtype=torch.float32).audio_scales == (None, None)
    cache = KVCache.empty(2, 4, 2, 4, 10, 5, device=cpu, dtype=torch.float32, audio_dtype=torch.int8,
                          cross_k_transposed=True, cross_v_transposed=True)
    assert cache.cross_k.dtype == cache.cross_v.dtype == torch.int8
    assert cache.cross_k_scales.shape == cache.cross_v_scales.shape == (2, 4, 2, 4)
    for scales in cache.audio_scales:
        scales.copy_(torch.arange(4.0)[None, :, None, None].expand_as(scales))  # row r's scales: r
    view = cache.rows(2, 1)
    assert float(view.cross_k_scales[0, 0, 0, 0]) == 1.0 and float(view.cross_v_scales[1, 1, 1, 3]) == 2.0
    view.cross_k_scales[0, 0, 0, 0] = 7.0  # a view: writes reach the cache
    assert float(cache.cross_k_scales[0, 1, 0, 0]) == 7.0
    cache.move_row(3, 0, 0)
    assert bool((cache.cross_k_scales[:, 0] == 3.0).all()) and bool((cache.cross_v_scales[:, 0] == 3.0).all())
    source = KVCache.empty(2, 2, 2, 4, 10, 5, device=cpu, dtype=torch.float32, audio_dtype=torch.int8)
    for scales in source.audio_scales:
        scales.fill_(9.0)
    cache.write_rows(torch.tensor([1, 3]), source)
    for scales in cache.audio_scales:
        assert bool((scales[:, [1, 3]] == 9.0).all()) and bool((scales[:, 2] == 2.0).all())
