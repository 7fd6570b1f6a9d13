"""The feature-conditioned (EAGLE-style) draft kind: lossless like every draft (speculative == greedy, token for
token, batch 1-8, mixed finish, with timestamps), its plumbing checked exactly (the engine's proposals are the ones
the teacher-forced training forward makes on the target's own states), its save/load round trip."""

from __future__ import annotations

import functools

import pytest
import torch
from conftest import perturbed, script_module
from test_engine import MAX_NEW, _features, _target, assert_same_as_greedy

from asr_spec.engine import DecodeOptions, DraftKind, Engine, check_pair
from asr_spec.engine.capture import StepRunner
from asr_spec.models import drafts as saved_drafts
from asr_spec.models.feature_draft import (
    init_feature_draft,
    is_feature_draft,
    load_feature_draft,
    save_feature_draft,
    shift_features,
)
from asr_spec.models.loading import load_distilled


def _self_draft():
    """All the target's layers with fc = [0 | I]: the draft's input is the target's own (token + position), so it
    is the target itself and every proposal is accepted."""
    draft = init_feature_draft(_target(), [0, 1])
    with torch.no_grad():
        d = draft.config.d_model
        draft.model.decoder.fc.weight.copy_(torch.cat([torch.zeros(d, d), torch.eye(d)], 1))
    return draft


def _reading_draft(seed: int = 5):
    """A draft whose proposals depend on the states it reads: the first layer, fc perturbed from [0 | I]."""
    draft = init_feature_draft(_target())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        fc = draft.model.decoder.fc.weight
        fc.add_(torch.randn(fc.shape, generator=gen) * 0.05)
    return draft


@functools.cache
def drafts(name: str):
    return {"self": _self_draft, "reading": _reading_draft,
            "perturbed": lambda: perturbed(_self_draft(), 0.3, seed=3)}[name]()


def run(name: str, batch_size: int, timestamps: bool = False, max_new: int = MAX_NEW, runner=None, **opts):
    options = DecodeOptions(language="en", timestamps=timestamps, max_new_tokens=max_new, **opts)
    return Engine(_target(), drafts(name), options, runner=runner).decode(_features(), batch_size=batch_size)


@functools.cache
def greedy(timestamps: bool, batch_size: int = 1):
    options = DecodeOptions(language="en", timestamps=timestamps, max_new_tokens=MAX_NEW)
    return Engine(_target(), None, options).decode(_features(), batch_size=batch_size)


def test_kind_is_detected():
    assert check_pair(_target(), drafts("reading")) is DraftKind.TARGET_FEATURES


@pytest.mark.parametrize("batch_size", [1, 2, 3, 8])
@pytest.mark.parametrize("name", ["self", "reading", "perturbed"])
def test_speculative_equals_greedy(name, batch_size):
    results = run(name, batch_size)
    assert_same_as_greedy(results, False, MAX_NEW)
    assert [r.tokens for r in results] == [r.tokens for r in greedy(False)]
    assert {r.finish_reason for r in results} == {"eos", "length"}  # mixed finish


@pytest.mark.parametrize("batch_size", [1, 3, 8])
@pytest.mark.parametrize("name", ["self", "reading"])
def test_speculative_equals_greedy_with_timestamps(name, batch_size):
    results = run(name, batch_size, timestamps=True)
    assert_same_as_greedy(results, True, MAX_NEW)
    assert [r.tokens for r in results] == [r.tokens for r in greedy(True)]
    ts_begin = _target().generation_config.no_timestamps_token_id + 1
    assert any(tok >= ts_begin for r in results for tok in r.tokens)


@pytest.mark.parametrize("k", [1, 4, 8])
def test_the_target_as_its_feature_draft_is_always_accepted(k):
    for r in run("self", 4, num_draft_tokens=k, max_new=13 if k == 8 else MAX_NEW):
        assert r.stats.drafted_tokens - r.stats.accepted_tokens <= k  # only the last step is cut by a limit
        assert sum(r.stats.accepted_hist) == r.stats.target_passes


def test_window_statistics_equal_greedy():
    """The target's prefill through the feature store gives the same SOT logits (no-speech probability) and the
    same log-probabilities as the greedy engine at the same batch size (CPU attention rounds by the batch)."""
    for spec, ref in zip(run("reading", 3), greedy(False, 3)):
        assert spec.no_speech_prob == pytest.approx(ref.no_speech_prob, abs=1e-6)  # other kernels: rounding
        assert spec.avg_logprob == pytest.approx(ref.avg_logprob, abs=1e-5)


def _teacher_forced_matches(draft, row: int, tokens: tuple[int, ...], prompt: tuple[int, ...]) -> list[bool]:
    """Per generated token: does the draft's teacher-forced proposal (on the target's own states, the rules the
    engine's draft applies) equal the target's token?"""
    from asr_spec.engine.rules import LogitRules, WhisperTokens

    target = _target()
    seq = torch.tensor([list(prompt) + list(tokens)])
    with torch.no_grad():
        enc = target.model.encoder(_features()[row][None]).last_hidden_state
        states = target.model.decoder(input_ids=seq[:, :-1], encoder_hidden_states=enc).last_hidden_state
        guess = draft.hidden(seq[:, :-1], shift_features(states), enc)
        logits = guess[:, len(prompt) - 1:] @ target.proj_out.weight.T
    wt = WhisperTokens.from_generation_config(target.generation_config, 448)
    rules = LogitRules(wt, target.config.vocab_size, False, torch.device("cpu"))
    at_begin = torch.arange(logits.shape[1])[None, :] == 0
    return (rules.static_scores(logits, at_begin).argmax(-1)[0] == seq[0, len(prompt):]).tolist()


def test_proposals_are_the_teacher_forced_ones_at_k1():
    """At K = 1 every proposal is made from the target's own states (the catch-up), so the accepted count of each
    chunk is exactly what the training forward's teacher-forced proposals give: the states reach the draft at the
    right positions, through admission, rollback and refills (batch 3 over 10 chunks)."""
    from asr_spec.distill.evaluation import simulate_steps

    draft = drafts("reading")
    results = run("reading", 3, num_draft_tokens=1)
    total = 0
    for row, r in enumerate(results):
        matches = _teacher_forced_matches(draft, row, r.tokens, r.prompt)
        _, accepted = simulate_steps(matches, 1)
        assert r.stats.accepted_tokens == accepted, row
        total += accepted
    assert 0 < total < sum(len(r.tokens) for r in results)  # neither vacuous nor trivial


def test_step_traces_into_one_graph():
    """torch.compile(fullgraph=True) traces the step with a feature-conditioned draft (no graph break), at most once
    per (rows, n_keys bucket, K), and gives the eager step's tokens and statistics."""
    from test_capture import Traced

    torch._dynamo.reset()
    config = dict(automatic_dynamic_shapes=False, recompile_limit=64, fail_on_recompile_limit_hit=True)
    traced = Traced()
    with torch._dynamo.config.patch(**config):
        results = run("reading", 3, runner=StepRunner("wrapped", traced.wrap))
    eager = run("reading", 3)
    assert [r.tokens for r in results] == [r.tokens for r in eager]
    assert [r.stats for r in results] == [r.stats for r in eager]
    assert 1 <= traced.traces <= len(traced.keys)


def test_save_load_round_trip(tmp_path):
    draft = drafts("reading")
    draft.draft_vocab_ids = None
    save_feature_draft(draft, tmp_path / "d", dtype=torch.float32, info={"note": "test"})
    assert is_feature_draft(tmp_path / "d")
    loaded = load_distilled(tmp_path / "d", _target())
    assert loaded.model.decoder.layers[0] is not draft.model.decoder.layers[0]
    for k, v in draft.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    assert [r.tokens for r in Engine(_target(), loaded, DecodeOptions(language="en", max_new_tokens=MAX_NEW))
            .decode(_features(), batch_size=2)] == [r.tokens for r in greedy(False)]
    from safetensors.torch import load_file, save_file

    weights = str(tmp_path / "d" / "model.safetensors")
    save_file({k: v for k, v in load_file(weights).items() if not k.endswith("fc.bias")}, weights)
    with pytest.raises(ValueError, match="weights missing for .*fc.bias"):
        load_feature_draft(tmp_path / "d", _target())
    with pytest.raises(ValueError, match="not a decoder-only one"):
        saved_drafts.load_trained_draft(tmp_path / "d", _target())


def test_gpu_bench_measures_the_feature_draft_too(tmp_path):
    """benchmarks/gpu_bench.py --kinds features (on by default at large-v2 shapes): its rows equal greedy, marked."""
    with script_module("gpu_bench") as gpu_bench:
        rows = gpu_bench.main(["--device", "cpu", "--tiny", "--kinds", "features", "--ks", "3", "--check", "0.05"])
    assert [(r["draft"], r["k"]) for r in rows] == [("none", 0), ("features", 3)]
    assert all(r["rows_equal_greedy"] == r["rows"] == 16 for r in rows)
    assert gpu_bench.parse_args([]).kinds == ["oracle", "features"]  # at full shapes both kinds are measured
