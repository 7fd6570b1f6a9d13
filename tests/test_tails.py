"""Tail repair (issue 28): the pure decision (covered time vs speech frames), the seam merge, the live source that
feeds tails into the running engine, and, with a tiny random Whisper, speculative == greedy with repaired tails.
Digital silence: skipped stride windows and stitching across the gap."""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from asr_spec import TranscribeOptions, Transcriber
from asr_spec.audio.chunking import DIGITAL_SILENCE, ChunkingOptions, ChunkSpan, plan_chunks, skip_silent_windows
from asr_spec.audio.loading import load_audio
from asr_spec.audio.vad import SpeechSpan, onset_before
from asr_spec.chunk_id import ChunkId
from asr_spec.engine import ChunkRequest, ChunkResult, ChunkStats
from asr_spec.errors import InputError
from asr_spec.eval.metrics import normalize
from asr_spec.transcribe.stitch import ChunkTokens, stitch_chunks
from asr_spec.transcribe.tail_runs import TailSource, with_tails
from asr_spec.transcribe.tails import (
    STEP_SAMPLES,
    closed_segments,
    covered_steps,
    drop_repeated_head,
    longest_gap_s,
    next_window_from,
    plan_tail,
    repeated_segment,
    rewind,
    seam_overlap,
    stride_tail,
    timed,
    trim_span,
    uncovered_speech_s,
)

sys.path.insert(0, str(Path(__file__).parent))
from test_transcribe import LONG, SHORT, tiny_draft, tiny_processor, tiny_real_vocab_whisper  # noqa: E402

EOT, TS = 50257, 50364  # whisper's <|endoftext|> and <|0.00|>


def ts(seconds: float) -> int:
    return TS + int(round(seconds / 0.02))


def speech_span(start_s: float, n_s: float, speech_s: list[tuple[float, float]]) -> SpeechSpan:
    """A vad chunk starting at start_s, n_s long, whose speech frames are the given (from, to) chunk seconds."""
    frames = np.zeros(int(round(n_s / 0.02)), bool)
    for a, b in speech_s:
        frames[int(round(a / 0.02)) : int(round(b / 0.02))] = True
    start = int(start_s * 16000)
    return SpeechSpan(start, start + int(n_s * 16000), 0, 0, is_first=False, is_last=False, speech=frames)


# -- the decision ----------------------------------------------------------------------------------------------

def test_a_segment_too_short_for_its_text_vouches_only_for_the_speech_before_it() -> None:
    """whisper-base wrote a 4.9 s espeak German sentence as 9 text tokens at 0.00-0.04 s: a tail from 0.04 s heard
    the same sentence, timed it the same way, and the text came out three times. A segment lasting under
    MIN_TOKEN_S a text token covers nothing: a tail starts at its start (none where that is the chunk's), so the
    speech after it is still decoded (" Yes." at 2.00-2.02 s before 6 s of untranscribed speech)."""
    span = speech_span(0.0, 5.0, [(0.0, 4.8)])
    crammed = (ts(0), *range(1, 10), ts(0.04), EOT)
    assert not timed(closed_segments(crammed, EOT, TS)[0][0], crammed, EOT)
    assert plan_tail(span, crammed, EOT, TS, 0.5) is None  # it would start at the chunk's start
    assert plan_tail(span, crammed, EOT, TS, 0.5, context_s=5.0) is None
    assert covered_steps(crammed, EOT, TS, span.speech, 0.5) == (0, 0)
    spoken = (ts(0), *range(1, 10), ts(0.3), EOT)  # 9 tokens in 0.3 s: >= 0.03 s each, trusted
    tail, kept = plan_tail(span, spoken, EOT, TS, 0.5)
    assert tail.start_sample == int(0.3 * 16000) and kept == spoken[:-1] + (EOT,)
    span = speech_span(0.0, 10.0, [(0.0, 2.1), (3.0, 9.0)])
    short_yes = (ts(0), 1, 2, 3, 4, 5, ts(1.9), ts(2.0), 11, 12, ts(2.02), EOT)
    for context_s in (0.0, 5.0):
        tail, kept = plan_tail(span, short_yes, EOT, TS, 0.5, context_s=context_s)
        assert tail.start_sample == 2 * 16000 and kept == short_yes[:7] + (EOT,)
    assert covered_steps(short_yes, EOT, TS, span.speech, 0.5) == (100, 7)


def test_covered_time_is_where_speech_first_goes_untranscribed() -> None:
    speech = np.zeros(1500, bool)
    speech[:175] = True
    speech[200:260] = True  # 1.2 s of speech after 4 s
    closed_early = (ts(0), 1, 2, ts(3.5), EOT)
    assert covered_steps(closed_early, EOT, TS, speech, 0.5) == (175, 3)
    assert covered_steps(closed_early, EOT, TS, speech, 1.5) is None  # under the margin
    assert covered_steps((ts(0), 1, 2, ts(3.5), ts(4.0), 7, ts(5.2), EOT), EOT, TS, speech, 0.5) is None
    skipped = (ts(0), 1, ts(3.5), ts(5.5), 7, ts(6.0), EOT)  # the speech at 4-5.2 s lies between two segments
    speech[275:300] = True
    assert covered_steps(skipped, EOT, TS, speech, 0.5) == (175, 2)
    assert covered_steps((ts(0), 1, 2, ts(3.5), ts(4.0), 7, EOT), EOT, TS, speech, 0.5) is None  # open: covers
    assert covered_steps((ts(0), 1, 2, ts(3.5), 7), EOT, TS, speech, 0.5) is None  # token limit, no eot
    assert covered_steps((1, 2, EOT), EOT, TS, speech, 0.5) is None  # no timestamps
    assert covered_steps((), EOT, TS, speech, 0.5) is None
    frames = np.array([1, 1, 0, 0, 1, 1, 1], bool)
    assert uncovered_speech_s(frames, 2) == pytest.approx(0.06)
    assert uncovered_speech_s(frames, 7) == 0.0


def test_a_tail_is_planned_only_when_speech_goes_on_past_the_text() -> None:
    span = speech_span(60.0, 29.1, [(0.2, 25.0), (26.0, 28.0)])  # a sentence at 26-28 s after the text ends at 25
    tokens = (ts(0.2), 1, 2, ts(25.0), EOT)
    tail, kept = plan_tail(span, tokens, EOT, TS, margin_s=0.5)
    assert kept == tokens
    assert tail.start_sample == span.start_sample + int(25.0 * 16000) and tail.end_sample == span.end_sample
    assert tail.start_sample % STEP_SAMPLES == span.start_sample % STEP_SAMPLES
    assert len(tail.speech) == len(span.speech) - 1250 and tail.speech.sum() == 100
    assert plan_tail(span, tokens, EOT, TS, margin_s=2.5) is None  # 2 s of speech left: under the margin
    assert plan_tail(span, (ts(0.2), 1, ts(28.0), EOT), EOT, TS, 0.5) is None  # covered to the speech end
    assert plan_tail(span, (ts(0.2), 1, 2, EOT), EOT, TS, 0.5) is None  # open segment: nothing to compare
    assert plan_tail(span, (ts(0), ts(0), EOT), EOT, TS, 0.5) is None  # covered nothing: same chunk again
    plain = ChunkSpan(0, 16000 * 29, 0, 0, True, False)  # a stride window: no speech frames, no tail
    assert plan_tail(plain, tokens, EOT, TS, 0.5) is None
    trimmed = trim_span(span, tail.start_sample)
    assert trimmed.end_sample == tail.start_sample and len(trimmed.speech) == 1250
    # a sentence skipped between two segments: the tail starts after the first, the parent keeps only it
    hole = (ts(0.2), 1, ts(25.0), ts(27.9), 5, ts(28.5), EOT)
    tail, kept = plan_tail(speech_span(60.0, 29.1, [(0.2, 25.0), (25.5, 27.5)]), hole, EOT, TS, 0.5)
    assert kept == (ts(0.2), 1, ts(25.0), EOT) and tail.start_sample == span.start_sample + 25 * 16000


def test_a_tail_that_would_open_on_a_long_silence_starts_at_the_speech_after_it() -> None:
    """A chunk of 27.5 s: speech to 5 s, 20 s of silence, a sentence. Its text stopped before the silence; the tail from
    there opened on it: Whisper timed the sentence from the tail's <|0.00|>, a cue 20 s early. A tail now starts
    where the speech after such a silence does (padded 0.2 s), as a chunk does; after a short pause as before."""
    span = speech_span(90.0, 27.5, [(0.2, 5.0), (25.1, 27.4)])
    tokens = (ts(0.2), 1, 2, ts(5.0), EOT)
    tail, kept = plan_tail(span, tokens, EOT, TS, margin_s=0.5)
    assert kept == tokens and tail.end_sample == span.end_sample
    assert tail.start_sample == span.start_sample + int(round(24.9 * 16000))
    assert tail.speech.sum() == span.speech.sum() - 240 and tail.speech[10]
    near = speech_span(90.0, 10.0, [(0.2, 5.0), (6.5, 9.0)])  # 1.5 s of silence: the tail opens on it
    assert plan_tail(near, tokens, EOT, TS, margin_s=0.5)[0].start_sample == near.start_sample + 5 * 16000
    # rewound to a segment's start (context_s): that segment's words are decoded again from it, silence or not
    two = (ts(0.2), 1, ts(2.0), ts(2.0), 2, ts(5.0), EOT)
    rewound = speech_span(90.0, 27.5, [(0.2, 1.9), (4.5, 5.0), (25.1, 27.4)])
    tail, kept = plan_tail(rewound, two, EOT, TS, margin_s=0.5, context_s=2.5)
    assert kept == two[:3] + (EOT,) and 1.8 * 16000 <= tail.start_sample - rewound.start_sample <= 2 * 16000


def test_a_tail_rewinds_to_a_segment_start_with_context_s_of_decoded_text_before_it() -> None:
    span = speech_span(0.0, 29.2, [(0.1, 25.6), (25.8, 29.1)])  # the last sentence (25.8-29.1 s) went undecoded
    tokens = (ts(0.1), 1, ts(4.0), ts(4.0), 2, ts(19.8), ts(19.8), 3, ts(23.1), ts(23.1), 4, ts(25.6), EOT)
    closed, open_start = closed_segments(tokens, EOT, TS)
    assert [(a, b) for a, b, _, _ in closed] == [(5, 200), (200, 990), (990, 1155), (1155, 1280)]
    assert open_start is None and [tokens[i] for _, _, i, _ in closed] == [ts(0.1), ts(4.0), ts(19.8), ts(23.1)]
    tail, kept = plan_tail(span, tokens, EOT, TS, 0.5, context_s=5.0)
    assert tail.start_sample == int(19.8 * 16000)  # 23.1 s is only 2.5 s before 25.6 s: one segment further back
    assert kept == tokens[:6] + (EOT,) and len(tail.speech) == len(span.speech) - 990  # segments 0 and 1
    assert plan_tail(span, tokens, EOT, TS, 0.5, context_s=2.0)[0].start_sample == int(23.1 * 16000)
    assert plan_tail(span, tokens, EOT, TS, 0.5, context_s=0.0)[1] == tokens[:-1] + (EOT,)  # from 25.6 s
    assert rewind(closed, 3, 60.0) == (200, 3)  # a short chunk: segment 1, never the chunk's first segment
    assert rewind(closed, 0, 5.0) == (5 + 195, 3)  # nothing before the first segment: its end
    whole = plan_tail(span, tokens[:3] + (EOT,), EOT, TS, 0.5, context_s=5.0)  # one segment: the tail starts at its end
    assert whole[0].start_sample == int(4.0 * 16000) and whole[1] == tokens[:3] + (EOT,)


def test_a_tail_at_a_late_segment_start_starts_where_that_segments_speech_does() -> None:
    """A word reviewer's espeak file at 8 kHz: "<|7.00|> After a long pause, ..." said from 6.70 s, the sentence after
    it undecoded; its tail from 7.00 s began mid-word, heard "The second speaker ..." and four words were lost.
    The tail starts where the speech frames show that segment's speech starting (padded into the pause)."""
    speech = [(0.08, 3.34), (6.70, 6.88), (6.92, 7.28), (7.32, 10.88), (14.24, 17.16)]  # gaps of 2 frames inside
    span = speech_span(0.0, 17.35, speech)
    tokens = (ts(0.0), 1, ts(7.0), ts(7.0), 2, ts(14.0), ts(14.0), EOT)
    tail, kept = plan_tail(span, tokens, EOT, TS, 0.5, context_s=5.0)
    assert tail.start_sample == int(6.50 * 16000) and kept == tokens[:3] + (EOT,)  # 0.2 s before the onset at 6.70
    assert len(tail.speech) == len(span.speech) - int(6.50 / 0.02)
    # an onset 1 s or more back is another segment's speech: the timestamp stays; so in unbroken speech
    assert plan_tail(speech_span(0.0, 17.35, [(0.08, 3.34), (5.9, 10.88), (14.24, 17.16)]), tokens, EOT, TS, 0.5,
                     context_s=5.0)[0].start_sample == int(7.0 * 16000)
    # a pause shorter than its 0.2 s pad: half of it
    short = speech_span(0.0, 17.35, [(0.08, 6.60), (6.72, 10.88), (14.24, 17.16)])
    assert plan_tail(short, tokens, EOT, TS, 0.5, context_s=5.0)[0].start_sample == int(6.66 * 16000)
    # a tail from a kept segment's end (no context) does not move: that segment's words are the parent's
    assert plan_tail(span, tokens, EOT, TS, 0.5, context_s=0.0)[0].start_sample == int(14.0 * 16000)


def test_onset_before_finds_the_last_real_pause_within_reach() -> None:
    frames = np.zeros(100, bool)
    frames[40:48] = frames[50:70] = True  # a 2-frame gap at 48-50 is inside speech
    assert onset_before(frames, 60, low=0, max_back=50, min_pause=5, pad=10) == 40 - 10
    assert onset_before(frames, 60, low=35, max_back=50, min_pause=5, pad=10) == 38  # the pause seen from low: half
    assert onset_before(frames, 60, low=0, max_back=15, min_pause=5, pad=10) == 60  # the onset is out of reach
    assert onset_before(frames, 60, low=0, max_back=50, min_pause=1, pad=10) == 49  # a 2-frame pause: half of it
    assert onset_before(frames, 80, low=0, max_back=50, min_pause=5, pad=4) == 76  # in a pause: padded back in it
    assert onset_before(np.ones(100, bool), 60, low=0, max_back=50, min_pause=5, pad=10) == 60


def test_word_timestamps_repair_the_chunks_the_default_repairs() -> None:
    """Coverage reads the timestamps the target wrote and the speech frames after them, in every mode: a last word
    whose aligned end stretches over the speech after the last timestamp (the target gave it no token) does not
    make that speech covered (issue 36), so word timestamps change times, not words."""
    target, _, processor = _eager_models()
    options = TranscribeOptions.from_values(language="en", batch_size=4, chunking="vad", timestamps=True,
                                            tail_margin_s=0.1)
    audio = [str(LONG)] + [str(p) for p in SHORT[:3]]
    plain = Transcriber(target, None, processor, options).transcribe(audio, progress=False)
    words_on = TranscribeOptions.from_values(options, word_timestamps=True)
    timed = Transcriber(target, None, processor, words_on).transcribe(audio, progress=False)
    assert sum(p.redecoded_tails for p in plain) >= 1
    for p, t in zip(plain, timed):
        assert t.redecoded_tails == p.redecoded_tails and t.chunk_tokens == p.chunk_tokens and t.text == p.text
        assert [(c.start_s, c.end_s) for c in t.chunks] == [(c.start_s, c.end_s) for c in p.chunks]
        assert all(s.words for s in t.segments if s.text)


def test_the_transcriber_decides_a_tail_the_same_with_and_without_word_timestamps() -> None:
    """The decision itself: the same tail, from the same evidence, in both modes."""
    target, _, processor = _eager_models()
    span = speech_span(60.0, 29.0, [(0.2, 26.0)])
    early = _result(ChunkId(0, 0), (ts(0.2), 1, 2, ts(25.0), EOT))  # the speech goes on 1 s past the last timestamp
    late = _result(ChunkId(0, 0), (ts(0.2), 1, 2, ts(26.0), EOT))  # covered to the speech's end
    plans = []
    for word_timestamps in (False, True):
        options = TranscribeOptions.from_values(language="en", chunking="vad", timestamps=True,
                                                word_timestamps=word_timestamps)
        transcriber = Transcriber(target, None, processor, options)
        plans.append((transcriber.tail_of(span, early), transcriber.tail_of(span, late)))
        assert transcriber.tail_of(span, _result(ChunkId(0, 0, 2), early.tokens)) is None  # the repair bound
    (words_early, words_late), (plain_early, plain_late) = plans
    assert words_early is not None and words_late is None
    assert words_early[1] == plain_early[1] and words_early[0].start_sample == plain_early[0].start_sample
    assert plain_late is None


def counted_speech(calls: list[int]) -> Callable[[list[tuple[float, float]]], Callable[[], np.ndarray]]:
    """speech_of(spans) -> () -> a 30 s window's speech frames over `spans` (s), each call counted in `calls`."""
    def speech_of(spans):
        def frames():
            calls.append(1)
            return speech_span(0.0, 30.0, spans).speech
        return frames
    return speech_of


def test_a_stride_window_gets_a_tail_only_for_speech_in_the_middle_it_keeps() -> None:
    rate = 16000
    window = ChunkSpan(20 * rate, 50 * rate, 5 * rate, 5 * rate, False, False)  # keeps 25-45 s of the file
    calls: list[int] = []
    speech_of = counted_speech(calls)
    ended_early = (ts(0.0), 1, ts(6.0), ts(6.0), 2, ts(14.0), EOT)  # the text stops at 14 s of 30
    tail, kept = stride_tail(window, ended_early, EOT, TS, 0.5, 0.0, speech_of([(0, 18.0)]))
    assert calls and kept == ended_early and tail.start_sample == window.start_sample + 14 * rate
    assert tail.end_sample == window.end_sample and tail.stride_right_samples == window.stride_right_samples
    assert tail.stride_left_samples == 0 and not tail.is_first
    assert stride_tail(window, ended_early, EOT, TS, 0.5, 0.0, speech_of([(26.0, 30.0)])) is None  # right stride
    calls.clear()
    covered = (ts(0.0), 1, ts(6.0), ts(6.0), 2, ts(24.8), EOT)  # ends within 0.5 s of the kept middle's end
    assert stride_tail(window, covered, EOT, TS, 0.5, 0.0, speech_of([(0, 30.0)])) is None and not calls
    assert stride_tail(window, ended_early[:-1], EOT, TS, 0.5, 0.0, speech_of([(0, 30.0)])) is None  # no eot
    assert stride_tail(window, (ts(0.0), 1, ts(6.0), ts(6.0), 2, EOT), EOT, TS, 0.5, 0.0, speech_of([])) is None
    assert not calls  # open last segment or no eot: no speech frames computed
    # rewinding never starts a tail inside the left stride (the window before keeps that text)
    early = (ts(0.0), 1, ts(4.0), ts(4.0), 2, ts(9.0), EOT)
    tail, kept = stride_tail(window, early, EOT, TS, 0.5, 5.0, speech_of([(0, 18.0)]))
    assert tail.start_sample == window.start_sample + 9 * rate and kept == early  # segment 1 starts at 4 s < 5 s
    trimmed = trim_span(window, tail.start_sample)
    assert trimmed.end_sample == tail.start_sample and trimmed.stride_right_samples == 0
    assert trimmed.stride_left_samples == window.stride_left_samples


def test_a_stride_window_that_skips_a_sentence_inside_its_middle_gets_a_tail_from_there() -> None:
    """Whisper may jump from one segment to a later one over a pause and the sentence after it (issue 28's
    held-out dialogue and monologue through stride): a gap of the kept middle is checked as its end is."""
    rate = 16000
    window = ChunkSpan(20 * rate, 50 * rate, 5 * rate, 5 * rate, False, False)  # keeps 5-25 s of the window
    calls: list[int] = []
    speech_of = counted_speech(calls)
    skipped = (ts(5.0), 1, ts(8.0), ts(12.0), 2, ts(24.9), EOT)  # nothing between 8 and 12 s
    tail, kept = stride_tail(window, skipped, EOT, TS, 0.5, 0.0, speech_of([(5.0, 8.0), (8.6, 11.4), (12.0, 25.0)]))
    assert calls and tail.start_sample == window.start_sample + 8 * rate and kept == skipped[:3] + (EOT,)
    assert tail.stride_right_samples == window.stride_right_samples
    calls.clear()
    assert stride_tail(window, skipped, EOT, TS, 0.5, 0.0, speech_of([(5.0, 8.0), (12.0, 25.0)])) is None
    assert calls  # a pause there: looked at, nothing to repair
    calls.clear()
    in_left_stride = (ts(1.0), 1, ts(2.0), ts(5.3), 2, ts(24.9), EOT)  # the gap is the window before's but 0.3 s
    assert stride_tail(window, in_left_stride, EOT, TS, 0.5, 0.0, speech_of([(0, 30.0)])) is None and not calls


def test_a_stride_tail_never_starts_after_the_next_window_does() -> None:
    """Windows 0-30, 20-50, 40-70 s: the middle one hears 20-24 s, a pause, speech from 40.5 s, and writes 20-24
    and 40.5-43 s, then stops (speech goes on). Its one tail could start at 40.5 s, after the next window's start
    (40 s): the stitch refused the file order and the whole input failed. That window hears it from its start:
    no tail; a tail that starts before it is planned as before."""
    rate = 16000
    w0, w1, w2 = plan_chunks(70 * rate, 30 * rate, 5 * rate, 5 * rate)
    assert next_window_from(w1, 5 * rate) == w2.start_sample and next_window_from(w2, 5 * rate) is None
    assert next_window_from(w0, 5 * rate) == w1.start_sample
    tokens = (ts(0.0), 1, 2, ts(4.0), ts(20.5), 3, 4, ts(23.0), EOT)
    heard = counted_speech([])([(0.0, 4.0), (20.5, 30.0)])
    tail, _ = stride_tail(w1, tokens, EOT, TS, 0.5, 5.0, heard)  # without the bound: at 40.3 s (`onset_before`)
    assert tail.start_sample == int(round(40.3 * rate)) > w2.start_sample
    assert stride_tail(w1, tokens, EOT, TS, 0.5, 5.0, heard, before=next_window_from(w1, 5 * rate)) is None
    earlier = (ts(0.0), 1, 2, ts(4.0), ts(12.0), 3, 4, ts(15.0), EOT)  # the text stops at 35 s: a tail from there
    tail, _ = stride_tail(w1, earlier, EOT, TS, 0.5, 0.0, counted_speech([])([(0.0, 4.0), (12.0, 30.0)]),
                          before=next_window_from(w1, 5 * rate))
    assert tail.start_sample == 35 * rate
    # and a tail of that tail (a speech span that keeps the window's right stride) is bounded the same
    assert next_window_from(tail, 5 * rate) == w2.start_sample


def test_a_stride_window_that_loops_is_decoded_again_from_where_its_loop_starts() -> None:
    """whisper-base may loop in a window ("the work was hard ..." three times, issue 36), its timestamps spread over
    the sentences it does not transcribe, so every second looks covered: a window whose text repeats itself
    (looping: compression ratio over the threshold) is trusted only up to its first segment that repeats an
    earlier one, and the rest of its middle is decoded again."""
    rate = 16000
    window = ChunkSpan(20 * rate, 50 * rate, 5 * rate, 5 * rate, False, False)  # keeps 5-25 s of the window
    calls: list[int] = []
    speech_of = counted_speech(calls)
    loop = (7, 8, 9, 10, 11)
    looped = (ts(5.0), 1, 2, 3, 4, ts(9.0), ts(9.0), *loop, ts(14.0), ts(14.0), *loop, ts(19.0), ts(19.0), *loop,
              ts(24.9), EOT)
    closed, _ = closed_segments(looped, EOT, TS)
    assert repeated_segment(closed, looped, EOT) == 2
    tail, kept = stride_tail(window, looped, EOT, TS, 0.5, 0.0, speech_of([(5.0, 25.0)]), looping=True)
    assert calls and tail.start_sample == window.start_sample + 14 * rate  # after the loop's first time
    assert kept == looped[:13] + (EOT,) and tail.stride_right_samples == window.stride_right_samples
    calls.clear()
    assert stride_tail(window, looped, EOT, TS, 0.5, 0.0, speech_of([(5.0, 25.0)])) is None and not calls  # not told
    # a short segment said twice ("Yes."), or a loop starting in the right stride: the next window's to decode
    short = (ts(5.0), 1, 2, 3, 4, ts(9.0), ts(9.0), 7, ts(10.0), ts(10.0), 7, ts(24.9), EOT)
    assert repeated_segment(closed_segments(short, EOT, TS)[0], short, EOT) is None
    assert stride_tail(window, short, EOT, TS, 0.5, 0.0, speech_of([(5.0, 25.0)]), looping=True) is None
    late = (ts(5.0), *loop, ts(24.8), ts(25.5), *loop, ts(28.0), EOT)
    assert stride_tail(window, late, EOT, TS, 0.5, 0.0, speech_of([(5.0, 25.0)]), looping=True) is None


def test_the_transcriber_decodes_a_looping_stride_window_again_before_its_seam() -> None:
    """The wiring of the above: `Transcriber.tail_of` asks the no-speech rule whether a stride window's text loops
    (compression ratio over 2.4) and, when it does, the window's middle from the loop's first repeat on is decoded
    again as a tail, before the window reaches a seam; without the loop condition (compression_ratio_threshold
    None) the same tokens, whose segments cover the middle, are kept as decoded."""
    target, _, processor = _eager_models()
    rate = 16000
    samples = load_audio(LONG)[20 * rate:50 * rate]  # speech all through
    window = ChunkSpan(20 * rate, 50 * rate, 5 * rate, 5 * rate, False, False)  # keeps 5-25 s of the window
    words = tuple(processor.tokenizer.encode(" The first boats came back.", add_special_tokens=False))
    loop = tuple(processor.tokenizer.encode(" The work was hard.", add_special_tokens=False))
    looped = (ts(5.0), *words, ts(8.0))
    for start in range(8, 24, 3):
        looped += (ts(start), *loop, ts(min(start + 3, 24.9)))
    result = _result(ChunkId(0, 1), (*looped, EOT))
    for threshold, tail_at_s in ((2.4, 11.0), (None, None)):
        options = TranscribeOptions.from_values(language="en", chunking="stride", timestamps=True, tail_context_s=0.0,
                                                compression_ratio_threshold=threshold)
        transcriber = Transcriber(target, None, processor, options)
        assert transcriber.options.no_speech.loops(processor.tokenizer.decode(looped)) == (threshold is not None)
        planned = transcriber.tail_of(window, result, samples)
        if tail_at_s is None:
            assert planned is None
        else:
            tail, kept = planned
            assert tail.start_sample == window.start_sample + int(tail_at_s * rate)  # after the loop's first time
            assert kept == (*looped[:2 + len(words) + len(loop) + 2], EOT)
    # a tail that would start after the next window does (43 s: `next_window_from`, 40 s): none
    gap = _result(ChunkId(0, 1), (ts(0.0), *words, ts(4.0), ts(20.5), *words, ts(23.0), EOT))
    transcriber.frontend.window_speech = lambda _: speech_span(0.0, 30.0, [(0.0, 4.0), (20.5, 30.0)]).speech
    assert transcriber.tail_of(window, gap, samples) is None
    last = dataclasses.replace(window, stride_right_samples=0, is_last=True)  # no window after it
    assert transcriber.tail_of(last, gap, samples)[0].start_sample == window.start_sample + 23 * rate  # its end


def test_the_no_speech_rule_says_when_a_text_loops() -> None:
    from asr_spec.transcribe.nospeech import NoSpeechRule

    rule = NoSpeechRule()
    assert rule.loops("the work was hard " * 8) and not rule.loops("The work was hard and the hours were long.")
    assert not NoSpeechRule(compression_ratio_threshold=None).loops("the work was hard " * 8)


def test_longest_gap_is_what_no_segment_covers_after_a_closed_one_within_bounds() -> None:
    closed = [(0, 100, 0, 2), (150, 400, 3, 5)]
    assert longest_gap_s(closed, None, 0, 1000) == pytest.approx(12.0)  # 400 -> 1000
    assert longest_gap_s(closed, None, 0, 420) == pytest.approx(1.0)  # 100 -> 150
    assert longest_gap_s(closed, 410, 0, 1000) == pytest.approx(1.0)  # open from 410: 400 -> 410 and 100 -> 150
    assert longest_gap_s(closed, None, 140, 420) == pytest.approx(0.4)  # 400 -> 420; 100 -> 150 starts before 140
    assert longest_gap_s([(0, 100, 0, 2)], 100, 0, 1000) == 0.0


# -- the seam --------------------------------------------------------------------------------------------------

def test_seam_drops_only_whole_repeated_words() -> None:
    assert seam_overlap([1, 2, 3, 4], [3, 4, 5]) == 2
    assert seam_overlap([1, 2, 3], [4, 5]) == 0
    assert seam_overlap([], [1]) == 0 and seam_overlap([1], []) == 0
    starts = {3, 5}.__contains__  # tokens 3 and 5 start words; 4 continues one
    assert seam_overlap([1, 2, 3], [3, 4, 5], starts_word=starts) == 0  # "3" would split the word 3-4
    assert seam_overlap([1, 3, 4], [3, 4, 5], starts_word=starts) == 2
    tail, n = drop_repeated_head((ts(0), 7, 3, 4, ts(2), EOT), (ts(0), 3, 4, 5, ts(1), EOT), EOT, starts)
    assert n == 2 and tail == (ts(0), 5, ts(1), EOT)  # timestamps stay, the repeated words go
    # a whole sentence the parent timed early and its tail heard again (13 tokens: 8 was the limit, it stayed)
    sentence = list(range(100, 113))
    assert seam_overlap([7, 8, *sentence], [*sentence, 9]) == 13


def _result(key, tokens) -> ChunkResult:
    return ChunkResult(key, tuple(tokens), (), "eos", ChunkStats())


def test_with_tails_orders_chunks_and_tails_and_ends_each_where_the_next_starts() -> None:
    a, b = speech_span(0.0, 29.0, [(0, 29)]), speech_span(30.0, 10.0, [(0, 10)])
    tail1 = plan_tail(a, (ts(0), 1, ts(20.0), EOT), EOT, TS, 0.5)[0]
    tail2 = plan_tail(tail1, (ts(0), 2, ts(4.0), EOT), EOT, TS, 0.5)[0]
    chunks = [(a, _result(0, [1]), None), (b, _result(1, [2]), None)]
    tails = {0: [[tail1, _result(ChunkId(0, 0, 1), [3]), None], [tail2, _result(ChunkId(0, 0, 2), [4]), None]]}
    ordered, continues = with_tails(chunks, tails)
    assert continues == [False, True, True, False]
    starts = [d[0].start_sample for d in ordered]
    ends = [d[0].end_sample for d in ordered]
    assert starts == sorted(starts) and all(e <= s for e, s in zip(ends, starts[1:]))
    assert ends[0] == tail1.start_sample and ends[1] == tail2.start_sample and ends[2] == a.end_sample


# -- the live source -------------------------------------------------------------------------------------------

def test_tail_source_feeds_tails_into_the_run_and_ends_when_nothing_is_in_flight() -> None:
    featurised = []

    def featurise(samples):
        featurised.append([len(s) for s in samples])
        return torch.zeros(len(samples), 80, 3000)

    source = TailSource(featurise)
    span = speech_span(0.0, 2.0, [(0, 2)])
    source.samples[ChunkId(0, 0)] = np.ones(span.n_samples, np.float32)
    in_engine = {ChunkId(0, 0)}  # what the engine holds: the source ends only once it is empty
    run = source.run(iter([ChunkRequest(ChunkId(0, 0), torch.zeros(80, 3000))]), lambda: bool(in_engine))
    assert next(run).id == ChunkId(0, 0)
    assert next(run) is None  # the chunk is decoding: the source must not end
    tail = plan_tail(span, (ts(0), 1, ts(1.0), EOT), EOT, TS, 0.5)[0]
    in_engine = set()
    source.finished(_result(ChunkId(0, 0), []), tail, span, keep_encoded=True)
    assert ChunkId(0, 0) not in source.samples  # let go once its result is in
    request = next(run)
    assert request.id == ChunkId(0, 0, 1) and request.keep_encoded and featurised == [[16000]]
    in_engine.add(request.id)
    assert next(run) is None
    in_engine.clear()
    source.finished(_result(ChunkId(0, 0, 1), []), None, tail, False)
    assert list(run) == [] and source.samples == {}


# -- digital silence -------------------------------------------------------------------------------------------

def test_silent_windows_are_skipped_and_their_neighbours_lose_that_stride() -> None:
    rate = 16000
    signal = np.zeros(120 * rate, np.float32)
    signal[5 * rate : 10 * rate] = 0.1  # speech in window 0 only
    signal[100 * rate : 110 * rate] = 0.1  # and in the last windows
    options = ChunkingOptions()
    all_windows = list(options.iter([signal]))
    kept = list(skip_silent_windows(options.iter([signal])))
    kept_starts = [span.start_sample // rate for span, _ in kept]
    assert len(kept) < len(all_windows) and kept_starts[0] == 0 and 40 not in kept_starts
    for (span, samples), (nxt, _) in zip(kept, kept[1:] + [(None, None)]):
        assert np.max(np.abs(samples)) > DIGITAL_SILENCE
        if nxt is not None and nxt.start_sample >= span.end_sample:  # a gap: no stride toward it
            assert span.stride_right_samples == 0 and nxt.stride_left_samples == 0
    assert list(skip_silent_windows(options.iter([np.zeros(60 * rate, np.float32)]))) == []


def test_stitching_does_not_merge_chunks_across_a_gap() -> None:
    rate = 16000
    a = ChunkSpan(0, 30 * rate, 0, 0, True, False)
    b = ChunkSpan(40 * rate, 70 * rate, 0, 5 * rate, False, False)
    c = ChunkSpan(60 * rate, 80 * rate, 5 * rate, 0, False, True)
    text = stitch_chunks([ChunkTokens((1, 2, 3), a), ChunkTokens((2, 3, 4), b), ChunkTokens((4, 5), c)],
                         eot_id=EOT, timestamp_begin_id=TS)
    assert text.token_ids[:6] == (1, 2, 3, 2, 3, 4)  # a and b do not overlap: both kept whole
    last = ChunkSpan(40 * rate, 70 * rate, 0, 0, False, True)
    timed = stitch_chunks([ChunkTokens((ts(0), 1, 2), a), ChunkTokens((ts(0), 3, ts(5), EOT), last)],
                          eot_id=EOT, timestamp_begin_id=TS)
    assert [(s.start_s, s.end_s, s.token_ids) for s in timed.segments] == [(0.0, 30.0, (1, 2)), (40.0, 45.0, (3,))]


# -- end to end, tiny random Whisper ---------------------------------------------------------------------------

@functools.cache
def _eager_models():
    """The tiny random Whisper with <|endoftext|> made likely (its final layer norm's bias moved along the eot
    row, +10 on the eot logit), so its chunks end early after a timestamp, as a real model's may: tails follow."""
    target = tiny_real_vocab_whisper()
    eot = target.generation_config.eos_token_id
    row = target.proj_out.weight[eot].detach()
    with torch.no_grad():
        target.model.decoder.layer_norm.bias += 10.0 * row / row.norm() ** 2
    return target, tiny_draft(target), tiny_processor()


def test_a_window_that_falls_back_still_gets_its_tail() -> None:
    """Every window falls back (no average log-probability reaches 0) to a temperature so small that its sampled
    pass is greedy's, so the windows' last passes and the tail the last window asks for do not depend on a CPU's
    rounding of sampled draws (a run at temperature 1 asked for one on some CPUs only). Between the passes no
    request was in the engine, so the tail source ended, and the tail a last pass asked for was never decoded:
    transcribe() raised AttributeError ('NoneType' object has no attribute 'tokens'), every input not yet
    yielded lost."""
    target, _, processor = _eager_models()
    options = TranscribeOptions.from_values(language="en", batch_size=4, chunking="vad", timestamps=True,
                                            tail_margin_s=0.1, temperature="0,0.000001", logprob_threshold=0.0,
                                            no_speech_threshold=1.0)
    clip = load_audio(str(LONG))[: 26 * 16000]  # its last window asks for a tail, on every CPU
    result = Transcriber(target, None, processor, options).transcribe([clip], progress=False)[0]
    assert result.error is None and result.fallback_windows and result.redecoded_tails >= 1
    assert sum(c.tail for c in result.chunks) == result.redecoded_tails


def test_repaired_tails_are_speculative_and_equal_to_greedy() -> None:
    target, draft, processor = _eager_models()
    options = TranscribeOptions.from_values(language="en", batch_size=4, chunking="vad", timestamps=True,
                                            tail_margin_s=0.1)
    audio = [str(LONG)] + [str(p) for p in SHORT[:3]]
    greedy = Transcriber(target, None, processor, options).transcribe(audio, progress=False)
    spec = Transcriber(target, draft, processor, options).transcribe(audio, progress=False)
    off = Transcriber(target, None, processor, TranscribeOptions.from_values(options, tail_repairs=0))
    plain = off.transcribe(audio, progress=False)
    assert sum(g.redecoded_tails for g in greedy) >= 1 and sum(p.redecoded_tails for p in plain) == 0
    for g, s, p in zip(greedy, spec, plain):
        assert s.chunk_tokens == g.chunk_tokens and s.text == g.text and s.redecoded_tails == g.redecoded_tails
        assert len(g.chunks) == len(p.chunks) + g.redecoded_tails
        assert sum(c.tail for c in g.chunks) == g.redecoded_tails
        times = [t for seg in g.segments for t in (seg.start_s, seg.end_s)]
        assert times == sorted(times)
    assert sum(s.stats.drafted_tokens for s in spec) > 0
    tail_chunks = [c for c in greedy[0].chunks if c.tail]
    assert all(c.stats.drafted_tokens == 0 for c in tail_chunks)  # greedy run: nothing drafted
    spec_tails = [c for s in spec for c in s.chunks if c.tail]
    assert spec_tails and sum(c.stats.drafted_tokens for c in spec_tails) > 0  # tails are decoded speculatively


def test_stride_windows_get_their_tails_repaired_speculatively_and_equal_to_greedy() -> None:
    target, draft, processor = _eager_models()
    options = TranscribeOptions.from_values(language="en", batch_size=4, chunking="stride", timestamps=True,
                                            tail_margin_s=0.1)
    from asr_spec.audio.loading import load_audio

    audio = [load_audio(str(LONG))[: 25 * 16000], str(LONG)]  # the first one's window closes early (measured)
    greedy = Transcriber(target, None, processor, options).transcribe(audio, progress=False)
    spec = Transcriber(target, draft, processor, options).transcribe(audio, progress=False)
    off = Transcriber(target, None, processor, TranscribeOptions.from_values(options, tail_repairs=0))
    plain = off.transcribe(audio, progress=False)
    assert greedy[0].redecoded_tails >= 1 and sum(c.tail for c in spec[0].chunks) == greedy[0].redecoded_tails
    assert len(normalize(greedy[0].text).split()) > len(normalize(plain[0].text).split())  # the tail's words
    for g, s, p in zip(greedy, spec, plain):
        assert s.chunk_tokens == g.chunk_tokens and s.text == g.text
        assert len(g.chunks) == len(p.chunks) + g.redecoded_tails
        times = [t for seg in g.segments for t in (seg.start_s, seg.end_s)]
        assert times == sorted(times)
        if not g.redecoded_tails:  # nothing repaired: stride's output as it was
            assert g.text == p.text and g.segments == p.segments


def test_tail_options_are_checked() -> None:
    for bad, cause in [(dict(tail_repairs=-1), "tail_repairs"), (dict(tail_repairs=True), "tail_repairs"),
                       (dict(tail_margin_s=0), "tail_margin_s"), (dict(tail_margin_s="1"), "tail_margin_s"),
                       (dict(tail_context_s=-1), "tail_context_s"), (dict(tail_context_s=None), "tail_context_s")]:
        with pytest.raises(InputError, match=cause):
            TranscribeOptions.from_values(**bad)


def test_words_of_repaired_tails_do_not_depend_on_the_draft_and_stay_in_order() -> None:
    target, draft, processor = _eager_models()
    options = TranscribeOptions.from_values(language="en", batch_size=4, chunking="vad", timestamps=True,
                                            tail_margin_s=0.1, word_timestamps=True)
    words = {}
    for name, model in (("greedy", None), ("spec", draft)):
        (result,) = Transcriber(target, model, processor, options).transcribe([str(LONG)], progress=False)
        assert result.redecoded_tails >= 1
        words[name] = [w for seg in result.segments for w in seg.words]
    assert words["spec"] == words["greedy"] and words["greedy"]
    starts = [w.start for w in words["greedy"]]
    assert starts == sorted(starts)


def test_a_run_with_tails_asks_for_no_more_rows_than_there_are_chunks(monkeypatch) -> None:
    requests = [ChunkRequest(ChunkId(0, i), torch.zeros(80, 3000)) for i in range(5)]
    for batch_size, rows in ((8, 5), (5, 5), (4, 4), (1, 1)):
        head, n_rows = TailSource.rows(iter(requests), batch_size)
        assert n_rows == rows
        assert [r.id for r in head] == [r.id for r in requests]
    _, n_rows = TailSource.rows(iter([]), 8)
    assert n_rows == 1

    from asr_spec.engine import cache

    rows_made: list[int] = []
    original = cache.KVCache.empty.__func__

    def spy(cls, n_layers, n_rows, n_heads, head_dim, n_positions, *args, **kwargs):
        if n_positions > 40:  # the batch's caches, not admission's prompt staging
            rows_made.append(n_rows)
        return original(cls, n_layers, n_rows, n_heads, head_dim, n_positions, *args, **kwargs)

    monkeypatch.setattr(cache.KVCache, "empty", classmethod(spy))
    target, _, processor = _eager_models()
    options = TranscribeOptions.from_values(language="en", chunking="vad", timestamps=True)
    (result,) = Transcriber(target, None, processor, options).transcribe(str(SHORT[0]), batch_size=1000,
                                                                         progress=False)
    assert result.ok and rows_made and set(rows_made) == {1}  # one chunk: one row, its tails included


# -- the server ------------------------------------------------------------------------------------------------

def test_the_server_repairs_tails_as_the_transcriber_does() -> None:
    """An upload whose chunks get tails re-decoded: the server's text, segments and words are the Transcriber's
    (the same decision, `finish_result`, and bookkeeping, `TailBook`), with requests sharing the batch. A request
    without words is decided on its timestamps, as a Transcriber without word timestamps decides."""
    pytest.importorskip("fastapi", reason="needs the asr-spec[serve] extra")
    from concurrent.futures import ThreadPoolExecutor

    from fastapi.testclient import TestClient

    from asr_spec.serve.app import ServeOptions, create_app
    from asr_spec.serve.batcher import Batcher

    target, draft, processor = _eager_models()
    options = TranscribeOptions.from_values(language="en", batch_size=3, chunking="vad", timestamps=True,
                                            tail_margin_s=0.1, word_timestamps=True)
    model = Transcriber(target, draft, processor, options)
    paths = [LONG, SHORT[0], LONG]
    worded = model.transcribe([str(LONG)], progress=False)[0]
    plain = Transcriber(target, draft, processor, TranscribeOptions.from_values(options, word_timestamps=False))
    want = {(LONG, True): worded}
    want[LONG, False], want[SHORT[0], False] = plain.transcribe([str(LONG), str(SHORT[0])], progress=False)
    assert worded.redecoded_tails >= 1 and want[LONG, False].redecoded_tails >= 1
    batcher = Batcher(model, batch_size=3)

    def post(client, path, granularities):
        files = {"file": (path.name, path.read_bytes(), "audio/flac")}
        data = {"model": "tiny", "response_format": "verbose_json", "timestamp_granularities[]": granularities}
        return client.post("/v1/audio/transcriptions", files=files, data=data)

    with TestClient(create_app(batcher, ServeOptions(model_id="tiny"))) as client:
        with ThreadPoolExecutor(3) as pool:
            asked = [["segment", "word"], ["segment"], ["segment"]]
            answers = list(pool.map(post, [client] * 3, paths, asked))
    assert batcher.session.keep_samples == {}  # every chunk's samples let go
    for path, answer, granularities in zip(paths, answers, asked):
        assert answer.status_code == 200, answer.text
        data, expect = answer.json(), want[path, "word" in granularities]
        assert data["text"] == expect.text
        assert [(s["start"], s["end"], s["text"]) for s in data["segments"]] == [
            (s.start_s, s.end_s, s.text) for s in expect.segments]
        if "word" in granularities:
            assert [(w["word"].strip(), w["start"], w["end"]) for w in data["words"]] == [
                (w.word.strip(), w.start, w.end) for s in expect.segments for w in s.words]


EOT_STUB, TS_STUB = 100, 200  # `stub_assembly`'s <|endoftext|> and first timestamp ids


def stub_assembly(text: dict[int, str]) -> tuple[object, Callable[[tuple[int, ...]], object]]:
    """An `Assembler` over a stub tokenizer (token id -> its text, `text`; <|endoftext|> EOT_STUB, timestamps from
    TS_STUB) and a maker of finished chunk results of given tokens: assembly tested without a model."""
    from types import SimpleNamespace

    from asr_spec.audio.vad import VadOptions
    from asr_spec.engine.stats import ChunkStats
    from asr_spec.transcribe.assembly import Assembler
    from asr_spec.transcribe.options import TranscribeOptions

    tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens=True, **_: "".join(text.get(i, "") for i in ids))
    assembler = Assembler(tokenizer, SimpleNamespace(eot=EOT_STUB, timestamp_begin=TS_STUB, lang_to_id={}),
                          TranscribeOptions(vad=VadOptions()))

    def result(tokens: tuple[int, ...]) -> object:
        return SimpleNamespace(tokens=tokens, no_speech_prob=0.0, avg_logprob=0.0, prompt=(1,), stats=ChunkStats(),
                               finish_reason="eos", temperature=0.0)

    return assembler, result


def test_a_tails_emptied_first_segment_takes_its_words_with_it() -> None:
    """A tail whose first segment is wholly the parent's last words: that segment is dropped from the text, and
    its words with it. Its later segments' words stayed one segment late before ("Last one" timed with "Next
    sentence"'s words, and the srt cue of "Next sentence" twice)."""
    from asr_spec.transcribe.alignment import group_words
    from asr_spec.transcribe.assembly import words_left
    from asr_spec.transcribe.segments import WordTiming

    eot, ts, rate = EOT_STUB, TS_STUB, 16_000
    assembler, result = stub_assembly({1: " the", 2: " end", 3: ".", 4: " Next", 5: " sentence", 6: " Last", 7: " one"})

    def word(w, start, end):
        return WordTiming(w, start, end, 1.0)

    parent = (ts, 1, 2, 3, ts + 50, eot)
    tail = (ts, 1, 2, 3, ts + 50, ts + 50, 4, 5, ts + 100, ts + 100, 6, 7, ts + 150, eot)
    words = [[[word(" the", 0.1, 0.3), word(" end.", 0.3, 0.9)]],
             [[word(" the", 1.0, 1.3), word(" end.", 1.3, 1.9)], [word(" Next", 2.0, 2.4), word(" sentence", 2.4, 2.9)],
              [word(" Last", 3.0, 3.4), word(" one", 3.4, 3.9)]]]
    spans = [SpeechSpan(0, rate, 0, 0, True, False), SpeechSpan(rate, 10 * rate, 0, 0, False, True)]
    got = assembler.assemble("x", spans, [result(parent), result(tail)], 10.0, 1.0, words, [False, True])
    assert [(s.text, [w.word for w in s.words]) for s in got.segments] == [
        ("the end.", [" the", " end."]), ("Next sentence", [" Next", " sentence"]), ("Last one", [" Last", " one"])]
    # the first segment only shortened: its first words go
    kept = words_left([["a", "b", "c"], ["d"]], [(1, 2, 3), (4,)], [(3,), (4,)], lambda ids: [[i] for i in
                                                                                              range(len(ids))])
    assert kept == [["c"], ["d"]]
    # words as the aligner grouped them: " well-known" is two (" well", "-known"), both dropped with its tokens
    pieces = {1: " well", 2: "-", 3: "known", 4: " said"}
    hyphen = [[word(" well", 0.0, 0.2), word("-known", 0.2, 0.5), word(" said", 0.5, 0.8)]]
    kept = words_left(hyphen, [(1, 2, 3, 4)], [(4,)], lambda ids: group_words([pieces[i] for i in ids]))
    assert [[w.word for w in segment] for segment in kept] == [[" said"]]
