"""Replicas until the question is answered: a group-sequential paired comparison of methods.

A study of methods run with ``until`` trains its replicas in looks: ``study.replicas`` first, then
:data:`nondet_jax.until.ROUND` more per method at each look, up to ``max_replicas``. After each look every comparison
of a method with the baseline (paired by seed, :func:`nondet_jax.analysis.methods.compare_methods`) is
assessed, and the study stops once every one is answered:

- ``decided``: the paired t interval at the look's level excludes 0. The levels follow Wang & Tsiatis'
  boundary of shape :data:`BOUNDARY_SHAPE` (stricter at early looks, looser at later ones) and are
  calibrated by simulation (:func:`look_levels`) so that a design stopping by its own rules decides a
  difference that is not there in at most 5% of studies, divided over the comparisons (Bonferroni).
  A comparison is given up ("futile") once its chance of being decided by the last look, were the
  difference what it looks like now, is under :data:`FUTILITY` (:func:`conditional_power`). Giving up
  is binding: the study stops training a comparison it gave up, so the calibration counts the decisions
  giving up forgoes and spends them on looser levels. ``decided=D`` also stops a comparison once its
  interval lies inside ±D (any difference is smaller than D, the smallest that matters); that decides
  nothing, so the error can only fall.
- ``width=X``: every repeated interval is at most X wide. Its levels are Pocock's (one constant level,
  no giving up): repeated confidence intervals, valid wherever the study stops. (The plain 95% paired t
  interval, stopped on its own width, covered only 89-92% of simulated 360-image accuracy differences,
  whose spread moves with their mean: :func:`simulate`.)

Nothing here trains: :mod:`nondet_jax.study.methods` runs the looks. No JAX.
"""

from __future__ import annotations

import bisect
import functools
import math

import numpy as np
from scipy import stats as sps

from nondet_jax.analysis import stats as S
from nondet_jax.until import Until, number

ALPHA = 0.05  # the whole design's error over every comparison and look: decided where there is no difference
# (``decided``), any repeated interval missing the truth (``width``)
CALIBRATION_TRIALS = 40_000
# "The same power" is capped here: near 100% the fixed design's replicas grow without bound while the sequential
# design, which stops at its first look, cannot use fewer than that look's.
POWER_CAP = 0.95
# A comparison not yet decided is given up ("futile") when its chance of being decided by the last look, were the
# difference what it looks like now, is below this: conditional power under the current trend. Chosen with the
# boundary shape below by `python benchmarks/coverage.py --sequential-grid --trials 4000` (looks every 4 replicas
# from 8 to 32; normal and 360-image differences at standardised 0.5, 0.7, 1): Pocock's level with 10%, not
# counted in the calibration (the design before), saved 18/23/25% and 12/24/36% against the fixed design of the
# same power; shape 0.4 with 20%, counted, 23/25/24% and 24/28/38%, its power within 0.5 points of the design
# before or higher, its error at most 5%.
FUTILITY = 0.20
# Wang & Tsiatis' boundary: look k (n_k of N replicas) decides at |z| > C·(n_k/N)^(Δ − 1/2); Δ = 0.5 is
# Pocock's constant level, Δ = 0 O'Brien & Fleming's.
BOUNDARY_SHAPE = 0.4
# A design's boundary as methods.json records it: the shape, the futility threshold, and whether giving up is
# counted in the calibration. BOUNDARY: ``decided``'s now. EARLIER: a ``decided`` folder recorded without one
# (started before boundaries were recorded): Pocock's constant level, giving up below 10% not counted.
# REPEATED: ``width``'s, Pocock's repeated confidence intervals, nothing given up.
BOUNDARY = {"shape": BOUNDARY_SHAPE, "futility": FUTILITY, "futility_counted": True}
EARLIER = {"shape": 0.5, "futility": 0.10, "futility_counted": False}
REPEATED = {"shape": 0.5, "futility": 0.0, "futility_counted": False}


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


def _levels(c: float, ns: tuple[int, ...], shape: float) -> np.ndarray:
    """Two-sided level of each look of Wang & Tsiatis' boundary ``C·(n_k/N)^(shape − 1/2)``."""
    n = np.asarray(ns, np.float64)
    return 2 * sps.norm.sf(c * (n / n[-1]) ** (shape - 0.5))


def _decide(t: np.ndarray, ns: tuple[int, ...], levels, futility: float) -> tuple[np.ndarray, np.ndarray]:
    """For t statistics (T, looks): each study's stop (look index) and whether it decided a difference there,
    deciding at look k when ``|t| > t(1 − level_k/2, n_k − 1)`` and giving up when the conditional power to
    decide at the last look's level is under ``futility``."""
    trials, last = len(t), len(ns) - 1
    stop, decided, open_ = np.full(trials, last), np.zeros(trials, bool), np.ones(trials, bool)
    for k, n in enumerate(ns):
        yes = np.abs(t[:, k]) > sps.t.ppf(1 - levels[k] / 2, n - 1)
        done = yes | (k == last)
        if futility:
            done |= conditional_power(t[:, k], n, ns[-1], levels[-1]) < futility
        take = open_ & done
        stop[take], decided[take] = k, yes[take]
        open_ &= ~take
    return stop, decided


@functools.lru_cache(maxsize=64)
def look_levels(ns: tuple[int, ...], alpha: float = ALPHA, shape: float = BOUNDARY_SHAPE,
                futility: float = FUTILITY, trials: int = CALIBRATION_TRIALS) -> tuple[float, ...]:
    """Each look's two-sided level for a design looking at ``ns`` pairs: Wang & Tsiatis' boundary of ``shape``
    with the constant C at which normal studies stopped by the design's own rules (deciding at these levels,
    giving up below ``futility`` conditional power) decide a difference that is not there in at most ``alpha``
    of them. A seeded simulation, so the same design always gets the same levels. ``shape=0.5, futility=0``:
    Pocock's constant level of repeated confidence intervals."""
    t, _ = t_path(np.random.default_rng(2024).normal(size=(trials, max(ns))), list(ns))
    lo, hi = 0.5, 6.0  # error(C) falls as C grows: the smallest C with error <= alpha
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if _decide(t, ns, _levels(mid, ns, shape), futility)[1].mean() <= alpha else (mid, hi)
    return tuple(float(v) for v in _levels(hi, ns, shape))


def boundary_of(until: Until, record: dict | None = None) -> dict:
    """The boundary ``until``'s levels follow: :data:`REPEATED` for ``width``; for ``decided``, the one its
    ``methods.json`` ``record`` names (:data:`EARLIER` where it names none), else this version's :data:`BOUNDARY`."""
    if until.rule != "decided":
        return REPEATED
    if record is None:
        return BOUNDARY
    return record["boundary"] if isinstance(record.get("boundary"), dict) else EARLIER


def design_levels(until: Until, comparisons: int = 1, boundary: dict | None = None) -> tuple[float, ...]:
    """The levels of ``until``'s looks with ``comparisons`` sharing the 5% (Bonferroni), on ``boundary``
    (default :func:`boundary_of` ``until``)."""
    b = boundary or boundary_of(until)
    return look_levels(tuple(until.looks()), ALPHA / comparisons, float(b["shape"]),
                       float(b["futility"]) if b["futility_counted"] else 0.0)


def conditional_power(t, n, last: int, level: float):
    """The chance that a paired comparison with t statistic ``t`` at ``n`` pairs reaches two-sided ``level`` at
    ``last`` pairs if the true standardised difference equals the one seen now (the B-value form, normal
    approximation): Φ((|t|/√f − c)/√(1 − f)) with f = n / last and c the level's normal quantile; 0 at the
    last look."""
    f = np.asarray(n, np.float64) / last
    c = sps.norm.ppf(1 - level / 2)
    with np.errstate(divide="ignore", invalid="ignore"):
        cp = sps.norm.cdf((np.abs(t) / np.sqrt(f) - c) / np.sqrt(np.maximum(1 - f, 0.0)))
    return np.where(f < 1, np.nan_to_num(cp, nan=0.0), 0.0)


def design_record(until: Until) -> dict:
    """``methods.json``'s record of a sequential design: ``until`` with its spec and, for ``decided``, the boundary
    its levels follow, so a folder started under another boundary is refused instead of resumed on levels its
    earlier looks were not read at (:func:`nondet_jax.study.methods.check_design`)."""
    record = {**until._asdict(), "spec": until.spec}
    if until.rule == "decided":
        record["boundary"] = dict(BOUNDARY)
    return record


def _t_stat(mean, sd, n):
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(sd > 0, mean / (sd / np.sqrt(n)), np.where(mean == 0, 0.0, np.inf))


def _resolution(r: dict) -> float | None:
    n_test = r.get("a", {}).get("n_test")
    return 1 / n_test if n_test and "accuracy" in str(r.get("a", {}).get("metric", "")) else None


def key(c: dict) -> tuple[str, str, str]:
    """A comparison's name: (method_b, method_a, arm)."""
    return c["method_b"], c["method_a"], c["arm"]


def answered(looks: list[dict]) -> dict[tuple, dict]:
    """The comparisons answered at earlier looks (``methods.json``'s), each with the look's replicas: an
    answer stands (the levels are calibrated for a design in which an answered comparison stops), so its method
    trains no more."""
    out: dict[tuple, dict] = {}
    for look in looks:
        for c in look["comparisons"]:
            if c["decision"] not in ("open", "not decided", "not narrow enough") and key(c) not in out:
                out[key(c)] = {**c, "replicas": c.get("replicas", look["replicas"])}
    return out


def assess(until: Until, comparisons: list[dict], earlier: dict[tuple, dict] | None = None,
           replicas: int | None = None) -> dict:
    """One look: each comparison (:func:`nondet_jax.analysis.methods.compare_methods`'s results, which carry
    the paired scores) answered or not, and whether the study stops; those in ``earlier`` (:func:`answered`)
    keep their answer. The levels are shared by every comparison (Bonferroni over all of them, answered or
    not). Returns ``{"replicas", "level", "comparisons": [{method_a, method_b, arm, difference, interval,
    decision, replicas}], "stop", "why"}``; ``level`` is this look's two-sided level (:func:`design_levels`;
    each interval printed at 1 − level). ``replicas``: the replicas per method this look trained (default: the
    most pairs compared); a comparison whose pairs are fewer (a replica diverged and its pair is left out) says
    so in ``pairs``."""
    earlier = earlier or {}
    levels = design_levels(until, len(comparisons))
    assessed = [r for r in comparisons if key(r) not in earlier]
    n = replicas or max((r["n_pairs"] for r in assessed), default=max(r["n_pairs"] for r in comparisons))
    level = levels[min(bisect.bisect_left(until.looks(), n), len(levels) - 1)]
    rows = []
    for r in comparisons:
        if key(r) in earlier:
            rows.append(earlier[key(r)])
            continue
        a, b = np.asarray(r["a"]["scores"]), np.asarray(r["b"]["scores"])
        lo, hi = S.paired_difference(a, b, 1 - level, _resolution(r))["ci"]
        better = None if not (lo > 0 or hi < 0) else \
            r["method_b"] if (hi < 0) != r.get("higher_is_better", True) else r["method_a"]
        if until.rule == "decided":
            if better is not None:
                decision = f"{better} is better"
            elif until.value is not None and -until.value < lo and hi < until.value:
                decision = f"within ±{number(until.value)}"
            elif n >= until.max_replicas:
                decision = "not decided"
            elif conditional_power(_t_stat(r["difference"], r["std_difference"], r["n_pairs"]), r["n_pairs"],
                                   until.max_replicas, levels[-1]) < FUTILITY:
                decision = "futile"
            else:
                decision = "open"
        else:
            decision = "narrow enough" if hi - lo <= until.value else "not narrow enough" if n >= until.max_replicas \
                else "open"
        rows.append({"method_a": r["method_a"], "method_b": r["method_b"], "arm": r["arm"], "replicas": n,
                     "difference": r["difference"], "interval": [lo, hi], "decision": decision,
                     "higher_is_better": bool(r.get("higher_is_better", True)),
                     # a width study's repeated interval that excludes 0 says which is better too
                     **({"better": better} if until.rule == "width" and better is not None else {}),
                     **({"pairs": r["n_pairs"]} if r["n_pairs"] != n else {})})
    done = all(row["decision"] not in ("open", "not decided", "not narrow enough") for row in rows)
    last = n >= until.max_replicas
    why = ("every comparison is answered" if done else
           f"the most replicas per method ({until.max_replicas}) are trained" if last else "")
    return {"replicas": n, "level": level, "rule": until.spec,
            "comparisons": rows, "stop": done or last, "why": why}


def look_lines(look: dict) -> list[str]:
    """A look (:func:`assess`'s) in words, one line per comparison: what the study prints at each look and
    ``compare`` prints for a sequential study (whose answers these are, not a fixed-sample test's)."""
    out = []
    for c in look["comparisons"]:
        lo, hi = c["interval"]
        now = c["replicas"] == look["replicas"]  # else an answer standing from an earlier look, at that look's level
        level = f"{100 * (1 - look['level']):.2f}% interval" if now else f"answered at {c['replicas']} replicas"
        if "pairs" in c:
            level += f", {c['pairs']} pairs: a diverged replica's pair left out"
        said = c["decision"] + (f" ({c['better']} is better: the interval excludes 0)" if c.get("better") else "")
        if said == "futile":
            said += " (given up: too unlikely to be decided by the last look, were the difference what it is now)"
        out.append(f"look at {look['replicas']} replicas: {c['method_b']} − {c['method_a']} on {c['arm']} "
                   f"{c['difference']:+.4g} [{lo:+.4g}, {hi:+.4g}] ({level}): {said}")
    return out


def _stops(until: Until, d: np.ndarray, levels, futility: float = FUTILITY) -> tuple[np.ndarray, ...]:
    """For simulated differences ``d`` (T, max pairs): each study's look index at its stop, its interval
    there and whether it decided a difference."""
    ns = until.looks()
    trials = len(d)
    stop = np.full(trials, len(ns) - 1)
    lo, hi = np.empty(trials), np.empty(trials)
    open_ = np.ones(trials, bool)
    for k, n in enumerate(ns):
        m, s = d[:, :n].mean(-1), d[:, :n].std(-1, ddof=1)
        q = sps.t.ppf(1 - levels[k] / 2, n - 1)
        l_k, h_k = m - q * s / math.sqrt(n), m + q * s / math.sqrt(n)
        if until.rule == "decided":
            done = (l_k > 0) | (h_k < 0)
            if until.value is not None:
                done |= (-until.value < l_k) & (h_k < until.value)
            done |= conditional_power(_t_stat(m, s, n), n, until.max_replicas, levels[-1]) < futility
        else:
            done = h_k - l_k <= until.value
        take = open_ & (done | (k == len(ns) - 1))
        stop[take], lo[take], hi[take] = k, l_k[take], h_k[take]
        open_ &= ~take
    return stop, lo, hi, (lo > 0) | (hi < 0)


def saving(until: Until, look: dict, comparisons: list[dict], trials: int = 4000, boundary: dict | None = None) -> list[dict]:
    """For each comparison at the stop (``look``: :func:`assess`'s), at the standardised difference found there
    (mean / std of the paired differences; biased up when the study stopped early, as every estimate at a
    sequential stop is), the design's power (:func:`simulate`), the replicas a fixed paired t design needs for
    the same power at the same family-wise level, and the share of replicas the sequential study saved against
    it (at the replicas its method trained). ``boundary``: the design's (:func:`boundary_of`)."""
    used = {key(c): c.get("replicas", look["replicas"]) for c in look["comparisons"]}
    decisions = {key(c): c["decision"] for c in look["comparisons"]}
    out = []
    for c in comparisons:
        sd = c.get("std_difference") or 0.0
        effect = abs(c["difference"]) / sd if sd > 0 else float("inf") if c["difference"] else 0.0
        n = used.get(key(c), look["replicas"])
        row = {"method_b": c["method_b"], "arm": c["arm"], "effect": effect, "replicas": n,
               "decision": decisions.get(key(c))}
        # a saving against a design of the same power is what a decision cost; a comparison given up or found
        # within ±D decided nothing
        if 0 < effect < float("inf") and until.rule == "decided" and str(row["decision"]).endswith(" is better"):
            # simulate() draws differences of std 1: ±D in those units is D / sd
            standard = until if until.value is None else until._replace(value=until.value / sd)
            sim = simulate(standard, effect, trials, comparisons=len(comparisons), boundary=boundary)
            fixed = sim["fixed_same_power"]
            row.update(power=sim["decided"], expected_replicas=sim["mean_replicas"], fixed_same_power=fixed,
                       saved=None if not fixed else 1 - n / fixed)
        out.append(row)
    return out


def simulate(until: Until, effect: float, trials: int = 4000, seed: int = 0, differences=None,
             comparisons: int = 1, boundary: dict | None = None) -> dict:
    """The design on simulated paired studies: ``differences(rng, shape, effect)`` -> (differences, true mean)
    (default: normal with std 1, so ``effect`` is standardised). Returns the share of studies that
    decided a difference (the error when ``effect`` is 0), the mean replicas per method at the stop, the
    coverage of the interval printed there, the share stopped inside ±D (``decided=D``), the share given up
    before the last look (``futile``), the share of ``max_replicas`` saved, and for a real
    effect the replicas a fixed paired t design needs for the same power (at most :data:`POWER_CAP`) and the
    share saved against it. ``comparisons``: how many the study assesses (the levels are Bonferroni's over them).
    ``boundary``: another design's (default: :func:`boundary_of` ``until``)."""
    rng = np.random.default_rng(seed)
    if differences is None:
        d, truth = effect + rng.normal(size=(trials, until.max_replicas)), effect
    else:
        d, truth = differences(rng, (trials, until.max_replicas), effect)
    boundary = boundary or boundary_of(until)
    levels = design_levels(until, comparisons, boundary)
    stop, lo, hi, decided = _stops(until, d, levels, float(boundary["futility"]))
    used = np.asarray(until.looks())[stop]
    out_within = (float(np.mean(~decided & (-until.value < lo) & (hi < until.value) & (stop < len(until.looks()) - 1)))
                  if until.rule == "decided" and until.value else None)
    out = {"rule": until.spec, "first": until.first, "max_replicas": until.max_replicas, "effect": effect,
           "look_levels": list(levels), "decided": float(decided.mean()),
           "mean_replicas": float(used.mean()), "coverage": float(np.mean((lo <= truth) & (truth <= hi))),
           "within": (float(np.mean(~decided & (-until.value < lo) & (hi < until.value)))
                      if until.rule == "decided" and until.value else None),
           "futile": (float(np.mean(~decided & (stop < len(until.looks()) - 1))) - (out_within or 0.0)
                      if until.rule == "decided" else None),
           "saved_against_max": 1 - float(used.mean()) / until.max_replicas}
    if effect and until.rule == "decided":
        sd = float(np.std(d[:, :until.max_replicas])) or 1.0
        target = min(out["decided"], POWER_CAP)
        fixed = S._smallest_n(lambda k: S._t_power(abs(truth) / sd * math.sqrt(k), k - 1, ALPHA / comparisons)
                              >= target, 10_000)
        out.update(fixed_same_power=fixed, saved=None if fixed is None else 1 - out["mean_replicas"] / fixed)
    return out
