"""Divergence dynamics: the growth-rate fit on synthetic data, and a real traced pair."""

import numpy as np
import pytest
from conftest import spec_of, tiny_config

from nondet_jax.analysis.dynamics import divergence_trace, fit_growth_rate
from nondet_jax.sources import arm_keys, arm_sources, perturbations
from nondet_jax.train import make_train


@pytest.mark.parametrize("rate", [0.02, 0.3])
def test_growth_rate_fit_recovers_known_rate(rate):
    rng = np.random.default_rng(0)
    t = np.arange(0, 200, 2.0)
    clean = 1e-9 * np.exp(rate * t)
    d = np.minimum(clean, 0.8) * np.exp(rng.normal(0, 0.05, len(t)))  # saturates at 0.8
    fit = fit_growth_rate(t, d)
    assert abs(fit["rate_per_step"] - rate) < max(4 * fit["stderr"], 0.02 * rate)
    assert fit["stderr"] > 0 and fit["points"] >= 3
    if rate == 0.3:  # saturation reached: the window stops there
        assert fit["window"][1] <= np.log(0.4 / 1e-9) / rate + 4


def test_growth_rate_fit_needs_three_positive_points():
    fit = fit_growth_rate([0, 1, 2], [0.0, 0.0, 1e-8])
    assert np.isnan(fit["rate_per_step"])


def test_traced_bitflip_pair_starts_one_ulp_apart_and_diverges(small_digits):
    config = tiny_config(**{"model.name": "mlp", "train.epochs": 2})
    fns = make_train(config, spec_of(small_digits))
    varied = arm_sources("bitflip")
    tr = divergence_trace(fns, arm_keys(0, varied, 2), perturbations(varied), small_digits, 2, every=2)
    assert tr["step"].tolist() == [0, 2, 4, 6, 8]
    assert 0 < tr["weight_distance"][0] < 1e-6  # one ulp of one weight
    assert tr["weight_distance"][-1] > tr["weight_distance"][0]
    ctl = divergence_trace(fns, arm_keys(0, frozenset(), 2), perturbations(frozenset()), small_digits, 2, every=2)
    assert (ctl["weight_distance"] == 0).all() and (ctl["disagreement"] == 0).all()
