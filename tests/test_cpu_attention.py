"""The CPU few-query attention kernel (`engine/cpu_attention.py`): values within each dtype's rounding of a float64
reference, row- and query-invariance, and the fallback to torch's products where it is disabled or not built."""

from __future__ import annotations

import logging

import pytest
import torch

from asr_spec.engine import cpu_attention, kernels
from asr_spec.engine.decoder import Decoder
from asr_spec.testing import random_whisper

H, D = 8, 64


pytestmark = pytest.mark.usefixtures("kernel")  # conftest: every test here needs the kernel built


def _operands(b: int, t: int, s: int, dtype: torch.dtype, seed: int = 0, positions_contiguous: bool = True):
    """q (b, t, H, D) and keys, values (b, H, s, D) as views of a cache with spare rows and positions (strided, as
    a decoder's `KVCache` slices are), stored (rows, H, D, positions) or (rows, H, positions, D)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, H, D, generator=gen).to(dtype)
    if positions_contiguous:
        store = torch.randn(2, b + 1, H, D, s + 5, generator=gen).to(dtype).transpose(-1, -2)
    else:
        store = torch.randn(2, b + 1, H, s + 5, D, generator=gen).to(dtype)
    return q, store[0, 1:, :, :s], store[1, 1:, :, :s]


def _reference(q, keys, values, n_seen, scale):
    """float64 softmax(scale q k^T) v, each query over its first n_seen keys -> (b, t, H * D)."""
    b, t = n_seen.shape
    out = torch.empty(b, t, H, D, dtype=torch.float64)
    for row in range(b):
        for i in range(t):
            n = int(n_seen[row, i])
            scores = torch.einsum("hd,hsd->hs", q[row, i].double() * scale, keys[row, :, :n].double())
            out[row, i] = torch.einsum("hs,hsd->hd", scores.softmax(-1), values[row, :, :n].double())
    return out.view(b, t, H * D)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1.6e-2)])
@pytest.mark.parametrize("t", [1, 3, 5, 32])
@pytest.mark.parametrize("positions_contiguous", [True, False])
def test_kernel_equals_a_float64_reference_within_the_dtypes_rounding(dtype, tol, t, positions_contiguous):
    """Ragged key counts (1, a partial last block, all), strided cache views in either layout, fp32 accumulation:
    within fp32's rounding, or one bf16 output rounding (2^-8 relative) of values of size ~1."""
    q, keys, values = _operands(3, t, 203, dtype, positions_contiguous=positions_contiguous)
    n_seen = torch.randint(1, 204, (3, t), generator=torch.Generator().manual_seed(1))
    n_seen[0, 0], n_seen[-1, -1] = 1, 203
    out = cpu_attention.attend(q, keys, values, n_seen, 0.125)
    assert out.dtype == dtype and out.shape == (3, t, H * D)
    torch.testing.assert_close(out.double(), _reference(q, keys, values, n_seen, 0.125), atol=tol, rtol=tol)


def test_keys_and_values_in_different_layouts():
    q, keys, _ = _operands(2, 3, 100, torch.float32)
    _, _, values = _operands(2, 3, 100, torch.float32, seed=1, positions_contiguous=False)
    n_seen = torch.tensor([[1, 50, 100], [7, 8, 9]])
    torch.testing.assert_close(cpu_attention.attend(q, keys, values, n_seen, 0.125).double(),
                               _reference(q, keys, values, n_seen, 0.125), atol=1e-5, rtol=1e-5)


def test_all_keys_when_no_counts_are_given():
    q, keys, values = _operands(2, 2, 1500, torch.bfloat16)
    full = torch.full((2, 2), 1500)
    assert torch.equal(cpu_attention.attend(q, keys, values, None), cpu_attention.attend(q, keys, values, full))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("positions_contiguous", [True, False])
def test_each_query_is_what_it_is_alone(dtype, positions_contiguous):
    """Row- and query-invariance is the kernel's own contract, by construction (each (row, head, query) output is
    computed by the same code in the same order from that query's data and key count alone), not a property of
    one CPU's rounding: so exact equality is the right check here. A query computed with 2 other rows and 11 other
    queries (groups of 4 sharing loads, other key counts beside it) vs alone, and vs in a 4-query pass."""
    q, keys, values = _operands(3, 12, 470, dtype, seed=2, positions_contiguous=positions_contiguous)
    n_seen = torch.randint(1, 471, (3, 12), generator=torch.Generator().manual_seed(3))
    whole = cpu_attention.attend(q, keys, values, n_seen, 0.125)
    for row in range(3):
        for i in range(12):
            alone = cpu_attention.attend(q[row:row + 1, i:i + 1], keys[row:row + 1], values[row:row + 1],
                                         n_seen[row:row + 1, i:i + 1], 0.125)
            assert torch.equal(alone[0, 0], whole[row, i]), f"row {row}, query {i}"
    four = cpu_attention.attend(q[1:2, 5:9], keys[1:2], values[1:2], n_seen[1:2, 5:9], 0.125)
    assert torch.equal(four[0], whole[1, 5:9])


def test_the_thread_count_changes_nothing():
    """(row, head) pairs are shared out between threads, each computed whole by one: the same bits."""
    q, keys, values = _operands(4, 4, 300, torch.bfloat16, seed=4)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_attention.attend(q, keys, values, None)
        torch.set_num_threads(2)
        assert torch.equal(cpu_attention.attend(q, keys, values, None), one)
    finally:
        torch.set_num_threads(threads)


def test_a_count_out_of_range_is_refused():
    q, keys, values = _operands(1, 2, 16, torch.float32)
    for bad in (0, 17):
        with pytest.raises(RuntimeError, match="out of"):
            cpu_attention.attend(q, keys, values, torch.tensor([[3, bad]]))


def _decoder(dtype: torch.dtype) -> Decoder:
    model = random_whisper("test", seed=1, init_std=0.2, decoder_layers=1).to(dtype)
    return Decoder(model.model.decoder, model.proj_out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decoder_uses_the_kernel_and_agrees_with_torchs_products(monkeypatch, dtype):
    """The kernel's decoder and the fallback's (ASR_SPEC_NO_CPU_KERNELS=1: torch's products, probes, buckets and
    masks) give the same logits within the dtype's rounding over a ragged 4-token pass."""
    fused = _decoder(dtype)
    monkeypatch.setenv(cpu_attention.DISABLE_ENV, "1")
    fallback = _decoder(dtype)
    assert fused.fused and not fallback.fused and fused.query_rows == 0
    gen = torch.Generator().manual_seed(0)
    n_ctx = fused.decoder.config.max_source_positions
    audio = torch.randn(2, n_ctx, fused.d_model, generator=gen)
    tokens = torch.randint(0, 100, (2, 4), generator=gen)
    positions = torch.tensor([[0, 1, 2, 3], [5, 6, 7, 8]])
    logits = []
    for decoder in (fused, fallback):
        cache = decoder.new_cache(2, 40, n_ctx)
        decoder.write_audio(cache, audio)
        decoder.forward(cache, torch.randint(0, 100, (2, 5), generator=torch.Generator().manual_seed(1)),
                        torch.arange(5).expand(2, -1), 32)
        logits.append(decoder.forward(cache, tokens, positions, 32).float())
    # fp32: rounding only; bf16: each path rounds its attention output once to bf16 (2^-8 relative) and the
    # layers after it carry that on: within a few bf16 steps of the logits' scale
    scale = logits[1].abs().max().item()
    tol = 1e-5 * scale if dtype == torch.float32 else 2**-5 * scale
    torch.testing.assert_close(logits[0], logits[1], atol=tol, rtol=0)


def test_disabled_kernel_falls_back_without_building(monkeypatch):
    monkeypatch.setenv(cpu_attention.DISABLE_ENV, "1")
    assert not cpu_attention.fused_attention_usable(torch.device("cpu"), torch.bfloat16)
    monkeypatch.setenv(cpu_attention.DISABLE_ENV, "0")
    assert cpu_attention.fused_attention_usable(torch.device("cpu"), torch.bfloat16)


def test_a_switch_is_on_for_any_value_but_empty_and_zero(monkeypatch):
    name = "ASR_SPEC_TEST_SWITCH"
    monkeypatch.delenv(name, raising=False)
    assert not cpu_attention.switched_on(name)
    for value, on in (("", False), ("0", False), ("1", True), ("yes", True)):
        monkeypatch.setenv(name, value)
        assert cpu_attention.switched_on(name) == on, value


def test_never_for_cuda_or_other_dtypes():
    assert not cpu_attention.fused_attention_usable(torch.device("cuda"), torch.bfloat16)
    assert not cpu_attention.fused_attention_usable(torch.device("cpu"), torch.float16)


def test_a_failed_build_warns_once_and_falls_back(monkeypatch, caplog, tmp_path):
    """A build that cannot run (here: a missing source file) logs one warning line and leaves the decoder on
    torch's products; the time it took is a build's (`build_seconds`), not the run's speed."""
    monkeypatch.setattr(cpu_attention, "SOURCE", tmp_path / "missing.cpp")
    monkeypatch.setattr(cpu_attention, "build_name", lambda: "asr_spec_cpu_attention_test_missing")
    monkeypatch.setattr(cpu_attention, "_BUILDS_S", [])
    cpu_attention._extension.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=cpu_attention.__name__):
            assert not cpu_attention.fused_attention_usable(torch.device("cpu"), torch.float32)
            assert not _decoder(torch.float32).fused
        assert len([r for r in caplog.records if "not built" in r.getMessage()]) == 1
        assert len(cpu_attention._BUILDS_S) == 1  # the failed build's seconds, counted once
    finally:
        cpu_attention._extension.cache_clear()


def test_a_build_lock_left_by_a_killed_build_is_removed_and_a_fresh_one_is_not(monkeypatch, caplog, tmp_path):
    """torch's extension build takes a lock file for its build folder and waits for ever while one is there: a
    build killed mid-way (a timeout, an OOM kill) left it, and every later run hung at its first kernel (the test
    suite too). One older than STALE_LOCK_S is removed with a warning; a build's own (seconds old) is left."""
    import os
    import time

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = tmp_path / "asr_spec_cpu_attention_test_lock" / "lock"
    lock.parent.mkdir()
    lock.touch()
    assert not cpu_attention.clear_stale_lock("asr_spec_cpu_attention_test_lock") and lock.exists()
    old = time.time() - cpu_attention.STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    with caplog.at_level(logging.WARNING, logger=cpu_attention.__name__):
        assert cpu_attention.clear_stale_lock("asr_spec_cpu_attention_test_lock")
    assert not lock.exists() and "build lock" in caplog.text
    assert not cpu_attention.clear_stale_lock("asr_spec_cpu_attention_test_lock")  # none left: nothing to do


def test_a_first_build_says_so_once_and_a_cached_one_does_not(monkeypatch, caplog):
    """The kernel is built here (the fixture), so torch's cache holds it and a load says nothing; where the cache
    holds no build of this name, one notice comes before the build (here: a load of the cached one), the command
    line shows it (`logs.NOTICE`), and the build's seconds are counted apart (`build_seconds`)."""
    assert cpu_attention.built(cpu_attention.build_name())
    building = "building the CPU kernels"
    monkeypatch.setattr(cpu_attention, "_BUILDS_S", [])
    for cached in (True, False):
        monkeypatch.setattr(cpu_attention, "built", lambda name, cached=cached: cached)
        cpu_attention._extension.cache_clear()
        caplog.clear()
        try:
            with caplog.at_level(logging.INFO, logger=cpu_attention.__name__):
                assert cpu_attention.fused_attention_usable(torch.device("cpu"), torch.float32)
                assert cpu_attention.fused_attention_usable(torch.device("cpu"), torch.bfloat16)
        finally:
            cpu_attention._extension.cache_clear()
        lines = [r for r in caplog.records if building in r.getMessage()]
        assert len(lines) == (0 if cached else 1), [r.getMessage() for r in lines]
        assert all(getattr(r, "notice", False) for r in lines)
        assert (cpu_attention.build_seconds() > 0) == (not cached)


def test_forced_avx2_flags_build_for_an_avx2_cpu_and_under_their_own_name(monkeypatch):
    """`--emulate-isa avx2` (ASR_SPEC_CPU_FLAGS without avx512f) must time the kernel an AVX2-only CPU builds,
    under a cache name of its own; the machine's own flags build for this CPU."""
    avx2 = "fma f16c avx avx2 bmi1 bmi2"
    avx512 = avx2 + " avx512f avx512bw avx512_bf16"
    assert cpu_attention.target_options(avx2, forced=True, own=avx512) == ("-march=x86-64-v3",)
    assert cpu_attention.target_options(avx512, forced=True, own=avx512) == ("-march=native",)
    assert cpu_attention.target_options(avx2, forced=False, own=avx2) == ("-march=native",)
    monkeypatch.delenv(cpu_attention.FLAGS_ENV, raising=False)
    own = cpu_attention.build_name()
    monkeypatch.setenv(cpu_attention.FLAGS_ENV, avx2)
    assert cpu_attention.cpu_flags() == avx2
    assert cpu_attention.build_name() != own


def test_two_copies_of_the_source_build_under_names_of_their_own(monkeypatch, tmp_path):
    """ninja rebuilds a build whose compile command changed, and the command names the source's path: a checkout
    and a worktree (or an install) of the same code shared one name and rebuilt it in turn, ~25 s at each switch."""
    monkeypatch.delenv(cpu_attention.FLAGS_ENV, raising=False)
    own = cpu_attention.build_name()
    copy = tmp_path / cpu_attention.SOURCE.name
    copy.write_text(cpu_attention.SOURCE.read_text())
    monkeypatch.setattr(cpu_attention, "SOURCE", copy)
    assert cpu_attention.build_name() != own


def test_cpuinfo_flags_are_its_flags_line_read_once(monkeypatch, tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 fma\nbugs\t\t: none\n")
    monkeypatch.delenv(cpu_attention.FLAGS_ENV, raising=False)
    monkeypatch.setattr(cpu_attention, "CPUINFO", info)
    assert cpu_attention.cpu_flags() == "flags\t\t: fpu avx2 fma"
    info.write_text("flags\t\t: fpu\n")  # read once a process: a CPU does not change under it
    assert cpu_attention.cpu_flags() == "flags\t\t: fpu avx2 fma"
    # no /proc/cpuinfo (some containers): torch's cpuid probe, as models.cpu.detect_cpu falls back to
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"avx2": True, "fma3": True, "avx512_f": False})
    kernels.hardware_flags.cache_clear()
    try:
        assert cpu_attention._cpuinfo_flags(tmp_path / "absent") == "avx2 fma3"
    finally:
        monkeypatch.undo()
        kernels.hardware_flags.cache_clear()
    monkeypatch.setenv(cpu_attention.FLAGS_ENV, "avx2 fma")  # the forced flags are read at every call
    assert cpu_attention.cpu_flags() == "avx2 fma"


def test_forced_avx512_flags_this_cpu_lacks_build_its_paths_emulated():
    """Flags forced to an AVX-512 CPU's on a CPU without AVX-512 build the kernel's AVX-512 paths through SIMDe
    (tests/test_native_kernels.py runs them), with the BF16 and VNNI instructions only where the flags name
    avx512_bf16 and avx512_vnni; a CPU with AVX-512 builds its own."""
    avx2 = "fma f16c avx avx2 bmi1 bmi2"
    emulated = ("-march=x86-64-v3", "-Wno-psabi", "-DCPU_KERNELS_EMULATE_AVX512")
    assert cpu_attention.target_options(avx2 + " avx512f avx512bw", forced=True, own=avx2) == emulated
    assert cpu_attention.target_options(avx2 + " avx512f avx512bw avx512_bf16", forced=True, own=avx2) == (
        *emulated, "-DCPU_KERNELS_EMULATE_AVX512_BF16")
    assert cpu_attention.target_options(avx2 + " avx512f avx512bw avx512_vnni avx512_bf16", forced=True, own=avx2) == (
        *emulated, "-DCPU_KERNELS_EMULATE_AVX512_BF16", "-DCPU_KERNELS_EMULATE_AVX512_VNNI")
    assert cpu_attention.target_options(avx2 + " avx512f", forced=True, own=avx2) == ("-march=native",)
    assert cpu_attention.target_options(avx2 + " avx512f avx512bw", forced=False, own=avx2) == ("-march=native",)
