"""Replica training: isolation of sources, bitwise determinism on CPU, strategies, schedules, accuracy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import one_replica, spec_of, tiny_config, tree_equal

from nondet_jax.config import from_flat
from nondet_jax.data.pipeline import augment, epoch_indices
from nondet_jax.replicas.choice import run_replicas
from nondet_jax.replicas.rule import resolve_strategy
from nondet_jax.sources import arm_keys, arm_sources, perturbations
from nondet_jax.train import make_schedule, make_train


def train_arm(config, data, arm, strategy="sequential", replicas=3):
    fns = make_train(config, spec_of(data))
    varied = arm_sources(arm)
    return run_replicas(fns, arm_keys(config.study.seed, varied, replicas), perturbations(varied), data,
                        config.train.epochs, strategy)


def init_weights(config, data, arm, replicas=3):
    fns = make_train(config, spec_of(data))
    varied = arm_sources(arm)
    init = jax.jit(jax.vmap(fns.init, in_axes=(0, None, None)))
    return init(arm_keys(config.study.seed, varied, replicas), perturbations(varied), jnp.asarray(data.x_train[:1])).params


@pytest.mark.parametrize("strategy", ["sequential", "vmap"])
def test_control_arm_replicas_are_bitwise_identical(small_digits, strategy):
    res = train_arm(tiny_config(**{"model.name": "resnet8", "model.width": 0.5}), small_digits, "control", strategy)
    for r in range(1, 3):
        assert np.array_equal(res.logits[0], res.logits[r])
        assert tree_equal(jax.tree.map(lambda x: x[0], res.state.params), jax.tree.map(lambda x: x[r], res.state.params))


def test_init_arm_varies_weights_only(small_digits):
    config = tiny_config(**{"data.augment": "on"})
    w = init_weights(config, small_digits, "init")
    leaf = np.asarray(w["dense1"]["kernel"])
    assert not np.array_equal(leaf[0], leaf[1])
    keys = arm_keys(0, arm_sources("init"), 3)
    orders = [np.asarray(epoch_indices(keys.data_order[r], 1, 256, 64)) for r in range(3)]
    assert all(np.array_equal(orders[0], o) for o in orders)
    x = jnp.asarray(small_digits.x_train[:8])
    views = [np.asarray(augment(x, jax.random.fold_in(keys.augmentation[r], 5), 1)) for r in range(3)]
    assert all(np.array_equal(views[0], v) for v in views)


def test_replica_initial_weights_equal_in_init_and_all_arms(small_digits):
    config = tiny_config(**{"model.name": "resnet8", "model.width": 0.5})
    # the all arm also flips one weight by one ulp: compare against init+bitflip keys' unflipped draw
    w_init = init_weights(config, small_digits, "init")
    w_all = init_weights(config, small_digits, "all")
    w_init_flip = init_weights(config, small_digits, "init+bitflip")
    assert tree_equal(w_all, w_init_flip)
    a = np.concatenate([np.asarray(x).reshape(3, -1) for x in jax.tree.leaves(w_init)], 1)
    b = np.concatenate([np.asarray(x).reshape(3, -1) for x in jax.tree.leaves(w_all)], 1)
    assert ((a != b).sum(1) == 1).all()  # identical draws but for the one-ulp flip


def test_bitflip_arm_changes_one_weight_against_control(small_digits):
    config = tiny_config(**{"model.name": "resnet8", "model.width": 0.5})
    c = np.concatenate([np.asarray(x).reshape(3, -1) for x in jax.tree.leaves(init_weights(config, small_digits, "control"))], 1)
    f = np.concatenate([np.asarray(x).reshape(3, -1) for x in jax.tree.leaves(init_weights(config, small_digits, "bitflip"))], 1)
    assert ((c != f).sum(1) == 1).all()
    assert len({int(np.flatnonzero(c[r] != f[r])[0]) for r in range(3)}) >= 2  # replicas flip different weights


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_batch_order_keeps_initial_loss_up_to_rounding(small_digits, dropout):
    """Permuting a minibatch changes only the reduction order: the first step's loss agrees to
    float rounding, and (with per-example dropout masks) dropout does not break that."""
    config = tiny_config(**{"model.name": "resnet8", "model.width": 0.5, "model.dropout": dropout,
                            "train.epochs": 1})
    spec = spec_of(small_digits)._replace(n_train=64)  # one step per epoch
    fns = make_train(config, spec)
    x, y = jnp.asarray(small_digits.x_train[:64]), jnp.asarray(small_digits.y_train[:64])
    losses = {}
    for arm in ("control", "batch_order"):
        keys, perturb = one_replica(arm, 1)
        state = fns.init(keys, perturb, x)
        _, m = jax.jit(fns.train_epoch)(state, x, y, keys, perturb, 0)
        losses[arm] = float(m["loss"][0])
    np.testing.assert_allclose(losses["batch_order"], losses["control"], rtol=1e-5)


def test_batch_order_changes_results_only_by_rounding(small_digits):
    config = tiny_config(**{"model.name": "resnet8", "model.width": 0.5})
    res = train_arm(config, small_digits, "batch_order")
    ctl = train_arm(config, small_digits, "control")
    np.testing.assert_allclose(res.logits, ctl.logits, atol=1e-2)
    assert not np.array_equal(res.logits, ctl.logits)  # reduction order did change bits


def test_same_config_and_seed_twice_is_bitwise_identical(small_digits):
    config = tiny_config(**{"model.dropout": 0.2, "data.augment": "on"})
    a = train_arm(config, small_digits, "all")
    jax.clear_caches()
    b = train_arm(config, small_digits, "all")
    assert np.array_equal(a.logits, b.logits) and tree_equal(a.state, b.state)
    assert not np.array_equal(a.logits[0], a.logits[1])


def test_sequential_equals_plain_single_replica_training(small_digits):
    config = tiny_config(**{"model.dropout": 0.2, "data.augment": "on"})
    res = train_arm(config, small_digits, "all", "sequential")
    fns = make_train(config, spec_of(small_digits))
    keys, perturb = one_replica("all", 2)
    x, y = jnp.asarray(small_digits.x_train), jnp.asarray(small_digits.y_train)
    state = jax.jit(fns.init)(keys, perturb, x[:1])
    for e in range(config.train.epochs):
        state, _ = jax.jit(fns.train_epoch)(state, x, y, keys, perturb, e)
    logits, _ = jax.jit(fns.evaluate)(state, jnp.asarray(small_digits.x_test))
    assert np.array_equal(res.logits[2], np.asarray(logits))
    assert tree_equal(jax.tree.map(lambda a: a[2], res.state.params), state.params)


@pytest.mark.parametrize("shape", ["step", "scan"])
def test_replica_threads_change_no_bit(small_digits, shape):
    """The sequential strategy trains replicas from several threads at once: every replica's weights, logits and
    per-step metrics are bitwise those of one thread, whatever the epoch's shape."""
    base = {"model.name": "resnet8", "model.width": 0.5, "model.dropout": 0.2, "data.augment": "on",
            "train.epoch_shape": shape}
    one = train_arm(tiny_config(**base, **{"train.replica_threads": 1}), small_digits, "all", replicas=4)
    three = train_arm(tiny_config(**base, **{"train.replica_threads": 3}), small_digits, "all", replicas=4)
    assert np.array_equal(one.logits, three.logits) and tree_equal(one.state, three.state)
    assert tree_equal(one.steps, three.steps)
    assert not np.array_equal(one.logits[0], one.logits[1])


def test_replica_threads_auto_is_one_per_core_on_cpu_only():
    import os

    from nondet_jax.train import replica_threads
    assert replica_threads(0, "cpu") == len(os.sched_getaffinity(0))
    assert replica_threads(0, "gpu") == 1 and replica_threads(3, "gpu") == 3


def test_vmap_matches_sequential_up_to_rounding(small_digits):
    config = tiny_config(**{"model.name": "resnet8", "model.width": 0.5})
    seq = train_arm(config, small_digits, "all", "sequential")
    vm = train_arm(config, small_digits, "all", "vmap")
    np.testing.assert_allclose(vm.logits, seq.logits, atol=1e-2, rtol=1e-3)
    assert vm.strategy == "vmap" and seq.strategy == "sequential"


def test_replica_result_does_not_depend_on_replica_count(small_digits):
    config = tiny_config()
    r2 = train_arm(config, small_digits, "all", replicas=2)
    r3 = train_arm(config, small_digits, "all", replicas=3)
    assert np.array_equal(r2.logits, r3.logits[:2])


def test_auto_strategy_rule():
    assert resolve_strategy("auto", 8, "cpu")[0] == "sequential"
    assert resolve_strategy("auto", 8, "gpu")[0] == "sequential"  # below the measured rule's vmap_min_replicas (H200)
    assert resolve_strategy("auto", 16, "gpu")[0] == "vmap"
    assert resolve_strategy("auto", 8, "tpu")[0] == "vmap"
    assert resolve_strategy("auto", 1, "gpu")[0] == "sequential"
    assert resolve_strategy("vmap", 8, "cpu") == ("vmap", "requested")


def test_auto_strategy_does_not_shard_a_watched_study(monkeypatch):
    """Several accelerators run sharded, whose epochs are one program: a study watching replicas between steps
    (study.dynamics_every, the bitflip and morin presets) was refused there by default (an outside review)."""
    import jax

    monkeypatch.setattr(jax, "local_device_count", lambda: 4)
    assert resolve_strategy("auto", 16, "gpu")[0] == "sharded"
    assert resolve_strategy("auto", 16, "gpu", watched=True)[0] == "vmap"
    assert resolve_strategy("auto", 8, "gpu", watched=True)[0] == "sequential"


def test_schedules():
    def cfg(**kw):
        return from_flat({f"optim.{k}": v for k, v in kw.items()}).optim

    cos = make_schedule(cfg(schedule="cosine", lr=0.4, warmup_epochs=2), epochs=10, steps_per_epoch=10)
    assert float(cos(0)) == 0.0 and float(cos(20)) == pytest.approx(0.4) and float(cos(10)) == pytest.approx(0.2)
    assert float(cos(100)) == pytest.approx(0.0, abs=1e-7) and float(cos(60)) < 0.4
    step = make_schedule(cfg(schedule="step", lr=1.0), epochs=4, steps_per_epoch=10)
    assert [float(step(s)) for s in (0, 19, 21, 31)] == pytest.approx([1.0, 1.0, 0.1, 0.01])
    every = make_schedule(cfg(schedule="step", lr=1.0, step_every_epochs=1, step_factor=0.5), 4, 10)
    assert float(every(25)) == pytest.approx(0.25)
    assert float(make_schedule(cfg(schedule="constant", lr=0.3), 4, 10)(33)) == pytest.approx(0.3)


@pytest.mark.parametrize("opt", [{"optim.name": "sgd", "optim.nesterov": True}, {"optim.name": "adamw", "optim.lr": 1e-3}])
def test_optimizers_reduce_training_loss(small_digits, opt):
    res = train_arm(tiny_config(**{"train.epochs": 4, **opt}), small_digits, "control", replicas=1)
    assert res.train_loss[0, -1] < res.train_loss[0, 0]


def test_no_recompilation_across_arms(small_digits):
    config = tiny_config(**{"train.epochs": 1})
    fns = make_train(config, spec_of(small_digits))
    traces = []

    def counted(*args):
        traces.append(1)
        return fns.train_epoch(*args)

    epoch = jax.jit(counted)
    x, y = jnp.asarray(small_digits.x_train), jnp.asarray(small_digits.y_train)
    for arm in ("control", "all", "bitflip"):
        k, p = one_replica(arm, 1)
        state = fns.init(k, p, x)
        epoch(state, x, y, k, p, 0)
    assert len(traces) == 1


@pytest.fixture
def optimized():
    """Full XLA optimisation for a test that trains for real (the suite disables most of it)."""
    before = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", False)
    yield
    jax.config.update("jax_disable_most_optimizations", before)


@pytest.mark.slow
def test_resnet8_reaches_90_percent_on_digits(digits, optimized):
    config = from_flat({"model.name": "resnet8", "train.epochs": 6, "study.replicas": 1, "metrics.pairwise": False})
    res = train_arm(config, digits, "control", replicas=1)
    acc = (res.logits[0].argmax(-1) == digits.y_test).mean()
    assert acc >= 0.90, acc
    assert res.train_loss[0, -1] < 0.5 * res.train_loss[0, 0]


def test_epoch_shape_auto_steps_on_cpu_and_scans_elsewhere():
    from nondet_jax.train import epoch_shape

    assert [epoch_shape("auto", n, "cpu") for n in (1, 11, 16, 17, 390)] == ["step"] * 5
    assert epoch_shape("auto", 390, "gpu") == "scan" and epoch_shape("step", 5, "gpu") == "step"
    assert epoch_shape("scan", 390, "cpu") == "scan"
    fns = make_train(tiny_config(**{"train.batch_size": 8}), spec_of_n(256))  # 32 steps per epoch on CPU
    assert fns.epoch_shape == "step" and fns.steps_per_epoch == 32


def spec_of_n(n):
    from nondet_jax.train import DataSpec

    return DataSpec(n, (8, 8, 1), 10, "digits")


@pytest.mark.parametrize("strategy", ["sequential", "vmap"])
def test_stepped_epoch_trains_what_the_scanned_epoch_trains(small_digits, strategy):
    """The epoch driven step by step from Python runs the same steps, guard, metrics and instruments as the scan:
    the same weights to rounding (bitwise for this MLP on one AVX2 CPU), the same per-step losses and instrument
    values, control replicas bitwise identical, and a diverged replica frozen as the scan freezes it."""
    base = {"model.dropout": 0.2, "train.epochs": 2, "train.batch_size": 32}
    step = train_arm(tiny_config(**base, **{"train.epoch_shape": "step"}), small_digits, "all", strategy)
    scan = train_arm(tiny_config(**base, **{"train.epoch_shape": "scan", "train.unroll": 1}), small_digits, "all",
                     strategy)
    np.testing.assert_allclose(step.logits, scan.logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(step.steps["loss"], scan.steps["loss"], rtol=1e-5, atol=1e-6)
    assert step.steps["loss"].shape == (3, 2 * 8) and not np.array_equal(step.logits[0], step.logits[1])
    control = train_arm(tiny_config(**base, **{"train.epoch_shape": "step"}), small_digits, "control", strategy)
    assert all(np.array_equal(control.logits[0], control.logits[r]) for r in (1, 2))
    diverged = train_arm(tiny_config(**base, **{"train.epoch_shape": "step", "optim.lr": 1e4}), small_digits, "init",
                         strategy)
    ref = train_arm(tiny_config(**base, **{"train.epoch_shape": "scan", "optim.lr": 1e4}), small_digits, "init",
                    strategy)
    assert np.array_equal(diverged.diverged_at, ref.diverged_at) and (diverged.diverged_at >= 0).all()
    inst = {**base, "instruments.config": "economy"}
    a = train_arm(tiny_config(**inst, **{"train.epoch_shape": "step"}), small_digits, "all", strategy, replicas=2)
    b = train_arm(tiny_config(**inst, **{"train.epoch_shape": "scan", "train.unroll": 1}), small_digits, "all",
                  strategy, replicas=2)
    assert a.steps["instruments"].keys() == b.steps["instruments"].keys()
    for k in ("Loss", "GradNorm", "Alpha", "NormTest"):
        np.testing.assert_allclose(a.steps["instruments"][k], b.steps["instruments"][k], rtol=1e-4, atol=1e-6)


def test_training_notes_say_what_runs_otherwise_than_meant(small_digits):
    """A batch size leaving a third of the examples out of every epoch, and a warm-up as long as training, were
    silent (outside reviews); the default study's settings say nothing."""
    from nondet_jax.study.runner import training_notes

    def notes(**flat):
        config = tiny_config(**flat)
        return training_notes(config, small_digits, make_train(config, spec_of(small_digits)))

    assert notes() == []  # 256 examples in batches of 64, 2 epochs after a 1-epoch warm-up
    dropped, = notes(**{"train.batch_size": 100})
    assert "leaves 56 of the 256 training examples (22%) out of every epoch" in dropped
    warm, = notes(**{"optim.warmup_epochs": 2})
    assert "optim.warmup_epochs=2 is as long as training (2 epoch(s))" in warm and "never decays" in warm
    assert notes(**{"optim.warmup_epochs": 2, "optim.schedule": "step"}) == []  # the step schedule has no warm-up
