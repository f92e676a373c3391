"""Choosing and building a strategy by name (``auto`` by the measured rule)."""

from __future__ import annotations

from typing import Callable

import jax

from nondet_jax.machine import measured
from nondet_jax.replicas.local import sequential_strategy, unrolled_strategy, vmap_strategy
from nondet_jax.replicas.loop import ArmResult, Strategy, train_replicas
from nondet_jax.sources import Perturbations, ReplicaKeys
from nondet_jax.train import TrainFns


def resolve_strategy(requested: str, replicas: int, backend: str | None = None) -> tuple[str, str]:
    """Pick the strategy for ``auto``; returns (strategy, reason), the reason naming the measurement.

    Rule: one replica runs ``sequential``; several accelerators run ``sharded`` (replicas over the
    devices, vmapped on each); otherwise the backend's measured rule in ``measured.json``
    (:func:`nondet_jax.machine.measured.strategy_rule`): ``vmap`` from ``vmap_min_replicas`` replicas on,
    ``sequential`` below it or when it is null (CPU: a vmapped ResNet step cost several times the
    loop, benchmarks/replicas.py and benchmarks/peer_pytorch.py; one GPU: vmap from 16 replicas on,
    from benchmarks/replica_speed.py on an H200, where ResNet-14 bfloat16 at batch 128 and R=16 gave
    2.45x a real loop under the determinism flags, and benchmarks/gpu_bench.py, 0.73x at R=4 in
    float32). A backend without a rule (TPU: not measured here) runs ``vmap``.
    """
    if requested != "auto":
        return requested, "requested"
    backend = backend or jax.default_backend()
    if replicas == 1:
        return "sequential", "auto: one replica"
    if backend != "cpu" and jax.local_device_count() > 1:
        return "sharded", f"auto: replicas over {jax.local_device_count()} {backend} devices, vmapped on each"
    rule = measured.strategy_rule(backend)
    if not rule:
        return "vmap", f"auto: {backend} batches replicas with vmap (no measured rule for {backend})"
    least = rule.get("vmap_min_replicas")
    if least is None or replicas < least:
        below = "never beat" if least is None else f"did not beat below {least} replicas"
        return "sequential", f"auto: on {backend} vmap {below} a loop ({rule['source']})"
    return "vmap", f"auto: on {backend} vmap beat a loop from {least} replicas on ({rule['source']})"


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
