"""Divergence dynamics: the growth-rate fit on synthetic data, and an arm's own pair watched while it trains."""

import jax
import numpy as np
import pytest
from conftest import spec_of, tiny_config

from nondet_jax.analysis.dynamics import fit_growth_rate
from nondet_jax.errors import UsageError
from nondet_jax.replicas.choice import run_replicas
from nondet_jax.replicas.loop import EpochState
from nondet_jax.replicas.watch import pair_trace, pair_watcher
from nondet_jax.sources import arm_keys, arm_sources, perturbations
from nondet_jax.study import runner
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


def flat64(params) -> np.ndarray:
    return np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(params)])


@pytest.mark.parametrize("strategy", ["sequential", "vmap"])
def test_an_arms_own_pair_is_watched_while_it_trains(small_digits, strategy):
    """The trace is the arm's replicas 0 and 1 themselves: at step 4 (one epoch) it equals the distance and the
    disagreement of the states a one-epoch run ends with; watching changes no bit of the training."""
    fns = make_train(tiny_config(), spec_of(small_digits))
    assert fns.epoch_shape == "step" and fns.steps_per_epoch == 4  # CPU: epochs driven step by step
    varied = arm_sources("bitflip")
    keys, perturb, x = arm_keys(0, varied, 3), perturbations(varied), small_digits.x_test
    watched = run_replicas(fns, keys, perturb, small_digits, 2, strategy, watcher=pair_watcher(fns, x, 2))
    plain = run_replicas(fns, keys, perturb, small_digits, 2, strategy)
    for a, b in zip(jax.tree.leaves(watched.state), jax.tree.leaves(plain.state)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(watched.logits, plain.logits)
    assert np.isnan(watched.steps["pair_distance"][[0, 2]]).all()  # kept under replica 1 only

    trace = pair_trace(fns, watched, x, every=2)
    assert trace["step"].tolist() == [0, 2, 4, 6, 8]
    assert 0 < trace["weight_distance"][0] < 1e-6  # one ulp of one weight
    assert trace["weight_distance"][-1] > trace["weight_distance"][0]
    one = run_replicas(fns, keys, perturb, small_digits, 1, strategy)  # the states after step 4
    p0, p1 = flat64(jax.tree.map(lambda a: a[0], one.state.params)), flat64(jax.tree.map(lambda a: a[1], one.state.params))
    np.testing.assert_allclose(trace["weight_distance"][2], np.linalg.norm(p0 - p1) / np.linalg.norm(p0), rtol=1e-5)
    pred = one.logits[:2, :256].argmax(-1)
    assert trace["disagreement"][2] == np.mean(pred[0] != pred[1])

    control = run_replicas(fns, arm_keys(0, frozenset(), 2), perturbations(frozenset()), small_digits, 2, strategy,
                           watcher=pair_watcher(fns, x, 2))
    ctl = pair_trace(fns, control, x, every=2)
    assert (ctl["weight_distance"] == 0).all() and (ctl["disagreement"] == 0).all()


def test_a_watched_run_resumes_with_its_trace(small_digits):
    """Epoch 2 continued from epoch 1's state (what a checkpoint holds) carries the same watched metrics."""
    fns = make_train(tiny_config(), spec_of(small_digits))
    varied = arm_sources("init")
    keys, perturb, x = arm_keys(0, varied, 2), perturbations(varied), small_digits.x_test
    kept = []
    whole = run_replicas(fns, keys, perturb, small_digits, 2, "sequential", watcher=pair_watcher(fns, x, 3),
                         on_epoch=kept.append)
    first: EpochState = kept[0]
    resumed = run_replicas(fns, keys, perturb, small_digits, 2, "sequential", watcher=pair_watcher(fns, x, 3),
                           start=first)
    for name in ("pair_distance", "pair_disagreement"):
        np.testing.assert_array_equal(resumed.steps[name], whole.steps[name])
    assert np.isfinite(whole.steps["pair_distance"][1, [0, 3, 6]]).all()


def test_a_study_that_cannot_be_watched_is_refused_before_it_writes(tmp_path, small_digits):
    with pytest.raises(UsageError, match="add --set train.epoch_shape=step, or drop study.dynamics_every"):
        runner.run(tiny_config(**{"study.dynamics_every": 2, "train.epoch_shape": "scan"}), tmp_path / "run",
                   progress=False, log=lambda *a, **k: None)
    assert not (tmp_path / "run").exists()
    fns = make_train(tiny_config(), spec_of(small_digits))
    with pytest.raises(ValueError, match="the unrolled strategy runs each epoch as one program"):
        run_replicas(fns, arm_keys(0, arm_sources("init"), 2), perturbations(arm_sources("init")), small_digits, 1,
                     "unrolled", watcher=pair_watcher(fns, small_digits.x_test, 2))
