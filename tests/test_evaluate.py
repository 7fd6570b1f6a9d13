"""LibriSpeech evaluation on the committed fixture tree: one JSONL record per utterance, resume after a kill,
long-form chapters, the greedy comparison and the summary, one-line errors. Uses the tiny random Whisper with the
real tokenizer from test_transcribe (text decodes, nothing downloaded), and (`real` marker) whisper-base."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import pytest
from conftest import script_module
from test_transcribe import _models, auto_dtype, save_tiny_models

from asr_spec import TranscribeOptions, Transcriber
from asr_spec.cli.evaluation import eval_main
from asr_spec.errors import InputError
from asr_spec.eval.evaluate import check_precision, evaluate, open_log
from asr_spec.eval.librispeech import HubUnavailableError, ResultsLog, iter_local
from asr_spec.eval.options import EvalOptions, parse_split
from asr_spec.eval.runner import run_eval
from asr_spec.eval.summary import eval_summary, format_summary, summary_path
from asr_spec.models.cpu import detect_cpu, dtype_name, precision_words
from asr_spec.models.loading import decoder_draft

ROOT = Path(__file__).parent / "fixtures" / "librispeech"
IDS = [u.id for u in iter_local(ROOT, "test-clean")]  # 14 utterances, 4 chapters, in corpus order
pytestmark = pytest.mark.filterwarnings("ignore:English text normaliser built without")

CHAPTERS = ["9001-100201", "9001-100202", "9002-100301", "9003-100401"]


@functools.cache
def tiny(draft: str = "perturbed") -> Transcriber:
    """The tiny target with no draft, a perturbed draft (disagrees now and then) or all its own decoder layers (in
    fp32: a bf16 copy of them would disagree at near-ties, and "same" must agree on every token)."""
    target, perturbed_draft, processor = _models()
    model = {"none": None, "perturbed": perturbed_draft, "same": decoder_draft(target)}[draft]
    options = TranscribeOptions.from_values(language="en", batch_size=3, draft_bf16=draft != "same")
    return Transcriber(target, model, processor, options)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> tuple[Path, Path]:
    """The tiny target (+ processor) and its perturbed draft saved as model directories."""
    return save_tiny_models(tmp_path_factory.mktemp("models"))


def utts():
    return iter_local(ROOT, "test-clean")


def test_parse_split_names() -> None:
    assert (parse_split("test.clean").hub_config, parse_split("test.clean").hub_split) == ("clean", "test")
    assert parse_split("test-other").local_dir == "test-other" and parse_split("test-other").hub_config == "other"
    assert parse_split("dev-clean") == parse_split("validation.clean")
    assert parse_split("train.clean.100").hub_split == "train.100"
    with pytest.raises(InputError, match="unknown LibriSpeech split 'test.dirty'"):
        parse_split("test.dirty")


@pytest.mark.parametrize("draft", ["same", "perturbed"])
def test_one_record_per_utterance_identical_to_greedy(tmp_path: Path, draft: str) -> None:
    path = tmp_path / "run.jsonl"
    seen: list[int] = []  # records on disk when each one is reported: written one at a time
    run = run_eval(tiny(draft), utts(), path, limit=4, compare_greedy=True, group_size=3,
                   on_record=lambda r: seen.append(len(ResultsLog(path).records())))
    assert (run.n_done, run.n_skipped, run.n_failed, run.n_not_identical) == (4, 0, 0, 0)
    assert seen == [1, 2, 3, 4]
    records = ResultsLog(path).records()
    assert [r["id"] for r in records] == IDS[:4]
    for r in records:
        assert r["hyp"] and r["hyp"] == r["greedy_hyp"] and r["identical_to_greedy"] is True
        assert r["audio_s"] > 2 and r["wall_s"] > 0 and r["greedy_wall_s"] > 0
        assert r["drafted_tokens"] > 0 and r["target_passes"] < r["generated_tokens"]
        assert 0 < sum(r["accepted_hist"]) <= r["target_passes"]  # steps by number of accepted draft tokens
    # the group's wall time is shared in proportion to audio: the shares of one group are equally fast
    first = records[:3]
    assert len({round(r["audio_s"] / r["wall_s"], 6) for r in first}) == 1
    s = eval_summary(path)
    assert s["n_scored"] == 4 and s["identical_fraction"] == 1.0 and s["all_identical_to_greedy"] is True
    assert s["speedup"] == pytest.approx(s["greedy_wall_s"] / s["wall_s"])
    assert s["target_passes_per_token"] == pytest.approx(1 / s["tokens_per_target_pass"])
    assert s["mean_accepted_per_target_pass"] == pytest.approx(s["accepted_tokens"] / s["target_passes"])
    if draft == "same":  # the target's own layers: every drafted token agrees, so each target pass yields close
        # to the K + 1 = 4 tokens of the default constant K = 3 (tokens past a row's limit are never proposed)
        assert s["acceptance_rate"] == 1.0 and s["tokens_per_target_pass"] > 3.5
    else:
        assert 0 < s["acceptance_rate"] < 1
    table = format_summary(s)
    assert "identical to greedy" in table and "100.00 % (4/4)" in table and "speed-up vs greedy" in table


def test_identical_means_the_same_tokens() -> None:
    from types import SimpleNamespace

    from asr_spec.eval.runner import _identical

    a = SimpleNamespace(text="Hello.", segments=(), chunk_tokens=((50, 51, 52),))
    assert _identical(a, SimpleNamespace(text="Hello.", segments=(), chunk_tokens=((50, 51, 52),)))
    assert not _identical(a, SimpleNamespace(text="Hello.", segments=(), chunk_tokens=((50, 53),)))  # same text


def test_resume_after_a_kill_skips_done_ids(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"

    class Killed(Exception):
        pass

    def kill_after_two(record: dict) -> None:
        if len(ResultsLog(path).records()) == 2:
            raise Killed

    with pytest.raises(Killed):
        run_eval(tiny("none"), utts(), path, limit=5, group_size=4, on_record=kill_after_two)
    assert [r["id"] for r in ResultsLog(path).records()] == IDS[:2]
    with open(path, "ab") as handle:  # and the crash cut a third line short
        handle.write(b'{"id": "9001-100201-0002", "ref": "IN TH')
    with pytest.warns(UserWarning, match="incomplete last line"):
        run = run_eval(tiny("none"), utts(), path, limit=5, group_size=4)
    assert (run.n_skipped, run.n_done) == (2, 3)
    assert [r["id"] for r in ResultsLog(path).records()] == IDS[:5]  # no repeats, no gaps, --limit kept
    run = run_eval(tiny("none"), utts(), path, limit=5, group_size=4)
    assert (run.n_skipped, run.n_done) == (5, 0)


def test_long_form_groups_by_chapter(tmp_path: Path) -> None:
    path = tmp_path / "long.jsonl"
    run = run_eval(tiny("none"), utts(), path, limit=2, as_long_form=True)  # --limit counts chapters
    assert run.n_done == 2
    records = ResultsLog(path).records()
    assert [r["id"] for r in records] == CHAPTERS[:2]
    by_id = {u.id: u for u in utts()}
    for r in records:
        assert r["parts"] == [i for i in IDS if i.startswith(r["id"] + "-")]
        assert r["ref"] == " ".join(by_id[p].text for p in r["parts"])
        assert r["audio_s"] == pytest.approx(sum(by_id[p].duration_s for p in r["parts"]), abs=1e-3)
    run = run_eval(tiny("none"), utts(), path, limit=3, as_long_form=True)  # resumes by chapter id
    assert (run.n_skipped, run.n_done) == (2, 1)
    assert [r["id"] for r in ResultsLog(path).records()] == CHAPTERS[:3]


def test_eval_main_end_to_end_with_a_preset_file(tmp_path: Path, capsys, model_dirs) -> None:
    target_dir, draft_dir = model_dirs
    preset = tmp_path / "tiny.toml"
    preset.write_text(f'model = "{target_dir}"\ndraft = "{draft_dir}"\nlanguage = "en"\n')
    out = tmp_path / "runs" / "tiny.jsonl"
    argv = ["--preset", str(preset), "--data-dir", str(ROOT), "--split", "test.clean", "--batch-size", "2",
            "--compare-greedy", "--output", str(out)]
    assert eval_main([*argv, "--limit", "3"]) == 0
    printed = capsys.readouterr()
    assert "identical to greedy" in printed.out and "100.00 % (3/3)" in printed.out
    assert "WER" in printed.out and "RTFx" in printed.out and "acceptance rate" in printed.out
    summary = json.loads(summary_path(out).read_text())
    # what the models ran on: the CPU class conftest pins (unpinned: this CPU's), the dtype `auto` gave, and the
    # same words in the printed table
    cpu_class = detect_cpu().cpu_class
    hardware = summary["hardware"]
    assert hardware["cpu"]["class"] == cpu_class and hardware["dtype"] == dtype_name(auto_dtype())
    words = precision_words(hardware)
    assert words.startswith(f"cpu {cpu_class}, ") and any(line.startswith("precision") and line.endswith(words)
                                                          for line in printed.out.splitlines())
    for key in ("wer", "cer", "rtfx", "acceptance_rate", "mean_accepted_per_target_pass", "target_passes_per_token",
                "identical_fraction", "speedup", "n_scored"):
        assert key in summary, key
    assert summary["n_scored"] == 3 and summary["identical_fraction"] == 1.0
    assert eval_main([*argv, "--limit", "4", "--quiet"]) == 0  # resumes: one more utterance
    assert "9001-100201-0000" not in capsys.readouterr().err
    assert json.loads(summary_path(out).read_text())["n_scored"] == 4
    # another model on the same log found every id done and printed the first model's WER under its own title
    other = [arg for arg in argv if arg != "--compare-greedy"] + ["--model", str(target_dir), "--limit", "4"]
    assert eval_main(other) == 2
    err = capsys.readouterr().err
    assert "its records were written with model None (this run: " in err and "compare_greedy True" in err
    other[other.index("--output") + 1] = str(tmp_path / "runs" / "other.jsonl")
    assert eval_main(other + ["--quiet"]) == 0  # a log of its own
    (tmp_path / "runs" / "other.setup.json").unlink()  # a log written before setups were kept: said, then kept
    assert eval_main(other + ["--quiet", "--limit", "5"]) == 0
    assert "no setup to check this run's against" in capsys.readouterr().err
    assert (tmp_path / "runs" / "other.setup.json").is_file()


def test_evaluate_writes_the_summary_next_to_the_log(tmp_path: Path) -> None:
    options = EvalOptions(data_dir=str(ROOT), limit=2, output=str(tmp_path / "x.jsonl"), compare_greedy=True)
    summary = evaluate(options, transcriber=tiny("perturbed"))
    assert json.loads((tmp_path / "x.summary.json").read_text())["n_scored"] == summary["n_scored"] == 2


def test_a_log_resumes_with_the_same_setup_however_spelled_and_not_in_another_precision(tmp_path: Path,
                                                                                       monkeypatch) -> None:
    """The setup was compared as typed: `--data-dir ls/test-clean` against `ls`, `--language English` against
    `en`, a model's relative path against its absolute one were refused as other setups; `--device`/`--dtype`
    compared as typed let a resume decode in another precision (ASR_SPEC_NO_CPU_KERNELS=1, another CPU class)
    and mixed the records under one title. The precision the loaded models run in is checked instead."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m").mkdir()
    one = EvalOptions(data_dir=str(ROOT), split="test-clean", language="English", model="m", no_draft=True)
    other = EvalOptions(data_dir=str(ROOT / "test-clean"), split="test-clean", language="en",
                        model=str(tmp_path / "m"), no_draft=True, device="cpu", dtype="auto")
    assert one.setup() == other.setup()
    assert one.setup()["language"] == "en" and EvalOptions(language="auto").setup()["language"] is None
    # a log whose setup was kept as typed (before setups were resolved): resumed by the same command, not refused
    kept = tmp_path / "kept.jsonl"
    kept.write_text(json.dumps({"id": IDS[0], "ref": "a", "hyp": "a", "audio_s": 1.0, "wall_s": 1.0}) + "\n")
    (tmp_path / "kept.setup.json").write_text(json.dumps({
        "preset": "base", "model": None, "draft": None, "no_draft": False, "device": None, "dtype": None,
        "language": None, "data": str(ROOT), "split": "test.clean", "long_form": False, "compare_greedy": False}))
    open_log(EvalOptions(data_dir=str(ROOT), split="test.clean", output=str(kept)))
    out = tmp_path / "x.jsonl"
    options = EvalOptions(data_dir=str(ROOT), limit=1, output=str(out))
    evaluate(options, transcriber=tiny("none"))
    setup = json.loads((tmp_path / "x.setup.json").read_text())
    check_precision(options, setup["precision"])  # the same: resumed
    with pytest.raises(InputError, match=r"x.jsonl: its records were decoded in .* \(this run: cpu other\); give "
                                         "--output for a new log"):
        check_precision(options, "cpu other")


def test_the_summary_of_a_limited_run_is_its_own_units(tmp_path: Path) -> None:
    """`--limit 2` on a log of 4 said the 4's WER and counts: the summary covers the run's first 2 units."""
    out = tmp_path / "x.jsonl"
    first = evaluate(EvalOptions(data_dir=str(ROOT), limit=4, output=str(out)), transcriber=tiny("none"))
    assert first["n_scored"] == 4
    summary = evaluate(EvalOptions(data_dir=str(ROOT), limit=2, output=str(out)), transcriber=tiny("none"))
    assert summary["n_scored"] == 2 and len(ResultsLog(out).records()) == 4
    assert json.loads((tmp_path / "x.summary.json").read_text())["n_scored"] == 2
    assert evaluate(EvalOptions(data_dir=str(ROOT), output=str(out), limit=None), transcriber=tiny("none"))[
        "n_scored"] == len(IDS)  # no limit: the whole split, the log's 4 resumed


@pytest.mark.parametrize("field,value", [("preset", "base"), ("model", "x"), ("draft", "y"), ("device", "cpu"),
                                         ("dtype", "float16"), ("language", "fr"), ("no_draft", True)])
def test_evaluate_refuses_model_options_with_a_transcriber(tmp_path: Path, field: str, value) -> None:
    options = EvalOptions(data_dir=str(ROOT), limit=1, output=str(tmp_path / "x.jsonl"), **{field: value})
    with pytest.raises(InputError, match=f"evaluate: {field} choose the models, but a transcriber was given"):
        evaluate(options, transcriber=tiny("none"))
    assert not (tmp_path / "x.jsonl").exists()  # refused before anything ran


def test_evaluate_applies_batch_size_to_a_given_transcriber(tmp_path: Path, monkeypatch) -> None:
    transcriber = tiny("none")
    seen: list[int] = []
    real = transcriber.transcribe

    def spy(sources, *, batch_size=None, **kwargs):
        seen.append(batch_size)
        return real(sources, batch_size=batch_size, **kwargs)

    monkeypatch.setattr(transcriber, "transcribe", spy)
    evaluate(EvalOptions(data_dir=str(ROOT), limit=2, batch_size=2, output=str(tmp_path / "x.jsonl")),
             transcriber=transcriber)
    assert seen and set(seen) == {2} and transcriber.options.batch_size == 3


def test_eval_command_evaluates_a_local_tree_under_any_folder_name(tmp_path: Path, model_dirs) -> None:
    """`python -m asr_spec eval --data-dir TREE --split my-split` in a process of its own: any LibriSpeech-layout
    folder works locally (hub split names are validated for the hub only)."""
    import shutil
    import subprocess

    shutil.copytree(ROOT / "test-clean", tmp_path / "tree" / "my-split")
    target_dir, _ = model_dirs
    preset = tmp_path / "tiny.toml"
    preset.write_text(f'model = "{target_dir}"\nlanguage = "en"\n')
    out = tmp_path / "runs" / "mine.jsonl"
    done = subprocess.run([sys.executable, "-m", "asr_spec", "eval", "--data-dir", str(tmp_path / "tree"),
                           "--split", "my-split", "--preset", str(preset), "--limit", "2", "--output", str(out),
                           "--quiet"],
                          capture_output=True, text=True, timeout=600, env=_env())
    assert done.returncode == 0, done.stderr
    assert "on LibriSpeech my-split" in done.stdout
    assert [r["id"] for r in ResultsLog(out).records()] == IDS[:2]
    default = EvalOptions(data_dir=str(tmp_path / "tree"), split="my-split", preset=str(preset))
    assert default.output_path() == Path("runs") / "tiny-my-split.jsonl"


def _env() -> dict[str, str]:
    import os

    root = str(Path(__file__).parent.parent)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--data-dir", "/no/such/dir"], "/no/such/dir: no such directory"),
        (["--data-dir", str(ROOT), "--split", "test.other"], "no LibriSpeech split 'test-other'"),
        (["--split", "test.dirty"], "unknown LibriSpeech split"),  # the hub knows only its own split names
        (["--data-dir", str(ROOT), "--split", "test.dirty"], "no LibriSpeech split 'test.dirty' here"),
        (["--data-dir", str(ROOT), "--preset", "no-such-preset"], "unknown preset 'no-such-preset'"),
        (["--data-dir", str(ROOT), "--limit", "-1"], "limit must be an integer >= 0"),
        (["--data-dir", str(ROOT), "--compare-greedy", "--no-draft"], "compare_greedy needs a draft"),
    ],
)
def test_bad_options_are_one_line_errors(capsys, args: list[str], needle: str) -> None:
    assert eval_main(args) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and needle in lines[0], err
    assert "Traceback" not in err


def test_unreachable_hub_says_pass_data_dir(monkeypatch, capsys) -> None:
    import asr_spec.eval.runner as runner_module

    def offline(config, split, streaming=True):
        raise HubUnavailableError(f"openslr/librispeech_asr {config}/{split}: the Hugging Face hub is unreachable "
                                  "(ConnectError: no network); pass a local LibriSpeech tree instead (iter_local)")
        yield  # a generator, as iter_hub

    monkeypatch.setattr(runner_module, "iter_hub", offline)
    assert eval_main(["--split", "test.other"]) == 2
    (line,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert "other/test: the Hugging Face hub is unreachable" in line and "pass --data-dir DIR" in line
    assert "iter_local" not in line


@pytest.mark.real
@pytest.mark.slow
def test_real_whisper_base_fixture_eval(tmp_path: Path) -> None:
    """whisper-base on 4 fixture utterances, with a draft of its decoder minus the next-to-last layer (0,1,2,3,5:
    46 % acceptance on these clips; the first and last layers alone get 5 %)."""
    from test_transcribe import _real_base

    target, processor = _real_base()
    n_layers = target.config.decoder_layers
    draft = decoder_draft(target, [*range(n_layers - 2), n_layers - 1])
    transcriber = Transcriber(target, draft, processor, TranscribeOptions.from_values(language="en", batch_size=4))
    options = EvalOptions(data_dir=str(ROOT), limit=4, compare_greedy=True, output=str(tmp_path / "base.jsonl"))
    s = evaluate(options, transcriber=transcriber)
    assert s["n_scored"] == 4 and s["identical_fraction"] == 1.0
    assert s["wer"] < 0.2  # measured 9.1 % (TTS fixtures; "full hour" for "flower")
    assert s["acceptance_rate"] > 0.3 and s["tokens_per_target_pass"] > 2  # measured 46 %, 3.3


def test_bench_script_runs_side_by_side(tmp_path: Path, capsys, model_dirs) -> None:
    """benchmarks/bench.py on two fixture clips with the tiny models: every row of ours, the batch-2 assistant error."""
    pytest.importorskip("matplotlib")
    with script_module("bench") as bench:
        target_dir, _ = model_dirs
        preset = tmp_path / "tiny.toml"
        preset.write_text(f'model = "{target_dir}"\n')  # no draft: cut one from the target
        plot = tmp_path / "bench.png"
        code = bench.main(["--preset", str(preset), "--limit", "2", "--batch-sizes", "1,2", "--draft-layers", "0",
                           "--plot", str(plot)])
        captured = capsys.readouterr()
        out = captured.out
        assert code == 0, out
        assert "decoder layers 0 of the target's 1" in out
        assert "assisted generate is only supported for batch_size = 1" in out
        assert plot.stat().st_size > 0
        rows = json.loads(plot.with_suffix(".json").read_text())["rows"]
        # faster-whisper needs the CTranslate2 weights of an embedded preset: skipped, and said so, for this one
        assert "faster-whisper batched: skipped" in captured.err
        assert "faster-whisper timestamps: skipped" in captured.err
        assert "faster-whisper int8: skipped" in captured.err
        figures = json.loads(plot.with_suffix(".json").read_text())
        hardware = figures["hardware"]
        assert hardware["dtype"] == dtype_name(auto_dtype()) and hardware["cpu"]["class"] == detect_cpu().cpu_class
        ours = {(c, n) for c in bench.CONFIGS if not c.startswith("fw") for n in (1, 2)}
        assert {(r["config"], r["batch_size"]) for r in rows} == ours
        assert all(r["identical_to_greedy"] for r in rows if r["config"] in ("spec", "default"))


@pytest.mark.slow
def test_bench_faster_whisper_column_runs_in_its_own_process() -> None:
    """The faster-whisper column runs in a child process holding the clips; where faster-whisper is not installed
    the child says so and the column is skipped (ImportError), as in CI."""
    import importlib.util

    with script_module("bench") as bench:
        clips = bench.load_clips(["tests/fixtures/speech/short/festival-kal.flac"], None)
        try:
            run = bench.FwRunner("base", bench.torch.device("cpu"), "en", clips)
        except ImportError as err:
            assert importlib.util.find_spec("faster_whisper") is None, err
            assert "faster_whisper" in str(err)
            return
        texts = run(clips, 1)
        assert len(texts) == 1 and len(texts[0].split()) >= 5
        assert run(clips[:0], 1) == []
        run.close()
        with_timestamps = bench.FwRunner("base", bench.torch.device("cpu"), "en", clips, timestamps=True)
        stamped = with_timestamps(clips, 1)  # timestamp mode may pick other words: only the shape is checked
        with_timestamps.close()
        assert len(stamped) == 1 and len(stamped[0].split()) >= 5


def _damaged_tree(tmp_path: Path) -> Path:
    """A copy of the fixture tree whose very first utterance is not audio and whose second is missing."""
    import shutil

    root = tmp_path / "tree"
    shutil.copytree(ROOT, root)
    chapter = root / "test-clean" / "9001" / "100201"
    (chapter / "9001-100201-0000.flac").write_bytes(b"garbage\n")
    (chapter / "9001-100201-0001.flac").unlink()
    return root


@pytest.mark.parametrize("long_form", [False, True])
def test_unreadable_or_missing_utterances_are_their_own_records_and_the_run_goes_on(tmp_path: Path,
                                                                                    long_form: bool) -> None:
    """A first utterance that is not audio stopped the run at its warm-up; a missing one stopped it while the tree
    was read (every rerun the same); in long-form a chapter with such a part stopped every chapter. Each is now its
    record's error (a chapter's, in long form), and every other unit is scored."""
    path = tmp_path / "run.jsonl"
    run = run_eval(tiny("none"), iter_local(_damaged_tree(tmp_path), "test-clean"), path, as_long_form=long_form)
    records = {r["id"]: r for r in ResultsLog(path).records()}
    failed = sorted(i for i, r in records.items() if r.get("error"))
    if long_form:
        assert sorted(records) == CHAPTERS and failed == ["9001-100201"] and run.n_failed == 1
    else:
        assert sorted(records) == sorted(IDS) and failed == IDS[:2] and run.n_failed == 2
        assert "not a readable audio file" in records[IDS[0]]["error"] and "no such file" in records[IDS[1]]["error"]
        # the file read named (an id alone said "no such file" with no clue which path, or extension, was read)
        assert records[IDS[1]]["error"].startswith(str(tmp_path / "tree" / "test-clean" / "9001" / "100201"))
    assert all(r["hyp"] or r.get("error") for r in records.values())


def test_an_empty_reference_is_said_and_failed_records_are_said_kept(tmp_path: Path, capsys) -> None:
    """An utterance with no reference text scored every word of its transcript as an insertion, without a word
    (11 of 13 insertions of a reviewer's run); a rerun kept every failed record and printed the same failures with
    no error line nor hint, as if it had tried them again."""
    path = tmp_path / "run.jsonl"
    log_ = ResultsLog(path)
    log_.append({"id": "a", "ref": "hello world", "hyp": "hello world", "audio_s": 1.0, "wall_s": 0.1})
    log_.append({"id": "b", "ref": " ", "hyp": "alpha beta gamma", "audio_s": 1.0, "wall_s": 0.1})
    log_.append({"id": "c", "ref": "x", "hyp": "", "audio_s": 0.0, "wall_s": 0.0, "error": "c.flac: no such file"})
    with pytest.warns(UserWarning, match=r"1 scored records have an empty reference \(b\): every word of their "
                                         "transcripts counts as an insertion"):
        summary = eval_summary(path)
    assert summary["insertions"] == 3
    from asr_spec.cli.evaluation import _report

    assert _report(EvalOptions(data_dir=str(ROOT), output=str(path)), {**summary, "log": str(path)}) == 1
    assert f"error: 1 failed: their records in {path} say why; a rerun keeps them" in capsys.readouterr().err


def test_nothing_scored_is_no_wer_and_an_unwritable_log_is_found_before_the_models_load(tmp_path: Path) -> None:
    path = tmp_path / "failed.jsonl"
    ResultsLog(path).append({"id": "a", "ref": "x", "hyp": "", "audio_s": 0.0, "wall_s": 0.0, "error": "bad"})
    summary = eval_summary(path)
    assert summary["n_scored"] == 0 and summary["wer"] != summary["wer"]  # NaN: "n/a", not "0.00 %"
    assert "n/a" in format_summary(summary)
    blocked = tmp_path / "a_file"
    blocked.write_text("")
    with pytest.raises(InputError, match="cannot write the results log"):
        ResultsLog(blocked / "run.jsonl").check_writable()


def test_a_transcript_file_that_is_not_utf8_is_named(tmp_path: Path) -> None:
    import shutil

    root = tmp_path / "tree"
    shutil.copytree(ROOT, root)
    trans = root / "test-clean" / "9001" / "100201" / "9001-100201.trans.txt"
    trans.write_bytes(trans.read_bytes().replace(b"THE", b"TH\xe9"))
    with pytest.raises(InputError, match=r"9001-100201\.trans\.txt: not UTF-8"):
        list(iter_local(root, "test-clean"))
