"""Where each file of a run folder lives: the one place these paths are spelled.

A run folder is untrusted input (a shared disk, an archive, a colleague's results): every name read from
one (an arm in ``config.json``'s ``study.arms``, a file an arm record lists) passes the same grammar as the
command line here before it becomes part of a path (:func:`arm_name`, :meth:`RunPaths.record_file`), and
every path that deletes or replaces something is checked to stay inside the folder (:func:`contained`,
used by :func:`nondet_jax.store.io.guarded`, the one helper through which anything is deleted or replaced).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from nondet_jax.arms import parse_arm
from nondet_jax.errors import UsageError

# The long tables the report writes as <kind>.csv (nondet_jax.report.frames; instruments.csv is the study's).
TABLES = ("replicas", "curves", "best", "decomposition", "pairs")
ARM_FILES = ("arms/{}.json", "logits/{}.npy", "features/{}.npy", "history/{}.npz", "weights/{}.npz", "pairs/{}.npz")


MAX_ARM_NAME = 200  # bytes: an arm name is a file name (arms/<arm>.json), within every file system's 255


def arm_name(arm: object, where: str = "") -> str:
    """``arm`` checked against the arm grammar (:func:`nondet_jax.arms.parse_arm`, what ``--arms`` takes):
    the one gate every arm name passes before it is part of a path. Such a name holds only source names,
    ``+`` and ``@snapshotK``: never a ``/``, ``..`` or an absolute path. ``where`` names where a name read
    from a run folder came from (``<run>/config.json study.arms``); UsageError otherwise."""
    if isinstance(arm, str) and len(arm.encode()) <= MAX_ARM_NAME:
        try:
            parse_arm(arm)
            return arm
        except UsageError:
            if not where:
                raise
    elif not where:
        raise UsageError(f"arm name {str(arm)[:60]!r} is not an arm (control, all, a source or a '+'-joined "
                         "combination, at most 200 characters); name one of those")
    shown = repr(arm) if len(repr(arm)) <= 80 else repr(arm)[:77] + "..."
    raise UsageError(f"{where} names arm {shown}, which is not an arm name (control, all, a source, a '+'-joined "
                     "combination, @snapshotK): the folder was edited or was not written by nondet_jax, and nothing "
                     "in it was touched; restore it, or start a new study with another --out")


METHOD_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,63}")


def method_name(name: object, where: str = "") -> str:
    """``name`` checked as a method's name (a multi-method study's ``methods/<name>/`` folder): a letter, then
    up to 63 letters, digits, ``_`` or ``-``, so never a ``/``, ``..`` or an absolute path, the same gate for the
    command line, the API and a name read from a folder's ``methods.json`` (``where`` names that file);
    UsageError otherwise."""
    if isinstance(name, str) and METHOD_NAME.fullmatch(name):
        return name
    shown = repr(name) if len(repr(name)) <= 60 else repr(name)[:57] + "..."
    if where:
        raise UsageError(f"{where} names method {shown}, which is not a method name: the folder was edited or was "
                         "not written by nondet_jax, and nothing in it was touched; restore it, or start a new study "
                         "with another --out")
    raise UsageError(f"method name {shown} is not a name: start with a letter, then at most 63 letters, digits, _ or "
                     "-, e.g. base, smooth or lr_0p2")


def contained(root: str | Path, target: str | Path) -> Path:
    """``target``, checked to lie strictly inside the run folder ``root``: it is ``root`` joined with a
    relative path without ``..`` (an absolute name drops the prefix when joined), no folder on the way
    from ``root`` to it is a symbolic link, and its folder, resolved, is inside ``root`` resolved.
    UsageError naming both otherwise. Returns ``target`` as a Path."""
    root, target = Path(root), Path(target)
    base, full = Path(os.path.abspath(root)), Path(os.path.abspath(target))  # lexical: '..' is refused below
    try:
        rel = full.relative_to(base) if ".." not in target.parts else None
    except ValueError:
        rel = None
    why = None
    if rel is None or not rel.parts:
        why = "it is not a path below the folder"
    else:
        step = base
        for part in rel.parts[:-1]:
            step = step / part
            if step.is_symlink():
                why = f"{step} on the way is a symbolic link"
                break
        if why is None:
            real_root, real_parent = base.resolve(), full.parent.resolve()
            if real_parent != real_root and real_root not in real_parent.parents:
                why = f"its folder resolves to {real_parent}"
    if why is not None:
        raise UsageError(f"refusing to delete or replace {target}: {why}, outside the run folder {root}; nondet_jax "
                         "deletes and replaces files only inside the run folder (was it edited?), and nothing was "
                         "touched: restore the folder, or start a new study with another --out")
    return target


class RunPaths:
    """Where each file of a run folder lives: the one place these paths are spelled (the sweep
    writes through :class:`RunStore`, the report reads through this)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.config = self.root / "config.json"
        self.environment = self.root / "environment.json"
        self.model = self.root / "model.json"  # what was imported and its parameter-shape fingerprint
        self.test_labels = self.root / "test_labels.npy"
        self.command = self.root / "command.txt"
        self.summary = self.root / "summary.json"
        self.arms_csv = self.root / "arms.csv"
        self.report = self.root / "report.md"
        self.figures = self.root / "figures"
        self.instruments_csv = self.root / "instruments.csv"  # every arm's instruments: arm,replica,step,quantity,value
        self.methods_json = self.root / "methods.json"  # a multi-method study: its methods, baseline, base config
        self.methods_csv = self.root / "methods.csv"  # ... one row per method and arm, with the paired comparison

    def table(self, kind: str) -> Path:
        """The CSV of a long table (``curves``, ``best``, ``pairs``, ...; :mod:`nondet_jax.report.frames`):
        ``<kind>.csv`` at the folder's top level."""
        return self.root / f"{kind}.csv"

    def method(self, name: str) -> Path:
        """A multi-method study's method ``name``: an ordinary run folder, ``methods/<name>``."""
        return self.root / "methods" / method_name(name)

    def method_figure(self, name: str) -> Path:
        """The figure of method ``name`` against the baseline, ``figures/method-<name>.png``."""
        return self.figures / f"method-{method_name(name)}.png"

    @staticmethod
    def rel(kind: str, arm: str, ext: str | None = None) -> str:
        """``'logits', 'init'`` -> ``'logits/init.npy'``: the path of an arm's file inside the folder (the
        arm name checked by :func:`arm_name`)."""
        return f"{kind}/{arm_name(arm)}{ext or ARM_EXT[kind]}"

    def arm_file(self, kind: str, arm: str, ext: str | None = None) -> Path:
        """An arm's file of ``kind`` (``arms``, ``logits``, ``pairs``, ``tta``, ...; see :data:`ARM_EXT`)."""
        return self.root / self.rel(kind, arm, ext)

    def listed_file(self, kind: str, arm: str, record: dict, ext: str | None = None) -> Path | None:
        """An arm's file of ``kind`` if its ``record`` lists it (the files a record lists are checked against their
        sha256 before a report reads them), else None: a file planted beside the arm's own (a ``tta/<arm>.npz``
        in a study without test-time augmentation) is never read, never a row of invented numbers."""
        rel = self.rel(kind, arm, ext)
        files = record.get("files") if isinstance(record, dict) else None
        return self.root / rel if isinstance(files, dict) and rel in files else None

    def checkpoints(self, arm: str) -> Path:
        return self.root / "checkpoints" / arm_name(arm)

    def parts(self, arm: str | None = None) -> Path:
        """Blocks of an arm's replicas trained apart, before they are merged (:mod:`nondet_jax.study.parts`)."""
        return self.root / "parts" if arm is None else self.root / "parts" / arm_name(arm)

    def part(self, arm: str, index: int, ext: str = ".npz") -> Path:
        """Process (or replica) ``index``'s part of ``arm`` in a multi-process run: ``parts/<arm>/<index><ext>``."""
        return self.parts(arm) / f"{int(index)}{ext}"

    def tensorboard(self, arm: str | None = None) -> Path:
        """TensorBoard event files (derived, rebuilt from the stored results): ``tensorboard/<arm>``."""
        return self.root / "tensorboard" if arm is None else self.root / "tensorboard" / arm_name(arm)

    def record_file(self, arm: str, rel: object, record: Path) -> Path:
        """A file that arm ``arm``'s record (``record``) lists, checked to be one the store writes for that
        arm (:func:`record_files`), so a planted record cannot point outside the folder, or anywhere else
        in it; UsageError naming the record and ``--recompute ARM`` otherwise."""
        if not isinstance(rel, str) or rel not in record_files(arm):
            shown = repr(rel) if len(repr(rel)) <= 80 else repr(rel)[:77] + "..."
            raise UsageError(f"result file {record} lists {shown}, which is not one of arm '{arm}''s files; rerun "
                             f"with --recompute {arm} to train arm '{arm}' again")
        return self.root / rel


# The extension of each kind of per-arm file.
ARM_EXT = {"arms": ".json", "logits": ".npy", "features": ".npy", "history": ".npz", "weights": ".npz",
           "pairs": ".npz", "dynamics": ".npz", "environments": ".json", "instruments": ".npz", "tta": ".npz",
           "snapshots": ".npy"}


TEST_LABELS = "test_labels.npy"  # listed by every arm record, as its files are


def record_files(arm: str) -> set[str]:
    """Every file name an arm record may list: the arm's own files (:data:`ARM_EXT`, and the instruments'
    CSV) and the test labels."""
    arm = arm_name(arm)
    return {TEST_LABELS, RunPaths.rel("instruments", arm, ".csv"), *(RunPaths.rel(k, arm) for k in ARM_EXT)}
