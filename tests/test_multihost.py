"""Two processes on localhost (CPU, jax.distributed) share one study: a complete, consistent folder
whose results equal a single-process run's bitwise."""

import csv
import json
import os
import socket
import subprocess
import sys

import pytest

from nondet_jax.store.run import verify_arm_files
from nondet_jax.study.multihost import replica_block

ENV = {**os.environ, "JAX_DISABLE_MOST_OPTIMIZATIONS": "1", "JAX_PLATFORMS": "cpu"}
STUDY = ["--model", "mlp", "--epochs", "2", "--replicas", "3", "--batch-size", "256", "--arms", "control,init",
         "--set", "train.checkpoint_seconds=0", "--no-progress"]  # every process checkpoints every epoch


def test_replica_blocks_cover_every_replica_once():
    for r in range(1, 12):
        for n in range(1, r + 1):
            blocks = [replica_block(r, i, n) for i in range(n)]
            assert [x for b in blocks for x in b] == list(range(r))
            assert max(map(len, blocks)) - min(map(len, blocks)) <= 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_write_a_complete_folder_equal_to_one_process(tmp_path):
    multi, single = tmp_path / "multi", tmp_path / "single"
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "nondet_jax.sweep", *STUDY, "--out", str(multi),
                               "--coordinator", f"localhost:{port}", "--num-processes", "2", "--process-id", str(i)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV) for i in (0, 1)]
    outputs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs[0][1][-2000:] + outputs[1][1][-2000:]
    assert "over 2 processes" in outputs[0][0] and "report:" in outputs[0][0]
    assert "report:" not in outputs[1][0]  # only process 0 reports
    one = subprocess.run([sys.executable, "-m", "nondet_jax.sweep", *STUDY, "--out", str(single)],
                         capture_output=True, text=True, env=ENV, timeout=600)
    assert one.returncode == 0, one.stderr
    for arm in ("control", "init"):
        record = json.loads((multi / "arms" / f"{arm}.json").read_text())
        verify_arm_files(multi, arm, record)  # every file the record lists is there, intact
        for name in (f"logits/{arm}.npy", f"features/{arm}.npy", f"weights/{arm}.npz", f"pairs/{arm}.npz"):
            assert (multi / name).read_bytes() == (single / name).read_bytes(), name
        assert record["metrics"] == json.loads((single / "arms" / f"{arm}.json").read_text())["metrics"]
    rows = [r for r in csv.DictReader((multi / "replicas.csv").open()) if r["metric"] == "test_accuracy"]
    assert [(r["arm"], r["replica"]) for r in rows] == [(a, str(i)) for a in ("control", "init") for i in range(3)]
    assert json.loads((multi / "environment.json").read_text())["processes"] == 2
    for name in ("summary.json", "report.md", "arms.csv"):
        assert (multi / name).is_file()
    assert not (multi / "parts").exists() and not any((multi / "checkpoints").iterdir())
