"""How much of the run-to-run variance each source contributes: the one-source-at-a-time design.

The study's arms vary one source each (``init``, ``data_order``, ...: that source drawn afresh per
replica, every other one at a single shared draw) and ``all`` varies every source. Write σ²_s for the
variance over replicas of a score (test accuracy, cross-entropy, ...) in the arm of source s and σ²_all
for the ``all`` arm's. Source s's **share** is σ²_s / σ²_all, and

    non-additivity = 1 − Σ_s σ²_s / σ²_all.

If the sources' effects added up independently (Y = μ + Σ_s g_s(u_s) + noise, a random-effects model
with independent effects), Var(all) = Σ_s σ²_s: the shares sum to 1 and the non-additivity is 0. It is
negative when each source alone already produces much of the total spread (their effects overlap, as
when any perturbation is amplified by training into the same chaotic divergence: Summers & Dinneen's
finding) and positive when sources only produce spread together (an interaction), or when ``all`` varies a
source no one-source arm measures (``unmeasured``: its spread is in Var(all) and in no share). What this design
cannot tell apart: which pairs of sources interact (a factorial design over them can), and how σ²_s
depends on the draw at which the other sources are held (it is measured at one draw of each).

Intervals: each share is the square of the std ratio's interval (``stats.std_ratio_ci``) and, as the arm
shares its seeds with the reference (replica r of both has the same keys for the sources the arm does not
vary), of the paired one (``stats.paired_ratio_ci``: ``paired_ci``, narrower when the pairs correlate); the
sum of the shares, and so the non-additivity, has ``stats.variance_sum_ratio_ci``'s (arms taken as
independent: conservative when they share seeds); all are simulated in ``nondet_jax.analysis.coverage``.
"""

from __future__ import annotations

import numpy as np

from nondet_jax.analysis import stats as S
from nondet_jax.analysis.task import QUANTITIES, task_of
from nondet_jax.arms import one_source_arms, parse_arm


def _scores(record: dict, row: str) -> np.ndarray:
    return np.array([r[row] for r in record["rows"] if r.get("diverged_at_step", -1) < 0], np.float64)


def _by_replica(record: dict, row: str) -> dict:
    return {r["replica"]: r[row] for r in record["rows"] if r.get("diverged_at_step", -1) < 0 and "replica" in r}


def decompose(records: dict[str, dict], reference: str = "all", quantities=None, own: tuple[str, ...] = (),
              inactive=()) -> dict:
    """Per score of the task (or of ``quantities``), each one-source arm's variance share of the
    ``reference`` arm's with its interval, their sum and the non-additivity 1 − sum with theirs, and
    ``unmeasured``: the sources the reference varies that no one-source arm measures (less ``inactive``, those
    the study does not use), whose spread lands in the non-additivity. Empty without the reference arm or a
    one-source arm. ``own``: sources of the user's own (``replicate``)."""
    singles = one_source_arms(records, reference, own)
    if reference not in records or not singles:
        return {}
    measured = set().union(*(parse_arm(a, own).varied for a in singles))
    unmeasured = sorted(parse_arm(reference, own).varied - measured - set(inactive))
    out = {}
    for q in quantities or QUANTITIES[task_of(records[reference])]:
        ref = _scores(records[reference], q.row)
        res = (records[reference].get("metrics") or {}).get(q.name, {}).get("resolution")
        xs = {a: _scores(records[a], q.row) for a in singles}
        v_ref = S.std(ref) ** 2
        shares = {}
        for a, x in xs.items():
            lo, hi = S.std_ratio_ci(x, ref, resolution=res)
            shares[a] = {"share": float(S.std(x) ** 2 / v_ref) if v_ref > 0 else float("nan"),
                         "ci": [float(lo) ** 2, float(hi) ** 2], "replicas": len(x)}
            pa, pr = _by_replica(records[a], q.row), _by_replica(records[reference], q.row)
            common = sorted(set(pa) & set(pr))
            px, py = np.array([pa[r] for r in common]), np.array([pr[r] for r in common])
            if len(common) >= S.MIN_REPLICAS["paired_ratio"] and np.ptp(px) > 0 and np.ptp(py) > 0:  # tied: "ci" only
                plo, phi = S.paired_ratio_ci(px, py)
                shares[a]["paired_ci"] = [float(plo) ** 2, float(phi) ** 2]
        lo, hi = S.variance_sum_ratio_ci(list(xs.values()), ref, resolution=res)
        total = sum(s["share"] for s in shares.values())
        out[q.name] = {"shares": shares, "sum": total, "sum_ci": [float(lo), float(hi)],
                       "non_additivity": 1 - total, "non_additivity_ci": [1 - float(hi), 1 - float(lo)],
                       "reference_replicas": len(ref), "unmeasured": unmeasured}
    return out
