"""The device script returns what it measured: a block's JSON says how the block ended, and the packed
folder fits what a device call brings back (at most 8 files, none more than two folders down, each under
16 MiB, plain names). The smallest QUICK block runs the whole script on the CPU."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import device_pack  # noqa: E402

NAME = re.compile(r"^[A-Za-z0-9._-]+$")


def returned(out: Path) -> list[Path]:
    """What a device call would bring back from ``out``, after checking the call's limits."""
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) <= device_pack.MAX_FILES, files
    for f in files:
        rel = f.relative_to(out)
        assert len(rel.parts) <= 3, rel  # $OUT/a/b/file at most
        assert all(NAME.match(part) for part in rel.parts), rel
        assert f.stat().st_size < device_pack.MAX_BYTES, (rel, f.stat().st_size)
    return files


def fake_work(work: Path, jsons: int, profile_mib: int) -> None:
    rng = np.random.default_rng(0)
    for i in range(jsons):
        (work / f"block{i}.json").write_text(json.dumps({"i": i}))
    for name in ("smoke", "speed_bf16", "hardware"):
        (work / f"{name}.log").write_text(f"{name} log\n" * 100)
    (work / "env.txt").write_text("NVIDIA H200\n")
    study = work / "hardware_run"
    (study / "arms").mkdir(parents=True)
    (study / "checkpoints" / "control").mkdir(parents=True)
    for f in ("config.json", "summary.json", "environment.json", "arms/control.json", "report.md"):
        (study / f).write_text("{}")
    (study / "checkpoints" / "control" / "big.bin").write_bytes(rng.bytes(2**20))  # never packed
    cache = work / "jax_cache"
    cache.mkdir()
    (cache / "entry").write_bytes(rng.bytes(2**20))  # never packed
    for cand in ("vmap_grouped", "vmap_rhs-bgc"):  # traces five folders down, as jax.profiler writes them
        deep = work / "profile" / cand / "plugins" / "profile" / "2026_12_04"
        deep.mkdir(parents=True)
        (deep / "host.xplane.pb").write_bytes(rng.bytes(profile_mib * 2**20 // 2))


@pytest.mark.parametrize("jsons, profile_mib", [(3, 1), (9, 24)])
def test_pack_fits_what_a_device_call_returns(tmp_path, jsons, profile_mib):
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    fake_work(work, jsons, profile_mib)
    device_pack.pack(work, out)
    device_pack.pack(work, out)  # the EXIT trap packs again: the same files
    files = returned(out)
    names = {f.name for f in files}
    assert {"logs.tar.gz"} <= names and len([n for n in names if n.endswith(".json")]) == min(jsons, 6)
    with tarfile.open(out / "logs.tar.gz") as tar:
        members = set(tar.getnames())
    assert {"smoke.log", "env.txt", "hardware_run/summary.json", "hardware_run/arms/control.json"} <= members
    assert not any("checkpoints" in m or "jax_cache" in m for m in members)
    # the JSONs that did not fit as files are in the logs, none lost
    assert {f"block{i}.json" for i in range(jsons)} <= names | members
    with tarfile.open(out / "profile.tar.gz") as tar:
        traces = [m for m in tar.getnames() if m.endswith(".pb")]
    # 1 MiB of traces: both candidates; 24 MiB (incompressible): one candidate's, under the limit
    assert len(traces) == (2 if profile_mib == 1 else 1), traces


def test_mark_records_how_a_block_ended(tmp_path):
    done = tmp_path / "done.json"
    done.write_text(json.dumps({"status": "complete", "runs": {"determinism": {"rows": [1]}}}))
    assert device_pack.mark(done, "speed_bf16", 0, 12.0, 160)["status"] == "complete"
    cut = tmp_path / "cut.json"
    cut.write_text(json.dumps({"status": "running", "runs": {"determinism": {"rows": [1, 2]}}}))
    rec = device_pack.mark(cut, "speed_bf16", 124, 160.0, 160)
    assert rec["status"] == "interrupted" and rec["runs"]["determinism"]["rows"] == [1, 2]  # the rows are kept
    assert rec["block"] == {"name": "speed_bf16", "exit": 124, "seconds": 160.0, "limit_s": 160}
    never = tmp_path / "never.json"  # cut before it wrote anything
    assert device_pack.mark(never, "hardware", 130, 3.0, 110)["status"] == "interrupted"
    assert json.loads(never.read_text())["block"]["name"] == "hardware"
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    assert device_pack.mark(broken, "speed_f32", 1, 3.0, 60)["status"] == "failed"


@pytest.mark.slow
def test_quick_smallest_block_runs_the_script_and_packs(tmp_path):
    """QUICK's smoke and its smallest speed block (3 candidates of an MLP), on the CPU, with
    the limits scaled for a loaded machine: every JSON complete and the returned folder within the limits."""
    out, work = tmp_path / "out", tmp_path / "work"
    env = {**os.environ, "QUICK": "1", "QUICK_SCALE": "5", "ONLY": "smoke,speed_r18", "OUT": str(out),
           "WORK": str(work), "PYTHON": sys.executable}
    proc = subprocess.run(["bash", "benchmarks/device_checks.sh"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    files = {f.name: f for f in returned(out)}
    assert set(files) == {"smoke.json", "speed_r18.json", "logs.tar.gz"}, files
    smoke = json.loads(files["smoke.json"].read_text())
    assert smoke["status"] == "complete" and smoke["backend"] == "cpu" and smoke["jit_ok"] is True
    speed = json.loads(files["speed_r18.json"].read_text())
    assert speed["status"] == "complete" and speed["block"]["exit"] == 0
    rows = speed["runs"]["determinism"]["rows"]
    assert [r["candidate"] for r in rows] == ["loop", "ceiling", "vmap:grouped"]
    assert all(r["replica_images_per_s"] > 0 for r in rows) and rows[0]["vs_loop"] == 1.0
    # the baseline is the loop a study runs on this backend: on CPU its epoch driven step by step
    assert rows[0]["epoch_shape"] == "step"
    assert any(p.name.endswith("-cache") for p in (work / "jax_cache").iterdir())  # the blocks share a filled cache
