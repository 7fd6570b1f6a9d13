"""A decoder's layers in one extension call (`engine/cpu_layers.py`, `cpu_decoder.h`): the same logits and the same
cache writes as the decoder's Python layer loop, bit for bit (the same kernels in the same order, on whatever CPU
runs the suite), in fp32 and bf16, with the thin products and with oneDNN's; an engine's transcript the same; and
the one decision where it is used."""

from __future__ import annotations

import copy

import pytest
import torch

from asr_spec.engine import DecodeOptions, Engine, cpu_attention, cpu_layers, cpu_linear
from asr_spec.engine import decoder as decoder_module
from asr_spec.engine.decoder import Decoder
from asr_spec.engine.kernels import onednn_linear
from asr_spec.models.loading import decoder_draft
from asr_spec.testing import random_whisper


def passes(decoder: Decoder, audio: torch.Tensor) -> tuple[list[torch.Tensor], object]:
    """A ragged prompt pass (one row's last entry a padding entry past the cache, clamped), a 1-token step and a
    4-token verify-shaped pass over 3 rows: (their logits, the cache)."""
    gen = torch.Generator().manual_seed(0)
    cache = decoder.new_cache(3, 24, audio.shape[1])
    decoder.write_audio(cache, audio)
    prompt = torch.randint(0, 60, (3, 5), generator=gen)
    positions = torch.tensor([[0, 1, 2, 3, 4], [0, 1, 2, 3, 4], [0, 1, 2, 3, 30]])
    logits = [decoder.forward(cache, prompt, positions, 8)]
    logits.append(decoder.forward(cache, prompt[:, :1], torch.tensor([[5], [5], [4]]), 8))
    logits.append(decoder.forward(cache, prompt[:, 1:], torch.tensor([[6], [6], [5]]) + torch.arange(4), 16))
    return logits, cache


@pytest.mark.parametrize("products", ["thin", "onednn"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_call_gives_the_python_loops_logits_and_cache_bit_for_bit(thin_kernel_no_amx, monkeypatch, dtype,
                                                                      products):
    """With either kind of products: the thin kernel's, or oneDNN's over packed weights (as on a CPU with AMX
    tiles in bf16; in the probe's row-invariant pieces there)."""
    if products == "onednn":
        monkeypatch.setattr(cpu_linear, "fused_linear_usable", lambda device, dtype: False)
    model = random_whisper("test", seed=5, init_std=0.2).to(dtype)
    decoder = Decoder(model.model.decoder, model.proj_out)
    if products == "onednn" and decoder.wide_linear is not onednn_linear:
        pytest.skip("oneDNN's products are not used for this dtype on this CPU")
    assert decoder.layer_loop is not None and decoder.thin == (products == "thin")
    assert decoder.layer_loop.rows == (-1 if products == "thin" else decoder.row_rows)
    audio = torch.randn(3, model.config.max_source_positions, model.config.d_model,
                        generator=torch.Generator().manual_seed(1)).to(dtype)
    one_call, cache_a = passes(decoder, audio)
    decoder.layer_loop = None  # the Python layer loop
    loop, cache_b = passes(decoder, audio)
    for a, b in zip(one_call, loop):
        assert torch.equal(a, b)
    for name in ("self_k", "self_v", "cross_k", "cross_v"):
        assert torch.equal(getattr(cache_a, name), getattr(cache_b, name)), name
    assert one_call[0].isfinite().all()


def test_an_engines_greedy_and_speculative_transcripts_are_the_python_loops(thin_kernel_no_amx, monkeypatch):
    """Greedy and speculative decoding (the target as its own 2-layer draft) through the one call and through the
    Python loop: the same tokens, log-probabilities and no-speech probabilities."""
    model = random_whisper("test", seed=6, init_std=0.2, vocab_size=70, decoder_layers=3)
    audio = torch.randn(4, model.config.max_source_positions, model.config.d_model,
                        generator=torch.Generator().manual_seed(2))
    options = DecodeOptions(language="en", max_new_tokens=24, num_draft_tokens=3)
    draft = decoder_draft(model, [0, 2])
    runs = {}
    for name, loop in (("one call", cpu_layers.layer_loop), ("python", lambda dec: None)):
        monkeypatch.setattr(cpu_layers, "layer_loop", loop)
        for kind, d in (("greedy", None), ("speculative", draft)):
            engine = Engine(model, d, options)
            assert (engine.target_dec.layer_loop is not None) == (name == "one call")
            runs[name, kind] = [(r.tokens, r.avg_logprob, r.no_speech_prob) for r in engine.decode(None, audio, 4)]
    for kind in ("greedy", "speculative"):
        assert runs["one call", kind] == runs["python", kind]
    assert [r[0] for r in runs["one call", "speculative"]] == [r[0] for r in runs["one call", "greedy"]]
    assert any(len(r[0]) > 3 for r in runs["one call", "greedy"])


def test_the_decision(thin_kernel_no_amx, monkeypatch):
    """The one call where the attention kernel runs a decoder with an erf GELU and its products are the thin
    kernel's or oneDNN's over packed weights (bf16 on a CPU with AMX tiles, where oneDNN's bf16 products are
    there); the Python loop with a tanh GELU (not in the products' epilogue), with unpacked products, and with
    the kernels disabled."""
    model = random_whisper("test", seed=7)
    assert Decoder(model.model.decoder, model.proj_out).layer_loop is not None
    tanh = copy.deepcopy(model)
    tanh.model.decoder.config.activation_function = "gelu_new"
    assert Decoder(tanh.model.decoder, tanh.proj_out).layer_loop is None
    low = copy.deepcopy(model).to(torch.bfloat16)
    with monkeypatch.context() as amx:
        amx.setattr(cpu_attention, "cpu_flags", lambda: "flags : avx2 avx512f avx512_bf16 amx_bf16 amx_tile")
        on_amx = Decoder(low.model.decoder, low.proj_out)
        assert not on_amx.thin
        assert (on_amx.layer_loop is not None) == (on_amx.wide_linear is onednn_linear)
    with monkeypatch.context() as unpacked:
        unpacked.setattr(cpu_linear, "fused_linear_usable", lambda device, dtype: False)
        unpacked.setattr(decoder_module, "onednn_usable", lambda device, dtype: False)
        assert Decoder(model.model.decoder, model.proj_out).layer_loop is None
    monkeypatch.setenv(cpu_attention.DISABLE_ENV, "1")
    assert Decoder(model.model.decoder, model.proj_out).layer_loop is None


def test_a_bad_position_or_cache_fails_the_call_before_anything_is_written(thin_kernel_no_amx):
    """The one call copies each pass's keys and values into the cache by raw pointers: a position outside the cache
    (a caller's clamp missing), a cache of another dtype (entries of another size) or of other heads would write
    outside it. Each is refused before the first write, so the cache stays as it was."""
    model = random_whisper("test", seed=8, init_std=0.2)
    decoder = Decoder(model.model.decoder, model.proj_out)
    assert decoder.layer_loop is not None
    cache = decoder.new_cache(2, 16, model.config.max_source_positions)
    decoder.write_audio(cache, torch.randn(2, model.config.max_source_positions, model.config.d_model))
    x = torch.randn(2, 3, model.config.d_model)
    n_seen = torch.full((2, 3), 3, dtype=torch.int32)
    before = cache.self_k.clone(), cache.self_v.clone()
    positions = cache.self_k.shape[3]
    for bad in ([[0, 1, positions], [0, 1, 2]], [[0, 1, 2], [-1, 0, 1]]):
        with pytest.raises(RuntimeError, match=r"write_pos\[.*is out of \[0, "):
            decoder.layer_loop(x, cache, torch.tensor(bad), n_seen)
        assert torch.equal(cache.self_k, before[0]) and torch.equal(cache.self_v, before[1])
    good = torch.tensor([[0, 1, 2], [0, 1, 2]])
    with pytest.raises(RuntimeError, match="one dtype"):
        decoder.layer_loop(x.to(torch.bfloat16), cache, good, n_seen)
    assert torch.equal(cache.self_k, before[0])
    decoder.layer_loop(x, cache, good, n_seen)  # the same call with good positions writes them
    assert not torch.equal(cache.self_k, before[0])
