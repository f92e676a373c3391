"""One arm: its keys, its training (resumable), its metrics and the files it writes."""

from __future__ import annotations

import csv
import io
import os

import jax
import numpy as np

from nondet_jax import config as cfg
from nondet_jax.analysis.arm import arm_metrics
from nondet_jax.analysis.dynamics import fit_growth_rate
from nondet_jax.analysis.health import (
    bitwise_identical,
    divergence_records,
    healthy_indices,
    healthy_subset,
)
from nondet_jax.analysis.metrics import accuracy, cross_entropy, regression_errors
from nondet_jax.analysis.mitigations import snapshot_epochs
from nondet_jax.analysis.over_training import best_epochs, evaluated_epochs, test_curves
from nondet_jax.analysis.task import TRAIN_SCORE
from nondet_jax.analysis.tta import tta_logits, view_grid
from nondet_jax.config import Config
from nondet_jax.errors import UsageError
from nondet_jax.instruments.dashboard import tidy_rows
from nondet_jax.machine import xla_flags
from nondet_jax.machine.determinism import provenance
from nondet_jax.replicas.choice import make_strategy, strategy_epoch_shape
from nondet_jax.replicas.loop import EpochState, _take, train_replicas
from nondet_jax.replicas.rule import resolve_study
from nondet_jax.replicas.watch import pair_trace, pair_watcher
from nondet_jax.sources import Arm, arm_keys, perturbations
from nondet_jax.store.checkpoint import (
    ArmCheckpoints,
    CorruptCheckpoint,
    key_fingerprint,
)
from nondet_jax.store.io import flatten_tree, npy_bytes, npz_bytes
from nondet_jax.store.paths import RunPaths
from nondet_jax.store.run import config_digest
from nondet_jax.study import parts
from nondet_jax.train import augmentation_settings, make_schedule, make_train


def arm_record(arm: Arm, result, strategy_reason: str, arm_metrics: dict, scores: dict[str, np.ndarray],
               task: str = "classification") -> dict:
    """The JSON record of a finished arm: per-replica rows (the task's test ``scores``, e.g.
    ``{"test_accuracy": ..., "test_loss": ...}``, and the training loss and score at the end),
    metrics, and how it was trained."""
    n = len(next(iter(scores.values())))
    rows = [{"arm": arm.name, "replica": r, **{k: float(v[r]) for k, v in scores.items()},
             "train_loss": float(result.train_loss[r, -1]), TRAIN_SCORE[task]: float(result.train_accuracy[r, -1]),
             "diverged_at_step": int(result.diverged_at[r]), "strategy": result.strategy} for r in range(n)]
    acc = next(iter(scores.values()))
    return {
        "arm": arm.name,
        "task": task,
        "varied": sorted(arm.varied),
        "replicas": len(acc),
        "replicas_used": int((result.diverged_at < 0).sum()),  # the metrics leave diverged replicas out
        "strategy": result.strategy,
        "strategy_reason": strategy_reason,
        "seconds": round(result.seconds, 3),
        "replicas_bitwise_identical": bitwise_identical(result.logits, result.diverged_at),
        "provenance": provenance(),
        "metrics": arm_metrics,
        "rows": rows,
    }


FAULT_ENV = "NONDET_JAX_INJECT_FAULT"  # "arm:replica:epoch": NaN weights before that epoch (fault tests)


def injected_fault(arm: Arm) -> tuple[int, int] | None:
    """(replica, epoch) of a fault to inject into ``arm``, from ``$NONDET_JAX_INJECT_FAULT``."""
    spec = os.environ.get(FAULT_ENV, "")
    parts = spec.split(":")
    if len(parts) == 3 and parts[0] == arm.name:
        return int(parts[1]), int(parts[2])
    return None


def arm_setup(config: Config, fns, arm: Arm):
    """(config, fns) an arm trains under: ``arm@snapshotK`` swaps in the snapshot schedule."""
    if arm.cycles:  # the same arm under the snapshot schedule, logits kept at each cycle end
        config = cfg.arm_config(config, arm)
        fns = make_train(config, fns.spec, fns.parts)
    return config, fns


def fit_arm(config: Config, data, fns, store, arm: Arm, progress, log=print, block: range | None = None):
    """Train replicas ``block`` (default: all) of an arm, continuing from their latest checkpoint and
    checkpointing every ``train.checkpoint_every`` epochs once ``train.checkpoint_seconds`` have passed since the
    last checkpoint. Returns (ArmResult, strategy reason)."""
    study = config.study
    config, fns = arm_setup(config, fns, arm)
    block = block or range(study.replicas)
    strategy_name, reason = resolve_study(study, len(block))
    strategy = make_strategy(fns, strategy_name)
    keys = arm_keys(study.seed, arm.varied, block.stop, first=block.start)
    perturb = perturbations(arm.varied)
    folder = store.paths.checkpoints(arm.name)
    if len(block) != study.replicas:
        folder = folder / f"replicas{block.start}-{block.stop - 1}"
    ckpt = ArmCheckpoints(folder, config.train.checkpoint_every, seconds=config.train.checkpoint_seconds)
    # The study that wrote a checkpoint (its config and parts by content) and the XLA flags its kernels ran under
    # (the user's, the CLI's determinism and CPU-type flags): another one is never resumed, so an arm in training
    # never continues under other kernels.
    meta = {"arm": arm.name, "keys_sha256": key_fingerprint(keys), "strategy": strategy_name,
            "epoch_shape": strategy_epoch_shape(fns, strategy_name),
            "config_sha256": config_digest(cfg.to_dict(config)), "identity_sha256": store.identity,
            "xla_flags": xla_flags.kernel_flags()}
    try:
        restored = ckpt.restore_latest(jax.eval_shape(strategy.init, keys, perturb, data.x_train[:1]),
                                       {k: v for k, v in meta.items() if k != "arm"})
    except CorruptCheckpoint as e:
        ckpt.close()
        raise UsageError(f"{e}; rerun with --recompute {arm.name} to train arm '{arm.name}' again from scratch") from None
    start = None
    if restored is not None:
        start = EpochState(*restored)
        log(f"arm {arm.name}: resuming from its checkpoint after epoch {start.epoch}")
        progress(start.epoch * len(block))
    watcher = None
    if watched(config, arm):  # replicas 0 and 1 where this block holds both (every block carries the metrics)
        watcher = pair_watcher(fns, data.x_test, study.dynamics_every, (0,) if block.start == 0 and len(block) > 1 else ())
    result = train_replicas(strategy, keys, perturb, data, config.train.epochs, progress, start=start,
                            on_epoch=lambda p: ckpt.save(p, meta), fault=injected_fault(arm),
                            eval_epochs=test_epochs(config, arm), watcher=watcher)
    ckpt.close()
    return result, reason


def watched(config: Config, arm: Arm) -> bool:
    """Whether the arm's replicas 0 and 1 are watched while they train (``study.dynamics_every``; not the control
    arm, whose replicas are identical)."""
    return config.study.dynamics_every > 0 and arm.name != "control" and config.study.replicas >= 2


def grow_arm(config: Config, data, fns, store, arm: Arm, progress_for, log=print) -> dict:
    """A look of a sequential study: train the replicas of ``arm`` that no part holds yet, as one block kept as
    a part (:mod:`nondet_jax.study.parts`), then store the arm merged from all its parts.
    ``progress_for(total)`` gives the progress callback for ``total`` replica-epochs."""
    study = config.study
    blocks = parts.trained_blocks(store, arm)
    parts.check_blocks(store, study.seed, arm, blocks)  # before training a block the merge would refuse beside them
    done = blocks[-1].stop if blocks else 0
    if done > study.replicas:
        raise UsageError(f"{store.paths.parts(arm.name)} holds {done} replicas of arm '{arm.name}', more than this "
                         f"study's {study.replicas}; rerun with --recompute {arm.name} to train it again")
    strategy_name, reason = resolve_study(study)
    if done < study.replicas:
        block = range(done, study.replicas)
        result, reason = fit_arm(config, data, fns, store, arm, progress_for(len(block) * config.train.epochs),
                                 log, block)
        parts.write_part(store, arm, result, parts.block_meta(study.seed, arm, block, store.identity))
        blocks.append(block)
    merged = parts.merge_blocks(config, data, arm_setup(config, fns, arm)[1], store, arm, blocks, strategy_name)
    return finish_arm(config, data, fns, store, arm, merged, reason, log)


def test_epochs(config: Config, arm: Arm) -> tuple[int, ...]:
    """The epoch counts after which an arm's test outputs are kept: its snapshot cycles' ends and, with
    ``study.eval_every``, every k epochs and the last."""
    cycles = snapshot_epochs(config.train.epochs, arm.cycles) if arm.cycles else ()
    return tuple(sorted(set(cycles) | set(evaluated_epochs(config.train.epochs, config.study.eval_every))))


def train_arm(config: Config, data, fns, store, arm: Arm, progress, log=print) -> dict:
    """Train one arm in this process (continuing from its latest checkpoint), then :func:`finish_arm`."""
    result, reason = fit_arm(config, data, fns, store, arm, progress, log)
    return finish_arm(config, data, fns, store, arm, result, reason, log)


def finish_arm(config: Config, data, fns, store, arm: Arm, result, reason: str, log=print) -> dict:
    """Compute an arm's metrics on the replicas that did not diverge, store everything, delete its
    checkpoints; returns its record."""
    study = config.study
    config, fns = arm_setup(config, fns, arm)
    labels = np.asarray(data.y_test)
    used = healthy_subset(result)
    diverged = divergence_records(result)
    for d in diverged:
        why = "its test outputs are not finite" if d["cause"] == "outputs" else "its training loss stopped being finite"
        last = d["last_finite_loss"]
        last = f"last finite loss {last:.4g}" if np.isfinite(last) else "no finite loss before it"
        log(f"arm {arm.name}: replica {d['replica']} diverged at step {d['step']} ({why}; {last}); it is frozen "
            "there and left out of the metrics")
    if len(used.logits):
        metrics, pair_arrays = arm_metrics(used, data, fns, config.metrics)
    else:
        metrics, pair_arrays = {}, {}
    task = getattr(data, "task", "classification")
    if task == "regression":
        scores = dict(zip(("test_mse", "test_mae"), regression_errors(result.logits, labels)))
    else:
        scores = {"test_accuracy": accuracy(result.logits, labels), "test_loss": cross_entropy(result.logits, labels)}
    record = arm_record(arm, result, reason, metrics, scores, task)
    record["diverged"] = diverged
    kept = test_epochs(config, arm)
    history = {"train_loss": result.train_loss, "train_accuracy": result.train_accuracy,
               "weight_distance": result.weight_distance, "step_loss": result.steps["loss"],
               "diverged_at": result.diverged_at}
    if study.eval_every:  # the test curves, and each replica's best epoch (on those that did not diverge)
        at = evaluated_epochs(config.train.epochs, study.eval_every)
        idx = [kept.index(e) for e in at]
        curves = test_curves(result.snapshots[:, idx], labels, task)
        history.update({"test_epochs": np.asarray(at), **curves})
        keep = healthy_indices(result.diverged_at)
        if len(keep):
            record["over_training"] = best_epochs({k: v[keep] for k, v in curves.items()}, at, study.eval_every,
                                                  len(labels))
    trace = pair_trace(fns, result, data.x_test, study.dynamics_every) if watched(config, arm) else None
    if trace is not None:
        record["dynamics"] = {"every": study.dynamics_every,
                              **fit_growth_rate(trace["step"], trace["weight_distance"])}
    elif watched(config, arm):
        log(f"arm {arm.name}: replicas 0 and 1 trained in different processes, so their divergence was not watched")
    extra = {}
    if "instruments" in result.steps:
        values = instrument_values(config, fns, result)
        extra[RunPaths.rel("instruments", arm.name)] = npz_bytes(values)
        extra[RunPaths.rel("instruments", arm.name, ".csv")] = tidy_csv(arm.name, values)
    if arm.cycles:
        cycle_idx = [kept.index(e) for e in snapshot_epochs(config.train.epochs, arm.cycles)]
        extra[RunPaths.rel("snapshots", arm.name)] = npy_bytes(result.snapshots[:, cycle_idx].astype(np.float32))
    elif config.metrics.tta:
        extra[RunPaths.rel("tta", arm.name)] = npz_bytes(tta_outputs(config, data, fns, result.state))
    store.save_arm(arm.name, record, result.logits.astype(np.float32), result.features.astype(np.float32), history,
                   {**{f"params/{k}": v for k, v in flatten_tree(result.state.params).items()},
                    **{f"batch_stats/{k}": v for k, v in flatten_tree(result.state.batch_stats).items()}},
                   pair_arrays, trace, extra)
    store.remove_checkpoints(arm.name)
    return record


def instrument_values(config: Config, fns, result) -> dict[str, np.ndarray]:
    """The instruments' values at the tracked steps: ``step`` (T,), each quantity (R, T, ...), and
    the training ``loss``, ``accuracy`` and learning rate ``lr`` at those steps (for the dashboard)."""
    steps = np.flatnonzero(np.asarray(result.steps["tracked"])[0])
    values = {k: np.asarray(v)[:, steps] for k, v in result.steps["instruments"].items()}
    if "Alpha" in values:  # finished at the next step, stored (as Cockpit does) at the step whose update it judges
        raw = np.asarray(result.steps["instruments"]["Alpha"])
        values["Alpha"] = np.concatenate([raw, np.full_like(raw[:, :1], np.nan)], axis=1)[:, steps + 1]
    out = {"step": steps, **values, "loss": np.asarray(result.steps["loss"])[:, steps],
           "accuracy": np.asarray(result.steps["accuracy"])[:, steps]}
    if not cfg.user_optimizer(config.optim):  # your own optimiser's learning rate is not the config's schedule
        lr = make_schedule(config.optim, config.train.epochs, fns.steps_per_epoch)
        out["lr"] = np.asarray([float(lr(int(t))) for t in steps])
    return out


def tidy_csv(arm: str, values: dict) -> bytes:
    """The tidy table (step, arm, replica, quantity, layer, value) of the scalar instruments."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=["step", "arm", "replica", "quantity", "layer", "value"], lineterminator="\n")
    w.writeheader()
    w.writerows(tidy_rows(arm, values))
    return buf.getvalue().encode()


def tta_outputs(config: Config, data, fns, state) -> dict[str, np.ndarray]:
    """Each replica's test logits under every view set of ``metrics.tta``: name -> (R, N, C)."""
    padding = augmentation_settings(config, data.name, data.x_train.shape[1])[2]
    x = jax.numpy.asarray(data.x_test)
    out = {}
    for name in config.metrics.tta:
        views = view_grid(name, padding)
        fn = jax.jit(lambda st: tta_logits(fns.evaluate, st, x, views, padding))
        r_count = len(np.asarray(state.health.diverged_at))
        out[name] = np.stack([np.asarray(fn(_take(state, r))) for r in range(r_count)])
    return out
