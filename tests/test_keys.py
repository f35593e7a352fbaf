import hashlib

import numpy as np
import pytest
from hypothesis import given, strategies as st

from helpers import SECRET, ns
from kvpolicy.errors import ConfigError, KVPolicyError
from kvpolicy.keys import BlockHasher, BlockKeys, Namespace, cbor, extra_digest

tokens_st = st.lists(st.integers(0, 2**32 - 1), max_size=60)
small_tokens_st = st.lists(st.integers(0, 7), max_size=60)
schemes = st.sampled_from(["keyed", "fast"])


def hasher(scheme="keyed", **kw):
    return BlockHasher(ns(**kw), scheme, secret=SECRET if scheme == "keyed" else None)


@given(tokens_st, schemes)
def test_only_full_blocks_get_keys(tokens, scheme):
    keys = hasher(scheme).hash_blocks(tokens)
    assert len(keys) == len(tokens) // 4


@given(tokens_st, schemes)
def test_chain_is_deterministic(tokens, scheme):
    assert hasher(scheme).hash_blocks(tokens) == hasher(scheme).hash_blocks(np.array(tokens, dtype=np.int64))


@given(tokens_st.filter(len), schemes, st.data())
def test_key_i_depends_on_every_token_up_to_block_i(tokens, scheme, data):
    h = hasher(scheme)
    pos = data.draw(st.integers(0, len(tokens) - 1), label="pos")  # every example changes a real token: none is skipped
    new = data.draw(st.integers(0, 2**32 - 1).filter(lambda v: v != tokens[pos]), label="new")
    changed = list(tokens)
    changed[pos] = new
    a, b = h.hash_blocks(tokens), h.hash_blocks(changed)
    first = pos // 4
    assert a[:first] == b[:first]  # blocks before the change keep their keys
    for i in range(first, len(a)):  # one changed token shifts every key after it
        assert a[i] != b[i]


@given(tokens_st, schemes, st.data())
def test_kernel_equals_pure_python_reference(tokens, scheme, data):
    h = hasher(scheme)
    n = len(tokens) // 4
    extra = {i: data.draw(st.one_of(st.none(), st.text(max_size=3), st.integers())) for i in range(n)}
    keys = h.hash_blocks(tokens, extra_keys=extra)
    parent = h.root
    for i in range(n):
        parent = h.hash_block_reference(parent, tokens[4 * i : 4 * i + 4], extra[i])
        assert parent == keys[i]


def test_keyed_reference_is_hashlib_blake2b():
    h = hasher("keyed")
    toks = [1, 2, 3, 4]
    msg = h.root + np.asarray(toks, dtype="<u4").tobytes()
    want = hashlib.blake2b(msg, key=SECRET, digest_size=16, person=b"kvpolicy.blk.v1").digest()
    assert h.hash_blocks(toks)[0] == want


@given(st.lists(st.lists(st.integers(0, 2**32 - 1), max_size=9), max_size=6), schemes)
def test_incremental_equals_from_scratch(chunks, scheme):
    h = hasher(scheme)
    chain = h.chain()
    got = []
    for c in chunks:
        new = chain.extend(c)
        got.extend(new)
    full = [t for c in chunks for t in c]
    scratch = h.hash_blocks(full)
    assert list(scratch) == got
    assert chain.keys == scratch
    assert chain.num_tokens == len(full)
    assert chain.last_key == (scratch.last() if len(scratch) else None)


def test_incremental_with_extras_and_parent():
    h = hasher("fast")
    toks = list(range(20))
    whole = h.hash_blocks(toks, extra_keys={3: "img-1"})
    chain = h.chain()
    chain.extend(toks[:6])
    chain.extend(toks[6:], extra_keys={3: "img-1"})
    assert chain.keys == whole
    rest = h.hash_blocks(toks[8:], parent=whole[1], extra_keys={1: "img-1"})
    assert list(rest) == list(whole[2:])
    with pytest.raises(ConfigError, match="extra_keys"):
        chain.extend([1], extra_keys={0: "too late"})


FIELDS = {
    "tenant": "other-tenant",
    "data_class": "private",
    "model_revision": "r2",
    "model_id": "other",
    "tokenizer_version": "t2",
    "kv_dtype": "fp8",
    "attention": "flashinfer/nhd",
    "position_encoding": {"rope_theta": 1000000},
}


@given(st.lists(st.integers(0, 2**32 - 1), min_size=4, max_size=40), st.sampled_from(sorted(FIELDS)), schemes)
def test_tenancy_and_compat_fields_never_share_a_key(tokens, field, scheme):
    base = ns(position_encoding={"rope_theta": 500000})
    other = base.evolve(**{field: FIELDS[field]})
    secret = SECRET if scheme == "keyed" else None
    a = BlockHasher(base, scheme, secret=secret).hash_blocks(tokens)
    b = BlockHasher(other, scheme, secret=secret).hash_blocks(tokens)
    assert not set(a) & set(b)


@given(st.lists(st.integers(0, 2**32 - 1), min_size=8, max_size=40), schemes)
def test_adapter_and_block_size_never_share_a_key(tokens, scheme):
    secret = SECRET if scheme == "keyed" else None
    base = BlockHasher(ns(), scheme, secret=secret).hash_blocks(tokens)
    lora = BlockHasher(ns(adapter_name="a", adapter_version="1"), scheme, secret=secret).hash_blocks(tokens)
    lora2 = BlockHasher(ns(adapter_name="a", adapter_version="2"), scheme, secret=secret).hash_blocks(tokens)
    bs8 = BlockHasher(ns(block_size_tokens=8), scheme, secret=secret).hash_blocks(tokens)
    sets = [set(base), set(lora), set(lora2), set(bs8)]
    for i in range(4):
        for j in range(i + 1, 4):
            assert not sets[i] & sets[j]


def test_secret_changes_every_key_and_keyed_needs_one():
    toks = list(range(16))
    a = BlockHasher(ns(), "keyed", secret=SECRET).hash_blocks(toks)
    b = BlockHasher(ns(), "keyed", secret=bytes(32)).hash_blocks(toks)
    assert not set(a) & set(b)
    with pytest.raises(ConfigError, match="secret"):
        BlockHasher(ns(), "keyed")
    with pytest.raises(ConfigError, match="secret"):
        BlockHasher(ns(), "keyed", secret=b"short")
    with pytest.raises(ConfigError, match="scheme"):
        BlockHasher(ns(), "md5")  # type: ignore[arg-type]


def test_fast_scheme_has_no_collisions_on_near_identical_blocks():
    h = hasher("fast")
    seen = set()
    base = np.zeros(4, dtype=np.uint32)
    for pos in range(4):
        for v in range(2000):
            t = base.copy()
            t[pos] = v
            seen.add(h.hash_blocks(t)[0])
    assert len(seen) == 4 * 2000 - 3  # the all-zero block appears once per position


@pytest.mark.parametrize(
    "bad, msg",
    [([1, -1, 2], "position 1 is -1"), ([1, 2**32], "position 1"), ([1.5, 2.0], "integers"), ([[1, 2], [3, 4]], "1-D"), (["a"], "integers"), ([True, False], "integers"),
     ([1, 2, 4.0], "position 2 is 4.0"), ([7, 8, "9"], "position 2 is '9'")],  # numpy made the whole list floats: "position 0 is 1.0"
)
def test_bad_tokens_name_the_position(bad, msg):
    with pytest.raises(ConfigError, match=msg) as exc:
        hasher("fast").hash_blocks(bad)
    assert exc.value.field == "tokens"
    assert isinstance(exc.value, ValueError) and isinstance(exc.value, KVPolicyError)


def test_bad_parent_and_extra_index():
    h = hasher("fast")
    with pytest.raises(ConfigError, match="parent"):
        h.hash_blocks([1, 2, 3, 4], parent=b"short")
    with pytest.raises(ConfigError, match="extra_keys"):
        h.hash_blocks([1, 2, 3, 4], extra_keys={-1: "x"})


def test_block_keys_views():
    keys = hasher("fast").hash_blocks(list(range(12)))
    assert isinstance(keys, BlockKeys) and len(keys) == 3
    assert [bytes.fromhex(x) for x in keys.hex()] == list(keys)
    i64 = keys.as_int64()
    assert i64.dtype == np.int64
    assert int(i64[0]) == int.from_bytes(keys[0][:8], "little", signed=True)
    assert keys[1:] == BlockKeys(keys.array[1:], 4)
    assert keys.last() == keys[2]
    with pytest.raises(ValueError):
        keys.array[0, 0] = 1  # read-only


@given(
    st.recursive(
        st.one_of(st.none(), st.booleans(), st.integers(-(2**80), 2**80), st.text(max_size=8), st.binary(max_size=40)),
        lambda inner: st.lists(inner, max_size=5).map(tuple),
        max_leaves=12,
    )
)
def test_cbor_encoder_matches_cbor2(value):
    cbor2 = pytest.importorskip("cbor2")
    assert cbor.dumps(value) == cbor2.dumps(value, canonical=True)


@given(st.lists(st.integers(0, 2**32 - 1), max_size=50))
def test_vectorised_cbor_uint_array(values):
    buf, offsets = cbor.encode_uint_array(np.asarray(values, dtype=np.uint64))
    assert buf == b"".join(cbor.dumps(v) for v in values)
    assert len(offsets) == len(values) + 1


def test_extra_digest_is_canonical():
    assert extra_digest(("img", 1)) == extra_digest(["img", 1])
    assert extra_digest(("img", 1)) != extra_digest(("img", 2))


# ---------------------------------------------------------------- the vLLM projection's other cases, from vLLM's documented rules
# (vllm/v1/core/kv_cache_utils.py: hash_block_tokens, init_none_hash, get_request_block_hasher,
#  BlockHashListWithBlockSize; vllm/utils/hashing.py), written out here independently of kvpolicy's code


def _vllm_reference(tokens, bs, hash_fn, seed, salt=None, lookahead=0):
    parent = hash_fn(seed)
    out = []
    n = (len(tokens) - lookahead) // bs
    for i in range(n):
        extra = (("cache_salt", salt),) if (salt and i == 0) else None
        if lookahead:
            extra = (extra, *tokens[(i + 1) * bs:(i + 1) * bs + lookahead])
        parent = hash_fn((parent, tuple(tokens[i * bs:(i + 1) * bs]), extra))
        out.append(parent)
    return out


def _sha_pickle(obj):
    import hashlib as _h
    import pickle as _p

    return _h.sha256(_p.dumps(obj, protocol=_p.HIGHEST_PROTOCOL)).digest()


def test_vllm_projection_drops_an_empty_salt_and_takes_the_engines_hash_seed():
    from kvpolicy.keys import vllm_block_hashes

    toks = list(range(7, 7 + 3 * 16))
    assert vllm_block_hashes(toks, 16, cache_salt="") == vllm_block_hashes(toks, 16)
    assert vllm_block_hashes(toks, 16, none_hash_seed="1234") == _vllm_reference(toks, 16, _sha_pickle, "1234")
    assert vllm_block_hashes(toks, 16, none_hash_seed="1234") != vllm_block_hashes(toks, 16)


@pytest.mark.parametrize("algo", ["xxhash", "xxhash_cbor"])
def test_vllm_projection_xxhash_needs_the_seed_and_matches_the_rule(algo):
    xxhash = pytest.importorskip("xxhash")
    import pickle as _p

    import cbor2

    from kvpolicy.errors import ConfigError
    from kvpolicy.keys import vllm_block_hashes

    toks = list(range(100, 100 + 2 * 16 + 5))

    def fn(obj):
        data = _p.dumps(obj, protocol=_p.HIGHEST_PROTOCOL) if algo == "xxhash" else cbor2.dumps(obj, canonical=True)
        return xxhash.xxh3_128_digest(data)

    with pytest.raises(ConfigError, match="none_hash_seed"):
        vllm_block_hashes(toks, 16, algo)
    assert vllm_block_hashes(toks, 16, algo, none_hash_seed="0", cache_salt="s") == _vllm_reference(toks, 16, fn, "0", salt="s")


@pytest.mark.parametrize("lookahead", [1, 3])
def test_vllm_projection_with_lookahead_tokens(lookahead):
    from kvpolicy.keys import vllm_block_hashes

    toks = list(range(1, 1 + 3 * 16 + 2))  # 50 tokens: 3 full blocks, the third has 2 tokens after it
    got = vllm_block_hashes(toks, 16, lookahead_tokens=lookahead)
    want = _vllm_reference(toks, 16, _sha_pickle, "vllm-none-hash", lookahead=lookahead)
    assert got == want and len(got) == (3 if lookahead <= 2 else 2), "a block is hashed only once its lookahead tokens exist"
    assert got[0] != vllm_block_hashes(toks, 16)[0]


def test_vllm_group_block_sizes_and_int_hashes():
    from kvpolicy.errors import ConfigError
    from kvpolicy.keys import vllm_block_hashes, vllm_group_block_hashes, vllm_int_hash

    toks = list(range(64))
    h16 = vllm_block_hashes(toks, 16)
    assert vllm_group_block_hashes(h16, 16, 32) == [h16[1], h16[3]]  # vLLM's own example: B and D
    with pytest.raises(ConfigError, match="target_block_size"):
        vllm_group_block_hashes(h16, 16, 24)
    assert vllm_int_hash(h16[0]) == int.from_bytes(h16[0][-8:], "big") < 2**64


@pytest.mark.parametrize("bad", [["bf16"], {"dtype": "bf16"}, None, 16, "fp4"])
def test_namespace_kv_dtype_is_a_known_name(bad):
    """A list or a dict for kv_dtype was a TypeError (unhashable) from the membership test; any non-name is a ConfigError."""
    with pytest.raises(ConfigError) as e:
        Namespace(model_id="m", model_revision="r", tokenizer_version="t", kv_dtype=bad, block_size_tokens=16)
    assert e.value.field == "kv_dtype"
