"""The variance decomposition over the one-source arms and all: shares, their sum, the non-additivity."""

import json

import numpy as np
import pytest

import nondet_jax as nj
from nondet_jax.analysis import stats
from nondet_jax.analysis.decomposition import decompose
from nondet_jax.arms import one_source_arms


def record(values, task_row="test_accuracy"):
    rows = [{"replica": i, task_row: float(v), "test_loss": float(v) * 2, "diverged_at_step": -1}
            for i, v in enumerate(values)]
    return {"rows": rows, "metrics": {"accuracy": {"resolution": None}}}


def test_shares_are_variance_ratios_with_the_std_ratio_interval_squared():
    rng = np.random.default_rng(0)
    arms = {"init": rng.normal(0, 1.0, 8), "data_order": rng.normal(0, 0.5, 8), "all": rng.normal(0, 1.2, 8),
            "init@snapshot2": rng.normal(0, 1, 8), "init+data_order": rng.normal(0, 1, 8)}
    records = {a: record(v) for a, v in arms.items()}
    assert one_source_arms(records) == ["init", "data_order"]  # no snapshot variant, no two-source arm
    d = decompose(records)["accuracy"]
    for a in ("init", "data_order"):
        assert d["shares"][a]["share"] == pytest.approx(np.var(arms[a], ddof=1) / np.var(arms["all"], ddof=1))
        lo, hi = stats.std_ratio_ci(arms[a], arms["all"])
        assert d["shares"][a]["ci"] == pytest.approx([lo ** 2, hi ** 2])
        lo, hi = stats.paired_ratio_ci(arms[a], arms["all"])  # replica r of both arms shares its seeds
        assert d["shares"][a]["paired_ci"] == pytest.approx([lo ** 2, hi ** 2])
    assert d["sum"] == pytest.approx(sum(s["share"] for s in d["shares"].values()))
    assert d["non_additivity"] == pytest.approx(1 - d["sum"])
    lo, hi = d["sum_ci"]
    assert lo < d["sum"] < hi and d["non_additivity_ci"] == pytest.approx([1 - hi, 1 - lo])
    assert decompose({"init": records["init"]}) == {}  # no all arm: nothing to decompose


def test_sources_all_varies_without_an_arm_are_named_and_a_lone_replica_prints_na():
    """`all` varies every seeded source; with arms init,data_order,all the spread of bitflip and batch_order is in
    Var(all) and in no share, so it counted as 'non-additivity' and the report read a positive one as sources
    acting together. They are named (less the sources the folder says the study does not use), and a share of
    one healthy replica prints n/a, not nan."""
    from nondet_jax.report.markdown import _decomposition_md

    rng = np.random.default_rng(1)
    records = {a: record(rng.normal(0, 1, 6)) for a in ("init", "data_order", "all")}
    assert decompose(records)["accuracy"]["unmeasured"] == ["augmentation", "batch_order", "bitflip", "dropout"]
    d = decompose(records, inactive={"dropout", "augmentation"})
    assert d["accuracy"]["unmeasured"] == ["batch_order", "bitflip"]
    for row in records["init"]["rows"][1:]:
        row["diverged_at_step"] = 3  # one replica left: no variance
    md = "\n".join(_decomposition_md({"task": "classification", "decomposition": decompose(records, inactive={
        "dropout", "augmentation"})}))
    assert "`all` also varies batch_order, bitflip, which no one-source arm here measures" in md
    assert "| init | 1 | n/a | n/a | n/a |" in md and "nan" not in md
    full = {**records, **{a: record(rng.normal(0, 1, 6)) for a in ("augmentation", "dropout", "bitflip", "batch_order")}}
    assert decompose(full)["accuracy"]["unmeasured"] == []
    assert "also varies" not in "\n".join(_decomposition_md({"task": "classification", "decomposition": decompose(full)}))


def test_a_decomposition_without_its_arms_is_refused(finished_run):
    """--set metrics.decomposition=true without an all arm (or a one-source arm) trained the study and left the
    decomposition out of the report without a word; nj.decompose on such a folder returned {} and
    nj.decompose(folder)["accuracy"] ended in a KeyError."""
    from nondet_jax.config import from_flat, validate

    for arms, missing in ((["init", "data_order"], "the all arm"), (["control", "all"], "an arm that varies one")):
        with pytest.raises(nj.UsageError, match=f"metrics.decomposition needs {missing}.*--arms init,data_order,all"):
            validate(from_flat({"metrics.decomposition": True, "study.arms": arms}))
    validate(from_flat({"metrics.decomposition": True, "study.arms": ["init", "all"]}))
    with pytest.raises(nj.UsageError, match=r"lacks the all arm among its finished arms \(control, init\)"):
        nj.decompose(finished_run)


@pytest.mark.slow
def test_decomposition_in_the_report(tmp_path):
    r = nj.run_study(model="mlp", data="digits", epochs=1, batch_size=128, arms="init,data_order,all", replicas=5,
                     out=tmp_path / "run", settings={"metrics.decomposition": True, "metrics.lmc_pairs": 0},
                     log=lambda *a, **k: None)
    d = nj.decompose(r)
    assert set(d) == {"accuracy", "cross_entropy"} and set(d["accuracy"]["shares"]) == {"init", "data_order"}
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["decomposition"]["accuracy"]["sum"] == pytest.approx(d["accuracy"]["sum"])
    report = (tmp_path / "run" / "report.md").read_text()
    assert "## Variance decomposition" in report and "| non-additivity 1 − sum |" in report
    assert (tmp_path / "run" / "figures" / "decomposition.png").stat().st_size > 10_000
    with pytest.raises(nj.UsageError, match="not a nondet_jax run folder"):
        nj.decompose(tmp_path)
