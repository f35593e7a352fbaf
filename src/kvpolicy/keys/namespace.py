"""The cache namespace: everything that must match before two KV blocks can be shared.

Two replicas may exchange a block only if they agree on every field here; the
namespace digest is the root of every key chain, so any difference — a model
revision, a RoPE scaling factor, an adapter version, a tenant — yields disjoint
keys. Isolation comes from the key itself, never from a TTL or a random prefix.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from typing import Any

import attrs

from ..errors import ConfigError

SCHEMA_VERSION = 1
NAMESPACE_PERSON = b"kvpolicy.ns.v1"

#: KV element formats and their bytes per element (``q`` in the brief).
KV_DTYPE_BYTES: dict[str, int] = {
    "fp32": 4,
    "fp16": 2,
    "bf16": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "int8": 1,
}

DATA_CLASSES = ("public", "shared", "internal", "private")

_Scalar = str | int | float | bool | None


def _canonical_value(field: str, value: Any) -> Any:
    """Normalise a position-encoding value into a hashable, canonical form."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ConfigError(field, f"must be finite, got {value!r}")
        # 10000 and 10000.0 are the same RoPE theta: one canonical spelling.
        return int(value) if value.is_integer() else value
    if isinstance(value, Mapping):
        return _canonical_mapping(field, value)
    if isinstance(value, (list, tuple)):
        return tuple(_canonical_value(f"{field}[{i}]", v) for i, v in enumerate(value))
    raise ConfigError(field, f"unsupported value type {type(value).__name__}")


def _canonical_mapping(field: str, value: Any) -> tuple[tuple[str, Any], ...]:
    if isinstance(value, tuple) and all(isinstance(p, tuple) and len(p) == 2 for p in value):
        value = dict(value)
    if not isinstance(value, Mapping):
        raise ConfigError(field, f"must be a mapping, got {type(value).__name__}")
    items = []
    for k, v in value.items():
        if not isinstance(k, str) or not k:
            raise ConfigError(field, f"keys must be non-empty strings, got {k!r}")
        items.append((k, _canonical_value(f"{field}.{k}", v)))
    return tuple(sorted(items))


def _to_jsonable(value: Any) -> Any:
    if isinstance(value, tuple) and all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) for p in value) and value:
        return {k: _to_jsonable(v) for k, v in value}
    if isinstance(value, tuple):
        return [_to_jsonable(v) for v in value]
    return value


def _nonempty_str(inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(attribute.name, f"must be a non-empty string, got {value!r}")


def _optional_str(inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and (not isinstance(value, str) or not value.strip()):
        raise ConfigError(attribute.name, f"must be None or a non-empty string, got {value!r}")


def _kv_dtype(inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, str) or value not in KV_DTYPE_BYTES:  # a list is unhashable: a TypeError from `in`
        raise ConfigError(attribute.name, f"unknown KV dtype {value!r}; known: {sorted(KV_DTYPE_BYTES)}")


def _block_size(inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(attribute.name, f"must be a positive int, got {value!r}")


def _data_class(inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value not in DATA_CLASSES:
        raise ConfigError(attribute.name, f"must be one of {DATA_CLASSES}, got {value!r}")


@attrs.frozen
class Namespace:
    """Frozen, validated identity of a KV cache.

    ``position_encoding`` takes any mapping (e.g. ``{"rope_theta": 500000,
    "rope_scaling": {"type": "llama3", "factor": 8.0}}``) and is stored as sorted
    pairs, so the order it was given in never changes the digest.
    """

    model_id: str = attrs.field(validator=_nonempty_str)
    model_revision: str = attrs.field(validator=_nonempty_str)
    tokenizer_version: str = attrs.field(validator=_nonempty_str)
    kv_dtype: str = attrs.field(validator=_kv_dtype)
    block_size_tokens: int = attrs.field(validator=_block_size)
    position_encoding: tuple[tuple[str, Any], ...] = attrs.field(
        factory=tuple, converter=lambda v: _canonical_mapping("position_encoding", v)
    )
    attention: str = attrs.field(default="paged-default", validator=_nonempty_str)
    adapter_name: str | None = attrs.field(default=None, validator=_optional_str)
    adapter_version: str | None = attrs.field(default=None, validator=_optional_str)
    tenant: str = attrs.field(default="default", validator=_nonempty_str)
    data_class: str = attrs.field(default="shared", validator=_data_class)

    def __attrs_post_init__(self) -> None:
        if (self.adapter_name is None) != (self.adapter_version is None):
            raise ConfigError(
                "adapter_version",
                "adapter_name and adapter_version are given together or not at all",
            )

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict, with the schema version."""
        d = attrs.asdict(self, recurse=False)
        d["position_encoding"] = _to_jsonable(self.position_encoding) if self.position_encoding else {}
        d["schema_version"] = SCHEMA_VERSION
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Namespace:
        """Inverse of :meth:`to_dict`; rejects unknown fields and other schema versions."""
        data = dict(data)
        version = data.pop("schema_version", SCHEMA_VERSION)
        if version != SCHEMA_VERSION:
            raise ConfigError("schema_version", f"this kvpolicy reads version {SCHEMA_VERSION}, got {version!r}")
        known = {a.name for a in attrs.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(unknown[0], f"unknown namespace field (known: {sorted(known)})")
        missing = [a.name for a in attrs.fields(cls) if a.default is attrs.NOTHING and a.name not in data]
        if missing:
            raise ConfigError(missing[0], "required namespace field is missing")
        return cls(**data)

    def canonical_bytes(self) -> bytes:
        """Canonical serialisation: sorted-key compact JSON, UTF-8, schema-versioned."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()

    @property
    def digest(self) -> bytes:
        """128-bit digest of :meth:`canonical_bytes` (BLAKE2b, personalised)."""
        return hashlib.blake2b(self.canonical_bytes(), digest_size=16, person=NAMESPACE_PERSON).digest()

    @property
    def kv_bytes_per_element(self) -> int:
        return KV_DTYPE_BYTES[self.kv_dtype]

    def evolve(self, **changes: Any) -> Namespace:
        """A copy with some fields changed (validated again)."""
        return attrs.evolve(self, **changes)
