"""The catalogue's models by name (:data:`MODELS`, whose names are :data:`nondet_jax.models.MODEL_NAMES`), and
:func:`make_model`: every model maps (N, H, W, C) images to logits; ``return_features=True`` adds the penultimate
features. Call signature: ``apply(variables, x, train, dropout_keys, return_features)``.
"""

from __future__ import annotations

from functools import partial

import flax.linen as nn

from nondet_jax.models.common import compute_dtype
from nondet_jax.models.mlp import MLP
from nondet_jax.models.preact import PreActResNet
from nondet_jax.models.resnet import cifar_resnet, resnet18, resnet50
from nondet_jax.models.shufflenet import ShuffleNetV2
from nondet_jax.models.vgg import VGG

MODELS = {
    "mlp": partial(MLP),
    "resnet8": partial(cifar_resnet, 8),
    "resnet14": partial(cifar_resnet, 14),
    "resnet20": partial(cifar_resnet, 20),
    "resnet32": partial(cifar_resnet, 32),
    "resnet56": partial(cifar_resnet, 56),
    "resnet18": resnet18,
    "resnet18_imagenet": partial(resnet18, stem="imagenet"),
    "resnet50": resnet50,
    "resnet29v2": partial(PreActResNet, depth=29),
    "vgg11": VGG,
    "shufflenetv2": ShuffleNetV2,
}


def make_model(name: str, num_classes: int, width: float = 1.0, dropout: float = 0.0,
               dtype: str = "float32") -> nn.Module:
    """Build a registered model by name; ``dtype`` "bfloat16" computes in bfloat16 with float32
    parameters (mixed precision), "float32" is the model as it always was."""
    extra = {} if dtype == "float32" else {"dtype": compute_dtype(dtype)}
    return MODELS[name](num_classes=num_classes, width=width, dropout=dropout, **extra)
