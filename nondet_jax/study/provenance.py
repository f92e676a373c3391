"""What a run folder records about how its results were made: ``environment.json``."""

from __future__ import annotations

from nondet_jax.machine import determinism
from nondet_jax.models import convs


def environment() -> dict:
    """The machine's record (:func:`nondet_jax.machine.determinism.environment`) plus how replica-batched
    convolutions are computed here and the measured table that chose it."""
    return {**determinism.environment(), "vmap_conv": convs.record()}
