"""Lossless bf16 on a CPU: the decoder's passes give every row what a 1-row, 1-token step gives it, bit for bit.

`kernels.row_block` / `kernels.query_block` measure, on the CPU the suite runs on, how many rows a bf16 product
and how many queries an attention product may take at once with each row's result unchanged; the decoder runs its
products in pieces of that size. Where the probe finds none (a CPU whose kernels do not even repeat a 1-row
product), these tests are skipped with the probe's figures: the contract there is bf16 greedy up to a near-tie
(tests/test_bf16.py). The decoder's attention runs through the C++ kernel where it is built (`cpu_attention`:
invariant by construction, no probe) and through torch's products otherwise: the invariance tests run both ways
(`attention_path`), the probes' own tests the torch way.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from conftest import perturbed, tiny_target

from asr_spec.engine import DecodeOptions, Engine
from asr_spec.engine.cpu_attention import DISABLE_ENV
from asr_spec.engine.decoder import Decoder
from asr_spec.engine.kernels import (
    ROW_BLOCK_MAX,
    TRANSPOSED_MIN_QUERIES,
    _invariant_rows,
    attention,
    blocked,
    key_buckets,
    mask_bias,
    query_block,
    row_block,
    stored,
)
from asr_spec.models.loading import decoder_draft
from asr_spec.testing import random_whisper

DTYPE = torch.bfloat16


@functools.cache
def _model(shape: str):
    return random_whisper(shape, seed=1, init_std=0.2, decoder_layers=2).to(DTYPE)


def _decoder(shape: str = "test", *, kernel: bool = False) -> Decoder:
    """A bf16 decoder of `shape`; kernel: the one asked for by the `attention_path` fixture (checked here),
    else torch's products (whose probes some tests check)."""
    model = _model(shape)
    decoder = Decoder(model.model.decoder, model.proj_out)
    assert decoder.fused == kernel
    if not decoder.row_rows:
        pytest.skip(f"bf16 products are not row-invariant on this CPU (rows {decoder.row_rows}, queries "
                    f"{decoder.query_rows}): bf16 is lossless here only up to near-ties")
    return decoder


def _clone(cache):
    """A copy of every tensor of `cache` (the int8 audio's scales are None elsewhere)."""
    return dataclasses.replace(cache, **{f.name: getattr(cache, f.name).clone() for f in dataclasses.fields(cache)
                                         if getattr(cache, f.name) is not None})


def test_the_probe_finds_the_rows_where_a_product_changes_kernel():
    """A product that rounds differently from its 4th row on is invariant for 3 rows; one that never repeats
    itself for none; an exact one for all."""
    x = torch.randn(ROW_BLOCK_MAX, 8)
    exact = functools.partial(torch.mul, other=2.0)
    assert _invariant_rows(exact, x, 0) == ROW_BLOCK_MAX
    assert _invariant_rows(lambda rows: rows * 2.0 + (1e-3 if len(rows) >= 4 else 0.0), x, 0) == 3
    noise = iter(range(10**6))
    assert _invariant_rows(lambda rows: rows + next(noise), x, 0) == 0


def test_blocked_products_are_the_whole_product_in_pieces():
    x, w, b = torch.randn(2, 5, 8), torch.randn(3, 8), torch.randn(3)
    torch.testing.assert_close(blocked(torch.nn.functional.linear, 2, x, w, b), torch.nn.functional.linear(x, w, b))
    assert row_block(3, 8, torch.float32, False) >= 0


@pytest.mark.parametrize("n_new", [4, 12])
def test_a_verify_pass_scores_each_position_as_a_one_token_step_does(n_new, attention_path):
    """Three rows at ragged lengths fed 4 tokens in one pass (a K = 3 verify pass; 12: 36 rows, more than one
    kernel takes on some CPUs) vs each row alone, one token at a time, over all key_count keys (the pass reads
    the smallest key bucket where the probe allows it): logits and written keys/values equal bit for bit.
    whisper-base's layer shapes (2 layers), where SDPA rounds by query count."""
    decoder = _decoder("base", kernel=attention_path == "kernel")
    gen = torch.Generator().manual_seed(0)
    n_rows, n_ctx = 3, decoder.decoder.config.max_source_positions
    cache = decoder.new_cache(n_rows, 64, n_ctx)
    decoder.write_audio(cache, torch.randn(n_rows, n_ctx, decoder.d_model, generator=gen).to(DTYPE))
    prompt = torch.randint(0, 1000, (n_rows, 7), generator=gen)
    decoder.forward(cache, prompt, torch.arange(7).expand(n_rows, -1), 32)
    lengths = torch.tensor([3, 7, 5])  # ragged rows: the rest of each prompt is stale, masked and overwritten
    tokens = torch.randint(0, 1000, (n_rows, n_new), generator=gen)
    positions = lengths[:, None] + torch.arange(n_new)
    whole = _clone(cache)
    verify = decoder.forward(whole, tokens, positions, 32)
    for row in range(n_rows):
        alone = _clone(cache.rows(1, row))
        for j in range(n_new):
            step = decoder.forward(alone, tokens[row:row + 1, j:j + 1], positions[row:row + 1, j:j + 1],
                                   decoder.key_count)
            assert torch.equal(step[0, 0], verify[row, j]), f"row {row}, position {j}"
        end = int(lengths[row]) + n_new
        assert torch.equal(alone.self_k[:, 0, :, :end], whole.self_k[:, row, :, :end]), f"row {row} keys"
        assert torch.equal(alone.self_v[:, 0, :, :end], whole.self_v[:, row, :, :end]), f"row {row} values"


@functools.cache
def _greedy(batch_size: int, path: str):  # path: `attention_path`'s, which the engine's decoders read
    target = tiny_target().to(DTYPE)
    features = torch.randn(8, 16, 100, generator=torch.Generator().manual_seed(0)).to(DTYPE)
    options = DecodeOptions(language="en", max_new_tokens=30)
    return target, features, Engine(target, None, options).decode(features, batch_size=batch_size)


@pytest.mark.parametrize("batch_size", [1, 4, 8])
def test_bf16_speculative_is_bf16_greedy_token_for_token(batch_size, attention_path):
    """No near-tie allowance: every row's tokens equal greedy's, and greedy's equal at every batch size."""
    _decoder(kernel=attention_path == "kernel")
    target, features, greedy = _greedy(batch_size, attention_path)
    options = DecodeOptions(language="en", max_new_tokens=30, num_draft_tokens=3)
    draft = decoder_draft(perturbed(tiny_target(), 0.3, seed=3, encoder=False).to(DTYPE))
    results = Engine(target, draft, options).decode(features, batch_size=batch_size)
    stats = [r.stats for r in results]
    assert sum(s.accepted_tokens for s in stats) > 0 and sum(s.drafted_tokens for s in stats) > sum(
        s.accepted_tokens for s in stats)  # proposals accepted and rejected
    assert [r.tokens for r in results] == [r.tokens for r in greedy]
    assert [r.tokens for r in greedy] == [r.tokens for r in _greedy(1, attention_path)[2]]


def test_a_cache_longer_than_the_pass_reads_gives_the_same_logits(monkeypatch):
    """A cache of more positions than `key_count` (a speculative engine at K > 14) is read over the same key_count
    keys as one of exactly key_count (greedy's): the same logits bit for bit."""
    monkeypatch.setenv(DISABLE_ENV, "1")  # torch's products: the probes decide their layout and buckets
    decoder = _decoder()
    gen = torch.Generator().manual_seed(0)
    n_ctx = decoder.decoder.config.max_source_positions
    audio = torch.randn(2, n_ctx, decoder.d_model, generator=gen).to(DTYPE)
    tokens = torch.randint(0, 100, (2, 6), generator=gen)
    logits = []
    for n_positions in (8, decoder.key_count + 20):
        cache = decoder.new_cache(2, n_positions, n_ctx)
        assert cache.n_positions == max(n_positions, decoder.key_count)
        decoder.write_audio(cache, audio)
        logits.append(decoder.forward(cache, tokens, torch.arange(6).expand(2, -1), 32))
    assert torch.equal(logits[0], logits[1])


def test_each_key_bucket_gives_a_query_what_all_keys_give(monkeypatch):
    """The probe's claim (`kernels.key_buckets`), on other data than it saw: a query's attention output over any
    bucket covering its position equals, bit for bit, its output over all key_count keys (masked keys exactly
    left out), for a lone query, a verify pass's 4 queries and a full piece; whisper-base's heads."""
    monkeypatch.setenv(DISABLE_ENV, "1")  # torch's products: the probes decide their layout and buckets
    decoder = _decoder("base")
    buckets = decoder.key_buckets
    if len(buckets) == 1:
        pytest.skip(f"no key bucket below {decoder.key_count} gives every query the same output on this CPU")
    gen = torch.Generator().manual_seed(7)
    h, d, n = decoder.n_heads, decoder.head_dim, decoder.key_count
    k_t = torch.randn(2, h, d, n, generator=gen).to(DTYPE)
    v = stored(torch.randn(2, h, n, d, generator=gen).to(DTYPE), decoder.values_t)  # as the decoder's cache
    for m in (1, 4, decoder.query_rows):
        q = (torch.randn(2, h, m, d, generator=gen) / 8).to(DTYPE)
        for last in (m - 1, 37, 63, 64, 200, 383, n - 1):
            positions = torch.arange(last - m + 1, last + 1)
            outs = {}
            for bucket in (b for b in buckets if b > last):
                seen = (torch.arange(bucket)[None, None, None, :] <= positions[None, None, :, None]).expand(2, 1, m, -1)
                outs[bucket] = attention(q, k_t[..., :bucket], v[:, :, :bucket], mask_bias(seen, DTYPE),
                                         decoder.query_rows, lone=True)
            assert all(torch.equal(out, outs[n]) for out in outs.values()), f"{m} queries ending at {last}"
    assert key_buckets(h, d, n, decoder.query_rows, DTYPE, decoder.values_t) is buckets  # probed once per shape


def test_the_memory_check_counts_the_positions_a_row_invariant_cache_holds(monkeypatch):
    """Through torch's products a bf16 decoder's cache holds at least `key_count` self-attention positions (each
    pass reads them all), more than the scheduler's 448 + K + 2: the memory check counts what `new_cache` makes."""
    from asr_spec.engine import memory

    monkeypatch.setenv(DISABLE_ENV, "1")
    decoder = _decoder("base")
    assert decoder.min_cache_positions == decoder.key_count > 448 + 5
    shape = memory.DecoderShape(decoder.n_layers, decoder.n_heads, decoder.head_dim, 2, decoder.audio_dtype,
                                decoder.min_cache_positions)
    run = memory.RunShape(shape, None, 448 + 5, 1500, decoder.d_model, 51865, 3, 0)
    cache = decoder.new_cache(1, 448 + 5, 1500)
    held = sum(t.numel() * t.element_size() for t in (cache.self_k, cache.self_v, cache.cross_k, cache.cross_v))
    scales = [t for t in (cache.cross_k_scales, cache.cross_v_scales) if t is not None]
    held += sum(t.numel() * t.element_size() for t in scales)
    assert memory._cache_bytes(run.target, run.n_positions, run.n_audio_ctx) == held


def test_values_are_stored_in_the_layout_the_probe_measured(monkeypatch):
    """A row-invariant decoder stores its attention values transposed exactly where `query_block` in that layout
    still takes `TRANSPOSED_MIN_QUERIES` queries over the audio keys, and its query pieces are what the probe
    found in the layout it stores (self-attention over key_count keys, cross-attention over the audio's)."""
    monkeypatch.setenv(DISABLE_ENV, "1")  # torch's products: the probes decide their layout and buckets
    decoder = _decoder("base")
    h, d, n_ctx = decoder.n_heads, decoder.head_dim, decoder.decoder.config.max_source_positions
    cache = decoder.new_cache(1, 8, n_ctx)
    assert decoder.values_t == (query_block(h, d, n_ctx, DTYPE, True) >= TRANSPOSED_MIN_QUERIES)
    for values in (cache.cross_v, cache.self_v):
        assert (values.stride(-2) == 1) == decoder.values_t
    assert decoder.query_rows == min(query_block(h, d, n, DTYPE, decoder.values_t) for n in (decoder.key_count, n_ctx))
