"""Limits checked before they bite, and failures that stay one line: memory (cgroup limits, replicate,
.npz headers, compare), a backend JAX cannot start, a full disk under orbax, children that die with
their parent and say nothing of their own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import FAST

from nondet_jax.errors import UsageError
from nondet_jax.machine import memory

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_DISABLE_MOST_OPTIMIZATIONS": "1",
       "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def sweep(*args, env=ENV, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nondet_jax.sweep", *args], capture_output=True, text=True, env=env,
                          **kw)


def error_lines(stderr: str) -> list[str]:
    """stderr without absl's and pip's warning lines."""
    return [ln for ln in stderr.splitlines() if ln.strip() and not ln.startswith("WARNING")]


# --- memory -----------------------------------------------------------------------------------

def _cgroup_tree(tmp: Path, version: int, limit: str, usage: int, inactive: int) -> tuple[Path, Path]:
    """A fake /proc/self/cgroup and /sys/fs/cgroup with the limit on the parent of the process's group."""
    root = tmp / "cgroup"
    own = (root / "job" / "step") if version == 2 else (root / "memory" / "job" / "step")
    own.mkdir(parents=True)
    names = {2: ("memory.max", "memory.current", "inactive_file"),
             1: ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")}[version]
    (own.parent / names[0]).write_text(limit + "\n")
    (own.parent / names[1]).write_text(f"{usage}\n")
    (own.parent / "memory.stat").write_text(f"anon 1\n{names[2]} {inactive}\n")
    (own / names[0]).write_text("max\n" if version == 2 else "9223372036854771712\n")
    (own / names[1]).write_text(f"{usage}\n")
    proc = tmp / "proc_cgroup"
    proc.write_text("0::/job/step\n" if version == 2 else "4:memory:/job/step\n1:cpu:/job/step\n")
    return proc, root


@pytest.mark.parametrize("version", [1, 2])
def test_cgroup_headroom_reads_the_tightest_limit_of_every_level(tmp_path, version):
    proc, root = _cgroup_tree(tmp_path, version, str(450 * 10**6), usage=300 * 10**6, inactive=50 * 10**6)
    left, where = memory.cgroup_headroom(proc, root)
    assert left == 200 * 10**6  # 450 MB - (300 MB in use - 50 MB of page cache the kernel drops first)
    assert "job" in where and "0.45 GB" in where


def test_no_cgroup_limit_is_no_headroom(tmp_path):
    proc, root = _cgroup_tree(tmp_path, 2, "max", usage=10, inactive=0)
    assert memory.cgroup_headroom(proc, root) is None
    assert memory.cgroup_headroom(tmp_path / "absent", root) is None


def _own_cgroup_with_limit(limit: int) -> Path | None:
    """A real cgroup v1/v2 child of this process's group with ``limit`` bytes, or None (not root, read-only)."""
    try:
        line = next(ln for ln in Path("/proc/self/cgroup").read_text().splitlines()
                    if ln.split(":")[1] in ("", "memory") or "memory" in ln.split(":")[1].split(","))
    except (OSError, StopIteration):
        return None
    v2 = line.split(":")[1] == ""
    base = Path("/sys/fs/cgroup") / ("" if v2 else "memory") / line.split(":", 2)[2].strip("/")
    folder = base / f"nondet_jax_test_{os.getpid()}"
    try:
        folder.mkdir()
        (folder / ("memory.max" if v2 else "memory.limit_in_bytes")).write_text(str(limit))
    except OSError:
        if folder.exists():
            folder.rmdir()
        return None
    return folder


def test_a_study_over_the_cgroup_limit_is_refused_in_one_line_not_killed(tmp_path):
    """Under a 450 MB memory limit the smallest study used to pass the check (MemAvailable: GBs) and be
    killed by the kernel (exit 137, nothing said); its peak is about 620 MB charged to the group."""
    group = _own_cgroup_with_limit(450 * 2**20)
    if group is None:
        pytest.skip("cannot create a memory cgroup here (needs root and a writable /sys/fs/cgroup)")
    try:
        cmd = [sys.executable, "-c", f"import os; open({str(group / 'cgroup.procs')!r}, 'w').write(str(os.getpid())); "
               "os.execv(__import__('sys').executable, [__import__('sys').executable, '-m', 'nondet_jax.sweep', "
               f"*{[*FAST, '--arms', 'control', '--out', str(tmp_path / 'run')]!r}])"]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=ENV)
    finally:
        for _ in range(50):
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.1)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(error_lines(proc.stderr)) == 1, proc.stderr
    line = error_lines(proc.stderr)[0]
    assert "the memory limit of cgroup" in line and "for compiling and running" in line
    assert not (tmp_path / "run").exists()


def test_replicate_refuses_a_state_that_cannot_fit_before_running():
    import jax.numpy as jnp

    import nondet_jax as nj

    for strategy in ("vmap", "sequential"):
        with pytest.raises(UsageError, match=r"need at least .*XLA's memory analysis"):
            nj.replicate(lambda keys: jnp.zeros((10**6, 10**6)), lambda s, b, keys: s + 1, steps=2, replicas=4, arms="control",
                         strategy=strategy)


def test_npz_larger_than_memory_is_refused_from_its_headers(tmp_path, monkeypatch):
    from nondet_jax import data
    from nondet_jax.machine import memory

    x = np.zeros((100, 8, 8, 1), np.float32)
    np.savez_compressed(tmp_path / "d.npz", x_train=x, y_train=np.arange(100) % 2, x_test=x[:10],
                        y_test=np.arange(10) % 2)
    monkeypatch.setattr(memory, "host_available", lambda: (10_000, "the memory limit of cgroup /job (1e-05 GB)"))
    with pytest.raises(UsageError, match=r"expands to 29 KB of arrays but the memory limit of cgroup /job"):
        data.load_npz(str(tmp_path / "d.npz"))


def test_probability_of_improvement_of_20000_runs_each_fits_in_a_small_address_space():
    """The (n_a, n_b) matrix of differences needed 7 GB for 20,000 runs a side; the midrank form is
    linear. Checked against the matrix on a small sample with ties, then run under a 1.5 GiB limit."""
    from nondet_jax.analysis.stats import probability_of_improvement

    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 5, 40), rng.integers(0, 6, 50)
    d = b[:, None] - a[None, :]
    assert probability_of_improvement(a, b)["probability"] == pytest.approx(((d > 0) + 0.5 * (d == 0)).mean(),
                                                                            abs=1e-15)
    code = textwrap.dedent("""
        import resource, numpy as np
        resource.setrlimit(resource.RLIMIT_AS, (1536 * 2**20, resource.RLIM_INFINITY))
        from nondet_jax.analysis.stats import probability_of_improvement
        r = np.random.default_rng(1)
        p = probability_of_improvement(r.normal(0, 1, 20000), r.normal(0.1, 1, 20000))
        print(round(p["probability"], 3))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert 0.52 < float(proc.stdout) < 0.54


# --- a backend JAX cannot start ---------------------------------------------------------------

@pytest.mark.parametrize("command", [["nondet_jax.sweep"], ["nondet_jax", "audit"]])
def test_a_backend_jax_cannot_start_is_one_line(command, tmp_path):
    proc = subprocess.run([sys.executable, "-m", *command, "--out" if "sweep" in command[0] else "--no-child",
                           *([str(tmp_path / "run")] if "sweep" in command[0] else [])],
                          capture_output=True, text=True, env={**ENV, "JAX_PLATFORMS": "cuda"})
    if proc.returncode == 0:
        pytest.skip("this machine has a CUDA backend")
    assert proc.returncode == 2, proc.stderr[-2000:]
    line, = error_lines(proc.stderr)
    assert "JAX_PLATFORMS=cuda but JAX could not start that backend" in line and "unset JAX_PLATFORMS" in line
    assert not (tmp_path / "run").exists()


# --- a full disk under orbax ------------------------------------------------------------------

@pytest.fixture
def small_disk(tmp_path):
    """A 600 KiB tmpfs: room for a run folder's first files, not for every checkpoint (root only)."""
    where = tmp_path / "disk"
    where.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=600k", "tmpfs", str(where)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


@pytest.mark.slow
def test_disk_full_during_a_checkpoint_is_one_line_and_resumes_bitwise(small_disk, tmp_path):
    """orbax's threads printed 129-225 lines of tracebacks around the one-line error."""
    study = [*FAST[:-1], "--epochs", "3", "--arms", "init", "--set", "train.checkpoint_every=1",
             "train.checkpoint_seconds=0", "--no-progress"]
    proc = sweep(*study, "--out", str(small_disk / "run"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    line, = error_lines(proc.stderr)
    assert "No space left on device" in line and "orbax's messages:" in line, line
    log = Path(line.rsplit("orbax's messages: ", 1)[1].rstrip(")"))
    assert b"RESOURCE_EXHAUSTED" in log.read_bytes()
    subprocess.run(["mount", "-o", "remount,size=50m", str(small_disk)], check=True)
    assert sweep(*study, "--out", str(small_disk / "run")).returncode == 0
    assert sweep(*study, "--out", str(tmp_path / "clean")).returncode == 0
    for name in ("logits/init.npy", "weights/init.npz"):
        assert (small_disk / "run" / name).read_bytes() == (tmp_path / "clean" / name).read_bytes(), name


@pytest.mark.slow
def test_a_file_size_limit_during_a_checkpoint_is_one_line_and_resumes_bitwise(tmp_path):
    """EFBIG (a file-size limit, ulimit -f) from orbax's writer printed about 40 lines of traceback: it was
    not counted among the write refusals. The checkpoint (~150 KB) is the first file over 100 KB."""
    study = [*FAST, "--epochs", "2", "--arms", "init", "--set", "train.checkpoint_every=1"]
    limited = ("import resource, runpy, sys; resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000)); "
               "sys.argv[0] = 'nondet_jax.sweep'; runpy.run_module('nondet_jax.sweep', run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", limited, *study, "--out", str(tmp_path / "run"), "--compile-cache",
                           "off"], capture_output=True, text=True, env=ENV)  # no preexec_fn: no fork in a JAX process
    assert proc.returncode == 2, proc.stderr[-3000:]
    line, = error_lines(proc.stderr)
    assert "File too large; raise the file-size limit (ulimit -f), then rerun the same command" in line, line
    assert sweep(*study, "--out", str(tmp_path / "run")).returncode == 0
    assert sweep(*study, "--out", str(tmp_path / "clean")).returncode == 0
    for name in ("logits/init.npy", "weights/init.npz"):
        assert (tmp_path / "run" / name).read_bytes() == (tmp_path / "clean" / name).read_bytes(), name


# --- children ---------------------------------------------------------------------------------

def _children(pid: int) -> list[int]:
    try:
        return [int(c) for t in Path(f"/proc/{pid}/task").iterdir()
                for c in (t / "children").read_text().split()]
    except OSError:
        return []


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_the_audit_child_dies_with_its_parent_and_leaves_no_temporary_folder(tmp_path):
    env = {**ENV, "TMPDIR": str(tmp_path)}
    p = subprocess.Popen([sys.executable, "-m", "nondet_jax", "audit", "--model", "mlp", "--steps", "1400",
                          "--batch-size", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    deadline = time.time() + 120
    while not _children(p.pid) and time.time() < deadline and p.poll() is None:
        time.sleep(0.1)
    kids = _children(p.pid)
    assert kids, "the audit started no child process"
    time.sleep(1.0)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=30)
    assert p.returncode == 143 and "Traceback" not in err, err
    for _ in range(100):
        if not any(_alive(k) for k in kids):
            break
        time.sleep(0.1)
    assert not any(_alive(k) for k in kids), "the audit's child outlived its parent"
    assert not [q for q in tmp_path.iterdir() if q.name.startswith("tmp")], list(tmp_path.iterdir())


@pytest.mark.slow
def test_ctrl_c_during_a_hardware_arm_is_one_line_from_the_sweep_alone(tmp_path):
    from nondet_jax.machine.signals import MESSAGE

    p = subprocess.Popen([sys.executable, "-m", "nondet_jax.sweep", *FAST, "--epochs", "30", "--arms", "hardware",
                          "--out", str(tmp_path / "run")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV,
                         text=True, start_new_session=True)
    deadline = time.time() + 180
    while time.time() < deadline and p.poll() is None and not any(
            "nondet_jax.study.hardware" in Path(f"/proc/{k}/cmdline").read_text(errors="replace")
            for k in _children(p.pid) if _alive(k)):
        time.sleep(0.1)
    time.sleep(3.0)  # the replica's process is importing, compiling or training
    os.killpg(p.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground group
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130, err[-2000:]
    assert "Traceback" not in err and error_lines(err) == [MESSAGE], err[-2000:]


@pytest.mark.parametrize("module", ["yaml", "jax"])
def test_ctrl_c_while_the_command_is_still_importing_is_one_line(tmp_path, module):
    """Ctrl-C while ``python -m nondet_jax.sweep`` imported its command module (numpy, PyYAML; 16 s of
    imports under load) printed a KeyboardInterrupt traceback: the handlers went in only once
    ``nondet_jax.cli.sweep`` was imported. A stand-in for ``module`` on PYTHONPATH says when the import has
    begun, waits, then loads the real one; the signal lands inside that import."""
    from nondet_jax.machine.signals import MESSAGE

    shim, started = tmp_path / "shim", tmp_path / "started"
    (shim / module).mkdir(parents=True)
    (shim / module / "__init__.py").write_text(textwrap.dedent(f"""
        import importlib, sys, time
        open({str(started)!r}, "w").close()
        time.sleep(30)
        sys.path.remove({str(shim)!r})
        del sys.modules[{module!r}]
        sys.modules[{module!r}] = importlib.import_module({module!r})
    """))
    env = {**ENV, "PYTHONPATH": f"{shim}{os.pathsep}{ENV['PYTHONPATH']}"}
    p = subprocess.Popen([sys.executable, "-m", "nondet_jax.sweep", *FAST, "--arms", "control",
                          "--out", str(tmp_path / "run")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                         text=True, start_new_session=True)
    deadline = time.time() + 60
    while not started.exists() and time.time() < deadline and p.poll() is None:
        time.sleep(0.02)
    assert started.exists(), p.communicate()[1][-2000:]
    os.killpg(p.pid, signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130 and "Traceback" not in err and error_lines(err) == [MESSAGE], err[-2000:]
