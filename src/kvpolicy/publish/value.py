"""The value rules: ``reuse-aware`` (a Count-Min sketch of decayed sightings) and ``structure-aware`` (kvpolicy's),
which publish the leading run whose expected re-read value beats its write cost, and :class:`WriteBudget`."""

from __future__ import annotations

import math
from array import array
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import numpy as np

from .._mix import _M64, fmix64, key_bits, splitmix64_next
from .._validate import check_non_negative_int, check_non_negative_number, check_positive_int, check_positive_number, check_probability, check_real
from ..errors import ConfigError
from .rules import PublishRequest, _Dedup, _check, _timed


class CountMinSketch:
    """Decayed counts in fixed memory; estimates never undercount."""

    def __init__(self, width: int = 1 << 18, depth: int = 4, half_life_s: float = 600.0, seed: int = 0) -> None:
        check_positive_int("width", width)
        check_positive_int("depth", depth)
        if width > 1 << 28 or depth > 64:  # depth x width doubles are allocated here, and each add touches every row
            raise ConfigError("width" if width > 1 << 28 else "depth", f"width at most 2**28 and depth at most 64, got {width!r} x {depth!r}")
        check_positive_number("half_life_s", half_life_s)
        check_non_negative_int("seed", seed)
        self.width, self.depth = width, depth
        self.lam = math.log(2) / half_life_s
        # rows as array('d'): scalar reads and writes are several times cheaper than numpy indexing;
        # ``table`` is a numpy view of the same memory for bulk rescaling
        self._rows_data = [array("d", bytes(8 * width)) for _ in range(depth)]
        self._seed = (seed * 0x9E3779B97F4A7C15) & _M64
        self._t0 = 0.0

    def _hashes(self, key: Hashable) -> tuple[int, int]:
        """Two 64-bit hashes of the key (splitmix64 on its 64 bits — an int as itself, bytes and str by BLAKE2b, stable
        across processes — and MurmurHash3's finaliser on that); row i reads
        column (h1 + i·h2) mod width (Kirsch–Mitzenmacher: as independent as separate hashes, for the price of two).
        Rows that share a column for most keys are one row: the sketch then overcounts as a single row does."""
        h1 = splitmix64_next(key_bits(key) ^ self._seed)[1]
        return h1, fmix64(h1) | 1

    def _rows(self, key: Hashable) -> list[int]:
        h1, h2 = self._hashes(key)
        w = self.width
        return [(h1 + i * h2) % w for i in range(self.depth)]

    def _weight(self, t_s: float) -> float:
        x = self.lam * (t_s - self._t0)
        if x > 50:  # rescale to keep weights finite
            f = math.exp(-x)
            for r in self._rows_data:
                v = np.frombuffer(r, dtype=np.float64)
                v *= f
            self._t0 = t_s
            x = 0.0
        return math.exp(x)

    def add(self, key: Hashable, t_s: float, amount: float = 1.0) -> None:
        check_real("t_s", t_s, negative_ok=True)  # one NaN would poison its columns for good
        check_real("amount", amount)
        w = amount * self._weight(t_s)
        h, h2 = self._hashes(key)
        width = self.width
        for row in self._rows_data:
            row[h % width] += w
            h += h2

    def estimate(self, key: Hashable, t_s: float) -> float:
        check_real("t_s", t_s, negative_ok=True)
        w = self._weight(t_s)
        h, h2 = self._hashes(key)
        width = self.width
        m = math.inf
        for row in self._rows_data:
            v = row[h % width]
            if v < m:
                m = v
            h += h2
        return m / w


class ReuseAwarePublish:
    name = "reuse-aware"

    def __init__(
        self,
        *,
        block_bytes: int,
        recompute_s: Callable[[int], float],
        write_bytes_per_s: float = 12.5e9,
        index_s: float = 2e-4,
        eviction_s: float = 2e-4,
        lifetime_s: float = 600.0,
        half_life_s: float = 600.0,
        cross_replica_share: float = 0.875,
        buckets: int = 4,
        origin_capacity: int = 200_000,
        sketch: CountMinSketch | None = None,
    ) -> None:
        check_positive_int("block_bytes", block_bytes)
        if not callable(recompute_s):
            raise ConfigError("recompute_s", f"must be a callable tokens -> seconds, got {recompute_s!r}")
        for name, v in (("write_bytes_per_s", write_bytes_per_s), ("lifetime_s", lifetime_s), ("half_life_s", half_life_s)):
            check_positive_number(name, v)
        check_non_negative_number("index_s", index_s)
        check_non_negative_number("eviction_s", eviction_s)
        check_probability("cross_replica_share", cross_replica_share)
        check_positive_int("buckets", buckets)
        if buckets > 64:
            raise ConfigError("buckets", f"must be at most 64 (buckets of a request's reused share), got {buckets!r}")
        check_positive_int("origin_capacity", origin_capacity)
        if sketch is not None and not isinstance(sketch, CountMinSketch):
            raise ConfigError("sketch", f"must be a CountMinSketch (or None: a default one), got {sketch!r}")
        self.block_bytes = block_bytes
        self.recompute_s = recompute_s
        self.write_s = block_bytes / write_bytes_per_s
        self.fixed_cost_s = index_s + eviction_s
        self.cost_s = self.write_s + self.fixed_cost_s  # the cost when the path's utilisation is unknown
        self.lifetime_s = lifetime_s
        self.half_life_s = half_life_s
        self.cross = cross_replica_share
        self.sketch = sketch or CountMinSketch(half_life_s=half_life_s)
        self._dedup = _Dedup()
        self.created = [0.0] * buckets
        self.seen_again = [0.0] * buckets
        self._origin: OrderedDict[Hashable, list[Any]] = OrderedDict()  # key -> [bucket, first seen s, seen again]
        self._origin_capacity = origin_capacity

    def _bucket(self, request: PublishRequest) -> int:
        n = len(self.created)
        return min(int(n * request.reused_blocks / max(request.full_blocks, 1)), n - 1)

    def first_sighting_probability(self, request: PublishRequest) -> float:
        b = self._bucket(request)
        return (self.seen_again[b] + 1) / (self.created[b] + 2)

    def observe(self, request: PublishRequest, keys: Sequence[Hashable]) -> None:
        t = _timed(request, keys, "reuse-aware")
        b = self._bucket(request)
        origin = self._origin
        for key in self._dedup.new_keys(request.request_id, keys):
            if self.sketch.estimate(key, t) < 0.5:  # first sighting: remember which kind of request made it, and when
                old = origin.pop(key, None)
                if old is not None:  # the sketch forgot an earlier sighting: that window is over, counted before this one opens
                    self._mature(*old)
                origin[key] = [b, t, 0]  # at the back: the windows stay in the order they opened, as maturing reads them
                if len(origin) > self._origin_capacity:
                    self._mature(*origin.popitem(last=False)[1])
            else:
                o = origin.get(key)
                if o is not None:
                    o[2] = 1  # seen again within its window: counted when the window closes
            self.sketch.add(key, t)
        # a block's outcome is known only once its window has passed: counting it earlier would read
        # "not seen again yet" as "never seen again" (a censoring bias that starts every trace at p ≈ 0)
        while origin:
            first = next(iter(origin.values()))
            if t - first[1] < self.lifetime_s:
                break
            self._mature(*origin.popitem(last=False)[1])

    def _mature(self, bucket: int, _t: float, seen: int) -> None:
        self.created[bucket] += 1
        self.seen_again[bucket] += seen

    def values(self, request: PublishRequest, keys: Sequence[Hashable]) -> list[float]:
        """Expected value − cost of publishing each leading block (seconds)."""
        t = _timed(request, keys, "reuse-aware")
        p_first = self.first_sighting_probability(request)
        cost = self.write_cost_s(request)
        out = []
        for depth, key in enumerate(keys):
            c = self.sketch.estimate(key, t)
            p = 1.0 - math.exp(-max(c - 1.0, 0.0) / self.half_life_s * self.lifetime_s) if c > 1.5 else p_first
            out.append(p * self.cross * self.recompute_s(depth) - cost)
        return out

    def write_cost_s(self, request: PublishRequest) -> float:
        """Seconds one block's write costs: the delay it imposes on its path, plus index and eviction."""
        rho = request.write_path_utilisation
        if rho is None:
            return self.cost_s
        rho = min(rho, 0.99)
        return self.write_s * rho / (1.0 - rho) + self.fixed_cost_s

    def publishable(self, request: PublishRequest, keys: Sequence[Hashable]) -> int:
        """The leading run with the largest total value: publishing is prefix-closed, so a deep block
        worth publishing carries the cheap shallow blocks it needs (a run is cut only where what
        follows is worth less, in total, than it costs)."""
        _check(request, keys, timed="reuse-aware")
        return best_prefix(self.values(request, keys))


class StructureAwarePublish:
    """Publish at first sighting when the request's structure says the block will be read again; count the rest.

    The byte-level decision the pool's owner cares about: a written block is worth it when another replica is more
    likely than not to read it (a wasted write weighs as much as a missed re-read: ``write_weight`` = ½). Per block::

        P(reuse)  = 1 − exp(−(ĉ − 1) / half_life_s × lifetime_s)   seen before (ĉ: decayed distinct requests, exact)
                  = P(a block of its class is seen again)         first sighting, learned online
        value     = P(reuse) × cross_replica_share − write_weight
        publish the leading run n maximising Σ_{j<n} value_j     (prefix-closed, as every filter here)

    **Classes** are what the request's own shape says about a block it creates: how much of the prompt was reused
    (quarters — a session's later turn reuses most of it, a fresh request with new documents little) × how deep into
    the request's new part the block lies (the first new block, the next 3, the next 12, the rest — the start of a
    new part is where a shared document or a branching conversation begins). A session still in progress re-reads
    its whole immutable history next turn, so the blocks of a mid-session request are published at first sighting
    wherever continuation has been likely; a system prompt or document seen once before is published at its second
    sighting (ĉ ≥ 2), never waiting for the k sightings of threshold-k; a unique tail of a one-shot request waits.

    **Learning** (no constant fitted to a trace): per class, ``reused`` counts created blocks seen again by another
    request within the watch window — counted the moment it happens — and ``dead`` those whose window closed
    without a second sighting; P = (reused + 1) / (reused + dead + 2). A block still inside its window and not yet
    seen again is not counted either way (not yet seen is not never). The window is learned: 3 × the mean delay to
    a second sighting (covering 95 % of an exponential delay; at most ``lifetime_s``) — a window as long as the pool
    lifetime would leave the first ``lifetime_s`` of a trace with positives and no negatives at all. Until evidence arrives P is ½, below the bar with any
    cross-replica share under 1: nothing is published on first sighting before the trace has shown it pays.

    Counts are exact, per key, for the ``capacity_keys`` most recently seen keys (a key older than that is new
    again); a Count-Min sketch overcounts by up to e/width × the decayed total of sightings — whole requests on a
    busy pool (RAG at 4 requests/s: ≈ 3 with the reuse-aware filter's 2^18 columns) — and makes unique blocks
    look shared.
    """

    name = "structure-aware"
    REUSE_BUCKETS = 4
    DEPTH_EDGES = (1, 4, 16)  # new-part index < 1, < 4, < 16, the rest

    def __init__(self, *, cross_replica_share: float = 0.875, write_weight: float = 0.5, lifetime_s: float = 600.0,
                 half_life_s: float = 600.0, capacity_keys: int = 500_000) -> None:
        check_probability("cross_replica_share", cross_replica_share)
        check_probability("write_weight", write_weight)
        if not 0 < write_weight < 1:
            raise ConfigError("write_weight", f"must be in (0, 1), got {write_weight!r}")
        check_positive_number("lifetime_s", lifetime_s)
        check_positive_number("half_life_s", half_life_s)
        check_positive_int("capacity_keys", capacity_keys)
        self.cross = cross_replica_share
        self.write_weight = write_weight
        self.lifetime_s = lifetime_s
        self.half_life_s = half_life_s
        self._lam = math.log(2) / half_life_s
        # key -> decayed count of distinct requests + 1j × last seen s, least recently seen first: exact, unlike a
        # Count-Min sketch whose overcount (e/width x the decayed total of sightings) reaches whole requests on a busy
        # pool and makes unique blocks look shared. A complex number holds the two floats exactly in one object that
        # the garbage collector never tracks (a tuple is tracked until a collection passes over it, and a long run
        # keeps capacity_keys of them: the pass at the end of a simulation spent a third of its time on them)
        self._seen: OrderedDict[Hashable, complex] = OrderedDict()
        n = self.REUSE_BUCKETS * (len(self.DEPTH_EDGES) + 1)
        self.reused = [0] * n
        self.dead = [0] * n
        self._dedup = _Dedup()
        # new blocks awaiting a verdict (key -> [class, first seen s]), oldest first: reused when seen again within the
        # window, dead when it closes; and new blocks watched for the delay to their second sighting (key -> first
        # seen s) for lifetime_s whatever the verdict — the window is learned from these, so it must not censor them
        self._origin: OrderedDict[Hashable, tuple[int, float]] = OrderedDict()
        self._watch: OrderedDict[Hashable, float] = OrderedDict()
        self._capacity = capacity_keys
        self._forgot = False  # has the count dropped a key (capacity)? Until it has, no key outside it is in a window
        self._mean_delay_s = 0.0
        self._n_delay = 0
        #: _depth(i) for every index below the last edge: the edges it has reached
        self._depth_table = tuple(sum(i >= e for e in self.DEPTH_EDGES) for i in range(self.DEPTH_EDGES[-1]))

    @property
    def window_s(self) -> float:
        """How long a new block is watched for a second sighting: 3 × the mean delay to the second sightings seen so
        far (95 % of an exponential delay), at most ``lifetime_s``; ``lifetime_s`` until one is seen."""
        return min(self.lifetime_s, 3.0 * self._mean_delay_s) if self._n_delay else self.lifetime_s

    def block_class(self, request: PublishRequest, new_index: int) -> int:
        """The class of the ``new_index``-th block after the request's reused prefix."""
        return self._reuse_class(request) + self._depth(new_index)

    def _reuse_class(self, request: PublishRequest) -> int:
        """The first class of the request's reuse quarter (its blocks' classes follow by depth)."""
        q = min(int(self.REUSE_BUCKETS * request.reused_blocks / max(request.full_blocks, 1)), self.REUSE_BUCKETS - 1)
        return q * (len(self.DEPTH_EDGES) + 1)

    def _depth(self, new_index: int) -> int:
        """How many of ``DEPTH_EDGES`` the new-part index has reached (0 for the first new block, … len(edges) for the
        rest): a table lookup below the last edge."""
        table = self._depth_table
        return table[new_index] if new_index < len(table) else len(self.DEPTH_EDGES)

    def first_sighting_probability(self, cls: int) -> float:
        return (self.reused[cls] + 1) / (self.reused[cls] + self.dead[cls] + 2)

    def observe(self, request: PublishRequest, keys: Sequence[Hashable]) -> None:
        t = _timed(request, keys, "structure-aware")
        origin = self._origin
        if request.request_id not in self._dedup._seen:
            # windows close once per request, before its blocks are counted: an engine that observes a request
            # block by block must see the same closings as one that observes it whole
            # (the closed ones counted in one walk from the oldest, then popped: no iterator per closing)
            window = self.window_s
            dead = self.dead
            n = 0
            for cls, opened_s in origin.values():
                if not t - opened_s >= window:
                    break
                dead[cls] += 1
                n += 1
            for _ in range(n):
                origin.popitem(last=False)
            watch, lifetime_s = self._watch, self.lifetime_s
            n = 0
            for opened_s in watch.values():
                if not t - opened_s >= lifetime_s:
                    break
                n += 1
            for _ in range(n):
                watch.popitem(last=False)
        new = self._dedup.new_keys(request.request_id, keys)
        if not new:
            return
        # every key new (the common first look at a request): no membership test needed
        fresh = None if len(new) == len(keys) else set(new)
        seen = self._seen
        watch = self._watch
        reused = self.reused
        capacity = self._capacity
        neg_lam = -self._lam
        exp = math.exp
        base = self._reuse_class(request)
        reused_blocks = request.reused_blocks
        depths = self._depth_table
        n_depths, deepest = len(depths), len(self.DEPTH_EDGES)
        # what every first sighting of this request stores (immutable, so shared): its count, and its origin per class
        first = complex(1.0, t)
        origins = [(base + d, t) for d in range(deepest + 1)]
        for j, key in enumerate(keys):
            if fresh is not None and key not in fresh:
                continue
            rec = seen.get(key)
            if rec is None:
                seen[key] = first
                if len(seen) > capacity:
                    seen.popitem(last=False)
                    self._forgot = True
                # a key the counts never held is in no window: only one they forgot (capacity) can be
                o = origin.pop(key, None) if self._forgot else None
                if o is not None:  # the counts forgot it inside its open window: this is its second sighting
                    reused[o[0]] += 1
                    watch.pop(key, None)
                    continue
                # first sighting: remember its class and when (_depth, inline)
                n = j - reused_blocks if j > reused_blocks else 0
                origin[key] = origins[depths[n] if n < n_depths else deepest]
                watch[key] = t
                if len(origin) > capacity:
                    self.dead[origin.popitem(last=False)[1][0]] += 1
                if len(watch) > capacity:
                    watch.popitem(last=False)
            else:
                dt = t - rec.imag
                seen[key] = complex(rec.real * exp(neg_lam * (dt if dt > 0.0 else 0.0)) + 1.0, t)
                seen.move_to_end(key)
                if rec.real != 1.0:
                    # seen twice before: its second sighting took it out of the window and the watch, and only a first
                    # sighting puts a key there — with a count of exactly 1.0 (a count of 1.0 after a long silence, the
                    # decayed part lost to rounding, looks them up for nothing)
                    continue
                t_first = watch.pop(key, None)
                if t_first is not None:  # its second sighting: the delay teaches the window
                    self._n_delay += 1
                    self._mean_delay_s += (t - t_first - self._mean_delay_s) / self._n_delay
                o = origin.pop(key, None)
                if o is not None:
                    reused[o[0]] += 1  # seen again within its window: counts at once, it cannot be taken back

    def values(self, request: PublishRequest, keys: Sequence[Hashable]) -> list[float]:
        """Per leading block: P(another replica reads it) − write_weight (observe the request first)."""
        t = _timed(request, keys, "structure-aware")
        out: list[float] = []
        append = out.append
        seen = self._seen
        neg_lam = -self._lam
        exp = math.exp
        half_life_s, lifetime_s, cross, write_weight = self.half_life_s, self.lifetime_s, self.cross, self.write_weight
        base = self._reuse_class(request)
        # first_sighting_probability of each depth class of this request (the counts do not move while it is valued)
        first = [self.first_sighting_probability(base + d) for d in range(len(self.DEPTH_EDGES) + 1)]
        depths = self._depth_table
        n_depths, p_deepest = len(depths), first[-1]
        reused_blocks = request.reused_blocks
        for j, key in enumerate(keys):
            rec = seen.get(key)
            if rec is not None:
                dt = t - rec.imag
                c = rec.real * exp(neg_lam * dt) if dt > 0.0 else rec.real  # exp(-0) is 1: seen at this instant, as after observe
            else:
                c = 0.0
            if c > 1.5:
                p = 1.0 - exp(-(c - 1.0) / half_life_s * lifetime_s)
            else:
                n = j - reused_blocks if j > reused_blocks else 0
                p = first[depths[n]] if n < n_depths else p_deepest
            append(p * cross - write_weight)
        return out

    def publishable(self, request: PublishRequest, keys: Sequence[Hashable]) -> int:
        _check(request, keys, timed="structure-aware")
        return best_prefix(self.values(request, keys))


def best_prefix(values: Sequence[float]) -> int:
    """n maximising sum(values[:n]) (0 when no leading run is worth its cost; the shortest on ties)."""
    best_n, best, acc = 0, 0.0, 0.0
    for j, v in enumerate(values):
        acc += v
        if acc > best + 1e-15:
            best_n, best = j + 1, acc
    return best_n


class WriteBudget:
    """Token bucket on published bytes; sheds the lowest-value blocks first."""

    def __init__(self, inner: Any, *, bytes_per_s: float, burst_bytes: float, block_bytes: int, value_floor_s: float = 0.0) -> None:
        check_positive_number("bytes_per_s", bytes_per_s)
        check_positive_number("burst_bytes", burst_bytes)
        check_positive_int("block_bytes", block_bytes)
        check_non_negative_number("value_floor_s", value_floor_s)
        self.inner = inner
        self.rate = bytes_per_s
        self.burst = burst_bytes
        self.block_bytes = block_bytes
        self.value_floor_s = value_floor_s
        self.tokens = burst_bytes
        self._t: float | None = None
        self.name = f"{getattr(inner, 'name', 'filter')} + budget"
        self.shed_blocks = 0

    def observe(self, request: PublishRequest, keys: Sequence[Hashable]) -> None:
        self.inner.observe(request, keys)

    def publishable(self, request: PublishRequest, keys: Sequence[Hashable]) -> int:
        t = _timed(request, keys, "WriteBudget")  # its bucket refills with time: at one time it never would
        n = self.inner.publishable(request, keys)
        if self._t is not None:
            self.tokens = min(self.burst, self.tokens + (t - self._t) * self.rate)
        self._t = t
        values = _find_values(self.inner, request, keys)
        k = 0
        while k < n:
            fill = self.tokens / self.burst
            if self.tokens < self.block_bytes or (values is not None and values[k] < self.value_floor_s * (1 - fill)):
                break
            self.tokens -= self.block_bytes
            k += 1
        self.shed_blocks += n - k
        return k


def _find_values(f: Any, request: PublishRequest, keys: Sequence[Hashable]) -> list[float] | None:
    if isinstance(f, ReuseAwarePublish):
        return f.values(request, keys)
    for inner in getattr(f, "filters", ()):
        v = _find_values(inner, request, keys)
        if v is not None:
            return v
    return None
