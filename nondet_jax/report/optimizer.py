"""An optax transformation in readable form: what ``model.json`` and the report say about the optimiser.

The settings are read from the transformations' closures (optax keeps them there), the schedules
evaluated at a few steps. This is the part a reader can check; the study's identity rests on the
optimiser's computation (:mod:`nondet_jax.study.identity`), not on this description.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

_PLUMBING = ("chain", "named_chain", "with_extra_args_support", "init_empty_state", "identity")
_SCALAR = (bool, int, float, str, type(None))


def schedule_steps(total: int) -> list[int]:
    """Steps at which a schedule's value is recorded: start, quarters and the last step."""
    total = max(int(total), 1)
    return sorted({0, 1, total // 4, total // 2, (3 * total) // 4, total - 1} & set(range(total)))


@lru_cache(maxsize=64)
def _over_steps(fn):
    """``fn`` over a vector of steps, compiled once per schedule (describing the optimiser again compiles nothing)."""
    return jax.jit(jax.vmap(fn))


def _schedule_values(fn, steps: list[int]) -> dict[str, float] | None:
    """The schedule's values at ``steps``: one compiled program for all of them (evaluated step by step, every
    operation of the schedule compiled a program of its own), step by step where it cannot be traced."""
    at = np.asarray(steps, np.int32)
    try:
        values = np.asarray(_over_steps(fn)(at))
    except Exception:  # noqa: BLE001 - not traceable over a batch of steps: evaluate them one by one
        try:
            values = np.asarray([fn(jnp.asarray(s, jnp.int32)) for s in at])
        except Exception:  # noqa: BLE001 - not a schedule after all: leave it out of the record
            return None
    if values.shape != (len(steps),) or not np.issubdtype(values.dtype, np.number):  # e.g. multi_transform's labels
        return None
    return {str(s): float(v) for s, v in zip(steps, values)}


def describe_optimizer(tx, total_steps: int, _seen: set[int] | None = None) -> list[dict]:
    """The optax transformations of ``tx`` in the order they apply, each with its scalar settings
    and the values of its schedules at :func:`schedule_steps`, read from the functions' closures:
    ``[{"transform": "trace", "decay": 0.9, "nesterov": False}, {"transform": "scale_by_schedule",
    "step_size_fn": {"0": -0.0, ...}}]``; a wrapper's transformation nested (``{"transform": "masked", "inner":
    [{"transform": "scale", ...}], "mask": "bias_bn_mask"}``). A transformation that keeps its settings elsewhere
    shows its name only."""
    steps = schedule_steps(total_steps)
    out: list[dict] = []
    seen: set[int] = set() if _seen is None else _seen  # shared with a wrapper's nested description

    def closure(fn) -> dict:
        code = getattr(fn, "__code__", None)
        if code is None:
            return {}
        return {n: c.cell_contents for n, c in zip(code.co_freevars, fn.__closure__ or ()) if _filled(c)}

    def visit(fn, depth=0, init=None):
        if depth > 12 or id(fn) in seen:
            return
        seen.add(id(fn))
        if hasattr(fn, "update") and not hasattr(fn, "__code__"):  # a GradientTransformation
            visit(fn.update, depth + 1, getattr(fn, "init", None))
            return
        if not callable(fn) or getattr(fn, "__code__", None) is None:
            return
        # settings held in the state (inject_hyperparams' numeric ones) are in the init function's closure
        cells = {**closure(init), **closure(fn)}
        owner = fn.__qualname__.split(".<locals>")[0]
        if owner not in _PLUMBING and fn.__qualname__.endswith(("update_fn", "update")):
            entry: dict[str, Any] = {"transform": owner}
            for name, value in sorted(cells.items()):
                if value is None:
                    continue
                if isinstance(value, _SCALAR):
                    entry[name] = value
                elif isinstance(value, dict) and all(isinstance(v, _SCALAR) for v in value.values()):
                    entry.update({k: v for k, v in value.items() if v is not None})
                elif isinstance(value, dict) and all(callable(v) for v in value.values()):
                    for k, v in value.items():
                        values = _schedule_values(v, steps)
                        if values is not None:
                            entry[k] = values
                elif hasattr(value, "update") and hasattr(value, "init"):  # a wrapper's transformation (masked's)
                    entry[name] = describe_optimizer(value, total_steps, seen)
                elif callable(value) and not hasattr(value, "update"):
                    inner = getattr(value, "__name__", "")
                    if name in ("inner_factory", "mask"):
                        entry[name] = inner
                    else:
                        values = _schedule_values(value, steps)
                        if values is not None:
                            entry[name] = values
            out.append(entry)
            return
        # the update's own closure first: it holds the transformations in the order they apply (the init's, walked
        # first, reached a masked transformation's inner one before the transformations applied before it)
        for value in [*closure(fn).values(), *closure(init).values()]:
            for item in value if isinstance(value, (tuple, list)) else (value,):
                if callable(item) or hasattr(item, "update"):
                    visit(item, depth + 1)

    visit(tx)
    return out


def _filled(cell) -> bool:
    try:
        cell.cell_contents  # noqa: B018
        return True
    except ValueError:
        return False


def format_optimizer(transforms: list[dict]) -> str:
    """``trace(decay=0.9, nesterov=False) + scale_by_schedule(step_size_fn={step 0: -0, ...})``."""
    def value(v):
        if isinstance(v, dict):
            return "{" + ", ".join(f"step {s}: {x:.4g}" for s, x in v.items()) + "}"
        if isinstance(v, list):  # a wrapped transformation
            return format_optimizer(v)
        return f"{v:.6g}" if isinstance(v, float) else str(v)

    return " + ".join(t["transform"] + "(" + ", ".join(f"{k}={value(v)}" for k, v in t.items() if k != "transform")
                       + ")" for t in transforms) or "(no readable transformations)"
