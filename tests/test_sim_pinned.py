"""Every decision of a run, pinned (issue #48): the simulator's rooms and its fast paths must leave each request's TTFT,
prefill time, queueing and route, and every figure of the report, as they were when this file was written.

The golden file was written by the code of d197e89, before the simulator was split into rooms and made faster, and
regenerated on purpose only where a decision changed on purpose since (86a89a6: the prices of issue #58; 0a66d4a: LRU
in the replicas) — so this test is the side-by-side comparison of the code before each refactor with the code after it
(issue #48's rooms and speed work, issue #61's rooms as objects) on a slice (``agent`` at seed 5, 600
requests, every view, the kvpolicy set and vllm-like). The kvpolicy set runs with the publish selector d197e89 had,
``dueling-gpu-s``, and without pulls from peers (issue #44's second and third rounds moved the defaults to the brief's
E[benefit] and turned pulls on, on purpose; the defaults are pinned by tests/test_sim_load_rules.py's short run). Regenerate only on purpose (KVPOLICY_WRITE_GOLDEN=1) and say why
in the commit: a missing golden file is a failure."""

import json
import math
import os
from pathlib import Path

import attrs
import pytest

from kvpolicy.publish_sim import DEFAULT_PREFILL
from kvpolicy.sim import PRESETS, compare, default_cluster
from kvpolicy.sim.events import PREFILL_DONE
from kvpolicy.traces import generate, preset

BPT = 131072
GOLDEN = Path(__file__).parent / "golden" / "sim_agent_seed5_decisions.json"


def _close(a, b, where=""):
    if isinstance(a, float) or isinstance(b, float):
        if isinstance(a, float) and math.isnan(a):
            assert isinstance(b, float) and math.isnan(b), where
        else:
            assert a == pytest.approx(b, rel=1e-9, abs=1e-12), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _close(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _close(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def _decisions():
    trace = generate(preset("agent", block_size_tokens=256, seed=5)).head(600)
    cl = default_cluster(trace, bytes_per_token=BPT, prefill=DEFAULT_PREFILL)
    # still named "kvpolicy"; d197e89's set had no pulls from peers (issue #44's third round turned them on)
    as_pinned = attrs.evolve(PRESETS["kvpolicy"], publish="dueling-gpu-s", pull_from_peers=False)
    rep, raw = compare(trace, cl, seed=5, policies=[as_pinned, "vllm-like"])
    # the rows as d197e89 wrote them: a field added since (bytes_pulled, 0 without pulls) is not in its file
    out = {"runs": [{k: v for k, v in r.items() if k != "bytes_pulled"} for r in rep["runs"]], "requests": {}}
    for (scenario, policy), res in sorted(raw.items()):
        if policy == "recompute-only":
            continue
        out["requests"][f"{scenario}/{policy}"] = {
            "ttft_s": [float(x) for x in res.ttft_s],
            "prefill_s": [float(x) for x in res.prefill_s],
            "queue_s": [float(x) for x in res.queue_s],
            "routes": [int(x) for x in res.routes],
            "node_bytes_out": [int(x) for x in res.node_bytes_out],
        }
    return json.loads(json.dumps(out))  # the report as a user's JSON reader sees it (tuples become lists)


def test_every_request_of_a_slice_is_decided_as_it_was_pinned():
    got = _decisions()
    if os.environ.get("KVPOLICY_WRITE_GOLDEN") == "1":
        GOLDEN.write_text(json.dumps(got, sort_keys=True))
    if not GOLDEN.exists():
        pytest.fail(f"golden file {GOLDEN} is missing: a missing golden file is a failure, never a regeneration "
                    "(regenerate on purpose with KVPOLICY_WRITE_GOLDEN=1 and review the diff)")
    want = json.loads(GOLDEN.read_text())
    assert len(want["requests"]) == 8 and all(len(v["ttft_s"]) >= 600 for v in want["requests"].values())
    _close(got, want, "")


def test_a_run_gives_the_garbage_collector_back_as_it_found_it():
    """run() holds the cyclic collector while its events run (pause_gc, default True) and restores its state however the
    run ends; pause_gc=False never touches it; the figures are the same either way."""
    import gc

    from kvpolicy.errors import ConfigError
    from kvpolicy.sim import Prepared, Simulator, policy_set

    trace = generate(preset("chat", block_size_tokens=256, seed=3)).head(60)
    cl = default_cluster(trace, bytes_per_token=BPT, prefill=DEFAULT_PREFILL)
    states = []

    class Watch(Simulator):
        def handlers(self):
            hs = list(super().handlers())
            first = hs[-1]  # NEW_REQUEST

            def new(i, t):
                states.append(gc.isenabled())
                first(i, t)

            hs[-1] = new
            return tuple(hs)

    was = gc.isenabled()
    try:
        gc.enable()
        a = Watch(Prepared(trace), cl, policy_set("kvpolicy")).run()
        assert gc.isenabled() and states and not any(states), "paused during the run, enabled after"
        states.clear()
        b = Watch(Prepared(trace), cl, policy_set("kvpolicy"), pause_gc=False).run()
        assert gc.isenabled() and all(states) and len(states) == len(trace)
        assert (a.ttft_s == b.ttft_s).all() and a.row() == b.row()
        gc.disable()
        Watch(Prepared(trace), cl, policy_set("kvpolicy")).run()
        assert not gc.isenabled(), "a collector the caller had disabled stays disabled"
        gc.enable()

        class Boom(Watch):
            def handlers(self):
                def boom(req, t):
                    raise RuntimeError("boom")

                hs = list(super().handlers())
                hs[PREFILL_DONE] = boom
                return tuple(hs)

        with pytest.raises(RuntimeError, match="boom"):
            Boom(Prepared(trace), cl, policy_set("kvpolicy")).run()
        assert gc.isenabled(), "restored when a run fails"
        with pytest.raises(ConfigError, match="pause_gc"):
            Simulator(Prepared(trace), cl, policy_set("kvpolicy"), pause_gc=1)
    finally:
        (gc.enable if was else gc.disable)()


def test_what_a_paused_run_allocated_waits_in_the_oldest_generation_and_a_callers_freeze_stays():
    """The objects a paused run allocated are handed to the oldest generation when the collector comes back (no young
    collection walks them all); a caller who froze objects of its own keeps them frozen (nothing is unfrozen)."""
    import gc

    from kvpolicy.sim import Prepared, Simulator, policy_set

    trace = generate(preset("chat", block_size_tokens=256, seed=3)).head(200)
    cl = default_cluster(trace, bytes_per_token=BPT, prefill=DEFAULT_PREFILL)

    def young() -> int:
        return len(gc.get_objects(generation=0)) + len(gc.get_objects(generation=1))

    was = gc.isenabled()
    try:
        gc.enable()
        gc.collect()
        sim = Simulator(Prepared(trace), cl, policy_set("kvpolicy"))
        sim.run()
        handed = young()
        assert gc.get_freeze_count() == 0
        mine = [[] for _ in range(100)]
        gc.freeze()
        frozen = gc.get_freeze_count()
        assert frozen >= len(mine)
        sim2 = Simulator(Prepared(trace), cl, policy_set("kvpolicy"))
        sim2.run()
        # (a frozen object that dies leaves the count: a few temporaries of the freeze's moment do)
        assert gc.get_freeze_count() > frozen // 2, "the caller's frozen objects stay frozen"
        left = young()
        assert handed < 200 < left, f"young objects after a run: {handed}; after one with a caller's freeze: {left}"
        del sim, sim2
    finally:
        gc.unfreeze()
        (gc.enable if was else gc.disable)()
