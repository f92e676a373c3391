"""Do ensembling tricks reduce run-to-run variability? (Summers & Dinneen 2021, section 6.)

For each arm, the replicas' test logits come in *variants*, each (R, N, C):

* ``single``: the trained model as it is;
* ``tta``: the same model with test-time augmentation (:func:`nondet_jax.analysis.tta.tta_logits`);
* ``snapshot``: each replica's snapshot ensemble, the mean of its K cycle-end logits under the
  ``snapshot`` schedule (:func:`snapshot_ensemble`).

Per variant: accuracy and cross-entropy mean and std with their intervals (:func:`stats.spread`: the mean's
t interval widened for skew, the std's robust one), the std ratio to ``single`` (:func:`stats.compare_spread`:
its robust interval and the permutation spread test's p), and over replica pairs the mean disagreement and logit
correlation with replica-jackknife CIs (``stats.METHODS``). Everything reuses :mod:`nondet_jax.analysis.metrics`
and :mod:`nondet_jax.analysis.stats`.

Example::

    per_arm = {"all": {"single": single, "tta": tta, "snapshot": snapshot_ensemble(snaps)}}
    results = {arm: mitigation_metrics(v, y_test) for arm, v in per_arm.items()}
    print(mitigation_table(results))
"""

from __future__ import annotations

import math

import numpy as np

from nondet_jax.analysis import metrics as M
from nondet_jax.analysis import stats as S
from nondet_jax.errors import UsageError


def snapshot_epochs(epochs: int, cycles: int) -> tuple[int, ...]:
    """Epoch counts after which the snapshot schedule's cycles end (snapshot c is taken there).

    ``snapshot_epochs(12, 3) == (4, 8, 12)``; raises UsageError unless ``cycles`` divides ``epochs``.
    """
    if cycles < 1 or epochs % cycles:
        raise UsageError(f"the snapshot schedule needs train.epochs divisible by optim.cycles, got {epochs} epochs "
                         f"and {cycles} cycles; fix --epochs or optim.cycles")
    return tuple(epochs // cycles * c for c in range(1, cycles + 1))


def snapshot_ensemble(snapshot_logits) -> np.ndarray:
    """Each replica's snapshot ensemble: (R, K, N, C) cycle-end logits -> (R, N, C) mean over K.

    Averaged in float64 and returned as float32 (identical snapshots give the snapshot exactly).
    """
    x = np.asarray(snapshot_logits)
    if x.ndim != 4:
        raise UsageError(f"snapshot logits must be (replicas, snapshots, examples, classes), got shape {x.shape}; "
                         "stack each replica's cycle-end logits on axis 1")
    return x.mean(axis=1, dtype=np.float64).astype(np.float32)


def variant_metrics(logits, labels) -> dict:
    """Metrics of one variant's (R, N, C) logits against (N,) labels (std with ddof=1).

    Returns ``accuracy`` and ``cross_entropy`` (mean, mean_ci, std, std_ci), ``replicas``,
    ``independent_errors_std`` and, with R >= 2, ``disagreement`` and ``pearson`` (mean over
    pairs, replica-jackknife ``ci``; NaN CI below 3 replicas). Interval methods: ``stats.METHODS``.
    """
    logits, labels = np.asarray(logits), np.asarray(labels)
    acc, ce = M.accuracy(logits, labels), M.cross_entropy(logits, labels)
    r = len(acc)
    out = {"replicas": r, "accuracy": S.spread(acc, resolution=1 / len(labels), value_range=S.ACCURACY_RANGE),
           "cross_entropy": S.spread(ce), "independent_errors_std": M.independent_errors_std(logits, labels)}
    if r >= 2:
        out["disagreement"] = S.pairwise_summary("disagreement", M.disagreement(logits), r,
                                                 minority=M.minority_predictions(logits), n_test=len(labels))
        out["pearson"] = S.pairwise_summary("pearson", M.pearson(logits), r)
    return out


def _check(variants: dict, labels) -> None:
    if not variants:
        raise UsageError("no variants given; pass e.g. {'single': logits, 'tta': tta_logits}")
    shapes = {k: np.shape(v) for k, v in variants.items()}
    first = next(iter(shapes.values()))
    if len(first) != 3 or any(s != first for s in shapes.values()):
        raise UsageError(f"every variant's logits must share one (replicas, examples, classes) shape, got {shapes}; "
                         "evaluate every variant on the same test set and replicas")
    if np.shape(labels) != (first[1],):
        raise UsageError(f"labels must be ({first[1]},) for {first[1]} test examples, got shape {np.shape(labels)}")


def mitigation_metrics(variants: dict, labels, reference: str = "single") -> dict[str, dict]:
    """:func:`variant_metrics` for every variant of one arm, plus the spread relative to ``reference``.

    Args:
      variants: name -> (R, N, C) logits, every variant from the same R replicas.
      labels: (N,) test labels.
      reference: the variant the others' accuracy and cross-entropy std are divided by.
    Returns:
      name -> metrics; variants other than the reference also get ``accuracy_vs_reference`` and
      ``cross_entropy_vs_reference`` (:func:`nondet_jax.analysis.stats.compare_spread`: ratio, CI, the
      permutation spread test's p that the table prints, F-test and Brown-Forsythe p) and ``accuracy_gain`` (mean accuracy minus the reference's).
    """
    _check(variants, labels)
    labels = np.asarray(labels)
    out = {name: variant_metrics(v, labels) for name, v in variants.items()}
    if reference in variants:
        ref = np.asarray(variants[reference])
        acc_ref, ce_ref = M.accuracy(ref, labels), M.cross_entropy(ref, labels)
        for name, v in variants.items():
            if name == reference:
                continue
            v = np.asarray(v)
            acc, ce = M.accuracy(v, labels), M.cross_entropy(v, labels)
            if len(acc) >= 2:
                out[name]["accuracy_vs_reference"] = S.compare_spread(acc, acc_ref, resolution=1 / len(labels))
                out[name]["cross_entropy_vs_reference"] = S.compare_spread(ce, ce_ref)
            out[name]["accuracy_gain"] = float(acc.mean() - acc_ref.mean())
    return out


def _num(x, digits: int, scale: float = 1.0) -> str:
    return "–" if x is None or not math.isfinite(x) else f"{x * scale:.{digits}f}"


_ci = S.format_ci


def mitigation_table(results: dict[str, dict[str, dict]]) -> str:
    """A Markdown table, one row per arm x variant, from ``{arm: mitigation_metrics(...)}``.

    Accuracy in %, its std (ddof=1) in percentage points, both with 95% CIs (t, robust); the
    std ratio to the reference variant with its permutation spread-test p; mean pairwise disagreement (%) and logit
    correlation with replica-jackknife CIs ("n/a" below 3 replicas); cross-entropy mean and std.
    """
    lines = ["| arm | variant | R | accuracy % [95% CI] | acc std (pp) [95% CI] | std ratio vs single (spread p) "
             "| disagreement % [95% CI] | correlation [95% CI] | cross-entropy mean | CE std |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for arm, variants in results.items():
        for name, m in variants.items():
            acc, ce = m["accuracy"], m["cross_entropy"]
            vs = m.get("accuracy_vs_reference")
            ratio = f"{_num(vs['ratio'], 2)} ({_num(vs['spread_p'], 3)})" if vs else "–"
            dis, cor = m.get("disagreement"), m.get("pearson")
            lines.append(
                f"| {arm} | {name} | {m['replicas']} | {_num(acc['mean'], 2, 100)}{_ci(acc['mean_ci'], 2, 100)} "
                f"| {_num(acc['std'], 2, 100)}{_ci(acc['std_ci'], 2, 100)} | {ratio} "
                f"| {_num(dis['mean'], 2, 100) + _ci(dis['ci'], 2, 100) if dis else '–'} "
                f"| {_num(cor['mean'], 4) + _ci(cor['ci'], 4) if cor else '–'} "
                f"| {_num(ce['mean'], 4)} | {_num(ce['std'], 4)} |")
    return "\n".join(lines) + "\n"
