"""Pieces every model shares: conv/BatchNorm layer factories and the classifier head with
per-example dropout."""

from __future__ import annotations

from functools import partial

import flax.linen as nn
import jax
import jax.numpy as jnp


# He (fan_out) init for convolutions, as torchvision's ResNets.
conv_init = nn.initializers.variance_scaling(2.0, "fan_out", "normal")


def conv_bn(train: bool, bn_momentum: float):
    """(conv, norm) layer factories: bias-free He-initialised convolutions, and BatchNorm using
    batch statistics in training and running averages otherwise (``axis_name=None``: per replica)."""
    conv = partial(nn.Conv, use_bias=False, kernel_init=conv_init)
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
