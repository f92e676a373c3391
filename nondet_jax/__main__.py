"""``python -m nondet_jax COMMAND ...`` (console script ``nondet-jax``): one entry for every command.

Commands: ``sweep`` (train a study), ``report`` (rebuild a run folder's report), ``audit`` (is
training bitwise reproducible here?), and ``compare`` when the installed version has it.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

COMMANDS = {"sweep": "train R replicas per arm and write a run folder (the default study: no arguments)",
            "report": "rebuild the report of a run folder from its stored results",
            "audit": "is training bitwise reproducible on this machine? a per-tensor answer",
            "compare": "compare two studies or methods"}


def prog_name(module: str, script: str) -> str:
    """How the user called a command, for usage lines: the console script's name, else ``python -m module``."""
    return script if os.path.basename(sys.argv[0] or "") == script else f"python -m {module}"


def available() -> dict[str, str]:
    # compare is written separately: offered only where its module is installed (imported lazily).
    return {c: h for c, h in COMMANDS.items() if importlib.util.find_spec(f"nondet_jax.{c}") is not None}


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
    return importlib.import_module(f"nondet_jax.{command}").main(rest, prog=f"{prog} {command}")


if __name__ == "__main__":
    sys.exit(main())
