"""A stream's speech frames (`asr_spec/stream/frames.py`): scored as blocks of any size arrive, and the cut near a
segment's end that the live policy trims at."""

from __future__ import annotations

import numpy as np

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
