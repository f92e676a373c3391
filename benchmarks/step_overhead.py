"""What the library adds to a training step: the default study's step next to a bare Flax + optax step.

    python benchmarks/step_overhead.py --out benchmarks/results/step_overhead.json

Both run the default study's ResNet-8 on digits at batch 128, one replica, jitted, on the same device arrays:

* ``library``: ``TrainFns.epoch_step``, the step a study on CPU dispatches (the batch gathered from the epoch's
  indices, the crop augmentation, the batch-order switch, the loss, SGD with momentum and weight decay on the
  warm-up/cosine schedule, the health and metrics it returns);
* ``bare``: ``value_and_grad`` of the mean cross-entropy of the model's ``train_apply`` on one fixed batch and
  ``optax.sgd(0.05, momentum=0.9)`` (no augmentation, no gather, no schedule);
* ``forward``: the bare loss alone;
* ``threads``: the library's step for ``--threads`` replicas at once, each replica's steps dispatched from a Python
  thread of its own, as the sequential strategy trains them (``train.replica_threads``); ms per replica-step.

Every row runs with the XLA flags ``python -m nondet_jax.sweep`` sets on this CPU type for the sequential
strategy (``nondet_jax.machine.xla_flags``; ``NONDET_JAX_CPU_DEFAULTS=0`` for jaxlib's own).

Each row's program is also compiled once ahead of time (``jit(...).lower(...).compile()``), timed: the seconds
XLA takes for the library's step against the bare step's say what the library's features add to a study's
compile. Rounds alternate the rows (``--rounds``), each the mean of ``--steps`` steps after a warm-up call; the table
prints the median ms per step and the ratio to ``bare``. A ratio near 1 says the library's step costs what the
model's own forward and backward cost, so a gap to PyTorch lies in XLA's kernels, not the library.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--threads", type=int, default=2, help="replicas (threads) of the threads row")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "step_overhead.json")
    args = ap.parse_args()

    from nondet_jax.machine import xla_flags

    added = xla_flags.apply_cpu_defaults(strategy="sequential")  # the flags a study sets on this CPU type
    import jax
    import numpy as np
    import optax

    from nondet_jax import config as cfg
    from nondet_jax.sources import one_replica
    from nondet_jax.study.prepare import prepare

    data, fns = prepare(cfg.Config())
    keys, perturb = one_replica("init")  # replica 0 of the init arm: no perturbation switched on
    x, y = jax.device_put((np.asarray(data.x_train), np.asarray(data.y_train)))
    state = jax.jit(fns.init)(keys, perturb, x[:1])
    idx = jax.jit(fns.epoch_indices)(keys, np.int32(0))
    step = jax.jit(fns.epoch_step)
    b = fns.batch_size
    xb, yb = x[:b], y[:b]
    tx = optax.sgd(0.05, momentum=0.9)

    def loss(params, bs):
        logits, new_bs = fns.model.train_apply({"params": params, "batch_stats": bs}, xb, None)
        return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean(), new_bs

    @jax.jit
    def bare(params, bs, opt):
        (_, new_bs), g = jax.value_and_grad(loss, has_aux=True)(params, bs)
        updates, opt = tx.update(g, opt, params)
        return optax.apply_updates(params, updates), new_bs, opt

    forward = jax.jit(lambda params, bs: loss(params, bs)[0])

    def library_steps(n):
        s = state
        for i in range(n):
            s, _ = step(s, x, y, keys, perturb, np.int32(0), np.int32(i % fns.steps_per_epoch), idx)
        return s

    def bare_steps(n):
        p, bs, o = state.params, state.batch_stats, tx.init(state.params)
        for _ in range(n):
            p, bs, o = bare(p, bs, o)
        return p

    def forward_steps(n):
        return [forward(state.params, state.batch_stats) for _ in range(n)][-1]

    def threads_steps(n):  # args.threads replicas, each from its own thread: n steps of each, per replica-step
        with ThreadPoolExecutor(args.threads) as pool:
            return list(pool.map(lambda _: jax.block_until_ready(library_steps(n)), range(args.threads)))

    rows = {"library": library_steps, "bare": bare_steps, "forward": forward_steps, "threads": threads_steps}
    per_call = {"threads": args.threads}  # replica-steps per step of a row
    times: dict[str, list[float]] = {k: [] for k in rows}
    compile_s = {}  # XLA's compile of each row's program alone, tracing and lowering excluded
    for name, (fn, fargs) in {"library": (step, (state, x, y, keys, perturb, np.int32(0), np.int32(0), idx)),
                              "bare": (bare, (state.params, state.batch_stats, tx.init(state.params))),
                              "forward": (forward, (state.params, state.batch_stats))}.items():
        lowered = fn.lower(*fargs)
        t = time.perf_counter()
        lowered.compile()
        compile_s[name] = time.perf_counter() - t
    for f in rows.values():
        jax.block_until_ready(f(1))  # compile
    for _ in range(args.rounds):
        for name, f in rows.items():
            t = time.perf_counter()
            jax.block_until_ready(f(args.steps))
            times[name].append((time.perf_counter() - t) / (args.steps * per_call.get(name, 1)) * 1e3)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{'row':<10} {'ms/step (median)':>17} {'x bare':>7} {'compile s':>10}  rounds")
    for k in rows:
        c = f"{compile_s[k]:.2f}" if k in compile_s else "-"
        print(f"{k:<10} {med[k]:>17.2f} {med[k] / med['bare']:>7.2f} {c:>10}  {', '.join(f'{t:.2f}' for t in times[k])}")
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    out = {"machine": {"platform": platform.platform(), "processor": platform.processor()}, "load_average": load,
           "jax": jax.__version__, "batch": b, "steps": args.steps, "ms_per_step": times, "median_ms": med,
           "library_vs_bare": med["library"] / med["bare"], "threads": args.threads,
           "threads_vs_library": med["threads"] / med["library"], "xla_flags_added": added,
           "compile_s": compile_s}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
