"""One short training run for the audit: logits and weights to compare bitwise."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from nondet_jax.config import Config
from nondet_jax.data import load_data
from nondet_jax.errors import UsageError
from nondet_jax.machine.determinism import (
    DETERMINISM_ON,
    NONDETERMINISTIC_BACKENDS,
    tree_ulp_diff,
)
from nondet_jax.machine.quick import once
from nondet_jax.sources import arm_keys, arm_sources, perturbations, replica_slice
from nondet_jax.study.prepare import check_outputs, resolve_parts
from nondet_jax.study.provenance import environment
from nondet_jax.train import DataSpec, make_train


def audit_run(config: Config, steps: int, perturb: str | None = None) -> dict:
    """Train ``steps`` steps twice in this process and compare the results per tensor."""
    data = load_data(config.data)
    b = config.train.batch_size
    if steps * b > len(data.x_train):
        raise UsageError(f"{steps} steps of batch {b} need {steps * b} training examples, {data.name} has "
                         f"{len(data.x_train)}; use fewer --steps or a smaller --batch-size")
    x, y = jnp.asarray(data.x_train[: steps * b]), jnp.asarray(data.y_train[: steps * b])
    fns = make_train(config, DataSpec(steps * b, tuple(x.shape[1:]), data.num_classes, data.name),
                     resolve_parts(config))  # --model PACKAGE.MODULE:ATTR: the user's own model
    check_outputs(fns)
    init, epoch = once(fns.init), jax.jit(fns.train_epoch)

    def train(arm: str):
        varied = arm_sources(arm)
        keys, p = replica_slice(arm_keys(config.study.seed, varied, 1), 0), perturbations(varied)
        state, _ = epoch(init(keys, p, x), x, y, keys, p, jnp.int32(0))
        return jax.device_get({"params": state.params, "batch_stats": state.batch_stats})

    first, second = train("control"), train(perturb or "control")
    tensors = tree_ulp_diff(first, second)
    flags = os.environ.get("XLA_FLAGS", "")
    backend = jax.default_backend()
    declared = backend not in NONDETERMINISTIC_BACKENDS or all(f in flags.split() for f in DETERMINISM_ON)
    differ = sum(t["differ"] for t in tensors.values())
    env = environment()
    return {"xla_flags": flags, "backend": backend, "device_kind": env["device_kind"], "steps": steps,
            "perturb": perturb, "declared_deterministic": declared, "elements": sum(t["elements"] for t in tensors.values()),
            "differ": differ, "max_ulp": max(t["max_ulp"] for t in tensors.values()),
            "bitwise_identical": differ == 0, "tensors": tensors}
