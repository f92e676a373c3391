"""The grammar of a sequential study of methods (``--until``, ``run_study(until=...)``), checked before JAX,
flax or scipy start: :class:`Until` and :func:`parse`. The statistics are
:mod:`nondet_jax.analysis.sequential`'s; the looks are run by :mod:`nondet_jax.study.methods`."""

from __future__ import annotations

import math
from typing import NamedTuple

from nondet_jax.arms import parse_arm
from nondet_jax.errors import UsageError

ROUND = 4  # replicas added per method at each look
MAX_REPLICAS = 1024  # per method: the design's simulations hold (trials, max_replicas) arrays (40,000 x 1,024: 330 MB)


class Until(NamedTuple):
    """A sequential design: ``rule`` ("decided" or "width"), its ``value`` (decided: the smallest
    difference that matters, or None; width: the widest interval accepted), the first look's replicas
    (``study.replicas``), the most replicas per method, and the replicas added at each look."""

    rule: str
    value: float | None
    first: int
    max_replicas: int
    round: int = ROUND

    @property
    def spec(self) -> str:
        return self.rule + ("" if self.value is None else f"={number(self.value)}")

    def looks(self) -> list[int]:
        """The replicas per method at each look the design may take."""
        return looks(self.first, self.max_replicas, self.round)


def number(value: float) -> str:
    """``value`` as a design's spec and answers write it: ``:g`` (0.01, 1) where that reads back as ``value``, else
    every digit it needs (0.0123456789): a spec must parse back to its own design (:func:`check_state`)."""
    return next((f"{value:.{digits}g}" for digits in range(6, 18) if float(f"{value:.{digits}g}") == value),
                repr(value))


def looks(first: int, max_replicas: int, step: int = ROUND) -> list[int]:
    out = list(range(first, max_replicas, step))
    return out + [max_replicas]


def parse(spec: str, max_replicas: int | None, replicas: int, where: str = "--until") -> Until:
    """``decided``, ``decided=D`` or ``width=X`` with the most replicas per method (``--max-replicas``;
    default 4x ``replicas``, at most :data:`MAX_REPLICAS`), checked: one-line UsageErrors naming the fix, in the
    words of ``where`` (``--until``: the command line's; ``until=``: ``run_study``'s)."""
    rule, eq, value = str(spec).strip().partition("=")
    cli = where == "--until"

    def give(name: str, n: int) -> str:  # an option with its value, as the caller writes it
        return f"--{name.replace('_', '-')} {n}" if cli else f"{name}={n}"

    option = "--max-replicas" if cli else "max_replicas="
    if rule not in ("decided", "width") or (rule == "width" and not eq):
        raise UsageError(f"{where} {spec!r}: write decided (stop once each method differs from the baseline), "
                         "decided=D (or once any difference is within ±D) or width=X (once each interval is at most "
                         "X wide), in the score's units, e.g. width=0.01")
    amount = None
    if eq:
        try:
            amount = float(value)
        except ValueError:
            amount = float("nan")
        if not (math.isfinite(amount) and amount > 0):
            raise UsageError(f"{where} {spec!r}: {value!r} is not a positive number; write e.g. {rule}=0.01 (a "
                             "difference in the score's units: 0.01 is one point of accuracy)")
    if replicas < 3:
        raise UsageError(f"a sequential study starts from at least 3 replicas per method (its first look), got "
                         f"{replicas}; use {give('replicas', 3)} or more")
    if replicas >= MAX_REPLICAS:
        raise UsageError(f"a sequential study plans for at most {MAX_REPLICAS} replicas per method, and its first look "
                         f"alone would train {replicas}; start from fewer, e.g. {give('replicas', MAX_REPLICAS // 4)}")
    max_replicas = min(4 * replicas, MAX_REPLICAS) if max_replicas is None else max_replicas
    if isinstance(max_replicas, bool) or not isinstance(max_replicas, int) or max_replicas <= replicas:
        raise UsageError(f"{option} {max_replicas!r} must be an integer above the first look's {replicas} replicas "
                         f"({'--replicas' if cli else 'replicas='}); e.g. "
                         f"{give('max_replicas', min(4 * replicas, MAX_REPLICAS))}")
    if max_replicas > MAX_REPLICAS:
        raise UsageError(f"{option} {max_replicas} is more than the {MAX_REPLICAS} replicas per method a sequential "
                         f"study plans for; use {give('max_replicas', MAX_REPLICAS)} or fewer")
    return Until(rule, amount, replicas, max_replicas)


def check_arms(arms) -> None:
    """Refuse arms a sequential study cannot grow or compare, before its first look trains: a ``hardware`` arm
    trains in processes of its own; arms that vary nothing (``control``) give every replica one run, so no look
    would have a comparison to read."""
    hardware = [a for a in arms if "hardware" in parse_arm(a).varied]
    if hardware:
        raise UsageError(f"arm '{hardware[0]}' trains in processes of its own, which a sequential study (--until) "
                         "cannot grow look by look; drop it, or study it with a fixed --replicas")
    if not any(parse_arm(a).varied for a in arms):
        said = f"arms {', '.join(arms)} vary" if len(arms) > 1 else f"arm {', '.join(arms)} varies"
        raise UsageError(f"{said} nothing between replicas (control's replicas are one run), so a sequential study "
                         "(--until) would have no difference to compare; add an arm whose replicas vary, such as all")


def _follows(rule: str, value, c: dict) -> bool:
    """Whether a recorded decision is the one its interval gives (a hand-edited answer would stop a study or
    train a method no more): ``decided``, a method better exactly when the interval excludes 0, and the one on
    its side; ``within ±D`` only inside ±D; ``width``, narrow enough only at most X wide."""
    lo, hi = c["interval"]
    decision = c["decision"]
    if lo is None or hi is None:  # no interval (too few pairs): no answer
        return decision in ("open", "not decided", "not narrow enough", "futile")
    if rule == "width":
        return (decision == "narrow enough") == (hi - lo <= value)
    if (lo > 0 or hi < 0) != decision.endswith(" is better"):
        return False
    if decision.endswith(" is better"):  # the winner on its side (where the record says which way is better)
        winner = c["method_b"] if (hi < 0) != c.get("higher_is_better", True) else c["method_a"]
        return decision[:-len(" is better")] == winner if "higher_is_better" in c else \
            decision[:-len(" is better")] in (c["method_a"], c["method_b"])
    if decision.startswith("within ±"):
        return value is not None and decision == f"within ±{number(value)}" and -value < lo and hi < value
    return True


def check_state(state, where: str) -> dict:
    """``methods.json``'s ``until`` as :func:`nondet_jax.study.methods.run_looks` writes it: the design and
    each look with its comparisons. A run folder is untrusted input: a damaged record is refused in one line
    naming ``where``, never read into a traceback."""
    def num(v):
        return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))

    def count(v):
        return isinstance(v, int) and not isinstance(v, bool)

    def text(*vs):
        return all(isinstance(v, str) for v in vs)

    try:
        d, looks = state["design"], state["looks"]
        ok = text(d["rule"], d["spec"]) and num(d["value"]) and count(d["first"]) and count(d["max_replicas"]) \
            and count(d["round"]) and isinstance(looks, list) \
            and set(d) <= {"rule", "value", "first", "max_replicas", "round", "spec", "boundary"}
        # the design parse() makes from the record's own spec: a record cannot ask for a design no command can
        ok = ok and parse(d["spec"], d["max_replicas"], d["first"]) == \
            Until(d["rule"], d["value"], d["first"], d["max_replicas"], d["round"])
        b = d.get("boundary")  # the boundary a decided design's levels follow (absent: recorded before boundaries)
        ok = ok and (b is None or (isinstance(b, dict) and num(b["shape"]) and b["shape"] is not None
                                   and 0 <= b["shape"] <= 1 and num(b["futility"]) and b["futility"] is not None
                                   and 0 <= b["futility"] < 1 and isinstance(b["futility_counted"], bool)))
        for k in looks if ok else ():
            ok = ok and count(k["replicas"]) and num(k["level"]) and text(k["rule"], k["why"]) \
                and d["first"] <= k["replicas"] <= d["max_replicas"] and k["level"] is not None \
                and 0 < k["level"] < 1 \
                and isinstance(k["stop"], bool) and isinstance(k["comparisons"], list)
            for c in k["comparisons"] if ok else ():
                ok = ok and text(c["method_a"], c["method_b"], c["arm"], c["decision"]) and count(c["replicas"]) \
                    and num(c["difference"]) and isinstance(c["interval"], list) and len(c["interval"]) == 2 \
                    and all(num(v) for v in c["interval"]) \
                    and _follows(d["rule"], d["value"], c)
    except (KeyError, TypeError, UsageError):
        ok = False
    if not ok:
        raise UsageError(f"{where} holds a damaged record of a sequential study's looks ('until'); restore it, or "
                         "start a new study with another --out")
    return state
