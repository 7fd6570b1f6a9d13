"""Command line: a thin typer layer over the library.

    asr-spec transcribe FILES... [--preset base] [--model M] [--draft-model D | --no-draft] [--output-dir DIR] ...
    asr-spec convert CT2_DIR OUT_DIR

`transcribe` parses its options into the keyword arguments of `Transcriber.from_preset` and calls
`Transcriber.iter_transcribe`, exactly what a Python user would call. Transcripts go to stdout (or to files with
--output-dir), the progress bar, warnings, per-file errors and a one-line summary to stderr. Exit codes: 0 all
transcribed, 1 some input failed (each reported as ``error: <file>: <cause>``, the others still transcribed),
2 bad options, an unloadable model, an unusable --output-dir or a batch that cannot fit in memory (one line),
130 interrupted (one line: how many files were finished, and where).
"""

from __future__ import annotations

import logging
import sys
import time
import warnings
from pathlib import Path
from typing import Any, NoReturn, Optional

import typer

from asr_spec.errors import AsrSpecError, one_line

# Errors caused by what the user gave us: reported on one line, no traceback. Anything else is a bug.
USER_ERRORS = (AsrSpecError, ValueError, OSError)
EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 1, 2, 130

app = typer.Typer(
    name="asr-spec", help="Lossless batched speculative decoding for Whisper: transcribe long recordings fast.",
    add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False, rich_markup_mode=None,
)


def _fail(message: str, code: int) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def _preset_help() -> str:
    from asr_spec.models.presets import available_presets

    names = ", ".join(available_presets()) or "none installed"
    return f"Model pair and settings: a preset name ({names}) or the path of a .toml file."


@app.command()
def transcribe(
    files: list[str] = typer.Argument(..., metavar="FILE", help="Audio files (wav, flac, mp3, ogg, m4a...)."),
    preset: str = typer.Option("base", help=_preset_help()),
    model: Optional[str] = typer.Option(None, help="Target model: hub id, directory, CTranslate2 directory or "
                                        "embedded:whisper-base. Replaces the preset's (and its draft)."),
    draft_model: Optional[str] = typer.Option(None, help="Draft model (same forms). Replaces the preset's."),
    no_draft: bool = typer.Option(False, "--no-draft", help="Plain greedy decoding (same transcript, slower)."),
    device: str = typer.Option("auto", help="auto, cpu, cuda or cuda:N."),
    dtype: Optional[str] = typer.Option(None, help="auto (float16 on CUDA, float32 on CPU), float32, float16, "
                                        "bfloat16. Default: the preset's."),
    language: Optional[str] = typer.Option(None, help="Spoken language (en, english...) or auto. Default: the "
                                           "preset's."),
    task: Optional[str] = typer.Option(None, help="transcribe or translate (to English)."),
    timestamps: Optional[bool] = typer.Option(None, "--timestamps/--no-timestamps", help="Whisper timestamp mode "
                                              "(segment times from the model). Default: the preset's (on)."),
    chunk_length: Optional[float] = typer.Option(None, help="Seconds per window (at most 30). Default: the "
                                                 "preset's."),
    num_draft_tokens: Optional[int] = typer.Option(None, help="Draft tokens per step (start value)."),
    batch_size: Optional[int] = typer.Option(None, help="Chunks decoded together, across files. Default 8."),
    output_dir: Optional[Path] = typer.Option(None, help="Write <name>.<format> files here instead of printing."),
    format: Optional[str] = typer.Option(None, "--format", help="With --output-dir: comma-separated txt, json, "
                                         "srt, vtt. Default: all four."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar, no summary (errors still shown)."),
    no_speech_threshold: Optional[float] = typer.Option(None, help="Drop a window whose <|nospeech|> probability "
                                                        "exceeds this (Whisper's rule). Default 0.6."),
    logprob_threshold: Optional[float] = typer.Option(None, help="...unless its average token log-probability "
                                                      "exceeds this. Default -1.0."),
    keep_no_speech: bool = typer.Option(False, "--keep-no-speech", help="Turn the no-speech rule off: decode "
                                        "and keep every window, silent or not."),
) -> None:
    """Transcribe audio files; the transcript goes to stdout unless --output-dir is given."""
    from asr_spec.transcribe import Transcriber

    if no_draft and draft_model is not None:
        _fail("--no-draft and --draft-model contradict each other: give one", EXIT_USAGE)
    if format is not None and output_dir is None:
        _fail("--format needs --output-dir (without it the transcript is printed)", EXIT_USAGE)
    if keep_no_speech and no_speech_threshold is not None:
        _fail("--keep-no-speech and --no-speech-threshold contradict each other: give one", EXIT_USAGE)
    given = {
        "target": model, "draft": draft_model, "dtype": dtype, "language": language, "task": task,
        "chunk_length_s": chunk_length, "num_draft_tokens": num_draft_tokens, "batch_size": batch_size,
        "formats": format, "timestamps": timestamps, "no_speech_threshold": no_speech_threshold,
        "logprob_threshold": logprob_threshold,
    }
    overrides: dict[str, Any] = {key: value for key, value in given.items() if value is not None}
    if no_draft:
        overrides["draft"] = None
    if keep_no_speech:
        overrides["no_speech_threshold"] = None
    run = _Run(len(files), output_dir)
    try:
        if output_dir is not None:  # before any model loads: the folder usable, names distinct, stale temps gone
            from asr_spec.transcribe.outputs import output_stems, prepare_output_dir

            output_stems(files)
            prepare_output_dir(output_dir)
        transcriber = Transcriber.from_preset(preset, device=device, **overrides)
    except USER_ERRORS as err:
        _fail(one_line(err), EXIT_USAGE)
    except KeyboardInterrupt:
        run.interrupted()
    try:
        for result in transcriber.iter_transcribe(files, progress=False if quiet else None, output_dir=output_dir):
            run.add(result)
    except USER_ERRORS as err:  # raised before any input is read, or a run that cannot fit in memory
        _fail(one_line(err), EXIT_USAGE)
    except KeyboardInterrupt:
        run.interrupted()
    if not quiet:
        typer.echo(run.summary(), err=True)
    if run.n_failed:
        raise typer.Exit(EXIT_FAILED)


class _Run:
    """What a `transcribe` command has done so far: printed, counted and summed as each file finishes."""

    def __init__(self, n_files: int, output_dir: Path | None):
        self.n_files, self.output_dir = n_files, output_dir
        self.n_done = self.n_failed = self.n_dropped = 0
        self.audio_s, self.stats, self.start = 0.0, [], time.perf_counter()

    def add(self, result: Any) -> None:
        self.n_done += 1
        if result.error is not None:
            self.n_failed += 1
            typer.echo(f"error: {result.source}: {result.error}", err=True)
            return
        self.audio_s += result.audio_s
        self.stats.append(result.stats)
        self.n_dropped += result.n_dropped
        if self.output_dir is None:
            if self.n_files > 1:
                typer.echo(f"==> {result.source} <==")
            typer.echo(result.text)
            sys.stdout.flush()

    def interrupted(self) -> NoReturn:
        """Ctrl-C: one line saying what is finished and where, exit 130. (typer turns a KeyboardInterrupt that
        escapes a command into a silent exit 130, so it is caught here, where the counts are known.)"""
        where = f"outputs in {self.output_dir}" if self.output_dir is not None else "printed above"
        ok = self.n_done - self.n_failed
        typer.echo(f"\ninterrupted: {ok} of {self.n_files} files finished ({where})", err=True)
        raise typer.Exit(EXIT_INTERRUPTED)

    def summary(self) -> str:
        from asr_spec.engine import ChunkStats

        stats = ChunkStats.total(self.stats)
        wall_s = time.perf_counter() - self.start
        files = f"{self.n_files - self.n_failed}/{self.n_files} files"
        files += f" ({self.n_failed} failed)" if self.n_failed else ""
        rtfx = self.audio_s / wall_s if wall_s > 0 else 0.0
        speed = f"{self.audio_s:.1f} s audio in {wall_s:.1f} s (RTFx {rtfx:.1f})"
        if stats.drafted_tokens:
            drafting = f"acceptance {stats.acceptance_rate:.1%}, {stats.tokens_per_target_pass:.2f} tokens/target pass"
        else:
            drafting = "greedy (no draft), 1.00 tokens/target pass"
        dropped = f", {self.n_dropped} windows without speech left out" if self.n_dropped else ""
        return f"{files}: {speed}, {drafting}{dropped}"



@app.command()
def convert(
    ct2_dir: Path = typer.Argument(..., help="CTranslate2 Whisper directory (model.bin, config.json, tokenizer.json)."),
    out_dir: Path = typer.Argument(..., help="transformers directory to create."),
    dtype: str = typer.Option("float32", help="Weights to save: float32 (exact), float16 or bfloat16."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace OUT_DIR if it exists."),
) -> None:
    """Convert a CTranslate2 Whisper model into a transformers one (usable with --model)."""
    import torch

    from asr_spec.models.embedded import convert_ct2

    torch_dtypes = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    if dtype not in torch_dtypes:
        _fail(f"--dtype must be one of {', '.join(torch_dtypes)}, got {dtype!r}", EXIT_USAGE)
    try:
        written = convert_ct2(ct2_dir, out_dir, dtype=torch_dtypes[dtype], overwrite=overwrite)
    except USER_ERRORS as err:
        _fail(one_line(err), EXIT_FAILED)
    typer.echo(str(written))


@app.command("eval", context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
             add_help_option=False)
def eval_(ctx: typer.Context) -> None:
    """WER, RTFx and speculative statistics on LibriSpeech (hub or a local tree); `asr-spec eval --help`."""
    from asr_spec.eval.evaluate import eval_main

    raise typer.Exit(eval_main(ctx.args))


@app.command("distill", context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
             add_help_option=False)
def distill(ctx: typer.Context) -> None:
    """Train a draft for a target by distillation (run | cache | train | eval); `asr-spec distill --help`."""
    from asr_spec.distill.cli import main as distill_main

    raise typer.Exit(distill_main(ctx.args, prog="asr-spec distill"))


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is when a message comes (the CLI may be run in-process under redirection)."""

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


_LOG_HANDLER = _StderrHandler()


def _configure_logging() -> None:
    """Warnings as one stderr line each; no library progress bars or chatter besides our own."""
    package = logging.getLogger("asr_spec")
    if _LOG_HANDLER not in package.handlers:
        _LOG_HANDLER.setFormatter(logging.Formatter("warning: %(message)s"))
        package.addHandler(_LOG_HANDLER)
    package.setLevel(logging.WARNING)
    package.propagate = False
    warnings.formatwarning = lambda message, *args, **kwargs: f"warning: {message}\n"
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:  # pragma: no cover - transformers is a dependency
        pass


def main(argv: list[str] | None = None) -> None:
    """Entry point of `asr-spec` and `python -m asr_spec`."""
    _configure_logging()
    app(args=argv, prog_name="asr-spec")  # typer exits 130 on a KeyboardInterrupt; `transcribe` reports it first
