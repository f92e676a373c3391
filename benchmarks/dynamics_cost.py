"""What watching replicas 0 and 1 costs a study, and whether the trace is the arm's own pair.

    python benchmarks/dynamics_cost.py --out benchmarks/results/dynamics_cost.json

Runs ``python -m nondet_jax.sweep --model resnet8 --epochs 2 --replicas 4 --arms control,bitflip`` (digits) in
fresh processes with the compilation cache off, alternating ``study.dynamics_every=K`` (watched) and no
dynamics, ``--rounds`` times. Prints each run's wall seconds and the bitflip arm's own training seconds, and
checks the watched trace against the arm's own epoch-end weight distance of replicas 0 and 1
(``history/bitflip.npz``): the relative difference at every epoch end the trace holds.

``--repo DIR`` runs the same command in another checkout (e.g. ``git worktree add /tmp/old 7b4261d``, where the
dynamics trained the pair again, vmapped) for a side-by-side comparison in one run.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def sweep(repo: Path, out: Path, every: int) -> dict:
    args = [sys.executable, "-m", "nondet_jax.sweep", "--model", "resnet8", "--epochs", "2", "--replicas", "4",
            "--arms", "control,bitflip", "--compile-cache", "off", "--no-progress", "--out", str(out)]
    if every:
        args += ["--set", f"study.dynamics_every={every}"]
    t = time.perf_counter()
    proc = subprocess.run(args, capture_output=True, text=True, cwd=repo)
    if proc.returncode:
        raise SystemExit(proc.stderr[-2000:])
    wall = time.perf_counter() - t
    record = json.loads((out / "arms" / "bitflip.json").read_text())
    row = {"wall_s": round(wall, 2), "bitflip_arm_s": record["seconds"]}
    if every:
        with np.load(out / "dynamics" / "bitflip.npz") as trace, np.load(out / "history" / "bitflip.npz") as history:
            own = history["weight_distance"][1:, 0]  # replicas 0 and 1 after each epoch
            steps = np.shape(history["step_loss"])[1] // len(own)  # per epoch
            at = {int(s): d for s, d in zip(trace["step"], trace["weight_distance"])}
            rel = [abs(at[(e + 1) * steps] - own[e]) / own[e] for e in range(len(own)) if (e + 1) * steps in at]
        row.update(rate_per_step=record["dynamics"]["rate_per_step"],
                   trace_vs_own_max_rel=max(rel) if rel else None, epoch_ends_compared=len(rel))
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--every", type=int, default=1, help="study.dynamics_every of the watched runs")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--repo", type=Path, action="append", default=[],
                   help="another checkout to run beside this one (repeatable)")
    p.add_argument("--out", type=Path, help="write the table as JSON here")
    args = p.parse_args(argv)
    repos = [ROOT, *args.repo]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for repo in repos:
                for every in (args.every, 0):
                    row = {"repo": str(repo), "round": r, "every": every,
                           **sweep(repo, Path(tmp) / f"{len(rows)}", every)}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    print(f"\n{'repo':<40} {'dynamics_every':>14} {'median wall s':>14} {'bitflip arm s':>14} {'trace vs own':>13}")
    for repo in repos:
        for every in (args.every, 0):
            sel = [x for x in rows if x["repo"] == str(repo) and x["every"] == every]
            rel = [x["trace_vs_own_max_rel"] for x in sel if x.get("trace_vs_own_max_rel") is not None]
            print(f"{str(repo)[-40:]:<40} {every or 'off':>14} {statistics.median(x['wall_s'] for x in sel):>14.1f} "
                  f"{statistics.median(x['bitflip_arm_s'] for x in sel):>14.2f} "
                  f"{(f'{max(rel):.1e}' if rel else '-'):>13}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"machine": {"platform": platform.platform(), "processor": platform.processor()},
                                        "command": "python benchmarks/dynamics_cost.py " + " ".join(argv or sys.argv[1:]),
                                        "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
