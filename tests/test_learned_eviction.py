"""lrb: the learned relaxed Belady — its model's fit, its labels, its features, and its victims."""

import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from strategies_prefix import chain_trace, flat_trace, prefix_traces
from kvpolicy.clock import ManualClock
from kvpolicy.errors import ConfigError
from kvpolicy.eviction import LearnedRelaxedBeladyPolicy, LogisticWindow, replay
from kvpolicy.eviction.base import serve
from kvpolicy.eviction.hit_density import splitmix64
from kvpolicy.eviction.kernels import replay_kernel
from kvpolicy.eviction.learned import N_FEATURES, logistic_fit, sigmoid
from kvpolicy.traces import first_appearance_ids

FAST = {"bins": 4, "interval": 1, "samples": 3, "span": 2.0}  # hit density's knobs, as tests/test_hit_density.py runs them


def _reference_fit(X, y, lam, iters=20000):
    """Plain gradient descent with a fixed step (1 / the loss's Lipschitz bound): slow, but no Newton, no line search."""
    w = np.zeros(X.shape[1])
    lip = 0.25 * np.linalg.norm(X, 2) ** 2 + lam.max()
    for _ in range(iters):
        w -= (X.T @ (sigmoid(X @ w) - y) + lam * w) / lip
    return w


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), m=st.integers(8, 60), d=st.integers(2, 5))
def test_the_fit_is_the_penalised_optimum_and_calibrated(seed, m, d):
    rng = np.random.default_rng(seed)
    X = np.column_stack([np.ones(m), rng.normal(size=(m, d - 1))])
    y = (rng.random(m) < sigmoid(X @ rng.normal(size=d))).astype(float)
    y[0], y[1] = 0.0, 1.0  # both labels: a window with one label only is never fit
    model = LogisticWindow(d, window=64, refit=10**6)
    for x, label in zip(X, y):
        model.add(x, label)
    model.fit(steps=50)
    ref = _reference_fit(X, y, model.penalty())
    assert model.loss(model.w) <= model.loss(ref) + 1e-7 * max(model.loss(ref), 1.0)  # no worse than the reference's optimum
    assert np.allclose(model.w[1:], ref[1:], atol=2e-3)
    mean_p, rate = model.calibration()
    assert mean_p == pytest.approx(rate, abs=1e-4)  # the unshrunk intercept: mean prediction = positive rate


def _numpy_newton(X, y, w, lam, steps):
    """The damped Newton iteration written with NumPy's dense algebra (the compiled fit lists each row's nonzero
    columns, fills one triangle and solves by its own Cholesky: those are what this checks)."""
    def loss(v):
        z = X @ v
        return float(np.sum(np.logaddexp(0.0, z) - y * z) + 0.5 * np.sum(lam * v * v))
    cur = loss(w)
    for _ in range(steps):
        p = sigmoid(X @ w)
        hess = (X * (p * (1.0 - p) + 1e-9)[:, None]).T @ X + np.diag(lam)
        step = np.linalg.solve(hess, X.T @ (p - y) + lam * w)
        t = 1.0
        while t > 1e-4 and loss(w - t * step) > cur:
            t *= 0.5
        if t <= 1e-4:
            break
        w = w - t * step
        new = loss(w)
        done = cur - new < 1e-6 * max(cur, 1.0)
        cur = new
        if done:
            break
    return w


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), m=st.integers(4, 80), steps=st.integers(1, 8))
def test_the_compiled_fit_takes_numpys_newton_steps_on_sparse_rows(seed, m, steps):
    rng = np.random.default_rng(seed)
    d = 12
    X = np.zeros((m + 5, d))  # rows past m are not the window's: the fit must not read them
    X[:, 0] = 1.0
    X[np.arange(m + 5), 1 + rng.integers(0, 6, m + 5)] = 1.0  # a one-hot bin
    dense = rng.normal(size=(m + 5, 5)) * (rng.random((m + 5, 5)) < 0.6)  # some zeros in the dense part too
    X[:, 7:] = dense
    X[m:] = 9.0
    y = (rng.random(m + 5) < 0.4).astype(float)
    lam = np.full(d, 1.0)
    lam[0] = 1e-6
    w0 = rng.normal(size=d) * 0.3
    w = w0.copy()
    mean_p, rate = logistic_fit(X, y, m, w, lam, steps)
    ref = _numpy_newton(X[:m], y[:m], w0, lam, steps)
    assert np.allclose(w, ref, rtol=1e-7, atol=1e-9)
    assert mean_p == pytest.approx(float(sigmoid(X[:m] @ w).mean()), rel=1e-12) and rate == pytest.approx(y[:m].mean(), rel=1e-12)


def test_a_window_with_one_label_is_not_fit_and_the_window_slides():
    model = LogisticWindow(2, window=4, refit=4)
    for _ in range(4):
        model.add(np.array([1.0, 0.5]), 0.0)  # refit due at 4 labels: zeros only, not fit
    assert model.w is None and math.isnan(model.calibration()[0])
    with pytest.raises(ConfigError, match="not fit"):
        model.predict(np.ones((1, 2)))
    for _ in range(4):
        model.add(np.array([1.0, -0.5]), 1.0)  # the four zeros slide out: at 8 labels the window holds ones only
    assert model.n == 8 and model.y.tolist() == [1.0] * 4 and model.w is None
    for label in (0.0, 0.0, 1.0, 1.0):
        model.add(np.array([1.0, 0.5 if label == 0 else -0.5]), label)  # both labels at the next refit: fit
    assert model.w is not None and model.fits == 1
    p = model.predict(np.array([[1.0, 0.5], [1.0, -0.5]]))
    assert p[0] < 0.5 < p[1]


@pytest.mark.parametrize("field, value", [("horizon", 0), ("horizon", -1.0), ("window", 0), ("window", 1 << 21), ("refit", 0),
                                          ("ridge", 0.0), ("ridge", "1"), ("samples", 0), ("seed", -1)])
def test_knobs_are_validated(field, value):
    with pytest.raises(ConfigError) as e:
        LearnedRelaxedBeladyPolicy(8, **{field: value})
    assert e.value.field == field


@settings(max_examples=60, deadline=None)
@given(tr=prefix_traces(max_requests=40), cap=st.integers(0, 14), seed=st.integers(0, 2**64 - 1))
def test_until_its_first_fit_it_evicts_what_hit_density_evicts(tr, cap, seed):
    """Differential: with no fit (the refit never comes) the victims are hit density's, sample for sample — recording
    the training samples draws nothing from the generator."""
    lrb = replay(tr, "lrb", cap, record_victims=True, seed=seed, refit=10**6, **FAST)
    hd = replay_kernel(tr, "hit-density", cap, seed=seed, **FAST)
    assert lrb.victims == hd.victims.tolist() and np.array_equal(lrb.hits, hd.hits)
    assert lrb.stats["fits"] == 0


def _same_stats(a, b):
    return a.keys() == b.keys() and all(a[k] == b[k] or (isinstance(a[k], float) and math.isnan(a[k]) and math.isnan(b[k])) for k in a)


@settings(max_examples=80, deadline=None)
@given(tr=prefix_traces(max_requests=40), cap=st.integers(0, 14), seed=st.integers(0, 2**64 - 1), window=st.integers(1, 12),
       refit=st.integers(1, 4), horizon=st.sampled_from([0.5, 1.0, 3.0]))
def test_the_kernel_makes_the_online_decisions_while_it_learns(tr, cap, seed, window, refit, horizon):
    """Differential: the replay kernel against the online policy, victim for victim, with fits every few labels, a
    window small enough that decisions go unrecorded, and the model's own account (labels, fits, calibration)."""
    kw = dict(seed=seed, window=window, refit=refit, horizon=horizon, **FAST)
    online = replay(tr, "lrb", cap, record_victims=True, **kw)
    kernel = replay_kernel(tr, "lrb", cap, **kw)
    assert kernel.victims.tolist() == online.victims and np.array_equal(kernel.hits, online.hits)
    assert _same_stats(kernel.stats, online.stats), (kernel.stats, online.stats)


def test_the_kernel_agrees_through_hundreds_of_fits_on_a_conversation_preset():
    from kvpolicy.traces.synthetic import generate, preset

    tr = generate(preset("chat", seed=3, n_requests=300))
    kw = dict(window=64, refit=16)
    online = replay(tr, "lrb", 114, record_victims=True, **kw)
    kernel = replay_kernel(tr, "lrb", 114, **kw)
    assert online.stats["fits"] > 100 and online.stats["unrecorded"] > 0  # it learned, and the window's cap was reached
    assert kernel.victims.tolist() == online.victims and np.array_equal(kernel.hits, online.hits)
    assert _same_stats(kernel.stats, online.stats)


@pytest.mark.parametrize("kw", [{"bins": 1}, {"alpha": 1}, {"clock": ManualClock()}], ids=["bad knob", "unknown", "clock"])
def test_the_kernel_takes_lrb_knobs_and_refuses_others(kw):
    with pytest.raises(ConfigError) as e:
        replay_kernel(flat_trace(np.array([0, 1, 2, 0])), "lrb", 2, **kw)
    assert e.value.field == next(iter(kw))


class _Checked(LearnedRelaxedBeladyPolicy):
    """Checks every learned decision against a reference: re-draw the same samples, score each, take the first lowest."""

    checked = 0

    def _choose(self):
        now, h, rng, cand = self.clock.now_s(), self.horizon_s(), self._rng, list(self._cand)
        fitted = self.model.w is not None and h is not None and h > 0
        victim = super()._choose()
        if fitted:
            drawn = []
            for _ in range(self.samples):
                rng, z = splitmix64(rng)
                drawn.append(cand[((z >> 32) * len(cand)) >> 32])
            scores = [float(sigmoid(self.features(n, now, h) @ self.model.w)) if n is not victim else None for n in drawn]
            v_score = float(sigmoid(self.features(victim, now, h) @ self.model.w))
            assert victim in drawn
            assert all(s is None or s >= v_score for s in scores)  # no sample the model rates less likely to return
            assert drawn.index(victim) == min(i for i, n in enumerate(drawn) if n is victim)
            # what an engine that ranks blocks itself reads (SGLang's strategy: priority_of) is the logit the decision
            # compares: the same order, the same probability
            assert all(float(sigmoid(self.priority_of(n, now)[0])) == pytest.approx(s if s is not None else v_score, rel=1e-9, abs=1e-12)
                       for n, s in zip(drawn, scores))
            self.checked += 1
        return victim


def test_every_learned_victim_is_the_sample_least_likely_to_return():
    rng = np.random.default_rng(5)
    ids = first_appearance_ids((300 * rng.random(6000) ** 2).astype(np.int64))
    tr = flat_trace(ids)
    p = _Checked(40, clock=ManualClock(), window=512, refit=64, **FAST)
    replay(tr, p)
    assert p.model.fits > 5 and p.checked > 1000, (p.model.fits, p.checked)


def test_a_sample_is_labelled_by_whether_it_is_used_again_within_the_horizon():
    clock = ManualClock()
    p = LearnedRelaxedBeladyPolicy(1, clock=clock, refit=10**6)  # room for one block: the only candidate is the sample

    def request(t, key):
        clock._now_s = float(t)
        p.victims(1, incoming=key)
        p.on_insert(key, 1)

    request(0, "a")
    request(1, "b")  # evicts a at age 1: no horizon before the first eviction, so no sample; H = 1 from now on
    assert p.horizon_s() == 1.0 and not p._pending
    request(2, "c")  # evicts b (age 1): recorded at t=2 with H = 1
    assert list(p._pending) == ["b"] and p.model.n == 0
    request(2.5, "b")  # b is back 0.5 s later, within H: a return, labelled when its H ends; c (age 0.5) is recorded
    assert p.model.n == 0 and [r[3] for r in p._pending["b"]] == [1.0] and list(p._pending) == ["b", "c"]
    request(10, "e")  # both Hs have ended: b goes to the model as 1, c (not back by 2.5 + H) as 0, in that order
    assert p.model.n == 2 and p.model.y[:2].tolist() == [1.0, 0.0]
    assert p.model.out_of_sample()[2] == 0  # no model yet: nothing was predicted before its outcome
    p.model.w = np.zeros(N_FEATURES)  # a model that says 1/2 for every block
    request(11, "f")  # b (recorded at 10 with no model) is not back by 10 + H: labelled 0; e recorded with P = 1/2
    request(11.5, "e")  # e is back within H: labelled 1, predicted 1/2; f recorded with P = 1/2
    request(30, "g")  # f is not back by 11.5 + H: labelled 0, predicted 1/2
    assert p.model.y[:5].tolist() == [1.0, 0.0, 0.0, 1.0, 0.0]
    assert p.model.out_of_sample() == (0.5, 0.5, 2)  # only e and f were predicted at their decisions


@pytest.mark.parametrize("same_time", [False, True])
def test_the_chain_features_count_turns_and_find_the_root(same_time):
    # a conversation: each request re-reads its history and appends a turn; another session shares block 0. Turns
    # are counted in requests, not clock ticks: requests at one timestamp (a coarse engine clock) count the same
    requests = [[0], [0, 1], [0, 1, 2], [0, 5], [0, 1, 2, 3]]
    p = LearnedRelaxedBeladyPolicy(100, clock=ManualClock())
    if same_time:  # an engine, through the policy API, with a clock that does not move
        for keys in requests:
            serve(p, keys)
    else:
        replay(chain_trace(requests), p)
    extra = {k: p._extra[k] for k in p.nodes}
    assert [extra[k][1] for k in (0, 1, 2, 3, 5)] == [0, 1, 2, 3, 1]  # turns: requests that extended the chain
    assert all(extra[k][2] == 0 for k in (0, 1, 2, 3, 5))  # the root of every chain
    x = p.features(p.nodes[3], now_s=10.0, h_s=4.0)
    assert x.shape == (N_FEATURES,) and x[0] == 1.0 and x[1:15].sum() == 1.0  # intercept, one age bin
    assert x[1 + 14 * 3 + 3] == pytest.approx(math.log1p(3))  # turn
    assert x[1 + 14 * 3 + 6] == pytest.approx(math.log1p(p.nodes[0].data[1]) / 4)  # the root's hits: 4 re-reads


def test_it_learns_to_keep_a_reused_class_through_a_scan():
    """tests/test_hit_density.py's hot set of 10 (reuse distance 30) through a scan, in a cache of 20: LRU hits
    nothing, and so does the sampled LRU lrb is before its first fit (hit density kept from learning: ``interval``).
    The model alone learns that a reused block comes back and a scanned one does not. The boundary matters: a hot
    block returns 30 s after its last use, past H = the mean eviction age (about 19 s here), so only an old hot block
    is labelled a return; at ``horizon`` 2 every return falls within H and it keeps nearly all of them."""
    hot = list(range(10))
    ids, nxt = [], 1000
    for i in range(3000):
        ids += [hot[i % len(hot)], nxt, nxt + 1]
        nxt += 2
    tr = flat_trace(first_appearance_ids(np.asarray(ids, dtype=np.int64)))
    assert replay_kernel(tr, "lru", 20).hit_blocks == 0
    assert replay(tr, "lrb", 20, refit=10**6, interval=10**9).hit_blocks == 0
    r = replay(tr, "lrb", 20, refit=256, interval=10**9)
    assert r.stats["fits"] > 10 and r.hit_blocks > 0.25 * 3000, r.stats
    assert abs(r.stats["window_mean_prediction"] - r.stats["window_positive_rate"]) < 1e-3
    assert replay(tr, "lrb", 20, refit=256, interval=10**9, horizon=2.0).hit_blocks > 0.95 * 3000


@settings(max_examples=30, deadline=None)
@given(tr=prefix_traces(max_requests=40), cap=st.integers(1, 14), window=st.integers(1, 6))
def test_no_more_samples_wait_for_their_outcome_than_the_window_holds(tr, cap, window):
    """Memory stays bounded by ``window``, not by the evictions within one H (about the cache's size in blocks)."""
    p = LearnedRelaxedBeladyPolicy(cap, clock=ManualClock(), window=window, refit=10**6, **FAST)
    offsets, ids = tr.block_offsets.tolist(), tr.block_ids.tolist()
    for r in range(len(tr)):
        p.clock._now_s = float(tr.arrival_s[r]) + r * 1e-9
        serve(p, ids[offsets[r]:offsets[r + 1]])
        assert len(p._deadlines) <= window and sum(map(len, p._pending.values())) <= window


def test_a_decision_past_the_cap_is_skipped_not_lost():
    rng = np.random.default_rng(3)
    tr = flat_trace(first_appearance_ids((200 * rng.random(3000)).astype(np.int64)))
    capped, free = (LearnedRelaxedBeladyPolicy(20, clock=ManualClock(), window=w, refit=10**6) for w in (4, 4096))
    a, b = replay(tr, capped, record_victims=True), replay(tr, free, record_victims=True)
    assert a.victims == b.victims  # no fit: both are hit density, decision for decision
    waiting = [sum(map(len, p._pending.values())) for p in (capped, free)]
    assert capped.unrecorded > 0 and free.unrecorded == 0
    assert capped.model.n + waiting[0] + capped.unrecorded == free.model.n + waiting[1]  # every decision: labelled, waiting or skipped


def test_an_engine_clock_that_steps_back_does_not_break_a_decision():
    """Engine clocks are not replay's: one that steps back (a wall clock adjusted, timestamps from several threads)
    must not make a negative interval reach a logarithm inside an eviction."""
    clock = ManualClock()
    p = LearnedRelaxedBeladyPolicy(8, clock=clock, refit=16, samples=4)
    rng = np.random.default_rng(9)
    for step in range(600):
        clock._now_s = float(step) - (50.0 if step % 7 == 0 else 0.0)  # every 7th request 50 s in the past
        serve(p, [int(k) for k in rng.integers(0, 40, size=1)])
    assert p.model.fits > 0
    p.check()


def test_a_sample_recorded_without_the_decisions_logit_is_predicted_by_the_model_of_now():
    """A block sampled where the decision did not compute its logit (a victim named outside the sampled candidates)
    carries the model's prediction for its features at that moment — not NaN, which would leave it out of the
    out-of-sample calibration — and NaN only while there is no model."""
    from kvpolicy.eviction.learned import lrb_logit, sigmoid1

    clock = ManualClock()
    p = LearnedRelaxedBeladyPolicy(100, clock=clock, refit=10**6)
    serve(p, [0, 1, 2])
    node = p.nodes[2]
    p._record(node, 5.0, 4.0)
    assert math.isnan(p._pending[2][-1][2]), "no model yet: no prediction"
    w = np.linspace(-1.0, 1.0, N_FEATURES)
    p.model.w = w
    p._record(node, 6.0, 4.0)
    x = p.features(node, 6.0, 4.0)
    assert p._pending[2][-1][2] == pytest.approx(sigmoid1(lrb_logit(x, w)))
    assert 0.0 < p._pending[2][-1][2] < 1.0 and (p._pending[2][-1][1] == x).all()
