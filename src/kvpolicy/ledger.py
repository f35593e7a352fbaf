"""The ledger: every request's outcome by cause, four latency distributions, byte flows.

**Outcomes.** Each request lands in exactly one request category —
``local_hit`` (every matchable block served locally), ``remote_hit`` (every
matchable block served, some remotely), ``partial_hit`` (some reuse, then a miss)
or ``miss`` (no reuse) — and its prompt tokens are split, exactly, into:

| token category | meaning |
|---|---|
| ``local_hit`` / ``remote_hit`` | served from the local cache / loaded from a remote tier |
| ``miss_never_published`` | the block had not been in any shared tier when the request arrived |
| ``miss_evicted`` | it was published, then evicted (tier and age kept) — or it is still listed resident but an evicted block before it ended the prefix run (``stranded_blocks``) |
| ``miss_incompatible`` / ``miss_transfer_error`` / ``miss_timeout`` | found but not loaded |
| ``miss_declined`` | found, but admission judged the load slower than recompute (or a guard rail refused) |
| ``split_recompute`` | found, and recomputed on purpose while the rest of the range loaded (compute while loading: the plan's split) |
| ``tail`` | the partial last block and the last token: always recomputed |

so the categories add up to the requests, the tokens and the bytes recorded. A
prefill→decode handoff is not reuse and is never recorded here as a hit.

**Publication log.** ``published(key)`` / ``evicted(key)`` record what the shared
tier held; a missing block is classified as evicted if its key was published
before. The exact table keeps the newest ``max_exact_keys`` keys; keys dropped
from it live on in a Bloom filter (``bloom_bits``, 4 hashes from BLAKE2b of the
whole key: keys need not be uniform — a tenant prefix shared by all of them
must not put them on the same bits). While nothing has been dropped the
classification is exact. After that, a never-published block is reported as
evicted with the filter's false-positive rate, ≈ (1 − e^(−4n/m))^4 for n dropped
keys in m bits (≈ 0.24 % at n = m/16); a published block is never reported as
never-published; ages are known only for keys still in the exact table.
Publishing is prefix-closed (a block is published only with its whole prefix),
so once one missing block of a request is never-published, so is every block
after it: classification costs one lookup per evicted block plus one.

**Distributions.** Cold prefill, local hit, remote hit and fallback recompute
(a load was attempted and failed or timed out): TTFT and component times, with
p50/p95/p99.

**Byte flows.** ``R_read`` (remote bytes loaded), ``R_write`` (bytes published),
``R_replica`` (replication traffic) and their total, over the whole run and over
the worst sliding window (15 minutes by default).

**Expected benefit per request class i**::

    E[benefit_i] = h_remote_i × (T_recompute_i − T_remote_i) − P_stall_i − P_write_i − P_eviction_i
    E[benefit]   = Σ_i λ_i × E[benefit_i]

from the ledger's own observations: ``h_remote_i`` the share of class-i requests
with a remote hit; ``T_recompute_i − T_remote_i`` the mean of (predicted recompute
− observed load) over them; ``P_stall_i`` from observed stalls; ``P_write_i`` =
Σ over writes never re-read of bytes × congestion × ``write_cost_s_per_byte``
(congestion ρ/(1 − ρ), the write path's shadow price when it was written —
``record_write``; 1 when unknown); ``P_eviction_i`` =
evicted-miss tokens × ``eviction_cost_s_per_token``. A term without data (or
without its cost coefficient) is reported as unknown (``None``) — never as 0 —
and then so is the sum.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from collections.abc import Hashable
from typing import Any, Literal

import attrs
import numpy as np

from .admission.histogram import LogHistogram
from ._validate import check_non_negative_number, check_positive_int, check_real
from .errors import ConfigError
from .prices import gpu_price, mean_gpu_price

REQUEST_CATEGORIES = ("local_hit", "remote_hit", "partial_hit", "miss")
TOKEN_CATEGORIES = (
    "local_hit", "remote_hit", "miss_never_published", "miss_evicted", "miss_incompatible",
    "miss_transfer_error", "miss_timeout", "miss_declined", "split_recompute", "tail",
)
DISTRIBUTIONS = ("cold_prefill", "local_hit", "remote_hit", "fallback_recompute")
NotLoaded = Literal["declined", "incompatible", "transfer_error", "timeout"]
NOT_LOADED_REASONS = ("declined", "incompatible", "transfer_error", "timeout")


@attrs.frozen
class RequestRecord:
    """One finished request, as the engine (or simulator) saw it."""

    prompt_tokens: int
    block_size_tokens: int
    local_blocks: int = 0
    remote_loaded_blocks: int = 0
    #: blocks found remotely but not used, and why
    remote_not_loaded_blocks: int = 0
    not_loaded_reason: NotLoaded | None = None
    #: keys of the blocks after the reused run (up to the matchable limit), to classify never-published vs evicted
    missing_keys: tuple[bytes, ...] = ()
    request_class: str = "default"
    arrival_s: float = 0.0
    ttft_s: float | None = None
    prefill_s: float | None = None
    load_s: float | None = None
    queue_s: float | None = None
    predicted_recompute_s: float | None = None  # of the blocks that were loaded (from the Decision)
    load_attempted: bool = False
    stall_s: float | None = None
    #: blocks found remotely and recomputed while the rest of the range loaded (the plan's split)
    split_blocks: int = 0
    #: the replica's prefill utilisation (0..1) when the request ran: the GPU seconds it saved or lost are priced
    #: 1/(1 − ρ) seconds of latency each (the queue they shorten or lengthen); None: unknown (1)
    prefill_utilisation: float | None = None
    #: the utilisation the replica would have measured had it recomputed what it loaded (its scheduler adds the
    #: predicted GPU seconds of its remote hits to its busy time, over the same window; may pass 1: demand beyond its
    #: slots). Given, a saved second is priced at the mean price between the two (the latency the hits bought, not
    #: the last second's worth); None: at ``prefill_utilisation``'s
    prefill_utilisation_without_hits: float | None = None

    def __attrs_post_init__(self) -> None:
        # types first: a NaN count passed every comparison below and reached the ledger's token sums (plain ints, the
        # common case, pass in one test)
        if not (type(self.prompt_tokens) is int and type(self.block_size_tokens) is int and type(self.local_blocks) is int
                and type(self.remote_loaded_blocks) is int and type(self.remote_not_loaded_blocks) is int and type(self.split_blocks) is int):
            for name in ("prompt_tokens", "block_size_tokens", "local_blocks", "remote_loaded_blocks", "remote_not_loaded_blocks", "split_blocks"):
                v = getattr(self, name)
                if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                    raise ConfigError(name, f"must be an int, got {v!r}")
        if not isinstance(self.request_class, str):
            raise ConfigError("request_class", f"must be a string, got {self.request_class!r}")
        a = self.arrival_s
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not math.isfinite(a):
            raise ConfigError("arrival_s", f"must be a finite number of seconds, got {a!r}")
        if not isinstance(self.load_attempted, (bool, np.bool_)):
            raise ConfigError("load_attempted", f"must be True or False, got {self.load_attempted!r}")
        if not isinstance(self.missing_keys, (tuple, list)):
            raise ConfigError("missing_keys", f"must be a tuple of block keys, got {type(self.missing_keys).__name__}")
        B = self.block_size_tokens
        if B <= 0 or self.prompt_tokens < 0:
            raise ConfigError("prompt_tokens", "prompt_tokens must be >= 0 and block_size_tokens > 0")
        matchable = max(self.prompt_tokens - 1, 0) // B
        used = self.local_blocks + self.remote_loaded_blocks + self.remote_not_loaded_blocks + self.split_blocks
        if min(self.local_blocks, self.remote_loaded_blocks, self.remote_not_loaded_blocks, self.split_blocks) < 0 or used > matchable:
            raise ConfigError("local_blocks", f"local + remote blocks ({used}) exceed the {matchable} matchable blocks of a {self.prompt_tokens}-token prompt")
        if len(self.missing_keys) > matchable - used:
            raise ConfigError("missing_keys", f"{len(self.missing_keys)} keys for {matchable - used} unmatched blocks")
        if self.remote_not_loaded_blocks and self.not_loaded_reason is None:
            raise ConfigError("not_loaded_reason", "required when remote_not_loaded_blocks > 0")
        if self.not_loaded_reason is not None and self.not_loaded_reason not in NOT_LOADED_REASONS:
            raise ConfigError("not_loaded_reason", f"must be one of {NOT_LOADED_REASONS}, got {self.not_loaded_reason!r}")
        u = self.prefill_utilisation
        if u is not None and (isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 <= u <= 1):
            raise ConfigError("prefill_utilisation", f"must be in [0, 1] or None, got {u!r}")
        uw = self.prefill_utilisation_without_hits
        if uw is not None:
            if isinstance(uw, bool) or not isinstance(uw, (int, float)) or not math.isfinite(uw) or uw < 0:
                raise ConfigError("prefill_utilisation_without_hits", f"must be a finite number >= 0 or None, got {uw!r}")
            if u is None:
                raise ConfigError("prefill_utilisation_without_hits", "needs prefill_utilisation (the utilisation it is the counterfactual of)")
        for name in ("ttft_s", "prefill_s", "load_s", "queue_s", "predicted_recompute_s", "stall_s"):
            v = getattr(self, name)
            if v is None or type(v) is float and 0.0 <= v < math.inf:  # (a NaN fails the comparison)
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ConfigError(name, f"must be a finite non-negative number of seconds or None, got {v!r}")


def _check_flow(t_s: float, size_bytes: float) -> None:
    if type(t_s) is float and type(size_bytes) in (int, float) and 0.0 <= t_s < math.inf and 0 <= size_bytes < math.inf:
        return  # plain finite non-negative numbers (a NaN fails both comparisons): the common case, without the loop
    for name, v in (("t_s", t_s), ("size_bytes", size_bytes)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ConfigError(name, f"must be a finite non-negative number, got {v!r}")


def _key_bytes(key: Hashable) -> bytes:
    """A block key's bytes for the Bloom filter: bytes as they are, an int (a 64-bit block hash, the simulator's
    block ids) as its signed 16-byte form — ``bytes(n)`` would be n zero bytes, a MemoryError for a 64-bit hash — a
    str as UTF-8, anything else by its repr."""
    if isinstance(key, (bytes, bytearray, memoryview)):
        return bytes(key)
    if isinstance(key, int):
        return key.to_bytes(16, "little", signed=True) if -(1 << 127) <= key < 1 << 127 else repr(key).encode()
    if isinstance(key, str):
        return key.encode()
    return repr(key).encode()


class PublicationLog:
    """What the shared tier held: exact recent keys + a Bloom filter of older ones."""

    def __init__(self, max_exact_keys: int = 1_000_000, bloom_bits: int = 1 << 24) -> None:
        check_positive_int("max_exact_keys", max_exact_keys)
        if isinstance(bloom_bits, bool) or not isinstance(bloom_bits, int) or bloom_bits < 64:
            raise ConfigError("bloom_bits", f"must be an int >= 64, got {bloom_bits!r}")
        self.max_exact_keys = max_exact_keys
        self._exact: dict[Hashable, tuple[str, float, float | None]] = {}  # key → (tier, first published_s, evicted_s)
        self.dropped_keys = 0
        self._bits = bytearray((bloom_bits + 7) // 8)
        self._m = bloom_bits
        self.bytes_written_by_class: dict[str, float] = {}
        # the newest max_exact_keys writes (key -> class, bytes), oldest first, and which of them were read; a write
        # that falls out unread is settled as unread bytes of its class (a read after that is not seen)
        self._written: OrderedDict[Hashable, tuple[str, float, float]] = OrderedDict()
        self._reads: set[Hashable] = set()
        self._unread_settled: dict[str, float] = {}
        #: the same, in priced bytes (bytes x the congestion of the path when written: Ledger.record_write)
        self._unread_priced_settled: dict[str, float] = {}

    def _positions(self, key: Hashable) -> tuple[int, int, int, int]:
        # BLAKE2b of the whole key: a key's first bytes need not be random (a tenant or model prefix shared by every
        # key would put them all on the same four bits)
        x = int.from_bytes(hashlib.blake2b(_key_bytes(key), digest_size=16).digest(), "little")
        m = self._m
        return (x & 0xFFFFFFFF) % m, (x >> 32 & 0xFFFFFFFF) % m, (x >> 64 & 0xFFFFFFFF) % m, (x >> 96) % m

    def _bloom_add(self, key: Hashable) -> None:
        bits = self._bits
        for p in self._positions(key):
            bits[p >> 3] |= 1 << (p & 7)

    def _bloom_has(self, key: Hashable) -> bool:
        bits = self._bits
        a, b, c, d = self._positions(key)
        return bool(bits[a >> 3] >> (a & 7) & bits[b >> 3] >> (b & 7) & bits[c >> 3] >> (c & 7) & bits[d >> 3] >> (d & 7) & 1)

    def published(self, key: Hashable, tier: str = "pool", t_s: float = 0.0, size_bytes: float = 0.0, request_class: str = "default",
                  priced_bytes: float | None = None) -> None:
        """``priced_bytes``: what the write costs in bytes of an idle path's time (default ``size_bytes``; see
        :meth:`Ledger.record_write`)."""
        _check_flow(t_s, size_bytes)  # a NaN size made the class's written bytes NaN; a NaN time, every later miss's class
        old = self._exact.pop(key, None)
        self._exact[key] = (tier, t_s if old is None else min(old[1], t_s), None)  # a re-publication keeps the first time
        if size_bytes:
            priced = size_bytes if priced_bytes is None else priced_bytes
            self.bytes_written_by_class[request_class] = self.bytes_written_by_class.get(request_class, 0.0) + size_bytes
            prev = self._written.pop(key, None)
            if prev is not None and key not in self._reads:  # written again before anyone read the first copy
                self._settle(prev)
            self._reads.discard(key)
            self._written[key] = (request_class, size_bytes, priced)
            while len(self._written) > self.max_exact_keys:
                k, w = self._written.popitem(last=False)
                if k in self._reads:
                    self._reads.discard(k)
                else:
                    self._settle(w)
        while len(self._exact) > self.max_exact_keys:
            oldest = next(iter(self._exact))
            del self._exact[oldest]
            self._bloom_add(oldest)
            self.dropped_keys += 1

    def evicted(self, key: Hashable, t_s: float = 0.0) -> None:
        _check_flow(t_s, 0.0)
        e = self._exact.get(key)
        if e is not None:
            self._exact[key] = (e[0], e[1], t_s)

    def read(self, key: Hashable) -> None:
        if key in self._written:  # only the writes still held need their reads: the set stays bounded with them
            self._reads.add(key)

    def classify(self, key: Hashable, now_s: float) -> tuple[str, str | None, float | None]:
        """("never_published" | "evicted" | "resident", tier, age_s since eviction), as of ``now_s``: a block
        first published after it had not been published yet."""
        check_non_negative_number("now_s", now_s)
        e = self._exact.get(key)
        if e is not None:
            tier, first_s, ev = e
            if first_s > now_s:
                return "never_published", None, None
            if ev is None:
                return "resident", tier, None
            return "evicted", tier, max(now_s - ev, 0.0)  # 0 when the log only knows a re-eviction after now_s
        if self.dropped_keys and self._bloom_has(key):
            return "evicted", None, None
        return "never_published", None, None

    def _settle(self, w: tuple[str, float, float]) -> None:
        cls, size, priced = w
        self._unread_settled[cls] = self._unread_settled.get(cls, 0.0) + size
        self._unread_priced_settled[cls] = self._unread_priced_settled.get(cls, 0.0) + priced

    def unread_write_bytes(self, priced: bool = False) -> dict[str, float]:
        """Bytes written and never read, per request class: the writes still held that no read has named, plus those
        that fell out of the newest ``max_exact_keys`` (or were overwritten) unread. ``priced``: each write's priced
        bytes instead (its bytes x the congestion of its path when it was written)."""
        out: dict[str, float] = dict(self._unread_priced_settled if priced else self._unread_settled)
        for key, (cls, size, priced_bytes) in self._written.items():
            if key not in self._reads:
                out[cls] = out.get(cls, 0.0) + (priced_bytes if priced else size)
        return out


class _Flow:
    """Bytes of one flow as (time, bytes) events; the total and the worst window.

    Memory stays bounded: past ``MAX_EVENTS`` kept events, every window that starts more than ``lag_s`` + one window
    before the newest event is settled — its bytes summed with every event still held, the largest kept — and the
    events before it are dropped. Exact while records arrive less than ``lag_s`` late (a record's time is its
    request's arrival, written when it finishes); a later one still counts in the total, and in the windows that
    start at or after the oldest event kept."""

    MAX_EVENTS = 1 << 20
    LAG_S = 3600.0

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.t: list[float] = []
        self.b: list[float] = []
        self._total = 0.0
        self._settled = 0.0  # the largest window sum among windows already settled
        self._dropped = 0  # events dropped after their windows were settled
        self._limit = self.MAX_EVENTS

    def add(self, t_s: float, amount: float) -> None:
        self.t.append(t_s)
        self.b.append(amount)
        self._total += amount
        if len(self.t) > self._limit:
            self._compact()

    def _sorted(self) -> tuple[np.ndarray, np.ndarray]:
        tt = np.asarray(self.t, dtype=np.float64)
        bb = np.asarray(self.b, dtype=np.float64)
        order = np.argsort(tt, kind="stable")
        return tt[order], bb[order]

    def _compact(self) -> None:
        tt, bb = self._sorted()
        k = int(np.searchsorted(tt, tt[-1] - self.LAG_S - self.window_s, side="left"))
        if k:
            c = np.concatenate([[0.0], np.cumsum(bb)])
            end = np.searchsorted(tt, tt[:k] + self.window_s, side="left")
            self._settled = max(self._settled, float(np.max(c[end] - c[:k])))
            self._dropped += k
        self.t, self.b = tt[k:].tolist(), bb[k:].tolist()
        self._limit = max(self.MAX_EVENTS, 2 * len(self.t))  # amortised: the next pass waits for as many new events

    def clear(self) -> None:
        self.t, self.b = [], []
        self._total = self._settled = 0.0
        self._dropped = 0
        self._limit = self.MAX_EVENTS

    @property
    def total(self) -> float:
        return self._total

    def peak_bytes_per_s(self) -> float:
        """Worst window [t_i, t_i + window) of Σ bytes / window."""
        if not self.t:
            return self._settled / self.window_s
        tt, bb = self._sorted()
        c = np.concatenate([[0.0], np.cumsum(bb)])
        end = np.searchsorted(tt, tt + self.window_s, side="left")
        return max(self._settled, float(np.max(c[end] - c[: tt.size]))) / self.window_s


class _Dist:
    """TTFT and component times of one distribution, buffered then folded."""

    FIELDS = ("ttft_s", "prefill_s", "load_s", "queue_s")

    def __init__(self) -> None:
        self.hists = {f: LogHistogram() for f in self.FIELDS}
        self.buf: dict[str, list[float]] = {f: [] for f in self.FIELDS}

    def add(self, field: str, v: float) -> None:
        b = self.buf[field]
        b.append(v)
        if len(b) >= 65536:
            self.flush()

    def flush(self) -> None:
        for f, b in self.buf.items():
            if b:
                self.hists[f].record_many(b)
                b.clear()

    def summary(self) -> dict[str, Any]:
        self.flush()
        return {f: h.summary() for f, h in self.hists.items()}


class Ledger:
    def __init__(self, bytes_per_token: int, *, window_s: float = 900.0, publication_log: PublicationLog | None = None,
                 write_cost_s_per_byte: float | None = None, eviction_cost_s_per_token: float | None = None,
                 judge_from_s: float | None = None) -> None:
        """``judge_from_s``: a held-out split — requests that arrive before it, and bytes written or replicated before
        it, are not counted (earlier writes still tell a later miss "evicted" from "never published")."""
        if isinstance(bytes_per_token, bool) or not isinstance(bytes_per_token, int) or bytes_per_token <= 0:
            raise ConfigError("bytes_per_token", f"must be a positive int, got {bytes_per_token!r}")
        if isinstance(window_s, bool) or not isinstance(window_s, (int, float)) or not 0 < window_s < math.inf:
            raise ConfigError("window_s", f"must be a positive number of seconds, got {window_s!r}")
        for name, v in (("write_cost_s_per_byte", write_cost_s_per_byte), ("eviction_cost_s_per_token", eviction_cost_s_per_token)):
            if v is not None:  # None: unknown, and E[benefit] says so; a NaN made it NaN without a word
                check_non_negative_number(name, v)
        if judge_from_s is not None:
            check_real("judge_from_s", judge_from_s, negative_ok=True)
        self.judge_from_s = judge_from_s
        self.bytes_per_token = bytes_per_token
        self.pub = publication_log or PublicationLog()
        self.write_cost_s_per_byte = write_cost_s_per_byte
        self.eviction_cost_s_per_token = eviction_cost_s_per_token
        self.requests = {c: 0 for c in REQUEST_CATEGORIES}
        self.tokens = {c: 0 for c in TOKEN_CATEGORIES}
        self.evicted_by_tier: dict[str, int] = {}
        self.evicted_age_s = LogHistogram()
        #: blocks published before a request and still listed resident that it missed: past an evicted block the
        #: prefix run had ended (a pool sharding a chain across nodes), or a tier dropped them without telling the log
        self.stranded_blocks = 0
        self.dists = {d: _Dist() for d in DISTRIBUTIONS}
        self.flows = {k: _Flow(window_s) for k in ("read", "write", "replica")}
        self._all_flows = _Flow(window_s)  # every flow's events: the total's worst window
        self.window_s = window_s
        self._cls: dict[str, dict[str, Any]] = {}
        self._t_first: float | None = None
        self._t_last = 0.0
        self._n_buffered = 0

    # ---------------------------------------------------------------- record

    def _before(self, t_s: float) -> bool:
        return self.judge_from_s is not None and t_s < self.judge_from_s

    def record(self, r: RequestRecord) -> None:
        if self._before(r.arrival_s):
            return
        B = r.block_size_tokens
        T = r.prompt_tokens
        matchable = (T - 1) // B if T > 0 else 0
        tok = self.tokens
        local_b = r.local_blocks
        remote_b = r.remote_loaded_blocks
        not_loaded = r.remote_not_loaded_blocks
        tok["local_hit"] += local_b * B
        tok["remote_hit"] += remote_b * B
        if not_loaded:
            tok["miss_" + r.not_loaded_reason] += not_loaded * B  # type: ignore[operator]
        tok["split_recompute"] += r.split_blocks * B
        rest = matchable - local_b - remote_b - not_loaded - r.split_blocks
        evicted = 0
        if r.missing_keys:
            pub = self.pub
            exact = pub._exact
            for key in r.missing_keys:
                if not pub.dropped_keys and key not in exact:
                    break  # never published — and publishing is prefix-closed: nothing after it was either
                kind, tier, age = pub.classify(key, r.arrival_s)
                if kind == "never_published":
                    break
                evicted += 1
                if kind == "evicted":
                    tier = tier or "unknown"
                    self.evicted_by_tier[tier] = self.evicted_by_tier.get(tier, 0) + 1
                    if age is not None:
                        self.evicted_age_s.record(age)
                else:  # published before the request, still listed resident, yet past the end of its run
                    self.stranded_blocks += 1
            tok["miss_evicted"] += evicted * B
        tok["miss_never_published"] += (rest - evicted) * B
        tok["tail"] += T - matchable * B
        reused = local_b + remote_b
        if reused == 0:
            cat = "miss"
        elif reused == matchable:
            cat = "remote_hit" if remote_b else "local_hit"
        else:
            cat = "partial_hit"
        self.requests[cat] += 1
        if r.load_attempted and not_loaded and r.not_loaded_reason in ("transfer_error", "timeout"):
            dist = "fallback_recompute"
        elif remote_b:
            dist = "remote_hit"
        elif local_b:
            dist = "local_hit"
        else:
            dist = "cold_prefill"
        buf = self.dists[dist].buf
        if r.ttft_s is not None:
            buf["ttft_s"].append(r.ttft_s)
        if r.prefill_s is not None:
            buf["prefill_s"].append(r.prefill_s)
        if r.load_s is not None:
            buf["load_s"].append(r.load_s)
        if r.queue_s is not None:
            buf["queue_s"].append(r.queue_s)
        self._n_buffered += 1
        if self._n_buffered >= 65536:
            for x in self.dists.values():
                x.flush()
            self._n_buffered = 0
        c = self._cls.get(r.request_class)
        if c is None:
            c = self._cls[r.request_class] = {"requests": 0, "remote_hits": 0, "saved_s": 0.0, "saved_n": 0, "stall_s": 0.0, "stall_n": 0,
                                              "evicted_tokens": 0, "evicted_priced": 0.0}
        c["requests"] += 1
        u = r.prefill_utilisation
        gpu = 1.0 if u is None else gpu_price(u)  # a GPU second's price: the queue it shortens (an eviction's loss: at the margin)
        if remote_b:
            c["remote_hits"] += 1
            if r.predicted_recompute_s is not None and r.load_s is not None:
                uw = r.prefill_utilisation_without_hits
                # what the hits bought: the mean price over the utilisations they moved the replica through
                saved_price = gpu if uw is None or u is None else mean_gpu_price(u, uw)
                c["saved_s"] += (r.predicted_recompute_s - r.load_s) * saved_price
                c["saved_n"] += 1
            self._flow("read", r.arrival_s, remote_b * B * self.bytes_per_token)
        if r.stall_s is not None:
            c["stall_s"] += r.stall_s
            c["stall_n"] += 1
        if evicted:
            c["evicted_tokens"] += evicted * B
            c["evicted_priced"] += evicted * B * gpu
        t = r.arrival_s
        if self._t_first is None:
            self._t_first = t
        if t > self._t_last:
            self._t_last = t

    def _time(self, t: float) -> None:
        if self._t_first is None:
            self._t_first = t
        self._t_last = max(self._t_last, t)

    def _flow(self, kind: str, t_s: float, nbytes: float) -> None:
        self.flows[kind].add(t_s, nbytes)
        self._all_flows.add(t_s, nbytes)

    def clear_flow(self, kind: str) -> None:
        """Forget one flow's bytes (a simulator's pre-filled pool, say), before any window was settled."""
        if kind not in self.flows:
            raise ConfigError("kind", f"must be one of {sorted(self.flows)}, got {kind!r}")
        if any(f._dropped for f in (*self.flows.values(), self._all_flows)):
            raise ConfigError("kind", "a flow can be cleared only before the ledger settled its old windows")
        self.flows[kind].clear()
        self._all_flows.clear()
        for f in self.flows.values():
            for t, nb in zip(f.t, f.b):
                self._all_flows.add(t, nb)

    def _flow_summary(self) -> dict[str, dict[str, float | None]]:
        span = (self._t_last - self._t_first) if self._t_first is not None else 0.0
        out: dict[str, dict[str, float | None]] = {}
        for k, f in (*self.flows.items(), ("total", self._all_flows)):
            out[k] = {"bytes": f.total, "mean_bytes_per_s": f.total / span if span > 0 else None, "peak_window_bytes_per_s": f.peak_bytes_per_s()}
        return out

    def record_write(self, key: Hashable, t_s: float, size_bytes: float, tier: str = "pool", request_class: str = "default",
                     congestion: float | None = None) -> None:
        """A block was published to a shared tier (the publication log checks ``t_s`` and ``size_bytes`` first).

        ``congestion``: the write's shadow price in units of its own link time — ρ/(1 − ρ) for a path at measured
        utilisation ρ (the delay a write imposes on the traffic sharing its links, the M/M/1 externality; 0 on an idle
        link, where it costs only the pool space it takes, paid in ``P_eviction``). None: 1, the whole link time (a
        busy link: conservative). ``P_write`` charges each write never read ``size_bytes × congestion ×
        write_cost_s_per_byte``."""
        if congestion is not None:
            check_non_negative_number("congestion", congestion)
        if self._before(t_s):
            self.pub.published(key, tier, t_s, 0.0, request_class)  # known as published; its bytes are not judged
            return
        self.pub.published(key, tier, t_s, size_bytes, request_class,
                           priced_bytes=None if congestion is None else size_bytes * congestion)
        self._flow("write", t_s, size_bytes)
        self._time(t_s)

    def record_eviction(self, key: Hashable, t_s: float) -> None:
        self.pub.evicted(key, t_s)  # which checks t_s: a NaN one made every later miss's age since eviction NaN

    def record_read(self, key: Hashable) -> None:
        self.pub.read(key)

    def record_replication(self, t_s: float, size_bytes: float) -> None:
        _check_flow(t_s, size_bytes)
        if self._before(t_s):
            return
        self._flow("replica", t_s, size_bytes)
        self._time(t_s)

    # ---------------------------------------------------------------- report

    @property
    def total_requests(self) -> int:
        return sum(self.requests.values())

    @property
    def total_tokens(self) -> int:
        return sum(self.tokens.values())

    def expected_benefit(self) -> dict[str, Any]:
        span = (self._t_last - self._t_first) if self._t_first is not None else 0.0
        unread = self.pub.unread_write_bytes(priced=True)
        per_class = {}
        total: float | None = 0.0
        unknown_terms: set[str] = set()
        for name, c in sorted(self._cls.items()):
            n = c["requests"]
            h = c["remote_hits"] / n if n else 0.0
            saved = c["saved_s"] / c["saved_n"] if c["saved_n"] else None
            stall = c["stall_s"] / n if c["stall_n"] else None
            write = None if self.write_cost_s_per_byte is None else unread.get(name, 0.0) * self.write_cost_s_per_byte / n
            evict = None if self.eviction_cost_s_per_token is None else c["evicted_priced"] * self.eviction_cost_s_per_token / n
            terms = {"h_remote": h, "recompute_minus_remote_s": saved, "p_stall_s": stall, "p_write_s": write, "p_eviction_s": evict}
            missing = [k for k, v in terms.items() if v is None and not (k == "recompute_minus_remote_s" and h == 0)]
            benefit = None if missing else h * (saved or 0.0) - stall - write - evict  # type: ignore[operator]
            lam = n / span if span > 0 else None
            per_class[name] = {**terms, "rate_per_s": lam, "e_benefit_s": benefit, "unknown": missing}
            if benefit is None or lam is None:
                unknown_terms.update(missing or ["rate_per_s"])
                total = None
            elif total is not None:
                total += lam * benefit
        return {"per_class": per_class, "e_benefit_s_per_s": total, "unknown": sorted(unknown_terms)}

    def to_dict(self) -> dict[str, Any]:
        bpt = self.bytes_per_token
        flows = self._flow_summary()
        return {
            "requests": dict(self.requests),
            "total_requests": self.total_requests,
            "tokens": dict(self.tokens),
            "total_tokens": self.total_tokens,
            "bytes": {k: v * bpt for k, v in self.tokens.items()},
            "evicted_by_tier": dict(self.evicted_by_tier),
            "stranded_blocks": self.stranded_blocks,
            "evicted_age_s": self.evicted_age_s.summary(),
            "distributions": {d: v.summary() for d, v in self.dists.items()},
            "flows": flows,
            "window_s": self.window_s,
            "expected_benefit": self.expected_benefit(),
        }

    def to_prometheus(self, prefix: str = "kvpolicy") -> str:
        """Prometheus text exposition (counters, summaries with quantiles, gauges)."""
        lines: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[tuple[dict[str, str], float | None]]) -> None:
            lines.append(f"# HELP {prefix}_{name} {help_}")
            lines.append(f"# TYPE {prefix}_{name} {kind}")
            for labels, v in samples:
                lab = ",".join(f'{k}="{val}"' for k, val in labels.items())
                lines.append(f"{prefix}_{name}{{{lab}}} {_num(v)}" if lab else f"{prefix}_{name} {_num(v)}")

        metric("requests_total", "counter", "Requests by outcome category.", [({"category": c}, v) for c, v in self.requests.items()])
        metric("prompt_tokens_total", "counter", "Prompt tokens by reuse outcome or miss cause.", [({"category": c}, v) for c, v in self.tokens.items()])
        metric("prompt_bytes_total", "counter", "KV bytes of prompt tokens by outcome or miss cause.", [({"category": c}, v * self.bytes_per_token) for c, v in self.tokens.items()])
        metric("stranded_blocks_total", "counter", "Blocks published before a request, still listed resident, that it missed past an evicted block (in miss_evicted).",
               [({}, self.stranded_blocks)])
        for d, dist in self.dists.items():
            dist.flush()
        for field in _Dist.FIELDS:
            samples = []
            sums = []
            for d, dist in self.dists.items():
                h = dist.hists[field]
                for q in (0.5, 0.95, 0.99):
                    v = h.quantile(q)
                    if v is not None:
                        samples.append(({"distribution": d, "quantile": str(q)}, v))
                sums.append((d, h.sum, h.count))
            name = field.replace("_s", "_seconds")
            lines.append(f"# HELP {prefix}_{name} {field} by distribution (cold prefill, local hit, remote hit, fallback recompute).")
            lines.append(f"# TYPE {prefix}_{name} summary")
            for labels, v in samples:
                lab = ",".join(f'{k}="{val}"' for k, val in labels.items())
                lines.append(f"{prefix}_{name}{{{lab}}} {_num(v)}")
            for d, s, n in sums:
                lines.append(f'{prefix}_{name}_sum{{distribution="{d}"}} {_num(s)}')
                lines.append(f'{prefix}_{name}_count{{distribution="{d}"}} {_num(n)}')
        flows = self._flow_summary()
        metric("flow_bytes_total", "counter", "Bytes moved by flow (read, write, replica, total).", [({"flow": k}, v["bytes"]) for k, v in flows.items()])
        metric("flow_peak_window_bytes_per_second", "gauge", f"Worst {self.window_s:.0f}-second window of each flow.", [({"flow": k}, v["peak_window_bytes_per_s"]) for k, v in flows.items()])
        return "\n".join(lines) + "\n"


def _num(v: float | None) -> str:
    if v is None:  # not known (a rate over no time): Prometheus' NaN, never the string None
        return "NaN"
    if isinstance(v, float) and (math.isinf(v) or math.isnan(v)):
        return "+Inf" if v > 0 else ("-Inf" if v < 0 else "NaN")
    return repr(float(v)) if isinstance(v, float) else str(v)
