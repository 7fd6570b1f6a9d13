"""`asr-spec distill` runs as a user makes them (a reviewer's findings): a resumed run asked for another head, a run
stopped early by --stop-after, a corpus that grew, a work folder inside --out, a cache folder that holds one,
training options checked before labelling, heads of impossible sizes, a corpus not in LibriSpeech's layout."""

from __future__ import annotations

import dataclasses
import logging
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import tiny_target
from test_distill_inputs import CORPUS, TRAINING, distill_cli, error_lines

from asr_spec.distill import commands
from asr_spec.distill import data as draft_data
from asr_spec.distill import train as distill
from asr_spec.errors import InputError


@pytest.fixture(scope="module")
def labelled(tmp_path_factory):
    """A cache of 3 random windows labelled by conftest's tiny target (16 mels, 50 audio positions)."""
    feats = torch.randn(3, 16, 100, generator=torch.Generator().manual_seed(2))
    return draft_data.build_cache(tiny_target(), [(["a", "b", "c"], feats)], 3, tmp_path_factory.mktemp("cache"),
                                  max_new_tokens=12, enc_dtype="float32", progress=False)


def _train_args(tmp_path: Path, cache, **change) -> SimpleNamespace:
    values = dict(model="in-memory", train_cache=[cache.path], held_out_cache=None, init_draft=None,
                  work=tmp_path / "work", out=tmp_path / "draft", overwrite=False, stop_after=None,
                  **{**TRAINING, "steps": 2, "batch_windows": 2, "ckpt_every": 1})
    return SimpleNamespace(**{**values, **change})


def test_a_checkpoint_is_not_resumed_with_another_head(tmp_path, labelled):
    """--vocab-size 4096, then 1000, then none, into one work folder: each saved the first run's 4096-token head
    (the checkpoint's), whatever the command said; now another head size is another run, refused by name."""
    model = tiny_target()
    cfg = distill.TrainConfig(steps=3, batch_windows=2, eval_every=0, ckpt_every=1)
    counts = labelled.token_counts(model.config.vocab_size)
    heads = {size: distill.choose_draft_vocab(counts, size, labelled.eot) for size in (20, 10)}
    work = tmp_path / "work"
    distill.train_draft(model, labelled, cfg, work_dir=work, layers=[0], draft_vocab=heads[20], stop_after=1,
                        progress=False)
    for vocab, wanted in ((heads[10], "10"), (None, "None")):
        with pytest.raises(ValueError, match=rf"\(head_size: recorded 20, wanted {wanted}\)"):
            distill.train_draft(model, labelled, cfg, work_dir=work, layers=[0], draft_vocab=vocab, stop_after=2,
                                progress=False)
    state = torch.load(work / "ckpt.pt", weights_only=True)  # one recorded before head_size was: its head's size
    del state["head_size"]
    torch.save(state, work / "ckpt.pt")
    with pytest.raises(ValueError, match=r"\(head_size: recorded 20, wanted 10\)"):
        distill.train_draft(model, labelled, cfg, work_dir=work, layers=[0], draft_vocab=heads[10], stop_after=2,
                            progress=False)
    res = distill.train_draft(model, labelled, cfg, work_dir=work, layers=[0], draft_vocab=heads[20],
                              progress=False)
    assert res.finished and res.step == 3 and torch.equal(res.draft.draft_vocab_ids, heads[20])


def test_stop_after_saves_nothing_and_the_same_command_goes_on(tmp_path, labelled, caplog, monkeypatch):
    """--stop-after 1 of 2 steps saved the half-trained draft as --out (its distill.json could not tell), and the
    same command without --stop-after then failed: --out "already holds files"."""
    model = tiny_target()
    with caplog.at_level(logging.INFO):
        commands._train(_train_args(tmp_path, labelled, stop_after=1), model)
    assert not (tmp_path / "draft").exists()
    assert "stopped at step 1 of 2 (--stop-after): nothing saved" in caplog.text
    steps = []
    step = distill._train_step
    monkeypatch.setattr(distill, "_train_step", lambda run, *rest: steps.append(run.step) or step(run, *rest))
    commands._train(_train_args(tmp_path, labelled), model)
    assert (tmp_path / "draft").is_dir() and steps == [1]  # went on from step 1: one step left
    assert torch.load(tmp_path / "work" / "ckpt.pt", weights_only=True)["step"] == 2


def test_a_corpus_that_gained_utterances_is_labelled_again(tmp_path):
    """`run` on a corpus folder with 7 more utterances reused the old cache (its source recorded only the path)."""
    corpus = tmp_path / "corpus"
    shutil.copytree(CORPUS / "test-clean" / "9001", corpus / "test-clean" / "9001")
    args = SimpleNamespace(corpus=corpus, split="test-clean", window_s=29.0, gap_s=0.4, max_utterances=0,
                           no_pack=False, model="embedded:whisper-base", language="en", timestamps=False,
                           max_new_tokens=256, enc_dtype="float16", hidden_dtype="float16")
    model = tiny_target()
    meta = {"language": "en", "timestamps": False, "max_new_tokens": 256, "enc_dtype": "float16",
            "hidden_dtype": "float16", "target": draft_data.target_identity(model, "embedded:whisper-base"),
            "source": commands.corpus_source(args)}
    assert commands.cache_difference(meta, args, model) is None
    shutil.copytree(CORPUS / "test-clean" / "9002", corpus / "test-clean" / "9002")
    assert commands.cache_difference(meta, args, model).startswith("source.files: recorded ")
    older = {**meta, "source": {k: v for k, v in meta["source"].items() if not k.startswith("files")}}
    assert "predates the record of its corpus's files" in commands.cache_difference(older, args, model)
    assert commands.corpus_files(tmp_path / "absent", "train")["files"] == 0
    counted = commands.corpus_files(corpus, "test-clean")
    work = corpus / "test-clean" / "work" / "cache"  # a work folder kept inside the corpus is not the corpus
    work.mkdir(parents=True)
    (work / "meta.json").write_text("{}")
    (corpus / "test-clean" / "README").write_text("notes")
    assert commands.corpus_files(corpus, "test-clean") == counted
    linked = tmp_path / "linked"  # a speaker folder linked in is read by iter_local, and counted
    (linked / "test-clean").mkdir(parents=True)
    (linked / "test-clean" / "9001").symlink_to(corpus / "test-clean" / "9001")
    speaker_files = list((CORPUS / "test-clean" / "9001").rglob("*.*"))
    assert commands.corpus_files(linked, "test-clean")["files"] == len(speaker_files) > 0


def test_run_checks_its_work_folder_and_training_options_before_any_work(tmp_path, monkeypatch):
    """A --work inside --out labelled and trained, then failed ("already holds files") or, with --overwrite,
    deleted the work folder; --steps 0, --kl-weight -1, --layers 0,7 came after the labelling (field names, not
    flags). Now each is one error naming the flag before anything is labelled."""
    labelled_calls: list[str] = []
    monkeypatch.setattr(commands, "_target", lambda name: tiny_target())
    monkeypatch.setattr(commands, "_cache", lambda args, target: labelled_calls.append("cache"))
    base = dict(model="m", audio=str(CORPUS), split="test-clean", out=str(tmp_path / "draft"), overwrite=False,
                work=None, window_s=29.0, gap_s=0.4, max_utterances=0, language="en", timestamps=False,
                max_new_tokens=256, enc_dtype="float16", hidden_dtype="float16", batch_size=4, **TRAINING)
    bad = [({"work": str(tmp_path / "draft" / "work")}, "--work "), ({"work": str(tmp_path / "draft")}, "--work "),
           ({"steps": 0}, "--steps must be >= 1, got 0"), ({"kl_weight": -1.0}, "--kl-weight must be >= 0"),
           ({"kl_weight": 0.0, "ce_weight": 0.0}, "--kl-weight and --ce-weight are both 0"),
           ({"eval_every": -3}, "--eval-every must be >= 0"), ({"layers": "0,7"}, "--layers '0,7'"),
           ({"reg_weight": 0.5}, "--reg-weight, --feature-noise and --projection-lr-scale apply to"),
           ({"vocab_size": -5}, "--vocab-size must be an integer 0.."),
           ({"vocab_size": 100_000}, "--vocab-size must be an integer 0..")]
    for change, needle in bad:
        with pytest.raises(InputError, match=needle.replace("(", r"\(").replace(".", r"\.")):
            commands.cmd_run(SimpleNamespace(**{**base, **change}))
    assert labelled_calls == [] and not (tmp_path / "draft").exists()


def test_cache_refuses_a_folder_that_holds_files(tmp_path, capsys):
    """`distill cache --out` over another cache replaced it without a word (hours of labelling)."""
    out = tmp_path / "cache"
    out.mkdir()
    (out / "meta.json").write_text("{}")
    code, _, err = distill_cli(capsys, "--model", tmp_path / "absent-model", "cache", "--corpus", CORPUS,
                               "--split", "test-clean", "--out", out)
    lines = error_lines(err)
    assert code == 1 and len(lines) == 1 and f"{out}: already holds files" in lines[0], err
    assert (out / "meta.json").read_text() == "{}"


def test_a_checkpoint_is_not_resumed_from_another_initial_draft(tmp_path, labelled):
    """Started from --init-draft A, then the same command without it: the run resumed A's layers and head and its
    distill.json said "init_draft": null."""
    model = tiny_target()
    start = tmp_path / "start"
    commands._train(_train_args(tmp_path, labelled, layers="1", out=start, work=tmp_path / "w0"), model)
    cfg = distill.TrainConfig(steps=3, batch_windows=2, eval_every=0, ckpt_every=1)
    work = tmp_path / "work"
    distill.train_draft(model, labelled, cfg, work_dir=work, layers=[0], init_from=start, stop_after=1,
                        progress=False)
    with pytest.raises(ValueError, match=r"\(init_draft: recorded '.*start', wanted None\)"):
        distill.train_draft(model, labelled, cfg, work_dir=work, layers=[0], stop_after=2, progress=False)
    assert distill.train_draft(model, labelled, cfg, work_dir=work, layers=[0], init_from=start,
                               progress=False).finished


@pytest.mark.parametrize("layout", ["flat", "empty", "long", "long-unpacked"])
def test_a_corpus_out_of_layout_is_named_with_the_cause(tmp_path, monkeypatch, layout):
    """Audio not in <speaker>/<chapter>/ folders gave "OUT: no windows to label" after loading the model (naming
    the output, leaving encoded.npy there); an utterance longer than the window gave "utterance 0 lasts ..."."""
    corpus = tmp_path / "corpus"
    split = corpus / "train"
    split.mkdir(parents=True)
    if layout == "flat":
        shutil.copy(next((CORPUS / "test-clean").rglob("*.flac")), split / "a.flac")
    if layout.startswith("long"):
        shutil.copytree(CORPUS / "test-clean" / "9001", split / "9001")
    if layout == "long-unpacked":  # one utterance of 35 s, over the encoder's 30 s window
        from asr_spec.eval import librispeech

        real = librispeech.iter_local
        monkeypatch.setattr(librispeech, "iter_local", lambda *a: [
            dataclasses.replace(u, duration_s=35.0) for u in real(*a)])
    args = SimpleNamespace(corpus=corpus, split="train", out=tmp_path / "cache", max_utterances=0,
                           no_pack=layout == "long-unpacked", window_s=3.0, gap_s=0.4, batch_size=4, from_cache=None,
                           long_file=None)
    needle = {"flat": "no utterances in split 'train'", "empty": "no utterances in split 'train'",
              "long": "9001-100201-0000.flac: 3.54 s, longer than a 3 s training window",
              "long-unpacked": "9001-100201-0000.flac: 35.00 s, longer than a 30 s encoder window"}[layout]
    with pytest.raises(InputError, match=needle):
        commands._cache(args, tiny_target())
    assert not (tmp_path / "cache").exists()


def test_a_draft_distilled_for_another_target_is_loaded_with_a_warning(tmp_path, labelled, caplog):
    """A draft trained for whisper-base ran under a 4-decoder-layer cut of it without a word (agreement 14 %):
    it still gives the target's transcript, so it loads, but a warning names what differs."""
    from asr_spec.models.loading import load_distilled
    from asr_spec.testing import random_whisper

    commands._train(_train_args(tmp_path, labelled, layers="1"), tiny_target())
    target = tiny_target()
    other = random_whisper("test", seed=3, vocab_size=70, init_std=0.2,
                           decoder_layers=target.config.decoder_layers + 1)
    with caplog.at_level(logging.WARNING):
        load_distilled(tmp_path / "draft", target)
        assert "distilled for another target" not in caplog.text
        load_distilled(tmp_path / "draft", other)
    expected = f"decoder_layers {target.config.decoder_layers}, this one {target.config.decoder_layers + 1}"
    assert "distilled for another target" in caplog.text and expected in caplog.text


def test_cache_takes_one_source_and_a_missing_cache_says_how_to_make_one(tmp_path, capsys):
    """--corpus beside --long-file was quietly left unread; a folder that is no cache said "build it with
    build_cache" (a library function, not the command)."""
    code, _, err = distill_cli(capsys, "--model", tmp_path / "absent-model", "cache", "--corpus", CORPUS,
                               "--long-file", "talk.flac", "--out", tmp_path / "out")
    lines = error_lines(err)
    assert code == 1 and len(lines) == 1 and "--corpus and --long-file given; give one of them" in lines[0], err
    with pytest.raises(ValueError, match="make one with `asr-spec distill cache`"):
        draft_data.PseudoLabelCache(tmp_path)


def test_a_ctrl_c_says_what_is_kept(capsys, monkeypatch):
    """An interrupted `distill` exited 130 without a word (`eval` said "interrupted ...")."""
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(commands, "cmd_train", interrupted)
    code, _, err = distill_cli(capsys, "train", "--train-cache", "c", "--work", "w")
    assert code == 130 and err.startswith("interrupted (training: the same command goes on from its last checkpoint")
