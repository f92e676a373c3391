"""A 3x3 (any k) convolution written as matmuls, for the benchmarks that compare it with lax.conv:
k*k shifted (strided) slices of the SAME-padded input, one ``dot_general`` each (under ``vmap``
these become batched GEMMs instead of grouped convolutions)."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def matmul_conv(x, w, stride: int):
    """``x`` (N, H, W, C) NHWC, ``w`` (kh, kw, C, F): SAME convolution with ``stride``."""
    kh, kw = w.shape[:2]
    n, h, wd, c = x.shape
    s = stride
    ho, wo = -(-h // s), -(-wd // s)
    ph, pw = max((ho - 1) * s + kh - h, 0), max((wo - 1) * s + kw - wd, 0)
    xp = jnp.pad(x, ((0, 0), (ph // 2, ph - ph // 2), (pw // 2, pw - pw // 2), (0, 0)))
    out = None
    for i in range(kh):
        for j in range(kw):
            xs = lax.slice(xp, (0, i, j, 0), (n, i + (ho - 1) * s + 1, j + (wo - 1) * s + 1, c), (1, s, s, 1))
            y = lax.dot_general(xs, w[i, j], (((3,), (0,)), ((), ())))
            out = y if out is None else out + y
    return out


def kernel_conv(fn):
    """A Flax module class with ``nn.Conv``'s parameter (kernel HWIO, no bias) and constructor,
    computing ``fn(x, kernel, stride)`` instead: a drop-in for the conv ``models.common.conv_bn``
    returns, to benchmark other computations of the same layer."""
    import flax.linen as nn

    from nondet_jax.models.common import conv_init

    class KernelConv(nn.Module):
        features: int
        kernel_size: tuple
        strides: int = 1
        use_bias: bool = False
        kernel_init: object = conv_init

        @nn.compact
        def __call__(self, x):
            kh, kw = self.kernel_size
            w = self.param("kernel", self.kernel_init, (kh, kw, x.shape[-1], self.features), jnp.float32)
            return fn(x, w, self.strides if isinstance(self.strides, int) else self.strides[0])

    return KernelConv
