"""Cockpit's instruments (Schneider et al. 2021) in JAX: jitted, per replica, cheap.

* :func:`make` builds a pure ``(init, update)`` pair (:mod:`.core`, with a runnable example): one shared
  pass per tracked step, then every quantity's record (:mod:`.quantities`: what it needs, its compute);
* :mod:`.configurations`: quantity names and Cockpit's ``economy`` / ``business`` / ``full``;
* :mod:`.schedules`: :func:`linear` (every k steps) and :func:`logarithmic`;
* :mod:`.per_example`: chunked per-example gradients by ``vmap(grad)`` (and the BatchNorm convention);
  :mod:`.layerwise`: the same sums from one batched backward pass for flax Conv/Dense/BatchNorm models;
* :mod:`.curvature`: Hessian-vector products, Lanczos, Hutchinson; :mod:`.formulas`: the tests,
  alpha, TIC, GSNR, EB criterion, CABS; :mod:`.histograms`;
* :mod:`.trainer`: instruments for a model; :mod:`.epoch`: the instrumented epoch, the one entry point
  ``nondet_jax.train`` uses; :mod:`.dashboard`: the figure and tidy rows.
"""


from __future__ import annotations

import importlib

# Loaded on first use: the config checks instrument names (configurations, no JAX) before a command starts JAX.
_LAZY = {"CONFIGURATIONS": "configurations", "QUANTITIES": "configurations", "resolve": "configurations",
         "Instruments": "core", "InstrumentState": "core", "layer_names": "core", "make": "core",
         "linear": "schedules", "log_over_run": "schedules", "logarithmic": "schedules"}
__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"nondet_jax.instruments.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'nondet_jax.instruments' has no attribute {name!r}")


def __dir__() -> list[str]:
    return __all__
