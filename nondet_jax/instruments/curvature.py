"""Curvature from Hessian-vector products (forward-over-reverse: ``jvp`` of ``grad``).

* :func:`hvp_operator`: linearise ``grad(loss)`` once; each product then reuses the stored
  forward/backward residuals.
* :func:`lanczos_top`: largest
  (algebraic) Hessian eigenvalue by at most ``k`` Lanczos steps with full reorthogonalisation
  (memory ``k x P``), optionally warm-started from the previous top eigenvector, with its relative
  residual ``||Hv - lambda v|| / |lambda|`` and an optional tolerance to stop early. Cockpit uses power iteration (up to 100 products); Lanczos reaches the extreme
  eigenvalue in far fewer products and, unlike power iteration, finds the largest *algebraic*
  eigenvalue even when a negative one has larger magnitude.
* :func:`ggn_diagonal`: the exact diagonal of the generalised Gauss-Newton matrix
  ``G = (1/B) sum_i J_i^T H_i J_i`` (``J_i`` the Jacobian of example ``i``'s outputs, ``H_i`` the
  Hessian of the loss in the outputs), which is BackPACK's ``DiagGGNExact``: no estimate, never
  negative. For piecewise-linear networks (ReLU, max-pooling, BatchNorm with fixed statistics) G is
  the Hessian itself, so it equals BackPACK's ``DiagHessian`` that Cockpit's HessTrace and TIC use.
* :func:`hutchinson`: Rademacher probes ``v``: ``E[v . Hv] = tr H`` and ``E[v * Hv] = diag H``
  (Hutchinson 1989; Bekas et al. 2007), per layer, with a standard error of the trace.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree

from nondet_jax.instruments import layerwise
from nondet_jax.instruments.per_example import common_dtype, per_example_pass, vary_like


def hvp_operator(loss: Callable, params) -> Callable:
    """``v -> H v`` for the Hessian of ``loss`` (params -> scalar) at ``params``; ``v`` a params-like tree."""
    _, hvp = jax.linearize(jax.grad(loss), params)
    return hvp


# Lanczos steps a cold start takes at least before ``tol`` may stop it, and the factor on the residual in
# the reported error. With both, the error bound covered the true error in 95.5-100% of 200 random cold
# starts on each spectrum of tests/test_instruments_ghost.py (the bare residual: 92-100%; a cluster of
# three at the top is the hard case).
MIN_STEPS = 20
ERROR_FACTOR = 2.0


class TopEigen(NamedTuple):
    value: jax.Array  # the largest Ritz value: never above the largest eigenvalue
    vector: jax.Array  # its Ritz vector, flat, unit norm
    residual: jax.Array  # ||H v - value v|| / |value|, from the Lanczos relation (no extra product)
    iters: jax.Array  # Hessian-vector products taken
    error: jax.Array  # the bound on (largest eigenvalue - value) >= 0: ERROR_FACTOR x residual x |value| + rounding


def lanczos_top(hvp: Callable, params, key, iters: int, start=None, tol: float | None = None) -> TopEigen:
    """The largest (algebraic) eigenvalue by at most ``iters`` Lanczos steps, full reorthogonalisation.

    ``start``: flat starting vector (e.g. the previous step's Ritz vector: a warm start, which needs
    fewer steps while the Hessian changes slowly); random normal when None or zero. A small random
    part is mixed into a warm start so an eigenvector orthogonal to it is still found.

    ``tol``: stop once the relative residual ``||H v - theta v|| / |theta|`` of the top Ritz pair is
    below it (a ``while_loop``: on XLA:CPU convolutions inside loops take a slow path, so with
    ``tol=None`` the ``iters`` steps run unrolled on CPU instead). The residual is
    ``beta_k |s_k|`` (Lanczos relation ``H V = V T + beta_k v_{k+1} e_k^T``; exact with full
    reorthogonalisation up to rounding): some eigenvalue of H lies within ``residual * |theta|`` of
    ``theta`` (and within ``(residual theta)^2 / gap`` when the gap to the rest of the spectrum is
    ``gap``). It does not prove that eigenvalue is the largest: before the top of the spectrum is
    resolved, theta sits near a lower eigenvalue with a small residual. ``error`` is therefore
    ``ERROR_FACTOR`` times the residual (absolute) plus a rounding floor, and a cold start takes at
    least ``MIN_STEPS`` steps before ``tol`` stops it; the largest eigenvalue lies in
    ``[value, value + error]`` (the Ritz value is a lower bound) in >= 95% of random starts on the
    spectra tested, which is an empirical statement, not a proof. A warm start may stop earlier.
    """
    flat, unravel = ravel_pytree(params)
    n = flat.shape[0]
    k = max(1, min(iters, n))
    dtype = flat.dtype
    v0 = jax.random.normal(key, (n,), dtype)
    if start is not None:
        ok = jnp.vdot(start, start) > 0
        v0 = jnp.where(ok, start / jnp.where(ok, jnp.linalg.norm(start), 1) + 1e-3 / jnp.sqrt(n) * v0, v0)
    v0 = v0 / jnp.linalg.norm(v0)
    tiny = jnp.finfo(dtype).tiny ** 0.5
    # Once the Krylov space is exhausted (a Hessian of rank below ``iters``: a small model or batch), what the
    # reorthogonalisation leaves of H v is rounding noise; normalised, it gave vectors that repeat earlier ones
    # and Ritz values far above the largest eigenvalue. Below this fraction of the largest product seen the
    # process stops there: its Ritz values are then those of an invariant subspace (up to the residual reported).
    breakdown = jnp.finfo(dtype).eps ** 0.5

    def matvec(v):
        return ravel_pytree(hvp(unravel(v)))[0]

    def top(alpha, beta, j):
        """Top Ritz value, eigenvector of T (k,), residual after ``j + 1`` steps (rows > j masked out:
        their diagonal below every used one, so the top eigenpair lies in the used block)."""
        used = jnp.arange(k) <= j
        low = jnp.min(jnp.where(used, alpha, jnp.inf)) - 1 - jnp.max(jnp.where(used, jnp.abs(beta), 0))
        a = jnp.where(used, alpha, low)
        off = jnp.where(jnp.arange(k - 1) < j, beta[:-1], 0)
        tri = jnp.diag(a) + jnp.diag(off, 1) + jnp.diag(off, -1)
        evals, evecs = jnp.linalg.eigh(tri)
        s = evecs[:, -1]
        res = jnp.abs(beta[j] * s[j]) / jnp.maximum(jnp.abs(evals[-1]), tiny)
        return evals[-1], s, res

    def body(j, carry):
        basis, alpha, beta = carry
        v = basis[j]
        w = matvec(v)
        a = jnp.vdot(w, v)
        scale = jnp.maximum(jnp.linalg.norm(w), jnp.maximum(jnp.max(jnp.abs(alpha)), jnp.max(beta)))
        # Full reorthogonalisation, twice (rows not yet filled are zero and drop out).
        w = w - basis.T @ (basis @ w)
        w = w - basis.T @ (basis @ w)
        b = jnp.linalg.norm(w)
        ok = (b > tiny) & (b > breakdown * scale)
        nxt = jnp.where(ok, w / jnp.where(ok, b, 1), 0)  # zero after a breakdown: the later steps add nothing
        basis = basis.at[j + 1].set(nxt, mode="drop")  # the last step's vector is not needed
        return basis, alpha.at[j].set(a), beta.at[j].set(b)

    init = vary_like((jnp.zeros((k, n), dtype).at[0].set(v0), jnp.zeros(k, dtype), jnp.zeros(k, dtype)), params)
    if tol is None:
        # Unrolled on CPU: XLA:CPU runs convolutions inside loops on a slow path (8 products: 6.0 s rolled,
        # 1.3 s unrolled for ResNet-8 at batch 128 on a loaded 2-core CPU).
        unroll = jax.default_backend() == "cpu" and k <= 32
        basis, alpha, beta = jax.lax.fori_loop(0, k, body, init, unroll=unroll)
        last = jnp.asarray(k - 1)
    else:
        cold = jnp.vdot(start, start) == 0 if start is not None else jnp.asarray(True)
        min_steps = jnp.where(cold, min(MIN_STEPS, k), 1)

        def cond(c):
            j, (basis, alpha, beta), res = c
            live = jnp.any(basis[jnp.minimum(j, k - 1)] != 0)  # no breakdown before step j
            return (j < k) & live & ((res > tol) | (j < min_steps))

        def step(c):
            j, carry, _ = c
            carry = body(j, carry)
            return j + 1, carry, top(carry[1], carry[2], j)[2]

        j, (basis, alpha, beta), _ = jax.lax.while_loop(cond, step, (jnp.asarray(0), init,
                                                                      vary_like(jnp.asarray(jnp.inf, dtype), params)))
        last = j - 1
    # The steps after a breakdown (zero basis rows) are left out of T; the basis rows past ``last`` are zero
    # and drop out of the Ritz vector.
    last = jnp.minimum(last, jnp.sum(jnp.any(basis != 0, axis=1)) - 1)
    value, s, res = top(alpha, beta, last)
    scale = jnp.maximum(jnp.abs(value), tiny)
    error = ERROR_FACTOR * res * scale + 4 * jnp.sqrt(n) * jnp.finfo(dtype).eps * scale
    return TopEigen(value, basis.T @ s, res, last + 1, error)


def output_factors(output_loss: Callable, outputs, batch) -> jax.Array:
    """``S_i`` (B, C, C) with ``S_i S_i^T`` the Hessian of ``output_loss(outputs_i, example_i)`` in the
    outputs (its positive part: eigenvalues below zero, from rounding or a non-convex loss, are dropped).
    For softmax cross-entropy that Hessian is ``diag(p) - p p^T``."""
    h = jax.vmap(jax.hessian(output_loss), in_axes=(0, 0))(outputs, batch)
    # on XLA:CPU (jaxlib 0.10.2) a batched eigh in a program that another thread runs at the same time hangs
    # both for good (a study's replica threads, with the GGN curvature on); one matrix per call does not (the
    # HessTrace/TICDiag it feeds moved by about 2e-7 relative, in their last bits)
    w, v = jax.lax.map(jnp.linalg.eigh, h) if jax.default_backend() == "cpu" else jnp.linalg.eigh(h)
    return v * jnp.sqrt(jnp.maximum(w, 0))[:, None, :]


def ggn_diagonal(example_output: Callable, output_loss: Callable, params, batch, context, chunk: int, *,
                 batched_output: Callable | None = None):
    """The exact diagonal of the GGN of the mean loss over ``batch``, as a params-like tree.

    Args:
      example_output: ``(params, example, context) -> (C,)`` outputs of one example (no batch axis).
      output_loss: ``(outputs, example) -> scalar``, so that the example's loss is
        ``output_loss(example_output(params, example, context), example)``.
      batched_output: optional ``(params, batch, context) -> (B, C)``, the same for a whole batch of
        flax linen layers whose examples do not interact: the sums then come from one batched backward
        pass and per-layer products (:mod:`.layerwise`); otherwise ``vmap(grad)`` over chunks.

    ``diag G = (1/B) sum_i sum_c (J_i^T s_ic)^2`` with ``s_ic`` the columns of :func:`output_factors`:
    each ``J_i^T s_ic`` is the gradient of ``s_ic . outputs_i`` (``s_ic`` held fixed), so the sum is
    the element-wise sum of squared gradients over ``B x C`` pseudo-examples, which the per-example
    machinery already computes (memory ``chunk x P``; cost about ``C`` per-example passes, as in BackPACK).
    """
    b = jax.tree.leaves(batch)[0].shape[0]
    if batched_output is not None:
        outputs = batched_output(params, batch, context)
    else:
        outputs = jax.vmap(example_output, in_axes=(None, 0, None))(params, batch, context)
    if outputs.ndim != 2 or outputs.shape[0] != b:
        raise ValueError(f"the outputs must be one vector per example, (batch, classes); got shape {outputs.shape}")
    c = outputs.shape[1]
    factors = jax.lax.stop_gradient(output_factors(output_loss, outputs, batch))
    cotangents = jnp.swapaxes(factors, 1, 2).reshape(b * c, c)  # row i*C + k: column k of S_i
    repeated = jax.tree.map(lambda a: jnp.repeat(a, c, axis=0), batch)
    pseudo = (repeated, cotangents)
    stats = None
    if batched_output is not None:
        res = layerwise.per_example_pass(lambda p, pb, ctx: jnp.sum(pb[1] * batched_output(p, pb[0], ctx), axis=-1),
                                         params, pseudo, context, chunk, grad_sq=True, hist1d=None, hist2d=None)
        stats = None if res is None else res[0]
    if stats is None:
        stats = per_example_pass(lambda p, ex, ctx: jnp.vdot(ex[1], example_output(p, ex[0], ctx)), params, pseudo,
                                 context, chunk, grad_sq=True, hist1d=None, hist2d=None)
    return jax.tree.map(lambda s: s / b, stats.sum_grad_sq)


def hutchinson(hvp: Callable, params, key, probes: int):
    """(per-layer trace estimates as a params-like tree of scalars, diagonal estimate as a params-like
    tree, standard error of the total trace).

    The standard error is ``sqrt(2 mean_k ||H v_k||^2 / probes)``: for Rademacher probes
    ``var(v . Hv) = 2 (||H||_F^2 - sum_j H_jj^2) <= 2 ||H||_F^2`` and ``E ||Hv||^2 = ||H||_F^2``, so it
    estimates an upper bound of the true one (also from a single probe)."""
    leaves, treedef = jax.tree.flatten(params)

    def add_probe(i, carry):
        diag, hv_sq = carry
        keys = jax.random.split(jax.random.fold_in(key, i), len(leaves))
        v = treedef.unflatten([jax.random.rademacher(k, p.shape, p.dtype) for k, p in zip(keys, leaves)])
        hv = hvp(v)
        hv_sq = hv_sq + sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(hv))
        return jax.tree.map(lambda d, a, b: d + a * b / probes, diag, v, hv), hv_sq

    carry = vary_like((jax.tree.map(jnp.zeros_like, params), jnp.zeros((), common_dtype(params))), params)
    if probes <= 2:  # straight-line code: XLA:CPU runs convolutions inside loops on a slower path
        for i in range(probes):
            carry = add_probe(i, carry)
    else:
        carry = jax.lax.fori_loop(0, probes, add_probe, carry)
    diag, hv_sq = carry
    return jax.tree.map(jnp.sum, diag), diag, jnp.sqrt(2 * hv_sq / probes / probes)
