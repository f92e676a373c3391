"""VGG-11 with BatchNorm, CIFAR-sized (Simonyan & Zisserman 2015, configuration A).

Max-pooling halves the resolution after the stages marked ``M``; on inputs too small for five
halvings (8x8 digits) a pool is skipped once the feature map is 1x1. A global average pool and one
dense layer end it (the CIFAR variant: no 4096-wide layers).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from nondet_jax.models.common import Head, conv_bn

VGG11 = (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M")


class VGG(nn.Module):
    num_classes: int
    layers: tuple = VGG11
    width: float = 1.0
    dropout: float = 0.0
    bn_momentum: float = 0.9
    dtype: Any = None  # compute dtype: bfloat16 for mixed precision (parameters stay float32)

    @nn.compact
    def __call__(self, x, train: bool = False, dropout_keys=None, return_features: bool = False):
        conv, norm = conv_bn(train, self.bn_momentum, self.dtype)
        for i, layer in enumerate(self.layers):
            if layer == "M":
                if x.shape[1] > 1 and x.shape[2] > 1:
                    x = nn.max_pool(x, (2, 2), strides=(2, 2))
                continue
            x = conv(max(1, int(round(layer * self.width))), (3, 3), name=f"conv{i}")(x)
            x = norm(name=f"bn{i}")(x)
            x = nn.relu(x)
        features = jnp.mean(x, axis=(1, 2))
        logits, features = Head(self.num_classes, self.dropout, self.dtype, name="head")(features, train, dropout_keys)
        return (logits, features) if return_features else logits
