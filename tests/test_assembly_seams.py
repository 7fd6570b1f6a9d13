"""Assembling a chunk and its re-decoded tail when the no-speech rule drops one of them: the tail's head is dropped
only against text the transcript keeps (tails.py `drop_repeated_head`, assembly.py `Assembler`). Pure of models: a
tokenizer of a few words and hand-made chunk results."""

from __future__ import annotations

from types import SimpleNamespace

from asr_spec.audio.vad import SpeechSpan, VadOptions
from asr_spec.engine.stats import ChunkStats
from asr_spec.transcribe.assembly import Assembler
from asr_spec.transcribe.options import TranscribeOptions
from asr_spec.transcribe.segments import WordTiming

EOT, TS, RATE = 100, 200, 16_000
TEXT = {1: " the", 2: " end", 3: ".", 4: " Next", 5: " sentence"}
SILENT = dict(no_speech_prob=0.9, avg_logprob=-2.0)  # what Whisper's rule drops (> 0.6, not above -1.0)
SPOKEN = dict(no_speech_prob=0.1, avg_logprob=-0.3)


def _assembler() -> Assembler:
    tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens=True, **_: "".join(TEXT.get(i, "") for i in ids))
    return Assembler(tokenizer, SimpleNamespace(eot=EOT, timestamp_begin=TS, lang_to_id={}),
                     TranscribeOptions(vad=VadOptions()))


def _result(tokens: tuple[int, ...], no_speech_prob: float, avg_logprob: float) -> SimpleNamespace:
    return SimpleNamespace(tokens=tokens, no_speech_prob=no_speech_prob, avg_logprob=avg_logprob, prompt=(1,),
                           stats=ChunkStats(), finish_reason="eos", temperature=0.0)


def _word(text: str, start: float, end: float) -> WordTiming:
    return WordTiming(text, start, end, 1.0)


PARENT = (TS, 1, 2, 3, TS + 50, EOT)  # " the end." at 0-1 s
TAIL = (TS, 1, 2, 3, TS + 50, TS + 50, 4, 5, TS + 100, EOT)  # " the end." again, then " Next sentence"
SPANS = [SpeechSpan(0, RATE, 0, 0, True, False), SpeechSpan(RATE, 10 * RATE, 0, 0, False, True)]
WORDS = [[[_word(" the", 0.1, 0.3), _word(" end.", 0.3, 0.9)]],
         [[_word(" the", 1.0, 1.3), _word(" end.", 1.3, 1.9)],
          [_word(" Next", 2.0, 2.4), _word(" sentence", 2.4, 2.9)]]]


def test_a_tail_keeps_its_head_when_the_no_speech_rule_drops_its_parent() -> None:
    """The parent's text is left out as no speech, its tail (decoded from the same audio) is kept: the words its
    head repeats from the parent are written once, by the tail. Before, the head was dropped against the parent's
    text first and the parent dropped after: " the end." appeared nowhere."""
    results = [_result(PARENT, **SILENT), _result(TAIL, **SPOKEN)]
    got = _assembler().assemble("x", SPANS, results, 10.0, 1.0, WORDS, [False, True])
    assert [c.dropped for c in got.chunks] == ["no speech", None]
    assert got.text == "the end. Next sentence"
    assert [(s.text, [w.word for w in s.words]) for s in got.segments] == [
        ("the end.", [" the", " end."]), ("Next sentence", [" Next", " sentence"])]
    assert got.segments[0].words[0].start == 1.0  # the tail's own times, not raised to the dropped parent's


def test_a_tail_drops_its_head_against_a_kept_parent_and_either_can_be_dropped() -> None:
    results = [_result(PARENT, **SPOKEN), _result(TAIL, **SPOKEN)]
    got = _assembler().assemble("x", SPANS, results, 10.0, 1.0, WORDS, [False, True])
    assert got.text == "the end. Next sentence"  # written once: the parent's
    assert [[w.word for w in s.words] for s in got.segments] == [[" the", " end."], [" Next", " sentence"]]
    dropped_tail = [_result(PARENT, **SPOKEN), _result(TAIL, **SILENT)]
    got = _assembler().assemble("x", SPANS, dropped_tail, 10.0, 1.0, WORDS, [False, True])
    assert got.text == "the end." and [c.dropped for c in got.chunks] == [None, "no speech"]
