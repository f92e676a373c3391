"""The bitwise audit: zero differences for a repeated run on CPU, nonzero under batch_order."""

import json
import os
import subprocess
import sys

import pytest
from conftest import tiny_config
from test_api import NET_MODULE
from test_sweep import ENV

from nondet_jax.cli.audit import failed
from nondet_jax.errors import UsageError
from nondet_jax.machine.determinism import DETERMINISM_ON
from nondet_jax.study.audit import audit_run


def test_repeated_steps_are_bitwise_identical_on_cpu():
    run = audit_run(tiny_config(**{"model.name": "resnet8", "model.width": 0.5}), steps=2)
    assert run["declared_deterministic"] and run["bitwise_identical"] and run["differ"] == 0
    assert not failed(run)
    assert "params/stem_conv/kernel" in run["tensors"] and "batch_stats/stem_bn/mean" in run["tensors"]


def test_batch_order_perturbation_is_detected():
    run = audit_run(tiny_config(**{"model.name": "resnet8", "model.width": 0.5}), steps=2, perturb="batch_order")
    assert run["differ"] > 0 and run["max_ulp"] > 0
    assert not failed(run)  # a perturbed run is meant to differ
    # and is said to (it printed 'declared deterministic: True' beside the differences; outside review)
    from nondet_jax.cli.audit import format_run

    last = format_run("perturbed", run).splitlines()[-1]
    assert "as expected: the second run was perturbed (batch_order)" in last and "declared" not in last


def test_a_declared_deterministic_run_that_differs_fails():
    assert failed({"declared_deterministic": True, "perturb": None, "bitwise_identical": False})
    assert not failed({"declared_deterministic": False, "perturb": None, "bitwise_identical": False})


def test_too_many_steps_is_a_usage_error():
    with pytest.raises(UsageError, match="training examples"):
        audit_run(tiny_config(), steps=100)


def test_cli_runs_both_flag_settings_on_your_own_model(tmp_path):
    """--model PACKAGE.MODULE:ATTR in the audit too (it was a KeyError traceback), in both processes."""
    out = tmp_path / "audit.json"
    (tmp_path / "mynets.py").write_text(NET_MODULE)
    env = {**ENV, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ENV.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, "-m", "nondet_jax", "audit", "--steps", "2", "--model", "mynets:Net",
                           "--json", str(out)], capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "params/Dense_1/kernel" in proc.stdout  # the user's layers, not a catalogue model's
    runs = json.loads(out.read_text())["runs"]
    assert len(runs) == 2
    child = runs["determinism flags on (child process)"]
    assert all(f in child["xla_flags"].split() for f in DETERMINISM_ON)
    assert all(r["bitwise_identical"] for r in runs.values())
    assert "bitwise identical" in proc.stdout


def test_cli_bad_input_exits_2():
    proc = subprocess.run([sys.executable, "-m", "nondet_jax", "audit", "--steps", "0"], capture_output=True, text=True,
                          env=ENV, timeout=300)
    assert proc.returncode == 2 and "--steps must be >= 1" in proc.stderr
