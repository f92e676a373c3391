"""nondet_jax: measure run-to-run variability of neural-network training and attribute it to its sources.

Three ways in (``import nondet_jax as nj``; see docs/api.md):

* ``nj.run_study(model=, data=, optimizer=, loss=, augment=, ...)``: a whole study on your own parts;
* ``nj.replicate(init, step, ...)``: your own single-replica functions, R replicas per arm;
* ``nj.metrics`` and ``nj.stats``: diversity metrics and statistics on arrays you already have.

The command line reaches the same study core: ``python -m nondet_jax sweep`` (``--help``).
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_API = {"run_study": "nondet_jax.api", "replicate": "nondet_jax.api", "decompose": "nondet_jax.api", "StudyResult": "nondet_jax.api",
        "MethodsResult": "nondet_jax.api",
        "Parts": "nondet_jax.models.parts", "Config": "nondet_jax.config", "UsageError": "nondet_jax.errors",
        "steps_per_epoch": "nondet_jax.train", "load_params": "nondet_jax.models.pretrained"}
__all__ = [*_API, "metrics", "stats"]


def __getattr__(name: str):
    # Imported on first use: ``import nondet_jax`` itself stays light (no JAX until a name is used).
    if name in _API:
        return getattr(importlib.import_module(_API[name]), name)
    if name in ("metrics", "stats"):
        return importlib.import_module(f"nondet_jax.analysis.{name}")
    raise AttributeError(f"module 'nondet_jax' has no attribute {name!r}")


def __dir__() -> list[str]:
    # the names imported on first use, so that dir() and tab completion (IPython, Jupyter) show the API
    return sorted({*globals(), *__all__})
