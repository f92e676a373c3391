"""The models' convolution as one primitive with three roles (forward, input gradient, weight
gradient), so that a replica-batched convolution is computed the way a measured table says.

Why a primitive: under ``jax.vmap`` over replicas, ``lax.conv_general_dilated`` with both operands
batched becomes a grouped convolution (``feature_group_count=R``), and so do the two convolutions
of its gradient; that choice is inherited, not made. ``jax.custom_batching.custom_vmap`` can choose
the batched computation but has no reverse mode, and ``custom_vjp`` around it loses forward mode
(which the instruments' ``jax.jvp``/``jax.linearize`` need). A primitive whose three roles are each
other's derivatives and transposes keeps every transformation and gets a batching rule of its own
in every role, so the gradient's convolutions are chosen too:

* ``fwd(x, w) = y``; ``lhs(g, w) = dL/dx`` (the input gradient); ``rhs(x, g) = dL/dw`` (the weight
  gradient). All three are bilinear; each one's transposes are the other two (``defbilinear``).
* Unbatched, each role lowers to exactly the convolutions lax emits (``lhs``/``rhs`` are
  ``jax.linear_transpose`` of lax's convolution), so a single-replica program (the ``sequential``
  strategy) computes bitwise what ``lax.conv_general_dilated`` computes; on CPU, except for a
  convolution XLA would run with its operands swapped (a kernel larger than its input, as in the last
  stage of a ResNet on 8x8 digits, :func:`swapped_by_xla`): that one gets its input's padding applied
  first and runs on XLA:CPU's fast path (the same sums, 8-11x faster, not bitwise lax's).
* Batched over replicas (both operands carry the axis), the role runs one of
  :data:`FORMULATIONS`: ``grouped`` (lax's own batching: a grouped convolution, what ``vmap`` always
  did), ``map`` (``lax.map`` over replicas: R plain convolutions in a loop), ``im2col`` (the k*k
  shifted slices concatenated along channels, one batched GEMM per replica axis), ``shifted`` (k*k
  batched GEMMs on shifted slices, summed), ``bgc`` (the weight gradient only: the replicas folded
  next to the channels and the gradient taken as the transpose of the grouped forward convolution, which
  is one convolution with ``batch_group_count=R``, the form XLA:GPU hands to cuDNN's backward-filter
  kernels; lax's own rule gives a grouped *forward* convolution whose window is the activation map).
  ``im2col``/``shifted`` take the gradients by autodiff of that forward, so their gradients are batched
  GEMMs as well. ``im2col``, ``shifted`` and ``bgc`` apply to 2-D NHWC/HWIO ungrouped convolutions
  without input dilation (the dimension numbers as strings or as the integer
  ``lax.ConvDimensionNumbers`` Flax passes) and fall back to ``grouped`` otherwise; ``bgc`` asked of
  the forward or the input gradient is ``grouped`` too. Only one operand batched (per-example gradients
  vmapped over examples) keeps lax's rule.

The choice per (backend, role, shape family) comes from :mod:`nondet_jax.machine.measured` (written from
``benchmarks/vmap_convs.py``); :func:`forced` or ``NONDET_JAX_VMAP_CONV`` overrides it, for every role
(``grouped``) or per role (``rhs:bgc,fwd:grouped``; roles not named keep the table's choice).
The choice is made when a program is traced: change it before jitting, not between calls of one
jitted function. :func:`record` is what ``environment.json`` stores.
"""

from __future__ import annotations

import contextlib
import os
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from nondet_jax.errors import UsageError
from nondet_jax.machine import measured

FORMULATIONS = ("grouped", "map", "im2col", "shifted", "bgc")
ROLES = ("fwd", "lhs", "rhs")
ENV = "NONDET_JAX_VMAP_CONV"
_forced: str | None = None
NHWC = ("NHWC", "HWIO", "NHWC")


def _hashable(kw: dict) -> tuple:
    """Conv keyword arguments as a hashable, ordered tuple (primitive parameters must hash)."""
    out = dict(kw)
    if not isinstance(out["padding"], str):
        out["padding"] = tuple(tuple(p) for p in out["padding"])
    for k in ("window_strides", "lhs_dilation", "rhs_dilation"):
        out[k] = None if out[k] is None else tuple(out[k])
    dn = out["dimension_numbers"]
    if isinstance(dn, (list, tuple)) and not isinstance(dn, lax.ConvDimensionNumbers):
        out["dimension_numbers"] = tuple(dn)
    return tuple(sorted(out.items()))


# ---------------------------------------------------------------------------- one replica


def _conv(conv: tuple):
    return partial(lax.conv_general_dilated, **dict(conv))


def _lax_role(a, b, *, role, conv, lhs_shape, rhs_shape):
    """One replica's role, as the convolutions lax itself emits for it."""
    c = _conv(conv)
    if role == "fwd":
        return c(a, b)
    if role == "lhs":  # a = output cotangent, b = kernel
        return jax.linear_transpose(lambda x: c(x, b), jax.ShapeDtypeStruct(lhs_shape, b.dtype))(a)[0]
    # rhs: a = input, b = output cotangent
    return jax.linear_transpose(lambda w: c(a, w), jax.ShapeDtypeStruct(rhs_shape, a.dtype))(b)[0]


def _role_impl(a, b, *, role, conv, lhs_shape, rhs_shape, barrier):
    """One replica's role: lax's convolutions; on CPU (``barrier``) none of them left for XLA to run with its
    operands swapped (:func:`unswapped`)."""
    role_fn = partial(_lax_role, role=role, conv=conv, lhs_shape=lhs_shape, rhs_shape=rhs_shape)
    return unswapped(role_fn)(a, b) if barrier else role_fn(a, b)


def swapped_by_xla(lhs_shape, rhs_shape, params: dict) -> bool:
    """Whether XLA would run this convolution (``lax.conv_general_dilated_p``'s ``params``) with its
    operands exchanged: its simplifier (``ConvOperandSwapper``) makes the kernel the input when the kernel's
    spatial extent exceeds the input's, a 3x3 SAME convolution of a 2x2 map for instance (the last stage of
    a ResNet on 8x8 digits). XLA:CPU runs the exchanged convolution on a slow path: ResNet-8's 128x2x2x64 3x3 convolution
    took 4.9 ms against 0.45 ms padded first, its gradients 10.4 against 1.3 ms (one core,
    ``benchmarks/conv_paths.py``). The rule read from
    XLA's ``SwapConvolutionOperandsIfBeneficial``: over the spatial dimensions that are neither a plain
    contraction nor a group, swap when the product of kernel sizes exceeds the product of input sizes."""
    if params["feature_group_count"] > 1 or params["batch_group_count"] > 1:
        return False
    dn = params["dimension_numbers"]
    kernel = inputs = 1
    for i, (ld, rd) in enumerate(zip(dn.lhs_spec[2:], dn.rhs_spec[2:])):
        k, n = rhs_shape[rd], lhs_shape[ld]
        (lo, hi), s = params["padding"][i], params["window_strides"][i]
        bd, wd = params["lhs_dilation"][i], params["rhs_dilation"][i]
        if lo == hi == 0 and wd == 1 and ((bd == k and s == k - 1) or (k == n and bd == s == 1)):
            continue  # a group or a pure contraction dimension: kept as it is by a swap
        kernel *= k
        inputs *= k if n == 1 and s == wd == 1 and lo == hi == k - 1 else n
    return kernel > inputs


def _conv_unswapped(x, w, **params):
    """``lax.conv_general_dilated_p`` of ``x`` and ``w``; where XLA would swap its operands
    (:func:`swapped_by_xla`), ``x``'s padding and dilation are applied first, behind an optimization barrier
    (XLA would fold them back), and the convolution runs unpadded: the same sums, on XLA:CPU's fast path."""
    if not swapped_by_xla(x.shape, w.shape, params):
        return lax.conv_general_dilated_p.bind(x, w, **params)
    dn, spatial = params["dimension_numbers"], len(params["padding"])
    config = [(0, 0, 0)] * x.ndim
    for i, d in enumerate(dn.lhs_spec[2:]):
        config[d] = (*params["padding"][i], params["lhs_dilation"][i] - 1)
    x = lax.optimization_barrier(lax.pad(x, jnp.zeros((), x.dtype), config))
    return lax.conv_general_dilated_p.bind(
        x, w, **{**params, "padding": ((0, 0),) * spatial, "lhs_dilation": (1,) * spatial})


def unswapped(fn):
    """``fn`` with every convolution it emits computed by :func:`_conv_unswapped` (its jaxpr re-evaluated,
    the other equations bound as they are)."""
    from jax.extend.core import Literal

    def run(*args):
        closed = jax.make_jaxpr(fn)(*args)
        env = dict(zip(closed.jaxpr.constvars, closed.consts)) | dict(zip(closed.jaxpr.invars, args))
        read = lambda v: v.val if isinstance(v, Literal) else env[v]  # noqa: E731
        for eqn in closed.jaxpr.eqns:
            ins = [read(v) for v in eqn.invars]
            if eqn.primitive is lax.conv_general_dilated_p:
                outs = [_conv_unswapped(*ins, **eqn.params)]
            else:
                params = eqn.primitive.get_bind_params(eqn.params)  # older jax returned (subfuns, params)
                subfuns, params = params if isinstance(params, tuple) else ((), params)
                outs = eqn.primitive.bind(*subfuns, *ins, **params)
                outs = outs if eqn.primitive.multiple_results else [outs]
            env.update(zip(eqn.outvars, outs))
        out = [read(v) for v in closed.jaxpr.outvars]
        return out[0] if len(out) == 1 else out

    return run


def inside_shard_map(*operands) -> bool:
    """Whether an operand varies over a manual (shard_map) axis: the primitive's transposes do not
    carry those types yet, so the models' convolution uses lax's there (the ``sharded`` strategy)."""
    return any(getattr(getattr(jax.typeof(v), "mat", None), "varying", None) for v in operands)


def _fusion_barrier_transpose(x: jax.Array, perm: tuple[int, ...]) -> jax.Array:
    """``x.transpose(perm)``, computed inside a ``lax.cond`` whose two branches are the same
    function: the value never depends on the predicate, but XLA cannot fuse ``x``'s producers
    into the transpose across the conditional's boundary, so it reads ``x`` once, materialized.

    The predicate must not be foldable at compile time (XLA inlines a conditional whose predicate
    is a constant): ``v == v`` of one element of ``x`` is True unless that element is NaN.
    Under ``vmap`` the predicate is batched, the cond becomes a select of two identical values,
    and XLA simplifies it back to a plain transpose (no barrier, no extra cost).
    """
    v = x[(0,) * x.ndim]
    transpose = lambda a: a.transpose(perm)  # noqa: E731
    return lax.cond(v == v, transpose, transpose, x)


def materialized_for_weight_gradient(x, dimension_numbers, rhs_shape):
    """``x`` (same value) transposed to the weight gradient's layout (feature, spatial..., batch)
    behind :func:`_fusion_barrier_transpose` and back: XLA cancels the pair against the layout its
    weight-gradient convolution wants, so the transpose it runs is one copy of one materialized array."""
    spec = lax.conv_dimension_numbers(x.shape, rhs_shape, dimension_numbers).lhs_spec
    perm = (spec[1], *spec[2:], spec[0])
    inverse = tuple(perm.index(i) for i in range(len(perm)))
    return _fusion_barrier_transpose(x, perm).transpose(inverse)


conv_p = Primitive("nondet_conv")


def _abstract_eval(a, b, **params):
    shape_params = {k: v for k, v in params.items() if k != "barrier"}
    out = jax.eval_shape(partial(_lax_role, **shape_params), jax.ShapeDtypeStruct(a.shape, a.dtype),
                         jax.ShapeDtypeStruct(b.shape, b.dtype))
    # inside shard_map an output varies over every manual axis an operand varies over (as lax's conv)
    ma, mb = getattr(a, "mat", None), getattr(b, "mat", None)
    base = b if ma is not None and mb is not None and not mb.varying <= ma.varying else a
    return base.update(shape=out.shape, dtype=out.dtype, weak_type=False)


conv_p.def_impl(_role_impl)
conv_p.def_abstract_eval(_abstract_eval)
mlir.register_lowering(conv_p, mlir.lower_fun(_role_impl, multiple_results=False))


def _bind(a, b, role, params):
    return conv_p.bind(a, b, **{**params, "role": role})


def _transpose_first(ct, a, b, *, role, **params):
    """Transpose with respect to the first operand (the second is known)."""
    if role == "fwd":  # <fwd(x, w), c> = <x, lhs(c, w)>
        return _bind(ct, b, "lhs", params)
    if role == "lhs":  # <lhs(g, w), c> = <g, fwd(c, w)>
        return _bind(ct, b, "fwd", params)
    return _bind(b, ct, "lhs", params)  # rhs: <rhs(x, g), c> = <fwd(x, c), g> = <x, lhs(g, c)>


def _transpose_second(ct, a, b, *, role, **params):
    """Transpose with respect to the second operand (the first is known)."""
    if role == "fwd":
        return _bind(a, ct, "rhs", params)
    if role == "lhs":  # <lhs(g, w), c> = <w, rhs(c, g)>
        return _bind(ct, a, "rhs", params)
    return _bind(a, ct, "fwd", params)  # rhs: <rhs(x, g), c> = <g, fwd(x, c)>


def _jvp_second(t, a, b, **params):
    # The forward's weight-tangent term convolves the input read across a fusion barrier on CPU
    # (see models.common.conv_general_dilated): its transpose, the weight gradient, reads it materialized.
    if params["role"] == "fwd" and params["barrier"]:
        a = materialized_for_weight_gradient(a, dict(params["conv"])["dimension_numbers"], params["rhs_shape"])
    return conv_p.bind(a, t, **params)


ad.defbilinear(conv_p, _transpose_first, _transpose_second)
ad.defjvp(conv_p, lambda t, a, b, **params: conv_p.bind(t, b, **params), _jvp_second)


# ---------------------------------------------------------------------------- replica-batched


def _nhwc_plain(conv: tuple, lhs_shape: tuple, rhs_shape: tuple) -> bool:
    """Whether the slice and ``bgc`` formulations apply: 2-D, NHWC/HWIO/NHWC (as strings or as the
    integer ``ConvDimensionNumbers`` Flax passes), ungrouped, no input dilation."""
    kw = dict(conv)
    dn = kw["dimension_numbers"]
    if dn is None or len(lhs_shape) != 4:
        return False
    layout = lax.conv_dimension_numbers(lhs_shape, rhs_shape, dn)
    return (layout == lax.conv_dimension_numbers(lhs_shape, rhs_shape, NHWC) and kw["feature_group_count"] == 1
            and kw["batch_group_count"] == 1 and (kw["lhs_dilation"] is None or all(d == 1 for d in kw["lhs_dilation"])))


def applies(form: str, role: str, conv: tuple, lhs_shape: tuple, rhs_shape: tuple) -> str:
    """The formulation that really runs when ``form`` is asked of ``role``: ``form``, or ``grouped``
    where it does not apply (see the module docstring)."""
    if form in ("im2col", "shifted", "bgc") and not _nhwc_plain(conv, lhs_shape, rhs_shape):
        return "grouped"
    if form == "bgc" and role != "rhs":
        return "grouped"
    return form


def _slices(xs, conv: tuple, kernel: tuple[int, int]):
    """The kh*kw strided slices of the padded input ``xs`` (R, N, H, W, C) a convolution reads, in
    (i, j) order, each (R, N, Ho, Wo, C)."""
    kw = dict(conv)
    (kh, kwid), (sh, sw) = kernel, kw["window_strides"]
    dh, dw = kw["rhs_dilation"] or (1, 1)
    h, w = xs.shape[2:4]
    pad = kw["padding"]
    if isinstance(pad, str):
        pad = lax.padtype_to_pads((h, w), ((kh - 1) * dh + 1, (kwid - 1) * dw + 1), (sh, sw), pad)
    zero = jnp.zeros((), xs.dtype)
    xp = lax.pad(xs, zero, [(0, 0, 0), (0, 0, 0), (pad[0][0], pad[0][1], 0), (pad[1][0], pad[1][1], 0), (0, 0, 0)])
    ho = (xp.shape[2] - (kh - 1) * dh - 1) // sh + 1
    wo = (xp.shape[3] - (kwid - 1) * dw - 1) // sw + 1
    r, n, _, _, c = xs.shape
    return [lax.slice(xp, (0, 0, i * dh, j * dw, 0), (r, n, i * dh + (ho - 1) * sh + 1, j * dw + (wo - 1) * sw + 1, c),
                      (1, 1, sh, sw, 1)) for i in range(kh) for j in range(kwid)]


def _dot(a, b, conv: tuple):
    """Batched (over the leading replica axis) product of ``a`` (R, N, Ho, Wo, K) and ``b`` (R, K, F)."""
    kw = dict(conv)
    return lax.dot_general(a, b, (((4,), (1,)), ((0,), (0,))), precision=kw["precision"],
                           preferred_element_type=kw["preferred_element_type"])


def _fwd_im2col(xs, ws, conv):
    kh, kw_, c, f = ws.shape[1:]
    cols = _slices(xs, conv, (kh, kw_))
    patches = cols[0] if len(cols) == 1 else jnp.concatenate(cols, axis=-1)
    return _dot(patches, ws.reshape(ws.shape[0], kh * kw_ * c, f), conv)


def _fwd_shifted(xs, ws, conv):
    kh, kw_ = ws.shape[1:3]
    out = None
    for (i, j), s in zip([(i, j) for i in range(kh) for j in range(kw_)], _slices(xs, conv, (kh, kw_))):
        y = _dot(s, ws[:, i, j], conv)
        out = y if out is None else out + y
    return out


_BATCHED_FWD = {"im2col": _fwd_im2col, "shifted": _fwd_shifted}


def _rhs_bgc(xs, gs, conv: tuple, rhs_shape: tuple):
    """The weight gradients of R replicas' convolutions, ``xs`` (R, N, H, W, C) the inputs and ``gs``
    (R, N, Ho, Wo, F) the output cotangents: the replicas folded next to the channels, the gradient of the
    grouped (``feature_group_count=R``) forward convolution with respect to its kernel, which lax
    transposes into one convolution with ``batch_group_count=R``; returns (R, kh, kw, C, F)."""
    r, n, h, w, c = xs.shape
    f = gs.shape[-1]
    kh, kw_ = rhs_shape[:2]
    x = jnp.moveaxis(xs, 0, 3).reshape(n, h, w, r * c)
    g = jnp.moveaxis(gs, 0, 3).reshape(n, *gs.shape[2:4], r * f)
    grouped = partial(lax.conv_general_dilated, **{**dict(conv), "dimension_numbers": NHWC, "feature_group_count": r})
    kernel = jax.ShapeDtypeStruct((kh, kw_, c, r * f), xs.dtype)
    wt = jax.linear_transpose(lambda k: grouped(x, k), kernel)(g)[0]
    return jnp.moveaxis(wt.reshape(kh, kw_, c, r, f), 3, 0)


def batched_role(form: str, a, b, *, role, conv, lhs_shape, rhs_shape, barrier=False):
    """Role ``role`` for operands both batched on axis 0 (R replicas), computed by formulation ``form``."""
    params = dict(role=role, conv=conv, lhs_shape=lhs_shape, rhs_shape=rhs_shape, barrier=barrier)
    if form not in FORMULATIONS:
        raise ValueError(f"unknown formulation {form!r}; use one of {', '.join(FORMULATIONS)}")
    form = applies(form, role, conv, lhs_shape, rhs_shape)
    if form == "bgc":
        return _rhs_bgc(a, b, conv, rhs_shape)
    if form == "grouped":
        return jax.vmap(partial(_role_impl, **params))(a, b)
    if form == "map":
        return lax.map(lambda ab: _role_impl(*ab, **params), (a, b))
    fwd = partial(_BATCHED_FWD[form], conv=conv)
    r = a.shape[0]
    if role == "fwd":
        return fwd(a, b)
    if role == "lhs":
        return jax.linear_transpose(lambda x: fwd(x, b), jax.ShapeDtypeStruct((r, *lhs_shape), b.dtype))(a)[0]
    return jax.linear_transpose(lambda w: fwd(a, w), jax.ShapeDtypeStruct((r, *rhs_shape), a.dtype))(b)[0]


def family(role: str, conv: tuple, rhs_shape: tuple) -> str:
    """The shape family a table entry is keyed by: role, kernel size, stride, input channels,
    e.g. ``rhs/3x3/s1/c64`` (HWIO kernels; other layouts use the kernel's own dimension order)."""
    kw = dict(conv)
    kernel = "x".join(str(k) for k in rhs_shape[:-2])
    stride = "x".join(str(s) for s in kw["window_strides"]) if len(set(kw["window_strides"])) > 1 \
        else str(kw["window_strides"][0])
    return f"{role}/{kernel}/s{stride}/c{rhs_shape[-2]}"


def parse_override(text: str, source: str = ENV) -> dict[str, str]:
    """``"grouped"`` -> that formulation for every role; ``"rhs:bgc,fwd:grouped"`` -> those roles only.
    A bad entry is a one-line :class:`UsageError` naming it."""
    out = {}
    for item in (i.strip() for i in text.split(",") if i.strip()):
        role, sep, form = item.rpartition(":")
        if form not in FORMULATIONS:
            raise UsageError(f"{source}={text!r}: {form!r} is not a conv formulation; use one of "
                             f"{', '.join(FORMULATIONS)}, for every role or per role as rhs:bgc,fwd:grouped")
        if sep and role not in ROLES:
            raise UsageError(f"{source}={text!r}: {role!r} is not a convolution role; use {', '.join(ROLES)}")
        out.update({role: form} if sep else dict.fromkeys(ROLES, form))
    return out


def override() -> dict[str, str]:
    """The per-role formulations forced now (:func:`forced`, else ``NONDET_JAX_VMAP_CONV``); {} for none."""
    if _forced is not None:
        return parse_override(_forced, "forced")
    return parse_override(os.environ.get(ENV) or "")


def choose(role: str, conv: tuple, rhs_shape: tuple, backend: str | None = None) -> str:
    """The formulation asked of one role of a replica-batched convolution: :func:`forced` or the
    ``NONDET_JAX_VMAP_CONV`` environment variable where it names the role, else the measured table's
    entry for the most specific key that exists (``role/kernel/stride/channels``, then
    ``role/kernel/stride``, then ``role``), else ``grouped`` (what ``vmap`` did before a table existed)."""
    forced_now = override()
    if role in forced_now:
        return forced_now[role]

    choices = measured.vmap_conv_choices(backend or jax.default_backend())
    key = family(role, conv, rhs_shape)
    for k in (key, key.rsplit("/", 1)[0], role):
        if k in choices:
            return choices[k]
    return "grouped"


def _batch_rule(args, dims, **params):
    a, b = args
    da, db = dims
    if da is None or db is None:  # one operand per replica only (e.g. per-example gradients): lax's rule
        return jax.vmap(partial(_role_impl, **params), in_axes=(da, db))(a, b), 0
    a, b = jnp.moveaxis(a, da, 0), jnp.moveaxis(b, db, 0)
    form = choose(params["role"], params["conv"], params["rhs_shape"])
    return batched_role(form, a, b, **params), 0


batching.primitive_batchers[conv_p] = _batch_rule


def conv(lhs, rhs, *, barrier: bool = False, **kw):
    """``lax.conv_general_dilated(lhs, rhs, **kw)`` through the primitive (same value and derivatives)."""
    conv_kw = _hashable(kw)
    return conv_p.bind(lhs, rhs, role="fwd", conv=conv_kw, lhs_shape=tuple(lhs.shape), rhs_shape=tuple(rhs.shape),
                       barrier=barrier)


@contextlib.contextmanager
def forced(form: str | None):
    """Within the block, every replica-batched convolution traced uses ``form``: one formulation for
    every role or per-role choices (``"rhs:bgc"``, as ``NONDET_JAX_VMAP_CONV``); None: the table."""
    global _forced
    if form is not None:
        parse_override(form, "forced")
    old, _forced = _forced, form
    try:
        yield
    finally:
        _forced = old


def record(backend: str | None = None) -> dict:
    """What ``environment.json`` stores: the override in force and the table used for this backend."""
    backend = backend or jax.default_backend()
    return {"override": _forced or os.environ.get(ENV) or None, "per_role": override(), "backend": backend,
            "table": measured.vmap_conv_table(backend)}
