"""Three learning rates, told apart by the instruments.

ResNet-8 on the embedded digits data (the default study's model and data), plain SGD (no momentum,
no weight decay, constant learning rate, so the classical stability threshold of gradient descent
is sharpness = 2 / lr), trained through ``make_train`` with instruments on (via the library).
Three learning rates: too small, good, large. The instruments read:

* Alpha (Cockpit's normalised step length along each update: -1 = no progress, 0 = step to the
  minimum of the local quadratic fit, 1 = step to the other side): about -0.5 (undershooting) for
  the small step, about 0 for the good one, positive (overshooting) for the large one;
* HessMaxEV against 2 / lr: far below the threshold for the small step; for the good and the large
  step the sharpness is pushed down to about 2 / lr (the edge of stability, Cohen et al. 2021).

On digits with BatchNorm the large rate still trains (BatchNorm lets the weights grow, which
lowers the effective step): the instruments show it overshooting at the edge of stability, not
failing. Measured (4 epochs, 1 replica, CPU): too small 0.003: Alpha -0.5, HessMaxEV 37 vs 2/lr
667, loss 2.0; good 0.1: Alpha -0.01, HessMaxEV 12 vs 20, loss 0.23; large 1.6: Alpha 0.34,
HessMaxEV 1.8 vs 1.25, loss 0.04.

Run ``python experiments/instruments_showcase.py [out.png]`` (default docs/instruments_showcase.png).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from nondet_jax.config import from_flat
from nondet_jax.data import load_dataset
from nondet_jax.data.pipeline import epoch_indices
from nondet_jax.sources import arm_keys, arm_sources, perturbations, replica_slice
from nondet_jax.train import DataSpec, epoch_metrics, make_train

LRS = {"too small": 0.003, "good": 0.1, "large": 1.6}
EPOCHS = 4
QUANTITIES = "Loss,Alpha,HessMaxEV,GradNorm,UpdateSize"


def train(lr: float, data, replicas: int = 1) -> dict:
    cfg = from_flat({"optim.lr": lr, "optim.momentum": 0, "optim.weight_decay": 0, "optim.schedule": "constant",
                     "train.epochs": EPOCHS, "instruments.config": QUANTITIES,
                     "instruments.every": 2, "instruments.hess_iters": 8})
    spec = DataSpec(len(data.x_train), tuple(data.x_train.shape[1:]), data.num_classes, data.name)
    fns = make_train(cfg, spec)
    varied = arm_sources("init")
    keys_all, perturb = arm_keys(0, varied, replicas), perturbations(varied)
    x, y = jnp.asarray(data.x_train), jnp.asarray(data.y_train)
    # One jitted train_step driven from Python (the body of train_epoch's scan): one small program to
    # compile instead of an unrolled epoch of instrumented steps, the same numbers.
    init, step = jax.jit(fns.init), jax.jit(fns.train_step)
    runs = []
    for r in range(replicas):
        keys = replica_slice(keys_all, r)
        state = init(keys, perturb, x[:1])
        ms = []
        for e in range(EPOCHS):
            idx = epoch_indices(keys.data_order, e, spec.n_train, fns.batch_size)
            for i in range(fns.steps_per_epoch):
                state, out = step(state, x, y, keys, perturb, jnp.int32(e), jnp.int32(i), idx[i])
                ms.append(jax.tree.map(np.asarray, epoch_metrics(out)))
        runs.append(jax.tree.map(lambda *a: np.stack(a), *ms))
    out = jax.tree.map(lambda *a: np.stack(a), *runs)  # leaves (R, T, ...)
    out["step"] = np.arange(out["loss"].shape[1])
    return out


def summary(name: str, lr: float, m: dict) -> dict:
    inst = m["instruments"]
    alpha = inst["Alpha"]
    sharp = inst["HessMaxEV"]
    late = m["step"] >= m["step"][-1] // 2
    return {"lr": lr, "name": name, "alpha_median": float(np.nanmedian(alpha)),
            "alpha_late": float(np.nanmedian(alpha[:, late])),
            "sharpness_late": float(np.nanmedian(sharp[:, late])), "two_over_lr": 2 / lr,
            "final_loss": float(np.mean(m["loss"][:, -11:]))}


def figure(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 3, figsize=(11, 7.5), sharex=True, constrained_layout=True)
    for j, (name, (lr, m)) in enumerate(results.items()):
        step = m["step"]
        for row, key in enumerate(("loss", "Alpha", "HessMaxEV")):
            ax = axes[row, j]
            arr = m["loss"] if key == "loss" else m["instruments"][key]
            for r in range(arr.shape[0]):
                ok = np.isfinite(arr[r])
                ax.plot(step[ok], arr[r][ok], ".-" if key != "loss" else "-", ms=2.5, lw=0.9, alpha=0.8,
                        color=f"C{r}", label=f"replica {r}" if (row == 0 and j == 0) else None)
            if key == "loss":
                ax.set_title(f"{name}: lr = {lr:g}", fontsize=11)
                ax.set_yscale("log")
            if key == "Alpha":
                ax.axhline(0, color="k", ls="--", lw=0.8)
                ax.set_ylim(-1.2, 2.5)
            if key == "HessMaxEV":
                ax.axhline(2 / lr, color="k", ls="--", lw=1, label="2 / lr")
                ax.set_yscale("log")
                ax.legend(fontsize=8, loc="lower right")
            if j == 0:
                ax.set_ylabel({"loss": "training loss", "Alpha": "Alpha", "HessMaxEV": "HessMaxEV"}[key])
            if row == 2:
                ax.set_xlabel("step")
    axes[0, 0].legend(fontsize=8)
    fig.suptitle("ResNet-8 on digits, plain SGD: what the instruments say about the learning rate", fontsize=12)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", nargs="?", type=Path, default=Path("docs/instruments_showcase.png"), help="figure path")
    out = p.parse_args(argv).out
    data = load_dataset("digits")
    results = {}
    for name, lr in LRS.items():
        print(f"training lr={lr} ({name}) ...", flush=True)
        results[name] = (lr, train(lr, data))
    rows = [summary(name, lr, m) for name, (lr, m) in results.items()]
    print(f"\n{'':10s} {'lr':>6s} {'Alpha med':>10s} {'Alpha 2nd half':>15s} {'HessMaxEV 2nd half':>19s} "
          f"{'2/lr':>7s} {'final loss':>11s}")
    for s in rows:
        print(f"{s['name']:10s} {s['lr']:6g} {s['alpha_median']:10.2f} {s['alpha_late']:15.2f} "
              f"{s['sharpness_late']:19.1f} {s['two_over_lr']:7.1f} {s['final_loss']:11.3f}")
    figure(results, out)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
