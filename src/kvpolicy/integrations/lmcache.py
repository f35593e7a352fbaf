"""LMCache: a kvpolicy publish filter as an L2 ``StorePolicy``.

LMCache 0.5.x's distributed storage manager writes chunks to L1 and asks its
store policy (``lmcache/v1/distributed/storage_controllers/store_policy.py``) two
questions:

* ``select_store_targets(keys: list[ObjectKey], adapters: list[L2AdapterDescriptor])
  -> dict[int, list[ObjectKey]]`` — which of the chunks just written to L1 go to
  which L2 adapter (by the descriptor's ``index``); a key in no list is not stored;
* ``select_l1_deletions(keys) -> list[ObjectKey]`` — which keys to drop from L1
  after a successful L2 store.

A policy is constructed **without arguments** by name from LMCache's registry
(``register_store_policy`` / ``create_store_policy``), chosen with
``--l2-store-policy NAME``. :class:`KVPolicyStorePolicyCore` answers with a
kvpolicy publish filter: the keys of one call that share a model, KV rank, object
group and cache salt (the salt is the tenant) are observed as one request of
``len(keys) × chunk_tokens`` tokens (each chunk counted once per call), and each
chunk is then judged on its own. A call carries every chunk written to L1 since
LMCache's store loop last woke (``StoreController`` pops its whole queue), often
several requests' runs back to back, so a run cut at its first refused chunk
would refuse the chunks of every request behind it.

Configuration comes from ``KVPOLICY_LMCACHE_STORE_POLICY`` (JSON, read at
construction, since LMCache passes none): ``{"filter": "threshold-2" |
"reuse-aware" | "all" | "never" | any make_filter spec, "chunk_tokens": 256,
"bytes_per_token": 131072, "prefill_tokens_per_s": 20000, "adapters": [names or
indexes], "delete_l1_after_store": false}``.

:func:`register` builds the real subclass of LMCache's ``StorePolicy`` (LMCache
is imported only then) and registers it as ``"kvpolicy"``. LMCache's registry
imports only its own modules, so the serving process must call it before
LMCache builds its storage manager (e.g. from a ``sitecustomize.py``; see
docs/integrations.md).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
from collections.abc import Sequence
from typing import Any

from .._io import json_loads
from ..clock import MonotonicClock
from ..errors import ConfigError
from ..protocols import Clock
from ..publish import PublishRequest, check_spec, make_filter

ENV = "KVPOLICY_LMCACHE_STORE_POLICY"
DEFAULTS: dict[str, Any] = {"filter": "threshold-2", "chunk_tokens": 256, "bytes_per_token": 131072, "prefill_tokens_per_s": 20000.0,
                            "adapters": None, "delete_l1_after_store": False}


def load_config(raw: str | None = None) -> dict[str, Any]:
    """The policy's settings: ``raw`` JSON (default: the ``KVPOLICY_LMCACHE_STORE_POLICY`` variable) over the defaults."""
    text = os.environ.get(ENV) if raw is None else raw
    cfg = dict(DEFAULTS)
    if text:
        try:
            given = json_loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(ENV, f"not JSON: {e}") from None
        if not isinstance(given, dict):
            raise ConfigError(ENV, "must be a JSON object")
        unknown = set(given) - set(DEFAULTS)
        if unknown:
            raise ConfigError(ENV, f"unknown settings {sorted(unknown)}; known: {sorted(DEFAULTS)}")
        cfg.update(given)
    for name in ("chunk_tokens", "bytes_per_token"):
        v = cfg[name]
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ConfigError(f"{ENV}.{name}", f"must be a positive int, got {v!r}")
    v = cfg["prefill_tokens_per_s"]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 or v != v or v == float("inf"):
        raise ConfigError(f"{ENV}.prefill_tokens_per_s", f"must be a finite positive number, got {v!r}")
    if not isinstance(cfg["delete_l1_after_store"], bool):  # "false" is truthy: it would have deleted L1 copies
        raise ConfigError(f"{ENV}.delete_l1_after_store", f"must be true or false, got {cfg['delete_l1_after_store']!r}")
    if not isinstance(cfg["filter"], str):
        raise ConfigError(f"{ENV}.filter", f"must be a publish filter spec such as \"threshold-2\", got {cfg['filter']!r}")
    try:
        check_spec(cfg["filter"])  # here, where the setting has its name, not when the store policy builds it
    except ConfigError as e:
        raise ConfigError(f"{ENV}.filter", e.problem) from None
    if cfg["adapters"] is not None and not isinstance(cfg["adapters"], list):
        raise ConfigError(f"{ENV}.adapters", "must be a list of adapter type names or indexes, or null (every adapter)")
    return cfg


class KVPolicyStorePolicyCore:
    """LMCache's store-policy methods, answered by a kvpolicy publish filter (no LMCache import)."""

    def __init__(self, config: dict[str, Any] | None = None, publish_filter: Any = None, *, clock: Clock | None = None) -> None:
        self.config = load_config(json.dumps(config)) if config is not None else load_config()
        self.clock = clock or MonotonicClock()  # each call's time: the filter's windows and decay run on it
        c = self.config
        self.chunk_tokens = c["chunk_tokens"]
        if publish_filter is None:
            block_bytes = c["bytes_per_token"] * self.chunk_tokens
            per_block_s = self.chunk_tokens / c["prefill_tokens_per_s"]
            publish_filter = make_filter(c["filter"], block_bytes=block_bytes, recompute_s=lambda depth: per_block_s)
        if not hasattr(publish_filter, "publishable") or not hasattr(publish_filter, "observe"):
            raise ConfigError("publish_filter", "must implement kvpolicy's PublishFilter (observe, publishable)")
        self.filter = publish_filter
        self._calls = itertools.count()
        self.stored_keys = 0
        self.skipped_keys = 0

    def _chains(self, keys: Sequence[Any]) -> dict[tuple[Any, ...], list[Any]]:
        chains: dict[tuple[Any, ...], list[Any]] = {}
        for k in keys:
            ident = (getattr(k, "model_name", ""), getattr(k, "kv_rank", 0), getattr(k, "object_group_id", 0), getattr(k, "cache_salt", ""))
            chains.setdefault(ident, []).append(k)
        return chains

    def _targets(self, adapters: Sequence[Any]) -> list[int]:
        wanted = self.config["adapters"]
        out = []
        for ad in adapters:
            idx = getattr(ad, "index", None)
            if idx is None:
                raise ConfigError("adapters", f"an L2AdapterDescriptor has an index, got {ad!r:.60}")
            if wanted is None or idx in wanted or getattr(ad, "type_name", None) in wanted:
                out.append(idx)
        return out

    def select_store_targets(self, keys: list[Any], adapters: list[Any]) -> dict[int, list[Any]]:
        targets = self._targets(adapters)
        chosen: list[Any] = []
        call = next(self._calls)
        now = self.clock.now_s()
        for (model, rank, group, salt), chain in self._chains(keys).items():
            tenant = salt or "default"
            req = PublishRequest(request_id=("lmcache", call, model, rank, group, salt), num_tokens=len(chain) * self.chunk_tokens,
                                 block_size_tokens=self.chunk_tokens, tenant=tenant if _tenant_ok(tenant) else "default", time_s=now)
            # an ObjectKey is its whole identity: the same chunk hash under another model, rank, group or salt is another block
            ids = [hashlib.blake2b(repr((getattr(k, "chunk_hash", k), model, rank, group, salt)).encode(), digest_size=16).digest() for k in chain]
            self.filter.observe(req, ids)
            # one call carries every chunk written to L1 since the store loop last woke — often several requests'
            # runs back to back — so each chunk is judged on its own: a run cut at the first refused chunk would
            # refuse the next request's chunks behind it, however often they had been seen
            n = 0
            for key, ident in zip(chain, ids):
                if self.filter.publishable(req, [ident]):
                    chosen.append(key)
                    n += 1
            self.stored_keys += n
            self.skipped_keys += len(chain) - n
        if not chosen or not targets:
            return {}
        return {i: list(chosen) for i in targets}

    def select_l1_deletions(self, keys: list[Any]) -> list[Any]:
        return list(keys) if self.config["delete_l1_after_store"] else []


def _tenant_ok(t: str) -> bool:
    from ..directory.base import TENANT_RE

    return bool(TENANT_RE.fullmatch(t))


def register(name: str = "kvpolicy") -> type:
    """Register kvpolicy's store policy in LMCache's registry (imports LMCache); returns the class. Calling it again
    (a ``sitecustomize`` run twice, a worker that registers too) returns the class already there; a name LMCache
    holds for another policy is an error naming it (LMCache's registry refuses a second registration)."""
    try:
        from lmcache.v1.distributed.storage_controllers import store_policy as sp
    except ImportError:
        raise ConfigError("lmcache", "LMCache (0.5.x, with lmcache.v1.distributed) is not importable here") from None
    registry = getattr(sp, "_STORE_POLICY_REGISTRY", None)
    held = registry.get(name) if isinstance(registry, dict) else None
    if held is not None:
        if isinstance(held, type) and issubclass(held, KVPolicyStorePolicyCore):
            return held
        raise ConfigError("name", f"LMCache already has a store policy {name!r} ({getattr(held, '__name__', held)}); register kvpolicy's "
                                  "under another name and pass that to --l2-store-policy")
    cls = type("KVPolicyStorePolicy", (KVPolicyStorePolicyCore, sp.StorePolicy), {"__doc__": KVPolicyStorePolicyCore.__doc__})
    sp.register_store_policy(name, cls)
    return cls
