"""What ``nondet_jax.replicate`` costs as its batches grow: its wall time (compile and run, 2 replicas of a
linear least-squares model, 50 steps) beside the same computation jitted by hand with the batches as an
argument and with the batches closed over (XLA embeds closed-over arrays in the program as constants, which is
what ``replicate`` did before its batches became an argument).

    python benchmarks/replicate_batches.py --out benchmarks/results/replicate_batches.json

Each row is the median of ``--rounds`` rounds, the three forms interleaved in each round, every one compiled
afresh (the compilation cache is off in this process). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import nondet_jax as nj  # noqa: E402  (after the checkout is put on sys.path)
from nondet_jax.store.io import atomic_write_json  # noqa: E402
from nondet_jax.study.identity import platform_identity  # noqa: E402

STEPS, FEATURES = 50, 64


def init(keys):
    return jax.random.normal(keys.init, (FEATURES,))


def step(w, b, keys):
    return w - 1e-3 * (b["x"].T @ (b["x"] @ w - b["y"])) / b["x"].shape[0]


def _by_hand(batches, closed: bool):
    def one(key, bt):
        return jax.lax.scan(lambda w, b: (step(w, b, None), None), jax.random.normal(key, (FEATURES,)), bt)[0]

    keys = jax.random.split(jax.random.key(0), 2)
    if closed:
        return jax.jit(jax.vmap(lambda k: one(k, batches)))(keys)
    return jax.jit(jax.vmap(one, in_axes=(0, None)))(keys, batches)


FORMS = {"replicate": lambda b: nj.replicate(init, step, b, arms="init", replicas=2, strategy="vmap")["init"],
         "by hand, batches an argument": lambda b: _by_hand(b, closed=False),
         "by hand, batches closed over": lambda b: _by_hand(b, closed=True)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[32, 2048, 8192], help="examples per step")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "replicate_batches.json")
    args = p.parse_args(argv)
    jax.config.update("jax_enable_compilation_cache", False)
    rows = []
    print(f"{'batches MB':>10} " + " ".join(f"{name:>30}" for name in FORMS))
    for size in args.batch:
        rng = np.random.default_rng(0)
        batches = {"x": rng.normal(size=(STEPS, size, FEATURES)).astype(np.float32),
                   "y": rng.normal(size=(STEPS, size)).astype(np.float32)}
        times: dict[str, list[float]] = {name: [] for name in FORMS}
        for _ in range(args.rounds):
            for name, form in FORMS.items():
                jax.clear_caches()
                t = time.perf_counter()
                jax.block_until_ready(form(batches))
                times[name].append(time.perf_counter() - t)
        mb = (batches["x"].nbytes + batches["y"].nbytes) / 1e6
        row = {"batch": size, "batches_mb": round(mb, 1), **{n: statistics.median(v) for n, v in times.items()}}
        rows.append(row)
        print(f"{mb:>10.1f} " + " ".join(f"{row[n]:>29.2f}s" for n in FORMS))
    machine = {k: v for k, v in platform_identity().items() if k != "sha256"}
    atomic_write_json(args.out, {"machine": machine, "cores": os.cpu_count(), "jax": jax.__version__,
                                 "steps": STEPS, "features": FEATURES, "rounds": args.rounds, "rows": rows})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
