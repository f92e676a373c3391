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

import numpy as np
from scipy import stats as sps

from nondet_jax.analysis import stats as S
from nondet_jax.analysis.metrics import pair_indices


def _hit(ci, truth) -> float:
    lo, hi = (np.asarray(c) for c in ci)
    return float(np.mean((lo <= truth) & (truth <= hi)))


def _mean(rng, r, t):  # accuracies: normal around 0.9 with a run-to-run std of 1 point
    return _hit(S.mean_ci(rng.normal(0.9, 0.01, (t, r))), 0.9)


def _std(rng, r, t):
    return _hit(S.std_ci(rng.normal(0.9, 0.01, (t, r))), 0.01)


def _ratio(rng, r, t):
    return _hit(S.std_ratio_ci(rng.normal(0, 0.5, (t, r)), rng.normal(0, 1.0, (t, r))), 0.5)


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
    return _hit(S.pairwise_mean_ci((y[:, a] != y[:, b]).mean(-1), r, bounds=(0.0, 1.0)), truth)


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


# name -> (interval kind in stats.METHODS, data model, simulator)
CASES = {
    "mean": ("mean", "normal", _mean),
    "std": ("std", "normal", _std),
    "std ratio": ("ratio", "normal, true ratio 0.5", _ratio),
    "pairwise mean": ("pairwise", "pair = μ + u_a + u_b + e_ab (normal)", _pairwise_random_effects),
    "pairwise disagreement": ("pairwise", "Bernoulli predictions, replica-level shift", _pairwise_disagreement),
    "pairwise |X_a−X_b| (stress)": ("pairwise", "one skewed value per pair", _pairwise_abs_difference),
    "difference of means": ("difference", "normal, stds 1 and 2", _difference),
    "probability of improvement": ("probability_of_improvement", "normal, shift 1 std", _poi),
    "probability of improvement, ties": ("probability_of_improvement", "binomial accuracies, 360 images",
                                         _poi_discrete),
}


def simulate(case: str, replicas: int, trials: int = 2000, seed: int = 0) -> float:
    """Fraction of ``trials`` simulated studies of ``replicas`` replicas (per arm) whose 95% interval
    of ``case`` (a key of :data:`CASES`, or an interval kind's first case) contains the truth."""
    if case not in CASES:
        case = next(name for name, (kind, _, _) in CASES.items() if kind == case)
    return CASES[case][2](np.random.default_rng(seed), replicas, trials)
