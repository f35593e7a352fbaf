import pytest
from hypothesis import given, settings, strategies as st

from kvpolicy.errors import ConfigError
from kvpolicy.warmup import HotPrefix, WarmupConfig, plan_warmup

prefixes_st = st.lists(
    st.tuples(st.integers(1, 64), st.integers(0, 50), st.floats(0.001, 2.0)), min_size=1, max_size=12
).map(lambda xs: [HotPrefix(prefix=f"p{i}", size_bytes=mb << 20, access_count=c, recompute_s=r) for i, (mb, c, r) in enumerate(xs)])
config_st = st.builds(
    WarmupConfig, replicas=st.integers(1, 6), window_s=st.floats(1, 60), bandwidth_bytes_per_s=st.floats(1e6, 5e9),
    current_load_bytes_per_s=st.floats(0, 1e9), max_loads_per_replica=st.integers(1, 3), max_loads_pool=st.integers(1, 6), min_access_count=st.integers(0, 5),
)


def concurrency(intervals):
    events = sorted([(s, 1) for s, e in intervals] + [(e, -1) for s, e in intervals], key=lambda x: (x[0], x[1]))
    cur = peak = 0
    for _, d in events:
        cur += d
        peak = max(peak, cur)
    return peak


@settings(max_examples=80)
@given(prefixes_st, config_st)
def test_caps_and_budget_hold_at_every_instant(prefixes, cfg):
    plan = plan_warmup(prefixes, cfg)
    sched = plan.schedule
    assert concurrency([(x.start_s, x.end_s) for x in sched]) <= cfg.max_loads_pool
    for r in range(cfg.replicas):
        assert concurrency([(x.start_s, x.end_s) for x in sched if x.replica == r]) <= cfg.max_loads_per_replica
    assert all(0 <= x.start_s < x.end_s <= cfg.window_s + 1e-9 for x in sched)
    assert sum(x.bytes for x in sched) <= cfg.available_bytes_per_s * cfg.window_s * (1 + 1e-9)
    # only measured hot prefixes are ever planned
    hot = {p.prefix for p in prefixes if p.access_count >= cfg.min_access_count}
    assert {x.prefix for x in sched} <= hot and set(plan.cold) == {p.prefix for p in prefixes} - hot


@settings(max_examples=60)
@given(prefixes_st, config_st)
def test_plans_are_deterministic(prefixes, cfg):
    assert plan_warmup(prefixes, cfg) == plan_warmup(list(prefixes), cfg)


def test_lower_value_prefixes_move_to_prefill_first():
    prefixes = [HotPrefix(prefix=f"p{i}", size_bytes=100 << 20, access_count=10, recompute_s=float(i + 1)) for i in range(6)]
    cfg = WarmupConfig(replicas=2, window_s=1.0, bandwidth_bytes_per_s=300 * 2**20, max_loads_per_replica=1, max_loads_pool=2)
    plan = plan_warmup(prefixes, cfg)
    for r in range(2):
        loaded = [x.prefix for x in plan.schedule if x.replica == r]
        left = plan.prefill[r]
        assert loaded and left
        value = {p.prefix: p.value_per_byte for p in prefixes}
        assert min(value[p] for p in loaded) >= max(value[p] for p in left)
    assert "cannot carry" in plan.verdict or "prefill" in plan.verdict
    assert plan.required_bytes_per_s > plan.available_bytes_per_s


def test_fits_readiness_hints_and_overlap():
    shared = ("b0", "b1")
    prefixes = [
        HotPrefix(prefix="sys", size_bytes=2 << 20, access_count=100, recompute_s=0.2, blocks=shared),
        HotPrefix(prefix="doc", size_bytes=4 << 20, access_count=50, recompute_s=0.3, blocks=shared + ("b2", "b3")),
        HotPrefix(prefix="rare", size_bytes=1 << 20, access_count=1, recompute_s=0.1),
    ]
    cfg = WarmupConfig(replicas=3, window_s=10, bandwidth_bytes_per_s=1e9, max_loads_per_replica=1, max_loads_pool=2, min_access_count=2)
    plan = plan_warmup(prefixes, cfg)
    assert plan.verdict.startswith("fits")
    assert plan.hot_bytes == 4 << 20  # the union of blocks, not 2 + 4 MiB
    for r in range(3):
        assert sum(x.bytes for x in plan.schedule if x.replica == r) == 4 << 20  # the shared blocks once
        assert plan.ready_at_s[r] is not None
    assert plan.cold == ("rare",)
    assert all(h["route_to_warm_until_s"] is not None for h in plan.routing_hints)
    d = plan.to_dict()
    assert set(d) >= {"required_gbps", "available_gbps", "schedule", "prefill", "verdict"}


def test_no_bandwidth_means_prefill():
    cfg = WarmupConfig(replicas=2, window_s=10, bandwidth_bytes_per_s=1e9, current_load_bytes_per_s=2e9)
    plan = plan_warmup([HotPrefix(prefix="a", size_bytes=1 << 20, access_count=5, recompute_s=0.1)], cfg)
    assert not plan.schedule and plan.prefill == {0: ("a",), 1: ("a",)} and plan.verdict.startswith("prefill")
    with pytest.raises(ConfigError, match="readiness_share"):
        WarmupConfig(replicas=1, window_s=1, bandwidth_bytes_per_s=1, readiness_share=0)
    with pytest.raises(ConfigError, match="size_bytes"):
        HotPrefix(prefix="x", size_bytes=0, access_count=1, recompute_s=1)


def test_a_plan_names_distinct_prefixes_of_the_right_type():
    """The same prefix listed twice was planned twice (its bytes counted twice in W); a string where the list goes
    was an AttributeError from inside the planner."""
    cfg = WarmupConfig(replicas=2, window_s=10, bandwidth_bytes_per_s=1e9)
    p = HotPrefix(prefix="a", size_bytes=1 << 20, access_count=5, recompute_s=0.1)
    with pytest.raises(ConfigError, match="'a' is listed twice"):
        plan_warmup([p, p], cfg)
    with pytest.raises(ConfigError, match="not a HotPrefix"):
        plan_warmup("ab", cfg)
    cold = HotPrefix(prefix="b", size_bytes=1 << 20, access_count=1, recompute_s=0.1)
    assert plan_warmup(iter([p, cold]), cfg).cold == ("b",) == plan_warmup([p, cold], cfg).cold  # a generator is read once


@pytest.mark.parametrize("field, value", [("size_bytes", 1.5), ("size_bytes", 0), ("access_count", float("inf")), ("access_count", 2.0),
                                          ("access_count", True), ("recompute_s", float("nan")), ("recompute_s", float("inf"))])
def test_a_hot_prefix_refuses_what_is_no_count_or_time(field, value):
    """A NaN recompute time made every prefix's value per byte NaN, and the plan's order arbitrary without a word."""
    kw = {"prefix": "p", "size_bytes": 1 << 20, "access_count": 3, "recompute_s": 0.1, field: value}
    with pytest.raises(ConfigError, match=field):
        HotPrefix(**kw)


@pytest.mark.parametrize("field, value", [("window_s", float("inf")), ("bandwidth_bytes_per_s", float("inf")),
                                          ("current_load_bytes_per_s", float("inf")), ("current_load_bytes_per_s", float("nan")),
                                          ("min_access_count", 1.5)])
def test_a_warmup_config_refuses_infinite_rates_and_windows(field, value):
    kw = {"replicas": 2, "window_s": 10.0, "bandwidth_bytes_per_s": 1e9, field: value}
    with pytest.raises(ConfigError, match=field):
        WarmupConfig(**kw)


@pytest.mark.parametrize("field, value", [("bytes_per_token", 1.5), ("bytes_per_token", float("nan")), ("min_access_count", -1), ("max_prefixes", 0)])
def test_hot_prefixes_from_a_trace_name_their_own_inputs(field, value):
    """A fractional bytes_per_token failed naming size_bytes, a HotPrefix field the caller never gave."""
    from kvpolicy.traces import generate, preset
    from kvpolicy.warmup import hot_prefixes_from_trace

    kw = {"bytes_per_token": 131072, "recompute_s": lambda tokens: 0.01, field: value}
    with pytest.raises(ConfigError, match=field):
        hot_prefixes_from_trace(generate(preset("chat", n_requests=50, seed=1)), **kw)
