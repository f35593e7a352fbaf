"""kvpolicy's adaptive eviction: hit density learned online, per structural class.

A block is worth its space by the hits it will still get per unit of time it will
still occupy — its **hit density** (LHD, NSDI'18). Nothing about that is a
constant to pick: the policy *learns*, per class of block, how hits and evictions
are distributed over a block's age, and from those distributions the expected
hits and expected remaining lifetime of a block at any age.

* **Age** is seconds of the policy clock since the block's last use (the arrival
  time of the request that used it): conversations continue after a think time,
  agents after a tool call; a block-count clock would age a block by how long
  other prompts are.
* **Class** = ``min(hits, 3)`` × *branched* (at least two child blocks were
  inserted under it while resident: a shared system prompt, a document several
  requests continue differently). Hits and branching are the structural facts a
  prefix cache sees without labels. A block back within the ghost window keeps
  them (hits + 1: the return is a reuse), as ARC's B2 remembers a frequent block.
* **Histograms**: each class keeps hits and evictions per age bin (``bins`` bins;
  a bin is ``span`` × the mean eviction age / ``bins`` wide, re-derived at each
  reconfiguration so the histogram covers the ages that matter on *this* trace).
* **Density** of class c at bin a (recomputed every ``interval`` requests, then
  the histograms decay by ``decay``)::

      D(c, a) = Σ_{x ≥ a} hits(c, x) / Σ_{x ≥ a} (x − a + 1) · (hits + evictions)(c, x)

  = expected hits of this lifetime / expected remaining lifetime, given it has
  survived to age a.
* **Ghosts correct the policy's own bias.** An evicted block is remembered (its
  class, last use and eviction bin) until as many bytes as the capacity have been
  evicted after it. If it is requested again in that window, its eviction is taken
  back and counted as the hit it would have been at its true age. Without this a
  class the policy evicts young never shows hits at older ages, and the policy
  keeps evicting it young (the estimate censors itself).
* **Victim**: ``samples`` candidates drawn uniformly (with replacement, a seeded
  splitmix64) from the evictable leaves; the lowest ``D`` goes (first drawn
  wins ties; not divided by size: a hit serves all of a block's tokens, and
  kvpolicy counts tokens). Until the first reconfiguration the rank is ``−age``
  (sampled LRU).

Knobs and defaults: ``samples`` 16, ``bins`` 256, ``span`` 8, ``interval`` 50
requests (and at least 8 × ``bins`` uses and inserts), ``decay`` 0.9 (LHD's), ``seed`` 0. None was fitted to a trace; they were
chosen once, on synthetic presets at seeds 1 and 2, and are reported on other seeds
and on the conversation trace (docs/benchmarks.md). A request is counted when its
root block (depth 0) is used or inserted.

The Numba kernel ``hit_density_kernel`` makes the same decisions, victim for victim
(tests/test_hit_density.py).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Any

import numpy as np

from .._mix import key_bits
from .._mix import splitmix64_next as splitmix64
from .._validate import check_positive_int, check_positive_number, check_probability
from ..errors import CapacityError, ConfigError
from ..protocols import Clock
from ..clock import ManualClock
from .base import EvictionPolicy, Node

_M64 = (1 << 64) - 1
N_CLASSES = 8
MAX_SAMPLES = 4096  # candidates drawn per eviction, at most
MAX_BINS = 1 << 16  # age bins per class, at most


def block_class(hits: int, child_inserts: int) -> int:
    return min(hits, 3) * 2 + (1 if child_inserts >= 2 else 0)


def densities(hit_hist: np.ndarray, evict_hist: np.ndarray, excess: np.ndarray) -> np.ndarray:
    """``D[c, a]`` from per-class hit and eviction histograms (the formula above; 0 where nothing was seen).
    ``excess[c]``: how far past the last bin its events lay, in bins, summed — their lifetime beyond it."""
    out = np.zeros(hit_hist.shape)
    for c in range(hit_hist.shape[0]):
        hits_up = events_up = 0.0
        lifetime = float(excess[c])
        for a in range(hit_hist.shape[1] - 1, -1, -1):
            hits_up += hit_hist[c, a]
            events_up += hit_hist[c, a] + evict_hist[c, a]
            lifetime += events_up
            out[c, a] = hits_up / lifetime if lifetime > 0 else 0.0
    return out


class HitDensityPolicy(EvictionPolicy):
    name = "hit-density"
    #: which expert picks the victim among the samples: 0 hit density, 1 LRU, 2 LFU (adaptive's mini-simulations)
    _executing = 0
    #: True: the engine says when a request begins (:meth:`request_began`) and a root's use or insertion counts no
    #: request — an engine that shows kvpolicy its blocks late and out of order (SGLang's radix cache, through its
    #: eviction strategy) would count some requests twice and miss others
    requests_from_engine = False

    def __init__(self, capacity_bytes: int, *, samples: int = 16, bins: int = 256, span: float = 8.0, interval: int = 50,
                 decay: float = 0.9, seed: int = 0, clock: Clock | None = None) -> None:
        check_positive_int("samples", samples)
        check_positive_int("interval", interval)
        check_positive_int("bins", bins)
        if samples > MAX_SAMPLES:  # each eviction draws this many: past it a victim costs more than a sort would
            raise ConfigError("samples", f"must be at most {MAX_SAMPLES}, got {samples!r}")
        if not 2 <= bins <= MAX_BINS:  # the histograms are classes x bins floats, recomputed every interval
            raise ConfigError("bins", f"must be in [2, {MAX_BINS}], got {bins!r}")
        check_positive_number("span", span)
        check_probability("decay", decay)
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
            raise ConfigError("seed", f"must be an int in [0, 2**64), got {seed!r}")
        super().__init__(capacity_bytes, clock=clock)
        self.samples, self.bins, self.span, self.interval, self.decay = samples, bins, float(span), interval, float(decay)
        self._rng = seed
        self.hit_hist = np.zeros((N_CLASSES, bins))
        self.evict_hist = np.zeros((N_CLASSES, bins))
        self.excess = np.zeros(N_CLASSES)
        self.density = np.zeros((N_CLASSES, bins))
        self.learned = False
        self.bin_width_s = 1.0
        self._inv_width = 1.0
        self._age_sum_s = 0.0
        self._age_n = 0.0
        self.requests = 0
        self._since_requests = 0
        self._since_events = 0
        self._cand: list[Node] = []
        self._pos: dict[Hashable, int] = {}
        # ghosts: key -> (bytes evicted before it, last use, class, eviction bin, its excess), oldest first
        self._ghosts: OrderedDict[Hashable, tuple[int, float, int, int, float]] = OrderedDict()
        self._evicted_bytes = 0
        self.ghost_hits = 0
        #: how many bytes may be evicted after a ghost before it is forgotten: the capacity (kept when an engine's mirror
        #: raises ``capacity_bytes`` so that it never evicts by itself: kvpolicy.integrations.sglang)
        self.ghost_window_bytes = capacity_bytes

    # ------------------------------------------------------------------ learning

    def _bin(self, age_s: float) -> int:
        """The age bin; an age below 0 (an engine clock that stepped back) is bin 0, never a negative index that
        would count it in the oldest bins. Replay's time only moves forward, which is all the kernel sees."""
        b = age_s * self._inv_width
        if b <= 0.0:
            return 0
        return self.bins - 1 if b >= self.bins - 1 else int(b)

    def _excess(self, age_s: float) -> float:
        b = age_s * self._inv_width - (self.bins - 1)
        return b if b > 0 else 0.0

    def _event(self, hist: np.ndarray, cls: int, age_s: float) -> tuple[int, float]:
        b, x = self._bin(age_s), self._excess(age_s)
        hist[cls, b] += 1.0
        self.excess[cls] += x
        return b, x

    def _tick(self) -> None:
        """A request began. Reconfigure after ``interval`` requests, and only once 8 × ``bins`` uses and inserts have
        been seen since the last time (the recompute touches every class's bins: that keeps it under one step per event)."""
        self.requests += 1
        self._since_requests += 1
        if self._since_requests >= self.interval and self._since_events >= N_CLASSES * self.bins:
            self._since_requests = self._since_events = 0
            self.reconfigure()

    def _begins_request(self, node: Node) -> bool:
        """Does using or inserting ``node`` begin a request? A root does, unless the engine says when requests begin."""
        return node.parent is None and not self.requests_from_engine

    def request_began(self) -> None:
        """A request began, said by an engine that shows kvpolicy its blocks out of order (SGLang's radix cache seen
        through its eviction strategy, where a root's use is seen late or never; set ``requests_from_engine``):
        counted toward the reconfiguration, as a root's use or insertion is otherwise."""
        self._tick()

    def reconfigure(self) -> None:
        """Recompute the densities, decay the histograms, re-derive the bin width from the mean eviction age."""
        self.density = densities(self.hit_hist, self.evict_hist, self.excess)
        self.hit_hist *= self.decay
        self.evict_hist *= self.decay
        self.excess *= self.decay
        if self._age_n > 0:
            self.bin_width_s = max(self.span * (self._age_sum_s / self._age_n) / self.bins, 1e-9)
            self._inv_width = 1.0 / self.bin_width_s
        self._age_sum_s *= self.decay
        self._age_n *= self.decay
        self.learned = True

    def rank(self, node: Node, now_s: float) -> float:
        """Lower is evicted first: the learned hit density (``−age`` until the first reconfiguration). Not divided by
        the block's size: a hit serves all of its tokens, so per byte of space the density is hits × size / (size ×
        lifetime) — kvpolicy counts tokens served (LHD divides by size for the share of objects hit)."""
        t_last, hits, kids = node.data
        if not self.learned:
            return -(now_s - t_last)
        return float(self.density[block_class(hits, kids), self._bin(now_s - t_last)])

    # ------------------------------------------------------------------ hooks

    def _admit(self, node: Node) -> None:
        now = self.clock.now_s()
        if self._begins_request(node):
            self._tick()
        elif node.parent is not None:
            node.parent.data[2] += 1
        node.data = [now, 0, 0]  # last use, hits, child inserts (this residency, or since a ghost's return)
        g = self._ghosts.pop(node.key, None)
        if g is not None and self._evicted_bytes - g[0] <= self.ghost_window_bytes:
            _, t_last, cls, b, x = g
            self.evict_hist[cls, b] = max(self.evict_hist[cls, b] - 1.0, 0.0)
            self.excess[cls] = max(self.excess[cls] - x, 0.0)
            self._event(self.hit_hist, cls, now - t_last)
            self.ghost_hits += 1
            node.data[1] = min(cls // 2 + 1, 3)  # back within the window: it keeps its history (+ this use), as ARC's B2 does
            node.data[2] = 2 * (cls & 1)
        self._since_events += 1

    def _hit(self, node: Node) -> None:
        now = self.clock.now_s()
        if self._begins_request(node):
            self._tick()
        t_last, hits, kids = node.data
        self._event(self.hit_hist, block_class(hits, kids), now - t_last)
        node.data[0] = now
        node.data[1] = hits + 1
        self._since_events += 1

    def _candidate(self, node: Node, yes: bool) -> None:
        if yes:
            self._pos[node.key] = len(self._cand)
            self._cand.append(node)
        else:
            i = self._pos.pop(node.key)
            last = self._cand.pop()
            if last is not node:
                self._cand[i] = last
                self._pos[last.key] = i

    def _pick(self, z: int) -> Node:
        """The candidate a 64-bit draw ``z`` picks: Lemire's multiply-shift, uniform enough in [0, candidates)."""
        return self._cand[((z >> 32) * len(self._cand)) >> 32]

    def _choose(self) -> Node:
        n = len(self._cand)
        if n == 0:
            raise CapacityError("no eviction candidate")  # unreachable: victims() checks freeable bytes first
        now = self.clock.now_s()
        expert = self._executing
        best: Node | None = None
        best_key: Any = None
        for _ in range(self.samples):
            self._rng, z = splitmix64(self._rng)
            node = self._pick(z)
            k = self.priority_of(node, now, expert)
            if best is None or k < best_key:  # the first drawn wins ties
                best, best_key = node, k
        assert best is not None
        return best

    def priority_of(self, node: Node, now_s: float, expert: int | None = None) -> tuple:
        """What a decision compares (lower is evicted first) — of any resident block, not only a sample: the learned
        hit density, not per byte (``−age`` until the first reconfiguration); for adaptive's LRU expert the last use, for
        its LFU expert (hits 0, 1, 2, 3+, last use). ``expert`` None: the one executing now. An engine that ranks
        every leaf itself (SGLang's radix cache) asks this (:class:`kvpolicy.integrations.sglang.PriorityStrategy`)."""
        expert = self._executing if expert is None else expert
        if expert == 0:
            return (self.rank(node, now_s),)
        if expert == 1:
            return (node.data[0],)  # LRU: the oldest
        return (min(node.data[1], 3), node.data[0])  # LFU: the fewest hits (0, 1, 2, 3+), then the oldest

    def _forget(self, node: Node) -> None:
        now = self.clock.now_s()
        t_last, hits, kids = node.data
        age = now - t_last
        cls = block_class(hits, kids)
        b, x = self._event(self.evict_hist, cls, age)
        self._age_sum_s += age
        self._age_n += 1.0
        self._ghosts[node.key] = (self._evicted_bytes, t_last, cls, b, x)
        self._ghosts.move_to_end(node.key)
        self._evicted_bytes += node.size
        while self._ghosts:
            k, g = next(iter(self._ghosts.items()))
            if self._evicted_bytes - g[0] <= self.ghost_window_bytes:
                break
            del self._ghosts[k]


class AdaptivePolicy(HitDensityPolicy):
    """Three experts — hit density, LRU and LFU — each replayed in a miniature simulation; the one that hits most evicts.

    Every expert picks from the same ``samples`` candidates: hit density the lowest density, LRU the oldest, LFU the
    fewest hits (0, 1, 2, 3+) then the oldest. Which one does best on *this* trace at *this* size is not guessed: a
    **miniature simulation** (Waldspurger et al., ATC'17; spatial sampling as in SHARDS, FAST'15) answers it. A
    fixed pseudo-random ``sample_rate`` of the keys (``splitmix64(key xor seed) < rate · 2**64``) is replayed in
    three small caches of ``sample_rate`` × the capacity, each evicting by one expert. A request's sampled blocks
    form one request of the mini-simulations, each under its nearest sampled ancestor (the chain, compressed), so
    the prefix rule holds there too; a hit scores the block's size. They learn nothing themselves: hit density ranks there by the real cache's
    densities, learned on every reference. Before each request that will recompute the real cache's densities
    (every ``interval`` requests, once 8 × ``bins`` uses and inserts were seen; until they are first computed, every
    ``interval`` requests), the mini-simulations' hits since the last time are scored — the scores decay by ``decay``, as the histograms do — and the expert with the highest
    score evicts from that request on (ties keep the current one); hit density until one leads. The
    mini-simulations never see the real cache, so no expert is judged in a cache another expert shaped. The knobs
    are hit density's plus ``sample_rate`` (default :meth:`default_sample_rate`: 1/16, more for caches under 4,096
    blocks; raised at each judging so that a mini-simulation holds 256 nodes of the mean resident size).

    ``expert`` pins the executing expert (``"hit-density"``, ``"lru"`` or ``"lfu"``; default ``None``: the
    mini-simulations pick) while the mini-simulations go on. Pinned to hit density it evicts exactly what
    :class:`HitDensityPolicy` does. ``evictions_by_expert`` counts the evictions each expert executed;
    :meth:`stats` adds each mini-simulation's hit ratio. The kernel makes the same decisions
    (``replay_kernel(trace, "adaptive", ...)``).

    A request is the run of blocks from one root block (depth 0) to the next, as the policy sees them (hits and
    insertions); its time is the clock's at its root.
    """

    name = "adaptive"
    EXPERTS = ("hit-density", "lru", "lfu")
    SAMPLE_RATE = 1 / 16  # the default share of the keys the mini-simulations replay ...
    MIN_MINI_CAPACITY = 256  # ... raised so that each mini-simulation holds at least this many (unit) blocks

    @classmethod
    def default_sample_rate(cls, capacity_bytes: int) -> float:
        """1/16, raised for small caches so a mini-simulation holds at least 256 blocks (all keys, at a capacity
        of 256 or less). Counted in unit-size blocks, as replay sizes them; at each judging :meth:`_fit_rate` raises
        it for an engine whose nodes are larger (bytes, runs of pages). Chosen on the presets at seeds 1–2 (128, 256,
        512: 256 scored best)."""
        if capacity_bytes <= 0:
            return cls.SAMPLE_RATE
        return max(cls.SAMPLE_RATE, min(1.0, cls.MIN_MINI_CAPACITY / capacity_bytes))

    def __init__(self, capacity_bytes: int, *, expert: str | None = None, sample_rate: float | None = None, **kw: Any) -> None:
        if expert is not None and expert not in self.EXPERTS:
            raise ConfigError("expert", f"must be one of {', '.join(self.EXPERTS)} (or None: the mini-simulations pick), got {expert!r}")
        auto_rate = sample_rate is None
        if sample_rate is None:
            sample_rate = self.default_sample_rate(capacity_bytes)
        if isinstance(sample_rate, bool) or not isinstance(sample_rate, (int, float)) or not 0 < sample_rate <= 1:
            raise ConfigError("sample_rate", f"must be a number in (0, 1], got {sample_rate!r}")
        super().__init__(capacity_bytes, **kw)
        self.expert = expert
        knobs = {"samples": self.samples, "bins": self.bins, "span": self.span, "interval": self.interval, "decay": self.decay, "seed": self._rng}
        #: the three experts' mini-simulations: which keys they see, what they hit since the last judging
        self.mini = _MiniSims(capacity_bytes, float(sample_rate), auto_rate, self._rng, self, knobs, min_nodes=self.MIN_MINI_CAPACITY)
        self._executing = self.EXPERTS.index(expert) if expert else 0
        self.evictions_by_expert = [0, 0, 0]
        self.scores = [0.0, 0.0, 0.0]  # each mini-simulation's hits, decayed a window
        self._since_judge = 0  # requests since the last judging
        self._admitted_root: Any = _NONE

    # the mini-simulations' figures, as this policy's (what the kernels and the reports read)
    seed = property(lambda self: self.mini.seed, doc="the seed of the sampled keys (the policy's own)")
    sample_rate = property(lambda self: self.mini.sample_rate, doc="the share of the keys the mini-simulations replay")
    mini_capacity_bytes = property(lambda self: self.mini.capacity_bytes, doc="each mini-simulation's capacity")
    mini_sims = property(lambda self: self.mini.sims, doc="the three mini-simulations, in EXPERTS order")
    mini_hits = property(lambda self: self.mini.hits, doc="bytes each mini-simulation hit")
    mini_refs = property(lambda self: self.mini.refs, doc="references the mini-simulations replayed")
    mini_ref_bytes = property(lambda self: self.mini.ref_bytes, doc="bytes the mini-simulations replayed")

    @property
    def leader(self) -> str:
        """The expert evicting now: the pinned one, else the one whose mini-simulation led at the last window."""
        return self.EXPERTS[self._executing]

    def is_sampled(self, key: Hashable) -> bool:
        """Does the mini-simulation see ``key``? (:func:`~kvpolicy.eviction.kernels.sampled_ids` for a range of int ids.)"""
        return self.mini.is_sampled(key)

    @staticmethod
    def judge_stats(evictions_by_expert: list[int], mini_hits: list[int], mini_refs: int, mini_ref_bytes: int | None = None) -> dict:
        """``mini_hits``: bytes hit per mini-simulation; ``mini_ref_bytes``: bytes referenced (default ``mini_refs``:
        unit-size blocks, as the kernel replays them)."""
        ex = AdaptivePolicy.EXPERTS
        denom = mini_refs if mini_ref_bytes is None else mini_ref_bytes
        return {"evictions_by_expert": dict(zip(ex, evictions_by_expert)),
                "mini_sim_hit_ratio": dict(zip(ex, [h / denom if denom else 0.0 for h in mini_hits])), "mini_sim_references": mini_refs}

    def stats(self) -> dict:
        """Evictions per expert, each mini-simulation's hit ratio (bytes hit over bytes referenced) and how many
        references it replayed."""
        self._flush()
        m = self.mini
        return self.judge_stats(self.evictions_by_expert, m.hits, m.refs, m.ref_bytes)

    # ------------------------------------------------------------------ the mini-simulations

    def _begin(self) -> None:
        """A request begins: the last one's sampled blocks go to the mini-simulations. If this request will recompute
        the densities (its root's tick) — or, until they are first computed, every ``interval`` requests — the
        mini-simulations' hits since the last time are scored first (they ranked by the densities those requests
        saw), the scores decay by ``decay``, as the histograms do, and the expert with the highest score evicts from
        now on."""
        self._flush()
        if (self._since_requests + 1 >= self.interval and self._since_events >= N_CLASSES * self.bins) or (
                not self.learned and self._since_judge + 1 >= self.interval):
            self._since_judge = 0
            if self.mini.auto_rate and self.nodes:
                self.mini.fit_rate(self.used_bytes / len(self.nodes))
            window = self.mini.take_window()
            for q in range(3):
                self.scores[q] = self.scores[q] * self.decay + window[q]
            if self.expert is None:
                lead = self._executing
                for q in range(3):
                    if self.scores[q] > self.scores[lead]:  # ties keep the current leader
                        lead = q
                self._executing = lead
        self._since_judge += 1

    def _flush(self) -> None:
        self.mini.flush(canonical=self.requests_from_engine)

    def _observe(self, node: Node) -> None:
        """A sampled block's use or insertion goes to the mini-simulations (:meth:`_MiniSims.observe`)."""
        self.mini.observe(node, self.clock)

    # ------------------------------------------------------------------ hooks

    def request_began(self) -> None:
        self._begin()  # the blocks sampled since the last one go to the mini-simulations as one request; the judge's turn
        super().request_began()

    def admit(self, key: Hashable, size: int, parent: Hashable | None = None) -> bool:
        if parent is None and not self.requests_from_engine:  # a request begins with its root's insertion: before anything is evicted for it
            self._begin()
            self._admitted_root = key
        return True

    def _hit(self, node: Node) -> None:
        if self._begins_request(node):
            self._begin()
            self._admitted_root = _NONE
        super()._hit(node)
        self._observe(node)

    def _admit(self, node: Node) -> None:
        if self._begins_request(node):
            if self._admitted_root == node.key:  # begun by admit() just before
                self._admitted_root = _NONE
            else:
                self._begin()
        super()._admit(node)
        self._observe(node)

    def _choose(self) -> Node:
        self.evictions_by_expert[self._executing] += 1
        return super()._choose()


class _MiniSims:
    """The three experts' miniature simulations of an :class:`AdaptivePolicy`: which keys they see (a fixed
    pseudo-random ``sample_rate`` of them), the blocks of the request being gathered, and the hits each scored since
    the last judging. It decides nothing: the policy judges the scores."""

    def __init__(self, capacity_bytes: int, sample_rate: float, auto_rate: bool, seed: int, teacher: HitDensityPolicy,
                 knobs: dict[str, Any], *, min_nodes: int) -> None:
        self.auto_rate = auto_rate  # raised at each judging (the rate was not given)
        self.min_nodes = min_nodes  # nodes of the mean resident size a mini-simulation holds at least (fit_rate)
        self.sample_rate = sample_rate
        self.seed = seed
        self.bound = int(sample_rate * 2**64)
        self._judged_capacity_bytes = capacity_bytes  # kept: an engine's mirror raises capacity_bytes (never evicts itself)
        self.capacity_bytes = round(capacity_bytes * sample_rate)
        self.sims = [_MiniSim(self.capacity_bytes, teacher, q, clock=ManualClock(), **knobs) for q in range(3)]
        self.hits = [0, 0, 0]
        self.refs = 0
        self.ref_bytes = 0
        self._window_hits = [0, 0, 0]
        # this request's sampled blocks, as the mini-simulations replay them: (key, size, its nearest sampled ancestor, time)
        self._pending: list[tuple[Hashable, int, Hashable | None, float]] = []
        self._pending_set: set[Hashable] = set()

    def is_sampled(self, key: Hashable) -> bool:
        return self.bound >= 2**64 or splitmix64(key_bits(key) ^ self.seed)[1] < self.bound

    def take_window(self) -> list[int]:
        """The hits each mini-simulation scored since the last call."""
        out, self._window_hits = self._window_hits, [0, 0, 0]
        return out

    def fit_rate(self, mean_node_bytes: float) -> None:
        """Raise the sample rate so that a mini-simulation holds at least ``MIN_MINI_CAPACITY`` nodes of the mean
        resident size — the default's rule, counted in the cache's own nodes: an engine whose blocks are bytes, or whose
        nodes are runs of blocks (SGLang's radix tree), would otherwise leave a mini-simulation a handful of nodes and
        a judge of noise. Only raised (the sampled keys grow: every key sampled stays sampled), and only when the rate
        was not given."""
        want = min(1.0, self.min_nodes * mean_node_bytes / self._judged_capacity_bytes) if self._judged_capacity_bytes else 1.0
        if want <= self.sample_rate:
            return
        self.sample_rate = want
        self.bound = int(want * 2**64)
        self.capacity_bytes = round(self._judged_capacity_bytes * want)
        for sim in self.sims:
            sim.capacity_bytes = sim.ghost_window_bytes = self.capacity_bytes

    def flush(self, *, canonical: bool) -> None:
        """The gathered request goes to the mini-simulations (in an engine's order-free form when ``canonical``)."""
        if not self._pending:
            return
        if canonical:
            self._pending = self._canonical(self._pending)
        for q, sim in enumerate(self.sims):
            h = sim.replay_observed(self._pending)
            self._window_hits[q] += h
            self.hits[q] += h
        self.refs += len(self._pending)
        self.ref_bytes += sum(item[1] for item in self._pending)
        self._pending = []
        self._pending_set.clear()

    @staticmethod
    def _canonical(pending: list[tuple[Hashable, int, Hashable | None, float]]) -> list[tuple[Hashable, int, Hashable | None, float]]:
        """An engine's request as the mini-simulations replay it, in an order that does not depend on the order the
        engine showed its blocks (SGLang asks for its leaves in its set's order — the nodes' addresses): by time, a
        block never before its sampled parent, then by depth and key bits."""
        by_key = {item[0]: item for item in pending}
        order: dict[Hashable, tuple[float, int, int]] = {}

        for key in by_key:
            chain = []  # key and its unranked sampled ancestors in this request, deepest first (no recursion: chains run deep)
            k: Hashable | None = key
            while k in by_key and k not in order:
                chain.append(k)
                k = by_key[k][2]
            above = order.get(k) if k in by_key else None
            for k in reversed(chain):
                t = by_key[k][3]
                above = (t, 0, key_bits(k)) if above is None else (max(t, above[0]), above[1] + 1, key_bits(k))
                order[k] = above
        return sorted(pending, key=lambda item: order[item[0]])

    def observe(self, node: Node, clock: Any) -> None:
        """A sampled block's use or insertion goes to the mini-simulations, under its nearest sampled ancestor: the
        sampled block before it when kvpolicy replays a request in order, and still the right parent when an engine
        shows its blocks out of order (SGLang's radix tree, through the strategy's mirror)."""
        if node.key in self._pending_set or not self.is_sampled(node.key):  # an engine may use a block twice in a request
            return
        p = node.parent
        while p is not None and not self.is_sampled(p.key):
            p = p.parent
        self._pending_set.add(node.key)
        self._pending.append((node.key, node.size, None if p is None else p.key, clock.now_s()))


class _MiniSim(HitDensityPolicy):
    """One expert's miniature simulation: a hit-density cache that evicts by ``expert`` and learns nothing — hit
    density ranks by the real cache's densities (``teacher``), learned on every reference, not on the sample."""

    def __init__(self, capacity_bytes: int, teacher: HitDensityPolicy, expert: int, **kw: Any) -> None:
        super().__init__(capacity_bytes, **kw)
        self._teacher = teacher
        self._executing = expert

    def rank(self, node: Node, now_s: float) -> float:
        return self._teacher.rank(node, now_s)

    def replay_observed(self, observed: list[tuple[Hashable, int, Hashable | None, float]]) -> int:
        """One request of sampled blocks, each ``(key, size, parent, time)`` with ``parent`` its nearest sampled
        ancestor: a resident block is a hit, a missing one is inserted under its parent when the parent is resident
        (the prefix rule; otherwise it is left out); the request's blocks stay pinned until its end. Returns the bytes
        hit: a hit serves the whole block, and a node of an engine's tree may hold many."""
        nodes, clock = self.nodes, self.clock
        hit_bytes = 0
        pinned: list[Hashable] = []
        for key, size, parent, t in observed:
            clock._now_s = t  # type: ignore[attr-defined]  # the event's own time (an engine's may run out of order)
            if key in nodes:
                self.on_access(key)
                hit_bytes += size
            elif (parent is None or parent in nodes) and self.admit(key, size, parent):
                if parent is not None:  # not evicted to make room for its child (it may not be this request's)
                    self.pin(parent)
                    pinned.append(parent)
                try:
                    self.victims(size, incoming=key)
                except CapacityError:  # everything left is pinned by this request
                    continue
                self.on_insert(key, size, parent)
            else:
                continue
            self.pin(key)
            pinned.append(key)
        for key in pinned:
            self.unpin(key)
        return hit_bytes

    def _event(self, hist: np.ndarray, cls: int, age_s: float) -> tuple[int, float]:
        return 0, 0.0

    def reconfigure(self) -> None:
        pass


_NONE = object()
