"""Per-example gradients of flax linen models from one batched backward pass (BackPACK-style).

When examples do not interact (the per-example loss of :mod:`.trainer`: the model in inference
mode, BatchNorm with fixed statistics), the gradient of the *summed* loss with respect to a layer's
output holds, in row ``i``, example ``i``'s own output gradient ``delta_i``. Each parameterised
layer's per-example parameter gradient is then a small batched product of its input and
``delta_i``, with no ``vmap(grad)`` (which turns every convolution's weight gradient into a
grouped convolution, slow on XLA:CPU):

* ``nn.Dense``: kernel ``sum_p x_ip delta_ip^T`` (``p`` runs over any axes between the batch and
  feature axes), bias ``sum_p delta_ip``;
* ``nn.Conv``: kernel ``sum_p patch_ip delta_ip^T``, with ``patch_ip`` the input window that output
  position ``p`` sees (im2col by strided slices of the padded input, so no convolution runs inside
  the chunk loop; strides, kernel dilation, explicit or SAME/VALID padding and
  ``feature_group_count`` are supported), bias ``sum_p delta_ip``;
* ``nn.BatchNorm`` with running averages (the fixed statistics): scale ``sum_p delta_ip * xhat_ip``
  with ``xhat = (x - mean) / sqrt(var + epsilon)``, bias ``sum_p delta_ip``.

How: a flax method interceptor records each supported layer's input and adds a zero tensor
``eps[path]`` to its output; ``grad`` of the summed loss with respect to ``eps`` is ``delta``. A
first, shape-only trace checks that every parameter belongs to exactly one supported layer call
with supported settings; otherwise :func:`per_example_pass` returns None and the caller falls back
to ``vmap(grad)`` (:func:`.per_example.per_example_pass`). What the check cannot see, and callers
must guarantee: that ``losses_fn`` treats examples independently (no batch statistics, no
attention across the batch).

Memory: the backward pass holds the batch's activations (as a training step); per-example
gradients are formed ``chunk`` examples at a time (``chunk x P`` floats, plus a chunk's im2col
patches), and only running sums leave each chunk, as in :mod:`.per_example`.
"""

from __future__ import annotations

import itertools
from typing import Callable, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen.linear import canonicalize_padding

from nondet_jax.instruments.per_example import (PerExampleStats, add_chunk, chunk_size, init_sums, matmul_sum,
                                                over_chunks, split_chunks)
from nondet_jax.models import common


# Convolution functions an nn.Conv may be given that compute exactly lax.conv_general_dilated's
# value (the CPU wrapper in models.common only changes how XLA schedules its weight gradient).
SAME_AS_LAX_CONV = (None, jax.lax.conv_general_dilated, common.conv_general_dilated)


class Unsupported(Exception):
    """A layer, setting or parameter layout the layerwise path does not handle (fall back to vmap)."""


class _Call(NamedTuple):
    module: nn.Module
    params: tuple[str, ...]  # the parameter names this call uses
    out: jax.ShapeDtypeStruct


def _spatial_tuple(v, n: int) -> tuple[int, ...]:
    if v is None:
        return (1,) * n
    return (v,) * n if isinstance(v, int) else tuple(v)


# ---- per layer type: check the call, say what to record, turn (record, delta) into gradients ----

def _kernel_size(m: nn.Conv) -> tuple[int, ...]:
    return (m.kernel_size,) if isinstance(m.kernel_size, int) else tuple(m.kernel_size)


def _conv_check(m: nn.Conv, x) -> tuple[str, ...]:
    n = len(_kernel_size(m))
    if (not m.shared_weights or m.mask is not None or m.conv_general_dilated not in SAME_AS_LAX_CONV
            or m.conv_general_dilated_cls is not None or x.ndim != n + 2
            or _spatial_tuple(m.input_dilation, n) != (1,) * n):
        raise Unsupported(f"convolution settings of {m.path}")
    pad = canonicalize_padding(m.padding, n)
    if isinstance(pad, str) and pad.upper() not in ("SAME", "VALID", "SAME_LOWER"):
        raise Unsupported(f"padding {pad} of {m.path}")
    return ("kernel", "bias") if m.use_bias else ("kernel",)


def _patches(m: nn.Conv, x, out_spatial: tuple[int, ...]):
    """im2col: ``(c, P, K, C)``, the input window of each of the ``P`` output positions, window
    positions ``K`` in row-major kernel order (the kernel's HW...IO layout flattened)."""
    ksize = _kernel_size(m)
    n = len(ksize)
    strides, dil = _spatial_tuple(m.strides, n), _spatial_tuple(m.kernel_dilation, n)
    pad = canonicalize_padding(m.padding, n)
    if isinstance(pad, str):
        dilated = tuple((k - 1) * d + 1 for k, d in zip(ksize, dil))
        pad = jax.lax.padtype_to_pads(x.shape[1:-1], dilated, strides, pad.upper())
    x = jax.lax.pad(x, jnp.zeros((), x.dtype), [(0, 0, 0)] + [(lo, hi, 0) for lo, hi in pad] + [(0, 0, 0)])
    windows = []
    for offset in itertools.product(*(range(k) for k in ksize)):
        start = [0] + [o * d for o, d in zip(offset, dil)] + [0]
        limit = [x.shape[0]] + [s + (q - 1) * st + 1 for s, q, st in zip(start[1:], out_spatial, strides)] + [x.shape[-1]]
        windows.append(jax.lax.slice(x, start, limit, [1] + list(strides) + [1]))
    w = jnp.stack(windows, axis=-2)  # (c, *out_spatial, K, C)
    return w.reshape((w.shape[0], -1) + w.shape[-2:])


def _conv_grads(m: nn.Conv, x, delta, params):
    kernel = params["kernel"]
    g = m.feature_group_count
    patches = _patches(m, x, delta.shape[1:-1])  # (c, P, K, C)
    c, p, k, cin = patches.shape
    d = delta.reshape(c, p, g, -1)  # (c, P, G, O/G)
    pk = patches.reshape(c, p, k, g, cin // g)
    gk = jnp.einsum("bpkgi,bpgo->bkigo", pk, d, precision=m.precision)
    out = {"kernel": gk.reshape((c,) + kernel.shape).astype(kernel.dtype)}
    if m.use_bias:
        out["bias"] = delta.reshape(c, p, -1).sum(1).astype(params["bias"].dtype)
    return out


def _dense_check(m: nn.Dense, x) -> tuple[str, ...]:
    if m.dot_general is not None or m.dot_general_cls is not None or x.ndim < 2:
        raise Unsupported(f"dense settings of {m.path}")
    return ("kernel", "bias") if m.use_bias else ("kernel",)


def _dense_grads(m: nn.Dense, x, delta, params):
    c = x.shape[0]
    x2, d2 = x.reshape(c, -1, x.shape[-1]), delta.reshape(c, -1, delta.shape[-1])
    out = {"kernel": jnp.einsum("bpi,bpo->bio", x2, d2, precision=m.precision).astype(params["kernel"].dtype)}
    if m.use_bias:
        out["bias"] = d2.sum(1).astype(params["bias"].dtype)
    return out


def _bn_check(m: nn.BatchNorm, x, args, kwargs) -> tuple[str, ...]:
    use_ra = kwargs.get("use_running_average", args[1] if len(args) > 1 else None)
    use_ra = m.use_running_average if use_ra is None else use_ra
    mask = kwargs.get("mask", args[2] if len(args) > 2 else None)
    axes = (m.axis,) if isinstance(m.axis, int) else tuple(m.axis)
    if use_ra is not True or mask is not None or tuple(a % x.ndim for a in axes) != (x.ndim - 1,) or x.ndim < 2:
        raise Unsupported(f"BatchNorm {m.path} is not in inference mode over the last axis")
    return tuple(n for n, on in (("scale", m.use_scale), ("bias", m.use_bias)) if on)


def _bn_normalised(m: nn.BatchNorm, x):
    """``(x - mean) / sqrt(var + epsilon)`` with the running averages (as flax's ``_normalize``)."""
    mean, var = m.get_variable("batch_stats", "mean"), m.get_variable("batch_stats", "var")
    if not m.force_float32_reductions:
        mean, var = jnp.asarray(mean, m.param_dtype), jnp.asarray(var, m.param_dtype)
    return (x - mean) * jax.lax.rsqrt(var + m.epsilon)


def _bn_grads(m: nn.BatchNorm, xhat, delta, params):
    c = delta.shape[0]
    d2 = delta.reshape(c, -1, delta.shape[-1])
    out = {}
    if m.use_scale:
        out["scale"] = jnp.sum(d2 * xhat.reshape(d2.shape), axis=1).astype(params["scale"].dtype)
    if m.use_bias:
        out["bias"] = d2.sum(1).astype(params["bias"].dtype)
    return out


GRADS = {nn.Conv: _conv_grads, nn.Dense: _dense_grads, nn.BatchNorm: _bn_grads}  # exact types: subclasses fall back


def _record(m, args, kwargs):
    """(parameter names, the array the layer's gradient rule needs) for one call; raises Unsupported."""
    if not args:
        raise Unsupported(f"{m.path} called without a positional input")
    x = args[0]
    if type(m) is nn.Conv:
        return _conv_check(m, x), x
    if type(m) is nn.Dense:
        return _dense_check(m, x), x
    return _bn_check(m, x, args, kwargs), _bn_normalised(m, x)


def _interceptor(calls: dict, records: dict, eps: dict | None):
    def intercept(next_fun, args, kwargs, context):
        m = context.module
        if context.method_name != "__call__" or type(m) not in GRADS:
            return next_fun(*args, **kwargs)
        path = tuple(m.path)
        if path in calls:
            raise Unsupported(f"layer {path} is called more than once")
        names, rec = _record(m, args, kwargs)
        y = next_fun(*args, **kwargs)
        calls[path] = _Call(m, names, jax.ShapeDtypeStruct(y.shape, y.dtype))
        records[path] = rec
        return y if eps is None else y + eps[path]
    return intercept


def _layer_params(params, path):
    sub = params
    for k in path:
        sub = sub[k]
    return sub


def _check_coverage(params, calls: dict):
    """Every parameter leaf belongs to exactly one recorded call, with the shapes its rule gives."""
    covered = set()
    for path, call in calls.items():
        try:
            sub = _layer_params(params, path)
        except (KeyError, TypeError) as e:
            raise Unsupported(f"no parameters at {path}") from e
        if not hasattr(sub, "keys") or set(sub.keys()) != set(call.params):
            raise Unsupported(f"parameters at {path} are not the layer's own {call.params}")
        if call.out.shape[0] == 0 or any(not hasattr(sub[n], "shape") for n in call.params):
            raise Unsupported(f"parameters at {path}")
        covered.update(path + (n,) for n in call.params)
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    keys = {tuple(getattr(k, "key", None) for k in kp) for kp, _ in leaves}
    if keys != covered or len(leaves) != len(covered):
        raise Unsupported(f"parameters outside supported layers: {sorted(map(str, keys - covered))[:3]}")


def per_example_pass(losses_fn: Callable, params, batch, context, chunk: int, *, grad_sq: bool,
                     hist1d: dict | None, hist2d: dict | None, tangents: tuple = (),
                     project_mean: bool = False) -> tuple[PerExampleStats, jax.Array | None] | None:
    """The sums of :func:`.per_example.per_example_pass`, from layer inputs and output gradients.

    Args:
      losses_fn: ``(params, batch, context) -> (B,)`` per-example losses of the whole batch, computed
        by flax linen ``apply`` calls whose parameter tree is ``params`` itself; examples must not
        interact.
      tangents: params-like trees ``t``; the projections ``g_i . t`` of every per-example gradient
        onto them are returned (the directional derivatives ``jax.linearize`` would give).
      project_mean: also project onto the mean gradient ``(1/B) sum_i g_i`` (first row), which the
        backward pass then computes too (a plain weight gradient).
      Other arguments: as :func:`.per_example.per_example_pass`.
    Returns ``(stats, projections (T, B) or None)``, or None when a layer or parameter is not
    supported (decided while tracing): fall back.
    """
    def run(p, eps):
        calls, records = {}, {}
        with nn.intercept_methods(_interceptor(calls, records, eps)):
            losses = losses_fn(p, batch, context)
        return losses, calls, records

    b = jax.tree.leaves(batch)[0].shape[0]
    try:
        found = {}

        def probe():
            losses, calls, _ = run(params, None)
            found.update(calls)
            return losses

        out = jax.eval_shape(probe)
        if out.shape != (b,) or not found:
            raise Unsupported("losses_fn must return one loss per example")
        _check_coverage(params, found)
    except Unsupported:
        return None

    eps0 = {path: jnp.zeros(call.out.shape, call.out.dtype) for path, call in found.items()}

    def total(p, eps):
        losses, _, records = run(p, eps)
        return jnp.sum(losses), (losses, records)

    if project_mean:  # the summed gradient as well: what the mean projection needs before the chunk loop
        (_, (losses, records)), (sum_grad, deltas) = jax.value_and_grad(total, argnums=(0, 1), has_aux=True)(
            params, eps0)
        tangents = (jax.tree.map(lambda s: s / b, sum_grad),) + tuple(tangents)
    else:
        (_, (losses, records)), deltas = jax.value_and_grad(total, argnums=1, has_aux=True)(params, eps0)
    c = chunk_size(b, chunk)
    paths = sorted(found)
    layer_params = {path: _layer_params(params, path) for path in paths}

    def body(acc, chunk_data):
        recs, ds = chunk_data
        g = {}
        for i, path in enumerate(paths):
            m = found[path].module
            for name, v in GRADS[type(m)](m, recs[i], ds[i], layer_params[path]).items():
                g[path + (name,)] = v
        g = jax.tree_util.tree_map_with_path(lambda kp, _: g[tuple(k.key for k in kp)], params)
        proj = None
        if tangents:
            proj = jnp.stack([sum(x.reshape(c, -1) @ u.ravel() for x, u in zip(jax.tree.leaves(g), jax.tree.leaves(t)))
                              for t in tangents])  # (T, c)
        return add_chunk(acc, g, params, hist1d=hist1d, hist2d=hist2d, batch_sum=matmul_sum), proj

    chunks = split_chunks(([records[p] for p in paths], [deltas[p] for p in paths]), c)
    acc, proj = over_chunks(body, init_sums(params, grad_sq=grad_sq, hist1d=hist1d, hist2d=hist2d), chunks)
    if proj is not None:
        proj = jnp.moveaxis(proj, 1, 0).reshape(len(tangents), b)  # (n, T, c) -> (T, B), examples in order
    return PerExampleStats(losses, *acc), proj
