"""Pieces every model shares: conv/BatchNorm layer factories and the classifier head with
per-example dropout."""

from __future__ import annotations

from functools import partial
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from nondet_jax.models import convs

# He (fan_out) init for convolutions, as torchvision's ResNets.
conv_init = nn.initializers.variance_scaling(2.0, "fan_out", "normal")


def conv_general_dilated(lhs, rhs, window_strides, padding, lhs_dilation=None, rhs_dilation=None,
                         dimension_numbers=None, feature_group_count=1, batch_group_count=1, precision=None,
                         preferred_element_type=None):
    """``lax.conv_general_dilated`` with the same value and derivatives, computed through
    :mod:`nondet_jax.models.convs`' primitive: a replica-batched call (``vmap`` over replicas) runs the
    formulation the measured table chooses, and on XLA:CPU the weight gradient reads a materialized input.

    Why the CPU part: XLA computes a convolution's weight gradient as another convolution whose input
    is the forward input transposed (NHWC -> CHWN). XLA:CPU fuses that transpose with everything that
    produced the input, so each weight gradient recomputed the BatchNorm/ReLU/residual chain of
    up to three blocks while transposing, reading up to 15 full activations in transposed order:
    in ResNet-14 (batch 128, 32x32) those transposes took ~155 of ~760 ms per training step on
    one core (``benchmarks/step_profile.py``). The forward's weight-tangent term convolves the input
    transposed behind a fusion barrier (``convs.materialized_for_weight_gradient``), only on CPU and
    for ungrouped convolutions.

    Unbatched, the convolutions are exactly the ones ``lax`` emits (same operands, same dimension
    numbers): results are bitwise those of ``lax.conv_general_dilated``, except on CPU where XLA would
    run a convolution with its operands swapped (``convs.swapped_by_xla``: a kernel larger than its
    input), which gets its input padded first and runs 8-11x faster (``benchmarks/conv_paths.py``). Forward mode (``jax.jvp``,
    ``jax.linearize`` of a gradient), reverse mode and ``vmap`` all work.
    """
    kw = dict(window_strides=window_strides, padding=padding, lhs_dilation=lhs_dilation, rhs_dilation=rhs_dilation,
              dimension_numbers=dimension_numbers, feature_group_count=feature_group_count,
              batch_group_count=batch_group_count, precision=precision, preferred_element_type=preferred_element_type)
    if convs.inside_shard_map(lhs, rhs):  # the primitive has no shard_map typing rule yet: lax's own convolution
        return lax.conv_general_dilated(lhs, rhs, **kw)
    barrier = jax.default_backend() == "cpu" and feature_group_count == 1 and batch_group_count == 1
    return convs.conv(lhs, rhs, barrier=barrier, window_strides=window_strides, padding=padding,
                      lhs_dilation=lhs_dilation, rhs_dilation=rhs_dilation, dimension_numbers=dimension_numbers,
                      feature_group_count=feature_group_count, batch_group_count=batch_group_count,
                      precision=precision, preferred_element_type=preferred_element_type)


PRECISIONS = {"float32": None, "bfloat16": jnp.bfloat16}  # model.dtype -> compute dtype (None: the params')


def compute_dtype(name: str):
    """The compute dtype of ``model.dtype`` ``name``: None for float32 (flax infers it from the float32
    parameters, as before the setting existed), ``jnp.bfloat16`` for bfloat16."""
    if name not in PRECISIONS:
        raise ValueError(f"unknown model dtype {name!r}; use one of {', '.join(PRECISIONS)}")
    return PRECISIONS[name]


def conv_bn(train: bool, bn_momentum: float, dtype=None):
    """(conv, norm) layer factories: bias-free He-initialised convolutions (computed by
    :func:`conv_general_dilated`), and BatchNorm using batch statistics in training and running
    averages otherwise (``axis_name=None``: per replica). ``dtype`` is the compute dtype (mixed
    precision: bfloat16 compute; parameters, running statistics and BatchNorm reductions stay float32)."""
    conv = partial(nn.Conv, use_bias=False, kernel_init=conv_init, conv_general_dilated=conv_general_dilated,
                   dtype=dtype)
    norm = partial(nn.BatchNorm, use_running_average=not train, momentum=bn_momentum, epsilon=1e-5, dtype=dtype)
    return conv, norm


def example_dropout(x: jax.Array, keys: jax.Array, rate: float) -> jax.Array:
    """Inverted dropout with one key per example (row of ``x``).

    Masks are tied to examples, not to batch positions, so permuting a batch together with its
    keys (the ``batch_order`` source) permutes the masks with the examples.
    """
    keep = jax.vmap(lambda k: jax.random.bernoulli(k, 1.0 - rate, x.shape[1:]))(keys)
    return jnp.where(keep, x / (1.0 - rate), 0.0).astype(x.dtype)


class Head(nn.Module):
    """Optional dropout, then a dense classifier. Returns (logits, features before dropout): float32
    under a low-precision compute ``dtype`` (the loss and the metrics read them), else as computed."""

    num_classes: int
    dropout: float = 0.0
    dtype: Any = None

    @nn.compact
    def __call__(self, features, train: bool, dropout_keys=None):
        x = features
        if train and self.dropout > 0:
            if dropout_keys is None:
                raise ValueError("training with dropout needs dropout_keys (one key per example)")
            x = example_dropout(x, dropout_keys, self.dropout)
        logits = nn.Dense(self.num_classes, dtype=self.dtype, name="classifier")(x)
        if self.dtype is None:  # full precision: the parameters' dtype (float64 under jax.enable_x64) is kept
            return logits, features
        return logits.astype(jnp.float32), features.astype(jnp.float32)
