"""``python -m nondet_jax compare`` on real run folders and on CSV files, its one-line errors, and the
run folder's strict summary.json and arms.csv intervals."""

import csv
import json
import os

import numpy as np
import pytest
from conftest import FAST, compare_refused, sweep_cli

from nondet_jax.analysis import stats
from nondet_jax.analysis.compare import compare, compare_many, verdict
from nondet_jax.cli.compare import main
from nondet_jax.errors import UsageError


def sweep(*args):
    proc = sweep_cli(*FAST, "--replicas", "3", *args)
    assert proc.returncode == 0, proc.stderr


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("compare")
    sweep("--arms", "init,all", "--out", str(root / "a"))
    sweep("--arms", "all", "--seed", "1", "--lr", "0.05", "--out", str(root / "b"))
    return root / "a", root / "b"


@pytest.fixture(scope="module")
def same_seeds(runs):
    c = runs[0].parent / "c"  # method B of a paired design: A's seeds, another learning rate
    sweep("--arms", "init,all", "--lr", "0.05", "--out", str(c))
    return runs[0], c


def test_paired_run_folders_compare_seed_by_seed(same_seeds, tmp_path, capsys):
    a, c = same_seeds
    r = compare(a, c, paired=True)
    sa, sc = np.array(scores(a, "all")), np.array(scores(c, "all"))
    assert r["paired"] and r["paired_by"] == "replica" and r["n_pairs"] == 3 and r["pairs_left_out"] == 0
    assert r["difference"] == pytest.approx(np.mean(sc - sa))
    n_test = len(np.load(a / "test_labels.npy"))
    assert r["difference_ci"] == pytest.approx(list(stats.mean_ci(sc - sa, resolution=1 / n_test)))
    assert r["p"] == stats.paired_t_p(sa, sc, resolution=1 / n_test)  # the printed interval's own test
    assert (r["p"] < 0.05) == (r["difference_ci"][0] > 0 or r["difference_ci"][1] < 0)
    assert r["probability_of_improvement"] == pytest.approx(np.mean((sc > sa) + 0.5 * (sc == sa)))
    plot = tmp_path / "paired.png"
    assert main([str(a), str(c), "--paired", "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    assert "paired by replica: 3 seed pairs" in out and "paired t p" in out and plot.stat().st_size > 10_000
    assert main([str(a), str(c), "--paired", "--arm", "init", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["a"]["arm"] == "init"


def test_several_arms_are_one_family_with_holm_adjusted_p(same_seeds, capsys):
    """--arm init,all compares each arm of A with the same arm of B; every p is also Holm-adjusted over the
    family, printed beside the raw one and named in the verdict, in the JSON too."""
    a, c = same_seeds
    family = compare_many(a, c, arms=["init", "all"], paired=True)
    raw = [compare(a, c, arm=x, paired=True)["p"] for x in ("init", "all")]
    assert [r["p"] for r in family] == raw and [r["p_holm"] for r in family] == stats.holm(raw)
    assert [r["a"]["arm"] for r in family] == ["init", "all"] and {r["holm_family"] for r in family} == {2}
    assert main([str(a), str(c), "--arm", "init,all", "--paired"]) == 0
    out = capsys.readouterr().out
    assert out.count("Holm-adjusted over 2 comparisons") == 2 and "(arm init," in out and "(arm all," in out
    assert main([str(a), str(c), "--arm", "init,all", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["holm_family"] == 2 and [x["p_holm"] for x in r["comparisons"]] == stats.holm(
        [x["p"] for x in r["comparisons"]])
    assert compare_many(a, c)[0]["p_holm"] == compare(a, c)["p"]  # one comparison: its own family


def test_a_family_verdict_says_whether_the_finding_survives_holm(tmp_path):
    (tmp_path / "a.csv").write_text("acc,other\n0.981,0.5\n0.975,0.52\n0.979,0.49\n0.983,0.51\n0.980,0.5\n")
    (tmp_path / "b.csv").write_text("acc,other\n0.985,0.5\n0.982,0.51\n0.986,0.5\n0.984,0.52\n0.987,0.49\n")
    acc, other = compare_many(tmp_path / "a.csv", tmp_path / "b.csv", columns=["acc", "other"])
    assert acc["p"] < 0.05 and acc["p_holm"] == pytest.approx(min(1.0, 2 * acc["p"]))
    assert "Holm-adjusted over the 2 comparisons" in verdict(acc)
    assert ("the finding holds" in verdict(acc)) == (acc["p_holm"] < 0.05)
    assert "Cannot tell A and B apart" in verdict(other)


def test_a_verdict_follows_its_printed_test():
    """Five seeds all favouring B: the paired interval excludes 0 and its own test, the paired t, rejects (the
    sign-flip p printed before could not fall below 2/2^5 = 0.0625 there, so no difference was claimed); a
    difference the interval does not exclude is not claimed either."""
    a = np.array([0.80, 0.82, 0.81, 0.83, 0.79])
    five = stats.compare_paired(a, a + np.array([0.020, 0.022, 0.019, 0.021, 0.020]))
    assert five["difference_ci"][0] > 0 and five["p"] < 0.05 and verdict(five).startswith("B is better than A")
    assert "paired t p" in verdict(five) and five["pairs_for_80pct_power"] == 2  # sd 0.001: two pairs suffice
    noisy = stats.compare_paired(a, a + np.array([0.02, -0.01, 0.015, -0.02, 0.01]))
    assert noisy["difference_ci"][0] < 0 < noisy["difference_ci"][1] and noisy["p"] >= 0.05
    assert verdict(noisy).startswith("Cannot tell A and B apart")
    # Welch: a p below 0.05 with an interval that (widened) still includes 0 is not a finding either
    r = {**stats.compare_means([0.0, 1.0, 2.0], [2.0, 3.0, 4.0]), "p": 0.04, "difference_ci": [-0.1, 4.1]}
    assert verdict(r).startswith("Not decided") and "includes 0" in verdict(r)


def test_paired_refuses_runs_that_do_not_share_seeds(runs, capsys):
    a, b = runs
    assert main([str(a), str(b), "--paired"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "same study.seed" in err and "drop --paired" in err
    assert main([str(a), str(a), "--paired", "--arm", "init", "--arm-b", "all"]) == 2
    assert "same arm" in capsys.readouterr().err


def test_paired_csv_files_pair_by_their_seed_column(tmp_path):
    a, b = tmp_path / "a.csv", tmp_path / "b.csv"
    a.write_text("seed,acc\n0,0.90\n1,0.85\n2,0.88\n3,0.91\n")
    b.write_text("seed,acc\n3,0.93\n1,0.86\n0,0.91\n2,0.88\n")  # another order: paired by seed, not by row
    r = compare(a, b, paired=True)
    assert r["paired_by"] == "seed" and r["difference"] == pytest.approx(np.mean([0.01, 0.01, 0.0, 0.02]))
    assert r["probability_of_improvement"] == pytest.approx(3.5 / 4)
    b.write_text("seed,acc\n0,0.91\n1,0.86\n2,0.88\n7,0.93\n")
    with pytest.raises(UsageError, match="seed 3 is only in"):
        compare(a, b, paired=True)
    a.write_text("acc\n0.90\n0.85\n0.88\n")
    b.write_text("acc\n0.91\n0.86\n")
    with pytest.raises(UsageError, match="row by row.*3 scores.*2"):
        compare(a, b, paired=True)
    b.write_text("acc\n0.91\n0.86\n0.90\n")
    assert compare(a, b, paired=True)["paired_by"] == "row"


def test_paired_t_p_is_scipys_and_agrees_with_the_printed_interval():
    """The paired p is scipy's ttest_rel; it falls below 0.05 exactly when the printed 95% interval excludes 0,
    tied differences of counts included (their p is where the tie bound reaches 0); no difference: about 5%."""
    from scipy import stats as sps

    rng = np.random.default_rng(0)
    u = rng.normal(size=(300, 8))
    p = [stats.paired_t_p(u[i] + rng.normal(0, 0.3, 8), u[i] + rng.normal(0, 0.3, 8)) for i in range(300)]
    assert np.mean(np.array(p) < 0.05) <= 0.08
    a, b = [0.0, 0.0, 0.0], [1.0, 2.0, 3.0]
    assert stats.paired_t_p(a, b) == pytest.approx(sps.ttest_rel(b, a).pvalue)
    for n, steps in ((3, 1), (8, 1), (8, 3), (20, 1)):  # every pair differs by the same count of test images
        a = np.full(n, 0.9)
        b = a + steps / 360
        r = stats.compare_paired(a, b, resolution=1 / 360)
        lo, hi = r["difference_ci"]
        assert (r["p"] < 0.05) == (lo > 0 or hi < 0), (n, steps, r["p"], lo, hi)
    assert stats.paired_t_p([0.9] * 4, [0.9] * 4, resolution=1 / 360) == 1.0


def scores(run, arm):
    return [r["test_accuracy"] for r in json.loads((run / "arms" / f"{arm}.json").read_text())["rows"]]


def test_two_run_folders(runs, capsys):
    a, b = runs
    assert main([str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "difference of means B − A" in out and "probability of improvement P(B > A)" in out
    r = compare(a, b)
    ref = stats.compare_means(scores(a, "all"), scores(b, "all"))
    assert r["difference"] == pytest.approx(ref["difference"]) and r["p"] == pytest.approx(ref["p"])
    assert r["n_a"] == r["n_b"] == 3 and r["a"]["arm"] == "all"
    assert compare(a, a, arm="init", arm_b="all")["b"]["arm"] == "all"


def test_loss_is_lower_is_better(runs):
    a, b = runs
    r = compare(a, b, metric="test_loss")
    assert r["higher_is_better"] is False
    la = [x["test_loss"] for x in json.loads((a / "arms" / "all.json").read_text())["rows"]]
    lb = [x["test_loss"] for x in json.loads((b / "arms" / "all.json").read_text())["rows"]]
    assert r["probability_of_improvement"] == pytest.approx(np.mean(np.array(lb)[:, None] < np.array(la)[None]))


def test_two_csv_files_and_json_output(tmp_path, capsys):
    (tmp_path / "a.csv").write_text("seed,acc\n0,0.981\n1,0.975\n2,0.979\n3,0.983\n")
    (tmp_path / "b.csv").write_text("0.985\n0.982\n0.986\n0.981\n0.987\n")  # no header, one column
    assert main([str(tmp_path / "a.csv"), str(tmp_path / "b.csv"), "--json"]) == 0
    r = json.loads(capsys.readouterr().out, parse_constant=lambda c: pytest.fail(f"bare {c} in JSON"))
    ref = stats.compare_means([0.981, 0.975, 0.979, 0.983], [0.985, 0.982, 0.986, 0.981, 0.987])
    assert r["difference"] == pytest.approx(ref["difference"]) and r["n_b"] == 5
    assert r["a"]["column"] == "acc"
    assert r["detect"] is None and r["replicas_for_detect"] is None


def test_detect_sizes_the_next_study_for_a_stated_difference(tmp_path, capsys):
    (tmp_path / "a.csv").write_text("0.981\n0.975\n0.979\n0.983\n")
    (tmp_path / "b.csv").write_text("0.985\n0.982\n0.986\n0.981\n")
    assert main([str(tmp_path / "a.csv"), str(tmp_path / "b.csv"), "--detect", "0.002"]) == 0
    out = capsys.readouterr().out
    ref = stats.compare_means([0.981, 0.975, 0.979, 0.983], [0.985, 0.982, 0.986, 0.981], detect=0.002)
    assert ref["replicas_for_detect"] == stats.replicas_for_difference(0.002, ref["pooled_std"]) > 4
    assert f"at a difference of 0.002 (--detect): {ref['replicas_for_detect']}" in out


@pytest.mark.parametrize("make,args,message", [
    (lambda d: None, ["{d}/a.csv", "{d}/run"], "cannot compare a CSV file"),
    (lambda d: None, ["{d}/a.csv", "{d}/missing.csv"], "does not exist"),
    (lambda d: (d / "c.csv").write_text("x,y\n1,2\n3,4\n"), ["{d}/a.csv", "{d}/c.csv"], "2 numeric columns"),
    (lambda d: None, ["{d}/a.csv", "{d}/a.csv", "--column", "nope"], "no column 'nope'"),
    (lambda d: (d / "c.csv").write_text("acc\n0.9\n"), ["{d}/a.csv", "{d}/c.csv"], "at least 2"),
    (lambda d: (d / "c.csv").write_text("acc\n0.9\nnan\n"), ["{d}/a.csv", "{d}/c.csv"], "non-finite"),
    (lambda d: (d / "c.csv").write_text("acc\n0.9\nbad\n"), ["{d}/a.csv", "{d}/c.csv", "--column", "acc"],
     "not numbers"),
    (lambda d: None, ["{d}/a.csv", "{d}/a.csv", "--arm", "init"], "--arm, --arm-b and --metric are for run folders"),
    (lambda d: None, ["{d}/run", "{d}/run"], "not a nondet_jax run folder"),
    (lambda d: (d / "c.csv").write_text("seed,acc\n0,0.9\n1,NA\n2,0.8\n"), ["{d}/a.csv", "{d}/c.csv"],
     "row 3, column 'acc' is empty or NA ('NA')"),
    (lambda d: (d / "c.csv").write_text("seed,acc\n0,0.9\n1,0.8\n2,\n"), ["{d}/a.csv", "{d}/c.csv"],
     "row 4, column 'acc' is empty or NA"),
    (lambda d: None, ["{d}/a.csv", "{d}/a.csv", "--detect", "0"], "--detect 0.0: give a nonzero difference"),
    (lambda d: None, ["{d}/a.csv", "{d}/a.csv", "--column", "acc,acc"], "--column names acc, acc: name each at most once"),
    (lambda d: None, ["{d}/a.csv", "{d}/a.csv", "--column", "acc,"], "--column 'acc,' has an empty name"),
    (lambda d: None, ["{d}/a.csv", "{d}/a.csv", "--column", "acc,x", "--plot", "{d}/f.png"],
     "--plot draws one comparison"),
    (lambda d: None, ["{d}/run", "{d}/run", "--arm", "init,all", "--arm-b", "all"], "--arm-b pairs one arm"),
    # outside review: a semicolon file, a column named twice, scores that overflow float64's sums
    (lambda d: (d / "c.csv").write_text("seed;acc\n0;0.9\n1;0.8\n"), ["{d}/a.csv", "{d}/c.csv"],
     "has one column, 'seed;acc': compare reads comma-separated files"),
    (lambda d: (d / "c.csv").write_text("seed,acc,acc\n0,0.9,1\n1,0.8,1\n"), ["{d}/c.csv", "{d}/a.csv", "--column",
                                                                            "acc"], "names column 'acc' twice"),
    (lambda d: (d / "c.csv").write_text("acc\n1e308\n-1e308\n1e308\n"), ["{d}/c.csv", "{d}/a.csv"],
     "holds scores too large to average or square in float64"),
])
def test_mismatched_inputs_exit_2_with_one_line(tmp_path, capsys, make, args, message):
    (tmp_path / "a.csv").write_text("acc\n0.98\n0.97\n0.99\n")
    (tmp_path / "run").mkdir()
    make(tmp_path)
    assert main([x.format(d=tmp_path) for x in args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def test_scores_without_spread_get_no_welch_test(tmp_path, capsys):
    """Two tied samples (every run alike, as a control arm's replicas) printed a zero-width 95% CI, 'Welch p = 0'
    and 'B is worse than A' (outside review); scipy's ttest_ind gives NaN: no test, said so."""
    (tmp_path / "a.csv").write_text("acc\n0.98\n0.98\n0.98\n")
    (tmp_path / "b.csv").write_text("acc\n0.97\n0.97\n0.97\n")
    assert main([str(tmp_path / "a.csv"), str(tmp_path / "b.csv")]) == 0
    out = capsys.readouterr().out
    assert "95% CI and Welch p n/a (neither method's scores vary)" in out and "No test: neither method's" in out
    assert "worse" not in out and "p = 0" not in out
    assert np.isnan(stats.welch(np.full(3, 0.98), np.full(3, 0.97))["p"])


def test_lower_is_better_is_refused_for_run_folders(runs, capsys):
    """--lower-is-better on two run folders flipped the verdict on accuracy (outside review): a run's metric knows
    its direction."""
    a, b = runs
    assert main([str(a), str(b), "--lower-is-better"]) == 2
    assert "--lower-is-better is for CSV files" in capsys.readouterr().err
    assert compare(a, b, metric="test_loss", higher_is_better=False)["higher_is_better"] is False


def test_missing_test_labels_change_no_number(runs, tmp_path):
    """compare read a tied accuracy's resolution from test_labels.npy; with the file gone it printed other numbers
    without a word (outside review). The arm's own verified logits give the same test-set size."""
    import shutil

    a, b = runs
    copy = tmp_path / "a"
    shutil.copytree(a, copy)
    (copy / "test_labels.npy").unlink()
    assert compare(copy, b, arm="all")["a"]["n_test"] == compare(a, b, arm="all")["a"]["n_test"] > 0


def test_run_folder_errors(runs, capsys):
    a, b = runs
    assert main([str(a), str(b), "--arm", "init"]) == 2  # b has no init arm
    assert "arm 'init' has no finished results" in capsys.readouterr().err
    assert main([str(a), str(b), "--metric", "f1"]) == 2
    assert "unknown --metric 'f1'" in capsys.readouterr().err


def test_summary_json_is_strict_and_arms_csv_has_pairwise_cis(runs):
    a, _ = runs
    summary = json.loads((a / "summary.json").read_text(), parse_constant=lambda c: pytest.fail(f"bare {c}"))
    m = summary["arms"]["init"]["metrics"]
    assert len(m["disagreement"]["ci"]) == 2 and m["accuracy"]["std_ci"][0] <= m["accuracy"]["std"]
    row = next(r for r in csv.DictReader((a / "arms.csv").open()) if r["arm"] == "init")
    for name, unit, scale in (("disagreement", "_pct", 100), ("cka", "", 1), ("pearson", "", 1),
                              ("weight_distance", "", 1)):
        lo, hi = float(row[f"{name}_ci_low{unit}"]), float(row[f"{name}_ci_high{unit}"])
        assert lo <= float(row[name + unit]) <= hi, name
        assert (lo, hi) == pytest.approx(tuple(scale * c for c in m[name]["ci"]))  # the mean column's units


def test_strict_json_replaces_non_finite_values():
    from nondet_jax.store.io import strict_json

    out = strict_json({"a": [float("nan"), 1.0, np.float64("inf")], "b": (np.float32(2.5), None), "c": "x"})
    assert json.loads(json.dumps(out, allow_nan=False)) == {"a": [None, 1.0, None], "b": [2.5, None], "c": "x"}


def test_plot_draws_the_intervals_it_prints(tmp_path):
    from nondet_jax.report.compare_figure import plot_result

    (tmp_path / "a.csv").write_text("seed,acc\n0,0.981\n1,0.975\n2,0.979\n3,0.983\n")
    (tmp_path / "b.csv").write_text("seed,acc\n0,0.986\n1,0.984\n2,0.990\n3,0.982\n")
    png = tmp_path / "compare.png"
    assert main([str(tmp_path / "a.csv"), str(tmp_path / "b.csv"), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    r = compare(tmp_path / "a.csv", tmp_path / "b.csv")
    assert r["a"]["scores"] == [0.981, 0.975, 0.979, 0.983]
    fig = plot_result(r)
    _, diff, poi = fig.axes
    for axis, ci in ((diff, r["difference_ci"]), (poi, r["probability_of_improvement_ci"])):
        (start, end), = [seg[:, 0] for seg in axis.collections[0].get_segments()]
        assert (start, end) == pytest.approx(tuple(ci))
    assert diff.get_xlim()[0] < 0 < diff.get_xlim()[1]  # the null value is on the axis
    # the methods by name, each interval's method in its title, the score's name on its axis
    scores = fig.axes[0]
    assert [t.get_text() for t in scores.get_xticklabels()] == ["A: a.csv (acc)\nn=4", "B: b.csv (acc)\nn=4"]
    assert scores.get_title() == "per-seed scores; mean, 96.5% t interval (t at 98.25%: widened from 95%)"
    assert scores.get_ylabel() == "acc"
    assert "Welch 95% CI" in diff.get_title() and "Newcombe 95% CI" in poi.get_title()
    assert "b.csv (acc) − a.csv (acc)" in diff.get_title() and "(B: b.csv (acc))" in poi.get_title()
    assert diff.get_xlabel() == "acc, B − A" and poi.get_xlabel() == "probability"
    paired = plot_result(compare(tmp_path / "a.csv", tmp_path / "b.csv", paired=True))
    assert "95% CI: paired t, scipy's ttest_rel" in paired.axes[1].get_title() and "Wilson 95% CI" in paired.axes[2].get_title()


def test_report_waits_for_no_sweep_it_refuses_a_locked_folder(runs, capsys):
    """`report` takes the folder's lock: alongside a sweep it used to write a report of 2 arms while
    summary.json and arms.csv had 3. Held by another process here, it refuses and writes nothing."""
    from nondet_jax.cli.report import main as report_main
    from nondet_jax.store.run import release_lock, take_lock

    a, _ = runs
    before = (a / "report.md").read_bytes()
    fd = take_lock(a)
    try:
        assert report_main([str(a)]) == 2
        err = capsys.readouterr().err.strip()
        assert "is in use by another sweep" in err and "rebuild the report" in err and "\n" not in err
        assert (a / "report.md").read_bytes() == before
    finally:
        release_lock(fd)
    assert report_main([str(a)]) == 0 and "report:" in capsys.readouterr().out



def test_report_names_the_folder_files_it_lacks(runs, tmp_path, capsys):
    """Without model.json the report was rebuilt with invented method text ('BatchNorm statistics recomputed' for
    an MLP, 'submodule ?'); without test_labels.npy its mitigations table vanished; without environment.json it
    said 'backend None' (outside review): each is named, with the command that writes it again, and nothing is
    written."""
    import shutil

    from nondet_jax.cli.report import main as report_main

    a, _ = runs
    for lost in (["model.json"], ["environment.json", "test_labels.npy"]):
        copy = tmp_path / "-".join(lost)
        shutil.copytree(a, copy)
        before = (copy / "report.md").read_bytes()
        for name in lost:
            (copy / name).unlink()
        assert report_main([str(copy)]) == 2
        err = capsys.readouterr().err.strip()
        assert f"lacks {', '.join(lost)}; rerun the sweep command that made it (command.txt)" in err, err
        assert "\n" not in err and (copy / "report.md").read_bytes() == before
    copy = tmp_path / "no-logits"
    shutil.copytree(a, copy)
    (copy / "logits" / "all.npy").unlink()  # said 'missing, truncated or corrupt (sha256 mismatch)' before
    assert report_main([str(copy)]) == 2
    assert f"result file {copy}/logits/all.npy is missing; rerun the sweep with --recompute all" in \
        capsys.readouterr().err

@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_plot_never_replaces_a_link_or_a_device(tmp_path, capsys, kind):
    """`--plot PATH` (and `audit --json PATH`) write by rename: a FIFO, device or symbolic link at PATH
    would become a regular file (`audit --json /dev/full` replaced the machine's /dev/full as root)."""
    (tmp_path / "a.csv").write_text("0.98\n0.97\n0.99\n")
    target = tmp_path / "target.png"
    target.write_bytes(b"keep")
    out = tmp_path / "out.png"
    if kind == "symlink":
        out.symlink_to(target)
    else:
        os.mkfifo(out)
    assert main([str(tmp_path / "a.csv"), str(tmp_path / "a.csv"), "--plot", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "which would be replaced" in err and "\n" not in err
    assert target.read_bytes() == b"keep" and (out.is_symlink() if kind == "symlink" else not out.is_file())
    from nondet_jax.cli.audit import main as audit_main
    assert audit_main(["--json", str(out)]) == 2
    assert "--json" in capsys.readouterr().err and target.read_bytes() == b"keep"


def test_csv_with_a_byte_order_mark_and_a_fifo(tmp_path, capsys):
    """A spreadsheet's UTF-8 BOM used to become part of the first column's name; a FIFO hung the read."""
    (tmp_path / "a.csv").write_bytes("\ufeffacc\n0.98\n0.97\n0.99\n".encode())
    (tmp_path / "b.csv").write_text("acc\n0.96\n0.95\n0.97\n")
    assert main([str(tmp_path / "a.csv"), str(tmp_path / "b.csv"), "--column", "acc"]) == 0
    assert "(column acc)" in capsys.readouterr().out
    os.mkfifo(tmp_path / "f.csv")
    assert main([str(tmp_path / "f.csv"), str(tmp_path / "b.csv")]) == 2
    assert "is not a regular file" in capsys.readouterr().err


def _copy(run, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    return copy


@pytest.mark.parametrize("edit", ["accuracy", "list"])
def test_compare_reads_an_arm_record_as_report_does(runs, tmp_path, capsys, edit):
    """compare never checked an arm record's own checksum: test accuracies edited to 0.99 in arms/all.json made
    report and --resume refuse, while compare printed a difference from the edited numbers; a record that is a list
    crashed it with AttributeError (outside review)."""
    a, b = runs
    copy = _copy(a, tmp_path)
    path = copy / "arms" / "all.json"
    record = json.loads(path.read_text())
    if edit == "accuracy":
        for row in record["rows"]:
            row["test_accuracy"] = 0.99
    path.write_text(json.dumps(record if edit == "accuracy" else []))
    said = "was changed after it was written" if edit == "accuracy" else "is not an arm record"
    with pytest.raises(UsageError, match=f"result file {path} {said}.*rerun with --recompute all"):
        compare(copy, b, arm="all")
    assert said in compare_refused(capsys, copy, b, "--arm", "all")


@pytest.mark.parametrize("name", ["config.json", "arms/all.json", "logits/all.npy", "model.json"])
def test_compare_follows_no_link_out_of_a_run_folder(runs, tmp_path, capsys, name):
    """A symbolic link to a file outside the folder, which report and --resume refuse, was followed by compare."""
    a, b = runs
    copy = _copy(a, tmp_path)
    outside = tmp_path / "outside"
    outside.write_bytes((copy / name).read_bytes())  # the very bytes: only the link is wrong
    (copy / name).unlink()
    (copy / name).symlink_to(outside)
    assert f"{copy / name} is a symbolic link, which nondet_jax never follows" in compare_refused(capsys, copy, b)


@pytest.mark.parametrize("name", ["model.json", "arms/all.json"])
def test_compare_never_waits_on_a_fifo_in_a_run_folder(runs, tmp_path, capsys, name):
    """compare hung forever on a FIFO where model.json or an arm record was."""
    a, b = runs
    copy = _copy(a, tmp_path)
    (copy / name).unlink()
    os.mkfifo(copy / name)
    assert f"{copy / name} is a FIFO, which a run folder never holds" in compare_refused(capsys, copy, b)


@pytest.mark.parametrize("damage", ["{ not json", "[]", '{"identity": {"data": {"test_sha256": 7}}}', None])
def test_a_damaged_model_json_is_named_not_called_another_test_set(runs, tmp_path, capsys, damage):
    """With model.json damaged (or gone), compare said the two runs' test arrays differ: its test split is unknown,
    and model.json is what to repair (the sweep writes it again on --resume)."""
    a, b = runs
    copy = _copy(a, tmp_path)
    if damage is None:
        (copy / "model.json").unlink()
        said = f"{copy} has no model.json, which records the test split its scores are on; rerun the sweep with " \
               f"--resume {copy}"
    else:
        (copy / "model.json").write_text(damage)
        said = f"{copy / 'model.json'} is unreadable or corrupt, so the test set {copy} was scored on is unknown; " \
               f"delete it and rerun the sweep with --resume {copy}"
    err = compare_refused(capsys, copy, b)
    assert said in err and "test arrays differ" not in err
