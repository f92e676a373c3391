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

from nondet_jax.instruments import configurations, histograms, layerwise
from nondet_jax.instruments import curvature as curv
from nondet_jax.instruments.per_example import common_dtype, per_example_pass
from nondet_jax.instruments.quantities import QUANTITIES, Pass, alpha_end, sq_norms
from nondet_jax.instruments.schedules import Schedule, linear


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
    curvature = _checked(names, norms, hess_tol, chunk, hess_iters, hess_probes, curvature, example_output,
                         output_loss)
    records = [QUANTITIES[q] for q in names]
    needs = frozenset().union(*(r.needs for r in records))
    schedule = schedule or linear(1)
    h1 = {"bins": histograms.HIST1D_BINS, "value_range": histograms.HIST1D_RANGE, **(hist1d or {})}
    h2 = {"bins": histograms.HIST2D_BINS, "value_range": histograms.HIST2D_RANGE, **(hist2d or {})}
    _check_hist("hist1d", h1)
    _check_hist("hist2d", h2)
    s = _Setup(
        names=names, records=records, needs=needs | ({"norms"} if "elements" in needs else set()),
        schedule=schedule, example_loss=example_loss, curv_loss=batch_loss_fn or _mean_loss(example_loss),
        context_fn=context_fn, chunk=chunk, hess_iters=hess_iters, hess_probes=hess_probes, seed=seed,
        h1=h1, h2=h2,
        batched_example_loss=batched_example_loss, norms=norms or "auto", hess_tol=hess_tol,
        example_output=example_output, output_loss=output_loss, batched_output=batched_output, curvature=curvature,
        every_step=getattr(schedule, "every_step", False))  # no branch: straight-line code measured faster
    return Instruments(lambda params: _init(s, params), lambda *a, **k: _update(s, *a, **k), names, schedule,
                       lambda params: _value_names(s, params))


def _check_hist(label: str, h: dict) -> None:
    """A histogram's settings (``bins``, ``value_range``) checked: a ValueError naming the problem."""
    unknown = set(h) - {"bins", "value_range"}
    if unknown:
        raise ValueError(f"{label} takes bins and value_range, got {sorted(unknown)[0]!r}")
    one = label == "hist1d"
    bins, ranges = ([h["bins"]], [h["value_range"]]) if one else (h["bins"], h["value_range"])
    shape = "an int >= 1" if one else "two ints >= 1 (gradient, parameter)"
    if not isinstance(bins, (tuple, list)) or len(bins) != (1 if one else 2) or \
            not all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in bins):
        raise ValueError(f"{label} bins must be {shape}, got {h['bins']!r}")
    if not isinstance(ranges, (tuple, list)) or len(ranges) != (1 if one else 2):
        raise ValueError(f"{label} value_range must be {'(low, high)' if one else 'two (low, high) pairs'}, "
                         f"got {h['value_range']!r}")
    for r in ranges:
        try:
            lo, hi = (float(v) for v in r)
        except (TypeError, ValueError):
            raise ValueError(f"{label} value_range must be (low, high) numbers, got {h['value_range']!r}") from None
        if not lo < hi:
            raise ValueError(f"{label} value_range needs low < high, got {h['value_range']!r}")


def _checked(names, norms, hess_tol, chunk, hess_iters, hess_probes, curvature, example_output, output_loss) -> str:
    """:func:`make`'s settings checked (ValueError naming the problem); returns the curvature source."""
    if not names:
        raise ValueError("no quantities to track; pass a configuration (economy, business, full) or quantity names")
    if norms not in (None, "auto", "ghost", "materialise"):
        raise ValueError(f"norms must be auto, ghost or materialise, got {norms!r}")
    if hess_tol is not None and not hess_tol > 0:
        raise ValueError(f"hess_tol must be > 0, got {hess_tol!r}")
    for label, v in (("chunk", chunk), ("hess_iters", hess_iters), ("hess_probes", hess_probes)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{label} must be an int >= 1, got {v!r}")
    if hess_iters > configurations.MAX_HESS_ITERS:
        raise ValueError(f"hess_iters must be at most {configurations.MAX_HESS_ITERS} (Lanczos keeps every vector: memory grows as "
                         f"hess_iters x parameters), got {hess_iters}; read HessMaxEVResidual for the error at fewer")
    curvature = curvature or ("ggn" if example_output is not None else "hutchinson")
    if curvature not in configurations.CURVATURES:
        raise ValueError(f"curvature must be ggn or hutchinson, got {curvature!r}")
    if curvature == "ggn" and (example_output is None or output_loss is None):
        raise ValueError("curvature='ggn' needs the model's outputs: pass example_output= and output_loss=")
    if curvature == "hutchinson" and "TICDiag" in names:
        raise ValueError("TICDiag needs the exact curvature diagonal (a Hutchinson estimate of it can be <= 0): pass "
                         "example_output= and output_loss= (curvature='ggn'), or leave TICDiag out")
    return curvature


class _Setup(NamedTuple):
    """:func:`make`'s arguments, resolved: what every step's update reads."""

    names: tuple
    records: list  # the Quantity of each name
    needs: frozenset  # the union of their needs ("elements" implies "norms")
    schedule: Schedule
    example_loss: Callable
    curv_loss: Callable
    context_fn: Callable | None
    chunk: int
    hess_iters: int
    hess_probes: int
    seed: int
    h1: dict
    h2: dict
    batched_example_loss: Callable | None
    norms: str
    hess_tol: float | None
    example_output: Callable | None
    output_loss: Callable | None
    batched_output: Callable | None
    curvature: str
    every_step: bool

    def has(self, need: str) -> bool:
        return need in self.needs

    @property
    def hvp(self) -> bool:  # HessMaxEV's Lanczos, or a Hutchinson diagonal
        return self.has("hvp") or (self.curvature == "hutchinson" and self.has("diagonal"))

    @property
    def norm_only(self) -> bool:
        """Only squared norms and projections asked for: with a tape, no per-example gradient is formed
        (:func:`.layerwise.tape_norm_stats`, the ghost-norm identity)."""
        return self.has("norms") and not self.has("elements") and self.norms != "materialise"

    def per_example_args(self) -> dict:
        return dict(grad_sq=self.has("grad_sq"), hist1d=self.h1 if self.has("hist1d") else None,
                    hist2d=self.h2 if self.has("hist2d") else None)


def _mean_loss(example_loss: Callable) -> Callable:
    def mean_loss(params, batch, context):
        return jnp.mean(jax.vmap(example_loss, in_axes=(None, 0, None))(params, batch, context))

    return mean_loss


def _init(s: _Setup, params) -> InstrumentState:
    fields = dict.fromkeys(InstrumentState._fields, ())
    dtype = common_dtype(params)
    for r in s.records:
        if r.init is not None:
            fields.update(r.init(params, dtype))
    return InstrumentState(**fields)


def _value_names(s: _Setup, params) -> list[str]:
    out = []
    layers = layer_names(params)
    for q, r in zip(s.names, s.records):
        out += [q, *r.extras(s.curvature)]
        if r.per_layer:
            out.extend(f"{q}/{n}" for n in layers)
    return out


class _Step(NamedTuple):
    """One ``update`` call's arguments."""

    params: Any
    batch: Any
    step: Any
    context: Any
    updates: Any
    lr: Any
    grads: Any
    loss: Any
    tape: Any
    b: int

    def context_of(self, s: _Setup):
        """``context_fn``'s context (evaluated only where a branch calls this), else the one passed."""
        return s.context_fn(self.params, self.batch, self.context) if s.context_fn is not None else self.context

    def example_losses(self, s: _Setup, params, ctx):
        return jax.vmap(s.example_loss, in_axes=(None, 0, None))(params, self.batch, ctx)


def _update(s: _Setup, state: InstrumentState, params, batch, *, step, context=None, updates=None, lr=None,
            grads=None, loss=None, tape=None, track: bool | None = None):
    """One step's measurements: returns ``(state, values)`` (see the module docstring).

    ``track``: the schedule's verdict for this step as a Python bool (``bool(inst.schedule(t))``),
    to choose the branch while tracing instead of by ``lax.switch`` on the device (the module
    docstring says why); it must be what the schedule says. None: the schedule decides on device.

    ``tape``: a :class:`.layerwise.Tape` of this step's training backward pass (with the
    per-example losses, and output gradients of the *summed* loss): per-example quantities then
    come from its contributions (the ``train_pass`` mode) and ``grads`` must be that pass's
    gradient; None: from a pass of ``example_loss`` of their own (``frozen_bn``).
    """
    for q, r in zip(s.names, s.records):
        if "updates" in r.needs and updates is None:
            raise ValueError(f"{q} needs the update the optimiser applies at this step: pass updates=")
        if "lr" in r.needs and lr is None:
            raise ValueError(f"{q} needs the learning rate of this step: pass lr=")
    leaves = jax.tree.leaves(batch)
    if not leaves or any(a.ndim < 1 or a.shape[0] != leaves[0].shape[0] for a in leaves):
        raise ValueError("batch must be a pytree of arrays sharing a leading batch axis")
    b = leaves[0].shape[0]
    if b < 2 and configurations.over_examples(s.names):
        raise ValueError(f"{', '.join(configurations.over_examples(s.names))} need a batch of at least 2 examples "
                         f"(variances over its examples), got {b}")
    if tape is not None and (grads is None or tape.losses is None):
        raise ValueError("a tape needs its per-example losses (tape.losses) and its pass's gradient (grads=)")
    a = _Step(params, batch, jnp.asarray(step), context, updates, lr, grads, loss, tape, b)
    dtype = common_dtype(params)
    shapes = {n: () for n in _value_names(s, params)}
    for q, r in zip(s.names, s.records):
        if r.shape is not None:
            shapes[q] = r.shape(s.h1, s.h2)
    nan_values = {k: jnp.full(sh, jnp.nan, dtype if not k.startswith("GradHist") else jnp.float32)
                  for k, sh in shapes.items()}
    alpha = s.has("alpha")

    def idle(state):
        return state, dict(nan_values)

    def end_only(state):  # the step after a tracked one that is not tracked itself: finish Alpha
        return state, {**nan_values, "Alpha": _alpha_end_only(s, a, state).astype(dtype)}

    def tracked(state):
        new_state, v = _tracked(s, a, state)
        out = dict(nan_values)
        out.update({k: jnp.asarray(x).astype(out[k].dtype).reshape(out[k].shape) for k, x in v.items()})
        return new_state, out

    if track is False:  # the caller read the schedule: not tracked (Alpha's end point is still decided here)
        if not alpha:
            return idle(state)
        return jax.lax.cond(s.schedule(a.step - 1) & (a.step >= 1), end_only, idle, state)
    if track or s.every_step:
        # Every step is tracked: no branch. (XLA:CPU runs convolutions inside a conditional, like
        # inside a loop, on a path about 6x slower: a ResNet-8 gradient took 617 ms in a
        # lax.cond against 96 ms outside on a loaded 2-core CPU.)
        return tracked(state)
    is_tracked = s.schedule(a.step)
    branches = [idle, tracked]
    index = is_tracked.astype(jnp.int32)
    if alpha:
        pending = s.schedule(a.step - 1) & (a.step >= 1)
        branches = [idle, end_only, tracked]
        index = jnp.where(is_tracked, 2, jnp.where(pending, 1, 0))
    return jax.lax.switch(index, branches, state)


def _alpha_end_only(s: _Setup, a: _Step, state: InstrumentState):
    """Alpha of the last tracked step's update, at an untracked step: its end point alone."""
    if a.tape is not None:
        losses = a.tape.losses
        # in a rolled chunk loop: straight-line, XLA:CPU slowed every untracked step of a sparse
        # schedule (docs/instruments.md)
        proj = layerwise.tape_norm_stats(a.tape, None, s.chunk, tangents=(state.direction,), mode="auto")[1][0]
    else:
        ctx = a.context_of(s)
        losses, proj = jax.jvp(lambda p: a.example_losses(s, p, ctx), (a.params,), (state.direction,))
    return alpha_end(losses, proj, state.alpha_start)


def _tracked(s: _Setup, a: _Step, state: InstrumentState):
    """A tracked step: the shared pass once, then every record's compute and carry."""
    p = shared_pass(s, a, state)
    values, new_state = {}, state
    for r in s.records:
        values.update(r.compute(p))
        if r.carry is not None:
            new_state = new_state._replace(**r.carry(p))
    return new_state, values


def shared_pass(s: _Setup, a: _Step, state: InstrumentState) -> Pass:
    """What the records asked for, each computed once: per-example statistics (from the training pass's
    tape, a batched per-layer pass or ``vmap(grad)``), directional derivatives, losses, curvature."""
    ctx = a.context_of(s) if a.tape is None else a.context  # context_fn serves the frozen convention only
    stats, proj, gbar, g_sq = _per_example(s, a, state, ctx)
    # Directional derivatives of every example's loss: one linearisation, several tangents
    # (unless the layerwise pass gave them as g_i . t).
    tangents = ([gbar] if s.has("mean_projection") else []) + (
        [a.updates, state.direction] if s.has("alpha") else [])
    losses = stats.losses if stats is not None else (a.tape.losses if a.tape is not None else None)
    if tangents and proj is None:
        losses, lin = jax.linearize(lambda p: a.example_losses(s, p, ctx), a.params)
        proj = jax.vmap(lin)(jax.tree.map(lambda *xs: jnp.stack(xs), *tangents))
    elif losses is None and (a.loss is None and s.has("loss")):
        losses = a.example_losses(s, a.params, ctx)
    p = Pass(a.b, a.step, s.schedule, a.params, state, layer_names(a.params), a.grads, a.updates, a.lr,
             s.curvature, stats, gbar, g_sq, proj, losses,
             a.loss if a.loss is not None else (jnp.mean(losses) if losses is not None else None))
    if s.has("grad_sq"):
        p = p._replace(g2=jnp.concatenate([x.ravel() for x in jax.tree.leaves(jax.tree.map(jnp.square, gbar))]),
                       s2=jnp.concatenate([x.ravel() for x in jax.tree.leaves(stats.sum_grad_sq)]))
    return _curvature(s, a, p, ctx)


def _per_example(s: _Setup, a: _Step, state: InstrumentState, ctx):
    """``(stats, proj, gbar, g_sq)``: the per-example sums and the projections they came with (None where
    not asked for)."""
    stats = proj = gbar = g_sq = None
    b = a.b
    if a.tape is not None:  # train_pass: the training backward pass's per-example contributions
        along = ((a.grads,) if s.has("mean_projection") else ()) + (
            (a.updates, state.direction) if s.has("alpha") else ())
        if s.norm_only:  # no per-example gradient formed: ghost norms + projections
            stats, proj = layerwise.tape_norm_stats(a.tape, jax.tree.map(lambda g: g * b, a.grads), s.chunk,
                                                    tangents=along, mode=s.norms)
            return stats, proj, a.grads, sum(sq_norms(a.grads))
        if s.has("norms"):
            stats, proj = layerwise.tape_stats(a.tape, a.params, s.chunk, **s.per_example_args(), tangents=along)
        elif along and not s.every_step:  # Alpha alone, in a branch: a rolled loop
            proj = layerwise.tape_norm_stats(a.tape, None, s.chunk, tangents=along, mode="auto")[1]
        elif along:
            proj = layerwise.tape_projections(a.tape, along)
    elif s.has("norms"):
        if s.batched_example_loss is not None:
            res = layerwise.per_example_pass(
                s.batched_example_loss, a.params, a.batch, ctx, s.chunk, **s.per_example_args(),
                tangents=(a.updates, state.direction) if s.has("alpha") else (),
                project_mean=s.has("mean_projection"), norms_only=s.norm_only, norms=s.norms)
            if res is not None:
                stats, proj = res
        if stats is None:  # no batched loss, or a layer the layerwise path does not support
            stats = per_example_pass(s.example_loss, a.params, a.batch, ctx, s.chunk, **s.per_example_args())
    if stats is not None:
        gbar = jax.tree.map(lambda x: x / b, stats.sum_grad)
        g_sq = sum(sq_norms(gbar))
    return stats, proj, gbar, g_sq


def _curvature(s: _Setup, a: _Step, p: Pass, ctx) -> Pass:
    """HessMaxEV's Lanczos result and the curvature diagonal, where asked for."""
    if s.hvp:
        key = jax.random.fold_in(jax.random.key(s.seed), a.step)
        hvp = curv.hvp_operator(lambda q: s.curv_loss(q, a.batch, ctx), a.params)
        if s.has("hvp"):
            p = p._replace(top=curv.lanczos_top(hvp, a.params, jax.random.fold_in(key, 1), s.hess_iters,
                                                start=p.state.hess_vec, tol=s.hess_tol))
    if not s.has("diagonal"):
        return p
    trace_se = None
    if s.curvature == "ggn":  # per-example outputs: the frozen convention's context
        diag = curv.ggn_diagonal(s.example_output, s.output_loss, a.params, a.batch,
                                 ctx if a.tape is None else a.context_of(s), s.chunk, batched_output=s.batched_output)
        traces = jax.tree.map(jnp.sum, diag)
    else:
        traces, diag, trace_se = curv.hutchinson(hvp, a.params, jax.random.fold_in(key, 2), s.hess_probes)
    return p._replace(diag=diag, traces=traces, total=sum(jax.tree.leaves(traces)), trace_se=trace_se)
