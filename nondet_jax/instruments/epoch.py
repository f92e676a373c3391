"""The instruments inside a training epoch: what ``nondet_jax.train`` asks the instruments package, once.

:func:`instrumented` returns an :class:`Instrumented`: the training step's gradient (with the tape the
``train_pass`` mode records), what to do after each step (measure now, or keep what the step saw for
later), and the deferred epoch. An unrolled epoch would hold one copy of the instruments per step (a
tiny economy study spent minutes compiling them): in ``train_pass`` mode without curvature quantities
the instruments run no convolution, so they are measured after the epoch's steps in one rolled loop,
and under a sparse schedule only on the steps the schedule reads (:func:`sparse_deferred`). Both give
bitwise the values of measuring step by step (``tests/test_train_pass.py``).

The training state is duck-typed: a NamedTuple with an ``instruments`` field (``train.TrainState``).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from nondet_jax.instruments.core import Instruments
from nondet_jax.instruments.layerwise import LazyTape, Tape
from nondet_jax.instruments.schedules import most_in_epoch
from nondet_jax.instruments.trainer import batch_of, defer_in_epoch, evaluate_outputs, for_model


class Seen(NamedTuple):
    """What the instruments need from one training step (stacked over an epoch when deferred)."""

    params: Any  # before the step's update
    batch: Any  # (x, y, dropout keys or None)
    batch_stats: Any  # before the step
    updates: Any
    grads: Any
    loss: Any
    step: Any  # global step
    tape: Any  # (records, deltas, per-example losses) of the recorded backward pass, or None


class Instrumented(NamedTuple):
    instruments: Instruments
    value_and_grad: Callable  # (params, batch_stats, x, y, dropout) -> ((loss, aux), grads, tape or None)
    after_step: Callable  # (istate, params, (x, y, dropout), batch_stats, updates, grads, loss, step, tape, later)
    #                       -> (istate, outputs the step appends)
    defer: bool  # measure after the epoch's steps (deferred_epoch) instead of inside each
    deferred_epoch: Callable  # (run_steps, step_later, state, idx, epoch) -> (state, stacked outputs)


def instrumented(cfg, model, train_loss: Callable, batch_stats_of: Callable, lr_at: Callable, *, steps: int,
                 epochs: int, unroll: int, batch_loss: Callable, catalogue: bool) -> Instrumented:
    """The instruments of one replica of ``model`` (``models.parts.ModelFns``) for ``cfg`` (an
    ``InstrumentsConfig``): ``train_loss`` ``(params, batch_stats, x, y, dropout) -> (loss, (outputs,
    batch_stats))``, ``batch_stats_of`` ``(params, batch_stats, x)``, ``lr_at`` the learning-rate schedule.
    ``catalogue``: the catalogue's models keep dropout on, one key per example; any other model is measured
    through its evaluate (inference mode, dropout off) and the per-layer path where its layers allow."""
    shared_key = not model.per_example_dropout
    inst = for_model(cfg, model.module if catalogue else None, train_loss, batch_stats_of, steps * epochs,
                     batch_loss=batch_loss, outputs=None if catalogue else evaluate_outputs(model.evaluate, batch_loss),
                     shared_key=shared_key)
    defer = unroll > 1 and defer_in_epoch(inst)
    alpha = "Alpha" in inst.quantities
    most_read = most_in_epoch(inst.schedule, steps, alpha)  # steps of an epoch the instruments read
    tape_calls = {}  # the recorded layers (static), from the trace of a deferred step

    def value_and_grad(params, batch_stats, x, y, dropout):
        if inst.value_grad_and_tape is not None:  # instruments.per_example = train_pass
            return inst.value_grad_and_tape(params, batch_stats, x, y, dropout)
        return (*jax.value_and_grad(train_loss, has_aux=True)(params, batch_stats, x, y, dropout), None)

    def measure(istate, seen: Seen, tape=None):
        """The instruments' update for one step from what the step saw: ``(istate, values)``."""
        return inst.update(istate, seen.params, seen.batch, step=seen.step, context=seen.batch_stats,
                           updates=seen.updates, lr=lr_at(seen.step), grads=seen.grads, loss=seen.loss, tape=tape)

    def after_step(istate, params, batch, batch_stats, updates, grads, loss, step, tape, later: bool):
        """What a training step saw (its parameters before the update): ``later`` (the deferred epoch),
        kept for later; else measured now: ``(values, tracked)``."""
        seen = Seen(params, batch_of(*batch, shared_key), batch_stats, updates, grads, loss, step, None)
        if later:
            if tape is not None:
                tape_calls["calls"] = tape.calls
            return istate, (seen._replace(tape=None if tape is None else (tape.records, tape.deltas, tape.losses)),)
        istate, values = measure(istate, seen, tape)
        return istate, (values, inst.schedule(seen.step))

    def deferred_epoch(run_steps: Callable, step_later: Callable, state, idx, epoch):
        """The epoch's training steps (``run_steps(step_later, state, idx)``), then the instruments of every
        step in one rolled scan: one copy of their program instead of one per unrolled step, and their work
        (products of recorded activations, no convolution) runs as fast in a loop."""
        if most_read < steps:  # keep and measure only the steps the schedule reads
            return sparse_deferred(inst, measure, tape_calls, run_steps, step_later, state, idx, epoch,
                                   steps=steps, slots=most_read, alpha=alpha)
        new, out = run_steps(step_later, state, idx)

        def measure_step(istate, seen):
            tape = None if seen.tape is None else Tape(tape_calls["calls"], *seen.tape)
            istate, values = measure(istate, seen, tape)
            return istate, (values, inst.schedule(seen.step))

        istate, (values, tracked) = jax.lax.scan(measure_step, state.instruments, out[2])
        return new._replace(instruments=istate), (out[0], out[1], values, tracked)

    return Instrumented(inst, value_and_grad, after_step, defer, deferred_epoch)


def sparse_deferred(inst: Instruments, measure: Callable, tape_calls: dict, run_steps: Callable,
                    step_later: Callable, state, idx, epoch, *, steps: int, slots: int, alpha: bool):
    """A deferred epoch whose schedule reads at most ``slots`` of its steps (tracked ones, and the step after
    each for Alpha): only those keep their tape, one flat row each in a buffer written under a ``lax.cond``,
    and the instruments run ``slots`` times. Keeping and measuring every step's tape made economy every 16
    steps cost 1.46x the plain epoch on XLA:CPU, against 1.28x this way (``benchmarks/instruments.py
    --epoch-timing``, docs/instruments.md)."""
    def read(g):  # whether the instruments read step g
        return inst.schedule(g) | ((g >= 1) & inst.schedule(g - 1)) if alpha else inst.schedule(g)

    def recorded(st, i, batch_idx):  # (records, deltas) of a step's tape; None without one
        t = step_later(st, i, batch_idx)[1][2].tape
        return None if t is None else t[:2]

    shapes = jax.eval_shape(recorded, state, jnp.int32(0), idx[0])
    leaves, treedef = jax.tree.flatten(shapes)
    sizes = [a.size for a in leaves]
    dtype = jnp.result_type(*leaves) if leaves else jnp.float32
    buf0 = jnp.zeros((slots, sum(sizes)), dtype)  # the tapes of the steps read, each as one flat row

    def step(carry, i, batch_idx):
        state, buf, count = carry
        state, (loss, acc, seen) = step_later(state, i, batch_idx)
        keep = read(seen.step)
        if leaves:
            row = lambda: jnp.concatenate([a.ravel().astype(dtype) for a in jax.tree.leaves(seen.tape[:2])])  # noqa: E731
            buf = jax.lax.cond(keep, lambda bf: jax.lax.dynamic_update_index_in_dim(bf, row(), count, 0),
                               lambda bf: bf, buf)
        # the steps nobody reads are measured as step -2: tracked by no schedule, after no tracked step
        seen = seen._replace(tape=None if seen.tape is None else seen.tape[2], step=jnp.where(keep, seen.step, -2))
        return (state, buf, count + keep.astype(jnp.int32)), (loss, acc, seen, keep)

    (new, buf, count), (losses, accs, seen_all, kept) = run_steps(step, (state, buf0, jnp.int32(0)), idx)
    # the steps read, in order, then steps nobody reads (measured as step -2: no work, no state change)
    order = jnp.argsort(~kept, stable=True)[:slots]

    def unflat(row):
        parts = jnp.split(row, np.cumsum(sizes)[:-1])
        return jax.tree.unflatten(treedef, [p.reshape(a.shape).astype(a.dtype) for p, a in zip(parts, leaves)])

    def measure_slot(istate, j):
        seen = jax.tree.map(lambda a: a[order[j]], seen_all)
        # the tape is sliced and unflattened only where a branch reads it
        tape = None if not leaves else LazyTape(tape_calls["calls"], lambda: unflat(buf[j]), seen.tape)
        return measure(istate, seen, tape)

    istate, values = jax.lax.scan(measure_slot, state.instruments, jnp.arange(slots))
    at = jnp.where(jnp.arange(slots) < count, order, steps)  # unused slots are dropped
    values = jax.tree.map(lambda v: jnp.full((steps,) + v.shape[1:], jnp.nan, v.dtype).at[at].set(v, mode="drop"),
                          values)
    tracked = jax.vmap(inst.schedule)(epoch * steps + jnp.arange(steps))
    return new._replace(instruments=istate), (losses, accs, values, tracked)
