"""Policy sets: what each system decides, on the same physics.

| preset | local eviction | publish | remote load | timeout | on failure |
|---|---|---|---|---|---|
| ``kvpolicy`` | LRU, locally and in the pool (reuse-distance lost to it under KV-overlap routing, issue #58) | dueling (all / threshold-2 / threshold-3 / structure-aware, each in a ghost pool of the pool's size; the one with the best E[benefit] decides), and on demand: a block a peer holds is pulled when another replica asks for it — through the pool (which keeps it), or straight from the peer when the pool's node is that pull's bottleneck (``pull_path="choose"``) | admission controller (p95 remote < margin × p50 recompute, or within the measured p95 TTFT; the plan that saves the most GPU seconds; path-aware, breaker; no caps on loads in flight or queued bytes, ``guard_rails=False``: the inequality prices the queue); compute while loading as the fallback | none needed: a late load turns into compute-while-loading at its p95 | recompute (partial use) |
| ``vllm-like`` | LRU, tail block first | every finished full block | always when present | none (transport only) | fail: the client retries |
| ``sglang-like`` | LRU over radix leaves | hit count ≥ 2 (write_through_selective) | prefetch if ≥ 256 tokens | 1 s + 0.25 s per 1024 tokens | recompute |
| ``lmcache-like`` | LRU | everything | always (``min_retrieve_tokens=0``) | none (transport only) | recompute |
| ``recompute-only`` | LRU | nothing | never | — | — |
| ``sglang-p2p-like`` | as ``sglang-like``, and pulls from peers as kvpolicy does | | | | |
| ``lmcache-p2p-like`` | as ``lmcache-like``, and pulls from peers (LMCache's P2P sharing) | | | | |
| ``llm-d-like`` | LRU, behind KV-overlap routing (``router``) | everything, and pulls straight from the peer that holds a block (``pull_path="direct"``: CPU to CPU, never through the pool, nothing written) | always | none (transport only) | recompute |
| ``oracle`` | Belady (offline) | blocks used again later, and pulls from peers | every block found: the bound on GPU seconds saved | none | fail: the client retries (a retry costs time, not GPU seconds) |

Baselines follow their documented behaviour, never their code. What each one
follows, in the engines' current releases:

* ``vllm-like`` — vLLM 0.33.0. Eviction: ``vllm/v1/core/kv_cache_utils.py``
  ``FreeKVCacheBlockQueue`` (the least recently used free block first; among
  blocks freed together, the tail of the chain first). Publishing and loading:
  the KV connector seam ``vllm/distributed/kv_transfer/kv_connector/v1/base.py``
  (``get_num_new_matched_tokens`` loads every matched token) as the offloading
  connector uses it (``.../v1/offloading_connector.py``: stores every finished
  full block). Failure: ``vllm/config/kv_transfer.py`` ``kv_load_failure_policy``
  — default ``"fail"`` (the request finishes with an error; the client resubmits).
* ``sglang-like`` — SGLang 0.5.23 HiCache. Publishing:
  ``sglang/srt/mem_cache/unified_radix_cache.py`` ``write_through_threshold`` =
  2 under ``--hicache-write-policy write_through_selective`` (the default policy
  of ``sglang/srt/mem_cache/hybrid_cache/hybrid_cache_controller.py``). Loading:
  the controller's ``prefetch_threshold`` = 256 tokens and its timeout
  ``prefetch_timeout_base`` = 1 s + ``prefetch_timeout_per_ki_token`` = 0.25 s;
  a prefetch that misses its deadline is dropped and the tokens recomputed.
* ``lmcache-like`` — LMCache 0.5.6, ``lmcache/v1/config.py``: stores every full
  chunk (``save_unfull_chunk`` = False: no partial chunk), retrieves every hit
  (``min_retrieve_tokens`` = 0), and recomputes what it could not retrieve.
* ``llm-d-like`` — llm-d's tiered prefix cache: vLLM's rules (offloading every
  full block, loading every hit), routed by its precise prefix-cache scorer (the
  KV-overlap router: ``router="kv-overlap"`` whatever the cluster's), with its P2P
  tier reading a block straight from the replica that holds it.

kvpolicy alone warms new replicas (the warmup planner), routes repeating
requests away from a replica that is still warming, moves writes off a storage
node whose breaker is open, computes while it loads, and pulls blocks that only
a peer's local cache holds through the pool (``pull_from_peers``: published on
demand, when a second replica asks; the engines' defaults have no such path —
LMCache's P2P sharing is off by default, vLLM's offloading connector and SGLang's
HiCache have none). Deployments that turn such a path on are the ``-p2p-like``
sets, which ``compare`` runs beside the defaults: kvpolicy is judged against them
too, and the oracle pulls as well, so that it stays a bound on every set.
A pull's path is a mechanism too: ``pull_path="relay"`` passes it through the
pool node it would be written to (kvpolicy's on-demand publication),
``"direct"`` sends it straight (llm-d), and ``"choose"`` decides per pull.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import attrs

from .._own import is_own, load_own
from ..errors import ConfigError
from ..eviction.replay import ALL_POLICIES, load_policy_factory
from ..publish import check_spec
from .config import ROUTERS

Load = Literal["admission", "always", "min-tokens", "never", "oracle"]
Timeout = Literal["none", "admission", "sglang"]
PULL_PATHS = ("relay", "direct", "choose")
Failure = Literal["recompute", "fail"]


@attrs.frozen
class PolicySet:
    name: str
    local_eviction: str = "lru"
    pool_eviction: str = "lru"
    #: a kvpolicy.publish.make_filter spec, or "oracle"
    publish: str = "all"
    #: a preset rule, or your own: ``PATH.py:CLASS`` / ``MODULE:CLASS`` naming a :class:`kvpolicy.protocols.LoadRule`
    #: (``blocks_to_load(match, ctx) -> int``), built once per run with no arguments
    load: Load | str = "always"
    min_load_tokens: int = 0
    timeout: Timeout = "none"
    failure: Failure = "recompute"
    warmup: bool = False
    uses_pool: bool = True
    #: prefill the leading blocks of a load range while the rest loads from the back (Cake)
    compute_while_loading: bool = False
    #: the admission controller hears the time of every prefill run in one piece (``observe_prefill``), so it learns the replicas' real
    #: compute when the profile it was given is off (``ClusterConfig.compute_factor``); False: it keeps the profile
    learn_compute: bool = True
    #: ``load="admission"``: "cluster" — one controller for every replica (its model pools all their measurements, its
    #: per-source caps and breakers are the cluster's, as a shared sidecar or directory service would keep them);
    #: "replica" — each replica its own, as an engine process that embeds one (each learns from its own loads and
    #: prefills only, so it leaves its priors later; its breakers steer only its own writes)
    controller_scope: str = "cluster"
    #: ``load="admission"``: how the plans that beat recompute are ranked (``AdmissionConfig.gpu_s_price``, seconds of
    #: TTFT per GPU second): ``inf`` the most GPU seconds saved; 0 the fastest (computing fronts while loading)
    gpu_s_price: float = math.inf
    #: the shared pool's write admission: "none" (every published block is written; the pool's eviction makes room) or
    #: "tinylfu" (a write into a full node must beat the block it would displace: kvpolicy.write_admission)
    write_admission: str = "none"
    #: ``load="admission"``: a published block held by a storage node whose breaker is open is written again elsewhere
    #: (its traffic shifts to the others); False: it stays where it is
    republish_unhealthy: bool = True
    #: ``load="admission"``: the controller's guard rails — at most ``AdmissionConfig.max_loads_per_replica`` loads in
    #: flight per replica and ``max_loads_per_source`` per storage node, none behind more than ``max_queue_bytes_per_source``
    #: (its defaults). False: no cap on either; the inequality, which prices the path's queue, and the breaker are the limits
    guard_rails: bool = True
    #: a request whose chain goes on past the pool's run in another replica's local cache (what the directory learns from
    #: the engines' KV events) may pull those blocks from that peer *through the pool*: one relay flow (the peer's egress,
    #: the node's ingress and egress, this replica's ingress), the node keeping what passes — a block published on demand,
    #: when a second replica asks for it. The load rule sees them as remote blocks after the pool's
    pull_from_peers: bool = False
    #: how a pull travels: "relay" through the pool node it would be written to (the node keeps what passes);
    #: "direct" straight from the peer's egress to this replica's ingress, nothing written (llm-d's P2P tier);
    #: "choose" per pull: direct when the relay's node is its path's bottleneck now, else relay (moot without pulls)
    pull_path: str = "relay"
    #: the router this set is deployed with (llm-d routes by KV overlap); None: the cluster's (``ClusterConfig.router``)
    router: str | None = None
    #: "cluster": each storage node holds ``ClusterConfig.pool_capacity_bytes_per_node`` and evicts by ``pool_eviction``;
    #: "unbounded": it keeps every block written to it (a pool that never fills: the oracle's, and a what-if of your own).
    #: A cluster with no pool (capacity under one block) has none either way
    pool_capacity: str = "cluster"

    def __attrs_post_init__(self) -> None:
        for field in ("local_eviction", "pool_eviction"):
            v = getattr(self, field)
            if is_own(v):  # an EvictionPolicy of your own, PATH.py:CLASS or MODULE:CLASS: it must load (built per replica and node)
                try:
                    load_policy_factory(v)
                except ConfigError as e:
                    raise ConfigError(field, e.problem) from None
            elif not isinstance(v, str) or v not in ALL_POLICIES:  # named here, not as "policy" when a replica is built
                raise ConfigError(field, f"unknown eviction policy {v!r}; known: {', '.join(ALL_POLICIES)}; or your own, PATH.py:CLASS")
        if self.publish != "oracle":
            try:
                check_spec(self.publish)
            except ConfigError as e:
                raise ConfigError("publish", f"{e.problem} (or 'oracle')") from None
        if is_own(self.load):
            load_own_rule(self.load)  # it must load, and build, before any run
        elif self.load not in ("admission", "always", "min-tokens", "never", "oracle"):
            raise ConfigError("load", f"unknown load rule {self.load!r}; known: admission, always, min-tokens, never, oracle; or your "
                                      "own, PATH.py:CLASS naming a kvpolicy.protocols.LoadRule")
        if self.timeout not in ("none", "admission", "sglang"):
            raise ConfigError("timeout", f"unknown timeout rule {self.timeout!r}")
        if self.failure not in ("recompute", "fail"):
            raise ConfigError("failure", f"must be 'recompute' or 'fail', got {self.failure!r}")
        if not isinstance(self.learn_compute, bool):
            raise ConfigError("learn_compute", f"must be True or False, got {self.learn_compute!r}")
        if self.controller_scope not in ("cluster", "replica"):
            raise ConfigError("controller_scope", f"must be 'cluster' or 'replica', got {self.controller_scope!r}")
        p = self.gpu_s_price
        if isinstance(p, bool) or not isinstance(p, (int, float)) or math.isnan(p) or p < 0:
            raise ConfigError("gpu_s_price", f"must be a number >= 0 (seconds of TTFT per GPU second), got {p!r}")
        if not isinstance(self.republish_unhealthy, bool):
            raise ConfigError("republish_unhealthy", f"must be True or False, got {self.republish_unhealthy!r}")
        if not isinstance(self.guard_rails, bool):
            raise ConfigError("guard_rails", f"must be True or False, got {self.guard_rails!r}")
        if not isinstance(self.pull_from_peers, bool):
            raise ConfigError("pull_from_peers", f"must be True or False, got {self.pull_from_peers!r}")
        if self.pull_from_peers and not self.uses_pool:
            raise ConfigError("pull_from_peers", "needs uses_pool: a pulled block passes through (and is kept by) a storage node")
        if self.pull_path not in PULL_PATHS:
            raise ConfigError("pull_path", f"must be one of {', '.join(PULL_PATHS)}, got {self.pull_path!r}")
        if self.router is not None and self.router not in ROUTERS:
            raise ConfigError("router", f"must be None (the cluster's) or one of {', '.join(ROUTERS)}, got {self.router!r}")
        if self.pool_capacity not in ("cluster", "unbounded"):
            raise ConfigError("pool_capacity", f"must be 'cluster' or 'unbounded', got {self.pool_capacity!r}")
        if self.write_admission not in ("none", "tinylfu"):
            raise ConfigError("write_admission", f"must be 'none' or 'tinylfu', got {self.write_admission!r}")
        if self.compute_while_loading and self.load != "admission":
            raise ConfigError("compute_while_loading", "needs load='admission' (the split comes from the controller's plan)")


PRESETS: dict[str, PolicySet] = {
    # every rule below: see the module docstring for the upstream file or option it follows
    "kvpolicy": PolicySet("kvpolicy", local_eviction="lru", pool_eviction="lru", publish="dueling",
                          load="admission", timeout="admission", failure="recompute", warmup=True, compute_while_loading=True,
                          pull_from_peers=True, pull_path="choose", guard_rails=False),
    "vllm-like": PolicySet("vllm-like", publish="all", load="always", timeout="none", failure="fail"),
    "sglang-like": PolicySet("sglang-like", publish="threshold-2", load="min-tokens", min_load_tokens=256, timeout="sglang", failure="recompute"),
    "lmcache-like": PolicySet("lmcache-like", publish="all", load="always", timeout="none", failure="recompute"),
    "recompute-only": PolicySet("recompute-only", publish="never", load="never", uses_pool=False),
    # the engines' own rules given the peer path kvpolicy has (issue #58: a comparison that gives a mechanism to one set
    # alone flatters it): LMCache's P2P sharing (publish all, load always, pull from the peer that holds a block) and
    # SGLang's HiCache rules with the same pulls
    "sglang-p2p-like": PolicySet("sglang-p2p-like", publish="threshold-2", load="min-tokens", min_load_tokens=256, timeout="sglang",
                                 failure="recompute", pull_from_peers=True),
    "lmcache-p2p-like": PolicySet("lmcache-p2p-like", publish="all", load="always", timeout="none", failure="recompute",
                                  pull_from_peers=True),
    # llm-d: vLLM's rules behind its precise prefix-cache scorer (KV-overlap routing), its tiered cache publishing every
    # block, and its P2P tier pulling straight from the holder's CPU, never through the shared tier
    "llm-d-like": PolicySet("llm-d-like", publish="all", load="always", timeout="none", failure="recompute",
                            pull_from_peers=True, pull_path="direct", router="kv-overlap"),
    # hindsight, with every mechanism any set has (pulls included), and a pool that keeps every block it publishes
    "oracle": PolicySet("oracle", local_eviction="belady", pool_eviction="belady", publish="oracle", load="oracle", failure="fail",
                        pull_from_peers=True, pool_capacity="unbounded"),
}
POLICY_SETS = tuple(PRESETS)


def load_own_rule(spec: str) -> Any:
    """A load rule of your own, built (no arguments) and checked to have ``blocks_to_load``."""
    cls = load_own(spec, "load", "a LoadRule class (blocks_to_load(match, ctx) -> int), built with no arguments")
    try:
        rule = cls()
    except Exception as e:  # the user's constructor: named, no traceback through kvpolicy
        raise ConfigError("load", f"{spec!r}: building it with no arguments raised {type(e).__name__}: {e}") from None
    if not callable(getattr(rule, "blocks_to_load", None)):
        raise ConfigError("load", f"{spec!r} has no blocks_to_load(match, ctx) method (kvpolicy.protocols.LoadRule)")
    return rule


def policy_set(name: Any) -> PolicySet:
    """A preset by name; a :class:`PolicySet` as given; or one of your own, ``PATH.py:NAME`` / ``MODULE:NAME`` naming a
    ``PolicySet`` (or a function returning one) — e.g. ``attrs.evolve(PRESETS["kvpolicy"], name="mine", publish="threshold-2")``."""
    if isinstance(name, PolicySet):
        return name
    if is_own(name):
        obj = load_own(name, "--policies", "a PolicySet (or a function returning one)", want_callable=False)
        if callable(obj) and not isinstance(obj, PolicySet):
            try:
                obj = obj()
            except TypeError as e:
                raise ConfigError("--policies", f"{name!r}: calling it with no arguments raised TypeError: {e}") from None
        if not isinstance(obj, PolicySet):
            raise ConfigError("--policies", f"{name!r} is a {type(obj).__name__}, not a kvpolicy.sim.PolicySet")
        return obj
    ps = PRESETS.get(name) if isinstance(name, str) else None
    if ps is None:
        raise ConfigError("--policies", f"unknown policy set {name!r}; known: {', '.join(POLICY_SETS)}; or your own: PATH.py:NAME naming a PolicySet")
    return ps


def recompute_twin(ps: PolicySet) -> PolicySet:
    """The same local eviction with no pool at all (for the empty-pool equivalence)."""
    return attrs.evolve(ps, name=f"{ps.name}/recompute", publish="never", load="never", uses_pool=False, warmup=False,
                        compute_while_loading=False, pull_from_peers=False, pull_path="relay")
