"""The instruments as a pure ``(init, update)`` pair with a NamedTuple state (optax style).

Example (runnable)::

    import jax, jax.numpy as jnp, optax
    from nondet_jax import instruments

    def example_loss(params, example, context):      # ONE example, no batch axis
        x, y = example
        return 0.5 * (x @ params["w"] - y) ** 2

    params = {"w": jnp.zeros(3)}
    x, y = jax.random.normal(jax.random.key(0), (64, 3)), jnp.ones(64)
    tx = optax.sgd(0.1)
    opt_state = tx.init(params)
    inst = instruments.make("economy", example_loss, schedule=instruments.linear(2))
    istate = inst.init(params)

    @jax.jit
    def step(params, opt_state, istate, batch, t):
        loss_fn = lambda p: jnp.mean(jax.vmap(example_loss, (None, 0, None))(p, batch, None))
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        istate, values = inst.update(istate, params, batch, step=t, updates=updates, lr=0.1,
                                     grads=grads, loss=loss)
        return optax.apply_updates(params, updates), opt_state, istate, values

    for t in range(4):
        params, opt_state, istate, values = step(params, opt_state, istate, (x, y), t)
        print(t, float(values["Loss"]), float(values["Alpha"]))   # NaN where not tracked

``update`` returns every quantity at every call (same keys, shapes and dtypes, so one compiled
program serves all steps); values are NaN at steps the schedule does not track, and the work is
skipped there (``lax.switch``: nothing runs but the branch taken, also under ``vmap`` as long as
``step`` is not batched; a schedule that tracks every step needs no branch). Call ``update`` once
per optimisation step with consecutive ``step``. On XLA:CPU, convolutions inside a branch run on a
path several times slower than straight-line code, so a tracked step costs more under a sparse
schedule than under every-step tracking (the full configuration every 16 steps on a small CNN: 81 ms
per step with the branch on the device, 19 ms without; ``benchmarks/peer_cockpit.py``). A loop that knows the step in Python
avoids it: ``update(..., track=bool(inst.schedule(t)))`` picks the branch while tracing (jit the
step with ``track`` static: two programs, one for tracked steps and one for the others).

Value names: ``"Quantity"`` (a scalar), per-layer ``"Quantity/<parameter path>"`` for GradNorm,
Distance, UpdateSize, HessTrace (their plain name holds the total: the norm over all parameters,
or the summed trace), ``"GradHist1d"`` (bins,) and ``"GradHist2d"`` (gradient bins, parameter bins);
with HessMaxEV also ``"HessMaxEVResidual"``, its relative residual ``||Hv - lambda v|| / |lambda|``, and
``"HessMaxEVError"``, a bound on how far below the largest eigenvalue it is (:func:`.curvature.lanczos_top`);
with ``curvature="hutchinson"`` also ``"HessTraceSE"`` and ``"TICTraceSE"``, standard errors.

Alpha is a two-step quantity (Cockpit's ``SAVE_SHIFT = 1``): the start point is a tracked step
``t`` (its loss, and per-example derivatives along the update ``updates`` taken there); the end
point is the next call, at the new parameters and on *its* batch. The value appears in the
``update`` call of step ``t + 1``: ``values["Alpha"]`` at step ``t + 1`` is the alpha of step ``t``'s update.

Conventions: see :mod:`nondet_jax.instruments.per_example` for BatchNorm (statistics held fixed at
the batch's values for per-example gradients). ``g`` in NormTest/InnerTest/OrthoTest/TIC/MeanGSNR/
EarlyStopping/CABS is the mean of the per-example gradients; GradNorm and Loss report ``grads`` and
``loss`` when given (what the optimiser saw), else the same mean. Curvature (HessMaxEV, HessTrace,
TIC) is that of ``batch_loss_fn`` (default: mean per-example loss).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree

from nondet_jax.instruments import (
    configurations,
    formulas,
    histograms,
    layerwise,
)
from nondet_jax.instruments import curvature as curv
from nondet_jax.instruments.per_example import common_dtype, per_example_pass
from nondet_jax.instruments.schedules import Schedule, linear

PER_EXAMPLE = ("NormTest", "InnerTest", "OrthoTest", "GradHist1d", "GradHist2d", "TICDiag", "TICTrace", "MeanGSNR",
               "EarlyStopping", "CABS")
GRAD_SQ = ("TICDiag", "TICTrace", "MeanGSNR", "EarlyStopping", "CABS")
DIAGONAL = ("HessTrace", "TICDiag", "TICTrace")  # from the curvature's diagonal (GGN or Hutchinson)
# Per-example quantities that need only squared norms ||g_i||^2 and projections g_i . t: with a tape
# (train_pass, or frozen_bn's layerwise pass) and none of the others asked for, no per-example
# gradient is formed (layerwise.tape_norm_stats, the ghost-norm identity). GradHist1d/2d and the
# element-wise quantities (GRAD_SQ) need every per-example gradient element.
NORM_ONLY = ("NormTest", "InnerTest", "OrthoTest")


class InstrumentState(NamedTuple):
    """What the instruments carry between steps (empty tuples for quantities not tracked)."""

    init_params: Any  # Distance: the parameters at init
    direction: Any  # Alpha: the update taken at the last tracked step
    alpha_start: Any  # Alpha: (t, f, var f, df, var df) at that step
    hess_vec: Any  # HessMaxEV: the last top eigenvector (flat), a warm start


class Instruments(NamedTuple):
    init: Callable  # params -> InstrumentState
    update: Callable  # (state, params, batch, *, step, ...) -> (state, values)
    quantities: tuple[str, ...]
    schedule: Schedule
    value_names: Callable  # params -> list of value names update returns
    hist_edges: dict  # "GradHist1d": edges; "GradHist2d": (gradient edges, parameter edges)
    # train_pass (set by .trainer): the training step's value_and_grad that also returns a Tape for ``update``
    value_grad_and_tape: Callable | None = None


def layer_names(params) -> list[str]:
    """'/'-joined paths of the parameter leaves, in ``jax.tree.leaves`` order."""
    def name(path):
        parts = []
        for k in path:
            parts.append(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))))
        return "/".join(parts)

    return [name(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]


def _sq_norms(tree) -> list[jax.Array]:
    return [jnp.sum(jnp.square(x)) for x in jax.tree.leaves(tree)]


def make(quantities: str | tuple[str, ...], example_loss: Callable, *, schedule: Schedule | None = None,
         batch_loss_fn: Callable | None = None, context_fn: Callable | None = None, chunk: int = 32,
         hess_iters: int = 20, hess_probes: int = 1, seed: int = 0,
         hist1d: dict | None = None, hist2d: dict | None = None,
         batched_example_loss: Callable | None = None, norms: str | None = None,
         hess_tol: float | None = None, example_output: Callable | None = None,
         output_loss: Callable | None = None, batched_output: Callable | None = None,
         curvature: str | None = None) -> Instruments:
    """Build the instruments.

    Args:
      quantities: ``"economy"``, ``"business"``, ``"full"``, quantity names, or a comma-separated mix.
      example_loss: ``(params, example, context) -> scalar``, the loss of one example (pytree
        without the batch axis). ``context`` is whatever ``context_fn`` returns (or ``update``'s
        ``context``): e.g. fixed BatchNorm statistics.
      schedule: ``step -> bool`` (:func:`linear`, :func:`logarithmic`); default every step.
      batch_loss_fn: ``(params, batch, context) -> scalar`` whose Hessian the curvature quantities
        measure; default the mean of ``example_loss`` over the batch.
      context_fn: ``(params, batch, context) -> context``, evaluated only at tracked steps (so its
        cost, e.g. a forward pass for BatchNorm statistics, is only paid there); it receives
        ``update``'s ``context`` argument and its result replaces it.
      chunk: examples per per-example-gradient chunk: memory ~ ``chunk x P``.
      hess_iters: Lanczos steps for HessMaxEV (memory ``hess_iters x P``). hess_probes: Hutchinson
        probes for HessTrace/TIC. seed: probes and Lanczos start vectors use keys from it and the step.
      hist1d / hist2d: ``{"bins": ..., "value_range": ...}`` overriding Cockpit's defaults.
      batched_example_loss: optional ``(params, batch, context) -> (B,)``, the same losses as
        ``example_loss`` for a whole batch in one call of flax linen modules whose examples do not
        interact: per-example gradients then come from one batched backward pass and per-layer
        products (:mod:`.layerwise`) instead of ``vmap(grad(example_loss))``, when every parameter
        belongs to a layer type it supports (otherwise the vmap path runs, decided while tracing).
      norms: when the per-example quantities asked for are only NormTest/InnerTest/OrthoTest and a
        layerwise tape is available: "auto" (ghost norms per layer where cheaper, no per-example
        gradient formed), "ghost" (ghost norms on every layer), "materialise" (form the per-example
        gradients as for GradHist1d). None: "auto".
      hess_tol: stop HessMaxEV's Lanczos steps once the relative residual ``||Hv - lambda v|| / |lambda|``
        is below it (a while loop; at most ``hess_iters`` steps, at least ``curvature.MIN_STEPS`` from
        a cold start). None: always ``hess_iters`` steps.
        Either way the residual is reported as ``"HessMaxEVResidual"``.
      example_output / output_loss: ``(params, example, context) -> (C,)`` and ``(outputs, example) ->
        scalar`` with ``example_loss == output_loss(example_output(...), example)``: HessTrace, TICDiag
        and TICTrace then use the exact diagonal of the generalised Gauss-Newton matrix of the mean
        per-example loss (:func:`.curvature.ggn_diagonal`; equal to the Hessian's for piecewise-linear
        networks). ``batched_output``: the outputs of a whole batch at once (flax linen layers whose
        examples do not interact), for the batched per-layer path.
      curvature: ``"ggn"`` (default when ``example_output`` is given) or ``"hutchinson"``:
        ``hess_probes`` Rademacher probes of ``batch_loss_fn``'s Hessian, about ``C`` times cheaper
        than the GGN for ``C`` outputs; HessTrace and TICTrace then come with ``"HessTraceSE"`` and
        ``"TICTraceSE"``, and TICDiag is refused (it would divide by a diagonal estimate that can be
        negative).

    Raises ValueError for unknown quantities or bad settings.
    """
    names = configurations.resolve(quantities)
    if not names:
        raise ValueError("no quantities to track; pass a configuration (economy, business, full) or quantity names")
    if norms not in (None, "auto", "ghost", "materialise"):
        raise ValueError(f"norms must be auto, ghost or materialise, got {norms!r}")
    if hess_tol is not None and not hess_tol > 0:
        raise ValueError(f"hess_tol must be > 0, got {hess_tol!r}")
    for label, v in (("chunk", chunk), ("hess_iters", hess_iters), ("hess_probes", hess_probes)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{label} must be an int >= 1, got {v!r}")
    curvature = curvature or ("ggn" if example_output is not None else "hutchinson")
    if curvature not in configurations.CURVATURES:
        raise ValueError(f"curvature must be ggn or hutchinson, got {curvature!r}")
    if curvature == "ggn" and (example_output is None or output_loss is None):
        raise ValueError("curvature='ggn' needs the model's outputs: pass example_output= and output_loss=")
    if curvature == "hutchinson" and "TICDiag" in names:
        raise ValueError("TICDiag needs the exact curvature diagonal (a Hutchinson estimate of it can be <= 0): pass "
                         "example_output= and output_loss= (curvature='ggn'), or leave TICDiag out")
    schedule = schedule or linear(1)
    h1 = {"bins": histograms.HIST1D_BINS, "value_range": histograms.HIST1D_RANGE, **(hist1d or {})}
    h2 = {"bins": histograms.HIST2D_BINS, "value_range": histograms.HIST2D_RANGE, **(hist2d or {})}
    has = lambda *qs: any(q in names for q in qs)  # noqa: E731
    need_pe = has(*PER_EXAMPLE)
    need_alpha = has("Alpha")
    need_hvp = has("HessMaxEV") or (curvature == "hutchinson" and has(*DIAGONAL))

    every_step = getattr(schedule, "every_step", False)  # no branch: straight-line code measured faster

    norms = norms or "auto"

    def norm_only() -> bool:
        return need_pe and norms != "materialise" and all(q in NORM_ONLY for q in names if q in PER_EXAMPLE)

    def mean_loss(params, batch, context):
        return jnp.mean(jax.vmap(example_loss, in_axes=(None, 0, None))(params, batch, context))

    curv_loss = batch_loss_fn or mean_loss

    def init(params) -> InstrumentState:
        zero = lambda: jax.tree.map(jnp.zeros_like, params)  # noqa: E731
        dtype = common_dtype(params)
        return InstrumentState(
            init_params=params if has("Distance") else (),
            direction=zero() if need_alpha else (),
            alpha_start=jnp.zeros(5, dtype) if need_alpha else (),
            hess_vec=jnp.zeros_like(ravel_pytree(params)[0]) if has("HessMaxEV") else ())

    def value_names(params) -> list[str]:
        out = []
        layers = layer_names(params)
        for q in names:
            out.append(q)
            if q == "HessMaxEV":
                out += ["HessMaxEVResidual", "HessMaxEVError"]
            if q in ("HessTrace", "TICTrace") and curvature == "hutchinson":
                out.append(f"{q}SE")
            if q in configurations.PER_LAYER:
                out.extend(f"{q}/{n}" for n in layers)
        return out

    def value_shapes(params) -> dict[str, tuple]:
        shapes = {n: () for n in value_names(params)}
        if "GradHist1d" in names:
            shapes["GradHist1d"] = (h1["bins"],)
        if "GradHist2d" in names:
            shapes["GradHist2d"] = tuple(h2["bins"])
        return shapes

    def update(state: InstrumentState, params, batch, *, step, context=None, updates=None, lr=None, grads=None,
               loss=None, tape=None, track: bool | None = None):
        """One step's measurements: returns ``(state, values)`` (see the module docstring).

        ``track``: the schedule's verdict for this step as a Python bool (``bool(inst.schedule(t))``),
        to choose the branch while tracing instead of by ``lax.switch`` on the device (the module
        docstring says why); it must be what the schedule says. None: the schedule decides on device.

        ``tape``: a :class:`.layerwise.Tape` of this step's training backward pass (with the
        per-example losses, and output gradients of the *summed* loss): per-example quantities then
        come from its contributions (the ``train_pass`` mode) and ``grads`` must be that pass's
        gradient; None: from a pass of ``example_loss`` of their own (``frozen_bn``).
        """
        if need_alpha and updates is None:
            raise ValueError("Alpha needs the update the optimiser applies at this step: pass updates=")
        if has("UpdateSize") and updates is None:
            raise ValueError("UpdateSize needs the update the optimiser applies at this step: pass updates=")
        if has("CABS") and lr is None:
            raise ValueError("CABS needs the learning rate of this step: pass lr=")
        leaves = jax.tree.leaves(batch)
        if not leaves or any(a.ndim < 1 or a.shape[0] != leaves[0].shape[0] for a in leaves):
            raise ValueError("batch must be a pytree of arrays sharing a leading batch axis")
        b = leaves[0].shape[0]
        if b < 2 and need_pe:
            raise ValueError(f"gradient-noise quantities need a batch of at least 2 examples, got {b}")
        if tape is not None and (grads is None or tape.losses is None):
            raise ValueError("a tape needs its per-example losses (tape.losses) and its pass's gradient (grads=)")
        step = jnp.asarray(step)
        dtype = common_dtype(params)
        shapes = value_shapes(params)
        layers = layer_names(params)
        nan_values = {k: jnp.full(s, jnp.nan, dtype if not k.startswith("GradHist") else jnp.float32)
                      for k, s in shapes.items()}

        def get_context():
            return context_fn(params, batch, context) if context_fn is not None else context

        def example_losses(p, ctx):
            return jax.vmap(example_loss, in_axes=(None, 0, None))(p, batch, ctx)

        def alpha_end_info(losses, end_proj, start):
            t = start[0]
            df = end_proj / jnp.where(t > 0, t, 1)
            return formulas.alpha(t, (start[1], jnp.mean(losses)), (start[3], jnp.mean(df)),
                                  (start[2], jnp.var(losses, ddof=1)), (start[4], jnp.var(df, ddof=1)))

        def idle(state):
            return state, dict(nan_values)

        def end_only(state):  # the step after a tracked one that is not tracked itself: finish Alpha
            if tape is not None:
                losses = tape.losses
                # in a rolled chunk loop: straight-line, XLA:CPU slowed every untracked step of a sparse
                # schedule (docs/instruments.md)
                proj = layerwise.tape_norm_stats(tape, None, chunk, tangents=(state.direction,), mode="auto")[1][0]
            else:
                ctx = get_context()
                losses, proj = jax.jvp(lambda p: example_losses(p, ctx), (params,), (state.direction,))
            values = dict(nan_values)
            values["Alpha"] = alpha_end_info(losses, proj, state.alpha_start).astype(dtype)
            return state, values

        def tracked(state):
            ctx = get_context() if tape is None else context  # context_fn serves the frozen convention only
            v: dict[str, jax.Array] = {}
            stats = None
            proj = None  # (T, B): every example's directional derivatives along gbar, updates, direction
            if tape is not None:  # train_pass: the training backward pass's per-example contributions
                along = ((grads,) if has("InnerTest", "OrthoTest") else ()) + (
                    (updates, state.direction) if need_alpha else ())
                if need_pe and norm_only():  # no per-example gradient formed: ghost norms + projections
                    stats, proj = layerwise.tape_norm_stats(tape, jax.tree.map(lambda g: g * b, grads), chunk,
                                                            tangents=along, mode=norms)
                    gbar = grads
                    g_sq = sum(_sq_norms(gbar))
                elif need_pe:
                    stats, proj = layerwise.tape_stats(
                        tape, params, chunk, grad_sq=has(*GRAD_SQ), hist1d=h1 if has("GradHist1d") else None,
                        hist2d=h2 if has("GradHist2d") else None, tangents=along)
                    gbar = jax.tree.map(lambda s: s / b, stats.sum_grad)
                    g_sq = sum(_sq_norms(gbar))
                elif along and not every_step:  # Alpha alone, in a branch: a rolled loop
                    proj = layerwise.tape_norm_stats(tape, None, chunk, tangents=along, mode="auto")[1]
                elif along:
                    proj = layerwise.tape_projections(tape, along)
            elif need_pe:
                pe_args = dict(grad_sq=has(*GRAD_SQ), hist1d=h1 if has("GradHist1d") else None,
                               hist2d=h2 if has("GradHist2d") else None)
                if batched_example_loss is not None:
                    res = layerwise.per_example_pass(
                        batched_example_loss, params, batch, ctx, chunk, **pe_args,
                        tangents=(updates, state.direction) if need_alpha else (),
                        project_mean=has("InnerTest", "OrthoTest"), norms_only=norm_only(), norms=norms)
                    if res is not None:
                        stats, proj = res
                if stats is None:  # no batched loss, or a layer the layerwise path does not support
                    stats = per_example_pass(example_loss, params, batch, ctx, chunk, **pe_args)
                gbar = jax.tree.map(lambda s: s / b, stats.sum_grad)
                g_sq = sum(_sq_norms(gbar))
            # Directional derivatives of every example's loss: one linearisation, several tangents
            # (unless the layerwise pass gave them as g_i . t).
            tangents = []
            if has("InnerTest", "OrthoTest"):
                tangents.append(gbar)
            if need_alpha:
                tangents += [updates, state.direction]
            losses = stats.losses if stats is not None else (tape.losses if tape is not None else None)
            if tangents and proj is None:
                losses, lin = jax.linearize(lambda p: example_losses(p, ctx), params)
                proj = jax.vmap(lin)(jax.tree.map(lambda *xs: jnp.stack(xs), *tangents))
            elif losses is None and (loss is None and has("Loss", "CABS")):
                losses = example_losses(params, ctx)
            batch_loss = loss if loss is not None else (jnp.mean(losses) if losses is not None else None)

            if has("Loss"):
                v["Loss"] = batch_loss
            if has("GradNorm"):
                if grads is None and not need_pe:
                    raise ValueError("GradNorm needs grads= (or a quantity that computes per-example gradients)")
                g = grads if grads is not None else gbar
                per = _sq_norms(g)
                v["GradNorm"] = jnp.sqrt(sum(per))
                v.update({f"GradNorm/{n}": jnp.sqrt(x) for n, x in zip(layers, per)})
            if has("Distance"):
                per = _sq_norms(jax.tree.map(jnp.subtract, params, state.init_params))
                v["Distance"] = jnp.sqrt(sum(per))
                v.update({f"Distance/{n}": jnp.sqrt(x) for n, x in zip(layers, per)})
            if has("UpdateSize"):
                per = _sq_norms(updates)
                v["UpdateSize"] = jnp.sqrt(sum(per))
                v.update({f"UpdateSize/{n}": jnp.sqrt(x) for n, x in zip(layers, per)})
            if has("NormTest"):
                v["NormTest"] = formulas.norm_test(b, stats.sum_sq_norm, g_sq)
            if has("InnerTest"):
                v["InnerTest"] = formulas.inner_test(b, proj[0], g_sq)
            if has("OrthoTest"):
                v["OrthoTest"] = formulas.ortho_test(b, stats.sum_sq_norm, proj[0], g_sq)
            if has("GradHist1d"):
                v["GradHist1d"] = stats.hist1d
            if has("GradHist2d"):
                v["GradHist2d"] = stats.hist2d
            if has(*GRAD_SQ):
                g2 = jnp.concatenate([x.ravel() for x in jax.tree.leaves(jax.tree.map(jnp.square, gbar))])
                s2 = jnp.concatenate([x.ravel() for x in jax.tree.leaves(stats.sum_grad_sq)])
            if has("MeanGSNR"):
                v["MeanGSNR"] = formulas.mean_gsnr(b, g2, s2)
            if has("EarlyStopping"):
                v["EarlyStopping"] = formulas.early_stopping(b, g2, s2)
            if has("CABS"):
                v["CABS"] = formulas.cabs(b, lr, g2, s2, batch_loss)

            new_state = state
            if need_hvp:
                key = jax.random.fold_in(jax.random.key(seed), step)
                hvp = curv.hvp_operator(lambda p: curv_loss(p, batch, ctx), params)
                if has("HessMaxEV"):
                    top = curv.lanczos_top(hvp, params, jax.random.fold_in(key, 1), hess_iters,
                                           start=state.hess_vec, tol=hess_tol)
                    v["HessMaxEV"] = top.value
                    v["HessMaxEVResidual"] = top.residual
                    v["HessMaxEVError"] = top.error
                    new_state = new_state._replace(hess_vec=top.vector)
            if has(*DIAGONAL):
                trace_se = None
                if curvature == "ggn":  # per-example outputs: the frozen convention's context
                    diag = curv.ggn_diagonal(example_output, output_loss, params, batch,
                                             ctx if tape is None else get_context(), chunk,
                                             batched_output=batched_output)
                    traces = jax.tree.map(jnp.sum, diag)
                else:
                    traces, diag, trace_se = curv.hutchinson(hvp, params, jax.random.fold_in(key, 2), hess_probes)
                per = jax.tree.leaves(traces)
                total = sum(per)
                if has("HessTrace"):
                    v["HessTrace"] = total
                    v.update({f"HessTrace/{n}": x for n, x in zip(layers, per)})
                    if trace_se is not None:
                        v["HessTraceSE"] = trace_se
                if has("TICDiag"):
                    d = jnp.concatenate([x.ravel() for x in jax.tree.leaves(diag)])
                    v["TICDiag"] = formulas.tic_diag(b, s2, d)
                if has("TICTrace"):
                    v["TICTrace"] = formulas.tic_trace(b, jnp.sum(s2), total)
                    if trace_se is not None:  # delta method: d(A / T) = A / T^2 dT
                        v["TICTraceSE"] = jnp.abs(v["TICTrace"]) * trace_se / jnp.abs(total + 1e-7)

            if need_alpha:
                pending = schedule(step - 1) & (step >= 1)
                finished = alpha_end_info(losses, proj[-1], state.alpha_start)
                v["Alpha"] = jnp.where(pending, finished, jnp.nan)
                t = jnp.sqrt(sum(_sq_norms(updates)))
                df = proj[-2] / jnp.where(t > 0, t, 1)
                start = jnp.stack([t, jnp.mean(losses), jnp.var(losses, ddof=1), jnp.mean(df), jnp.var(df, ddof=1)])
                new_state = new_state._replace(direction=updates, alpha_start=start.astype(dtype))
            out = dict(nan_values)
            out.update({k: jnp.asarray(x).astype(out[k].dtype).reshape(out[k].shape) for k, x in v.items()})
            return new_state, out

        if track is False:  # the caller read the schedule: not tracked (Alpha's end point is still decided here)
            if not need_alpha:
                return idle(state)
            return jax.lax.cond(schedule(step - 1) & (step >= 1), end_only, idle, state)
        if track or getattr(schedule, "every_step", False):
            # Every step is tracked: no branch. (XLA:CPU runs convolutions inside a conditional, like
            # inside a loop, on a path about 6x slower: a ResNet-8 gradient took 617 ms in a
            # lax.cond against 96 ms outside on a loaded 2-core CPU.)
            return tracked(state)
        is_tracked = schedule(step)
        branches = [idle, tracked]
        index = is_tracked.astype(jnp.int32)
        if need_alpha:
            pending = schedule(step - 1) & (step >= 1)
            branches = [idle, end_only, tracked]
            index = jnp.where(is_tracked, 2, jnp.where(pending, 1, 0))
        return jax.lax.switch(index, branches, state)

    edges = {"GradHist1d": histograms.edges(h1["bins"], h1["value_range"]),
             "GradHist2d": (histograms.edges(h2["bins"][0], h2["value_range"][0]),
                            histograms.edges(h2["bins"][1], h2["value_range"][1]))}
    return Instruments(init, update, names, schedule, value_names, edges)
