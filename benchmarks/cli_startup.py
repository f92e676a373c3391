"""What a refused argument costs, and what the XLA-flag check costs asked afresh against remembered.

Each command is run with one bad argument (the one-line error, exit 2) ``--repeats`` times in fresh processes;
the table gives the median wall and CPU seconds (user + system of the child) and the modules it imported that
a refusal should never need (jax, flax, scipy). Then ``check_flags`` of the determinism flags in a fresh
process, with its memory of accepted flag sets empty (a throw-away child asks jaxlib) and with it filled (a
file beside the compilation cache answers).

    python benchmarks/cli_startup.py --out benchmarks/results/cli_startup.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REFUSALS = {  # command -> a refused argument (each exits 2 with one line)
    "sweep --arms control,nosuch": ["-m", "nondet_jax.sweep", "--arms", "control,nosuch"],
    "sweep --set train.epochs=0": ["-m", "nondet_jax.sweep", "--set", "train.epochs=0"],
    "sweep --resume (no run folder)": ["-m", "nondet_jax.sweep", "--resume", "/nonexistent/run"],
    "report (no run folder)": ["-m", "nondet_jax", "report", "/nonexistent/run"],
    "audit --steps 0": ["-m", "nondet_jax", "audit", "--steps", "0"],
    "compare --plot x.txt": ["-m", "nondet_jax", "compare", "a.csv", "b.csv", "--plot", "x.txt"],
}
HEAVY = ("jax", "flax", "scipy")
PROBE = "import sys, runpy; sys.argv = {argv!r}; sys.path.insert(0, {root!r})\n" \
        "try:\n    runpy.run_module({module!r}, run_name='__main__')\n" \
        "except SystemExit as e:\n    code = e.code\nelse:\n    code = 0\n" \
        "print('HEAVY', ','.join(m for m in {heavy!r} if m in sys.modules), file=sys.stderr)\nsys.exit(code)\n"


def timed(cmd: list[str], env: dict) -> tuple[float, float, subprocess.CompletedProcess]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tempfile.gettempdir())
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), proc


def refusals(repeats: int, env: dict) -> list[dict]:
    rows = []
    for name, args in REFUSALS.items():
        module, argv = args[1], [args[1], *args[2:]]
        probe = PROBE.format(argv=argv, root=str(ROOT), module=module, heavy=HEAVY)
        walls, cpus, proc = [], [], None
        for _ in range(repeats):
            wall, cpu, proc = timed([sys.executable, "-c", probe], env)
            walls.append(wall)
            cpus.append(cpu)
        lines = proc.stderr.strip().splitlines()
        heavy = next((ln.split(" ", 1)[1] if " " in ln else "" for ln in lines if ln.startswith("HEAVY")), "?")
        errors = [ln for ln in lines if not ln.startswith("HEAVY")]
        rows.append({"command": name, "exit": proc.returncode, "error": errors[-1] if errors else "",
                     "wall_s": statistics.median(walls), "cpu_s": statistics.median(cpus),
                     "heavy_imports": [m for m in heavy.split(",") if m]})
    return rows


def flag_check(repeats: int, env: dict) -> dict:
    """check_flags(DETERMINISM_ON) in a fresh process: its memory empty, then filled (a file beside the cache)."""
    code = ("import time; from nondet_jax.machine import determinism as D; t = time.perf_counter(); "
            "D.check_flags(D.DETERMINISM_ON); print(time.perf_counter() - t)")
    out = {}
    with tempfile.TemporaryDirectory() as cache:
        env = {**env, "NONDET_JAX_COMPILE_CACHE": cache, "PYTHONPATH": str(ROOT)}
        for label in ("asked afresh", "remembered"):
            walls, cpus = [], []
            for _ in range(repeats):
                if label == "asked afresh":
                    for f in Path(cache).rglob("*.ok"):
                        f.unlink()
                wall, cpu, proc = timed([sys.executable, "-c", code], env)
                assert proc.returncode == 0, proc.stderr[-2000:]
                walls.append(float(proc.stdout.strip().splitlines()[-1]))
                cpus.append(cpu)
            out[label] = {"check_s": statistics.median(walls), "process_cpu_s": statistics.median(cpus)}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/cli_startup.json"))
    args = p.parse_args(argv)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    rows = refusals(args.repeats, env)
    print(f"{'refused argument':<34} {'exit':>4} {'wall s':>7} {'CPU s':>6}  heavy imports")
    for r in rows:
        print(f"{r['command']:<34} {r['exit']:>4} {r['wall_s']:>7.2f} {r['cpu_s']:>6.2f}  "
              f"{','.join(r['heavy_imports']) or 'none'}")
    flags = flag_check(args.repeats, env)
    for label, r in flags.items():
        print(f"check_flags, {label:<13} {r['check_s']:>6.2f} s in the process ({r['process_cpu_s']:.2f} CPU-s "
              "for the whole process)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {"benchmark": "cli_startup", "machine": os.uname().machine, "cpu_count": os.cpu_count(),
              "load_before": os.getloadavg(), "refusals": rows, "check_flags": flags}
    args.out.write_text(json.dumps(record, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
