"""Compilation of a study with one arm against the same study with six: do the arms share their programs?

    python benchmarks/study_compile.py [--models mlp,resnet8] [--out benchmarks/results/study_compile.json]

For each model, two studies through ``nondet_jax.run_study`` on the embedded digits data (3 replicas, 1
epoch, LMC on one pair), each in a fresh Python process (no compiled program carried over, no persistent
cache): ``control`` alone and ``control,init,data_order,augmentation,bitflip,all``. Per study: the XLA
programs compiled (``jax.monitoring``'s backend-compile events), the seconds spent compiling them, and
the study's wall time; the ratio row divides the six-arm study's by the one-arm study's (target: compile
seconds <= 1.3x, issue 29).

    python benchmarks/study_compile.py --default-study 2 --out benchmarks/results/study_compile-default.json

instead runs the default study (``python -m nondet_jax.sweep``, its 7 arms of 8 replicas) for that many epochs,
cold (``--compile-cache off``, a fresh process), and gives the same three figures and compile's share of the wall
time (targets: at most 30 programs, at most 15% compile).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

from nondet_jax.store.io import atomic_write_json

CHILD = r"""
import json, sys, tempfile, time
import jax
import nondet_jax as nj
model, arms = sys.argv[1], sys.argv[2]
seconds = []
jax.monitoring.register_event_duration_secs_listener(
    lambda e, d, **k: seconds.append(d) if e == "/jax/core/compile/backend_compile_duration" else None)
t0 = time.perf_counter()
with tempfile.TemporaryDirectory() as out:
    nj.run_study(model=model, data="digits", epochs=1, batch_size=128, arms=arms, replicas=3, out=out,
                 settings={"metrics.lmc_pairs": 1, "data.augment": "on"}, log=lambda *a, **k: None)
print("RESULT " + json.dumps({"programs": len(seconds), "compile_s": sum(seconds), "wall_s": time.perf_counter() - t0}))
"""
ARMS = {"1 arm": "control", "6 arms": "control,init,data_order,augmentation,bitflip,all"}
DEFAULT_STUDY = r"""
import json, sys, tempfile, time
from nondet_jax.machine import signals
signals.install()
import logging, re
import jax
from nondet_jax.cli import sweep
seconds, by_program = [], {}
jax.monitoring.register_event_duration_secs_listener(
    lambda e, d, **k: seconds.append(d) if e == "/jax/core/compile/backend_compile_duration" else None)

class Compiles(logging.Handler):  # jax_log_compiles names each program: seconds per name
    def emit(self, record):
        m = re.search(r"Finished XLA compilation of (.+?) in ([0-9.e-]+) sec", record.getMessage())
        if m:
            n, s = by_program.get(m.group(1), (0, 0.0))
            by_program[m.group(1)] = (n + 1, s + float(m.group(2)))

jax.config.update("jax_log_compiles", True)
logging.getLogger("jax").addHandler(Compiles())
logging.getLogger("jax").propagate = False  # the names are collected, not printed
t0 = time.perf_counter()
with tempfile.TemporaryDirectory() as out:
    status = sweep.main(["--epochs", sys.argv[1], "--compile-cache", "off", "--no-progress", "--out", out + "/run"])
wall = time.perf_counter() - t0
print("RESULT " + json.dumps({"programs": len(seconds), "compile_s": sum(seconds), "wall_s": wall,
                              "compile_share": sum(seconds) / wall, "status": status,
                              "by_program": dict(sorted(by_program.items(), key=lambda kv: -kv[1][1]))}))
"""


def child_result(code: str, *args: str, env: dict) -> dict | None:
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not line:
        print(proc.stderr[-2000:], file=sys.stderr)
        return None
    return json.loads(line[-1][7:])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="mlp,resnet8")
    ap.add_argument("--default-study", type=int, metavar="EPOCHS",
                    help="only: the default study for EPOCHS epochs, cold (programs, compile s, wall s, share)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "study_compile.json")
    args = ap.parse_args(argv)
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    results = {"machine": {"platform": platform.platform(), "cpu_count": os.cpu_count()}, "models": {}}
    if args.default_study:
        r = child_result(DEFAULT_STUDY, str(args.default_study), env=env)
        if r is None:
            return 1
        print(f"default study, {args.default_study} epochs, cold: {r['programs']} programs, {r['compile_s']:.1f} s "
              f"compiling of {r['wall_s']:.1f} s ({r['compile_share']:.0%})")
        for name, (count, secs) in list(r.get("by_program", {}).items())[:8]:
            print(f"  {secs:6.2f} s  {count:3d}x  {name}")
        results["default_study"] = {"epochs": args.default_study, **r}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(args.out, results)
        print(f"wrote {args.out}")
        return 0
    print(f"{'model':10s} {'study':8s} {'programs':>9s} {'compile s':>10s} {'wall s':>8s}")
    for model in args.models.split(","):
        rows = {}
        for label, arms in ARMS.items():
            r = rows[label] = child_result(CHILD, model, arms, env=env)
            if r is None:
                return 1
            print(f"{model:10s} {label:8s} {r['programs']:9d} {r['compile_s']:10.1f} {r['wall_s']:8.1f}")
        ratio = {k: rows["6 arms"][k] / rows["1 arm"][k] for k in ("programs", "compile_s", "wall_s")}
        print(f"{model:10s} {'ratio':8s} {ratio['programs']:9.2f} {ratio['compile_s']:10.2f} {ratio['wall_s']:8.2f}")
        results["models"][model] = {**rows, "ratio_6_to_1": ratio}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out, results)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
