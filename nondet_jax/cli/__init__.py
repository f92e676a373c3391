"""The command line: one entry for every command, argument parsing and exit codes; each command
(:mod:`~nondet_jax.cli.sweep`, :mod:`~nondet_jax.cli.report`, :mod:`~nondet_jax.cli.audit`,
:mod:`~nondet_jax.cli.compare`) calls the layers below.

Commands: ``sweep`` (train a study), ``report`` (rebuild a run folder's report), ``audit`` (is
training bitwise reproducible here?), and ``compare`` when the installed version has it.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

from nondet_jax.machine import signals

COMMANDS = {"sweep": "train R replicas per arm and write a run folder (the default study: no arguments)",
            "report": "rebuild the report of a run folder from its stored results",
            "audit": "is training bitwise reproducible on this machine? a per-tensor answer",
            "compare": "compare two studies or methods"}


def prog_name(module: str, script: str) -> str:
    """How the user called a command, for usage lines: the console script's name, else ``python -m module``."""
    return script if os.path.basename(sys.argv[0] or "") == script else f"python -m {module}"


def available() -> dict[str, str]:
    # compare is written separately: offered only where its module is installed (imported lazily).
    return {c: h for c, h in COMMANDS.items() if importlib.util.find_spec(f"nondet_jax.cli.{c}") is not None}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    prog = prog_name("nondet_jax", "nondet-jax")
    commands = available()
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: {prog} COMMAND [options]   ({prog} COMMAND --help for each)\n\ncommands:")
        for c, h in commands.items():
            print(f"  {c:<8} {h}")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in commands:
        print(f"{prog}: error: unknown command '{command}'; choose one of: {', '.join(commands)}", file=sys.stderr)
        return 2
    return run_command(command, rest, f"{prog} {command}")


INTERRUPTED = {"sweep": None,  # signals.MESSAGE: finished arms are kept, rerun to resume
               "report": "interrupted: rerun the same command to rebuild the report",
               "audit": "interrupted: nothing was written; rerun the same command",
               "compare": "interrupted: nothing was written; rerun the same command"}


def sweep_entry() -> int:
    """``python -m nondet_jax.sweep``: in a child training one arm, leave when the parent sweep does. Nothing
    heavier than this package's ``cli`` is imported before :func:`run_command` installs the signal handlers."""
    if os.environ.get(signals.CHILD_ENV) == "1":
        signals.die_with_parent()  # a child training an arm leaves when its sweep does
    return run_command("sweep")


def run_command(command: str, argv: list[str] | None = None, prog: str | None = None) -> int:
    """Run a command's ``main`` with SIGINT/SIGTERM handled (one line, exit 130/143, even while XLA
    compiles; see :mod:`nondet_jax.machine.signals`)."""
    child = os.environ.get(signals.CHILD_ENV) == "1"  # an arm's child process: its parent says it
    signals.install(None if child else INTERRUPTED.get(command) or signals.MESSAGE)
    module = importlib.import_module(f"nondet_jax.cli.{command}")
    try:
        return module.main(argv, prog=prog) if prog else module.main(argv)
    except BrokenPipeError:  # the reader (head, less) closed the pipe: no traceback (Python's signal docs)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except Exception:
        problem = backend_problem()  # after the failure: the backend must start under the command's XLA flags
        if problem is None:
            raise
        module_name = f"nondet_jax.{command}" if command == "sweep" else f"nondet_jax {command}"
        print(f"{prog or prog_name(module_name, f'nondet-jax-{command}')}: error: {problem}", file=sys.stderr)
        return 2


def backend_problem() -> str | None:
    """Why the backend ``JAX_PLATFORMS`` asks for cannot start (``cuda`` without a GPU or without
    jax[cuda]; JAX raises an AssertionError from deep inside the first computation), as one line;
    None when it starts or the variable is unset (JAX picks what is there)."""
    asked = os.environ.get("JAX_PLATFORMS", "")
    if not asked or "jax" not in sys.modules:
        return None
    import jax

    try:
        jax.devices()
    except Exception as e:  # noqa: BLE001 (JAX raises RuntimeError, or AssertionError from its backend table)
        said = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return (f"JAX_PLATFORMS={asked} but JAX could not start that backend ({said}); install the matching jax "
                "package (e.g. pip install 'jax[cuda12]') on a machine with that device, or unset JAX_PLATFORMS")
    return None
