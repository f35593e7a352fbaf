import numpy as np
import pytest

from kvpolicy.admission import AdmissionController, LatencyModel, LinkPrior
from kvpolicy.clock import ManualClock
from kvpolicy.errors import ConfigError
from kvpolicy.ledger import Ledger
from kvpolicy.profile import PrefillModel, parse_profile
from kvpolicy.reference import ModelConfig, PeerClient, ReferenceEngine
from kvpolicy.reference.profiling import ReferenceProfileTarget, render, run_profile
from kvpolicy.reference.replica import PeerReplica
from helpers import TimeRecorder

CFG = ModelConfig(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, ffn_dim=64, vocab_size=512)
B = 16
RNG = np.random.default_rng(5)
SYSTEM = RNG.integers(0, 512, 20 * B + 5).tolist()  # 20 full blocks + a partial one
TOL = 1e-4
SECRET = b"test-deployment-secret-0123456789"
BLOCK_BYTES = CFG.block_bytes(B)


def controller():
    prefill = PrefillModel(a_s=0.0, b_s_per_token=5e-5, c_s_per_token2=1e-10, rms_rel_error=0.0, max_rel_error=0.0)
    return AdmissionController(LatencyModel(LinkPrior(bandwidth_bytes_per_s=1e9), prefill), clock=ManualClock())


@pytest.fixture(scope="module")
def peer():
    p = PeerReplica.start(CFG, secret=SECRET, block_size_tokens=B, capacity_blocks=512)
    p.prefill(SYSTEM)
    assert p.stats()["published_blocks"] == 20, "published after answering, before the next command"
    yield p
    p.close()


@pytest.fixture
def engine_b(peer):
    peer.set_faults(drop=False, delay_s=0.0, corrupt=False)
    client = PeerClient(peer.address, peer.namespace_digest, secret=SECRET, block_bytes=BLOCK_BYTES, name="peer-a", timeout_s=5.0)
    e = ReferenceEngine(CFG, block_size_tokens=B, peers=[client], controller=controller(), ledger=Ledger(CFG.geometry().bytes_per_token),
                        replica="replica-b", secret=SECRET)
    yield e
    e.close()
    peer.set_faults(drop=False, delay_s=0.0, corrupt=False)


def recompute(tokens, cfg=CFG):
    return ReferenceEngine(cfg, block_size_tokens=B).prefill(tokens).logits  # fast keys: this engine never talks to a peer


def test_logits_after_installing_remote_blocks_equal_a_full_recompute(engine_b):
    prompt = SYSTEM + RNG.integers(0, 512, 40).tolist()
    r = engine_b.prefill(prompt)
    assert r.load_status == "ok" and r.loaded_blocks == 20 and r.local_blocks == 0
    assert r.computed_tokens == len(prompt) - 20 * B
    assert np.allclose(r.logits, recompute(prompt), atol=TOL, rtol=0)
    for k in ("lookup_s", "transfer_s", "stage_s", "install_s", "prefill_s"):
        assert r.timings[k] >= 0
    assert engine_b.ledger.requests["remote_hit"] + engine_b.ledger.requests["partial_hit"] == 1
    assert engine_b.ledger.tokens["remote_hit"] == 20 * B
    # the next request with the same prefix hits locally; decoding matches too
    r2 = engine_b.prefill(SYSTEM + [1, 2, 3])
    assert r2.local_blocks == 20 and r2.loaded_blocks == 0
    assert np.allclose(r2.logits, recompute(SYSTEM + [1, 2, 3]), atol=TOL, rtol=0)
    assert engine_b.generate(prompt, 4) == ReferenceEngine(CFG, block_size_tokens=B).generate(prompt, 4)


@pytest.mark.parametrize("change", [
    {"rope_theta": 500000.0}, {"revision": "r2"}, {"adapter": ("lora-x", "v1")}, {"block": 32},
])
def test_a_block_from_another_namespace_is_never_matched(peer, change):
    cfg = CFG if "rope_theta" not in change and "revision" not in change else ModelConfig(**{**_cfg_kwargs(CFG), **change})
    block = change.get("block", B)
    e = ReferenceEngine(cfg, block_size_tokens=block, adapter=change.get("adapter"), controller=controller(), secret=SECRET)
    assert e.namespace.digest != peer.namespace_digest
    # asked under its own namespace, the peer holds nothing for it; asked with its keys under the peer's namespace, nothing matches either
    own = PeerClient(peer.address, e.namespace.digest, secret=SECRET, block_bytes=e.block_bytes)
    assert own.match_prefix(list(e.hasher.hash_blocks(SYSTEM))) == 0
    theirs = PeerClient(peer.address, peer.namespace_digest, secret=SECRET, block_bytes=BLOCK_BYTES)
    assert theirs.match_prefix(list(e.hasher.hash_blocks(SYSTEM))) == 0
    own.close()
    theirs.close()


def _cfg_kwargs(c):
    import attrs

    return attrs.asdict(c)


def test_forcing_a_foreign_block_in_would_change_the_logits():
    other = ModelConfig(**{**_cfg_kwargs(CFG), "rope_theta": 500000.0})
    src = ReferenceEngine(other, block_size_tokens=B)
    src.prefill(SYSTEM)
    dst = ReferenceEngine(CFG, block_size_tokens=B)
    keys_src = list(src.hasher.hash_blocks(SYSTEM))
    keys_dst = list(dst.hasher.hash_blocks(SYSTEM))
    assert not set(keys_src) & set(keys_dst), "the namespace keeps the chains disjoint"
    prev = None
    for ks, kd in zip(keys_src, keys_dst):  # bypass the keys: install the other RoPE's K/V under our keys
        assert dst._install(kd, prev, src.payload(ks))
        prev = kd
    forced = dst.prefill(SYSTEM + [9, 9, 9]).logits
    honest = recompute(SYSTEM + [9, 9, 9])
    assert np.max(np.abs(forced - honest)) > 1e-2, "a block computed under another RoPE theta is not the same block"


@pytest.mark.parametrize("fault,status", [({"drop": True}, "failed"), ({"delay_s": 1.0}, "timeout"), ({"corrupt": True}, "failed")])
def test_failed_timed_out_or_corrupt_loads_fall_back_to_recompute(peer, engine_b, fault, status):
    prompt = SYSTEM + RNG.integers(0, 512, 7).tolist()
    peer.set_faults(**fault)
    r = engine_b.prefill(prompt)
    assert r.decision is not None and r.decision.loads
    assert r.load_status == status and r.loaded_blocks == 0
    assert r.computed_tokens == len(prompt)
    assert np.allclose(r.logits, recompute(prompt), atol=TOL, rtol=0), "the output is correct whatever the transfer did"
    if fault.get("corrupt"):
        assert engine_b.counts["corrupt_refused"] == 1
    nl = engine_b.ledger.tokens
    assert nl["miss_timeout" if status == "timeout" else "miss_transfer_error"] == 20 * B
    assert engine_b.controller.loads_in_flight() == 0


def test_measured_byte_slope_equals_the_geometry_formula():
    for cfg in (CFG, ModelConfig(num_layers=3, num_heads=8, num_kv_heads=2, head_dim=8, ffn_dim=32, vocab_size=256, dtype="float16")):
        e = ReferenceEngine(cfg, block_size_tokens=B)
        sizes = []
        for n in (4, 10):
            e.reset()
            e.prefill(list(range(n * B)), publish=False)
            sizes.append(e.allocated_kv_bytes())
        slope = (sizes[1] - sizes[0]) / (6 * B)
        assert slope == cfg.geometry().bytes_per_token == 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * cfg.bytes_per_element


def test_paged_cache_evicts_with_the_policy_and_stays_correct():
    e = ReferenceEngine(CFG, block_size_tokens=B, capacity_blocks=24)
    a = RNG.integers(0, 512, 20 * B).tolist()
    b = RNG.integers(0, 512, 20 * B).tolist()
    e.prefill(a)
    r = e.prefill(b)
    assert e.counts["evicted_blocks"] > 0 and len(e.slot_of) <= 24
    assert np.allclose(r.logits, recompute(b), atol=TOL, rtol=0)
    r = e.prefill(a + [1])
    assert np.allclose(r.logits, recompute(a + [1]), atol=TOL, rtol=0)


def test_bad_model_config_names_the_field():
    with pytest.raises(ConfigError) as err:
        ModelConfig(num_heads=4, num_kv_heads=3)
    assert err.value.field == "num_kv_heads"
    with pytest.raises(ConfigError) as err:
        ModelConfig(dtype="int4")
    assert err.value.field == "dtype"
    with pytest.raises(ConfigError) as err:
        ReferenceEngine(CFG).prefill([])
    assert err.value.field == "tokens"
    with pytest.raises(ConfigError) as err:
        ReferenceEngine(CFG).prefill([10_000])
    assert err.value.field == "tokens"
    for field in ("model_id", "revision"):  # they go into every block key's namespace
        with pytest.raises(ConfigError) as err:
            ModelConfig(**{field: None})
        assert err.value.field == field


def test_injected_faults_are_checked_when_set():
    """A NaN delay reached time.sleep() inside the server's thread; a truthy non-bool flag read as a fault."""
    from kvpolicy.reference.transport import Faults

    f = Faults()
    for field, bad in (("delay_s", float("nan")), ("delay_s", -1.0), ("drop", 1), ("corrupt", "yes")):
        with pytest.raises(ConfigError) as err:
            setattr(f, field, bad)
        assert err.value.field == field
    f.delay_s, f.drop = 0.25, True
    assert f == Faults(drop=True, delay_s=0.25)


def test_profile_runs_and_its_csv_reads_back():
    target = ReferenceProfileTarget(CFG, block_size_tokens=B, max_prefix_tokens=8 * B)
    try:
        prof, report = run_profile(target, [4 * B, 8 * B], [1, 2], repeats=2, expected_bytes_per_token=CFG.geometry().bytes_per_token)
    finally:
        target.close()
    assert report["slope_matches_formula"] is True
    back = parse_profile(prof.to_csv())
    assert list(back.prefix_tokens) == [4 * B, 8 * B]
    assert back.bytes_per_token == pytest.approx(CFG.geometry().bytes_per_token)
    for col in ("remote_load_p95_ms", "cold_prefill_c2_p50_ms", "remote_transfer_p50_ms"):
        assert col in back.extra
    assert {r["concurrency"] for r in report["rows"]} == {1, 2}
    assert all(r["samples"] >= 2 for r in report["rows"])
    # half hits: the prompt again with half its prefix (whole blocks) cached — they fit the cross term
    assert back.extra["half_hit_cached_tokens"].tolist() == [2 * B, 4 * B]
    assert back.extra["tail_tokens"].tolist() == [16, 16], "each row is fitted as the prompt it ran: prefix + tail"
    assert np.all(back.extra["half_hit_ttft_ms"] > 0)
    assert back.prefill_model().cross_s_per_token2 is not None
    text = render(report)  # what the simulator will take from this profile is printed with it
    assert "half-hit p50" in text and "prefill model    T_prefill(T)" in text and "from the half-hit rows" in text


def test_replicas_share_a_block_server_publishing_into_it_and_loading_from_it():
    """A pool node: replica A publishes into the server in the background, replica B loads what A computed."""
    from kvpolicy.reference.transport import BlockServer, BlockStore, TransportKeys, block_mac

    store = BlockStore(CFG.namespace(B).digest, BLOCK_BYTES)
    server = BlockServer(store, secret=SECRET)
    shared = (tuple(server.address), store.namespace_digest)
    a = PeerReplica.start(CFG, secret=SECRET, block_size_tokens=B, capacity_blocks=512, name="a", shared=shared, link_bytes_per_s=1e9)
    b = PeerReplica.start(CFG, secret=SECRET, block_size_tokens=B, capacity_blocks=512, name="b", shared=shared, link_bytes_per_s=1e9)
    try:
        first = a.prefill(SYSTEM)
        assert first["loaded_blocks"] == 0
        a.flush()
        assert len(store.blocks) == 20, "every full block went to the shared server"
        got = b.prefill(SYSTEM + [7, 8, 9])
        assert got["loaded_blocks"] == 20 and got["load_status"] == "ok" and got["load_bytes"] > 0
        # a put whose MAC does not match the payload is refused whole
        client = PeerClient(server.address, store.namespace_digest, secret=SECRET, block_bytes=BLOCK_BYTES)
        key, payload = bytes(16), b"\x01" * BLOCK_BYTES
        assert client.put([key], [payload], 5.0) == 1 and store.blocks[key] == payload
        from kvpolicy.reference.transport import client_handshake, Channel, TransportLimits
        import socket as _s

        k = TransportKeys.from_secret(SECRET)
        with _s.create_connection(server.address, timeout=5.0) as sock:
            ch = Channel(sock, client_handshake(sock, k, 5.0), is_server=False, limits=TransportLimits())
            meta = [{"key": (b"\x02" * 16).hex(), "nbytes": BLOCK_BYTES, "mac": block_mac(k.block, store.namespace_digest, b"\x02" * 16, b"\x03" * BLOCK_BYTES)}]
            ch.send({"op": "put", "namespace": store.namespace_digest.hex(), "blocks": meta}, [b"\x04" * BLOCK_BYTES])
            assert ch.recv(5.0) == {"stored": 0, "error": "mac"}
        assert b"\x02" * 16 not in store.blocks and server.stats["mac_refused"] == 1
        client.close()
    finally:
        a.close()
        b.close()
        server.close()


def test_a_probe_prefill_is_not_what_the_replicas_controller_learns_from():
    """bench_sim_vs_real probes each replica's serving path with short cold prompts before the replay. Those prefills
    used to feed the controller's prefill ratio like traffic (short prompts run furthest from the profile), so the
    real controllers started the replay believing recompute ~1.7x dearer, and loaded 1.7-7x the simulated ones'
    bytes. learn=False keeps a probe out; stats() shows what the controller learned; min_samples is the model's."""
    from kvpolicy.reference.transport import BlockServer, BlockStore

    store = BlockStore(CFG.namespace(B).digest, BLOCK_BYTES)
    server = BlockServer(store, secret=SECRET)
    shared = (tuple(server.address), store.namespace_digest)
    prefill = PrefillModel(a_s=0.0, b_s_per_token=1e-9, c_s_per_token2=0.0, rms_rel_error=0.0, max_rel_error=0.0)  # far too fast
    rep = PeerReplica.start(CFG, secret=SECRET, block_size_tokens=B, capacity_blocks=512, name="a", shared=shared, link_bytes_per_s=1e9,
                            prefill=prefill, min_samples=1)
    try:
        def ratio():
            return rep.stats()["admission"]["peer"]["p50"]["prefill_ratio"]

        for i in range(3):
            rep.prefill(RNG.integers(0, 512, 2 * B), learn=False)
        assert ratio() == 1.0, "probes heard: the controller left its prior"
        rep.prefill(RNG.integers(0, 512, 2 * B))
        assert ratio() > 10.0, "traffic heard: the real forward pass is far slower than this profile"
        with pytest.raises(ConfigError) as e:
            rep.prefill([1, 2, 3], learn="no")
        assert e.value.field == "learn"
    finally:
        rep.close()
        server.close()
    with pytest.raises(ConfigError) as e:
        PeerReplica.start(CFG, secret=SECRET, block_size_tokens=B, min_samples=0)
    assert e.value.field == "min_samples"


def test_model_config_refuses_the_wrong_types_by_name():
    from kvpolicy.errors import ConfigError
    from kvpolicy.reference.model import ModelConfig

    for field, bad in (("rope_theta", None), ("rope_theta", float("nan")), ("dtype", ["float32"]), ("seed", "x")):
        with pytest.raises(ConfigError) as e:
            ModelConfig(**{field: bad})
        assert e.value.field == field


def test_engine_refuses_float_token_ids_and_an_unallocatable_pool():
    """Float token ids were cast to int64 (1.5 became 1: a different prompt, silently); a pool of 1e30 blocks was
    numpy's "maximum allowed dimension exceeded"."""
    from kvpolicy.errors import ConfigError
    from kvpolicy.reference import ModelConfig
    from kvpolicy.reference.engine import ReferenceEngine

    eng = ReferenceEngine(ModelConfig(), block_size_tokens=16, capacity_blocks=16)
    with pytest.raises(ConfigError, match="token ids must be integers"):
        eng.prefill([1.5, 2.0] * 20)
    with pytest.raises(ConfigError) as e:
        ReferenceEngine(ModelConfig(), block_size_tokens=16, capacity_blocks=10**30)
    assert e.value.field == "capacity_blocks"


def test_prefill_timings_account_for_the_call(engine_b):
    """Each part of a prefill is timed, the parts up to the first token never overlap (their sum stays
    within TTFT), the write-back comes after TTFT and within the call, and a load's parts appear only
    when it loaded."""
    import time

    prompt = SYSTEM + [5, 6, 7]
    t0 = time.perf_counter()
    r = engine_b.prefill(prompt)
    call_s = time.perf_counter() - t0
    parts = ("match_s", "gather_s", "prefill_s", "cache_s")
    assert all(r.timings[k] >= 0 for k in parts + ("publish_s",))
    load = sum(r.timings.get(k, 0.0) for k in ("transfer_s", "stage_s", "install_s"))
    assert r.loaded_blocks > 0 and load > 0
    assert sum(r.timings[k] for k in parts) + load <= r.timings["ttft_s"]
    assert r.timings["ttft_s"] + r.timings["publish_s"] <= call_s, "TTFT does not include the write-back"
    again = engine_b.prefill(prompt, publish=False)  # all local now: nothing loaded, nothing offered
    assert again.loaded_blocks == 0 and "transfer_s" not in again.timings and "publish_s" not in again.timings
    assert sum(again.timings[k] for k in parts) <= again.timings["ttft_s"]
    assert engine_b.publish(again) == 0, "published already: nothing new"
    assert "publish_s" in again.timings
    with pytest.raises(ConfigError) as err:
        engine_b.publish(prompt)
    assert err.value.field == "result"


def test_wait_published_returns_only_once_another_replica_can_load_the_blocks():
    """A replica answers at the first token and publishes after; a caller that lets another replica load
    next (the profiler, the example) asks to wait. Without the wait this matched 0–50 of 64 blocks."""
    rng = np.random.default_rng(11)
    hasher = ReferenceEngine(CFG, block_size_tokens=B, secret=SECRET).hasher
    with PeerReplica.start(CFG, secret=SECRET, block_size_tokens=B, capacity_blocks=512) as p:
        client = PeerClient(p.address, p.namespace_digest, secret=SECRET, block_bytes=BLOCK_BYTES, name="p", timeout_s=5.0)
        for i in range(5):
            p.reset()
            tokens = rng.integers(0, 512, 64 * B)
            out = p.prefill(tokens, wait_published=True)
            keys = list(hasher.hash_blocks(tokens))
            assert client.match_prefix(keys) == 64 and out["published_blocks"] == 64 * (i + 1)  # the store keeps earlier ones


def test_publish_requests_carry_the_engines_time():
    """The publish filter's windows and decay run on the request's time: the controller's clock, else monotonic
    seconds (it was 0 for every request)."""
    ctl = controller()
    ctl.clock.advance(50.0)
    rec = TimeRecorder()
    led = Ledger(CFG.geometry().bytes_per_token)
    e = ReferenceEngine(CFG, block_size_tokens=B, controller=ctl, publish_filter=rec, ledger=led)
    e.prefill(list(range(3 * B + 1)))
    ctl.clock.advance(9.0)
    e.prefill(list(range(100, 100 + 3 * B + 1)))
    assert rec.times == [50.0, 59.0]
    assert led.expected_benefit()["per_class"]["default"]["rate_per_s"] == pytest.approx(2 / 9.0), "the ledger's times too"
    rec2 = TimeRecorder()
    ReferenceEngine(CFG, block_size_tokens=B, publish_filter=rec2).prefill(list(range(2 * B + 1)))
    assert rec2.times and rec2.times[0] > 0
