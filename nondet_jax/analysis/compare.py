"""Is my improvement real? Two studies' or methods' per-seed scores compared with intervals."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np

from nondet_jax.analysis import stats as S
from nondet_jax.analysis.task import RUN_METRICS, run_metric, task_of
from nondet_jax.errors import UsageError
from nondet_jax.store.io import check_no_links, real_number
from nondet_jax.store.paths import RunPaths
from nondet_jax.store.run import read_arm_record, verify_arm_files

INDEX_COLUMNS = ("seed", "replica", "run", "index")
MISSING = ("", "NA", "N/A", "NAN", "NULL", "NONE")  # what spreadsheets write for a missing score


def _is_run(path: Path) -> bool:
    return path.is_dir()


def run_scores(run: str | Path, arm: str, metric: str | None = None) -> tuple[np.ndarray, dict]:
    """Per-replica ``metric`` of ``arm`` in a run folder (default: the task's test score, test accuracy or a
    regression's test MSE; replicas that diverged left out), and where it came from."""
    run = Path(run)
    config_path = RunPaths(run).config
    if not (config_path.exists() or config_path.is_symlink()):
        raise UsageError(f"{run} is not a nondet_jax run folder (no config.json); pass the --out folder of a sweep "
                         "or a CSV file of per-seed scores")
    check_no_links(run)  # as report: a link would read files outside the folder, a FIFO block the read forever
    record_path = RunPaths(run).arm_file("arms", arm)  # read only: no lock, nothing written
    if not record_path.exists():
        finished = sorted(p.stem for p in (run / "arms").glob("*.json")) if (run / "arms").is_dir() else []
        raise UsageError(f"arm '{arm}' has no finished results in {run} (finished: {', '.join(finished) or 'none'}); "
                         "pick one with --arm")
    record = verify_arm_files(run, arm, read_arm_record(run, arm))  # its own sha256 and form, then its files
    metric = run_metric(task_of(record), metric)
    rows = [r for r in record["rows"] if r.get("diverged_at_step", -1) < 0]
    if not all(real_number(r.get(metric)) for r in rows):
        # a record resealed by hand (anyone can recompute its checksum): a KeyError below
        raise UsageError(f"result file {record_path} holds a replica without its {metric} as a number (edited, its "
                         f"checksum recomputed); rerun the sweep with --recompute {arm} to train arm '{arm}' again")
    config = json.loads(RunPaths(run).config.read_text())
    where = {"source": str(run), "kind": "run", "arm": arm, "metric": metric, "task": task_of(record), "dataset": config["data"]["name"],
             "model": config["model"]["name"], "diverged_left_out": len(record["rows"]) - len(rows),
             "test_set": _test_set(run) or config["data"]["name"], "seed": config["study"]["seed"],
             "replicas": [int(r["replica"]) for r in rows], "n_test": _n_test(run, arm)}
    return np.array([r[metric] for r in rows], dtype=np.float64), where


def _n_test(run: Path, arm: str) -> int | None:
    """The number of test examples of a run (the step of its test accuracy): its test labels, else the arm's test
    logits (verified with the arm's files; the labels may be missing until the next sweep writes them), or None."""
    for path, axis in ((RunPaths(run).test_labels, 0), (RunPaths(run).arm_file("logits", arm), 1)):
        try:
            return int(np.load(path, mmap_mode="r", allow_pickle=False).shape[axis])
        except (OSError, ValueError, IndexError):
            continue
    return None


def _test_set(run: Path) -> str | None:
    """The sha256 of a run's test split (``model.json``), or None for a folder without one (or a ``model.json``
    from before it was recorded); UsageError for a ``model.json`` that is unreadable or not a record: its test
    split unknown, the runs' test arrays were said to differ."""
    path = RunPaths(run).model
    if not path.exists():
        return None
    try:
        ident = json.loads(path.read_text()).get("identity", {})
        sha = ident.get("data", {}).get("test_sha256")
        if not isinstance(sha, (str, type(None))):
            raise TypeError("not a digest")
        return sha
    except (OSError, ValueError, AttributeError, TypeError):
        raise UsageError(f"{path} is unreadable or corrupt, so the test set {run} was scored on is unknown; delete it "
                         f"and rerun the sweep with --resume {run}, which writes it again (finished arms are kept)"
                         ) from None


def csv_scores(path: str | Path, column: str | None = None) -> tuple[np.ndarray, dict]:
    """Per-seed scores from a CSV file: the named ``column``, or the only numeric column (a header
    line is optional when the file holds one column of numbers)."""
    path = Path(path)
    if not path.is_file():  # a FIFO would block the read forever
        raise UsageError(f"{path} is not a regular file; pass a CSV file of per-seed scores")
    try:  # utf-8-sig: a spreadsheet's byte-order mark is not part of the first column's name
        lines = [line for line in path.read_text(encoding="utf-8-sig").splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}; pass a CSV file of per-seed scores") from None
    rows = list(csv.reader(lines))
    if not rows:
        raise UsageError(f"{path} is empty; it needs one row per seed with a score")

    def number(x):
        try:
            return float(x)
        except ValueError:
            return None

    header = rows[0] if any(number(c) is None for c in rows[0]) else [f"column{i + 1}" for i in range(len(rows[0]))]
    body = rows[1:] if header is rows[0] else rows
    if len(header) == 1 and any(sep in header[0] for sep in ";\t|"):
        raise UsageError(f"{path} has one column, '{header[0]}': compare reads comma-separated files; write the "
                         "file with commas between its columns")
    if any(len(r) != len(header) for r in body):
        raise UsageError(f"{path} has rows with different numbers of fields; fix the file")
    twice = sorted({h for h in header if header.count(h) > 1})
    if twice and header is rows[0]:
        raise UsageError(f"{path} names column '{twice[0]}' twice; rename one")
    holes = {i: [k for k, r in enumerate(body) if number(r[i]) is None] for i in range(len(header))}
    numeric = [i for i in holes if body and not holes[i]]
    for i, name in enumerate(header):  # a column of numbers with a hole in it: name the cell
        cells = [body[k][i] for k in holes[i]]
        if cells and len(cells) < len(body) and (column is None or column == name) and \
                all(c.strip().upper() in MISSING for c in cells):
            line = holes[i][0] + (2 if header is rows[0] else 1)
            raise UsageError(f"{path} row {line}, column '{name}' is empty or NA ({cells[0]!r}); remove that "
                             "seed's row or fill in its score")
    if column is None:  # a seed or replica number is an index, not a score
        numeric = [i for i in numeric if header[i].strip().lower() not in INDEX_COLUMNS]
        if len(numeric) != 1:
            names = ", ".join(header[i] for i in numeric) or "none"
            raise UsageError(f"{path} has {len(numeric)} numeric columns ({names}); name the score with --column")
        idx = numeric[0]
    elif column not in header:
        raise UsageError(f"{path} has no column '{column}' (columns: {', '.join(header)}); fix --column")
    else:
        idx = header.index(column)
        if idx not in numeric:
            raise UsageError(f"column '{column}' of {path} holds values that are not numbers; fix the file or --column")
    scores = np.array([number(r[idx]) for r in body], dtype=np.float64)
    where = {"source": str(path), "kind": "csv", "column": header[idx]}
    index = next((i for i, h in enumerate(header) if h.strip().lower() in INDEX_COLUMNS and i != idx), None)
    if index is not None:  # what --paired pairs the rows by
        where["index_column"] = header[index].strip().lower()
        where["index"] = [r[index].strip() for r in body]
    return scores, where


def pair_up(xa: np.ndarray, wa: dict, xb: np.ndarray, wb: dict) -> tuple[np.ndarray, np.ndarray, dict]:
    """The two methods' scores as seed pairs for ``--paired``: run folders pair replica r with replica r
    (the same keys only under the same ``study.seed``; a replica that diverged in either, or that the other has
    not trained, is left out),
    CSV files pair by a seed/replica/run/index column both have, else row by row."""
    if wa["kind"] == "run":
        if wa["seed"] != wb["seed"]:
            raise UsageError(f"--paired pairs replica r of A with replica r of B, which share seeds only under the "
                             f"same study.seed: {wa['source']} used {wa['seed']} and {wb['source']} {wb['seed']}; "
                             "rerun one with the other's --seed, or drop --paired")
        if wa["arm"] != wb["arm"]:
            raise UsageError(f"--paired needs the same arm in both (the arm decides which sources each replica's keys "
                             f"vary): A is '{wa['arm']}', B '{wb['arm']}'; drop --arm-b or --paired")
        ra, rb = dict(zip(wa["replicas"], xa)), dict(zip(wb["replicas"], xb))
        keys = sorted(set(ra) & set(rb))
        left_out = len(set(ra) ^ set(rb))
        how = "replica"
    elif "index" in wa and wa.get("index_column") == wb.get("index_column"):
        ra, rb = dict(zip(wa["index"], xa)), dict(zip(wb["index"], xb))
        for w, r in ((wa, ra), (wb, rb)):
            if len(r) != len(w["index"]):
                raise UsageError(f"{w['source']} names a {w['index_column']} twice; --paired needs one row per "
                                 f"{w['index_column']}")
        only = sorted(set(ra) ^ set(rb))
        if only:
            side = wa["source"] if only[0] in ra else wb["source"]
            raise UsageError(f"{wa['index_column']} {only[0]} is only in {side}; --paired needs the same "
                             f"{wa['index_column']}s in both files (or drop --paired)")
        keys, left_out, how = sorted(ra, key=lambda k: (len(k), k)), 0, wa["index_column"]
    else:
        if len(xa) != len(xb):
            raise UsageError(f"--paired pairs the files row by row (neither names a seed column), but {wa['source']} "
                             f"has {len(xa)} scores and {wb['source']} {len(xb)}; add a seed column or drop --paired")
        ra, rb = dict(enumerate(xa)), dict(enumerate(xb))
        keys, left_out, how = list(range(len(xa))), 0, "row"
    return (np.array([ra[k] for k in keys]), np.array([rb[k] for k in keys]),
            {"paired_by": how, "pairs_left_out": left_out})


def compare(a: str | Path, b: str | Path, arm: str = "all", arm_b: str | None = None, metric: str | None = None,
            column: str | None = None, higher_is_better: bool | None = None, detect: float | None = None,
            paired: bool = False) -> dict:
    """Compare method A with method B: two run folders (arm ``arm`` of A, ``arm_b`` or ``arm`` of B,
    per-replica ``metric``) or two CSV files (``column``). Returns
    :func:`nondet_jax.analysis.stats.compare_means`'s fields plus ``a`` and ``b`` (where the scores came from);
    ``paired``: the methods ran under the same seeds (:func:`pair_up`), and the fields are
    :func:`nondet_jax.analysis.stats.compare_paired`'s.
    ``higher_is_better`` defaults to True, or to the metric's direction for run folders (losses: lower).
    ``detect``: a difference to size the next study for (replicas per method for 80% power at it).
    """
    if detect is not None and not (np.isfinite(detect) and detect != 0):
        raise UsageError(f"--detect {detect}: give a nonzero difference in the scores' units, e.g. 0.005")
    a, b = Path(a), Path(b)
    for p in (a, b):
        if not p.exists():
            raise UsageError(f"{p} does not exist; pass two run folders or two CSV files")
    if _is_run(a) != _is_run(b):
        raise UsageError(f"cannot compare a {'run folder' if _is_run(a) else 'CSV file'} ({a}) with a "
                         f"{'run folder' if _is_run(b) else 'CSV file'} ({b}); pass two run folders or two CSV files")
    if _is_run(a):
        if column is not None:
            raise UsageError("--column is for CSV files; for run folders choose --arm and --metric")
        xa, wa = run_scores(a, arm, metric)
        xb, wb = run_scores(b, arm_b or arm, metric)
        if wa["task"] != wb["task"]:
            raise UsageError(f"{a} is a {wa['task']} and {b} a {wb['task']}: their scores cannot be compared; pass two "
                             "runs of the same task")
        if wa["test_set"] != wb["test_set"]:
            lacking = [p for p in (a, b) if not RunPaths(p).model.exists()] if wa["dataset"] == wb["dataset"] else []
            if lacking:  # its test split unknown: the arrays may well be the same
                raise UsageError(f"{lacking[0]} has no model.json, which records the test split its scores are on; "
                                 f"rerun the sweep with --resume {lacking[0]}, which writes it (finished arms are "
                                 "kept), then compare again")
            what = (f"{a} was tested on {wa['dataset']} and {b} on {wb['dataset']}" if wa["dataset"] != wb["dataset"]
                    else f"{a} and {b} both name {wa['dataset']}, but their test arrays differ")
            raise UsageError(f"{what}: scores on different test sets cannot be compared; pass two runs on the same "
                             "test set")
        own = RUN_METRICS[wa["task"]][wa["metric"]]
        if higher_is_better is not None and higher_is_better != own:
            raise UsageError(f"{wa['metric']} is {'higher' if own else 'lower'}-is-better, which run folders know: "
                             "--lower-is-better is for CSV files; drop it (choose the score with --metric)")
        higher_is_better = own
    else:
        if arm != "all" or arm_b is not None or metric is not None:
            raise UsageError("--arm, --arm-b and --metric are for run folders; for CSV files choose --column")
        xa, wa = csv_scores(a, column)
        xb, wb = csv_scores(b, column)
    for x, w in ((xa, wa), (xb, wb)):
        if len(x) < 2:
            raise UsageError(f"{w['source']} gives {len(x)} score(s); the comparison needs at least 2 per method")
        if not np.isfinite(x).all():
            raise UsageError(f"{w['source']} holds a non-finite score (NaN or inf); remove that seed or fix the file")
        S.computable(x, w["source"])
    higher = True if higher_is_better is None else higher_is_better
    if paired:
        xa, xb, how = pair_up(xa, wa, xb, wb)
        if len(xa) < 2:
            raise UsageError(f"only {len(xa)} seed pair(s) are in both A and B; --paired needs at least 2")
        resolution = 1 / wa["n_test"] if wa["kind"] == "run" and wa["n_test"] and "accuracy" in wa["metric"] else None
        result = {**S.compare_paired(xa, xb, higher_is_better=higher, detect=detect, resolution=resolution), **how}
        kinds = ("paired_difference", "paired_probability_of_improvement")
    else:
        result = S.compare_means(xa, xb, higher_is_better=higher, detect=detect)
        kinds = ("difference", "probability_of_improvement")
    wa, wb = {**wa, "scores": xa.tolist()}, {**wb, "scores": xb.tolist()}
    return {**result, "a": wa, "b": wb,
            "methods": dict(zip(("difference", "probability_of_improvement"), (S.METHODS[k] for k in kinds)))}


def compare_many(a: str | Path, b: str | Path, arms: list[str] | None = None, columns: list[str] | None = None,
                 **kwargs) -> list[dict]:
    """:func:`compare` for each of several ``arms`` (run folders: arm x of A against arm x of B) or
    ``columns`` (CSV files), as one family: each result gains ``p_holm``, its p Holm-adjusted over the
    family (:func:`nondet_jax.analysis.stats.holm`), and ``holm_family``, the family's size; the verdicts
    name the adjusted p. With one arm or column the family is that comparison (``p_holm`` = ``p``)."""
    arms, columns = arms or ["all"], columns or [None]
    if len(arms) > 1 and len(columns) > 1:
        raise UsageError("name several --arm values (run folders) or several --column values (CSV files), not both")
    many, option = (arms, "--arm") if len(arms) > 1 else (columns, "--column")
    if len(set(many)) < len(many):
        raise UsageError(f"{option} names {', '.join(many)}: name each at most once")
    if len(arms) > 1 and kwargs.get("arm_b") is not None:
        raise UsageError("--arm-b pairs one arm of A with another arm of B; give one --arm with it, or drop --arm-b")
    pairs = [(x, columns[0]) for x in arms] if len(arms) > 1 else [(arms[0], c) for c in columns]
    results = [compare(a, b, arm=x, column=c, **kwargs) for x, c in pairs]
    for r, q in zip(results, S.holm([r["p"] for r in results])):
        r.update(p_holm=q, holm_family=len(results))
    return results


def _label(w: dict) -> str:
    if w["kind"] == "run":
        out = f"{w['source']} (arm {w['arm']}, {w['metric']}"
        return out + (f"; {w['diverged_left_out']} diverged replica(s) left out)" if w["diverged_left_out"] else ")")
    return f"{w['source']} (column {w['column']})"


def verdict(r: dict) -> str:
    """One sentence on what the printed interval and the printed test support together: a difference is claimed
    only when the 95% CI excludes 0 and the test's p is below 0.05 (Holm-adjusted too, in a family). The paired
    test is the printed interval's own (the paired t), so there the two never disagree; Welch's p and interval
    are one test too."""
    lo, hi = r["difference_ci"]
    if not np.isfinite(r["p"]):
        return (f"No test: neither method's scores vary (A {r['mean_a']:.6g} in every run, B {r['mean_b']:.6g}); "
                "identical runs (a control arm) are one observation each, so compare arms that vary a source, or "
                "pair seeds with --paired.")
    better = "better" if (r["difference"] > 0) == r["higher_is_better"] else "worse"
    test = "paired t p" if r.get("paired") else "Welch p"
    family = r.get("holm_family", 1)
    excludes, rejects = lo > 0 or hi < 0, r["p"] < 0.05
    if excludes and rejects:
        if family > 1:
            held = "holds" if r["p_holm"] < 0.05 else "does not hold"
            return (f"B is {better} than A: the 95% CI of the difference excludes 0 ({test} = {r['p']:.3g}); Holm-adjusted "
                    f"over the {family} comparisons p = {r['p_holm']:.3g}: the finding {held} for the family.")
        return f"B is {better} than A: the 95% CI of the difference excludes 0 ({test} = {r['p']:.3g})."
    if excludes != rejects:
        said = ("the 95% CI of the difference excludes 0 but the " + test.split(" p")[0] + f" test does not reject "
                f"({test} = {r['p']:.3g})") if excludes else (
                f"the {test.split(' p')[0]} test rejects ({test} = {r['p']:.3g}) but the 95% CI of the difference "
                "includes 0")
        return f"Not decided: {said}; more seeds would settle it."
    if r.get("paired"):
        n = r["pairs_for_80pct_power"]
        need = (f"about {n} seed pairs would detect a difference this size 80% of the time" if n
                else "no difference was observed to size a study for")
        return f"Cannot tell A and B apart with {r['n_pairs']} seed pairs: the 95% CI includes 0; {need}."
    n = r["replicas_for_80pct_power"]
    need = (f"about {n} runs per method would detect a difference this size 80% of the time" if n
            else "no difference was observed to size a study for")
    return f"Cannot tell A and B apart with {r['n_a']} and {r['n_b']} runs: the 95% CI includes 0; {need}."


def _holm(r: dict) -> str:
    family = r.get("holm_family", 1)
    return f", Holm-adjusted over {family} comparisons {r['p_holm']:.3g}" if family > 1 else ""


def format_many(results: list[dict]) -> str:
    """:func:`format_result` of each comparison of a family (:func:`compare_many`), blank-line separated."""
    return "\n\n".join(format_result(r) for r in results)


def format_paired(r: dict) -> str:
    g = lambda x: f"{x:.4g}"  # noqa: E731
    lo, hi = r["difference_ci"]
    plo, phi = r["probability_of_improvement_ci"]
    op = ">" if r["higher_is_better"] else "<"
    left = (f"; {r['pairs_left_out']} replica(s) without a partner in the other (diverged there, or beyond its "
            "replicas), left out" if r["pairs_left_out"] else "")
    corr = "n/a" if not np.isfinite(r["correlation"]) else f"{r['correlation']:.3f}"
    return "\n".join([
        f"A: {_label(r['a'])}: mean {g(r['mean_a'])}, std {g(r['std_a'])}",
        f"B: {_label(r['b'])}: mean {g(r['mean_b'])}, std {g(r['std_b'])}",
        f"paired by {r['paired_by']}: {r['n_pairs']} seed pairs{left}; correlation of the pairs {corr}",
        f"mean difference B − A over seeds: {r['difference']:+.4g}  95% CI [{g(lo)}, {g(hi)}]  paired t p = "
        f"{r['p']:.3g}{_holm(r)} (std of the differences {g(r['std_difference'])})",
        f"share of seeds where B {op} A (ties ½): {r['probability_of_improvement']:.3f}  95% CI [{plo:.3f}, {phi:.3f}]",
        f"seed pairs for 80% power at this difference: {r['pairs_for_80pct_power'] or 'n/a'} (paired t-test; a "
        "planning figure for the next study, not evidence about this one)",
        *([f"seed pairs for 80% power at a difference of {g(r['detect'])} (--detect): "
           f"{r['pairs_for_detect'] or 'n/a'}"] if r.get("detect") is not None else []),
        verdict(r),
        f"methods: difference: {r['methods']['difference']}; share of seeds: "
        f"{r['methods']['probability_of_improvement']}; p: {S.TESTS['paired_t_p']}",
    ])


def format_result(r: dict) -> str:
    if r.get("paired"):
        return format_paired(r)
    g = lambda x: f"{x:.4g}"  # noqa: E731
    lo, hi = r["difference_ci"]
    plo, phi = r["probability_of_improvement_ci"]
    op = ">" if r["higher_is_better"] else "<"
    return "\n".join([
        f"A: {_label(r['a'])}: n = {r['n_a']}, mean {g(r['mean_a'])}, std {g(r['std_a'])}",
        f"B: {_label(r['b'])}: n = {r['n_b']}, mean {g(r['mean_b'])}, std {g(r['std_b'])}",
        f"difference of means B − A: {r['difference']:+.4g}  " + (
            f"95% CI [{g(lo)}, {g(hi)}]  Welch p = {r['p']:.3g}{_holm(r)} (df {r['welch_df']:.1f})"
            if np.isfinite(r["p"]) else "95% CI and Welch p n/a (neither method's scores vary)"),
        f"probability of improvement P(B {op} A): {r['probability_of_improvement']:.3f}  95% CI [{plo:.3f}, {phi:.3f}]",
        f"replicas per method for 80% power at this difference: "
        f"{(r['replicas_for_80pct_power'] if r['pooled_std'] > 0 else None) or 'n/a'} "
        f"(two-sample t-test, pooled run-to-run std {g(r['pooled_std'])}; a planning figure for the next study, "
        "not evidence about this one)",
        *([f"replicas per method for 80% power at a difference of {g(r['detect'])} (--detect): "
           f"{r['replicas_for_detect'] or 'n/a'}"] if r.get("detect") is not None else []),
        verdict(r),
        f"methods: difference: {r['methods']['difference']}; probability of improvement: "
        f"{r['methods']['probability_of_improvement']}",
    ])
