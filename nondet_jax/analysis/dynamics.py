"""Divergence dynamics: how fast two replicas that differ in one source drift apart.

Replicas 0 and 1 of an arm train side by side in one program (vmapped over the pair, one
``lax.scan`` per epoch); every ``every`` steps the program records their relative weight
distance ``||θ0 − θ1|| / ||θ0||`` and the disagreement of their predictions on a fixed probe set
of test images. :func:`fit_growth_rate` fits the early exponential growth of the distance (a
Lyapunov-like exponent, per step) with its standard error.

Example::

    trace = divergence_trace(fns, arm_keys(0, arm_sources("bitflip"), 2), perturbations(...), data,
                             epochs=4, every=2)
    fit_growth_rate(trace["step"], trace["weight_distance"])   # {"rate_per_step": ..., "stderr": ...}
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from nondet_jax.data.pipeline import epoch_indices
from nondet_jax.machine.quick import once
from nondet_jax.sources import Perturbations, ReplicaKeys
from nondet_jax.train import TrainFns, TrainState


def _pair_distance(params) -> jax.Array:
    a = jnp.concatenate([x[0].ravel() for x in jax.tree.leaves(params)])
    b = jnp.concatenate([x[1].ravel() for x in jax.tree.leaves(params)])
    return jnp.linalg.norm(a - b) / jnp.linalg.norm(a)  # direct difference: no cancellation


def divergence_trace(fns: TrainFns, keys: ReplicaKeys, perturb: Perturbations, data, epochs: int, every: int,
                     probe: int = 256) -> dict[str, np.ndarray]:
    """Train the pair ``keys`` (leading axis 2) and record distance and disagreement every ``every`` steps.

    Returns ``step`` (global step after which each value was taken; 0 = initial weights),
    ``weight_distance`` and ``disagreement`` arrays.
    """
    n, b = len(data.x_train), fns.batch_size
    x_tr, y_tr = jnp.asarray(data.x_train), jnp.asarray(data.y_train)
    x_probe = jnp.asarray(data.x_test[:probe])
    steps = fns.steps_per_epoch
    step_pair = jax.vmap(fns.train_step, in_axes=(0, None, None, 0, None, None, None, 0))

    def disagreement(state: TrainState):
        logits, _ = jax.vmap(fns.evaluate, in_axes=(0, None))(state, x_probe)
        pred = logits.argmax(-1)
        return jnp.mean(pred[0] != pred[1])

    @jax.jit
    def epoch_trace(state, keys, perturb, epoch):
        idx = jax.vmap(epoch_indices, in_axes=(0, None, None, None))(keys.data_order, epoch, n, b)

        def body(state, inputs):
            i, batch_idx = inputs
            state, _ = step_pair(state, x_tr, y_tr, keys, perturb, epoch, i, batch_idx)
            due = (epoch * steps + i + 1) % every == 0
            values = jax.lax.cond(due, lambda s: (_pair_distance(s.params), disagreement(s)),
                                  lambda s: (jnp.float32(jnp.nan), jnp.float32(jnp.nan)), state)
            return state, values

        return jax.lax.scan(body, state, (jnp.arange(steps), jnp.swapaxes(idx, 0, 1)), unroll=fns.unroll)

    state = once(jax.vmap(fns.init, in_axes=(0, None, None)))(keys, perturb, x_tr[:1])
    dist = [float(_pair_distance(state.params))]
    dis = [float(disagreement(state))]
    for e in range(epochs):
        state, (d, g) = epoch_trace(state, keys, perturb, jnp.int32(e))
        dist.extend(np.asarray(d).tolist())
        dis.extend(np.asarray(g).tolist())
    step = np.arange(len(dist))
    keep = (step % every == 0)
    return {"step": step[keep], "weight_distance": np.asarray(dist)[keep], "disagreement": np.asarray(dis)[keep]}


def fit_growth_rate(step, distance, saturation: float = 0.5) -> dict:
    """Fit ``log d = log d0 + λ t`` over the early growth phase; λ per step with its standard error.

    The window runs from the first positive distance to the first point that reaches
    ``saturation`` × the largest distance (after that, growth slows and log-linearity fails).
    Returns rate_per_step, stderr, window (first and last step used) and points; NaN rate when
    fewer than 3 points qualify.
    """
    t, d = np.asarray(step, np.float64), np.asarray(distance, np.float64)
    ok = np.isfinite(d) & (d > 0)
    t, d = t[ok], d[ok]
    nan = {"rate_per_step": float("nan"), "stderr": float("nan"), "window": [None, None], "points": int(len(t))}
    if len(t) < 3:
        return nan
    stop = int(np.argmax(d >= saturation * d.max()))
    t, y = t[: stop + 1], np.log(d[: stop + 1])
    if len(t) < 3:  # already saturated from the start (e.g. different initial weights): no growth phase
        return {**nan, "points": int(len(t))}
    slope, intercept = np.polyfit(t, y, 1)
    resid = y - (slope * t + intercept)
    se = float(np.sqrt(resid @ resid / (len(t) - 2) / ((t - t.mean()) ** 2).sum()))
    return {"rate_per_step": float(slope), "stderr": se, "window": [float(t[0]), float(t[-1])], "points": int(len(t))}
