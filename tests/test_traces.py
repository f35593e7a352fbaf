import json

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kvpolicy.errors import ConfigError, TraceFormatError
from kvpolicy.traces import (
    Trace,
    detect_format,
    first_appearance_ids,
    generate,
    preset,
    read_bailian,
    read_mooncake,
    read_tokens_jsonl,
    read_trace,
    write_tokens_jsonl,
)


def write_lines(path, objs):
    path.write_text("".join((o if isinstance(o, str) else json.dumps(o)) + "\n" for o in objs))
    return path


def mc(ts, inp, ids, out=10):
    return {"timestamp": ts, "input_length": inp, "output_length": out, "hash_ids": ids}


def test_mooncake_partial_block_kept_apart(tmp_path):
    p = write_lines(tmp_path / "t.jsonl", [mc(0, 1100, [7, 8, 9]), mc(1000, 1024, [7, 8]), mc(2000, 100, [5])])
    tr = read_mooncake(p)
    assert len(tr) == 3 and tr.block_size_tokens == 512
    assert tr.full_blocks.tolist() == [2, 2, 0]
    assert tr.blocks(0).tolist() == [0, 1] and tr.blocks(1).tolist() == [0, 1]
    assert tr.partial_block_ids[0] >= 0 and tr.partial_block_ids[1] == -1 and tr.partial_block_ids[2] >= 0
    assert tr.arrival_s.tolist() == [0.0, 1.0, 2.0]
    # 1024 tokens = 2 full blocks, but the last token is recomputed: only block 0 is matchable
    assert tr.matchable_blocks.tolist() == [2, 1, 0]


@pytest.mark.parametrize(
    "line, what",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "JSON object"),
        (json.dumps({"timestamp": 0, "input_length": 10, "hash_ids": [1]}), "output_length"),
        (json.dumps(mc(0, -5, [])), "negative"),
        (json.dumps(mc(0, 1100, [1, 2])), r"needs ceil\(1100/512\) = 3"),
        (json.dumps(mc(0, 10, [-1])), r"hash_ids\[0\]"),
        (json.dumps(mc(0, 10, "abc")), "must be a list"),
        (json.dumps(mc("soon", 10, [1])), "timestamp"),
        (json.dumps(mc(0, 10.5, [1])), "input_length"),
        # integers past int64 are bad lines, not an OverflowError from numpy (or from float()) after the read
        (json.dumps(mc(0, 10, [2**63])), r"hash_ids\[0\] must be an integer in \[0, 2\*\*63\)"),
        (json.dumps({**mc(0, 10, [1]), "output_length": 10**23}), "'output_length' is too large"),
        ('{"timestamp": 1' + "0" * 400 + ', "input_length": 10, "output_length": 1, "hash_ids": [1]}', "'timestamp' must be a finite number"),
        ('{"timestamp": NaN, "input_length": 10, "output_length": 1, "hash_ids": [1]}', "'timestamp' must be a finite number"),
        # an id repeated in its own chain is a cycle: the replay kernels' leaf-first eviction never ended on one
        (json.dumps(mc(0, 1024, [2, 2])), r"hash_ids\[1\]: block id 2 follows id 2, but nothing \(it starts the request\) at line 2, hash_ids\[0\]; block ids must be chained"),
    ],
)
def test_mooncake_malformed_lines_name_file_and_line(tmp_path, line, what):
    p = write_lines(tmp_path / "t.jsonl", [mc(0, 10, [1]), line])
    with pytest.raises(TraceFormatError, match=what) as exc:
        read_mooncake(p)
    assert exc.value.line == 2 and str(p) in str(exc.value) and f"{p}:2" in str(exc.value)


def test_time_backwards_and_sort(tmp_path):
    p = write_lines(tmp_path / "t.jsonl", [mc(5000, 600, [1, 2]), mc(1000, 600, [1, 3])])
    with pytest.raises(TraceFormatError, match="backwards") as exc:
        read_mooncake(p)
    assert exc.value.line == 2
    tr = read_mooncake(p, sort=True)
    assert tr.arrival_s.tolist() == [1.0, 5.0]
    assert tr.partial_block_ids.tolist() == [1, 2]  # renumbered by first appearance after sorting


def test_skip_bad_lines_counts_and_reports(tmp_path):
    p = write_lines(tmp_path / "t.jsonl", [mc(0, 10, [1]), "garbage", mc(1, 10, [2, 3]), mc(2, 10, [4])])
    tr = read_mooncake(p, skip_bad_lines=True)
    assert len(tr) == 2 and tr.skipped_lines == (2, 3)
    empty = write_lines(tmp_path / "e.jsonl", ["garbage"])
    with pytest.raises(TraceFormatError, match="1 bad lines skipped"):
        read_mooncake(empty, skip_bad_lines=True)


def test_missing_file_and_empty(tmp_path):
    with pytest.raises(TraceFormatError, match="no such file"):
        read_trace(tmp_path / "nope.jsonl")
    (tmp_path / "e.jsonl").write_text("\n\n")
    with pytest.raises(TraceFormatError, match="empty"):
        read_trace(tmp_path / "e.jsonl")


def test_bailian_chains_content_ids(tmp_path):
    rows = [
        {"chat_id": 1, "parent_chat_id": -1, "timestamp": 0.0, "input_length": 40, "output_length": 5, "type": "text", "turn": 1, "hash_ids": [10, 11, 12]},
        # same content ids in another order: content-equal blocks, different prefixes
        {"chat_id": 2, "parent_chat_id": -1, "timestamp": 1.0, "input_length": 48, "output_length": 5, "type": "text", "turn": 1, "hash_ids": [11, 10, 12]},
        {"chat_id": 3, "parent_chat_id": 1, "timestamp": 2.0, "input_length": 64, "output_length": 5, "type": "text", "turn": 2, "hash_ids": [10, 11, 12, 13]},
    ]
    tr = read_bailian(write_lines(tmp_path / "b.jsonl", rows))
    assert tr.block_size_tokens == 16
    a, b, c = tr.blocks(0).tolist(), tr.blocks(1).tolist(), tr.blocks(2).tolist()
    assert len(a) == 2 and len(b) == 3 and len(c) == 4
    assert not set(a) & set(b)  # 10→11 and 11→10 are different prefixes
    assert c[:2] == a  # turn 2 extends turn 1
    assert tr.session[0] == tr.session[2] != tr.session[1]
    assert tr.class_names == ("text",)
    assert detect_format(tmp_path / "b.jsonl") == "bailian"


def test_tokens_jsonl_tenants_never_share(tmp_path):
    shared = list(range(40))
    rows = [
        {"timestamp": 0, "tokens": shared + [1, 2], "tenant": "a", "request_id": "r1"},
        {"timestamp": 1, "tokens": shared + [3], "tenant": "a", "request_id": "r2"},
        {"timestamp": 2, "tokens": shared + [3], "tenant": "b", "request_id": "r3"},
    ]
    tr = read_tokens_jsonl(write_lines(tmp_path / "t.jsonl", rows), block_size_tokens=16)
    assert tr.blocks(0).tolist() == tr.blocks(1).tolist()
    assert not set(tr.blocks(0).tolist()) & set(tr.blocks(2).tolist())
    assert tr.request_ids == ("r1", "r2", "r3")
    assert tr.prompt(1).tolist() == shared + [3]
    assert detect_format(tmp_path / "t.jsonl") == "tokens"
    bad = write_lines(tmp_path / "bad.jsonl", [{"tokens": [1, -2]}])
    with pytest.raises(TraceFormatError, match=r"tokens\[1\]"):
        read_tokens_jsonl(bad)


def test_unknown_format(tmp_path):
    p = write_lines(tmp_path / "x.jsonl", [{"foo": 1}])
    with pytest.raises(TraceFormatError, match="unknown trace format"):
        read_trace(p)
    with pytest.raises(ConfigError, match="format"):
        read_trace(p, format="csv")  # type: ignore[arg-type]


@settings(max_examples=15)
@given(seed=st.integers(0, 10_000))
def test_generator_mooncake_round_trip(tmp_path_factory, seed):
    tr = generate(preset("mixed", n_requests=40, seed=seed, block_size_tokens=32))
    p = tmp_path_factory.mktemp("rt") / "t.jsonl"
    tr.to_mooncake_jsonl(p)
    back = read_mooncake(p, block_size_tokens=32)
    assert np.array_equal(back.block_ids, tr.block_ids)
    assert np.array_equal(back.partial_block_ids, tr.partial_block_ids)
    assert np.array_equal(back.input_tokens, tr.input_tokens)
    assert np.allclose(back.arrival_s, np.round(tr.arrival_s * 1000) / 1000)


def test_generator_is_deterministic_and_seeded():
    a = generate(preset("chat", n_requests=200, seed=3))
    b = generate(preset("chat", n_requests=200, seed=3))
    c = generate(preset("chat", n_requests=200, seed=4))
    assert np.array_equal(a.block_ids, b.block_ids) and np.array_equal(a.arrival_s, b.arrival_s)
    assert not np.array_equal(a.input_tokens, c.input_tokens)


@pytest.mark.parametrize("name", ["chat", "rag", "agent", "mixed"])
def test_presets_have_reuse_and_structure(name):
    tr = generate(preset(name, n_requests=300))
    assert len(tr) == 300
    assert np.all(tr.publish_boundary_tokens <= tr.input_tokens)
    assert tr.tenant is not None and tr.request_class is not None
    # something is reused, and no tenant ever shares a block with another
    assert np.unique(tr.block_ids).size < tr.block_ids.size
    owner = {}
    for i in range(len(tr)):
        for b in tr.blocks(i).tolist():
            assert owner.setdefault(b, int(tr.tenant[i])) == int(tr.tenant[i])


def test_token_jsonl_round_trip_keeps_structure(tmp_path):
    tr = generate(preset("agent", n_requests=60, block_size_tokens=16), keep_tokens=True)
    p = tmp_path / "tok.jsonl"
    write_tokens_jsonl(tr, p)
    back = read_tokens_jsonl(p, block_size_tokens=16)
    assert np.array_equal(back.block_ids, tr.block_ids)
    assert np.array_equal(back.input_tokens, tr.input_tokens)
    assert np.array_equal(back.tokens, tr.tokens)


@given(st.lists(st.integers(-5, 10**12), max_size=50))
def test_first_appearance_ids(ids):
    arr = np.asarray(ids, dtype=np.int64)
    out = first_appearance_ids(arr)
    seen = {}
    want = [seen.setdefault(x, len(seen)) for x in ids]
    assert out.tolist() == want


def test_mooncake_ids_must_be_chained(tmp_path):
    # line 2 puts 8 after 9 where line 1 put it after 7: an id that stands for two prefixes; named with both lines
    p = write_lines(tmp_path / "t.jsonl", [mc(0, 1536, [7, 8, 9]), mc(1, 1024, [9, 8]), mc(2, 1024, [9, 4])])
    with pytest.raises(TraceFormatError, match=r"hash_ids\[0\]: block id 9 follows nothing .* but id 8 at line 1, hash_ids\[2\]") as exc:
        read_mooncake(p)
    assert exc.value.line == 2
    # --skip-bad-lines drops the line, and a dropped line teaches nothing: line 3's root 6 does not clash with the
    # 6-after-5 of the rejected line 2
    p = write_lines(tmp_path / "u.jsonl", [mc(0, 1024, [1, 2]), mc(1, 1536, [5, 6, 5]), mc(2, 1024, [6, 3]), mc(3, 1024, [1, 2])])
    tr = read_mooncake(p, skip_bad_lines=True)
    assert tr.skipped_lines == (2,) and len(tr) == 3
    # a partial block is never keyed, so its id is free: 9 ends line 1 partly and starts line 2 as a full block
    tr = read_mooncake(write_lines(tmp_path / "v.jsonl", [mc(0, 1100, [7, 8, 9]), mc(1, 600, [9, 3])]))
    assert tr.full_blocks.tolist() == [2, 1]


def _walk(chains):
    """Reference for chain_check: walk the requests in order, remembering each id's first predecessor and where;
    a request that contradicts one is bad and forgets its own first sightings."""
    first, bad, conflict = {}, [], None
    for r, chain in enumerate(chains):
        mine = {}
        for j, h in enumerate(chain):
            pred = chain[j - 1] if j else -1
            seen = first.get(h, mine.get(h))
            if seen is None:
                mine[h] = (pred, r, j)
            elif seen[0] != pred:
                bad.append(r)
                conflict = conflict or (h, r, j, pred, seen[1], seen[2], seen[0])
                break
        else:
            first.update(mine)
    return bad, conflict


@settings(max_examples=300)
@given(st.lists(st.lists(st.integers(0, 6), max_size=5), max_size=8), st.booleans())
def test_chain_check_matches_a_walk(chains, sparse):
    from kvpolicy.traces import chain_check, chain_conflict

    off = np.zeros(len(chains) + 1, dtype=np.int64)
    np.cumsum([len(c) for c in chains], out=off[1:])
    scale = 10**15 if sparse else 1  # sparse ids take the remap path, dense ones the table: both must agree with the walk
    ids = np.asarray([h * scale for c in chains for h in c], dtype=np.int64)
    bad, want = _walk([[h * scale for h in c] for c in chains])
    got_bad, got = chain_check(off, ids, all_bad=True)
    assert got_bad.tolist() == bad
    for c in (got, chain_conflict(off, ids)):
        assert (None if c is None else (c.block_id, c.request, c.position, c.predecessor, c.first_request, c.first_position,
                                        c.first_predecessor)) == want


def test_trace_validation():
    ok = dict(arrival_s=[0.0], input_tokens=[10], output_tokens=[1], block_offsets=[0, 0], block_ids=[], partial_block_ids=[0], block_size_tokens=16)
    Trace(**ok)
    with pytest.raises(ConfigError, match="partial_block_ids"):
        Trace(**{**ok, "partial_block_ids": [-1]})
    with pytest.raises(ConfigError, match="block_ids"):
        Trace(**{**ok, "input_tokens": [40]})
    with pytest.raises(ConfigError, match="arrival_s"):
        Trace(**{**ok, "arrival_s": [1.0, 0.0], "input_tokens": [10, 10], "output_tokens": [1, 1], "block_offsets": [0, 0, 0], "partial_block_ids": [0, 1]})
    with pytest.raises(ConfigError, match="block_size_tokens"):
        Trace(**{**ok, "block_size_tokens": 0})
    two = dict(arrival_s=[0.0, 1.0], input_tokens=[32, 32], output_tokens=[1, 1], block_offsets=[0, 2, 4], partial_block_ids=[-1, -1], block_size_tokens=16)
    Trace(**two, block_ids=[5, 6, 5, 6])
    with pytest.raises(ConfigError, match=r"block_ids: request 1, block 0: block id 6 follows nothing .* but id 5 at request 0, block 1; block ids must be chained"):
        Trace(**two, block_ids=[5, 6, 6, 5])


def test_gzip_trace_reads_like_plain_and_bad_gzip_names_the_file(tmp_path):
    import gzip

    objs = [mc(0, 1100, [7, 8, 9]), mc(1000, 1024, [7, 8]), mc(2000, 100, [5])]
    plain = write_lines(tmp_path / "t.jsonl", objs)
    gz = tmp_path / "t.jsonl.gz"
    gz.write_bytes(gzip.compress(plain.read_bytes()))
    a, b = read_mooncake(plain), read_trace(gz)
    assert detect_format(gz) == "mooncake"
    assert b.full_blocks.tolist() == a.full_blocks.tolist() == [2, 2, 0]
    assert b.arrival_s.tolist() == a.arrival_s.tolist() and len(b) == 3
    # a gzip stream cut short is a trace error naming the file, not an EOFError from zlib
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(gz.read_bytes()[:-12])
    with pytest.raises(TraceFormatError, match="cut.jsonl.gz.*gzip"):
        read_mooncake(cut)
    # a .gz name over plain bytes is refused the same way
    fake = tmp_path / "fake.jsonl.gz"
    fake.write_bytes(plain.read_bytes())
    with pytest.raises(TraceFormatError, match="fake.jsonl.gz.*gzip"):
        read_trace(fake)


def test_shipped_trace_is_the_mooncake_conversation_trace():
    from pathlib import Path

    p = Path(__file__).resolve().parents[1] / "data" / "mooncake_conversation_trace.jsonl.gz"
    assert p.exists(), "data/mooncake_conversation_trace.jsonl.gz is missing from the repository"
    tr = read_trace(p)
    assert tr.block_size_tokens == 512 and len(tr) > 10_000


@pytest.mark.parametrize("field, bad", [
    ("mix", "chat"), ("mix", (("chat", float("nan")),)), ("mix", (("chat",),)),  # not pairs: a ValueError from unpacking
    ("seed", "x"), ("seed", -1),  # numpy refused it later, inside generate()
    ("n_requests", 2.5), ("rate_per_s", float("nan")), ("rate_per_s", float("inf")),
    ("user_tokens", (20.5, 400)), ("turns_mean", {"chat": 0.5}), ("turns_mean", {"chats": 4.0}),  # a misspelt kind was ignored
    ("doc_zipf", 0.8), ("doc_zipf", 1.0), ("doc_zipf", float("inf")),  # numpy's zipf refused it inside generate(), a RAG request later
])
def test_synthetic_spec_refuses_bad_fields_by_name(field, bad):
    from kvpolicy.traces.synthetic import SyntheticSpec

    with pytest.raises(ConfigError) as e:
        SyntheticSpec(**{field: bad})
    assert e.value.field == field


def test_a_zipf_exponent_just_above_one_still_generates():
    tr = generate(preset("rag", n_requests=30, doc_zipf=1.01, seed=2))
    assert len(tr) == 30


def test_turns_mean_overrides_only_the_kinds_it_names():
    """turns_mean={"chat": 6} on the mixed preset made RAG and agent sessions single-turn without a word: a kind it
    does not name keeps its default (agent 8 turns), so the agent sessions of the two traces are the same."""
    from kvpolicy.traces.synthetic import TURNS_MEAN

    spec = preset("mixed", n_requests=400, seed=4, turns_mean={"chat": 6.0})
    assert spec.turns_mean == {**TURNS_MEAN, "chat": 6.0}
    a, b = generate(preset("mixed", n_requests=400, seed=4)), generate(spec)
    agent = a.class_names.index("agent")
    assert b.class_names.index("agent") == agent

    def turns(tr):
        return np.unique(tr.session[tr.request_class == agent], return_counts=True)[1].max()

    assert turns(a) > 1 and turns(b) > 1



def test_every_consumer_refuses_a_trace_of_sparse_or_negative_ids_by_name():
    """A Trace built by hand from raw 64-bit hashes: every kernel and table keeps a record per id, so an id of 10**15
    made replay_kernel fail inside Numba and publish_bench ask numpy for 7 PiB. check_trace, which every consumer
    calls first, now refuses it naming the trace and the remedy; canonicalize(trace) replays as before."""
    import attrs

    from kvpolicy.eviction import replay
    from kvpolicy.eviction.bench import compare
    from kvpolicy.eviction.kernels import replay_kernel
    from kvpolicy.publish_sim import publish_bench
    from kvpolicy.traces import canonicalize
    from kvpolicy.warmup import hot_prefixes_from_trace

    dense = generate(preset("chat", n_requests=120, block_size_tokens=64, seed=9))
    sparse = attrs.evolve(dense, block_ids=dense.block_ids * 1_000_003 + 10**15)
    negative = attrs.evolve(dense, block_ids=dense.block_ids - 1)
    for bad, says in ((sparse, "canonicalize"), (negative, "non-negative")):
        for call in (lambda t: replay_kernel(t, "lru", 40), lambda t: replay(t, "lru", 40), lambda t: compare(t, ["lru"], [40]),
                     lambda t: publish_bench(t, ["threshold-2"], bytes_per_token=4096),
                     lambda t: hot_prefixes_from_trace(t, bytes_per_token=4096, recompute_s=lambda n: 0.01)):
            with pytest.raises(ConfigError) as e:
                call(bad)
            assert says in e.value.problem, e.value
    fixed = canonicalize(sparse)
    assert np.array_equal(replay_kernel(fixed, "lru", 40).hits, replay_kernel(dense, "lru", 40).hits)


def test_a_decompression_bomb_is_refused_after_a_bounded_read(tmp_path):
    """A 2 MB gzip of one 2 GiB line peaked at 4.3 GB of memory (lines were read whole). A line past MAX_LINE_BYTES is
    now refused naming the file and line, having read at most that much of it."""
    import gzip
    import resource

    from kvpolicy.traces import read_mooncake
    from kvpolicy.traces.readers import MAX_LINE_BYTES

    f = tmp_path / "bomb.jsonl.gz"
    chunk = b"9" * (1 << 20)
    with gzip.open(f, "wb", compresslevel=1) as g:
        g.write(b'{"timestamp": 0, "input_length": 16, "output_length": 1, "hash_ids": [1]}\n{"timestamp": ')
        for _ in range(MAX_LINE_BYTES // len(chunk) * 3):  # 192 MiB on one line
            g.write(chunk)
        g.write(b"}\n")
    assert f.stat().st_size < 2 * 2**20
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(TraceFormatError, match=r"bomb.jsonl.gz:2.*longer than 64 MiB"):
        read_mooncake(f)
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mib < 3 * MAX_LINE_BYTES / 2**20, f"{grown_mib:.0f} MiB"
