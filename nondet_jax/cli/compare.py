"""``python -m nondet_jax compare A B``: the command line of :mod:`nondet_jax.analysis.arm.compare`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from nondet_jax.analysis.task import RUN_METRICS
from nondet_jax.cli import prog_name
from nondet_jax.errors import OneLineParser, UsageError
from nondet_jax.store.io import check_output_file, check_path_name
from nondet_jax.store.paths import RunPaths


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


def _sequential(args, state: dict) -> int:
    """A sequential study of methods: the answers of its last look (a fixed-sample p on the replicas it stopped at
    would read its data as if no look had decided when to stop, and could contradict the study's answer)."""
    from nondet_jax.analysis.sequential import look_lines

    if args.method_a or args.method_b or args.arm or args.metric is not None or args.detect or args.plot:
        raise UsageError(f"{args.a} is a sequential study (--until {state['design']['spec']}): its answers are its "
                         "looks', which compare prints whole; drop --method-a, --method-b, --arm, --metric, --detect "
                         "and --plot")
    looks = state["looks"]
    if looks and looks[-1]["stop"]:  # the files its answers were read from, checked as the sweep and report do
        from nondet_jax.analysis.methods import compare_methods
        from nondet_jax.study.methods import method_fix

        try:
            compare_methods(args.a)
        except UsageError as e:
            raise UsageError(method_fix(str(e))) from None
    if args.json:
        print(json.dumps({"sequential": state["design"]["spec"], "looks": looks}, indent=2))
        return 0
    if not looks:
        print(f"{args.a}: a sequential study (--until {state['design']['spec']}) with no look yet; rerun its command "
              "to go on")
        return 0
    last = looks[-1]
    print(f"{args.a}: a sequential study (--until {state['design']['spec']}, looks at "
          f"{', '.join(str(k['replicas']) for k in looks)} replicas per method); its answers at the last look"
          + ("" if last["stop"] else " (not stopped yet: rerun its command to go on)") + ":")
    print("\n".join(look_lines(last)))
    print("(intervals at each look's level; a fixed-sample test on the replicas it stopped at is not this design's "
          "answer: python -m nondet_jax report shows every look)")
    return 0


def _sequential_root(folder) -> tuple[Path, str] | None:
    """The sequential study (its folder and ``--until`` spec) whose method run folder ``folder`` is
    (``ROOT/methods/NAME`` beside a ``methods.json`` with ``until``), else None."""
    from nondet_jax.analysis.methods import read_record

    folder = Path(folder)
    root = folder.parent.parent
    if folder.parent.name != "methods" or not RunPaths(root).methods_json.is_file():
        return None
    try:
        record = read_record(root)
    except UsageError:  # a damaged record: compare ROOT names it
        return None
    state = record.get("until")
    return (root, state["design"]["spec"]) if state is not None and folder.name in record["methods"] else None


def _sequential_notes(folders) -> list[str]:
    """A note per sequential study whose methods' run folders were compared: its looks decided how many replicas
    they trained, which a fixed-sample test reads as if fixed in advance; its answers are its looks'."""
    found: dict = {}
    for f in folders:
        hit = _sequential_root(f)
        if hit is not None:
            found.setdefault(hit, []).append(Path(f).name)
    return [f"note: {' and '.join(names)} {'are methods' if len(names) > 1 else 'is a method'} of the sequential study "
            f"{root} (--until {spec}), whose looks decided how many replicas they trained; this test reads them as if "
            f"their number had been fixed in advance. The study's answers: python -m nondet_jax compare {root}"
            for (root, spec), names in found.items()]


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
    p.add_argument("--metric", help="run folders: one of " + "; ".join(f"{', '.join(m)} ({task})" for task, m in
                                                              RUN_METRICS.items()) + " (default: the first of its task)")
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
            from nondet_jax.analysis.methods import compare_methods, read_record

            if args.column or args.arm_b or args.lower_is_better:
                raise UsageError("--column, --arm-b and --lower-is-better are not for a study of methods; choose "
                                 "--arm, --metric, --method-a and --method-b")
            state = read_record(args.a).get("until")
            if state is not None:  # its answers are its looks', not a fixed-sample test's on the replicas it stopped at
                return _sequential(args, state)
            from nondet_jax.study.methods import method_fix

            try:
                results = compare_methods(args.a, args.method_a, args.method_b, arms=_names(args.arm, "--arm"),
                                          metric=args.metric, detect=args.detect)
            except UsageError as e:  # an arm's fix as a study of methods takes it
                raise UsageError(method_fix(str(e))) from None
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
    for note in [] if methods else _sequential_notes(f for f in (args.a, args.b) if Path(f).is_dir()):
        # beside the result, never inside --json's
        print(note, file=sys.stderr if args.json else sys.stdout)
    return 0


if __name__ == "__main__":
    from nondet_jax.cli import run_command

    sys.exit(run_command("compare"))
