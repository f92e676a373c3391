"""Pieces every model shares: conv/BatchNorm layer factories and the classifier head with
per-example dropout."""

from __future__ import annotations

from functools import partial

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax


# He (fan_out) init for convolutions, as torchvision's ResNets.
conv_init = nn.initializers.variance_scaling(2.0, "fan_out", "normal")


def _fusion_barrier_transpose(x: jax.Array, perm: tuple[int, ...]) -> jax.Array:
    """``x.transpose(perm)``, computed inside a ``lax.cond`` whose two branches are the same
    function: the value never depends on the predicate, but XLA cannot fuse ``x``'s producers
    into the transpose across the conditional's boundary, so it reads ``x`` once, materialized.

    The predicate must not be foldable at compile time (XLA inlines a conditional whose predicate
    is a constant): ``v == v`` of one element of ``x`` is True unless that element is NaN.
    Under ``vmap`` the predicate is batched, the cond becomes a select of two identical values,
    and XLA simplifies it back to a plain transpose (no barrier, no extra cost).
    """
    v = x[(0,) * x.ndim]
    transpose = lambda a: a.transpose(perm)  # noqa: E731
    return lax.cond(v == v, transpose, transpose, x)


def conv_general_dilated(lhs, rhs, window_strides, padding, lhs_dilation=None, rhs_dilation=None,
                         dimension_numbers=None, feature_group_count=1, batch_group_count=1, precision=None,
                         preferred_element_type=None):
    """``lax.conv_general_dilated`` with the same value and derivatives, whose weight gradient on
    XLA:CPU reads a materialized input.

    Why: XLA computes a convolution's weight gradient as another convolution whose input is the
    forward input transposed (NHWC -> CHWN). XLA:CPU fuses that transpose with everything that
    produced the input, so each weight gradient recomputed the BatchNorm/ReLU/residual chain of
    up to three blocks while transposing, reading up to 15 full activations in transposed order:
    in ResNet-14 (batch 128, 32x32) those transposes took ~155 of ~760 ms per training step on
    one core (``benchmarks/step_profile.py``). Here the JVP's weight-tangent term convolves the
    input transposed behind :func:`_fusion_barrier_transpose` and transposed back: XLA cancels
    the pair of transposes against the layout its weight-gradient convolution wants, so the
    transpose it runs is one plain copy of one materialized array.

    The convolutions are exactly the ones ``lax`` emits (same operands, same dimension numbers):
    results are bitwise those of ``lax.conv_general_dilated``. A ``custom_jvp`` (not ``custom_vjp``)
    keeps forward-mode (``jax.jvp``, ``jax.linearize`` of a gradient) working. Used only when
    ``jax.default_backend() == "cpu"`` and for ungrouped convolutions; elsewhere it *is*
    ``lax.conv_general_dilated``.
    """
    conv = partial(lax.conv_general_dilated, window_strides=window_strides, padding=padding,
                   lhs_dilation=lhs_dilation, rhs_dilation=rhs_dilation, dimension_numbers=dimension_numbers,
                   feature_group_count=feature_group_count, batch_group_count=batch_group_count,
                   precision=precision, preferred_element_type=preferred_element_type)
    if jax.default_backend() != "cpu" or feature_group_count != 1 or batch_group_count != 1:
        return conv(lhs, rhs)
    spec = lax.conv_dimension_numbers(lhs.shape, rhs.shape, dimension_numbers).lhs_spec
    perm = (spec[1], *spec[2:], spec[0])  # (feature, spatial..., batch): the weight-gradient layout
    inverse = tuple(perm.index(i) for i in range(len(perm)))

    @jax.custom_jvp
    def f(x, w):
        return conv(x, w)

    def f_jvp(primals, tangents):
        x, w = primals
        dx, dw = tangents
        y = conv(x, w)
        terms = []
        if not isinstance(dx, jax.custom_derivatives.SymbolicZero):
            terms.append(conv(dx, w))
        if not isinstance(dw, jax.custom_derivatives.SymbolicZero):
            terms.append(conv(_fusion_barrier_transpose(x, perm).transpose(inverse), dw))
        if not terms:  # jax does not call the rule with no tangent at all; kept total anyway
            return y, jnp.zeros_like(y)
        return y, terms[0] if len(terms) == 1 else terms[0] + terms[1]

    f.defjvp(f_jvp, symbolic_zeros=True)
    return f(lhs, rhs)


def conv_bn(train: bool, bn_momentum: float):
    """(conv, norm) layer factories: bias-free He-initialised convolutions (computed by
    :func:`conv_general_dilated`), and BatchNorm using batch statistics in training and running
    averages otherwise (``axis_name=None``: per replica)."""
    conv = partial(nn.Conv, use_bias=False, kernel_init=conv_init, conv_general_dilated=conv_general_dilated)
    norm = partial(nn.BatchNorm, use_running_average=not train, momentum=bn_momentum, epsilon=1e-5)
    return conv, norm


def example_dropout(x: jax.Array, keys: jax.Array, rate: float) -> jax.Array:
    """Inverted dropout with one key per example (row of ``x``).

    Masks are tied to examples, not to batch positions, so permuting a batch together with its
    keys (the ``batch_order`` source) permutes the masks with the examples.
    """
    keep = jax.vmap(lambda k: jax.random.bernoulli(k, 1.0 - rate, x.shape[1:]))(keys)
    return jnp.where(keep, x / (1.0 - rate), 0.0).astype(x.dtype)


class Head(nn.Module):
    """Optional dropout, then a dense classifier. Returns (logits, features before dropout)."""

    num_classes: int
    dropout: float = 0.0

    @nn.compact
    def __call__(self, features, train: bool, dropout_keys=None):
        x = features
        if train and self.dropout > 0:
            if dropout_keys is None:
                raise ValueError("training with dropout needs dropout_keys (one key per example)")
            x = example_dropout(x, dropout_keys, self.dropout)
        return nn.Dense(self.num_classes, name="classifier")(x), features
