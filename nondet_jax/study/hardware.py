"""The ``hardware`` arm as Morin & Willetts ran it: every replica in a fresh process of its own.

Their fixed-seed runs were separate processes, and GPU nondeterminism between runs comes largely
from each process's own kernel choices (autotuning) and atomics. Training the whole arm in one
child process makes its replicas share one compiled program and one autotuning result (and the
persistent compilation cache would hand the same executable to later processes too). Here replica
r trains alone in process r: XLA's determinism flags off, JAX's persistent compilation cache off
(which also turns off XLA's per-fusion autotuning cache it carries), so each process compiles and
autotunes afresh. The processes are recorded in ``environments/<arm>.processes.json``.

:func:`train_arm_per_process` is called by the sweep in place of training the arm in one child
process; ``python -m nondet_jax.study.hardware RUN_DIR ARM REPLICA`` is the (internal) child entry.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

import jax
import numpy as np

from nondet_jax.errors import UsageError
from nondet_jax.replicas.rule import resolve_study
from nondet_jax.sources import parse_arm
from nondet_jax.store.io import atomic_write_json, guarded
from nondet_jax.store.paths import RunPaths
from nondet_jax.store.run import RunStore
from nondet_jax.study.arm import arm_setup, finish_arm, fit_arm
from nondet_jax.study.parts import block_meta, check_blocks, merge_blocks, write_part
from nondet_jax.study.prepare import prepare_child
from nondet_jax.study.processes import REPLICA_CHILD, child_env, require_child, run_child
from nondet_jax.study.provenance import environment


def train_arm_per_process(config, data, fns, store, arm, flags, log=print) -> dict:
    """Train each replica of ``arm`` in its own fresh process under ``flags``, merge, compute the
    arm's metrics here and store it (as the sweep does for any arm); returns its record.

    A replica whose part is already in ``parts/<arm>/`` (an interrupted run) is not trained again.
    Metrics and the divergence trace (when ``study.dynamics_every`` asks for one) run in this process,
    under its own flags: only the training of the replicas is per process.
    """
    arm = parse_arm(arm) if isinstance(arm, str) else arm
    study = config.study
    paths = RunPaths(store.root)
    xla_flags = child_env(flags, REPLICA_CHILD)["XLA_FLAGS"]
    check_blocks(store, study.seed, arm, [range(r, r + 1) for r in range(study.replicas)
                                          if paths.part(arm.name, r, ".json").exists()], xla_flags)
    for r in range(study.replicas):
        if paths.part(arm.name, r, ".json").exists():
            log(f"arm {arm.name}: replica {r} already trained in its own process, reusing it")
            continue
        log(f"arm {arm.name}: replica {r} in a fresh process (XLA_FLAGS {xla_flags}; compilation cache off)")
        run_child("nondet_jax.study.hardware", [str(store.root), arm.name, str(r)], flags, REPLICA_CHILD,
                  f"the process training replica {r} of arm '{arm.name}'", caches=False,
                  after="its output is above; finished replicas are kept")
    processes = [json.loads(paths.part(arm.name, r, ".json").read_text()) for r in range(study.replicas)]
    merged = merge_blocks(config, data, arm_setup(config, fns, arm)[1], store, arm,
                          [range(r, r + 1) for r in range(study.replicas)],
                          resolve_study(study)[0], flags=xla_flags)
    store.write_json(RunPaths.rel("environments", arm.name, ".processes.json"),
                     {"mode": "one process per replica", "parent_pid": os.getpid(), "processes": processes})
    record = finish_arm(config, data, fns, store, arm, merged, "one fresh process per replica", log)
    guarded("rmtree", store.root, paths.parts(arm.name))
    if store.paths.parts().is_dir() and not any(store.paths.parts().iterdir()):
        guarded("rmdir", store.root, store.paths.parts())
    return record


def train_replica_child(out: str, arm: str, replica: int) -> int:
    """Entry of a replica's process: train replica ``replica`` of ``arm`` alone and write its part."""
    require_child(REPLICA_CHILD, "python -m nondet_jax.study.hardware is internal: the sweep starts these processes "
                  "itself")
    jax.config.update("jax_enable_compilation_cache", False)
    config, data, fns, identity = prepare_child(out)
    with RunStore(out, config, locked_by_parent=True, identity=identity) as store:
        result, _ = fit_arm(config, data, fns, store, parse_arm(arm), lambda n: None, lambda *a, **k: None,
                            block=range(replica, replica + 1))
        write_part(store, parse_arm(arm), result,
                   block_meta(config.study.seed, parse_arm(arm), range(replica, replica + 1), identity))
        env = environment()
        atomic_write_json(store.paths.part(arm, replica, ".json"), {
            "replica": replica, "pid": os.getpid(), "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "compilation_cache": bool(jax.config.jax_enable_compilation_cache),
            "backend": env.get("backend"), "device_kind": env.get("device_kind"),
            "test_logits_sha256": hashlib.sha256(np.ascontiguousarray(result.logits).tobytes()).hexdigest()},
            root=store.root)
    return 0


if __name__ == "__main__":
    from nondet_jax.machine import signals

    signals.install(None)  # Ctrl-C reaches the whole process group: the sweep prints the one line
    try:
        sys.exit(train_replica_child(sys.argv[1], sys.argv[2], int(sys.argv[3])))
    except UsageError as e:
        print(f"python -m nondet_jax.study.hardware: error: {e}", file=sys.stderr)
        sys.exit(2)
