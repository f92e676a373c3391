"""Cockpit's instruments (Schneider et al. 2021) in JAX: jitted, per replica, cheap.

* :func:`make` builds a pure ``(init, update)`` pair (:mod:`.core`, with a runnable example);
* :mod:`.configurations`: quantity names and Cockpit's ``economy`` / ``business`` / ``full``;
* :mod:`.schedules`: :func:`linear` (every k steps) and :func:`logarithmic`;
* :mod:`.per_example`: chunked per-example gradients by ``vmap(grad)`` (and the BatchNorm convention);
  :mod:`.layerwise`: the same sums from one batched backward pass for flax Conv/Dense/BatchNorm models;
* :mod:`.curvature`: Hessian-vector products, Lanczos, Hutchinson; :mod:`.formulas`: the tests,
  alpha, TIC, GSNR, EB criterion, CABS; :mod:`.histograms`;
* :mod:`.trainer`: the adaptor ``nondet_jax.train`` uses; :mod:`.dashboard`: the figure and tidy rows.
"""

from nondet_jax.instruments.configurations import CONFIGURATIONS, QUANTITIES, resolve
from nondet_jax.instruments.core import Instruments, InstrumentState, layer_names, make
from nondet_jax.instruments.schedules import linear, log_over_run, logarithmic

__all__ = ["CONFIGURATIONS", "QUANTITIES", "InstrumentState", "Instruments", "layer_names", "linear", "log_over_run",
           "logarithmic", "make", "resolve"]
