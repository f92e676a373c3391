"""Crash safety: orbax checkpoints, resume after SIGKILL bitwise, divergence isolation, corruption."""

import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import conftest
import jax
import numpy as np
import pytest
from conftest import spec_of, tiny_config, tree_equal

from nondet_jax.machine import xla_flags
from nondet_jax.replicas.choice import make_strategy
from nondet_jax.replicas.loop import EpochState, train_replicas
from nondet_jax.sources import arm_keys, arm_sources, perturbations
from nondet_jax.store.checkpoint import (
    ArmCheckpoints,
    CorruptCheckpoint,
    key_fingerprint,
)
from nondet_jax.train import make_train

ENV = {**os.environ, "JAX_DISABLE_MOST_OPTIMIZATIONS": "1", "JAX_PLATFORMS": "cpu"}
STUDY = ["--model", "mlp", "--epochs", "5", "--replicas", "3", "--batch-size", "256", "--arms", "control,init,all",
         "--set", "train.checkpoint_seconds=0", "--no-progress"]  # a checkpoint every epoch: kills land mid-arm
RESULTS = ("arms/", "logits/", "features/", "history/", "weights/", "pairs/")


def sweep(*args, env=None):
    return subprocess.run([sys.executable, "-m", "nondet_jax.sweep", *args], capture_output=True, text=True,
                          env=env or ENV, timeout=600)


def digests(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and str(p.relative_to(folder)).startswith(RESULTS)
            and not p.name.startswith(".")}


def assert_same_results(out: Path, clean: Path) -> None:
    """Every file of ``out`` byte for byte that of ``clean``; arm records up to their timings."""
    assert digests(out).keys() == digests(clean).keys()
    for name, digest in digests(clean).items():
        if name.startswith("arms/"):
            a, b = json.loads((clean / name).read_text()), json.loads((out / name).read_text())
            assert without_timing(a) == without_timing(b), name
        else:
            assert digests(out)[name] == digest, name


def without_timing(record: dict) -> dict:
    return {k: v for k, v in record.items() if k not in ("seconds", "files", "record_sha256")}


@pytest.fixture(scope="module")
def arm(small_digits):
    config = tiny_config(**{"model.name": "resnet8", "train.epochs": 3})
    fns = make_train(config, spec_of(small_digits))
    varied = arm_sources("all")
    return fns, arm_keys(0, varied, 2), perturbations(varied), make_strategy(fns, "sequential")


def test_checkpoint_restores_exactly_the_saved_state_and_resumes_bitwise(arm, small_digits, tmp_path):
    fns, keys, perturb, strategy = arm
    ckpt = ArmCheckpoints(tmp_path / "ck", every=1)
    saved = {}

    def on_epoch(p):
        ckpt.save(p, {"keys_sha256": key_fingerprint(keys)})
        saved[p.epoch] = p

    full = train_replicas(strategy, keys, perturb, small_digits, 3, on_epoch=on_epoch)
    assert ckpt.steps() == [2, 3]  # two kept
    target = jax.eval_shape(strategy.init, keys, perturb, small_digits.x_train[:1])
    epoch, state, steps, wd, _ = ckpt.restore_latest(target, {"keys_sha256": key_fingerprint(keys)})
    assert epoch == 3 and tree_equal(state, saved[3].state) and tree_equal(steps, saved[3].steps)
    assert jax.tree.structure(state) == jax.tree.structure(saved[3].state)  # optax NamedTuples, Health
    np.testing.assert_array_equal(wd, saved[3].weight_distance)
    # Resume from epoch 2: the last epoch again gives bitwise the uninterrupted result.
    ckpt.close()
    for p in (tmp_path / "ck" / "orbax" / "3", tmp_path / "ck" / "sha256" / "3.json"):
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    restored = ArmCheckpoints(tmp_path / "ck").restore_latest(target, {"keys_sha256": key_fingerprint(keys)})
    assert restored[0] == 2
    resumed = train_replicas(strategy, keys, perturb, small_digits, 3, start=EpochState(*restored))
    assert tree_equal(resumed.state, full.state)
    np.testing.assert_array_equal(resumed.logits, full.logits)
    np.testing.assert_array_equal(resumed.train_loss, full.train_loss)
    np.testing.assert_array_equal(resumed.weight_distance, full.weight_distance)


def test_checkpoints_wait_for_checkpoint_seconds_and_resume_bitwise(arm, small_digits, tmp_path, monkeypatch):
    """A due epoch is saved once ``seconds`` have passed since the last save (or the arm's start): with a clock
    at 4 s per epoch and 10 s, epochs 3 and 6 of 6; resuming from epoch 3 gives the uninterrupted result."""
    from nondet_jax.store import checkpoint

    fns, keys, perturb, strategy = arm
    clock = iter(range(0, 1000, 4))
    monkeypatch.setattr(checkpoint, "_clock", lambda: next(clock))
    ckpt = ArmCheckpoints(tmp_path / "ck", every=1, keep=5, seconds=10)  # the clock reads 0 at the start
    full = train_replicas(strategy, keys, perturb, small_digits, 6,
                          on_epoch=lambda p: ckpt.save(p, {"keys_sha256": key_fingerprint(keys)}))
    ckpt.close()
    assert ckpt.steps() == [3, 6]
    target = jax.eval_shape(strategy.init, keys, perturb, small_digits.x_train[:1])
    for p in (tmp_path / "ck" / "orbax" / "6", tmp_path / "ck" / "sha256" / "6.json"):
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    restored = ArmCheckpoints(tmp_path / "ck").restore_latest(target, {"keys_sha256": key_fingerprint(keys)})
    resumed = train_replicas(strategy, keys, perturb, small_digits, 6, start=EpochState(*restored))
    assert restored[0] == 3 and tree_equal(resumed.state, full.state)


def test_a_checkpoint_resumes_only_under_the_xla_flags_it_was_written_with(arm, small_digits, tmp_path):
    fns, keys, perturb, strategy = arm
    written = xla_flags.kernel_flags("--xla_cpu_enable_fast_math=false --xla_dump_to=/tmp/x")
    assert written == "--xla_cpu_enable_fast_math=false"  # dump and log flags do not change kernels
    ckpt = ArmCheckpoints(tmp_path / "ck", every=1)
    train_replicas(strategy, keys, perturb, small_digits, 1, on_epoch=lambda p: ckpt.save(p, {"xla_flags": written}))
    ckpt.close()
    target = jax.eval_shape(strategy.init, keys, perturb, small_digits.x_train[:1])
    assert ArmCheckpoints(tmp_path / "ck").restore_latest(target, {"xla_flags": written}) is not None
    with pytest.raises(CorruptCheckpoint, match="xla_flags differs"):
        ArmCheckpoints(tmp_path / "ck").restore_latest(target, {"xla_flags": xla_flags.kernel_flags(
            "--xla_cpu_enable_fast_math=false --xla_cpu_experimental_ynn_fusion_type=-individual_convolution")})


def test_corrupt_or_foreign_checkpoint_is_detected_and_half_saved_one_discarded(arm, small_digits, tmp_path):
    fns, keys, perturb, strategy = arm
    ckpt = ArmCheckpoints(tmp_path / "ck", every=2)
    train_replicas(strategy, keys, perturb, small_digits, 2, on_epoch=lambda p: ckpt.save(p, {"k": 1}))
    ckpt.close()
    assert ckpt.steps() == [2]  # every=2: epoch 1 was not saved
    target = jax.eval_shape(strategy.init, keys, perturb, small_digits.x_train[:1])
    with pytest.raises(CorruptCheckpoint, match="different run"):
        ArmCheckpoints(tmp_path / "ck").restore_latest(target, {"k": 2})
    # a checkpoint from before the epoch shape was recorded (or of another shape) is another run's
    with pytest.raises(CorruptCheckpoint, match="epoch_shape differs: it was written with another epoch shape"):
        ArmCheckpoints(tmp_path / "ck").restore_latest(target, {"k": 1, "epoch_shape": "step"})
    # nor one whose epochs ran under other XLA flags (a resume would continue the arm under other kernels)
    with pytest.raises(CorruptCheckpoint, match="xla_flags differs: it was written with other XLA flags"):
        ArmCheckpoints(tmp_path / "ck").restore_latest(target, {"k": 1, "xla_flags": "--xla_cpu_enable_fast_math=true"})
    data = max((p for p in (tmp_path / "ck" / "orbax" / "2").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])  # truncate the biggest file
    with pytest.raises(CorruptCheckpoint, match="does not match its sha256 manifest"):
        ArmCheckpoints(tmp_path / "ck").restore_latest(target, {"k": 1})
    (tmp_path / "ck" / "sha256" / "2.json").unlink()  # as if killed between orbax's commit and the manifest
    assert ArmCheckpoints(tmp_path / "ck").restore_latest(target, {"k": 1}) is None
    assert not (tmp_path / "ck" / "orbax" / "2").exists()


def test_divergent_replica_is_frozen_recorded_and_left_out(tmp_path):
    out = tmp_path / "run"
    proc = sweep(*STUDY[:-1], "--epochs", "3", "--out", str(out), "--no-progress",
                 env={**ENV, "NONDET_JAX_INJECT_FAULT": "all:1:1"})
    assert proc.returncode == 0, proc.stderr
    assert "replica 1 diverged at step 5" in proc.stdout  # 5 steps per epoch: epoch 1 starts at step 5
    record = json.loads((out / "arms" / "all.json").read_text())
    assert record["replicas"] == 3 and record["replicas_used"] == 2
    assert record["diverged"][0]["replica"] == 1 and record["diverged"][0]["step"] == 5
    assert np.isfinite(record["diverged"][0]["last_finite_loss"])
    assert [r["diverged_at_step"] for r in record["rows"]] == [-1, 5, -1]
    pairs = np.load(out / "pairs" / "all.npz")
    assert pairs["accuracy"].shape == (2,) and pairs["disagreement"].shape == (1,)
    weights = np.load(out / "weights" / "all.npz")
    assert np.isnan(weights[[k for k in weights.files if k.startswith("params/")][0]][1]).all()  # frozen as it was
    summary = json.loads((out / "summary.json").read_text())
    assert "all" in summary["arms"] and summary["vs_all"]["init"]["accuracy"]["ratio"] > 0
    report = (out / "report.md").read_text()
    assert "diverged (left out of every metric; R counts the rest): all 1 of 3 (replica 1 at step 5)" in report
    assert "diverged (left out" in proc.stdout
    history = np.load(out / "history" / "all.npz")
    assert np.isnan(history["train_loss"][1, 1:]).all() and np.isfinite(history["train_loss"][[0, 2]]).all()


def marks(out: Path) -> set[str]:
    """EpochState marks of a running study: finished arms and written checkpoints."""
    return {str(p) for pattern in ("arms/*.json", "checkpoints/*/sha256/*.json") for p in out.glob(pattern)}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    """STUDY run to the end without interruption: the reference of every kill-and-resume test."""
    clean = tmp_path_factory.mktemp("uninterrupted") / "clean"
    proc = sweep(*STUDY, "--out", str(clean))
    assert proc.returncode == 0, proc.stderr
    return clean


@pytest.mark.slow
def test_sigkill_at_random_moments_then_resume_gives_bitwise_the_uninterrupted_study(tmp_path, uninterrupted):
    clean = uninterrupted
    out = tmp_path / "killed"
    rng = random.Random(7)
    kills = 0
    for attempt in range(4):  # 3 kills, each after 1-3 new checkpoints or arms plus a seeded delay; then finish
        p = subprocess.Popen([sys.executable, "-m", "nondet_jax.sweep", *STUDY, "--out", str(out)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV, text=True)
        seen, target, count = marks(out), rng.randint(1, 3), 0
        while attempt < 3 and p.poll() is None:
            new = marks(out) - seen
            seen |= new
            count += len(new)
            if count >= target:
                time.sleep(rng.uniform(0.0, 0.3))
                p.send_signal(signal.SIGKILL)
                p.wait()
                kills += 1
                break
            time.sleep(0.02)
        if p.returncode == -signal.SIGKILL:
            # What a killed run leaves: every result file present is complete (its arm record lists it).
            for rec_path in (out / "arms").glob("*.json"):
                rec = json.loads(rec_path.read_text())
                for rel, digest in rec["files"].items():
                    assert hashlib.sha256((out / rel).read_bytes()).hexdigest() == digest
            continue
        stdout, stderr = p.communicate()
        assert p.returncode == 0, stderr
        break
    assert kills >= 2, "the kills missed the run; the test proves nothing"
    assert_same_results(out, clean)
    assert not list(out.rglob(".*.tmp")) and not any((out / "checkpoints").iterdir())


def test_recompute_repairs_a_corrupt_arm_and_resume_reuses_the_folder(tmp_path, monkeypatch):
    from nondet_jax.cli import sweep

    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
    out = tmp_path / "run"
    fast = ["--model", "mlp", "--epochs", "1", "--replicas", "2", "--batch-size", "256", "--no-progress"]
    assert sweep.main([*fast, "--arms", "control,init", "--out", str(out)]) == 0
    good = digests(out)
    logits = out / "logits" / "init.npy"
    logits.write_bytes(logits.read_bytes()[:-8])
    assert sweep.main(["--resume", str(out)]) == 2  # refused: names the file and --recompute
    assert sweep.main(["--resume", str(out), "--recompute", "init"]) == 0
    assert {k: v for k, v in digests(out).items() if not k.startswith("arms/")} == \
        {k: v for k, v in good.items() if not k.startswith("arms/")}
    assert sweep.main(["--resume", str(out)]) == 0  # nothing to do: both arms reused
    # the command that made the folder stays first, the repairs after it (a --resume replaced it; outside review)
    made = (out / "command.txt").read_text().splitlines()
    assert f"--arms control,init --out {out}" in made[0] and made[1:] == [
        f"{made[1].split(' --resume')[0]} --resume {out} --recompute init", f"{made[1].split(' --resume')[0]} --resume {out}"]


FAST = [*conftest.FAST, "--epochs", "2"]  # each test names its replicas


@pytest.fixture
def in_process(monkeypatch):
    """sweep.main in this process (its XLA_FLAGS edits undone afterwards)."""
    from nondet_jax.cli import sweep

    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
    return sweep


def _diverged_study_checks(out: Path, capsys, arms: dict[str, int]):
    """Exit 0, every arm stored with its diverged count, table/CSV/figures say so, rerun reuses."""
    import csv

    for arm, n in arms.items():
        record = json.loads((out / "arms" / f"{arm}.json").read_text())
        assert len(record["diverged"]) == n and record["replicas_used"] == record["replicas"] - n
        assert (record["metrics"] == {}) == (n == record["replicas"])
    rows = {r["arm"]: r for r in csv.DictReader((out / "arms.csv").open())}
    assert {a: int(rows[a]["diverged"]) for a in arms} == arms
    report = (out / "report.md").read_text()
    assert "diverged (left out of every metric" in report and (out / "figures" / "accuracy.png").exists()
    if any(n == json.loads((out / "arms" / f"{a}.json").read_text())["replicas"] for a, n in arms.items()):
        assert "n/a" in report
    before = digests(out)
    capsys.readouterr()
    assert sweep_main_resume(out) == 0
    printed = capsys.readouterr().out
    assert all(f"arm {a}: already finished" in printed for a in arms) and "diverged at step" not in printed
    assert digests(out) == before


def sweep_main_resume(out: Path) -> int:
    from nondet_jax.cli import sweep

    return sweep.main(["--resume", str(out), "--no-progress"])


def test_every_replica_diverged_is_a_stored_result(in_process, tmp_path, capsys):
    out = tmp_path / "run"
    assert in_process.main([*FAST, "--replicas", "2", "--lr", "1e4", "--arms", "control,init", "--out", str(out)]) == 0
    _diverged_study_checks(out, capsys, {"control": 2, "init": 2})
    assert ",2," in (out / "arms.csv").read_text()


def test_one_replica_arm_fully_diverged_next_to_a_healthy_one(in_process, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("NONDET_JAX_INJECT_FAULT", "control:0:1")
    out = tmp_path / "run"
    assert in_process.main([*FAST, "--replicas", "1", "--set", "metrics.pairwise=false", "--arms", "control,init",
                            "--out", str(out)]) == 0
    _diverged_study_checks(out, capsys, {"control": 1, "init": 0})


def test_a_replica_diverged_at_its_first_step_has_no_last_finite_loss(in_process, tmp_path, capsys, monkeypatch):
    """It was logged with 'last finite loss nan' (outside review)."""
    monkeypatch.setenv("NONDET_JAX_INJECT_FAULT", "init:1:0")
    out = tmp_path / "run"
    assert in_process.main([*FAST, "--replicas", "2", "--set", "metrics.pairwise=false", "--arms", "init",
                            "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert "replica 1 diverged at step 0 (its training loss stopped being finite; no finite loss before it)" in said
    assert "nan" not in said.split("diverged at step 0")[1].split("\n")[0]

def test_non_finite_outputs_with_finite_losses_count_as_divergence(in_process, tmp_path, capsys, monkeypatch):
    from nondet_jax.study import arm

    real = arm.make_strategy

    def poisoned(fns, name):  # replica 1's test logits overflow although every training loss was finite
        s = real(fns, name)

        def evaluate_poisoned(state, x):
            logits, feats = s.evaluate(state, x)
            logits = np.array(logits)
            logits[1, 0, 0] = np.inf
            return logits, feats

        return s._replace(evaluate=evaluate_poisoned)

    monkeypatch.setattr(arm, "make_strategy", poisoned)
    out = tmp_path / "run"
    assert in_process.main([*FAST, "--replicas", "3", "--arms", "init", "--out", str(out)]) == 0
    record = json.loads((out / "arms" / "init.json").read_text())
    assert [d["replica"] for d in record["diverged"]] == [1] and record["diverged"][0]["step"] == 9  # the last of 2 x 5 steps
    assert record["replicas_used"] == 2 and np.isfinite(record["metrics"]["accuracy"]["std"])
    _diverged_study_checks(out, capsys, {"init": 1})


# sweep.main with the signal handling of nondet_jax.machine.signals installed first, as the CLI's main does
# the handlers first, then the heavy imports, as the console scripts do (nondet_jax.cli.run_command): a
# signal sent during the seconds of importing flax and JAX on a loaded machine must find them installed
SWEEP_WITH_SIGNALS = ("import sys; from nondet_jax.machine import signals; signals.install(); from nondet_jax.cli import sweep; "
                      "sys.exit(sweep.main(sys.argv[1:]))")
COMPILE_FOREVER = """
import sys
from nondet_jax.machine import signals
signals.install()
import jax, jax.numpy as jnp
def f(x):
    for i in range(3000):  # minutes of XLA compilation: a Ctrl-C must not wait for it
        x = jnp.sin(x) * (i + 1) + jnp.cos(x @ x.T)
    return x
print("compiling", flush=True)
jax.jit(f).lower(jnp.ones((64, 64))).compile()
print("compiled", flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("sig,status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_during_compilation_exits_at_once_with_one_line(sig, status):
    from nondet_jax.machine.signals import MESSAGE

    p = subprocess.Popen([sys.executable, "-c", COMPILE_FOREVER], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env=ENV, text=True)
    assert p.stdout.readline().strip() == "compiling"
    time.sleep(2.0)
    p.send_signal(sig)
    try:  # the compilation never ends on its own: leaving at all is leaving at once (the latency's figure is
        out, err = p.communicate(timeout=30)  # benchmarks/signal_latency.py's, not a timed assertion)
    except subprocess.TimeoutExpired:
        p.kill()
        raise AssertionError("the process did not leave within 30 s of the signal") from None
    assert p.returncode == status
    assert "compiled" not in out and "Traceback" not in err
    assert err.strip().splitlines()[-1] == MESSAGE and err.count(MESSAGE) == 1


@pytest.mark.slow
def test_sigint_and_sigterm_at_any_moment_then_resume_gives_bitwise_the_uninterrupted_study(tmp_path, uninterrupted):
    from nondet_jax.machine.signals import MESSAGE

    clean = uninterrupted
    out = tmp_path / "interrupted"
    rng = random.Random(11)
    plan = [(signal.SIGINT, 0), (signal.SIGTERM, 1), (signal.SIGINT, 2), (None, 0)]  # (signal, marks before it)
    for sig, target in plan:
        p = subprocess.Popen([sys.executable, "-c", SWEEP_WITH_SIGNALS, *STUDY, "--out", str(out)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV, text=True)
        seen = marks(out)
        if sig is not None:
            if target == 0:
                time.sleep(rng.uniform(1.0, 3.0))  # imports, data, first compilation
            else:
                while p.poll() is None and len(marks(out) - seen) < target:
                    time.sleep(0.02)
                time.sleep(rng.uniform(0.0, 0.3))
            p.send_signal(sig)
        stdout, stderr = p.communicate(timeout=600)
        if sig is not None and p.returncode != 0:
            assert p.returncode == {signal.SIGINT: 130, signal.SIGTERM: 143}[sig], stderr
            assert "Traceback" not in stderr and stderr.strip().splitlines()[-1] == MESSAGE, stderr
        else:
            assert p.returncode == 0, stderr
    assert_same_results(out, clean)
    assert not any((out / "checkpoints").iterdir())


@pytest.mark.slow
def test_compiled_programs_are_released_between_studies(tmp_path, monkeypatch):
    """A loop of studies with different settings in one process: with memory.release_compiled after
    each (the study core's call), the process's memory mappings stay bounded."""
    from nondet_jax.config import from_flat
    from nondet_jax.study import memory
    from nondet_jax.study.runner import run

    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
    counts = []
    for i in range(5):
        config = from_flat({"model.name": "mlp", "train.epochs": 1, "train.batch_size": 256, "study.replicas": 2,
                            "study.arms": "init", "optim.lr": 0.01 * (i + 1), "model.width": 1 + 0.25 * i})
        run(config, tmp_path / f"s{i}", progress=False, log=lambda *a, **k: None)
        memory.release_compiled()
        counts.append(memory.map_count())
    assert counts[0] > 0
    assert max(counts[2:]) <= counts[1] + 200, counts  # no growth per study once warm


def test_write_refusals_are_recognised_behind_orbax_errors():
    import errno

    from nondet_jax.store.checkpoint import write_refusal

    assert write_refusal(ValueError("Error writing local file: No space left on device")).errno == errno.ENOSPC
    try:
        try:
            raise OSError(errno.EROFS, "Read-only file system")
        except OSError as inner:
            raise RuntimeError("save failed") from inner
    except RuntimeError as e:
        assert write_refusal(e).errno == errno.EROFS
    assert write_refusal(ValueError("shape mismatch")) is None


def test_healthy_subset_of_one_replica_and_of_none():
    from nondet_jax.analysis.health import (
        bitwise_identical,
        flag_nonfinite_outputs,
        healthy_subset,
    )
    from nondet_jax.replicas.loop import ArmResult
    from nondet_jax.train import Health, TrainState

    def result(diverged, r, logits=None):
        state = TrainState({"w": np.zeros((r, 3))}, {}, None, Health(np.asarray(diverged, np.int32), np.zeros(r)))
        return ArmResult(state, np.zeros((r, 2)), np.zeros((r, 2)), np.zeros((r, 4, 3)) if logits is None else logits,
                         np.zeros((r, 4, 5)), np.zeros((3, r * (r - 1) // 2)), "sequential", 0.0,
                         {"loss": np.zeros((r, 10))}, np.zeros((r, 0, 4, 3)))

    one = healthy_subset(result([4], 1))
    assert one.logits.shape == (0, 4, 3) and one.weight_distance.shape == (3, 0)
    three = healthy_subset(result([-1, 3, -1], 3))
    assert three.logits.shape[0] == 2 and three.weight_distance.shape == (3, 1)
    logits = np.zeros((3, 4, 3))
    logits[2, 1, 0] = np.nan
    flagged = flag_nonfinite_outputs(result([-1, 3, -1], 3, logits))
    assert flagged.diverged_at.tolist() == [-1, 3, 9]  # replica 2 at the last step, replica 1 keeps its step
    assert bitwise_identical(logits, flagged.diverged_at) and not bitwise_identical(logits, [-1, -1, -1])


@pytest.mark.parametrize("mask,mode", [(0o022, 0o644), (0o027, 0o640), (0o077, 0o600)])
def test_result_files_get_the_umasks_permissions(tmp_path, mask, mode):
    from nondet_jax.store.io import atomic_write_bytes

    old = os.umask(mask)
    try:
        atomic_write_bytes(tmp_path / "sub" / "f.json", b"{}")
    finally:
        os.umask(old)
    assert (tmp_path / "sub" / "f.json").stat().st_mode & 0o777 == mode


def test_orphaned_checkpoints_of_a_finished_arm_are_removed_on_the_next_run(in_process, tmp_path):
    out = tmp_path / "run"
    args = ["--model", "mlp", "--epochs", "1", "--replicas", "2", "--batch-size", "256", "--no-progress",
            "--arms", "init", "--out", str(out)]
    assert in_process.main(args) == 0
    orphan = out / "checkpoints" / "init" / "orbax" / "1"  # as if killed between the record and the cleanup
    orphan.mkdir(parents=True)
    (orphan / "data").write_bytes(b"x")
    assert in_process.main(args) == 0
    assert not (out / "checkpoints" / "init").exists()


def test_closed_loop_errors_after_a_failed_save_stay_out_of_the_terminal(monkeypatch):
    """A full disk during a checkpoint printed the one-line error, then 'Event loop is closed' tracebacks that
    tensorstore's threads raise through threading.excepthook and sys.unraisablehook (only sys.excepthook was
    quieted). Every route is quiet for that error, and only for it."""
    import logging
    import threading
    import types

    from nondet_jax.store.checkpoint import quiet_after_failed_save

    seen = []
    for module, name in ((sys, "excepthook"), (threading, "excepthook"), (sys, "unraisablehook")):
        monkeypatch.setattr(module, name, lambda *a, _name=name: seen.append((_name, a[-2] if len(a) == 3 else
                                                                                 a[0].exc_value)))
    monkeypatch.setattr(logging.getLogger("asyncio"), "propagate", True)
    quiet_after_failed_save(None)
    quiet_after_failed_save(None)  # twice wraps each hook once
    closed, other = RuntimeError("Event loop is closed"), ValueError("something else")
    for value in (closed, other):
        sys.excepthook(type(value), value, None)
        threading.excepthook(types.SimpleNamespace(exc_type=type(value), exc_value=value, exc_traceback=None,
                                                   thread=None))
        sys.unraisablehook(types.SimpleNamespace(exc_type=type(value), exc_value=value, exc_traceback=None,
                                                 err_msg=None, object=None))
    assert seen == [("excepthook", other), ("excepthook", other), ("unraisablehook", other)]
