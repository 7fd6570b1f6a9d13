"""How a stream's buffer is committed and cut: the commit and trim steps of `StreamPolicy` (`stream/policy.py`),
which reads each decode's result and calls them.

- `_commit`: text tokens appended to the committed text (never taken back);
- `_trim_committed`: once closed segments are wholly committed, the buffer cut at a pause near the end of the latest
  one that leaves `context_s` of committed left context (or, after a segment Whisper skipped speech from, restarted
  at that speech: `_restart_after`);
- `_force_trim`: a full buffer's closed segments but the last one committed by force and cut after;
- `_trim`: the cut itself: the audio, the committed words of the segments cut, the hypotheses' words before the cut
  (the last one kept shifted to the new start, the one before it for two of the last three) and the seam words a
  cut back over speech may say again;
- `_reset_after`: the buffer started afresh after an utterance.

`BufferTrims` is a mixin over the policy's state (the attributes declared below, set by `StreamPolicy.__init__`):
the policy's reading of results (its flows) and the buffer's cuts (these steps) are apart, each one place.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from asr_spec.stream.agreement import (
    SAMPLE_RATE,
    SAMPLES_PER_TIMESTAMP,
    SegmentEnd,
    TokenKinds,
    aligned_end,
    last_words,
    segments,
    shifted,
)
from asr_spec.stream.frames import SpeechFrames
from asr_spec.stream.options import StreamOptions

# committed words a buffer may say again after a cut before their segment's end (Whisper-base times segment ends to
# the second: a live run cut back to a pause 1.5 s inside a segment and said its last five words twice, another its
# last three at 2), a restart where a close decode stopped short, or one after speech a step jumped over (dropped)
SEAM_WORDS = 8


class BufferTrims:
    """The commit and trim steps of a stream's buffer (see the module docstring)."""

    kinds: TokenKinds
    detokenize: Callable[[Sequence[int]], str]
    options: StreamOptions
    _word_key: Callable[[tuple[int, ...]], str]
    _frames: SpeechFrames
    _buffer: np.ndarray  # (n,) float32: the uncommitted audio
    _start: int  # stream sample of _buffer[0]
    _previous: tuple[int, ...]  # the last hypothesis, relative to the buffer's start
    _earlier: list[int]  # the text tokens of the hypothesis before it
    _committed: list[int]  # text tokens committed in the buffer
    _seam: list[int]  # committed text tokens the buffer's start may say again
    _close_end: int | None
    _text: str  # all committed text

    def _commit(self, piece: list[int]) -> str:
        """Commit the text tokens `piece` (they follow what is committed); returns the delta text."""
        if not piece:
            return ""
        self._committed.extend(piece)
        delta = self.detokenize(piece)
        self._text += delta
        return delta

    def _trim_committed(self, hypothesis: tuple[int, ...], new_text: list[int], said: int,
                        before_skip: SegmentEnd | None) -> None:
        """Trim the buffer after the last closed segment whose text is all committed (within the hypothesis's
        first `said` text tokens) and that ends `context_s` or more before the last such segment's end, at a pause
        near its end (`SpeechFrames.cut_near`); a segment with no pause there is not trimmed yet. The committed
        segments after the cut stay in the buffer, their words forced as the next decodes' prefix (left context).
        Once `before_skip` (the segment after which the hypothesis skipped speech) is committed, the buffer restarts
        at that speech instead (`_restart_after`)."""
        done = [s for s in segments(hypothesis, self.kinds) if 0 < s.text_end <= said]
        if not done:
            return
        if done[-1] == before_skip:  # no left context: Whisper would read on from it past the speech again
            self._restart_after(hypothesis, new_text, before_skip)
            return
        latest_ts = done[-1].end_ts - self._seconds(self.options.context_s) // SAMPLES_PER_TIMESTAMP
        for segment in reversed([s for s in done if s.end_ts <= latest_ts]):
            cut = self._frames.cut_near(self._start, segment.end_ts)
            if cut is not None:
                self._trim(hypothesis, new_text, segment, cut)
                return

    def _restart_after(self, hypothesis: tuple[int, ...], new_text: list[int], segment: SegmentEnd) -> None:
        """Trim the buffer at a pause near the end of `segment`, after which the hypothesis skipped speech (or, where
        its own words run on past that end, at the first pause after it), so that the next decode starts at that
        speech; committed words it says again at its start are dropped (`segment`'s end may be early)."""
        cut = self._frames.cut_near(self._start, segment.end_ts)
        if cut is None:
            cut = self._frames.cut_after(self._start, segment.end_ts)
        if cut is not None:
            self._trim(hypothesis, new_text, segment, cut)
            self._seam = last_words(new_text[:segment.text_end], SEAM_WORDS, self.kinds)

    def _force_trim(self, hypothesis: tuple[int, ...], new_text: list[int], said: int,
                    timed: list[SegmentEnd], decoded: int) -> str:
        """A full buffer: commit its closed segments but the last one (the only one: it) and trim after them; with
        no closed segment, commit everything and start afresh after the audio it was decoded from (`decoded`
        samples from the buffer's start: a decode reads at most a window, and a buffer fed in large blocks may hold
        more, which is decoded next). Only `timed` count: its closed segments timed as they heard
        (`hearing.Timing.timed`: a drifted hypothesis's text is still its reading of the buffer, its timestamps are
        not; a skip's later segments wait for that speech to be heard). `said`: the hypothesis's text tokens
        committed already. Returns the text committed."""
        closed = [s for s in timed if s.end_ts > 0]
        if not closed:
            delta = self._commit(new_text[said:])
            self._reset_after(self._start + decoded)
            return delta
        segment = closed[-2] if len(closed) > 1 else closed[0]
        delta = self._commit(new_text[said:segment.text_end])
        cut = self._frames.cut_near(self._start, segment.end_ts)
        self._trim(hypothesis, new_text, segment, segment.end_ts if cut is None else cut)
        return delta

    def _trim(self, hypothesis: tuple[int, ...], new_text: list[int], segment: SegmentEnd, cut_ts: int) -> None:
        """Drop the buffer's first `cut_ts` timestamp steps and the committed text of `segment` and those before
        (the committed words that new_text's first `segment.text_end` tokens say); the hypothesis's tokens after
        the segment stay, shifted to the new start."""
        cut = min(cut_ts * SAMPLES_PER_TIMESTAMP, len(self._buffer))
        end = min(segment.end_samples, len(self._buffer))
        back_over_speech = cut < end and self._frames.any_between(self._start + cut, self._start + end)
        self._seam = last_words(new_text[:segment.text_end], SEAM_WORDS, self.kinds) if back_over_speech else []
        self._drop_head(cut)
        self._close_end = None
        self._committed, self._earlier = (
            text[aligned_end(new_text[:segment.text_end], text, self.kinds, self._word_key):]
            for text in (self._committed, self._earlier))
        self._previous = shifted(hypothesis[segment.end_index + 1:], cut // SAMPLES_PER_TIMESTAMP, self.kinds)

    def _reset_after(self, end_sample: int) -> None:
        """Start the buffer afresh at stream sample `end_sample` (an utterance closed there)."""
        self._drop_head(max(0, min(end_sample - self._start, len(self._buffer))))
        self._previous, self._committed, self._seam, self._close_end, self._earlier = (), [], [], None, []

    def _drop_head(self, n_samples: int) -> None:
        """The buffer without its first `n_samples`: it starts that much later, and the speech frames before it
        are let go (nothing before the buffer's start is asked of them again)."""
        self._buffer = self._buffer[n_samples:]
        self._start += n_samples
        self._frames.forget_before(self._start)

    @staticmethod
    def _seconds(seconds: float) -> int:
        return int(round(seconds * SAMPLE_RATE))
