"""Tests that pin decisions, not shapes (issues #44 and #49): each names the decision, computes what it must be by hand
or by an exhaustive reference written here, and fails when the decision changes."""

import math

import attrs

import pytest
from hypothesis import given, settings, strategies as st

from kvpolicy.admission import AdmissionConfig, AdmissionContext, AdmissionController, LatencyModel, LinkPrior
from kvpolicy.clock import ManualClock
from kvpolicy.errors import ConfigError
from kvpolicy.eviction.replay import make_policy
from kvpolicy.matching import PrefixMatch
from kvpolicy.profile import PrefillModel
from kvpolicy.publish import DuelingPublish, PublishRequest, StructureAwarePublish, make_filter
from kvpolicy.write_admission import FrequencySketch, WriteAdmission, gate

B = 16
BLOCK_BYTES = 131072 * B
# a linear prefill (20k tokens/s) and a 2.5 GB/s link: a block (2 MiB) loads in 0.84 ms + overheads, computes in 0.8 ms
PREFILL = PrefillModel(a_s=0.0, b_s_per_token=5e-5, c_s_per_token2=0.0, rms_rel_error=float("nan"), max_rel_error=float("nan"))


def controller(bw=2.5e9, **cfg):
    return AdmissionController(LatencyModel(LinkPrior(bandwidth_bytes_per_s=bw), PREFILL), AdmissionConfig(**cfg), clock=ManualClock())


def pm(local, remote, tokens=None):
    tokens = tokens or (local + remote + 10) * B + 3
    return PrefixMatch(tokens, B, (tokens - 1) // B, local, (remote,), ("pool",), "miss")


# ------------------------------------------------------------------------------------------- the load rule


def _exhaustive(c, L, R, ctx, price):
    """The reference: every extent k in {1, 2, 4, ..} ∪ {R} and every split s in [0, k), valued by evaluate() alone."""
    best = None
    ks = sorted({min(2**i, R) for i in range(R.bit_length() + 1)})
    for k in ks:
        for s in range(0, k if c.config.compute_while_loading else 1):
            t = c.evaluate(L, R, k, B, ctx, s)
            if t["benefit_s"] <= 0:
                continue
            key = (t["gpu_saved_s"], t["benefit_s"]) if price == math.inf else (t["benefit_s"] + price * t["gpu_saved_s"],)
            if best is None or key > best[0]:
                best = (key, k, s, t)
    return best


@settings(max_examples=120, deadline=None)
@given(st.floats(0.3e9, 20e9), st.integers(0, 40), st.integers(1, 48), st.floats(0.0, 0.05), st.integers(0, 3),
       st.sampled_from([0.0, math.inf]))
def test_the_chosen_plan_is_the_one_an_exhaustive_search_ranks_first(bw, local, remote, wait_s, queued, price):
    """At gpu_s_price=inf the plan that saves the most GPU seconds among those that beat recompute; at 0 the fastest.
    The reference tries every split s, not only the controller's candidates (plain, meeting point, least winning)."""
    c = controller(bw=bw, compute_while_loading=True, gpu_s_price=price, ttft_slo_s=0.0)
    ctx = AdmissionContext(block_bytes=BLOCK_BYTES, queue_wait_s=wait_s, prefill_queue_requests=queued)
    d = c.propose(pm(local, remote), ctx)  # no side effects: the reference sees the same controller state
    ref = _exhaustive(c, local, remote, ctx, price)
    if ref is None:
        assert not d.loads and d.reason == "slower_than_recompute"
        return
    assert d.loads
    t = d.terms
    if price == math.inf:
        assert t["gpu_saved_s"] == pytest.approx(ref[3]["gpu_saved_s"], rel=1e-9, abs=1e-12), (d.load_blocks, d.split_blocks, ref[1:3])
    else:  # the fastest: the controller tries the meeting point, which the linear sides make the best split
        assert t["benefit_s"] >= ref[3]["benefit_s"] - 1e-9 - 0.02 * abs(ref[3]["benefit_s"])


def _ascending(c, L, R, ctx, prompt_tokens):
    """The reference search: every extent in {1, 2, 4, …} ∪ {R} in ascending order, every candidate plan of each, the
    first of equal keys kept (the controller's own candidates: what is tested is the order and the bound, not them)."""
    c95, c50 = c.model.coefficients(0.95, ctx.source), c.model.coefficients(0.5, ctx.source)
    sides = c._sides(L, B, ctx, c95, c50, prompt_tokens)
    price, slo = c.config.gpu_s_price, c.slo_s()
    best, closest = None, (1, 0, -math.inf)
    for k in sorted({min(2**i, R) for i in range(R.bit_length() + 1)}):
        for s, benefit in c._plans(k, sides, split=c.config.compute_while_loading):
            if benefit > closest[2]:
                closest = (k, s, benefit)
            if benefit <= 0 and not (slo > 0 and sides.ttft(k, s) <= slo):
                continue
            saved = sides.front(k) - sides.front(s)
            key = (saved, benefit) if price == math.inf else (benefit + price * saved, saved)
            if best is None or key > best[0]:
                best = (key, k, s)
    return (best[1], best[2]) if best is not None else closest[:2]


@settings(max_examples=150, deadline=None)
@given(st.floats(0.3e9, 20e9), st.integers(0, 40), st.integers(1, 70), st.floats(0.0, 0.05), st.sampled_from([0.0, 5e-5]),
       st.sampled_from([0.0, 2e-9]), st.sampled_from([0.0, 1.5, math.inf]), st.booleans(), st.sampled_from([0.0, 0.02]))
def test_the_search_from_the_largest_extent_down_chooses_what_an_ascending_search_of_every_extent_chooses(
        bw, local, remote, wait_s, b, c2, price, split, slo):
    """decide() searches the extents from R down and stops once a whole extent saves fewer GPU seconds than the best
    plan found (issue #61's decide() budget): the plan (k, s) it chooses is the ascending search's, equal keys going
    to the smaller extent — a flat prefill (b = c = 0) makes every extent save the same GPU seconds, so a bound that
    stops on a tie (≤), or a search that keeps the larger of equal plans, chooses another k."""
    pf = PrefillModel(a_s=0.0, b_s_per_token=b, c_s_per_token2=c2, rms_rel_error=float("nan"), max_rel_error=float("nan"))
    c = AdmissionController(LatencyModel(LinkPrior(bandwidth_bytes_per_s=bw, dispatch_s=0.004), pf),
                            AdmissionConfig(compute_while_loading=split, gpu_s_price=price, ttft_slo_s=slo), clock=ManualClock())
    ctx = AdmissionContext(block_bytes=BLOCK_BYTES, queue_wait_s=wait_s)
    m = pm(local, remote)
    d = c.propose(m, ctx)
    k, s = _ascending(c, local, remote, ctx, m.num_prompt_tokens)
    assert d.reason != "no_remote_blocks"
    assert (d.load_blocks if d.loads else k, d.split_blocks if d.loads else s) == (k, s if s < k else 0)
    if not d.loads:  # a refusal reports the terms of the plan that came closest
        want = c.evaluate(local, remote, k, B, ctx, s if s < k else 0)
        assert (d.terms["t_plan_s"], d.terms["t_recompute_p50_s"]) == (want["t_plan_s"], want["t_recompute_p50_s"])


def test_a_decisions_remote_terms_add_up_to_its_remote_time_and_install_is_per_block_loaded():
    """evaluate()'s terms, as a decision reports them: at each quantile T_remote = lookup + queue + transfer + stage +
    install, install = install_s_per_block × the blocks loaded (k − split, not k: the front is computed), the queue
    the bytes ahead at B_eff. An extent of no blocks costs the dispatch alone: recompute = dispatch, prefill 0."""
    c = AdmissionController(LatencyModel(LinkPrior(bandwidth_bytes_per_s=2.5e9, stage_bytes_per_s=20e9), PREFILL),
                            AdmissionConfig(compute_while_loading=True), clock=ManualClock())
    ctx = AdmissionContext(block_bytes=BLOCK_BYTES, path_backlog_bytes=3 * BLOCK_BYTES)
    for k, split in ((8, 0), (40, 7), (1, 0)):
        t = c.evaluate(2, 40, k, B, ctx, split)
        for q in ("p95", "p50"):
            co = c.model.coefficients(0.95 if q == "p95" else 0.5, "pool")
            n = k - split
            assert t[f"install_{q}_s"] == pytest.approx(co.install_s_per_block * n)
            assert t[f"install_{q}_s"] > 0 and t[f"stage_{q}_s"] > 0 and t[f"queue_{q}_s"] > 0
            assert t[f"queue_{q}_s"] == pytest.approx(t["queue_bytes"] * co.s_per_byte)
            parts = sum(t[f"{x}_{q}_s"] for x in ("lookup", "queue", "transfer", "stage", "install"))
            assert t[f"t_remote_{q}_s"] == pytest.approx(parts), (k, split, q)
    none = c.evaluate(2, 40, 0, B, ctx)
    assert none["t_recompute_p50_s"] == none["dispatch_p50_s"] > 0 and none["prefill_p50_s"] == 0.0
    assert none["t_remote_p95_s"] == pytest.approx(none["lookup_p95_s"] + none["queue_p95_s"])


def test_the_search_stops_at_the_first_extent_whose_whole_range_saves_less_than_the_best_plan(monkeypatch):
    """At gpu_s_price = inf the search starts from R and ends at the first extent whose front(k) is below the GPU seconds
    the best plan found saves: a load of all 40 blocks that wins plans one extent, not the seven of {1, 2, …, 32, 40}.
    At a finite price the bound does not hold (a smaller extent may be faster by more than it saves): every extent."""
    planned = []
    for price, want in ((math.inf, [40]), (1.0, [40, 32, 16, 8, 4, 2, 1])):
        c = controller(bw=20e9, gpu_s_price=price)
        real = c._plans
        monkeypatch.setattr(c, "_plans", lambda k, sides, split: planned.append(k) or real(k, sides, split=split))
        planned.clear()
        d = c.propose(pm(0, 40), AdmissionContext(block_bytes=BLOCK_BYTES))
        assert d.loads and d.load_blocks == 40
        assert planned == want, price


def test_a_split_computes_the_least_front_that_wins_and_starts_it_to_meet_the_load_there():
    """A link too slow for a plain load: the front computed is the smallest s whose plan still beats recompute by the
    margin (s − 1 would not), and the GPU starts it late — at remote(k − s) − W − front(s) — so it meets the load at s."""
    c = controller(bw=2.5e9, compute_while_loading=True)  # a block loads in 1.26 ms at p95, computes in 0.8 ms
    ctx = AdmissionContext(block_bytes=BLOCK_BYTES)
    d = c.propose(pm(0, 40), ctx)
    assert d.loads and 0 < d.split_blocks < d.load_blocks
    k, s = d.load_blocks, d.split_blocks
    assert c.evaluate(0, 40, k, B, ctx, s)["benefit_s"] > 0
    assert c.evaluate(0, 40, k, B, ctx, s - 1)["benefit_s"] <= 0, "one block less of front would not beat recompute"
    c95 = c.model.coefficients(0.95, "pool")
    c50 = c.model.coefficients(0.5, "pool")
    remote = c95.remote((k - s) * BLOCK_BYTES, k - s, 0.0) + c50.interference_s_per_byte * (k - s) * BLOCK_BYTES
    front = c50.recompute(0, s * B)
    assert d.compute_after_s == pytest.approx(remote - front)


def test_recompute_is_charged_to_the_requests_a_busy_replica_will_queue():
    """externality = requests queued now + rho / (1 - rho): the recompute side of the inequality grows with it, so a load
    that loses on an idle replica wins on a busy one."""
    ctx = AdmissionContext(block_bytes=BLOCK_BYTES, prefill_queue_requests=2, prefill_utilisation=0.75)
    assert ctx.externality == pytest.approx(2 + 3.0)
    assert AdmissionContext(block_bytes=BLOCK_BYTES, prefill_utilisation=1.0).externality == pytest.approx(99.0), "rho capped at 0.99"
    assert AdmissionContext(block_bytes=BLOCK_BYTES).externality == 0.0
    c = controller(bw=0.6e9, ttft_slo_s=0.0)
    idle = c.decide(pm(0, 32), AdmissionContext(block_bytes=BLOCK_BYTES))
    assert not idle.loads
    busy = c.decide(pm(0, 32), AdmissionContext(block_bytes=BLOCK_BYTES, prefill_utilisation=0.75))
    assert busy.loads
    t = busy.terms
    assert t["t_recompute_only_s"] == pytest.approx(t["t_recompute_p50_s"] * (1 + 3.0))
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ConfigError, match="prefill_utilisation"):
            AdmissionContext(block_bytes=BLOCK_BYTES, prefill_utilisation=bad)


def test_a_load_whose_predicted_ttft_equals_the_p95_target_is_within_it():
    """The target is inclusive: one remote block (one extent, one plan) slower than recompute, with the target set to
    exactly its predicted TTFT, is taken as within_slo (a strict < refused it; no test set the target at the bound)."""
    m = pm(0, 1, tokens=4 * B + 3)
    ctx = AdmissionContext(block_bytes=BLOCK_BYTES)
    d = controller(bw=0.05e9, ttft_slo_s=0.0).decide(m, ctx)
    assert not d.loads and d.reason == "slower_than_recompute"
    at = controller(bw=0.05e9, ttft_slo_s=d.terms["ttft_p95_s"]).decide(m, ctx)
    assert at.loads and at.reason == "within_slo" and at.load_blocks == 1
    # two extents, both slower than recompute: the search takes the larger (it saves more) when its TTFT is exactly the
    # target, not only the smaller one that is under it
    m2 = pm(0, 2, tokens=4 * B + 3)
    both = controller(bw=0.05e9, ttft_slo_s=1e6).decide(m2, ctx)
    assert both.reason == "within_slo" and both.load_blocks == 2
    exact = controller(bw=0.05e9, ttft_slo_s=both.terms["ttft_p95_s"]).decide(m2, ctx)
    assert exact.reason == "within_slo" and exact.load_blocks == 2


def test_a_load_slower_than_recompute_is_taken_only_within_the_p95_target():
    """The brief's inequality alone declines it; a p95 TTFT target (configured, or derived from the TTFTs the engine
    reports) takes it when the request's predicted TTFT stays within the target: its delay cannot move the p95."""
    m = pm(0, 8, tokens=8 * B + 3)
    ctx = AdmissionContext(block_bytes=BLOCK_BYTES)
    strict = controller(bw=0.6e9, ttft_slo_s=0.0)
    d = strict.decide(m, ctx)
    assert not d.loads and d.reason == "slower_than_recompute"
    predicted = d.terms["ttft_p95_s"]
    assert controller(bw=0.6e9, ttft_slo_s=predicted * 1.01).decide(m, ctx).reason == "within_slo"
    assert not controller(bw=0.6e9, ttft_slo_s=predicted * 0.99).decide(m, ctx).loads
    derived = controller(bw=0.6e9)
    assert derived.slo_s() == 0.0, "no target before min_samples TTFTs"
    for _ in range(derived.model.min_samples - 1):
        derived.observe_ttft(2 * predicted)
    assert not derived.decide(m, ctx).loads
    derived.observe_ttft(2 * predicted)
    assert derived.slo_s() == pytest.approx(2 * predicted, rel=0.05)
    got = derived.decide(m, ctx)
    assert got.loads and got.reason == "within_slo" and got.terms["ttft_slo_s"] == derived.slo_s()
    # within the target, the plan that saves the most GPU seconds: the plain load, not the split that beats recompute
    split_wins = controller(bw=2.5e9, compute_while_loading=True, ttft_slo_s=0.0).propose(pm(0, 40), ctx)
    assert split_wins.loads and split_wins.split_blocks > 0
    within = controller(bw=2.5e9, compute_while_loading=True, ttft_slo_s=10.0).propose(pm(0, 40), ctx)
    assert within.loads and within.split_blocks == 0 and within.load_blocks == 40 and within.reason == "within_slo"
    with pytest.raises(ConfigError, match="ttft_s"):
        derived.observe_ttft(float("nan"))
    with pytest.raises(ConfigError, match="ttft_slo_s"):
        AdmissionConfig(ttft_slo_s=-1.0)
    with pytest.raises(ConfigError, match="gpu_s_price"):
        AdmissionConfig(gpu_s_price=float("nan"))


# ------------------------------------------------------------------------------------------- publishing: dueling


def _req(i, n_blocks, t, local=0):
    return PublishRequest(request_id=i, num_tokens=n_blocks * B + 1, block_size_tokens=B, time_s=t, reused_blocks=local, local_blocks=local)


def _duel(cands, cap, **kw):
    return DuelingPublish(block_bytes=BLOCK_BYTES, recompute_s=lambda depth: 0.01, write_bytes_per_s=BLOCK_BYTES / 0.004,
                          pool_capacity_blocks=cap, candidates=cands, **kw)


def test_the_ghost_scores_are_the_briefs_e_benefit_worked_by_hand():
    """The brief's terms, by default: a block served from a ghost saves its recompute less its load (0.01 − 0.004 s
    here: the read path runs at the write's rate); a block written costs its link time (0.004 s) times the chance that
    the rule's writes go unread — with no record yet, ½: 0.002 up front — until its first read pays that back
    (P_write is publishing blocks nobody read; the rest of the price waits until a write proves unread)."""
    f = _duel(("all", "threshold-2"), cap=10)
    keys = ["a", "b", "c"]
    for i, t in ((1, 0.0), (2, 1.0), (3, 2.0)):
        r = _req(i, 3, t)
        f.observe(r, keys)
        f.publishable(r, keys)
    d = math.exp(-math.log(2) / 600.0)  # one second of the 600 s half-life
    # all: wrote 3 at request 1 (-0.006 up front); served 3 at request 2 (+0.018) and their first reads paid back what
    # their writes were charged (+0.006); served 3 again at request 3 (+0.018), nothing more paid back
    assert f.scores[0] == pytest.approx(((-0.006 * d) + 0.018 + 0.006) * d + 0.018)
    # threshold-2: request 2 writes 3 (its count reached 2; its own record still empty: ½ up front); request 3 reads them
    assert f.scores[1] == pytest.approx(-0.006 * d + 0.018 + 0.006)
    assert f.written_blocks == [3, 3] and f.served_s == pytest.approx([0.036, 0.018])
    assert f.leader_name == "all"
    assert list(f.ghosts[0].values()) == [True, True, True], "read since written"


def test_the_gpu_seconds_score_worked_by_hand():
    """score="gpu_s" (the spec dueling-gpu-s): a hit earns its whole recompute_s (0.01 s), every write costs 0.004 s,
    read or not."""
    f = _duel(("all", "threshold-2"), cap=10, score="gpu_s")
    keys = ["a", "b", "c"]
    for i, t in ((1, 0.0), (2, 1.0)):
        r = _req(i, 3, t)
        f.observe(r, keys)
        f.publishable(r, keys)
    decay = math.exp(-math.log(2) / 600.0)
    assert f.scores[0] == pytest.approx(-0.012 * decay + 0.03)
    assert f.scores[1] == pytest.approx(-0.012)
    assert f.written_blocks == [3, 3] and f.served_s == pytest.approx([0.03, 0.0])
    g = make_filter("dueling-gpu-s", block_bytes=BLOCK_BYTES, recompute_s=lambda d: 0.01)
    assert g.score == "gpu_s" and make_filter("dueling", block_bytes=BLOCK_BYTES, recompute_s=lambda d: 0.01).score == "e_benefit"


def test_a_hit_is_worth_nothing_when_its_load_is_slower_than_its_recompute():
    """read_bytes_per_s slow enough that a block loads in 0.02 s, slower than its 0.01 s recompute: a ghost hit saves
    nothing (the admission controller would recompute it), and its write is still paid back by the read."""
    f = _duel(("all",), cap=10, read_bytes_per_s=BLOCK_BYTES / 0.02)
    for i in (1, 2):
        r = _req(i, 2, float(i))
        f.observe(r, ["a", "b"])
        f.publishable(r, ["a", "b"])
    assert f.served_s == [0.0]
    assert f.scores[0] == pytest.approx(-0.004 * math.exp(-math.log(2) / 600.0) + 0.004)  # 2 writes, ½ of 0.004 each up front


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 12), min_size=1, max_size=6, unique=True), st.integers(0, 3), st.floats(0.0, 30.0),
                          st.integers(0, 3)), min_size=1, max_size=40))
def test_every_write_is_charged_exactly_its_fate(reqs):
    """Undecayed (a half-life far longer than the stream), with evictions (capacity 5: by writes, and by what pulls
    leave), reads by pulls, and read windows that close (requests up to 30 s apart): score = served − the writes'
    charges, where a write read at any time costs nothing, one that proved unread (evicted or its window closed) and was
    not read after costs its whole price, and one still pending what it was charged up front — none paid back twice,
    none charged twice."""
    f = _duel(("all", "threshold-2"), cap=5, half_life_s=1e12)
    t = 0.0
    for i, (keys, local, gap, peer) in enumerate(reqs):
        t += gap
        r = attrs.evolve(_req(i, len(keys), t, local=min(local, len(keys))), peer_blocks=peer)
        f.observe(r, keys)
        f.publishable(r, keys)
    from kvpolicy.publish.dueling import _Writes

    for c in range(2):
        ghost = f.ghosts[c]
        pending = sum(w.up_front_s for w in f._pending[c] for k in w.keys if ghost.get(k) is w)
        assert f.scores[c] == pytest.approx(f.served_s[c] - f.write_cost_s * f._unread[c] - pending, abs=1e-9)
        assert 0 <= f._unread[c] and f._reads[c] + f._unread[c] <= f.written_blocks[c]
        for v in ghost.values():  # what a ghost holds: read, a pending write (its window still open), or one charged in full
            assert v is True or type(v) is complex and v.real == pytest.approx(f.write_cost_s) or type(v) is _Writes and v in f._pending[c]


def test_a_write_is_charged_the_rest_once_it_proves_unread_and_a_late_read_pays_it_all_back():
    """threshold-0-like `all`, price 0.004: a write is charged ½ up front (no record yet); its read window (the
    half-life until a first read has been seen) closes unread: the other ½ is charged and the write counts as unread,
    so the next write is charged ⅔ up front. Read after all, it pays back all it was charged and counts as read. A write
    the ghost evicts unread is charged the rest at once."""
    f = _duel(("all",), cap=2, half_life_s=1e12)
    f.half_life_s = 10.0  # the window's bound (the scores' decay stays at 1e12 s: undecayed)
    r = _req(1, 1, 1.0)
    f.observe(r, ["a"])
    f.publishable(r, ["a"])
    assert f.scores[0] == pytest.approx(-0.002) and f.read_window_s == 10.0
    r = _req(2, 1, 12.0)  # past the window: a proved unread
    f.observe(r, ["x"])
    assert f.scores[0] == pytest.approx(-0.004) and f._unread == [1] and f.ghosts[0]["a"] == complex(0.004, 1.0)
    f.publishable(r, ["x"])  # x: ⅔ of 0.004 up front (1 unread, 0 read: (1 + 1) / (1 + 2))
    assert f.scores[0] == pytest.approx(-0.004 - 0.004 * 2 / 3)
    r = _req(3, 1, 13.0)
    f.observe(r, ["a"])  # a read at last: its whole 0.004 back, and a hit (0.01 − 0.004)
    assert f.scores[0] == pytest.approx(-0.004 * 2 / 3 + 0.006) and (f._reads, f._unread) == ([1], [0])
    assert f._read_delay_sum_s == pytest.approx(12.0) and f.read_window_s == pytest.approx(10.0), "3 × 12 s, at most the bound"
    f.publishable(_req(4, 1, 13.0), ["y"])  # y evicts x (capacity 2: a, read, is newer): x proves unread, the rest of it now
    assert list(f.ghosts[0]) == ["a", "y"] and f._unread == [1]
    # y: ⅓ up front ((0 + 1) / (1 + 2): written before x's eviction proved it unread), then x's rest, ⅓
    assert f.scores[0] == pytest.approx(-0.004 * 2 / 3 + 0.006 - 0.004 / 3 - 0.004 / 3)


def test_a_rule_whose_writes_are_read_is_charged_little_while_its_next_reads_are_on_the_way():
    """Once a rule's record shows its writes read (20 read, none unread), a new write costs it 1/22 of its price up
    front: the lag before its reads come no longer counts against it as if every write were wasted (the charge at write
    time, paid back at the read, ranked a rule that writes below one that writes nothing until its reads came in)."""
    f = _duel(("all",), cap=100, half_life_s=1e12)
    for i in range(20):
        r = _req(2 * i, 1, float(i))
        f.observe(r, [f"k{i}"])
        f.publishable(r, [f"k{i}"])
        f.observe(_req(2 * i + 1, 1, i + 0.5), [f"k{i}"])
    assert (f._reads, f._unread) == ([20], [0])
    assert f.read_window_s == pytest.approx(1.5), "3 × the 0.5 s from each write to its read"
    before = f.scores[0]
    f.observe(_req(100, 1, 30.0), ["new"])
    f.publishable(_req(100, 1, 30.0), ["new"])
    assert before - f.scores[0] == pytest.approx(0.004 / 22)


def test_scores_decay_with_their_half_life_and_every_request_is_decided_once():
    """Two seconds apart, a score decays by 2^(-2/600); each request counts once for the candidate that decided it."""
    f = _duel(("all", "threshold-2"), cap=10)
    for i, t in ((1, 0.0), (2, 2.0)):
        r = _req(i, 3, t)
        f.observe(r, ["a", "b", "c"])
        f.publishable(r, ["a", "b", "c"])
    # all: -0.006 at t=0 (its three writes, ½ up front), decayed over 2 s, then three hits (+0.018) and their writes paid back
    assert f.scores[0] == pytest.approx(-0.006 * 2 ** (-2 / 600) + 0.018 + 0.006, rel=1e-12)
    # request 1: all has just paid for its writes, threshold-2 leads; request 2: all leads
    assert f.decided == [1, 1] and sum(f.report()[c]["decided_requests"] for c in f.candidates) == 2


def test_a_shared_threshold_count_leaves_every_later_candidate_observing():
    """threshold-3 and threshold-2 share one count; a candidate after them (structure-aware here) still observes every
    request — it publishes at the second sighting, as one built alone does."""
    f = _duel(("threshold-3", "threshold-2", "structure-aware"), cap=10)
    alone = StructureAwarePublish()
    for i in range(3):
        r = _req(i, 2, float(i))
        f.observe(r, ["a", "b"])
        alone.observe(r, ["a", "b"])
        assert f.rules[2].publishable(r, ["a", "b"]) == alone.publishable(r, ["a", "b"])
    assert f.rules[2]._seen.keys() == alone._seen.keys() == {"a", "b"}


def test_a_ghost_is_an_lru_of_the_pools_size_that_reads_refresh():
    """Capacity 2: a, then b written; a read; c written evicts b (the least recently used), not a."""
    f = _duel(("all",), cap=2)
    for i, keys in enumerate((["a"], ["b"], ["a"], ["c"])):
        r = _req(i, len(keys), float(i))
        f.observe(r, keys)
        if i != 2:  # the read alone refreshes a (request 2 publishes nothing: an engine that observes and stops there)
            f.publishable(r, keys)
    assert list(f.ghosts[0]) == ["a", "c"]
    assert f.written_blocks == [3] and f.served_s == [pytest.approx(0.01 - f.load_s)]


def test_a_local_run_is_not_a_pool_read_in_the_ghosts():
    f = _duel(("all",), cap=10)
    r = _req(1, 3, 0.0)
    f.observe(r, ["a", "b", "c"])
    f.publishable(r, ["a", "b", "c"])
    r2 = _req(2, 3, 0.0, local=2)  # the replica held a, b itself: only c came from the pool
    f.observe(r2, ["a", "b", "c"])
    assert f.served_s == [pytest.approx(0.01 - f.load_s)]


def _continuation_stream(n):
    """Chains read exactly once more, by the next request (a conversation's next turn): only a rule that publishes at
    first sighting serves the re-read."""
    out = []
    for i in range(n):
        out.append((2 * i, [f"s{i}-{j}" for j in range(4)]))
        out.append((2 * i + 1, [f"s{i}-{j}" for j in range(4)] + [f"s{i}-{j}" for j in range(4, 6)]))
    return out


def _scan_stream(n):
    """A hot document read by every 4th request amid unique one-off prompts: publishing everything writes the one-offs
    for nothing; a count threshold writes the document once it repeats."""
    out = []
    for i in range(n):
        out.append((i, ["doc-0", "doc-1", "doc-2"] if i % 4 == 0 else [f"u{i}-{j}" for j in range(3)]))
    return out


@pytest.mark.parametrize("stream,winner", [(_continuation_stream(200), "all"), (_scan_stream(400), "threshold-2")])
def test_the_dueling_selector_converges_to_the_rule_that_wins_each_stream(stream, winner):
    f = _duel(("all", "threshold-2"), cap=64)
    decided = []
    for t, (i, keys) in enumerate(stream):
        r = _req(i, len(keys), float(t))
        f.observe(r, keys)
        f.publishable(r, keys)
        decided.append(f.leader_name)
    assert f.leader_name == winner
    assert decided[-len(decided) // 4:].count(winner) == len(decided) // 4, "it stays with the winner once it has learned"


def test_a_block_a_pull_serves_is_credited_to_no_rule_and_kept_as_read():
    """peer_blocks = 2: after the replica's own blocks, the first 2 were held by a peer — a pull serves them whatever is
    published. No ghost earns them; each ghost keeps them as the pull leaves them (written and read: no charge), so a
    later read from the pool is credited as usual. The block after them is served from the ghost as before."""
    f = _duel(("all", "threshold-2"), cap=10, half_life_s=1e12)
    r1 = _req(1, 3, 0.0)
    f.observe(r1, ["a", "b", "c"])
    f.publishable(r1, ["a", "b", "c"])  # all writes a, b, c (−0.012); threshold-2 nothing
    r2 = attrs.evolve(_req(2, 3, 1.0), peer_blocks=2)
    f.observe(r2, ["a", "b", "c"])
    hit = 0.01 - f.load_s
    # all: a, b came by a pull (no credit; their writes are paid back: read), c from its ghost (+hit, paid back)
    assert f.scores[0] == pytest.approx(-0.012 + 3 * 0.004 + hit)
    assert f.served_s == pytest.approx([hit, 0.0])
    # threshold-2: a, b kept as read, c (no peer had it, the rule had not written it) not served
    assert dict(f.ghosts[1]) == {"a": True, "b": True} and f.scores[1] == 0.0
    assert dict(f.ghosts[0]) == {"a": True, "b": True, "c": True} and f._reads == [3, 0], "all's three writes read: two by the pull"
    r3 = _req(3, 2, 2.0)
    before = list(f.scores)
    f.observe(r3, ["a", "b"])  # a pool read of what the pull left: credited to every ghost that kept it
    assert f.served_s == pytest.approx([3 * hit, 2 * hit])
    assert f.scores == pytest.approx([before[0] + 2 * hit, before[1] + 2 * hit]), "no write is paid back twice"


def test_what_a_pull_leaves_is_the_ghosts_newest_and_the_ghost_keeps_its_size():
    """Capacity 2: the rule wrote x (unread); a pull of a, b, c leaves them in every ghost as the most recently used,
    evicting the least recently used first — x, then a. A pull of a block the ghost already holds refreshes it. A
    peer_blocks past the request's blocks counts only its blocks."""
    f = _duel(("all",), cap=2, half_life_s=1e12)
    r0 = _req(0, 1, 0.0)
    f.observe(r0, ["x"])
    f.publishable(r0, ["x"])
    f.observe(attrs.evolve(_req(1, 3, 1.0), peer_blocks=3), ["a", "b", "c"])
    assert list(f.ghosts[0]) == ["b", "c"] and all(f.ghosts[0].values())
    f.observe(attrs.evolve(_req(2, 1, 2.0), peer_blocks=1), ["b"])  # pulled again: refreshed, c is now the oldest
    f.observe(attrs.evolve(_req(3, 1, 3.0), peer_blocks=5), ["d"])  # 5 said, 1 block: d alone
    assert list(f.ghosts[0]) == ["b", "d"]
    f.observe(attrs.evolve(_req(4, 2, 4.0, local=1), peer_blocks=5), ["e", "g"])  # after 1 local block, 1 left: g alone
    assert list(f.ghosts[0]) == ["d", "g"]
    f.observe(attrs.evolve(_req(5, 2, 5.0, local=2), peer_blocks=3), ["e", "g"])  # all local: nothing came from a peer
    assert list(f.ghosts[0]) == ["d", "g"]
    assert f.served_s == [0.0]


def _second_sighting_stream(n, peer):
    """Each request's 4 leading blocks are read exactly once more, by the next request on another replica, while the
    first replica still holds them (``peer``: the directory says so, as PublishRequest.peer_blocks); its 2 tail blocks
    never are. Without pulls only a rule that publishes at first sighting serves the re-read (and pays for the tails);
    with them every rule is served, and writing at first sighting buys nothing but the tails' cost."""
    out = []
    for i in range(n):
        keys = [f"s{i}-{j}" for j in range(4)]
        out.append((_req(2 * i, 6, 2.0 * i), keys + [f"t{i}-0", f"t{i}-1"]))
        r = _req(2 * i + 1, 4, 2.0 * i + 1)
        out.append((attrs.evolve(r, peer_blocks=4) if peer else r, keys))
    return out


@pytest.mark.parametrize("peer,winner", [(False, "all"), (True, "threshold-2")])
def test_dueling_follows_the_rule_that_wins_once_pulls_serve_the_second_sighting(peer, winner):
    f = _duel(("all", "threshold-2"), cap=64)
    for r, keys in _second_sighting_stream(200, peer):
        f.observe(r, keys)
        f.publishable(r, keys)
    assert f.leader_name == winner
    if peer:
        assert f.served_s == [0.0, 0.0], "every re-read came by a pull: no rule earned it"


def test_peer_blocks_must_be_a_count_of_blocks():
    for bad in (-1, 1.5, True, None):
        with pytest.raises(ConfigError) as e:
            attrs.evolve(_req(1, 3, 0.0), peer_blocks=bad)
        assert e.value.field == "peer_blocks"


def test_dueling_is_built_by_name_and_refuses_what_cannot_be():
    f = make_filter("dueling", block_bytes=BLOCK_BYTES, recompute_s=lambda d: 0.01, pool_capacity_blocks=100, write_bytes_per_s=5e9)
    assert isinstance(f, DuelingPublish) and f.capacity == 100 and f.candidates == DuelingPublish.CANDIDATES
    for kw, field in ((dict(candidates=()), "candidates"), (dict(candidates=("dueling",)), "candidates"), (dict(candidates=("dueling-gpu-s",)), "candidates"),
                      (dict(candidates="all"), "candidates"), (dict(score="latency"), "score"), (dict(read_bytes_per_s=0), "read_bytes_per_s"),
                      (dict(pool_capacity_blocks=0), "pool_capacity_blocks"), (dict(half_life_s=float("nan")), "half_life_s")):
        with pytest.raises(ConfigError, match=field):
            DuelingPublish(block_bytes=BLOCK_BYTES, recompute_s=lambda d: 0.01, **kw)
    with pytest.raises(ConfigError, match="local_blocks"):
        PublishRequest(request_id=1, num_tokens=64, block_size_tokens=B, reused_blocks=1, local_blocks=2)


# ------------------------------------------------------------------------------------------- a write must beat its victim


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(st.integers(0, 30), min_size=1, max_size=6), min_size=1, max_size=60), st.integers(0, 30), st.integers(0, 30))
def test_a_write_worth_less_than_its_victim_is_refused(requests, candidate, victim):
    """With a sketch too wide to collide on 31 keys and no reset, the estimate is the exact count of requests containing
    the key (up to the 4-bit counter's 15): the candidate is admitted exactly when it was seen in more requests than its
    victim."""
    adm = WriteAdmission(capacity_blocks=10_000)  # sample_size 100,000: no reset here
    exact: dict[int, int] = {}
    for i, keys in enumerate(requests):
        adm.observe(i, keys)
        adm.observe(i, keys)  # the same request again counts nothing
        for k in set(keys):
            exact[k] = exact.get(k, 0) + 1
    def seen(k: int) -> int:
        return min(exact.get(k, 0), 15)

    assert adm.value(candidate) == seen(candidate)
    assert adm.admit(candidate, victim) == (seen(candidate) > seen(victim))
    assert adm.admit(candidate, None), "a write that displaces nothing is admitted"


def test_the_sketch_halves_every_count_after_sample_size_additions():
    sk = FrequencySketch(width=1024, depth=4, sample_size=8)
    for _ in range(7):
        sk.add("hot")
    assert sk.estimate("hot") == 7 and sk.resets == 0
    sk.add("cold")
    assert sk.resets == 1 and sk.estimate("hot") == 3 and sk.estimate("cold") == 0
    for _ in range(40):
        sk.add("x")
    assert sk.estimate("x") <= 15, "4-bit counters"


def test_the_gate_admits_a_leading_run_against_the_tiers_own_victims():
    """A full LRU tier of 4 blocks: 'old' (seen once) and 'hot' (seen 3 times) are its first victims. A candidate seen
    twice beats 'old' and loses to 'hot': the run stops there, prefix-closed; a tier with room takes everything."""
    tier = make_policy("lru", 4)
    for k in ("old", "hot", "x", "y"):
        tier.on_insert(k, 1, None)
    adm = WriteAdmission(capacity_blocks=4, sample_size=1000)
    for i in range(3):
        adm.observe(("hot", i), ["hot"])
    adm.observe("o", ["old"])
    for i in range(2):
        adm.observe(("c", i), ["c1", "c2", "c3"])
    assert tier.peek_victims(2) == ["old", "hot"]
    assert gate(tier, adm, ["c1", "c2", "c3"], 1) == 1
    assert adm.refused == 1
    roomy = make_policy("lru", 10)
    roomy.on_insert("z", 1, None)
    assert gate(roomy, adm, ["c1", "c2", "c3"], 1) == 3
    with pytest.raises(ConfigError, match="free_blocks"):
        adm.admit_run(["a"], [], free_blocks=-1)


def test_peek_is_none_where_pins_make_the_need_impossible_and_for_a_policy_that_must_choose_to_know():
    from kvpolicy.errors import CapacityError

    p = make_policy("lru", 12)
    for k in range(12):
        p.on_insert(k, 1, None)
        if k < 10:
            p.pin(k)
    assert p.peek_victims(2) == [10, 11] and p.peek_victims(3) is None
    with pytest.raises(CapacityError):
        p.victims(3)
    sieve = make_policy("sieve", 2)
    sieve.on_insert("a", 1, None)
    sieve.on_insert("b", 1, None)
    assert sieve.peek_victims(1) is None and sieve.peek_victims(0) == []
    with pytest.raises(ConfigError, match="need_bytes"):
        p.peek_victims(-1)


@settings(max_examples=80, deadline=None)
@given(st.sampled_from(["lru", "lfu", "gdsf", "reuse-distance", "fifo", "ttl"]),
       st.lists(st.tuples(st.sampled_from(["insert", "access", "pin", "unpin"]), st.integers(0, 25)), max_size=80),
       st.integers(1, 6))
def test_peek_names_exactly_the_victims_that_victims_then_evicts(name, ops, need):
    """peek_victims is pure and agrees with victims(): the same keys, in the same order (roots only, so no parent
    becomes a candidate midway), or None exactly when victims() would raise."""
    from kvpolicy.errors import CapacityError

    p = make_policy(name, 12)
    pinned: dict[int, int] = {}
    for op, k in ops:
        if op == "insert" and k not in p.nodes:
            try:
                p.victims(1)
            except CapacityError:
                continue
            p.on_insert(k, 1, None)
        elif op == "access" and k in p.nodes:
            p.on_access(k)
        elif op == "pin" and k in p.nodes:
            p.pin(k)
            pinned[k] = pinned.get(k, 0) + 1
        elif op == "unpin" and pinned.get(k):
            p.unpin(k)
            pinned[k] -= 1
    fill = 100
    while p.used_bytes < p.capacity_bytes:  # a full tier: every need names victims
        p.on_insert(fill, 1, None)
        fill += 1
    before = dict(p.nodes)
    peek = p.peek_victims(need)
    assert p.peek_victims(need) == peek and dict(p.nodes) == before, "peeking changes nothing"
    if peek is None:
        with pytest.raises(CapacityError):
            p.victims(need)
    else:
        assert p.victims(need) == peek


# ------------------------------------------------------------------------------------------- the simulator's new parts


def test_a_replicas_utilisation_is_its_busy_share_averaged_over_the_window():
    """One slot busy from 0 to 10 s, then idle: 1 − e^−1 at 10 s (window 10 s), that times e^−1 at 20 s."""
    from kvpolicy.sim.world import UTIL_WINDOW_S, _Replica

    assert UTIL_WINDOW_S == 10.0
    rep = _Replica(0, make_policy("lru", 10), 1, None, None, None)
    rep.utilisation(0.0)
    rep.free_slots = 0
    assert rep.utilisation(10.0) == pytest.approx(1 - math.exp(-1))
    rep.free_slots = 1
    assert rep.utilisation(20.0) == pytest.approx((1 - math.exp(-1)) * math.exp(-1))
    assert rep.utilisation(20.0) == pytest.approx((1 - math.exp(-1)) * math.exp(-1)), "reading it again changes nothing"


def test_the_pool_gate_cuts_a_chain_at_its_first_refused_block_whichever_node_holds_it():
    """Two nodes, each full; blocks 0-1 go to node 0 and beat its victim, block 2 goes to node 1 and loses: the write
    keeps blocks 0-1 and drops 2 and everything after it, on both nodes."""
    import attrs as _attrs

    from kvpolicy.sim import Prepared, Simulator, default_cluster, policy_set
    from kvpolicy.publish_sim import DEFAULT_PREFILL as P
    from kvpolicy.traces import generate, preset

    tr = generate(preset("chat", n_requests=20, block_size_tokens=64, seed=1))
    cl = default_cluster(tr, bytes_per_token=4096, prefill=P, storage_nodes=2)
    sim = Simulator(Prepared(tr), cl, _attrs.evolve(policy_set("kvpolicy"), write_admission="tinylfu"))
    n0, n1 = sim.pool.nodes
    bb = sim.pool.block_bytes
    for node, prefix in ((n0, "v0"), (n1, "v1")):
        pol = node.policy
        j = 0
        while pol.used_bytes + bb <= pol.capacity_bytes:
            pol.on_insert(f"{prefix}-{j}", bb, None)
            j += 1
    g = sim.pool.write_gate
    for i in range(3):
        g.observe(("hot", i), ["v1-0", "v1-1", "v1-2", "v1-3"])  # node 1's first victims are popular
        g.observe(("new", i), ["c0", "c1"])
    g.observe("once", ["c2", "c3"])
    order = [(0, n0), (1, n0), (2, n1), (3, n0)]
    out = sim.pool._gate_writes({n0: ["c0", "c1", "c3"], n1: ["c2"]}, order)
    assert out == {n0: ["c0", "c1"]}


def test_a_held_out_split_changes_no_decision_and_counts_only_the_second_half():
    """judge_from_request = k: the same run (every TTFT identical), with the figures of requests k onwards only."""
    import numpy as np

    from kvpolicy.sim import Prepared, Simulator, default_cluster, policy_set
    from kvpolicy.publish_sim import DEFAULT_PREFILL as P
    from kvpolicy.traces import generate, preset

    tr = generate(preset("mixed", n_requests=160, block_size_tokens=64, seed=4))
    cl = default_cluster(tr, bytes_per_token=4096, prefill=P, replicas=3, storage_nodes=2)
    prep = Prepared(tr)
    k = 80
    whole = Simulator(prep, cl, policy_set("kvpolicy")).run()
    half = Simulator(prep, cl, policy_set("kvpolicy"), judge_from_request=k).run()
    assert np.array_equal(whole.ttft_s, half.ttft_s), "judging changes nothing the policies do"
    assert half.quantile_ms(0.95) == pytest.approx(float(np.quantile(whole.ttft_s[k:], 0.95)) * 1e3)
    assert half.ledger.total_requests == len(tr) - k
    assert half.ledger.total_tokens == int(tr.input_tokens[k:].sum())
    assert whole.gpu_prefill_s == pytest.approx(whole.prefill_s.sum()) and np.array_equal(whole.prefill_s, half.prefill_s)
    assert half.gpu_prefill_s == pytest.approx(half.prefill_s[k:].sum()) and 0 < half.gpu_prefill_s < whole.gpu_prefill_s
    assert half.bytes_written < whole.bytes_written
    assert half.loads < whole.loads and half.row()["requests"] == len(tr) - k
    with pytest.raises(ConfigError, match="judge_from_request"):
        Simulator(prep, cl, policy_set("kvpolicy"), judge_from_request=len(tr))


def test_a_split_waiting_for_its_slot_starts_its_front_later_by_exactly_that_wait():
    """compute_after_s = remote(k − s) − W − front(s): W of queue wait already delays the front, so it is asked to
    start that much sooner after the load began (and never before 0)."""
    c = controller(bw=2.5e9, compute_while_loading=True)
    for wait in (0.0, 0.004):
        ctx = AdmissionContext(block_bytes=BLOCK_BYTES, queue_wait_s=wait)
        d = c.propose(pm(0, 40), ctx)
        assert d.loads and 0 < d.split_blocks < d.load_blocks
        k, s = d.load_blocks, d.split_blocks
        c95, c50 = c.model.coefficients(0.95, "pool"), c.model.coefficients(0.5, "pool")
        remote = c95.remote((k - s) * BLOCK_BYTES, k - s, 0.0) + c50.interference_s_per_byte * (k - s) * BLOCK_BYTES
        assert d.compute_after_s == pytest.approx(max(remote - wait - c50.recompute(0, s * B), 0.0))


def test_a_split_plan_charges_its_front_to_the_requests_behind():
    """plan(k, s) = max(W + front(s), remote(k − s)) + externality × front(s), with the externality from the queue and the
    replica's utilisation."""
    c = controller(bw=2.5e9, compute_while_loading=True)
    ctx = AdmissionContext(block_bytes=BLOCK_BYTES, prefill_queue_requests=1, prefill_utilisation=0.5)
    t = c.evaluate(0, 40, 40, B, ctx, 10)
    c95, c50 = c.model.coefficients(0.95, "pool"), c.model.coefficients(0.5, "pool")
    front = c50.recompute(0, 10 * B)
    remote = c95.remote(30 * BLOCK_BYTES, 30, 0.0) + c50.interference_s_per_byte * 30 * BLOCK_BYTES
    assert t["externality"] == pytest.approx(2.0)
    assert t["t_plan_s"] == pytest.approx(max(front, remote) + 2.0 * front)
    assert t["gpu_saved_s"] == pytest.approx(c50.recompute(0, 40 * B) - front)


def test_two_found_blocks_can_be_split_one_computed_one_loaded():
    """The smallest range that can be split: a plain load of 2 blocks loses, computing the first while the second loads
    wins."""
    c = controller(bw=2.5e9, compute_while_loading=True, ttft_slo_s=0.0)  # a block: 1.26 ms at p95, 0.8 ms of compute + 2 ms dispatch
    ctx = AdmissionContext(block_bytes=BLOCK_BYTES)
    assert not controller(bw=2.5e9, ttft_slo_s=0.0).propose(pm(0, 2), ctx).loads
    d = c.propose(pm(0, 2), ctx)
    assert d.loads and d.load_blocks == 2 and d.split_blocks == 1


def test_the_sketch_caps_its_counters_at_15_and_resets_every_sample_size_additions_exactly():
    sk = FrequencySketch(width=1024, depth=4, sample_size=1000)
    for _ in range(40):
        sk.add("x")
    assert sk.estimate("x") == 15, "4-bit counters stop at 15"
    sk = FrequencySketch(width=1024, depth=2, sample_size=5)
    for _ in range(5):
        sk.add("a")
    assert sk.resets == 1 and sk.estimate("a") == 2 and sk.additions == 0
    for _ in range(4):
        sk.add("b")
    assert sk.resets == 1, "the next reset comes after sample_size more additions, not one fewer"
    sk.add("b")
    assert sk.resets == 2 and sk.estimate("a") == 1 and sk.estimate("b") == 2
    other_seed = FrequencySketch(width=1024, depth=2, sample_size=5, seed=7)
    assert [other_seed._columns(k) for k in range(20)] != [sk._columns(k) for k in range(20)], "the seed moves the columns"


def test_a_sketch_spreads_keys_over_its_rows_independently():
    """Two rows that put most keys in the same column are one row: the overcount of a single row (Kirsch-Mitzenmacher
    needs an odd, key-dependent stride)."""
    sk = FrequencySketch(width=1 << 12, depth=4, sample_size=10**6)
    cols = [sk._columns(k) for k in range(2000)]
    for a in range(4):
        for b in range(a + 1, 4):
            same = sum(c[a] == c[b] for c in cols)
            assert same < 20, (a, b, same)
    assert len({c[0] for c in cols}) > 1500, "keys spread over the columns"


def test_a_key_sharing_one_rows_counter_with_a_frequent_key_is_not_counted_as_frequent():
    """Count-min overcounts a key only where every row collides: the rows hash independently of each other, so a key
    in the frequent key's column of one row (1 in 64 here) is almost never in it in the other three (a stride that
    does not depend on the key — columns h1, h1 + 1, h1 + 4, … — makes one row's collision every row's)."""
    sk = FrequencySketch(width=64, depth=4, sample_size=10**6)
    for _ in range(15):
        sk.add("frequent")
    inflated = sum(sk.estimate(k) > 0 for k in range(4000))
    assert inflated <= 3, f"{inflated} of 4,000 unseen keys estimated as seen"


def test_the_write_admission_sizes_its_sketch_from_the_tier_and_refuses_what_cannot_be():
    assert WriteAdmission(capacity_blocks=10).sketch.width == 1024, "at least 1024 columns"
    assert WriteAdmission(capacity_blocks=1000).sketch.width == 4096, "the next power of two >= 4 x the tier's blocks"
    assert WriteAdmission(capacity_blocks=1024).sketch.width == 4096
    assert WriteAdmission(capacity_blocks=1025).sketch.width == 8192
    assert WriteAdmission(capacity_blocks=100).sketch.sample_size == 1000, "TinyLFU's W = 10 x the tier"
    assert WriteAdmission(capacity_blocks=100, sample_size=7).sketch.sample_size == 7
    assert WriteAdmission(capacity_blocks=1 << 27).sketch.width == 1 << 28, "capped at 2**28 columns"
    for kw, field in ((dict(width=0), "width"), (dict(depth=0), "depth"), (dict(depth=17), "depth"), (dict(width=(1 << 28) + 1), "width"),
                      (dict(sample_size=0), "sample_size"), (dict(seed=-1), "seed")):
        with pytest.raises(ConfigError, match=field):
            FrequencySketch(**{"width": 64, "depth": 2, "sample_size": 10, **kw})
    FrequencySketch(width=64, depth=16, sample_size=1)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ConfigError, match="capacity_blocks"):
            WriteAdmission(capacity_blocks=bad)
    assert FrequencySketch(width=64, sample_size=10).depth == 4, "TinyLFU's (and Caffeine's) four rows by default"
    assert WriteAdmission(capacity_blocks=10).sketch.depth == 4


def test_the_write_gates_seed_seeds_its_sketch():
    """Two gates with different seeds hash keys to different columns (an adversary who knows one deployment's
    columns learns nothing of another's); the same seed, the same columns as a sketch of that seed."""
    a, b = WriteAdmission(capacity_blocks=10, seed=3), WriteAdmission(capacity_blocks=10, seed=4)
    same = FrequencySketch(width=1024, depth=4, sample_size=100, seed=3)
    assert [a.sketch._columns(k) for k in range(50)] == [same._columns(k) for k in range(50)]
    assert sum(a.sketch._columns(k) == b.sketch._columns(k) for k in range(50)) < 5


def test_the_write_admission_counts_what_it_decides_and_forgets_old_request_ids():
    adm = WriteAdmission(capacity_blocks=100, sample_size=10**6)  # no reset in this test
    adm.observe("r", ["a"])
    adm.observe("r", ["a"])
    assert adm.value("a") == 1
    for i in range(4096):
        adm.observe(i, ["z"])
    adm.observe("r", ["a"])  # 4,096 newer requests later, "r" is forgotten: seen again, it counts again
    assert adm.value("a") == 2
    adm2 = WriteAdmission(capacity_blocks=100, sample_size=10**6)
    for i in range(4096):
        adm2.observe(i, ["z"])
    adm2.observe(0, ["y"])  # exactly 4,096 held: the oldest is still remembered
    assert adm2.value("y") == 0
    assert adm.admit("a", None) and adm.admit("a", "z") is False
    assert (adm.admitted, adm.refused) == (1, 1)
    assert adm.admit_run(["p", "q"], None) == 2 and adm.admitted == 3, "a tier that cannot name its victims takes all"
    # two fit without a victim, the third meets 'a' (2 requests) and the fourth would need a victim there is not
    assert adm.admit_run(["a", "a", "z", "a"], ["a"], free_blocks=2) == 3 and adm.refused == 2
    assert adm.admit_run(["z", "z", "z"], ["a"], free_blocks=1) == 2 and adm.refused == 3, "no victim left for the third"


def test_the_gate_counts_the_tiers_free_blocks_in_blocks_not_bytes():
    tier = make_policy("lru", 40)  # blocks of 10 bytes: room for 4, 3 held
    for k in ("v1", "v2", "v3"):
        tier.on_insert(k, 10, None)
    adm = WriteAdmission(capacity_blocks=4)
    adm.observe(1, ["v1", "v2", "v3"])
    adm.observe(2, ["v1", "v2", "v3"])
    adm.observe(3, ["c1", "c2"])
    # c1 takes the free block; c2 (1 request) meets v1 (2 requests) and is refused
    assert tier.peek_victims(20) == ["v1"] and gate(tier, adm, ["c1", "c2"], 10) == 1
    assert gate(tier, adm, [], 10) == 0


# ------------------------------------------------------------------------------------------- admission, number by number
# (each pins what a mutant of tools/mutation.py changed without a test noticing)


def _one_load(c, ctx=None):
    d = c.decide(pm(0, 32), ctx or AdmissionContext(block_bytes=BLOCK_BYTES))
    assert d.loads
    return d


def test_the_bytes_ahead_drain_at_the_links_p50_rate():
    c = controller(bw=1e10)
    p = c.propose(pm(0, 32), AdmissionContext(block_bytes=BLOCK_BYTES))
    assert p.load_bytes == p.load_blocks * BLOCK_BYTES, "the proposal's bytes are its blocks' bytes"
    d = _one_load(c)
    assert c.queued_bytes("pool") == pytest.approx(d.load_bytes)
    s_per_byte = c.model.coefficients(0.5, "pool").s_per_byte
    c.clock.advance(0.5 * d.load_bytes * s_per_byte)
    assert c.queued_bytes("pool") == pytest.approx(0.5 * d.load_bytes, rel=1e-9)
    c.clock.advance(d.load_bytes * s_per_byte)
    assert c.queued_bytes("pool") == 0.0
    assert c.queued_bytes("another-source") == 0.0


@pytest.mark.parametrize("slack,refused", [(0, False), (-1, True)])
def test_the_queue_cap_refuses_only_what_waits_behind_more_than_it(slack, refused):
    probe = controller(bw=1e11)
    x = _one_load(probe).load_bytes
    c = controller(bw=1e11, max_queue_bytes_per_source=x + slack)
    _one_load(c)
    d = c.decide(pm(0, 32), AdmissionContext(block_bytes=BLOCK_BYTES, replica="replica-1"))
    assert (d.reason == "queue_full") == refused and d.loads != refused


def test_a_cancelled_load_gives_back_exactly_one_slot():
    c = controller(bw=1e11, max_loads_per_replica=2)
    a = _one_load(c)
    _one_load(c)
    assert c.decide(pm(0, 32), AdmissionContext(block_bytes=BLOCK_BYTES)).reason == "replica_cap"
    c.cancel(a.load_id)
    _one_load(c)
    assert c.decide(pm(0, 32), AdmissionContext(block_bytes=BLOCK_BYTES)).reason == "replica_cap"
    c = controller(bw=1e11, max_loads_per_source=2)  # the source's slots likewise, from two replicas
    a = _one_load(c, AdmissionContext(block_bytes=BLOCK_BYTES, replica="r0"))
    _one_load(c, AdmissionContext(block_bytes=BLOCK_BYTES, replica="r1"))
    c.cancel(a.load_id)
    _one_load(c, AdmissionContext(block_bytes=BLOCK_BYTES, replica="r2"))
    assert c.decide(pm(0, 32), AdmissionContext(block_bytes=BLOCK_BYTES, replica="r3")).reason == "source_cap"


def test_a_committed_load_passes_the_rails_and_says_so():
    c = controller(bw=1e11, max_loads_per_replica=1)
    ctx = AdmissionContext(block_bytes=BLOCK_BYTES)
    p1, p2 = c.propose(pm(0, 32), ctx), c.propose(pm(0, 32), ctx)  # the engine asked twice before admitting either
    first = c.admit(p1, ctx, committed=True)
    assert first.loads and first.reason != "committed", "nothing refused it: its own reason"
    second = c.admit(p2, ctx, committed=True)
    assert second.loads and second.reason == "committed", "the cap would have refused it"


def test_the_p50_and_p95_terms_read_their_own_quantiles():
    c = controller(bw=1e10)
    d = c.propose(pm(0, 32), AdmissionContext(block_bytes=BLOCK_BYTES))
    assert d.loads and d.split_blocks == 0
    n_bytes = d.load_blocks * BLOCK_BYTES
    assert d.terms["transfer_p95_s"] > d.terms["transfer_p50_s"], "the prior's p95 is slower than its p50"
    for tag, q in (("p50", 0.5), ("p95", 0.95)):
        co = c.model.coefficients(q, "pool")
        assert d.terms[f"transfer_{tag}_s"] == pytest.approx(co.transfer_overhead_s + co.s_per_byte * n_bytes)


def test_the_latency_model_learns_each_observation_as_its_formula_says():
    m = LatencyModel(LinkPrior(bandwidth_bytes_per_s=1e9), PREFILL, min_samples=8)
    staged = LatencyModel(LinkPrior(bandwidth_bytes_per_s=1e9, stage_bytes_per_s=4e9), PREFILL)
    assert staged.coefficients(0.5).stage_s_per_byte == pytest.approx(1 / 4e9), "a staging leg's prior: one over its rate"
    for q in (0.5, 0.95):
        assert m.t_recompute(0, 1000, q)["prefill_s"] == pytest.approx(m.prefill_seconds(0, 1000)), "an unfitted ratio is 1, p95 too"
    m.observe_interference(bytes_moved=1e3, stall_s=4.0, active_decodes=3)
    assert m.interference_per_byte.hist.quantile(0.5) == pytest.approx(4.0 / 1e3 / 4, rel=0.02), "per byte, per decode"
    m.observe_interference(bytes_moved=0, stall_s=0.1)  # nothing moved: nothing to learn, and no division
    m.observe_prefill(0, 0, 0.5)  # nothing computed: predicted 0
    n = m.prefill_ratio.hist.count
    m.observe_prefill_batch(1.0, 0.0)  # a pass of 0 seconds after its fixed part teaches nothing
    assert m.prefill_ratio.hist.count == n
    for _ in range(2):
        m.observe_load(bytes_loaded=2**20, n_blocks=1, transfer_s=1e-3, source="s")
    assert not m.transfer_for("s").fitted()
    m.observe_load(bytes_loaded=2**20, n_blocks=1, transfer_s=1e-3, source="s")
    assert m.transfer_for("s").fitted(), "a source's own fit takes over after max(min_samples // 4, 3) = 3 samples"
    m.observe_timeout(elapsed_s=1.0, bytes_loaded=1, source="t")
    assert "t" in m.timeout_floors, "a timed-out load of one byte still sets a floor"


def test_a_transfer_model_is_fitted_at_exactly_min_samples():
    from kvpolicy.admission import TransferModel

    t = TransferModel(LinkPrior(bandwidth_bytes_per_s=1e9), 3)
    for i in range(3):
        assert not t.fitted()
        t.observe(2**20, 1e-3)
    assert t.fitted()


def test_the_histograms_count_zeros_and_single_values():
    from kvpolicy.admission import LogHistogram
    from kvpolicy.admission.histogram import WindowedHistogram

    h = LogHistogram()
    h.record_many([5.0])
    assert h.count == 1 and h.quantile(0.5) == pytest.approx(5.0, rel=0.02)
    z = LogHistogram()
    z.record_many([0.0, 10.0])
    assert z.quantile(0.0) == 0.0 and z.quantile(1.0) == pytest.approx(10.0, rel=0.02), "rank 1 is past the one zero"
    a, b = LogHistogram(), LogHistogram()
    a.record_many([0.0, 0.0, 3.0])
    b.record_many([0.0, 7.0])
    a.merge(b)
    assert a.count == 5 and a.quantile(0.5) == 0.0 and a.quantile(0.75) == pytest.approx(3.0, rel=0.02), "three of five are 0"
    with pytest.raises(ConfigError, match="window_s"):
        WindowedHistogram(0.0, lambda: 0.0)


def test_breaker_and_ramp_bounds():
    from kvpolicy.admission import CircuitBreaker, RampController

    with pytest.raises(ConfigError, match="failure_threshold"):
        CircuitBreaker(failure_threshold=0)
    r = RampController(1.0, 100.0, initial_share=0.5, max_share=0.5)  # starting at the cap is allowed
    assert r.share == pytest.approx(0.5)


def _req_u(i, n_blocks, t, rho):
    return PublishRequest(request_id=i, num_tokens=n_blocks * B + 1, block_size_tokens=B, time_s=t, write_path_utilisation=rho)


@pytest.mark.parametrize("rho,price", [(0.0, 0.0), (0.5, 0.004), (0.8, 0.016), (1.0, 0.004 * 99), (None, 0.004)])
def test_a_write_is_priced_by_the_utilisation_of_its_path(rho, price):
    """Issue #58: a write costs the delay it imposes on the traffic sharing its path, t_write × ρ/(1 − ρ) — nothing on
    an idle link (the pool space it takes is paid in the ghost's lost re-reads), 4x t_write at 80 % (capped at ρ = 0.99);
    unknown ρ is the whole t_write. Charged ½ of it up front (no record yet), its first read pays back exactly what it
    was charged, whatever ρ is then."""
    f = _duel(("all",), cap=10, half_life_s=1e12)
    assert f.write_price_s(_req_u(0, 3, 0.0, rho)) == pytest.approx(price)
    r = _req_u(1, 3, 0.0, rho)
    f.observe(r, ["a", "b", "c"])
    f.publishable(r, ["a", "b", "c"])
    assert f.scores[0] == pytest.approx(-3 * price / 2)
    r2 = _req_u(2, 3, 1.0, 0.3)  # read at another utilisation: the charge of the write comes back, not today's price
    f.observe(r2, ["a", "b", "c"])
    assert f.scores[0] == pytest.approx(3 * (0.01 - f.load_s))
    gpu = _duel(("all",), cap=10, score="gpu_s")  # the GPU-seconds score keeps its flat charge
    assert gpu.write_price_s(_req_u(0, 3, 0.0, 0.0)) == gpu.write_cost_s


def test_on_an_idle_path_the_rule_that_serves_more_leads_however_much_it_writes():
    """On an idle path writing is free: in the continuation stream (each chain read once more, by the next turn) `all`
    serves what the count rule cannot and leads; in the scan stream (a hot document amid one-off prompts) `all`'s
    one-off writes cost nothing and it serves the document one read sooner, so it leads. On a path at 95 % every write
    costs 19 x t_write, and
    in the scan stream the rule that writes the one-offs loses — the old flat charge judged every path as busy."""
    for stream, rho, winner in ((_continuation_stream(60), 0.0, "all"), (_scan_stream(200), 0.0, "all"),
                                (_scan_stream(200), 0.95, "threshold-2")):
        f = _duel(("all", "threshold-2"), cap=100)
        for t, (i, keys) in enumerate(stream):
            r = _req_u(i, len(keys), float(t), rho)
            f.observe(r, keys)
            f.publishable(r, keys)
        assert f.leader_name == winner, (rho, f.report())
        if stream[0][1][0] == "doc-0" and rho == 0.0:
            assert f.scores[0] > f.scores[1] and f.written_blocks[0] > 3 * f.written_blocks[1]


def test_a_write_budget_keeps_every_leader_within_the_budget_rules_writes():
    """write_budget_rule: a candidate leads only while its ghost has written (decayed) no more blocks than the budget
    rule's — here `all` serves more on an idle path but writes more than threshold-2, so threshold-2 leads; without the
    budget `all` leads. A budget that is not a candidate is refused by name."""
    runs = {}
    for budget in (None, "threshold-2"):
        f = _duel(("all", "threshold-2"), cap=100, write_budget_rule=budget)
        for t, (i, keys) in enumerate(_continuation_stream(60)):
            r = _req_u(i, len(keys), float(t), 0.0)
            f.observe(r, keys)
            f.publishable(r, keys)
        runs[budget] = f
        assert f.written_decayed[0] > f.written_decayed[1] > 0
    assert runs[None].leader_name == "all" and runs["threshold-2"].leader_name == "threshold-2"
    assert runs["threshold-2"].scores[0] > runs["threshold-2"].scores[1], "it leads on the budget, not on the score"
    with pytest.raises(ConfigError) as e:
        _duel(("all", "structure-aware"), cap=10, write_budget_rule="threshold-2")
    assert e.value.field == "write_budget_rule"


def test_with_no_evidence_the_budget_rule_decides_not_the_first_candidate_listed():
    """Issue #58: the budget rule is the engine's own (threshold-2 for a set that pulls). Until another candidate has
    earned a higher score it decides — a tie, every score 0 at the start, used to go to the first candidate listed
    (structure-aware, which under KV-overlap routing writes nothing: on a random family it decided half the requests
    before the count rule's first reads came in). A candidate that has earned more still leads; without a budget the
    earliest keeps a tie."""
    f = _duel(("structure-aware", "threshold-3", "threshold-2", "all"), cap=100, write_budget_rule="threshold-2")
    assert f.leader_name == "threshold-2"
    r = _req_u(1, 3, 0.0, 0.0)  # idle path: the writes cost nothing, nothing is read yet — every score stays 0
    f.observe(r, ["a", "b", "c"])
    assert f.publishable(r, ["a", "b", "c"]) == 0 and f.scores == [0.0] * 4 and f.leader_name == "threshold-2"
    assert f.decided[f.candidates.index("threshold-2")] == 1
    f.scores[1] = 1e-9  # threshold-3 earned more (within the budget: it has written no more)
    assert f.leader_name == "threshold-3"
    assert _duel(("structure-aware", "threshold-2"), cap=100).leader_name == "structure-aware"


def test_a_candidate_that_wrote_exactly_the_budget_rules_blocks_is_within_the_budget():
    """The write budget is "no more blocks than the budget rule's": a candidate whose ghost wrote exactly as many
    (decayed) blocks as count-2's, and earned more, leads; one that wrote a block more does not, however much it earned.
    The bound allows float noise of a part in a billion, not a relative slack below the budget's own writes."""
    f = _duel(("threshold-3", "threshold-2"), cap=100, write_budget_rule="threshold-2")
    f.written_decayed[:] = [1000.0, 1000.0]
    f.scores[:] = [1.0, 0.5]
    assert f.leader_name == "threshold-3"
    f.written_decayed[0] = 1000.0 * (1 + 1e-10)  # the same writes, summed in another order
    assert f.leader_name == "threshold-3"
    f.written_decayed[0] = 1001.0
    assert f.leader_name == "threshold-2"


def test_the_gate_where_pins_leave_no_victims_to_name_admits_the_run_and_lets_the_tier_refuse():
    """Issue #60: a full tier whose blocks are pinned cannot name victims for the run (peek_victims is None): the gate
    admits the whole run — counted as admitted, nothing refused — and leaves it to the tier, which then has no room
    (victims raises). Where it names fewer victims than the run needs, the run stops at the first block without one
    (refused once). A gate that refused on None, or admitted past the named victims, breaks one of the two."""
    from kvpolicy.errors import CapacityError

    tier = make_policy("lru", 4)
    for k in ("a", "b", "c", "d"):
        tier.on_insert(k, 1, None)
        tier.pin(k)
    adm = WriteAdmission(capacity_blocks=4, sample_size=1000)
    for i in range(3):
        adm.observe(("c", i), ["c1", "c2"])
    assert tier.peek_victims(2) is None
    assert gate(tier, adm, ["c1", "c2"], 1) == 2 and (adm.admitted, adm.refused) == (2, 0)
    with pytest.raises(CapacityError):
        tier.victims(1)
    tier.unpin("d")  # one victim named for a run of two: the first candidate beats it, the second has none
    assert tier.peek_victims(2) is None and tier.peek_victims(1) == ["d"]
    assert adm.admit_run(["c1", "c2"], ["d"]) == 1 and adm.refused == 1


def test_dueling_reads_an_unknown_local_run_as_none_held():
    """Issue #60: a request whose replica did not say what it held itself (local_blocks None) is read from the pool
    from its first block: every ghost hit from block 0 counts (as local_blocks=0), none is taken for a local hit."""
    f = _duel(("all",), cap=10)
    r = _req(1, 3, 0.0)
    f.observe(r, ["a", "b", "c"])
    f.publishable(r, ["a", "b", "c"])
    unknown = PublishRequest(request_id=2, num_tokens=3 * B + 1, block_size_tokens=B, time_s=1.0, reused_blocks=0, local_blocks=None)
    f.observe(unknown, ["a", "b", "c"])
    assert f.served_s == [pytest.approx(3 * (0.01 - f.load_s))]
    g = _duel(("all",), cap=10)
    g.observe(r, ["a", "b", "c"])
    g.publishable(r, ["a", "b", "c"])
    g.observe(_req(2, 3, 1.0, local=1), ["a", "b", "c"])
    assert g.served_s == [pytest.approx(2 * (0.01 - g.load_s))], "a known local run is not a pool read"


def test_the_gate_admits_everything_into_a_tier_that_cannot_peek():
    """A tier without peek_victims (a tier of the engine's own, a cachetools cache) cannot say what a write would
    displace: the gate admits the whole run and the tier's own policy decides, as without a gate (a mutant of tools/
    mutation.py's new operators — the check and the call swapped — showed no test named it)."""
    adm = WriteAdmission(capacity_blocks=4, sample_size=1000)

    class Plain:  # no peek_victims
        capacity_bytes, used_bytes = 4, 4

    assert gate(Plain(), adm, ["c1", "c2", "c3"], 1) == 3 and (adm.admitted, adm.refused) == (3, 0)
    assert gate(Plain(), adm, [], 1) == 0


def test_the_write_budget_counts_decay_with_the_scores_half_life():
    """The budget compares decayed write counts (what is true now counts): a block written 600 s ago weighs half of one
    written now, as the scores do (a mutant dividing by the decay, so that old writes weighed more, went unnoticed)."""
    f = _duel(("all", "threshold-2"), cap=100, write_budget_rule="threshold-2")
    r = _req_u(1, 4, 0.0, 0.0)
    f.observe(r, ["a", "b", "c", "d"])
    f.publishable(r, ["a", "b", "c", "d"])
    assert f.written_decayed == [4.0, 0.0]
    later = _req_u(2, 1, 600.0, 0.0)
    f.observe(later, ["z"])
    assert f.written_decayed[0] == pytest.approx(2.0) and f.scores[0] == pytest.approx(0.0)


def test_dueling_refuses_to_decide_a_request_without_a_time_by_name():
    """Dueling decays its scores and closes its read windows on the request's time: a request without ``time_s``
    asked of it directly (never observed) is a ConfigError naming the field and dueling — even when no candidate keeps
    time itself (the count rules would take it), not an AssertionError from inside, and dueling, not the candidate that
    would have asked first (mutants that dropped the check, its ``timed``, or moved it after the candidates, lived)."""
    for cands in (("all", "threshold-2"), DuelingPublish.CANDIDATES):  # with structure-aware first, dueling is named
        f = _duel(cands, cap=10)
        with pytest.raises(ConfigError) as e:
            f.publishable(PublishRequest(request_id=1, num_tokens=3 * B + 1, block_size_tokens=B), ["a", "b", "c"])
        assert e.value.field == "time_s" and str(e.value).count("dueling") == 1 and "structure-aware" not in str(e.value)


def test_the_budgets_room_is_what_the_budget_rule_wrote_less_what_each_decisions_leader_wrote():
    """``budget_room_blocks``: the blocks the budget rule has written in its ghost, less those each decision's leader
    wrote in its own — what a writer outside the duel (the simulator's re-publication) may still spend. Not decayed
    (the bytes a run is judged on add up); a second call for the same request adds nothing; no budget: no bound."""
    f = _duel(("never", "threshold-2"), cap=100, write_budget_rule="threshold-2")
    keys = ["a", "b", "c"]
    r1 = _req_u(1, 3, 0.0, 0.0)
    f.observe(r1, keys)
    assert f.publishable(r1, keys) == 0 and f.budget_room_blocks == 0  # first sighting: nobody wrote
    f.scores[0] = 1e-9  # `never` has earned more: it leads the second sighting, which threshold-2 writes in its ghost
    r2 = _req_u(2, 3, 600.0, 0.0)
    f.observe(r2, keys)
    assert f.publishable(r2, keys) == 0 and f.leader_name == "never"
    assert f.budget_room_blocks == 3, "threshold-2 wrote 3, the leader none"
    assert f.publishable(r2, keys) == 0 and f.budget_room_blocks == 3, "the same request again"
    f.scores[0] = -1.0  # threshold-2 leads a third request: what it writes itself takes none of the room
    for i in (3, 4):
        r = _req_u(i, 4, 1200.0 * (i - 1), 0.0)
        f.observe(r, keys + ["d"])
        f.publishable(r, keys + ["d"])
    assert f.leader_name == "threshold-2" and f.written_blocks[1] == 4 and f.budget_room_blocks == 3
    assert _duel(("never", "threshold-2"), cap=100).budget_room_blocks == math.inf


@pytest.mark.parametrize("rho,price", [(None, 1.0), (0.0, 1.0), (0.5, 2.0), (0.8, 5.0), (1.0, 100.0)])
def test_a_gpu_second_is_priced_by_the_prefill_queue_it_shortens(rho, price):
    """Issue #58: a hit's saved recompute is worth 1/(1 − ρ_gpu) seconds of latency per second — the second itself and
    the wait it spares every request queued behind it (the same M/M/1 formula that prices a write on a link). Dueling
    credits a ghost's hit at that price: a rule that serves on an overloaded replica earns more than the same hit at
    idle. Unknown ρ: 1."""
    from kvpolicy.publish import gpu_price

    assert gpu_price(rho) == pytest.approx(price)
    f = _duel(("all",), cap=10)
    first = _req(1, 3, 0.0)
    f.observe(first, ["a", "b", "c"])
    f.publishable(first, ["a", "b", "c"])
    before = f.scores[0]
    again = PublishRequest(request_id=2, num_tokens=3 * B + 1, block_size_tokens=B, time_s=0.0, reused_blocks=0, local_blocks=0,
                           prefill_utilisation=rho)
    f.observe(again, ["a", "b", "c"])
    saved = 3 * (0.01 - f.load_s)
    assert f.served_s == [pytest.approx(saved)], "the undecayed report stays in GPU seconds"
    assert f.scores[0] - before == pytest.approx(saved * price + 3 * f.write_cost_s / 2), "3 hits at the GPU price, 3 writes paid back"
