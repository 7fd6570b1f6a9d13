"""The encoder's int8 products (`engine/int8.py`, `cpu_int8.h`): the row quantizer against its definition, the
epilogue against its formula, a product against float64 within int8's rounding, a row's output independent of the
rows beside it, an int8 encoder near the bf16 one and a window's output independent of the batch, speculative ==
greedy over it, and the one decision where it runs."""

from __future__ import annotations

import pytest
import torch

from asr_spec.engine import cpu_attention, int8
from asr_spec.engine.encoder import Encoder
from asr_spec.engine.kernels import onednn_usable
from asr_spec.testing import random_whisper

CPU = torch.device("cpu")


@pytest.fixture
def int8_kernel(kernel):
    """conftest's `kernel`, and oneDNN's int8 linear in this torch."""
    if not int8._onednn_int8():
        pytest.skip("this torch has no oneDNN int8 linear")


def _rows(m: int, k: int, seed: int = 0, dtype=torch.bfloat16) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * torch.rand(m, 1, generator=gen) * 4
    x[0] = 0.0  # an all-zero row: scale 1, every element the zero point
    x[1, 3] = 40.0  # an outlier: its own row's scale only
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m, k", [(5, 37), (64, 512), (3, 16)])
def test_rows_are_quantized_by_their_own_maximum(int8_kernel, dtype, m, k):
    x = _rows(m, k, dtype=dtype)
    q, scales = int8.quantize(x)
    assert q.dtype == torch.uint8 and q.shape == (m, k) and scales.shape == (m,)
    top = x.float().abs().amax(1)
    torch.testing.assert_close(scales, torch.where(top > 0, top / int8.LEVELS, torch.ones_like(top)))
    expected = torch.round(x.float() * torch.where(top > 0, int8.LEVELS / top, 0.0)[:, None]) + int8.ZERO_POINT
    # x * (127 / max) is one fp32 multiply in both; a tie may round either way only through a different factor
    assert (q.float() - expected).abs().max() <= 1
    assert int(q.min()) >= 1 and int(q.max()) <= 255 and bool((q[0] == int8.ZERO_POINT).all())


def test_the_epilogue_is_its_formula(int8_kernel):
    gen = torch.Generator().manual_seed(1)
    raw = torch.randn(9, 35, generator=gen).bfloat16()
    scales, bias = torch.rand(9, generator=gen) + 0.1, torch.randn(35, generator=gen)
    residual = torch.randn(9, 35, generator=gen).bfloat16()
    out = cpu_attention.extension().rescale_rows(raw, scales, bias, residual, False)
    exact = raw.double() * scales.double()[:, None] + bias.double() + residual.double()
    torch.testing.assert_close(out.double(), exact, rtol=8e-3, atol=1e-6)
    bare = cpu_attention.extension().rescale_rows(raw, scales, bias, None, False)
    torch.testing.assert_close(bare.double(), exact - residual.double(), rtol=8e-3, atol=1e-6)
    gelu = cpu_attention.extension().rescale_rows(raw, scales, bias, None, True)
    torch.testing.assert_close(gelu.double(), torch.nn.functional.gelu(exact - residual.double()), rtol=8e-3,
                               atol=1e-6)
    with pytest.raises(RuntimeError, match="GELU with a residual"):
        cpu_attention.extension().rescale_rows(raw, scales, bias, residual, True)


@pytest.mark.parametrize("post", ["none", "gelu"])
def test_a_product_agrees_with_float64_within_int8s_rounding(int8_kernel, post):
    gen = torch.Generator().manual_seed(2)
    layer = torch.nn.Linear(96, 80)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(80, 96, generator=gen) * 0.1)
    x = torch.randn(2, 30, 96, generator=gen).bfloat16()
    out = int8.int8_linear(x, int8.Int8Weight(layer.weight, layer.bias), post=post)
    exact = torch.nn.functional.linear(x.double(), layer.weight.double(), layer.bias.double())
    if post == "gelu":
        exact = torch.nn.functional.gelu(exact)
    assert out.shape == (2, 30, 80) and out.dtype == torch.bfloat16
    # 7-bit activations and weights: each product within ~1 % of the row's largest term; summed over 96 terms
    assert ((out.double() - exact).norm() / exact.norm()).item() < 0.03


def test_a_post_op_it_does_not_have_is_refused(int8_kernel):
    weight = int8.Int8Weight(torch.nn.Linear(16, 8).weight, None)
    x = torch.randn(1, 4, 16).bfloat16()
    with pytest.raises(ValueError, match="post"):
        int8.int8_linear(x, weight, post="relu")
    with pytest.raises(ValueError, match="residual"):
        int8.int8_linear(x, weight, post="gelu", residual=torch.zeros(1, 4, 8).bfloat16())


def test_a_rows_output_does_not_depend_on_the_rows_beside_it(int8_kernel):
    """Bit for bit: the integer sums are exact and everything else is per row (the contract of int8.py)."""
    layer = torch.nn.Linear(64, 48)
    weight = int8.Int8Weight(layer.weight, layer.bias)
    x = _rows(40, 64, seed=3).view(2, 20, 64)
    residual = torch.randn(2, 20, 48).bfloat16()
    together = int8.int8_linear(x, weight, residual=residual)
    for w in range(2):
        for rows in (slice(0, 20), slice(5, 6), slice(7, 19)):
            alone = int8.int8_linear(x[w:w + 1, rows], weight, residual=residual[w:w + 1, rows])
            assert torch.equal(alone[0], together[w, rows])


def _model_and_features(seed: int = 3):
    model = random_whisper("test", seed=seed, vocab_size=70, init_std=0.2).to(torch.bfloat16)
    features = torch.randn(3, model.config.num_mel_bins, 2 * model.config.max_source_positions,
                           generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    return model, features


def _int8_encoder(monkeypatch, model) -> Encoder:
    monkeypatch.setattr(int8, "int8_encoder_usable", lambda device, dtype: True)
    encoder = Encoder(model.model.encoder)
    if not encoder.int8:
        pytest.skip("the encoder's bf16 oneDNN path or its attention kernel is not in use here")
    return encoder


def test_an_int8_encoder_is_near_the_bf16_one_and_a_window_is_its_own(int8_kernel, no_amx_tiles, monkeypatch):
    if not onednn_usable(CPU, torch.bfloat16):
        pytest.skip("no oneDNN bf16 products on this CPU: the encoder runs the module itself")
    model, features = _model_and_features()
    plain = Encoder(model.model.encoder)
    quantized = _int8_encoder(monkeypatch, model)
    a, b = quantized(features).float(), plain(features).float()
    assert ((a - b).norm() / b.norm()).item() < 0.1  # whisper-base on speech: ~5 % (int8.py)
    for w in range(3):
        assert torch.equal(quantized(features[w:w + 1])[0].float(), a[w])


def test_speculative_equals_greedy_over_an_int8_encoder(int8_kernel, no_amx_tiles, monkeypatch):
    from asr_spec.engine import DecodeOptions, Engine
    from asr_spec.models.drafts import decoder_draft

    if not onednn_usable(CPU, torch.bfloat16):
        pytest.skip("no oneDNN bf16 products on this CPU")
    model, features = _model_and_features(seed=5)
    _int8_encoder(monkeypatch, model)  # every Engine's encoder below is int8
    opts = DecodeOptions(language="en", max_new_tokens=24, num_draft_tokens=3)
    greedy = Engine(model, None, opts).decode(features, None, 2)
    spec = Engine(model, decoder_draft(model, [0]), opts).decode(features, None, 2)
    assert [r.tokens for r in spec] == [r.tokens for r in greedy]


def test_only_bf16_with_avx512_vnni_and_no_amx(int8_kernel, monkeypatch):
    monkeypatch.delenv(int8.DISABLE_ENV, raising=False)
    vnni = "fpu avx2 fma avx512f avx512bw avx512_bf16 avx512_vnni"
    monkeypatch.setattr(cpu_attention, "cpu_flags", lambda: vnni)
    assert int8.int8_encoder_usable(CPU, torch.bfloat16)
    assert not int8.int8_encoder_usable(CPU, torch.float32)
    assert not int8.int8_encoder_usable(torch.device("cuda"), torch.bfloat16)
    for flags in ("fpu avx2 fma", vnni + " amx_bf16 amx_tile"):
        monkeypatch.setattr(cpu_attention, "cpu_flags", lambda flags=flags: flags)
        assert not int8.int8_encoder_usable(CPU, torch.bfloat16)
    monkeypatch.setattr(cpu_attention, "cpu_flags", lambda: vnni)
    monkeypatch.setenv(int8.DISABLE_ENV, "1")
    assert not int8.int8_encoder_usable(CPU, torch.bfloat16)
