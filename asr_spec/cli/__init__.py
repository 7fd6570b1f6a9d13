"""Command line: a thin typer layer over the library, one module per command.

    asr-spec transcribe FILES... [--preset base] [--model M] [--draft D | --no-draft] [--output-dir DIR] ...
    asr-spec transcribe --ray [--ray-address auto] [--workers N] FILES|--manifest M --output results.jsonl
    asr-spec convert CT2_DIR OUT_DIR
    asr-spec stream FILE|- [--preset base] [--speed 1] [--step-s 0.75] [--no-vad] [--no-hypothesis] [--tentative]
    asr-spec serve [--preset base] [--model M] [--draft D | --no-draft] [--host H] [--port P] ...
    asr-spec eval [--preset base] [--data-dir TREE] [--split test.clean] [--compare-greedy] ...
    asr-spec distill [--model TARGET] run | cache | train | eval | head ...

Each command parses its options and calls the same public function a Python user calls (`Transcriber`,
`run_server`, `convert_ct2`, `evaluate`, `asr_spec.distill.commands`). The options several commands share are
declared once (`asr_spec.cli.options`), and so are the exit codes: 0 done, 1 some input failed, 2 bad options or an
unusable model, data or folder (one ``error:`` line), 130 interrupted.
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from asr_spec.cli.distill import distill_app, expand_variadic
from asr_spec.cli.evaluation import eval_command
from asr_spec.cli.options import (
    BEST_OF,
    COMPRESSION_RATIO_THRESHOLD,
    DEVICE,
    DRAFT,
    EXIT_USAGE,
    HOTWORDS,
    INITIAL_PROMPT,
    LANGUAGE,
    MODEL,
    NO_DRAFT,
    PRESET,
    SEED,
    TEMPERATURE,
    THREADS,
    TRACE_STREAMS,
    USER_ERRORS,
    fail,
    interruptible,
    preset_overrides,
    start_trace,
    use_threads,
)
from asr_spec.cli.stream import stream
from asr_spec.cli.transcribe import transcribe
from asr_spec.errors import one_line
from asr_spec.logs import configure_logging

__all__ = ["app", "main"]

app = typer.Typer(
    name="asr-spec", help="Lossless batched speculative decoding for Whisper: transcribe long recordings fast.",
    add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False, rich_markup_mode=None,
)
app.command()(transcribe)
app.command()(stream)


@app.command()
def serve(  # long function: typer declares each of its ~25 options as a parameter
    preset: str = PRESET,
    model: str | None = MODEL,
    draft: str | None = DRAFT,
    no_draft: bool = NO_DRAFT,
    host: str = typer.Option("127.0.0.1", help="Address to listen on (0.0.0.0: every interface)."),
    port: int = typer.Option(8000, min=0, max=65535, help="TCP port (0..65535)."),
    batch_size: int = typer.Option(8, help="Engine rows shared by all requests' chunks."),
    max_requests: int = typer.Option(32, help="Requests in flight at once; beyond: 503 with Retry-After."),
    max_streams: int = typer.Option(16, help="Live streams (WebSocket /v1/realtime) open at once; beyond: an error "
                                    "event and close code 1013."),
    max_backlog_s: float | None = typer.Option(None, help="Seconds of a live stream's audio received and not yet "
                                               "decoded; beyond: an error event (backlog_full) and close code "
                                               "1008. Default: the server's (120 s)."),
    idle_timeout_s: float | None = typer.Option(None, help="Seconds a live stream may append no audio (while none "
                                                "of its audio is being decoded) before it gets an error event "
                                                "(idle_timeout) and is closed, freeing its place (default 60 s)."),
    catch_up: bool | None = typer.Option(None, "--catch-up/--no-catch-up", help="A live stream that is behind "
                                         "is re-decoded less often, each re-decode covering all that arrived "
                                         "(default); off: every step_s re-decoded however far behind."),
    hypothesis: bool | None = typer.Option(None, "--hypothesis/--no-hypothesis", help="A live stream's re-decode "
                                           "offers its previous hypothesis as the draft (where no model draft "
                                           "runs: fewer target passes); off (default): plain re-decoding, the same "
                                           "text."),
    step_s: float | None = typer.Option(None, help="A live stream is re-decoded after this many new seconds "
                                        "(default: the streaming policy's, 0.75 s)."),
    committed_prefix: bool | None = typer.Option(None, "--committed-prefix/--no-committed-prefix", help="A live "
                                                 "stream's re-decode forces its committed words as the decoder's "
                                                 "prefix and generates only what follows (default); off: it "
                                                 "generates its whole buffer again."),
    context_s: float | None = typer.Option(None, help="Committed audio a live stream's buffer keeps, when trimmed, "
                                           "before what is new (left context; its words forced as the prefix). "
                                           "Default: the streaming policy's (5 s); 0: none."),
    group_wait_s: float | None = typer.Option(None, help="The longest a live stream's re-decode waits for others "
                                              "to be encoded with it, while another stream's is decoding (0: "
                                              "never; default 10 s)."),
    trace_streams: Path | None = TRACE_STREAMS,
    max_audio_in_flight_s: float = typer.Option(43200.0, help="Seconds of audio in flight at once (12 h); beyond: "
                                                "503 with Retry-After."),
    max_file_mb: float = typer.Option(25.0, help="Largest upload in MB; beyond: 413."),
    max_audio_s: float = typer.Option(7200.0, help="Longest audio of one request in seconds (2 h); beyond: 413, "
                                      "from the container's header before decoding, else while decoding."),
    upload_timeout_s: float = typer.Option(120.0, help="Seconds an upload may take to arrive; beyond: 408."),
    api_key: list[str] | None = typer.Option(None, help="Require `Authorization: Bearer KEY` on every route "
                                                "but /health (repeatable; also ASR_SPEC_API_KEY, comma-separated)."),
    language: str | None = LANGUAGE,
    task: str | None = typer.Option(None, help="transcribe (POST /v1/audio/transcriptions) or translate (to "
                                    "English: POST /v1/audio/translations); one task a server. Default: the "
                                    "preset's."),
    word_timestamps: bool | None = typer.Option(None, "--word-timestamps/--no-word-timestamps",
                                                   help="Answer timestamp_granularities[]=word (verbose_json "
                                                   "`words`); needs chunking vad. Default: the preset's."),
    temperature: str | None = TEMPERATURE,
    compression_ratio_threshold: float | None = COMPRESSION_RATIO_THRESHOLD,
    best_of: int | None = BEST_OF,
    seed: int | None = SEED,
    initial_prompt: str | None = INITIAL_PROMPT,
    hotwords: str | None = HOTWORDS,
    device: str = DEVICE,
    threads: int | None = THREADS,
) -> None:
    """Serve OpenAI's POST /v1/audio/transcriptions (or, with --task translate, /v1/audio/translations) and live
    transcription (WebSocket /v1/realtime, the page at /); concurrent requests and streams share one speculative
    batch."""
    with interruptible():
        from asr_spec.serve import run_server

    use_threads(threads)
    if trace_streams is not None:
        start_trace(trace_streams)
    overrides = preset_overrides(model, draft, no_draft, language=language, task=task,
                                 word_timestamps=word_timestamps, temperature=temperature,
                                 compression_ratio_threshold=compression_ratio_threshold, best_of=best_of, seed=seed,
                                 initial_prompt=initial_prompt, hotwords=hotwords)
    try:
        run_server(preset, host=host, port=port, batch_size=batch_size, max_requests=max_requests,
                   max_streams=max_streams, max_audio_in_flight_s=max_audio_in_flight_s, max_file_mb=max_file_mb,
                   max_audio_s=max_audio_s, upload_timeout_s=upload_timeout_s, api_keys=api_key or (), device=device,
                   max_backlog_s=max_backlog_s, catch_up=catch_up, step_s=step_s, hypothesis=hypothesis,
                   committed_prefix=committed_prefix, context_s=context_s, group_wait_s=group_wait_s,
                   idle_timeout_s=idle_timeout_s, **overrides)
    except ImportError as err:
        fail(f"{one_line(err)}: install the server extra (pip install 'asr-spec[serve]')", EXIT_USAGE)
    except USER_ERRORS as err:
        fail(one_line(err), EXIT_USAGE)


@app.command()
def convert(
    ct2_dir: Path = typer.Argument(..., help="CTranslate2 Whisper directory (model.bin, config.json, tokenizer.json)."),
    out_dir: Path = typer.Argument(..., help="transformers directory to create."),
    dtype: str = typer.Option("float32", help="Weights to save: float32 (exact), float16 or bfloat16."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace OUT_DIR if it exists."),
) -> None:
    """Convert a CTranslate2 Whisper model into a transformers one (usable with --model)."""
    import torch

    from asr_spec.models.cpu import DTYPES
    from asr_spec.models.embedded import convert_ct2

    torch_dtypes = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    names = [name for name, precision in DTYPES.items() if precision in torch_dtypes]  # as --dtype spells them
    if DTYPES.get(dtype) not in torch_dtypes:
        fail(f"--dtype must be one of {', '.join(names)}, got {dtype!r}", EXIT_USAGE)
    if not ct2_dir.is_dir():  # (it said "<ct2_dir>/model.bin: no such file")
        fail(f"{ct2_dir}: {'a file, not a folder' if ct2_dir.exists() else 'no such folder'} (CT2_DIR)", EXIT_USAGE)
    if out_dir.exists() and not out_dir.is_dir():
        fail(f"{out_dir}: OUT_DIR is a file, not a folder", EXIT_USAGE)
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        fail(f"{out_dir}: OUT_DIR already exists; remove it, choose another or pass --overwrite", EXIT_USAGE)
    try:
        written = convert_ct2(ct2_dir, out_dir, dtype=torch_dtypes[DTYPES[dtype]], overwrite=overwrite)
    except USER_ERRORS as err:  # an unusable model or folder (the exit codes above)
        fail(one_line(err), EXIT_USAGE)
    typer.echo(str(written))


app.command("eval")(eval_command)
app.add_typer(distill_app, name="distill")


def main(argv: list[str] | None = None) -> None:
    """Entry point of `asr-spec` and `python -m asr_spec`. A Ctrl-C before a command catches its own (while the
    logging set-up imports transformers, the first second or so) is one line and exit 130, not a traceback."""
    with interruptible():
        configure_logging()
        args = sys.argv[1:] if argv is None else list(argv)
        if args[:1] == ["distill"]:
            args = expand_variadic(args)
        app(args=args, prog_name="asr-spec")  # typer exits 130 on a KeyboardInterrupt; `transcribe` reports it first
