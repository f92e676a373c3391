"""Shared fixtures: small configurations and data so the suite stays fast on 2 CPU cores."""

from __future__ import annotations

import os
import tempfile

import jax
import numpy as np
import pytest

from nondet_jax.config import from_flat
from nondet_jax.data import Dataset, load_dataset
from nondet_jax.train import DataSpec

# Compile time dominates these tiny runs; tests that train for real turn optimisation back on.
jax.config.update("jax_disable_most_optimizations", True)
# The sweeps the tests start share one compilation cache, kept out of the user's own.
os.environ.setdefault("NONDET_JAX_COMPILE_CACHE", os.path.join(tempfile.gettempdir(), "nondet_jax_test_cache"))


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


def tree_equal(a, b) -> bool:
    import jax

    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb))
