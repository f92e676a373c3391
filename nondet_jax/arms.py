"""The arm grammar: the named randomness sources, their stable stream indices, and what an arm name means.

No JAX here: a command checks ``--arms`` and a config's ``study.arms`` before it starts JAX (the key rule that
turns these names into PRNG keys is :mod:`nondet_jax.sources`, which re-exports everything below).

``control`` varies nothing, ``all`` every seeded source, a source name only that source, ``a+b`` the union of
its parts, and ``arm@snapshotK`` the same arm under a snapshot schedule of K cycles::

    parse_arm("init+data_order").varied  # frozenset({'init', 'data_order'})
"""

from __future__ import annotations

import difflib
import hashlib
from typing import NamedTuple

from nondet_jax.errors import UsageError

# Stable small integers: never reorder or reuse, or every stored study changes meaning.
SOURCE_ID = {
    "init": 1,
    "data_order": 2,
    "augmentation": 3,
    "dropout": 4,
    "bitflip": 5,
    "batch_order": 6,
    "hardware": 7,
}
SOURCES = tuple(SOURCE_ID)
RESERVED = ("control", "all", "step", "varies")  # names a source of your own cannot take


def source_id(name: str) -> int:
    """The stream index of a source: :data:`SOURCE_ID` for the built-in ones; for a source of your own
    (:func:`nondet_jax.replicate`'s ``sources=``) ``2**31 + the first 31 bits of
    sha256("nondet_jax source:" + name)``: stable, the same in every version and process, and never a
    built-in one's."""
    if name in SOURCE_ID:
        return SOURCE_ID[name]
    digest = hashlib.sha256(f"nondet_jax source:{name}".encode()).digest()
    return (1 << 31) + (int.from_bytes(digest[:4], "big") & 0x7FFFFFFF)


def check_own_sources(names) -> tuple[str, ...]:
    """Your own source names as a tuple; UsageError for a name that is not an identifier, repeats, or
    is a built-in source or reserved."""
    names = (names,) if isinstance(names, str) else tuple(names)
    for n in names:
        if not isinstance(n, str) or not n.isidentifier() or n.startswith("_"):
            raise UsageError(f"source name {n!r} is not a Python identifier without a leading underscore; name your "
                             "sources like env or policy")
        if n in SOURCE_ID or n in RESERVED:
            raise UsageError(f"source name '{n}' is taken ({'a built-in source' if n in SOURCE_ID else 'reserved'}); "
                             "choose another name for your own source")
    if len(set(names)) != len(names):
        raise UsageError(f"source '{next(n for n in names if names.count(n) > 1)}' is named twice in sources")
    return names
IMPLEMENTED = ("init", "data_order", "augmentation", "dropout", "bitflip", "batch_order")
PERTURBATIONS = ("bitflip", "batch_order")


class Arm(NamedTuple):
    """An arm parsed once: its name as the user wrote it, the sources it varies, and the snapshot
    cycles of an ``arm@snapshotK`` variant (0 for a plain arm)."""

    name: str
    varied: frozenset[str]
    cycles: int = 0

    @property
    def base(self) -> str:
        """The plain arm this one is a variant of (itself when plain): ``'init@snapshot3'`` -> ``'init'``."""
        return self.name.partition("@")[0]


def parse_arm(name: str, own: tuple[str, ...] = ()) -> Arm:
    """Parse an arm name into an :class:`Arm`; UsageError naming the fix for unknown names.

    ``control`` varies nothing, ``all`` every seeded source (not ``hardware``), a source name only
    that source, and ``a+b`` the union of its parts (``all+hardware`` for everything). A variant
    suffix ``@snapshotK`` (K >= 2) trains the same arm under the snapshot schedule of K cycles (a
    mitigation, compared with the plain arm at equal training cost); it changes no source. ``own``:
    sources of your own (:func:`nondet_jax.replicate`), which arms may name, and ``all`` varies too.
    """
    base, _, variant = name.partition("@")
    cycles = 0
    if variant:
        k = variant.removeprefix("snapshot")
        if not variant.startswith("snapshot") or not (k.isascii() and k.isdigit()) or int(k) < 2:
            raise UsageError(f"unknown arm variant '@{variant}' in '{name}'; the one variant is @snapshotK with K >= 2 "
                             "cycles, e.g. init@snapshot3")
        cycles = int(k)
    varied: set[str] = set()
    if base != "control":
        for p in base.split("+"):
            if p == "all":
                varied.update(IMPLEMENTED + tuple(own))
            elif p in SOURCES or p in own:
                varied.add(p)
            else:
                close = difflib.get_close_matches(p, ["control", "all", *SOURCES, *own], n=1)
                hint = f"did you mean '{close[0]}'? " if close else ""
                raise UsageError(f"unknown arm or source '{p}'; {hint}use control, all, one of "
                                 f"{', '.join((*SOURCES, *own))}, or a '+'-joined combination")
    return Arm(name, frozenset(varied), cycles)


def split_variant(arm: str) -> tuple[str, int]:
    """``'init@snapshot3'`` -> ``('init', 3)``; plain arms give K = 0 (see :func:`parse_arm`)."""
    a = parse_arm(arm)
    return a.base, a.cycles


def one_source_arms(arms, reference: str = "all", own: tuple[str, ...] = ()) -> list[str]:
    """The arms that vary exactly one source (snapshot variants and the reference left out): the terms of the
    variance decomposition (:mod:`nondet_jax.analysis.decomposition`)."""
    out = []
    for a in arms:
        if a == reference:
            continue
        parsed = parse_arm(a, own)
        if len(parsed.varied) == 1 and not parsed.cycles:
            out.append(a)
    return out


def decomposition_gap(arms, reference: str = "all", own: tuple[str, ...] = ()) -> str | None:
    """What the variance decomposition over ``arms`` lacks (the reference arm, a one-source arm), in words; None
    when it has both."""
    lacks = ([] if reference in arms else [f"the {reference} arm"]) + \
        ([] if one_source_arms(arms, reference, own) else ["an arm that varies one source (init, data_order, ...)"])
    return " and ".join(lacks) or None


def arm_sources(arm: str) -> frozenset[str]:
    """The sources an arm varies (see :func:`parse_arm`)."""
    return parse_arm(arm).varied
