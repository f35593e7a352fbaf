import re
import math

import pytest
from hypothesis import example, given, settings, strategies as st

from kvpolicy.errors import ConfigError
from kvpolicy.ledger import DISTRIBUTIONS, REQUEST_CATEGORIES, Ledger, PublicationLog, RequestRecord

B = 16


@st.composite
def records(draw):
    T = draw(st.integers(0, 400))
    matchable = max(T - 1, 0) // B
    local = draw(st.integers(0, matchable))
    remote = draw(st.integers(0, matchable - local))
    not_loaded = draw(st.integers(0, matchable - local - remote))
    missing = draw(st.integers(0, matchable - local - remote - not_loaded))
    keys = tuple(bytes([draw(st.integers(0, 9))]) * 16 for _ in range(missing))
    return RequestRecord(
        prompt_tokens=T, block_size_tokens=B, local_blocks=local, remote_loaded_blocks=remote, remote_not_loaded_blocks=not_loaded,
        not_loaded_reason=draw(st.sampled_from(["declined", "incompatible", "transfer_error", "timeout"])) if not_loaded else None,
        missing_keys=keys, request_class=draw(st.sampled_from(["chat", "rag"])), arrival_s=draw(st.floats(0, 1000)),
        ttft_s=draw(st.floats(0.001, 5)), load_s=0.01 if remote else None, predicted_recompute_s=0.05 if remote else None,
        load_attempted=bool(remote or not_loaded),
    )


@example([RequestRecord(prompt_tokens=0, block_size_tokens=B, ttft_s=0.01)], set())
@given(st.lists(records(), max_size=40), st.sets(st.integers(0, 9)))
def test_ledger_counts_add_up(recs, published):
    led = Ledger(bytes_per_token=7)
    for p in published:
        led.record_write(bytes([p]) * 16, 0.0, 100.0)
    for r in recs:
        led.record(r)
    d = led.to_dict()
    assert d["total_requests"] == len(recs) == sum(d["requests"].values())
    assert d["total_tokens"] == sum(r.prompt_tokens for r in recs)
    assert sum(d["bytes"].values()) == 7 * sum(r.prompt_tokens for r in recs)
    assert d["tokens"]["local_hit"] == B * sum(r.local_blocks for r in recs)
    assert all(v >= 0 for v in d["tokens"].values()), d["tokens"]  # an empty prompt has no block to miss (nor a tail below 0)
    assert sum(led.dists[x].hists["ttft_s"].count + len(led.dists[x].buf["ttft_s"]) for x in DISTRIBUTIONS) == len(recs)
    assert set(d["requests"]) == set(REQUEST_CATEGORIES)


def test_miss_causes_are_kept_apart():
    led = Ledger(bytes_per_token=1)
    k_pub, k_ev, k_new = b"p" * 16, b"e" * 16, b"n" * 16
    led.record_write(k_ev, 1.0, 10.0, tier="ssd")
    led.record_eviction(k_ev, 5.0)
    led.record_write(k_pub, 1.0, 10.0)
    led.record(RequestRecord(prompt_tokens=5 * B + 1, block_size_tokens=B, local_blocks=1, remote_not_loaded_blocks=1, not_loaded_reason="timeout",
                             missing_keys=(k_ev, k_new), arrival_s=65.0, load_attempted=True, ttft_s=0.3))
    t = led.tokens
    assert t["local_hit"] == B and t["miss_timeout"] == B and t["miss_evicted"] == B
    assert t["miss_never_published"] == 2 * B and t["tail"] == 1
    assert led.evicted_by_tier == {"ssd": 1}
    assert led.evicted_age_s.quantile(0.5) == pytest.approx(60.0, rel=0.02)
    assert led.dists["fallback_recompute"].summary()["ttft_s"]["count"] == 1


def test_a_published_block_stranded_behind_an_evicted_one_is_an_eviction_miss_never_never_published():
    """Pool nodes shard a chain: node A evicts block 1 while node B still holds blocks 2 and 3. The run ends at
    block 1, and 2 and 3 are missed because of that eviction; they were published, so never 'never published'."""
    led = Ledger(bytes_per_token=1)
    chain = [bytes([i]) * 16 for i in range(5)]
    for k in chain[:4]:
        led.record_write(k, 1.0, 10.0, tier="pool")
    led.record_eviction(chain[1], 2.0)
    led.record(RequestRecord(prompt_tokens=5 * B + 1, block_size_tokens=B, remote_loaded_blocks=1, missing_keys=tuple(chain[1:]), arrival_s=3.0))
    t = led.tokens
    assert t["remote_hit"] == B and t["miss_evicted"] == 3 * B and t["miss_never_published"] == B and t["tail"] == 1
    assert led.evicted_by_tier == {"pool": 1} and led.stranded_blocks == 2 and led.to_dict()["stranded_blocks"] == 2
    assert "\nkvpolicy_stranded_blocks_total 2\n" in led.to_prometheus()


def test_bloom_keeps_dropped_keys_as_evicted():
    log = PublicationLog(max_exact_keys=2, bloom_bits=1 << 16)
    keys = [bytes([i]) * 16 for i in range(5)]
    for k in keys:
        log.published(k)
    assert log.dropped_keys == 3
    assert all(log.classify(k, 0.0)[0] in ("evicted", "resident") for k in keys)
    assert log.classify(b"\xff" * 16, 0.0)[0] == "never_published"


def test_bloom_hashes_the_whole_key():
    """Keys that share their first 16 bytes (a tenant or model prefix) must not share Bloom bits: the filter read only
    those bytes, so every dropped key made every key with the same prefix look evicted."""
    log = PublicationLog(max_exact_keys=2, bloom_bits=1 << 16)
    prefix = b"tenant-0042/model-7/"
    for i in range(5):
        log.published(prefix + bytes([i]) * 8)
    assert log.dropped_keys == 3
    assert [log.classify(prefix + bytes([i]) * 8, 0.0)[0] for i in range(3)] == ["evicted"] * 3
    assert [log.classify(prefix + bytes([i]) * 8, 0.0)[0] for i in range(100, 110)] == ["never_published"] * 10


@settings(max_examples=100, deadline=None)
@given(st.lists(st.one_of(st.integers(-2**63, 2**64 - 1), st.binary(max_size=24), st.text(max_size=8)), min_size=1, max_size=30, unique=True))
def test_bloom_takes_any_block_key(keys):
    """Engines' block keys are ints as often as bytes (64-bit hashes; the simulator's block ids). A key dropped from
    the exact table goes to the Bloom filter; an int went through ``bytes(n)`` — n zero bytes: a MemoryError for a
    64-bit hash, a ValueError for a negative one. No false negatives: every key published is still known."""
    log = PublicationLog(max_exact_keys=1, bloom_bits=1 << 12)
    for k in keys:
        log.published(k, size_bytes=1.0)
    assert log.dropped_keys == len(keys) - 1
    assert all(log.classify(k, 0.0)[0] in ("evicted", "resident") for k in keys)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["w", "r"]), st.integers(0, 5), st.sampled_from(["a", "b"]), st.integers(1, 9)), max_size=40),
       st.integers(1, 4))
def test_unread_write_bytes_against_the_history(events, cap):
    """A write is unread unless its key is read while the write is still held: before the key is written again and
    before ``cap`` other keys were written after it. Computed here from the whole event history; the log keeps at
    most ``cap`` writes and only their reads."""
    log = PublicationLog(max_exact_keys=cap, bloom_bits=1 << 10)
    for op, k, cls, size in events:
        key = bytes([k]) * 8
        if op == "w":
            log.published(key, size_bytes=size, request_class=cls)
        else:
            log.read(key)
        assert len(log._written) <= cap and log._reads <= set(log._written)
    want: dict[str, float] = {}
    for i, (op, k, cls, size) in enumerate(events):
        if op != "w":
            continue
        read = False
        others: set[int] = set()
        for op2, k2, _, _ in events[i + 1:]:
            if op2 == "w" and k2 == k:
                break  # superseded
            if op2 == "w":
                others.add(k2)
                if len(others) >= cap:
                    break  # fell out of the newest cap writes
            elif k2 == k:
                read = True
                break
        if not read:
            want[cls] = want.get(cls, 0.0) + size
    got = log.unread_write_bytes()
    assert {c: v for c, v in got.items() if v} == {c: v for c, v in want.items() if v}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 30), st.floats(-4.9, 0), st.integers(0, 9)), max_size=80), st.floats(0.5, 6))
def test_flow_peak_is_exact_while_it_stays_bounded(steps, window):
    """A flow that settles its old windows every few events (limit 4, lag 5 s) reports the same total and worst
    window as the brute force over every event, for records up to 4.9 s late, while it drops what it settled."""
    from kvpolicy.ledger import _Flow

    f = _Flow(window)
    f.LAG_S, f.MAX_EVENTS, f._limit = 5.0, 4, 4
    events, now = [], 0.0
    for gap, late, nbytes in steps:
        now += gap / 10
        t = max(now + late, 0.0)
        f.add(t, float(nbytes))
        events.append((t, float(nbytes)))
        assert len(f.t) <= f._limit
    peak = max((sum(b for t2, b in events if t <= t2 < t + window) for t, _ in events), default=0.0) / window
    assert f.total == pytest.approx(sum(b for _, b in events))
    assert f.peak_bytes_per_s() == pytest.approx(peak)
    if len(events) == 80 and events[-1][0] > 20:
        assert f._dropped or len(f.t) <= 4


def test_clear_flow_forgets_one_flow_and_its_share_of_the_total():
    led = Ledger(bytes_per_token=1, window_s=10.0)
    led.record_write(b"k" * 16, 1.0, 100.0)
    led.record_replication(2.0, 40.0)
    led.clear_flow("write")
    flows = led.to_dict()["flows"]
    assert flows["write"]["bytes"] == 0 and flows["replica"]["bytes"] == 40.0 and flows["total"]["bytes"] == 40.0
    assert flows["total"]["peak_window_bytes_per_s"] == pytest.approx(4.0)
    with pytest.raises(ConfigError, match="kind"):
        led.clear_flow("writes")


def test_expected_benefit_reports_unknown_terms():
    led = Ledger(bytes_per_token=1)
    for t in (0.0, 10.0):
        led.record(RequestRecord(prompt_tokens=10 * B + 1, block_size_tokens=B, remote_loaded_blocks=10, load_s=0.1, predicted_recompute_s=0.5, arrival_s=t, request_class="chat", stall_s=0.01))
    eb = led.expected_benefit()
    assert eb["e_benefit_s_per_s"] is None and "p_write_s" in eb["unknown"]
    led2 = Ledger(bytes_per_token=1, write_cost_s_per_byte=1e-9, eviction_cost_s_per_token=1e-6)
    for t in (0.0, 10.0):
        led2.record(RequestRecord(prompt_tokens=10 * B + 1, block_size_tokens=B, remote_loaded_blocks=10, load_s=0.1, predicted_recompute_s=0.5, arrival_s=t, request_class="chat", stall_s=0.01))
    eb2 = led2.expected_benefit()
    c = eb2["per_class"]["chat"]
    assert c["e_benefit_s"] == pytest.approx(1.0 * 0.4 - 0.01)
    assert eb2["e_benefit_s_per_s"] == pytest.approx(c["e_benefit_s"] * 2 / 10)


def test_a_class_without_remote_hits_has_a_benefit_of_its_costs_alone():
    """With no remote hit there is nothing to save, so the saved term is not unknown: E[benefit] is − P_stall − P_write −
    P_eviction. A cost that is unknown still leaves it unknown, and is named (a mutant that counted the missing saved
    term as unknown whatever the hits, and let the other terms through, lived)."""
    led = Ledger(bytes_per_token=1, write_cost_s_per_byte=0.0, eviction_cost_s_per_token=0.0)
    for t in (0.0, 10.0):
        led.record(RequestRecord(prompt_tokens=4 * B + 1, block_size_tokens=B, local_blocks=2, arrival_s=t, stall_s=0.02))
    eb = led.expected_benefit()
    c = eb["per_class"]["default"]
    assert c["h_remote"] == 0.0 and c["recompute_minus_remote_s"] is None and c["unknown"] == []
    assert c["e_benefit_s"] == pytest.approx(-0.02) and eb["e_benefit_s_per_s"] == pytest.approx(-0.02 * 2 / 10)
    no_stall = Ledger(bytes_per_token=1, write_cost_s_per_byte=0.0, eviction_cost_s_per_token=0.0)
    for t in (0.0, 10.0):
        no_stall.record(RequestRecord(prompt_tokens=4 * B + 1, block_size_tokens=B, local_blocks=2, arrival_s=t))
    eb = no_stall.expected_benefit()
    assert eb["per_class"]["default"]["e_benefit_s"] is None and eb["unknown"] == ["p_stall_s"]


def test_the_bloom_filter_answers_at_the_rate_its_size_promises():
    """Keys that fell out of the exact table go to a Bloom filter of m bits with four probes per key: a key never
    published is taken for a dropped one at about (1 − e^(−4n/m))^4 (0.11 % at n/m = 0.05). Measured over 100,000 keys
    never published, it stays under 1.5× that (a probe masked to one bit, or any probe that does not spread over the
    filter, about doubles it); and every dropped key is still known (no false negative)."""
    m, n = 1 << 14, 820
    log = PublicationLog(max_exact_keys=1, bloom_bits=m)
    for i in range(n + 1):
        log.published(("pub", i), size_bytes=1.0)
    assert log.dropped_keys == n
    assert all(log.classify(("pub", i), 0.0)[0] == "evicted" for i in range(n))
    probes = 100_000
    false = sum(log.classify(("never", i), 0.0)[0] != "never_published" for i in range(probes))
    promised = (1 - math.exp(-4 * n / m)) ** 4
    assert false / probes < 1.5 * promised, (false, promised * probes)


def test_byte_flows_and_peak_window():
    led = Ledger(bytes_per_token=10, window_s=100.0)
    led.record_write(b"a" * 16, 0.0, 1000.0)
    led.record_replication(50.0, 500.0)
    led.record(RequestRecord(prompt_tokens=2 * B + 1, block_size_tokens=B, remote_loaded_blocks=2, arrival_s=300.0))
    f = led.to_dict()["flows"]
    assert f["write"]["bytes"] == 1000 and f["replica"]["bytes"] == 500 and f["read"]["bytes"] == 2 * B * 10
    assert f["total"]["bytes"] == 1000 + 500 + 320
    assert f["total"]["peak_window_bytes_per_s"] == pytest.approx(1500 / 100)
    text = led.to_prometheus()  # a scraper sees each flow under its own label
    for flow, nbytes in (("read", 320), ("write", 1000), ("replica", 500), ("total", 1820)):
        assert f'\nkvpolicy_flow_bytes_total{{flow="{flow}"}} {nbytes}.0\n' in text
    assert '\nkvpolicy_flow_peak_window_bytes_per_second{flow="total"} 15.0\n' in text


@pytest.mark.parametrize("name", ["ttft_s", "prefill_s", "load_s", "queue_s", "predicted_recompute_s", "stall_s"])
def test_every_time_a_record_carries_is_checked_whatever_comes_before_it(name):
    """Each time field is refused by name when it is not a finite number of seconds >= 0 — the last ones too, after
    fields that are fine (a check that stopped at the first good field let a NaN queue time into the distributions)."""
    fine = dict(ttft_s=0.05, prefill_s=0.04, load_s=0.01, queue_s=0.0, predicted_recompute_s=0.03, stall_s=0.0)
    RequestRecord(prompt_tokens=3 * B, block_size_tokens=B, local_blocks=1, **fine)
    for bad in (float("nan"), -1.0, math.inf):
        with pytest.raises(ConfigError, match=name):
            RequestRecord(prompt_tokens=3 * B, block_size_tokens=B, local_blocks=1, **{**fine, name: bad})


_LINE = re.compile(r'^[a-zA-Z_:][a-zA-Z0-9_:]*(\{([a-zA-Z_][a-zA-Z0-9_]*="[^"]*")(,[a-zA-Z_][a-zA-Z0-9_]*="[^"]*")*\})? (-?[0-9.e+-]+|[+-]Inf|NaN)$')


def test_prometheus_exposition_parses():
    led = Ledger(bytes_per_token=2)
    led.record(RequestRecord(prompt_tokens=3 * B, block_size_tokens=B, local_blocks=2, ttft_s=0.05, prefill_s=0.04))
    text = led.to_prometheus()
    types = {}
    for line in text.strip().splitlines():
        if line.startswith("# HELP"):
            continue
        if line.startswith("# TYPE"):
            _, _, name, kind = line.split()
            types[name] = kind
            continue
        assert _LINE.match(line), line
        name = line.split("{")[0].split(" ")[0]
        base = re.sub(r"_(sum|count)$", "", name)
        assert name in types or base in types, line
    assert 'kvpolicy_requests_total{category="local_hit"} 1' in text
    # the token and byte counters are labelled by category too (2 local blocks of 16 tokens, 2 bytes a token)
    assert '\nkvpolicy_prompt_tokens_total{category="local_hit"} 32\n' in text
    assert '\nkvpolicy_prompt_bytes_total{category="local_hit"} 64\n' in text
    assert 'kvpolicy_ttft_seconds{distribution="local_hit",quantile="0.5"}' in text
    # a summary carries its _sum and _count per distribution (a scraper's rate of the mean needs both)
    assert 'kvpolicy_ttft_seconds_sum{distribution="local_hit"} 0.05\n' in text
    assert 'kvpolicy_ttft_seconds_count{distribution="local_hit"} 1\n' in text
    assert 'kvpolicy_ttft_seconds_count{distribution="cold_prefill"} 0\n' in text


def test_record_validation():
    with pytest.raises(ConfigError, match="local_blocks"):
        RequestRecord(prompt_tokens=2 * B, block_size_tokens=B, local_blocks=2)  # only 1 matchable block
    with pytest.raises(ConfigError, match="not_loaded_reason"):
        RequestRecord(prompt_tokens=5 * B, block_size_tokens=B, remote_not_loaded_blocks=1)
    with pytest.raises(ConfigError, match="bytes_per_token"):
        Ledger(bytes_per_token=0)
    led = Ledger(bytes_per_token=2)
    for bad in (float("nan"), -1.0, "3"):  # a NaN eviction time made the age of every later miss on that key NaN
        with pytest.raises(ConfigError, match="t_s"):
            led.record_eviction(b"k" * 16, bad)


@given(st.integers(1, 12), st.data())
def test_a_miss_is_never_published_exactly_when_the_block_never_was(n, data):
    """Prefix-closed publishing, any evictions and re-publications, some of them only after the request arrived:
    of the blocks after the reused run, those published before the request count as eviction misses (evicted
    themselves, or still listed resident but past the end of the run: stranded), the rest as never published."""
    arrival_s = 10.0
    chain = [bytes([i + 1]) * 16 for i in range(n)]
    published = data.draw(st.integers(0, n), label="published")  # chain[:published] went to the shared tier ...
    late = data.draw(st.integers(0, published), label="late")  # ... chain[late:published] only after the request arrived
    evicted = data.draw(st.sets(st.integers(0, max(late - 1, 0)), max_size=late), label="evicted")
    republished = data.draw(st.sets(st.sampled_from(sorted(evicted)), max_size=len(evicted)) if evicted else st.just(set()), label="again")
    led = Ledger(bytes_per_token=1)
    for i in range(published):
        led.record_write(chain[i], 1.0 if i < late else arrival_s + 1.0, 16.0)
    for i in evicted:
        led.record_eviction(chain[i], 2.0)
    for i in republished:  # back in the tier after the request: it was evicted when the request looked
        led.record_write(chain[i], arrival_s + 2.0, 16.0)
    # the run ends at the first block not resident when the request looked (or earlier: it may have reused fewer)
    first_gone = min([i for i in range(n) if i >= late or i in evicted], default=n)
    reused = data.draw(st.integers(0, first_gone), label="reused")
    led.record(RequestRecord(prompt_tokens=n * B + 1, block_size_tokens=B, remote_loaded_blocks=reused,
                             missing_keys=tuple(chain[reused:]), arrival_s=arrival_s))
    t = led.tokens
    assert t["miss_never_published"] == B * (n - max(late, reused))
    assert t["miss_evicted"] == B * max(late - reused, 0)
    assert led.stranded_blocks == sum(1 for i in range(reused, late) if i not in evicted or i in republished)


@pytest.mark.parametrize("field, value", [("prompt_tokens", float("nan")), ("block_size_tokens", 1.5), ("local_blocks", float("nan")),
                                          ("remote_loaded_blocks", 2.0), ("split_blocks", float("nan")), ("request_class", 7),
                                          ("arrival_s", float("nan")), ("load_attempted", "yes"), ("missing_keys", "k")])
def test_a_request_record_that_cannot_be_is_refused(field, value):
    """A NaN count passed every comparison of the checks (NaN < 0 is false) and reached the ledger's token sums."""
    kw = {"prompt_tokens": 64, "block_size_tokens": 16, "local_blocks": 1, "remote_loaded_blocks": 1, field: value}
    with pytest.raises(ConfigError, match=field):
        RequestRecord(**kw)


@pytest.mark.parametrize("call, field", [
    (lambda: Ledger(1024, write_cost_s_per_byte=float("nan")), "write_cost_s_per_byte"),
    (lambda: Ledger(1024, eviction_cost_s_per_token=-1e-6), "eviction_cost_s_per_token"),
    (lambda: Ledger(1024, eviction_cost_s_per_token="1e-6"), "eviction_cost_s_per_token"),
    (lambda: PublicationLog(max_exact_keys=1.5), "max_exact_keys"),
    (lambda: PublicationLog(bloom_bits=8), "bloom_bits"),
    (lambda: PublicationLog().published(b"k", t_s=float("nan")), "t_s"),
    (lambda: PublicationLog().published(b"k", t_s=1.0, size_bytes=float("nan")), "size_bytes"),
    (lambda: PublicationLog().published(b"k", t_s=1.0, size_bytes=-4096.0), "size_bytes"),
    (lambda: PublicationLog().evicted(b"k", t_s=float("inf")), "t_s"),
    (lambda: PublicationLog().classify(b"k", now_s=None), "now_s"),
])
def test_the_publication_log_and_the_ledgers_costs_refuse_numbers_that_cannot_be(call, field):
    """A NaN write cost made E[benefit] NaN; a NaN write size, the class's written bytes (and its Prometheus line); a
    NaN publication time, every later miss's class — each without a word. A log of 1.5 exact keys was taken."""
    with pytest.raises(ConfigError, match=field):
        call()


def test_unknown_costs_stay_unknown():
    led = Ledger(1024, write_cost_s_per_byte=None, eviction_cost_s_per_token=0.0)
    assert led.write_cost_s_per_byte is None and led.eviction_cost_s_per_token == 0.0


def test_p_write_prices_each_unread_write_at_its_paths_congestion():
    """Issue #58: P_write charged every unread byte one fixed link-second rate, so the set that wrote most ranked last
    even where its writes crossed idle links. Each write now carries its shadow price (ρ/(1 − ρ) of its path when
    written; None: the whole link time): an unread write on an idle link costs nothing, one at 3x congestion three
    times its link time, and a read takes its charge back."""
    led = Ledger(bytes_per_token=1, write_cost_s_per_byte=1e-9, eviction_cost_s_per_token=0.0)
    led.record_write("idle", 0.0, 1e9, congestion=0.0)
    led.record_write("busy", 1.0, 1e9, congestion=3.0)
    led.record_write("unknown", 2.0, 1e9)
    led.record_write("read", 3.0, 1e9, congestion=5.0)
    led.record_read("read")
    assert led.pub.unread_write_bytes() == {"default": 3e9}
    assert led.pub.unread_write_bytes(priced=True) == {"default": pytest.approx(4e9)}
    for t in (0.0, 10.0):
        led.record(RequestRecord(prompt_tokens=10 * B + 1, block_size_tokens=B, arrival_s=t))
    c = led.expected_benefit()["per_class"]["default"]
    assert c["p_write_s"] == pytest.approx(4e9 * 1e-9 / 2)
    with pytest.raises(ConfigError) as e:
        led.record_write("x", 4.0, 1.0, congestion=-1.0)
    assert e.value.field == "congestion"


def test_saved_and_evicted_gpu_seconds_are_priced_by_the_prefill_queue():
    """Issue #58: a GPU second saved by a remote hit, or lost to an eviction, is worth 1/(1 − ρ) seconds of latency on a
    replica whose prefill slots are busy ρ of the time (the queue it shortens or lengthens) — the price dueling uses.
    At ρ = 0.5 both terms double; unknown ρ leaves them in GPU seconds."""
    def benefit(rho):
        led = Ledger(bytes_per_token=1, write_cost_s_per_byte=0.0, eviction_cost_s_per_token=0.001)
        led.record_write(b"k2", 0.0, 1.0)
        led.record_eviction(b"k2", 0.5)
        led.record(RequestRecord(prompt_tokens=4 * B + 1, block_size_tokens=B, remote_loaded_blocks=2, predicted_recompute_s=0.3,
                                 load_s=0.1, arrival_s=1.0, stall_s=0.0, prefill_utilisation=rho))
        led.record(RequestRecord(prompt_tokens=4 * B + 1, block_size_tokens=B, local_blocks=1, missing_keys=(b"k2",), arrival_s=2.0,
                                 stall_s=0.0, prefill_utilisation=rho))
        return led.expected_benefit()["per_class"]["default"]

    plain, busy = benefit(None), benefit(0.5)
    assert plain["recompute_minus_remote_s"] == pytest.approx(0.2) and busy["recompute_minus_remote_s"] == pytest.approx(0.4)
    assert plain["p_eviction_s"] > 0 and busy["p_eviction_s"] == pytest.approx(2 * plain["p_eviction_s"])
    with pytest.raises(ConfigError) as e:
        RequestRecord(prompt_tokens=10, block_size_tokens=B, prefill_utilisation=1.5)
    assert e.value.field == "prefill_utilisation"


def test_a_set_that_saves_more_is_not_priced_below_one_that_stays_congested():
    """Issue #58, the ledger's ranking: a GPU second saved is priced by the mean of 1/(1 − ρ) over the utilisations the
    hits moved the replica through (``prefill_utilisation_without_hits``), not at the end point alone. A set that
    escapes congestion by saving a lot (ρ 0.5 instead of 1.3) saves more latency than one that saves little and stays
    at the cap (ρ 0.99 instead of 1.0); priced at the end point, the congested one ranked first."""
    def eb(hits, rho, rho_without):
        led = Ledger(bytes_per_token=1, write_cost_s_per_byte=0.0, eviction_cost_s_per_token=0.0)
        for i in range(10):
            loaded = 2 if i < hits else 0
            led.record(RequestRecord(prompt_tokens=4 * B + 1, block_size_tokens=B, remote_loaded_blocks=loaded,
                                     predicted_recompute_s=0.3 if loaded else None, load_s=0.1 if loaded else None,
                                     arrival_s=float(i), stall_s=0.0, prefill_utilisation=rho, prefill_utilisation_without_hits=rho_without))
        return led.expected_benefit()["e_benefit_s_per_s"]

    saver, congested = eb(8, 0.5, 1.3), eb(1, 0.99, 1.0)
    assert saver > congested
    assert eb(8, 0.5, None) < eb(1, 0.99, None), "at the end point's price the congested set ranks first"
    # no shift: the marginal price; a shift within the cap's region: the cap's price
    assert eb(8, 0.5, 0.5) == pytest.approx(eb(8, 0.5, None))
    assert eb(8, 0.995, 1.2) == pytest.approx(eb(8, 0.99, None))


@given(a=st.floats(0, 1), b=st.floats(0, 3), c=st.floats(0, 3))
def test_the_mean_gpu_price_is_the_mean_of_the_marginal_price(a, b, c):
    """mean_gpu_price(a, b) × (b − a) is the integral of gpu_price from a to b: it lies between the prices at the two
    ends (the price grows with ρ), it adds up over adjoining intervals, and a zero-width interval is the marginal price."""
    from kvpolicy.prices import gpu_price, mean_gpu_price

    lo, hi = sorted((gpu_price(a), gpu_price(min(b, 1.0))))
    m = mean_gpu_price(a, b)
    assert lo * (1 - 1e-9) <= m <= hi * (1 + 1e-9)
    assert mean_gpu_price(b, a) == pytest.approx(m)
    if abs(b - a) > 1e-6 and abs(c - b) > 1e-6 and abs(c - a) > 1e-6:
        assert mean_gpu_price(a, b) * (b - a) + mean_gpu_price(b, c) * (c - b) == pytest.approx(mean_gpu_price(a, c) * (c - a), rel=1e-6, abs=1e-9)
    assert mean_gpu_price(a, a) == gpu_price(a)
    assert mean_gpu_price(0.0, 0.5) == pytest.approx(2 * math.log(2))  # ∫₀^½ dx/(1 − x) / ½


@pytest.mark.parametrize("bad", [-0.1, math.nan, math.inf, True, "0.5"])
def test_the_utilisation_without_hits_is_checked(bad):
    with pytest.raises(ConfigError) as e:
        RequestRecord(prompt_tokens=10, block_size_tokens=B, prefill_utilisation=0.5, prefill_utilisation_without_hits=bad)
    assert e.value.field == "prefill_utilisation_without_hits"
    with pytest.raises(ConfigError, match="needs prefill_utilisation") as e:
        RequestRecord(prompt_tokens=10, block_size_tokens=B, prefill_utilisation_without_hits=0.5)


def test_an_idle_replica_with_no_hits_is_a_utilisation_of_zero_and_a_hit_without_a_load_time_saves_nothing_known():
    """The counterfactual's floor is 0, not excluded (an idle replica that loaded nothing); and a remote hit whose load
    time the engine did not report is a hit (h_remote) without a saving to price — never a saving computed from None."""
    RequestRecord(prompt_tokens=10, block_size_tokens=B, prefill_utilisation=0.0, prefill_utilisation_without_hits=0.0)
    led = Ledger(bytes_per_token=1, write_cost_s_per_byte=0.0, eviction_cost_s_per_token=0.0)
    led.record(RequestRecord(prompt_tokens=4 * B + 1, block_size_tokens=B, remote_loaded_blocks=2, predicted_recompute_s=0.3,
                             load_s=None, arrival_s=1.0, stall_s=0.0, prefill_utilisation=0.5, prefill_utilisation_without_hits=0.7))
    c = led.expected_benefit()["per_class"]["default"]
    assert c["h_remote"] == 1.0 and c["recompute_minus_remote_s"] is None
