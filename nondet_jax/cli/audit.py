"""``python -m nondet_jax audit``: is training bitwise reproducible on this machine?"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from nondet_jax import config as cfg
from nondet_jax.cli import prog_name
from nondet_jax.errors import OneLineParser, UsageError
from nondet_jax.machine.determinism import check_flags
from nondet_jax.store.io import check_output_file, check_path_name
from nondet_jax.study.processes import AUDIT_CHILD, require_child, run_child


def audit_in_child(args: list[str], flags) -> dict:
    """Run the audit in a child process whose XLA_FLAGS carry ``flags``; return its result (the last line
    of its standard output: no temporary file, so a parent killed meanwhile leaves nothing behind)."""
    check_flags(flags)
    proc = run_child("nondet_jax", ["audit", *args, "--child-json"], flags, AUDIT_CHILD, "the audit's child process",
                     capture=True)
    lines = proc.stdout.strip().splitlines()
    if not lines:
        raise RuntimeError("the audit's child process printed no result; rerun the audit with --no-child")
    return json.loads(lines[-1])


def format_run(title: str, run: dict) -> str:
    lines = [f"{title}: backend {run['backend']}, XLA_FLAGS '{run['xla_flags']}', {run['steps']} steps"
             + (f", second run perturbed by {run['perturb']}" if run["perturb"] else ""),
             f"  {'tensor':<48} {'elements':>9} {'differ':>8} {'max ulp':>10}"]
    for name, t in run["tensors"].items():
        lines.append(f"  {name:<48} {t['elements']:>9} {t['differ']:>8} {t['max_ulp']:>10}")
    verdict = "bitwise identical" if run["bitwise_identical"] else f"{run['differ']} of {run['elements']} elements differ"
    if run["perturb"]:  # the second run was changed on purpose: differences are what it measures
        lines.append(f"  => {verdict}, as expected: the second run was perturbed ({run['perturb']}), so this "
                     "measures how far one such change moves the weights, not whether training repeats")
    else:
        lines.append(f"  => {verdict}; declared deterministic: {run['declared_deterministic']}")
    return "\n".join(lines)


def failed(run: dict) -> bool:
    """A run declared deterministic that is not (perturbed runs are meant to differ)."""
    return run["declared_deterministic"] and not run["perturb"] and not run["bitwise_identical"]


def main(argv: list[str] | None = None, prog: str | None = None) -> int:

    prog = prog or prog_name("nondet_jax audit", "nondet-jax-audit")
    p = OneLineParser(prog=prog, description=__doc__.splitlines()[0].replace("``", ""))
    p.add_argument("--steps", type=int, default=5, help="training steps per run (default 5)")
    p.add_argument("--model", default="resnet8", help="a catalogue model or your own, PACKAGE.MODULE:ATTR")
    p.add_argument("--dataset", default="digits")
    p.add_argument("--data-dir")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--perturb", choices=["batch_order"], help="perturb the second run's reduction order")
    p.add_argument("--json", help="write the result here")
    p.add_argument("--no-child", action="store_true", help="skip the run with determinism flags on")
    p.add_argument("--child-json", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    raw = list(argv if argv is not None else sys.argv[1:])
    try:
        if args.steps < 1:
            raise UsageError(f"--steps must be >= 1, got {args.steps}")
        if args.json:
            check_path_name(Path(args.json), "--json")
            if Path(args.json).is_dir() or not Path(args.json).parent.is_dir():
                what = "is a folder" if Path(args.json).is_dir() else "is in a folder that does not exist"
                raise UsageError(f"--json {args.json} {what}; pass a file path in an existing folder, e.g. "
                                 "--json audit.json")
            check_output_file(Path(args.json), "--json")  # a link, device or FIFO there is never replaced
        config = cfg.from_flat({"model.name": args.model, "data.name": args.dataset, "data.data_dir": args.data_dir,
                                "train.batch_size": args.batch_size, "train.epochs": 1, "study.seed": args.seed,
                                "study.replicas": 1, "metrics.pairwise": False})
        from nondet_jax.study.audit import audit_run  # JAX: once the arguments and the config are good

        if args.child_json:
            require_child(AUDIT_CHILD, "--child-json is internal: the audit starts such a process itself")
            print(json.dumps(audit_run(config, args.steps, args.perturb)))
            return 0
        from nondet_jax.machine.determinism import DETERMINISM_ON

        runs = {"current flags": audit_run(config, args.steps, args.perturb)}
        if not args.no_child:
            child_args = [a for a in raw if a not in ("--no-child",)]
            if "--json" in child_args:
                i = child_args.index("--json")
                del child_args[i:i + 2]
            runs["determinism flags on (child process)"] = audit_in_child(child_args, DETERMINISM_ON)
        for title, run in runs.items():
            print(format_run(title, run))
        if args.json:
            from nondet_jax.store.io import atomic_write_json

            atomic_write_json(Path(args.json), {"runs": runs}, "--json")  # a refused write: one line (store.io.write_error)
    except UsageError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    bad = [t for t, r in runs.items() if failed(r)]
    if bad:
        print(f"NOT DETERMINISTIC although declared so: {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    from nondet_jax.cli import run_command

    sys.exit(run_command("audit"))
