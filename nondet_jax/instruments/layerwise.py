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
import warnings
from typing import Callable, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.linen import normalization
from flax.linen.linear import canonicalize_padding

from nondet_jax.instruments import histograms
from nondet_jax.instruments.per_example import (
    PerExampleStats,
    chunk_size,
    matmul_sum,
    over_chunks,
    split_chunks,
    vary_like,
)
from nondet_jax.models import common

# Convolution functions an nn.Conv may be given that compute exactly lax.conv_general_dilated's
# value (the CPU wrapper in models.common only changes how XLA schedules its weight gradient).
SAME_AS_LAX_CONV = (None, jax.lax.conv_general_dilated, common.conv_general_dilated)


class Unsupported(Exception):
    """A layer, setting or parameter layout the layerwise path does not handle (fall back to vmap)."""


class SlowerPath(UserWarning):
    """The per-example quantities fall back to ``vmap(grad)``: the same values, more time."""


def slower(reason: Exception) -> None:
    """Say once per reason (while tracing) that the recorder cannot take the model's layers."""
    warnings.warn(f"instruments: per-example gradients by vmap(grad), slower than the recorded pass, because of "
                  f"{reason} (the recorder takes flax Conv, Dense and BatchNorm called once each)", SlowerPath,
                  stacklevel=3)


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


def _bn_check(m: nn.BatchNorm, x, args, kwargs, training_ok: bool) -> tuple[str, ...]:
    use_ra = kwargs.get("use_running_average", args[1] if len(args) > 1 else None)
    use_ra = m.use_running_average if use_ra is None else use_ra
    mask = kwargs.get("mask", args[2] if len(args) > 2 else None)
    axes = (m.axis,) if isinstance(m.axis, int) else tuple(m.axis)
    if mask is not None or tuple(a % x.ndim for a in axes) != (x.ndim - 1,) or x.ndim < 2:
        raise Unsupported(f"BatchNorm {m.path} with a mask or not over the last axis")
    if use_ra is not True and not (training_ok and use_ra is False and m.axis_name is None):
        raise Unsupported(f"BatchNorm {m.path} is not in inference mode (or training mode on one device)")
    return tuple(n for n, on in (("scale", m.use_scale), ("bias", m.use_bias)) if on)


def _bn_normalised(m: nn.BatchNorm, x, training: bool):
    """``(x - mean) / sqrt(var + epsilon)`` as flax's ``_normalize`` forms it: with the running
    averages in inference mode, with the batch's own statistics in training mode."""
    if training:
        mean, var = normalization._compute_stats(
            x, tuple(range(x.ndim - 1)), m.dtype, use_fast_variance=m.use_fast_variance,
            force_float32_reductions=m.force_float32_reductions)
    else:
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


def _record(m, args, kwargs, training_ok: bool):
    """(parameter names, the array the layer's gradient rule needs) for one call; raises Unsupported."""
    if not args:
        raise Unsupported(f"{m.path} called without a positional input")
    x = args[0]
    if type(m) is nn.Conv:
        return _conv_check(m, x), x
    if type(m) is nn.Dense:
        return _dense_check(m, x), x
    names = _bn_check(m, x, args, kwargs, training_ok)
    use_ra = kwargs.get("use_running_average", args[1] if len(args) > 1 else None)
    return names, _bn_normalised(m, x, training=not (m.use_running_average if use_ra is None else use_ra))


def _interceptor(calls: dict, records: dict, eps: dict | None, training_ok: bool):
    def intercept(next_fun, args, kwargs, context):
        m = context.module
        if context.method_name != "__call__" or type(m) not in GRADS or m.is_initializing():
            return next_fun(*args, **kwargs)
        path = tuple(m.path)
        if path in calls:
            raise Unsupported(f"layer {path} is called more than once")
        names, rec = _record(m, args, kwargs, training_ok)
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


class Tape:
    """What one backward pass recorded: per supported layer, its input (BatchNorm: the normalised
    input) and the gradient of the *summed* loss with respect to its output, plus the per-example
    losses. Not a pytree (it holds the flax modules, static); use it inside the traced function that
    made it (closures into ``lax.switch`` branches are fine)."""

    def __init__(self, calls: dict, records: dict, deltas: dict, losses: jax.Array):
        self.calls, self.records, self.deltas, self.losses = calls, records, deltas, losses
        self.paths = sorted(calls)

    def scaled(self, factor, losses: jax.Array) -> "Tape":
        """The same tape with the output gradients multiplied by ``factor`` (e.g. the batch size, when
        the backward pass ran on a mean loss) and the given per-example losses."""
        return Tape(self.calls, self.records, {k: d * factor for k, d in self.deltas.items()}, losses)


class LazyTape(Tape):
    """A tape whose records and output gradients come from ``load() -> (records, deltas)`` where they
    are read (each read traces ``load`` again: a read inside a ``lax.switch`` branch loads inside that
    branch only, so a step the branch skips loads nothing)."""

    def __init__(self, calls: dict, load: Callable, losses: jax.Array):
        self.calls, self.paths, self._load, self.losses = calls, sorted(calls), load, losses

    records = property(lambda self: self._load()[0])
    deltas = property(lambda self: self._load()[1])


def value_grad_and_tape(fn: Callable, params, *args, training: bool = False):
    """``(value, aux), grads, tape`` of ``fn(params, *args) -> (scalar, aux)`` from ONE backward pass.

    Every flax Conv/Dense/BatchNorm call inside ``fn`` is recorded (:class:`Tape`); ``tape.losses`` is
    None (the caller knows its per-example losses). ``training``: BatchNorm layers in training mode
    (batch statistics) are accepted; their records use the batch's statistics, so the per-example
    contributions built from the tape still sum exactly to the gradient, but examples interact.
    When a layer or parameter is not supported (decided while tracing), ``tape`` is None and the
    value and gradient are ``jax.value_and_grad``'s.
    """
    def run(p, eps):
        calls, records = {}, {}
        with nn.intercept_methods(_interceptor(calls, records, eps, training)):
            out = fn(p, *args)
        return out, calls, records

    try:
        found = {}

        def probe():
            out, calls, _ = run(params, None)
            found.update(calls)
            return out

        out = jax.eval_shape(probe)
        if jnp.shape(out[0]) != () or not found:
            raise Unsupported("fn must return (scalar, aux) and call a supported layer")
        _check_coverage(params, found)
    except Unsupported as e:
        slower(e)
        return *jax.value_and_grad(fn, has_aux=True)(params, *args), None

    eps0 = {path: jnp.zeros(call.out.shape, call.out.dtype) for path, call in found.items()}

    def total(p, eps):
        (value, aux), _, records = run(p, eps)
        return value, (aux, records)

    (value, (aux, records)), (grads, deltas) = jax.value_and_grad(total, argnums=(0, 1), has_aux=True)(params, eps0)
    return (value, aux), grads, Tape(found, records, deltas, None)


def _example_grads(tape: Tape, recs, ds, layer_params, params):
    """Per-example gradients (params-like, leading axis = the chunk's examples) from one chunk of the tape."""
    g = {}
    for i, path in enumerate(tape.paths):
        m = tape.calls[path].module
        for name, v in GRADS[type(m)](m, recs[i], ds[i], layer_params[path]).items():
            g[path + (name,)] = v
    return jax.tree_util.tree_map_with_path(lambda kp, _: g[tuple(k.key for k in kp)], params)


def _flat(tree, lead: tuple = ()) -> jax.Array:
    """Every leaf flattened (after ``lead`` leading axes) and joined, in ``jax.tree.leaves`` order."""
    return jnp.concatenate([x.reshape(lead + (-1,)) for x in jax.tree.leaves(tree)], axis=len(lead))


def _unflat(flat: jax.Array, like):
    """Inverse of :func:`_flat` (no leading axes), with ``like``'s shapes and dtypes."""
    leaves, treedef = jax.tree.flatten(like)
    out, i = [], 0
    for x in leaves:
        out.append(flat[i:i + x.size].reshape(x.shape).astype(x.dtype))
        i += x.size
    return treedef.unflatten(out)


def tape_stats(tape: Tape, params, chunk: int, *, grad_sq: bool, hist1d: dict | None, hist2d: dict | None,
               tangents: tuple = (), rolled: bool = True) -> tuple[PerExampleStats, jax.Array | None]:
    """The sums of :func:`.per_example.per_example_pass` from a tape: per-example gradients formed
    ``chunk`` examples at a time by per-layer products; ``tangents``: params-like trees ``t`` whose
    projections ``g_i . t`` are returned as ``(T, B)`` (None without tangents).

    Each chunk's gradients are joined into one ``(chunk, P)`` array, so every sum, the projections
    and each histogram are one operation, not one per parameter leaf (fewer, larger kernels: less
    compile time and less time on XLA:CPU)."""
    b = tape.losses.shape[0]
    c = chunk_size(b, chunk)
    layer_params = {path: _layer_params(params, path) for path in tape.paths}
    p_flat = _flat(params)
    t_flat = jnp.stack([_flat(t).astype(p_flat.dtype) for t in tangents], axis=1) if tangents else None  # (P, T)
    zeros = jnp.zeros_like(p_flat)
    init = vary_like((zeros, jnp.zeros((), p_flat.dtype), zeros if grad_sq else None,
                      None if hist1d is None else jnp.zeros(hist1d["bins"], jnp.float32),
                      None if hist2d is None else jnp.zeros(hist2d["bins"], jnp.float32)), params)
    p_bins = None if hist2d is None else histograms.bin_index(p_flat, hist2d["bins"][1], *hist2d["value_range"][1])

    def body(acc, chunk_data):
        recs, ds = chunk_data
        g = _flat(_example_grads(tape, recs, ds, layer_params, params), (c,))  # (c, P)
        sum_g, sq, sum_g2, h1, h2 = acc
        sum_g = sum_g + matmul_sum(g)
        sq = sq + jnp.sum(jnp.square(g))
        if sum_g2 is not None:
            sum_g2 = sum_g2 + matmul_sum(jnp.square(g))
        if h1 is not None:
            h1 = h1 + histograms.counts(histograms.bin_index(g, hist1d["bins"], *hist1d["value_range"]), hist1d["bins"])
        if h2 is not None:
            nx, ny = hist2d["bins"]
            ix = histograms.bin_index(g, nx, *hist2d["value_range"][0])
            h2 = h2 + histograms.counts(ix * ny + p_bins, nx * ny).reshape(nx, ny)
        proj = None if t_flat is None else (g @ t_flat).T  # (T, c)
        return (sum_g, sq, sum_g2, h1, h2), proj

    chunks = split_chunks(([tape.records[p] for p in tape.paths], [tape.deltas[p] for p in tape.paths]), c)
    (sum_g, sq, sum_g2, h1, h2), proj = over_chunks(body, init, chunks, convolutions=not rolled)
    if proj is not None:
        proj = jnp.moveaxis(proj, 1, 0).reshape(len(tangents), b)  # (n, T, c) -> (T, B), examples in order
    return PerExampleStats(tape.losses, _unflat(sum_g, params), sq,
                           None if sum_g2 is None else _unflat(sum_g2, params), h1, h2), proj


def per_example_pass(losses_fn: Callable, params, batch, context, chunk: int, *, grad_sq: bool,
                     hist1d: dict | None, hist2d: dict | None, tangents: tuple = (),
                     project_mean: bool = False, norms_only: bool = False,
                     norms: str | None = None) -> tuple[PerExampleStats, jax.Array | None] | None:
    """The sums of :func:`.per_example.per_example_pass`, from layer inputs and output gradients.

    Args:
      losses_fn: ``(params, batch, context) -> (B,)`` per-example losses of the whole batch, computed
        by flax linen ``apply`` calls whose parameter tree is ``params`` itself; examples must not
        interact.
      tangents: params-like trees ``t``; the projections ``g_i . t`` of every per-example gradient
        onto them are returned (the directional derivatives ``jax.linearize`` would give).
      project_mean: also project onto the mean gradient ``(1/B) sum_i g_i`` (first row), which the
        backward pass then computes too (a plain weight gradient).
      norms_only: only ``losses``, ``sum_grad``, ``sum_sq_norm`` and the projections are needed
        (no element-wise sums or histograms): :func:`tape_norm_stats` with mode ``norms``, no
        per-example gradient formed.
      Other arguments: as :func:`.per_example.per_example_pass`.
    Returns ``(stats, projections (T, B) or None)``, or None when a layer or parameter is not
    supported (decided while tracing): fall back.
    """
    b = jax.tree.leaves(batch)[0].shape[0]

    def total(p):
        losses = losses_fn(p, batch, context)
        if losses.shape != (b,):
            raise Unsupported("losses_fn must return one loss per example")
        return jnp.sum(losses), losses

    try:
        (_, losses), sum_grad, tape = value_grad_and_tape(total, params)
    except Unsupported as e:
        slower(e)
        return None
    if tape is None:
        return None
    tape = Tape(tape.calls, tape.records, tape.deltas, losses)
    if project_mean:  # the summed gradient came with the deltas: the mean projection needs it before the chunks
        tangents = (jax.tree.map(lambda s: s / b, sum_grad),) + tuple(tangents)
    if norms_only:
        return tape_norm_stats(tape, sum_grad, chunk, tangents=tangents, mode=norms)
    return tape_stats(tape, params, chunk, grad_sq=grad_sq, hist1d=hist1d, hist2d=hist2d, tangents=tangents)


# ---- norm-only paths: per-example squared gradient norms without per-example gradients ----
#
# The "ghost norm" identity (Goodfellow 2015; Li et al. 2022): a layer's per-example weight gradient
# is ``G_i = A_i^T D_i`` with ``A_i`` (positions x fan-in: the input, or the im2col patches) and
# ``D_i`` (positions x fan-out: the output gradient), so ``||G_i||^2 = sum_pq (A_i A_i^T)_pq (D_i D_i^T)_pq``:
# two Gram matrices of positions x positions instead of the fan-in x fan-out gradient. With one
# position (a Dense layer on a flat input) it is ``||a_i||^2 ||delta_i||^2``.

# Norm-only path: "auto" (per layer, the cheaper of ghost and materialised by :func:`ghost_is_cheaper`),
# "ghost" (every layer with more than zero positions), "materialise" (per-example weight gradients
# formed per layer and squared). "auto" is the default of every ``mode`` argument below.


def ghost_is_cheaper(positions: int, fan_in: int, fan_out: int, tangents: int = 0) -> bool:
    """The rule of norms mode "auto", by multiply-adds per example: ghost costs the two Gram matrices,
    ``positions^2 (fan_in + fan_out)``, plus ``tangents`` projections through the layer's outputs
    under each tangent, ``tangents positions fan_in fan_out``; materialising costs forming the
    gradient, ``positions fan_in fan_out``, plus ``(tangents + 1) fan_in fan_out`` for its norm and
    projections. So with any projection to compute (InnerTest, OrthoTest, Alpha) forming the layer's
    gradient wins (measured: ``benchmarks/instruments.py --kernel-timing``, docs/instruments.md);
    without, ghost wins when ``positions (fan_in + fan_out) < fan_in fan_out`` (roughly; the issue's
    ``positions^2 < fan_in fan_out`` picked ghost for a 1x1 shortcut, 16 positions, 16 -> 32
    channels, where it measured 2x slower)."""
    if positions == 1 and tangents == 0:
        return True
    ghost = positions * positions * (fan_in + fan_out) + tangents * positions * fan_in * fan_out
    formed = positions * fan_in * fan_out + (tangents + 1) * fan_in * fan_out
    return ghost < formed


def _ghost_sq_norms(a, d, precision=None):
    """``(c,)`` per-example ``||A_i^T D_i||^2`` by the ghost identity, for ``a`` (c, P, G, I) and ``d``
    (c, P, G, O) (G groups: block-diagonal weights, summed over groups)."""
    if a.shape[1] == 1:  # one position: ||a_i||^2 ||d_i||^2 per group
        return jnp.sum(jnp.sum(jnp.square(a), axis=(1, 3)) * jnp.sum(jnp.square(d), axis=(1, 3)), axis=1)
    ga = jnp.einsum("bpgi,bqgi->bgpq", a, a, precision=precision)
    gd = jnp.einsum("bpgo,bqgo->bgpq", d, d, precision=precision)
    return jnp.sum(ga * gd, axis=(1, 2, 3))


def layer_modes(tape: Tape, mode: str | None = None, tangents: int = 0) -> dict:
    """``{path: "ghost" | "materialise" | "formed"}``: what the norm-only path does per recorded layer
    with ``tangents`` projections to compute (``formed``: BatchNorm, whose per-example gradient is C numbers)."""
    mode = mode or "auto"
    out = {}
    for path in tape.paths:
        m, d = tape.calls[path].module, tape.deltas[path]
        if type(m) is nn.BatchNorm:
            out[path] = "formed"
            continue
        p = int(np.prod(d.shape[1:-1])) if d.ndim > 2 else 1
        fan_in = tape.records[path].shape[-1] * (int(np.prod(_kernel_size(m))) if type(m) is nn.Conv else 1)
        ghost = mode == "ghost" or (mode == "auto" and ghost_is_cheaper(p, fan_in, d.shape[-1], tangents))
        out[path] = "ghost" if ghost else "materialise"
    return out


def tape_sq_norms(tape: Tape, chunk: int, mode: str | None = None) -> jax.Array:
    """``(B,)``: every example's squared gradient norm ``||g_i||^2`` (all layers), from the tape, without
    forming ``g_i`` as one vector: per layer either the ghost-norm identity or the layer's own
    per-example weight gradient squared (``mode``: "auto", "ghost", "materialise"; default
    "auto"), ``chunk`` examples at a time (the Gram matrices take ``chunk x positions^2``)."""
    return _norms_and_projections(tape, chunk, (), mode)[0]


def tape_projections(tape: Tape, tangents: tuple) -> jax.Array:
    """``(T, B)``: every example's contribution ``g_i`` projected onto each tangent ``t`` (params-like),
    layer by layer from the tape without forming ``g_i``: each layer's output under the tangent weights
    (all tangents side by side in one product with the layer's input or im2col patches), dotted with
    the example's output gradient. Straight-line code; :func:`tape_norm_stats` gives the same in a
    rolled chunk loop."""
    if not tangents:
        return jnp.zeros((0, tape.deltas[tape.paths[0]].shape[0]))
    out = 0
    for path in tape.paths:
        m, x, d = tape.calls[path].module, tape.records[path], tape.deltas[path]
        ts = [_layer_params(t, path) for t in tangents]
        c = d.shape[0]
        if type(m) is nn.Conv:
            g = m.feature_group_count
            patches = _patches(m, x, d.shape[1:-1])
            _, p, k, cin = patches.shape
            tk = jnp.stack([t["kernel"].reshape(k, cin // g, g, -1) for t in ts])  # (T, K, I, G, O)
            y = jnp.einsum("bpkgi,tkigo->tbpgo", patches.reshape(c, p, k, g, cin // g), tk, precision=m.precision)
            part = jnp.einsum("tbpgo,bpgo->tb", y, d.reshape(c, p, g, -1))
            if m.use_bias:
                part = part + jnp.stack([t["bias"] for t in ts]) @ d.reshape(c, p, -1).sum(1).T
        elif type(m) is nn.Dense:
            x2, d2 = x.reshape(c, -1, x.shape[-1]), d.reshape(c, -1, d.shape[-1])
            tk = jnp.stack([t["kernel"] for t in ts])  # (T, I, O)
            part = jnp.einsum("tbpo,bpo->tb", jnp.einsum("bpi,tio->tbpo", x2, tk, precision=m.precision), d2)
            if m.use_bias:
                part = part + jnp.stack([t["bias"] for t in ts]) @ d2.sum(1).T
        else:
            d2 = d.reshape(c, -1, d.shape[-1])
            part = 0
            if m.use_scale:
                part = part + jnp.stack([t["scale"] for t in ts]) @ jnp.sum(d2 * x.reshape(d2.shape), axis=1).T
            if m.use_bias:
                part = part + jnp.stack([t["bias"] for t in ts]) @ d2.sum(1).T
        out = out + part
    return out


def _layer_sq_and_proj(m, x, d, ts: list, mode: str):
    """One layer, one chunk: ``(c,)`` squared per-example gradient norms and ``(T, c)`` projections onto
    the tangents' weights ``ts``: by the ghost identity and the layer's outputs under the tangents, or
    from the layer's own per-example weight gradient (never the whole model's), per ``mode`` and
    :func:`ghost_is_cheaper`."""
    c, n_t = d.shape[0], len(ts)
    proj = jnp.zeros((n_t, c), d.dtype)
    if type(m) is nn.BatchNorm:  # the per-example gradient is C numbers: formed
        d2 = d.reshape(c, -1, d.shape[-1])
        parts = ([("scale", jnp.sum(d2 * x.reshape(d2.shape), axis=1))] if m.use_scale else []) + (
            [("bias", d2.sum(1))] if m.use_bias else [])
        sq = sum(jnp.sum(jnp.square(v), axis=1) for _, v in parts)
        for name, v in parts:
            if ts:
                proj = proj + jnp.stack([t[name] for t in ts]) @ v.T
        return sq, proj
    g = m.feature_group_count if type(m) is nn.Conv else 1
    if type(m) is nn.Conv:
        patches = _patches(m, x, d.shape[1:-1])  # (c, P, K, C)
        _, p, k, cin = patches.shape
        a = jnp.moveaxis(patches.reshape(c, p, k, g, cin // g), 3, 2).reshape(c, p, g, k * (cin // g))
    else:
        a = x.reshape(c, -1, 1, x.shape[-1])
        p = a.shape[1]
    dg = d.reshape(c, p, g, -1)
    fan_in, fan_out = a.shape[-1] * g, d.shape[-1]
    ghost = mode == "ghost" or (mode == "auto" and ghost_is_cheaper(p, fan_in, fan_out, n_t))
    kernels = [t["kernel"].reshape(-1) for t in ts]
    if ghost:
        sq = _ghost_sq_norms(a, dg, m.precision)
        if ts:  # the layer's outputs under every tangent: one GEMM per group, (c P, I) x (I, T O/G)
            tk = jnp.stack([kk.reshape(a.shape[-1], g, -1) if type(m) is nn.Conv else kk.reshape(a.shape[-1], 1, -1)
                            for kk in kernels])  # (T, I, G, O/G), I in the patches' (K, C/G) order
            y = jnp.einsum("bpgi,tigo->bpgto", a, tk, precision=m.precision)
            proj = jnp.einsum("bpgto,bpgo->tb", y, dg)
    else:
        gk = jnp.einsum("bpgi,bpgo->bigo", a, dg, precision=m.precision).reshape(c, -1)  # kernel layout
        sq = jnp.sum(jnp.square(gk), axis=1)
        if ts:
            proj = jnp.stack(kernels) @ gk.T
    if m.use_bias:
        db = d.reshape(c, p, -1).sum(1)
        sq = sq + jnp.sum(jnp.square(db), axis=1)
        if ts:
            proj = proj + jnp.stack([t["bias"] for t in ts]) @ db.T
    return sq, proj


def _norms_and_projections(tape: Tape, chunk: int, tangents: tuple, mode: str | None):
    """``(B,)`` squared per-example gradient norms and ``(T, B)`` projections onto ``tangents`` (None
    without), in one loop over ``chunk`` examples at a time that builds each convolution's im2col
    patches once (:func:`_layer_sq_and_proj` per layer)."""
    mode = mode or "auto"
    if mode not in ("auto", "ghost", "materialise"):
        raise ValueError(f"norms must be auto, ghost or materialise, got {mode!r}")
    b = tape.deltas[tape.paths[0]].shape[0]
    c = chunk_size(b, chunk)
    ts = {path: [_layer_params(t, path) for t in tangents] for path in tape.paths}

    def body(acc, chunk_data):
        recs, ds = chunk_data
        sq, proj = 0, 0
        for path, r, d in zip(tape.paths, recs, ds):
            s, pr = _layer_sq_and_proj(tape.calls[path].module, r, d, ts[path], mode)
            sq, proj = sq + s, proj + pr
        return acc, (sq, proj)

    chunks = split_chunks(([tape.records[p] for p in tape.paths], [tape.deltas[p] for p in tape.paths]), c)
    # A rolled loop. In one chunk (straight-line code, or a loop of one trip, which XLA removes) inside a
    # sparse schedule's branch, XLA:CPU slowed the *untracked* steps by 40% (ResNet-8, NormTest+InnerTest+
    # OrthoTest every 16 steps: 1.42x against 1.03x in 4 chunks of 32; every step 1.54x against 1.47x).
    _, (sq, proj) = jax.lax.scan(body, 0.0, chunks)
    proj = jnp.moveaxis(proj, 1, 0).reshape(len(tangents), b) if tangents else None  # (n, T, c) -> (T, B)
    return sq.reshape(b), proj


def tape_norm_stats(tape: Tape, sum_grad, chunk: int, *, tangents: tuple = (), mode: str | None = None
                    ) -> tuple[PerExampleStats, jax.Array | None]:
    """What NormTest, InnerTest, OrthoTest and Alpha need, with no per-example gradient formed:
    ``stats`` (losses, ``sum_grad`` as given, the sum of the squared norms of :func:`tape_sq_norms`;
    no element-wise sums or histograms) and the projections ``g_i . t`` onto ``tangents`` ``(T, B)``
    (None without tangents), from :func:`_norms_and_projections`."""
    sq, proj = _norms_and_projections(tape, chunk, tangents, mode)
    return PerExampleStats(tape.losses, sum_grad, jnp.sum(sq), None, None, None), proj
