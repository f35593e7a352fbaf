"""The flow-level network: max-min fair sharing, per-direction links, priorities, conservation."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpolicy.errors import ConfigError
from kvpolicy.sim.network import FlowNetwork

GB = 1e9


def drain(net):
    """Run the network to the end; returns {fid: end time}."""
    ends = {}
    while True:
        t = net.next_event_s()
        if t == math.inf:
            return ends
        for f in net.advance(t):
            ends[f.fid] = t


def test_one_flow_takes_overhead_plus_size_over_bandwidth():
    net = FlowNetwork()
    link = net.add_link("l", 5 * GB)
    f = net.start(0.0, [link], 2 * GB, latency_s=0.01)
    ends = drain(net)
    assert ends[f.fid] == pytest.approx(0.01 + 2 * GB / (5 * GB))


def test_two_equal_flows_on_one_link_finish_together_at_twice_the_time():
    net = FlowNetwork()
    link = net.add_link("l", 5 * GB)
    a = net.start(0.0, [link], 1 * GB)
    b = net.start(0.0, [link], 1 * GB)
    ends = drain(net)
    assert ends[a.fid] == pytest.approx(2 * GB / (5 * GB))
    assert ends[b.fid] == pytest.approx(ends[a.fid])


def test_a_write_in_the_opposite_direction_does_not_slow_a_read():
    net = FlowNetwork()
    node_out, node_in = net.add_link("node.out", 5 * GB), net.add_link("node.in", 5 * GB)
    rep_in, rep_out = net.add_link("rep.in", 5 * GB), net.add_link("rep.out", 5 * GB)
    read = net.start(0.0, [node_out, rep_in], 1 * GB)
    write = net.start(0.0, [rep_out, node_in], 3 * GB)
    ends = drain(net)
    assert ends[read.fid] == pytest.approx(0.2)  # alone on its direction: full rate
    assert ends[write.fid] == pytest.approx(0.6)


def test_a_short_flow_leaves_and_the_long_one_speeds_up():
    net = FlowNetwork()
    link = net.add_link("l", 4 * GB)
    short = net.start(0.0, [link], 1 * GB)
    long_ = net.start(0.0, [link], 3 * GB)
    ends = drain(net)
    assert ends[short.fid] == pytest.approx(0.5)  # 2 GB/s each until the short one ends
    assert ends[long_.fid] == pytest.approx(0.5 + 2 * GB / (4 * GB))  # then 4 GB/s for the last 2 GB


def test_a_flow_never_runs_faster_than_the_smallest_link_on_its_path():
    net = FlowNetwork()
    fast, slow = net.add_link("fast", 10 * GB), net.add_link("slow", 1 * GB)
    f = net.start(0.0, [fast, slow], 1 * GB)
    g = net.start(0.0, [fast], 9 * GB)
    net.advance(0.0)
    assert f.rate_bytes_per_s == pytest.approx(1 * GB)
    assert g.rate_bytes_per_s == pytest.approx(9 * GB)  # max-min: the other flow takes what the bottlenecked one cannot use
    ends = drain(net)
    assert ends[f.fid] == pytest.approx(1.0) and ends[g.fid] == pytest.approx(1.0)


def test_background_class_gets_only_what_the_foreground_leaves():
    net = FlowNetwork()
    link = net.add_link("l", 4 * GB)
    load = net.start(0.0, [link], 2 * GB, priority=0)
    pub = net.start(0.0, [link], 2 * GB, priority=1)
    net.advance(0.0)
    assert load.rate_bytes_per_s == pytest.approx(4 * GB) and pub.rate_bytes_per_s == 0.0
    ends = drain(net)
    assert ends[load.fid] == pytest.approx(0.5) and ends[pub.fid] == pytest.approx(1.0)


def test_cancel_returns_what_was_delivered_and_frees_the_link():
    net = FlowNetwork()
    link = net.add_link("l", 2 * GB)
    a = net.start(0.0, [link], 4 * GB)
    b = net.start(0.0, [link], 1 * GB)
    net.advance(0.0)
    assert net.cancel(0.5, a) == pytest.approx(0.5 * GB)  # 1 GB/s each for 0.5 s
    assert not a.alive and a.done_bytes() == pytest.approx(0.5 * GB)
    ends = drain(net)
    assert ends[b.fid] == pytest.approx(0.75)  # alone at 2 GB/s for its last 0.5 GB
    assert link.bytes_carried == pytest.approx(1.5 * GB)


def test_capacity_changes_apply_from_that_moment():
    net = FlowNetwork()
    link = net.add_link("l", 1 * GB)
    f = net.start(0.0, [link], 2 * GB)
    net.advance(0.0)
    net.set_capacity(1.0, link, 0.1 * GB)  # degraded: 1 GB left at 0.1 GB/s
    net.set_capacity(5.0, link, 1 * GB)  # restored with 0.6 GB left
    ends = drain(net)
    assert ends[f.fid] == pytest.approx(5.6)


def test_zero_capacity_stalls_until_restored_and_bad_input_is_refused():
    net = FlowNetwork()
    link = net.add_link("l", 0.0)
    f = net.start(0.0, [link], 1 * GB)
    net.advance(0.0)
    assert net.next_event_s() == math.inf and f.rate_bytes_per_s == 0.0
    net.set_capacity(2.0, link, 1 * GB)
    assert drain(net)[f.fid] == pytest.approx(3.0)
    for bad in (dict(size_bytes=float("nan")), dict(size_bytes=-1.0), dict(size_bytes=1.0, latency_s=-1.0), dict(size_bytes=1.0, priority=3)):
        with pytest.raises(ConfigError):
            net.start(3.0, [link], **bad)
    with pytest.raises(ConfigError, match="capacity"):
        net.add_link("x", float("inf"))
    with pytest.raises(ConfigError, match="backwards"):
        net.start(1.0, [link], 1.0)


def reference_max_min(links, flows):
    """Plain progressive filling, flow by flow (the textbook algorithm): {flow index: rate}."""
    rates = {}
    rem = dict(links)
    active = set(range(len(flows)))
    while active:
        share = {}
        for name in rem:
            n = sum(1 for i in active if name in flows[i])
            if n:
                share[name] = max(rem[name], 0.0) / n
        name = min(share, key=share.get)
        x = share[name]
        for i in [i for i in active if name in flows[i]]:
            rates[i] = x
            active.discard(i)
            for other in flows[i]:
                rem[other] -= x
    return rates


topologies = st.integers(min_value=1, max_value=5).flatmap(lambda n_links: st.tuples(
    st.lists(st.floats(min_value=0.1, max_value=10.0), min_size=n_links, max_size=n_links),
    st.lists(st.lists(st.integers(min_value=0, max_value=n_links - 1), min_size=1, max_size=3, unique=True), min_size=1, max_size=8),
))


@settings(max_examples=150, deadline=None)
@given(topologies, st.lists(st.floats(min_value=0.01, max_value=5.0), min_size=8, max_size=8))
def test_rates_are_max_min_fair_like_the_textbook_algorithm_and_bytes_are_conserved(topo, sizes):
    caps, paths = topo
    net = FlowNetwork()
    links = [net.add_link(f"l{i}", c * GB) for i, c in enumerate(caps)]
    flows = [net.start(0.0, [links[j] for j in path], sizes[i] * GB) for i, path in enumerate(paths)]
    net.advance(0.0)
    want = reference_max_min({f"l{i}": c * GB for i, c in enumerate(caps)}, [[f"l{j}" for j in p] for p in paths])
    for i, f in enumerate(flows):
        assert f.rate_bytes_per_s == pytest.approx(want[i], rel=1e-9, abs=1e-3)
    for link in links:  # no link carries more than its capacity, and each flow's rate is bounded by its path
        load = sum(f.rate_bytes_per_s for f, p in zip(flows, paths) if links.index(link) in p)
        assert load <= link.capacity_bytes_per_s * (1 + 1e-9)
    for f, p in zip(flows, paths):
        assert f.rate_bytes_per_s <= min(links[j].capacity_bytes_per_s for j in p) * (1 + 1e-9)
    drain(net)
    for i, link in enumerate(links):  # every byte of every flow crossed every link on its path, once
        assert link.bytes_carried == pytest.approx(sum(sizes[k] * GB for k, p in enumerate(paths) if i in p), rel=1e-9)
    assert all(not f.alive and f.done_bytes() == pytest.approx(f.size_bytes) for f in flows)


def test_flows_on_a_link_count_those_still_in_their_latency_by_class_or_all():
    """A flow issued but not yet moving (its latency not over) is on the link already: a transport counts its bytes as
    ahead of a new load. Asked for one class, the classes at or above it; asked for none, every flow."""
    net = FlowNetwork()
    link = net.add_link("l", 1e9)
    net.start(0.0, (link,), 5e6, latency_s=1.0, priority=1)  # background, still in its latency
    net.start(0.0, (link,), 2e6, latency_s=1.0, priority=0)
    assert sorted(net.flows_on(link)) == [2e6, 5e6]
    assert net.flows_on(link, 0) == [2e6], "a foreground load is not delayed by background flows"
    assert sorted(net.flows_on(link, 1)) == [2e6, 5e6]
