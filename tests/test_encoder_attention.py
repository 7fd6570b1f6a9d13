"""The encoder's self-attention through the CPU kernel extension (`cpu_attention.encoder_attention`,
`cpu_encoder_attention.h`): agreement with a float64 attention within the dtype's rounding, q/k/v read in place
as slices of a wider product, each window's output independent of the others in the call, bad operands refused,
and the one decision where the encoder uses it (bf16 only)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from asr_spec.engine import cpu_attention, int8
from asr_spec.engine.encoder import Encoder
from asr_spec.engine.kernels import onednn_usable
from asr_spec.testing import random_whisper

CPU = torch.device("cpu")
# fp32: sums of ~1e-7 relative error; bf16: the numerators and the output each rounded to 8 bits
TOL = {torch.float32: 2e-6, torch.bfloat16: 1.2e-2}


def _qkv(windows: int, n: int, heads: int, head_dim: int, dtype: torch.dtype, seed: int = 0):
    """q, k, v as column slices of one (windows, n, 3 * heads * head_dim) product output (rows apart)."""
    gen = torch.Generator().manual_seed(seed)
    width = heads * head_dim
    fused = (torch.randn(windows, n, 3 * width, generator=gen) * 2).to(dtype)
    return fused[..., :width], fused[..., width:2 * width], fused[..., 2 * width:]


def _reference(q, k, v, heads, scale):
    """float64 softmax(scale q k^T) v per window and head, (B, N, heads * head_dim)."""
    b, n, width = q.shape
    split = [t.double().view(b, n, heads, width // heads).transpose(1, 2) for t in (q, k, v)]
    return F.scaled_dot_product_attention(*split, scale=scale).transpose(1, 2).reshape(b, n, width)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("windows, n, heads, head_dim", [(2, 37, 2, 20), (1, 150, 4, 64), (3, 33, 1, 8),
                                                         (1, 1, 2, 16)])
def test_agrees_with_a_float64_attention_within_the_dtypes_rounding(kernel, dtype, windows, n, heads, head_dim):
    q, k, v = _qkv(windows, n, heads, head_dim, dtype)
    scale = head_dim ** -0.5
    out = cpu_attention.encoder_attention(q, k, v, heads, scale)
    assert out.shape == q.shape and out.dtype == dtype and out.is_contiguous()
    exact = _reference(q, k, v, heads, scale)
    tol = TOL[dtype] * exact.abs().max().item()
    torch.testing.assert_close(out.double(), exact, atol=tol, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_windows_output_is_the_same_with_other_windows_beside_it(kernel, dtype):
    """Bit for bit, whatever the windows in the call and the threads: an encoder output depends on its window."""
    q, k, v = _qkv(3, 70, 2, 32, dtype, seed=5)
    together = cpu_attention.encoder_attention(q, k, v, 2, 0.125)
    threads = torch.get_num_threads()
    try:
        for n_threads in (1, 2):
            torch.set_num_threads(n_threads)
            for w in range(3):
                alone = cpu_attention.encoder_attention(q[w:w + 1], k[w:w + 1], v[w:w + 1], 2, 0.125)
                assert torch.equal(alone[0], together[w])
    finally:
        torch.set_num_threads(threads)


def test_bad_operands_are_refused(kernel):
    q, k, v = _qkv(1, 8, 2, 8, torch.float32)
    with pytest.raises(RuntimeError, match="heads"):
        cpu_attention.encoder_attention(q, k, v, 3, 1.0)
    with pytest.raises(RuntimeError, match="float32"):
        cpu_attention.encoder_attention(q, k.bfloat16(), v, 2, 1.0)
    with pytest.raises(RuntimeError, match="alike"):
        cpu_attention.encoder_attention(q, k[:, :4], v, 2, 1.0)


def test_only_bf16_where_the_extension_is_built(kernel, no_amx_tiles, monkeypatch):
    flags = no_amx_tiles  # the kernel built first (the fixture order)
    assert cpu_attention.encoder_attention_usable(CPU, torch.bfloat16)
    with monkeypatch.context() as amx:  # AMX tiles: torch's attention stays
        amx.setattr(cpu_attention, "cpu_flags", lambda: flags + " amx_bf16 amx_tile")
        assert not cpu_attention.encoder_attention_usable(CPU, torch.bfloat16)
    assert not cpu_attention.encoder_attention_usable(CPU, torch.float32)
    assert not cpu_attention.encoder_attention_usable(torch.device("cuda"), torch.bfloat16)
    monkeypatch.setenv(cpu_attention.DISABLE_ENV, "1")
    assert not cpu_attention.encoder_attention_usable(CPU, torch.bfloat16)


def test_a_bf16_encoder_with_it_agrees_with_torchs_attention(kernel, no_amx_tiles, monkeypatch):
    """The same bf16 encoder with its attention through the kernel and through SDPA: outputs within bf16's
    rounding of each other (and both within it of the fp32 module, tests/test_encoder.py)."""
    if not onednn_usable(CPU, torch.bfloat16):
        pytest.skip("no oneDNN bf16 products on this CPU: the encoder runs the module itself")
    model = random_whisper("test", seed=3, vocab_size=70, init_std=0.2).to(torch.bfloat16)
    features = torch.randn(2, model.config.num_mel_bins, 2 * model.config.max_source_positions,
                           generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    # the attention alone: bf16 products in both (an AVX-512 VNNI CPU's own run would make the first's int8)
    monkeypatch.setattr(int8, "int8_encoder_usable", lambda device, dtype, asked=False: False)
    fused = Encoder(model.model.encoder)
    monkeypatch.setattr(cpu_attention, "encoder_attention_usable", lambda device, dtype: False)
    plain = Encoder(model.model.encoder)
    assert fused.kernel_attention and not plain.kernel_attention
    a, b = fused(features).float(), plain(features).float()
    torch.testing.assert_close(a, b, rtol=5e-2, atol=5e-2)
