"""Effective capacity: what the pool really holds after reserves.

    C_effective = C_physical − C_active_decode − C_reserved − C_fragmentation

Blocks held by active decodes are not free: evicting them hurts live service for
a hypothetical future hit. Fragmentation comes from block sizes, shard mismatch,
partial pages and bookkeeping. Reports and eviction policies share this object.
"""

from __future__ import annotations

from typing import Any

import attrs

from ..errors import ConfigError


def _non_negative(inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(attribute.name, f"must be a non-negative int (bytes), got {value!r}")


@attrs.frozen
class EffectiveCapacity:
    physical_bytes: int = attrs.field(validator=_non_negative)
    active_decode_bytes: int = attrs.field(default=0, validator=_non_negative)
    reserved_bytes: int = attrs.field(default=0, validator=_non_negative)
    fragmentation_bytes: int = attrs.field(default=0, validator=_non_negative)

    def __attrs_post_init__(self) -> None:
        if self.active_decode_bytes + self.reserved_bytes + self.fragmentation_bytes > self.physical_bytes:
            raise ConfigError(
                "physical_bytes",
                f"{self.physical_bytes} is less than active decode + reserved + fragmentation "
                f"({self.active_decode_bytes} + {self.reserved_bytes} + {self.fragmentation_bytes})",
            )

    @property
    def effective_bytes(self) -> int:
        return self.physical_bytes - self.active_decode_bytes - self.reserved_bytes - self.fragmentation_bytes

    def effective_blocks(self, block_bytes: int) -> int:
        if isinstance(block_bytes, bool) or not isinstance(block_bytes, int) or block_bytes <= 0:
            raise ConfigError("block_bytes", f"must be a positive int, got {block_bytes!r}")
        return self.effective_bytes // block_bytes

    @classmethod
    def from_fractions(cls, physical_bytes: int, active_decode: float = 0.0, reserved: float = 0.0, fragmentation: float = 0.0) -> EffectiveCapacity:
        for name, f in (("active_decode", active_decode), ("reserved", reserved), ("fragmentation", fragmentation)):
            if not 0 <= f <= 1:
                raise ConfigError(name, f"must be a fraction in [0, 1], got {f}")
        return cls(physical_bytes, int(physical_bytes * active_decode), int(physical_bytes * reserved), int(physical_bytes * fragmentation))

    def to_dict(self) -> dict[str, int]:
        d = attrs.asdict(self)
        d["effective_bytes"] = self.effective_bytes
        return d
