"""The study core: arms -> train -> metrics -> run folder -> report, in one process or several."""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import numpy as np

from nondet_jax import config as cfg
from nondet_jax.analysis.task import QUANTITIES, task_of
from nondet_jax.config import Config
from nondet_jax.data import data_notes
from nondet_jax.errors import UsageError
from nondet_jax.machine.determinism import (
    DETERMINISM_OFF,
    NONDETERMINISTIC_BACKENDS,
    check_flags,
)
from nondet_jax.models.parts import Parts
from nondet_jax.replicas.choice import strategy_epoch_shape
from nondet_jax.replicas.rule import resolve_study
from nondet_jax.report.markdown import write_report
from nondet_jax.report.summary import format_table
from nondet_jax.sources import Arm
from nondet_jax.store.io import atomic_write_bytes, check_no_links, check_path_name, guarded, npy_bytes
from nondet_jax.store.paths import RunPaths
from nondet_jax.store.run import RunStore
from nondet_jax.study import multihost as mh
from nondet_jax.study.arm import arm_setup, finish_arm, fit_arm, grow_arm, train_arm
from nondet_jax.study.child import run_in_child
from nondet_jax.study.hardware import train_arm_per_process
from nondet_jax.study.parts import block_meta, merge_blocks, write_part
from nondet_jax.study.prepare import (
    check_epoch_shape,
    check_model,
    check_watchable,
    default_out,
    model_record,
    parse_arms,
    prepare,
)
from nondet_jax.study.progress import Progress
from nondet_jax.study.provenance import environment, fallback_said, instruments_path
from nondet_jax.until import check_arms


def study_strategy(config: Config) -> str:
    """The strategy this study's arms run (``auto`` resolved)."""
    return resolve_study(config.study)[0]


def study_epoch_shape(config: Config, fns) -> str:
    """The epoch shape this study's strategy runs (what ``environment.json`` records)."""
    return strategy_epoch_shape(fns, study_strategy(config))


def write_run_files(store, config: Config, data, fns, command: str | None, model: dict,
                    processes: int = 1, log=print) -> tuple[str, str]:
    """What every study writes before training, single- or multi-process alike: ``environment.json``
    (with the strategy and why, and how the instruments form per-example gradients), ``model.json``
    (:func:`model_record`), the test labels, the command. Returns (strategy, reason)."""
    study = config.study
    strategy, reason = resolve_study(study)
    env = environment()
    env["strategy"] = {"requested": study.strategy, "chosen": strategy, "reason": reason}
    env["scan_unroll"] = fns.unroll
    env["epoch_shape"] = study_epoch_shape(config, fns)
    env["replica_threads"] = fns.replica_threads if strategy == "sequential" else 1
    env["processes"] = processes
    for note in training_notes(config, data, fns):
        log(note)
    path = instruments_path(fns, data)
    if path is not None:
        env["instruments_path"] = path
        for why in path["why"]:  # said once here; training itself then runs under fallback_said()
            log(why)
    store.write_json(store.paths.environment.name, env)
    store.write_json(store.paths.model.name, model)
    if command:
        atomic_write_bytes(store.paths.command, (made_by(store.paths.command, command) + "\n").encode(), root=store.root)
    atomic_write_bytes(store.paths.test_labels, npy_bytes(np.asarray(data.y_test)), root=store.root)
    return strategy, reason


def made_by(path, command: str) -> str:
    """``command.txt``'s text after ``command``: the command itself, but a ``--resume`` (which names only the folder)
    keeps the command that started the folder first and is added after it (it replaced it)."""
    if "--resume" not in command.split() or not path.is_file():
        return command
    try:
        lines = [line for line in path.read_text().splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError):
        return command
    return "\n".join(lines + ([command] if command not in lines else []))


BN_LEFT = 0.05  # the share of the initial running statistics a study's BatchNorm may keep at its end


DROPPED_SHARE = 0.05  # the share of the training examples an epoch may leave out (full batches only) unsaid


def training_notes(config: Config, data, fns) -> list[str]:
    """Lines for the log about training that runs as configured but likely not as meant: BatchNorm statistics
    that cannot converge (:func:`batch_norm_note`), a batch size that leaves a sizeable share of the examples out of
    every epoch, a warm-up as long as training (the cosine schedule then never decays)."""
    out = [note for note in [batch_norm_note(config, data, fns)] if note]
    n, b = len(data.x_train), config.train.batch_size
    left = n - fns.steps_per_epoch * b
    if left > DROPPED_SHARE * n:
        out.append(f"note: batch size {b} leaves {left} of the {n} training examples ({100 * left / n:.0f}%) out of "
                   "every epoch (full batches only; each epoch's shuffle leaves out others); choose a batch size "
                   f"that divides {n} more nearly, e.g. {n // max(1, round(n / b))}")
    o, total = config.optim, config.train.epochs * fns.steps_per_epoch
    if not cfg.user_optimizer(o) and o.schedule == "cosine" and round(o.warmup_epochs * fns.steps_per_epoch) >= total:
        out.append(f"note: optim.warmup_epochs={o.warmup_epochs:g} is as long as training ({config.train.epochs} "
                   f"epoch(s)): the learning rate rises to {o.lr:g} over all {total} steps and never decays; train "
                   f"for more than {o.warmup_epochs:g} epochs or set a shorter warm-up (--set optim.warmup_epochs=...)")
    return out


def batch_norm_note(config: Config, data, fns) -> str | None:
    """A line for the log when the model's BatchNorm running statistics cannot have converged over the
    study's training steps: a running average with momentum m keeps m**steps of its initial value
    (mean 0, variance 1), and the test scores, computed with those statistics, measure that."""
    momenta = fns.model.bn_momenta(data.x_train[:1])
    if not momenta:
        return None
    steps = config.train.epochs * fns.steps_per_epoch
    m = max(momenta)
    left = m ** steps
    if left <= BN_LEFT:
        return None
    return (f"note: BatchNorm momentum {m:g} over this study's {steps} training steps leaves {100 * left:.0f}% of its "
            "running statistics at their initial values (mean 0, variance 1), and the test scores use them; train "
            f"longer or use momentum <= {BN_LEFT ** (1 / steps):.2f} (Flax's default is 0.99)")


def finish_study(store, log) -> dict:
    """After the arms: the report (``replicas.csv`` and the other tables over every finished arm with it)."""
    summary = write_report(store.root)
    log(format_table(summary))
    log(f"report: {store.paths.report}")
    return summary


def log_accuracy(log, arm: Arm, record: dict) -> None:
    if record["metrics"]:
        q = QUANTITIES[task_of(record)][0]
        acc = record["metrics"][q.name]
        if q.name == "accuracy":  # in % as the table prints it
            said = f"test accuracy {100 * acc['mean']:.2f}% (std {100 * acc['std']:.2f})"
        else:
            said = f"{q.label} {acc['mean']:.4g} (std {acc['std']:.4g})"
        log(f"arm {arm.name}: {said}, {record['seconds']:.1f} s")


def run(config: Config, out: str | Path | None = None, progress: bool | None = None, log=print,
        command: str | None = None, recompute: tuple[str, ...] = (), parts: Parts = Parts(), data=None,
        after_arm=None, grow: bool = False, procs: mh.Processes = mh.Processes(0, 1)) -> dict | None:
    """Run a study: train every arm not yet finished in ``out``, then write the report.

    Arms that vary ``hardware`` run in a child process with XLA's determinism flags off; the
    others run here, under this process's flags. Returns the summary (also in ``summary.json``).
    Arms named in ``recompute`` are deleted (results and checkpoints) and trained again.
    ``parts`` and ``data`` are the user's own (see :func:`prepare`). ``after_arm(out, arm_name)``, when
    given, runs once each arm is stored (or found finished), e.g. to export it to TensorBoard.
    ``out`` None is :func:`default_out` of the config and the study's identity by content. The
    summary returned carries ``out``, the run folder. ``grow``: a look of a sequential study
    (:mod:`nondet_jax.study.sequential`): ``study.replicas`` may exceed the folder's, and each arm trains
    only the replicas it lacks (:func:`nondet_jax.study.arm.grow_arm`). ``procs``: this process's place among
    several that share the study (:mod:`nondet_jax.study.multihost`): each trains its block of every arm's
    replicas, and process 0 holds the folder's lock, merges, stores, reports and alone returns the summary
    (None elsewhere). Raises UsageError on bad input before anything is written.
    """
    in_memory = parts != Parts() or data is not None
    if out is not None:
        check_path_name(Path(out), "--out")  # before anything reads the folder
    data, fns = prepare(config, parts, data)
    study = config.study
    arms = parse_arms(config)
    unknown = [a for a in recompute if a not in study.arms]
    if unknown:
        raise UsageError(f"--recompute names arm '{unknown[0]}', which is not in this study's arms "
                         f"({', '.join(study.arms)}); name one of those")
    hardware_arms = [a.name for a in arms if "hardware" in a.varied]
    if hardware_arms and in_memory:
        raise UsageError(f"arm '{hardware_arms[0]}' trains in a child process that rebuilds the study from the run "
                         "folder, so it cannot use parts passed in memory; run it with the CLI (--model "
                         "PACKAGE.MODULE:ATTR --dataset PATH.npz) on the same --out, or drop it")
    check_watchable(config, fns, study_strategy(config))
    if procs.count > 1:
        check_processes(study, hardware_arms, recompute, procs)
    if grow:
        check_arms(study.arms)
    if hardware_arms:
        check_flags(DETERMINISM_OFF)
    model = model_record(config, data, fns)
    out = Path(out) if out is not None else default_out(config, model["identity_sha256"])
    check_no_links(out)  # no link or FIFO in the folder: model.json is read before the folder is opened
    check_model(RunPaths(out), model, config)
    check_epoch_shape(RunPaths(out), study_epoch_shape(config, fns), recompute)
    if progress is None:
        progress = sys.stderr.isatty()
    backend = jax.default_backend()
    log = log if procs.leader else (lambda *a, **k: None)
    if not in_memory and config.data.name.endswith(".npz"):  # run_study notes the arrays it is given itself
        for line in data_notes(data, "store them as integers in the .npz"):
            log(line)

    store = RunStore(out, config, recompute=recompute, identity=model["identity_sha256"], grow=grow,
                     locked_by_parent=not procs.leader)
    try:
        strategy = open_study(store, config, data, fns, command, model, procs, log)
        log(f"nondet_jax: {len(arms)} arms x {study.replicas} replicas of {config.model.name} on {data.name} "
            f"({len(data.x_train)} train / {len(data.x_test)} test), {config.train.epochs} epoch{'s' if config.train.epochs != 1 else ''}, strategy "
            f"{strategy} on {backend}{f' over {procs.count} processes' if procs.count > 1 else ''} -> {out}")
        if hardware_arms and backend not in NONDETERMINISTIC_BACKENDS:
            log(f"note: {backend} reductions are deterministic, so arm(s) {', '.join(hardware_arms)} check that "
                "(replicas must come out bitwise identical even with XLA's determinism flags off); batch_order is "
                "the simulated counterpart of hardware nondeterminism here")
        for name in recompute:
            log(f"arm {name}: deleting its results and checkpoints to train it again (--recompute)")
            store.remove_arm(name)
        with Progress(progress and procs.leader, None if progress else log) as bar, fallback_said():
            for arm in arms:
                if store.arm_done(arm.name):
                    log(f"arm {arm.name}: already finished in {out}, reusing it")
                elif (record := train_one(config, data, fns, store, arm, bar, log, strategy, procs, grow,
                                          hardware=arm.name in hardware_arms)) is not None and not progress:
                    log_accuracy(log, arm, record)
                if after_arm is not None and procs.leader:
                    after_arm(out, arm.name)
        if not procs.leader:
            return None
        if store.paths.parts().is_dir() and not any(store.paths.parts().iterdir()):
            guarded("rmdir", store.root, store.paths.parts())
        summary = finish_study(store, log)
    finally:
        store.close()
    control = summary["arms"].get("control")
    if control and not control["replicas_bitwise_identical"] and backend == "cpu":
        log("WARNING: the control arm's replicas are not bitwise identical on CPU: the backend or the "
            "strategy is not deterministic here (see environment.json)")
    return {**summary, "out": str(out)}


def check_processes(study, hardware_arms: list[str], recompute, procs: mh.Processes) -> None:
    """What a study shared by several processes cannot do, refused before anything is written."""
    if hardware_arms:
        raise UsageError("hardware arms train in a child process of their own, which a multi-process run cannot "
                         "start; run them in a single-process sweep on the same --out")
    if recompute:
        raise UsageError("--recompute runs in a single process; rerun it without --num-processes first")
    if study.replicas < procs.count:
        raise UsageError(f"{study.replicas} replicas cannot be split over {procs.count} processes; use --replicas "
                         f"{procs.count} or more")


def open_study(store, config: Config, data, fns, command: str | None, model: dict, procs: mh.Processes, log) -> str | None:
    """Open the run folder (process 0 takes its lock) and write what a study writes before training; with
    several processes, every one learns whether process 0 could. Returns the strategy's name (None on the others)."""
    error, strategy = None, None
    try:
        store.open()
        if procs.leader:
            strategy = write_run_files(store, config, data, fns, command, model, procs.count, log=log)[0]
    except UsageError as e:
        error = e
    if procs.count == 1 and error is not None:
        raise error
    if procs.count > 1 and not mh.agree(error is None):
        raise error or UsageError(f"process 0 could not open the run folder {store.root}; see its error")
    return strategy


def train_one(config: Config, data, fns, store, arm: Arm, bar, log, strategy: str, procs: mh.Processes, grow: bool,
              hardware: bool) -> dict | None:
    """Train one arm the way this study does, store it and return its record (None on processes other than 0)."""
    study = config.study
    if procs.count > 1:  # this process's block, kept as a part; process 0 merges the blocks into the arm
        block = mh.replica_block(study.replicas, procs.index, procs.count)
        result, reason = fit_arm(config, data, fns, store, arm, bar.arm(arm.name, len(block) * config.train.epochs),
                                 log, block)
        write_part(store, arm, result, block_meta(study.seed, arm, block, store.identity))
        mh.barrier(f"trained {arm.name}")
        record, error = None, None
        if procs.leader:
            blocks = [mh.replica_block(study.replicas, i, procs.count) for i in range(procs.count)]
            try:  # a part refused (e.g. a process under other XLA flags) stops every process, not only this one
                merged = merge_blocks(config, data, arm_setup(config, fns, arm)[1], store, arm, blocks, strategy,
                                      parallel=True)
            except UsageError as e:
                error = e
        if not mh.agree(error is None):
            raise error or UsageError(f"process 0 could not merge the parts of arm '{arm.name}'; see its error")
        if procs.leader:
            record = finish_arm(config, data, fns, store, arm, merged, reason, log)
            guarded("rmtree", store.root, store.paths.parts(arm.name))
        mh.barrier(f"stored {arm.name}")
        return record
    if hardware and study.hardware_processes == "replica":
        return train_arm_per_process(config, data, fns, store, arm, DETERMINISM_OFF, log)
    if hardware:
        log(f"arm {arm.name}: training in a child process with XLA_FLAGS {' '.join(DETERMINISM_OFF)}")
        run_in_child(store.root, arm, DETERMINISM_OFF)
        return store.load_arm(arm.name)
    if grow:
        return grow_arm(config, data, fns, store, arm, lambda n: bar.arm(arm.name, n), log)
    return train_arm(config, data, fns, store, arm, bar.arm(arm.name, study.replicas * config.train.epochs), log)
