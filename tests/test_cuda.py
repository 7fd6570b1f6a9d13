"""CUDA checks (fp16/bf16): speculative == the same engine's greedy on the GPU, and fp32 == transformers.

Skipped without an NVIDIA GPU.
"""

from __future__ import annotations

import pytest
import torch

from asr_spec.engine import DecodeOptions, Engine
from asr_spec.models.loading import decoder_draft
from conftest import hf_greedy, perturbed, tiny_target

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]


def _features(n=12):
    return torch.randn(n, 16, 100, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("batch_size", [1, 4, 8])
def test_speculative_equals_engine_greedy_on_gpu(dtype, batch_size):
    target = tiny_target().to("cuda", dtype)
    feats = _features().cuda()
    greedy = Engine(target, None, DecodeOptions(language="en", max_new_tokens=40), batch_size=batch_size).decode(feats)
    for draft in (decoder_draft(target), perturbed(tiny_target(), 0.3, seed=3).to("cuda", dtype)):
        spec = Engine(target, draft, DecodeOptions(language="en", max_new_tokens=40), batch_size=batch_size)
        results = spec.decode(feats)
        same = sum(a.tokens == b.tokens for a, b in zip(results, greedy))
        # fp16 verification of K+1 positions in one pass vs one at a time can flip a near-tie; allow one row
        assert same >= len(greedy) - 1, f"{len(greedy) - same} rows differ"


def test_fp32_on_gpu_equals_transformers():
    target = tiny_target().cuda()
    feats = _features(6).cuda()
    results = Engine(target, decoder_draft(target), DecodeOptions(language="en", max_new_tokens=40),
                     batch_size=3).decode(feats)
    for row, r in enumerate(results):
        assert r.prompt + r.tokens == tuple(hf_greedy(target, feats[row], language="en", task="transcribe",
                                                      max_new_tokens=40))
