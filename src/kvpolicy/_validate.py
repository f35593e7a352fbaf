"""attrs validators shared by the value classes: each names the field it refuses."""

from __future__ import annotations

import math
from typing import Any

import attrs

from .errors import ConfigError


def positive_int(inst: Any, a: attrs.Attribute, v: Any) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ConfigError(a.name, f"must be a positive int, got {v!r}")


def non_negative_int(inst: Any, a: attrs.Attribute, v: Any) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ConfigError(a.name, f"must be a non-negative int, got {v!r}")


def positive_number(inst: Any, a: attrs.Attribute, v: Any) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ConfigError(a.name, f"must be a finite positive number, got {v!r}")


def non_negative_number(inst: Any, a: attrs.Attribute, v: Any) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise ConfigError(a.name, f"must be a finite non-negative number, got {v!r}")


def probability(inst: Any, a: attrs.Attribute, v: Any) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1:
        raise ConfigError(a.name, f"must be a probability in [0, 1], got {v!r}")
