"""TensorBoard event files from a run folder: one run per replica, so replicas overlay.

``python -m nondet_jax.report RUN_DIR --tensorboard`` (or ``--log tensorboard`` on the sweep, after each
arm) writes ``RUN_DIR/tensorboard/<arm>/replica<r>/`` with, per replica:

* ``train/loss`` and ``train/accuracy`` per epoch (x axis: epoch);
* ``train/step_loss`` per step (x axis: global step);
* ``test/accuracy`` and ``test/loss`` at the last epoch (at every evaluated epoch with ``study.eval_every``);
* every scalar instrument at its tracked steps (``instruments/<Quantity>``), with ``--instruments``.

View them with ``tensorboard --logdir RUN_DIR/tensorboard``. The writer is tensorboardX (no
TensorFlow needed): ``pip install "nondet_jax[tensorboard]"``. Event files are derived data: they
are rewritten from the stored results each time and are not part of the run's checksums.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from nondet_jax.analysis.metrics import accuracy, cross_entropy, regression_errors
from nondet_jax.errors import UsageError
from nondet_jax.store.io import guarded, read_arrays
from nondet_jax.store.paths import RunPaths
from nondet_jax.store.run import read_arm_record

FOLDER = "tensorboard"


def writer_class():
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        raise UsageError("TensorBoard logging needs tensorboardX; install it with "
                         "pip install \"nondet_jax[tensorboard]\" (or pip install tensorboardX)") from None
    return SummaryWriter


def arm_scalars(run: Path, arm: str) -> list[dict[str, list[tuple[int, float]]]]:
    """Per replica, tag -> [(step, value), ...] from the arm's stored history, logits and instruments."""
    paths = RunPaths(run)  # the store owns the run folder's layout
    hist = read_arrays(paths.arm_file("history", arm))
    logits = read_arrays(paths.arm_file("logits", arm))
    labels = read_arrays(paths.test_labels)
    regression = np.issubdtype(labels.dtype, np.floating)  # a regression's targets (classes are integers)
    if regression:
        acc, nll = regression_errors(logits, labels)  # test MSE, MAE
    else:
        acc, nll = accuracy(logits, labels), cross_entropy(logits, labels)
    inst_path = paths.listed_file("instruments", arm, read_arm_record(run, arm))  # a planted file: never read
    inst = read_arrays(inst_path) if inst_path is not None else {}
    epochs = hist["train_loss"].shape[1]
    out = []
    for r in range(len(logits)):
        tags: dict[str, list[tuple[int, float]]] = {
            "train/loss": [(e + 1, float(v)) for e, v in enumerate(hist["train_loss"][r])],
            "train/mae" if regression else "train/accuracy":
                [(e + 1, float(v)) for e, v in enumerate(hist["train_accuracy"][r])],
            "test/mse" if regression else "test/accuracy": [(epochs, float(acc[r]))],
            "test/mae" if regression else "test/loss": [(epochs, float(nll[r]))],
        }
        if "test_epochs" in hist:  # study.eval_every: the test curve at every evaluated epoch
            names = ("test_mse", "test_mae") if regression else ("test_accuracy", "test_loss")
            for key, tag in zip(names, ("test/mse", "test/mae") if regression else ("test/accuracy", "test/loss")):
                tags[tag] = [(int(e), float(v)) for e, v in zip(hist["test_epochs"], hist[key][r])]
        if "step_loss" in hist:
            tags["train/step_loss"] = [(t, float(v)) for t, v in enumerate(np.ravel(hist["step_loss"][r]))]
        for name, values in inst.items():
            if name in ("step", "lr", "loss", "accuracy") or values.ndim != 2:
                continue  # scalar quantities only: (R, T); histograms stay in the npz
            tags[f"instruments/{name}"] = [(int(t), float(v)) for t, v in zip(inst["step"], values[r])
                                           if np.isfinite(v)]
        out.append(tags)
    return out


def export_arm(run: str | Path, arm: str) -> Path:
    """Write (anew) the event files of one finished arm; returns its folder."""
    writer_cls = writer_class()
    run = Path(run)
    folder = RunPaths(run).tensorboard(arm)  # the arm's name checked: it may come from the folder
    guarded("rmtree", run, folder)
    for r, tags in enumerate(arm_scalars(run, arm)):
        with writer_cls(str(folder / f"replica{r}")) as w:
            for tag, points in tags.items():
                for step, value in points:
                    w.add_scalar(tag, value, step)
    return folder


def export_run(run: str | Path, arms: list[str]) -> Path:
    """Event files for every arm in ``arms``; returns ``RUN/tensorboard``."""
    for arm in arms:
        export_arm(run, arm)
    return RunPaths(run).tensorboard()
