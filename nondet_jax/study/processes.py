"""One way to run part of a study in a child process, for the three that do: an arm of the sweep under
other XLA flags (:mod:`.child`), the ``hardware`` arm's one fresh process per replica (:mod:`.hardware`) and
the audit's run with the determinism flags on (``cli.audit``).

A child is ``python -m <module> <args>`` with ``flags`` in its XLA_FLAGS (read when its backend starts), a
marker in its environment that its internal entry checks (:func:`require_child`: started by hand, it refuses
in one line), the parent's pid (``signals.PARENT_ENV``; :func:`require_child` asks Linux to end the child
with its parent) and a session of its own (Ctrl-C reaches the parent, which prints the one line). A child
that fails is one RuntimeError naming what it was doing, with its exit status.

This module imports no JAX: the audit's parent checks its arguments before JAX starts.
"""

from __future__ import annotations

import os
import subprocess
import sys

from nondet_jax.errors import UsageError
from nondet_jax.machine.determinism import with_flags
from nondet_jax.machine.signals import CHILD_ENV, PARENT_ENV, die_with_parent

ARM_CHILD = CHILD_ENV  # an arm of the sweep (python -m nondet_jax.sweep --child-arm ARM)
REPLICA_CHILD = "NONDET_JAX_REPLICA_CHILD"  # one replica of the hardware arm (python -m nondet_jax.study.hardware)
AUDIT_CHILD = "NONDET_JAX_AUDIT_CHILD"  # the audit with the determinism flags on (python -m nondet_jax audit --child-json)
# no persistent compilation cache (nor XLA's per-fusion autotuning cache it carries): the process compiles afresh
NO_CACHES = {"NONDET_JAX_COMPILE_CACHE": "off", "JAX_ENABLE_COMPILATION_CACHE": "false"}


def child_env(flags, marker: str, *, caches: bool = True) -> dict[str, str]:
    """The environment of a child: this one with ``flags`` in XLA_FLAGS (``determinism.with_flags``), the
    ``marker`` set, the parent's pid, and without the compilation caches unless ``caches``."""
    return {**os.environ, "XLA_FLAGS": with_flags(flags), marker: "1", PARENT_ENV: str(os.getpid()),
            **({} if caches else NO_CACHES)}


def run_child(module: str, args: list[str], flags, marker: str, what: str, *, caches: bool = True,
              capture: bool = False, after: str = "its output is above") -> subprocess.CompletedProcess:
    """Run ``python -m module *args`` as a child (see the module docstring) and wait for it. ``capture``: its
    output comes back in the result (text) instead of going to this process's terminal. A non-zero exit is
    ``RuntimeError("<what> failed with exit status N; <after>")``, ``after`` the last line of its standard
    error when captured."""
    proc = subprocess.run([sys.executable, "-m", module, *args], env=child_env(flags, marker, caches=caches),
                          capture_output=capture, text=capture or None, start_new_session=True)
    if proc.returncode != 0:
        if capture:
            after = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise RuntimeError(f"{what} failed with exit status {proc.returncode}; {after}")
    return proc


def require_child(marker: str, refusal: str) -> None:
    """In a child's internal entry: UsageError ``refusal`` unless a parent started it with ``marker``; then
    leave when that parent does (``signals.die_with_parent``)."""
    if os.environ.get(marker) != "1":
        raise UsageError(refusal)
    die_with_parent()
