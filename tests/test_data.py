"""The embedded digits set, the TFDS loader (on TFDS's mock data) and the on-device pipeline."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorflow_datasets as tfds

from nondet_jax.data import load_dataset
from nondet_jax.data.pipeline import augment, batch_permutation, epoch_indices
from nondet_jax.errors import UsageError


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


def test_imagenette_is_resized_and_center_cropped_on_mock_data():
    from nondet_jax.config import from_flat
    from nondet_jax.data import load_data

    with tfds.testing.mock_data(num_examples=24):  # mock photos have random sizes (8..48 px a side)
        d = load_data(from_flat({"data.name": "imagenette", "data.image_size": 16}).data)
        full = load_dataset("imagenette")
    assert d.x_train.shape == (24, 16, 16, 3) and d.x_test.shape == (24, 16, 16, 3)
    assert full.x_train.shape == (24, 224, 224, 3)  # the default size for ImageNet-like sets
    assert d.num_classes == 10 and d.y_train.dtype == np.int32 and d.x_train.dtype == np.float32
    assert np.isfinite(d.x_train).all()
    np.testing.assert_allclose(d.x_train.mean(axis=(0, 1, 2)), 0, atol=1e-4)  # standardised per channel
    np.testing.assert_allclose(d.x_train.std(axis=(0, 1, 2)), 1, atol=1e-4)


def test_imagenet2012_needs_a_cap_and_takes_a_fixed_subset_on_mock_data():
    from nondet_jax.config import from_flat
    from nondet_jax.data.tfds_source import subset_indices

    with pytest.raises(UsageError, match="data.max_train_examples"):
        from_flat({"data.name": "imagenet2012"})
    with tfds.testing.mock_data(num_examples=30):
        with pytest.raises(UsageError, match="data.max_train_examples"):
            load_dataset("imagenet2012", image_size=16)
        d = load_dataset("imagenet2012", image_size=16, max_train_examples=10, max_test_examples=6)
        again = load_dataset("imagenet2012", image_size=16, max_train_examples=10, max_test_examples=6)
        source = tfds.data_source("imagenet2012", split="train", download=False)
        idx = subset_indices(30, 10)
        expected = [int(source[int(i)]["label"]) for i in idx]
    assert d.x_train.shape == (10, 16, 16, 3) and d.x_test.shape == (6, 16, 16, 3) and d.num_classes == 1000
    assert len(set(idx)) == 10 and not np.array_equal(idx, np.arange(10))  # a random subset, not the first 10
    assert d.y_train.tolist() == expected
    assert np.array_equal(d.x_train, again.x_train) and np.array_equal(d.y_test, again.y_test)


def test_fixed_size_sets_can_be_resized_whole():
    with tfds.testing.mock_data(num_examples=24):
        d = load_dataset("mnist", image_size=14)
        native = load_dataset("mnist", image_size=28)
        default = load_dataset("mnist")
    assert d.x_train.shape == (24, 14, 14, 1)
    assert np.array_equal(native.x_train, default.x_train)  # the native size is the untouched images


def test_missing_imagenet_says_where_the_tar_files_go(tmp_path):
    with pytest.raises(UsageError, match="ILSVRC2012_img_train.tar and ILSVRC2012_img_val.tar") as e:
        load_dataset("imagenet2012", str(tmp_path), max_train_examples=100)
    msg = str(e.value)
    assert f"{tmp_path}/downloads/manual/" in msg and "tfds build imagenet2012" in msg and "\n" not in msg
    with pytest.raises(UsageError, match="tfds build imagenette/320px-v2"):
        load_dataset("imagenette", str(tmp_path))


def test_data_too_big_for_memory_is_refused_before_reading():
    with tfds.testing.mock_data(num_examples=24):
        with pytest.raises(UsageError, match="needs about .* GiB in memory.*max_train_examples"):
            load_dataset("imagenette", image_size=40000)


def test_digits_refuses_tfds_only_settings():
    from nondet_jax.config import from_flat

    with pytest.raises(UsageError, match="apply to TFDS data sets"):
        from_flat({"data.image_size": 32})
    with pytest.raises(UsageError, match="apply to TFDS data sets"):
        load_dataset("digits", max_train_examples=100)


def test_resize_center_crop_by_hand():
    from nondet_jax.data.tfds_source import resize_center_crop

    img = np.arange(6 * 10 * 2, dtype=np.uint8).reshape(6, 10, 2)
    # shorter side already the size and nothing cropped off it: exactly the central 6 columns
    np.testing.assert_array_equal(resize_center_crop(img, 6, crop_fraction=1.0), img[:, 2:8])
    const = np.full((37, 53, 3), 123, np.uint8)
    out = resize_center_crop(const, 16)
    assert out.shape == (16, 16, 3) and out.dtype == np.uint8 and (out == 123).all()
    # a horizontal ramp halved: the (symmetric, antialiased) filter keeps it linear away from the edges
    ramp = np.tile(np.arange(40, dtype=np.float64), (40, 1))[..., None]
    half = resize_center_crop(ramp, 20, crop_fraction=1.0)[..., 0]
    np.testing.assert_allclose(half[:, 1:-1], np.tile(2 * np.arange(1, 19) + 0.5, (20, 1)), atol=1e-9)
    # ImageNet's transform: shorter side to size / 0.875, then the central size x size
    tall = np.zeros((64, 32, 1), np.uint8)
    tall[:, 14:18] = 255  # a centred vertical bar survives the crop, centred
    out = resize_center_crop(tall, 14)
    assert out.shape == (14, 14, 1) and out[:, 7, 0].min() > 200 and out[:, 0, 0].max() == 0


@pytest.mark.parametrize("change,message", [
    (lambda x, y: (x * 1e300, y), "beyond float32's"),
    (lambda x, y: (x + 1j, y), "x_train has dtype complex128, but must hold real numbers"),
    (lambda x, y: (np.where(np.arange(10)[:, None] == 3, np.nan, x), y),
     r"x_train holds 4 NaN or infinite value\(s\) \(the first in example 3\), but must hold finite numbers"),
    (lambda x, y: (x, np.where(np.arange(10) == 5, np.inf, y)), r"y_train holds 1 NaN .* example 5\), but must hold "
                                                                  "finite numbers for a regression"),
    (lambda x, y: ((x * 1e10).astype(np.int64), y), "beyond int32"),
    (lambda x, y: (x, y * 1e300), r"y_train holds values up to 1e\+300"),
])
def test_values_training_cannot_represent_are_refused(change, message):
    """float64 values beyond float32 used to pass the finite check and become inf (every replica
    "diverged" at step 0); complex inputs lost their imaginary part."""
    from nondet_jax.data import from_arrays
    from nondet_jax.errors import UsageError

    x, y = np.random.default_rng(0).random((10, 4)), np.linspace(0.0, 1.0, 10)
    x, y = change(x, y)
    with pytest.raises(UsageError, match=message):
        from_arrays("t", x, y, x, y)


@pytest.mark.parametrize("y_train,y_test,message", [
    # uint64 labels beyond int64 wrapped to -1 in the message, with numpy's warnings
    (np.where(np.arange(20) == 3, 2**64 - 1, np.arange(20) % 3).astype(np.uint64), np.arange(5) % 3,
     "labels run up to 18446744073709551615, which makes 18446744073709551616 classes, but only 4 distinct"),
    # a test label no training example has was accepted without a word
    (np.arange(20) % 3, np.array([0, 1, 2, 7, 1]), "y_test holds label(s) 7 that no training example has"),
    # one test example: CKA divided 0 by 0 (numpy's warning) over the centred features
    (np.arange(20) % 3, np.array([1]), "x_test holds 1 example, but the diversity metrics compare replicas over "
                                       "at least 2"),
])
def test_labels_and_test_splits_the_metrics_cannot_use_are_refused(y_train, y_test, message):
    import warnings

    from nondet_jax.data import from_arrays
    from nondet_jax.errors import UsageError

    x = np.zeros((20, 4), np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # and no numpy warning on the way
        with pytest.raises(UsageError) as e:
            from_arrays("t", x, y_train, x[:len(y_test)], y_test)
    assert message in str(e.value)


def test_data_notes_name_what_is_taken_as_given_but_likely_meant_otherwise():
    """Raw 0..255 pixels were used unscaled and float class labels became a regression without a word on the
    command line (run_study said the second for arrays only): the notes both paths log."""
    from nondet_jax.data import data_notes, from_arrays

    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(20, 4, 4, 1)).astype(np.uint8)
    labels = np.arange(20) % 3
    notes = data_notes(from_arrays("raw", raw, labels, raw[:6], labels[:6]))
    assert len(notes) == 1 and "raw pixel values (0 .. 255)" in notes[0] and "x / 255" in notes[0]
    scaled = (raw / 255.0).astype(np.float32)
    assert data_notes(from_arrays("ok", scaled, labels, scaled[:6], labels[:6])) == []
    floats = from_arrays("f", scaled, labels.astype(np.float32), scaled[:6], labels[:6].astype(np.float32))
    notes = data_notes(floats, "store them as integers in the .npz")
    assert len(notes) == 1 and "whole numbers (3 distinct values)" in notes[0] and notes[0].endswith(
        "store them as integers in the .npz if they are class labels")
    assert data_notes(floats, None) == []  # the user chose the task: nothing said about the labels
    nchw = scaled.transpose(0, 3, 1, 2)  # (20, 1, 4, 4)
    notes = data_notes(from_arrays("nchw", nchw, labels, nchw[:6], labels[:6]))
    assert len(notes) == 1 and "channels-first (20, 1, 4, 4)" in notes[0] and "x.transpose(0, 2, 3, 1)" in notes[0]
