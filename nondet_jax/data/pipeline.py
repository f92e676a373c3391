"""On-device batching for one replica: shuffling, augmentation and in-batch order, all jittable.

Every function takes the replica's key for its source and derives per-epoch or per-step keys with
``fold_in`` (the key rule, docs/metrics.md), so the whole epoch runs inside one ``lax.scan`` with no host work.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def epoch_indices(key: jax.Array, epoch, n: int, batch_size: int) -> jax.Array:
    """Example indices of one epoch as (steps, batch_size): a permutation keyed by
    ``fold_in(key, epoch)``, the last incomplete batch dropped."""
    steps = n // batch_size
    perm = jax.random.permutation(jax.random.fold_in(key, epoch), n)
    return perm[: steps * batch_size].reshape(steps, batch_size)


def default_crop_padding(image_size: int) -> int:
    """4 pixels for 32x32 images (the CIFAR standard), scaled down for smaller ones (1 for 8x8)."""
    return max(1, round(4 * image_size / 32))


def augment(x: jax.Array, key: jax.Array, padding: int, flip: bool = True) -> jax.Array:
    """Random crop after zero padding, and a random horizontal flip, one draw per example.

    Example i of the batch uses ``fold_in(key, i)``: its draw depends on its position in the
    batch as sampled, not on any later reordering.
    """
    b, h, w, _ = x.shape
    keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, jnp.arange(b))

    def one(img, k):
        k_crop, k_flip = jax.random.split(k)
        if padding > 0:
            padded = jnp.pad(img, ((padding, padding), (padding, padding), (0, 0)))
            dy, dx = jax.random.randint(k_crop, (2,), 0, 2 * padding + 1)
            img = jax.lax.dynamic_slice(padded, (dy, dx, 0), img.shape)
        if flip:
            img = jnp.where(jax.random.bernoulli(k_flip), img[:, ::-1, :], img)
        return img

    return jax.vmap(one)(x, keys)


def batch_permutation(key: jax.Array, step, batch_size: int) -> jax.Array:
    """The ``batch_order`` permutation of one minibatch (keyed by the global step)."""
    return jax.random.permutation(jax.random.fold_in(key, step), batch_size)
