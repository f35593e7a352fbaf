"""One exception tree for everything a user can cause.

Every error a caller can trigger derives from :class:`KVPolicyError`; the ones
caused by a bad value also derive from :class:`ValueError`, so generic
``except ValueError`` code keeps working.
"""

from __future__ import annotations

from typing import Any


class KVPolicyError(Exception):
    """Base of every error kvpolicy raises on purpose."""


class ConfigError(KVPolicyError, ValueError):
    """A configuration value is impossible; the message names the field."""

    def __init__(self, field: str, problem: str) -> None:
        self.field = field
        self.problem = problem
        super().__init__(f"{field}: {problem}")

    def __reduce__(self) -> tuple[Any, ...]:  # raised in a sweep's worker process, it crosses back whole (by name and problem)
        return (type(self), (self.field, self.problem))


class InputFormatError(KVPolicyError, ValueError):
    """A file (or stream) is malformed; the message names the file and line."""

    def __init__(self, path: str, line: int | None, problem: str) -> None:
        self.path = path
        self.line = line
        self.problem = problem
        where = f"{path}:{line}" if line is not None else str(path)
        super().__init__(f"{where}: {problem}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.path, self.line, self.problem))


class TraceFormatError(InputFormatError):
    """A trace file is malformed."""


class ProfileFormatError(InputFormatError):
    """A measured-profile CSV is malformed."""


class IncompatibleNamespaceError(KVPolicyError, ValueError):
    """Blocks built under one namespace were offered to another."""


class ProfileRequiredError(KVPolicyError):
    """The closed-form KV size does not hold for this model; measure it instead."""


class CapacityError(KVPolicyError):
    """The requested bytes cannot be freed (pinned blocks) or do not fit."""


class OracleRequiredError(KVPolicyError):
    """An offline policy was asked for a number it needs future knowledge for."""


class RemoteLoadError(KVPolicyError):
    """A remote load failed and the failure policy is ``fail``."""
