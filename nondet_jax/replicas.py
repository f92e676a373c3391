"""Execution strategies: run the single-replica functions of ``train`` for R replicas.

* ``vmap``: one jitted program over the replica axis (convolutions become grouped convolutions);
* ``sharded``: the replica axis over a device mesh, vmapped on each device (:mod:`nondet_jax.sharding`);
* ``sequential``: each function jitted once, a Python loop over replicas (no recompilation);
* ``auto``: a documented per-backend rule (:func:`resolve_strategy`), recorded with the results.

Replica r's keys, and so its draws, are the same under every strategy; ``sequential`` runs
exactly the single-replica program, ``vmap`` may differ from it by floating-point rounding.
"""

from __future__ import annotations

import time
from typing import Any, Callable, NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np

from nondet_jax.health import flag_nonfinite_outputs
from nondet_jax.metrics import flatten_weights, weight_distance
from nondet_jax.sources import Perturbations, ReplicaKeys, replica_slice
from nondet_jax.train import TrainFns, TrainState


class ArmResult(NamedTuple):
    """What training one arm produced; arrays carry a leading replica axis R."""

    state: TrainState  # final weights, BatchNorm statistics, optimiser state and Health
    train_loss: np.ndarray  # (R, epochs) mean training loss per epoch (NaN once a replica diverged)
    train_accuracy: np.ndarray  # (R, epochs)
    logits: np.ndarray  # (R, n_test, classes)
    features: np.ndarray  # (R, n_test, features)
    weight_distance: np.ndarray  # (epochs + 1, pairs): ||θa − θb|| / ||θa|| at init and after each epoch
    strategy: str
    seconds: float
    steps: dict  # per-step training metrics, leaves (R, epochs * steps_per_epoch, ...)
    snapshots: np.ndarray  # (R, K, n_test, classes) test logits after each of ``eval_epochs`` (K may be 0)

    @property
    def diverged_at(self) -> np.ndarray:
        """(R,) global step at which each replica diverged and was frozen; -1 = never."""
        return np.asarray(self.state.health.diverged_at)


class Progress(NamedTuple):
    """Where an arm's training stands after ``epoch`` epochs: what a checkpoint holds."""

    epoch: int
    state: TrainState  # stacked over replicas
    steps: dict  # per-step metrics so far, leaves (R, epoch * steps_per_epoch, ...)
    weight_distance: np.ndarray  # (epoch + 1, pairs)
    snapshots: np.ndarray | None = None  # (R, k, n_test, classes) logits after the eval_epochs passed so far


class Strategy(NamedTuple):
    """How R replicas are executed: functions over states stacked on a leading replica axis."""

    name: str
    init: Callable  # (keys, perturb, x_sample) -> stacked TrainState
    epoch: Callable  # (state, x, y, keys, perturb, epoch, progress) -> (state, metrics with leaves (R, steps))
    evaluate: Callable  # (state, x) -> (logits, features), each (R, ...)


def resolve_strategy(requested: str, replicas: int, backend: str | None = None) -> tuple[str, str]:
    """Pick the strategy for ``auto``; returns (strategy, reason), the reason naming the measurement.

    Rule: one replica runs ``sequential``; several accelerators run ``sharded`` (replicas over the
    devices, vmapped on each); otherwise the backend's measured rule in ``measured.json``
    (:func:`nondet_jax.measured.strategy_rule`): ``vmap`` from ``vmap_min_replicas`` replicas on,
    ``sequential`` below it or when it is null (CPU: a vmapped ResNet step cost several times the
    loop, benchmarks/replicas.py and benchmarks/peer_pytorch.py; one GPU: vmap from 16 replicas on,
    from benchmarks/gpu_bench.py on an H200, where ResNet-14 at batch 128 gave 0.73x the loop's
    replica-images/s at R=4, 0.99x at R=16, 1.10x at R=64 in float32). A backend without a rule
    (TPU: not measured here) runs ``vmap``.
    """
    from nondet_jax.measured import strategy_rule

    if requested != "auto":
        return requested, "requested"
    backend = backend or jax.default_backend()
    if replicas == 1:
        return "sequential", "auto: one replica"
    if backend != "cpu" and jax.local_device_count() > 1:
        return "sharded", f"auto: replicas over {jax.local_device_count()} {backend} devices, vmapped on each"
    rule = strategy_rule(backend)
    if not rule:
        return "vmap", f"auto: {backend} batches replicas with vmap (no measured rule for {backend})"
    least = rule.get("vmap_min_replicas")
    if least is None or replicas < least:
        below = "never beat" if least is None else f"did not beat below {least} replicas"
        return "sequential", f"auto: on {backend} vmap {below} a loop ({rule['source']})"
    return "vmap", f"auto: on {backend} vmap beat a loop from {least} replicas on ({rule['source']})"


def _stack(trees: list[Any]) -> Any:
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def _take(tree: Any, r: int) -> Any:
    return jax.tree.map(lambda a: a[r], tree)


def _distances(params) -> np.ndarray:
    """Pairwise relative weight distances of stacked params (leading axis R); empty for R = 1."""
    r = jax.tree.leaves(params)[0].shape[0]
    return weight_distance(flatten_weights(params)) if r > 1 else np.zeros(0)


def sequential_strategy(fns: TrainFns) -> Strategy:
    """The single-replica programs, each compiled once, in a Python loop over replicas."""
    init, epoch_fn, evaluate = jax.jit(fns.init), jax.jit(fns.train_epoch), jax.jit(fns.evaluate)

    def init_all(keys, perturb, x):
        r_count = jax.tree.leaves(keys)[0].shape[0]
        return _stack([init(replica_slice(keys, r), perturb, x) for r in range(r_count)])

    def epoch_all(state, x, y, keys, perturb, e, progress):
        r_count = jax.tree.leaves(keys)[0].shape[0]
        states, metrics = [], []
        for r in range(r_count):
            s, m = epoch_fn(_take(state, r), x, y, replica_slice(keys, r), perturb, e)
            states.append(s)
            metrics.append(jax.block_until_ready(m))
            progress(1)
        return _stack(states), _stack(metrics)

    def evaluate_all(state, x):
        outputs = [evaluate(_take(state, r), x) for r in range(jax.tree.leaves(state.params)[0].shape[0])]
        return tuple(np.stack([np.asarray(o[i]) for o in outputs]) for i in (0, 1))

    return Strategy("sequential", init_all, epoch_all, evaluate_all)


def vmap_strategy(fns: TrainFns) -> Strategy:
    """One jitted program over the replica axis per epoch."""
    init = jax.jit(jax.vmap(fns.init, in_axes=(0, None, None)))
    epoch_fn = jax.jit(jax.vmap(fns.train_epoch, in_axes=(0, None, None, 0, None, None)))
    evaluate = jax.jit(jax.vmap(fns.evaluate, in_axes=(0, None)))

    def epoch_all(state, x, y, keys, perturb, e, progress):
        state, m = epoch_fn(state, x, y, keys, perturb, e)
        m = jax.block_until_ready(m)
        progress(jax.tree.leaves(keys)[0].shape[0])
        return state, m

    return Strategy("vmap", init, epoch_all, evaluate)


def inject_fault(state: TrainState, replica: int) -> TrainState:
    """A simulated hardware fault: every weight of ``replica`` becomes NaN (tests divergence handling)."""
    return state._replace(params=jax.tree.map(lambda a: a.at[replica].set(jnp.nan), state.params))


def train_replicas(strategy: Strategy, keys: ReplicaKeys, perturb: Perturbations, data, epochs: int,
                   progress: Callable[[int], None] = lambda n: None, start: Progress | None = None,
                   on_epoch: Callable[[Progress], None] = lambda p: None,
                   fault: tuple[int, int] | None = None, eval_epochs: tuple[int, ...] = ()) -> ArmResult:
    """Train the replicas whose keys are given (leading axis R) for ``epochs`` epochs.

    ``start`` continues from a checkpoint instead of initialising; ``on_epoch`` sees the
    :class:`Progress` after every epoch (to checkpoint it); ``fault = (replica, epoch)`` makes that
    replica's weights NaN before that epoch; after each epoch count in ``eval_epochs`` the test logits
    are kept (snapshot ensembles); replicas whose test outputs are not finite are marked diverged
    (:func:`nondet_jax.health.flag_nonfinite_outputs`). The loop is epoch-major: all R states exist at every
    epoch end (for the divergence curves), whatever the strategy.
    """
    t0 = time.perf_counter()
    x_tr, y_tr, x_te = (jnp.asarray(a) for a in (data.x_train, data.y_train, data.x_test))
    r_count = jax.tree.leaves(keys)[0].shape[0]
    if start is None:
        state = strategy.init(keys, perturb, x_tr[:1])
        start = Progress(0, state, {}, _distances(state.params)[None])
    state, steps, distances = start.state, start.steps, [start.weight_distance]
    snapshots = [] if start.snapshots is None else list(np.moveaxis(np.asarray(start.snapshots), 1, 0))
    chex.assert_tree_shape_prefix(state, (r_count,))
    for e in range(start.epoch, epochs):
        if fault is not None and fault[1] == e:
            state = inject_fault(state, fault[0])
        state, m = strategy.epoch(state, x_tr, y_tr, keys, perturb, jnp.int32(e), progress)
        m = jax.tree.map(np.asarray, m)
        steps = m if not steps else jax.tree.map(lambda a, b: np.concatenate([a, b], 1), steps, m)
        distances.append(_distances(state.params)[None])
        if e + 1 in eval_epochs:
            snapshots.append(np.asarray(strategy.evaluate(state, x_te)[0]))
        stacked = np.stack(snapshots, 1) if snapshots else None
        on_epoch(Progress(e + 1, state, steps, np.concatenate(distances), stacked))
    logits, feats = strategy.evaluate(state, x_te)
    per_epoch = {k: np.asarray(steps[k]).reshape(r_count, epochs, -1).mean(-1) for k in ("loss", "accuracy")}
    return flag_nonfinite_outputs(ArmResult(state, per_epoch["loss"], per_epoch["accuracy"], np.asarray(logits), np.asarray(feats),
                     np.concatenate(distances), strategy.name, time.perf_counter() - t0, steps,
                     np.stack(snapshots, 1) if snapshots else np.zeros((r_count, 0) + np.shape(logits)[1:], np.float32)))


STRATEGY_BUILDERS = {"vmap": vmap_strategy, "sequential": sequential_strategy}


def make_strategy(fns: TrainFns, name: str) -> Strategy:
    if name == "sharded":  # imported here: nondet_jax.sharding builds on this module
        from nondet_jax.sharding import sharded_strategy

        return sharded_strategy(fns)
    if name not in STRATEGY_BUILDERS:
        raise ValueError(f"unknown strategy {name!r}; use one of {', '.join(STRATEGY_BUILDERS)}")
    return STRATEGY_BUILDERS[name](fns)


def run_replicas(fns: TrainFns, keys: ReplicaKeys, perturb: Perturbations, data, epochs: int,
                 strategy: str, progress: Callable[[int], None] = lambda n: None, **kwargs) -> ArmResult:
    """Train the replicas whose keys are given (leading axis R) with a concrete strategy; keyword
    arguments go to :func:`train_replicas` (checkpoint resume, per-epoch callback, fault)."""
    return train_replicas(make_strategy(fns, strategy), keys, perturb, data, epochs, progress, **kwargs)
