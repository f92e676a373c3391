"""An arm trained in a child process under other XLA flags (the ``hardware`` arm's parent)."""

from __future__ import annotations

from pathlib import Path

from nondet_jax.sources import Arm, parse_arm
from nondet_jax.store.paths import RunPaths
from nondet_jax.store.run import RunStore
from nondet_jax.study.arm import train_arm
from nondet_jax.study.prepare import prepare_child
from nondet_jax.study.processes import ARM_CHILD, require_child, run_child
from nondet_jax.study.progress import Progress
from nondet_jax.study.provenance import environment, fallback_said


def run_in_child(out: Path, arm: Arm, flags) -> None:
    """Train ``arm`` in a fresh process whose XLA_FLAGS carry ``flags`` (read at backend start);
    it writes into the same run folder, under the lock this process holds (:mod:`.processes`)."""
    run_child("nondet_jax.sweep", ["--out", str(out), "--child-arm", arm.name], flags, ARM_CHILD,
              f"the child process training arm '{arm.name}'", after="its output is above; finished arms are kept")


def train_arm_child(out: str, arm_name: str, progress: bool) -> int:
    """Entry of an arm's child process: train one arm of the run folder's config under this process's flags."""
    require_child(ARM_CHILD, "--child-arm is internal: the sweep starts such processes itself")
    arm = parse_arm(arm_name)
    config, data, fns, identity = prepare_child(out)
    with RunStore(out, config, locked_by_parent=True, identity=identity) as store:
        env = environment()
        env["arm"] = arm.name
        store.write_json(RunPaths.rel("environments", arm.name), env)
        with Progress(progress, None if progress else print) as bar, fallback_said():  # the parent said it
            train_arm(config, data, fns, store, arm, bar.arm(arm.name, config.study.replicas * config.train.epochs))
    return 0
