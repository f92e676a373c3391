"""The default study against the same study written as a plain PyTorch program, wall clock to the same table.

``python -m nondet_jax.sweep`` with no arguments runs the ``sources`` preset: ResNet-8 (CIFAR stem, widths
16/32/64, BatchNorm momentum 0.9 in Flax's sense, eps 1e-5, He fan-out convolutions, LeCun-normal head) on
scikit-learn's digits (the fixed stratified 1437/360 split, standardised with the training mean and std),
random crops after 1 pixel of zero padding (no flips), SGD (momentum 0.9, weight decay 5e-4 added to the
gradient) at peak lr 0.05 with a linear warm-up of 1 epoch and a cosine decay to 0, set per step, 12 epochs of
batch 128 (the last incomplete batch dropped: 11 steps), 8 replicas in each of 7 arms (control, init,
data_order, augmentation, bitflip, batch_order, all). It prints per arm the test accuracy's mean and std.

The PyTorch program below is that study as a researcher would write it with nothing but PyTorch, NumPy and
scikit-learn: the same model, data, split, augmentation, optimiser and schedule, and the arms by seeding, a
loop over arms and replicas with one ``torch.Generator`` per source (``init``: weight init; ``data_order``:
the epoch's shuffle; ``augmentation``: the crop offsets; ``bitflip``: which kernel weight moves one ulp and
which way; ``batch_order``: a permutation inside each minibatch, the identity where the arm does not vary
it). A source the arm does not vary draws from one seed shared by every replica. It is the same experiment,
not bitwise the same arithmetic: PyTorch draws from its own generators, pads a stride-2 3x3 convolution by 1
on each side where Flax's SAME pads (0, 1), and keeps BatchNorm's running variance unbiased where Flax keeps
it biased. It does less than the sweep: no linear mode connectivity, CKA, disagreement, intervals, report,
figures or checkpoints, only the accuracy table; the ratio is what a user waits for either table.

What is timed
-------------
Both sides run as child processes of this script, one after the other in one run (nondet_jax first), each
timed from its start to its exit (interpreter start and imports included):

* ``nondet_jax``: ``python -m nondet_jax.sweep --compile-cache off --out <fresh folder> --no-progress``
  (plus ``--epochs/--replicas/--arms`` where they differ from the preset), cold: JAX's persistent
  compilation cache is off, so every program is compiled in the run (``--jax-compile-cache DIR`` uses one
  instead, recorded with how many entries it held before; ``--jax-set KEY=VALUE`` adds a ``--set``). Its table
  is read from the run folder's ``arms.csv``.
* ``pytorch``: this file's PyTorch program (``--torch-child``), with the thread count and memory layout the
  probe found fastest. Before either side, a probe child times training steps of the same ResNet-8 for
  ``torch.set_num_threads`` 1 and 2, channels-last and contiguous, interleaved, best of its rounds; the
  probe is not part of the PyTorch wall time (``--threads N --layout channels_last|contiguous`` skips it).

The JSON (default ``benchmarks/results/peer_study_pytorch.json``) records the machine (lscpu model name,
cores, load average before, between and after), the versions, each side's wall seconds and command, both
tables, the probe, and ``ratio`` = nondet_jax wall / PyTorch wall (above 1: nondet_jax slower).

    python benchmarks/peer_study_pytorch.py            # the default study, both sides (minutes each)
    python benchmarks/peer_study_pytorch.py --quick    # 2 epochs, 2 replicas, arms control,init (a test)

Needs torch (``pip install -e '.[bench]'``: torch 2.13.0, CPU wheel) besides nondet_jax; ``--help`` does not.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

# The study: nondet_jax/presets/sources.yaml (tests/test_scripts.py checks that they agree).
ARMS = ("control", "init", "data_order", "augmentation", "bitflip", "batch_order", "all")
REPLICAS = 8
EPOCHS = 12
BATCH = 128
LR = 0.05
MOMENTUM = 0.9
WEIGHT_DECAY = 5e-4
WARMUP_EPOCHS = 1
STUDY_SEED = 0
CROP_PADDING = 1  # nondet_jax.data.pipeline.default_crop_padding(8)
BN_MOMENTUM = 0.1  # PyTorch's convention: Flax's momentum 0.9
BN_EPS = 1e-5
TEST_SIZE, SPLIT_SEED = 360, 0  # nondet_jax/data/digits.py
QUICK = {"epochs": 2, "replicas": 2, "arms": ("control", "init")}

SOURCES = ("init", "data_order", "augmentation", "bitflip", "batch_order")  # the seeded sources this study has
VARIES = {"control": (), "all": SOURCES, **{s: (s,) for s in SOURCES}}


# ---------------------------------------------------------------------------- the PyTorch program
# Nothing here imports nondet_jax or JAX: this is the program a PyTorch user would write for the study.


def load_digits():
    """scikit-learn's digits, the fixed stratified split, standardised with the training mean/std: NCHW."""
    import numpy as np
    import torch
    from sklearn.datasets import load_digits as sk_digits
    from sklearn.model_selection import train_test_split

    d = sk_digits()
    x, y = d.images.astype(np.float32)[:, None], d.target.astype(np.int64)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=TEST_SIZE, stratify=y, random_state=SPLIT_SEED)
    mean, std = x_tr.mean(dtype=np.float64), x_tr.std(dtype=np.float64) + 1e-8
    x_tr, x_te = (((a - mean) / std).astype(np.float32) for a in (x_tr, x_te))
    return tuple(torch.from_numpy(a) for a in (x_tr, y_tr, x_te, y_te))


def resnet8(num_classes: int = 10, in_channels: int = 1):
    """CIFAR ResNet-8: a 3x3 stem, three stages of one basic block (16, 32, 64; stride 2 from the second),
    1x1 projection shortcuts, global average pool, a linear head."""
    from torch import nn

    class Block(nn.Module):
        def __init__(self, cin, cout, stride):
            super().__init__()
            self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(cout, BN_EPS, BN_MOMENTUM)
            self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(cout, BN_EPS, BN_MOMENTUM)
            self.shortcut = nn.Identity()
            if stride != 1 or cin != cout:
                self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                              nn.BatchNorm2d(cout, BN_EPS, BN_MOMENTUM))

        def forward(self, x):
            y = self.bn2(self.conv2(self.bn1(self.conv1(x)).relu()))
            return (self.shortcut(x) + y).relu()

    return nn.Sequential(nn.Conv2d(in_channels, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16, BN_EPS, BN_MOMENTUM),
                         nn.ReLU(), Block(16, 16, 1), Block(16, 32, 2), Block(32, 64, 2),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, num_classes))


def init_weights(model, gen) -> None:
    """He normal (fan-out) convolutions, LeCun normal (truncated at 2 std) head, zero bias, as nondet_jax."""
    from torch import nn

    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu", generator=gen)
        elif isinstance(m, nn.Linear):
            std = (1.0 / m.in_features) ** 0.5 / 0.87962566103423978
            nn.init.trunc_normal_(m.weight, 0.0, std, -2 * std, 2 * std, generator=gen)
            nn.init.zeros_(m.bias)


def bitflip_(model, gen) -> None:
    """Move one weight, uniform over the convolution and linear kernels, by one ulp up or down (a fair coin)."""
    import torch
    from torch import nn

    kernels = [m.weight for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    j = int(torch.randint(sum(w.numel() for w in kernels), (1,), generator=gen))
    toward = float("inf") if bool(torch.rand(1, generator=gen) < 0.5) else -float("inf")
    with torch.no_grad():
        for w in kernels:
            if j < w.numel():
                v = w.view(-1)[j:j + 1]  # the weights as initialised: contiguous
                v.copy_(torch.nextafter(v, torch.full_like(v, toward)))
                return
            j -= w.numel()


def random_crop(x, padding: int, gen):
    """One crop offset per image, uniform over the (2p+1)^2 positions of the zero-padded image. Returns an
    NCHW view with channels-last strides."""
    import torch
    import torch.nn.functional as F

    b, _, h, w = x.shape
    xp = F.pad(x, (padding,) * 4).permute(0, 2, 3, 1)  # NHWC
    off = torch.randint(0, 2 * padding + 1, (b, 2), generator=gen)
    rows = (off[:, :1] + torch.arange(h))[:, :, None]
    cols = (off[:, 1:] + torch.arange(w))[:, None, :]
    return xp[torch.arange(b)[:, None, None], rows, cols].permute(0, 3, 1, 2)


def lr_at(step: int, total: int, warmup: int) -> float:
    """Linear warm-up from 0 over ``warmup`` steps, then a cosine to 0 at ``total`` (optax's
    warmup_cosine_decay_schedule, the step index counted from 0 as nondet_jax does)."""
    import math

    if step < warmup:
        return LR * step / warmup
    return LR * 0.5 * (1 + math.cos(math.pi * min(step - warmup, total - warmup) / (total - warmup)))


def source_seed(source: str, replica: int, varies: bool, seed: int = STUDY_SEED) -> int:
    """One seed per (study, source, replica); replica 0 of the seed stream is the one every replica shares."""
    return 1_000_000 * seed + 1000 * (SOURCES.index(source) + 1) + (replica + 1 if varies else 0)


def train_replica(arm: str, replica: int, data, epochs: int, channels_last: bool):
    """One replica of one arm: returns (test accuracy in %, the final weights' bytes)."""
    import torch
    import torch.nn.functional as F

    x_train, y_train, x_test, y_test = data
    varied = VARIES[arm]
    gens = {s: torch.Generator().manual_seed(source_seed(s, replica, s in varied)) for s in SOURCES}
    layout = torch.channels_last if channels_last else torch.contiguous_format
    model = resnet8()
    init_weights(model, gens["init"])
    if "bitflip" in varied:
        bitflip_(model, gens["bitflip"])
    model = model.to(memory_format=layout)
    opt = torch.optim.SGD(model.parameters(), lr=0.0, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)
    n = len(x_train)
    steps = n // BATCH  # the last incomplete batch is dropped
    total, warmup = epochs * steps, min(round(WARMUP_EPOCHS * steps), epochs * steps - 1)
    model.train()
    for epoch in range(epochs):
        order = torch.randperm(n, generator=gens["data_order"])[:steps * BATCH].view(steps, BATCH)
        for i in range(steps):
            x, y = x_train[order[i]], y_train[order[i]]
            x = random_crop(x, CROP_PADDING, gens["augmentation"]).contiguous(memory_format=layout)
            if "batch_order" in varied:
                p = torch.randperm(BATCH, generator=gens["batch_order"])
                x, y = x[p], y[p]
            for group in opt.param_groups:
                group["lr"] = lr_at(epoch * steps + i, total, warmup)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    model.eval()
    with torch.inference_mode():
        acc = (model(x_test.contiguous(memory_format=layout)).argmax(1) == y_test).double().mean().item()
        weights = b"".join(t.detach().contiguous().numpy().tobytes() for t in model.state_dict().values())
    return 100.0 * acc, weights


def torch_study(arms, replicas: int, epochs: int, threads: int, channels_last: bool) -> dict:
    """The study: every arm, every replica, one after the other; prints the table as it goes."""
    import hashlib

    import torch

    torch.set_num_threads(threads)
    data = load_digits()
    out = {"torch": torch.__version__, "threads": torch.get_num_threads(), "channels_last": channels_last,
           "arms": {}}
    print(f"pytorch: {len(arms)} arms x {replicas} replicas of resnet8 on digits ({len(data[0])} train / "
          f"{len(data[2])} test), {epochs} epochs, {threads} thread(s), "
          f"{'channels-last' if channels_last else 'contiguous'}", flush=True)
    for arm in arms:
        t0 = time.perf_counter()
        accs, digests = [], []
        for r in range(replicas):
            acc, weights = train_replica(arm, r, data, epochs, channels_last)
            accs.append(acc)
            digests.append(hashlib.sha256(weights).hexdigest())
        row = {"accuracies_pct": accs, "accuracy_mean_pct": statistics.fmean(accs),
               "accuracy_std_pct": statistics.stdev(accs) if len(accs) > 1 else None,
               "bitwise_identical": len(set(digests)) == 1, "seconds": round(time.perf_counter() - t0, 3)}
        out["arms"][arm] = row
        print(f"arm {arm}: test accuracy {row['accuracy_mean_pct'] / 100:.4f} +- "
              f"{(row['accuracy_std_pct'] or 0) / 100:.4f}, {row['seconds']:.1f} s", flush=True)
    print(f"{'arm':14} {'R':>2} {'accuracy %':>10} {'acc std %':>9}")
    for arm, row in out["arms"].items():
        std = "bitwise identical" if row["bitwise_identical"] and replicas > 1 else fmt(row["accuracy_std_pct"])
        print(f"{arm:14} {replicas:2d} {row['accuracy_mean_pct']:10.2f} {std:>9}")
    return out


def probe(rounds: int, steps: int) -> dict:
    """Milliseconds per training step of this ResNet-8 (batch 128 of digits) per (threads, layout)."""
    import torch
    import torch.nn.functional as F

    x_train, y_train, _, _ = load_digits()
    x, y = x_train[:BATCH], y_train[:BATCH]
    configs = [(t, cl) for t in (1, 2) for cl in (True, False)]
    best = {c: float("inf") for c in configs}
    for _ in range(rounds):  # interleaved: every config once per round, the best round kept
        for threads, cl in configs:
            torch.set_num_threads(threads)
            layout = torch.channels_last if cl else torch.contiguous_format
            model = resnet8().to(memory_format=layout).train()
            opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)
            xb = x.contiguous(memory_format=layout)
            for i in range(steps + 3):  # 3 warm-up steps
                if i == 3:
                    t0 = time.perf_counter()
                loss = F.cross_entropy(model(xb), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
            best[threads, cl] = min(best[threads, cl], 1000 * (time.perf_counter() - t0) / steps)
    rows = [{"threads": t, "layout": "channels_last" if cl else "contiguous", "ms_per_step": round(ms, 3)}
            for (t, cl), ms in best.items()]
    return {"rounds": rounds, "steps": steps, "rows": rows, "best": min(rows, key=lambda r: r["ms_per_step"])}


# ---------------------------------------------------------------------------- the side-by-side run


def child_result(cmd: list[str], env: dict) -> tuple[float, str, int]:
    """Run ``cmd``, echoing its output as it comes; (wall seconds from start to exit, stdout, return code)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        print("  | " + line, end="", flush=True)
    rc = proc.wait()
    return time.perf_counter() - t0, "".join(lines), rc


def machine() -> dict:
    model = platform.processor() or platform.machine()
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, timeout=30).stdout.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return {"cpu": model, "cores": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}


def load() -> list[float]:
    return [round(v, 2) for v in os.getloadavg()]


def jax_table(run: Path) -> dict:
    with open(run / "arms.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    table = {}
    for row in rows:
        std = row["accuracy_std_pct"]
        table[row["arm"]] = {"replicas": int(row["replicas"]), "accuracy_mean_pct": float(row["accuracy_mean_pct"]),
                             "accuracy_std_pct": float(std) if std else None, "seconds": float(row["seconds"])}
    with open(run / "replicas.csv", newline="") as f:
        for row in csv.DictReader(f):  # long: one row per arm, replica and score (older folders: test_accuracy_pct)
            if row.get("metric", "test_accuracy") == "test_accuracy":
                value = row["value"] if "value" in row else row["test_accuracy_pct"]
                table[row["arm"]].setdefault("accuracies_pct", []).append(float(value))
    return table


def fmt(v) -> str:
    return "     —" if v is None else f"{v:6.2f}"


def print_tables(arms, replicas: int, jax: dict, torch_: dict, jax_s: float, torch_s: float) -> None:
    print(f"\n{'arm':14} {'R':>2} | nondet_jax acc %  std % | PyTorch acc %  std %")
    print("-" * 64)
    for arm in arms:
        j, t = jax[arm], torch_[arm]
        print(f"{arm:14} {replicas:2d} |           {fmt(j['accuracy_mean_pct'])} {fmt(j['accuracy_std_pct'])} |"
              f"        {fmt(t['accuracy_mean_pct'])} {fmt(t['accuracy_std_pct'])}")
    print("-" * 64)
    print(f"wall clock: nondet_jax {jax_s:.1f} s, PyTorch {torch_s:.1f} s, ratio (nondet_jax / PyTorch) "
          f"{jax_s / torch_s:.2f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help=f"{QUICK['epochs']} epochs, {QUICK['replicas']} replicas, arms {','.join(QUICK['arms'])} "
                        "(a smoke test), and a shorter probe")
    p.add_argument("--epochs", type=int, help=f"epochs (default {EPOCHS}, the preset's)")
    p.add_argument("--replicas", type=int, help=f"replicas per arm (default {REPLICAS})")
    p.add_argument("--arms", help=f"comma list of arms among {','.join(ARMS)} (default: all seven)")
    p.add_argument("--threads", type=int, help="torch.set_num_threads for the PyTorch side (default: the probe's "
                                               "fastest of 1 and 2)")
    p.add_argument("--layout", choices=("channels_last", "contiguous"),
                   help="memory layout of the PyTorch side (default: the probe's fastest)")
    p.add_argument("--jax-compile-cache", default="off",
                   help="the sweep's --compile-cache: 'off' (cold, the default) or a folder")
    p.add_argument("--jax-out", type=Path, help="the sweep's run folder, kept (must not exist; default: a temporary "
                                                "folder, removed)")
    p.add_argument("--jax-set", action="append", default=[], metavar="KEY=VALUE",
                   help="a --set for the sweep (repeatable), e.g. train.replica_threads=1: the study as it ran before")
    p.add_argument("--out", type=Path, default=RESULTS / "peer_study_pytorch.json")
    p.add_argument("--torch-child", help=argparse.SUPPRESS)  # JSON: the PyTorch study in this process
    p.add_argument("--probe-child", help=argparse.SUPPRESS)  # JSON: the probe in this process
    args = p.parse_args(argv)

    if args.torch_child:
        spec = json.loads(args.torch_child)
        res = torch_study(spec["arms"], spec["replicas"], spec["epochs"], spec["threads"], spec["channels_last"])
        Path(spec["result"]).write_text(json.dumps(res))
        return 0
    if args.probe_child:
        spec = json.loads(args.probe_child)
        Path(spec["result"]).write_text(json.dumps(probe(spec["rounds"], spec["steps"])))
        return 0

    epochs = args.epochs or (QUICK["epochs"] if args.quick else EPOCHS)
    replicas = args.replicas or (QUICK["replicas"] if args.quick else REPLICAS)
    arms = tuple(a.strip() for a in args.arms.split(",")) if args.arms else (QUICK["arms"] if args.quick else ARMS)
    unknown = [a for a in arms if a not in VARIES]
    if unknown:
        p.error(f"unknown arm(s) {','.join(unknown)}; choose among {','.join(ARMS)}")
    if args.jax_out is not None and args.jax_out.exists():
        p.error(f"--jax-out {args.jax_out} exists; name a fresh folder (the sweep would resume it)")

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    res = {"machine": machine(), "load_average": {"before": load()},
           "study": {"arms": list(arms), "replicas": replicas, "epochs": epochs, "batch_size": BATCH,
                     "model": "resnet8", "dataset": "digits", "preset": "sources", "quick": args.quick}}
    tmp = Path(tempfile.mkdtemp(prefix="peer_study_"))
    try:
        # 1. the probe: PyTorch's threads and layout for this machine (not part of its wall time)
        if args.threads is None or args.layout is None:
            spec = {"rounds": 2, "steps": 5 if args.quick else 20, "result": str(tmp / "probe.json")}
            _, _, rc = child_result([sys.executable, __file__, "--probe-child", json.dumps(spec)], env)
            if rc:
                print(f"the PyTorch probe failed (exit {rc})", file=sys.stderr)
                return 1
            res["probe"] = json.loads((tmp / "probe.json").read_text())
            best = res["probe"]["best"]
            print("probe (ms per step): " + ", ".join(f"{r['threads']} thread(s) {r['layout']} {r['ms_per_step']}"
                                                      for r in res["probe"]["rows"]))
        else:
            best = {}
        threads = args.threads or best["threads"]
        layout = args.layout or best["layout"]

        # 2. nondet_jax: the sweep, cold, into a fresh folder
        run = args.jax_out or tmp / "run"
        cache = args.jax_compile_cache
        cache_entries = None if cache.lower() == "off" else (
            sum(1 for _ in Path(cache).expanduser().rglob("*") if _.is_file()) if Path(cache).expanduser().exists()
            else 0)
        cmd = [sys.executable, "-m", "nondet_jax.sweep"]
        for flag, value, default in (("--epochs", epochs, EPOCHS), ("--replicas", replicas, REPLICAS),
                                     ("--arms", ",".join(arms), ",".join(ARMS))):
            if value != default:
                cmd += [flag, str(value)]
        cmd += ["--compile-cache", cache, "--out", str(run), "--no-progress"]
        for setting in args.jax_set:
            cmd += ["--set", setting]
        print("nondet_jax: " + " ".join(cmd[1:]), flush=True)
        jax_s, jax_out, rc = child_result(cmd, env)
        if rc:
            print(f"nondet_jax.sweep failed (exit {rc})", file=sys.stderr)
            return 1
        res["load_average"]["between"] = load()
        environment = json.loads((run / "environment.json").read_text())
        done = [ln for ln in jax_out.splitlines() if ln.startswith("done in ")]
        res["nondet_jax"] = {
            "command": "python " + " ".join(cmd[1:]).replace(str(run), "<fresh folder>"),
            "wall_s": round(jax_s, 2), "reported_s": float(done[-1].split()[2]) if done else None,
            "compile_cache": cache, "persistent_compile_cache_used": cache.lower() != "off",
            "compile_cache_entries_before": cache_entries, "strategy": environment.get("strategy"),
            "epoch_shape": environment.get("epoch_shape"), "replica_threads": environment.get("replica_threads"),
            "table": jax_table(run)}

        # 3. PyTorch: the same study as a plain program
        spec = {"arms": list(arms), "replicas": replicas, "epochs": epochs, "threads": threads,
                "channels_last": layout == "channels_last", "result": str(tmp / "torch.json")}
        cmd = [sys.executable, __file__, "--torch-child", json.dumps(spec)]
        print(f"pytorch: {Path(__file__).name} --torch-child (threads {threads}, {layout})", flush=True)
        torch_s, _, rc = child_result(cmd, env)
        if rc:
            print(f"the PyTorch study failed (exit {rc})", file=sys.stderr)
            return 1
        res["load_average"]["after"] = load()
        t = json.loads((tmp / "torch.json").read_text())
        res["pytorch"] = {"command": f"python benchmarks/{Path(__file__).name} (its --torch-child)",
                          "wall_s": round(torch_s, 2), "threads": t["threads"], "layout": layout,
                          "threads_chosen_by": "--threads" if args.threads else "probe",
                          "layout_chosen_by": "--layout" if args.layout else "probe", "table": t["arms"]}
        res["versions"] = {**environment.get("versions", {}), "torch": t["torch"], "python": platform.python_version()}
        res["ratio"] = round(jax_s / torch_s, 3)
        res["ratio_means"] = "nondet_jax wall / PyTorch wall: above 1, nondet_jax took longer to the same table"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    print(f"\nmachine: {res['machine']['cpu']}, {res['machine']['cores']} cores; load average before "
          f"{res['load_average']['before']}, between {res['load_average']['between']}, after "
          f"{res['load_average']['after']}")
    print_tables(arms, replicas, res["nondet_jax"]["table"], res["pytorch"]["table"], jax_s, torch_s)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
