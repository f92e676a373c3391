"""Building a strategy by name (``auto`` resolved by :func:`nondet_jax.replicas.rule.resolve_strategy`)."""

from __future__ import annotations

from typing import Callable

from nondet_jax.replicas.local import sequential_strategy, unrolled_strategy, vmap_strategy
from nondet_jax.replicas.loop import ArmResult, Strategy, train_replicas
from nondet_jax.sources import Perturbations, ReplicaKeys
from nondet_jax.train import TrainFns


def strategy_epoch_shape(fns: TrainFns, strategy: str) -> str:
    """The epoch shape a strategy runs: ``fns.epoch_shape`` for ``sequential`` and ``vmap`` (one step program
    driven from Python, or one scan program per epoch); the ``unrolled`` and ``sharded`` strategies always scan."""
    return fns.epoch_shape if strategy in ("sequential", "vmap") else "scan"


STRATEGY_BUILDERS = {"vmap": vmap_strategy, "sequential": sequential_strategy, "unrolled": unrolled_strategy}


def make_strategy(fns: TrainFns, name: str) -> Strategy:
    if name == "sharded":  # imported here: nondet_jax.replicas.sharded builds on this module
        from nondet_jax.replicas.sharded import sharded_strategy

        return sharded_strategy(fns)
    if name not in STRATEGY_BUILDERS:
        raise ValueError(f"unknown strategy {name!r}; use one of {', '.join(STRATEGY_BUILDERS)}")
    return STRATEGY_BUILDERS[name](fns)


def run_replicas(fns: TrainFns, keys: ReplicaKeys, perturb: Perturbations, data, epochs: int,
                 strategy: str, progress: Callable[[int], None] = lambda n: None, **kwargs) -> ArmResult:
    """Train the replicas whose keys are given (leading axis R) with a concrete strategy; keyword
    arguments go to :func:`train_replicas` (checkpoint resume, per-epoch callback, fault)."""
    return train_replicas(make_strategy(fns, strategy), keys, perturb, data, epochs, progress, **kwargs)
