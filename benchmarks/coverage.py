"""Simulated coverage of every interval nondet_jax prints, at R=4, 8 and 12 (nominal 95%).

For each case of :data:`nondet_jax.analysis.coverage.CASES` (an interval, its method and a data model with a
known true value), draws ``--trials`` seeded simulated studies per replica count and prints the
fraction whose interval contains the truth. Writes benchmarks/results/coverage.json.

Run ``python benchmarks/coverage.py [--trials 4000]`` (a few seconds).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from nondet_jax.analysis import coverage  # noqa: E402  (after the checkout is put on sys.path)
from nondet_jax.analysis.stats import METHODS  # noqa: E402
from nondet_jax.store.io import atomic_write_json  # noqa: E402


def percentile_bootstrap(statistic: str, replicas: int, trials: int, seed: int, resamples: int = 1000) -> float:
    """Coverage of the percentile bootstrap the report used before (replaced): normal data, 95% nominal."""
    rng = np.random.default_rng(seed)
    x = rng.normal(0.0, 1.0, (trials, replicas))
    idx = rng.integers(0, replicas, (resamples, replicas))
    boot = x[:, idx]  # (trials, resamples, R)
    values = boot.std(-1, ddof=1) if statistic == "std" else boot.mean(-1)
    lo, hi = np.quantile(values, [0.025, 0.975], axis=1)
    truth = 1.0 if statistic == "std" else 0.0
    return float(np.mean((lo <= truth) & (truth <= hi)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=4000)
    p.add_argument("--replicas", type=int, nargs="+", default=[4, 8, 12])
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "coverage.json")
    args = p.parse_args(argv)
    rows = []
    print(f"{'interval':<36}" + "".join(f"{'R=' + str(r):>8}" for r in args.replicas) + "  data model; method")
    for name, (kind, model, _) in coverage.CASES.items():
        cov = {str(r): coverage.simulate(name, r, args.trials, seed=r) for r in args.replicas}
        rows.append({"interval": name, "kind": kind, "method": METHODS[kind], "data_model": model, "coverage": cov})
        print(f"{name:<36}" + "".join(f"{100 * c:>7.1f}%" for c in cov.values()) + f"  {model}; {METHODS[kind]}")
    before = []
    for statistic in ("std", "mean"):
        cov = {str(r): percentile_bootstrap(statistic, r, args.trials, seed=r) for r in args.replicas}
        before.append({"interval": statistic, "method": "percentile bootstrap, 1000 resamples (replaced)",
                       "data_model": "normal", "coverage": cov})
        print(f"{statistic + ' (percentile bootstrap, before)':<36}" + "".join(f"{100 * c:>7.1f}%" for c in cov.values()))
    atomic_write_json(args.out, {"nominal": 0.95, "trials": args.trials, "rows": rows, "replaced": before})
    print(f"{args.trials} simulated studies per cell; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
