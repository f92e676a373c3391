"""nondet_jax: measure run-to-run variability of neural-network training and attribute it to its sources.

Entry points: ``python -m nondet_jax.sweep`` (a whole study), and the modules
``config``, ``sources`` (the key rule), ``models``, ``data``, ``train`` (single-replica pure
functions), ``replicas`` (strategies), ``store`` (the run folder). See README.md and DESIGN.md.
"""

__version__ = "0.1.0"
