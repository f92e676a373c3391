"""A normal (non-editable) install runs the default command's smallest form from another directory:
the presets ship inside the wheel as package data."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_wheel_install_runs_the_default_study_from_another_directory(tmp_path):
    wheels = tmp_path / "wheels"
    # Build isolation, as a user's pip does: the project's build requirement (setuptools>=77) comes from the
    # package index, not from whatever setuptools this virtual environment happens to have (a fresh venv on
    # Python 3.11 has 65.5, too old for the license field).
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), str(ROOT)],
                           capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr[-3000:]
    wheel = next(wheels.glob("nondet_jax-*.whl"))
    venv = tmp_path / "venv"
    # Reuse the installed dependencies (no network): a fresh venv that sees this interpreter's site-packages.
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    # This interpreter may itself be a virtual environment: its site-packages (where the dependencies
    # are) join the fresh one's path through a .pth file, without running its own .pth files (so an
    # editable install of the checkout there stays out of sight).
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    import site

    deps = [p for p in site.getsitepackages() if Path(p).is_dir()]
    Path(purelib, "_nondet_jax_test_deps.pth").write_text("\n".join(deps) + "\n")
    # Without PYTHONPATH: a checkout on it (with the egg-info the wheel build writes there) would make pip
    # think the package is installed already and skip the wheel.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(wheel)], check=True,
                   capture_output=True, timeout=600, env=env)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = subprocess.run([str(python), "-c", "import nondet_jax; print(nondet_jax.__file__)"], capture_output=True,
                           text=True, env=env, cwd=elsewhere, check=True).stdout
    assert str(venv) in where, where  # the wheel's copy, not the editable checkout
    proc = subprocess.run([str(python), "-m", "nondet_jax.sweep", "--arms", "control,init", "--replicas", "2",
                           "--epochs", "1", "--no-progress"], capture_output=True, text=True, env=env, cwd=elsewhere,
                          timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert list(elsewhere.glob("runs/*/report.md"))
