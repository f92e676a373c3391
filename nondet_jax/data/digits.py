"""The embedded default: scikit-learn's handwritten digits (1,797 real 8x8 grey images, 10 classes).

Ships inside scikit-learn, so nothing is downloaded. The split is fixed and stratified:
``train_test_split(test_size=360, stratify=y, random_state=0)`` gives 1,437 training and 360 test
images (35-37 per class in the test set, as the classes are 174-183 strong). Pixels (0..16) are standardised with the training mean/std.
"""

from __future__ import annotations

import numpy as np
from sklearn.datasets import load_digits as _sk_load_digits
from sklearn.model_selection import train_test_split

from nondet_jax.data import Dataset, standardize

TEST_SIZE = 360
SPLIT_SEED = 0


def load_digits() -> Dataset:
    """The digits data set with its fixed stratified split, as (N, 8, 8, 1) float32 images."""
    d = _sk_load_digits()
    x = d.images.astype(np.float32)[..., None]
    y = d.target.astype(np.int32)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=TEST_SIZE, stratify=y, random_state=SPLIT_SEED)
    x_tr, x_te = standardize(x_tr, x_te)
    return Dataset("digits", x_tr, y_tr, x_te, y_te, 10)
