"""``python -m nondet_jax.sweep``: train R replicas per arm and write the run folder.

Thin CLI over :func:`run` (parse, validate, call). Every bad input exits with status 2 and a
one-line error naming the problem and the fix; nothing already written is touched.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

import numpy as np

from nondet_jax import config as cfg
from nondet_jax.config import Config, UsageError

# CLI flag -> dotted config key
FLAGS = {
    "arms": "study.arms",
    "replicas": "study.replicas",
    "seed": "study.seed",
    "strategy": "study.strategy",
    "epochs": "train.epochs",
    "batch_size": "train.batch_size",
    "model": "model.name",
    "width": "model.width",
    "dropout": "model.dropout",
    "dataset": "data.name",
    "data_dir": "data.data_dir",
    "augment": "data.augment",
    "optimizer": "optim.name",
    "lr": "optim.lr",
}


def default_out(config: Config) -> Path:
    """``runs/<dataset>-<model>-<hash of the config without its arms>``: same settings, same folder."""
    d = cfg.to_dict(config)
    d["study"].pop("arms")
    digest = hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:8]
    return Path("runs") / f"{config.data.name}-{config.model.name}-{digest}"


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64)
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def replica_scores(logits: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Test accuracy and mean cross-entropy per replica from (R, n, classes) logits."""
    acc = (logits.argmax(-1) == labels).mean(-1)
    nll = -np.take_along_axis(_log_softmax(logits), labels[None, :, None], -1)[..., 0].mean(-1)
    return acc, nll


def arm_record(arm: str, result, labels: np.ndarray, strategy_reason: str) -> dict:
    """The JSON record of a finished arm: per-replica rows and aggregates (std with ddof=1)."""
    from nondet_jax.sources import arm_sources

    acc, nll = replica_scores(result.logits, labels)
    rows = [{"arm": arm, "replica": r, "test_accuracy": float(acc[r]), "test_loss": float(nll[r]),
             "train_loss": float(result.train_loss[r, -1]), "train_accuracy": float(result.train_accuracy[r, -1]),
             "strategy": result.strategy} for r in range(len(acc))]
    ddof = 1 if len(acc) > 1 else 0
    identical = bool(all(np.array_equal(result.logits[0], result.logits[r]) for r in range(len(acc))))
    return {
        "arm": arm,
        "varied": sorted(arm_sources(arm)),
        "replicas": len(acc),
        "strategy": result.strategy,
        "strategy_reason": strategy_reason,
        "seconds": round(result.seconds, 3),
        "test_accuracy_mean": float(acc.mean()), "test_accuracy_std": float(acc.std(ddof=ddof)),
        "test_loss_mean": float(nll.mean()), "test_loss_std": float(nll.std(ddof=ddof)),
        "std_ddof": ddof,
        "replicas_bitwise_identical": identical,
        "rows": rows,
    }


class Progress:
    """A rich progress bar per arm (replica-epochs, with ETA); silent when stderr is not a terminal."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._bar = None

    def __enter__(self):
        if self.enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as Bar, TextColumn, TimeElapsedColumn, \
                TimeRemainingColumn

            self._bar = Bar(TextColumn("{task.description:<14}"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("replica-epochs"), TimeElapsedColumn(), TimeRemainingColumn(), transient=False)
            self._bar.__enter__()
        return self

    def __exit__(self, *exc):
        if self._bar is not None:
            self._bar.__exit__(*exc)

    def arm(self, name: str, total: int):
        if self._bar is None:
            return lambda n: None
        task = self._bar.add_task(name, total=total)
        return lambda n: self._bar.advance(task, n)


def run(config: Config, out: str | Path | None = None, progress: bool | None = None, log=print) -> dict:
    """Run a study: train every arm not yet finished in ``out`` and write the run folder.

    Returns the summary (also written to ``summary.json``). Raises UsageError on bad input
    before anything is written.
    """
    import jax

    from nondet_jax.data import load_dataset
    from nondet_jax.determinism import environment
    from nondet_jax.replicas import resolve_strategy, run_replicas
    from nondet_jax.sources import arm_keys, arm_sources, perturbations
    from nondet_jax.store import RunStore, flatten_tree
    from nondet_jax.train import DataSpec, make_train

    cfg.validate(config)
    data = load_dataset(config.data.name, config.data.data_dir)
    n_train = len(data.x_train)
    if config.train.batch_size > n_train:
        raise UsageError(f"batch size {config.train.batch_size} is larger than the {n_train} training examples of "
                         f"{data.name}; use --batch-size {n_train} or less")
    out = Path(out) if out is not None else default_out(config)
    study = config.study
    strategy, reason = resolve_strategy(study.strategy, study.replicas)
    spec = DataSpec(n_train, tuple(data.x_train.shape[1:]), data.num_classes, data.name)
    fns = make_train(config, spec)
    if progress is None:
        progress = sys.stderr.isatty()

    with RunStore(out, config) as store:
        env = environment()
        env["strategy"] = {"requested": study.strategy, "chosen": strategy, "reason": reason}
        env["scan_unroll"] = fns.unroll
        store.write_json("environment.json", env)
        log(f"nondet_jax: {len(study.arms)} arms x {study.replicas} replicas of {config.model.name} on {data.name} "
            f"({n_train} train / {len(data.x_test)} test), {config.train.epochs} epochs, strategy {strategy} "
            f"on {jax.default_backend()} -> {out}")
        with Progress(progress) as bar:
            for arm in study.arms:
                if store.arm_done(arm):
                    log(f"arm {arm}: already finished in {out}, reusing it")
                    continue
                varied = arm_sources(arm)
                result = run_replicas(fns, arm_keys(study.seed, varied, study.replicas), perturbations(varied),
                                      data, config.train.epochs, strategy,
                                      bar.arm(arm, study.replicas * config.train.epochs))
                record = arm_record(arm, result, data.y_test, reason)
                store.save_arm(arm, record, result.logits.astype(np.float32), result.features.astype(np.float32),
                               {"train_loss": result.train_loss, "train_accuracy": result.train_accuracy},
                               {**{f"params/{k}": v for k, v in flatten_tree(result.state.params).items()},
                                **{f"batch_stats/{k}": v for k, v in flatten_tree(result.state.batch_stats).items()}})
                if not progress:
                    log(f"arm {arm}: {record['test_accuracy_mean']:.4f} +- {record['test_accuracy_std']:.4f} "
                        f"test accuracy, {record['seconds']:.1f} s")
        all_arms = json.loads((out / "config.json").read_text())["study"]["arms"]
        records = [store.load_arm(a) for a in all_arms if store.arm_done(a)]
        store.write_rows([row for rec in records for row in rec["rows"]])
        summary = {
            "study": str(out),
            "dataset": data.name, "model": config.model.name, "n_test": len(data.x_test),
            "arms": {rec["arm"]: {k: v for k, v in rec.items() if k != "rows"} for rec in records},
        }
        store.write_json("summary.json", summary)
    log(format_table(summary))
    control = summary["arms"].get("control")
    if control and not control["replicas_bitwise_identical"] and jax.default_backend() == "cpu":
        log("WARNING: the control arm's replicas are not bitwise identical on CPU: the backend or the "
            "strategy is not deterministic here (see environment.json)")
    return summary


def format_table(summary: dict) -> str:
    """The per-arm table printed at the end of a sweep (plain text, stable for logs)."""
    head = f"{'arm':<14} {'R':>3} {'test accuracy (mean ± std)':>28} {'test loss (mean ± std)':>26} {'seconds':>8}"
    lines = [head, "-" * len(head)]
    for arm, a in summary["arms"].items():
        lines.append(f"{arm:<14} {a['replicas']:>3} {a['test_accuracy_mean'] * 100:>17.2f}% ± {a['test_accuracy_std'] * 100:.2f}%"
                     f" {a['test_loss_mean']:>17.4f} ± {a['test_loss_std']:.4f} {a['seconds']:>8.1f}")
    lines.append("std: sample standard deviation over replicas (ddof=1)")
    return "\n".join(lines)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2
        self.exit(2, f"{self.prog}: error: {message}; see --help\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m nondet_jax.sweep",
                description="Train R replicas per arm, varying only the arm's randomness sources, and write a run folder.")
    p.add_argument("--arms", help="comma list: control (nothing varies), a source (init, data_order, augmentation, "
                                  "dropout, bitflip, batch_order), a+b combination, or all. Default: "
                                  + ",".join(Config().study.arms))
    p.add_argument("--replicas", type=int, help="replicas per arm (R)")
    p.add_argument("--epochs", type=int)
    p.add_argument("--model", help="mlp, resnet8, resnet14, resnet20, resnet32, resnet56, resnet18")
    p.add_argument("--width", type=float, help="width multiplier")
    p.add_argument("--dropout", type=float, help="dropout rate before the classifier")
    p.add_argument("--dataset", help="digits (embedded), cifar10, mnist, fashion_mnist (TFDS, prepared in --data-dir)")
    p.add_argument("--data-dir", help="TFDS data directory")
    p.add_argument("--augment", help="auto (on for cifar10), on, off")
    p.add_argument("--batch-size", type=int)
    p.add_argument("--optimizer", help="sgd or adamw")
    p.add_argument("--lr", type=float, help="peak learning rate")
    p.add_argument("--seed", type=int, help="study seed (root of every key)")
    p.add_argument("--strategy", help="auto, vmap or sequential")
    p.add_argument("--out", help="run folder (default: runs/<dataset>-<model>-<config hash>)")
    p.add_argument("--config", help="YAML or JSON file of config keys (sections or dotted keys)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any config key, e.g. --set optim.nesterov=true (repeatable)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar even on a terminal")
    return p


def config_from_args(args: argparse.Namespace) -> Config:
    flat = cfg.load_file(args.config) if args.config else {}
    for flag, key in FLAGS.items():
        value = getattr(args, flag)
        if value is not None:
            flat[key] = value
    flat.update(cfg.parse_overrides(args.set))
    return cfg.from_flat(flat)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = config_from_args(args)
        run(config, args.out, progress=False if args.no_progress else None)
    except UsageError as e:
        print(f"python -m nondet_jax.sweep: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: finished arms are kept in the run folder; rerun the same command to resume",
              file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    t0 = time.perf_counter()
    code = main()
    if code == 0:
        print(f"done in {time.perf_counter() - t0:.0f} s")
    sys.exit(code)
