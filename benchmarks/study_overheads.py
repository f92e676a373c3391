"""The default study's work beyond training, piece by piece: each piece timed as it runs now and as it ran before.

    python benchmarks/study_overheads.py [--rounds 5] [--out benchmarks/results/study_overheads.json]

Rows (median of ``--rounds``, seconds; the default study runs each piece as counted in the last column):

* ``spread tests``: the report's permutation spread tests of 6 arms x 2 scores at R=8, one
  :func:`nondet_jax.analysis.stats.spread_test` call each (before) against one
  :func:`~nondet_jax.analysis.stats.spread_tests` call (now); the p-values are checked equal.
* ``ratio design figure``: :func:`~nondet_jax.analysis.stats.replicas_for_ratio_interval` at 0.5 and 0.75 from a
  cold cache, with Bonett's kurtosis taking ``** 4`` (before) and squaring twice (now); the answers are checked equal.
* ``replicas of an epoch``: the 8 ResNet-8 (digits) replica states an epoch of the ``sequential`` strategy starts
  from, sliced out of the stacked state (before: ``replicas.loop._take``) against taken from the list the stack was
  made of (now); the default study has 84 such epochs.
* ``flag check``: the child process that checks the determinism flags (:func:`nondet_jax.machine.determinism.start_check`),
  which the CLI now runs while it imports the study (before: alone, first).

Prints a table and writes the JSON (machine, versions, every round).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from nondet_jax.store.io import atomic_write_json


def timed(fn, rounds: int) -> list[float]:
    out = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def spread_rows(rounds: int) -> dict:
    from nondet_jax.analysis import stats as S

    rng = np.random.default_rng(0)
    pairs = [(rng.normal(0, s, 8), rng.normal(0, 1, 8)) for s in np.linspace(0.5, 2.0, 12)]
    one = [S.spread_test(a, b) for a, b in pairs]
    assert one == S.spread_tests(pairs), "batched p-values differ"
    return {"before": timed(lambda: [S.spread_test(a, b) for a, b in pairs], rounds),
            "now": timed(lambda: S.spread_tests(pairs), rounds), "per_study": 1}


def ratio_rows(rounds: int) -> dict:
    from nondet_jax.analysis import stats as S

    def cold():
        S.replicas_for_ratio_interval.cache_clear()
        return S.replicas_for_ratio_interval(0.5), S.replicas_for_ratio_interval(0.75)

    now_answer, now = cold(), timed(cold, rounds)
    squared = S._fourth
    S._fourth = lambda x: ((x - S._trimmed_mean(x)[..., None]) ** 4).sum(-1)
    try:
        before_answer, before = cold(), timed(cold, rounds)
    finally:
        S._fourth = squared
        S.replicas_for_ratio_interval.cache_clear()
    assert now_answer == before_answer, (now_answer, before_answer)
    return {"before": before, "now": now, "per_study": 1}


def replica_rows(rounds: int) -> dict:
    import jax

    from nondet_jax.config import from_flat
    from nondet_jax.data import load_dataset
    from nondet_jax.replicas.loop import _stack, _take
    from nondet_jax.sources import arm_keys, arm_sources, perturbations, replica_slice
    from nondet_jax.train import DataSpec, make_train

    data = load_dataset("digits")
    fns = make_train(from_flat({"model.name": "resnet8"}),
                     DataSpec(len(data.x_train), tuple(data.x_train.shape[1:]), data.num_classes, data.name))
    keys, perturb = arm_keys(0, arm_sources("all"), 8), perturbations(arm_sources("all"))
    init = jax.jit(fns.init)
    replicas = [init(replica_slice(keys, r), perturb, jax.device_put(data.x_train[:1])) for r in range(8)]
    stacked = _stack(replicas)
    kept = {"stacked": stacked, "replicas": replicas}

    def sliced():
        return jax.block_until_ready([_take(stacked, r) for r in range(8)])

    def from_kept():
        return [kept["replicas"][r] if kept["stacked"] is stacked else _take(stacked, r) for r in range(8)]

    def same(x, y):  # bit for bit (the health record starts as NaN)
        x, y = np.asarray(x), np.asarray(y)
        return np.array_equal(x, y, equal_nan=np.issubdtype(x.dtype, np.floating))

    for a, b in zip(sliced(), from_kept()):
        assert all(same(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    return {"before": timed(sliced, rounds), "now": timed(from_kept, rounds), "per_study": 84}


def flag_rows(rounds: int) -> dict:
    from nondet_jax.machine import determinism as D

    def check():
        D._KNOWN.clear()
        D.start_check(D.DETERMINISM_ON)()

    old = os.environ.get(D.CACHE_ENV)
    os.environ[D.CACHE_ENV] = "off"  # asked every time, as in a cold run
    try:
        t = timed(check, rounds)
    finally:
        if old is None:
            os.environ.pop(D.CACHE_ENV)
        else:
            os.environ[D.CACHE_ENV] = old
    return {"before": t, "now": [0.0] * rounds, "per_study": 1,
            "note": "now: overlapped with the CLI's imports on the other core (its wall time, not added)"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results/study_overheads.json")
    args = ap.parse_args()
    rows = {"spread tests": spread_rows(args.rounds), "ratio design figure": ratio_rows(args.rounds),
            "replicas of an epoch": replica_rows(args.rounds), "flag check": flag_rows(args.rounds)}
    print(f"{'piece':<22} {'before s':>9} {'now s':>9} {'per study':>9} {'saved per study s':>18}")
    for name, r in rows.items():
        b, n = statistics.median(r["before"]), statistics.median(r["now"])
        r.update(before_median=b, now_median=n, saved_per_study=(b - n) * r["per_study"])
        print(f"{name:<22} {b:>9.4f} {n:>9.4f} {r['per_study']:>9} {r['saved_per_study']:>18.2f}")
    import jax
    import scipy

    atomic_write_json(Path(args.out), {
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "platform": platform.platform(), "python": sys.version.split()[0]},
        "load_average": os.getloadavg(), "versions": {"jax": jax.__version__, "scipy": scipy.__version__},
        "rounds": args.rounds, "rows": rows})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
