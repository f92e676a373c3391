"""Test-time augmentation: every view is exactly the shift/flip it claims, and logits are averaged."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import one_replica, spec_of, tiny_config

from nondet_jax.analysis.tta import apply_view, stack_views, tta_logits, view_grid
from nondet_jax.errors import UsageError
from nondet_jax.train import make_train

# A hand-made batch: 2 non-square images (5 x 7, so swapped axes show), 2 channels, no zeros.
IMG = (np.arange(2 * 5 * 7 * 2, dtype=np.float32).reshape(2, 5, 7, 2) + 1)


def reference_view(x, flip, dy, dx, p):
    padded = np.pad(x, ((0, 0), (p, p), (p, p), (0, 0)))
    out = padded[:, p + dy:p + dy + x.shape[1], p + dx:p + dx + x.shape[2]]
    return out[:, :, ::-1] if flip else out


@pytest.mark.parametrize("name,padding,count,offsets", [
    ("none", 4, 1, {0}),
    ("flip", 4, 2, {0}),
    ("crop5", 4, 25, {-4, -2, 0, 2, 4}),
    ("crop9", 4, 81, set(range(-4, 5))),
    ("flip+crop5", 4, 50, {-4, -2, 0, 2, 4}),
    ("flip+crop9", 4, 162, set(range(-4, 5))),
    ("crop3", 1, 9, {-1, 0, 1}),
    ("flip+crop5", 2, 50, {-2, -1, 0, 1, 2}),
])
def test_view_grids(name, padding, count, offsets):
    v = view_grid(name, padding)
    assert v.shape == (count, 3) and v.dtype == np.int32
    assert len({tuple(r) for r in v}) == count  # no view twice
    assert set(v[:, 1]) == offsets and set(v[:, 2]) == offsets
    assert set(v[:, 0]) == ({0, 1} if name.startswith("flip") else {0})
    assert (0, 0, 0) in {tuple(r) for r in v}  # the image itself is always one of the views


@pytest.mark.parametrize("name,padding", [("flip", 2), ("crop5", 2), ("flip+crop5", 2), ("crop9", 4),
                                          ("flip+crop9", 4)])
def test_each_view_is_exactly_the_shift_and_flip_it_claims(name, padding):
    views = view_grid(name, padding)
    stacked = np.asarray(jax.jit(stack_views, static_argnums=2)(jnp.asarray(IMG), views, padding))
    assert stacked.shape == (len(views),) + IMG.shape
    for (flip, dy, dx), got in zip(views, stacked):
        np.testing.assert_array_equal(got, reference_view(IMG, flip, dy, dx, padding))


def test_views_by_hand():
    x = jnp.asarray(IMG)
    down = np.asarray(apply_view(x, jnp.array([0, 1, 0]), 2))  # dy = +1: view[i] = x[i + 1]
    np.testing.assert_array_equal(down[:, :4], IMG[:, 1:])
    assert (down[:, 4] == 0).all()
    left = np.asarray(apply_view(x, jnp.array([0, 0, -2]), 2))  # dx = -2: view[:, j] = x[:, j - 2]
    np.testing.assert_array_equal(left[:, :, 2:], IMG[:, :, :5])
    assert (left[:, :, :2] == 0).all()
    mirrored = np.asarray(apply_view(x, jnp.array([1, 0, 0]), 2))
    np.testing.assert_array_equal(mirrored, IMG[:, :, ::-1])
    np.testing.assert_array_equal(np.asarray(apply_view(x, jnp.array([0, 0, 0]), 2)), IMG)


@pytest.mark.parametrize("name,padding,match", [
    ("crop5", 1, "crop padding 1 gives 3"),
    ("crop4", 4, "odd grid size"),
    ("blur", 4, "unknown test-time augmentation"),
])
def test_bad_view_sets_are_refused(name, padding, match):
    with pytest.raises(UsageError, match=match):
        view_grid(name, padding)


def test_tta_logits_average_a_linear_model_over_views():
    rng = np.random.default_rng(0)
    w = rng.normal(size=(5 * 7 * 2, 3)).astype(np.float32)
    evaluate = lambda state, x: (x.reshape(len(x), -1) @ state, None)  # noqa: E731
    views = view_grid("flip+crop5", 2)
    got = np.asarray(jax.jit(tta_logits, static_argnums=(0, 4))(evaluate, jnp.asarray(w), jnp.asarray(IMG), views, 2))
    ref = np.mean([reference_view(IMG, *v, 2).reshape(2, -1) @ w for v in views], axis=0)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-4)
    plain = np.asarray(tta_logits(evaluate, jnp.asarray(w), jnp.asarray(IMG), view_grid("none", 2), 2))
    np.testing.assert_array_equal(plain, np.asarray(evaluate(jnp.asarray(w), jnp.asarray(IMG))[0]))  # 1 view: itself


def test_tta_logits_with_the_trainers_evaluate(small_digits):
    config = tiny_config(**{"model.name": "resnet8", "model.width": 0.5, "train.eval_batch_size": 40})
    fns = make_train(config, spec_of(small_digits))
    state = fns.init(*one_replica("init", 1), jnp.asarray(small_digits.x_train[:1]))
    x = jnp.asarray(small_digits.x_test[:60])
    views = view_grid("flip+crop3", 1)
    got = np.asarray(jax.jit(lambda s, x: tta_logits(fns.evaluate, s, x, views, 1))(state, x))
    per_view = [np.asarray(fns.evaluate(state, jnp.asarray(reference_view(np.asarray(x), *v, 1)))[0]) for v in views]
    assert got.shape == (60, 10)
    np.testing.assert_allclose(got, np.mean(per_view, axis=0), rtol=1e-4, atol=1e-5)
    assert not np.allclose(got, per_view[len(views) // 4])  # the average is not just the centre view
