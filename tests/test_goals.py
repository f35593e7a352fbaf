"""Issue #20's goal lines in evict-bench and publish-bench, and the held-out split: computed right, PASS only when met."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies_prefix import chain_trace, prefix_traces

from kvpolicy.errors import ConfigError
from kvpolicy.eviction import replay
from kvpolicy.eviction.bench import compare, eviction_goals, render
from kvpolicy.publish_sim import publish_goals
from kvpolicy.publish_sim import render as render_publish
from kvpolicy.traces import generate, preset


def _res(points: dict[str, float], cap: int = 100) -> dict:
    return {"results": [{"policy": p, "capacity_blocks": cap, "token_hit_ratio": v / 100} for p, v in points.items()]}


@pytest.mark.parametrize("pts,gap_goal,classic_goal", [
    ({"lru": 40, "arc": 41, "s3fifo": 40, "belady": 60, "reuse-distance": 46.0}, True, True),     # closes 30 % of 20 points exactly
    ({"lru": 40, "arc": 41, "s3fifo": 40, "belady": 60, "reuse-distance": 45.9}, False, True),    # 29.5 %
    ({"lru": 40, "arc": 47.1, "s3fifo": 40, "belady": 60, "reuse-distance": 46.0}, True, False),  # 1.1 points below ARC
    ({"lru": 40, "arc": 40, "s3fifo": 40, "belady": 44.9, "reuse-distance": 40}, None, True),     # gap under 5 points: n/a
])
def test_eviction_goals(pts, gap_goal, classic_goal):
    (g,) = eviction_goals(_res(pts), ["reuse-distance"])
    assert g["gap_goal"] is gap_goal and g["classic_goal"] is classic_goal
    assert g["gap_points"] == pytest.approx(pts["belady"] - pts["lru"])
    assert g["best_classic"] == max(("lru", "arc", "s3fifo"), key=lambda n: pts[n])


def _runs(**kw):
    runs = [{"policy": name, "reread_bytes": rr, "bytes_written": w, "reread_share_of_oracle": rr / 100, "written_over_oracle": w / 100}
            for name, (rr, w) in kw.items()]
    return {"runs": runs}


def test_publish_goals():
    share = publish_goals(_runs(**{"reuse-aware": (86, 129), "threshold-2": (90, 100)}))
    assert share["share_goal"] and not share["dominance_goal"] and share["goal"]
    heavy = publish_goals(_runs(**{"reuse-aware": (86, 131), "threshold-2": (90, 100)}))
    assert not heavy["share_goal"] and not heavy["goal"]
    dom = publish_goals(_runs(**{"reuse-aware": (70, 150), "threshold-2": (60, 150), "threshold-3": (50, 160)}))
    assert dom["dominance_goal"] and dom["goal"] and not dom["share_goal"]
    tie = publish_goals(_runs(**{"reuse-aware": (60, 150), "threshold-2": (60, 150)}))
    assert not tie["dominance_goal"], "equal on both axes is not domination"


@pytest.fixture(scope="module")
def trace():
    return generate(preset("chat", n_requests=400, seed=17))


def test_the_split_scores_only_the_second_half_against_an_independent_replay(trace):
    k = len(trace) // 2
    cap = 200
    res = compare(trace, ["lru", "reuse-distance"], [cap], judge_from_request=k)
    row = next(r for r in res["results"] if r["policy"] == "lru")
    r0 = int(trace.block_offsets[k])
    online = replay(trace, "lru", cap)  # the pure-Python policy, not the kernel compare() uses
    assert row["hit_blocks"] == int(online.hits[r0:].sum())
    assert row["token_hit_ratio"] == pytest.approx(row["hit_blocks"] * trace.block_size_tokens / trace.input_tokens[k:].sum())
    full = compare(trace, ["lru"], [cap])
    assert next(r for r in full["results"] if r["policy"] == "lru")["hit_blocks"] == online.hit_blocks
    inf = next(r for r in res["results"] if r["policy"] == "infinite")
    assert inf["hit_blocks"] >= next(r for r in res["results"] if r["policy"] == "belady")["hit_blocks"]
    assert "judged on requests" in render(res) and "goals (issue #20)" in render(res)
    with pytest.raises(ConfigError, match="judge_from_request"):
        compare(trace, ["lru"], [cap], judge_from_request=len(trace))


def test_the_publish_split_counts_only_the_second_half(trace):
    from kvpolicy.publish_sim import publish_bench

    k = len(trace) // 2
    bpt = 512
    B = trace.block_size_tokens
    res = publish_bench(trace, ["all", "structure-aware"], replicas=4, bytes_per_token=bpt, judge_from_request=k, pool_capacity_blocks=None)
    runs = {r["policy"]: r for r in res["runs"]}
    # "all" writes every block once, when it is first computed: an independent count of first appearances at r >= k
    req = trace.request_of_block_ref()
    _, first_ref = np.unique(trace.block_ids, return_index=True)
    assert runs["all"]["blocks_written"] == int((req[first_ref] >= k).sum())
    # and it re-reads everything the oracle does, which counts only the second half's reads
    assert runs["all"]["reread_bytes"] == runs["oracle"]["reread_bytes"]
    full = publish_bench(trace, ["all"], replicas=4, bytes_per_token=bpt, pool_capacity_blocks=None)
    assert runs["oracle"]["reread_bytes"] < {r["policy"]: r for r in full["runs"]}["oracle"]["reread_bytes"]
    assert runs["all"]["bytes_written"] == runs["all"]["blocks_written"] * B * bpt
    assert [g["policy"] for g in res["goals"]] == ["structure-aware"]
    with pytest.raises(ConfigError, match="judge_from_request"):
        publish_bench(trace, ["all"], replicas=4, bytes_per_token=bpt, judge_from_request=-1)
    # a string was read as its characters ('unknown publish policy 'a''); the others raised TypeError or went unchecked
    for kw, field in (({"policies": "all"}, "--policies"), ({"pool_capacity_blocks": "5"}, "--pool-capacity-blocks"),
                      ({"write_bytes_per_s": float("nan")}, "write_bytes_per_s"), ({"seed": -1}, "seed")):
        args = {"policies": ["all"], **kw}
        with pytest.raises(ConfigError) as e:
            publish_bench(trace, args.pop("policies"), replicas=4, bytes_per_token=bpt, **args)
        assert e.value.field == field


def test_first_sighting_bound_by_hand():
    from kvpolicy.publish_sim import first_sighting_bound

    # 2 replicas, round-robin (even requests on A, odd on B): r1 reads 0,1 (their 2nd sighting); r2 holds 0,1 and
    # reads 2; r3 holds 0 and creates 3; r4 holds 0,1,2 and creates 4; r5 holds 0,1,2 and reads 4; r6 holds 0, reads 3
    # and creates 5; r7 holds 0,3 and reads 5 — every re-read is a block's 2nd sighting, and every block is re-read
    tr = chain_trace([[0, 1], [0, 1, 2], [0, 1, 2], [0, 3], [0, 1, 2, 4], [0, 1, 2, 4], [0, 3, 5], [0, 3, 5]])
    fs = first_sighting_bound(tr, replicas=2)
    assert fs["oracle_reread_blocks"] == 2 + 1 + 1 + 1 + 1  # r1: 0,1; r2: 2; r5: 4; r6: 3; r7: 5
    assert fs["second_sighting_rereads"] == 6 and fs["second_sighting_blocks"] == 6
    assert fs["waiting_share_max"] == 0.0 and fs["blocks_seen"] == 6 and fs["base_rate"] == 1.0
    assert fs["oracle_written_blocks"] == 6
    assert fs["needed_first_sighting_catches"] == 6  # ceil(0.85 * 6 = 5.1)
    assert fs["precision_needed"] == pytest.approx(0.85 * 6 / (1.3 * 6))
    # 3 replicas: r1 (B) reads 0,1 at their 2nd sighting, r3 (A again) holds them; add a reader on C at the 3rd sighting
    fs2 = first_sighting_bound(chain_trace([[0, 1], [0, 1], [2], [0, 1], [3], [0, 1]]), replicas=3)
    assert fs2["oracle_reread_blocks"] == 4 and fs2["second_sighting_rereads"] == 2
    assert fs2["waiting_share_max"] == 0.5 and fs2["recall_needed"] == pytest.approx((0.85 * 4 - 2) / 2)
    # 2 replicas: 0,1's second sighting is on their own replica; their first re-read is the third sighting — a
    # filter that waits for a second sighting gets it, and the goal asks nothing of a first sighting
    fs3 = first_sighting_bound(chain_trace([[0, 1], [2], [0, 1], [0, 1]]), replicas=2)
    assert fs3["oracle_reread_blocks"] == 2 and fs3["second_sighting_rereads"] == 0 and fs3["waiting_share_max"] == 1.0
    assert fs3["needed_first_sighting_catches"] == 0 and fs3["precision_needed"] == 0.0
    with pytest.raises(ConfigError, match="share"):
        first_sighting_bound(tr, share=0)


@settings(max_examples=40, deadline=None)
@given(prefix_traces(max_requests=30), st.integers(2, 4))
def test_no_filter_beats_the_first_sighting_bound(trace, replicas):
    """Whatever a filter does, its re-reads are at most the waiting share plus the second-sighting re-reads of what it
    published at first sighting; a filter that waits (threshold-k) never passes the waiting share; publishing
    everything catches every second-sighting block; and the bound's re-reads are the oracle's (counted apart)."""
    from kvpolicy.publish_sim import first_sighting_bound, publish_bench

    bpt = 4
    block_bytes = bpt * trace.block_size_tokens
    res = publish_bench(trace, ["all", "threshold-2", "threshold-3", "structure-aware", "reuse-aware"], replicas=replicas, bytes_per_token=bpt,
                        pool_capacity_blocks=None)  # issue #20 judged an infinite pool
    fs = first_sighting_bound(trace, replicas=replicas)
    runs = {r["policy"]: r for r in res["runs"]}
    assert fs["oracle_reread_blocks"] * block_bytes == runs["oracle"]["reread_bytes"]
    assert fs["oracle_written_blocks"] * block_bytes == runs["oracle"]["bytes_written"]
    assert res["first_sighting"]["second_sighting_blocks"] == fs["second_sighting_blocks"]
    waiting = fs["oracle_reread_blocks"] - fs["second_sighting_rereads"]
    for name, run in runs.items():
        if name == "oracle":
            continue
        assert run["reread_bytes"] // block_bytes <= waiting + run["first_sighting_caught_blocks"], name
        assert run["first_sighting_caught_blocks"] <= min(run["first_sighting_published_blocks"], fs["second_sighting_blocks"])
    for name in ("threshold-2", "threshold-3"):
        assert runs[name]["first_sighting_published_blocks"] == 0
        assert runs[name]["reread_bytes"] // block_bytes <= waiting
    assert runs["all"]["first_sighting_caught_blocks"] == fs["second_sighting_blocks"]
    assert runs["all"]["first_sighting_published_blocks"] == fs["blocks_seen"] == np.unique(trace.block_ids).size
    text = render_publish(res)  # the report states the bound under each goal line whenever there is a second-sighting re-read
    assert ("first sightings:" in text) == bool(fs["second_sighting_blocks"])


def test_reuse_gaps_by_hand_and_against_a_loop():
    from kvpolicy.eviction.bench import reuse_gap_s

    tr = chain_trace([[0, 1], [2], [0, 1], [0, 3], [2]])  # request i arrives at i s
    got = reuse_gap_s(tr)
    assert np.array_equal(np.isnan(got), [True, True, True, False, False, False, True, False])
    assert got[~np.isnan(got)].tolist() == [2.0, 2.0, 1.0, 3.0]


@settings(max_examples=30, deadline=None)
@given(prefix_traces(max_requests=25))
def test_reuse_gaps_match_a_plain_loop(trace):
    from kvpolicy.eviction.bench import reuse_gap_s

    t = trace.arrival_s[trace.request_of_block_ref()]
    last, want = {}, []
    for i, b in enumerate(trace.block_ids.tolist()):
        want.append(t[i] - last[b] if b in last else np.nan)
        last[b] = t[i]
    np.testing.assert_array_equal(reuse_gap_s(trace), np.asarray(want, dtype=float))


def test_where_the_gap_is():
    from kvpolicy.eviction.bench import gap_where, reuse_gap_s

    tr = chain_trace([[0, 1], [2], [0, 1], [0, 3], [2]])  # 8 references over 4 s
    lru = np.array([0, 0, 0, 1, 0, 1, 0, 0], dtype=bool)     # 6 misses inserted into 2 blocks: ~2 x 4 / 6 s each
    bel = np.array([0, 0, 0, 1, 1, 1, 0, 1], dtype=bool)     # extra hits: refs 4 (gap 2 s) and 7 (gap 3 s)
    w = gap_where(tr, 2, lru, bel, reuse_gap_s(tr))
    assert w["lru_lifetime_s"] == pytest.approx(2 * 4 / 6) and w["extra_hits"] == 2
    assert w["extra_reuse_gap_s"]["p50"] == pytest.approx(2.5)
    assert gap_where(tr, 6, lru, bel, reuse_gap_s(tr))["lru_lifetime_s"] is None  # never evicted: no residency
    assert gap_where(tr, 2, lru, bel, reuse_gap_s(tr), r0=6)["extra_hits"] == 1     # only scored references


def test_evict_bench_says_where_the_gap_is():
    trace = generate(preset("chat", seed=5))
    distinct = int(np.unique(trace.block_ids).size)
    res = compare(trace, ["adaptive"], [distinct // 64, distinct // 2])
    assert [w["capacity_blocks"] for w in res["gap_where"]] == [distinct // 64, distinct // 2]
    text = render(res)
    wide = [g["capacity_blocks"] for g in res["goals"] if g["gap_goal"] is not None]
    assert wide and all(f"@ {c:,} blocks: LRU keeps a block" in text for c in wide)
    assert f"@ {distinct // 2:,} blocks: LRU keeps" not in text  # no gap worth explaining there
    assert f"@ {distinct // 64:,} blocks: LRU keeps a block" in render(compare(trace, ["lru"], [distinct // 64]))  # no goal policy ran


def _bench_goals():
    """benchmarks/bench_goals.py, the script behind docs/benchmarks.md's #20 scoreboard (imported by path)."""
    import importlib.util
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[1] / "benchmarks"
    sys.path.insert(0, str(bench))  # its _common helper
    try:
        spec = importlib.util.spec_from_file_location("bench_goals", bench / "bench_goals.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(bench))
    return mod


def test_the_goal_scoreboard_counts_what_the_goal_lines_say():
    mod = _bench_goals()
    ev = eviction_goals({"results": _res({"lru": 40, "arc": 41, "s3fifo": 40, "belady": 60, "adaptive": 46.0}, cap=10)["results"]
                         + _res({"lru": 40, "arc": 47.1, "s3fifo": 40, "belady": 60, "adaptive": 46.0}, cap=20)["results"]
                         + _res({"lru": 40, "arc": 40, "s3fifo": 40, "belady": 44.9, "adaptive": 38.0}, cap=30)["results"]}, ["adaptive"])
    pub = [publish_goals(_runs(**{"structure-aware": (90, 120), "threshold-2": (70, 100)}), "structure-aware"),
           publish_goals(_runs(**{"structure-aware": (90, 140), "threshold-2": (70, 100)}), "structure-aware")]
    runs = [{"what": "evict", "trace": "t", "goals": ev}, {"what": "publish", "trace": "t", "goals": pub[:1]},
            {"what": "publish", "trace": "u", "goals": pub[1:]}]
    board = mod.scoreboard(runs)
    # gap goal: PASS at 10, PASS at 20, n/a at 30; classic: PASS, MISS (1.1 below ARC), MISS (2 below LRU)
    assert board == {"adaptive": {"gap_goal": [2, 2], "classic_goal": [1, 3]}, "structure-aware": {"publish_goal": [1, 2]}}
    md = mod.markdown(runs)
    assert "| t | 20 | +30% of 20.0 pts — **PASS** | 46.00 % vs arc 47.10 % (-1.10) — **MISS** |" in md
    assert "| u | structure-aware | 90.0% | 1.40× | 2 no | **MISS** |" in md


def test_evict_bench_says_who_evicted_and_what_the_judge_saw():
    trace = generate(preset("chat", seed=5))
    distinct = int(np.unique(trace.block_ids).size)
    cap = distinct // 16
    res = compare(trace, ["adaptive", "hit-density"], [cap])
    (row,) = [r for r in res["results"] if r["policy"] == "adaptive"]
    stats = replay(trace, "adaptive", cap).stats  # the online object, not the kernel compare ran
    direct, seen = stats["evictions_by_expert"], stats["mini_sim_hit_ratio"]
    assert row["evictions_by_expert"] == direct and sum(direct.values()) > 0 and row["mini_sim_hit_ratio"] == seen
    assert all("evictions_by_expert" not in r for r in res["results"] if r["policy"] != "adaptive")
    n = sum(direct.values())
    shares = " / ".join(f"{100 * direct[q] / n:.0f}" for q in ("hit-density", "lru", "lfu"))
    seen_txt = " / ".join(f"{100 * seen[q]:.1f}" for q in ("hit-density", "lru", "lfu"))
    assert f"  adaptive @ {cap:,} blocks: {shares} %; mini-simulations {seen_txt} %" in render(res)


def test_compare_names_bad_capacities_and_policies():
    """A string capacity was a TypeError from min(); 10**30 failed inside Numba's typing; a policy string was read as
    its characters ('unknown policy 'l''); a negative bytes_per_token would have priced byte flows negative."""
    from kvpolicy.errors import ConfigError
    from kvpolicy.traces import generate, preset

    tr = generate(preset("chat", n_requests=30))
    for caps in (["10"], [10**30], [2.5], [0], []):
        with pytest.raises(ConfigError, match="--capacities-blocks"):
            compare(tr, ["lru"], caps)
    with pytest.raises(ConfigError, match="give a list of policy names"):
        compare(tr, "lru", [10])
    with pytest.raises(ConfigError, match="bytes_per_token"):
        compare(tr, ["lru"], [10], bytes_per_token=-1)


def test_bench_goals_names_a_bad_evict_policy_before_running_anything(capsys):
    mod = _bench_goals()
    for bad, said in (("nope", "unknown policy 'nope'"), ("", "name at least one policy")):
        with pytest.raises(SystemExit) as e:
            mod.main(["--evict-policies", bad, "--no-trace", "--presets", "chat"])
        assert e.value.code == 2 and f"--evict-policies: {said}" in capsys.readouterr().err


def test_evict_bench_shows_the_learned_models_labels_fits_and_calibration():
    trace = generate(preset("chat", n_requests=600, seed=5))
    distinct = int(np.unique(trace.block_ids).size)
    res = compare(trace, ["lrb"], [distinct // 16, distinct])  # the second never evicts: never fit
    small, whole = ([r for r in res["results"] if r["policy"] == "lrb" and r["capacity_blocks"] == c][0] for c in (distinct // 16, distinct))
    m = small["model"]
    assert m["fits"] > 0 and m["labels"] > 0 and abs(m["window_mean_prediction"] - m["window_positive_rate"]) < 1e-3
    text = render(res)
    assert (f"  lrb @ {distinct // 16:,} blocks: {m['labels']:,} labels, {m['fits']} fits; fit {m['window_mean_prediction']:.3f} / "
            f"{m['window_positive_rate']:.3f}, out of sample {m['out_of_sample_mean_prediction']:.3f} / "
            f"{m['out_of_sample_positive_rate']:.3f}") in text
    assert whole["model"]["fits"] == 0 and f"  lrb @ {distinct:,} blocks: 0 labels, 0 fits; never fit" in text
