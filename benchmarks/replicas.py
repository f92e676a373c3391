"""Replica throughput of the execution strategies, and of one fresh process per replica.

What it measures
----------------
*Replica-images per second*: replicas x training images processed / wall seconds, for R
replicas of one arm (``all``: every source varied, seed 0, so replica r is the same model under
every strategy) trained with each strategy on two workloads, batch 128:

* ``resnet14``: ResNet-14 on synthetic 32x32x3 images (standard normal pixels, uniform labels,
  10 classes, 256 test images; augmentation off, as for any data set but CIFAR);
* ``digits``: the default study, ResNet-8 on the embedded digits data (1,437 train images 8x8x1,
  11 steps per epoch; ``--quick``: its first 2 batches).

Strategies:

* ``vmap`` and ``sequential`` (:mod:`nondet_jax.replicas`), run in this process;
* ``peer``: what the seed papers' scripts do, one fresh Python process per replica. The parent
  launches ``python benchmarks/replicas.py --peer-child WORKLOAD --replica r`` for r = 0, 1, ...
  one after another; each child imports, loads the data, compiles and trains ONE replica for the
  same epochs. Its time is the parent's wall clock around the children, so it INCLUDES process
  start, imports and compilation: that is the point. The peer row for R sums the walls of the
  first R children. The children are independent and identical in work, so to bound the run
  only ``--peer-children`` of them are launched (full default 2); a larger R is charged R x their
  mean wall and is marked ``*`` in the table (``children_measured`` < R in the JSON).
  ``--peer-children 8`` measures every peer row.

How the in-process numbers are split
------------------------------------
Each in-process measurement starts from ``jax.clear_caches()`` (every row pays its own
compilation, as a fresh study would) and timestamps every epoch with the ``progress`` callback of
``run_replicas``. The first epoch of each program run (sequential: of each replica; vmap: of the
one batched program) holds the compilation; the later epochs are the steady state:

* ``steady img/s``: replica-images of the non-first epochs / their seconds;
* ``compile s``: wall seconds - (epochs run) x (mean steady epoch seconds): compiling init,
  train-epoch and evaluate, plus running init and evaluate (small);
* ``e2e img/s``: R x epochs x images per epoch / wall seconds, compilation included: the figure to
  compare with ``peer``, which in addition pays process start, imports and data loading
  (``process_overhead_s`` in its JSON rows);
* ``vs peer``: e2e img/s / peer's e2e img/s at the same R.

The peer row's ``compile s`` and ``steady img/s`` come from the same split inside its children.

Also recorded: ``resolve_strategy("auto", R)`` per R; the largest absolute difference between the
vmap and sequential final test logits at each R both ran (the same replicas, so it is the
floating-point rounding of the batched program, amplified by every training step after it: 0 at
R=1, where both run the same computation); ``determinism.environment()``; and the load average
before and after (another process sharing the CPU slows every row).

Command lines
-------------
::

    python benchmarks/replicas.py            # full: R = 1,4,8; about 11-13 min on 2 CPU cores
    python benchmarks/replicas.py --quick    # smoke test: R = 2, 2 steps per epoch, 2 epochs
    python benchmarks/replicas.py --replicas 1,4 --strategies vmap,sequential --workloads digits \\
        --out /tmp/replicas.json

Reading the result
------------------
One row per (workload, strategy, R). ``steady img/s`` compares the compiled programs; ``e2e
img/s`` and ``vs peer`` compare what a user waits for. Compilation dominates these short runs, so
e2e favours whatever compiles least: ``sequential`` compiles one single-replica program for any R,
``vmap`` one program per R, ``peer`` one per child. On XLA:CPU ``vmap`` turns each convolution into
a grouped convolution, and at R > 1 its steady state is slower than ``sequential`` (several times
for the 32x32 ResNet-14), which is why ``auto`` picks ``sequential`` there. Rows are noisy when
another process shares the CPU: compare ``load_average`` in the JSON. JSON:
``benchmarks/results/replicas.json`` (``--quick``: ``replicas-quick.json``) by default.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np

from nondet_jax.config import from_flat
from nondet_jax.data import Dataset, load_dataset
from nondet_jax.machine.determinism import environment
from nondet_jax.replicas.choice import run_replicas
from nondet_jax.replicas.rule import resolve_strategy
from nondet_jax.sources import ReplicaKeys, arm_keys, arm_sources, perturbations
from nondet_jax.store.io import atomic_write_json
from nondet_jax.train import DataSpec, TrainFns, make_train

BATCH = 128
SEED = 0
ARM = "all"
SYNTHETIC_TEST = 256  # test images of the synthetic workload
IN_PROCESS = ("vmap", "sequential")
STRATEGIES = IN_PROCESS + ("peer",)
WORKLOADS = ("resnet14", "digits")
RESULTS = Path(__file__).resolve().parent / "results"


@dataclasses.dataclass(frozen=True)
class Workload:
    """One benchmark workload: a model, a data set and how long to train."""

    name: str
    model: str
    epochs: int
    steps: int | None  # training steps per epoch; None: the whole data set (digits only)


@dataclasses.dataclass(frozen=True)
class Mode:
    """A benchmark design: the workloads, the replica counts and how many peer children to launch."""

    workloads: dict[str, Workload]
    replicas: tuple[int, ...]
    peer_children: int


# Every in-process row pays its own compilation (15-45 s per row on 2 CPU cores) and vmapped
# ResNet-14 steps are slow on CPU: these bound the designs (2 epochs: one compile, one steady).
MODES = {
    "quick": Mode({"resnet14": Workload("resnet14", "resnet14", epochs=2, steps=2),
                   "digits": Workload("digits", "resnet8", epochs=2, steps=2)},
                  replicas=(2,), peer_children=1),
    "full": Mode({"resnet14": Workload("resnet14", "resnet14", epochs=2, steps=2),
                  "digits": Workload("digits", "resnet8", epochs=3, steps=None)},
                 replicas=(1, 4, 8), peer_children=2),
}


def load_data(w: Workload) -> Dataset:
    """The workload's data: digits (its first ``steps`` batches if set) or synthetic images."""
    if w.name == "digits":
        d = load_dataset("digits")
        n = len(d.x_train) if w.steps is None else w.steps * BATCH
        return d._replace(x_train=d.x_train[:n], y_train=d.y_train[:n])
    rng = np.random.default_rng(SEED)
    n = w.steps * BATCH
    images = lambda k: rng.standard_normal((k, 32, 32, 3), dtype=np.float32)  # noqa: E731
    labels = lambda k: rng.integers(0, 10, k).astype(np.int32)  # noqa: E731
    return Dataset("synthetic", images(n), labels(n), images(SYNTHETIC_TEST), labels(SYNTHETIC_TEST), 10)


def build(w: Workload) -> tuple[TrainFns, Dataset]:
    """The single-replica training functions and the data of a workload."""
    data = load_data(w)
    config = from_flat({"model.name": w.model, "train.batch_size": BATCH, "train.epochs": w.epochs})
    spec = DataSpec(len(data.x_train), tuple(data.x_train.shape[1:]), data.num_classes, data.name)
    return make_train(config, spec), data


def replica_keys(first: int, count: int) -> ReplicaKeys:
    """Keys of replicas first..first+count-1 of the benchmark arm (the same under every strategy)."""
    keys = arm_keys(SEED, arm_sources(ARM), first + count)
    return jax.tree.map(lambda k: k[first:], keys)


def timed_run(w: Workload, fns: TrainFns, data: Dataset, strategy: str, first: int,
              count: int) -> tuple[dict, np.ndarray]:
    """Train ``count`` replicas from a cold jit cache; returns (timings row, final test logits)."""
    jax.clear_caches()
    keys, perturb = replica_keys(first, count), perturbations(arm_sources(ARM))
    stamps = [time.perf_counter()]
    result = run_replicas(fns, keys, perturb, data, w.epochs, strategy,
                          progress=lambda n: stamps.append(time.perf_counter()))
    wall = time.perf_counter() - stamps[0]
    epochs = np.diff(stamps).reshape(-1, w.epochs)  # one row per program run: vmap 1, sequential R
    steady = epochs[:, 1:]
    images = fns.steps_per_epoch * BATCH
    per_program_epoch = count // len(epochs)  # replicas trained by one program epoch
    row = {
        "workload": w.name, "strategy": strategy, "replicas": count,
        "epochs": w.epochs, "steps_per_epoch": fns.steps_per_epoch, "images_per_epoch": images,
        "wall_s": wall,
        "steady_s": float(steady.sum()),
        "compile_s": wall - epochs.size * float(steady.mean()),
        "steady_rate": per_program_epoch * images * steady.size / float(steady.sum()),
        "e2e_rate": count * w.epochs * images / wall,
    }
    return row, result.logits


def run_peer_child(w: Workload, replica: int) -> None:
    """Body of one ``--peer-child`` process: train one replica, print its timings as JSON."""
    fns, data = build(w)
    row, _ = timed_run(w, fns, data, "sequential", replica, 1)
    print(json.dumps(row))


def launch_children(w: Workload, count: int, quick: bool) -> tuple[list[float], list[dict]]:
    """Run ``count`` peer children one after another; their wall seconds and their own timings."""
    walls, children = [], []
    for r in range(count):
        cmd = [sys.executable, __file__, "--peer-child", w.name, "--replica", str(r)] + ["--quick"] * quick
        t0 = time.perf_counter()
        out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True)
        walls.append(time.perf_counter() - t0)
        children.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return walls, children


def peer_rows(w: Workload, replicas: list[int], n_children: int, quick: bool) -> list[dict]:
    """One row per R: the first R children's walls summed, or, beyond the ``n_children`` children
    launched, R x their mean wall (``children_measured`` < R)."""
    walls, children = launch_children(w, min(n_children, max(replicas)), quick)
    images = children[0]["images_per_epoch"]
    rows = []
    for count in replicas:
        m = min(count, len(walls))
        scale = count / m
        wall = sum(walls[:m]) * scale
        steady_s = sum(c["steady_s"] for c in children[:m]) * scale
        rows.append({
            "workload": w.name, "strategy": "peer", "replicas": count,
            "epochs": w.epochs, "steps_per_epoch": children[0]["steps_per_epoch"], "images_per_epoch": images,
            "wall_s": wall,
            "steady_s": steady_s,
            "compile_s": float(np.mean([c["compile_s"] for c in children[:m]])),  # per child
            "steady_rate": count * (w.epochs - 1) * images / steady_s,
            "e2e_rate": count * w.epochs * images / wall,
            # process start, imports, data loading and make_train, summed over the R children
            "process_overhead_s": (sum(walls[:m]) - sum(c["wall_s"] for c in children[:m])) * scale,
            "children_measured": m,
        })
    return rows


def in_process_rows(w: Workload, strategies: list[str], replicas: list[int]) -> tuple[list[dict], dict]:
    """Rows of the in-process strategies, and the max |vmap - sequential| test logit per R."""
    fns, data = build(w)
    rows, logits = [], {}
    for strategy in strategies:
        for count in replicas:
            row, logits[strategy, count] = timed_run(w, fns, data, strategy, 0, count)
            rows.append(row)
            print(f"  {w.name} {strategy} R={count}: {row['wall_s']:.1f} s", flush=True)
    diffs = {str(r): float(np.abs(logits["vmap", r] - logits["sequential", r]).max())
             for r in replicas if ("vmap", r) in logits and ("sequential", r) in logits}
    return rows, diffs


def add_speedups(rows: list[dict]) -> None:
    """Set each row's end-to-end speedup over the peer row of the same workload and R (None if absent)."""
    peer = {(r["workload"], r["replicas"]): r["e2e_rate"] for r in rows if r["strategy"] == "peer"}
    for r in rows:
        base = peer.get((r["workload"], r["replicas"]))
        r["speedup_vs_peer"] = None if base is None else r["e2e_rate"] / base


def format_table(rows: list[dict]) -> str:
    """The result table (plain text)."""
    head = (f"{'workload':<9} {'strategy':<10} {'R':>3} {'compile s':>9} {'steady img/s':>12} "
            f"{'e2e img/s':>10} {'vs peer':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        speedup = "-" if r["speedup_vs_peer"] is None else f"{r['speedup_vs_peer']:.2f}x"
        star = "*" if r.get("children_measured", r["replicas"]) < r["replicas"] else ""
        lines.append(f"{r['workload']:<9} {r['strategy']:<10} {str(r['replicas']) + star:>3} {r['compile_s']:>9.1f} "
                     f"{r['steady_rate']:>12.1f} {r['e2e_rate']:>10.1f} {speedup:>7}")
    lines += ["img/s: replica-images per second; e2e: including compilation (peer: also process start, imports);",
              "vs peer: e2e img/s over peer's at the same R; peer compile s: per child;",
              "*: peer wall = R x the mean wall of the children launched (--peer-children)"]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict:
    """Run every requested measurement, print the table and write the JSON; returns the record."""
    chosen = MODES[args.mode].workloads
    load_before = os.getloadavg()
    rows, diffs = [], {}
    for name in args.workloads:
        w = chosen[name]
        print(f"{name}: {w}", flush=True)
        if "peer" in args.strategies:
            rows += peer_rows(w, args.replicas, args.peer_children, args.quick)
            print(f"  {name} peer: {rows[-1]['children_measured']} children, {rows[-1]['wall_s']:.1f} s "
                  f"(R={rows[-1]['replicas']})", flush=True)
        in_process = [s for s in args.strategies if s in IN_PROCESS]
        if in_process:
            w_rows, diffs[name] = in_process_rows(w, in_process, args.replicas)
            rows += w_rows
    add_speedups(rows)
    record = {
        "benchmark": "replicas",
        "mode": args.mode,
        "command": [Path(sys.executable).name] + sys.argv,
        "batch_size": BATCH, "arm": ARM, "seed": SEED,
        "workloads": {n: dataclasses.asdict(chosen[n]) for n in args.workloads},
        "peer_children": args.peer_children,
        "auto": {str(r): dict(zip(("strategy", "reason"), resolve_strategy("auto", r))) for r in args.replicas},
        "logits_max_abs_diff_vmap_vs_sequential": diffs,
        "load_average": {"before": load_before, "after": os.getloadavg()},
        "environment": environment(),
        "rows": rows,
    }
    print(format_table(rows))
    for r, auto in record["auto"].items():
        print(f"auto R={r}: {auto['strategy']} ({auto['reason']})")
    print(f"max |vmap - sequential| final test logit, per workload and R: {json.dumps(diffs)}")
    atomic_write_json(args.out, record)
    print(f"wrote {args.out}")
    return record


def _csv(kind: type, allowed: tuple | None = None):
    """argparse type: a comma-separated list of ``kind``, each in ``allowed`` if given (ints >= 1)."""
    def parse(text: str) -> list:
        try:
            items = [kind(t.strip()) for t in text.split(",") if t.strip()]
        except ValueError:
            items = []
        bad = [i for i in items if (i not in allowed if allowed else i < 1)]
        if not items or bad:
            raise argparse.ArgumentTypeError(f"bad value {text!r}; use {', '.join(allowed or ['integers >= 1'])}")
        return items
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Replica throughput: vmap vs sequential vs one process per replica.")
    p.add_argument("--quick", action="store_true", help="smoke test: R=2, 2 steps per epoch, 2 epochs, 1 peer child")
    p.add_argument("--out", type=Path, help="JSON output (default benchmarks/results/replicas.json; "
                                            "--quick: replicas-quick.json)")
    p.add_argument("--replicas", type=_csv(int), help="replica counts (default 1,4,8; --quick 2)")
    p.add_argument("--strategies", type=_csv(str, STRATEGIES), default=list(STRATEGIES),
                   help=f"default {','.join(STRATEGIES)}")
    p.add_argument("--workloads", type=_csv(str, WORKLOADS), default=list(WORKLOADS),
                   help=f"default {','.join(WORKLOADS)}")
    p.add_argument("--peer-children", type=int, help="peer processes actually launched; larger R are "
                                                     "extrapolated (default 2; --quick 1)")
    p.add_argument("--peer-child", metavar="WORKLOAD", help=argparse.SUPPRESS)
    p.add_argument("--replica", type=int, default=0, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.mode = "quick" if args.quick else "full"
    mode = MODES[args.mode]
    if args.peer_child:
        run_peer_child(mode.workloads[args.peer_child], args.replica)
        return 0
    args.replicas = sorted(set(args.replicas or mode.replicas))
    if args.peer_children is None:
        args.peer_children = mode.peer_children
    if args.peer_children < 1:
        parser.error("--peer-children must be >= 1")
    args.out = args.out or RESULTS / ("replicas-quick.json" if args.mode == "quick" else "replicas.json")
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
