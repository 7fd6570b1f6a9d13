"""A stream's speech frames (`asr_spec/stream/frames.py`): scored as blocks of any size arrive, and the cut near a
segment's end that the live policy trims at."""

from __future__ import annotations

import numpy as np
import pytest

from asr_spec.stream.frames import SpeechFrames
from asr_spec.stream.hearing import FRAME_SAMPLES


def loud(samples: np.ndarray) -> np.ndarray:
    """A voice function: a frame's probability is its largest absolute sample."""
    return np.abs(samples.reshape(-1, FRAME_SAMPLES)).max(1)


def test_frames_are_scored_whole_whatever_the_blocks() -> None:
    audio = np.zeros(10 * FRAME_SAMPLES, np.float32)
    audio[3 * FRAME_SAMPLES + 7] = audio[7 * FRAME_SAMPLES] = 0.9
    frames = SpeechFrames(loud, 0.5)
    for i in range(0, len(audio), 700):  # blocks that split frames
        frames.feed(audio[i:i + 700])
    assert frames.speech.tolist() == [i in (3, 7) for i in range(10)]
    assert frames.speech_from(3 * FRAME_SAMPLES + 100).tolist() == [3, 7]  # from the frame holding that sample
    assert frames.speech_from(4 * FRAME_SAMPLES).tolist() == [7]
    assert frames.any_between(4 * FRAME_SAMPLES, 7 * FRAME_SAMPLES + 1)  # touches frame 7
    assert not frames.any_between(4 * FRAME_SAMPLES, 7 * FRAME_SAMPLES)
    assert frames.may_speak_from(7 * FRAME_SAMPLES) and not frames.may_speak_from(8 * FRAME_SAMPLES)
    unscored = SpeechFrames(None, 0.5)
    unscored.feed(audio)
    assert not unscored.scored and len(unscored.speech) == 0 and not unscored.any_between(0, len(audio))
    assert unscored.may_speak_from(len(audio))  # unscored: any audio may be speech


def test_a_cut_at_the_buffers_start_is_no_cut() -> None:
    """The quietest frame near a segment's end may hold the buffer's start (a buffer trimmed at a pause starts in
    the middle of a quiet frame): a cut there would cut nothing, so there is none (the policy trims later)."""
    audio = np.full(40 * FRAME_SAMPLES, 0.9, np.float32)
    audio[10 * FRAME_SAMPLES:11 * FRAME_SAMPLES] = 0.0  # frame 10 quiet
    frames = SpeechFrames(loud, 0.5)
    frames.feed(audio)
    start = 10 * FRAME_SAMPLES + FRAME_SAMPLES // 2  # the buffer starts mid-way through the quiet frame
    assert frames.cut_near(start, 10) is None  # a segment ending 0.2 s in: the quiet frame is at its start
    early = 10 * FRAME_SAMPLES - 5 * FRAME_SAMPLES  # a buffer from 5 frames earlier: the same pause is 0.17 s in
    assert frames.cut_near(early, 10) == (10 * FRAME_SAMPLES + FRAME_SAMPLES // 2 - early) // 320
    assert SpeechFrames(None, 0.5).cut_near(start, 10) == 10  # unscored: at the end itself
    assert SpeechFrames(None, 0.5).cut_near(start, 0) is None


def test_a_cut_after_a_segment_end_is_in_the_first_pause_after_it() -> None:
    audio = np.full(40 * FRAME_SAMPLES, 0.9, np.float32)
    audio[20 * FRAME_SAMPLES:22 * FRAME_SAMPLES] = 0.0  # frames 20 and 21 quiet
    frames = SpeechFrames(loud, 0.5)
    frames.feed(audio)
    start = 5 * FRAME_SAMPLES
    middle = (20 * FRAME_SAMPLES + FRAME_SAMPLES // 2 - start) // 320
    assert frames.cut_after(start, 10) == middle  # the end (0.2 s in, frame 5 + 6) runs on in speech to frame 20
    assert frames.cut_after(start, middle) == middle  # an end inside the pause: there
    assert frames.cut_after(start, (24 * FRAME_SAMPLES - start) // 320) is None  # speech to the last scored frame
    assert SpeechFrames(None, 0.5).cut_after(start, 10) is None



def test_an_utterance_closes_after_its_last_speech_frame_once_the_silence_has_come() -> None:
    audio = np.zeros(40 * FRAME_SAMPLES, np.float32)
    audio[5 * FRAME_SAMPLES:12 * FRAME_SAMPLES] = 0.9  # speech in frames 5-11, silence after
    frames = SpeechFrames(loud, 0.5)
    frames.feed(audio)
    end = 12 * FRAME_SAMPLES
    assert frames.close_point(0, len(audio), 28 * FRAME_SAMPLES, 100) == end + 100  # the silence is there
    assert frames.close_point(0, len(audio), 29 * FRAME_SAMPLES, 100) is None  # not yet
    assert frames.close_point(0, end + 3 * FRAME_SAMPLES, 3 * FRAME_SAMPLES, 0) == end
    assert frames.close_point(12 * FRAME_SAMPLES, len(audio), FRAME_SAMPLES, 0) is None  # no speech from there on
    assert SpeechFrames(None, 0.5).close_point(0, len(audio), FRAME_SAMPLES, 0) is None  # unscored: never


def test_forgotten_frames_change_no_answer_about_the_frames_kept() -> None:
    """A stream's frames from its buffer's start on are all the policy asks about: the ones before are let go
    (a stream of hours holds a buffer's worth), and every question from there on is answered as before."""
    rng = np.random.default_rng(0)
    audio = (rng.random(300 * FRAME_SAMPLES) > 0.97).astype(np.float32) * 0.9  # speech in ~3 % of the samples
    whole, kept = SpeechFrames(loud, 0.5), SpeechFrames(loud, 0.5)
    for i in range(0, len(audio), 3000):
        whole.feed(audio[i:i + 3000])
        kept.feed(audio[i:i + 3000])
        kept.forget_before(max(0, i - 5000))
    forgotten = range(0, len(audio), 3000)[-1] - 5000  # the last forget_before's sample
    start = forgotten + 77  # within the kept frames (not on a frame's edge)
    assert kept.first_frame == forgotten // FRAME_SAMPLES and len(kept.speech) < 20
    assert kept.speech_from(start).tolist() == whole.speech_from(start).tolist()
    for end_ts in (1, 7, 20):
        assert kept.cut_near(start, end_ts) == whole.cut_near(start, end_ts)
        assert kept.cut_after(start, end_ts) == whole.cut_after(start, end_ts)
    assert kept.any_between(start, len(audio)) == whole.any_between(start, len(audio))
    assert kept.close_point(start, len(audio), 2 * FRAME_SAMPLES, 9) == whole.close_point(
        start, len(audio), 2 * FRAME_SAMPLES, 9)
    speech, local = kept.heard_from(start)
    whole_speech, _ = whole.heard_from(start)
    assert speech.tolist() == whole_speech[kept.first_frame:].tolist() and local == start % FRAME_SAMPLES + (
        start // FRAME_SAMPLES - kept.first_frame) * FRAME_SAMPLES
    with pytest.raises(ValueError, match="before the kept frames"):
        kept.speech_from(kept.first_frame * FRAME_SAMPLES - 1)
