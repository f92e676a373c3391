"""Watching two replicas while they train: the divergence dynamics of an arm.

The arm's own replicas 0 and 1 are watched while they train (:func:`pair_watcher`, a
:class:`~nondet_jax.replicas.loop.Watcher` of the loop every strategy shares; nothing is trained again):
before every ``every``-th step, their relative weight distance ``||θ0 − θ1|| / ||θ0||`` and the disagreement
of their predictions on a fixed probe set of test images, kept in replica 1's row of the per-step metrics
``pair_distance`` and ``pair_disagreement`` (so checkpoints, blocks and resumes carry them like the loss).
:func:`pair_trace` reads them back, with the look at the final weights;
:func:`nondet_jax.analysis.dynamics.fit_growth_rate` fits the growth. Watching needs the epoch driven step by
step (``train.epoch_shape`` step, the default on CPU) under the ``sequential`` or ``vmap`` strategy.

Example::

    watcher = pair_watcher(fns, data.x_test, every=2)
    result = run_replicas(fns, arm_keys(0, arm_sources("bitflip"), 2), perturbations(...), data, 4, "sequential",
                          watcher=watcher)
    trace = pair_trace(fns, result, data.x_test, every=2)
    fit_growth_rate(trace["step"], trace["weight_distance"])   # {"rate_per_step": ..., "stderr": ...}
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from nondet_jax.replicas.loop import ArmResult, Watcher, _take
from nondet_jax.train import TrainFns

NAMES = ("pair_distance", "pair_disagreement")  # the per-step metrics a watched arm carries
PROBE = 256  # test images whose predictions the pair is compared on


@jax.jit
def _distance(a, b) -> jax.Array:
    """``analysis.metrics.weight_distance`` of one pair, on the device: a look copies no weights to the host."""
    fa = jnp.concatenate([x.ravel() for x in jax.tree.leaves(a)])
    fb = jnp.concatenate([x.ravel() for x in jax.tree.leaves(b)])
    return jnp.linalg.norm(fa - fb) / jnp.linalg.norm(fa)  # direct difference: no cancellation


@functools.partial(jax.jit, static_argnums=0)
def _disagreement(evaluate, s0, s1, x) -> jax.Array:
    return jnp.mean(evaluate(s0, x)[0].argmax(-1) != evaluate(s1, x)[0].argmax(-1))


def _measure(fns: TrainFns, x, replica, firsts) -> dict[str, dict[int, jax.Array]]:
    """Each watched pair (f, f + 1): its distance and disagreement, under replica f + 1. Dispatched, not waited
    for: the loop reads the values at the epoch's end, so training never stops for a look."""
    out = {name: {} for name in NAMES}
    for f in firsts:
        s0, s1 = replica(f), replica(f + 1)
        out["pair_distance"][f + 1] = _distance(s0.params, s1.params)
        out["pair_disagreement"][f + 1] = _disagreement(fns.evaluate, s0, s1, x)
    return out


def pair_watcher(fns: TrainFns, x_test, every: int, firsts: tuple[int, ...] = (0,)) -> Watcher:
    """Watch the pairs (f, f + 1) for f in ``firsts`` (indices in the trained block; () measures nothing, so a
    block without the pair carries the same metrics, all NaN) before every ``every``-th step of the run."""
    x = jax.device_put(np.asarray(x_test[:PROBE]))

    def look(epoch, i, replica):
        if (int(epoch) * fns.steps_per_epoch + i) % every:
            return None
        return _measure(fns, x, replica, firsts)

    return Watcher(NAMES, look)


def pair_trace(fns: TrainFns, result: ArmResult, x_test, every: int, first: int = 0) -> dict[str, np.ndarray] | None:
    """The watched pair (``first``, ``first`` + 1) of ``result``: ``step`` (steps taken when each value was
    measured; 0 = initial weights, the last from the final weights), ``weight_distance`` and ``disagreement``.
    None when the pair was not watched (its replicas trained in different processes)."""
    dist = np.asarray(result.steps["pair_distance"], np.float64)[first + 1]
    dis = np.asarray(result.steps["pair_disagreement"], np.float64)[first + 1]
    if not np.isfinite(dist).any():
        return None
    total = len(dist)
    if total % every == 0:
        last = _measure(fns, jax.device_put(np.asarray(x_test[:PROBE])), lambda r: _take(result.state, r), (first,))
        dist, dis = np.append(dist, last["pair_distance"][first + 1]), np.append(dis, last["pair_disagreement"][first + 1])
    step = np.arange(len(dist))
    keep = step % every == 0
    return {"step": step[keep], "weight_distance": dist[keep], "disagreement": dis[keep]}
