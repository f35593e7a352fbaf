import json

import pytest
from hypothesis import given, strategies as st

from kvpolicy.data import bundled_configs
from kvpolicy.errors import ConfigError, ProfileRequiredError
from kvpolicy.geometry import KVGeometry, useful_tokens

LLAMA3_8B = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096, "torch_dtype": "bfloat16"}


def test_llama3_8b_is_131072_bytes_per_token():
    g = KVGeometry.from_hf_config(LLAMA3_8B)
    assert g.bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131072
    assert KVGeometry.from_hf_config(bundled_configs()["llama-3-8b"]).bytes_per_token == 131072


def test_gqa_uses_kv_heads_not_query_heads():
    mha = KVGeometry.from_hf_config({k: v for k, v in LLAMA3_8B.items() if k != "num_key_value_heads"})
    assert mha.bytes_per_token == 4 * 131072


def test_fp8_override_and_head_dim_field():
    assert KVGeometry.from_hf_config(LLAMA3_8B, kv_dtype="fp8").bytes_per_token == 65536
    cfg = {**LLAMA3_8B, "head_dim": 256}
    assert KVGeometry.from_hf_config(cfg).bytes_per_token == 2 * 32 * 8 * 256 * 2


def test_text_config_nesting(tmp_path):
    p = tmp_path / "config.json"
    p.write_text(json.dumps({"model_type": "llava", "text_config": LLAMA3_8B}))
    assert KVGeometry.from_hf_config(p).bytes_per_token == 131072
    # the dtype stated once, at the top (Qwen2-VL's layout): the text model's KV is in it
    inner = {k: v for k, v in LLAMA3_8B.items() if k != "torch_dtype"}
    p.write_text(json.dumps({"model_type": "qwen2_vl", "torch_dtype": "float32", "text_config": inner}))
    assert KVGeometry.from_hf_config(p).bytes_per_token == 262144
    p.write_text(json.dumps({"model_type": "qwen2_vl", "text_config": inner}))
    with pytest.raises(ConfigError, match="torch_dtype"):
        KVGeometry.from_hf_config(p)


def test_mla_has_its_own_formula():
    g = KVGeometry.from_hf_config(bundled_configs()["deepseek-v3"])
    assert g.kind == "mla"
    assert g.bytes_per_token == 61 * (512 + 64) * 2


def test_qwen_sliding_window_disabled_uses_dense_formula():
    assert KVGeometry.from_hf_config(bundled_configs()["qwen2.5-7b"]).bytes_per_token == 2 * 28 * 4 * 128 * 2


@pytest.mark.parametrize(
    "extra",
    [
        {"sliding_window": 4096},
        {"layer_types": ["full_attention", "sliding_attention"]},
        {"attention_chunk_size": 8192},
        {"layers_block_type": ["attention", "mamba"]},
    ],
)
def test_nonlinear_caches_need_a_measured_profile(extra):
    with pytest.raises(ProfileRequiredError, match="measure"):
        KVGeometry.from_hf_config({**LLAMA3_8B, **extra})


@pytest.mark.parametrize(
    "cfg, field",
    [
        ({**LLAMA3_8B, "num_hidden_layers": 0}, "num_hidden_layers"),
        ({k: v for k, v in LLAMA3_8B.items() if k != "torch_dtype"}, "torch_dtype"),
        ({**LLAMA3_8B, "torch_dtype": "float64x"}, "torch_dtype"),
        ({**LLAMA3_8B, "num_key_value_heads": 5}, "num_key_value_heads"),
        ({**LLAMA3_8B, "hidden_size": 4097}, "hidden_size"),
        ({"num_hidden_layers": 2, "kv_lora_rank": 512, "torch_dtype": "bf16"}, "qk_rope_head_dim"),
    ],
)
def test_bad_configs_name_the_field(cfg, field):
    with pytest.raises(ConfigError, match=field):
        KVGeometry.from_hf_config(cfg)


def test_bad_config_files(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        KVGeometry.from_hf_config(tmp_path / "missing.json")
    p = tmp_path / "bad.json"
    p.write_text('{"a":\n  oops}')
    with pytest.raises(ConfigError, match=r"bad.json:2"):
        KVGeometry.from_hf_config(p)
    with pytest.raises(ConfigError, match="kv_dtype"):
        KVGeometry.from_hf_config(LLAMA3_8B, kv_dtype="int3")


@given(st.integers(0, 10**7), st.integers(1, 4096))
def test_useful_tokens_is_a_multiple_of_b_and_at_most_t(t, b):
    u = useful_tokens(t, b)
    assert u <= t and u % b == 0 and t - u < b


@given(st.integers(0, 10**6), st.integers(1, 1024))
def test_load_bytes_is_bytes_per_token_times_useful(t, b):
    g = KVGeometry.dense(num_layers=2, num_kv_heads=2, head_dim=4, bytes_per_element=2)
    assert g.load_bytes(t, b) == g.bytes_per_token * useful_tokens(t, b)
    assert g.kv_bytes(t) == 2 * 2 * 2 * 4 * 2 * t


def test_geometry_validation():
    with pytest.raises(ConfigError, match="num_layers"):
        KVGeometry.dense(num_layers=0, num_kv_heads=1, head_dim=1, bytes_per_element=2)
    with pytest.raises(ConfigError, match="num_kv_heads"):
        KVGeometry(num_layers=1, bytes_per_element=2)
    with pytest.raises(ConfigError, match="kind"):
        KVGeometry(num_layers=1, bytes_per_element=2, num_kv_heads=1, head_dim=1, kind="ssm")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="block_size_tokens"):
        useful_tokens(10, 0)
    with pytest.raises(ConfigError, match="matched_tokens"):
        useful_tokens(-1, 16)
