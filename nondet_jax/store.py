"""The run folder (DESIGN.md §7): atomic writes, a lock against concurrent sweeps, resume.

Layout::

    <out>/config.json        the resolved configuration (a folder holds one configuration)
    <out>/environment.json   versions, backend, devices, flags, PRNG settings, strategies
    <out>/replicas.csv       one row per (arm, replica)
    <out>/summary.json       per-arm aggregates
    <out>/arms/<arm>.json    an arm's rows and aggregates: its presence marks the arm finished
    <out>/logits/<arm>.npy   (R, n_test, classes) test logits in replica order
    <out>/features/<arm>.npy (R, n_test, features) penultimate features
    <out>/history/<arm>.npz  per-epoch training loss and accuracy (R, epochs), and the pairwise
                             weight distance at init and after each epoch (epochs + 1, pairs)
    <out>/weights/<arm>.npz  final parameters and BatchNorm statistics, leading axis R
    <out>/pairs/<arm>.npz    per-replica accuracy and cross-entropy, per-pair metrics, LMC curves
    <out>/dynamics/<arm>.npz replicas 0 and 1 traced every k steps (study.dynamics_every > 0)
    <out>/environments/<arm>.json  the environment of an arm trained in a child process
    <out>/arms.csv, report.md, figures/   written by nondet_jax.report from the files above
"""

from __future__ import annotations

import csv
import fcntl
import io
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from flax import traverse_util

from nondet_jax.config import Config, UsageError, to_dict

LOCK = ".lock"
ARM_FILES = ("arms/{}.json", "logits/{}.npy", "features/{}.npy", "history/{}.npz", "weights/{}.npz", "pairs/{}.npz")


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename: never half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode())


def atomic_save_npy(path: Path, array: np.ndarray) -> None:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    atomic_write_bytes(path, buf.getvalue())


def atomic_save_npz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    atomic_write_bytes(path, buf.getvalue())


def flatten_tree(tree: Any) -> dict[str, np.ndarray]:
    """A nested dict of arrays as {'a/b/c': array} (the key format of ``weights/<arm>.npz``)."""
    return {"/".join(k): np.asarray(v) for k, v in traverse_util.flatten_dict(tree).items()}


def _config_diff(a: dict, b: dict) -> list[str]:
    out = []
    for section in sorted(set(a) | set(b)):
        for key in sorted(set(a.get(section, {})) | set(b.get(section, {}))):
            if section == "study" and key == "arms":
                continue  # arms may be added to a folder; each arm is stored on its own
            va, vb = a.get(section, {}).get(key), b.get(section, {}).get(key)
            if va != vb:
                out.append(f"{section}.{key} {va!r} vs {vb!r}")
    return out


class RunStore:
    """An open run folder. Use as a context manager: it holds the folder's lock while open."""

    def __init__(self, out: str | Path, config: Config, locked_by_parent: bool = False):
        self.root = Path(out)
        self.config = config
        self.locked_by_parent = locked_by_parent  # a child process writing under its parent's lock
        self._lock_fd: int | None = None

    def __enter__(self) -> "RunStore":
        self.open()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def open(self) -> None:
        """Check the folder can take this config, take the lock, write ``config.json``."""
        root = self.root
        if self.locked_by_parent:
            return
        if root.exists() and not root.is_dir():
            raise UsageError(f"--out {root} is a file, not a folder; choose another --out")
        cfg_path = root / "config.json"
        if root.exists() and not cfg_path.exists() and any(p.name != LOCK for p in root.iterdir()):
            raise UsageError(f"--out {root} exists and is not a nondet_jax run folder; choose a new or empty --out")
        try:
            root.mkdir(parents=True, exist_ok=True)
            fd = os.open(root / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise UsageError(f"cannot write to --out {root}: {e.strerror}; choose a writable folder") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip()
            os.close(fd)
            raise UsageError(f"results folder {root} is in use by another sweep (pid {holder or 'unknown'}); wait for "
                             "it to finish or choose another --out") from None
        # flock dies with its process, so a killed sweep leaves no stale lock; the pid is for the message.
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd
        try:
            new = to_dict(self.config)
            if cfg_path.exists():
                try:
                    old = json.loads(cfg_path.read_text())
                except (OSError, json.JSONDecodeError):
                    raise UsageError(f"{cfg_path} is unreadable or corrupt; delete the folder {root} "
                                     "or choose another --out") from None
                diff = _config_diff(old, new)
                if diff:
                    raise UsageError(f"--out {root} holds results of a different config ({'; '.join(diff[:3])}); "
                                     "choose another --out or rerun with the same settings")
                new["study"]["arms"] = list(dict.fromkeys(old["study"]["arms"] + new["study"]["arms"]))
            atomic_write_json(cfg_path, new)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self._lock_fd is not None:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)
            self._lock_fd = None

    # --- arms -------------------------------------------------------------------------------
    def arm_done(self, arm: str) -> bool:
        """True when every file of the arm is present (its JSON marker is written last)."""
        return all((self.root / f.format(arm)).exists() for f in ARM_FILES)

    def load_arm(self, arm: str) -> dict:
        return json.loads((self.root / f"arms/{arm}.json").read_text())

    def save_arm(self, arm: str, record: dict, logits: np.ndarray, features: np.ndarray,
                 history: dict[str, np.ndarray], weights: dict[str, np.ndarray], pairs: dict[str, np.ndarray],
                 dynamics: dict[str, np.ndarray] | None = None) -> None:
        """Write an arm's arrays, then its JSON record (the marker that the arm is finished)."""
        if dynamics is not None:
            atomic_save_npz(self.root / f"dynamics/{arm}.npz", dynamics)
        atomic_save_npy(self.root / f"logits/{arm}.npy", logits)
        atomic_save_npy(self.root / f"features/{arm}.npy", features)
        atomic_save_npz(self.root / f"history/{arm}.npz", history)
        atomic_save_npz(self.root / f"weights/{arm}.npz", weights)
        atomic_save_npz(self.root / f"pairs/{arm}.npz", pairs)
        atomic_write_json(self.root / f"arms/{arm}.json", record)

    def write_json(self, name: str, obj: Any) -> None:
        atomic_write_json(self.root / name, obj)

    def write_rows(self, rows: list[dict]) -> None:
        """Write ``replicas.csv`` (one row per arm and replica) atomically."""
        if not rows:
            return
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=list(rows[0]), lineterminator="\n")
        w.writeheader()
        w.writerows(rows)
        atomic_write_bytes(self.root / "replicas.csv", buf.getvalue().encode())
