"""The loop every strategy shares: an arm's replicas trained epoch by epoch, with checkpoints."""

from __future__ import annotations

import time
from typing import Any, Callable, NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np

from nondet_jax.analysis.health import flag_nonfinite_outputs
from nondet_jax.analysis.metrics import flatten_weights, weight_distance
from nondet_jax.machine.quick import once
from nondet_jax.sources import Perturbations, ReplicaKeys
from nondet_jax.train import TrainState


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


class EpochState(NamedTuple):
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
    # (state, x, y, keys, perturb, epoch, progress, watch=None) -> (state, metrics with leaves (R, steps)); watch(i,
    # replica) sees replica(r)'s state before step i (a stepped epoch only: else ValueError, see unwatched)
    epoch: Callable
    evaluate: Callable  # (state, x) -> (logits, features), each (R, ...)


class Watcher(NamedTuple):
    """A look at the replicas between training steps (divergence dynamics): ``look(epoch, i, replica)``, before
    step ``i`` of ``epoch`` with ``replica(r)`` replica r's state then, returns ``{name: {r: value}}`` for the
    replicas it measures, or None when the step is not one it measures. The loop keeps every
    name as a per-step metric (leaves (R, steps), NaN at the steps not measured), checkpointed and merged with
    the others; the look after the last step is the caller's (from the final state)."""

    names: tuple[str, ...]
    look: Callable


def unwatched(what: str) -> ValueError:
    """The error of a strategy asked to show its replicas between steps where its epochs are one program."""
    return ValueError(f"{what} runs each epoch as one program, so nothing can watch its replicas between steps; "
                      "watching needs train.epoch_shape step with the sequential or vmap strategy")


@once
def _stack_trees(trees: list[Any]) -> Any:
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


@once
def _take_tree(tree: Any, r) -> Any:
    return jax.tree.map(lambda a: a[r], tree)


def _host_device(leaves: list) -> Any:
    """The CPU device every leaf lives on, else None: there numpy stacks and slices in the process's own memory
    and nothing is compiled; on an accelerator, traced (``jax.eval_shape``, an enclosing ``jit``), for typed PRNG
    keys (numpy has no such dtype), weakly typed leaves (numpy would make them strong) or leaves that are not
    JAX arrays, a program does."""
    if not leaves or not all(isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) for x in leaves):
        return None
    devices = {d for x in leaves for d in x.devices()}
    if len(devices) != 1 or next(iter(devices)).platform != "cpu":
        return None
    if any(jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) or x.weak_type for x in leaves):
        return None
    return next(iter(devices))


def _put(tree: Any, device) -> Any:
    """Host arrays onto ``device``: left uncommitted on the default device, as a compiled program's outputs are
    (read-only views of one stacked buffer are fine: no program here donates its inputs)."""
    return jax.device_put(tree) if device == jax.devices()[0] else jax.device_put(tree, device)


def _stack(trees: list[Any]) -> Any:
    """Stack R pytrees on a new leading axis. On a CPU by numpy (copies, the same bits; the default study
    compiled 3 programs fewer, 0.59 s of compiling: ``benchmarks/study_compile.py``), elsewhere one compiled program per tree
    structure and R (stacking leaf by leaf outside a program compiled one per leaf shape: 16 of a study's 126
    programs)."""
    trees = list(trees)
    device = _host_device(jax.tree.leaves(trees))
    if device is None:
        return _stack_trees(trees)
    return _put(jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *trees), device)


def _take(tree: Any, r: int) -> Any:
    """Replica ``r`` of a stacked pytree: on a CPU by numpy, elsewhere one compiled program per tree structure,
    ``r`` an argument."""
    device = _host_device(jax.tree.leaves(tree))
    if device is None:
        return _take_tree(tree, r)
    return _put(jax.tree.map(lambda a: np.asarray(a)[r], tree), device)


def _distances(params) -> np.ndarray:
    """Pairwise relative weight distances of stacked params (leading axis R); empty for R = 1."""
    r = jax.tree.leaves(params)[0].shape[0]
    return weight_distance(flatten_weights(params)) if r > 1 else np.zeros(0)


def watched_columns(watcher: Watcher, looks: dict, r_count: int, steps: int) -> dict[str, np.ndarray]:
    """An epoch's looks (step -> {name: {r: value}}) as per-step metrics: name -> (R, steps), NaN where unseen."""
    out = {name: np.full((r_count, steps), np.nan, np.float32) for name in watcher.names}
    for i, values in looks.items():
        for name, by_replica in values.items():
            for r, v in by_replica.items():
                out[name][r, i] = np.asarray(v)  # a look's values arrive here, after the epoch's steps
    return out


def inject_fault(state: TrainState, replica: int) -> TrainState:
    """A simulated hardware fault: every weight of ``replica`` becomes NaN (tests divergence handling)."""
    return state._replace(params=jax.tree.map(lambda a: a.at[replica].set(jnp.nan), state.params))


def train_replicas(strategy: Strategy, keys: ReplicaKeys, perturb: Perturbations, data, epochs: int,
                   progress: Callable[[int], None] = lambda n: None, start: EpochState | None = None,
                   on_epoch: Callable[[EpochState], None] = lambda p: None,
                   fault: tuple[int, int] | None = None, eval_epochs: tuple[int, ...] = (),
                   watcher: Watcher | None = None) -> ArmResult:
    """Train the replicas whose keys are given (leading axis R) for ``epochs`` epochs.

    ``start`` continues from a checkpoint instead of initialising; ``on_epoch`` sees the
    :class:`EpochState` after every epoch (to checkpoint it); ``fault = (replica, epoch)`` makes that
    replica's weights NaN before that epoch; after each epoch count in ``eval_epochs`` the test logits
    are kept (snapshot ensembles); ``watcher`` looks at the replicas between steps (:class:`Watcher`);
    replicas whose test outputs are not finite are marked diverged
    (:func:`nondet_jax.analysis.health.flag_nonfinite_outputs`). The loop is epoch-major: all R states exist at every
    epoch end (for the divergence curves), whatever the strategy.
    """
    t0 = time.perf_counter()
    # device_put, not jnp.asarray: a host array moves without compiling a copy program per shape
    x_tr, y_tr, x_te = jax.device_put((data.x_train, data.y_train, data.x_test))
    r_count = jax.tree.leaves(keys)[0].shape[0]
    if start is None:
        state = strategy.init(keys, perturb, jax.device_put(np.asarray(data.x_train[:1])))
        start = EpochState(0, state, {}, _distances(state.params)[None])
    state, steps, distances = start.state, start.steps, [start.weight_distance]
    snapshots = [] if start.snapshots is None else list(np.moveaxis(np.asarray(start.snapshots), 1, 0))
    chex.assert_tree_shape_prefix(state, (r_count,))
    for e in range(start.epoch, epochs):
        if fault is not None and fault[1] == e:
            state = inject_fault(state, fault[0])
        if watcher is None:
            state, m = strategy.epoch(state, x_tr, y_tr, keys, perturb, np.int32(e), progress)
        else:
            looks = {}

            def watch(i, replica, looks=looks, e=e):
                values = watcher.look(e, i, replica)
                if values is not None:
                    looks[i] = values

            state, m = strategy.epoch(state, x_tr, y_tr, keys, perturb, np.int32(e), progress, watch=watch)
        m = jax.tree.map(np.asarray, m)
        if watcher is not None:
            m.update(watched_columns(watcher, looks, r_count, np.shape(m["loss"])[1]))
        steps = m if not steps else jax.tree.map(lambda a, b: np.concatenate([a, b], 1), steps, m)
        distances.append(_distances(state.params)[None])
        if e + 1 in eval_epochs:
            snapshots.append(np.asarray(strategy.evaluate(state, x_te)[0]))
        stacked = np.stack(snapshots, 1) if snapshots else None
        on_epoch(EpochState(e + 1, state, steps, np.concatenate(distances), stacked))
    logits, feats = strategy.evaluate(state, x_te)
    per_epoch = {k: np.asarray(steps[k]).reshape(r_count, epochs, -1).mean(-1) for k in ("loss", "accuracy")}
    return flag_nonfinite_outputs(ArmResult(state, per_epoch["loss"], per_epoch["accuracy"], np.asarray(logits), np.asarray(feats),
                     np.concatenate(distances), strategy.name, time.perf_counter() - t0, steps,
                     np.stack(snapshots, 1) if snapshots else np.zeros((r_count, 0) + np.shape(logits)[1:], np.float32)))
