"""The live policy's checks of what a hypothesis heard (`asr_spec/stream/hearing.py`), on hand-made segments and
speech frames: each rule at its edge."""

from __future__ import annotations

import functools

import numpy as np

from asr_spec.stream.agreement import TokenKinds, segments
from asr_spec.stream.hearing import (
    FRAME_SAMPLES,
    RATE_MARGIN,
    TOKEN_SLACK,
    TOKENS_PER_S,
    UNHEARD_SPEECH_S,
    before_guess,
    before_loop,
    before_padding,
    budget_rate,
    drifted,
    first_pause,
    hypothesis_rate,
    ids_loop,
    pause_near,
    settled_end,
    shorter_close,
    skipped,
    step_heard,
    stopped_short,
    timing,
    token_budget,
)

EOT, TS = 50, 60  # text ids < 50 (even: a word's first token), timestamps from 60: one step 0.02 s, 320 samples
KINDS = TokenKinds(EOT, TS, np.arange(EOT + 1) % 2 == 0)
FRAMES_PER_S = 16_000 / FRAME_SAMPLES  # 31.25


def speech_between(*spans_s: tuple[float, float], total_s: float = 40.0) -> np.ndarray:
    """(n_frames,) bool: speech in the given (start, end) seconds of the stream."""
    speech = np.zeros(int(total_s * FRAMES_PER_S), bool)
    for start, end in spans_s:
        speech[int(start * FRAMES_PER_S):int(end * FRAMES_PER_S)] = True
    return speech


def speech_after(start_s: float, *spans_s: tuple[float, float]) -> np.ndarray:
    """`speech_between` with every span `start_s` later (a buffer that starts there)."""
    return speech_between(*((start_s + a, start_s + b) for a, b in spans_s), total_s=start_s + 40.0)


def ts(seconds: float) -> int:
    return TS + int(round(seconds / 0.02))


def words(n: int) -> list[int]:
    return [2 * (i % 20) for i in range(n)]  # n one-token words



def say(tokens) -> str:
    """A detokenizer stand-in: "w<id>" a token."""
    return " ".join(f"w{t}" for t in tokens)

def test_a_segment_with_more_speech_than_its_words_can_say_has_drifted() -> None:
    # three words: drifted past 0.5 s a word and 3 s more (4.5 s of speech), at any buffer start
    for start_s in (0.0, 7.04):
        start = int(start_s * 16_000)
        closed = segments([ts(0), *words(5), ts(2), ts(2), *words(3), ts(9), EOT], KINDS)
        assert [s.words for s in closed] == [5, 3]
        assert drifted(closed, speech_between((start_s, start_s + 9.0)), start) == 1  # 7 s of speech, 3 words
        assert drifted(closed, speech_between((start_s, start_s + 6.4)), start) is None  # 4.4 s in the second
        assert drifted(closed, speech_between((start_s, start_s + 2.0), (start_s + 6.5, start_s + 9.0)),
                       start) is None  # pauses in it: 2.5 s of speech
    assert drifted([], speech_between((0, 9)), 0) is None


def test_a_close_decode_stopped_short_where_speech_follows_its_last_closed_segment() -> None:
    start, n = 16_000, 10 * 16_000  # a buffer from 1 s, 10 s of it
    closed = segments([ts(0), *words(4), ts(2), ts(2), *words(3), ts(4), EOT], KINDS)
    assert stopped_short(closed, speech_between((1.0, 5.0), (7.0, 9.0)), start, n) == closed[-1]
    assert stopped_short(closed, speech_between((1.0, 5.0), (7.0, 7.4)), start, n) is None  # 0.4 s: heard
    assert stopped_short(closed, speech_between((1.0, 5.0), (11.0, 12.0)), start, n) is None  # after its audio
    open_tail = segments([ts(0), *words(4), ts(2), ts(2), *words(3), EOT], KINDS)  # the second left open
    assert stopped_short(open_tail, speech_between((1.0, 6.0)), start, n) == open_tail[0]
    assert stopped_short(segments([ts(0), ts(0), EOT], KINDS), speech_between((1.0, 6.0)), start, n) is None
    # a drifted second segment: stopped before it, where the speech it ran over begins (its timed segments)
    drift = [ts(0), *words(4), ts(2), ts(2), *words(2), ts(9), EOT]
    closed, voiced = segments(drift, KINDS), speech_between((1.0, 10.0))
    timed = timing(drift, closed, voiced, start, KINDS)
    assert (timed.drift, timed.skip) == (1, None)
    assert stopped_short(timed.timed(closed), voiced, start, n) == closed[0]
    assert stopped_short(closed, voiced, start, n) is None  # read as timed, it heard its audio


def test_a_close_decode_none_of_which_was_timed_is_decoded_again_to_a_pause_after_what_its_words_could_say() -> None:
    start, n = 16_000, 14 * 16_000  # a buffer from 1 s, 14 s of it: speech 1-3.5, 3.7-6, 6.5-14 s of the stream
    voiced = speech_between((1.0, 3.5), (3.7, 6.0), (6.5, 14.0))
    frame = FRAME_SAMPLES
    # 4 words could take 2 s of speech (to 3.0 s): the first pause after it, 3.5 s, in the middle of its first frame
    assert shorter_close(4, voiced, start, n) == (int(3.5 * FRAMES_PER_S) * frame + frame // 2) - start
    # 6 words: 3 s of speech, to 4.2 s (past the first pause): the next pause, at 6.0 s
    assert shorter_close(6, voiced, start, n) == (int(6.0 * FRAMES_PER_S) * frame + frame // 2) - start
    assert shorter_close(0, voiced, start, n) == shorter_close(1, voiced, start, n)  # one word at least
    # no pause after what 12 words could take (6 s: to 7.7 s, speech to the audio's end), or too little after one
    assert shorter_close(12, voiced, start, n) is None
    assert shorter_close(6, speech_between((1.0, 3.5), (3.7, 6.0), (6.5, 6.9)), start, n) is None  # 0.4 s after


def test_a_segment_after_which_the_next_opens_past_an_utterance_skipped_it() -> None:
    # "...lost.<|3.00|><|9.00|> Is that what...": the next segment (closed, or open at the buffer's end) opens 6 s
    # later; what lies between decides, at any buffer start
    for start_s in (0.0, 5.0):
        start = int(start_s * 16_000)
        voiced = functools.partial(speech_after, start_s)
        for tail in ([ts(12), EOT], [EOT]):  # the segment after the jump closed, or left open
            hypothesis = [ts(0), *words(6), ts(3), ts(9), *words(6), *tail]
            closed = segments(hypothesis, KINDS)
            said = (0.5, 3.0), (9.0, 12.0)
            assert skipped(hypothesis, closed, voiced(*said, (4.0, 6.3)), start, KINDS) == 0  # an utterance
            assert skipped(hypothesis, closed, voiced(*said, (4.0, 4.0 + UNHEARD_SPEECH_S - 0.1)), start, KINDS) is None
            assert skipped(hypothesis, closed, voiced(*said), start, KINDS) is None  # silence between
            # speech running on from the segment's end without a pause is its own words timed early
            assert skipped(hypothesis, closed, voiced((0.5, 5.5), (9.0, 12.0)), start, KINDS) is None
            assert skipped(hypothesis, closed, voiced((0.5, 5.5), (6.0, 7.0), (9.0, 12.0)), start, KINDS) == 0
    # back-to-back segments have no gap; no voice function: no frame is speech
    touching = [ts(0), *words(6), ts(3), ts(3), *words(6), ts(6), EOT]
    assert skipped(touching, segments(touching, KINDS), speech_between((0.0, 6.0)), 0, KINDS) is None
    gap = [ts(0), *words(6), ts(3), ts(9), *words(6), ts(12), EOT]
    assert skipped(gap, segments(gap, KINDS), np.zeros(0, bool), 0, KINDS) is None
    assert [first_pause(speech_between((0.0, 2.0)), f) for f in (0, 62, 70)] == [62, 62, 70]
    assert first_pause(speech_between((0.0, 2.0)), 0, 40) is None  # all speech in frames [0, 40)
    assert first_pause(speech_between((0.0, 40.0)), 0) is None
    # timing: the segments through the one before the jump; a drift before it wins
    three = [ts(0), *words(6), ts(3), ts(3), *words(6), ts(5), ts(9), *words(4), ts(11), EOT]
    closed, voiced = segments(three, KINDS), speech_between((0.2, 5.0), (6.0, 8.0), (9.0, 11.0))
    timed = timing(three, closed, voiced, 0, KINDS)
    assert (timed.drift, timed.skip, timed.timed(closed)) == (None, 1, closed[:2])


def test_a_looping_text_is_read_up_to_its_first_repeated_segment() -> None:
    loop = [ts(0), 2, 4, 6, 8, ts(1), *[t for k in range(1, 6) for t in (ts(k), 2, 4, 6, 8, ts(k + 1))], EOT]

    assert before_loop(tuple(loop), KINDS, say) == (ts(0), 2, 4, 6, 8, ts(1), EOT)
    varied = (ts(0), 2, 4, 6, 8, ts(1), ts(1), *range(10, 48, 2), ts(5), ts(5), 2, 4, 6, 8, ts(6), EOT)
    assert before_loop(varied, KINDS, say) == varied  # said again, but the text does not loop
    short = (ts(0), 2, ts(1), *[t for k in range(1, 9) for t in (ts(k), 2, ts(k + 1))], EOT)
    assert before_loop(short, KINDS, say) == short  # "Yes." again and again: under MIN_LOOP_TOKENS


def test_a_loop_inside_one_segment_is_not_heard() -> None:
    """`asr-spec stream --no-vad` over 40 s of silence: "<|0.00|> Yn yw'n yw'n ..." to its budget, one segment (no
    segment repeats another), agreed on by two step decodes and committed 150 times over. The first segment whose
    own text loops goes, with all after it; one that says a word or two again does not."""
    loop = (2, 4, 6) * 40
    assert before_loop((ts(0), 8, *loop), KINDS, say) == (EOT,)  # cut short, left open
    spoken = (ts(0), *range(10, 40, 2), ts(3))
    ended = (*spoken, ts(3), *loop, ts(9), EOT)
    assert before_loop(ended, KINDS, say) == ended  # ended: a segment said as it was, read by agreement
    assert before_loop((*spoken, ts(3), *loop), KINDS, say) == (*spoken, EOT)
    again = (*spoken, ts(3), 2, 4, 2, 4, 6, ts(4))  # cut at the budget, but no loop in it
    assert before_loop(again, KINDS, say) == again
    n = int(10 * 16_000)
    assert step_heard((*spoken, ts(3), *loop), speech_between(), 0, n, KINDS, say) == (*spoken, EOT)


def test_a_looping_cut_does_not_raise_the_streams_token_rate() -> None:
    """A re-decode that ran out of its budget doubles its stream's next budget (speech denser than its rate), up to
    32x; a loop over silence did that each time, and each decode then took ~10 s. Its ids compress: no doubling."""
    from types import SimpleNamespace

    from asr_spec.stream.decodes import _observe

    assert ids_loop([101, 102, 103] * 20) and not ids_loop([101, 102, 103] * 10)  # under LOOP_MIN_IDS: not judged
    assert not ids_loop(list(range(1000, 1220)))
    stream = SimpleNamespace(n_cut=0, rates=[], taken_samples=16_000)
    _observe(stream, SimpleNamespace(finish_reason="length", tokens=[101, 102, 103] * 20))
    assert stream.n_cut == 0
    _observe(stream, SimpleNamespace(finish_reason="length", tokens=list(range(1000, 1064))))
    assert stream.n_cut == 1


def test_a_cut_hypothesis_is_read_up_to_its_first_repeat_whatever_it_compresses_to() -> None:
    """A loop cut short by its token budget (no <|endoftext|>) may compress under the threshold; it is still
    read up to its first repeated segment. The same tokens ending in <|endoftext|> are kept as they are."""
    two = (ts(0), *range(10, 40, 2), ts(3), ts(3), 2, 4, 6, 8, ts(4), ts(4), 2, 4, 6, 8, ts(5), ts(5), 2, 4)

    assert before_loop((*two, EOT), KINDS, say) == (*two, EOT)  # compresses under the threshold: not a loop
    assert before_loop(two, KINDS, say) == (*two[:two.index(ts(4)) + 1], EOT)
    assert before_loop(two[:two.index(ts(4)) + 1], KINDS, say) == two[:two.index(ts(4)) + 1]  # cut, no repeat


def test_segments_that_open_past_the_audio_are_not_heard() -> None:
    """A full buffer's decode of 24.06 s wrote its last sentence five times, timed 23.96-28.96 s (seen live): the
    segments that open at or after the audio's end, and all after them, are dropped (then <|endoftext|>); the one
    that opens inside it stays (a word cut by the buffer's end is heard); an open last segment past the end goes
    too; a hypothesis within its audio is as it is."""
    n = int(4.06 * 16_000)
    within = (ts(0), 2, 4, 6, ts(2), ts(2), 8, 10, ts(3.96), ts(3.96), 12, 14)
    looped = (*within, ts(4.96), ts(4.96), 12, 14, ts(5.96), ts(5.96), 12, 14, ts(6.96), EOT)
    assert before_padding(looped, n, KINDS) == (*within, ts(4.96), EOT)
    assert before_padding((*within, ts(4.96), EOT), n, KINDS) == (*within, ts(4.96), EOT)
    open_past = (ts(0), 2, 4, 6, ts(2), ts(4.06), 8, 10)  # its open segment opens at the audio's end
    assert before_padding(open_past, n, KINDS) == (ts(0), 2, 4, 6, ts(2), EOT)
    assert before_padding(open_past, n + 320, KINDS) == open_past
    assert before_padding((ts(4.5), 2, 4, ts(5)), n, KINDS) == (EOT,)

    quiet = speech_between()
    assert step_heard(looped, quiet, 0, n, KINDS, say) == (*within, ts(4.96), EOT)
    # one word timed over 3.9 s of speech (drifted): its later segments are late, not guessed
    drifted_first = (ts(0), 2, ts(3.9), ts(3.9), 8, 10, ts(3.96), ts(3.96), 12, 14, ts(4.96), ts(4.96), 12, 14,
                     ts(5.96), EOT)
    assert step_heard(drifted_first, speech_between((0.0, 3.9)), 0, n, KINDS, say) == drifted_first


def test_the_token_budget_holds_the_fastest_live_speech_and_cuts_a_loop() -> None:
    """TOKENS_PER_S a second and TOKEN_SLACK more, the prefix counted, TOKEN_SLACK at least: a 12 s buffer may
    say 160 tokens (the traces' fastest live hypothesis over 10 s said 5 a second; their loops ran to 445)."""
    assert token_budget(12 * 16_000, 0) == 160 == TOKENS_PER_S * 12 + TOKEN_SLACK
    assert token_budget(12 * 16_000, 60) == 100  # 60 of them forced: 100 to generate
    assert token_budget(0, 0) == TOKEN_SLACK == token_budget(16_000, 400)  # never less than the slack
    assert token_budget(16_001, 0) == 29  # a started second's tokens, rounded up
    assert token_budget(30 * 16_000, 0) < 445


def test_settled_segments_end_settled_s_before_the_audio() -> None:
    closed = segments([ts(0), *words(4), ts(2), ts(2), *words(3), ts(4), ts(4), *words(2), ts(4.9), EOT], KINDS)
    n = 5 * 16_000
    assert [settled_end(closed, n, s) for s in (0.1, 1.0, 2.0, 3.5)] == [9, 7, 4, 0]
    assert settled_end(closed, n, 4.5) == 0
    assert settled_end(segments([ts(0), ts(0), EOT], KINDS), n, 0.1) == 0  # a segment ending at 0 settles nothing


def test_a_cut_goes_to_the_quietest_frame_near_a_segment_end_unless_all_there_is_speech() -> None:
    probs = np.full(200, 0.9, np.float32)
    probs[100] = 0.1  # frame 100: stream samples 51,200-51,712, 3.2-3.232 s
    start = 16_000  # the buffer starts at 1 s: the pause is 2.2-2.232 s into it
    assert pause_near(probs, start, round(2.0 / 0.02), 0.5) == (100 * FRAME_SAMPLES + 256 - start) // 320
    assert pause_near(probs, start, round(2.8 / 0.02), 0.5) is None  # 0.57 s away: past PAUSE_SEARCH_S
    assert pause_near(np.full(200, 0.9, np.float32), start, 100, 0.5) is None  # no pause
    assert pause_near(probs, start, round(20.0 / 0.02), 0.5) is None  # beyond the frames scored so far


def test_a_last_segment_guessed_past_the_audio_is_left_out() -> None:
    # the slice's cut last line: 16.6 s of audio, "Because" heard in its last 0.34 s, ten words timed to 19 s
    for start_s in (0.0, 43.4):
        start, n = int(start_s * 16_000), int(16.6 * 16_000)
        said = [ts(0), *words(9), ts(14), ts(14)]
        guessed = (*said, *words(10), ts(19), EOT)
        voiced = speech_after(start_s, (0.5, 13.5), (16.26, 16.6))
        closed = segments(guessed, KINDS)
        assert before_guess(guessed, closed, voiced, start, n, KINDS) == (*said[:-1], EOT)
        heard = speech_after(start_s, (0.5, 13.5), (15.5, 16.6))  # 1.1 s of speech for ten words: heard
        assert before_guess(guessed, closed, heard, start, n, KINDS) == guessed
        ends_in = (*said, *words(10), ts(16.9), EOT)  # ends 0.3 s past the audio: not guessed into the padding
        assert before_guess(ends_in, segments(ends_in, KINDS), voiced, start, n, KINDS) == ends_in
        assert before_guess(guessed, closed, np.zeros(0, bool), start, n, KINDS) == guessed  # no frames scored
    # a real last sentence timed late (opened at 15 s, its speech from 10.5 s): counted from the segment before
    late = (ts(0), *words(9), ts(10), ts(15), *words(20), ts(19), EOT)
    voiced_late = speech_between((0.5, 9.5), (10.5, 16.6))
    assert before_guess(late, segments(late, KINDS), voiced_late, 0, int(16.6 * 16_000), KINDS) == late
    only = (ts(0), *words(5), ts(3), EOT)  # the only segment: nothing is left
    assert before_guess(only, segments(only, KINDS), speech_between((0.0, 0.2)), 0, 16_000, KINDS) == (EOT,)



def test_a_streams_rate_follows_what_its_hypotheses_said_and_doubles_after_a_cut() -> None:
    """English at ~4 tokens a second keeps the floor; a script of 18 a second (Hindi) gets twice its median; each
    re-decode in a row that ran out doubles it (a budget too small for dense speech grows until it fits)."""
    assert budget_rate([], 0) == TOKENS_PER_S
    assert budget_rate([4.3, 5.0, 3.9], 0) == TOKENS_PER_S
    assert budget_rate([18.0, 17.0, 40.0], 0) == RATE_MARGIN * 18.0  # the median: one loop that ended weighs nothing
    assert budget_rate([], 1) == 2 * TOKENS_PER_S and budget_rate([18.0], 2) == 4 * RATE_MARGIN * 18.0
    assert budget_rate([], 50) == 32 * TOKENS_PER_S  # bounded
    assert token_budget(10 * 16_000, 0, budget_rate([18.0], 0)) == 376
    assert hypothesis_rate(60, 10 * 16_000) == 6.0
    assert hypothesis_rate(6, 8_000) == 3.0  # a 0.5 s buffer's rate over 2 s
