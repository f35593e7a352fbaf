"""A vLLM KV connector that puts kvpolicy's admission in front of another connector.

Load it by module path; its transfers are the wrapped connector's (vLLM's
``OffloadingConnector``, LMCache's, …), its decisions kvpolicy's::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVPolicyConnector",
      "kv_connector_module_path": "kvpolicy.integrations.vllm_kv_connector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"inner_connector": "OffloadingConnector", "cpu_bytes_to_use": 8000000000,
        "kvpolicy": {"link_gbps": 100, "prefill_tokens_per_s": 20000, "margin": 0.8}}}'

Scheduler side (vLLM 0.33's call sequence, see docs/integrations.md):
``get_num_new_matched_tokens`` asks the inner connector how many tokens it could
load, then kvpolicy's controller ``propose``s how many of them are worth loading
— pure, as often as vLLM asks; ``update_state_after_alloc`` admits the (possibly
trimmed) load and takes its slot before telling the inner connector;
``update_connector_output`` feeds finished and failed loads back (failed
physical block ids mapped to positions) and releases slots; ``request_finished``
releases what is left and returns the inner connector's answer. The worker side
is the inner connector's, unchanged (every other method is forwarded).

What does not fit: the inner connector decides its own stores — kvpolicy's
store verdict is attached to the step's metadata (``metadata.kvpolicy``) for an
inner connector that reads it; vLLM's ``OffloadingConnector`` does not, so with
it use :mod:`kvpolicy.integrations.vllm_offload` for the CPU tier's eviction.

The base class is vLLM's ``KVConnectorBase_V1`` when vLLM is importable,
``object`` otherwise (the module imports, and is tested, without vLLM). Every
method and property of that base the connector does not decide itself calls the
inner connector's (:func:`~kvpolicy.integrations._forward.forward_to_inner`), and
the questions vLLM asks of the class (``get_required_kvcache_layout``, …) are the
inner class's answers.
"""

from __future__ import annotations

import importlib
from typing import Any

from ..errors import ConfigError
from ._forward import forward_to_inner
from ._settings import ADMISSION_DEFAULTS, controller_from_settings, filter_setting, positive_int_setting, read_settings, string_setting
from .vllm_connector import VllmConnectorPolicy, _tokens

try:  # pragma: no cover - depends on the environment
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1 as _Base  # type: ignore[import-not-found]
except ImportError:
    _Base = object  # type: ignore[assignment,misc]
try:  # pragma: no cover - depends on the environment
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA as _HMA  # type: ignore[import-not-found]
except ImportError:
    _HMA = None

DEFAULTS = {**ADMISSION_DEFAULTS, "bytes_per_token": 131072, "block_size": 16, "kv_dtype": "bf16", "partial_loads": None}

#: inner connectors that load any leading part of the hit they offered (vLLM 0.33's OffloadingConnector computes
#: its load range from the count it is given); any other is asked for all it offered or nothing — vLLM's own LMCache
#: adapter asserts that the count equals its hit (``lmcache_integration/vllm_v1_adapter.py``)
PARTIAL_LOAD_CONNECTORS = ("OffloadingConnector",)


def _inner_class(name: str, module_path: str | None) -> Any:
    field = "kv_connector_extra_config.inner_connector"
    try:
        if module_path:
            return getattr(importlib.import_module(module_path), name)
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # type: ignore[import-not-found]

        return KVConnectorFactory.get_connector_class_by_name(name)
    except (ImportError, AttributeError, ValueError) as e:
        where = f" in {module_path!r}" if module_path else " (a connector registered with vLLM)"
        raise ConfigError(field, f"cannot find the connector class {name!r}{where}: {e}") from None


def _inner_class_of(extra: Any) -> Any:
    """The inner connector's class a ``kv_connector_extra_config`` names, or None when it names none."""
    if not isinstance(extra, dict) or not extra.get("inner_connector"):
        return None
    return _inner_class(extra["inner_connector"], extra.get("inner_connector_module_path"))


def _extra_of(kv_transfer_config: Any) -> Any:
    return getattr(kv_transfer_config, "kv_connector_extra_config", None)


class _Counted(VllmConnectorPolicy):
    """The helper, deciding from the count the inner connector can load (no index of its own)."""

    def propose_from_count(self, request: Any, num_computed_tokens: int, external_tokens: int, *, partial: bool = True) -> int:
        """Tokens worth loading of the ``external_tokens`` the inner connector offered: a leading part of them
        (``partial``), or — for a connector that takes all it offered or nothing — all of them or 0."""
        from ..matching import PrefixMatch

        toks = _tokens(request)
        B = self.B
        L = num_computed_tokens // B
        matchable = max(len(toks) - 1, 0) // B
        R = max(min(external_tokens // B, matchable - L), 0)
        m = PrefixMatch(len(toks), B, matchable, L, (R,), ("external",), "miss" if R < matchable - L else "all_matchable_found")
        d = self.controller.propose(m, self._ctx())
        self._remember(str(request.request_id), d, m, None)
        if not d.loads:
            return 0
        if partial:
            return d.load_blocks * B
        return external_tokens if d.load_blocks >= R else 0  # the best plan loads only a part: recompute it all


class KVPolicyConnector(_Base):  # type: ignore[misc,valid-type]
    """kvpolicy's admission and publish verdicts in front of an inner vLLM connector."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None, *, inner: Any = None) -> None:
        ktc = getattr(vllm_config, "kv_transfer_config", None)
        extra = dict(getattr(ktc, "kv_connector_extra_config", None) or {})
        if _Base is not object:  # pragma: no cover - with vLLM installed
            super().__init__(vllm_config, role, kv_cache_config)
        if inner is None:
            name = extra.get("inner_connector")
            if not name:
                raise ConfigError("kv_connector_extra_config.inner_connector", "names the connector whose transfers kvpolicy decides")
            inner = _inner_class(name, extra.get("inner_connector_module_path"))(vllm_config, role, kv_cache_config)
        self.inner = inner
        where = "kv_connector_extra_config.kvpolicy"
        cfg = read_settings(extra.get("kvpolicy"), DEFAULTS, where)
        controller = controller_from_settings(cfg, where)
        bytes_per_token = positive_int_setting(cfg, "bytes_per_token", where)
        kv_dtype, publish_filter = string_setting(cfg, "kv_dtype", where), filter_setting(cfg, "publish", where)
        cache = getattr(vllm_config, "cache_config", None)
        block_size = positive_int_setting(cfg, "block_size", where)  # checked even where vLLM's cache config gives it
        B = int(getattr(cache, "block_size", None) or block_size)
        from ..keys import BlockHasher, Namespace

        model = getattr(getattr(vllm_config, "model_config", None), "model", None) or "model"
        ns = Namespace(model_id=str(model), model_revision="main", tokenizer_version="vllm", kv_dtype=kv_dtype, block_size_tokens=B)
        self.policy = _Counted(BlockHasher(ns, "fast"), _NoIndex(), controller, publish_filter,
                               bytes_per_token=bytes_per_token)
        partial = cfg["partial_loads"]
        if partial is not None and not isinstance(partial, bool):
            raise ConfigError(f"{where}.partial_loads", f"must be true, false or null (decided by the inner connector), got {partial!r}")
        #: whether the inner connector loads a leading part of the hit it offered (else: all of it or nothing)
        self.partial_loads = type(inner).__name__ in PARTIAL_LOAD_CONNECTORS if partial is None else partial

    # ---------------------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        ext, is_async = self.inner.get_num_new_matched_tokens(request, num_computed_tokens)
        if ext is None:
            return None, False  # the inner connector needs more time: vLLM asks again
        if not ext:
            return 0, False
        n = self.policy.propose_from_count(request, num_computed_tokens, int(ext), partial=self.partial_loads)
        return (min(n, int(ext)), bool(is_async)) if n else (0, False)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens:  # the slot, for the controller's books: a load vLLM was promised is never refused here
            self.policy.update_state_after_alloc(request, blocks, num_external_tokens)
        # vLLM counts these tokens as loaded from now on: the inner connector loads exactly them
        self.inner.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        meta = self.inner.build_connector_meta(scheduler_output)
        ours = self.policy.build_connector_meta(scheduler_output)
        try:
            meta.kvpolicy = ours  # for an inner connector that reads kvpolicy's store verdicts
        except AttributeError:  # pragma: no cover - a metadata class with __slots__
            pass
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        self.policy.update_connector_output(connector_output)
        self.inner.update_connector_output(connector_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self.policy.request_finished(request, block_ids)
        return self.inner.request_finished(request, block_ids)

    # ---------------------------------------------------------------- questions vLLM asks of the class: the inner class's answer
    # (vLLM asks them before any connector exists: the KV cache layout the inner connector copies in — the
    # OffloadingConnector needs its own — whether CUDA graphs must be piecewise, whether sleep mode works)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        inner = _inner_class_of(_extra_of(getattr(vllm_config, "kv_transfer_config", None)))
        return inner.get_required_kvcache_layout(vllm_config) if inner is not None else None

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        inner = _inner_class_of(extra_config)
        return bool(inner.requires_piecewise_for_cudagraph(extra_config)) if inner is not None else False

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        inner = _inner_class_of(_extra_of(kv_transfer_config))
        return bool(inner.supports_sleep_mode(kv_transfer_config)) if inner is not None else True

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: Any, labelnames: Any, per_engine_labelvalues: Any) -> Any:
        inner = _inner_class_of(_extra_of(getattr(vllm_config, "kv_transfer_config", None)))
        if inner is None:
            return None
        return inner.build_prom_metrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ---------------------------------------------------------------- everything else is the inner connector's
    # (every other method and property of vLLM's base: forward_to_inner below; anything else the inner has: here)

    def __getattr__(self, name: str) -> Any:
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


forward_to_inner(KVPolicyConnector, _Base)


class KVPolicyConnectorHMA(KVPolicyConnector, *((_HMA,) if _HMA is not None else ())):  # type: ignore[misc]
    """:class:`KVPolicyConnector` for an inner connector that supports vLLM's hybrid memory allocator (HMA) — vLLM's
    ``OffloadingConnector`` does. vLLM keeps HMA on only for a ``SupportsHMA`` connector and then ends a request with
    ``request_finished_all_groups`` (one block list per KV-cache group): this class is one, and forwards it after
    kvpolicy's publish verdict. Load it as ``"kv_connector": "KVPolicyConnectorHMA"``; an inner connector without
    HMA is refused when the connector is built (use :class:`KVPolicyConnector`: vLLM then turns HMA off)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None, *, inner: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config, inner=inner)
        if not callable(getattr(self.inner, "request_finished_all_groups", None)) or (_HMA is not None and not isinstance(self.inner, _HMA)):
            raise ConfigError("kv_connector_extra_config.inner_connector",
                              f"{type(self.inner).__name__} does not support vLLM's hybrid memory allocator (SupportsHMA): "
                              "load KVPolicyConnector instead (vLLM then turns HMA off)")

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        self.policy.request_finished(request, block_ids[0] if block_ids else [])
        return self.inner.request_finished_all_groups(request, block_ids)


class _NoIndex:
    """The wrapped connector answers what is remote; kvpolicy keeps no index of its own here."""

    def match_prefix(self, keys: Any) -> int:
        return 0

