"""Diverged replicas as results: which replicas diverged, when, and the arm restricted to the rest.

A replica diverges when a training loss stops being finite (:func:`nondet_jax.train.guard`
freezes it there) or when its trained model's test logits or penultimate features are not
finite although every loss was (BatchNorm running statistics that overflowed, say): the second
kind is flagged here, after evaluation, at the step training ended. Metrics are computed over the
healthy replicas only; an arm with none left is stored and reported with "n/a".
"""

from __future__ import annotations

import jax
import numpy as np

from nondet_jax.analysis.metrics import pair_indices


def _replace_diverged_at(result, diverged_at: np.ndarray):
    state = result.state
    health = state.health._replace(diverged_at=np.asarray(diverged_at, np.int32))
    return result._replace(state=state._replace(health=health))


def flag_nonfinite_outputs(result):
    """``result`` with every replica whose test logits or features hold a non-finite value marked
    diverged at the last training step (replicas already diverged keep their step).

    Args:
      result: a :class:`nondet_jax.replicas.loop.ArmResult`.
    Returns:
      the same result, ``state.health.diverged_at`` updated (unchanged object when nothing is new).
    """
    r = len(result.logits)
    bad = ~np.isfinite(np.asarray(result.logits).reshape(r, -1)).all(1)
    if np.size(result.features):
        bad |= ~np.isfinite(np.asarray(result.features).reshape(r, -1)).all(1)
    diverged_at = np.array(result.diverged_at, np.int32)
    fresh = bad & (diverged_at < 0)
    if not fresh.any():
        return result
    loss = result.steps.get("loss") if isinstance(result.steps, dict) else None
    last_step = max(int(np.shape(loss)[1]) - 1, 0) if loss is not None and np.ndim(loss) >= 2 else 0
    diverged_at[fresh] = last_step
    return _replace_diverged_at(result, diverged_at)


def healthy_indices(diverged_at) -> np.ndarray:
    """Indices of the replicas that did not diverge (``diverged_at < 0``)."""
    return np.flatnonzero(np.asarray(diverged_at) < 0)


def healthy_subset(result):
    """The result restricted to the replicas that did not diverge, pairwise weight distances
    re-indexed to the remaining pairs (none when fewer than 2 remain; the arm may be empty)."""
    keep = healthy_indices(result.diverged_at)
    r = len(result.diverged_at)
    if len(keep) == r:
        return result
    if r >= 2:
        ia, ib = pair_indices(r)
        pairs = np.asarray([np.flatnonzero((ia == a) & (ib == b))[0] for i, a in enumerate(keep)
                            for b in keep[i + 1:]], dtype=np.int64)
    else:
        pairs = np.zeros(0, np.int64)
    wd = np.asarray(result.weight_distance)
    wd = wd[:, pairs] if wd.ndim == 2 and wd.shape[1] else np.zeros((wd.shape[0] if wd.ndim else 0, 0), wd.dtype)
    take = lambda x: np.asarray(x)[keep]  # noqa: E731
    return result._replace(state=jax.tree.map(take, result.state), train_loss=take(result.train_loss),
                           train_accuracy=take(result.train_accuracy), logits=take(result.logits),
                           features=take(result.features), weight_distance=wd,
                           steps=jax.tree.map(take, result.steps), snapshots=take(result.snapshots))


def divergence_records(result) -> list[dict]:
    """One JSON-ready entry per diverged replica: its index, the step, the last finite training loss,
    and why (``loss`` not finite during training, or ``outputs`` not finite after it)."""
    out = []
    train_loss = np.asarray(result.train_loss)
    for r in np.flatnonzero(np.asarray(result.diverged_at) >= 0):
        out.append({"replica": int(r), "step": int(result.diverged_at[r]),
                    "last_finite_loss": float(np.asarray(result.state.health.last_loss)[r]),
                    "cause": "loss" if not np.isfinite(train_loss[r]).all() else "outputs"})
    return out


def bitwise_identical(logits: np.ndarray, diverged_at) -> bool:
    """Whether the healthy replicas' logits are bitwise equal (diverged ones say nothing about the
    backend's determinism: a fault injected into one replica is not nondeterminism)."""
    kept = np.asarray(logits)[healthy_indices(diverged_at)]
    return bool(all(np.array_equal(kept[0], lg, equal_nan=True) for lg in kept[1:])) if len(kept) else True
