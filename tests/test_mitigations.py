"""Mitigation analysis: snapshot ensembles, per-variant spread and diversity, the Markdown table."""

import numpy as np
import pytest

from nondet_jax.analysis.mitigations import (
    mitigation_metrics,
    mitigation_table,
    snapshot_ensemble,
    snapshot_epochs,
    variant_metrics,
)
from nondet_jax.errors import UsageError

LABELS = np.array([0, 0, 1, 1])


def logits_for(preds, margin=2.0):
    """(R, N, 2) logits whose argmax is ``preds`` (R, N), with the given margin."""
    preds = np.asarray(preds)
    out = np.zeros(preds.shape + (2,), np.float32)
    np.put_along_axis(out, preds[..., None], margin, axis=-1)
    return out


# Replicas predicting [0,0,1,1] (all right), [0,1,1,1] (3/4), [1,1,1,1] (2/4).
THREE = logits_for([[0, 0, 1, 1], [0, 1, 1, 1], [1, 1, 1, 1]])


def test_snapshot_ensemble_of_identical_snapshots_is_the_single_model():
    single = np.random.default_rng(0).normal(size=(3, 50, 10)).astype(np.float32)
    snaps = np.repeat(single[:, None], 4, axis=1)  # (R, K, N, C)
    ens = snapshot_ensemble(snaps)
    assert ens.dtype == np.float32 and np.array_equal(ens, single)
    a, b = variant_metrics(single, np.arange(50) % 10), variant_metrics(ens, np.arange(50) % 10)
    assert a == b


def test_snapshot_ensemble_averages_over_snapshots():
    snaps = np.array([[[[1.0, 0.0]], [[3.0, 4.0]]]])  # R=1, K=2, N=1, C=2
    np.testing.assert_array_equal(snapshot_ensemble(snaps), [[[2.0, 2.0]]])
    with pytest.raises(UsageError, match="stack each replica's cycle-end logits"):
        snapshot_ensemble(snaps[0])


def test_snapshot_epochs():
    assert snapshot_epochs(12, 3) == (4, 8, 12) and snapshot_epochs(5, 1) == (5,)
    with pytest.raises(UsageError, match="divisible"):
        snapshot_epochs(12, 5)


def test_identical_replicas_have_no_spread_and_no_disagreement():
    logits = np.repeat(np.random.default_rng(1).normal(size=(1, 40, 5)), 4, axis=0)
    m = variant_metrics(logits, np.arange(40) % 5)
    assert m["accuracy"]["std"] == 0.0 and m["accuracy"]["std_ci"][0] == 0.0 < m["accuracy"]["std_ci"][1] < 2 / 40
    assert m["cross_entropy"]["std"] == 0.0 and m["cross_entropy"]["std_ci"] == [0.0, 0.0]
    assert m["disagreement"]["mean"] == 0.0 and m["disagreement"]["ci"][0] == 0 < m["disagreement"]["ci"][1]
    assert m["disagreement"]["minority_predictions"] == 0  # the Poisson bound of no differing prediction
    assert all(np.isnan(m["pearson"]["ci"])) and m["pearson"]["na"].startswith("n/a: replicas too alike")
    assert m["pearson"]["mean"] == pytest.approx(1.0, abs=1e-12)


def test_hand_computed_accuracy_spread_and_disagreement():
    m = variant_metrics(THREE, LABELS)
    assert m["replicas"] == 3
    assert m["accuracy"]["mean"] == pytest.approx(0.75)
    assert m["accuracy"]["std"] == pytest.approx(0.25)  # std(1, .75, .5), ddof=1
    assert m["disagreement"]["mean"] == pytest.approx((1 / 4 + 2 / 4 + 1 / 4) / 3)
    lo, hi = m["accuracy"]["mean_ci"]  # t(2 df) at 98.25% (stats.MEAN_TAIL): 0.75 ± 5.2039 * 0.25 / sqrt(3)
    assert 0.75 - 5.2039 * 0.25 / np.sqrt(3) < 0 and (lo, hi) == (0.0, 1.0)  # both ends clipped to [0, 100%]
    # cross-entropy of a right answer with margin 2: log(1 + e^-2); of a wrong one: log(1 + e^2)
    right, wrong = np.log1p(np.exp(-2.0)), np.log1p(np.exp(2.0))
    assert m["cross_entropy"]["mean"] == pytest.approx((9 * right + 3 * wrong) / 12)


def test_mitigation_metrics_compare_every_variant_with_single():
    # "tta" fixes replica 2's first example: accuracies 1, .75, .75
    tta = logits_for([[0, 0, 1, 1], [0, 1, 1, 1], [0, 1, 1, 1]])
    res = mitigation_metrics({"single": THREE, "tta": tta, "snapshot": THREE}, LABELS)
    assert set(res) == {"single", "tta", "snapshot"}
    assert "accuracy_vs_reference" not in res["single"]
    vs = res["tta"]["accuracy_vs_reference"]
    assert vs["ratio"] == pytest.approx(np.std([1, .75, .75], ddof=1) / 0.25)
    assert res["tta"]["accuracy_gain"] == pytest.approx((1 + .75 + .75) / 3 - 0.75)
    assert res["snapshot"]["accuracy_vs_reference"]["ratio"] == pytest.approx(1.0)
    assert res["snapshot"]["accuracy_gain"] == 0.0


def test_ensembling_noisy_snapshots_lowers_disagreement():
    """Logits = a shared signal + independent noise per replica and snapshot: the K-snapshot mean
    has 1/K the noise variance, so replicas disagree less and correlate more."""
    rng = np.random.default_rng(0)
    signal = rng.normal(size=(1, 1, 2000, 10))
    snaps = (signal + 0.5 * rng.normal(size=(6, 5, 2000, 10))).astype(np.float32)
    labels = signal[0, 0].argmax(-1)
    res = mitigation_metrics({"single": snaps[:, 0], "snapshot": snapshot_ensemble(snaps)}, labels)
    s, e = res["single"], res["snapshot"]
    assert e["disagreement"]["mean"] < 0.6 * s["disagreement"]["mean"]
    assert e["pearson"]["mean"] > s["pearson"]["mean"] + 0.1
    assert e["accuracy"]["mean"] > s["accuracy"]["mean"] + 0.1
    assert e["disagreement"]["ci"][1] < s["disagreement"]["ci"][0]  # the CIs do not overlap


def test_table_has_one_row_per_arm_and_variant():
    res = {"init": mitigation_metrics({"single": THREE, "tta": THREE}, LABELS),
           "all": mitigation_metrics({"single": THREE[:2], "tta": THREE[1:]}, LABELS)}
    table = mitigation_table(res)
    rows = [line for line in table.splitlines() if line.startswith("| init") or line.startswith("| all")]
    assert [r.split("|")[1:3] for r in rows] == [[" init ", " single "], [" init ", " tta "], [" all ", " single "],
                                                [" all ", " tta "]]
    assert "| 75.00 [" in rows[0] and "| 25.00 [" in rows[0] and "| 33.33 [" in rows[0]
    assert "| 1.00 (–) |" in rows[1]  # identical spread: ratio 1; the spread test is n/a at R=3 (< 5 per arm)
    assert "| 75.00 [0.00, 100.00] |" in rows[1]  # an accuracy's mean interval ends at 100%
    assert "| 87.50 [" in rows[2] and "| 25.00 n/a |" in rows[2]  # R=2: a t interval, but no pairwise CI
    assert table.count("\n") == 6


@pytest.mark.parametrize("variants,labels,match", [
    ({}, LABELS, "no variants"),
    ({"single": THREE, "tta": THREE[:2]}, LABELS, "share one"),
    ({"single": THREE[0]}, LABELS, "share one"),
    ({"single": THREE}, LABELS[:3], "labels must be"),
])
def test_bad_inputs_are_refused(variants, labels, match):
    with pytest.raises(UsageError, match=match):
        mitigation_metrics(variants, labels)
