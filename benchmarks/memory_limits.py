"""What the memory checks rest on: a study's peak memory beyond its RSS at the check (the working
allowance ``nondet_jax.study.memory.WORKING_BYTES``), and ``compare``'s peak on two 20,000-run CSV files.

Each measurement runs in a fresh process (peak RSS from ``resource.getrusage``). Prints a table and
writes benchmarks/results/memory_limits.json.

    python benchmarks/memory_limits.py [--models mlp resnet8]
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results" / "memory_limits.json"

STUDY = """
import resource, sys
import nondet_jax.study.prepare as prepare
checked = {}
original = prepare.check_fits
def spy(*a, **k):
    checked.update(original(*a, **k))
    checked["rss_at_check"] = int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) * 1024
    return checked
prepare.check_fits = spy
from nondet_jax.cli import sweep
assert sweep.main(sys.argv[1:]) == 0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print({"estimate": checked["total"], "rss_at_check": checked["rss_at_check"], "peak": peak})
"""

COMPARE = """
import resource, sys
from nondet_jax.cli import compare
compare.main(sys.argv[1:])
print({"peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024})
"""


def last_dict(stdout: str) -> dict:
    return eval(stdout.strip().splitlines()[-1])  # noqa: S307  (our own child's printed dict)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["mlp", "resnet8"])
    p.add_argument("--rows", type=int, default=20_000)
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            proc = subprocess.run([sys.executable, "-c", STUDY, "--model", model, "--epochs", "1", "--replicas", "2",
                                   "--arms", "control", "--no-progress", "--out", f"{tmp}/{model}"],
                                  capture_output=True, text=True, check=True)
            r = last_dict(proc.stdout)
            rows.append({"what": f"study: {model}, 2 replicas, 1 epoch on digits", **r,
                         "beyond_check": r["peak"] - r["rss_at_check"]})
        import numpy as np

        rng = np.random.default_rng(0)
        for name, shift in (("a.csv", 0.0), ("b.csv", 0.001)):
            np.savetxt(f"{tmp}/{name}", rng.normal(0.9 + shift, 0.01, args.rows), header="accuracy", comments="")
        proc = subprocess.run([sys.executable, "-c", COMPARE, f"{tmp}/a.csv", f"{tmp}/b.csv"], capture_output=True,
                              text=True, check=True)
        rows.append({"what": f"compare: two CSV files of {args.rows:,} runs", **last_dict(proc.stdout)})
    print(f"{'measurement':<46}{'RSS at check':>14}{'peak RSS':>12}{'beyond check':>14}")
    for r in rows:
        at = f"{r['rss_at_check'] / 1e6:.0f} MB" if "rss_at_check" in r else "-"
        beyond = f"{r['beyond_check'] / 1e6:.0f} MB" if "beyond_check" in r else "-"
        print(f"{r['what']:<46}{at:>14}{r['peak'] / 1e6:>9.0f} MB{beyond:>14}")
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps({"machine": platform.processor() or platform.machine(), "rows": rows}, indent=2) + "\n")
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
