"""Decoding options of the engine: one frozen dataclass, validated in one place."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class DecodeOptions:
    """How to decode every chunk. Derive variants with `dataclasses.replace`.

    The output never depends on the draft settings: the target decides every token (lossless speculation).
    """

    language: str | None = None  # "en", "english" or "<|en|>"; None = detect per chunk (multilingual models)
    task: Literal["transcribe", "translate"] = "transcribe"
    timestamps: bool = False  # Whisper timestamp mode (segment start/end tokens) instead of <|notimestamps|>
    max_new_tokens: int | None = None  # None = up to the model's max_target_positions (448 for Whisper)
    # K, draft tokens proposed per step. By measurement on whisper-base drafts (CPU, batch 4,
    # scripts/tune_draft_length.py and `asr-spec distill eval`) K=3 was fastest (README, "Choosing K").
    num_draft_tokens: int = 3
    # Whisper's no-speech rule (openai-whisper `transcribe()` defaults): a window is dropped when the target's
    # <|nospeech|> probability at the <|startoftranscript|> position exceeds no_speech_threshold, unless the
    # average log-probability of its tokens exceeds logprob_threshold. None turns the rule (resp. the rescue) off.
    no_speech_threshold: float | None = 0.6
    logprob_threshold: float | None = -1.0

    def __post_init__(self) -> None:
        if self.task not in ("transcribe", "translate"):
            raise ValueError(f"task must be 'transcribe' or 'translate', got {self.task!r}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {self.num_draft_tokens}")
        t = self.no_speech_threshold
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t <= 1):
            raise ValueError(f"no_speech_threshold must be a probability in [0, 1] or None, got {t!r}")
        t = self.logprob_threshold
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t)):
            raise ValueError(f"logprob_threshold must be a finite number or None, got {t!r}")

    def is_no_speech(self, no_speech_prob: float, avg_logprob: float) -> bool:
        """Whisper's rule: drop the window when it is probably silent and its tokens are not confident."""
        if self.no_speech_threshold is None or not no_speech_prob > self.no_speech_threshold:
            return False
        return self.logprob_threshold is None or not avg_logprob > self.logprob_threshold
