"""The oneDNN encoder's pieces: convolutions as products over their taps (`conv_rows`), residual adds fused into
the products (`onednn_linear_add`), and the whole encoder against the module's own fp32 forward at several windows
(tolerances, never bit for bit: the kernels round their own way on each CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from asr_spec.engine import encoder as encoder_module
from asr_spec.engine.encoder import Encoder, conv_rows, tap_major
from asr_spec.engine.kernels import onednn_linear_add, onednn_usable
from asr_spec.testing import random_whisper

CPU = torch.device("cpu")
DTYPES = [torch.float32, torch.bfloat16]
# fp32 products round at ~1e-7 relative; bf16 keeps 8 significant bits, rounded after every product
TOL = {torch.float32: 1e-4, torch.bfloat16: 5e-2}


def _needs(dtype: torch.dtype) -> None:
    if not onednn_usable(CPU, dtype):
        pytest.skip(f"no oneDNN {dtype} products on this CPU: the encoder runs the module itself")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n_frames", "stride", "kernel"), [(40, 1, 3), (40, 2, 3), (41, 2, 3), (9, 3, 5)])
def test_conv_rows_equals_conv1d(dtype, n_frames, stride, kernel):
    """Time-major in and out, odd lengths and strides included (padding to a multiple of the stride), bias and
    GELU fused: the module's conv1d then GELU, up to rounding."""
    _needs(dtype)
    gen = torch.Generator().manual_seed(n_frames + stride)
    conv = torch.nn.Conv1d(6, 10, kernel, stride=stride, padding=kernel // 2).to(dtype)
    x = torch.randn(3, 6, n_frames, generator=gen).to(dtype)
    with torch.no_grad():
        ref = F.gelu(F.conv1d(x.float(), conv.weight.float(), conv.bias.float(), stride, kernel // 2))
        got = conv_rows(x.transpose(1, 2), tap_major(conv.weight), conv.bias, stride, kernel // 2, ("gelu", "none"))
    assert got.shape == (3, ref.shape[-1], 10)
    torch.testing.assert_close(got.float(), ref.transpose(1, 2), rtol=TOL[dtype], atol=TOL[dtype])


def test_conv_rows_reads_no_neighbouring_window():
    """Each window's output depends on its own frames only: a window alone gives what it gives in a batch."""
    _needs(torch.float32)
    conv = torch.nn.Conv1d(4, 8, 3, stride=2, padding=1)
    x = torch.randn(3, 21, 4, generator=torch.Generator().manual_seed(1))
    weight = tap_major(conv.weight)
    with torch.no_grad():
        batch = conv_rows(x, weight, conv.bias, 2, 1)
        alone = torch.cat([conv_rows(x[i:i + 1], weight, conv.bias, 2, 1) for i in range(3)])
    torch.testing.assert_close(batch, alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False])
def test_linear_add_is_the_product_plus_the_residual(dtype, bias):
    _needs(dtype)
    gen = torch.Generator().manual_seed(2)
    x, w = torch.randn(2, 7, 16, generator=gen), torch.randn(12, 16, generator=gen) / 4
    b, residual = torch.randn(12, generator=gen) if bias else None, torch.randn(2, 7, 12, generator=gen)
    got = onednn_linear_add(x.to(dtype), w.to(dtype), None if b is None else b.to(dtype), residual.to(dtype))
    assert got.shape == residual.shape
    torch.testing.assert_close(got.float(), residual + F.linear(x, w, b), rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_windows", [1, 4])
def test_encoder_equals_the_modules_fp32_forward(dtype, n_windows):
    """The oneDNN encoder in `dtype` against the module's own forward in fp32 (bf16: within bf16's rounding); its
    output contiguous, (N, n_audio_ctx, d_model)."""
    _needs(dtype)
    model = random_whisper("test", seed=3, vocab_size=70, init_std=0.2)
    ctx = model.config.max_source_positions
    features = torch.randn(n_windows, model.config.num_mel_bins, 2 * ctx, generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        ref = model.model.encoder(input_features=features).last_hidden_state
    enc = Encoder(model.to(dtype).model.encoder)
    assert enc.fast and enc.conv_products == (dtype == torch.bfloat16)
    out = enc(features.to(dtype))
    assert out.shape == (n_windows, ctx, model.config.d_model) and out.is_contiguous()
    torch.testing.assert_close(out.float(), ref, rtol=TOL[dtype], atol=TOL[dtype])


def test_the_stem_is_contiguous_in_both_convolution_paths():
    """fp32 (the module's convolutions) and bf16 (products): the hidden state leaves the stem (N, S, d) contiguous,
    the layout every residual add, LayerNorm and product after it reads without a copy."""
    for dtype in DTYPES:
        if not onednn_usable(CPU, dtype):
            continue
        model = random_whisper("test", seed=3, vocab_size=70, init_std=0.2).to(dtype)
        enc = Encoder(model.model.encoder)
        features = torch.randn(2, model.config.num_mel_bins, 2 * model.config.max_source_positions).to(dtype)
        with torch.inference_mode():
            x = enc.stem(features)
        assert x.shape == (2, model.config.max_source_positions, model.config.d_model) and x.is_contiguous()


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_windows_stem_does_not_depend_on_its_batch(dtype, monkeypatch):
    """Each window's stem is computed alone: even where the stem's products rounded with their number of windows
    (simulated: an offset that grows with it, as a kernel chosen by the shape might round), a window's stem is the
    same in a batch of three as alone."""
    _needs(dtype)
    model = random_whisper("test", seed=3, vocab_size=70, init_std=0.2).to(dtype)
    enc = Encoder(model.model.encoder)
    if enc.conv_products:
        real = encoder_module.conv_rows
        monkeypatch.setattr(encoder_module, "conv_rows", lambda x, *a, **k: real(x, *a, **k) + 0.05 * (len(x) - 1))
    else:
        for conv in (enc.module.conv1, enc.module.conv2):
            monkeypatch.setattr(conv, "forward", lambda x, conv=conv: F.conv1d(
                x, conv.weight, conv.bias, conv.stride, conv.padding) + 0.05 * (len(x) - 1))
    features = torch.randn(3, model.config.num_mel_bins, 2 * model.config.max_source_positions,
                           generator=torch.Generator().manual_seed(5)).to(dtype)
    with torch.inference_mode():
        whole = enc.stem(features)
        for i in range(3):
            assert torch.equal(enc.stem(features[i: i + 1])[0], whole[i])


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_benchmarks_stages_compose_to_each_whole_forward(dtype):
    """benchmarks.bench_encoder times stages; chained, each side's stages give its whole forward, so the stage
    rows add up to what runs (and the engine's encoder is the one timed)."""
    _needs(dtype)
    from benchmarks.bench_encoder import encoder_stages, engine_encoder, module_stages

    model = random_whisper("test", seed=3, vocab_size=70, init_std=0.2).to(dtype).eval()
    features = torch.randn(2, model.config.num_mel_bins, 2 * model.config.max_source_positions,
                           generator=torch.Generator().manual_seed(6)).to(dtype)
    enc = model.model.encoder
    for stages, whole in ((module_stages(enc), lambda f: enc(input_features=f).last_hidden_state),
                          (encoder_stages(engine_encoder(model)), engine_encoder(model))):
        assert [name for name, _ in stages] == ["stem", *["attention", "mlp"] * len(enc.layers), "final norm"]
        with torch.inference_mode():
            x = features
            for _, fn in stages:
                x = fn(x)
            torch.testing.assert_close(x.float(), whole(features).float(), rtol=TOL[dtype], atol=TOL[dtype])
