"""Whisper's no-speech rule: leave out the text of a window the model itself calls silent.

openai-whisper's `transcribe()` (and faster-whisper's) skips a window when the probability of `<|nospeech|>` at
the start-of-transcript position exceeds `no_speech_threshold` (0.6), unless the window's average token
log-probability exceeds `logprob_threshold` (-1.0). Before that check it re-decodes, at rising temperatures, any
window that "needs fallback": average log-probability below -1.0 or a text so repetitive that its zlib
compression ratio exceeds `compression_ratio_threshold` (2.4).

Without fallback (asr-spec's `temperature` (0,): greedy only, what keeps every window identical to greedy) a window
that would need one for repetition keeps its looped text, and the confidence of a loop is high: on 60 s of
near-silence whisper-base detects Welsh and repeats "yw'n" with an average log-probability of -0.38. So then a
window is rescued by its confidence only when Whisper would have accepted it at temperature 0, i.e. when its
compression ratio is within the threshold too:

    dropped = no_speech_prob > no_speech_threshold
              and not (avg_logprob > logprob_threshold and compression_ratio <= compression_ratio_threshold)

With fallback (a schedule of several temperatures, fallback.py) the repetition is fallback's to cure, and the rule
is Whisper's exactly, on the window's final result:

    dropped = no_speech_prob > no_speech_threshold and not avg_logprob > logprob_threshold

Every input to the rule comes from the target model alone (`engine.ChunkResult`), so the decision is the same with
or without a draft.
"""

from __future__ import annotations

from dataclasses import dataclass

from asr_spec.checks import is_number
from asr_spec.errors import InputError
from asr_spec.stream.agreement import compression_ratio  # Whisper's, shared with the live policy's loop rule

__all__ = ["NoSpeechRule", "compression_ratio"]

NO_SPEECH = "no speech"  # the reason a ChunkReport gives for a dropped window


@dataclass(frozen=True)
class NoSpeechRule:
    """Thresholds of the rule (Whisper's defaults). no_speech_threshold None turns the rule off; logprob_threshold
    None means no window is rescued by its confidence (as in Whisper); compression_ratio_threshold None drops the
    repetition condition (Whisper's rule exactly)."""

    no_speech_threshold: float | None = 0.6  # P(<|nospeech|>) above which a window may be dropped
    logprob_threshold: float | None = -1.0  # ...unless its average token log-probability is above this
    compression_ratio_threshold: float | None = 2.4  # ...and its text is not more repetitive than this

    def __post_init__(self) -> None:
        t = self.no_speech_threshold
        if t is not None and not (is_number(t) and 0 <= t <= 1):
            raise InputError(f"no_speech_threshold must be a probability in [0, 1] or None, got {t!r}")
        for name in ("logprob_threshold", "compression_ratio_threshold"):
            value = getattr(self, name)
            if value is not None and not is_number(value):
                raise InputError(f"{name} must be a finite number or None, got {value!r}")

    @property
    def enabled(self) -> bool:
        return self.no_speech_threshold is not None

    def drops(self, no_speech_prob: float, avg_logprob: float, text: str, fallback: bool = False) -> bool:
        """Whether a window with these statistics and decoded `text` is left out; fallback: it went through
        temperature fallback (Whisper's rule exactly, without the repetition condition)."""
        if self.no_speech_threshold is None or not no_speech_prob > self.no_speech_threshold:
            return False
        confident = self.logprob_threshold is not None and avg_logprob > self.logprob_threshold
        return not (confident and (fallback or not self.loops(text)))

    def loops(self, text: str) -> bool:
        """Whether `text` is more repetitive than Whisper accepts (compression ratio over the threshold; never when
        the threshold is None)."""
        threshold = self.compression_ratio_threshold
        return threshold is not None and compression_ratio(text) > threshold
