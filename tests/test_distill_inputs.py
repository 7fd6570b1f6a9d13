"""`asr-spec distill` against inputs that do not fit: a work folder made from other audio or for another target, an
unreadable utterance in the corpus, a cache labelled by another target, an --out folder that already holds files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import tiny_target
from test_transcribe import save_tiny_models

from asr_spec.cli import main
from asr_spec.distill import commands
from asr_spec.distill import data as draft_data
from asr_spec.distill import train as distill
from asr_spec.errors import InputError
from asr_spec.models import drafts
from asr_spec.testing import random_whisper

CORPUS = Path(__file__).parent / "fixtures" / "librispeech"
# `run`'s training options at their defaults (checked before labelling: `arguments.train_settings`)
TRAINING = dict(steps=600, batch_windows=4, lr=3e-4, seed=0, warmup_steps=30, eval_every=0, ckpt_every=50,
                kl_weight=1.0, ce_weight=1.0, kind="decoder", reg_weight=None, feature_noise=0.0,
                projection_lr_scale=1.0, vocab_size=0, layers="1")


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    return save_tiny_models(tmp_path_factory.mktemp("models"))[0]


@pytest.fixture(scope="module")
def small_cache(tmp_path_factory):
    """A cache of 3 random windows labelled by conftest's tiny target (16 mels, 50 audio positions)."""
    feats = torch.randn(3, 16, 100, generator=torch.Generator().manual_seed(1))
    return draft_data.build_cache(tiny_target(), [(["a", "b", "c"], feats)], 3, tmp_path_factory.mktemp("cache"),
                                  max_new_tokens=12, enc_dtype="float32", progress=False)


def distill_cli(capsys, *args) -> tuple[int, str, str]:
    """`asr-spec distill ARGS...` in-process: (exit code, stdout, stderr)."""
    with pytest.raises(SystemExit) as info:
        main(["distill", *[str(a) for a in args]])
    out = capsys.readouterr()
    return int(info.value.code or 0), out.out, out.err


def error_lines(err: str) -> list[str]:
    assert "Traceback" not in err, err
    return [line for line in err.splitlines() if line.startswith("error:")]


# -- 1. `run` reuses its work folder only for the audio and target it was made from --------------------------------

def test_run_labels_again_when_the_audio_the_windows_or_the_target_differ(tmp_path, monkeypatch):
    """`run` reused its work folder's cache (and the checkpoint trained on it) whatever --audio, --split, --model
    said (only the language, timestamp mode and token limit were compared): now any of them, the packing, the
    labelling or the target's config differing labels afresh and drops the old checkpoint."""
    calls: list[str] = []
    model = tiny_target()
    targets = {"org/model-a": model, "org/model-b": model}

    def fake_cache(args, target):  # what build_cache records, without labelling anything
        calls.append("cache")
        Path(args.out).mkdir(parents=True, exist_ok=True)
        meta = {"language": args.language, "timestamps": args.timestamps, "max_new_tokens": args.max_new_tokens,
                "enc_dtype": args.enc_dtype, "hidden_dtype": args.hidden_dtype, "source": commands.corpus_source(args),
                "target": draft_data.target_identity(target, commands.target_name(args.model))}
        (Path(args.out) / "meta.json").write_text(json.dumps(meta))
        return 0

    monkeypatch.setattr(commands, "_target", lambda name: targets[name])
    monkeypatch.setattr(commands, "_cache", fake_cache)
    monkeypatch.setattr(commands, "_train", lambda args, target: calls.append("train"))
    ckpt = tmp_path / "work" / "train" / "ckpt.pt"
    base = dict(model="org/model-a", audio=str(tmp_path / "corpus"), split="train", out=str(tmp_path / "draft"),
                overwrite=False, work=str(tmp_path / "work"), window_s=29.0, gap_s=0.4, max_utterances=0, language="en",
                timestamps=False, max_new_tokens=256, enc_dtype="float16", hidden_dtype="float16", batch_size=4,
                **TRAINING)
    commands.cmd_run(SimpleNamespace(**base))
    assert calls == ["cache", "train"]
    changes = ({}, {"model": "org/model-b"}, {"audio": str(tmp_path / "elsewhere")}, {"split": "test-clean"},
               {"window_s": 5.0}, {"gap_s": 0.2}, {"max_utterances": 4}, {"timestamps": True}, {"language": "de"},
               {"hidden_dtype": "float32"}, "the model under the same name changed")
    for change in changes:
        commands.cmd_run(SimpleNamespace(**base))  # as first made: reused
        ckpt.parent.mkdir(parents=True, exist_ok=True)
        ckpt.write_bytes(b"trained on the cache there")
        calls.clear()
        if isinstance(change, str):
            targets["org/model-a"], change = random_whisper("test", vocab_size=70, decoder_layers=1), {}
        commands.cmd_run(SimpleNamespace(**{**base, **change}))
        labels_again = change != {} or targets["org/model-a"] is not model
        assert calls == (["cache", "train"] if labels_again else ["train"]), change
        assert ckpt.exists() != labels_again, change


def test_cache_difference_names_the_field():
    model = tiny_target()
    args = SimpleNamespace(model="embedded:whisper-base", corpus="/data/tts", split="train", window_s=29.0, gap_s=0.4,
                           max_utterances=0, no_pack=False, language="en", timestamps=False, max_new_tokens=256,
                           enc_dtype="float16", hidden_dtype="float16")
    meta = {"language": "en", "timestamps": False, "max_new_tokens": 256, "enc_dtype": "float16",
            "hidden_dtype": "float16", "target": draft_data.target_identity(model, "embedded:whisper-base"),
            "source": commands.corpus_source(args)}
    assert commands.cache_difference(meta, args, model) is None
    moved = SimpleNamespace(**{**vars(args), "corpus": "/data/other"})
    assert commands.cache_difference(meta, moved, model).startswith("source.corpus: recorded '/data/tts'")
    renamed = SimpleNamespace(**{**vars(args), "model": "embedded:whisper-tiny.en"})
    assert commands.cache_difference(meta, renamed, model).startswith("target.name:")
    old = {k: v for k, v in meta.items() if k not in ("source", "target")}  # a cache from before these records
    assert commands.cache_difference(old, args, model).startswith("target: recorded None")


def test_first_difference_compares_what_is_wanted_key_by_key():
    assert draft_data.first_difference({"a": 1, "x": 9}, {"a": 1}) is None
    assert draft_data.first_difference({"a": {"b": 1, "c": 2}}, {"a": {"b": 1, "c": 3}}) == "a.c: recorded 2, wanted 3"
    assert draft_data.first_difference({}, {"a": 1}) == "a: recorded None, wanted 1"


def test_run_on_other_audio_does_not_train_on_the_old_cache(tmp_path, capsys, target_dir):
    """The review's reproduction: a second `run` into the same --out with --audio /nonexistent printed `saved`
    (it trained on the first run's cache); now it labels afresh, and a corpus that is not there is one error line."""
    out = tmp_path / "d1"
    common = ["--out", out, "--layers", "1", "--steps", "1", "--vocab-size", "0", "--max-new-tokens", "8",
              "--max-utterances", "2"]
    code, stdout, err = distill_cli(capsys, "--model", target_dir, "run", "--audio", CORPUS, "--split", "test-clean",
                                    *common)
    assert code == 0 and f"saved {out}" in stdout, err
    code, stdout, err = distill_cli(capsys, "--model", target_dir, "run", "--audio", tmp_path / "nonexistent",
                                    "--split", "whatever", "--window-s", "5", "--overwrite", *common)
    assert code == 1 and "saved" not in stdout
    assert len(error_lines(err)) == 1 and "nonexistent" in error_lines(err)[0], err
    assert "labelling again (source.corpus: recorded" in err


def test_a_checkpoint_of_other_caches_or_another_target_is_not_resumed(tmp_path, small_cache):
    """A training checkpoint records the caches it was trained on and the target: resuming it on another cache
    (e.g. one labelled again) or for a target loaded by another name is refused, naming what differs."""
    model = tiny_target()
    feats = torch.from_numpy(np.array(small_cache.encoded))
    other = draft_data.build_cache(model, [(["x", "y", "z"], feats)], 3, tmp_path / "other", max_new_tokens=12,
                                   enc_dtype="float32", timestamps=True, pre_encoded=True, progress=False)
    cfg = distill.TrainConfig(steps=4, batch_windows=2, eval_every=0, ckpt_every=1)
    work = tmp_path / "work"
    distill.train_draft(model, small_cache, cfg, work_dir=work, layers=[0], stop_after=1, progress=False,
                        target_name="/models/a")
    with pytest.raises(ValueError, match=r"checkpoint of a different run \(data: recorded"):
        distill.train_draft(model, other, cfg, work_dir=work, layers=[0], stop_after=2, progress=False,
                            target_name="/models/a")
    with pytest.raises(ValueError, match=r"\(target.name: recorded '/models/a', wanted '/models/b'\)"):
        distill.train_draft(model, small_cache, cfg, work_dir=work, layers=[0], stop_after=2, progress=False,
                            target_name="/models/b")
    with pytest.raises(ValueError, match=r"\(config.steps: recorded 4, wanted 5\)"):
        distill.train_draft(model, small_cache, distill.TrainConfig(steps=5, batch_windows=2, eval_every=0),
                            work_dir=work, layers=[0], stop_after=2, progress=False, target_name="/models/a")
    res = distill.train_draft(model, small_cache, cfg, work_dir=work, layers=[0], stop_after=2, progress=False,
                              target_name="/models/a")  # the same run resumes
    assert res.history == [] and torch.load(work / "ckpt.pt", weights_only=True)["step"] == 2


# -- 2. an unreadable utterance is skipped, not the whole cache lost -----------------------------------------------

@pytest.mark.parametrize("pack", [True, False])
def test_cache_skips_an_unreadable_utterance_and_keeps_the_rest(tmp_path, capsys, target_dir, pack):
    """A truncated flac stopped `distill cache` (`error: ...: corrupt or truncated audio`), leaving a folder with
    encoded.npy alone; now it is a warning line, the cache holds every other utterance, the summary counts it and
    the exit code (1) says something was skipped. Unpacked, its whole window goes and encoded.npy is cut to fit."""
    corpus = tmp_path / "corpus"
    shutil.copytree(CORPUS, corpus)
    bad = corpus / "test-clean" / "9001" / "100201" / "9001-100201-0001.flac"
    bad.write_bytes(bad.read_bytes()[: bad.stat().st_size // 2])
    out = tmp_path / "cache"
    code, stdout, err = distill_cli(capsys, "--model", target_dir, "cache", "--corpus", corpus, "--split",
                                    "test-clean", "--max-utterances", "4", "--max-new-tokens", "8", "--out", out,
                                    *([] if pack else ["--no-pack"]))
    assert code == 1, err
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and str(bad) in warnings[0] and "skipped" in warnings[0], err
    assert error_lines(err) == []
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert summary["unreadable"] == 1 and summary["utterances"] == 3
    cache = draft_data.PseudoLabelCache(out)
    ids = [i for window in cache.meta["ids"] for i in window]
    assert ids == ["9001-100201-0000", "9001-100201-0002", "9001-100202-0000"]
    assert len(cache) == summary["windows"] == (1 if pack else 3)
    assert cache.encoded.shape[0] == len(cache) and np.abs(np.asarray(cache.encoded[-1], np.float32)).sum() > 0


def test_keep_first_rows_cuts_an_npy_array_in_place(tmp_path):
    path = tmp_path / "a.npy"
    for dtype in ("float16", "float32"):
        array = np.lib.format.open_memmap(path, "w+", np.dtype(dtype), (1234, 3, 5))
        array[:] = np.arange(1234 * 15).reshape(1234, 3, 5) % 1000
        array.flush()
        del array
        draft_data.keep_first_rows(path, 7)
        kept = np.load(path)
        assert kept.shape == (7, 3, 5) and kept.dtype == np.dtype(dtype)
        assert np.array_equal(kept, np.arange(7 * 15).reshape(7, 3, 5) % 1000)


# -- 3. a cache labelled by another target ----------------------------------------------------------------------

def test_training_on_a_cache_of_another_target_is_one_error_line(tmp_path, capsys, target_dir, small_cache):
    """A cache labelled by another target trained into a `RuntimeError: mat1 and mat2 shapes cannot be multiplied`
    traceback; now it is refused at load, naming the field."""
    code, _, err = distill_cli(capsys, "--model", target_dir, "train", "--train-cache", small_cache.path, "--work",
                               tmp_path / "w", "--steps", "1")
    lines = error_lines(err)
    assert code == 1 and len(lines) == 1, err
    assert "a cache made for another target (n_audio_ctx: recorded 50, wanted 1500)" in lines[0]
    assert not (tmp_path / "w").exists()


def test_check_target_compares_the_recorded_target(small_cache, tmp_path):
    model = tiny_target()
    small_cache.check_target(model)  # its own target; no name recorded: none compared
    small_cache.check_target(model, "/models/any")
    other = random_whisper("test", vocab_size=80)  # the same width and audio length, another <|endoftext|>
    with pytest.raises(InputError, match=r"another target \(eot: recorded 40, wanted 50\)"):
        small_cache.check_target(other)
    feats = torch.from_numpy(np.array(small_cache.encoded))
    named = draft_data.build_cache(model, [(["x", "y", "z"], feats)], 3, tmp_path / "named", max_new_tokens=12,
                                   pre_encoded=True, progress=False, target_name="/models/a")
    named.check_target(model, "/models/a")
    with pytest.raises(InputError, match=r"another target \(target.name: recorded '/models/a', wanted '/models/b'\)"):
        named.check_target(model, "/models/b")


def relabel_args(source: Path, out: Path, model: str) -> SimpleNamespace:
    """`distill --model MODEL cache --from-cache SOURCE --out OUT --timestamps` as the command's namespace."""
    return SimpleNamespace(model=model, from_cache=source, out=out, max_windows=0, batch_size=2, timestamps=True,
                           hidden_dtype="float32", long_file=None, corpus=None)


def test_relabelling_a_cache_of_another_target_is_refused(small_cache, tmp_path):
    """`cache --from-cache SRC` labelled SRC's encoder outputs with whatever --model said: another target's decoder
    over them made labels of nothing, silently. Now SRC must have been made by the target asked for, as training's
    caches must (`check_target`): one line naming SRC, the target it was made with and the one asked for."""
    model = tiny_target()
    feats = torch.from_numpy(np.array(small_cache.encoded))
    named = draft_data.build_cache(model, [(["x", "y", "z"], feats)], 3, tmp_path / "named", max_new_tokens=12,
                                   pre_encoded=True, progress=False, target_name="/models/a")
    with pytest.raises(InputError) as info:
        commands._cache(relabel_args(named.path, tmp_path / "other", "/models/b"), model)
    assert str(info.value).startswith(f"{named.path}: a cache made for another target (target.name: recorded "
                                      "'/models/a', wanted '/models/b'): made with /models/a, asked for /models/b")
    assert "\n" not in str(info.value) and not (tmp_path / "other").exists()
    commands._cache(relabel_args(named.path, tmp_path / "same", "/models/a"), model)  # its own target: labelled
    relabelled = draft_data.PseudoLabelCache(tmp_path / "same")
    assert len(relabelled) == 3 and relabelled.timestamps and relabelled.meta["target"]["name"] == "/models/a"


def test_the_cli_refuses_relabelling_a_cache_of_another_target_in_one_line(tmp_path, capsys, target_dir,
                                                                           small_cache):
    code, _, err = distill_cli(capsys, "--model", target_dir, "cache", "--from-cache", small_cache.path, "--out",
                               tmp_path / "out")
    lines = error_lines(err)
    assert code == 1 and len(lines) == 1, err
    assert f"{small_cache.path}: a cache made for another target" in lines[0]
    assert f"made with a target it does not name, asked for {target_dir.resolve()}" in lines[0]
    assert not (tmp_path / "out").exists()


# -- 4. numbers the labelling cannot use ----------------------------------------------------------------------------

@pytest.mark.parametrize(("args", "needle"), [
    (["cache", "--corpus", CORPUS, "--max-utterances", "-2"], "--max-utterances must be an integer >= 0, got -2"),
    (["cache", "--corpus", CORPUS, "--batch-size", "0"], "--batch-size must be an integer >= 1, got 0"),
    (["cache", "--corpus", CORPUS, "--max-new-tokens", "0"], "--max-new-tokens must be an integer >= 1, got 0"),
    (["cache", "--corpus", CORPUS, "--window-s", "40"], "--window-s must be at most 30 s (Whisper's window), got 40"),
    (["cache", "--corpus", CORPUS, "--window-s", "0"], "--window-s must be a positive number of seconds, got 0"),
    (["cache", "--corpus", CORPUS, "--gap-s", "-1"], "--gap-s must be a finite number of seconds >= 0, got -1"),
    (["cache", "--corpus", CORPUS, "--max-windows", "3"], "--max-windows 3: applies with --from-cache only"),
    (["cache", "--from-cache", CORPUS, "--max-windows", "-1"], "--max-windows must be an integer >= 0, got -1"),
    (["run", "--audio", CORPUS, "--max-utterances", "-1"], "--max-utterances must be an integer >= 0, got -1"),
])
def test_cache_and_run_refuse_numbers_the_labelling_cannot_use_before_loading(tmp_path, capsys, args, needle):
    """--max-utterances -2 labelled all but the last two utterances; --max-windows -1 ended in "no windows to
    label", --batch-size 0 in range()'s error once the target had loaded; --max-windows without --from-cache was
    ignored. Now each is one line naming the flag, before the (absent) model is looked for."""
    code, _, err = distill_cli(capsys, "--model", tmp_path / "absent-model", *args, "--out", tmp_path / "out")
    lines = error_lines(err)
    assert code == 1 and len(lines) == 1 and needle in lines[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing written


# -- 5. --out that already holds files ------------------------------------------------------------------------------

def test_saving_into_a_folder_with_files_needs_overwrite_and_is_atomic(tmp_path, monkeypatch):
    """`distill train|run|head --out DIR` wrote into DIR whatever it held (a whole Whisper model was replaced), file
    by file; now a folder with files is refused, and with overwrite replaced in one rename, never half-written."""
    from asr_spec.models.feature_draft import save_feature_draft

    model = tiny_target()
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "model.safetensors").write_bytes(b"a whole Whisper model")
    for save, kind in ((drafts.save_trained_draft, "decoder"), (save_feature_draft, "target-features")):
        with pytest.raises(InputError, match="already holds files"):
            save(distill.init_draft(model, [0], kind), victim)
        assert (victim / "model.safetensors").read_bytes() == b"a whole Whisper model"

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(drafts, "write_draft_extras", broken)
    with pytest.raises(OSError, match="disk full"):
        drafts.save_trained_draft(distill.init_draft(model, [0]), victim, overwrite=True)
    assert (victim / "model.safetensors").read_bytes() == b"a whole Whisper model"  # untouched by the failure
    assert sorted(p.name for p in tmp_path.iterdir()) == ["victim"]  # no half-written folder left beside it
    monkeypatch.undo()
    drafts.save_trained_draft(distill.init_draft(model, [0]), victim, overwrite=True)
    assert drafts.load_trained_draft(victim, model) is not None and not (victim / "model.safetensors").read_bytes(
    ).startswith(b"a whole")
    empty = tmp_path / "empty"
    empty.mkdir()
    drafts.save_trained_draft(distill.init_draft(model, [0]), empty)  # an empty folder is fine
    assert (empty / drafts.INFO_FILE).is_file()


@pytest.mark.parametrize("command", ["run", "train", "head"])
def test_cli_refuses_an_out_folder_with_files_before_any_work(tmp_path, capsys, small_cache, command):
    out = tmp_path / "model"
    out.mkdir()
    (out / "config.json").write_text("{}")
    args = {"run": ["run", "--audio", CORPUS, "--split", "test-clean"],
            "train": ["train", "--train-cache", small_cache.path, "--work", tmp_path / "w"],
            "head": ["head", "--draft", tmp_path / "absent", "--train-cache", small_cache.path, "--head-size", "0"]}
    code, _, err = distill_cli(capsys, "--model", tmp_path / "absent-model", *args[command], "--out", out)
    lines = error_lines(err)
    assert code == 1 and len(lines) == 1 and f"{out}: already holds files" in lines[0] and "--overwrite" in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no model loaded, no work folder made
    assert (out / "config.json").read_text() == "{}"
