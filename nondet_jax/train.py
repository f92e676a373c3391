"""Single-replica training as pure functions (the replica axis is added only by ``replicas``).

``make_train`` closes over the static configuration and returns:

* ``init(keys, perturb, x_sample) -> TrainState``: initial weights from the ``init`` key, then
  the ``bitflip`` perturbation when the arm varies it;
* ``train_step(state, x, y, keys, perturb, epoch, i, batch_idx) -> (state, (loss, accuracy))``:
  one step, the body of the epoch's scan (for instruments that look between steps);
* ``train_epoch(state, x, y, keys, perturb, epoch) -> (state, metrics)``: one epoch as one ``lax.scan``;
  ``metrics`` holds per-step training loss and accuracy;
* ``evaluate(state, x) -> (logits, features)``: test logits and penultimate features, in chunks;
* ``recompute_batch_stats(params, batch_stats, x) -> batch_stats``: BatchNorm statistics of
  ``params`` measured on the batch ``x`` (for interpolated weights in LMC).

Example::

    fns = make_train(Config(), DataSpec(1437, (8, 8, 1), 10))
    varied = arm_sources("init")
    keys, perturb = replica_slice(arm_keys(0, varied, 4), 0), perturbations(varied)
    state = fns.init(keys, perturb, x_train[:1])
    state, metrics = jax.jit(fns.train_epoch)(state, x_train, y_train, keys, perturb, 0)
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from nondet_jax.config import Config, OptimConfig, StudyConfig
from nondet_jax.data import AUGMENT_BY_DEFAULT, FLIP_BY_DEFAULT
from nondet_jax.data.pipeline import (
    augment,
    batch_permutation,
    default_crop_padding,
    epoch_indices,
)
from nondet_jax.errors import UsageError
from nondet_jax.instruments.epoch import instrumented
from nondet_jax.models import MODELS, compute_dtype, pretrained
from nondet_jax.models.parts import Parts, model_fns
from nondet_jax.sources import Perturbations, ReplicaKeys, bitflip

# XLA:CPU runs convolutions inside a while-loop body on a much slower path than straight-line
# code (jax#12868): a ResNet-8 digits epoch of 11 steps took 1.45 s as a rolled scan and 0.23 s
# fully unrolled, compile 3.6 s vs 14.7 s (benchmarks/scan_unroll.py). So on CPU, where an epoch is a scan
# (train.epoch_shape: scan, and the unrolled strategy; auto steps), short epochs are unrolled.
CPU_UNROLL_MAX_STEPS = 16


class DataSpec(NamedTuple):
    """What the training functions need to know about the data, statically."""

    n_train: int
    image_shape: tuple[int, int, int]
    num_classes: int
    name: str = "digits"
    x_dtype: Any = np.dtype(np.float32)  # the inputs' dtype: float32, or integers (token ids) kept as given
    task: str = "classification"  # or "regression": num_classes is then the outputs per example


class Health(NamedTuple):
    """Divergence bookkeeping of one replica: a replica whose training loss stops being finite is
    frozen at the start of that epoch (its last state known finite); see :func:`guard`."""

    diverged_at: jax.Array  # int32 global step whose loss was first not finite; -1 = never
    last_loss: jax.Array  # float32 last finite training loss (NaN before the first step)



def carry_change(before, after, dtypes: bool = True) -> tuple[str, str, str] | None:
    """How ``after`` differs from ``before`` as a value a loop carries from step to step (``lax.scan`` and
    ``lax.cond`` need the same structure, shapes and dtypes): None when it does not, else (where, was, now) for a
    message: ``("", "PyTreeDef(...)", "PyTreeDef(...)")`` when the structure differs, else the first leaf that
    differs, ``("['w']", "float32(3,)", "float16(3,)")``. ``dtypes=False``: shapes alone (an optimizer's updates,
    which ``optax.apply_updates`` casts to the parameters' dtypes)."""
    if jax.tree.structure(after) != jax.tree.structure(before):
        return "", str(jax.tree.structure(before)), str(jax.tree.structure(after))
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(before), jax.tree.leaves(after)):
        was, now = (np.shape(a), jnp.result_type(a)), (np.shape(b), jnp.result_type(b))
        if was != now if dtypes else was[0] != now[0]:
            return jax.tree_util.keystr(path), f"{was[1]}{was[0]}", f"{now[1]}{now[0]}"
    return None


def healthy() -> Health:
    return Health(jnp.int32(-1), jnp.float32(jnp.nan))


class TrainState(NamedTuple):
    params: Any
    batch_stats: Any
    opt_state: Any
    health: Any = None  # Health; None only for evaluation-only states
    instruments: Any = None  # nondet_jax.instruments.InstrumentState when config.instruments is on


def guard(old: TrainState, new: TrainState, losses: jax.Array, first_step: jax.Array) -> TrainState:
    """After an epoch: ``new`` if every step's loss was finite and the replica had not diverged
    before; else ``old`` (the state at the epoch's start, the last one known finite), with the step
    of the first non-finite loss and the last finite loss recorded.

    Checked once per epoch, outside the step loop (a per-step check multiplied the compile time of
    an unrolled ResNet-8 epoch by 6: 36 s -> 218 s in benchmarks/scan_unroll.py), from the losses alone, and the
    state is chosen by ``lax.cond``: consuming the weights (an elementwise select, a finiteness
    sum) let XLA fuse the last update differently and moved weights by an ulp, whereas this
    leaves the epoch's program, and so its results, bitwise as they were without the guard.
    """
    h = old.health
    bad = ~jnp.isfinite(losses)
    fresh = (h.diverged_at < 0) & bad.any()
    ok = (h.diverged_at < 0) & ~fresh
    kept = jax.lax.cond(ok, lambda: tuple(new[:3]), lambda: tuple(old[:3]))
    first_bad = jnp.argmax(bad)
    before = jnp.where(first_bad > 0, losses[jnp.maximum(first_bad - 1, 0)], h.last_loss)
    diverged_at = jnp.where(fresh, (first_step + first_bad).astype(jnp.int32), h.diverged_at)
    last_loss = jnp.where(ok, losses[-1].astype(jnp.float32), jnp.where(fresh, before.astype(jnp.float32), h.last_loss))
    return TrainState(*kept, Health(diverged_at, last_loss), *new[4:])


class TrainFns(NamedTuple):
    init: Callable
    train_step: Callable
    train_epoch: Callable
    evaluate: Callable
    recompute_batch_stats: Callable
    batch_size: int
    steps_per_epoch: int
    unroll: int
    instruments: Any = None  # the nondet_jax.instruments.Instruments (quantities, value names, edges) when on
    spec: Any = None  # the DataSpec the functions were made for
    loss_fn: Callable | None = None  # (params, batch_stats, x, y, dropout_keys) -> (loss, (logits, batch_stats))
    parts: Any = None  # the nondet_jax.models.parts.Parts the functions were made with
    model: Any = None  # the nondet_jax.models.parts.ModelFns of the model
    tx: Any = None  # the optax.GradientTransformation the steps apply
    example_loss: Callable | None = None  # per-example (logits, labels) -> loss
    augment: Callable | None = None  # (key, x_batch) -> x_batch, or None: no augmentation
    epoch_shape: str = "scan"  # "scan": train_epoch is one program; "step": driven step by step (stepped_epoch)
    epoch_indices: Callable | None = None  # (keys, epoch) -> (steps, batch) example indices of the epoch
    epoch_step: Callable | None = None  # (state, x, y, keys, perturb, epoch, i, indices) -> (state, outputs)
    epoch_finish: Callable | None = None  # (state at the start, state at the end, [outputs per step], epoch)
    replica_threads: int = 1  # replicas the sequential strategy trains at once (replica_threads())


def epoch_metrics(out) -> dict:
    """An epoch's stacked ``train_step`` outputs -> metrics: ``loss``, ``accuracy`` (steps,), and with
    instruments ``instruments`` (name -> (steps, ...), NaN at untracked steps) and ``tracked`` (steps,)."""
    metrics = {"loss": out[0], "accuracy": out[1]}
    if len(out) > 2:
        metrics["instruments"], metrics["tracked"] = out[2], out[3]
    return metrics


def squared_error(predictions, targets):
    """Per-example squared error, averaged over outputs: the default loss of a regression."""
    d = (predictions - targets).reshape(targets.shape[0], -1)
    return jnp.mean(d * d, axis=-1)


def steps_per_epoch(n_train: int, batch_size: int) -> int:
    """Optimizer steps per epoch: full batches only (the last incomplete batch of each epoch's shuffled
    order is dropped, so every step sees ``batch_size`` examples). An optax schedule of your own spans
    ``epochs * steps_per_epoch(n_train, batch_size)`` steps, e.g.
    ``optax.cosine_decay_schedule(0.1, epochs * nj.steps_per_epoch(len(x_train), 128))``."""
    return int(n_train) // int(batch_size)


def make_schedule(o: OptimConfig, epochs: int, steps_per_epoch: int) -> optax.Schedule:
    """The learning-rate schedule over ``epochs * steps_per_epoch`` steps."""
    total = epochs * steps_per_epoch
    if o.schedule == "constant":
        return optax.constant_schedule(o.lr)
    if o.schedule == "step":
        if o.step_every_epochs > 0:
            return optax.exponential_decay(o.lr, max(1, round(o.step_every_epochs * steps_per_epoch)),
                                           o.step_factor, staircase=True)
        return optax.piecewise_constant_schedule(o.lr, {int(0.5 * total): o.step_factor,
                                                        int(0.75 * total): o.step_factor})
    if o.schedule == "snapshot":
        # Snapshot ensembles (Huang et al. 2017) as Summers & Dinneen's accelerated ensembles: K equal
        # cosine cycles, each with its own linear warm-up from 0. With a warm-up the schedule is exactly
        # 0 at each cycle's end (step count c * cycle, where snapshot c is taken); without one the
        # next cycle restarts at the peak there, and each cycle's cosine ends at 0 in the limit.
        cycle = (epochs // o.cycles) * steps_per_epoch
        warmup = min(round(o.warmup_epochs * steps_per_epoch), cycle - 1)
        one = optax.warmup_cosine_decay_schedule(0.0, o.lr, warmup, cycle, end_value=0.0)
        if o.cycles == 1:
            return one
        return optax.join_schedules([one] * o.cycles, [c * cycle for c in range(1, o.cycles)])
    warmup = min(round(o.warmup_epochs * steps_per_epoch), total - 1)
    return optax.warmup_cosine_decay_schedule(0.0, o.lr, warmup, total, end_value=0.0)


def bias_bn_mask(params) -> Any:
    """True at every leaf named ``bias`` (dense, conv and BatchNorm biases) or ``scale`` (BatchNorm
    scales): the parameter group Summers & Dinneen train at a tenth of the learning rate."""
    return jax.tree_util.tree_map_with_path(lambda path, _: getattr(path[-1], "key", None) in ("bias", "scale"),
                                            params)


def make_optimizer(o: OptimConfig, schedule: optax.Schedule) -> optax.GradientTransformation:
    """SGD (momentum, Nesterov; L2 weight decay added to the gradient, as PyTorch) or AdamW.

    With ``o.bias_bn_lr_scale != 1`` the final update of the :func:`bias_bn_mask` leaves is
    multiplied by it: the same as scaling their learning rate (the update is linear in the
    learning rate for both optimisers; AdamW's decoupled decay is scaled with it).
    """
    if o.name == "adamw":
        tx = optax.adamw(schedule, weight_decay=o.weight_decay)
    else:
        tx = optax.chain(optax.add_decayed_weights(o.weight_decay),
                         optax.sgd(schedule, momentum=o.momentum or None, nesterov=o.nesterov))
    if o.bias_bn_lr_scale == 1.0:  # the default: no extra transform, bitwise the plain optimiser
        return tx
    return optax.chain(tx, optax.masked(optax.scale(o.bias_bn_lr_scale), bias_bn_mask))


def augmentation_settings(config: Config, name: str, image_size: int) -> tuple[bool, bool, int]:
    """(augment?, flip?, crop padding) after resolving ``auto``."""
    d = config.data
    on = d.augment == "on" or (d.augment == "auto" and name in AUGMENT_BY_DEFAULT)
    flip = d.flip == "on" or (d.flip == "auto" and name in FLIP_BY_DEFAULT)
    return on, flip, d.crop_padding or default_crop_padding(image_size)


def scan_unroll(setting: int, steps: int, backend: str | None = None) -> int:
    """Steps unrolled per scan iteration: ``setting`` if > 0, else all steps on CPU for short
    epochs (see CPU_UNROLL_MAX_STEPS) and 1 elsewhere."""
    if setting > 0:
        return min(setting, steps)
    backend = backend or jax.default_backend()
    return steps if backend == "cpu" and steps <= CPU_UNROLL_MAX_STEPS else 1


def epoch_shape(setting: str, steps: int, backend: str | None = None) -> str:
    """How an epoch runs: ``"scan"``, one ``lax.scan`` program (unrolled per :func:`scan_unroll`), or ``"step"``,
    one jitted step dispatched ``steps`` times from Python (:func:`stepped_epoch`). ``auto``: ``step`` on CPU at
    every epoch length (a rolled scan runs convolutions on XLA:CPU's slow while-loop path, an unrolled one
    compiles a copy of the step per step: the digits study's 11-step epoch compiled in 15 s, its step in 2 s, and
    both ran at the same speed), ``scan`` elsewhere (on an H200 the stepped loop ran 0.53x the rolled scan:
    benchmarks/results/device-h200)."""
    if setting != "auto":
        return setting
    backend = backend or jax.default_backend()
    return "step" if backend == "cpu" else "scan"


def replica_threads(setting: int, backend: str | None = None) -> int:
    """Replicas the ``sequential`` strategy trains at once, each dispatched from its own Python thread:
    ``setting`` if > 0, else on CPU the cores this process may use, elsewhere 1. XLA:CPU runs the programs that
    one thread dispatches one after another, and a small model's step leaves cores idle (ResNet-8 at batch 128
    on 2 cores: 9.4 ms per step alone, 6.3 ms per replica-step from 2 threads, benchmarks/step_overhead.py);
    on an accelerator one stream runs them in turn anyway."""
    if setting > 0:
        return setting
    if (backend or jax.default_backend()) != "cpu":
        return 1
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def stepped_programs(fns: TrainFns, lift: Callable) -> tuple[Callable, Callable, Callable]:
    """The three programs of an epoch driven step by step (:func:`stepped_epoch`), jitted by ``lift(fn, in_axes,
    once=False)`` for the strategy's replica layout (``jax.jit`` for one replica, ``jax.jit(jax.vmap(fn, in_axes))``
    for a replica axis): ``begin(keys, e)`` (the epoch's indices), ``step(state, x, y, keys, perturb, e, i,
    indices)`` and ``finish(state at the start, state at the end, [outputs per step], e)`` (the divergence guard,
    the metrics). ``begin`` draws integers and ``finish`` selects, compares and stacks, so they are lifted with
    ``once=True`` (:func:`nondet_jax.machine.quick.once`: compiled without LLVM's optimisations, the same bits)."""
    return (lift(fns.epoch_indices, (0, None), once=True),
            lift(fns.epoch_step, (0, None, None, 0, None, None, None, 0)),
            lift(fns.epoch_finish, (0, 0, 0, None), once=True))


def stepped_epoch(fns: TrainFns, lift: Callable) -> Callable:
    """An epoch as ``train_epoch`` computes it, driven step by step from Python: the epoch's indices, one
    jitted training step ``steps_per_epoch`` times (dispatched asynchronously), then the divergence guard and
    the metrics (:func:`stepped_programs`). Returns ``epoch(state, x, y, keys, perturb, e, watch=None) -> (state,
    metrics)``; every replica runs the same three programs, whatever the steps per epoch. ``watch(i, state)``,
    when given, sees the state before each step ``i`` of the epoch (it reads the state and changes nothing)."""
    begin, step, finish = stepped_programs(fns, lift)

    def epoch(state, x, y, keys, perturb, e, watch=None):
        idx, new, outs = begin(keys, e), state, []
        for i in range(fns.steps_per_epoch):
            if watch is not None:
                watch(i, new)
            new, out = step(new, x, y, keys, perturb, e, np.int32(i), idx)
            outs.append(out)
        return finish(state, new, outs, e)

    return epoch


def evaluator(model, eval_b: int) -> Callable:
    """``evaluate(state, x) -> (logits, features)`` of ``model`` (``models.parts.ModelFns``), in chunks of
    ``eval_b`` examples."""
    def evaluate(state: TrainState, x):
        n = x.shape[0]
        chunk = min(eval_b, n)
        nb = -(-n // chunk)
        xp = jnp.pad(x, ((0, nb * chunk - n),) + ((0, 0),) * (x.ndim - 1)).reshape((nb, chunk) + x.shape[1:])
        f = lambda xb: model.evaluate({"params": state.params, "batch_stats": state.batch_stats}, xb)  # noqa: E731
        if nb == 1:  # no loop at all: a 1-trip loop is XLA:CPU's slow convolution path too
            logits, feats = jax.tree.map(lambda a: a[None], f(xp[0]))
        else:
            _, (logits, feats) = jax.lax.scan(lambda c, xb: (c, f(xb)), None, xp, unroll=scan_unroll(0, nb))
        feats = feats.reshape((nb * chunk,) + feats.shape[2:])[:n]
        if feats.ndim == 1:  # a regression model's (N,) outputs as its features: one feature each, as CKA takes
            feats = feats[:, None]
        return logits.reshape((nb * chunk,) + logits.shape[2:])[:n], feats

    return evaluate


def make_train(config: Config, spec: DataSpec, parts: Parts = Parts()) -> TrainFns:
    """Pure single-replica init / train-epoch / evaluate functions.

    The arm enters only through the keys and :class:`Perturbations` passed at call time, so one
    compiled program serves every arm of a study (the study section of ``config`` is ignored, but for
    ``study.dynamics_every``, which makes ``train.epoch_shape`` auto drive epochs step by step on every backend:
    the dynamics watch replicas between steps, :mod:`nondet_jax.replicas.watch`).
    ``parts`` are the user's own model, optimiser, loss and augmentation; each one left ``None``
    is the one ``config`` names (the catalogue's models go through the same :func:`model_fns`).
    """
    parts = parts._replace(init_params=pretrained.as_given(parts.init_params))  # hashable, by content
    if config.study.dynamics_every and config.train.epoch_shape == "auto":  # watched between steps: stepped epochs
        config = dataclasses.replace(config, train=dataclasses.replace(config.train, epoch_shape="step"))
    return _make_train(dataclasses.replace(config, study=StudyConfig()), spec, parts)


def model_and_loss(config: Config, spec: DataSpec, parts: Parts) -> tuple[Any, Callable]:
    """``(model functions, per-example loss (outputs, targets) -> losses)``: the user's ``parts``, else what
    ``config`` names; a regression's outputs are shaped like its targets before the loss sees them."""
    if parts.model is None:
        m = config.model
        extra = {} if m.dtype == "float32" else {"dtype": compute_dtype(m.dtype)}  # mixed precision
        model = model_fns(MODELS[m.name], spec.num_classes, {"width": m.width, "dropout": m.dropout, **extra},
                          parts.features)
    else:
        model = model_fns(parts.model, spec.num_classes, features=parts.features)
    if spec.task == "regression":
        user_loss = parts.loss or squared_error
        return model, lambda out, y: user_loss(out.reshape(y.shape), y)
    return model, parts.loss or optax.softmax_cross_entropy_with_integer_labels


@functools.lru_cache(maxsize=16)
def _make_train(config: Config, spec: DataSpec, parts: Parts) -> TrainFns:
    model, example_loss = model_and_loss(config, spec, parts)
    regression = spec.task == "regression"
    b = config.train.batch_size
    steps = steps_per_epoch(spec.n_train, b)
    if steps < 1:
        raise UsageError(f"batch size {b} is larger than the {spec.n_train} training examples; use a batch size of "
                         f"{spec.n_train} or less")
    lr_at = make_schedule(config.optim, config.train.epochs, steps)  # the optimiser's, and CABS's learning rate
    tx = parts.optimizer or make_optimizer(config.optim, lr_at)
    augment_fn = parts.augment
    if augment_fn is None:
        do_augment, flip, padding = augmentation_settings(config, spec.name, spec.image_shape[0])
        if do_augment:
            augment_fn = lambda key, x: augment(x, key, padding, flip)  # noqa: E731
    shape = epoch_shape(config.train.epoch_shape, steps)
    unroll = scan_unroll(config.train.unroll, steps)  # train_epoch's (the scan shape, and the unrolled strategy's)

    def variables(params, batch_stats):
        return {"params": params, "batch_stats": batch_stats}

    def loss_fn(params, batch_stats, x, y, dropout):
        logits, new_stats = model.train_apply(variables(params, batch_stats), x, dropout)
        loss = example_loss(logits, y).mean()
        return loss, (logits, new_stats)

    def recompute_batch_stats(params, batch_stats, x):
        """BatchNorm statistics of given weights, recomputed on data (for interpolated weights)."""
        return model.recompute_batch_stats(variables(params, batch_stats), x)

    inst = None
    if config.instruments.config != "none":  # Cockpit's quantities, computed only at tracked steps
        inst = instrumented(config.instruments, model, loss_fn, recompute_batch_stats, lr_at, steps=steps,
                            epochs=config.train.epochs, unroll=unroll, batch_loss=example_loss,
                            catalogue=parts.model is None and model.per_example_dropout)

    def init(keys: ReplicaKeys, perturb: Perturbations, x_sample: jax.Array) -> TrainState:
        v = model.init(keys.init, x_sample[:1])
        if parts.init_params is not None:  # fine-tuning: the given weights, the init key draws the rest
            v = {**v, "params": pretrained.overlay(v["params"], parts.init_params.tree)}
        flipped = bitflip(v["params"], keys.bitflip)
        params = jax.tree.map(lambda a, b: jnp.where(perturb.bitflip, a, b), flipped, v["params"])
        return TrainState(params, v["batch_stats"], tx.init(params), healthy(),
                          None if inst is None else inst.instruments.init(params))

    def train_step(state: TrainState, x_train, y_train, keys: ReplicaKeys, perturb: Perturbations, epoch, i,
                   batch_idx, *, later: bool = False):
        """Step ``i`` of ``epoch`` on the examples ``batch_idx``: returns (state, (loss, accuracy)), with
        instruments (state, (loss, accuracy, values, tracked)). ``later`` (train_epoch's deferral): the
        instruments do not run; the outputs end with what they need instead of values, tracked."""
        g = epoch * steps + i  # global step: the per-step key index
        x, y = x_train[batch_idx], y_train[batch_idx]
        if augment_fn is not None:
            x = augment_fn(jax.random.fold_in(keys.augmentation, g), x)
        # Off, the identity gather: bitwise the natural order, and no recompile per arm.
        p = jnp.where(perturb.batch_order, batch_permutation(keys.batch_order, g, b), jnp.arange(b))
        x, y = x[p], y[p]
        dkeys = model.dropout_input(jax.random.fold_in(keys.dropout, g), b, p)
        if inst is not None:
            (loss, (logits, bs)), grads, tape = inst.value_and_grad(state.params, state.batch_stats, x, y, dkeys)
        else:
            (loss, (logits, bs)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
                state.params, state.batch_stats, x, y, dkeys)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        # the step's score: accuracy, or for a regression the batch's mean absolute error
        acc = jnp.mean(jnp.abs(logits.reshape(y.shape) - y)) if regression else jnp.mean(jnp.argmax(logits, -1) == y)
        if inst is None:
            return TrainState(params, bs, opt_state, state.health), (loss, acc)
        istate, out = inst.after_step(state.instruments, state.params, (x, y, dkeys), state.batch_stats, updates, grads,
                                      loss, g, tape, later)
        return TrainState(params, bs, opt_state, state.health, istate), (loss, acc, *out)

    def indices(keys: ReplicaKeys, epoch):
        """The epoch's example indices, (steps, batch)."""
        return epoch_indices(keys.data_order, epoch, spec.n_train, b)

    def finish(start: TrainState, end: TrainState, out, epoch):
        """After an epoch's steps (their outputs stacked): the divergence guard and the epoch's metrics."""
        return guard(start, end, out[0], epoch * steps), epoch_metrics(out)

    def run_steps(step: Callable, carry, idx):
        """``step(carry, i, batch_idx) -> (carry, out)`` over the epoch's steps, outputs stacked."""
        if steps == 1:  # a 1-trip scan still lowers to a while loop (jax#25330): XLA:CPU's slow path
            carry, out = step(carry, jnp.int32(0), idx[0])
            return carry, jax.tree.map(lambda a: a[None], out)
        return jax.lax.scan(lambda c, inputs: step(c, *inputs), carry, (jnp.arange(steps), idx), unroll=unroll)

    def train_epoch(state: TrainState, x_train, y_train, keys: ReplicaKeys, perturb: Perturbations, epoch):
        def step(state: TrainState, i, batch_idx, later: bool = False):
            return train_step(state, x_train, y_train, keys, perturb, epoch, i, batch_idx, later=later)

        idx = indices(keys, epoch)
        if inst is not None and inst.defer:  # the instruments measured after the steps (instruments/epoch.py)
            new, out = inst.deferred_epoch(run_steps, functools.partial(step, later=True), state, idx, epoch)
        else:
            new, out = run_steps(step, state, idx)
        return finish(state, new, out, epoch)

    def epoch_step(state: TrainState, x_train, y_train, keys: ReplicaKeys, perturb: Perturbations, epoch, i, idx):
        return train_step(state, x_train, y_train, keys, perturb, epoch, i, idx[i])

    def epoch_finish(start: TrainState, end: TrainState, outs, epoch):
        return finish(start, end, jax.tree.map(lambda *a: jnp.stack(a), *outs), epoch)

    evaluate = evaluator(model, config.train.eval_batch_size)

    return TrainFns(init, train_step, train_epoch, evaluate, recompute_batch_stats, b, steps, unroll,
                    None if inst is None else inst.instruments, spec,
                    loss_fn, parts, model, tx, example_loss, augment_fn, shape, indices, epoch_step, epoch_finish,
                    replica_threads(config.train.replica_threads))
