"""``python -m nondet_jax.sweep``: train R replicas per arm and write the run folder.

Thin CLI over :func:`run` (parse, validate, call). Every bad input exits with status 2 and a
one-line error naming the problem and the fix; nothing already written is touched.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from nondet_jax import config as cfg
from nondet_jax.config import Config, UsageError

CHILD_ENV = "NONDET_JAX_CHILD"  # set by the sweep in the processes it starts for an arm

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


PRESET_DIR = Path(__file__).resolve().parent.parent / "experiments"
DEFAULT_PRESET = "sources"


def preset_path(name: str) -> Path:
    """``experiments/<name>.yaml``; UsageError naming the available presets when absent."""
    path = PRESET_DIR / f"{name}.yaml"
    if not path.is_file():
        names = sorted(p.stem for p in PRESET_DIR.glob("*.yaml")) if PRESET_DIR.is_dir() else []
        raise UsageError(f"unknown preset '{name}'; choose one of: {', '.join(names) or '(none found in ' + str(PRESET_DIR) + ')'}")
    return path


def default_out(config: Config) -> Path:
    """``runs/<dataset>-<model>-<hash of the config without its arms>``: same settings, same folder."""
    d = cfg.to_dict(config)
    d["study"].pop("arms")
    digest = hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:8]
    return Path("runs") / f"{config.data.name}-{config.model.name}-{digest}"


def arm_record(arm: str, result, strategy_reason: str, arm_metrics: dict, acc: np.ndarray, nll: np.ndarray) -> dict:
    """The JSON record of a finished arm: per-replica rows (test accuracy ``acc`` and cross-entropy
    ``nll``), metrics, and how it was trained."""
    from nondet_jax.sources import arm_sources

    rows = [{"arm": arm, "replica": r, "test_accuracy": float(acc[r]), "test_loss": float(nll[r]),
             "train_loss": float(result.train_loss[r, -1]), "train_accuracy": float(result.train_accuracy[r, -1]),
             "strategy": result.strategy} for r in range(len(acc))]
    return {
        "arm": arm,
        "varied": sorted(arm_sources(arm)),
        "replicas": len(acc),
        "strategy": result.strategy,
        "strategy_reason": strategy_reason,
        "seconds": round(result.seconds, 3),
        "replicas_bitwise_identical": bool(all(np.array_equal(result.logits[0], lg) for lg in result.logits)),
        "metrics": arm_metrics,
        "rows": rows,
    }


def check_arms_active(config: Config, dataset: str, image_size: int) -> None:
    """Refuse an arm that varies only sources switched off in this config (its replicas would
    equal the control arm's): e.g. ``dropout`` with model.dropout = 0."""
    from nondet_jax.sources import arm_sources
    from nondet_jax.train import augmentation_settings

    inactive = set()
    if not augmentation_settings(config, dataset, image_size)[0]:
        inactive.add(("augmentation", "--augment on"))
    if config.model.dropout == 0:
        inactive.add(("dropout", "--dropout 0.1 (say)"))
    for arm in config.study.arms:
        varied = arm_sources(arm)
        off = [(src, fix) for src, fix in sorted(inactive) if src in varied]
        if arm not in ("control", "all") and varied and len(off) == len(varied):
            raise UsageError(f"arm '{arm}' varies only {', '.join(s for s, _ in off)}, which is off in this config, "
                             f"so its replicas would equal control's; turn it on with {off[0][1]} or drop the arm")


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


def prepare(config: Config):
    """Validate against the data and build the training functions: (data, fns). Writes nothing."""
    from nondet_jax.data import load_dataset
    from nondet_jax.train import DataSpec, make_train

    cfg.validate(config)
    data = load_dataset(config.data.name, config.data.data_dir)
    n_train = len(data.x_train)
    if config.train.batch_size > n_train:
        raise UsageError(f"batch size {config.train.batch_size} is larger than the {n_train} training examples of "
                         f"{data.name}; use --batch-size {n_train} or less")
    check_arms_active(config, data.name, data.x_train.shape[1])
    spec = DataSpec(n_train, tuple(data.x_train.shape[1:]), data.num_classes, data.name)
    return data, make_train(config, spec)


def train_arm(config: Config, data, fns, store, arm: str, progress, log=print) -> dict:
    """Train one arm in this process, compute its metrics and store it; returns its record."""
    from nondet_jax.analysis import arm_metrics
    from nondet_jax.replicas import resolve_strategy, run_replicas
    from nondet_jax.sources import arm_keys, arm_sources, perturbations
    from nondet_jax.store import flatten_tree

    study = config.study
    strategy, reason = resolve_strategy(study.strategy, study.replicas)
    varied = arm_sources(arm)
    result = run_replicas(fns, arm_keys(study.seed, varied, study.replicas), perturbations(varied), data,
                          config.train.epochs, strategy, progress)
    metrics, pair_arrays = arm_metrics(result, data, fns, config.metrics)
    record = arm_record(arm, result, reason, metrics, pair_arrays["accuracy"], pair_arrays["cross_entropy"])
    trace = None
    if study.dynamics_every and arm != "control" and study.replicas >= 2:
        from nondet_jax.dynamics import divergence_trace, fit_growth_rate

        trace = divergence_trace(fns, arm_keys(study.seed, varied, 2), perturbations(varied), data,
                                 config.train.epochs, study.dynamics_every)
        record["dynamics"] = {"every": study.dynamics_every,
                              **fit_growth_rate(trace["step"], trace["weight_distance"])}
    store.save_arm(arm, record, result.logits.astype(np.float32), result.features.astype(np.float32),
                   {"train_loss": result.train_loss, "train_accuracy": result.train_accuracy,
                    "weight_distance": result.weight_distance},
                   {**{f"params/{k}": v for k, v in flatten_tree(result.state.params).items()},
                    **{f"batch_stats/{k}": v for k, v in flatten_tree(result.state.batch_stats).items()}},
                   pair_arrays, trace)
    return record


def run_in_child(out: Path, arm: str, flags) -> None:
    """Train ``arm`` in a fresh process whose XLA_FLAGS carry ``flags`` (read at backend start);
    it writes into the same run folder, under the lock this process holds."""
    import subprocess

    from nondet_jax.determinism import with_flags

    env = {**os.environ, "XLA_FLAGS": with_flags(flags), CHILD_ENV: "1"}
    proc = subprocess.run([sys.executable, "-m", "nondet_jax.sweep", "--out", str(out), "--child-arm", arm], env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"the child process training arm '{arm}' failed with exit status {proc.returncode}; "
                           "its output is above; finished arms are kept")


def child_main(out: str, arm: str, progress: bool) -> int:
    """Entry of a child process: train one arm of the run folder's config under this process's flags."""
    from nondet_jax.determinism import environment
    from nondet_jax.store import RunStore

    if os.environ.get(CHILD_ENV) != "1":
        raise UsageError("--child-arm is internal: the sweep starts such processes itself")
    config = cfg.from_dict(json.loads((Path(out) / "config.json").read_text()))
    data, fns = prepare(config)
    with RunStore(out, config, locked_by_parent=True) as store:
        env = environment()
        env["arm"] = arm
        store.write_json(f"environments/{arm}.json", env)
        with Progress(progress) as bar:
            train_arm(config, data, fns, store, arm, bar.arm(arm, config.study.replicas * config.train.epochs))
    return 0


def run(config: Config, out: str | Path | None = None, progress: bool | None = None, log=print,
        command: str | None = None) -> dict:
    """Run a study: train every arm not yet finished in ``out``, then write the report.

    Arms that vary ``hardware`` run in a child process with XLA's determinism flags off; the
    others run here, under this process's flags. Returns the summary (also in ``summary.json``).
    Raises UsageError on bad input before anything is written.
    """
    import jax

    from nondet_jax.determinism import DETERMINISM_OFF, NONDETERMINISTIC_BACKENDS, check_flags, environment
    from nondet_jax.replicas import resolve_strategy
    from nondet_jax.report import format_table, write_report
    from nondet_jax.sources import arm_sources
    from nondet_jax.store import RunStore, atomic_write_bytes

    data, fns = prepare(config)
    study = config.study
    hardware_arms = [a for a in study.arms if "hardware" in arm_sources(a)]
    if hardware_arms:
        check_flags(DETERMINISM_OFF)
    out = Path(out) if out is not None else default_out(config)
    strategy, reason = resolve_strategy(study.strategy, study.replicas)
    if progress is None:
        progress = sys.stderr.isatty()
    backend = jax.default_backend()

    with RunStore(out, config) as store:
        env = environment()
        env["strategy"] = {"requested": study.strategy, "chosen": strategy, "reason": reason}
        env["scan_unroll"] = fns.unroll
        store.write_json("environment.json", env)
        if command:
            atomic_write_bytes(out / "command.txt", (command + "\n").encode())
        log(f"nondet_jax: {len(study.arms)} arms x {study.replicas} replicas of {config.model.name} on {data.name} "
            f"({len(data.x_train)} train / {len(data.x_test)} test), {config.train.epochs} epochs, strategy "
            f"{strategy} on {backend} -> {out}")
        if hardware_arms and backend not in NONDETERMINISTIC_BACKENDS:
            log(f"note: {backend} reductions are deterministic, so arm(s) {', '.join(hardware_arms)} check that "
                "(replicas must come out bitwise identical even with XLA's determinism flags off); batch_order is "
                "the simulated counterpart of hardware nondeterminism here")
        with Progress(progress) as bar:
            for arm in study.arms:
                if store.arm_done(arm):
                    log(f"arm {arm}: already finished in {out}, reusing it")
                    continue
                if arm in hardware_arms:
                    log(f"arm {arm}: training in a child process with XLA_FLAGS {' '.join(DETERMINISM_OFF)}")
                    run_in_child(out, arm, DETERMINISM_OFF)
                    record = store.load_arm(arm)
                else:
                    record = train_arm(config, data, fns, store, arm,
                                       bar.arm(arm, study.replicas * config.train.epochs), log)
                if not progress:
                    acc = record["metrics"]["accuracy"]
                    log(f"arm {arm}: test accuracy {acc['mean']:.4f} +- {acc['std']:.4f}, {record['seconds']:.1f} s")
        all_arms = json.loads((out / "config.json").read_text())["study"]["arms"]
        store.write_rows([row for a in all_arms if store.arm_done(a) for row in store.load_arm(a)["rows"]])
        summary = write_report(out)
    log(format_table(summary))
    log(f"report: {out / 'report.md'}")
    control = summary["arms"].get("control")
    if control and not control["replicas_bitwise_identical"] and backend == "cpu":
        log("WARNING: the control arm's replicas are not bitwise identical on CPU: the backend or the "
            "strategy is not deterministic here (see environment.json)")
    return summary


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2
        self.exit(2, f"{self.prog}: error: {message}; see --help\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m nondet_jax.sweep",
                description="Train R replicas per arm, varying only the arm's randomness sources, and write a run folder.")
    p.add_argument("--arms", help="comma list: control (nothing varies), a source (init, data_order, augmentation, "
                                  "dropout, bitflip, batch_order), a+b combination, or all. Default: the preset's")
    p.add_argument("--replicas", type=int, help="replicas per arm (R)")
    p.add_argument("--epochs", type=int)
    p.add_argument("--model", help="mlp, resnet8/14/20/32/56, resnet18, resnet18_imagenet, resnet50, resnet29v2, "
                                   "vgg11, shufflenetv2")
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
    p.add_argument("--preset", help="a study from experiments/: sources (the default), morin, bitflip")
    p.add_argument("--config", help="YAML or JSON file of config keys (sections or dotted keys), applied after the preset")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any config key, e.g. --set optim.nesterov=true (repeatable)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar even on a terminal")
    p.add_argument("--child-arm", help=argparse.SUPPRESS)
    return p


def config_from_args(args: argparse.Namespace) -> Config:
    """Preset (default: sources unless --config is given), then --config, then flags, then --set."""
    preset = args.preset or (None if args.config else DEFAULT_PRESET)
    flat = cfg.load_file(preset_path(preset)) if preset else {}
    if args.config:
        flat.update(cfg.load_file(args.config))
    for flag, key in FLAGS.items():
        value = getattr(args, flag)
        if value is not None:
            flat[key] = value
    flat.update(cfg.parse_overrides(args.set))
    return cfg.from_flat(flat)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    progress = False if args.no_progress else None
    try:
        if args.child_arm:
            return child_main(args.out, args.child_arm, progress if progress is not None else sys.stderr.isatty())
        config = config_from_args(args)
        if config.study.xla_determinism:
            set_determinism_flags()
        command = "python -m nondet_jax.sweep" + "".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:]))
        t0 = time.perf_counter()
        run(config, args.out, progress=progress, command=command)
        print(f"done in {time.perf_counter() - t0:.0f} s")
    except UsageError as e:
        print(f"python -m nondet_jax.sweep: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: finished arms are kept in the run folder; rerun the same command to resume",
              file=sys.stderr)
        return 130
    except RuntimeError as e:
        print(f"python -m nondet_jax.sweep: {e}", file=sys.stderr)
        return 1
    return 0


def set_determinism_flags() -> None:
    """Put XLA's determinism flags into this process's XLA_FLAGS before the backend starts, so
    that arms run here are deterministic on GPU too (only ``hardware`` arms run without them)."""
    from nondet_jax.determinism import DETERMINISM_ON, check_flags, with_flags

    if with_flags(DETERMINISM_ON) != os.environ.get("XLA_FLAGS", ""):
        check_flags(DETERMINISM_ON)
        os.environ["XLA_FLAGS"] = with_flags(DETERMINISM_ON)


if __name__ == "__main__":
    sys.exit(main())
