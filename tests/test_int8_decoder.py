"""The int8 precision's decoder: fp32, its audio keys/values held in int8 with a scale a channel (or bf16:
`int8.audio_dtype`) and its step's weights read in bf16 (`int8.bf16_weights_usable`). The attention kernel under
fp32 queries over bf16 keys/values is exactly fp32 attention over their widened values (both layouts, ragged
counts), over int8 ones fp32 attention over their scaled values within fp32 rounding and row-invariant; a
decoder's logits are an fp32 decoder's over the bf16-rounded audio, and over the bf16-rounded weights, bit for bit
(its layer loop and its Python loop), over the int8 audio within rounding; the channel quantizer; the decisions;
and the memory a run needs counting 2 bytes (bf16) or 1 byte and the scales (int8) an audio key; the one rule of
which caches carry scales; the oracle draft's fingerprints over int8 audio."""

from __future__ import annotations

import pytest
import torch

from asr_spec.engine import cpu_attention, cpu_linear, int8, memory
from asr_spec.engine.cache import KVCache, channel_scaled
from asr_spec.engine.decoder import Decoder
from asr_spec.testing import random_whisper

CPU = torch.device("cpu")
H, D = 8, 64

pytestmark = pytest.mark.usefixtures("kernel")  # conftest: the kernel extension built


@pytest.mark.parametrize("positions_contiguous", [True, False])
@pytest.mark.parametrize("t", [1, 4, 6])
def test_fp32_queries_over_bf16_keys_are_fp32_attention_over_their_values(t, positions_contiguous):
    gen = torch.Generator().manual_seed(t)
    b, s = 3, 203
    q = torch.randn(b, t, H, D, generator=gen)
    if positions_contiguous:  # (rows, H, D, positions) as the audio's keys/values are stored
        store = torch.randn(2, b, H, D, s + 3, generator=gen).bfloat16().transpose(-1, -2)
    else:
        store = torch.randn(2, b, H, s + 3, D, generator=gen).bfloat16()
    keys, values = store[0, :, :, :s], store[1, :, :, :s]
    n_seen = torch.randint(1, s + 1, (b, t), generator=gen, dtype=torch.int32)
    n_seen[0, 0], n_seen[-1, -1] = 1, s
    mixed = cpu_attention.attend(q, keys, values, n_seen, 0.125)
    widened = cpu_attention.attend(q, keys.float(), values.float(), n_seen, 0.125)
    assert mixed.dtype == torch.float32
    assert torch.equal(mixed, widened)


def _int8_store(gen: torch.Generator, b: int, s: int, positions_contiguous: bool):
    """Keys and values (b, H, s, D) of random channels of unlike sizes, int8 in either layout, their channel scales
    (b, H, D) and the fp32 values they stand for (int8 x scale)."""
    raw = torch.randn(2, b, H, D, s, generator=gen) * torch.rand(2, b, H, D, 1, generator=gen) * 4
    quantized, scales = int8.quantize_channels(raw)
    values = quantized.float() * scales[..., None]
    if positions_contiguous:  # (rows, H, D, positions) as the audio's keys/values are stored
        return quantized.transpose(-1, -2), scales, values.transpose(-1, -2)
    return quantized.transpose(-1, -2).contiguous(), scales, values.transpose(-1, -2)


@pytest.mark.parametrize("positions_contiguous", [True, False])
@pytest.mark.parametrize("t", [1, 4, 6])
def test_fp32_queries_over_int8_keys_are_fp32_attention_over_their_scaled_values(t, positions_contiguous):
    gen = torch.Generator().manual_seed(10 + t)
    b, s = 3, 203
    q = torch.randn(b, t, H, D, generator=gen)
    stored, scales, values = _int8_store(gen, b, s, positions_contiguous)
    n_seen = torch.randint(1, s + 1, (b, t), generator=gen, dtype=torch.int32)
    n_seen[0, 0], n_seen[-1, -1] = 1, s
    out = cpu_attention.attend(q, stored[0], stored[1], n_seen, 0.125, scales[0], scales[1])
    reference = cpu_attention.attend(q, values[0], values[1], n_seen, 0.125)
    assert out.dtype == torch.float32
    # the scales multiply the query before its sums and the output after them: fp32 rounding apart
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)
    for row in range(b):  # and a query's output is the one it gets alone (invariant by construction)
        for i in range(t):
            alone = cpu_attention.attend(q[row:row + 1, i:i + 1], stored[0, row:row + 1], stored[1, row:row + 1],
                                         n_seen[row:row + 1, i:i + 1], 0.125, scales[0, row:row + 1],
                                         scales[1, row:row + 1])
            assert torch.equal(alone.view(-1), out[row, i])


@pytest.mark.parametrize("positions_contiguous", [True, False])
@pytest.mark.parametrize("t", [1, 4])
def test_bf16_queries_over_int8_keys_are_the_fp32_queries_output_rounded_once(t, positions_contiguous):
    # a bf16 decoder's int8 audio (`int8.audio_dtype`): its queries widened exactly, the fp32 queries' arithmetic
    gen = torch.Generator().manual_seed(20 + t)
    b, s = 3, 203
    q = torch.randn(b, t, H, D, generator=gen).bfloat16()
    stored, scales, _ = _int8_store(gen, b, s, positions_contiguous)
    n_seen = torch.randint(1, s + 1, (b, t), generator=gen, dtype=torch.int32)
    out = cpu_attention.attend(q, stored[0], stored[1], n_seen, 0.125, scales[0], scales[1])
    wide = cpu_attention.attend(q.float(), stored[0], stored[1], n_seen, 0.125, scales[0], scales[1])
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, wide.bfloat16())


def test_keys_in_another_dtype_than_the_queries_allow_only_bf16_or_int8_under_fp32_or_int8_under_bf16():
    q = torch.randn(1, 1, H, D).bfloat16()
    keys = torch.randn(1, H, 10, D)
    with pytest.raises(RuntimeError, match="bfloat16 or int8 under float32 queries, or int8 under bfloat16"):
        cpu_attention.attend(q, keys, keys, None, 1.0)
    with pytest.raises(RuntimeError, match="bfloat16 or int8 under float32 queries"):
        cpu_attention.attend(q.float(), keys.bfloat16(), keys, None, 1.0)  # keys and values apart
    with pytest.raises(RuntimeError, match="bfloat16 or int8 under float32 queries"):
        cpu_attention.attend(q, keys.to(torch.int8), keys.bfloat16(), None, 1.0)


def test_int8_keys_take_their_scales_and_only_they_do():
    q = torch.randn(1, 1, H, D)
    keys, scales = torch.zeros(1, H, 10, D, dtype=torch.int8), torch.ones(1, H, D)
    with pytest.raises(RuntimeError, match="key_scales and value_scales with int8"):
        cpu_attention.attend(q, keys, keys, None, 1.0)  # int8 without scales
    with pytest.raises(RuntimeError, match="key_scales and value_scales with int8"):
        cpu_attention.attend(q, keys.float(), keys.float(), None, 1.0, scales, scales)  # scales without int8
    with pytest.raises(RuntimeError, match=r"\(B, H, head_dim\) float32"):
        cpu_attention.attend(q, keys, keys, None, 1.0, scales[..., :-1], scales)


def test_the_channel_quantizer():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 40, generator=gen) * torch.tensor([0.01, 1.0, 300.0])[:, None]
    x[1, 2] = 0.0  # a channel of zeros: scale 1, zeros
    quantized, scales = int8.quantize_channels(x)
    assert quantized.dtype == torch.int8 and quantized.shape == x.shape and scales.shape == (2, 3)
    top = x.abs().amax(-1)
    torch.testing.assert_close(scales, torch.where(top > 0, top / int8.LEVELS, torch.ones_like(top)))
    assert int(quantized.abs().max()) == int8.LEVELS
    assert torch.equal(quantized[1, 2], torch.zeros(40, dtype=torch.int8))
    # each value rounded to its nearest step
    assert bool(((quantized.float() * scales[..., None] - x).abs() <= scales[..., None] * 0.5001).all())


def test_the_decision(monkeypatch):
    monkeypatch.delenv(int8.AUDIO_ENV, raising=False)
    monkeypatch.delenv(int8.INT8_AUDIO_ENV, raising=False)
    assert int8.audio_dtype(CPU, torch.float32, asked=True) == torch.int8
    assert int8.audio_dtype(CPU, torch.float32) == torch.float32  # --dtype float32: fp32 audio
    for asked in (True, False):  # a bf16 decoder, in any precision: int8
        assert int8.audio_dtype(CPU, torch.bfloat16, asked=asked) == torch.int8
    assert int8.audio_dtype(CPU, torch.float16) == torch.float16  # no kernel for fp16: its own
    assert int8.audio_dtype(torch.device("cuda"), torch.float32, asked=True) == torch.float32
    assert int8.audio_dtype(torch.device("cuda"), torch.bfloat16) == torch.bfloat16
    monkeypatch.setenv(int8.INT8_AUDIO_ENV, "1")
    assert int8.audio_dtype(CPU, torch.float32, asked=True) == torch.bfloat16
    assert int8.audio_dtype(CPU, torch.bfloat16) == torch.bfloat16
    monkeypatch.setenv(int8.AUDIO_ENV, "1")
    assert int8.audio_dtype(CPU, torch.float32, asked=True) == torch.float32
    monkeypatch.delenv(int8.AUDIO_ENV)
    monkeypatch.delenv(int8.INT8_AUDIO_ENV)
    monkeypatch.setenv(cpu_attention.DISABLE_ENV, "1")  # torch's products would not take int8 or bf16 audio
    assert int8.audio_dtype(CPU, torch.float32, asked=True) == torch.float32
    assert int8.audio_dtype(CPU, torch.bfloat16) == torch.bfloat16


def test_the_weights_decision(monkeypatch):
    monkeypatch.delenv(int8.WEIGHTS_ENV, raising=False)
    thin = cpu_linear.fused_linear_usable(CPU, torch.float32)
    assert int8.bf16_weights_usable(CPU, torch.float32, asked=True) == thin
    assert not int8.bf16_weights_usable(CPU, torch.float32)  # --dtype float32: fp32 weights
    assert not int8.bf16_weights_usable(CPU, torch.bfloat16, asked=True)  # a bf16 decoder's are bf16 anyway
    assert not int8.bf16_weights_usable(torch.device("cuda"), torch.float32, asked=True)
    monkeypatch.setenv(int8.WEIGHTS_ENV, "1")
    assert not int8.bf16_weights_usable(CPU, torch.float32, asked=True)
    monkeypatch.delenv(int8.WEIGHTS_ENV)
    monkeypatch.setenv(cpu_attention.DISABLE_ENV, "1")  # no thin products: oneDNN's fp32 ones take fp32 weights
    assert not int8.bf16_weights_usable(CPU, torch.float32, asked=True)


def _step_weights_rounded(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` whose decoder step weights (q/k/v, both out projections, the cross-attention query, fc1,
    fc2; not the audio's key/value projections) and an untied output head are rounded to bf16, kept in fp32."""
    import copy

    rounded = copy.deepcopy(model)
    with torch.no_grad():
        for layer in rounded.model.decoder.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                         layer.self_attn.out_proj, layer.encoder_attn.q_proj, layer.encoder_attn.out_proj,
                         layer.fc1, layer.fc2):
                proj.weight.copy_(proj.weight.bfloat16().float())
        rounded.proj_out.weight = torch.nn.Parameter(model.proj_out.weight.detach().bfloat16().float())
    return rounded


@pytest.mark.parametrize("layer_loop", [True, False])
def test_a_decoder_over_bf16_weights_is_fp32_over_the_rounded_weights(monkeypatch, layer_loop):
    """The weights' bf16 copies widened exactly under fp32 rows (`cpu_linear.h`'s `MixedPanels`): bit for bit an
    fp32 decoder whose step weights and head were rounded to bf16 (the audio's projections left fp32)."""
    monkeypatch.delenv(int8.WEIGHTS_ENV, raising=False)
    monkeypatch.setenv(int8.AUDIO_ENV, "1")  # the audio in fp32 in both: only the weights differ
    if not cpu_linear.fused_linear_usable(CPU, torch.float32):
        pytest.skip("the thin products are not used here")
    model = random_whisper("test", seed=4, vocab_size=70, init_std=0.2).eval()
    reference = _step_weights_rounded(model)
    dec = Decoder(model.model.decoder, model.proj_out, int8_precision=True)
    plain = Decoder(reference.model.decoder, reference.proj_out)
    assert dec.bf16_weights and not plain.bf16_weights and dec.audio_dtype == torch.float32
    if not layer_loop:
        dec.layer_loop = plain.layer_loop = None
    n_audio = model.config.max_source_positions
    audio = torch.randn(2, n_audio, model.config.d_model, generator=torch.Generator().manual_seed(5))
    cache, ref_cache = dec.new_cache(2, 20, n_audio), plain.new_cache(2, 20, n_audio)
    dec.write_audio(cache, audio)
    plain.write_audio(ref_cache, audio)
    assert torch.equal(cache.cross_k, ref_cache.cross_k)  # the audio's projections stay the module's fp32
    tokens = torch.tensor([[5, 9, 11], [7, 3, 2]])
    positions = torch.arange(3).expand(2, 3)
    logits = dec.forward(cache, tokens, positions, 4)
    assert torch.equal(logits, plain.forward(ref_cache, tokens, positions, 4))
    fp32 = Decoder(model.model.decoder, model.proj_out)  # and near the fp32 weights' logits, not equal
    fp32_cache = fp32.new_cache(2, 20, n_audio)
    fp32.write_audio(fp32_cache, audio)
    full = fp32.forward(fp32_cache, tokens, positions, 4)
    assert not torch.equal(logits, full) and float((logits - full).abs().max()) < 0.05 * float(full.abs().max())


def _audio_pair(monkeypatch, layer_loop: bool, audio_dtype: torch.dtype, seed: int, rows: int):
    """(int8 precision decoder, plain fp32 decoder, their caches of `rows` rows with the same random audio written)
    over one random model, the weights fp32 in both (only the audio's dtype differs: `audio_dtype`)."""
    monkeypatch.delenv(int8.AUDIO_ENV, raising=False)
    if audio_dtype == torch.int8:
        monkeypatch.delenv(int8.INT8_AUDIO_ENV, raising=False)
    else:
        monkeypatch.setenv(int8.INT8_AUDIO_ENV, "1")  # bf16 audio
    monkeypatch.setenv(int8.WEIGHTS_ENV, "1")
    model = random_whisper("test", seed=seed, vocab_size=70, init_std=0.2).eval()
    dec = Decoder(model.model.decoder, model.proj_out, int8_precision=True)
    plain = Decoder(model.model.decoder, model.proj_out)
    assert dec.audio_dtype == audio_dtype and plain.audio_dtype == torch.float32
    if not layer_loop:
        dec.layer_loop = plain.layer_loop = None
    n_audio = model.config.max_source_positions
    audio = torch.randn(rows, n_audio, model.config.d_model, generator=torch.Generator().manual_seed(seed + 1))
    cache, reference = dec.new_cache(rows, 20, n_audio), plain.new_cache(rows, 20, n_audio)
    dec.write_audio(cache, audio)
    plain.write_audio(reference, audio)
    return dec, plain, cache, reference


@pytest.mark.parametrize("layer_loop", [True, False])
def test_a_decoder_over_bf16_audio_is_fp32_over_the_rounded_audio(monkeypatch, layer_loop):
    dec, plain, cache, reference = _audio_pair(monkeypatch, layer_loop, torch.bfloat16, seed=2, rows=2)
    assert cache.cross_k.dtype == cache.cross_v.dtype == torch.bfloat16 and cache.self_k.dtype == torch.float32
    # the products are fp32's, rounded once as they are stored
    assert torch.equal(cache.cross_k, reference.cross_k.bfloat16())
    assert torch.equal(cache.cross_v, reference.cross_v.bfloat16())
    reference.cross_k.copy_(cache.cross_k)
    reference.cross_v.copy_(cache.cross_v)
    tokens = torch.tensor([[5, 9, 11], [7, 3, 2]])
    positions = torch.arange(3).expand(2, 3)
    assert torch.equal(dec.forward(cache, tokens, positions, 4), plain.forward(reference, tokens, positions, 4))


@pytest.mark.parametrize("layer_loop", [True, False])
def test_a_decoder_over_int8_audio_is_fp32_over_the_scaled_audio(monkeypatch, layer_loop):
    """int8 audio keys/values quantized per channel as they are written (`write_audio`), their scales moved with
    their rows, and the logits an fp32 decoder's over the values they stand for, within fp32 rounding."""
    dec, plain, cache, reference = _audio_pair(monkeypatch, layer_loop, torch.int8, seed=6, rows=3)
    assert cache.cross_k.dtype == torch.int8 and cache.cross_k_scales.shape == (
        len(dec.layers), 3, dec.n_heads, dec.head_dim)
    assert reference.cross_k_scales is None
    for stored, scales, fp32 in ((cache.cross_k, cache.cross_k_scales, reference.cross_k),
                                 (cache.cross_v, cache.cross_v_scales, reference.cross_v)):
        expected, expected_scales = int8.quantize_channels(fp32.transpose(-1, -2).contiguous())
        assert torch.equal(stored.transpose(-1, -2), expected) and torch.equal(scales, expected_scales)
        fp32.copy_(stored.float() * scales[..., None, :])
    # rows moved keep their scales: row 2 into row 0, as a finished row's slot is refilled
    cache.move_row(2, 0, 0)
    reference.move_row(2, 0, 0)
    tokens = torch.tensor([[5, 9, 11], [7, 3, 2], [1, 4, 6]])
    positions = torch.arange(3).expand(3, 3)
    logits = dec.forward(cache, tokens, positions, 4)
    torch.testing.assert_close(logits, plain.forward(reference, tokens, positions, 4), rtol=1e-4, atol=1e-4)


def test_a_runs_memory_counts_one_byte_and_the_scales_an_int8_audio_key():
    bf16 = memory.DecoderShape(6, 8, 64, 4, audio_dtype=torch.bfloat16)
    compact = memory.DecoderShape(6, 8, 64, 4, audio_dtype=torch.int8)
    saved = (memory.row_bytes(memory.RunShape(bf16, None, 450, 1500, 512, 51865, 0, 0))
             - memory.row_bytes(memory.RunShape(compact, None, 450, 1500, 512, 51865, 0, 0)))
    assert saved == 2 * 6 * 8 * 64 * (1500 - 4)  # a byte fewer each, an fp32 scale more a channel


def test_a_runs_memory_counts_two_bytes_an_audio_key():
    fp32 = memory.DecoderShape(6, 8, 64, 4)
    compact = memory.DecoderShape(6, 8, 64, 4, audio_dtype=torch.bfloat16)
    run = memory.RunShape(fp32, None, 450, 1500, 512, 51865, 0, 0)
    saved = memory.row_bytes(run) - memory.row_bytes(memory.RunShape(compact, None, 450, 1500, 512, 51865, 0, 0))
    assert saved == 2 * 6 * 8 * 64 * 1500 * 2  # keys and values, every layer, 2 bytes fewer each


def test_only_int8_audio_carries_channel_scales():
    assert channel_scaled(torch.int8)
    assert not any(channel_scaled(d) for d in (torch.float32, torch.bfloat16, torch.float16))
    shape = (2, 3, H, D, 450, 20)
    assert KVCache.empty(*shape, device=CPU, dtype=torch.float32, audio_dtype=torch.int8).cross_k_scales.shape == (
        2, 3, H, D)
    assert KVCache.empty(*shape, device=CPU, dtype=torch.float32, audio_dtype=torch.bfloat16).audio_scales == (
        None, None)


def test_an_oracle_fingerprint_reads_int8_audio_values_with_their_scales():
    """The oracle draft finds a row's chunk by a few of its audio values: an int8 cache's are those values scaled,
    the same as a cache holding the dequantized values (so two chunks differing only in their scales differ)."""
    from asr_spec.engine.oracle import _fingerprint

    gen = torch.Generator().manual_seed(3)
    compact = KVCache.empty(1, 2, H, D, 8, 20, device=CPU, dtype=torch.float32, audio_dtype=torch.int8)
    compact.cross_v.copy_(torch.randint(-127, 128, compact.cross_v.shape, generator=gen, dtype=torch.int8))
    compact.cross_v_scales.copy_(torch.rand(compact.cross_v_scales.shape, generator=gen) + 0.5)
    plain = KVCache.empty(1, 2, H, D, 8, 20, device=CPU, dtype=torch.float32)
    plain.cross_v.copy_(compact.cross_v.float() * compact.cross_v_scales[:, :, :, None, :])
    torch.testing.assert_close(_fingerprint(compact), _fingerprint(plain))
    compact.cross_v_scales[:, 1] *= 2  # row 1's chunk: the same levels, other scales
    assert not torch.allclose(_fingerprint(compact)[1], _fingerprint(plain)[1])
