"""ResNets: CIFAR ResNet-(6n+2) with widths 16/32/64 (He et al. 2016, as in Summers & Dinneen
2021), ResNet-18 with a CIFAR stem (3x3 conv, no max-pool) or an ImageNet stem, and ResNet-50.

BatchNorm uses ``axis_name=None``: statistics are per replica, never synchronised across the
replica axis. Inputs of any size >= 1 pixel per side work (8x8 digits included): the stages
halve the resolution with stride-2 convolutions (SAME padding) and a global average pool ends it.
"""

from __future__ import annotations

from typing import Any, Sequence

import flax.linen as nn
import jax.numpy as jnp

from nondet_jax.models.common import Head, conv_bn


class BasicBlock(nn.Module):
    features: int
    stride: int = 1
    bn_momentum: float = 0.9
    dtype: Any = None  # compute dtype (None: the parameters' float32)

    @nn.compact
    def __call__(self, x, train: bool):
        conv, norm = conv_bn(train, self.bn_momentum, self.dtype)
        y = conv(self.features, (3, 3), strides=self.stride)(x)
        y = nn.relu(norm()(y))
        y = conv(self.features, (3, 3))(y)
        y = norm()(y)
        if self.stride != 1 or x.shape[-1] != self.features:
            x = conv(self.features, (1, 1), strides=self.stride, name="shortcut_conv")(x)
            x = norm(name="shortcut_bn")(x)
        return nn.relu(x + y)


class Bottleneck(nn.Module):
    """1x1 (width), 3x3 (width, stride), 1x1 (4 x width), as ResNet-50 (stride on the 3x3, as torchvision)."""

    features: int
    stride: int = 1
    bn_momentum: float = 0.9
    dtype: Any = None  # compute dtype (None: the parameters' float32)

    @nn.compact
    def __call__(self, x, train: bool):
        conv, norm = conv_bn(train, self.bn_momentum, self.dtype)
        out = 4 * self.features
        y = nn.relu(norm()(conv(self.features, (1, 1))(x)))
        y = nn.relu(norm()(conv(self.features, (3, 3), strides=self.stride)(y)))
        y = norm()(conv(out, (1, 1))(y))
        if self.stride != 1 or x.shape[-1] != out:
            x = norm(name="shortcut_bn")(conv(out, (1, 1), strides=self.stride, name="shortcut_conv")(x))
        return nn.relu(x + y)


class ResNet(nn.Module):
    """Stem, stages of residual blocks, global average pool, head.

    ``stem="cifar"``: one 3x3 convolution. ``stem="imagenet"``: 7x7 convolution with stride 2 and a
    3x3 max-pool with stride 2 (He et al. 2016), for ImageNet-sized inputs.
    """

    stage_sizes: Sequence[int]
    stage_widths: Sequence[int]
    stem_width: int
    num_classes: int
    width: float = 1.0
    dropout: float = 0.0
    bn_momentum: float = 0.9  # 0 makes a training-mode pass store that batch's exact statistics
    stem: str = "cifar"
    bottleneck: bool = False
    dtype: Any = None  # compute dtype: bfloat16 for mixed precision (parameters stay float32)

    @nn.compact
    def __call__(self, x, train: bool = False, dropout_keys=None, return_features: bool = False):
        w = lambda c: max(1, int(round(c * self.width)))  # noqa: E731
        conv, norm = conv_bn(train, self.bn_momentum, self.dtype)
        if self.stem == "imagenet":
            x = conv(w(self.stem_width), (7, 7), strides=2, name="stem_conv")(x)
        else:
            x = conv(w(self.stem_width), (3, 3), name="stem_conv")(x)
        x = norm(name="stem_bn")(x)
        x = nn.relu(x)
        if self.stem == "imagenet":
            x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
        block = Bottleneck if self.bottleneck else BasicBlock
        for i, (n, c) in enumerate(zip(self.stage_sizes, self.stage_widths)):
            for j in range(n):
                stride = 2 if (i > 0 and j == 0) else 1
                x = block(w(c), stride, self.bn_momentum, self.dtype, name=f"stage{i + 1}_block{j + 1}")(x, train)
        features = jnp.mean(x, axis=(1, 2))
        logits, features = Head(self.num_classes, self.dropout, self.dtype, name="head")(features, train, dropout_keys)
        return (logits, features) if return_features else logits


def cifar_resnet(depth: int, num_classes: int, width: float = 1.0, dropout: float = 0.0, dtype=None) -> ResNet:
    """ResNet-depth for depth = 6n + 2 (8, 14, 20, 32, 56, ...): 3 stages of n blocks, 16/32/64."""
    if (depth - 2) % 6 or depth < 8:
        raise ValueError(f"CIFAR ResNet depth must be 6n+2 with n >= 1, got {depth}")
    n = (depth - 2) // 6
    return ResNet((n, n, n), (16, 32, 64), 16, num_classes, width, dropout, dtype=dtype)


def resnet18(num_classes: int, width: float = 1.0, dropout: float = 0.0, stem: str = "cifar", dtype=None) -> ResNet:
    """ResNet-18: 4 stages of 2 basic blocks, 64/128/256/512; CIFAR stem unless ``stem="imagenet"``."""
    return ResNet((2, 2, 2, 2), (64, 128, 256, 512), 64, num_classes, width, dropout, stem=stem, dtype=dtype)


def resnet50(num_classes: int, width: float = 1.0, dropout: float = 0.0, stem: str = "imagenet",
             dtype=None) -> ResNet:
    """ResNet-50: 3/4/6/3 bottleneck blocks, widths 64..512 (outputs 4x); ImageNet stem by default."""
    return ResNet((3, 4, 6, 3), (64, 128, 256, 512), 64, num_classes, width, dropout, stem=stem, bottleneck=True,
                  dtype=dtype)
