import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from strategies_prefix import flat_trace, prefix_traces
from kvpolicy.errors import ConfigError
from kvpolicy.eviction import replay
from kvpolicy.eviction.kernels import KERNEL_POLICIES, next_use_per_ref, replay_kernel
from kvpolicy.traces import first_appearance_ids


@pytest.mark.parametrize("policy", KERNEL_POLICIES)
@settings(max_examples=60, deadline=None)
@given(tr=prefix_traces(max_requests=30), cap=st.integers(0, 14))
def test_kernel_makes_the_online_decisions(policy, tr, cap):
    online = replay(tr, policy, cap, record_victims=True)
    kernel = replay_kernel(tr, policy, cap)
    assert np.array_equal(online.hits, kernel.hits)
    assert online.victims == kernel.victims.tolist()


@pytest.mark.parametrize("policy", KERNEL_POLICIES)
@settings(max_examples=30, deadline=None)
@given(ids=st.lists(st.integers(0, 20), max_size=150), cap=st.integers(1, 10))
def test_kernel_on_flat_streams(policy, ids, cap):
    ids = first_appearance_ids(np.asarray(ids, dtype=np.int64))
    if ids.size == 0:
        return
    tr = flat_trace(ids)
    online = replay(tr, policy, cap, record_victims=True)
    kernel = replay_kernel(tr, policy, cap)
    assert np.array_equal(online.hits, kernel.hits) and online.victims == kernel.victims.tolist()


def test_next_use_per_ref():
    tr = flat_trace(np.array([0, 1, 0, 2, 1]))
    assert next_use_per_ref(tr).tolist() == [2, 4, np.inf, np.inf, np.inf]


def test_kernel_errors():
    tr = flat_trace(np.array([0, 1]))
    with pytest.raises(ConfigError, match="no kernel"):
        replay_kernel(tr, "mru", 2)
    with pytest.raises(ConfigError, match="ttl_s"):
        replay_kernel(tr, "ttl", 2, ttl_s=-1)
    with pytest.raises(ConfigError, match="the lfu kernel takes no such option"):
        replay_kernel(tr, "lfu", 2, ttl_s=5)
    with pytest.raises(ConfigError, match="capacity_blocks"):
        replay_kernel(tr, "lru", -1)
    with pytest.raises(ConfigError, match="fewer than 67,108,864 blocks"):
        replay_kernel(tr, "s3fifo", 2**26)


@pytest.mark.parametrize("policy", KERNEL_POLICIES)
def test_kernel_on_queues_that_wrap_and_compact(policy):
    # long enough that FIFO's ring wraps many times, SIEVE's array and S3-FIFO's
    # ghost compact many times and the prefetch reaches past the end of the trace
    rng = np.random.default_rng(7)
    ids = first_appearance_ids((300 * rng.random(6000) ** 2).astype(np.int64))
    tr = flat_trace(ids)
    for cap in (1, 7, 40):
        online = replay(tr, policy, cap, record_victims=True)
        kernel = replay_kernel(tr, policy, cap)
        assert np.array_equal(online.hits, kernel.hits) and online.victims == kernel.victims.tolist()


@pytest.mark.parametrize("policy,kw", [
    ("ttl", dict(ttl_s=2.5)), ("ttl", dict(ttl_s=float("inf"))),
    ("reuse-distance", dict(aging=3.0, boost=0.0)), ("reuse-distance", dict(ewma=0.2, effective_bytes=3)),
])
@settings(max_examples=60, deadline=None)
@given(tr=prefix_traces(max_requests=30), cap=st.integers(0, 14))
def test_priority_kernel_knobs_make_the_online_decisions(policy, kw, tr, cap):
    """TTL's expiry (every block expiring within a few requests, or never) and reuse-distance's doomed / aged / boosted
    ranks: the kernel with the knob evicts what the online policy with the same knob evicts."""
    online = replay(tr, policy, cap, record_victims=True, **kw)
    kernel = replay_kernel(tr, policy, cap, **kw)
    assert np.array_equal(online.hits, kernel.hits)
    assert online.victims == kernel.victims.tolist()


@pytest.mark.parametrize("policy", ["lfu", "gdsf", "ttl", "reuse-distance"])
def test_priority_kernel_compacts_its_heap(policy):
    """Half the references hit 50 hot blocks, so the heap fills with the stale entries of blocks hit since they were
    pushed: LFU's and GDSF's sink until the heap is full, TTL's and reuse-distance's surface and make it compact
    early. A compaction that dropped a live entry, or kept a dead one, would change the victims."""
    rng = np.random.default_rng(11)
    hot, cold = rng.integers(0, 50, 20000), rng.integers(50, 5000, 20000)
    tr = flat_trace(first_appearance_ids(np.where(rng.random(20000) < 0.5, hot, cold)))
    for cap in (30, 300):
        online = replay(tr, policy, cap, record_victims=True)
        kernel = replay_kernel(tr, policy, cap)
        assert np.array_equal(online.hits, kernel.hits) and online.victims == kernel.victims.tolist()
