"""Regression is recognised from the targets, trained with its own loss and reported in MSE, not accuracy."""

from __future__ import annotations

import json

import flax.linen as nn
import numpy as np
import optax
import pytest

import nondet_jax as nj
from nondet_jax.data import from_arrays
from nondet_jax.errors import UsageError

QUIET = {"log": lambda *a, **k: None}


class MLP(nn.Module):
    num_classes: int = 1  # a regression's outputs per example

    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Dropout(0.1, deterministic=not train)(nn.relu(nn.Dense(16)(x)))
        return nn.Dense(self.num_classes)(x)


def diabetes():
    from sklearn.datasets import load_diabetes

    x, y = load_diabetes(return_X_y=True)  # 442 patients; targets are whole-number floats (25.0 .. 346.0)
    x = ((x - x.mean(0)) / x.std(0)).astype(np.float32)
    return x[:352], y[:352], x[352:], y[352:]


def test_float_targets_are_a_regression_whole_numbers_included():
    d = from_arrays("diabetes", *diabetes())
    assert d.task == "regression" and d.num_classes == 1 and d.y_train.dtype == np.float32
    assert np.array_equal(d.y_train, diabetes()[1].astype(np.float32))  # not relabelled as 347 classes
    two = from_arrays("two", np.zeros((4, 3)), np.zeros((4, 2)), np.zeros((2, 3)), np.zeros((2, 2)))
    assert two.task == "regression" and two.num_classes == 2
    labels = from_arrays("c", np.zeros((4, 3)), np.array([0.0, 1, 2, 1]), np.zeros((2, 3)), np.array([0.0, 2]),
                         task="classification")
    assert labels.task == "classification" and labels.num_classes == 3
    with pytest.raises(UsageError, match=r"y_train holds 1 NaN or infinite value\(s\) \(the first in example 1\), but "
                                         "must hold finite numbers for a regression"):
        from_arrays("n", np.zeros((2, 3)), np.array([0.0, np.nan]), np.zeros((1, 3)), np.array([0.0]))
    with pytest.raises(UsageError, match="task 'ranking' is unknown"):
        from_arrays("n", np.zeros((2, 3)), np.zeros(2), np.zeros((1, 3)), np.zeros(1), task="ranking")


def test_diabetes_study_end_to_end_speaks_of_mse(tmp_path):
    x_tr, y_tr, x_te, y_te = diabetes()
    mu, sd = y_tr.mean(), y_tr.std()
    data = (x_tr, (y_tr - mu) / sd, x_te, (y_te - mu) / sd)
    result = nj.run_study(model=MLP, data=data, optimizer=optax.adam(1e-2), loss=lambda p, t: (p - t) ** 2,
                          epochs=3, batch_size=32, arms="control,init,dropout,all", replicas=3,
                          out=tmp_path / "run", **QUIET)
    rows = {r["arm"]: r for r in result.table}
    assert "accuracy_mean_pct" not in rows["init"] and "disagreement_pct" not in rows["init"]
    assert rows["control"]["mse_std"] == 0.0 and rows["init"]["mse_std"] > 0
    assert rows["init"]["prediction_distance"] > 0 and -1 <= rows["init"]["pearson"] <= 1
    assert rows["init"]["mse_std_ratio_vs_all"] > 0 and "lmc_barrier_pct" not in rows["init"]
    # the stored per-replica MSE is the MSE of the stored predictions
    preds = result.logits["init"].reshape(3, -1)
    mse = np.mean((preds - data[3][None]) ** 2, axis=1)
    assert np.allclose([r["value"] for r in result.rows if r["arm"] == "init" and r["metric"] == "test_mse"], mse, rtol=1e-6)
    report = result.report.read_text()
    assert "test MSE" in report and "regression, 1 output(s) per example" in report
    assert "accuracy std" not in report and "disagreement (%)" not in report
    assert (tmp_path / "run" / "figures" / "mse.png").exists()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["task"] == "regression" and set(summary["vs_all"]["init"]) == {"mse", "mae"}


def test_regression_through_the_cli_from_an_npz(tmp_path):
    from nondet_jax.cli import sweep

    x_tr, y_tr, x_te, y_te = diabetes()
    np.savez(tmp_path / "d.npz", x_train=x_tr, y_train=(y_tr - 150) / 80, x_test=x_te, y_test=(y_te - 150) / 80)
    assert sweep.main(["--model", "mlp", "--dataset", str(tmp_path / "d.npz"), "--augment", "off", "--epochs", "1",
                       "--replicas", "2", "--batch-size", "32", "--arms", "control,init", "--no-progress",
                       "--out", str(tmp_path / "run")]) == 0
    assert "test MSE" in (tmp_path / "run" / "report.md").read_text()


def test_instruments_on_a_regression_with_its_own_loss(tmp_path):
    """The instruments measure the user's own loss: the GGN of a mean squared error in the output bias
    is exactly 2 (the loss is quadratic in it), and Alpha is stored at the step whose update it judges."""
    x_tr, y_tr, x_te, y_te = diabetes()
    mu, sd = y_tr.mean(), y_tr.std()
    nj.run_study(model=MLP, data=(x_tr, (y_tr - mu) / sd, x_te, (y_te - mu) / sd), optimizer=optax.adam(1e-2),
                 loss=lambda p, t: (p - t) ** 2, epochs=1, batch_size=32, arms="control", replicas=2,
                 settings={"instruments.config": "economy,HessTrace,TICTrace", "instruments.every": 4},
                 out=tmp_path / "run", **QUIET)
    values = np.load(tmp_path / "run" / "instruments" / "control.npz")
    np.testing.assert_array_equal(values["step"], [0, 4, 8])
    np.testing.assert_allclose(values["HessTrace/Dense_1/bias"], 2.0, rtol=1e-5)
    for k in ("Alpha", "Loss", "NormTest", "HessTrace", "TICTrace"):
        assert np.isfinite(values[k]).all(), k
    assert "lr" not in values.files  # the config's schedule is not your optimiser's


class FlatOutputs(nn.Module):
    """A regression model returning (N,) for (N,) targets, as docs/api.md presents regression."""
    num_classes: int = 1
    width: int = 16

    @nn.compact
    def __call__(self, x, train: bool):
        return nn.Dense(self.num_classes)(nn.relu(nn.Dense(self.width)(x)))[:, 0]


def _small_regression():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 5)).astype(np.float32)
    y = (x @ rng.normal(size=5)).astype(np.float32)
    return x[:48], y[:48], x[48:], y[48:]


def test_a_regression_model_may_return_one_output_per_example_unshaped(tmp_path):
    """(N,) outputs trained the first arm and then died in CKA (numpy: "einstein sum subscripts string
    contains too many subscripts"): its features are now (N, 1)."""
    result = nj.run_study(model=FlatOutputs, data=_small_regression(), arms="control,init", replicas=2, epochs=1,
                          batch_size=16, out=tmp_path / "run", **QUIET)
    assert np.load(tmp_path / "run" / "features" / "init.npy").shape == (2, 16, 1)
    assert result.logits["init"].shape == (2, 16)
    assert np.isfinite({r["arm"]: r for r in result.table}["init"]["cka"])


def test_a_folder_without_a_finished_arm_takes_the_corrected_model(tmp_path, monkeypatch):
    """A study that stopped before storing any arm left model.json behind, and the folder then refused the
    corrected model ("holds results of another model"): the user needed a new folder. With no finished
    arm there is nothing to protect; the stopped arm's checkpoint (of the other model) is refused by its
    identity, naming --recompute, which then trains the corrected model."""
    from nondet_jax.config import from_flat
    from nondet_jax.models.parts import Parts
    from nondet_jax.study import arm as analysis  # the name finish_arm calls
    from nondet_jax.study import runner

    data = from_arrays("arrays-test", *_small_regression())
    config = from_flat({"study.arms": "init", "study.replicas": 2, "train.epochs": 1, "train.batch_size": 16,
                        "model.name": "own:FlatOutputs", "data.name": "arrays-test", "data.augment": "off",
                        "train.checkpoint_seconds": 0})  # the stopped arm leaves its checkpoint

    def crash(*a, **k):
        raise RuntimeError("stopped before the arm was stored")

    monkeypatch.setattr(analysis, "arm_metrics", crash)
    with pytest.raises(RuntimeError):
        runner.run(config, tmp_path / "run", parts=Parts(model=FlatOutputs(width=16)), data=data, **QUIET)
    monkeypatch.undo()
    assert (tmp_path / "run" / "model.json").exists() and not list((tmp_path / "run" / "arms").glob("*.json"))
    corrected = Parts(model=FlatOutputs(width=8))
    with pytest.raises(UsageError, match="rerun with --recompute init"):
        runner.run(config, tmp_path / "run", parts=corrected, data=data, **QUIET)
    summary = runner.run(config, tmp_path / "run", parts=corrected, data=data, recompute=("init",), **QUIET)
    assert "init" in summary["arms"]


def test_methods_and_compare_on_a_regression_read_its_errors(tmp_path, capsys):
    """A study of methods on a regression compares test MSE (it looked for test_loss, which a regression does
    not store, and crashed after training); `compare` on its run folders defaults to test MSE, takes test_mae,
    and refuses a classification metric in one line; model.json names the squared error it trained on."""
    from nondet_jax.cli import compare as cli

    x_tr, y_tr, x_te, y_te = diabetes()
    data = (x_tr, (y_tr - 150) / 80, x_te, (y_te - 150) / 80)
    result = nj.run_study(model=MLP, data=data, optimizer=optax.sgd(0.05), epochs=1, batch_size=64, arms="all",
                          replicas=3, methods={"base": {}, "fast": {"optimizer": optax.sgd(0.2)}},
                          out=tmp_path / "run", **QUIET)
    (row,) = result.to_frame("methods").dropna(subset=["n_pairs"]).to_dict("records")
    assert row["n_pairs"] == 3
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["metric"] == "test_mse"
    model = json.loads((tmp_path / "run" / "methods" / "base" / "model.json").read_text())
    assert model["loss"] == model["identity"]["loss"]["name"] == "squared_error" and model["augment"] == "none"
    base, fast = (str(tmp_path / "run" / "methods" / m) for m in ("base", "fast"))
    capsys.readouterr()
    assert cli.main([base, fast, "--arm", "all", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["a"]["metric"] == "test_mse"
    assert cli.main([base, fast, "--arm", "all", "--metric", "test_mae"]) == 0
    assert cli.main([base, fast, "--arm", "all", "--metric", "test_accuracy"]) == 2
    assert ("unknown --metric 'test_accuracy' for a run folder of a regression; use one of test_mse, test_mae, "
            "train_loss, train_mae") in capsys.readouterr().err
    from nondet_jax.cli import sweep

    assert sweep.main(["--model", "mlp", "--epochs", "1", "--replicas", "2", "--batch-size", "256", "--arms", "all",
                       "--no-progress", "--out", str(tmp_path / "cls")]) == 0
    capsys.readouterr()
    assert cli.main([base, str(tmp_path / "cls"), "--arm", "all"]) == 2  # it blamed a --metric nobody passed
    assert f"{base} is a regression and {tmp_path / 'cls'} a classification: their scores cannot be compared" in \
        capsys.readouterr().err
