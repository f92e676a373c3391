"""XLA:CPU flags the CLI sets before JAX starts, per CPU type and strategy, from a measured table.

jaxlib 0.10.2 sends a convolution's weight gradient to YNNPACK by default. Whether turning that
off (``--xla_cpu_experimental_ynn_fusion_type=-individual_convolution``) is faster depends on the CPU, and
so does whether XLA:CPU's older loop emitters (``--xla_cpu_use_fusion_emitters=false``: faster to compile)
run as fast: the table in ``measured.json`` (section ``xla_cpu``) holds, per :func:`cpu_type`, the flags
measured faster and bitwise repeatable there, with the command and numbers they rest on, and the strategies
they hold for (a flag that keeps a loop of single-replica programs repeatable can break the bitwise equality
of replicas batched by ``vmap``, or of ``unrolled`` with ``sequential``). :func:`apply_cpu_defaults`
adds them to ``XLA_FLAGS`` unless the user already set the same flag (any value, including
empty) or set ``NONDET_JAX_CPU_DEFAULTS=0``; flags are read when the backend starts, so it must run
before JAX initialises its backends (child processes inherit the variable; once the backend started it adds
nothing). :func:`record` is what ``environment.json`` stores.
"""

from __future__ import annotations

import os
import platform
import sys
import warnings

from nondet_jax.machine import measured

OPT_OUT = "NONDET_JAX_CPU_DEFAULTS"  # "0": never add flags
APPLIED = "NONDET_JAX_CPU_FLAGS_ADDED"  # what apply_cpu_defaults added, for the record and child processes


def _cpuinfo() -> dict[str, str]:
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return {}
    info = {}
    for line in text.splitlines():
        if not line.strip():
            break  # the first processor describes them all
        k, _, v = line.partition(":")
        info[k.strip()] = v.strip()
    return info


VENDORS = {"GenuineIntel": "intel", "AuthenticAMD": "amd"}


def cpu_type() -> str:
    """The CPU family the table is keyed by: ``x86_64-avx512-intel``, ``x86_64-avx512-amd`` (AVX-512 CPUs of
    the two vendors are measured apart: turning YNNPACK's convolutions off was 1.4-2.1x faster on an Intel Xeon
    and 1.35x on an AMD EPYC Zen 4, whose first measurement under load had been undecided, docs/performance.md),
    ``x86_64-avx512`` (another vendor), ``x86_64-avx2``, else the machine name."""
    machine = platform.machine() or "unknown"
    info = _cpuinfo()
    flags = set(info.get("flags", "").split())
    if machine in ("x86_64", "AMD64"):
        if "avx512f" in flags:
            vendor = VENDORS.get(info.get("vendor_id", ""))
            return f"x86_64-avx512-{vendor}" if vendor else "x86_64-avx512"
        return "x86_64-avx2" if "avx2" in flags else "x86_64"
    return machine


def cpu_model() -> str | None:
    """The CPU's model name (``/proc/cpuinfo``), for the record."""
    return _cpuinfo().get("model name") or platform.processor() or None


def kernel_flags(flags: str | None = None) -> str:
    """``XLA_FLAGS`` (default: this process's) as what can change the kernels a program runs: each flag once,
    sorted, without the flags that only dump or log (checkpoints and parts record this: the same flags in another
    order resume or merge them)."""
    flags = os.environ.get("XLA_FLAGS", "") if flags is None else flags
    return " ".join(sorted({f for f in flags.split() if not f.startswith(("--xla_dump", "--xla_log"))}))


def _names(flags: str) -> set[str]:
    return {f.split("=")[0] for f in flags.split()}


def cpu_defaults(kind: str | None = None, strategy: str | None = None) -> list[str]:
    """The flags the measured table sets on CPU type ``kind`` (default: this machine's) for a study run with
    ``strategy``. A rule that lists its ``strategies`` holds only for those (a flag can break the bitwise equality
    of replicas batched by ``vmap`` while a loop of single-replica programs stays repeatable): for any other
    strategy, or an unknown one (None), it sets nothing."""
    rule = measured.xla_cpu_rule(kind or cpu_type())
    if "strategies" in rule and strategy not in rule["strategies"]:
        return []
    return list(rule.get("flags", []))


def apply_cpu_defaults(environ=None, kind: str | None = None, strategy: str | None = None) -> list[str]:
    """Add this CPU type's measured flags for ``strategy`` (:func:`cpu_defaults`) to ``environ["XLA_FLAGS"]``
    (default ``os.environ``) unless the user set them or opted out, or JAX already started in this process (then
    nothing is added: the processes it starts must run its kernels); returns the flags added. Call it before JAX
    starts its backends:

    >>> from nondet_jax.machine import xla_flags
    >>> xla_flags.apply_cpu_defaults(strategy="sequential")  # doctest: +SKIP
    """
    environ = os.environ if environ is None else environ
    if environ.get(OPT_OUT, "1") == "0":
        return []
    current = environ.get("XLA_FLAGS", "")
    added = [f for f in cpu_defaults(kind, strategy) if f.split("=")[0] not in _names(current)]
    if added and environ is os.environ and backend_started():
        # this process's kernels can no longer change: adding the flags would give only its child processes
        # (hardware replicas, blocks, parts) other kernels than its own
        warnings.warn(f"JAX's backend already started: XLA flags {added} of this CPU type's rule are not set, so "
                      "processes this one starts run the kernels it runs", stacklevel=2)
        return []
    if added:
        environ["XLA_FLAGS"] = " ".join([*current.split(), *added])
        environ[APPLIED] = " ".join(added)
    return added


def backend_started() -> bool:
    if "jax" not in sys.modules:
        return False
    try:
        from jax._src import xla_bridge

        return bool(getattr(xla_bridge, "_backends", {}))
    except ImportError:  # pragma: no cover - jax internals moved
        return False


def record() -> dict:
    """CPU type and model, the table's rule for it, and what :func:`apply_cpu_defaults` added."""
    kind = cpu_type()
    return {"cpu_type": kind, "cpu_model": cpu_model(), "rule": measured.xla_cpu_rule(kind),
            "added": os.environ.get(APPLIED, "").split(), "opted_out": os.environ.get(OPT_OUT) == "0"}
