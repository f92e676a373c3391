"""Arm metrics on real trained replicas: LMC with BatchNorm recomputed, zero diversity for control."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import spec_of, tiny_config

from nondet_jax.analysis.arm import (
    arm_metrics,
    bn_examples,
    compare_arms,
    interpolation_error_fn,
    lmc_pairs,
)
from nondet_jax.analysis.metrics import interpolation_curve, interpolation_curves
from nondet_jax.config import MetricsConfig
from nondet_jax.replicas.choice import run_replicas
from nondet_jax.sources import arm_keys, arm_sources, perturbations
from nondet_jax.train import make_train


@pytest.fixture(scope="module")
def trained(small_digits):
    config = tiny_config(**{"model.name": "resnet8", "model.width": 0.5, "train.epochs": 2})
    fns = make_train(config, spec_of(small_digits))
    out = {}
    for arm in ("control", "all"):
        varied = arm_sources(arm)
        out[arm] = run_replicas(fns, arm_keys(0, varied, 4), perturbations(varied), small_digits, 2, "sequential")
    return fns, out


def test_control_arm_has_zero_diversity_and_zero_barrier(trained, small_digits):
    fns, res = trained
    m, arrays = arm_metrics(res["control"], small_digits, fns, MetricsConfig(lmc_pairs=2, lmc_points=5))
    assert m["accuracy"]["std"] == 0 and m["disagreement"]["mean"] == 0
    assert m["ensemble_gain_accuracy"]["mean"] == 0 and m["weight_distance"]["mean"] == 0
    assert m["lmc_barrier"]["values"] == [0.0, 0.0]
    assert arrays["lmc_curves"].shape == (2, 5)
    assert np.allclose(m["cka"]["mean"], 1.0)


def test_all_arm_metrics_are_populated(trained, small_digits):
    fns, res = trained
    m, arrays = arm_metrics(res["all"], small_digits, fns, MetricsConfig(lmc_pairs=1, lmc_points=3))
    assert m["disagreement"]["mean"] > 0 and m["weight_distance"]["mean"] > 0
    lo, hi = m["disagreement"]["ci"]
    assert lo <= m["disagreement"]["mean"] <= hi
    assert len(arrays["disagreement"]) == 6 and arrays["lmc_pairs"].tolist() == [[0, 1]]
    assert res["all"].weight_distance.shape == (3, 6) and (res["all"].weight_distance > 0).all()


def test_batchnorm_is_recomputed_for_interpolated_weights(trained, small_digits):
    fns, res = trained
    state = res["all"].state
    take = lambda i: jax.tree.map(lambda x: x[i], state.params)  # noqa: E731
    mid = jax.tree.map(lambda a, b: 0.5 * (a + b), take(0), take(1))
    bs0 = jax.tree.map(lambda x: x[0], state.batch_stats)
    x = jnp.asarray(small_digits.x_train)
    new = fns.recompute_batch_stats(mid, bs0, x)
    assert not all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(bs0)))
    # the recomputed mean of the first BatchNorm is the batch mean of the stem convolution's output
    stem = jax.lax.conv_general_dilated(x, mid["stem_conv"]["kernel"], (1, 1), "SAME",
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"))
    np.testing.assert_allclose(new["stem_bn"]["mean"], stem.mean((0, 1, 2)), rtol=1e-4, atol=1e-5)
    err = interpolation_error_fn(fns, bs0, x, jnp.asarray(small_digits.x_test), small_digits.y_test)
    assert 0.0 <= err(mid) <= 1.0
    # the study's curve, its points from several threads at once: the same errors as one after another
    alphas = np.linspace(0.0, 1.0, 5)
    one = interpolation_curve(err, take(0), take(1), alphas)
    assert np.array_equal(interpolation_curve(err, take(0), take(1), alphas, threads=3), one)
    assert one[0] == err(take(1))
    # several pairs' points share one pool (an identical pair evaluated once): each row is its pair's curve
    rows = interpolation_curves(err, [(take(0), take(1)), (take(1), take(1)), (take(1), take(0))], alphas, threads=2)
    assert np.array_equal(rows[0], one) and np.array_equal(rows[2], interpolation_curve(err, take(1), take(0), alphas))
    assert np.array_equal(rows[1], np.full(len(alphas), err(take(1))))


def test_batchnorm_is_recomputed_on_examples_of_every_class(trained, small_digits):
    """A training set stored class by class (an outside review): the LMC curve's ends are the replicas' own
    errors, as on shuffled data; the first examples alone held one class and read errors far from them."""
    fns, res = trained
    order = np.argsort(small_digits.y_train, kind="stable")
    idx = bn_examples(len(order), 100)
    assert len(set(small_digits.y_train[order][idx].tolist())) == small_digits.num_classes
    assert bn_examples(256, 256) == slice(None)  # a set no larger: all of it, in its order
    ends = []
    for data in (small_digits, small_digits._replace(x_train=small_digits.x_train[order],
                                                      y_train=small_digits.y_train[order])):
        m, arrays = arm_metrics(res["all"], data, fns, MetricsConfig(lmc_pairs=1, lmc_points=2, bn_examples=100))
        ends.append(arrays["lmc_curves"][0])
    assert np.abs(ends[1] - ends[0]).max() <= 0.05, ends


def test_lmc_pairs_are_disjoint():
    assert lmc_pairs(7, 5) == [(0, 1), (2, 3), (4, 5)]
    assert lmc_pairs(8, 2) == [(0, 1), (2, 3)]


def test_compare_arms_against_all():
    rows = lambda v: [{"test_accuracy": a, "test_loss": a * 2} for a in v]  # noqa: E731
    recs = {"all": {"rows": rows([0.9, 0.92, 0.88, 0.91])}, "init": {"rows": rows([0.9, 0.905, 0.9, 0.895])}}
    out = compare_arms(recs)
    assert set(out) == {"init"} and out["init"]["accuracy"]["ratio"] < 1
    assert compare_arms({"init": recs["init"]}) == {}


def test_snapshot_variants_are_not_in_the_sources_family():
    """arm@snapshotK is a mitigation, compared with its own arm in the mitigations table: it was given a ratio to
    'all' and counted in the findings' Holm family and the ranking of sources (an outside review)."""
    rng = np.random.default_rng(0)

    def record(varied):
        rows = [{"replica": r, "test_accuracy": float(a), "test_loss": float(b), "diverged_at_step": -1}
                for r, (a, b) in enumerate(rng.normal(0.9, 0.01, (6, 2)))]
        return {"rows": rows, "varied": varied, "metrics": {}}

    out = compare_arms({"all": record(["init", "data_order"]), "init": record(["init"]),
                        "data_order": record(["data_order"]), "init@snapshot3": record(["init"])})
    assert sorted(out) == ["data_order", "init"]
    assert out["init"]["accuracy"]["family_level"] == 1 - 0.05 / 2  # two sources, not three
