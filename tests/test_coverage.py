"""Every interval nondet_jax prints covers the truth at least 93% of the time at R=8 (nominal 95%) on the
data studies produce (normal, skewed, heavy-tailed, bad seeds, counts, ties), by seeded simulation
(nondet_jax.analysis.coverage); the recorded weak spots stay recorded; the old percentile bootstrap of a
std did not cover."""

import numpy as np
import pytest

from nondet_jax.analysis import coverage, stats

# cells documented in docs/statistics.md as below 93% at R=8: checked to stay where they are, not hidden
KNOWN_WEAK = {"mean: strong skew (stress)": 0.82, "std: strong skew (stress)": 0.80,
              "pairwise |X_a−X_b| (stress)": 0.88}


@pytest.mark.parametrize("case", [c for c in coverage.CASES if c not in KNOWN_WEAK])
def test_interval_covers_at_least_93_percent_at_r8(case):
    rate = coverage.simulate(case, replicas=8, trials=4000, seed=0)
    assert 0.93 <= rate <= 1.0, f"{case}: {rate:.3f}"


@pytest.mark.parametrize("case", [c for c in coverage.CASES if c.startswith("ratio: ") and c not in KNOWN_WEAK])
def test_ratio_interval_holds_from_the_first_r_it_is_shown(case):
    assert stats.MIN_REPLICAS["ratio"] == 5
    assert coverage.simulate(case, replicas=5, trials=4000, seed=0) >= 0.93, case
    assert np.isnan(stats.std_ratio_ci(np.arange(4.0), np.arange(4.0) * 2)[0])  # n/a below it


@pytest.mark.parametrize("case", sorted(KNOWN_WEAK))
def test_known_weak_spots_are_where_the_docs_say(case):
    rate = coverage.simulate(case, replicas=8, trials=4000, seed=0)
    assert KNOWN_WEAK[case] <= rate < 0.95, f"{case}: {rate:.3f}"


def test_every_printed_interval_kind_is_simulated():
    assert {kind for kind, _, _ in coverage.CASES.values()} == set(stats.METHODS)


def test_every_scenario_of_the_issue_is_simulated_for_mean_std_and_ratio():
    for kind in ("mean", "std", "ratio"):
        assert {c.split(": ", 1)[1] for c in coverage.CASES if c.startswith(kind + ": ")} >= {
            "normal", "skewed", "heavy tails", "bad seeds", "counts, 10,000 images", "counts, 360 images",
            "near ties, 360 images", "fraction of an image"}


def test_no_tied_arm_of_counts_gets_a_zero_width_interval():
    tied = np.full(8, 342 / 360)
    lo, hi = stats.std_ci(tied, resolution=1 / 360)
    assert lo == 0 and 0 < hi < 1 / 360  # below one image: ties are likely only for a spread under one image
    lo, hi = stats.mean_ci(tied, resolution=1 / 360)
    assert lo < tied[0] < hi
    ref = np.array([330, 335, 338, 342, 344, 339, 333, 341]) / 360
    out = stats.compare_spread(tied, ref, resolution=1 / 360)
    assert out["ratio"] == 0 and out["ratio_ci"][0] == 0 < out["ratio_ci"][1]
    assert 0 < out["spread_p"] < 0.01 and out["f_test_p"] == 0.0  # F claims certainty, the permutation test does not


@pytest.mark.slow  # ~1,000 exact permutation tests of 12,870 splits: about 90 s
def test_spread_test_false_alarms_near_nominal_and_holm_controls_the_family():
    assert coverage.false_alarm("spread_p", "bad seeds", 8, trials=300) <= 0.08
    assert coverage.false_alarm("f_test_p", "bad seeds", 8, trials=300) > 0.10  # why F is not the default
    assert coverage.false_alarm("spread_p_holm", "normal", 8, trials=150, arms=5) <= 0.08


def test_percentile_bootstrap_of_a_std_undercovers_at_r8():
    """The reason for not resampling: resampling 8 values cannot reach the true spread often enough."""
    rng = np.random.default_rng(0)
    x = rng.normal(0, 1, (2000, 8))
    idx = rng.integers(0, 8, (200, 8))
    boot = x[:, idx].std(-1, ddof=1)  # (trials, resamples)
    lo, hi = np.quantile(boot, [0.025, 0.975], axis=1)
    assert np.mean((lo <= 1) & (1 <= hi)) < 0.85
    assert coverage.simulate("std: normal", 8) > 0.93


def test_the_docs_coverage_table_is_the_stored_simulation():
    """docs/statistics.md's table is ``python benchmarks/coverage.py --markdown`` of the committed JSON."""
    import importlib.util
    import json
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("coverage_benchmark", root / "benchmarks" / "coverage.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    stored = json.loads((root / "benchmarks" / "results" / "coverage.json").read_text())
    assert {r["interval"] for r in stored["rows"]} == set(coverage.CASES)
    assert bench.markdown(stored) in (root / "docs" / "statistics.md").read_text()


def test_power_beside_coverage_quick_run_writes_every_table(tmp_path):
    """``benchmarks/coverage.py --power --quick``: every family simulated, and the numbers the docs rest on hold
    in direction (a paired ratio interval has more power than the independent one on arms sharing seeds;
    the paired t finds a real gain at least as often as the interval it replaced; Bonferroni keeps the family)."""
    import importlib.util
    import json
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("coverage_benchmark", root / "benchmarks" / "coverage.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "power.json"
    assert bench.main(["--power", "--quick", "--power-out", str(out)]) == 0
    stored = json.loads(out.read_text())
    assert {r["scenario"] for r in stored["ratio"]} == set(coverage.power.RATIO_SCENARIOS)
    normal = next(r for r in stored["paired_ratio"] if r["scenario"] == "normal")
    assert normal["pitman_morgan"]["power"] > normal["bonett_printed"]["power"]
    assert normal["paired_bonett_98"]["coverage"] >= 0.93
    cmp = stored["compare"][0]
    assert cmp["paired_t"]["power"] >= cmp["joined"]["power"] and cmp["paired_t"]["coverage"] >= 0.9
    assert all(r["bonferroni"] <= 0.06 for r in stored["family"])
    failing = next(r for r in stored["failed_rule"] if r["scenario"].startswith("1 in 8"))
    assert failing["rate"][str(stats.FAILED_THRESHOLD)] < 0.02  # a failed run is named
    assert "| std ratio 2, independent arms |" in bench.power_markdown(stored)


def test_the_sequential_grid_compares_designs_at_their_error(tmp_path, monkeypatch):
    """``benchmarks/coverage.py --sequential-grid``: each design's error, power and replicas saved, kept in the power
    JSON beside the other tables and printed as a table; the design the tool runs is one of the grid's rows and a
    design whose giving up is counted in its calibration keeps its error near 5%."""
    import importlib.util
    import json
    from pathlib import Path

    from nondet_jax import until
    from nondet_jax.analysis import sequential
    root = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("coverage_benchmark", root / "benchmarks" / "coverage.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert (sequential.BOUNDARY_SHAPE, sequential.FUTILITY, True, 8, until.ROUND) in bench.GRID
    monkeypatch.setattr(bench, "GRID", [(0.5, 0.1, False, 8, 4), (sequential.BOUNDARY_SHAPE, sequential.FUTILITY, True, 6, 2)])
    out = tmp_path / "power.json"
    out.write_text(json.dumps({"ratio": ["kept"]}))
    assert bench.main(["--sequential-grid", "--trials", "1500", "--power-out", str(out)]) == 0
    stored = json.loads(out.read_text())
    assert stored["ratio"] == ["kept"] and len(stored["sequential_grid"]) == 2 * 2 * 4
    nulls = [r for r in stored["sequential_grid"] if r["effect"] == 0]
    assert all(r["decided"] <= 0.05 + 3 * (0.05 * 0.95 / 1500) ** 0.5 for r in nulls)
    real = [r for r in stored["sequential_grid"] if r["effect"] == 1.0]
    assert all(r["decided"] > 0.9 and 8 <= r["mean_replicas"] < 16 for r in real)
    table = bench.grid_markdown(stored["sequential_grid"])
    assert table.count("\n") == 1 + 2 * 2 and "| 8, 12, …, 32 | 0.5 | 10% | no | normal |" in table
    assert f"| 6, 8, …, 32 | {sequential.BOUNDARY_SHAPE:g} |" in table


def test_the_power_simulation_runs_the_printed_spread_test():
    """power.spread_test_cell's batched permutation test is stats.spread_test (every split at R=8), and Hines'
    variant merges an even arm's two equal middle deviations."""
    rng = np.random.default_rng(4)
    a, b = rng.normal(size=(20, 8)) * 1.5, rng.normal(size=(20, 8))
    p = coverage.power._split_pvalues(*(coverage.power._spread_deviations(x, "printed") for x in (a, b)))
    np.testing.assert_allclose(p, [stats.spread_test(x, y) for x, y in zip(a, b)], atol=2 / 12870)
    z = coverage.power._spread_deviations(np.array([[0.0, 1.0, 2.0, 10.0]]), "hines")  # median 1.5
    np.testing.assert_allclose(z, [[np.sqrt(2) * 0.5, 1.5, 8.5]])
    # the rank tests: Fligner-Killeen's exact permutation p is close to scipy's chi-square approximation, and
    # Klotz's does not depend on which arm comes first
    from scipy import stats as sps
    fk = coverage.power._rank_pvalues(a, b, "fligner")
    np.testing.assert_allclose(fk, [sps.fligner(x, y).pvalue for x, y in zip(a, b)], atol=0.05)
    # the variance ratio permuted is scipy's exact permutation test of it on the mean-centred arms
    var_p = coverage.power._variance_pvalues(a[:4], b[:4])
    ref = [sps.permutation_test((x - x.mean(), y - y.mean()), lambda u, v: abs(u.var() / (u.var() + v.var()) - 0.5),
                                permutation_type="independent", alternative="greater", n_resamples=np.inf).pvalue
           for x, y in zip(a[:4], b[:4])]
    np.testing.assert_allclose(var_p, ref, rtol=1e-9)
    assert coverage.power._variance_pvalues(np.zeros((1, 8)), np.zeros((1, 8)))[0] == 1.0
    klotz = coverage.power._rank_pvalues(a, b, "klotz")
    np.testing.assert_allclose(klotz, coverage.power._rank_pvalues(b, a, "klotz"))
    assert 0 < klotz.min() and klotz.max() <= 1


def test_the_docs_power_tables_are_the_stored_simulation():
    """docs/statistics.md's power tables are ``python benchmarks/coverage.py --power --markdown`` of the committed
    JSON, and the methods chosen from them are the ones the docs name."""
    import importlib.util
    import json
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("coverage_benchmark", root / "benchmarks" / "coverage.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    stored = json.loads((root / "benchmarks" / "results" / "power.json").read_text())
    assert bench.power_markdown(stored) in (root / "docs" / "statistics.md").read_text()
    realistic = [r for r in stored["paired_ratio"] if r["realistic"]]
    assert min(r["paired_bonett_98"]["coverage"] for r in realistic) >= 0.93  # stats.PAIRED_TAIL = 0.8 keeps 93%
    assert stats.PAIRED_TAIL == 0.8 and min(r["paired_bonett_97.5"]["coverage"] for r in realistic) < 0.93
    # the 93% rule read for a test: of the spread tests whose false alarms stay at most 7% in every realistic
    # scenario, the printed one is the most powerful at R=8 on normal studies; each one with more power breaks it
    tests = [r for r in stored["spread_test"] if r["realistic"]]
    normal = next(r for r in tests if r["scenario"] == "normal" and r["replicas"] == 8)
    keeps = [t for t in coverage.power.SPREAD_TESTS if max(r[t]["false_alarm"] for r in tests) <= 0.07]
    assert "printed" in keeps and max(keeps, key=lambda t: normal[t]["power"]) == "printed"
    assert {"hines", "levene", "klotz", "trimmed", "variance"}.isdisjoint(keeps) and "fligner" in keeps
    assert all(r["bonferroni"] <= 0.05 for r in stored["family"])
