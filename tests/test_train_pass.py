"""The ``train_pass`` per-example mode: contributions recorded from the training backward pass, in
float64. With BatchNorm in training mode they sum exactly to the batch gradient and equal the
gradients with respect to per-example copies of the weights; without BatchNorm they are
``vmap(grad)``'s per-example gradients."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from nondet_jax.config import from_flat
from nondet_jax.instruments import layerwise, per_example
from nondet_jax.instruments.trainer import for_model, model_losses, train_pass_grad
from nondet_jax.models import MLP, make_model
from nondet_jax.models.common import Head
from tests.test_layerwise import H1, H2, ConvZoo, _assert_same_stats, _setup


def _train_loss(model):
    def loss(params, stats, xb, yb, dkeys):
        v = {"params": params, "batch_stats": stats} if stats else {"params": params}
        logits, upd = model.apply(v, xb, train=True, dropout_keys=dkeys, mutable=["batch_stats"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean(), (logits, upd)
    return loss


def _tangent(params):
    return jax.tree.map(lambda a: jnp.cos(jnp.arange(a.size, dtype=a.dtype)).reshape(a.shape), params)


@pytest.mark.parametrize("model, shape, dropout, chunk", [
    (ConvZoo(), (9, 8, 2), False, 4),
    (ConvZoo(dropout=0.5), (9, 8, 2), True, 12),
    (make_model("resnet8", 3, width=0.25, dropout=0.3), (8, 8, 1), True, 5),
])
def test_contributions_sum_to_the_batch_gradient_with_batchnorm_in_training_mode(model, shape, dropout, chunk):
    with jax.enable_x64(True):
        params, stats, (x, y, dk) = _setup(model, 12, shape, dropout)
        loss_fn = _train_loss(model)
        tangent = _tangent(params)

        def run(p):
            (loss, aux), grads, tape = train_pass_grad(loss_fn, p, stats, x, y, dk)
            st, proj = layerwise.tape_stats(tape, p, chunk, grad_sq=True, hist1d=H1, hist2d=H2,
                                            tangents=(grads, tangent))
            return loss, grads, tape.losses, st, proj, layerwise.tape_projections(tape, (grads, tangent))

        loss, grads, losses, st, proj, ghost = jax.jit(run)(params)
        (ref_loss, _), ref_grads = jax.value_and_grad(loss_fn, has_aux=True)(params, stats, x, y, dk)
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-14)
        np.testing.assert_allclose(losses.mean(), loss, rtol=1e-13)  # training-mode per-example losses
        for g, r, s in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), jax.tree.leaves(st.sum_grad)):
            np.testing.assert_allclose(g, r, rtol=1e-12, atol=1e-15)  # the recorded pass is the training gradient
            np.testing.assert_allclose(s / 12, r, rtol=1e-10, atol=1e-14)  # contributions sum to it
        np.testing.assert_allclose(proj, ghost, rtol=1e-10, atol=1e-13)  # projections without forming g_i
        g_flat = np.concatenate([np.ravel(a) for a in jax.tree.leaves(grads)])
        t_flat = np.concatenate([np.ravel(a) for a in jax.tree.leaves(tangent)])
        np.testing.assert_allclose(proj.sum(1), [12 * g_flat @ g_flat, 12 * g_flat @ t_flat], rtol=1e-10)


class TinyBN(nn.Module):
    """Dense -> BatchNorm (training mode) -> tanh -> Dense: small enough for per-example weight copies."""

    num_classes: int = 3
    dropout: float = 0.0
    bn_momentum: float = 0.9

    @nn.compact
    def __call__(self, x, train: bool = False, dropout_keys=None):
        h = nn.Dense(5, name="d1")(x.reshape(x.shape[0], -1))
        h = jnp.tanh(nn.BatchNorm(use_running_average=not train, momentum=self.bn_momentum, name="bn")(h))
        return nn.Dense(self.num_classes, name="d2")(h)


def test_contributions_are_gradients_with_respect_to_per_example_weight_copies():
    """Brute force: give every example its own copy of the weights (the batch statistics still mix
    all examples); the gradient with respect to copy i, at copies equal to the weights, is example
    i's contribution. Checks every contribution, not only their sum."""
    with jax.enable_x64(True):
        model = TinyBN()
        params, stats, (x, y, _) = _setup(model, 8, (2, 3, 1))
        b = 8

        def loss_of_copies(copies):  # flax's BatchNorm by hand, weights per example
            xf = x.reshape(b, -1)
            h = jnp.einsum("bi,bio->bo", xf, copies["d1"]["kernel"]) + copies["d1"]["bias"]
            mean = h.mean(0)
            var = jnp.maximum((h * h).mean(0) - mean * mean, 0)
            h = jnp.tanh((h - mean) * jax.lax.rsqrt(var + 1e-5) * copies["bn"]["scale"] + copies["bn"]["bias"])
            logits = jnp.einsum("bi,bio->bo", h, copies["d2"]["kernel"]) + copies["d2"]["bias"]
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).sum()

        copies = jax.tree.map(lambda a: jnp.broadcast_to(a, (b,) + a.shape), params)
        brute = jax.grad(loss_of_copies)(copies)  # (B, ...) per leaf: the contributions

        def run(p):
            _, _, tape = train_pass_grad(_train_loss(model), p, stats, x, y, None)
            recs = [tape.records[k] for k in tape.paths]
            ds = [tape.deltas[k] for k in tape.paths]
            return layerwise._example_grads(tape, recs, ds, {k: layerwise._layer_params(p, k) for k in tape.paths}, p)

        mine = run(params)
        for a, r in zip(jax.tree.leaves(mine), jax.tree.leaves(brute)):
            np.testing.assert_allclose(a, r, rtol=1e-9, atol=1e-13)


class ConvNoBN(nn.Module):
    num_classes: int = 3
    dropout: float = 0.0

    @nn.compact
    def __call__(self, x, train: bool = False, dropout_keys=None):
        y = nn.relu(nn.Conv(4, (3, 3), strides=2, padding="SAME")(x))
        y = nn.relu(nn.Conv(6, (3, 3), padding="SAME", feature_group_count=2, use_bias=False)(y))
        logits, _ = Head(self.num_classes, self.dropout, name="head")(jnp.mean(y, axis=(1, 2)), train, dropout_keys)
        return logits


@pytest.mark.parametrize("model, shape, dropout", [(ConvNoBN(dropout=0.5), (9, 8, 2), True),
                                                   (MLP(3, hidden=5), (4, 3, 1), False)])
def test_without_batchnorm_contributions_are_vmap_grad_per_example_gradients(model, shape, dropout):
    with jax.enable_x64(True):
        params, stats, batch = _setup(model, 12, shape, dropout)
        example_loss, _ = model_losses(model)
        kw = dict(grad_sq=True, hist1d=H1, hist2d=H2)
        slow = per_example.per_example_pass(example_loss, params, batch, stats, 4, **kw)
        _, _, tape = train_pass_grad(_train_loss(model), params, stats, *batch)
        fast, _ = layerwise.tape_stats(tape, params, 4, **kw)
        _assert_same_stats(fast, slow)


def test_instruments_in_both_modes_agree_without_batchnorm_and_train_pass_needs_no_second_pass():
    """The trainer adaptor (economy + GSNR) on a model without BatchNorm: train_pass and frozen_bn give
    the same values (the same per-example gradients, float64), and in train_pass mode the update
    runs no forward pass of its own (the tape is all it reads)."""
    with jax.enable_x64(True):
        model = ConvNoBN(dropout=0.5)
        params, stats, (x, y, dk) = _setup(model, 12, (9, 8, 2), True)
        loss_fn = _train_loss(model)
        upd = jax.tree.map(lambda a: 1e-3 * jnp.ones_like(a), params)
        out = {}
        for mode in ("train_pass", "frozen_bn"):
            cfg = from_flat({"instruments.config": "economy,MeanGSNR", "instruments.chunk": 4,
                             "instruments.per_example": mode}).instruments
            inst = for_model(cfg, model, loss_fn, lambda p, s, xb: s, total_steps=10)
            assert (inst.value_grad_and_tape is not None) == (mode == "train_pass")

            def step(s, p):
                if inst.value_grad_and_tape is not None:
                    (loss, _), grads, tape = inst.value_grad_and_tape(p, stats, x, y, dk)
                else:
                    (loss, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(p, stats, x, y, dk)
                    tape = None
                st, v1 = inst.update(s, p, (x, y, dk), step=0, context=stats, updates=upd, lr=0.1, grads=grads,
                                     loss=loss, tape=tape)
                return inst.update(st, p, (x, y, dk), step=1, context=stats, updates=upd, lr=0.1, grads=grads,
                                   loss=loss, tape=tape)[1] | {k + "@0": v for k, v in v1.items()}

            out[mode] = jax.jit(step)(inst.init(params), params)
            if mode == "train_pass":  # the update adds no convolution to the recorded training pass
                def taped(p, with_update):
                    (loss, _), grads, tape = inst.value_grad_and_tape(p, stats, x, y, dk)
                    if not with_update:
                        return grads
                    return inst.update(inst.init(p), p, (x, y, dk), step=0, context=stats, updates=upd, lr=0.1,
                                       grads=grads, loss=loss, tape=tape)
                convs = [str(jax.make_jaxpr(lambda p: taped(p, w))(params)).count("conv_general_dilated")
                         for w in (False, True)]
                assert convs[0] > 0 and convs[1] == convs[0]
        for k in out["train_pass"]:
            np.testing.assert_allclose(out["train_pass"][k], out["frozen_bn"][k], rtol=1e-9, atol=1e-12, err_msg=k)
        assert np.isfinite(out["train_pass"]["Alpha"]) and np.isfinite(out["train_pass"]["NormTest@0"])


def test_unsupported_model_falls_back_to_a_plain_gradient_and_no_tape():
    from tests.test_layerwise import WithLayerNorm

    with jax.enable_x64(True):
        model = WithLayerNorm()
        params, stats, (x, y, _) = _setup(model, 6, (3, 3, 2))
        loss_fn = _train_loss(model)
        with pytest.warns(layerwise.SlowerPath, match="LayerNorm"):  # said, not silent
            (loss, _), grads, tape = train_pass_grad(loss_fn, params, stats, x, y, None)
        assert tape is None
        (ref, _), ref_grads = jax.value_and_grad(loss_fn, has_aux=True)(params, stats, x, y, None)
        assert loss == ref
        for a, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
            np.testing.assert_array_equal(a, r)


@pytest.mark.parametrize("flat", [
    # every step of the 4-step epoch is read (Alpha reads the step after each tracked one): one measurement per step
    {"instruments.config": "economy,MeanGSNR", "instruments.every": 3, "train.batch_size": 64},
    # 16 steps, every 5th tracked: 8 steps read at most, so only those keep their tape (the sparse path);
    # epoch 1 starts with the step after epoch 0's last tracked one (Alpha's end point across epochs)
    {"instruments.config": "economy", "instruments.every": 5, "train.batch_size": 16},
    # the logarithmic schedule: its tracked steps are listed, not a residue class
    {"instruments.config": "Alpha,NormTest,GradNorm", "instruments.schedule": "log", "instruments.log_points": 6,
     "train.batch_size": 16},
])
def test_unrolled_epoch_measures_after_its_steps_with_the_same_values(small_digits, flat):
    """On CPU a short epoch is unrolled and, in train_pass mode without curvature, its instruments run
    after the steps in one rolled scan (only over the steps the schedule reads when that is fewer than
    the epoch's): the values equal those of the steps run one by one, over two epochs."""
    from nondet_jax.data.pipeline import epoch_indices
    from nondet_jax.train import make_train
    from tests.conftest import one_replica, spec_of, tiny_config

    config = tiny_config(**{"model.dropout": 0.2, **flat})
    fns = make_train(config, spec_of(small_digits))
    assert fns.unroll == fns.steps_per_epoch > 1
    keys, perturb = one_replica("init", 1)
    x, y = jnp.asarray(small_digits.x_train), jnp.asarray(small_digits.y_train)
    state0 = jax.jit(fns.init)(keys, perturb, x[:1])
    epoch = jax.jit(fns.train_epoch)
    step = jax.jit(fns.train_step)
    by_epoch, by_step = state0, state0
    for e in range(2):
        by_epoch, m = epoch(by_epoch, x, y, keys, perturb, e)
        idx = epoch_indices(keys.data_order, e, len(small_digits.x_train), fns.batch_size)
        rows = []
        for i in range(fns.steps_per_epoch):
            by_step, out = step(by_step, x, y, keys, perturb, e, i, idx[i])
            rows.append(out)
        tracked = np.array([r[3] for r in rows])
        np.testing.assert_array_equal(m["tracked"], tracked)
        assert 0 < tracked.sum() < len(tracked) or flat.get("instruments.every") == 3
        for k, v in m["instruments"].items():
            np.testing.assert_allclose(v, np.stack([r[2][k] for r in rows]), rtol=2e-4, atol=1e-6,
                                       err_msg=f"{k}, epoch {e}")
        for a, b in zip(jax.tree.leaves(by_epoch.params), jax.tree.leaves(by_step.params)):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_most_in_epoch_bounds_the_steps_a_schedule_reads():
    """The bound the sparse deferred epoch sizes its tape buffer by holds for every epoch (brute force)."""
    from nondet_jax.instruments.schedules import linear, log_over_run, most_in_epoch

    for which, sched in enumerate([linear(1), linear(5), linear(16), linear(3, 2), log_over_run(200, 20)]):
        for steps in [1, 4, 11, 16, 23]:
            for with_next in [False, True]:
                g = np.arange(200 + steps)
                t = np.asarray(jax.vmap(sched)(jnp.asarray(g)))
                read = t | np.concatenate([[False], t[:-1]]) if with_next else t
                per_epoch = [read[e * steps:(e + 1) * steps].sum() for e in range(200 // steps)]
                bound = most_in_epoch(sched, steps, with_next)
                assert max(per_epoch) <= bound <= steps, (which, steps, with_next)
