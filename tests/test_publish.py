import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kvpolicy.errors import ConfigError
from kvpolicy.keys import BlockHasher
from kvpolicy.publish import (
    AllOf,
    BoundaryPublish,
    NeverPublish,
    CountMinSketch,
    PublishAll,
    PublishFilter,
    PublishRequest,
    ReuseAwarePublish,
    StructureAwarePublish,
    ThresholdPublish,
    WriteBudget,
    make_filter,
)

from helpers import ns

B = 4


def req(i, n_blocks, t=0.0, **kw):
    return PublishRequest(request_id=i, num_tokens=n_blocks * B + 1, block_size_tokens=B, time_s=t, **kw)


def reuse_aware(**kw):
    base = dict(block_bytes=1 << 20, recompute_s=lambda d: 0.01, write_bytes_per_s=1e9, index_s=0, eviction_s=0, half_life_s=600, lifetime_s=600)
    base.update(kw)
    return ReuseAwarePublish(**base)


@given(st.integers(1, 12), st.integers(1, 5), st.integers(0, 3))
def test_threshold_k_after_exactly_k_distinct_requests(n, k, extra):
    f = ThresholdPublish(k)
    chain = list(range(n))
    for i in range(k):
        keys = chain + [1000 + 10 * i + j for j in range(extra)]  # each request may extend the prefix differently
        r = req(i, len(keys))
        assert f.publishable(r, keys) < n or i >= k  # not yet before the k-th request is observed
        f.observe(r, keys)
        assert (f.publishable(r, chain) == n) == (i == k - 1)


@settings(max_examples=150)
@given(st.lists(st.lists(st.integers(0, 12), max_size=6), max_size=40), st.integers(1, 6), st.integers(1, 3))
def test_threshold_counts_are_bounded_like_an_lru_of_keys(requests, capacity, k):
    """With ``capacity_keys`` = c, a key's count survives while fewer than c other keys were seen since it was last
    seen (its LRU stack distance, computed here from the whole history) and starts again from 1 otherwise."""
    f = ThresholdPublish(k, capacity_keys=capacity)
    history: list[int] = []  # every counted sighting, in order
    want: dict[int, int] = {}
    for i, keys in enumerate(requests):
        for key in dict.fromkeys(keys):
            if key in history:
                last = len(history) - 1 - history[::-1].index(key)
                distance = len(set(history[last + 1:]) - {key})
                want[key] = want[key] + 1 if distance < capacity else 1
            else:
                want[key] = 1
            history.append(key)
        f.observe(req(i, len(keys)), keys)
        f.observe(req(i, len(keys)), keys)  # the same request again: counted once
        assert f.held_keys <= capacity
        for key in set(history):
            last = len(history) - 1 - history[::-1].index(key)
            held = len(set(history[last + 1:]) - {key}) < capacity
            assert f.count(key) == (want[key] if held else 0), key
            assert f.publishable(req(999, 1), [key]) == int(held and want[key] >= k)


def test_regression_vllm_52227_counting_per_lookup():
    """A threshold counted per lookup made an N-block prefix need 2N+1 repeats."""
    f = ThresholdPublish(2)
    chain = list(range(8))
    for i in range(2):
        r = req(i, 8)
        for j in range(1, 9):  # an engine that looks the prefix up block by block
            f.observe(r, chain[:j])
    assert f.publishable(req(99, 8), chain) == 8


def test_regression_sglang_30689_one_request_counted_once():
    f = ThresholdPublish(2)
    r = req(7, 3)
    for _ in range(5):
        f.observe(r, [1, 2, 3])
    assert f.count(1) == 1 and f.publishable(r, [1, 2, 3]) == 0
    ra = reuse_aware()
    for _ in range(5):
        ra.observe(r, [1, 2, 3])
    assert ra.sketch.estimate(1, 0.0) == pytest.approx(1.0)


def test_regression_lmcache_2206_never_a_partial_block():
    r = PublishRequest(request_id=1, num_tokens=10, block_size_tokens=B)  # 2 full blocks + 2 tokens
    for f in (PublishAll(), ThresholdPublish(1), BoundaryPublish(), reuse_aware()):
        with pytest.raises(ConfigError, match="partial"):
            f.publishable(r, [1, 2, 3])
    assert PublishAll().publishable(r, [1, 2]) == 2


@settings(max_examples=60)
@given(st.lists(st.tuples(st.sampled_from(["a", "b"]), st.sampled_from(["public", "shared", "internal", "private"]),
                          st.integers(0, 6), st.integers(0, 40)), min_size=1, max_size=25),
       st.sampled_from(["boundary", "boundary+reuse-aware", "boundary+threshold-2", "boundary+all", "boundary+structure-aware"]))
def test_tenancy_property(requests, spec):
    """No block beyond a boundary, of a private class, or of another tenant is ever published."""
    hashers = {t: BlockHasher(ns(tenant=t, block_size_tokens=B), "fast") for t in "ab"}
    kw = dict(block_bytes=1 << 20, recompute_s=lambda d: 1.0, write_bytes_per_s=1e12)
    f = make_filter(spec, **kw) if "reuse-aware" in spec else make_filter(spec)
    published: dict[bytes, str] = {}
    for i, (tenant, cls, n_blocks, boundary) in enumerate(requests):
        tokens = list(range(n_blocks * B + 1))
        keys = list(hashers[tenant].hash_blocks(tokens))
        r = PublishRequest(request_id=i, num_tokens=len(tokens), block_size_tokens=B, tenant=tenant, data_class=cls,
                           boundary_tokens=min(boundary, len(tokens)), time_s=float(i))
        f.observe(r, keys)
        n = f.publishable(r, keys)
        assert n <= min(boundary, len(tokens)) // B
        if cls == "private":
            assert n == 0
        for k in keys[:n]:
            assert published.setdefault(k, tenant) == tenant


@given(st.lists(st.tuples(st.integers(0, 50), st.floats(0, 1000)), max_size=200))
def test_count_min_never_undercounts(events):
    sk = CountMinSketch(width=64, depth=3, half_life_s=100.0)
    events = sorted(events, key=lambda e: e[1])
    for key, t in events:
        sk.add(key, t)
    now = events[-1][1] if events else 0.0
    lam = np.log(2) / 100.0
    for key in {k for k, _ in events}:
        want = sum(np.exp(-lam * (now - t)) for k, t in events if k == key)
        assert sk.estimate(key, now) >= want * (1 - 1e-9)


def test_count_min_rows_are_independent():
    """2,048 keys seen once in 4 rows of 1,024 columns: a key's overcount in one row is Poisson(2), ≥ 3 with probability
    0.32; the minimum of four independent rows is ≥ 3 for 0.32**4 ≈ 1 % of keys. Rows that share a column for most
    keys (the sketch's first hashing: 82 %) overcount as one row: ~28 % of keys here."""
    rng = np.random.default_rng(0)
    for keys in (rng.integers(0, 2**62, 2048).tolist(), [bytes(rng.integers(0, 256, 16, dtype=np.uint8)) for _ in range(2048)],
                 list(range(2048)), [b"tenant-a/block-" + str(i).encode() for i in range(2048)],  # one 8-byte prefix
                 [f"chunk:{i}" for i in range(2048)]):
        sk = CountMinSketch(width=1024, depth=4, half_life_s=1e9)
        for k in keys:
            sk.add(k, 0.0)
        over = np.array([sk.estimate(k, 0.0) - 1.0 for k in keys])
        assert (over >= 0).all()
        assert (over >= 2.5).mean() < 0.03, (over >= 2.5).mean()
        assert np.mean([len(set(sk._rows(k))) == 1 for k in keys]) < 0.01


def test_count_min_hashes_str_keys_the_same_in_every_process():
    """A str key's columns do not follow Python's per-process hash seed: two replicas (or two runs) count alike."""
    import subprocess
    import sys

    code = "from kvpolicy.publish import CountMinSketch; print(CountMinSketch()._rows('chunk:7'), CountMinSketch()._rows(('a', 1)))"
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**__import__("os").environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2")}
    assert len(outs) == 1, outs


def test_reuse_aware_keeps_unique_tails_out_and_publishes_reuse():
    f = reuse_aware()
    for i in range(300):  # unique single-use chains: the learned first-sighting probability falls
        keys = [10_000 + 10 * i + j for j in range(3)]
        r = req(i, 3, t=i)
        f.observe(r, keys)
    assert f.first_sighting_probability(req(999, 3)) == 0.5, "no window has closed yet: no evidence, the prior"
    f.observe(req(998, 3, t=1000.0), [90_000, 90_001, 90_002])  # every earlier window has closed now
    assert f.first_sighting_probability(req(999, 3)) < 0.05
    fresh = [1, 2, 3]
    r = req(1000, 3, t=1400.0)
    f.observe(r, fresh)
    assert f.publishable(r, fresh) == 0  # seen once: not yet
    r2 = req(1001, 3, t=1410.0)
    f.observe(r2, fresh)
    assert f.publishable(r2, fresh) == 3  # re-used soon after: worth the write


def test_reuse_aware_counts_a_block_only_once_its_window_has_closed():
    """'Not seen again yet' is not 'never seen again': a block re-read late in its window counts as reused."""
    f = reuse_aware(lifetime_s=100.0)
    for i in range(50):
        f.observe(req(i, 2, t=float(i)), [1000 + 2 * i, 1001 + 2 * i])
    for i in range(50):  # each chain is read again 90 s after it was made: inside its 100 s window
        f.observe(req(100 + i, 2, t=90.0 + i), [1000 + 2 * i, 1001 + 2 * i])
    f.observe(req(999, 1, t=500.0), [7])
    assert f.first_sighting_probability(req(5000, 2)) > 0.9
    late = reuse_aware(lifetime_s=100.0)
    for i in range(50):
        late.observe(req(i, 2, t=float(i)), [1000 + 2 * i, 1001 + 2 * i])
    for i in range(50):  # read again only after the window: not reuse within the lifetime
        late.observe(req(100 + i, 2, t=200.0 + i), [1000 + 2 * i, 1001 + 2 * i])
    late.observe(req(999, 1, t=500.0), [7])
    assert late.first_sighting_probability(req(5000, 2)) < 0.1


@given(st.lists(st.tuples(st.floats(0, 5), st.integers(0, 8)), min_size=1, max_size=40))
def test_write_budget_bounds_bytes(steps):
    wb = WriteBudget(PublishAll(), bytes_per_s=10.0, burst_bytes=20.0, block_bytes=5)
    t = 0.0
    written = 0
    for i, (dt, n) in enumerate(steps):
        t += dt
        written += 5 * wb.publishable(req(i, n, t=t), list(range(n)))
        assert written <= 20.0 + 10.0 * t + 1e-9


def test_allof_and_protocol():
    f = AllOf(ThresholdPublish(1), BoundaryPublish())
    assert isinstance(f, PublishFilter)
    r = req(1, 4, boundary_tokens=9)
    f.observe(r, [1, 2, 3, 4])
    assert f.publishable(r, [1, 2, 3, 4]) == 2
    with pytest.raises(ConfigError, match="unknown publish policy"):
        make_filter("sometimes")
    for spec in ("threshold-x", "threshold-0", "threshold--2", "threshold-", "threshold-²"):
        with pytest.raises(ConfigError, match=r"threshold-K needs a positive integer K, got '" + spec + "'"):
            make_filter(spec)
    assert make_filter("threshold-3").k == 3
    with pytest.raises(ConfigError, match="boundary_tokens"):
        PublishRequest(request_id=1, num_tokens=4, block_size_tokens=B, boundary_tokens=9)


def _sessions(f, n_sessions, turns, gap_s, new_per_turn=2, sys_blocks=3, t0=0.0, rid0=0):
    """Interleaved sessions: a shared system prompt, then each turn re-reads its history and adds new blocks.
    Returns (request, keys, published) per request."""
    out, rid = [], rid0
    for turn in range(turns):
        for sidx in range(n_sessions):
            t = t0 + turn * gap_s + sidx * (gap_s / n_sessions)
            hist = [("h", rid0, sidx, k) for k in range(turn * new_per_turn)]
            new = [("h", rid0, sidx, k) for k in range(turn * new_per_turn, (turn + 1) * new_per_turn)]
            keys = [("sys", k) for k in range(sys_blocks)] + hist + new
            r = PublishRequest(request_id=rid, num_tokens=len(keys) * B + 1, block_size_tokens=B, time_s=t,
                               reused_blocks=sys_blocks + len(hist) if turn or rid else 0)
            f.observe(r, keys)
            out.append((r, keys, f.publishable(r, keys)))
            rid += 1
    return out


def test_structure_aware_past_its_capacity_gives_up_on_its_oldest_first_sighting():
    """With room for 2 keys, a third new key pushes out the oldest one waiting for a second sighting: it is counted
    dead in its class (block 0 of a prompt: depth 0), not the newest (block 1 of its prompt: depth 1); and its watched
    first sighting goes with it, so both kept keys, seen again 4 s later, teach the window their delay."""
    f = StructureAwarePublish(capacity_keys=2)
    f.observe(req(0, 1, t=0.0), [10])  # key 10: depth 0
    f.observe(req(1, 2, t=1.0), [20, 21])  # keys 20 (depth 0) and 21 (depth 1): 10 is pushed out
    assert f.dead[f.block_class(req(9, 1), 0)] == 1 and sum(f.dead) == 1
    f.observe(req(2, 2, t=5.0), [20, 21])  # both seen again, 4 s after their first sighting
    assert f._n_delay == 2 and f._mean_delay_s == pytest.approx(4.0)  # both kept keys taught it


def test_structure_aware_waits_for_evidence_then_publishes_a_continuing_session_at_first_sighting():
    f = StructureAwarePublish()
    first = _sessions(f, n_sessions=1, turns=1, gap_s=10.0)
    assert first[0][2] == 0, "nothing seen before, no evidence yet: the prior (1/2 x 7/8) is under the bar"
    runs = _sessions(f, n_sessions=20, turns=6, gap_s=10.0, t0=100.0, rid0=1)
    late = runs[-20:]  # the last turn: every earlier turn of every session was continued
    assert all(n == len(keys) for _, keys, n in late), "a session that keeps continuing: its new blocks go out at first sighting"
    # the watch window follows the reuse delay: 3 x the 10 s turn gap (the first prompt's 100 s wait lifts the mean a little)
    assert 30.0 <= f.window_s < 40.0


def test_structure_aware_keeps_one_shot_tails_out_but_publishes_the_shared_prefix_on_its_second_sighting():
    f = StructureAwarePublish()
    published_tail = 0
    for i in range(400):  # one-shot requests: a shared 3-block prompt, then 4 blocks nobody reads again
        keys = [("sys", k) for k in range(3)] + [("tail", i, k) for k in range(4)]
        r = PublishRequest(request_id=i, num_tokens=len(keys) * B + 1, block_size_tokens=B, time_s=float(i), reused_blocks=3 if i else 0)
        f.observe(r, keys)
        n = f.publishable(r, keys)
        if i == 0:
            assert n == 0  # first sighting of everything, no evidence
        elif i >= 1:
            assert n >= 3  # the prompt was seen one request ago: published at its second sighting
        published_tail += max(n - 3, 0)
    assert published_tail == 0
    assert f.first_sighting_probability(f.block_class(r, 0)) < 0.05


def test_structure_aware_counts_exactly_where_a_sketch_would_not():
    """A Count-Min sketch of 2^18 columns over ~300k decayed sightings overcounts by about 3: unique keys look shared.
    The filter's exact table never does."""
    f = StructureAwarePublish()
    for i in range(3000):
        keys = [("u", i, k) for k in range(100)]
        r = PublishRequest(request_id=i, num_tokens=len(keys) * B + 1, block_size_tokens=B, time_s=i * 0.01)
        f.observe(r, keys)
    fresh = [("fresh", k) for k in range(5)]
    r = PublishRequest(request_id=10**6, num_tokens=21, block_size_tokens=B, time_s=30.0)
    f.observe(r, fresh)
    assert f.publishable(r, fresh) == 0
    assert all(v == pytest.approx(0.5 * 0.875 - 0.5) for v in f.values(r, fresh))  # the prior, not a phantom count


def test_structure_aware_knobs_are_validated():
    for kw, field in (({"cross_replica_share": 1.5}, "cross_replica_share"), ({"write_weight": 0.0}, "write_weight"),
                      ({"lifetime_s": 0}, "lifetime_s"), ({"capacity_keys": 0}, "capacity_keys"),
                      ({"cross_replica_share": True}, "cross_replica_share"), ({"lifetime_s": float("inf")}, "lifetime_s")):
        with pytest.raises(ConfigError) as e:
            StructureAwarePublish(**kw)
        assert e.value.field == field


def test_the_docs_publish_page_examples_run_and_print_what_they_say(capsys):
    """Every runnable python block of docs/publish.md (those that import kvpolicy; the others are signatures) runs, and
    each ``print(...)   # expected`` prints what its comment says."""
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "publish.md").read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", doc, flags=re.S) if "from kvpolicy" in b]
    assert len(blocks) >= 2
    for i, block in enumerate(blocks):
        expected = [m.group(1).split(":")[0].strip() for m in re.finditer(r"^print\(.*\)\s+#\s*(.+)$", block, flags=re.M)]
        exec(compile(block, f"docs/publish.md block {i}", "exec"), {})
        printed = capsys.readouterr().out.splitlines()
        assert [line.strip() for line in printed] == expected, (i, printed, expected)


@pytest.mark.parametrize("make, field", [
    (lambda: CountMinSketch(width=2.5), "width"),  # "cannot convert 'float' object to bytes" from array()
    (lambda: CountMinSketch(depth=10**30), "depth"),  # it hung, building 1e30 rows
    (lambda: CountMinSketch(half_life_s=float("nan")), "half_life_s"),  # accepted: every weight NaN
    (lambda: CountMinSketch(seed="x"), "seed"),
    (lambda: ReuseAwarePublish(block_bytes=1024, recompute_s=0.5), "recompute_s"),  # not callable: failed at the first verdict
    (lambda: ReuseAwarePublish(block_bytes=1024, recompute_s=lambda t: t, buckets=10**30), "buckets"),
    (lambda: ReuseAwarePublish(block_bytes=1024, recompute_s=lambda t: t, buckets="4"), "buckets"),  # not "str > int"
    (lambda: ReuseAwarePublish(block_bytes=1024, recompute_s=lambda t: t, sketch="x"), "sketch"),
    # a bool is not a count of tokens or blocks (True < 0 is False: only the type check refuses it)
    (lambda: PublishRequest(request_id=1, num_tokens=True, block_size_tokens=B), "num_tokens"),
    (lambda: PublishRequest(request_id=1, num_tokens=4 * B, block_size_tokens=B, reused_blocks=True), "reused_blocks"),
    (lambda: ReuseAwarePublish(block_bytes=1024, recompute_s=lambda t: t, index_s=float("nan")), "index_s"),
    (lambda: WriteBudget(PublishAll(), bytes_per_s=float("nan"), burst_bytes=1e6, block_bytes=1024), "bytes_per_s"),
    (lambda: WriteBudget(PublishAll(), bytes_per_s=1e6, burst_bytes=1e6, block_bytes=1024, value_floor_s="x"), "value_floor_s"),
])
def test_publish_options_are_refused_by_name(make, field):
    with pytest.raises(ConfigError) as e:
        make()
    assert e.value.field == field


def test_a_bad_count_in_a_publish_request_is_named_with_the_value_given():
    with pytest.raises(ConfigError) as e:
        PublishRequest(request_id=1, num_tokens=4 * B, block_size_tokens=B, peer_blocks=-3)
    assert e.value.field == "peer_blocks" and "got -3" in str(e.value)


def test_filters_that_run_on_time_refuse_a_request_without_one():
    """A request without time_s (the default) is refused, naming it, by every filter whose counts decay or windows
    close with time; the count and rule filters take it. (A default of 0 for every request let engine adapters feed
    reuse-aware counts that never decayed and structure-aware a window of 0 s.)"""
    r = PublishRequest(request_id=1, num_tokens=4 * B + 1, block_size_tokens=B)
    assert r.time_s is None
    keys = [1, 2, 3, 4]
    budget = WriteBudget(ThresholdPublish(1), bytes_per_s=1.0, burst_bytes=10.0, block_bytes=1)
    for f in (reuse_aware(), StructureAwarePublish(), budget):
        with pytest.raises(ConfigError) as e:
            f.observe(r, keys)
            f.publishable(r, keys)
        assert e.value.field == "time_s"
    for f in (reuse_aware(), StructureAwarePublish()):
        with pytest.raises(ConfigError, match="time_s"):
            f.values(r, keys)
    for f in (PublishAll(), NeverPublish(), ThresholdPublish(1), BoundaryPublish()):
        f.observe(r, keys)
        f.publishable(r, keys)
    with pytest.raises(ConfigError, match="time_s"):
        PublishRequest(request_id=1, num_tokens=4, block_size_tokens=B, time_s=float("nan"))


def test_reuse_aware_windows_mature_in_the_order_they_opened_however_a_request_is_observed():
    """Found by the publish-filter contract (distinct-request counting): a block the sketch had forgotten (one half-life
    after its first sighting) was recorded again in its old place in the queue of open windows, ahead of older ones.
    Maturing stops at the first window still open, so a filter that observed the request whole left windows of t=0
    unmatured that one observing it block by block had counted: the two learned different first-sighting odds and
    published different runs. The forgotten window is counted first and the new one opens at the back."""
    def run(noisy):
        f = reuse_aware()
        steps = [(1, 0.0, [("c", 0), ("c", 1), ("c", 2), ("c", 3), ("t", 1)], 2), (2, 127.0, [("c", 0), ("c", 1), ("t", 2)], 2),
                 (3, 601.0, [("c", 0), ("c", 1), ("c", 2)], 2), (4, 754.0, [("c", 0), ("t", 4)], 2)]
        out = []
        for i, t, keys, reused in steps:
            r = req(i, len(keys), t=t, reused_blocks=reused)
            if noisy:
                for j in range(1, len(keys) + 1):
                    f.observe(r, keys[:j])
            else:
                f.observe(r, keys)
            times = [o[1] for o in f._origin.values()]
            assert times == sorted(times), f"open windows out of order: {times}"
            out.append((f.publishable(r, keys), list(f.created), list(f.seen_again)))
        return out

    whole, by_block = run(False), run(True)
    assert whole == by_block
    assert whole[2][1] == [0.0, 5.0, 0.0, 0.0], "every window of t=0 matured at t=601 (the forgotten one first)"


def test_structure_aware_a_key_its_counts_forgot_inside_its_window_is_seen_again_not_created_again():
    """capacity_keys bounds the exact counts; a key they drop (least recently seen) may still have its window open.
    Seen again then, it is a second sighting of the class that created it — not a new block of the request seeing it."""
    f = StructureAwarePublish(capacity_keys=2, lifetime_s=600)
    f.observe(req(1, 1, t=0.0), [("a", 0)])
    f.observe(req(2, 1, t=0.1), [("x", 0)])
    f.observe(req(3, 1, t=1.0), [("x", 0)])  # x seen again: the window learns a 0.9 s delay (2.7 s)
    f.observe(req(4, 1, t=1.1), [("y", 0)])  # a third key: ("a", 0), least recently seen, leaves the counts
    assert ("a", 0) in f._origin and ("a", 0) not in f._seen, "its window is still open"
    before = list(f.reused)
    f.observe(req(5, 1, t=1.2), [("a", 0)])
    assert sum(f.reused) == sum(before) + 1 and ("a", 0) not in f._origin


@pytest.mark.parametrize("call, field", [
    (lambda c: c.add(b"k", float("nan")), "t_s"), (lambda c: c.add(b"k", "5"), "t_s"), (lambda c: c.add(b"k", 1.0, float("nan")), "amount"),
    (lambda c: c.add(b"k", 1.0, -1.0), "amount"), (lambda c: c.estimate(b"k", float("inf")), "t_s"),
])
def test_the_sketch_refuses_a_time_or_amount_that_would_poison_it(call, field):
    """One NaN time or amount made its columns NaN for good: every later estimate of every key sharing them was NaN."""
    from kvpolicy.publish import CountMinSketch

    c = CountMinSketch(width=64, depth=2)
    c.add(b"k", 1.0)
    with pytest.raises(ConfigError, match=field):
        call(c)
    assert c.estimate(b"k", 1.0) == pytest.approx(1.0)


# ----------------------------------------------------------------------------- the filters, number by number
# (each pins what a mutant of tools/mutation.py changed without a test noticing)

import math  # noqa: E402


def test_a_publish_request_takes_ints_at_their_least():
    PublishRequest(request_id=1, num_tokens=0, block_size_tokens=1)  # an empty request is a request
    for bad in (True, 2.0, -1):
        with pytest.raises(ConfigError) as e:
            PublishRequest(request_id=1, num_tokens=bad, block_size_tokens=B)
        assert e.value.field == "num_tokens"


def test_never_publishes_and_still_checks_its_input():
    f = NeverPublish()
    r = req(1, 3)
    f.observe(r, ["a", "b", "c"])
    assert f.publishable(r, ["a", "b", "c"]) == 0
    for call in (f.observe, f.publishable):
        with pytest.raises(ConfigError, match="keys"):
            call(r, ["a"] * 4)  # more keys than full blocks


def test_count_min_sketch_limits_and_columns():
    CountMinSketch(width=8, depth=64)  # the deepest allowed
    for kw in ({"width": (1 << 28) + 1}, {"depth": 65}):  # (the widest allowed, 2**28, would allocate 8 GiB at depth 4)
        with pytest.raises(ConfigError):
            CountMinSketch(**kw)
    sk = CountMinSketch(width=1 << 12, depth=4, seed=3)
    sk.add("k", 0.0)
    touched = [int(np.flatnonzero(np.frombuffer(r, dtype=np.float64))[0]) for r in sk._rows_data]
    assert touched == sk._rows("k"), "_rows names the columns add() writes"


def test_the_sketch_seed_is_mixed_not_masked():
    """key ^ seed: keys 0 and 1 stay apart under any seed (key | seed would merge every key into the seed's set bits)."""
    sk = CountMinSketch(width=1 << 16, depth=4, seed=1)
    for _ in range(5):
        sk.add(0, 0.0)
    assert sk.estimate(1, 0.0) == 0.0 and sk.estimate(0, 0.0) == pytest.approx(5.0)


def test_the_sketch_decays_correctly_across_a_rescale():
    sk = CountMinSketch(width=1 << 12, depth=4, half_life_s=1.0)
    sk.add("old", 0.0)
    sk.add("new", 100.0)  # 100 half-lives later: the table is rescaled to keep weights finite
    assert sk.estimate("new", 100.0) == pytest.approx(1.0)
    assert sk.estimate("new", 101.0) == pytest.approx(0.5)
    assert sk.estimate("old", 101.0) == pytest.approx(0.0, abs=1e-20)


def test_reuse_aware_bounds_and_the_write_delay_at_full_utilisation():
    reuse_aware(buckets=64)
    with pytest.raises(ConfigError):
        reuse_aware(buckets=65)
    f = reuse_aware(index_s=1e-4, eviction_s=1e-4)
    full = f.write_cost_s(req(1, 2, write_path_utilisation=1.0))
    assert full == pytest.approx(f.write_s * 0.99 / 0.01 + 2e-4), "a saturated path counts as 99 % busy, not as infinite"
    assert f.write_cost_s(req(1, 2, write_path_utilisation=0.5)) == pytest.approx(f.write_s + 2e-4), "rho / (1 - rho) at 0.5 is 1"


def test_reuse_aware_values_a_block_by_its_decayed_count():
    """values(): a block seen by c distinct requests (decayed) is worth P(read again) x cross share x its recompute
    seconds − the write's cost, with P = 1 - exp(-(c - 1) / half_life x lifetime) when c > 1.5 — here c = 4 at t = 0
    and 2 one half-life later (the sketch's count, not c + 1, which would call a block read once more than it was)."""
    f = reuse_aware(half_life_s=10.0, lifetime_s=20.0, cross_replica_share=1.0, recompute_s=lambda d: 2.0)
    for i in range(4):
        f.observe(req(i, 1, t=0.0), ["k"])
    cost = f.write_cost_s(req(9, 1, t=0.0))
    for t, c in ((0.0, 4.0), (10.0, 2.0)):
        assert f.sketch.estimate("k", t) == pytest.approx(c)
        want = (1.0 - math.exp(-(c - 1.0) / 10.0 * 20.0)) * 2.0 - cost
        assert f.values(req(9, 1, t=t), ["k"]) == [pytest.approx(want, rel=1e-12)]


def test_structure_aware_counts_decay_at_its_half_life():
    """values(): a block seen by c distinct requests (decayed) has P(read again) = 1 - exp(-(c - 1) / half_life x
    lifetime) when c > 1.5 — here c = 4 at t = 0 and 2 one half-life later."""
    f = StructureAwarePublish(half_life_s=10.0, lifetime_s=20.0, write_weight=0.5, cross_replica_share=1.0)
    for i in range(4):
        f.observe(req(i, 1, t=0.0), ["k"])
    for t, c in ((0.0, 4.0), (10.0, 2.0)):
        want = (1.0 - math.exp(-(c - 1.0) / 10.0 * 20.0)) - 0.5
        assert f.values(req(9, 1, t=t), ["k"]) == [pytest.approx(want)]
    with pytest.raises(ConfigError, match="write_weight"):
        StructureAwarePublish(write_weight=1.0)


def test_structure_aware_classes_by_hand():
    f = StructureAwarePublish()
    E = len(StructureAwarePublish.DEPTH_EDGES) + 1
    all_reused = PublishRequest(request_id=1, num_tokens=8 * B + 1, block_size_tokens=B, reused_blocks=8, time_s=0.0)
    assert f.block_class(all_reused, 0) == (StructureAwarePublish.REUSE_BUCKETS - 1) * E
    assert f.block_class(req(1, 8), 3) == 1 and f.block_class(req(1, 8), 4) == 2 and f.block_class(req(1, 8), 16) == 3
    empty = PublishRequest(request_id=2, num_tokens=0, block_size_tokens=B, time_s=0.0)
    assert f.block_class(empty, 0) == 0


def test_structure_aware_remembers_the_most_recently_seen_keys():
    f = StructureAwarePublish(capacity_keys=2, half_life_s=1e9, lifetime_s=1e9)
    f.observe(req(1, 1), ["a"])
    f.observe(req(2, 1), ["b"])
    assert set(f._seen) == {"a", "b"}, "exactly capacity_keys kept"
    f.observe(req(3, 1), ["a"])  # a seen again: the most recent
    f.observe(req(4, 1), ["c"])
    assert set(f._seen) == {"a", "c"}
    with pytest.raises(ConfigError, match="time_s"):
        f.publishable(PublishRequest(request_id=5, num_tokens=B + 1, block_size_tokens=B), ["a"])


def test_the_budget_floor_rises_as_the_bucket_empties():
    """A block is written while tokens last, and only if its value is at least value_floor_s x (1 - fill): a full
    bucket takes anything, a half-empty one only blocks worth half the floor."""

    class Valued(ReuseAwarePublish):  # reuse-aware's values (what the budget reads), fixed by hand
        def __init__(self, values):
            super().__init__(block_bytes=1, recompute_s=lambda d: 0.01)
            self._v = values

        def publishable(self, request, keys):
            return len(keys)

        def values(self, request, keys):
            return list(self._v[: len(keys)])

    bb = 100
    full = WriteBudget(Valued([0.1] * 4), bytes_per_s=1e-9, burst_bytes=4 * bb, block_bytes=bb, value_floor_s=1.0)
    assert full.publishable(req(1, 4), list("abcd")) == 1, "full: the first passes (floor x 0); then 3/4 full needs 0.25"
    half = WriteBudget(Valued([0.6, 0.6, 0.4, 0.4]), bytes_per_s=1e-9, burst_bytes=4 * bb, block_bytes=bb, value_floor_s=1.0)
    half.tokens = 2 * bb
    assert half.publishable(req(1, 4), list("abcd")) == 1, "half full needs 0.5; then a quarter full needs 0.75"


def test_a_composed_spec_is_every_part_at_once():
    f = make_filter("threshold-1+never")
    r = req(1, 2)
    f.observe(r, ["a", "b"])
    assert f.publishable(r, ["a", "b"]) == 0, "never, composed, vetoes"
    alone = make_filter("threshold-1")
    alone.observe(r, ["a", "b"])
    assert alone.publishable(r, ["a", "b"]) == 2


def test_structure_aware_decays_from_the_last_sighting_and_classes_a_one_block_request():
    f = StructureAwarePublish(half_life_s=10.0, lifetime_s=20.0, write_weight=0.5, cross_replica_share=1.0)
    for i in range(4):
        f.observe(req(i, 1, t=5.0), ["k"])
    want = (1.0 - math.exp(-(2.0 - 1.0) / 10.0 * 20.0)) - 0.5  # c = 4 halved once: ten seconds after t = 5
    assert f.values(req(9, 1, t=15.0), ["k"]) == [pytest.approx(want)]
    one = PublishRequest(request_id=1, num_tokens=B + 1, block_size_tokens=B, reused_blocks=1, time_s=0.0)
    assert f.block_class(one, 0) == (StructureAwarePublish.REUSE_BUCKETS - 1) * (len(StructureAwarePublish.DEPTH_EDGES) + 1)


def test_an_own_filter_must_observe_and_answer(tmp_path):
    (tmp_path / "myfilters.py").write_text(
        "class Good:\n    def __init__(self, block_bytes=0):\n        self.block_bytes = block_bytes\n"
        "    def observe(self, request, keys):\n        pass\n    def publishable(self, request, keys):\n        return len(keys)\n"
        "class Mute:\n    def publishable(self, request, keys):\n        return 0\n")
    good = make_filter(f"{tmp_path / 'myfilters.py'}:Good", block_bytes=7)
    assert good.block_bytes == 7 and good.publishable(req(1, 2), ["a", "b"]) == 2
    with pytest.raises(ConfigError, match="lacks observe/publishable"):
        make_filter(f"{tmp_path / 'myfilters.py'}:Mute")


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 6), st.integers(0, 3)), min_size=1, max_size=40))
def test_dueling_shares_one_count_between_its_thresholds_and_decides_as_separate_ones_would(reqs):
    """Differential (issue #48's speed-up): threshold-2 and threshold-3 inside dueling share one count, observed once;
    each still answers what a ThresholdPublish of its own, fed the same requests, answers; recompute_s is asked once
    per depth."""
    from kvpolicy.publish import DuelingPublish

    calls = []

    def rs(depth):
        calls.append(depth)
        return 0.001 * (depth + 1)

    d = DuelingPublish(block_bytes=1 << 20, recompute_s=rs, write_bytes_per_s=1e9, pool_capacity_blocks=6,
                       candidates=("threshold-3", "all", "threshold-2"))
    t3, t2 = d.rules[0], d.rules[2]
    assert t2._count is t3._count and len(d._observers) == 2, "one count, observed once"
    alone = {3: ThresholdPublish(3), 2: ThresholdPublish(2)}
    for i, (chain, n, local) in enumerate(reqs):
        keys = [(chain, j) for j in range(n)]
        r = req(i, n, t=float(i), reused_blocks=min(local, n), local_blocks=min(local, n))
        d.observe(r, keys)
        for f in alone.values():
            f.observe(r, keys)
        assert t3.publishable(r, keys) == alone[3].publishable(r, keys)
        assert t2.publishable(r, keys) == alone[2].publishable(r, keys)
        d.publishable(r, keys)
    assert sorted(set(calls)) == sorted(calls), "recompute_s asked once per depth"


def test_structure_aware_depth_classes_are_the_edges_reached():
    f = StructureAwarePublish()
    for i in range(64):
        assert f._depth(i) == sum(i >= e for e in StructureAwarePublish.DEPTH_EDGES), i


@settings(max_examples=100, deadline=None)
@given(reqs=st.lists(st.tuples(st.lists(st.integers(0, 40), min_size=1, max_size=24, unique=True), st.floats(0, 900),
                               st.integers(0, 10), st.booleans()), min_size=1, max_size=25))
def test_structure_aware_values_are_the_documented_formula(reqs):
    """values(): per block, P(reuse) × cross − write_weight with P = 1 − exp(−(ĉ − 1) / half_life × lifetime) when ĉ (the
    decayed count) > 1.5, else the first-sighting probability of the block's class — written out here from the
    docstring, beside the filter's fast loop (its depth table, its per-request class probabilities, no exp when no time
    has passed)."""
    f = StructureAwarePublish(capacity_keys=16)  # small: keys are forgotten too
    t = 0.0
    for i, (keys, dt, reused, look_first) in enumerate(reqs):
        t += dt
        r = req(i, len(keys), t, reused_blocks=min(reused, len(keys)))
        if look_first:
            f.observe(r, keys)
        want = []
        for j, key in enumerate(keys):
            rec = f._seen.get(key)
            c = rec.real * math.exp(-f._lam * max(t - rec.imag, 0.0)) if rec is not None else 0.0
            if c > 1.5:
                p = 1.0 - math.exp(-(c - 1.0) / f.half_life_s * f.lifetime_s)
            else:
                p = f.first_sighting_probability(f.block_class(r, max(j - r.reused_blocks, 0)))
            want.append(p * f.cross - f.write_weight)
        assert f.values(r, keys) == want
        new = [k for k in keys if k not in f._seen and k not in f._origin]
        f.observe(r, keys)
        for j, key in enumerate(keys):  # a first sighting is remembered in its class
            if key in new and key in f._origin:
                assert f._origin[key][0] == f.block_class(r, max(j - r.reused_blocks, 0))


def test_dedup_counts_each_request_block_pair_once():
    from kvpolicy.publish import _Dedup

    d = _Dedup(size=2)
    assert d.new_keys("r1", [3, 1, 3, 2]) == [3, 1, 2], "a first look: every key once, in order"
    assert d.new_keys("r1", [1, 4, 2, 5, 4]) == [4, 5], "a second look: only what it had not seen"
    assert d.new_keys("r2", []) == [] and d.new_keys("r3", [1]) == [1]
    assert d.new_keys("r1", [1]) == [1], "r1 is forgotten: only the newest 2 requests are kept"


def test_write_budget_refills_at_its_rate():
    """Emptied at t=5 s, a 10 B/s bucket of 5-byte blocks holds two blocks' worth 1 s later — the time since it was
    last asked, not the clock's reading — and never more than its burst."""
    wb = WriteBudget(PublishAll(), bytes_per_s=10.0, burst_bytes=20.0, block_bytes=5)
    assert wb.publishable(req(0, 8, t=5.0), list(range(8))) == 4, "the burst: 20 bytes"
    assert wb.shed_blocks == 4, "the blocks the rule allowed and the budget refused"
    assert wb.publishable(req(1, 8, t=6.0), list(range(8))) == 2, "10 bytes refilled in a second"
    assert wb.shed_blocks == 4 + 6
    assert wb.publishable(req(2, 8, t=105.0), list(range(8))) == 4, "never past the burst"
    assert wb.shed_blocks == 4 + 6 + 4


def test_two_requests_at_one_instant_count_a_shared_block_twice_exactly():
    """A block seen by two requests at the same time has ĉ = 2 exactly (no decay over no time)."""
    f = StructureAwarePublish()
    for i in (1, 2):
        f.observe(req(i, 2, 5.0), ["a", "b"])
    assert f._seen["a"].real == 2.0 and f._seen["a"].imag == 5.0
    f.observe(req(3, 2, 5.5), ["a", "b"])  # half a second later: decayed over that half second, then one more
    assert f._seen["a"].real == 2.0 * math.exp(-f._lam * 0.5) + 1.0


@pytest.mark.parametrize("build, field", [
    (lambda: ThresholdPublish(0), "k"), (lambda: ThresholdPublish(True), "k"), (lambda: ThresholdPublish("2"), "k"),
    (lambda: reuse_aware(eviction_s=-1.0), "eviction_s"),
])
def test_filters_refuse_bad_knobs_by_name(build, field):
    with pytest.raises(ConfigError) as e:
        build()
    assert e.value.field == field


def test_keys_must_be_a_sequence():
    class IndexOnly:  # indexable, but no length
        def __getitem__(self, i):
            return "abc"[i]

    for bad in ((k for k in "abc"), IndexOnly(), "abc"):
        with pytest.raises(ConfigError, match="keys"):
            PublishAll().publishable(req(1, 3), bad)
    assert PublishAll().publishable(req(1, 3), ("a", "b", "c")) == 3, "a tuple is a sequence"


def test_structure_aware_windows_close_at_their_boundary_once_and_a_late_sighting_teaches_nothing():
    """Hand-worked: blocks a, b made at t = 0 (lifetime 100 s); a seen again at t = 50 (reused, a 50 s delay: the window
    is min(100, 3 × 50) = 100 s). At t = 99.9 b's window is still open; at exactly t = 100 it closes — b counts dead
    once, and leaves the watch. Seen at t = 120, b is neither reused nor a delay. c (made at 99.9) stays open at 120."""
    f = StructureAwarePublish(lifetime_s=100.0, half_life_s=100.0)
    cls = f.block_class(req(1, 2), 0)  # a fresh request's first new block (b, its second, is in the next depth class)
    cls_b = f.block_class(req(1, 2), 1)
    f.observe(req(1, 2, t=0.0), ["a", "b"])
    f.observe(req(2, 1, t=50.0), ["a"])
    assert f.reused[cls] == 1 and f._n_delay == 1 and f._mean_delay_s == 50.0 and f.window_s == 100.0
    f.observe(req(3, 1, t=99.9), ["c"])
    assert "b" in f._origin and "b" in f._watch and sum(f.dead) == 0, "99.9 s: b's window is open"
    f.observe(req(4, 1, t=100.0), ["d"])
    assert list(f._origin) == ["c", "d"] and list(f._watch) == ["c", "d"], "b's window closed at exactly 100 s"
    assert f.dead[cls_b] == 1 and sum(f.dead) == 1, "b counted dead once"
    f.observe(req(5, 1, t=120.0), ["b"])
    f.observe(req(6, 1, t=120.0), ["e"])
    assert f.dead[cls_b] == 1 and sum(f.dead) == 1 and f.reused[cls_b] == 0, "a sighting after the window is not reuse"
    assert f._n_delay == 1 and f._mean_delay_s == 50.0, "nor a delay"
    assert list(f._origin) == ["c", "d", "e"], "c (made at 99.9 s) is open at 120 s"


def test_reuse_aware_counts_a_window_it_can_no_longer_hold_as_closed_at_once():
    """``origin_capacity``: past it, the oldest open window is counted as closed now (its block created, seen again or
    not), not dropped — so a filter that watches more new blocks than it can hold still learns from every one."""
    f = reuse_aware(lifetime_s=1000.0, origin_capacity=3)
    f.observe(req(0, 2, t=0.0), ["a", "b"])
    f.observe(req(1, 1, t=1.0), ["a"])  # a seen again inside its window
    assert sum(f.created) == 0, "no window has closed yet"
    f.observe(req(2, 2, t=2.0), ["c", "d"])  # four open windows, room for three: a's is counted now
    assert sum(f.created) == 1 and sum(f.seen_again) == 1
    f.observe(req(3, 1, t=3.0), ["e"])  # b's next, never seen again
    assert sum(f.created) == 2 and sum(f.seen_again) == 1
    assert list(f._origin) == ["c", "d", "e"]
