"""The per-example pass: per-example losses and gradients, ``vmap(value_and_grad)`` over chunks.

Only running sums leave each chunk (sum of gradients, sum of squared gradient norms, element-wise
sum of squared gradients, histogram counts), so memory is ``chunk x P``, never ``B x P``.
:mod:`.layerwise` computes the same sums faster for flax models built from Conv/Dense/BatchNorm
(and shares :func:`init_sums`, :func:`add_chunk`, :func:`over_chunks` with this module).

BatchNorm convention: the per-example loss is evaluated with the normalisation statistics held
fixed at the values the whole batch gives (they enter as a constant ``context``), so example ``i``'s
gradient ignores how its own activations move the batch mean and variance. The mean of these
per-example gradients is then the gradient of the batch loss with the statistics treated as
constants, which for a model with BatchNorm differs from the training gradient (for a model
without BatchNorm the two are equal). BackPACK handles BatchNorm only in training mode and only in
its first-order extensions.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from nondet_jax.instruments import histograms


class PerExampleStats(NamedTuple):
    losses: jax.Array  # (B,)
    sum_grad: object  # params-like: sum_i g_i
    sum_sq_norm: jax.Array  # sum_i ||g_i||^2
    sum_grad_sq: object  # params-like: sum_i g_i**2 (element-wise), or None
    hist1d: jax.Array | None
    hist2d: jax.Array | None


def chunk_size(batch: int, requested: int) -> int:
    """The largest divisor of ``batch`` that is <= ``requested`` (chunks must tile the batch)."""
    c = max(1, min(requested, batch))
    while batch % c:
        c -= 1
    return c


def common_dtype(params):
    """The dtype every leaf's values promote to (float64 when float32 and float64 parameters mix): the
    dtype of scalars summed over all leaves, such as a squared norm or a quantity's value."""
    return jnp.result_type(*(x.dtype for x in jax.tree.leaves(params)))


def _varying(x) -> frozenset:
    """The ``shard_map`` axes ``x`` varies over (empty outside one)."""
    t = jax.typeof(x)
    mat = getattr(t, "manual_axis_type", None)  # jax 0.10; later versions name it ``vma``
    return frozenset(mat.varying) if mat is not None else frozenset(getattr(t, "vma", ()))


def vary_like(tree, ref):
    """``tree``'s leaves made to vary over every ``shard_map`` axis that a leaf of ``ref`` varies over.

    A loop's carry started from zeros inside the ``sharded`` strategy's ``shard_map`` is the same on every
    device, while the body, computed from one replica's parameters, makes it vary per device: ``lax.scan``
    and ``fori_loop`` refuse a carry whose type changes. Outside ``shard_map`` ``tree`` is returned as it is."""
    axes = frozenset().union(*(_varying(x) for x in jax.tree.leaves(ref)))

    def cast(x):
        missing = tuple(sorted(axes - _varying(x)))
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(cast, tree) if axes else tree


def init_sums(params, *, grad_sq: bool, hist1d: dict | None, hist2d: dict | None):
    """Zero running sums ``(sum_g, sum_sq_norm, sum_g2, hist1d, hist2d)`` (None for those not asked for), varying
    as ``params`` do (:func:`vary_like`)."""
    zeros = jax.tree.map(jnp.zeros_like, params)
    return vary_like((zeros, jnp.zeros((), common_dtype(params)), zeros if grad_sq else None,
                      None if hist1d is None else jnp.zeros(hist1d.get("bins", histograms.HIST1D_BINS), jnp.float32),
                      None if hist2d is None else jnp.zeros(hist2d.get("bins", histograms.HIST2D_BINS), jnp.float32)),
                     params)


def matmul_sum(x: jax.Array) -> jax.Array:
    """``x.sum(0)`` as a product with a vector of ones: XLA:CPU reduces over the leading axis of a
    large array several times slower than it runs the matrix-vector product."""
    return (jnp.ones((1, x.shape[0]), x.dtype) @ x.reshape(x.shape[0], -1)).reshape(x.shape[1:])


def add_chunk(acc, g, params, *, hist1d: dict | None, hist2d: dict | None, batch_sum: Callable | None = None):
    """Add one chunk's per-example gradients ``g`` (params-like, leading axis = examples) to the sums.

    ``batch_sum``: how to sum over the examples axis (default ``x.sum(0)``; :func:`matmul_sum`).
    """
    batch_sum = batch_sum or (lambda x: x.sum(0))
    sum_g, sq, sum_g2, h1, h2 = acc
    sum_g = jax.tree.map(lambda s, x: s + batch_sum(x), sum_g, g)
    sq = sq + sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(g))
    if sum_g2 is not None:
        sum_g2 = jax.tree.map(lambda s, x: s + batch_sum(jnp.square(x)), sum_g2, g)
    if h1 is not None:
        h1 = h1 + histograms.hist1d(g, **hist1d)
    if h2 is not None:
        h2 = h2 + histograms.hist2d(g, params, **hist2d)
    return sum_g, sq, sum_g2, h1, h2


def over_chunks(body: Callable, init, chunks, *, convolutions: bool = True):
    """``lax.scan(body, init, chunks)``, or straight-line code where XLA:CPU would be slow.

    XLA:CPU runs convolutions inside loops on a slow path (see train.CPU_UNROLL_MAX_STEPS): one chunk
    runs without a loop, and, when ``body`` runs convolutions, up to 16 chunks are unrolled on CPU.
    Returns ``(acc, stacked outputs)``.
    """
    n = jax.tree.leaves(chunks)[0].shape[0]
    if n == 1:
        acc, out = body(init, jax.tree.map(lambda a: a[0], chunks))
        return acc, jax.tree.map(lambda a: a[None], out)
    unroll = n if (convolutions and jax.default_backend() == "cpu" and n <= 16) else 1
    return jax.lax.scan(body, init, chunks, unroll=unroll)


def split_chunks(tree, c: int):
    """Reshape every leaf's leading batch axis ``(B, ...)`` into ``(B // c, c, ...)``."""
    return jax.tree.map(lambda a: a.reshape((a.shape[0] // c, c) + a.shape[1:]), tree)


def per_example_pass(example_loss: Callable, params, batch, context, chunk: int, *, grad_sq: bool,
                     hist1d: dict | None, hist2d: dict | None) -> PerExampleStats:
    """Run ``example_loss(params, example, context)`` and its gradient over every example of ``batch``.

    Args:
      example_loss: loss of one example (no batch axis) -> scalar.
      batch: pytree whose leaves have the batch axis first.
      chunk: examples per vectorised chunk (rounded down to a divisor of the batch size).
      grad_sq: also accumulate the element-wise sum of squared per-example gradients.
      hist1d / hist2d: keyword arguments of :func:`histograms.hist1d` / :func:`hist2d`, or None.
    """
    b = jax.tree.leaves(batch)[0].shape[0]
    c = chunk_size(b, chunk)
    value_and_grads = jax.vmap(jax.value_and_grad(example_loss), in_axes=(None, 0, None))
    init = init_sums(params, grad_sq=grad_sq, hist1d=hist1d, hist2d=hist2d)

    def body(acc, examples):
        losses, g = value_and_grads(params, examples, context)
        return add_chunk(acc, g, params, hist1d=hist1d, hist2d=hist2d), losses

    acc, losses = over_chunks(body, init, split_chunks(batch, c))
    return PerExampleStats(losses.reshape(b), *acc)
