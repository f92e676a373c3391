"""Cockpit's formulas, as pure functions of the shared per-step statistics.

Notation: ``B`` batch size, ``g_i`` the gradient of example ``i``'s loss, ``g = (1/B) sum_i g_i``.
Cockpit receives BackPACK's ``g_i / B`` and rescales; these functions take the unscaled sums.
Variances that rounding can push below zero are clipped at zero before square roots (a NaN would
read as "not tracked").
"""

from __future__ import annotations

import jax.numpy as jnp


def norm_test(b, sum_sq_norm, g_sq):
    """Byrd et al. (2012), eq. 3.9: the largest theta for which the norm test passes."""
    var_l1 = jnp.maximum(sum_sq_norm - b * g_sq, 0) / (b - 1)
    return jnp.sqrt(var_l1 / b / g_sq)


def inner_test(b, projections, g_sq):
    """Bollapragada et al. (2017), eq. 2.6; ``projections[i] = g_i . g``."""
    var = jnp.maximum(jnp.sum(projections ** 2) - b * g_sq ** 2, 0) / (b - 1)
    return jnp.sqrt(var / b / g_sq ** 2)


def ortho_test(b, sum_sq_norm, projections, g_sq):
    """Bollapragada et al. (2017), eq. 3.3: the largest nu for which the orthogonality test passes."""
    var = jnp.maximum(sum_sq_norm - jnp.sum(projections ** 2) / g_sq, 0) / (b - 1)
    return jnp.sqrt(var / b / g_sq)


def mean_gsnr(b, grad_sq_elem, sum_grad_sq_elem, eps=1e-5):
    """Liu et al. (2020): mean over parameters of g^2 / (mean_i g_i^2 - g^2 + eps)."""
    return jnp.mean(grad_sq_elem / (sum_grad_sq_elem / b - grad_sq_elem + eps))


def early_stopping(b, grad_sq_elem, sum_grad_sq_elem, eps=1e-5):
    """Mahsereci et al. (2017), eq. 7 (left-hand side): training should stop once it exceeds 0."""
    diag_var = (sum_grad_sq_elem - b * grad_sq_elem) / (b - 1)
    return 1 - b * jnp.mean(grad_sq_elem / (diag_var + eps))


def cabs(b, lr, grad_sq_elem, sum_grad_sq_elem, loss):
    """Balles et al. (2017), eq. 22: the batch size CABS suggests."""
    return lr * jnp.sum(sum_grad_sq_elem - b * grad_sq_elem) / (b * loss)


def tic_diag(b, sum_grad_sq_elem, diag_curv, eps=1e-7):
    """Thomas et al. (2019): sum_j (mean_i g_ij^2) / (H_jj + eps)."""
    return jnp.sum(sum_grad_sq_elem / b / (diag_curv + eps))


def tic_trace(b, sum_grad_sq_total, trace_curv, eps=1e-7):
    """Thomas et al. (2019): sum_j mean_i g_ij^2 / (tr H + eps)."""
    return sum_grad_sq_total / b / (trace_curv + eps)


def alpha(t, fs, dfs, var_fs, var_dfs, eps=1e-10):
    """Cockpit's normalised step length from a noise-weighted quadratic fit along the step.

    Observations: losses ``fs`` and directional derivatives ``dfs`` (per unit length) at 0 and at
    ``t`` = the step's length, with variances. ``alpha = 2 t / alpha_bar - 1`` where ``alpha_bar`` is
    where the fitted parabola returns to its value at 0: -1 = no progress, 0 = step to the
    minimum, 1 = step to the other side; -1 also when the fit is concave or ``t`` is 0 (Cockpit).
    """
    # Fit in the coordinate s = x / t in [0, 1] (same alpha, better conditioned): derivatives scale by t.
    f0, f1 = fs
    d0, d1 = dfs[0] * t, dfs[1] * t
    var = jnp.stack([var_fs[0], var_fs[1], var_dfs[0] * t ** 2, var_dfs[1] * t ** 2])
    var = jnp.where(var == 0, eps, var)
    phi = jnp.array([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.0, 1.0, 2.0]], var.dtype)
    w = 1.0 / jnp.sqrt(var)
    mu = jnp.linalg.lstsq(phi * w[:, None], jnp.stack([f0, f1, d0, d1]) * w)[0]
    # alpha_bar in s units = -mu1 / mu2; in x units times t, so 2 t / alpha_bar - 1 = -2 mu2 / mu1 - 1.
    value = -2.0 * mu[2] / mu[1] - 1.0
    return jnp.where((mu[2] < 0) | (t == 0), -1.0, value)
