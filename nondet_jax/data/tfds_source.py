"""TFDS loaders through ``tfds.data_source`` (random access, no TensorFlow needed at run time).

Nothing is ever downloaded here: a data set that is not prepared in ``data_dir`` raises a
UsageError that says how to prepare it. Tests use ``tfds.testing.mock_data``.

Splits are loaded whole into host memory (then onto the device by the trainer), which is what
makes every replica's epoch one ``lax.scan``. That is fine for CIFAR/MNIST and Imagenette, not
for ImageNet: ``imagenet2012`` needs ``data.max_train_examples`` (a fixed random subset of the
training split) and every set is refused up front when its float32 arrays would not fit in half
the machine's memory. Variable-size photographs (``RESIZED`` sets) are resized, shorter side to
``image_size / CROP_FRACTION``, then centre-cropped to ``image_size`` (the standard ImageNet
evaluation transform), with an antialiased bilinear filter written in numpy.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

import numpy as np

from nondet_jax.data import (
    DEFAULT_IMAGE_SIZE,
    NEEDS_TRAIN_CAP,
    RESIZED,
    Dataset,
    standardize,
)
from nondet_jax.errors import UsageError

NUM_CLASSES = {"cifar10": 10, "mnist": 10, "fashion_mnist": 10, "imagenette": 10, "imagenet2012": 1000}
# Imagenette's 320px variant: the 2019 70/30 train/validation split, a 1/5 of the full-size download,
# and still larger than 224 on the shorter side.
TFDS_NAMES = {"imagenette": "imagenette/320px-v2"}
TEST_SPLIT = {"imagenette": "validation", "imagenet2012": "validation"}  # no labelled test split
NATIVE_SIZE = {"cifar10": 32, "mnist": 28, "fashion_mnist": 28}
CROP_FRACTION = 0.875  # 224 of 256: the resize-then-centre-crop ratio of the ImageNet literature
SUBSET_SEED = 0  # the capped subsets are the same every run
READ_CHUNK = 256  # records decoded at a time (decoded full-size photos are large)
MEMORY_FRACTION = 0.5  # refuse data whose arrays would take more of the machine's memory than this


def tfds_name(name: str) -> str:
    return TFDS_NAMES.get(name, name)


def prepare_hint(name: str, data_dir: str | None) -> str:
    where = data_dir or "~/tensorflow_datasets"
    build = (f"`pip install tensorflow && tfds build {tfds_name(name)} --file_format=array_record "
             f"--data_dir {where}`")
    if name == "imagenet2012":
        return (f"download ILSVRC2012_img_train.tar and ILSVRC2012_img_val.tar (registration at "
                f"https://image-net.org/download-images) into {where}/downloads/manual/, then run {build}, "
                f"then pass --data-dir {where}")
    return f"prepare it once where there is internet access with {build}, then pass --data-dir {where}"


def subset_indices(n: int, cap: int) -> np.ndarray:
    """Sorted indices of a fixed random subset of ``cap`` of ``n`` examples (all when cap is 0 or >= n)."""
    if cap <= 0 or cap >= n:
        return np.arange(n)
    return np.sort(np.random.default_rng(SUBSET_SEED).choice(n, cap, replace=False))


@functools.lru_cache(maxsize=512)  # photos share a few sizes
def _filter_matrix(n_in: int, n_out: int) -> np.ndarray:
    """(n_out, n_in) weights of an antialiased linear (triangle) resampling filter.

    The triangle is widened by the downscale factor (as PIL's bilinear filter), and each row is
    normalised, so a constant image stays constant and edges are renormalised rather than padded.
    """
    scale = n_in / n_out
    support = max(scale, 1.0)
    centers = (np.arange(n_out) + 0.5) * scale
    x = np.arange(n_in) + 0.5
    w = np.maximum(0.0, 1.0 - np.abs(x[None, :] - centers[:, None]) / support)
    w = w / w.sum(1, keepdims=True)
    w.setflags(write=False)  # cached: shared by every caller
    return w


def resize_center_crop(img: np.ndarray, size: int, crop_fraction: float = CROP_FRACTION) -> np.ndarray:
    """Resize so the shorter side is ``round(size / crop_fraction)``, then take the central ``size`` x ``size``.

    Args:
      img: (H, W, C) uint8 (or float) image.
      size: side of the square output.
      crop_fraction: ``size`` over the resized shorter side (1.0 = crop nothing off the shorter side).
    Returns:
      (size, size, C) array of ``img``'s dtype (uint8 values rounded and clipped).
    """
    h, w = img.shape[:2]
    short = max(size, round(size / crop_fraction))
    nh, nw = (short, max(short, round(w * short / h))) if h <= w else (max(short, round(h * short / w)), short)
    top, left = (nh - size) // 2, (nw - size) // 2
    wy = _filter_matrix(h, nh)[top:top + size]
    wx = _filter_matrix(w, nw)[left:left + size]
    # Two plain GEMMs (rows, then columns); float32 suffices for uint8 output.
    dt = np.float64 if img.dtype == np.float64 else np.float32
    c = img.shape[2]
    rows = (wy.astype(dt) @ np.asarray(img, dt).reshape(h, w * c)).reshape(size, w, c)
    cols = rows.transpose(0, 2, 1).reshape(size * c, w) @ wx.T.astype(dt)  # (size * C, size)
    out = cols.reshape(size, c, size).transpose(0, 2, 1)
    if np.issubdtype(img.dtype, np.integer):
        return np.clip(np.rint(out), 0, np.iinfo(img.dtype).max).astype(img.dtype)
    return out.astype(img.dtype)


def _getitems(source, idx: list[int]):
    try:
        return source.__getitems__(idx)
    except TypeError:  # some TFDS versions' mock sources lack batched reads
        return [source[i] for i in idx]


def _read_split(source, idx: np.ndarray, size: int | None, crop_fraction: float = CROP_FRACTION
                ) -> tuple[np.ndarray, np.ndarray]:
    """Images (the source's dtype, uint8) and int32 labels of the examples ``idx``; resized and
    centre-cropped (:func:`resize_center_crop`) when ``size`` is given."""
    x, y = None, np.empty(len(idx), np.int32)
    for s in range(0, len(idx), READ_CHUNK):
        records = _getitems(source, [int(i) for i in idx[s:s + READ_CHUNK]])
        for j, r in enumerate(records, start=s):
            img = np.asarray(r["image"])
            if size is not None:
                img = resize_center_crop(img, size, crop_fraction)
            if x is None:
                x = np.empty((len(idx),) + img.shape, img.dtype)
            x[j], y[j] = img, int(r["label"])
    return x, y


def standardize_uint8(x_train: np.ndarray, x_test: np.ndarray, chunk: int = 1024) -> tuple[np.ndarray, np.ndarray]:
    """:func:`standardize` for large uint8 arrays, without float64 copies of them.

    The per-channel mean and std come exactly from 256-bin histograms; the float32 outputs are
    written a chunk of examples at a time.
    """
    c = x_train.shape[-1]
    counts = np.zeros((c, 256), np.int64)
    for s in range(0, len(x_train), chunk):
        block = x_train[s:s + chunk].reshape(-1, c)
        for k in range(c):
            counts[k] += np.bincount(block[:, k], minlength=256)
    v = np.arange(256, dtype=np.float64)
    total = counts.sum(1)
    mean = (counts * v).sum(1) / total
    std = np.sqrt((counts * (v[None] - mean[:, None]) ** 2).sum(1) / total) + 1e-8

    def apply(x):
        out = np.empty(x.shape, np.float32)
        for s in range(0, len(x), chunk):
            out[s:s + chunk] = (x[s:s + chunk] - mean) / std
        return out

    return apply(x_train), apply(x_test)


def _check_memory(name: str, n_train: int, n_test: int, shape: tuple[int, int, int], cap_hint: str) -> None:

    need = (n_train + n_test) * int(np.prod(shape)) * 5  # uint8 while reading + float32 after
    try:
        have = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return
    if need > MEMORY_FRACTION * have:
        raise UsageError(f"{name} at {shape[0]}x{shape[1]} needs about {need / 2**30:.0f} GiB in memory "
                         f"({n_train} train + {n_test} test images), more than {MEMORY_FRACTION:.0%} of this "
                         f"machine's {have / 2**30:.0f} GiB; {cap_hint}")


def load_tfds(name: str, data_dir: str | None = None, *, image_size: int = 0, max_train_examples: int = 0,
              max_test_examples: int = 0) -> Dataset:
    """Load the train and test splits of a TFDS image-classification data set into memory.

    Args:
      name: a TFDS-backed name of :data:`nondet_jax.data.DATASETS`.
      data_dir: TFDS data directory (None = TFDS default).
      image_size: output side; 0 = 224 for RESIZED sets, the native size otherwise. A fixed-size
        set brought to another size is resized whole (nothing cropped).
      max_train_examples, max_test_examples: fixed random subsets (0 = whole split).
    Returns:
      A :class:`Dataset` of standardised float32 images (N, S, S, C) and int32 labels.
    """
    import tensorflow_datasets as tfds

    if name in NEEDS_TRAIN_CAP and max_train_examples <= 0:
        raise UsageError(f"{name}'s training split does not fit in memory; set a subset size with "
                         f"--set data.max_train_examples=50000 (say), and --set data.image_size=64 for a smoke run")
    test_split = TEST_SPLIT.get(name, "test")
    folder = tfds_name(name).split("/")[0]  # TFDS keeps a set (and its configs) under <data_dir>/<name>
    if data_dir and not (Path(data_dir).expanduser() / folder).is_dir():
        # nothing of it there: TFDS would name a file-format problem after a warning of its own
        raise UsageError(f"dataset '{name}' is not in {data_dir} (no folder {folder} there); "
                         f"{prepare_hint(name, data_dir)}")
    absl_log = logging.getLogger("absl")
    level = absl_log.level
    absl_log.setLevel(logging.ERROR)  # TFDS's warnings while probing: the one-line error below says what is wrong
    try:
        sources = {s: tfds.data_source(tfds_name(name), split=s, data_dir=data_dir, download=False)
                   for s in ("train", test_split)}
    except Exception as e:  # TFDS raises assorted types for "not there" / "wrong format"
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UsageError(f"dataset '{name}' is not available for random access in "
                         f"{data_dir or 'the TFDS default folder'} ({first}); {prepare_hint(name, data_dir)}") from None
    finally:
        absl_log.setLevel(level)
    idx_tr = subset_indices(len(sources["train"]), max_train_examples)
    idx_te = subset_indices(len(sources[test_split]), max_test_examples)
    if len(idx_tr) == 0 or len(idx_te) == 0:
        raise UsageError(f"dataset '{name}' has an empty split in {data_dir}; {prepare_hint(name, data_dir)}")
    resized = name in RESIZED
    native = NATIVE_SIZE.get(name)
    size = image_size or (DEFAULT_IMAGE_SIZE if resized else native)
    channels = 1 if name in ("mnist", "fashion_mnist") else 3
    _check_memory(name, len(idx_tr), len(idx_te), (size, size, channels),
                  "cap the splits with --set data.max_train_examples=N --set data.max_test_examples=M "
                  "or lower --set data.image_size")
    # Photos: resize + centre crop. Fixed-size sets: untouched at their own size, else resized whole.
    target = size if resized or size != native else None
    crop = CROP_FRACTION if resized else 1.0
    try:
        (x_tr, y_tr), (x_te, y_te) = (_read_split(sources[s], i, target, crop)
                                      for s, i in (("train", idx_tr), (test_split, idx_te)))
    except ImportError as e:
        raise UsageError(f"decoding {name}'s images needs pillow or opencv ({e}); run `pip install pillow`") from None
    if resized:
        x_tr, x_te = standardize_uint8(x_tr, x_te)
    else:
        x_tr, x_te = standardize(x_tr.astype(np.float32), x_te.astype(np.float32))
    return Dataset(name, x_tr, y_tr, x_te, y_te, NUM_CLASSES[name])

