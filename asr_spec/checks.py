"""The one home of value checks: every options dataclass, the CLI and the server check a number here, so a
malformed one is refused the same way everywhere (a bool is not a number; NaN is not a number of seconds).

Each check returns the value it accepted and raises `ValueCheckError` (an `InputError`) whose one-line message
names the value and says what it must be. The engine keeps its own `check_int` (it imports nothing else from
asr_spec, and raises ValueError); `int_at_least` is the same check for the layers above it.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from asr_spec.errors import InputError

__all__ = ["ValueCheckError", "finite", "int_at_least", "is_int", "is_number", "non_empty_str", "positive",
           "positive_int", "positive_seconds", "seconds_at_least_zero"]


class ValueCheckError(InputError):
    """A value given as an option or argument is malformed: a number that is not one, not finite, or out of its
    range; a name that is not a non-empty string."""


def is_number(value: Any, *, finite_only: bool = True) -> bool:
    """An int or float, not a bool; finite unless finite_only is off."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return not finite_only or math.isfinite(value)


def is_int(value: Any) -> bool:
    """An int (a numpy one too), not a bool."""
    return not isinstance(value, bool) and isinstance(value, (int, np.integer))


def int_at_least(value: Any, name: str, minimum: int) -> int:
    """`value`, an integer (not a bool) >= minimum."""
    if not is_int(value) or value < minimum:
        raise ValueCheckError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def positive_int(value: Any, name: str, unit: str) -> int:
    """`value`, an integer > 0 of `unit` ("Hz"), as an int."""
    if not is_int(value) or value <= 0:
        raise ValueCheckError(f"{name} must be a positive integer number of {unit}, got {value!r}")
    return int(value)


def finite(value: Any, name: str, unit: str | None = None) -> float:
    """`value`, a finite number (of `unit`, "seconds", when given)."""
    if not is_number(value):
        of = "" if unit is None else f" of {unit}"
        raise ValueCheckError(f"{name} must be a finite number{of}, got {value!r}")
    return value


def positive(value: Any, name: str, unit: str, *, finite_only: bool = True) -> float:
    """`value`, a number > 0 of `unit` ("seconds", "MB"); finite unless finite_only is off (a limit may be inf)."""
    if not is_number(value, finite_only=finite_only) or not value > 0:
        raise ValueCheckError(f"{name} must be a positive number of {unit}, got {value!r}")
    return value


def positive_seconds(value: Any, name: str, *, finite_only: bool = True) -> float:
    """`value`, a number of seconds > 0 (finite unless finite_only is off)."""
    return positive(value, name, "seconds", finite_only=finite_only)


def seconds_at_least_zero(value: Any, name: str) -> float:
    """`value`, a finite number of seconds >= 0."""
    if not is_number(value) or value < 0:
        raise ValueCheckError(f"{name} must be a finite number of seconds >= 0, got {value!r}")
    return value


def non_empty_str(value: Any, name: str) -> str:
    """`value`, a str that is not empty (a name, an id: an int or "" would be compared with no request's)."""
    if not isinstance(value, str) or not value:
        raise ValueCheckError(f"{name} must be a non-empty string, got {value!r}")
    return value
