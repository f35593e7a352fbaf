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
inner class's answers. Transfer metrics (:class:`KVPolicyStats`) carry the inner
connector's stats and kvpolicy's own counts to vLLM's log line and Prometheus.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from typing import Any

from .._validate import check_non_negative_number
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
try:  # pragma: no cover - depends on the environment
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats as _StatsBase  # type: ignore[import-not-found]
except ImportError:
    _StatsBase = object  # type: ignore[assignment,misc]

DEFAULTS = {**ADMISSION_DEFAULTS, "bytes_per_token": 131072, "block_size": 16, "kv_dtype": "bf16", "partial_loads": None,
            "learn_prefill_from_steps": True}

#: inner connectors that load any leading part of the hit they offered (vLLM 0.33's OffloadingConnector computes
#: its load range from the count it is given); any other is asked for all it offered or nothing — vLLM's own LMCache
#: adapter asserts that the count equals its hit (``lmcache_integration/vllm_v1_adapter.py``)
PARTIAL_LOAD_CONNECTORS = ("OffloadingConnector",)


def _inner_class(name: str, module_path: str | None) -> Any:
    field = "kv_connector_extra_config.inner_connector"
    known: list[str] = []
    try:
        if module_path:
            module = importlib.import_module(module_path)
            known = [n for n, v in vars(module).items() if isinstance(v, type) and not n.startswith("_")]
            return getattr(module, name)
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # type: ignore[import-not-found]

        known = list(getattr(KVConnectorFactory, "_registry", {}))
        return KVConnectorFactory.get_connector_class_by_name(name)
    except (ImportError, AttributeError, ValueError) as e:
        import difflib

        where = f" in {module_path!r}" if module_path else " (a connector registered with vLLM)"
        close = difflib.get_close_matches(name, known, n=3)
        hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        raise ConfigError(field, f"cannot find the connector class {name!r}{where}: {e}{hint}") from None


def _inner_class_of(extra: Any) -> Any:
    """The inner connector's class a ``kv_connector_extra_config`` names, or None when it names none."""
    if not isinstance(extra, dict) or not extra.get("inner_connector"):
        return None
    return _inner_class(extra["inner_connector"], extra.get("inner_connector_module_path"))


def _extra_of(kv_transfer_config: Any) -> Any:
    return getattr(kv_transfer_config, "kv_connector_extra_config", None)


class _Counted(VllmConnectorPolicy):
    """The helper, deciding from the count the inner connector can load (no index of its own)."""

    def propose_from_count(self, request: Any, num_computed_tokens: int, external_tokens: int, *,
                           partial: bool = True) -> tuple[int, str]:
        """Tokens worth loading of the ``external_tokens`` the inner connector offered — a leading part of them
        (``partial``), or, for a connector that takes all it offered or nothing, all of them or 0 — and the
        controller's reason (``"partial_plan"``: its best plan loads only a part, which such a connector cannot)."""
        from ..matching import PrefixMatch

        toks = _tokens(request)
        B = self.B
        L = num_computed_tokens // B
        matchable = max(len(toks) - 1, 0) // B
        R = max(min(external_tokens // B, matchable - L), 0)
        m = PrefixMatch(len(toks), B, matchable, L, (R,), ("external",), "miss" if R < matchable - L else "all_matchable_found")
        rid = str(request.request_id)
        self._promised.discard(rid)  # asked again: its earlier answer is not another load
        d = self.controller.propose(m, self._ctx())
        self._remember(rid, d, m, None)
        if not d.loads:
            n, reason = 0, d.reason
        elif partial:
            n, reason = d.load_blocks * B, d.reason
        elif d.load_blocks >= R:
            n, reason = external_tokens, d.reason
        else:
            n, reason = 0, "partial_plan"  # the best plan loads only a part: recompute it all
        self._promise(rid, n > 0)
        return n, reason


#: kvpolicy's own counts in a stats interval: requests the inner connector offered a hit for (once vLLM allocated
#: them), the tokens it offered, the tokens kvpolicy let it load (after vLLM's own trims), the tokens kvpolicy
#: declined, and — by the controller's reason — the requests whose offer kvpolicy cut or declined
COUNTS = ("requests", "offered_tokens", "loaded_tokens", "declined_tokens")
#: what the controller learned of the deployment's compute, reported with the counts (values, not counts)
LEARNED = ("compute_over_profile", "step_fixed_s")


def _class_path(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _registered(name: str, path: str) -> Any:
    """The class vLLM's KVConnectorFactory has registered as ``name``, if it is the one at ``path``; else None."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # type: ignore[import-not-found]
    except ImportError:
        return None
    if name not in getattr(KVConnectorFactory, "_registry", {}):
        return None
    try:
        cls = KVConnectorFactory.get_connector_class_by_name(name)
    except (ImportError, AttributeError, ValueError):
        return None
    return cls if isinstance(cls, type) and _class_path(cls) == path else None


def _class_at(path: str) -> Any:
    """The inner connector class a stats payload names (``module:Qualname``) — only a class this process already
    has: its module imported (vLLM's front end imports the configured inner connector's module when it builds its
    Prometheus metrics, from the config), or registered with vLLM's ``KVConnectorFactory`` under its own name (as
    vLLM's ``MultiConnector`` finds its children's classes). A payload crosses a process boundary, so kvpolicy never
    imports a module because one names it. None: neither."""
    field = "kv_connector_stats.inner_class"
    module, sep, name = path.partition(":")
    if not sep or not module or not name:
        raise ConfigError(field, f"must be 'module:Class', got {path!r}")
    obj: Any = sys.modules.get(module)
    if obj is None:
        obj = _registered(name.rsplit(".", 1)[-1], path)
        if obj is None:
            return None
    else:
        try:
            for part in name.split("."):
                obj = getattr(obj, part)
        except AttributeError as e:
            raise ConfigError(field, f"cannot find the inner connector class {path!r}: {e}") from None
    if not callable(getattr(obj, "build_kv_connector_stats", None)):
        raise ConfigError(field, f"{path!r} is not a vLLM connector class")
    return obj


def _count(v: Any, field: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ConfigError(field, f"must be a non-negative int, got {v!r}")
    return v


class KVPolicyStats(_StatsBase):  # type: ignore[misc,valid-type]
    """What the wrapping connector reports to vLLM's transfer metrics: kvpolicy's counts for the interval and the
    inner connector's own stats, carried whole (``aggregate``, ``reduce``, ``reset`` are the inner stats' own).

    vLLM rebuilds a connector's stats in its front-end process from a dict (``to_dict``), asking the configured
    class — the wrapper — with no config to find the inner class by: the dict names it (``inner_class``), as
    vLLM's ``MultiConnector`` names its children. ``reduce`` (vLLM's "KV Transfer metrics" log line) is the inner
    stats' reduction plus ``kvpolicy_requests``, ``kvpolicy_offered_tokens``, ``kvpolicy_loaded_tokens``,
    ``kvpolicy_declined_tokens`` and ``kvpolicy_declined_<reason>`` (requests), and once learned
    ``kvpolicy_compute_over_profile`` (the deployment's prefill over the profile's prediction, p50) and
    ``kvpolicy_step_fixed_s`` (a step's fixed part) — what the step timer has learned."""

    def __init__(self, data: dict[str, Any] | None = None, *, inner: Any = None, inner_class: str | None = None) -> None:
        counts = dict.fromkeys(COUNTS, 0)
        declined: dict[str, int] = {}
        if data:
            for k in COUNTS:
                if k in data:
                    counts[k] = _count(data[k], f"kv_connector_stats.{k}")
            reasons = data.get("declined") or {}
            if not isinstance(reasons, dict):
                raise ConfigError("kv_connector_stats.declined", f"must map reasons to counts, got {type(reasons).__name__}")
            declined.update({str(r): _count(n, f"kv_connector_stats.declined.{r}") for r, n in reasons.items()})
        self.data: dict[str, Any] = {**counts, "declined": declined}  # vLLM's KVConnectorStats.data
        #: what the controller has learned of the deployment's compute (the step timer): its prefill over the
        #: profile's prediction (p50) and a step's fixed part in seconds — None until learned
        self.learned: dict[str, float | None] = dict.fromkeys(LEARNED)
        for k in LEARNED:
            v = (data or {}).get(k)
            if v is not None:  # null: not learned yet
                check_non_negative_number(f"kv_connector_stats.{k}", v)
            self.learned[k] = None if v is None else float(v)
        self.inner = inner
        self.inner_class = inner_class

    def count(self, offered_tokens: int, answered_tokens: int, loaded_tokens: int, reason: str) -> None:
        """One request vLLM allocated: what the inner connector offered, what kvpolicy answered, what vLLM loads."""
        d = self.data
        d["requests"] += 1
        d["offered_tokens"] += offered_tokens
        d["loaded_tokens"] += loaded_tokens
        if answered_tokens < offered_tokens:
            d["declined_tokens"] += offered_tokens - answered_tokens
            d["declined"][reason] = d["declined"].get(reason, 0) + 1

    def to_dict(self) -> dict[str, Any]:
        inner = self.inner.to_dict() if self.inner is not None else None
        return {**{k: self.data[k] for k in COUNTS}, "declined": dict(self.data["declined"]), **self.learned, "inner": inner,
                "inner_class": self.inner_class}

    def aggregate(self, other: Any) -> KVPolicyStats:
        if not isinstance(other, KVPolicyStats):
            raise ConfigError("kv_connector_stats", f"cannot aggregate {type(other).__name__} into kvpolicy's stats")
        for k in COUNTS:
            self.data[k] += other.data[k]
        for r, n in other.data["declined"].items():
            self.data["declined"][r] = self.data["declined"].get(r, 0) + n
        for k, v in other.learned.items():  # a value, not a count: the newer report's
            if v is not None:
                self.learned[k] = v
        if other.inner is not None:
            self.inner = other.inner if self.inner is None else self.inner.aggregate(other.inner)
            self.inner_class = self.inner_class or other.inner_class
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = dict(self.inner.reduce()) if self.inner is not None and not self.inner.is_empty() else {}
        if self.data["requests"]:
            out.update({f"kvpolicy_{k}": self.data[k] for k in COUNTS})
            out.update({f"kvpolicy_declined_{r}": n for r, n in sorted(self.data["declined"].items())})
        out.update({f"kvpolicy_{k}": round(v, 4) for k, v in self.learned.items() if v is not None})
        return out

    def is_empty(self) -> bool:
        return self.data["requests"] == 0 and (self.inner is None or self.inner.is_empty())

    def reset(self) -> None:
        self.data = {**dict.fromkeys(COUNTS, 0), "declined": {}}
        self.learned = dict.fromkeys(LEARNED)
        if self.inner is not None:
            self.inner.reset()


class _PromMetrics:
    """vLLM's Prometheus hook for the wrapping connector: kvpolicy's counters (``vllm:kvpolicy_offered_tokens``,
    ``vllm:kvpolicy_loaded_tokens``, ``vllm:kvpolicy_declined_tokens``, ``vllm:kvpolicy_declined_requests`` by
    ``reason``), and the inner connector's own metrics fed the inner part of each payload."""

    def __init__(self, metric_types: Any, labelnames: Any, per_engine_labelvalues: Any, inner: Any) -> None:
        try:  # vLLM keys the types by prometheus_client's classes
            from prometheus_client import Counter  # type: ignore[import-not-found]

            counter = metric_types.get(Counter)
        except ImportError:
            counter = next((v for k, v in metric_types.items() if getattr(k, "__name__", "") == "Counter"), None)
        if counter is None:
            raise ConfigError("metric_types", "vLLM gave no Counter type for the connector's Prometheus metrics")
        labels = list(labelnames)
        self.inner = inner
        self.per_engine = per_engine_labelvalues
        self.tokens = {k: counter(name=f"vllm:kvpolicy_{k}", documentation=doc, labelnames=labels) for k, doc in (
            ("offered_tokens", "Tokens the connector kvpolicy wraps offered to load"),
            ("loaded_tokens", "Tokens kvpolicy let the wrapped connector load (after vLLM's own trims)"),
            ("declined_tokens", "Tokens the wrapped connector offered that kvpolicy had recomputed instead"))}
        self.declined = counter(name="vllm:kvpolicy_declined_requests",
                                documentation="Requests whose offered load kvpolicy cut or declined, by the controller's reason",
                                labelnames=labels + ["reason"])
        gauge = next((v for k, v in metric_types.items() if getattr(k, "__name__", "") == "Gauge"), None)
        self.learned = {} if gauge is None else {k: gauge(name=f"vllm:kvpolicy_{k}", documentation=doc, labelnames=labels) for k, doc in (
            ("compute_over_profile", "The deployment's prefill compute over the profile's prediction (p50), learned from vLLM's steps"),
            ("step_fixed_s", "The fixed part of a vLLM step in seconds (weights, decodes), learned from vLLM's steps"))}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        values = list(self.per_engine[engine_idx])
        for k, c in self.tokens.items():
            if transfer_stats_data.get(k):
                c.labels(*values).inc(transfer_stats_data[k])
        for r, n in (transfer_stats_data.get("declined") or {}).items():
            self.declined.labels(*values, r).inc(n)
        for k, g in self.learned.items():
            if transfer_stats_data.get(k) is not None:
                g.labels(*values).set(transfer_stats_data[k])
        if self.inner is not None and transfer_stats_data.get("inner") is not None:
            self.inner.observe(transfer_stats_data["inner"], engine_idx)


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
        self.stats = KVPolicyStats(inner_class=_class_path(type(inner)))
        # req -> (tokens offered, tokens answered, reason, whether the inner connector loads it asynchronously)
        self._offers: dict[str, tuple[int, int, str, bool]] = {}
        where = "kv_connector_extra_config.kvpolicy"
        cfg = read_settings(extra.get("kvpolicy"), DEFAULTS, where)
        controller = controller_from_settings(cfg, where)
        bytes_per_token = positive_int_setting(cfg, "bytes_per_token", where)
        kv_dtype = string_setting(cfg, "kv_dtype", where)
        cache = getattr(vllm_config, "cache_config", None)
        block_size = positive_int_setting(cfg, "block_size", where)  # checked even where vLLM's cache config gives it
        B = int(getattr(cache, "block_size", None) or block_size)
        publish_filter = filter_setting(cfg, "publish", where, block_bytes=bytes_per_token * B, block_s=B / cfg["prefill_tokens_per_s"])
        from ..keys import BlockHasher, Namespace

        model = getattr(getattr(vllm_config, "model_config", None), "model", None) or "model"
        ns = Namespace(model_id=str(model), model_revision="main", tokenizer_version="vllm", kv_dtype=kv_dtype, block_size_tokens=B)
        learn = cfg["learn_prefill_from_steps"]
        if not isinstance(learn, bool):
            raise ConfigError(f"{where}.learn_prefill_from_steps", f"must be true or false, got {learn!r}")
        # with pipeline parallelism one step per stage runs at once: the gap between outputs is a stage's time
        pp = getattr(getattr(vllm_config, "parallel_config", None), "pipeline_parallel_size", 1)
        # how many steps vLLM keeps scheduled at once: 2 with async scheduling (its batch queue), else 1
        in_flight = getattr(vllm_config, "max_concurrent_batches", 1)
        in_flight = in_flight if isinstance(in_flight, int) and not isinstance(in_flight, bool) and in_flight >= 1 else 1
        self.policy = _Counted(BlockHasher(ns, "fast"), _NoIndex(), controller, publish_filter,
                               bytes_per_token=bytes_per_token, learn_prefill_from_steps=learn and not (isinstance(pp, int) and pp > 1),
                               steps_in_flight=in_flight)
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
            self.policy._promise(str(request.request_id), False)  # asked again, and nothing to load now
            return 0, False
        n, reason = self.policy.propose_from_count(request, num_computed_tokens, int(ext), partial=self.partial_loads)
        n = min(n, int(ext))
        self._offers[str(request.request_id)] = (int(ext), n, reason, bool(is_async))
        return (n, bool(is_async)) if n else (0, False)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        offer = self._offers.pop(str(request.request_id), None)
        # the slot, for the controller's books: a load vLLM was promised is never refused here (0 tokens: no load, and
        # the promise is off); a synchronous load (the inner connector answered is_async False: LMCache's) is
        # released two steps on
        self.policy.update_state_after_alloc(request, blocks, num_external_tokens, sync=not (offer and offer[3]))
        if offer is not None:
            self.stats.count(offer[0], offer[1], int(num_external_tokens), offer[2])
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
        self._offers.pop(str(request.request_id), None)
        return self.inner.request_finished(request, block_ids)

    # ---------------------------------------------------------------- transfer metrics (vLLM's log line and Prometheus)

    def get_kv_connector_stats(self) -> KVPolicyStats | None:
        """This interval's stats — kvpolicy's counts (scheduler side) and the inner connector's — then a fresh
        interval. None when both are empty."""
        inner_get = getattr(self.inner, "get_kv_connector_stats", None)
        inner = inner_get() if callable(inner_get) else None
        out, self.stats = self.stats, KVPolicyStats(inner_class=self.stats.inner_class)
        out.inner = inner
        if out.is_empty():
            return None
        model, timer = self.policy.controller.model, self.policy.step_timer
        if model.prefill_ratio.hist.count >= model.min_samples:
            out.learned["compute_over_profile"] = model.prefill_ratio.q(0.5)
        if timer is not None and timer.fixed_s is not None:
            out.learned["step_fixed_s"] = timer.fixed_s
        return out

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVPolicyStats:
        """The stats again from their dict (vLLM's front end), the inner part rebuilt by the inner class it names."""
        if data is None:
            return KVPolicyStats()
        if not isinstance(data, dict):
            raise ConfigError("kv_connector_stats", f"must be the dict KVPolicyStats.to_dict gives, got {type(data).__name__}")
        inner, path = data.get("inner"), data.get("inner_class")
        if isinstance(inner, dict) and path:
            inner_cls = _class_at(str(path))
            if inner_cls is None:  # kvpolicy's counts still count; the inner connector's cannot be read here
                warnings.warn(f"kvpolicy: the inner connector's transfer stats are dropped: {path!r} is neither imported in "
                              "this process nor registered with vLLM's KVConnectorFactory, and kvpolicy imports no module a "
                              "stats payload names (register the inner connector, or import its module in the front end)",
                              RuntimeWarning, stacklevel=2)
                inner = None
            else:
                inner = inner_cls.build_kv_connector_stats(data=inner)
        return KVPolicyStats(data, inner=inner, inner_class=path)

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
        inner_prom = inner.build_prom_metrics(vllm_config, metric_types, labelnames, per_engine_labelvalues) if inner is not None else None
        return _PromMetrics(metric_types, labelnames, per_engine_labelvalues, inner_prom)

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


def _register_with_vllm() -> list[str]:
    """Register the connectors by name with vLLM's ``KVConnectorFactory`` (lazily, by this module's path) when vLLM
    is importable; returns the names registered. vLLM's ``MultiConnector`` rebuilds each child's transfer stats in
    the front end by the child's *registered* name (``get_connector_class_by_name``), which a connector loaded by
    module path does not have: without this, a kvpolicy connector inside a ``MultiConnector`` raised ``ValueError``
    in vLLM's stats logger. vLLM imports this module in the front end too, when it checks the config (its
    ``MultiConnector`` asks each child class about CUDA graphs and HMA there)."""
    try:  # pragma: no cover - depends on the environment
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # type: ignore[import-not-found]
    except ImportError:
        return []
    done = []
    for name in ("KVPolicyConnector", "KVPolicyConnectorHMA"):
        try:
            KVConnectorFactory.register_connector(name, __name__, name)
        except ValueError:  # already registered: this module imported again, or a vLLM that ships one by that name
            continue
        done.append(name)
    return done


REGISTERED = _register_with_vllm()
