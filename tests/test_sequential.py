"""A sequential study of methods: replicas in looks until every comparison is answered (--until).

The statistics (the per-look level, the decisions, the simulated error) are checked on numbers; the
looks on real training: an arm grown look by look equals the arm trained whole, a stopped study resumes
without training, and a part that is not this study's is refused.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from conftest import FAST, sweep_cli

from nondet_jax import config as cfg
from nondet_jax.analysis import sequential
from nondet_jax.errors import UsageError
from nondet_jax.until import Until, parse

MLP = {"model.name": "mlp", "train.epochs": 1, "train.batch_size": 256, "study.arms": ["control", "all"],
       "study.strategy": "sequential", "train.checkpoint_seconds": 0}


@pytest.mark.parametrize("spec,max_replicas,replicas,words", [
    ("sure", None, 4, "write decided"), ("width", None, 4, "write decided"), ("width=-1", None, 4, "positive number"),
    ("decided=nan", None, 4, "positive number"), ("decided", 4, 4, "above the first look's 4"),
    ("decided", None, 2, "at least 3 replicas"), ("decided", 8.5, 4, "must be an integer"),
    ("decided", 5000, 8, "more than the 1024 replicas per method"), ("decided", None, 2, "use --replicas 3 or more"),
    ("decided", None, 2000, r"first look alone would train 2000; start from fewer, e\.g\. --replicas 256$")])
def test_a_bad_design_is_one_line_naming_the_fix(spec, max_replicas, replicas, words):
    with pytest.raises(UsageError, match=words):
        parse(spec, max_replicas, replicas)


def test_a_design_looks_every_round_up_to_its_most_replicas():
    assert parse("decided", None, 4) == Until("decided", None, 4, 16)
    assert parse("width=0.01", 14, 8).looks() == [8, 12, 14]
    assert parse("decided=0.02", 12, 4).spec == "decided=0.02"
    # the default is 4x the first look, at most the 1024 planned for (it was refused, naming a --max-replicas 1200 the
    # command never gave)
    assert parse("decided", None, 300) == Until("decided", None, 300, 1024)
    for spec, most, replicas, words in [("decided", None, 2, "use replicas=3 or more"),
                                        ("decided", 4, 4, r"4 replicas \(replicas=\); e\.g\. max_replicas=16$")]:
        with pytest.raises(UsageError, match=words):  # run_study's words, not the command line's
            parse(spec, most, replicas, where="until=")


def test_the_look_levels_keep_the_designs_error_at_5_percent():
    """The boundary's levels, calibrated on one seeded simulation, hold on fresh ones: no difference is
    decided where there is none in more than 5% of studies (plus Monte Carlo error), for one comparison and
    for three (Bonferroni), and the interval printed at the stop covers at least 95%."""
    design = Until("decided", None, 8, 32)
    levels = sequential.design_levels(design)
    assert len(levels) == 7 and list(levels) == sorted(levels)  # stricter at early looks
    assert 0.05 / 7 < levels[0] and levels[-1] < 0.05  # looser than Bonferroni over 7, stricter than one look
    pocock = sequential.look_levels(tuple(design.looks()), 0.05, 0.5, 0.0)
    assert len(set(pocock)) == 1 and 0.0125 / 2 < pocock[0] < 0.05 / 2 * 1.2
    # a folder recorded before boundaries were: its looks were read at Pocock's level, and so are its levels now
    earlier = sequential.boundary_of(design, {"rule": "decided"})
    assert earlier is sequential.EARLIER and sequential.design_levels(design, 1, earlier) == pocock
    assert sequential.boundary_of(design, sequential.design_record(design)) == sequential.BOUNDARY
    assert sequential.boundary_of(Until("width", 1.0, 8, 32), {}) is sequential.REPEATED
    for comparisons in (1, 3):
        null = sequential.simulate(design, 0.0, 8000, seed=11, comparisons=comparisons)
        assert null["decided"] <= 0.05 / comparisons + 3 * np.sqrt(0.05 / comparisons / 8000)
        assert null["coverage"] >= 0.95 - 0.006
    assert null["futile"] > 0.8 and null["mean_replicas"] < 16  # no difference: given up early, not run to 32
    real = sequential.simulate(design, 1.0, 4000, seed=12)
    assert real["decided"] > 0.95 and real["mean_replicas"] < 16 and real["coverage"] >= 0.95 - 0.01


def test_stopping_on_the_width_of_the_repeated_interval_keeps_its_coverage():
    design = Until("width", 1.0, 8, 32)
    for effect in (0.0, 1.0):
        cell = sequential.simulate(design, effect, 4000, seed=13)
        assert cell["coverage"] >= 0.95 - 0.01 and 8 < cell["mean_replicas"] < 32


def _comparison(a, b, name="lr2"):
    from nondet_jax.analysis import stats as S

    r = S.compare_paired(a, b)
    return {**r, "method_a": "base", "method_b": name, "arm": "all", "a": {"scores": list(a)}, "b": {"scores": list(b)}}


def test_a_look_answers_each_comparison_by_its_repeated_interval():
    rng = np.random.default_rng(0)
    a = rng.normal(0.9, 0.01, 8)
    clear, tied, small = a + 0.05 + rng.normal(0, 0.005, 8), a + rng.normal(0, 0.01, 8), a + rng.normal(0, 0.001, 8)
    design = Until("decided", None, 8, 16)
    look = sequential.assess(design, [_comparison(a, clear)])
    (row,) = look["comparisons"]
    assert row["decision"] == "lr2 is better" and look["stop"] and look["why"] == "every comparison is answered"
    levels = sequential.design_levels(design)
    level = levels[0]
    assert look["level"] == level
    from scipy import stats as sps

    d = clear - a  # the repeated interval is the paired t interval at 1 - level (scipy's, by hand)
    half = sps.t.ppf(1 - level / 2, 7) * d.std(ddof=1) / np.sqrt(8)
    assert row["interval"] == pytest.approx([d.mean() - half, d.mean() + half])
    worse = sequential.assess(design, [_comparison(clear, a)])["comparisons"][0]
    assert worse["decision"] == "base is better"
    two = sequential.assess(design, [_comparison(a, clear), _comparison(a, tied, "same")])
    assert [c["decision"] for c in two["comparisons"]] == ["lr2 is better", "futile"] and two["stop"]
    assert two["level"] < look["level"]  # two comparisons share the 5%
    maybe = a + np.array([0.01, 0.03, -0.01, 0.02, 0.0, 0.03, 0.01, 0.02])  # t 2.8: not decided, likely to be
    row = sequential.assess(design, [_comparison(a, maybe)])
    assert row["comparisons"][0]["decision"] == "open" and not row["stop"] and row["why"] == ""
    t = np.mean(maybe - a) / (np.std(maybe - a, ddof=1) / np.sqrt(8))
    assert sequential.conditional_power(t, 8, 16, levels[-1]) > sequential.FUTILITY > \
        sequential.conditional_power(t / 3, 8, 16, levels[-1])
    within = sequential.assess(Until("decided", 0.01, 8, 16), [_comparison(a, small)])["comparisons"][0]
    assert within["decision"] == "within ±0.01"
    last = sequential.assess(Until("decided", None, 4, 8), [_comparison(a, tied)])
    assert last["stop"] and "most replicas" in last["why"] and last["comparisons"][0]["decision"] == "not decided"
    narrow = sequential.assess(Until("width", 0.5, 8, 16), [_comparison(a, tied)])
    assert narrow["comparisons"][0]["decision"] == "narrow enough"


def test_an_arm_grown_look_by_look_equals_the_arm_trained_whole(tmp_path):
    """Replica r's keys are its index's, so replicas 3-4 trained as a second block after 0-2 give, bitwise,
    what five replicas trained at once give; the blocks stay as parts, and a rerun trains nothing."""
    from nondet_jax.study import runner

    quiet = lambda *a, **k: None  # noqa: E731
    runner.run(cfg.from_flat({**MLP, "study.replicas": 3}), tmp_path / "grown", progress=False, grow=True, log=quiet)
    lines = []
    runner.run(cfg.from_flat({**MLP, "study.replicas": 5}), tmp_path / "grown", progress=False, grow=True,
               log=lines.append)
    runner.run(cfg.from_flat({**MLP, "study.replicas": 5}), tmp_path / "whole", progress=False, log=quiet)
    for arm in ("control", "all"):
        grown, whole = (json.loads((tmp_path / f / "arms" / f"{arm}.json").read_text()) for f in ("grown", "whole"))
        assert grown["replicas"] == 5 and grown["rows"] == whole["rows"]
        assert np.array_equal(np.load(tmp_path / "grown" / "logits" / f"{arm}.npy"),
                              np.load(tmp_path / "whole" / "logits" / f"{arm}.npy"))
        assert sorted(p.name for p in (tmp_path / "grown" / "parts" / arm).iterdir()) == ["0.npz", "3.npz"]
    assert not any("already finished" in str(line) for line in lines)  # both arms grew
    # A killed look: the record gone, both blocks kept. The rerun merges them and trains nothing.
    (tmp_path / "grown" / "arms" / "all.json").unlink()
    rows = json.loads((tmp_path / "whole" / "arms" / "all.json").read_text())["rows"]
    lines.clear()
    runner.run(cfg.from_flat({**MLP, "study.replicas": 5}), tmp_path / "grown", progress=False, grow=True,
               log=lines.append)
    assert json.loads((tmp_path / "grown" / "arms" / "all.json").read_text())["rows"] == rows
    assert not any("resuming" in str(line) for line in lines)
    # A part from another arm (other keys) where this arm's second block belongs is refused, naming it.
    (tmp_path / "grown" / "arms" / "all.json").unlink()
    shutil.copy(tmp_path / "grown" / "parts" / "control" / "3.npz", tmp_path / "grown" / "parts" / "all" / "3.npz")
    with pytest.raises(UsageError, match=r"part .*parts/all/3.npz holds replicas 3..4 of another study or arm.*"
                                         r"--recompute all"):
        runner.run(cfg.from_flat({**MLP, "study.replicas": 5}), tmp_path / "grown", progress=False, grow=True, log=quiet)


def test_a_part_trained_under_other_xla_flags_is_not_merged(tmp_path, monkeypatch):
    """A look grown under other XLA flags (changed XLA_FLAGS, or a new CPU rule) would mix two kernels' arithmetic
    in one arm: the part that differs is refused in one line naming both flag sets and --recompute; the part
    itself is kept, and under its own flags the arm merges."""
    from nondet_jax.study import parts, runner

    quiet = lambda *a, **k: None  # noqa: E731
    monkeypatch.setenv("XLA_FLAGS", "")
    runner.run(cfg.from_flat({**MLP, "study.replicas": 3}), tmp_path, progress=False, grow=True, log=quiet)
    part = tmp_path / "parts" / "all" / "0.npz"
    before = part.read_bytes()
    (tmp_path / "arms" / "all.json").unlink()  # a killed look: the rerun merges the kept part
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_use_fusion_emitters=false")  # read only here: JAX already started
    with pytest.raises(UsageError, match=r"part .*parts/all/0.npz \(replicas 0..2 of arm 'all'\) was trained under "
                                         r"XLA flags '', this run under '--xla_cpu_use_fusion_emitters=false'.*"
                                         r"--recompute all.*or run under the part's flags"):
        runner.run(cfg.from_flat({**MLP, "study.replicas": 3}), tmp_path, progress=False, grow=True, log=quiet)
    assert part.read_bytes() == before
    # a look that would grow the arm is refused before it trains the new block
    with pytest.raises(UsageError, match=r"part .*parts/control/0.npz \(replicas 0..2 of arm 'control'\)"):
        runner.run(cfg.from_flat({**MLP, "study.replicas": 5}), tmp_path, progress=False, grow=True, log=quiet)
    assert sorted(p.name for p in (tmp_path / "parts").rglob("*.npz")) == ["0.npz", "0.npz"]
    monkeypatch.setenv("XLA_FLAGS", "")  # under the parts' flags the look goes on
    runner.run(cfg.from_flat({**MLP, "study.replicas": 5}), tmp_path, progress=False, grow=True, log=quiet)
    assert json.loads((tmp_path / "arms" / "all.json").read_text())["replicas"] == 5
    assert part.read_bytes() == before
    # a part from before parts carried their flags: "unrecorded flags"
    with np.load(part) as f:
        arrays = {k: f[k] for k in f.files if k != f"meta{parts.SEP}xla_flags"}
    np.savez(part, **arrays)
    (tmp_path / "arms" / "all.json").unlink()
    with pytest.raises(UsageError, match=r"was trained under unrecorded flags, this run under ''.*again$"):
        runner.run(cfg.from_flat({**MLP, "study.replicas": 5}), tmp_path, progress=False, grow=True, log=quiet)


def test_a_sequential_study_of_methods_stops_once_answered_and_resumes(tmp_path, capsys):
    """The command line end to end: a learning rate twice the baseline's is decided better at the second look
    (8 replicas per method), recorded look by look in methods.json and the report; the same command again
    trains nothing; another design on the folder is refused."""
    out = tmp_path / "study"
    study = [*FAST, "--replicas", "4", "--arms", "control,all", "--method", "base:", "--method", "lr2:optim.lr=0.2",
             "--out", out]
    proc = sweep_cli(*study, "--until", "decided", "--max-replicas", "12")
    assert proc.returncode == 0, proc.stderr
    state = json.loads((out / "methods.json").read_text())["until"]
    assert state["design"] == {"rule": "decided", "value": None, "first": 4, "max_replicas": 12, "round": 4,
                               "spec": "decided", "boundary": {"shape": sequential.BOUNDARY_SHAPE,
                                                               "futility": sequential.FUTILITY, "futility_counted": True}}
    looks = state["looks"]
    assert [k["replicas"] for k in looks] == [4, 8] and [k["stop"] for k in looks] == [False, True]
    assert looks[-1]["comparisons"][0]["decision"] == "lr2 is better" and looks[0]["comparisons"][0]["decision"] == "open"
    assert "look at 8 replicas: lr2 − base on all" in proc.stdout
    assert "(a sequential study: its answers are the looks' intervals above" in proc.stdout
    for name in ("base", "lr2"):
        assert json.loads((out / "methods" / name / "arms" / "all.json").read_text())["replicas"] == 8
        assert not (out / "methods" / name / "parts").exists()  # stopped: the blocks the arms grew from are gone
    report = (out / "report.md").read_text()
    assert "## Sequential design" in report and "| 8 | lr2 | base | all |" in report
    assert "Stopped at 8 of at most 12 replicas per method: every comparison is answered." in report
    again = sweep_cli(*study, "--until", "decided", "--max-replicas", "12")
    assert again.returncode == 0 and again.stdout.count("already finished") == 4
    assert json.loads((out / "methods.json").read_text())["until"]["looks"] == looks
    from nondet_jax.cli import compare
    assert compare.main([str(out)]) == 0  # its answers are the looks', not a fixed-sample test's verdicts
    said = capsys.readouterr().out
    assert "a sequential study (--until decided, looks at 4, 8 replicas per method)" in said
    assert "look at 8 replicas: lr2 − base on all" in said and "lr2 is better" in said and "Holm" not in said
    assert compare.main([str(out), "--method-b", "lr2"]) == 2
    finished = (out / "methods.json").read_text()
    # interrupted while training the second look: its folders grew to 8, the record holds the first look only
    record = json.loads(finished)
    record["until"]["looks"] = looks[:1]
    (out / "methods.json").write_text(json.dumps(record, indent=2) + "\n")
    from nondet_jax.report.methods import write_methods_report
    write_methods_report(out, log=lambda *a, **k: None)  # its report says it has not stopped (it said it had)
    assert "This sequential study has not stopped yet (rerun its command to go on): its answers so far" in \
        (out / "report.md").read_text() and "stopped sequentially" not in (out / "report.md").read_text()
    resumed = sweep_cli(*study, "--until", "decided", "--max-replicas", "12")
    assert resumed.returncode == 0, resumed.stderr  # was refused: "a different config (study.replicas 8 vs 4)"
    assert json.loads((out / "methods.json").read_text())["until"]["looks"] == looks
    added = sweep_cli(*study, "--method", "wd:optim.weight_decay=0.01", "--until", "decided", "--max-replicas", "12")
    assert added.returncode == 2 and "is a sequential study of the methods base, lr2, whose looks" in added.stderr
    assert (out / "methods.json").read_text() == finished
    before = (out / "methods.json").read_bytes()
    arm = out / "methods" / "lr2" / "arms" / "all.json"
    whole = arm.read_bytes()
    arm.write_bytes(whole[:100])  # a damaged arm: refused, and methods.json keeps every method's identity
    broken = sweep_cli(*study, "--until", "decided", "--max-replicas", "12")
    assert broken.returncode == 2 and "unreadable or corrupt" in broken.stderr
    assert f"rerun with --resume {out / 'methods' / 'lr2'} --recompute all, then this command again" in broken.stderr
    from nondet_jax.cli import report as report_cli
    capsys.readouterr()
    assert report_cli.main([str(out)]) == 2  # the same fix from the report
    assert f"--resume {out / 'methods' / 'lr2'} --recompute all, then this command again" in capsys.readouterr().err
    assert compare.main([str(out)]) == 2  # and from compare, which printed the recorded answers over a broken arm
    assert f"--resume {out / 'methods' / 'lr2'} --recompute all, then this command again" in capsys.readouterr().err
    assert (out / "methods.json").read_bytes() == before
    arm.write_bytes(whole)
    other = sweep_cli(*study, "--until", "width=0.01", "--max-replicas", "12")
    assert other.returncode == 2 and "rerun it with those" in other.stderr
    fixed = sweep_cli(*study)
    assert fixed.returncode == 2 and "is a sequential study of methods (--until decided --max-replicas 12)" in fixed.stderr
    record = json.loads((out / "methods.json").read_text())
    older = json.loads(json.dumps(record))
    del older["until"]["design"]["boundary"]  # looks taken by the version before, at Pocock's constant level
    (out / "methods.json").write_text(json.dumps(older))
    moved = sweep_cli(*study, "--until", "decided", "--max-replicas", "12")
    assert moved.returncode == 2 and "whose looks were read at Pocock's constant level" in moved.stderr
    assert json.loads((out / "methods.json").read_text()) == older  # refused before anything is written
    from nondet_jax.report.methods import write_methods_report
    write_methods_report(out, log=lambda *a, **k: None)  # its report describes the design its looks were read at
    assert "Pocock's constant level (this folder predates recorded boundaries)" in (out / "report.md").read_text()
    bent = json.loads(json.dumps(record))
    bent["until"]["design"]["boundary"]["futility"] = "high"
    (out / "methods.json").write_text(json.dumps(bent))
    bad = sweep_cli(*study, "--until", "decided", "--max-replicas", "12")
    assert bad.returncode == 2 and "holds a damaged record of a sequential study's looks" in bad.stderr
    del record["until"]["looks"][0]["comparisons"][0]["interval"]  # a damaged record: one line, not a traceback
    (out / "methods.json").write_text(json.dumps(record))
    damaged = sweep_cli(*study, "--until", "decided", "--max-replicas", "12")
    assert damaged.returncode == 2 and "holds a damaged record of a sequential study's looks" in damaged.stderr
    assert "Traceback" not in damaged.stderr


@pytest.mark.slow
def test_an_answered_methods_folder_removed_is_trained_again_to_its_answer(tmp_path):
    """A method answered at an earlier look trains no more; if its folder goes, the next run trains it again to
    the replicas it was answered at (the same keys: the same scores), so the family and every level stay the
    design's (it dropped out of the family, loosening the level, and a later run grew it past its answer)."""
    out = tmp_path / "study"
    study = ["--model", "mlp", "--epochs", "1", "--replicas", "3", "--arms", "control,all", "--no-progress",
             "--method", "base:", "--method", "close:optim.lr=0.0501", "--method", "nomom:optim.momentum=0",
             "--until", "decided", "--max-replicas", "11", "--out", out]
    assert sweep_cli(*study).returncode == 0
    finished = json.loads((out / "methods.json").read_text())["until"]["looks"]
    last = {c["method_b"]: c for c in finished[-1]["comparisons"]}
    assert last["close"]["replicas"] < finished[-1]["replicas"], "close must be answered before the last look"
    scores = (out / "methods" / "close" / "replicas.csv").read_bytes()
    shutil.rmtree(out / "methods" / "close")
    again = sweep_cli(*study)
    assert again.returncode == 0, again.stderr
    assert f"method close (optim.lr=0.0501), {last['close']['replicas']} replicas" in again.stdout
    assert json.loads((out / "methods.json").read_text())["until"]["looks"] == finished
    assert (out / "methods" / "close" / "replicas.csv").read_bytes() == scores


def test_decided_beyond_an_accuracys_range_is_said(tmp_path):
    """decided=2 on accuracy (a fraction) answers every comparison 'within ±2' at the first look: the study says
    D is in the score's units (it stopped silently, having asked nothing)."""
    proc = sweep_cli(*FAST, "--replicas", "3", "--arms", "control,all", "--method", "base:", "--method", "lr2:optim.lr=0.2",
                     "--until", "decided=2", "--max-replicas", "6", "--out", tmp_path / "study")
    assert proc.returncode == 0, proc.stderr
    assert "note: --until decided=2 on accuracy, a fraction: every difference lies within ±1, so a comparison not " \
        "decided is 'within ±2' as soon as its interval fits inside ±1" in proc.stdout
    assert "within ±2" in proc.stdout


def test_run_study_takes_a_sequential_design(tmp_path):
    import nondet_jax as nj

    result = nj.run_study(model="mlp", data="digits", epochs=1, batch_size=256, arms="control,all", replicas=3,
                          strategy="sequential", out=tmp_path / "api", log=lambda *a, **k: None,
                          methods={"base": {}, "lr2": {"optim.lr": 0.2}}, until="width=0.5", max_replicas=7)
    state = json.loads((tmp_path / "api" / "methods.json").read_text())["until"]
    assert state["design"]["spec"] == "width=0.5" and [k["replicas"] for k in state["looks"]] == [3, 7]
    assert state["looks"][-1]["stop"] and state["looks"][0]["comparisons"][0]["decision"] == "open"
    assert len({(r["arm"], r["replica"]) for r in result.methods["lr2"].rows}) == 2 * 7
    with pytest.raises(UsageError, match="until= and max_replicas= run a sequential study of methods"):
        nj.run_study(model="mlp", until="decided")
    with pytest.raises(UsageError, match=r"max_replicas= 3 must be an integer above"):
        nj.run_study(model="mlp", methods={"a": {}, "b": {"optim.lr": 0.2}}, replicas=3, until="decided", max_replicas=3)
    with pytest.raises(UsageError, match=r"^max_replicas=8 is for a sequential study; add until='decided'"):
        nj.run_study(model="mlp", methods={"a": {}, "b": {"optim.lr": 0.2}}, replicas=3, max_replicas=8)


def test_an_answer_stands_and_its_method_trains_no_more():
    """A comparison answered at an earlier look keeps its answer (and its replicas) at later looks; the levels
    stay those for every comparison."""
    rng = np.random.default_rng(1)
    a = rng.normal(0.9, 0.01, 8)
    maybe = a + np.array([0.01, 0.03, -0.01, 0.02, 0.0, 0.03, 0.01, 0.02])
    design = Until("decided", None, 4, 16)
    first = sequential.assess(design, [_comparison(a[:4], a[:4] - 0.2, "bad"), _comparison(a[:4], maybe[:4])])
    assert [c["decision"] for c in first["comparisons"]] == ["base is better", "open"]
    earlier = sequential.answered([first])
    assert list(earlier) == [("bad", "base", "all")] and earlier["bad", "base", "all"]["replicas"] == 4
    later = sequential.assess(design, [_comparison(a[:4], a[:4] - 0.2, "bad"), _comparison(a, maybe)], earlier)
    levels = sequential.design_levels(design, 2)  # Bonferroni over both comparisons, the answered one too
    assert later["replicas"] == 8 and (first["level"], later["level"]) == levels[:2]
    assert later["comparisons"][0] == earlier["bad", "base", "all"]


def test_a_look_is_the_replicas_trained_when_a_diverged_replicas_pair_is_left_out():
    """A look counts the replicas it trained, not the pairs left (a diverged replica's pair is left out): the
    look at 8 of at most 8 stops with 7 pairs (it looked again and again at 7 pairs, and its record of a look
    at 7 replicas was refused as one the design never takes)."""
    rng = np.random.default_rng(2)
    a = rng.normal(0.9, 0.01, 7)
    design = Until("decided", None, 4, 8)
    look = sequential.assess(design, [_comparison(a, a + rng.normal(0, 0.01, 7))], replicas=8)
    (row,) = look["comparisons"]
    assert look["replicas"] == row["replicas"] == 8 and row["pairs"] == 7 and look["stop"]
    assert look["level"] == sequential.design_levels(design)[1]
    assert "(97.5" not in sequential.look_lines(look)[0] and "7 pairs: a diverged replica's pair left out" in \
        sequential.look_lines(look)[0]


def test_what_a_stop_saved_is_said_for_decided_comparisons_at_d_in_the_scores_units():
    """decided=D is in the scores' units; the simulation behind "saved" draws differences of std 1, so D enters
    it as D / sd (it entered as D standard deviations); a comparison that decided nothing gets no saving."""
    rng = np.random.default_rng(3)
    a = rng.normal(0.9, 0.01, 8)
    better, same = _comparison(a, a + 0.01 + rng.normal(0, 0.003, 8)), _comparison(a, a + rng.normal(0, 1e-4, 8), "same")
    design = Until("decided", 0.01, 8, 16)
    look = sequential.assess(design, [better, same])
    assert [c["decision"] for c in look["comparisons"]] == ["lr2 is better", "within ±0.01"]
    rows = sequential.saving(design, look, [better, same], trials=500)
    sd = better["std_difference"]
    sim = sequential.simulate(Until("decided", 0.01 / sd, 8, 16), rows[0]["effect"], 500, comparisons=2)
    assert rows[0]["power"] == sim["decided"] and rows[0]["expected_replicas"] == sim["mean_replicas"]
    assert "power" not in rows[1] and rows[1]["decision"] == "within ±0.01"


def test_a_study_stopped_before_its_first_look_resumes_and_keeps_its_baseline(tmp_path):
    """methods.json holds the design from the start (interrupted before its first look, the study was refused as
    "a fixed number of replicas" on every rerun); once a look is recorded, another baseline is refused."""
    from nondet_jax.analysis.methods import read_record
    from nondet_jax.study import methods as M

    base = cfg.from_flat({**MLP, "study.replicas": 4})
    planned, baseline = M.plan(base, {"base": {}, "lr2": {"optim.lr": 0.2}}, "base", api=True)
    design, names = Until("decided", None, 4, 12), [m.name for m in planned]
    M.write_methods(tmp_path, base, planned, baseline)  # what an earlier version wrote before the first look
    assert M.check_design(tmp_path, design, names, "base") == 4  # nothing finished: a sequential study starts
    (tmp_path / "methods.json").unlink()
    M.write_methods(tmp_path, base, planned, baseline, design)  # what run_methods writes before training
    assert read_record(tmp_path)["until"]["looks"] == []
    from nondet_jax.report.methods import write_methods_report

    write_methods_report(tmp_path, log=lambda *a, **k: None)  # no fixed-sample verdicts for a study with no look
    assert "(No comparison: this sequential study has taken no look yet" in (tmp_path / "report.md").read_text()
    assert M.check_design(tmp_path, design, names, "lr2") == 4  # no look yet: nothing to keep
    record = read_record(tmp_path)
    a = np.random.default_rng(4).normal(0.9, 0.01, 4)
    look = sequential.assess(design, [_comparison(a, a + np.array([0.01, -0.005, 0.002, 0.004]))], replicas=4)
    assert look["comparisons"][0]["decision"] == "open" and not look["stop"]
    record["until"]["looks"] = [look]
    (tmp_path / "methods.json").write_text(json.dumps(record))
    assert M.check_design(tmp_path, design, names, "base") == 8
    from nondet_jax.report.methods import _md_sequential  # the report of a study interrupted after this look

    said = "\n".join(_md_sequential(record["until"], []))  # said "Stopped at 4 ...: not yet"
    assert "Not stopped yet: the last look taken was at 4 of at most 12 replicas per method (rerun the same " \
        "command to go on)." in said and "Stopped at" not in said
    with pytest.raises(UsageError, match="whose looks compared every method with the baseline base; rerun it with "
                                         "--baseline base"):
        M.check_design(tmp_path, design, names, "lr2")
    (tmp_path / "methods" / "base").mkdir(parents=True)  # methods.json lost, the method folders kept
    (tmp_path / "methods.json").unlink()
    with pytest.raises(UsageError, match=r"holds the folders of methods \(.*methods\) but no methods.json"):
        M.check_design(tmp_path, design, names, "base")
    assert not (tmp_path / "methods.json").exists()
    M.write_methods(tmp_path, base, planned, baseline)  # a fixed study of methods, one arm finished
    (tmp_path / "methods" / "base" / "arms").mkdir()
    (tmp_path / "methods" / "base" / "arms" / "all.json").write_text("{}")
    with pytest.raises(UsageError, match="holds a study of methods with a fixed number of replicas"):
        M.check_design(tmp_path, design, names, "base")


def test_a_damaged_or_impossible_record_of_the_looks_is_refused():
    """methods.json's ``until`` is read as untrusted input: a design no command can make (a round of 0, a million
    replicas, an unknown key, a spec that is not its rule's), looks that are not a list, a level that is not a
    probability or a boundary that is not one are each refused in one line, not read into a traceback or a 30 GiB
    simulation. No look yet is a record: the design is written before the first look trains."""
    from nondet_jax.until import check_state

    good = {"design": {**sequential.design_record(Until("decided", None, 4, 8))},
            "looks": [{"replicas": 4, "level": 0.02, "rule": "decided", "why": "", "stop": False,
                       "comparisons": [{"method_a": "base", "method_b": "lr2", "arm": "all", "decision": "open",
                                        "replicas": 4, "difference": 0.1, "interval": [-0.1, 0.3]}]}]}
    assert check_state(json.loads(json.dumps(good)), "methods.json") is not None
    assert check_state({**json.loads(json.dumps(good)), "looks": []}, "methods.json")["looks"] == []
    won = json.loads(json.dumps(good))
    won["looks"][0]["comparisons"][0].update(interval=[0.1, 0.3], decision="lr2 is better", higher_is_better=True)
    assert check_state(won, "methods.json") is not None
    edits = [("design", "round", 0), ("design", "max_replicas", 10 ** 6), ("design", "note", "by hand"),
             ("design", "spec", "width=1"), ("design", "first", 1), ("design", "rule", "soon"),
             ("boundary", "shape", float("nan")), ("boundary", "futility", 1.5), ("look", "level", float("nan")),
             ("look", "level", 0.0), ("look", "replicas", 99), ("looks", None, {}),
             ("comparison", "decision", "lr2 is better"), ("comparison", "decision", "within ±0.5"),
             ("comparison", "interval", [0.1, 0.3]), ("winner", None, "base is better")]  # a decision its interval does not give, either way
    for where, key, value in edits:
        bad = json.loads(json.dumps(good))
        if where == "looks":
            bad["looks"] = value
        elif where == "winner":  # an interval above 0, higher better: lr2 won, the record names base
            bad["looks"][0]["comparisons"][0].update(interval=[0.1, 0.3], decision=value, higher_is_better=True)
        else:
            target = {"design": bad["design"], "boundary": bad["design"]["boundary"], "look": bad["looks"][0],
                      "comparison": bad["looks"][0]["comparisons"][0]}[where]
            target[key] = value
        with pytest.raises(UsageError, match="holds a damaged record of a sequential study's looks"):
            check_state(bad, "methods.json")


def test_a_look_says_what_futile_means_and_which_method_a_narrow_interval_favours():
    rng = np.random.default_rng(5)
    a = rng.normal(0.9, 0.01, 8)
    narrow = sequential.assess(Until("width", 0.5, 8, 16), [_comparison(a, a + 0.02 + rng.normal(0, 0.001, 8))])
    assert narrow["comparisons"][0]["better"] == "lr2"
    assert sequential.look_lines(narrow)[0].endswith("narrow enough (lr2 is better: the interval excludes 0)")
    tied = sequential.assess(Until("decided", None, 8, 16), [_comparison(a, a + np.array([1.0, -1.0] * 4) * 1e-4)])
    assert tied["comparisons"][0]["decision"] == "futile"
    assert "futile (given up: too unlikely to be decided by the last look" in sequential.look_lines(tied)[0]


@pytest.mark.parametrize("spec", ["width=0.0123456789", "decided=1234567", "decided=0.1234567"])
def test_a_design_given_to_every_digit_is_the_one_its_record_reads_back(spec):
    """A spec is written with every digit its number needs: ``:g`` kept six, so --until width=0.0123456789 wrote a
    design whose spec read back as another and the study was refused as "a damaged record" before its first look."""
    from nondet_jax.until import check_state

    design = parse(spec, 12, 4)
    assert parse(design.spec, 12, 4) == design and design.spec == spec
    a = np.random.default_rng(6).normal(0.9, 0.01, 4)
    look = sequential.assess(design._replace(rule="decided"), [_comparison(a, a + 1e-4 * np.arange(4))], replicas=4)
    state = {"design": sequential.design_record(design._replace(rule="decided")), "looks": [look]}
    assert look["comparisons"][0]["decision"] == f"within ±{spec.partition('=')[2]}"
    assert check_state(json.loads(json.dumps(state)), "methods.json") == json.loads(json.dumps(state))
    assert parse("decided=0.02", 12, 4).spec == "decided=0.02" and parse("width=1", 12, 4).spec == "width=1"


def test_a_rerun_under_other_settings_is_refused_before_methods_json_says_them(tmp_path):
    """A study of methods rerun with another setting (--epochs 2 on a sequential study of 1 epoch) is refused by
    its first method's folder; methods.json had already been rewritten with the refused config, so the report and
    compare then refused the folder ("methods.json says method 'base' trained under settings its folder did not")."""
    from nondet_jax.study import methods as M

    base = cfg.from_flat({**MLP, "study.replicas": 4})
    planned, baseline = M.plan(base, {"base": {}, "lr2": {"optim.lr": 0.2}}, "base", api=True)
    design = Until("decided", None, 4, 12)
    M.write_methods(tmp_path, base, planned, baseline, design)
    for m in planned:  # each method's folder as its study writes it: its own settings, the look's replicas
        (tmp_path / "methods" / m.name).mkdir(parents=True)
        own = cfg.to_dict(cfg.from_flat({**m.settings, "study.replicas": 8}, base))
        (tmp_path / "methods" / m.name / "config.json").write_text(json.dumps(own))
    M.write_methods(tmp_path, base, planned, baseline, design)  # the same settings: written
    before = (tmp_path / "methods.json").read_bytes()
    with pytest.raises(UsageError, match=r"methods/base was started with a different config \(train.epochs 1 vs 2\)"):
        M.write_methods(tmp_path, cfg.from_flat({"train.epochs": 2}, base), planned, baseline, design)
    assert (tmp_path / "methods.json").read_bytes() == before
    only_new = M.plan(base, {"base2": {}, "wd": {"optim.weight_decay": 0.01}}, "base2", api=True)
    with pytest.raises(UsageError, match=r"methods/base was started"):  # methods of earlier runs are kept: checked too
        M.write_methods(tmp_path, cfg.from_flat({"train.epochs": 2}, base), *only_new)
    assert (tmp_path / "methods.json").read_bytes() == before


def test_compare_of_a_sequential_studys_method_folders_says_whose_answers_they_are(tmp_path):
    """compare A B on two methods' run folders of a sequential study printed a fixed-sample p on replicas the looks
    chose, with no word of the study: it says so once, naming the command that prints the study's answers."""
    from nondet_jax.cli.compare import _sequential_notes
    from nondet_jax.study import methods as M

    base = cfg.from_flat({**MLP, "study.replicas": 4})
    planned, baseline = M.plan(base, {"base": {}, "lr2": {"optim.lr": 0.2}}, "base", api=True)
    M.write_methods(tmp_path / "seq", base, planned, baseline, Until("decided", None, 4, 12))
    M.write_methods(tmp_path / "fixed", base, planned, baseline)
    (note,) = _sequential_notes([tmp_path / "seq" / "methods" / "base", tmp_path / "seq" / "methods" / "lr2"])
    assert note.startswith(f"note: base and lr2 are methods of the sequential study {tmp_path / 'seq'} (--until "
                           "decided)") and note.endswith(f"python -m nondet_jax compare {tmp_path / 'seq'}")
    assert _sequential_notes([tmp_path / "fixed" / "methods" / "base", tmp_path / "seq" / "methods" / "other",
                              tmp_path / "seq"]) == []
