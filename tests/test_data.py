"""The embedded digits set, the TFDS loader (on TFDS's mock data) and the on-device pipeline."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorflow_datasets as tfds

from nondet_jax.config import UsageError
from nondet_jax.data import load_dataset
from nondet_jax.data.pipeline import augment, batch_permutation, epoch_indices


def test_digits_split_is_fixed_and_stratified(digits):
    assert digits.x_train.shape == (1437, 8, 8, 1) and digits.x_test.shape == (360, 8, 8, 1)
    assert digits.x_train.dtype == np.float32 and digits.y_train.dtype == np.int32
    counts = np.bincount(digits.y_test, minlength=10)
    assert counts.sum() == 360 and counts.min() >= 35 and counts.max() <= 37  # stratified: 10% per class ± 1
    again = load_dataset("digits")
    assert np.array_equal(again.x_train, digits.x_train) and np.array_equal(again.y_test, digits.y_test)
    assert abs(float(digits.x_train.mean())) < 1e-5 and abs(float(digits.x_train.std()) - 1) < 1e-3


@pytest.mark.parametrize("name", ["mnist", "fashion_mnist", "cifar10"])
def test_tfds_loader_on_mock_data(name):
    with tfds.testing.mock_data(num_examples=24):
        d = load_dataset(name)
    h = 32 if name == "cifar10" else 28
    c = 3 if name == "cifar10" else 1
    assert d.x_train.shape == (24, h, h, c) and d.x_test.shape == (24, h, h, c)
    assert d.y_train.dtype == np.int32 and d.num_classes == 10
    assert d.x_train.dtype == np.float32 and np.isfinite(d.x_train).all()


def test_missing_tfds_data_says_how_to_prepare(tmp_path):
    with pytest.raises(UsageError, match="tfds build cifar10"):
        load_dataset("cifar10", str(tmp_path))
    assert not any(tmp_path.iterdir()) or all(p.is_dir() for p in tmp_path.rglob("*"))  # nothing downloaded


def test_epoch_indices_are_a_keyed_permutation():
    k = jax.random.key(0)
    a = np.asarray(epoch_indices(k, 0, 100, 32))
    assert a.shape == (3, 32) and len(np.unique(a)) == 96
    assert np.array_equal(a, np.asarray(epoch_indices(k, 0, 100, 32)))
    assert not np.array_equal(a, np.asarray(epoch_indices(k, 1, 100, 32)))


def test_augment_crops_and_flips_hand_made_image():
    img = jnp.arange(16, dtype=jnp.float32).reshape(1, 4, 4, 1) + 1  # values 1..16, no zeros
    seen_flip, seen_shift = False, False
    for s in range(40):
        out = np.asarray(augment(img, jax.random.key(s), padding=1))[0, ..., 0]
        src = np.asarray(img)[0, ..., 0]
        candidates = []
        for flip in (False, True):
            base = src[:, ::-1] if flip else src
            padded = np.pad(base, 1)
            for dy in range(3):
                for dx in range(3):
                    if np.array_equal(padded[dy:dy + 4, dx:dx + 4], out):
                        candidates.append((flip, dy, dx))
        assert candidates, "output is not a padded crop of the (flipped) image"
        seen_flip |= any(c[0] for c in candidates) and not any(not c[0] for c in candidates)
        seen_shift |= all((c[1], c[2]) != (1, 1) for c in candidates)
    assert seen_flip and seen_shift


def test_batch_permutation_is_keyed_by_step():
    k = jax.random.key(3)
    p0, p1 = np.asarray(batch_permutation(k, 0, 16)), np.asarray(batch_permutation(k, 1, 16))
    assert sorted(p0) == list(range(16)) and not np.array_equal(p0, p1)
