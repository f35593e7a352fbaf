"""Validators shared by the value classes (attrs-style) and the policies' constructors (``check_*``): each names the field it refuses."""

from __future__ import annotations

import math
import numbers
from typing import Any

import attrs

from .errors import ConfigError


def check_positive_int(field: str, v: Any) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ConfigError(field, f"must be a positive int, got {v!r}")


def check_positive_number(field: str, v: Any) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ConfigError(field, f"must be a finite positive number, got {v!r}")


def check_non_negative_number(field: str, v: Any) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise ConfigError(field, f"must be a finite non-negative number, got {v!r}")


def check_real(field: str, v: Any, *, negative_ok: bool = False) -> None:
    """A measurement an engine hands over: a finite real number (numpy's too), never negative unless ``negative_ok``.
    Plain floats and ints take the fast path: hot paths (a sketch's every sighting) call this."""
    if (type(v) in (float, int) or (isinstance(v, numbers.Real) and not isinstance(v, bool))) and math.isfinite(v) and (negative_ok or v >= 0):
        return
    raise ConfigError(field, f"must be {'a finite number' if negative_ok else 'a finite non-negative number'}, got {v!r}")


def check_count(field: str, v: Any) -> None:
    """A non-negative int, numpy's too (an engine's counts often are)."""
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0:
        raise ConfigError(field, f"must be a non-negative int, got {v!r}")


def check_non_negative_int(field: str, v: Any) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ConfigError(field, f"must be a non-negative int, got {v!r}")


def check_probability(field: str, v: Any) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1:
        raise ConfigError(field, f"must be a probability in [0, 1], got {v!r}")


def check_split(k: Any, n_requests: int) -> int:
    """A held-out split's first judged request: an int in [0, n_requests) (0: no split)."""
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k < max(n_requests, 1):
        raise ConfigError("judge_from_request", f"must be an int in [0, {n_requests}), got {k!r}")
    return k


def positive_int(inst: Any, a: attrs.Attribute, v: Any) -> None:
    check_positive_int(a.name, v)


def non_negative_int(inst: Any, a: attrs.Attribute, v: Any) -> None:
    check_non_negative_int(a.name, v)


def positive_number(inst: Any, a: attrs.Attribute, v: Any) -> None:
    check_positive_number(a.name, v)


def non_negative_number(inst: Any, a: attrs.Attribute, v: Any) -> None:
    check_non_negative_number(a.name, v)


def probability(inst: Any, a: attrs.Attribute, v: Any) -> None:
    check_probability(a.name, v)
