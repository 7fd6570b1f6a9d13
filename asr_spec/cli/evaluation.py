"""`asr-spec eval`: the options parsed into `EvalOptions`, then
`asr_spec.eval.evaluate` (or `asr_spec.distributed.evaluate_on_ray` with --ray), and the summary table printed.

Exit codes: 0 done, 1 some utterance failed or differed from greedy, 2 bad options or data (one `error:` line on
stderr; typer's own usage errors exit 2 too), 130 interrupted.
"""

from __future__ import annotations

import warnings
from typing import Any

import typer

from asr_spec.cli.options import (
    BATCH_SIZE,
    DEVICE,
    DRAFT,
    DTYPE,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    LANGUAGE,
    MODEL,
    NO_DRAFT,
    PRESET,
    RAY,
    RAY_ADDRESS,
    THREADS_PER_WORKER,
    WORKERS,
    fail,
)
from asr_spec.errors import AsrSpecError, one_line, show_warning_line
from asr_spec.eval.options import GROUP_BATCHES, EvalOptions

__all__ = ["eval_command", "eval_main"]

EVAL_ERRORS = (AsrSpecError, ValueError, OSError, ImportError)  # bad preset/data/device, a missing extra


def _show(record: dict[str, Any]) -> None:
    if record.get("error"):
        typer.echo(f"error: {record['id']}: {record['error']}", err=True)
        return
    mark = "" if record.get("identical_to_greedy", True) else "  [DIFFERS FROM GREEDY]"
    typer.echo(f"{record['id']}  {record['audio_s']:.1f} s  {record['hyp']}{mark}", err=True)


def _run(options: EvalOptions, quiet: bool) -> dict[str, Any]:
    """The evaluation `options` describe, here or on Ray; its summary."""
    from asr_spec.eval.evaluate import evaluate

    on_record = None if quiet else _show
    with warnings.catch_warnings():
        warnings.showwarning = show_warning_line  # "warning: <message>", not a raw UserWarning and source line
        warnings.filterwarnings("ignore", message="English text normaliser built without")
        if options.ray:
            from asr_spec.distributed import evaluate_on_ray

            return evaluate_on_ray(options, on_record)
        return evaluate(options, on_record=on_record)


def _report(options: EvalOptions, summary: dict[str, Any]) -> int:
    """The summary table on stdout; the exit code."""
    from asr_spec.eval.summary import format_summary, summary_path

    split = options.split_name + (" long-form" if options.long_form else "")
    typer.echo(format_summary(summary, title=f"{options.preset_name()} on LibriSpeech {split} ({summary['log']})"))
    typer.echo(f"summary: {summary_path(summary['log'])}")
    if summary["n_failed"]:  # a rerun skips every recorded id, failed ones too: said, or it looked like a retry
        typer.echo(f"error: {summary['n_failed']} failed: their records in {summary['log']} say why; a rerun keeps "
                   "them (delete their lines to try them again)", err=True)
    differs = summary.get("n_greedy_checked", 0) - summary.get("n_identical_to_greedy", 0)
    if differs:
        typer.echo(f"error: {differs} transcripts differ from greedy decoding: speculative decoding must be lossless",
                   err=True)
    return EXIT_FAILED if summary["n_failed"] or differs else EXIT_OK


def eval_command(  # long function: typer declares each of its 20 options as a parameter
    preset: str = PRESET,
    split: str = typer.Option("test.clean", help="Hub: test.clean, test.other, validation.clean, ...; with "
                              "--data-dir: any folder of the tree (test-clean, my-split, ...)."),
    data_dir: str | None = typer.Option(None, help="Local LibriSpeech tree (holding e.g. test-clean/). Default: "
                                           "the HF hub."),
    limit: int | None = typer.Option(None, help="First N utterances (with --long-form: chapters)."),
    long_form: bool = typer.Option(False, "--long-form", help="One input per chapter, its utterances end to end."),
    compare_greedy: bool = typer.Option(False, "--compare-greedy", help="Also decode without the draft: check "
                                        "identical output, measure the speed-up."),
    batch_size: int | None = BATCH_SIZE,
    group_size: int | None = typer.Option(None, help=f"Utterances per Transcriber call. Default: {GROUP_BATCHES} "
                                             "x batch (long-form: batch)."),
    output: str | None = typer.Option(None, help="Results JSONL (default runs/<preset>-<split>.jsonl); its "
                                         "summary is written next to it as <name>.summary.json."),
    model: str | None = MODEL,
    draft: str | None = DRAFT,
    no_draft: bool = NO_DRAFT,
    device: str = DEVICE,
    dtype: str | None = DTYPE,
    language: str | None = LANGUAGE,
    no_streaming: bool = typer.Option(False, "--no-streaming", help="Hub: download the split instead of streaming "
                                      "it."),
    quiet: bool = typer.Option(False, "--quiet", help="No per-utterance lines."),
    ray: bool = RAY,
    ray_address: str | None = RAY_ADDRESS,
    workers: int | None = WORKERS,
    threads_per_worker: int | None = THREADS_PER_WORKER,
) -> None:
    """WER, CER and speed of asr-spec on LibriSpeech (hub or a local tree); resumable (one JSONL line per
    utterance, rerun with the same --output to continue)."""
    given = {name: value for name, value in (("workers", workers), ("threads_per_worker", threads_per_worker))
             if value is not None}  # not given: EvalOptions' defaults
    try:
        options = EvalOptions(preset=preset, split=split, data_dir=data_dir, limit=limit, long_form=long_form,
                              compare_greedy=compare_greedy, batch_size=batch_size, group_size=group_size,
                              output=output, model=model, draft=draft, device=None if device == "auto" else device,
                              dtype=dtype, language=language, no_draft=no_draft, streaming=not no_streaming, ray=ray,
                              ray_address=ray_address, **given)
    except AsrSpecError as err:
        fail(one_line(err), EXIT_USAGE)
    try:
        summary = _run(options, quiet)
    except KeyboardInterrupt:
        typer.echo("interrupted (rerun the same command to resume)", err=True)
        raise typer.Exit(EXIT_INTERRUPTED) from None
    except EVAL_ERRORS as err:
        fail(one_line(err), EXIT_USAGE)
    raise typer.Exit(_report(options, summary))


_eval_app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None)
_eval_app.command()(eval_command)


def eval_main(argv: list[str] | None = None, *, prog: str = "asr-spec eval") -> int:
    """`asr-spec eval ARGV` as a function (tests): the exit code, never SystemExit.
    argv None: sys.argv[1:]."""
    try:
        _eval_app(args=argv, prog_name=prog)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    return EXIT_OK
