"""The int8 encoder's self-attention (`cpu_int8_attention.h`, `int8.int8_attention_usable`): the kernel against
its definition (the levels this build quantizes with, in float64) from fp32 and from bf16 inputs, against fp32
attention within int8's rounding, a window's output independent of the windows beside it, ragged sizes and strided
inputs, what it refuses, the one decision where it runs, and the int8 encoders (fp32 and bf16) taking it; the AVX-512
VNNI path built emulated on any CPU against its definition."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from conftest import UNPINNED_ENV, simde_headers

from asr_spec.engine import cpu_attention, int8
from asr_spec.engine.encoder import Encoder
from asr_spec.testing import random_whisper

CPU = torch.device("cpu")


def _levels(x: torch.Tensor, levels: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x's symmetric levels along `dim` (one scale per slice: max |x| / levels, 1 where the slice is all zero), each
    rounded from x times levels / max |x| in fp32 as the kernel multiplies (bf16 inputs land on exact halves often
    enough that float64's quotient would round some the other way)."""
    top = x.abs().amax(dim, keepdim=True)
    inv = torch.where(top > 0, levels / top.float(), torch.zeros_like(top.float()))
    scale = torch.where(top > 0, top / levels, torch.ones_like(top))
    return torch.round(x.float() * inv).double(), scale


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, scale: float,
              levels: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """The kernel's definition in float64 at `levels` (query, key, numerator, value; None: those this build
    quantizes with, `int8_attention_levels`: keys and values in 8 bits with AVX-512 VNNI, 7 without): q per query
    and head, k per key and head, the softmax numerators rounded to 1 / 255, v per channel and head over the
    window's keys; out = sum p v / sum p. (B, N, heads * d) each -> (B, N, heads * d)"""
    query, key, prob, value = levels or cpu_attention.int8_attention_levels()
    b, n, width = q.shape
    q, k, v = (t.double().reshape(b, n, heads, width // heads).transpose(1, 2) for t in (q, k, v))
    (qi, qs), (ki, ks), (vi, vs) = _levels(q, query, -1), _levels(k, key, -1), _levels(v, value, -2)
    scores = (qi @ ki.transpose(-1, -2)) * qs * ks.transpose(-1, -2) * scale
    p = torch.round(torch.exp(scores - scores.amax(-1, keepdim=True)) * prob)
    out = (p @ vi) * vs / p.sum(-1, keepdim=True)
    return out.transpose(1, 2).reshape(b, n, width)


def _qkv(b: int, n: int, width: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as slices of one fused (b, n, 3 * width) product (rows apart, as the encoder's), with outliers."""
    gen = torch.Generator().manual_seed(seed)
    fused = torch.randn(b, n, 3 * width, generator=gen) * (torch.rand(b, n, 1, generator=gen) + 0.5)
    fused[..., 5] *= 12.0  # an outlier channel: its rows' and the values' scales
    fused[0, 0] = 0.0  # an all-zero query, key and value row
    return fused.split(width, -1)


SHAPES = [(2, 37, 2, 32), (1, 5, 1, 64), (3, 130, 4, 256), (1, 1, 2, 8)]  # b, n, heads, width


def _is_its_definition(attend, b: int, n: int, heads: int, width: int,
                       levels: tuple[int, int, int, int] | None = None) -> None:
    """`attend` (an `encoder_attention_int8`) against `reference` at `levels`, on `_qkv`'s inputs of these shapes."""
    q, k, v = _qkv(b, n, width)
    out = attend(q, k, v, heads, 0.125)
    assert out.shape == q.shape and out.dtype == torch.float32 and out.is_contiguous()
    expected = reference(q, k, v, heads, 0.125, levels)
    # the integer sums are exact; a numerator on a rounding tie (the fp32 exp against float64's) may move one
    # level of 1 / 255, i.e. the output by at most the largest value / 255
    prob = (levels or cpu_attention.int8_attention_levels())[2]
    err = (out.double() - expected).abs()
    assert err.max() <= v.abs().max() / prob
    assert err.mean() <= 1e-4 * v.abs().max()


@pytest.mark.parametrize("b, n, heads, width", SHAPES)
def test_the_kernel_is_its_definition(kernel, b, n, heads, width):
    _is_its_definition(cpu_attention.encoder_attention_int8, b, n, heads, width)


def test_the_vnni_path_built_emulated_is_its_definition_at_eight_bits(kernel, monkeypatch):
    """The AVX-512 VNNI path (`vpdpbusd` over 12 query rows, 8-bit keys and values: what AVX-512-VNNI EPYCs and AMX
    Xeons run) built with every AVX-512 instruction emulated through SIMDe (`cpu_attention.emulated_macros`), so
    that a machine without VNNI tests it too. Once, in the suite's pinned run (the kernel runs of
    tests/test_native_kernels.py would only build it again); where a VNNI CPU runs it natively, the native build
    gave the same outputs bit for bit (docs/cpu.md)."""
    if os.environ.get(UNPINNED_ENV) == "1":
        pytest.skip("built once, in the suite's pinned run")
    with monkeypatch.context() as real:  # the CPU's own flags, not the suite's pinned ones
        real.delenv(cpu_attention.FLAGS_ENV, raising=False)
        if "avx2" not in cpu_attention.cpu_flags().split():
            pytest.skip("the emulated build targets an AVX2 CPU (x86-64-v3)")
    if not simde_headers():
        pytest.skip("SIMDe's headers (libsimde-dev) are not installed: the AVX-512 paths cannot be emulated here")
    macros = cpu_attention.emulated_macros({"avx512f", "avx512bw", "avx512_bf16", "avx512_vnni"})
    emulated = cpu_attention.load(f"{cpu_attention.build_name()}_vnni_emulated", macros)
    levels = tuple(emulated.int8_attention_levels())
    assert levels == (127, 127, 255, 127)
    for shape in SHAPES:
        _is_its_definition(emulated.encoder_attention_int8, *shape, levels=levels)
    # bf16 inputs: the same integers and fp32 steps, the output rounded once
    q, k, v = (t.bfloat16() for t in _qkv(3, 130, 256, seed=4))
    widened = emulated.encoder_attention_int8(q.float(), k.float(), v.float(), 4, 0.125)
    assert torch.equal(emulated.encoder_attention_int8(q, k, v, 4, 0.125), widened.bfloat16())


@pytest.mark.parametrize("b, n, heads, width", [(2, 37, 2, 32), (3, 130, 4, 256), (1, 1, 2, 8)])
def test_bf16_inputs_are_widened_exactly_and_the_output_rounded_once(kernel, b, n, heads, width):
    # a bf16 encoder's q, k, v: the same integers and fp32 steps as their fp32 values (checked against the
    # definition above), the output rounded to bf16 at the end
    q, k, v = (t.bfloat16() for t in _qkv(b, n, width, seed=4))
    out = cpu_attention.encoder_attention_int8(q, k, v, heads, 0.125)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape and out.is_contiguous()
    widened = cpu_attention.encoder_attention_int8(q.float(), k.float(), v.float(), heads, 0.125)
    assert torch.equal(out, widened.bfloat16())


def test_its_levels_follow_the_instruction_set(kernel):
    # 8-bit keys and values where the build sums u8 x s8 quads in int32 (AVX-512 VNNI), else 7-bit (AVX2's int16
    # pair sums must not saturate: 2 x 255 x 63); queries and numerators 8-bit everywhere
    query, key, prob, value = cpu_attention.int8_attention_levels()
    assert (query, prob) == (127, 255) and key == value and key in (63, 127)
    own, target = cpu_attention._cpuinfo_flags(cpu_attention.CPUINFO).split(), cpu_attention._target()
    vnni = ("-march=native" in target and "avx512_vnni" in own) or "-DCPU_KERNELS_EMULATE_AVX512_VNNI" in target
    assert (key == 127) == vnni


def test_the_kernel_is_near_fp32_attention_within_int8s_rounding(kernel):
    b, n, heads, width = 2, 300, 4, 256
    q, k, v = _qkv(b, n, width, seed=3)
    out = cpu_attention.encoder_attention_int8(q, k, v, heads, 0.125)
    split = [t.reshape(b, n, heads, width // heads).transpose(1, 2) for t in (q, k, v)]
    fp32 = F.scaled_dot_product_attention(*split, scale=0.125).transpose(1, 2).reshape(b, n, width)
    # 4.6 % here, where an outlier channel 12x the others sets every row's q and k scale; whisper-base on speech:
    # docs/cpu.md
    assert ((out - fp32).norm() / fp32.norm()).item() < 0.06


def test_a_windows_output_does_not_depend_on_the_windows_beside_it(kernel):
    q, k, v = _qkv(3, 70, 128, seed=1)
    together = cpu_attention.encoder_attention_int8(q, k, v, 2, 0.125)
    for w in range(3):  # the same integers and the same fp32 steps, window by window
        alone = cpu_attention.encoder_attention_int8(q[w:w + 1], k[w:w + 1], v[w:w + 1], 2, 0.125)
        assert torch.equal(alone[0], together[w])


def test_what_it_refuses(kernel):
    q, k, v = _qkv(1, 8, 24)
    with pytest.raises(RuntimeError, match="heads of a multiple of 4"):
        cpu_attention.encoder_attention_int8(q, k, v, 4, 0.125)  # head_dim 6
    with pytest.raises(RuntimeError, match="must be float32 or bfloat16"):
        cpu_attention.encoder_attention_int8(q, k.bfloat16(), v, 2, 0.125)  # dtypes mixed
    with pytest.raises(RuntimeError, match="must be float32 or bfloat16"):
        cpu_attention.encoder_attention_int8(q.half(), k.half(), v.half(), 2, 0.125)
    with pytest.raises(RuntimeError, match="must be float32 or bfloat16"):
        cpu_attention.encoder_attention_int8(q, k.contiguous(), v, 2, 0.125)  # k's rows apart unlike q's
    empty = torch.empty(0, 8, 24)
    assert cpu_attention.encoder_attention_int8(empty, empty, empty, 2, 0.125).shape == (0, 8, 24)


def test_an_encoder_attends_in_int8_where_its_products_are_int8(kernel, monkeypatch):
    monkeypatch.delenv(int8.ATTENTION_ENV, raising=False)
    monkeypatch.delenv(int8.DISABLE_ENV, raising=False)
    if not int8._onednn_int8():
        pytest.skip("this torch has no oneDNN int8 linear")
    assert int8.int8_attention_usable(CPU, torch.float32, asked=True)
    assert not int8.int8_attention_usable(CPU, torch.float32)  # fp32 not asked for int8
    for products in (True, False):  # bf16: with the products (AVX-512 VNNI without AMX), else the bf16 kernel's
        monkeypatch.setattr(int8, "int8_encoder_usable", lambda device, dtype, asked=False, on=products: on)
        assert int8.int8_attention_usable(CPU, torch.bfloat16) == products
    monkeypatch.undo()
    monkeypatch.setenv(int8.ATTENTION_ENV, "1")
    assert not int8.int8_attention_usable(CPU, torch.float32, asked=True)
    monkeypatch.setenv(int8.ATTENTION_ENV, "0")
    monkeypatch.setenv(int8.DISABLE_ENV, "1")  # no int8 products, no int8 attention
    assert not int8.int8_attention_usable(CPU, torch.float32, asked=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_int8_encoder_attends_in_int8_near_its_own_dtypes_attention(kernel, monkeypatch, dtype):
    # fp32: the "int8" precision's encoder (marked), against its fp32 attention (SDPA); bf16: an encoder whose
    # products are int8 (an AVX-512 VNNI CPU without AMX: the suite's native kernel run), against the bf16 kernel's
    if not int8._onednn_int8():
        pytest.skip("this torch has no oneDNN int8 linear")
    monkeypatch.delenv(int8.ATTENTION_ENV, raising=False)
    monkeypatch.delenv(int8.DISABLE_ENV, raising=False)
    model = random_whisper("test", seed=2, vocab_size=70, init_std=0.2).to(dtype).eval()
    if dtype == torch.float32:
        int8.request(model.model.encoder)
    features = torch.randn(2, model.config.num_mel_bins, 2 * model.config.max_source_positions,
                           generator=torch.Generator().manual_seed(6)).to(dtype)
    encoder = Encoder(model.model.encoder)
    if not encoder.fast or not encoder.int8:
        pytest.skip(f"no int8 products for a {dtype} encoder here")
    assert encoder.int8_attention
    monkeypatch.setenv(int8.ATTENTION_ENV, "1")
    own_attention = Encoder(model.model.encoder)
    assert own_attention.int8 and not own_attention.int8_attention
    a, b = encoder(features), own_attention(features)
    assert a.dtype == b.dtype == dtype
    assert ((a.float() - b.float()).norm() / b.float().norm()).item() < 0.05
    assert torch.equal(encoder(features[1:])[0], a[1])  # a window's output is its own
