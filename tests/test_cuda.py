"""CUDA checks (fp16/bf16): speculative == the same engine's greedy on the GPU, and fp32 == transformers.

Skipped without an NVIDIA GPU (except the check of the tie check itself, which runs bf16 on the CPU).

Half precision: verifying K+1 positions in one pass and decoding one position at a time round differently, so a
row may leave the engine's greedy output where the target's top two scores are a numerical tie. Every row must
equal greedy, or first differ at a position where the target's top-2 rule-applied scores (computed in float32 from
the same half-precision weights, at the common prefix) are within the tolerance of that dtype. Anything else fails.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from conftest import first_divergence, hf_greedy, perturbed, script_module, tiny_target

from asr_spec.engine import DecodeOptions, Engine
from asr_spec.models.loading import decoder_draft

DEVICE = "cuda"
# Largest top-2 gap of the target's scores that counts as a tie, per dtype: a few units in the last place of
# logits of size ~10 (fp16: 10-bit mantissa, ulp(8..16) = 2^-7; bf16: 7-bit mantissa, ulp(8..16) = 2^-4).
TIE = {torch.float16: 4 * 2.0 ** -7, torch.bfloat16: 4 * 2.0 ** -4}


def _features(n=12):
    return torch.randn(n, 16, 100, generator=torch.Generator().manual_seed(0))


def assert_rows_equal_or_tie(target, feats, results, greedy, dtype, timestamps: bool = False) -> None:
    """Each row of `results` equals `greedy`'s, or first differs where the target's top-2 scores tie."""
    reference = copy.deepcopy(target).float()  # the same (rounded) weights, scored without half-precision rounding
    for row, (res, ref) in enumerate(zip(results, greedy)):
        diverged = first_divergence(reference, feats[row].float(), res.prompt + res.tokens, ref.prompt + ref.tokens,
                                    len(res.prompt), timestamps)
        if diverged is not None:
            i, gap, _ = diverged
            assert gap <= TIE[dtype], (f"row {row}: diverges at token {i} without a tie "
                                       f"(top-2 gap {gap:.2e} > {TIE[dtype]:.2e} for {dtype})")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("batch_size", [1, 4, 8])
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_speculative_equals_engine_greedy_on_gpu(dtype, batch_size):
    target = tiny_target().to(DEVICE, dtype)
    feats = _features().to(DEVICE)
    options = DecodeOptions(language="en", max_new_tokens=40)
    greedy = Engine(target, None, options).decode(feats, batch_size=batch_size)
    for draft in (decoder_draft(target), perturbed(tiny_target(), 0.3, seed=3).to(DEVICE, dtype)):
        results = Engine(target, draft, options).decode(feats, batch_size=batch_size)
        assert_rows_equal_or_tie(target, feats, results, greedy, dtype)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_fp32_on_gpu_equals_transformers(monkeypatch):
    # exact fp32 on both sides: no TF32 in matmuls or in the encoder's convolutions (cuDNN's default is on)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    target = tiny_target().to(DEVICE)
    feats = _features(6).to(DEVICE)
    results = Engine(target, decoder_draft(target), DecodeOptions(language="en", max_new_tokens=40)).decode(
        feats, batch_size=3)
    for row, r in enumerate(results):
        assert r.prompt + r.tokens == tuple(hf_greedy(target, feats[row], language="en", task="transcribe",
                                                      max_new_tokens=40))


def test_tie_check_rejects_a_difference_that_is_no_tie():
    """The check above can fail: one token changed in a greedy row (bf16, on the CPU) is not a tie."""
    import dataclasses

    dtype = torch.bfloat16
    target = tiny_target().to("cpu", dtype)
    feats = _features(4)
    greedy = Engine(target, None, DecodeOptions(language="en", max_new_tokens=12)).decode(feats, batch_size=4)
    row = greedy[0]
    changed = dataclasses.replace(row, tokens=row.tokens[:3] + ((row.tokens[3] + 1) % 60,) + row.tokens[4:])
    assert_rows_equal_or_tie(target, feats, greedy, greedy, dtype)  # equal rows pass
    with pytest.raises(AssertionError, match="row 0: diverges at token .* without a tie"):
        assert_rows_equal_or_tie(target, feats, [changed, *greedy[1:]], greedy, dtype)


# -- the fp16/bf16 contract, row by row against transformers generate() with timestamps -----------------------

NEEDS_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("speculative", [False, True])
@pytest.mark.cuda
@NEEDS_GPU
def test_half_precision_contract_against_generate_with_timestamps(dtype, speculative):
    """Every emitted token is the target's own argmax after Whisper's rules; a row may differ from transformers'
    generate() only from a position where the top two scores are within rounding (checked there), never elsewhere."""
    target = tiny_target().to("cuda", dtype)
    feats = _features(8).cuda().to(dtype)
    draft = decoder_draft(target) if speculative else None
    opts = DecodeOptions(language="en", timestamps=True, max_new_tokens=40, num_draft_tokens=4)
    results = Engine(target, draft, opts).decode(feats, batch_size=4)
    for row, r in enumerate(results):
        ref = hf_greedy(target, feats[row], language="en", task="transcribe", timestamps=True, max_new_tokens=40)
        diverged = first_divergence(target, feats[row], r.prompt + r.tokens, ref, len(r.prompt), True)
        if diverged is not None:  # a near-tie: the top two within 16 units of rounding of the larger one
            i, gap, top = diverged
            assert gap <= 16 * torch.finfo(dtype).eps * max(1.0, abs(top)), (
                f"row {row} ({dtype}): differs from generate() at token {i} without a near-tie (gap {gap:.3g})")


@pytest.mark.parametrize("speculative", [False, True])
@pytest.mark.cuda
@NEEDS_GPU
def test_cuda_graphs_equal_eager(speculative):
    """The captured step replays the eager step's kernels: identical tokens and statistics, with refills and a
    shrinking tail (10 chunks through 4 slots), also in a second run of the same engine (issue 35)."""
    target = tiny_target().to("cuda", torch.float16)
    feats = _features(10).cuda().half()
    draft = decoder_draft(target) if speculative else None
    runs = {}
    for graphs in (False, True):
        opts = DecodeOptions(language="en", timestamps=True, max_new_tokens=40, cuda_graphs=graphs)
        engine = Engine(target, draft, opts)
        runs[graphs] = engine.decode(feats, batch_size=4)
        if graphs:
            assert engine.runner.graphs, "no CUDA graph was captured"
            # a second run of the same engine replays the graphs on the same (reset) state: the same again
            again = engine.decode(feats, batch_size=4)
            assert [(r.tokens, r.stats) for r in again] == [(r.tokens, r.stats) for r in runs[True]]
    assert [(r.tokens, r.stats) for r in runs[True]] == [(r.tokens, r.stats) for r in runs[False]]


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two NVIDIA GPUs")
def test_an_engine_on_the_second_gpu_decodes_as_on_the_first():
    """`--device cuda:1`: streams, graph captures and the host read's event were the current device's (cuda:0),
    so the capture recorded nothing, every replay did nothing and the read raced the copy."""
    feats = _features(10)
    runs = {}
    for device in ("cuda:0", "cuda:1"):
        target = tiny_target().to(device, torch.float16)
        opts = DecodeOptions(language="en", timestamps=True, max_new_tokens=40, cuda_graphs=True)
        engine = Engine(target, decoder_draft(target), opts)
        runs[device] = [(r.tokens, r.stats) for r in engine.decode(feats.to(device).half(), batch_size=4)]
        assert engine.runner.graphs and torch.cuda.current_device() == 0
    assert runs["cuda:1"] == runs["cuda:0"]


@pytest.mark.cuda
@NEEDS_GPU
def test_graphs_captured_ahead_equal_eager():
    """`Engine.capture_ahead` on a real GPU: every (rows bucket, key bucket) captured on parked slots (no
    device-side assert), then a speculative run that captures nothing more gives the eager run's tokens."""
    target = tiny_target().to("cuda", torch.float16)
    feats = _features(10).cuda().half()
    opts = DecodeOptions(language="en", timestamps=True, max_new_tokens=40)
    engine = Engine(target, decoder_draft(target), opts)
    n_graphs = engine.capture_ahead(4)
    assert n_graphs == len(engine.runner.graphs) > 0
    results = engine.decode(feats, batch_size=4)
    assert len(engine.runner.graphs) == n_graphs
    eager = Engine(target, decoder_draft(target), replace(opts, cuda_graphs=False)).decode(feats, batch_size=4)
    assert [(r.tokens, r.stats) for r in results] == [(r.tokens, r.stats) for r in eager]


@pytest.mark.cuda
@NEEDS_GPU
def test_oracle_bench_on_gpu_through_cuda_graphs():
    """benchmarks/gpu_bench.py's tiny run on the GPU (fp32, so no near-tie may make a row differ), eager and CUDA
    graphs: the captured step reads the oracle's acceptance as set between runs, every row equals greedy."""
    with script_module("gpu_bench") as bench:
        rows = bench.main(["--device", "cuda", "--tiny", "--dtype", "float32", "--modes", "eager,graphs"])
    assert {row["mode"] for row in rows} == {"eager", "graphs"}
    assert bench.check(rows, 0.05) == []
