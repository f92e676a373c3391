"""The named randomness sources and the one key-derivation rule (docs/metrics.md).

Every PRNG key in nondet_jax is made here::

    root            = jax.random.key(study_seed)
    stream(source)  = fold_in(root, SOURCE_ID[source])
    key(source, r)  = fold_in(stream(source), r + 1)   if the arm varies the source
                      fold_in(stream(source), 0)       otherwise (shared by every replica)
    per epoch/step  : fold_in(key(source, r), epoch or step)

A source of your own (:func:`nondet_jax.replicate`'s ``sources=``) follows the same rule with
``source_id(name)`` in place of ``SOURCE_ID[source]``: a hash of its name, never a built-in index.

Two kinds of source:

* *draw* sources (``init``, ``data_order``, ``augmentation``, ``dropout``) always draw from their
  key; frozen, every replica draws the same.
* *perturbation* sources (``bitflip``, ``batch_order``) change an otherwise fixed computation;
  frozen they are the identity (no weight nudged, minibatches in their natural order), so an arm
  that varies neither trains exactly the unperturbed model.

``hardware`` (the backend's own nondeterminism) has no key: an arm that varies it runs in a
child process with XLA's determinism flags off (``study.run``), all its seeds as the other
sources of the arm say. ``all`` varies every *seeded* source; add ``+hardware`` to include it.

Example::

    keys = arm_keys(seed=0, varied=arm_sources("init"), replicas=4)
    keys.init.shape  # (4,): one init key per replica; keys.data_order holds 4 copies of one key
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

# The arm grammar lives in nondet_jax.arms (no JAX); these names are part of this module's interface too.
from nondet_jax.arms import (  # noqa: F401
    IMPLEMENTED,
    PERTURBATIONS,
    RESERVED,
    SOURCE_ID,
    SOURCES,
    Arm,
    arm_sources,
    check_own_sources,
    parse_arm,
    source_id,
    split_variant,
)
from nondet_jax.errors import UsageError
from nondet_jax.machine.quick import once


class ReplicaKeys(NamedTuple):
    """One typed key per implemented source; a leading replica axis when made by :func:`arm_keys`."""

    init: jax.Array
    data_order: jax.Array
    augmentation: jax.Array
    dropout: jax.Array
    bitflip: jax.Array
    batch_order: jax.Array


class Perturbations(NamedTuple):
    """Whether each perturbation source is on: boolean scalars, passed at call time so one
    compiled program serves every arm."""

    bitflip: jax.Array
    batch_order: jax.Array


def perturbations(varied: frozenset[str]) -> Perturbations:
    """The perturbation switches of an arm that varies ``varied``."""
    return Perturbations(*(jnp.asarray(s in varied) for s in PERTURBATIONS))


def stream(seed: int, source: str) -> jax.Array:
    """The key stream of one source: ``fold_in(key(seed), source_id(source))``."""
    return jax.random.fold_in(jax.random.key(seed), source_id(source))


def replica_key(seed: int, source: str, replica: int, varies: bool) -> jax.Array:
    """Key of ``source`` for ``replica`` (0-based); shared by all replicas when not ``varies``."""
    return jax.random.fold_in(stream(seed, source), replica + 1 if varies else 0)


def arm_keys(seed: int, varied: frozenset[str], replicas: int, first: int = 0) -> ReplicaKeys:
    """Keys of every implemented source for replicas ``first``..``replicas``-1 of an arm, each with a leading
    replica axis (one compiled program per seed and replica range, whatever the arm)."""
    return ReplicaKeys(*_fold_streams(seed, tuple(source_id(s) for s in IMPLEMENTED),
                                      np.array([s in varied for s in IMPLEMENTED]), first, replicas))


def own_keys(seed: int, names: tuple[str, ...], varied: frozenset[str], replicas: int) -> dict[str, jax.Array]:
    """Keys of your own sources for replicas 0..R-1 of an arm, by the same rule as :func:`arm_keys`."""
    if not names:
        return {}
    keys = _fold_streams(seed, tuple(source_id(n) for n in names), np.array([n in varied for n in names]), 0,
                         replicas)
    return dict(zip(names, keys))


@once(static_argnums=(0, 1, 3, 4))
def _fold_streams(seed, ids, varies, first, stop):
    """Per source id, the keys of replicas first..stop-1: ``fold_in(stream, r + 1)`` where ``varies``, else
    ``fold_in(stream, 0)`` (the rule in this module's docstring)."""
    idx = jnp.arange(first, stop, dtype=jnp.uint32)
    root = jax.random.key(seed)
    return tuple(jax.vmap(jax.random.fold_in, in_axes=(None, 0))(jax.random.fold_in(root, sid),
                                                                  jnp.where(varies[i], idx + 1, 0).astype(jnp.uint32))
                 for i, sid in enumerate(ids))


def abstract_keys() -> ReplicaKeys:
    """The shapes of one replica's keys (no replica axis), for ``jax.eval_shape``: nothing is compiled."""
    return jax.eval_shape(lambda: ReplicaKeys(*(jax.random.key(0) for _ in IMPLEMENTED)))


def replica_slice(keys: ReplicaKeys, r: int) -> ReplicaKeys:
    """Keys of replica ``r`` from keys with a leading replica axis (one compiled program, ``r`` an argument)."""
    return _replica_slice(keys, r)


@once
def _replica_slice(keys, r):
    return jax.tree.map(lambda k: k[r], keys)


def one_replica(arm: str = "init", replica: int = 0, seed: int = 0) -> tuple[ReplicaKeys, Perturbations]:
    """Replica ``replica`` of arm ``arm``: its keys (no replica axis) and the arm's perturbations, the
    arguments of the single-replica training functions (what benchmarks and tests of one replica build)."""
    varied = arm_sources(arm)
    return replica_slice(arm_keys(seed, varied, replica + 1), replica), perturbations(varied)


class StepKeys:
    """The keys :func:`nondet_jax.replicate` hands one replica's ``init`` and ``step``.

    ``keys.init``, ``keys.data_order``, ``keys.augmentation``, ``keys.dropout``, ``keys.bitflip``,
    ``keys.batch_order``: the replica's own key where the arm varies that source, one key shared by
    every replica otherwise; in ``step`` folded with the step index (a fresh draw per step).
    ``keys.step``: the step index (None in ``init``), for schedules of your own.
    ``keys.varies(source)``: a boolean array, True where the arm varies ``source`` (traced, so one
    compiled program serves every arm: use it with ``jnp.where`` / ``lax.cond``, not ``if``).
    :func:`bitflip` takes these keys directly and is the identity in an arm that does not vary it.
    Which sources the functions read is recorded while they are traced (``reads``), so that an arm
    whose sources are never read is refused instead of returning copies of control.
    """

    __slots__ = ("_keys", "_on", "_step", "_reads", "_own", "_own_on")

    def __init__(self, keys: ReplicaKeys, on: ReplicaKeys, step=None, reads: set | None = None,
                 own: dict | None = None, own_on: dict | None = None):
        self._keys, self._on, self._step = keys, on, step
        self._reads = reads if reads is not None else set()
        self._own, self._own_on = own or {}, own_on or {}  # sources of your own: name -> key, switch

    def __getattr__(self, name: str):
        if name in IMPLEMENTED or name in self._own:
            self._reads.add(name)
            key = self._own[name] if name in self._own else getattr(self._keys, name)
            return key if self._step is None else jax.random.fold_in(key, self._step)
        raise AttributeError(f"keys have no source '{name}'; sources: {', '.join((*IMPLEMENTED, *self._own))}")

    @property
    def step(self):
        """The step index in ``step`` (a traced int32, 0 at the first step); None in ``init``."""
        return self._step

    def varies(self, source: str) -> jax.Array:
        """True (a boolean array) where this arm varies ``source``."""
        if source in self._own_on:
            return self._own_on[source]
        if source not in IMPLEMENTED:
            raise UsageError(f"keys.varies('{source}'): unknown source; choose one of "
                             f"{', '.join((*IMPLEMENTED, *self._own))}")
        return getattr(self._on, source)

    def tree_flatten(self):
        names = tuple(self._own)
        return (tuple(getattr(self, n) for n in IMPLEMENTED) + tuple(self._on)
                + tuple(getattr(self, n) for n in names) + tuple(self._own_on[n] for n in names)), names

    @classmethod
    def tree_unflatten(cls, names, children):
        n, k = len(IMPLEMENTED), len(names)
        own = children[2 * n:]
        return cls(ReplicaKeys(*children[:n]), ReplicaKeys(*children[n:2 * n]), own=dict(zip(names, own[:k])),
                   own_on=dict(zip(names, own[k:])))


jax.tree_util.register_pytree_node_class(StepKeys)


def switches(varied: frozenset[str], replicas: int) -> ReplicaKeys:
    """Per source, (replicas,) booleans: whether the arm varies it (what :meth:`StepKeys.varies` returns)."""
    return ReplicaKeys(*(jnp.full((replicas,), s in varied) for s in IMPLEMENTED))


def _leaf_name(path) -> str:
    last = path[-1] if path else None
    return str(getattr(last, "key", getattr(last, "name", getattr(last, "idx", ""))))


def bitflip(params, key):
    """Move one weight of ``params`` (any pytree of arrays) by exactly one ulp.

    The weight is drawn uniformly over the scalars of all ``kernel`` leaves (biases and BatchNorm
    parameters start at 0 or 1, where a one-ulp step is a subnormal that XLA:CPU flushes to zero);
    a tree without ``kernel`` leaves draws among the nonzero scalars of all its floating-point
    leaves. The direction (toward +inf or -inf) is a fair coin. Both come from ``key``; given the
    :class:`StepKeys` of :func:`nondet_jax.replicate`, the flip happens only in arms that vary
    ``bitflip`` (elsewhere the params come back unchanged). Returns the new params (same structure
    and dtypes).
    """
    if isinstance(key, StepKeys):
        flipped = bitflip(params, key.bitflip)
        on = key.varies("bitflip")
        return jax.tree.map(lambda a, b: jnp.where(on, a, b), flipped, params)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    floats = [i for i, (_, leaf) in enumerate(leaves) if jnp.issubdtype(jnp.result_type(leaf), jnp.inexact)
              and jnp.size(leaf)]
    kernels = [i for i in floats if _leaf_name(leaves[i][0]) == "kernel"]
    chosen = kernels or floats
    if not chosen:
        raise ValueError("bitflip needs at least one floating-point parameter")
    arrays = [jnp.asarray(leaves[i][1]) for i in chosen]
    sizes = [a.size for a in arrays]
    k_idx, k_dir = jax.random.split(key)
    if kernels:
        flat_index = jax.random.randint(k_idx, (), 0, sum(sizes))
    else:  # the j-th nonzero scalar, j uniform
        nonzero = jnp.cumsum(jnp.concatenate([(a.reshape(-1) != 0).astype(jnp.int32) for a in arrays]))
        j = jax.random.randint(k_idx, (), 0, jnp.maximum(nonzero[-1], 1))
        flat_index = jnp.searchsorted(nonzero, j + 1)
    up = jax.random.bernoulli(k_dir)
    start = 0
    out = [leaf for _, leaf in leaves]
    for i, w in zip(chosen, arrays):
        local = flat_index - start
        start += w.size
        hit = (local >= 0) & (local < w.size)
        v = w.reshape(-1)
        j = jnp.clip(local, 0, w.size - 1)
        target = jnp.where(up, jnp.inf, -jnp.inf).astype(w.dtype)
        moved = jnp.nextafter(v[j], target)
        out[i] = v.at[j].set(jnp.where(hit, moved, v[j])).reshape(w.shape)
    return jax.tree_util.tree_unflatten(treedef, out)
