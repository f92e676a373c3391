"""nondet_jax's instruments side by side with the real Cockpit: the same model, weights and batches.

The peer is Cockpit itself (cockpit-for-pytorch 1.0.2 on BackPACK 1.7.1, torch 2.13.0): install it
with ``pip install ".[peer]" --extra-index-url https://download.pytorch.org/whl/cpu``. The JAX side
is what a study runs on a user's own Flax model: ``nondet_jax.instruments.trainer.for_model`` with
``evaluate_outputs`` (per-example quantities from the training pass's own tape, ``train_pass``;
HessTrace/TICDiag/TICTrace from the exact GGN diagonal, ``curvature=ggn``), one jitted training step.

Two parts, each in a child process of its own (the values part runs JAX in float64):

``values``: float64, plain SGD (lr 0.1), the first ``--steps`` + 1 batches of the embedded digits
data in order, every step tracked, every quantity both compute (``QUANTITIES``), for two models: an
MLP 64-32-10 (batch 64) and the CNN of the speed part (batch 128). Both frameworks start from the
same weights (Flax's initialisation, copied into torch). Per quantity: the largest relative
difference over the steps (histograms: the largest count difference). HessMaxEV is approximate in
both (Lanczos here, Cockpit's power iteration to rtol 1e-3), so on the MLP both are compared with the
largest eigenvalue of the dense Hessian, and the row says whether this project's
``HessMaxEVError`` covers its error.

``speed``: float32, the CNN (conv 3x3 32 - ReLU - max-pool 2 - conv 3x3 64 - ReLU - max-pool 2 -
dense 10) on digits (8x8x1), batch 128, plain SGD. Per framework: the uninstrumented step, and
economy, business and full tracked every step and every 16 steps; every 16 steps, the JAX side
reads the schedule in Python (``update(track=...)``: a program for tracked steps, one for the others,
as Cockpit decides in Python) and, in the ``/switch`` rows, on the device (one program, a
``lax.switch``, what a study's scanned epoch does). All variants run in interleaved
rounds (each round runs every variant's next block in turn, the order reversed every other round):
a block is 4 steps for every-step variants and one whole 16-step cycle otherwise; a variant's ms per
step is the median over rounds of its blocks' mean step time, and its ratio is that over the same
framework's uninstrumented step. Both frameworks on one thread (``torch.set_num_threads(1)``;
XLA's ``--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1``).

    python benchmarks/peer_cockpit.py                 # both parts (~5 min on 2 cores)
    python benchmarks/peer_cockpit.py --quick         # 2 steps, 1 round: a smoke test
    python benchmarks/peer_cockpit.py --jax-only      # the JAX side alone (no torch needed)

Writes benchmarks/results/peer_cockpit.json (``--out``).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from nondet_jax.store.io import atomic_write_json

QUANTITIES = ("Loss", "GradNorm", "Distance", "UpdateSize", "NormTest", "InnerTest", "OrthoTest", "Alpha", "CABS",
              "EarlyStopping", "MeanGSNR", "GradHist1d", "GradHist2d", "HessTrace", "TICDiag", "TICTrace",
              "HessMaxEV")
PER_LAYER = ("GradNorm", "Distance", "UpdateSize", "HessTrace")  # Cockpit gives one value per parameter
CONFIGS = ("economy", "business", "full")
EVERY = (1, 16)
TARGETS = {("economy", 1): 1.5, ("economy", 16): 1.1, ("business", 1): 2.0, ("full", 1): 6.0}  # issue 27
LR = 0.1
ONE_THREAD = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"


# ---------------------------------------------------------------------------------------------- models
def flax_model(name: str):
    import flax.linen as nn

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            hidden = nn.relu(nn.Dense(32)(x.reshape((x.shape[0], -1))))  # Dense_0
            return nn.Dense(10)(hidden)

    class CNN(nn.Module):
        @nn.compact
        def __call__(self, x):
            for width in (32, 64):
                x = nn.relu(nn.Conv(width, (3, 3), padding=1)(x))
                x = nn.max_pool(x, (2, 2), strides=(2, 2))
            x = x.transpose(0, 3, 1, 2).reshape((x.shape[0], -1))  # torch's flatten order (C, H, W)
            return nn.Dense(10)(x)

    return {"mlp": MLP, "cnn": CNN}[name]()


def torch_model(name: str, params):
    """The torch twin of ``flax_model(name)`` holding ``params`` (Flax's), and the Flax leaf of each
    torch parameter, in ``model.parameters()`` order."""
    import torch

    def linear(k, b):
        m = torch.nn.Linear(*np.shape(k))
        m.weight.data = torch.as_tensor(np.asarray(k).T.copy())
        m.bias.data = torch.as_tensor(np.asarray(b).copy())
        return m

    def conv(k, b):
        m = torch.nn.Conv2d(np.shape(k)[2], np.shape(k)[3], 3, padding=1)
        m.weight.data = torch.as_tensor(np.asarray(k).transpose(3, 2, 0, 1).copy())
        m.bias.data = torch.as_tensor(np.asarray(b).copy())
        return m

    if name == "mlp":
        p = params
        layers = [torch.nn.Flatten(), linear(p["Dense_0"]["kernel"], p["Dense_0"]["bias"]), torch.nn.ReLU(),
                  linear(p["Dense_1"]["kernel"], p["Dense_1"]["bias"])]
        leaves = ["Dense_0/kernel", "Dense_0/bias", "Dense_1/kernel", "Dense_1/bias"]
    else:
        p = params
        layers, leaves = [], []
        for i in range(2):
            layers += [conv(p[f"Conv_{i}"]["kernel"], p[f"Conv_{i}"]["bias"]), torch.nn.ReLU(), torch.nn.MaxPool2d(2)]
            leaves += [f"Conv_{i}/kernel", f"Conv_{i}/bias"]
        layers += [torch.nn.Flatten(), linear(p["Dense_0"]["kernel"], p["Dense_0"]["bias"])]
        leaves += ["Dense_0/kernel", "Dense_0/bias"]
    return torch.nn.Sequential(*layers), leaves


def digits_batches(b: int, count: int, dtype):
    """``count`` consecutive batches of ``b`` digits images (NHWC) and labels, in the data's order."""
    from nondet_jax.data import load_dataset
    d = load_dataset("digits")
    n = len(d.x_train)
    idx = [(np.arange(b) + s * b) % n for s in range(count)]
    return [(d.x_train[i].astype(dtype), d.y_train[i].astype(np.int64)) for i in idx]


# ------------------------------------------------------------------------------------------ the JAX side
class JaxSide:
    """One training run with (or without, ``config=None``) instruments, as a study runs a user's model."""

    def __init__(self, model_name: str, params, config: str | None, every: int, total_steps: int):
        import jax
        import optax

        from nondet_jax.config import InstrumentsConfig
        from nondet_jax.instruments import trainer

        model = flax_model(model_name)
        ce = optax.softmax_cross_entropy_with_integer_labels

        def train_loss(params, batch_stats, x, y, dropout_keys):
            logits = model.apply({"params": params}, x)
            return ce(logits, y).mean(), (logits, batch_stats)

        self.tx = optax.sgd(LR)
        self.params, self.opt_state = params, self.tx.init(params)
        if config is None:
            self.inst, self.istate = None, None

            @jax.jit
            def step(params, opt_state, istate, x, y, t):
                (loss, _), grads = jax.value_and_grad(train_loss, has_aux=True)(params, {}, x, y, None)
                updates, opt_state = self.tx.update(grads, opt_state, params)
                return optax.apply_updates(params, updates), opt_state, istate, {"Loss": loss}
        else:
            def evaluate(variables, x):
                return model.apply({"params": variables["params"]}, x), None

            cfg = InstrumentsConfig(config=config, every=every)
            inst = trainer.for_model(cfg, None, train_loss, lambda p, stats, x: stats, total_steps,
                                     outputs=trainer.evaluate_outputs(evaluate, ce))
            self.inst, self.istate = inst, inst.init(params)

            # The schedule read here, in Python, as Cockpit reads it: a program for tracked steps and one
            # for the others, no lax.switch on the device (XLA:CPU's slow path for convolutions in a branch).
            @functools.partial(jax.jit, static_argnames="track")
            def step(params, opt_state, istate, x, y, t, track=None):
                (loss, _), grads, tape = inst.value_grad_and_tape(params, {}, x, y, None)
                updates, opt_state = self.tx.update(grads, opt_state, params)
                istate, values = inst.update(istate, params, trainer.batch_of(x, y, None, False), step=t,
                                             context={}, updates=updates, lr=LR, grads=grads, loss=loss, tape=tape,
                                             track=track)
                return optax.apply_updates(params, updates), opt_state, istate, values
        self._step = step
        self.branch = "python"

    def step(self, x, y, t):
        kw = {} if self.inst is None or self.branch == "device" else {"track": bool(self.inst.schedule(t))}
        self.params, self.opt_state, self.istate, values = self._step(self.params, self.opt_state, self.istate,
                                                                      x, y, t, **kw)
        return values


def init_params(model_name: str, dtype):
    import jax
    import jax.numpy as jnp
    x = jnp.zeros((1, 8, 8, 1), dtype)
    params = flax_model(model_name).init(jax.random.key(0), x)["params"]
    return jax.tree.map(lambda a: a.astype(dtype), params)


# ----------------------------------------------------------------------------------------- the torch side
class CockpitSide:
    """The same run in torch: plain (``config=None``) or under a Cockpit with the named quantities."""

    def __init__(self, model_name: str, params, names, every: int):
        import torch
        from backpack import extend

        self.torch = torch
        model, self.leaves = torch_model(model_name, params)
        self.lossf = torch.nn.CrossEntropyLoss()
        self.individual = torch.nn.CrossEntropyLoss(reduction="none")
        self.cockpit = None
        if names:
            from cockpit import Cockpit, quantities
            from cockpit.utils.schedules import linear
            model, self.lossf = extend(model), extend(self.lossf)
            self.cockpit = Cockpit(model.parameters(), quantities=[getattr(quantities, q)(track_schedule=linear(every))
                                                                  for q in names])
        self.model = model
        self.opt = torch.optim.SGD(model.parameters(), lr=LR)

    def step(self, x, y, t):
        x = self.torch.as_tensor(np.ascontiguousarray(x.transpose(0, 3, 1, 2)))
        y = self.torch.as_tensor(y)
        self.opt.zero_grad()
        out = self.model(x)
        loss = self.lossf(out, y)
        if self.cockpit is None:
            loss.backward()
        else:
            info = {"batch_size": len(y), "individual_losses": self.individual(out, y), "loss": loss,
                    "optimizer": self.opt}
            with self.cockpit(t, info=info):
                loss.backward(create_graph=self.cockpit.create_graph(t))
        self.opt.step()
        return loss


# ---------------------------------------------------------------------------------------------- values
def cockpit_values(out: dict, step: int, name: str, leaves: list[str]):
    v = out[step][name]
    if name in ("GradHist1d", "GradHist2d"):
        return np.asarray(v["hist"], np.float64)
    if name in PER_LAYER:
        per = dict(zip(leaves, np.asarray(v, np.float64)))
        total = float(np.sum(list(per.values()))) if name == "HessTrace" else float(np.linalg.norm(list(per.values())))
        return total, per
    return float(v)


def dense_top_eigenvalue(model_name: str, params, x, y) -> float:
    import jax
    import jax.numpy as jnp
    import optax
    from jax.flatten_util import ravel_pytree
    model = flax_model(model_name)
    flat, unravel = ravel_pytree(params)

    def f(v):
        return optax.softmax_cross_entropy_with_integer_labels(model.apply({"params": unravel(v)}, x), y).mean()

    return float(jnp.linalg.eigvalsh(jax.hessian(f)(flat))[-1])


def values_part(model_name: str, steps: int, jax_only: bool) -> dict:
    import jax
    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp

    b = 64 if model_name == "mlp" else 128
    batches = digits_batches(b, steps + 1, np.float64)
    params = init_params(model_name, jnp.float64)
    ours = JaxSide(model_name, params, ",".join(QUANTITIES), 1, steps + 1)
    vals, exact = [], []
    for t, (x, y) in enumerate(batches):
        if model_name == "mlp" and t < steps:
            exact.append(dense_top_eigenvalue(model_name, ours.params, jnp.asarray(x), jnp.asarray(y)))
        vals.append({k: np.asarray(v) for k, v in ours.step(jnp.asarray(x), jnp.asarray(y), t).items()})
    res = {"model": model_name, "batch_size": b, "steps": steps, "dtype": "float64", "rows": {}}

    def dense_check(row):  # HessMaxEV against the dense Hessian's largest eigenvalue (the MLP only)
        if exact:
            mine = [float(vals[t]["HessMaxEV"]) for t in range(steps)]
            err = [float(vals[t]["HessMaxEVError"]) for t in range(steps)]
            row.update(dense=exact, ours_error_stated=err,
                       ours_rel_err_vs_dense=max(abs(m - e) / e for m, e in zip(mine, exact)),
                       ours_within_stated_error=all(m <= e + 1e-12 * e and e - m <= s
                                                    for m, e, s in zip(mine, exact, err)))
        return row

    if jax_only:
        res["rows"] = {q: {"ours": [float(np.sum(vals[t + (q == "Alpha")][q])) for t in range(steps)]}
                       for q in QUANTITIES}
        dense_check(res["rows"]["HessMaxEV"])
        return res
    import torch
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)
    peer = CockpitSide(model_name, jax.device_get(params), QUANTITIES, 1)
    for t, (x, y) in enumerate(batches):
        peer.step(x, y, t)
    out = peer.cockpit.get_output()
    for q in QUANTITIES:
        row = {"ours": [], "cockpit": [], "max_rel_diff": 0.0}
        for t in range(steps):
            mine = vals[t + 1][q] if q == "Alpha" else vals[t][q]  # ours: Alpha at the step after (see core.py)
            theirs = cockpit_values(out, t, q, peer.leaves)
            if q in ("GradHist1d", "GradHist2d"):
                row["max_count_diff"] = max(row.get("max_count_diff", 0.0), float(np.abs(mine - theirs).max()))
                row["counts"] = int(theirs.sum())
                row.pop("max_rel_diff", None)
                continue
            if q in PER_LAYER:
                theirs, per = theirs
                for leaf, value in per.items():
                    d = abs(float(vals[t][f"{q}/{leaf}"]) - value) / max(abs(value), 1e-300)
                    row["max_rel_diff_per_layer"] = max(row.get("max_rel_diff_per_layer", 0.0), d)
            mine = float(mine)
            row["ours"].append(mine)
            row["cockpit"].append(theirs)
            row["max_rel_diff"] = max(row["max_rel_diff"], abs(mine - theirs) / max(abs(theirs), 1e-300))
        if q == "HessMaxEV" and exact:
            dense_check(row)
            row["cockpit_rel_err_vs_dense"] = max(abs(c - e) / e for c, e in zip(row["cockpit"], exact))
        res["rows"][q] = row
    return res


# ----------------------------------------------------------------------------------------------- speed
def speed_part(rounds: int, quick: bool, jax_only: bool, log) -> dict:
    import jax
    import jax.numpy as jnp

    from nondet_jax.instruments import configurations

    batches = digits_batches(128, 64, np.float32)
    jbatches = [(jnp.asarray(x), jnp.asarray(y)) for x, y in batches]
    params = init_params("cnn", jnp.float32)
    variants = {}
    frameworks = ("jax",) if jax_only else ("jax", "torch")
    if not jax_only:
        import torch
        torch.set_num_threads(1)
    for fw in frameworks:
        for config, every in [(None, 1)] + [(c, k) for c in CONFIGS for k in EVERY]:
            label = f"{fw}/{config or 'off'}" + (f"/every{every}" if config else "")
            if fw == "jax":
                variants[label] = JaxSide("cnn", params, config, every, 10 ** 6)
                if every > 1:  # the same with the schedule read on the device (one program, lax.switch)
                    variants[label + "/switch"] = JaxSide("cnn", params, config, every, 10 ** 6)
                    variants[label + "/switch"].branch = "device"
            else:
                names = {"economy": configurations.ECONOMY, "business": configurations.BUSINESS,
                         "full": configurations.FULL}.get(config, ())
                variants[label] = CockpitSide("cnn", jax.device_get(params), names, every)
    block1 = 2 if quick else 4
    cursor = dict.fromkeys(variants, 0)

    def run_block(label, count):
        side = variants[label]
        t0 = time.perf_counter()
        out = None
        for s in range(cursor[label], cursor[label] + count):
            x, y = jbatches[s % 64] if label.startswith("jax") else batches[s % 64]
            out = side.step(x, y, s)
        if label.startswith("jax"):
            jax.block_until_ready(out)
        # every-16 blocks start at a tracked step; every-step runs go on without a gap (Cockpit's Alpha
        # finishes at the step after the one it starts at)
        cursor[label] += count if count % 16 == 0 or "every1" in label.split("/") else 16
        return (time.perf_counter() - t0) / count

    compile_s = {}
    for label in variants:  # compile (JAX) and warm up (both): a tracked step and the Alpha end point
        t0 = time.perf_counter()
        run_block(label, 2)
        compile_s[label] = time.perf_counter() - t0
        log(f"  {label:28s} first 2 steps in {compile_s[label]:6.1f} s")
    times = {v: [] for v in variants}
    order = list(variants)
    for r in range(rounds):
        for label in order[::-1] if r % 2 else order:
            count = block1 if "every1" in label.split("/") else 16
            times[label].append(run_block(label, count))
        log(f"  round {r + 1}/{rounds}: " + ", ".join(f"{v} {1e3 * t[-1]:.1f}" for v, t in times.items()))
    rows = []
    for fw in frameworks:
        base = float(np.median(times[f"{fw}/off"]))
        for label in variants:
            if label.startswith(fw):
                ms = 1e3 * float(np.median(times[label]))
                _, config, *rest = label.split("/")
                every = int(rest[0][5:]) if rest else None
                branch = None if fw == "torch" or config == "off" else ("device" if "switch" in rest else "python")
                rows.append({"framework": fw, "config": config, "every": every, "schedule_read": branch,
                             "ms_per_step": ms,
                             "ratio": ms / (1e3 * base), "target": TARGETS.get((config, every)),
                             "first_2_steps_s": compile_s[label], "block_ms": [1e3 * t for t in times[label]]})
    return {"model": "cnn", "batch_size": 128, "dtype": "float32", "rounds": rounds, "rows": rows}


# ------------------------------------------------------------------------------------------------ main
def child(args) -> None:
    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    if args.part == "values":
        res = {m: values_part(m, args.steps, args.jax_only) for m in ("mlp", "cnn")}
    else:
        res = speed_part(args.rounds, args.quick, args.jax_only, log)
    print("RESULT " + json.dumps(res))


def versions(jax_only: bool) -> dict:
    from importlib.metadata import version
    names = ["jax", "jaxlib", "flax", "optax"] + ([] if jax_only else ["torch", "backpack-for-pytorch",
                                                                       "cockpit-for-pytorch"])
    return {n: version(n) for n in names}


def print_tables(results: dict) -> None:
    for m, r in results.get("values", {}).items():
        print(f"\nvalues, {m} (batch {r['batch_size']}, {r['steps']} steps, float64): largest relative difference")
        print(f"{'quantity':14s} {'ours vs Cockpit':>16s} {'per layer':>10s}  note")
        for q, row in r["rows"].items():
            if "max_count_diff" in row:
                print(f"{q:14s} {'counts':>16s} {'':>10s}  largest count difference {row['max_count_diff']:.0f} "
                      f"of {row['counts']}")
                continue
            if "max_rel_diff" not in row:  # --jax-only: the dense check alone
                if "dense" in row:
                    print(f"{q:14s} {'':>16s} {'':>10s}  vs dense eigvalsh: ours {row['ours_rel_err_vs_dense']:.1e} "
                          f"(within its stated error: {row['ours_within_stated_error']})")
                continue
            note = ""
            if "dense" in row:
                note = (f"vs dense eigvalsh: ours {row['ours_rel_err_vs_dense']:.1e} (within its stated error: "
                        f"{row['ours_within_stated_error']}), Cockpit {row['cockpit_rel_err_vs_dense']:.1e}")
            per = row.get("max_rel_diff_per_layer")
            print(f"{q:14s} {row['max_rel_diff']:16.1e} {'' if per is None else f'{per:10.1e}'}  {note}")
    s = results.get("speed")
    if s:
        print(f"\nspeed: CNN on digits, batch {s['batch_size']}, {s['dtype']}, one thread each, "
              f"median of {s['rounds']} rounds")
        print(f"{'framework':9s} {'config':9s} {'every':>5s} {'schedule read':>13s} {'ms/step':>9s} {'ratio':>7s} "
              f"{'target':>7s}")
        for row in s["rows"]:
            every = "" if row["every"] is None else str(row["every"])
            target = "" if row["target"] is None else f"{row['target']:.1f}x"
            read = {"python": "in Python", "device": "on device", None: ""}[row["schedule_read"]]
            if row["framework"] == "torch" and row["every"]:
                read = "in Python"
            if row["every"] == 1:
                read = ""  # every step tracked: no branch either way
            print(f"{row['framework']:9s} {row['config']:9s} {every:>5s} {read:>13s} {row['ms_per_step']:9.1f} "
                  f"{row['ratio']:6.2f}x {target:>7s}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", choices=("values", "speed", "both"), default="both")
    ap.add_argument("--steps", type=int, default=5, help="values: tracked steps compared")
    ap.add_argument("--rounds", type=int, default=15, help="speed: interleaved rounds")
    ap.add_argument("--quick", action="store_true", help="2 steps, 1 round, short blocks (a smoke test)")
    ap.add_argument("--jax-only", action="store_true", help="the JAX side alone (no torch, Cockpit or BackPACK)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "peer_cockpit.json")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.rounds = 2, 1
    if args.child:
        child(args)
        return 0
    results = {"machine": {"platform": platform.platform(), "processor": platform.processor(),
                           "cpu_count": os.cpu_count(), "load_avg_at_start": os.getloadavg()},
               "versions": versions(args.jax_only), "command": " ".join(["python", *sys.argv])}
    env = {**os.environ, "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") + " " + ONE_THREAD).strip(),
           "OMP_NUM_THREADS": "1"}
    for part in ("values", "speed") if args.part == "both" else (args.part,):
        cmd = [sys.executable, __file__, "--child", "--part", part, "--steps", str(args.steps),
               "--rounds", str(args.rounds)] + (["--quick"] if args.quick else []) + \
              (["--jax-only"] if args.jax_only else [])
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True)
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode != 0 or not line:
            print(f"the {part} part failed (exit {proc.returncode})", file=sys.stderr)
            return 1
        results[part] = json.loads(line[-1][len("RESULT "):])
    results["machine"]["load_avg_at_end"] = os.getloadavg()
    print_tables(results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out, results)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
