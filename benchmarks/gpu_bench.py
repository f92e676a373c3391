"""Replica throughput, memory and compile time of the strategies on one accelerator (GPU or TPU).

Grid (in priority order, see ``grid``: the script stops starting configurations at ``--budget-s``
and writes the JSON after every one, so a cut-short run still leaves its rows)::

    model    in resnet14, resnet18 (CIFAR stem), batch 128, 32x32x3 synthetic images, 10 classes
    dtype    in float32, bfloat16
    strategy x R:
      vmap        R in 1, 4, 16, 64   jit(vmap(train_epoch)): convs become grouped convolutions
      sequential  R = 1               jit(train_epoch); a loop over replicas runs this program R
                                      times, so its replica-images/s does not depend on R
      sharded     R = 16              jit(shard_map(vmap(train_epoch))) over a 1-device mesh
                                      (nondet_jax.replicas.sharded.programs): the overhead of the mesh
      vmap_<form> R in 16, 64         vmap with every replica-batched conv (forward and both
                                      gradients) computed by one formulation of nondet_jax.models.convs
                                      (grouped, map, im2col, shifted), whatever the table says;
                                      plain ``vmap`` follows the measured table

Each (model, dtype) pair runs every strategy before the next pair starts; the vmap_<form> rows at
R = 64 come last.

Each configuration builds the library's single-replica functions (``make_train``), the program
exactly as the strategy does, then ``lower(...).compile()`` (``compile_s``), one warm-up epoch and
``--epochs`` timed epochs of ``--steps`` steps (one rolled ``lax.scan`` each, as the library runs
on accelerators). Recorded per row: replica-images/s (R x steps x 128 / median epoch seconds),
the compiled program's memory (``compiled.memory_analysis()``: arguments + outputs + temporaries
- aliased, bytes), the device's ``memory_stats()`` peak after the row (cumulative over the process:
monotone, so it bounds the rows so far), and any error (out of memory is recorded, not fatal).

float32 runs at JAX's default matmul precision (on H100/H200: TF32 tensor cores for convs and
dots). bfloat16 is the library's mixed precision (``model.dtype=bfloat16``: bfloat16 compute,
float32 parameters, optimiser state, BatchNorm statistics, logits and loss).

    bash benchmarks/gpu.sh                        # the full grid on the first GPU, under 8 minutes
    python benchmarks/gpu_bench.py --quick        # CPU smoke test (< 2 min): resnet8, batch 16, R <= 2,
                                                  # each strategy once, bf16 on sharded and vmap_im2col
    python benchmarks/gpu_bench.py --models resnet18 --dtypes bfloat16 --replicas 16,64

TPU variant (one host, e.g. v5e-8 / v6e-8; ``pip install -e '.[tpu]'``): the same command runs on
the TPU backend; add ``--sharded-devices 0`` to put ``sharded`` over every chip (R must be >= the
chip count; R = 16, 64 on 8 chips gives 2 and 8 replicas per chip), and prefer bfloat16 (TPU
matmuls are bf16 at default precision anyway). ``memory_stats()`` works on TPU as on GPU. On a
multi-host slice call ``jax.distributed.initialize()`` first (not done here).

Writes ``benchmarks/results/gpu_bench.json`` (``--quick``: ``gpu_bench-quick.json``).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import traceback
from pathlib import Path

from nondet_jax.models.convs import FORMULATIONS, forced
from nondet_jax.store.io import atomic_write_json

RESULTS = Path(__file__).resolve().parent / "results"
CLASSES = 10
FORMS = tuple(f"vmap_{f}" for f in FORMULATIONS)
QUICK = {("sequential", "float32"), ("vmap", "float32"), ("sharded", "bfloat16"), ("vmap_im2col", "bfloat16")}


def grid(models, dtypes, replicas, strategies) -> list[dict]:
    """Configurations in priority order: each (model, dtype) pair in the order given, with
    ``sequential``, ``vmap`` at every R, ``sharded`` (one R: it is vmap plus a mesh) and each
    ``vmap_<form>`` at the smallest R >= 16; ``vmap_<form>`` at the larger R come last of all.
    A run cut short by ``--budget-s`` therefore still has the whole comparison for the first pairs."""
    big = [r for r in replicas if r >= 16] or [max(replicas)]
    per_strategy = {"sequential": [1], "vmap": list(replicas), "sharded": big[:1], **{f: big[:1] for f in FORMS}}
    unknown = set(strategies) - set(per_strategy)
    if unknown:
        raise ValueError(f"unknown strategies {sorted(unknown)}; use {', '.join(per_strategy)}")
    out, late = [], []
    for model in models:
        for dtype in dtypes:
            for strategy in (s for s in per_strategy if s in strategies):
                out += [{"model": model, "dtype": dtype, "strategy": strategy, "replicas": r}
                        for r in per_strategy[strategy]]
            late += [{"model": model, "dtype": dtype, "strategy": f, "replicas": r}
                     for f in FORMS if f in strategies for r in big[1:]]
    return out + late


def memory_of(compiled) -> int | None:
    try:
        m = compiled.memory_analysis()
        return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
                   - m.alias_size_in_bytes)
    except Exception:  # noqa: BLE001 (not every backend reports it)
        return None


def peak_bytes(device) -> int | None:
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    return None if not stats else stats.get("peak_bytes_in_use")


def measure(cfg: dict, batch: int, steps: int, epochs: int, sharded_devices: int) -> dict:
    """One configuration: build, compile, warm up, time; returns its row."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from nondet_jax.config import from_flat
    from nondet_jax.replicas.sharded import AXIS, programs
    from nondet_jax.sources import arm_keys, arm_sources, perturbations
    from nondet_jax.train import DataSpec, make_train

    r, strategy = cfg["replicas"], cfg["strategy"]
    form = strategy[len("vmap_"):] if strategy in FORMS else None
    rng = np.random.default_rng(0)
    n = steps * batch
    x = jnp.asarray(rng.standard_normal((n, 32, 32, 3), dtype=np.float32))
    y = jnp.asarray(rng.integers(0, CLASSES, n).astype(np.int32))
    varied = arm_sources("all")
    keys, perturb = arm_keys(0, varied, r), perturbations(varied)
    with forced(form):  # the formulation is chosen while the program is traced (lower below)
        config = from_flat({"model.name": cfg["model"], "model.dtype": cfg["dtype"], "train.batch_size": batch,
                            "train.epochs": epochs + 1})
        fns = make_train(config, DataSpec(n, (32, 32, 3), CLASSES, "synthetic"))
        vmapped = (0, None, None, 0, None, None)
        if strategy == "sequential":
            init, epoch_fn = jax.jit(fns.init), jax.jit(fns.train_epoch)
            keys = jax.tree.map(lambda k: k[0], keys)
        elif strategy == "sharded":
            devices = jax.devices()[:sharded_devices] if sharded_devices else jax.devices()
            d = len(devices)
            if r % d:
                raise ValueError(f"R={r} is not a multiple of the {d} devices")
            mesh, init, epoch_fn, _ = programs(fns, tuple(devices), r // d)
            keys = jax.device_put(keys, NamedSharding(mesh, P(AXIS)))
            x, y, perturb = jax.device_put((x, y, perturb), NamedSharding(mesh, P()))
        else:
            init = jax.jit(jax.vmap(fns.init, in_axes=(0, None, None)))
            epoch_fn = jax.jit(jax.vmap(fns.train_epoch, in_axes=vmapped))
        state = init(keys, perturb, x[:1])
        t0 = time.perf_counter()
        compiled = epoch_fn.lower(state, x, y, keys, perturb, jnp.int32(0)).compile()
        compile_s = time.perf_counter() - t0
        times = []
        for e in range(epochs + 1):  # epoch 0: warm-up
            t0 = time.perf_counter()
            state, m = compiled(state, x, y, keys, perturb, jnp.int32(e))
            jax.block_until_ready((state, m))
            if e:
                times.append(time.perf_counter() - t0)
        loss = float(np.mean(np.asarray(m["loss"])))
    seconds = statistics.median(times)
    return {**cfg, "compile_s": compile_s, "epoch_s": times, "steps_per_epoch": fns.steps_per_epoch,
            "batch": batch, "replica_images_per_s": r * fns.steps_per_epoch * batch / seconds,
            "program_bytes": memory_of(compiled), "peak_bytes_in_use_so_far": peak_bytes(jax.devices()[0]),
            "final_loss": loss, "finite": bool(np.isfinite(loss))}


def format_table(rows: list[dict]) -> str:
    head = (f"{'model':<9} {'dtype':<9} {'strategy':<12} {'R':>3} {'img/s':>10} {'compile s':>9} "
            f"{'program GiB':>11} {'peak GiB':>9}  note")
    lines = [head, "-" * len(head)]
    gib = lambda b: "-" if b is None else f"{b / 2**30:.2f}"  # noqa: E731
    for r in rows:
        if "error" in r or "skipped" in r:
            note = r.get("skipped") or r["error"].strip().splitlines()[-1][:70]
            lines.append(f"{r['model']:<9} {r['dtype']:<9} {r['strategy']:<12} {r['replicas']:>3} "
                         f"{'-':>10} {'-':>9} {'-':>11} {'-':>9}  {note}")
            continue
        lines.append(f"{r['model']:<9} {r['dtype']:<9} {r['strategy']:<12} {r['replicas']:>3} "
                     f"{r['replica_images_per_s']:>10.1f} {r['compile_s']:>9.1f} {gib(r['program_bytes']):>11} "
                     f"{gib(r['peak_bytes_in_use_so_far']):>9}  {'' if r['finite'] else 'loss not finite'}")
    lines.append("img/s: replica-images per second (sequential: the same for any R); program GiB: the compiled "
                 "epoch's arguments + outputs + temporaries; peak GiB: device peak so far in the process")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="CPU smoke test: resnet8, batch 16, R <= 2, 1 step, "
                                                        "each strategy once")
    p.add_argument("--models", default="resnet14,resnet18")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--replicas", default="1,4,16,64")
    p.add_argument("--strategies", default="sequential,vmap,sharded," + ",".join(FORMS[1:]),
                   help=f"of sequential,vmap,sharded,{','.join(FORMS)} (vmap_grouped = vmap without the table)")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--steps", type=int, default=4, help="steps per epoch (one rolled scan)")
    p.add_argument("--epochs", type=int, default=3, help="timed epochs after one warm-up epoch")
    p.add_argument("--sharded-devices", type=int, default=1, help="devices of the sharded mesh (0: all)")
    p.add_argument("--budget-s", type=float, default=400.0, help="start no configuration after this many seconds")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if args.quick:
        args.models, args.replicas, args.batch, args.steps, args.epochs = "resnet8", "2", 16, 1, 2
        args.budget_s = min(args.budget_s, 100.0)
    t_start = time.perf_counter()
    import jax

    if args.quick:  # a smoke test: compile time dominates on CPU
        jax.config.update("jax_disable_most_optimizations", True)
    from nondet_jax.machine.determinism import environment
    from nondet_jax.replicas.sharded import programs

    replicas = [int(v) for v in args.replicas.split(",")]
    configs = grid(args.models.split(","), args.dtypes.split(","), replicas, args.strategies.split(","))
    if args.quick:  # every code path once: each strategy, each dtype, within 2 minutes on a busy CPU
        configs = [dict(c, replicas=1) if c["strategy"] == "sequential" else c for c in configs
                   if (c["strategy"], c["dtype"]) in QUICK]
    out = args.out or RESULTS / ("gpu_bench-quick.json" if args.quick else "gpu_bench.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"benchmark": "gpu_bench", "args": {k: str(v) for k, v in vars(args).items()},
              "backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()],
              "device_kind": jax.devices()[0].device_kind, "jax": jax.__version__,
              "environment": environment(), "rows": []}
    print(f"{len(configs)} configurations on {jax.devices()[0].device_kind} ({jax.default_backend()}), "
          f"budget {args.budget_s:.0f} s", flush=True)
    for cfg in configs:
        elapsed = time.perf_counter() - t_start
        if elapsed > args.budget_s:
            row = {**cfg, "skipped": f"budget ({elapsed:.0f} s > {args.budget_s:.0f} s)"}
        else:
            try:
                row = measure(cfg, args.batch, args.steps, args.epochs, args.sharded_devices)
            except Exception as exc:  # noqa: BLE001 (out of memory and friends are results too)
                row = {**cfg, "error": f"{type(exc).__name__}: {exc}"[:2000], "traceback": traceback.format_exc()[-3000:]}
            jax.clear_caches()
            programs.cache_clear()
            gc.collect()
        row["elapsed_s"] = time.perf_counter() - t_start
        record["rows"].append(row)
        atomic_write_json(out, record)
        msg = (row.get("skipped") or row.get("error", "").splitlines()[0][:100] if "replica_images_per_s" not in row
               else f"{row['replica_images_per_s']:.1f} img/s, compile {row['compile_s']:.1f} s")
        print(f"[{row['elapsed_s']:6.1f} s] {cfg['model']} {cfg['dtype']} {cfg['strategy']} R={cfg['replicas']}: {msg}",
              flush=True)
    print(format_table(record["rows"]))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
