"""Uncertainty for variability studies: intervals with the coverage they claim, variance-ratio
tests, power, and "is my improvement real?".

All functions take plain numpy (or JAX) arrays of per-replica values, e.g. test accuracies.
Every interval's method is in :data:`METHODS` (one line each, printed where it is used); its
coverage at R=8 and R=12 is measured by ``benchmarks/coverage.py`` and tested in
``tests/test_coverage.py`` (nominal 95% must cover at least 93% at R=8). Below the R at which an
interval means anything (:data:`MIN_REPLICAS`) it is ``(nan, nan)``: shown as "n/a" with
:func:`na_reason`, stored as null.

Example::

    import numpy as np
    from nondet_jax import stats
    a, b = np.random.default_rng(0).normal(0, 1, 20), np.random.default_rng(1).normal(0, 2, 20)
    stats.std_ci(a)                       # (low, high) 95% chi-square CI of the std
    stats.compare_spread(a, b)            # std ratio, its CI, F-test and Brown-Forsythe p, replicas for 80% power
    stats.compare_spread_from_summary(0.00302, 50, 0.00346, 50, ddof=0)["f_test_p"]   # 0.34: published stds
    stats.compare_means(a, b)             # difference with Welch CI, p, probability of improvement, replicas needed
"""

from __future__ import annotations

import math

import numpy as np
from scipy import stats as sps

from nondet_jax.analysis.metrics import pair_indices

LEVEL = 0.95
BOOTSTRAP_SAMPLES = 4000
BOOTSTRAP_SEED = 0

METHODS = {
    "mean": "t interval: mean ± t(R−1)·s/√R",
    "std": "chi-square interval (normal data): s·√((R−1)/χ²(R−1)) at the two tail quantiles",
    "pairwise": "replica jackknife (leave one replica and all its pairs out) of the mean over pairs, ± t(R−1)·se",
    "ratio": "F interval of std(a)/std(b) (normal data)",
    "difference": "Welch t interval of mean(B) − mean(A), Welch–Satterthwaite degrees of freedom",
    "probability_of_improvement": ("P(B > A) + ½P(B = A) over all pairs of runs (as rliable); Newcombe's score interval "
                                   "with the Hanley–McNeil variance (method 5)"),
}
MIN_REPLICAS = {"mean": 2, "std": 2, "pairwise": 3, "ratio": 2, "difference": 2, "probability_of_improvement": 2}
_WHY = {"mean": "a mean's interval needs a spread estimate", "std": "a std needs two values",
        "pairwise": "the jackknife needs two pairs left when one replica is left out",
        "ratio": "each std needs two values", "difference": "each mean's spread needs two values",
        "probability_of_improvement": "its variance needs two values per method"}


def na_reason(kind: str, replicas: int) -> str | None:
    """Why the ``kind`` interval (a key of :data:`METHODS`) is "n/a" at ``replicas``; None when it exists."""
    need = MIN_REPLICAS[kind]
    return None if replicas >= need else f"n/a: R={replicas} < {need} ({_WHY[kind]})"


def format_ci(ci, digits: int = 4, scale: float = 1.0) -> str:
    """`` [low, high]`` for printing, or `` n/a`` when the interval does not exist (too few replicas:
    stored as null or NaN); never a made-up [0, x]."""
    if not ci or any(c is None or not math.isfinite(c) for c in ci):
        return " n/a"
    return f" [{ci[0] * scale:.{digits}f}, {ci[1] * scale:.{digits}f}]"


def std(x, ddof: int = 1):
    """Sample std (over the last axis); exactly 0 for identical values (shifted by the first value:
    the mean of equal floats can be off by an ulp, which would leave a spurious 1e-16 spread)."""
    x = np.asarray(x, dtype=np.float64)
    if x.shape[-1] <= ddof:
        return _out(np.full(x.shape[:-1], np.nan))
    return _out((x - x[..., :1]).std(axis=-1, ddof=ddof))


def _out(a):
    """A float for a 0-d result, else the array (the functions below also take batches: (..., R))."""
    a = np.asarray(a, dtype=np.float64)
    return float(a) if a.ndim == 0 else a


def _nan2(shape=()) -> tuple:
    return _out(np.full(shape, np.nan)), _out(np.full(shape, np.nan))


def mean_ci(x, level: float = LEVEL) -> tuple:
    """t interval of the mean (exact for normal data); (nan, nan) below 2 values. Last axis: replicas."""
    x = np.asarray(x, dtype=np.float64)
    n = x.shape[-1]
    if n < MIN_REPLICAS["mean"]:
        return _nan2(x.shape[:-1])
    m, half = x.mean(-1), sps.t.ppf(0.5 + level / 2, n - 1) * std(x) / math.sqrt(n)
    return _out(m - half), _out(m + half)


def std_ci(x, level: float = LEVEL, std_max: float = np.inf) -> tuple:
    """Chi-square interval of the standard deviation of normal data (brackets ``std(x, ddof=1)``).

    ``(R−1)s²/σ² ~ χ²(R−1)``, so σ lies in ``s·√((R−1)/χ²_{(1+level)/2})`` to
    ``s·√((R−1)/χ²_{(1−level)/2})``; (nan, nan) below 2 values. Last axis: replicas.
    ``std_max`` is the largest std the quantity can have (0.5 for a value in [0, 1], such as an
    accuracy): the upper end is clipped to it, which keeps every possible true std (at R=2 the
    unclipped upper end is 32 times the estimate).
    """
    x = np.asarray(x, dtype=np.float64)
    n = x.shape[-1]
    if n < MIN_REPLICAS["std"]:
        return _nan2(x.shape[:-1])
    s, d = std(x), n - 1
    return (_out(np.minimum(s * math.sqrt(d / sps.chi2.ppf(0.5 + level / 2, d)), std_max)),
            _out(np.minimum(s * math.sqrt(d / sps.chi2.ppf(0.5 - level / 2, d)), std_max)))


def pairwise_mean_ci(values, replicas: int, level: float = LEVEL, bounds: tuple[float, float] = (-np.inf, np.inf)) -> tuple:
    """CI of the mean of a pairwise metric over R replicas, respecting that pairs share replicas.

    ``values`` holds one value per pair in :func:`nondet_jax.analysis.metrics.pair_indices` order (last
    axis). The mean over pairs is a U-statistic of the replicas; its standard error comes from the
    jackknife over replicas (leave replica i and its R−1 pairs out), with t(R−1) quantiles.
    The interval is clipped to ``bounds``, the metric's possible range (a disagreement is never
    below 0): clipping never drops a possible true value, so coverage is unchanged.
    (nan, nan) below 3 replicas.
    """
    values = np.asarray(values, dtype=np.float64)
    r = replicas
    if r < MIN_REPLICAS["pairwise"]:
        return _nan2(values.shape[:-1])
    a, b = pair_indices(r)
    if values.shape[-1] != len(a):
        raise ValueError(f"{values.shape[-1]} pair values do not match {r} replicas ({len(a)} pairs)")
    incidence = np.zeros((len(a), r))
    incidence[np.arange(len(a)), a] = incidence[np.arange(len(a)), b] = 1.0
    per_replica = values @ incidence  # (..., R): sum over the pairs of replica i
    loo = (values.sum(-1, keepdims=True) - per_replica) / (len(a) - (r - 1))  # mean without replica i
    se = np.sqrt((r - 1) / r * ((loo - loo.mean(-1, keepdims=True)) ** 2).sum(-1))
    m, half = values.mean(-1), sps.t.ppf(0.5 + level / 2, r - 1) * se
    return _out(np.clip(m - half, *bounds)), _out(np.clip(m + half, *bounds))


def spread(x, std_max: float = np.inf) -> dict:
    """Mean and std (ddof=1) of per-replica values with their intervals (t; chi-square, its upper end
    clipped to ``std_max``, see :func:`std_ci`)."""
    x = np.asarray(x, dtype=np.float64)
    return {"mean": float(x.mean()), "mean_ci": list(mean_ci(x)), "std": std(x),
            "std_ci": list(std_ci(x, std_max=std_max))}


ACCURACY_STD_MAX = 0.5  # the largest std of a quantity in [0, 1]


def _f_p(f: float, d1: int, d2: int) -> float:
    cdf = sps.f.cdf(f, d1, d2)
    return float(min(1.0, 2 * min(cdf, 1 - cdf)))


def f_test(a, b) -> float:
    """Two-sided F-test p-value for equal variances of two normal samples."""
    return _f_comparison(std(a), len(a), std(b), len(b))["f_test_p"]


def brown_forsythe(a, b) -> float:
    """Brown-Forsythe (Levene with medians) p-value for equal spread: robust to non-normality."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if np.ptp(a) == 0 and np.ptp(b) == 0:
        return 1.0
    return float(sps.levene(a, b, center="median").pvalue)


def _ratio_ci(va, vb, d1: int, d2: int, level: float) -> tuple:
    """F interval of sqrt(va/vb) (variances with d1, d2 degrees of freedom); NaN where vb is 0."""
    with np.errstate(divide="ignore", invalid="ignore"):
        f = np.where(vb > 0, va / np.where(vb > 0, vb, 1.0), np.nan)
    return (_out(np.sqrt(f / sps.f.ppf(0.5 + level / 2, d1, d2))),
            _out(np.sqrt(f / sps.f.ppf(0.5 - level / 2, d1, d2))))


def std_ratio_ci(a, b, level: float = LEVEL) -> tuple:
    """F-distribution CI of std(a)/std(b) under normality (last axis: replicas)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if min(a.shape[-1], b.shape[-1]) < MIN_REPLICAS["ratio"]:
        return _nan2(np.broadcast_shapes(a.shape[:-1], b.shape[:-1]))
    return _ratio_ci(np.asarray(std(a)) ** 2, np.asarray(std(b)) ** 2, a.shape[-1] - 1, b.shape[-1] - 1, level)


def f_test_power(ratio: float, n: int, alpha: float = 0.05, n_b: int | None = None) -> float:
    """Power of the two-sided F-test with n replicas in the first arm (``n_b`` in the second, default n)
    when the true std ratio is ``ratio``."""
    d1, d2 = n - 1, (n_b or n) - 1
    lo, hi = sps.f.ppf(alpha / 2, d1, d2), sps.f.ppf(1 - alpha / 2, d1, d2)
    r2 = ratio ** 2
    return float(sps.f.sf(hi / r2, d1, d2) + sps.f.cdf(lo / r2, d1, d2))


def _smallest_n(ok, max_n: int) -> int | None:
    """Smallest n in [2, max_n] with ok(n), for ok monotone in n; None when there is none.

    Doubling first, then bisection: ``ok`` is only evaluated near the answer (scipy's noncentral
    distributions lose accuracy far in the tails, at n much larger than needed).
    """
    hi = 2
    while not ok(hi):
        if hi >= max_n:
            return None
        hi = min(2 * hi, max_n)
    lo = max(2, hi // 2)
    while lo < hi:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def replicas_for_power(ratio: float, power: float = 0.8, alpha: float = 0.05, max_n: int = 100_000) -> int | None:
    """Smallest replicas per arm at which the F-test detects std ratio ``ratio`` with ``power``.

    None when the ratio is 1, not finite, or needs more than ``max_n``.
    """
    if not np.isfinite(ratio) or ratio <= 0 or abs(ratio - 1) < 1e-12:
        return None
    return _smallest_n(lambda n: f_test_power(ratio, n, alpha) >= power, max_n)


def compare_spread_from_summary(std_a: float, n_a: int, std_b: float, n_b: int, ddof: int = 1,
                                level: float = LEVEL) -> dict:
    """Two spreads known only by their std and count (e.g. published): is ``std_a`` different from ``std_b``?

    ``ddof`` says how the given stds were computed (0: divided by n, as numpy's default and Morin &
    Willetts; 1: by n−1); they are converted to unbiased variances first. Returns the std ratio a/b
    (of the ddof=1 stds), its F interval, the two-sided F-test p, the power of that test at the
    observed ratio with these counts, and the replicas per arm needed for 80% power.

    Example: Morin & Willetts' accuracy spreads, ``compare_spread_from_summary(0.00302, 50, 0.00346, 50,
    ddof=0)`` gives ratio 0.87 and p = 0.34.
    """
    out = _f_comparison(std_a, n_a, std_b, n_b, ddof, level)
    ratio = out["ratio"]
    finite = bool(np.isfinite(ratio) and ratio > 0)
    return {**out, "power": f_test_power(ratio, n_a, n_b=n_b) if finite else float("nan"),
            "replicas_for_80pct_power": replicas_for_power(ratio) if finite else None}


def _f_comparison(std_a: float, n_a: int, std_b: float, n_b: int, ddof: int = 1, level: float = LEVEL) -> dict:
    """Ratio, its F interval and the two-sided F-test p of two stds (see compare_spread_from_summary)."""
    if min(n_a, n_b) < 2 or min(n_a, n_b) <= ddof or min(std_a, std_b) < 0:
        raise ValueError(f"need two non-negative stds from at least 2 values each (and more than ddof={ddof}); "
                         f"got std {std_a} of {n_a} and std {std_b} of {n_b}")
    va, vb = std_a ** 2 * (n_a - ddof) / (n_a - 1), std_b ** 2 * (n_b - ddof) / (n_b - 1)
    d1, d2 = n_a - 1, n_b - 1
    ci = _ratio_ci(va, vb, d1, d2, level)
    if vb == 0:
        p, ratio = (1.0 if va == 0 else 0.0), float("nan")
    else:
        ratio, p = math.sqrt(va / vb), (0.0 if va == 0 else _f_p(va / vb, d1, d2))
    return {"ratio": ratio, "ratio_ci": list(ci), "f_test_p": p}


def compare_spread(x, reference) -> dict:
    """Std of ``x`` relative to ``reference`` (Morin & Willetts' statistic) with its uncertainty.

    Returns ratio, its 95% CI, F-test and Brown-Forsythe p-values, and the replicas per arm needed
    for 80% power at the observed ratio.
    """
    out = compare_spread_from_summary(std(x), len(x), std(reference), len(reference))
    return {"ratio": out["ratio"], "ratio_ci": out["ratio_ci"], "f_test_p": out["f_test_p"],
            "brown_forsythe_p": brown_forsythe(x, reference),
            "replicas_for_80pct_power": out["replicas_for_80pct_power"]}


def welch(a, b, level: float = LEVEL) -> dict:
    """Difference of means ``mean(b) − mean(a)`` with its Welch t interval and two-sided p (last axis: replicas)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    na, nb = a.shape[-1], b.shape[-1]
    diff = b.mean(-1) - a.mean(-1)
    if min(na, nb) < MIN_REPLICAS["difference"]:
        nan = _out(np.full(np.shape(diff), np.nan))
        return {"difference": _out(diff), "ci": [nan, nan], "p": nan, "df": nan}
    qa, qb = np.asarray(std(a)) ** 2 / na, np.asarray(std(b)) ** 2 / nb
    se = np.sqrt(qa + qb)
    with np.errstate(divide="ignore", invalid="ignore"):
        df = np.where(se > 0, (qa + qb) ** 2 / (qa ** 2 / (na - 1) + qb ** 2 / (nb - 1)), na + nb - 2)
        t = np.where(se > 0, diff / np.where(se > 0, se, 1.0), np.where(diff == 0, 0.0, np.inf))
    half = sps.t.ppf(0.5 + level / 2, df) * se
    return {"difference": _out(diff), "ci": [_out(diff - half), _out(diff + half)],
            "p": _out(2 * sps.t.sf(np.abs(t), df)), "df": _out(df)}


def probability_of_improvement(a, b, level: float = LEVEL) -> dict:
    """P(B > A) + ½·P(B = A) for one run of each method (rliable's probability of improvement, the
    Mann–Whitney statistic over all (a, b) pairs), with a 95% interval (last axis: replicas).

    Interval: Newcombe's (2006) method 5, a score interval with the Hanley–McNeil variance at
    N = (n_a + n_b)/2: every θ with |θ̂ − θ| ≤ z·√V(θ),
    ``V(θ) = θ(1−θ)/(n_a n_b)·[1 + (N−1)((1−θ)/(2−θ) + θ/(1+θ))]``. It stays inside [0, 1] and is
    not degenerate when every B beats every A (θ̂ = 1), where a bootstrap or a DeLong interval is.
    """
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    na, nb = a.shape[-1], b.shape[-1]
    diff = b[..., :, None] - a[..., None, :]
    theta = ((diff > 0) + 0.5 * (diff == 0)).mean((-1, -2))
    if min(na, nb) < MIN_REPLICAS["probability_of_improvement"]:
        nan = _out(np.full(np.shape(theta), np.nan))
        return {"probability": _out(theta), "ci": [nan, nan]}
    z, big_n = sps.norm.ppf(0.5 + level / 2), (na + nb) / 2

    def outside(t):  # > 0 where t is outside the interval around theta
        v = t * (1 - t) / (na * nb) * (1 + (big_n - 1) * ((1 - t) / (2 - t) + t / (1 + t)))
        return (theta - t) ** 2 - z * z * v

    def bisect(lo, hi, lo_outside):  # the boundary between lo and hi (exactly one crossing)
        for _ in range(50):
            mid = 0.5 * (lo + hi)
            out = outside(mid) > 0
            lo, hi = np.where(out == lo_outside, mid, lo), np.where(out == lo_outside, hi, mid)
        return 0.5 * (lo + hi)

    zero, one = np.zeros_like(theta), np.ones_like(theta)
    low = np.where(theta <= 0, 0.0, bisect(zero, theta, True))
    high = np.where(theta >= 1, 1.0, bisect(theta, one, False))
    return {"probability": _out(theta), "ci": [_out(low), _out(high)]}


def t_test_power(effect: float, n: int, alpha: float = 0.05) -> float:
    """Power of the two-sided two-sample t-test with n replicas per method at standardised effect
    ``effect`` = difference / std."""
    df, ncp = 2 * n - 2, abs(effect) * math.sqrt(n / 2)
    crit = sps.t.ppf(1 - alpha / 2, df)
    return float(sps.nct.sf(crit, df, ncp) + sps.nct.cdf(-crit, df, ncp))


def replicas_for_difference(difference: float, sd: float, power: float = 0.8, alpha: float = 0.05,
                            max_n: int = 100_000) -> int | None:
    """Replicas per method for the two-sided t-test to detect ``difference`` with ``power`` when the
    run-to-run std is ``sd``. None for no difference, no spread estimate, or more than ``max_n``."""
    if not (np.isfinite(difference) and np.isfinite(sd)) or difference == 0:
        return None
    if sd == 0:
        return 2
    return _smallest_n(lambda n: t_test_power(difference / sd, n, alpha) >= power, max_n)


def compare_means(a, b, level: float = LEVEL, higher_is_better: bool = True) -> dict:
    """Is method B better than method A? Per-seed scores of each, e.g. test accuracies.

    Returns n_a, n_b, both means and stds, the difference mean(B) − mean(A) with its Welch interval
    and p-value, the probability of improvement (that one run of B scores better than one run of
    A: higher, or lower when ``higher_is_better`` is False) with its interval, and the replicas per
    method a two-sample t-test needs to detect the observed difference with 80% power given the
    pooled run-to-run std.
    """
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    if min(len(a), len(b)) < 2 or not (np.isfinite(a).all() and np.isfinite(b).all()):
        raise ValueError(f"need at least 2 finite scores per method; got {len(a)} and {len(b)}")
    sign = 1.0 if higher_is_better else -1.0
    w, poi = welch(a, b, level), probability_of_improvement(sign * a, sign * b, level)
    pooled = math.sqrt(((len(a) - 1) * std(a) ** 2 + (len(b) - 1) * std(b) ** 2) / (len(a) + len(b) - 2))
    return {"n_a": len(a), "n_b": len(b), "mean_a": float(a.mean()), "mean_b": float(b.mean()),
            "std_a": std(a), "std_b": std(b), "difference": w["difference"], "difference_ci": w["ci"],
            "welch_df": w["df"], "p": w["p"], "probability_of_improvement": poi["probability"],
            "probability_of_improvement_ci": poi["ci"], "pooled_std": pooled,
            "replicas_for_80pct_power": replicas_for_difference(w["difference"], pooled), "level": level,
            "higher_is_better": higher_is_better}
