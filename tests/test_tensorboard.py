"""TensorBoard export: one run per replica, values equal to the stored results."""

import os
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("tensorboardX")
from tensorboardX.proto import event_pb2  # noqa: E402

ENV = {**os.environ, "JAX_DISABLE_MOST_OPTIMIZATIONS": "1", "JAX_PLATFORMS": "cpu"}


def read_scalars(folder) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] from the event files in ``folder`` (TFRecord framing, no TensorFlow)."""
    out: dict[str, list] = {}
    for path in sorted(folder.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        pos = 0
        while pos < len(data):
            (n,) = struct.unpack("<Q", data[pos:pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + n])
            pos += 12 + n + 4
            for v in event.summary.value:
                out.setdefault(v.tag, []).append((event.step, v.simple_value))
    return out


def test_sweep_logs_and_report_exports_one_run_per_replica(tmp_path):
    out = tmp_path / "run"
    args = ["--model", "mlp", "--epochs", "2", "--replicas", "2", "--batch-size", "128", "--no-progress",
            "--arms", "control,init", "--instruments", "Loss,GradNorm", "--out", str(out), "--log", "tensorboard"]
    proc = subprocess.run([sys.executable, "-m", "nondet_jax.sweep", *args], capture_output=True, text=True, env=ENV)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("TensorBoard event files in") == 2  # as each arm finishes
    logged = read_scalars(out / "tensorboard" / "init" / "replica1")
    shutil.rmtree(out / "tensorboard")
    proc = subprocess.run([sys.executable, "-m", "nondet_jax.report", str(out), "--tensorboard"],
                          capture_output=True, text=True, env=ENV)
    assert proc.returncode == 0, proc.stderr
    hist = np.load(out / "history" / "init.npz")
    for r in range(2):
        tags = read_scalars(out / "tensorboard" / "init" / f"replica{r}")
        assert [s for s, _ in tags["train/loss"]] == [1, 2]
        np.testing.assert_allclose([v for _, v in tags["train/loss"]], hist["train_loss"][r], rtol=1e-6)
        assert len(tags["train/step_loss"]) == hist["step_loss"][r].size
        assert "instruments/GradNorm" in tags and "test/accuracy" in tags
    # replicas of init differ, control's are identical
    a, b = (read_scalars(out / "tensorboard" / "init" / f"replica{r}")["train/loss"] for r in range(2))
    assert a != b
    a, b = (read_scalars(out / "tensorboard" / "control" / f"replica{r}")["train/loss"] for r in range(2))
    assert a == b
    assert read_scalars(out / "tensorboard" / "init" / "replica1") == logged  # the sweep's log, rebuilt


def test_log_tensorboard_without_tensorboardx_is_refused_before_training(tmp_path):
    fake = tmp_path / "site" / "tensorboardX"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('no tensorboardX here')\n")
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "nondet_jax.sweep", "--model", "mlp", "--epochs", "1", "--replicas",
                           "2", "--arms", "control", "--out", str(out), "--log", "tensorboard", "--no-progress"],
                          capture_output=True, text=True, env={**ENV, "PYTHONPATH": str(tmp_path / "site")})
    assert proc.returncode == 2, proc.stderr
    assert "nondet_jax[tensorboard]" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not out.exists()
