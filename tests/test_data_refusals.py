"""An outside review's data findings: a catalogue conv model (or the user's own) on data it cannot take, a
:class:`nondet_jax.data.Dataset` built by hand skipping the data checks, and a report of an interrupted study
silent about its missing arms. The refusals are rows R1 .. R4 of docs/bad_inputs.md, checked here word for word."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import conftest
import numpy as np
import pytest

from nondet_jax.errors import UsageError

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "bad_inputs.md"

# A user's own convolutional model, imported by the CLI as reviewpkg.nets:CNN.
NETS = """import flax.linen as nn


class CNN(nn.Module):
    num_classes: int = 10

    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.relu(nn.Conv(4, (3, 3))(x))
        return nn.Dense(self.num_classes)(x.reshape(x.shape[0], -1))
"""


def _documented() -> dict[str, tuple[str, str, str]]:
    """Rows ``| R<k> | where | input | message |`` of docs/bad_inputs.md (after its generated table)."""
    rows = {}
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and re.fullmatch(r"R\d+", cells[0]):
            rows[cells[0]] = tuple(c.removeprefix("`` ").removesuffix(" ``").replace("\\|", "|") for c in cells[1:])
    return rows


def _save(path: Path, x_train, x_test, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    np.savez(path, x_train=x_train, y_train=rng.integers(0, 10, len(x_train)), x_test=x_test,
             y_test=rng.integers(0, 10, len(x_test)))
    return path


@pytest.fixture(scope="module")
def shapes(tmp_path_factory) -> Path:
    """gray.npz: (300, 8, 8) images without a channel axis; tab.npz: (300, 64) tabular arrays; and the package
    ``reviewpkg`` holding the user's own CNN."""
    d = tmp_path_factory.mktemp("shapes")
    rng = np.random.default_rng(0)
    _save(d / "gray.npz", rng.random((300, 8, 8), np.float32), rng.random((40, 8, 8), np.float32))
    _save(d / "tab.npz", rng.random((300, 64), np.float32), rng.random((40, 64), np.float32))
    (d / "reviewpkg").mkdir()
    (d / "reviewpkg" / "__init__.py").write_text("")
    (d / "reviewpkg" / "nets.py").write_text(NETS)
    return d


def _refused(proc, out: Path) -> str:
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert not out.exists(), "a refused study wrote its run folder"
    prefix = "python -m nondet_jax.sweep: error: "
    assert lines[0].startswith(prefix), lines[0]
    return lines[0].removeprefix(prefix)


@pytest.mark.parametrize("row,data,model", [("R1", "gray.npz", "resnet8"), ("R2", "tab.npz", "resnet8"),
                                            ("R3", "tab.npz", "reviewpkg.nets:CNN")])
def test_a_model_on_data_it_cannot_take_is_refused_in_one_line(shapes, row, data, model):
    """Defect 1: resnet8 on (N, 8, 8) or (N, 64) arrays, and the user's CNN on (N, 64), ended in a Flax
    ScopeParamShapeError or a numpy broadcast traceback, exit 1."""
    out = shapes / f"run-{row}"
    proc = conftest.sweep_cli(*conftest.FAST, "--dataset", shapes / data, "--model", model, "--augment", "off",
                              "--out", out, cwd=shapes)
    message = _refused(proc, out)
    where, given, documented = _documented()[row]
    assert where == "CLI" and given.startswith(f"--dataset <tmp>/{data} --model {model} --augment off")
    assert message == documented
    assert f"model {model}" in message and "(300, " in message  # the model and the data's shape, named
    if model.startswith("reviewpkg"):
        assert "init fails" in message and "ValueError" in message  # and the first line of what went wrong


def test_a_catalogue_model_on_images_and_the_mlp_on_any_shape_are_still_accepted(shapes, small_digits):
    """The new check refuses what cannot run, nothing else: the MLP takes (N, 64) and (N, 8, 8) arrays, and
    resnet8 takes (N, H, W, C) images."""
    from nondet_jax.config import from_flat
    from nondet_jax.data import load_npz
    from nondet_jax.study.prepare import check_model_input
    from nondet_jax.train import DataSpec

    for name in ("gray.npz", "tab.npz"):
        data = load_npz(str(shapes / name))
        check_model_input(from_flat({"model.name": "mlp"}), DataSpec(300, data.x_train.shape[1:], 10))
        with pytest.raises(UsageError, match="needs images"):
            check_model_input(from_flat({"model.name": "resnet8"}), DataSpec(300, data.x_train.shape[1:], 10))
    check_model_input(from_flat({"model.name": "resnet8"}), conftest.spec_of(small_digits))


class OneRow:  # a user's model whose init (one example) works but whose forward pass on a batch fails
    def __new__(cls, num_classes: int = 10):
        import flax.linen as nn

        class Flat(nn.Module):
            num_classes: int = 10

            @nn.compact
            def __call__(self, x, train: bool):
                return nn.Dense(self.num_classes)(x.reshape(1, -1))

        return Flat(num_classes)


def test_a_model_failing_on_a_batch_is_named_with_the_first_line_of_its_error(small_digits, tmp_path):
    """The forward pass is guarded as the init is: the model, the batch's and the data's shapes and the first
    line of Flax's ScopeParamShapeError, in one line, before anything is written."""
    import optax

    import nondet_jax as nj

    d = small_digits
    with pytest.raises(UsageError) as e:
        nj.run_study(OneRow, (d.x_train, d.y_train, d.x_test, d.y_test), optimizer=optax.adam(1e-2), epochs=1,
                     batch_size=64, arms="control,init", replicas=2, out=tmp_path / "run", log=lambda *a: None)
    message = str(e.value)
    assert "\n" not in message and not (tmp_path / "run").exists()
    assert re.fullmatch(r"model \S+:OneRow fails on a batch of shape \(64, 8, 8, 1\) of data of shape \(256, 8, 8, 1\) "
                        r"\(ScopeParamShapeError: .*\); make the model take inputs of this shape, or reshape the data "
                        r"\(images are \(N, H, W, C\)\)", message), message


class Linear:  # a user's model (built lazily: flax is imported when a test builds it)
    def __new__(cls, num_classes: int = 10):
        import flax.linen as nn

        class Dense(nn.Module):
            num_classes: int = 10

            @nn.compact
            def __call__(self, x, train: bool):
                return nn.Dense(self.num_classes)(x.reshape(x.shape[0], -1))

        return Dense(num_classes)


def _own_dataset(small_digits, kind: str):
    from nondet_jax.data import Dataset

    d = small_digits
    if kind == "classes":  # labels 0 .. 9 with num_classes=5
        return Dataset("mine", d.x_train, d.y_train, d.x_test, d.y_test, 5)
    x = d.x_train.copy()
    x[3, 0, 0, 0] = np.nan
    return Dataset("mine", x, d.y_train, d.x_test, d.y_test, 10)


@pytest.mark.parametrize("row,kind", [("R4", "classes"), ("R5", "nan")])
def test_a_dataset_built_by_hand_gets_the_checks_of_from_arrays(small_digits, tmp_path, row, kind):
    """Defect 2: Dataset(..., num_classes=5) with labels up to 9 trained, diverged and failed late about a
    dtype; a NaN in x_train was not refused. Both now get from_arrays' one-line refusal, before any write."""
    import optax

    import nondet_jax as nj

    out = tmp_path / "run"
    with pytest.raises(UsageError) as e:
        nj.run_study(Linear, _own_dataset(small_digits, kind), optimizer=optax.adam(1e-2), epochs=1, batch_size=64,
                     arms="control,init", replicas=2, out=out, log=lambda *a: None)
    message = str(e.value)
    assert "\n" not in message and not out.exists()
    where, given, documented = _documented()[row]
    assert where == "API" and given.startswith("run_study(Linear, Dataset('mine'")
    assert message == documented
    assert ("num_classes=5" in message) if kind == "classes" else ("NaN" in message)


def test_a_dataset_built_by_hand_is_checked_as_from_arrays_checks_arrays(small_digits):
    """The one set of checks (nondet_jax.data.check_arrays) for arrays and a Dataset: a good Dataset comes back
    as given, float 0/1 class labels are cast to int32 as from_arrays casts them, and a regression's width must
    be its targets'."""
    from nondet_jax.data import Dataset, check_dataset, from_arrays

    d = small_digits
    assert check_dataset(d) is d
    floats = check_dataset(d._replace(y_train=d.y_train.astype(np.float32), y_test=d.y_test.astype(np.float32)))
    assert floats.y_train.dtype == np.int32 and np.array_equal(floats.y_train, d.y_train)
    for bad, match in [(d._replace(x_test=d.x_test[:, :4]), "same example shape"),
                       (d._replace(y_test=d.y_test[:-1]), "y_test has shape"),
                       (d._replace(task="regresion"), "task 'regresion' is unknown"),
                       (d._replace(num_classes=10.0), "must be an integer"),
                       (Dataset("r", d.x_train, np.ones((256, 3), np.float32), d.x_test, np.ones((100, 3), np.float32),
                                2, "regression"), "num_classes=3")]:
        with pytest.raises(UsageError, match=match):
            check_dataset(bad)
    with pytest.raises(UsageError) as arrays:
        from_arrays("mine", *_own_dataset(d, "nan")[1:5])
    with pytest.raises(UsageError) as dataset:
        check_dataset(_own_dataset(d, "nan"))
    assert str(arrays.value) == str(dataset.value)


def test_the_report_of_an_interrupted_study_names_its_unfinished_arms(finished_run, capsys):
    """Defect 3: a sweep killed after arms/control.json was written left a folder whose report listed the
    finished arms only, exit 0, without a word about the arm the study asked for and never finished."""
    from nondet_jax.cli.report import main as report_main

    record = json.loads((finished_run / "arms" / "init.json").read_text())
    for name in record.get("files", []):  # the arm's files, as a sweep killed before it finished has none (the
        if name != "test_labels.npy":  # study's test labels, listed by every record, are written when it starts)
            (finished_run / name).unlink(missing_ok=True)
    (finished_run / "arms" / "init.json").unlink()
    shutil.rmtree(finished_run / "figures", ignore_errors=True)
    assert report_main([str(finished_run)]) == 0
    out = capsys.readouterr().out
    line = next((x for x in out.splitlines() if x.startswith("unfinished:")), None)
    assert line == (f"unfinished: 1 of the 2 arms this study asks for have no finished results (init) and are not "
                    "in this report (the sweep stopped before them); train them with python -m nondet_jax.sweep "
                    f"--resume {finished_run} (finished arms are kept), or rerun the same command, which rebuilds "
                    "the report"), out
    report = (finished_run / "report.md").read_text()
    assert f"**{line}**" in report and report.count(line) == 2  # above the table, and in it
    assert json.loads((finished_run / "summary.json").read_text())["unfinished"] == ["init"]
    assert list(json.loads((finished_run / "summary.json").read_text())["arms"]) == ["control"]

    # the fix it names works: --resume trains the missing arm, and the report says nothing more
    proc = conftest.sweep_cli("--resume", finished_run, "--no-progress")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (finished_run / "arms" / "init.json").is_file() and "unfinished" not in proc.stdout
    assert "unfinished" not in (finished_run / "report.md").read_text()


def test_a_finished_study_has_no_unfinished_line(finished_run_template):
    run, proc = finished_run_template
    assert "unfinished" not in proc.stdout and "unfinished" not in (run / "report.md").read_text()
    assert json.loads((run / "summary.json").read_text())["unfinished"] == []


def test_a_tfds_set_missing_from_the_data_dir_is_named_as_missing(tmp_path, capfd):
    """A --data-dir without the set (or that does not exist) was reported, after a warning of TFDS's own, as a
    TFRECORD format problem (outside review): it is named as not there, with the command that prepares it."""
    from nondet_jax.data.tfds_source import load_tfds

    for where in (tmp_path / "does_not_exist", tmp_path):
        with pytest.raises(UsageError, match=rf"dataset 'mnist' is not in {re.escape(str(where))} \(no folder mnist "
                                             r"there\); prepare it once .*tfds build mnist"):
            load_tfds("mnist", str(where))
    assert "WARNING" not in capfd.readouterr().err
