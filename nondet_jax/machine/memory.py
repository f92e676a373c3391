"""How much more memory this process can have: the host's ``MemAvailable``, capped by the limits of
every control group (cgroup v2 ``memory.max``, v1 ``memory.limit_in_bytes``) the process sits in.

A container or a batch job's memory limit is usually far below the host's free memory; a check
against ``MemAvailable`` alone passed a study the kernel then killed (exit 137, no message).
"""

from __future__ import annotations

from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def _int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return None if text in ("", "max") else int(text) if text.isdigit() else None


def _reclaimable(stat: Path, key: str) -> int:
    """Page cache the kernel drops before it kills (``inactive_file`` of ``memory.stat``)."""
    try:
        for line in stat.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _levels(root: Path, rel: str) -> list[Path]:
    """The cgroup folder of ``rel`` under ``root`` and every parent up to ``root`` (a limit may be set on
    any of them); just ``root`` where the path is not visible (a cgroup namespace shows its own group as
    the root)."""
    rel = rel.strip("/")
    here = root / rel if rel else root
    if not here.is_dir():
        return [root]
    levels = [here]
    while here != root:
        here = here.parent
        levels.append(here)
    return levels


def cgroup_headroom(proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = CGROUP_ROOT) -> tuple[int, str] | None:
    """(bytes the tightest memory limit still allows, which limit), or None where no limit is set."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    best: tuple[int, str] | None = None
    for line in lines:
        _, controllers, rel = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":  # cgroup v2
            folders, limit, usage, stat, key = _levels(root, rel), "memory.max", "memory.current", "memory.stat", \
                "inactive_file"
        elif "memory" in controllers.split(","):  # cgroup v1
            folders, limit, usage, stat, key = _levels(root / "memory", rel), "memory.limit_in_bytes", \
                "memory.usage_in_bytes", "memory.stat", "total_inactive_file"
        else:
            continue
        for folder in folders:
            cap, used = _int(folder / limit), _int(folder / usage)
            if cap is None or used is None or cap >= 2**62:  # v1 writes "no limit" as about 2**63
                continue
            left = max(0, cap - max(0, used - _reclaimable(folder / stat, key)))
            if best is None or left < best[0]:
                best = (left, f"the memory limit of cgroup {folder} ({cap / 1e9:.3g} GB)")
    return best


def host_available() -> tuple[int | None, str]:
    """(bytes this process can still allocate on the host, where that is), None when unknown: the
    smaller of ``MemAvailable`` and the cgroup headroom."""
    available: tuple[int | None, str] = (None, "memory")
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = (int(line.split()[1]) * 1024, "host memory")
    except (OSError, ValueError, IndexError):
        pass
    limit = cgroup_headroom()
    if limit is not None and (available[0] is None or limit[0] < available[0]):
        return limit
    return available


def human(n: float) -> str:
    """Bytes as a short decimal size (``1.5 GB``)."""
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if n < 1000 or unit == "PB":
            return f"{n:.3g} {unit}"
        n /= 1000
    return f"{n:.3g} PB"  # pragma: no cover


def npy_header(f) -> tuple:
    """(shape, dtype) from the header of a ``.npy`` array at ``f``'s position (its data not read); ``f`` left at the
    data's start. ValueError or EOFError when there is no such header."""
    import numpy as np

    version = np.lib.format.read_magic(f)
    read = np.lib.format.read_array_header_2_0 if version >= (2, 0) else np.lib.format.read_array_header_1_0
    shape, _, dtype = read(f, max_header_size=10_000)
    return shape, dtype


def check_npz_sizes(path: str, name: str | None = None) -> None:
    """Read a ``.npz`` file's array headers (not its data) and refuse, before anything is loaded, an
    array whose header claims more data than its member holds (a corrupt or crafted header) or arrays
    that would not fit in the memory this process can have (a few MB compressed can expand to GBs).
    ``name``: the file as messages call it (default ``--dataset PATH``; a parameters file says so)."""
    import zipfile

    import numpy as np

    from nondet_jax.errors import UsageError

    name = name or f"--dataset {path}"
    try:
        z = zipfile.ZipFile(path)
    except (OSError, zipfile.BadZipFile):
        return  # np.load says what is wrong
    total = 0
    with z:
        for info in z.infolist():
            if not info.filename.endswith(".npy"):
                continue
            try:
                with z.open(info) as f:
                    shape, dtype = npy_header(f)
                    header = f.tell()
            except (OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
                raise UsageError(f"{name}: the header of {info.filename} cannot be read ({e}); pass a file "
                                 "written by np.savez") from None
            nbytes = int(np.prod(shape, dtype=object)) * dtype.itemsize
            if not dtype.hasobject and nbytes > info.file_size - header:
                raise UsageError(f"{name}: {info.filename} claims shape {shape} ({human(nbytes)}) but holds "
                                 f"{human(info.file_size - header)} of data; the file is truncated or corrupt: write it "
                                 "again with np.savez")
            total += nbytes
    available, where = host_available()
    if available is not None and total > available:
        raise UsageError(f"{name} expands to {human(total)} of arrays but {where} has {human(available)} available; "
                         + ("use a subset of the data or " if name.startswith("--dataset") else "use ")
                         + "a machine with more memory")
