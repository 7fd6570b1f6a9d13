"""Speculative-decoding statistics: one type for a chunk, a file or a whole run (summed with `add` / `total`)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, replace
from typing import Any


@dataclass(frozen=True)
class ChunkStats:
    """Counts of one chunk, or summed over chunks; the two ratios are derived (and serialised by `asdict`)."""

    chunks: int = 1
    generated_tokens: int = 0
    target_passes: int = 0  # target forward passes (steps) over the row, the admission prefill not counted
    draft_passes: int = 0
    drafted_tokens: int = 0  # draft tokens offered for verification
    accepted_tokens: int = 0  # of those, accepted by the target
    accepted_hist: tuple[int, ...] = ()  # accepted_hist[j] = steps that accepted j draft tokens
    hypothesis_offered: int = 0  # tokens of the request's hypothesis proposed for verification (engine/hypothesis.py)
    hypothesis_accepted: int = 0  # of those, accepted by the target
    acceptance_rate: float = field(init=False)  # accepted_tokens / drafted_tokens (0 without a draft)
    tokens_per_target_pass: float = field(init=False)  # generated / target passes (1 greedy, up to K+1)

    def __post_init__(self) -> None:
        rate = self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0
        per_pass = self.generated_tokens / self.target_passes if self.target_passes else 0.0
        object.__setattr__(self, "acceptance_rate", rate)
        object.__setattr__(self, "tokens_per_target_pass", per_pass)

    def add(self, other: ChunkStats) -> ChunkStats:
        hist = itertools.zip_longest(self.accepted_hist, other.accepted_hist, fillvalue=0)
        return ChunkStats(
            self.chunks + other.chunks, self.generated_tokens + other.generated_tokens,
            self.target_passes + other.target_passes, self.draft_passes + other.draft_passes,
            self.drafted_tokens + other.drafted_tokens, self.accepted_tokens + other.accepted_tokens,
            tuple(a + b for a, b in hist), self.hypothesis_offered + other.hypothesis_offered,
            self.hypothesis_accepted + other.hypothesis_accepted,
        )

    @classmethod
    def total(cls, items: Iterable[ChunkStats]) -> ChunkStats:
        """The sum of `items` (no chunk at all: zeros)."""
        out = cls(chunks=0)
        for item in items:
            out = out.add(item)
        return out

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> ChunkStats:
        """Back from ``dataclasses.asdict(stats)`` (or a record holding its keys; other keys are ignored; the
        derived ratios are recomputed)."""
        counts = {f.name: values[f.name] for f in fields(cls) if f.init and f.name in values}
        if "accepted_hist" in counts:
            counts["accepted_hist"] = tuple(counts["accepted_hist"])
        return cls(**counts)

    @classmethod
    def count_names(cls) -> tuple[str, ...]:
        """The counts (the fields summed by `add`), without the derived ratios."""
        return tuple(f.name for f in fields(cls) if f.init)


@dataclass
class StageTimes:
    """Wall seconds an engine spent in its stages since it was made, on a CPU (where each stage's work is done when
    it returns; on CUDA the stages run asynchronously and nothing is counted). `minus` gives one run's share."""

    encoder_s: float = 0.0  # encoder passes (`encoding.ChunkEncoder`, the draft's own encoder included)
    steps_s: float = 0.0  # decode steps: draft, verify, accept (`speculative.step`)
    steps: int = 0
    admit_s: float = 0.0  # admissions: audio keys/values, prompts and prefixes prefilled (`admission.Admission`)
    encoder_calls: int = 0  # target encoder calls (`ChunkEncoder`, any device): windows encoded together count once
    encoder_windows: int = 0  # the windows they encoded

    def minus(self, before: StageTimes) -> StageTimes:
        return StageTimes(*(getattr(self, f.name) - getattr(before, f.name) for f in fields(self)))

    def copy(self) -> StageTimes:
        return replace(self)

    @contextmanager
    def count(self, stage: str, enabled: bool) -> Iterator[None]:
        """Adds the wall time of the block to `stage` ("encoder" or "steps", which also counts one step) when
        `enabled`."""
        start = time.perf_counter()
        yield
        if enabled:
            setattr(self, f"{stage}_s", getattr(self, f"{stage}_s") + time.perf_counter() - start)
            self.steps += stage == "steps"
