"""What the `asr-spec` commands share: exit codes, the one-line failure, and each common option declared once.

Exit codes of every command: 0 done, 1 some input failed (each reported on its own ``error:`` line, the others
still done), 2 bad options or an unusable model, data or folder (one ``error:`` line; typer's own usage errors
exit 2 too), 130 interrupted.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any, NoReturn

import typer

from asr_spec.errors import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, AsrSpecError

__all__ = ["BATCH_SIZE", "BEST_OF", "COMPRESSION_RATIO_THRESHOLD", "DEVICE", "DRAFT", "DTYPE", "EXIT_FAILED",
           "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_USAGE", "HOTWORDS", "INITIAL_PROMPT", "LANGUAGE", "MODEL", "NO_DRAFT",
           "PRESET", "RAY", "RAY_ADDRESS", "SEED", "TEMPERATURE", "THREADS", "TRACE_STREAMS", "USER_ERRORS", "WORKERS",
           "fail", "interruptible", "preset_overrides", "start_trace", "use_threads"]

# Errors caused by what the user gave us: reported on one line, no traceback. Anything else is a bug.
USER_ERRORS = (AsrSpecError, ValueError, OSError, MemoryError)  # MemoryError: engine.ResourceError


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """The command line's start and a command's own imports (torch, transformers: a second or more): a Ctrl-C
    there is one line, `interrupted`, exit 130 (typer turns a KeyboardInterrupt that escapes a command into a
    silent exit 130; SystemExit passes through it)."""
    try:
        yield
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        raise SystemExit(EXIT_INTERRUPTED) from None


def fail(message: str, code: int) -> NoReturn:
    """One ``error: MESSAGE`` line on stderr, then exit with `code`."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, as a shell reports a filter whose reader went away


def reader_gone() -> NoReturn:
    """stdout's reader went away (`asr-spec transcribe ... | head -1`): exit quietly as Unix filters do, not with
    "error: [Errno 32] Broken pipe" and exit 2. stdout is pointed at /dev/null so Python's own flush at exit
    raises no second error."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    raise typer.Exit(EXIT_BROKEN_PIPE)


def start_trace(path: os.PathLike) -> None:
    """--trace-streams: the live streams' trace appended to `path` (`asr_spec.logs.trace_streams`); a path that
    cannot be written fails in one line before anything loads."""
    from asr_spec.logs import trace_streams

    try:
        trace_streams(path)
    except OSError as err:
        fail(f"--trace-streams {path}: cannot write there ({err.strerror or err})", EXIT_USAGE)


def _preset_help() -> str:
    from asr_spec.models.presets import available_presets

    names = ", ".join(available_presets()) or "none installed"
    return f"Model pair and settings: a preset name ({names}) or the path of a .toml file."


# The options of `transcribe`, `serve` and `eval` (the same name, default and meaning in each).
PRESET = typer.Option("base", help=_preset_help())
TRACE_STREAMS = typer.Option(None, help="Append a line per live re-decode result to this file: its audio, the "
                             "hypothesis with timestamps, what it committed (to see why a stream's text is what it "
                             "is).")
MODEL = typer.Option(None, help="Model: hub id, directory, CTranslate2 directory or embedded:whisper-base. "
                     "Replaces the preset's (and its draft).")
DRAFT = typer.Option(None, help="Draft model (same forms). Replaces the preset's.")
NO_DRAFT = typer.Option(False, "--no-draft", help="Plain greedy decoding (same transcript, slower).")
DEVICE = typer.Option("auto", help="auto, cpu, cuda or cuda:N.")
DTYPE = typer.Option(None, help="auto (float16 on CUDA; on a CPU bfloat16 where its products are native and "
                     "row-invariant, so speculative == bf16 greedy token for token; int8 on an AVX2-only CPU; else "
                     "float32: docs/cpu.md), float32, float16, bfloat16, int8 (fp32 weights, the encoder's products "
                     "in int8). Default: the preset's.")
LANGUAGE = typer.Option(None, help="Spoken language (en, english...) or auto (detected: once per "
                        "file, per re-decode in a live stream). Default: the preset's.")
BATCH_SIZE = typer.Option(None, help="Chunks decoded together, across files. Default: TranscribeOptions' (presets "
                          "set none).")
RAY = typer.Option(False, "--ray", help="Run on a Ray cluster (pip install 'asr-spec[ray]'): one JSONL record per "
                   "input in --output, resumable.")
RAY_ADDRESS = typer.Option(None, help="With --ray: the cluster (auto, ray://host:10001). Default: RAY_ADDRESS, else "
                           "a local Ray on this machine.")
WORKERS = typer.Option(None, help="With --ray: transcription actors (one per GPU on GPU machines). Default 1.")
THREADS = typer.Option(None, help="torch CPU threads of this process (openai-whisper's --threads). Default: "
                       "torch's, one per core (or OMP_NUM_THREADS); fewer leave cores to other work.")
THREADS_PER_WORKER = typer.Option(None, help="With --ray: torch threads of each CPU actor. Default 1.")

# Decoding options of `transcribe` and `serve` (for the server: the default of requests that set none).
TEMPERATURE = typer.Option(None, help="Temperature fallback: comma-separated increasing temperatures in [0, 1]; a "
                           "window failing the thresholds is decoded again at the next (openai-whisper: "
                           "0,0.2,0.4,0.6,0.8,1.0). 0 alone: greedy only. Default 0.")
COMPRESSION_RATIO_THRESHOLD = typer.Option(None, help="Fallback when a window's text compresses (zlib) by more "
                                           "than this. Default 2.4.")
BEST_OF = typer.Option(None, help="Candidates per window at a temperature > 0 (rows of the same batch); the "
                       "likeliest is kept. Default 5.")
SEED = typer.Option(None, help="Seed of the sampled windows: the same seed and models give the same transcript "
                    "(docs/decoding.md: Temperature fallback). Default 0.")
INITIAL_PROMPT = typer.Option(None, help="Previous text given to every chunk (after <|startofprev|>, its last 223 "
                              "tokens): names, terms, style. With serve, every re-decode of a live stream gets it "
                              "too.")
HOTWORDS = typer.Option(None, help="Hint phrases (faster-whisper's): before the initial prompt, on every chunk but "
                        "one with a prefix. With serve, every re-decode of a live stream gets them too.")


def use_threads(threads: int | None) -> None:
    """--threads: this process's torch CPU threads, set before any model loads (None: torch's default); under 1 a
    usage error (torch's own was a RuntimeError traceback)."""
    if threads is None:
        return
    if threads < 1:
        fail(f"--threads {threads}: must be at least 1", EXIT_USAGE)
    import torch

    torch.set_num_threads(threads)


def preset_overrides(model: str | None, draft: str | None, no_draft: bool, **options: Any) -> dict[str, Any]:
    """`Transcriber.from_preset` keyword arguments from the model options and the options given (None = not given)."""
    if no_draft and draft is not None:
        fail("--no-draft and --draft contradict each other: give one", EXIT_USAGE)
    given = {"model": model, "draft": draft, **options}
    chosen = {key: value for key, value in given.items() if value is not None}
    if no_draft:
        chosen["draft"] = None
    return chosen
