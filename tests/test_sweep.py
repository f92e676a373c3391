"""The sweep CLI end to end: the run folder, resume, determinism, and bad input (exit 2, nothing damaged)."""

import csv
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import CLI_ENV, FAST, sweep_cli

from nondet_jax.cli import sweep
from nondet_jax.config import from_flat
from nondet_jax.errors import UsageError
from nondet_jax.machine import xla_flags
from nondet_jax.store.run import RunStore
from nondet_jax.study import runner
from nondet_jax.study.prepare import default_out

ENV = CLI_ENV


def cli(*args, cwd=None):
    return sweep_cli(*args, cwd=cwd)


def snapshot(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != ".lock"}


def quiet(*_a, **_k):
    pass


@pytest.fixture(scope="module")
def run_dir(finished_run_template, tmp_path_factory):
    """The finished control,init study, copied once for this module's tests (one of them adds an arm)."""
    out = tmp_path_factory.mktemp("study") / "run"
    shutil.copytree(finished_run_template[0], out)
    return out, finished_run_template[1]


def test_cli_writes_the_run_folder(run_dir):
    out, proc = run_dir
    assert "control" in proc.stdout and "acc std %" in proc.stdout
    for name in ("config.json", "environment.json", "replicas.csv", "summary.json", "arms.csv", "report.md",
                 "command.txt", "figures/accuracy.png", "figures/spread.png", "figures/diversity.png",
                 "figures/lmc.png", "figures/divergence.png", "pairs/init.npz"):
        assert (out / name).is_file(), name
    report = (out / "report.md").read_text()
    assert "python -m nondet_jax.sweep" in report and "![spread](figures/spread.png)" in report
    arms = list(csv.DictReader((out / "arms.csv").open()))
    assert [a["arm"] for a in arms] == ["control", "init"]
    assert float(arms[0]["disagreement_pct"]) == 0.0 and float(arms[1]["disagreement_pct"]) > 0
    # One unit with the report: accuracy-like columns in % (named _pct), cross-entropy in nats (_nats)
    summary = json.loads((out / "summary.json").read_text())
    init = summary["arms"]["init"]["metrics"]
    assert float(arms[1]["accuracy_mean_pct"]) == pytest.approx(100 * init["accuracy"]["mean"])
    assert float(arms[1]["disagreement_pct"]) == pytest.approx(100 * init["disagreement"]["mean"])
    assert float(arms[1]["cross_entropy_std_nats"]) == pytest.approx(init["cross_entropy"]["std"])
    assert arms[0]["accuracy_std_ratio_vs_all"] == ""  # no all arm here
    logits = np.load(out / "logits" / "init.npy")
    assert logits.shape == (2, 360, 10) and logits.dtype == np.float32
    rows = [r for r in csv.DictReader((out / "replicas.csv").open()) if r["metric"] == "test_accuracy"]
    assert [(r["arm"], r["replica"]) for r in rows] == [("control", "0"), ("control", "1"), ("init", "0"), ("init", "1")]
    assert 1 < float(rows[2]["value"]) <= 100 and rows[2]["unit"] == "%"
    env = json.loads((out / "environment.json").read_text())
    for key in ("jax_threefry_partitionable", "prng_impl", "backend", "device_kind", "xla_flags", "strategy", "versions"):
        assert key in env, key
    assert env["strategy"]["chosen"] == "sequential"
    cpu = env["xla_cpu_defaults"]  # the CPU type's measured flags for the strategy it ran, unless the user set them
    if not cpu["opted_out"] and "ynn" not in CLI_ENV.get("XLA_FLAGS", ""):  # the CLI's environment, not ours
        assert cpu["added"] == xla_flags.cpu_defaults(cpu["cpu_type"], "sequential")
        assert all(f in env["xla_flags"].split() for f in cpu["added"])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["arms"]["control"]["replicas_bitwise_identical"] is True
    assert summary["arms"]["init"]["replicas_bitwise_identical"] is False
    m = summary["arms"]["init"]["metrics"]
    for key in ("accuracy", "cross_entropy", "independent_errors_std", "disagreement", "pearson", "spearman",
                "ensemble_gain_accuracy", "ensemble_gain_cross_entropy", "cka", "weight_distance", "lmc_barrier"):
        assert key in m, key
    with np.load(out / "history" / "init.npz") as h:
        assert h["weight_distance"].shape == (2, 1) and h["train_loss"].shape == (2, 1)
    config = json.loads((out / "config.json").read_text())
    assert config["model"]["name"] == "mlp" and config["study"]["arms"] == ["control", "init"]


def test_rerun_reuses_finished_arms_and_adds_new_ones(run_dir):
    out, _ = run_dir
    before = snapshot(out)
    proc = cli(*FAST, "--arms", "control,init", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "already finished" in proc.stdout
    after = snapshot(out)
    for name in before:
        if name.startswith(("logits/", "weights/", "arms/", "features/", "history/")):
            assert before[name] == after[name], name
    proc = cli(*FAST, "--arms", "data_order", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    rows = list(csv.DictReader((out / "replicas.csv").open()))
    assert {r["arm"] for r in rows} == {"control", "init", "data_order"}
    assert snapshot(out)["logits/init.npy"] == before["logits/init.npy"]


@pytest.mark.parametrize("args,message", [
    (["--arms", "control,nosuch"], "unknown arm or source 'nosuch'"),
    (["--arms", "init+cosmic_rays"], "unknown arm or source 'cosmic_rays'"),
    (["--model", "resnet99"], "unknown model 'resnet99'"),
    (["--dataset", "imagenet"], "unknown dataset 'imagenet'"),
    (["--batch-size", "5000"], "batch size 5000 is larger than the 1437 training examples"),
    (["--replicas", "0"], "replicas must be >= 1"),
    (["--set", "train.epoch=3"], "unknown config key 'train.epoch'"),
    (["--strategy", "fast"], "unknown strategy 'fast'"),
    (["--epochs", "two"], "invalid int value"),
    (["--preset", "nosuch"], "unknown preset 'nosuch'"),
    (["--replicas", "1"], "pairwise metrics need at least 2 replicas"),
    (["--arms", "control,dropout"], "arm 'dropout' varies only dropout"),
    (["--augment", "off", "--arms", "augmentation"], "arm 'augmentation' varies only augmentation"),
    (["--batch-size", "1", "--arms", "control,batch_order"],
     "arm 'batch_order' varies only batch_order, which is the identity at batch size 1"),
])
def test_bad_input_exits_2_with_one_line(tmp_path, args, message):
    out = tmp_path / "run"
    proc = cli(*FAST, "--out", str(out), *args)
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and "Location" not in ln]
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert not out.exists()


def test_folder_of_a_different_config_is_refused_untouched(run_dir):
    out, _ = run_dir
    before = snapshot(out)
    proc = cli(*FAST, "--arms", "control", "--seed", "5", "--out", str(out))
    assert proc.returncode == 2 and "different config" in proc.stderr and "study.seed" in proc.stderr
    assert snapshot(out) == before


def test_folder_in_use_is_refused(tmp_path):
    out = tmp_path / "busy"
    config = from_flat({"model.name": "mlp", "train.epochs": 1, "study.replicas": 2, "train.batch_size": 128})
    with RunStore(out, config):
        proc = cli(*FAST, "--arms", "control,init,bitflip,batch_order,data_order,all", "--out", str(out))
        assert proc.returncode == 2 and f"in use by another sweep (pid {os.getpid()})" in proc.stderr
    assert not (out / "logits").exists()


def test_corrupt_config_is_refused(tmp_path):
    out = tmp_path / "bad"
    out.mkdir()
    (out / "config.json").write_text("{not json")
    proc = cli(*FAST, "--out", str(out))
    assert proc.returncode == 2 and "corrupt" in proc.stderr
    assert (out / "config.json").read_text() == "{not json"


def test_foreign_folder_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(UsageError, match="not a nondet_jax run folder"):
        runner.run(from_flat({"model.name": "mlp", "train.epochs": 1}), tmp_path, progress=False, log=quiet)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_a_kill_during_the_first_config_write_leaves_a_usable_folder(tmp_path):
    """Killed while writing the first config.json, a folder holds only the lock and a temporary file:
    the rerun takes it as new (it used to answer "not a nondet_jax run folder" forever)."""
    from nondet_jax.store.run import RunStore

    out = tmp_path / "run"
    out.mkdir()
    (out / ".lock").write_text("123\n")
    (out / ".config.json.k2j3.tmp").write_text('{"study": {"ar')
    config = from_flat({"model.name": "mlp", "train.epochs": 1})
    with RunStore(out, config):
        pass
    assert json.loads((out / "config.json").read_text())["model"]["name"] == "mlp"
    assert not list(out.glob(".*.tmp"))


def test_same_config_twice_gives_bitwise_identical_results(tmp_path):
    config = from_flat({"model.name": "mlp", "train.epochs": 2, "study.replicas": 2, "train.batch_size": 128,
                        "study.arms": "all", "model.dropout": 0.1, "data.augment": "on"})
    runner.run(config, tmp_path / "a", progress=False, log=quiet)
    runner.run(config, tmp_path / "b", progress=False, log=quiet)
    for name in ("logits/all.npy", "features/all.npy", "weights/all.npz", "replicas.csv"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


def test_config_file_and_overrides(tmp_path):
    f = tmp_path / "study.yaml"
    f.write_text("model:\n  name: mlp\ntrain:\n  epochs: 3\nstudy.replicas: 4\n")
    args = sweep.build_parser().parse_args(["--config", str(f), "--epochs", "2", "--set", "optim.nesterov=true"])
    config = sweep.config_from_args(args)
    assert (config.model.name, config.train.epochs, config.study.replicas, config.optim.nesterov) == ("mlp", 2, 4, True)
    f.write_text("model: [1, 2\n")
    with pytest.raises(UsageError, match="not valid YAML"):
        sweep.config_from_args(sweep.build_parser().parse_args(["--config", str(f)]))


def test_set_takes_key_value_items_and_pairs():
    args = sweep.build_parser().parse_args(["--set", "optim.lr", "0.1", "--set", "train.epochs=3", "study.seed", "7"])
    config = sweep.config_from_args(args)
    assert (config.optim.lr, config.train.epochs, config.study.seed) == (0.1, 3, 7)
    with pytest.raises(UsageError, match="--set optim.lr has no value"):
        sweep.config_from_args(sweep.build_parser().parse_args(["--set", "optim.lr"]))



def test_set_and_flag_giving_one_key_two_values_is_refused_and_a_bracketed_list_is_a_list():
    """`--epochs 3 --set train.epochs=1` trained 1 epoch with nothing said; `--set study.arms=[control,init]`
    read '[control' as an arm (outside review)."""
    def config(*argv):
        return sweep.config_from_args(sweep.build_parser().parse_args(list(argv)))

    with pytest.raises(UsageError, match="--epochs 3 and --set train.epochs=1 disagree; give one"):
        config("--epochs", "3", "--set", "train.epochs=1")
    assert config("--epochs", "3", "--set", "train.epochs=3").train.epochs == 3
    assert config("--lr", "0.05", "--set", "optim.lr=5e-2").optim.lr == 0.05  # one value, written two ways
    assert config("--arms", "control,init", "--set", "study.arms=[control, init]").study.arms == ("control", "init")
    assert config("--set", "study.arms=[control, init]").study.arms == ("control", "init")


def test_a_presets_digits_augmentation_is_not_carried_to_another_data_set():
    """The default preset's "no flips" is for digits; `--dataset cifar10` under it trained CIFAR-10 without flips,
    against the documented defaults (outside review): another data set gets its own default flips, and the
    preset's crops (its arms include `augmentation`). What the user chooses, by flag, --set or --config, is kept."""
    def data(*argv):
        return sweep.config_from_args(sweep.build_parser().parse_args(list(argv))).data

    assert (data().augment, data().flip) == ("on", "off")
    for argv in (["--dataset", "cifar10"], ["--set", "data.name=mnist"], ["--preset", "morin", "--dataset", "cifar10"]):
        assert (data(*argv).augment, data(*argv).flip) == ("on", "auto"), argv
    assert (data("--dataset", "cifar10", "--set", "data.flip=off").flip, data("--dataset", "cifar10",
                                                                         "--augment", "off").augment) == ("off", "off")


def test_default_out_depends_on_settings_not_arms():
    a = from_flat({"study.arms": "control"})
    b = from_flat({"study.arms": "init"})
    c = from_flat({"train.epochs": 3})
    assert default_out(a) == default_out(b) != default_out(c)


@pytest.mark.parametrize("preset", ["sources", "morin", "bitflip"])
def test_presets_load_and_name_their_command(preset):
    path = sweep.preset_path(preset)
    assert path.read_text().startswith(f"# python -m nondet_jax.sweep --preset {preset}")
    config = sweep.config_from_args(sweep.build_parser().parse_args(["--preset", preset]))
    assert "all" in config.study.arms and config.data.name == "digits"


def test_no_arguments_means_the_sources_preset():
    default = sweep.config_from_args(sweep.build_parser().parse_args([]))
    sources = sweep.config_from_args(sweep.build_parser().parse_args(["--preset", "sources"]))
    assert default == sources
    assert default.study.arms == ("control", "init", "data_order", "augmentation", "bitflip", "batch_order", "all")


def test_help_shows_every_preset_every_arm_kind_and_the_defaults():
    text = " ".join(sweep.build_parser().format_help().split("options:")[1].split())  # argparse wraps lines
    for preset in sweep.preset_names():
        assert preset in text
    for word in ("hardware", "@snapshotK", "all+hardware", "batch_order"):
        assert word in text, word
    default = sweep.config_from_args(sweep.build_parser().parse_args([]))
    assert f"(default: {default.train.epochs})" in text.split("--epochs EPOCHS")[1].split("--")[0]
    assert f"(default: {default.optim.lr})" in text.split("--lr LR")[1].split("--")[0]
    assert "(default: control, init," in text


def test_report_rebuilds_from_stored_results(run_dir, tmp_path):
    out, _ = run_dir
    summary_before = json.loads((out / "summary.json").read_text())
    (out / "report.md").unlink()
    proc = subprocess.run([sys.executable, "-m", "nondet_jax.report", str(out)], capture_output=True, text=True,
                          env=ENV, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert (out / "report.md").is_file() and "acc std %" in proc.stdout
    after = json.loads((out / "summary.json").read_text())
    assert after["arms"].keys() == summary_before["arms"].keys()
    assert after["arms"]["init"]["metrics"] == summary_before["arms"]["init"]["metrics"]


@pytest.mark.parametrize("make", ["missing", "empty_run"])
def test_report_on_folder_without_results_exits_2(tmp_path, make):
    folder = tmp_path / "x"
    if make == "empty_run":
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"study": {"arms": ["control"]}}))
    proc = subprocess.run([sys.executable, "-m", "nondet_jax.report", str(folder)], capture_output=True, text=True,
                          env=ENV, timeout=300)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1
    assert ("no finished arms" if make == "empty_run" else "not a nondet_jax run folder") in lines[0]


def test_hardware_arm_trains_in_a_child_process_with_determinism_off(tmp_path):
    from nondet_jax.machine.determinism import DETERMINISM_OFF, DETERMINISM_ON

    out = tmp_path / "hw"  # one child for the whole arm (the default, one per replica: test_hardware_processes)
    proc = cli(*FAST, "--arms", "control,hardware", "--set", "study.hardware_processes=arm", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "child process" in proc.stdout and "batch_order is the simulated counterpart" in proc.stdout
    child_env = json.loads((out / "environments" / "hardware.json").read_text())
    parent_env = json.loads((out / "environment.json").read_text())
    assert all(f in child_env["xla_flags"].split() for f in DETERMINISM_OFF)
    assert "--xla_gpu_autotune_level=0" not in child_env["xla_flags"]  # XLA's default autotuning in the child
    assert all(f in parent_env["xla_flags"].split() for f in DETERMINISM_ON)
    summary = json.loads((out / "summary.json").read_text())
    # CPU is deterministic even with the determinism flags off: verified, not assumed
    assert summary["arms"]["hardware"]["replicas_bitwise_identical"] is True
    assert np.array_equal(np.load(out / "logits" / "hardware.npy"), np.load(out / "logits" / "control.npy"))


def test_unknown_xla_flag_is_a_clear_error(tmp_path):
    env = {**ENV, "XLA_FLAGS": "--xla_no_such_flag=1"}
    proc = subprocess.run([sys.executable, "-m", "nondet_jax.sweep", *FAST, "--out", str(tmp_path / "x")],
                          capture_output=True, text=True, env=env, timeout=300)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1
    assert "XLA flag --xla_no_such_flag=1 is not known to the installed jaxlib" in lines[0]
    assert not (tmp_path / "x").exists()


def test_dynamics_are_traced_stored_and_reported(tmp_path):
    config = from_flat({"model.name": "mlp", "train.epochs": 2, "study.replicas": 2, "train.batch_size": 128,
                        "study.arms": "control,bitflip", "study.dynamics_every": 3})
    summary = runner.run(config, tmp_path, progress=False, log=quiet)
    assert "dynamics" not in summary["arms"]["control"]
    dyn = summary["arms"]["bitflip"]["dynamics"]
    assert dyn["every"] == 3 and np.isfinite(dyn["rate_per_step"])
    with np.load(tmp_path / "dynamics" / "bitflip.npz") as t:
        assert t["step"][:3].tolist() == [0, 3, 6]
    assert (tmp_path / "figures" / "dynamics.png").is_file()
    assert "## Divergence dynamics" in (tmp_path / "report.md").read_text()


def test_resume_from_inside_a_shared_folder_never_imports_its_code(tmp_path):
    """`cd folder && sweep --resume .` put the folder on sys.path, so a mod.py planted beside a config naming
    `mod:Net` was imported (and run). Refused before any import; the planted code never runs."""
    from nondet_jax.config import to_dict

    run = tmp_path / "shared"
    run.mkdir()
    (run / "config.json").write_text(json.dumps(to_dict(from_flat({"model.name": "plantedmod:Net"}))))
    marker = tmp_path / "ran"
    (run / "plantedmod.py").write_text(f"open({str(marker)!r}, 'w').write('x')\nNet = None\n")
    proc = cli("--resume", ".", cwd=run)
    assert proc.returncode == 2 and "would be imported from inside the run folder" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not marker.exists()


@pytest.mark.parametrize("content", [b"[1, 2]", b"null", b"\xff\xfe\x00binary"])
def test_resume_with_a_config_that_is_not_an_object_is_one_line(tmp_path, content):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_bytes(content)
    proc = cli("--resume", str(run))
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "config.json" in proc.stderr and (run / "config.json").read_bytes() == content


def test_a_huge_value_in_a_config_gives_a_short_one_line_error(tmp_path):
    """A 400 KB value (within the file-size limit) used to be quoted whole in the "one-line" error."""
    from nondet_jax.errors import MAX_MESSAGE

    path = tmp_path / "big.yaml"
    path.write_text("model:\n  name: " + "x" * 400_000 + "\n")
    proc = cli("--config", str(path), "--no-progress")
    err = proc.stderr.strip()
    assert proc.returncode == 2 and len(err.splitlines()) == 1 and len(err) < MAX_MESSAGE + 100, err[:200]
    assert "characters cut" in err
    assert str(UsageError("problem\nsecond line; fix")) == "problem second line; fix"


def test_each_arm_keeps_its_own_provenance_and_the_report_names_mixed_settings(tmp_path):
    """environment.json is rewritten by every run; arms added under other XLA flags used to be mixed with no
    record. Each arm record keeps what it was trained under, and the report says when arms differ."""
    out = tmp_path / "run"
    assert cli(*FAST, "--arms", "init", "--out", str(out)).returncode == 0
    env = {**ENV, "XLA_FLAGS": (ENV.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=1").strip()}
    proc = subprocess.run([sys.executable, "-m", "nondet_jax.sweep", *FAST, "--arms", "init,all", "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr
    init, all_ = (json.loads((out / "arms" / f"{a}.json").read_text())["provenance"] for a in ("init", "all"))
    assert "device_count=1" in all_["xla_flags"] and "device_count=1" not in init["xla_flags"]
    assert init["jaxlib"] == all_["jaxlib"] and init["backend"] == "cpu"
    assert "Arms trained under different xla_flags" in (out / "report.md").read_text()


def test_lock_file_honours_the_umask(tmp_path):
    """`.lock` was always 0644, so under umask 002 a group member could not resume a shared folder."""
    from nondet_jax.store.run import release_lock, take_lock

    old = os.umask(0o002)
    try:
        release_lock(take_lock(tmp_path))
    finally:
        os.umask(old)
    assert (tmp_path / ".lock").stat().st_mode & 0o777 == 0o664


def test_power_ratios_are_set_and_changed_without_retraining(tmp_path):
    out = tmp_path / "run"
    assert cli(*FAST, "--arms", "init,all", "--out", str(out)).returncode == 0
    first = json.loads((out / "summary.json").read_text())["vs_all"]["init"]["accuracy"]["replicas_for_ratio"]
    assert list(first) == ["0.5", "0.75"]
    logits = (out / "logits" / "init.npy").stat().st_mtime_ns
    proc = cli(*FAST, "--arms", "init,all", "--set", "metrics.power_ratios=0.6,1.5", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["vs_all"]["init"]["accuracy"]["replicas_for_ratio"]) == ["0.6", "1.5"]
    assert (out / "logits" / "init.npy").stat().st_mtime_ns == logits  # the arms were reused, not retrained
    assert "0.6 (" in (out / "report.md").read_text()


def test_a_relative_npz_path_is_recorded_absolute(tmp_path, monkeypatch):
    """config.json held --dataset as typed: a study started with a relative .npz path could not be resumed from
    another directory (--resume OUT read the path against the new working directory)."""
    from nondet_jax.cli import sweep as cli

    monkeypatch.chdir(tmp_path)
    for argv in (["--dataset", "mine.npz"], ["--set", "data.name=sub/mine.npz"]):
        name = cli.config_from_args(cli.build_parser().parse_args(argv)).data.name
        assert name == str(tmp_path / argv[-1].removeprefix("data.name="))
    assert cli.config_from_args(cli.build_parser().parse_args(["--dataset", "digits"])).data.name == "digits"


def test_a_folder_with_nothing_trained_is_not_said_to_hold_results(tmp_path):
    """A first run that crashed before any arm finished left config.json alone; a rerun with other settings was told
    the folder 'holds results' (outside review): it says nothing is trained yet and that deleting it loses nothing."""
    from nondet_jax.store.run import different_config

    diff = ["study.strategy 'sharded' vs 'sequential'"]
    assert "holds nothing trained yet; delete it" in str(different_config(tmp_path, diff))
    (tmp_path / "checkpoints" / "init").mkdir(parents=True)
    assert "holds nothing trained yet" in str(different_config(tmp_path, diff))
    (tmp_path / "checkpoints" / "init" / "3").mkdir()
    assert "holds results of a different config" in str(different_config(tmp_path, diff))
    (tmp_path / "checkpoints" / "init" / "3").rmdir()
    (tmp_path / "parts" / "init").mkdir(parents=True)
    (tmp_path / "parts" / "init" / "0.npz").write_bytes(b"x")  # a block of replicas trained apart
    assert "holds results of a different config" in str(different_config(tmp_path, diff))
    (tmp_path / "parts" / "init" / "0.npz").unlink()
    (tmp_path / "arms").mkdir()
    (tmp_path / "arms" / "control.json").write_text("{}")
    assert "holds results of a different config" in str(different_config(tmp_path, diff))
