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
    stats.std_ci(a)                       # (low, high) robust CI of the std (Bonett's, z at 98.75%)
    stats.std_ci_normal(a)                # (low, high) 95% chi-square CI of the std (exact for normal data)
    stats.compare_spread(a, b)            # std ratio, its robust CI, permutation spread p, F-test p, replicas
    stats.compare_spread_from_summary(0.00302, 50, 0.00346, 50, ddof=0)["f_test_p"]   # 0.34: published stds
    stats.compare_means(a, b)             # difference with Welch CI, p, probability of improvement, replicas needed
"""

from __future__ import annotations

import functools
import math

import numpy as np
from scipy import integrate, optimize, special
from scipy import stats as sps

from nondet_jax.analysis.metrics import PAIRWISE_RANGE, PAIRWISE_SCALE, pair_indices
from nondet_jax.errors import UsageError

LEVEL = 0.95
BOOTSTRAP_SAMPLES = 4000
BOOTSTRAP_SEED = 0

METHODS = {
    "mean": "t interval widened for skew: mean ± t(R−1; 98.25%)·s/√R, i.e. scipy's 96.5% t interval (widened from 95%: "
            "the 95% holds under skew and bad seeds, by simulation); a tied arm: its value ± the largest mean shift that leaves R replicas tied; counts fewer "
            "than 40 steps from their median: joined with Garwood's Poisson interval of those steps",
    "std": ("Bonett (2006) robust interval: exp(ln(c·s²) ± z·se)^½, se from the trimmed-mean kurtosis (never below a "
            "normal's), z at 98.75%, i.e. Bonett's 97.5% interval (widened from 95%: the 95% holds under skew and bad seeds "
            "to R=16, by simulation; tails heavier than t with 5 df fall below 93% from R=16); a tied "
            "arm of counts: [0, the largest std that ties R replicas with probability 2.5%]"),
    "pairwise": ("replica jackknife (leave one replica and all its pairs out) of the mean over pairs, ± t(R−1; 98.25%)·se "
                 "(a 96.5% interval: widened as the mean's), on "
                 "a log scale of the distance to the bound near-identical replicas approach; a disagreement with fewer "
                 "than 40 minority predictions: joined with Garwood's Poisson interval of that count"),
    "ratio": ("Bonett (2006) robust interval of std(a)/std(b), pooled kurtosis (never below a normal's), z at 98.75%, "
              "i.e. Bonett's 97.5% interval (widened from 95% as the std's); a tied arm: "
              "[0, its tie bound / the lower end of the other's std]"),
    "difference": "Welch t interval of mean(B) − mean(A), Welch–Satterthwaite degrees of freedom",
    "probability_of_improvement": ("P(B > A) + ½P(B = A) over all pairs of runs (as rliable); Newcombe's score interval "
                                   "with the Hanley–McNeil variance (method 5)"),
    "decomposition": ("sum of the one-source arms' variance shares Σ σ²_s/σ²_all: Bonett's log-variance interval "
                      "extended to a sum (delta method, kurtosis pooled over the arms, z widened as the std's); each "
                      "share alone: the std ratio's interval, squared, and beside it the paired ratio interval's (the arm shares "
                      "its seeds with all), squared"),
    "paired_difference": ("paired t interval of mean(B_i − A_i) over runs sharing seeds, 95%, not widened: scipy's "
                          "ttest_rel(b, a).confidence_interval() (tied differences of counts: ± the largest mean shift "
                          "that ties them all)"),
    "paired_ratio": ("std(a)/std(b) of arms sharing seeds (replica i of each): Bonett's log-variance interval with the "
                     "pairs' co-kurtosis taken off its variance, z at 98%, i.e. a 96% interval (widened from 95%: the "
                     "93% holds on 360-image accuracies, by simulation); its p (paired_p) is the same interval's: "
                     "below 0.05 exactly when the 95% interval excludes 1"),
    "paired_probability_of_improvement": ("share of seed pairs where B beats A (a tie counts ½); Wilson's score interval "
                                          "with continuity correction (Newcombe 1998, method 4)"),
}
TESTS = {
    "spread_p": ("permutation Brown–Forsythe test: the pooled t of absolute deviations from each arm's median, "
                 "exact over every split of the replicas (20,000 seeded random splits above that many), two-sided; "
                 "n/a below 5 replicas per arm"),
    "spread_p_holm": "spread_p Holm-adjusted over the arms compared with `all` (per quantity)",
    "f_test_p": "F-test of equal variances (normal data only; Morin & Willetts' test)",
    "brown_forsythe_p": "Brown–Forsythe (Levene with medians), F approximation",
    "paired_t_p": ("paired t-test of mean(B_i − A_i) = 0, two-sided: scipy's ttest_rel(b, a).pvalue, the test of the "
                   "printed paired interval (below 0.05 exactly when the 95% interval excludes 0; differences of counts "
                   "that all tie: the level at which their tie bound reaches 0)"),
}
MIN_REPLICAS = {"mean": 2, "std": 3, "pairwise": 3, "ratio": 5, "difference": 2, "probability_of_improvement": 2,
                "paired_difference": 2, "paired_probability_of_improvement": 2, "decomposition": 5, "paired_ratio": 5}
_WHY = {"mean": "a mean's interval needs a spread estimate", "std": "the robust interval needs three values",
        "pairwise": "the jackknife needs a pair left when one replica is left out",
        "ratio": "below 5 replicas per arm the robust ratio interval covers < 93% of skewed or heavy-tailed spreads",
        "difference": "each mean's spread needs two values",
        "probability_of_improvement": "its variance needs two values per method",
        "paired_difference": "the differences' spread needs two pairs",
        "paired_probability_of_improvement": "a share needs two pairs",
        "decomposition": "as the ratio's: below 5 replicas per arm it covers < 93% of skewed spreads",
        "paired_ratio": "as the ratio's: below 5 pairs it covers < 93% of skewed spreads"}


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


def _z(level: float) -> float:
    return float(sps.norm.ppf(0.5 + level / 2))


@functools.lru_cache(maxsize=64)
def tie_rate(replicas: int, level: float = LEVEL) -> float:
    """The largest variance, in squared steps of the count, of a count-valued score (correct test
    examples) whose R replicas all tie with probability at least (1 − level)/2.

    The count is modelled as many test examples flipping independently between replicas, either way:
    a symmetric Skellam variable (the difference of two Poisson counts), the most concentrated count
    of a given variance of that kind, so the bound holds for every such count. Replicas that differ
    by a whole bad seed are not counts of that kind (see docs/statistics.md).
    """
    beta = (1 - level) / 2
    k = np.arange(-60, 61)

    def excess(lam):  # P(R replicas tie) − beta; the tie probability sums P(X = k)^R, X ~ Skellam(lam/2, lam/2)
        return float((special.ive(k, lam) ** replicas).sum()) - beta

    hi = 1.0
    while excess(hi) > 0:
        hi *= 2
    return float(optimize.brentq(excess, 0.0, hi, xtol=1e-12))


def _tied(x) -> np.ndarray:
    return np.ptp(x, axis=-1) == 0


# The mean's t interval (and the pairwise jackknife's) puts this share of 1 − level in its tails (t's 98.25%
# quantile for a 95% interval):
# chosen by simulation (nondet_jax.analysis.coverage, benchmarks/coverage.py) so the 95% holds from R=3 to 16
# under skew (lognormal, skewness 1.8: the exact t interval covered 91.5-92.7%) and 10% bad seeds (92.4% at
# R=8), at the price of an interval 10% wider at R=8 (21% at R=3) that covers 96-97% of normal data.
MEAN_TAIL = 0.7

# Bonett's spread intervals (one std, a ratio of two, the decomposition's sum) put this share of 1 − level in
# their tails on the log-variance scale (z at 98.75% for a 95% interval), chosen the same way: with z at 97.5%
# the std's interval covered 91.6% of skewed and 89.8% of bad-seed spreads at R=16 (it falls with R: the
# kurtosis of a few replicas is underestimated just when their spread is), the ratio's 91.2% under strong skew
# at R=8; with 0.5, 93.1-96.5% at R=16 and the ratio 95.6%, at the price of a log-scale half-width 14% wider
# that covers 98.8-99.9% of normal data at R=4-16 (benchmarks/coverage.py).
SPREAD_TAIL = 0.5


def _z_spread(level: float) -> float:
    return float(sps.norm.ppf(1 - SPREAD_TAIL * (1 - level) / 2))


def _replica_axis(x) -> np.ndarray:
    """``x`` as float64 with its replicas on the last axis, or a one-line error for a single number."""
    x = np.asarray(x, dtype=np.float64)
    if x.ndim == 0:
        raise UsageError(f"got one number ({float(x):g}), but an interval needs one score per replica (an array)")
    return x


def mean_ci(x, level: float = LEVEL, resolution: float | None = None, widen: bool = True) -> tuple:
    """t interval of the mean, its critical value widened for skewed data (:data:`MEAN_TAIL`: t's
    1 − 0.7·(1 − level)/2 quantile); (nan, nan) below 2 values. Last axis: replicas.

    ``resolution``: the step of a count-valued score (1/n_test for an accuracy). R tied values then
    give their value ± the largest mean shift of a count that ties R replicas (:func:`tie_rate`), not
    a zero-width interval. When the replicas differ from their median by fewer than
    :data:`RARE_MINORITY` steps in all, the interval is joined with :func:`rare_steps_ci` (a few
    borderline test examples flipping: at R=16 the t interval alone covered 91.6% of such arms, one
    replica a step away from the rest giving too small a spread). ``widen=False``: the plain t interval
    (t's (1 + level)/2 quantile) and no Poisson join, tied counts still given the tie bound.
    """
    x = _replica_axis(x)
    n = x.shape[-1]
    if n < MIN_REPLICAS["mean"]:
        return _nan2(x.shape[:-1])
    tail = MEAN_TAIL if widen else 1.0
    m, half = x.mean(-1), sps.t.ppf(1 - tail * (1 - level) / 2, n - 1) * std(x) / math.sqrt(n)
    lo, hi = m - half, m + half
    if resolution:
        tied = _tied(x)
        shift = tie_rate(n, level) * resolution
        lo, hi = np.where(tied, m - shift, lo), np.where(tied, m + shift, hi)
        rare_lo, rare_hi, steps = rare_steps_ci(x, resolution, level)
        rare = ~tied & (steps < RARE_MINORITY) & widen
        lo, hi = np.where(rare, np.fmin(lo, rare_lo), lo), np.where(rare, np.fmax(hi, rare_hi), hi)
    return _out(lo), _out(hi)


def _garwood(count, level: float) -> tuple:
    """Garwood's exact interval of a Poisson mean from one ``count``: [0, 3.69] at 95% for a count of 0."""
    m = np.asarray(count, dtype=np.float64)
    a = (1 - level) / 2
    with np.errstate(invalid="ignore"):
        lo = np.where(m > 0, sps.chi2.ppf(a, 2 * np.maximum(m, 1)) / 2, 0.0)
    return lo, sps.chi2.ppf(1 - a, 2 * m + 2) / 2


def rare_steps_ci(x, resolution: float, level: float = LEVEL) -> tuple:
    """Interval of the mean of a count-valued score whose R replicas differ by a few steps of the count
    (``resolution``: 1/n_test for an accuracy): few borderline test examples, each flipping rarely.

    The steps above and below the replicas' median (rounded to the count), K+ and K−, are then about
    Poisson: the mean lies in ``median + [lo(K+) − hi(K−), hi(K+) − lo(K−)]·resolution/R``, each
    ``lo``/``hi`` Garwood's exact Poisson interval at 1 − (1 − level)/2 (Bonferroni over the two counts).
    Returns (low, high, K+ + K−); last axis: replicas.
    """
    x = np.asarray(x, dtype=np.float64)
    n, first = x.shape[-1], x[..., :1]
    k = np.rint((x - first) / resolution)
    d = k - np.rint(np.median(k, axis=-1, keepdims=True))
    up, down = np.clip(d, 0, None).sum(-1), np.clip(-d, 0, None).sum(-1)
    inner = 1 - (1 - level) / 2
    (up_lo, up_hi), (down_lo, down_hi) = _garwood(up, inner), _garwood(down, inner)
    centre = first[..., 0] + (k - d)[..., 0] * resolution
    return (_out(centre + (up_lo - down_hi) * resolution / n), _out(centre + (up_hi - down_lo) * resolution / n),
            _out(up + down))


def _trimmed_mean(x: np.ndarray) -> np.ndarray:
    """Bonett's centre for the kurtosis: the mean trimmed by 1/(2√(R−4)) at each end (the mean below R=5)."""
    n = x.shape[-1]
    return x.mean(-1) if n < 5 else sps.trim_mean(x, 1 / (2 * math.sqrt(n - 4)), axis=-1)


def _fourth(x: np.ndarray) -> np.ndarray:
    d2 = (x - _trimmed_mean(x)[..., None]) ** 2  # squared twice: numpy's ** 4 is a general power (benchmarks/study_overheads.py)
    return (d2 * d2).sum(-1)


def _squares(x: np.ndarray) -> np.ndarray:
    return ((x - x.mean(-1, keepdims=True)) ** 2).sum(-1)


NORMAL_KURTOSIS = 3.0


def _log_variance_se(kurtosis, n: int, level: float) -> tuple:
    """(c, se of ln(c·s²)) of Bonett's interval at sample size n."""
    c = n / (n - _z(level))
    return c, c * np.sqrt((kurtosis - (n - 3) / n) / (n - 1))


def std_ci(x, level: float = LEVEL, std_max: float = np.inf, resolution: float | None = None) -> tuple:
    """Robust interval of the standard deviation (brackets ``std(x, ddof=1)`` unless clipped at ``std_max``);
    last axis: replicas.

    Bonett (2006): σ² lies in ``exp(ln(c·s²) ± z·se)``, ``c = R/(R − z₉₇.₅)``, z widened to the 98.75%
    quantile (:data:`SPREAD_TAIL`),
    ``se = c·√((γ̂ − (R−3)/R)/(R−1))`` with ``γ̂`` the kurtosis about a trimmed mean, never taken
    below a normal's (3), so the interval is never narrower than the normal-theory one's order.
    It holds its coverage under skew, heavy tails and bad seeds where the chi-square interval
    (:func:`std_ci_normal`) does not (docs/statistics.md). (nan, nan) below 3 values.

    ``std_max`` is the largest std the quantity can have (0.5 for a value in [0, 1]): the upper end
    is clipped to it. The interval is for σ, which std_max bounds; the sample std with ddof=1 can exceed it
    (0.98, 0.98, 0.10 give 0.508), and then lies above the clipped interval. ``resolution`` is the step of a count-valued score (1/n_test for an accuracy):
    R tied counts give ``[0, √tie_rate(R)·resolution]``, the largest std that still ties R replicas
    with probability 2.5%; without it tied values give (0, 0): the spread is exactly zero.
    """
    x = _replica_axis(x)
    n = x.shape[-1]
    if n < MIN_REPLICAS["std"]:
        return _nan2(x.shape[:-1])
    s2, z = np.asarray(std(x)) ** 2, _z_spread(level)
    with np.errstate(divide="ignore", invalid="ignore"):
        kurt = np.maximum(np.where(s2 > 0, n * _fourth(x) / np.where(s2 > 0, _squares(x), 1.0) ** 2, 0.0), NORMAL_KURTOSIS)
    c, se = _log_variance_se(kurt, n, level)
    lo, hi = np.sqrt(c * s2 * np.exp(-z * se)), np.sqrt(c * s2 * np.exp(z * se))
    if resolution:
        hi = np.where(s2 > 0, hi, math.sqrt(tie_rate(n, level)) * resolution)
    return _out(np.minimum(lo, std_max)), _out(np.minimum(hi, std_max))


def std_ci_normal(x, level: float = LEVEL, std_max: float = np.inf) -> tuple:
    """Chi-square interval of the standard deviation of normal data: ``(R−1)s²/σ² ~ χ²(R−1)``, so σ lies
    in ``s·√((R−1)/χ²_{(1+level)/2})`` to ``s·√((R−1)/χ²_{(1−level)/2})``; (nan, nan) below 2 values.
    Exact for normal data and binomial counts: under skew, heavy tails or bad seeds it covers 84–88% at
    R=8, on near ties 50–75% (``benchmarks/coverage.py``)."""
    x = np.asarray(x, dtype=np.float64)
    n = x.shape[-1]
    if n < 2:
        return _nan2(x.shape[:-1])
    s, d = std(x), n - 1
    return (_out(np.minimum(s * math.sqrt(d / sps.chi2.ppf(0.5 + level / 2, d)), std_max)),
            _out(np.minimum(s * math.sqrt(d / sps.chi2.ppf(0.5 - level / 2, d)), std_max)))


def pairwise_mean_ci(values, replicas: int, level: float = LEVEL, bounds: tuple[float, float] = (-np.inf, np.inf),
                     scale: str = "linear") -> tuple:
    """CI of the mean of a pairwise metric over R replicas, respecting that pairs share replicas.

    ``values`` holds one value per pair in :func:`nondet_jax.analysis.metrics.pair_indices` order (last
    axis). The mean over pairs is a U-statistic of the replicas; its standard error comes from the
    jackknife over replicas (leave replica i and its R−1 pairs out), with the widened t(R−1) quantile of
    :func:`mean_ci` (:data:`MEAN_TAIL`: replicas of unequal noise skew the pairs' mean as bad seeds do), on the
    ``scale`` given: ``"linear"``, ``"log"`` (a metric near its lower bound, e.g. a disagreement or a
    distance: the jackknife of log(mean − low)) or ``"log-upper"`` (near its upper bound, e.g. CKA or a
    correlation: of log(high − mean)). On a log scale the interval never crosses the bound and never
    collapses while replicas differ; where a leave-one-out mean sits on the bound (no pair differs
    without one replica) or every leave-one-out mean is the same (a zero standard error, which would
    print a zero-width interval), it is (nan, nan): "n/a, replicas too alike to estimate" (:data:`TOO_ALIKE`).
    The interval is clipped to ``bounds``, the metric's possible range. (nan, nan) below 3 replicas.
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
    m = values.mean(-1)
    forward, back = {"linear": (lambda v: v, lambda v: v),
                     "log": (lambda v: np.log(v - bounds[0]), lambda v: bounds[0] + np.exp(v)),
                     "log-upper": (lambda v: np.log(bounds[1] - v), lambda v: bounds[1] - np.exp(v))}[scale]
    with np.errstate(divide="ignore", invalid="ignore"):
        loo_t, m_t = forward(loo), forward(m)
        se = np.sqrt((r - 1) / r * ((loo_t - loo_t.mean(-1, keepdims=True)) ** 2).sum(-1))
        half = sps.t.ppf(1 - MEAN_TAIL * (1 - level) / 2, r - 1) * se  # widened as the mean's: see MEAN_TAIL
        ends = back(m_t - half), back(m_t + half)
    lo, hi = np.minimum(*ends), np.maximum(*ends)
    shown = np.isfinite(se) & (se > 0)  # se = 0: every leave-one-out mean equal, nothing to estimate a spread from
    lo, hi = np.where(shown, lo, np.nan), np.where(shown, hi, np.nan)
    return _out(np.clip(lo, *bounds)), _out(np.clip(hi, *bounds))


TOO_ALIKE = ("n/a: replicas too alike to estimate (leaving out any one replica leaves the same mean, or no pair "
             "that differs)")


RARE_MINORITY = 40  # below this many minority predictions (a disagreement) or steps from the median (the mean of a
# count, rare_steps_ci) an interval is joined with the Poisson one


def rare_disagreement_ci(minority, replicas: int, n_test: int, level: float = LEVEL) -> tuple:
    """Interval of the disagreement of near-identical replicas from the count of minority predictions
    (:func:`nondet_jax.analysis.metrics.minority_predictions`, M).

    When each test image flips between replicas with a small probability p_j, M is about Poisson with
    mean R·Σp_j and the disagreement 2·Σp_j(1−p_j)/n is at most 2·E[M]/(R·n): Garwood's exact Poisson
    interval of E[M], scaled by 2/(R·n). It exists for every M, including 0 (no replica differs:
    ``[0, 2·3.69/(R·n)]`` at 95%), where the jackknife has nothing to work with. Last axis: none
    (``minority`` may be an array of studies).
    """
    lo, hi = _garwood(minority, level)
    scale = 2 / (replicas * n_test)
    return _out(lo * scale), _out(np.minimum(hi * scale, 1.0))


def disagreement_ci(values, replicas: int, minority=None, n_test: int | None = None, level: float = LEVEL) -> tuple:
    """The disagreement's interval: the log-scale replica jackknife (:func:`pairwise_mean_ci`), joined
    with :func:`rare_disagreement_ci` when fewer than :data:`RARE_MINORITY` predictions are in the
    minority (near-identical replicas: in ``benchmarks/coverage.py`` the jackknife alone prints an
    interval in 3–70% of such studies at R=3–16; joined, it is always printed and covers at least
    98.7%). Without ``minority`` the jackknife alone."""
    lo, hi = pairwise_mean_ci(values, replicas, level, bounds=(0.0, 1.0), scale="log")
    if minority is None or n_test is None or replicas < MIN_REPLICAS["pairwise"]:
        return lo, hi
    m = np.asarray(minority)
    plo, phi = rare_disagreement_ci(m, replicas, n_test, level)
    rare = m < RARE_MINORITY
    return _out(np.where(rare, np.fmin(plo, lo), lo)), _out(np.where(rare, np.fmax(phi, hi), hi))


def pairwise_summary(name: str, values, replicas: int, minority: int | None = None, n_test: int | None = None) -> dict:
    """Mean over pairs of the pairwise metric ``name`` (a metric of :mod:`nondet_jax.analysis.metrics`)
    with its jackknife interval on the metric's scale (``PAIRWISE_SCALE``, within ``PAIRWISE_RANGE``);
    for ``disagreement`` with ``minority`` and ``n_test`` given, :func:`disagreement_ci`. ``na`` says
    why an interval is missing."""
    values = np.asarray(values, dtype=np.float64)
    out: dict = {"mean": float(values.mean())}
    if name == "disagreement" and minority is not None:
        ci = disagreement_ci(values, replicas, minority, n_test)
        out["minority_predictions"] = int(minority)
    else:
        ci = pairwise_mean_ci(values, replicas, bounds=PAIRWISE_RANGE.get(name, (-np.inf, np.inf)),
                              scale=PAIRWISE_SCALE.get(name, "linear"))
    out["ci"] = list(ci)
    if not np.isfinite(ci[0]):
        out["na"] = na_reason("pairwise", replicas) or TOO_ALIKE
    return out


def spread(x, std_max: float = np.inf, resolution: float | None = None, value_range: tuple | None = None) -> dict:
    """Mean and std (ddof=1) of per-replica values with their intervals (:func:`mean_ci`,
    :func:`std_ci`: robust, its upper end clipped to ``std_max``; ``resolution`` the step of a count,
    1/n_test for an accuracy, kept in the result so later comparisons know it). ``value_range``
    (low, high): the values' possible range, (0, 1) for an accuracy; the mean's interval is clipped to
    it and ``std_max`` defaults to half its width."""
    x = np.asarray(x, dtype=np.float64)
    m_ci = mean_ci(x, resolution=resolution)
    if value_range is not None:
        m_ci = tuple(float(np.clip(c, *value_range)) for c in m_ci)
        std_max = min(std_max, (value_range[1] - value_range[0]) / 2)
    out = {"mean": float(x.mean()), "mean_ci": list(m_ci), "std": std(x),
           "std_ci": list(std_ci(x, std_max=std_max, resolution=resolution)),
           "std_ci_normal": list(std_ci_normal(x, std_max=std_max))}
    return {**out, "resolution": resolution} if resolution else out


ACCURACY_STD_MAX = 0.5  # the largest std of a quantity in [0, 1]
ACCURACY_RANGE = (0.0, 1.0)


def _f_p(f: float, d1: int, d2: int) -> float:
    if not np.isfinite(f):
        return float("nan")
    cdf = sps.f.cdf(f, d1, d2)
    return float(min(1.0, 2 * min(cdf, 1 - cdf)))


def f_test(a, b) -> float:
    """Two-sided F-test p-value for equal variances of two normal samples."""
    return _f_comparison(std(a), len(a), std(b), len(b))["f_test_p"]


def brown_forsythe(a, b) -> float:
    """Brown-Forsythe (Levene with medians) p-value for equal spread: robust to non-normality. NaN below
    :data:`SPREAD_TEST_MIN` replicas per arm (at 2 each arm's two deviations from its median are equal, so the
    F statistic is infinite whatever the spreads: p < 0.05 in every study)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float("nan") if min(a.size, b.size) < SPREAD_TEST_MIN else levene_median(a, b)


def levene_median(a, b) -> float:
    """scipy's Levene test about the medians at any R (1.0 when neither arm varies): :func:`brown_forsythe`
    without its minimum, for the simulation that shows why it has one."""
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


def std_ratio_ci_normal(a, b, level: float = LEVEL) -> tuple:
    """F-distribution CI of std(a)/std(b) under normality (last axis: replicas); Morin & Willetts' interval."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if min(a.shape[-1], b.shape[-1]) < 2:
        return _nan2(np.broadcast_shapes(a.shape[:-1], b.shape[:-1]))
    return _ratio_ci(np.asarray(std(a)) ** 2, np.asarray(std(b)) ** 2, a.shape[-1] - 1, b.shape[-1] - 1, level)


def std_ratio_ci(a, b, level: float = LEVEL, resolution: float | None = None) -> tuple:
    """Robust interval of std(a)/std(b) (last axis: replicas): Bonett (2006).

    ``ln(σa²/σb²)`` lies in ``ln(c·sa²/sb²) ± z·√(Va + Vb)``, ``Vj = (γ̂ − (nj−3)/nj)/(nj−1)``,
    ``c = [na/(na−z)]/[nb/(nb−z)]``, ``γ̂`` the pooled kurtosis of both arms about their trimmed means
    (never below a normal's). When ``a`` is tied (``resolution``: a count, see :func:`std_ci`):
    ``[0, a's tie bound / the lower end of b's std interval]`` (each end fails at most 2.5% of the
    time). NaN where b is tied (no ratio to a zero spread); (nan, nan) below 5 replicas per arm.
    """
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    na, nb = a.shape[-1], b.shape[-1]
    shape = np.broadcast_shapes(a.shape[:-1], b.shape[:-1])
    if min(na, nb) < MIN_REPLICAS["ratio"]:
        return _nan2(shape)
    va, vb, z = np.asarray(std(a)) ** 2, np.asarray(std(b)) ** 2, _z_spread(level)
    with np.errstate(divide="ignore", invalid="ignore"):
        kurt = (na + nb) * (_fourth(a) + _fourth(b)) / (_squares(a) + _squares(b)) ** 2
        kurt = np.maximum(np.nan_to_num(kurt, nan=0.0), NORMAL_KURTOSIS)
        se = np.sqrt((kurt - (na - 3) / na) / (na - 1) + (kurt - (nb - 3) / nb) / (nb - 1))
        c = (na / (na - _z(level))) / (nb / (nb - _z(level)))  # Bonett's small-sample factor, at the nominal z
        f = np.where(vb > 0, va / np.where(vb > 0, vb, 1.0), np.nan)
        lo, hi = np.sqrt(c * f * np.exp(-z * se)), np.sqrt(c * f * np.exp(z * se))
        if resolution:
            tie_hi = math.sqrt(tie_rate(na, level)) * resolution / np.asarray(std_ci(b, level)[0])
            hi = np.where((va == 0) & (vb > 0), tie_hi, hi)
    return _out(lo), _out(hi)


def variance_sum_ratio_ci(arms, reference, level: float = LEVEL, resolution: float | None = None) -> tuple:
    """Interval of ``Σ_j σ_j² / σ_ref²`` from independent arms (each (..., R_j), last axis replicas), the
    sum of the one-source arms' variance shares (:mod:`nondet_jax.analysis.decomposition`).

    Bonett's log-variance interval extended to a sum: each arm's ``c_j·s_j²`` with ``c_j = R_j/(R_j − z)``
    and ``Var ln s_j² ≈ c_j²(γ̂ − (R_j−3)/R_j)/(R_j−1)`` (:func:`std_ci`'s), ``γ̂`` the kurtosis pooled over the arms (each about
    its trimmed mean, in units of its own variance; never below a normal's); the sum's log variance by
    the delta method, ``Σ_j (c_j s_j²)² Var ln s_j² / (Σ_j c_j s_j²)²``; the ratio's interval
    ``exp(ln(ΣS/S_ref) ± z·√(Var ln ΣS + Var ln S_ref))``. A tied arm of counts (``resolution``) adds
    nothing below and its tie bound² above. (nan, nan) below 5 replicas in an arm or when the
    reference is tied."""
    xs = [np.asarray(a, np.float64) for a in arms]
    ref = np.asarray(reference, np.float64)
    if min(x.shape[-1] for x in (*xs, ref)) < MIN_REPLICAS["ratio"]:
        return _nan2(ref.shape[:-1])
    z = _z_spread(level)
    group = [*xs, ref]
    with np.errstate(divide="ignore", invalid="ignore"):
        kurts = [x.shape[-1] * _fourth(x) / _squares(x) ** 2 for x in group]
        weights = [x.shape[-1] * (np.asarray(std(x)) > 0) for x in group]
        pooled = sum(np.nan_to_num(k, nan=0.0) * w for k, w in zip(kurts, weights)) / np.maximum(sum(weights), 1)
        kurt = np.maximum(pooled, NORMAL_KURTOSIS)
        parts = []
        for x in group:  # (c·s², Var ln(c·s²)), as std_ci has them
            c, se = _log_variance_se(kurt, x.shape[-1], level)
            parts.append((c * np.asarray(std(x)) ** 2, se ** 2))
        (v_ref, var_ref), terms = parts[-1], parts[:-1]
        total = sum(v for v, _ in terms)
        var_total = np.where(total > 0, sum(v * v * w for v, w in terms) / np.where(total > 0, total, 1) ** 2, 0.0)
        f = np.where(v_ref > 0, total / np.where(v_ref > 0, v_ref, 1.0), np.nan)
        half = z * np.sqrt(var_total + var_ref)
        lo, hi = f * np.exp(-half), f * np.exp(half)
        if resolution:
            ties = sum(np.where(np.ptp(x, -1) == 0, tie_rate(x.shape[-1], level) * resolution ** 2, 0.0) for x in xs)
            hi = hi + np.where(v_ref > 0, ties / np.where(v_ref > 0, v_ref * np.exp(-z * np.sqrt(var_ref)), 1), np.nan)
    return _out(lo), _out(hi)


def _pooled_t(x, y, axis=-1):
    """|pooled two-sample t| of x and y along ``axis`` (vectorised, for :func:`scipy.stats.permutation_test`);
    0 for two constant, equal groups, inf for two constant, different ones."""
    nx, ny = x.shape[axis], y.shape[axis]
    mx, my = x.mean(axis), y.mean(axis)
    ss = ((x - np.expand_dims(mx, axis)) ** 2).sum(axis) + ((y - np.expand_dims(my, axis)) ** 2).sum(axis)
    sp = np.sqrt(ss / (nx + ny - 2) * (1 / nx + 1 / ny))
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(sp > 0, np.abs(mx - my) / np.where(sp > 0, sp, 1.0), np.where(mx == my, 0.0, np.inf))


def spread_test(a, b, resamples: int = 20_000) -> float:
    """Two-sided permutation p-value for equal spread: the Brown–Forsythe statistic (pooled t of the
    absolute deviations from each arm's own median) over the splits of the pooled deviations into arms
    of the same sizes (:func:`scipy.stats.permutation_test`: every split when there are at most
    ``resamples``, else ``resamples`` seeded random ones). Exact under exchangeability, so right with
    ties and counts, where the F approximation (:func:`brown_forsythe`) and the F-test are not; 1.0
    when neither arm varies."""
    return spread_tests([(a, b)], resamples)[0]


def spread_tests(pairs, resamples: int = 20_000) -> list[float]:
    """:func:`spread_test` of each ``(a, b)`` in ``pairs``, the same p-values: the pairs of the same sizes share
    one :func:`scipy.stats.permutation_test` call (its splits enumerated once: most of a call's time at R=8)."""
    out: list[float] = [1.0] * len(pairs)
    groups: dict[tuple[int, int], list[int]] = {}
    devs = []
    for i, (a, b) in enumerate(pairs):
        a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
        za, zb = np.abs(a - np.median(a)), np.abs(b - np.median(b))
        devs.append((za, zb))
        if np.ptp(np.concatenate([za, zb])) > 0 and min(len(a), len(b)) >= 2:
            groups.setdefault((len(a), len(b)), []).append(i)
    for idx in groups.values():
        za, zb = (np.stack([devs[i][k] for i in idx]) for k in (0, 1))
        res = sps.permutation_test((za, zb), _pooled_t, permutation_type="independent", vectorized=True,
                                   n_resamples=resamples, alternative="greater", rng=BOOTSTRAP_SEED, axis=-1)
        for i, p in zip(idx, np.atleast_1d(res.pvalue)):
            out[i] = float(p)
    return out


def holm(pvalues) -> list:
    """Holm's step-down adjustment of p-values (family-wise error at most alpha for any dependence);
    None entries are kept as None and not counted."""
    idx = [i for i, p in enumerate(pvalues) if p is not None and np.isfinite(p)]
    out: list = [None if p is None else float(p) for p in pvalues]
    m, running = len(idx), 0.0
    for rank, i in enumerate(sorted(idx, key=lambda i: pvalues[i])):
        running = max(running, min(1.0, (m - rank) * pvalues[i]))
        out[i] = running
    return out


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
    if min(n_a, n_b) < 2 or min(n_a, n_b) <= ddof or not (std_a >= 0 and std_b >= 0 and np.isfinite([std_a, std_b]).all()):
        raise UsageError(f"need two finite, non-negative stds from at least 2 values each (and more than ddof={ddof}); "
                         f"got std {std_a} of {n_a} and std {std_b} of {n_b}")
    va, vb = std_a ** 2 * (n_a - ddof) / (n_a - 1), std_b ** 2 * (n_b - ddof) / (n_b - 1)
    d1, d2 = n_a - 1, n_b - 1
    ci = _ratio_ci(va, vb, d1, d2, level)
    if vb == 0:
        p, ratio = (1.0 if va == 0 else 0.0), float("nan")
    else:
        ratio, p = math.sqrt(va / vb), (0.0 if va == 0 else _f_p(va / vb, d1, d2))
    return {"ratio": ratio, "ratio_ci": list(ci), "f_test_p": p}


POWER_RATIOS = (0.5, 0.75)


def _finite_scores(x, name: str) -> np.ndarray:
    """``x`` as a 1-D float64 array of per-replica scores, or a one-line error naming what is wrong with it: a
    non-finite score would otherwise become a p of 0 or 1 with nothing said."""
    x = np.asarray(x, np.float64)
    if x.ndim != 1:
        raise UsageError(f"{name} has shape {x.shape}, but must be one score per replica (a 1-D array)")
    bad = np.flatnonzero(~np.isfinite(x))
    if len(bad):
        raise UsageError(f"{name} holds {len(bad)} NaN or infinite score(s) (the first at index {bad[0]}); leave "
                         "out the replicas that diverged")
    return computable(x, name)


def computable(x: np.ndarray, name: str) -> np.ndarray:
    """``x`` (finite scores) when their mean and spread are finite in float64, else a one-line error: scores near
    the float64 limit overflow the sums (std inf or NaN, an interval of NaN)."""
    with np.errstate(over="ignore", invalid="ignore"):
        ok = np.isfinite(x.mean()) and np.isfinite(x.var()) if x.size else True
    if not ok:
        raise UsageError(f"{name} holds scores too large to average or square in float64 (up to "
                         f"{np.abs(x).max():.3g}); rescale them")
    return x
# below 5 replicas per arm the permutation test of median deviations is not valid (at R=4 the two middle
# deviations of each arm are equal: 6-16% false alarms at p < 0.05, benchmarks/coverage.py): n/a there
SPREAD_TEST_MIN = 5


def compare_spread(x, reference, resolution: float | None = None, ratios=POWER_RATIOS,
                   spread_p: float | None = None) -> dict:
    """Std of ``x`` relative to ``reference`` (Morin & Willetts' statistic) with its uncertainty.

    Returns the ratio with its robust 95% interval (:func:`std_ratio_ci`; ``resolution``: the step
    of a count, for tied arms) and the F interval, the permutation spread test's p (:func:`spread_test`,
    the one to read; NaN below 5 replicas per arm), the F-test's and Brown–Forsythe's, and the replicas per arm at which the
    printed ratio interval excludes 1 in 80% of studies at each true ratio in ``ratios``
    (:func:`replicas_for_ratio_interval`: normal data; a design figure, not a post-hoc power). ``spread_p``:
    :func:`spread_test`'s p when the caller computed it already (:func:`spread_tests`, many comparisons at once).
    """
    x, reference = (_finite_scores(v, name) for v, name in ((x, "x"), (reference, "reference")))
    out = compare_spread_from_summary(std(x), len(x), std(reference), len(reference))
    return {"ratio": out["ratio"], "ratio_ci": list(std_ratio_ci(x, reference, resolution=resolution)),
            "ratio_ci_normal": out["ratio_ci"],
            "spread_p": (float("nan") if min(len(x), len(reference)) < SPREAD_TEST_MIN else
                         spread_test(x, reference) if spread_p is None else spread_p),
            "f_test_p": out["f_test_p"],
            "brown_forsythe_p": brown_forsythe(x, reference),
            "replicas_for_ratio": {str(r): replicas_for_ratio_interval(float(r)) for r in ratios}}


@functools.lru_cache(maxsize=32)
def replicas_for_ratio_interval(ratio: float, power: float = 0.8, level: float = LEVEL, trials: int = 4000,
                                max_n: int = 1000) -> int | None:
    """Replicas per arm at which the printed ratio interval (:func:`std_ratio_ci`, widened) excludes 1 in
    ``power`` of simulated studies of normal data whose true std ratio is ``ratio`` (seeded: the same answer
    every time). Larger than the F-test's :func:`replicas_for_power` (at ratio 0.5: 19 for the F-test), whose
    figure the report printed before for an interval that could not reach it. None as there."""
    if not np.isfinite(ratio) or ratio <= 0 or abs(ratio - 1) < 1e-12:
        return None

    def ok(n):
        rng = np.random.default_rng(n)
        lo, hi = std_ratio_ci(rng.normal(0.0, ratio, (trials, n)), rng.normal(0.0, 1.0, (trials, n)), level)
        return float(np.mean((lo > 1) | (hi < 1))) >= power

    return _smallest_n(ok, max_n)


@functools.lru_cache(maxsize=32)
def replicas_for_std_factor(factor: float = 2.0, share: float = 0.8, level: float = LEVEL, trials: int = 4000,
                            max_n: int = 10_000) -> int | None:
    """Replicas at which the printed 95% std interval (:func:`std_ci`, robust and widened) spans at most
    ``factor`` (upper end / lower end: 2.0 means the std is known to within a factor of about √2 either way)
    in ``share`` of simulated studies of normal data (seeded: the same answer every time); wider on skewed
    data. The chi-square interval's figure, which the report printed before, is smaller (18 for a factor of 2,
    where the printed interval spans at least 2.45)."""
    if not factor > 1:
        return None

    def ok(n):
        lo, hi = std_ci(np.random.default_rng(n).normal(size=(trials, n)), level)
        return float(np.mean(hi <= factor * lo)) >= share

    return _smallest_n(ok, max_n)


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
        t = np.where(se > 0, diff / np.where(se > 0, se, 1.0), np.nan)
    # neither sample varies: no spread to test against (scipy's ttest_ind gives NaN too), never p = 0 with a
    # zero-width interval (identical replicas, a control arm, are one observation, not n)
    half = np.where(se > 0, sps.t.ppf(0.5 + level / 2, df) * se, np.nan)
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
    # The Mann-Whitney U of b from midranks: #(b > a) + ½·#(b = a) in O(n log n) memory and time (the
    # (n_a, n_b) matrix of differences took 7 GB for two 20,000-run samples).
    ranks = sps.rankdata(np.concatenate([a, b], -1), axis=-1)
    theta = (ranks[..., na:].sum(-1) - nb * (nb + 1) / 2) / (na * nb)
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


def paired_difference(a, b, level: float = LEVEL, resolution: float | None = None) -> dict:
    """``mean(b_i − a_i)`` over pairs of runs that share seeds (pair i: replica i of each), with the
    paired t interval at ``level`` (scipy's ``ttest_rel(b, a).confidence_interval(level)``; not widened and
    not joined with Garwood's: on 360-image accuracies the joined interval was 1.2x wider and found a real
    gain in a third as many studies, while the plain one covers at least 93%: ``benchmarks/coverage.py
    --power``; differences of counts that all tie get the tie bound of :func:`mean_ci`, not a zero width)
    and ``std`` of the differences. Last axis: pairs."""
    d = np.asarray(b, np.float64) - np.asarray(a, np.float64)
    lo, hi = mean_ci(d, level, resolution, widen=False)
    return {"difference": _out(d.mean(-1)), "ci": [lo, hi], "std": _out(np.asarray(std(d)))}


def paired_t_p(a, b, resolution: float | None = None) -> float:
    """Two-sided p of the paired t-test of mean(b − a) = 0, the test of :func:`paired_difference`'s interval (p
    below 1 − level exactly when that interval excludes 0): scipy's ``ttest_rel(b, a).pvalue``, computed from the
    interval's own mean and std (so the two agree to the last bit, and differences equal but for rounding raise no
    precision warning). Differences of counts (``resolution``) that all tie have the tie bound for an interval,
    ``mean ± tie_rate(n, level) · resolution``: their p is the 1 − level at which that bound just reaches 0 (1.0
    when every difference is 0)."""
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    d = b - a
    if np.ptp(d) > 0:
        return float(2 * sps.t.sf(abs(d.mean()) / (std(d) / math.sqrt(len(d))), len(d) - 1))
    if d[0] == 0:
        return 1.0
    if not resolution:  # no spread and no count: nothing bounds the mean's uncertainty from below
        return 0.0
    reach = lambda alpha: tie_rate(len(d), 1.0 - alpha) * resolution - abs(d[0])  # noqa: E731  (falls with alpha)
    if reach(1.0 - 1e-9) >= 0:  # even the narrowest bound reaches 0
        return 1.0
    if reach(1e-6) < 0:  # beyond what the tie bound can be computed for: p is below 1e-6, given as 1e-6
        return 1e-6
    return float(optimize.brentq(reach, 1e-6, 1.0 - 1e-9, xtol=1e-12))


def paired_probability_of_improvement(a, b, level: float = LEVEL) -> dict:
    """The share of seed pairs where B beats A, ``(wins + ½ ties) / n``, with Wilson's score interval
    with continuity correction (Newcombe 1998, method 4: inside [0, 1], not degenerate when B wins
    every pair; a half-counted tie only makes it wider than needed). Last axis: pairs. (scipy's
    ``binomtest(...).proportion_ci("wilsoncc")`` takes one whole count; here ties count ½ and studies
    are vectorised.)"""
    d = np.asarray(b, np.float64) - np.asarray(a, np.float64)
    n = d.shape[-1]
    theta = ((d > 0) + 0.5 * (d == 0)).mean(-1)
    if n < MIN_REPLICAS["paired_probability_of_improvement"]:
        nan = _out(np.full(np.shape(theta), np.nan))
        return {"probability": _out(theta), "ci": [nan, nan]}
    z = sps.norm.ppf(0.5 + level / 2)
    z2, k = z * z, 2 * n * theta
    with np.errstate(invalid="ignore"):
        low = (k + z2 - 1 - z * np.sqrt(np.maximum(z2 - 2 - 1 / n + 4 * theta * (n * (1 - theta) + 1), 0))) / (
            2 * (n + z2))
        high = (k + z2 + 1 + z * np.sqrt(np.maximum(z2 + 2 - 1 / n + 4 * theta * (n * (1 - theta) - 1), 0))) / (
            2 * (n + z2))
    low = np.where(theta <= 0, 0.0, np.clip(low, 0.0, 1.0))
    high = np.where(theta >= 1, 1.0, np.clip(high, 0.0, 1.0))
    return {"probability": _out(theta), "ci": [_out(low), _out(high)]}


def pairs_for_difference(difference: float, sd: float, power: float = 0.8, alpha: float = 0.05,
                         max_n: int = 100_000) -> int | None:
    """Pairs for the two-sided paired t-test to detect ``difference`` with ``power`` when the
    differences' std is ``sd`` (one-sample t on the differences). None as :func:`replicas_for_difference`."""
    if not (np.isfinite(difference) and np.isfinite(sd)) or difference == 0:
        return None
    if sd == 0:
        return 2

    return _smallest_n(lambda n: _t_power(abs(difference) / sd * math.sqrt(n), n - 1, alpha) >= power, max_n)


def compare_paired(a, b, level: float = LEVEL, higher_is_better: bool = True, detect: float | None = None,
                   resolution: float | None = None) -> dict:
    """:func:`compare_means` for runs that share seeds: ``a[i]`` and ``b[i]`` are the two methods'
    scores under seed i. The difference ``mean(B_i − A_i)`` with its paired t interval and that test's p
    (:func:`paired_t_p`), the share of seeds where B is better (higher, or lower when
    ``higher_is_better`` is False) with its interval, the correlation of the pairs, and the pairs a
    paired t-test needs for 80% power at the observed (and at ``detect``) difference."""
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    if len(a) != len(b):
        raise UsageError(f"paired scores come in pairs (a[i] and b[i] under seed i), but a has {len(a)} and b "
                         f"{len(b)}; pass the two methods' scores for the same seeds")
    a, b = _finite_scores(a, "a"), _finite_scores(b, "b")
    if len(a) < 2:
        raise UsageError(f"need at least 2 pairs of scores; got {len(a)}")
    sign = 1.0 if higher_is_better else -1.0
    d, poi = paired_difference(a, b, level, resolution), paired_probability_of_improvement(sign * a, sign * b, level)
    with np.errstate(invalid="ignore", divide="ignore"):
        corr = float(np.corrcoef(a, b)[0, 1]) if std(a) > 0 and std(b) > 0 else float("nan")
    return {"paired": True, "n_a": len(a), "n_b": len(b), "n_pairs": len(a), "mean_a": float(a.mean()),
            "mean_b": float(b.mean()), "std_a": std(a), "std_b": std(b), "difference": d["difference"],
            "difference_ci": d["ci"], "std_difference": d["std"], "p": paired_t_p(a, b, resolution),
            "correlation": corr, "probability_of_improvement": poi["probability"],
            "probability_of_improvement_ci": poi["ci"],
            "pairs_for_80pct_power": pairs_for_difference(d["difference"], d["std"]), "level": level,
            "higher_is_better": higher_is_better, "detect": detect,
            "pairs_for_detect": None if detect is None else pairs_for_difference(abs(detect), d["std"])}


def _t_power(ncp: float, df: int, alpha: float) -> float:
    """Power of a two-sided t-test with noncentrality ``ncp`` and ``df`` degrees of freedom."""
    crit = sps.t.ppf(1 - alpha / 2, df)
    power = float(sps.nct.sf(crit, df, ncp) + sps.nct.cdf(-crit, df, ncp))
    if np.isfinite(power):
        return power
    # scipy's noncentral t gives NaN far out (a large ncp): T = (Z + ncp) / √(V/df), so integrate over V ~ χ²(df)
    def given(v):
        c = crit * math.sqrt(v / df)
        return (sps.norm.sf(c - ncp) + sps.norm.cdf(-c - ncp)) * sps.chi2.pdf(v, df)

    return float(integrate.quad(given, 0.0, np.inf)[0])


def t_test_power(effect: float, n: int, alpha: float = 0.05) -> float:
    """Power of the two-sided two-sample t-test with n replicas per method at standardised effect
    ``effect`` = difference / std."""
    return _t_power(abs(effect) * math.sqrt(n / 2), 2 * n - 2, alpha)


def replicas_for_difference(difference: float, sd: float, power: float = 0.8, alpha: float = 0.05,
                            max_n: int = 100_000) -> int | None:
    """Replicas per method for the two-sided t-test to detect ``difference`` with ``power`` when the
    run-to-run std is ``sd``. None for no difference, no spread estimate, or more than ``max_n``."""
    if not (np.isfinite(difference) and np.isfinite(sd)) or difference == 0:
        return None
    if sd == 0:
        return 2
    return _smallest_n(lambda n: t_test_power(difference / sd, n, alpha) >= power, max_n)


def compare_means(a, b, level: float = LEVEL, higher_is_better: bool = True, detect: float | None = None) -> dict:
    """Is method B better than method A? Per-seed scores of each, e.g. test accuracies.

    Returns n_a, n_b, both means and stds, the difference mean(B) − mean(A) with its Welch interval
    and p-value, the probability of improvement (that one run of B scores better than one run of
    A: higher, or lower when ``higher_is_better`` is False) with its interval, and the replicas per
    method a two-sample t-test needs to detect the observed difference with 80% power given the
    pooled run-to-run std; with ``detect`` (a difference in the scores' units, e.g. 0.005 for half a
    point of accuracy) also ``replicas_for_detect``: the replicas per method for 80% power at that
    stated difference, the number to plan the next study by.
    """
    a, b = (_finite_scores(np.asarray(v, np.float64).ravel(), n) for v, n in ((a, "a"), (b, "b")))
    if min(len(a), len(b)) < 2:
        raise UsageError(f"need at least 2 scores per method; got {len(a)} and {len(b)}")
    sign = 1.0 if higher_is_better else -1.0
    w, poi = welch(a, b, level), probability_of_improvement(sign * a, sign * b, level)
    pooled = math.sqrt(((len(a) - 1) * std(a) ** 2 + (len(b) - 1) * std(b) ** 2) / (len(a) + len(b) - 2))
    return {"n_a": len(a), "n_b": len(b), "mean_a": float(a.mean()), "mean_b": float(b.mean()),
            "std_a": std(a), "std_b": std(b), "difference": w["difference"], "difference_ci": w["ci"],
            "welch_df": w["df"], "p": w["p"], "probability_of_improvement": poi["probability"],
            "probability_of_improvement_ci": poi["ci"], "pooled_std": pooled,
            "replicas_for_80pct_power": replicas_for_difference(w["difference"], pooled), "level": level,
            "higher_is_better": higher_is_better, "detect": detect,
            "replicas_for_detect": None if detect is None else replicas_for_difference(abs(detect), pooled)}


def pitman_morgan(a, b, level: float = LEVEL) -> dict:
    """Paired comparison of two spreads: ``std(a)/std(b)`` when ``a[i]`` and ``b[i]`` share a seed (replica i of
    two arms of one study share the keys of every source neither varies, so their scores are correlated).

    Pitman (1939) and Morgan (1939): σa = σb exactly when the sums ``a + b`` and the differences ``a − b`` are
    uncorrelated, so the two-sided p is scipy's ``pearsonr(a + b, a − b).pvalue`` (t with n − 2 degrees of
    freedom). The interval of the ratio λ inverts the same test (the correlation of ``a + λ·b`` and
    ``a − λ·b``) at every λ: with ``F = sa²/sb²``, ``r`` the correlation of a and b and
    ``K = t²(n−2; (1+level)/2)/(n−2)``, λ² lies in ``F·[1 + 2K(1−r²) ± 2√(K(1−r²)(1 + K(1−r²)))]``.
    Exact for bivariate normal pairs; independent arms (r = 0) give an interval close to the F
    interval, correlated ones a narrower one. Last axis: pairs; (nan, nan) below 3 pairs or when b is tied.
    """
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    n = a.shape[-1]
    if n < 3:
        nan = _out(np.full(a.shape[:-1], np.nan))
        return {"ratio": nan, "ci": [nan, nan], "p": nan, "correlation": nan}
    da, db = a - a.mean(-1, keepdims=True), b - b.mean(-1, keepdims=True)
    va, vb, cab = (da * da).sum(-1), (db * db).sum(-1), (da * db).sum(-1)
    k = sps.t.ppf(0.5 + level / 2, n - 2) ** 2 / (n - 2)
    with np.errstate(divide="ignore", invalid="ignore"):
        r2 = np.where((va > 0) & (vb > 0), cab * cab / (va * vb), 0.0)
        f = np.where(vb > 0, va / np.where(vb > 0, vb, 1.0), np.nan)
        g = k * (1 - r2)
        root = 2 * np.sqrt(g * (1 + g))
        lo, hi = np.sqrt(f * (1 + 2 * g - root)), np.sqrt(f * (1 + 2 * g + root))
        # the sums' and differences' correlation, as scipy's pearsonr has it (var(a) − var(b) over their product)
        num, den = va - vb, np.sqrt(np.maximum((va + vb) ** 2 - 4 * cab * cab, 0.0))
        rho = np.where(den > 0, num / np.where(den > 0, den, 1.0), 0.0)
        rho = np.clip(rho, -1.0, 1.0)
        t = rho * np.sqrt((n - 2) / np.maximum(1 - rho * rho, 1e-300))
        p = np.where(den > 0, 2 * sps.t.sf(np.abs(t), n - 2), np.where(va == vb, 1.0, 0.0))
        corr = np.where((va > 0) & (vb > 0), cab / np.sqrt(va * vb), np.nan)
    return {"ratio": _out(np.sqrt(f)), "ci": [_out(lo), _out(hi)], "p": _out(p), "correlation": _out(corr)}


# A replica this many robust stds (1.4826·MAD) from its arm's median is named as failed (stats.failed_replicas).
# Chosen by simulation (benchmarks/coverage.py --power, 2000 arms per cell at R=8 and 16): at 10 a healthy arm
# has a replica named in at most 2.4% of normal, skewed, heavy-tailed (t, 5 df), 10%-bad-seed, near-ceiling or
# count-valued studies (t, 3 df: 3.2%); at 6, up to 10.5%; a run that failed to train (40% against 92% ± 0.5%)
# is named in 99.9% of arms.
FAILED_THRESHOLD = 10.0
FAILED_MIN_REPLICAS = 5


def failed_replicas(x, threshold: float = FAILED_THRESHOLD, resolution: float | None = None) -> list | np.ndarray:
    """Replicas far outside the rest of their arm: ``|x_i − median| > threshold · 1.4826·MAD`` (the
    median absolute deviation scaled to a normal's std; at least one step ``resolution`` of a count, so
    counts whose replicas mostly tie flag only a replica ``threshold`` images away). A robust rule: one
    failed run moves neither the median nor the MAD. Never more than a minority of replicas, never below
    :data:`FAILED_MIN_REPLICAS` replicas (nothing to call "the rest"). Returns the indices (a 1-d ``x``) or
    a boolean mask (last axis: replicas) of the replicas named."""
    x = np.asarray(x, np.float64)
    n = x.shape[-1]
    if n < FAILED_MIN_REPLICAS:
        mask = np.zeros(x.shape, bool)
    else:
        med = np.median(x, -1, keepdims=True)
        scale = 1.4826 * np.median(np.abs(x - med), -1, keepdims=True)
        if resolution:
            scale = np.maximum(scale, resolution)
        mask = (scale > 0) & (np.abs(x - med) > threshold * scale)
        mask &= (mask.sum(-1, keepdims=True) < n / 2)
    return [int(i) for i in np.flatnonzero(mask)] if x.ndim == 1 else mask


# The paired ratio interval's share of 1 − level in its tails (1.0: z at 97.5%, Bonett as published), chosen by
# benchmarks/coverage.py --power as the most powerful that keeps 93% in every realistic shared-seed scenario (2000
# studies per cell, R=8 and 16): z at 98% (0.8) covers 93.3-99.2% and detects a true ratio of 0.5 in 21.8% / 65.7% of
# normal studies at R=8 / 16 (the independent arms' interval: 12.8% / 46.6%); z at 97.5% covered 92.3% of
# accuracies on 360 images from a shared latent at R=8. Pitman-Morgan's normal-theory interval (46.7% / 83.7%)
# covered 75-87% of skewed, bad-seed and 360-image arms.
PAIRED_TAIL = 0.8


def paired_ratio_ci(a, b, level: float = LEVEL) -> tuple:
    """Robust interval of std(a)/std(b) for arms that share seeds (pair i: replica i of each; last axis:
    pairs): Bonett's log-variance interval (:func:`std_ratio_ci`) with the pairs' covariance of squared
    deviations taken off its variance, so correlated arms get the narrower interval their pairing earns.

    ``ln(σa²/σb²)`` lies in ``ln(sa²/sb²) ± z·se``, ``se² = [2(γ̂ − (n−3)/n) − 2(γ̂ab − 1)]/(n−1)``, ``γ̂``
    the kurtosis pooled over both arms about their trimmed means (never below a normal's 3), ``γ̂ab =
    n·Σ da²db² / (Σda²·Σdb²)`` the co-kurtosis of the pairs (1 + 2ρ² for normal pairs), z at
    :data:`PAIRED_TAIL`; se never below the normal-theory ``√(4(1 − r²)/(n − 1))`` at the pairs'
    correlation r. (nan, nan) below 5 pairs or when b is tied."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape[-1] < MIN_REPLICAS["ratio"]:
        return _nan2(a.shape[:-1])
    f, se = _paired_log_variance(a, b)
    z = float(sps.norm.ppf(1 - PAIRED_TAIL * (1 - level) / 2))
    with np.errstate(invalid="ignore"):
        lo, hi = np.sqrt(f * np.exp(-z * se)), np.sqrt(f * np.exp(z * se))
    return _out(lo), _out(hi)


def paired_ratio_p(a, b) -> float | np.ndarray:
    """The p of :func:`paired_ratio_ci`: the largest ``1 − level`` at which its interval still holds 1, so
    ``p < α`` exactly when the printed interval at ``1 − α`` excludes 1 (z at :data:`PAIRED_TAIL`, as the
    interval's: ``p = min(1, 2(1 − Φ(|ln F|/se)) / PAIRED_TAIL)``). Its false alarms are the interval's (at most
    4.5% in every realistic shared-seed scenario at R=8 and 16, ``benchmarks/coverage.py --power``); NaN below 5
    pairs or when b is tied."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape[-1] < MIN_REPLICAS["ratio"]:
        return _out(np.full(a.shape[:-1], np.nan))
    f, se = _paired_log_variance(a, b)
    with np.errstate(divide="ignore", invalid="ignore"):
        u = np.abs(np.log(f)) / se
        p = np.minimum(1.0, 2 * sps.norm.sf(u) / PAIRED_TAIL)
    return _out(p)


def _paired_log_variance(a, b) -> tuple[np.ndarray, np.ndarray]:
    """``F = sa²/sb²`` (NaN where b is tied) and the se of ``ln F`` of :func:`paired_ratio_ci` (pairs: last axis)."""
    n = a.shape[-1]
    va, vb = np.asarray(std(a)) ** 2, np.asarray(std(b)) ** 2
    ta, tb = a - _trimmed_mean(a)[..., None], b - _trimmed_mean(b)[..., None]
    sa, sb = _squares(a), _squares(b)
    with np.errstate(divide="ignore", invalid="ignore"):
        kurt = 2 * n * ((ta ** 4).sum(-1) + (tb ** 4).sum(-1)) / (sa + sb) ** 2
        kurt = np.maximum(np.nan_to_num(kurt, nan=0.0), NORMAL_KURTOSIS)
        da, db = a - a.mean(-1, keepdims=True), b - b.mean(-1, keepdims=True)
        co = np.nan_to_num(n * (da * da * db * db).sum(-1) / (sa * sb), nan=1.0)
        r2 = np.nan_to_num((da * db).sum(-1) ** 2 / (sa * sb), nan=0.0)
        se = np.sqrt(np.maximum((2 * (kurt - (n - 3) / n) - 2 * (co - 1)) / (n - 1), 4 * (1 - r2) / (n - 1)))
        f = np.where(vb > 0, va / np.where(vb > 0, vb, 1.0), np.nan)
    return f, se
