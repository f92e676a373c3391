"""The numbers of a report: per-arm records read back, aggregated into summary rows and tables."""

from __future__ import annotations

import csv
import io
import json
import shlex
from pathlib import Path

import numpy as np

from nondet_jax import config as cfg
from nondet_jax.analysis.arm import compare_arms
from nondet_jax.analysis.decomposition import decompose
from nondet_jax.analysis.mitigations import mitigation_metrics, snapshot_ensemble
from nondet_jax.analysis.stats import METHODS, POWER_RATIOS, TESTS, format_ci
from nondet_jax.analysis.task import PAIRWISE, QUANTITIES, task_of
from nondet_jax.errors import UsageError
from nondet_jax.sources import split_variant
from nondet_jax.store.io import _finite, atomic_write_bytes, check_no_links, read_arrays, real_number
from nondet_jax.store.paths import RunPaths, arm_name
from nondet_jax.store.run import RESULT_NEUTRAL, read_arm_record, verify_arm_files


def _fmt(x, digits=4) -> str:
    return "—" if x is None or (isinstance(x, float) and not np.isfinite(x)) else f"{x:.{digits}f}"


def _pct(x) -> str:
    """A fraction as a percentage with 2 decimals; "—" when missing."""
    return _fmt(None if x is None else x * 100, 2)


def _ci(ci, digits=4, scale=1.0) -> str:

    return format_ci(ci, digits, scale)


def load_records(run: Path) -> tuple[dict, dict[str, dict]]:
    """The run's config and the records of its finished arms, in the config's arm order."""
    paths = RunPaths(run)
    cfg_path = paths.config
    if not run.is_dir() or not cfg_path.exists():
        raise UsageError(f"{run} is not a nondet_jax run folder (no config.json); pass the --out folder of a sweep")
    check_no_links(run)
    try:
        config = json.loads(cfg_path.read_text())
        arms = config["study"]["arms"]
        if not isinstance(arms, list):
            raise TypeError("study.arms is not a list")
    except (OSError, json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise UsageError(f"{cfg_path} is unreadable or corrupt ({type(e).__name__}); rerun the sweep into a new "
                         "--out") from None
    _check_report_keys(config, cfg_path)
    arms = [arm_name(a, f"{cfg_path} study.arms") for a in arms]  # before any file is named after one
    records = {a: verify_arm_files(run, a, read_arm_record(run, a)) for a in arms
               if paths.arm_file("arms", a).exists()}
    if not records:
        raise UsageError(f"{run} has no finished arms yet; run the sweep to completion first")
    for arm, rec in records.items():
        _check_scores(paths.arm_file("arms", arm), arm, rec)
    return config, records


def _check_scores(path: Path, arm: str, record: dict) -> None:
    """An arm record (its digest anyone can recompute) holds its task's two scores as statistics of numbers,
    the scores every table and figure reads: a record without them, or with text in them, ended the report in a
    KeyError or TypeError after it had rewritten summary.json and arms.csv (an outside review)."""
    task = task_of(record)
    fix = f"rerun with --recompute {arm} to train arm '{arm}' again"
    if task not in QUANTITIES:
        raise UsageError(f"result file {path} names task {task!r}, not one of {', '.join(QUANTITIES)}; {fix}")
    number = lambda v: v is None or real_number(v)  # noqa: E731 (a statistic may be n/a)
    trained = any(row.get("diverged_at_step", -1) < 0 for row in record["rows"])  # else no statistics: all diverged
    for q in QUANTITIES[task]:
        stats = record["metrics"].get(q.name)
        if trained and (not isinstance(stats, dict) or not all(number(stats.get(k)) for k in ("mean", "std"))) or \
                not all(q.row in row and number(row[q.row]) for row in record["rows"]):
            raise UsageError(f"result file {path} does not hold its {q.name} as numbers (its statistics or a replica's "
                             f"{q.row}); {fix}")


REPORT_KEYS = tuple(sorted(k for s, k in RESULT_NEUTRAL if s == "metrics"))  # metrics.* keys the report alone reads


def _check_report_keys(config: dict, cfg_path: Path) -> None:
    """The keys only the report reads (:data:`nondet_jax.store.run.RESULT_NEUTRAL`'s ``metrics.*``: no arm record's
    digest covers them) checked as the command line checks them: a power ratio of 5 or 'abc' ended the report in
    a traceback, NaN was printed."""
    metrics = config.get("metrics", {})
    given = {f"metrics.{k}": metrics[k] for k in REPORT_KEYS if isinstance(metrics, dict) and k in metrics}
    try:
        cfg.validate(cfg.from_flat(given))
    except UsageError as e:
        raise UsageError(f"{cfg_path} holds a value the report cannot use ({e}); rerun the sweep on the same --out "
                         "with the setting you want (finished arms are reused, only the report is rebuilt)") from None


def build_summary(run: Path) -> tuple[dict, dict[str, dict]]:
    """Per-arm metrics plus each arm's spread relative to the ``all`` arm; and the arm records."""
    config, records = load_records(run)
    env_path = RunPaths(run).environment
    try:
        env = json.loads(env_path.read_text()) if env_path.exists() else {}
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        env = None
    if not isinstance(env, dict):
        raise UsageError(f"{env_path} is unreadable or not a JSON object; rerun the sweep on the same --out, which "
                         "writes it again")
    return {
        "study": str(run),
        "dataset": config["data"]["name"], "model": config["model"]["name"],
        "epochs": config["train"]["epochs"], "seed": config["study"]["seed"],
        "backend": env.get("backend"), "device_kind": env.get("device_kind"),
        "std_ddof": 1, "ci_level": 0.95, "ci_methods": METHODS, "tests": TESTS,
        "task": task_of(next(iter(records.values()))),
        "arms": {a: {k: v for k, v in rec.items() if k != "rows"} for a, rec in records.items()},
        "vs_all": compare_arms(records, ratios=tuple(config.get("metrics", {}).get("power_ratios", POWER_RATIOS))),
        "mitigations": mitigation_results(run, records),
        "decomposition": decompose(records, inactive=unused_sources(run, config))
        if config.get("metrics", {}).get("decomposition") else {},
        # the arms config.json asks for without a finished record (an interrupted sweep): named by the table
        "unfinished": [a for a in config["study"]["arms"] if a not in records],
    }, records


def model_record(paths: RunPaths) -> dict:
    """``model.json``'s record, ``{}`` where it is missing, unreadable or not a record (what it says is then
    unknown; the checks that need it refuse such a folder themselves)."""
    try:
        model = json.loads(paths.model.read_text()) if paths.model.is_file() else {}  # a FIFO never opened
        return model if isinstance(model, dict) else {}
    except (OSError, ValueError):
        return {}


def unused_sources(run: Path, config: dict) -> set[str]:
    """The seeded sources this study does not use, as its ``model.json`` records them (the facts
    ``study.prepare.check_arms_active`` refuses a one-source arm on): dropout in a model without it, augmentation
    switched off, and ``batch_order`` at batch size 1. ``all`` varies them and they add nothing."""
    model = model_record(RunPaths(run))
    unused = {"dropout": model.get("dropout") is False, "augmentation": model.get("augment") == "none",
              "batch_order": config.get("train", {}).get("batch_size") == 1}
    return {k for k, v in unused.items() if v}


def unfinished_line(summary: dict) -> str | None:
    """A line naming the arms the study asks for that have no finished results (a sweep stopped before them:
    killed, out of time), with the command that trains them; None when every arm is finished."""
    missing = summary.get("unfinished") or []
    if not missing:
        return None
    total = len(missing) + len(summary.get("arms", {}))
    names = ", ".join(missing)
    return (f"unfinished: {len(missing)} of the {total} arms this study asks for have no finished results ({names}) "
            "and are not in this report (the sweep stopped before them); train them with python -m nondet_jax.sweep "
            f"--resume {shlex.quote(str(summary.get('study', 'RUN')))} (finished arms are kept), or rerun the same "
            "command, which rebuilds the report")


def _healthy(record: dict) -> set[int]:
    return {row["replica"] for row in record["rows"] if row.get("diverged_at_step", -1) < 0}


def mitigation_results(run: Path, records: dict[str, dict]) -> dict[str, dict]:
    """Per plain arm with a mitigation stored: its variants' metrics (nondet_jax.analysis.mitigations).

    Variants: ``single`` (the arm's logits), ``tta:<views>`` (same models, test-time augmentation),
    ``snapshotK`` (arm@snapshotK: the mean of each replica's K cycle-end logits, same training
    epochs) and ``snapshotK last`` (its final snapshot alone). Replica r of the two arms shares
    every key, so the comparison is paired; replicas that diverged in either are left out.
    """
    paths = RunPaths(run)
    if not paths.test_labels.exists() or task_of(next(iter(records.values()), {})) != "classification":
        return {}  # the variants are scored by accuracy and cross-entropy
    labels = read_arrays(paths.test_labels)
    out = {}
    for arm, rec in records.items():
        if split_variant(arm)[1]:
            continue
        snaps = {other: split_variant(other)[1] for other in records
                 if split_variant(other)[0] == arm and split_variant(other)[1]}
        keep = sorted(_healthy(rec).intersection(*(_healthy(records[o]) for o in snaps)))
        if not keep:
            continue
        variants = {"single": read_arrays(paths.arm_file("logits", arm))[keep]}
        tta = paths.listed_file("tta", arm, rec)
        if tta is not None:
            variants.update({f"tta:{name}": a[keep] for name, a in read_arrays(tta).items()})
        for other, k in snaps.items():
            variants[f"snapshot{k}"] = snapshot_ensemble(read_arrays(paths.arm_file("snapshots", other))[keep])
            variants[f"snapshot{k} last"] = read_arrays(paths.arm_file("logits", other))[keep]
        if len(variants) > 1:
            out[arm] = mitigation_metrics(variants, labels)
    return out


def _x100(x):
    """A fraction as a percentage (None stays None)."""
    return None if x is None else 100 * x


def _ci_cols(name: str, ci, unit: str = "", scale=lambda v: v) -> dict:
    """``name_ci_low<unit>``, ``name_ci_high<unit>`` of a [low, high] interval; empty cells where n/a."""
    lo, hi = (ci or [None, None])
    return {f"{name}_ci_low{unit}": scale(_finite(lo)), f"{name}_ci_high{unit}": scale(_finite(hi))}


# Units of the tables (arms.csv, replicas.csv, StudyResult.table/.rows): accuracy-like quantities in %, as
# in the report and the figures, cross-entropy in nats, a regression's MSE and MAE in the targets' units
# (squared for MSE); the unit ends the column name (_pct, _nats), and a name without one is a ratio,
# correlation, similarity, p-value or a regression's error.


def arm_rows(summary: dict) -> list[dict]:
    """One flat row per arm (the ``arms.csv`` table); units in the column names (see
    :data:`nondet_jax.analysis.task.PAIRWISE`)."""
    task = task_of(summary)
    quantities = QUANTITIES[task]
    rows = []
    for arm, a in summary["arms"].items():
        m = a["metrics"]  # empty when every replica diverged: the row says so, its numbers are empty (n/a)
        row = {"arm": arm, "varied": "+".join(a["varied"]) or "none", "replicas": a["replicas"],
               "diverged": len(a.get("diverged", [])),
               "diverged_at_steps": " ".join(f"{d['replica']}@{d['step']}" for d in a.get("diverged", []))}
        for q in quantities:
            def scale(v, k=q.scale):
                return None if v is None else k * v

            st = m.get(q.name) if isinstance(m.get(q.name), dict) else {}
            row.update({f"{q.name}_mean{q.unit}": scale(st.get("mean")), f"{q.name}_std{q.unit}": scale(st.get("std")),
                        **_ci_cols(f"{q.name}_std", st.get("std_ci"), q.unit, scale)})
        if task == "classification":
            row["independent_errors_std_pct"] = _x100(m.get("independent_errors_std"))
        vs = summary["vs_all"].get(arm)
        for q in quantities:
            c = vs[q.name] if vs else {}
            row.update({f"{q.name}_std_ratio_vs_all": c.get("ratio"), **_ci_cols(f"{q.name}_ratio", c.get("ratio_ci")),
                        f"{q.name}_spread_p": c.get("spread_p"), f"{q.name}_spread_p_holm": c.get("spread_p_holm"),
                        f"{q.name}_f_test_p": c.get("f_test_p"), f"{q.name}_brown_forsythe_p": c.get("brown_forsythe_p"),
                        **{f"{q.name}_replicas_for_ratio_{k}": n for k, n in c.get("replicas_for_ratio", {}).items()}})
        for name, unit in PAIRWISE[task].items():
            scale = _x100 if unit == "_pct" else (lambda v: v)
            row[f"{name}{unit}"] = scale(m[name]["mean"]) if name in m else None
            if name != "lmc_barrier":  # same units as the mean; empty where "n/a" (R < 3)
                row.update(_ci_cols(name, (m.get(name) or {}).get("ci"), unit, scale))
        row.update({"strategy": a["strategy"], "seconds": a["seconds"]})
        rows.append(row)
    return rows


def _write_csv(path: Path, rows: list[dict], root: Path | None = None) -> None:

    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(rows[0]), lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    atomic_write_bytes(path, buf.getvalue().encode(), root=root)


def _std_cell(st: dict, a: dict, scale: float = 100.0, digits: int = 2) -> str:
    """``std [low, high]`` of an arm's score, or "bitwise identical" when its replicas are (the spread is
    exactly zero by construction, not estimated)."""
    if a.get("replicas_used", a.get("replicas", 2)) < 2:  # one replica: no spread, and nothing compared to
        return "n/a (1 replica)"
    if a.get("replicas_bitwise_identical"):
        return "bitwise identical"
    ci = st.get("std_ci") or [None, None]
    if any(c is None or not np.isfinite(c) for c in ci):
        return f"{small(st['std'] * scale, digits)} n/a"
    return f"{small(st['std'] * scale, digits)} [{small(ci[0] * scale, digits)}, {small(ci[1] * scale, digits)}]"


def small(x, digits: int) -> str:
    """``x`` with ``digits`` decimals, or in scientific notation when that would print a nonzero value as 0."""
    if x is None or not np.isfinite(x):
        return "—"
    return f"{x:.{digits}f}" if x == 0 or abs(x) >= 0.5 * 10 ** -digits else f"{x:.1e}"


def fmt_p(x) -> str:
    """A p-value with 3 decimals, or in scientific notation below 0.001 (never a bare "0.000")."""
    if x is None or not np.isfinite(x):
        return "—"
    return f"{x:.3f}" if x >= 0.001 or x == 0 else f"{x:.1e}"


def _classification_columns(arm: str, a: dict, summary: dict) -> tuple[str, str, str]:
    """(header, row after the arm and R, legend) of the classification table."""
    m = a["metrics"]
    vs = summary["vs_all"].get(arm, {}).get("accuracy", {})
    head = (f"{'accuracy %':>10} {'acc std % [95% CI]':>22} {'ratio vs all':>12} {'p':>7}"
            f" {'CE std [95% CI]':>26} {'disagree %':>10} {'CKA':>6} {'w. dist':>8} {'LMC bar. %':>10}")
    row = ""
    if m:
        acc, ce = m["accuracy"], m["cross_entropy"]
        wd = m.get("weight_distance", {}).get("mean")
        row = (f"{acc['mean'] * 100:>10.2f} {_std_cell(acc, a):<22} "
               f"{_fmt(vs.get('ratio'), 2):>12} {fmt_p(vs.get('spread_p_holm')):>7} {_std_cell(ce, a, 1.0, 4):<26} "
               f"{small(None if m.get('disagreement') is None else m['disagreement']['mean'] * 100, 2):>10} "
               f"{_fmt(m.get('cka', {}).get('mean'), 3):>6} {small(wd, 3):>8} "
               f"{_pct(m.get('lmc_barrier', {}).get('mean')):>10}")
    legend = ("std: sample std over replicas (ddof=1), robust 95% CI (Bonett; a tied accuracy: up to the largest std "
              "that ties R replicas; n/a below R=3); ratio: accuracy std / the all arm's; p: permutation spread test, "
              "Holm-adjusted over the arms; CE in nats; disagreement and LMC barrier (test error) in %, mean over "
              "pairs; w. dist: relative distance ||θa−θb||/||θa|| of two replicas' final weights, mean over pairs")
    return head, row, legend


def _regression_columns(arm: str, a: dict, summary: dict) -> tuple[str, str, str]:
    """(header, row, legend) of a regression's table: test MSE and MAE in place of accuracy and
    cross-entropy, the RMS distance and correlation of replicas' predictions in place of disagreement."""
    m = a["metrics"]
    vs = summary["vs_all"].get(arm, {}).get("mse", {})
    g = lambda v: "n/a" if v is None or not np.isfinite(v) else f"{v:.4g}"  # noqa: E731
    ci = lambda c: "" if not c or c[0] is None or not np.isfinite(c[0]) else f" [{g(c[0])}, {g(c[1])}]"  # noqa: E731
    head = (f"{'test MSE':>10} {'MSE std [95% CI]':>28} {'ratio vs all':>12} {'p':>7}"
            f" {'MAE std [95% CI]':>28} {'pred. dist':>10} {'pred. r':>7} {'CKA':>6}")
    row = ""
    if m:
        mse, mae = m["mse"], m["mae"]
        row = (f"{g(mse['mean']):>10} {(g(mse['std']) + ci(mse['std_ci'])):>28} {_fmt(vs.get('ratio'), 2):>12} "
               f"{fmt_p(vs.get('spread_p_holm')):>7} {(g(mae['std']) + ci(mae['std_ci'])):>28} "
               f"{g(m.get('prediction_distance', {}).get('mean')):>10} {_fmt(m.get('pearson', {}).get('mean'), 3):>7} "
               f"{_fmt(m.get('cka', {}).get('mean'), 3):>6}")
    legend = ("regression: std over replicas (ddof=1), robust 95% CI (Bonett; n/a below R=3); ratio: "
              "test-MSE std / the all arm's; p: permutation spread test, Holm-adjusted over the arms; pred. dist: RMS difference of two replicas' test "
              "predictions, pred. r: their Pearson correlation, mean over pairs (no accuracy, disagreement or LMC "
              "barrier: they need classes)")
    return head, row, legend


def format_table(summary: dict) -> str:
    """The main per-arm table (plain text): printed by the sweep, embedded in the report; its
    columns are the task's (:func:`_classification_columns`, :func:`_regression_columns`)."""
    columns = _regression_columns if task_of(summary) == "regression" else _classification_columns
    head = legend = ""
    rows = []
    w = max([13, *(len(arm) + 1 for arm in summary["arms"])])  # init@snapshot3 pushed its row out of line
    for arm, a in summary["arms"].items():
        head, row, legend = columns(arm, a, summary)
        if not a["metrics"]:
            rows.append(f"{arm:<{w}}{0:>3} {'n/a':>10}  every replica diverged, nothing left to measure (see below)")
        else:
            rows.append(f"{arm:<{w}}{a.get('replicas_used', a['replicas']):>3} {row}")
    head = f"{'arm':<{w}}{'R':>3} {head}"
    lines = [head, "-" * len(head), *rows, legend]
    diverged = {arm: a["diverged"] for arm, a in summary["arms"].items() if a.get("diverged")}
    if diverged:
        lines.append("diverged (left out of every metric; R counts the rest): " + "; ".join(
            f"{arm} {len(d)} of {summary['arms'][arm]['replicas']} (replica "
            + ", ".join(f"{x['replica']} at step {x['step']}" + (" with non-finite outputs" if x.get("cause") == "outputs"
                        else "") for x in d) + ")" for arm, d in diverged.items()))
    unfinished = unfinished_line(summary)
    if unfinished:
        lines.append(unfinished)
    return "\n".join(lines)
