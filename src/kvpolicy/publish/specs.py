"""Filter specs: ``check_spec`` names what a spec holds, ``make_filter`` builds it."""

from __future__ import annotations

from typing import Any

from .._own import call_own, is_own, load_own
from ..errors import ConfigError
from .rules import AllOf, BoundaryPublish, NeverPublish, PublishAll, ThresholdPublish
from .value import ReuseAwarePublish, StructureAwarePublish


_NAMES = ("all", "never", "boundary", "reuse-aware", "structure-aware", "dueling", "dueling-gpu-s")


_OWN_USAGE = "a PublishFilter class (or factory), built with the keywords it takes of block_bytes, recompute_s, ..."


def check_spec(spec: str) -> list[str]:
    """The names in a filter spec (``a+b`` → both), each checked: a known name or ``threshold-K`` with an integer K ≥ 1.
    Builds nothing, so a caller can refuse a misspelt spec before any work."""
    if not isinstance(spec, str):
        raise ConfigError("policy", f"must be a publish policy name (a string like 'structure-aware' or 'threshold-2'), got {type(spec).__name__}")
    parts = [p.strip() for p in spec.split("+") if p.strip()]
    if not parts:
        raise ConfigError("policy", f"empty publish policy {spec!r}")
    for name in parts:
        if is_own(name):
            load_own(name, "policy", _OWN_USAGE)
        elif name.startswith("threshold-"):
            k = name.split("-", 1)[1]
            if not (k.isascii() and k.isdigit()) or int(k) < 1:  # here, not in ThresholdPublish: its error would name its argument, not the spec
                raise ConfigError("policy", f"threshold-K needs a positive integer K, got {name!r}")
        elif name not in _NAMES:
            raise ConfigError("policy", f"unknown publish policy {name!r}; known: {', '.join(_NAMES)}, threshold-K (compose with +); "
                              f"or one of your own: MODULE:NAME or PATH.py:NAME, NAME {_OWN_USAGE}")
    return parts


def make_filter(spec: str, **kw: Any) -> Any:
    """``all``, ``never``, ``threshold-K``, ``boundary``, ``reuse-aware``, ``structure-aware``; ``a+b`` composes with AllOf.
    A filter of your own is ``MODULE:NAME`` or ``PATH.py:NAME``, built as ``NAME(**kw)`` with the keywords its signature
    takes (``block_bytes``, ``recompute_s``, ... as kvpolicy's own get them), and must have ``observe`` and ``publishable``."""
    parts = check_spec(spec)
    if len(parts) > 1:
        return AllOf(*(make_filter(p, **kw) for p in parts))
    name = parts[0]
    if is_own(name):
        f = call_own(name, "policy", load_own(name, "policy", _OWN_USAGE), **kw)
        if not callable(getattr(f, "observe", None)) or not callable(getattr(f, "publishable", None)):
            raise ConfigError("policy", f"{name!r} built a {type(f).__name__}, which lacks observe/publishable: a publish filter "
                              "implements kvpolicy.publish.PublishFilter (docs/publish.md)")
        return f
    if name == "all":
        return PublishAll()
    if name == "never":
        return NeverPublish()
    if name == "boundary":
        return BoundaryPublish()
    if name.startswith("threshold-"):
        return ThresholdPublish(int(name.split("-", 1)[1]))
    if name == "reuse-aware":
        return ReuseAwarePublish(**_taken(ReuseAwarePublish, kw))
    if name in ("dueling", "dueling-gpu-s"):
        from .dueling import DuelingPublish  # (dueling builds its candidates with make_filter)

        return DuelingPublish(**{**_taken(DuelingPublish, kw), "score": "gpu_s" if name == "dueling-gpu-s" else "e_benefit"})
    return StructureAwarePublish(**_taken(StructureAwarePublish, kw))


def _taken(cls: Any, kw: dict[str, Any]) -> dict[str, Any]:
    """The keywords ``cls`` takes (callers pass every filter the same set: block_bytes, recompute_s, pool_capacity_blocks, ...)."""
    import inspect

    params = inspect.signature(cls).parameters
    return {k: v for k, v in kw.items() if k in params}
