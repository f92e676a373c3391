"""The replica-batched convolution (nondet_jax.models.convs): every formulation is the plain vmap's value and
derivatives within float tolerance; the choice follows the override, then the measured table."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from nondet_jax.models import convs
from nondet_jax.models.common import conv_general_dilated

CASES = [  # kernel, stride, padding, rhs dilation
    (3, 1, "SAME", 1), (3, 2, "SAME", 1), (1, 2, "SAME", 1), (3, 2, ((1, 1), (0, 1)), 1), (3, 1, "VALID", 2)]


def _operands(k, r=3, n=2, size=7, cin=4, cout=5):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((r, n, size, size, cin)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((r, k, k, cin, cout)) / (k * np.sqrt(cin)), jnp.float32)
    return x, w


@pytest.mark.parametrize("form", convs.FORMULATIONS)
@pytest.mark.parametrize("k,stride,padding,dilation", CASES)
def test_every_formulation_is_the_plain_vmap_value_and_gradients(form, k, stride, padding, dilation):
    """Forward, input gradient and weight gradient of vmap over replicas (both operands batched)
    agree with vmap of lax.conv_general_dilated within float32 rounding, and so does a JVP."""
    x, w = _operands(k)
    kw = dict(window_strides=(stride, stride), padding=padding, rhs_dilation=(dilation, dilation),
              dimension_numbers=("NHWC", "HWIO", "NHWC"))

    def outputs(conv):
        f = lambda a, b: conv(a, b, **kw)  # noqa: E731
        loss = lambda a, b: jnp.sum(jnp.tanh(f(a, b)) ** 2)  # noqa: E731
        jvp = lambda a, b: jax.jvp(f, (a, b), (0.5 * a, 0.25 * b))[1]  # noqa: E731
        return jax.jit(jax.vmap(lambda a, b: (f(a, b), *jax.grad(loss, argnums=(0, 1))(a, b), jvp(a, b))))(x, w)

    reference = outputs(lax.conv_general_dilated)
    with convs.forced(form):
        got = outputs(conv_general_dilated)
    for name, a, b in zip(("forward", "input gradient", "weight gradient", "jvp"), reference, got):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-4, err_msg=f"{form} {name}")


@pytest.mark.parametrize("form", ("im2col", "map"))
def test_second_order_through_a_formulation(form):
    """A Hessian-vector product (forward over reverse, as HessMaxEV) of a replica-batched conv matches lax."""
    x, w = _operands(3, r=2)
    kw = dict(window_strides=(1, 1), padding="SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))

    def hvp(conv):
        loss = lambda a, b: jnp.sum(jnp.tanh(conv(a, b, **kw)) ** 2)  # noqa: E731
        g = jax.grad(loss, argnums=1)
        return jax.jit(jax.vmap(lambda a, b: jax.jvp(lambda v: g(a, v), (b,), (b,))[1]))(x, w)

    ref = hvp(lax.conv_general_dilated)
    with convs.forced(form):
        np.testing.assert_allclose(np.asarray(hvp(conv_general_dilated)), np.asarray(ref), rtol=1e-4, atol=1e-4)


def test_slice_formulations_fall_back_to_grouped_where_they_do_not_apply():
    """Grouped (depthwise) convolutions have no im2col formulation: the result is lax's."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((2, 2, 6, 6, 4)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((2, 3, 3, 1, 4)), jnp.float32)
    kw = dict(window_strides=(1, 1), padding="SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"),
              feature_group_count=4)
    ref = jax.vmap(lambda a, b: lax.conv_general_dilated(a, b, **kw))(x, w)
    with convs.forced("im2col"):
        got = jax.vmap(lambda a, b: conv_general_dilated(a, b, **kw))(x, w)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))


def test_choice_order_override_then_table_then_grouped(monkeypatch):
    conv = convs._hashable(dict(window_strides=(1, 1), padding="SAME", lhs_dilation=None, rhs_dilation=None,
                                dimension_numbers=("NHWC", "HWIO", "NHWC"), feature_group_count=1,
                                batch_group_count=1, precision=None, preferred_element_type=None))
    shape = (3, 3, 16, 16)
    assert convs.family("rhs", conv, shape) == "rhs/3x3/s1/c16"
    monkeypatch.delenv(convs.ENV, raising=False)
    table = {"rhs/3x3/s1/c16": "im2col", "fwd/3x3/s1": "map", "lhs": "shifted"}
    monkeypatch.setattr("nondet_jax.machine.measured.vmap_conv_choices", lambda backend: table)
    assert convs.choose("rhs", conv, shape) == "im2col"  # exact family
    assert convs.choose("fwd", conv, shape) == "map"  # kernel and stride
    assert convs.choose("lhs", conv, shape) == "shifted"  # role
    monkeypatch.setattr("nondet_jax.machine.measured.vmap_conv_choices", lambda backend: {})
    assert convs.choose("rhs", conv, shape) == "grouped"  # unmeasured: what vmap always did
    monkeypatch.setenv(convs.ENV, "map")
    assert convs.choose("rhs", conv, shape) == "map"
    with convs.forced("shifted"):
        assert convs.choose("rhs", conv, shape) == "shifted"
    monkeypatch.setenv(convs.ENV, "winograd")
    from nondet_jax.errors import UsageError

    with pytest.raises(UsageError, match="NONDET_JAX_VMAP_CONV"):
        convs.choose("rhs", conv, shape)


def test_environment_records_the_conv_choice_and_cpu_flags():
    from nondet_jax.study.provenance import environment

    env = environment()
    assert env["vmap_conv"]["backend"] == jax.default_backend()
    assert "table" in env["vmap_conv"] and "override" in env["vmap_conv"]
    assert env["xla_cpu_defaults"]["cpu_type"]


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the operand swap is avoided on CPU only")
def test_no_convolution_runs_with_swapped_operands_on_cpu():
    """A 3x3 SAME convolution of a 2x2 map (ResNet-8's last stage on digits): XLA swaps lax's operands
    (kernel as input: a slow path on CPU), in the forward and the input gradient; the models'
    convolution pads the input first, so no convolution of its step is swapped, and the values and
    both gradients are lax's within float32 rounding. A convolution XLA does not swap is bitwise lax's."""
    rng = np.random.default_rng(2)
    kw = dict(window_strides=(1, 1), padding="SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))

    def step(conv, size, stride=1):
        x = jnp.asarray(rng.standard_normal((4, size, size, 8)), jnp.float32)
        w = jnp.asarray(rng.standard_normal((3, 3, 8, 8)) / 8, jnp.float32)
        f = lambda a, b: conv(a, b, **{**kw, "window_strides": (stride, stride)})  # noqa: E731
        fn = jax.jit(lambda a, b: (f(a, b), *jax.grad(lambda a, b: jnp.sum(jnp.tanh(f(a, b)) ** 2), (0, 1))(a, b)))
        # a swapped convolution: the kernel as input (dim_labels=01fb_o01i->f01b), its window reversed
        swapped = [line for line in fn.lower(x, w).compile().as_text().splitlines()
                   if " convolution(" in line and "rhs_reversal" in line]
        return fn(x, w), swapped

    conv_params = lambda size: dict(  # noqa: E731
        window_strides=(1, 1), padding=((1, 1), (1, 1)), lhs_dilation=(1, 1), rhs_dilation=(1, 1),
        dimension_numbers=lax.conv_dimension_numbers((4, size, size, 8), (3, 3, 8, 8), ("NHWC", "HWIO", "NHWC")),
        feature_group_count=1, batch_group_count=1)
    assert convs.swapped_by_xla((4, 2, 2, 8), (3, 3, 8, 8), conv_params(2))
    assert not convs.swapped_by_xla((4, 8, 8, 8), (3, 3, 8, 8), conv_params(8))
    state = rng.bit_generator.state
    ref, ref_swapped = step(lax.conv_general_dilated, 2)
    rng.bit_generator.state = state
    got, got_swapped = step(conv_general_dilated, 2)
    assert ref_swapped and not got_swapped, (ref_swapped, got_swapped)
    for a, b in zip(ref, got):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-5)
    state = rng.bit_generator.state
    ref, _ = step(lax.conv_general_dilated, 8)
    rng.bit_generator.state = state
    got, _ = step(conv_general_dilated, 8)
    for a, b in zip(ref, got):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a))
