"""`asr-spec stream FILE|-`: live transcription from the command line, the policy of `Transcriber.stream`.

A file is read at `--speed` times real time (0: as fast as the decoding goes), `-` reads raw PCM16 16 kHz mono
from stdin as it comes. Committed text goes to stdout as soon as it is stable (no newline until the end);
`--tentative` also shows the uncommitted rest on stderr. Exit codes: 0 done, 2 bad options, an unusable model or
input (one ``error:`` line), 130 interrupted.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import typer

from asr_spec.cli.options import (
    DEVICE,
    DRAFT,
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    LANGUAGE,
    MODEL,
    NO_DRAFT,
    PRESET,
    THREADS,
    TRACE_STREAMS,
    USER_ERRORS,
    fail,
    interruptible,
    preset_overrides,
    start_trace,
    use_threads,
)
from asr_spec.errors import InputError, one_line
from asr_spec.stream.options import StreamOptions

__all__ = ["stream"]

SAMPLE_RATE = 16_000


def stream(
    source: str = typer.Argument(..., metavar="FILE|-", help="An audio file, or - for raw PCM16 16 kHz mono on "
                                 "stdin."),
    preset: str = PRESET,
    model: str | None = MODEL,
    draft: str | None = DRAFT,
    no_draft: bool = NO_DRAFT,
    language: str | None = LANGUAGE,
    device: str = DEVICE,
    speed: float = typer.Option(1.0, help="A file is fed at this many times real time; 0: as fast as possible."),
    step_s: float = typer.Option(StreamOptions().step_s, help="Re-decode the uncommitted audio after this many new "
                                 "seconds."),
    no_vad: bool = typer.Option(False, "--no-vad", help="No voice activity: utterances are not closed at silence."),
    no_hypothesis: bool = typer.Option(False, "--no-hypothesis", help="Plain re-decoding: do not offer the previous "
                                       "hypothesis as the draft (the same text, more target passes)."),
    tentative: bool = typer.Option(False, "--tentative", help="Also show the uncommitted text on stderr."),
    trace_streams: Path | None = TRACE_STREAMS,
    threads: int | None = THREADS,
) -> None:
    """Transcribe a live stream: committed text is printed as it becomes stable."""
    with interruptible():
        from asr_spec import allocator
        from asr_spec.transcribe import Transcriber

    if math.isnan(speed) or speed < 0:
        fail(f"--speed must be >= 0, got {speed}", EXIT_USAGE)
    use_threads(threads)
    allocator.pin()  # a process of its own, as `transcribe`
    if trace_streams is not None:
        start_trace(trace_streams)
    try:
        options = StreamOptions(step_s=step_s)
        asr = Transcriber.from_preset(preset, **preset_overrides(model, draft, no_draft, language=language,
                                                                 device=device, batch_size=1))
        blocks = _stdin_blocks(step_s) if source == "-" else _file_blocks(source, step_s, speed)
        runner = asr.streams(options, vad=not no_vad, batch_size=1, offer_hypothesis=not no_hypothesis)
        if _run(runner, blocks, tentative):
            fail("interrupted (what was heard is transcribed above)", EXIT_INTERRUPTED)
    except KeyboardInterrupt:  # before the stream ran, or a second Ctrl-C while it finished
        typer.echo("", err=False)
        fail("interrupted", EXIT_INTERRUPTED)
    except USER_ERRORS as err:
        fail(one_line(err), EXIT_USAGE)


TENTATIVE_CHARS = 190  # the end of the uncommitted text --tentative shows on its one line


def _run(runner, blocks: Iterator[np.ndarray], tentative: bool) -> bool:
    """Stream `blocks` through `runner`, printing committed text as it comes; True when Ctrl-C ended the input.
    Ctrl-C ends the input, as its end would: what was heard is finished and printed (the only way to stop
    `arecord ... | asr-spec stream -`; the words not yet committed were lost); a second Ctrl-C aborts."""
    stream = runner.open()
    wrote = False

    def show(updates) -> None:
        nonlocal wrote
        for _, update in updates:
            text = update.delta if wrote else update.delta.lstrip()  # the line opens with a word, as offline
            if text:
                wrote = True
                sys.stdout.write(text)
                sys.stdout.flush()
            if tentative and not update.final:  # the text's end (the line's opening redraw code kept)
                sys.stderr.write(f"\r\x1b[K… {update.tentative.strip()[-TENTATIVE_CHARS:]}")
                sys.stderr.flush()

    broken, interrupted = None, False
    try:
        for block in blocks:
            stream.feed(block)
            show(runner.pump())
    except USER_ERRORS as err:  # the input broke off: what it gave is still transcribed to its end, then reported
        broken = err
    except KeyboardInterrupt:
        interrupted = True
    stream.finish()
    while not stream.done:
        updates = runner.pump()  # decodes all that is due: nothing is in flight after it
        if not updates:  # so none would ever come (a bug of the policy): stop, not spin
            break
        show(updates)
    if tentative:
        sys.stderr.write("\r\x1b[K")
    if wrote or broken is None:  # a transcript's line end; an input refused at its first block printed nothing
        sys.stdout.write("\n")
        sys.stdout.flush()
    if broken is not None:
        raise broken
    return interrupted


def _file_blocks(path: str, step_s: float, speed: float) -> Iterator[np.ndarray]:
    """The file's samples in blocks of step_s, each given no earlier than its end time / speed after the start."""
    from asr_spec.audio.loading import stream_audio

    start, fed_s = time.monotonic(), 0.0
    for block in stream_audio(path, block_s=step_s):
        fed_s += len(block) / SAMPLE_RATE
        if speed > 0:
            time.sleep(max(0.0, start + fed_s / speed - time.monotonic()))
        yield block


def _stdin_blocks(step_s: float) -> Iterator[np.ndarray]:
    """Raw little-endian PCM16 mono 16 kHz from stdin, step_s at a time (the last block may be shorter); a WAV
    file of just those samples is read past its header (`_raw_samples`)."""
    n_bytes = int(step_s * SAMPLE_RATE) * 2
    pipe = sys.stdin.buffer
    rest, first = b"", True
    while True:
        data = pipe.read(n_bytes)
        if not data:
            break
        if first:
            data = _raw_samples(data)
        data, first = rest + data, False
        usable = len(data) // 2 * 2
        rest = data[usable:]
        yield np.frombuffer(data[:usable], dtype="<i2").astype(np.float32) / 32768.0
    if rest:
        raise InputError("stdin: an odd number of bytes: not PCM16")


def _raw_samples(head: bytes) -> bytes:
    """The first bytes read from stdin as raw PCM16: a 16 kHz mono PCM16 WAV's header is skipped (`arecord`
    without `-t raw`); the header of any other encoded file is refused (its coded bytes read as samples are noise,
    and the stream "transcribed" to nothing, exit 0)."""
    from asr_spec.audio.opening import container_of, pcm16_wav_payload

    kind = container_of(head)
    if kind is None:
        return head
    payload = pcm16_wav_payload(head)
    if payload is not None:
        return head[payload:]
    raise InputError(f"stdin: looks like {kind}, not raw PCM16 16 kHz mono: decode it first (ffmpeg -i FILE -f s16le "
                     "-ac 1 -ar 16000 -), or give the file's path")
