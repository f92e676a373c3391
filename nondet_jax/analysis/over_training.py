"""Test scores over training (``study.eval_every``): each replica's test curve, its best epoch and best
score, and their spreads over replicas with intervals (:func:`nondet_jax.analysis.stats.spread`).

The best epoch is what early stopping on the test curve would pick (the first epoch with the best
score); its spread over seeds says how much the stopping point itself is luck.
"""

from __future__ import annotations

import numpy as np

from nondet_jax.analysis import stats as S
from nondet_jax.analysis.metrics import accuracy, cross_entropy, regression_errors


def evaluated_epochs(epochs: int, every: int) -> tuple[int, ...]:
    """Epoch counts after which the test set is evaluated: every ``every`` epochs and after the last
    (none when ``every`` is 0)."""
    if every <= 0:
        return ()
    return tuple(sorted(set(range(every, epochs + 1, every)) | {epochs}))


def test_curves(snapshots, labels, task: str = "classification") -> dict[str, np.ndarray]:
    """Per replica and evaluated epoch, (R, K): test accuracy and loss (classification) or MSE and MAE,
    from the test outputs ``snapshots`` (R, K, n_test, ...)."""
    snaps = np.asarray(snapshots)
    k = snaps.shape[1]
    if task == "regression":
        cols = [regression_errors(snaps[:, j], labels) for j in range(k)]
        return {"test_mse": np.stack([c[0] for c in cols], 1), "test_mae": np.stack([c[1] for c in cols], 1)}
    return {"test_accuracy": np.stack([accuracy(snaps[:, j], labels) for j in range(k)], 1),
            "test_loss": np.stack([cross_entropy(snaps[:, j], labels) for j in range(k)], 1)}


def best_epochs(curves: dict[str, np.ndarray], epochs: tuple[int, ...], every: int, n_test: int) -> dict:
    """Each replica's best test score and the (first) epoch it is reached at, with their spreads
    (mean, std and intervals over replicas). The score is accuracy (higher is better) or MSE (lower)."""
    name = "test_accuracy" if "test_accuracy" in curves else "test_mse"
    c = np.asarray(curves[name], np.float64)
    pick = np.argmax(c, 1) if name == "test_accuracy" else np.argmin(c, 1)
    best = c[np.arange(len(c)), pick]
    at = np.asarray(epochs)[pick]
    score = S.spread(best, resolution=1 / n_test if name == "test_accuracy" else None,
                     value_range=(0.0, 1.0) if name == "test_accuracy" else None)
    return {"metric": name, "epochs": list(epochs), "best": {**score, "values": best.tolist()},
            "best_epoch": {**S.spread(at, resolution=every, value_range=(float(epochs[0]), float(epochs[-1]))),
                           "values": at.tolist()}}
