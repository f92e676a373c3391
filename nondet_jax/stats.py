"""Uncertainty for variability studies: seeded bootstrap CIs, variance-ratio tests, power.

All functions take plain numpy (or JAX) arrays of per-replica values, e.g. test accuracies.

Example::

    import numpy as np
    from nondet_jax import stats
    a, b = np.random.default_rng(0).normal(0, 1, 20), np.random.default_rng(1).normal(0, 2, 20)
    stats.bootstrap_std_ci(a)             # (low, high) 95% CI of std(a, ddof=1)
    stats.compare_spread(a, b)            # std ratio, its CI, F-test and Brown-Forsythe p, replicas for 80% power
"""

from __future__ import annotations

import math

import numpy as np
from scipy import stats as sps

BOOTSTRAP_SAMPLES = 10_000
BOOTSTRAP_SEED = 0


def std(x, ddof: int = 1) -> float:
    """Sample std; exactly 0 for identical values (shifted by the first value: the mean of equal
    floats can be off by an ulp, which would leave a spurious 1e-16 spread)."""
    x = np.asarray(x, dtype=np.float64)
    return float((x - x[0]).std(ddof=ddof)) if len(x) > ddof else float("nan")


def bootstrap_std_ci(x, level: float = 0.95, samples: int = BOOTSTRAP_SAMPLES, seed: int = BOOTSTRAP_SEED,
                     ddof: int = 1) -> tuple[float, float]:
    """Percentile-bootstrap CI of the sample std (ddof=1); seeded, so the same every run.

    Resamples are drawn with ``numpy.random.default_rng(seed)``. With fewer than 2 values the
    interval is (nan, nan).
    """
    x = np.asarray(x, dtype=np.float64)
    if len(x) < 2:
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(x), size=(samples, len(x)))
    s = (x[idx] - x[0]).std(axis=1, ddof=ddof)
    lo, hi = np.quantile(s, [(1 - level) / 2, 1 - (1 - level) / 2])
    return float(lo), float(hi)


def bootstrap_mean_ci(x, level: float = 0.95, samples: int = BOOTSTRAP_SAMPLES,
                      seed: int = BOOTSTRAP_SEED) -> tuple[float, float]:
    """Percentile-bootstrap CI of the mean (seeded)."""
    x = np.asarray(x, dtype=np.float64)
    if len(x) < 2:
        return float("nan"), float("nan")
    idx = np.random.default_rng(seed).integers(0, len(x), size=(samples, len(x)))
    lo, hi = np.quantile(x[idx].mean(axis=1), [(1 - level) / 2, 1 - (1 - level) / 2])
    return float(lo), float(hi)


def f_test(a, b) -> float:
    """Two-sided F-test p-value for equal variances of two normal samples."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    va, vb = std(a) ** 2, std(b) ** 2
    if va == 0 and vb == 0:
        return 1.0
    if vb == 0 or va == 0:
        return 0.0
    f = va / vb
    cdf = sps.f.cdf(f, len(a) - 1, len(b) - 1)
    return float(min(1.0, 2 * min(cdf, 1 - cdf)))


def brown_forsythe(a, b) -> float:
    """Brown-Forsythe (Levene with medians) p-value for equal spread: robust to non-normality."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if np.ptp(a) == 0 and np.ptp(b) == 0:
        return 1.0
    return float(sps.levene(a, b, center="median").pvalue)


def std_ratio_ci(a, b, level: float = 0.95) -> tuple[float, float]:
    """F-distribution CI of std(a)/std(b) under normality."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    va, vb = std(a) ** 2, std(b) ** 2
    if vb == 0:
        return float("nan"), float("nan")
    f = va / vb
    d1, d2 = len(a) - 1, len(b) - 1
    lo = f / sps.f.ppf(1 - (1 - level) / 2, d1, d2)
    hi = f / sps.f.ppf((1 - level) / 2, d1, d2)
    return math.sqrt(lo), math.sqrt(hi)


def f_test_power(ratio: float, n: int, alpha: float = 0.05) -> float:
    """Power of the two-sided F-test with n replicas per arm when the true std ratio is ``ratio``."""
    d = n - 1
    lo, hi = sps.f.ppf(alpha / 2, d, d), sps.f.ppf(1 - alpha / 2, d, d)
    r2 = ratio ** 2
    return float(sps.f.sf(hi / r2, d, d) + sps.f.cdf(lo / r2, d, d))


def replicas_for_power(ratio: float, power: float = 0.8, alpha: float = 0.05, max_n: int = 100_000) -> int | None:
    """Smallest replicas per arm at which the F-test detects std ratio ``ratio`` with ``power``.

    None when the ratio is 1, not finite, or needs more than ``max_n``.
    """
    if not np.isfinite(ratio) or ratio <= 0 or abs(ratio - 1) < 1e-12:
        return None
    if f_test_power(ratio, max_n, alpha) < power:
        return None
    lo, hi = 2, max_n  # power grows with n: bisect
    while lo < hi:
        mid = (lo + hi) // 2
        if f_test_power(ratio, mid, alpha) >= power:
            hi = mid
        else:
            lo = mid + 1
    return lo


def compare_spread(x, reference) -> dict:
    """Std of ``x`` relative to ``reference`` (Morin & Willetts' statistic) with its uncertainty.

    Returns ratio, its 95% CI, F-test and Brown-Forsythe p-values, and the replicas per arm needed
    for 80% power at the observed ratio.
    """
    s, s_ref = std(x), std(reference)
    ratio = s / s_ref if s_ref > 0 else float("nan")
    lo, hi = std_ratio_ci(x, reference)
    return {"ratio": ratio, "ratio_ci": [lo, hi], "f_test_p": f_test(x, reference),
            "brown_forsythe_p": brown_forsythe(x, reference), "replicas_for_80pct_power": replicas_for_power(ratio)}


def bootstrap_pairwise_mean_ci(values, replicas: int, level: float = 0.95, samples: int = 2000,
                               seed: int = BOOTSTRAP_SEED) -> tuple[float, float]:
    """CI of the mean of a pairwise metric, resampling *replicas* (not pairs, which share members).

    ``values`` holds one value per pair in :func:`nondet_jax.metrics.pair_indices` order. Each
    bootstrap sample draws R replicas with replacement and averages the metric over its pairs of
    distinct replicas. Seeded: the same numbers every run.
    """
    from nondet_jax.metrics import pair_indices

    values = np.asarray(values, dtype=np.float64)
    if replicas < 3:
        return float("nan"), float("nan")
    a, b = pair_indices(replicas)
    m = np.full((replicas, replicas), np.nan)
    m[a, b] = m[b, a] = values
    idx = np.random.default_rng(seed).integers(0, replicas, size=(samples, replicas))
    sub = m[idx[:, :, None], idx[:, None, :]]  # (samples, R, R); NaN where a replica meets itself
    upper = np.triu(np.ones((replicas, replicas), bool), k=1)
    sub = np.where(upper, sub, np.nan).reshape(samples, -1)
    ok = ~np.isnan(sub).all(axis=1)
    means = np.nanmean(sub[ok], axis=1)
    lo, hi = np.quantile(means, [(1 - level) / 2, 1 - (1 - level) / 2])
    return float(lo), float(hi)
