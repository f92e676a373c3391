"""Which XLA:CPU path a convolution takes, and what it costs: two cases behind choices in the models' convolution.

* ``swap``: a 3x3 SAME convolution of a 2x2 map (ResNet-8's last stage on the 8x8 digits, 64 channels). XLA's
  simplifier runs lax's convolution with its operands swapped (the kernel larger than the input); the models'
  convolution (``nondet_jax.models.common.conv_general_dilated``) pads the input first so that it is not
  (``convs.swapped_by_xla``).
* ``channels``: a 3x3 SAME convolution of a 32x32 map with 16 channels (ResNet-14's first stage). XLA:CPU gives
  convolutions with at most 16 channels to Eigen, not YNNPACK; a 17th (zero) output channel, sliced off, sends it
  to YNNPACK.

Each variant: forward alone, and the gradients with respect to both operands (``jax.grad`` of a sum of squares),
jitted, best of ``--repeats`` timed calls after a warm-up; the compiled program says which path ran (a swapped
convolution, forward or gradient: ``rhs_reversal``; the forward in YNNPACK: ``ynn_fusion``). Run it on one core for per-core costs::

    taskset -c 0 python benchmarks/conv_paths.py        # benchmarks/results/conv_paths.json
    python benchmarks/conv_paths.py --quick            # batch 8, 2 repeats (a smoke run)
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--quick", action="store_true", help="batch 8, 2 repeats")
    p.add_argument("--out", type=Path, default=RESULTS / "conv_paths.json")
    args = p.parse_args(argv)
    if args.quick:
        args.batch, args.repeats = 8, 2
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax

    from nondet_jax.models.common import conv_general_dilated

    rng = np.random.default_rng(0)
    dn = ("NHWC", "HWIO", "NHWC")

    def lax_conv(x, w):
        return lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=dn)

    def models_conv(x, w):
        return conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=dn)

    def seventeen(x, w):  # a zero 17th output channel, sliced off: the same values
        wide = jnp.pad(w, ((0, 0), (0, 0), (0, 0), (0, 1)))
        return lax_conv(x, wide)[..., : w.shape[-1]]

    cases = {
        "swap": ((args.batch, 2, 2, 64), (3, 3, 64, 64), {"lax (XLA swaps it)": lax_conv,
                                                           "models' convolution (padded first)": models_conv}),
        "channels": ((args.batch, 32, 32, 16), (3, 3, 16, 16), {"16 channels (Eigen)": lax_conv,
                                                                 "17th zero channel (YNNPACK)": seventeen}),
    }

    def best(fn, *a):
        jax.block_until_ready(fn(*a))
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            jax.block_until_ready(fn(*a))
            times.append(time.perf_counter() - t)
        return 1e3 * min(times)

    rows = []
    for case, (xs, ws, variants) in cases.items():
        x = jnp.asarray(rng.standard_normal(xs, dtype=np.float32))
        w = jnp.asarray(rng.standard_normal(ws, dtype=np.float32) / np.sqrt(9 * ws[2]))
        reference = None
        for name, conv in variants.items():
            fwd = jax.jit(conv)
            grad = jax.jit(jax.grad(lambda a, b, c=conv: jnp.sum(c(a, b) ** 2), argnums=(0, 1)))
            forward_text = fwd.lower(x, w).compile().as_text()
            text = forward_text + grad.lower(x, w).compile().as_text()
            lines = [ln for ln in text.splitlines() if " convolution(" in ln]
            value = np.asarray(fwd(x, w))
            reference = value if reference is None else reference
            rows.append({"case": case, "variant": name, "forward_ms": best(fwd, x, w), "gradients_ms": best(grad, x, w),
                         "swapped_convolutions": sum("rhs_reversal" in ln for ln in lines),
                         "forward_ynnpack": "ynn_fusion" in forward_text,
                         "max_abs_difference": float(np.abs(value - reference).max())})
    print(f"{'case':<9} {'variant':<36} {'forward ms':>10} {'gradients ms':>12} {'swapped':>7} {'YNNPACK':>7}")
    for r in rows:
        print(f"{r['case']:<9} {r['variant']:<36} {r['forward_ms']:>10.2f} {r['gradients_ms']:>12.2f} "
              f"{r['swapped_convolutions']:>7} {str(r['forward_ynnpack']):>7}")
    out = {"batch": args.batch, "repeats": args.repeats, "cores": len(os.sched_getaffinity(0)),
           "jax": jax.__version__, "load_average": os.getloadavg(), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
