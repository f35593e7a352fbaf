"""Publish filters: put in the shared pool only what another request will re-read.

Publishing every finished block is the most harmful setting: user tails are
mostly unique, so the pool pays for writes, indexing and eviction with no
re-read. A filter answers one question per finished (or prefilled) request —
how many **leading** full blocks may be published (0 = none) — so the published
set stays prefix-closed, and learns from ``observe`` (called once per request,
before ``publishable``; repeated calls for the same request id are ignored).

Policies (compose with :class:`AllOf` — the minimum — and :class:`WriteBudget`):

* ``never`` — a read-only pool (the brief's first experiment);
* ``all`` — the baseline;
* ``threshold-k`` — a block after k **distinct requests** containing it (the
  SGLang / vLLM / KVBM style) — counted per request, never per lookup;
* ``boundary`` — only blocks wholly before the application's mark
  (``PublishRequest.boundary_tokens``: system prompt, template, knowledge-base
  version, de-identified document) and nothing of a ``private`` data class, ever;
* ``reuse-aware`` — kvpolicy's: publish a block when its expected value exceeds
  its write cost (below).

**reuse-aware.** Evidence is the number of distinct requests that contained the
block, decayed with half-life ``half_life_s``, kept in a Count-Min sketch
(``width`` × ``depth`` counters: memory is fixed at 8 × width × depth bytes; a
count is overestimated by at most ε·N with probability 1 − δ, ε = e/width,
δ = e^−depth, N the decayed total of sightings — with the defaults 2^18 × 4
(8 MiB), ε ≈ 1.0e-5 · N at δ ≈ 1.8 %, under half a request while N < 48k).
With ĉ the decayed count including this request::

    rate       = (ĉ − 1) / half_life_s                      (other requests per second)
    P(reuse)   = 1 − exp(−rate × lifetime_s)                if the block was seen before
               = P(a new block is seen again | bucket)      on its first sighting
    value      = P(reuse) × cross_replica_share × recompute_s(depth)
    cost       = t_write × ρ/(1 − ρ) + index_s + eviction_s,   t_write = block_bytes / write_bytes_per_s

ρ is the recent utilisation of the write's path (``PublishRequest.write_path_utilisation``,
measured by the engine): a write on a shared link costs the delay it imposes
on the traffic it shares the link with — t_write × ρ/(1 − ρ), the M/M/1 delay
a job of length t_write adds to a queue at load ρ (capped at ρ = 0.99). When ρ
is unknown the cost is the full t_write (a busy-link assumption: conservative).
    publish the leading run n maximising Σ_{j<n} (value_j − cost)

Publishing is prefix-closed (a block is useless remotely without its prefix), so
a deep block worth publishing carries the shallow blocks it needs even when each
of those alone would not pay; the run stops where everything after it is worth
less, in total, than it costs.

The first-sighting probability is **learned**, per bucket of how much of the
request was itself reused (quarters of its blocks: a mid-session request reuses
most of its prompt): of the new blocks such requests created, the share that was
seen again within ``lifetime_s`` (Laplace-smoothed). A block is counted only
once its ``lifetime_s`` window has closed — until then "not seen again yet" is
not evidence of "never" (counting it early biases every trace's start towards
p ≈ 0); before any window has closed the estimate is the prior, ½. It lets a live session's newest turn be published
before the next turn needs it, and keeps unique tails out. Origins are tracked for
the newest ``origin_capacity`` new blocks (memory bound).

**WriteBudget** is a token bucket on written bytes per second (``burst_bytes``
deep); when it runs low it sheds the lowest-value blocks first: a block is
admitted only while tokens last and its value is at least
``value_floor × (1 − fill)`` (fill = tokens / burst).
"""

from __future__ import annotations

import math
import numbers
from array import array
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Protocol, runtime_checkable

import attrs
import numpy as np

from ._mix import _M64, fmix64, key_bits, splitmix64_next
from ._validate import check_non_negative_int, check_non_negative_number, check_positive_int, check_positive_number, check_probability, check_real
from ._own import call_own, is_own, load_own
from .errors import ConfigError

DATA_CLASSES = ("public", "shared", "internal", "private")


@attrs.frozen
class PublishRequest:
    request_id: Hashable
    num_tokens: int
    block_size_tokens: int
    #: seconds on any clock that only moves forward; None: not given — the filters that decay counts or close windows
    #: (reuse-aware, structure-aware, WriteBudget) refuse such a request, as a time of 0 for every request broke them
    time_s: float | None = None
    tenant: str = "default"
    data_class: str = "shared"
    boundary_tokens: int | None = None
    replica: str = "replica-0"
    reused_blocks: int = 0  # leading blocks this request itself found (local or remote)
    #: of those, the leading blocks found in the replica's own cache (no pool read); None: not said (the dueling
    #: selector's ghost pools then count a local hit as a pool hit)
    local_blocks: int | None = None
    #: recent utilisation (0..1) of the links a write would cross (the replica's egress, the pool's
    #: ingress), as the engine measures it; None: unknown (a write then costs its full link time)
    write_path_utilisation: float | None = None
    #: after the replica's own blocks (``local_blocks``), the leading ones another replica held in its local cache when
    #: the request arrived — blocks a pull from that peer serves whatever was published (the directory knows them from
    #: the engines' KV events). The dueling selector credits no rule with them and lets every ghost keep them as a pull
    #: would; 0 (default): no pulls, or none possible
    peer_blocks: int = 0

    def __attrs_post_init__(self) -> None:
        u = self.write_path_utilisation
        if u is not None and (isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 <= u <= 1):
            raise ConfigError("write_path_utilisation", f"must be in [0, 1] or None, got {u!r}")
        for name, least in (("num_tokens", 0), ("block_size_tokens", 1), ("reused_blocks", 0), ("peer_blocks", 0)):
            v = getattr(self, name)
            if type(v) is not int and (isinstance(v, bool) or not isinstance(v, numbers.Integral)) or v < least:  # numpy ints are ints
                raise ConfigError(name, f"must be an int >= {least}, got {v!r}")
        lb = self.local_blocks
        if lb is not None and (type(lb) is not int and (isinstance(lb, bool) or not isinstance(lb, numbers.Integral)) or not 0 <= lb <= self.reused_blocks):
            raise ConfigError("local_blocks", f"must be an int in [0, reused_blocks={self.reused_blocks}] or None, got {lb!r}")
        t = self.time_s
        if t is not None and (type(t) is not float and (isinstance(t, bool) or not isinstance(t, numbers.Real)) or not math.isfinite(t)):
            raise ConfigError("time_s", f"must be a finite number of seconds or None, got {t!r}")
        if self.data_class not in DATA_CLASSES:
            raise ConfigError("data_class", f"must be one of {DATA_CLASSES}, got {self.data_class!r}")
        b = self.boundary_tokens
        if b is not None and (isinstance(b, bool) or not isinstance(b, numbers.Integral)):
            raise ConfigError("boundary_tokens", f"must be an int or None, got {b!r}")
        if self.boundary_tokens is not None and not 0 <= self.boundary_tokens <= self.num_tokens:
            raise ConfigError("boundary_tokens", f"must be in [0, num_tokens={self.num_tokens}], got {self.boundary_tokens}")

    @property
    def full_blocks(self) -> int:
        return self.num_tokens // self.block_size_tokens


@runtime_checkable
class PublishFilter(Protocol):
    def observe(self, request: PublishRequest, keys: Sequence[Hashable]) -> None: ...

    def publishable(self, request: PublishRequest, keys: Sequence[Hashable]) -> int: ...


def _check(request: PublishRequest, keys: Sequence[Hashable], *, timed: str | None = None) -> None:
    if type(request) is not PublishRequest and not isinstance(request, PublishRequest):
        raise ConfigError("request", f"must be a PublishRequest, got {type(request).__name__}")
    if type(keys) is not list and (isinstance(keys, (str, bytes, bytearray)) or not hasattr(keys, "__len__") or not hasattr(keys, "__getitem__")):
        raise ConfigError("keys", f"must be a sequence of block keys, got {type(keys).__name__}")
    if len(keys) > request.full_blocks:
        raise ConfigError("keys", f"{len(keys)} keys for {request.num_tokens} tokens: only full blocks ({request.full_blocks}) may be published — never a partial one")
    if timed is not None and request.time_s is None:
        raise ConfigError("time_s", f"{timed} decays its counts and closes its windows on the request's time: give "
                                    "PublishRequest(time_s=...) in seconds from any clock that only moves forward")


def _timed(request: PublishRequest, keys: Sequence[Hashable], name: str) -> float:
    """:func:`_check` for a filter that keeps time: the request's time, which it must carry."""
    _check(request, keys, timed=name)
    assert request.time_s is not None  # _check refused a request without one
    return request.time_s


class _Dedup:
    """Counts each (request, block) pair once: an engine may observe a request
    several times, or block by block as it looks the prefix up. Remembers the
    keys of the newest ``size`` requests (memory bound)."""

    def __init__(self, size: int = 4096) -> None:
        # request -> the keys it showed: a tuple after its first look (a tenth of a set's memory, and most requests are
        # looked at once), a set from its second on
        self._seen: OrderedDict[Hashable, tuple | set] = OrderedDict()
        self._size = size

    def new_keys(self, request_id: Hashable, keys: Sequence[Hashable]) -> list[Hashable]:
        seen = self._seen
        done = seen.get(request_id)
        if done is None:  # a request's first look: every key is new
            # a chain's keys are distinct (nearly always): the keys as they are, else the first of each in order
            fresh = list(keys) if len(set(keys)) == len(keys) else list(dict.fromkeys(keys))
            seen[request_id] = tuple(fresh)
            if len(seen) > self._size:
                seen.popitem(last=False)
            return fresh
        seen.move_to_end(request_id)
        if isinstance(done, tuple):
            done = seen[request_id] = set(done)
        fresh = [k for k in dict.fromkeys(keys) if k not in done]
        done.update(fresh)
        return fresh

    def first(self, request_id: Hashable) -> bool:
        """True the first time ``request_id`` is seen (among the newest ``size``), and remembers it; False after."""
        if request_id in self._seen:
            self._seen.move_to_end(request_id)
            return False
        self.new_keys(request_id, ())
        return True


class NeverPublish:
    name = "never"

    def observe(self, request: PublishRequest, keys: Sequence[Hashable]) -> None:
        _check(request, keys)

    def publishable(self, request: PublishRequest, keys: Sequence[Hashable]) -> int:
        _check(request, keys)
        return 0


class PublishAll:
    name = "all"

    def observe(self, request: PublishRequest, keys: Sequence[Hashable]) -> None:
        _check(request, keys)

    def publishable(self, request: PublishRequest, keys: Sequence[Hashable]) -> int:
        _check(request, keys)
        return len(keys)


class ThresholdPublish:
    """A block after ``k`` distinct requests that contain it.

    Counts are kept for the ``capacity_keys`` most recently seen keys (default 500k, as ``structure-aware``): a key
    seen less recently than that starts again from 0, so an engine that runs for days holds bounded memory (an
    unbounded count grew by one entry for every block ever seen)."""

    def __init__(self, k: int = 2, *, capacity_keys: int = 500_000) -> None:
        if isinstance(k, bool) or not isinstance(k, int) or k <= 0:
            raise ConfigError("k", f"must be a positive int, got {k!r}")
        check_positive_int("capacity_keys", capacity_keys)
        self.k = k
        self.name = f"threshold-{k}"
        self._count: OrderedDict[Hashable, int] = OrderedDict()  # least recently seen first
        self._capacity = capacity_keys
        self._dedup = _Dedup()

    def observe(self, request: PublishRequest, keys: Sequence[Hashable]) -> None:
        _check(request, keys)
        count = self._count
        for key in self._dedup.new_keys(request.request_id, keys):
            c = count.get(key)
            if c is None:
                count[key] = 1
                if len(count) > self._capacity:
                    count.popitem(last=False)
            else:
                count[key] = c + 1
                count.move_to_end(key)  # now the most recently seen

    @property
    def held_keys(self) -> int:
        """Keys with a count held (at most ``capacity_keys``). Not ``__len__``: an empty filter must stay truthy."""
        return len(self._count)

    def count(self, key: Hashable) -> int:
        return self._count.get(key, 0)

    def publishable(self, request: PublishRequest, keys: Sequence[Hashable]) -> int:
        _check(request, keys)
        n = 0
        for key in keys:
            if self._count.get(key, 0) < self.k:
                break
            n += 1
        return n


class BoundaryPublish:
    """Nothing past the application's boundary, nothing private, ever."""

    name = "boundary"

    def observe(self, request: PublishRequest, keys: Sequence[Hashable]) -> None:
        _check(request, keys)

    def publishable(self, request: PublishRequest, keys: Sequence[Hashable]) -> int:
        _check(request, keys)
        if request.data_class == "private" or request.boundary_tokens is None:
            return 0
        return min(len(keys), request.boundary_tokens // request.block_size_tokens)


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


class DuelingPublish:
    """Never worse than the best simple rule: every candidate rule publishes into a ghost pool of its own, and the
    rule whose ghost has earned the most decides the real writes (set dueling — Qureshi et al., ISCA'07 — with a
    miniature pool per rule instead of leader sets: in one shared pool a rule that writes more takes space from the
    others, and would look better than it is).

    Each ghost holds keys only, as many as the real pool holds blocks (``pool_capacity_blocks``; None: unbounded),
    least recently used first — the same shape as the pool, so a rule that writes too much evicts its own re-reads.
    Per request, in each ghost, the brief's E[benefit] terms as the ledger counts them::

        served_s  = Σ max(recompute_s(j) − load_s, 0) over the leading run of keys[L:] the ghost holds
                    (L: the replica's own blocks; load_s = block_bytes / read_bytes_per_s: a hit saves
                    T_recompute − T_remote, not the whole recompute)
        unread    = the blocks the rule published that no request has read yet (P_write: publishing blocks nobody
                    read — a written block is charged its write price when it is written (below), and that charge
                    is taken back at its first read)
        score    += served_s − new writes × write cost + first reads × write cost

    P_eviction is paid in the ghost's lost re-reads. Scores decay with half-life ``half_life_s`` (what is true now
    counts). The candidates (default: ``structure-aware`` — kvpolicy's value rule —, ``threshold-3``, ``threshold-2``,
    ``all``) are any publish specs; ties go to the earlier one. Every candidate observes every request, so the one
    that takes over has learned all along. ``read_bytes_per_s``: the read path's rate (default: the write's).

    ``score="gpu_s"`` scores in GPU seconds instead (the rule before issue #44's second round): a hit is worth its
    whole ``recompute_s(j)`` and every written block is charged, read or not. Where a load costs a sizeable share of a
    recompute it ranks a rule that writes more higher (measured: docs/publish.md).

    **Prices** (issue #58). A written block is charged its shadow price, ``t_write × ρ/(1 − ρ)`` with ρ the write
    path's measured utilisation (:meth:`write_price_s`): the delay it imposes on the traffic sharing its links — on an
    idle link a write costs only the pool space it takes, which its ghost already pays in lost re-reads (a fixed
    ``t_write`` per block counted a second of link time as a second of GPU time, and picked the rules that write least
    whatever the links' load). Its first read pays back what it was charged.

    **A write budget** (``write_budget_rule``, e.g. ``"threshold-2"``): a candidate leads only while its ghost has
    written (decayed as the scores are) no more blocks than that rule's — bytes are a constraint, served seconds the
    objective. The simulator sets it to ``threshold-2`` (SGLang's selective write-through) for a set that pulls from
    peers: a pull serves the second sighting that publishing at first sighting would, so writing more than the count
    rule buys little.

    ``recompute_s`` is a pure function of the depth: its values are remembered. Count thresholds among the candidates
    share one count (it does not depend on k).

    Costs: one LRU walk per candidate per request over the blocks it reads and writes; memory ≈ candidates ×
    ``pool_capacity_blocks`` keys.
    """

    name = "dueling"
    CANDIDATES = ("structure-aware", "threshold-3", "threshold-2", "all")
    #: "e_benefit": the brief's terms (a hit saves recompute − load; unread writes are charged); "gpu_s": hits at their
    #: whole recompute seconds, every write charged
    SCORES = ("e_benefit", "gpu_s")

    def __init__(self, *, block_bytes: int, recompute_s: Callable[[int], float], write_bytes_per_s: float = 12.5e9,
                 pool_capacity_blocks: int | None = None, candidates: Sequence[str] = CANDIDATES, half_life_s: float = 600.0,
                 cross_replica_share: float = 0.875, read_bytes_per_s: float | None = None, score: str = "e_benefit",
                 write_budget_rule: str | None = None) -> None:
        check_positive_int("block_bytes", block_bytes)
        if not callable(recompute_s):
            raise ConfigError("recompute_s", f"must be a callable depth -> seconds, got {recompute_s!r}")
        check_positive_number("write_bytes_per_s", write_bytes_per_s)
        if read_bytes_per_s is not None:
            check_positive_number("read_bytes_per_s", read_bytes_per_s)
        if score not in self.SCORES:
            raise ConfigError("score", f"must be one of {', '.join(self.SCORES)}, got {score!r}")
        self.score = score
        if pool_capacity_blocks is not None:
            check_positive_int("pool_capacity_blocks", pool_capacity_blocks)
        check_positive_number("half_life_s", half_life_s)
        if isinstance(candidates, str) or not candidates:
            raise ConfigError("candidates", f"must be a non-empty list of publish specs, got {candidates!r}")
        for spec in candidates:
            if not isinstance(spec, str) or any(p in ("dueling", "dueling-gpu-s") for p in check_spec(spec)):
                raise ConfigError("candidates", f"{spec!r}: a candidate is a publish spec other than dueling")
        kw = {"block_bytes": block_bytes, "recompute_s": recompute_s, "write_bytes_per_s": write_bytes_per_s,
              "cross_replica_share": cross_replica_share}
        self.candidates = tuple(candidates)
        if write_budget_rule is not None and write_budget_rule not in self.candidates:
            raise ConfigError("write_budget_rule", f"must be one of the candidates {list(self.candidates)} or None, got {write_budget_rule!r}")
        #: the candidate whose writes bound every leader's: a rule leads only while its ghost has written (decayed) no
        #: more blocks than this one's — bytes are a constraint, served seconds the objective (None: no bound)
        self.budget = None if write_budget_rule is None else self.candidates.index(write_budget_rule)
        self.rules = [make_filter(spec, **kw) for spec in self.candidates]
        # count thresholds of the same capacity see the same requests and keep the same counts whatever their k: one
        # count serves them all, observed once (a threshold's state does not depend on its k)
        self._observers: list[Any] = []
        counts: dict[int, ThresholdPublish] = {}
        for rule in self.rules:
            if type(rule) is ThresholdPublish:
                first = counts.setdefault(rule._capacity, rule)
                if first is not rule:
                    rule._count, rule._dedup = first._count, first._dedup
                    continue
            self._observers.append(rule)
        self.recompute_s = recompute_s
        #: what a hit at depth j saves, max(recompute_s(j) − load_s, 0), by depth as asked (recompute_s is pure)
        self._rs_memo: list[float] = []
        self.write_cost_s = block_bytes / write_bytes_per_s  # per block written and never read: the ledger's P_write price
        self.load_s = block_bytes / (read_bytes_per_s if read_bytes_per_s is not None else write_bytes_per_s)  # per block read
        if score == "gpu_s":
            self.load_s = 0.0
        self.capacity = pool_capacity_blocks
        self.half_life_s = half_life_s
        self._lam = math.log(2) / half_life_s
        #: per candidate: key -> True once read, else the price its write was charged; least recently used first
        self.ghosts: list[OrderedDict[Hashable, bool | float]] = [OrderedDict() for _ in self.candidates]
        self.scores = [0.0] * len(self.candidates)
        self.served_s = [0.0] * len(self.candidates)  # undecayed totals, for reports
        self.written_blocks = [0] * len(self.candidates)
        self.written_decayed = [0.0] * len(self.candidates)  # blocks written, decayed as the scores are (the budget's test)
        self.decided = [0] * len(self.candidates)  # requests each candidate decided for
        self._t: float | None = None
        self._read = _Dedup(size=4096)
        self._wrote = _Dedup(size=4096)

    def write_price_s(self, request: PublishRequest) -> float:
        """What one block's write costs now (``score="e_benefit"``): the delay it imposes on the traffic sharing its
        path, ``t_write × ρ/(1 − ρ)`` (the M/M/1 externality of a job of length t_write at load ρ, ρ capped at 0.99)
        with ρ the path's measured utilisation (``PublishRequest.write_path_utilisation``) — on an idle link a write
        costs only the pool space it takes, which the ghost already charges as lost re-reads. Unknown ρ: the whole
        ``t_write`` (a busy link: conservative)."""
        if self.score != "e_benefit":
            return self.write_cost_s
        rho = request.write_path_utilisation
        if rho is None:
            return self.write_cost_s
        rho = min(rho, 0.99)
        return self.write_cost_s * rho / (1.0 - rho)

    @property
    def leader(self) -> int:
        """The index of the candidate that decides now: the highest score among those within the write budget (the
        earliest on a tie); the budget rule itself is always within it."""
        sc = self.scores
        b = self.budget
        cap = self.written_decayed[b] * (1.0 + 1e-9) + 1e-9 if b is not None else math.inf
        wd = self.written_decayed
        best = -1
        for i in range(len(sc)):
            if wd[i] > cap:
                continue
            if best < 0 or sc[i] > sc[best]:  # strictly: a tie stays with the earlier
                best = i
        return best

    @property
    def leader_name(self) -> str:
        return self.candidates[self.leader]

    def _decay_to(self, t: float) -> None:
        if self._t is not None and t > self._t:
            f = math.exp(-self._lam * (t - self._t))
            self.scores = [x * f for x in self.scores]
            self.written_decayed = [x * f for x in self.written_decayed]
        if self._t is None or t > self._t:
            self._t = t

    def observe(self, request: PublishRequest, keys: Sequence[Hashable]) -> None:
        t = _timed(request, keys, "dueling")
        if self._read.first(request.request_id):
            self._decay_to(t)
            L = request.local_blocks or 0
            rs = self._rs_memo
            while len(rs) < len(keys):
                rs.append(max(self.recompute_s(len(rs)) - self.load_s, 0.0))
            cost = self.write_cost_s if self.score == "e_benefit" else 0.0  # what a first read pays back
            P = min(request.peer_blocks, max(len(keys) - L, 0))
            cap = self.capacity
            for c, ghost in enumerate(self.ghosts):
                served = 0.0
                paid_back = 0.0
                get, to_end = ghost.get, ghost.move_to_end
                for j in range(L, L + P):  # served by a pull whatever the rule: no credit; the pool keeps them, read
                    key = keys[j]
                    was_read = get(key)
                    if was_read is not None:
                        if was_read is not True:
                            ghost[key] = True  # a pull read it: its write's charge is paid back
                            paid_back += was_read
                        to_end(key)
                    else:
                        ghost[key] = True
                        if cap is not None and len(ghost) > cap:
                            ghost.popitem(last=False)
                for j in range(L + P, len(keys)):
                    key = keys[j]
                    was_read = get(key)
                    if was_read is None:
                        break
                    if was_read is not True:
                        ghost[key] = True  # its write's charge is paid back: it was read
                        paid_back += was_read
                    to_end(key)
                    served += rs[j]
                self.scores[c] += served + (paid_back if cost else 0.0)
                self.served_s[c] += served
        for rule in self._observers:
            rule.observe(request, keys)

    def publishable(self, request: PublishRequest, keys: Sequence[Hashable]) -> int:
        _check(request, keys, timed="dueling")
        ns = [rule.publishable(request, keys) for rule in self.rules]
        if self._wrote.first(request.request_id):
            cap = self.capacity
            price = self.write_price_s(request)
            for c, ghost in enumerate(self.ghosts):
                wrote = 0
                to_end = ghost.move_to_end
                for key in keys[:ns[c]]:
                    if key in ghost:
                        to_end(key)
                        continue
                    ghost[key] = price  # written, not read yet: the charge its first read pays back
                    wrote += 1
                    if cap is not None and len(ghost) > cap:
                        ghost.popitem(last=False)
                self.scores[c] -= wrote * price
                self.written_blocks[c] += wrote
                self.written_decayed[c] += wrote
        lead = self.leader
        self.decided[lead] += 1
        return ns[lead]

    def report(self) -> dict[str, Any]:
        """Per candidate: recompute seconds its ghost served, blocks it wrote, its decayed score, requests it decided."""
        return {spec: {"served_s": self.served_s[c], "written_blocks": self.written_blocks[c], "score": self.scores[c],
                       "decided_requests": self.decided[c]} for c, spec in enumerate(self.candidates)}


class AllOf:
    """Composition: a block is publishable only if every filter allows it."""

    def __init__(self, *filters: Any) -> None:
        if not filters:
            raise ConfigError("filters", "AllOf needs at least one filter")
        self.filters = filters
        self.name = " & ".join(getattr(f, "name", type(f).__name__) for f in filters)

    def observe(self, request: PublishRequest, keys: Sequence[Hashable]) -> None:
        for f in self.filters:
            f.observe(request, keys)

    def publishable(self, request: PublishRequest, keys: Sequence[Hashable]) -> int:
        return min(f.publishable(request, keys) for f in self.filters)


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


_NAMES = ("all", "never", "boundary", "reuse-aware", "structure-aware", "dueling", "dueling-gpu-s")
_OWN_USAGE = "a PublishFilter class (or factory), built with the keywords it takes of block_bytes, recompute_s, ..."


def check_spec(spec: str) -> list[str]:
    """The names in a filter spec (``a+b`` → both), each checked: a known name or ``threshold-K`` with an integer K ≥ 1.
    Builds nothing, so a caller can refuse a misspelt spec before any work."""
    if not isinstance(spec, str):
        raise ConfigError("policy", f"must be a publish policy name (a string like 'structure-aware' or 'threshold-2'), got {type(spec).__name__}")
    parts = [p.strip() for p in spec.split("+") if p.strip()]
    if not parts:
        raise ConfigError("policy", f"empty publish policy {spec!r}")
    for name in parts:
        if is_own(name):
            load_own(name, "policy", _OWN_USAGE)
        elif name.startswith("threshold-"):
            k = name.split("-", 1)[1]
            if not (k.isascii() and k.isdigit()) or int(k) < 1:  # here, not in ThresholdPublish: its error would name its argument, not the spec
                raise ConfigError("policy", f"threshold-K needs a positive integer K, got {name!r}")
        elif name not in _NAMES:
            raise ConfigError("policy", f"unknown publish policy {name!r}; known: {', '.join(_NAMES)}, threshold-K (compose with +); "
                              f"or one of your own: MODULE:NAME or PATH.py:NAME, NAME {_OWN_USAGE}")
    return parts


def make_filter(spec: str, **kw: Any) -> Any:
    """``all``, ``never``, ``threshold-K``, ``boundary``, ``reuse-aware``, ``structure-aware``; ``a+b`` composes with AllOf.
    A filter of your own is ``MODULE:NAME`` or ``PATH.py:NAME``, built as ``NAME(**kw)`` with the keywords its signature
    takes (``block_bytes``, ``recompute_s``, ... as kvpolicy's own get them), and must have ``observe`` and ``publishable``."""
    parts = check_spec(spec)
    if len(parts) > 1:
        return AllOf(*(make_filter(p, **kw) for p in parts))
    name = parts[0]
    if is_own(name):
        f = call_own(name, "policy", load_own(name, "policy", _OWN_USAGE), **kw)
        if not callable(getattr(f, "observe", None)) or not callable(getattr(f, "publishable", None)):
            raise ConfigError("policy", f"{name!r} built a {type(f).__name__}, which lacks observe/publishable: a publish filter "
                              "implements kvpolicy.publish.PublishFilter (docs/publish.md)")
        return f
    if name == "all":
        return PublishAll()
    if name == "never":
        return NeverPublish()
    if name == "boundary":
        return BoundaryPublish()
    if name.startswith("threshold-"):
        return ThresholdPublish(int(name.split("-", 1)[1]))
    if name == "reuse-aware":
        return ReuseAwarePublish(**_taken(ReuseAwarePublish, kw))
    if name in ("dueling", "dueling-gpu-s"):
        return DuelingPublish(**{**_taken(DuelingPublish, kw), "score": "gpu_s" if name == "dueling-gpu-s" else "e_benefit"})
    return StructureAwarePublish(**_taken(StructureAwarePublish, kw))


def _taken(cls: Any, kw: dict[str, Any]) -> dict[str, Any]:
    """The keywords ``cls`` takes (callers pass every filter the same set: block_bytes, recompute_s, pool_capacity_blocks, ...)."""
    import inspect

    params = inspect.signature(cls).parameters
    return {k: v for k, v in kw.items() if k in params}
