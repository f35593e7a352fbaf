"""What every engine adapter builds from its engine's extra config: an admission controller."""

from __future__ import annotations

from typing import Any

from ..admission import AdmissionConfig, AdmissionController, LatencyModel, LinkPrior
from ..errors import ConfigError
from ..profile import PrefillModel

#: the settings an adapter reads from its engine's extra config under "kvpolicy"
ADMISSION_DEFAULTS: dict[str, Any] = {"link_gbps": 100.0, "prefill_tokens_per_s": 20000.0, "margin": 0.8, "publish": "threshold-2"}


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
