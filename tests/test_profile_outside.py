"""benchmarks/profile_outside.py: its parts are read from cProfile's figures of the functions named."""

from __future__ import annotations

import cProfile
import pstats

import numpy as np

from asr_spec.audio.vad import VadOptions, iter_vad_chunks
from benchmarks.profile_outside import PARTS, part_times


def test_a_part_sums_the_calls_of_its_function_and_the_others_stay_at_zero():
    def silence(samples: np.ndarray) -> np.ndarray:  # a VAD that hears nothing
        return np.zeros(len(samples) // 512, np.float32)

    profile = cProfile.Profile()
    for _ in range(2):
        profile.runcall(lambda: list(iter_vad_chunks([np.zeros(16_000, np.float32)], VadOptions(), silence)))
    parts = {part: (seconds, calls) for _, part, seconds, calls in part_times(pstats.Stats(profile))}
    assert len(parts) == len(PARTS)
    seconds, calls = parts["voice activity (silero + planning)"]
    assert calls >= 2 and seconds >= 0.0  # a generator counts once per resumption: at least once a run
    assert parts["log-mel features"] == (0.0, 0) and parts["admission"] == (0.0, 0)
