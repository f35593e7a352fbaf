import pytest
from hypothesis import given, strategies as st

from helpers import ns
from kvpolicy.errors import ConfigError
from kvpolicy.keys import Namespace

VARIANTS = {
    "model_id": "m2",
    "model_revision": "r2",
    "tokenizer_version": "t2",
    "kv_dtype": "fp16",
    "block_size_tokens": 16,
    "position_encoding": {"rope_theta": 1e6},
    "attention": "other",
    "tenant": "acme",
    "data_class": "private",
}


@pytest.mark.parametrize("field", sorted(VARIANTS))
def test_every_field_changes_the_digest(field):
    assert ns().digest != ns().evolve(**{field: VARIANTS[field]}).digest


def test_adapter_changes_the_digest():
    a = ns(adapter_name="x", adapter_version="1")
    assert a.digest != ns().digest
    assert a.digest != a.evolve(adapter_version="2").digest


@given(st.permutations(["rope_theta", "factor", "type", "low"]))
def test_field_order_never_changes_the_digest(order):
    values = {"rope_theta": 500000.0, "factor": 8.0, "type": "llama3", "low": {"b": 1, "a": 2}}
    a = ns(position_encoding={k: values[k] for k in order})
    assert a.digest == ns(position_encoding=values).digest


def test_integral_floats_are_canonical():
    assert ns(position_encoding={"rope_theta": 10000}).digest == ns(position_encoding={"rope_theta": 10000.0}).digest


def test_round_trip_and_digest_size():
    a = ns(position_encoding={"rope_theta": 500000, "rope_scaling": {"factor": 8.0, "type": "llama3"}}, adapter_name="x", adapter_version="1")
    assert Namespace.from_dict(a.to_dict()) == a
    assert len(a.digest) == 16
    assert b'"schema_version":1' in a.canonical_bytes()


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"model_id": ""}, "model_id"),
        ({"kv_dtype": "fp4x"}, "kv_dtype"),
        ({"block_size_tokens": 0}, "block_size_tokens"),
        ({"block_size_tokens": True}, "block_size_tokens"),
        ({"data_class": "secret"}, "data_class"),
        ({"adapter_name": "x"}, "adapter_version"),
        ({"position_encoding": {"rope_theta": float("nan")}}, "position_encoding.rope_theta"),
        ({"position_encoding": {"": 1}}, "position_encoding"),
        ({"position_encoding": [1, 2]}, "position_encoding"),
    ],
)
def test_bad_fields_are_named(kw, field):
    with pytest.raises(ConfigError) as exc:
        ns(**kw)
    assert exc.value.field == field


def test_from_dict_rejects_unknown_missing_and_versions():
    d = ns().to_dict()
    with pytest.raises(ConfigError, match="colour"):
        Namespace.from_dict({**d, "colour": "red"})
    d2 = dict(d)
    del d2["model_id"]
    with pytest.raises(ConfigError, match="model_id"):
        Namespace.from_dict(d2)
    with pytest.raises(ConfigError, match="schema_version"):
        Namespace.from_dict({**d, "schema_version": 99})


def test_frozen():
    with pytest.raises(AttributeError):
        ns().tenant = "x"  # type: ignore[misc]
