"""Execution strategies: run the single-replica functions of ``train`` for R replicas.

* ``vmap``: one jitted program over the replica axis (convolutions become grouped convolutions);
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

from nondet_jax.metrics import flatten_weights, weight_distance
from nondet_jax.sources import Perturbations, ReplicaKeys, replica_slice
from nondet_jax.train import TrainFns, TrainState


class ArmResult(NamedTuple):
    """What training one arm produced; arrays carry a leading replica axis R."""

    state: TrainState  # final weights, BatchNorm statistics and optimiser state
    train_loss: np.ndarray  # (R, epochs) mean training loss per epoch
    train_accuracy: np.ndarray  # (R, epochs)
    logits: np.ndarray  # (R, n_test, classes)
    features: np.ndarray  # (R, n_test, features)
    weight_distance: np.ndarray  # (epochs + 1, pairs): ||θa − θb|| / ||θa|| at init and after each epoch
    strategy: str
    seconds: float


def resolve_strategy(requested: str, replicas: int, backend: str | None = None) -> tuple[str, str]:
    """Pick the strategy for ``auto``; returns (strategy, reason).

    Rule: one replica, or the CPU backend, runs ``sequential`` (on XLA:CPU a vmapped ResNet step
    costs several times the loop: benchmarks/replicas.py measures it); accelerators run ``vmap``.
    """
    if requested != "auto":
        return requested, "requested"
    backend = backend or jax.default_backend()
    if replicas == 1:
        return "sequential", "auto: one replica"
    if backend == "cpu":
        return "sequential", "auto: XLA:CPU runs vmapped convolutions slower than a loop (benchmarks/replicas.py)"
    return "vmap", f"auto: {backend} batches replicas with vmap"


def _stack(trees: list[Any]) -> Any:
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def _distances(params) -> np.ndarray:
    """Pairwise relative weight distances of stacked params (leading axis R); empty for R = 1."""
    r = jax.tree.leaves(params)[0].shape[0]
    return weight_distance(flatten_weights(params)) if r > 1 else np.zeros(0)


def _epoch_means(metrics: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """(R, epochs) means from per-epoch metrics whose leaves are (R, steps)."""
    loss = np.stack([np.asarray(m["loss"]).mean(-1) for m in metrics], -1)
    acc = np.stack([np.asarray(m["accuracy"]).mean(-1) for m in metrics], -1)
    return loss, acc


def run_sequential(fns: TrainFns, keys: ReplicaKeys, perturb: Perturbations, data, epochs: int,
                   progress: Callable[[int], None] = lambda n: None) -> ArmResult:
    """Train replicas with the single-replica programs (compiled once), looping over replicas
    inside each epoch so that all R states exist at every epoch end (for divergence curves)."""
    t0 = time.perf_counter()
    init, epoch_fn, evaluate = jax.jit(fns.init), jax.jit(fns.train_epoch), jax.jit(fns.evaluate)
    x_tr, y_tr, x_te = (jnp.asarray(a) for a in (data.x_train, data.y_train, data.x_test))
    r_count = jax.tree.leaves(keys)[0].shape[0]
    replica_keys = [replica_slice(keys, r) for r in range(r_count)]
    states = [init(k, perturb, x_tr[:1]) for k in replica_keys]
    distances = [_distances(_stack([s.params for s in states]))]
    metrics = []
    for e in range(epochs):
        epoch_metrics = []
        for r, k in enumerate(replica_keys):
            states[r], m = epoch_fn(states[r], x_tr, y_tr, k, perturb, jnp.int32(e))
            epoch_metrics.append(jax.block_until_ready(m))
            progress(1)
        metrics.append(_stack(epoch_metrics))
        distances.append(_distances(_stack([s.params for s in states])))
    outputs = [evaluate(s, x_te) for s in states]
    loss, acc = _epoch_means(metrics)
    return ArmResult(_stack(states), loss, acc, np.stack([np.asarray(o[0]) for o in outputs]),
                     np.stack([np.asarray(o[1]) for o in outputs]), np.stack(distances), "sequential",
                     time.perf_counter() - t0)


def run_vmap(fns: TrainFns, keys: ReplicaKeys, perturb: Perturbations, data, epochs: int,
             progress: Callable[[int], None] = lambda n: None) -> ArmResult:
    """Train all replicas in one vmapped program per epoch."""
    t0 = time.perf_counter()
    r_count = jax.tree.leaves(keys)[0].shape[0]
    init = jax.jit(jax.vmap(fns.init, in_axes=(0, None, None)))
    epoch_fn = jax.jit(jax.vmap(fns.train_epoch, in_axes=(0, None, None, 0, None, None)))
    evaluate = jax.jit(jax.vmap(fns.evaluate, in_axes=(0, None)))
    x_tr, y_tr, x_te = (jnp.asarray(a) for a in (data.x_train, data.y_train, data.x_test))
    state = init(keys, perturb, x_tr[:1])
    chex.assert_tree_shape_prefix(state, (r_count,))
    distances = [_distances(state.params)]
    metrics = []
    for e in range(epochs):
        state, m = epoch_fn(state, x_tr, y_tr, keys, perturb, jnp.int32(e))
        metrics.append(jax.block_until_ready(m))
        distances.append(_distances(state.params))
        progress(r_count)
    logits, feats = evaluate(state, x_te)
    loss, acc = _epoch_means(metrics)
    return ArmResult(state, loss, acc, np.asarray(logits), np.asarray(feats), np.stack(distances), "vmap",
                     time.perf_counter() - t0)


RUNNERS = {"vmap": run_vmap, "sequential": run_sequential}


def run_replicas(fns: TrainFns, keys: ReplicaKeys, perturb: Perturbations, data, epochs: int,
                 strategy: str, progress: Callable[[int], None] = lambda n: None) -> ArmResult:
    """Train the replicas whose keys are given (leading axis R) with a concrete strategy."""
    if strategy not in RUNNERS:
        raise ValueError(f"unknown strategy {strategy!r}; use one of {', '.join(RUNNERS)}")
    return RUNNERS[strategy](fns, keys, perturb, data, epochs, progress)
