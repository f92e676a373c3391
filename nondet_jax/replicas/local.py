"""The one-device strategies: ``vmap`` (one program over the replica axis), ``sequential`` (the
single-replica programs in a Python loop) and ``unrolled`` (those programs inside one jitted program)."""

from __future__ import annotations

import weakref
from functools import lru_cache

import jax
import jax.numpy as jnp
import numpy as np

from nondet_jax.machine.quick import once as quick
from nondet_jax.machine.threads import in_threads
from nondet_jax.replicas.loop import Strategy, _stack, _take, unwatched
from nondet_jax.sources import replica_slice
from nondet_jax.train import TrainFns, stepped_epoch, stepped_programs


def epoch_program(fns: TrainFns, lift):
    """The strategy's epoch ``(state, x, y, keys, perturb, e) -> (state, metrics)``: ``train_epoch`` lifted
    (``lift(fn, in_axes)``: jitted, vmapped where there is a replica axis), or, when ``fns.epoch_shape`` is
    ``"step"``, the same epoch driven step by step (:func:`nondet_jax.train.stepped_epoch`)."""
    if fns.epoch_shape == "step":
        return stepped_epoch(fns, lift)
    return lift(fns.train_epoch, (0, None, None, 0, None, None))


# the programs (``fns.train_epoch``, ``fns.epoch_step`` stepped, ``fns.evaluate``) that have run once in this process: their
# programs are compiled, so a later arm's first epoch starts every thread at once (an arm of 8 replicas in 2 threads:
# 4 rounds, not replica 0 alone and then 4 more)
_RAN: weakref.WeakSet = weakref.WeakSet()


@lru_cache(maxsize=32)
def _jit(fn, in_axes=None, once: bool = False):
    """``jax.jit(fn)``, one per function (``in_axes`` unused: the one-replica layout of :func:`epoch_program`);
    ``once``: compiled quickly (:func:`nondet_jax.machine.quick.once`)."""
    return (quick if once else jax.jit)(fn)


def sequential_strategy(fns: TrainFns) -> Strategy:
    """The single-replica programs, each compiled once, in a loop over replicas: ``fns.replica_threads`` of them
    at once, each replica's epoch dispatched from a thread of its own (XLA:CPU runs one thread's programs one after
    another; each replica's programs and inputs are the same whichever thread runs them, so the results are too).
    The first epoch this process runs of ``fns``'s programs trains replica 0 alone first, so the threads find them
    compiled (a later arm's strategy shares them: ``_jit``). Watched
    (``watch``), a stepped epoch runs step-major in one thread: step i of every replica, then step i + 1 (the same
    programs on the same inputs, so the same results), and ``watch(i, replica)`` sees every replica's state before
    step i."""
    init, evaluate = quick(fns.init), jax.jit(fns.evaluate)
    epoch_fn = epoch_program(fns, _jit)
    program = fns.epoch_step if fns.epoch_shape == "step" else fns.train_epoch  # what _RAN knows
    # the replicas the last stacked state was made of: the next epoch starts from them instead of slicing them back
    # out of the stack (numpy and device_put: 30 ms an epoch of 8 ResNet-8 replicas, 2.6 s of a default study's
    # Python, benchmarks/study_overheads.py)
    kept: dict = {}

    def stacked(replicas: list):
        kept.clear()  # consumed: dropped before the new stack is made, so the peak is what it was (the old stack, the
        # new replicas and the new stack)
        out = _stack(replicas)
        kept.update(stacked=out, replicas=replicas)
        return out

    def replica(state, r: int):
        return kept["replicas"][r] if kept.get("stacked") is state else _take(state, r)

    def init_all(keys, perturb, x):
        r_count = jax.tree.leaves(keys)[0].shape[0]
        return stacked([init(replica_slice(keys, r), perturb, x) for r in range(r_count)])

    def epoch_all(state, x, y, keys, perturb, e, progress, watch=None):
        r_count = jax.tree.leaves(keys)[0].shape[0]
        if watch is not None:
            return watched_epoch(state, x, y, keys, perturb, e, progress, watch, r_count)

        def one(r):
            s, m = epoch_fn(replica(state, r), x, y, replica_slice(keys, r), perturb, e)
            return s, jax.block_until_ready(m)

        outs = []
        for out in in_threads(one, range(r_count), fns.replica_threads, first_alone=program not in _RAN,
                              name="replica"):
            outs.append(out)
            progress(1)
        _RAN.add(program)
        return stacked([o[0] for o in outs]), _stack([o[1] for o in outs])

    def watched_epoch(state, x, y, keys, perturb, e, progress, watch, r_count):
        if fns.epoch_shape != "step":
            raise unwatched("the sequential strategy with train.epoch_shape scan")
        begin, step, finish = stepped_programs(fns, _jit)
        ks = [replica_slice(keys, r) for r in range(r_count)]
        start = [replica(state, r) for r in range(r_count)]
        new, idx, outs = list(start), [begin(k, e) for k in ks], [[] for _ in ks]
        for i in range(fns.steps_per_epoch):
            watch(i, lambda r: new[r])
            for r, k in enumerate(ks):
                new[r], out = step(new[r], x, y, k, perturb, e, np.int32(i), idx[r])
                outs[r].append(out)
        done = [finish(start[r], new[r], outs[r], e) for r in range(r_count)]
        progress(r_count)
        return stacked([d[0] for d in done]), _stack([jax.block_until_ready(d[1]) for d in done])

    def evaluate_all(state, x):
        def one(r):
            return jax.block_until_ready(evaluate(replica(state, r), x))

        r_count = jax.tree.leaves(state.params)[0].shape[0]
        outputs = list(in_threads(one, range(r_count), fns.replica_threads, first_alone=fns.evaluate not in _RAN,
                                  name="replica"))
        _RAN.add(fns.evaluate)
        return tuple(np.stack([np.asarray(o[i]) for o in outputs]) for i in (0, 1))

    return Strategy("sequential", init_all, epoch_all, evaluate_all)


@lru_cache(maxsize=32)
def _jit_vmap(fn, in_axes, once: bool = False):
    """``jax.jit(jax.vmap(fn, in_axes))``, one per function: the arms of a study (each builds its strategy) share
    the compiled programs instead of compiling their own copies (a 4-arm study: 49 programs, 39 for one arm).
    ``once``: a program that runs once per replica, compiled quickly (:func:`nondet_jax.machine.quick.once`)."""
    return (quick if once else jax.jit)(jax.vmap(fn, in_axes=in_axes))


def vmap_strategy(fns: TrainFns) -> Strategy:
    """One jitted program over the replica axis per epoch."""
    init = _jit_vmap(fns.init, (0, None, None), once=True)
    epoch_fn = epoch_program(fns, _jit_vmap)
    evaluate = _jit_vmap(fns.evaluate, (0, None))

    def epoch_all(state, x, y, keys, perturb, e, progress, watch=None):
        if watch is None:
            state, m = epoch_fn(state, x, y, keys, perturb, e)
        elif fns.epoch_shape != "step":
            raise unwatched("the vmap strategy with train.epoch_shape scan")
        else:  # the stepped epoch: watch sees the stacked state before each step, one replica at a time
            state, m = epoch_fn(state, x, y, keys, perturb, e, watch=lambda i, s: watch(i, lambda r: _take(s, r)))
        m = jax.block_until_ready(m)
        progress(jax.tree.leaves(keys)[0].shape[0])
        return state, m

    return Strategy("vmap", init, epoch_all, evaluate)


def unrolled_strategy(fns: TrainFns) -> Strategy:
    """The R single-replica programs inside one jitted program per epoch: the loop over replicas is
    unrolled while tracing, so an epoch of R replicas is one launch (no Python loop between replicas)
    and each replica computes what ``sequential`` computes. Compile time and program size grow with R."""

    def count(keys) -> int:
        return jax.tree.leaves(keys)[0].shape[0]

    @quick
    def init_all(keys, perturb, x):
        return _stack([fns.init(replica_slice(keys, r), perturb, x) for r in range(count(keys))])

    @jax.jit
    def epoch_fn(state, x, y, keys, perturb, e):
        outs = [fns.train_epoch(_take(state, r), x, y, replica_slice(keys, r), perturb, e) for r in range(count(keys))]
        return _stack([o[0] for o in outs]), _stack([o[1] for o in outs])

    @jax.jit
    def evaluate_all(state, x):
        outs = [fns.evaluate(_take(state, r), x) for r in range(jax.tree.leaves(state.params)[0].shape[0])]
        return tuple(jnp.stack([o[i] for o in outs]) for i in (0, 1))

    def epoch_all(state, x, y, keys, perturb, e, progress, watch=None):
        if watch is not None:
            raise unwatched("the unrolled strategy")
        state, m = epoch_fn(state, x, y, keys, perturb, e)
        m = jax.block_until_ready(m)
        progress(count(keys))
        return state, m

    return Strategy("unrolled", init_all, epoch_all, evaluate_all)
