"""Provenance of everything that changes bits: versions, backend, devices, XLA flags, PRNG settings.

(The determinism flags, child-process arms and ulp comparisons of DESIGN.md §2 come later.)
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import jax


def _version(pkg: str) -> str | None:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


def git_revision() -> str | None:
    """The nondet_jax source tree's git commit (with '-dirty' when modified), if it is a checkout."""
    here = Path(__file__).resolve().parent
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5)
        if rev.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return rev.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.TimeoutExpired):
        return None


def environment() -> dict:
    """A JSON-ready record of the software and hardware a result was made with."""
    devices = jax.devices()
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "versions": {p: _version(p) for p in ("nondet_jax", "jax", "jaxlib", "flax", "optax", "chex", "numpy",
                                              "scikit-learn", "tensorflow-datasets")},
        "backend": jax.default_backend(),
        "device_count": len(devices),
        "device_kind": devices[0].device_kind,
        "devices": [str(d) for d in devices],
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "jax_env": {k: v for k, v in os.environ.items() if k.startswith(("JAX_", "XLA_", "TF_"))},
        "prng_impl": str(jax.config.jax_default_prng_impl),
        "jax_threefry_partitionable": bool(jax.config.jax_threefry_partitionable),
        "jax_enable_x64": bool(jax.config.jax_enable_x64),
        "jax_default_matmul_precision": jax.config.jax_default_matmul_precision,
        "cpu_count": os.cpu_count(),
        "git_revision": git_revision(),
    }
