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
from nondet_jax.replicas import sharded as sharding
from nondet_jax.sources import arm_keys, perturbations, replica_slice
from nondet_jax.train import make_train, steps_per_epoch


def _bytes(tree) -> int:

    return int(sum(np.prod(a.shape, dtype=np.int64) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree)))


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if n < 1000 or unit == "PB":
            return f"{n:.3g} {unit}"
        n /= 1000
    return f"{n:.3g} PB"  # pragma: no cover


def available_bytes() -> tuple[int | None, str]:
    """(bytes this process can still allocate where the replicas live, where that is): the first
    accelerator's free memory, or the host's ``MemAvailable``; None when unknown."""
    device = jax.devices()[0]
    if device.platform != "cpu":
        stats = device.memory_stats() or {}
        if "bytes_limit" in stats:
            return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0)), f"{device.device_kind}"
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024, "host memory"
    except (OSError, ValueError, IndexError):
        pass
    return None, "memory"


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
      {"per_replica", "data", "total"} in bytes.
    """
    fns = fns or make_train(config, spec)
    r = config.study.replicas if replicas is None else replicas
    keys = replica_slice(arm_keys(0, frozenset(), 1), 0)
    x = jax.ShapeDtypeStruct((1, *spec.image_shape), spec.x_dtype)
    state = jax.eval_shape(fns.init, keys, perturbations(frozenset()), x)
    logits, feats = jax.eval_shape(fns.evaluate, state, jax.ShapeDtypeStruct((n_test, *spec.image_shape), spec.x_dtype))
    steps = max(1, steps_per_epoch(spec.n_train, config.train.batch_size)) * config.train.epochs
    per_replica = _bytes(state) + _bytes(logits) + _bytes(feats) + steps * 8  # loss and accuracy per step
    data = (spec.n_train + n_test) * (int(np.prod(spec.image_shape)) * 4 + 4)
    return {"per_replica": per_replica, "data": data, "total": r * per_replica + data}


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
    fits = max(0, (available - need["data"]) // need["per_replica"])
    raise UsageError(f"{r} replicas of {config.model.name} need at least {_human(need['total'])} ({r} x "
                     f"{_human(need['per_replica'])} of weights, optimiser state and outputs, plus "
                     f"{_human(need['data'])} of data) but {where or 'this machine'} has {_human(available)} "
                     f"available; use --replicas {fits} or fewer, or a smaller model")


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

