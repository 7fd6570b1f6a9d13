"""The `asr-spec` command: output, one-line errors, exit codes. Runs `main(argv)` in-process on the tiny model
directories of test_transcribe (a random Whisper with the real tokenizer)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
from test_transcribe import LONG, SHORT, auto_precision_words, make_bad_inputs, save_tiny_models

from asr_spec.cli import main
from asr_spec.models.cpu import detect_cpu
from asr_spec.transcribe.outputs import SOURCES_INDEX


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> tuple[Path, Path]:
    return save_tiny_models(tmp_path_factory.mktemp("models"))


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    """Run `asr-spec ARGS...`; returns (exit code, stdout, stderr)."""
    with pytest.raises(SystemExit) as info:
        main([str(a) for a in args])
    out = capsys.readouterr()
    return int(info.value.code or 0), out.out, out.err


def tiny(model_dirs, *args: str, draft: bool = True) -> list[str]:
    target, draft_dir = model_dirs
    return ["transcribe", "--model", str(target), *(["--draft", str(draft_dir)] if draft else []),
            "--language", "en", "--batch-size", "3", *args]  # later options win: `args` can override these


def assert_one_line_error(err: str, *needles: str) -> None:
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and all(n in lines[0] for n in needles), err
    assert "Traceback" not in err


def assert_only_line_is_error(err: str, *needles: str) -> None:
    """`assert_one_line_error`, and stderr holds no other line but the CPU kernels' one-time build notice
    (`cpu_attention.BUILD_NOTICE`): a fresh machine's first run shows it, and so does a run that meets another
    process's build under way (the suite's other worker); it answers nothing itself."""
    from asr_spec.engine import cpu_attention

    assert_one_line_error(err, *needles)
    notice = f"note: {cpu_attention.BUILD_NOTICE}"
    assert len([line for line in err.strip().splitlines() if line != notice]) == 1, err


def test_a_kernel_build_during_the_options_check_is_reported_too(capsys, model_dirs, monkeypatch) -> None:
    """On a CPU with native bf16 the options' check (`Transcriber.plan_preset`: `auto` probes the bf16 products)
    builds the kernels, before the run's record began: a fresh machine's ~55 s build went unreported."""
    from asr_spec.engine import cpu_attention
    from asr_spec.transcribe import Transcriber

    built = [0.0]
    plan = Transcriber.plan_preset

    def planned(*args, **kwargs):
        built[0] = 30.0  # the probe built the kernels here
        return plan(*args, **kwargs)

    monkeypatch.setattr(Transcriber, "plan_preset", planned)
    monkeypatch.setattr(cpu_attention, "build_seconds", lambda: built[0])
    code, _, err = run_cli(capsys, *tiny(model_dirs, str(SHORT[0]), draft=False))
    summary = err.strip().splitlines()[-1]
    assert code == 0 and "; the CPU kernels' one-time build took 30.0 s more" in summary, summary


def test_a_first_runs_kernel_build_is_reported_apart_from_its_speed(capsys, model_dirs, monkeypatch) -> None:
    """The CPU kernels' one-time build (~20-60 s on a fresh machine) is not the run's speed: the summary's RTFx
    leaves it out and says how long it took."""
    from asr_spec.engine import cpu_attention

    monkeypatch.setattr(cpu_attention, "build_seconds", lambda: 7.0)  # built before the run: not its cost
    code, _, err = run_cli(capsys, *tiny(model_dirs, str(SHORT[0]), draft=False))
    assert code == 0 and "one-time build" not in err
    started: list[float] = []

    def builds() -> float:  # 7 s at the run's start; then as if all of the run after its start had been a build
        if not started:
            started.append(time.perf_counter())
            return 7.0
        return 7.0 + time.perf_counter() - started[0]

    monkeypatch.setattr(cpu_attention, "build_seconds", builds)
    code, _, err = run_cli(capsys, *tiny(model_dirs, str(SHORT[0]), draft=False))
    summary = err.strip().splitlines()[-1]
    assert code == 0 and "; the CPU kernels' one-time build took " in summary, summary
    took = re.search(r" in (\d+\.\d) s \(RTFx [\d.]+; loading (\d+\.\d) s before; the CPU kernels' one-time build "
                     r"took (\d+\.\d) s more\)", summary)
    # the whole run counted as the build, the loading's and the transcription's alike
    assert took and float(took[1]) == float(took[2]) == 0.0 and float(took[3]) > 0.1, summary


def test_the_summary_gives_the_transcriptions_speed_and_the_loading_apart(capsys, model_dirs, monkeypatch) -> None:
    """Loading the models (~3 s, ~30 s cold) is not the transcription's speed: the README
    sample said "77.7 s audio in 32.5 s (RTFx 2.4)" where its json's wall_s was 11.5 s."""
    from asr_spec import Transcriber

    real = Transcriber.from_preset.__func__

    def slow(cls, *args, **kwargs):
        time.sleep(3.0)
        return real(cls, *args, **kwargs)

    monkeypatch.setattr(Transcriber, "from_preset", classmethod(slow))
    code, _, err = run_cli(capsys, *tiny(model_dirs, str(SHORT[0]), draft=False))
    summary = err.strip().splitlines()[-1]
    took = re.search(r" in (\d+\.\d) s \(RTFx [\d.]+; loading (\d+\.\d) s before\)", summary)
    assert code == 0 and took, summary
    assert float(took[2]) >= 3.0 and float(took[1]) < 3.0, summary


def test_warnings_and_notices_are_the_lines_the_command_line_shows() -> None:
    """`logs`: an INFO record is shown only as a notice (``note: ...``, `logs.NOTICE`), a warning always."""
    import logging

    from asr_spec import logs

    def record(level: int, notice: bool) -> logging.LogRecord:
        made = logging.LogRecord("asr_spec.engine.cpu_attention", level, __file__, 1, "building %s", ("x",), None)
        if notice:
            made.__dict__.update(logs.NOTICE)
        return made

    shown = {(level, notice): logs._shown(record(level, notice)) for level in (logging.INFO, logging.WARNING)
             for notice in (False, True)}
    assert shown == {(logging.INFO, False): False, (logging.INFO, True): True, (logging.WARNING, False): True,
                     (logging.WARNING, True): True}
    assert logs._Prefixed("%(message)s").format(record(logging.INFO, True)) == "note: building x"
    assert logs._Prefixed("%(message)s").format(record(logging.WARNING, False)) == "warning: building x"
    from asr_spec.engine import cpu_attention

    assert cpu_attention.NOTICE == logs.NOTICE  # the engine's spelling of it (it imports nothing from logs)


def test_transcribe_prints_text_and_a_summary(capsys, model_dirs) -> None:
    code, spec_out, spec_err = run_cli(capsys, *tiny(model_dirs, str(LONG), str(SHORT[0])))
    assert code == 0
    assert spec_out.splitlines()[0] == f"==> {LONG} <==" and f"==> {SHORT[0]} <==" in spec_out
    summary = spec_err.strip().splitlines()[-1]
    assert summary.startswith("2/2 files: ") and "RTFx" in summary and "acceptance" in summary
    assert "tokens/target pass" in summary
    # dtype auto on the CPU class conftest pins (int8 where the kernel extension is built, else float32; unpinned,
    # this CPU's), then the attention path this machine could build
    assert summary.endswith(f"[{auto_precision_words()}]")
    if detect_cpu().cpu_class == "avx2":
        int8 = ("[cpu avx2, int8 precision (float32 arithmetic), attention: cpu kernel, encoder products and attention "
                "int8, decoder weights bf16, audio keys/values int8]")
        assert summary.endswith((int8, "[cpu avx2, float32, attention: torch]"))
    code, greedy_out, greedy_err = run_cli(capsys, *tiny(model_dirs, str(LONG), str(SHORT[0]), draft=False))
    assert code == 0 and greedy_out == spec_out  # lossless: the draft changes the speed only
    assert "greedy (no draft)" in greedy_err
    code, single, quiet_err = run_cli(capsys, *tiny(model_dirs, str(SHORT[0]), "--quiet", "--no-timestamps"))
    assert code == 0 and not single.startswith("==>") and single.strip()  # one file: the text alone
    assert quiet_err == ""


def test_bad_files_are_reported_one_line_each_and_the_rest_transcribed(capsys, tmp_path: Path, model_dirs) -> None:
    bad = make_bad_inputs(tmp_path)
    blip = tmp_path / "blip.wav"  # 0.1 s: valid
    sf.write(blip, np.zeros(1600, np.float32), 16_000)
    code, out, err = run_cli(capsys, *tiny(model_dirs, str(SHORT[0]), *bad, str(blip)))
    assert code == 1
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == len(bad)
    for line, (path, cause) in zip(errors, bad.items()):
        assert line.startswith(f"error: {path}: ") and cause in line
    assert "Traceback" not in err
    assert f"==> {SHORT[0]} <==" in out and f"==> {blip} <==" in out
    assert err.strip().splitlines()[-1].startswith(f"2/{len(bad) + 2} files ({len(bad)} failed)")


def test_a_file_that_cannot_be_audio_is_said_before_the_models_load(capsys, tmp_path: Path, model_dirs,
                                                                      monkeypatch) -> None:
    """A mistyped name waited for the models' loading (~60 s cold beside other work) before its one line; a run
    of nothing but such files loaded them for nothing. Said at once, each once; the readable ones still run."""
    from asr_spec.transcribe import Transcriber

    loads: list[str] = []
    real_load = Transcriber.from_preset.__func__  # type: ignore[attr-defined]

    def from_preset(cls, *args, **kwargs):  # noqa: ANN001, ANN202
        loads.append(capsys.readouterr().err)  # what stderr held when the models started to load
        return real_load(cls, *args, **kwargs)

    monkeypatch.setattr(Transcriber, "from_preset", classmethod(from_preset))
    folder, text = tmp_path / "folder", tmp_path / "notes.wav"
    folder.mkdir()
    text.write_text("not audio\n")
    missing = tmp_path / "mising.wav"
    code, out, err = run_cli(capsys, *tiny(model_dirs, str(missing), str(folder), str(text)))
    assert code == 1 and out == "" and loads == []
    assert err.splitlines() == [f"error: {missing}: no such file",
                                f"error: {folder}: is a directory, not an audio file",
                                f"error: {text}: not a readable audio file (text, not audio)",
                                "0/3 files (3 failed): no file could be read, no model loaded"]
    code, out, err = run_cli(capsys, *tiny(model_dirs, str(missing), str(SHORT[0]), str(missing)))
    assert code == 1 and f"==> {SHORT[0]} <==" in out
    assert loads == [f"error: {missing}: no such file\n" * 2]  # both said before the load, neither again after it
    assert "error:" not in err and err.strip().splitlines()[-1].startswith("1/3 files (2 failed)")


@pytest.mark.parametrize(
    "args,needles",
    [
        (["--batch-size", "0"], ["batch_size must be an integer >= 1, got 0"]),
        (["--chunk-length", "45"], ["chunk_length_s must be in (0, 30]"]),
        (["--task", "summarise"], ["task must be 'transcribe' or 'translate'"]),
        (["--format", "docx", "--output-dir", "out"], ["unknown output format 'docx'"]),
        (["--format", "txt"], ["--format needs --output-dir"]),
        (["--no-draft"], ["--no-draft and --draft contradict"]),
        (["--dtype", "int4"], ["unknown dtype 'int4'"]),
        # cue flags where no srt/vtt is written were taken and ignored
        (["--word-timestamps", "--max-words-per-cue", "2"], ["--max-words-per-cue shape srt/vtt cues",
                                                             "no file is written"]),
        (["--output-dir", "out", "--format", "txt,json", "--word-timestamps", "--max-line-width", "10",
          "--max-line-count", "2"],
         ["--max-line-width/--max-line-count shape srt/vtt cues, but --format is txt,json"]),
        (["--ray", "--output", "r.jsonl", "--max-line-width", "20"], ["--ray writes JSONL records: drop them"]),
    ],
)
def test_bad_options_exit_2_with_one_line(capsys, model_dirs, args: list[str], needles: list[str]) -> None:
    code, out, err = run_cli(capsys, *tiny(model_dirs, str(SHORT[0]), *args))
    assert code == 2 and out == ""
    assert_only_line_is_error(err, *needles)


def test_unknown_preset_and_unloadable_model_exit_2(capsys, tmp_path: Path) -> None:
    code, _, err = run_cli(capsys, "transcribe", str(SHORT[0]), "--preset", "large-v9")
    assert code == 2
    assert_one_line_error(err, "unknown preset 'large-v9'", "base, base-distilled, large-v2, large-v3, tiny.en")
    code, _, err = run_cli(capsys, "transcribe", str(SHORT[0]), "--model", str(tmp_path))
    assert code == 2
    assert_one_line_error(err, str(tmp_path), "not a Whisper model directory")
    if not torch.cuda.is_available():
        code, _, err = run_cli(capsys, "transcribe", str(SHORT[0]), "--device", "cuda")
        assert code == 2
        assert_one_line_error(err, "CUDA is not available")
    for device, why in (("gpu", "not a device name"), ("cuda:x", "not a device name"), ("meta", "runs on cpu or cuda")):
        code, _, err = run_cli(capsys, "transcribe", str(SHORT[0]), "--device", device)
        assert code == 2
        assert_one_line_error(err, f"device {device!r}", why)


@pytest.mark.parametrize("args", [["--workers", "4"], ["--threads-per-worker", "8"], ["--workers", "1"]])
def test_ray_options_without_ray_are_a_usage_error_not_ignored(capsys, monkeypatch, args: list[str]) -> None:
    """`--workers N` and `--threads-per-worker N` were accepted and silently ignored without --ray (a run of one
    process, the user believing it ran on four); refused like --output and --ray-address, before anything loads."""
    from asr_spec.transcribe import Transcriber

    monkeypatch.setattr(Transcriber, "from_preset", lambda *a, **k: pytest.fail("a model was loaded"))
    code, out, err = run_cli(capsys, "transcribe", str(SHORT[0]), *args)
    assert code == 2 and out == ""
    assert_only_line_is_error(err, "--workers, --threads-per-worker, --manifest, --output and --ray-address need "
                                   "--ray")


def test_ray_options_not_given_keep_the_ray_runners_defaults(capsys, monkeypatch, tmp_path: Path) -> None:
    """With --ray, an option left out is RayOptions' default (the CLI says "not given" with None), a given one
    reaches it as given."""
    from asr_spec import distributed

    seen: list[distributed.RayOptions] = []

    def fake_run(inputs, output, *, options, **kwargs):
        seen.append(options)
        return distributed.RunReport(Path(output), len(inputs), 0, 0, 0, 0.0)

    monkeypatch.setattr(distributed, "transcribe_dataset", fake_run)
    base = ["transcribe", "--ray", "--quiet", "--output", str(tmp_path / "r.jsonl"), str(SHORT[0])]
    assert run_cli(capsys, *base)[0] == 0
    assert run_cli(capsys, *base, "--workers", "3", "--threads-per-worker", "2")[0] == 0
    defaults = distributed.RayOptions()
    assert (seen[0].workers, seen[0].threads_per_worker) == (defaults.workers, defaults.threads_per_worker)
    assert (seen[1].workers, seen[1].threads_per_worker) == (3, 2)


def test_output_dir_writes_the_chosen_formats(capsys, tmp_path: Path, model_dirs) -> None:
    out_dir = tmp_path / "transcripts"
    code, out, _ = run_cli(capsys, *tiny(model_dirs, str(LONG), "--output-dir", str(out_dir), "--format", "txt,json"))
    assert code == 0 and out == ""
    assert sorted(p.name for p in out_dir.iterdir()) == [SOURCES_INDEX, "long_75s.json", "long_75s.txt"]
    data = json.loads((out_dir / "long_75s.json").read_text())
    assert data["source"] == str(LONG) and data["text"] and len(data["chunks"]) == 3  # vad, the presets' default
    assert data["stats"]["drafted_tokens"] > 0 and "acceptance_rate" in data["stats"]
    code, _, _ = run_cli(capsys, *tiny(model_dirs, str(SHORT[0]), "--output-dir", str(out_dir), "--quiet"))
    assert code == 0 and {p.suffix for p in out_dir.glob(f"{SHORT[0].stem}.*")} == {".txt", ".json", ".srt", ".vtt"}


def test_convert_reports_a_bad_directory_on_one_line(capsys, tmp_path: Path) -> None:
    """An unusable model or folder is exit 2, as the other commands' (it was 1, "some input failed"); OUT_DIR named
    as such, and the flag as the command line spells it (the message said "pass overwrite")."""
    code, _, err = run_cli(capsys, "convert", str(tmp_path / "nothing"), str(tmp_path / "out"))
    assert code == 2
    assert_one_line_error(err, f"{tmp_path / 'nothing'}: no such folder (CT2_DIR)")
    code, _, err = run_cli(capsys, "convert", str(tmp_path), str(tmp_path / "out"))
    assert code == 2
    assert_one_line_error(err, "model.bin")  # a folder without a model: the converter says what is missing
    code, _, err = run_cli(capsys, "convert", str(tmp_path), str(tmp_path / "out"), "--dtype", "int8")
    assert code == 2
    assert_one_line_error(err, "--dtype must be one of float32, fp32, float16, fp16, bfloat16, bf16")
    a_file = tmp_path / "en.wav"
    a_file.write_bytes(b"RIFF")
    code, _, err = run_cli(capsys, "convert", str(tmp_path), str(a_file))
    assert code == 2
    assert_one_line_error(err, f"{a_file}: OUT_DIR is a file, not a folder")
    code, _, err = run_cli(capsys, "convert", str(tmp_path), str(tmp_path), "--dtype", "fp16")
    assert code == 2
    assert_one_line_error(err, "OUT_DIR already exists; remove it, choose another or pass --overwrite")


def test_python_dash_m_works() -> None:
    done = subprocess.run([sys.executable, "-m", "asr_spec", "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "transcribe" in done.stdout and "convert" in done.stdout
    done = subprocess.run([sys.executable, "-m", "asr_spec", "transcribe", "x.wav", "--batch-size", "0"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.strip() == "error: batch_size must be an integer >= 1, got 0"


@pytest.mark.real
@pytest.mark.slow
def test_real_base_preset_and_convert(capsys, tmp_path: Path) -> None:
    pytest.importorskip("asr_spec.models.ct2", reason="the CTranslate2 converter is not available")
    from asr_spec.eval.metrics import score
    from asr_spec.models import embedded

    try:
        tiny_en = embedded.embedded_ct2_dir("whisper-tiny.en")
    except (ImportError, OSError, ValueError) as err:
        pytest.skip(f"offline model packages not usable: {err}")
    code, out, err = run_cli(capsys, "transcribe", str(SHORT[1]), "--preset", "base", "--language", "en")
    assert code == 0, err
    manifest = dict(line.split("\t")[::2] for line in (SHORT[1].parent / "manifest.tsv").read_text().splitlines()[1:])
    assert score([manifest[SHORT[1].name]], [out]).wer < 0.2
    code, out, err = run_cli(capsys, "convert", str(tiny_en), str(tmp_path / "tiny.en"))
    assert code == 0, err
    code, text, err = run_cli(capsys, "transcribe", str(SHORT[1]), "--model", out.strip(), "--quiet")
    assert code == 0 and score([manifest[SHORT[1].name]], [text]).wer < 0.3, err


def test_eval_subcommand_is_wired(capsys, tmp_path: Path) -> None:
    code, _, err = run_cli(capsys, "eval", "--data-dir", str(tmp_path / "nowhere"), "--split", "test.clean")
    assert code == 2
    assert_one_line_error(err, "nowhere")


def test_chunking_and_word_timestamps_options(capsys, tmp_path: Path, model_dirs) -> None:
    out_dir = tmp_path / "words"
    args = tiny(model_dirs, str(SHORT[0]), "--output-dir", str(out_dir), "--format", "json,srt", "--quiet",
                "--word-timestamps", "--max-words-per-cue", "2")
    code, _, err = run_cli(capsys, *args)
    assert code == 0, err
    data = json.loads((out_dir / f"{SHORT[0].stem}.json").read_text())
    words = [w for segment in data["segments"] for w in segment.get("words", [])]
    assert words and set(words[0]) == {"word", "start", "end", "probability"}
    cues = (out_dir / f"{SHORT[0].stem}.srt").read_text().count("-->")
    assert cues >= len(words) / 2
    code, _, err = run_cli(capsys, *tiny(model_dirs, str(SHORT[0]), "--chunking", "stride", "--word-timestamps"))
    assert code == 2
    assert_one_line_error(err, "word_timestamps need chunking 'vad'")
    code, _, err = run_cli(capsys, *tiny(model_dirs, str(SHORT[0]), "--chunking", "silence"))
    assert code == 2
    assert_one_line_error(err, "chunking must be one of vad, stride")


def test_eval_and_distill_are_typer_commands_with_their_help(capsys) -> None:
    done = subprocess.run([sys.executable, "-m", "asr_spec", "eval", "--help"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    for option in ("--preset", "--model", "--draft", "--no-draft", "--batch-size", "--compare-greedy", "--ray"):
        assert option in done.stdout
    code, out, _ = run_cli(capsys, "distill", "--help")
    assert code == 0 and all(command in out for command in ("cache", "train", "eval", "head", "run"))
    code, _, err = run_cli(capsys, "eval", "--limit", "many")
    assert code == 2 and "--limit" in err  # typer's own usage error: exit 2 as before


def test_distill_options_with_several_values() -> None:
    from asr_spec.cli.distill import expand_variadic

    argv = ["distill", "--threads", "2", "eval", "--sim-k", "3", "4", "8", "--k", "3", "--no-speed",
            "--train-cache", "a", "b", "--draft", "d"]
    assert expand_variadic(argv) == ["distill", "--threads", "2", "eval", "--sim-k", "3", "--sim-k", "4", "--sim-k",
                                     "8", "--k", "3", "--no-speed", "--train-cache", "a", "--train-cache", "b",
                                     "--draft", "d"]
    assert expand_variadic(["transcribe", "x.wav", "--batch-size", "2"]) == ["transcribe", "x.wav", "--batch-size", "2"]


def test_a_port_or_thread_count_out_of_range_is_a_usage_error_before_anything_loads(capsys, monkeypatch) -> None:
    """`serve --port 70000` (or -1) was a traceback once the models had loaded, `distill --threads 0` torch's
    RuntimeError traceback: both are usage errors (exit 2), found before any model loads."""
    import asr_spec.serve

    monkeypatch.setattr(asr_spec.serve, "run_server", lambda *args, **kwargs: pytest.fail("the server was started"))
    for port in ("70000", "-1"):
        code, _, err = run_cli(capsys, "serve", "--port", port)
        assert code == 2 and "--port" in err and "Traceback" not in err, err
    for threads in ("0", "-3"):
        code, _, err = run_cli(capsys, "distill", "--threads", threads, "--model", "/absent", "eval",
                               "--held-out-cache", "/absent-cache")
        assert code == 2
        assert_only_line_is_error(err, f"--threads {threads}: must be at least 1")


def test_the_summary_names_fallback_only_where_a_window_fell_back() -> None:
    """A schedule of temperatures under which no window fell back says nothing of it (it said "windows decoded
    again (fallback_windows): 0 at 0.2, 0 at 0.4, ..."); one window at 0.2 is counted there."""
    from types import SimpleNamespace

    from asr_spec.cli.transcribe import _Run
    from asr_spec.engine import ChunkStats

    def result(*counts: int) -> SimpleNamespace:
        return SimpleNamespace(error=None, audio_s=1.0, stats=ChunkStats(), n_dropped=0, redecoded_tails=0,
                               fallback_windows=tuple(zip((0.2, 0.4), counts)), source="a.wav", text="")

    run = _Run(2, Path("out"))
    run.add(result(0, 0))
    assert "decoded again" not in run.summary()
    run.add(result(1, 0))
    assert run.summary().endswith("windows decoded again (fallback_windows): 1 at 0.2, 0 at 0.4")
    # nothing decoded: not "greedy (no draft)" of a run with its draft loaded, and files read with no speech in
    # them are not called untranscribed (a reviewer's silence, music and phase-inverted files read as failures)
    assert "no speech heard" in run.summary() and "greedy" not in run.summary()
    failed = _Run(1, Path("out"))
    failed.add(SimpleNamespace(error="x.wav: not audio", audio_s=0.0, stats=ChunkStats(), n_dropped=0,
                               redecoded_tails=0, fallback_windows=(), source="x.wav", text=""))
    assert failed.summary().startswith("0/1 files (1 failed)") and "no file transcribed" in failed.summary()
    run.add(SimpleNamespace(error=None, audio_s=1.0, stats=ChunkStats(generated_tokens=3), n_dropped=0,
                            redecoded_tails=0, fallback_windows=(), source="b.wav", text="x"))
    assert "greedy (no draft)" in run.summary()


def test_the_summary_names_the_languages_it_detected() -> None:
    """A French file decoded as Thai showed only in the JSON (a multilingual reviewer's); a run that detects says
    what it found, a run given its language says nothing of it."""
    from types import SimpleNamespace

    from asr_spec.cli.transcribe import _Run
    from asr_spec.engine import ChunkStats

    def result(language: str) -> SimpleNamespace:
        return SimpleNamespace(error=None, audio_s=1.0, stats=ChunkStats(), n_dropped=0, redecoded_tails=0,
                               fallback_windows=(), source="a.wav", text="", language=language)

    given, detects = _Run(2, Path("out")), _Run(3, Path("out"))
    detects.detects = True
    for code in ("de", "fr", "de"):
        given.add(result(code))
        detects.add(result(code))
    assert "language" not in given.summary()
    assert "languages detected: de 2, fr 1" in detects.summary()
    alone = _Run(1, Path("out"))
    alone.detects = True
    alone.add(result("fr"))
    assert ", language fr (detected)" in alone.summary()


def test_a_ctrl_c_while_the_command_line_imports_is_one_line(capsys, monkeypatch) -> None:
    """The console script imported the whole command line (torch, transformers) before any catch: a Ctrl-C in its
    first second was a 25-50 line traceback from the middle of an import (a diff reviewer's). Its entry point,
    `asr_spec.__main__.run`, imports it inside its own."""
    import builtins
    import tomllib

    import asr_spec.__main__ as entry

    scripts = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["asr-spec"] == "asr_spec.__main__:run"
    real = builtins.__import__

    def interrupted(name, *args, **kwargs):
        if name == "asr_spec.cli":
            raise KeyboardInterrupt
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", interrupted)
    with pytest.raises(SystemExit) as exit_:
        entry.run()
    assert exit_.value.code == 130 and capsys.readouterr().err == "interrupted\n"


def test_a_ctrl_c_during_a_commands_imports_is_one_line(capsys, monkeypatch) -> None:
    """`serve`, `stream` and `transcribe` import torch and transformers as they start: a Ctrl-C there escaped the
    command and typer exited 130 saying nothing (a diff reviewer's). Each imports inside `interruptible`."""
    import builtins

    real = builtins.__import__

    def interrupted(name, *args, **kwargs):
        if name in ("asr_spec.transcribe", "asr_spec.serve"):
            raise KeyboardInterrupt
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", interrupted)
    for args in (["transcribe", "x.wav"], ["stream", "x.wav"], ["serve"]):
        with pytest.raises(SystemExit) as exit_:
            main(args)
        assert exit_.value.code == 130 and capsys.readouterr().err == "interrupted\n", args


def test_a_ctrl_c_before_a_command_starts_is_one_line(capsys, monkeypatch) -> None:
    """Ctrl-C in the first second (the logging set-up importing transformers, before `transcribe` catches its
    own) printed a 45-line traceback (an archive reviewer's)."""
    import asr_spec.cli as cli

    def interrupted() -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "configure_logging", interrupted)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["transcribe", "x.wav"])
    assert exit_.value.code == 130 and capsys.readouterr().err == "interrupted\n"


def test_threads_sets_the_processs_torch_threads_before_the_models_load(capsys, monkeypatch, model_dirs) -> None:
    """`--threads N` (openai-whisper's) on transcribe, stream and serve: torch's threads when the models load; under
    1 one line, exit 2, as distill's; with --ray the workers' is --threads-per-worker."""
    import asr_spec.serve
    from asr_spec.transcribe import Transcriber

    seen: list[int] = []
    real_load = Transcriber.from_preset.__func__  # type: ignore[attr-defined]

    def from_preset(cls, *args, **kwargs):  # noqa: ANN001, ANN202
        seen.append(torch.get_num_threads())
        return real_load(cls, *args, **kwargs)

    monkeypatch.setattr(Transcriber, "from_preset", classmethod(from_preset))
    monkeypatch.setattr(asr_spec.serve, "run_server", lambda *args, **kwargs: seen.append(torch.get_num_threads()))
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            assert run_cli(capsys, *tiny(model_dirs, str(SHORT[0]), "--threads", str(threads), "--quiet"))[0] == 0
            assert run_cli(capsys, "stream", str(SHORT[0]), "--model", str(model_dirs[0]), "--no-draft", "--speed",
                           "0", "--threads", str(threads))[0] == 0
            assert run_cli(capsys, "serve", "--threads", str(threads))[0] == 0
        assert seen == [1, 1, 1, 2, 2, 2]
        for command in (tiny(model_dirs, str(SHORT[0])), ["stream", str(SHORT[0])], ["serve"]):
            code, _, err = run_cli(capsys, *command, "--threads", "0")
            assert code == 2
            assert_only_line_is_error(err, "--threads 0: must be at least 1")
        code, _, err = run_cli(capsys, "transcribe", "--ray", str(SHORT[0]), "--threads", "2")
        assert code == 2
        assert_only_line_is_error(err, "with --ray give --threads-per-worker")
        assert len(seen) == 6  # nothing loaded for a usage error
    finally:
        torch.set_num_threads(before)


def test_threads_hold_for_the_options_check_and_a_ctrl_c_there_is_one_line(capsys, monkeypatch, model_dirs) -> None:
    """`auto`'s precision probe runs in the options' check: it ran at torch's own threads, not --threads (70 s on
    two busy cores where one thread took 11 s), and a Ctrl-C during it (or the files' check) exited 130 saying
    nothing (a docs reviewer's)."""
    from asr_spec.transcribe import Transcriber

    seen: list[int] = []
    real_plan = Transcriber.plan_preset

    def plan(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        seen.append(torch.get_num_threads())
        return real_plan(*args, **kwargs)

    monkeypatch.setattr(Transcriber, "plan_preset", staticmethod(plan))
    before = torch.get_num_threads()
    try:
        assert run_cli(capsys, *tiny(model_dirs, str(SHORT[0]), "--threads", "1", "--quiet"))[0] == 0
        assert seen and set(seen) == {1}  # the options' check, and the load's own plan
    finally:
        torch.set_num_threads(before)

    def interrupted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise KeyboardInterrupt

    monkeypatch.setattr(Transcriber, "plan_preset", staticmethod(interrupted))
    code, out, err = run_cli(capsys, *tiny(model_dirs, str(SHORT[0])))
    assert code == 130 and out == "" and err.strip().splitlines()[-1].startswith("interrupted"), err
