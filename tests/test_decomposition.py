"""The variance decomposition over the one-source arms and all: shares, their sum, the non-additivity."""

import json

import numpy as np
import pytest

import nondet_jax as nj
from nondet_jax.analysis import stats
from nondet_jax.analysis.decomposition import decompose, one_source_arms


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
