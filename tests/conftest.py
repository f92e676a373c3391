"""Shared fixtures: small configurations and data so the suite stays fast on 2 CPU cores."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np
import pytest

from nondet_jax.config import from_flat
from nondet_jax.data import Dataset, load_dataset
from nondet_jax.sources import arm_keys, arm_sources, perturbations, replica_slice
from nondet_jax.train import DataSpec

# Compile time dominates these tiny runs; tests that train for real turn optimisation back on.
jax.config.update("jax_disable_most_optimizations", True)
# The sweeps the tests start share one compilation cache, kept out of the user's own.
os.environ.setdefault("NONDET_JAX_COMPILE_CACHE", os.path.join(tempfile.gettempdir(), "nondet_jax_test_cache"))


# The one small study the command-line tests start from; later arguments override (argparse keeps the last):
# ``[*FAST, "--replicas", "3"]``. tests/test_bad_inputs.py prints it in docs/bad_inputs.md.
FAST = ["--model", "mlp", "--epochs", "1", "--replicas", "2", "--batch-size", "256", "--no-progress"]
CLI_ENV = {**os.environ, "JAX_DISABLE_MOST_OPTIMIZATIONS": "1", "JAX_PLATFORMS": "cpu"}


def sweep_cli(*args, env=None, cwd=None, timeout=600) -> subprocess.CompletedProcess:
    """``python -m nondet_jax.sweep ARGS`` in a fresh process, output captured."""
    return subprocess.run([sys.executable, "-m", "nondet_jax.sweep", *map(str, args)], capture_output=True, text=True,
                          env=CLI_ENV if env is None else env, cwd=cwd, timeout=timeout)


@pytest.fixture(scope="session")
def finished_run_template(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """A finished ``FAST`` run folder with arms control and init, trained once per test process, and the
    command's output: tests read it as it is or copy it (:func:`finished_run`) before they change it."""
    out = tmp_path_factory.mktemp("finished") / "run"
    proc = sweep_cli(*FAST, "--arms", "control,init", "--out", out)
    assert proc.returncode == 0, proc.stderr
    return out, proc


@pytest.fixture
def finished_run(finished_run_template, tmp_path) -> Path:
    """A copy of the finished run folder of :func:`finished_run_template`, the test's own to change."""
    run = tmp_path / "run"
    shutil.copytree(finished_run_template[0], run)
    return run


@pytest.fixture(scope="session")
def digits() -> Dataset:
    return load_dataset("digits")


@pytest.fixture(scope="session")
def small_digits(digits) -> Dataset:
    """256 training and 100 test digits: enough for a few real steps."""
    return digits._replace(x_train=digits.x_train[:256], y_train=digits.y_train[:256], x_test=digits.x_test[:100],
                           y_test=digits.y_test[:100])


def spec_of(data: Dataset) -> DataSpec:
    return DataSpec(len(data.x_train), tuple(data.x_train.shape[1:]), data.num_classes, data.name)


def tiny_config(**flat):
    """An MLP (or any model given as model.name) trained for 2 short epochs."""
    base = {"model.name": "mlp", "train.epochs": 2, "train.batch_size": 64, "optim.lr": 0.05,
            "study.replicas": 3}
    base.update(flat)
    return from_flat(base)


def one_replica(arm: str | frozenset = "control", replica: int = 0, seed: int = 0):
    """``(keys, perturbations)`` of replica ``replica`` of ``arm`` (an arm name, or the set of sources it varies):
    what a strategy hands one replica, for tests that drive ``make_train``'s functions by hand."""
    varied = arm_sources(arm) if isinstance(arm, str) else frozenset(arm)
    return replica_slice(arm_keys(seed, varied, replica + 1), replica), perturbations(varied)


def tree_equal(a, b) -> bool:
    import jax

    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb))


def compare_refused(capsys, *args) -> str:
    """``python -m nondet_jax compare ARGS``'s one-line refusal (exit 2), run in this process; a read that blocks (a
    FIFO in a run folder) fails the test after 60 s instead of hanging the suite."""
    import signal

    from nondet_jax.cli.compare import main

    def hung(*_):
        raise TimeoutError("compare hung")

    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(60)
    try:
        status = main([str(a) for a in args])
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    err = capsys.readouterr().err.strip()
    assert status == 2 and "\n" not in err and "Traceback" not in err, err
    return err

