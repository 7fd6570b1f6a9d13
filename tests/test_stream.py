"""Streams through the engine (stream/driver.py, Transcriber.streams / stream, `asr-spec stream`) with the tiny
random Whisper of the real vocabulary: offering the previous hypothesis changes nothing but the passes, streams
sharing one engine get what each gets alone, and the CLI prints what the Python API gives."""

from __future__ import annotations

import functools
import io
import logging
import os
import re
import signal

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
    # a file piped whole where raw PCM16 goes: one line naming it (it gave an empty transcript and exit 0); a
    # 16 kHz mono PCM16 WAV (arecord without -t raw) is read past its header, as the raw samples
    piped = cli.invoke(app, args + ["-"], input=flac.read_bytes())
    assert piped.exit_code == 2 and "stdin: looks like a FLAC file, not raw PCM16" in piped.output
    assert piped.stdout == ""  # refused at its first block: no empty transcript line
    wav = io.BytesIO()
    sf.write(wav, pcm, SAMPLE_RATE, format="WAV", subtype="PCM_16")
    as_wav = cli.invoke(app, args + ["-"], input=wav.getvalue())
    assert as_wav.exit_code == 0 and as_wav.stdout == from_stdin.stdout, as_wav.output
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


class _ScriptedRunner:
    """A stream runner whose pump() gives `updates` one at a time (the CLI's printing without a model)."""

    def __init__(self, updates: list) -> None:
        self.updates = updates

    def open(self):
        from types import SimpleNamespace

        self.stream = SimpleNamespace(feed=lambda block: None, finish=lambda: None, done=True)
        return self.stream

    def pump(self):
        return [(self.stream, self.updates.pop(0))] if self.updates else []


def test_tentative_text_is_redrawn_on_its_line_however_long(capsys):
    """A tentative text over ~195 characters lost the line's opening redraw code: updates piled up on one line."""
    from types import SimpleNamespace

    from asr_spec.cli.stream import _run

    long_text = " ".join(f"word{i}" for i in range(60))
    updates = [SimpleNamespace(delta="", final=False, tentative=long_text[:n]) for n in (250, 300, 350)]

    _run(_ScriptedRunner(updates), iter([np.zeros(10, np.float32)] * 3), tentative=True)
    err = capsys.readouterr().err
    assert err.count("\r\x1b[K… ") == 3 and err.endswith("\r\x1b[K")


def test_the_printed_line_opens_with_a_word(capsys):
    """Whisper's text starts with a space: `asr-spec stream` printed " The quick brown fox ..." (offline text is
    stripped); a delta of spaces alone before the first word is not a start either."""
    from types import SimpleNamespace

    from asr_spec.cli.stream import _run

    updates = [SimpleNamespace(delta=d, final=False, tentative="") for d in (" ", " The quick", " brown fox.")]

    _run(_ScriptedRunner(updates), iter([np.zeros(10, np.float32)] * 3), tentative=False)
    assert capsys.readouterr().out == "The quick brown fox.\n"


def _pump_until_done(runner, streams, most: int = 20) -> list:
    """pump() until every one of `streams` is done (at most `most` times: a stream left waiting fails, not hangs)."""
    updates = []
    for _ in range(most):
        if all(s.done for s in streams):
            break
        updates += runner.pump()
    return updates


def _interrupted_on(runner, call: int) -> None:
    """The runner's engine session raises KeyboardInterrupt on its `call`-th run (Ctrl-C while it decodes)."""
    real, calls = runner.session.run, [0]

    def run(*args, **kwargs):
        calls[0] += 1
        if calls[0] == call:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    runner.session.run = run


def test_ctrl_c_during_a_decode_loses_nothing():
    """Ctrl-C in the engine's run left the decode in flight (the stream waited for ever: pump() gave [] and
    `done` stayed False) and dropped the updates that pump had collected (a finished stream's final one)."""
    audio = _audio()[:2 * SAMPLE_RATE]
    runner = transcriber(speculative=False, **FAST).streams(OPTIONS, vad=False, batch_size=4)
    quiet, talk = runner.open(), runner.open()
    quiet.finish()  # nothing to decode: its final update waits for the next pump
    talk.feed(audio)
    _interrupted_on(runner, 1)
    with pytest.raises(KeyboardInterrupt):
        runner.pump()
    talk.finish()
    updates = _pump_until_done(runner, [quiet, talk])
    assert [u.final for s, u in updates if s is quiet] == [True]
    # as if the interrupted decode had never been asked for: fed, finished, decoded
    alone = transcriber(speculative=False, **FAST).streams(OPTIONS, vad=False, batch_size=4)
    reference = alone.open()
    reference.feed(audio)
    reference.finish()
    expected = _pump_until_done(alone, [reference])
    assert talk.done and expected[-1][1].final and expected[-1][1].text.strip()
    assert [u for s, u in updates if s is talk] == [u for _, u in expected]


def _interrupted_accept(stream, when: str) -> None:
    """Ctrl-C as the runner hands `stream` its first result: a KeyboardInterrupt just before its policy's `accept`
    runs ("before") or just as it returns ("after"), or a real SIGINT sent to this process inside it ("signal")."""
    real, calls = stream.policy.accept, [0]

    def accept(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 1 and when == "before":
            raise KeyboardInterrupt
        if calls[0] == 1 and when == "signal":
            os.kill(os.getpid(), signal.SIGINT)
        update = real(*args, **kwargs)
        if calls[0] == 1 and when == "after":
            raise KeyboardInterrupt
        return update

    stream.policy.accept = accept


@pytest.mark.parametrize("when", ["before", "after", "signal"])
def test_ctrl_c_while_results_are_handed_out_loses_nothing(when):
    """Ctrl-C inside `StreamRunner.deliver`: an update its policy made (the interrupt came as `accept` returned)
    was dropped, its words never shown; a decode not yet accepted stayed in flight, so the stream never asked
    again and its heard tail was lost. Now the next pumps give what an uninterrupted run gives."""
    audio = _audio()[:3 * SAMPLE_RATE]

    def two_streams():
        runner = transcriber(speculative=False, **FAST).streams(OPTIONS, vad=False, batch_size=4)
        pair = [runner.open(), runner.open()]
        for stream in pair:
            stream.feed(audio)
        return runner, pair

    alone, expected = two_streams()
    reference = alone.pump()
    for stream in expected:
        stream.finish()
    reference += _pump_until_done(alone, expected)
    runner, pair = two_streams()
    _interrupted_accept(pair[1], when)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's own, as a CLI process has it
    try:
        with pytest.raises(KeyboardInterrupt):
            runner.pump()
    finally:
        signal.signal(signal.SIGINT, previous)
    for stream in pair:
        stream.finish()
    updates = _pump_until_done(runner, pair)
    assert all(s.done for s in pair) and reference[-1][1].text.strip()
    ours, theirs = ([[u for s, u in got if s is stream] for stream in streams]
                    for got, streams in ((updates, pair), (reference, expected)))
    assert ours[0] == theirs[0]  # the stream handed its result first: as if nothing happened
    # the interrupted one: its update shown as the run gave it; or, its decode withdrawn, asked for again once
    # finished (one close decode of it all: the same transcript, in one final update)
    # (a real SIGINT inside `accept` is held until every result is handed out: as after it)
    assert ours[1] == theirs[1] if when != "before" else [u.text for u in ours[1]] == [theirs[1][-1].text]


def test_ctrl_c_during_a_decode_prints_what_was_heard(capsys):
    """`asr-spec stream` interrupted while the engine decodes finishes the stream and prints its text (it spun at
    100 % CPU for ever, printing nothing more)."""
    from asr_spec.cli.stream import _run

    blocks = [_audio()[i:i + SAMPLE_RATE] for i in range(0, 4 * SAMPLE_RATE, SAMPLE_RATE)]
    runner = transcriber(speculative=False, **FAST).streams(OPTIONS, vad=False, batch_size=1)
    _interrupted_on(runner, 2)
    pump, finals = runner.pump, []

    def recorded():
        updates = pump()
        finals.extend(u for _, u in updates if u.final)
        return updates

    runner.pump = recorded
    assert _run(runner, iter(blocks), tentative=False) is True
    assert len(finals) == 1 and finals[0].text.strip()
    assert capsys.readouterr().out == finals[0].text + "\n"


def test_the_cli_stops_when_no_update_can_come(capsys):
    """A stream left unfinished with nothing in flight (a bug) ended the CLI in a busy loop, not at its end."""
    from types import SimpleNamespace

    from asr_spec.cli.stream import _run

    class Runner:
        pumps = 0

        def open(self):
            return SimpleNamespace(feed=lambda block: None, finish=lambda: None, done=False)

        def pump(self):
            self.pumps += 1
            if self.pumps > 5:
                raise RuntimeError("pumped on while nothing could come")
            return []

    assert _run(Runner(), iter([np.zeros(10, np.float32)] * 2), tentative=False) is False
    assert capsys.readouterr().out == "\n"


def test_a_closed_stream_takes_no_audio():
    """Audio fed to a closed stream was dropped in silence, and "finish(), then pump() until done" never ended."""
    from asr_spec.errors import InputError

    runner = transcriber(speculative=False, **FAST).streams(OPTIONS, vad=False, batch_size=1)
    stream = runner.open()
    stream.feed(_audio()[:2 * SAMPLE_RATE])
    runner.pump()
    runner.close(stream)
    with pytest.raises(InputError, match="^stream 0 is closed$"):
        stream.feed(_audio()[:SAMPLE_RATE])
    with pytest.raises(InputError, match="^stream 0 is closed$"):
        stream.finish()
    assert stream.done and runner.pump() == []


def test_options_of_the_wrong_type_are_refused():
    """A dict of options failed deep in the policy with an AttributeError ('dict' object has no attribute ...)."""
    from asr_spec.errors import InputError

    asr = transcriber(speculative=False, **FAST)
    with pytest.raises(InputError, match="^options must be a StreamOptions, got dict$"):
        list(asr.stream([_audio()[:SAMPLE_RATE]], {"step_s": 1.0}))
    assert asr.streams(None, vad=False).options == StreamOptions()


# -- prompts: a stream's re-decodes carry the transcriber's initial prompt and hotwords ---------------------------

PROMPTS = dict(initial_prompt="Mikayla Szczepanski saw the doctor.", hotwords="Szczepanski")


def recorded_requests(engine) -> list:
    """Every request `engine` is given from now on (its `run` wrapped on this instance)."""
    seen, run = [], engine.run

    def recorded(source):
        for request in source:
            if request is not None:
                seen.append(request)
            yield request

    engine.run = lambda source, batch_size: run(recorded(source), batch_size)
    return seen


def first_window_prompt(asr, path) -> tuple[int, ...]:
    """The prompt of the first window of `path` transcribed offline (the request the engine was given)."""
    seen = recorded_requests(asr.engine)
    asr.transcribe([str(path)], progress=False)
    del asr.engine.run  # its own again
    return next(r.prompt for r in seen if r.id.index == 0 and r.id.attempt == 0)


def _streamed_requests(asr) -> list:
    seen = recorded_requests(asr.engine)  # timestamps on: the streams decode with the transcriber's engine
    blocks = [_audio()[i:i + 8000] for i in range(0, len(_audio()), 8000)]
    assert list(asr.stream(blocks, OPTIONS, vad=False))[-1].final
    return seen


def test_a_streams_redecodes_carry_the_offline_first_windows_prompt():
    """initial_prompt / hotwords were accepted and ignored by live streams: every re-decode now carries the prompt
    the transcriber gives an input's first window offline, the committed ones (a prefix forced) too."""
    asr = transcriber(speculative=False, timestamps=True, **FAST, **PROMPTS)
    want = first_window_prompt(asr, LONG)
    assert want == asr.prompt_tokens().first_previous and len(want) > 5
    seen = _streamed_requests(asr)
    assert len(seen) > 3 and any(r.prefix for r in seen)  # several re-decodes, some forcing committed words
    assert all(r.prompt == want for r in seen)
    plain = _streamed_requests(transcriber(speculative=False, timestamps=True, **FAST))
    assert plain and all(r.prompt == () for r in plain)


def test_a_long_prompt_gives_way_to_the_committed_prefix():
    """A prompt at the model's limit (223 tokens) keeps its last tokens beside a re-decode's forced prefix: the two
    hold at most `max_prompt_tokens` together, as an offline first window's prompt and prefix do."""
    words = " ".join(["Dr. Mikayla Szczepanski, we'll see you now."] * 20)  # 340 tokens: the first 117 dropped
    asr = transcriber(speculative=False, timestamps=True, initial_prompt=words, **FAST)
    limit = asr.tokens.max_prompt_tokens
    full = first_window_prompt(asr, LONG)
    assert len(full) == limit
    seen = _streamed_requests(asr)
    assert any(r.prefix for r in seen)  # the cut below happened, not only the whole prompt
    for request in seen:
        assert len(request.prompt) + len(request.prefix) == limit
        assert request.prompt == full[len(request.prefix):]


def test_a_stream_prompt_keeps_its_last_tokens_within_the_room_a_prefix_leaves():
    from asr_spec.stream.decodes import NO_PROMPT, StreamPrompt

    prompt = StreamPrompt((1, 2, 3, 4, 5), 6)
    assert prompt.fitted(0) == prompt.fitted(1) == (1, 2, 3, 4, 5)
    assert prompt.fitted(3) == (3, 4, 5) and prompt.fitted(5) == (5,)
    assert prompt.fitted(6) == prompt.fitted(9) == () and NO_PROMPT.fitted(0) == ()
