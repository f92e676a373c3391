"""Several processes (hosts) on one study, with JAX's own distributed runtime.

``python -m nondet_jax.sweep --coordinator HOST:PORT --num-processes N --process-id I`` on each host
(or ``--distributed auto`` where JAX detects the cluster: Slurm, Open MPI, Cloud TPU) calls
:func:`jax.distributed.initialize`. Every process then trains a contiguous block of each arm's
replicas (:func:`replica_block`) from the same per-replica keys as a single process would, and
writes only its own part (``parts/<arm>/<first replica>.npz``, atomically, :mod:`nondet_jax.study.parts`; checkpoints under
``checkpoints/<arm>/replicas<a>-<b>/``). After a barrier, process 0 merges the parts, computes the
arm's metrics and writes the arm's files and, at the end, the summary and report; the others wait
at a second barrier. The run folder must be on a file system every process sees.

Replica r's training does not depend on which process runs it (its keys are ``fold_in`` of its
index), so the stored results equal a single-process run's with the same strategy. One thing is
lost: the per-epoch pairwise weight distances need all replicas' states at every epoch, so a
multi-process run records them at initialisation and at the end only (NaN in between).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import numpy as np
from jax.experimental import multihost_utils

from nondet_jax.errors import UsageError


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
    """Wait until every process reaches the barrier ``name``."""
    multihost_utils.sync_global_devices(name)


def agree(ok: bool) -> bool:
    """Process 0's ``ok`` on every process (e.g. whether it could open the run folder)."""
    return bool(multihost_utils.broadcast_one_to_all(np.int32(ok)))


def replica_block(replicas: int, index: int, count: int) -> range:
    """The contiguous replicas process ``index`` of ``count`` trains: as even as possible."""
    base, extra = divmod(replicas, count)
    start = index * base + min(index, extra)
    return range(start, start + base + (index < extra))
