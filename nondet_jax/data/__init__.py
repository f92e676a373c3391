"""Data sets as arrays in memory: the embedded digits default and TFDS ``data_source`` loaders.

Images are float32 (N, H, W, C), standardised with the training split's per-channel mean and std;
labels are int32. On-device batching, shuffling and augmentation live in :mod:`.pipeline`.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

DATASETS = ("digits", "cifar10", "mnist", "fashion_mnist")
AUGMENT_BY_DEFAULT = ("cifar10",)  # random crop (+ flip) is the standard recipe for natural images
FLIP_BY_DEFAULT = ("cifar10", "fashion_mnist")  # a mirrored digit is another symbol (or none)


class Dataset(NamedTuple):
    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int


def standardize(x_train: np.ndarray, x_test: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Scale both splits by the training split's per-channel mean and std."""
    mean = x_train.mean(axis=(0, 1, 2), keepdims=True, dtype=np.float64)
    std = x_train.std(axis=(0, 1, 2), keepdims=True, dtype=np.float64) + 1e-8
    f = lambda x: ((x - mean) / std).astype(np.float32)  # noqa: E731
    return f(x_train), f(x_test)


def load_dataset(name: str, data_dir: str | None = None) -> Dataset:
    """Load a data set by name; raises UsageError when it is unknown or not prepared."""
    from nondet_jax.config import UsageError

    if name == "digits":
        from nondet_jax.data.digits import load_digits

        return load_digits()
    if name in DATASETS:
        from nondet_jax.data.tfds_source import load_tfds

        return load_tfds(name, data_dir)
    raise UsageError(f"unknown dataset '{name}'; choose one of: {', '.join(DATASETS)}")
