"""Rolled vs unrolled epoch scan on XLA:CPU (the reason for ``train.scan_unroll``).

XLA:CPU runs convolutions inside a while-loop body on a slower path than straight-line code
(jax#12868). This times one training epoch of the default study's model (ResNet-8, digits,
batch 128: 11 steps) with ``train.unroll=1`` (a rolled ``lax.scan``: a while loop) and with
``train.unroll=0`` (auto: fully unrolled on CPU), compile time and steady epoch seconds, each in
a fresh process so neither benefits from the other's compilation.

    python benchmarks/scan_unroll.py [--epochs 4] [--out benchmarks/results/scan_unroll.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def child(unroll: int, epochs: int) -> dict:
    import jax
    import jax.numpy as jnp

    from nondet_jax.config import from_flat
    from nondet_jax.data import load_dataset
    from nondet_jax.sources import one_replica
    from nondet_jax.train import DataSpec, make_train

    d = load_dataset("digits")
    config = from_flat({"train.unroll": unroll, "train.epochs": epochs})
    fns = make_train(config, DataSpec(len(d.x_train), tuple(d.x_train.shape[1:]), d.num_classes, d.name))
    keys, p = one_replica("control")
    x, y = jnp.asarray(d.x_train), jnp.asarray(d.y_train)
    state = jax.jit(fns.init)(keys, p, x[:1])
    t0 = time.perf_counter()
    epoch = jax.jit(fns.train_epoch).lower(state, x, y, keys, p, jnp.int32(0)).compile()
    compile_s = time.perf_counter() - t0
    times = []
    for e in range(epochs):
        t0 = time.perf_counter()
        state, m = epoch(state, x, y, keys, p, jnp.int32(e))
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t0)
    return {"unroll": fns.unroll, "steps_per_epoch": fns.steps_per_epoch, "compile_s": compile_s,
            "epoch_s": times, "steady_epoch_s": min(times[1:]) if len(times) > 1 else times[0],
            "backend": jax.default_backend()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--out", default="benchmarks/results/scan_unroll.json")
    p.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child is not None:
        print("RESULT " + json.dumps(child(args.child, args.epochs)))
        return 0
    rows = {}
    for name, unroll in (("rolled", 1), ("auto", 0)):
        proc = subprocess.run([sys.executable, __file__, "--child", str(unroll), "--epochs", str(args.epochs)],
                              capture_output=True, text=True, check=True)
        rows[name] = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][0][7:])
    print(f"{'scan':<8} {'unroll':>6} {'compile s':>10} {'steady epoch s':>15}")
    for name, r in rows.items():
        print(f"{name:<8} {r['unroll']:>6} {r['compile_s']:>10.1f} {r['steady_epoch_s']:>15.3f}")
    ratio = rows["rolled"]["steady_epoch_s"] / rows["auto"]["steady_epoch_s"]
    print(f"rolled / auto steady epoch time: {ratio:.1f}x ({rows['auto']['backend']})")
    from nondet_jax.store.io import atomic_write_json

    atomic_write_json(Path(args.out), {"rows": rows, "ratio_rolled_over_auto": ratio})
    return 0


if __name__ == "__main__":
    sys.exit(main())
