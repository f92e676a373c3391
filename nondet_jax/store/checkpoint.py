"""Per-arm training checkpoints at epoch boundaries, with orbax-checkpoint.

A checkpoint holds what :class:`nondet_jax.replicas.loop.EpochState` holds: the stacked training state of
every replica (parameters, BatchNorm statistics, optimiser state, divergence Health), the per-step
training metrics and weight distances so far, and the number of finished epochs. Random-number
positions need no state of their own: every draw is ``fold_in(replica key, global step)``
(the key rule in docs/metrics.md), so the epoch count *is* the position; the replica keys' fingerprint is stored and
checked on restore.

Layout, under ``<run>/checkpoints/<arm>/``::

    orbax/<epoch>/        orbax's atomic step folder (written to a temporary name, then renamed)
    sha256/<epoch>.json   a manifest of every file in that step folder, written after it

A step folder without its manifest was interrupted between the two writes and is discarded; one
whose files do not match its manifest is corrupt, and restoring it raises
:class:`CorruptCheckpoint` (the CLI turns it into a one-line error naming ``--recompute ARM``).
No pickles: orbax stores arrays with tensorstore and metadata as JSON.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import logging
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import jax
import numpy as np

from nondet_jax.errors import UsageError
from nondet_jax.store.io import DENIED, FULL, atomic_write_json, guarded, write_error

logging.getLogger("absl").setLevel(logging.WARNING)  # orbax logs every save at INFO


class CorruptCheckpoint(RuntimeError):
    """A checkpoint whose files do not match the manifest written when it was saved."""


def key_fingerprint(keys) -> str:
    """sha256 of the raw key data of a ReplicaKeys tree (typed keys are unwrapped)."""
    h = hashlib.sha256()
    for k in jax.tree.leaves(keys):
        data = jax.random.key_data(k) if jax.dtypes.issubdtype(k.dtype, jax.dtypes.prng_key) else k
        h.update(np.asarray(data).tobytes())
    return h.hexdigest()


def _manifest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def verify_step(root: Path, epoch: int) -> None:
    """Raise CorruptCheckpoint unless the files of step ``epoch`` match its sha256 manifest."""
    folder = Path(root) / "orbax" / str(epoch)
    try:
        expected = json.loads((Path(root) / "sha256" / f"{epoch}.json").read_text())
    except (OSError, ValueError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CorruptCheckpoint(f"checkpoint {folder} has an unreadable sha256 manifest") from None
    if not isinstance(expected, dict):
        raise CorruptCheckpoint(f"checkpoint {folder} has a sha256 manifest that is not a table of files")
    actual = _manifest(folder)
    if actual != expected:
        bad = sorted(k for k in set(expected) | set(actual) if expected.get(k) != actual.get(k))
        raise CorruptCheckpoint(f"checkpoint {folder} is corrupt ({bad[0]} does not match its sha256 manifest)")


def check_folders(root: Path) -> None:
    """Refuse an arm's checkpoint folder whose ``orbax`` or ``sha256`` is there but not a folder: with a file for
    ``sha256`` every step looked unfinished and was deleted before anything was refused (an outside review)."""
    for name in ("orbax", "sha256"):
        path = Path(root) / name
        if (path.exists() or path.is_symlink()) and (path.is_symlink() or not path.is_dir()):
            raise CorruptCheckpoint(f"checkpoint folder {root} holds {name} as something other than a folder")


def verify_latest(root: Path, expect: dict | None = None) -> None:
    """Check the newest step of an arm's checkpoint folder that has a manifest (no orbax needed) and,
    given ``expect``, that its JSON meta holds those values (e.g. the study's identity): a checkpoint
    of another study is refused before anything in the folder is written."""
    check_folders(root)
    steps = sorted(int(p.stem) for p in (Path(root) / "sha256").glob("*.json") if p.stem.isdigit()
                   and (Path(root) / "orbax" / p.stem).is_dir())
    if not steps:
        return
    verify_step(root, steps[-1])
    folder = Path(root) / "orbax" / str(steps[-1])
    try:  # orbax's JsonSave file; restore_latest checks the same meta again through orbax
        meta = json.loads((folder / "meta" / "metadata").read_text())
    except (OSError, ValueError):
        return
    _check_meta(folder, meta if isinstance(meta, dict) else {}, expect or {})
    _check_epoch(folder, meta, steps[-1])


def _check_epoch(folder: Path, meta, epoch: int) -> None:
    """A step's meta records the epoch it was saved after; a folder renamed to another epoch is refused (a resume
    would start from the wrong epoch, and the newer steps it saves would push out the good ones)."""
    if isinstance(meta, dict) and "epoch" in meta and meta["epoch"] != epoch:
        raise CorruptCheckpoint(f"checkpoint {folder} holds the state after epoch {meta['epoch']!r}, not after epoch "
                                f"{epoch} as its folder's name says")


_META_WHAT = {"config_sha256": "another config", "identity_sha256": "another study's data, model, optimiser, loss or "
              "augmentation", "keys_sha256": "other replica keys", "strategy": "another strategy",
              "epoch_shape": "another epoch shape (train.epoch_shape, or an older nondet_jax)",
              "xla_flags": "other XLA flags (XLA_FLAGS, or those the sweep sets for this CPU type and strategy; or an "
              "older nondet_jax): its epochs ran other kernels"}


def _check_meta(folder: Path, meta: dict, expect: dict) -> None:
    for k, v in expect.items():
        if meta.get(k) != v:
            raise CorruptCheckpoint(f"checkpoint {folder} belongs to a different run ({k} differs: it was written "
                                    f"with {_META_WHAT.get(k, 'other settings')})")


def write_refusal(e: BaseException) -> OSError | None:
    """The file system's refusal behind ``e`` (disk full, read-only, not permitted), if that is what
    it is: an OSError in its chain, or tensorstore's message for one."""
    seen = e
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in FULL + DENIED:
            return seen
        seen = seen.__cause__ or seen.__context__
    text = str(e)
    for code in FULL + DENIED:
        if os.strerror(code) in text:
            return OSError(code, os.strerror(code))
    return None


CHECKPOINT_LOG = "orbax-errors.log"  # in an arm's checkpoint folder: what orbax printed while a save failed


@contextlib.contextmanager
def stderr_captured():
    """Send everything written to file descriptor 2 (Python's tracebacks from orbax's threads, absl's
    log lines, tensorstore's C++ messages) to an anonymous temporary file while the block runs; yields
    a dict whose ``text`` holds what was written once the block ends. Nothing is shown unless the
    caller keeps it (:func:`keep_log`)."""
    sys.stderr.flush()
    saved, sink, captured = os.dup(2), tempfile.TemporaryFile(), {"text": b""}
    os.dup2(sink.fileno(), 2)
    try:
        yield captured
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        sink.seek(0)
        captured["text"] = sink.read()
        sink.close()


def quiet_after_failed_save(log: Path | None) -> None:
    """After a failed save, tensorstore's C++ threads keep finishing their writes for a while and hand
    each result to the asyncio loop orbax has closed; every one prints "RuntimeError: Event loop is
    closed" through ``sys.excepthook``, and asyncio logs each of orbax's failed writes as "exception
    was never retrieved" when it is collected (also after the one-line error). Those, and only those,
    are kept out of the terminal from then on: the loop errors dropped, asyncio's log sent to ``log``."""
    quiet = logging.getLogger("asyncio")
    if quiet.propagate:
        quiet.propagate = False
        handler = logging.NullHandler()
        if log is not None:
            try:
                handler = logging.FileHandler(log, delay=True)
            except OSError:
                pass
        quiet.addHandler(handler)
    def closed(value) -> bool:
        return isinstance(value, RuntimeError) and str(value) == "Event loop is closed"

    # the same error reaches Python three ways: uncaught in the main thread, in another thread, and unraisable
    # (a callback or finaliser with nowhere to raise it, "Exception ignored in: ..."); each hook is wrapped once
    for module, name, is_closed in ((sys, "excepthook", lambda kind, value, tb: closed(value)),
                                    (threading, "excepthook", lambda args: closed(args.exc_value)),
                                    (sys, "unraisablehook", lambda args: closed(args.exc_value))):
        previous = getattr(module, name)
        if getattr(previous, "quiet_closed_loops", False):
            continue

        def hook(*args, _previous=previous, _is_closed=is_closed):
            if not _is_closed(*args):
                _previous(*args)

        hook.quiet_closed_loops = True
        setattr(module, name, hook)


def keep_log(captured: dict, path: Path) -> Path | None:
    """Write what :func:`stderr_captured` caught to ``path`` (or, where that folder refuses, e.g. a full
    disk, to a file in the temporary folder); the path written, None when nothing was caught or
    nothing could be written."""
    text = captured["text"]
    if not text.strip():
        return None
    for where in (path, Path(tempfile.gettempdir()) / f"nondet_jax-{path.name}"):
        try:
            where.write_bytes(text)
            return where
        except OSError:
            continue
    return None


def _clock() -> float:
    """Seconds for the checkpoint cadence (a function of its own, so a test can give it a clock)."""
    return time.monotonic()


class ArmCheckpoints:
    """The checkpoints of one arm: save every ``every`` epochs, restore the latest valid one.

    ``seconds`` > 0 saves a due epoch only once that much time has passed since the last save (or since the
    arm started), so a study of short epochs writes a checkpoint when one would spare a crash real work, not
    every few seconds. A save of ResNet-8 replicas cost 0.05 s on an idle 2-core CPU and about 0.8 s while
    another process loaded it (benchmarks/checkpoint_cost.py). Which epochs are saved never changes a
    result: a resumed arm is bitwise the uninterrupted one."""

    def __init__(self, directory: str | Path, every: int = 1, keep: int = 2, seconds: float = 0.0):
        import orbax.checkpoint as ocp

        self.root = Path(directory).resolve()  # orbax wants absolute paths
        self.every = every
        self.seconds = seconds
        self._since = _clock()
        self._ocp = ocp
        self._manager = None
        self._keep = keep

    def _mgr(self):
        if self._manager is None:
            ocp = self._ocp
            (self.root / "orbax").mkdir(parents=True, exist_ok=True)
            me = jax.process_index()  # each process checkpoints its own replicas, on its own
            options = ocp.CheckpointManagerOptions(
                max_to_keep=self._keep, enable_async_checkpointing=False, create=False, cleanup_tmp_directories=True,
                multiprocessing_options=ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me}))
            self._manager = ocp.CheckpointManager(self.root / "orbax", options=options)
        return self._manager

    def _sha(self, epoch: int) -> Path:
        return self.root / "sha256" / f"{epoch}.json"

    def steps(self) -> list[int]:
        """Epochs with a complete checkpoint (step folder and manifest), oldest first; step
        folders left without a manifest by an interrupted save are deleted."""
        check_folders(self.root)
        if not (self.root / "orbax").is_dir():
            return []
        out = []
        for step in sorted(self._mgr().all_steps()):
            if self._sha(step).exists():
                out.append(step)
            else:
                guarded("rmtree", self.root, self.root / "orbax" / str(step))
        if len(out) != len(self._mgr().all_steps()):
            self._mgr().reload()
        return out

    def save(self, progress, meta: dict) -> None:
        """Checkpoint ``progress`` (a replicas.loop.EpochState) if its epoch is due, with JSON ``meta``."""
        if self.every <= 0 or progress.epoch % self.every:
            return
        if self.seconds > 0 and _clock() - self._since < self.seconds:
            return
        ocp = self._ocp
        history = {"steps": progress.steps, "weight_distance": progress.weight_distance}
        if progress.snapshots is not None:
            history["snapshots"] = progress.snapshots
        with stderr_captured() as captured:  # a refused write makes orbax's threads print 100+ lines of tracebacks
            before = set(threading.enumerate())
            try:
                self._mgr().save(progress.epoch, args=ocp.args.Composite(
                    state=ocp.args.StandardSave(jax.device_get(progress.state)),  # host arrays: any process layout
                    history=ocp.args.StandardSave(_nonempty(history)),
                    meta=ocp.args.JsonSave({**meta, "epoch": progress.epoch})))
                self._mgr().wait_until_finished()
                failed = None
            except Exception as e:  # orbax reports a full disk as a ValueError (from tensorstore) or an OSError
                failed = e
                try:
                    self.close()  # its threads finish (and print) while stderr is still captured
                except Exception:  # noqa: BLE001 (the save's own error is the one to report)
                    self._manager = None
                for thread in set(threading.enumerate()) - before:  # orbax's background threads print as they end
                    try:
                        thread.join(timeout=10)
                    except Exception:  # noqa: BLE001 (orbax's threads re-raise their error in join)
                        pass
                gc.collect()  # and asyncio logs its never-retrieved futures now, not at exit
        if failed is not None:
            refused = write_refusal(failed)
            where = keep_log(captured, self.root / CHECKPOINT_LOG)
            quiet_after_failed_save(where)
            if refused is None:
                raise failed
            error = write_error(self.root / "orbax" / str(progress.epoch), refused)
            raise UsageError(f"{error} (orbax's messages: {where})" if where else error) from None
        atomic_write_json(self._sha(progress.epoch), _manifest(self.root / "orbax" / str(progress.epoch)),
                          root=self.root)
        self._since = _clock()
        for old in self._sha(0).parent.glob("*.json"):  # manifests of steps orbax has pruned
            if not (self.root / "orbax" / old.stem).exists():
                guarded("unlink", self.root, old)

    def restore_latest(self, state_target, meta_check: dict):
        """The latest checkpoint as (epoch, state, steps, weight_distance, snapshots), or None.

        ``state_target`` is the abstract stacked state (``jax.eval_shape`` of init); ``meta_check``
        holds values the checkpoint's meta must equal (e.g. the key fingerprint)."""
        steps = self.steps()
        if not steps:
            return None
        epoch = steps[-1]
        folder = self.root / "orbax" / str(epoch)
        verify_step(self.root, epoch)
        ocp = self._ocp
        try:
            restored = self._mgr().restore(epoch, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), state_target)),
                history=ocp.args.StandardRestore(),
                meta=ocp.args.JsonRestore()))
        except Exception as e:  # orbax/tensorstore raise many types for unreadable data
            raise CorruptCheckpoint(f"checkpoint {folder} cannot be read ({type(e).__name__})") from None
        _check_meta(folder, restored.meta, meta_check)
        _check_epoch(folder, restored.meta, epoch)
        history = _restore_empty(restored.history)
        return (epoch, restored.state, history["steps"], np.asarray(history["weight_distance"]),
                history.get("snapshots"))

    def close(self) -> None:
        if self._manager is not None:
            self._manager.close()
            self._manager = None


# Zero-size arrays (the pairwise distances of a 1-replica arm) are stored as their shape.
def _nonempty(tree):
    return jax.tree.map(lambda a: {"empty_shape": np.asarray(a.shape, np.int64)} if np.size(a) == 0
                        else np.asarray(a), tree)


def _restore_empty(tree):
    if isinstance(tree, dict):
        if set(tree) == {"empty_shape"}:
            return np.zeros(tuple(int(s) for s in np.asarray(tree["empty_shape"])))
        return {k: _restore_empty(v) for k, v in tree.items()}
    return np.asarray(tree)
