"""``python -m nondet_jax compare A B``: the command line of :mod:`nondet_jax.analysis.arm.compare`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from nondet_jax.cli import prog_name
from nondet_jax.errors import OneLineParser, UsageError
from nondet_jax.store.io import check_output_file, check_path_name
from nondet_jax.store.paths import RUN_METRICS, RunPaths


def _plot_path(path: str) -> Path:
    """``--plot FILE``, checked before anything is computed."""
    path = Path(path)
    check_path_name(path, "--plot")
    if path.suffix.lower() not in (".png", ".pdf", ".svg"):
        raise UsageError(f"--plot {path}: name a .png, .pdf or .svg file")
    if not path.parent.is_dir():
        raise UsageError(f"--plot {path}: folder {path.parent} does not exist; create it or choose another path")
    check_output_file(path, "--plot")
    return path


def _names(value: str | None, option: str) -> list[str] | None:
    """``--arm``/``--column``: one name or several, comma-separated."""
    if value is None:
        return None
    names = [v.strip() for v in value.split(",")]
    if not all(names):
        raise UsageError(f"{option} {value!r} has an empty name; separate names with single commas")
    return names


def main(argv: list[str] | None = None, prog: str | None = None) -> int:

    prog = prog or prog_name("nondet_jax compare", "nondet-jax-compare")
    p = OneLineParser(prog=prog, description=__doc__.splitlines()[0].replace("``", ""))
    p.add_argument("a", help="method A: a run folder or a CSV file of per-seed scores; or a study of methods (a "
                   "sweep's --out with --method), alone: each method against its baseline, paired by seed")
    p.add_argument("b", nargs="?", help="method B: same kind as A")
    p.add_argument("--method-a", help="a study of methods: the method compared with (default: its baseline)")
    p.add_argument("--method-b", help="a study of methods: the one method compared with --method-a (default: every "
                   "other method, p-values also Holm-adjusted over them)")
    p.add_argument("--arm", default=None, help="arm of each run folder (default: all; a study of methods: every arm "
                   "whose replicas vary); several, comma-separated "
                   "(init,data_order,all): each compared, p-values also Holm-adjusted over them")
    p.add_argument("--arm-b", default=None, help="a different arm for B (default: --arm)")
    p.add_argument("--metric", default="test_accuracy", help=f"run folders: one of {', '.join(RUN_METRICS)}")
    p.add_argument("--column", default=None, help="CSV files: the score column (default: the only numeric one); "
                   "several, comma-separated: each compared, p-values also Holm-adjusted over them")
    p.add_argument("--lower-is-better", action="store_true", help="scores are losses or errors (CSV files)")
    p.add_argument("--detect", type=float, default=None, metavar="D",
                   help="also give the replicas per method for 80%% power at a difference D (the scores' units)")
    p.add_argument("--paired", action="store_true",
                   help="the methods ran under the same seeds: compare seed by seed (run folders: replica r with "
                        "replica r, same --seed; CSV files: by their seed/replica/run/index column, else row by row)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--plot", metavar="FILE", help="also draw the comparison (scores, difference, probability of "
                   "improvement, each with its interval) into FILE (.png, .pdf or .svg)")
    args = p.parse_args(argv)
    try:
        plot = _plot_path(args.plot) if args.plot else None
        arms, columns = _names(args.arm or "all", "--arm"), _names(args.column, "--column")
        if plot is not None and max(len(arms or []), len(columns or [])) > 1:
            raise UsageError("--plot draws one comparison; give one --arm or --column with it")
        methods = RunPaths(args.a).methods_json.is_file() and not RunPaths(args.a).config.exists()
        if methods and args.b is not None:
            raise UsageError(f"{args.a} is a study of methods: compare its methods with --method-a/--method-b, not "
                             f"with a second folder ({args.b})")
        if not methods and args.b is None:
            raise UsageError(f"compare takes two run folders or two CSV files (A B), or one study of methods; {args.a} "
                             "alone is not a study of methods (no methods.json): add B")
        if not methods and (args.method_a or args.method_b):
            raise UsageError(f"--method-a/--method-b pick methods of one study of methods, and {args.a} is none (no "
                             "methods.json); drop them to compare A with B")
        from nondet_jax.analysis.compare import compare_many, format_many  # scipy: once the arguments are good

        if methods:
            from nondet_jax.analysis.methods import compare_methods

            if args.column or args.arm_b or args.lower_is_better:
                raise UsageError("--column, --arm-b and --lower-is-better are not for a study of methods; choose "
                                 "--arm, --metric, --method-a and --method-b")
            results = compare_methods(args.a, args.method_a, args.method_b, arms=_names(args.arm, "--arm"),
                                      metric=args.metric, detect=args.detect)
            if plot is not None and len(results) > 1:
                raise UsageError("--plot draws one comparison; name --method-b and one --arm with it")
        else:
            results = compare_many(args.a, args.b, arms=arms, columns=columns, arm_b=args.arm_b, metric=args.metric,
                                   higher_is_better=False if args.lower_is_better else None, detect=args.detect,
                                   paired=args.paired)
        r = results[0]
        if plot is not None:
            import io

            from nondet_jax.report.compare_figure import plot_result
            from nondet_jax.store.io import atomic_write_bytes

            buf = io.BytesIO()
            plot_result(r).savefig(buf, format=plot.suffix[1:], dpi=110)
            atomic_write_bytes(plot, buf.getvalue(), "--plot")  # a refused write: one line
    except UsageError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        from nondet_jax.store.io import strict_json

        out = r if len(results) == 1 else {"comparisons": results, "holm_family": len(results)}
        print(json.dumps(strict_json(out), indent=2, allow_nan=False))
    else:
        print(format_many(results))
    return 0


if __name__ == "__main__":
    from nondet_jax.cli import run_command

    sys.exit(run_command("compare"))
