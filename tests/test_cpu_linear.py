"""The thin fp32 and bf16 products of the CPU kernel extension (`engine/cpu_linear.py`, `cpu_linear.h`): the panel
layouts, agreement with a float64 product within the dtype's rounding, each row the same bits whatever the rows
beside it, fp32 rows over bf16 panels (the certified head's) as fp32 over the widened weights, and a decoder whose
verify pass gives every position what its 1-token steps give it, in both dtypes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from asr_spec.engine import cpu_attention, cpu_linear, int8
from asr_spec.engine.decoder import Decoder
from asr_spec.engine.kernels import ANY_ROWS
from asr_spec.testing import random_whisper


def test_panels_hold_each_column_once_and_zeros_past_the_last():
    """Pure layout: column n of W^T in panel n // nb at lane n % nb, the last panel padded with zeros."""
    weight = torch.arange(5 * 3, dtype=torch.float32).view(5, 3)
    panels = cpu_linear.panels_of(weight, 4)
    assert panels.shape == (2, 3, 4) and panels.is_contiguous()
    for n in range(5):
        assert torch.equal(panels[n // 4, :, n % 4], weight[n])
    assert torch.equal(panels[1, :, 1:], torch.zeros(3, 3))


def test_pair_panels_put_k_pairs_side_by_side_with_a_zero_past_an_odd_k():
    """Pure layout of the bf16 panels: element [p, i, c, e] is W[p * nb + c, 2 i + e], zeros past N and past K."""
    weight = torch.arange(5 * 3, dtype=torch.float32).view(5, 3) + 1
    pairs = cpu_linear.pair_panels_of(weight, 4)
    assert pairs.shape == (2, 2, 4, 2) and pairs.is_contiguous()
    for n in range(5):
        for k in range(3):
            assert pairs[n // 4, k // 2, n % 4, k % 2] == weight[n, k]
        assert pairs[n // 4, 1, n % 4, 1] == 0
    assert torch.equal(pairs[1, :, 1:], torch.zeros(2, 3, 2))


# the output's own rounding: none beyond the fp32 sums' in fp32, half an ulp of 8 bits in bf16
ROUNDING = {torch.float32: 0.0, torch.bfloat16: 2.0 ** -8}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, k", [(512, 512), (1536, 512), (37, 20), (37, 21), (51865, 64)])
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 33])
def test_agrees_with_a_float64_product_within_the_dtypes_rounding(thin_kernel, dtype, n, k, rows):
    """Against the float64 product of the same (rounded) operands: fp32 sums (~1e-6 relative per sqrt(k) terms),
    then the output rounded once to the dtype."""
    gen = torch.Generator().manual_seed(n + rows)
    weight, bias = torch.randn(n, k, generator=gen).to(dtype), torch.randn(n, generator=gen).to(dtype)
    x, residual = torch.randn(2, rows, k, generator=gen).to(dtype), torch.randn(2, rows, n, generator=gen).to(dtype)
    panels = cpu_linear.pack_panels(weight)
    assert panels.shape == (n, k) and panels.data.dtype == dtype
    exact = F.linear(x.double(), weight.double(), bias.double())
    tol = 1e-6 * k ** 0.5 * exact.abs().max().item()
    rtol = ROUNDING[dtype]
    torch.testing.assert_close(cpu_linear.linear(x, panels, bias).double(), exact, atol=tol, rtol=rtol)
    torch.testing.assert_close(cpu_linear.linear(x, panels, None).double(), exact - bias.double(), atol=tol,
                               rtol=rtol)
    torch.testing.assert_close(cpu_linear.linear_add(x, panels, bias, residual).double(), exact + residual.double(),
                               atol=tol, rtol=rtol)
    gelu = cpu_linear.linear(x, panels, bias, "gelu", "none")  # GELU's slope is at most 1.13
    torch.testing.assert_close(gelu.double(), F.gelu(exact), atol=1.2 * tol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_epilogue_gelu_is_erf_gelu(thin_kernel, dtype):
    """`gelu_erf` (Abramowitz and Stegun's erf, |error| <= 1.5e-7: absolute, not relative, far in the negative
    tail) against float64 erf GELU over [-12, 12]: an identity product hands it exact inputs; the error within
    4e-7 of max(1, |x|) plus the output's one rounding."""
    x = torch.linspace(-12, 12, 4801).to(dtype)[:, None]
    panels = cpu_linear.pack_panels(torch.eye(1, dtype=dtype))
    got = cpu_linear.linear(x, panels, None, "gelu", "none").double()[:, 0]
    exact = F.gelu(x.double()[:, 0])
    bound = 4e-7 * x.double()[:, 0].abs().clamp(min=1) + ROUNDING[dtype] * exact.abs()
    assert bool(((got - exact).abs() <= bound).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 7, 16, 33, 100])
def test_the_epilogue_rounds_each_output_once_as_torch_does(thin_kernel, dtype, n):
    """Exact products (K = 1: x w is exact in fp32) isolate the epilogue: x w + b, + residual, in fp32 in that
    order, rounded once to the dtype as torch rounds (to nearest even, a NaN stays NaN), bit for bit, in every lane
    of a panel and in a last panel's first columns (n below, at and past a vector's lanes)."""
    gen = torch.Generator().manual_seed(n)
    weight, bias = torch.randn(n, 1, generator=gen).to(dtype), torch.randn(n, generator=gen).to(dtype)
    x, residual = torch.randn(6, 1, generator=gen).to(dtype), torch.randn(6, n, generator=gen).to(dtype)
    x[5, 0] = float("nan")
    panels = cpu_linear.pack_panels(weight)
    product = x.float() * weight.float()[:, 0]
    cases = {"plain": (cpu_linear.linear(x, panels, None), product),
             "bias": (cpu_linear.linear(x, panels, bias), product + bias.float()),
             "residual": (cpu_linear.linear_add(x, panels, bias, residual), product + bias.float() + residual.float())}
    for name, (got, sums) in cases.items():
        want = sums.to(dtype)
        assert torch.equal(got[:5], want[:5]), name
        assert bool(got[5].isnan().all()), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [2, 5, 8, 32])
def test_each_row_is_what_it_is_alone(thin_kernel, dtype, rows):
    """The contract the decoder's lossless verify pass rests on: bit for bit, any number of rows and threads."""
    gen = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(2048, 512, generator=gen).to(dtype), torch.randn(2048, generator=gen).to(dtype)
    x = torch.randn(rows, 512, generator=gen).to(dtype)
    panels = cpu_linear.pack_panels(weight)
    residual = torch.randn(rows, 2048, generator=gen).to(dtype)
    runs = {"plain": lambda rows: cpu_linear.linear(x[rows], panels, bias),
            "gelu": lambda rows: cpu_linear.linear(x[rows], panels, bias, "gelu", "none"),
            "residual": lambda rows: cpu_linear.linear_add(x[rows], panels, bias, residual[rows])}
    together = {name: run(slice(None)) for name, run in runs.items()}
    threads = torch.get_num_threads()
    try:
        for n_threads in (1, 2):
            torch.set_num_threads(n_threads)
            for name, run in runs.items():
                alone = torch.cat([run(slice(i, i + 1)) for i in range(rows)])
                assert torch.equal(alone, together[name]), name
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("n, k", [(51865, 64), (37, 21), (16, 512)])
def test_fp32_rows_over_bf16_panels_are_fp32_over_the_widened_weights(thin_kernel, n, k):
    """`MixedPanels`: each bf16 weight widened exactly, the same fused multiply-adds in the same order as the fp32
    panels' (k in order; an odd K's padding adds a zero product): bit for bit the fp32 product of the rounded
    weights, each row what it is alone."""
    gen = torch.Generator().manual_seed(k)
    weight, bias = torch.randn(n, k, generator=gen).bfloat16(), torch.randn(n, generator=gen)
    x = torch.randn(9, k, generator=gen) * 10
    mixed = cpu_linear.linear(x, cpu_linear.repack(weight), bias)
    assert mixed.dtype == torch.float32
    assert torch.equal(mixed, cpu_linear.linear(x, cpu_linear.repack(weight.float()), bias))
    alone = torch.cat([cpu_linear.linear(x[i:i + 1], cpu_linear.repack(weight), bias) for i in range(len(x))])
    assert torch.equal(alone, mixed)


def test_rows_of_a_wider_tensor_are_read_in_place(thin_kernel):
    """A slice of a wider output (rows apart in memory, as q of a fused q/k/v product) gives what its copy gives."""
    gen = torch.Generator().manual_seed(3)
    wide = torch.randn(4, 3 * 64, generator=gen)
    panels = cpu_linear.pack_panels(torch.randn(32, 64, generator=gen))
    assert torch.equal(cpu_linear.linear(wide[:, 64:128], panels, None),
                       cpu_linear.linear(wide[:, 64:128].contiguous(), panels, None))


def test_bad_operands_are_refused(thin_kernel):
    panels = cpu_linear.pack_panels(torch.randn(16, 8))
    with pytest.raises(RuntimeError, match="columns"):
        cpu_linear.linear(torch.randn(2, 9), panels, None)
    with pytest.raises(RuntimeError, match="float32"):
        cpu_linear.linear(torch.randn(2, 8, dtype=torch.float64), panels, None)
    with pytest.raises(RuntimeError, match="bfloat16"):  # x in one dtype, the panels in the other
        cpu_linear.linear(torch.randn(2, 8, dtype=torch.bfloat16), panels, None)
    with pytest.raises(ValueError, match="post-op"):
        cpu_linear.linear(torch.randn(2, 8), panels, None, "relu")


def test_float32_and_bfloat16_on_a_cpu_where_the_extension_is_built(thin_kernel_no_amx, monkeypatch):
    assert cpu_linear.fused_linear_usable(torch.device("cpu"), torch.bfloat16)
    assert not cpu_linear.fused_linear_usable(torch.device("cpu"), torch.float16)
    assert not cpu_linear.fused_linear_usable(torch.device("cuda"), torch.float32)
    with monkeypatch.context() as amx:  # AMX tiles: oneDNN's bf16 products stay (the probe decides), fp32 thin
        amx.setattr(cpu_attention, "cpu_flags", lambda: "flags : avx2 avx512f avx512_bf16 amx_bf16 amx_tile")
        assert not cpu_linear.fused_linear_usable(torch.device("cpu"), torch.bfloat16)
        assert cpu_linear.fused_linear_usable(torch.device("cpu"), torch.float32)
    monkeypatch.setenv(cpu_attention.DISABLE_ENV, "1")
    assert not cpu_linear.fused_linear_usable(torch.device("cpu"), torch.float32)
    assert not cpu_linear.fused_linear_usable(torch.device("cpu"), torch.bfloat16)


def test_a_decoder_on_the_thin_products_agrees_with_onednns(thin_kernel, monkeypatch):
    """The same fp32 decoder with its step products through the kernel and through oneDNN's packed products:
    logits equal within fp32 rounding over a ragged 4-token pass and a step."""
    model = random_whisper("test", seed=4, init_std=0.2, decoder_layers=2)
    thin = Decoder(model.model.decoder, model.proj_out)
    monkeypatch.setattr(cpu_linear, "fused_linear_usable", lambda device, dtype: False)
    onednn = Decoder(model.model.decoder, model.proj_out)
    assert thin.thin and not onednn.thin
    gen = torch.Generator().manual_seed(0)
    n_ctx = thin.decoder.config.max_source_positions
    audio = torch.randn(2, n_ctx, thin.d_model, generator=gen)
    tokens = torch.randint(0, 100, (2, 4), generator=gen)
    outs = []
    for decoder in (thin, onednn):
        cache = decoder.new_cache(2, 16, n_ctx)
        decoder.write_audio(cache, audio)
        window = decoder.forward(cache, tokens, torch.tensor([[0, 1, 2, 3], [0, 1, 2, 3]]), 8)
        outs.append((window, decoder.forward(cache, tokens[:, :1], torch.tensor([[4], [4]]), 8)))
    scale = outs[1][0].abs().max().item()
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, atol=1e-5 * scale, rtol=0)


@pytest.mark.parametrize("dtype, held", [(torch.float32, torch.float32), (torch.bfloat16, torch.int8),
                                          (torch.bfloat16, torch.bfloat16)])
def test_a_verify_pass_gives_each_position_its_one_token_steps_bits(thin_kernel_no_amx, monkeypatch, dtype, held):
    """With the attention kernel and the thin products every fp32 and bf16 product is row-invariant (no probe: a
    bf16 decoder's rows figure is `ANY_ROWS`): a 4-token pass over ragged rows gives the logits and cache entries
    that 1-token steps give, bit for bit, a bf16 decoder's over its int8 audio (`int8.audio_dtype`) or bf16."""
    if held == torch.bfloat16:
        monkeypatch.setenv(int8.INT8_AUDIO_ENV, "1")
    else:
        monkeypatch.delenv(int8.INT8_AUDIO_ENV, raising=False)
    model = random_whisper("test", seed=2, init_std=0.2, decoder_layers=2).to(dtype)
    decoder = Decoder(model.model.decoder, model.proj_out)
    assert decoder.thin and decoder.fused and decoder.audio_dtype == held
    assert decoder.row_rows == (ANY_ROWS if dtype == torch.bfloat16 else 0)
    gen = torch.Generator().manual_seed(0)
    n_ctx = decoder.decoder.config.max_source_positions
    # the audio keys as shaped in bf16 (each key's head_dim contiguous), transposed in int8 and fp32; values
    # transposed
    keys_last = decoder.new_cache(1, 8, n_ctx).cross_k.stride(-1) == 1
    assert keys_last == (held == torch.bfloat16) and decoder.keys_t != keys_last
    audio = torch.randn(2, n_ctx, decoder.d_model, generator=gen).to(dtype)
    prompt = torch.randint(0, 100, (2, 3), generator=gen)
    tokens = torch.randint(0, 100, (2, 4), generator=gen)
    starts = torch.tensor([3, 3])
    caches, logits = [], []
    for one_at_a_time in (False, True):
        cache = decoder.new_cache(2, 40, n_ctx)
        decoder.write_audio(cache, audio)
        decoder.forward(cache, prompt, torch.arange(3).expand(2, -1), 32)
        if one_at_a_time:
            out = torch.cat([decoder.forward(cache, tokens[:, i:i + 1], (starts + i)[:, None], 32)
                             for i in range(4)], dim=1)
        else:
            out = decoder.forward(cache, tokens, starts[:, None] + torch.arange(4), 32)
        caches.append(cache)
        logits.append(out)
    assert torch.equal(logits[0], logits[1])
    assert torch.equal(caches[0].self_k[:, :, :, :7], caches[1].self_k[:, :, :, :7])
