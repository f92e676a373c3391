"""The test suite's slowest tests and its total, from pytest's own durations: what a change added to CI.

Runs the suite (or reads the log of a run made with ``--durations=0``), sums each test's setup, call and
teardown, and prints the ``--top`` slowest tests, the per-file totals and the whole: the test seconds (the
sum over workers) and the wall seconds pytest reported.

    python benchmarks/suite_durations.py --out benchmarks/results/suite_durations.json            # the whole suite
    python benchmarks/suite_durations.py --from-log pytest.log                                      # a finished run
    python benchmarks/suite_durations.py --pytest-args "tests/test_stats.py -n 0" --top 10
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINE = re.compile(r"^\s*(\d+(?:\.\d+)?)s\s+(setup|call|teardown)\s+(\S.*?)\s*$")
SUMMARY = re.compile(r"^=*\s*(\d+ (?:passed|failed).*?) in (\d+(?:\.\d+)?)s")


def parse(log: str) -> tuple[dict[str, float], float | None, str]:
    """Test id -> seconds (setup + call + teardown), pytest's wall seconds, its final summary line."""
    per_test: dict[str, float] = defaultdict(float)
    for line in log.splitlines():
        m = LINE.match(line)
        if m:
            per_test[m.group(3)] += float(m.group(1))
    wall, summary = None, ""
    for line in log.splitlines():
        m = SUMMARY.search(line)
        if m and ("passed" in m.group(1) or "failed" in m.group(1)):
            wall, summary = float(m.group(2)), m.group(1)
    return dict(per_test), wall, summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--from-log", type=Path, help="read a finished run's output instead of running the suite")
    p.add_argument("--pytest-args", default="", help="extra pytest arguments (quoted), e.g. a file or -n 0")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/suite_durations.json"))
    args = p.parse_args(argv)
    if args.from_log:
        log, elapsed = args.from_log.read_text(errors="replace"), None
    else:
        cmd = [sys.executable, "-m", "pytest", "-q", "--durations=0", "--durations-min=0",
               *shlex.split(args.pytest_args)]
        t = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        elapsed = time.perf_counter() - t
        log = proc.stdout + proc.stderr
    per_test, wall, summary = parse(log)
    if not per_test:
        print("no durations found: run pytest with --durations=0", file=sys.stderr)
        return 1
    per_file: dict[str, float] = defaultdict(float)
    for test, s in per_test.items():
        per_file[test.split("::")[0]] += s
    top = sorted(per_test.items(), key=lambda kv: -kv[1])[: args.top]
    total = sum(per_test.values())
    print(f"{'seconds':>8}  {args.top} slowest tests")
    for test, s in top:
        print(f"{s:>8.1f}  {test}")
    print(f"\n{'seconds':>8}  per file")
    for f, s in sorted(per_file.items(), key=lambda kv: -kv[1]):
        print(f"{s:>8.1f}  {f}")
    print(f"\n{len(per_test)} tests, {total:.0f} test-seconds; pytest's wall time "
          f"{'n/a' if wall is None else f'{wall:.0f} s'} ({summary or 'no summary line'})")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"benchmark": "suite_durations", "tests": len(per_test), "test_seconds": total,
                                    "pytest_wall_s": wall, "elapsed_s": elapsed, "summary": summary,
                                    "slowest": [{"test": t, "s": s} for t, s in top],
                                    "per_file": dict(sorted(per_file.items(), key=lambda kv: -kv[1]))}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
