"""A write must beat its victim: TinyLFU admission in front of any bounded tier.

In a full pool every write displaces a block, and the re-reads that block would
have served are lost (the brief's P_eviction). A publish filter that prices only
the write's link time sees a free write on an idle link and publishes
everything; the pool then thrashes. :class:`WriteAdmission` asks the tier's own
eviction policy which block a write would displace (``peek_victims``, the
seam every kvpolicy :class:`~kvpolicy.eviction.base.EvictionPolicy` has) and
admits the write only when the candidate is worth more than that victim, both
valued by the same estimator::

    admit(candidate) ⇔ victim is None  or  f̂(candidate) > f̂(victim)

f̂ is a frequency sketch of **distinct requests** that contained each block
(every request is observed, whether or not it publishes): a Count-Min sketch of
4-bit counters (cap 15) that halves every counter after ``sample_size``
sightings, ``sample_size`` = 10 × the tier's capacity in blocks by default —
TinyLFU's "reset", W/C = 10 (Einziger, Friedman, Manes, *TinyLFU: A Highly
Efficient Cache Admission Policy*, ACM TOS 2017; Caffeine's default), a figure
of the tier, not of a trace. Ties are refused, so a pool full of blocks seen
once since the last reset is not flushed by more of them (a scan, a stream of
one-hit unique tails), while a block seen once more than its victim gets in;
after a reset old counts have halved and new blocks win again.

``admit_run`` applies it to a prefix-closed write: candidate j against the j-th
victim in eviction order (a block that fits without eviction passes); the run
stops at the first refusal — a block is useless remotely without its prefix.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ._mix import _M64, fmix64, key_bits, splitmix64_next
from ._validate import check_non_negative_int, check_positive_int
from .errors import ConfigError
from .publish import _Dedup

COUNTER_MAX = 15


@runtime_checkable
class VictimPeek(Protocol):
    """A bounded tier that can name what a write would displace (every kvpolicy EvictionPolicy)."""

    def peek_victims(self, need_bytes: int) -> list[Hashable] | None: ...


class FrequencySketch:
    """TinyLFU's sketch: ``depth`` rows of ``width`` 4-bit counters (held in uint8), min over rows, halved every
    ``sample_size`` additions. Estimates never undercount a key's additions since the last reset (halved at each)."""

    def __init__(self, *, width: int, depth: int = 4, sample_size: int, seed: int = 0) -> None:
        check_positive_int("width", width)
        check_positive_int("depth", depth)
        if width > 1 << 28 or depth > 16:
            raise ConfigError("width" if width > 1 << 28 else "depth", f"width at most 2**28 and depth at most 16, got {width!r} x {depth!r}")
        check_positive_int("sample_size", sample_size)
        check_non_negative_int("seed", seed)
        self.width, self.depth, self.sample_size = width, depth, sample_size
        self._rows = np.zeros((depth, width), dtype=np.uint8)
        self._seed = (seed * 0x9E3779B97F4A7C15) & _M64
        self.additions = 0
        self.resets = 0

    def _columns(self, key: Hashable) -> list[int]:
        h1 = splitmix64_next(key_bits(key) ^ self._seed)[1]
        h2 = fmix64(h1) | 1
        w = self.width
        return [(h1 + i * h2) % w for i in range(self.depth)]

    def add(self, key: Hashable) -> None:
        rows = self._rows
        for i, c in enumerate(self._columns(key)):
            if rows[i, c] < COUNTER_MAX:
                rows[i, c] += 1
        self.additions += 1
        if self.additions >= self.sample_size:
            self._rows >>= 1  # the reset: every count halves, so the sketch follows what is popular now
            self.additions = 0
            self.resets += 1

    def estimate(self, key: Hashable) -> int:
        rows = self._rows
        return int(min(rows[i, c] for i, c in enumerate(self._columns(key))))


class WriteAdmission:
    """TinyLFU in front of a bounded tier: a write is admitted only when it beats the block it would displace.

    ``capacity_blocks``: the tier's size in blocks (sets the sketch: width = the next power of two ≥ 4 × capacity,
    at least 1024; sample_size = 10 × capacity unless given). Call :meth:`observe` for every request (its blocks, once
    per request), then :meth:`admit` / :meth:`admit_run` with the victims the tier's ``peek_victims`` names."""

    name = "tinylfu"

    def __init__(self, *, capacity_blocks: int, sample_size: int | None = None, depth: int = 4, seed: int = 0) -> None:
        check_positive_int("capacity_blocks", capacity_blocks)
        if sample_size is None:
            sample_size = 10 * capacity_blocks
        width = max(1024, 1 << (4 * capacity_blocks - 1).bit_length())
        self.capacity_blocks = capacity_blocks
        self.sketch = FrequencySketch(width=min(width, 1 << 28), depth=depth, sample_size=sample_size, seed=seed)
        self._seen = _Dedup(size=4096)  # request ids observed (the newest 4,096): each counted once
        self.admitted = 0
        self.refused = 0

    def observe(self, request_id: Hashable, keys: Sequence[Hashable]) -> None:
        """Count each distinct key of one request once (a repeated call for the same request counts nothing)."""
        if not self._seen.first(request_id):
            return
        for key in dict.fromkeys(keys):
            self.sketch.add(key)

    def value(self, key: Hashable) -> int:
        """The estimate both sides are compared by: distinct requests seen with this block since the last resets."""
        return self.sketch.estimate(key)

    def admit(self, candidate: Hashable, victim: Hashable | None) -> bool:
        """Whether ``candidate`` may displace ``victim`` (None: it fits without displacing anything)."""
        ok = victim is None or self.value(candidate) > self.value(victim)
        if ok:
            self.admitted += 1
        else:
            self.refused += 1
        return ok

    def admit_run(self, candidates: Sequence[Hashable], victims: Sequence[Hashable] | None, free_blocks: int = 0) -> int:
        """How many leading ``candidates`` to write: the first ``free_blocks`` fit; then candidate j meets the next
        victim in eviction order; the run stops at the first refusal (prefix-closed). ``victims`` None: the tier
        cannot name them — every candidate is admitted (the tier's own policy decides, as without a gate)."""
        check_non_negative_int("free_blocks", free_blocks)
        if victims is None:
            self.admitted += len(candidates)
            return len(candidates)
        for j, key in enumerate(candidates):
            v = j - free_blocks
            victim = victims[v] if 0 <= v < len(victims) else None
            if v >= len(victims):  # fewer victims than needed: the tier cannot take more (pinned blocks)
                self.refused += 1
                return j
            if not self.admit(key, victim):
                return j
        return len(candidates)


def gate(tier: Any, admission: WriteAdmission, candidates: Sequence[Hashable], block_bytes: int) -> int:
    """The leading run of ``candidates`` (each ``block_bytes``, none resident) the tier should take: its victims for the
    whole run, peeked, then :meth:`WriteAdmission.admit_run`. A tier without ``peek_victims`` admits everything."""
    n = len(candidates)
    if n == 0:
        return 0
    peek = getattr(tier, "peek_victims", None)
    if peek is None:
        return admission.admit_run(candidates, None)
    victims = peek(n * block_bytes)
    if victims is None:
        return admission.admit_run(candidates, None)
    free = max(int((tier.capacity_bytes - tier.used_bytes) // block_bytes), 0) if hasattr(tier, "capacity_bytes") else 0
    return admission.admit_run(candidates, victims, free_blocks=min(free, n))
