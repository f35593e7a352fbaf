"""`kvpolicy publish-bench`: what each publish policy writes, and what gets re-read.

Requests are routed to N replicas (``kvpolicy.analysis.replicas.route``). Each
replica keeps every block it computed or loaded (an infinite local cache, so a
pool read is always cross-replica reuse). Per request, under the prefix rule:
the leading blocks held locally are local hits, the pool's continuation is read
(``reread_bytes``: re-reads actually served), then the filter decides how many
leading blocks to publish; new ones are written (``blocks_written``,
``bytes_written``) into an LRU pool of ``pool_capacity_blocks`` — by default the
pool ``kvpolicy compare`` gives the same trace (a quarter of its distinct blocks),
so a write pays for what it evicts (issue #44); ``None`` is an infinite pool, where
#20's goals were measured. A write never read before it left the pool is wasted
(``wasted_write_bytes``); an eviction of a block some replica needed from the
pool later is counted (``evicted_needed_blocks``).

The **oracle** writes exactly the blocks another replica will need later. In an
infinite pool that is the most re-read bytes for the fewest written; in a
finite one it also evicts the block needed farthest in the future, and does not
write a block needed later than every block it holds (Belady with bypass), so
its served re-reads bound every filter's in the same pool.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections import OrderedDict
from typing import Any

import numpy as np

from .analysis.replicas import replica_view, route
from ._validate import check_non_negative_int, check_positive_int, check_positive_number, check_probability, check_split
from .errors import ConfigError
from .eviction.policies import depth_cost
from .profile import PrefillModel
from ._own import is_own
from .publish import DuelingPublish, PublishRequest, make_filter
from .sweep import Sweep
from .traces.model import check_trace

#: order-of-magnitude default prefill model (≈ 20k tokens/s, mildly superlinear); pass a measured profile
DEFAULT_PREFILL = PrefillModel(a_s=0.0, b_s_per_token=5e-5, c_s_per_token2=1e-10, rms_rel_error=float("nan"), max_rel_error=float("nan"))


def block_recompute_s(prefill: PrefillModel, block_size_tokens: int):
    """Seconds to recompute the block at each depth: the prefill model's marginal (as GDSF's cost)."""
    return depth_cost(prefill, block_size_tokens)


#: ``publish_bench(pool_capacity_blocks=COMPARE_POOL)``: the pool ``kvpolicy compare`` gives the trace
COMPARE_POOL = "compare"


def compare_pool_blocks(trace: Any, pool_share: float = 0.25, storage_nodes: int = 4) -> int:
    """The pool, in blocks, that ``kvpolicy compare``'s default cluster gives ``trace`` (``default_cluster``)."""
    distinct = int(trace.summary()["distinct_blocks"])
    return storage_nodes * max(int(distinct * pool_share / storage_nodes), 1)


def publish_bench(trace: Any, policies: list[str], *, replicas: int = 8, routing: str = "round-robin",
                  pool_capacity_blocks: int | str | None = COMPARE_POOL, bytes_per_token: int, prefill: PrefillModel | None = None,
                  write_bytes_per_s: float = 12.5e9, seed: int = 0, progress: Any = None, judge_from_request: int = 0,
                  sweep: Sweep | None = None) -> dict[str, Any]:
    """``judge_from_request`` = k > 0 is a held-out split: every filter sees the whole trace (it learns on requests < k)
    but only writes and re-reads made by requests >= k are counted — for the oracle too. ``pool_capacity_blocks``:
    blocks the LRU pool holds; ``"compare"`` (default) the pool ``kvpolicy compare`` gives the trace; None infinite."""
    check_trace(trace)
    if isinstance(policies, str):  # "all" would be read as the policies 'a', 'l', 'l'
        raise ConfigError("--policies", f"give a list of publish policy specs, got the string {policies!r}")
    if pool_capacity_blocks == COMPARE_POOL:
        pool_capacity_blocks = compare_pool_blocks(trace)
    if pool_capacity_blocks is not None:  # None: infinite
        check_positive_int("--pool-capacity-blocks", pool_capacity_blocks)
    cap: int | None = pool_capacity_blocks  # type: ignore[assignment]
    check_positive_number("write_bytes_per_s", write_bytes_per_s)
    check_non_negative_int("seed", seed)
    k = check_split(judge_from_request, len(trace))
    step = progress or (lambda _m: None)
    B = trace.block_size_tokens
    block_bytes = bytes_per_token * B
    prefill = prefill or DEFAULT_PREFILL
    rep = route(trace, replicas, routing, seed=seed)  # type: ignore[arg-type]
    offsets = trace.block_offsets.tolist()
    ids = trace.block_ids.tolist()
    matchable = trace.matchable_blocks.tolist()
    arrival = trace.arrival_s.tolist()
    ntok = trace.input_tokens.tolist()
    bound = trace.publish_boundary_tokens.tolist() if trace.publish_boundary_tokens is not None else None
    tenant = [trace.tenant_names[t] for t in trace.tenant.tolist()] if trace.tenant is not None else None
    # the filters' keywords but recompute_s, a closure no worker process could be sent: each job builds it (_publish_job)
    kw = {"block_bytes": block_bytes, "write_bytes_per_s": write_bytes_per_s,
          "cross_replica_share": (replicas - 1) / replicas if routing != "prefix-affinity" else 0.1, "pool_capacity_blocks": cap}
    needs = _pool_needs(trace, rep)
    r_all, in_s, n_seen = _sightings(trace, rep)
    # per reference: 1 where a block first appears and is re-read at its 2nd sighting, 0 where it first appears
    # otherwise, -1 elsewhere — the same for every filter, so computed once
    first_at_arr = np.full(len(ids), -1, dtype=np.int64)
    if ids:
        _, first_ref = np.unique(trace.block_ids, return_index=True)
        first_at_arr[first_ref] = in_s[trace.block_ids[first_ref]]
    first_at: list[int] = first_at_arr.tolist()
    shared = {"trace": trace, "rep": rep, "offsets": offsets, "ids": ids, "matchable": matchable, "arrival": arrival, "ntok": ntok,
              "bound": bound, "tenant": tenant, "kw": kw, "needs": needs, "first_at": first_at, "k": k, "cap": cap,
              "replicas": replicas, "block_bytes": block_bytes, "prefill": prefill}
    runs = (sweep or Sweep()).map(_publish_job, shared, list(policies), progress=step)
    step("oracle")
    if cap is None:
        view = replica_view(trace, replicas, routing, bytes_per_token=bytes_per_token, seed=seed)  # type: ignore[arg-type]
        ow = int(round(view.write_reread_bytes[k:].sum()))
        orr = float(view.read_bytes[k:].sum())
        runs.append({"policy": "oracle", "blocks_written": ow // block_bytes, "bytes_written": ow, "reread_bytes": int(round(orr)),
                     "wasted_write_bytes": 0, "reread_per_written_byte": (orr / ow) if ow else None, "evicted_needed_blocks": 0})
    else:
        ow_b, orr_b, oev = _finite_oracle(trace, rep, needs, cap, k)
        runs.append({"policy": "oracle", "blocks_written": ow_b, "bytes_written": ow_b * block_bytes, "reread_bytes": orr_b * block_bytes,
                     "wasted_write_bytes": None, "reread_per_written_byte": (orr_b / ow_b) if ow_b else None, "evicted_needed_blocks": oev})
    oracle = runs[-1]
    for run in runs:
        run["reread_share_of_oracle"] = run["reread_bytes"] / oracle["reread_bytes"] if oracle["reread_bytes"] else None
        run["written_over_oracle"] = run["bytes_written"] / oracle["bytes_written"] if oracle["bytes_written"] else None
    source = trace.source if k == 0 else f"{trace.source} — judged on requests {k:,}..{len(trace) - 1:,} (learned on the first {k:,})"
    res = {"source": source, "replicas": replicas, "routing": routing, "pool_capacity_blocks": cap,
           "block_bytes": block_bytes, "judge_from_request": k, "runs": runs}
    judged = [*GOAL_PUBLISH_POLICIES, *(p for p in policies if is_own(p))]  # a filter of your own is judged too
    res["goals"] = [g for g in (publish_goals(res, p) for p in judged) if g is not None]
    if k == 0:  # what the share goal asks of a first sighting (the bound is over the whole trace: no split)
        res["first_sighting"] = _first_sighting_figures(r_all, in_s, n_seen, GOAL_REREAD_SHARE, GOAL_WRITTEN_OVER_ORACLE)
    return res


def _publish_job(sh: dict[str, Any], spec: str) -> dict[str, Any]:
    """One publish filter over the trace, in its own LRU pool: what it writes, what gets re-read, what it evicts."""
    trace, rep, offsets, ids, matchable = sh["trace"], sh["rep"], sh["offsets"], sh["ids"], sh["matchable"]
    arrival, ntok, bound, tenant, kw, needs = sh["arrival"], sh["ntok"], sh["bound"], sh["tenant"], sh["kw"], sh["needs"]
    first_at, k, cap, replicas, block_bytes = sh["first_at"], sh["k"], sh["cap"], sh["replicas"], sh["block_bytes"]
    B = trace.block_size_tokens
    try:
        f = make_filter(spec, recompute_s=block_recompute_s(sh["prefill"], B), **kw)  # each filter takes the keywords it uses (a composition passes them to every part)
    except ConfigError as err:  # named as the option that gave the spec (a filter of your own that does not build, say)
        raise ConfigError("--policies", err.problem) from None
    local: list[set[int]] = [set() for _ in range(replicas)]
    pool: OrderedDict[int, list[Any]] = OrderedDict()  # block -> [read since written, counted (written at r >= k)]
    written = reread = wasted = evicted_needed = 0
    first_pub = first_caught = 0  # blocks published by the request that first saw them; of those, re-read at their 2nd sighting (oracle)
    for r in range(len(trace)):
        p = int(rep[r])
        s, e = offsets[r], offsets[r + 1]
        m = s + matchable[r]
        mine = local[p]
        j = s
        while j < m and ids[j] in mine:
            j += 1
        L = j - s
        while j < m and ids[j] in pool:
            pool[ids[j]][0] = True
            pool.move_to_end(ids[j])
            j += 1
        if r >= k:
            reread += j - s - L
        blocks = ids[s:e]
        mine.update(blocks)
        req = PublishRequest(request_id=r, num_tokens=ntok[r], block_size_tokens=B, time_s=arrival[r],
                             tenant=tenant[r] if tenant else "default", boundary_tokens=bound[r] if bound else None,
                             replica=str(p), reused_blocks=j - s, local_blocks=L)
        f.observe(req, blocks)
        n = f.publishable(req, blocks)
        if r >= k:
            for flag in first_at[s:s + n]:
                if flag >= 0:
                    first_pub += 1
                    first_caught += flag
        for b in blocks[:n]:
            if b in pool:
                pool.move_to_end(b)
                continue
            pool[b] = [False, r >= k]
            written += r >= k
            if cap is not None and len(pool) > cap:
                gone, (was_read, counted) = pool.popitem(last=False)
                wasted += counted and not was_read
                evicted_needed += r >= k and _needed_after(needs, gone, r)
    wasted += sum(1 for was_read, counted in pool.values() if counted and not was_read)
    run: dict[str, Any] = {
        "policy": spec, "blocks_written": written, "bytes_written": written * block_bytes, "reread_bytes": reread * block_bytes,
        "wasted_write_bytes": wasted * block_bytes, "reread_per_written_byte": (reread / written) if written else None,
        "evicted_needed_blocks": evicted_needed, "first_sighting_published_blocks": first_pub, "first_sighting_caught_blocks": first_caught}
    if isinstance(f, DuelingPublish):
        run["dueling"] = f.report()
    if spec == "boundary" and bound is None:
        run["note"] = ("boundary publishes nothing here: this trace marks no prompt boundaries (Mooncake, Bailian and token "
                       "JSONL carry none; kvpolicy's synthetic presets do)")
    return run


def _pool_needs(trace: Any, rep: Any) -> dict[int, list[int]]:
    """Per block id: the requests (in order) that need it from the pool — its first sighting on each replica other than
    the first replica to see it (local caches are infinite here: a replica that has seen a block holds it)."""
    offsets, ids = trace.block_offsets.tolist(), trace.block_ids.tolist()
    seen_on: dict[int, set[int]] = {}
    needs: dict[int, list[int]] = {}
    for r in range(len(trace)):
        p = int(rep[r])
        for b in set(ids[offsets[r]:offsets[r + 1]]):
            on = seen_on.get(b)
            if on is None:
                seen_on[b] = {p}
            elif p not in on:
                on.add(p)
                needs.setdefault(b, []).append(r)
    return needs


def _local_runs(trace: Any, rep: Any) -> Any:
    """Per request, in order: (index, the set of blocks its replica holds, its first and end reference, the end of its
    matchable blocks, the first reference past the replica's own leading run) — replicas keep every block they saw, so
    the caller adds the request's blocks to the set once it is done with it."""
    offsets, ids, matchable = trace.block_offsets.tolist(), trace.block_ids.tolist(), trace.matchable_blocks.tolist()
    local: dict[int, set[int]] = {}
    for r in range(len(trace)):
        mine = local.setdefault(int(rep[r]), set())
        s, e = offsets[r], offsets[r + 1]
        m = s + matchable[r]
        j = s
        while j < m and ids[j] in mine:
            j += 1
        yield r, mine, s, e, m, j


def _needed_after(needs: dict[int, list[int]], b: int, r: int) -> bool:
    lst = needs.get(b)
    return lst is not None and bool(lst) and lst[-1] > r


def _next_need(needs: dict[int, list[int]], b: int, r: int) -> float:
    lst = needs.get(b)
    if not lst:
        return math.inf
    i = bisect.bisect_right(lst, r)
    return float(lst[i]) if i < len(lst) else math.inf


def _finite_oracle(trace: Any, rep: Any, needs: dict[int, list[int]], cap: int, k: int) -> tuple[int, int, int]:
    """(blocks written, re-read blocks served, evictions of blocks needed later) of the hindsight publisher in a pool of
    ``cap`` blocks: it writes the blocks some other replica will need, evicts the one needed farthest ahead (Belady), and
    writes nothing needed later than everything it holds (bypass). Counted for requests >= k."""
    ids = trace.block_ids.tolist()
    pool: dict[int, float] = {}  # block -> its next need
    heap: list[tuple[float, int]] = []  # (-next need, block), stale entries skipped
    written = served = evicted = 0
    for r, mine, s, e, m, j in _local_runs(trace, rep):
        while j < m and ids[j] in pool:
            b = ids[j]
            served += r >= k
            nn = _next_need(needs, b, r)
            pool[b] = nn
            heapq.heappush(heap, (-nn, b))
            j += 1
        blocks = ids[s:e]
        mine.update(blocks)
        for b in dict.fromkeys(blocks):
            if b in pool:
                continue
            nn = _next_need(needs, b, r)
            if nn == math.inf:
                continue
            if len(pool) >= cap:
                while heap and (heap[0][1] not in pool or pool[heap[0][1]] != -heap[0][0]):
                    heapq.heappop(heap)
                far, victim = -heap[0][0], heap[0][1]
                if nn >= far:
                    continue  # needed later than everything held: bypass
                heapq.heappop(heap)
                del pool[victim]
                evicted += r >= k and far != math.inf
            pool[b] = nn
            heapq.heappush(heap, (-nn, b))
            written += r >= k
    return written, served, evicted


#: issue #20: a publish filter reaches >= 85 % of the oracle's re-read bytes at <= 1.3x its writes, or dominates every count threshold
GOAL_REREAD_SHARE = 0.85
GOAL_WRITTEN_OVER_ORACLE = 1.3
#: the filters judged against the goal, where they ran
GOAL_PUBLISH_POLICIES = ("structure-aware", "reuse-aware", "dueling")


def publish_goals(res: dict[str, Any], policy: str = "reuse-aware") -> dict[str, Any] | None:
    """The goal line for ``policy``: (a) share of the oracle's re-read bytes and writes over the oracle's; (b) whether it
    dominates every ``threshold-k`` run present (re-reads at least as much, writes no more, one of them strictly)."""
    runs = {r["policy"]: r for r in res["runs"]}
    me = runs.get(policy)
    if me is None or me["reread_share_of_oracle"] is None:
        return None
    a = bool(me["reread_share_of_oracle"] >= GOAL_REREAD_SHARE and me["written_over_oracle"] is not None
             and me["written_over_oracle"] <= GOAL_WRITTEN_OVER_ORACLE)
    thresholds = [r for name, r in runs.items() if name.startswith("threshold")]
    dominated = {r["policy"]: bool(me["reread_bytes"] >= r["reread_bytes"] and me["bytes_written"] <= r["bytes_written"]
                                   and (me["reread_bytes"] > r["reread_bytes"] or me["bytes_written"] < r["bytes_written"])) for r in thresholds}
    b = bool(dominated) and all(dominated.values())
    return {"policy": policy, "reread_share_of_oracle": me["reread_share_of_oracle"], "written_over_oracle": me["written_over_oracle"],
            "share_goal": a, "dominates": dominated, "dominance_goal": b, "goal": a or b}


def _sightings(trace: Any, rep: Any) -> tuple[Any, Any, int]:
    """Per block id: ``r`` the oracle's cross-replica re-reads of it (the blocks another replica reads from an infinite
    pool holding every block seen before: the prefix beyond the replica's own, up to the first block never seen),
    and ``s`` whether one of them is its second sighting (the request right after the one that created it); and how
    many distinct full blocks the trace has."""
    n = max(trace.num_block_ids, 1)
    r = np.zeros(n, dtype=np.int64)
    s = np.zeros(n, dtype=np.bool_)
    sightings = np.zeros(n, dtype=np.int64)
    ids = trace.block_ids.tolist()
    for _, mine, a, e, m, j in _local_runs(trace, rep):
        while j < m and sightings[ids[j]]:
            b = ids[j]
            r[b] += 1
            if sightings[b] == 1:
                s[b] = True
            j += 1
        blocks = set(ids[a:e])
        for b in blocks:
            sightings[b] += 1
        mine.update(blocks)
    return r, s, int(np.count_nonzero(sightings))


def first_sighting_bound(trace: Any, *, replicas: int = 8, routing: str = "round-robin", seed: int = 0,
                         share: float = GOAL_REREAD_SHARE, written_over_oracle: float = GOAL_WRITTEN_OVER_ORACLE) -> dict[str, Any]:
    """What the publish goal asks of a block's *first* sighting, from the trace alone (whole trace, no split).

    Let the oracle's re-reads be RR, of which F·RR happen at a block's second sighting — the request right after
    the one that created it, before any filter could have seen it twice — and let S be those blocks. A filter
    that never publishes a block at its first sighting (threshold-k for any k ≥ 2, a filter waiting for
    evidence) captures at most (1 − F)·RR: the re-read at the second sighting needs the block in the pool already.
    Any filter captures at most (1 − F)·RR + |A ∩ S|, where A is what it publishes at first sighting (a block
    published at first sighting gains at most its second-sighting re-read over one published later). So reaching
    ``share`` of RR needs |A ∩ S| ≥ c = share·RR − (1 − F)·RR; and with at most ``written_over_oracle`` × the
    oracle's W written blocks, |A| ≤ written_over_oracle·W, so A's precision on S is at least c / (written_over_oracle·W).
    Compared with the base rate |S| / (blocks ever seen), that is the lift over a blind guess any first-sighting
    predictor must reach — a bound, not an estimate: it assumes every other decision perfect.
    """
    check_probability("share", share)
    if share == 0:
        raise ConfigError("share", "must be in (0, 1], got 0")
    check_positive_number("written_over_oracle", written_over_oracle)
    rep = route(trace, replicas, routing, seed=seed)  # type: ignore[arg-type]
    r, s, seen = _sightings(trace, rep)
    out = {"source": trace.source, "replicas": replicas, "routing": routing}
    out.update(_first_sighting_figures(r, s, seen, share, written_over_oracle))
    return out


def _first_sighting_figures(r: Any, s: Any, seen: int, share: float, written_over_oracle: float) -> dict[str, Any]:
    rr = int(r.sum())
    second = int(s.sum())
    written = int((r > 0).sum())
    need = max(share * rr - (rr - second), 0.0)
    precision = need / (written_over_oracle * written) if written else None
    base = second / seen if seen else None
    return {"oracle_reread_blocks": rr,
            "oracle_written_blocks": written, "second_sighting_rereads": second,
            "waiting_share_max": (rr - second) / rr if rr else None, "blocks_seen": seen, "second_sighting_blocks": second,
            "base_rate": base, "needed_first_sighting_catches": int(math.ceil(need)),
            "recall_needed": need / second if second else None, "precision_needed": precision,
            "lift_needed": (precision / base) if precision is not None and base else None,
            "share": share, "written_over_oracle": written_over_oracle}


def _first_sighting_line(fs: dict[str, Any], run: dict[str, Any]) -> str:
    pub, caught = run["first_sighting_published_blocks"], run["first_sighting_caught_blocks"]
    prec = f"{caught / pub:.0%}" if pub else "-"
    need = (f"needs >= {fs['needed_first_sighting_catches']:,} ({fs['recall_needed']:.0%}) at precision >= {fs['precision_needed']:.0%} "
            f"({fs['lift_needed']:.1f}x the base rate)" if fs["needed_first_sighting_catches"] else "needs none")
    return (f"  first sightings: published {pub:,} blocks, {prec} of them re-read at their 2nd sighting (base rate "
            f"{fs['base_rate']:.1%}), {caught / fs['second_sighting_blocks']:.0%} of the {fs['second_sighting_blocks']:,} that are; "
            f"waiting for a 2nd sighting caps the share at {fs['waiting_share_max']:.0%}, so the share goal {need}")


def render(res: dict[str, Any]) -> str:
    gib = 2**30
    cap = res["pool_capacity_blocks"]
    w = max(28, *(len(r["policy"]) for r in res["runs"]))  # a filter of your own is named by its module:class
    lines = [f"trace            {res['source']}",
             f"setup            {res['replicas']} replicas, {res['routing']} routing, pool {'infinite' if cap is None else f'{cap:,} blocks (LRU; the oracle: Belady)'}, "
             f"{res['block_bytes'] / 2**20:,.0f} MiB per block", "",
             f"{'policy':>{w}} {'blocks_written':>15} {'written GiB':>12} {'re-read GiB':>12} {'wasted GiB':>11} {'evicted, needed':>16} "
             f"{'re-read/written':>16} {'re-read of oracle':>18}"]
    for r in res["runs"]:
        rr = "-" if r["reread_per_written_byte"] is None else f"{r['reread_per_written_byte']:.2f}"
        so = "-" if r["reread_share_of_oracle"] is None else f"{r['reread_share_of_oracle']:.1%}"
        wasted = "-" if r["wasted_write_bytes"] is None else f"{r['wasted_write_bytes'] / gib:,.1f}"
        lines.append(f"{r['policy']:>{w}} {r['blocks_written']:>15,} {r['bytes_written'] / gib:>12,.1f} {r['reread_bytes'] / gib:>12,.1f} "
                     f"{wasted:>11} {r.get('evicted_needed_blocks', 0):>16,} {rr:>16} {so:>18}")
    lines += [f"note             {r['note']}" for r in res["runs"] if r.get("note")]
    for g in res.get("goals") or []:
        wo = "-" if g["written_over_oracle"] is None else f"{g['written_over_oracle']:.2f}x"
        dom = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in g["dominates"].items()) or "no threshold run"
        lines += ["", f"goal: {g['policy']} reaches >= {GOAL_REREAD_SHARE:.0%} of the oracle's served re-reads in this pool at <= "
                      f"{GOAL_WRITTEN_OVER_ORACLE}x its writes, or dominates every count threshold -> {'PASS' if g['goal'] else 'MISS'}",
                  f"  share: {g['reread_share_of_oracle']:.1%} of the oracle's re-reads at {wo} its writes -> {'PASS' if g['share_goal'] else 'MISS'}",
                  f"  dominance over the count thresholds: {dom} -> {'PASS' if g['dominance_goal'] else 'MISS'}"]
        fs, me = res.get("first_sighting"), next((r for r in res["runs"] if r["policy"] == g["policy"]), None)
        if fs and me and fs["second_sighting_blocks"]:
            lines.append(_first_sighting_line(fs, me))
    return "\n".join(lines)
