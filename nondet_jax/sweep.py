"""``python -m nondet_jax.sweep``, the module path users type; the command is :mod:`nondet_jax.cli.sweep`."""

import sys

if __name__ == "__main__":
    from nondet_jax.cli.sweep import entry

    sys.exit(entry())
