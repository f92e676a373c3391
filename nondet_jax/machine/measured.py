"""The measured tables the library's automatic choices read (``measured.json`` beside this file):
which formulation a replica-batched convolution uses (:mod:`nondet_jax.models.convs`), from how many
replicas ``auto`` batches them on a GPU (:func:`nondet_jax.replicas.choice.resolve_strategy`), and which
XLA:CPU flags the CLI sets per CPU type (:mod:`nondet_jax.machine.xla_flags`). Every entry names the
benchmark result it rests on; the benchmarks in ``benchmarks/`` rewrite them."""

from __future__ import annotations

import functools
import json
from pathlib import Path

PATH = Path(__file__).with_name("measured.json")
GPU_BACKENDS = ("gpu", "cuda", "rocm")


@functools.lru_cache(maxsize=None)
def tables() -> dict:
    """The whole file, parsed once per process."""
    return json.loads(PATH.read_text())


def _backend_key(backend: str) -> str:
    return "gpu" if backend in GPU_BACKENDS else backend


def vmap_conv_table(backend: str) -> dict:
    """The conv-formulation table of ``backend`` ({} when unmeasured): ``choices`` plus its ``source``."""
    return tables()["vmap_conv"].get(_backend_key(backend), {})


def vmap_conv_choices(backend: str) -> dict[str, str]:
    """Shape family (``role/kernel/stride/channels`` or a prefix of it) -> formulation, for ``backend``."""
    return vmap_conv_table(backend).get("choices", {})


def strategy_rule(backend: str) -> dict:
    """The measured strategy rule of ``backend``: ``vmap_min_replicas`` (None: never vmap) and its ``source``."""
    return tables()["strategy"].get(_backend_key(backend), {})


def xla_cpu_rule(cpu_type: str) -> dict:
    """The XLA:CPU flags measured faster and bitwise repeatable on ``cpu_type`` ({} when unmeasured)."""
    return tables()["xla_cpu"].get(cpu_type, {})
