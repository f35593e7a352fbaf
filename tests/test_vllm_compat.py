import json
from pathlib import Path

import pytest
from hypothesis import given, strategies as st

from kvpolicy.errors import ConfigError
from kvpolicy.keys import vllm_block_hashes, vllm_none_hash

VECTORS = json.loads((Path(__file__).parent / "data" / "vllm_0_33_block_hashes.json").read_text())["cases"]


@pytest.mark.parametrize("case", VECTORS, ids=lambda c: f"{c['algo']}-B{c['block_size']}-n{len(c['token_ids'])}-salt{c['cache_salt']}-lora{c['lora_name']}")
def test_every_vllm_vector(case):
    assert vllm_none_hash(case["algo"]).hex() == case["none_hash"]
    got = vllm_block_hashes(case["token_ids"], case["block_size"], case["algo"], case["cache_salt"], case["lora_name"], case["lora_path"])
    assert [h.hex() for h in got] == case["block_hashes"]


def test_all_vector_kinds_are_present():
    algos = {c["algo"] for c in VECTORS}
    assert algos == {"sha256", "sha256_cbor"}
    assert any(c["cache_salt"] for c in VECTORS) and any(c["lora_name"] for c in VECTORS)


@given(st.lists(st.integers(0, 200000), max_size=40), st.integers(1, 40), st.sampled_from(["sha256", "sha256_cbor"]))
def test_continuing_a_chain_equals_from_scratch(tokens, cut_blocks, algo):
    bs = 4
    whole = vllm_block_hashes(tokens, bs, algo, cache_salt="s")
    k = min(cut_blocks, len(whole))
    if k == 0:
        return
    rest = vllm_block_hashes(tokens[k * bs :], bs, algo, cache_salt="s", parent=whole[k - 1], first_block_index=k)
    assert whole[k:] == rest


def test_vllm_errors():
    with pytest.raises(ConfigError, match="algo"):
        vllm_block_hashes([1], 1, "md5")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="block_size"):
        vllm_block_hashes([1], 0)
    with pytest.raises(ConfigError, match="lora_path"):
        vllm_block_hashes([1], 1, lora_path="/x")


@given(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=300), st.integers(1, 40))
def test_spliced_pickle_equals_pickle_dumps(tokens, block_size):
    import hashlib
    import pickle

    parent = vllm_none_hash("sha256")
    want = []
    for i in range(len(tokens) // block_size):
        parent = hashlib.sha256(pickle.dumps((parent, tuple(tokens[i * block_size : (i + 1) * block_size]), None), protocol=pickle.HIGHEST_PROTOCOL)).digest()
        want.append(parent)
    assert vllm_block_hashes(tokens, block_size, "sha256") == want


def test_huge_blocks_fall_back_to_pickle():
    import hashlib
    import pickle

    tokens = [2**32 - 1] * 20000  # one 140 KB pickle: more than one frame
    root = vllm_none_hash("sha256")
    want = hashlib.sha256(pickle.dumps((root, tuple(tokens), None), protocol=pickle.HIGHEST_PROTOCOL)).digest()
    assert vllm_block_hashes(tokens, 20000, "sha256") == [want]
