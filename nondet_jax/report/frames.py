"""Everything a run folder measured as long tables (one row per number): the CSV files the report writes
and :meth:`nondet_jax.StudyResult.to_frame`.

One naming scheme: a per-replica score is named as ``compare --metric`` takes it and as arm records
store it (``test_accuracy``, ``test_loss``, ``train_accuracy``, ``train_loss``; a regression's
``test_mse``, ``test_mae``, ``train_loss``, ``train_mae``); a pairwise metric as in ``summary.json``
(``disagreement``, ``ensemble_gain_accuracy``, ...). The ``value`` column is in the unit the ``unit``
column names (``%``, ``nats``, or empty for a ratio, correlation or a regression's error), the units of
``arms.csv`` and the report. Each kind's columns are :data:`COLUMNS`; its loader is :data:`FRAMES`.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import Callable

import numpy as np

from nondet_jax.analysis.metrics import pair_indices
from nondet_jax.analysis.task import PAIRWISE, QUANTITIES, task_of
from nondet_jax.errors import UsageError
from nondet_jax.store.io import read_arrays
from nondet_jax.store.paths import RunPaths

# The unit of each per-replica score in the tables (stored as fractions and nats; accuracy-like in %).
SCORE_UNITS = {"test_accuracy": "%", "train_accuracy": "%", "test_loss": "nats", "train_loss": "nats"}
UNIT_NAMES = {"_pct": "%", "_nats": "nats", "": ""}

COLUMNS = {
    "replicas": ("arm", "replica", "metric", "value", "unit", "diverged_at_step"),
    "curves": ("arm", "replica", "epoch", "metric", "value", "unit"),
    "best": ("arm", "replica", "metric", "value", "unit", "epoch"),
    "decomposition": ("metric", "term", "value", "ci_low", "ci_high", "replicas"),
    "pairs": ("arm", "replica_a", "replica_b", "metric", "value", "unit"),
    "instruments": ("arm", "replica", "step", "quantity", "value"),
}


def score_unit(metric: str, task: str) -> tuple[str, float]:
    """(unit, factor from the stored value) of a per-replica score."""
    if task == "regression":  # MSE, MAE and the user's loss: in the targets' units
        return "", 1.0
    unit = SCORE_UNITS.get(metric, "")
    return unit, 100.0 if unit == "%" else 1.0


def replicas(run: Path, summary: dict, records: dict[str, dict]) -> list[dict]:
    """Every replica's final scores: one row per arm, replica and score."""
    task = task_of(summary)
    out = []
    for arm, rec in records.items():
        for row in rec["rows"]:
            for metric, v in row.items():
                if metric in ("arm", "replica", "diverged_at_step", "strategy") or not isinstance(v, (int, float)):
                    continue  # the scores: a missing one (None) has no row
                unit, k = score_unit(metric, task)
                out.append({"arm": arm, "replica": row["replica"], "metric": metric, "value": k * v, "unit": unit,
                            "diverged_at_step": row.get("diverged_at_step", -1)})
    return out


def curves(run: Path, summary: dict, records: dict[str, dict]) -> list[dict]:
    """Per replica and epoch: the training scores of every epoch and, with ``study.eval_every``, the
    test scores of the epochs tested (``history/<arm>.npz``)."""
    task = task_of(summary)
    out = []
    for arm in records:
        path = RunPaths(run).arm_file("history", arm)
        if not path.exists():
            continue
        h = read_arrays(path)
        series = []
        for name in h:
            if name.startswith("train_") and h[name].ndim == 2:
                series.append((name, np.arange(1, h[name].shape[1] + 1), h[name]))
            elif name.startswith("test_") and name != "test_epochs" and "test_epochs" in h:
                series.append((name, h["test_epochs"], h[name]))
        for name, epochs, values in series:
            unit, k = score_unit(name, task)
            for r in range(values.shape[0]):
                out += [{"arm": arm, "replica": r, "epoch": int(e), "metric": name, "value": k * float(v), "unit": unit}
                        for e, v in zip(epochs, values[r])]
    return out


def best(run: Path, summary: dict, records: dict[str, dict]) -> list[dict]:
    """Per replica: its best test score over the epochs tested (``study.eval_every``) and the first
    epoch that reached it."""
    task = task_of(summary)
    out = []
    for arm, rec in records.items():
        ot = rec.get("over_training")
        if not ot:
            continue
        unit, k = score_unit(ot["metric"], task)
        healthy = [row["replica"] for row in rec["rows"] if row.get("diverged_at_step", -1) < 0]
        for r, v, e in zip(healthy, ot["best"]["values"], ot["best_epoch"]["values"]):
            out.append({"arm": arm, "replica": r, "metric": ot["metric"], "value": k * v, "unit": unit, "epoch": e})
    return out


def decomposition(run: Path, summary: dict, records: dict[str, dict]) -> list[dict]:
    """Per score: each one-source arm's share of the ``all`` arm's variance (``term`` the arm), the sum
    of the shares (``sum``) and the non-additivity 1 − sum (``non_additivity``), with 95% intervals."""
    rows = {q.name: q.row for q in QUANTITIES[task_of(summary)]}
    out = []
    for name, d in (summary.get("decomposition") or {}).items():
        metric = rows.get(name, name)
        for arm, s in d["shares"].items():
            out.append({"metric": metric, "term": arm, "value": s["share"], "ci_low": s["ci"][0],
                        "ci_high": s["ci"][1], "replicas": s["replicas"]})
        for term, key in (("sum", "sum"), ("non_additivity", "non_additivity")):
            out.append({"metric": metric, "term": term, "value": d[key], "ci_low": d[f"{key}_ci"][0],
                        "ci_high": d[f"{key}_ci"][1], "replicas": d["reference_replicas"]})
    return out


def pairs(run: Path, summary: dict, records: dict[str, dict]) -> list[dict]:
    """Per pair of replicas (a < b): every pairwise metric (``pairs/<arm>.npz``); the LMC barrier on
    the disjoint pairs it was measured on."""
    units = PAIRWISE[task_of(summary)]
    out = []
    for arm in records:
        path = RunPaths(run).arm_file("pairs", arm)
        if not path.exists():
            continue
        arrays = read_arrays(path)
        for metric, suffix in units.items():
            if metric not in arrays:
                continue
            values = arrays[metric]
            if metric == "lmc_barrier":
                index = arrays["lmc_pairs"]
            else:
                r = int(round((1 + np.sqrt(1 + 8 * len(values))) / 2))
                index = np.stack(pair_indices(r), 1)
            k = 100.0 if suffix == "_pct" else 1.0
            out += [{"arm": arm, "replica_a": int(a), "replica_b": int(b), "metric": metric, "value": k * float(v),
                     "unit": UNIT_NAMES[suffix]} for (a, b), v in zip(index, values)]
    return out


def _typed_instrument(row: dict, where: Path, run: Path) -> dict:
    """An instruments row with its replica and step as ints and its value as a float (a CSV holds text; an empty
    value is NaN)."""
    try:
        return {**row, "replica": int(row["replica"]), "step": int(row["step"]), "value": float(row["value"] or "nan")}
    except (TypeError, ValueError):
        raise UsageError(f"{where} holds a row that is not (arm, replica, step, quantity, number): {row}; rebuild it "
                         f"with python -m nondet_jax report {run}") from None


def instruments(run: Path, summary: dict, records: dict[str, dict]) -> list[dict]:
    """The instruments' values per arm, replica and step (``instruments.csv``; folders written before it
    existed: the per-arm ``instruments/<arm>.csv``, layer-wise values named ``quantity/layer``), typed: replica and
    step ints, value a float."""
    paths = RunPaths(run)
    if paths.instruments_csv.is_file():
        with paths.instruments_csv.open(newline="") as f:
            return [_typed_instrument({k: row[k] for k in COLUMNS["instruments"]}, paths.instruments_csv, run)
                    for row in csv.DictReader(f)]
    out = []
    for arm, rec in records.items():
        path = paths.listed_file("instruments", arm, rec, ".csv")
        if path is not None:
            with path.open(newline="") as f:
                out += [_typed_instrument({"arm": row["arm"], "replica": row["replica"], "step": row["step"],
                                           "quantity": row["quantity"] + (f"/{row['layer']}" if row.get("layer") else ""),
                                           "value": row["value"]}, path, run) for row in csv.DictReader(f)]
    if not out:
        raise UsageError(f"{run} holds no instruments' values (no instruments.csv); run the study with instruments "
                         "on: --instruments economy on the command line, settings={'instruments.config': 'economy'} "
                         "in Python")
    return out


# kind -> loader (run folder, summary, arm records) -> rows; the CSV of each is RunPaths.table(kind).
FRAMES: dict[str, Callable[[Path, dict, dict], list[dict]]] = {
    "replicas": replicas, "curves": curves, "best": best, "decomposition": decomposition, "pairs": pairs,
    "instruments": instruments,
}
WRITTEN = ("replicas", "curves", "best", "decomposition", "pairs")  # the report's CSVs (instruments: the study's)


def csv_bytes(rows: list[dict], columns) -> bytes:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(columns), lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    return buf.getvalue().encode()
