"""`evaluate`: one whole LibriSpeech evaluation run, from `EvalOptions` to the summary written next to the log.

    EvalOptions ──utterances──► (first one read: a bad data dir or an unreachable hub fails before any model
    loads) ──Transcriber.from_preset──► run_eval (eval/runner.py) ──► eval_summary (eval/summary.py) ──►
    <log>.summary.json
"""

from __future__ import annotations

import functools
import itertools
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from asr_spec.errors import InputError
from asr_spec.eval.librispeech import Utterance, take
from asr_spec.eval.options import EvalOptions
from asr_spec.eval.runner import record_of, run_eval, utterances
from asr_spec.eval.summary import eval_summary, summary_path, write_summary

__all__ = ["evaluate"]

# EvalOptions fields that choose or load the models: with a ready `transcriber` they would be ignored, so they are
# refused instead (batch_size and the run options are applied to it).
_MODEL_FIELDS = ("preset", "model", "draft", "device", "dtype", "language", "no_draft")


def _load_transcriber(options: EvalOptions) -> Any:
    from asr_spec.transcribe import Transcriber

    overrides = options.model_overrides()
    if options.compare_greedy and "draft" not in overrides:
        # evaluating the draft is asking for it: on a CPU too (presets decode greedily there by default)
        from asr_spec.models.presets import load_preset

        overrides["draft"] = load_preset(options.preset_name()).draft_or_none()
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


def evaluate(options: EvalOptions, *, transcriber: Any = None,
             on_record: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run (or resume) the evaluation `options` describe and return its summary, also written next to the log.

    The data source is opened before the models load, so a bad data_dir or an unreachable hub fails fast.
    `transcriber` replaces the preset's models; the options that would choose models (preset, model, draft,
    device, dtype, language, no_draft) must then be left unset (InputError otherwise); batch_size applies to it.
    """
    if transcriber is not None:
        _check_no_model_options(options)
    items = utterances(options)
    try:
        first = next(items)
    except StopIteration:
        raise InputError(f"{options.data_dir or 'the hub'}: split {options.split} has no utterances") from None
    path = options.output_path()
    if options.ray:
        if transcriber is not None:
            raise InputError("with ray each worker loads options.preset: do not pass a transcriber")
        _run_eval_on_ray(options, itertools.chain([first], items), path, on_record)
    else:
        if transcriber is None:
            transcriber = _load_transcriber(options)
        run_eval(transcriber, itertools.chain([first], items), path, limit=options.limit,
                 as_long_form=options.long_form, compare_greedy=options.compare_greedy,
                 batch_size=options.batch_size, group_size=options.group_size, on_record=on_record)
    summary = eval_summary(path)
    summary["log"] = str(path)
    write_summary(summary, summary_path(path))
    return summary


def _run_eval_on_ray(options: EvalOptions, items: Iterable[Utterance], path: Path,
                     on_record: Callable[[dict[str, Any]], None] | None) -> None:
    """--ray: the utterance files go to `asr_spec.distributed.transcribe_dataset` (`group_size` files per actor
    call); each record is the one `run_eval` writes. Its wall_s is the utterance's share of its actor's batch time
    (first batch: model warm-up included), so RTFx is the throughput of one worker, not of the cluster."""
    from asr_spec import distributed

    utts = {u.id: u for u in take(items, options.limit)}
    rows = [{"id": u.id, "path": os.fspath(u.audio)} for u in utts.values()]
    ray_options = distributed.RayOptions(address=options.ray_address, workers=options.workers, progress=False,
                                         files_per_batch=options.group_size or distributed.RayOptions.files_per_batch)
    distributed.transcribe_dataset(rows, path, options=ray_options,
                                   loader=functools.partial(_load_transcriber, options),
                                   record=lambda row, t, wall_s, read_s: record_of(utts[row["id"]], t, wall_s, None),
                                   on_record=on_record)
