"""Scale out on Ray: transcribe a corpus across the cores, GPUs or machines of a Ray cluster (Ray Data batch
inference; `pip install 'asr-spec[ray]'`).

    inputs (files | manifest | LibriSpeech tree) ──skip ids already in the output──► ray.data.from_items
      ──map_batches(_decode_batch): CPU tasks, read + decode + resample to 16 kHz──► {id, audio, error, read_s}
      ──map_batches(_TranscribeWorker): an actor pool, one Transcriber per actor (num_gpus=1 on GPUs)──► results
      ──iter_rows at the driver──► one JSONL line per input (appended, flushed, fsync'ed), deduplicated by id

With GPU actors the decode step runs in separate CPU tasks, in parallel with the GPUs; with CPU actors Ray Data
fuses it into the actors (both would reserve the same CPUs), so each worker decodes its own files. Each actor's
Transcriber batches the chunks of all the files of the batch it receives (continuous batching), so
`files_per_batch` files keep its engine rows full. Ray does the scheduling: a decode task that fails is retried,
an actor that dies is restarted and its batch redone (Ray Data's actor defaults); the driver writes a
record only once per id, so a redone batch never duplicates a line. A file that cannot be read is one record with
`error` set; the run goes on. So is one whose transcription raises (its batch is then transcribed file by file;
where every file raises alone, the fault is not theirs and the run stops, its records kept). Rerunning with the
same output skips every id already recorded (a partial last line left by a killed run is cut first), so a killed
run resumes where it stopped.

The inputs are read by `asr_spec.manifests` (its readers re-exported here). Ray is imported only inside the
functions that need it: the rest of asr-spec works without it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from asr_spec.audio.loading import SAMPLE_RATE, load_audio
from asr_spec.checks import int_at_least, is_number
from asr_spec.errors import AsrSpecError, InputError, one_line
from asr_spec.eval.librispeech import ResultsLog
from asr_spec.manifests import InputRow, _as_rows, file_inputs, librispeech_inputs, manifest_inputs
from asr_spec.transcribe.results import Transcription
from asr_spec.transcribe.segments import transcript_dict

__all__ = [
    "RayOptions",
    "RunReport",
    "file_inputs",
    "librispeech_inputs",
    "manifest_inputs",
    "transcribe_dataset",
    "transcription_record",
]

log = logging.getLogger(__name__)

INPUT_ERRORS = (AsrSpecError, ValueError, OSError)  # one input's fault: recorded on it, the run goes on
MAX_BLOCKS = 1024  # Ray Data blocks of the input list: one per file up to this, so decoding spreads over the cluster
RECORD_KEYS = ("id", "path", "text", "segments", "language", "audio_s", "wall_s", "latency_s", "read_s", "stats",
               "error", "ref", "meta")

Loader = Callable[[], Any]  # builds the Transcriber of one actor (picklable: it travels to the workers)
MakeRecord = Callable[[InputRow, Transcription, float, float], dict[str, Any]]  # (row, t, wall_s, read_s) -> record


@dataclass(frozen=True)
class RayOptions:
    """How the run is spread over the cluster. Checked once, here."""

    address: str | None = None  # Ray cluster ("auto", "ray://host:10001"); None: RAY_ADDRESS, else a local Ray
    workers: int = 1  # transcription actors, each holding one Transcriber (one per GPU on GPU machines)
    gpus_per_worker: float | None = None  # None: 1 when the cluster has GPUs, else 0 (CPU actors)
    threads_per_worker: int = 1  # torch threads of a CPU actor (and the CPUs it reserves)
    files_per_batch: int = 8  # files given to an actor at once; their chunks share its engine batch
    progress: bool = True  # Ray Data's progress bars on stderr

    def __post_init__(self) -> None:
        for name, minimum in (("workers", 1), ("threads_per_worker", 1), ("files_per_batch", 1)):
            int_at_least(getattr(self, name), name, minimum)
        gpus = self.gpus_per_worker
        if gpus is not None and (not is_number(gpus, finite_only=False) or not gpus >= 0):
            raise InputError(f"gpus_per_worker must be a number >= 0, got {gpus!r}")


@dataclass(frozen=True)
class RunReport:
    """What one `transcribe_dataset` call did."""

    output: Path
    n_inputs: int  # distinct inputs asked for
    n_skipped: int  # already in the output (resumed)
    n_written: int  # records this call appended
    n_failed: int  # of n_written, records with an error
    wall_s: float  # seconds from starting the pipeline to its last record
    hardware: tuple[dict[str, Any], ...] = ()  # what this call's workers decoded on (`models.cpu.run_precision`),
    # each kind once, in the order first seen; () where none ran (all resumed) or the loader's object is no Transcriber
    # of n_skipped, records with an error: a rerun keeps them, and said nothing of them ("0 failed", exit 0)
    n_failed_before: int = 0


# -- the records -------------------------------------------------------------------------------------------------

def transcription_record(row: InputRow, t: Transcription, wall_s: float, read_s: float) -> dict[str, Any]:
    """One JSONL record: id, path, text, segments [{start_s, end_s, text}], language, audio_s, wall_s (this
    file's share of its actor's batch time), latency_s (from its first chunk to its transcript, inside the batch),
    read_s (decoding), stats (`ChunkStats` as a dict), and from the input ref, meta; error (one line) when it failed."""
    record: dict[str, Any] = {
        "id": row["id"], "path": row["path"], "text": t.text, "segments": [transcript_dict(s) for s in t.segments],
        "language": t.language, "audio_s": t.audio_s, "wall_s": wall_s, "latency_s": t.wall_s, "read_s": read_s,
        "stats": None if t.stats is None else dataclasses.asdict(t.stats),
    }
    record.update({key: row[key] for key in ("ref", "meta") if key in row})
    if t.error is not None:
        record["error"] = t.error
    return record


# -- the Ray stages (run on the workers) --------------------------------------------------------------------------

def _decode_batch(batch: dict[str, np.ndarray]) -> dict[str, Any]:
    """CPU task: read, decode, downmix and resample each file of the batch. audio[i]: float32 (n_samples_i,) at
    16 kHz (empty when the file failed, with `error` set)."""
    audio, errors, read_s = [], [], []
    for path in batch["path"]:
        start = time.perf_counter()
        try:
            audio.append(load_audio(str(path)))
            errors.append("")
        except INPUT_ERRORS as err:
            audio.append(np.zeros(0, np.float32))
            errors.append(one_line(err, str(path)))
        read_s.append(time.perf_counter() - start)
    return {"id": batch["id"], "path": batch["path"], "audio": audio, "error": np.array(errors, dtype=object),
            "read_s": np.array(read_s)}


class _TranscribeWorker:
    """Actor: one Transcriber, built once by `loader`; each call transcribes a batch of decoded files together."""

    def __init__(self, loader: Loader, threads: int, use_gpu: bool):
        import torch

        if not use_gpu:
            torch.set_num_threads(threads)
        self.transcriber = loader()
        self.hardware = _hardware_of(self.transcriber)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, Any]:
        paths, errors = [str(p) for p in batch["path"]], [str(e) for e in batch["error"]]
        ok = [i for i, err in enumerate(errors) if not err]
        sources = [{"array": batch["audio"][i], "sampling_rate": SAMPLE_RATE, "path": paths[i]} for i in ok]
        start = time.perf_counter()
        done = self._transcribe(sources) if sources else []
        wall_s = time.perf_counter() - start
        results: list[Transcription] = [Transcription(p, "", (), None, None, 0.0, 0.0, (), error=e or None)
                                        for p, e in zip(paths, errors)]
        for i, t in zip(ok, done):
            results[i] = t
        audio_s = np.array([t.audio_s for t in results])
        shares = wall_s * audio_s / audio_s.sum() if audio_s.sum() > 0 else np.full(len(results), wall_s / len(results))
        column = np.empty(len(results), dtype=object)  # Transcription objects, pickled by Ray
        column[:] = results
        return {"id": batch["id"], "result": column, "wall_s": shares, "read_s": batch["read_s"],
                "hardware": np.full(len(results), self.hardware, dtype=object)}


    def _transcribe(self, sources: list[dict[str, Any]]) -> list[Transcription]:
        """The batch's transcriptions; where transcribing them together raises, each file's alone, one that still
        raises recorded with its error (the run goes on: Ray Data does not retry a task's own exception, and one
        such file stopped the whole run). Where every file raises alone too the fault is not one file's: raised."""
        try:
            return self.transcriber.transcribe(sources, progress=False)
        except Exception:
            if len(sources) == 1:
                raise
            log.warning("a batch of %d files raised; transcribing each alone", len(sources), exc_info=True)
            alone = [self._alone(source) for source in sources]
            if all(isinstance(result, BaseException) for result in alone):
                raise
        return [_failed(source, result) if isinstance(result, BaseException) else result
                for source, result in zip(sources, alone)]

    def _alone(self, source: dict[str, Any]) -> Transcription | Exception:
        """One file's transcription, or what transcribing it raised."""
        try:
            return self.transcriber.transcribe([source], progress=False)[0]
        except Exception as err:  # recorded on the file by the caller
            return err


def _failed(source: dict[str, Any], err: BaseException) -> Transcription:
    """The record of a file whose transcription raised: no text, its audio's length, the error in one line."""
    return Transcription(source["path"], "", (), None, None, len(source["array"]) / SAMPLE_RATE, 0.0, (),
                         error=f"transcription failed: {one_line(err)}")


def _hardware_of(transcriber: Any) -> str:
    """`models.cpu.run_precision` of a worker's Transcriber as JSON (a column's value); "" for a loader's object
    that is not one (no device or target to ask)."""
    from asr_spec.models.cpu import run_of, run_precision

    if not all(hasattr(transcriber, name) for name in ("device", "target")):
        return ""
    return json.dumps(run_precision(*run_of(transcriber)), sort_keys=True)


# -- the driver --------------------------------------------------------------------------------------------------

def _import_ray() -> Any:
    try:
        import ray
    except ImportError as err:
        raise InputError("the Ray runner needs ray: pip install 'asr-spec[ray]'") from err
    return ray


def _worker_cause(err: BaseException) -> str:
    """One line saying what a worker raised: a task error carries the exception (`cause`); an actor that died
    while starting (a bad preset) carries only its traceback text, whose last "SomethingError: message" line it is."""
    inner = getattr(err, "cause", None)
    if isinstance(inner, BaseException):
        return one_line(inner)
    raised = re.findall(r"^\s*(?:[\w.]+\.)?\w*(?:Error|Exception): (.+)$", str(err), re.MULTILINE)
    return raised[-1].strip() if raised else one_line(err)


def _connect(ray: Any, options: RayOptions) -> bool:
    """Join the cluster (options.address, else RAY_ADDRESS) or start a local Ray; True when we started it."""
    if ray.is_initialized():
        return False
    address = options.address or os.environ.get("RAY_ADDRESS") or None
    if address is None:  # a local Ray sized for the actors plus room for the decode tasks
        cpus = max(os.cpu_count() or 1, options.workers * options.threads_per_worker + 1)
        ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False, configure_logging=False)
    else:
        _check_reachable(address)
        ray.init(address=address, log_to_driver=False, configure_logging=False)
    return True


# seconds a cluster's address has to answer a TCP connection before the run is refused
REACH_TIMEOUT_S = 10.0


def _check_reachable(address: str) -> None:
    """`InputError` naming a "host:port" (or "ray://host:port") address where nothing answers: Ray retried an
    unreachable one for minutes, printing warnings and no error (a Ray reviewer's 127.0.0.1:1, 7 minutes).
    "auto", "local" and other forms are Ray's to resolve."""
    import socket

    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not host or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=REACH_TIMEOUT_S).close()
    except OSError as err:
        raise InputError(f"ray_address {address}: nothing answers there ({err.strerror or err})") from err


def _pipeline(ray: Any, rows: Sequence[InputRow], loader: Loader, options: RayOptions) -> Any:
    """The Ray Data dataset of results: decode tasks, then the actor pool. Lazy: runs as it is iterated."""
    gpus = options.gpus_per_worker
    if gpus is None:
        gpus = 1.0 if ray.cluster_resources().get("GPU", 0) > 0 else 0.0
    ray.data.DataContext.get_current().enable_progress_bars = options.progress
    if not options.progress:  # nor Ray Data's "Starting execution" lines
        logging.getLogger("ray.data").setLevel(logging.WARNING)
    items = [{"id": row["id"], "path": row["path"]} for row in rows]
    ds = ray.data.from_items(items, override_num_blocks=min(len(items), MAX_BLOCKS))
    ds = ds.map_batches(_decode_batch, batch_size=1, num_cpus=1)  # a task whose process dies is retried
    return ds.map_batches(  # Ray Data restarts a dead actor and retries its batch (max_restarts/max_task_retries -1)
        _TranscribeWorker, fn_constructor_kwargs={"loader": loader, "threads": options.threads_per_worker,
                                                  "use_gpu": gpus > 0},
        batch_size=options.files_per_batch, compute=ray.data.ActorPoolStrategy(size=options.workers),
        num_gpus=gpus, num_cpus=1 if gpus > 0 else options.threads_per_worker,
    )


# options that change how fast a run goes, not what its records say (every other one is the run's setup); a
# greedy transcript is the same with or without a draft, but sampled windows are not (their draws follow K)
SPEED_ONLY = frozenset({"batch_size", "device", "cuda_graphs", "formats"})


def transcription_setup(preset: str | os.PathLike, overrides: dict[str, Any]) -> dict[str, Any]:
    """What makes a run's records what they are: its preset and options but `SPEED_ONLY`, a model, draft or preset
    path absolute, the language as its code ("English" is "en"), as JSON holds them."""
    from asr_spec.engine.options import language_code

    def resolved(value: Any) -> Any:
        return os.path.abspath(value) if isinstance(value, (str, os.PathLike)) and os.path.exists(value) else value

    setup = {"preset": resolved(preset), **{key: value for key, value in sorted(overrides.items())
                                             if key not in SPEED_ONLY}}
    for key in ("model", "draft"):
        if setup.get(key) is not None:
            setup[key] = resolved(setup[key])
    if isinstance(setup.get("language"), str):
        try:
            setup["language"] = language_code(setup["language"])
        except ValueError:
            pass  # "auto", or the options' own check names it
    return json.loads(json.dumps(setup, default=str))


def _loader_and_setup(preset: str, loader: Loader | None, overrides: dict[str, Any]
                      ) -> tuple[Loader, dict[str, Any] | None]:
    """The actors' loader and the run's setup: `Transcriber.from_preset(preset, **overrides)` and its
    `transcription_setup`, or the caller's `loader` and None (a loader's models are its own to tell apart: eval
    keeps its setup, `eval.evaluate.open_log`); both given is an `InputError`."""
    if loader is not None:
        if overrides:
            raise InputError(f"give either loader or Transcriber options, not both ({', '.join(sorted(overrides))})")
        return loader, None
    from asr_spec.transcribe import Transcriber

    return functools.partial(Transcriber.from_preset, preset, **overrides), transcription_setup(preset, overrides)


def _keep_setup(output: Path, setup: dict[str, Any], has_records: bool) -> None:
    """The run's `setup` against the one kept beside its records (<name>.setup.json, as eval keeps its): another
    one is an `InputError` naming what changed (a rerun with another language or model found every id done and
    kept the first run's records as its own, exit 0); the first run's (or a log kept before setups were) is
    written."""
    from asr_spec.eval.evaluate import setup_path

    path = setup_path(output)
    if has_records and path.exists():
        try:
            before = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            raise InputError(f"{path}: cannot read the setup of the records ({err})") from err
        changed = [f"{key} {before.get(key)!r} (this run: {setup.get(key)!r})"
                   for key in sorted(set(before) | set(setup)) if before.get(key) != setup.get(key)]
        if changed:
            raise InputError(f"{output}: its records were written with {', '.join(changed)}; give another "
                             "--output, or delete it to start again")
        return
    path.write_text(json.dumps(setup, indent=1) + "\n", encoding="utf-8")


def transcribe_dataset(inputs: Sequence[InputRow] | Sequence[str | os.PathLike], output: str | os.PathLike, *,
                       preset: str = "base", options: RayOptions | None = None, loader: Loader | None = None,
                       record: MakeRecord = transcription_record,
                       on_record: Callable[[dict[str, Any]], None] | None = None,
                       **overrides: Any) -> RunReport:
    """Transcribe `inputs` on a Ray cluster; one JSONL record per input in `output` (see `transcription_record`).

    inputs:    rows of `file_inputs` / `manifest_inputs` / `librispeech_inputs`, or plain paths and patterns.
    output:    the JSONL results; ids already in it are skipped (resume), a partial last line is cut; a run of
               another setup than its records' is refused (`transcription_setup`, kept as <name>.setup.json).
    preset, overrides: what each actor loads, `Transcriber.from_preset(preset, **overrides)` (model, draft,
               device, language, batch_size, ...); or `loader`, a picklable zero-argument callable returning it.
    record:    builds the record of one input from (row, Transcription, wall_s, read_s), on the driver.
    on_record: called with each record once it is written.
    """
    options = RayOptions() if options is None else options
    if not isinstance(options, RayOptions):
        raise InputError(f"options must be a RayOptions, got {type(options).__name__}")
    rows = _as_rows(inputs)
    loader, setup = _loader_and_setup(preset, loader, overrides)
    log = ResultsLog(output)
    log.check_writable()  # before Ray starts and the models load (found at the first record: all decoded for nothing)
    logged = log.records()
    if setup is not None:
        _keep_setup(log.path, setup, bool(logged))
    done, failed = {r["id"] for r in logged}, {r["id"] for r in logged if r.get("error")}
    # a row is done under its id, or under its path: a manifest's rows were named by their paths as read from here
    # before they were named as the manifest writes them (manifests.py), and a log of those resumes
    pending = [row for row in rows if row["id"] not in done and row["path"] not in done]
    n_failed_before = sum(row["id"] in failed or row["path"] in failed for row in rows)
    n_skipped, n_written, n_failed, start = len(rows) - len(pending), 0, 0, time.perf_counter()
    hardware: dict[str, None] = {}  # the workers' `_hardware_of`, each once, in order
    if pending:
        ray = _import_ray()
        by_id = {row["id"]: row for row in pending}
        started = _connect(ray, options)
        try:
            for out in _pipeline(ray, pending, loader, options).iter_rows():
                row = by_id.pop(str(out["id"]), None)
                if row is None:  # already written: a batch Ray redid after a worker died
                    continue
                rec = record(row, out["result"], float(out["wall_s"]), float(out["read_s"]))
                log.append(rec)
                n_written += 1
                n_failed += bool(rec.get("error"))
                hardware.setdefault(str(out["hardware"]))
                if on_record is not None:
                    on_record(rec)
        except ray.exceptions.RayError as err:  # e.g. actors that cannot start (a bad preset)
            raise AsrSpecError(f"the Ray run stopped after {n_written} new records in {output}; rerun to resume "
                               f"({_worker_cause(err)})") from err
        finally:
            if started:
                ray.shutdown()
    return RunReport(Path(output), len(rows), n_skipped, n_written, n_failed, time.perf_counter() - start,
                     tuple(json.loads(kind) for kind in hardware if kind), n_failed_before)


def evaluate_on_ray(options: Any, on_record: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """`asr-spec eval --ray`: the utterance files of `options` (an `asr_spec.eval.EvalOptions` with `ray` on) go
    to `transcribe_dataset` (`group_size` files per actor call), each worker loading the models as `evaluate`
    does; each record is the one `run_eval` writes. Returns the summary, also written next to the log.

    A record's wall_s is the utterance's share of its actor's batch time (first batch: model warm-up included), so
    RTFx is the throughput of one worker, not of the cluster. The summary's `hardware` is what this call's workers
    decoded on (one dict, or a list where they differed; left out where every id was already recorded)."""
    from asr_spec.eval.evaluate import load_transcriber, open_log, open_utterances, write_eval_summary
    from asr_spec.eval.librispeech import take
    from asr_spec.eval.runner import record_of

    if not options.ray:
        raise InputError("evaluate_on_ray: options.ray is off (run asr_spec.eval.evaluate instead)")
    utts = {u.id: u for u in take(open_utterances(options), options.limit)}
    open_log(options)
    rows = [{"id": u.id, "path": os.fspath(u.audio)} for u in utts.values()]
    ray_options = RayOptions(address=options.ray_address, workers=options.workers, progress=False,
                             threads_per_worker=options.threads_per_worker,
                             files_per_batch=options.group_size or RayOptions.files_per_batch)

    def record(row: InputRow, t: Transcription, wall_s: float, read_s: float) -> dict[str, Any]:
        return record_of(utts[row["id"]], t, wall_s, None)

    report = transcribe_dataset(rows, options.output_path(), options=ray_options,
                                loader=functools.partial(load_transcriber, options), record=record,
                                on_record=on_record)
    kinds = report.hardware
    return write_eval_summary(options, (kinds[0] if len(kinds) == 1 else list(kinds)) if kinds else None, set(utts))
