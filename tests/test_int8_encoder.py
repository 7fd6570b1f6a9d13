"""The encoder's int8 products (`engine/int8.py`, `cpu_int8.h`): the row quantizer against its definition (8-bit
and 7-bit activations), the products' levels per CPU (AVX2's 7-bit weights), the epilogue against its formula, a
product against float64 within int8's rounding, a row's output independent of the rows beside it, an int8 encoder
near the bf16 / fp32 one and a window's output independent of the batch, speculative == greedy over it, the "int8"
precision end to end, and the one decision where it runs."""

from __future__ import annotations

from dataclasses import replace

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


@pytest.mark.parametrize("levels", [127, 63])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m, k", [(5, 37), (64, 512), (3, 16)])
def test_rows_are_quantized_by_their_own_maximum(int8_kernel, dtype, m, k, levels):
    x = _rows(m, k, dtype=dtype)
    q, scales = int8.quantize(x, levels)
    assert q.dtype == torch.uint8 and q.shape == (m, k) and scales.shape == (m,)
    top = x.float().abs().amax(1)
    torch.testing.assert_close(scales, torch.where(top > 0, top / levels, torch.ones_like(top)))
    expected = torch.round(x.float() * torch.where(top > 0, levels / top, 0.0)[:, None]) + levels + 1
    # x * (levels / max) is one fp32 multiply in both; a tie may round either way only through a different factor
    assert (q.float() - expected).abs().max() <= 1
    assert int(q.min()) >= 1 and int(q.max()) <= 2 * levels + 1 and bool((q[0] == levels + 1).all())
    with pytest.raises(RuntimeError, match="levels must be 127 or 63"):
        int8.quantize(x, 100)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_epilogue_is_its_formula(int8_kernel, dtype):
    gen = torch.Generator().manual_seed(1)
    raw = torch.randn(9, 35, generator=gen).to(dtype)
    scales, bias = torch.rand(9, generator=gen) + 0.1, torch.randn(35, generator=gen)
    residual = torch.randn(9, 35, generator=gen).to(dtype)
    tol = 8e-3 if dtype == torch.bfloat16 else 1e-6  # bf16: rounded once at the end
    kept = raw.clone()
    out = cpu_attention.extension().rescale_rows(raw, scales, bias, residual, False)
    assert out.dtype == dtype and out.data_ptr() == raw.data_ptr()  # in place: raw is the product's temporary
    raw = kept
    exact = raw.double() * scales.double()[:, None] + bias.double() + residual.double()
    torch.testing.assert_close(out.double(), exact, rtol=tol, atol=1e-6)
    bare = cpu_attention.extension().rescale_rows(raw.clone(), scales, bias, None, False)
    torch.testing.assert_close(bare.double(), exact - residual.double(), rtol=tol, atol=1e-6)
    gelu = cpu_attention.extension().rescale_rows(raw.clone(), scales, bias, None, True)
    torch.testing.assert_close(gelu.double(), torch.nn.functional.gelu(exact - residual.double()), rtol=tol,
                               atol=1e-6)
    with pytest.raises(RuntimeError, match="GELU with a residual"):
        cpu_attention.extension().rescale_rows(raw, scales, bias, residual, True)
    with pytest.raises(RuntimeError, match="in raw's dtype"):
        cpu_attention.extension().rescale_rows(raw, scales, bias, residual.double().to(
            torch.float32 if dtype == torch.bfloat16 else torch.bfloat16), False)


def _real_flags() -> str:
    """This machine's own /proc/cpuinfo flags (conftest pins AVX2's for the decisions): "" where unknown."""
    from asr_spec.models import cpu

    try:
        return cpu.CPUINFO.read_text(errors="replace").partition("flags")[2].partition("\n")[0]
    except OSError:
        return ""


def test_weights_are_7_bit_without_vnni(monkeypatch):
    for flags, weights in (("fpu avx2 fma", 63), ("fpu avx2 fma avx_vnni", 127), ("avx512f avx512_vnni", 127)):
        monkeypatch.setattr(cpu_attention, "cpu_flags", lambda flags=flags: flags)
        assert int8.levels() == int8.Levels(activations=127, weights=weights)
    # AVX2's int16 pair sums hold 2 x 255 x 63, not 2 x 255 x 127
    assert 2 * 255 * 63 <= 2 ** 15 - 1 < 2 * 255 * 127


def test_a_weight_is_quantized_in_its_levels():
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(6, 10, generator=gen)
    for levels in (127, 63):
        w = int8.Int8Weight(weight, None, levels)
        torch.testing.assert_close(w.scales, weight.abs().amax(1) / levels)
        assert int8.int8_weight(torch.nn.Linear(4, 3), levels=levels) is not None
    layer = torch.nn.Linear(10, 6)
    assert int8.int8_weight(layer, levels=63) is int8.int8_weight(layer, levels=63)  # shared per levels
    assert int8.int8_weight(layer, levels=63) is not int8.int8_weight(layer, levels=127)


@pytest.mark.parametrize("flags", ["pinned", "native"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("post", ["none", "gelu"])
def test_a_product_agrees_with_float64_within_int8s_rounding(int8_kernel, monkeypatch, post, dtype, flags):
    """The levels `int8.levels` gives: with the suite's pinned AVX2 flags 8-bit activations and 7-bit weights
    (valid on every CPU) and, where this CPU has VNNI, 8-bit both. (8-bit both on an AVX2-only CPU saturate its
    int16 pair sums: ~6 % off there.)"""
    if flags == "native":
        real = _real_flags()
        if "vnni" not in real:
            pytest.skip("8-bit weights need VNNI, which this CPU lacks")
        monkeypatch.setattr(cpu_attention, "cpu_flags", lambda: real)
    gen = torch.Generator().manual_seed(2)
    layer = torch.nn.Linear(96, 80)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(80, 96, generator=gen) * 0.1)
    x = torch.randn(2, 30, 96, generator=gen).to(dtype)
    levels = int8.levels()
    out = int8.int8_linear(x, int8.Int8Weight(layer.weight, layer.bias, levels.weights), levels.activations,
                           post=post)
    exact = torch.nn.functional.linear(x.double(), layer.weight.double(), layer.bias.double())
    if post == "gelu":
        exact = torch.nn.functional.gelu(exact)
    assert out.shape == (2, 30, 80) and out.dtype == dtype
    # 8-bit activations and 7- or 8-bit weights: each product within ~1 % of the row's largest term
    assert ((out.double() - exact).norm() / exact.norm()).item() < 0.03


def test_a_post_op_it_does_not_have_is_refused(int8_kernel):
    weight = int8.Int8Weight(torch.nn.Linear(16, 8).weight, None)
    x = torch.randn(1, 4, 16).bfloat16()
    with pytest.raises(ValueError, match="post"):
        int8.int8_linear(x, weight, 63, post="relu")
    with pytest.raises(ValueError, match="residual"):
        int8.int8_linear(x, weight, 63, post="gelu", residual=torch.zeros(1, 4, 8).bfloat16())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_rows_output_does_not_depend_on_the_rows_beside_it(int8_kernel, dtype):
    """Bit for bit: the integer sums are exact and everything else is per row (the contract of int8.py)."""
    layer = torch.nn.Linear(64, 48)
    weight = int8.Int8Weight(layer.weight, layer.bias)
    x = _rows(40, 64, seed=3, dtype=dtype).view(2, 20, 64)
    residual = torch.randn(2, 20, 48).to(dtype)
    together = int8.int8_linear(x, weight, 63, residual=residual)
    for w in range(2):
        for rows in (slice(0, 20), slice(5, 6), slice(7, 19)):
            alone = int8.int8_linear(x[w:w + 1, rows], weight, 63, residual=residual[w:w + 1, rows])
            assert torch.equal(alone[0], together[w, rows])


def _model_and_features(seed: int = 3, dtype: torch.dtype = torch.bfloat16):
    model = random_whisper("test", seed=seed, vocab_size=70, init_std=0.2).to(dtype)
    features = torch.randn(3, model.config.num_mel_bins, 2 * model.config.max_source_positions,
                           generator=torch.Generator().manual_seed(4)).to(dtype)
    return model, features


def _int8_encoder(monkeypatch, model) -> Encoder:
    """The model's encoder in int8: bf16 as if on an AVX-512 VNNI CPU (the decision patched), fp32 through the
    "int8" precision's mark (`int8.request`), the real decision."""
    if model.dtype == torch.bfloat16:
        monkeypatch.setattr(int8, "int8_encoder_usable", lambda device, dtype, asked=False: True)
    else:
        int8.request(model.model.encoder)
    encoder = Encoder(model.model.encoder)
    if not encoder.int8:
        pytest.skip("the encoder's oneDNN path or its attention kernel is not in use here")
    return encoder


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_an_int8_encoder_is_near_the_plain_one_and_a_window_is_its_own(int8_kernel, no_amx_tiles, monkeypatch,
                                                                       dtype):
    if not onednn_usable(CPU, dtype):
        pytest.skip(f"no oneDNN {dtype} products on this CPU: the encoder runs the module itself")
    model, features = _model_and_features(dtype=dtype)
    # the plain encoder switched off from int8 explicitly: a bf16 encoder is int8 by itself on an AVX-512 VNNI CPU
    monkeypatch.setenv(int8.DISABLE_ENV, "1")
    plain = Encoder(model.model.encoder)
    monkeypatch.delenv(int8.DISABLE_ENV)
    assert not plain.int8
    quantized = _int8_encoder(monkeypatch, model)
    a, b = quantized(features).float(), plain(features).float()
    assert ((a - b).norm() / b.norm()).item() < 0.1  # whisper-base on speech: ~5-6.5 % (docs/cpu.md)
    for w in range(3):  # every stage row-invariant: the stem window by window (fp32) or as products (bf16)
        assert torch.equal(quantized(features[w:w + 1])[0].float(), a[w])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_speculative_equals_greedy_over_an_int8_encoder(int8_kernel, no_amx_tiles, monkeypatch, dtype):
    from asr_spec.engine import DecodeOptions, Engine
    from asr_spec.models.drafts import decoder_draft

    if not onednn_usable(CPU, dtype):
        pytest.skip(f"no oneDNN {dtype} products on this CPU")
    model, features = _model_and_features(seed=5, dtype=dtype)
    _int8_encoder(monkeypatch, model)  # every Engine's encoder below is int8
    opts = DecodeOptions(language="en", max_new_tokens=24, num_draft_tokens=3)
    greedy_engine = Engine(model, None, opts)
    assert greedy_engine.encoder.int8
    # the int8 precision's fp32 decoder and a bf16 decoder hold their audio keys/values in int8 (`int8.audio_dtype`)
    assert greedy_engine.target_dec.audio_dtype == torch.int8
    greedy = greedy_engine.decode(features, None, 2)
    spec_engine = Engine(model, decoder_draft(model, [0]), opts)
    # and so does its draft (its proposals over int8 audio; the target verifies them), in the target's dtype or
    # lowered to bf16 under an fp32 target where oneDNN's bf16 products are native (`DecodeOptions.draft_bf16`)
    draft, target = spec_engine.draft_dec, greedy_engine.target_dec
    lowered = dtype == torch.float32 and onednn_usable(CPU, torch.bfloat16)
    assert draft.dtype == (torch.bfloat16 if lowered else dtype)
    assert draft.audio_dtype == target.audio_dtype == torch.int8
    if lowered:  # kept in fp32 (`draft_bf16` off), it holds the target's int8 too
        kept = Engine(model, decoder_draft(model, [0]), replace(opts, draft_bf16=False)).draft_dec
        assert kept.dtype == torch.float32 and kept.audio_dtype == target.audio_dtype == torch.int8
    spec = spec_engine.decode(features, None, 2)
    assert [r.tokens for r in spec] == [r.tokens for r in greedy]


def test_only_bf16_with_avx512_vnni_and_no_amx_or_fp32_when_asked(int8_kernel, monkeypatch):
    monkeypatch.delenv(int8.DISABLE_ENV, raising=False)
    vnni = "fpu avx2 fma avx512f avx512bw avx512_bf16 avx512_vnni"
    monkeypatch.setattr(cpu_attention, "cpu_flags", lambda: vnni)
    assert int8.int8_encoder_usable(CPU, torch.bfloat16)
    assert not int8.int8_encoder_usable(CPU, torch.float32)
    assert not int8.int8_encoder_usable(torch.device("cuda"), torch.bfloat16)
    for flags in ("fpu avx2 fma", vnni + " amx_bf16 amx_tile"):
        monkeypatch.setattr(cpu_attention, "cpu_flags", lambda flags=flags: flags)
        assert not int8.int8_encoder_usable(CPU, torch.bfloat16)
        assert int8.int8_encoder_usable(CPU, torch.float32, asked=True)  # the "int8" precision: any x86 CPU
    assert not int8.int8_encoder_usable(torch.device("cuda"), torch.float32, asked=True)
    assert not int8.int8_encoder_usable(CPU, torch.float16, asked=True)
    monkeypatch.setattr(cpu_attention, "cpu_flags", lambda: vnni)
    monkeypatch.setenv(int8.DISABLE_ENV, "1")
    assert not int8.int8_encoder_usable(CPU, torch.bfloat16)
    assert not int8.int8_encoder_usable(CPU, torch.float32, asked=True)


def test_the_int8_precision_end_to_end(int8_kernel):
    """`--dtype int8`: fp32 weights, the encoder marked and its products int8, the run summary saying so, and a
    real recording's words near fp32's (whisper-base; the WER on the long fixtures: docs/cpu.md)."""
    from asr_spec import Transcriber
    from asr_spec.eval.metrics import score
    from asr_spec.models.cpu import precision_line

    clip = "tests/fixtures/speech/long_75s.flac"
    runs = {}
    for precision in ("int8", "float32"):
        t = Transcriber.from_pretrained("embedded:whisper-base", dtype=precision, language="en", batch_size=4)
        assert t.target.dtype == torch.float32
        assert t.engine.encoder.int8 == (precision == "int8") == int8.requested(t.target.model.encoder)
        line = precision_line(t.device, t.target.dtype, int8.requested(t.target.model.encoder))
        int8_line = ", encoder products and attention int8, decoder weights bf16, audio keys/values int8"
        assert line.endswith(int8_line) == (precision == "int8"), line
        assert t.engine.encoder.int8_attention == (precision == "int8")
        assert (t.engine.target_dec.audio_dtype == torch.int8) == (precision == "int8")
        runs[precision] = t.transcribe(clip, progress=False)[0].text
    assert score([runs["float32"]], [runs["int8"]]).wer < 0.05, runs
