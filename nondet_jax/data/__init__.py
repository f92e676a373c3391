"""Data sets as arrays in memory: the embedded digits default and TFDS ``data_source`` loaders.

Images are float32 (N, H, W, C), standardised with the training split's per-channel mean and std;
labels are int32. On-device batching, shuffling and augmentation live in :mod:`.pipeline`.
"""

from __future__ import annotations

import zipfile
from typing import NamedTuple

import numpy as np

from nondet_jax.errors import UsageError
from nondet_jax.machine.memory import check_npz_sizes

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
    num_classes: int  # classification: classes; regression: outputs per example (the model's width)
    task: str = "classification"  # or "regression": float targets (see from_arrays)


TASKS = ("classification", "regression")


def standardize(x_train: np.ndarray, x_test: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Scale both splits by the training split's per-channel mean and std."""
    mean = x_train.mean(axis=(0, 1, 2), keepdims=True, dtype=np.float64)
    std = x_train.std(axis=(0, 1, 2), keepdims=True, dtype=np.float64) + 1e-8
    f = lambda x: ((x - mean) / std).astype(np.float32)  # noqa: E731
    return f(x_train), f(x_test)


ARRAY_NAMES = ("x_train", "y_train", "x_test", "y_test")


def _check_real(name: str, what: str, a: np.ndarray, purpose: str = "") -> None:
    """UsageError unless ``a`` holds finite real numbers, saying which is wrong: the dtype, or where the
    first NaN or infinite value is (the message used to say "dtype or NaN/inf", leaving the user to guess)."""
    if not np.issubdtype(a.dtype, np.number) or np.iscomplexobj(a):
        raise UsageError(f"{name}: {what} has dtype {a.dtype}, but must hold real numbers{' ' + purpose if purpose else ''}; "
                         "convert it, e.g. with .astype(np.float32)")
    bad = ~np.isfinite(a)
    if bad.any():
        first = int(np.argwhere(bad)[0][0])
        raise UsageError(f"{name}: {what} holds {int(bad.sum())} NaN or infinite value(s) (the first in example "
                         f"{first}), but must hold finite numbers{' ' + purpose if purpose else ''}; remove or replace them")


def check_arrays(name: str, x_train, y_train, x_test, y_test, num_classes: int | None = None,
                 task: str | None = None) -> tuple[dict[str, np.ndarray], str, int]:
    """The checks of :func:`from_arrays`, which it and a :class:`Dataset` built by hand
    (:func:`check_dataset`) pass: ``(arrays, task, classes)``, the arrays as numpy arrays (boolean labels as
    0/1), not cast; ``classes`` the classes of a classification, the outputs per example of a regression.
    UsageError naming the problem and its fix otherwise."""
    arrays = {k: np.asarray(v) for k, v in zip(ARRAY_NAMES, (x_train, y_train, x_test, y_test))}
    arrays.update({k: arrays[k].astype(np.int64) for k in ("y_train", "y_test") if arrays[k].dtype == bool})  # 0/1
    if task is not None and task not in TASKS:
        raise UsageError(f"task '{task}' is unknown; use 'classification' or 'regression'")
    if num_classes is not None and (isinstance(num_classes, bool) or not isinstance(num_classes, (int, np.integer))):
        raise UsageError(f"{name}: num_classes is {num_classes!r}, but must be an integer (the number of classes, "
                         "or of outputs per example for a regression); pass one")
    if task is None:
        floats = [np.issubdtype(arrays[k].dtype, np.floating) for k in ("y_train", "y_test")]
        task = "regression" if any(floats) else "classification"
    for split in ("train", "test"):
        x, y = arrays[f"x_{split}"], arrays[f"y_{split}"]
        if x.ndim < 2 or len(x) == 0:
            raise UsageError(f"{name}: x_{split} has shape {x.shape}; it must be (N, features) or (N, H, W, C) images "
                             "with N >= 1")
        if split == "test" and len(x) < 2:  # CKA centres features over the test examples: 0/0 with one
            raise UsageError(f"{name}: x_test holds 1 example, but the diversity metrics compare replicas over at least "
                             "2 (CKA centres features over them); give the test split 2 or more examples")
        want = "(N,) or (N, outputs) regression targets" if task == "regression" else f"({len(x)},) integer class labels"
        if y.ndim not in ((1, 2) if task == "regression" else (1,)) or len(y) != len(x):
            raise UsageError(f"{name}: y_{split} has shape {y.shape} for {len(x)} examples in x_{split}; it must be "
                             f"{want}")
        if task == "regression":
            _check_real(name, f"y_{split}", y, "for a regression")
        if task == "classification" and not (np.issubdtype(y.dtype, np.integer) or (
                np.issubdtype(y.dtype, np.floating) and np.all(np.isfinite(y)) and np.all(y == np.round(y)))):
            raise UsageError(f"{name}: y_{split} holds {y.dtype} values that are not whole numbers; labels must be "
                             "integer class indices 0 .. classes-1")
        _check_real(name, f"x_{split}", x)
        for arr, what in ((x, f"x_{split}"), (y, f"y_{split}") if task == "regression" else (x[:0], "")):
            if np.issubdtype(arr.dtype, np.floating) and arr.size and np.abs(arr).max() > np.finfo(np.float32).max:
                raise UsageError(f"{name}: {what} holds values up to {float(np.abs(arr).max()):.3g}, beyond float32's "
                                 f"{np.finfo(np.float32).max:.3g}, which training computes in; rescale them")
        if np.issubdtype(x.dtype, np.integer) and x.size and (x.max() > np.iinfo(np.int32).max
                                                             or x.min() < np.iinfo(np.int32).min):
            raise UsageError(f"{name}: x_{split} holds integers beyond int32 (up to {int(x.max())}); token ids must "
                             "fit in int32")
    if arrays["x_train"].shape[1:] != arrays["x_test"].shape[1:]:
        raise UsageError(f"{name}: x_train examples have shape {arrays['x_train'].shape[1:]} but x_test examples "
                         f"{arrays['x_test'].shape[1:]}; both splits must have the same example shape")
    if task == "regression":
        if arrays["y_train"].shape[1:] != arrays["y_test"].shape[1:]:
            raise UsageError(f"{name}: y_train has {arrays['y_train'].shape[1:]} outputs per example but y_test "
                             f"{arrays['y_test'].shape[1:]}; both splits need the same targets")
        outputs = int(np.prod(arrays["y_train"].shape[1:]))
        if num_classes is not None and num_classes != outputs:
            raise UsageError(f"{name}: num_classes is {num_classes}, but the regression targets have {outputs} "
                             f"value(s) per example; set num_classes={outputs}")
        return arrays, task, outputs
    ys = (arrays["y_train"], arrays["y_test"])
    # Python ints, each split in its own dtype: uint64 labels beyond int64 used to wrap to negative numbers
    # in the message (with numpy's warnings); concatenating uint64 with int64 gives floats.
    lo, hi = min(int(y.min()) for y in ys), max(int(y.max()) for y in ys)
    classes = hi + 1 if num_classes is None else num_classes
    seen = [set(np.unique(y).tolist()) for y in ys]
    used = len(seen[0] | seen[1])
    if num_classes is None and classes - used > max(1000, used):  # e.g. raw ids up to 1e8: a logit for each
        raise UsageError(f"{name}: labels run up to {hi}, which makes {classes} classes, but only {used} "
                         "distinct labels occur; labels must be class indices 0 .. classes-1: relabel them, e.g. "
                         "np.unique(y, return_inverse=True)[1]")
    if lo < 0 or hi >= classes or classes < 2:
        given = f" (num_classes={classes})" if num_classes is not None else ""
        fix = f", or set num_classes={hi + 1}" if num_classes is not None and lo >= 0 and hi >= 1 else ""
        raise UsageError(f"{name}: labels range over {lo} .. {hi}, but must be class indices "
                         f"0 .. {classes - 1}{given} with at least 2 classes; relabel them 0 .. classes-1{fix}")
    unseen = sorted(seen[1] - seen[0])
    if num_classes is None and unseen:  # accepted without a word: the model can never predict such a class
        shown = ", ".join(map(str, unseen[:5])) + (", ..." if len(unseen) > 5 else "")
        raise UsageError(f"{name}: y_test holds label(s) {shown} that no training example has, so no replica can "
                         "learn them; move examples of those classes into the training split, or drop them from "
                         "the test split")
    return arrays, task, classes


def from_arrays(name: str, x_train, y_train, x_test, y_test, num_classes: int | None = None,
                task: str | None = None) -> Dataset:
    """A :class:`Dataset` of the user's own arrays, checked: images (N, H, W, C) or any (N, features)
    array; UsageError naming the problem otherwise (:func:`check_arrays`). The task is recognised from
    the targets, not guessed: integer targets are class labels in [0, classes) (classification);
    floating-point targets, (N,) or (N, outputs), are a regression (``task="regression"`` says so for
    integer targets too; ``task="classification"`` accepts whole-number float labels). Arrays are used
    as given (inputs cast to float32, or to int32 when both splits hold integers such as token ids;
    class labels to int32, regression targets to float32), not standardised."""
    arrays, task, classes = check_arrays(name, x_train, y_train, x_test, y_test, num_classes, task)
    x_dtype = np.int32 if np.issubdtype(arrays["x_train"].dtype, np.integer) and \
        np.issubdtype(arrays["x_test"].dtype, np.integer) else np.float32  # token ids stay integers (nn.Embed)
    y_dtype = np.float32 if task == "regression" else np.int32
    return Dataset(name, arrays["x_train"].astype(x_dtype), arrays["y_train"].astype(y_dtype),
                   arrays["x_test"].astype(x_dtype), arrays["y_test"].astype(y_dtype), classes, task)


def check_dataset(data: Dataset) -> Dataset:
    """A :class:`Dataset` built by hand (``run_study(data=Dataset(...))``), checked as :func:`from_arrays`
    checks arrays (:func:`check_arrays`), its ``num_classes`` and ``task`` taken as given: labels beyond
    ``num_classes``, a NaN input or mismatched splits refused before anything trains. Returned as given
    (its arrays identify the study), save class labels that are not integers (whole-number floats or
    booleans), cast to int32 as :func:`from_arrays` casts them."""
    name = data.name if isinstance(data.name, str) else str(data.name)
    arrays, _, _ = check_arrays(name, data.x_train, data.y_train, data.x_test, data.y_test, data.num_classes,
                                data.task)
    if data.task == "classification" and not all(np.issubdtype(arrays[k].dtype, np.integer) for k in ("y_train", "y_test")):
        data = data._replace(y_train=arrays["y_train"].astype(np.int32), y_test=arrays["y_test"].astype(np.int32))
    return data


def _whole_number_targets(y, most: int = 100) -> int:
    """How many distinct values ``y`` holds when they are whole numbers, at most ``most`` of them (what class
    labels stored as floats look like), else 0."""
    y = np.asarray(y)
    if y.ndim != 1 or not np.all(y == np.round(y)):
        return 0
    distinct = len(np.unique(y))
    return distinct if distinct <= most else 0


def data_notes(data: Dataset, classify: str | None = "store them as integers") -> list[str]:
    """Lines a study logs about data it takes as given but that are likely meant otherwise: whole-number or
    one-hot float targets read as a regression (``classify``: how to ask for classes; None: the user chose the
    task, nothing said), images that look channels-first, and images of raw pixel values (0 .. 255), which
    are not scaled."""
    out = []
    y = np.asarray(data.y_train)
    if classify and getattr(data, "task", "classification") == "regression":
        classes = _whole_number_targets(y)
        if classes:  # float 0/1 labels from pandas or a CSV: said, since a regression is what the dtype asks for
            out.append(f"data: y_train holds floating-point targets that are whole numbers ({classes} distinct values), "
                       f"read as a regression (float targets are); {classify} if they are class labels")
        elif y.ndim == 2 and np.isin(y, (0, 1)).all() and (y.sum(1) == 1).all():
            out.append("data: y_train looks one-hot (rows of 0s and one 1), read as a regression on its columns; "
                       f"pass y.argmax(1) ({classify}) if they are class labels")
    x = data.x_train
    if x.ndim == 4 and x.shape[1] in (1, 3) and x.shape[3] not in (1, 3) and x.shape[2] == x.shape[3]:
        out.append(f"data: x_train's images look channels-first {tuple(x.shape)} (N, C, H, W); the models read "
                   "channels-last (N, H, W, C): pass x.transpose(0, 2, 3, 1) if the second axis is the channels")
    if x.ndim == 4 and x.size and float(np.max(x)) > 10 and float(np.min(x)) >= 0:
        out.append(f"data: x_train holds images of raw pixel values ({np.min(x):g} .. {np.max(x):g}), used as they "
                   "are (the built-in data sets are standardised); scale them (x / 255, or to mean 0 and std 1), or "
                   "a network's first layers may saturate and every replica predict one class")
    return out


def load_npz(path: str) -> Dataset:
    """A ``.npz`` file holding ``x_train, y_train, x_test, y_test`` (see :func:`from_arrays`); its
    headers are checked first (:func:`check_npz_sizes`)."""
    check_npz_sizes(path)
    try:
        f = np.load(path, allow_pickle=False)
        if not isinstance(f, np.lib.npyio.NpzFile):  # a .npy (one array) named .npz: no context manager
            raise UsageError(f"--dataset {path} holds one array (a .npy file), not the arrays x_train, y_train, "
                             "x_test, y_test; save them with np.savez(path, x_train=..., y_train=..., x_test=..., "
                             "y_test=...)")
        with f:
            missing = [k for k in ARRAY_NAMES if k not in f.files]
            if missing:
                raise UsageError(f"--dataset {path} lacks array(s) {', '.join(missing)} (it has {', '.join(f.files)}); "
                                 "save it with np.savez(path, x_train=..., y_train=..., x_test=..., y_test=...)")
            arrays = [f[k] for k in ARRAY_NAMES]
    except UsageError:
        raise
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:  # a truncated zip is a BadZipFile
        said = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UsageError(f"--dataset {path} cannot be read as a .npz file ({said}); pass a file written by np.savez") \
            from None
    return from_arrays(str(path), *arrays)


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
    if name == "digits":
        if image_size not in (0, 8) or max_train_examples or max_test_examples:
            raise UsageError("data.image_size and data.max_*_examples apply to TFDS data sets, not digits (8x8, "
                             "1437 train / 360 test); leave them at 0")
        from nondet_jax.data.digits import load_digits

        return load_digits()
    if name.endswith(".npz"):
        if image_size or max_train_examples or max_test_examples:
            raise UsageError("data.image_size and data.max_*_examples apply to TFDS data sets, not a .npz file; "
                             "leave them at 0")
        return load_npz(name)
    if name in DATASETS:
        from nondet_jax.data.tfds_source import load_tfds

        return load_tfds(name, data_dir, image_size=image_size, max_train_examples=max_train_examples,
                         max_test_examples=max_test_examples)
    raise UsageError(f"unknown dataset '{name}'; choose one of: {', '.join(DATASETS)}")


def load_data(d) -> Dataset:
    """:func:`load_dataset` with every setting of a :class:`nondet_jax.config.DataConfig`."""
    return load_dataset(d.name, d.data_dir, image_size=d.image_size, max_train_examples=d.max_train_examples,
                        max_test_examples=d.max_test_examples)
