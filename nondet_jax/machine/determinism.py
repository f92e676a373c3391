"""Everything that changes bits: XLA determinism flags, provenance, and ulp comparisons of pytrees.
(JAX is imported where it is used: a command sets and checks its flags before JAX starts.)

* :data:`DETERMINISM_ON` / :data:`DETERMINISM_OFF`: the XLA flags that make GPU reductions
  deterministic, or explicitly allow the nondeterministic kernels. Flags are read when the
  backend starts, so a process keeps the flags it started with: arms that need other flags run in
  a child process (:func:`with_flags` builds its ``XLA_FLAGS``). :func:`check_flags` asks a
  throw-away process whether the installed jaxlib knows them (an unknown flag aborts XLA).
* :func:`ulp_distance` and :func:`tree_ulp_diff`: how far apart two results are, in units in the
  last place, per tensor.
* :func:`environment`: the provenance record written to ``environment.json``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Callable

import numpy as np

from nondet_jax.errors import UsageError
from nondet_jax.machine import xla_flags

# Checked against the installed jaxlib by check_flags (all three are known to jaxlib 0.10.2 and 0.11.2).
# Autotuning stays on: with --xla_gpu_autotune_level=0 as well, XLA took its default convolution algorithms and
# a ResNet-14 bfloat16 epoch on an H200 ran 7x slower for 16 replicas in a loop (3,379 against 24,358
# replica-images/s) and 70x slower at batch 2048 (3,396 against 238,978), benchmarks/results/device-h200.
# Replicas in one process share one compiled program, so the control arm stays bitwise identical (every
# candidate but vmap:rhs=bgc was replica-position invariant with autotuning on); across processes JAX's
# persistent cache (on by default) keeps XLA's autotuning results beside the programs
# (jax_persistent_cache_enable_xla_caches), so a later process reuses the same kernel choices.
DETERMINISM_ON = (
    "--xla_gpu_deterministic_ops=true",  # deterministic reductions and scatters
    "--xla_gpu_exclude_nondeterministic_ops=true",  # refuse kernels that cannot be made deterministic
    "--xla_gpu_enable_scatter_determinism_expander=true",  # sort-based deterministic scatter-add
)
DETERMINISM_OFF = (
    "--xla_gpu_deterministic_ops=false",
    "--xla_gpu_exclude_nondeterministic_ops=false",
)
NONDETERMINISTIC_BACKENDS = ("gpu", "cuda", "rocm")  # where reduction order can change run to run


def with_flags(flags, base: str | None = None) -> str:
    """``XLA_FLAGS`` with ``flags`` set: same-named flags in ``base`` (default: this process's) are replaced.

    When ``flags`` turns determinism off (it holds :data:`DETERMINISM_OFF`), every other flag
    :data:`DETERMINISM_ON` sets is dropped from ``base`` as well, so the child runs with XLA's own
    defaults for them (autotuning on, XLA's scatter lowering), as a user who never asked for
    determinism would. (A parent with determinism on used to leak ``--xla_gpu_autotune_level=0``
    into the "hardware" arm.)
    """
    base = os.environ.get("XLA_FLAGS", "") if base is None else base
    names = {f.split("=")[0] for f in flags}
    if set(DETERMINISM_OFF) <= set(flags):
        names |= {f.split("=")[0] for f in DETERMINISM_ON}
    kept = [f for f in base.split() if f.split("=")[0] not in names]
    return " ".join(kept + list(flags))


CACHE_ENV = "NONDET_JAX_COMPILE_CACHE"  # the persistent compilation cache's folder (or "off"): the CLI sets it
_KNOWN: set[str] = set()  # keys of the XLA_FLAGS strings this process has checked


def _flags_key(xla_flags: str) -> str:
    """Everything whether XLA accepts ``xla_flags`` depends on: the flags themselves and the installed jax and
    jaxlib, down to the size and modification time of jaxlib's compiled libraries (a rebuilt jaxlib of the same
    version is another key)."""
    spec = importlib.util.find_spec("jaxlib")
    libs = []
    if spec is not None and spec.origin:
        for lib in sorted(Path(spec.origin).parent.glob("*.so")):
            st = lib.stat()
            libs.append([lib.name, st.st_size, st.st_mtime_ns])
    record = [xla_flags, _version("jax"), _version("jaxlib"), str(Path(spec.origin).parent) if spec else None, libs]
    return hashlib.sha256(json.dumps(record).encode()).hexdigest()


def _known_file(key: str) -> Path | None:
    folder = os.environ.get(CACHE_ENV)
    if not folder or folder.lower() == "off":
        return None
    return Path(folder) / "nondet_jax_xla_flags" / f"{key}.ok"


def check_flags(flags) -> None:
    """Raise UsageError when the installed jaxlib does not know one of ``flags`` (:func:`start_check`, waited for)."""
    start_check(flags)()


def start_check(flags) -> Callable[[], None]:
    """Start checking that the installed jaxlib knows every one of ``flags``; returns the wait, which raises
    UsageError when it does not. Between the two the caller may import (not start JAX's backend).

    XLA aborts the whole process on an unknown flag, so the check runs in a throw-away child (1.4 s in
    benchmarks/study_overheads.py, on a core of its own while the caller goes on). An accepted ``XLA_FLAGS`` string is remembered in this process
    and, when the persistent compilation cache is on, as a file beside it, keyed by the whole string and the
    installed jax/jaxlib (see :func:`_flags_key`): only acceptance is remembered, so a refusal is always asked
    afresh.
    """
    merged = with_flags(flags)
    key = _flags_key(merged)
    known = _known_file(key)
    if key in _KNOWN or (known is not None and known.is_file()):
        _KNOWN.add(key)
        return lambda: None
    env = {**os.environ, "XLA_FLAGS": merged, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen([sys.executable, "-c", "import jax; jax.devices()"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)

    def wait() -> None:
        try:
            _, stderr = proc.communicate(timeout=120)
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        if proc.returncode != 0:
            bad = [ln.split("XLA_FLAGS:")[-1].strip() for ln in stderr.splitlines() if "Unknown flag" in ln]
            what = f"XLA flag {bad[0]}" if bad else "XLA_FLAGS"
            raise UsageError(f"{what} is not known to the installed jaxlib {_version('jaxlib')}; remove it from "
                             "XLA_FLAGS, or upgrade jaxlib")
        _KNOWN.add(key)
        if known is not None:
            _remember(known, merged)

    return wait


def _remember(known: Path, merged: str) -> None:
    """Write the marker of an accepted flag string beside the compilation cache (atomically)."""
    try:
        known.parent.mkdir(parents=True, exist_ok=True)
        tmp = known.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(merged + "\n")
        os.replace(tmp, known)
    except OSError:  # a read-only cache: the check is asked again next time, nothing else changes
        pass


def _ordered(x: np.ndarray) -> np.ndarray:
    """Map floats to integers in the same order, adjacent floats to adjacent integers, ±0 to 0."""
    x = np.asarray(x)
    if x.dtype.kind != "f" and x.dtype.name != "bfloat16":
        raise TypeError(f"ulp distance needs floating-point arrays, got {x.dtype}")
    bits = x.dtype.itemsize * 8
    i = x.view(f"int{bits}").astype(np.int64)
    magnitude = np.int64(np.iinfo(f"int{bits}").max)
    return np.where(i < 0, -(i & magnitude), i)


NAN_MISMATCH = np.iinfo(np.uint64).max


def ulp_distance(a, b) -> np.ndarray:
    """Elementwise distance in units in the last place between two float arrays of one dtype.

    Adjacent representable numbers are 1 apart; +0 and -0 are 0 apart; subnormals count like
    any other step; the largest finite number and infinity are 1 apart. NaN policy: two NaNs
    (any payload) are 0 apart; a NaN against a number is ``NAN_MISMATCH`` (uint64 max).
    Returns uint64 (a float64 distance can exceed int64).
    """
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype != b.dtype or a.shape != b.shape:
        raise ValueError(f"ulp distance needs equal dtypes and shapes, got {a.dtype}{a.shape} and {b.dtype}{b.shape}")
    oa, ob = _ordered(a), _ordered(b)
    ua, ub = oa.view(np.uint64), ob.view(np.uint64)
    d = np.where(oa >= ob, ua - ub, ub - ua)  # modular uint64 difference: exact, as it is < 2**64
    na, nb = np.isnan(a), np.isnan(b)
    return np.where(na & nb, np.uint64(0), np.where(na ^ nb, np.uint64(NAN_MISMATCH), d))


def tree_ulp_diff(a, b) -> dict[str, dict]:
    """Per leaf of two pytrees of float arrays: element count, how many differ, largest ulp distance."""
    out = {}
    import jax
    from flax import traverse_util

    fa = traverse_util.flatten_dict(a) if isinstance(a, dict) else dict(enumerate(jax.tree.leaves(a)))
    fb = traverse_util.flatten_dict(b) if isinstance(b, dict) else dict(enumerate(jax.tree.leaves(b)))
    if fa.keys() != fb.keys():
        raise ValueError("the two pytrees have different structures")
    for k in fa:
        d = ulp_distance(np.asarray(fa[k]), np.asarray(fb[k]))
        name = "/".join(k) if isinstance(k, tuple) else str(k)
        out[name] = {"elements": int(d.size), "differ": int((d != 0).sum()), "max_ulp": int(d.max(initial=0))}
    return out


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


def provenance() -> dict:
    """What an arm was trained under that can change its bits, kept in the arm's own record (the run
    folder's ``environment.json`` is rewritten by each run): XLA flags, matmul precision, x64, jaxlib,
    backend and CPU type."""
    import jax

    return {"xla_flags": os.environ.get("XLA_FLAGS", ""),
            "jax_default_matmul_precision": jax.config.jax_default_matmul_precision,
            "jax_enable_x64": bool(jax.config.jax_enable_x64), "jaxlib": _version("jaxlib"),
            "backend": jax.default_backend(), "cpu_type": xla_flags.cpu_type()}


def environment() -> dict:
    """A JSON-ready record of the software and hardware a result was made with (a run folder's
    ``environment.json`` adds the model layer's choices: :func:`nondet_jax.study.provenance.environment`)."""
    import jax

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
        "xla_cpu_defaults": xla_flags.record(),  # CPU type, the measured flag rule, what the CLI added
    }
