"""Every interval nondet_jax prints covers the truth at least 93% of the time at R=8 (nominal 95%),
by seeded simulation (nondet_jax.analysis.coverage), and the old percentile bootstrap of a std did not."""

import numpy as np
import pytest

from nondet_jax.analysis import coverage, stats


@pytest.mark.parametrize("case", [c for c in coverage.CASES if "stress" not in c])
def test_interval_covers_at_least_93_percent_at_r8(case):
    rate = coverage.simulate(case, replicas=8, trials=2000, seed=0)
    assert 0.93 <= rate <= 0.99, f"{case}: {rate:.3f}"


def test_every_printed_interval_kind_is_simulated():
    assert {kind for kind, _, _ in coverage.CASES.values()} == set(stats.METHODS)


def test_percentile_bootstrap_of_a_std_undercovers_at_r8():
    """The reason for the chi-square interval: resampling 8 values cannot reach the true spread often enough."""
    rng = np.random.default_rng(0)
    x = rng.normal(0, 1, (2000, 8))
    idx = rng.integers(0, 8, (200, 8))
    boot = x[:, idx].std(-1, ddof=1)  # (trials, resamples)
    lo, hi = np.quantile(boot, [0.025, 0.975], axis=1)
    assert np.mean((lo <= 1) & (1 <= hi)) < 0.85
    assert coverage.simulate("std", 8) > 0.93


def test_skewed_pair_values_are_the_known_weak_spot():
    """One heavily skewed value per pair (no averaging inside the pair) under-covers a little: recorded, not hidden."""
    assert 0.88 <= coverage.simulate("pairwise |X_a−X_b| (stress)", 8) < 0.95
