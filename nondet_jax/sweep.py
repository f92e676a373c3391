"""``python -m nondet_jax.sweep``, the module path users type; the command is :mod:`nondet_jax.cli.sweep`.

Only :mod:`nondet_jax.cli` (the standard library and the signal handlers) is imported here: the handlers
go in before the command's own module (numpy, PyYAML, then JAX) is imported, so Ctrl-C at any moment
from the first import prints one line and exits 130 (it used to print a KeyboardInterrupt traceback
while ``nondet_jax.cli.sweep`` was still being imported).
"""

import sys

if __name__ == "__main__":
    from nondet_jax.cli import sweep_entry

    sys.exit(sweep_entry())
