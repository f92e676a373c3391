"""Overhead of the instruments: step time with / without, per configuration, side by side.

What it measures
----------------
For each workload (batch 128):

* ``resnet8_digits``: the default study, ResNet-8 on the embedded digits data;
* ``resnet14_random``: ResNet-14 on synthetic 32x32x3 images (standard normal pixels, 10 classes),

it compiles ``make_train(...).train_step`` (one jitted step, the body of the epoch scan) for
instruments off and for each per-example mode (``train_pass``, ``frozen_bn``) and configuration
(economy, business, full) at ``every=1`` and ``every=16``, then runs them in interleaved rounds (each round runs every variant for a block of
steps, in turn), so machine noise hits all variants alike. Per variant, the step time is the
median over rounds of the block's mean step time (every-16 blocks are whole 16-step cycles: one
tracked step, one Alpha end-point step, 14 idle steps). The ratio is that time over the
instruments-off time.

Where the cost goes: the instruments' ``update`` alone, at a tracked step, for each quantity on its
own (ms; and x the plain train step's time).

Run ``python benchmarks/instruments.py [--quick]``; writes benchmarks/results/instruments.json.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from nondet_jax import instruments
from nondet_jax.config import from_flat
from nondet_jax.data import load_dataset
from nondet_jax.sources import one_replica
from nondet_jax.store.io import atomic_write_json
from nondet_jax.train import DataSpec, make_train

CONFIGS = ("economy", "business", "full")
EVERY = (1, 16)
MODES = ("train_pass", "frozen_bn")  # instruments.per_example
TARGETS = {"economy": 1.3, "business": 1.8, "full": 6.0}  # every step
TARGETS_EVERY16 = {"economy": 1.1}
# --configs items besides economy/business/full: quantity lists ("+"-joined, or these names), and an
# "@materialise" / "@ghost" / "@auto" suffix: that variant with instruments.norms set so (the norm-only
# path off, or ghost on every layer).
ALIASES = {"norms": "Alpha+Distance+GradNorm+InnerTest+Loss+NormTest+OrthoTest+UpdateSize"}  # economy - GradHist1d


def config_of(item: str) -> tuple[str, str | None]:
    """(instruments.config value, the instruments.norms suffix or None) of a --configs item."""
    name, _, norms = item.partition("@")
    return ALIASES.get(name, name).replace("+", ","), norms or None


WORKLOADS = ("resnet8_digits", "resnet14_random")


def workload(name: str):
    if name not in WORKLOADS:
        raise SystemExit(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    if name == "resnet8_digits":
        d = load_dataset("digits")
        return "resnet8", d.x_train, d.y_train, DataSpec(len(d.x_train), tuple(d.x_train.shape[1:]), 10, "digits")
    rng = np.random.default_rng(0)
    n = 512
    x = rng.standard_normal((n, 32, 32, 3)).astype(np.float32)
    y = rng.integers(0, 10, n).astype(np.int32)
    return "resnet14", x, y, DataSpec(n, (32, 32, 3), 10, "random")


def make_step(model, spec, flat):
    cfg = from_flat({"model.name": model, "train.batch_size": 128, **flat})
    fns = make_train(cfg, spec)
    return fns, jax.jit(fns.train_step)


def run_block(step_fn, state, x, y, keys, perturb, start, count, n, b):
    t0 = time.perf_counter()
    for s in range(start, start + count):
        idx = (jnp.arange(b) + s * b) % n
        state, out = step_fn(state, x, y, keys, perturb, jnp.int32(0), jnp.int32(s), idx)
    jax.block_until_ready(out)
    return state, (time.perf_counter() - t0) / count


def bench_workload(name: str, quick: bool, rounds: int, log, breakdown_ok=lambda: True, configs=CONFIGS,
                   everies=EVERY, modes=MODES) -> dict:
    model, x_np, y_np, spec = workload(name)
    x, y = jnp.asarray(x_np), jnp.asarray(y_np)
    n, b = len(x_np), 128
    keys, perturb = one_replica("init")
    variants = {"off": ({}, 1)}
    for m in modes:
        for c in configs:
            for k in everies:
                value, norms = config_of(c)
                flat = {"instruments.config": value, "instruments.every": k, "instruments.per_example": m}
                if norms:
                    flat["instruments.norms"] = norms
                variants[f"{m}/{c}/every{k}"] = (flat, k)
    block1 = 2 if (quick and model == "resnet14") else 4
    progs, states, compile_s = {}, {}, {}
    for v, (flat, _every) in variants.items():
        fns, step_fn = make_step(model, spec, flat)
        state = jax.jit(fns.init)(keys, perturb, x[:1])
        t0 = time.perf_counter()
        state, _ = run_block(step_fn, state, x, y, keys, perturb, 0, 2, n, b)  # compile, a tracked + an end step
        compile_s[v] = time.perf_counter() - t0
        progs[v], states[v] = step_fn, state
        log(f"  {name} {v}: compiled + 2 steps in {compile_s[v]:.1f} s")
    times = {v: [] for v in variants}
    cursor = {v: 16 for v in variants}  # every variant starts its blocks at a tracked step (16 | cursor)
    for r in range(rounds):
        for v, (_, every) in variants.items():
            count = 16 if (every == 16 or v == "off") else block1
            states[v], dt = run_block(progs[v], states[v], x, y, keys, perturb, cursor[v], count, n, b)
            cursor[v] += count if count % 16 == 0 else 16  # keep every-16 blocks aligned to whole cycles
            times[v].append(dt)
        log(f"  {name} round {r + 1}/{rounds}: " + ", ".join(f"{v} {1e3 * np.mean(t[-1:]):.0f} ms"
                                                          for v, t in times.items()))
    base = float(np.median(times["off"]))
    out = {"model": model, "batch_size": b, "step_ms_off": 1e3 * base, "compile_s": compile_s, "modes": {},
           "times_ms": {v: [1e3 * t for t in ts] for v, ts in times.items()}}
    for m in modes:
        out["modes"][m] = {}
        for c in configs:
            row = {}
            for k in everies:
                t = float(np.median(times[f"{m}/{c}/every{k}"]))
                row[f"every{k}_ms"] = 1e3 * t
                row[f"every{k}_ratio"] = t / base
            out["modes"][m][c] = row
    if not (quick and model == "resnet14") and breakdown_ok():  # --quick: the breakdown on the default model only
        out["breakdown"] = breakdown(model, spec, x, y, keys, perturb, base, quick, log)
    return out


def breakdown(model, spec, x, y, keys, perturb, base_s, quick, log) -> dict:
    """Each quantity alone (frozen_bn mode): ``update`` at a tracked step (the Alpha end point included), ms."""
    fns, _ = make_step(model, spec, {"instruments.config": "economy"})
    state = jax.jit(fns.init)(keys, perturb, x[:1])
    from nondet_jax.instruments.trainer import for_model
    from nondet_jax.models import make_model

    net = make_model(model, spec.num_classes)

    xb, yb = x[:128], y[:128]
    params, stats = state.params, state.batch_stats
    upd = jax.tree.map(lambda a: 1e-3 * jnp.ones_like(a), params)
    res = {}
    for q in instruments.QUANTITIES:
        cfg = from_flat({"instruments.config": q, "optim.momentum": 0, "optim.weight_decay": 0,
                         "instruments.per_example": "frozen_bn"}).instruments
        inst = for_model(cfg, net, fns.loss_fn, fns.recompute_batch_stats, total_steps=1000)
        fn = jax.jit(lambda s, p, bs, t: inst.update(s, p, (xb, yb, None), step=t, context=bs, updates=upd, lr=0.1,
                                                     grads=upd, loss=jnp.float32(1.0)))
        ist = inst.init(params)
        jax.block_until_ready(fn(ist, params, stats, 1))
        reps = []
        for _ in range(2 if quick else 3):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(ist, params, stats, 1))
            reps.append(time.perf_counter() - t0)
        res[q] = {"ms": 1e3 * float(np.median(reps)), "x_step": float(np.median(reps)) / base_s}
        log(f"  {model} {q}: {res[q]['ms']:.1f} ms ({res[q]['x_step']:.2f} x a step)")
    return res


def _resnet8_batch():
    """ResNet-8 on digits, one initialised replica and a batch of 128: (model, spec, fns, x, y, state)."""
    model, x_np, y_np, spec = workload("resnet8_digits")
    fns, _ = make_step(model, spec, {})
    keys, perturb = one_replica("init")
    x, y = jnp.asarray(x_np[:128]), jnp.asarray(y_np[:128])
    return model, spec, fns, x, y, jax.jit(fns.init)(keys, perturb, x[:1])


def pass_timing(rounds: int, log) -> dict:
    """The per-example pass alone against one training gradient (ResNet-8 on digits, batch 128,
    chunk 32), interleaved over ``rounds`` rounds: the training gradient, the inference-mode
    gradient the pass starts from (BatchNorm statistics fixed), the layerwise pass (without and with
    GradHist1d's histogram) and the ``vmap(grad)`` pass. Median ms and x the training gradient."""
    from nondet_jax.instruments import histograms, layerwise, per_example
    from nondet_jax.instruments.trainer import model_losses, train_pass_grad
    from nondet_jax.models import make_model

    model, spec, fns, x, y, state = _resnet8_batch()
    params, stats = state.params, fns.recompute_batch_stats(state.params, state.batch_stats, x)
    example_loss, batched = model_losses(make_model(model, spec.num_classes))
    batch, h1 = (x, y, None), {"bins": histograms.HIST1D_BINS}

    def _taped(p):
        return train_pass_grad(fns.loss_fn, p, state.batch_stats, x, y, None)

    def _tape_stats(p, hist, rolled=True, chunk=32):
        _, grads, tape = _taped(p)
        return layerwise.tape_stats(tape, p, chunk, grad_sq=False, hist1d=hist, hist2d=None, tangents=(grads,),
                                    rolled=rolled)
    variants = {
        "training gradient": lambda p: jax.grad(lambda q: fns.loss_fn(q, state.batch_stats, x, y, None)[0])(p),
        "inference-mode gradient": lambda p: jax.grad(lambda q: batched(q, batch, stats).mean())(p),
        "layerwise pass": lambda p: layerwise.per_example_pass(batched, p, batch, stats, 32, grad_sq=False,
                                                               hist1d=None, hist2d=None),
        "layerwise pass + GradHist1d": lambda p: layerwise.per_example_pass(batched, p, batch, stats, 32,
                                                                            grad_sq=False, hist1d=h1, hist2d=None),
        "vmap(grad) pass": lambda p: per_example.per_example_pass(example_loss, p, batch, stats, 32, grad_sq=False,
                                                                  hist1d=None, hist2d=None),
        # train_pass: the training gradient itself, recorded, then the per-example products from the tape
        "training gradient + tape": lambda p: (lambda r: (r[1], r[2].records, r[2].deltas))(_taped(p)),
        "training gradient + tape stats": lambda p: _tape_stats(p, None),
        "training gradient + tape stats + GradHist1d": lambda p: _tape_stats(p, h1),
        "training gradient + tape stats + GradHist1d, chunks unrolled": lambda p: _tape_stats(p, h1, False),
        "training gradient + tape stats + GradHist1d, one chunk": lambda p: _tape_stats(p, h1, True, 128),
        "training gradient + tape projections (x3)": lambda p: layerwise.tape_projections(
            _taped(p)[2], (p, p, p)),
    }
    compiled, compile_s = {k: jax.jit(f) for k, f in variants.items()}, {}
    for k, f in compiled.items():
        t0 = time.perf_counter()
        jax.block_until_ready(f(params))
        compile_s[k] = time.perf_counter() - t0
    times = {k: [] for k in compiled}
    for _ in range(rounds):
        for k, f in compiled.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f(params))
            times[k].append(time.perf_counter() - t0)
    base = float(np.median(times["training gradient"]))
    res = {k: {"ms": 1e3 * float(np.median(t)), "x_training_gradient": float(np.median(t)) / base,
               "compile_and_first_call_s": compile_s[k]} for k, t in times.items()}
    for k, v in res.items():
        log(f"  {k:62s} {v['ms']:8.1f} ms {v['x_training_gradient']:6.2f}x  (compile {compile_s[k]:5.1f} s)")
    return res


def kernel_timing(rounds: int, log) -> dict:
    """The measured per-example norm choices, on ResNet-8 / digits (batch 128, chunk 32, the training pass's tape):

    * per layer, the squared per-example gradient norms by the ghost identity against forming the
      layer's per-example weight gradient (the rule of ``layerwise.ghost_is_cheaper``);
    * the recorded training gradient plus the norm-only path (auto, or ghost everywhere) against plus the
      materialised tape pass with the same outputs (``tape_stats`` without histograms), with 0, 1 and 3
      projections (NormTest; + InnerTest/OrthoTest; + Alpha's two);
    * GradHist2d's counting, (chunk x P) bin indices: ``bincount`` (a scatter-add) against
      ``jax.ops.segment_sum`` and a sort-based count (``searchsorted`` on the sorted indices)."""
    from nondet_jax.instruments import layerwise
    from nondet_jax.instruments.trainer import train_pass_grad

    model, spec, fns, x, y, state = _resnet8_batch()
    params = state.params
    (_, _), grads, tape = train_pass_grad(fns.loss_fn, params, state.batch_stats, x, y, None)  # eager: concrete tape
    variants = {}
    modes = layerwise.layer_modes(tape, "auto")
    for path in tape.paths:
        m = tape.calls[path].module
        if modes[path] == "formed":
            continue
        rec, d = tape.records[path][:32], tape.deltas[path][:32]
        p = int(np.prod(d.shape[1:-1])) if d.ndim > 2 else 1
        fan_in = rec.shape[-1] * (int(np.prod(layerwise._kernel_size(m))) if type(m) is layerwise.nn.Conv else 1)
        label = f"{'/'.join(path)} P={p} in={fan_in} out={d.shape[-1]} (auto: {modes[path]})"
        for mode in ("ghost", "materialise"):
            variants[f"{label} | {mode}"] = (
                jax.jit(lambda r, dd, m=m, mode=mode: layerwise._layer_sq_and_proj(m, r, dd, [], mode)[0]), (rec, d))
    # The passes inside one jitted program with the recorded training gradient (as in a training step:
    # closing over a concrete tape would make its arrays compile-time constants and mislead).
    t2, t3 = jax.tree.map(lambda a: 0.5 * a, params), jax.tree.map(lambda a: 0.25 * a, params)

    def in_step(kind, n_t, p, a, c):
        (_, _), g, tp = train_pass_grad(fns.loss_fn, p, state.batch_stats, x, y, None)
        tans = (g, a, c)[:n_t]
        if kind == "gradient":
            return g
        if kind == "materialised":
            return g, layerwise.tape_stats(tp, p, 32, grad_sq=False, hist1d=None, hist2d=None, tangents=tans)
        return g, layerwise.tape_norm_stats(tp, g, 32, tangents=tans, mode=kind)

    variants["recorded training gradient"] = (jax.jit(lambda p, a, c: in_step("gradient", 0, p, a, c)),
                                              (params, t2, t3))
    for n_t in (0, 1, 3):
        for kind, label in (("materialised", "+ per-example gradients formed (tape_stats, chunk 32)"),
                            ("auto", "+ norm-only path (auto)"), ("ghost", "+ norm-only path, ghost on every layer")):
            variants[f"{label}, {n_t} projections"] = (
                jax.jit(lambda p, a, c, kind=kind, n_t=n_t: in_step(kind, n_t, p, a, c)), (params, t2, t3))
    n_p = sum(a.size for a in jax.tree.leaves(params))
    idx = jax.random.randint(jax.random.key(0), (32 * n_p,), 0, 2000)
    variants["GradHist2d counts: bincount (scatter-add)"] = (
        jax.jit(lambda i: jnp.bincount(i, length=2000).astype(jnp.float32)), (idx,))
    variants["GradHist2d counts: segment_sum"] = (
        jax.jit(lambda i: jax.ops.segment_sum(jnp.ones(i.shape, jnp.float32), i, 2000)), (idx,))
    variants["GradHist2d counts: segment_sum, int32 ones"] = (
        jax.jit(lambda i: jax.ops.segment_sum(jnp.ones(i.shape, jnp.int32), i, 2000).astype(jnp.float32)), (idx,))
    idx100 = idx % 100
    variants["GradHist1d counts (100 bins): bincount"] = (
        jax.jit(lambda i: jnp.bincount(i, length=100).astype(jnp.float32)), (idx100,))
    variants["GradHist1d counts (100 bins): segment_sum, int32 ones"] = (
        jax.jit(lambda i: jax.ops.segment_sum(jnp.ones(i.shape, jnp.int32), i, 100).astype(jnp.float32)), (idx100,))
    variants["GradHist2d counts: sort + searchsorted"] = (
        jax.jit(lambda i: jnp.diff(jnp.searchsorted(jnp.sort(i), jnp.arange(2001), method="scan_unrolled"))
                .astype(jnp.float32)), (idx,))
    for f, a in variants.values():
        jax.block_until_ready(f(*a))
    times = {k: [] for k in variants}
    for _ in range(rounds):
        for k, (f, a) in variants.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f(*a))
            times[k].append(time.perf_counter() - t0)
    res = {k: 1e3 * float(np.median(t)) for k, t in times.items()}
    for k, v in res.items():
        log(f"  {k:90s} {v:9.3f} ms")
    return res


def epoch_timing(variants: list[tuple[str, dict]], log, rounds: int = 16, workload_name: str = "resnet8_digits",
                 save=None) -> dict:
    """The program a study runs, per variant (a label and config overrides): one training epoch,
    ``jit(train_epoch)`` (on CPU a short epoch is unrolled and economy-style instruments are measured
    after its steps; the step benchmark above times ``train_step`` alone, which does neither).
    Seconds to ``lower`` and ``compile`` each variant; then ``rounds`` interleaved rounds, each running
    every variant's next epoch in turn (in reverse order every other round), so machine load hits all alike. Per variant: ms per training
    step = the mean over the rounds (16 rounds are a whole every-16 schedule cycle whatever the epoch
    length, since epoch ``e`` holds steps ``e*S .. e*S+S-1``), and its ratio to the first variant's."""
    model, x_np, y_np, spec = workload(workload_name)
    x, y = jnp.asarray(x_np), jnp.asarray(y_np)
    keys, perturb = one_replica("init")
    res, progs, states = {}, {}, {}
    for label, flat in variants:
        flat = dict(flat)
        cfg = from_flat({"model.name": model, "train.batch_size": 128, **flat})
        fns = make_train(cfg, spec)
        state = jax.jit(fns.init)(keys, perturb, x[:1])
        t0 = time.perf_counter()
        lowered = jax.jit(fns.train_epoch).lower(state, x, y, keys, perturb, jnp.int32(0))
        t1 = time.perf_counter()
        progs[label] = lowered.compile()
        t2 = time.perf_counter()
        states[label] = state
        res[label] = {"overrides": flat, "steps": fns.steps_per_epoch, "unroll": fns.unroll, "lower_s": t1 - t0,
                      "compile_s": t2 - t1, "epoch_s": []}
        log(f"  {label:24s} lower {t1 - t0:6.1f} s  compile {t2 - t1:7.1f} s  ({fns.steps_per_epoch} steps, "
            f"unroll {fns.unroll})")
        if save is not None:
            save(res)  # after every variant: a run stopped early keeps what it measured
    for e in range(rounds):
        for label, _ in variants[::-1] if e % 2 else variants:  # the order alternates: no variant always follows the same one
            t0 = time.perf_counter()
            states[label], m = progs[label](states[label], x, y, keys, perturb, jnp.int32(e))
            jax.block_until_ready((states[label], m))
            res[label]["epoch_s"].append(time.perf_counter() - t0)
        if save is not None:
            save(res)
    base = None
    for label, _ in variants:
        r = res[label]
        r["step_ms"] = 1e3 * float(np.mean(r["epoch_s"])) / r["steps"]
        base = base or r["step_ms"]
        r["ratio"] = r["step_ms"] / base
        log(f"  {label:24s} {r['step_ms']:8.1f} ms per step  {r['ratio']:5.2f}x  (compile {r['compile_s']:.1f} s, "
            f"{r['compile_s'] / res[variants[0][0]]['compile_s']:.2f}x)")
    return res


def main(argv=None):
    from nondet_jax.study.memory import release_compiled

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds and steps (about 10 minutes on 2 CPU cores)")
    ap.add_argument("--workloads", default="resnet8_digits,resnet14_random")
    ap.add_argument("--out", default=None)
    ap.add_argument("--rounds", type=int, help="timed rounds per workload (default: 5; --quick: 2, and 1 for "
                                               "resnet14_random)")
    ap.add_argument("--breakdown-after-s", type=float, default=float("inf"),
                    help="skip the per-quantity breakdown when this many seconds have passed (a time-boxed run)")
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help="configurations to time: economy/business/full, quantities joined by '+', or 'norms' "
                         "(economy without GradHist1d); an '@materialise' or '@ghost' suffix builds the variant "
                         "with that norm-only mode (e.g. norms,norms@materialise)")
    ap.add_argument("--every", default=",".join(map(str, EVERY)), help="schedules to time: track every k steps")
    ap.add_argument("--modes", default=",".join(MODES), help="instruments.per_example modes to time")
    ap.add_argument("--no-breakdown", action="store_true", help="skip the per-quantity breakdown")
    ap.add_argument("--pass-timing", action="store_true",
                    help="only time the per-example pass against a training gradient (ResNet-8 digits; "
                         "writes benchmarks/results/instruments_pass.json)")
    ap.add_argument("--epoch-timing", metavar="VARIANTS",
                    help="only time the program a study runs, one epoch (jit(train_epoch)) per variant: compile "
                         "time, then --rounds (default 16) interleaved epochs; VARIANTS: comma list of "
                         "label=key:value;key:value, the first the baseline (e.g. 'off=,economy=instruments.config:economy'; "
                         "instruments.config takes the --configs spelling, e.g. norms or NormTest+Alpha); "
                         "workload: the first of --workloads; writes benchmarks/results/instruments_epoch.json")
    ap.add_argument("--kernel-timing", action="store_true",
                    help="only time the per-example norm choices (ghost vs materialised norms per layer, the norm-only pass, "
                         "GradHist2d's counting); writes benchmarks/results/instruments_kernels.json")
    args = ap.parse_args(argv)
    if args.kernel_timing:
        log = lambda s: print(s, flush=True)  # noqa: E731
        res = {"rounds": args.rounds or 7, "backend": jax.default_backend(), "cpu_count": os.cpu_count(),
               "load_avg_at_start": os.getloadavg(), "jax": jax.__version__,
               "ms": kernel_timing(args.rounds or 7, log)}
        out = Path(args.out or "benchmarks/results/instruments_kernels.json")
        atomic_write_json(out, res)
        print(f"wrote {out}")
        return
    if args.epoch_timing:
        log = lambda s: print(s, flush=True)  # noqa: E731
        variants = []
        for item in args.epoch_timing.split(","):
            label, _, spec = item.partition("=")
            flat = dict(kv.split(":", 1) for kv in spec.split(";") if kv)
            if "instruments.config" in flat:  # the --configs spelling: aliases, quantities joined by '+'
                flat["instruments.config"] = config_of(flat["instruments.config"])[0]
            variants.append((label, flat))
        w = args.workloads.split(",")[0]
        rounds = args.rounds or 16
        log(f"one epoch of {w} (batch 128), jit(train_epoch): lower, compile, then {rounds} interleaved epochs:")
        res = {"backend": jax.default_backend(), "cpu_count": os.cpu_count(), "platform": platform.platform(),
               "jax": jax.__version__, "load_avg_at_start": os.getloadavg(), "workload": w, "rounds": rounds}
        out = Path(args.out or "benchmarks/results/instruments_epoch.json")
        res["epoch"] = epoch_timing(variants, log, rounds, w, lambda r: atomic_write_json(out, {**res, "epoch": r}))
        res["load_avg_at_end"] = os.getloadavg()
        atomic_write_json(out, res)
        print(f"wrote {out}")
        return
    if args.pass_timing:
        log = lambda s: print(s, flush=True)  # noqa: E731
        log("per-example pass alone, ResNet-8 on digits, batch 128, chunk 32 (median of interleaved rounds):")
        res = {"rounds": args.rounds or 7, "backend": jax.default_backend(), "cpu_count": os.cpu_count(),
               "platform": platform.platform(), "jax": jax.__version__, "pass": pass_timing(args.rounds or 7, log)}
        out = Path(args.out or "benchmarks/results/instruments_pass.json")
        atomic_write_json(out, res)
        print(f"wrote {out}")
        return
    configs, everies, modes = args.configs.split(","), tuple(int(k) for k in args.every.split(",")), args.modes.split(",")
    rounds = args.rounds or (2 if args.quick else 5)
    t_start = time.perf_counter()
    out = Path(args.out or "benchmarks/results/instruments.json")  # "quick" inside says how it was run
    log = lambda s: print(s, flush=True)  # noqa: E731
    results = {"quick": args.quick, "rounds": rounds, "backend": jax.default_backend(),
               "device_kind": jax.devices()[0].device_kind, "cpu_count": os.cpu_count(), "platform": platform.platform(), "jax": jax.__version__,
               "targets_every1": TARGETS, "targets_every16": TARGETS_EVERY16,
               "load_avg_at_start": os.getloadavg(), "workloads": {}}
    for w in args.workloads.split(","):
        log(f"{w}:")
        w_rounds = args.rounds or (1 if (args.quick and w == "resnet14_random") else rounds)
        results["workloads"][w] = bench_workload(
            w, args.quick, w_rounds, log,
            lambda: not args.no_breakdown and time.perf_counter() - t_start < args.breakdown_after_s, configs,
            everies, modes)
        atomic_write_json(out, results)  # after every workload: a time-boxed run keeps what it did
        # Each workload's compiled programs go before the next: XLA:CPU's JIT maps memory per program, and a
        # whole grid in one process once hit the kernel's limit on mappings (LLVM "Unable to allocate section memory").
        release_compiled()
    default = results["workloads"].get("resnet8_digits") or next(iter(results["workloads"].values()))
    results["ratios"] = {f"{m}/{c}_every{k}": default["modes"][m][c][f"every{k}_ratio"]
                         for m in modes for c in configs for k in everies}
    print()
    print(f"{'workload':18s} {'mode':11s} {'config':18s} {'every 1':>9s} {'every 16':>9s} {'target@1':>9s} {'@16':>5s}")
    for w, r in results["workloads"].items():
        print(f"{w:18s} {'off':11s} {'':18s} {r['step_ms_off']:7.1f}ms")
        for m in modes:
            for c in configs:
                row = r["modes"][m][c]
                cells = " ".join(f"{row[f'every{k}_ratio']:8.2f}x" if f"every{k}_ratio" in row else f"{'-':>9s}"
                                 for k in EVERY)
                t16 = f"{TARGETS_EVERY16[c]:4.1f}x" if c in TARGETS_EVERY16 else ""
                t1 = f"{TARGETS[c]:8.1f}x" if c in TARGETS else f"{'':9s}"
                print(f"{'':18s} {m:11s} {c:18s} {cells} {t1} {t16:>5s}")
    for w, r in results["workloads"].items():
        if "breakdown" not in r:
            continue
        print(f"\nwhere the cost goes, {w} (update alone at a tracked step, x one plain step):")
        for q, v in sorted(r["breakdown"].items(), key=lambda kv: -kv[1]["ms"]):
            print(f"  {q:14s} {v['ms']:8.1f} ms {v['x_step']:6.2f}x")
    atomic_write_json(out, results)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
