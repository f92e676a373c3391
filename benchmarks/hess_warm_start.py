"""HessMaxEV's Lanczos: Hessian-vector products to a tolerance, warm start against cold, and how far the
reported residual is from the true error.

A small tanh MLP in float64 (6 -> 7 -> 3, batch 16; the model of tests/test_instruments.py) trained by
plain SGD for ``--steps`` steps. At every step ``curvature.lanczos_top`` runs twice to each tolerance:
warm (started from the previous step's Ritz vector at that tolerance) and cold (random start), and the
top eigenvalue is compared with ``numpy.linalg.eigvalsh`` of the dense Hessian.

    python benchmarks/hess_warm_start.py          # prints a table, writes benchmarks/results/hess_warm_start.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from nondet_jax.instruments import curvature


def example_loss(params, x, y):
    h = jnp.tanh(x @ params["layer1"]["w"] + params["layer1"]["b"])
    logits = h @ params["layer2"]["w"]
    return jax.nn.logsumexp(logits) - logits[y]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--tols", default="1e-3,1e-6")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "hess_warm_start.json")
    args = ap.parse_args()
    tols = [float(t) for t in args.tols.split(",")]
    jax.config.update("jax_enable_x64", True)
    k1, k2, kx, ky = jax.random.split(jax.random.key(2), 4)
    params = {"layer1": {"w": jax.random.normal(k1, (6, 7), jnp.float64) * 0.8, "b": jnp.full((7,), 0.1)},
              "layer2": {"w": jax.random.normal(k2, (7, 3), jnp.float64) * 0.8}}
    x, y = jax.random.normal(kx, (16, 6), jnp.float64), jax.random.randint(ky, (16,), 0, 3)

    def mean_loss(p):
        return jnp.mean(jax.vmap(example_loss, (None, 0, 0))(p, x, y))

    flat0, unravel = ravel_pytree(params)
    dense = jax.jit(lambda f: jax.hessian(lambda g: mean_loss(unravel(g)))(f))

    def run(p, start, key, tol):
        hvp = curvature.hvp_operator(mean_loss, p)
        return curvature.lanczos_top(hvp, p, key, 60, start=start, tol=tol)

    run = jax.jit(run, static_argnums=3)
    rows = {t: {"warm": [], "cold": [], "error_over_residual": []} for t in tols}
    starts = {t: jnp.zeros_like(flat0) for t in tols}
    for s in range(args.steps):
        exact = float(np.linalg.eigvalsh(np.asarray(dense(ravel_pytree(params)[0])))[-1])
        for t in tols:
            key = jax.random.key(100 + s)
            warm, cold = run(params, starts[t], key, t), run(params, jnp.zeros_like(flat0), key, t)
            starts[t] = warm.vector
            if s > 0:  # step 0 has no previous vector: warm and cold are the same run
                rows[t]["warm"].append(int(warm.iters))
                rows[t]["cold"].append(int(cold.iters))
            for r in (warm, cold):
                rows[t]["error_over_residual"].append(abs(float(r.value) - exact) / abs(exact) / float(r.residual))
        params = jax.tree.map(lambda a, g: a - 0.05 * g, params, jax.grad(mean_loss)(params))
    out = {}
    print(f"{'tolerance':>10} {'warm HVPs':>10} {'cold HVPs':>10} {'max true error / residual':>26}")
    for t in tols:
        r = rows[t]
        out[str(t)] = {"warm_mean": float(np.mean(r["warm"])), "cold_mean": float(np.mean(r["cold"])),
                       "max_error_over_residual": float(np.max(r["error_over_residual"])), **r}
        print(f"{t:>10g} {out[str(t)]['warm_mean']:>10.1f} {out[str(t)]['cold_mean']:>10.1f} "
              f"{out[str(t)]['max_error_over_residual']:>26.2e}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"steps": args.steps, "model": "tanh MLP 6-7-3, batch 16, float64, SGD lr 0.05",
                                    "tolerances": out}, indent=2) + "\n")
    print(f"wrote {args.out} (steps 1..{args.steps - 1}; means over those steps)")


if __name__ == "__main__":
    main()
