"""What checkpointing costs a study of short epochs: the same study with a checkpoint every epoch and without.

    python benchmarks/checkpoint_cost.py --out benchmarks/results/checkpoint_cost.json

Runs ``python -m nondet_jax.sweep --epochs 6 --arms control,init`` (the default preset's ResNet-8 on digits, 8
replicas) in fresh processes, alternating ``train.checkpoint_seconds=0`` (a checkpoint at every epoch, what every
study did before the setting existed) and ``train.checkpoint_every=0`` (none), after one warm-up run that fills
the persistent compilation cache. Prints each round's wall seconds and the cost per save, (with - without) /
saves, median over rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SETTINGS = {"every epoch": "train.checkpoint_seconds=0", "none": "train.checkpoint_every=0"}


def sweep(out: Path, setting: str, epochs: int, arms: str) -> float:
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "nondet_jax.sweep", "--epochs", str(epochs), "--arms", arms,
                           "--no-progress", "--set", setting, "--out", str(out)], capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(proc.stderr[-2000:])
    return time.perf_counter() - t


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--arms", default="control,init")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/checkpoint_cost.json"))
    args = p.parse_args(argv)
    saves = args.epochs * len(args.arms.split(","))
    rows = {label: [] for label in SETTINGS}
    with tempfile.TemporaryDirectory() as tmp:
        sweep(Path(tmp) / "warm", SETTINGS["none"], args.epochs, args.arms)  # fills the compilation cache
        for i in range(args.rounds):
            for label, setting in SETTINGS.items():
                rows[label].append(sweep(Path(tmp) / f"{i}-{label.replace(' ', '_')}", setting, args.epochs, args.arms))
                print(f"round {i + 1}: checkpoints {label:<11} {rows[label][-1]:6.1f} s", flush=True)
    per_save = statistics.median((a - b) / saves for a, b in zip(rows["every epoch"], rows["none"]))
    print(f"{saves} saves per study: {per_save:.2f} s per save (median over {args.rounds} rounds)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"benchmark": "checkpoint_cost", "epochs": args.epochs, "arms": args.arms,
                                    "saves": saves, "wall_s": rows, "seconds_per_save": per_save,
                                    "cpu_count": os.cpu_count(), "load_after": os.getloadavg()}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
