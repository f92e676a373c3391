"""The ``sharded`` strategy: the replica axis over a device mesh, batched inside each device.

Layout. With D devices and R replicas, ``run_sharded`` runs *rounds*; in each round every device
trains ``per_device`` replicas (``w``) of its own, so a round covers D x w replicas::

    inner="vmap"        w = ceil(R / D), one round: device d holds replicas d*w .. d*w + w - 1
                        (contiguous blocks), vmapped, as the ``vmap`` strategy on w replicas;
    inner="sequential"  w = 1, ceil(R / D) rounds: round j puts replica j*D + d on device d and
                        each device runs exactly the single-replica program (no vmap), as
                        the ``sequential`` strategy; the D devices work in parallel;
    per_device=w        any fixed width: ceil(R / (D*w)) rounds of w-wide vmaps per device.

Each round is one ``jax.jit(jax.shard_map(...))`` program over a 1-D mesh with axis
``"replicas"`` (``jax.make_mesh``, ``AxisType.Auto``): states and keys are ``NamedSharding``
with ``P("replicas")`` on their leading axis, the data and the perturbation switches replicated
(``P()``). One program serves every round and every epoch (compiled once).

Padding, not fallback. When D x w x rounds > R the last round is padded with copies of the last
replica's keys; their results are computed and dropped. Padding never changes a real
replica's result (replicas do not interact) and costs at most D*w - 1 extra replica-trainings;
falling back to fewer devices would instead idle devices for the whole arm. R < D uses only R
devices.

Dependence on the device count. Replica r's computation is the single-replica program
(``inner="sequential"``, or ``per_device=1``) or a w-wide vmap of it. So:

* ``inner="sequential"`` gives results independent of D and bitwise equal to ``sequential``
  on a deterministic backend (tests/test_sharded.py checks D = 1, 2, 4 on XLA:CPU);
* ``inner="vmap"`` gives, for each device's block, bitwise what ``vmap`` gives on those w
  replicas; since w = ceil(R / D) changes with D, results across device counts agree only up
  to the rounding of the batched program (as ``vmap`` vs ``sequential``). A fixed
  ``per_device`` makes the vmap width, and so the computation, the same for every D.

The stacked state (leading axis R) stays on the mesh between epochs. When R is a multiple of D
it is sharded ``P("replicas")``, R / D contiguous replicas per device; with one round and no
padding (``inner="vmap"``) each epoch is then one call of one program with no data movement.
Otherwise each round's rows are sliced out, placed, trained and concatenated back.
The compiled programs are cached per (training functions, devices, width), so every arm of a
study with the same layout shares one compilation.

Use it as the other strategies: ``run_sharded(fns, keys, perturb, data, epochs)`` (the signature
of ``run_replicas`` without the strategy name), or ``sharded_strategy(fns, ...)`` for
``train_replicas``.

Example (two host devices on a CPU; the flag must be set before jax starts)::

    XLA_FLAGS=--xla_force_host_platform_device_count=2 python -c "..."
    result = run_sharded(fns, keys, perturb, data, epochs, inner="vmap")
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Sequence

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from nondet_jax.machine.quick import once
from nondet_jax.replicas.loop import ArmResult, Strategy, train_replicas, unwatched
from nondet_jax.sources import Perturbations, ReplicaKeys
from nondet_jax.train import TrainFns

AXIS = "replicas"
INNER = ("vmap", "sequential")


def plan(replicas: int, devices: int, inner: str = "vmap", per_device: int | None = None) -> tuple[int, int, int]:
    """(devices used D, replicas per device per round w, rounds) for R replicas on ``devices``.

    Padded replicas: D * w * rounds - R (see the module docstring).
    """
    if inner not in INNER:
        raise ValueError(f"unknown inner strategy {inner!r}; use one of {', '.join(INNER)}")
    if replicas < 1 or devices < 1:
        raise ValueError(f"need at least one replica and one device, got R={replicas}, devices={devices}")
    d = min(devices, replicas)
    if per_device is None:
        w = math.ceil(replicas / d) if inner == "vmap" else 1
    elif per_device < 1:
        raise ValueError(f"per_device must be >= 1, got {per_device}")
    else:
        w = per_device
    return d, w, math.ceil(replicas / (d * w))


def make_mesh(devices: int | Sequence[jax.Device] | None = None) -> jax.sharding.Mesh:
    """A 1-D mesh with axis ``"replicas"`` over the first ``devices`` devices (all if None)."""
    if devices is None or isinstance(devices, int):
        all_devices = jax.local_devices()
        n = len(all_devices) if devices is None else devices
        if not 1 <= n <= len(all_devices):
            raise ValueError(f"asked for {n} devices, {len(all_devices)} available")
        devices = all_devices[:n]
    devices = list(devices)
    return jax.make_mesh((len(devices),), (AXIS,), axis_types=(AxisType.Auto,), devices=devices)


def _per_device(fn: Callable, width: int, in_axes: tuple) -> Callable:
    """``fn`` over a device's ``width`` replicas: vmapped, or (width 1) the single-replica program
    on the squeezed arguments, so that the device runs exactly what ``sequential`` jits."""
    if width > 1:
        return jax.vmap(fn, in_axes=in_axes)

    def single(*args):
        args = [jax.tree.map(lambda a: a[0], x) if ax == 0 else x for x, ax in zip(args, in_axes)]
        return jax.tree.map(lambda a: a[None], fn(*args))

    return single


def _rows(tree, start: int, stop: int, r_count: int):
    """Rows start..stop-1 of a tree with leading axis R, indices past R repeating row R - 1."""
    if start == 0 and stop == r_count:
        return tree
    if stop <= r_count:
        return jax.tree.map(lambda a: a[start:stop], tree)
    idx = np.minimum(np.arange(start, stop), r_count - 1)
    return jax.tree.map(lambda a: a[idx], tree)


@functools.lru_cache(maxsize=32)
def programs(fns: TrainFns, devices: tuple, width: int) -> tuple:
    """(mesh, init, train_epoch, evaluate) as jitted ``shard_map`` programs over ``devices`` with
    ``width`` replicas per device; cached, so every strategy (every arm) shares their compilations."""
    mesh = make_mesh(list(devices))

    def sharded(fn, in_axes, jit=jax.jit):
        in_specs = tuple(P(AXIS) if ax == 0 else P() for ax in in_axes)
        return jit(jax.shard_map(_per_device(fn, width, in_axes), mesh=mesh, in_specs=in_specs, out_specs=P(AXIS)))

    return (mesh, sharded(fns.init, (0, None, None), once), sharded(fns.train_epoch, (0, None, None, 0, None, None)),
            sharded(fns.evaluate, (0, None)))


def sharded_strategy(fns: TrainFns, *, inner: str = "vmap", per_device: int | None = None,
                     devices: int | Sequence[jax.Device] | None = None) -> Strategy:
    """The replica axis over a 1-D device mesh (module docstring): a :class:`~nondet_jax.replicas.loop.Strategy`.

    Args:
      fns: the single-replica training functions.
      inner: ``"vmap"`` (one round, ceil(R/D) replicas vmapped per device) or ``"sequential"``
        (one replica per device per round: the single-replica program).
      per_device: replicas per device per round; overrides the width ``inner`` implies.
      devices: how many of ``jax.devices()`` to use, or the devices themselves (default all).
    """
    plan(1, 1, inner, per_device)  # validate early
    device_list = list(jax.local_devices()[:devices] if isinstance(devices, int) or devices is None else devices)
    if isinstance(devices, int) and not 1 <= devices <= len(jax.local_devices()):
        raise ValueError(f"asked for {devices} devices, {len(jax.local_devices())} available")
    shared_cache: dict[int, tuple] = {}  # id(x) -> (x, x on every device)

    def layout(r_count: int):
        d, w, rounds = plan(r_count, len(device_list), inner, per_device)
        return d * w, rounds, programs(fns, tuple(device_list[:d]), w)

    def shared(mesh, a):
        """``a`` replicated on every device of the mesh (the data: transferred once, not per epoch)."""
        hit = shared_cache.get(id(a))
        if hit is None or hit[0] is not a:
            hit = (a, jax.device_put(a, NamedSharding(mesh, P())))
            shared_cache.clear()  # one data set at a time
            shared_cache[id(a)] = hit
        return hit[1]

    def over_rounds(r_count, program, stacked: tuple, common: tuple, after_round=lambda n: None):
        """Run ``program`` on every round's rows of the ``stacked`` trees; outputs with leading axis R."""
        per_round, rounds, (mesh, *_) = layout(r_count)
        spread = NamedSharding(mesh, P(AXIS))
        outs = []
        for j in range(rounds):
            lo, hi = j * per_round, (j + 1) * per_round
            rows = [jax.device_put(_rows(t, lo, hi, r_count), spread) for t in stacked]
            outs.append(program(*rows, *common))
            after_round(min(hi, r_count) - lo)
        if len(outs) == 1 and rounds * per_round == r_count:
            return outs[0]  # stays sharded: R / D contiguous replicas per device
        out = jax.tree.map(lambda *xs: jnp.concatenate(xs)[:r_count], *outs)
        return jax.device_put(out, spread) if r_count % len(mesh.devices.flat) == 0 else out

    def replicated(mesh, tree):
        return jax.device_put(tree, NamedSharding(mesh, P()))

    def init_all(keys, perturb, x):
        r_count = jax.tree.leaves(keys)[0].shape[0]
        mesh, init = layout(r_count)[2][:2]
        state = over_rounds(r_count, init, (keys,), (replicated(mesh, perturb), replicated(mesh, x)))
        chex.assert_tree_shape_prefix(state, (r_count,))
        return state

    def epoch_all(state, x, y, keys, perturb, e, progress, watch=None):
        if watch is not None:
            raise unwatched("the sharded strategy")
        r_count = jax.tree.leaves(keys)[0].shape[0]
        mesh, _, epoch_fn = layout(r_count)[2][:3]

        def program(s, k, *common):
            s, m = epoch_fn(s, common[0], common[1], k, common[2], common[3])
            return s, jax.block_until_ready(m)

        common = (shared(mesh, x), shared(mesh, y), replicated(mesh, perturb), replicated(mesh, e))
        return over_rounds(r_count, program, (state, keys), common, progress)

    def evaluate_all(state, x):
        r_count = jax.tree.leaves(state.params)[0].shape[0]
        mesh, *_, evaluate = layout(r_count)[2]
        logits, feats = over_rounds(r_count, evaluate, (state,), (shared(mesh, x),))
        return np.asarray(logits), np.asarray(feats)

    return Strategy("sharded", init_all, epoch_all, evaluate_all)


def run_sharded(fns: TrainFns, keys: ReplicaKeys, perturb: Perturbations, data, epochs: int,
                progress: Callable[[int], None] = lambda n: None, *, inner: str = "vmap",
                per_device: int | None = None, devices: int | Sequence[jax.Device] | None = None,
                **kwargs) -> ArmResult:
    """Train the replicas whose keys are given (leading axis R) with the replica axis over a mesh.

    Args:
      fns, keys, perturb, data, epochs, progress: as :func:`nondet_jax.replicas.choice.run_replicas`;
        ``progress(n)`` is called after each round of each epoch with the real replicas it trained.
      inner, per_device, devices: see :func:`sharded_strategy`.
      **kwargs: to :func:`nondet_jax.replicas.loop.train_replicas` (resume, per-epoch callback, fault).

    Returns:
      An :class:`~nondet_jax.replicas.loop.ArmResult` with ``strategy`` ``"sharded"``.
    """
    strategy = sharded_strategy(fns, inner=inner, per_device=per_device, devices=devices)
    return train_replicas(strategy, keys, perturb, data, epochs, progress, **kwargs)
