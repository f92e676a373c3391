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


def test_small_p_values_are_not_printed_as_zero():
    assert fmt_p(0.00016) == "1.6e-04" and fmt_p(0.0123) == "0.012" and fmt_p(None) == "—"
    assert fmt_p(float("nan")) == "—"
