"""Programs compiled quickly: those that run once per replica (init) or only move or count bits (keys, stacking
and slicing replicas, an epoch's indices and its end-of-epoch check).

XLA's backend optimisation level 0 skips LLVM's optimisation passes. On the 2-core CPU that took the default
study's ``init`` (ResNet-8: the random draws of every kernel) from 3.5 s to 1.2 s of compiling (``python
benchmarks/study_compile.py --default-study 2``, before and after), and it runs once
per replica, so nothing is lost at run time. Integer and copy programs compute the same bits at any level;
init's truncated normal may round one ulp differently than at the default level, the same in every run (every
strategy, the audit and the dynamics compile init this way).
"""

from __future__ import annotations

import functools
from typing import Callable

import jax

ONCE = {"xla_backend_optimization_level": 0}


def once(fn: Callable | None = None, **jit_kwargs) -> Callable:
    """``jax.jit(fn, **jit_kwargs)`` compiled with :data:`ONCE` when called with concrete arrays; traced inside
    another program (``jax.eval_shape``, an enclosing ``jit``), where JAX takes no compiler options, it is a plain
    ``jax.jit`` and the enclosing program's options apply. Usable as ``@once`` or ``@once(static_argnums=...)``."""
    if fn is None:
        return functools.partial(once, **jit_kwargs)
    quick, plain = jax.jit(fn, compiler_options=ONCE, **jit_kwargs), jax.jit(fn, **jit_kwargs)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves((args, kwargs))):
            return plain(*args, **kwargs)
        try:
            return quick(*args, **kwargs)
        except ValueError as e:  # concrete arguments, but called while another program is traced
            if "compiler_options" not in str(e):
                raise
            return plain(*args, **kwargs)

    return call
