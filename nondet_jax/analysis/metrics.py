"""Diversity metrics over the R replicas of an arm (definitions: docs/metrics.md), on any numpy or JAX arrays.

Shapes: ``logits`` (R, n, classes), ``labels`` (n,), ``features`` (R, n, d), flat ``weights``
(R, P). Pairwise metrics return one value per unordered pair (a < b), in the order of
:func:`pair_indices`; they are vectorised over pairs (in chunks where memory would grow as
R^2 n), never a Python loop over pairs.

Example::

    import numpy as np
    from nondet_jax import metrics
    logits = np.random.default_rng(0).normal(size=(5, 100, 10))
    labels = np.arange(100) % 10
    metrics.disagreement(logits).mean()              # mean pairwise disagreement
    metrics.ensemble_gain(logits, labels)["accuracy"].mean()
"""

from __future__ import annotations

from typing import Callable

import jax
import numpy as np
from scipy.stats import rankdata

from nondet_jax.errors import UsageError
from nondet_jax.machine.threads import in_threads

PAIR_CHUNK = 64  # pairs per vectorised block
CHUNK_ELEMENTS = 1 << 24  # and at most this many float64 elements per block (128 MiB)

# The possible range of each pairwise metric: their intervals are clipped to it (stats.pairwise_mean_ci).
# Ensemble gains are differences of accuracies or losses and can have either sign.
PAIRWISE_RANGE = {"disagreement": (0.0, 1.0), "pearson": (-1.0, 1.0), "spearman": (-1.0, 1.0), "cka": (0.0, 1.0),
                  "weight_distance": (0.0, np.inf), "prediction_distance": (0.0, np.inf)}
# the scale of each metric's jackknife interval (stats.pairwise_mean_ci): log of the distance to the bound
# that near-identical replicas approach; the ensemble gains, signed, stay linear
PAIRWISE_SCALE = {"disagreement": "log", "weight_distance": "log", "prediction_distance": "log",
                  "cka": "log-upper", "pearson": "log-upper", "spearman": "log-upper"}


def pair_indices(r: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices (a, b) of the R(R-1)/2 unordered pairs a < b, row-major."""
    if r < 2:
        raise ValueError(f"pairwise metrics need at least 2 replicas, got {r}")
    return np.triu_indices(r, k=1)


def _chunks(r: int, elements_per_pair: int = 1):
    a, b = pair_indices(r)
    size = max(1, min(PAIR_CHUNK, CHUNK_ELEMENTS // max(1, elements_per_pair)))
    for s in range(0, len(a), size):
        yield a[s:s + size], b[s:s + size]


def log_softmax(logits) -> np.ndarray:
    z = np.asarray(logits, dtype=np.float64)
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def check_labels(logits, labels) -> tuple[np.ndarray, np.ndarray]:
    """``(logits, labels)`` as arrays, UsageError unless logits are (R, n, classes) or (n, classes)
    and labels n integer classes below ``classes``."""
    logits, labels = np.asarray(logits), np.asarray(labels)
    if logits.ndim not in (2, 3) or labels.ndim != 1 or logits.shape[-2] != len(labels):
        raise UsageError(f"logits of shape {logits.shape} do not match labels of shape {labels.shape}; pass logits "
                         "as (replicas, examples, classes) and one integer label per example")
    if labels.dtype.kind not in "iu":
        raise UsageError(f"labels must be integers in [0, {logits.shape[-1]}) for {logits.shape[-1]} classes of "
                         f"logits, got dtype {labels.dtype}; pass class indices")
    if len(labels) and not 0 <= labels.min() <= labels.max() < logits.shape[-1]:
        raise UsageError(f"labels range over {labels.min()} .. {labels.max()}, but must lie in [0, {logits.shape[-1]}) "
                         f"for {logits.shape[-1]} classes of logits; pass class indices")
    return logits, labels


def accuracy(logits, labels) -> np.ndarray:
    """Per-replica accuracy, shape (R,) (or a scalar for one (n, classes) array)."""
    logits, labels = check_labels(logits, labels)
    return (logits.argmax(-1) == labels).mean(-1)


def cross_entropy(logits, labels) -> np.ndarray:
    """Per-replica mean cross-entropy (float64), shape (R,)."""
    logits, labels = check_labels(logits, labels)
    lp = log_softmax(logits)
    lab = np.broadcast_to(np.asarray(labels), lp.shape[:-1])
    return -np.take_along_axis(lp, lab[..., None], -1)[..., 0].mean(-1)


def _per_replica(x, what: str, axes: str) -> np.ndarray:
    """``x`` as an array of ``axes`` (three), or a one-line error naming the shape it has."""
    x = np.asarray(x)
    if x.ndim != 3:
        raise UsageError(f"{what} of shape {x.shape} are not {axes}; stack one array per replica on a first axis")
    return x


def disagreement(logits) -> np.ndarray:
    """Fraction of examples whose predicted class differs, per pair: shape (P,)."""
    logits = _per_replica(logits, "logits", "(replicas, examples, classes)")
    pred = logits.argmax(-1)
    onehot = np.eye(logits.shape[-1], dtype=np.float32)[pred]  # (R, n, C)
    agree = np.einsum("anc,bnc->ab", onehot, onehot) / pred.shape[1]
    a, b = pair_indices(len(pred))
    return 1.0 - agree[a, b]


def minority_predictions(logits) -> int:
    """Predictions that differ from their example's most common predicted class, summed over the test
    examples: Σ_j (R − max_c n_jc) for (R, n, C) logits. 0 when every replica predicts alike; the count
    whose Poisson interval bounds the disagreement of near-identical replicas
    (:func:`nondet_jax.analysis.stats.rare_disagreement_ci`)."""
    logits = np.asarray(logits)
    pred = logits.argmax(-1)
    counts = np.eye(logits.shape[-1], dtype=np.int64)[pred].sum(0)  # (n, C): replicas predicting each class
    return int((len(pred) - counts.max(-1)).sum())


def _pairwise_pearson(x: np.ndarray) -> np.ndarray:
    x = x.reshape(len(x), -1).astype(np.float64)
    z = x - x.mean(1, keepdims=True)
    z /= np.linalg.norm(z, axis=1, keepdims=True)
    c = z @ z.T
    a, b = pair_indices(len(x))
    return c[a, b]


def pearson(logits) -> np.ndarray:
    """Pearson correlation of two replicas' flattened logits, per pair: (P,)."""
    return _pairwise_pearson(np.asarray(logits))


def spearman(logits) -> np.ndarray:
    """Spearman rank correlation of flattened logits (ties get average ranks), per pair: (P,)."""
    x = np.asarray(logits).reshape(len(logits), -1).astype(np.float64)  # scipy ranks no bfloat16
    return _pairwise_pearson(rankdata(x, axis=1))


def ensemble_gain(logits, labels) -> dict[str, np.ndarray]:
    """What a 2-model ensemble (average of the two logits) gains over its members' mean, per pair:
    positive when it helps.

    Returns ``{"accuracy": (P,), "cross_entropy": (P,)}``: the ensemble's accuracy minus the members'
    mean accuracy, and the members' mean cross-entropy minus the ensemble's.
    """
    logits = np.asarray(logits)
    labels = np.asarray(labels)
    acc, ce = accuracy(logits, labels), cross_entropy(logits, labels)
    gains_acc, gains_ce = [], []
    for a, b in _chunks(len(logits), logits[0].size):
        ens = 0.5 * (logits[a].astype(np.float64) + logits[b].astype(np.float64))
        gains_acc.append(accuracy(ens, labels) - 0.5 * (acc[a] + acc[b]))
        gains_ce.append(0.5 * (ce[a] + ce[b]) - cross_entropy(ens, labels))
    return {"accuracy": np.concatenate(gains_acc), "cross_entropy": np.concatenate(gains_ce)}


def regression_errors(predictions, targets) -> tuple[np.ndarray, np.ndarray]:
    """Per-replica test MSE and MAE of ``predictions`` (R, N, ...) against ``targets`` (N, ...):
    ((R,), (R,)), averaged over examples and outputs."""
    p = np.asarray(predictions, np.float64)
    y = np.asarray(targets, np.float64)
    if p.ndim < 2 or p.shape[1] != len(y) or p[0].size != y.size:
        raise UsageError(f"predictions of shape {p.shape} do not match targets of shape {y.shape}; pass predictions "
                         "as (replicas, examples, outputs) and targets as (examples,) or (examples, outputs)")
    err = p.reshape(len(p), -1) - y.reshape(1, -1)
    return np.mean(err ** 2, axis=1), np.mean(np.abs(err), axis=1)


def prediction_distance(predictions) -> np.ndarray:
    """Root-mean-square difference of two replicas' predictions, per pair: (P,)."""
    p = np.asarray(predictions, np.float64).reshape(len(predictions), -1)
    a, b = pair_indices(len(p))
    return np.sqrt(np.mean((p[a] - p[b]) ** 2, axis=1))


def ensemble_gain_mse(predictions, targets) -> np.ndarray:
    """What averaging a pair's predictions gains: its members' mean MSE minus the MSE of the averaged
    predictions, per pair (positive when the ensemble is better): (P,)."""
    p = np.asarray(predictions, np.float64).reshape(len(predictions), -1)
    y = np.asarray(targets, np.float64).reshape(1, -1)
    mse = np.mean((p - y) ** 2, axis=1)
    a, b = pair_indices(len(p))
    return 0.5 * (mse[a] + mse[b]) - np.mean((0.5 * (p[a] + p[b]) - y) ** 2, axis=1)


def linear_cka(features) -> np.ndarray:
    """Linear CKA (Kornblith et al. 2019) of two replicas' features, per pair: (P,).

    ``CKA(X, Y) = ||Y^T X||_F^2 / (||X^T X||_F ||Y^T Y||_F)`` on column-centred X, Y (n, d).
    """
    f = _per_replica(features, "features", "(replicas, examples, dimensions)").astype(np.float64)
    f = f - f.mean(1, keepdims=True)
    self_norm = np.linalg.norm(np.einsum("rnd,rne->rde", f, f), axis=(1, 2))
    out = []
    for a, b in _chunks(len(f), f[0].size):
        cross = np.einsum("pnd,pne->pde", f[a], f[b])
        out.append((cross ** 2).sum((1, 2)) / (self_norm[a] * self_norm[b]))
    return np.concatenate(out)


def flatten_weights(tree) -> np.ndarray:
    """(R, P) float64 matrix from a pytree (or dict) of arrays with leading replica axis R."""
    leaves = [np.asarray(x) for x in jax.tree.leaves(tree)]
    r = leaves[0].shape[0]
    return np.concatenate([x.reshape(r, -1).astype(np.float64) for x in leaves], axis=1)


def weight_distance(weights) -> np.ndarray:
    """``||θa − θb|| / ||θa||`` per pair (a < b), from (R, P) flat weights: shape (P,).

    Differences are taken directly (not from a Gram matrix), so the one-ulp distances of
    ``bitflip`` early in training are not lost to cancellation.
    """
    w = np.asarray(weights, dtype=np.float64)
    norms = np.linalg.norm(w, axis=1)
    out = []
    for a, b in _chunks(len(w), w.shape[1]):
        out.append(np.linalg.norm(w[a] - w[b], axis=1) / norms[a])
    return np.concatenate(out)


def independent_errors_std(logits, labels) -> float:
    """The accuracy std that test-set sampling alone explains (Jordan 2023).

    ``sqrt(sum_i p_i (1 - p_i) * R / (R - 1)) / n`` with p_i example i's error rate over the R
    replicas. Estimated from R replicas, p_i(1 − p_i) is low by the factor (R − 1)/R on average
    (the sample variance of a Bernoulli with ddof=0); R/(R − 1) makes the variance unbiased
    (tests/test_metrics.py simulates it). NaN below 2 replicas.
    """
    wrong = np.asarray(logits).argmax(-1) != np.asarray(labels)  # (R, n)
    r = wrong.shape[0]
    if r < 2:
        return float("nan")
    p = wrong.mean(0)
    return float(np.sqrt((p * (1 - p)).sum() * r / (r - 1)) / wrong.shape[1])


def interpolation_curve(error_fn: Callable, theta_a, theta_b, alphas, threads: int = 1) -> np.ndarray:
    """``error_fn(θb + α (θa − θb))`` for each α (α = 1 is θa, α = 0 is θb).

    ``error_fn`` maps one pytree of weights to a scalar error; the study's version recomputes
    BatchNorm statistics on training data at each point (:func:`nondet_jax.analysis.arm.interpolation_error_fn`).
    Identical endpoints give exactly the endpoint at every α (computed once: every point is θb + α·0, the same
    weights). ``threads`` > 1: the first point alone (it compiles ``error_fn``'s programs), then the others from
    that many threads at once (the same values).
    """
    return interpolation_curves(error_fn, [(theta_a, theta_b)], alphas, threads)[0]


def interpolation_curves(error_fn: Callable, pairs, alphas, threads: int = 1) -> np.ndarray:
    """:func:`interpolation_curve` of each ``(θa, θb)`` in ``pairs``, one row each; with ``threads`` > 1 the
    points of every pair share one pool (only the very first point runs alone)."""
    alphas = list(np.asarray(alphas, dtype=np.float32))

    def point(job):
        (theta_a, theta_b), alpha = pairs[job[0]], alphas[job[1]]
        return float(error_fn(jax.tree.map(lambda a, b: b + alpha * (a - b), theta_a, theta_b)))

    identical = [all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(ta), jax.tree.leaves(tb))) for ta, tb in pairs]
    jobs = [(k, i) for k, same in enumerate(identical) for i in range(1 if same else len(alphas))]
    values = in_threads(point, jobs, threads, name="lmc")
    out = np.empty((len(pairs), len(alphas)))
    for (k, i), v in zip(jobs, values):
        out[k, slice(None) if identical[k] else i] = v
    return out


def barrier(curve: np.ndarray) -> float:
    """Linear-mode-connectivity barrier (Frankle et al. 2020) of an error curve whose first and last
    points are the endpoints: ``max_α err(α) − mean(err(0), err(1))``."""
    curve = np.asarray(curve)
    return float(curve.max() - 0.5 * (curve[0] + curve[-1]))
