"""Run kvpolicy's engine adapters on the engines' own base classes, read from their wheels.

The test suite runs without vLLM or SGLang installed, on stand-ins shaped like their base classes. This script
checks the adapters against the real ones: it reads ``KVConnectorBase_V1`` and the transfer-metrics code (vLLM),
``HiCacheStorage`` and the eviction strategies (SGLang) and the store-policy registry with its ``ObjectKey`` (LMCache) out of the downloaded
wheels, with the heavy modules they import (torch, the engines' loggers and configs) stubbed, imports kvpolicy's
adapters on top of them, and drives every hook an engine calls through to a recording inner connector / store::

    pip download vllm==0.33.0 sglang==0.5.23 lmcache==0.5.6 --no-deps -d wheels/
    python tools/check_engine_bases.py --vllm wheels/vllm-0.33.0-*.whl --sglang wheels/sglang-0.5.23-*.whl \
        --lmcache wheels/lmcache-0.5.6-*.whl

Exit status 0 when every check holds. Each engine's check runs in its own process (the adapters pick their base
class once, at import). The drivers (``drive_vllm_connector``, ``drive_vllm_metrics``, ``drive_hicache_backend``,
``drive_lmcache_policy``) also run in the test suite, over stand-ins shaped like the engines' code
(tests/test_integrations.py). ``--sglang`` also reads SGLang's own ``RadixCache`` out of the wheel
(:func:`load_sglang_radix`) and checks kvpolicy's stand-in of its eviction loop against it, reference by reference.
With both ``--vllm`` and ``--sglang``, :func:`check_events` replays KV events made by vLLM's own ``BlockPool`` and
SGLang's own ``RadixCache`` and recorder (tools/engine_events.py) through ``kvpolicy.integrations.vllm_events``.
"""

from __future__ import annotations

import argparse
import enum
import inspect
import logging
import os
import subprocess
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # its sibling, tools/engine_wheels.py
from engine_wheels import SGLANG_EVICT, _load, _module, _numpy_torch, _source, load_sglang_radix  # noqa: E402,F401

VLLM_BASE = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"
VLLM_METRICS = "vllm/distributed/kv_transfer/kv_connector/v1/metrics.py"
VLLM_FACTORY = "vllm/distributed/kv_transfer/kv_connector/factory.py"
VLLM_MULTI = "vllm/distributed/kv_transfer/kv_connector/v1/multi_connector.py"
VLLM_SCHED_OUTPUT = "vllm/v1/core/sched/output.py"
VLLM_OUTPUTS = "vllm/v1/outputs.py"
SGLANG_BASE = "sglang/srt/mem_cache/hicache_storage.py"
SGLANG_FACTORY = "sglang/srt/mem_cache/storage/backend_factory.py"
VLLM_OFFLOAD = "vllm/v1/kv_offload/"
LMCACHE_API = "lmcache/v1/distributed/api.py"
LMCACHE_POLICY = "lmcache/v1/distributed/storage_controllers/store_policy.py"


def check_vllm(wheel: str) -> None:
    for n in ("vllm", "vllm.distributed", "vllm.distributed.kv_transfer", "vllm.distributed.kv_transfer.kv_connector",
              "vllm.distributed.kv_transfer.kv_connector.v1", "vllm.v1", "vllm.v1.attention", "vllm.v1.core",
              "vllm.v1.core.sched", "vllm.v1.metrics"):
        _module(n)
    _module("torch", Tensor=object)
    _module("vllm.logger", init_logger=logging.getLogger)
    _module("vllm.v1.attention.backend", AttentionMetadata=object)
    _module("vllm.v1.core.sched.output", SchedulerOutput=object)
    _module("vllm.v1.metrics.cache_hit_source", CacheHitSource=enum.Enum("CacheHitSource", "EXTERNAL_UNSPECIFIED HOST DISK P2P"))
    _module("vllm.v1.outputs", KVConnectorOutput=object)
    base = _load(wheel, VLLM_BASE, "vllm.distributed.kv_transfer.kv_connector.v1.base")
    # the transfer metrics: vLLM's own KVConnectorStats, KVConnectorLogging and KVConnectorProm
    _module("prometheus_client", Counter=PromCounter, Gauge=type("Gauge", (PromCounter,), {}),
            Histogram=type("Histogram", (PromCounter,), {}))
    # vLLM's own connector factory (its registry) and MultiConnector, which rebuilds children's stats by name
    _module("vllm.config", KVTransferConfig=types.SimpleNamespace, VllmConfig=object)
    _module("vllm.config.kv_transfer", KVTransferConfig=types.SimpleNamespace)
    _module("vllm.distributed.kv_transfer.kv_connector.base", KVConnectorBase=object, KVConnectorBaseType=object)
    v1 = sys.modules["vllm.distributed.kv_transfer.kv_connector.v1"]
    v1.KVConnectorRole, v1.supports_hma = base.KVConnectorRole, base.supports_hma  # type: ignore[attr-defined]
    _module("vllm.utils")
    _module("vllm.utils.func_utils", supports_kw=lambda f, kw: kw in inspect.signature(f).parameters)
    factory = _load(wheel, VLLM_FACTORY, "vllm.distributed.kv_transfer.kv_connector.factory")
    metrics = _load(wheel, VLLM_METRICS, "vllm.distributed.kv_transfer.kv_connector.v1.metrics")
    multi = _load(wheel, VLLM_MULTI, "vllm.distributed.kv_transfer.kv_connector.v1.multi_connector")
    from kvpolicy.integrations import vllm_kv_connector

    drive_vllm_connector(base.KVConnectorBase_V1, vllm_kv_connector)
    drive_vllm_metrics(metrics, factory, vllm_kv_connector, multi.MultiConnector)
    # vLLM's own SchedulerOutput (and the request records in it) and KVConnectorOutput, for the step timer
    _module("vllm.config.ec_manager_config", EncoderCacheManagerMetadata=object)
    _module("vllm.multimodal")
    _module("vllm.multimodal.utils", strip_covered_mm_data=lambda mm, *a, **k: mm)
    _module("vllm.compilation")
    _module("vllm.compilation.cuda_graph", CUDAGraphStat=object)
    _module("vllm.utils.torch_utils", PIN_MEMORY=False)
    sched_output = _load(wheel, VLLM_SCHED_OUTPUT, "vllm.v1.core.sched.output")
    outputs = _load(wheel, VLLM_OUTPUTS, "vllm.v1.outputs")
    ratio = drive_vllm_step_timing(sched_output, outputs, vllm_kv_connector)
    print(f"  step timer: learned the compute at {ratio:.3f}x the profile (true 2.5x) from vLLM 0.33's SchedulerOutput and KVConnectorOutput")
    check_vllm_offload(wheel)


def check_vllm_offload(wheel: str) -> None:
    """vLLM 0.33's own CPU offloading manager (``vllm/v1/kv_offload/cpu/manager.py``, its cache-policy base, factory
    and LRU) read from the wheel, with kvpolicy's CachePolicy classes loaded by module path and kvpolicy's offloading
    spec wrapping its ``prepare_store``: :func:`drive_vllm_offload` runs a seeded workload through it."""
    for n in ("vllm.v1.kv_offload", "vllm.v1.kv_offload.cpu", "vllm.v1.kv_offload.cpu.policies",
              "vllm.distributed.kv_transfer.kv_connector.v1.offloading"):
        _module(n)
    _module("vllm.v1.kv_hints", KvHintsEnvelope=object)
    _module("vllm.v1.kv_offload.config", OffloadingConfig=object)
    _module("vllm.utils.math_utils", cdiv=lambda a, b: -(-a // b))
    _module("vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics", OffloadingConnectorStats=object)
    _module("typing_extensions", override=lambda f: f)

    class Logger(logging.LoggerAdapter):  # vLLM's logger adds the *_once methods
        def warning_once(self, msg: str, *args: object) -> None:
            self.warning(msg, *args)

    _module("vllm.logger", init_logger=lambda name: Logger(logging.getLogger(name), {}))
    ob = _load(wheel, VLLM_OFFLOAD + "base.py", "vllm.v1.kv_offload.base")
    _load(wheel, VLLM_OFFLOAD + "cpu/common.py", "vllm.v1.kv_offload.cpu.common")
    pb = _load(wheel, VLLM_OFFLOAD + "cpu/policies/base.py", "vllm.v1.kv_offload.cpu.policies.base")
    _load(wheel, VLLM_OFFLOAD + "cpu/policies/factory.py", "vllm.v1.kv_offload.cpu.policies.factory")
    _load(wheel, VLLM_OFFLOAD + "cpu/policies/lru.py", "vllm.v1.kv_offload.cpu.policies.lru")
    manager = _load(wheel, VLLM_OFFLOAD + "cpu/manager.py", "vllm.v1.kv_offload.cpu.manager")

    class CPUOffloadingSpec:  # the spec's shape kvpolicy's reads: its extra config, chunk geometry, get_manager
        def __init__(self, extra_config: dict, num_chunks: int) -> None:
            self.extra_config, self.num_chunks = extra_config, num_chunks
            self.tokens_per_block, self.blocks_per_chunk = (16,), 1
            self.eviction_policy = extra_config.get("eviction_policy", "lru")
            self.cache_policy_module_path = extra_config.get("cache_policy_module_path")
            self._manager = None

        def get_manager(self) -> object:
            if not self._manager:
                self._manager = manager.CPUOffloadingManager(num_chunks=self.num_chunks, cache_policy=self.eviction_policy,
                                                             cache_policy_module_path=self.cache_policy_module_path)
            return self._manager

    _module("vllm.v1.kv_offload.cpu.spec", CPUOffloadingSpec=CPUOffloadingSpec)
    from kvpolicy.integrations import vllm_offload

    assert vllm_offload._Base is pb.CachePolicy, "kvpolicy's policies subclass vLLM's CachePolicy"
    runs = [(name, "threshold-2") for name in ("KVPolicyReuseDistance", "KVPolicyAdaptive", "KVPolicyGDSF", "KVPolicyLRU", "lru")]
    runs += [("KVPolicyReuseDistance", "reuse-aware"), ("KVPolicyReuseDistance", "structure-aware"), ("lru", "structure-aware")]
    for name, publish in runs:
        extra = {"kvpolicy_publish": publish, "eviction_policy": name}
        if name != "lru":
            extra["cache_policy_module_path"] = vllm_offload.__name__
        spec = vllm_offload.KVPolicyOffloadingSpec(extra, 48)
        hits = drive_vllm_offload(spec.get_manager(), ob.ReqContext, ob.make_offload_key, seed=7)
        print(f"  offload {name}, {publish}: chunk hit ratio {hits:.3f}, resident chunks behind a missing head "
              f"{UNREACHABLE[0]:.1%} (vLLM 0.33's CPU manager, 48 chunks)")

    class EveryOther:  # a filter that allows all of one offer and none of the next: its cuts fall on resident chunks
        def __init__(self) -> None:
            self.calls = 0

        def observe(self, request: object, keys: list) -> None:
            self.calls += 1

        def publishable(self, request: object, keys: list) -> int:
            return len(keys) if self.calls % 2 else 0

    for name in ("KVPolicyReuseDistance", "lru"):
        mgr = manager.CPUOffloadingManager(num_chunks=48, cache_policy=name,
                                           cache_policy_module_path=None if name == "lru" else vllm_offload.__name__)
        mgr.prepare_store = vllm_offload.filtered_prepare_store(mgr.prepare_store, EveryOther(), 16,
                                                                resident=vllm_offload._resident_in(mgr))
        hits = drive_vllm_offload(mgr, ob.ReqContext, ob.make_offload_key, seed=11)
        print(f"  offload {name}, a filter cutting every other offer: chunk hit ratio {hits:.3f}")

    # issue #60: a request stored over two scheduler steps (a chunked prefill, then decode), and the same chunks after a
    # full reuse, are evicted tail first by every policy — the order vLLM's own LRU gives
    for name in ("lru", "KVPolicyReuseDistance", "KVPolicyAdaptive", "KVPolicyGDSF", "KVPolicyLRU", "KVPolicyLRB"):
        for reuse in (False, True):
            mgr = manager.CPUOffloadingManager(num_chunks=16, cache_policy=name,
                                               cache_policy_module_path=None if name == "lru" else vllm_offload.__name__)
            order = eviction_order_of_a_two_step_request(mgr, ob.ReqContext, ob.make_offload_key, reuse=reuse)
            assert order == [3, 2, 1, 0], f"{name}{' after a reuse' if reuse else ''}: evicted {order}, not tail first"
    print("  offload: a request stored over two steps is evicted [3, 2, 1, 0] by every policy, after a full reuse too (vLLM 0.33's manager)")


def eviction_order_of_a_two_step_request(mgr: object, ReqContext: type, make_key: object, *, reuse: bool) -> list[int]:
    """Request A stores chunks 0-1 in one step and 2-3 in the next (prepare_store, complete_store, each step), then
    finishes; with ``reuse`` a second request loads all four and finishes. One-chunk requests then fill the manager
    until A's chunks are gone: the positions of A's chunks in the order they left."""
    keys = [make_key(b"A" + j.to_bytes(2, "big"), 0) for j in range(4)]  # type: ignore[operator]
    ctx = ReqContext(req_id="A")
    for j, k in enumerate(keys):
        ctx.set_offload_key_position(k, (j + 1) * 16)
    mgr.on_new_request(ctx)  # type: ignore[attr-defined]
    for step in (keys[:2], keys[2:]):
        out = mgr.prepare_store(step, ctx)  # type: ignore[attr-defined]
        mgr.complete_store(list(out.keys_to_store), ctx)  # type: ignore[attr-defined]
    mgr.on_request_finished(ctx)  # type: ignore[attr-defined]
    if reuse:
        again = ReqContext(req_id="B")
        for j, k in enumerate(keys):
            again.set_offload_key_position(k, (j + 1) * 16)
        mgr.on_new_request(again)  # type: ignore[attr-defined]
        assert all(mgr.lookup(k, again).name == "HIT" for k in keys)  # type: ignore[attr-defined]
        mgr.prepare_load(keys, again)  # type: ignore[attr-defined]
        mgr.complete_load(keys, again)  # type: ignore[attr-defined]
        mgr.on_request_finished(again)  # type: ignore[attr-defined]
    gone: list[int] = []
    probe = ReqContext(req_id="probe")
    for i in range(200):
        filler = ReqContext(req_id=f"f{i}")
        k = make_key(b"F" + i.to_bytes(2, "big"), 0)  # type: ignore[operator]
        filler.set_offload_key_position(k, 16)
        mgr.on_new_request(filler)  # type: ignore[attr-defined]
        out = mgr.prepare_store([k], filler)  # type: ignore[attr-defined]
        if out is not None:
            mgr.complete_store(list(out.keys_to_store), filler)  # type: ignore[attr-defined]
        mgr.on_request_finished(filler)  # type: ignore[attr-defined]
        for j, kk in enumerate(keys):
            if j not in gone and mgr.lookup(kk, probe).name == "MISS":  # type: ignore[attr-defined]
                gone.append(j)
        if len(gone) == 4:
            break
    return gone


def drive_vllm_offload(mgr: object, ReqContext: type, make_key: object, *, seed: int, requests: int = 600) -> float:
    """A seeded workload through an offloading manager in the order vLLM's scheduler calls it: requests of shared
    prefix families, up to three in flight, each looking up its leading hits, loading them, storing the rest (one
    store in ten fails) and finishing. After every call the manager's books must balance (evictable chunks counted
    = chunks at ref count 0), vLLM's own assertions must hold, a chunk resident when offered must still be resident
    after the store (vLLM protects the offer), and the policy must hear of every resident chunk an offer held as
    that request's reuse. Returns the chunk hit ratio."""
    import random

    rng = random.Random(seed)
    pol = mgr._policy  # type: ignore[attr-defined]
    heard: dict[str, set] = {}
    finished = pol.on_request_finished

    def on_request_finished(key_groups, insertion_only_keys, reused_keys, req_context):
        heard[req_context.req_id] = set(reused_keys)
        return finished(key_groups, insertion_only_keys, reused_keys, req_context)

    pol.on_request_finished = on_request_finished

    def balanced() -> None:
        ready0 = sum(1 for k in all_keys if (c := pol.get(k)) is not None and c.ref_cnt == 0)
        assert mgr._num_evictable_cache_chunks == ready0, (mgr._num_evictable_cache_chunks, ready0)  # type: ignore[attr-defined]

    all_keys: set = set()
    chains: list[list] = []
    families = [rng.randbytes(8) for _ in range(12)]
    inflight: list[tuple] = []
    looked = hit = 0
    for i in range(requests):
        fam = rng.choice(families) if rng.random() < 0.8 else rng.randbytes(8)
        n = rng.randint(2, 10)
        keys = [make_key(fam + j.to_bytes(2, "big") + (b"" if j < n - 2 else rng.randbytes(1)), 0) for j in range(n)]  # type: ignore[operator]
        all_keys.update(keys)
        ctx = ReqContext(req_id=f"r{i}")
        for j, k in enumerate(keys):
            ctx.set_offload_key_position(k, (j + 1) * 16)
        mgr.on_new_request(ctx)  # type: ignore[attr-defined]
        lead = 0
        while lead < len(keys) and mgr.lookup(keys[lead], ctx).name == "HIT":  # type: ignore[attr-defined]
            lead += 1
        looked += len(keys)
        hit += lead
        if lead:
            mgr.prepare_load(keys[:lead], ctx)  # type: ignore[attr-defined]
        balanced()
        held = {k for k in keys if mgr.lookup(k, ctx).name in ("HIT", "HIT_PENDING")}  # type: ignore[attr-defined]
        ready = {k for k in keys if mgr.lookup(k, ctx).name == "HIT"}  # type: ignore[attr-defined]
        out = mgr.prepare_store(keys, ctx)  # type: ignore[attr-defined]
        assert all(mgr.lookup(k, ctx).name != "MISS" for k in held), "a chunk resident when offered was evicted"  # type: ignore[attr-defined]
        balanced()
        inflight.append((ctx, keys[:lead], list(out.keys_to_store) if out is not None else [], ready))
        while len(inflight) > rng.randint(0, 3):
            c, loaded, stored, was_ready = inflight.pop(0)
            if loaded:
                mgr.complete_load(loaded, c)  # type: ignore[attr-defined]
            if stored:
                mgr.complete_store(stored, c, success=rng.random() > 0.1)  # type: ignore[attr-defined]
            mgr.on_request_finished(c)  # type: ignore[attr-defined]
            balanced()
            missing = was_ready - heard.get(c.req_id, set())
            assert not missing, f"{len(missing)} chunks ready when {c.req_id} offered them were not the policy's reuse"
        chains.append(keys)
    # chunks in memory that can never be hit: vLLM looks a prefix up only to its first miss
    resident = {k for k in all_keys if pol.get(k) is not None}
    unreachable = {k for ks in chains for j, k in enumerate(ks) if k in resident and any(x not in resident for x in ks[:j])}
    UNREACHABLE[0] = len(unreachable) / max(len(resident), 1)
    return hit / looked


#: the share of resident chunks the last drive_vllm_offload left behind a missing head
UNREACHABLE = [0.0]


class SchedulerSideInner:
    """An inner connector's scheduler-side hooks that offer nothing to load and keep no state: what a driver needs
    of one when it checks kvpolicy's side."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        pass

    def build_connector_meta(self, scheduler_output):
        return types.SimpleNamespace()

    def update_connector_output(self, connector_output):
        pass


def drive_vllm_connector(Base: type, m: types.ModuleType) -> None:
    """Build ``m.KVPolicyConnector`` (its module imported over ``Base``) as vLLM's factory does, around a recording
    inner connector, and drive every hook vLLM calls; raises AssertionError on the first that does not arrive."""
    assert m._Base is Base, "the connector subclasses vLLM's base"
    calls: list[tuple] = []

    class Inner(SchedulerSideInner, Base):  # type: ignore[misc,valid-type]  # every abstract hook, recorded
        def start_load_kv(self, forward_context, **kw):
            calls.append(("start_load_kv", self._get_connector_metadata()))

        def wait_for_layer_load(self, layer_name):
            calls.append(("wait_for_layer_load", layer_name))

        def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kw):
            calls.append(("save_kv_layer", layer_name))

        def wait_for_save(self):
            calls.append(("wait_for_save",))

        def get_finished(self, finished_req_ids):
            return {"saved"}, {"loaded"}

        @classmethod
        def get_required_kvcache_layout(cls, vllm_config):
            return "LBHNC"

        @classmethod
        def requires_piecewise_for_cudagraph(cls, extra_config):
            return bool(extra_config.get("layerwise"))

    module_name = f"kvpolicy_check_inner_{id(Inner)}"
    sys.modules[module_name] = types.SimpleNamespace(Inner=Inner)  # type: ignore[assignment]
    try:
        extra = {"inner_connector": "Inner", "inner_connector_module_path": module_name, "layerwise": True,
                 "kvpolicy": {"link_gbps": 100, "bytes_per_token": 2048}}
        ktc = types.SimpleNamespace(kv_connector="KVPolicyConnector", is_kv_producer=True, kv_connector_extra_config=extra)
        cfg = types.SimpleNamespace(kv_transfer_config=ktc, cache_config=types.SimpleNamespace(block_size=16),
                                    model_config=types.SimpleNamespace(model="m"))
        conn = m.KVPolicyConnector(cfg, "worker", None)  # as vLLM's factory builds it
        assert isinstance(conn.inner, Inner)
        meta = conn.build_connector_meta(None)
        conn.bind_connector_metadata(meta)
        conn.start_load_kv(None)
        conn.wait_for_layer_load("layer.0")
        conn.save_kv_layer("layer.0", None, None)
        conn.wait_for_save()
        assert calls == [("start_load_kv", meta), ("wait_for_layer_load", "layer.0"), ("save_kv_layer", "layer.0"), ("wait_for_save",)], calls
        assert conn.get_finished(set()) == ({"saved"}, {"loaded"})
        conn.clear_connector_metadata()
        assert not conn.inner.has_connector_metadata()
        assert conn.requires_kv_delivery is True and conn.role == "worker"
        # questions asked of the class, before any connector exists: the inner class answers
        assert m.KVPolicyConnector.get_required_kvcache_layout(cfg) == "LBHNC"
        assert m.KVPolicyConnector.requires_piecewise_for_cudagraph(extra) is True
        assert m.KVPolicyConnector.supports_sleep_mode(ktc) is True
        missing = sorted(n for c in Base.__mro__ if c is not object for n, v in vars(c).items()
                         if not n.startswith("_") and callable(v) and n not in vars(m.KVPolicyConnector))
        assert not missing, f"methods of vLLM's base the connector does not answer itself or forward: {missing}"
        if m._HMA is not None:  # the hybrid memory allocator: vLLM ends requests with request_finished_all_groups
            finished: list[tuple] = []

            class InnerHMA(Inner, m._HMA):  # type: ignore[misc,valid-type,name-defined]
                def request_finished_all_groups(self, request, block_ids):
                    finished.append((request.request_id, block_ids))
                    return True, {"inner": 1}

            sys.modules[module_name].InnerHMA = InnerHMA  # type: ignore[attr-defined]
            assert issubclass(m.KVPolicyConnectorHMA, m._HMA) and not issubclass(m.KVPolicyConnector, m._HMA)
            hma = m.KVPolicyConnectorHMA(types.SimpleNamespace(**{**vars(cfg), "kv_transfer_config": types.SimpleNamespace(
                **{**vars(ktc), "kv_connector_extra_config": {**extra, "inner_connector": "InnerHMA"}})}), "scheduler", None)
            req = types.SimpleNamespace(request_id="r1", prompt_token_ids=list(range(40)))
            assert hma.request_finished_all_groups(req, ([1, 2], [3])) == (True, {"inner": 1}) and finished == [("r1", ([1, 2], [3]))]
            assert "r1" in hma.policy._pending_meta["stores"], "kvpolicy's publish verdict, before the inner connector's answer"
            try:
                m.KVPolicyConnectorHMA(cfg, "scheduler", None)  # an inner connector without HMA
            except m.ConfigError as e:
                assert e.field == "kv_connector_extra_config.inner_connector"
            else:
                raise AssertionError("KVPolicyConnectorHMA took an inner connector without HMA")
    finally:
        del sys.modules[module_name]


def drive_vllm_step_timing(sched_output: types.ModuleType, outputs: types.ModuleType, m: types.ModuleType) -> float:
    """The connector's step timer over vLLM's own records: ``SchedulerOutput`` (its ``scheduled_new_reqs`` of
    ``NewRequestData``, ``scheduled_cached_reqs`` of ``CachedRequestData``, ``num_scheduled_tokens``) when a step is
    scheduled and ``KVConnectorOutput`` when its output is back — async scheduling (two steps in flight), decode-only
    steps and empty ones (reported only when their output carries something: ``is_empty()``). The deployment
    computes 2.5x the profile; returns the ratio the controller learned (AssertionError beyond 3 %)."""
    from collections import deque

    from kvpolicy.clock import ManualClock

    extra = {"kvpolicy": {"bytes_per_token": 2048}}
    cfg = types.SimpleNamespace(kv_transfer_config=types.SimpleNamespace(kv_connector="KVPolicyConnector", is_kv_producer=True,
                                                                         kv_connector_extra_config=extra),
                                cache_config=types.SimpleNamespace(block_size=16), model_config=types.SimpleNamespace(model="m"),
                                max_concurrent_batches=2)
    conn = m.KVPolicyConnector(cfg, "scheduler", None, inner=SchedulerSideInner())
    assert conn.policy.step_timer is not None and conn.policy.step_timer.steps_in_flight == 2
    clock = ManualClock()
    conn.policy.controller.clock = clock
    model = conn.policy.controller.model

    def step(k: int) -> tuple[object, float]:
        so = sched_output.SchedulerOutput.make_empty()
        if k % 7 == 6:
            return so, 1e-4  # an empty step: nothing to run
        cached = sched_output.CachedRequestData.make_empty()
        cached.req_ids = [f"d{j}" for j in range(6)]
        cached.num_computed_tokens = [2000 + k] * 6
        so.scheduled_cached_reqs = cached
        so.num_scheduled_tokens = dict.fromkeys(cached.req_ids, 1)
        seconds = 0.006
        if k % 3:
            new = sched_output.NewRequestData(req_id=f"p{k}", prompt_token_ids=None, mm_features=[], sampling_params=None,
                                              pooling_params=None, block_ids=([],), num_computed_tokens=512, lora_request=None)
            so.scheduled_new_reqs = [new]
            so.num_scheduled_tokens[f"p{k}"] = 1536
            seconds += 2.5 * model.prefill_seconds(512, 2048)
        so.total_num_scheduled_tokens = sum(so.num_scheduled_tokens.values())
        return so, seconds

    queue: deque = deque()  # vLLM's batch queue: (step, done at s, output)
    gpu_free = 0.0
    for k in range(90):  # step_with_batch_queue: schedule while there is room, else block on the oldest
        so, seconds = step(k)
        conn.build_connector_meta(so)
        gpu_free = max(clock.now_s(), gpu_free) + seconds
        empty = so.total_num_scheduled_tokens == 0
        out = outputs.KVConnectorOutput(finished_recving={"x"} if empty and k % 2 else None)
        queue.append((k, gpu_free, out, empty))
        if len(queue) < 2:
            continue
        _, done, out, empty = queue.popleft()
        clock.advance(max(done - clock.now_s(), 0.0))
        if not (empty and out.is_empty()):  # vLLM hands the scheduler an empty step's output only when it carries something
            conn.update_connector_output(out)
    ratio = model.prefill_ratio.q(0.5)
    assert abs(ratio / 2.5 - 1) < 0.03, (ratio, conn.policy.step_timer.steps)
    return ratio


class PromCounter:
    """prometheus_client's metric as vLLM uses it: ``cls(name=, documentation=, labelnames=).labels(*v).inc(n)``."""

    def __init__(self, name: str, documentation: str = "", labelnames: object = (), **kw: object) -> None:
        self.name, self.labelnames, self.values = name, list(labelnames), {}  # type: ignore[call-overload]

    def labels(self, *values: object) -> object:
        assert len(values) == len(self.labelnames), (self.name, values)
        metric = self

        class Child:
            def inc(self, n: float = 1) -> None:
                metric.values[values] = metric.values.get(values, 0) + n

            def set(self, v: float) -> None:  # a Gauge's
                metric.values[values] = v

        return Child()


class AddingStats:
    """An inner connector's transfer stats as vLLM's connectors keep them (``OffloadingConnectorStats``): a ``data``
    dict of counts that add up across workers and intervals."""

    data: dict

    def aggregate(self, other):
        self.data = {k: self.data.get(k, 0) + other.data.get(k, 0) for k in {*self.data, *other.data}}
        return self

    def reduce(self):
        return dict(self.data)

    def is_empty(self):
        return not any(self.data.values())

    def reset(self):
        self.data = {}


def drive_vllm_metrics(metrics: types.ModuleType, factory: types.ModuleType, m: types.ModuleType, Multi: type) -> None:
    """Feed what the wrapping connector reports through vLLM's own transfer-metrics code (``metrics``: its
    ``KVConnectorStats``, ``KVConnectorLogging``, ``KVConnectorProm``), as vLLM's front end does: the payload
    rebuilt by the configured class (found by ``factory``, from the config's module path), added up, logged, and
    observed by Prometheus — the inner connector's stats and kvpolicy's counts both arrive; and as a child of
    ``Multi`` (vLLM's ``MultiConnector``), which rebuilds it by the connector's registered name. Raises
    AssertionError on the first that does not."""
    assert m._StatsBase is metrics.KVConnectorStats, "kvpolicy's stats subclass vLLM's"
    assert factory.KVConnectorFactory.get_connector_class_by_name("KVPolicyConnector") is m.KVPolicyConnector, "registered by name"

    class InnerStats(AddingStats, metrics.KVConnectorStats):  # type: ignore[misc,name-defined]
        pass

    observed: list = []

    class Inner:
        def __init__(self, *a):
            pass

        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            return 4096, False

        def update_state_after_alloc(self, request, blocks, num_external_tokens):
            pass

        def get_kv_connector_stats(self):
            return InnerStats(data={"transfer_bytes": 100})

        @classmethod
        def build_kv_connector_stats(cls, data=None):
            return InnerStats(data=dict(data or {}))

        @classmethod
        def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
            return types.SimpleNamespace(observe=lambda data, engine_idx=0: observed.append(data))

    module_name = f"kvpolicy_check_metrics_{id(Inner)}"
    sys.modules[module_name] = types.SimpleNamespace(Inner=Inner)  # type: ignore[assignment]
    Inner.__module__, Inner.__qualname__ = module_name, "Inner"
    try:
        extra = {"inner_connector": "Inner", "inner_connector_module_path": module_name,
                 "kvpolicy": {"link_gbps": 0.001, "bytes_per_token": 2048}}
        ktc = types.SimpleNamespace(kv_connector="KVPolicyConnector", kv_connector_module_path=m.__name__, kv_connector_extra_config=extra)
        cfg = types.SimpleNamespace(kv_transfer_config=ktc, cache_config=types.SimpleNamespace(block_size=16),
                                    model_config=types.SimpleNamespace(model="m"))
        assert factory.KVConnectorFactory.get_connector_class(ktc) is m.KVPolicyConnector
        conn = m.KVPolicyConnector(cfg, "scheduler", None)
        req = types.SimpleNamespace(request_id="r1", prompt_token_ids=list(range(8192)))
        assert conn.get_num_new_matched_tokens(req, 0) == (0, False), "a slow link: recompute"
        conn.update_state_after_alloc(req, [], 0)
        from kvpolicy.clock import ManualClock

        clock = conn.policy.controller.clock = ManualClock()
        for k in range(60):  # steps through the helper: the compute learned at 2x the profile (the prior: 20,000 tokens/s)
            tokens = 256 * (1 + k % 8)
            conn.policy.build_connector_meta(types.SimpleNamespace(num_scheduled_tokens={"p": tokens, "d": 1}, scheduled_new_reqs=[],
                                                                   scheduled_cached_reqs=types.SimpleNamespace(req_ids=["p", "d"],
                                                                                                               num_computed_tokens=[0, 900])))
            clock.advance(0.005 + 2 * tokens / 20000.0)
            conn.policy.update_connector_output(types.SimpleNamespace())
            clock.advance(1.0)
        stats = conn.get_kv_connector_stats()
        assert isinstance(stats, metrics.KVConnectorStats)
        assert abs(stats.learned["compute_over_profile"] - 2.0) < 0.05 and abs(stats.learned["step_fixed_s"] - 0.005) < 1e-3, stats.learned
        payload = stats.to_dict()  # what the scheduler sends to the front end
        log = metrics.KVConnectorLogging(ktc)
        log.observe(payload)
        log.observe(payload)
        lines: list[str] = []
        log.log(lambda fmt, *a: lines.append(fmt % a))
        assert len(lines) == 1 and "transfer_bytes=200" in lines[0], lines
        assert "kvpolicy_requests=2" in lines[0] and "kvpolicy_declined_slower_than_recompute=2" in lines[0], lines
        assert "kvpolicy_compute_over_profile=2.0" in lines[0], lines
        prom = metrics.KVConnectorProm(cfg, ["model_name"], {0: ["m"]})
        prom.observe(payload, 0)
        counters = {c.name: c for c in (*prom.prom_metrics.tokens.values(), prom.prom_metrics.declined, *prom.prom_metrics.learned.values())}
        assert counters["vllm:kvpolicy_offered_tokens"].values == {("m",): 4096}, counters
        assert abs(counters["vllm:kvpolicy_compute_over_profile"].values[("m",)] - 2.0) < 0.05, "a gauge of what was learned"
        assert counters["vllm:kvpolicy_declined_requests"].values == {("m", "slower_than_recompute"): 1}
        assert observed == [{"transfer_bytes": 100}], "the inner connector's Prometheus metrics get its part"
        # a child of vLLM's MultiConnector: its stats come back keyed by class name, rebuilt by registered name
        rebuilt = Multi.build_kv_connector_stats(data={"KVPolicyConnector": payload})
        reduced = rebuilt.reduce()["KVPolicyConnector"]
        assert reduced["transfer_bytes"] == 100 and reduced["kvpolicy_requests"] == 1, reduced
    finally:
        del sys.modules[module_name]


def check_sglang(wheel: str) -> None:
    for n in ("sglang", "sglang.srt", "sglang.srt.mem_cache"):
        _module(n)
    _module("torch", Tensor=object)

    class _Envs:
        def __getattr__(self, name: str) -> object:
            return types.SimpleNamespace(get=lambda: None, value=None)

    _module("sglang.srt.environ", envs=_Envs())
    base = _load(wheel, SGLANG_BASE, "sglang.srt.mem_cache.hicache_storage")
    from kvpolicy.integrations import sglang_hicache

    drive_hicache_backend(base.HiCacheStorage, sglang_hicache, base.PoolTransferResult)
    drive_hicache_sidecars(base, sglang_hicache)
    _module("sglang.srt.mem_cache.storage")
    _module("sglang.srt.mem_cache.storage.file")
    _module("sglang.srt.utils")
    _module("sglang.srt.utils.common", human_readable_int=str)
    _load(wheel, "sglang/srt/mem_cache/storage/file/lru_file_evictor.py", "sglang.srt.mem_cache.storage.file.lru_file_evictor")
    factory = _load(wheel, SGLANG_FACTORY, "sglang.srt.mem_cache.storage.backend_factory")
    drive_hicache_factory(factory.StorageBackendFactory, base, sglang_hicache)
    evict = _load(wheel, SGLANG_EVICT, "sglang.srt.mem_cache.evict_policy")
    drive_sglang_strategies(evict)
    radix, params, _ = load_sglang_radix(wheel)
    drive_sglang_radix(radix, params, evict)


def drive_sglang_radix(radix: types.ModuleType, params: types.ModuleType, evict: types.ModuleType) -> None:
    """kvpolicy's stand-in of SGLang's radix cache (``radix_replay(..., merge_runs=True)``) against SGLang's own
    ``RadixCache`` (``sglang_radix_replay``): with priorities that never tie — LRU and LFU, then the node's first
    token — the two hit the same references, one by one. (With SGLang's own LRU and LFU strategies they can part where
    leaves tie: SGLang heaps a list made from a set of nodes, whose order is the nodes' addresses — two runs of SGLang's
    own code can differ there.) Then kvpolicy's strategies run inside SGLang's own tree, beside the stand-in."""
    import numpy as np

    from kvpolicy.eviction import AdaptivePolicy, HitDensityPolicy
    from kvpolicy.integrations.sglang import make_sglang_strategy, policy_factories
    from kvpolicy.testing.radix import radix_replay, sglang_radix_replay
    from kvpolicy.traces import generate, preset

    def first(node: object) -> int:
        key = node.key  # type: ignore[attr-defined]
        return int(key.token_ids[0]) if hasattr(key, "token_ids") else int(key[0])

    tie_free = {"lru": lambda n: (n.last_access_time, first(n)), "lfu": lambda n: (n.hit_count, n.last_access_time, first(n))}
    for name, seed in (("agent", 7), ("chat", 7), ("mixed", 7)):
        trace = generate(preset(name, seed=seed, n_requests=1200))
        distinct = int(np.unique(trace.block_ids).size)
        for cap in (distinct // 64, distinct // 16):
            for which, rank in tie_free.items():
                theirs = sglang_radix_replay(trace, types.SimpleNamespace(get_priority=rank), cap, radix=radix, params=params)
                ours = radix_replay(trace, rank, cap, merge_runs=True)
                assert (theirs == ours).all(), (f"{name} seed {seed} at {cap} tokens, {which} without ties: SGLang's RadixCache "
                                                f"{int(theirs.sum())} hits, the stand-in {int(ours.sum())}; first apart at reference "
                                                f"{int(np.flatnonzero(theirs != ours)[0])}")
            print(f"  SGLang's own RadixCache, {name} seed {seed}, {cap} tokens: the stand-in hits what it hits (LRU and LFU without ties)")
    try:
        from hypothesis import HealthCheck, given, settings, strategies as st
    except ImportError:
        print("  (hypothesis not installed: the random prefix traces are skipped)")
    else:
        from kvpolicy.testing.strategies import prefix_traces

        @settings(max_examples=300, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(trace=prefix_traces(max_requests=40), cap=st.integers(1, 14), which=st.sampled_from(sorted(tie_free)))
        def random_traces(trace: object, cap: int, which: str) -> None:
            rank = tie_free[which]
            theirs = sglang_radix_replay(trace, types.SimpleNamespace(get_priority=rank), cap, radix=radix, params=params)
            assert (theirs == radix_replay(trace, rank, cap, merge_runs=True)).all()

        random_traces()
        print("  SGLang's own RadixCache, 300 random prefix traces (Hypothesis), 1-14 tokens: the stand-in hits what it hits")
    trace = generate(preset("agent", seed=7, n_requests=1200))
    cap = int(np.unique(trace.block_ids).size) // 16
    lru = int(sglang_radix_replay(trace, evict.LRUStrategy(), cap, radix=radix, params=params).sum())
    # what `kvpolicy sglang-bench --sglang-own` does with an installed SGLang: its modules imported by name, torch too
    from kvpolicy.integrations.sglang_bench import compare_strategies

    own = compare_strategies(trace, [cap], ["sglang-lru", "kvpolicy-reuse-distance"], own_sglang=True)
    got = own["results"][0]["hit_blocks"]  # SGLang's LRU again: equal but for its ties' address order
    assert own["loop"] == "SGLang's own RadixCache" and abs(got - lru) <= 0.001 * lru, (got, lru)
    drive_sglang_step_clock(wheel_of_radix(radix), radix, params, trace, cap)
    for policy in (HitDensityPolicy(cap), AdaptivePolicy(cap), policy_factories()["reuse-distance"]()):  # as register() builds it
        clock = [0.0]
        strategy = make_sglang_strategy(policy, now_s=lambda c=clock: c[0])
        assert isinstance(strategy, evict.EvictionStrategy), type(strategy).__mro__
        hits = int(sglang_radix_replay(trace, strategy, cap, clock, radix=radix, params=params).sum())
        print(f"  SGLang's own RadixCache, agent seed 7, {cap} tokens: {policy.name} {hits:,} hits, SGLang's LRU {lru:,}")


def wheel_of_radix(radix: types.ModuleType) -> str:
    """The wheel a module was read out of (its code's file name is ``WHEEL!path``)."""
    fn = radix.RadixCache.__init__.__code__.co_filename
    return fn.split("!", 1)[0]


def drive_sglang_step_clock(wheel: str, radix: types.ModuleType, params: types.ModuleType, trace: object, cap: int) -> None:
    """SGLang 0.5.23's server builds ``UnifiedRadixCache``, whose nodes are stamped by a step counter
    (``unified_cache/components/base.py``: ``get_and_increase_time_counter``, one more per stamp), not
    ``time.monotonic()``. With SGLang's own counter as the tree's clock, kvpolicy's hit density and adaptive rank at the
    tree's own time by default: they decide exactly as when told the counter's value, where a wall clock would not be
    the nodes' clock at all."""
    import numpy as np

    from kvpolicy.eviction import AdaptivePolicy, HitDensityPolicy
    from kvpolicy.integrations.sglang import make_sglang_strategy
    from kvpolicy.testing.radix import sglang_radix_replay

    counter = types.ModuleType("sglang_step_counter")
    counter.float64 = np.float64  # type: ignore[attr-defined]
    counter._LAST_ACCESS_TIME_COUNTER_FLOAT = np.float64(1.0)  # type: ignore[attr-defined]  # SGLang's initial value
    tree = __import__("ast").parse(_source(wheel, "sglang/srt/mem_cache/unified_cache/components/base.py"))
    fn = [n for n in tree.body if getattr(n, "name", None) == "get_and_increase_time_counter"]
    assert fn, "SGLang's UnifiedRadixCache clock (get_and_increase_time_counter) is not where it was"
    exec(compile(__import__("ast").Module(body=fn, type_ignores=[]), "components/base.py", "exec"), counter.__dict__)
    step = counter.get_and_increase_time_counter
    for cls in (HitDensityPolicy, AdaptivePolicy):
        got = {}
        for how in ("default", "told", "wall"):
            counter._LAST_ACCESS_TIME_COUNTER_FLOAT = np.float64(1.0)  # type: ignore[attr-defined]
            now = {"default": None, "told": lambda: float(counter._LAST_ACCESS_TIME_COUNTER_FLOAT) - 1.0,  # type: ignore[attr-defined]
                   "wall": __import__("time").monotonic}[how]
            strategy = make_sglang_strategy(cls(cap), now_s=now)
            got[how] = int(sglang_radix_replay(trace, strategy, cap, radix=radix, params=params, stamp=step).sum())
        # both decide exactly as told (adaptive too, whatever order SGLang's set of leaves hands them over in: a run
        # on CI once parted by 2 % when its mini-simulations replayed blocks in that order)
        assert got["default"] == got["told"], (cls.name, got)
        print(f"  SGLang's own RadixCache stamped by UnifiedRadixCache's step counter, {cap} tokens: {cls.name} "
              f"{got['default']:,} hits at its default clock, {got['told']:,} told the counter, {got['wall']:,} on a wall clock")


def drive_sglang_strategies(evict: types.ModuleType) -> None:
    """SGLang's own ``LRUStrategy`` and ``LFUStrategy`` through kvpolicy's stand-in of its eviction loop
    (``kvpolicy.testing.radix``) keep exactly what the stand-in's copies of them keep (so what bench_sglang_strategy.py
    compares kvpolicy with is SGLang's priority, not a paraphrase), and kvpolicy's strategies built by
    ``make_sglang_strategy`` are SGLang ``EvictionStrategy`` instances that run through the same loop."""
    from kvpolicy.eviction import AdaptivePolicy, HitDensityPolicy, LRUPolicy
    from kvpolicy.integrations.sglang import make_sglang_strategy
    from kvpolicy.testing.radix import radix_replay, sglang_lfu, sglang_lru
    from kvpolicy.traces import generate, preset

    trace = generate(preset("agent", seed=7, n_requests=800))
    cap = 250
    for theirs, ours in ((evict.LRUStrategy(), sglang_lru), (evict.LFUStrategy(), sglang_lfu)):
        a, b = radix_replay(trace, theirs.get_priority, cap), radix_replay(trace, ours, cap)
        assert (a == b).all(), f"{type(theirs).__name__}: {int(a.sum())} hits, the stand-in's copy {int(b.sum())}"
    lru_hits = int(radix_replay(trace, evict.LRUStrategy().get_priority, cap).sum())
    for policy in (LRUPolicy(cap), HitDensityPolicy(cap), AdaptivePolicy(cap)):
        clock = [0.0]
        strategy = make_sglang_strategy(policy, now_s=(lambda c=clock: c[0]) if isinstance(policy, HitDensityPolicy) else None)
        assert isinstance(strategy, evict.EvictionStrategy), type(strategy).__mro__
        hits = int(radix_replay(trace, strategy.get_priority, cap, clock=clock).sum())
        print(f"  SGLang's eviction loop (stand-in), agent seed 7, {cap} blocks: {policy.name} {hits:,} hits, SGLang's LRU {lru_hits:,}")


def drive_hicache_sidecars(base: types.ModuleType, m: types.ModuleType) -> None:
    """A hybrid model's sidecar writes with SGLang's own ``PoolTransfer``, ``PoolName``, ``PoolHitPolicy`` and
    ``HiCacheStorageExtraInfo``, in the order its hybrid controller makes them (sidecars, then the KV): under
    threshold-2 nothing of a span seen once is stored, sidecar or KV, and its answers are keyed by SGLang's pool
    names; at the span's second backup the KV and its sidecars are stored together."""
    written: list[tuple[object, str]] = []

    class Inner:
        def batch_set_v2(self, transfers, extra_info=None):
            for t in transfers:
                written.extend((t.name, k) for k in t.keys)
            return {t.name: [True] * len(t.keys) for t in transfers}

        def batch_set_v1(self, keys, host_indices, extra_info=None):
            written.extend(("kv", k) for k in keys)
            return [True] * len(keys)

    cfg = types.SimpleNamespace(extra_config={"inner": {"backend_name": "file"}, "kvpolicy": {"link_gbps": 100, "publish": "threshold-2"}})
    s = m.KVPolicyHiCacheStorage(cfg, None, inner=Inner())
    Name, Hit, Info = base.PoolName, base.PoolHitPolicy, base.HiCacheStorageExtraInfo

    def backup(span: list[str]) -> dict:
        mamba = base.PoolTransfer(name=Name.MAMBA, host_indices=[0], keys=span[-1:], hit_policy=Hit.TRAILING_PAGES)
        indexer = base.PoolTransfer(name=Name.INDEXER, host_indices=list(range(len(span))), keys=list(span), hit_policy=Hit.ALL_PAGES)
        got = dict(s.batch_set_v2([mamba], Info(prefix_keys=["root"] + span[:-1])))
        got.update(s.batch_set_v2([indexer], Info(prefix_keys=["root"])))
        assert s.batch_set_v1(span, list(range(len(span))), Info(prefix_keys=["root"])) == [True] * len(span)
        return got

    span = [f"page-{i}" for i in range(4)]
    got = backup(span)
    assert got == {Name.MAMBA: [True], Name.INDEXER: [True] * 4} and written == [], (got, written)
    backup(["other"])
    backup(span)
    assert sorted(map(str, written)) == sorted(map(str, [(Name.MAMBA, "page-3")] + [(Name.INDEXER, k) for k in span] + [("kv", k) for k in span])), written


def drive_hicache_factory(Factory: type, base: types.ModuleType, m: types.ModuleType) -> None:
    """kvpolicy's backend built as SGLang's cache controller builds a ``dynamic`` one (``create_backend`` then
    ``register_mem_pool_host``), its inner store built by the same factory: SGLang's ``file`` store, and a ``dynamic``
    one (whose extra config must keep ``backend_name``, ``module_path`` and ``class_name``)."""
    import tempfile

    made: list[object] = []

    class Recorder(base.HiCacheStorage):  # type: ignore[misc,name-defined]  # a third-party store SGLang loads dynamically
        def __init__(self, storage_config, kwargs=None):
            self.extra = storage_config.extra_config
            made.append(self)

        def register_mem_pool_host(self, pool):
            self.pool = pool

        def batch_exists(self, keys, extra_info=None):
            return len(keys)

        def get(self, key, target_location=None, target_sizes=None):
            return None

        def batch_get(self, keys, target_locations=None, target_sizes=None):
            return [None] * len(keys)

        def set(self, key, value=None, target_location=None, target_sizes=None):
            return True

        def batch_set(self, keys, values=None, target_locations=None, target_sizes=None):
            return True

        def exists(self, key):
            return True

    mod = f"kvpolicy_check_hicache_{id(Recorder)}"
    sys.modules[mod] = types.SimpleNamespace(Recorder=Recorder)  # type: ignore[assignment]
    pool = types.SimpleNamespace(layout="page_first", page_size=64)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for inner in ({"backend_name": "dynamic", "module_path": mod, "class_name": "Recorder", "marker": 7},
                          {"backend_name": "file", "file_storage_path": tmp}):
                cfg = base.HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                                is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                                                model_name="m", extra_config={"backend_name": "kvpolicy", "module_path": m.__name__,
                                                                              "class_name": "KVPolicyHiCacheStorage", "inner": inner,
                                                                              "kvpolicy": {"link_gbps": 100}})
                backend = Factory.create_backend("dynamic", cfg, pool)  # SGLang's cache controller, then its attach
                assert isinstance(backend, m.KVPolicyHiCacheStorage), type(backend)
                backend.register_mem_pool_host(pool)
                if inner["backend_name"] == "dynamic":
                    assert made and backend.inner is made[-1] and made[-1].pool is pool, "the dynamic inner store was not built"
                    assert made[-1].extra == inner, f"the inner store's extra config: {made[-1].extra}"
                    assert backend.batch_exists([f"k{i}" for i in range(4)]) == 4
                else:
                    assert type(backend.inner).__name__ == "HiCacheFile" and backend.inner.file_path == tmp, backend.inner
    finally:
        del sys.modules[mod]


def drive_hicache_backend(Base: type, m: types.ModuleType, Result: type) -> None:
    """Build ``m.KVPolicyHiCacheStorage`` (its module imported over ``Base``) around a recording inner store and make
    the calls SGLang's cache controllers make; raises AssertionError on the first that does not reach the store.
    ``Result``: SGLang's ``PoolTransferResult`` (what ``batch_exists_v2`` answers, and kvpolicy cuts)."""
    assert m._Base is Base, "the backend subclasses SGLang's base"
    calls: list[object] = []

    class Inner:
        def register_mem_pool_host(self, pool):
            calls.append("register_mem_pool_host")

        def register_mem_host_pool_v2(self, pool, name):
            calls.append(("register_mem_host_pool_v2", name))

        def on_host_pools_registered(self):
            calls.append("on_host_pools_registered")

        def batch_get_v2(self, transfers, extra_info=None):
            return {"mamba": [True]}

        def batch_set_v2(self, transfers, extra_info=None):
            return {"mamba": [True]}

        def exists(self, key):
            return False

        def close(self):
            calls.append("close")

        def get_stats(self):
            return metrics

    metrics = types.SimpleNamespace(prefetch_pgs=[3], backup_pgs=[], prefetch_bandwidth=[], backup_bandwidth=[])  # StorageMetrics
    cfg = types.SimpleNamespace(extra_config={"inner": {"backend_name": "file"}, "kvpolicy": {"link_gbps": 100}})
    s = m.KVPolicyHiCacheStorage(cfg, None, inner=Inner())
    s.register_mem_pool_host(object())  # SGLang's attach: the anchor pool, then each sidecar pool, then the signal
    s.register_mem_host_pool_v2(object(), "mamba")
    s.on_host_pools_registered()
    assert s.batch_get_v2([]) == {"mamba": [True]} and s.batch_set_v2([]) == {"mamba": [True]}
    assert s.exists("nope") is False
    # SGLang 0.5.23 with --enable-metrics (unified_radix_cache.py): get_stats(), None -> StorageMetrics(), then
    # `storage_metrics.prefetch_stats = ...` and an isinstance assert — the store's own metrics object must come back
    got = s.get_stats()
    assert got is metrics, f"get_stats must be the inner store's StorageMetrics, got {got!r}"
    got.prefetch_stats = {}
    s.close()
    assert calls == ["register_mem_pool_host", ("register_mem_host_pool_v2", "mamba"), "on_host_pools_registered", "close"], calls
    missing = sorted(n for c in Base.__mro__ if c is not object for n, v in vars(c).items()
                     if not n.startswith("_") and callable(v) and n not in vars(m.KVPolicyHiCacheStorage))
    assert not missing, f"methods of SGLang's base the backend does not answer itself or forward: {missing}"

    class Stored:  # holds every page asked about
        def batch_exists_v2(self, keys, pool_transfers=None, extra_info=None):
            return Result(kv_hit_pages=len(keys), extra_pool_hit_pages={}, restorable_prefix_pages=list(range(len(keys) + 1)))

    slow = m.KVPolicyHiCacheStorage(types.SimpleNamespace(extra_config={"inner": {"backend_name": "file"}, "kvpolicy": {"link_gbps": 0.001}}),
                                    None, inner=Stored())
    assert slow.get_stats() is None, "a store without metrics: None, which SGLang replaces with an empty StorageMetrics"
    res = slow.batch_exists_v2([f"page-{i}" for i in range(8)])
    assert res.kv_hit_pages == 0 and res.restorable_prefix_pages == [0], "a link slower than recompute: no page is worth prefetching"
    fast = m.KVPolicyHiCacheStorage(cfg, None, inner=Stored())
    assert fast.batch_exists_v2([f"page-{i}" for i in range(8)]).kv_hit_pages == 8


class L2AdapterDescriptor:
    """LMCache's descriptor of an L2 adapter, as the store policy sees it: ``index`` and ``type_name``."""

    def __init__(self, index: int, type_name: str) -> None:
        self.index, self.type_name = index, type_name


def check_lmcache(wheel: str) -> None:
    for n in ("lmcache", "lmcache.v1", "lmcache.v1.distributed", "lmcache.v1.distributed.storage_controllers"):
        _module(n)
    _module("torch", Tensor=object, Size=tuple, dtype=object)
    _module("lmcache.logging", init_logger=logging.getLogger)
    api = _load(wheel, LMCACHE_API, "lmcache.v1.distributed.api")
    _module("lmcache.v1.distributed.storage_controllers.utils", L2AdapterDescriptor=L2AdapterDescriptor)
    sp = _load(wheel, LMCACHE_POLICY, "lmcache.v1.distributed.storage_controllers.store_policy")
    from kvpolicy.integrations import lmcache

    drive_lmcache_policy(sp, api.ObjectKey, lmcache)


def drive_lmcache_policy(sp: types.ModuleType, ObjectKey: type, m: types.ModuleType) -> None:
    """Register kvpolicy's store policy in ``sp`` (LMCache's store_policy module: its registry), build it as LMCache
    does (``create_store_policy(name)``, no arguments) and ask it what LMCache's StoreController asks, with LMCache's
    own ``ObjectKey``s. Raises AssertionError on the first answer that is not LMCache's contract."""
    import os

    saved = os.environ.pop(m.ENV, None)
    try:
        cls = m.register("kvpolicy")
        assert issubclass(cls, sp.StorePolicy) and "kvpolicy" in sp.get_registered_store_policies()
        assert m.register("kvpolicy") is cls, "registering again returns the class already there"
        try:
            m.register("default")  # LMCache's own
        except m.ConfigError as e:
            assert e.field == "name"
        else:
            raise AssertionError("kvpolicy took over a name LMCache holds for another policy")
        pol = sp.create_store_policy("kvpolicy")
        assert isinstance(pol, sp.StorePolicy)
        run = [ObjectKey(chunk_hash=bytes([i]) * 16, model_name="meta-llama/Llama-3-8B", kv_rank=0) for i in range(4)]
        salted = [ObjectKey(chunk_hash=bytes([i]) * 16, model_name="meta-llama/Llama-3-8B", kv_rank=0, cache_salt="user-7")
                  for i in range(2)]
        adapters = [L2AdapterDescriptor(0, "fs"), L2AdapterDescriptor(1, "redis")]
        assert pol.select_store_targets(run + salted, adapters) == {}, "threshold-2: seen once, not stored"
        got = pol.select_store_targets(run + salted, adapters)
        assert got == {0: run + salted, 1: run + salted}, got
        fresh = ObjectKey(chunk_hash=b"\xff" * 16, model_name="meta-llama/Llama-3-8B", kv_rank=0)
        assert pol.select_store_targets([fresh] + run, adapters) == {0: run, 1: run}, "each chunk on its own sightings"
        assert pol.select_l1_deletions(run) == []
    finally:
        if saved is not None:
            os.environ[m.ENV] = saved


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm", help="a vLLM wheel (pip download vllm==0.33.0 --no-deps)")
    ap.add_argument("--sglang", help="an SGLang wheel (pip download sglang==0.5.23 --no-deps)")
    ap.add_argument("--lmcache", help="an LMCache wheel (pip download lmcache==0.5.6 --no-deps)")
    ap.add_argument("--only", choices=("vllm", "sglang", "lmcache"), help=argparse.SUPPRESS)  # one engine, in this process
    args = ap.parse_args(argv)
    checks = {"vllm": check_vllm, "sglang": check_sglang, "lmcache": check_lmcache}
    if args.only:
        checks[args.only](getattr(args, args.only))
        return 0
    if not (args.vllm or args.sglang or args.lmcache):
        ap.error("give --vllm WHEEL, --sglang WHEEL and/or --lmcache WHEEL")
    failed = 0
    for engine in ("vllm", "sglang", "lmcache"):
        wheel = getattr(args, engine)
        if not wheel:
            continue
        r = subprocess.run([sys.executable, __file__, f"--{engine}", wheel, "--only", engine], capture_output=True, text=True)
        print(f"{engine}: {'OK' if r.returncode == 0 else 'FAILED'} ({wheel})")
        if r.stdout.strip():
            print(r.stdout.rstrip())
        if r.returncode:
            failed += 1
            print(r.stderr.strip()[-2000:])
    if args.vllm and args.sglang:
        failed += check_events(args.vllm, args.sglang)
    return 1 if failed else 0


def check_events(vllm: str, sglang: str) -> int:
    """``vllm_events`` against KV events made by vLLM's own BlockPool and SGLang's own RadixCache and recorder
    (tools/engine_events.py): every block each engine holds at the end is in the directory, and nothing else. Returns
    1 on a miss or a stale entry."""
    import os
    import tempfile

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import engine_events

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "cases.json")
        r = subprocess.run([sys.executable, engine_events.__file__, "--vllm", vllm, "--sglang", sglang, "--out", out],
                           capture_output=True, text=True)
        if r.returncode:
            print(f"events: FAILED to make the engines' events\n{r.stderr.strip()[-2000:]}")
            return 1
        import json

        with open(out) as f:
            rows = engine_events.score(json.load(f))
    bad = [x for x in rows if x["missing"] or x["stale"]]
    print(f"events: {'OK' if not bad else 'FAILED'} ({len(rows)} cases made by vLLM's BlockPool and SGLang's RadixCache + recorder)")
    for x in rows:
        print(f"  {x['case']:40s} engine holds {x['held']:3d}  missing {x['missing']}  stale {x['stale']}  verified {x['verified']:3d}"
              f"  restarts seen {x['restarts']}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
