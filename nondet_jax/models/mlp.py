"""A small MLP for fast tests and quick studies."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from nondet_jax.models.common import Head


class MLP(nn.Module):
    num_classes: int
    hidden: int = 64
    depth: int = 2
    width: float = 1.0
    dropout: float = 0.0
    dtype: Any = None  # compute dtype: bfloat16 for mixed precision (parameters stay float32)

    @nn.compact
    def __call__(self, x, train: bool = False, dropout_keys=None, return_features: bool = False):
        x = jnp.reshape(x, (x.shape[0], -1))
        for i in range(self.depth):
            x = nn.relu(nn.Dense(max(1, int(round(self.hidden * self.width))), dtype=self.dtype,
                                  name=f"dense{i + 1}")(x))
        logits, features = Head(self.num_classes, self.dropout, self.dtype, name="head")(x, train, dropout_keys)
        return (logits, features) if return_features else logits
