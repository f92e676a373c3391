"""Memory mappings held by one process running several studies in a row, with and without
:func:`nondet_jax.study.memory.release_compiled` after each.

    python benchmarks/map_count.py [--studies 6] [--model mlp] [--out benchmarks/results/map_count.json]

Each study has different settings (the learning rate and width change), as a learning-rate sweep
through the library would; every study trains 2 replicas of one arm for 1 epoch on digits. The two
modes run in two fresh processes, side by side in one run of this script. The count is the number of
lines of ``/proc/self/maps`` after each study; the kernel's limit is ``vm.max_map_count``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, sys, tempfile
import jax
from nondet_jax.study import memory
from nondet_jax.config import from_flat
from nondet_jax.study.runner import run

release, studies, model = sys.argv[1] == "release", int(sys.argv[2]), sys.argv[3]
counts = [memory.map_count()]
with tempfile.TemporaryDirectory() as d:
    for i in range(studies):
        config = from_flat({"model.name": model, "train.epochs": 1, "train.batch_size": 256, "study.replicas": 2,
                            "study.arms": "init", "optim.lr": 0.01 * (i + 1), "model.width": 1 + 0.25 * i})
        run(config, f"{d}/s{i}", progress=False, log=lambda *a, **k: None)
        if release:
            memory.release_compiled()
        counts.append(memory.map_count())
print(json.dumps(counts))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--studies", type=int, default=6)
    p.add_argument("--model", default="mlp")
    p.add_argument("--out")
    args = p.parse_args()
    from nondet_jax.study.memory import max_map_count

    rows = {}
    for mode in ("keep", "release"):
        with tempfile.TemporaryDirectory() as cache:
            env = {"NONDET_JAX_COMPILE_CACHE": "off", "XDG_CACHE_HOME": cache}
            import os

            proc = subprocess.run([sys.executable, "-c", CHILD, mode, str(args.studies), args.model],
                                  capture_output=True, text=True, env={**os.environ, **env}, check=True)
        rows[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
        print(f"{mode:>8}: mappings after start and after each study: {rows[mode]}", flush=True)
    result = {"model": args.model, "studies": args.studies, "max_map_count": max_map_count(), "maps": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
