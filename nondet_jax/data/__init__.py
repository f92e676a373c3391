"""Data sets as arrays in memory: the embedded digits default and TFDS ``data_source`` loaders.

Images are float32 (N, H, W, C), standardised with the training split's per-channel mean and std;
labels are int32. On-device batching, shuffling and augmentation live in :mod:`.pipeline`.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

DATASETS = ("digits", "cifar10", "mnist", "fashion_mnist", "imagenette", "imagenet2012")
# Variable-size photographs: resized (shorter side) and centre-cropped to data.image_size on loading.
RESIZED = ("imagenette", "imagenet2012")
DEFAULT_IMAGE_SIZE = 224  # data.image_size = 0 means this for RESIZED sets, the native size otherwise
# Too big to hold in memory whole: data.max_train_examples must cap the training split.
NEEDS_TRAIN_CAP = ("imagenet2012",)
AUGMENT_BY_DEFAULT = ("cifar10", "imagenette", "imagenet2012")  # random crop (+ flip): the standard for photos
FLIP_BY_DEFAULT = ("cifar10", "fashion_mnist", "imagenette", "imagenet2012")  # a mirrored digit is another symbol


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


def load_dataset(name: str, data_dir: str | None = None, *, image_size: int = 0, max_train_examples: int = 0,
                 max_test_examples: int = 0) -> Dataset:
    """Load a data set by name; raises UsageError when it is unknown, not prepared or too big.

    Args:
      name: one of :data:`DATASETS`.
      data_dir: TFDS data directory (None = TFDS default).
      image_size: square side the images are brought to (0 = 224 for imagenette/imagenet2012, the
        native size otherwise); TFDS sets only.
      max_train_examples, max_test_examples: keep a fixed random subset of at most this many
        examples of the split (0 = all); TFDS sets only, required for imagenet2012's training split.
    """
    from nondet_jax.errors import UsageError

    if name == "digits":
        if image_size not in (0, 8) or max_train_examples or max_test_examples:
            raise UsageError("data.image_size and data.max_*_examples apply to TFDS data sets, not digits (8x8, "
                             "1437 train / 360 test); leave them at 0")
        from nondet_jax.data.digits import load_digits

        return load_digits()
    if name in DATASETS:
        from nondet_jax.data.tfds_source import load_tfds

        return load_tfds(name, data_dir, image_size=image_size, max_train_examples=max_train_examples,
                         max_test_examples=max_test_examples)
    raise UsageError(f"unknown dataset '{name}'; choose one of: {', '.join(DATASETS)}")


def load_data(d) -> Dataset:
    """:func:`load_dataset` with every setting of a :class:`nondet_jax.config.DataConfig`."""
    return load_dataset(d.name, d.data_dir, image_size=d.image_size, max_train_examples=d.max_train_examples,
                        max_test_examples=d.max_test_examples)
