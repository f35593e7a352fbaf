import subprocess
import sys
import textwrap
from collections import OrderedDict

import pytest
from hypothesis import given, settings

from kvpolicy.admission import AdmissionConfig, AdmissionController, LatencyModel, LinkPrior
from kvpolicy.errors import CapacityError
from kvpolicy.eviction import BeladyPolicy
from kvpolicy.eviction import make_policy as build_policy
from kvpolicy.matching import InMemoryBlockIndex
from kvpolicy.profile import fit_prefill
from kvpolicy.publish import PublishAll, ThresholdPublish, make_filter
from kvpolicy.testing import (
    AdmissionContract,
    BlockIndexContract,
    ContractViolation,
    EvictionPolicyContract,
    PublishFilterContract,
    contract_test,
    first_divergence,
    latency_distributions,
    link_figures,
    namespaces,
    prefix_traces,
    token_sequences,
)

PREFILL = fit_prefill([4096, 16384, 32768, 65536], [0.31, 1.41, 3.19, 7.6])
EVICTION = ["lru", "fifo", "lfu", "ttl", "s3fifo", "sieve", "arc", "gdsf", "reuse-distance", "hit-density", "adaptive", "lrb", "belady"]


def eviction_contract(name):
    def make_policy(self, capacity_bytes, clock):
        if name == "belady":
            return BeladyPolicy(capacity_bytes, oracle=lambda k: float((k * 7919) % 101), clock=clock)
        return build_policy(name, capacity_bytes, clock=clock)

    attrs = {"make_policy": make_policy}
    if name == "arc":
        attrs["max_block_bytes"] = 1  # ARC caches blocks of one size
    return type(f"{name}Contract", (EvictionPolicyContract,), attrs)


@pytest.mark.parametrize("name", EVICTION)
def test_every_builtin_eviction_policy_passes_its_contract(name):
    contract_test(eviction_contract(name), max_examples=20)().runTest()


@pytest.mark.parametrize("spec, enforces", [("all", False), ("never", True), ("threshold-2", False), ("boundary", True),
                                            ("reuse-aware", False), ("boundary+reuse-aware", True), ("boundary+threshold-3", True),
                                            ("structure-aware", False), ("boundary+structure-aware", True)])
def test_every_builtin_publish_filter_passes_its_contract(spec, enforces):
    kw = {"block_bytes": 1 << 20, "recompute_s": lambda d: 0.01, "write_bytes_per_s": 1e9}

    class C(PublishFilterContract):
        enforces_boundary = enforces

        def make_filter(self):
            return make_filter(spec, **kw) if "reuse-aware" in spec else make_filter(spec)

    contract_test(C, max_examples=25)().runTest()


class ControllerContract(AdmissionContract):
    def make_controller(self, clock):
        return AdmissionController(LatencyModel(LinkPrior(bandwidth_bytes_per_s=25e9), PREFILL),
                                   AdmissionConfig(max_loads_per_replica=2, max_loads_per_source=3), clock=clock)


def test_admission_controller_passes_its_contract():
    contract_test(ControllerContract, max_examples=25)().runTest()


class MemoryIndexContract(BlockIndexContract):
    def make_index(self, keys):
        return InMemoryBlockIndex(keys)


def test_in_memory_index_passes_its_contract():
    contract_test(MemoryIndexContract, max_examples=25)().runTest()


# --------------------------------------------------------------------------- broken policies are caught


class NaiveLRU:
    """Evicts from the least recent end; breaks exactly one rule: pins or prefix closure."""

    def __init__(self, capacity, respect_pins=True, respect_children=True):
        self.capacity, self.respect_pins, self.respect_children = capacity, respect_pins, respect_children
        self.d = OrderedDict()
        self.parent = {}
        self.pins = {}
        self.used_bytes = 0

    def __contains__(self, k):
        return k in self.d

    def __len__(self):
        return len(self.d)

    def on_insert(self, k, size, parent=None):
        self.d[k] = size
        self.parent[k] = parent
        self.used_bytes += size

    def on_access(self, k):
        self.d.move_to_end(k)

    def on_remove(self, k):
        self.used_bytes -= self.d.pop(k)
        del self.parent[k]

    def pin(self, k):
        self.pins[k] = self.pins.get(k, 0) + 1

    def unpin(self, k):
        self.pins[k] -= 1

    def _pinned_at_or_below(self, k):
        stack = [k]
        while stack:
            x = stack.pop()
            if self.pins.get(x, 0):
                return True
            stack += [c for c, p in self.parent.items() if p == x]
        return False

    def _blocked(self, k):
        if self.respect_children and any(p == k for p in self.parent.values()):
            return True
        return self.respect_pins and self._pinned_at_or_below(k)

    def victims(self, need):
        freeable = sum(s for k, s in self.d.items() if not self._pinned_at_or_below(k))
        if need > self.capacity or (self.respect_pins and self.used_bytes + need - self.capacity > freeable):
            raise CapacityError("cannot free enough")
        out = []
        while self.used_bytes + need > self.capacity:
            k = next(k for k in self.d if not self._blocked(k))
            out.append(k)
            self.on_remove(k)
        return out


def caught(machine, name):
    from hypothesis import Phase

    test = contract_test(machine, max_examples=200, steps=40)
    test.settings = settings(test.settings, phases=[Phase.explicit, Phase.reuse, Phase.generate])  # caught is enough: skip shrinking
    with pytest.raises(ContractViolation) as exc:
        test().runTest()
    assert name in str(exc.value), str(exc.value)


def test_contract_catches_a_policy_that_evicts_pinned_blocks():
    class C(EvictionPolicyContract):
        def make_policy(self, capacity_bytes, clock):
            return NaiveLRU(capacity_bytes, respect_pins=False)

    caught(C, "pinned-never-evicted")


def test_contract_catches_a_policy_that_breaks_prefix_closure():
    class C(EvictionPolicyContract):
        def make_policy(self, capacity_bytes, clock):
            return NaiveLRU(capacity_bytes, respect_children=False)

    caught(C, "prefix-closure")


def test_contract_catches_publishing_past_the_boundary():
    class C(PublishFilterContract):
        def make_filter(self):
            return PublishAll()

    caught(C, "tenancy-boundary")


class PerLookupThreshold(ThresholdPublish):
    """Counts every observe call — the vLLM #52227 bug."""

    def observe(self, request, keys):
        for k in keys:
            self._count[k] = self._count.get(k, 0) + 1


def test_contract_catches_counting_lookups_instead_of_requests():
    class C(PublishFilterContract):
        enforces_boundary = False

        def make_filter(self):
            return PerLookupThreshold(2)

    caught(C, "distinct-request-counting")


class AlwaysLoads(AdmissionController):
    """Loads whatever the prediction says."""

    def decide(self, match, ctx):
        import attrs

        d = super().decide(match, ctx)
        if d.action != "load" and match.remote_total_blocks and d.t_remote_p95_s is not None:
            d = attrs.evolve(d, action="load", load_blocks=match.remote_total_blocks, load_id=-1)
        return d


def test_contract_catches_loading_when_recompute_is_faster():
    class C(AdmissionContract):
        def make_controller(self, clock):
            return AlwaysLoads(LatencyModel(LinkPrior(bandwidth_bytes_per_s=0.2e9), PREFILL),
                               AdmissionConfig(max_loads_per_replica=100, max_loads_per_source=100), clock=clock)

    caught(C, "load-only-when-it-wins")


class NeverLoads(AdmissionController):
    """Recomputes everything and says the link is too slow."""

    def decide(self, match, ctx):
        import attrs

        d = super().propose(match, ctx)
        if d.action == "load":
            d = attrs.evolve(d, action="recompute", reason="slower_than_recompute", load_blocks=0, load_id=None)
        return d


def test_contract_catches_a_controller_that_never_loads():
    class C(AdmissionContract):
        def make_controller(self, clock):
            return NeverLoads(LatencyModel(LinkPrior(bandwidth_bytes_per_s=25e9), PREFILL),
                              AdmissionConfig(max_loads_per_replica=2, max_loads_per_source=3), clock=clock)

    caught(C, "refuse-only-when-it-loses")


# --------------------------------------------------------------------------- differential helper, strategies, plugin


@settings(max_examples=20, deadline=None)
@given(prefix_traces(max_requests=20))
def test_first_divergence(tr):
    """Two different implementations that must agree: reuse-distance with its corrections switched off
    (no aging, no boost, an unreachable C_effective) is LRU decision for decision."""
    lru = lambda cap, clock: build_policy("lru", cap, clock=clock)  # noqa: E731
    plain_rd = lambda cap, clock: build_policy("reuse-distance", cap, clock=clock, aging=0.0, boost=0.0, effective_bytes=10**18)  # noqa: E731
    assert first_divergence(lru, plain_rd, [tr], 3) is None


def test_first_divergence_reports_the_place():
    from kvpolicy.traces import generate, preset

    tr = generate(preset("chat", n_requests=120, block_size_tokens=64))
    d = first_divergence(lambda c, k: build_policy("lru", c, clock=k), lambda c, k: build_policy("fifo", c, clock=k), [tr], 40)
    assert d is not None and d.trace_index == 0 and "trace 0" in str(d)


@settings(max_examples=30, deadline=None)
@given(namespaces(), token_sequences(), latency_distributions(), link_figures(), prefix_traces(shape="sessions"))
def test_strategies_make_valid_objects(ns, prompts, lat, link, tr):
    assert len(ns.digest) == 16 and prompts and all(x > 0 for x in lat) and link.bandwidth_bytes_per_s > 0
    assert tr.block_ids.size == int(tr.full_blocks.sum())


def test_plugin_and_a_ten_line_user_test_file(tmp_path):
    user = tmp_path / "test_user_policy.py"
    user.write_text(textwrap.dedent('''
        from kvpolicy.eviction import LRUPolicy
        from kvpolicy.testing import EvictionPolicyContract, contract_test

        class MyPolicy(LRUPolicy):
            pass

        class MyContract(EvictionPolicyContract):
            def make_policy(self, capacity_bytes, clock):
                return MyPolicy(capacity_bytes, clock=clock)

        TestMyPolicy = contract_test(MyContract)
    '''))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(user), "--kvpolicy-examples", "5", "--kvpolicy-steps", "10"],
                       capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 passed" in r.stdout
