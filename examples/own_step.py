"""The single-replica-functions level: your own ``init(keys)`` and ``step(state, batch, keys)``
(here a least-squares regression trained by minibatch SGD), R replicas per arm. nondet_jax hands
each replica its per-source keys and adds the replica axis. (``python examples/own_step.py``)"""

import jax
import jax.numpy as jnp
import numpy as np

import nondet_jax as nj

rng = np.random.default_rng(0)
X = rng.normal(size=(512, 8)).astype(np.float32)
w_true = rng.normal(size=8).astype(np.float32)
Y = X @ w_true + 0.5 * rng.normal(size=512).astype(np.float32)
STEPS, BATCH, LR = 200, 32, 0.05


def init(keys):  # keys.init differs between replicas only in arms that vary init
    return {"w": 0.1 * jax.random.normal(keys.init, (8,)), "b": jnp.zeros(())}


def step(state, batch, keys):  # keys are already folded with the step index
    idx = jax.random.choice(keys.data_order, X.shape[0], (BATCH,), replace=False)  # this step's minibatch
    x, y = jnp.asarray(X)[idx], jnp.asarray(Y)[idx]

    def loss(p):
        return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)

    grads = jax.grad(loss)(state)
    return jax.tree.map(lambda p, g: p - LR * g, state, grads)


states = nj.replicate(init, step, steps=STEPS, arms="control,init,data_order,all", replicas=6, seed=0)
for arm, s in states.items():  # every leaf has a leading replica axis
    w, b = np.asarray(s["w"]), np.asarray(s["b"])
    mse = np.array([np.mean((X @ w[r] + b[r] - Y) ** 2) for r in range(len(b))])
    print(f"{arm:<10} training MSE over 6 replicas: mean {mse.mean():.5f}, std {mse.std(ddof=1):.2e}")
