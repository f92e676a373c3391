"""``python -m nondet_jax report RUN``: rebuild a run folder's report from its stored results."""

from __future__ import annotations

import sys
from pathlib import Path

from nondet_jax.cli import prog_name
from nondet_jax.errors import OneLineParser, UsageError
from nondet_jax.store.paths import RunPaths


def main(argv: list[str] | None = None, prog: str | None = None) -> int:

    prog = prog or prog_name("nondet_jax.report", "nondet-jax-report")

    p = OneLineParser(prog=prog,
                                description="Rebuild the report of a run folder from its stored results.")
    p.add_argument("run_dir")
    p.add_argument("--tensorboard", action="store_true",
                   help="also write TensorBoard event files, one run per replica, into RUN_DIR/tensorboard "
                        "(needs tensorboardX: pip install \"nondet_jax[tensorboard]\")")
    args = p.parse_args(argv)
    try:
        run = Path(args.run_dir)
        if RunPaths(run).methods_json.is_file() and not RunPaths(run).config.exists():
            from nondet_jax.study.methods import method_fix

            try:
                return _methods(run, args, prog)
            except UsageError as e:  # an arm's fix as a study of methods takes it
                raise UsageError(method_fix(str(e))) from None
        if not RunPaths(run).config.is_file():
            raise UsageError(f"{run} is not a nondet_jax run folder (no config.json); pass the --out folder of a sweep")
        paths = RunPaths(run)
        lost = [p.name for p in (paths.model, paths.environment, paths.test_labels) if not p.exists()]
        from nondet_jax.study.prepare import holds_results

        if lost and holds_results(paths):  # the report's text, figures and tables read them
            raise UsageError(f"{run} lacks {', '.join(lost)}; rerun the sweep command that made it (command.txt), "
                             f"which writes {'it' if len(lost) == 1 else 'them'} again without retraining a finished arm")
        from nondet_jax.report.markdown import write_report  # JAX and scipy: once the folder is a run folder
        from nondet_jax.store.run import release_lock, take_lock

        fd = take_lock(run, "wait for it to finish, then rebuild the report")  # never half a sweep's results
        try:
            summary = write_report(args.run_dir)
        finally:
            release_lock(fd)
        if args.tensorboard:
            from nondet_jax.report.tensorboard import export_run

            print(f"tensorboard: {export_run(args.run_dir, list(summary['arms']))}")
    except UsageError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    from nondet_jax.report.summary import format_table

    print(format_table(summary))
    print(f"report: {RunPaths(args.run_dir).report}")
    return 0


def _methods(run: Path, args, prog: str) -> int:
    """A study of methods: each finished method's report rebuilt, then the report across methods."""
    from nondet_jax.analysis.methods import finished
    from nondet_jax.report.markdown import write_report
    from nondet_jax.report.methods import write_methods_report
    from nondet_jax.store.io import check_no_links
    from nondet_jax.store.run import release_lock, take_lock

    if args.tensorboard:
        raise UsageError(f"--tensorboard exports one run folder; pass a method's folder {run}/methods/NAME")
    check_no_links(run)  # a method's folder a link to one outside: its report was written there
    for name in finished(run):
        folder = RunPaths(run).method(name)
        fd = take_lock(folder, "wait for it to finish, then rebuild the report")
        try:
            write_report(folder)
        finally:
            release_lock(fd)
    write_methods_report(run)
    return 0


if __name__ == "__main__":
    from nondet_jax.cli import run_command

    sys.exit(run_command("report"))
