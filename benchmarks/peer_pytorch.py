"""CPU training speed: nondet_jax's strategies and variants vs PyTorch eager, side by side.

Workload: ResNet-14 (``resnet14``: CIFAR stem, widths 16/32/64, BatchNorm, 1x1 shortcut
convolutions), batch 128, 32x32x3 standard-normal images, 10 classes, SGD (momentum 0.9,
weight decay 5e-4) with the library's default schedule; no augmentation. PyTorch runs a matching
ResNet-14 written here (same layers, He fan-out init, BatchNorm eps 1e-5 / momentum 0.1 = flax
0.9) in eager mode: forward, cross-entropy, backward, ``optim.SGD`` step.

What is timed
-------------
Every measurement runs in its own child process (XLA flags and the host device count are read
when the backend starts). A jax child trains with ``nondet_jax.replicas.choice.run_replicas`` (or
``nondet_jax.replicas.sharded.run_sharded``) on one 128-image batch per epoch, so one epoch is one
training step (the library's ``steps == 1`` path: no scan), ``--steps`` + 1 epochs; the first
holds the compilation and is dropped. The ``progress`` callback timestamps each program call
(sequential: one replica-epoch; vmap: all R; sharded: one round), giving one rate per call:
replicas in the call x 128 / its seconds. A torch child times ``--steps`` steps after 2 warm-up
steps, one rate per step. Each row reports the median and the best of its rates; ``vs torch``
divides by the torch (NCHW, default) row's rate *of the same pass* (the passes interleave every
row, so each ratio compares measurements taken minutes apart, not an hour apart: other processes
share these cores). ``--passes`` repeats the whole interleaved list.

Rows
----
* ``torch`` (NCHW) and ``torch_cl`` (``channels_last``), ``torch.set_num_threads(--threads)``;
  ``torch_1t`` (one thread) and ``torch_passive`` (``OMP_WAIT_POLICY=PASSIVE``): OpenMP's
  spinning threads collapse when other processes share the cores (measured here: 26-30 img/s
  with 2 spinning threads vs 140-160 with one), so ``vs best torch`` compares with the fastest
  torch row of the same pass: the fair opponent on a shared machine;
* ``sequential R=1``, ``sequential R=4``: the default strategy on CPU (``auto``);
* every jax row that names no XLA flags of its own runs with the flags ``python -m nondet_jax.sweep`` would set
  for its strategy on this CPU type (``nondet_jax.machine.xla_flags.cpu_defaults``, shown as ``+ CPU rule``), so
  it times what a study runs; ``seq1_jaxlib`` is ``sequential R=1`` with jaxlib's own defaults;
* ``vmap R=4``: replica-batched convolutions computed as the measured table says
  (``nondet_jax/measured.json``); ``vmap4_<form>``: every one computed by formulation ``<form>``
  (``NONDET_JAX_VMAP_CONV``; ``grouped`` is what vmap did before the table);
* ``sharded D=2 R=2 inner=sequential`` and ``sharded D=2 R=4 inner=vmap``: two forced host
  devices (``--xla_force_host_platform_device_count=2``), one replica per device per round or
  two vmapped per device;
* conv variants at ``sequential R=1`` (the model's ``conv_bn`` factory patched in the child):
  ``plain_conv`` (flax's ``nn.Conv``, i.e. ``lax.conv_general_dilated`` with its own weight
  gradient: the models' convolution before ``models.common.conv_general_dilated``), ``nchw`` (lax convolution with NCHW/OIHW dimension numbers, transposes around it) and
  ``matmul`` (3x3 conv as nine shifted slices, each a ``dot_general``, summed; 1x1 as one
  ``dot_general``: autodiff gives matmul input and weight gradients);
* ``vmap`` rows time 2 steps (a vmapped step costs several sequential ones on XLA:CPU);
* XLA:CPU flag sets at ``sequential R=1`` (each checked in a throw-away child first: an unknown
  flag aborts the process): see ``FLAG_SETS``; ``ynn_conv`` also at ``vmap R=4`` (YNNPACK keeps
  grouped convolutions grouped).

    python benchmarks/peer_pytorch.py                  # 2 passes, 6 timed steps per row (~40 min on 2 busy cores)
    python benchmarks/peer_pytorch.py --quick          # 1 pass, 2 steps, a subset of rows (smoke test)
    python benchmarks/peer_pytorch.py --rows torch,seq1,shard2_seq --passes 3

Writes ``benchmarks/results/peer_pytorch.json``; needs ``pip install -e '.[bench]'`` (torch
2.13.0) for the torch rows.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from convs import kernel_conv, matmul_conv  # noqa: E402  (benchmarks/convs.py)

from nondet_jax.machine import xla_flags
from nondet_jax.store.io import atomic_write_json

RESULTS = Path(__file__).resolve().parent / "results"
BATCH = 128
CLASSES = 10

FLAG_SETS = {
    "ynn_conv": "--xla_cpu_experimental_ynn_fusion_type=+individual_convolution",
    "no_ynn": "--xla_cpu_experimental_ynn_fusion_type=",
    "no_ynn_conv": "--xla_cpu_experimental_ynn_fusion_type=-individual_convolution",
    "onednn": "--xla_cpu_use_onednn=true --xla_cpu_experimental_onednn_custom_call=true",
    "fast_math": "--xla_cpu_enable_fast_math=true",
    "eigen_1thread": "--xla_cpu_multi_thread_eigen=false",
    # YNNPACK's convolutions off, its elementwise (and reduction) fusions on: BatchNorm/ReLU/add
    # loops are most of what XLA loses to PyTorch once the convolutions are fast
    "no_ynn_conv_elt": "--xla_cpu_experimental_ynn_fusion_type=-individual_convolution,+eltwise",
    "no_ynn_conv_eltred": "--xla_cpu_experimental_ynn_fusion_type=-individual_convolution,+eltwise,+reduce",
    "no_ynn_conv_vec512": "--xla_cpu_experimental_ynn_fusion_type=-individual_convolution --xla_cpu_prefer_vector_width=512",
    # XLA:CPU's older loop emitters instead of its fusion emitters: faster to compile, as fast to run
    "no_ynn_conv_legacy": "--xla_cpu_experimental_ynn_fusion_type=-individual_convolution --xla_cpu_use_fusion_emitters=false",
    "no_ynn_conv_eigen1": "--xla_cpu_experimental_ynn_fusion_type=-individual_convolution --xla_cpu_multi_thread_eigen=false",
}
TWO_DEVICES = "--xla_force_host_platform_device_count=2"

# name -> (kind, settings). kind "torch": channels_last; kind "jax": strategy, R, conv, flags,
# sharded settings.
ROWS = {
    "torch": ("torch", {"channels_last": False}),
    "torch_1t": ("torch", {"channels_last": False, "threads": 1}),
    "torch_passive": ("torch", {"channels_last": False, "env": {"OMP_WAIT_POLICY": "PASSIVE"}}),
    "torch_cl": ("torch", {"channels_last": True}),
    "seq1": ("jax", {"strategy": "sequential", "replicas": 1}),
    "seq4": ("jax", {"strategy": "sequential", "replicas": 4}),
    "seq1_jaxlib": ("jax", {"strategy": "sequential", "replicas": 1, "cpu_rule": False}),
    "vmap4": ("jax", {"strategy": "vmap", "replicas": 4, "steps": 2}),  # formulations from the measured table
    **{f"vmap4_{f}": ("jax", {"strategy": "vmap", "replicas": 4, "steps": 2, "env": {"NONDET_JAX_VMAP_CONV": f}})
       for f in ("grouped", "map", "im2col", "shifted")},
    "shard2_seq": ("jax", {"strategy": "sharded", "replicas": 2, "inner": "sequential", "flags": TWO_DEVICES}),
    "shard2_vmap4": ("jax", {"strategy": "sharded", "replicas": 4, "inner": "vmap", "flags": TWO_DEVICES}),
    "plain_conv": ("jax", {"strategy": "sequential", "replicas": 1, "conv": "plain"}),
    "nchw": ("jax", {"strategy": "sequential", "replicas": 1, "conv": "nchw"}),
    "matmul": ("jax", {"strategy": "sequential", "replicas": 1, "conv": "matmul"}),
    **{f"seq1_{k}": ("jax", {"strategy": "sequential", "replicas": 1, "flags": v}) for k, v in FLAG_SETS.items()},
    "seq4_no_ynn_conv_eigen1": ("jax", {"strategy": "sequential", "replicas": 4,
                                        "flags": FLAG_SETS["no_ynn_conv_eigen1"]}),
    "vmap4_ynn_conv": ("jax", {"strategy": "vmap", "replicas": 4, "flags": FLAG_SETS["ynn_conv"], "steps": 2}),
}
QUICK_ROWS = ("torch", "torch_1t", "seq1", "shard2_seq", "matmul", "seq1_ynn_conv")
TORCH_ROWS = tuple(n for n, (kind, _) in ROWS.items() if kind == "torch")


# ---------------------------------------------------------------------------- torch


def torch_resnet14(channels_last: bool):
    """A PyTorch ResNet-14 with the layers of nondet_jax's ``resnet14``."""
    import torch
    from torch import nn

    def conv(cin, cout, k, stride=1):
        c = nn.Conv2d(cin, cout, k, stride=stride, padding=k // 2, bias=False)
        nn.init.kaiming_normal_(c.weight, mode="fan_out", nonlinearity="relu")
        return c

    def bn(c):
        return nn.BatchNorm2d(c, eps=1e-5, momentum=0.1)

    class Block(nn.Module):
        def __init__(self, cin, cout, stride):
            super().__init__()
            self.c1, self.b1 = conv(cin, cout, 3, stride), bn(cout)
            self.c2, self.b2 = conv(cout, cout, 3), bn(cout)
            self.short = (nn.Sequential(conv(cin, cout, 1, stride), bn(cout))
                          if stride != 1 or cin != cout else nn.Identity())

        def forward(self, x):
            y = torch.relu(self.b1(self.c1(x)))
            return torch.relu(self.short(x) + self.b2(self.c2(y)))

    layers = [conv(3, 16, 3), bn(16), nn.ReLU()]
    cin = 16
    for i, c in enumerate((16, 32, 64)):
        for j in range(2):
            layers.append(Block(cin, c, 2 if i > 0 and j == 0 else 1))
            cin = c
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, CLASSES)]
    model = nn.Sequential(*layers)
    return model.to(memory_format=torch.channels_last) if channels_last else model


def torch_child(settings: dict, steps: int, threads: int) -> dict:
    import numpy as np
    import torch

    torch.set_num_threads(settings.get("threads", threads))
    torch.manual_seed(0)
    model = torch_resnet14(settings["channels_last"]).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.standard_normal((BATCH, 3, 32, 32), dtype=np.float32))
    if settings["channels_last"]:
        x = x.contiguous(memory_format=torch.channels_last)
    y = torch.from_numpy(rng.integers(0, CLASSES, BATCH))
    loss_fn = torch.nn.CrossEntropyLoss()
    times = []
    for i in range(steps + 2):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        float(loss)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return {"rates": [BATCH / t for t in times], "compile_s": 0.0, "torch": torch.__version__,
            "threads": torch.get_num_threads()}


# ---------------------------------------------------------------------------- jax


def patch_conv(kind: str) -> None:
    """Replace the conv layer the ResNets build (``models.resnet.conv_bn``) by a variant."""
    from functools import partial

    from jax import lax

    import nondet_jax.models.resnet as resnet
    from nondet_jax.models.common import conv_bn

    def nchw_conv(x, w, s):
        y = lax.conv_general_dilated(x.transpose(0, 3, 1, 2), w.transpose(3, 2, 0, 1), (s, s), "SAME",
                                     dimension_numbers=("NCHW", "OIHW", "NCHW"))
        return y.transpose(0, 2, 3, 1)

    if kind == "plain":  # flax's nn.Conv as it was before models.common.conv_general_dilated
        import flax.linen as nn

        from nondet_jax.models.common import conv_init

        resnet.conv_bn = lambda train, m, dtype=None: (
            partial(nn.Conv, use_bias=False, kernel_init=conv_init, dtype=dtype), conv_bn(train, m, dtype)[1])
        return
    # matmul: kh*kw shifted slices of the SAME-padded input, one dot_general each
    VariantConv = kernel_conv(nchw_conv if kind == "nchw" else matmul_conv)

    def variant_conv_bn(train, bn_momentum, dtype=None):  # the signature of models.common.conv_bn
        _, norm = conv_bn(train, bn_momentum, dtype)
        return partial(VariantConv), norm

    resnet.conv_bn = variant_conv_bn


def jax_child(settings: dict, steps: int) -> dict:
    import jax
    import numpy as np

    from nondet_jax.config import from_flat
    from nondet_jax.data import Dataset
    from nondet_jax.sources import arm_keys, arm_sources, perturbations
    from nondet_jax.train import DataSpec, make_train

    if settings.get("conv", "lax") != "lax":
        patch_conv(settings["conv"])
    rng = np.random.default_rng(0)
    images = lambda k: rng.standard_normal((k, 32, 32, 3), dtype=np.float32)  # noqa: E731
    labels = lambda k: rng.integers(0, CLASSES, k).astype(np.int32)  # noqa: E731
    data = Dataset("synthetic", images(BATCH), labels(BATCH), images(BATCH), labels(BATCH), CLASSES)
    epochs = steps + 1
    config = from_flat({"model.name": "resnet14", "train.batch_size": BATCH, "train.epochs": epochs})
    fns = make_train(config, DataSpec(BATCH, (32, 32, 3), CLASSES, "synthetic"))
    r = settings["replicas"]
    varied = arm_sources("all")
    keys, perturb = arm_keys(0, varied, r), perturbations(varied)
    stamps, counts = [], []

    def progress(n):
        stamps.append(time.perf_counter())
        counts.append(n)

    t0 = time.perf_counter()
    if settings["strategy"] == "sharded":
        from nondet_jax.replicas.sharded import run_sharded
        result = run_sharded(fns, keys, perturb, data, epochs, progress, inner=settings["inner"])
    else:
        from nondet_jax.replicas.choice import run_replicas
        result = run_replicas(fns, keys, perturb, data, epochs, settings["strategy"], progress)
    wall = time.perf_counter() - t0
    # one rate per epoch (all replicas' images over the epoch's wall time): replicas trained from threads report
    # their progress in bursts, so a rate per progress call would be meaningless
    calls_per_epoch = len(stamps) // epochs
    ends = np.array([t0] + stamps[calls_per_epoch - 1::calls_per_epoch])
    images = np.add.reduceat(np.asarray(counts), np.arange(0, len(counts), calls_per_epoch)) * BATCH
    dt = np.diff(ends)
    rates = [float(n / t) for n, t in zip(images[1:], dt[1:])]  # the first epoch compiles
    first_epoch = float(dt[0])
    return {"rates": rates, "compile_s": first_epoch - float(np.sum(dt[1:]) / (epochs - 1)),
            "wall_s": wall, "devices": len(jax.devices()), "strategy": result.strategy,
            "final_loss_mean": float(np.mean(result.train_loss[:, -1]))}


# ---------------------------------------------------------------------------- parent


def flag_accepted(flags: str) -> tuple[bool, str]:
    """Whether XLA starts with ``flags``: an unknown or malformed flag aborts the process."""
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    code = "import jax, jax.numpy as jnp; print(float(jax.jit(lambda a: a @ a)(jnp.ones((4, 4))).sum()))"
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    return p.returncode == 0, (p.stderr or p.stdout)[-400:]


def row_flags(settings: dict) -> str:
    """The XLA flags a jax row runs with: its own, else what the CLI would set for its strategy on this CPU type."""
    if "flags" in settings or not settings.get("cpu_rule", True):
        return settings.get("flags", "")
    return " ".join(xla_flags.cpu_defaults(strategy=settings["strategy"]))


def run_row(name: str, steps: int, threads: int) -> dict:
    kind, settings = ROWS[name]
    flags = row_flags(settings) if kind == "jax" else ""
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu", **settings.get("env", {}))
    steps = min(steps, settings.get("steps", steps))
    cmd = [sys.executable, __file__, "--child", name, "--steps", str(steps), "--threads", str(threads)]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode != 0 or not lines:
        return {"error": (p.stderr or p.stdout)[-2000:], "process_s": time.perf_counter() - t0}
    out = json.loads(lines[-1][len("RESULT "):])
    out["process_s"], out["xla_flags"] = time.perf_counter() - t0, flags
    return out


def describe(name: str) -> str:
    kind, s = ROWS[name]
    if kind == "torch":
        extra = "".join(f", {k}={v}" for k, v in s.get("env", {}).items())
        extra += f", {s['threads']} thread" if "threads" in s else ""
        return f"PyTorch eager {'channels_last' if s['channels_last'] else 'NCHW'}{extra}"
    parts = [s["strategy"], f"R={s['replicas']}"]
    if s["strategy"] == "sharded":
        parts += ["D=2", f"inner={s['inner']}"]
    if s.get("conv", "lax") != "lax":
        parts.append(f"conv={s['conv']}")
    if "NONDET_JAX_VMAP_CONV" in s.get("env", {}):
        parts.append(f"conv={s['env']['NONDET_JAX_VMAP_CONV']}")
    flag = next((k for k, v in FLAG_SETS.items() if v and v == s.get("flags")), None)
    if flag:
        parts.append(f"flags={flag}")
    elif "flags" not in s and row_flags(s):
        parts.append("+ CPU rule")
    return " ".join(parts)


def summarise(record: dict) -> list[dict]:
    """One row per measurement name: median/best rates over passes and ratios to torch per pass."""
    rows = []
    for name in record["rows"]:
        runs = [p[name] for p in record["passes"] if name in p and "rates" in p[name]]
        if not runs:
            err = next((p[name]["error"] for p in record["passes"] if name in p), "not run")
            rows.append({"name": name, "describe": describe(name), "error": err})
            continue
        rates = [r for run in runs for r in run["rates"]]
        ratios, best_ratios = [], []
        for p in record["passes"]:
            if name not in p or "rates" not in p[name]:
                continue
            mine = statistics.median(p[name]["rates"])
            torch_rates = {t: statistics.median(p[t]["rates"]) for t in TORCH_ROWS if t in p and "rates" in p[t]}
            if "torch" in torch_rates:
                ratios.append(mine / torch_rates["torch"])
            if torch_rates:
                best_ratios.append(mine / max(torch_rates.values()))
        rows.append({"name": name, "describe": describe(name), "median": statistics.median(rates),
                     "best": max(rates), "compile_s": statistics.median(r["compile_s"] for r in runs),
                     "vs_torch_per_pass": ratios, "vs_torch": statistics.median(ratios) if ratios else None,
                     "vs_best_torch_per_pass": best_ratios,
                     "vs_best_torch": statistics.median(best_ratios) if best_ratios else None,
                     "samples": len(rates)})
    return rows


def format_table(rows: list[dict]) -> str:
    head = (f"{'row':<16} {'what':<48} {'median img/s':>12} {'best':>8} {'compile s':>9} {'vs torch':>17} "
            f"{'vs best torch':>17}")
    lines = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['name']:<16} {r['describe']:<48} failed: {r['error'].strip().splitlines()[-1][:60]}")
            continue
        cells = []
        for key in ("vs_torch", "vs_best_torch"):
            per_pass = ",".join(f"{x:.2f}" for x in r[key + "_per_pass"])
            cells.append("-" if r[key] is None else f"{r[key]:.2f}x ({per_pass})")
        lines.append(f"{r['name']:<16} {r['describe']:<48} {r['median']:>12.1f} {r['best']:>8.1f} "
                     f"{r['compile_s']:>9.1f} {cells[0]:>17} {cells[1]:>17}")
    lines.append("img/s: replica-images per second (torch: images per second), median and best of every timed "
                 "step of every pass;\nvs torch: median over passes of (row median / torch row median in the same "
                 "pass); vs best torch: the same against the fastest torch row of that pass")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help=f"rows {','.join(QUICK_ROWS)}, 1 pass, 2 steps")
    p.add_argument("--rows", help=f"comma-separated subset of {','.join(ROWS)}")
    p.add_argument("--passes", type=int, default=2)
    p.add_argument("--steps", type=int, default=6, help="timed steps per row (jax: epochs of one step)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads")
    p.add_argument("--out", type=Path)
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        kind, settings = ROWS[args.child]
        result = torch_child(settings, args.steps, args.threads) if kind == "torch" else jax_child(settings, args.steps)
        print("RESULT " + json.dumps(result))
        return 0
    if args.quick:
        args.passes, args.steps = 1, 2
    names = args.rows.split(",") if args.rows else list(QUICK_ROWS if args.quick else ROWS)
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        p.error(f"unknown rows {unknown}; use {','.join(ROWS)}")
    if "torch" not in names:
        names.insert(0, "torch")  # every ratio needs it
    try:
        import torch  # noqa: F401
    except ImportError:
        print("torch is not installed (pip install -e '.[bench]'): torch rows fail, ratios are empty")
    rejected = {}
    for flags in {ROWS[n][1].get("flags", "") for n in names if ROWS[n][0] == "jax"} - {""}:
        ok, log = flag_accepted(flags)
        if not ok:
            rejected[flags] = log
            print(f"XLA rejects {flags!r}: {log.strip().splitlines()[-1] if log.strip() else ''}")
    names = [n for n in names if ROWS[n][1].get("flags", "") not in rejected]
    record = {"benchmark": "peer_pytorch", "batch": BATCH, "steps": args.steps, "threads": args.threads,
              "cpu_count": os.cpu_count(), "rows": names, "settings": {n: ROWS[n] for n in names},
              "rejected_flags": rejected, "passes": [], "load_average": [os.getloadavg()],
              "command": [Path(sys.executable).name] + sys.argv}
    try:
        import jax
        record["jax"] = jax.__version__
    except ImportError:
        pass
    for i in range(args.passes):
        results = {}
        order = names if i % 2 == 0 else names[::-1]  # alternate the order: drift hits both ends alike
        for name in order:
            results[name] = run_row(name, args.steps, args.threads)
            r = results[name]
            msg = (f"median {statistics.median(r['rates']):.1f} img/s, {r['process_s']:.0f} s" if "rates" in r
                   else "FAILED " + r["error"].strip().splitlines()[-1][:120])
            print(f"pass {i + 1}/{args.passes} {name:<16} {msg}", flush=True)
        record["passes"].append(results)
        record["load_average"].append(os.getloadavg())
    record["summary"] = summarise(record)
    print(format_table(record["summary"]))
    print(f"load average (1, 5, 15 min) before and after each pass: {record['load_average']}")
    out = args.out or RESULTS / ("peer_pytorch-quick.json" if args.quick else "peer_pytorch.json")
    atomic_write_json(out, record)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
