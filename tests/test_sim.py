import json
import math
import os

import attrs
import numpy as np
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from kvpolicy.cli import main
from kvpolicy.errors import ConfigError
from kvpolicy.publish_sim import DEFAULT_PREFILL
from kvpolicy.sim import (
    POLICY_SETS, ROUTERS, SCENARIOS, ClusterConfig, Degrade, PolicySet, Prepared, ScaleOut, Simulator, Spike, apply_spike, build, compare,
    default_cluster, policy_set, recompute_twin,
)
from kvpolicy.traces import generate, preset

BPT = 4096  # small KV per token keeps the numbers readable


@pytest.fixture(scope="module")
def trace():
    return generate(preset("mixed", n_requests=240, block_size_tokens=64, seed=3))


@pytest.fixture(scope="module")
def prepared(trace):
    return Prepared(trace)


def cluster(trace, **kw):
    base = dict(replicas=4, local_kv_gib=64 * 64 * BPT / 2**30, pool_share=0.5, storage_nodes=2)
    base.update(kw)
    return default_cluster(trace, bytes_per_token=BPT, prefill=DEFAULT_PREFILL, **base)


def run(prepared, c, name, **kw):
    ps = name if isinstance(name, PolicySet) else policy_set(name)
    return Simulator(prepared, c, ps, **kw).run()


def check_conservation(res, trace):
    assert np.all(res.completed == 1), "every request finishes exactly once"
    assert np.all(np.isfinite(res.ttft_s)) and np.all(res.ttft_s >= 0)
    # a request waits for a slot after it joins the queue, never before, and within its TTFT
    assert np.all(np.isfinite(res.queue_s)) and np.all(res.queue_s >= 0) and np.all(res.queue_s <= res.ttft_s + 1e-9)
    assert sum(res.node_bytes_out) + res.bytes_direct == sum(res.replica_bytes_in) == res.bytes_sent
    assert res.bytes_read <= res.bytes_sent
    assert 0 <= res.bytes_pulled <= res.bytes_written, "what pulls wrote is part of what was written"
    assert res.bytes_read + res.bytes_unused == res.bytes_sent, "every byte sent is either used or counted as unused"
    assert res.loads == res.loads_ok + res.loads_failed + res.loads_timeout
    led = res.ledger
    assert led.total_requests == len(trace)
    assert led.total_tokens == int(trace.input_tokens.sum())
    assert led.flows["read"].total + res.warmup_bytes == res.bytes_read


def check_released(sim):
    """Once every request has finished, nothing is held: no local block pinned, no pool block leased."""
    for rep in sim.fleet.replicas:
        assert rep.cache.protected_bytes == 0 and not any(n.pins for n in rep.cache.nodes.values()), f"{rep.name} still pins blocks"
        rep.cache.check()
    for node in sim.pool.nodes:
        assert node.policy.protected_bytes == 0, f"{node.name} still leases blocks"
        assert node.policy.used_bytes <= node.policy.capacity_bytes, f"{node.name} holds more than it can"
    assert not sim.pool.writing, "a write or a pull still marked in flight"
    assert all(k in node.policy.nodes for k, node in sim.pool.where.items()), "the directory names a node that does not hold the block"


#: pulls from peers with the plainest load rule (every match loaded, a failure retried by the client) and nothing
#: published: every block shared moves by a pull — under failures, hangs and retries, without the admission controller
PULL_ALWAYS = attrs.evolve(policy_set("vllm-like"), name="pull-always", publish="never", pull_from_peers=True)


def by_name(name):
    return PULL_ALWAYS if name == "pull-always" else policy_set(name)


@pytest.mark.parametrize("name", ["kvpolicy", "vllm-like", "sglang-like", "oracle", "pull-always"])
def test_every_pin_and_lease_is_released_when_the_requests_are_done(trace, prepared, name):
    """Busy replicas (one prefill slot, a small local cache, requests arriving together) so that a request finds some of
    the blocks it computed already cached by another in flight — each of those is pinned once and released once (a
    peer's copy a pull held, too)."""
    c = cluster(trace, prefill_slots=1, local_kv_gib=16 * 64 * BPT / 2**30)
    sim = Simulator(prepared, c, by_name(name), seed=1)
    check_conservation(sim.run(), trace)
    check_released(sim)


@pytest.mark.parametrize("name", POLICY_SETS)
def test_deterministic_for_a_seed(trace, prepared, name):
    c = cluster(trace, router="random")
    a, b = run(prepared, c, name, seed=7), run(prepared, c, name, seed=7)
    assert np.array_equal(a.ttft_s, b.ttft_s)
    assert a.row() == b.row()


@pytest.mark.parametrize("name", POLICY_SETS)
def test_conservation_and_reads_equal_sent_without_failures(trace, prepared, name):
    res = run(prepared, cluster(trace), name)
    check_conservation(res, trace)
    if res.loads_failed == res.loads_timeout == 0:
        assert res.bytes_read == res.bytes_sent, "a clean run reads exactly what it sent"
    if name == "recompute-only":
        assert res.bytes_sent == res.bytes_written == 0


def test_loads_happen_and_save_gpu(trace, prepared):
    base = run(prepared, cluster(trace), "recompute-only")
    for name in ("kvpolicy", "vllm-like", "oracle"):
        res = run(prepared, cluster(trace), name)
        assert res.loads_ok > 0 and res.bytes_read > 0
        assert res.gpu_prefill_s < base.gpu_prefill_s


def test_zero_bandwidth_makes_every_admission_recompute(trace, prepared):
    c = cluster(trace, node_bandwidth_bytes_per_s=0.0, transport_timeout_s=5.0)
    sim = Simulator(prepared, c, policy_set("kvpolicy"))
    assert sim.seed_pool(prepared.keys) > 0  # the pool holds everything; only the link is gone
    reasons = []
    orig = sim.lifecycle.arrive

    def spy(req, t):
        orig(req, t)
        if req.decision is not None:
            reasons.append(req.decision.action)

    sim.lifecycle.arrive = spy
    res = sim.run()
    check_conservation(res, trace)
    assert reasons and set(reasons) <= {"recompute", "local_only"}
    assert res.loads == 0 and res.bytes_read == 0
    o = Simulator(prepared, c, policy_set("oracle"))  # the GPU bound loads all it finds: every load times out, and is retried
    o.seed_pool(prepared.keys)
    orc = o.run()
    check_conservation(orc, trace)
    assert orc.loads > 0 and orc.loads_ok == 0
    # a policy that always loads still finishes: the transport times every load out
    vs = Simulator(prepared, c, policy_set("lmcache-like"))
    vs.seed_pool(prepared.keys)
    v = vs.run()
    check_conservation(v, trace)
    assert v.loads > 0 and v.loads_ok == 0 and v.loads_timeout == v.loads


@pytest.mark.parametrize("name", POLICY_SETS)
def test_a_pool_that_holds_nothing_equals_recompute(trace, prepared, name):
    c = cluster(trace, lookup_s=0.0)
    c = attrs.evolve(c, pool_capacity_bytes_per_node=0)
    ps = policy_set(name)
    res = run(prepared, c, ps)
    twin = run(prepared, c, recompute_twin(ps))
    assert res.bytes_read == res.bytes_written == 0 and res.loads == 0
    assert res.gpu_prefill_s == pytest.approx(twin.gpu_prefill_s, rel=1e-12)
    assert np.allclose(res.ttft_s, twin.ttft_s, rtol=1e-12, atol=1e-12)


def test_scale_out_adds_replicas_and_kvpolicy_warms_them(trace, prepared):
    t = float(trace.arrival_s[len(trace) // 2])
    c = cluster(trace)
    res = run(prepared, c, "kvpolicy", events=(ScaleOut(t, 3),))
    assert res.replicas_final == 7
    check_conservation(res, trace)
    assert res.warmup_bytes > 0
    assert run(prepared, c, "vllm-like", events=(ScaleOut(t, 3),)).warmup_bytes == 0


def test_kv_overlaps_count_follows_a_request_the_warmup_rule_passes_on(trace, prepared):
    """kv-overlap counts a request's prefill on the replica it is served by: when a warming replica passes a repeating
    request on to a warm one, the count goes there too, at what that replica holds — else the warming replica keeps a
    count nothing takes off and the warm one's goes below zero. After the run every count is back at 0, and never
    below it on the way."""
    t = float(trace.arrival_s[len(trace) // 2])
    # links slow enough that the new replicas warm for ~14 s, with requests arriving meanwhile
    c = attrs.evolve(cluster(trace, node_bandwidth_bytes_per_s=2e7, replica_bandwidth_bytes_per_s=2e7), router="kv-overlap")
    sim = Simulator(prepared, c, policy_set("kvpolicy"), events=(ScaleOut(t, 3),))
    passed_on, low = [], []
    route = sim.fleet.route

    def spy(req, now):
        before = [r.routed_tokens for r in sim.fleet.replicas]
        rep = route(req, now)
        after = [r.routed_tokens for r in sim.fleet.replicas]
        passed_on.append(any(now < r.warming_until_s for r in sim.fleet.replicas))  # the rule had a replica warming
        low.append(min(after))
        assert after[rep.idx] - before[rep.idx] == req.routed_tokens  # counted where it is served,
        held = rep.index.match_prefix(prepared.keys[req.i][:prepared.matchable[req.i]])  # at the prefill its cache leaves
        assert req.routed_tokens == trace.input_tokens[req.i] - held * trace.block_size_tokens
        return rep

    sim.fleet.route = spy
    res = sim.run()
    assert res.warmup_bytes > 0 and any(passed_on)
    assert min(low) >= 0
    assert [r.routed_tokens for r in sim.fleet.replicas] == [0] * res.replicas_final


@pytest.mark.parametrize("name", ["vllm-like", "kvpolicy"])
def test_kv_overlaps_count_on_a_replica_is_the_prefill_of_the_requests_sent_there_and_not_yet_prefilled(trace, prepared, name):
    """The router's count on each replica is, at every routing and every prefill's end, the sum of what it counted for
    the requests it sent there whose prefill has not ended: a finished prefill takes off its own tokens (not the
    replica's whole count), and a failed load that the client retries (vllm-like's ``failure="fail"``) takes its count
    off the replica it leaves before the retry is routed afresh."""
    busy = attrs.evolve(trace, arrival_s=trace.arrival_s / 20)  # 20× the rate: retries leave replicas others still load on
    c = attrs.evolve(cluster(busy, failure_rate=0.3), router="kv-overlap")
    sim = Simulator(Prepared(busy), c, policy_set(name))
    sent: dict[int, tuple[int, int]] = {}  # request → (replica, tokens counted) of its current attempt
    route, done = sim.fleet.route, sim.lifecycle.prefill_done

    def check():
        for r in sim.fleet.replicas:
            assert r.routed_tokens == sum(n for idx, n in sent.values() if idx == r.idx), r.idx

    def on_route(req, now):
        rep = route(req, now)
        sent[req.i] = (rep.idx, req.routed_tokens)
        check()
        return rep

    def on_done(req, now):
        done(req, now)
        del sent[req.i]
        check()

    sim.fleet.route, sim.lifecycle.prefill_done = on_route, on_done
    res = sim.run()
    assert not sent and res.loads > 0
    assert (res.retries > 0) is (name == "vllm-like")


def test_degraded_node_fails_and_kvpolicy_breaker_moves_off_it(trace, prepared):
    D = float(trace.arrival_s[-1])
    ev = (Degrade(0, 0.0, D + 1, bandwidth_factor=0.5, failure_rate=1.0),)
    c = cluster(trace)
    vl = run(prepared, c, "vllm-like", events=ev)
    check_conservation(vl, trace)
    assert vl.loads_failed > 0 and vl.retries > 0
    kv_sim = Simulator(prepared, c, policy_set("kvpolicy"), events=ev)
    kv = kv_sim.run()
    check_conservation(kv, trace)
    assert kv.loads_failed < vl.loads_failed
    assert kv_sim.planner.controller.breakers["node-0"].transitions, "the breaker opened on the failing node"


def test_a_republication_spends_only_the_room_the_write_budget_leaves(trace, prepared, monkeypatch):
    """Bytes are a constraint: kvpolicy writes a block again off a node whose breaker is open
    (``republish_unhealthy``) only within the room its write budget leaves (``DuelingPublish.budget_room_blocks``:
    what the budget rule wrote in its ghost less what the decisions' leaders wrote), so no re-publication makes it
    write more than the engine's count rule would. Here the count rule leads every decision: no room, and kvpolicy
    writes exactly what it writes with re-publication off. With the room unbounded it re-publishes (the old rule) and
    writes more; with 5 blocks of room, exactly 5 over the run. With re-publication off, none whatever the room; and
    a block the write gate cuts is not counted as written again."""
    from kvpolicy.publish import DuelingPublish

    D = float(trace.arrival_s[-1])
    ev = (Degrade(0, 0.0, D + 1, bandwidth_factor=0.5, failure_rate=1.0),)
    c = cluster(trace)
    kv = policy_set("kvpolicy")
    off_set = attrs.evolve(kv, republish_unhealthy=False)
    gated = attrs.evolve(kv, write_admission="tinylfu")
    runs = {}
    for name, room, ps in (("budget", None, kv), ("off", None, off_set), ("free", math.inf, kv), ("five", 5, kv),
                           ("free, off", math.inf, off_set), ("free, held cut", math.inf, gated),
                           ("free, gate keeps all", math.inf, gated)):
        if room is not None:
            monkeypatch.setattr(DuelingPublish, "budget_room_blocks", property(lambda self, r=room: r))
        sim = Simulator(prepared, c, ps, events=ev)
        if name.endswith("held cut"):  # a write gate that refuses every block the pool holds: nothing is written again
            sim.pool._gate_writes = lambda batches, order, held=sim.pool.where: {
                n: [k for k in todo if k not in held] for n, todo in batches.items()}
        if name.endswith("keeps all"):  # a write gate that cuts nothing: the same run as without one
            sim.pool._gate_writes = lambda batches, order: batches
        runs[name] = (sim, sim.run())
    monkeypatch.undo()
    moved = {name: sim.pool.republished_blocks for name, (sim, _) in runs.items()}
    duel = runs["budget"][0].pool.filter
    assert duel.decided == [0, 0, len(trace), 0] and duel.budget_room_blocks == 0, "threshold-2 decided every request"
    assert moved["budget"] == 0 and runs["budget"][1].bytes_written == runs["off"][1].bytes_written
    assert moved["free"] > 5 and runs["free"][1].bytes_written > runs["off"][1].bytes_written
    assert moved["five"] == 5
    assert moved["free, off"] == moved["off"] == 0 and moved["free, held cut"] == 0, moved
    assert moved["free, gate keeps all"] == moved["free"], "what the gate passes is counted"


def test_hanging_transfers_time_out_and_fall_back(trace, prepared):
    c = cluster(trace, timeout_rate=1.0, transport_timeout_s=1.5)
    res = run(prepared, c, "lmcache-like")
    check_conservation(res, trace)
    assert res.loads > 0 and res.loads_timeout == res.loads and res.bytes_read == 0
    assert res.ledger.tokens["miss_timeout"] > 0
    kv = run(prepared, c, "kvpolicy")
    check_conservation(kv, trace)
    assert kv.loads_timeout == kv.loads and kv.loads < res.loads, "the breaker stops loading from a source that never answers"


@pytest.mark.parametrize("router", ["round-robin", "random", "prefix-affinity"])
def test_the_oracles_hindsight_routes_are_the_routes_taken(trace, prepared, router):
    t = float(trace.arrival_s[len(trace) // 3])
    sim = Simulator(prepared, cluster(trace, router=router), policy_set("oracle"), events=(ScaleOut(t, 2),))
    expected = sim.static_routes()
    res = sim.run()
    assert np.array_equal(res.routes, expected)
    assert Simulator(prepared, cluster(trace, router="least-loaded"), policy_set("oracle")).static_routes() is None


def test_failure_draws_are_the_same_for_every_policy_set(trace, prepared):
    """The draws depend only on (seed, request, attempt, node, purpose): another process with another
    PYTHONHASHSEED draws the same numbers, and they are uniform on [0, 1)."""
    import os
    import subprocess
    import sys

    from kvpolicy.sim.world import _unit

    args = [(0, 5, 0, 1, 1), (3, 17, 1, 2, 2), (9, 0, 0, 0, 3)]
    code = "from kvpolicy.sim.world import _unit; print([_unit(*a) for a in %r])" % (args,)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, "PYTHONHASHSEED": "12345"}, check=True)
    assert eval(out.stdout) == [_unit(*a) for a in args]
    draws = [_unit(0, i, 0, 1, 1) for i in range(4000)]
    assert all(0.0 <= x < 1.0 for x in draws) and abs(sum(draws) / len(draws) - 0.5) < 0.02
    assert _unit(0, 5, 0, 1, 1) != _unit(1, 5, 0, 1, 1), "another seed, another draw"
    c = cluster(trace, failure_rate=0.3)
    fails = {name: run(prepared, c, name).loads_failed for name in ("lmcache-like", "sglang-like")}
    assert all(v > 0 for v in fails.values())


def test_apply_spike_squeezes_the_window_and_keeps_every_request(trace):
    D = float(trace.arrival_s[-1])
    sp = Spike(0.2 * D, 0.4 * D, 3.0)
    out = apply_spike(trace, sp)
    assert len(out) == len(trace)
    assert np.all(np.diff(out.arrival_s) >= 0)
    before = np.sum((trace.arrival_s >= sp.t1_s) & (trace.arrival_s < sp.t1_s + 3 * (sp.t2_s - sp.t1_s)))
    inside = np.sum((out.arrival_s >= sp.t1_s) & (out.arrival_s < sp.t2_s))
    assert inside == before


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_scenario_builds_on_any_trace(trace, scenario):
    sc = build(scenario, trace, cluster(trace))
    assert len(sc.trace) == len(trace)
    res = Simulator(Prepared(sc.trace), sc.cluster, policy_set("kvpolicy"), events=sc.events).run()
    check_conservation(res, sc.trace)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**16), router=st.sampled_from(ROUTERS), name=st.sampled_from(POLICY_SETS + ("pull-always",)),
       slots=st.integers(1, 3), failure=st.sampled_from([0.0, 0.3]), hang=st.sampled_from([0.0, 0.2]), nodes=st.integers(1, 3))
def test_conservation_property(trace, prepared, seed, router, name, slots, failure, hang, nodes):
    c = cluster(trace, router=router, prefill_slots=slots, failure_rate=failure, timeout_rate=hang, storage_nodes=nodes, transport_timeout_s=2.0)
    sim = Simulator(prepared, c, by_name(name), seed=seed)
    res = sim.run()
    check_conservation(res, trace)
    check_released(sim)
    # the pool never holds more than its capacity, local caches never more than theirs
    assert res.ledger.tokens["remote_hit"] * BPT <= res.bytes_read


def test_bad_configuration_names_the_field(trace):
    with pytest.raises(ConfigError) as e:
        cluster(trace, router="sticky")
    assert e.value.field == "router"
    with pytest.raises(ConfigError) as e:
        Degrade(0, 10.0, 5.0)
    assert e.value.field == "t2_s"
    with pytest.raises(ConfigError) as e:
        cluster(trace, failure_rate=1.5)
    assert e.value.field == "failure_rate"
    with pytest.raises(ConfigError) as e:  # inf bytes: a named error, not an OverflowError from int(inf)
        default_cluster(trace, bytes_per_token=BPT, prefill=DEFAULT_PREFILL, local_kv_gib=1e300)
    assert e.value.field == "local_kv_gib"
    with pytest.raises(ConfigError) as e:  # a ZeroDivisionError sizing the pool per node
        default_cluster(trace, bytes_per_token=BPT, prefill=DEFAULT_PREFILL, storage_nodes=0)
    assert e.value.field == "storage_nodes"
    for field, bad in (("pool_share", float("inf")), ("pool_share", "0.25"), ("local_kv_gib", None), ("bytes_per_token", None)):
        # an OverflowError converting an infinite pool to int; TypeErrors from a comparison or a multiplication
        with pytest.raises(ConfigError) as e:
            default_cluster(trace, prefill=DEFAULT_PREFILL, **{"bytes_per_token": BPT, field: bad})
        assert e.value.field == field
    with pytest.raises(ConfigError) as e:  # a TypeError at the first failure draw
        Simulator(trace, cluster(trace), policy_set("kvpolicy"), seed="x")
    assert e.value.field == "seed"
    with pytest.raises(ConfigError) as e:  # read as the scenarios 's', 't', ...
        compare(trace, cluster(trace), scenarios="steady")
    assert e.value.field == "--scenario"
    with pytest.raises(ConfigError) as e:
        Simulator(trace, cluster(trace), policy_set("kvpolicy"), events=(Degrade(5, 0.0, 1.0),))
    assert e.value.field == "node"
    with pytest.raises(ConfigError) as e:
        policy_set("nvidia-dynamo")
    assert e.value.field == "--policies"
    with pytest.raises(ConfigError):
        ClusterConfig(bytes_per_token=0, prefill=DEFAULT_PREFILL)


def test_compare_report_and_checks(trace):
    report, raw = compare(trace, cluster(trace), scenarios=["steady", "degraded"], policies=["kvpolicy", "vllm-like", "oracle"])
    names = {(r["scenario"], r["policy"]) for r in report["runs"]}
    assert ("steady", "recompute-only") in names, "recompute-only always runs: savings are measured against it"
    for r in report["runs"]:
        for k in ("ttft_p50_ms", "ttft_p95_ms", "ttft_p99_ms", "gpu_prefill_s", "bytes_read", "bytes_written", "peak15_bytes_per_s", "ledger"):
            assert k in r
        assert r["ttft_p50_ms"] <= r["ttft_p95_ms"] <= r["ttft_p99_ms"]
    assert {c["scenario"] for c in report["checks"]} == {"steady", "degraded"}


def test_cli_compare_json(tmp_path, capsys, trace):
    path = tmp_path / "t.jsonl"
    trace.to_mooncake_jsonl(path)
    out = tmp_path / "out.json"
    rc = main(["compare", str(path), "--format", "mooncake", "--block-size", "64", "--scenario", "steady", "--policies", "kvpolicy,vllm-like",
               "--bytes-per-token", str(BPT), "--replicas", "4", "--json", str(out), "--no-progress"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "steady" in text and "kvpolicy" in text and "recompute-only" in text
    data = json.loads(out.read_text())
    assert {r["policy"] for r in data["runs"]} == {"kvpolicy", "vllm-like", "recompute-only"}
    assert data["cluster"]["compute_factor"] == 1.0
    slow = tmp_path / "slow.json"
    assert main(["compare", str(path), "--format", "mooncake", "--block-size", "64", "--scenario", "steady", "--policies", "recompute-only",
                 "--bytes-per-token", str(BPT), "--replicas", "4", "--json", str(slow), "--no-progress", "--compute-factor", "2",
                 "--link-prior-factor", "4"]) == 0
    text = capsys.readouterr().out
    assert "compute 2x the profile" in text, "the text report says the compute is not the profile's"
    assert "link prior 4x the real bandwidth" in text
    twice = json.loads(slow.read_text())
    assert twice["cluster"]["compute_factor"] == 2.0 and twice["cluster"]["link_prior_factor"] == 4.0
    assert twice["offered_load"]["cold_prefill_s"] == pytest.approx(2 * data["offered_load"]["cold_prefill_s"]), "the offered load is the real compute"
    # the report holds every policy set as it ran; --controller-scope gives kvpolicy's one controller per replica
    assert data["policy_sets"]["kvpolicy"]["controller_scope"] == "cluster" and data["policy_sets"]["vllm-like"]["load"] == "always"
    own = tmp_path / "own.json"
    assert main(["compare", str(path), "--format", "mooncake", "--block-size", "64", "--scenario", "steady", "--policies", "kvpolicy,vllm-like",
                 "--bytes-per-token", str(BPT), "--replicas", "4", "--json", str(own), "--no-progress", "--controller-scope", "replica"]) == 0
    assert "one controller per replica (as an engine embeds it): kvpolicy" in capsys.readouterr().out
    per = json.loads(own.read_text())
    assert per["policy_sets"]["kvpolicy"]["controller_scope"] == "replica" and per["policy_sets"]["kvpolicy"]["publish"] == "dueling"
    assert {r["policy"] for r in per["runs"]} == {"kvpolicy", "vllm-like", "recompute-only"}


def test_cli_compare_bad_input(capsys, tmp_path):
    assert main(["compare", "--policies", "kvpolicy,bogus", "--no-progress"]) == 2
    assert "bogus" in capsys.readouterr().err
    assert main(["compare", "--policies", "vllm-like", "--controller-scope", "replica", "--no-progress"]) == 2
    assert "--controller-scope" in capsys.readouterr().err, "a flag that would change nothing is refused by name"
    assert main(["compare", "--node-gbps", "-1", "--no-progress"]) == 2
    assert "--node-gbps" in capsys.readouterr().err


# ---------------------------------------------------------------- the flow network and compute while loading


def test_a_hung_load_costs_kvpolicy_little_it_computes_while_waiting(trace, prepared):
    """Every transfer hangs: the baselines wait for the transport's timeout, kvpolicy's plain loads
    turn into compute-while-loading at their p95 prediction, and a timeout's evidence stops further loads."""
    c = cluster(trace, timeout_rate=1.0, transport_timeout_s=5.0)
    rc = run(prepared, c, "recompute-only")
    lm = run(prepared, c, "lmcache-like")
    kv = run(prepared, c, "kvpolicy")
    check_conservation(kv, trace)
    assert kv.bytes_read == 0 and lm.bytes_read == 0
    assert kv.quantile_ms(0.95) <= rc.quantile_ms(0.95) * 1.05 < lm.quantile_ms(0.95)
    assert kv.loads < lm.loads / 3, "timeouts are data: the model stops believing in the source"


def test_compute_while_loading_meets_the_load_in_the_middle(trace, prepared):
    """On a link too slow for a plain load to win, kvpolicy splits: part of each found range is
    recomputed (split_recompute), the rest arrives; loads are cut where compute meets them."""
    c = cluster(trace, node_bandwidth_bytes_per_s=0.05e9, replica_bandwidth_bytes_per_s=0.05e9)
    sim = Simulator(prepared, c, policy_set("kvpolicy"))
    sim.seed_pool(prepared.keys)
    kv = sim.run()
    check_conservation(kv, trace)
    tok = kv.ledger.tokens
    assert tok["split_recompute"] > 0 and tok["remote_hit"] > 0
    assert kv.bytes_unused > 0, "a load cut where compute met it moved bytes it did not need"
    plain = Simulator(prepared, c, attrs.evolve(policy_set("kvpolicy"), compute_while_loading=False))
    plain.seed_pool(prepared.keys)
    pl = plain.run()
    assert pl.ledger.tokens["split_recompute"] == 0
    assert kv.ledger.tokens["remote_hit"] > pl.ledger.tokens["remote_hit"], "splitting uses the link where a plain load cannot win"


def test_interference_is_charged_to_the_receiving_replica(trace, prepared):
    c = cluster(trace)
    res = run(prepared, c, "lmcache-like")
    assert res.stall_s > 0
    quiet = run(prepared, attrs.evolve(c, interference_s_per_byte=0.0), "lmcache-like")
    assert quiet.stall_s == 0
    assert quiet.ttft_s.sum() < res.ttft_s.sum(), "stolen GPU time delays prefills"


def test_background_publishes_leave_loads_alone(trace, prepared):
    fair = run(prepared, cluster(trace), "vllm-like")
    bg = run(prepared, cluster(trace, publish_priority="background", stage_bytes_per_s=2e9), "vllm-like")
    check_conservation(bg, trace)
    assert bg.bytes_written > 0
    with pytest.raises(ConfigError, match="publish_priority"):
        cluster(trace, publish_priority="urgent")
    assert fair.link_series and all(len(v[0]) == len(v[1]) == len(v[2]) for v in fair.link_series.values())
    assert all(0.0 <= u <= 1.0 for v in fair.link_series.values() for u in v[1])


def test_a_long_decode_tail_costs_a_few_samples_not_one_per_period(trace, prepared):
    """Decodes that end long after the last arrival (here up to ~6e4 s: 0.01 tokens/s) must not keep the utilisation
    sampler ticking every duration/200 until they do — ~1e5 samples here, billions at 1e-10 tokens/s (memory, then a
    hang). Past the last arrival with the network idle, the sampler skips to 4 samples before the next event."""
    res = run(prepared, cluster(trace, decode_tokens_per_s=0.01), "kvpolicy", seed=0)
    check_conservation(res, trace)
    t = next(iter(res.link_series.values()))[0]
    assert t[-1] > 1e4  # it did sample through the tail
    assert 200 <= t.size < 200 + 10 * len(trace)  # the arrivals' ~200, then a handful per tail event


def test_a_load_that_ends_in_time_queues_only_once_its_blocks_are_installed(trace, prepared):
    """A plain load that ended while its request waited joined the prefill queue stamped at 'now + install'
    and could take a slot at an earlier event — a negative queue wait, a prefill before its KV was in place.
    This configuration had one (found by the conservation property)."""
    c = cluster(trace, router="round-robin", prefill_slots=1, failure_rate=0.3, timeout_rate=0.0, storage_nodes=2, transport_timeout_s=2.0)
    res = run(prepared, c, "kvpolicy", seed=0)
    check_conservation(res, trace)
    assert res.ledger.to_dict()["distributions"]["remote_hit"]["queue_s"]["count"] > 0, "the ledger keeps the queue wait apart"


def test_a_run_does_not_depend_on_where_its_objects_live_in_memory(monkeypatch):
    """Requests computing while they load were kept in a set: iterated in address order, they were re-planned in
    a different order from one run to the next, and the same simulation in one process gave different TTFTs
    (chat seed 101, hit density in the pool: 152.7 or 153.8 GPU seconds). Here each run hashes requests at
    random, as addresses would."""
    import random

    from kvpolicy.sim import world

    tr = generate(preset("chat", n_requests=2500, block_size_tokens=256, seed=101))
    cluster = default_cluster(tr, bytes_per_token=131072, prefill=DEFAULT_PREFILL)
    sc = build("steady", tr, cluster)
    prep = Prepared(sc.trace)
    ps = attrs.evolve(policy_set("kvpolicy"), pool_eviction="hit-density")
    runs = []
    for s in (1, 2):
        rng = random.Random(s)
        hashes: dict[int, int] = {}
        monkeypatch.setattr(world._Req, "__hash__", lambda self: hashes.setdefault(id(self), rng.getrandbits(60)))
        r = Simulator(prep, sc.cluster, ps, events=sc.events, seed=101).run()
        runs.append((r.ttft_s.copy(), r.gpu_prefill_s))
    assert np.array_equal(runs[0][0], runs[1][0]) and runs[0][1] == runs[1][1]


OWN = """
import attrs
from kvpolicy.eviction.base import PriorityPolicy
from kvpolicy.sim import PRESETS


class MyLRU(PriorityPolicy):  # LRU written by a user
    name = "my-lru"

    def priority(self, node):
        return (node.t_access, -node.depth)


class Shallow(PriorityPolicy):  # keeps deep blocks: not LRU
    name = "shallow"

    def priority(self, node):
        return (node.depth, node.t_access)


def mine():
    return attrs.evolve(PRESETS["vllm-like"], name="vllm-mine", local_eviction=__file__ + ":MyLRU", pool_eviction=__file__ + ":MyLRU")


SHALLOW = attrs.evolve(PRESETS["vllm-like"], name="vllm-shallow", local_eviction=__file__ + ":Shallow", pool_eviction=__file__ + ":Shallow")


SAME_NAME = attrs.evolve(PRESETS["kvpolicy"], publish="threshold-2")
NOT_A_SET = 3
"""


def test_compare_runs_a_policy_set_of_your_own(trace, tmp_path):
    """A PolicySet object, or PATH.py:NAME naming one (or a function giving one), runs beside the presets; its
    eviction may be a policy of your own: vllm-like with a user's LRU in both tiers is vllm-like, row for row."""
    mod = tmp_path / "mysets.py"
    mod.write_text(OWN)
    c = cluster(trace)
    report, _ = compare(trace, c, scenarios=["steady"], policies=["vllm-like", f"{mod}:mine", f"{mod}:SHALLOW"], seed=3)
    rows = {r["policy"]: r for r in report["runs"]}
    assert set(rows) == {"vllm-like", "vllm-mine", "vllm-shallow", "recompute-only"}
    for k in ("ttft_p95_ms", "gpu_prefill_s", "loads", "bytes_read", "bytes_written"):
        assert rows["vllm-mine"][k] == rows["vllm-like"][k], k
    assert rows["vllm-shallow"]["gpu_prefill_s"] != rows["vllm-like"]["gpu_prefill_s"], "the policy of your own is the one that ran"
    obj = attrs.evolve(policy_set("vllm-like"), name="lru-pool-kvpolicy", pool_eviction="lru")
    report, _ = compare(trace, c, scenarios=["steady"], policies=[obj], seed=3)
    assert {r["policy"] for r in report["runs"]} == {"lru-pool-kvpolicy", "recompute-only"}
    for bad, says in (([f"{mod}:SAME_NAME", "kvpolicy"], "two policy sets are named 'kvpolicy'"),
                      ([f"{mod}:NOT_A_SET"], "not a kvpolicy.sim.PolicySet"), ([f"{mod}:nope"], "has no name 'nope'")):
        with pytest.raises(ConfigError) as e:
            compare(trace, c, scenarios=["steady"], policies=bad)
        assert e.value.field == "--policies" and says in e.value.problem, e.value.problem
    with pytest.raises(ConfigError) as e:
        PolicySet("x", local_eviction=f"{tmp_path}/absent.py:X")
    assert e.value.field == "local_eviction" and "no file" in e.value.problem
    assert main(["compare", "--preset", "chat", "--policies", f"{mod}:NOT_A_SET", "--no-progress"]) == 2


def test_the_replicas_compute_runs_at_compute_factor_times_the_profile(trace, prepared):
    """compute_factor is physics every policy set lives with: recompute-only's GPU seconds (no dispatch cost here)
    scale by it (within 2 %: the order in which requests finish, and so what the local caches hold, moves a little)."""
    base = run(prepared, cluster(trace, dispatch_s=0.0), "recompute-only")
    for f in (0.5, 2.0):
        res = run(prepared, cluster(trace, compute_factor=f, dispatch_s=0.0), "recompute-only")
        assert res.gpu_prefill_s == pytest.approx(f * base.gpu_prefill_s, rel=0.02)
    for bad in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ConfigError) as e:
            cluster(trace, compute_factor=bad)
        assert e.value.field == "compute_factor"


def test_kvpolicys_controller_learns_the_link_when_its_prior_is_wrong(trace, prepared):
    """link_prior_factor: kvpolicy's controller is told the path's bandwidth times this (a NIC's spec, an idle-fabric
    benchmark); it learns B_eff from the transfers it admits. The physics and every baseline are unchanged."""
    c = cluster(trace, router="round-robin")
    real_bw = min(c.node_bandwidth_bytes_per_s, c.replica_bandwidth_bytes_per_s)
    for f in (4.0, 0.5):
        sim = Simulator(prepared, attrs.evolve(c, link_prior_factor=f), policy_set("kvpolicy"))
        assert sim.planner.controller.model.prior.bandwidth_bytes_per_s == pytest.approx(f * real_bw)
        sim.run()
        learned = 1.0 / sim.planner.controller.model.coefficients(0.5).s_per_byte
        assert abs(np.log(learned / real_bw)) < abs(np.log(f)) / 2, f"prior {f}x: it believes {learned / real_bw:.2f}x the link"
    base = run(prepared, c, "vllm-like")
    assert np.array_equal(run(prepared, attrs.evolve(c, link_prior_factor=4.0), "vllm-like").ttft_s, base.ttft_s), "a baseline has no prior"
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ConfigError) as e:
            attrs.evolve(c, link_prior_factor=bad)
        assert e.value.field == "link_prior_factor"


def test_a_uniform_compute_scale_is_the_compute_factor_per_request(trace, prepared):
    """compute_scale replays measured compute request by request (bench_sim_vs_real feeds it each real forward pass
    over the profile's); a scale of f on every request is compute_factor=f exactly — every TTFT and every GPU second,
    through plain loads, compute while loading and the controller's learning — wherever the router does not read the
    cluster's prediction (round-robin here: a request's compute is not known before it runs). At 100 MB/s kvpolicy
    declines, splits and loads by turns, and how many of each follows the compute it learns."""
    for name in ("recompute-only", "kvpolicy", "lmcache-like"):
        for f in (0.5, 2.0):
            c = cluster(trace, router="round-robin", node_bandwidth_bytes_per_s=1e8, replica_bandwidth_bytes_per_s=1e8)
            per_request = run(prepared, c, name, compute_scale=np.full(len(trace), f))
            whole = run(prepared, attrs.evolve(c, compute_factor=f), name)
            assert np.array_equal(per_request.ttft_s, whole.ttft_s), (name, f)
            assert per_request.gpu_prefill_s == whole.gpu_prefill_s
    one = np.ones(len(trace))
    one[7] = 3.0  # one slow forward pass: that request's TTFT grows, by no more than twice its own prefill
    c = cluster(trace, router="round-robin", dispatch_s=0.0)
    base = run(prepared, c, "recompute-only")
    slow = run(prepared, c, "recompute-only", compute_scale=one)
    own = c.prefill_s(0, int(trace.input_tokens[7]))
    assert own < slow.ttft_s[7] - base.ttft_s[7] <= 2 * own + 1e-9
    for bad, says in ((np.ones(3), "one number per request"), (np.r_[one[:-1], 0.0], "request 239"),
                      (np.r_[np.nan, one[1:]], "request 0"), ([[1.0]], "one number per request"),
                      (["fast"] * len(trace), "one number per request"), ([None] * len(trace), "request 0 has nan")):
        with pytest.raises(ConfigError) as e:
            Simulator(prepared, c, policy_set("kvpolicy"), compute_scale=bad)
        assert e.value.field == "compute_scale" and says in e.value.problem, e.value.problem


def test_each_replica_can_have_its_own_controller(trace, prepared, monkeypatch):
    """controller_scope="replica": every replica decides with a controller of its own, as an engine process that
    embeds one (bench_sim_vs_real's real replicas do) — it learns from its own loads and prefills only, so it leaves
    its priors later than the cluster's, which hears them all. One replica: the two scopes are the same run."""
    from kvpolicy.admission import AdmissionController

    ps = policy_set("kvpolicy")
    own = attrs.evolve(ps, controller_scope="replica")
    c = cluster(trace, router="round-robin", node_bandwidth_bytes_per_s=1e8, replica_bandwidth_bytes_per_s=1e8)
    alone = attrs.evolve(c, replicas=1)
    assert np.array_equal(run(prepared, alone, ps).ttft_s, run(prepared, alone, own).ttft_s)
    asked: dict[int, set] = {}
    decide = AdmissionController.decide

    def spy(self, m, ctx):
        asked.setdefault(id(self), set()).add(ctx.replica)
        return decide(self, m, ctx)

    monkeypatch.setattr(AdmissionController, "decide", spy)
    for scope, controllers in (("cluster", 1), ("replica", c.replicas)):
        asked.clear()
        sim = Simulator(prepared, attrs.evolve(c, compute_factor=2.0), attrs.evolve(ps, controller_scope=scope))
        res = sim.run()
        check_conservation(res, trace)
        assert len(asked) == controllers, (scope, asked)
        if scope == "replica":
            assert all(len(names) == 1 for names in asked.values()), "a controller decided for another replica"
        else:
            assert asked[id(sim.planner.controller)] == {r.name for r in sim.fleet.replicas} and not sim.planner.controllers
    # every prefill in one piece (no compute while loading): each replica's controller heard exactly its own
    # replica's requests, and learned the compute from them
    sim = Simulator(prepared, attrs.evolve(c, compute_factor=2.0), attrs.evolve(own, compute_while_loading=False))
    res = sim.run()
    for idx, ctl in ((0, sim.planner.controller), *sim.planner.controllers.items()):
        assert ctl.model.prefill_ratio.hist.count == int(np.sum(res.routes == idx)) >= 20
        assert ctl.model.prefill_ratio.q(0.5) == pytest.approx(2.0, rel=0.05)
    with pytest.raises(ConfigError) as e:
        attrs.evolve(ps, controller_scope="node")
    assert e.value.field == "controller_scope"


def test_kvpolicys_controller_learns_the_compute_it_observes(trace, prepared):
    """The admission controller's prior is the profile; the replicas' real prefill runs compute_factor times it. The
    reference engine has always fed each measured prefill back (observe_prefill); the simulated replicas did not, so a
    profile off by 2x stayed off for the whole run — with GPUs twice as fast as profiled, kvpolicy kept loading what
    recompute now beat, and lost to recompute-only on agent, mixed and chat (docs/sim.md)."""
    for f in (0.5, 2.0):
        sim = Simulator(prepared, cluster(trace, compute_factor=f), policy_set("kvpolicy"))
        sim.run()
        learned = sim.planner.controller.model.prefill_ratio.q(0.5)
        assert learned == pytest.approx(f, rel=0.05), f"compute_factor {f}: the controller believes {learned}"
    kept = Simulator(prepared, cluster(trace, compute_factor=0.5), attrs.evolve(policy_set("kvpolicy"), learn_compute=False))
    kept.run()
    assert kept.planner.controller.model.prefill_ratio.q(0.5) == 1.0, "learn_compute=False: the profile is kept"
    with pytest.raises(ConfigError, match="learn_compute"):
        attrs.evolve(policy_set("kvpolicy"), learn_compute="yes")


_EVICTIONS = ("lru", "belady", "reuse-distance", "fifo", "s3fifo")
_PUBLISH = ("all", "never", "threshold-2", "dueling", "structure-aware", "oracle", "boundary+reuse-aware")
_LOADS = ("admission", "always", "min-tokens", "never", "oracle")


@settings(max_examples=int(os.environ.get("KVPOLICY_COMBO_EXAMPLES", "40")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(local=st.sampled_from(_EVICTIONS), pool=st.sampled_from(_EVICTIONS), publish=st.sampled_from(_PUBLISH),
       load=st.sampled_from(_LOADS), timeout=st.sampled_from(("none", "admission", "sglang")), failure=st.sampled_from(("recompute", "fail")),
       flags=st.tuples(*[st.booleans()] * 6), scope=st.sampled_from(("cluster", "replica")), wa=st.sampled_from(("none", "tinylfu")),
       router=st.sampled_from(ROUTERS), seed=st.integers(0, 99), pull_path=st.sampled_from(("relay", "direct", "choose", "bogus")),
       own_router=st.sampled_from((None, *ROUTERS)), pool_capacity=st.sampled_from(("cluster", "unbounded", "bogus")))
def test_every_combination_of_policy_set_fields_runs_or_is_a_config_error(trace, local, pool, publish, load, timeout, failure, flags,
                                                                           scope, wa, router, seed, pull_path, own_router, pool_capacity):
    """Issue #58: a PolicySet with load="oracle" and pull_from_peers=True crashed with KeyError in the pool's grouping,
    through compare. Every combination of fields either runs — every request finishing once, nothing left held — or
    is refused at construction with a ConfigError naming a field."""
    warmup, uses_pool, cwl, learn, republish, pulls = flags
    try:
        ps = PolicySet("combo", local_eviction=local, pool_eviction=pool, publish=publish, load=load, timeout=timeout, failure=failure,
                       warmup=warmup, uses_pool=uses_pool, compute_while_loading=cwl, learn_compute=learn, controller_scope=scope,
                       write_admission=wa, republish_unhealthy=republish, pull_from_peers=pulls, pull_path=pull_path,
                       router=own_router, pool_capacity=pool_capacity)
    except ConfigError as e:
        assert e.field in {a.name for a in attrs.fields(PolicySet)}, e
        event("refused")
        return
    event("ran")
    small = trace.head(80)
    sim = Simulator(Prepared(small), cluster(small, router=router, failure_rate=0.2, timeout_rate=0.1, transport_timeout_s=2.0), ps, seed=seed)
    check_conservation(sim.run(), small)
    check_released(sim)


_BOUNDED = ("kvpolicy", "vllm-like", "sglang-like", "lmcache-like", "sglang-p2p-like", "lmcache-p2p-like", "llm-d-like")


@settings(max_examples=int(os.environ.get("KVPOLICY_BOUND_EXAMPLES", "6")), deadline=None)
@given(seed=st.integers(0, 2**16), kind=st.sampled_from(("chat", "rag", "agent", "mixed")), n=st.integers(40, 120),
       router=st.sampled_from(ROUTERS), replicas=st.integers(2, 4), nodes=st.integers(1, 3), local_blocks=st.integers(8, 400),
       pulls=st.booleans(), failure=st.sampled_from([0.0, 0.2]), pull_path=st.sampled_from(("relay", "direct", "choose")))
# found 2026-12-07 by the mutation tool's random draws: vllm-like (direct pulls, a fifth of transfers failing, random
# routing) saved 2.4986 GPU s against the oracle's 2.4899 — the oracle's own loads failed where vllm-like's did not, and
# its retries were routed elsewhere. The oracle's loads now never fail (it knows which would): 2.7182
@example(seed=63, kind="chat", n=40, router="random", replicas=4, nodes=3, local_blocks=63, pulls=True, failure=0.2, pull_path="direct")
# found 2026-12-07 (fourth session) by the same draws: vllm-like's failed load of request 11 sent its retry to the other
# replica, request 14 left that replica's queue 84 ms sooner, and request 20 found 31 more of 14's blocks in the pool —
# a routing the oracle, whose loads never fail, never had (6.6466 GPU s against 6.5462). On vllm-like's own routes
# the oracle saves 6.6466: the bound is over cache decisions on the same routes
@example(seed=440, kind="rag", n=79, router="random", replicas=2, nodes=1, local_blocks=8, pulls=False, failure=0.2, pull_path="relay")
def test_the_oracle_bounds_every_sets_gpu_seconds_saved(seed, kind, n, router, replicas, nodes, local_blocks, pulls, failure, pull_path):
    """Issue #58: kvpolicy saved 105 % of the oracle's GPU seconds on the built-in trace — the oracle could not pull, and
    loaded only what won on time. The oracle now has every mechanism a set has and loads every block it knows will
    arrive: on random small traces and clusters, replaying a set's own routes (``Simulator(routes=...)``: where its
    retries went, and so every queue behind them), the oracle's GPU seconds saved are at least the set's, with pulls on
    or off. Where the set's routes are the ones the router gives a run without retries, that is the oracle's own run."""
    tr = generate(preset(kind, n_requests=n, block_size_tokens=64, seed=seed))
    c = default_cluster(tr, bytes_per_token=BPT, prefill=DEFAULT_PREFILL, replicas=replicas, storage_nodes=nodes, router=router,
                        local_kv_gib=local_blocks * 64 * BPT / 2**30, pool_share=0.5, failure_rate=failure)
    prep = Prepared(tr)
    base = Simulator(prep, c, policy_set("recompute-only"), seed=seed).run().gpu_prefill_s
    for name in _BOUNDED:
        ps = attrs.evolve(policy_set(name), name=f"{name}~", pull_from_peers=pulls, pull_path=pull_path if pulls else "relay")
        sim = Simulator(prep, c, ps, seed=seed)
        res = sim.run()
        # kv-overlap's count of what it sent each replica is returned by every attempt: at its prefill, or as it retries
        assert [r.routed_tokens for r in sim.fleet.replicas] == [0] * len(sim.fleet.replicas), ps.name
        saved = base - res.gpu_prefill_s
        # a set's own router and pull path (llm-d-like's) go to the oracle too, and the routes it took
        orc = attrs.evolve(policy_set("oracle"), router=ps.router, pull_path=ps.pull_path if pulls else "relay")
        bound = base - Simulator(prep, c, orc, seed=seed, routes=res.routes).run().gpu_prefill_s
        assert saved <= bound + 1e-9, f"{ps.name} saved {saved:.4f} GPU s, the oracle on its routes {bound:.4f}"


def test_a_replayed_route_sends_every_attempt_to_its_replica_and_bad_routes_are_named():
    """``Simulator(routes=...)`` replays another run's routes: every request is served where the array says, whatever
    the router (a round-robin cluster given one run's random routes serves exactly there), and an array of the wrong
    length, type or range is a ConfigError naming ``routes``."""
    tr = generate(preset("chat", n_requests=60, block_size_tokens=64, seed=5))
    c = default_cluster(tr, bytes_per_token=BPT, prefill=DEFAULT_PREFILL, replicas=3, storage_nodes=2, router="random",
                        local_kv_gib=64 * 64 * BPT / 2**30, pool_share=0.5)
    prep = Prepared(tr)
    want = Simulator(prep, c, policy_set("vllm-like"), seed=9).run().routes
    assert len(set(want.tolist())) == 3
    got = Simulator(prep, attrs.evolve(c, router="round-robin"), policy_set("kvpolicy"), seed=0, routes=want).run().routes
    assert got.tolist() == want.tolist()
    for bad in (want[:-1], want.astype(float), np.full(len(want), 3), np.full(len(want), -1), "0", [0] * (len(want) - 1) + [-1]):
        with pytest.raises(ConfigError) as e:
            Simulator(prep, c, policy_set("kvpolicy"), routes=bad)
        assert e.value.field == "routes", bad
    as_list = Simulator(prep, c, policy_set("kvpolicy"), seed=0, routes=want.tolist()).run().routes  # any sequence of ints
    assert as_list.tolist() == want.tolist()


def test_a_replayed_route_may_name_a_replica_a_scale_out_adds_once_it_is_there():
    """With a scale-out in the run, a route may name the replica it adds (the bound is the replicas the run ends with),
    but a request that arrives before that replica joins cannot be sent to it: a ConfigError naming ``routes``, not an
    IndexError from inside the router."""
    tr = generate(preset("chat", n_requests=40, block_size_tokens=64, seed=5))
    c = default_cluster(tr, bytes_per_token=BPT, prefill=DEFAULT_PREFILL, replicas=2, storage_nodes=1, local_kv_gib=64 * 64 * BPT / 2**30,
                        pool_share=0.5)
    prep = Prepared(tr)
    t_mid = float(prep.arrival_s[20])
    events = (ScaleOut(t_s=t_mid, replicas=1),)
    late = np.array([i % 2 if i <= 20 else 2 for i in range(40)])  # replica 2 only from request 21 on
    got = Simulator(prep, c, policy_set("kvpolicy"), events=events, routes=late).run().routes
    assert got.tolist() == late.tolist()
    with pytest.raises(ConfigError, match="routes"):
        Simulator(prep, c, policy_set("kvpolicy"), events=events, routes=np.full(40, 3))
    early = late.copy()
    early[3] = 2
    with pytest.raises(ConfigError) as e:
        Simulator(prep, c, policy_set("kvpolicy"), events=events, routes=early).run()
    assert e.value.field == "routes" and "request 3" in str(e.value)


def test_the_simulators_default_seed_is_0():
    """Every random draw takes the run's seed; left out, it is 0 (the golden files' runs pass none)."""
    tr = generate(preset("chat", n_requests=40, block_size_tokens=64, seed=5))
    c = default_cluster(tr, bytes_per_token=BPT, prefill=DEFAULT_PREFILL, replicas=3, storage_nodes=2, router="random",
                        local_kv_gib=64 * 64 * BPT / 2**30, pool_share=0.5, failure_rate=0.2)
    prep = Prepared(tr)
    runs = [Simulator(prep, c, policy_set("vllm-like"), **kw).run() for kw in ({}, {"seed": 0}, {"seed": 1})]
    assert runs[0].routes.tolist() == runs[1].routes.tolist() and runs[0].ttft_s.tolist() == runs[1].ttft_s.tolist()
    assert runs[0].routes.tolist() != runs[2].routes.tolist()


def test_the_oracles_loads_never_fail_nor_hang_where_every_other_sets_do(trace, prepared):
    """Hindsight includes the transfers: with every transfer failing (and none hanging, then every one hanging), the
    oracle's loads all arrive — no failure, no retry —, while vllm-like's fail and are retried."""
    for rates in (dict(failure_rate=1.0), dict(timeout_rate=1.0, transport_timeout_s=1.0)):
        c = cluster(trace, **rates)
        orc = Simulator(prepared, c, policy_set("oracle"), seed=0).run()
        assert orc.loads > 0 and orc.loads_failed == orc.loads_timeout == orc.retries == 0, (rates, orc.row())
        other = Simulator(prepared, c, policy_set("vllm-like"), seed=0).run()
        assert other.loads_failed + other.loads_timeout > 0 and other.retries > 0, rates


def test_a_hang_is_drawn_per_source_so_one_load_can_lose_one_node_and_keep_the_others(trace, prepared):
    """Each transfer's hang is drawn from (seed, request, attempt, source): a load over several nodes at a timeout rate of
    ½ has some groups hung and others moving — one draw per load would hang all of its groups or none."""
    from kvpolicy.sim.transfers import Transfers

    sim = Simulator(prepared, cluster(trace, timeout_rate=0.5, transport_timeout_s=1.0, storage_nodes=4), policy_set("vllm-like"), seed=0)
    begin = sim.transfers.begin_read
    patterns = []

    def spy(*a, **kw):
        load = begin(*a, **kw)
        patterns.append(tuple(f is None for f in load.flows))
        return load

    sim.transfers.begin_read = spy  # the one Transfers the lifecycle and the warmup call
    sim.run()
    multi = [p for p in patterns if len(p) > 1]
    assert isinstance(sim.transfers, Transfers) and multi, "loads over several nodes"
    assert any(any(p) and not all(p) for p in multi), "some load lost one node and kept another"


def test_the_write_gate_hears_every_request_not_only_those_that_publish(trace, prepared):
    """Issue #60: TinyLFU's estimate is how many requests carried a block — all of them, also those whose publish
    filter writes nothing (a count rule's first sighting, a `never` set). A gate that heard only publishing requests
    would value every block at nothing here: nothing is published."""
    ps = PolicySet("gate-never", publish="never", load="always", write_admission="tinylfu")
    sim = Simulator(prepared, cluster(trace), ps, seed=0)
    res = sim.run()
    assert res.bytes_written == 0
    first = int(trace.block_ids[trace.block_offsets[0]])
    seen = sum(1 for i in range(len(trace)) if first in trace.block_ids[trace.block_offsets[i]:trace.block_offsets[i + 1]])
    assert seen >= 2 and sim.pool.write_gate.value(first) >= min(seen, 15) // 2


def test_a_pull_crosses_the_peers_staging_copy_its_egress_and_the_nodes_ingress():
    """Issue #60: a pull relays through the pool: from the peer's staging copy (its GPU to CPU memory, where it has one)
    out of its NIC into the node, then as any read — out of the node into this replica (and its staging copy). A read
    from the pool crosses only the second part."""
    from types import SimpleNamespace

    from kvpolicy.sim.transfers import Transfers

    node = SimpleNamespace(out="node.out", inn="node.in")
    rep = SimpleNamespace(inn="rep.in", stage="rep.stage")
    peer = SimpleNamespace(out="peer.out", stage="peer.stage")
    assert Transfers.read_path(node, rep) == ("node.out", "rep.in", "rep.stage")
    assert Transfers.read_path(node, rep, peer) == ("peer.stage", "peer.out", "node.in", "node.out", "rep.in", "rep.stage")
    bare = SimpleNamespace(out="peer.out", stage=None)
    assert Transfers.read_path(node, SimpleNamespace(inn="rep.in", stage=None), bare) == ("peer.out", "node.in", "node.out", "rep.in")


def test_a_direct_pull_crosses_the_peer_and_this_replica_and_no_node():
    """Issue #58: llm-d's P2P tier reads a block straight from the holder: the peer's staging copy and egress, then this
    replica's ingress and staging copy — the node a relay would pass through is not on the path."""
    from types import SimpleNamespace

    from kvpolicy.sim.transfers import Transfers

    node = SimpleNamespace(out="node.out", inn="node.in")
    rep = SimpleNamespace(inn="rep.in", stage="rep.stage")
    peer = SimpleNamespace(out="peer.out", stage="peer.stage")
    assert Transfers.read_path(node, rep, peer, True) == ("peer.stage", "peer.out", "rep.in", "rep.stage")
    assert Transfers.read_path(node, rep, None, True) == ("node.out", "rep.in", "rep.stage"), "a read from the pool is no pull"


def test_compare_bounds_each_set_by_the_oracle_with_its_own_router_and_pull_path():
    """llm-d-like routes by KV overlap and pulls straight from peers; an oracle routed round-robin through the pool is no
    bound on it. compare runs the oracle as each such set is deployed, and the bound line holds each set to its own."""
    from kvpolicy.sim.compare import _oracle_variants, checks

    c = ClusterConfig(bytes_per_token=2048, prefill=DEFAULT_PREFILL, router="round-robin")
    from kvpolicy.sim import PRESETS

    sets = [PRESETS[n] for n in ("kvpolicy", "llm-d-like", "lmcache-p2p-like", "sglang-like", "oracle", "recompute-only")]
    v = _oracle_variants(sets, c)
    assert set(v) == {"kvpolicy", "llm-d-like"}, "the sets deployed as the oracle is (round-robin, relay pulls) need none"
    assert (v["llm-d-like"].router, v["llm-d-like"].pull_path) == ("kv-overlap", "direct")
    assert (v["kvpolicy"].router, v["kvpolicy"].pull_path) == ("round-robin", "choose")
    assert all(x.load == "oracle" and x.publish == "oracle" for x in v.values())
    assert _oracle_variants([s for s in sets if s.name != "oracle"], c) == {}

    def report(own_bound):
        runs = [{"scenario": "steady", "policy": p, "gpu_saved_s": g, "ttft_p95_ms": 1.0, "bytes_written": 0, "loads": 0,
                 "e_benefit_s_per_s": None, "gpu_prefill_s": 100.0 - g} for p, g in (("oracle", 10.0), ("llm-d-like", 12.0), ("recompute-only", 0.0))]
        return {"runs": runs, "oracle_bounds": {"steady": {"llm-d-like": {"oracle": "oracle [kv-overlap, direct pulls]", "gpu_saved_s": own_bound}}}}

    line = next(x for x in checks(report(12.5)) if x["check"] == "the oracle's GPU seconds saved bound every set")
    assert line["ok"] and "llm-d-like against the oracle [kv-overlap, direct pulls]: 12.5 s" in line["detail"]
    line = next(x for x in checks(report(11.0)) if x["check"] == "the oracle's GPU seconds saved bound every set")
    assert not line["ok"] and "beaten by llm-d-like 12.0 s" in line["detail"]


def test_a_replica_knows_the_utilisation_its_hits_spared_it():
    """The ledger's price of a saved GPU second needs what the replica would have been busy with had it recomputed
    what it loaded: its utilisation plus its hits' GPU seconds per slot, averaged over the same window. A steady
    stream of r saved seconds per second on s slots adds r/s; with no hits it is the utilisation itself; old hits fade
    as the utilisation's window does."""
    from types import SimpleNamespace

    from kvpolicy.sim.world import UTIL_WINDOW_S, _Replica

    rep = _Replica(0, SimpleNamespace(nodes={}), 4, None, None, None)
    rep.util = 0.3
    assert rep.utilisation_without_hits(5.0) == 0.3
    t = 0.0
    while t < 20 * UTIL_WINDOW_S:  # 0.5 GPU s saved every 0.25 s: 2 s per s on 4 slots
        t += 0.25
        rep.note_hit(t, 0.5)
    assert rep.utilisation_without_hits(t) == pytest.approx(0.3 + 2.0 / 4, rel=0.02)
    faded = rep.utilisation_without_hits(t + UTIL_WINDOW_S) - 0.3
    assert faded == pytest.approx(0.5 * np.exp(-1.0), rel=0.02)


@pytest.mark.parametrize("seed", [31, 32])
def test_compares_ledger_line_tells_the_truth_on_random_trace_families(seed):
    """Issue #58: on random trace families (every generator knob drawn from the seed), in every view, compare's line on
    the ledger's ranking names the set E[benefit] ranks first, says whether it saves within 2 points of the most with a
    p95 within 5 % of the best — recomputed here from the runs — and names the sets that meet both bars, or says that
    none does. (Whether the ranking itself holds is the goal matrix's, measured in docs/benchmarks.md: it does not in
    every view.)"""
    from kvpolicy.sim import compare
    from kvpolicy.traces import SyntheticSpec

    rng = np.random.default_rng(seed)
    spec = SyntheticSpec(n_requests=150, block_size_tokens=int(rng.choice([64, 128, 256])), mix=tuple(zip(("chat", "rag", "agent"), rng.dirichlet(np.ones(3)).tolist())),
                         rate_per_s=float(rng.uniform(1, 6)), n_tenants=int(rng.integers(1, 6)), n_docs=int(rng.integers(20, 500)),
                         doc_zipf=float(rng.uniform(1.05, 1.8)), think_time_s=float(rng.uniform(2, 60)), seed=seed)
    trace = generate(spec)
    router = ("round-robin", "kv-overlap")[seed % 2]
    cl = attrs.evolve(default_cluster(trace, bytes_per_token=131072, prefill=DEFAULT_PREFILL, replicas=4), router=router)
    report, _ = compare(trace, cl, seed=seed)
    line = "the set the ledger ranks first saves within 2 points of the most, p95 within 5% of the best"
    total = {r["scenario"]: r["gpu_prefill_s"] for r in report["runs"] if r["policy"] == "recompute-only"}
    for s in report["scenarios"]:
        got = [c for c in report["checks"] if c["scenario"] == s and c["check"] == line]
        assert len(got) == 1, s
        rows = [r for r in report["runs"] if r["scenario"] == s and r["policy"] != "oracle"]
        ranked = [r for r in rows if r["e_benefit_s_per_s"] is not None]
        assert {r["policy"] for r in rows} - {r["policy"] for r in ranked} == {"recompute-only"}, s  # it uses no pool: nothing to rank
        first = max(ranked, key=lambda r: r["e_benefit_s_per_s"])
        most, fastest = max(r["gpu_saved_s"] for r in rows), min(r["ttft_p95_ms"] for r in rows)

        def good(r):
            return (most - r["gpu_saved_s"]) / total[s] * 100 <= 2.0 and r["ttft_p95_ms"] <= 1.05 * fastest

        assert got[0]["ok"] == good(first), (s, got[0]["detail"])
        assert got[0]["detail"].startswith(f"{first['policy']} (E[benefit] "), s
        meet = [r["policy"] for r in rows if good(r)]
        assert got[0]["detail"].endswith(f"sets that meet both: {', '.join(meet)}" if meet else "no set meets both "
                                                                                                 "(the most GPU seconds and the best p95 pull apart)"), s
