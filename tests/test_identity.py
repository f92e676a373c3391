"""A study's identity is its content: a changed part is never reused, an unchanged one always is."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

import nondet_jax as nj
from nondet_jax.errors import UsageError

QUIET = {"log": lambda *a, **k: None}
STUDY = {"epochs": 1, "batch_size": 32, "arms": "control,init", "replicas": 2, "settings": {"metrics.lmc_pairs": 0}}


def _net(activation):
    class Net(nn.Module):  # one name, two bodies: only the content tells them apart
        num_classes: int = 3

        @nn.compact
        def __call__(self, x, train: bool):
            return nn.Dense(self.num_classes)(activation(nn.Dense(8)(x)))

    return Net


ReluNet, TanhNet = _net(nn.relu), _net(nn.tanh)
assert (ReluNet.__module__, ReluNet.__qualname__) == (TanhNet.__module__, TanhNet.__qualname__)


def arrays(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(96, 5)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64) + (x[:, 1] > 0.5)
    return x[:64], y[:64], x[64:], y[64:]


def ce(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels)


def ce40(logits, labels):
    return 40 * optax.softmax_cross_entropy_with_integer_labels(logits, labels)


def shift(key, x):
    return x + 0.01


def shift2(key, x):
    return x + 0.02


BASE = {"model": ReluNet, "data": arrays(), "optimizer": optax.sgd(0.05, momentum=0.9), "loss": ce, "augment": shift}
CHANGES = {  # each changed alone; the part the refusal must name
    "optimizer": ({"optimizer": optax.sgd(5.0, momentum=0.9)}, "the optimizer differs (scale step_size -0.05 -> -5)"),
    "schedule": ({"optimizer": optax.sgd(optax.cosine_decay_schedule(0.05, 100), momentum=0.9)}, "the optimizer differs"),
    "model body": ({"model": TanhNet}, "the model differs (the same name, another computation with the same 75 "
                                       "parameters in the same shapes"),
    "loss": ({"loss": ce40}, f"the loss differs (was {__name__}:ce, now {__name__}:ce40)"),
    "augment": ({"augment": shift2}, f"the augment differs (was {__name__}:shift, now {__name__}:shift2)"),
    "data": ({"data": (arrays(1)[0], *arrays()[1:])}, "the data differs (was arrays-"),
    # a setting changes the parts' traces too (the batch's shape): the setting is named, not the parts
    "batch size": ({"batch_size": 8}, "(train.batch_size 32 vs 8)"),
}


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    out = tmp_path_factory.mktemp("identity") / "run"
    nj.run_study(**BASE, out=out, **STUDY, **QUIET)
    return out


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
            and p.name != ".lock"}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_changed_part_is_refused_by_name_and_nothing_is_written(finished, change):
    kwargs, named = CHANGES[change]
    before = _files(finished)
    with pytest.raises(UsageError, match=r"holds results of another study: |of a different config") as e:
        nj.run_study(**{**BASE, **STUDY, **kwargs}, out=finished, **QUIET)
    assert named in str(e.value)
    assert _files(finished) == before


def test_the_same_study_again_is_reused_and_the_check_is_cheap(finished):
    from nondet_jax import config as cfg
    from nondet_jax.study.prepare import model_record, prepare

    logs = []
    nj.run_study(**BASE, out=finished, **STUDY, log=logs.append)
    assert sum("already finished" in line for line in logs) == 2
    config = cfg.Config()  # the default study: its identity is traced, not compiled
    data, fns = prepare(config)
    compiles = []

    def on_duration(event, secs, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    model_record(config, data, fns)
    jax.monitoring.register_event_duration_secs_listener(on_duration)
    try:
        model_record(config, data, fns)
    finally:
        jax.monitoring.unregister_event_duration_listener(on_duration)
    assert compiles == []  # the check again compiles nothing (0.04-0.19 s measured), whatever the load


def test_default_folder_per_learning_rate_each_recording_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    folders = {}
    for lr in (0.05, 0.5):
        result = nj.run_study(**{**BASE, "optimizer": optax.sgd(lr)}, **STUDY, **QUIET)
        folders[lr] = result.out
        model = json.loads((result.out / "model.json").read_text())
        assert model["identity"]["optimizer"]["transforms"] == [{"transform": "scale", "step_size": -lr}]
        assert f"scale(step_size={-lr:g})" in result.report.read_text()
    assert folders[0.05] != folders[0.5] and folders[0.05].parent == folders[0.5].parent == Path("runs")


def test_npz_is_identified_by_its_arrays_not_its_path(tmp_path, monkeypatch):
    from nondet_jax.cli import compare, sweep

    monkeypatch.chdir(tmp_path)
    x, y = arrays()[0].reshape(64, 5, 1, 1), arrays()[1]
    np.savez("tok.npz", x_train=x, y_train=y, x_test=x[:20], y_test=y[:20])
    cli = ["--model", "mlp", "--epochs", "1", "--replicas", "2", "--batch-size", "16", "--arms", "control,init",
           "--no-progress", "--set", "metrics.lmc_pairs=0"]
    assert sweep.main([*cli, "--dataset", "tok.npz", "--out", "a"]) == 0
    assert sweep.main([*cli, "--dataset", "./tok.npz", "--out", "a"]) == 0  # the same file: reused
    shutil.copy("tok.npz", "copy.npz")
    assert sweep.main([*cli, "--dataset", "copy.npz", "--out", "b"]) == 0
    assert compare.main(["a", "b", "--arm", "init"]) == 0  # one test set, two spellings
    rng = np.random.default_rng(1)
    np.savez("tok.npz", x_train=rng.normal(size=x.shape).astype(np.float32), y_train=y, x_test=x[:20], y_test=y[:20])
    before = _files(Path("a"))
    assert sweep.main([*cli, "--dataset", "tok.npz", "--out", "a"]) == 2
    assert _files(Path("a")) == before


def test_a_checkpoint_of_another_config_is_not_resumed(tmp_path):
    from nondet_jax.cli import sweep
    from nondet_jax.study import arm as analysis  # the name finish_arm calls

    def stopped(out, *extra):  # trains epoch 1 of 2 of arm init, checkpoints it, stops before the metrics
        original = analysis.arm_metrics
        analysis.arm_metrics = lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt)
        try:
            sweep.main(["--model", "mlp", "--epochs", "2", "--replicas", "2", "--batch-size", "256", "--arms", "init",
                        "--set", "train.checkpoint_seconds=0", "--no-progress", "--out", str(out), *extra])
        finally:
            analysis.arm_metrics = original
        assert (out / "checkpoints" / "init").is_dir()

    stopped(tmp_path / "a")
    stopped(tmp_path / "b", "--lr", "0.5")
    shutil.rmtree(tmp_path / "a" / "checkpoints" / "init")
    shutil.copytree(tmp_path / "b" / "checkpoints" / "init", tmp_path / "a" / "checkpoints" / "init")
    with pytest.raises(UsageError, match=r"belongs to a different run \(identity_sha256 differs: it was written with "
                                         r"another study's data, model, optimiser"):
        from nondet_jax import config as cfg
        from nondet_jax.study import runner

        runner.run(cfg.from_dict(json.loads((tmp_path / "a" / "config.json").read_text())), tmp_path / "a",
                   progress=False, **QUIET)


def test_optimizer_description_reads_settings_and_schedules():
    from nondet_jax.report.optimizer import describe_optimizer, format_optimizer

    tx = optax.chain(optax.clip_by_global_norm(1.0),
                     optax.sgd(optax.warmup_cosine_decay_schedule(0.0, 0.1, 10, 100), momentum=0.9))
    d = describe_optimizer(tx, 100)
    assert [t["transform"] for t in d] == ["clip_by_global_norm", "trace", "scale_by_schedule"]
    assert d[0]["max_norm"] == 1.0 and d[1]["decay"] == 0.9
    schedule = d[2]["step_size_fn"]
    assert list(schedule) == ["0", "1", "25", "50", "75", "99"] and schedule["0"] == 0.0
    assert abs(schedule["25"] + 0.1 * 0.5 * (1 + np.cos(np.pi * 15 / 90))) < 1e-6  # -lr(25): the sign of descent
    inj = describe_optimizer(optax.inject_hyperparams(optax.adam)(learning_rate=3e-4), 10)
    assert inj[0]["transform"] == "inject_hyperparams" and inj[0]["inner_factory"] == "adam"
    assert inj[0]["learning_rate"] == 3e-4 and inj[0]["b1"] == 0.9
    assert "clip_by_global_norm(max_norm=1)" in format_optimizer(d)
    # multi_transform's label function is a callable in a closure too, but gives labels, not numbers
    labelled = optax.multi_transform({"a": optax.sgd(0.1), "b": optax.set_to_zero()},
                                     lambda params: jax.tree.map(lambda x: "a" if x.ndim > 1 else "b", params))
    assert describe_optimizer(labelled, 10)[0]["transform"] == "partition"  # optax's name for multi_transform
    # Summers & Dinneen's tenth of the learning rate for biases and BatchNorm scales: applied last, to those alone
    # (it was listed first, as a global scale, and the mask left out: an outside review)
    from nondet_jax.config import OptimConfig
    from nondet_jax.train import make_optimizer, make_schedule

    o = OptimConfig(bias_bn_lr_scale=0.1)
    line = format_optimizer(describe_optimizer(make_optimizer(o, make_schedule(o, 2, 10)), 20))
    assert line.startswith("add_decayed_weights(") and line.count("scale(") == 1
    assert line.endswith(" + masked(inner=scale(step_size=0.1), mask=bias_bn_mask)")


def test_config_digests_of_earlier_folders_do_not_move():
    """Every arm record holds its config's digest: a key left out of it (or added to the config without
    ADDED_KEYS) makes every earlier folder's records look edited. metrics.decomposition was left out once, and
    the reviewers' folders of an hour before were refused ('config.json does not hold the config arm ... was
    trained with'). The digests of the default config and of the decomposition preset's, as every version since
    the config's last change wrote them."""
    from nondet_jax.config import Config, from_flat, to_dict
    from nondet_jax.store.run import config_digest

    assert config_digest(to_dict(Config())) == "f04d2d4ec4e9510599b0b2b950c5358979dddf10418e18d2ffd60f6866c5153f"
    assert config_digest(to_dict(from_flat({"metrics.decomposition": True}))) == \
        "b98d3959c2fd1854c52dee7ee8688ee864415b03cdd188b2259064c4376a183e"


def test_a_folder_from_before_a_key_was_added_is_the_same_study():
    """train.epoch_shape arrived after run folders existed: a stored config without it is the same study as one
    with its default, and keeps its digest; another value is another study."""
    from nondet_jax.config import Config, from_flat, to_dict
    from nondet_jax.store.run import _config_diff, config_digest

    new = to_dict(Config())
    old = json.loads(json.dumps(new))
    del old["train"]["epoch_shape"]
    assert _config_diff(old, new) == [] and config_digest(old) == config_digest(new)
    stepped = to_dict(from_flat({"train.epoch_shape": "step"}))
    assert _config_diff(old, stepped) == ["train.epoch_shape None vs 'step'"]
