"""The run folder as a study writes it: the lock, the config check on resume, arms' records."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import stat
from pathlib import Path
from typing import Any

import numpy as np

from nondet_jax.config import Config, comparable_data_name, to_dict
from nondet_jax.errors import UsageError
from nondet_jax.store.io import (
    TEMP_GLOB,
    atomic_write_bytes,
    atomic_write_json,
    check_no_links,
    check_path_name,
    check_writable_file,
    guarded,
    not_numbers,
    npy_bytes,
    npz_bytes,
    real_number,
)
from nondet_jax.store.paths import ARM_EXT, TABLES, TEST_LABELS, RunPaths, arm_name, record_files

LOCK = ".lock"


# Keys a folder's results do not depend on: arms may be added (each arm is stored on its own), the
# checkpoint interval and cadence only decide how much a crash costs, the replica threads how fast the sequential
# strategy trains (bitwise the same results), and the power ratios are read by the report.
RESULT_NEUTRAL = {("study", "arms"), ("train", "checkpoint_every"), ("train", "checkpoint_seconds"),
                  ("train", "replica_threads"), ("metrics", "power_ratios")}
# Not metrics.decomposition, though only the report reads it: it was in every arm record's config digest before
# the power ratios were left out, so leaving it out now would make every earlier folder's records look edited.


# Keys added after run folders existed, with the value that means what a folder without them meant: at that
# value they are left out, so an older folder is the same study (and keeps its digests).
ADDED_KEYS = {("train", "epoch_shape"): "auto"}


def _comparable(config: dict) -> dict:
    """A config's results-relevant form: :data:`RESULT_NEUTRAL` keys left out, :data:`ADDED_KEYS` left out at
    their default, a ``.npz`` path replaced by :data:`nondet_jax.config.NPZ_BY_CONTENT` (its bytes are part of
    the study's identity)."""
    kept = {s: {k: v for k, v in sec.items() if (s, k) not in RESULT_NEUTRAL
                and not ((s, k) in ADDED_KEYS and v == ADDED_KEYS[s, k])}
            for s, sec in config.items() if isinstance(sec, dict)}
    if isinstance(kept.get("data"), dict) and "name" in kept["data"]:
        kept["data"]["name"] = comparable_data_name(kept["data"]["name"])
    return kept


def _config_diff(a: dict, b: dict) -> list[str]:
    a, b = _comparable(a), _comparable(b)
    out = []
    for section in sorted(set(a) | set(b)):
        for key in sorted(set(a.get(section, {})) | set(b.get(section, {}))):
            if (section, key) in RESULT_NEUTRAL:
                continue
            va, vb = a.get(section, {}).get(key), b.get(section, {}).get(key)
            if va != vb:
                out.append(f"{section}.{key} {va!r} vs {vb!r}")
    return out


def different_config(root: Path, diff: list[str]) -> UsageError:
    """The refusal of a run folder whose config differs from this study's in ``diff`` (:func:`_config_diff`); a
    folder whose first run stopped before any arm finished or saved a checkpoint or a part is said to hold nothing
    trained."""
    if not any(p.is_file() for p in (root / "arms").glob("*.json")) and \
            not any(any((root / kind).glob("*/*")) for kind in ("checkpoints", "parts")):
        return UsageError(f"--out {root} was started with a different config ({'; '.join(diff[:3])}) and holds "
                          "nothing trained yet; delete it, choose another --out, or rerun with the same settings")
    return UsageError(f"--out {root} holds results of a different config ({'; '.join(diff[:3])}); choose another "
                      "--out or rerun with the same settings")


def config_changes(root: Path, config: dict) -> list[str]:
    """What differs between the folder's ``config.json`` and ``config`` (a :func:`~nondet_jax.config.to_dict`), the
    replicas aside (a study may grow); none where the folder has no readable config."""
    try:
        old = read_config(RunPaths(root).config)
    except UsageError:
        return []
    return [d for d in _config_diff(old, config) if not d.startswith("study.replicas ")]


def config_digest(config: dict) -> str:
    """sha256 of a config's results-relevant form (:func:`_comparable`)."""
    return hashlib.sha256(json.dumps(_comparable(config), sort_keys=True).encode()).hexdigest()


def record_digest(record: dict) -> str:
    """sha256 of an arm record without its own ``record_sha256`` entry."""
    body = {k: v for k, v in record.items() if k != "record_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def read_arm_record(root: Path, arm: str) -> dict:
    """``arms/<arm>.json``, parsed and checked to be an arm record that nobody edited (its own
    sha256 matches). UsageError naming the file and ``--recompute ARM`` otherwise."""
    path = RunPaths(root).arm_file("arms", arm)
    fix = f"rerun with --recompute {arm} to train arm '{arm}' again"
    try:
        record = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        raise UsageError(f"result file {path} is unreadable or corrupt; {fix}") from None
    if not isinstance(record, dict) or not isinstance(record.get("rows"), list) or \
            not isinstance(record.get("files"), dict) or not isinstance(record.get("metrics"), dict):
        raise UsageError(f"result file {path} is not an arm record (it needs rows, files and metrics); {fix}")
    if "record_sha256" not in record:
        raise UsageError(f"result file {path} carries no checksum (written by an older nondet_jax, or edited); {fix}")
    if record.get("record_sha256") != record_digest(record):
        raise UsageError(f"result file {path} was changed after it was written (its sha256 does not match); {fix}")
    if not _well_formed(record):  # a checksum anyone can recompute: the form is checked too
        raise UsageError(f"result file {path} is not an arm record (its rows, metrics or diverged replicas are not "
                         f"in their form); {fix}")
    return record


def _well_formed(record: dict) -> bool:
    """An arm record's parts in the form the report reads: rows one table per replica of numbers (its arm and
    strategy named by text), the varied sources text, replicas a count, each metric a table of statistics or one
    number, each diverged replica a table with its replica and step, files named by text."""
    def count(v):
        return isinstance(v, int) and not isinstance(v, bool)

    def cell(k, v):  # a row's scores are numbers (NaN where a replica diverged); its names are text
        return isinstance(v, str) if k in ("arm", "strategy") else v is None or real_number(v)

    diverged, varied = record.get("diverged", []), record.get("varied", [])
    return (all(isinstance(r, dict) and count(r.get("replica")) and all(cell(k, v) for k, v in r.items())
                for r in record["rows"])
            and isinstance(varied, list) and all(isinstance(v, str) for v in varied)
            and count(record.get("replicas", 0))
            and all(isinstance(k, str) and (v is None or isinstance(v, (dict, int, float)) and not isinstance(v, bool))
                    for k, v in record["metrics"].items())
            and isinstance(diverged, list)
            and all(isinstance(d, dict) and count(d.get("replica")) and count(d.get("step")) for d in diverged)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in record["files"].items()))


def verify_arm_files(root: Path, arm: str, record: dict, identity: str = "") -> dict:
    """Check every file an arm's record lists against its sha256, ``config.json`` against the
    config the arm was trained with and, given the study's ``identity``, that the arm was trained in
    this study; UsageError naming the file and the fix when one is missing, truncated or altered.
    Returns the record."""
    root = Path(root)
    paths = RunPaths(root)
    if identity and record.get("identity_sha256") != identity:
        raise UsageError(f"arm '{arm}' in {root} was trained by another study (its parts' fingerprints differ from "
                         f"this one's); rerun with --recompute {arm} to train it again here, or choose another --out")
    listed = record.get("files", {})
    for rel in listed:  # every name checked before any file is opened: a planted record names no other file
        paths.record_file(arm, rel, paths.arm_file("arms", arm))
    for rel, digest in listed.items():
        path = root / rel
        missing = False
        try:
            if not path.is_file():  # a folder or FIFO where the file was: never opened (a FIFO would block)
                os.lstat(path)  # FileNotFoundError when absent
                ok = False
            else:
                data = path.read_bytes()
                ok = hashlib.sha256(data).hexdigest() == digest
                bad = not_numbers(data, rel) if ok else None
                if bad:  # its digest recomputed by hand (anyone can): the form is checked too, before any write
                    raise UsageError(f"result file {path} is not in its form ({bad}); rerun the sweep with "
                                     f"--recompute {arm} to train arm '{arm}' again")
        except FileNotFoundError:
            ok, missing = rel == TEST_LABELS, True  # the labels: rewritten from the data set by the next sweep
        except OSError:
            ok = False
        if not ok and rel == TEST_LABELS:
            raise UsageError(f"{path} is not the labels arm '{arm}' was evaluated on (sha256 mismatch); delete it "
                             "and rerun the same sweep command, which writes it again from the data set")
        if not ok:
            what = "is missing" if missing else "is truncated or corrupt (sha256 mismatch)"
            raise UsageError(f"result file {path} {what}; rerun the sweep with --recompute {arm} to train arm "
                             f"'{arm}' again")
    try:
        current = config_digest(json.loads(RunPaths(root).config.read_text()))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        current = None
    if current != record.get("config_sha256"):
        raise UsageError(f"{RunPaths(root).config} does not hold the config arm '{arm}' was trained with (edited after "
                         f"the run?); restore it, or start a new study with another --out")
    return record


def take_lock(root: Path, fix: str = "wait for it to finish or choose another --out") -> int:
    """Take the run folder's exclusive lock (``.lock``, holding the pid for the message) and return its
    descriptor; a :class:`UsageError` naming the holder when another process has it. ``flock`` dies with
    its process, so a killed sweep leaves no stale lock. Sweeps and ``report`` take it, so a report is
    never built from a folder a sweep is still writing."""
    try:  # less the umask, as any file; O_NONBLOCK: a FIFO there must not block the open
        fd = os.open(root / LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o666)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UsageError(f"{root / LOCK} is a symbolic link, which nondet_jax never follows in a run folder; "
                             "remove it") from None
        if e.errno == errno.EISDIR:
            raise UsageError(f"{root / LOCK} is a folder, where nondet_jax keeps the run folder's lock file; remove "
                             "it and rerun the same command") from None
        raise UsageError(f"cannot write to {root}: {e.strerror}; choose a writable folder") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UsageError(f"{root / LOCK} is a FIFO, device or socket, where nondet_jax keeps the run folder's lock "
                         "file; remove it and rerun the same command")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip()
        os.close(fd)
        raise UsageError(f"results folder {root} is in use by another sweep (pid {holder or 'unknown'}); {fix}") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def release_lock(fd: int) -> None:
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


def read_config(cfg_path: Path) -> dict:
    """A run folder's ``config.json`` as a dict whose ``study.arms`` is a list; UsageError otherwise (a
    FIFO or folder in its place is refused, never opened)."""
    try:
        if not cfg_path.is_file():
            raise ValueError("not a file")
        old = json.loads(cfg_path.read_text())
        if not isinstance(old, dict) or not isinstance(old.get("study", {}).get("arms"), list):
            raise ValueError("not a config")
    except (OSError, ValueError, AttributeError):  # JSONDecodeError, UnicodeDecodeError are ValueErrors
        raise UsageError(f"{cfg_path} is unreadable or corrupt; delete the folder {cfg_path.parent} "
                         "or choose another --out") from None
    return old


# The folders a study writes into (a file in place of one used to end in a traceback after other writes).
FOLDERS = (*ARM_EXT, "figures", "checkpoints", "parts", "tensorboard")


def check_layout(root: Path, arms: list[str]) -> None:
    """Before anything in a run folder is written: every file a study or its report replaces is absent
    or a regular file (not a folder, FIFO, device or link), every folder it writes into is absent or a
    folder, and nothing named like a temporary file is anything but a file. A folder where
    ``replicas.csv`` goes used to end in a traceback after ``command.txt`` and ``environment.json`` had
    been rewritten; ``arms`` as a file, in retraining every arm. ``arms``: checked names."""
    paths = RunPaths(root)
    for kind in FOLDERS:
        folder = root / kind
        if (folder.exists() or folder.is_symlink()) and not folder.is_dir():
            raise UsageError(f"{folder} is a file, where nondet_jax keeps a folder; move it away and rerun the same "
                             "command")
    files = [paths.config, paths.environment, paths.model, paths.test_labels, paths.command, paths.summary,
             paths.arms_csv, paths.report, paths.instruments_csv,
             *(paths.table(kind) for kind in TABLES)]
    for arm in arms:
        files += [root / rel for rel in sorted(record_files(arm) - {TEST_LABELS})]
        files.append(root / RunPaths.rel("environments", arm, ".processes.json"))
    if paths.figures.is_dir():
        files += sorted(p for p in paths.figures.iterdir() if p.suffix == ".png")
    files += sorted(root.rglob(TEMP_GLOB))
    for path in files:
        check_writable_file(path)


def _leftover(path: Path) -> bool:
    """A temporary file of :func:`nondet_jax.store.io.atomic_write_bytes`, left by a process killed
    mid-write (e.g. during the very first ``config.json``): never a result."""
    return path.is_file() and path.match(TEMP_GLOB)


class RunStore:
    """An open run folder. Use as a context manager: it holds the folder's lock while open."""

    def __init__(self, out: str | Path, config: Config, locked_by_parent: bool = False,
                 recompute: tuple[str, ...] = (), identity: str = "", grow: bool = False):
        self.root = Path(out)
        self.identity = identity  # the study's identity_sha256: stored with every arm, checked on reuse
        self.paths = RunPaths(out)
        self.arms: list[str] = list(config.study.arms)  # after open: every arm of the folder, earlier ones first
        self.recompute = recompute  # arms about to be deleted: not verified on open
        self.config = config
        self.locked_by_parent = locked_by_parent  # a child process writing under its parent's lock
        # A sequential study's next look: study.replicas may grow, and an arm with fewer replicas is unfinished
        # (its record removed; the blocks it was merged from stay, see nondet_jax.study.parts).
        self.grow = grow
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
        check_path_name(root, "--out")
        if root.is_symlink() and not root.exists():  # mkdir used to say "File exists"
            raise UsageError(f"--out {root} is a symbolic link to {os.readlink(root)}, which does not exist; create "
                             "that folder, or choose another --out")
        if root.exists() and not root.is_dir():
            raise UsageError(f"--out {root} is a file, not a folder; choose another --out")
        cfg_path = RunPaths(root).config
        if root.exists() and not cfg_path.exists() and any(p.name != LOCK and not _leftover(p) for p in root.iterdir()):
            if RunPaths(root).methods_json.is_file():
                raise UsageError(f"--out {root} holds a study of methods (methods.json); continue it with the --method "
                                 "flags that started it, or choose a new or empty --out for this study")
            raise UsageError(f"--out {root} exists and is not a nondet_jax run folder; choose a new or empty --out")
        check_no_links(root)
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UsageError(f"cannot write to --out {root}: {e.strerror}; choose a writable folder") from None
        self._lock_fd = take_lock(root)
        try:
            new = to_dict(self.config)
            old = read_config(cfg_path) if cfg_path.exists() else None
            # Every name the folder gives is checked before anything in it is deleted or written.
            old_arms = [arm_name(a, f"{cfg_path} study.arms") for a in old["study"]["arms"]] if old else []
            check_layout(root, list(dict.fromkeys(old_arms + list(new["study"]["arms"]))))
            for tmp in root.rglob(TEMP_GLOB):  # left by a process killed mid-write; never a result
                guarded("unlink", root, tmp)
            if old is not None:
                diff = _config_diff(old, new)
                if self.grow and old.get("study", {}).get("replicas", 0) <= new["study"]["replicas"]:
                    diff = [d for d in diff if not d.startswith("study.replicas ")]
                if diff:
                    raise different_config(root, diff)
                new["study"]["arms"] = list(dict.fromkeys(old_arms + new["study"]["arms"]))
                self.arms = new["study"]["arms"]
                finished = []
                for arm in old_arms:  # damaged results stop the run before anything is written
                    if self.grow and self.arm_done(arm) and arm not in self.recompute and \
                            self.load_arm(arm).get("replicas") != new["study"]["replicas"]:
                        guarded("unlink", root, self.paths.arm_file("arms", arm))  # grown from its parts next
                    if self.arm_done(arm) and arm not in self.recompute:
                        self.verify_arm(arm)
                        finished.append(arm)
                    elif arm not in self.recompute and self.paths.checkpoints(arm).is_dir():
                        from nondet_jax.store.checkpoint import (
                            CorruptCheckpoint,
                            verify_latest,
                        )

                        try:
                            verify_latest(self.paths.checkpoints(arm),
                                          {"identity_sha256": self.identity} if self.identity else None)
                        except CorruptCheckpoint as e:
                            raise UsageError(f"{e}; rerun with --recompute {arm} to train arm '{arm}' again from "
                                             "scratch") from None
            else:
                finished = []
            atomic_write_json(cfg_path, new, root=root)
            for arm in finished:  # left behind by a kill between an arm's record and their deletion
                self.remove_checkpoints(arm)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self._lock_fd is not None:
            release_lock(self._lock_fd)
            self._lock_fd = None

    # --- arms -------------------------------------------------------------------------------
    def arm_done(self, arm: str) -> bool:
        """True when the arm's JSON record, written last, is present (see :meth:`verify_arm`)."""
        return self.paths.arm_file("arms", arm).exists()

    def load_arm(self, arm: str) -> dict:
        """The arm's record, checked to be unedited (see :func:`read_arm_record`)."""
        return read_arm_record(self.root, arm)

    def verify_arm(self, arm: str) -> dict:
        """The arm's record, its files checked (see :func:`verify_arm_files`)."""
        return verify_arm_files(self.root, arm, self.load_arm(arm), self.identity)

    def remove_arm(self, arm: str) -> None:
        """Delete an arm's results and checkpoints (its record first, so it never looks finished)."""
        guarded("unlink", self.root, self.paths.arm_file("arms", arm))
        for rel in sorted(record_files(arm) - {TEST_LABELS, RunPaths.rel("arms", arm)}) + \
                [RunPaths.rel("environments", arm, ".processes.json")]:
            guarded("unlink", self.root, self.root / rel)
        self.remove_checkpoints(arm)
        guarded("rmtree", self.root, self.paths.parts(arm))  # per-process parts of an interrupted arm

    def remove_checkpoints(self, arm: str) -> None:
        """Delete an arm's checkpoints (once its results are stored, or to retrain it)."""
        guarded("rmtree", self.root, self.paths.checkpoints(arm))

    def save_arm(self, arm: str, record: dict, logits: np.ndarray, features: np.ndarray,
                 history: dict[str, np.ndarray], weights: dict[str, np.ndarray], pairs: dict[str, np.ndarray],
                 dynamics: dict[str, np.ndarray] | None = None, extra: dict[str, bytes] | None = None) -> None:
        """Write an arm's arrays, then its JSON record (the marker that the arm is finished), which
        lists every file's sha256. ``extra`` maps further relative paths to their bytes."""
        at = RunPaths.rel
        files = {at("logits", arm): npy_bytes(logits), at("features", arm): npy_bytes(features),
                 at("history", arm): npz_bytes(history), at("weights", arm): npz_bytes(weights),
                 at("pairs", arm): npz_bytes(pairs), **(extra or {})}
        if dynamics is not None:
            files[at("dynamics", arm)] = npz_bytes(dynamics)
        for rel, data in files.items():
            atomic_write_bytes(self.paths.record_file(arm, rel, self.paths.arm_file("arms", arm)), data, root=self.root)
        digests = {rel: hashlib.sha256(data).hexdigest() for rel, data in files.items()}
        labels = self.paths.test_labels  # the report reads it: covered like the arm's own files
        if labels.is_file():
            digests[TEST_LABELS] = hashlib.sha256(labels.read_bytes()).hexdigest()
        record = json.loads(json.dumps({**record, "files": digests, "config_sha256": config_digest(to_dict(self.config)),
                                        "identity_sha256": self.identity}))
        record["record_sha256"] = record_digest(record)  # over the JSON form, as read back
        atomic_write_json(self.paths.arm_file("arms", arm), record, root=self.root)

    def write_json(self, name: str, obj: Any) -> None:
        atomic_write_json(self.root / name, obj, root=self.root)
