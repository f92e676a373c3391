"""From a trained arm to numbers: per-arm diversity metrics with CIs, and comparisons between arms.

``arm_metrics`` runs once per arm, right after training (it needs the model for the LMC
barrier); ``compare_arms`` works on the stored records only, so the report can be rebuilt
without training.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from nondet_jax.analysis import metrics as M
from nondet_jax.analysis import stats as S
from nondet_jax.analysis.task import PAIRWISE, QUANTITIES, task_of
from nondet_jax.config import MetricsConfig
from nondet_jax.sources import split_variant
from nondet_jax.train import TrainFns, TrainState

CLASSIFICATION_PAIRS = [p for p in PAIRWISE["classification"] if p != "lmc_barrier"]


def lmc_pairs(replicas: int, count: int) -> list[tuple[int, int]]:
    """Disjoint pairs (0, 1), (2, 3), ... : independent barrier estimates, at most ``count``."""
    return [(2 * i, 2 * i + 1) for i in range(min(count, replicas // 2))]


@functools.lru_cache(maxsize=4)
def _predictions(evaluate, recompute_batch_stats):
    """One jitted program per model (not per arm): the arrays are arguments, not constants baked in."""
    @jax.jit
    def predictions(params, batch_stats, x_bn, x_test):
        bs = recompute_batch_stats(params, batch_stats, x_bn)
        logits, _ = evaluate(TrainState(params, bs, None), x_test)
        return logits.argmax(-1)

    return predictions


BN_SUBSET_SEED = 0  # one fixed subset for every arm and replica pair, so their barriers are read on the same images


def bn_examples(n: int, count: int):
    """Which of ``n`` training examples BatchNorm statistics are recomputed on: all of them when there are at most
    ``count`` (in their order, so the arithmetic is that of the whole set), else ``count`` drawn without
    replacement by a fixed seed and kept in the data's order. The first ``count`` would do only for shuffled data:
    a set stored class by class gave one class's statistics and an LMC curve whose ends missed their replicas' own
    errors."""
    if n <= count:
        return slice(None)
    return np.sort(np.random.default_rng(BN_SUBSET_SEED).choice(n, count, replace=False))


def interpolation_error_fn(fns: TrainFns, batch_stats, x_bn, x_test, y_test):
    """Jitted test error of weights, with BatchNorm statistics recomputed on ``x_bn`` first."""
    y_test = np.asarray(y_test)
    predictions = _predictions(fns.evaluate, fns.recompute_batch_stats)
    x_bn, x_test = jnp.asarray(x_bn), jnp.asarray(x_test)
    return lambda params: float((np.asarray(predictions(params, batch_stats, x_bn, x_test)) != y_test).mean())


def arm_metrics(result, data, fns: TrainFns, cfg: MetricsConfig) -> tuple[dict, dict[str, np.ndarray]]:
    """Metrics of one trained arm: a JSON-ready dict and the per-pair arrays to store.

    Accuracy and cross-entropy: mean and std (ddof=1) with their intervals (:func:`stats.spread`: the mean's,
    the std's robust one and its chi-square one for normal data). Pairwise
    metrics (when ``cfg.pairwise``): mean over the R(R-1)/2 pairs with a replica-jackknife CI
    (methods: ``stats.METHODS``).
    LMC: barrier on up to ``cfg.lmc_pairs`` disjoint pairs, BatchNorm recomputed at each point.
    """
    labels = np.asarray(data.y_test)
    if getattr(data, "task", "classification") == "regression":
        return regression_metrics(result, labels, cfg)
    acc, ce = M.accuracy(result.logits, labels), M.cross_entropy(result.logits, labels)
    r = len(acc)
    out = {"accuracy": S.spread(acc, resolution=1 / len(labels), value_range=S.ACCURACY_RANGE),
           "cross_entropy": S.spread(ce),
           "independent_errors_std": M.independent_errors_std(result.logits, labels)}
    arrays: dict[str, np.ndarray] = {"accuracy": acc, "cross_entropy": ce}
    if not cfg.pairwise or r < 2:
        return out, arrays
    gain = M.ensemble_gain(result.logits, labels)
    arrays.update({
        "disagreement": M.disagreement(result.logits),
        "pearson": M.pearson(result.logits),
        "spearman": M.spearman(result.logits),
        "ensemble_gain_accuracy": gain["accuracy"],
        "ensemble_gain_cross_entropy": gain["cross_entropy"],
        "cka": M.linear_cka(result.features),
        "weight_distance": result.weight_distance[-1],
    })
    minority = M.minority_predictions(result.logits)
    for name in CLASSIFICATION_PAIRS:
        out[name] = S.pairwise_summary(name, arrays[name], r, minority=minority, n_test=len(labels))
    pairs = lmc_pairs(r, cfg.lmc_pairs)
    if pairs:
        x_bn = np.asarray(data.x_train[bn_examples(len(data.x_train), cfg.bn_examples)])
        # on the host: slicing replicas and interpolating weights there compiles nothing (as device arrays, each
        # leaf shape's slice, add, subtract and multiply was a program of its own: 64 of a default study's 126)
        host = jax.device_get(result.state)
        bs0 = jax.tree.map(lambda x: x[0], host.batch_stats)
        error = interpolation_error_fn(fns, bs0, x_bn, np.asarray(data.x_test), labels)
        alphas = np.linspace(0.0, 1.0, cfg.lmc_points)
        take = lambda i: jax.tree.map(lambda x: x[i], host.params)  # noqa: E731
        curves = M.interpolation_curves(error, [(take(a), take(b)) for a, b in pairs], alphas, fns.replica_threads)
        barriers = np.array([M.barrier(c) for c in curves])
        arrays.update({"lmc_alphas": alphas, "lmc_curves": curves, "lmc_pairs": np.array(pairs),
                       "lmc_barrier": barriers})
        out["lmc_barrier"] = {"mean": float(barriers.mean()), "values": barriers.tolist(), "pairs": pairs}
    return out, arrays


def compare_arms(records: dict[str, dict], reference: str = "all", ratios=S.POWER_RATIOS,
                 quantities=None) -> dict[str, dict]:
    """Each arm's spread of the task's two per-replica scores (accuracy and cross-entropy, or test MSE
    and MAE) relative to the ``reference`` arm (:func:`nondet_jax.analysis.stats.compare_spread`), with
    the permutation spread test's p Holm-adjusted over the arms (``spread_p_holm``, per quantity).

    Arms of one study share seeds (replica r of every arm has the same keys for the sources it does not
    vary), so replicas with the same index in both arms are compared as pairs: ``paired_ratio_ci``
    (:func:`nondet_jax.analysis.stats.paired_ratio_ci`) and its p (``paired_p``: below 0.05 exactly when that 95%
    interval excludes 1). ``family_ci`` is the
    interval the findings read: the paired one (else the independent one) at level 1 − 0.05/m over the m arms
    compared (Bonferroni: the findings' family-wise error at most 5%). ``failed_replicas``: the replica
    indices of either arm that :func:`nondet_jax.analysis.stats.failed_replicas` names (runs that failed to
    train), and ``without_failed`` the ratio and its intervals with them left out.
    Empty when the reference arm is absent. ``quantities``: other scores than the task's (``replicate``'s)."""
    if reference not in records:
        return {}

    def healthy(rows):  # diverged replicas are left out of every metric
        return [row for row in rows if row.get("diverged_at_step", -1) < 0]

    quantities = quantities or QUANTITIES[task_of(records[reference])]
    ref = healthy(records[reference]["rows"])
    out = {}
    cells = []  # (arm, quantity, its rows, x, y, resolution)
    for arm, rec in records.items():
        rows = healthy(rec["rows"])
        if arm == reference or split_variant(arm)[1] or len(ref) < 2 or len(rows) < 2:
            continue  # a snapshot ensemble (arm@snapshotK) is a mitigation, compared with its own arm, not a source
        for q in quantities:
            res = (rec.get("metrics") or {}).get(q.name, {}).get("resolution")
            cells.append((arm, q, rows, np.array([row[q.row] for row in rows]), np.array([row[q.row] for row in ref]), res))
    # every permutation spread test at once (control's is not read: it varies nothing)
    tested = [i for i, (arm, _, _, x, y, _) in enumerate(cells)
              if records[arm].get("varied", True) and min(len(x), len(y)) >= S.SPREAD_TEST_MIN]
    spread_p = dict(zip(tested, S.spread_tests([cells[i][3:5] for i in tested])))
    for i, (arm, q, rows, x, y, res) in enumerate(cells):
        c = S.compare_spread(x, y, resolution=res, ratios=ratios, spread_p=spread_p.get(i, float("nan")))
        c.update(_paired_and_failed(rows, ref, q.row, res))
        if not records[arm].get("varied", True):  # control varies nothing: its spread is 0 by design, no test means anything
            c.update({"spread_p": None, "f_test_p": None, "brown_forsythe_p": None})
        out.setdefault(arm, {})[q.name] = c
    for q in quantities:
        arms = list(out)  # control's p is None: left out of the Holm family
        for arm, p in zip(arms, S.holm([out[a][q.name]["spread_p"] for a in arms])):
            out[arm][q.name]["spread_p_holm"] = p
        family = sum(1 for a in arms if records[a].get("varied", True))  # the arms the findings test
        for arm in arms:
            c = out[arm][q.name]
            level = 1 - (1 - S.LEVEL) / max(family, 1)
            pairs, (x, y, res) = c.pop("_pairs", None), c.pop("_arms")
            ci = S.paired_ratio_ci(*pairs, level) if pairs is not None else S.std_ratio_ci(x, y, level, resolution=res)
            c["family_ci"], c["family_level"] = list(ci), level
    return out


def _paired_and_failed(rows: list[dict], ref: list[dict], key: str, resolution) -> dict:
    """The paired ratio of replicas with the same index in both arms, and the failed replicas named."""
    # a row without its replica index (an older record, a hand-built one) is paired by position
    by_a = {row.get("replica", i): row[key] for i, row in enumerate(rows)}
    by_b = {row.get("replica", i): row[key] for i, row in enumerate(ref)}
    common = sorted(set(by_a) & set(by_b))
    x, y = np.array([by_a[r] for r in common]), np.array([by_b[r] for r in common])
    out: dict = {"_arms": (np.array(list(by_a.values())), np.array(list(by_b.values())), resolution)}
    # a tied arm (a count no replica moved) keeps the independent interval, which has its tie bound
    if len(common) >= S.MIN_REPLICAS["paired_ratio"] and np.ptp(x) > 0 and np.ptp(y) > 0:
        out.update(paired=True, pairs=len(common), paired_ratio_ci=list(S.paired_ratio_ci(x, y)),
                   paired_p=S.paired_ratio_p(x, y), pair_correlation=float(np.corrcoef(x, y)[0, 1]), _pairs=(x, y))
    failed = {"arm": [list(by_a)[i] for i in S.failed_replicas(list(by_a.values()), resolution=resolution)],
              "reference": [list(by_b)[i] for i in S.failed_replicas(list(by_b.values()), resolution=resolution)]}
    if failed["arm"] or failed["reference"]:
        xa = np.array([v for r, v in by_a.items() if r not in failed["arm"]])
        xb = np.array([v for r, v in by_b.items() if r not in failed["reference"]])
        keep = [r for r in common if r not in failed["arm"] and r not in failed["reference"]]
        out["failed_replicas"] = failed
        out["without_failed"] = {"ratio": S.std(xa) / S.std(xb) if S.std(xb) > 0 else None,
                                 "ratio_ci": list(S.std_ratio_ci(xa, xb, resolution=resolution)),
                                 "paired_ratio_ci": list(S.paired_ratio_ci(np.array([by_a[r] for r in keep]),
                                                                           np.array([by_b[r] for r in keep])))}
    return out


def regression_metrics(result, targets: np.ndarray, cfg: MetricsConfig) -> tuple[dict, dict[str, np.ndarray]]:
    """:func:`arm_metrics` of a regression: test MSE and MAE (mean, std with CIs), and over pairs the
    RMS distance between predictions, their Pearson/Spearman correlation, the 2-model ensemble's MSE
    gain, CKA of the features and the weight distance. No LMC barrier (it is defined on test error)."""
    mse, mae = M.regression_errors(result.logits, targets)
    out = {"mse": S.spread(mse), "mae": S.spread(mae)}
    arrays: dict[str, np.ndarray] = {"mse": mse, "mae": mae}
    r = len(mse)
    if not cfg.pairwise or r < 2:
        return out, arrays
    arrays.update({"prediction_distance": M.prediction_distance(result.logits), "pearson": M.pearson(result.logits),
                   "spearman": M.spearman(result.logits), "ensemble_gain_mse": M.ensemble_gain_mse(result.logits, targets),
                   "cka": M.linear_cka(result.features), "weight_distance": result.weight_distance[-1]})
    for name in PAIRWISE["regression"]:
        out[name] = S.pairwise_summary(name, arrays[name], r)
    return out, arrays
