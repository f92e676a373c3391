"""Where one ResNet-14 training step (CIFAR-style 32x32x3, batch 128, the library's default
``train_epoch`` of one step) spends its time on XLA:CPU, by kind of work, next to PyTorch eager
(``--model`` and ``--image`` profile another model and input on the XLA side: the default study's step is
``--model resnet8 --image 8,8,1``).

XLA: the compiled step runs ``--steps`` times under ``jax.profiler``; XLA:CPU's thunk runtime
records one trace event per executed thunk (a fusion, a convolution, a YNNPACK fusion, a copy).
Each event's name is an instruction of the optimized HLO (``compiled.as_text()``), and the
``op_name`` metadata of that instruction and of its fused computation says which layer and which
pass it belongs to (``jvp(ResNet)/...``: forward; ``transpose(jvp(ResNet))/...``: backward). The
categories: convolution forward / input gradient / weight gradient (an output shaped like a kernel),
the layout transposes XLA inserts for the weight gradients, BatchNorm(+ReLU, residual add) forward
and backward, the optimiser, the rest. Thunks can run concurrently on several threads, so the sum
of the categories is thread time; run it pinned to one core (``taskset -c 0``) for a sum that
equals the wall time and a comparison with PyTorch on one thread.

The XLA side runs with the flags ``python -m nondet_jax.sweep`` sets on this CPU type for the sequential strategy
(``nondet_jax.machine.xla_flags``; ``NONDET_JAX_CPU_DEFAULTS=0`` for jaxlib's own), so it profiles the step a study
runs.

PyTorch (``--torch``): ``torch.profiler`` over the same number of steps of
``benchmarks/peer_pytorch.py``'s ResNet-14, self CPU time per aten operator, grouped alike.

``--conv plain`` profiles the model with flax's plain ``nn.Conv`` (``lax.conv_general_dilated``)
instead of ``models.common.conv_general_dilated`` (the weight gradient behind a fusion barrier).

    taskset -c 0 python benchmarks/step_profile.py --torch           # XLA and torch on one core
    python benchmarks/step_profile.py --conv plain --top 20           # the previous convolution, 20 slowest thunks
    taskset -c 0 python benchmarks/step_profile.py --model resnet8 --image 8,8,1 --top 12   # the default study's step

Prints the table; ``--out`` writes it with the per-thunk times as JSON.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

BATCH = 128
CLASSES = 10


def parse_hlo(text: str):
    """instruction name -> (output shape, its line, the lines of the computation it calls)."""
    comps, cur = {}, None
    for line in text.splitlines():
        m = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if m and not line.startswith(" "):
            cur = comps.setdefault(m.group(1), [])
            continue
        if cur is not None and line.startswith("  "):
            cur.append(line)
    instr = {}
    for lines in comps.values():
        for line in lines:
            m = re.match(r"\s+(?:ROOT )?%([\w.\-]+) = (\S+) ", line)
            if m:
                called = re.search(r"calls=%([\w.\-]+)", line)
                instr[m.group(1)] = (m.group(2), line, comps.get(called.group(1), []) if called else [])
    return instr


KERNEL_SHAPE = re.compile(r"f32\[(\d+,(3,3|1,1),\d+|(3,3|1,1),\d+,\d+)\]")


def classify(shape: str, line: str, body: list[str]) -> str:
    names = " ".join(sorted(set(re.findall(r'op_name="([^"]+)"', line + "\n".join(body)))))
    text = line + "\n".join(body)
    if "convolution(" in text or "conv_general_dilated" in names:
        if KERNEL_SHAPE.match(shape):
            return "conv weight gradient"
        return "conv input gradient" if "transpose(" in names else "conv forward"
    if re.search(r"transpose\(|copy\(", text) and re.match(r"f32\[\d+,\d+,\d+,\d+\]", shape) and (
            "transpose" in line.split("=")[0] or "wrapped_copy" in line.split("=")[0]):
        return "transposes for weight gradients"
    if "optax" in names or "state.opt_state" in names or "apply_updates" in names:
        return "optimiser"
    if re.search(r"BatchNorm|_bn/|relu", names):
        return "BatchNorm/ReLU/add backward" if "transpose(jvp" in names else "BatchNorm/ReLU/add forward"
    if "Dense" in names or "classifier" in names or "softmax" in names or "log" in names:
        return "head and loss"
    return "other"


def profile_jax(steps: int, conv: str, top: int, model: str = "resnet14", image: tuple = (32, 32, 3)) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import nondet_jax.models.resnet as resnet
    from nondet_jax.config import from_flat
    from nondet_jax.sources import one_replica
    from nondet_jax.train import DataSpec, make_train

    if conv == "plain":
        import flax.linen as nn

        from nondet_jax.models.common import conv_bn, conv_init
        resnet.conv_bn = lambda train, m, dtype=None: (
            partial(nn.Conv, use_bias=False, kernel_init=conv_init, dtype=dtype), conv_bn(train, m, dtype)[1])
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((BATCH, *image), dtype=np.float32))
    y = jnp.asarray(rng.integers(0, CLASSES, BATCH).astype(np.int32))
    config = from_flat({"model.name": model, "train.batch_size": BATCH, "train.epochs": 5})
    fns = make_train(config, DataSpec(BATCH, image, CLASSES, "synthetic"))
    keys, perturb = one_replica("all")
    state = jax.jit(fns.init)(keys, perturb, x)
    compiled = jax.jit(fns.train_epoch).lower(state, x, y, keys, perturb, jnp.int32(1)).compile()
    instr = parse_hlo(compiled.as_text())
    for _ in range(2):
        state, _m = compiled(state, x, y, keys, perturb, jnp.int32(1))
        jax.block_until_ready(state)
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        t0 = time.perf_counter()
        for _ in range(steps):
            state, _m = compiled(state, x, y, keys, perturb, jnp.int32(1))
            jax.block_until_ready(state)
        wall = (time.perf_counter() - t0) / steps
        jax.profiler.stop_trace()
        trace = json.load(gzip.open(glob.glob(os.path.join(d, "plugins/profile/*/*.trace.json.gz"))[0]))
    per_thunk = collections.defaultdict(float)
    for e in trace["traceEvents"]:
        if e.get("ph") == "X" and e["name"] in instr:
            per_thunk[e["name"]] += e["dur"] / 1e3 / steps
    # a conditional's event encloses the events of its branch's thunks: count those only
    for name in [n for n in per_thunk if instr[n][1].split("=", 1)[1].lstrip().split(" ", 1)[1].startswith(
            "conditional(")]:
        del per_thunk[name]
    cats = collections.defaultdict(float)
    for name, ms in per_thunk.items():
        cats[classify(*instr[name])] += ms
    slowest = sorted(per_thunk.items(), key=lambda kv: -kv[1])[:top]
    return {"wall_ms": wall * 1e3, "categories": dict(cats),
            "slowest": [(n, ms, classify(*instr[n]), instr[n][0]) for n, ms in slowest],
            "threads": os.sched_getaffinity(0).__len__()}


TORCH_GROUPS = [("conv weight+input gradient", ("convolution_backward",)),
                ("conv forward", ("mkldnn_convolution", "conv2d", "_convolution")),
                ("BatchNorm/ReLU/add backward", ("batch_norm_backward", "threshold_backward")),
                ("BatchNorm/ReLU/add forward", ("native_batch_norm", "clamp_min", "relu", "aten::add")),
                ("optimiser", ("_foreach", "sgd", "mul_", "add_", "zero_")),
                ("head and loss", ("softmax", "nll_loss", "addmm", "linear", "mean"))]


def profile_torch(steps: int, threads: int) -> dict:
    import numpy as np
    import torch
    from torch.profiler import ProfilerActivity, profile

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from peer_pytorch import torch_resnet14

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = torch_resnet14(False).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.standard_normal((BATCH, 3, 32, 32), dtype=np.float32))
    y = torch.from_numpy(rng.integers(0, CLASSES, BATCH))
    loss_fn = torch.nn.CrossEntropyLoss()

    def step():
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        return float(loss.detach())

    for _ in range(2):
        step()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    wall = (time.perf_counter() - t0) / steps
    cats = collections.defaultdict(float)
    for ev in prof.key_averages():
        ms = ev.self_cpu_time_total / 1e3 / steps
        group = next((g for g, keys in TORCH_GROUPS if any(k in ev.key for k in keys)), "other")
        cats[group] += ms
    return {"wall_ms": wall * 1e3, "categories": dict(cats), "threads": torch.get_num_threads(),
            "torch": torch.__version__}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3, help="profiled steps (after 2 warm-up steps)")
    p.add_argument("--conv", choices=("library", "plain"), default="library")
    p.add_argument("--torch", action="store_true", help="also profile PyTorch eager")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="torch threads")
    p.add_argument("--top", type=int, default=0, help="list the N slowest XLA thunks")
    p.add_argument("--model", default="resnet14", help="XLA side only: e.g. resnet8 with --image 8,8,1 (digits)")
    p.add_argument("--image", default="32,32,3", help="height,width,channels of the XLA side's input")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    image = tuple(int(v) for v in args.image.split(","))
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from nondet_jax.machine import xla_flags

    added = xla_flags.apply_cpu_defaults(strategy="sequential")  # the flags a study sets on this CPU type
    record = {"xla": profile_jax(args.steps, args.conv, args.top, args.model, image), "conv": args.conv,
              "model": args.model, "image": image, "xla_flags_added": added,
              "load_average": os.getloadavg()}
    if args.torch:
        record["torch"] = profile_torch(args.steps, args.threads)
    names = list(dict.fromkeys(list(record["xla"]["categories"]) + list(record.get("torch", {}).get("categories", {}))))
    names.sort(key=lambda n: -record["xla"]["categories"].get(n, 0.0))
    cols = ["xla"] + (["torch"] if args.torch else [])
    print(f"{'ms per step':<34}" + "".join(f"{c:>10}" for c in cols))
    for n in names:
        print(f"{n:<34}" + "".join(f"{record[c]['categories'].get(n, 0.0):>10.1f}" for c in cols))
    print(f"{'sum (thread time)':<34}" + "".join(f"{sum(record[c]['categories'].values()):>10.1f}" for c in cols))
    print(f"{'wall time per step':<34}" + "".join(f"{record[c]['wall_ms']:>10.1f}" for c in cols))
    print(f"cores available: {record['xla']['threads']}; torch threads: "
          f"{record.get('torch', {}).get('threads', '-')}; conv: {args.conv}; CPU rule's flags: {added or 'none'}; "
          f"load average {record['load_average']}")
    for name, ms, cat, shape in record["xla"]["slowest"]:
        print(f"{ms:8.1f} ms  {name:<32} {cat:<32} {shape}")
    if args.out:
        args.out.write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
