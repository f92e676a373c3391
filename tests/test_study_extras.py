"""The mitigations preset and the instruments end to end through the sweep CLI, on digits."""

import csv
import json
import os
import subprocess
import sys

import numpy as np
import pytest

ENV = {**os.environ, "JAX_DISABLE_MOST_OPTIMIZATIONS": "1", "JAX_PLATFORMS": "cpu"}


def sweep(*args):
    return subprocess.run([sys.executable, "-m", "nondet_jax.sweep", *args, "--no-progress"], capture_output=True,
                          text=True, env=ENV, timeout=900)


@pytest.mark.slow
def test_mitigations_preset_runs_end_to_end_on_digits(tmp_path):
    out = tmp_path / "run"
    # The preset as shipped, shortened: MLP, 3 epochs (3 snapshot cycles of 1 epoch), 3 replicas.
    proc = sweep("--preset", "mitigations", "--model", "mlp", "--epochs", "3", "--replicas", "3",
                 "--set", "optim.warmup_epochs=0.5", "--arms", "init,init@snapshot3", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    snaps = np.load(out / "snapshots" / "init@snapshot3.npy")
    assert snaps.shape == (3, 3, 360, 10)
    np.testing.assert_array_equal(snaps[:, -1], np.load(out / "logits" / "init@snapshot3.npy"))  # last = final
    assert not np.array_equal(snaps[:, 0], snaps[:, 1])
    tta = np.load(out / "tta" / "init.npz")
    assert tta.files == ["crop3"] and tta["crop3"].shape == (3, 360, 10)
    summary = json.loads((out / "summary.json").read_text())
    variants = summary["mitigations"]["init"]
    assert list(variants) == ["single", "tta:crop3", "snapshot3", "snapshot3 last"]
    assert variants["single"]["replicas"] == 3 and "accuracy_vs_reference" in variants["snapshot3"]
    report = (out / "report.md").read_text()
    assert "## Mitigations" in report and "| init | snapshot3 | 3 |" in report
    # The snapshot arm is the plain arm under another schedule: same keys, so the replicas start alike
    # (the pairwise weight distances at init are equal) and then part (the final weights differ).
    h_plain, h_snap = np.load(out / "history" / "init.npz"), np.load(out / "history" / "init@snapshot3.npz")
    np.testing.assert_array_equal(h_plain["weight_distance"][0], h_snap["weight_distance"][0])
    assert h_plain["weight_distance"][0].min() > 0  # and the init arm's replicas do differ from each other
    w_plain, w_snap = np.load(out / "weights" / "init.npz"), np.load(out / "weights" / "init@snapshot3.npz")
    assert w_plain.files == w_snap.files
    assert any(not np.array_equal(w_plain[k], w_snap[k]) for k in w_plain.files if k.startswith("params"))


def test_instruments_from_the_cli_fill_the_run_folder(tmp_path):
    out = tmp_path / "run"
    proc = sweep("--model", "mlp", "--epochs", "2", "--replicas", "2", "--batch-size", "256", "--arms", "init",
                 "--instruments", "economy", "--set", "instruments.every=2", "--set", "optim.momentum=0",
                 "--set", "optim.weight_decay=0", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    values = np.load(out / "instruments" / "init.npz")
    np.testing.assert_array_equal(values["step"], [0, 2, 4, 6, 8])  # 5 steps per epoch, every 2nd
    assert values["Loss"].shape == (2, 5) and np.isfinite(values["Loss"]).all()
    np.testing.assert_allclose(values["Loss"], values["loss"], rtol=1e-5)  # the instrument sees the step's loss
    assert np.isfinite(values["Alpha"]).all()  # finished at the untracked next step, stored at the tracked one
    rows = list(csv.DictReader((out / "instruments" / "init.csv").open()))
    assert set(rows[0]) == {"step", "arm", "replica", "quantity", "layer", "value"}
    assert {r["quantity"] for r in rows} >= {"Loss", "GradNorm", "Distance", "UpdateSize"}
    assert (out / "figures" / "instruments_init.png").stat().st_size > 10_000
    # every arm's instruments in one long table at the folder's top level (what to_frame("instruments") reads)
    long = list(csv.DictReader((out / "instruments.csv").open()))
    assert list(long[0]) == ["arm", "replica", "step", "quantity", "value"]
    assert len(long) == len(rows) and {r["arm"] for r in long} == {"init"}
    loss = {(int(r["replica"]), int(r["step"])): float(r["value"]) for r in long if r["quantity"] == "Loss"}
    assert loss == {(r, int(t)): float(values["Loss"][r, i]) for r in range(2) for i, t in enumerate(values["step"])}
    assert any(r["quantity"].startswith("GradNorm/") for r in long)  # a layer's value under its full name
    from nondet_jax.api import StudyResult  # the frame is typed (its CSV is text: groupby().mean() raised)
    frame = StudyResult(out, json.loads((out / "summary.json").read_text())).to_frame("instruments")
    assert str(frame["replica"].dtype) == "int64" and str(frame["step"].dtype) == "int64"
    assert frame.groupby("quantity")["value"].mean()["Loss"] == pytest.approx(float(values["Loss"].mean()), rel=1e-6)


def test_sharded_strategy_from_the_cli_over_two_host_devices(tmp_path):
    out = tmp_path / "run"
    env = {**ENV, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    proc = subprocess.run([sys.executable, "-m", "nondet_jax.sweep", "--model", "mlp", "--epochs", "1", "--replicas",
                           "3", "--batch-size", "256", "--arms", "control,init", "--strategy", "sharded",
                           "--no-progress", "--out", str(out)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr
    environment = json.loads((out / "environment.json").read_text())
    assert environment["strategy"]["chosen"] == "sharded" and len(environment["devices"]) == 2
    record = json.loads((out / "arms" / "control.json").read_text())
    assert record["strategy"] == "sharded" and record["replicas_bitwise_identical"]
    assert np.load(out / "logits" / "init.npy").shape == (3, 360, 10)


@pytest.mark.slow
def test_eval_every_keeps_test_curves_and_best_epochs(tmp_path):
    """study.eval_every: every replica's test curve in the history, its last point the table's score,
    the best epoch and score per replica with intervals in the record and the report, a figure, the
    TensorBoard test scalars at every evaluated epoch; a snapshot arm keeps only its cycles' snapshots."""
    out = tmp_path / "run"
    proc = sweep("--model", "mlp", "--epochs", "4", "--replicas", "3", "--arms", "init,init@snapshot2",
                 "--set", "study.eval_every=3", "--set", "metrics.lmc_pairs=0", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    h = np.load(out / "history" / "init.npz")
    np.testing.assert_array_equal(h["test_epochs"], [3, 4])  # every 3 epochs, and after the last
    rows = [r for r in csv.DictReader((out / "replicas.csv").open()) if r["arm"] == "init" and r["metric"] == "test_accuracy"]
    np.testing.assert_allclose(100 * h["test_accuracy"][:, -1], [float(r["value"]) for r in rows], rtol=1e-12)
    rec = json.loads((out / "arms" / "init.json").read_text())["over_training"]
    np.testing.assert_allclose(rec["best"]["values"], h["test_accuracy"].max(1))
    assert all(e in (3, 4) for e in rec["best_epoch"]["values"]) and len(rec["best"]["std_ci"]) == 2
    report = (out / "report.md").read_text()
    assert "## Test scores over training" in report and "| init@snapshot2 |" in report
    assert (out / "figures" / "test_curves.png").stat().st_size > 10_000
    assert np.load(out / "snapshots" / "init@snapshot2.npy").shape == (3, 2, 360, 10)  # its 2 cycles, not 3 points
    from nondet_jax.report.tensorboard import arm_scalars

    assert [e for e, _ in arm_scalars(out, "init")[0]["test/accuracy"]] == [3, 4]
