"""Bootstrap CIs, variance-ratio tests and power against references and simulation."""

import numpy as np
import pytest
from scipy import stats as sps

from nondet_jax import stats


def test_bootstrap_is_seeded_and_brackets_the_estimate():
    x = np.random.default_rng(1).normal(size=12)
    lo, hi = stats.bootstrap_std_ci(x)
    assert (lo, hi) == stats.bootstrap_std_ci(x)
    assert lo < x.std(ddof=1) < hi
    assert np.isnan(stats.bootstrap_std_ci([1.0])[0])


def test_bootstrap_std_ci_covers_true_std_near_nominal_rate():
    """Percentile bootstrap of a std under-covers at small n; at n=30 it is close to nominal."""
    rng = np.random.default_rng(2)
    hits = 0
    trials = 300
    for t in range(trials):
        x = rng.normal(0, 2.0, size=30)
        lo, hi = stats.bootstrap_std_ci(x, samples=1000, seed=t)
        hits += lo <= 2.0 <= hi
    rate = hits / trials
    assert 0.85 <= rate <= 0.99, rate


def test_mean_ci_coverage():
    rng = np.random.default_rng(3)
    hits = sum(lo <= 1.0 <= hi for lo, hi in (stats.bootstrap_mean_ci(rng.normal(1.0, 1.0, 25), samples=1000, seed=t)
                                           for t in range(200)))
    assert 0.88 <= hits / 200 <= 0.99


def test_f_test_matches_scipy_reference():
    rng = np.random.default_rng(4)
    a, b = rng.normal(0, 1, 15), rng.normal(0, 1.8, 20)
    f = a.var(ddof=1) / b.var(ddof=1)
    ref = 2 * min(sps.f.cdf(f, 14, 19), sps.f.sf(f, 14, 19))
    assert stats.f_test(a, b) == pytest.approx(ref)
    assert stats.f_test(a, a) == pytest.approx(1.0)
    assert stats.f_test(np.zeros(5), np.zeros(5)) == 1.0 and stats.f_test(np.zeros(5), b) == 0.0


def test_brown_forsythe_is_levene_with_medians():
    rng = np.random.default_rng(5)
    a, b = rng.normal(0, 1, 15), rng.normal(0, 3, 15)
    assert stats.brown_forsythe(a, b) == pytest.approx(sps.levene(a, b, center="median").pvalue)
    # by hand: one-way ANOVA on absolute deviations from the medians
    za, zb = np.abs(a - np.median(a)), np.abs(b - np.median(b))
    assert stats.brown_forsythe(a, b) == pytest.approx(sps.f_oneway(za, zb).pvalue)


def test_f_test_false_positive_rate_is_nominal():
    rng = np.random.default_rng(6)
    p = np.array([stats.f_test(rng.normal(size=10), rng.normal(size=10)) for _ in range(2000)])
    assert 0.035 <= (p < 0.05).mean() <= 0.065


def test_power_formula_matches_simulation():
    rng = np.random.default_rng(7)
    n, ratio = 20, 1.8
    sim = np.mean([stats.f_test(rng.normal(0, ratio, n), rng.normal(0, 1, n)) < 0.05 for _ in range(2000)])
    assert stats.f_test_power(ratio, n) == pytest.approx(sim, abs=0.04)


def test_replicas_for_power():
    n = stats.replicas_for_power(2.0)
    assert stats.f_test_power(2.0, n) >= 0.8 > stats.f_test_power(2.0, n - 1)
    assert stats.replicas_for_power(1.0) is None
    assert stats.replicas_for_power(0.5) == n  # symmetric in the ratio
    # Morin & Willetts: a ratio of 0.9 needs hundreds of runs per arm
    assert stats.replicas_for_power(0.9) > 300


def test_std_ratio_ci_covers():
    rng = np.random.default_rng(8)
    hits = 0
    for _ in range(500):
        lo, hi = stats.std_ratio_ci(rng.normal(0, 2, 12), rng.normal(0, 1, 12))
        hits += lo <= 2.0 <= hi
    assert 0.92 <= hits / 500 <= 0.98


def test_compare_spread_fields():
    rng = np.random.default_rng(9)
    out = stats.compare_spread(rng.normal(0, 1, 10), rng.normal(0, 1, 10))
    assert set(out) == {"ratio", "ratio_ci", "f_test_p", "brown_forsythe_p", "replicas_for_80pct_power"}
    assert out["ratio_ci"][0] < out["ratio"] < out["ratio_ci"][1]


def test_pairwise_mean_ci_resamples_replicas():
    from nondet_jax.metrics import pair_indices

    rng = np.random.default_rng(10)
    r = 6
    a, b = pair_indices(r)
    x = rng.normal(size=r)
    values = np.abs(x[a] - x[b])
    lo, hi = stats.bootstrap_pairwise_mean_ci(values, r)
    assert lo < values.mean() < hi and (lo, hi) == stats.bootstrap_pairwise_mean_ci(values, r)
    assert stats.bootstrap_pairwise_mean_ci(np.full(len(a), 0.25), r) == (0.25, 0.25)
    assert np.isnan(stats.bootstrap_pairwise_mean_ci([0.1], 2)[0])


def test_identical_values_have_exactly_zero_spread():
    x = np.full(12, 0.9833333333333333)
    assert stats.std(x) == 0.0 and stats.bootstrap_std_ci(x) == (0.0, 0.0)
    out = stats.compare_spread(x, np.random.default_rng(0).normal(0.98, 0.006, 12))
    assert out["ratio"] == 0.0 and out["replicas_for_80pct_power"] is None
