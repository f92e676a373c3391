"""Replica-batched convolutions in the real models: the formulation asked for is the one that runs (read
from the lowered program, not from values), the backward-filter form (``bgc``) equals ``grouped`` in
float64, per-role choices, and the fused-loop strategy (``unrolled``) against ``sequential``."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import one_replica
from jax import lax

from nondet_jax.config import from_flat
from nondet_jax.errors import UsageError
from nondet_jax.models import convs
from nondet_jax.models.common import conv_general_dilated
from nondet_jax.replicas.choice import make_strategy
from nondet_jax.sources import arm_keys, arm_sources, perturbations
from nondet_jax.train import DataSpec, make_train

R = 2
SPEC = DataSpec(64, (8, 8, 3), 10, "random")
VARIED = arm_sources("all")


def _resnet8():
    return make_train(from_flat({"model.name": "resnet8", "model.width": 0.5, "train.batch_size": 32,
                                 "data.augment": "on"}), SPEC)


def _data(n=64):
    rng = np.random.default_rng(0)
    return (jnp.asarray(rng.standard_normal((n, 8, 8, 3)), jnp.float32),
            jnp.asarray(rng.integers(0, 10, n), jnp.int32))


def _lowered_step(fns, form):
    """StableHLO of one vmapped training step of R replicas with ``form`` forced."""
    x, y = _data()
    keys, perturb = arm_keys(0, VARIED, R), perturbations(VARIED)
    with convs.forced(form):
        state = jax.vmap(fns.init, in_axes=(0, None, None))(keys, perturb, x[:1])
        step = jax.vmap(fns.train_step, in_axes=(0, None, None, 0, None, None, None, None))
        return jax.jit(step).lower(state, x, y, keys, perturb, jnp.int32(0), jnp.int32(0),
                                   jnp.arange(fns.batch_size)).as_text()


def _convolutions(hlo: str) -> list[tuple[int, int]]:
    """(batch_group_count, feature_group_count) of every convolution in a StableHLO module."""
    return [(int(b), int(f)) for b, f in re.findall(r"stablehlo\.convolution.*?batch_group_count = (\d+) : i64, "
                                                    r"feature_group_count = (\d+) : i64", hlo)]


def _kernels(fns) -> int:
    x, _ = _data()
    state = fns.init(*one_replica(VARIED), x[:1])
    return sum(1 for leaf in jax.tree.leaves(state.params) if leaf.ndim == 4)


@pytest.fixture(scope="module")
def resnet():
    return _resnet8()


def test_flax_passes_integer_dimension_numbers(resnet):
    # the reason the slice formulations silently fell back to grouped: Flax's nn.Conv passes
    # ConvDimensionNumbers of integers, not the string form
    seen = []
    real = convs.conv_p.bind

    def spy(*args, **params):
        seen.append(dict(params["conv"])["dimension_numbers"])
        return real(*args, **params)

    x, _ = _data()
    convs.conv_p.bind = spy
    try:
        jax.eval_shape(lambda: resnet.init(*one_replica(VARIED), x[:1]))
    finally:
        convs.conv_p.bind = real
    assert seen and all(isinstance(d, lax.ConvDimensionNumbers) for d in seen)


def test_the_formulation_asked_for_is_the_one_that_runs(resnet):
    layers = _kernels(resnet)
    grouped = _convolutions(_lowered_step(resnet, "grouped"))
    # forward, input gradient (not of the first layer) and weight gradient: all grouped over R
    assert len(grouped) >= 2 * layers and all(f == R and b == 1 for b, f in grouped)
    bgc = _convolutions(_lowered_step(resnet, "rhs:bgc"))
    assert sum(1 for b, f in bgc if b == R and f == 1) == layers  # every weight gradient in backward-filter form
    assert sum(1 for b, f in bgc if f == R) == len(grouped) - layers  # forward and input gradients still grouped
    for form in ("im2col", "shifted"):
        hlo = _lowered_step(resnet, form)
        assert _convolutions(hlo) == [], form  # GEMMs only
        assert "stablehlo.dot_general" in hlo
    mapped = _lowered_step(resnet, "map")
    assert "stablehlo.while" in mapped and all(f == 1 and b == 1 for b, f in _convolutions(mapped))


@pytest.mark.parametrize("k,stride,padding", [(3, 1, "SAME"), (3, 2, "SAME"), (3, 1, "VALID"), (3, 2, "VALID"),
                                              (1, 2, "SAME"), (3, 2, ((1, 0), (0, 2)))])
def test_backward_filter_form_equals_grouped_in_float64(k, stride, padding):
    with jax.enable_x64(True):
        rng = np.random.default_rng(k + stride)
        x = jnp.asarray(rng.standard_normal((3, 2, 9, 9, 4)))
        w = jnp.asarray(rng.standard_normal((3, k, k, 4, 5)))
        dn = lax.conv_dimension_numbers(x.shape[1:], w.shape[1:], ("NHWC", "HWIO", "NHWC"))  # as Flax passes
        kw = dict(window_strides=(stride, stride), padding=padding, dimension_numbers=dn)

        def outputs():
            f = lambda a, b: conv_general_dilated(a, b, **kw)  # noqa: E731
            loss = lambda a, b: jnp.sum(jnp.tanh(f(a, b)) ** 2)  # noqa: E731
            g = jax.grad(loss, argnums=1)
            hvp = lambda a, b: jax.jvp(lambda v: g(a, v), (b,), (0.5 * b,))[1]  # noqa: E731  HessMaxEV's product
            jvp = lambda a, b: jax.jvp(f, (a, b), (0.5 * a, 0.25 * b))[1]  # noqa: E731
            return jax.jit(jax.vmap(lambda a, b: (*jax.grad(loss, argnums=(0, 1))(a, b), hvp(a, b), jvp(a, b))))(x, w)

        with convs.forced("grouped"):
            ref = outputs()
        with convs.forced("rhs:bgc"):
            got = outputs()
        for name, a, b in zip(("input gradient", "weight gradient", "hvp", "jvp"), ref, got):
            assert a.dtype == jnp.float64
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-12, atol=1e-12, err_msg=name)


def test_per_role_choices():
    assert convs.parse_override("rhs:bgc,fwd:grouped") == {"rhs": "bgc", "fwd": "grouped"}
    assert convs.parse_override("map") == dict.fromkeys(convs.ROLES, "map")
    assert convs.parse_override("im2col,rhs:bgc") == {"fwd": "im2col", "lhs": "im2col", "rhs": "bgc"}
    for bad, word in (("rhs:winograd", "winograd"), ("grad:bgc", "grad"), ("winograd", "winograd")):
        with pytest.raises(UsageError, match=word):
            convs.parse_override(bad)
    with convs.forced("rhs:bgc"):
        assert convs.override() == {"rhs": "bgc"} and convs.record()["per_role"] == {"rhs": "bgc"}
    assert convs.applies("bgc", "fwd", convs._hashable(dict(
        window_strides=(1, 1), padding="SAME", lhs_dilation=None, rhs_dilation=None,
        dimension_numbers=("NHWC", "HWIO", "NHWC"), feature_group_count=1, batch_group_count=1, precision=None,
        preferred_element_type=None)), (2, 8, 8, 3), (3, 3, 3, 4)) == "grouped"


def _train(fns, strategy, keys, epochs=2):
    x, y = _data()
    perturb = perturbations(VARIED)
    s = make_strategy(fns, strategy)
    state = s.init(keys, perturb, x[:1])
    for e in range(epochs):
        state, _ = s.epoch(state, x, y, keys, perturb, e, lambda n: None)
    return jax.device_get(state.params), jax.device_get(s.evaluate(state, x)[0])


def test_unrolled_is_bitwise_sequential(resnet):
    keys = arm_keys(0, VARIED, 3)
    seq, unr = _train(resnet, "sequential", keys), _train(resnet, "unrolled", keys)
    for a, b in zip(jax.tree.leaves(seq), jax.tree.leaves(unr)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _identical_keys_run(resnet, strategy, form):
    keys = jax.tree.map(lambda k: jnp.repeat(k, 3, 0), arm_keys(0, VARIED, 1))
    with convs.forced(form):
        params, logits = _train(resnet, strategy, keys, epochs=1)
    return [np.asarray(leaf) for leaf in [*jax.tree.leaves(params), logits]]


@pytest.mark.parametrize("strategy,form", [("vmap", "grouped"), ("unrolled", None)])
def test_replicas_with_identical_keys_come_out_identical(resnet, strategy, form):
    for leaf in _identical_keys_run(resnet, strategy, form):
        assert (leaf == leaf[:1]).all()


def test_backward_filter_form_with_identical_keys_agrees_to_rounding(resnet):
    # At these shapes XLA:CPU's batch_group_count convolution sums a replica's weight gradient in an
    # order that depends on its position: replicas with identical keys agree to float32 rounding, not
    # bitwise (at other shapes they are bitwise), so replica_speed.py's invariance check decides before
    # auto may choose it on a backend.
    for leaf in _identical_keys_run(resnet, "vmap", "rhs:bgc"):
        np.testing.assert_allclose(leaf, np.broadcast_to(leaf[:1], leaf.shape), rtol=1e-5, atol=1e-6)
