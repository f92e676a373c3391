"""``python -m nondet_jax COMMAND ...`` (console script ``nondet-jax``) and the per-command console
scripts; the commands live in :mod:`nondet_jax.cli`."""

from __future__ import annotations

import sys

from nondet_jax.cli import main, run_command


def sweep() -> int:  # console scripts: nondet-jax-sweep, nondet-jax-report, nondet-jax-audit, nondet-jax-compare
    return run_command("sweep")


def report() -> int:
    return run_command("report")


def audit() -> int:
    return run_command("audit")


def compare() -> int:
    return run_command("compare")


__all__ = ["main", "run_command", "sweep", "report", "audit", "compare"]

if __name__ == "__main__":
    sys.exit(main())
