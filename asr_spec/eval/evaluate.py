"""`evaluate`: one whole LibriSpeech evaluation run, from `EvalOptions` to the summary written next to the log.

    EvalOptions ──open_utterances──► (first one read: a bad data dir or an unreachable hub fails before any model
    loads) ──load_transcriber──► run_eval (eval/runner.py) ──► write_eval_summary (eval/summary.py) ──►
    <log>.summary.json

On a Ray cluster (`EvalOptions.ray`) the same steps run through `asr_spec.distributed.evaluate_on_ray`, one layer
up (distributed imports eval, never the reverse): `evaluate` refuses `ray` and names it.
"""

from __future__ import annotations

import itertools
import json
import warnings
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import Any

from asr_spec.errors import InputError
from asr_spec.eval.librispeech import ResultsLog, Utterance
from asr_spec.eval.options import SETUP_VERSION, EvalOptions
from asr_spec.eval.runner import run_eval, utterances
from asr_spec.eval.summary import eval_summary, summary_path, write_summary

__all__ = ["check_precision", "evaluate", "load_transcriber", "open_log", "open_utterances", "setup_path",
           "write_eval_summary"]

# EvalOptions fields that choose or load the models: with a ready `transcriber` they would be ignored, so they are
# refused instead (batch_size and the run options are applied to it).
_MODEL_FIELDS = ("preset", "model", "draft", "device", "dtype", "language", "no_draft")


def load_transcriber(options: EvalOptions) -> Any:
    """`Transcriber.from_preset` with the options' model overrides. With compare_greedy the preset's draft decodes
    every run, on any device (evaluating the draft is asking for it): `plan_models(..., every_run=True)`."""
    from asr_spec.models.loading import resolve_device
    from asr_spec.models.presets import load_preset, plan_models
    from asr_spec.transcribe import Transcriber

    overrides = options.model_overrides()
    if options.compare_greedy:
        device_type = resolve_device(overrides.get("device")).type
        plan = plan_models(load_preset(options.preset_name()), device_type, overrides, every_run=True)
        overrides["draft"] = plan.draft
    transcriber = Transcriber.from_preset(options.preset_name(), **overrides)
    if options.compare_greedy and transcriber.draft is None:
        raise InputError(f"preset {options.preset_name()}: no draft model (its draft is missing or not set), so "
                         "--compare-greedy has nothing to compare; give a preset with a draft")
    return transcriber


def _check_no_model_options(options: EvalOptions) -> None:
    given = [name for name in _MODEL_FIELDS if getattr(options, name) not in (None, False)]
    if given:
        raise InputError(f"evaluate: {', '.join(given)} choose the models, but a transcriber was given: set them "
                         "on the transcriber, or leave `transcriber` out")


def open_utterances(options: EvalOptions) -> Iterator[Utterance]:
    """The split's utterances, the first one already read: a bad data_dir or an unreachable hub fails here,
    before any model loads (InputError / HubUnavailableError)."""
    items = utterances(options)
    try:
        first = next(items)
    except StopIteration:
        raise InputError(f"{options.data_dir or 'the hub'}: split {options.split} has no utterances") from None
    return itertools.chain([first], items)


def open_log(options: EvalOptions) -> ResultsLog:
    """The run's results log, checked before the models load: writable, and resumed only by a run of the setup
    that wrote its records (`EvalOptions.setup`, kept next to it as <name>.setup.json): a second run with another
    --model found every id done and printed the first model's WER under its own title."""
    log = ResultsLog(options.output_path())
    log.check_writable()
    setup, path = options.setup(), setup_path(log.path)
    if log.done_ids() and path.exists():
        try:
            before = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            raise InputError(f"{path}: cannot read the setup of the log's records ({err})") from err
        if isinstance(before, dict) and before.get("version") != SETUP_VERSION:  # kept as typed: resolved now
            before = options.resolved_setup(before)
        changed = [f"{key} {before.get(key)!r} (this run: {value!r})" for key, value in setup.items()
                   if before.get(key) != value]
        if changed:
            raise InputError(f"{log.path}: its records were written with {', '.join(changed)}; give --output for "
                             "a new log, or delete it to start again")
    else:
        if log.done_ids():  # a log written before setups were kept: resumed with this run's, said so, kept from now
            warnings.warn(f"{log.path}: its records have no setup to check this run's against (written before "
                          f"{path.name} was kept): taking this run's as theirs", stacklevel=2)
        path.write_text(json.dumps(setup, indent=1) + "\n", encoding="utf-8")
    return log


def check_precision(options: EvalOptions, precision: str) -> None:
    """After the models load, before anything is decoded: the log's records were decoded in `precision` (the run
    summary's words, `models.cpu.precision_line`), else `InputError` (a log of bf16 records with the CPU kernels,
    resumed with ASR_SPEC_NO_CPU_KERNELS=1 or on another CPU class, mixed two precisions under one title); a
    setup that does not say one (its first run, or written before) takes this run's."""
    log, path = ResultsLog(options.output_path()), setup_path(options.output_path())
    try:
        setup = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    except (OSError, ValueError) as err:
        raise InputError(f"{path}: cannot read the setup of the log's records ({err})") from err
    before = setup.get("precision")
    if before is not None and before != precision and log.done_ids():
        raise InputError(f"{log.path}: its records were decoded in {before} (this run: {precision}); give --output "
                         "for a new log, or delete it to start again")
    setup["precision"] = precision
    path.write_text(json.dumps(setup, indent=1) + "\n", encoding="utf-8")


def setup_path(log_path: Path) -> Path:
    """Where a results log's setup is kept: <name>.setup.json beside it."""
    return log_path.with_name(log_path.stem + ".setup.json")


def write_eval_summary(options: EvalOptions, hardware: dict[str, Any] | list[dict[str, Any]] | None = None,
                       ids: Collection[str] | None = None) -> dict[str, Any]:
    """The summary of the run's log, also written next to it as <name>.summary.json; with `hardware` (what the
    models ran on, `models.cpu.run_precision`: a run in this process, or a Ray run's workers, one dict where they
    agreed, else a list of each kind) under that key. ids: the run's units where it has a `limit` (the log may
    hold more, of an earlier run's: `--limit 2` on a log of 7 said the 7's WER), None: the whole log."""
    path = options.output_path()
    summary = eval_summary(path, ids=None if options.limit is None else ids)
    summary["log"] = str(path)
    if hardware is not None:
        summary["hardware"] = hardware
    write_summary(summary, summary_path(path))
    return summary


def evaluate(options: EvalOptions, *, transcriber: Any = None,
             on_record: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run (or resume) the evaluation `options` describe and return its summary, also written next to the log.

    The data source and the results log are opened before the models load, so a bad data_dir, an unreachable hub
    or a log that cannot be written fails fast.
    `transcriber` replaces the preset's models; the options that would choose models (preset, model, draft,
    device, dtype, language, no_draft) must then be left unset (InputError otherwise); batch_size applies to it.
    `options.ray`: InputError; `asr_spec.distributed.evaluate_on_ray` runs it (as `asr-spec eval --ray` does).
    """
    if options.ray:
        raise InputError("ray: run it with asr_spec.distributed.evaluate_on_ray(options) (asr-spec eval --ray)")
    if transcriber is not None:
        _check_no_model_options(options)
    items = open_utterances(options)
    open_log(options)
    if transcriber is None:
        transcriber = load_transcriber(options)
    from asr_spec.models.cpu import precision_line, run_of, run_precision

    check_precision(options, precision_line(*run_of(transcriber)))
    run = run_eval(transcriber, items, options.output_path(), limit=options.limit, as_long_form=options.long_form,
                   compare_greedy=options.compare_greedy, batch_size=options.batch_size,
                   group_size=options.group_size, on_record=on_record)
    return write_eval_summary(options, run_precision(*run_of(transcriber)), run.ids)
