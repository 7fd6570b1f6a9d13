"""Command line: a thin typer layer over the library.

    asr-spec transcribe FILES... [--preset base] [--model M] [--draft-model D | --no-draft] [--output-dir DIR] ...
    asr-spec convert CT2_DIR OUT_DIR

`transcribe` parses its options into the keyword arguments of `Transcriber.from_preset` and calls
`Transcriber.iter_transcribe`, exactly what a Python user would call. Transcripts go to stdout (or to files with
--output-dir), the progress bar, warnings, per-file errors and a one-line summary to stderr. Exit codes: 0 all
transcribed, 1 some input failed (each reported as ``error: <file>: <cause>``, the others still transcribed),
2 bad options (one line), 130 interrupted.
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
    chunking: Optional[str] = typer.Option(None, help="vad (speech chunks found by silero-vad; silence skipped) "
                                           "or stride (overlapping windows stitched at the seams). Default: the "
                                           "preset's."),
    word_timestamps: Optional[bool] = typer.Option(None, "--word-timestamps/--no-word-timestamps",
                                                   help="Per-word times in the json output (needs --chunking "
                                                   "vad). Default: the preset's (off)."),
    max_words_per_cue: Optional[int] = typer.Option(None, help="srt/vtt cues of at most N words (needs "
                                                    "--word-timestamps). Default: one cue per segment."),
    num_draft_tokens: Optional[int] = typer.Option(None, help="Draft tokens per step (start value)."),
    batch_size: Optional[int] = typer.Option(None, help="Chunks decoded together, across files. Default 8."),
    output_dir: Optional[Path] = typer.Option(None, help="Write <name>.<format> files here instead of printing."),
    format: Optional[str] = typer.Option(None, "--format", help="With --output-dir: comma-separated txt, json, "
                                         "srt, vtt. Default: all four."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar, no summary (errors still shown)."),
) -> None:
    """Transcribe audio files; the transcript goes to stdout unless --output-dir is given."""
    from asr_spec.engine import ChunkStats
    from asr_spec.transcribe import Transcriber

    if no_draft and draft_model is not None:
        _fail("--no-draft and --draft-model contradict each other: give one", EXIT_USAGE)
    if format is not None and output_dir is None:
        _fail("--format needs --output-dir (without it the transcript is printed)", EXIT_USAGE)
    given = {
        "target": model, "draft": draft_model, "dtype": dtype, "language": language, "task": task,
        "chunk_length_s": chunk_length, "num_draft_tokens": num_draft_tokens, "batch_size": batch_size,
        "formats": format, "timestamps": timestamps, "chunking": chunking, "word_timestamps": word_timestamps,
        "max_words_per_cue": max_words_per_cue,
    }
    overrides: dict[str, Any] = {key: value for key, value in given.items() if value is not None}
    if no_draft:
        overrides["draft"] = None
    try:
        transcriber = Transcriber.from_preset(preset, device=device, **overrides)
    except USER_ERRORS as err:
        _fail(one_line(err), EXIT_USAGE)

    n_failed, audio_s, stats, start = 0, 0.0, [], time.perf_counter()
    try:
        for result in transcriber.iter_transcribe(files, progress=False if quiet else None, output_dir=output_dir):
            if result.error is not None:
                n_failed += 1
                typer.echo(f"error: {result.source}: {result.error}", err=True)
                continue
            audio_s += result.audio_s
            stats.append(result.stats)
            if output_dir is None:
                if len(files) > 1:
                    typer.echo(f"==> {result.source} <==")
                typer.echo(result.text)
                sys.stdout.flush()
    except USER_ERRORS as err:  # raised before any input is read (e.g. two inputs with the same output name)
        _fail(one_line(err), EXIT_USAGE)
    wall_s = time.perf_counter() - start
    if not quiet:
        typer.echo(_summary(len(files), n_failed, audio_s, wall_s, ChunkStats.total(stats)), err=True)
    if n_failed:
        raise typer.Exit(EXIT_FAILED)


def _summary(n_files: int, n_failed: int, audio_s: float, wall_s: float, stats: Any) -> str:
    files = f"{n_files - n_failed}/{n_files} files" + (f" ({n_failed} failed)" if n_failed else "")
    speed = f"{audio_s:.1f} s audio in {wall_s:.1f} s (RTFx {audio_s / wall_s if wall_s > 0 else 0.0:.1f})"
    if stats.drafted_tokens:
        drafting = f"acceptance {stats.acceptance_rate:.1%}, {stats.tokens_per_target_pass:.2f} tokens/target pass"
    else:
        drafting = "greedy (no draft), 1.00 tokens/target pass"
    return f"{files}: {speed}, {drafting}"



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
    try:
        app(args=argv, prog_name="asr-spec")
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        sys.exit(EXIT_INTERRUPTED)
