"""The hardware arm with one fresh process per replica (nondet_jax.study.hardware): on CPU the replicas
really come from distinct processes, without compilation caches, and are still bitwise identical."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from nondet_jax import config as cfg
from nondet_jax.machine.determinism import DETERMINISM_OFF
from nondet_jax.store.run import RunStore
from nondet_jax.study.hardware import train_arm_per_process
from nondet_jax.study.prepare import model_record, prepare

# The sweep's run and the in-process one below under the same XLA flags: NONDET_JAX_CPU_DEFAULTS=0 (the CLI would
# add its CPU type's rule, which changes the kernels) and XLA_FLAGS as this module found them (set again below for
# the processes the in-process half starts, whatever another test's in-process sweep left there)
ENV = {**os.environ, "JAX_DISABLE_MOST_OPTIMIZATIONS": "1", "JAX_PLATFORMS": "cpu", "NONDET_JAX_CPU_DEFAULTS": "0",
       "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")}


@pytest.mark.slow
def test_one_process_per_replica_on_cpu(tmp_path, monkeypatch):
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "nondet_jax.sweep", "--model", "mlp", "--epochs", "1", "--replicas",
                           "2", "--batch-size", "128", "--no-progress", "--arms", "control,hardware", "--set",
                           "study.hardware_processes=arm", "--out", str(out)],
                          capture_output=True, text=True, env=ENV, timeout=600)
    assert proc.returncode == 0, proc.stderr
    one_child = np.load(out / "logits" / "hardware.npy")  # the whole arm in one child process
    for key, value in ENV.items():
        monkeypatch.setenv(key, value)
    config = cfg.from_dict(json.loads((out / "config.json").read_text()))
    data, fns = prepare(config)
    identity = model_record(config, data, fns)["identity_sha256"]  # as the sweep opens it: parts carry it
    with RunStore(out, config, recompute=("hardware",), identity=identity) as store:
        store.remove_arm("hardware")
        record = train_arm_per_process(config, data, fns, store, "hardware", DETERMINISM_OFF, log=lambda *a: None)
    info = json.loads((out / "environments" / "hardware.processes.json").read_text())
    pids = [p["pid"] for p in info["processes"]]
    assert len(set(pids)) == 2 and info["parent_pid"] not in pids  # distinct fresh processes
    assert [p["replica"] for p in info["processes"]] == [0, 1]
    for p in info["processes"]:
        assert p["compilation_cache"] is False and "--xla_gpu_deterministic_ops=false" in p["xla_flags"]
    assert record["replicas_bitwise_identical"] and record["strategy_reason"] == "one fresh process per replica"
    logits = np.load(out / "logits" / "hardware.npy")
    np.testing.assert_array_equal(logits, one_child)  # CPU: same bits as one process for the arm
    np.testing.assert_array_equal(logits[0], np.load(out / "logits" / "control.npy")[0])
    assert not (out / "parts").exists()


@pytest.mark.slow
def test_the_sweep_runs_hardware_one_process_per_replica_by_default(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "nondet_jax.sweep", "--model", "mlp", "--epochs", "1", "--replicas", "2",
                           "--batch-size", "128", "--no-progress", "--arms", "control,hardware", "--out", str(out)],
                          capture_output=True, text=True, env=ENV, timeout=600)
    assert proc.returncode == 0, proc.stderr
    info = json.loads((out / "environments" / "hardware.processes.json").read_text())
    assert len({p["pid"] for p in info["processes"]}) == 2
    assert json.loads((out / "arms" / "hardware.json").read_text())["replicas_bitwise_identical"]


def test_every_child_process_starts_one_way_and_refuses_to_be_started_by_hand():
    """study/processes: the arm, replica and audit children get their flags, marker and parent the same way;
    a failed child is one error naming what it did; an internal entry started by hand refuses in one line."""
    from nondet_jax.machine.signals import PARENT_ENV
    from nondet_jax.study import processes

    env = processes.child_env(DETERMINISM_OFF, processes.REPLICA_CHILD, caches=False)
    assert env[processes.REPLICA_CHILD] == "1" and env[PARENT_ENV] == str(os.getpid())
    assert env["NONDET_JAX_COMPILE_CACHE"] == "off" and "--xla_gpu_deterministic_ops=false" in env["XLA_FLAGS"]
    arm_env = processes.child_env(DETERMINISM_OFF, processes.ARM_CHILD)  # the caches stay unless asked otherwise
    assert arm_env.get("NONDET_JAX_COMPILE_CACHE") == os.environ.get("NONDET_JAX_COMPILE_CACHE")
    with pytest.raises(RuntimeError, match=r"^the test child failed with exit status 1; IndexError"):
        processes.run_child("nondet_jax.study.hardware", [], DETERMINISM_OFF, processes.REPLICA_CHILD, "the test child",
                            capture=True)  # started properly, but without its arguments
    clean = {k: v for k, v in ENV.items() if k not in (processes.REPLICA_CHILD, processes.AUDIT_CHILD)}
    for argv, said in ((["nondet_jax.study.hardware", "run", "control", "0"], "is internal: the sweep starts"),
                       (["nondet_jax", "audit", "--child-json"], "--child-json is internal")):
        proc = subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True, env=clean, timeout=300)
        assert proc.returncode == 2 and said in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
