"""The console table shows small effects: values below its resolution in scientific notation, bitwise
identical arms named as such, p-values below 0.001 never printed as 0."""

from nondet_jax.report.summary import _std_cell, fmt_p, small


def test_values_below_the_resolution_print_in_scientific_notation():
    assert small(5.1e-09, 4) == "5.1e-09" and small(0.0123, 4) == "0.0123" and small(0.0, 2) == "0.00"
    assert small(None, 2) == "—"
    # a bitflip arm's cross-entropy std: the estimate and both ends readable, not "0.0000 [0.0000, 0.0000]"
    assert _std_cell({"std": 5.1e-09, "std_ci": [2e-09, 1.3e-08]}, {}, 1.0, 4) == "5.1e-09 [2.0e-09, 1.3e-08]"


def test_bitwise_identical_arms_and_missing_intervals():
    assert _std_cell({"std": 0.0, "std_ci": [0.0, 0.0]}, {"replicas_bitwise_identical": True}) == "bitwise identical"
    assert _std_cell({"std": 0.01, "std_ci": [None, None]}, {}) == "1.00 n/a"
    # one replica is identical to itself: nothing was compared (it read "bitwise identical": an outside review)
    one = {"replicas": 1, "replicas_used": 1, "replicas_bitwise_identical": True}
    assert _std_cell({"std": float("nan"), "std_ci": [None, None]}, one) == "n/a (1 replica)"


def test_long_arm_names_keep_the_table_in_line():
    from nondet_jax.report.summary import format_table

    arm = {"replicas": 2, "replicas_used": 2, "metrics": {}}
    lines = format_table({"arms": {"init": arm, "init@snapshot3": arm}, "vs_all": {}}).splitlines()
    assert lines[2].index(" 0 ") == lines[3].index(" 0 ")  # the R column one under the other


def test_small_p_values_are_not_printed_as_zero():
    assert fmt_p(0.00016) == "1.6e-04" and fmt_p(0.0123) == "0.012" and fmt_p(None) == "—"
    assert fmt_p(float("nan")) == "—"


def test_the_ratio_of_a_bitwise_identical_arm_is_named_not_given_a_zero_width_interval():
    """The report's comparison table: a control arm whose replicas are bitwise identical has a spread of exactly 0
    by construction: it reads "0 (bitwise identical)", not "0.00 [0.00, 0.00]"; an estimated ratio keeps its CI."""
    import numpy as np

    from nondet_jax.analysis import stats
    from nondet_jax.analysis.task import QUANTITIES
    from nondet_jax.report.markdown import _comparison_md

    q1, q2 = QUANTITIES["classification"]
    ref = np.array([330, 335, 338, 342, 344, 339, 333, 341]) / 360
    tied, spread = np.full(8, 0.95), ref[::-1] + 1 / 360
    vs = {arm: {q.name: stats.compare_spread(x, ref, resolution=1 / 360) for q in (q1, q2)}
          for arm, x in (("control", tied), ("init", spread))}
    summary = {"vs_all": vs, "arms": {"control": {"replicas_bitwise_identical": True}, "init": {}, "all": {}}}
    rows = {line.split(" | ")[0]: line for line in _comparison_md(summary) if line.startswith("| control")
            or line.startswith("| init")}
    assert rows["| control"].count("0 (bitwise identical)") == 2 and "[0.00, 0.00]" not in rows["| control"]
    lo, hi = vs["init"][q1.name]["ratio_ci"]
    assert f"[{lo:.2f}, {hi:.2f}]" in rows["| init"]
