"""Every quantity the instruments measure, one record each: what it needs from the step's shared pass, and
its few lines of compute (Cockpit's ``quantities/`` split into declare and compute, at optax's size).

:func:`.core.make` gathers the needs of the quantities asked for once, runs one shared pass at a tracked
step (the per-example statistics, the directional derivatives, the curvature: :func:`.core.shared_pass`)
and then each record's ``compute`` on that :class:`Pass`. A record's needs:

* ``"norms"``: per-example squared gradient norms ``||g_i||^2`` and the mean gradient (``p.stats``,
  ``p.gbar``, ``p.g_sq``); ``"elements"``: every per-example gradient element (histograms, element-wise
  sums; a tape then cannot use ghost norms); ``"grad_sq"``: the element-wise ``g^2`` and ``sum_i g_i^2``
  (``p.g2``, ``p.s2``); ``"hist1d"`` / ``"hist2d"``: the histograms of the per-example gradients;
* ``"mean_projection"``: every example's directional derivative along the mean gradient (``p.proj[0]``);
  ``"alpha"``: along this step's update and the last tracked one (``p.proj[-2]``, ``p.proj[-1]``);
* ``"loss"``: the batch loss (``p.batch_loss``) and per-example losses (``p.losses``);
* ``"hvp"``: Hessian-vector products (HessMaxEV's Lanczos: ``p.top``); ``"diagonal"``: the curvature's
  diagonal (``p.diag``, per-layer ``p.traces``, their ``p.total`` and with Hutchinson ``p.trace_se``);
* ``"updates"`` / ``"lr"``: the caller must pass ``update(updates=...)`` / ``update(lr=...)``.

Adding a quantity: its record here and one test (docs/instruments.md has the recipe). The config check
reads the names from :data:`QUANTITIES` before JAX starts, so this module imports JAX on first use
(:class:`_OnUse`): a record's compute runs only inside a traced step.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, NamedTuple


class _OnUse:
    """A module imported when one of its attributes is first read (``config.validate`` imports this module to
    know the quantities' names, before JAX starts)."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str):
        return getattr(importlib.import_module(self._name), attr)


jax = _OnUse("jax")
jnp = _OnUse("jax.numpy")
flatten_util = _OnUse("jax.flatten_util")
formulas = _OnUse("nondet_jax.instruments.formulas")


class Pass(NamedTuple):
    """What a tracked step's shared pass hands the records (None where no record asked for it)."""

    b: int  # examples in the batch
    step: Any  # the global step (traced)
    schedule: Callable
    params: Any
    state: Any  # the InstrumentState before this step
    layers: list  # '/'-joined parameter paths (per-layer values)
    grads: Any  # what the optimiser saw, or None
    updates: Any
    lr: Any
    curvature: str  # "ggn" or "hutchinson"
    stats: Any = None  # the per-example pass's sums (losses, sum_grad, sum_sq_norm, sum_grad_sq, hist1d, hist2d)
    gbar: Any = None  # the mean per-example gradient
    g_sq: Any = None  # ||gbar||^2
    proj: Any = None  # (T, B): every example's directional derivatives along the tangents
    losses: Any = None  # (B,) per-example losses
    batch_loss: Any = None
    g2: Any = None  # gbar^2, flat
    s2: Any = None  # sum_i g_i^2, flat
    top: Any = None  # curvature.lanczos_top's result
    diag: Any = None  # the curvature diagonal (a params-shaped tree)
    traces: Any = None  # its per-layer sums
    total: Any = None  # their sum
    trace_se: Any = None  # Hutchinson: the trace's standard error


class Quantity(NamedTuple):
    """One instrument: its needs from the shared pass and how it turns a :class:`Pass` into values."""

    compute: Callable[[Pass], dict]  # -> {value name: array}
    needs: frozenset = frozenset()
    per_layer: bool = False  # also "<name>/<parameter path>" values
    extras: Callable[[str], tuple] = lambda curvature: ()  # further value names, given the curvature
    shape: Callable[[dict, dict], tuple] | None = None  # (hist1d, hist2d settings) -> value shape; None: scalar
    init: Callable | None = None  # (params, dtype) -> {InstrumentState field: initial value}
    carry: Callable | None = None  # Pass -> {InstrumentState field: value after this step}


def sq_norms(tree) -> list:
    return [jnp.sum(jnp.square(x)) for x in jax.tree.leaves(tree)]


def _norms(name: str, per: list, layers: list) -> dict:
    """The norm over all parameters under ``name``, each layer's under ``name/<layer>``."""
    return {name: jnp.sqrt(sum(per)), **{f"{name}/{n}": jnp.sqrt(x) for n, x in zip(layers, per)}}


def _grad_norm(p: Pass) -> dict:
    if p.grads is None and p.gbar is None:
        raise ValueError("GradNorm needs grads= (or a quantity that computes per-example gradients)")
    return _norms("GradNorm", sq_norms(p.grads if p.grads is not None else p.gbar), p.layers)


def alpha_end(losses, end_proj, start):
    """Alpha of the update taken at the step whose ``start`` (t, f, var f, df, var df) was kept, from the
    losses and directional derivatives at its end point."""
    t = start[0]
    df = end_proj / jnp.where(t > 0, t, 1)
    return formulas.alpha(t, (start[1], jnp.mean(losses)), (start[3], jnp.mean(df)),
                          (start[2], jnp.var(losses, ddof=1)), (start[4], jnp.var(df, ddof=1)))


def _alpha(p: Pass) -> dict:
    pending = p.schedule(p.step - 1) & (p.step >= 1)
    return {"Alpha": jnp.where(pending, alpha_end(p.losses, p.proj[-1], p.state.alpha_start), jnp.nan)}


def _alpha_start(p: Pass) -> dict:
    t = jnp.sqrt(sum(sq_norms(p.updates)))
    df = p.proj[-2] / jnp.where(t > 0, t, 1)
    start = jnp.stack([t, jnp.mean(p.losses), jnp.var(p.losses, ddof=1), jnp.mean(df), jnp.var(df, ddof=1)])
    return {"direction": p.updates, "alpha_start": start.astype(p.state.alpha_start.dtype)}


def _flat_diag(p: Pass):
    return jnp.concatenate([x.ravel() for x in jax.tree.leaves(p.diag)])


def _traced(name: str):  # HessTrace/TICTrace: with Hutchinson also their standard error
    return lambda curvature: (f"{name}SE",) if curvature == "hutchinson" else ()


def _hess_trace(p: Pass) -> dict:
    v = {"HessTrace": p.total, **{f"HessTrace/{n}": x for n, x in zip(p.layers, jax.tree.leaves(p.traces))}}
    if p.trace_se is not None:
        v["HessTraceSE"] = p.trace_se
    return v


def _tic_trace(p: Pass) -> dict:
    v = {"TICTrace": formulas.tic_trace(p.b, jnp.sum(p.s2), p.total)}
    if p.trace_se is not None:  # delta method: d(A / T) = A / T^2 dT
        v["TICTraceSE"] = jnp.abs(v["TICTrace"]) * p.trace_se / jnp.abs(p.total + 1e-7)
    return v


def _needs(*names: str) -> frozenset:
    return frozenset(names)


GRAD_SQ = _needs("elements", "grad_sq")

QUANTITIES: dict[str, Quantity] = {
    "Loss": Quantity(lambda p: {"Loss": p.batch_loss}, _needs("loss")),
    "GradNorm": Quantity(_grad_norm, per_layer=True),
    "Distance": Quantity(lambda p: _norms("Distance", sq_norms(jax.tree.map(jnp.subtract, p.params,
                                                                             p.state.init_params)), p.layers),
                         per_layer=True, init=lambda params, dtype: {"init_params": params}),
    "UpdateSize": Quantity(lambda p: _norms("UpdateSize", sq_norms(p.updates), p.layers), _needs("updates"),
                           per_layer=True),
    "NormTest": Quantity(lambda p: {"NormTest": formulas.norm_test(p.b, p.stats.sum_sq_norm, p.g_sq)},
                         _needs("norms")),
    "InnerTest": Quantity(lambda p: {"InnerTest": formulas.inner_test(p.b, p.proj[0], p.g_sq)},
                          _needs("norms", "mean_projection")),
    "OrthoTest": Quantity(lambda p: {"OrthoTest": formulas.ortho_test(p.b, p.stats.sum_sq_norm, p.proj[0], p.g_sq)},
                          _needs("norms", "mean_projection")),
    "Alpha": Quantity(_alpha, _needs("alpha", "updates"),
                      init=lambda params, dtype: {"direction": jax.tree.map(jnp.zeros_like, params),
                                                  "alpha_start": jnp.zeros(5, dtype)},
                      carry=_alpha_start),
    "GradHist1d": Quantity(lambda p: {"GradHist1d": p.stats.hist1d}, _needs("elements", "hist1d"),
                           shape=lambda h1, h2: (h1["bins"],)),
    "GradHist2d": Quantity(lambda p: {"GradHist2d": p.stats.hist2d}, _needs("elements", "hist2d"),
                           shape=lambda h1, h2: tuple(h2["bins"])),
    "HessMaxEV": Quantity(lambda p: {"HessMaxEV": p.top.value, "HessMaxEVResidual": p.top.residual,
                                     "HessMaxEVError": p.top.error}, _needs("hvp"),
                          extras=lambda curvature: ("HessMaxEVResidual", "HessMaxEVError"),
                          init=lambda params, dtype: {"hess_vec": jnp.zeros_like(flatten_util.ravel_pytree(params)[0])},
                          carry=lambda p: {"hess_vec": p.top.vector}),
    "HessTrace": Quantity(_hess_trace, _needs("diagonal"), per_layer=True, extras=_traced("HessTrace")),
    "TICDiag": Quantity(lambda p: {"TICDiag": formulas.tic_diag(p.b, p.s2, _flat_diag(p))}, GRAD_SQ | {"diagonal"}),
    "TICTrace": Quantity(_tic_trace, GRAD_SQ | {"diagonal"}, extras=_traced("TICTrace")),
    "MeanGSNR": Quantity(lambda p: {"MeanGSNR": formulas.mean_gsnr(p.b, p.g2, p.s2)}, GRAD_SQ),
    "EarlyStopping": Quantity(lambda p: {"EarlyStopping": formulas.early_stopping(p.b, p.g2, p.s2)}, GRAD_SQ),
    "CABS": Quantity(lambda p: {"CABS": formulas.cabs(p.b, p.lr, p.g2, p.s2, p.batch_loss)},
                     GRAD_SQ | {"lr", "loss"}),
}
