"""asr_spec/checks.py: the one home of number checks (pure, no model)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from asr_spec.checks import (
    ValueCheckError,
    finite,
    int_at_least,
    is_number,
    positive,
    positive_int,
    positive_seconds,
    seconds_at_least_zero,
)
from asr_spec.errors import InputError


def test_a_bool_is_not_a_number_and_nan_is_not_finite() -> None:
    assert is_number(3) and is_number(0.5) and not is_number(True) and not is_number("3")
    assert not is_number(math.nan) and not is_number(math.inf)
    assert is_number(math.inf, finite_only=False)  # a limit may be inf; its range check refuses NaN:
    with pytest.raises(ValueCheckError):
        positive_seconds(math.nan, "max_audio_s", finite_only=False)


@pytest.mark.parametrize("check, args, message", [
    (int_at_least, (True, "batch_size", 1), "batch_size must be an integer >= 1, got True"),
    (int_at_least, (0, "batch_size", 1), "batch_size must be an integer >= 1, got 0"),
    (int_at_least, (2.0, "seed", 0), "seed must be an integer >= 0, got 2.0"),
    (positive_int, (0, "sampling_rate", "Hz"), "sampling_rate must be a positive integer number of Hz, got 0"),
    (positive_seconds, (math.nan, "block_s"), "block_s must be a positive number of seconds, got nan"),
    (positive_seconds, (False, "block_s"), "block_s must be a positive number of seconds, got False"),
    (positive, (-1, "max_file_mb", "MB"), "max_file_mb must be a positive number of MB, got -1"),
    (seconds_at_least_zero, (-0.1, "tail_context_s"), "tail_context_s must be a finite number of seconds >= 0"),
    (finite, (math.inf, "vad threshold"), "vad threshold must be a finite number, got inf"),
    (finite, ("1", "segment 0: start_s", "seconds"), "segment 0: start_s must be a finite number of seconds"),
])
def test_each_check_refuses_with_one_line_naming_the_value(check, args, message) -> None:
    with pytest.raises(ValueCheckError) as info:
        check(*args)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)
    assert isinstance(info.value, InputError) and isinstance(info.value, ValueError)


def test_accepted_values_come_back() -> None:
    assert int_at_least(np.int64(3), "n", 1) == 3
    assert positive_int(np.int32(16000), "rate", "Hz") == 16000 and type(positive_int(16000, "r", "Hz")) is int
    assert positive_seconds(math.inf, "max_audio_s", finite_only=False) == math.inf
    assert seconds_at_least_zero(0, "t") == 0 and finite(-2.5, "x") == -2.5


def test_one_line_takes_the_name_off_before_it_splits_the_lines() -> None:
    """A file named "bad\nname.wav" printed `error: odd/bad` and `name.wav: odd/bad`, its cause lost (an archive
    reviewer's): the first line of the message ended inside the name."""
    from asr_spec.errors import AudioError, one_line

    err = AudioError("odd/bad\nname.wav: not a readable audio file (text, not audio)\n  more detail")
    assert one_line(err, "odd/bad\nname.wav") == "not a readable audio file (text, not audio)"
    assert one_line(AudioError("a.wav: corrupt"), "a.wav") == "corrupt" and one_line(AudioError("\n\n")) == "AudioError"
