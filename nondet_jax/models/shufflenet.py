"""ShuffleNet v2 (Ma et al. 2018), CIFAR-sized: 3x3 stem with stride 1 and no max-pool.

Stages of 4/8/4 units with 116/232/464 output channels (the 1.0x model), then a 1x1 convolution
to 1024 channels, global average pool and the head. A unit splits its channels in two, transforms
one half (1x1, depthwise 3x3, 1x1) and shuffles the concatenation; the first unit of a stage
transforms both halves with stride 2.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from nondet_jax.models.common import Head, conv_bn


def channel_shuffle(x, groups: int = 2):
    n, h, w, c = x.shape
    return x.reshape(n, h, w, groups, c // groups).swapaxes(3, 4).reshape(n, h, w, c)


class ShuffleUnit(nn.Module):
    out: int
    stride: int = 1
    bn_momentum: float = 0.9
    dtype: Any = None  # compute dtype (None: the parameters' float32)

    @nn.compact
    def __call__(self, x, train: bool):
        conv, norm = conv_bn(train, self.bn_momentum, self.dtype)
        half = self.out // 2

        def branch(y, name):
            y = nn.relu(norm(name=f"{name}_bn1")(conv(half, (1, 1), name=f"{name}_pw1")(y)))
            y = norm(name=f"{name}_bn2")(conv(half, (3, 3), strides=self.stride, feature_group_count=half,
                                              name=f"{name}_dw")(y))
            return nn.relu(norm(name=f"{name}_bn3")(conv(half, (1, 1), name=f"{name}_pw2")(y)))

        if self.stride == 1:
            left, right = jnp.split(x, 2, axis=-1)
            out = jnp.concatenate([left, branch(right, "main")], axis=-1)
        else:
            c = x.shape[-1]
            left = norm(name="proj_bn1")(conv(c, (3, 3), strides=self.stride, feature_group_count=c, name="proj_dw")(x))
            left = nn.relu(norm(name="proj_bn2")(conv(half, (1, 1), name="proj_pw")(left)))
            out = jnp.concatenate([left, branch(x, "main")], axis=-1)
        return channel_shuffle(out)


class ShuffleNetV2(nn.Module):
    num_classes: int
    width: float = 1.0
    dropout: float = 0.0
    bn_momentum: float = 0.9
    stage_repeats: tuple = (4, 8, 4)
    stage_channels: tuple = (116, 232, 464)
    dtype: Any = None  # compute dtype: bfloat16 for mixed precision (parameters stay float32)

    @nn.compact
    def __call__(self, x, train: bool = False, dropout_keys=None, return_features: bool = False):
        even = lambda c: max(2, 2 * int(round(c * self.width / 2)))  # noqa: E731  units split channels in two
        conv, norm = conv_bn(train, self.bn_momentum, self.dtype)
        x = conv(even(24), (3, 3), name="stem_conv")(x)
        x = nn.relu(norm(name="stem_bn")(x))
        for i, (n, c) in enumerate(zip(self.stage_repeats, self.stage_channels)):
            for j in range(n):
                x = ShuffleUnit(even(c), 2 if j == 0 else 1, self.bn_momentum, self.dtype,
                               name=f"stage{i + 2}_unit{j + 1}")(x, train)
        x = conv(even(1024), (1, 1), name="conv5")(x)
        x = nn.relu(norm(name="conv5_bn")(x))
        features = jnp.mean(x, axis=(1, 2))
        logits, features = Head(self.num_classes, self.dropout, self.dtype, name="head")(features, train, dropout_keys)
        return (logits, features) if return_features else logits
