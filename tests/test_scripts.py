"""Every script that imports the package runs here, at least as far as ``--help`` (imports and argument
parsing), and the variants that patch the model's layers in their smallest mode: a script that nothing
runs breaks silently when the package moves."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted([*ROOT.glob("benchmarks/*.py"), *ROOT.glob("experiments/*.py")])
LIBRARIES = {"benchmarks/convs.py"}  # imported by the other benchmarks, not run
ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}


def run(*args, timeout=600):
    return subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, cwd=ROOT, env=ENV,
                          timeout=timeout)


def test_the_script_list_is_not_empty():
    assert len(SCRIPTS) >= 15 and all(p.exists() for p in SCRIPTS)


@pytest.mark.parametrize("script", [p.relative_to(ROOT).as_posix() for p in SCRIPTS
                                    if p.relative_to(ROOT).as_posix() not in LIBRARIES])
def test_script_help(script):
    proc = run(script, "--help", timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage:" in proc.stdout


def test_benchmark_library_imports():
    proc = run("-c", "import sys; sys.path.insert(0, 'benchmarks'); import convs; print(convs.kernel_conv)")
    assert proc.returncode == 0 and "function kernel_conv" in proc.stdout, proc.stderr[-2000:]


def test_shell_scripts_parse():
    for sh in ROOT.glob("benchmarks/*.sh"):
        proc = subprocess.run(["bash", "-n", str(sh)], capture_output=True, text=True)
        assert proc.returncode == 0, (sh, proc.stderr)


@pytest.mark.slow
def test_conv_paths_quick_runs_and_names_the_paths(tmp_path):
    proc = run("benchmarks/conv_paths.py", "--quick", "--out", tmp_path / "c.json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {(r["case"], r["variant"].split(" ")[0]): r for r in json.loads((tmp_path / "c.json").read_text())["rows"]}
    assert rows["swap", "lax"]["swapped_convolutions"] > 0 and rows["swap", "models'"]["swapped_convolutions"] == 0
    assert all(r["max_abs_difference"] < 1e-4 for r in rows.values())


@pytest.mark.slow
def test_step_profile_plain_conv_runs():
    proc = run("benchmarks/step_profile.py", "--conv", "plain", "--steps", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ms" in proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("row", ["plain_conv", "nchw", "matmul"])
def test_peer_pytorch_conv_variants_run(row):
    # the JAX side of a row runs in a child of its own (no torch needed): ResNet-14 with the patched conv
    proc = run("benchmarks/peer_pytorch.py", "--child", row, "--steps", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "RESULT " in proc.stdout


def test_peer_pytorch_rows_run_with_the_flags_a_study_would_set(monkeypatch):
    """A row that names no flags of its own times what ``python -m nondet_jax.sweep`` runs on this CPU type."""
    from nondet_jax.machine import xla_flags as flags

    monkeypatch.setattr(flags, "cpu_type", lambda: "x86_64-avx2")  # a type whose rule sets a flag for sequential
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import peer_pytorch as pp
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    from nondet_jax.machine import xla_flags

    rule = " ".join(xla_flags.cpu_defaults(strategy="sequential"))
    assert rule and pp.row_flags(pp.ROWS["seq1"][1]) == rule and "CPU rule" in pp.describe("seq1")
    assert pp.row_flags(pp.ROWS["vmap4"][1]) == ""  # the rule holds for sequential, not vmap
    assert pp.row_flags(pp.ROWS["seq1_jaxlib"][1]) == ""  # jaxlib's own defaults
    assert pp.row_flags(pp.ROWS["seq1_no_ynn"][1]) == pp.FLAG_SETS["no_ynn"]  # a row's own flags win
    assert "CPU rule" not in pp.describe("seq1_jaxlib")


@pytest.mark.slow
def test_replica_speed_smallest_run_writes_every_row(tmp_path):
    out = tmp_path / "speed.json"
    proc = run("benchmarks/replica_speed.py", "--model", "mlp", "--replicas", "2", "--steps", "2", "--epochs", "1",
               "--candidates", "loop,ceiling,vmap:rhs=bgc,unrolled", "--flags", "default", "--out", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["runs"]["default"]["rows"]
    assert [r["candidate"] for r in rows] == ["loop", "ceiling", "vmap:rhs=bgc", "unrolled"]
    assert all("error" not in r and r["replica_images_per_s"] > 0 for r in rows)
    assert rows[0]["vs_loop"] == 1.0 and rows[1]["of_ceiling"] == 1.0
    assert rows[-1]["position_invariant"] is True  # the fused loop computes what sequential does


@pytest.mark.slow
def test_peer_cockpit_jax_side_runs_and_hessmaxev_matches_the_dense_hessian(tmp_path):
    out = tmp_path / "peer.json"
    proc = run("benchmarks/peer_cockpit.py", "--jax-only", "--quick", "--out", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    for model in ("mlp", "cnn"):
        rows = res["values"][model]["rows"]
        assert all(all(abs(v) < float("inf") for v in row["ours"]) for row in rows.values()), model
    top = res["values"]["mlp"]["rows"]["HessMaxEV"]
    assert top["ours_within_stated_error"] and top["ours_rel_err_vs_dense"] < 1e-9
    assert {(r["config"], r["every"], r["schedule_read"]) for r in res["speed"]["rows"]} >= {
        ("off", None, None), ("full", 16, "python"), ("full", 16, "device"), ("economy", 1, "python")}
    assert all(r["ms_per_step"] > 0 for r in res["speed"]["rows"])


@pytest.mark.slow
def test_peer_cockpit_values_agree_with_the_real_cockpit(tmp_path):
    """Needs the peer (pip install ".[peer]"): every quantity both compute exactly agrees in float64."""
    for module in ("torch", "backpack", "cockpit"):
        pytest.importorskip(module)
    out = tmp_path / "peer.json"
    proc = run("benchmarks/peer_cockpit.py", "--part", "values", "--quick", "--out", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for model, r in json.loads(out.read_text())["values"].items():
        for q, row in r["rows"].items():
            if "max_count_diff" in row:
                assert row["max_count_diff"] == 0, (model, q)
            elif q != "HessMaxEV":  # approximate in both (Lanczos, power iteration): checked against dense
                assert row["max_rel_diff"] < 1e-12, (model, q, row["max_rel_diff"])
    assert json.loads(out.read_text())["values"]["mlp"]["rows"]["HessMaxEV"]["ours_within_stated_error"]


def test_peer_study_is_the_default_study():
    """benchmarks/peer_study_pytorch.py writes the sources preset out by hand: a preset change must show here."""
    import importlib.util

    import yaml

    from nondet_jax.arms import arm_sources
    from nondet_jax.data import digits
    from nondet_jax.data.pipeline import default_crop_padding

    spec = importlib.util.spec_from_file_location("peer_study", ROOT / "benchmarks/peer_study_pytorch.py")
    ps = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ps)  # no torch needed to import it
    preset = yaml.safe_load((ROOT / "nondet_jax/presets/sources.yaml").read_text())
    assert preset["model"]["name"] == "resnet8" and preset["data"]["name"] == "digits"
    assert (preset["data"]["augment"], preset["data"]["flip"]) == ("on", "off")
    o, t, s = preset["optim"], preset["train"], preset["study"]
    assert (o["name"], o["schedule"]) == ("sgd", "cosine") and not o.get("nesterov")
    assert (o["lr"], o["momentum"], o["weight_decay"], o["warmup_epochs"]) == (
        ps.LR, ps.MOMENTUM, ps.WEIGHT_DECAY, ps.WARMUP_EPOCHS)
    assert (t["epochs"], t["batch_size"]) == (ps.EPOCHS, ps.BATCH)
    assert (tuple(s["arms"]), s["replicas"], s["seed"]) == (ps.ARMS, ps.REPLICAS, ps.STUDY_SEED)
    assert ps.CROP_PADDING == default_crop_padding(8)
    assert (ps.TEST_SIZE, ps.SPLIT_SEED) == (digits.TEST_SIZE, digits.SPLIT_SEED)
    for arm in ps.ARMS:  # the arms vary the same sources (the model has no dropout)
        assert set(ps.VARIES[arm]) == set(arm_sources(arm)) - {"dropout"}, arm


@pytest.mark.slow
def test_peer_study_quick_runs_both_sides(tmp_path):
    pytest.importorskip("torch")
    out = tmp_path / "peer_study.json"
    proc = run("benchmarks/peer_study_pytorch.py", "--quick", "--out", out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    for side in ("nondet_jax", "pytorch"):
        assert res[side]["wall_s"] > 0
        assert list(res[side]["table"]) == ["control", "init"], side
        assert all(0 < row["accuracy_mean_pct"] <= 100 for row in res[side]["table"].values()), side
        assert res[side]["table"]["control"]["accuracy_std_pct"] == 0.0, side  # control: identical replicas
    assert res["pytorch"]["table"]["control"]["bitwise_identical"] is True
    assert res["nondet_jax"]["persistent_compile_cache_used"] is False
    assert res["ratio"] == pytest.approx(res["nondet_jax"]["wall_s"] / res["pytorch"]["wall_s"], rel=1e-2)
    assert res["pytorch"]["threads"] in (1, 2) and set(res["load_average"]) == {"before", "between", "after"}
    assert "wall clock: nondet_jax" in proc.stdout


def test_step_overhead_times_the_library_step_against_a_bare_one(tmp_path):
    out = tmp_path / "step.json"
    proc = run("benchmarks/step_overhead.py", "--rounds", "1", "--steps", "2", "--out", out)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert set(result["median_ms"]) == {"library", "bare", "forward", "threads"} and result["threads"] == 2
    assert all(v > 0 for v in result["median_ms"].values()) and result["library_vs_bare"] > 0


def test_study_overheads_runs_and_checks_each_piece_is_the_same_answer(tmp_path):
    """benchmarks/study_overheads.py times each piece before and now and asserts both give the same answer."""
    out = tmp_path / "overheads.json"
    proc = run("benchmarks/study_overheads.py", "--rounds", "1", "--out", out)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert set(rows) == {"spread tests", "ratio design figure", "replicas of an epoch", "flag check"}
    assert all(r["before_median"] > 0 for r in rows.values())
