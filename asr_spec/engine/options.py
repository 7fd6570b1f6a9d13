"""Decoding options of the engine: one frozen dataclass, validated in one place."""

from __future__ import annotations

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

    def __post_init__(self) -> None:
        if self.task not in ("transcribe", "translate"):
            raise ValueError(f"task must be 'transcribe' or 'translate', got {self.task!r}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {self.num_draft_tokens}")
