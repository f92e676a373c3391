"""``python -m nondet_jax.report RUN``, the module path users type; the command is :mod:`nondet_jax.cli.report`."""

import sys

from nondet_jax.cli import run_command

sys.exit(run_command("report"))
