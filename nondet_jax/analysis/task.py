"""What a study measures per replica, by task: classification (accuracy, cross-entropy) or regression
(test MSE and MAE). Everything that reports a per-replica score reads it from here."""

from __future__ import annotations

from typing import NamedTuple


class Quantity(NamedTuple):
    name: str  # key of the metric in an arm's metrics and in vs_all
    row: str  # key of the per-replica value in an arm record's rows
    unit: str  # suffix of its table columns
    scale: float  # stored value -> table unit
    label: str  # how the report names it


QUANTITIES = {
    "classification": (Quantity("accuracy", "test_accuracy", "_pct", 100.0, "accuracy"),
                       Quantity("cross_entropy", "test_loss", "_nats", 1.0, "cross-entropy")),
    "regression": (Quantity("mse", "test_mse", "", 1.0, "test MSE"),
                   Quantity("mae", "test_mae", "", 1.0, "test MAE")),
}
TRAIN_SCORE = {"classification": "train_accuracy", "regression": "train_mae"}  # the step's second output
# Pairwise metrics per task, each with its table unit.
PAIRWISE = {
    "classification": {"disagreement": "_pct", "pearson": "", "spearman": "", "ensemble_gain_accuracy": "_pct",
                       "ensemble_gain_cross_entropy": "_nats", "cka": "", "weight_distance": "", "lmc_barrier": "_pct"},
    "regression": {"prediction_distance": "", "pearson": "", "spearman": "", "ensemble_gain_mse": "", "cka": "",
                   "weight_distance": ""},
}


def task_of(record: dict) -> str:
    """The task of an arm record or summary (records before regression existed are classification)."""
    return record.get("task", "classification")
