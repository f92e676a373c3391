"""Tracking schedules: step -> bool, traceable (``step`` may be a traced integer; a Python integer
gives a Python bool, computed without the device).

Cockpit's two schedules (``cockpit/utils/schedules.py``): :func:`linear` tracks the steps
``{offset + n * interval | n >= 0}``; :func:`logarithmic` tracks ``int(base ** e)`` for ``steps``
exponents evenly spaced in ``[start, end]``, plus step 0 when ``init``.
"""

from __future__ import annotations

from typing import Callable

import jax.numpy as jnp
import numpy as np

Schedule = Callable[[jnp.ndarray], jnp.ndarray]


def linear(interval: int = 1, offset: int = 0) -> Schedule:
    """Track at ``offset, offset + interval, ...``."""
    if interval < 1 or offset < 0:
        raise ValueError(f"linear schedule needs interval >= 1 and offset >= 0, got {interval}, {offset}")

    def schedule(step):
        if isinstance(step, (int, np.integer)):  # read in Python (``update(track=...)``): no device work
            return bool(step >= offset and (step - offset) % interval == 0)
        shifted = jnp.asarray(step) - offset
        return (shifted >= 0) & (shifted % interval == 0)

    schedule.interval = interval  # most_in_epoch bounds the tracked steps of an epoch by it
    schedule.every_step = interval == 1 and offset == 0  # lets update skip the branch altogether
    return schedule


def logarithmic(start: float, end: float, steps: int = 300, base: float = 10, init: bool = True) -> Schedule:
    """Track at the integer parts of ``base ** linspace(start, end, steps)`` (and 0 if ``init``)."""
    if steps < 1:
        raise ValueError(f"logarithmic schedule needs steps >= 1, got {steps}")
    tracked = np.unique(np.floor(np.logspace(start, end, steps, base=base) + 1e-9).astype(np.int64))
    if init:
        tracked = np.union1d(tracked, [0])
    table = tracked.astype(np.int32)

    steps_set = frozenset(int(s) for s in table)

    def schedule(step):
        if isinstance(step, (int, np.integer)):  # read in Python: no device work
            return int(step) in steps_set
        return jnp.any(jnp.asarray(step) == jnp.asarray(table))

    schedule.tracked_steps = tuple(int(s) for s in table)
    return schedule


def log_over_run(total_steps: int, points: int = 50) -> Schedule:
    """A :func:`logarithmic` schedule covering steps ``0 .. total_steps - 1`` with ``points`` points."""
    return logarithmic(0.0, float(np.log10(max(total_steps - 1, 1))), points, 10, True)


def most_in_epoch(schedule: Schedule, steps: int, with_next: bool = False) -> int:
    """The most steps of one epoch (steps ``e * steps .. e * steps + steps - 1``) that ``schedule``
    tracks, counting with ``with_next`` also the step after each tracked one (Alpha's end point): an
    upper bound, ``steps`` when the schedule is not one of this module's."""
    per = 2 if with_next else 1
    if hasattr(schedule, "interval"):  # linear: at most ceil(steps / interval) of each residue
        return min(steps, per * -(-steps // schedule.interval))
    if hasattr(schedule, "tracked_steps"):
        t = np.asarray(schedule.tracked_steps, np.int64)
        needed = np.union1d(t, t + 1) if with_next else t
        return min(steps, int(np.bincount(needed // steps).max()))
    return steps
