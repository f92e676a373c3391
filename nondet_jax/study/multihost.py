"""Several processes (hosts) on one study, with JAX's own distributed runtime.

``python -m nondet_jax.sweep --coordinator HOST:PORT --num-processes N --process-id I`` on each host
(or ``--distributed auto`` where JAX detects the cluster: Slurm, Open MPI, Cloud TPU) calls
:func:`jax.distributed.initialize`. Every process then trains a contiguous block of each arm's
replicas (:func:`replica_block`) from the same per-replica keys as a single process would, and
writes only its own part (``parts/<arm>/<process>.npz``, atomically; checkpoints under
``checkpoints/<arm>/replicas<a>-<b>/``). After a barrier, process 0 merges the parts, computes the
arm's metrics and writes the arm's files and, at the end, the summary and report; the others wait
at a second barrier. The run folder must be on a file system every process sees.

Replica r's training does not depend on which process runs it (its keys are ``fold_in`` of its
index), so the stored results equal a single-process run's with the same strategy. One thing is
lost: the per-epoch pairwise weight distances need all replicas' states at every epoch, so a
multi-process run records them at initialisation and at the end only (NaN in between).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import NamedTuple

import jax
import numpy as np
from flax import traverse_util
from jax.experimental import multihost_utils

from nondet_jax.errors import UsageError
from nondet_jax.replicas.loop import ArmResult, _distances
from nondet_jax.train import Health, TrainState

SEP = "::"  # key separator in part files ('/' occurs inside instrument names)


class Processes(NamedTuple):
    index: int
    count: int

    @property
    def leader(self) -> bool:
        return self.index == 0


def initialize(coordinator: str | None, num_processes: int | None, process_id: int | None,
               auto: bool = False) -> Processes:
    """Join the distributed runtime when asked to; returns this process's place in it."""
    given = [v is not None for v in (coordinator, num_processes, process_id)]
    if not auto and not any(given):
        return Processes(0, 1)
    if not auto and not all(given):
        raise UsageError("multi-process runs need --coordinator HOST:PORT, --num-processes N and --process-id I "
                         "together (or --distributed auto where JAX detects the cluster)")
    if not auto and num_processes < 1:  # it used to blame --process-id
        raise UsageError(f"--num-processes must be >= 1, got {num_processes}; use e.g. --num-processes 2")
    if not auto and not 0 <= process_id < num_processes:
        raise UsageError(f"--process-id must be in [0, {num_processes}), got {process_id}")
    if not auto:
        host, _, port = coordinator.rpartition(":")
        if not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
            raise UsageError(f"--coordinator must be HOST:PORT with a port in 1..65535, got '{coordinator}'; "
                             "e.g. --coordinator node0:12345")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # barriers between CPU processes
    if auto:
        jax.distributed.initialize()
    else:
        jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id)
    return Processes(jax.process_index(), jax.process_count())


def barrier(name: str) -> None:

    multihost_utils.sync_global_devices(name)


def agree(ok: bool) -> bool:
    """Process 0's ``ok`` on every process (e.g. whether it could open the run folder)."""
    from jax.experimental import multihost_utils

    return bool(multihost_utils.broadcast_one_to_all(np.int32(ok)))


def replica_block(replicas: int, index: int, count: int) -> range:
    """The contiguous replicas process ``index`` of ``count`` trains: as even as possible."""
    base, extra = divmod(replicas, count)
    start = index * base + min(index, extra)
    return range(start, start + base + (index < extra))


def _flat(prefix: str, tree) -> dict[str, np.ndarray]:
    if tree is None:
        return {}
    if isinstance(tree, dict):
        return {SEP.join((prefix,) + k): np.asarray(v) for k, v in traverse_util.flatten_dict(tree).items()}
    return {prefix: np.asarray(tree)}


def part_bytes(result) -> bytes:
    """The parts of an ArmResult process 0 needs, as npz bytes (no pickles)."""
    arrays = {**_flat("params", result.state.params), **_flat("batch_stats", result.state.batch_stats),
              "diverged_at": np.asarray(result.state.health.diverged_at),
              "last_loss": np.asarray(result.state.health.last_loss),
              "train_loss": result.train_loss, "train_accuracy": result.train_accuracy, "logits": result.logits,
              "features": result.features, "snapshots": result.snapshots, **_flat("steps", result.steps),
              "seconds": np.float64(result.seconds), "strategy": np.array(result.strategy)}
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def _tree(arrays: dict[str, np.ndarray], prefix: str):
    sub = {tuple(k.split(SEP)[1:]): v for k, v in arrays.items() if k.split(SEP)[0] == prefix}
    return traverse_util.unflatten_dict(sub) if sub else {}


def merge_parts(paths: list[Path], init_params) -> "object":
    """One ArmResult from the processes' parts (in process order). ``init_params``: every
    replica's initial parameters, stacked, for the weight distance at initialisation."""
    parts = []
    for path in paths:
        with np.load(path, allow_pickle=False) as f:
            parts.append({k: f[k] for k in f.files})
    cat = {k: np.concatenate([p[k] for p in parts]) for k in parts[0] if k not in ("seconds", "strategy")}
    state = TrainState(_tree(cat, "params"), _tree(cat, "batch_stats"), None,
                       Health(cat["diverged_at"], cat["last_loss"]))
    epochs = cat["train_loss"].shape[1]
    first, last = _distances(init_params), _distances(state.params)
    distances = np.full((epochs + 1, len(first)), np.nan)
    distances[0], distances[-1] = first, last
    return ArmResult(state, cat["train_loss"], cat["train_accuracy"], cat["logits"], cat["features"], distances,
                     str(parts[0]["strategy"]), max(float(p["seconds"]) for p in parts), _tree(cat, "steps"),
                     cat["snapshots"])
