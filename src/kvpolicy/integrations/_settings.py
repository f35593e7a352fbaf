"""What every engine adapter builds from its engine's extra config: an admission controller."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..admission import AdmissionConfig, AdmissionController, LatencyModel, LinkPrior
from .._validate import check_positive_int
from ..errors import ConfigError
from ..profile import PrefillModel

#: the settings an adapter reads from its engine's extra config under "kvpolicy"
ADMISSION_DEFAULTS: dict[str, Any] = {"link_gbps": 100.0, "prefill_tokens_per_s": 20000.0, "margin": 0.8, "publish": "threshold-2"}


def read_settings(raw: Any, defaults: dict[str, Any], where: str) -> dict[str, Any]:
    """The ``kvpolicy`` block of an engine's extra config over ``defaults``. A key that is not a setting here is an
    error naming it — a typo (``link_gpbs``) would otherwise leave the default in force without a word — and so is a
    block that is not a mapping (a JSON string where an object goes)."""
    if raw is None:
        return dict(defaults)
    if not isinstance(raw, Mapping):
        raise ConfigError(where, f"must be an object of kvpolicy settings, got {type(raw).__name__}")
    unknown = sorted(str(k) for k in raw if k not in defaults)
    if unknown:
        raise ConfigError(f"{where}.{unknown[0]}", f"is not a kvpolicy setting here; the settings: {', '.join(sorted(defaults))}")
    return {**defaults, **raw}


def positive_int_setting(cfg: dict[str, Any], key: str, where: str) -> int:
    check_positive_int(f"{where}.{key}", cfg[key])
    return cfg[key]


def string_setting(cfg: dict[str, Any], key: str, where: str) -> str:
    v = cfg[key]
    if not isinstance(v, str):
        raise ConfigError(f"{where}.{key}", f"must be a string, got {v!r}")
    return v


def filter_setting(cfg: dict[str, Any], key: str, where: str, *, block_bytes: int, block_s: float) -> Any:
    """The publish filter a setting names (a ``make_filter`` spec); a bad spec is an error naming ``where.key``,
    not the filter's own ``policy``. ``block_bytes`` and ``block_s`` (the seconds one block takes to recompute) are
    what ``reuse-aware`` weighs a write against — every adapter gives them, so every spec builds."""
    return spec_filter(string_setting(cfg, key, where), f"{where}.{key}", block_bytes=block_bytes, block_s=block_s)


def spec_filter(spec: str, field: str, *, block_bytes: int, block_s: float, pool_capacity_blocks: int | None = None) -> Any:
    """:func:`~kvpolicy.publish.make_filter` for an engine's setting ``field``: its errors name ``field``.
    ``pool_capacity_blocks``: what the tier holds, for ``dueling``'s ghost pools (None: unbounded)."""
    from ..publish import make_filter

    try:
        return make_filter(spec, block_bytes=block_bytes, recompute_s=lambda depth: block_s, pool_capacity_blocks=pool_capacity_blocks)
    except ConfigError as e:
        raise ConfigError(field, e.problem) from None


def controller_from_settings(cfg: dict[str, Any], where: str) -> AdmissionController:
    """An admission controller whose prior is the deployment's link (``link_gbps``, useful Gbit/s) and
    prefill speed (``prefill_tokens_per_s``); every bad value names ``where.<key>``."""
    for k in ("link_gbps", "prefill_tokens_per_s", "margin"):
        v = cfg[k]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 or v != v or v == float("inf"):
            raise ConfigError(f"{where}.{k}", f"must be a finite positive number, got {v!r}")
    prefill = PrefillModel(a_s=0.0, b_s_per_token=1.0 / cfg["prefill_tokens_per_s"], c_s_per_token2=0.0, rms_rel_error=float("nan"),
                           max_rel_error=float("nan"))
    return AdmissionController(LatencyModel(LinkPrior(bandwidth_bytes_per_s=cfg["link_gbps"] * 1e9 / 8), prefill),
                               AdmissionConfig(margin=float(cfg["margin"])))
