import attrs
import numpy as np
import pytest
from hypothesis import given, strategies as st

from kvpolicy.errors import ProfileFormatError
from kvpolicy.profile import fit_prefill, parse_profile, read_profile

GOOD = """prefix_tokens,kv_bytes,cold_prefill_ms,local_hit_ttft_ms,remote_load_p95_ms
4096,536870912,310.5,22.0,90.1
16384,2147483648,1410.0,31.0,350.2
32768,4294967296,3190.0,45.5,700.9
65536,8589934592,7600.0,80.0,1400.0
"""


def test_read_write_round_trip(tmp_path):
    p = tmp_path / "profile.csv"
    p.write_text(GOOD)
    prof = read_profile(p)
    assert len(prof) == 4
    assert prof.bytes_per_token == pytest.approx(131072)
    assert np.allclose(prof.byte_slopes(), 131072)
    assert "remote_load_p95_ms" in prof.extra
    q = tmp_path / "again.csv"
    prof.write(q)
    again = read_profile(q)
    for col in ("prefix_tokens", "kv_bytes", "cold_prefill_ms", "local_hit_ttft_ms"):
        assert np.array_equal(getattr(again, col), getattr(prof, col))
    assert np.array_equal(again.extra["remote_load_p95_ms"], prof.extra["remote_load_p95_ms"])


@given(
    st.floats(0.0, 0.05),
    st.floats(1e-6, 1e-4),
    st.floats(0.0, 1e-9),
)
def test_fit_recovers_a_nonnegative_quadratic(a, b, c):
    t = np.array([1024, 4096, 16384, 32768, 65536], dtype=np.float64)
    y = a + b * t + c * t * t
    m = fit_prefill(t, y)
    assert m.max_rel_error < 1e-6
    assert np.allclose(m(t), y, rtol=1e-6)
    assert min(m.a_s, m.b_s_per_token, m.c_s_per_token2) >= 0


def test_fit_is_superlinear_and_extrapolates():
    t = np.array([4096, 16384, 32768, 65536], dtype=np.float64)
    y = 0.01 + 5e-5 * t + 2e-10 * t * t
    m = fit_prefill(t, y * (1 + np.array([0.01, -0.01, 0.01, -0.01])))
    assert m.c_s_per_token2 > 0
    assert m(131072) == pytest.approx(0.01 + 5e-5 * 131072 + 2e-10 * 131072**2, rel=0.05)
    assert 0 < m.rms_rel_error < 0.02


def test_fit_never_goes_negative_on_concave_data():
    t = np.array([1000, 2000, 4000, 8000], dtype=np.float64)
    y = np.sqrt(t) / 1000
    m = fit_prefill(t, y)
    assert min(m.a_s, m.b_s_per_token, m.c_s_per_token2) >= 0
    assert np.all(m(np.linspace(0, 20000, 50)) >= 0)


@pytest.mark.parametrize(
    "text, line, what",
    [
        ("prefix_tokens,kv_bytes,cold_prefill_ms\n1,2,3\n", 1, "missing column"),
        ("", None, "empty"),
        ("prefix_tokens,kv_bytes,cold_prefill_ms,local_hit_ttft_ms\n", 1, "no rows"),
        ("prefix_tokens,kv_bytes,cold_prefill_ms,local_hit_ttft_ms\n10,1,1,1\n10,2,2,2\n", 3, "does not increase"),
        ("prefix_tokens,kv_bytes,cold_prefill_ms,local_hit_ttft_ms\n10,1,1,1\n5,2,2,2\n", 3, "does not increase"),
        ("prefix_tokens,kv_bytes,cold_prefill_ms,local_hit_ttft_ms\n10,1,-1,1\n", 2, "negative"),
        ("prefix_tokens,kv_bytes,cold_prefill_ms,local_hit_ttft_ms\n10,nan,1,1\n", 2, "finite"),
        ("prefix_tokens,kv_bytes,cold_prefill_ms,local_hit_ttft_ms\n10,x,1,1\n", 2, "not a number"),
        ("prefix_tokens,kv_bytes,cold_prefill_ms,local_hit_ttft_ms\n10,1,1\n", 2, "expected 4 fields"),
        ("prefix_tokens,kv_bytes,cold_prefill_ms,local_hit_ttft_ms\n10.5,1,1,1\n", 2, "positive integer"),
        ("prefix_tokens,kv_bytes,cold_prefill_ms,local_hit_ttft_ms\n10,1,0,1\n", 2, "must be positive"),
        # past int64 (and past what a float holds exactly): a named row, not an OverflowError from numpy
        ("prefix_tokens,kv_bytes,cold_prefill_ms,local_hit_ttft_ms\n10,1,1,1\n99999999999999999999999999,1,1,1\n", 3, "larger than any prompt"),
        ("prefix_tokens,kv_bytes,cold_prefill_ms,local_hit_ttft_ms,kv_bytes\n", 1, "duplicate"),
        # the optional columns: half hits (together, a whole number of tokens below the prefix) and the tail
        ("prefix_tokens,kv_bytes,cold_prefill_ms,local_hit_ttft_ms,half_hit_cached_tokens\n10,1,1,1,5\n", 1, "needs its partner"),
        ("prefix_tokens,kv_bytes,cold_prefill_ms,local_hit_ttft_ms,half_hit_ttft_ms\n10,1,1,1,5\n", 1, "needs its partner"),
        ("prefix_tokens,kv_bytes,cold_prefill_ms,local_hit_ttft_ms,half_hit_cached_tokens,half_hit_ttft_ms\n10,1,1,1,10,1\n", 2, "below prefix_tokens"),
        ("prefix_tokens,kv_bytes,cold_prefill_ms,local_hit_ttft_ms,half_hit_cached_tokens,half_hit_ttft_ms\n10,1,1,1,4.5,1\n", 2, "whole number"),
        ("prefix_tokens,kv_bytes,cold_prefill_ms,local_hit_ttft_ms,half_hit_cached_tokens,half_hit_ttft_ms\n10,1,1,1,4,0\n", 2, "half_hit_ttft_ms"),
        ("prefix_tokens,kv_bytes,cold_prefill_ms,local_hit_ttft_ms,tail_tokens\n10,1,1,1,16\n20,2,2,2,16.5\n", 3, "tail_tokens"),
        ("prefix_tokens,kv_bytes,cold_prefill_ms,local_hit_ttft_ms,tail_tokens\n10,1,1,1,16\n20,2,2,2,99999999999999\n", 3, "tail_tokens"),
    ],
)
def test_malformed_profiles_name_the_line(text, line, what):
    with pytest.raises(ProfileFormatError, match=what) as exc:
        parse_profile(text, source="p.csv")
    assert exc.value.line == line
    assert exc.value.path == "p.csv"
    if line is not None:
        assert f"p.csv:{line}" in str(exc.value)


def test_missing_file(tmp_path):
    with pytest.raises(ProfileFormatError, match="no such file"):
        read_profile(tmp_path / "nope.csv")


def test_prefill_model_learns_what_reading_a_cached_prefix_costs():
    from kvpolicy.profile import MeasuredProfile

    L = np.array([1024, 2048, 4096, 8192])
    cold = 1e3 * (0.01 + 5e-5 * L + 1e-9 * L * L)
    hit = 1e3 * (0.004 + 2e-6 * L)  # the engine gathers cached KV: 2 us per cached token
    m = MeasuredProfile(prefix_tokens=L, kv_bytes=L * 512.0, cold_prefill_ms=cold, local_hit_ttft_ms=hit).prefill_model()
    assert m.d_s_per_cached_token == pytest.approx(2e-6, rel=1e-6)
    flat = MeasuredProfile(prefix_tokens=L, kv_bytes=L * 512.0, cold_prefill_ms=cold, local_hit_ttft_ms=np.full(4, 5.0)).prefill_model()
    assert flat.d_s_per_cached_token == pytest.approx(0.0, abs=1e-15)
    from kvpolicy.sim import ClusterConfig

    c = ClusterConfig(bytes_per_token=512, prefill=m)
    assert c.prefill_s(4096, 4096 + 16) - ClusterConfig(bytes_per_token=512, prefill=flat).prefill_s(4096, 4096 + 16) == pytest.approx(2e-6 * 4096)


def test_without_half_hit_rows_the_cross_term_is_the_causal_one():
    """No half-hit rows: a prefill after a cached prefix costs T_prefill(end) − T_prefill(start) + d·start,
    the formula the simulator and the admission controller used before the cross term existed."""
    from kvpolicy.profile import MeasuredProfile

    L = np.array([1024, 2048, 4096, 8192])
    cold = 1e3 * (0.01 + 5e-5 * L + 1e-9 * L * L)
    m = MeasuredProfile(prefix_tokens=L, kv_bytes=L * 512.0, cold_prefill_ms=cold, local_hit_ttft_ms=1e3 * (0.004 + 2e-6 * L)).prefill_model()
    assert m.cross_s_per_token2 is None and m.cross_rms_rel_error is None
    for start, end in ((0, 100), (1000, 1016), (5000, 9000)):
        want = m(end) - m(start) + m.a_s + m.d_s_per_cached_token * start
        assert m.prefill_s(start, end) == pytest.approx(want, rel=1e-12)
        assert m.marginal_s(start, end) == pytest.approx(m(end) - m(start), rel=1e-12)


def test_a_dense_engine_is_cheaper_after_a_hit_than_the_causal_formula_says():
    """The reference engine computes a dense score block per chunk: with half its prompt cached it
    costs less than c·(T² − r²). The half-hit rows see it and the model follows."""
    from kvpolicy.profile import MeasuredProfile

    L = np.array([512, 1024, 2048, 4096], dtype=np.int64)
    c = 1e-9

    def dense_s(start, end):  # q new tokens each attend to all `end` keys: q·end = q² + q·start
        q = end - start
        return 1e-3 + 1e-5 * q + c * q * end

    r = L // 2
    prof = MeasuredProfile(prefix_tokens=L, kv_bytes=L * 512.0, cold_prefill_ms=1e3 * dense_s(0, L), local_hit_ttft_ms=1e3 * dense_s(L, L),
                           extra={"half_hit_cached_tokens": r.astype(np.float64), "half_hit_ttft_ms": 1e3 * dense_s(r, L)})
    m = prof.prefill_model()
    assert m.cross_s_per_token2 == pytest.approx(c, rel=1e-3)
    assert m.prefill_s(4000, 4100) == pytest.approx(dense_s(4000, 4100), rel=1e-3)
    causal = attrs.evolve(m, cross_s_per_token2=None)
    # the causal formula charges each new token 2c per cached token, this engine c
    assert causal.prefill_s(4000, 4100) - dense_s(4000, 4100) == pytest.approx(c * 100 * 4000, rel=1e-3)


def test_a_negative_cross_term_is_refused():
    from kvpolicy.errors import ConfigError
    from kvpolicy.profile import PrefillModel

    with pytest.raises(ConfigError, match="cross_s_per_token2"):
        PrefillModel(a_s=0.0, b_s_per_token=1e-5, c_s_per_token2=0.0, rms_rel_error=0.0, max_rel_error=0.0, cross_s_per_token2=-1e-9)


@pytest.mark.parametrize("field", ["a_s", "b_s_per_token", "c_s_per_token2", "d_s_per_cached_token"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1e-9])
def test_a_prefill_coefficient_that_cannot_be_is_refused(field, bad):
    """A NaN coefficient made every T_recompute NaN and the controller's decisions arbitrary, silently (offered 100
    remote blocks that win, it loaded 1). The fit's own errors may be NaN (not measured)."""
    from kvpolicy.errors import ConfigError
    from kvpolicy.profile import PrefillModel

    kw = {"a_s": 0.0, "b_s_per_token": 1e-5, "c_s_per_token2": 0.0, "rms_rel_error": float("nan"), "max_rel_error": float("nan"), field: bad}
    with pytest.raises(ConfigError, match=field):
        PrefillModel(**kw)


@given(
    st.floats(0.0, 0.05),
    st.floats(1e-6, 1e-4),
    st.floats(0.0, 1e-9),
    st.floats(0.0, 1e-6),
    st.floats(0.0, 4e-9),
    st.sampled_from([None, 1, 16, 256]),
)
def test_the_fit_gives_back_the_engine_that_made_the_rows(a, b, c, d, x, tail):
    """Rows made by an engine whose every new token pays x per cached token — cold, local hit, half hit.
    Without a tail column each row is its prefix alone (the sequential fit); with one, the prompts are
    prefix + tail and every term is fitted at once, d and x apart (the sequential fit would read the
    tail's attention to the cache as cost per cached token). Either way the fit gives x back, and the
    model predicts a prefill at any split of cached and new tokens."""
    from kvpolicy.profile import MeasuredProfile

    L = np.array([1024, 4096, 16384, 32768, 65536], dtype=np.int64)
    r = L // 2

    def engine_s(start, end):
        q = end - start
        return a + b * q + c * q * q + x * q * start + d * start

    T = L + (tail or 0)
    extra = {"half_hit_cached_tokens": r.astype(np.float64), "half_hit_ttft_ms": 1e3 * engine_s(r, T)}
    if tail is not None:
        extra["tail_tokens"] = np.full(5, float(tail))
    prof = MeasuredProfile(prefix_tokens=L, kv_bytes=L * 512.0, cold_prefill_ms=1e3 * engine_s(0, T), local_hit_ttft_ms=1e3 * engine_s(L, T),
                           extra=extra)
    m = prof.prefill_model()
    assert m.cross_s_per_token2 == pytest.approx(x, rel=1e-5, abs=1e-15)
    assert m.rms_rel_error < 1e-6 and m.cross_rms_rel_error < 1e-6
    for start, end in ((0, 8192), (8192, 8192 + 512), (60000, 70000), (100, 116)):
        # 10 ns absolute: a fixed term far below what relative error resolves on 1,024+ token rows
        # (a = 7.5e-10 s beside 29 ms) need not be recovered to predict a 16-token prefill
        assert m.prefill_s(start, end) == pytest.approx(engine_s(start, end), rel=1e-6, abs=1e-8)


def test_with_the_tail_known_and_no_half_hits_the_cross_term_stays_causal():
    from kvpolicy.profile import MeasuredProfile

    L = np.array([1024, 2048, 4096, 8192])

    def causal_s(start, end):  # x = 2c: c·(end² − start²)
        return 0.01 + 5e-5 * (end - start) + 1e-9 * (end * end - start * start) + 2e-6 * start

    prof = MeasuredProfile(prefix_tokens=L, kv_bytes=L * 512.0, cold_prefill_ms=1e3 * causal_s(0, L + 16), local_hit_ttft_ms=1e3 * causal_s(L, L + 16),
                           extra={"tail_tokens": np.full(4, 16.0)})
    m = prof.prefill_model()
    assert m.cross_s_per_token2 is None and m.cross_rms_rel_error is None
    assert m.d_s_per_cached_token == pytest.approx(2e-6, rel=1e-6)
    assert m.prefill_s(3000, 3500) == pytest.approx(causal_s(3000, 3500), rel=1e-6)


def test_a_zero_local_hit_time_is_named_when_every_row_is_fitted():
    from kvpolicy.errors import ConfigError

    prof = parse_profile("prefix_tokens,kv_bytes,cold_prefill_ms,local_hit_ttft_ms,tail_tokens\n1024,1,5,0,16\n2048,2,9,1,16\n")
    with pytest.raises(ConfigError) as exc:
        prof.prefill_model()
    assert exc.value.field == "local_hit_ttft_ms"
