"""The bf16 path on a CPU (`--dtype bfloat16`, faster where bf16 products are native): what "lossless" means there.

A bf16 target's transcript is that target's own greedy decoding: every emitted token is the argmax, after
Whisper's rules, of the bf16 model's scores. Two bf16 computations of the same scores (transformers' modules and
this engine's oneDNN products; a (K+1)-token verify pass and a 1-token step) round differently, so a row may part
from the reference only where the reference's top two scores are within bf16 rounding (checked there, as
tests/test_cuda.py does for CUDA); anywhere else is a failure. Speculative == greedy holds in the same sense in bf16
and exactly (up to fp32 ties) in fp32 (tests/test_engine.py).

On a CPU without native bf16 (AVX2-only) the same products are emulated: slower, the same contract, so these tests
run there too.
"""

from __future__ import annotations

import functools

import pytest
import torch
from conftest import first_divergence, hf_greedy, perturbed, tiny_target
from test_cuda import assert_rows_equal_or_tie

from asr_spec.engine import DecodeOptions, Engine
from asr_spec.models.loading import decoder_draft

DTYPE = torch.bfloat16
MAX_NEW = 30


@functools.cache
def _target():
    return tiny_target().to(DTYPE)


@functools.cache
def _features(n: int = 8) -> torch.Tensor:
    return torch.randn(n, 16, 100, generator=torch.Generator().manual_seed(0)).to(DTYPE)


@functools.cache
def _greedy(batch_size: int, timestamps: bool):
    options = DecodeOptions(language="en", timestamps=timestamps, max_new_tokens=MAX_NEW)
    return Engine(_target(), None, options).decode(_features(), batch_size=batch_size)


@pytest.mark.parametrize("timestamps", [False, True])
def test_bf16_tokens_are_the_bf16_targets_own_greedy(timestamps):
    """Each row equals transformers' generate() of the same bf16 model, or parts from it only at a near-tie of the
    bf16 scores (within 16 units of bf16 rounding of the larger one)."""
    results = _greedy(4, timestamps)
    n_equal = 0
    for row, r in enumerate(results):
        ref = hf_greedy(_target(), _features()[row], language="en", task="transcribe", timestamps=timestamps,
                        max_new_tokens=MAX_NEW)
        diverged = first_divergence(_target(), _features()[row], r.prompt + r.tokens, ref, len(r.prompt), timestamps)
        if diverged is None:
            n_equal += 1
            continue
        i, gap, top = diverged
        assert gap <= 16 * torch.finfo(DTYPE).eps * max(1.0, abs(top)), (
            f"row {row}: differs from generate() at token {i} without a bf16 near-tie (gap {gap:.3g})")
    assert n_equal >= len(results) // 2  # a near-tie is the exception, not the rule


@pytest.mark.parametrize("batch_size", [1, 4, 8])
@pytest.mark.parametrize("draft_name", ["self", "perturbed"])
def test_bf16_speculative_equals_bf16_greedy(draft_name, batch_size):
    draft = {"self": lambda: decoder_draft(_target()),
             "perturbed": lambda: decoder_draft(perturbed(tiny_target(), 0.3, seed=3, encoder=False).to(DTYPE))}
    options = DecodeOptions(language="en", max_new_tokens=MAX_NEW, num_draft_tokens=4)
    results = Engine(_target(), draft[draft_name](), options).decode(_features(), batch_size=batch_size)
    assert sum(r.stats.accepted_tokens for r in results) > 0  # the draft really proposed and was accepted
    assert_rows_equal_or_tie(_target(), _features(), results, _greedy(batch_size, False), DTYPE)
