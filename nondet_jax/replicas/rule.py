"""Which strategy ``auto`` runs: the measured rule, light enough to ask before JAX is imported (the CLI picks the
CPU's flags by it)."""

from __future__ import annotations

from nondet_jax.machine import measured


def resolve_strategy(requested: str, replicas: int, backend: str | None = None, watched: bool = False) -> tuple[str, str]:
    """Pick the strategy for ``auto``; returns (strategy, reason), the reason naming the measurement.

    Rule: one replica runs ``sequential``; several accelerators run ``sharded`` (replicas over the
    devices, vmapped on each) unless the study is ``watched`` (``study.dynamics_every``: replicas watched between
    steps, which ``sharded``'s one-program epochs do not allow); otherwise the backend's measured rule in ``measured.json``
    (:func:`nondet_jax.machine.measured.strategy_rule`): ``vmap`` from ``vmap_min_replicas`` replicas on,
    ``sequential`` below it or when it is null (CPU: a vmapped ResNet step cost several times the
    loop, benchmarks/replicas.py and benchmarks/peer_pytorch.py; one GPU: vmap from 16 replicas on,
    from benchmarks/replica_speed.py on an H200, where ResNet-14 bfloat16 at batch 128 and R=16 gave
    2.45x a real loop under the determinism flags, and benchmarks/gpu_bench.py, 0.73x at R=4 in
    float32). A backend without a rule (TPU: not measured here) runs ``vmap``.
    """
    if requested != "auto":
        return requested, "requested"
    if replicas == 1:
        return "sequential", "auto: one replica"
    if backend != "cpu":  # JAX imported here: the CLI resolves for the CPU before JAX starts, importing none
        import jax

        backend = backend or jax.default_backend()
        if backend != "cpu" and jax.local_device_count() > 1 and not watched:
            return "sharded", f"auto: replicas over {jax.local_device_count()} {backend} devices, vmapped on each"
    rule = measured.strategy_rule(backend)
    if not rule:
        return "vmap", f"auto: {backend} batches replicas with vmap (no measured rule for {backend})"
    least = rule.get("vmap_min_replicas")
    if least is None or replicas < least:
        below = "never beat" if least is None else f"did not beat below {least} replicas"
        return "sequential", f"auto: on {backend} vmap {below} a loop ({rule['source']})"
    return "vmap", f"auto: on {backend} vmap beat a loop from {least} replicas on ({rule['source']})"


def resolve_study(study, replicas: int | None = None) -> tuple[str, str]:
    """:func:`resolve_strategy` for a study's settings (a :class:`nondet_jax.config.StudyConfig`): its strategy, its
    replicas (or ``replicas`` trained at once: a block, several methods' together) and whether it watches replicas
    between steps (``study.dynamics_every``)."""
    return resolve_strategy(study.strategy, study.replicas if replicas is None else replicas,
                            watched=bool(study.dynamics_every))

