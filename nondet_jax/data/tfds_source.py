"""TFDS loaders through ``tfds.data_source`` (random access, no TensorFlow needed at run time).

Nothing is ever downloaded here: a data set that is not prepared in ``data_dir`` raises a
UsageError that says how to prepare it. Tests use ``tfds.testing.mock_data``.
"""

from __future__ import annotations

import numpy as np

from nondet_jax.data import Dataset, standardize

NUM_CLASSES = {"cifar10": 10, "mnist": 10, "fashion_mnist": 10}


def _read_split(source) -> tuple[np.ndarray, np.ndarray]:
    n = len(source)
    try:
        records = source.__getitems__(list(range(n)))
    except TypeError:  # some TFDS versions' mock sources lack batched reads
        records = [source[i] for i in range(n)]
    x = np.stack([np.asarray(r["image"]) for r in records]).astype(np.float32)
    y = np.asarray([int(r["label"]) for r in records], dtype=np.int32)
    return x, y


def prepare_hint(name: str, data_dir: str | None) -> str:
    where = data_dir or "~/tensorflow_datasets"
    return (f"prepare it once where there is internet access with `pip install tensorflow && "
            f"tfds build {name} --file_format=array_record --data_dir {where}`, then pass --data-dir {where}")


def load_tfds(name: str, data_dir: str | None = None) -> Dataset:
    """Load the train and test splits of a TFDS image-classification data set into memory."""
    import tensorflow_datasets as tfds

    from nondet_jax.config import UsageError

    try:
        splits = {s: tfds.data_source(name, split=s, data_dir=data_dir, download=False) for s in ("train", "test")}
        (x_tr, y_tr), (x_te, y_te) = _read_split(splits["train"]), _read_split(splits["test"])
    except Exception as e:  # TFDS raises assorted types for "not there" / "wrong format"
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UsageError(f"dataset '{name}' is not available for random access in "
                         f"{data_dir or 'the TFDS default folder'} ({first}); {prepare_hint(name, data_dir)}") from None
    if len(x_tr) == 0 or len(x_te) == 0:
        raise UsageError(f"dataset '{name}' has an empty split in {data_dir}; {prepare_hint(name, data_dir)}")
    x_tr, x_te = standardize(x_tr, x_te)
    return Dataset(name, x_tr, y_tr, x_te, y_te, NUM_CLASSES[name])
