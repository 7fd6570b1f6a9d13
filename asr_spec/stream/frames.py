"""The speech of one stream, frame by frame: a voice function's score of every FRAME_SAMPLES frame as the audio
arrives, and the questions the live policy asks of it, against one threshold in one place.

    frames = SpeechFrames(voice, threshold)   # voice: VoiceFn or None (no voice activity: no frame is scored)
    frames.feed(samples)                      # (n,) float32 16 kHz; whole frames are scored, the rest waits
    frames.forget_before(sample)              # the frames before the one holding stream `sample` are let go
    frames.heard_from(start)                  # (speech, start) for `hearing`'s functions, both from the kept frames
    frames.speech_from(sample)                # indices of the speech frames from the one holding stream `sample`
    frames.may_speak_from(sample)             # any of them (or unscored: it may)
    frames.any_between(first, end)            # any speech frame touching stream samples [first, end)
    frames.cut_near(start, end_ts)            # where to cut a buffer for a segment's end (`hearing.pause_near`)
    frames.cut_after(start, end_ts)           # at the first pause after it (`hearing.first_pause`)
    frames.close_point(start, received, silence, pad)   # where an utterance closes, once silence follows it

Only the frames from the live buffer's start on are kept (the policy lets the others go as its buffer moves on):
a stream that runs for hours holds a buffer's worth of frames, and a feed copies no more than that.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from asr_spec.stream.agreement import SAMPLES_PER_TIMESTAMP
from asr_spec.stream.hearing import FRAME_SAMPLES, first_pause, frame_cut, pause_near

VoiceFn = Callable[[np.ndarray], np.ndarray]  # (n_frames * FRAME_SAMPLES,) samples -> (n_frames,) speech prob

__all__ = ["SpeechFrames", "VoiceFn"]


class SpeechFrames:
    """The speech probability of every kept frame of one stream (`probs`) and whether it is speech (`speech`:
    probability at or above `threshold`); without a voice function nothing is scored and no frame is speech.
    Kept: the frames from stream frame `first_frame` on (`forget_before`)."""

    def __init__(self, voice: VoiceFn | None, threshold: float):
        self.voice, self.threshold = voice, threshold
        self._unframed = np.zeros(0, np.float32)  # samples not yet scored (< one frame)
        self.first_frame = 0  # stream frame index of probs[0]
        self.probs = np.zeros(0, np.float32)  # (n_kept,) speech probability of each kept frame
        self.speech = np.zeros(0, bool)  # (n_kept,) probs >= threshold

    @property
    def scored(self) -> bool:
        """A voice function scores the frames (else the policy decodes and cuts by timestamps alone)."""
        return self.voice is not None

    def feed(self, block: np.ndarray) -> None:
        """Score the whole frames of the stream's next (n,) float32 samples; a partial frame waits for the next."""
        if self.voice is None:
            return
        pending = np.concatenate([self._unframed, block])
        n = len(pending) // FRAME_SAMPLES * FRAME_SAMPLES
        if n:
            probs = np.asarray(self.voice(pending[:n]), np.float32)
            self.probs = np.concatenate([self.probs, probs])
            self.speech = np.concatenate([self.speech, probs >= self.threshold])
        self._unframed = pending[n:]

    def forget_before(self, sample: int) -> None:
        """Let go of the frames before the one holding stream sample `sample`: nothing before it is asked again."""
        n_drop = min(sample // FRAME_SAMPLES - self.first_frame, len(self.probs))
        if n_drop > 0:
            self.probs, self.speech = self.probs[n_drop:], self.speech[n_drop:]
            self.first_frame += n_drop

    def heard_from(self, start: int) -> tuple[np.ndarray, int]:
        """(speech, start) for `hearing`'s functions (`speech`: frame i stream samples [i * FRAME_SAMPLES, ...)
        of the stream, `start` a stream sample), both counted from the first kept frame: what they find is the
        same, in samples or frames from `start`."""
        return self.speech, self._local(start)

    def _local(self, sample: int) -> int:
        """Stream sample `sample` counted from the first kept frame's first sample."""
        local = sample - self.first_frame * FRAME_SAMPLES
        if local < 0:
            raise ValueError(f"stream sample {sample} lies before the kept frames (from frame {self.first_frame})")
        return local

    def speech_from(self, sample: int) -> np.ndarray:
        """Indices (stream frames) of the speech frames from the one that holds stream sample `sample` on."""
        first = self._local(sample) // FRAME_SAMPLES
        return self.first_frame + first + np.flatnonzero(self.speech[first:])

    def may_speak_from(self, sample: int) -> bool:
        """Whether the audio from stream sample `sample` on may hold speech: a speech frame there, or unscored."""
        return self.voice is None or len(self.speech_from(sample)) > 0

    def any_between(self, first_sample: int, end_sample: int) -> bool:
        """Whether any frame touching stream samples [first_sample, end_sample) is speech."""
        first, end = self._local(first_sample), self._local(max(first_sample, end_sample))
        return bool(self.speech[first // FRAME_SAMPLES:-(-end // FRAME_SAMPLES)].any())

    def cut_near(self, start: int, end_ts: int) -> int | None:
        """Where to cut a buffer starting at stream sample `start` for a segment ending at `end_ts` (timestamp steps
        from `start`): at a pause near it (`hearing.pause_near`; None: none there); unscored, at the end itself.
        None too where the cut would be at the buffer's start: it would cut no audio, and a trim there would still
        drop the segment's committed words from the buffer's record while their audio stays (said again)."""
        cut = end_ts if self.voice is None else pause_near(self.probs, self._local(start), end_ts, self.threshold)
        return cut if cut is not None and cut > 0 else None

    def cut_after(self, start: int, end_ts: int) -> int | None:
        """Where to cut a buffer starting at stream sample `start` at the first pause at or after a segment's end
        (`end_ts`, timestamp steps from `start`): the middle of the first frame there that is not speech, in
        timestamp steps from `start`; None without one (or unscored, or at the buffer's start)."""
        if self.voice is None:
            return None
        local = self._local(start)
        pause = first_pause(self.speech, (local + end_ts * SAMPLES_PER_TIMESTAMP) // FRAME_SAMPLES)
        cut = None if pause is None else frame_cut(pause, local)
        return cut if cut else None

    def close_point(self, start: int, received: int, silence: int, pad: int) -> int | None:
        """The stream sample an utterance of a buffer starting at stream sample `start` closes at (its last speech
        frame's end plus `pad` samples) when `silence` samples or more of the `received` so far follow it; None
        otherwise (or unscored, or no speech from `start` on)."""
        speech = self.speech_from(start)
        if self.voice is None or not len(speech):
            return None
        speech_end = (int(speech[-1]) + 1) * FRAME_SAMPLES
        return speech_end + pad if received - speech_end >= silence else None
