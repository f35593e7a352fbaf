"""llama.cpp replicas sharing prefix KV through kvpolicy (issue #46).

The codec and the GGUF reader are tested on data made here. The real-engine tests run SmolLM2-135M in
llama-cpp-python: point ``KVPOLICY_GGUF`` at its ``.gguf`` (``.ci/run`` builds llama-cpp-python and fetches the
model; ``KVPOLICY_REQUIRE_LLAMACPP=1`` there turns a missing engine or model into a failure, not a skip)."""

from __future__ import annotations

import os
import struct

import attrs
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpolicy.cli import main
from kvpolicy.errors import ConfigError
from kvpolicy.gguf import GGUFModel, read_metadata, row_bytes
from kvpolicy.integrations.llamacpp import (
    STATE_MAGIC,
    StateFormatError,
    StateLayout,
    block_payloads,
    build_seq_state,
    parse_seq_state,
)

from helpers import SECRET

# ------------------------------------------------------------------------------------------------ a GGUF made here


def _gguf_str(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def write_gguf(path, meta: dict, *, version: int = 3, magic: bytes = b"GGUF") -> None:
    """A GGUF file of metadata only (no tensors): ints as u32, floats as f32, strings, lists of u32 or strings."""
    out = [magic, struct.pack("<IQQ", version, 0, len(meta))]
    for k, v in meta.items():
        out.append(_gguf_str(k))
        if isinstance(v, str):
            out.append(struct.pack("<I", 8) + _gguf_str(v))
        elif isinstance(v, float):
            out.append(struct.pack("<If", 6, v))
        elif isinstance(v, int):
            out.append(struct.pack("<II", 4, v))
        elif isinstance(v, list) and all(isinstance(x, str) for x in v):
            out.append(struct.pack("<IIQ", 9, 8, len(v)) + b"".join(_gguf_str(x) for x in v))
        else:
            out.append(struct.pack("<IIQ", 9, 4, len(v)) + struct.pack(f"<{len(v)}I", *v))
    path.write_bytes(b"".join(out))


LLAMA_META = {"general.architecture": "llama", "general.name": "tiny", "llama.block_count": 4, "llama.embedding_length": 256,
              "llama.attention.head_count": 8, "llama.attention.head_count_kv": 2, "llama.rope.freq_base": 10000.0,
              "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b", "c"]}


def test_a_gguf_gives_the_caches_bytes_per_token_exactly_in_every_cache_type(tmp_path):
    f = tmp_path / "m.gguf"
    write_gguf(f, LLAMA_META)
    m = GGUFModel.read(f)
    assert (m.architecture, m.num_layers, m.num_kv_heads, m.key_length, m.value_length) == ("llama", 4, (2, 2, 2, 2), 32, 32)
    assert m.bytes_per_token() == 4 * 2 * (2 * 32) * 2  # layers x (K + V) x row of 64 f16
    assert m.bytes_per_token("q8_0", "q8_0") == 4 * 2 * (64 // 32 * 34)  # 34 bytes per 32 elements, not rounded up
    assert m.bytes_per_token("f32", "q4_0") == 4 * (64 * 4 + 64 // 32 * 18)
    assert row_bytes("q5_1", 64) == 48 and row_bytes("bf16", 3) == 6
    with pytest.raises(ConfigError, match="q8_0 stores blocks of 32"):
        row_bytes("q8_0", 48)
    # one value per layer (GGUF stores either form) — a model whose layers hold different KV heads
    write_gguf(f, {**LLAMA_META, "llama.attention.head_count_kv": [2, 2, 1, 4]})
    assert GGUFModel.read(f).bytes_per_token() == (2 + 2 + 1 + 4) * 32 * 2 * 2
    write_gguf(f, {**LLAMA_META, "llama.attention.head_count_kv": [2, 2]})
    with pytest.raises(ConfigError, match="llama.attention.head_count_kv.*2 values for 4 layers"):
        GGUFModel.read(f)


def test_the_namespace_changes_with_the_file_the_tokenizer_the_cache_types_and_the_block_size(tmp_path):
    f, g = tmp_path / "m.gguf", tmp_path / "n.gguf"
    write_gguf(f, LLAMA_META)
    write_gguf(g, {**LLAMA_META, "tokenizer.ggml.tokens": ["a", "b", "d"]})
    m, n = GGUFModel.read(f), GGUFModel.read(g)
    base = m.namespace(16).digest
    assert m.namespace(16).digest == base  # deterministic
    assert m.namespace(16).model_revision == m.file_digest()
    assert m.namespace(32).digest != base
    assert m.namespace(16, type_k="q8_0", type_v="q8_0").digest != base
    assert m.namespace(16, type_k="q4_0", type_v="q4_0").digest != m.namespace(16, type_k="q8_0", type_v="q8_0").digest
    assert n.namespace(16).digest != base  # another tokenizer
    assert m.namespace(16, file_digest="another file").digest != base
    with pytest.raises(ConfigError, match="type_k"):
        m.namespace(16, type_k="q3_k")


@pytest.mark.parametrize("mutate, field", [
    (lambda b: b"GGUX" + b[4:], "not a GGUF file"),
    (lambda b: b[:4] + struct.pack("<I", 7) + b[8:], "gguf.version"),
    (lambda b: b[: len(b) // 2], "truncated"),
    (lambda b: b[:16] + struct.pack("<Q", 2**60) + b[24:], "gguf.kv_count"),
])
def test_a_corrupt_gguf_is_refused_naming_what_is_wrong(tmp_path, mutate, field):
    f = tmp_path / "m.gguf"
    write_gguf(f, LLAMA_META)
    f.write_bytes(mutate(f.read_bytes()))
    with pytest.raises(ConfigError, match=field):
        read_metadata(f)


def test_an_array_claiming_more_elements_than_the_file_holds_is_refused_before_allocating(tmp_path):
    f = tmp_path / "m.gguf"
    head = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + _gguf_str("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, 2**62)
    f.write_bytes(head + b"\0" * 64)
    with pytest.raises(ConfigError, match="tokenizer.ggml.tokens.*array of"):
        read_metadata(f)
    write_gguf(f, {k: v for k, v in LLAMA_META.items() if k != "llama.block_count"})
    with pytest.raises(ConfigError, match="llama.block_count"):
        GGUFModel.read(f)


def test_a_hostile_gguf_is_refused_quickly_in_bounded_memory_with_a_short_line(tmp_path, capsys):
    """Round three: 303 bytes claiming 2^27 layers ran `size --gguf` 139 s at 10.4 GB and printed 128 TiB (exit 0);
    a 200 MB file of one u8 array peaked at 3.4 GB; a 10 MB architecture name made a 10 MB error line. Layers and
    heads are bounded as the CLI's --layers is (1,024), an array past MAX_ARRAY_ELEMENTS is refused before a list is
    made, and a long name is refused in one short line."""
    import time
    import tracemalloc

    from kvpolicy import gguf

    f = tmp_path / "m.gguf"
    write_gguf(f, {**LLAMA_META, "llama.block_count": 2**27})
    assert f.stat().st_size < 500
    t0 = time.perf_counter()
    assert main(["size", "--gguf", str(f)]) == 2
    err = capsys.readouterr().err
    assert time.perf_counter() - t0 < 5 and "llama.block_count" in err and "1,024" in err and len(err.splitlines()) == 1
    for k, v in (("llama.attention.head_count_kv", 2**20), ("llama.attention.key_length", 2**30)):
        write_gguf(f, {**LLAMA_META, k: v})
        with pytest.raises(ConfigError) as e:
            GGUFModel.read(f)
        assert e.value.field == k
    # one u8 array just past the bound: refused, and reading it held no list of its elements
    n = gguf.MAX_ARRAY_ELEMENTS + 1
    f.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + _gguf_str("general.blob") + struct.pack("<IIQ", 9, 0, n) + b"\1" * n)
    tracemalloc.start()
    with pytest.raises(ConfigError, match="general.blob.*array of 4,194,305 elements"):
        read_metadata(f)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 2**20
    # arrays within the bound add up: the whole file's budget is MAX_TOTAL_ELEMENTS
    half = gguf.MAX_TOTAL_ELEMENTS // 3 + 1
    body = b"".join(_gguf_str(f"general.blob{i}") + struct.pack("<IIQ", 9, 0, half) + b"\1" * half for i in range(3))
    f.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 3) + body)
    with pytest.raises(ConfigError, match="general.blob2.*in all"):
        read_metadata(f)
    for meta, field in (({**LLAMA_META, "general.architecture": "x" * 10**6}, "general.architecture"),
                        ({**LLAMA_META, "general.name": "n" * 10**6}, "general.name")):
        write_gguf(f, meta)
        assert main(["size", "--gguf", str(f)]) == 2
        err = capsys.readouterr().err
        assert field in err and len(err) < 400, err[:400]
    f.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + _gguf_str("k" * 10**6) + struct.pack("<II", 4, 1))
    with pytest.raises(ConfigError, match="a key of 1,000,000 bytes") as e:
        read_metadata(f)
    assert len(str(e.value)) < 400


def test_size_reads_a_gguf(tmp_path, capsys):
    f = tmp_path / "m.gguf"
    write_gguf(f, LLAMA_META)
    assert main(["size", "--gguf", str(f), "--cache-type-k", "q8_0", "--cache-type-v", "q8_0", "--prefix-tokens", "100", "--block-size", "16", "--json"]) == 0
    import json

    out = json.loads(capsys.readouterr().out)
    assert out["bytes_per_token"] == 4 * 2 * 68
    assert out["prefixes"][0] == {"prefix_tokens": 100, "useful_tokens": 96, "kv_bytes": 54400, "load_bytes": 52224}
    assert main(["size", "--gguf", str(f), "--config", "llama-3-8b"]) == 2
    assert "exactly one of --config" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ the state codec


def _state_blob(layout: StateLayout, positions, k, v, *, magic=STATE_MAGIC) -> bytes:
    """A llama.cpp sequence export, written the way llama_kv_cache::state_write does (one stream)."""
    n = len(positions)
    parts = [struct.pack("<IiII", magic, 0, 1, n)]
    parts += [struct.pack("<iIi", int(p), 1, 0) for p in positions]
    parts.append(struct.pack("<II", int(layout.v_trans), layout.num_layers))
    for t, row, a in zip(layout.k_types, layout.k_row_bytes, k):
        parts += [struct.pack("<iQ", t, row), a.tobytes()]
    for i, (t, row, a) in enumerate(zip(layout.v_types, layout.v_row_bytes, v)):
        if layout.v_trans:
            el, ne = layout.v_elem_bytes[i], layout.v_elems[i]
            parts += [struct.pack("<iII", t, el, ne), a.reshape(n, ne, el).transpose(1, 0, 2).tobytes()]
        else:
            parts += [struct.pack("<iQ", t, row), a.tobytes()]
    return b"".join(parts)


@st.composite
def states(draw):
    layers = draw(st.integers(1, 3))
    v_trans = draw(st.booleans())
    el = 2
    k_rows = tuple(draw(st.sampled_from([4, 6, 8])) for _ in range(layers))
    v_elems = tuple(draw(st.sampled_from([2, 3, 4])) for _ in range(layers))
    layout = StateLayout((1,) * layers, k_rows, (1,) * layers, tuple(e * el for e in v_elems), v_trans,
                         (el,) * layers if v_trans else (), v_elems if v_trans else ())
    B = draw(st.integers(1, 4))
    n_blocks = draw(st.integers(1, 4))
    n = B * n_blocks + draw(st.integers(0, B - 1))  # a partial block at the end, as a prompt leaves
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    k = [rng.integers(0, 256, (n, r), dtype=np.uint8) for r in k_rows]
    v = [rng.integers(0, 256, (n, r), dtype=np.uint8) for r in layout.v_row_bytes]
    order = draw(st.permutations(list(range(n))))  # the cells as they sit in the cache: any order of positions
    return layout, B, n_blocks, n, k, v, order


@settings(max_examples=60, deadline=None)
@given(states())
def test_blocks_cut_from_an_export_rebuild_the_same_cells_in_position_order(s):
    layout, B, n_blocks, n, k, v, order = s
    blob = _state_blob(layout, order, [a[order] for a in k], [a[order] for a in v])
    parsed = parse_seq_state(blob)
    assert parsed.layout == layout and np.array_equal(parsed.positions, np.arange(n))
    for got, want in zip(parsed.k + parsed.v, k + v):
        assert np.array_equal(got, want)  # sorted back by position, V un-transposed
    blocks = block_payloads(parsed, n_blocks, B)
    assert len(blocks) == n_blocks and {len(b) for b in blocks} == {B * layout.bytes_per_token}
    # a block is its B cells of every layer's K rows, then of every layer's V rows
    b = n_blocks - 1
    cut = slice(b * B, (b + 1) * B)
    assert blocks[b] == b"".join([a[cut].tobytes() for a in k] + [a[cut].tobytes() for a in v])
    rebuilt = parse_seq_state(build_seq_state(layout, blocks, B))
    m = n_blocks * B
    assert np.array_equal(rebuilt.positions, np.arange(m))
    for got, want in zip(rebuilt.k + rebuilt.v, k + v):
        assert np.array_equal(got, want[:m])
    # and the rebuilt state is byte for byte what llama.cpp writes for those cells in order
    assert build_seq_state(layout, blocks, B) == _state_blob(layout, list(range(m)), [a[:m] for a in k], [a[:m] for a in v])


def test_blocks_are_never_cut_from_a_context_missing_a_position():
    layout = StateLayout((1,), (4,), (1,), (4,), False)
    k = [np.zeros((8, 4), np.uint8)]
    parsed = parse_seq_state(_state_blob(layout, [0, 1, 2, 3, 5, 6, 7, 8], k, k))
    assert len(block_payloads(parsed, 1, 4)) == 1
    with pytest.raises(StateFormatError, match="positions 0…7"):
        block_payloads(parsed, 2, 4)


@pytest.mark.parametrize("mutate, what", [
    (lambda b: struct.pack("<I", 0x12345678) + b[4:], "magic"),
    (lambda b: b[:-1], "runs past the end"),
    (lambda b: b + b"\0", "left over"),
    (lambda b: b[:8] + struct.pack("<I", 2) + b[12:], "runs past the end|several streams"),
    (lambda b: b[:16] + struct.pack("<iIi", 0, 2, 0) + b[28:], "several sequences"),
])
def test_a_state_this_codec_does_not_read_is_refused(mutate, what):
    layout = StateLayout((1,), (4,), (1,), (4,), False)
    k = [np.zeros((4, 4), np.uint8)]
    with pytest.raises(StateFormatError, match=what):
        parse_seq_state(mutate(_state_blob(layout, [0, 1, 2, 3], k, k)))


# ------------------------------------------------------------------------------------------------ the real engine


def _engine():
    path = os.environ.get("KVPOLICY_GGUF")
    required = bool(os.environ.get("KVPOLICY_REQUIRE_LLAMACPP"))
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        if required:
            pytest.fail("KVPOLICY_REQUIRE_LLAMACPP is set but llama-cpp-python is not installed")
        pytest.skip("llama-cpp-python is not installed (.ci/run builds it)")
    if not path or not os.path.exists(path):
        if required:
            pytest.fail(f"KVPOLICY_REQUIRE_LLAMACPP is set but KVPOLICY_GGUF={path!r} is not a file")
        pytest.skip("KVPOLICY_GGUF does not name the SmolLM2-135M GGUF (.ci/run fetches it)")
    return path


B = 16


@pytest.fixture(scope="module")
def gguf_path():
    return _engine()


@pytest.fixture(scope="module")
def model(gguf_path):
    return GGUFModel.read(gguf_path)


@pytest.fixture(scope="module")
def namespace(model):
    return model.namespace(B)


def new_llama(path):
    from llama_cpp import Llama

    return Llama(model_path=path, n_ctx=1024, n_threads=2, n_threads_batch=2, n_batch=256, verbose=False)


@pytest.fixture(scope="module")
def llamas(gguf_path):
    return [new_llama(gguf_path) for _ in range(3)]


@pytest.fixture
def server(namespace, model):
    from kvpolicy.reference.transport import BlockServer, BlockStore

    srv = BlockServer(BlockStore(namespace.digest, B * model.bytes_per_token()), secret=SECRET)
    yield srv
    srv.close()


def client(server, namespace, model, name="store"):
    from kvpolicy.reference.transport import PeerClient

    return PeerClient(server.address, namespace.digest, secret=SECRET, block_bytes=B * model.bytes_per_token(), name=name)


def replica(llm, model, namespace, *, store=None, **kw):
    from kvpolicy.integrations.llamacpp import LlamaCppReplica

    llm.reset()
    return LlamaCppReplica(llm, model, block_size_tokens=B, secret=SECRET if store is not None else kw.pop("secret", None), store=store,
                           file_digest=namespace.model_revision, **kw)


def prompt(llm, n, seed=0):
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(100, 40000, n)]


def cold_logits(llm, tokens):
    llm.reset()
    llm.eval(tokens)
    from llama_cpp import llama_get_logits_ith

    return np.ctypeslib.as_array(llama_get_logits_ith(llm._ctx.ctx, -1), shape=(llm.n_vocab(),)).copy()


def test_the_gguf_prices_exactly_the_state_llama_cpp_exports(llamas, model, namespace):
    """kvpolicy size --gguf's bytes per token against the engine's own export: the state of n cells is
    8 (magic, seq) + 8 (streams, cells) + 12 per cell + 8 (v_trans, layers) + 12 per layer and direction + n x bytes per token."""
    r = replica(llamas[0], model, namespace)
    toks = prompt(llamas[0], 100)
    r.prefill(toks)
    state = r.export_state()
    assert state.layout.bytes_per_token == model.bytes_per_token() == 23040
    import ctypes

    import llama_cpp

    size = llama_cpp.llama_state_seq_get_size(llamas[0]._ctx.ctx, 0)
    assert size == 8 + 8 + 12 * 100 + 8 + 12 * 2 * model.num_layers + 100 * model.bytes_per_token()
    assert ctypes.sizeof(ctypes.c_uint8 * size) == size


@pytest.mark.parametrize("n_tokens", [17, 50, 64, 65, 150])  # 1, 3, 3 (the last token is computed), 4 and 9 blocks
def test_a_remote_load_gives_exactly_the_logits_of_a_cold_prefill(llamas, model, namespace, server, n_tokens):
    toks = prompt(llamas[0], n_tokens, seed=n_tokens)
    pub = replica(llamas[0], model, namespace, store=client(server, namespace, model))
    first = pub.prefill(toks)
    assert first.local_blocks == first.loaded_blocks == 0
    assert pub.counts["published_blocks"] == n_tokens // B
    loader = replica(llamas[1], model, namespace, store=client(server, namespace, model))
    tail = prompt(llamas[0], 7, seed=99)
    got = loader.prefill(toks + tail)
    matchable = min((n_tokens + 7 - 1) // B, n_tokens // B)
    assert (got.local_blocks, got.remote_found, got.loaded_blocks, got.load_status) == (0, matchable, matchable, "ok")
    assert got.computed_tokens == n_tokens + 7 - matchable * B
    want = cold_logits(llamas[2], toks + tail)
    assert np.abs(got.logits - want).max() == 0.0  # not close: the same numbers


def test_a_load_behind_local_blocks_keeps_them_and_adds_the_fetched_ones(llamas, model, namespace, server):
    toks = prompt(llamas[0], 130, seed=5)
    pub = replica(llamas[0], model, namespace, store=client(server, namespace, model))
    pub.prefill(toks)  # publishes 8 blocks
    loader = replica(llamas[1], model, namespace, store=client(server, namespace, model), publish_filter=_Never())
    loader.prefill(toks[:40] + prompt(llamas[0], 5, seed=1))  # the loader's context holds 2 blocks of it
    got = loader.prefill(toks + [7, 8, 9])
    assert (got.local_blocks, got.loaded_blocks, got.load_status) == (2, 6, "ok")
    assert np.abs(got.logits - cold_logits(llamas[2], toks + [7, 8, 9])).max() == 0.0
    again = loader.prefill(toks + [7, 8, 10])  # now all 8 are the context's own
    assert (again.local_blocks, again.remote_found, again.loaded_blocks) == (8, 0, 0)
    assert np.abs(again.logits - cold_logits(llamas[2], toks + [7, 8, 10])).max() == 0.0


class _Never:
    def observe(self, request, keys):
        pass

    def publishable(self, request, keys):
        return 0


def test_a_block_forged_in_flight_is_refused_and_the_request_recomputes(llamas, model, namespace, server):
    toks = prompt(llamas[0], 96, seed=7)
    replica(llamas[0], model, namespace, store=client(server, namespace, model)).prefill(toks)
    server.faults.corrupt = True  # one byte of the first block flipped after its MAC was made
    loader = replica(llamas[1], model, namespace, store=client(server, namespace, model))
    got = loader.prefill(toks + [11])
    assert (got.remote_found, got.loaded_blocks, got.load_status) == (6, 0, "failed")
    assert loader.counts["corrupt_refused"] == 1
    assert np.abs(got.logits - cold_logits(llamas[2], toks + [11])).max() == 0.0


class _Truncating:
    """A store whose blocks arrive one byte short (a buggy or hostile server past the transport's size check)."""

    def __init__(self, inner):
        self.inner = inner
        self.name, self.block_bytes, self.namespace_digest = inner.name, inner.block_bytes, inner.namespace_digest

    def match_prefix(self, keys):
        return self.inner.match_prefix(keys)

    def fetch(self, keys, timeout_s):
        res = self.inner.fetch(keys, timeout_s)
        return attrs.evolve(res, payloads=tuple(p[:-1] for p in res.payloads))

    def put(self, keys, payloads, timeout_s):
        return self.inner.put(keys, payloads, timeout_s)


def test_a_truncated_block_is_refused_and_the_request_recomputes(llamas, model, namespace, server):
    toks = prompt(llamas[0], 80, seed=8)
    replica(llamas[0], model, namespace, store=client(server, namespace, model)).prefill(toks)
    loader = replica(llamas[1], model, namespace, store=_Truncating(client(server, namespace, model)))
    got = loader.prefill(toks + [3])
    assert (got.loaded_blocks, got.load_status, loader.counts["corrupt_refused"]) == (0, "failed", 1)
    assert np.abs(got.logits - cold_logits(llamas[2], toks + [3])).max() == 0.0


def test_blocks_of_another_namespace_are_never_matched(llamas, model, namespace, server):
    """Another tenant's replica (another namespace digest, so other keys) asks the same server: the server answers
    only its own namespace, the replica finds nothing and computes."""
    from kvpolicy.reference.transport import PeerClient

    toks = prompt(llamas[0], 64, seed=9)
    replica(llamas[0], model, namespace, store=client(server, namespace, model)).prefill(toks)
    other = model.namespace(B, tenant="other", file_digest=namespace.model_revision)
    c = PeerClient(server.address, other.digest, secret=SECRET, block_bytes=B * model.bytes_per_token())
    r = replica(llamas[1], model, namespace, store=c, tenant="other")
    got = r.prefill(toks + [5])
    assert (got.remote_found, got.loaded_blocks) == (0, 0)
    assert np.abs(got.logits - cold_logits(llamas[2], toks + [5])).max() == 0.0
    with pytest.raises(ConfigError, match="another namespace"):
        replica(llamas[1], model, namespace, store=client(server, namespace, model), tenant="other")


def test_an_import_llama_cpp_refuses_leaves_a_recompute_from_nothing(llamas, model, namespace, server, monkeypatch):
    """A state of another cache type (right sizes, wrong ggml type): llama.cpp refuses it and clears the sequence, so
    even the context's own blocks are gone — the request recomputes from the first token, and the answer is right."""
    toks = prompt(llamas[0], 80, seed=10)
    replica(llamas[0], model, namespace, store=client(server, namespace, model)).prefill(toks)
    loader = replica(llamas[1], model, namespace, store=client(server, namespace, model), publish_filter=_Never())
    loader.prefill(toks[:33])  # 2 blocks of its own
    from kvpolicy.integrations import llamacpp

    build = llamacpp.build_seq_state
    monkeypatch.setattr(llamacpp, "build_seq_state", lambda lay, *a, **k: build(attrs.evolve(lay, k_types=(8,) * lay.num_layers), *a, **k))
    got = loader.prefill(toks + [4])
    assert (got.local_blocks, got.loaded_blocks, loader.counts["import_refused"]) == (2, 0, 1)
    assert got.computed_tokens == 81
    assert np.abs(got.logits - cold_logits(llamas[2], toks + [4])).max() == 0.0


def test_admission_decides_every_load_and_hears_how_it_ended(llamas, model, namespace, server):
    from kvpolicy.admission import AdmissionController
    from kvpolicy.ledger import Ledger
    from kvpolicy.profile import PrefillModel

    toks = prompt(llamas[0], 160, seed=11)
    replica(llamas[0], model, namespace, store=client(server, namespace, model)).prefill(toks)
    from kvpolicy.admission import LatencyModel, LinkPrior

    prefill = PrefillModel(a_s=0.01, b_s_per_token=1e-3, c_s_per_token2=0.0, rms_rel_error=float("nan"), max_rel_error=float("nan"))
    ctl = AdmissionController(LatencyModel(LinkPrior(bandwidth_bytes_per_s=1e9), prefill))
    ledger = Ledger(bytes_per_token=model.bytes_per_token())
    loader = replica(llamas[1], model, namespace, store=client(server, namespace, model), controller=ctl, ledger=ledger)
    got = loader.prefill(toks + [1, 2])
    assert got.decision is not None and got.decision.loads and got.loaded_blocks == 10
    assert ctl.loads_in_flight() == 0  # the outcome was recorded
    d = ledger.to_dict()
    assert d["tokens"]["remote_hit"] == 160


def test_sharing_needs_the_secret_and_the_stores_block_size(llamas, model, namespace, server):
    from kvpolicy.integrations.llamacpp import LlamaCppReplica
    from kvpolicy.reference.transport import PeerClient

    with pytest.raises(ConfigError, match="secret"):
        LlamaCppReplica(llamas[0], model, block_size_tokens=B, store=client(server, namespace, model), file_digest=namespace.model_revision)
    bad = PeerClient(server.address, namespace.digest, secret=SECRET, block_bytes=1000)
    with pytest.raises(ConfigError, match="store"):
        LlamaCppReplica(llamas[0], model, block_size_tokens=B, secret=SECRET, store=bad, file_digest=namespace.model_revision)
    r = replica(llamas[0], model, namespace)
    for bad_tokens, msg in (([], "empty"), ([1.5, 2.0], "integer"), ([-1, 3], r"\[0, 49152\)"), ([0] * 2000, "do not fit")):
        with pytest.raises(ConfigError, match=msg):
            r.prefill(bad_tokens)


def test_profile_measures_llama_cpp_in_process(gguf_path, tmp_path, capsys):
    """kvpolicy profile --gguf: the engine's own KV bytes (the slope equals the GGUF's formula), cold and local-hit
    prefills, and a real remote load over the authenticated transport, into a profile compare reads."""
    out = tmp_path / "p.csv"
    assert main(["profile", "--gguf", gguf_path, "--lengths", "64,128", "--block-size", "32", "--concurrency", "1", "--repeats", "2",
                 "--tail-tokens", "8", "--out", str(out), "--json", "-q"]) == 0
    import json

    from kvpolicy.profile import read_profile

    rep = json.loads(capsys.readouterr().out)
    assert rep["measured_bytes_per_token"] == pytest.approx(23040, rel=1e-9) and rep["formula_bytes_per_token"] == 23040
    assert rep["slope_matches_formula"]
    prof = read_profile(out)
    assert list(prof.prefix_tokens) == [64, 128] and list(prof.kv_bytes) == [64 * 23040, 128 * 23040]
    assert np.all(0 < prof.local_hit_ttft_ms) and np.all(prof.local_hit_ttft_ms < prof.cold_prefill_ms)  # the prefix is not recomputed
    remote = prof.extra["remote_load_p50_ms"]
    assert np.all(0 < remote) and np.all(remote < prof.cold_prefill_ms)  # 135M on a CPU: a load is far cheaper than recompute
    assert main(["profile", "--gguf", gguf_path, "--lengths", "48", "--block-size", "32"]) == 2
    assert "--lengths" in capsys.readouterr().err


@pytest.fixture(scope="module")
def llama_server(gguf_path, tmp_path_factory):
    """llama-cpp-python's OpenAI-compatible server on the real model (text prompts only)."""
    import subprocess
    import sys
    import time

    import httpx

    try:
        import llama_cpp.server  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        if os.environ.get("KVPOLICY_REQUIRE_LLAMACPP"):
            pytest.fail("KVPOLICY_REQUIRE_LLAMACPP is set but llama-cpp-python[server] is not installed")
        pytest.skip("llama-cpp-python[server] is not installed")
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    log = tmp_path_factory.mktemp("llama-server") / "stderr.log"
    proc = subprocess.Popen([sys.executable, "-m", "llama_cpp.server", "--model", gguf_path, "--model_alias", "smollm2", "--host", "127.0.0.1",
                             "--port", str(port), "--n_ctx", "2048", "--n_threads", "2", "--verbose", "false"],
                            stdout=subprocess.DEVNULL, stderr=log.open("wb"))  # not a pipe: its request log would fill it and block
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            if proc.poll() is not None:
                pytest.fail(f"the llama.cpp server exited: {log.read_text()[-2000:]}")
            try:
                if httpx.get(f"{url}/v1/models", timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def test_profile_over_http_against_llama_cpps_own_server_with_text_prompts(llama_server, gguf_path, capsys):
    """kvpolicy profile --openai-url on llama-cpp-python's server, which takes text only: prompts of one-token words,
    counted by the server's own tokenizer, so a prefix of words is a prefix of tokens and the server's prefix cache hits."""
    import json

    from kvpolicy.openai_profile import OpenAIProfileTarget

    t = OpenAIProfileTarget(llama_server, "smollm2", bytes_per_token=23040, prompt_format="text")
    words = t._ids(np.random.default_rng(0), 300)
    assert len(t._tokenize(t._text(words))) == 300 + t.special_tokens  # exact token counts
    t.close()
    assert main(["profile", "--openai-url", llama_server, "--model", "smollm2", "--gguf", gguf_path, "--prompt-format", "text",
                 "--lengths", "256,512", "--concurrency", "1", "--repeats", "2", "--tail-tokens", "8", "--json", "-q"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["formula_bytes_per_token"] == 23040 and rep["kv_bytes"] == [256 * 23040, 512 * 23040]  # computed from the GGUF
    assert rep["has_remote"] is False
    for r in rep["rows"]:  # the server's own prefix cache skips the cached prefix: text prompts kept it token for token
        assert r["local_hit_ttft_p50_ms"] < 0.5 * r["cold_prefill_p50_ms"], r
    # token ids are refused by this server: the error says what to do
    assert main(["profile", "--openai-url", llama_server, "--model", "smollm2", "--gguf", gguf_path, "--lengths", "256",
                 "--concurrency", "1", "--repeats", "2", "-q"]) == 2
    assert "--prompt-format text" in capsys.readouterr().err


class _Peers:
    """The in-process PeerSender: each replica by name, asked to send what it holds."""

    def __init__(self):
        self.replicas = {}

    def send(self, engine, keys):
        return self.replicas[engine].send_blocks(keys)


def _on_demand(llamas, model, namespace, server, d, peers, names, idx):
    from kvpolicy.directory import TenantScopedDirectory  # noqa: F401 - d is one

    for name, i in zip(names, idx):
        peers.replicas[name] = replica(llamas[i], model, namespace, store=client(server, namespace, model), directory=d,
                                       publish_filter=_Never(), advertise=True, peers=peers, replica=name)
    return [peers.replicas[n] for n in names]


def test_a_block_only_a_peer_holds_is_pulled_through_the_store_and_gives_a_cold_prefills_logits(llamas, model, namespace, server):
    """Publishing on demand with a real model: nothing is published by itself (``never``); replica a holds the prompt's
    6 blocks in its context and says so in the directory. Replica b finds them there, asks a to send them into the store
    (a's own export), loads them, and its logits are a cold prefill's. The store keeps them: a third replica that pulls
    from nobody loads them from the store."""
    from kvpolicy.directory import InMemoryDirectory, TenantScopedDirectory

    d = TenantScopedDirectory(InMemoryDirectory(), "default", namespace_digest=namespace.digest)
    peers = _Peers()
    a, b = _on_demand(llamas, model, namespace, server, d, peers, ["a", "b"], [0, 1])
    toks = prompt(llamas[0], 100, seed=11)
    a.prefill(toks)
    assert a.counts["published_blocks"] == 0 and [e[0].holder for e in d.lookup(list(a._held))] == ["a/gpu/g0"] * 6
    tail = prompt(llamas[0], 9, seed=12)
    want = cold_logits(llamas[2], toks + tail)
    got = b.prefill(toks + tail)
    assert (got.local_blocks, got.remote_found, got.loaded_blocks, got.pulled_blocks, got.load_status) == (0, 6, 6, 6, "ok")
    assert a.counts["sent_blocks"] == 6 and b.counts["pulled_blocks"] == 6
    assert np.abs(got.logits - want).max() == 0.0  # not close: the same numbers
    c = replica(llamas[2], model, namespace, store=client(server, namespace, model), publish_filter=_Never())
    later = c.prefill(toks + [5, 6, 7])
    assert (later.loaded_blocks, later.pulled_blocks, later.load_status) == (6, 0, "ok"), "the store kept what the pull passed"


def test_a_peer_that_no_longer_holds_the_blocks_sends_nothing_and_the_request_recomputes(llamas, model, namespace, server):
    """Replica a's context moves on to another prompt: the blocks it held leave the directory with it, so b finds no
    peer for them and computes; and asked directly for blocks it no longer holds, a sends nothing."""
    from kvpolicy.directory import InMemoryDirectory, TenantScopedDirectory

    d = TenantScopedDirectory(InMemoryDirectory(), "default", namespace_digest=namespace.digest)
    peers = _Peers()
    a, b = _on_demand(llamas, model, namespace, server, d, peers, ["a", "b"], [0, 1])
    toks = prompt(llamas[0], 80, seed=21)
    a.prefill(toks)
    keys = list(a._held)
    a.prefill(prompt(llamas[0], 80, seed=22))  # another prompt: a's context holds none of toks' blocks now
    assert all(not es for es in d.lookup(keys)), "withdrawn from the directory"
    got = b.prefill(toks + [1, 2])
    assert (got.remote_found, got.loaded_blocks, got.pulled_blocks) == (0, 0, 0) and got.computed_tokens == 82
    assert a.send_blocks(keys) == 0 and a.counts["sent_blocks"] == 0


def test_publishing_on_demand_needs_a_store_a_directory_and_a_sender(llamas, model, namespace, server):
    from kvpolicy.directory import InMemoryDirectory, TenantScopedDirectory

    d = TenantScopedDirectory(InMemoryDirectory(), "default")
    for kw, field in ((dict(advertise=True), "advertise"), (dict(peers=_Peers()), "peers"), (dict(advertise=1), "advertise")):
        with pytest.raises(ConfigError) as e:
            replica(llamas[0], model, namespace, **kw)
        assert e.value.field == field
    with pytest.raises(ConfigError) as e:
        replica(llamas[0], model, namespace, store=client(server, namespace, model), directory=d, peers=object())
    assert e.value.field == "peers"


def test_a_pull_follows_the_stores_run_and_sends_blocks_from_the_middle_of_the_peers_context(llamas, model, namespace, server):
    """The store holds the prompt's first 2 blocks (another replica published a shorter prompt); replica a holds all 6.
    Replica b loads 2 from the store and has a send the other 4 — a's blocks 2..5, cut from the middle of its export —
    in one load of 6; its logits are a cold prefill's."""
    from kvpolicy.directory import InMemoryDirectory, TenantScopedDirectory

    d = TenantScopedDirectory(InMemoryDirectory(), "default", namespace_digest=namespace.digest)
    toks = prompt(llamas[0], 100, seed=31)
    first = replica(llamas[2], model, namespace, store=client(server, namespace, model))
    first.prefill(toks[:40])  # publishes 2 blocks of it (2 full blocks of 40 tokens)
    peers = _Peers()
    a, b = _on_demand(llamas, model, namespace, server, d, peers, ["a", "b"], [0, 1])
    a.prefill(toks)
    want = cold_logits(llamas[2], toks + [3, 4])
    got = b.prefill(toks + [3, 4])
    assert (got.remote_found, got.loaded_blocks, got.pulled_blocks, got.load_status) == (6, 6, 4, "ok")
    assert a.counts["sent_blocks"] == 4
    assert np.abs(got.logits - want).max() == 0.0


def test_the_in_process_sender_is_a_peer_sender():
    from kvpolicy.protocols import PeerSender

    assert isinstance(_Peers(), PeerSender) and not isinstance(object(), PeerSender)


def test_a_context_that_moved_on_sends_nothing_under_the_keys_it_advertised(llamas, model, namespace, server):
    """Round three, data corruption: send_blocks sent whatever the context held, labelled with the keys it last
    advertised. Replica a prefills toks and advertises them; then its Llama is used outside prefill (another prompt
    over the last 3 blocks). b finds a in the directory and asks: a's send computes the keys of what its context holds
    now and sends only the 3 blocks still bound to them — b loads those, computes the rest, and its logits are a cold
    prefill's; the store never gets the other blocks under toks' keys."""
    from kvpolicy.directory import InMemoryDirectory, TenantScopedDirectory

    d = TenantScopedDirectory(InMemoryDirectory(), "default", namespace_digest=namespace.digest)
    peers = _Peers()
    a, b = _on_demand(llamas, model, namespace, server, d, peers, ["a", "b"], [0, 1])
    toks = prompt(llamas[0], 100, seed=41)
    a.prefill(toks)
    keys = list(a._held)
    assert len(keys) == 6
    a.llm.n_tokens = 3 * B  # used outside prefill: the context keeps 3 blocks, then holds another prompt's tokens
    a.llm.eval(prompt(llamas[0], 60, seed=42))
    assert [e[0].holder for e in d.lookup(keys)] == ["a/gpu/g0"] * 6, "the directory still says a holds all 6"
    want = cold_logits(llamas[2], toks + [7, 8])
    got = b.prefill(toks + [7, 8])
    assert (got.remote_found, got.pulled_blocks, got.loaded_blocks, got.load_status) == (6, 3, 3, "ok")
    assert a.counts["sent_blocks"] == 3
    assert np.abs(got.logits - want).max() == 0.0
    store = client(server, namespace, model)
    assert store.match_prefix(keys) == 3, "blocks 3..5 never reached the store under toks' keys"
    a.llm.reset()  # and a context holding none of them sends none
    a.llm.eval(prompt(llamas[0], 50, seed=43))
    assert a.send_blocks(keys) == 0 and a.counts["sent_blocks"] == 3


def test_a_send_waits_for_the_holders_prefill_and_refuses_past_its_wait(llamas, model, namespace, server):
    """A pull arriving while the holder prefills another prompt: the send takes the replica's lock (the prefill holds
    it throughout), waits at most send_wait_s, and refuses — never exports a context mid-change."""
    import threading

    from kvpolicy.directory import InMemoryDirectory, TenantScopedDirectory

    d = TenantScopedDirectory(InMemoryDirectory(), "default", namespace_digest=namespace.digest)
    peers = _Peers()
    (a,) = _on_demand(llamas, model, namespace, server, d, peers, ["a"], [0])
    toks = prompt(llamas[0], 64, seed=51)
    a.prefill(toks)
    keys = list(a._held)
    a.send_wait_s = 0.2
    got = []
    with a.lock:  # what a prefill in another thread holds
        t = threading.Thread(target=lambda: got.append(a.send_blocks(keys)))
        t.start()
        t.join(timeout=5)
    assert got == [0] and a.counts["sends_refused_busy"] == 1 and a.counts["sent_blocks"] == 0
    assert a.send_blocks(keys) == 4  # free again: the context still holds them


class _HungPeers:
    def __init__(self, wait_s):
        self.wait_s, self.release = wait_s, __import__("threading").Event()

    def send(self, engine, keys):
        self.release.wait(self.wait_s)
        return len(keys)


class _LyingPeers:
    def send(self, engine, keys):
        return 10**6  # claims it sent a million blocks, sends none


def test_a_pull_has_a_deadline_and_a_peers_claim_is_checked_against_the_store(llamas, model, namespace, server):
    """A sender that blocked 20 s made prefill take 20 s with load_timeout_s=5, the controller counting the load in
    flight all along; one that claimed 10^6 blocks and sent none was reported as pulled_blocks=10. A pull now waits at
    most the load's deadline (pulls_timeout, the controller told of a timeout, nothing left in flight), and what a
    peer claims is confirmed with the store (pulls_short): b recomputes, with a cold prefill's logits."""
    import time

    from kvpolicy.admission import AdmissionController, LatencyModel, LinkPrior
    from kvpolicy.directory import InMemoryDirectory, TenantScopedDirectory
    from kvpolicy.integrations.llamacpp import LlamaCppReplica
    from kvpolicy.profile import PrefillModel

    d = TenantScopedDirectory(InMemoryDirectory(), "default", namespace_digest=namespace.digest)
    toks = prompt(llamas[0], 100, seed=61)
    holder = replica(llamas[0], model, namespace, store=client(server, namespace, model), directory=d, publish_filter=_Never(),
                     advertise=True, peers=_Peers(), replica="a")
    holder.prefill(toks)
    want = cold_logits(llamas[2], toks + [9])
    hung = _HungPeers(20.0)
    prefill = PrefillModel(a_s=0.01, b_s_per_token=1e-3, c_s_per_token2=0.0, rms_rel_error=float("nan"), max_rel_error=float("nan"))
    ctl = AdmissionController(LatencyModel(LinkPrior(bandwidth_bytes_per_s=1e12), prefill))
    b = replica(llamas[1], model, namespace, store=client(server, namespace, model), directory=d, publish_filter=_Never(),
                advertise=True, peers=hung, replica="b", controller=ctl)
    b.load_timeout_s = 0.5
    t0 = time.perf_counter()
    got = b.prefill(toks + [9])
    took = time.perf_counter() - t0
    hung.release.set()
    assert took < 5.0, took
    assert (got.remote_found, got.pulled_blocks, got.loaded_blocks) == (6, 0, 0) and b.counts["pulls_timeout"] == 1
    assert got.load_status == "timeout" and ctl.loads_in_flight() == 0
    assert np.abs(got.logits - want).max() == 0.0
    liar = replica(llamas[1], model, namespace, store=client(server, namespace, model), directory=d, publish_filter=_Never(),
                   advertise=True, peers=_LyingPeers(), replica="c")
    got = liar.prefill(toks + [9])
    assert (got.pulled_blocks, got.loaded_blocks) == (0, 0) and liar.counts["pulled_blocks"] == 0
    assert liar.counts["pulls_short"] == 1 and "claimed 1000000" in liar.last_error
    assert np.abs(got.logits - want).max() == 0.0
    assert isinstance(liar, LlamaCppReplica)


class _EmptyPeers:
    def __init__(self):
        self.asked = 0

    def send(self, engine, keys):
        self.asked += 1
        return 0  # holds none of them any more


def test_a_peer_that_sends_nothing_leaves_no_admitted_load_in_flight(llamas, model, namespace, server):
    """Issue #60: the controller admitted a load of the peer's run; the peer sent nothing. The load never starts, so the
    controller is told (cancel) — no slot leaks — and the request computes, with a cold prefill's logits."""
    from kvpolicy.admission import AdmissionController, LatencyModel, LinkPrior
    from kvpolicy.directory import InMemoryDirectory, TenantScopedDirectory
    from kvpolicy.profile import PrefillModel

    d = TenantScopedDirectory(InMemoryDirectory(), "default", namespace_digest=namespace.digest)
    toks = prompt(llamas[0], 100, seed=71)
    holder = replica(llamas[0], model, namespace, store=client(server, namespace, model), directory=d, publish_filter=_Never(),
                     advertise=True, peers=_Peers(), replica="a")
    holder.prefill(toks)
    want = cold_logits(llamas[2], toks + [4])
    prefill = PrefillModel(a_s=0.01, b_s_per_token=1e-3, c_s_per_token2=0.0, rms_rel_error=float("nan"), max_rel_error=float("nan"))
    ctl = AdmissionController(LatencyModel(LinkPrior(bandwidth_bytes_per_s=1e12), prefill))
    empty = _EmptyPeers()
    b = replica(llamas[1], model, namespace, store=client(server, namespace, model), directory=d, publish_filter=_Never(),
                advertise=True, peers=empty, replica="b", controller=ctl)
    for round_ in range(3):  # a leaked slot would pile up, round after round
        got = b.prefill(toks + [4])
        assert got.decision is not None and got.decision.loads and empty.asked == round_ + 1
        assert (got.pulled_blocks, got.loaded_blocks, got.load_status) == (0, 0, None)
        assert ctl.loads_in_flight() == 0
        assert np.abs(got.logits - want).max() == 0.0
        b.llm.reset()
