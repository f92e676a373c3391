"""The instability experiment: how far do one-ulp (``bitflip``) and reduction-order (``batch_order``)
replicas diverge, epoch by epoch, compared with a new initialisation (``init``)?

Reads the preset ``nondet_jax/presets/instability.yaml`` (ResNet-8 on the embedded digits, 60 epochs, R
replicas per arm), trains each arm with the library's own strategy and keys, and after every epoch
(and at the initial weights) evaluates every replica on the test set: pairwise disagreement, linear
CKA of penultimate features and relative weight distance, each as the mean over the R(R-1)/2 pairs
and per pair. Writes ``experiments/results/instability.json`` after each arm (a rerun skips arms
already there) and the figure ``docs/instability.png``.

Run ``python experiments/instability.py`` (about 15 minutes on 2 cores); ``--plot-only`` redraws
the figure and reprints the table from the JSON; ``--epochs N`` shortens it (smoke runs).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
PRESET = ROOT / "nondet_jax" / "presets" / "instability.yaml"
OUT = ROOT / "experiments" / "results" / "instability.json"
FIGURE = ROOT / "docs" / "instability.png"
sys.path.insert(0, str(ROOT))


def train_arm_curves(config, data, fns, arm: str) -> dict:
    """Per-epoch pairwise disagreement, CKA and weight distance of one arm's replicas."""
    import jax.numpy as jnp

    from nondet_jax.analysis import metrics as M
    from nondet_jax.replicas.choice import make_strategy
    from nondet_jax.replicas.loop import train_replicas
    from nondet_jax.replicas.rule import resolve_strategy
    from nondet_jax.sources import arm_keys, arm_sources, perturbations

    study = config.study
    strategy = make_strategy(fns, resolve_strategy(study.strategy, study.replicas)[0])
    varied = arm_sources(arm)
    keys, perturb = arm_keys(study.seed, varied, study.replicas), perturbations(varied)
    labels = np.asarray(data.y_test)
    x_te = jnp.asarray(data.x_test)
    curves = {"epoch": [], "disagreement": [], "cka": [], "weight_distance": [], "accuracy": []}

    def record(epoch, state, distances):
        logits, feats = (np.asarray(a) for a in strategy.evaluate(state, x_te))
        curves["epoch"].append(epoch)
        curves["disagreement"].append(M.disagreement(logits).tolist())
        curves["cka"].append(M.linear_cka(feats).tolist())
        curves["weight_distance"].append(np.asarray(distances).tolist())
        curves["accuracy"].append(M.accuracy(logits, labels).tolist())

    t0 = time.perf_counter()
    state0 = strategy.init(keys, perturb, jnp.asarray(data.x_train[:1]))
    record(0, state0, M.weight_distance(M.flatten_weights(state0.params)))
    train_replicas(strategy, keys, perturb, data, config.train.epochs,
                   on_epoch=lambda p: record(p.epoch, p.state, p.weight_distance[-1]))
    return {"arm": arm, "replicas": study.replicas, "seconds": round(time.perf_counter() - t0, 1), **curves}


def run(epochs: int | None, out: Path) -> dict:
    from nondet_jax import config as cfg
    from nondet_jax.study.prepare import prepare

    flat = cfg.load_file(PRESET)
    if epochs:
        flat["train.epochs"] = epochs
    config = cfg.from_flat(flat)
    data, fns = prepare(config)
    result = json.loads(out.read_text()) if out.exists() else {}
    if result.get("config") != cfg.to_dict(config):
        result = {"config": cfg.to_dict(config), "arms": {}}
    for arm in config.study.arms:
        if arm in result["arms"]:
            continue
        print(f"training {arm} ({config.study.replicas} replicas, {config.train.epochs} epochs)", flush=True)
        result["arms"][arm] = train_arm_curves(config, data, fns, arm)
        out.parent.mkdir(parents=True, exist_ok=True)
        from nondet_jax.store.io import atomic_write_json

        atomic_write_json(out, result)
    return result


def table(result: dict) -> str:
    """Mean over pairs at a few epochs, with the report's 95% replica-jackknife interval at the last one
    (on the metric's log scale, within its range; "n/a" where the replicas are too alike to estimate)."""
    from nondet_jax.analysis.stats import pairwise_summary

    arms = result["arms"]
    last = min(len(a["epoch"]) for a in arms.values()) - 1
    marks = sorted({0, 1, 2, 5, 10, 20, 40, last} & set(range(last + 1)))
    lines = [f"{'arm':<12}{'metric':<17}" + "".join(f"{'ep ' + str(e):>9}" for e in marks) + "   last epoch [95% CI]"]
    for arm, a in arms.items():
        for key, scale, unit in (("disagreement", 100, "%"), ("cka", 1, ""), ("weight_distance", 1, "")):
            vals = [float(np.mean(a[key][e])) * scale for e in marks]
            lo, hi = pairwise_summary(key, np.asarray(a[key][last]), a["replicas"])["ci"]
            ci = f"[{lo * scale:.3g}, {hi * scale:.3g}]" if np.isfinite(lo) else "n/a"
            lines.append(f"{arm:<12}{key + unit:<17}" + "".join(f" {v:>8.3g}" for v in vals) + f"   {ci}")
        lines.append(f"{arm:<12}{'accuracy %':<17}" + "".join(f" {np.mean(a['accuracy'][e]) * 100:>8.4g}" for e in marks))
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    panels = (("disagreement", 100, "pairwise disagreement on test (%)", True),
              ("cka", 1, "linear CKA of features (1 = same)", False),
              ("weight_distance", 1, "||θa − θb|| / ||θa||", True))
    for i, (arm, a) in enumerate(result["arms"].items()):
        ep = np.asarray(a["epoch"])
        for ax, (key, scale, label, log) in zip(axes, panels):
            v = np.asarray(a[key], dtype=float) * scale  # (epochs + 1, pairs)
            lo, mid, hi = v.min(1), v.mean(1), v.max(1)
            if log:  # exact zeros (identical predictions or weights) have no place on a log axis: not drawn
                lo, mid, hi = (np.where(x > 0, x, np.nan) for x in (lo, mid, hi))
            ax.plot(ep, mid, color=f"C{i}", label=f"{arm} (mean over pairs)")
            ax.fill_between(ep, lo, hi, color=f"C{i}", alpha=0.2, lw=0)
            ax.set_xlabel("epoch (0 = initial weights)")
            ax.set_ylabel(label)
            if log:
                ax.set_yscale("log")
    axes[0].legend(fontsize=8)
    r = next(iter(result["arms"].values()))["replicas"]
    fig.suptitle(f"How far replicas diverge, per epoch: ResNet-8 on digits, {r} replicas per arm "
                 "(band: min-max over pairs)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=None, help="override the preset's 60 epochs (smoke runs)")
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--figure", type=Path, default=FIGURE)
    p.add_argument("--plot-only", action="store_true")
    args = p.parse_args(argv)
    result = json.loads(args.out.read_text()) if args.plot_only else run(args.epochs, args.out)
    print(table(result))
    plot(result, args.figure)
    print(f"wrote {args.out} and {args.figure}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
