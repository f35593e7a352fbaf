from collections import OrderedDict

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kvpolicy.analysis import (
    EffectiveCapacity,
    PrefixMRC,
    analyze,
    default_capacities,
    lru_hit_ratio_curve,
    prefix_groups,
    replica_view,
    request_stack_distances,
    request_stack_distances_reference,
    reuse_times_s,
    route,
    shards,
    stack_distances,
    stack_distances_reference,
    worst_window_rate,
)
from kvpolicy.errors import ConfigError
from kvpolicy.testing.strategies import prefix_traces
from kvpolicy.traces import Trace, first_appearance_ids, generate, preset

ids_st = st.lists(st.integers(0, 12), max_size=80).map(lambda x: first_appearance_ids(np.asarray(x, dtype=np.int64)))


@given(ids_st)
def test_stack_distances_equal_brute_force(ids):
    assert np.array_equal(stack_distances(ids), stack_distances_reference(ids))


@given(ids_st, st.data())
def test_weighted_stack_distances_equal_brute_force(ids, data):
    n = int(ids.max()) + 1 if ids.size else 1
    w = np.asarray(data.draw(st.lists(st.integers(0, 9), min_size=n, max_size=n)), dtype=np.int64)
    assert np.array_equal(stack_distances(ids, w), stack_distances_reference(ids, w))


def test_compaction_path_is_exercised():
    rng = np.random.default_rng(1)
    ids = first_appearance_ids(rng.integers(0, 30, 5000))  # tree of 2×30: compacts ~100 times
    assert np.array_equal(stack_distances(ids), stack_distances_reference(ids))


@given(prefix_traces())
def test_request_stack_distances_equal_brute_force(tr):
    assert np.array_equal(
        request_stack_distances(tr.block_offsets, tr.block_ids),
        request_stack_distances_reference(tr.block_offsets, tr.block_ids),
    )


def lru_prefix_cache_hits(tr, capacity):
    """Direct simulation: an LRU prefix cache, lookup then insert (tail first), prefix rule."""
    cache: OrderedDict = OrderedDict()  # last = most recent
    hits = 0
    for i in range(len(tr)):
        blocks = tr.blocks(i).tolist()
        m = int(tr.matchable_blocks[i])
        for b in blocks[:m]:
            if b in cache:
                hits += 1
            else:
                break
        for b in reversed(blocks):
            cache.pop(b, None)
            cache[b] = True
            while len(cache) > capacity:
                cache.popitem(last=False)
    return hits


@settings(max_examples=60)
@given(prefix_traces(), st.integers(1, 12))
def test_prefix_mrc_equals_direct_lru_simulation(tr, capacity):
    m = PrefixMRC.from_trace(tr)
    assert int(m.hit_blocks(np.array([capacity]))[0]) == lru_prefix_cache_hits(tr, capacity)


@given(prefix_traces())
def test_prefix_mrc_is_monotone_and_bounded(tr):
    m = PrefixMRC.from_trace(tr)
    caps = np.arange(1, 40)
    h = m.token_hit_ratio(caps)
    assert np.all(np.diff(h) >= 0)  # miss ratio never increases with capacity
    assert np.all(h <= m.ceiling_token_hit_ratio + 1e-12)
    assert m.ceiling_token_hit_ratio <= 1.0
    if m.ceiling_blocks:
        c90 = m.capacity_for(0.9)
        assert m.hit_blocks(np.array([c90]))[0] >= 0.9 * m.ceiling_blocks
        assert c90 == 1 or m.hit_blocks(np.array([c90 - 1]))[0] < 0.9 * m.ceiling_blocks


def test_lru_hits_iff_stack_distance_below_capacity():
    rng = np.random.default_rng(0)
    ids = first_appearance_ids(rng.zipf(1.3, 3000) % 200)
    d = stack_distances(ids)
    for cap in (1, 5, 20, 80):
        cache: OrderedDict = OrderedDict()
        for x, dist in zip(ids.tolist(), d.tolist()):
            hit = x in cache
            assert hit == (0 <= dist < cap)
            cache.pop(x, None)
            cache[x] = True
            if len(cache) > cap:
                cache.popitem(last=False)


def test_shards_rate_one_equals_exact_and_size_bound_too():
    rng = np.random.default_rng(2)
    ids = first_appearance_ids(rng.zipf(1.2, 20000) % 3000)
    caps = default_capacities(3000)
    exact = lru_hit_ratio_curve(stack_distances(ids), caps)
    assert np.allclose(shards(ids, rate=1.0).hit_ratio(caps), exact)
    assert np.allclose(shards(ids, s_max=10**6).hit_ratio(caps), exact)


def test_shards_approximates_on_uniform_ids():
    rng = np.random.default_rng(3)
    ids = first_appearance_ids(rng.integers(0, 20000, 300_000))
    caps = default_capacities(20000)
    exact = lru_hit_ratio_curve(stack_distances(ids), caps)
    for res in (shards(ids, rate=0.1, seed=1), shards(ids, s_max=4000, seed=1)):
        assert np.mean(np.abs(res.hit_ratio(caps) - exact)) < 0.02
    fs = shards(ids, s_max=2000)
    assert fs.final_rate < 0.2  # the threshold dropped to keep ≤ 2000 ids


def test_shards_arguments():
    with pytest.raises(ConfigError, match="exactly one"):
        shards(np.array([0, 1]))
    with pytest.raises(ConfigError, match="rate"):
        shards(np.array([0, 1]), rate=0.0)
    for bad in ([-1, 0], [0, 3, -1], list(range(40)) + [-2] + list(range(40))):  # first, last, mid-vector
        with pytest.raises(ConfigError, match="non-negative"):
            stack_distances(np.array(bad))
    with pytest.raises(ConfigError, match="rate"):
        shards(np.array([0, 1]), rate="0.5")  # a TypeError from the comparison
    with pytest.raises(ConfigError, match="s_max"):
        shards(np.array([0, 1]), s_max=10**30)  # an OverflowError entering the kernel
    with pytest.raises(ConfigError, match="ids must be dense"):
        stack_distances(np.array([2**63 - 1, 0]))  # a slot per id: numpy's "maximum allowed dimension exceeded"
    assert stack_distances(np.array([5, 3, 5])).tolist() == [-1, -1, 1]  # sparse but small is still fine


@given(prefix_traces(), st.integers(1, 5), st.sampled_from(["random", "round-robin", "prefix-affinity"]))
def test_replica_view_partitions_the_ceiling(tr, n, routing):
    v = replica_view(tr, n, routing, bytes_per_token=2)
    m = PrefixMRC.from_trace(tr)
    assert v.ceiling_tokens == m.ceiling_blocks * tr.block_size_tokens
    assert np.all(v.local_blocks <= v.global_blocks)
    assert v.local_tokens + v.cross_tokens == v.ceiling_tokens
    if n == 1:
        assert v.cross_tokens == 0
    assert np.all(v.write_reread_bytes <= v.write_all_bytes)
    assert v.read_bytes.sum() == v.cross_tokens * 2
    assert v.write_all_bytes.sum() == np.unique(tr.block_ids).size * tr.block_size_tokens * 2


def test_prefix_affinity_is_deterministic_and_keeps_shared_prefixes_together():
    tr = generate(preset("chat", n_requests=300))
    a = route(tr, 6, "prefix-affinity", affinity_blocks=2)
    assert np.array_equal(a, route(tr, 6, "prefix-affinity", affinity_blocks=2))
    keys = {}
    for i in range(len(tr)):
        b = tr.blocks(i)
        if b.size >= 2:
            assert keys.setdefault(int(b[1]), int(a[i])) == int(a[i])
    with pytest.raises(ConfigError, match="routing"):
        route(tr, 2, "sticky")  # type: ignore[arg-type]


def test_worst_window_and_reuse_times():
    t = np.array([0.0, 10.0, 20.0, 1000.0])
    v = np.array([1.0, 1.0, 1.0, 5.0])
    assert worst_window_rate(t, v, 900.0) == pytest.approx(5.0 / 900)
    assert worst_window_rate(t, v, 30.0) == pytest.approx(5.0 / 30)
    tr = Trace(arrival_s=[0.0, 2.0, 5.0], input_tokens=[2, 2, 2], output_tokens=[1, 1, 1], block_offsets=[0, 2, 4, 6], block_ids=[0, 1, 0, 2, 0, 1], partial_block_ids=[-1, -1, -1], block_size_tokens=1)
    assert reuse_times_s(tr).tolist() == [-1.0, -1.0, 2.0, -1.0, 3.0, 5.0]


def test_effective_capacity():
    c = EffectiveCapacity(100, 20, 5, 5)
    assert c.effective_bytes == 70 and c.effective_blocks(7) == 10
    with pytest.raises(ConfigError, match="physical_bytes"):
        EffectiveCapacity(10, 20)
    with pytest.raises(ConfigError, match="active_decode"):
        EffectiveCapacity.from_fractions(100, active_decode=1.5)


def test_analyze_verdicts():
    tr = generate(preset("chat", n_requests=400))
    r = analyze(tr, bytes_per_token=1024, replicas=4, local_capacity=EffectiveCapacity(2**40))
    assert r["verdict"] in ("enough local cache", "prefix-affinity routing", "a shared pool is worth a trial")
    assert r["mrc"] and all(0 <= row["token_hit_ratio"] <= r["ceiling_token_hit_ratio"] + 1e-12 for row in r["mrc"])
    # one replica with a huge cache: all reuse is local and fits
    one = analyze(tr, bytes_per_token=1024, replicas=1, local_capacity=EffectiveCapacity(2**40))
    assert one["verdict"] == "enough local cache"
    # a trace with no reuse
    n = 50
    no = Trace(arrival_s=np.arange(n, dtype=float), input_tokens=np.full(n, 64), output_tokens=np.ones(n, np.int64), block_offsets=np.arange(n + 1) * 4, block_ids=np.arange(4 * n), partial_block_ids=np.full(n, -1), block_size_tokens=16)
    assert analyze(no, bytes_per_token=1024)["verdict"] == "no reuse worth chasing"


@given(st.lists(st.integers(-1, 40), max_size=80), st.lists(st.integers(0, 45), min_size=1, max_size=6), st.booleans())
def test_hits_at_counts_exactly_the_distances_below_each_capacity(dists, caps, weighted):
    """An access with stack distance d hits an LRU cache of C blocks iff 0 <= d < C (d = -1: a first access)."""
    from kvpolicy.analysis.mrc import hits_at

    w = [1.0 + (i % 3) for i in range(len(dists))] if weighted else None
    got = hits_at(np.asarray(dists, dtype=np.int64), np.asarray(caps, dtype=np.int64), None if w is None else np.asarray(w))
    for c, g in zip(caps, got):
        want = sum((w[i] if w else 1.0) for i, d in enumerate(dists) if 0 <= d < c)
        assert g == pytest.approx(want)


def test_hits_at_on_a_capacity_boundary_and_the_far_path():
    from kvpolicy.analysis.mrc import hits_at

    assert list(hits_at(np.array([0, 1, 2, 2, 5]), np.array([0, 1, 2, 3, 6]))) == [0, 1, 2, 4, 5]
    far = np.array([0, 10**9, 3, 10**9 + 1])  # large distances take the sort path
    assert list(hits_at(far, np.array([1, 4, 10**9, 10**9 + 1, 10**9 + 2]))) == [1, 2, 2, 3, 4]


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 60), st.integers(1, 30_000), st.sampled_from([0.05, 0.3, 0.7]), st.integers(0, 5), st.integers(0, 2**32))
def test_shards_fixed_rate_is_the_exact_stack_distances_of_its_sample(n_ids, n, rate, seed, draw):
    """Fixed-rate SHARDS is exact on what it samples: its distances are the stack distances of the sampled ids'
    own substream (scaled by 1/R) — through compactions of its bit array too (a few ids over many accesses fill it)."""
    from kvpolicy.analysis.mrc import SHARDS_MODULUS, _id_hashes

    ids = first_appearance_ids(np.random.default_rng(draw).integers(0, n_ids, n))
    res = shards(ids, rate=rate, seed=seed)
    thr = max(1, int(round(rate * SHARDS_MODULUS)))
    sub = ids[_id_hashes(int(ids.max()) + 1, seed)[ids] < thr]
    ref = stack_distances(first_appearance_ids(sub)) if sub.size else np.zeros(0, dtype=np.int64)
    want = np.where(ref >= 0, np.floor(ref / (thr / SHARDS_MODULUS)).astype(np.int64), -1)
    assert res.sampled_accesses == sub.size and np.array_equal(res.scaled_distances, want)


@pytest.mark.parametrize("bad", [float("nan"), 1.5, 0, "131072"])
def test_reuse_summary_refuses_a_bytes_per_token_that_cannot_be(bad):
    """A NaN bytes_per_token made every byte figure of the summary NaN, without a word."""
    from kvpolicy.analysis.reuse import reuse_summary

    with pytest.raises(ConfigError, match="bytes_per_token"):
        reuse_summary(generate(preset("chat", n_requests=50, seed=1)), bad)


@pytest.mark.parametrize("field, value", [("local_share", float("nan")), ("min_ceiling", 2.0), ("max_imbalance", 0.5),
                                          ("max_imbalance", float("inf")), ("capacities_blocks", [1.5]), ("capacities_blocks", [True])])
def test_analyze_refuses_verdict_thresholds_that_cannot_be(field, value):
    """A NaN threshold failed every comparison and picked a verdict without a word; a capacity of 1.5 blocks was cut to 1."""
    with pytest.raises(ConfigError, match=field):
        analyze(generate(preset("chat", n_requests=50, seed=1)), bytes_per_token=1024, **{field: value})


def test_the_peak_rate_names_the_window_it_was_measured_over():
    """A trace shorter than the 15-minute window is its own window: the verdict said "the worst 0-minute window"."""
    n = 6
    tr = Trace(arrival_s=np.arange(n) * 1e-3, input_tokens=np.full(n, 64), output_tokens=np.ones(n, np.int64), block_offsets=np.arange(n + 1) * 4,
               block_ids=np.tile(np.arange(4), n), partial_block_ids=np.full(n, -1), block_size_tokens=16)
    r = analyze(tr, bytes_per_token=1024, replicas=4, local_capacity=EffectiveCapacity(2**10))
    pool = [x for x in r["verdict_reasons"] if "a shared pool would read" in x]
    assert pool and "over the whole trace (5 ms)" in pool[0] and "0-minute" not in pool[0]
    from kvpolicy.analysis.report import _window

    assert _window(900.0, 3600.0) == "at the worst 15-minute window" and _window(90.0, 3600.0) == "at the worst 90 s window"
    assert _window(0.0, 0.0) == "over the whole trace (0 ms)"


@pytest.mark.parametrize("call, field", [
    (lambda tr: route(tr, 4, "prefix-affinity", seed=float("nan")), "seed"),
    (lambda tr: route(tr, 4, "random", seed=1.5), "seed"),
    (lambda tr: route(tr, 4, affinity_blocks=0), "affinity_blocks"),
    (lambda tr: shards(np.arange(50) % 7, rate=0.5, seed=float("nan")), "seed"),
    (lambda tr: worst_window_rate(np.arange(5.0), np.ones(5), float("nan")), "window_s"),
    (lambda tr: worst_window_rate(np.arange(5.0), np.ones(5), float("inf")), "window_s"),
    (lambda tr: prefix_groups(tr, float("nan")), "bytes_per_token"),
    (lambda tr: prefix_groups(tr, 1024, depth_blocks=1.5), "depth_blocks"),
    (lambda tr: prefix_groups(tr, 1024, top=2.5), "top"),
])
def test_the_analysis_functions_refuse_inputs_that_cannot_be_naming_them(call, field):
    """A NaN seed went into the rendezvous and SHARDS hashes as a float; a NaN window answered NaN bytes/s and an
    infinite one 0; prefix_groups took a NaN bytes_per_token (every byte figure NaN) and failed deep in numpy on a
    fractional depth or top."""
    with pytest.raises(ConfigError, match=field):
        call(generate(preset("chat", n_requests=40, seed=1)))
