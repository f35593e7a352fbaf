import threading
import time

import pytest

from kvpolicy.admission import AdmissionController, LatencyModel, LinkPrior
from kvpolicy.clock import ManualClock
from kvpolicy.directory import Entry, InMemoryDirectory
from kvpolicy.errors import ConfigError
from kvpolicy.eviction.policies import GDSFPolicy, LFUPolicy, LRUPolicy
from kvpolicy.eviction.reuse_distance import ReuseDistancePolicy
from kvpolicy.integrations.lmcache import StorePolicyAdapter
from kvpolicy.integrations.sglang import PriorityStrategy
from kvpolicy.integrations.vllm_connector import VllmConnectorPolicy
from kvpolicy.integrations.vllm_events import (
    AllBlocksCleared, BlockRemoved, BlockStored, EventFormatError, KVEventIngestor, ZmqEventSubscriber, decode_batch, decode_event, encode_batch,
)
from kvpolicy.keys import BlockHasher, Namespace, vllm_block_hashes
from kvpolicy.profile import PrefillModel
from kvpolicy.publish import PublishAll, ThresholdPublish

B = 16
NS = Namespace(model_id="m", model_revision="r", tokenizer_version="t", kv_dtype="bf16", block_size_tokens=B)
HASHER = BlockHasher(NS, "fast")
PROMPT = list(range(1000, 1000 + 4 * B + 3))


def stored(tokens, parent=None, algo="sha256", as_int=False):
    raw = vllm_block_hashes(tokens, B, algo, parent=parent)
    hashes = [int.from_bytes(h[-8:], "big") for h in raw] if as_int else raw
    return BlockStored(tuple(hashes), parent, tuple(tokens[: len(hashes) * B]), B, None, "GPU"), raw


def ingestor(d=None, **kw):
    return KVEventIngestor(d or InMemoryDirectory(), "acme", HASHER, holder="pod-1", bytes_per_token=2048, **kw)


# --------------------------------------------------------------------------- wire format


def test_batch_round_trip_has_vllm_shape():
    ev, _ = stored(PROMPT)
    payload = encode_batch(12.5, [ev, BlockRemoved(ev.block_hashes[-1:], "GPU"), AllBlocksCleared()], data_parallel_rank=0)
    import msgpack

    raw = msgpack.unpackb(payload)
    assert raw[0] == 12.5 and raw[2] == 0
    assert raw[1][0][0] == "BlockStored" and raw[1][1][0] == "BlockRemoved" and raw[1][2] == ["AllBlocksCleared"]
    ts, events, rank = decode_batch(payload)
    assert [decode_event(e, i) for i, e in enumerate(events)] == [ev, BlockRemoved(ev.block_hashes[-1:], "GPU"), AllBlocksCleared()]


@pytest.mark.parametrize("raw,field", [
    (["Nope"], "events[0]"),
    ([], "events[0]"),
    (["BlockStored", [b"x"], None, [1, 2], 0], "events[0].block_size"),
    (["BlockStored", [b"x"], None, [1, 2, 3], 2], "events[0]"),
    (["BlockStored", [1.5], None, [1, 2], 2], "events[0].block_hashes"),
    (["BlockRemoved"], "events[0]"),
])
def test_malformed_events_name_the_field(raw, field):
    with pytest.raises(EventFormatError) as e:
        decode_event(raw, 0)
    assert e.value.field == field


# --------------------------------------------------------------------------- ingestion


@pytest.mark.parametrize("as_int", [False, True])
def test_stored_blocks_map_to_the_requests_own_keys(as_int):
    d = InMemoryDirectory()
    ing = ingestor(d)
    ev1, h1 = stored(PROMPT[: 2 * B], as_int=as_int)
    parent = ev1.block_hashes[-1]
    h2 = vllm_block_hashes(PROMPT[2 * B: 4 * B], B, parent=h1[-1])
    if as_int:
        h2 = [int.from_bytes(h[-8:], "big") for h in h2]
    ev2 = BlockStored(tuple(h2), parent, tuple(PROMPT[2 * B: 4 * B]), B, None, "CPU")
    h2_removed = h2[-1]
    assert ing.ingest(encode_batch(1.0, [ev1, ev2])) == 2
    keys = list(HASHER.hash_blocks(PROMPT))
    assert d.match_prefix("acme", keys) == 4
    assert [e[0].tier for e in d.lookup("acme", keys)] == ["gpu", "gpu", "cpu", "cpu"]
    assert d.lookup("acme", keys)[0][0].namespace_digest == NS.digest
    assert d.match_prefix("other-tenant", keys) == 0
    other = BlockHasher(Namespace(model_id="m", model_revision="r2", tokenizer_version="t", kv_dtype="bf16", block_size_tokens=B), "fast")
    assert d.match_prefix("acme", list(other.hash_blocks(PROMPT))) == 0, "another namespace never matches"
    ing.ingest(encode_batch(2.0, [BlockRemoved((h2_removed,), "CPU")]))
    assert d.match_prefix("acme", keys) == 3
    ing.ingest(encode_batch(3.0, [AllBlocksCleared()]))
    assert d.match_prefix("acme", keys) == 0
    assert ing.counts["stored_blocks"] == 4 and ing.counts["removed_blocks"] == 1 and ing.counts["cleared"] == 1


def test_orphans_wrong_block_size_and_hash_mismatch_are_refused():
    d = InMemoryDirectory()
    ing = ingestor(d, verify_algo="sha256")
    ev, h = stored(PROMPT[B: 2 * B], parent=b"\x01" * 32)  # parent never seen
    ing.apply(ev)
    assert ing.counts["orphans"] == 1
    bad_bs = BlockStored((b"a",), None, tuple(range(8)), 8)
    ing.apply(bad_bs)
    assert ing.counts["incompatible"] == 1
    ev, h = stored(PROMPT[:B])
    tampered = BlockStored((b"\x00" * 32,), None, ev.token_ids, B)
    ing.apply(tampered)
    assert ing.counts["mismatched"] == 1
    assert d.keys("acme") == []
    ing.apply(ev)
    assert len(d.keys("acme")) == 1


def test_malformed_frames_are_counted_never_raised():
    ing = ingestor()
    assert ing.ingest(b"\xc1 not msgpack") == 0
    import msgpack

    assert ing.ingest(msgpack.packb({"a": 1})) == 0
    ev, _ = stored(PROMPT[:B])
    assert ing.ingest(encode_batch(1.0, [["Bogus", 1], ev])) == 1
    assert ing.counts["malformed_frames"] == 2 and ing.counts["malformed_events"] == 1 and ing.counts["stored_blocks"] == 1


def test_real_zmq_socket_on_loopback():
    zmq = pytest.importorskip("zmq")
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    d = InMemoryDirectory()
    ing = ingestor(d)
    sub = ZmqEventSubscriber(ing, f"tcp://127.0.0.1:{port}", topic="kv@pod-1")
    stop = threading.Event()
    th = threading.Thread(target=sub.run, args=(stop,), daemon=True)
    th.start()
    try:
        ev, h = stored(PROMPT)
        probe = encode_batch(0.0, [])
        deadline = time.time() + 10
        while ing.counts["batches"] == 0 and time.time() < deadline:  # PUB/SUB joins late: probe until heard
            pub.send_multipart([b"kv@pod-1", (0).to_bytes(8, "big"), probe])
            time.sleep(0.05)
        assert ing.counts["batches"] > 0
        pub.send_multipart([b"kv@pod-1", (1).to_bytes(8, "big"), encode_batch(1.0, [ev])])
        pub.send_multipart([b"kv@pod-1", b"short"])                                  # malformed: 2 parts
        pub.send_multipart([b"kv@pod-1", (2).to_bytes(8, "big"), b"\xc1garbage"])      # malformed payload
        pub.send_multipart([b"kv@pod-1", (5).to_bytes(8, "big"), encode_batch(2.0, [BlockRemoved((h[-1],), "GPU")])])  # 3, 4 missed
        pub.send_multipart([b"other-topic", (0).to_bytes(8, "big"), encode_batch(3.0, [AllBlocksCleared()])])  # filtered out
        deadline = time.time() + 10
        while ing.counts["removed_blocks"] < 1 and time.time() < deadline:
            time.sleep(0.02)
    finally:
        stop.set()
        th.join(timeout=5)
        sub.close()
        pub.close(linger=0)
    keys = list(HASHER.hash_blocks(PROMPT))
    assert d.match_prefix("acme", keys) == 3
    assert ing.counts["malformed_frames"] == 2
    assert ing.counts["missed_batches"] == 2
    assert ing.counts["cleared"] == 0


# --------------------------------------------------------------------------- adapters


class FakeRequest:
    def __init__(self, rid, tokens):
        self.request_id = rid
        self.prompt_token_ids = tokens


def controller(clock=None):
    prefill = PrefillModel(a_s=0.0, b_s_per_token=1e-4, c_s_per_token2=0.0, rms_rel_error=0.0, max_rel_error=0.0)
    return AdmissionController(LatencyModel(LinkPrior(bandwidth_bytes_per_s=25e9), prefill), clock=clock or ManualClock())


def test_vllm_connector_helper_answers_from_the_controller():
    d = InMemoryDirectory()
    prompt = list(range(50, 50 + 64 * B + 5))
    keys = list(HASHER.hash_blocks(prompt))
    d.publish("acme", [Entry(k, "pool", 2048 * B) for k in keys[:40]])
    helper = VllmConnectorPolicy(HASHER, d.index("acme"), controller(), ThresholdPublish(1), bytes_per_token=2048)
    req = FakeRequest("r1", prompt)
    n, async_load = helper.get_num_new_matched_tokens(req, num_computed_tokens=8 * B)
    assert async_load is False
    assert n % B == 0 and 0 < n <= 32 * B, "loads only remote blocks after the 8 local ones, whole blocks"
    assert helper.load_finished("r1", transfer_s=0.001) == n // B
    delay, params = helper.request_finished(req, block_ids=list(range(64)))
    assert delay is False and params == {"kvpolicy_publish_blocks": 64}
    # a failed load feeds the breaker; the leading blocks before the first failed one stay usable
    req2 = FakeRequest("r2", prompt)
    n2, _ = helper.get_num_new_matched_tokens(req2, 0)
    assert n2 > 0
    usable = helper.load_failed("r2", failed_block_ids={105}, first_block_id=100)
    assert usable == 5
    assert helper.controller.breaker("pool")._failures
    with pytest.raises(ConfigError):
        helper.load_finished("nope", transfer_s=0.1)


def test_vllm_connector_helper_recomputes_when_nothing_remote():
    helper = VllmConnectorPolicy(HASHER, InMemoryDirectory().index("acme"), controller(), PublishAll(), bytes_per_token=2048)
    assert helper.get_num_new_matched_tokens(FakeRequest("r", PROMPT), 0) == (0, False)


class TreeNode:  # the fields SGLang's radix TreeNode has
    def __init__(self, parent, t, hits=0, n=16):
        self.parent = parent
        self.last_access_time = t
        self.hit_count = hits
        self.key = list(range(n))
        self.value = list(range(n))


def test_sglang_strategy_orders_like_the_kvpolicy_policy():
    root = TreeNode(None, 0.0)
    a = TreeNode(root, 5.0, hits=3)
    b = TreeNode(a, 5.0, hits=0)      # same time, deeper: vLLM/kvpolicy evict the tail first
    c = TreeNode(root, 1.0, hits=1)
    lru = PriorityStrategy(LRUPolicy(1 << 20))
    order = sorted([a, b, c], key=lru.get_priority)
    assert order == [c, b, a]
    lfu = PriorityStrategy(LFUPolicy(1 << 20))
    assert sorted([a, b, c], key=lfu.get_priority) == [b, c, a]
    for pol in (GDSFPolicy(1 << 20), ReuseDistancePolicy(1 << 20)):
        pr = [PriorityStrategy(pol).get_priority(x) for x in (a, b, c)]
        assert all(isinstance(p, tuple) for p in pr)
    with pytest.raises(ConfigError):
        PriorityStrategy(object())  # type: ignore[arg-type]


def test_lmcache_store_policy_publishes_only_what_the_filter_allows():
    ad = StorePolicyAdapter(ThresholdPublish(2), chunk_tokens=256)
    keys = [f"chunk-{i}" for i in range(5)]
    ad.begin_request("r1", num_tokens=4 * 256 + 10)
    assert ad.select_store_targets(keys, ["LocalCPUBackend", "RemoteBackend"]) == {}
    ad.begin_request("r2", num_tokens=4 * 256 + 10)
    got = ad.select_store_targets(keys, ["LocalCPUBackend", "RemoteBackend"])
    assert got == {"LocalCPUBackend": keys[:4], "RemoteBackend": keys[:4]}, "full chunks only, prefix-closed"
    assert ad.select_delete_targets(keys, ["LocalCPUBackend"]) == {}
    with pytest.raises(ConfigError):
        StorePolicyAdapter(object())
