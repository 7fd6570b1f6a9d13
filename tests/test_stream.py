"""Streams through the engine (stream/driver.py, Transcriber.streams / stream, `asr-spec stream`) with the tiny
random Whisper of the real vocabulary: offering the previous hypothesis changes nothing but the passes, streams
sharing one engine get what each gets alone, and the CLI prints what the Python API gives."""

from __future__ import annotations

import functools
import logging
import re

import numpy as np
import pytest
from test_transcribe import LONG, save_tiny_models, transcriber
from typer.testing import CliRunner

from asr_spec.audio.loading import SAMPLE_RATE, load_audio
from asr_spec.cli import app
from asr_spec.stream.policy import StreamOptions

SECONDS = 6
FAST = dict(max_new_tokens=12, num_hypothesis_tokens=6)  # a tiny model's decodes, kept short
OPTIONS = StreamOptions(step_s=1.0, max_buffer_s=4.0, context_s=2.0)  # short buffers: many trims, context kept


@functools.cache
def _audio() -> np.ndarray:
    return load_audio(str(LONG))[: SECONDS * SAMPLE_RATE]


def run(offer: bool, n_streams: int = 1, block_s: float = 1.0):
    """Feed n_streams streams (the same audio, each from a different offset) block by block; returns each
    stream's updates and the runner's stats."""
    runner = transcriber(speculative=False, **FAST).streams(OPTIONS, vad=False, batch_size=4, offer_hypothesis=offer)
    audio = [np.roll(_audio(), i * 2 * SAMPLE_RATE) for i in range(n_streams)]
    streams = [runner.open() for _ in range(n_streams)]
    updates = {s.id: [] for s in streams}
    block = int(block_s * SAMPLE_RATE)
    for i in range(0, len(audio[0]), block):
        for stream, a in zip(streams, audio):
            stream.feed(a[i:i + block])
        for stream, update in runner.pump():
            updates[stream.id].append(update)
    for stream in streams:
        stream.finish()
    while runner.streams:
        for stream, update in runner.pump():
            updates[stream.id].append(update)
    return [updates[s.id] for s in streams], runner.stats


def test_offering_the_hypothesis_changes_only_the_passes():
    with_hyp, stats = run(True)
    plain, plain_stats = run(False)
    assert with_hyp == plain  # every update (delta, tentative, text) the same: each decode gave greedy's tokens
    final = with_hyp[0][-1]
    assert final.final and final.text.strip()
    assert stats.generated_tokens == plain_stats.generated_tokens
    assert stats.hypothesis_accepted > 0 and plain_stats.hypothesis_offered == 0
    assert stats.target_passes < plain_stats.target_passes


def test_streams_sharing_the_engine_get_what_each_gets_alone():
    together, _ = run(True, n_streams=3)
    alone, _ = run(True, n_streams=1)
    assert alone[0] == together[0] and together[1] != together[0]


def test_transcriber_stream_yields_the_same_text():
    blocks = (_audio()[i:i + 8000] for i in range(0, len(_audio()), 8000))
    updates = list(transcriber(speculative=False, **FAST).stream(blocks, OPTIONS, vad=False))
    assert updates[-1].final
    assert "".join(u.delta for u in updates) == updates[-1].text


@pytest.mark.slow
def test_cli_prints_the_committed_text(tmp_path):
    target_dir, _ = save_tiny_models(tmp_path)
    wav = tmp_path / "in.raw"
    pcm = (np.clip(_audio(), -1, 1) * 32767).astype("<i2")
    wav.write_bytes(pcm.tobytes())
    cli = CliRunner()
    args = ["stream", "--model", str(target_dir), "--language", "en", "--no-vad", "--speed", "0", "--device", "cpu"]
    from_stdin = cli.invoke(app, args + ["-"], input=pcm.tobytes())
    assert from_stdin.exit_code == 0, from_stdin.output
    flac = tmp_path / "in.flac"
    import soundfile as sf

    sf.write(flac, pcm, SAMPLE_RATE)
    from_file = cli.invoke(app, args + [str(flac)])
    assert from_file.exit_code == 0, from_file.output
    assert from_file.stdout.strip() and from_file.stdout == from_stdin.stdout
    bad = cli.invoke(app, args[:-4] + ["--speed", "-1", str(flac)])
    assert bad.exit_code == 2 and "--speed" in bad.output
    not_a_number = cli.invoke(app, args[:-4] + ["--speed", "nan", str(flac)])
    assert not_a_number.exit_code == 2 and "--speed" in not_a_number.output
    # input that breaks off (one odd byte after the samples): what it gave is transcribed to its end, then reported
    broken = cli.invoke(app, args + ["-"], input=pcm.tobytes() + b"\x00")
    assert broken.exit_code == 2 and "odd number of bytes" in broken.output
    assert broken.stdout.startswith(from_stdin.stdout.rstrip("\n"))
    trace = tmp_path / "traces" / "stream.log"  # its folder is made
    logger = logging.getLogger("asr_spec.stream.policy")
    try:
        traced = cli.invoke(app, args + ["--trace-streams", str(trace), str(flac)])
        assert traced.exit_code == 0 and traced.stdout == from_file.stdout, traced.output
        assert "decode 1 " not in traced.output  # to the file only
        lines = trace.read_text().splitlines()
        assert lines and all(re.match(r"\d+ ms stream 0 decode \d+ \((step|overflow|close)\) of ", line)
                             for line in lines), lines[:3]
        assert "final" in lines[-1] and "decode 1 " in lines[0]
        unwritable = cli.invoke(app, args + ["--trace-streams", str(flac / "x.log"), str(flac)])
        assert unwritable.exit_code == 2 and "--trace-streams" in unwritable.output
    finally:  # the trace is the process's: leave the logger as it was
        for handler in list(logger.handlers):
            logger.removeHandler(handler)
            handler.close()
        logger.setLevel(logging.NOTSET)
        logger.propagate = True


def test_token_kinds_start_words_as_word_times_do():
    """A live stream agrees on and commits whole words: with whisper's tokenizer a token starts a word by the rule
    of word times and seams (`agreement.starts_word`): " the" does, "ing" does not, and a Chinese or Japanese
    character does (they were all one word up to a pause before, so their text was committed seconds late)."""
    from asr_spec.models.loading import load_processor
    from asr_spec.stream.driver import token_kinds

    tokenizer = load_processor("embedded:whisper-base").tokenizer
    eot = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    kinds = token_kinds(tokenizer, eot, eot + 1, 223)

    def first(text: str) -> int:
        return tokenizer.encode(text, add_special_tokens=False)[0]

    assert kinds.word_start[first(" the")] and not kinds.word_start[first("ing")]
    assert kinds.word_start[first("我")] and kinds.word_start[first("。")] and kinds.word_start[first("い")]
    assert not kinds.word_start[eot]


def _fed_then(blocks, ending):
    yield from blocks
    if ending is not None:
        raise ending


def test_ctrl_c_ends_the_input_and_what_was_heard_is_printed(capsys):
    """`arecord ... | asr-spec stream -` stops only by Ctrl-C, which skipped the stream's finish: the words not yet
    committed (heard before it) were never printed."""
    from asr_spec.cli.stream import _run

    blocks = [_audio()[i:i + SAMPLE_RATE] for i in range(0, 4 * SAMPLE_RATE, SAMPLE_RATE)]
    printed = {}
    for ending in (None, KeyboardInterrupt()):
        runner = transcriber(speculative=False, **FAST).streams(OPTIONS, vad=False, batch_size=1)
        interrupted = _run(runner, _fed_then(blocks, ending), tentative=False)
        printed[ending is None] = capsys.readouterr().out
        assert interrupted is (ending is not None)
    assert printed[False].strip() and printed[False] == printed[True]


def test_tentative_text_is_redrawn_on_its_line_however_long(capsys):
    """A tentative text over ~195 characters lost the line's opening redraw code: updates piled up on one line."""
    from types import SimpleNamespace

    from asr_spec.cli.stream import _run

    long_text = " ".join(f"word{i}" for i in range(60))
    updates = [SimpleNamespace(delta="", final=False, tentative=long_text[:n]) for n in (250, 300, 350)]

    class Runner:
        def open(self):
            self.stream = SimpleNamespace(feed=lambda block: None, finish=lambda: None, done=True)
            return self.stream

        def pump(self):
            return [(self.stream, updates.pop(0))] if updates else []

    _run(Runner(), iter([np.zeros(10, np.float32)] * 3), tentative=True)
    err = capsys.readouterr().err
    assert err.count("\r\x1b[K… ") == 3 and err.endswith("\r\x1b[K")
