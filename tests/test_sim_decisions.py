"""The simulator's decisions on scenarios small enough to work by hand (issue #49): a few requests, one storage
node, a linear prefill, and every TTFT, byte and route computed here from the cluster's figures — not read back from
the simulator. Each test names the decision it pins."""

import math

import attrs
import numpy as np
import pytest

from kvpolicy.admission import AdmissionContext, LoadOutcome
from kvpolicy.errors import ConfigError
from kvpolicy.matching import PrefixMatch
from kvpolicy.profile import PrefillModel
from kvpolicy.sim import Degrade, PolicySet, Prepared, Simulator, default_cluster, policy_set
from kvpolicy.sim.network import FlowNetwork
from kvpolicy.sim.replicas import Replicas
from kvpolicy.traces.model import Trace

B = 64  # tokens per block
BPT = 4096  # bytes per token: a block is 256 KiB
BLOCK_BYTES = B * BPT
# prefill(t0, t1) = a + b·(t1 − t0): 10 ms fixed, 0.1 ms a token
P = PrefillModel(a_s=0.01, b_s_per_token=1e-4, c_s_per_token2=0.0, rms_rel_error=float("nan"), max_rel_error=float("nan"))


def tiny(prompts, arrivals, out=8):
    """Requests of whole blocks plus one token (so every full block is matchable), ``out`` tokens decoded."""
    n = len(prompts)
    off = np.concatenate([[0], np.cumsum([len(p) for p in prompts])]).astype(np.int64)
    return Trace(arrival_s=np.array(arrivals, float), input_tokens=np.array([len(p) * B + 1 for p in prompts], np.int64),
                 output_tokens=np.full(n, out, np.int64), block_offsets=off,
                 block_ids=np.array([b for p in prompts for b in p], np.int64),
                 partial_block_ids=np.arange(10_000, 10_000 + n, dtype=np.int64), block_size_tokens=B)


def cluster(tr, **kw):
    base = dict(replicas=2, storage_nodes=1, router="round-robin", pool_share=1.0, prefill=P)
    base.update(kw)
    return default_cluster(tr, bytes_per_token=BPT, **base)


def simulate(tr, c, name="lmcache-like", **kw):
    sim = Simulator(Prepared(tr), c, policy_set(name) if isinstance(name, str) else name, **kw)
    return sim, sim.run()


# four requests for the same 4 blocks, 100 s apart, round-robin over 2 replicas: replica 0, 1, 0, 1
SAME = ([[1, 2, 3, 4]] * 4, [0.0, 100.0, 200.0, 300.0])


def cold_ttft(c, T):
    return c.lookup_s + c.dispatch_s + P.a_s + P.b_s_per_token * T


def load_ttft(c, k, T, local=0):
    """lookup, the transfer (overhead + bytes over the slower end), the install, the prefill of the rest (after the
    ``local`` cached blocks and the k loaded), and the interference the load's bytes steal from the replica."""
    nbytes = k * BLOCK_BYTES
    link = min(c.node_bandwidth_bytes_per_s, c.replica_bandwidth_bytes_per_s)
    return (c.lookup_s + c.transfer_overhead_s + nbytes / link + c.install_s_per_block * k
            + c.dispatch_s + P.a_s + P.b_s_per_token * (T - (local + k) * B) + c.interference_s_per_byte * nbytes)


def local_ttft(c, k, T):
    return c.lookup_s + c.dispatch_s + P.a_s + P.b_s_per_token * (T - k * B)


def test_a_loaded_prefix_costs_its_transfer_and_install_and_then_stays_local():
    """r0 computes cold on replica 0 and publishes; r1 on replica 1 loads the 4 blocks, installs them (only a load
    that ended ok pays the install) and prefills 1 token; r2 and r3 find all 4 in their replica's own cache — r3
    because r1's loaded blocks were installed there."""
    tr = tiny(*SAME)
    c = cluster(tr)
    sim, res = simulate(tr, c)
    T = 4 * B + 1
    want = [cold_ttft(c, T), load_ttft(c, 4, T), local_ttft(c, 4, T), local_ttft(c, 4, T)]
    assert res.ttft_s == pytest.approx(want, rel=1e-9, abs=1e-12)
    assert list(res.routes) == [0, 1, 0, 1]
    assert res.loads == 1 and res.bytes_read == 4 * BLOCK_BYTES and res.bytes_written == 4 * BLOCK_BYTES
    assert res.ledger.tokens["local_hit"] == 2 * 4 * B and res.ledger.tokens["remote_hit"] == 4 * B


def test_an_install_that_costs_more_delays_exactly_the_loaded_request():
    tr = tiny(*SAME)
    slow = cluster(tr, install_s_per_block=0.25)
    _, a = simulate(tr, cluster(tr))
    _, b = simulate(tr, slow)
    assert b.ttft_s - a.ttft_s == pytest.approx([0.0, 4 * (0.25 - cluster(tr).install_s_per_block), 0.0, 0.0], abs=1e-12)


def test_when_the_run_ends_every_replica_is_drained():
    """The routers read each replica's queued prefill tokens and decoding tokens: a request adds its own when it
    queues and when its decode starts, and takes exactly those away when it leaves."""
    tr = tiny([[1, 2, 3, 4], [1, 2, 3, 4], [5, 6], [1, 2, 7], [5, 6, 8, 9, 10]], [0.0, 0.001, 0.002, 0.003, 0.004], out=40)
    for router in ("least-loaded", "kv-overlap", "round-robin"):
        for name in ("lmcache-like", "kvpolicy"):
            sim, res = simulate(tr, cluster(tr, router=router, prefill_slots=1), name)
            assert np.all(res.completed == 1)
            for rep in sim.fleet.replicas:
                assert (rep.load_tokens, rep.decode_tokens, rep.active, rep.free_slots, len(rep.queue)) == (0, 0, 0, 1, 0), (router, name)
                assert rep.queued_s == pytest.approx(0.0, abs=1e-12)


def test_a_queued_request_counts_its_prompt_less_the_blocks_it_skips(monkeypatch):
    """What a queued request adds to its replica's load (the routers' view) and to its predicted queue (admission's
    view): its prompt less the blocks it will not prefill — cached locally or loaded — in tokens, and the prefill of
    that rest."""
    tr = tiny(*SAME)
    c = cluster(tr)
    seen = []
    enqueue = Replicas.enqueue

    def spy(self, rep, req, t, reused_blocks):
        enqueue(self, rep, req, t, reused_blocks)
        seen.append((req.i, req.queued_tokens, req.queued_pred_s))

    monkeypatch.setattr(Replicas, "enqueue", spy)
    simulate(tr, c)
    T = 4 * B + 1
    assert [i for i, _, _ in seen] == [0, 1, 2, 3]
    for i, tokens, pred in seen:
        skipped = 0 if i == 0 else 4
        assert tokens == T - skipped * B
        assert pred == pytest.approx(c.dispatch_s + P.a_s + P.b_s_per_token * (T - skipped * B))


def test_a_load_behind_a_local_prefix_predicts_the_recompute_of_its_own_blocks_only(monkeypatch):
    """A baseline's load of blocks [L, L+k) is worth their recompute with [0, L) cached: dispatch + prefill(L·B, (L+k)·B)
    less the fixed term (the prompt's rest pays that). Replica 1 caches [1, 2] first (r1); r3 then loads [3, 4]."""
    tr = tiny([[1, 2, 3, 4], [1, 2], [9], [1, 2, 3, 4]], [0.0, 100.0, 200.0, 300.0])
    c = cluster(tr)
    got = {}
    enqueue = Replicas.enqueue

    def spy(self, rep, req, t, reused_blocks):
        got[req.i] = (req.local, req.load, req.predicted_s)
        enqueue(self, rep, req, t, reused_blocks)

    monkeypatch.setattr(Replicas, "enqueue", spy)
    _, res = simulate(tr, c)
    assert got[3][:2] == (2, 2)
    assert got[3][2] == pytest.approx(c.dispatch_s + P.b_s_per_token * 2 * B)
    assert res.ttft_s[3] == pytest.approx(load_ttft(c, 2, 4 * B + 1, local=2), rel=1e-9)


def test_only_the_requests_judged_count_the_bytes_they_read():
    """judge_from_request = 1: request 1's load is judged (its bytes read count), request 0's write is not."""
    tr = tiny(*SAME)
    _, res = simulate(tr, cluster(tr), judge_from_request=1)
    assert res.bytes_read == 4 * BLOCK_BYTES and res.loads == 1


def test_a_degraded_node_serves_at_its_factor_of_the_bandwidth():
    """Degrade(factor): the node's ports run at factor × bandwidth while the window is open: the load's bytes take
    1/factor as long; outside the window, the full rate again."""
    tr = tiny(*SAME)
    base = cluster(tr, node_bandwidth_bytes_per_s=1e9, replica_bandwidth_bytes_per_s=1e9)
    sc = Simulator(Prepared(tr), base, policy_set("lmcache-like"), events=(Degrade(node=0, t1_s=50.0, t2_s=150.0, bandwidth_factor=0.25,
                                                                                     failure_rate=0.0),))
    res = sc.run()
    nbytes = 4 * BLOCK_BYTES
    extra = nbytes / (0.25 * 1e9) - nbytes / 1e9
    _, plain = simulate(tr, base)
    assert res.ttft_s - plain.ttft_s == pytest.approx([0.0, extra, 0.0, 0.0], abs=1e-12)


def test_kv_overlap_sends_a_tie_to_the_first_replica_and_an_overlap_to_its_holder():
    """kv-overlap's cost is the prefill still needed + queued prefill + decode_weight × decode load; the lowest wins,
    a tie goes to the lowest index. r0 (all idle: a tie) → replica 0; r1, the same prompt while r0 decodes → replica
    0 still (its 4 cached blocks outweigh r0's decode); r2, a new prompt → replica 1 (replica 0 is busier)."""
    tr = tiny([[1, 2, 3, 4], [1, 2, 3, 4], [7, 8]], [0.0, 1.0, 2.0], out=400)
    _, res = simulate(tr, cluster(tr, router="kv-overlap", replicas=3))
    assert list(res.routes) == [0, 0, 1]


@pytest.mark.parametrize("name", ["lmcache-like", "kvpolicy"])
def test_kv_overlap_counts_a_request_from_its_routing_until_its_prefill_is_done_a_loading_one_too(name):
    """kv-overlap keeps its own count of the prefill each replica was sent (Dynamo's router adds a request's predicted
    new tokens when it routes it and removes them at its first token): a request still loading its prefix is on its
    replica's count, whichever load path the set has. r0 (16 seeded blocks, 4 MiB, found in the pool only) goes to
    replica 0 on a tie and loads them over a 100 MB/s link (about 42 ms; recompute would take 100 ms, so kvpolicy's
    controller loads too); r1, a new 2-block prompt 20 ms later, then finds replica 0 carrying r0's 16 blocks + 1 token
    and goes to replica 1. Counted from the end of the load instead (the queue the replica holds), replica 0 would
    look idle and r1 would follow r0 there."""
    chain = list(range(1, 17))
    tr = tiny([chain, [51, 52]], [0.0, 0.02])
    c = cluster(tr, router="kv-overlap", node_bandwidth_bytes_per_s=1e8, replica_bandwidth_bytes_per_s=1e8)
    ps = policy_set(name)
    if name == "kvpolicy":
        ps = attrs.evolve(ps, warmup=False, pull_from_peers=False)
    sim = Simulator(Prepared(tr), c, ps)
    sim.seed_pool([chain])
    res = sim.run()
    load_end_s = c.lookup_s + c.transfer_overhead_s + 16 * BLOCK_BYTES / 1e8
    assert res.loads == 1 and load_end_s > 0.02 and res.ttft_s[0] > load_end_s  # r0 loaded, still loading when r1 came
    assert list(res.routes) == [0, 1]
    assert [r.routed_tokens for r in sim.fleet.replicas] == [0, 0]  # every request's count returned at its prefill


def test_prefix_affinity_hashes_exactly_the_first_affinity_blocks():
    """Requests that share their first affinity_blocks blocks go to one replica; requests that differ only in the
    last of those blocks are spread (one hash of that block's chain id each)."""
    k = 3
    together = [[1, 2, 3, 100 + j] for j in range(20)]
    apart = [[1, 2, 200 + j, 300 + j] for j in range(20)]
    tr = tiny(together + apart, list(range(40)))
    _, res = simulate(tr, cluster(tr, router="prefix-affinity", affinity_blocks=k, replicas=4))
    assert len(set(res.routes[:20].tolist())) == 1
    assert len(set(res.routes[20:].tolist())) > 1


# ------------------------------------------------------------------------------------------- the flow network


def test_max_min_rates_pop_links_in_share_order_after_a_freeze():
    """Progressive filling: after link B (1 B/s, two flows) freezes its flows at 0.5, link A's share rises from 10/3 to
    4.75 — but link D (8 B/s, two flows: 4 each) must be filled first, or A would hand its flow f4 4.75 and D's own
    flow only 3.25. Max-min: f1 5.5, f2 0.5, f3 0.5, f4 4, f5 4."""
    net = FlowNetwork()
    A, Bl, D = net.add_link("A", 10.0), net.add_link("B", 1.0), net.add_link("D", 8.0)
    flows = [net.start(0.0, links, 1e6) for links in ((A,), (A, Bl), (Bl,), (A, D), (D,))]
    net.advance(0.0)
    assert [f.rate_bytes_per_s for f in flows] == pytest.approx([5.5, 0.5, 0.5, 4.0, 4.0])


def test_cancelling_a_flow_takes_it_off_its_links_and_out_of_the_count():
    net = FlowNetwork()
    a = net.add_link("a", 100.0)
    f1, f2 = net.start(0.0, (a,), 1000.0), net.start(0.0, (a,), 1000.0)
    late = net.start(0.0, (a,), 1000.0, latency_s=5.0)
    net.advance(0.0)
    assert net.flow_count(a) == 2 and net.active_flows() == 3
    net.cancel(1.0, f1)
    assert net.flow_count(a) == 1 and net.link_state()["a"][2] == 1
    net.cancel(1.0, late)  # still in its latency: cancelled before it moved a byte
    assert net.active_flows() == 1
    assert f2.rate_bytes_per_s == pytest.approx(100.0)


def test_a_capacity_change_moves_the_next_event_and_says_so():
    """version changes whenever the next event time may have: a caller's wake-ups from before are stale."""
    net = FlowNetwork()
    a = net.add_link("a", 100.0)
    net.start(0.0, (a,), 1000.0)
    net.advance(0.0)
    assert net.next_event_s() == pytest.approx(10.0)
    v = net.version
    net.set_capacity(2.0, a, 50.0)
    assert net.version != v and net.next_event_s() == pytest.approx(2.0 + 800.0 / 50.0)
    net.set_capacity(3.0, a, 0.0)  # a link down: nothing moves until it is back
    assert net.next_event_s() == float("inf")
    net.set_capacity(4.0, a, 0.5)  # and a slow link is a link
    assert net.next_event_s() == pytest.approx(4.0 + 750.0 / 0.5)


def test_the_drained_replica_bookkeeping_is_not_the_same_thing_twice():
    """A guard on the helpers above: a cold prompt, a load and a local hit are three different numbers here."""
    tr = tiny(*SAME)
    c = cluster(tr)
    T = 4 * B + 1
    assert len({round(cold_ttft(c, T), 12), round(load_ttft(c, 4, T), 12), round(local_ttft(c, 4, T), 12)}) == 3
    assert attrs.evolve(c, install_s_per_block=0.0).install_s_per_block == 0.0


# ------------------------------------------------------------------------------------------- failures, timeouts, writes


def _failing(seed):
    """A load of 8 blocks from a node that fails every transfer: the node's draw for request 1 says how many of the
    blocks arrived intact before the failure (the simulator's own draw, an input here like a seed)."""
    from kvpolicy.sim.world import _unit

    tr = tiny([[1, 2, 3, 4, 5, 6, 7, 8]] * 2, [0.0, 100.0])
    ev = (Degrade(node=0, t1_s=50.0, t2_s=150.0, bandwidth_factor=1.0, failure_rate=1.0),)
    return tr, ev, int(_unit(seed, 1, 0, 0, 3) * 8)


@pytest.mark.parametrize("seed", [3, 5])
def test_a_failed_load_delivers_the_blocks_before_the_failure_and_kvpolicy_uses_them(seed):
    """The transfer from a failing node carries its leading blocks intact (one flow per node, the drawn share of its
    blocks). A baseline uses a load whole or not at all; kvpolicy's controller keeps the blocks that arrived and
    recomputes the rest, counted as transfer errors (not timeouts)."""
    tr, ev, n = _failing(seed)
    assert 0 < n < 8
    c = cluster(tr)
    base = Simulator(Prepared(tr), c, policy_set("lmcache-like"), events=ev, seed=seed).run()
    assert base.bytes_sent == n * BLOCK_BYTES and base.loads_failed == 1
    assert base.ledger.tokens["remote_hit"] == 0 and base.ledger.tokens["miss_transfer_error"] == 8 * B
    ps = attrs.evolve(policy_set("kvpolicy"), publish="all", compute_while_loading=False)
    kv = Simulator(Prepared(tr), c, ps, events=ev, seed=seed).run()
    assert kv.bytes_sent == n * BLOCK_BYTES and kv.loads_failed == 1
    tok = kv.ledger.tokens
    assert (tok["remote_hit"], tok["miss_transfer_error"], tok["miss_timeout"]) == (n * B, (8 - n) * B, 0)
    assert kv.bytes_read == n * BLOCK_BYTES


def test_a_write_still_moving_at_the_transport_timeout_never_lands():
    """r0's write crawls (its node at 5e-6 × the bandwidth until t = 150 s: 1 MiB would take 42 s); at the transport
    timeout (30 s) it is cancelled and never lands, so r1 on the other replica at t = 200 s finds nothing to load.
    A write that would have finished in time lands, and r1 loads it."""
    tr = tiny([[1, 2, 3, 4], [1, 2, 3, 4]], [0.0, 200.0])
    c = cluster(tr)
    slow = (Degrade(node=0, t1_s=0.0, t2_s=150.0, bandwidth_factor=5e-6, failure_rate=0.0),)
    res = Simulator(Prepared(tr), c, policy_set("lmcache-like"), events=slow).run()
    assert res.loads == 0 and res.ledger.tokens["remote_hit"] == 0
    assert res.bytes_written == 4 * BLOCK_BYTES  # r1's own write, at full speed again: r0's never landed
    ok = (Degrade(node=0, t1_s=0.0, t2_s=150.0, bandwidth_factor=5e-5, failure_rate=0.0),)  # 4.2 s: in time
    res = Simulator(Prepared(tr), c, policy_set("lmcache-like"), events=ok).run()
    assert res.bytes_written == 4 * BLOCK_BYTES and res.loads == 1 and res.ledger.tokens["remote_hit"] == 4 * B


def test_a_load_sees_only_the_foreground_flows_on_its_path():
    """What the transport reports to admission: the remaining bytes of the foreground flows on the busier end of the
    path (the source's egress or the replica's ingress). Background flows — warmup, background writes — never delay
    a load, so they are not reported."""
    tr = tiny(*SAME)
    sim = Simulator(Prepared(tr), cluster(tr), policy_set("kvpolicy"))
    rep, node = sim.fleet.replicas[0], sim.pool.nodes[0]
    for _ in range(3):  # background, on the source's egress: more than the ingress carries, were they counted
        sim.transfers.net.start(0.0, (node.out,), 7e6, priority=1)
    sim.transfers.net.start(0.0, (rep.inn,), 3e6, priority=0)  # foreground, on the replica's ingress
    sim.transfers.net.start(0.0, (rep.inn,), 1e6, priority=0)
    sim.transfers.net.advance(0.0)
    assert sorted(sim.transfers.path_flows(rep, node, 2e6)) == [1e6, 3e6]
    # as they stand when asked: 0.1 ms later (before either ends) the two share the ingress, each at half of it
    sim.loop.clock.t = 1e-4
    half = 0.5 * rep.inn.capacity_bytes_per_s * 1e-4
    assert sorted(sim.transfers.path_flows(rep, node, 2e6)) == pytest.approx([1e6 - half, 3e6 - half])


# ------------------------------------------------------------------------------------------- scale-out and warmup


def _scaled(monkeypatch):
    """Hot prefixes served early, then 2 new replicas at t = 40 s that kvpolicy warms from the pool."""
    from kvpolicy.sim import ScaleOut
    from kvpolicy.sim import replicas

    a, b, c_ = [1, 2, 3, 4], [5, 6, 7], [8, 9]  # three prompts over two replicas: from the fourth request on, loads
    prompts = [a, b, c_, a, b, c_, a, b, a]
    tr = tiny(prompts, [0.0, 5.0, 10.0, 15.0, 20.0, 25.0, 30.0, 35.0, 80.0])
    c = cluster(tr, node_bandwidth_bytes_per_s=4e9, replica_bandwidth_bytes_per_s=3e9, storage_nodes=1)
    configs, steps = [], []
    plan = replicas.plan_warmup
    monkeypatch.setattr(replicas, "plan_warmup", lambda hot, cfg: configs.append(cfg) or plan(hot, cfg))
    done = Replicas._warm_step_done
    monkeypatch.setattr(Replicas, "_warm_step_done", lambda self, rep, t: steps.append((rep.idx, t)) or done(self, rep, t))
    sim = Simulator(Prepared(tr), c, attrs.evolve(policy_set("kvpolicy"), publish="all"), events=(ScaleOut(t_s=40.0, replicas=2),))
    return tr, c, sim, configs, steps


def test_a_warmup_plan_gets_the_bandwidth_the_new_replicas_can_take_less_half_of_todays_reads(monkeypatch):
    """The warmup budget: min(storage egress × nodes, replica ingress × new replicas); today's serving load, the bytes
    read so far per second (from t = 1 s), counted at most half of it."""
    tr, c, sim, configs, _ = _scaled(monkeypatch)
    read_before = {}
    scale = Replicas.scale_out

    def spy(self, ev, t):
        read_before["b"] = (self.tally.bytes_read, t)
        scale(self, ev, t)

    monkeypatch.setattr(Replicas, "scale_out", spy)
    sim.run()
    (cfg,) = configs
    bw = min(4e9 * 1, 3e9 * 2)
    assert cfg.bandwidth_bytes_per_s == pytest.approx(bw) and cfg.replicas == 2
    got, t = read_before["b"]
    assert got > 0 and t == 40.0
    assert cfg.current_load_bytes_per_s == pytest.approx(got / t) and got / t < bw * 0.5
    # a replica set reading more than half of the budget leaves warmup the other half, not less
    from kvpolicy.sim import ScaleOut

    configs.clear()
    _, _, busy, configs2, _ = _scaled(monkeypatch)
    busy.tally.bytes_read = int(30 * bw)  # 0.75 × bw a second over 40 s
    busy.fleet.scale_out(ScaleOut(t_s=40.0, replicas=2), 40.0)
    assert configs2[-1].current_load_bytes_per_s == pytest.approx(bw * 0.5)


def test_a_warming_replica_is_ready_when_its_last_planned_load_ends_and_the_bytes_are_counted(monkeypatch):
    """Readiness is what the replica holds: once its last planned warm load has ended, warming_until_s is that
    moment (not the plan's prediction); every byte it took is counted as replication in the ledger."""
    tr, c, sim, _, steps = _scaled(monkeypatch)
    planned = {}
    scale = Replicas.scale_out

    def spy(self, ev, t):
        self.tally.bytes_read += int(30 * 4e9)  # serving looks busy: the plan expects half its link, the loads get all of it
        scale(self, ev, t)
        planned.update({r.idx: r.warming_until_s for r in self.replicas[2:]})

    monkeypatch.setattr(Replicas, "scale_out", spy)
    res = sim.run()
    new = [r for r in sim.fleet.replicas if r.idx >= 2]
    assert steps and {i for i, _ in steps} <= {2, 3}
    warmed = 0
    for r in new:
        mine = sorted(t for i, t in steps if i == r.idx)
        assert r.warm_left == 0
        if mine:  # ready at its last step (the plan's time if that came first), not at an earlier step
            assert r.warming_until_s == min(planned[r.idx], mine[-1])
            warmed += len(mine) > 1 and planned[r.idx] > mine[-1]
        # what was warmed is in the replica's own cache: the hot chains the pool held
        assert all(k in r.cache.nodes for k in (1, 2, 3, 4)) or not mine
    assert warmed >= 1, "a replica with several warm loads, ready before its plan said"
    assert res.warmup_bytes > 0
    assert res.ledger.flows["replica"].total == res.warmup_bytes


def test_sglangs_timeout_gives_up_on_a_hung_load_after_one_second_and_a_quarter_per_kilotoken():
    """SGLang's rule: a load is abandoned 1 s + 0.25 s per 1,024 tokens after the request arrived; the request then
    prefills everything. r0 and r1 see the prompt (threshold 2: published after r1), r2 on a third replica loads it
    and every transfer hangs (timeout_rate 1)."""
    tr = tiny([list(range(1, 21))] * 3, [0.0, 100.0, 200.0])
    c = cluster(tr, timeout_rate=1.0, replicas=3)
    res = Simulator(Prepared(tr), c, policy_set("sglang-like")).run()
    T = 20 * B + 1
    limit = 1.0 + 0.25 * 20 * B / 1024
    assert res.ttft_s[2] == pytest.approx(limit + c.dispatch_s + P.a_s + P.b_s_per_token * T, rel=1e-9)
    assert (res.loads, res.loads_timeout, res.ledger.tokens["miss_timeout"]) == (1, 1, 20 * B)


def test_the_makespan_runs_from_the_first_arrival_to_the_last_first_token():
    tr = tiny([[1, 2], [3, 4]], [0.0, 0.01])
    c = cluster(tr)
    res = Simulator(Prepared(tr), c, policy_set("lmcache-like")).run()
    assert res.makespan_s == pytest.approx(0.01 + cold_ttft(c, 2 * B + 1), rel=1e-12)


def test_the_next_event_is_found_past_a_stalled_group():
    """A group on a link at 0 B/s has no next event; the scan goes on to the groups after it."""
    net = FlowNetwork()
    down, up = net.add_link("down", 100.0), net.add_link("up", 100.0)
    net.start(0.0, (down,), 1000.0)
    net.start(0.0, (up,), 500.0)
    net.advance(0.0)
    net.set_capacity(0.0, down, 0.0)
    assert net.next_event_s() == pytest.approx(5.0)


def test_a_degraded_node_also_takes_writes_at_its_factor():
    """Both directions of the node's port slow down: r0's write (1 MiB, 1.05 ms at 1 GB/s) takes 105 ms at 0.01 ×, so
    r1, arriving 100 ms in on the other replica, finds nothing published yet; at full speed it loads."""
    tr = tiny([[1, 2, 3, 4], [1, 2, 3, 4]], [0.0, 0.1])
    c = cluster(tr, node_bandwidth_bytes_per_s=1e9, replica_bandwidth_bytes_per_s=1e9)
    got = {}
    for factor in (0.01, 1.0):
        ev = (Degrade(node=0, t1_s=0.0, t2_s=50.0, bandwidth_factor=factor, failure_rate=0.0),)
        res = Simulator(Prepared(tr), c, policy_set("lmcache-like"), events=ev).run()
        got[factor] = res.loads
    assert got == {0.01: 0, 1.0: 1}


@pytest.mark.parametrize("judge_from", [0, 1])
def test_a_failed_load_the_client_resubmits_is_one_retry_of_the_request_judged(judge_from):
    """vLLM's rule (failure "fail"): a load error surfaces to the client, which resubmits at once — one retry, counted
    for request 1 whether it is the first request judged or not; the resubmission lands on replica 0 (round-robin),
    which holds the prompt, and the bytes the failed transfer moved before failing were sent but never used."""
    tr, ev, n = _failing(3)
    res = Simulator(Prepared(tr), cluster(tr), policy_set("vllm-like"), events=ev, seed=3, judge_from_request=judge_from).run()
    assert res.retries == 1 and res.loads_failed == 1
    assert list(res.routes) == [0, 0] and res.bytes_sent == n * BLOCK_BYTES and res.bytes_unused == n * BLOCK_BYTES
    assert res.ledger.tokens["local_hit"] == 8 * B


# ------------------------------------------------------------------------------------------- compute while loading


def test_compute_while_loading_meets_the_load_where_front_and_arrivals_cross():
    """kvpolicy computes the found range from its front while it loads from the back; they meet at the j minimising
    max(slot + front(j), arrival of the last K − j) — the reference here scans every j. Replica 1 holds the first
    L = 3 blocks (r1 loaded them), so r3 finds L = 3 local and K = 10 remote: a block arrives every 10 ms after the
    0.2 ms overhead, the front computes one in 6.4 ms plus reading the cached prefix (2e-5 s a cached token), after
    12 ms of dispatch and fixed term; the tail is the prompt's last token.

    Until 2026-12-03 the simulator read a flow's progress as of the network's last event, not as of now: with no
    other flow moving, every re-plan pushed the meeting later, and r3 recomputed all 10 blocks (TTFT 97.1 ms)."""
    PD = attrs.evolve(P, d_s_per_cached_token=2e-5)
    L, K = 3, 10
    X = list(range(1, L + K + 1))
    tr = tiny([X, X[:L], [99], X], [0.0, 100.0, 200.0, 300.0])
    R = BLOCK_BYTES / 0.01
    c = default_cluster(tr, bytes_per_token=BPT, prefill=PD, replicas=2, storage_nodes=1, router="round-robin", pool_share=1.0,
                        node_bandwidth_bytes_per_s=R, replica_bandwidth_bytes_per_s=R)
    res = Simulator(Prepared(tr), c, attrs.evolve(policy_set("kvpolicy"), publish="all")).run()
    T = (L + K) * B + 1

    def pf(s, e):
        return PD.a_s + PD.b_s_per_token * (e - s) + PD.d_s_per_cached_token * s

    def front(j):
        return 0.0 if j == 0 else c.dispatch_s + pf(L * B, (L + j) * B)

    t0 = 300.0 + c.lookup_s
    t1 = t0 + c.transfer_overhead_s

    def arrival(m):
        return t0 if m == 0 else t1 + m * BLOCK_BYTES / R

    meets = [max(t0 + front(j), arrival(K - j)) for j in range(K + 1)]
    j = min(range(K + 1), key=meets.__getitem__)
    assert 0 < j < K, "a meeting in the middle"
    tail = pf((L + K) * B, T) - PD.a_s
    assert res.ttft_s[3] == pytest.approx(meets[j] + tail - 300.0, rel=1e-9)
    assert res.ledger.tokens["remote_hit"] >= (K - j) * B


def test_with_no_directory_lookup_a_request_queues_at_once_and_the_next_router_sees_it():
    """lookup_s = 0: a request that loads nothing joins its replica's queue at its arrival (an event later would let
    a request arriving at the same instant see an idle replica); least-loaded then sends the second elsewhere."""
    tr = tiny([[1, 2], [3, 4]], [5.0, 5.0])
    for lookup_s, routes in ((0.0, [0, 1]), (0.0005, [0, 0])):
        res = Simulator(Prepared(tr), cluster(tr, router="least-loaded", lookup_s=lookup_s), policy_set("lmcache-like")).run()
        assert list(res.routes) == routes, lookup_s


def test_a_write_the_pool_gate_refuses_is_never_sent():
    """TinyLFU in front of a full pool (4 blocks): the hot chain H, published and read again and again, holds it; a
    chain C seen once would displace it and is refused — the pool gets H's 4 blocks only. Without the gate, C's 4
    are written over H's."""
    H, C = [1, 2, 3, 4], [5, 6, 7, 8]
    tr = tiny([H, H, H, H, H, C], [0, 10, 20, 30, 40, 50])
    c = cluster(tr, pool_share=0.5)
    assert c.pool_capacity_bytes_per_node == 4 * BLOCK_BYTES
    written = {}
    for gate in ("none", "tinylfu"):
        res = Simulator(Prepared(tr), c, attrs.evolve(policy_set("lmcache-like"), write_admission=gate)).run()
        written[gate] = res.bytes_written // BLOCK_BYTES
    assert written == {"none": 8, "tinylfu": 4}


def test_a_finished_requests_blocks_are_unpinned_and_can_make_room():
    """A replica of 4 blocks: A's blocks stay pinned only while A runs; B then evicts them to install its own, and a
    second B hits all 4 locally."""
    A, Bp = [1, 2, 3, 4], [5, 6, 7, 8]
    tr = tiny([A, Bp, Bp], [0.0, 100.0, 200.0])
    c = cluster(tr, replicas=1, local_kv_gib=4 * BLOCK_BYTES / 2**30)
    _, res = simulate(tr, c, "recompute-only")
    T = 4 * B + 1
    assert res.ttft_s[2] == pytest.approx(c.dispatch_s + P.a_s + P.b_s_per_token * (T - 4 * B), rel=1e-9)


def test_an_install_goes_on_past_blocks_another_request_installed_meanwhile():
    """R1 = [1, 2] and R2 = [1, 2, 3, 4] arrive together on one replica with two slots; R1 ends first and installs
    [1, 2]; R2 then finds those in place and installs the rest after them, so R3 hits all 4 locally."""
    tr = tiny([[1, 2], [1, 2, 3, 4], [1, 2, 3, 4]], [0.0, 0.0, 100.0])
    c = cluster(tr, replicas=1, prefill_slots=2)
    _, res = simulate(tr, c, "recompute-only")
    assert res.ledger.tokens["local_hit"] == 4 * B


def test_a_plain_load_that_ends_before_compute_queues_whole_and_pays_the_fixed_term():
    """On a fast link kvpolicy plans a plain load (no front); it ends before its p95 prediction, the blocks are
    installed, and the request queues with nothing left to compute but the prompt's last token: its prefill is
    dispatch + the whole prefill of the rest (the fixed term included), and its load time is the transfer's."""
    L, K = 3, 10
    X = list(range(1, L + K + 1))
    tr = tiny([X, X[:L], [99], X], [0.0, 100.0, 200.0, 300.0])
    R = BLOCK_BYTES / 1e-4  # a block in 0.1 ms
    c = cluster(tr, node_bandwidth_bytes_per_s=R, replica_bandwidth_bytes_per_s=R)
    res = Simulator(Prepared(tr), c, attrs.evolve(policy_set("kvpolicy"), publish="all")).run()
    T = (L + K) * B + 1
    t0 = 300.0 + c.lookup_s
    end = t0 + c.transfer_overhead_s + K * BLOCK_BYTES / R
    want = end + c.install_s_per_block * K + c.dispatch_s + P.a_s + P.b_s_per_token * (T - (L + K) * B) - 300.0
    assert res.ttft_s[3] == pytest.approx(want, abs=5e-6)  # µs of interference debt aside
    load = res.ledger.to_dict()["distributions"]["remote_hit"]["load_s"]
    assert load["max"] == pytest.approx(end - t0, rel=1e-6)


@pytest.mark.parametrize("priority", ["fair", "background"])
def test_a_write_back_shares_the_staging_copy_with_a_load_unless_it_is_background(priority):
    """Reads and writes meet only on the replica's staging copy through CPU memory (a full-duplex NIC carries them
    apart). Replica 1 is still writing r1's 36 new blocks through a slow staging copy when r3 loads r0's 4 blocks
    there: in the same class the load gets half of the copy for its whole transfer (the write has more left than the
    load moves); as background the write waits and the load runs alone, exactly as with no write at all."""
    stage = 1e7  # bytes/s: the slowest link, so the load's time is its bytes over its share of it
    tr = tiny([[1, 2, 3, 4], list(range(100, 136)), [50], [1, 2, 3, 4]], [0.0, 100.0, 100.4, 100.5])
    c = cluster(tr, stage_bytes_per_s=stage, publish_priority=priority)
    _, res = simulate(tr, c)
    assert list(res.routes) == [0, 1, 0, 1] and res.loads == 1
    T, k = 4 * B + 1, 4
    share = stage / 2 if priority == "fair" else stage
    want = (c.lookup_s + c.transfer_overhead_s + k * BLOCK_BYTES / share + c.install_s_per_block * k + c.dispatch_s
            + P.a_s + P.b_s_per_token * (T - k * B) + c.interference_s_per_byte * k * BLOCK_BYTES)
    assert res.ttft_s[3] == pytest.approx(want, rel=1e-9)
    assert res.bytes_written == (4 + 36 + 1) * BLOCK_BYTES


def test_background_publishing_without_a_staging_copy_is_refused_as_a_setting_that_changes_nothing():
    tr = tiny(*SAME)
    with pytest.raises(ConfigError, match="publish_priority.*stage_bytes_per_s"):
        cluster(tr, publish_priority="background")
    assert cluster(tr, publish_priority="background", stage_bytes_per_s=1e9).publish_priority == "background"


def _late_load(price):
    """One plain load of K blocks on a link the controller believes twice as fast as it is (``link_prior_factor``):
    it runs past its p95 prediction but ends well before recomputing the range would have."""
    L, K = 3, 10
    X = list(range(1, L + K + 1))
    tr = tiny([X, X[:L], [99], X], [0.0, 100.0, 200.0, 300.0])
    recompute_s = P.b_s_per_token * K * B  # the range's GPU seconds (dispatch and the fixed term aside)
    R = K * BLOCK_BYTES / (0.6 * recompute_s)  # the transfer takes 60 % of that
    c = cluster(tr, node_bandwidth_bytes_per_s=R, replica_bandwidth_bytes_per_s=R, link_prior_factor=2.0)
    ps = attrs.evolve(policy_set("kvpolicy"), publish="all", gpu_s_price=price)
    sim = Simulator(Prepared(tr), c, ps)
    return sim, sim.run(), (L, K, R, c)


def test_a_late_load_still_on_course_to_beat_recompute_is_waited_for_not_raced():
    """Past its p95 prediction the plain load is still arriving, and at the rate the link shows it lands before
    recompute would have produced the range: at the default price (GPU seconds first) the request waits for it, the
    GPU computes no front and no loaded byte is thrown away (``AdmissionController.keep_waiting``). At a price of 0
    (the fastest plan) the same late load turns into compute-while-loading at its p95 prediction."""
    sim, res, (L, K, R, c) = _late_load(math.inf)
    assert res.loads == 2 and res.ledger.tokens["remote_hit"] == (L + K) * B  # request 1 loads X[:L], request 3 the rest
    assert res.ledger.tokens["split_recompute"] == 0 and res.bytes_unused == 0
    t0 = 300.0 + c.lookup_s
    end = t0 + c.transfer_overhead_s + K * BLOCK_BYTES / R
    assert res.ttft_s[3] + 300.0 >= end, "it waited for the whole load"
    # ... outside its prefill slot: the GPU is busy only for the rest of the prompt (a slot taken at the p95 prediction
    # would have held the GPU while the bytes came in)
    assert res.prefill_s[3] == pytest.approx(c.dispatch_s + P.a_s + P.b_s_per_token * 1, rel=1e-9)
    _, fast, _ = _late_load(0.0)
    assert fast.ledger.tokens["split_recompute"] > 0, "at price 0 the late load is raced from the front"
    assert fast.ttft_s[3] < res.ttft_s[3]
    assert fast.gpu_prefill_s > res.gpu_prefill_s


def test_a_late_load_that_slows_after_the_check_is_raced_at_the_recompute_deadline():
    """The same late load, on course at its p95 prediction; then its node drops to 5 % of its bandwidth, so the rest
    would land long after recompute would have produced the range. The request waits until that deadline
    (wait_limit_s, checked once more there), then the GPU computes from the front while the rest keeps coming: a front
    is recomputed, and the TTFT is far below waiting for the whole load."""
    L, K = 3, 10
    X = list(range(1, L + K + 1))
    tr = tiny([X, X[:L], [99], X], [0.0, 100.0, 200.0, 300.0])
    recompute_s = P.b_s_per_token * K * B
    R = K * BLOCK_BYTES / (0.6 * recompute_s)
    c = cluster(tr, node_bandwidth_bytes_per_s=R, replica_bandwidth_bytes_per_s=R, link_prior_factor=2.0)
    ps = attrs.evolve(policy_set("kvpolicy"), publish="all")
    slow = [Degrade(0, 300.032, 301.0, bandwidth_factor=0.05, failure_rate=0.0)]  # just after the p95 check (~300.031 s)
    res = Simulator(Prepared(tr), c, ps, events=slow).run()
    assert res.ledger.tokens["split_recompute"] > 0, "raced from the front at the deadline"
    whole = c.lookup_s + 0.032 + (K * BLOCK_BYTES - R * 0.0315) / (0.05 * R)  # waiting for every byte at 5 %
    deadline = c.dispatch_s + P.a_s + P.b_s_per_token * K * B  # t_recompute_only: the range recomputed on an idle replica
    assert deadline < res.ttft_s[3] < whole - 0.05, (res.ttft_s[3], deadline, whole)


@pytest.mark.parametrize("name", ["lmcache-like", "kvpolicy"])
def test_a_block_another_request_cached_meanwhile_is_pinned_by_both(name):
    """Two requests for the same 4 blocks at the same instant on one replica with one prefill slot: the second found
    nothing cached when it arrived, and by the end of its prefill the first has cached all four. It pins each of them
    for its decode (a block in use is never evicted under it), once, and releases them when it is done."""
    tr = tiny([[1, 2, 3, 4], [1, 2, 3, 4]], [0.0, 0.0], out=64)
    c = cluster(tr, replicas=1, prefill_slots=1)
    sim = Simulator(Prepared(tr), c, policy_set(name), seed=0)
    held = []
    decode_done = sim.lifecycle.decode_done

    def at_decode_end(req, t):
        cache = sim.fleet.replicas[0].cache
        held.append((req.i, list(req.pinned), {k: cache.nodes[k].pins for k in (1, 2, 3, 4)}))
        decode_done(req, t)

    sim.lifecycle.decode_done = at_decode_end
    handlers = sim.handlers
    sim.handlers = lambda: tuple(at_decode_end if h == decode_done else h for h in handlers())
    sim.run()
    first, second = sorted(held)
    assert first[1] == second[1] == [1, 2, 3, 4], "each request holds its four blocks, in chain order"
    assert max(first[2].values()) <= 2 and min(second[2].values()) >= 1
    cache = sim.fleet.replicas[0].cache
    assert cache.protected_bytes == 0 and all(n.pins == 0 for n in cache.nodes.values())


PULL = attrs.evolve(policy_set("lmcache-like"), name="pull/never", publish="never", pull_from_peers=True)


def test_a_block_only_a_peer_holds_is_pulled_through_the_node_and_kept_there():
    """Nothing is published (``never``); r0 computes the 4 blocks on replica 0. r1 lands on replica 1: the pool holds
    nothing, replica 0's cache holds all 4, so it pulls them — one directory round trip more than a pool load (the peer
    is asked to send), one block's time more (the node stores a block before it forwards it), then one relay flow over
    the peer's egress, the node's ingress and egress and its own ingress, at the slowest of them. The node keeps them:
    4 blocks written (on demand), 4 read. r2 and r3 hit their own cache. Without the pull r1 recomputes and nothing
    crosses the network."""
    tr = tiny(*SAME)
    c = cluster(tr)
    sim, res = simulate(tr, c, PULL)
    T = 4 * B + 1
    link = min(c.node_bandwidth_bytes_per_s, c.replica_bandwidth_bytes_per_s)
    relay = c.lookup_s + BLOCK_BYTES / link  # asking the peer, and the node's first block
    want = [cold_ttft(c, T), load_ttft(c, 4, T) + relay, local_ttft(c, 4, T), local_ttft(c, 4, T)]
    assert res.ttft_s == pytest.approx(want, rel=1e-9, abs=1e-12)
    assert res.loads == 1 and res.bytes_read == res.bytes_written == res.bytes_pulled == 4 * BLOCK_BYTES
    assert res.bytes_sent == 4 * BLOCK_BYTES and res.node_bytes_out == (4 * BLOCK_BYTES,)
    assert sorted(sim.pool.where) == [1, 2, 3, 4] and not sim.pool.writing
    assert res.ledger.tokens["remote_hit"] == 4 * B and res.ledger.tokens["local_hit"] == 2 * 4 * B
    _, plain = simulate(tr, c, attrs.evolve(PULL, name="never", pull_from_peers=False))
    assert plain.ttft_s[1] == pytest.approx(cold_ttft(c, T)) and plain.bytes_sent == plain.bytes_written == 0


def test_a_pull_follows_the_pools_run_in_parallel_with_it():
    """Three replicas, round-robin, nothing published but what pulls leave in the pool. r1 (replica 1) pulls [1, 2]
    from replica 0, so the pool holds [1, 2]; r3 (replica 0) computes [3, 4] behind its own [1, 2]. r5 (replica 2,
    which holds none of them) finds [1, 2] in the pool and [3, 4] only in replica 0's cache: it loads the first two
    from the node and pulls the other two through it, two flows at once — the pool's ends first (the pull starts one
    directory round trip and one block later, as the node stores a block before forwarding it), so the load lasts as long
    as the pull of 2 blocks; it installs 4 and pays the interference of 4."""
    tr = tiny([[1, 2], [1, 2], [9], [1, 2, 3, 4], [8], [1, 2, 3, 4]], [0.0, 100.0, 200.0, 300.0, 400.0, 500.0])
    c = cluster(tr, replicas=3)
    sim, res = simulate(tr, c, PULL)
    assert list(res.routes) == [0, 1, 2, 0, 1, 2]
    T = 4 * B + 1
    link = min(c.node_bandwidth_bytes_per_s, c.replica_bandwidth_bytes_per_s)
    assert c.transfer_overhead_s + 2 * BLOCK_BYTES / link < c.lookup_s, "the pool's flow is done before the pull moves"
    want = (2 * c.lookup_s + c.transfer_overhead_s + 3 * BLOCK_BYTES / link + 4 * c.install_s_per_block
            + c.dispatch_s + P.a_s + P.b_s_per_token * (T - 4 * B) + c.interference_s_per_byte * 4 * BLOCK_BYTES)
    assert res.ttft_s[5] == pytest.approx(want, rel=1e-9)
    assert res.ttft_s[3] == pytest.approx(local_ttft(c, 2, T), rel=1e-9), "replica 0 computes [3, 4] behind its own [1, 2]"
    assert res.bytes_written == res.bytes_pulled == 4 * BLOCK_BYTES and res.bytes_read == 6 * BLOCK_BYTES
    assert sorted(sim.pool.where) == [1, 2, 3, 4] and not sim.pool.writing


def test_a_peer_copy_with_a_write_in_flight_is_not_pulled():
    """r0 computes [1, 2, 3, 4] on replica 0 and publishes them (``all``); their write moves for a fraction of a
    millisecond. r1 arrives on replica 1 while it moves: the pool holds nothing yet, and pulling the peer's copy would
    write the same blocks a second time — so r1 computes. r2 (replica 2), once the write has landed, loads the 4."""
    T = 4 * B + 1
    c = cluster(tiny([[1, 2, 3, 4]], [0.0]), replicas=3)
    t1 = cold_ttft(c, T) + 1e-5  # r0's first token (its write starts then) and 10 µs
    tr = tiny([[1, 2, 3, 4]] * 3, [0.0, t1, 100.0])
    c = cluster(tr, replicas=3)
    link = min(c.node_bandwidth_bytes_per_s, c.replica_bandwidth_bytes_per_s)
    assert 1e-5 < c.transfer_overhead_s + 4 * BLOCK_BYTES / link, "r1 arrives before the write lands"
    sim, res = simulate(tr, c, attrs.evolve(PULL, name="pull/all", publish="all"))
    assert list(res.routes) == [0, 1, 2]
    assert res.ttft_s[1] == pytest.approx(cold_ttft(c, T), rel=1e-9), "computed: its blocks were being written"
    assert res.ttft_s[2] == pytest.approx(load_ttft(c, 4, T), rel=1e-9)
    assert res.bytes_written == 4 * BLOCK_BYTES and res.loads == 1 and res.bytes_pulled == 0, "published, not pulled"


def test_a_pulled_copy_is_held_until_it_has_passed_and_released_after():
    """While a pull moves, the peer's blocks are pinned in its cache (its engine may not evict them under the
    transfer) and marked as being written (no second writer); when the pull lands both are released."""
    tr = tiny(*SAME)
    c = cluster(tr)
    sim = Simulator(Prepared(tr), c, PULL)
    seen = []
    begin = sim.transfers.begin_read

    def spy(rep, groups, t0, req_i, attempt, **kw):
        load = begin(rep, groups, t0, req_i, attempt, **kw)
        peer = sim.fleet.replicas[0].cache
        seen.append(([peer.nodes[k].pins for k in (1, 2, 3, 4)], sorted(sim.pool.writing)))
        return load

    sim.transfers.begin_read = spy
    sim.run()
    assert seen == [([1, 1, 1, 1], [1, 2, 3, 4])], "held and marked while it moves"
    assert all(n.pins == 0 for n in sim.fleet.replicas[0].cache.nodes.values()) and not sim.pool.writing


class _FakeCache:
    def __init__(self, keys):
        self.nodes = dict.fromkeys(keys)


class _FakeReplica:
    def __init__(self, idx, keys, flows=0):
        self.idx, self.cache, self.out, self.flows = idx, _FakeCache(keys), f"out-{idx}", flows


def _peers(reps, exclude, writing=()):
    from kvpolicy.sim.world import _PeerIndex
    return _PeerIndex(reps, exclude, set(writing), lambda link: next(r.flows for r in reps if r.out == link))


def test_the_peer_tier_is_the_longest_run_one_other_replica_holds():
    """The run one peer holds from the first key: the longest wins; a key being written ends it (a second writer would
    write it twice); the asking replica never counts; a tie goes to the peer with the fewest flows leaving it, then the
    lowest index. ``held_run`` is the same run with writes in flight counted (what pulls could serve)."""
    me = _FakeReplica(0, [1, 2, 3, 4, 5])
    a = _FakeReplica(1, [1, 2])
    b = _FakeReplica(2, [1, 2, 3, 4], flows=3)
    c = _FakeReplica(3, [1, 2, 3, 4], flows=1)
    d = _FakeReplica(4, [2, 3, 4, 5])  # holds the tail, not the head: no run
    peers = _peers([me, a, b, c, d], me)
    assert (peers.match_prefix([1, 2, 3, 4, 5]), peers.holder) == (4, c), "longest run; tie to the fewest flows"
    c.flows = 3
    assert (peers.match_prefix([1, 2, 3, 4, 5]), peers.holder) == (4, b), "then the lowest index"
    assert (peers.match_prefix([9]), peers.holder) == (0, None)
    assert (peers.match_prefix([]), peers.holder) == (0, None)
    busy = _peers([me, a, b, c, d], me, writing=[3])
    assert (busy.match_prefix([1, 2, 3, 4, 5]), busy.holder.idx) == (2, 1), "a key being written ends the run"
    assert busy.held_run([1, 2, 3, 4, 5]) == 4, "what pulls could serve counts it"
    assert busy.held_run([2, 3]) == 2 and busy.held_run([7]) == 0 and busy.held_run([]) == 0
    alone = _peers([me], me)
    assert alone.match_prefix([1, 2]) == 0 and alone.held_run([1, 2]) == 0, "the asking replica's own blocks are its local run"
    tail_only = _peers([me, d], me)
    assert tail_only.match_prefix([1, 2, 3]) == 0 and tail_only.held_run([1, 2, 3]) == 0, "a run starts at the first key"


def test_a_pool_that_holds_one_block_a_node_still_takes_pulls_and_one_that_holds_none_does_not():
    tr = tiny([[1], [1]], [0.0, 100.0])
    one = cluster(tr)
    one = attrs.evolve(one, pool_capacity_bytes_per_node=BLOCK_BYTES)
    sim, res = simulate(tr, one, PULL)
    assert res.bytes_written == BLOCK_BYTES and list(sim.pool.where) == [1]
    _, none = simulate(tr, attrs.evolve(one, pool_capacity_bytes_per_node=BLOCK_BYTES - 1), PULL)
    assert none.bytes_written == none.bytes_sent == 0


def test_a_pull_that_hangs_is_given_up_and_its_blocks_are_free_to_be_written_again():
    """Every transfer hangs (``timeout_rate`` 1): r1's pull delivers nothing; lmcache-like has no timeout of its own, so
    the transport gives up at ``transport_timeout_s`` and r1 recomputes from there. Nothing landed, nothing is left
    marked as being written, the peer's copy is released."""
    tr = tiny(*SAME)
    c = cluster(tr, timeout_rate=1.0, transport_timeout_s=2.0)
    sim, res = simulate(tr, c, PULL)
    T = 4 * B + 1
    assert res.ttft_s[1] == pytest.approx(c.lookup_s + c.transport_timeout_s + c.dispatch_s + P.a_s + P.b_s_per_token * T, rel=1e-9)
    assert res.loads_timeout == 1 and res.bytes_written == 0 and not sim.pool.where and not sim.pool.writing
    assert all(n.pins == 0 for n in sim.fleet.replicas[0].cache.nodes.values())


@pytest.mark.parametrize("seed", range(12))
def test_a_pull_that_fails_part_way_leaves_the_leading_blocks_in_the_pool(seed):
    """Every transfer fails after a drawn share of its blocks (``failure_rate`` 1): a plain load moves front to back, so
    what passed the node — and what it keeps — is the chain's leading blocks, the ones the request can use."""
    tr = tiny([[1, 2, 3, 4, 5, 6, 7, 8]] * 2, [0.0, 100.0])
    c = cluster(tr, failure_rate=1.0, placement_chunk_blocks=16)
    sim, res = simulate(tr, c, PULL, seed=seed)
    n = len(sim.pool.where)
    assert sorted(sim.pool.where) == list(range(1, n + 1)), "a prefix of the chain"
    assert res.bytes_written == n * BLOCK_BYTES and not sim.pool.writing


def test_some_failed_pull_delivers_part_of_its_blocks():
    """The test above must see a pull that delivered some blocks but not all, or it shows nothing."""
    tr = tiny([[1, 2, 3, 4, 5, 6, 7, 8]] * 2, [0.0, 100.0])
    c = cluster(tr, failure_rate=1.0, placement_chunk_blocks=16)
    assert any(0 < len(simulate(tr, c, PULL, seed=s)[0].pool.where) < 8 for s in range(12))


def test_the_publish_filter_hears_what_a_peer_held_only_when_pulls_are_on():
    """r1 on replica 1 finds its 4 blocks in replica 0's cache: with pulls the filter is told peer_blocks = 4 (what a pull
    serves whatever is published); a set without pulls always tells it 0."""
    tr = tiny(*SAME)
    c = cluster(tr)
    for ps, want in ((attrs.evolve(PULL, publish="dueling"), 4), (attrs.evolve(PULL, publish="dueling", pull_from_peers=False), 0)):
        sim = Simulator(Prepared(tr), c, ps)
        seen = {}
        observe = sim.pool.filter.observe

        def spy(request, keys, observe=observe):
            seen[request.request_id[0]] = request.peer_blocks
            observe(request, keys)

        sim.pool.filter.observe = spy
        sim.run()
        assert seen == {0: 0, 1: want, 2: 0, 3: 0}, ps.pull_from_peers


# --- direct pulls, "choose", and a set's own router (issue #58: llm-d's P2P tier and its router)

DIRECT = attrs.evolve(PULL, name="pull/direct", pull_path="direct")


def test_a_direct_pull_goes_straight_from_the_peer_and_writes_nothing():
    """The same four requests as the relay above, but the pull goes straight from replica 0 to replica 1: one directory
    round trip more than a pool load (the peer is asked to send) and no store and forward — then the bytes at the
    slower of the peer's egress and this replica's ingress. Nothing passes a node, so nothing is written or read from
    the pool; r3 (replica 1) hits the 4 blocks the pull installed, as it did after the relay."""
    tr = tiny(*SAME)
    c = cluster(tr, node_bandwidth_bytes_per_s=1e12)  # a node far faster than a replica: it cannot be what a pull waits on
    sim, res = simulate(tr, c, DIRECT)
    T = 4 * B + 1
    want_r1 = (2 * c.lookup_s + c.transfer_overhead_s + 4 * BLOCK_BYTES / c.replica_bandwidth_bytes_per_s + c.install_s_per_block * 4
               + c.dispatch_s + P.a_s + P.b_s_per_token * (T - 4 * B) + c.interference_s_per_byte * 4 * BLOCK_BYTES)
    assert res.ttft_s[1] == pytest.approx(want_r1, rel=1e-9)
    assert res.ttft_s[3] == pytest.approx(local_ttft(c, 4, T), rel=1e-9)
    assert res.loads == 1 and res.bytes_sent == res.bytes_direct == 4 * BLOCK_BYTES, "4 blocks crossed the network, once"
    assert res.bytes_written == res.bytes_pulled == 0 and res.node_bytes_out == (0,), "no node was crossed or written"
    assert not sim.pool.where and not sim.pool.writing
    assert res.ledger.tokens["remote_hit"] == 4 * B
    _, relay = simulate(tr, c, PULL)
    assert relay.bytes_pulled == 4 * BLOCK_BYTES and relay.ttft_s[1] > res.ttft_s[1], "the relay stores and forwards"


def _choose_at(queue_wait_s: float = 0.0, *, write_blocks: float = 0.0, write_priority: int = 0, at_s: float = 0.0,
               peer_egress_bytes_per_s: float | None = None, **cluster_kw) -> bool:
    """A two-replica cluster with a pull to plan: replica 1 pulls 4 blocks from replica 0 at ``at_s``. A write of
    ``write_blocks`` on the node the relay passes through starts at 0 (priority ``write_priority``: 1 is background);
    replica 1's prefill slots are taken, with ``queue_wait_s`` of predicted work queued per slot, when it is > 0."""
    tr = tiny(*SAME)
    c = cluster(tr, **cluster_kw)
    sim = Simulator(Prepared(tr), c, attrs.evolve(PULL, name="pull/choose", pull_path="choose"))
    node, (peer, rep) = sim.pool.nodes[0], sim.fleet.replicas
    if peer_egress_bytes_per_s is not None:  # a slow port on the peer alone
        peer.out.capacity_bytes_per_s = peer_egress_bytes_per_s
    net = sim.transfers.net
    if write_blocks:
        net.start(0.0, (node.inn,), write_blocks * BLOCK_BYTES, payload=None, on_done=lambda f, t: None, priority=write_priority)
        net.advance(0.0)  # it moves from 0
    if queue_wait_s > 0:
        rep.free_slots = 0
        rep.queued_s = queue_wait_s * rep.slots
        assert rep.queue_wait_s(at_s) == queue_wait_s
    sim.loop.clock.t = at_s
    return sim.transfers.pull_direct(rep, node, peer, 4 * BLOCK_BYTES)


def _relay_s(node_bytes_per_s: float = 5e9, replica_bytes_per_s: float = 5e9, peer_egress_bytes_per_s: float = 5e9) -> float:
    """The relay's finish for that pull on idle links, worked by hand: one block stored at the node before it is
    forwarded (at the slower of the peer's egress and the node's ingress), then 4 blocks at the slowest link of its
    path."""
    slowest = min(node_bytes_per_s, replica_bytes_per_s, peer_egress_bytes_per_s)
    return BLOCK_BYTES / min(peer_egress_bytes_per_s, node_bytes_per_s) + 4 * BLOCK_BYTES / slowest


def test_choose_relays_a_pull_only_while_the_store_and_forward_costs_the_request_nothing():
    """``pull_path="choose"``: the relay stores a block before it forwards it, so on idle links it lands later than the
    direct path — straight, unless the replica's queue would hold the request past the relay's finish anyway (then
    the node's copy for later readers is free): relay, a tie included. With a long write queued on the node's ingress
    the relay waits behind it — straight, whatever the queue."""
    relay_s = _relay_s()
    assert _choose_at() is True
    assert _choose_at(relay_s * 0.95) is True, "the store and forward is part of the relay's finish"
    assert _choose_at(relay_s * 1.05) is False
    assert _choose_at(relay_s) is False, "a relay that lands as the queue frees the slot costs nothing"
    assert _choose_at(write_blocks=1e6) is True
    assert _choose_at(relay_s * 1.05, write_blocks=1e6) is True


@pytest.mark.parametrize("slow", ["node", "peer egress"])
def test_the_relays_store_and_forward_is_one_block_at_the_slower_of_the_peers_egress_and_the_nodes_ingress(slow):
    """Half the bandwidth on the node (every node link) or on the peer's egress alone: the block stored before it is
    forwarded crosses the slower of the two, and so does the pull. A queue 3 % either side of that finish decides."""
    kw = {"node_bandwidth_bytes_per_s": 2.5e9} if slow == "node" else {"peer_egress_bytes_per_s": 2.5e9}
    relay_s = _relay_s(node_bytes_per_s=2.5e9) if slow == "node" else _relay_s(peer_egress_bytes_per_s=2.5e9)
    assert _choose_at(relay_s * 0.97, **kw) is True
    assert _choose_at(relay_s * 1.03, **kw) is False


def test_choose_reads_the_links_as_they_are_now_not_at_the_networks_last_event():
    """``choose`` reads the bytes ahead on each link as of the pull's planning, not as of the network's last event: a
    100-block write on the node's ingress that started at 0 has a tenth of a block left at 99.9 blocks' time, and the
    relay (hidden by a queue 5 % longer than its idle finish) is chosen. Read as of 0, the write would still hold its
    100 blocks ahead of the pull — straight."""
    at_s = 99.9 * BLOCK_BYTES / 5e9
    assert _choose_at(_relay_s() * 1.05, write_blocks=100, at_s=at_s) is False
    assert _choose_at(_relay_s() * 1.05, write_blocks=100, at_s=0.0) is True


def test_a_long_write_ahead_of_a_pull_delays_it_by_at_most_the_pulls_own_size():
    """Links share fairly: a 100-block write on the node's ingress makes the 4-block pull wait behind 4 blocks of it,
    not 100 (what ``choose`` reads: each flow's bytes ahead capped at the pull's size). With the queue 5 % past that
    relay's finish — one block stored, 4 ahead, the 4 pulled — the relay is hidden and chosen; 5 % short, straight."""
    relay_s = (1 + 4 + 4) * BLOCK_BYTES / 5e9
    assert _choose_at(relay_s * 1.05, write_blocks=100) is False
    assert _choose_at(relay_s * 0.95, write_blocks=100) is True


def test_choose_counts_only_the_traffic_a_pull_waits_behind_not_background_writes():
    """Reads go before background writes on a link (``ClusterConfig.publish_priority``): a long background write on the
    node's ingress delays a relayed pull by nothing, so a relay the queue hides is still chosen. A foreground write of
    the same size is bytes ahead of the pull — straight."""
    assert _choose_at(_relay_s() * 1.05, write_blocks=1000, write_priority=1) is False
    assert _choose_at(_relay_s() * 1.05, write_blocks=1000, write_priority=0) is True


def test_a_set_deployed_with_its_own_router_routes_by_it_whatever_the_cluster_says():
    """llm-d routes by KV overlap: ``PolicySet.router`` overrides the cluster's for that set alone. On a cluster set to
    round-robin, llm-d-like's routes are those of the same set on a kv-overlap cluster; lmcache-p2p-like keeps
    round-robin."""
    tr = tiny([[1, 2, 3, 4], [1, 2, 3, 4, 5], [7], [1, 2, 3, 4, 6]], [0.0, 100.0, 200.0, 300.0])
    rr = cluster(tr, replicas=2)
    _, own = simulate(tr, rr, "llm-d-like")
    _, kv = simulate(tr, cluster(tr, replicas=2, router="kv-overlap"), attrs.evolve(policy_set("llm-d-like"), router=None))
    _, plain = simulate(tr, rr, "lmcache-p2p-like")
    assert list(own.routes) == list(kv.routes) and list(plain.routes) == [0, 1, 0, 1]
    assert list(own.routes) != list(plain.routes)


@pytest.mark.parametrize("fields, named", [
    (dict(pull_from_peers=True, pull_path="teleport"), "pull_path"),
    (dict(router="nearest"), "router"),
])
def test_a_pull_path_or_router_that_cannot_run_is_a_config_error_naming_its_field(fields, named):
    with pytest.raises(ConfigError) as e:
        PolicySet("bad", **fields)
    assert e.value.field == named


@pytest.mark.parametrize("rate", [0.3, 0.7])
def test_a_share_of_the_transfers_hangs_drawn_per_request_and_node(rate):
    """``timeout_rate``: each transfer hangs when its own draw — a hash of (seed, request, attempt, node) — falls under
    the rate; the others move. One pool node, lmcache-like loading everything it finds: request i > 0 loads the
    prompt r0 published, and exactly those whose draw is under the rate time out."""
    from kvpolicy.sim.world import _unit

    n = 40
    tr = tiny([[1, 2, 3, 4]] * n, [10.0 * i for i in range(n)])
    c = cluster(tr, timeout_rate=rate, transport_timeout_s=2.0, replicas=1, local_kv_gib=0.0)
    res = Simulator(Prepared(tr), c, policy_set("lmcache-like"), seed=7).run()
    hung = sum(_unit(7, i, 0, 0, 2) < rate for i in range(1, n))
    assert 0 < hung < n - 1, "the draws put some under the rate and some over"
    assert (res.loads, res.loads_timeout, res.loads_ok) == (n - 1, hung, n - 1 - hung)


def test_an_unbounded_pool_keeps_every_block_written_and_the_clusters_pool_evicts():
    """``pool_capacity``: a node of the cluster's size (2 blocks here) evicts as its policy says; "unbounded" keeps every
    block written — the oracle's pool, whose Belady per node had evicted a block a request then missed (seed 226: an
    LRU pool kept it, and llm-d-like saved 0.4 % more GPU seconds than the oracle)."""
    tr = tiny([[1, 2], [3, 4], [5, 6], [1, 2], [3, 4]], [0.0, 10.0, 20.0, 30.0, 40.0])
    c = cluster(tr, replicas=5, pool_share=2 / 6)  # the pool: one node of 2 blocks
    assert c.pool_capacity_bytes_per_node == 2 * BLOCK_BYTES
    small, _ = simulate(tr, c, PolicySet("lru-pool", publish="all", load="always"))
    big, res = simulate(tr, c, PolicySet("open-pool", publish="all", load="always", pool_capacity="unbounded"))
    assert len(small.pool.where) == 2 and sorted(big.pool.where) == [1, 2, 3, 4, 5, 6]
    assert res.loads == 2 and res.bytes_read == 4 * BLOCK_BYTES, "r3 and r4 load what r0 and r1 wrote"
    one = cluster(tr, replicas=5, pool_share=1 / 6)  # a node of exactly one block: a pool, so "unbounded" holds all
    assert one.pool_capacity_bytes_per_node == BLOCK_BYTES
    open_one, _ = simulate(tr, one, PolicySet("open-pool", publish="all", load="always", pool_capacity="unbounded"))
    assert sorted(open_one.pool.where) == [1, 2, 3, 4, 5, 6]
    with pytest.raises(ConfigError, match="pool_capacity"):
        PolicySet("x", pool_capacity="infinite")
    assert policy_set("oracle").pool_capacity == "unbounded"


def test_the_oracles_now_is_the_latest_first_arrival_and_a_retry_does_not_move_it_back():
    """Belady ranks a block by its next use after *now*: the request being served. Each first arrival sets it (they come
    in index order); a retry of an earlier request (failure rule "fail": the client resubmits) is not a step back in the
    trace. A clock stuck at the first request ranked every block by a use long past. (The oracle's own loads never fail:
    the hindsight tiers with the loads of a set that does.)"""
    tr = tiny([[1, 2, 3, 4]] * 12, [0.0] + [10.0] * 11)  # eleven at once, after the first: retries follow later arrivals
    c = cluster(tr, failure_rate=0.5, replicas=4)
    sim = Simulator(Prepared(tr), c, attrs.evolve(policy_set("oracle"), name="belady-tiers", load="always"), seed=3)
    oracle = sim.lifecycle._oracle
    seen = []
    arrive = sim.lifecycle.arrive

    def spy(req, t):
        seen.append((req.i, req.attempt, oracle.now))
        arrive(req, t)

    sim.lifecycle.arrive = spy
    res = sim.run()
    assert res.retries > 0, "some loads failed and were retried"
    firsts = [(i, now) for i, attempt, now in seen if attempt == 0]
    assert firsts == [(i, i) for i in range(12)]
    latest, retried_behind = -1, 0
    for i, attempt, now in seen:
        if attempt == 0:
            latest = i
        else:
            assert now == latest, "a retry leaves now at the latest first arrival"
            retried_behind += i < latest
    assert retried_behind, "a retry of an earlier request arrived after a later one"
    assert oracle.now == 11


def test_a_judged_split_counts_bytes_written_from_its_first_requests_arrival_time():
    """``judge_from_request`` = k: bytes written count from request k's *arrival time* on — not from second k. Two
    prompts written at t = 100 and t = 300 (vllm-like publishes all); judged from request 1 (arrival 300), only the
    second write counts; the whole run counts both."""
    tr = tiny([[1, 2], [3, 4]], [100.0, 300.0])
    c = cluster(tr)
    whole = Simulator(Prepared(tr), c, policy_set("vllm-like")).run()
    half = Simulator(Prepared(tr), c, policy_set("vllm-like"), judge_from_request=1).run()
    assert whole.bytes_written == 4 * BLOCK_BYTES
    assert half.bytes_written == 2 * BLOCK_BYTES


def test_a_scale_out_before_the_second_arrival_plans_warmup_from_the_first_request_alone(monkeypatch):
    """The warmup planner knows only what has arrived: a scale-out between request 0 and request 1 hands it a trace of
    one request, never a request still to come (nor an empty trace, before any arrival)."""
    from kvpolicy.sim import ScaleOut, replicas

    tr = tiny([[1, 2, 3], [1, 2, 3], [7, 8, 9]], [0.0, 50.0, 60.0])
    c = cluster(tr, storage_nodes=1)
    seen = []
    hot = replicas.hot_prefixes_from_trace
    monkeypatch.setattr(replicas, "hot_prefixes_from_trace", lambda t, **kw: seen.append(len(t)) or hot(t, **kw))
    for t_out, want in ((10.0, 1), (55.0, 2), (0.0, 1)):
        seen.clear()
        Simulator(Prepared(tr), c, attrs.evolve(policy_set("kvpolicy"), warmup=True), events=(ScaleOut(t_s=t_out, replicas=1),)).run()
        assert seen == [want], (t_out, seen)


def test_without_guard_rails_no_load_is_refused_for_the_loads_already_in_flight():
    """PolicySet.guard_rails: the admission controller caps the loads in flight per replica (4) and per node, and the
    bytes a load may wait behind. Ten requests for ten different seeded chains arrive at once on one replica: with the
    guard rails, the fifth and later find four loads in flight and recompute; without them, every one loads (the
    inequality prices the queue they wait behind, and here the link still wins). The field is checked by name."""
    prompts = [[100 * i + j for j in range(8)] for i in range(10)]
    tr = tiny(prompts, [0.0] * 10)
    c = cluster(tr, replicas=1)
    out = {}
    for rails in (True, False):
        ps = attrs.evolve(policy_set("kvpolicy"), name=f"rails-{rails}", guard_rails=rails, warmup=False, pull_from_peers=False,
                          compute_while_loading=False)
        sim = Simulator(Prepared(tr), c, ps)
        sim.seed_pool(prompts)
        out[rails] = sim.run()
        cfg = sim.planner.controller.config
        assert (cfg.max_loads_per_replica == 4) is rails
    assert out[False].loads == 10
    assert 4 <= out[True].loads < 10
    with pytest.raises(ConfigError) as e:
        attrs.evolve(policy_set("kvpolicy"), guard_rails="no")
    assert e.value.field == "guard_rails"


@pytest.mark.parametrize("opener", [0, 1])
def test_a_block_is_written_again_only_off_a_node_the_writers_own_breaker_has_opened(monkeypatch, opener):
    """Re-publication asks the writer's controller, not the first replica's: with one controller per replica
    (``controller_scope="replica"``) and node X's breaker open in one replica's alone, that replica writes X's blocks
    again elsewhere and the other leaves them where they are. Each replica opens it in turn, so one of the two runs has
    a writer whose index is not X's (a mutant that asked the first replica's controller, or none, lived; so did one
    that asked the controller of the replica numbered as the node is). The write budget's room is unbounded here, so
    the budget does not decide."""
    from kvpolicy.publish import DuelingPublish
    from kvpolicy.sim.world import _Req

    monkeypatch.setattr(DuelingPublish, "budget_room_blocks", property(lambda self: math.inf))
    tr = tiny(*SAME)
    # the peer's blocks reach the pool through a relayed pull (choose would pull them straight on these idle links)
    sim = Simulator(Prepared(tr), cluster(tr, storage_nodes=2), attrs.evolve(policy_set("kvpolicy"), controller_scope="replica", pull_path="relay"))
    sim.run()
    pool, reps = sim.pool, sim.fleet.replicas
    held = pool.where[1]
    on_it = [k for k in (1, 2, 3, 4) if pool.where.get(k) is held]
    assert on_it and pool.republished_blocks == 0
    b = sim.planner.ctl(reps[opener]).breaker(held.name)
    for _ in range(b.failure_threshold):
        b.record_failure()
    assert b.state == "open" and sim.planner.ctl(reps[1 - opener]).breaker(held.name).state == "closed"
    t = sim.loop.clock.now_s()
    for attempt, rep, moved in ((7, reps[1 - opener], 0), (8, reps[opener], len(on_it))):
        req = _Req(0, t)
        req.attempt, req.local, req.load = attempt, 0, 0
        pool.publish(rep, req, [1, 2, 3, 4], t)
        assert pool.republished_blocks == moved, rep.name
    assert set(on_it) <= pool.writing, "the opener's writes of the node's blocks are in flight"


def test_the_write_gate_cuts_the_chain_at_its_first_refused_block_across_nodes(monkeypatch):
    """Publishing is prefix-closed: the write-admission gate admits a leading run per node, and the chain is cut at
    the first block refused on any node — blocks before the cut are written whatever node they go to, none after it.
    A chain of 4 new blocks, positions 0-1 placed on node A (2 admitted) and 2-3 on node B (1 admitted): the cut falls
    at position 3, so A writes both and B one; with A admitting 1 the cut is at 1 and B writes none (a mutant that
    keyed the cut on anything but the chain position lived, and one that gated only when the last key was truthy)."""
    from kvpolicy.sim import pool as pool_mod
    from kvpolicy.sim.world import _Req

    tr = tiny(*SAME)
    sim = Simulator(Prepared(tr), cluster(tr, storage_nodes=2, placement_chunk_blocks=2),
                    attrs.evolve(policy_set("kvpolicy"), write_admission="tinylfu"))
    pool = sim.pool
    a, b = pool.nodes
    admitted = {id(a.policy): 2, id(b.policy): 1}
    monkeypatch.setattr(pool_mod, "gate", lambda policy, adm, todo, bb: admitted[id(policy)])

    class Everything:  # a publish filter that publishes the whole chain
        def observe(self, request, keys):
            pass

        def publishable(self, request, keys):
            return len(keys)

    pool.filter = Everything()
    rep = sim.fleet.replicas[0]
    cases = ((2, [20, 21, 22, 23], {20, 21, 22}), (1, [30, 31, 32, 33], {30}),
             (2, [40, 41, 42, 0], {40, 41, 42}))  # a chain whose last key is 0 is gated too
    for attempt, (n_a, chain, written) in enumerate(cases):
        admitted[id(a.policy)] = n_a
        monkeypatch.setattr(pool, "place", lambda chunk_key, rep=None, edge=chain[2]: a if chunk_key < edge else b)
        req = _Req(0, 0.0)
        req.attempt, req.local, req.load = 10 + attempt, 0, 0
        before = set(pool.writing)
        pool.publish(rep, req, chain, 0.0)
        assert pool.writing - before == written


def test_a_landing_write_releases_only_its_own_blocks_the_rest_of_the_chain_stays_marked():
    """A chain's blocks are written in groups, one per node; each group's landing releases its own blocks from the
    writes in flight, not the whole chain's: a group still moving elsewhere keeps its blocks marked, so no second
    writer writes them again meanwhile."""
    tr = tiny(*SAME)
    sim = Simulator(Prepared(tr), cluster(tr, storage_nodes=2), PULL)
    pool = sim.pool
    pool.writing.update((1, 2, 3, 4))
    n = pool._land((pool.nodes[0], [1, 2], [1, 2, 3, 4], "default"), 0.0)
    assert n == 2 and pool.writing == {3, 4}
    assert pool.where[1] is pool.nodes[0] and 3 not in pool.where


def test_a_queued_split_expects_to_skip_its_local_blocks_and_the_range_it_loads():
    """A request queued for its prefill slot while it loads (compute while loading) expects to skip its local blocks
    and the loaded part of its range — ``load - split`` blocks, the GPU computing the split's front: the replica's
    queued tokens and predicted seconds (what its queue's wait and the least-loaded router read) count only the rest."""
    from kvpolicy.sim.world import _Req

    tr = tiny([[1, 2, 3, 4, 5, 6, 7, 8]], [0.0])
    sim = Simulator(Prepared(tr), cluster(tr, replicas=1), policy_set("kvpolicy"))
    rep = sim.fleet.replicas[0]
    rep.free_slots = 0  # the slot is taken: the request stays queued
    req = _Req(0, 0.0)
    req.cake, req.load, req.split = True, 5, 2
    sim.fleet.enqueue(rep, req, 0.0, 1)
    T = 8 * B + 1
    skip = 1 + 5 - 2
    assert req.queued_tokens == rep.load_tokens == T - skip * B
    c = sim.fleet.c
    assert rep.queued_s == pytest.approx(c.dispatch_s + c.prefill_s(skip * B, T), rel=1e-12)



def _taught_run(node_s_per_byte, peer_s_per_byte=None):
    """Two replicas, round-robin, the kvpolicy set publishing every block. r0 (replica 0) computes [1..8] and writes
    it to the one node; r1 (replica 1) finds it in the pool and in replica 0's cache. Before the run the controller
    has measured ``node_s_per_byte`` on the node, and ``peer_s_per_byte`` on replica 0 as a source (25 loads of 8
    blocks each; None: nothing measured, its prior)."""
    tr = tiny([list(range(1, 9))] * 2, [0.0, 50.0])
    c = cluster(tr)
    sim = Simulator(Prepared(tr), c, attrs.evolve(policy_set("kvpolicy"), name="kvpolicy/all", publish="all"))
    ctl = sim.planner.controller
    for source, rate in (("node-0", node_s_per_byte), ("replica-0", peer_s_per_byte)):
        if rate is None:
            continue
        cx = AdmissionContext(block_bytes=BLOCK_BYTES, source=source, replica="replica-1")
        for _ in range(25):
            d = ctl.decide(PrefixMatch(8 * B + 1, B, 8, 0, (8,), ("pool",), "miss"), cx)
            if d.loads:
                ctl.record(LoadOutcome(d.load_id, "ok", d.load_blocks, transfer_s=d.load_bytes * rate))
    return sim, sim.run(), c


def test_a_run_the_pool_holds_on_a_path_too_slow_to_load_is_pulled_from_a_peer_that_holds_it():
    """Issue #58: where the controller would compute some of what the pool holds (its node, measured, is slower than
    recompute) and a peer holds the same run, it proposes the peer's copy too and takes the proposal that saves more GPU
    seconds. With the node measured at 1 MB/s, r1 pulls the 8 blocks straight from replica 0 (no node crossed) instead
    of recomputing them; with the node measured at its own speed, or not at all, the pool's copy wins and nothing is
    pulled. Both measured at 25 MB/s, each proposal plans the same split (5 of the 8 blocks to compute): a tie, and
    the pool's copy is kept."""
    T = 8 * B + 1
    _, slow, c = _taught_run(1e-6)
    assert list(slow.routes) == [0, 1]
    assert slow.loads == 1 and slow.bytes_direct == slow.bytes_read == 8 * BLOCK_BYTES, "r1's 8 blocks came from the peer"
    assert slow.ttft_s[1] < cold_ttft(c, T) and slow.prefill_s[1] < slow.prefill_s[0] / 4
    for taught in (None, 1 / c.node_bandwidth_bytes_per_s):
        _, fast, _ = _taught_run(taught)
        assert fast.loads == 1 and fast.bytes_read == 8 * BLOCK_BYTES and fast.bytes_direct == fast.bytes_pulled == 0, taught
        assert fast.ttft_s[1] == pytest.approx(load_ttft(c, 8, T), rel=1e-6)
    _, tie, _ = _taught_run(4e-8, 4e-8)
    assert tie.loads == 1 and tie.bytes_read == 8 * BLOCK_BYTES and tie.bytes_direct == tie.bytes_pulled == 0, "read from the node"


def test_a_block_whose_write_is_in_flight_is_not_written_again():
    """r0 computes [1, 2, 3, 4] on replica 0 and publishes them (``all``) into a node crawling at 5e-5 × its bandwidth
    (1 MiB takes 4.2 s). r1, on replica 1, computes the same blocks (the pool holds nothing yet) and finishes while r0's
    write still moves: its publish skips the four, so the node's ingress carries them once. Every figure the run reports
    would be the same with a second write (the pool counts only blocks that land new), so the test reads the link."""
    T = 4 * B + 1
    tr = tiny([[1, 2, 3, 4]] * 2, [0.0, 0.5])
    c = cluster(tr)
    slow = (Degrade(node=0, t1_s=0.0, t2_s=150.0, bandwidth_factor=5e-5, failure_rate=0.0),)
    sim = Simulator(Prepared(tr), c, policy_set("lmcache-like"), events=slow)
    res = sim.run()
    assert list(res.routes) == [0, 1] and res.loads == 0
    assert res.ttft_s[1] == pytest.approx(cold_ttft(c, T), rel=1e-9), "computed: the pool held nothing yet"
    assert res.ttft_s[1] + 0.5 < 4.0, "r1's publish comes while r0's write still moves"
    assert res.bytes_written == 4 * BLOCK_BYTES
    (node,) = sim.pool.nodes
    assert node.inn.bytes_carried == pytest.approx(4 * BLOCK_BYTES), "the blocks crossed the node's ingress once"


def test_the_choose_rule_is_asked_about_a_peer_runs_own_path_node_holder_and_bytes():
    """How a peer's run would travel (``pull_path="choose"``) is judged on that run's path: the node its first block's
    placement chunk passes through — placed as the asking replica's writes are, skipping a node whose breaker is open in
    that replica's own controller —, the peer that holds it, and the run's bytes; the answer is the one the load uses.
    Replica 0 computes [1..8], replica 1 [1..5]; then replica 1's request for [1..8] is matched against the peers alone:
    5 blocks local, 3 held by replica 0, from block 5 (placement chunks of 2: the chunk starts at block 4, placed on
    node 0; blocks 3 and 6, which a miscounted chunk start would name, are placed elsewhere)."""
    tr = tiny([list(range(1, 9)), [1, 2, 3, 4, 5]], [0.0, 10.0])
    c = cluster(tr, storage_nodes=3, placement_chunk_blocks=2)
    kv = attrs.evolve(policy_set("kvpolicy"), name="kvpolicy/never", publish="never", pull_path="choose", controller_scope="replica")
    sim = Simulator(Prepared(tr), c, kv)
    res = sim.run()
    assert list(res.routes) == [0, 1]
    rep0, rep1 = sim.fleet.replicas
    keys = sim.p.keys[0]
    node0 = sim.pool.nodes[0]
    assert sim.pool.place(keys[4]) is node0 and node0 not in (sim.pool.place(keys[3]), sim.pool.place(keys[6]))
    asked = []

    def spy(rep, node, holder, nbytes):
        asked.append((rep, node, holder, nbytes))
        return len(asked) == 1

    sim.transfers.pull_direct = spy

    def ask():
        return sim.lifecycle._peer_source(rep1, keys, 8, 8 * B + 1, sim.loop.clock.t)

    copy = ask()
    assert copy.match.local_blocks == 5 and copy.match.remote_total_blocks == 3 and copy.holder is rep0
    assert asked == [(rep1, node0, rep0, 3 * BLOCK_BYTES)]
    assert copy.direct is True, "the path the rule chose is the one the pull takes"
    ctl1 = sim.planner.ctl(rep1)
    assert ctl1 is not sim.planner.ctl(rep0)
    breaker = ctl1.breaker(node0.name)
    while breaker.state != "open":  # node 0 unhealthy as replica 1 sees it (replica 0's controller still trusts it)
        breaker.record_failure()
    elsewhere = sim.pool.place(keys[4], rep1)
    assert elsewhere is not node0 and sim.pool.place(keys[4]) is node0
    copy = ask()
    assert asked[1] == (rep1, elsewhere, rep0, 3 * BLOCK_BYTES)
    assert copy.direct is False
