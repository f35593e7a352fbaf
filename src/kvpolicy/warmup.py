"""Warmup planner: warm new replicas from the shared cache without a stampede.

Autoscaling with a shared cache can become ten new replicas pulling the same hot
blocks at once. The planner turns *measured* hot prefixes into a schedule:

* only prefixes with ``access_count ≥ min_access_count`` are planned — never
  random recent ones; the rest are reported as cold;
* each replica loads its prefixes in order of **recompute seconds saved per
  byte** (``access_count × recompute_s / bytes``); bytes a replica already holds
  from an earlier prefix of the same chain are not loaded twice;
* loads are list-scheduled on slots: at most ``max_loads_per_replica`` at once
  on a replica and ``max_loads_pool`` at once on the pool; each load gets an
  equal share of the useful bandwidth left over by current traffic, so caps hold
  at every instant and no more than ``available × window`` bytes move;
* a load that would end after the window goes to **prefill** (lower-value
  prefixes move there first when the link cannot carry the warmup);
* the bandwidth needed to warm everything, ``N × W / Δt``, is set against what
  is available, with a verdict: warm all at once / warm the top prefixes and
  prefill the rest / stagger the replicas in waves / prefill;
* **routing hints**: requests for a prefix go to warm replicas until the new
  replica's load of it ends (or forever, if it is left to prefill);
* **readiness**: a replica is ready when it holds ≥ ``readiness_share`` of the
  hot bytes of the target profile — never "the process started".

Plans are deterministic: no randomness; ties break by prefix id and replica.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import attrs

from ._validate import check_non_negative_int, check_positive_int
from ._validate import non_negative_int as _count
from ._validate import non_negative_number as _nonneg
from ._validate import positive_int as _pos_int
from ._validate import positive_number as _pos
from .errors import ConfigError


def _block_tuple(v: Any) -> tuple[Hashable, ...]:
    if isinstance(v, (str, bytes, bytearray)) or not hasattr(v, "__iter__"):
        raise ConfigError("blocks", f"must be a sequence of block ids, got {type(v).__name__}")
    return tuple(v)


@attrs.frozen
class HotPrefix:
    prefix: Hashable
    size_bytes: int = attrs.field(validator=_pos_int)
    access_count: int = attrs.field(validator=_count)
    recompute_s: float = attrs.field(validator=_nonneg)
    #: block ids of the chain (optional): overlapping prefixes are not loaded twice
    blocks: tuple[Hashable, ...] = attrs.field(default=(), converter=_block_tuple)

    @property
    def value_per_byte(self) -> float:
        return self.access_count * self.recompute_s / self.size_bytes


@attrs.frozen
class WarmupConfig:
    replicas: int = attrs.field(validator=_pos)
    window_s: float = attrs.field(validator=_pos)
    bandwidth_bytes_per_s: float = attrs.field(validator=_pos)
    current_load_bytes_per_s: float = attrs.field(default=0.0, validator=_nonneg)
    max_loads_per_replica: int = attrs.field(default=2, validator=_pos)
    max_loads_pool: int = attrs.field(default=8, validator=_pos)
    min_access_count: int = attrs.field(default=2, validator=_count)
    readiness_share: float = 0.9

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.replicas, int) or not isinstance(self.max_loads_per_replica, int) or not isinstance(self.max_loads_pool, int):
            raise ConfigError("replicas", "replicas and load caps are integers")
        r = self.readiness_share
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 < r <= 1:
            raise ConfigError("readiness_share", f"must be in (0, 1], got {self.readiness_share}")

    @property
    def available_bytes_per_s(self) -> float:
        return max(self.bandwidth_bytes_per_s - self.current_load_bytes_per_s, 0.0)


@attrs.frozen
class Load:
    replica: int
    prefix: Hashable
    start_s: float
    end_s: float
    bytes: int


@attrs.frozen
class WarmupPlan:
    schedule: tuple[Load, ...]
    prefill: dict[int, tuple[Hashable, ...]]
    cold: tuple[Hashable, ...]
    hot_bytes: int
    required_bytes_per_s: float
    available_bytes_per_s: float
    verdict: str
    ready_at_s: dict[int, float | None]
    routing_hints: tuple[dict[str, Any], ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "required_gbps": self.required_bytes_per_s * 8 / 1e9,
            "available_gbps": self.available_bytes_per_s * 8 / 1e9,
            "hot_bytes": self.hot_bytes,
            "verdict": self.verdict,
            "schedule": [{"replica": x.replica, "prefix": _jsonable(x.prefix), "start_s": x.start_s, "end_s": x.end_s, "bytes": x.bytes} for x in self.schedule],
            "prefill": {str(r): [_jsonable(p) for p in v] for r, v in self.prefill.items()},
            "cold": [_jsonable(p) for p in self.cold],
            "ready_at_s": {str(r): v for r, v in self.ready_at_s.items()},
            "routing_hints": [{**h, "prefix": _jsonable(h["prefix"])} for h in self.routing_hints],
        }


def _jsonable(x: Any) -> Any:
    return x if isinstance(x, (int, str, float)) else str(x)


def plan_warmup(prefixes: Sequence[HotPrefix], config: WarmupConfig) -> WarmupPlan:
    cfg = config
    if not hasattr(prefixes, "__iter__"):  # a string iterates, and its first item is then named below
        raise ConfigError("prefixes", f"must be a sequence of HotPrefix, got {type(prefixes).__name__}")
    prefixes = list(prefixes)  # read more than once below: a generator would be empty the second time
    seen: set = set()
    for i, p in enumerate(prefixes):
        if not isinstance(p, HotPrefix):
            raise ConfigError("prefixes", f"item {i} is a {type(p).__name__}, not a HotPrefix")
        if p.prefix in seen:  # it would be scheduled (and its bytes counted) twice
            raise ConfigError("prefixes", f"prefix {p.prefix!r} is listed twice (items of one plan name distinct prefixes)")
        seen.add(p.prefix)
    if not isinstance(cfg, WarmupConfig):
        raise ConfigError("config", f"must be a WarmupConfig, got {type(cfg).__name__}")
    hot = [p for p in prefixes if p.access_count >= cfg.min_access_count]
    cold = tuple(p.prefix for p in prefixes if p.access_count < cfg.min_access_count)
    hot.sort(key=lambda p: (-p.value_per_byte, str(p.prefix)))
    # hot bytes of the target profile: the union of blocks (or sizes, without block lists)
    block_bytes: dict[Any, float] = {}
    hot_bytes = 0
    for p in hot:
        if p.blocks:
            per = p.size_bytes / len(p.blocks)
            for b in p.blocks:
                block_bytes.setdefault(b, per)
        else:
            hot_bytes += p.size_bytes
    hot_bytes += int(round(sum(block_bytes.values())))
    avail = cfg.available_bytes_per_s
    required = cfg.replicas * hot_bytes / cfg.window_s
    concurrency = min(cfg.max_loads_pool, cfg.replicas * cfg.max_loads_per_replica)
    per_load = avail / concurrency if avail > 0 else 0.0
    pool_slots = [0.0] * cfg.max_loads_pool
    rep_slots = [[0.0] * cfg.max_loads_per_replica for _ in range(cfg.replicas)]
    held: list[set] = [set() for _ in range(cfg.replicas)]
    schedule: list[Load] = []
    prefill: dict[int, list[Hashable]] = {r: [] for r in range(cfg.replicas)}
    loaded_bytes = [0] * cfg.replicas
    ready: dict[int, float | None] = {r: None for r in range(cfg.replicas)}
    for rank, p in enumerate(hot):
        for r in range(cfg.replicas):
            if p.blocks:
                new = [b for b in p.blocks if b not in held[r]]
                nbytes = int(round(len(new) * p.size_bytes / len(p.blocks)))
            else:
                new, nbytes = [], p.size_bytes
            if nbytes == 0:
                continue
            if per_load <= 0:
                prefill[r].append(p.prefix)
                continue
            start = max(min(rep_slots[r]), min(pool_slots))
            end = start + nbytes / per_load
            if end > cfg.window_s:
                prefill[r].append(p.prefix)
                continue
            i = rep_slots[r].index(min(rep_slots[r]))
            j = pool_slots.index(min(pool_slots))
            rep_slots[r][i] = end
            pool_slots[j] = end
            held[r].update(new)
            schedule.append(Load(r, p.prefix, start, end, nbytes))
    # readiness: when each replica holds the readiness share of the hot bytes
    for r in range(cfg.replicas):
        got = 0
        for load in sorted((x for x in schedule if x.replica == r), key=lambda x: x.end_s):
            got += load.bytes
            if hot_bytes and got >= cfg.readiness_share * hot_bytes:
                ready[r] = load.end_s
                break
        loaded_bytes[r] = sum(x.bytes for x in schedule if x.replica == r)
    hints = []
    for x in sorted(schedule, key=lambda x: (x.replica, x.end_s)):
        hints.append({"prefix": x.prefix, "replica": x.replica, "route_to_warm_until_s": x.end_s})
    for r, items in prefill.items():
        for pfx in items:
            hints.append({"prefix": pfx, "replica": r, "route_to_warm_until_s": None})
    waves = int(avail * cfg.window_s // hot_bytes) if hot_bytes else cfg.replicas
    if not hot:
        verdict = "nothing to warm: no prefix reaches the hot threshold"
    elif required <= avail and not any(prefill.values()):
        verdict = f"fits: warm all {cfg.replicas} replicas at once ({required * 8 / 1e9:.2f} of {avail * 8 / 1e9:.2f} Gbit/s)"
    elif waves >= 1:
        verdict = (f"the link cannot carry N x W / dt = {required * 8 / 1e9:.2f} Gbit/s (available {avail * 8 / 1e9:.2f}): warm the top prefixes now and "
                   f"prefill the rest, or stagger: about {waves} replica(s) can be fully warmed per {cfg.window_s:g} s window")
    else:
        verdict = (f"prefill: the link cannot warm even one replica's hot set ({hot_bytes / 2**30:.1f} GiB) within {cfg.window_s:g} s "
                   f"at {avail * 8 / 1e9:.2f} Gbit/s; {len(schedule)} load(s) of the most valuable prefixes still fit")
    return WarmupPlan(
        schedule=tuple(sorted(schedule, key=lambda x: (x.start_s, x.replica, str(x.prefix)))),
        prefill={r: tuple(v) for r, v in prefill.items()},
        cold=cold, hot_bytes=hot_bytes, required_bytes_per_s=required, available_bytes_per_s=avail,
        verdict=verdict, ready_at_s=ready, routing_hints=tuple(hints),
    )


def hot_prefixes_from_trace(trace: Any, *, bytes_per_token: int, recompute_s: Any, min_access_count: int = 2, max_prefixes: int = 64) -> list[HotPrefix]:
    """Hot prefixes measured from a trace: each request's leading run of blocks used by
    ≥ ``min_access_count`` distinct requests, keyed by the run's last block."""
    import numpy as np

    from .traces.model import check_trace

    check_trace(trace)  # a bincount by id: sparse ids would ask for an array as long as the largest
    check_positive_int("bytes_per_token", bytes_per_token)  # named here, not as a HotPrefix's size_bytes
    check_non_negative_int("min_access_count", min_access_count)
    check_positive_int("max_prefixes", max_prefixes)
    counts = np.bincount(trace.block_ids, minlength=trace.num_block_ids) if trace.block_ids.size else np.zeros(0, np.int64)
    B = trace.block_size_tokens
    found: dict[int, tuple[int, ...]] = {}
    for i in range(len(trace)):
        blocks = trace.blocks(i)
        n = 0
        while n < blocks.size and counts[blocks[n]] >= min_access_count:
            n += 1
        if n:
            found.setdefault(int(blocks[n - 1]), tuple(int(b) for b in blocks[:n]))
    out = [HotPrefix(prefix=f"block-{end}", size_bytes=len(chain) * B * bytes_per_token, access_count=int(counts[end]),
                     recompute_s=float(recompute_s(len(chain) * B)), blocks=chain) for end, chain in found.items()]
    out.sort(key=lambda p: (-p.value_per_byte, str(p.prefix)))
    return out[:max_prefixes]
