"""Replicas until the question is answered: a group-sequential paired comparison of methods.

A study of methods run with ``until`` trains its replicas in looks: ``study.replicas`` first, then
:data:`nondet_jax.until.ROUND` more per method at each look, up to ``max_replicas``. After each look every comparison
of a method with the baseline (paired by seed, :func:`nondet_jax.analysis.methods.compare_methods`) is
assessed, and the study stops once every one is answered:

- ``decided``: the paired t interval at a constant per-look level (Pocock's design) excludes 0. The
  level is calibrated by simulation (:func:`per_look_level`) so that, over all the looks the design
  may take, the chance that any interval misses the true difference is at most 5% divided over the
  comparisons (Bonferroni). These are repeated confidence intervals: valid whenever the study stops,
  so the decision and the interval printed at the stop keep their error rate although the study
  looked at its data before deciding to go on. ``decided=D`` also stops a comparison once its interval
  lies inside ±D (any difference is smaller than D, the smallest that matters).
- ``width=X``: every repeated interval is at most X wide. (The plain 95% paired t interval, stopped on
  its own width, covered only 89-92% of simulated 360-image accuracy differences, whose spread moves
  with their mean: :func:`simulate`.)

Nothing here trains: :mod:`nondet_jax.study.methods` runs the looks. No JAX.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from scipy import stats as sps

from nondet_jax.analysis import stats as S
from nondet_jax.until import Until

ALPHA = 0.05  # the whole design's error: any repeated interval missing the truth, over every comparison and look
CALIBRATION_TRIALS = 40_000
# "The same power" is capped here: near 100% the fixed design's replicas grow without bound while the sequential
# design, which stops at its first look, cannot use fewer than that look's.
POWER_CAP = 0.95


def t_path(d: np.ndarray, ns: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Paired t statistics (T, looks) and their two-sided p at each look's first n pairs of ``d`` (T, N)."""
    cs, cs2 = np.cumsum(d, -1), np.cumsum(d * d, -1)
    out_t, out_p = [], []
    for n in ns:
        m = cs[:, n - 1] / n
        var = np.maximum(cs2[:, n - 1] - n * m * m, 0.0) / (n - 1)
        with np.errstate(divide="ignore", invalid="ignore"):
            t = np.where(var > 0, m / np.sqrt(var / n), np.where(m == 0, 0.0, np.inf))
        out_t.append(t)
        out_p.append(2 * sps.t.sf(np.abs(t), n - 1))
    return np.stack(out_t, -1), np.stack(out_p, -1)


@functools.lru_cache(maxsize=64)
def per_look_level(ns: tuple[int, ...], alpha: float = ALPHA, trials: int = CALIBRATION_TRIALS) -> float:
    """The constant per-look p threshold at which a design looking at ``ns`` pairs rejects a true null in
    ``alpha`` of normal studies (Pocock's boundary for the paired t; seeded simulation, so the same design
    always gets the same level)."""
    _, p = t_path(np.random.default_rng(2024).normal(size=(trials, max(ns))), list(ns))
    return float(np.quantile(p.min(-1), alpha))


def _resolution(r: dict) -> float | None:
    n_test = r.get("a", {}).get("n_test")
    return 1 / n_test if n_test and "accuracy" in str(r.get("a", {}).get("metric", "")) else None


def assess(until: Until, comparisons: list[dict]) -> dict:
    """One look: each comparison (:func:`nondet_jax.analysis.methods.compare_methods`'s results, which carry
    the paired scores) answered or not, and whether the study stops. Returns ``{"replicas", "level",
    "comparisons": [{method_a, method_b, arm, difference, interval, decision}], "stop", "why"}``;
    ``level`` is the per-look p level of the repeated intervals (each printed at 1 − level)."""
    n = min(r["n_pairs"] for r in comparisons)
    level = per_look_level(tuple(until.looks()), ALPHA / len(comparisons))
    rows = []
    for r in comparisons:
        a, b = np.asarray(r["a"]["scores"]), np.asarray(r["b"]["scores"])
        lo, hi = S.paired_difference(a, b, 1 - level, _resolution(r))["ci"]
        if until.rule == "decided":
            if lo > 0 or hi < 0:
                better = "B" if (hi < 0) != r.get("higher_is_better", True) else "A"
                decision = f"{r['method_b'] if better == 'B' else r['method_a']} is better"
            elif until.value is not None and -until.value < lo and hi < until.value:
                decision = f"within ±{until.value:g}"
            else:
                decision = "open"
        else:
            decision = "narrow enough" if hi - lo <= until.value else "open"
        rows.append({"method_a": r["method_a"], "method_b": r["method_b"], "arm": r["arm"],
                     "difference": r["difference"], "interval": [lo, hi], "decision": decision})
    answered = all(row["decision"] != "open" for row in rows)
    last = n >= until.max_replicas
    why = ("every comparison is answered" if answered else
           f"the most replicas per method ({until.max_replicas}) are trained" if last else "")
    return {"replicas": n, "level": level, "rule": until.spec,
            "comparisons": rows, "stop": answered or last, "why": why}


def _stops(until: Until, d: np.ndarray, level: float, resolution: float | None = None) -> tuple[np.ndarray, ...]:
    """For simulated differences ``d`` (T, max pairs): each study's look index at its stop, its interval
    there and whether it decided a difference."""
    ns = until.looks()
    trials = len(d)
    stop = np.full(trials, len(ns) - 1)
    lo, hi = np.empty(trials), np.empty(trials)
    open_ = np.ones(trials, bool)
    for k, n in enumerate(ns):
        m, s = d[:, :n].mean(-1), d[:, :n].std(-1, ddof=1)
        q = sps.t.ppf(1 - level / 2, n - 1)
        l_k, h_k = m - q * s / math.sqrt(n), m + q * s / math.sqrt(n)
        if until.rule == "decided":
            done = (l_k > 0) | (h_k < 0)
            if until.value is not None:
                done |= (-until.value < l_k) & (h_k < until.value)
        else:
            done = h_k - l_k <= until.value
        take = open_ & (done | (k == len(ns) - 1))
        stop[take], lo[take], hi[take] = k, l_k[take], h_k[take]
        open_ &= ~take
    return stop, lo, hi, (lo > 0) | (hi < 0)


def saving(until: Until, look: dict, comparisons: list[dict], trials: int = 4000) -> list[dict]:
    """For each comparison at the stop (``look``: :func:`assess`'s), at the standardised difference found there
    (mean / std of the paired differences; biased up when the study stopped early, as every estimate at a
    sequential stop is), the design's power (:func:`simulate`), the replicas a fixed paired t design needs for
    the same power at the same family-wise level, and the share of replicas the sequential study saved against
    it (at the replicas it used)."""
    out = []
    for c in comparisons:
        sd = c.get("std_difference") or 0.0
        effect = abs(c["difference"]) / sd if sd > 0 else float("inf") if c["difference"] else 0.0
        row = {"method_b": c["method_b"], "arm": c["arm"], "effect": effect, "replicas": look["replicas"]}
        if 0 < effect < float("inf") and until.rule == "decided":
            sim = simulate(until, effect, trials, comparisons=len(comparisons))
            row.update(power=sim["decided"], expected_replicas=sim["mean_replicas"], fixed_same_power=sim["fixed_same_power"],
                       saved=None if not sim["fixed_same_power"] else 1 - look["replicas"] / sim["fixed_same_power"])
        out.append(row)
    return out


def simulate(until: Until, effect: float, trials: int = 4000, seed: int = 0, differences=None,
             comparisons: int = 1) -> dict:
    """The design on simulated paired studies: ``differences(rng, shape, effect)`` -> (differences, true mean)
    (default: normal with std 1, so ``effect`` is standardised). Returns the share of studies that
    decided a difference (the error when ``effect`` is 0), the mean replicas per method at the stop, the
    coverage of the interval printed there, the share stopped inside ±D (``decided=D``), and for a real
    effect the replicas a fixed paired t design needs for the same power (at most :data:`POWER_CAP`) and the
    share saved against it. ``comparisons``: how many the study assesses (the levels are Bonferroni's over them)."""
    rng = np.random.default_rng(seed)
    if differences is None:
        d, truth = effect + rng.normal(size=(trials, until.max_replicas)), effect
    else:
        d, truth = differences(rng, (trials, until.max_replicas), effect)
    level = per_look_level(tuple(until.looks()), ALPHA / comparisons)
    stop, lo, hi, decided = _stops(until, d, level)
    used = np.asarray(until.looks())[stop]
    out = {"rule": until.spec, "first": until.first, "max_replicas": until.max_replicas, "effect": effect,
           "per_look_level": level, "decided": float(decided.mean()),
           "mean_replicas": float(used.mean()), "coverage": float(np.mean((lo <= truth) & (truth <= hi))),
           "within": (float(np.mean(~decided & (-until.value < lo) & (hi < until.value)))
                      if until.rule == "decided" and until.value else None)}
    if effect and until.rule == "decided":
        sd = float(np.std(d[:, :until.max_replicas])) or 1.0
        target = min(out["decided"], POWER_CAP)
        fixed = S._smallest_n(lambda k: S._t_power(abs(truth) / sd * math.sqrt(k), k - 1, ALPHA / comparisons)
                              >= target, 10_000)
        out.update(fixed_same_power=fixed, saved=None if fixed is None else 1 - out["mean_replicas"] / fixed)
    return out
