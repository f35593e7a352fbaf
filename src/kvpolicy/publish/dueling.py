"""``dueling``: every candidate rule in a ghost pool of its own; the one that has earned the most decides."""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from .._validate import check_positive_int, check_positive_number
from ..errors import ConfigError
from ..prices import gpu_price
from .rules import PublishRequest, ThresholdPublish, _Dedup, _check, _timed
from .specs import check_spec, make_filter


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
    ``all``) are any publish specs; ties go to the budget rule (below), then to the earlier one. Every candidate
    observes every request, so the one that takes over has learned all along. ``read_bytes_per_s``: the read path's
    rate (default: the write's).

    ``score="gpu_s"`` scores in GPU seconds instead (the rule before issue #44's second round): a hit is worth its
    whole ``recompute_s(j)`` and every written block is charged, read or not. Where a load costs a sizeable share of a
    recompute it ranks a rule that writes more higher (measured: docs/publish.md).

    **Prices** (issue #58). A written block is charged its shadow price, ``t_write × ρ/(1 − ρ)`` with ρ the write
    path's measured utilisation (:meth:`write_price_s`): the delay it imposes on the traffic sharing its links — on an
    idle link a write costs only the pool space it takes, which its ghost already pays in lost re-reads (a fixed
    ``t_write`` per block counted a second of link time as a second of GPU time, and picked the rules that write least
    whatever the links' load). Its first read pays back what it was charged.

    **A GPU second** a hit saves is priced by the prefill queue it shortens: ``1/(1 − ρ_gpu)`` seconds of latency per
    second of recompute (:func:`gpu_price`), ρ_gpu the replica's measured prefill utilisation
    (``PublishRequest.prefill_utilisation``): on an idle replica a saved second is one second; in overload it is that
    second for every request queued behind it. The same price as the write's, from the other side of the same queue
    formula; unknown ρ: 1.

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
        """The index of the candidate that decides now: the highest score among those within the write budget. The
        budget rule itself is always within it and keeps a tie — with no evidence yet (every score 0) the engine's own
        rule decides, not the first candidate listed; among the others the earliest."""
        sc = self.scores
        b = self.budget
        cap = self.written_decayed[b] * (1.0 + 1e-9) + 1e-9 if b is not None else math.inf
        wd = self.written_decayed
        best = -1 if b is None else b  # the budget rule (the engine's own) until another has earned more than it
        for i in range(len(sc)):
            if wd[i] > cap:
                continue
            if best < 0 or sc[i] > sc[best]:  # strictly: a tie stays with the budget rule, then the earlier
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
            gpu = gpu_price(request.prefill_utilisation) if self.score == "e_benefit" else 1.0
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
                self.scores[c] += served * gpu + (paid_back if cost else 0.0)
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
