"""An SGLang HiCache storage backend that applies kvpolicy in front of a real store.

SGLang 0.5.x loads a storage backend dynamically::

    python -m sglang.launch_server ... --enable-hierarchical-cache --hicache-storage-backend dynamic \\
      --hicache-storage-backend-extra-config '{"backend_name": "kvpolicy",
        "module_path": "kvpolicy.integrations.sglang_hicache", "class_name": "KVPolicyHiCacheStorage",
        "inner": {"backend_name": "file"}, "kvpolicy": {"link_gbps": 100, "prefill_tokens_per_s": 20000,
        "bytes_per_page": 2097152, "page_tokens": 64, "publish": "threshold-2"}}'

(``sglang/srt/mem_cache/storage/backend_factory.py``: the class must subclass
``HiCacheStorage`` and is built as ``cls(storage_config, kwargs)``.) SGLang moves a
dynamic backend's pages through ``batch_get`` / ``batch_set`` unless the extra
config says ``"interface_v1": 1``; add it for a zero-copy inner store (mooncake,
hf3fs, …) and kvpolicy decides on ``batch_get_v1`` / ``batch_set_v1`` instead. The inner
store is any backend SGLang can build (``file``, ``mooncake``, ``hf3fs``, another
dynamic one), created when SGLang registers the host memory pool.

What kvpolicy decides: **loads** — ``batch_exists`` answers how many leading pages
are *worth* prefetching (the inner store's hit run, cut to what the admission
controller proposes; SGLang recomputes the rest) — and **stores** — ``batch_set``
writes only the leading pages the publish filter allows (the others are
reported handled, not stored); a hybrid model's sidecar pools (``batch_set_v2``,
written before the span's KV) only where the filter stores the KV, the KV write keeping
the verdicts the sidecar call got. Every ``batch_get`` is timed and fed back, so the
controller learns this store's real B_eff. Everything else is the inner store's,
every method of SGLang's base class included: ``register_mem_host_pool_v2``,
``batch_get_v2`` and ``on_host_pools_registered`` go to the inner store unchanged.

The base class is SGLang's ``HiCacheStorage`` when SGLang is importable,
``object`` otherwise (the module imports, and is tested, without SGLang).
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any

from ..admission import AdmissionContext, LoadOutcome
from ..errors import ConfigError
from ..matching import PrefixMatch
from ..publish import PublishRequest
from ._forward import forward_to_inner
from ._settings import ADMISSION_DEFAULTS, controller_from_settings, filter_setting, positive_int_setting, read_settings

try:  # pragma: no cover - depends on the environment
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage as _Base  # type: ignore[import-not-found]
except ImportError:
    _Base = object  # type: ignore[assignment,misc]

DEFAULTS = {**ADMISSION_DEFAULTS, "bytes_per_page": 2 << 20, "page_tokens": 64}


def _build_inner(spec: dict[str, Any], storage_config: Any, mem_pool_host: Any) -> Any:
    """The real store ``spec`` names, built by SGLang's own ``StorageBackendFactory`` with the rest of ``spec`` as its
    extra config. A ``dynamic`` inner store keeps ``backend_name`` in its config: SGLang's dynamic loader requires
    ``backend_name``, ``module_path`` and ``class_name`` there (``backend_factory.py``)."""
    import copy

    try:
        from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # type: ignore[import-not-found]
    except ImportError:
        raise ConfigError("extra_config.inner", "building the inner store needs SGLang's StorageBackendFactory "
                                                "(sglang.srt.mem_cache.storage.backend_factory)") from None
    name = spec.get("backend_name")
    if not isinstance(name, str) or not name:
        raise ConfigError("extra_config.inner.backend_name", f"names the real store (\"file\", \"mooncake\", \"dynamic\", ...), got {name!r}")
    cfg = copy.copy(storage_config)
    cfg.extra_config = dict(spec) if name == "dynamic" else ({k: v for k, v in spec.items() if k != "backend_name"} or None)
    return StorageBackendFactory.create_backend(name, cfg, mem_pool_host)


class KVPolicyHiCacheStorage(_Base):  # type: ignore[misc,valid-type]
    def __init__(self, storage_config: Any, kwargs: Any = None, *, inner: Any = None) -> None:
        extra = dict(getattr(storage_config, "extra_config", None) or {})
        self.storage_config = storage_config
        self._inner_spec = extra.get("inner")
        if inner is None and not isinstance(self._inner_spec, dict):
            raise ConfigError("extra_config.inner", "names the real store: {\"backend_name\": \"file\"} or another SGLang backend")
        spec = self._inner_spec if isinstance(self._inner_spec, dict) else {}
        if inner is None and not (isinstance(spec.get("backend_name"), str) and spec["backend_name"]):
            raise ConfigError("extra_config.inner.backend_name", "names the real store (\"file\", \"mooncake\", \"dynamic\" with its "
                                                                  f"module_path and class_name, ...), got {spec.get('backend_name')!r}")
        self.inner = inner
        cfg = read_settings(extra.get("kvpolicy"), DEFAULTS, "extra_config.kvpolicy")
        self.page_tokens = positive_int_setting(cfg, "page_tokens", "extra_config.kvpolicy")
        self.bytes_per_page = positive_int_setting(cfg, "bytes_per_page", "extra_config.kvpolicy")
        self.controller = controller_from_settings(cfg, "extra_config.kvpolicy")
        self.filter = filter_setting(cfg, "publish", "extra_config.kvpolicy", block_bytes=self.bytes_per_page,
                                     block_s=self.page_tokens / cfg["prefill_tokens_per_s"])
        self._ids = itertools.count()
        self.counts = {"exists_pages": 0, "exposed_pages": 0, "set_pages": 0, "stored_pages": 0, "loads_timed": 0,
                       "sidecar_set_pages": 0, "sidecar_stored_pages": 0}
        # the verdicts a sidecar write made for the span whose KV write comes next, and that backup's chain
        self._pending: dict[str, bool] = {}
        self._op_chain: tuple[int, str] | None = None
        # SGLang calls a backend from three threads at once (cache_controller.py: batch_exists from the prefetch
        # thread, the reads from its IO thread, the writes from the backup thread); kvpolicy's decisions share one
        # controller and one filter, so each decision holds this lock — the inner store's I/O never does
        self._lock = threading.Lock()

    # ---------------------------------------------------------------- wiring

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        self.mem_pool_host = mem_pool_host
        if self.inner is None:
            self.inner = _build_inner(self._inner_spec, self.storage_config, mem_pool_host)  # type: ignore[arg-type]
        if hasattr(self.inner, "register_mem_pool_host"):
            self.inner.register_mem_pool_host(mem_pool_host)

    def _ctx(self) -> AdmissionContext:
        return AdmissionContext(block_bytes=self.bytes_per_page, source="hicache-storage")

    def _worth(self, hit_pages: int) -> int:
        """How many of the ``hit_pages`` leading pages the controller proposes to load (pure)."""
        if hit_pages <= 0:
            return 0
        P = self.page_tokens
        # the pages asked about follow what the device and host already hold: no local blocks here
        m = PrefixMatch((hit_pages + 1) * P, P, hit_pages, 0, (hit_pages,), ("storage",), "all_matchable_found")
        d = self.controller.propose(m, self._ctx())
        return d.load_blocks if d.loads else 0

    # ---------------------------------------------------------------- loads: what is worth prefetching

    def _exposed(self, hit: int) -> int:
        with self._lock:
            k = self._worth(hit)
            self.counts["exists_pages"] += hit
            self.counts["exposed_pages"] += k
        return k

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        hit = int(self.inner.batch_exists(keys, extra_info) if extra_info is not None else self.inner.batch_exists(keys))
        return self._exposed(hit)

    def batch_exists_v2(self, keys: list[str], pool_transfers: Any = None, extra_info: Any = None) -> Any:
        res = self.inner.batch_exists_v2(keys, pool_transfers, extra_info)
        k = self._exposed(int(getattr(res, "kv_hit_pages", 0)))
        # set the field itself: SGLang 0.5.23's update_kv_hit_pages keeps the larger of the two (it accumulates
        # batches), which left the inner store's whole hit run in place — kvpolicy's cut was ignored
        res.kv_hit_pages = k
        restorable = getattr(res, "restorable_prefix_pages", None)
        if restorable is not None:  # a trailing-window pool's restorable lengths: none past the cut
            res.restorable_prefix_pages = [p for p in restorable if p <= k]
        return res

    def _timed_get(self, n_pages: int, fn: Any) -> Any:
        """Run a read and feed the controller what it measured (the model learns this store's B_eff)."""
        t0 = time.perf_counter()
        out = fn()
        dt = time.perf_counter() - t0
        if n_pages > 0:
            P = self.page_tokens
            m = PrefixMatch((n_pages + 1) * P, P, n_pages, 0, (n_pages,), ("storage",), "all_matchable_found")
            with self._lock:
                prop = self.controller.propose(m, self._ctx())
                if prop.loads:
                    d = self.controller.admit(prop, self._ctx(), load_blocks=min(n_pages, prop.load_blocks))
                    if d.loads:
                        assert d.load_id is not None  # an admitted load has an id
                        ok = _leading_ok(out, d.load_blocks)
                        self.controller.record(LoadOutcome(d.load_id, "ok" if ok == d.load_blocks else "failed", ok,
                                                           transfer_s=dt * d.load_blocks / n_pages))
                        self.counts["loads_timed"] += 1
        return out

    def batch_get_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> Any:
        return self._timed_get(len(keys), lambda: self.inner.batch_get_v1(keys, host_indices, extra_info))

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> Any:
        return self._timed_get(len(keys), lambda: self.inner.batch_get(keys, target_locations, target_sizes))

    # ---------------------------------------------------------------- stores: only what will be re-read

    def _decide(self, keys: list[str]) -> list[bool]:
        """The publish filter's verdict on ``keys``, page by page, one sighting each (call with the lock held)."""
        req = PublishRequest(request_id=("hicache", next(self._ids)), num_tokens=len(keys) * self.page_tokens,
                             block_size_tokens=self.page_tokens, time_s=self.controller.clock.now_s())
        self.filter.observe(req, keys)
        n = self.filter.publishable(req, keys)
        return [i < n for i in range(len(keys))]

    def _publishable(self, keys: list[str]) -> int:
        """How many leading pages of a KV write to store. Pages a sidecar write of the same span already decided
        (SGLang's hybrid controller writes the sidecars first) keep that verdict, and are not sighted twice."""
        with self._lock:
            ok = [self._pending.pop(k, None) for k in keys]
            rest = [k for k, x in zip(keys, ok) if x is None]
            if rest:
                fresh = iter(self._decide(rest))
                ok = [next(fresh) if x is None else x for x in ok]
            n = next((i for i, x in enumerate(ok) if not x), len(ok))
            self.counts["set_pages"] += len(keys)
            self.counts["stored_pages"] += n
        return n

    def batch_set_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        n = self._publishable(keys)
        if n == 0:
            return [True] * len(keys)  # handled: kvpolicy chose not to store them
        per = len(host_indices) // max(len(keys), 1)
        head = self.inner.batch_set_v1(keys[:n], host_indices[: n * per], extra_info)
        return list(head) + [True] * (len(keys) - n)

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None) -> bool:
        n = self._publishable(keys)
        if n == 0:
            return True
        cut = (lambda x: x[:n] if x is not None else None)
        return bool(self.inner.batch_set(keys[:n], cut(values), cut(target_locations), cut(target_sizes)))

    def batch_set_v2(self, transfers: list[Any], extra_info: Any = None) -> dict[Any, list[bool]]:
        """A hybrid model's sidecar pools (Mamba and SWA states, DSA indexer pages, ...). SGLang's hybrid cache
        controller writes them before the KV pages of the same span, one call per window length. A sidecar page is
        only usable under its KV run, so it is stored only where the publish filter stores the KV: the filter decides
        the transfer's pages here, and the span's KV write that follows keeps those verdicts (one sighting per page
        per backup). An ``all_pages`` pool is cut page by page at the first page left out; a pool that holds a
        trailing window (``trailing_pages``) or block groups is written whole or not at all. What kvpolicy leaves
        out is reported handled (True), as for KV pages. A call whose chain (``extra_info.prefix_keys`` + its keys)
        is not the last call's begins another backup: verdicts no KV write took (a rank that writes no KV, SGLang's
        ``backup_skip``) are dropped, so a page backed up again is sighted again."""
        prefix = list(getattr(extra_info, "prefix_keys", None) or [])
        send, skipped, cut = [], {}, {}
        with self._lock:
            for t in transfers:
                keys = list(getattr(t, "keys", None) or [])
                if not keys:  # nothing keyed: not a host -> storage write kvpolicy can judge
                    send.append(t)
                    continue
                chain = (len(prefix) + len(keys), keys[-1])  # every call of one backup ends its chain at the span's end
                if chain != self._op_chain:
                    self._pending.clear()
                    self._op_chain = chain
                new = [k for k in keys if k not in self._pending]
                if new:
                    self._pending.update(zip(new, self._decide(new)))
                ok = [self._pending[k] for k in keys]
                n = next((i for i, x in enumerate(ok) if not x), len(ok))
                if _policy_name(t) != "all_pages" and n < len(keys):
                    n = 0
                self.counts["sidecar_set_pages"] += len(keys)
                self.counts["sidecar_stored_pages"] += n
                if n == 0:
                    skipped[t.name] = [True] * len(keys)
                elif n == len(keys):
                    send.append(t)
                else:
                    send.append(_cut_transfer(t, keys, n))
                    cut[t.name] = len(keys) - n
        out = dict(self.inner.batch_set_v2(send, extra_info)) if send or not transfers else {}
        for name, rest in cut.items():
            key = name if name in out else getattr(name, "value", name)
            out[key] = list(out.get(key, [])) + [True] * rest
        out.update(skipped)
        return out

    # ---------------------------------------------------------------- everything else is the inner store's

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        return self.inner.get(key, target_location, target_sizes)

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return bool(self.inner.set(key, value, target_location, target_sizes))

    def exists(self, key: str) -> bool:
        return bool(self.inner.exists(key))

    def clear(self) -> None:
        self.inner.clear()

    def get_stats(self) -> Any:
        """The inner store's metrics, unchanged (SGLang's ``StorageMetrics`` or None): with ``--enable-metrics`` SGLang
        0.5.23's scheduler sets ``prefetch_stats`` on what this returns and asserts it is a ``StorageMetrics`` — the
        dict this returned until 2026-12-01 raised there. kvpolicy's own counts are :attr:`counts`."""
        get = getattr(self.inner, "get_stats", None)
        return get() if callable(get) else None

    def __getattr__(self, name: str) -> Any:  # what the inner store has beyond SGLang's base class (``close``, ...)
        if name in ("inner", "_inner_spec"):
            raise AttributeError(name)
        return getattr(self.inner, name)


# every other method of SGLang's base class is the inner store's too: its defaults would otherwise answer —
# on_host_pools_registered would never reach the real store, register_mem_host_pool_v2 would keep a hybrid
# model's sidecar pools on the wrapper, and the sidecar reads and writes (batch_get_v2, batch_set_v2) would raise
forward_to_inner(KVPolicyHiCacheStorage, _Base)


def _policy_name(transfer: Any) -> str:
    """A transfer's ``hit_policy`` as SGLang spells its value (``"all_pages"``, ``"trailing_pages"``, ...)."""
    p = getattr(transfer, "hit_policy", None)
    return str(getattr(p, "value", p)).lower()


def _cut_transfer(t: Any, keys: list[str], n: int) -> Any:
    """``t`` with only its first ``n`` pages: keys and host indices (the same number per page)."""
    import copy

    per = len(t.host_indices) // len(keys) if getattr(t, "host_indices", None) is not None else 0
    c = copy.copy(t)
    c.keys = keys[:n]
    if per:
        c.host_indices = t.host_indices[: n * per]
    return c


def _leading_ok(out: Any, n: int) -> int:
    """Leading pages a read reports as read (a list of booleans, a count, or a list of values)."""
    if isinstance(out, int) and not isinstance(out, bool):
        return min(out, n)
    if isinstance(out, (list, tuple)):
        k = 0
        for x in out[:n]:
            if x is None or x is False:
                break
            k += 1
        return k
    return n
