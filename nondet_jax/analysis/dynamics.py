"""Divergence dynamics: how fast two replicas that differ in one source drift apart.

:mod:`nondet_jax.replicas.watch` measures replicas 0 and 1 of an arm while they train (their relative weight
distance ``||θ0 − θ1|| / ||θ0||`` and the disagreement of their predictions, every k steps);
:func:`fit_growth_rate` fits the early exponential growth of the distance (a Lyapunov-like exponent, per step)
with its standard error.

Example::

    fit_growth_rate(trace["step"], trace["weight_distance"])   # {"rate_per_step": ..., "stderr": ...}
"""

from __future__ import annotations

import numpy as np


def fit_growth_rate(step, distance, saturation: float = 0.5) -> dict:
    """Fit ``log d = log d0 + λ t`` over the early growth phase; λ per step with its standard error.

    The window runs from the first positive distance to the first point that reaches
    ``saturation`` × the largest distance (after that, growth slows and log-linearity fails).
    Returns rate_per_step, stderr, window (first and last step used) and points; NaN rate when
    fewer than 3 points qualify.
    """
    t, d = np.asarray(step, np.float64), np.asarray(distance, np.float64)
    ok = np.isfinite(d) & (d > 0)
    t, d = t[ok], d[ok]
    nan = {"rate_per_step": float("nan"), "stderr": float("nan"), "window": [None, None], "points": int(len(t))}
    if len(t) < 3:
        return nan
    stop = int(np.argmax(d >= saturation * d.max()))
    t, y = t[: stop + 1], np.log(d[: stop + 1])
    if len(t) < 3:  # already saturated from the start (e.g. different initial weights): no growth phase
        return {**nan, "points": int(len(t))}
    slope, intercept = np.polyfit(t, y, 1)
    resid = y - (slope * t + intercept)
    se = float(np.sqrt(resid @ resid / (len(t) - 2) / ((t - t.mean()) ** 2).sum()))
    return {"rate_per_step": float(slope), "stderr": se, "window": [float(t[0]), float(t[-1])], "points": int(len(t))}
