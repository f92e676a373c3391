"""Simulated coverage of the intervals in :mod:`nondet_jax.analysis.stats`: how often a nominal 95% interval
contains the true value, over many seeded simulated studies of R replicas (vectorised: every study
at once).

Each :data:`CASES` entry draws ``trials`` studies from a model whose true value is known and
returns the fraction of intervals that contain it. ``benchmarks/coverage.py`` prints the table at
R=8 and R=12; ``tests/test_coverage.py`` fails below 93% at R=8.

Example::

    from nondet_jax.analysis import coverage
    coverage.simulate("std", replicas=8, trials=2000)    # ~0.95
"""

from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple

import numpy as np
from scipy import stats as sps

from nondet_jax.analysis import power
from nondet_jax.analysis import stats as S
from nondet_jax.analysis.metrics import PAIRWISE_RANGE, PAIRWISE_SCALE, pair_indices


def _hit(ci, truth) -> float:
    lo, hi = (np.asarray(c) for c in ci)
    return float(np.mean((lo <= truth) & (truth <= hi)))


class Scenario(NamedTuple):
    """Per-replica scores as studies produce them: ``draw(rng, shape)`` gives values whose true mean and
    std are ``mean`` and ``std``; ``resolution`` is the step of a count (None: continuous); the second
    arm of a ratio is ``reference(rng, shape)`` with true std ``reference_std``."""
    description: str
    draw: Callable
    mean: float
    std: float
    resolution: float | None
    reference: Callable
    reference_std: float
    stress: bool = False


def _continuous(description, draw, mean, sd, stress=False) -> Scenario:
    """A continuous score; the ratio's reference arm is the same shape with twice the spread."""
    return Scenario(description, draw, mean, sd, None, lambda rng, shape: 2 * draw(rng, shape), 2 * sd, stress)


def _counts(description, n_test, base, flips, q, wide=None) -> Scenario:
    """An accuracy on ``n_test`` images: ``base`` correct plus ``flips`` borderline images, each right
    with probability ``q`` independently per replica (binomial); the ratio's reference arm is a
    binomial accuracy of ``wide`` = (images, p) or, by default, twice the deviations from ``base``."""
    sd = math.sqrt(flips * q * (1 - q)) / n_test

    def draw(rng, shape):
        return (base + rng.binomial(flips, q, shape)) / n_test

    if wide is None:
        def reference(rng, shape):
            return (base + 2 * rng.binomial(flips, q, shape)) / n_test
        ref_sd = 2 * sd
    else:
        def reference(rng, shape):
            return rng.binomial(n_test, wide, shape) / n_test
        ref_sd = math.sqrt(n_test * wide * (1 - wide)) / n_test
    return Scenario(description, draw, (base + flips * q) / n_test, sd, 1 / n_test, reference, ref_sd)


def _bad_seeds(rng, shape, share=0.1, shift=-4.0):
    x = rng.normal(0.0, 1.0, shape)
    return np.where(rng.random(shape) < share, x + shift, x)


_LN = lambda s: math.sqrt((math.exp(s * s) - 1) * math.exp(s * s))  # noqa: E731  the std of lognormal(0, s)
SCENARIOS = {
    "normal": _continuous("normal", lambda rng, sh: rng.normal(0.0, 1.0, sh), 0.0, 1.0),
    "skewed": _continuous("lognormal(0, 0.5): skewness 1.8", lambda rng, sh: rng.lognormal(0.0, 0.5, sh),
                          math.exp(0.125), _LN(0.5)),
    "heavy tails": _continuous("Student t, 5 df: excess kurtosis 6", lambda rng, sh: rng.standard_t(5, sh),
                               0.0, math.sqrt(5 / 3)),
    "bad seeds": _continuous("10% of seeds 4 std below the rest", _bad_seeds, -0.4, math.sqrt(1 + 0.09 * 16)),
    "counts, 10,000 images": _counts("accuracy on 10,000 images, binomial, p = 0.9", 10_000, 0, 10_000, 0.9),
    "counts, 360 images": _counts("accuracy on 360 images, binomial, p = 0.95", 360, 0, 360, 0.95),
    "near ties, 360 images": _counts("3 borderline images of 360, each right with p = 0.08 (13% of R=8 arms tie)",
                                     360, 340, 3, 0.08, wide=0.95),
    "fraction of an image": _counts("2 borderline images of 360, p = 0.05: std 0.3 images (44% of R=8 arms tie)",
                                    360, 340, 2, 0.05, wide=0.95),
    "strong skew (stress)": _continuous("lognormal(0, 1): skewness 6.2", lambda rng, sh: rng.lognormal(0.0, 1.0, sh),
                                        math.exp(0.5), _LN(1.0), stress=True),
}


def _interval_case(kind: str, scenario: Scenario) -> Callable:
    def run(rng, r, t):
        x = scenario.draw(rng, (t, r))
        if kind == "mean":
            return _hit(S.mean_ci(x, resolution=scenario.resolution), scenario.mean)
        if kind == "std":
            return _hit(S.std_ci(x, resolution=scenario.resolution), scenario.std)
        ref = scenario.reference(rng, (t, r))
        return _hit(S.std_ratio_ci(x, ref, resolution=scenario.resolution), scenario.std / scenario.reference_std)
    return run


def false_alarm(test: str, scenario: str, replicas: int, trials: int = 1000, seed: int = 0, arms: int = 1) -> float:
    """How often ``test`` (a key of :data:`nondet_jax.analysis.stats.TESTS`) finds a different spread at
    p < 0.05 when every arm is drawn from the same ``scenario``: with ``arms`` > 1, the share of studies
    with at least one false finding among ``arms`` arms compared with one reference (``spread_p_holm``:
    after Holm's adjustment)."""
    rng, sc = np.random.default_rng(seed), SCENARIOS[scenario]
    fn = {"spread_p": S.spread_test, "spread_p_holm": S.spread_test, "f_test_p": S.f_test,
          "brown_forsythe_p": S.levene_median}[test]  # the tests at every R, n/a or not in the report
    found = 0
    for _ in range(trials):
        ref = sc.draw(rng, (replicas,))
        p = [fn(sc.draw(rng, (replicas,)), ref) for _ in range(arms)]
        if test == "spread_p_holm":
            p = S.holm(p)
        found += min(p) < 0.05
    return found / trials


def _pairwise_random_effects(rng, r, t):
    """Pair value μ + u_a + u_b + e_ab: each replica shifts all of its pairs (the dependence
    between pairs that share a replica), plus pair-level noise of the same size."""
    a, b = pair_indices(r)
    u, e = rng.normal(0, 1, (t, r)), rng.normal(0, 1, (t, len(a)))
    return _hit(S.pairwise_mean_ci(3.0 + u[:, a] + u[:, b] + e, r), 3.0)


def _pairwise_disagreement(rng, r, t, n=200):
    """Disagreement of replicas whose per-example predictions are Bernoulli(q_i) with a replica-level
    logit shift (some replicas more confident than others); true value by a large simulation."""
    q = np.random.default_rng(1234).beta(0.3, 0.3, n)
    logit = np.log(q / (1 - q))

    sd = 0.5
    nodes, weights = np.polynomial.hermite_e.hermegauss(40)  # E over the two replicas' shifts, exactly
    p = 1 / (1 + np.exp(-(logit[None] + sd * nodes[:, None])))  # (nodes, n)
    w = weights / weights.sum()
    truth = float(np.einsum("i,j,in,jn->", w, w, p, 1 - p) * 2 / n)

    def draw(gen, shape):
        shift = gen.normal(0, sd, shape + (1,))
        return gen.random(shape + (n,)) < 1 / (1 + np.exp(-(logit + shift)))

    a, b = pair_indices(r)
    y = draw(rng, (t, r))
    ones = y.sum(1)
    minority = np.minimum(ones, r - ones).sum(-1)
    return _hit(S.disagreement_ci((y[:, a] != y[:, b]).mean(-1), r, minority, n), truth)


def borderline_draws(rng, r, t, borderline, p, unequal, n=360):
    """``t`` studies of ``r`` replicas that agree on all but ``borderline`` of ``n`` test images, on each
    of which a replica flips with probability ``p`` (times a per-replica factor lognormal(0, 0.7) when
    ``unequal``: seeds of unequal noise). Returns (pair disagreements (t, P), minority predictions (t,),
    the true disagreement)."""
    def draw(gen, trials, reps):
        factor = gen.lognormal(0.0, 0.7, (trials, reps, 1)) if unequal else 1.0
        flips = gen.random((trials, reps, borderline)) < np.minimum(p * factor, 0.5)
        i, j = pair_indices(reps)
        ones = flips.sum(1)
        return (flips[:, i] != flips[:, j]).sum(-1) / n, np.minimum(ones, reps - ones).sum(-1)

    truth = float(draw(np.random.default_rng(1234), 200_000, 2)[0].mean())
    return (*draw(rng, t, r), truth)


def _borderline_disagreement(rng, r, t, borderline, p, unequal, n=360):
    """Coverage of the report's disagreement interval (:func:`nondet_jax.analysis.stats.disagreement_ci`)
    on :func:`borderline_draws`; a study printing n/a counts as a miss."""
    values, minority, truth = borderline_draws(rng, r, t, borderline, p, unequal, n)
    return _hit(S.disagreement_ci(values, r, minority, n), truth)


BORDERLINE = {"pairwise disagreement, unequal noise": (30, 0.1, True),
              "pairwise disagreement, few borderline images": (12, 0.05, True),
              "pairwise disagreement, near-identical": (2, 0.06, True)}


def _cka_pairs(features: np.ndarray) -> np.ndarray:
    """Linear CKA of every pair of replicas, batched over studies: (T, R, n, d) -> (T, P) (the formula of
    :func:`nondet_jax.analysis.metrics.linear_cka`)."""
    f = features - features.mean(2, keepdims=True)
    gram = np.einsum("trnd,trne->trde", f, f)
    a, b = pair_indices(features.shape[1])
    cross = np.einsum("tpnd,tpne->tpde", f[:, a], f[:, b])
    norms = np.linalg.norm(gram, axis=(2, 3))
    return (cross ** 2).sum((2, 3)) / (norms[:, a] * norms[:, b])


def _pairwise_cka(rng, r, t, noise, n=60, d=6):
    """Linear CKA of replicas whose features are a shared part plus each replica's own noise, its variance
    ``noise``² times a per-replica factor lognormal(0, 0.7) (seeds of unequal noise, as in
    :func:`borderline_draws`); the report's interval (the jackknife on the scale and range of ``cka``), the
    truth by a large simulation."""
    shared = np.random.default_rng(1234).normal(size=(n, d)) * np.linspace(2.0, 0.2, d)  # anisotropic features

    def draw(gen, trials, reps):
        scale = noise * np.sqrt(gen.lognormal(0.0, 0.7, (trials, reps, 1, 1)))
        return shared + scale * gen.normal(size=(trials, reps, n, d))

    truth = float(_cka_pairs(draw(np.random.default_rng(4321), 20_000, 2)).mean())
    values = np.concatenate([_cka_pairs(draw(rng, 500, r)) for _ in range(0, t, 500)])[:t]
    return _hit(S.pairwise_mean_ci(values, r, bounds=PAIRWISE_RANGE["cka"], scale=PAIRWISE_SCALE["cka"]), truth)


def _pairwise_abs_difference(rng, r, t):
    """A stress case: one |X_a − X_b| per pair of standard normal X (skewed, no averaging inside a pair)."""
    a, b = pair_indices(r)
    x = rng.normal(size=(t, r))
    return _hit(S.pairwise_mean_ci(np.abs(x[:, a] - x[:, b]), r, bounds=(0.0, np.inf)), 2 / np.sqrt(np.pi))


def _difference(rng, r, t):  # unequal spreads: Welch's case
    return _hit(S.welch(rng.normal(0, 1, (t, r)), rng.normal(0.5, 2, (t, r)))["ci"], 0.5)


def _poi(rng, r, t, shift=1.0):
    truth = float(sps.norm.cdf(shift / np.sqrt(2)))
    return _hit(S.probability_of_improvement(rng.normal(0, 1, (t, r)), rng.normal(shift, 1, (t, r)))["ci"], truth)


def _poi_discrete(rng, r, t, n_test=360):
    """Accuracies on a 360-image test set (ties between runs are common): binomial scores."""
    pa, pb = 0.95, 0.955
    big_a, big_b = rng.binomial(n_test, pa, 400_000), rng.binomial(n_test, pb, 400_000)
    truth = float((big_b > big_a).mean() + 0.5 * (big_b == big_a).mean())
    ci = S.probability_of_improvement(rng.binomial(n_test, pa, (t, r)), rng.binomial(n_test, pb, (t, r)))["ci"]
    return _hit(ci, truth)


def _paired_normal(rng, r, t, shift=0.3):
    """Two methods under shared seeds: a seed effect u_i common to both (std 1) plus each run's own
    noise (std 0.3), B better by ``shift``: a = u + e_a, b = u + shift + e_b."""
    u = rng.normal(size=(t, r))
    return u + rng.normal(0, 0.3, (t, r)), u + shift + rng.normal(0, 0.3, (t, r))


def _paired_counts(rng, r, t, n_test=360, gain=0.5, flips=5):
    """Accuracies on 360 images under shared seeds: the seed decides 30 borderline images for both
    methods (binomial), and B changes ``flips`` more, each right with probability 0.5 + gain/flips (A:
    0.5): the differences are counts of 1/360 and often tie. Returns a, b and the true mean difference."""
    shared = 330 + rng.binomial(30, 0.6, (t, r))
    a = shared + rng.binomial(flips, 0.5, (t, r))
    b = shared + rng.binomial(flips, 0.5 + gain / flips / 2, (t, r))
    return a / n_test, b / n_test, flips * (gain / flips / 2) / n_test


def _paired_difference(rng, r, t):
    a, b = _paired_normal(rng, r, t)
    return _hit(S.paired_difference(a, b)["ci"], 0.3)


def _paired_difference_counts(rng, r, t):
    a, b, truth = _paired_counts(rng, r, t)
    return _hit(S.paired_difference(a, b, resolution=1 / 360)["ci"], truth)


def _paired_difference_identical(rng, r, t):
    """A bitflip-like method: B equals A on every image but each of 2 borderline ones, which flip with
    probability 0.05 in either method: most differences are exactly 0, the truth is 0."""
    d = rng.binomial(2, 0.05, (t, r)) - rng.binomial(2, 0.05, (t, r))
    a = 0.9 + np.zeros((t, r))
    return _hit(S.paired_difference(a, a + d / 360, resolution=1 / 360)["ci"], 0.0)


def _paired_poi(rng, r, t):
    a, b = _paired_normal(rng, r, t, shift=0.2)
    truth = float(sps.norm.cdf(0.2 / (0.3 * np.sqrt(2))))
    return _hit(S.paired_probability_of_improvement(a, b)["ci"], truth)


def _paired_poi_counts(rng, r, t):
    a, b, _ = _paired_counts(rng, r, t)
    big_a, big_b, _ = _paired_counts(rng, 400_000, 1)
    truth = float((big_b > big_a).mean() + 0.5 * (big_b == big_a).mean())
    return _hit(S.paired_probability_of_improvement(a, b)["ci"], truth)


DECOMPOSITION_STDS = (1.0, 0.8, 0.6, 0.9)  # four one-source arms; the all arm's std 1.2


def _decomposition(rng, r, t, draw=None):
    """Σ σ²_s / σ²_all over four one-source arms and the all arm, each drawn independently."""
    draw = draw or (lambda s: rng.normal(0, s, (t, r)))
    xs = [draw(s) for s in DECOMPOSITION_STDS]
    truth = sum(s * s for s in DECOMPOSITION_STDS) / 1.2 ** 2
    return _hit(S.variance_sum_ratio_ci(xs, draw(1.2)), truth)


def _decomposition_counts(rng, r, t, n_test=360):
    """Accuracies on 360 images: arm s has flips_s borderline images right with probability 0.5 each, all
    arm 60 (binomial counts); the shares are ratios of binomial variances."""
    flips = (40, 25, 10, 30)
    xs = [(300 + rng.binomial(f, 0.5, (t, r))) / n_test for f in flips]
    ref = (300 + rng.binomial(60, 0.5, (t, r))) / n_test
    return _hit(S.variance_sum_ratio_ci(xs, ref, resolution=1 / n_test), sum(flips) / 60)


def _paired_ratio(rng, r, t, scenario):
    """The paired ratio interval (:func:`nondet_jax.analysis.stats.paired_ratio_ci`) on two arms sharing seeds
    (:data:`nondet_jax.analysis.power.PAIRED_SCENARIOS`), at their true ratio of 0.5."""
    sc = power.PAIRED_SCENARIOS[scenario]
    truth = sc.truth if np.isfinite(sc.truth) else power._truth(sc.draw)
    a, b = sc.draw(rng, (t, r), False)
    return _hit(S.paired_ratio_ci(a, b), truth)


# name -> (interval kind in stats.METHODS, data model, simulator); "(stress)" cases are recorded, not required
CASES = {
    **{f"{kind}: {name}": (kind, sc.description, _interval_case(kind, sc))
       for kind in ("mean", "std", "ratio") for name, sc in SCENARIOS.items()},
    "pairwise mean": ("pairwise", "pair = μ + u_a + u_b + e_ab (normal)", _pairwise_random_effects),
    "pairwise disagreement": ("pairwise", "Bernoulli predictions, replica-level shift", _pairwise_disagreement),
    "pairwise |X_a−X_b| (stress)": ("pairwise", "one skewed value per pair", _pairwise_abs_difference),
    "pairwise CKA, moderate diversity": ("pairwise", "features: shared part + own noise (std 0.5, unequal seeds): "
                                         "CKA about 0.84", functools.partial(_pairwise_cka, noise=0.5)),
    "pairwise CKA, near-identical": ("pairwise", "features: shared part + own noise (std 0.02, unequal seeds): "
                                     "CKA about 0.9997", functools.partial(_pairwise_cka, noise=0.02)),
    **{name: ("pairwise", f"{k} borderline images of 360, flip p = {p}, unequal seeds"
              + (": 0.06% disagreement (a bitflip arm)" if k == 2 else ""),
              functools.partial(_borderline_disagreement, borderline=k, p=p, unequal=u))
       for name, (k, p, u) in BORDERLINE.items()},
    "difference of means": ("difference", "normal, stds 1 and 2", _difference),
    "probability of improvement": ("probability_of_improvement", "normal, shift 1 std", _poi),
    "probability of improvement, ties": ("probability_of_improvement", "binomial accuracies, 360 images",
                                         _poi_discrete),
    "decomposition: normal": ("decomposition", "4 one-source arms (stds 1, 0.8, 0.6, 0.9) and all (1.2), normal",
                              _decomposition),
    "decomposition: skewed": ("decomposition", "the same, lognormal(0, 0.5) spreads: skewness 1.8",
                              lambda rng, r, t: _decomposition(rng, r, t, lambda s: s * np.exp(rng.normal(0, 0.5, (t, r))))),
    "decomposition: heavy tails": ("decomposition", "the same, Student t with 5 df",
                                   lambda rng, r, t: _decomposition(rng, r, t, lambda s: s * rng.standard_t(5, (t, r)))),
    "decomposition: counts, 360 images": ("decomposition", "binomial accuracies: 40, 25, 10, 30 borderline images "
                                          "of 360, all 60", _decomposition_counts),
    "paired difference": ("paired_difference", "shared seed effect (std 1), run noise 0.3, shift 0.3",
                          _paired_difference),
    "paired difference, counts": ("paired_difference", "accuracies on 360 images, shared borderline images",
                                  _paired_difference_counts),
    "paired difference, near-identical": ("paired_difference", "B = A but 2 images flipping with p 0.05 (ties at 0)",
                                          _paired_difference_identical),
    "paired probability of improvement": ("paired_probability_of_improvement",
                                          "shared seed effect, run noise 0.3, shift 0.2", _paired_poi),
    "paired probability of improvement, ties": ("paired_probability_of_improvement",
                                                "accuracies on 360 images, shared borderline images",
                                                _paired_poi_counts),
    **{f"paired ratio: {name}": ("paired_ratio", sc.description, functools.partial(_paired_ratio, scenario=name))
       for name, sc in power.PAIRED_SCENARIOS.items()},
}


def simulate(case: str, replicas: int, trials: int = 2000, seed: int = 0) -> float:
    """Fraction of ``trials`` simulated studies of ``replicas`` replicas (per arm) whose 95% interval
    of ``case`` (a key of :data:`CASES`, or an interval kind's first case) contains the truth."""
    if case not in CASES:
        case = next(name for name, (kind, _, _) in CASES.items() if kind == case)
    return CASES[case][2](np.random.default_rng(seed), replicas, trials)
