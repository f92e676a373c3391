"""Writing a run folder's files: atomic, regular files only, one-line errors when the disk refuses."""

from __future__ import annotations

import errno
import io
import json
import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from nondet_jax.errors import UsageError
from nondet_jax.store.paths import contained

FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # EFBIG: a file-size limit (ulimit -f, RLIMIT_FSIZE)


DENIED = (errno.EROFS, errno.EACCES, errno.EPERM)


def write_error(path: Path, e: OSError, option: str = "--out") -> UsageError:
    """The one-line error for a write the file system refused (disk full, read-only, immutable);
    ``option`` names what the user passed the path with (a run folder's ``--out``, or ``--json`` ...)."""
    if e.errno == errno.EFBIG:
        fix = ("raise the file-size limit (ulimit -f), then rerun the same command: finished arms and checkpoints "
               "are kept" if option == "--out" else f"raise the file-size limit (ulimit -f), or pass another {option}")
    elif option != "--out":
        fix = f"{'free some space' if e.errno in FULL else 'make the folder writable'}, or pass another {option}"
    elif e.errno in FULL:
        fix = "free some space, then rerun the same command: finished arms and checkpoints are kept"
    else:
        fix = "make the folder writable, then rerun the same command"  # report has no --out to change
    return UsageError(f"cannot write {path}: {e.strerror or e}; {fix}")


def umask() -> int:
    """This process's umask, read without changing it (``/proc/self/status``; else set and restore)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


TEMP_GLOB = ".*.tmp"  # the names of atomic_write_bytes' temporary files


def check_path_name(path: Path, option: str) -> None:
    """Refuse a path the run folder could not record or the file system cannot hold, before anything
    is written: one that is not UTF-8 (run folders record paths in UTF-8 JSON) or whose name is too long."""
    text = os.fsdecode(path)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise UsageError(f"{option} {ascii(text)} is not valid UTF-8 text, which nondet_jax's records (JSON, UTF-8) cannot hold; "
                         "choose a name in UTF-8") from None
    limit = os.pathconf("/", "PC_NAME_MAX")
    long = next((p for p in Path(text).parts if len(p.encode()) > limit), None)
    if long is not None:
        raise UsageError(f"{option} {text.replace(long, f'{long[:12]}...({len(long.encode())} bytes)')} is too long "
                         f"for the file system (at most {limit} bytes a name); choose a shorter name")


def check_output_file(path: Path, option: str) -> None:
    """An output file named by the user outside a run folder (``--json``, ``--plot``): it is replaced by
    a rename, so a symbolic link, device, FIFO or folder there would be replaced too (``/dev/null``
    turned into a regular file). Refused with a one-line error instead."""
    path = Path(path)
    check_path_name(path, option)
    if path.is_symlink() or (path.exists() and not path.is_file()):
        what = "a symbolic link" if path.is_symlink() else "a folder" if path.is_dir() else "a device, FIFO or socket"
        raise UsageError(f"{option} {path} is {what}, which would be replaced; pass the path of a regular file")


GUARDED = ("unlink", "rmtree", "rmdir", "replace")


def guarded(op: str, root: str | Path, target: str | Path, source: str | Path | None = None) -> None:
    """The one way nondet_jax deletes or replaces anything: ``op`` is ``unlink`` (a file; missing is
    fine), ``rmtree`` (a folder and what it holds; missing is fine), ``rmdir`` (an empty folder) or
    ``replace`` (``source`` renamed onto ``target``). ``target`` (and ``source``) must lie inside the
    folder ``root`` (:func:`nondet_jax.store.paths.contained`: no absolute name, no ``..``, no symbolic
    link on the way, resolved inside), else a UsageError and nothing is touched: a name read from a run
    folder can never make a sweep delete or overwrite anything outside it."""
    if op not in GUARDED:
        raise ValueError(f"unknown operation {op!r}; one of {', '.join(GUARDED)}")
    target = contained(root, target)
    if op == "unlink":
        target.unlink(missing_ok=True)
    elif op == "rmtree":
        if target.is_symlink():  # rmtree refuses a link itself; say so rather than skip it
            raise UsageError(f"{target} is a symbolic link, which nondet_jax never follows in a run folder; remove it")
        shutil.rmtree(target, ignore_errors=True)
    elif op == "rmdir":
        target.rmdir()
    else:
        os.replace(contained(root, source), target)


def _not_a_file(path: Path) -> str | None:
    """What stands at ``path`` when it is neither absent nor a regular file (a file is written there)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    except OSError:  # a parent that is a file (ENOTDIR): the folder check names that
        return None
    if stat.S_ISREG(mode):
        return None
    return ("a symbolic link" if stat.S_ISLNK(mode) else "a folder" if stat.S_ISDIR(mode) else
            "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device")


def check_writable_file(path: Path, option: str = "--out") -> None:
    """Refuse a folder, FIFO, device, socket or link where a file is written (it would be replaced, or
    the rename fails with a traceback), and a file where its folder should be: one line naming it."""
    path = Path(path)
    what = _not_a_file(path)
    if what is not None:
        fix = "move it away and rerun the same command" if option == "--out" else f"pass another {option}"
        raise UsageError(f"{path} is {what}, where nondet_jax writes a file; {fix}")
    for parent in (path.parent, *path.parent.parents):
        if parent.exists() or parent.is_symlink():
            if not parent.is_dir():
                raise UsageError(f"{parent} is a file, where nondet_jax keeps a folder; move it away and rerun the "
                                 "same command")
            break


def atomic_write_bytes(path: Path, data: bytes, option: str = "--out", root: str | Path | None = None) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename: never half a file. The file
    gets the permissions a plain ``open`` would (0644 under umask 022), not mkstemp's 0600; a write the
    file system refuses, or a folder or FIFO where the file goes, is a :class:`UsageError` naming the
    file and the fix. ``root``: the run folder the file must stay inside (the rename goes through
    :func:`guarded`); None for a file the user named (``--json``, ``--plot``): its own folder."""
    path = Path(path)
    root = path.parent if root is None else root
    contained(root, path)
    check_writable_file(path, option)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")  # TEMP_GLOB
    except OSError as e:
        if e.errno in FULL + DENIED:
            raise write_error(path, e, option) from None
        raise
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o666 & ~umask())
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        guarded("replace", root, path, tmp)
    except BaseException as e:
        guarded("unlink", root, tmp)
        if isinstance(e, OSError) and e.errno in FULL + DENIED:
            raise write_error(path, e, option) from None
        raise


def atomic_write_json(path: Path, obj: Any, option: str = "--out", root: str | Path | None = None) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode(), option, root)


def npy_bytes(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, _portable(np.asarray(array)), allow_pickle=False)
    return buf.getvalue()


def npz_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    """``np.savez`` of ``arrays``; an array of a float type numpy does not know (JAX's bfloat16, float8: kind
    ``V``, which ``.npz`` stores as raw bytes that read back as void) as float32, which holds it exactly."""
    buf = io.BytesIO()
    np.savez(buf, **{k: _portable(np.asarray(v)) for k, v in arrays.items()})
    return buf.getvalue()


def _portable(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float32) if a.dtype.kind == "V" else a


def flatten_tree(tree: Any) -> dict[str, np.ndarray]:
    """A nested dict of arrays as {'a/b/c': array} (the key format of ``weights/<arm>.npz``)."""
    from flax import traverse_util  # here: the commands' argument checks import this module before JAX starts

    return {"/".join(k): np.asarray(v) for k, v in traverse_util.flatten_dict(tree).items()}


def check_no_links(root: Path) -> None:
    """Refuse a run folder holding a symbolic link, FIFO, device or socket anywhere: nondet_jax writes
    only plain files and folders there; following a link would read or overwrite files outside the
    folder, and reading a FIFO would wait forever."""
    root = Path(root)
    if not root.is_dir():
        return
    for dirpath, dirnames, filenames in os.walk(root):  # does not descend into linked folders
        for name in sorted(dirnames + filenames):
            path = Path(dirpath) / name
            if path.is_symlink():
                raise UsageError(f"{path} is a symbolic link, which nondet_jax never follows in a run folder; "
                                 "remove it (or put a copy of its target in its place)")
            what = _not_a_file(path)
            if what is not None and what != "a folder":
                raise UsageError(f"{path} is {what}, which a run folder never holds (nondet_jax writes only plain files "
                                 "and folders there, and reading one could wait forever); remove it")


def _finite(x):
    """x, or None where it is NaN or infinite (strict JSON has no NaN; CSV shows an empty cell)."""
    return None if isinstance(x, float) and not np.isfinite(x) else x


def strict_json(obj):
    """``obj`` with every non-finite float replaced by None, so ``json.dumps(allow_nan=False)`` holds."""
    if isinstance(obj, dict):
        return {k: strict_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict_json(v) for v in obj]
    if isinstance(obj, (np.floating, np.integer)):
        obj = obj.item()
    return _finite(obj)


def read_arrays(path: Path):
    """A run folder's stored arrays, read whole and checked, never unpickled: a ``.npy`` file's array, or a
    ``.npz`` file's ``{name: array}``. UsageError naming the file when it is no such file or holds an array that is
    not numbers (a file resealed by hand with an object array ended a report in a traceback after it had written
    its other outputs)."""
    import zipfile

    try:
        with open(path, "rb") as f:
            loaded = np.load(f, allow_pickle=False)
            arrays = {k: loaded[k] for k in loaded.files} if isinstance(loaded, np.lib.npyio.NpzFile) else loaded
        bad = [k for k, a in (arrays.items() if isinstance(arrays, dict) else [("", arrays)]) if a.dtype.kind not in "biuf"]
        if bad:
            raise ValueError(f"{bad[0] or 'its array'} holds {arrays[bad[0]].dtype if bad[0] else arrays.dtype} values, not numbers")
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        raise UsageError(f"{path} is not a readable array file ({(str(e).splitlines() or [type(e).__name__])[0][:80]}); "
                         "rerun the sweep on the same --out to write it again") from None
    return arrays


def not_numbers(data: bytes, name: str) -> str | None:
    """The first array of a stored ``.npy`` or ``.npz`` file (its bytes, ``name`` telling which) that does not hold
    numbers, read from the headers alone, as words ("train_loss holds <U1 values"); None when every one does, or
    when ``name`` is no array file. A file resealed by hand with text in it passed its digest and ended a report in
    a traceback after its other outputs were written."""
    import zipfile

    from nondet_jax.machine.memory import npy_header

    try:
        if name.endswith(".npy"):
            dtypes = {"its array": npy_header(io.BytesIO(data))[1]}
        elif name.endswith(".npz"):
            with zipfile.ZipFile(io.BytesIO(data)) as z:
                dtypes = {}
                for info in z.infolist():
                    with z.open(info) as f:
                        dtypes[info.filename.removesuffix(".npy")] = npy_header(f)[1]
        else:
            return None
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        return f"its headers cannot be read ({(str(e).splitlines() or [type(e).__name__])[0][:60]})"
    return next((f"{k} holds {d} values, not numbers" for k, d in dtypes.items() if d.kind not in "biuf"), None)


def real_number(v) -> bool:
    """A JSON value that is a number (an int or a float, NaN included), not a bool or text: what a record's scores
    must be."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)

