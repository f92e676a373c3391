"""The snapshot (cyclic cosine) schedule and the per-parameter-group learning rate."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from nondet_jax.config import from_flat
from nondet_jax.errors import UsageError
from nondet_jax.models import make_model
from nondet_jax.train import bias_bn_mask, make_optimizer, make_schedule


def optim(**kw):
    flat = {f"optim.{k}": v for k, v in kw.items() if k != "epochs"}
    flat["train.epochs"] = kw.get("epochs", 12)
    return from_flat(flat).optim


def values(schedule, n):
    return np.array([float(schedule(i)) for i in range(n + 1)])


@pytest.mark.parametrize("cycles,warmup", [(3, 1), (4, 0.5), (2, 2)])
def test_snapshot_hits_zero_at_every_cycle_end_and_peaks_after_each_warmup(cycles, warmup):
    epochs, spe, lr = 12, 10, 0.4
    o = optim(schedule="snapshot", cycles=cycles, warmup_epochs=warmup, lr=lr, epochs=epochs)
    s = make_schedule(o, epochs, spe)
    cycle, w = epochs // cycles * spe, round(warmup * spe)
    v = values(s, epochs * spe)
    for c in range(cycles):
        assert v[c * cycle] == 0.0  # warm-up starts from 0 (c = 0) and the previous cycle ends at 0
        assert v[c * cycle + w] == pytest.approx(lr, rel=1e-6)  # peak right after the warm-up
        seg = v[c * cycle:(c + 1) * cycle + 1]
        assert seg.argmax() == w and np.all(np.diff(seg[:w + 1]) > 0) and np.all(np.diff(seg[w:]) < 0)
    assert v[cycles * cycle] == 0.0  # and the last one ends at 0 too
    np.testing.assert_array_equal(v[:cycle], v[cycle:2 * cycle])  # every cycle is the same curve
    assert v.max() == pytest.approx(lr, rel=1e-6)


def test_snapshot_without_warmup_restarts_at_peak_like_huang_et_al():
    epochs, spe, lr = 6, 5, 0.2
    s = make_schedule(optim(schedule="snapshot", cycles=3, warmup_epochs=0, lr=lr, epochs=epochs), epochs, spe)
    v = values(s, epochs * spe)
    cycle = 10
    for c in range(3):
        assert v[c * cycle] == pytest.approx(lr)
        # the cycle's last step: lr/2 (1 + cos(pi (L-1)/L)), its cosine reaching 0 at L
        last = lr / 2 * (1 + math.cos(math.pi * (cycle - 1) / cycle))
        assert v[c * cycle + cycle - 1] == pytest.approx(last, rel=1e-5)
    assert v[3 * cycle] == 0.0


def test_snapshot_with_one_cycle_is_the_cosine_schedule():
    a = make_schedule(optim(schedule="snapshot", cycles=1, warmup_epochs=2, lr=0.3), 12, 7)
    b = make_schedule(optim(schedule="cosine", warmup_epochs=2, lr=0.3), 12, 7)
    np.testing.assert_array_equal(values(a, 84), values(b, 84))


@pytest.mark.parametrize("flat,match", [
    ({"optim.schedule": "snapshot", "optim.cycles": 5, "train.epochs": 12}, "divisible by optim.cycles"),
    ({"optim.schedule": "cosine", "optim.cycles": 3}, "needs the snapshot schedule"),
    ({"optim.schedule": "snapshot", "optim.cycles": 4, "optim.warmup_epochs": 3, "train.epochs": 12}, "warmup_epochs"),
    ({"optim.cycles": 0}, "optim.cycles must be >= 1"),
    ({"optim.bias_bn_lr_scale": 0}, "bias_bn_lr_scale must be > 0"),
])
def test_bad_schedule_settings_are_refused(flat, match):
    with pytest.raises(UsageError, match=match):
        from_flat(flat)



@pytest.mark.parametrize("epochs", [1, 2, 3, 4, 5, 7])
def test_the_epochs_a_snapshot_refusal_suggests_are_accepted(epochs):
    """The mitigations preset at --epochs 2 suggested --epochs 3, which its warm-up of 1 epoch then refused
    (outside review): the suggestion is the fewest epochs that pass both checks."""
    import re

    flat = {"optim.schedule": "snapshot", "optim.cycles": 3, "optim.warmup_epochs": 1, "train.epochs": epochs}
    with pytest.raises(UsageError) as e:
        from_flat(flat)
    suggested = int(re.search(r"--epochs (\d+)", str(e.value)).group(1))
    assert suggested == 6 and from_flat({**flat, "train.epochs": suggested}).train.epochs == 6


@pytest.fixture(scope="module")
def resnet_params():
    model = make_model("resnet8", 10, 0.5)
    return model.init(jax.random.key(0), jnp.zeros((1, 8, 8, 1)), train=False)["params"]


def test_bias_bn_mask_selects_biases_and_batchnorm_scales_only(resnet_params):
    mask = bias_bn_mask(resnet_params)
    picked, others = [], []
    for path, m in jax.tree_util.tree_leaves_with_path(mask):
        (picked if m else others).append(jax.tree_util.keystr(path))
    assert "['head']['classifier']['bias']" in picked
    bn = "['stage1_block1']['BatchNorm_0']"
    assert f"{bn}['scale']" in picked and f"{bn}['bias']" in picked
    assert all(p.endswith("['bias']") or p.endswith("['scale']") for p in picked)
    assert others and all(p.endswith("['kernel']") for p in others)  # every conv/dense kernel, nothing else
    n_bn = sum("BatchNorm" in p or "bn" in p for p in picked)
    assert n_bn == len(picked) - 1  # all BatchNorm scales and biases plus the classifier's bias


def _grads(params, seed):
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(treedef, [jax.random.normal(k, x.shape) for k, x in zip(keys, leaves)])


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_group_scale_equals_training_that_group_at_scaled_lr(resnet_params, name):
    """Three steps with bias_bn_lr_scale 0.1 move biases/BN scales exactly as the same optimiser at
    0.1x the learning rate does, and every kernel exactly as the unscaled optimiser does."""
    lr, wd = 0.05, 5e-4
    base = optim(name=name, lr=lr, weight_decay=wd, schedule="constant")
    scaled = make_optimizer(optim(name=name, lr=lr, weight_decay=wd, schedule="constant", bias_bn_lr_scale=0.1),
                            optax.constant_schedule(lr))
    plain = make_optimizer(base, optax.constant_schedule(lr))
    slow = make_optimizer(base, optax.constant_schedule(0.1 * lr))

    def run(tx):
        p, st = resnet_params, tx.init(resnet_params)
        for k in range(3):
            u, st = tx.update(_grads(resnet_params, k), st, p)
            p = optax.apply_updates(p, u)
        return p

    got, ref_full, ref_slow = run(scaled), run(plain), run(slow)
    mask = bias_bn_mask(resnet_params)
    for m, g, f, s, p0 in zip(jax.tree.leaves(mask), jax.tree.leaves(got), jax.tree.leaves(ref_full),
                              jax.tree.leaves(ref_slow), jax.tree.leaves(resnet_params)):
        if m:
            np.testing.assert_allclose(g - p0, s - p0, rtol=1e-5, atol=1e-9)
            assert not np.allclose(g - p0, f - p0)
        else:
            np.testing.assert_array_equal(g, f)


def test_default_scale_is_the_plain_optimizer_bitwise(resnet_params):
    o = optim(lr=0.1, momentum=0.9, weight_decay=5e-4)
    tx = make_optimizer(o, optax.constant_schedule(0.1))
    ref = optax.chain(optax.add_decayed_weights(5e-4), optax.sgd(0.1, momentum=0.9))
    g = _grads(resnet_params, 7)
    u, _ = tx.update(g, tx.init(resnet_params), resnet_params)
    r, _ = ref.update(g, ref.init(resnet_params), resnet_params)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(u), jax.tree.leaves(r)))
