"""k methods that differ only in the learning rate: trained batched (one set of programs per arm) against
trained one after another (each method its own programs), wall time of the whole sweep.

    python benchmarks/batched_methods.py --out benchmarks/results/batched_methods.json

Runs ``python -m nondet_jax sweep --method m0: --method m1:optim.lr=... ...`` in fresh processes with the
persistent compilation cache off (every run compiles what it needs, as a first run does), alternating
``--batch-methods`` and without, ``--rounds`` times. Prints each run's wall seconds and the median ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LRS = (0.05, 0.1, 0.02, 0.2, 0.01, 0.3, 0.03, 0.15)


def sweep(out: Path, args, batched: bool) -> float:
    methods = [a for i in range(args.k) for a in ("--method", f"m{i}:" + (f"optim.lr={LRS[i]}" if i else ""))]
    cmd = [sys.executable, "-m", "nondet_jax", "sweep", "--model", args.model, "--epochs", str(args.epochs),
           "--replicas", str(args.replicas), "--arms", args.arms, "--batch-size", str(args.batch_size),
           "--no-progress", "--compile-cache", "off", "--set", "train.checkpoint_every=0", *methods, "--out", str(out)]
    t = time.perf_counter()
    proc = subprocess.run(cmd + (["--batch-methods"] if batched else []), capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(proc.stderr[-2000:])
    return time.perf_counter() - t


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="mlp")
    p.add_argument("--k", type=int, default=4, help="methods (learning rates)")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--arms", default="control,all")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/batched_methods.json"))
    args = p.parse_args(argv)
    if not 2 <= args.k <= len(LRS):
        raise SystemExit(f"--k between 2 and {len(LRS)}")
    rows: dict[str, list[float]] = {"separate": [], "batched": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            for label in rows:
                rows[label].append(sweep(Path(tmp) / f"{i}-{label}", args, label == "batched"))
                print(f"round {i + 1}: {label:<9} {rows[label][-1]:6.1f} s", flush=True)
    med = {k: statistics.median(v) for k, v in rows.items()}
    print(f"\n{'methods':<9}{'separate s':>12}{'batched s':>11}{'ratio':>8}   ({args.model}, {args.replicas} replicas, "
          f"{args.epochs} epochs, arms {args.arms}, cache off, median of {args.rounds})")
    print(f"{args.k:<9}{med['separate']:>12.1f}{med['batched']:>11.1f}{med['separate'] / med['batched']:>7.2f}x")
    result = {"k": args.k, "model": args.model, "replicas": args.replicas, "epochs": args.epochs, "arms": args.arms,
              "batch_size": args.batch_size, "rounds": rows, "median_s": med,
              "speedup": med["separate"] / med["batched"], "machine": platform.processor() or platform.machine(),
              "cpus": os.cpu_count(), "command": " ".join([Path(sys.argv[0]).as_posix(), *(argv or sys.argv[1:])])}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
