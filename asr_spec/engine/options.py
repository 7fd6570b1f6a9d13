"""Decoding options of the engine: one frozen dataclass, validated in one place."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

DraftSchedule = Literal["constant", "heuristic"]


@dataclass(frozen=True)
class DecodeOptions:
    """How to decode every chunk. Derive variants with `dataclasses.replace`.

    The output never depends on the draft settings: the target decides every token (lossless speculation).
    """

    language: str | None = None  # "en", "english" or "<|en|>"; None = detect per chunk (multilingual models)
    task: Literal["transcribe", "translate"] = "transcribe"
    timestamps: bool = False  # Whisper timestamp mode (segment start/end tokens) instead of <|notimestamps|>
    max_new_tokens: int | None = None  # None = up to the model's max_target_positions (448 for Whisper)
    # K, and how it changes: "constant", or "heuristic" (per row: K+2 after a full accept, K-1 otherwise, as
    # transformers' num_assistant_tokens_schedule). Defaults by measurement on whisper-base drafts (CPU, batch 4,
    # scripts/tune_draft_length.py and `asr-spec distill eval`): constant beat heuristic at every K, and K=3 was
    # fastest (README, "Choosing K").
    num_draft_tokens: int = 3
    draft_schedule: DraftSchedule = "constant"
    max_draft_tokens: int = 12  # upper bound for the heuristic schedule
    draft_confidence: float = 0.0  # a row stops drafting once the draft's top probability drops below this

    def __post_init__(self) -> None:
        if self.task not in ("transcribe", "translate"):
            raise ValueError(f"task must be 'transcribe' or 'translate', got {self.task!r}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {self.num_draft_tokens}")
        if self.draft_schedule not in ("constant", "heuristic"):
            raise ValueError(f"draft_schedule must be 'constant' or 'heuristic', got {self.draft_schedule!r}")
        if self.max_draft_tokens < self.num_draft_tokens:
            raise ValueError(
                f"max_draft_tokens ({self.max_draft_tokens}) must be >= num_draft_tokens ({self.num_draft_tokens})"
            )
        if not 0.0 <= self.draft_confidence < 1.0:
            raise ValueError(f"draft_confidence must be in [0, 1), got {self.draft_confidence}")

    @property
    def k_max(self) -> int:
        """Largest number of draft tokens a step can propose."""
        return self.num_draft_tokens if self.draft_schedule == "constant" else self.max_draft_tokens
