"""Test-time augmentation: evaluate each test image under fixed views and average the logits.

A view is (flip, dy, dx): shift the image by the offsets ``(dy, dx)`` within ``[-p, p]`` as
training's random crop does (zero padding by ``p``, then the ``H x W`` window whose corner is at
``(p + dy, p + dx)`` of the padded image, so ``view[i, j] = x[i + dy, j + dx]``, 0 outside), then
mirror it horizontally when ``flip``. Named view sets (Summers & Dinneen's TTA mitigation):

* ``none``: the image itself (1 view);
* ``flip``: the image and its mirror (2 views);
* ``cropK`` (K odd, e.g. ``crop5``, ``crop9``): a K x K grid of offsets
  ``rint(linspace(-p, p, K))`` in each direction (K² views; the centre is the image itself);
* ``flip+cropK``: every crop of the grid, unflipped and flipped (2K² views).

With CIFAR's padding p = 4, ``crop5`` shifts by -4, -2, 0, 2, 4 and ``crop9`` by every pixel in
[-4, 4]. A grid needs K <= 2p + 1 distinct offsets: on 8x8 digits (p = 1) use ``crop3``.

Example::

    views = view_grid("flip+crop5", padding=4)               # (50, 3) int32
    logits = jax.jit(lambda s, x: tta_logits(fns.evaluate, s, x, views, 4))(state, x_test)
"""

from __future__ import annotations

import re
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from nondet_jax.errors import UsageError
from nondet_jax.train import scan_unroll

VIEW_SETS = ("none", "flip", "crop5", "crop9", "flip+crop5", "flip+crop9")  # the usual ones; any odd K works
_PATTERN = re.compile(r"^(none|flip|crop(\d+)|flip\+crop(\d+))$")


def view_grid(name: str, padding: int) -> np.ndarray:
    """The views of a named set as an (V, 3) int32 array of rows (flip, dy, dx).

    Args:
      name: ``none``, ``flip``, ``cropK`` or ``flip+cropK`` (K odd, >= 3).
      padding: the crop padding p (training's: ``train.augmentation_settings(...)[2]``).
    Returns:
      Rows in a fixed order: unflipped before flipped, then dy, then dx ascending.
    """
    m = _PATTERN.match(name.strip())
    if not m:
        raise UsageError(f"unknown test-time augmentation '{name}'; use one of: {', '.join(VIEW_SETS)} "
                         "(or cropK / flip+cropK with K odd)")
    k = int(m.group(2) or m.group(3) or 1)
    flips = (0, 1) if name.startswith("flip") else (0,)
    if k > 1:
        if k % 2 == 0:
            raise UsageError(f"test-time augmentation '{name}' needs an odd grid size (the centre is the image "
                             f"itself); use crop{k + 1} or crop{k - 1}")
        if k > 2 * padding + 1:
            raise UsageError(f"test-time augmentation '{name}' needs {k} distinct offsets but crop padding {padding} "
                             f"gives {2 * padding + 1}; use crop{2 * padding + 1} or raise data.crop_padding")
    offsets = np.rint(np.linspace(-padding, padding, k)).astype(np.int32) if k > 1 else np.zeros(1, np.int32)
    rows = [(f, dy, dx) for f in flips for dy in offsets for dx in offsets]
    return np.asarray(rows, np.int32).reshape(-1, 3)


def apply_view(x: jax.Array, view: jax.Array, padding: int) -> jax.Array:
    """One view (flip, dy, dx) of a batch ``x`` (N, H, W, C): shift by (dy, dx) with zero fill, then
    mirror when flip. ``view`` may be traced (jittable, scannable); ``padding`` is static and
    bounds the offsets (|dy|, |dx| <= padding)."""
    n, h, w, c = x.shape
    view = jnp.asarray(view, jnp.int32)
    flip, dy, dx = view[0], view[1], view[2]
    if padding > 0:
        padded = jnp.pad(x, ((0, 0), (padding, padding), (padding, padding), (0, 0)))
        x = jax.lax.dynamic_slice(padded, (0, padding + dy, padding + dx, 0), (n, h, w, c))
    return jnp.where(flip > 0, x[:, :, ::-1, :], x)


def stack_views(x: jax.Array, views, padding: int) -> jax.Array:
    """All views of a batch, stacked: (V, N, H, W, C). For a small batch; :func:`tta_logits` never
    materialises more than one view of the data at a time."""
    return jax.vmap(apply_view, in_axes=(None, 0, None))(x, jnp.asarray(views, jnp.int32), padding)


def tta_logits(evaluate: Callable, state, x: jax.Array, views, padding: int) -> jax.Array:
    """Logits averaged over views: ``mean_v evaluate(state, view_v(x))[0]``.

    Args:
      evaluate: ``evaluate(state, x) -> (logits, features)`` (``TrainFns.evaluate``).
      state: the model state it takes.
      x: (N, H, W, C) images.
      views: (V, 3) array from :func:`view_grid`.
      padding: the crop padding the views were made with.
    Returns:
      (N, classes) float32 logits. Jittable; the views run one after another in a ``lax.scan``
      (a fixed summation order, so the result is deterministic), with one view of ``x`` in memory
      at a time on an accelerator. On the CPU a scan of at most 16 views is unrolled for speed
      (:func:`nondet_jax.train.scan_unroll`), and XLA may then hold several views at once.
    """
    views = jnp.asarray(views, jnp.int32)

    def body(total, view):
        logits, _ = evaluate(state, apply_view(x, view, padding))
        return total + logits.astype(jnp.float32), None


    out = jax.eval_shape(evaluate, state, x)[0]
    # Unrolled on CPU for short scans: XLA:CPU runs convolutions in a loop body on a slow path.
    total, _ = jax.lax.scan(body, jnp.zeros(out.shape, jnp.float32), views,
                            unroll=scan_unroll(0, views.shape[0]))
    return total / views.shape[0]
