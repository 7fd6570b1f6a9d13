"""Draft distillation on a tiny random target: cache round-trip, training, agreement metric, resume, save/load."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from conftest import tiny_target

from asr_spec.distill import data as draft_data
from asr_spec.distill import evaluation
from asr_spec.distill import train as distill
from asr_spec.engine import DecodeOptions, Engine
from asr_spec.errors import InputError
from asr_spec.models import drafts

MAX_NEW = 24


@pytest.fixture(scope="module")
def model():
    return tiny_target()


@pytest.fixture(scope="module")
def feats():
    return torch.randn(8, 16, 100, generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def cache(model, feats, tmp_path_factory):
    out = tmp_path_factory.mktemp("cache")
    ids = [f"w{i}" for i in range(len(feats))]
    batches = [(ids[:5], feats[:5]), (ids[5:], feats[5:])]
    return draft_data.build_cache(model, batches, len(feats), out, max_new_tokens=MAX_NEW, enc_dtype="float32",
                               progress=False, hidden_dtype="float32")


@pytest.fixture(scope="module")
def ts_cache(model, cache, tmp_path_factory):
    """`cache`'s windows labelled again in timestamp mode from its stored encoder outputs (`distill cache
    --from-cache --timestamps`)."""
    enc = torch.from_numpy(np.array(cache.encoded))
    return draft_data.build_cache(model, [(cache.meta["ids"], enc)], len(cache), tmp_path_factory.mktemp("ts"),
                                  max_new_tokens=MAX_NEW, enc_dtype="float32", timestamps=True, pre_encoded=True,
                                  progress=False)


def test_pack_windows_fills_in_order_and_rejects_too_long():
    assert draft_data.pack_windows([10, 10, 10, 5], max_window_s=29, gap_s=0.5) == [[0, 1], [2, 3]]
    assert draft_data.pack_windows([], max_window_s=29) == []
    with pytest.raises(ValueError, match="utterance 1"):
        draft_data.pack_windows([3, 31], max_window_s=29)
    joined = draft_data.join_audio([np.ones(10, np.float32), np.ones(5, np.float32)], gap_s=0.001, sample_rate=2000)
    assert joined.tolist() == [1.0] * 10 + [0.0, 0.0] + [1.0] * 5


def test_cache_round_trip_matches_engine_greedy(model, feats, cache):
    engine = Engine(model, None, DecodeOptions(language="en", max_new_tokens=MAX_NEW))
    enc = engine.encode(feats, 3)
    results = engine.decode(None, enc, batch_size=3)
    reopened = draft_data.PseudoLabelCache(cache.path)
    assert len(reopened) == len(feats)
    for i, r in enumerate(results):
        assert reopened.sequence(i) == list(r.prompt) + list(r.tokens)
    assert np.allclose(reopened.encoded[:], enc.numpy(), atol=1e-4)  # batch shapes differ: float rounding
    assert reopened.meta["ids"][3] == ["w3"]
    b = reopened.batch([0, 3])
    n0 = int(reopened.lengths[0])
    assert (b.labels[0] != -100).sum() == n0 - reopened.prompt_len  # one label per generated token
    # the cached teacher state gives the target's own teacher-forced logits
    with torch.no_grad():
        ref = model(encoder_outputs=(enc[:1],), decoder_input_ids=b.input_ids[:1, : n0 - 1]).logits
    got = b.teacher_hidden[:1, : n0 - 1] @ model.proj_out.weight.T
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_agreement_is_one_for_the_target_as_draft(model, cache):
    draft = distill.init_draft(model, layers=list(range(model.config.decoder_layers)))
    rep = evaluation.evaluate_agreement(model, draft, cache)
    assert rep.agreement == 1.0 and rep.tokens > 0
    assert rep.accepted_per_step[4] > 1.0 and rep.tokens_per_pass[8] >= rep.tokens_per_pass[4]


def test_timestamp_relabel_is_the_engines_timestamp_decoding(model, cache, ts_cache):
    enc = torch.from_numpy(np.array(cache.encoded))
    results = Engine(model, None, DecodeOptions(language="en", max_new_tokens=MAX_NEW, timestamps=True)).decode(
        None, enc, batch_size=3)
    assert ts_cache.timestamps and not cache.timestamps
    assert ts_cache.prompt_len == cache.prompt_len - 1  # no <|notimestamps|> in the prompt
    for i, r in enumerate(results):
        assert ts_cache.sequence(i) == list(r.prompt) + list(r.tokens)
        assert r.tokens[0] >= model.generation_config.no_timestamps_token_id + 1  # a timestamp comes first
    assert np.array_equal(ts_cache.encoded[:], cache.encoded[:])
    assert ts_cache.meta["ids"] == cache.meta["ids"]


def test_cache_union_rows_keep_their_own_cache_and_prompt(model, cache, ts_cache):
    union = draft_data.CacheUnion([cache, ts_cache])
    assert len(union) == 2 * len(cache)
    both = union.batch([1, len(cache) + 1])
    for row, single in enumerate((cache.batch([1]), ts_cache.batch([1]))):
        n = single.input_ids.shape[1]
        assert torch.equal(both.input_ids[row, :n], single.input_ids[0])
        assert torch.equal(both.labels[row, :n], single.labels[0]) and (both.labels[row, n:] == -100).all()
        torch.testing.assert_close(both.teacher_hidden[row, :n], single.teacher_hidden[0])
        torch.testing.assert_close(both.encoded[row], single.encoded[0])
    v = model.config.vocab_size
    assert (union.token_counts(v) == cache.token_counts(v) + ts_cache.token_counts(v)).all()


@pytest.mark.parametrize("timestamps", [False, True])
def test_agreement_predicts_the_engines_accepted_tokens(model, cache, ts_cache, timestamps):
    """Teacher-forced matches, run through constant-K speculation, give exactly the tokens the engine accepts:
    the evaluation picks proposals as the engine's draft does, in timestamp mode too."""
    held = ts_cache if timestamps else cache
    draft = distill.init_draft(model, layers=[1])
    opts = DecodeOptions(language="en", max_new_tokens=MAX_NEW, timestamps=timestamps, num_draft_tokens=3)
    spec = Engine(model, draft, opts).decode(None, torch.from_numpy(np.array(held.encoded)), batch_size=3)
    for i, r in enumerate(spec):
        _, accepted = evaluation.simulate_steps(evaluation.draft_matches(model, draft, held, i), 3)
        assert accepted == r.stats.accepted_tokens, i
    assert 0 < sum(r.stats.accepted_tokens for r in spec) < sum(r.stats.drafted_tokens for r in spec)


def test_training_can_start_from_a_saved_draft(model, cache, ts_cache, tmp_path):
    first = distill.train_draft(model, cache, _cfg(steps=3), work_dir=tmp_path / "a", progress=False).draft
    saved = drafts.save_trained_draft(first, tmp_path / "first", dtype=torch.float32)
    union = draft_data.CacheUnion([cache, ts_cache])
    again = distill.train_draft(model, union, _cfg(steps=3), work_dir=tmp_path / "b", init_from=saved, stop_after=0,
                                progress=False).draft
    for k, v in distill.trainable_parameters(first).items():
        assert torch.equal(distill.trainable_parameters(again)[k], v), k
    with pytest.raises(ValueError, match="init-draft"):
        distill.train_draft(model, union, _cfg(steps=3), work_dir=tmp_path / "c", layers=[0], init_from=saved,
                            progress=False)


def test_simulate_steps():
    assert evaluation.simulate_steps([True] * 6, 4) == (2, 5)  # 4 accepted + 1, then 1 accepted + nothing left
    assert evaluation.simulate_steps([False] * 3, 4) == (3, 0)
    assert evaluation.simulate_steps([True, False, True, True], 2) == (2, 3)
    assert evaluation.simulate_steps([True, True], 4) == (1, 2)  # cut by its limit: the last accepted, no bonus


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decoder_step_ms_times_a_step_in_the_decoders_own_audio_layout(dtype):
    """`distill eval`'s step timer writes its random keys/values as the decoder stores them: a bf16 decoder holds
    them in int8 with a scale a channel where the CPU attention kernel runs (its `normal_()` of the int8 cache
    raised there), and the step reads them."""
    model = tiny_target().to(dtype)
    assert evaluation.decoder_step_ms(model, 2, model.config.max_source_positions, repeats=2) > 0


def test_choose_draft_vocab_keeps_seen_tokens_then_low_ids():
    counts = np.zeros(50, dtype=np.int64)
    counts[[30, 7, 12]] = [5, 9, 1]
    v = distill.choose_draft_vocab(counts, 6, eot=40)
    assert v.tolist() == [0, 1, 7, 12, 30, 40]


def _cfg(**kw):
    return distill.TrainConfig(**{**dict(steps=8, batch_windows=3, lr=3e-3, warmup_steps=2, eval_every=0,
                                         ckpt_every=4, seed=5), **kw})


def test_training_lowers_the_loss(model, cache, tmp_path):
    cfg = _cfg()
    vocab = distill.train_vocab(model.config.vocab_size, model.generation_config.suppress_tokens, None)
    b = cache.batch(list(range(len(cache))))
    with torch.no_grad():
        before = float(distill.loss_on_batch(distill.init_draft(model), model.proj_out.weight, vocab, b, cfg)[0])
    res = distill.train_draft(model, cache, cfg, work_dir=tmp_path, progress=False)
    with torch.no_grad():
        after = float(distill.loss_on_batch(res.draft, model.proj_out.weight, vocab, b, cfg)[0])
    assert after < before


def test_history_has_held_out_agreement_every_eval_and_at_the_end(model, cache, tmp_path):
    res = distill.train_draft(model, cache, _cfg(steps=5, eval_every=2), work_dir=tmp_path / "h", held_out=cache,
                              progress=False)
    assert [h["step"] for h in res.history] == [2, 4, 5]
    assert all(0.0 <= h["agreement"] <= 1.0 and "accepted_k4" in h for h in res.history)
    plain = distill.train_draft(model, cache, _cfg(steps=5, eval_every=2), work_dir=tmp_path / "p", progress=False)
    assert [sorted(h) for h in plain.history] == [["loss", "step"]] * 2


def test_resume_gives_the_same_draft(model, cache, tmp_path):
    cfg = _cfg()
    whole = distill.train_draft(model, cache, cfg, work_dir=tmp_path / "a", progress=False).draft
    distill.train_draft(model, cache, cfg, work_dir=tmp_path / "b", stop_after=4, progress=False)
    resumed = distill.train_draft(model, cache, cfg, work_dir=tmp_path / "b", progress=False).draft
    for (k, a), (_, b) in zip(distill.trainable_parameters(whole).items(),
                              distill.trainable_parameters(resumed).items(), strict=True):
        assert torch.equal(a, b), k
    with pytest.raises(ValueError, match="different run"):
        distill.train_draft(model, cache, dataclasses.replace(cfg, lr=1e-3), work_dir=tmp_path / "b",
                            progress=False)


@pytest.mark.parametrize("restricted", [False, True])
def test_saved_draft_loads_and_engine_output_equals_greedy(model, cache, feats, tmp_path, restricted):
    vocab = None
    if restricted:
        vocab = distill.choose_draft_vocab(cache.token_counts(model.config.vocab_size), 30, eot=cache.eot)
    res = distill.train_draft(model, cache, _cfg(steps=3), work_dir=tmp_path / "w", draft_vocab=vocab,
                              progress=False)
    out = drafts.save_trained_draft(res.draft, tmp_path / "draft", dtype=torch.float32, info={"seed": 5})
    assert (out / drafts.VOCAB_FILE).exists() == restricted
    loaded = drafts.load_trained_draft(out, model)
    for k, v in distill.trainable_parameters(res.draft).items():
        assert torch.equal(loaded.state_dict()[k], v), k
    assert loaded.model.decoder.embed_tokens.weight is model.model.decoder.embed_tokens.weight
    half = drafts.load_trained_draft(drafts.save_trained_draft(res.draft, tmp_path / "fp16"), model)  # default fp16
    for k, v in distill.trainable_parameters(res.draft).items():
        assert half.state_dict()[k].dtype == torch.float32 and torch.equal(half.state_dict()[k], v.half().float()), k
    if restricted:
        assert loaded.draft_vocab_ids.tolist() == vocab.tolist()
    opts = DecodeOptions(language="en", max_new_tokens=MAX_NEW, num_draft_tokens=3)
    greedy = Engine(model, None, opts).decode(feats, batch_size=3)
    spec = Engine(model, loaded, opts).decode(feats, batch_size=3)
    assert [r.tokens for r in spec] == [r.tokens for r in greedy]
    assert sum(r.stats.drafted_tokens for r in spec) > 0


def test_distill_command_end_to_end(tmp_path, capsys):
    """`asr-spec distill run` on the committed LibriSpeech-layout fixture with a tiny target: the draft it saves
    loads through models.load_draft (sharing the target's embeddings) and decodes losslessly."""
    from pathlib import Path

    from test_transcribe import save_tiny_models

    from asr_spec.cli import main
    from asr_spec.engine import DecodeOptions, Engine
    from asr_spec.models.loading import load_draft, load_model

    target_dir, _ = save_tiny_models(tmp_path)
    corpus = Path(__file__).parent / "fixtures" / "librispeech"
    out = tmp_path / "draft"
    with pytest.raises(SystemExit) as info:
        main(["distill", "--model", str(target_dir), "run", "--audio", str(corpus), "--split", "test-clean",
              "--out", str(out), "--layers", "1", "--steps", "2", "--vocab-size", "0", "--max-new-tokens", "16",
              "--max-utterances", "4"])
    assert (info.value.code or 0) == 0, capsys.readouterr().err
    assert (out / "distill.json").is_file()
    cpu = torch.device("cpu")
    target = load_model(target_dir, cpu, torch.float32)
    draft = load_draft(out, target, cpu, torch.float32)
    assert draft.model.decoder.embed_tokens.weight.data_ptr() == target.model.decoder.embed_tokens.weight.data_ptr()
    feats = torch.randn(3, 80, 3000, generator=torch.Generator().manual_seed(0))
    opts = DecodeOptions(language="en", max_new_tokens=12)
    greedy = Engine(target, None, opts).decode(feats, batch_size=3)
    spec = Engine(target, draft, opts).decode(feats, batch_size=3)
    assert [r.tokens for r in spec] == [r.tokens for r in greedy]

    # held-out evaluation of the same draft with other heads: a restriction only removes candidates
    capsys.readouterr()
    cache_dir = tmp_path / "draft.work" / "cache"
    with pytest.raises(SystemExit) as info:
        main(["distill", "--model", str(target_dir), "eval", "--held-out-cache", str(cache_dir), "--draft", str(out),
              "--no-speed", "--head-sizes", "3", "0", "--train-cache", str(cache_dir), "--sim-k", "2", "3"])
    assert (info.value.code or 0) == 0, capsys.readouterr().err
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    small, full = report["trained-head-3"], report["trained-head-full"]
    assert full["vocab_coverage"] == 1.0 and small["vocab_coverage"] < 1.0
    assert small["agreement"] <= full["agreement"]
    assert set(small["tokens_per_pass"]) == {"2", "3", "4"}  # --sim-k plus --k

    # ... and saved again with the head that comparison chose: same layers, the restricted head
    capsys.readouterr()
    smaller = tmp_path / "draft-head-3"
    with pytest.raises(SystemExit) as info:
        main(["distill", "--model", str(target_dir), "head", "--draft", str(out), "--train-cache", str(cache_dir),
              "--head-size", "3", "--out", str(smaller)])
    assert (info.value.code or 0) == 0, capsys.readouterr().err
    restricted = load_draft(smaller, target, cpu, torch.float32)
    assert len(restricted.draft_vocab_ids) == 3
    assert json.loads((smaller / "distill.json").read_text())["head"]["size"] == 3
    spec = Engine(target, restricted, opts).decode(feats, batch_size=3)
    assert [r.tokens for r in spec] == [r.tokens for r in greedy]


def test_distill_commands_fail_in_one_line(tmp_path, capsys, cache):
    """A model that is not there, or a relabel into the very cache it reads (whose encoder outputs would be
    truncated as they are read): one `error:` line naming the cause, no traceback, and the cache left whole."""
    from test_transcribe import save_tiny_models

    from asr_spec.cli import main

    target_dir, _ = save_tiny_models(tmp_path)
    for argv, words in (
        (["--model", str(tmp_path / "absent"), "train", "--train-cache", str(cache.path), "--out", str(tmp_path / "d"),
          "--work", str(tmp_path / "w")],
         str(tmp_path / "absent")),
        (["--model", str(target_dir), "cache", "--from-cache", str(cache.path), "--out", str(cache.path)],
         "the same folder"),
    ):
        capsys.readouterr()
        with pytest.raises(SystemExit) as info:
            main(["distill", *argv])
        err = capsys.readouterr().err
        assert info.value.code == 1 and "Traceback" not in err, err
        lines = [line for line in err.splitlines() if line.startswith("error:")]
        assert len(lines) == 1 and words in lines[0], err
    assert float(np.abs(np.asarray(cache.encoded)).sum()) > 0  # not truncated


def test_layer_ids_by_count_by_id_and_bad_specs():
    from asr_spec.distill.arguments import layer_ids

    assert layer_ids("2", 6) == [0, 5] and layer_ids("1", 6) == [0] and layer_ids("3", 6) == [0, 2, 5]
    assert layer_ids("0,5", 6) == [0, 5] and layer_ids("5,", 6) == [5]
    for bad in ("7,", "a,b", ",", "0"):
        with pytest.raises(InputError, match="--layers"):
            layer_ids(bad, 6)
