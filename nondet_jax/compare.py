"""``python -m nondet_jax.compare A B``: is method B really better than method A, and how many seeds
would it take to know?

A and B are two run folders (one arm of each: ``--arm``, default ``all``) or two CSV files of
per-seed scores (``--column``; default the file's only numeric column). Prints the difference of
means with its Welch 95% interval and p-value, the probability of improvement (rliable's: that one
run of B beats one run of A, ties counting half) with its interval, and the replicas per method a
two-sample t-test needs to detect the observed difference with 80% power given the measured
run-to-run std (:func:`nondet_jax.stats.compare_means`). Bad input: one line on stderr, exit 2.

``--plot FILE.png`` also draws the scores and both intervals.

Library use::

    from nondet_jax.compare import compare
    result = compare("runs/baseline", "runs/new", arm="all")     # or two .csv paths
    print(format_result(result))
    plot_result(result).savefig("compare.png")
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import numpy as np

from nondet_jax import stats as S
from nondet_jax.config import UsageError

INDEX_COLUMNS = ("seed", "replica", "run", "index")
RUN_METRICS = {"test_accuracy": True, "test_loss": False, "train_loss": False, "train_accuracy": True}


def _is_run(path: Path) -> bool:
    return path.is_dir()


def run_scores(run: str | Path, arm: str, metric: str = "test_accuracy") -> tuple[np.ndarray, dict]:
    """Per-replica ``metric`` of ``arm`` in a run folder (replicas that diverged left out), and where it came from."""
    from nondet_jax.store import RunPaths, verify_arm_files

    run = Path(run)
    if not (run / "config.json").is_file():
        raise UsageError(f"{run} is not a nondet_jax run folder (no config.json); pass the --out folder of a sweep "
                         "or a CSV file of per-seed scores")
    if metric not in RUN_METRICS:
        raise UsageError(f"unknown --metric '{metric}' for a run folder; use one of {', '.join(RUN_METRICS)}")
    record_path = RunPaths(run).arm_file("arms", arm)  # read only: no lock, nothing written
    if not record_path.exists():
        finished = sorted(p.stem for p in (run / "arms").glob("*.json")) if (run / "arms").is_dir() else []
        raise UsageError(f"arm '{arm}' has no finished results in {run} (finished: {', '.join(finished) or 'none'}); "
                         "pick one with --arm")
    try:
        record = json.loads(record_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        raise UsageError(f"result file {record_path} is unreadable or corrupt; rerun its study with --recompute {arm} "
                         "or pick another --arm") from None
    record = verify_arm_files(run, arm, record)
    rows = [r for r in record["rows"] if r.get("diverged_at_step", -1) < 0]
    config = json.loads((run / "config.json").read_text())
    where = {"source": str(run), "kind": "run", "arm": arm, "metric": metric, "dataset": config["data"]["name"],
             "model": config["model"]["name"], "diverged_left_out": len(record["rows"]) - len(rows)}
    return np.array([r[metric] for r in rows], dtype=np.float64), where


def csv_scores(path: str | Path, column: str | None = None) -> tuple[np.ndarray, dict]:
    """Per-seed scores from a CSV file: the named ``column``, or the only numeric column (a header
    line is optional when the file holds one column of numbers)."""
    path = Path(path)
    try:
        lines = [line for line in path.read_text().splitlines() if line.strip()]
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
    if any(len(r) != len(header) for r in body):
        raise UsageError(f"{path} has rows with different numbers of fields; fix the file")
    numeric = [i for i, _ in enumerate(header) if body and all(number(r[i]) is not None for r in body)]
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
    return scores, {"source": str(path), "kind": "csv", "column": header[idx]}


def compare(a: str | Path, b: str | Path, arm: str = "all", arm_b: str | None = None, metric: str = "test_accuracy",
            column: str | None = None, higher_is_better: bool | None = None) -> dict:
    """Compare method A with method B: two run folders (arm ``arm`` of A, ``arm_b`` or ``arm`` of B,
    per-replica ``metric``) or two CSV files (``column``). Returns
    :func:`nondet_jax.stats.compare_means`'s fields plus ``a`` and ``b`` (where the scores came from).
    ``higher_is_better`` defaults to True, or to the metric's direction for run folders (losses: lower).
    """
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
        if wa["dataset"] != wb["dataset"]:
            raise UsageError(f"{a} was tested on {wa['dataset']} and {b} on {wb['dataset']}: scores on different test "
                             "sets cannot be compared; pass two runs on the same dataset")
        if higher_is_better is None:
            higher_is_better = RUN_METRICS[metric]
    else:
        if arm != "all" or arm_b is not None or metric != "test_accuracy":
            raise UsageError("--arm, --arm-b and --metric are for run folders; for CSV files choose --column")
        xa, wa = csv_scores(a, column)
        xb, wb = csv_scores(b, column)
    for x, w in ((xa, wa), (xb, wb)):
        if len(x) < 2:
            raise UsageError(f"{w['source']} gives {len(x)} score(s); the comparison needs at least 2 per method")
        if not np.isfinite(x).all():
            raise UsageError(f"{w['source']} holds a non-finite score (NaN or inf); remove that seed or fix the file")
    result = S.compare_means(xa, xb, higher_is_better=True if higher_is_better is None else higher_is_better)
    wa, wb = {**wa, "scores": xa.tolist()}, {**wb, "scores": xb.tolist()}
    return {**result, "a": wa, "b": wb, "methods": {k: S.METHODS[k] for k in ("difference", "probability_of_improvement")}}


def plot_result(r: dict):
    """The comparison as a figure (returned, not saved): each method's per-seed scores with the mean and
    its t interval; the difference of means with its Welch interval against 0; the probability of
    improvement with its interval against ½ (no difference)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker  # noqa: F401 - matplotlib.ticker.MaxNLocator below

    fig, (ax, ad, ap) = plt.subplots(1, 3, figsize=(10, 3.6), gridspec_kw={"width_ratios": [1.2, 1, 1]})
    what = r["a"].get("metric") or r["a"].get("column") or "score"
    rng = np.random.default_rng(0)
    for i, (name, w) in enumerate((("A", r["a"]), ("B", r["b"]))):
        x = np.asarray(w["scores"])
        lo, hi = S.mean_ci(x)
        ax.scatter(i + rng.uniform(-0.1, 0.1, len(x)), x, s=16, alpha=0.8, color=f"C{i}")
        ax.errorbar(i + 0.25, x.mean(), yerr=[[x.mean() - lo], [hi - x.mean()]], fmt="o", color="k", capsize=4)
    ax.set_xticks([0, 1], [f"A (n={r['n_a']})", f"B (n={r['n_b']})"])
    ax.set_xlim(-0.5, 1.6)
    ax.set_ylabel(what)
    ax.set_title("per-seed scores; mean, 95% t CI", fontsize=9)
    for axis, value, (lo, hi), null, title in (
            (ad, r["difference"], r["difference_ci"], 0.0, "difference of means B − A\n(Welch 95% CI)"),
            (ap, r["probability_of_improvement"], r["probability_of_improvement_ci"], 0.5,
             f"P(B {'>' if r['higher_is_better'] else '<'} A), one run each\n(Newcombe 95% CI)")):
        axis.errorbar([value], [0], xerr=[[value - lo], [hi - value]], fmt="o", color="k", capsize=5)
        axis.axvline(null, color="C3", lw=1, ls="--", label="no difference")
        left, right = min(lo, null), max(hi, null)
        pad = 0.1 * (right - left) or 0.01
        axis.set_xlim(left - pad, right + pad)
        axis.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(4))
        axis.set_yticks([])
        axis.set_title(title, fontsize=9)
    ap.set_xlim(-0.02, 1.02)
    ap.legend(fontsize=8, loc="lower left")
    fig.suptitle(verdict(r), fontsize=9)
    fig.tight_layout()
    return fig


def _plot_path(path: str) -> Path:
    """``--plot FILE``, checked before anything is computed."""
    path = Path(path)
    if path.suffix.lower() not in (".png", ".pdf", ".svg"):
        raise UsageError(f"--plot {path}: name a .png, .pdf or .svg file")
    if not path.parent.is_dir():
        raise UsageError(f"--plot {path}: folder {path.parent} does not exist; create it or choose another path")
    return path


def _label(w: dict) -> str:
    if w["kind"] == "run":
        out = f"{w['source']} (arm {w['arm']}, {w['metric']}"
        return out + (f"; {w['diverged_left_out']} diverged replica(s) left out)" if w["diverged_left_out"] else ")")
    return f"{w['source']} (column {w['column']})"


def verdict(r: dict) -> str:
    """One sentence on what the interval supports."""
    lo, hi = r["difference_ci"]
    better = "better" if (r["difference"] > 0) == r["higher_is_better"] else "worse"
    if lo > 0 or hi < 0:
        return f"B is {better} than A: the 95% CI of the difference excludes 0 (Welch p = {r['p']:.3g})."
    n = r["replicas_for_80pct_power"]
    need = (f"about {n} runs per method would detect a difference this size 80% of the time" if n
            else "no difference was observed to size a study for")
    return f"Cannot tell A and B apart with {r['n_a']} and {r['n_b']} runs: the 95% CI includes 0; {need}."


def format_result(r: dict) -> str:
    g = lambda x: f"{x:.4g}"  # noqa: E731
    lo, hi = r["difference_ci"]
    plo, phi = r["probability_of_improvement_ci"]
    op = ">" if r["higher_is_better"] else "<"
    return "\n".join([
        f"A: {_label(r['a'])}: n = {r['n_a']}, mean {g(r['mean_a'])}, std {g(r['std_a'])}",
        f"B: {_label(r['b'])}: n = {r['n_b']}, mean {g(r['mean_b'])}, std {g(r['std_b'])}",
        f"difference of means B − A: {r['difference']:+.4g}  95% CI [{g(lo)}, {g(hi)}]  Welch p = {r['p']:.3g} "
        f"(df {r['welch_df']:.1f})",
        f"probability of improvement P(B {op} A): {r['probability_of_improvement']:.3f}  95% CI [{plo:.3f}, {phi:.3f}]",
        f"replicas per method for 80% power at this difference: {r['replicas_for_80pct_power'] or 'n/a'} "
        f"(two-sample t-test, pooled run-to-run std {g(r['pooled_std'])})",
        verdict(r),
        f"methods: difference: {r['methods']['difference']}; probability of improvement: "
        f"{r['methods']['probability_of_improvement']}",
    ])


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    from nondet_jax.__main__ import prog_name
    from nondet_jax.errors import OneLineParser

    prog = prog or prog_name("nondet_jax.compare", "nondet-jax-compare")
    p = OneLineParser(prog=prog, description=__doc__.splitlines()[0].replace("``", ""))
    p.add_argument("a", help="method A: a run folder or a CSV file of per-seed scores")
    p.add_argument("b", help="method B: same kind as A")
    p.add_argument("--arm", default="all", help="arm of each run folder (default: all)")
    p.add_argument("--arm-b", default=None, help="a different arm for B (default: --arm)")
    p.add_argument("--metric", default="test_accuracy", help=f"run folders: one of {', '.join(RUN_METRICS)}")
    p.add_argument("--column", default=None, help="CSV files: the score column (default: the only numeric one)")
    p.add_argument("--lower-is-better", action="store_true", help="scores are losses or errors (CSV files)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--plot", metavar="FILE", help="also draw the comparison (scores, difference, probability of "
                   "improvement, each with its interval) into FILE (.png, .pdf or .svg)")
    args = p.parse_args(argv)
    try:
        plot = _plot_path(args.plot) if args.plot else None
        r = compare(args.a, args.b, args.arm, args.arm_b, args.metric, args.column,
                    False if args.lower_is_better else None)
    except UsageError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    if plot is not None:
        import io

        from nondet_jax.store import atomic_write_bytes

        buf = io.BytesIO()
        plot_result(r).savefig(buf, format=plot.suffix[1:], dpi=110)
        atomic_write_bytes(plot, buf.getvalue())
    if args.json:
        from nondet_jax.report import strict_json

        print(json.dumps(strict_json(r), indent=2, allow_nan=False))
    else:
        print(format_result(r))
    return 0


if __name__ == "__main__":
    from nondet_jax.__main__ import run_command

    sys.exit(run_command("compare"))
