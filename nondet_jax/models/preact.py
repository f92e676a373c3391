"""Pre-activation ResNet v2 with bottleneck blocks, depth 9n+2 (He et al. 2016b): ResNet-29v2 is
Morin & Willetts' network (the Keras ``cifar10_resnet`` example, version 2, n = 3).

Stem: 3x3 conv with 16 channels, BatchNorm, ReLU. Three stages of n bottleneck blocks
(BN-ReLU-1x1, BN-ReLU-3x3, BN-ReLU-1x1); stage outputs 64, 128, 256 channels; the first block of
each stage projects the shortcut with a 1x1 convolution (stride 2 from the second stage on).
A final BN-ReLU, global average pool and the head end it.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from nondet_jax.models.common import Head, conv_bn


class PreActBottleneck(nn.Module):
    inner: int
    out: int
    stride: int = 1
    preactivate: bool = True  # the very first block takes the stem's activated output as is
    bn_momentum: float = 0.9
    dtype: Any = None  # compute dtype (None: the parameters' float32)

    @nn.compact
    def __call__(self, x, train: bool):
        conv, norm = conv_bn(train, self.bn_momentum, self.dtype)
        y = nn.relu(norm()(x)) if self.preactivate else x
        shortcut = x
        if self.stride != 1 or x.shape[-1] != self.out:  # as the Keras example: projected from the block input
            shortcut = conv(self.out, (1, 1), strides=self.stride, name="shortcut_conv")(x)
        y = conv(self.inner, (1, 1), strides=self.stride)(y)
        y = conv(self.inner, (3, 3))(nn.relu(norm()(y)))
        y = conv(self.out, (1, 1))(nn.relu(norm()(y)))
        return shortcut + y


class PreActResNet(nn.Module):
    num_classes: int
    depth: int = 29
    width: float = 1.0
    dropout: float = 0.0
    bn_momentum: float = 0.9
    dtype: Any = None  # compute dtype: bfloat16 for mixed precision (parameters stay float32)

    @nn.compact
    def __call__(self, x, train: bool = False, dropout_keys=None, return_features: bool = False):
        if (self.depth - 2) % 9:
            raise ValueError(f"pre-activation ResNet depth must be 9n+2, got {self.depth}")
        n = (self.depth - 2) // 9
        w = lambda c: max(1, int(round(c * self.width)))  # noqa: E731
        conv, norm = conv_bn(train, self.bn_momentum, self.dtype)
        x = conv(w(16), (3, 3), name="stem_conv")(x)
        x = nn.relu(norm(name="stem_bn")(x))
        inner = 16
        for stage in range(3):
            out = inner * (4 if stage == 0 else 2)
            for j in range(n):
                stride = 2 if (stage > 0 and j == 0) else 1
                x = PreActBottleneck(w(inner), w(out), stride, not (stage == 0 and j == 0), self.bn_momentum,
                                     self.dtype, name=f"stage{stage + 1}_block{j + 1}")(x, train)
            inner = out
        x = nn.relu(norm(name="final_bn")(x))
        features = jnp.mean(x, axis=(1, 2))
        logits, features = Head(self.num_classes, self.dropout, self.dtype, name="head")(features, train, dropout_keys)
        return (logits, features) if return_features else logits
