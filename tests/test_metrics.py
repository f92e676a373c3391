"""Each metric against a brute-force reference on small random inputs, and its invariances."""

import itertools

import numpy as np
import pytest
from scipy import stats as sps

from nondet_jax.analysis import metrics

R, N, C, D = 5, 40, 4, 6


@pytest.fixture
def rng():
    return np.random.default_rng(0)


@pytest.fixture
def logits(rng):
    return rng.normal(size=(R, N, C)).astype(np.float32)


@pytest.fixture
def labels(rng):
    return rng.integers(0, C, size=N)


def pairs():
    return list(itertools.combinations(range(R), 2))


def ce_ref(lg, y):
    lg = lg.astype(np.float64)
    return float(np.mean([-(lg[i, y[i]] - np.log(np.exp(lg[i]).sum())) for i in range(len(y))]))


def test_pair_order_and_count():
    a, b = metrics.pair_indices(4)
    assert list(zip(a, b)) == list(itertools.combinations(range(4), 2))
    with pytest.raises(ValueError, match="at least 2"):
        metrics.pair_indices(1)


def test_accuracy_and_cross_entropy(logits, labels):
    for r in range(R):
        assert metrics.accuracy(logits, labels)[r] == np.mean([logits[r, i].argmax() == labels[i] for i in range(N)])
        assert metrics.cross_entropy(logits, labels)[r] == pytest.approx(ce_ref(logits[r], labels), rel=1e-10)


def test_disagreement(logits):
    ref = [np.mean([logits[a, i].argmax() != logits[b, i].argmax() for i in range(N)]) for a, b in pairs()]
    np.testing.assert_allclose(metrics.disagreement(logits), ref, atol=1e-7)


def test_pearson_and_spearman(logits):
    np.testing.assert_allclose(metrics.pearson(logits),
                               [sps.pearsonr(logits[a].ravel(), logits[b].ravel())[0] for a, b in pairs()], atol=1e-6)
    np.testing.assert_allclose(metrics.spearman(logits),
                               [sps.spearmanr(logits[a].ravel(), logits[b].ravel())[0] for a, b in pairs()], atol=1e-6)


def test_ensemble_gain(logits, labels, monkeypatch):
    monkeypatch.setattr(metrics, "PAIR_CHUNK", 3)  # exercise chunking
    got = metrics.ensemble_gain(logits, labels)
    for p, (a, b) in enumerate(pairs()):
        ens = (logits[a].astype(np.float64) + logits[b]) / 2
        acc = lambda lg: np.mean([lg[i].argmax() == labels[i] for i in range(N)])  # noqa: E731
        assert got["accuracy"][p] == pytest.approx(acc(ens) - (acc(logits[a]) + acc(logits[b])) / 2)
        # a gain is positive when the ensemble helps: its cross-entropy below the members' mean
        assert got["cross_entropy"][p] == pytest.approx((ce_ref(logits[a], labels) + ce_ref(logits[b], labels)) / 2 - ce_ref(ens, labels))


def cka_ref(x, y):
    """Kornblith et al.'s HSIC form with explicit centring matrices."""
    n = len(x)
    h = np.eye(n) - np.ones((n, n)) / n
    k, l_ = h @ x @ x.T @ h, h @ y @ y.T @ h
    return np.trace(k @ l_) / np.sqrt(np.trace(k @ k) * np.trace(l_ @ l_))


def test_linear_cka_matches_reference_and_invariances(rng, monkeypatch):
    monkeypatch.setattr(metrics, "PAIR_CHUNK", 4)
    f = rng.normal(size=(R, N, D))
    np.testing.assert_allclose(metrics.linear_cka(f), [cka_ref(f[a], f[b]) for a, b in pairs()], rtol=1e-10)
    q, _ = np.linalg.qr(rng.normal(size=(D, D)))
    g = f.copy()
    g[1] = 3.7 * f[1] @ q + 2.0  # orthogonal transform, isotropic scaling, and a shift
    np.testing.assert_allclose(metrics.linear_cka(g), metrics.linear_cka(f), rtol=1e-10)
    same = np.repeat(f[:1], 3, axis=0)
    np.testing.assert_allclose(metrics.linear_cka(same), 1.0)


def test_weight_distance(rng):
    w = rng.normal(size=(R, 30))
    ref = [np.linalg.norm(w[a] - w[b]) / np.linalg.norm(w[a]) for a, b in pairs()]
    np.testing.assert_allclose(metrics.weight_distance(w), ref, rtol=1e-12)
    tree = {"a": w[:, :10].reshape(R, 2, 5), "b": {"c": w[:, 10:]}}
    np.testing.assert_allclose(metrics.weight_distance(metrics.flatten_weights(tree)), ref, rtol=1e-12)


def test_weight_distance_resolves_one_ulp():
    w = np.ones((2, 1000), np.float32) * 0.37
    w[1, 17] = np.nextafter(w[1, 17], np.float32(1))
    d = metrics.weight_distance(w)[0]
    assert d > 0 and d == pytest.approx(float(w[1, 17] - w[0, 17]) / np.linalg.norm(w[0].astype(np.float64)))


def test_identical_models_have_zero_diversity(logits, labels):
    same = np.repeat(logits[:1], 4, axis=0)
    assert (metrics.disagreement(same) == 0).all()
    g = metrics.ensemble_gain(same, labels)
    assert np.allclose(g["accuracy"], 0) and np.allclose(g["cross_entropy"], 0, atol=1e-12)
    np.testing.assert_allclose(metrics.pearson(same), 1.0)
    assert (metrics.weight_distance(np.repeat(np.arange(5.0)[None] + 1, 3, 0)) == 0).all()
    theta = {"w": np.linspace(-1, 1, 7, dtype=np.float32)}
    calls = []
    curve = metrics.interpolation_curve(lambda t: calls.append(1) or float(np.abs(t["w"]).sum()), theta, theta,
                                        np.linspace(0, 1, 5), threads=2)
    assert metrics.barrier(curve) == 0.0 and len(set(curve)) == 1 and len(curve) == 5
    assert len(calls) == 1  # identical endpoints (the control arm): every point is the same weights, evaluated once


def test_interpolation_curve_and_barrier():
    ta, tb = {"w": np.array([1.0, 0.0], np.float32)}, {"w": np.array([0.0, 1.0], np.float32)}
    err = lambda t: float(1 - np.abs(t["w"]).max())  # noqa: E731  max error at the midpoint
    curve = metrics.interpolation_curve(err, ta, tb, [0.0, 0.25, 0.5, 0.75, 1.0])
    assert np.array_equal(metrics.interpolation_curve(err, ta, tb, [0.0, 0.25, 0.5, 0.75, 1.0], threads=3), curve)
    np.testing.assert_allclose(curve, [0.0, 0.25, 0.5, 0.25, 0.0], atol=1e-7)
    assert metrics.barrier(curve) == pytest.approx(0.5)


def test_independent_errors_std(labels, logits):
    wrong = logits.argmax(-1) != labels
    p = wrong.mean(0)
    r = len(logits)
    assert metrics.independent_errors_std(logits, labels) == pytest.approx(np.sqrt(sum(p * (1 - p)) * r / (r - 1)) / N)
    assert np.isnan(metrics.independent_errors_std(logits[:1], labels))


def test_independent_errors_baseline_is_unbiased_at_small_r():
    """Replicas whose errors are independent Bernoulli(q_i): the baseline's variance must average the true
    sum q(1-q)/n^2 at R=8 (the uncorrected p(1-p) was low by (R-1)/R, its std by 6.5%)."""
    rng = np.random.default_rng(0)
    n, r, trials = 300, 8, 400
    q = rng.beta(0.5, 4.0, n)
    truth = (q * (1 - q)).sum() / n ** 2
    wrong = rng.random((trials, r, n)) < q  # (trials, R, n)
    labels = np.zeros(n, int)
    logits = np.stack([wrong, ~wrong], -1).astype(np.float32)  # argmax 1 (wrong) where wrong
    est = np.array([metrics.independent_errors_std(lg, labels) ** 2 for lg in logits])
    assert abs(est.mean() / truth - 1) < 0.02  # unbiased variance
    p = wrong.mean(1)
    old = ((p * (1 - p)).sum(-1) / n ** 2).mean()
    assert old / truth == pytest.approx((r - 1) / r, abs=0.02)


def test_metrics_accept_jax_arrays(logits, labels):
    import jax.numpy as jnp

    np.testing.assert_allclose(metrics.disagreement(jnp.asarray(logits)), metrics.disagreement(logits))
    np.testing.assert_allclose(metrics.linear_cka(jnp.asarray(logits)), metrics.linear_cka(logits), rtol=1e-6)


def test_bfloat16_logits_give_the_metrics_of_their_float32_values():
    """A user model with bfloat16 outputs: every metric of an arm runs (scipy's ranks refuse bfloat16)
    and equals the metric of the same values in float32."""
    import jax.numpy as jnp

    from nondet_jax.analysis import metrics as M

    x = np.random.default_rng(0).normal(size=(3, 20, 4)).astype(np.float32)
    b = np.asarray(jnp.asarray(x, jnp.bfloat16))
    f = b.astype(np.float32)
    labels = np.arange(20) % 4
    for fn in (M.spearman, M.pearson, M.disagreement, M.linear_cka):
        np.testing.assert_allclose(fn(b), fn(f), rtol=1e-6)
    np.testing.assert_allclose(M.cross_entropy(b, labels), M.cross_entropy(f, labels), rtol=1e-5)
    assert M.minority_predictions(b) == M.minority_predictions(f)


def test_arrays_of_the_wrong_shape_or_labels_out_of_range_are_named():
    """The arrays entry's messages name the problem: a 2-D array where replicas are stacked (an einsum error
    before), labels out of range (it said "got dtype int64"), one number where an interval needs replicas."""
    from nondet_jax.analysis import stats
    from nondet_jax.errors import UsageError

    with pytest.raises(UsageError, match=r"^logits of shape \(3, 4\) are not \(replicas, examples, classes\)"):
        metrics.disagreement(np.ones((3, 4)))
    with pytest.raises(UsageError, match=r"^features of shape \(3, 20\) are not \(replicas, examples, dimensions\)"):
        metrics.linear_cka(np.ones((3, 20)))
    with pytest.raises(UsageError, match=r"^labels range over 10 \.\. 12, but must lie in \[0, 4\)"):
        metrics.accuracy(np.ones((2, 3, 4)), np.arange(3) + 10)
    for interval in (stats.std_ci, stats.mean_ci):
        with pytest.raises(UsageError, match=r"^got one number \(3\), but an interval needs one score per replica"):
            interval(3.0)
