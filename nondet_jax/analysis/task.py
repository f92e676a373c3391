"""What a study measures per replica, by task: classification (accuracy, cross-entropy) or regression
(test MSE and MAE). Everything that reports a per-replica score reads it from here."""

from __future__ import annotations

from typing import NamedTuple

from nondet_jax.errors import UsageError


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
# The per-replica scores of an arm record's rows that ``compare --metric`` takes, by task, each with whether
# higher is better; the first is the default.
RUN_METRICS = {"classification": {"test_accuracy": True, "test_loss": False, "train_loss": False,
                                  "train_accuracy": True},
               "regression": {"test_mse": False, "test_mae": False, "train_loss": False, "train_mae": False}}
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


def run_metric(task: str, metric: str | None) -> str:
    """``metric`` (default: the task's test score) if a run folder of ``task`` stores it per replica, else a
    one-line error naming the ones it does."""
    names = RUN_METRICS[task]
    if metric is None:
        return next(iter(names))
    if metric not in names:
        raise UsageError(f"unknown --metric '{metric}' for a run folder of a {task}; use one of {', '.join(names)}")
    return metric
