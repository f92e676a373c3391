"""Replica-images/s of each way to train R replicas, on a study-like run, against a real loop and a ceiling.

Each candidate trains R replicas of one model for ``--epochs`` epochs of ``--steps`` steps (batch 128,
augmentation on, random inputs), and is timed per epoch after the first (which compiles; its excess over
the median is the compile time). The epoch has the shape a study gives it on this backend
(``train.epoch_shape`` and ``train.unroll`` auto: on CPU stepped from Python, a rolled ``lax.scan``
elsewhere), unless a candidate names another. Candidates:

* ``loop``: the ``sequential`` strategy, R single-replica epochs run one after another: the loop a study
  really runs (the baseline every ratio is taken against);
* ``loop:unroll=K``: the same as one scan with K steps unrolled per iteration (``train.unroll = K``; 1 = rolled);
* ``loop:step``: the same loop with each epoch driven step by step from Python (``train.epoch_shape = step``:
  one jitted step, asynchronous dispatch, no scan: the epoch shape that does not grow with the steps per epoch);
* ``ceiling``: one replica at batch R x 128 (the same work as R replicas, the stock kernels for dense
  convolutions): what batching R replicas could reach at best;
* ``vmap:<per-role>``: the ``vmap`` strategy with the replica-batched convolutions forced per role
  (``NONDET_JAX_VMAP_CONV`` syntax with ``=`` for ``:`` and ``+`` for ``,``, e.g. ``vmap:rhs=bgc``,
  ``vmap:rhs=shifted+fwd=map`` or ``vmap:grouped``; ``vmap`` alone: the
  measured table);
* ``unrolled``: the R single-replica epochs inside one jitted program.

Per row: median seconds per epoch, replica-images/s, the ratio to ``loop`` (measured in the same
process), the fraction of the ceiling's replica-images/s, and the fraction of the roofline (XLA's own
FLOP and byte counts of one training step against the chip's peaks, ``--peak-tflops``/``--peak-gbs``;
n/a where no peak is given); compile seconds; the process's peak device memory so far where the backend
reports it; and whether R replicas with identical keys come out bitwise identical (replica-position
invariance, which a candidate must pass before ``auto`` may choose it).

Every candidate runs under the control arm's determinism flags (what a study runs: the headline) and, with
``--flags determinism,default``, again under XLA's defaults, each set in a child process of its own. The
JSON is written before the first row (``"status": "running"``) and after every row; a run cut by SIGINT or
SIGTERM (a time box) keeps its rows and is marked ``"status": "interrupted"``. ``--profile DIR`` traces one
more epoch of each candidate (or of ``--profile-candidates``) and adds the trace's ten longest kernels.

    python benchmarks/replica_speed.py --model resnet14 --replicas 16 --dtype bfloat16 --out r.json
    python benchmarks/replica_speed.py --model mlp --replicas 2 --steps 16 --epochs 2   # the smallest run
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

BATCH = 128
DEFAULT_CANDIDATES = "loop,ceiling,vmap:grouped,vmap:rhs=bgc,vmap:rhs=map,unrolled"
PEAKS = {  # dense peaks per chip (NVIDIA's datasheet): TFLOP/s by compute dtype, and HBM GB/s
    "H200": {"bfloat16": 989.0, "float32": 494.0, "gbs": 4800.0},  # float32 = TF32 tensor cores
    "H100": {"bfloat16": 989.0, "float32": 494.0, "gbs": 3350.0},
}


def _spec(candidate: str) -> tuple[str, str | None, int | str]:
    """(kind, forced convolution for vmap, epoch shape: 0 = the study's, K = steps unrolled, "step")."""
    kind, _, rest = candidate.partition(":")
    if kind == "loop" and rest:
        if rest == "step":
            return kind, None, "step"
        if rest.startswith("unroll=") and rest[7:].isdigit() and int(rest[7:]) > 0:
            return kind, None, int(rest[7:])
        raise SystemExit(f"unknown loop variant {candidate!r}: use loop, loop:step or loop:unroll=K (K >= 1)")
    return kind, rest.replace("=", ":").replace("+", ",") or None, 0


def top_kernels(trace_dir, count: int = 10) -> list[dict]:
    """The ``count`` longest kernels of a ``jax.profiler`` trace (its Chrome-trace JSON): device events
    where the trace has a device (GPU/TPU), else the host's XLA threads; total ms, calls, share of the total."""
    import gzip
    from collections import Counter

    files = sorted(Path(trace_dir).rglob("*.trace.json.gz"))
    if not files:
        return []
    events = json.loads(gzip.open(files[-1]).read())
    events = events["traceEvents"] if isinstance(events, dict) else events
    procs = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    device = {pid for pid, name in procs.items() if "/device:" in name}

    def kept(e):
        if device:
            return e["pid"] in device
        return ("XLA" in threads.get((e["pid"], e.get("tid")), "") and not e["name"].startswith(("$", "ThunkExecutor")))

    total, calls = Counter(), Counter()
    for e in events:
        if e.get("ph") == "X" and "dur" in e and kept(e):
            total[e["name"]] += e["dur"]
            calls[e["name"]] += 1
    whole = sum(total.values()) or 1.0
    return [{"kernel": k[:200], "ms": us / 1e3, "calls": calls[k], "share": us / whole}
            for k, us in total.most_common(count)]


def child(args) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from nondet_jax.config import from_flat
    from nondet_jax.models import convs
    from nondet_jax.replicas.choice import make_strategy
    from nondet_jax.sources import arm_keys, arm_sources, perturbations, replica_slice
    from nondet_jax.train import DataSpec, make_train

    r_count, steps = args.replicas, args.steps
    shape = (args.image, args.image, 3) if args.model != "mlp" else (8, 8, 1)
    device = jax.devices()[0]
    kind = next((k for k in PEAKS if k in device.device_kind), None)
    peak_tflops = args.peak_tflops or (PEAKS[kind][args.dtype] if kind else None)
    peak_gbs = args.peak_gbs or (PEAKS[kind]["gbs"] if kind else None)
    varied = arm_sources("all")
    perturb = perturbations(varied)
    rows = []

    def build(batch: int, n: int, epoch: int | str):
        flat = {"model.name": args.model, "train.batch_size": batch, "train.epochs": args.epochs,
                "data.augment": "on" if args.model != "mlp" else "off", "model.dtype": args.dtype,
                # 0: the study's own shape on this backend (train.epoch_shape and train.unroll auto)
                "train.unroll": epoch if isinstance(epoch, int) else 0,
                "train.epoch_shape": "step" if epoch == "step" else "scan" if epoch else "auto"}
        fns = make_train(from_flat(flat), DataSpec(n, shape, 10, "random"))
        rng = np.random.default_rng(0)  # every candidate trains on the same data (the ceiling on more of it)
        x = jnp.asarray(rng.standard_normal((n, *shape), dtype=np.float32))
        y = jnp.asarray(rng.integers(0, 10, n).astype(np.int32))
        return fns, x, y

    def step_cost(fns, x, y, keys, batched: bool):
        """XLA's FLOP and byte count of one training step (whole R replicas when batched)."""
        state = jax.jit(jax.vmap(fns.init, in_axes=(0, None, None)))(keys, perturb, x[:1]) if batched else \
            jax.jit(fns.init)(replica_slice(keys, 0), perturb, x[:1])
        idx = jnp.arange(fns.batch_size)
        fn = fns.train_step
        if batched:
            fn = jax.vmap(fn, in_axes=(0, None, None, 0, None, None, None, None))
            ks = keys
        else:
            ks = replica_slice(keys, 0)
        lowered = jax.jit(fn).lower(state, x, y, ks, perturb, jnp.int32(0), jnp.int32(0), idx)
        try:  # the unoptimised program's count: no compile (a GPU compile with autotuning costs seconds)
            cost = lowered.cost_analysis()
        except Exception:  # noqa: BLE001 - a backend without it: the compiled program's
            cost = None
        cost = (cost[0] if isinstance(cost, list) else cost) or {}
        if not cost.get("flops"):  # XLA:GPU's lowered count was empty on jax 0.11.2 (an H200): compile
            cost = lowered.compile().cost_analysis()
            cost = (cost[0] if isinstance(cost, list) else cost) or {}
        return float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0))

    profiled = set(args.profile_candidates.split(",")) if args.profile_candidates else None
    for cand in args.candidates.split(","):
        kind_, conv, shape_ = _spec(cand)
        batch = BATCH * r_count if kind_ == "ceiling" else BATCH
        width = 1 if kind_ == "ceiling" else r_count
        fns, x, y = build(batch, steps * batch, shape_)
        keys = arm_keys(0, varied, width)
        strategy_name = {"loop": "sequential", "ceiling": "sequential"}.get(kind_, kind_)
        row = {"candidate": cand, "strategy": strategy_name, "conv": conv, "replicas": r_count, "steps": steps,
               "batch": batch, "dtype": args.dtype, "model": args.model,
               "epoch_shape": "step" if fns.epoch_shape == "step" else f"scan, {fns.unroll} of {steps} steps unrolled"}
        try:
            with convs.forced(conv):
                strategy = make_strategy(fns, strategy_name)
                t0 = time.perf_counter()
                state = strategy.init(keys, perturb, x[:1])
                jax.block_until_ready(state)
                init_s = time.perf_counter() - t0
                times = []
                for e in range(args.epochs + 1):
                    t = time.perf_counter()
                    state, m = strategy.epoch(state, x, y, keys, perturb, e, lambda n: None)
                    jax.block_until_ready(state)
                    times.append(time.perf_counter() - t)
                if args.profile and (profiled is None or cand in profiled):
                    # one more epoch, traced (read with TensorBoard's profile plugin or xprof), and its longest kernels
                    where = args.profile / cand.replace(":", "_").replace("=", "-").replace("+", "_")
                    with jax.profiler.trace(str(where)):
                        state, m = strategy.epoch(state, x, y, keys, perturb, args.epochs + 1, lambda n: None)
                        jax.block_until_ready(state)
                    row["top_kernels"] = top_kernels(where)
                med = statistics.median(times[1:])
                row.update(epoch_s=times[1:], median_epoch_s=med, compile_s=max(times[0] - med, 0.0),
                           replica_images_per_s=r_count * BATCH * steps / med, init_s=init_s)
                # replica-position invariance: every replica given replica 0's keys
                same = jax.tree.map(lambda k: jnp.repeat(k[:1], width, 0), keys)
                s2 = strategy.init(same, perturb, x[:1])
                s2, _ = strategy.epoch(s2, x, y, same, perturb, 0, lambda n: None)
                leaves = [np.asarray(a) for a in jax.tree.leaves(jax.device_get(s2.params))]
                differ = sum(int((a != a[:1]).sum()) for a in leaves)
                row["position_invariant"] = differ == 0
                # how far from it: the fraction of weight elements that differ from replica 0's, the largest gap
                row["position_differ_fraction"] = differ / sum(a[1:].size for a in leaves) if width > 1 else 0.0
                row["position_max_abs_diff"] = float(max(np.abs(a - a[:1]).max() for a in leaves))
                # the loop and the fused loop do R single-replica steps' work; vmap's program is counted whole
                flops, nbytes = step_cost(fns, x, y, keys, batched=strategy_name == "vmap")
                if kind_ in ("loop", "unrolled"):
                    flops, nbytes = flops * r_count, nbytes * r_count
                row.update(step_flops=flops, step_bytes=nbytes)
                bound = max(flops / (peak_tflops * 1e12) if peak_tflops else 0.0,
                            nbytes / (peak_gbs * 1e9) if peak_gbs else 0.0)
                row["roofline_fraction"] = bound * steps / med if (peak_tflops or peak_gbs) else None
            stats = device.memory_stats() or {}
            # the process's peak so far (JAX cannot reset it): run a candidate alone for its own peak
            row["process_peak_bytes"] = stats.get("peak_bytes_in_use")
        except Exception as e:  # a candidate that fails is a row with its error, not a lost run
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        rows.append(row)
        print("ROW " + json.dumps(row), flush=True)
    return rows


def ratios(rows: list[dict]) -> None:
    """Each row's replica-images/s over the loop's and the ceiling's, measured in the same process."""
    loop = next((r for r in rows if r["candidate"] == "loop" and "replica_images_per_s" in r), None)
    ceil = next((r for r in rows if r["candidate"] == "ceiling" and "replica_images_per_s" in r), None)
    for r in rows:
        if "replica_images_per_s" in r:
            r["vs_loop"] = r["replica_images_per_s"] / loop["replica_images_per_s"] if loop else None
            r["of_ceiling"] = r["replica_images_per_s"] / ceil["replica_images_per_s"] if ceil else None


def table(rows: list[dict], flags: str) -> str:
    head = f"{'candidate':<18} {'img/s':>10} {'x loop':>7} {'of ceil':>8} {'roofline':>9} {'compile s':>9} {'invariant':>9}"
    out = [f"-- {flags}", head]
    for r in rows:
        if "error" in r:
            out.append(f"{r['candidate']:<18} FAILED {r['error'][:80]}")
            continue
        fmt = lambda v, f: "n/a" if v is None else format(v, f)  # noqa: E731
        out.append(f"{r['candidate']:<18} {r['replica_images_per_s']:>10.0f} {fmt(r.get('vs_loop'), '.2f'):>7} "
                   f"{fmt(r.get('of_ceiling'), '.0%'):>8} {fmt(r.get('roofline_fraction'), '.1%'):>9} "
                   f"{r['compile_s']:>9.1f} {str(r['position_invariant']):>9}")
    return "\n".join(out)


def ulps_of(run: Path, out: Path) -> int:
    """Per tensor of the hardware arm's final weights: how many elements differ from replica 0, by how many ulps."""
    import numpy as np

    from nondet_jax.machine.determinism import ulp_distance
    from nondet_jax.store.paths import RunPaths

    weights = np.load(RunPaths(run).arm_file("weights", "hardware"))
    rows = {}
    for name in weights.files:
        w = weights[name]
        if not np.issubdtype(w.dtype, np.floating):
            continue
        d = np.stack([ulp_distance(w[0], w[r]) for r in range(1, len(w))])
        rows[name] = {"elements": int(w[0].size), "differ": int((d > 0).sum()), "max_ulps": int(d.max(initial=0))}
    moved = {k: v for k, v in rows.items() if v["differ"]}
    print(f"{len(moved)} of {len(rows)} tensors differ between replicas" +
          "".join(f"\n  {k}: {v['differ']} of {v['elements']} elements, up to {v['max_ulps']} ulps"
                  for k, v in sorted(moved.items())))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"run": str(run), "tensors": rows}, indent=1))
    return 0


def table_from(path: Path) -> int:
    record = json.loads(path.read_text())
    for flags, run in record["runs"].items():
        rows = sorted((r for r in run["rows"] if "replica_images_per_s" in r), key=lambda r: -r["replica_images_per_s"])
        print(table(rows, f"{flags} flags"))
    det = record["runs"].get("determinism", {}).get("rows", [])
    ok = [r for r in det if r.get("position_invariant") and r["candidate"] not in ("ceiling",)
          and "replica_images_per_s" in r]
    if ok:
        best = max(ok, key=lambda r: r["replica_images_per_s"])
        print(f"fastest position-invariant candidate under the determinism flags: {best['candidate']} "
              f"({best.get('vs_loop') or float('nan'):.2f}x the loop)")
    return 0


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


def run_flags(args, argv, record: dict, flags: str) -> None:
    """One child process under one flag set; its rows land in ``record`` (and the JSON) as they come."""
    from nondet_jax.machine.determinism import DETERMINISM_ON, with_flags

    env = dict(os.environ)
    if flags == "determinism":
        env["XLA_FLAGS"] = with_flags(DETERMINISM_ON)
    cmd = [sys.executable, __file__, "--child", *[a for a in (argv if argv is not None else sys.argv[1:])
                                                 if a != "--child"]]
    rows, error = [], None
    run = record["runs"][flags] = {"xla_flags": env.get("XLA_FLAGS", ""), "rows": rows, "error": None}
    err = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
    timer = threading.Timer(args.timeout, proc.kill) if args.timeout else None
    if timer:
        timer.start()
    try:
        for line in proc.stdout:  # each row as it comes: a child cut short keeps the rows it finished
            if line.startswith("ROW "):
                rows.append(json.loads(line[4:]))
                ratios(rows)
                args.out.write_text(json.dumps(record, indent=1))
                print(f"  {flags}: {rows[-1]['candidate']} done", flush=True)
        if proc.wait() != 0:
            err.seek(0)
            error = "timed out" if timer and not timer.is_alive() else (err.read().strip().splitlines() or ["exit"])[-1]
    except KeyboardInterrupt:
        error = "interrupted"
        raise
    finally:  # interrupted (the device script's time box): the child goes too
        if proc.poll() is None:
            proc.kill()
        if timer:
            timer.cancel()
        run["error"] = error
        ratios(rows)
        args.out.write_text(json.dumps(record, indent=1))
        print(table(rows, f"{flags} flags" + (f" (error: {error})" if error else "")), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet14")
    p.add_argument("--replicas", type=int, default=16)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--image", type=int, default=32, help="image side (random HxWx3 inputs)")
    p.add_argument("--steps", type=int, default=16, help="steps per epoch (at least 16 for a study-like epoch)")
    p.add_argument("--epochs", type=int, default=2, help="timed epochs after the compiling one (median)")
    p.add_argument("--candidates", default=DEFAULT_CANDIDATES)
    p.add_argument("--flags", default="determinism,default", help="determinism, default, or both (comma list)")
    p.add_argument("--peak-tflops", type=float, help="the chip's peak TFLOP/s for --dtype (H100/H200 known)")
    p.add_argument("--peak-gbs", type=float, help="the chip's memory bandwidth in GB/s (H100/H200 known)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per child process (0: none)")
    p.add_argument("--profile", type=Path, help="also write a jax.profiler trace of one epoch per candidate here")
    p.add_argument("--profile-candidates", help="trace only these candidates (comma list; default: every one)")
    p.add_argument("--ulps-of", type=Path, metavar="RUN", help="only: per-tensor ulp differences between the "
                   "replicas of RUN's hardware arm (replica 0 against each other)")
    p.add_argument("--table-from", type=Path, metavar="JSON", help="only: print the rows of a written JSON, "
                   "fastest first, and the candidate the determinism-flags run favours")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/replica_speed.json"))
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args)
        return 0
    if args.ulps_of:
        return ulps_of(args.ulps_of, args.out)
    if args.table_from:
        return table_from(args.table_from)
    record = {"benchmark": "replica_speed", "command": [Path(sys.executable).name, *sys.argv], "status": "running",
              "runs": {}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1))  # a run cut before its first row still leaves its mark
    # a time box's SIGTERM is handled as SIGINT is: the rows so far are kept and the record is marked
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        for flags in args.flags.split(","):
            run_flags(args, argv, record, flags)
    except KeyboardInterrupt:
        record["status"] = "interrupted"
        args.out.write_text(json.dumps(record, indent=1))
        print(f"interrupted; the rows so far are in {args.out}", flush=True)
        return 130
    record["status"] = "complete"
    args.out.write_text(json.dumps(record, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
