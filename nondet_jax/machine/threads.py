"""Independent calls of compiled programs from several Python threads at once (XLA:CPU runs the programs one
thread dispatches one after another, so a small model leaves cores idle)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, Iterator


def in_threads(fn: Callable, items: Iterable, threads: int, first_alone: bool = True, name: str = "worker") -> Iterator:
    """``fn(item)`` for each item, yielded in order, from ``threads`` threads at once (one: a plain loop).
    ``first_alone``: the first item runs before the others start, so the programs ``fn`` compiles on its first call
    are compiled once, not by every thread at the same time. ``fn`` must give the same result whichever thread runs
    it (a compiled program on the same inputs does)."""
    items = list(items)
    alone = len(items) if threads <= 1 else min(len(items), int(first_alone))
    for item in items[:alone]:
        yield fn(item)
    if alone < len(items):
        with ThreadPoolExecutor(threads, thread_name_prefix=name) as pool:
            yield from pool.map(fn, items[alone:])
