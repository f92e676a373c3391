"""Hardware nondeterminism on one GPU: its spread, the cost of XLA's determinism flags, the audit.

Three parts, each in its own processes (XLA flags are read when a backend starts):

1. **spread**: ``python -m nondet_jax.sweep --arms control,hardware`` on the embedded digits with
   ResNet-14: ``control`` runs with XLA's determinism flags on, ``hardware`` (every seed fixed
   too) in a child process with them off. Reports each arm's accuracy std, whether its replicas
   are bitwise identical, and their disagreement.
2. **cost**: steady-state step time of ResNet-14 and ResNet-18 (CIFAR stem) at batch 128 and
   512 on synthetic 32x32x3 images, once in a process with the determinism flags on and once
   with them off; the ratio is the price of determinism. Skipped on CPU (the flags are GPU flags).
3. **audit**: ``python -m nondet_jax audit`` on ResNet-14: N steps twice, per-tensor ulp
   differences, with the default flags and with determinism on.

Usage (about 6-8 minutes on one H200; ``--quick`` for a smoke run anywhere)::

    python benchmarks/determinism_gpu.py [--quick] [--out benchmarks/results/determinism_gpu.json]

Prints a table per part and writes everything to the JSON file, with the machine's environment.
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

COST_MODELS = ("resnet14", "resnet18")
COST_BATCHES = (128, 512)


def sh(args: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env={**os.environ, **(env or {})})


def part_spread(quick: bool, tmp: Path) -> dict:
    out = tmp / "spread"
    r, epochs = ("4", "2") if quick else ("8", "6")
    proc = sh(["-m", "nondet_jax.sweep", "--arms", "control,hardware", "--model", "resnet14", "--replicas", r,
               "--epochs", epochs, "--out", str(out), "--no-progress", "--set", "metrics.lmc_pairs=0"])
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1:]}
    summary = json.loads((out / "summary.json").read_text())
    rows = {}
    for arm, a in summary["arms"].items():
        m = a["metrics"]
        rows[arm] = {"replicas": a["replicas"], "accuracy_mean": m["accuracy"]["mean"], "accuracy_std": m["accuracy"]["std"],
                     "accuracy_std_ci": m["accuracy"]["std_ci"], "cross_entropy_std": m["cross_entropy"]["std"],
                     "disagreement": m.get("disagreement", {}).get("mean"),
                     "bitwise_identical": a["replicas_bitwise_identical"],
                     "xla_flags": json.loads((out / ("environments/hardware.json" if arm == "hardware" else
                                                     "environment.json")).read_text())["xla_flags"]}
    return {"arms": rows, "vs_all": summary["vs_all"], "backend": summary["backend"]}


def timing_child(steps: int) -> None:
    """In a child: step time per (model, batch) under this process's flags; prints JSON."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from nondet_jax.config import from_flat
    from nondet_jax.sources import one_replica
    from nondet_jax.train import DataSpec, make_train

    out = {}
    for model in COST_MODELS:
        for batch in COST_BATCHES:
            n = steps * batch
            x = jnp.asarray(np.random.default_rng(0).normal(size=(n, 32, 32, 3)).astype(np.float32))
            y = jnp.asarray(np.arange(n) % 10, dtype=jnp.int32)
            config = from_flat({"model.name": model, "train.batch_size": batch, "train.epochs": 1,
                                "metrics.pairwise": False, "study.replicas": 1})
            fns = make_train(config, DataSpec(n, (32, 32, 3), 10, "synthetic"))
            keys, p = one_replica("control")
            epoch = jax.jit(fns.train_epoch)
            state = jax.jit(fns.init)(keys, p, x[:1])
            t0 = time.perf_counter()
            state, m = epoch(state, x, y, keys, p, jnp.int32(0))
            jax.block_until_ready(m)
            compile_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            for e in range(1, 3):
                state, m = epoch(state, x, y, keys, p, jnp.int32(e))
            jax.block_until_ready(m)
            step_ms = (time.perf_counter() - t0) / (2 * steps) * 1000
            out[f"{model}/b{batch}"] = {"step_ms": step_ms, "images_per_s": batch / step_ms * 1000,
                                        "first_epoch_s": compile_s}
    print("TIMING " + json.dumps({"xla_flags": os.environ.get("XLA_FLAGS", ""), "results": out}))


def part_cost(quick: bool) -> dict:
    from nondet_jax.machine.determinism import (
        DETERMINISM_OFF,
        DETERMINISM_ON,
        with_flags,
    )

    steps = "3" if quick else "20"
    res = {}
    for name, flags in (("determinism_on", DETERMINISM_ON), ("determinism_off", DETERMINISM_OFF)):
        proc = sh([__file__, "--timing-child", steps], {"XLA_FLAGS": with_flags(flags)})
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("TIMING ")]
        if proc.returncode != 0 or not line:
            return {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1]}
        res[name] = json.loads(line[0][len("TIMING "):])
    ratios = {k: res["determinism_on"]["results"][k]["step_ms"] / v["step_ms"]
              for k, v in res["determinism_off"]["results"].items()}
    return {**res, "step_time_ratio_on_over_off": ratios}


def part_audit(quick: bool, tmp: Path) -> dict:
    out = tmp / "audit.json"
    proc = sh(["-m", "nondet_jax", "audit", "--steps", "2" if quick else "5", "--model", "resnet14", "--json", str(out)])
    if not out.exists():
        return {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1], "exit_status": proc.returncode}
    runs = json.loads(out.read_text())["runs"]
    return {"exit_status": proc.returncode,
            "runs": {k: {f: v[f] for f in ("xla_flags", "backend", "declared_deterministic", "elements", "differ",
                                           "max_ulp", "bitwise_identical")} for k, v in runs.items()},
            "report": proc.stdout}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default="benchmarks/results/determinism_gpu.json")
    p.add_argument("--parts", default="spread,cost,audit", help="which parts to run, in this order")
    p.add_argument("--timing-child", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    parts = args.parts.split(",")
    if set(parts) - {"spread", "cost", "audit"}:
        p.error(f"unknown parts {sorted(set(parts) - {'spread', 'cost', 'audit'})}; use spread, cost, audit")
    if args.timing_child:
        timing_child(args.timing_child)
        return 0
    import jax

    from nondet_jax.machine.determinism import NONDETERMINISTIC_BACKENDS, environment
    from nondet_jax.store.io import atomic_write_json

    backend = jax.default_backend()
    result: dict = {"environment": environment(), "quick": args.quick, "skipped": {}}
    t0 = time.perf_counter()
    save = lambda: atomic_write_json(Path(args.out), {**result, "seconds": time.perf_counter() - t0})  # noqa: E731
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if "spread" in parts:
            print("== spread: control (determinism on) vs hardware (off)", flush=True)
            result["spread"] = part_spread(args.quick, tmp)
            for arm, r in result["spread"].get("arms", {}).items():
                print(f"  {arm:<9} R={r['replicas']} acc {r['accuracy_mean'] * 100:.2f}% "
                      f"std {r['accuracy_std'] * 100:.3f}% CE std {r['cross_entropy_std']:.5f} "
                      f"disagreement {r['disagreement']} bitwise identical {r['bitwise_identical']}", flush=True)
            save()
        if "cost" in parts and backend in NONDETERMINISTIC_BACKENDS:
            print("== cost of the determinism flags (steady step time)", flush=True)
            result["cost"] = part_cost(args.quick)
            for k, ratio in result["cost"].get("step_time_ratio_on_over_off", {}).items():
                on = result["cost"]["determinism_on"]["results"][k]["step_ms"]
                off = result["cost"]["determinism_off"]["results"][k]["step_ms"]
                print(f"  {k:<16} on {on:8.2f} ms  off {off:8.2f} ms  ratio {ratio:.3f}", flush=True)
            save()
        elif "cost" in parts:
            result["skipped"]["cost"] = f"the determinism flags are GPU flags: no effect on {backend}"
            print(f"== cost: skipped ({result['skipped']['cost']})")
        if "audit" in parts:
            print("== audit", flush=True)
            result["audit"] = part_audit(args.quick, tmp)
            print(result["audit"].get("report") or result["audit"], flush=True)
    result["seconds"] = time.perf_counter() - t0
    atomic_write_json(Path(args.out), result)
    print(f"wrote {args.out} in {result['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
