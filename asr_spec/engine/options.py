"""Decoding options of the engine: one frozen dataclass, validated in one place."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np


def check_int(value: Any, name: str, minimum: int, error: type[Exception] = ValueError) -> None:
    """The one integer check of the project: `value` must be an int (not a bool) >= `minimum`; raises `error`
    (the engine raises ValueError; the layers above pass `asr_spec.errors.InputError`)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise error(f"{name} must be an integer >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class DecodeOptions:
    """How to decode every chunk. Derive variants with `dataclasses.replace`.

    The output never depends on the draft settings: the target decides every token (lossless speculation).
    """

    # "en", "english" or "<|en|>"; None = detect (multilingual models): per chunk, or per `ChunkRequest.language_group`
    language: str | None = None
    task: Literal["transcribe", "translate"] = "transcribe"
    timestamps: bool = False  # Whisper timestamp mode (segment start/end tokens) instead of <|notimestamps|>
    max_new_tokens: int | None = None  # None = up to the model's max_target_positions (448 for Whisper)
    # K, draft tokens proposed per step. By measurement on whisper-base drafts (CPU, batch 4,
    # benchmarks/tune_draft_length.py and `asr-spec distill eval`) K=3 was fastest (docs/measurements.md, "Choosing K").
    num_draft_tokens: int = 3
    # CUDA only: run the step as one CUDA graph per (rows, n_keys bucket, K), captured lazily. False keeps the
    # eager step (the tests' reference, --no-graphs); the tokens are the same either way.
    cuda_graphs: bool = True
    # CPU fp32: a draft that reads the target's encoder output runs its decoder in bf16 (oneDNN, where the CPU has
    # bf16 instructions): a draft pass reads half the bytes; only its proposals change, never the output
    draft_bf16: bool = True
    # CPU fp32 where a bf16 product runs the head (native bf16, or the thin kernel: head.approximate_product): the
    # target's output head is read in bf16 and certified (engine/head.py: every decision, hence every token, is
    # the fp32 head's); False reads it in fp32
    certified_head: bool = True
    # The draft decodes only runs of at most this many rows (batch slots: min(batch size, chunks to decode)); larger
    # runs decode greedily without it (on a CPU a verify pass of several rows is compute-bound). None: every run;
    # at least 1 (a run that never drafts is a run without a draft).
    draft_max_rows: int | None = None
    # Hypothesis drafting: tokens a request offers (`ChunkRequest.hypothesis`, a stream's previous hypothesis)
    # proposed per step while they last and agree, all verified in one target pass (a window of this + 1)
    num_hypothesis_tokens: int = 16

    def __post_init__(self) -> None:
        if self.language is not None and (not isinstance(self.language, str) or not self.language.strip()):
            raise ValueError(f"language must be a language code or name, or auto (None in Python) to detect it, got "
                             f"{self.language!r}")
        if self.language is not None:
            language_code(self.language)  # known to Whisper: checked before any model loads
        if isinstance(self.task, str):  # "Translate" as "translate", as a language's name is taken in any case
            object.__setattr__(self, "task", self.task.strip().lower())
        if self.task not in ("transcribe", "translate"):
            raise ValueError(f"task must be 'transcribe' or 'translate', got {self.task!r}")
        for name in ("timestamps", "cuda_graphs", "draft_bf16", "certified_head"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.max_new_tokens is not None:
            check_int(self.max_new_tokens, "max_new_tokens", 1)
        check_int(self.num_draft_tokens, "num_draft_tokens", 1)
        check_int(self.num_hypothesis_tokens, "num_hypothesis_tokens", 1)
        if self.draft_max_rows is not None:
            check_int(self.draft_max_rows, "draft_max_rows", 1)

    def drafts(self, n_rows: int) -> bool:
        """Whether a run of `n_rows` rows (batch slots) decodes with the draft, when one is loaded: the one home of
        the draft_max_rows rule (the engine's memory check and its allocation both ask it)."""
        return self.draft_max_rows is None or n_rows <= self.draft_max_rows


def is_auto(language: Any) -> bool:
    """Whether a language option says "auto" (detect it), in any case: the one spelling of it the options and the
    presets' draft rule read."""
    return isinstance(language, str) and language.strip().lower() == "auto"


def language_code(language: str) -> str:
    """Whisper's code of a language given as a code, a name or a token ("en", "English", "<|en|>" -> "en");
    ValueError naming it when Whisper has no such language (found when the engine was built, after the models
    loaded, before)."""
    from transformers.models.whisper.tokenization_whisper import LANGUAGES, TO_LANGUAGE_CODE

    lang = language.lower().strip()
    code = TO_LANGUAGE_CODE.get(lang, lang).strip("<|>")
    if code not in LANGUAGES:
        raise ValueError(f"language {language!r} is not one Whisper knows (a code such as 'en' or a name such as "
                         "'english')")
    return code
