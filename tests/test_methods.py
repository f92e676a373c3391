"""Methods in a study: one folder, one ordinary run folder per method, paired by seed, a report across them."""

from __future__ import annotations

import csv
import json
import os
import shutil

import numpy as np
import pytest
from conftest import FAST, compare_refused, sweep_cli

from nondet_jax.analysis import stats as S

METHODS = ["--method", "base:", "--method", "same:metrics.power_ratios=0.5", "--method", "lr2:optim.lr=0.2"]
STUDY = [*FAST, "--replicas", "3", "--arms", "control,all", "--set", "train.checkpoint_seconds=0"]


@pytest.fixture(scope="module")
def methods_run(tmp_path_factory):
    """A finished 3-method study from the command line: base, a method whose results equal base's (a
    report-only key) and a learning rate of its own."""
    out = tmp_path_factory.mktemp("methods") / "study"
    proc = sweep_cli(*STUDY, *METHODS, "--out", out)
    assert proc.returncode == 0, proc.stderr
    return out, proc


def _scores(folder, arm="all"):
    """Per-replica test accuracy (a fraction) of an arm, in replica order, from its stored record."""
    rows = json.loads((folder / "arms" / f"{arm}.json").read_text())["rows"]
    return np.array([r["test_accuracy"] for r in sorted(rows, key=lambda r: r["replica"])])


def test_cli_study_of_three_methods_reports_paired_comparisons(methods_run):
    out, proc = methods_run
    record = json.loads((out / "methods.json").read_text())
    assert list(record["methods"]) == ["base", "same", "lr2"] and record["baseline"] == "base"
    for name in record["methods"]:  # each method an ordinary run folder with its own report
        assert (out / "methods" / name / "config.json").is_file() and (out / "methods" / name / "report.md").is_file()
    base, same, lr2 = (_scores(out / "methods" / n) for n in ("base", "same", "lr2"))
    # paired by construction: replica r of every method trains under the same keys, so a method that changes no
    # result reproduces the baseline replica by replica, bitwise
    assert np.array_equal(base, same) and len(base) == 3
    assert not np.array_equal(base, lr2)
    summary = json.loads((out / "summary.json").read_text())
    comparisons = {(c["method_b"], c["arm"]): c for c in summary["comparisons"]}
    assert set(comparisons) == {("same", "all"), ("lr2", "all")}  # control's replicas are one run: not compared
    c = comparisons["lr2", "all"]
    expected = S.compare_paired(base, lr2)  # the existing paired machinery on the stored scores
    assert c["difference"] == pytest.approx(np.mean(lr2 - base)) == pytest.approx(expected["difference"])
    assert c["difference_ci"] == pytest.approx(expected["difference_ci"]) and c["p"] == pytest.approx(expected["p"])
    assert c["probability_of_improvement"] == pytest.approx(np.mean((lr2 > base) + 0.5 * (lr2 == base)))
    ps = [comparisons[m, "all"]["p"] for m in ("same", "lr2")]
    assert [comparisons[m, "all"]["p_holm"] for m in ("same", "lr2")] == pytest.approx(S.holm(ps))
    assert c["holm_family"] == 2
    assert comparisons["same", "all"]["difference"] == 0.0
    report = (out / "report.md").read_text()
    assert "paired by seed" in report and "| lr2 | base | all |" in report and "| same | base | all |" in report
    assert "Holm" in report and (out / "figures" / "method-lr2.png").stat().st_size > 0
    rows = list(csv.DictReader((out / "methods.csv").open()))
    assert {(r["method"], r["arm"]) for r in rows} == {(m, a) for m in ("base", "same", "lr2") for a in ("control", "all")}
    assert "lr2" in proc.stdout and "Holm p" in proc.stdout


def test_compare_reads_a_study_of_methods(methods_run, capsys):
    from nondet_jax.cli import compare

    out, _ = methods_run
    assert compare.main([str(out), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert [c["method_b"] for c in got["comparisons"]] == ["same", "lr2"] and got["holm_family"] == 2
    assert compare.main([str(out), "--method-a", "lr2", "--method-b", "base", "--json"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert one["paired"] and one["a"]["source"].endswith("lr2") and one["holm_family"] == 1
    summary = json.loads((out / "summary.json").read_text())
    lr2 = next(c for c in summary["comparisons"] if c["method_b"] == "lr2")
    assert one["difference"] == pytest.approx(-lr2["difference"])
    assert compare.main([str(out), "--method-b", "nosuch"]) == 2
    assert "is not a method of" in capsys.readouterr().err
    record = (out / "methods.json").read_text()
    edited = json.loads(record)
    edited["methods"]["lr2"]["settings"] = {"optim.lr": "0.3"}  # an edited record: not what lr2 trained with
    try:
        (out / "methods.json").write_text(json.dumps(edited))
        assert compare.main([str(out)]) == 2
        assert "says method 'lr2' trained under settings its folder did not (optim.lr 0.2 vs 0.3, trained vs recorded" in \
            capsys.readouterr().err
    finally:
        (out / "methods.json").write_text(record)


def test_adding_a_method_to_a_finished_study_trains_only_the_new_one(methods_run, tmp_path):
    out = tmp_path / "study"
    shutil.copytree(methods_run[0], out)
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in (out / "methods").rglob("*") if p.is_file()
              and p.parent.name in ("arms", "logits", "weights")}
    proc = sweep_cli(*STUDY, *METHODS, "--method", "nomom:optim.momentum=0", "--out", out)
    assert proc.returncode == 0, proc.stderr
    for name in ("base", "same", "lr2"):
        for arm in ("control", "all"):
            assert f"arm {arm}: already finished in {out / 'methods' / name}, reusing it" in proc.stdout
    assert all((p.read_bytes(), p.stat().st_mtime_ns) == was for p, was in before.items())
    new = proc.stdout.split("method nomom")[1]  # the new method is trained, both arms
    assert "arm control: test accuracy" in new and "arm all: test accuracy" in new and "reusing" not in new
    assert (out / "methods" / "nomom" / "arms" / "all.json").is_file()
    summary = json.loads((out / "summary.json").read_text())
    assert sorted(c["method_b"] for c in summary["comparisons"]) == ["lr2", "nomom", "same"]
    assert {c["holm_family"] for c in summary["comparisons"]} == {3}
    # report rebuilds every method's report and the one across them, from the stored results alone
    from nondet_jax.cli import report

    (out / "report.md").unlink()
    (out / "methods" / "nomom" / "report.md").unlink()
    assert report.main([str(out)]) == 0
    assert "| nomom | base | all |" in (out / "report.md").read_text()
    assert (out / "methods" / "nomom" / "report.md").is_file()
    assert json.loads((out / "summary.json").read_text())["comparisons"] == summary["comparisons"]


def test_methods_from_a_config_file_and_flags(tmp_path):
    from nondet_jax.cli import sweep

    f = tmp_path / "m.yaml"
    f.write_text("model: {name: mlp}\nmethods:\n  base: {}\n  lr2: {optim.lr: 0.2}\n  nomom: {optim: {momentum: 0}}\n"
                 "baseline: lr2\n")
    args = sweep.build_parser().parse_args(["--config", str(f)])
    config = sweep.config_from_args(args)  # the methods section is not a config key
    methods, baseline = sweep.methods_from_args(args, config)
    assert [(m.name, m.settings) for m in methods] == [("base", {}), ("lr2", {"optim.lr": 0.2}),
                                                       ("nomom", {"optim.momentum": 0})]
    assert baseline == "lr2" and config.model.name == "mlp"
    args = sweep.build_parser().parse_args(["--config", str(f), "--method", "a:", "--method",
                                            "b:metrics.tta=flip,crop3,optim.lr=0.1"])
    methods, baseline = sweep.methods_from_args(args, sweep.config_from_args(args))  # flags replace the file's
    assert [(m.name, m.settings) for m in methods] == [("a", {}), ("b", {"metrics.tta": "flip,crop3",
                                                                         "optim.lr": "0.1"})]
    assert baseline == "a"


def test_api_methods_with_parts_and_frames(tmp_path):
    import jax
    import optax

    import nondet_jax as nj

    def smoothed(logits, labels):
        return optax.softmax_cross_entropy(logits, optax.smooth_labels(jax.nn.one_hot(labels, logits.shape[-1]), 0.1))

    kw = dict(model="mlp", data="digits", epochs=1, batch_size=256, arms="all", replicas=2, out=tmp_path / "m",
              settings={"train.checkpoint_seconds": 0}, log=lambda *a: None)
    r = nj.run_study(**kw, methods={"ce": {}, "smooth": {"loss": smoothed}}, baseline="ce")
    assert list(r.methods) == ["ce", "smooth"] and r.baseline == "ce"
    frame = r.to_frame("methods")
    assert list(frame.index.names) == ["method", "arm"] and frame.loc[("smooth", "all"), "vs"] == "ce"
    assert np.isnan(frame.loc[("ce", "all"), "difference"])
    def accuracy(method):  # the long replicas table: one number a row, in %
        f = r.methods[method].to_frame("replicas").query("metric == 'test_accuracy'")
        return f.sort_values(["arm", "replica"])["value"].to_numpy() / 100

    assert frame.loc[("smooth", "all"), "difference"] == pytest.approx(np.mean(accuracy("smooth") - accuracy("ce")))
    replicas = r.to_frame("replicas")
    assert list(replicas.columns[:3]) == ["method", "arm", "replica"] and set(replicas.method) == {"ce", "smooth"}
    # the method's loss is part of its identity: the same folder with another loss is refused, naming the part
    with pytest.raises(nj.UsageError, match="loss"):
        nj.run_study(**kw, methods={"ce": {}, "smooth": {"loss": lambda lo, y: smoothed(lo, y) * 2}})


def test_batched_methods_equal_each_method_alone(tmp_path):
    import jax
    import optax

    import nondet_jax as nj

    def smoothed(logits, labels):
        return optax.softmax_cross_entropy(logits, optax.smooth_labels(jax.nn.one_hot(labels, logits.shape[-1]), 0.1))

    kw = dict(model="mlp", data="digits", epochs=1, batch_size=256, arms="control,all", replicas=2,
              settings={"train.checkpoint_seconds": 0, "metrics.lmc_pairs": 0, "study.dynamics_every": 2})
    methods = {"base": {}, "lr2": {"optim.lr": 0.1}, "plain": {"optim.momentum": 0.0, "optim.weight_decay": 0.0},
               "smooth": {"loss": smoothed}}  # smooth has a part of its own: trained alone
    said = []
    batched = nj.run_study(**kw, out=tmp_path / "b", methods=methods, batch_methods=True, log=said.append)
    assert any("3 methods (base, lr2, plain) batched" in str(s) for s in said)
    alone = nj.run_study(**kw, out=tmp_path / "a", methods={n: methods[n] for n in ("base", "lr2", "plain")},
                         log=lambda *a: None)
    for name in ("base", "lr2", "plain"):
        record = json.loads((batched.out / "methods" / name / "arms" / "all.json").read_text())
        assert "batched with 3 methods" in record["strategy_reason"]
        for arm in ("control", "all"):
            b, a = batched.methods[name].logits[arm], alone.methods[name].logits[arm]
            np.testing.assert_allclose(b, a, rtol=0, atol=1e-5)  # float rounding: lr x unit schedule, traced
        control = batched.methods[name].logits["control"]
        assert np.array_equal(control[0], control[1])  # the control arm is still bitwise one run
        with np.load(batched.out / "methods" / name / "dynamics" / "all.npz") as b, \
                np.load(alone.out / "methods" / name / "dynamics" / "all.npz") as a:  # each method's own pair
            assert b["step"].tolist() == a["step"].tolist() == [0, 2, 4]
            np.testing.assert_allclose(b["weight_distance"], a["weight_distance"], rtol=1e-4)
    smooth = json.loads((batched.out / "methods" / "smooth" / "arms" / "all.json").read_text())
    assert "batched" not in smooth["strategy_reason"]
    assert not np.allclose(batched.methods["lr2"].logits["all"], batched.methods["base"].logits["all"])


def test_a_plain_study_on_a_folder_of_methods_says_what_the_folder_holds(methods_run):
    """It was told the folder 'is not a nondet_jax run folder'; nothing in it changes."""
    out, _ = methods_run
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    proc = sweep_cli(*STUDY, "--out", out)
    assert proc.returncode == 2 and "holds a study of methods (methods.json); continue it with the --method flags" \
        in proc.stderr, proc.stderr
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} == before


def test_the_report_of_methods_names_the_unfinished_ones_in_the_terminal_too(methods_run, tmp_path):
    import shutil

    from nondet_jax.report.methods import write_methods_report

    out = tmp_path / "study"
    shutil.copytree(methods_run[0], out)
    (out / "methods" / "lr2" / "summary.json").unlink()  # lr2 stopped before it finished
    lines = []
    write_methods_report(out, log=lines.append)
    assert "not finished yet: method(s) lr2 (rerun the same command to train them)" in lines
    assert "Not finished yet: lr2" in (out / "report.md").read_text()


def test_the_report_of_methods_refuses_a_method_folder_linked_outside(methods_run, tmp_path):
    """methods/lr2 a symbolic link to a folder elsewhere: the report rebuilt lr2's report, figures and lock there
    (an outside review); it refuses, one line, and the folder outside is not touched."""
    from nondet_jax.cli.report import main as report

    out, outside = tmp_path / "study", tmp_path / "elsewhere"
    shutil.copytree(methods_run[0], out)
    shutil.move(out / "methods" / "lr2", outside)
    (out / "methods" / "lr2").symlink_to(outside, target_is_directory=True)
    before = {p: p.stat().st_mtime_ns for p in outside.rglob("*")}
    assert report([str(out)]) == 2
    assert {p: p.stat().st_mtime_ns for p in outside.rglob("*")} == before


def test_a_methods_arm_record_gone_is_named_with_the_fix(methods_run, tmp_path):
    """A method's arm record removed by hand: the report names the method and arm it lacks (it said only that the
    methods share no varied arm, and to train an arm such as all)."""
    import shutil

    from nondet_jax.analysis.methods import compare_methods
    from nondet_jax.errors import UsageError

    out = tmp_path / "study"
    shutil.copytree(methods_run[0], out)
    (out / "methods" / "lr2" / "arms" / "all.json").unlink()
    for rebuilt in (False, True):  # lr2's summary as it was, and rebuilt without the arm
        if rebuilt:
            from nondet_jax.report.markdown import write_report

            write_report(out / "methods" / "lr2")
        with pytest.raises(UsageError, match=r"method lr2 lacks arm all \(its arms/<arm>.json is gone\); rerun the "
                                             "study's command to train it again"):
            compare_methods(out, b="lr2")


@pytest.mark.parametrize("edit", ["accuracy", "list"])
def test_a_methods_arm_record_is_read_as_report_reads_it(methods_run, tmp_path, capsys, edit):
    """lr2's test accuracies edited in its arms/all.json changed the paired difference and Holm p that compare
    printed and MethodsResult loaded, without a word; a record that is a list crashed both with AttributeError
    (outside review). Both now refuse as report does."""
    from nondet_jax.analysis.methods import compare_methods
    from nondet_jax.api import MethodsResult
    from nondet_jax.errors import UsageError

    out = tmp_path / "study"
    shutil.copytree(methods_run[0], out)
    path = out / "methods" / "lr2" / "arms" / "all.json"
    record = json.loads(path.read_text())
    for row in record["rows"]:
        row["test_accuracy"] = 0.99
    path.write_text(json.dumps(record if edit == "accuracy" else []))
    said = "was changed after it was written" if edit == "accuracy" else "is not an arm record"
    for read in (compare_methods, MethodsResult):
        with pytest.raises(UsageError, match=f"result file {path} {said}"):
            read(out)
    err = compare_refused(capsys, out)
    assert f"{path} {said}" in err and f"rerun with --resume {out / 'methods' / 'lr2'} --recompute all" in err


@pytest.mark.parametrize("edit", ["arms a list", "task regression", "task a list", "varied emptied", "vs_all damaged",
                                  "arm ../x", "a list", "not JSON"])
def test_a_damaged_method_summary_is_refused_with_the_report_that_rebuilds_it(methods_run, tmp_path, capsys, edit):
    """A method's summary.json has no checksum of its own: damaged, it crashed compare and MethodsResult with
    AttributeError, or sent them after another task's metric ("unknown --metric 'test_mse'" with no --metric
    given). It is checked against the method's arm records and refused, naming the report command that rebuilds it."""
    from nondet_jax.analysis.methods import compare_methods
    from nondet_jax.api import MethodsResult
    from nondet_jax.errors import UsageError

    out = tmp_path / "study"
    shutil.copytree(methods_run[0], out)
    folder = out / "methods" / "lr2"
    summary = json.loads((folder / "summary.json").read_text())
    if edit == "arms a list":
        summary["arms"] = list(summary["arms"].values())
    elif edit == "task regression":
        summary["task"] = "regression"
    elif edit == "task a list":
        summary["task"] = ["classification"]
    elif edit == "vs_all damaged":
        summary["vs_all"] = {arm: 3 for arm in summary["arms"]}
    elif edit == "arm ../x":
        summary["arms"]["../x"] = summary["arms"]["all"]
    elif edit == "varied emptied":
        summary["arms"]["all"]["varied"] = []
    elif edit == "a list":
        summary = [summary]
    (folder / "summary.json").write_text("{ not json" if edit == "not JSON" else json.dumps(summary))
    fix = f"rebuild it with python -m nondet_jax report {folder}"
    for read in (compare_methods, MethodsResult):
        with pytest.raises(UsageError, match=f"^{folder / 'summary.json'} .*; {fix}$"):
            read(out)
    err = compare_refused(capsys, out)
    assert f"{folder / 'summary.json'} " in err and err.endswith(fix) and "--metric" not in err
    from nondet_jax.cli.report import main as report

    assert report([str(folder)]) == 0  # the fix it names
    assert len(compare_methods(out)) == 2


@pytest.mark.parametrize("kind", ["fifo", "link"])
def test_compare_of_methods_never_waits_on_a_fifo_nor_follows_a_link(methods_run, tmp_path, capsys, kind):
    out = tmp_path / "study"
    shutil.copytree(methods_run[0], out)
    path = out / "methods" / "lr2" / "model.json"
    outside = tmp_path / "outside.json"
    outside.write_bytes(path.read_bytes())
    path.unlink()
    os.mkfifo(path) if kind == "fifo" else path.symlink_to(outside)
    said = "is a FIFO, which a run folder never holds" if kind == "fifo" else "is a symbolic link, which nondet_jax never"
    assert f"{path} {said}" in compare_refused(capsys, out)


def test_a_study_result_reads_arm_records_checked(methods_run, tmp_path):
    """StudyResult (each MethodsResult.methods[name]) read arm records as plain JSON: a record edited after the
    result was loaded went into its long tables and load_replica unchecked."""
    from nondet_jax.api import MethodsResult
    from nondet_jax.errors import UsageError

    out = tmp_path / "study"
    shutil.copytree(methods_run[0], out)
    result = MethodsResult(out)
    path = out / "methods" / "lr2" / "arms" / "all.json"
    record = json.loads(path.read_text())
    record["rows"][0]["test_accuracy"] = 0.99
    path.write_text(json.dumps(record))
    with pytest.raises(UsageError, match=f"result file {path} was changed after it was written"):
        result.methods["lr2"].to_frame("replicas")
