"""The latency histograms' fast paths answer what the plain computation answers (issue #48: the admission controller's
refits made cheaper with every decision unchanged)."""

import math

import numpy as np
from hypothesis import given, settings, strategies as st

from kvpolicy.admission.histogram import LogHistogram, WindowedHistogram
from kvpolicy.admission.model import LinkPrior, TransferModel

QS = (0.0, 0.05, 0.5, 0.95, 0.99, 1.0)
VALUES = st.one_of(st.just(0.0), st.floats(1e-12, 1e-9), st.floats(1e-6, 1e3))


def _numpy_quantile(h, q):
    """The quantile as computed before the list version: numpy's cumsum and searchsorted over the buckets."""
    if h.count == 0:
        return None
    keys = np.asarray(sorted(h._counts), dtype=np.int64)
    cum = np.cumsum([h._counts[k] for k in keys.tolist()], dtype=np.int64) + h._zero
    rank = q * (h.count - 1)
    if rank < h._zero:
        return 0.0
    i = int(np.searchsorted(cum, rank, side="right"))
    if i >= keys.size:
        return h.max
    k = int(keys[i])
    gamma = math.exp(h._gamma_log)
    return min(max(2 * math.exp(k * h._gamma_log) / (gamma + 1), h.min), h.max)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(VALUES, st.integers(1, 3)), max_size=60))
def test_a_quantile_is_what_numpy_gave(xs):
    h = LogHistogram()
    for x, n in xs:
        h.record(x, n)
        for q in QS:
            assert h.quantile(q) == _numpy_quantile(h, q)


FEW = st.sampled_from([0.0, 1e-3, 2e-3, 0.5, 0.51, 7.0, 300.0])  # a handful of buckets, each hit again and again


@settings(max_examples=150, deadline=None)
@given(st.lists(st.one_of(st.tuples(st.just("record"), FEW, st.integers(1, 3)), st.tuples(st.just("many"), st.lists(FEW, max_size=4), st.just(0)),
                          st.tuples(st.just("merge"), st.lists(FEW, max_size=4), st.just(0))), max_size=60))
def test_the_buckets_order_kept_between_new_buckets_answers_what_sorting_afresh_answers(ops):
    """The sorted bucket keys are kept while records land in buckets that exist, and dropped by a new bucket, by
    record_many and by merge: every quantile after every step is the plain computation's."""
    h = LogHistogram()
    for op, x, n in ops:
        if op == "record":
            h.record(x, n)
        elif op == "many":
            h.record_many(x)
        else:
            other = LogHistogram()
            for v in x:
                other.record(v)
            h.merge(other)
        for q in QS:
            assert h.quantile(q) == _numpy_quantile(h, q)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 7), VALUES), max_size=60))
def test_a_window_kept_merged_answers_what_merging_afresh_answers(steps):
    now = [0.0]
    w = WindowedHistogram(5.0, lambda: now[0])
    for dt, x in steps:
        now[0] += dt
        w.record(x)
        fresh = w.prev.copy().merge(w.cur)
        for q in QS:
            assert w.quantile(q) == fresh.quantile(q)
        assert w.count == fresh.count


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.floats(1e3, 1e9), st.floats(1e-5, 1.0)), min_size=1, max_size=80))
def test_a_transfer_fit_reused_for_the_same_points_is_the_fit_of_those_points(obs):
    prior = LinkPrior(bandwidth_bytes_per_s=1e9)
    kept = TransferModel(prior, min_samples=3)
    for size, sec in obs:
        kept.observe(size, sec)
        fresh = TransferModel(prior, min_samples=3)
        fresh.buckets = kept.buckets  # the same data, no remembered fit
        for q in (0.5, 0.95):
            assert kept.coefficients(q) == fresh.coefficients(q)
