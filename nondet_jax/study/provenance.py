"""What a run folder records about how its results were made: ``environment.json``."""

from __future__ import annotations

import contextlib
import warnings

import jax
import jax.numpy as jnp

from nondet_jax.instruments.layerwise import SlowerPath
from nondet_jax.machine import determinism
from nondet_jax.models import convs
from nondet_jax.sources import one_replica


def environment() -> dict:
    """The machine's record (:func:`nondet_jax.machine.determinism.environment`) plus how replica-batched
    convolutions are computed here and the measured table that chose it."""
    return {**determinism.environment(), "vmap_conv": convs.record()}


def instruments_path(fns, data) -> dict | None:
    """How the instruments form per-example gradients for this model (None without instruments):
    ``{"per_example": "recorded pass" | "vmap(grad)", "why": [...]}``, the second with the reasons the
    layer recorder gave (a layer it does not take). Found by tracing one training step
    (``jax.eval_shape``: nothing runs), which is where the choice is made."""
    if fns.instruments is None:
        return None
    keys, perturb = one_replica("control")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", SlowerPath)
        state = jax.eval_shape(fns.init, keys, perturb, data.x_train[:1])
        jax.eval_shape(fns.train_step, state, data.x_train, data.y_train, keys, perturb, jnp.int32(0), jnp.int32(0),
                       jnp.arange(fns.batch_size))
    why = sorted({str(w.message) for w in caught if issubclass(w.category, SlowerPath)})
    for w in caught:  # anything else is the user's to see
        if not issubclass(w.category, SlowerPath):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return {"per_example": "vmap(grad)" if why else "recorded pass", "why": why}


@contextlib.contextmanager
def fallback_said():
    """The recorder's fallback warning silenced while a study trains: :func:`instruments_path` has
    put it in the log and ``environment.json`` once already."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SlowerPath)
        yield
