"""Memory a study needs, checked before anything is allocated, and compiled programs released after.

:func:`check_fits` refuses a study whose replicas cannot fit (``--replicas 10000000`` used to
allocate until the kernel killed the process), naming the numbers. :func:`release_compiled` drops
the compiled programs a finished study holds: XLA:CPU maps every compiled program into memory
(one ResNet-14 with the full instruments holds about 11,500 mappings) and a process may hold at
most ``vm.max_map_count`` (65,530 by default), so a notebook running a dozen studies in a row ran
out of mappings while gigabytes of RAM were free.
"""

from __future__ import annotations

import gc
from pathlib import Path

import jax
import numpy as np

from nondet_jax import train
from nondet_jax.config import Config
from nondet_jax.errors import UsageError
from nondet_jax.machine.memory import host_available
from nondet_jax.machine.memory import human as _human
from nondet_jax.replicas import sharded as sharding
from nondet_jax.sources import abstract_keys, perturbations
from nondet_jax.train import make_train, steps_per_epoch


def _bytes(tree) -> int:
    # a.dtype.itemsize, not np.dtype's: a typed PRNG key (optax.noisy_sgd's state) is no numpy dtype
    return int(sum(np.prod(a.shape, dtype=np.int64) * a.dtype.itemsize for a in jax.tree.leaves(tree)))


# Memory a study needs on the host beyond its state: XLA compiling and running the programs, the
# report and figures. Measured by python benchmarks/memory_limits.py (peak RSS minus RSS at the check, 2-core
# AMD EPYC, jaxlib 0.10.2): 417 MB for the smallest study (mlp, 2 replicas, 1 epoch on digits), 1,071 MB for resnet8.
WORKING_BYTES = 450 * 10**6


def available_bytes() -> tuple[int | None, str]:
    """(bytes this process can still allocate where the replicas live, where that is): the first
    accelerator's free memory, or the host's (``MemAvailable`` capped by cgroup limits, see
    :func:`nondet_jax.machine.memory.host_available`); None when unknown."""
    device = jax.devices()[0]
    if device.platform != "cpu":
        stats = device.memory_stats() or {}
        if "bytes_limit" in stats:
            return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0)), f"{device.device_kind}"
    return host_available()


def estimate(config: Config, spec, n_test: int, replicas: int | None = None, fns=None) -> dict[str, int]:
    """A lower bound on the bytes a study holds at once: per replica the training state (weights,
    BatchNorm statistics, optimiser state, instruments' state), the test logits and features it
    returns, and its per-step history; once, the data set on the device.

    Args:
      config: the study's config (``study.replicas`` unless ``replicas`` is given).
      spec: the :class:`nondet_jax.train.DataSpec` of the data.
      n_test: test examples.
      fns: the study's training functions (default: the catalogue's for ``config``).
    Returns:
      {"per_replica", "data", "working", "total"} in bytes (``working``: :data:`WORKING_BYTES` on the host,
      0 on an accelerator).
    """
    fns = fns or make_train(config, spec)
    r = config.study.replicas if replicas is None else replicas
    keys = abstract_keys()
    x = jax.ShapeDtypeStruct((1, *spec.image_shape), spec.x_dtype)
    state = jax.eval_shape(fns.init, keys, perturbations(frozenset()), x)
    logits, feats = jax.eval_shape(fns.evaluate, state, jax.ShapeDtypeStruct((n_test, *spec.image_shape), spec.x_dtype))
    steps = max(1, steps_per_epoch(spec.n_train, config.train.batch_size)) * config.train.epochs
    per_replica = _bytes(state) + _bytes(logits) + _bytes(feats) + steps * 8  # loss and accuracy per step
    data = (spec.n_train + n_test) * (int(np.prod(spec.image_shape)) * 4 + 4)
    working = WORKING_BYTES if jax.devices()[0].platform == "cpu" else 0
    return {"per_replica": per_replica, "data": data, "working": working, "total": r * per_replica + data + working}


def check_fits(config: Config, spec, n_test: int, replicas: int | None = None, available: int | None = None,
               where: str | None = None, fns=None) -> dict[str, int]:
    """Refuse (UsageError naming the numbers and the largest R that fits) a study whose
    :func:`estimate` exceeds the memory available; returns the estimate otherwise.

    ``available`` (bytes) and ``where`` default to :func:`available_bytes`."""
    need = estimate(config, spec, n_test, replicas, fns)
    if available is None:
        available, where = available_bytes()
    if available is None or need["total"] <= available:
        return need
    r = config.study.replicas if replicas is None else replicas
    fits = (available - need["data"] - need["working"]) // need["per_replica"]
    fix = (f"use --replicas {fits} or fewer, or a smaller model" if fits >= 2 else
           "raise the memory limit or free memory (even 2 replicas do not fit)")
    working = f", plus {_human(need['working'])} for compiling and running" if need["working"] else ""
    raise UsageError(f"{r} replicas of {config.model.name} need at least {_human(need['total'])} ({r} x "
                     f"{_human(need['per_replica'])} of weights, optimiser state and outputs, plus "
                     f"{_human(need['data'])} of data{working}) but {where or 'this machine'} has "
                     f"{_human(available)} available; {fix}")


def check_program_fits(stats, what: str, fix: str, copies: int = 1, available: int | None = None,
                       where: str | None = None) -> None:
    """Refuse (UsageError naming the numbers) a compiled program that cannot run in the memory available:
    XLA's own account of it (``compiled.memory_analysis()``: arguments, outputs, temporaries), with
    ``copies`` of its outputs kept (one per replica run in turn)."""
    if stats is None:  # a backend without memory analysis
        return
    need = stats.argument_size_in_bytes + stats.temp_size_in_bytes + copies * stats.output_size_in_bytes
    if available is None:
        available, where = available_bytes()
    if available is not None and need > available:
        raise UsageError(f"{what} need at least {_human(need)} (XLA's memory analysis of the compiled program: "
                         f"{_human(stats.argument_size_in_bytes)} of inputs, {_human(stats.temp_size_in_bytes)} of "
                         f"temporaries, {copies} x {_human(stats.output_size_in_bytes)} of results) but "
                         f"{where or 'this machine'} has {_human(available)} available; {fix}")


def map_count() -> int:
    """The number of memory mappings this process holds (lines of ``/proc/self/maps``; 0 elsewhere)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


def release_compiled() -> None:
    """Drop the compiled programs and traced functions studies left in this process: the cache of
    training functions (:func:`nondet_jax.train.make_train`, up to 16 configurations), the sharded
    strategies' cache, and JAX's own caches. The next study compiles afresh (or reads the persistent
    compilation cache). Call it when a study is finished."""
    train._make_train.cache_clear()
    sharding.programs.cache_clear()
    jax.clear_caches()
    gc.collect()


def max_map_count() -> int | None:
    """The kernel's limit on mappings per process (``vm.max_map_count``), None where unknown."""
    try:
        return int(Path("/proc/sys/vm/max_map_count").read_text())
    except (OSError, ValueError):
        return None

