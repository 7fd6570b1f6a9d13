"""The int8 precision's decoder: fp32, its audio keys/values held in bf16 (`int8.bf16_audio_usable`) and its step's
weights read in bf16 (`int8.bf16_weights_usable`). The attention kernel under fp32 queries over bf16 keys/values is
exactly fp32 attention over their widened values (both layouts, ragged counts), a decoder's logits are an fp32
decoder's over the bf16-rounded audio, and over the bf16-rounded weights, bit for bit (its layer loop and its
Python loop), the two decisions, and the memory a run needs counting 2 bytes an audio key."""

from __future__ import annotations

import pytest
import torch

from asr_spec.engine import cpu_attention, cpu_linear, int8, memory
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


def test_keys_in_another_dtype_than_the_queries_allow_only_bf16_under_fp32():
    q = torch.randn(1, 1, H, D).bfloat16()
    keys = torch.randn(1, H, 10, D)
    with pytest.raises(RuntimeError, match="bfloat16 under float32 queries"):
        cpu_attention.attend(q, keys, keys, None, 1.0)
    with pytest.raises(RuntimeError, match="bfloat16 under float32 queries"):
        cpu_attention.attend(q.float(), keys.bfloat16(), keys, None, 1.0)  # keys and values apart


def test_the_decision(monkeypatch):
    monkeypatch.delenv(int8.AUDIO_ENV, raising=False)
    assert int8.bf16_audio_usable(CPU, torch.float32, asked=True)
    assert not int8.bf16_audio_usable(CPU, torch.float32)  # --dtype float32: fp32 audio
    assert not int8.bf16_audio_usable(CPU, torch.bfloat16, asked=True)  # a bf16 decoder's audio is bf16 anyway
    assert not int8.bf16_audio_usable(torch.device("cuda"), torch.float32, asked=True)
    monkeypatch.setenv(int8.AUDIO_ENV, "1")
    assert not int8.bf16_audio_usable(CPU, torch.float32, asked=True)
    monkeypatch.delenv(int8.AUDIO_ENV)
    monkeypatch.setenv(cpu_attention.DISABLE_ENV, "1")  # torch's products would not take bf16 audio
    assert not int8.bf16_audio_usable(CPU, torch.float32, asked=True)


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


@pytest.mark.parametrize("layer_loop", [True, False])
def test_a_decoder_over_bf16_audio_is_fp32_over_the_rounded_audio(monkeypatch, layer_loop):
    monkeypatch.delenv(int8.AUDIO_ENV, raising=False)
    monkeypatch.setenv(int8.WEIGHTS_ENV, "1")  # the weights in fp32 in both: only the audio differs
    model = random_whisper("test", seed=2, vocab_size=70, init_std=0.2).eval()
    dec = Decoder(model.model.decoder, model.proj_out, int8_precision=True)
    plain = Decoder(model.model.decoder, model.proj_out)
    assert dec.audio_dtype == torch.bfloat16 and plain.audio_dtype == torch.float32
    if not layer_loop:
        dec.layer_loop = plain.layer_loop = None
    n_audio = model.config.max_source_positions
    audio = torch.randn(2, n_audio, model.config.d_model, generator=torch.Generator().manual_seed(3))
    cache, reference = dec.new_cache(2, 20, n_audio), plain.new_cache(2, 20, n_audio)
    assert cache.cross_k.dtype == cache.cross_v.dtype == torch.bfloat16 and cache.self_k.dtype == torch.float32
    dec.write_audio(cache, audio)
    plain.write_audio(reference, audio)
    # the products are fp32's, rounded once as they are stored
    assert torch.equal(cache.cross_k, reference.cross_k.bfloat16())
    assert torch.equal(cache.cross_v, reference.cross_v.bfloat16())
    reference.cross_k.copy_(cache.cross_k)
    reference.cross_v.copy_(cache.cross_v)
    tokens = torch.tensor([[5, 9, 11], [7, 3, 2]])
    positions = torch.arange(3).expand(2, 3)
    assert torch.equal(dec.forward(cache, tokens, positions, 4), plain.forward(reference, tokens, positions, 4))


def test_a_runs_memory_counts_two_bytes_an_audio_key():
    fp32 = memory.DecoderShape(6, 8, 64, 4)
    compact = memory.DecoderShape(6, 8, 64, 4, audio_bytes=2)
    run = memory.RunShape(fp32, None, 450, 1500, 512, 51865, 0, 0)
    saved = memory.row_bytes(run) - memory.row_bytes(memory.RunShape(compact, None, 450, 1500, 512, 51865, 0, 0))
    assert saved == 2 * 6 * 8 * 64 * 1500 * 2  # keys and values, every layer, 2 bytes fewer each
