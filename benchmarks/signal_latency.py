"""How long a process takes to leave after SIGINT / SIGTERM arrives during an XLA compilation,
with and without :func:`nondet_jax.machine.signals.install`.

    python benchmarks/signal_latency.py [--modes on,off] [--ops 3000] [--delay 2] [--limit 600]

Each row is a fresh process that traces and compiles one program of ``--ops`` chained operations
(minutes of XLA:CPU compilation at 3000) and receives the signal ``--delay`` seconds after it
printed that it starts. Reported: exit status, seconds from the signal to the exit, whether the
compilation finished, and the last line of stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

CHILD = r"""
import sys
if sys.argv[1] == "on":
    from nondet_jax.machine import signals
    signals.install()
import jax, jax.numpy as jnp
def f(x):
    for i in range(int(sys.argv[2])):
        x = jnp.sin(x) * (i + 1) + jnp.cos(x @ x.T)
    return x
print("compiling", flush=True)
jax.jit(f).lower(jnp.ones((64, 64))).compile()
print("compiled", flush=True)
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", default="on,off")
    p.add_argument("--ops", type=int, default=3000)
    p.add_argument("--delay", type=float, default=2.0)
    p.add_argument("--limit", type=float, default=600.0)
    p.add_argument("--out")
    args = p.parse_args()
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    rows = []
    for mode in args.modes.split(","):
        for sig in (signal.SIGINT, signal.SIGTERM):
            proc = subprocess.Popen([sys.executable, "-c", CHILD, mode, str(args.ops)], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, env=env)
            proc.stdout.readline()
            time.sleep(args.delay)
            t0 = time.perf_counter()
            proc.send_signal(sig)
            try:
                out, err = proc.communicate(timeout=args.limit)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
            row = {"handler": mode, "signal": sig.name, "exit_status": proc.returncode,
                   "seconds_to_exit": round(time.perf_counter() - t0, 3), "compiled": "compiled" in out,
                   "stderr_last_line": (err.strip().splitlines() or [""])[-1][:100]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"ops": args.ops, "delay_s": args.delay, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
