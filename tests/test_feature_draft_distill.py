"""`asr-spec distill` for the feature-conditioned draft, on a tiny random target: the cache's stored states are the
draft's inputs (fp16 by default), EAGLE's loss trains it, the teacher-forced evaluation predicts the engine exactly
at K = 1, save/load through the drafts/ format with its kind, and the CLI's train + eval side by side."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from test_distill import MAX_NEW, feats, model  # noqa: F401  (the same tiny target and features as fixtures)

from asr_spec.distill import data as draft_data
from asr_spec.distill import evaluation
from asr_spec.distill import train as distill
from asr_spec.distill.commands import save_draft
from asr_spec.engine import DecodeOptions, Engine
from asr_spec.models.feature_draft import FeatureDraft, is_feature_draft
from asr_spec.models.loading import load_distilled


def _cache(model, feats, out, **kw):
    ids = [f"w{i}" for i in range(len(feats))]
    return draft_data.build_cache(model, [(ids, feats)], len(feats), out, max_new_tokens=MAX_NEW,
                                  enc_dtype="float32", progress=False, **kw)


@pytest.fixture(scope="module")
def cache(model, feats, tmp_path_factory):
    return _cache(model, feats, tmp_path_factory.mktemp("cache"), hidden_dtype="float32")


@pytest.fixture(scope="module")
def ts_cache(model, feats, tmp_path_factory):
    return _cache(model, feats, tmp_path_factory.mktemp("ts"), timestamps=True)  # fp16 states, the default


def _cfg(**kw):
    return distill.TrainConfig(**{**dict(kind="target-features", steps=12, batch_windows=3, lr=3e-3, warmup_steps=2,
                                         eval_every=0, ckpt_every=6, seed=5), **kw})


def test_states_are_stored_in_fp16_by_default(cache, ts_cache):
    assert ts_cache.hidden.dtype == np.float16 and cache.hidden.dtype == np.float32
    b16, b32 = ts_cache.batch([2]), cache.batch([2])
    assert b16.teacher_hidden.dtype == torch.float32  # read as float32 whatever the storage
    n = min(b16.input_ids.shape[1], b32.input_ids.shape[1], ts_cache.prompt_len - 1)  # the shared prompt part
    torch.testing.assert_close(b16.teacher_hidden[0, :n], b32.teacher_hidden[0, :n], atol=1e-2, rtol=1e-3)


def test_config_rejects_feature_options_for_the_decoder_kind():
    with pytest.raises(ValueError, match="target-features drafts only"):
        distill.TrainConfig(reg_weight=1.0)
    with pytest.raises(ValueError, match="kind must be"):
        distill.TrainConfig(kind="eagle")


@pytest.mark.parametrize("noise", [0.0, 0.1])
def test_training_lowers_the_loss(model, cache, ts_cache, tmp_path, noise):
    union = draft_data.CacheUnion([cache, ts_cache])  # both labelling modes
    cfg = _cfg(feature_noise=noise, eval_every=6)
    run = distill.train_draft(model, union, cfg, work_dir=tmp_path, held_out=ts_cache, progress=False)
    assert isinstance(run.draft, FeatureDraft)
    # the curve: teacher-forced agreement, and the engine's own tokens per target pass (not a simulation)
    assert [p["step"] for p in run.history] == [6, 12]
    for point in run.history:
        assert 0 <= point["agreement"] <= 1 and "accepted_k4" not in point
        assert point["engine_k4"]["windows_equal_to_labels"] == f"{len(ts_cache)}/{len(ts_cache)}"
    head = model.proj_out.weight
    vocab = distill.train_vocab(model.config.vocab_size, model.generation_config.suppress_tokens or (), None)
    fresh = distill.init_draft(model, kind="target-features")
    batch = union.batch(range(len(union)))
    clean = _cfg()
    with torch.no_grad():
        before, _ = distill.loss_on_batch(fresh, head, vocab, batch, clean)
        after, _ = distill.loss_on_batch(run.draft, head, vocab, batch, clean)
    assert float(after) < 0.8 * float(before)
    # resumed from its checkpoint: the same weights
    again = distill.train_draft(model, union, cfg, work_dir=tmp_path, progress=False)
    for k, v in distill.trainable_parameters(run.draft).items():
        assert torch.equal(distill.trainable_parameters(again.draft)[k], v), k


def test_teacher_forced_matches_predict_the_engine_at_k1(model, cache, tmp_path):
    """At K = 1 each proposal reads the target's own states, so the cache's teacher-forced matches give exactly the
    engine's accepted tokens (`draft_states` feeds the states as the engine does)."""
    run = distill.train_draft(model, cache, _cfg(steps=4), work_dir=tmp_path, progress=False)
    opts = DecodeOptions(language="en", max_new_tokens=MAX_NEW, num_draft_tokens=1)
    spec = Engine(model, run.draft, opts).decode(None, torch.from_numpy(np.array(cache.encoded)), batch_size=3)
    for i, r in enumerate(spec):
        _, accepted = evaluation.simulate_steps(evaluation.draft_matches(model, run.draft, cache, i), 1)
        assert accepted == r.stats.accepted_tokens, i
    assert 0 < sum(r.stats.accepted_tokens for r in spec) < sum(r.stats.drafted_tokens for r in spec)


def test_saved_draft_round_trip_and_engine_count(model, cache, ts_cache, tmp_path):
    run = distill.train_draft(model, ts_cache, _cfg(steps=3), work_dir=tmp_path / "w", progress=False)
    run.draft.draft_vocab_ids = distill.choose_draft_vocab(ts_cache.token_counts(70), 60, ts_cache.eot)
    save_draft(run.draft, tmp_path / "d", {"note": "test"})
    assert is_feature_draft(tmp_path / "d")
    assert json.loads((tmp_path / "d" / "distill.json").read_text())["kind"] == "target-features"
    loaded = load_distilled(tmp_path / "d", model)
    assert torch.equal(loaded.draft_vocab_ids, run.draft.draft_vocab_ids)
    line = evaluation.engine_tokens_per_pass(model, loaded, ts_cache, 3, batch_size=4)
    assert line["windows_equal_to_labels"] == f"{len(ts_cache)}/{len(ts_cache)}"
    assert 1.0 <= line["tokens_per_target_pass"] <= 4.0


def test_cli_train_and_eval_side_by_side(model, cache, tmp_path, capsys):
    """`distill train --kind target-features` then `distill eval --compare-draft ... --engine-k`."""
    from asr_spec.cli.distill import distill_main

    model.save_pretrained(tmp_path / "target")
    old = distill.train_draft(model, cache, distill.TrainConfig(steps=2, eval_every=0, ckpt_every=0),
                              work_dir=tmp_path / "w0", progress=False).draft
    save_draft(old, tmp_path / "old", {})
    common = ["--model", str(tmp_path / "target")]
    assert distill_main([*common, "train", "--kind", "target-features", "--train-cache", str(cache.path),
                         "--work", str(tmp_path / "w"), "--steps", "3", "--eval-every", "0",
                         "--out", str(tmp_path / "new")]) == 0
    capsys.readouterr()
    assert distill_main([*common, "eval", "--draft", str(tmp_path / "new"), "--compare-draft", str(tmp_path / "old"),
                         "--held-out-cache", str(cache.path), "--engine-k", "2", "3", "--no-speed",
                         "--batch-size", "2"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for name in ("trained", "old"):
        assert set(out[name]) >= {"agreement", "engine_k2", "engine_k3", "draft_step_ms"}
        assert out[name]["engine_k3"]["windows_equal_to_labels"] == f"{len(cache)}/{len(cache)}"


def test_warm_start_from_a_plain_draft_proposes_what_it_proposes(model, cache, tmp_path):
    """A feature-conditioned draft started from a plain distilled draft of as many layers (its layers, LayerNorm
    and head; fc = [0 | I]) drafts exactly the plain draft's tokens before training: the engine accepts the same
    number of them, row by row, and both equal greedy."""
    from asr_spec.models import drafts

    plain = distill.train_draft(model, cache, distill.TrainConfig(steps=3, eval_every=0, ckpt_every=0, lr=3e-3),
                                work_dir=tmp_path / "p", layers=[0, 1], progress=False).draft
    plain.draft_vocab_ids = distill.choose_draft_vocab(cache.token_counts(70), 60, cache.eot)
    saved = drafts.save_trained_draft(plain, tmp_path / "plain", dtype=torch.float32)
    warm = distill.train_draft(model, cache, _cfg(steps=3), work_dir=tmp_path / "w", layers=[0, 1], init_from=saved,
                               stop_after=0, progress=False).draft
    assert isinstance(warm, FeatureDraft)
    assert torch.equal(warm.draft_vocab_ids.cpu(), plain.draft_vocab_ids.cpu())
    enc = torch.from_numpy(np.array(cache.encoded))
    opts = DecodeOptions(language="en", max_new_tokens=MAX_NEW, num_draft_tokens=3)
    greedy = Engine(model, None, opts).decode(None, enc, batch_size=3)
    runs = [Engine(model, d, opts).decode(None, enc, batch_size=3) for d in (load_distilled(saved, model), warm)]
    for g, a, b in zip(greedy, *runs, strict=True):
        assert a.tokens == g.tokens and b.tokens == g.tokens
        assert (a.stats.accepted_tokens, a.stats.drafted_tokens) == (b.stats.accepted_tokens, b.stats.drafted_tokens)
    assert sum(r.stats.accepted_tokens for r in runs[1]) > 0
    with pytest.raises(ValueError, match="init-draft"):  # a plain draft of another layer count does not fit
        distill.train_draft(model, cache, _cfg(steps=3), work_dir=tmp_path / "x", layers=[0], init_from=saved,
                            progress=False)


def test_warm_start_extra():
    plain = {"model.decoder.layers.0.w", "model.decoder.layer_norm.w"}
    feature = plain | {"model.decoder.fc.weight", "model.decoder.fc.bias"}
    assert distill.warm_start_extra(plain, plain) == set()
    assert distill.warm_start_extra(feature, plain) == {"model.decoder.fc.weight", "model.decoder.fc.bias"}
    assert distill.warm_start_extra(feature, feature) == set()
    assert distill.warm_start_extra(plain, feature) is None  # the source has a tensor the draft lacks
    assert distill.warm_start_extra(feature | {"model.decoder.layers.1.w"}, plain) is None


def test_the_projection_learns_at_its_own_share_of_the_rate(model, cache, tmp_path):
    """projection_lr_scale: fc's group runs at that share of the schedule's lr, the layers at the whole of it; a
    decoder-only draft has no projection and refuses the option."""
    cfg = _cfg(steps=4, warmup_steps=1, projection_lr_scale=0.01, ckpt_every=0)
    draft = distill.init_draft(model, kind="target-features")
    params = distill.trainable_parameters(draft)
    groups = distill.param_groups(params, cfg)
    assert [g["lr_scale"] for g in groups] == [1.0, 0.01]
    assert {id(p) for p in groups[1]["params"]} == {id(draft.model.decoder.fc.weight), id(draft.model.decoder.fc.bias)}
    assert sum(len(g["params"]) for g in groups) == len(params)
    run = distill.train_draft(model, cache, cfg, work_dir=tmp_path, progress=False, stop_after=2)
    assert run.draft is not None
    plain = distill.trainable_parameters(distill.init_draft(model))
    assert [g["lr_scale"] for g in distill.param_groups(plain, distill.TrainConfig())] == [1.0]
    with pytest.raises(ValueError, match="target-features drafts only"):
        distill.TrainConfig(projection_lr_scale=0.5)
    with pytest.raises(ValueError, match="projection_lr_scale must be > 0"):
        _cfg(projection_lr_scale=0.0)


def test_a_small_projection_rate_moves_the_state_columns_less(model, cache, tmp_path):
    """The same steps with the projection at 1/100 of the rate change fc's state columns about 100x less (Adam:
    a step's size is the rate's, whatever the gradient's scale)."""
    moved = []
    for scale in (1.0, 0.01):
        cfg = _cfg(steps=3, warmup_steps=1, projection_lr_scale=scale, ckpt_every=0)
        draft = distill.train_draft(model, cache, cfg, work_dir=tmp_path / str(scale), progress=False).draft
        d = model.config.d_model
        moved.append(float(draft.model.decoder.fc.weight.detach()[:, :d].abs().max()))  # the state columns start at 0
    assert 0 < moved[1] < moved[0] / 20
