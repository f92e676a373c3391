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
from nondet_jax.config import Config
from nondet_jax.errors import UsageError

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
    "instruments": "instruments.config",
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
             "diverged_at_step": int(result.diverged_at[r]), "strategy": result.strategy} for r in range(len(acc))]
    return {
        "arm": arm,
        "varied": sorted(arm_sources(arm)),
        "replicas": len(acc),
        "replicas_used": int((result.diverged_at < 0).sum()),  # the metrics leave diverged replicas out
        "strategy": result.strategy,
        "strategy_reason": strategy_reason,
        "seconds": round(result.seconds, 3),
        "replicas_bitwise_identical": bool(all(np.array_equal(result.logits[0], lg, equal_nan=True)
                                               for lg in result.logits)),
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
    from nondet_jax.data import load_data
    from nondet_jax.train import DataSpec, make_train

    cfg.validate(config)
    data = load_data(config.data)
    n_train = len(data.x_train)
    if config.train.batch_size > n_train:
        raise UsageError(f"batch size {config.train.batch_size} is larger than the {n_train} training examples of "
                         f"{data.name}; use --batch-size {n_train} or less")
    check_arms_active(config, data.name, data.x_train.shape[1])
    if config.metrics.tta:
        from nondet_jax.train import augmentation_settings
        from nondet_jax.tta import view_grid

        for name in config.metrics.tta:
            view_grid(name, augmentation_settings(config, data.name, data.x_train.shape[1])[2])
    spec = DataSpec(n_train, tuple(data.x_train.shape[1:]), data.num_classes, data.name)
    return data, make_train(config, spec)


FAULT_ENV = "NONDET_JAX_INJECT_FAULT"  # "arm:replica:epoch": NaN weights before that epoch (fault tests)


def injected_fault(arm: str) -> tuple[int, int] | None:
    """(replica, epoch) of a fault to inject into ``arm``, from ``$NONDET_JAX_INJECT_FAULT``."""
    spec = os.environ.get(FAULT_ENV, "")
    parts = spec.split(":")
    if len(parts) == 3 and parts[0] == arm:
        return int(parts[1]), int(parts[2])
    return None


def healthy_subset(result):
    """The result restricted to replicas that did not diverge (pairwise distances re-indexed)."""
    import jax

    from nondet_jax.metrics import pair_indices

    keep = np.flatnonzero(result.diverged_at < 0)
    r = len(result.diverged_at)
    if len(keep) == r:
        return result
    ia, ib = pair_indices(r)
    pairs = [np.flatnonzero((ia == a) & (ib == b))[0] for i, a in enumerate(keep) for b in keep[i + 1:]]
    return result._replace(state=jax.tree.map(lambda x: x[keep], result.state), train_loss=result.train_loss[keep],
                           train_accuracy=result.train_accuracy[keep], logits=result.logits[keep],
                           features=result.features[keep], weight_distance=result.weight_distance[:, pairs],
                           steps=jax.tree.map(lambda x: x[keep], result.steps), snapshots=result.snapshots[keep])


def arm_setup(config: Config, fns, arm: str):
    """(config, fns, snapshot cycles) an arm trains under: ``arm@snapshotK`` swaps in the snapshot schedule."""
    from nondet_jax.sources import split_variant
    from nondet_jax.train import make_train

    cycles = split_variant(arm)[1]
    if cycles:  # the same arm under the snapshot schedule, logits kept at each cycle end
        config = cfg.arm_config(config, arm)
        fns = make_train(config, fns.spec)
    return config, fns, cycles


def fit_arm(config: Config, data, fns, store, arm: str, progress, log=print, block: range | None = None):
    """Train replicas ``block`` (default: all) of an arm, continuing from their latest checkpoint and
    checkpointing every ``train.checkpoint_every`` epochs. Returns (ArmResult, strategy reason)."""
    import jax

    from nondet_jax.checkpoint import ArmCheckpoints, CorruptCheckpoint, key_fingerprint
    from nondet_jax.mitigations import snapshot_epochs
    from nondet_jax.replicas import Progress, make_strategy, resolve_strategy, train_replicas
    from nondet_jax.sources import arm_keys, arm_sources, perturbations

    study = config.study
    config, fns, cycles = arm_setup(config, fns, arm)
    block = block or range(study.replicas)
    strategy_name, reason = resolve_strategy(study.strategy, len(block))
    strategy = make_strategy(fns, strategy_name)
    varied = arm_sources(arm)
    keys = jax.tree.map(lambda k: k[block.start:block.stop], arm_keys(study.seed, varied, study.replicas))
    perturb = perturbations(varied)
    folder = store.root / "checkpoints" / arm
    if len(block) != study.replicas:
        folder = folder / f"replicas{block.start}-{block.stop - 1}"
    ckpt = ArmCheckpoints(folder, config.train.checkpoint_every)
    meta = {"arm": arm, "keys_sha256": key_fingerprint(keys), "strategy": strategy_name}
    try:
        restored = ckpt.restore_latest(jax.eval_shape(strategy.init, keys, perturb, data.x_train[:1]),
                                       {"keys_sha256": meta["keys_sha256"], "strategy": strategy_name})
    except CorruptCheckpoint as e:
        ckpt.close()
        raise UsageError(f"{e}; rerun with --recompute {arm} to train arm '{arm}' again from scratch") from None
    start = None
    if restored is not None:
        start = Progress(*restored)
        log(f"arm {arm}: resuming from its checkpoint after epoch {start.epoch}")
        progress(start.epoch * len(block))
    result = train_replicas(strategy, keys, perturb, data, config.train.epochs, progress, start=start,
                            on_epoch=lambda p: ckpt.save(p, meta), fault=injected_fault(arm),
                            eval_epochs=snapshot_epochs(config.train.epochs, cycles) if cycles else ())
    ckpt.close()
    return result, reason


def train_arm(config: Config, data, fns, store, arm: str, progress, log=print) -> dict:
    """Train one arm in this process (continuing from its latest checkpoint), then :func:`finish_arm`."""
    result, reason = fit_arm(config, data, fns, store, arm, progress, log)
    return finish_arm(config, data, fns, store, arm, result, reason, log)


def finish_arm(config: Config, data, fns, store, arm: str, result, reason: str, log=print) -> dict:
    """Compute an arm's metrics on the replicas that did not diverge, store everything, delete its
    checkpoints; returns its record."""
    from nondet_jax.analysis import arm_metrics
    from nondet_jax.metrics import accuracy, cross_entropy
    from nondet_jax.sources import arm_keys, arm_sources, perturbations
    from nondet_jax.store import flatten_tree, npy_bytes, npz_bytes

    study = config.study
    config, fns, cycles = arm_setup(config, fns, arm)
    varied = arm_sources(arm)
    labels = np.asarray(data.y_test)
    used = healthy_subset(result)
    diverged = [{"replica": int(r), "step": int(result.diverged_at[r]),
                 "last_finite_loss": float(result.state.health.last_loss[r])}
                for r in np.flatnonzero(result.diverged_at >= 0)]
    for d in diverged:
        log(f"arm {arm}: replica {d['replica']} diverged at step {d['step']} (last finite loss "
            f"{d['last_finite_loss']:.4g}); it is frozen there and left out of the metrics")
    if len(used.logits):
        metrics, pair_arrays = arm_metrics(used, data, fns, config.metrics)
    else:
        metrics, pair_arrays = {}, {}
    record = arm_record(arm, result, reason, metrics, accuracy(result.logits, labels),
                        cross_entropy(result.logits, labels))
    record["diverged"] = diverged
    trace = None
    if study.dynamics_every and arm != "control" and study.replicas >= 2:
        from nondet_jax.dynamics import divergence_trace, fit_growth_rate

        trace = divergence_trace(fns, arm_keys(study.seed, varied, 2), perturbations(varied), data,
                                 config.train.epochs, study.dynamics_every)
        record["dynamics"] = {"every": study.dynamics_every,
                              **fit_growth_rate(trace["step"], trace["weight_distance"])}
    extra = {}
    if "instruments" in result.steps:
        values = instrument_values(config, fns, result)
        extra[f"instruments/{arm}.npz"] = npz_bytes(values)
        extra[f"instruments/{arm}.csv"] = tidy_csv(arm, values)
    if cycles:
        extra[f"snapshots/{arm}.npy"] = npy_bytes(result.snapshots.astype(np.float32))
    elif config.metrics.tta:
        extra[f"tta/{arm}.npz"] = npz_bytes(tta_outputs(config, data, fns, result.state))
    store.save_arm(arm, record, result.logits.astype(np.float32), result.features.astype(np.float32),
                   {"train_loss": result.train_loss, "train_accuracy": result.train_accuracy,
                    "weight_distance": result.weight_distance, "step_loss": result.steps["loss"],
                    "diverged_at": result.diverged_at},
                   {**{f"params/{k}": v for k, v in flatten_tree(result.state.params).items()},
                    **{f"batch_stats/{k}": v for k, v in flatten_tree(result.state.batch_stats).items()}},
                   pair_arrays, trace, extra)
    store.remove_checkpoints(arm)
    return record


def instrument_values(config: Config, fns, result) -> dict[str, np.ndarray]:
    """The instruments' values at the tracked steps: ``step`` (T,), each quantity (R, T, ...), and
    the training ``loss``, ``accuracy`` and learning rate ``lr`` at those steps (for the dashboard)."""
    from nondet_jax.train import make_schedule

    steps = np.flatnonzero(np.asarray(result.steps["tracked"])[0])
    lr = make_schedule(config.optim, config.train.epochs, fns.steps_per_epoch)
    return {"step": steps, **{k: np.asarray(v)[:, steps] for k, v in result.steps["instruments"].items()},
            "loss": np.asarray(result.steps["loss"])[:, steps], "accuracy": np.asarray(result.steps["accuracy"])[:, steps],
            "lr": np.asarray([float(lr(int(t))) for t in steps])}


def tidy_csv(arm: str, values: dict) -> bytes:
    """The tidy table (step, arm, replica, quantity, layer, value) of the scalar instruments."""
    import csv
    import io

    from nondet_jax.instruments.dashboard import tidy_rows

    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=["step", "arm", "replica", "quantity", "layer", "value"], lineterminator="\n")
    w.writeheader()
    w.writerows(tidy_rows(arm, values))
    return buf.getvalue().encode()


def tta_outputs(config: Config, data, fns, state) -> dict[str, np.ndarray]:
    """Each replica's test logits under every view set of ``metrics.tta``: name -> (R, N, C)."""
    import jax

    from nondet_jax.train import augmentation_settings
    from nondet_jax.tta import tta_logits, view_grid

    padding = augmentation_settings(config, data.name, data.x_train.shape[1])[2]
    x = jax.numpy.asarray(data.x_test)
    out = {}
    for name in config.metrics.tta:
        views = view_grid(name, padding)
        fn = jax.jit(lambda st: tta_logits(fns.evaluate, st, x, views, padding))
        r_count = len(np.asarray(state.health.diverged_at))
        out[name] = np.stack([np.asarray(fn(jax.tree.map(lambda a: a[r], state))) for r in range(r_count)])
    return out


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
        command: str | None = None, recompute: tuple[str, ...] = ()) -> dict:
    """Run a study: train every arm not yet finished in ``out``, then write the report.

    Arms that vary ``hardware`` run in a child process with XLA's determinism flags off; the
    others run here, under this process's flags. Returns the summary (also in ``summary.json``).
    Arms named in ``recompute`` are deleted (results and checkpoints) and trained again.
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
    unknown = [a for a in recompute if a not in study.arms]
    if unknown:
        raise UsageError(f"--recompute names arm '{unknown[0]}', which is not in this study's arms "
                         f"({', '.join(study.arms)}); name one of those")
    hardware_arms = [a for a in study.arms if "hardware" in arm_sources(a)]
    if hardware_arms:
        check_flags(DETERMINISM_OFF)
    out = Path(out) if out is not None else default_out(config)
    strategy, reason = resolve_strategy(study.strategy, study.replicas)
    if progress is None:
        progress = sys.stderr.isatty()
    backend = jax.default_backend()

    with RunStore(out, config, recompute=recompute) as store:
        env = environment()
        env["strategy"] = {"requested": study.strategy, "chosen": strategy, "reason": reason}
        env["scan_unroll"] = fns.unroll
        store.write_json("environment.json", env)
        if command:
            atomic_write_bytes(out / "command.txt", (command + "\n").encode())
        from nondet_jax.store import npy_bytes

        atomic_write_bytes(out / "test_labels.npy", npy_bytes(np.asarray(data.y_test)))
        log(f"nondet_jax: {len(study.arms)} arms x {study.replicas} replicas of {config.model.name} on {data.name} "
            f"({len(data.x_train)} train / {len(data.x_test)} test), {config.train.epochs} epochs, strategy "
            f"{strategy} on {backend} -> {out}")
        if hardware_arms and backend not in NONDETERMINISTIC_BACKENDS:
            log(f"note: {backend} reductions are deterministic, so arm(s) {', '.join(hardware_arms)} check that "
                "(replicas must come out bitwise identical even with XLA's determinism flags off); batch_order is "
                "the simulated counterpart of hardware nondeterminism here")
        for arm in recompute:
            log(f"arm {arm}: deleting its results and checkpoints to train it again (--recompute)")
            store.remove_arm(arm)
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
                if not progress and record["metrics"]:
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


def run_distributed(config: Config, out: str | Path | None, procs, progress: bool | None = None, log=print,
                    command: str | None = None) -> dict | None:
    """:func:`run` across several processes (see :mod:`nondet_jax.multihost`): each trains its block
    of every arm's replicas; process 0 holds the folder's lock, merges, stores and reports. Returns
    the summary on process 0, None elsewhere."""
    import shutil

    import jax

    from nondet_jax import multihost as mh
    from nondet_jax.determinism import environment
    from nondet_jax.replicas import make_strategy, resolve_strategy
    from nondet_jax.sources import arm_keys, arm_sources, perturbations
    from nondet_jax.store import RunStore, atomic_write_bytes, npy_bytes

    data, fns = prepare(config)
    study = config.study
    if any("hardware" in arm_sources(a) for a in study.arms):
        raise UsageError("hardware arms train in a child process of their own, which a multi-process run cannot "
                         "start; run them in a single-process sweep on the same --out")
    if study.replicas < procs.count:
        raise UsageError(f"{study.replicas} replicas cannot be split over {procs.count} processes; use --replicas "
                         f"{procs.count} or more")
    out = Path(out) if out is not None else default_out(config)
    log = log if procs.leader else (lambda *a, **k: None)
    store = RunStore(out, config, locked_by_parent=not procs.leader)
    error = None
    try:
        store.open()
        if procs.leader:
            env = {**environment(), "processes": procs.count}
            store.write_json("environment.json", env)
            atomic_write_bytes(out / "test_labels.npy", npy_bytes(np.asarray(data.y_test)))
            if command:
                atomic_write_bytes(out / "command.txt", (command + "\n").encode())
    except UsageError as e:
        error = e
    if not mh.agree(error is None):
        store.close()
        raise error or UsageError(f"process 0 could not open the run folder {out}; see its error")
    block = mh.replica_block(study.replicas, procs.index, procs.count)
    log(f"nondet_jax: {len(study.arms)} arms x {study.replicas} replicas over {procs.count} processes -> {out}")
    try:
        with Progress(bool(progress) and procs.leader) as bar:
            for arm in study.arms:
                if store.arm_done(arm):
                    log(f"arm {arm}: already finished in {out}, reusing it")
                    continue
                result, reason = fit_arm(config, data, fns, store, arm,
                                         bar.arm(arm, len(block) * config.train.epochs), log, block)
                part = out / "parts" / arm / f"{procs.index}.npz"
                atomic_write_bytes(part, mh.part_bytes(result))
                mh.barrier(f"trained {arm}")
                if procs.leader:
                    arm_cfg, arm_fns, _ = arm_setup(config, fns, arm)
                    varied = arm_sources(arm)
                    strategy = make_strategy(arm_fns, resolve_strategy(study.strategy, study.replicas)[0])
                    init = strategy.init(arm_keys(study.seed, varied, study.replicas), perturbations(varied),
                                         jax.numpy.asarray(data.x_train[:1]))
                    merged = mh.merge_parts([out / "parts" / arm / f"{i}.npz" for i in range(procs.count)],
                                            init.params)
                    record = finish_arm(config, data, fns, store, arm, merged, reason, log)
                    shutil.rmtree(out / "parts" / arm, ignore_errors=True)
                    if record["metrics"]:
                        acc = record["metrics"]["accuracy"]
                        log(f"arm {arm}: test accuracy {acc['mean']:.4f} +- {acc['std']:.4f}")
                mh.barrier(f"stored {arm}")
        if not procs.leader:
            return None
        if (out / "parts").is_dir() and not any((out / "parts").iterdir()):
            (out / "parts").rmdir()
        from nondet_jax.report import format_table, write_report

        all_arms = json.loads((out / "config.json").read_text())["study"]["arms"]
        store.write_rows([row for a in all_arms if store.arm_done(a) for row in store.load_arm(a)["rows"]])
        summary = write_report(out)
        log(format_table(summary))
        log(f"report: {out / 'report.md'}")
        return summary
    finally:
        store.close()


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
    p.add_argument("--dataset", help="digits (embedded), cifar10, mnist, fashion_mnist, imagenette, imagenet2012 (TFDS, "
                                     "prepared in --data-dir; see README)")
    p.add_argument("--data-dir", help="TFDS data directory")
    p.add_argument("--augment", help="auto (on for cifar10), on, off")
    p.add_argument("--batch-size", type=int)
    p.add_argument("--optimizer", help="sgd or adamw")
    p.add_argument("--lr", type=float, help="peak learning rate")
    p.add_argument("--seed", type=int, help="study seed (root of every key)")
    p.add_argument("--instruments", help="Cockpit's quantities per step and replica: economy, business, full, or "
                                         "quantity names (e.g. Loss,HessMaxEV); see instruments.every/schedule")
    p.add_argument("--strategy", help="auto, vmap, sequential or sharded (replicas over the devices)")
    p.add_argument("--out", help="run folder (default: runs/<dataset>-<model>-<config hash>)")
    p.add_argument("--preset", help="a study from experiments/: sources (the default), morin, bitflip")
    p.add_argument("--config", help="YAML or JSON file of config keys (sections or dotted keys), applied after the preset")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any config key, e.g. --set optim.nesterov=true (repeatable)")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue the study in RUN_DIR with the config stored there "
                   "(finished arms are kept, an arm in training continues from its last checkpoint)")
    p.add_argument("--recompute", metavar="ARMS", help="comma list of arms whose results (and checkpoints) are "
                   "deleted and trained again, e.g. after a corrupt-file error")
    p.add_argument("--compile-cache", metavar="DIR", help="JAX's persistent compilation cache: a folder, or 'off' "
                   f"(default: ${CACHE_ENV} or {default_cache_dir()})")
    p.add_argument("--coordinator", metavar="HOST:PORT", help="multi-process run: address of process 0 "
                   "(with --num-processes and --process-id; see nondet_jax.multihost)")
    p.add_argument("--num-processes", type=int, help="multi-process run: number of processes")
    p.add_argument("--process-id", type=int, help="multi-process run: this process's index, 0 .. N-1")
    p.add_argument("--distributed", choices=["auto"], help="multi-process run with the cluster's settings detected "
                   "by jax.distributed.initialize (Slurm, Open MPI, Cloud TPU)")
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


def config_for_resume(args: argparse.Namespace) -> Config:
    """The config stored in ``--resume RUN_DIR``; settings given with it would change the study."""
    given = [f"--{f.replace('_', '-')}" for f in (*FLAGS, "preset", "config", "out") if getattr(args, f) is not None]
    if given or args.set:
        raise UsageError(f"--resume takes its settings from the run folder, so {(given or ['--set'])[0]} cannot be "
                         "combined with it; drop it, or start a new study with --out")
    path = Path(args.resume) / "config.json"
    try:
        return cfg.from_dict(json.loads(path.read_text()))
    except FileNotFoundError:
        raise UsageError(f"--resume {args.resume} is not a nondet_jax run folder (no config.json); pass the --out "
                         "folder of an earlier sweep") from None
    except (OSError, json.JSONDecodeError):
        raise UsageError(f"{path} is unreadable or corrupt; start a new study with --out") from None


CACHE_ENV = "NONDET_JAX_COMPILE_CACHE"


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "nondet_jax" / "jax"


def enable_compile_cache(setting: str | None) -> Path | None:
    """Turn on JAX's persistent compilation cache (every program, however quick to compile), so a
    second identical run, or an arm's child process, compiles nothing new. Returns the folder."""
    import jax

    setting = setting or os.environ.get(CACHE_ENV) or str(default_cache_dir())
    if setting.lower() == "off":
        return None
    folder = Path(setting).expanduser()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"cannot create the compilation cache folder {folder}: {e.strerror}; pass "
                         "--compile-cache DIR with a writable folder, or --compile-cache off") from None
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    os.environ[CACHE_ENV] = str(folder)  # the processes started for hardware arms use it too
    return folder


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    progress = False if args.no_progress else None
    try:
        enable_compile_cache(args.compile_cache)
        if args.child_arm:
            return child_main(args.out, args.child_arm, progress if progress is not None else sys.stderr.isatty())
        if args.resume:
            config = config_for_resume(args)
            args.out = args.resume
        else:
            config = config_from_args(args)
        if config.study.xla_determinism:
            set_determinism_flags()
        command = "python -m nondet_jax.sweep" + "".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:]))
        t0 = time.perf_counter()
        recompute = tuple(a.strip() for a in (args.recompute or "").split(",") if a.strip())
        from nondet_jax import multihost

        procs = multihost.initialize(args.coordinator, args.num_processes, args.process_id, args.distributed == "auto")
        if procs.count > 1:
            if recompute:
                raise UsageError("--recompute runs in a single process; rerun it without --num-processes first")
            run_distributed(config, args.out, procs, progress=progress, command=command)
        else:
            run(config, args.out, progress=progress, command=command, recompute=recompute)
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
