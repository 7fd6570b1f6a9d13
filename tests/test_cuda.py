"""CUDA checks (fp16/bf16): speculative == the same engine's greedy on the GPU, and fp32 == transformers.

Skipped without an NVIDIA GPU (except the check of the tie check itself, which runs bf16 on the CPU).

Half precision: verifying K+1 positions in one pass and decoding one position at a time round differently, so a
row may leave the engine's greedy output where the target's top two scores are a numerical tie. Every row must
equal greedy, or first differ at a position where the target's top-2 rule-applied scores (computed in float32 from
the same half-precision weights, at the common prefix) are within the tolerance of that dtype. Anything else fails.
"""

from __future__ import annotations

import copy

import pytest
import torch

from asr_spec.engine import DecodeOptions, Engine
from asr_spec.engine.rules import LogitRules, WhisperTokens
from asr_spec.models.loading import decoder_draft
from conftest import hf_greedy, perturbed, tiny_target


DEVICE = "cuda"
# Largest top-2 gap of the target's scores that counts as a tie, per dtype: a few units in the last place of
# logits of size ~10 (fp16: 10-bit mantissa, ulp(8..16) = 2^-7; bf16: 7-bit mantissa, ulp(8..16) = 2^-4).
TIE = {torch.float16: 4 * 2.0 ** -7, torch.bfloat16: 4 * 2.0 ** -4}


def _features(n=12):
    return torch.randn(n, 16, 100, generator=torch.Generator().manual_seed(0))


def assert_rows_equal_or_tie(target, feats, results, greedy, dtype, timestamps: bool = False) -> None:
    """Each row of `results` equals `greedy`'s, or first differs where the target's top-2 scores tie."""
    reference = copy.deepcopy(target).float()  # the same (rounded) weights, scored without half-precision rounding
    tokens = WhisperTokens.from_generation_config(target.generation_config, 448)
    rules = LogitRules(tokens, target.config.vocab_size, timestamps, torch.device("cpu"))
    for row, (res, ref) in enumerate(zip(results, greedy)):
        ours, theirs = res.prompt + res.tokens, ref.prompt + ref.tokens
        if ours == theirs:
            continue
        i = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
        assert i >= len(res.prompt), f"row {row}: prompts differ {res.prompt} vs {ref.prompt}"
        prefix = torch.tensor([theirs[:i]])
        with torch.no_grad():
            logits = reference(input_features=feats[row][None].float(),
                               decoder_input_ids=prefix.to(feats.device)).logits[:, -1:].cpu()
        scores = rules.apply(logits, prefix, torch.tensor([i]), torch.tensor([len(res.prompt)]))[0, 0]
        top2 = scores.topk(2).values
        gap = float(top2[0] - top2[1])
        assert gap <= TIE[dtype], (f"row {row}: diverges at token {i} ({ours[i:i + 3]} vs {theirs[i:i + 3]}) "
                                   f"without a tie (top-2 gap {gap:.2e} > {TIE[dtype]:.2e} for {dtype})")


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
def test_fp32_on_gpu_equals_transformers():
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
