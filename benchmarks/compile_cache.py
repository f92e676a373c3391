"""Time to first step with JAX's persistent compilation cache off, cold and warm.

    python benchmarks/compile_cache.py [--model resnet8] [--out benchmarks/results/compile_cache.json]

Each row is a fresh Python process (as a user's second run would be):

* ``first step s``: from process start to the end of the first training epoch of one replica
  (imports, data, tracing, compiling init and the epoch, running it) via the library;
* ``sweep s``: wall time of a whole ``python -m nondet_jax.sweep`` study (2 arms x 2 replicas,
  1 epoch), the CLI's own cache setting (``--compile-cache``);
* ``new cache files``: entries the run added to the cache (0 = it compiled nothing new).

Settings: ``off``; ``cold`` (an empty cache folder); ``warm`` (the folder the cold run filled).
Ratios are measured side by side in one run of this script.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = r"""
import sys, time
t0 = float(sys.argv[1])
from nondet_jax.cli.sweep import enable_compile_cache
enable_compile_cache(sys.argv[2])
import jax, jax.numpy as jnp
from nondet_jax.config import from_flat
from nondet_jax.data import load_dataset
from nondet_jax.sources import one_replica
from nondet_jax.train import DataSpec, make_train
d = load_dataset("digits")
c = from_flat({"model.name": sys.argv[3], "data.augment": "on", "data.flip": "off"})
fns = make_train(c, DataSpec(len(d.x_train), d.x_train.shape[1:], d.num_classes, d.name))
k, p = one_replica("all")
state = jax.jit(fns.init)(k, p, d.x_train[:1])
state, m = jax.jit(fns.train_epoch)(state, d.x_train, d.y_train, k, p, jnp.int32(0))
jax.block_until_ready(m)
print("FIRST", time.time() - t0)
"""


def files(folder: Path) -> int:
    return sum(1 for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet8")
    ap.add_argument("--out", default="benchmarks/results/compile_cache.json")
    args = ap.parse_args()
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "cache"
        for setting in ("off", "cold", "warm"):
            value = "off" if setting == "off" else str(cache)
            before = files(cache)
            proc = subprocess.run([sys.executable, "-c", CHILD, str(time.time()), value, args.model],
                                  capture_output=True, text=True, env=env)
            first = float([ln for ln in proc.stdout.splitlines() if ln.startswith("FIRST")][0].split()[1])
            t = time.perf_counter()
            sweep = subprocess.run([sys.executable, "-m", "nondet_jax.sweep", "--model", args.model, "--epochs", "1",
                                    "--replicas", "2", "--arms", "control,init", "--no-progress",
                                    "--out", str(Path(tmp) / f"run_{setting}"), "--compile-cache", value],
                                   capture_output=True, text=True, env=env)
            assert sweep.returncode == 0, sweep.stderr[-2000:]
            rows.append({"cache": setting, "first_step_s": round(first, 2),
                         "sweep_s": round(time.perf_counter() - t, 2), "new_cache_files": files(cache) - before})
    off = rows[0]
    print(f"{'cache':<6}{'first step s':>14}{'sweep s':>10}{'new cache files':>17}{'first step vs off':>19}")
    for r in rows:
        print(f"{r['cache']:<6}{r['first_step_s']:>14.1f}{r['sweep_s']:>10.1f}{r['new_cache_files']:>17}"
              f"{off['first_step_s'] / r['first_step_s']:>18.2f}x")
    import platform

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"machine": platform.processor() or platform.machine(),
                                          "cpus": os.cpu_count(), "model": args.model, "rows": rows}, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
