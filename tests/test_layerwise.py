"""The layerwise per-example pass (one batched backward pass + per-layer products) against
``vmap(grad)``, in float64, on tiny models with every layer setting the library's models use."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from nondet_jax.config import from_flat
from nondet_jax.instruments import layerwise, per_example
from nondet_jax.instruments.trainer import for_model, model_losses
from nondet_jax.models import MLP, ShuffleNetV2, make_model
from nondet_jax.models.common import Head

H1 = {"bins": 30, "value_range": (-0.05, 0.05)}
H2 = {"bins": (8, 10), "value_range": ((-0.05, 0.05), (-1.0, 1.0))}


class ConvZoo(nn.Module):
    """Every convolution setting the layerwise path claims: strides, SAME/VALID/explicit padding,
    kernel dilation, bias, groups (depthwise), 1x1 shortcuts, BatchNorm with and without scale, and
    a Dense on a feature map (positions between the batch and feature axes)."""

    num_classes: int = 3
    dropout: float = 0.0
    bn_momentum: float = 0.9

    @nn.compact
    def __call__(self, x, train: bool = False, dropout_keys=None):
        bn = lambda **kw: nn.BatchNorm(use_running_average=not train, momentum=self.bn_momentum, **kw)  # noqa: E731
        y = nn.Conv(6, (3, 3), strides=2, padding="SAME", use_bias=True)(x)
        y = nn.relu(bn()(y))
        s = nn.Conv(4, (1, 1), strides=(2, 1), use_bias=False, name="shortcut_conv")(y)
        y = nn.Conv(6, (3, 3), padding="SAME", feature_group_count=6, use_bias=False)(y)  # depthwise
        y = nn.Conv(4, (3, 2), strides=(2, 1), padding=((1, 2), (0, 1)), feature_group_count=2)(y)
        y = nn.relu(bn(use_scale=False)(y) + bn(name="shortcut_bn")(s))
        y = nn.Conv(5, (2, 2), kernel_dilation=(2, 1), padding="VALID", use_bias=True)(
            jnp.pad(y, ((0, 0), (1, 1), (1, 1), (0, 0))))
        y = nn.tanh(nn.Dense(3)(y))  # a dense layer applied at every position
        logits, _ = Head(self.num_classes, self.dropout, name="head")(jnp.mean(y, axis=(1, 2)), train, dropout_keys)
        return logits


def _f64(tree):
    return jax.tree.map(lambda a: a.astype(jnp.float64) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


def _setup(model, n=12, shape=(9, 8, 2), dropout_keys=False):
    kx, ky, ki, kd = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(kx, (n,) + shape, jnp.float64)
    y = jax.random.randint(ky, (n,), 0, 3)
    v = _f64(model.init(ki, x[:1], train=False))
    params = v["params"]
    # batch statistics that differ from init's (0, 1): the training-mode pass at momentum 0
    stats = {}
    if "batch_stats" in v:
        _, upd = model.clone(bn_momentum=0.0).apply(v, x, train=True, mutable=["batch_stats"],
                                                    **({"dropout_keys": jax.random.split(kd, n)}
                                                       if dropout_keys else {}))
        stats = upd["batch_stats"]
    dk = jax.random.split(kd, n) if dropout_keys else None
    return params, stats, (x, y, dk)


def _assert_same_stats(fast, slow):
    np.testing.assert_allclose(fast.losses, slow.losses, rtol=1e-12)
    for a, b in zip(jax.tree.leaves(fast.sum_grad), jax.tree.leaves(slow.sum_grad)):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-13)
    np.testing.assert_allclose(fast.sum_sq_norm, slow.sum_sq_norm, rtol=1e-12)
    for a, b in zip(jax.tree.leaves(fast.sum_grad_sq), jax.tree.leaves(slow.sum_grad_sq)):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-15)
    np.testing.assert_array_equal(fast.hist1d, slow.hist1d)
    np.testing.assert_array_equal(fast.hist2d, slow.hist2d)


@pytest.mark.parametrize("model, shape, dropout, chunk", [
    (ConvZoo(), (9, 8, 2), False, 4),
    (ConvZoo(dropout=0.5), (9, 8, 2), True, 12),
    (make_model("resnet8", 3, width=0.25, dropout=0.3), (8, 8, 1), True, 5),  # stride-2 blocks, 1x1 shortcuts
    (ShuffleNetV2(3, width=0.05, stage_repeats=(2,), stage_channels=(116,)), (8, 8, 1), False, 6),  # depthwise convolutions
    (MLP(3, hidden=5), (4, 3, 1), False, 12),
])
def test_layerwise_pass_equals_vmap_grad(model, shape, dropout, chunk):
    with jax.enable_x64(True):
        params, stats, batch = _setup(model, 12, shape, dropout)
        example_loss, batched = model_losses(model)
        kw = dict(grad_sq=True, hist1d=H1, hist2d=H2)
        slow = jax.jit(lambda p, bt, s: per_example.per_example_pass(example_loss, p, bt, s, chunk, **kw))(
            params, batch, stats)
        tangent = jax.tree.map(lambda a: jnp.cos(jnp.arange(a.size, dtype=a.dtype)).reshape(a.shape), params)
        fast_fn = jax.jit(lambda p, bt, s: layerwise.per_example_pass(batched, p, bt, s, chunk, **kw,
                                                                      tangents=(tangent,), project_mean=True))
        fast, proj = fast_fn(params, batch, stats)
        _assert_same_stats(fast, slow)
        # projections: the directional derivatives along the mean gradient and along the tangent
        losses_of = lambda p: jax.vmap(example_loss, (None, 0, None))(p, batch, stats)  # noqa: E731
        gbar = jax.tree.map(lambda a: a / len(slow.losses), slow.sum_grad)
        for row, t in zip(proj, (gbar, tangent)):
            np.testing.assert_allclose(row, jax.jvp(losses_of, (params,), (t,))[1], rtol=1e-9, atol=1e-13)
        again = fast_fn(params, batch, stats)  # deterministic: bitwise the same outputs
        for a, b in zip(jax.tree.leaves((fast, proj)), jax.tree.leaves(again)):
            np.testing.assert_array_equal(a, b)


class WithLayerNorm(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False, dropout_keys=None):
        x = nn.LayerNorm()(nn.Dense(4)(x.reshape(x.shape[0], -1)))
        return nn.Dense(3)(x)


class WithRawParam(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False, dropout_keys=None):
        x = nn.Dense(4)(x.reshape(x.shape[0], -1))
        return nn.Dense(3)(x * self.param("gain", nn.initializers.ones, (4,)))


class SharedLayer(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False, dropout_keys=None):
        x = x.reshape(x.shape[0], -1)
        dense = nn.Dense(x.shape[-1])
        return nn.Dense(3)(dense(nn.relu(dense(x))))


class CircularConv(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False, dropout_keys=None):
        x = nn.Conv(2, (3, 3), padding="CIRCULAR")(x)
        return nn.Dense(3)(jnp.mean(x, axis=(1, 2)))


@pytest.mark.parametrize("model", [WithLayerNorm(), WithRawParam(), SharedLayer(), CircularConv()])
def test_unsupported_layers_fall_back(model):
    """Layers the path does not know, raw parameters, a layer called twice, an unsupported padding:
    the layerwise pass declines (None) and the instruments' vmap path gives the same values."""
    with jax.enable_x64(True):
        params, stats, batch = _setup(model, 6, (3, 3, 2))
        _, batched = model_losses(model)
        assert layerwise.per_example_pass(batched, params, batch, stats, 3, grad_sq=False, hist1d=None,
                                          hist2d=None) is None


def test_trainer_instruments_same_with_and_without_layerwise():
    """The trainer adaptor on ResNet-8 (float32, BatchNorm statistics from the batch, dropout): every
    economy/business quantity agrees within float32 rounding with the layerwise path on and off."""
    model = make_model("resnet8", 10, width=0.5, dropout=0.2)
    kx, ky, ki, kd = jax.random.split(jax.random.key(3), 4)
    x = jax.random.normal(kx, (16, 8, 8, 1))
    y = jax.random.randint(ky, (16,), 0, 10)
    dk = jax.random.split(kd, 16)
    v = model.init(ki, x[:1], train=False)

    def train_loss(params, stats, xb, yb, dkeys):
        logits, _ = model.apply({"params": params, "batch_stats": stats}, xb, train=True, dropout_keys=dkeys,
                                mutable=["batch_stats"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean(), None

    def stats_of(params, stats, xb):
        _, upd = model.clone(bn_momentum=0.0, dropout=0.0).apply(
            {"params": params, "batch_stats": stats}, xb, train=True, mutable=["batch_stats"])
        return upd["batch_stats"]

    cfg = from_flat({"instruments.config": "business,MeanGSNR", "instruments.chunk": 8}).instruments
    params = v["params"]
    upd = jax.tree.map(lambda a: 1e-3 * jnp.ones_like(a), params)
    out = {}
    for lw in (True, False):
        inst = for_model(cfg, model, train_loss, stats_of, total_steps=10, layerwise=lw)
        fn = jax.jit(lambda s, p: inst.update(s, p, (x, y, dk), step=1, context=v["batch_stats"], updates=upd,
                                              lr=0.1))
        out[lw] = fn(inst.init(params), params)[1]
    for k in out[True]:
        a, b = np.asarray(out[True][k]), np.asarray(out[False][k])
        if k == "GradHist1d":  # a few elements may sit on a bin edge within float32 rounding
            assert np.abs(a - b).sum() <= 1e-4 * b.sum(), k
        else:
            np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-6, err_msg=k)
