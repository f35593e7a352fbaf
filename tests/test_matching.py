import pytest
from hypothesis import given, strategies as st

from helpers import ns
from kvpolicy.errors import ConfigError
from kvpolicy.keys import BlockHasher
from kvpolicy.matching import InMemoryBlockIndex, match
from kvpolicy.protocols import BlockIndex

B = 4
H = BlockHasher(ns(block_size_tokens=B), "fast")


def keys_for(n_tokens, seed=0):
    return H.hash_blocks([(seed * 1000 + i) % 97 for i in range(n_tokens)])


@given(st.integers(0, 80), st.sets(st.integers(0, 25)), st.sets(st.integers(0, 25)))
def test_match_invariants(n_tokens, local_ids, remote_ids):
    keys = keys_for(n_tokens)
    local = InMemoryBlockIndex(keys[i] for i in local_ids if i < len(keys))
    remote = InMemoryBlockIndex((keys[i] for i in remote_ids if i < len(keys)), name="pool")
    m = match(keys, n_tokens, local, remote)
    # the useful prefix is block-aligned and never includes the last token
    assert m.useful_tokens % B == 0
    assert m.useful_tokens <= max(n_tokens - 1, 0)
    assert m.recompute_tokens >= 1 or n_tokens == 0
    assert m.useful_tokens + m.recompute_tokens == n_tokens
    # a leading run: every matched block is present in the tier that served it
    for i in range(m.local_blocks):
        assert keys[i] in local
    s, e = m.remote_block_range(0)
    assert s == m.local_blocks
    for i in range(s, e):
        assert keys[i] in remote
    # nothing after a gap counts: the run stops at the first block neither tier continues
    nxt = m.matched_blocks
    if nxt < m.matchable_blocks:
        assert m.stop_reason == "miss"
        assert keys[nxt] not in remote or nxt < m.local_blocks
    assert m.tier_names == ("pool",)


@given(st.integers(1, 20))
def test_exact_multiple_of_b_never_counts_the_final_block(n_blocks):
    n_tokens = n_blocks * B
    keys = keys_for(n_tokens)
    m = match(keys, n_tokens, InMemoryBlockIndex(keys))
    assert m.local_blocks == n_blocks - 1
    assert m.recompute_tokens == B
    assert m.stop_reason == ("all_matchable_found" if n_blocks > 1 else "no_matchable_block")


@given(st.integers(1, 20), st.integers(1, B - 1))
def test_partial_block_is_never_a_hit(n_blocks, tail):
    n_tokens = n_blocks * B + tail
    keys = keys_for(n_tokens)
    m = match(keys, n_tokens, InMemoryBlockIndex(keys))
    assert m.local_blocks == n_blocks
    assert m.partial_tail_tokens == tail == m.recompute_tokens


def test_remote_after_a_local_gap_does_not_count():
    keys = keys_for(41)  # 10 full blocks
    local = InMemoryBlockIndex([keys[0], keys[1], keys[3]])
    remote = InMemoryBlockIndex([keys[4], keys[5]])
    m = match(keys, 41, local, remote)
    assert (m.local_blocks, m.remote_blocks, m.stop_reason) == (2, (0,), "miss")
    remote.add([keys[2]])
    m = match(keys, 41, local, remote)
    # block 3 is local-only; tiers continue in order, so the remote tier serves 2 and stops at 3
    assert (m.local_blocks, m.remote_blocks) == (2, (1,))


def test_two_remote_tiers_continue_in_order():
    keys = keys_for(33)  # 8 full blocks, 8 matchable (33-1)//4 = 8
    cpu = InMemoryBlockIndex(keys[2:4], name="cpu")
    pool = InMemoryBlockIndex(keys[4:8], name="pool")
    m = match(keys, 33, InMemoryBlockIndex(keys[:2]), cpu, pool)
    assert (m.local_blocks, m.remote_blocks, m.tier_names) == (2, (2, 4), ("cpu", "pool"))
    assert m.useful_tokens == 32 and m.recompute_tokens == 1
    assert m.remote_block_range(1) == (4, 8)


def test_no_local_cache_and_protocol():
    keys = keys_for(20)
    idx = InMemoryBlockIndex(keys)
    assert isinstance(idx, BlockIndex)
    m = match(keys, 20, None, idx)
    assert (m.local_blocks, m.remote_blocks) == (0, (4,))


class Liar:
    def match_prefix(self, keys):
        return len(keys) + 1


def test_bad_inputs_are_named():
    keys = keys_for(20)
    with pytest.raises(ConfigError, match="keys"):
        match(keys, 10, None)
    with pytest.raises(ConfigError, match="block_size_tokens"):
        match(list(keys), 20, None)
    with pytest.raises(ConfigError, match="block_size_tokens"):
        match(keys, 20, None, block_size_tokens=8)
    with pytest.raises(ConfigError, match="num_tokens"):
        match(keys, -1, None)
    for one_key in (b"k" * 16, "k" * 16, None):  # a single key (its bytes became 16 "keys") or nothing: not a chain
        with pytest.raises(ConfigError, match="keys: must be BlockKeys or a sequence"):
            match(one_key, 1000, None, block_size_tokens=16)
    with pytest.raises(ConfigError, match="'liar'"):
        match(keys, 20, None, Liar(), tier_names=["liar"])
    with pytest.raises(ConfigError, match="tier_names"):
        match(keys, 20, None, Liar(), tier_names=[])
    with pytest.raises(ConfigError, match="16-byte"):
        InMemoryBlockIndex([b"x"])
    idx = InMemoryBlockIndex(keys[:2])
    for bad in (2**62, -1, "k" * 16):  # bytes(2**62) would try to allocate 4 EiB of zeros: checked as add() checks
        with pytest.raises(ConfigError, match="16-byte"):
            idx.discard([bad])
    idx.discard([keys[0], b"\0" * 16])  # a key that is not there is no error
    assert len(idx) == 1


def test_plain_sequence_keys_with_block_size():
    keys = keys_for(20)
    m = match(list(keys), 20, InMemoryBlockIndex(keys), block_size_tokens=B)
    assert m.local_blocks == 4
