"""Intervals, variance-ratio tests, power and comparisons against textbook formulas, scipy, published
figures and simulation (coverage: tests/test_coverage.py)."""

import numpy as np
import pytest
from scipy import stats as sps

from nondet_jax.analysis import stats


def test_std_ci_normal_is_the_chi_square_interval():
    x = np.random.default_rng(1).normal(size=12)
    lo, hi = stats.std_ci_normal(x)
    s = x.std(ddof=1)
    assert lo == pytest.approx(s * np.sqrt(11 / sps.chi2.ppf(0.975, 11)))
    assert hi == pytest.approx(s * np.sqrt(11 / sps.chi2.ppf(0.025, 11)))
    assert lo < s < hi
    assert all(np.isnan(stats.std_ci_normal([1.0])))


def test_std_ci_is_bonetts_interval_by_hand():
    """Bonett (2006), written out: kurtosis about the mean trimmed by 1/(2√(n−4)), floored at 3; the small-sample
    factor c at z(97.5%), the half-width at z(98.75%) (stats.SPREAD_TAIL)."""
    x = np.random.default_rng(1).standard_t(3, size=12)
    n, z = 12, sps.norm.ppf(1 - 0.5 * 0.025)
    m = sps.trim_mean(x, 1 / (2 * np.sqrt(n - 4)))
    kurt = max(n * ((x - m) ** 4).sum() / (((x - x.mean()) ** 2).sum()) ** 2, 3.0)
    c = n / (n - sps.norm.ppf(0.975))
    se = c * np.sqrt((kurt - (n - 3) / n) / (n - 1))
    lo, hi = stats.std_ci(x)
    assert lo == pytest.approx(np.sqrt(c * x.var(ddof=1) * np.exp(-z * se)))
    assert hi == pytest.approx(np.sqrt(c * x.var(ddof=1) * np.exp(z * se)))
    assert lo < x.std(ddof=1) < hi
    assert all(np.isnan(stats.std_ci([1.0, 2.0])))  # the robust interval needs 3 values
    assert stats.na_reason("std", 2).startswith("n/a: R=2 < 3")


def test_ratio_ci_is_bonetts_pooled_kurtosis_interval_by_hand():
    rng = np.random.default_rng(2)
    a, b = rng.normal(0, 1, 10), rng.normal(0, 2, 12)
    z, z0 = sps.norm.ppf(1 - 0.5 * 0.025), sps.norm.ppf(0.975)  # the half-width's (widened) and c's
    tm = lambda v: sps.trim_mean(v, 1 / (2 * np.sqrt(len(v) - 4)))  # noqa: E731
    kurt = 22 * (((a - tm(a)) ** 4).sum() + ((b - tm(b)) ** 4).sum()) / (
        ((a - a.mean()) ** 2).sum() + ((b - b.mean()) ** 2).sum()) ** 2
    kurt = max(kurt, 3.0)
    se = np.sqrt((kurt - 7 / 10) / 9 + (kurt - 9 / 12) / 11)
    c = (10 / (10 - z0)) / (12 / (12 - z0))
    f = a.var(ddof=1) / b.var(ddof=1)
    assert stats.std_ratio_ci(a, b) == pytest.approx((np.sqrt(c * f * np.exp(-z * se)), np.sqrt(c * f * np.exp(z * se))))


def test_spread_test_is_the_exact_permutation_of_brown_forsythe():
    """Every split of the pooled absolute deviations, counted by hand against scipy's t statistic."""
    import itertools
    rng = np.random.default_rng(3)
    a, b = rng.normal(0, 1, 5), rng.normal(0, 3, 6)
    z = np.r_[np.abs(a - np.median(a)), np.abs(b - np.median(b))]
    t = lambda idx: abs(sps.ttest_ind(z[list(idx)], np.delete(z, list(idx))).statistic)  # noqa: E731
    obs = t(range(5))
    null = [t(c) for c in itertools.combinations(range(11), 5)]
    assert stats.spread_test(a, b) == pytest.approx(np.mean(np.array(null) >= obs - 1e-12))
    assert stats.spread_test(np.zeros(4), np.zeros(4)) == 1.0
    big = stats.spread_test(rng.normal(size=20), rng.normal(size=20))  # 10,000 seeded random splits
    assert big == stats.spread_test(*np.random.default_rng(3).normal(size=(2, 20))) or 0 < big <= 1


def test_holm_matches_the_textbook_step_down():
    assert stats.holm([0.01, 0.04, 0.03, None, 0.5]) == pytest.approx([0.04, 0.09, 0.09, None, 0.5], nan_ok=True)
    assert stats.holm([]) == []


def test_mean_ci_is_the_t_interval_at_its_widened_critical_value():
    x = np.random.default_rng(3).normal(1.0, 2.0, 8)
    half = sps.t.ppf(0.9825, 7) * x.std(ddof=1) / np.sqrt(8)  # 1 − 0.7 · 0.05 / 2: see stats.MEAN_TAIL
    assert stats.mean_ci(x) == pytest.approx((x.mean() - half, x.mean() + half))
    assert all(np.isnan(stats.mean_ci([0.5])))


def test_intervals_take_batches_of_studies():
    x = np.random.default_rng(2).normal(size=(5, 8))
    lo, hi = stats.std_ci(x)
    assert lo.shape == (5,) and lo[3] == pytest.approx(stats.std_ci(x[3])[0])
    assert stats.std_ratio_ci(x, 2 * x[::-1])[1][2] == pytest.approx(stats.std_ratio_ci(x[2], 2 * x[2])[1])
    lo, hi = stats.mean_ci(x)
    assert hi[1] == pytest.approx(stats.mean_ci(x[1])[1])


def test_na_reason_and_format():
    assert stats.na_reason("pairwise", 2).startswith("n/a: R=2 < 3")
    assert stats.na_reason("std", 8) is None
    assert stats.format_ci([float("nan"), float("nan")]) == " n/a" == stats.format_ci([None, None])
    assert stats.format_ci([0.1, 0.25], 2, 100) == " [10.00, 25.00]"


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
    assert 0.92 <= hits / 500 <= 0.99


def test_compare_spread_fields():
    rng = np.random.default_rng(9)
    out = stats.compare_spread(rng.normal(0, 1, 10), rng.normal(0, 1, 10))
    assert set(out) == {"ratio", "ratio_ci", "ratio_ci_normal", "spread_p", "f_test_p", "brown_forsythe_p",
                        "replicas_for_ratio"}
    assert out["ratio_ci"][0] < out["ratio"] < out["ratio_ci"][1]
    assert out["replicas_for_ratio"] == {"0.5": stats.replicas_for_ratio_interval(0.5),
                                         "0.75": stats.replicas_for_ratio_interval(0.75)}


def test_pairwise_mean_ci_is_the_replica_jackknife():
    from nondet_jax.analysis.metrics import pair_indices

    rng = np.random.default_rng(10)
    r = 6
    a, b = pair_indices(r)
    x = rng.normal(size=r)
    values = np.abs(x[a] - x[b])
    # by hand: leave replica i (and its pairs) out
    loo = np.array([values[(a != i) & (b != i)].mean() for i in range(r)])
    se = np.sqrt((r - 1) / r * ((loo - loo.mean()) ** 2).sum())
    half = sps.t.ppf(0.9825, r - 1) * se  # the mean's widened critical value (stats.MEAN_TAIL)
    assert stats.pairwise_mean_ci(values, r) == pytest.approx((values.mean() - half, values.mean() + half))
    # every pair equal: the jackknife has no spread to see, so no zero-width interval is printed
    assert all(np.isnan(stats.pairwise_mean_ci(np.full(len(a), 0.25), r)))
    lo, hi = stats.pairwise_mean_ci(values, r, bounds=(0.0, np.inf), scale="log")  # log scale: by hand too
    loo_log = np.log(loo)
    se_log = np.sqrt((r - 1) / r * ((loo_log - loo_log.mean()) ** 2).sum())
    t = sps.t.ppf(0.9825, r - 1)
    assert (lo, hi) == pytest.approx((values.mean() * np.exp(-t * se_log), values.mean() * np.exp(t * se_log)))
    assert all(np.isnan(stats.pairwise_mean_ci([0.1], 2)))
    with pytest.raises(ValueError, match="pair values"):
        stats.pairwise_mean_ci(values[:-1], r)


def test_pairwise_intervals_stay_inside_the_metric_range():
    """A disagreement of one image in a few pairs: the jackknife's low end falls below 0 unclipped;
    the interval printed is clipped to the metric's range [0, 1] and still holds the mean."""
    from nondet_jax.analysis.metrics import PAIRWISE_RANGE, pair_indices

    r = 4
    values = np.zeros(len(pair_indices(r)[0]))
    values[:2] = 0.003  # replica 0 disagrees with replicas 1 and 2 on one image in 360
    raw = stats.pairwise_mean_ci(values, r)
    assert raw[0] < 0
    lo, hi = stats.pairwise_mean_ci(values, r, bounds=PAIRWISE_RANGE["disagreement"])
    assert lo == 0.0 and hi == raw[1] and lo <= values.mean() <= hi


def test_compare_spread_from_summary_reproduces_morin_willetts():
    """Their Table: accuracy stds 0.00302 vs 0.00346 and loss stds 0.01995 vs 0.02699, 50 runs each, ddof=0."""
    acc = stats.compare_spread_from_summary(0.00302, 50, 0.00346, 50, ddof=0)
    assert acc["f_test_p"] == pytest.approx(0.34, abs=0.005)
    assert acc["ratio"] == pytest.approx(0.873, abs=0.001) and acc["ratio_ci"][0] < 1 < acc["ratio_ci"][1]
    loss = stats.compare_spread_from_summary(0.01995, 50, 0.02699, 50, ddof=0)
    assert loss["f_test_p"] == pytest.approx(0.037, abs=0.002)
    assert loss["ratio_ci"][1] < 1
    assert loss["power"] == pytest.approx(stats.f_test_power(loss["ratio"], 50))
    assert loss["replicas_for_80pct_power"] == stats.replicas_for_power(loss["ratio"]) > 50


def test_compare_spread_from_summary_agrees_with_raw_data():
    rng = np.random.default_rng(11)
    a, b = rng.normal(0, 1, 9), rng.normal(0, 2, 14)
    raw = stats.compare_spread(a, b)
    for ddof in (0, 1):
        s = stats.compare_spread_from_summary(a.std(ddof=ddof), 9, b.std(ddof=ddof), 14, ddof=ddof)
        assert s["f_test_p"] == pytest.approx(raw["f_test_p"]) and s["ratio"] == pytest.approx(raw["ratio"])
        assert s["ratio_ci"] == pytest.approx(raw["ratio_ci_normal"])  # from stds alone: the F interval
    with pytest.raises(ValueError, match="at least 2"):
        stats.compare_spread_from_summary(0.1, 1, 0.2, 5)


def test_unequal_counts_power_matches_simulation():
    rng = np.random.default_rng(12)
    sim = np.mean([stats.f_test(rng.normal(0, 1.8, 10), rng.normal(0, 1, 25)) < 0.05 for _ in range(2000)])
    assert stats.f_test_power(1.8, 10, n_b=25) == pytest.approx(sim, abs=0.04)


def test_welch_matches_scipy():
    rng = np.random.default_rng(13)
    a, b = rng.normal(0, 1, 8), rng.normal(1, 2, 11)
    w = stats.welch(a, b)
    ref = sps.ttest_ind(b, a, equal_var=False)
    assert w["p"] == pytest.approx(ref.pvalue) and w["difference"] == pytest.approx(b.mean() - a.mean())
    ci = ref.confidence_interval(0.95)
    assert w["ci"] == pytest.approx([ci.low, ci.high])


def test_probability_of_improvement_is_rliables():
    a, b = np.array([1.0, 2.0, 3.0]), np.array([2.0, 4.0, 0.0])
    # pairs (b, a): 2>1, 2=2 (half), 2<3, 4>all, 0<all -> (1 + 0.5 + 3) / 9
    poi = stats.probability_of_improvement(a, b)
    assert poi["probability"] == pytest.approx(4.5 / 9)
    lo, hi = poi["ci"]
    assert 0 <= lo < 0.5 < hi <= 1
    sure = stats.probability_of_improvement(np.zeros(8), np.ones(8))
    assert sure["probability"] == 1.0 and 0.5 < sure["ci"][0] < 1.0 and sure["ci"][1] == 1.0  # not degenerate


def test_replicas_for_difference_matches_simulated_power():
    n = stats.replicas_for_difference(0.5, 1.0)
    assert stats.t_test_power(0.5, n) >= 0.8 > stats.t_test_power(0.5, n - 1)
    assert n == 64  # the textbook figure for d = 0.5
    rng = np.random.default_rng(14)
    sim = np.mean([sps.ttest_ind(rng.normal(0.5, 1, n), rng.normal(0, 1, n)).pvalue < 0.05 for _ in range(1000)])
    assert sim == pytest.approx(0.8, abs=0.04)
    assert stats.replicas_for_difference(0.0, 1.0) is None


def test_compare_means_fields():
    rng = np.random.default_rng(15)
    out = stats.compare_means(rng.normal(0.90, 0.01, 8), rng.normal(0.91, 0.01, 8))
    assert out["difference_ci"][0] < out["difference"] < out["difference_ci"][1]
    assert 0 <= out["probability_of_improvement_ci"][0] <= out["probability_of_improvement"]
    assert out["replicas_for_80pct_power"] >= 2
    with pytest.raises(ValueError, match="at least 2"):
        stats.compare_means([0.9], [0.8, 0.7])


def test_identical_values_have_exactly_zero_spread():
    """A continuous score tied across replicas is bitwise-identical training: zero by construction. An
    accuracy (a count) tied across replicas is not: its interval reaches the largest std that ties."""
    x = np.full(12, 0.9833333333333333)
    assert stats.std(x) == 0.0 and stats.std_ci(x) == (0.0, 0.0)
    lo, hi = stats.std_ci(x, resolution=1 / 360)
    assert lo == 0.0 and hi == pytest.approx(np.sqrt(stats.tie_rate(12)) / 360)
    out = stats.compare_spread(x, np.random.default_rng(0).normal(0.98, 0.006, 12))
    assert out["ratio"] == 0.0 and out["ratio_ci"] == [0.0, 0.0]  # continuous: exactly zero
    out = stats.compare_spread(x, np.random.default_rng(0).normal(0.98, 0.006, 12), resolution=1 / 360)
    assert out["ratio_ci"][0] == 0.0 < out["ratio_ci"][1]


def test_tie_rate_is_where_r_skellam_replicas_tie_with_probability_2_5_percent():
    from scipy import special
    for r in (4, 8):
        lam = stats.tie_rate(r)
        k = np.arange(-40, 41)
        assert (special.ive(k, lam) ** r).sum() == pytest.approx(0.025, rel=1e-6)
        sim = np.random.default_rng(r).poisson(lam / 2, (2, 40000, r))
        d = sim[0] - sim[1]
        assert (np.ptp(d, axis=1) == 0).mean() == pytest.approx(0.025, abs=0.004)


def test_accuracy_std_interval_ends_at_the_largest_possible_std():
    """At R=3 the robust upper end is many times the estimate: for an accuracy (in [0, 1], so its std is at
    most 0.5) it is clipped to 0.5, which keeps every possible true std."""
    acc = [0.60, 0.86, 0.70]
    raw = stats.std_ci(acc)
    assert raw[1] > 0.5  # an impossible std of an accuracy
    lo, hi = stats.spread(acc, std_max=stats.ACCURACY_STD_MAX)["std_ci"]
    assert lo == raw[0] and hi == 0.5
    assert stats.spread([0.80, 0.81, 0.82, 0.80, 0.79, 0.83], std_max=0.5)["std_ci"] == list(stats.std_ci(
        [0.80, 0.81, 0.82, 0.80, 0.79, 0.83]))  # far from the bound: unchanged


def test_a_count_mean_a_few_steps_from_its_median_is_joined_with_the_poisson_interval():
    """16 replicas, one a test image above the rest: the t interval alone is too narrow for a truth of 0.24
    images above 340 (3 borderline images right with p 0.08); the joined interval holds it and is Garwood's
    by hand: the median 340 plus [lo(1) − hi(0), hi(1) − lo(0)]/16 images, each at 97.5%."""
    x = np.r_[np.full(15, 340.0), 341.0] / 360
    truth = (340 + 3 * 0.08) / 360
    t_lo, t_hi = stats.mean_ci(x)
    assert not t_lo <= truth <= t_hi
    lo, hi = stats.mean_ci(x, resolution=1 / 360)
    assert lo <= truth <= hi and lo <= t_lo and t_hi <= hi
    g = lambda q, k: sps.chi2.ppf(q, 2 * k) / 2  # noqa: E731  Garwood's ends: chi-square quantiles
    assert (lo, hi) == pytest.approx(((340 + (g(0.0125, 1) - g(0.9875, 1)) / 16) / 360,
                                      (340 + (g(0.9875, 2) - 0) / 16) / 360))
    assert stats.rare_steps_ci(x, 1 / 360)[2] == 1
    spread_out = np.r_[np.full(8, 300.0), np.full(8, 340.0)] / 360  # 320 steps from the median: t alone
    assert stats.mean_ci(spread_out, resolution=1 / 360) == pytest.approx(stats.mean_ci(spread_out))


def test_minority_predictions_and_the_poisson_interval_of_rare_disagreement():
    from nondet_jax.analysis import metrics
    logits = np.zeros((4, 5, 3))
    logits[:, :, 0] = 1.0  # every replica predicts class 0 ...
    logits[1, 2, 1] = logits[3, 2, 2] = 2.0  # ... but on image 2 two replicas differ (each its own way)
    logits[0, 4, 2] = 2.0  # and one on image 4
    assert metrics.minority_predictions(logits) == 3
    assert metrics.minority_predictions(np.repeat(logits[:1], 4, 0)) == 0
    for m in (0, 3, 25):
        lo, hi = stats.rare_disagreement_ci(m, 8, 360)
        lam_hi = hi * 8 * 360 / 2  # Garwood: P(Poisson(upper) <= m) = 2.5%, P(Poisson(lower) >= m) = 2.5%
        assert sps.poisson.cdf(m, lam_hi) == pytest.approx(0.025, rel=1e-6)
        if m:
            assert sps.poisson.sf(m - 1, lo * 8 * 360 / 2) == pytest.approx(0.025, rel=1e-6)
        else:
            assert lo == 0
    # replicas that never differ: a disagreement interval [0, 2·3.69/(R·n)], not a zero-width bar
    a, _ = __import__("nondet_jax.analysis.metrics", fromlist=["pair_indices"]).pair_indices(8)
    lo, hi = stats.disagreement_ci(np.zeros(len(a)), 8, minority=0, n_test=360)
    assert lo == 0 and hi == pytest.approx(2 * sps.chi2.ppf(0.975, 2) / 2 / (8 * 360))


def test_pitman_morgan_is_pearsonr_of_sums_and_differences_and_its_interval_inverts_it():
    rng = np.random.default_rng(5)
    u = rng.normal(size=12)
    a, b = u + rng.normal(0, 0.3, 12), u + rng.normal(0, 1.5, 12)
    out = stats.pitman_morgan(a, b)
    assert out["p"] == pytest.approx(sps.pearsonr(a + b, a - b).pvalue)
    assert out["ratio"] == pytest.approx(a.std(ddof=1) / b.std(ddof=1))
    assert out["correlation"] == pytest.approx(np.corrcoef(a, b)[0, 1])
    lo, hi = out["ci"]
    for lam in (lo, hi):  # each end is the ratio at which the test is exactly at 5%
        assert sps.pearsonr(a + lam * b, a - lam * b).pvalue == pytest.approx(0.05)
    # by hand: F·[1 + 2K(1−r²) ± 2√(K(1−r²)(1 + K(1−r²)))], K = t²/(n−2)
    f, r2, k = a.var(ddof=1) / b.var(ddof=1), out["correlation"] ** 2, sps.t.ppf(0.975, 10) ** 2 / 10
    g = k * (1 - r2)
    assert (lo ** 2, hi ** 2) == pytest.approx((f * (1 + 2 * g - 2 * np.sqrt(g * (1 + g))),
                                                f * (1 + 2 * g + 2 * np.sqrt(g * (1 + g)))))


def test_paired_ratio_interval_is_narrower_for_correlated_arms_and_none_below_5_pairs():
    rng = np.random.default_rng(6)
    u = rng.normal(size=16)
    a, b = u + rng.normal(0, 0.2, 16), u + rng.normal(0, 1.0, 16)
    plo, phi = stats.paired_ratio_ci(a, b)
    ilo, ihi = stats.std_ratio_ci(a, b)
    assert plo < a.std(ddof=1) / b.std(ddof=1) < phi
    assert np.log(phi / plo) < np.log(ihi / ilo)
    assert all(np.isnan(stats.paired_ratio_ci(a[:4], b[:4])))


def test_failed_replica_rule_names_a_planted_failure_and_not_a_normal_arm():
    rng = np.random.default_rng(7)
    healthy = rng.normal(0.92, 0.005, 8)
    assert stats.failed_replicas(healthy) == []
    planted = healthy.copy()
    planted[3] = 0.40
    assert stats.failed_replicas(planted) == [3]
    assert stats.failed_replicas(planted[:4]) == []  # too few replicas to call the rest "the rest"
    tied = np.full(8, 340 / 360)
    tied[2] = 341 / 360  # one image off: a count, not a failure
    assert stats.failed_replicas(tied, resolution=1 / 360) == []
    assert stats.failed_replicas(rng.normal(size=(1000, 8))).any(-1).mean() < 0.05  # false alarms, normal arms


def test_paired_difference_is_scipys_paired_t_interval():
    rng = np.random.default_rng(8)
    a = rng.normal(size=9)
    b = a + 0.3 + rng.normal(0, 0.2, 9)
    ci = sps.ttest_rel(b, a).confidence_interval()
    assert stats.paired_difference(a, b)["ci"] == pytest.approx([ci.low, ci.high])


def test_compare_arms_pairs_replicas_sharing_seeds_and_names_failed_runs():
    from nondet_jax.analysis.arm import compare_arms
    rng = np.random.default_rng(9)
    u = rng.normal(0.9, 0.01, 8)  # the seed's shared effect: replica r of both arms
    acc = {"all": u + rng.normal(0, 0.01, 8), "init": u.copy(), "data_order": rng.normal(0.9, 0.01, 8)}
    acc["data_order"][5] = 0.4  # a run that failed to train
    records = {arm: {"rows": [{"replica": r, "test_accuracy": float(v[r]), "test_loss": float(1 - v[r])}
                              for r in range(8)], "metrics": {}} for arm, v in acc.items()}
    out = compare_arms(records)
    c = out["init"]["accuracy"]
    assert c["paired"] and c["pairs"] == 8
    # the p printed beside the paired interval is that interval's: at level 1 − p one end of it touches 1
    p = c["paired_p"]
    assert 0 < p < 1 and c["pair_correlation"] == pytest.approx(np.corrcoef(acc["init"], acc["all"])[0, 1])
    lo, hi = stats.paired_ratio_ci(acc["init"], acc["all"], 1 - p)
    assert min(abs(lo - 1), abs(hi - 1)) < 1e-9
    rng2 = np.random.default_rng(3)  # and on many studies: p < 0.05 exactly where the 95% interval excludes 1
    a2 = rng2.normal(size=(2000, 8))
    b2 = a2 + 1.5 * rng2.normal(size=(2000, 8))  # std ratio 0.55, correlation 0.55
    lo2, hi2 = stats.paired_ratio_ci(a2, b2)
    assert np.array_equal(stats.paired_ratio_p(a2, b2) < 0.05, (lo2 > 1) | (hi2 < 1))
    assert 0.05 < ((lo2 > 1) | (hi2 < 1)).mean() < 0.95
    assert c["family_level"] == pytest.approx(1 - 0.05 / 2)
    assert c["family_ci"] == pytest.approx(list(stats.paired_ratio_ci(acc["init"], acc["all"], 1 - 0.05 / 2)))
    assert "failed_replicas" not in c
    d = out["data_order"]["accuracy"]
    assert d["failed_replicas"] == {"arm": [5], "reference": []}
    keep = np.delete(acc["data_order"], 5)
    assert d["without_failed"]["ratio"] == pytest.approx(keep.std(ddof=1) / acc["all"].std(ddof=1))


def test_findings_name_the_failed_replica_and_read_the_paired_family_interval():
    from nondet_jax.analysis.arm import compare_arms
    from nondet_jax.report.markdown import _findings
    rng = np.random.default_rng(10)
    u = rng.normal(0.9, 0.01, 8)
    acc = {"all": u + rng.normal(0, 0.01, 8), "init": u + rng.normal(0, 0.002, 8)}
    acc["init"][6] = 0.35
    records = {arm: {"rows": [{"replica": r, "test_accuracy": float(v[r]), "test_loss": 1.0} for r in range(8)]}
               for arm, v in acc.items()}
    summary = {"vs_all": compare_arms(records), "arms": {a: {"replicas": 8} for a in acc}, "backend": "cpu"}
    text = "\n".join(_findings(summary))
    assert "95.0% paired (the arms share seeds: 8 pairs) interval (Bonferroni over 1 arms; z at 98.00%, widened)" in text
    assert "**Failed replicas named**" in text and "`init` replica 6" in text
    keep = np.delete(acc["init"], 6)
    assert f"Without them the std ratio is {keep.std(ddof=1) / acc['all'].std(ddof=1):.2f}" in text


def test_a_tied_arm_of_counts_keeps_the_independent_interval_with_its_tie_bound():
    from nondet_jax.analysis.arm import compare_arms
    ref = np.array([330, 335, 338, 342, 344, 339, 333, 341]) / 360
    records = {"all": {"rows": [{"replica": r, "test_accuracy": float(v), "test_loss": 1.0 + r}
                                for r, v in enumerate(ref)]},
               "hardware": {"rows": [{"replica": r, "test_accuracy": 340 / 360, "test_loss": 1.0 + r} for r in range(8)],
                            "metrics": {"accuracy": {"resolution": 1 / 360}}}}
    c = compare_arms(records)["hardware"]["accuracy"]
    assert "paired" not in c  # nothing to pair: no replica moved
    lo, hi = c["family_ci"]
    assert lo == 0 < hi  # the tie bound, not a zero-width [0, 0]


def test_replicas_for_std_factor_is_the_printed_intervals():
    """The design figure is the printed (robust, widened) interval's: it spans at most a factor 2 in 80% of
    normal studies at 31 replicas and not at 30; the chi-square interval's 18 was printed before, where the
    printed interval never spans less than 2.45."""
    assert stats.replicas_for_std_factor(2.0) == 31
    share = {n: np.mean(np.divide(*stats.std_ci(np.random.default_rng(n).normal(size=(4000, n)))[::-1]) <= 2)
             for n in (30, 31)}
    assert share[30] < 0.8 <= share[31]
    lo, hi = stats.std_ci(np.random.default_rng(0).normal(size=(4000, 18)))
    assert (hi / lo).min() > 2.45 and stats.replicas_for_std_factor(1.0) is None


def test_non_finite_or_too_few_scores_get_no_confident_p():
    """A NaN or infinite score is refused in one line (it gave a spread p of 1.0 or 0.0); Brown–Forsythe is n/a
    below 5 replicas per arm (at 2 its statistic is infinite whatever the spreads: p < 0.05 in every study)."""
    from nondet_jax.errors import UsageError

    good = [0.91, 0.92, 0.93, 0.90, 0.94]
    with pytest.raises(UsageError, match=r"^x holds 1 NaN or infinite score\(s\) \(the first at index 2\); leave out"):
        stats.compare_spread([0.9, 0.91, np.nan, 0.92, 0.93], good)
    with pytest.raises(UsageError, match="reference holds 1 NaN"):
        stats.compare_spread(good, [0.1, np.inf, 0.2, 0.5, 0.4])
    with pytest.raises(UsageError, match="need two finite, non-negative stds"):
        stats.compare_spread_from_summary(float("nan"), 5, 0.02, 5)
    with pytest.raises(UsageError, match="but a has 5 and b 7; pass the two methods' scores for the same seeds"):
        stats.compare_paired(range(5), range(7))
    with pytest.raises(UsageError, match="b holds 1 NaN"):
        stats.compare_means(good, good[:4] + [np.nan])
    rng = np.random.default_rng(0)
    assert np.isnan(stats.brown_forsythe(rng.normal(size=2), rng.normal(size=2)))
    with np.errstate(divide="ignore"):  # why: at R=2 the raw test rejects in every study
        assert all(stats.levene_median(*rng.normal(size=(2, 2))) < 0.05 for _ in range(200))
    assert np.isnan(stats.compare_spread([0.91, 0.93], [0.90, 0.94])["brown_forsythe_p"])
    a, b = rng.normal(size=8), rng.normal(size=8)
    assert stats.brown_forsythe(a, b) == pytest.approx(sps.levene(a, b, center="median").pvalue)
