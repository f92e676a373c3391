"""Model shapes, depths, width multiplier and per-example dropout."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from nondet_jax.models import MODELS, make_model
from nondet_jax.models.common import example_dropout


def n_convs(params) -> int:
    return sum(1 for k in traverse_util.flatten_dict(params) if k[-1] == "kernel" and "conv" in "/".join(k).lower()
               and "shortcut" not in "/".join(k))


@pytest.mark.parametrize("name,depth", [("resnet8", 8), ("resnet14", 14), ("resnet20", 20), ("resnet18", 18),
                                        ("resnet18_imagenet", 18), ("resnet50", 50), ("resnet29v2", 29)])
def test_resnet_depth_counts_weighted_layers(name, depth):
    v = jax.eval_shape(lambda: make_model(name, 10).init(jax.random.key(0), jnp.zeros((1, 8, 8, 1))))
    # depth = convolutions on the main path + the classifier
    assert n_convs(v["params"]) + 1 == depth


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("shape", [(8, 8, 1), (32, 32, 3)])
def test_models_map_images_to_logits_and_features(name, shape):
    if name in ("resnet56", "resnet18", "resnet50", "vgg11", "shufflenetv2") and shape[0] == 32:
        pytest.skip("large model at 32x32: covered at 8x8")
    model = make_model(name, 10)
    x = jnp.ones((2,) + shape)
    v = model.init(jax.random.key(0), x, train=False)
    logits, feats = model.apply(v, x, train=False, return_features=True)
    assert logits.shape == (2, 10) and feats.ndim == 2 and logits.dtype == jnp.float32


def test_width_multiplier_scales_channels():
    v1 = jax.eval_shape(lambda: make_model("resnet8", 10).init(jax.random.key(0), jnp.zeros((1, 8, 8, 1))))
    v2 = jax.eval_shape(lambda: make_model("resnet8", 10, width=2).init(jax.random.key(0), jnp.zeros((1, 8, 8, 1))))
    assert v1["params"]["stem_conv"]["kernel"].shape[-1] == 16
    assert v2["params"]["stem_conv"]["kernel"].shape[-1] == 32
    assert v2["params"]["head"]["classifier"]["kernel"].shape[0] == 128


def test_batchnorm_state_is_per_model_and_updates_in_training():
    model = make_model("resnet8", 10)
    x = jax.random.normal(jax.random.key(1), (4, 8, 8, 1))
    v = model.init(jax.random.key(0), x, train=False)
    _, upd = model.apply(v, x, train=True, mutable=["batch_stats"])
    before = jax.tree.leaves(v["batch_stats"])
    after = jax.tree.leaves(upd["batch_stats"])
    assert any(not np.array_equal(a, b) for a, b in zip(before, after))


def test_example_dropout_masks_follow_their_keys():
    keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(jax.random.key(0), jnp.arange(6))
    x = jnp.ones((6, 50))
    out = example_dropout(x, keys, 0.5)
    perm = jnp.array([3, 1, 5, 0, 2, 4])
    out_perm = example_dropout(x[perm], keys[perm], 0.5)
    assert np.array_equal(np.asarray(out)[np.asarray(perm)], np.asarray(out_perm))
    assert set(np.unique(np.asarray(out))) <= {0.0, 2.0}


def test_dropout_head_needs_keys_in_training():
    model = make_model("mlp", 10, dropout=0.3)
    x = jnp.ones((2, 8, 8, 1))
    v = model.init(jax.random.key(0), x)
    with pytest.raises(ValueError, match="dropout_keys"):
        model.apply(v, x, train=True)


def test_shufflenet_channel_shuffle_interleaves_halves():
    from nondet_jax.models.shufflenet import channel_shuffle

    x = jnp.arange(6.0).reshape(1, 1, 1, 6)
    assert channel_shuffle(x).ravel().tolist() == [0, 3, 1, 4, 2, 5]


def test_vgg11_has_eight_convolutions_and_survives_8x8_inputs():
    v = jax.eval_shape(lambda: make_model("vgg11", 10).init(jax.random.key(0), jnp.zeros((1, 8, 8, 1))))
    assert sum(1 for k in traverse_util.flatten_dict(v["params"]) if k[-1] == "kernel") == 9  # 8 conv + classifier


@pytest.mark.parametrize("name", ["resnet8", "vgg11", "resnet29v2", "shufflenetv2", "resnet18_imagenet", "resnet50"])
@pytest.mark.parametrize("strategy", ["sequential", "vmap"])
def test_every_model_trains_under_every_strategy(small_digits, name, strategy):
    """The small model trains for real under each strategy (replicas differ, losses finite); the large ones are
    traced through the same epoch, vmapped over the replica axis for ``vmap`` (jax.eval_shape: every shape and
    the per-example dropout and augmentation paths, without compiling programs that take seconds each)."""
    from conftest import spec_of, tiny_config

    from nondet_jax.replicas.choice import run_replicas
    from nondet_jax.sources import arm_keys, arm_sources, perturbations
    from nondet_jax.train import make_train

    data = small_digits._replace(x_train=small_digits.x_train[:64], y_train=small_digits.y_train[:64])
    config = tiny_config(**{"model.name": name, "model.width": 0.25, "train.epochs": 1, "train.batch_size": 32,
                            "model.dropout": 0.1, "data.augment": "on"})
    varied = arm_sources("all")
    fns, keys, perturb = make_train(config, spec_of(data)), arm_keys(0, varied, 2), perturbations(varied)
    if name == "resnet8":
        res = run_replicas(fns, keys, perturb, data, 1, strategy)
        assert np.isfinite(res.train_loss).all() and res.logits.shape == (2, 100, 10)
        assert not np.array_equal(res.logits[0], res.logits[1])
        return
    x, y, e = jnp.asarray(data.x_train), jnp.asarray(data.y_train), jnp.int32(0)
    if strategy == "vmap":
        state = jax.eval_shape(jax.vmap(fns.init, in_axes=(0, None, None)), keys, perturb, x[:1])
        new, m = jax.eval_shape(jax.vmap(fns.train_epoch, in_axes=(0, None, None, 0, None, None)),
                                state, x, y, keys, perturb, e)
        logits, feats = jax.eval_shape(jax.vmap(fns.evaluate, in_axes=(0, None)), new, jnp.asarray(data.x_test))
        lead = (2,)
    else:
        one = jax.tree.map(lambda k: k[0], keys)
        state = jax.eval_shape(fns.init, one, perturb, x[:1])
        new, m = jax.eval_shape(fns.train_epoch, state, x, y, one, perturb, e)
        logits, feats = jax.eval_shape(fns.evaluate, new, jnp.asarray(data.x_test))
        lead = ()
    assert jax.tree.map(lambda a: (a.shape, a.dtype), new) == jax.tree.map(lambda a: (a.shape, a.dtype), state)
    assert m["loss"].shape == lead + (fns.steps_per_epoch,) and logits.shape == lead + (100, 10)
    assert feats.ndim == len(lead) + 2 and feats.shape[:-1] == lead + (100,)


@pytest.mark.parametrize("k,stride,padding,groups", [(3, 1, "SAME", 1), (3, 2, "SAME", 1), (1, 2, "SAME", 1),
                                                     (3, 2, ((1, 1), (0, 1)), 1), (3, 1, "SAME", 2)])
def test_conv_matches_lax_in_value_and_every_derivative(k, stride, padding, groups):
    """The models' convolution (a fusion barrier before the weight gradient on CPU) is
    lax.conv_general_dilated: value, gradients, JVP, Hessian-vector product and vmapped
    gradient agree bitwise in float64 (the same convolutions run), grouped or not."""
    from jax import lax

    from nondet_jax.models.common import conv_general_dilated

    with jax.enable_x64(True):
        rng = np.random.default_rng(0)
        x = jnp.asarray(rng.standard_normal((2, 7, 7, 4)))
        w = jnp.asarray(rng.standard_normal((k, k, 4 // groups, 6)))
        kw = dict(window_strides=(stride, stride), padding=padding, dimension_numbers=("NHWC", "HWIO", "NHWC"),
                  feature_group_count=groups)

        def derivatives(conv):
            f = lambda a, b: conv(a, b, **kw)  # noqa: E731
            loss = lambda a, b: jnp.sum(jnp.tanh(f(a, b)) ** 2)  # noqa: E731
            tx, tw = 0.3 * jnp.ones_like(x), 0.7 * jnp.ones_like(w)
            return [f(x, w), *jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w),
                    jax.jvp(f, (x, w), (tx, tw))[1],
                    jax.linearize(jax.grad(loss, argnums=1), x, w)[1](tx, tw),
                    jax.vmap(jax.grad(loss, argnums=1), in_axes=(0, None))(jnp.stack([x, 2 * x]), w),
                    jax.grad(lambda b: loss(x, b))(w)]

        for a, b in zip(derivatives(lax.conv_general_dilated), derivatives(conv_general_dilated)):
            assert a.dtype == jnp.float64
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_conv_weight_gradient_reads_its_input_across_a_conditional_on_cpu():
    """The fusion barrier survives compilation: the weight gradient's transpose sits in a conditional."""
    from nondet_jax.models.common import conv_general_dilated

    if jax.default_backend() != "cpu":
        pytest.skip("CPU only")
    x, w = jnp.ones((2, 8, 8, 4)), jnp.ones((3, 3, 4, 4))
    loss = lambda a, b: jnp.sum(jax.nn.relu(conv_general_dilated(jax.nn.relu(a), b, (1, 1), "SAME",  # noqa: E731
                                                                 dimension_numbers=("NHWC", "HWIO", "NHWC"))))
    hlo = jax.jit(jax.grad(loss, argnums=1)).lower(x, w).compile().as_text()
    assert "conditional(" in hlo


def test_model_names_without_flax_match_the_catalogue():
    """The config checks model names before JAX starts (nondet_jax.models.MODEL_NAMES); they must be the
    catalogue's, in its order."""
    from nondet_jax import models

    assert models.MODEL_NAMES == tuple(MODELS)
    assert models.PRECISION_NAMES == tuple(models.PRECISIONS)
