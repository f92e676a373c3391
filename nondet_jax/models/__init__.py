"""Model registry: every model maps (N, H, W, C) images to logits; ``return_features=True`` adds
the penultimate features. Call signature: ``apply(variables, x, train, dropout_keys, return_features)``.
"""

from __future__ import annotations

from functools import partial

import flax.linen as nn

from nondet_jax.models.mlp import MLP
from nondet_jax.models.resnet import ResNet, cifar_resnet, resnet18

MODELS = {
    "mlp": partial(MLP),
    "resnet8": partial(cifar_resnet, 8),
    "resnet14": partial(cifar_resnet, 14),
    "resnet20": partial(cifar_resnet, 20),
    "resnet32": partial(cifar_resnet, 32),
    "resnet56": partial(cifar_resnet, 56),
    "resnet18": resnet18,
}


def make_model(name: str, num_classes: int, width: float = 1.0, dropout: float = 0.0) -> nn.Module:
    """Build a registered model by name."""
    return MODELS[name](num_classes=num_classes, width=width, dropout=dropout)


__all__ = ["MODELS", "MLP", "ResNet", "cifar_resnet", "make_model", "resnet18"]
