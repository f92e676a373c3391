"""Model registry: every model maps (N, H, W, C) images to logits; ``return_features=True`` adds
the penultimate features. Call signature: ``apply(variables, x, train, dropout_keys, return_features)``.

The names are here without Flax (:data:`MODEL_NAMES`, :data:`PRECISION_NAMES`), so a command checks its
config before it starts JAX; the models themselves (``MODELS``, ``make_model``, the classes) load on first use
from :mod:`nondet_jax.models.catalogue`.
"""

from __future__ import annotations

import importlib

# The catalogue's names (tests/test_models.py holds them equal to catalogue.MODELS) and model.dtype's values.
MODEL_NAMES = ("mlp", "resnet8", "resnet14", "resnet20", "resnet32", "resnet56", "resnet18", "resnet18_imagenet",
               "resnet50", "resnet29v2", "vgg11", "shufflenetv2")
PRECISION_NAMES = ("float32", "bfloat16")

_LAZY = {"MODELS": "catalogue", "make_model": "catalogue", "MLP": "mlp", "PreActResNet": "preact", "ResNet": "resnet",
         "cifar_resnet": "resnet", "resnet18": "resnet", "resnet50": "resnet", "ShuffleNetV2": "shufflenet",
         "VGG": "vgg", "PRECISIONS": "common", "compute_dtype": "common"}
__all__ = ["MODEL_NAMES", "PRECISION_NAMES", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"nondet_jax.models.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'nondet_jax.models' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
