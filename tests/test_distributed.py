"""The Ray runner on a local Ray instance (2 workers' worth of CPUs): the same transcripts as one process, one record
per input whatever happens (a corrupt file, a resumed run, a worker killed mid-run), and the two CLIs.

One Ray instance for the module; tiny random models saved to a folder; the committed fixtures. Skipped without ray.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from test_transcribe import save_tiny_models  # noqa: E402

from asr_spec import distributed  # noqa: E402
from asr_spec.cli import main as cli_main  # noqa: E402
from asr_spec.cli.evaluation import eval_main  # noqa: E402
from asr_spec.models.cpu import precision_words, run_of, run_precision  # noqa: E402
from asr_spec.transcribe import Transcriber  # noqa: E402
from asr_spec.transcribe.segments import transcript_dict  # noqa: E402

pytestmark = pytest.mark.slow

TESTS = Path(__file__).parent
SHORT = sorted(str(p) for p in (TESTS / "fixtures" / "speech" / "short").glob("*.flac"))
LIBRI = TESTS / "fixtures" / "librispeech"
QUIET = distributed.RayOptions(progress=False)


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    """One small local Ray for the module; its workers import this checkout's asr_spec and this test module."""
    saved = {key: os.environ.get(key) for key in ("PYTHONPATH", "RAY_DEDUP_LOGS", "OMP_NUM_THREADS")}
    os.environ.update(PYTHONPATH=os.pathsep.join([str(TESTS.parent), str(TESTS)]), RAY_DEDUP_LOGS="1",
                      OMP_NUM_THREADS="1")
    ray.init(num_cpus=3, include_dashboard=False, object_store_memory=100 * 2**20, log_to_driver=False,
             configure_logging=False)
    yield
    ray.shutdown()
    for key, value in saved.items():
        os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)


@pytest.fixture(scope="module")
def preset(tmp_path_factory) -> Path:
    """A preset file naming the tiny target and draft (what the workers load), English."""
    folder = tmp_path_factory.mktemp("models")
    save_tiny_models(folder)
    path = folder / "tiny.toml"
    path.write_text('model = "./tiny"\ndraft = "./tiny-draft"\nlanguage = "en"\n')
    return path


@pytest.fixture(scope="module")
def local(preset: Path) -> Transcriber:
    """The preset's models in this process, as each worker loads them."""
    return Transcriber.from_preset(preset, device="cpu")


@pytest.fixture(scope="module")
def expected(local: Transcriber) -> dict[str, dict]:
    """What one process gives on the short clips: text, segments and statistics per path."""
    results = local.transcribe(SHORT[:3], progress=False)
    as_jsonl = [dict(dataclasses.asdict(t), segments=[transcript_dict(s) for s in t.segments]) for t in results]
    return {t["source"]: _transcript(json.loads(json.dumps(t))) for t in as_jsonl}  # segments without token ids


@pytest.fixture(scope="module")
def hardware(local: Transcriber) -> dict:
    """What one process's models decode on (`run_precision`), as JSON gives it back: the workers' must be the same
    (they inherit this process's pinned CPU flags)."""
    return json.loads(json.dumps(run_precision(*run_of(local))))


def _transcript(record: dict) -> dict:
    """What must not depend on how files are spread over workers: the tokens (acceptance counts may: they depend
    on which rows share a batch)."""
    stats = record["stats"]
    return {"text": record["text"], "segments": list(record["segments"]),
            "tokens": (stats["chunks"], stats["generated_tokens"])}


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _corrupt(folder: Path) -> str:
    bad = folder / "corrupt.flac"
    bad.write_bytes(b"fLaC" + os.urandom(200))
    return str(bad)


class CrashOnce:
    """A loader whose Transcriber kills its own process (like an OOM kill) on its first batch while `marker`
    exists; the marker is removed first, so the restarted actor gets through."""

    def __init__(self, marker: str, preset: str):
        self.marker, self.preset = marker, preset

    def __call__(self) -> CrashOnce:
        self.transcriber = Transcriber.from_preset(self.preset, device="cpu")
        return self

    def transcribe(self, sources, **kwargs):
        if os.path.exists(self.marker):
            os.remove(self.marker)
            os._exit(1)
        return self.transcriber.transcribe(sources, **kwargs)


def test_same_transcripts_as_one_process_and_a_corrupt_file_is_one_record(tmp_path, preset, expected,
                                                                          hardware) -> None:
    manifest = tmp_path / "m.csv"
    lines = ["path,text,speaker"] + [f"{p},reference {i},s{i}" for i, p in enumerate(SHORT[:3])]
    manifest.write_text("\n".join(lines + [f"{_corrupt(tmp_path)},,x"]) + "\n")
    out = tmp_path / "out.jsonl"
    options = dataclasses.replace(QUIET, workers=2, files_per_batch=2)
    report = distributed.transcribe_dataset(distributed.manifest_inputs(manifest), out, preset=str(preset),
                                            options=options, device="cpu")
    records = {r["path"]: r for r in _records(out)}
    assert (report.n_inputs, report.n_written, report.n_failed, len(records)) == (4, 4, 1, 4)
    assert report.hardware == (hardware,)  # two workers, one kind: once
    for i, path in enumerate(SHORT[:3]):
        got = records[path]
        assert _transcript(got) == expected[path]
        assert got["ref"] == f"reference {i}" and got["meta"] == {"speaker": f"s{i}"} and "error" not in got
    bad = records[str(tmp_path / "corrupt.flac")]
    assert bad["text"] == "" and bad["stats"] is None and "not a readable audio file" in bad["error"]


def test_a_worker_killed_mid_run_still_gives_every_record_once(tmp_path, preset, expected) -> None:
    marker = tmp_path / "crash-once"
    marker.touch()
    out = tmp_path / "out.jsonl"
    options = dataclasses.replace(QUIET, files_per_batch=1)
    report = distributed.transcribe_dataset(SHORT[:3], out, options=options, loader=CrashOnce(str(marker), str(preset)))
    assert not marker.exists()  # the first actor did die
    records = _records(out)
    assert sorted(r["id"] for r in records) == SHORT[:3] and report.n_written == 3
    assert report.hardware == ()  # the loader's object is no Transcriber: nothing to say, and nothing fails
    assert all(_transcript(r) == expected[r["path"]] for r in records)


def test_cli_resumes_without_duplicates(tmp_path, preset, expected, hardware, capsys) -> None:
    out = tmp_path / "out.jsonl"
    first = {"id": SHORT[0], "path": SHORT[0], "text": "done before"}
    out.write_text(json.dumps(first) + "\n" + '{"id": "' + SHORT[1] + '", "text": "cut off by a ki')  # a killed run
    args = ["transcribe", "--ray", "--workers", "1", "--preset", str(preset), "--device", "cpu",
            str(Path(SHORT[0]).parent / "[ef][se]*.flac"), "--output", str(out)]  # the first three
    with pytest.raises(SystemExit) as exit_:
        cli_main(args)
    assert exit_.value.code == 0
    said = capsys.readouterr().err
    assert "2 records written" in said and f"the workers decoded on: {precision_words(hardware)}\n" in said
    records = _records(out)
    assert records[0] == first  # untouched: resumed, not redone
    assert sorted(r["id"] for r in records) == SHORT[:3]  # the partial line is gone, each file once
    assert all(_transcript(r) == expected[r["path"]] for r in records[1:])
    with pytest.raises(SystemExit) as exit_:  # everything is done: nothing to run
        cli_main(args)
    assert exit_.value.code == 0 and len(_records(out)) == 3
    said = capsys.readouterr().err
    assert "0 records written" in said and "decoded on" not in said  # nothing decoded: nothing to say of it
    with pytest.raises(SystemExit) as exit_:
        cli_main(["transcribe", "--ray", *SHORT[:1]])
    assert exit_.value.code == 2 and "--ray needs --output" in capsys.readouterr().err


def test_eval_ray_writes_the_records_the_summary_reads(tmp_path, preset, hardware) -> None:
    out = tmp_path / "eval.jsonl"
    code = eval_main(["--ray", "--data-dir", str(LIBRI), "--preset", str(preset), "--limit", "3", "--device", "cpu",
                      "--output", str(out), "--quiet"])
    records = _records(out)
    assert code == 0 and len(records) == 3 and len({r["id"] for r in records}) == 3
    assert all(r["ref"] and "hyp" in r and r["wall_s"] > 0 and "target_passes" in r for r in records)
    summary = json.loads((tmp_path / "eval.summary.json").read_text())
    assert summary["n_scored"] == 3 and summary["rtfx"] > 0
    assert summary["hardware"] == hardware  # what the workers decoded on


def test_eval_on_ray_takes_threads_per_worker(tmp_path, monkeypatch) -> None:
    """`eval --ray` had no --threads-per-worker: its CPU actors always ran one torch thread, where docs/ray.md
    sizes workers x threads (`transcribe --ray` had it)."""
    from asr_spec.eval.options import EvalOptions

    given = {}

    def fake(rows, output, *, options, **kwargs):
        given["options"] = options
        return types.SimpleNamespace(hardware=())

    monkeypatch.setattr(distributed, "transcribe_dataset", fake)
    distributed.evaluate_on_ray(EvalOptions(ray=True, data_dir=str(LIBRI), limit=1, threads_per_worker=3,
                                            output=str(tmp_path / "e.jsonl")))
    assert given["options"].threads_per_worker == 3


def test_with_gpu_workers_decoding_runs_in_its_own_cpu_tasks(capsys) -> None:
    """The plan only (nothing runs): GPU actors leave decoding to CPU tasks; CPU actors take it over (fused)."""
    for gpus, optimised in [(1.0, "ActorPoolMapOperator[MapBatches(_TranscribeWorker)]\n+- TaskPoolMapOperator"),
                            (0.0, "ActorPoolMapOperator[MapBatches(_decode_batch)->MapBatches(_TranscribeWorker)]")]:
        options = dataclasses.replace(QUIET, gpus_per_worker=gpus)
        distributed._pipeline(ray, [{"id": "a", "path": "a.flac"}], lambda: None, options).explain()
        plan = capsys.readouterr().out
        assert optimised in plan.split("Physical Plan (Optimized)")[1]


@pytest.mark.parametrize("args, needle", [
    (["transcribe", "--output", "x.jsonl", "a.flac"], "--manifest, --output and --ray-address need --ray"),
    (["transcribe", "--ray", "--output", "x.jsonl"], "no input: give audio FILEs or --manifest"),
    (["transcribe", "--ray", "--output", "x.jsonl", "--output-dir", "d", "a.flac"], "drop --output-dir"),
    (["eval", "--workers", "2"], "ray_address, workers and threads_per_worker are options of ray"),
    (["eval", "--threads-per-worker", "2"], "ray_address, workers and threads_per_worker are options of ray"),
    (["eval", "--ray"], "ray runs utterance files of a local tree: give data_dir"),
])
def test_cli_option_errors(capsys, args: list[str], needle: str) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli_main(args)
    assert exit_.value.code == 2 and needle in capsys.readouterr().err


def test_bad_inputs_are_one_line_errors(tmp_path) -> None:
    with pytest.raises(distributed.InputError, match="no file matches"):
        distributed.file_inputs([str(tmp_path / "*.flac")])
    (tmp_path / "folder").mkdir()  # a pattern that matches folders only: no file, not an empty run
    with pytest.raises(distributed.InputError, match=r"no file matches this pattern \(only folders"):
        distributed.file_inputs([str(tmp_path / "fold*")])


def test_a_file_named_like_a_pattern_is_that_file(tmp_path) -> None:
    """"talk [1].flac" was read as a pattern: alone it matched nothing (refused), beside "talk 1.flac" it matched
    that one, and another file's speech was recorded under the name asked for."""
    named, other = tmp_path / "talk [1].flac", tmp_path / "talk 1.flac"
    named.write_bytes(b"x")
    assert distributed.file_inputs([str(named)]) == [{"id": str(named), "path": str(named)}]
    other.write_bytes(b"y")
    assert distributed.file_inputs([str(named)]) == [{"id": str(named), "path": str(named)}]
    assert distributed.file_inputs([str(tmp_path / "talk ?.flac")]) == [{"id": str(other), "path": str(other)}]
    manifest = tmp_path / "m.jsonl"
    manifest.write_text('{"file": "a.flac"}\n')
    with pytest.raises(distributed.InputError, match=r"m.jsonl:1: no 'path' value .*found: file"):
        distributed.manifest_inputs(manifest)
    spreadsheet = tmp_path / "excel.csv"  # saved as "CSV UTF-8" by a spreadsheet: a byte-order mark first
    spreadsheet.write_bytes("path,text\na.flac,hello\n".encode("utf-8-sig"))
    assert [(r["path"], r["ref"]) for r in distributed.manifest_inputs(spreadsheet)] == [(str(tmp_path / "a.flac"),
                                                                                         "hello")]
    with pytest.raises(distributed.InputError, match="workers must be an integer >= 1"):
        distributed.RayOptions(workers=0)
    assert [r["id"] for r in distributed.librispeech_inputs(LIBRI)][:2] == ["9001-100201-0000", "9001-100201-0001"]


def test_a_manifest_loses_no_row_to_a_quote_or_a_repeated_id(tmp_path) -> None:
    """A TSV text opening with '"Tis' swallowed every line after it into its field, and a second file of an id
    was dropped: those files were never transcribed, without a word."""
    tsv = tmp_path / "m.tsv"
    tsv.write_text('path\ttext\na.flac\thello\nb.flac\t"Tis the season\nc.flac\tworld\n\nd.flac\tlast one\n')
    with pytest.raises(distributed.InputError, match=r"m.tsv:3: a quote opened there runs over 4 lines"):
        distributed.manifest_inputs(tsv)
    tsv.write_text('path\ttext\na.flac\thello\nb.flac\t"""Tis the season"\nc.flac\t"he said ""stop"""\n\n'
                   "d.flac\tlast one\n")  # as csv.writer and pandas quote them
    assert [(Path(r["path"]).name, r["ref"]) for r in distributed.manifest_inputs(tsv)] == [
        ("a.flac", "hello"), ("b.flac", '"Tis the season'), ("c.flac", 'he said "stop"'), ("d.flac", "last one")]
    tsv.write_text("path\ttext\na.flac\thello\tthere\n")
    with pytest.raises(distributed.InputError, match=r"m.tsv:2: 3 fields where the header has 2"):
        distributed.manifest_inputs(tsv)
    speakers = tmp_path / "s.csv"
    speakers.write_text("id,path\nspk1,a.flac\nspk1,b.flac\nspk2,c.flac\n")
    with pytest.raises(distributed.InputError, match=r"s.csv: id 'spk1' is given to two files"):
        distributed.manifest_inputs(speakers)
    speakers.write_text("id,path\nspk1,a.flac\nspk1,a.flac\n")  # the same row twice: once
    assert len(distributed.manifest_inputs(speakers)) == 1


def test_a_manifests_ids_do_not_depend_on_how_it_is_named(tmp_path, monkeypatch) -> None:
    """A rerun naming the manifest from another folder (`m2/corpus.csv`, then `corpus.csv` from m2) found none of
    its records: the ids were the paths as read from here, every file transcribed again and recorded twice."""
    folder = tmp_path / "m2"
    folder.mkdir()
    (folder / "corpus.csv").write_text("path,text\naudio/a.flac,hello\n")
    monkeypatch.chdir(tmp_path)
    from_above = distributed.manifest_inputs("m2/corpus.csv")
    monkeypatch.chdir(folder)
    from_inside = distributed.manifest_inputs("corpus.csv")
    assert [r["id"] for r in from_above] == [r["id"] for r in from_inside] == ["audio/a.flac"]
    assert from_above[0]["path"] == str(Path("m2/audio/a.flac")) and from_inside[0]["path"] == "audio/a.flac"
    (folder / "corpus.csv").write_text("path\n./audio/a.flac\naudio/a.flac\n")  # one file, written two ways: once
    assert [r["id"] for r in distributed.manifest_inputs("corpus.csv")] == ["audio/a.flac"]
    # a log written when the ids were the paths as read from here resumes: its record counts for the row
    monkeypatch.chdir(tmp_path)
    log = tmp_path / "old.jsonl"
    log.write_text(json.dumps({"id": str(Path("m2/audio/a.flac")), "path": str(Path("m2/audio/a.flac")),
                               "text": "done"}) + "\n")
    report = distributed.transcribe_dataset(distributed.manifest_inputs("m2/corpus.csv"), log, options=QUIET,
                                            loader=lambda: None)
    assert (report.n_inputs, report.n_skipped, report.n_written) == (1, 1, 0)


def test_the_input_readers_live_in_manifests_below_the_runner() -> None:
    """`asr_spec.manifests` reads the inputs; the runner re-exports its readers, and reading inputs imports neither
    the runner (no cycle) nor Ray."""
    from asr_spec import manifests

    for name in ("file_inputs", "manifest_inputs", "librispeech_inputs"):
        assert getattr(distributed, name) is getattr(manifests, name) and name in distributed.__all__
    code = ("import sys, asr_spec.manifests; "
            "print(sorted(m for m in ('asr_spec.distributed', 'ray') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          cwd=TESTS.parent)
    assert done.stdout.strip() == "[]"


def test_an_unwritable_output_is_found_before_ray_starts(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(distributed, "_import_ray", lambda: pytest.fail("Ray started for an unwritable output"))
    (tmp_path / "notadir").write_text("")
    with pytest.raises(distributed.InputError, match="cannot write the results log"):
        distributed.transcribe_dataset(SHORT[:1], tmp_path / "notadir" / "out.jsonl", loader=lambda: None)


def test_without_ray_the_runner_says_how_to_install_it(tmp_path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now fails, as when it is not installed
    with pytest.raises(distributed.InputError, match=r"pip install 'asr-spec\[ray\]'"):
        distributed.transcribe_dataset(SHORT[:1], tmp_path / "out.jsonl", loader=lambda: None)


def test_a_rerun_says_what_failed_before_and_exits_1(tmp_path, monkeypatch, capsys) -> None:
    """A rerun over a log holding a failed record said "0 written (0 failed), 2 already there" and exit 0: the
    failed one is kept for ever (as eval says) and a script never heard of it."""
    monkeypatch.setattr(distributed, "_import_ray", lambda: pytest.fail("Ray started with nothing to do"))
    good, bad = str(SHORT[0]), str(tmp_path / "notaudio.wav")
    log = tmp_path / "rf.jsonl"
    log.write_text(json.dumps({"id": good, "path": good, "text": "done"}) + "\n"
                   + json.dumps({"id": bad, "path": bad, "error": "not audio"}) + "\n")
    report = distributed.transcribe_dataset([good, bad], log, options=QUIET, loader=lambda: None)
    assert (report.n_skipped, report.n_written, report.n_failed, report.n_failed_before) == (2, 0, 0, 1)
    with pytest.raises(SystemExit) as exit_:
        cli_main(["transcribe", "--ray", "--output", str(log), good, bad])
    assert exit_.value.code == 1
    assert "1 failed before: their records in" in capsys.readouterr().err


def test_ray_cli_checks_options_before_ray_and_says_an_interrupt(tmp_path, monkeypatch, capsys) -> None:
    """A bad option was found by every actor (a 110-line traceback, then "rerun to resume"); Ctrl-C exited 130
    without a word."""
    monkeypatch.setattr(distributed, "transcribe_dataset", lambda *a, **k: pytest.fail("Ray run for a bad option"))
    with pytest.raises(SystemExit) as exit_:
        cli_main(["transcribe", "--ray", "--output", str(tmp_path / "x.jsonl"), "--language", "klingon",
                  str(SHORT[0])])
    assert exit_.value.code == 2 and "language 'klingon' is not one Whisper knows" in capsys.readouterr().err

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(distributed, "transcribe_dataset", interrupted)
    with pytest.raises(SystemExit) as exit_:
        cli_main(["transcribe", "--ray", "--output", str(tmp_path / "x.jsonl"), str(SHORT[0])])
    err = capsys.readouterr().err
    assert exit_.value.code == 130 and "interrupted (the records in" in err and "rerun the same command" in err


def test_an_unreachable_cluster_address_is_refused_at_once(monkeypatch) -> None:
    """Ray retried 127.0.0.1:1 for minutes (warnings, no error); "auto" and other forms stay Ray's to resolve."""
    import socket

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]  # closed again at once: nothing listens there
    for address in (f"127.0.0.1:{port}", f"ray://127.0.0.1:{port}"):
        with pytest.raises(distributed.InputError, match=rf"ray_address {address}: nothing answers there"):
            distributed._check_reachable(address)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        distributed._check_reachable(f"127.0.0.1:{server.getsockname()[1]}")  # something answers: Ray's to join
    for other in ("auto", "local", "ray://head"):
        distributed._check_reachable(other)
    ray = types.SimpleNamespace(is_initialized=lambda: False,
                                init=lambda **kwargs: pytest.fail("ray.init called for an unreachable address"))
    with pytest.raises(distributed.InputError, match="nothing answers there"):
        distributed._connect(ray, distributed.RayOptions(address=f"127.0.0.1:{port}"))


def test_a_rerun_with_other_options_is_refused_before_ray_starts(tmp_path: Path, monkeypatch) -> None:
    """A rerun into the same results with another language (or model, prompt, ...) found every id done and kept
    the first run's records as its own, exit 0 (CHANGELOG, forty-fifth session's noticed items). The run's setup is
    kept beside its records, as eval keeps its; a speed option (batch size, device) is not part of it, and the
    same setup spelled otherwise ("English", a relative path) is the same."""
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "results.jsonl"
    out.write_text("".join(json.dumps({"id": path, "path": path, "text": "x"}) + "\n" for path in SHORT[:2]))

    def no_ray():  # every id is recorded: nothing may start Ray
        raise AssertionError("Ray was started")

    monkeypatch.setattr(distributed, "_import_ray", no_ray)
    os.symlink(TESTS / "fixtures", tmp_path / "fixtures")
    first = distributed.transcribe_dataset(SHORT[:2], out, options=QUIET, language="en", model="fixtures")
    assert first.n_skipped == 2 and (tmp_path / "results.setup.json").exists()
    again = distributed.transcribe_dataset(SHORT[:2], out, options=QUIET, language="English", batch_size=2,
                                           model=str(tmp_path / "fixtures"))
    assert again.n_skipped == 2
    with pytest.raises(distributed.InputError, match=r"results.jsonl: its records were written with language 'en' "
                                                     r"\(this run: 'fr'\); give another --output"):
        distributed.transcribe_dataset(SHORT[:2], out, options=QUIET, language="fr", model="fixtures")
