"""What :func:`nondet_jax.replicate` returns: the replicas' final states, as before (a dict, arm ->
state), and, with ``score=``, their scores as the tables, report, comparison and decomposition a
study gives (the same statistics: :mod:`nondet_jax.analysis.stats`, :func:`compare_arms`,
:func:`nondet_jax.analysis.decomposition.decompose`)."""

from __future__ import annotations

import jax
import numpy as np

from nondet_jax.analysis import stats as S
from nondet_jax.analysis.arm import compare_arms
from nondet_jax.analysis.decomposition import decompose
from nondet_jax.analysis.health import bitwise_identical
from nondet_jax.analysis.task import Quantity
from nondet_jax.errors import UsageError

COLUMNS = {
    "arms": ("arm", "varied", "replicas", "metric", "mean", "std", "std_ci_low", "std_ci_high", "std_ratio_vs_all",
             "ratio_ci_low", "ratio_ci_high", "spread_p", "spread_p_holm"),
    "replicas": ("arm", "replica", "metric", "value"),
    "curves": ("arm", "replica", "step", "metric", "value"),
    "decomposition": ("metric", "term", "value", "ci_low", "ci_high", "replicas"),
}


def _nan(v):
    return np.nan if v is None else float(v)


def _identical(state) -> bool:
    """Whether every replica's state (leaves with a leading replica axis) is bitwise replica 0's: the study's
    check (:func:`nondet_jax.analysis.health.bitwise_identical`) on each leaf, a PRNG key by its bits."""
    def bits(leaf):
        return jax.random.key_data(leaf) if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key) else leaf

    return all(bitwise_identical(np.asarray(bits(leaf)), np.full(len(leaf), -1))
               for leaf in jax.tree.leaves(state) if np.ndim(leaf))


def _float_step(x: np.ndarray) -> float | None:
    """The step of a tied float32 score (its spacing at the value): replicas whose states differ can tie on a
    score rounded to it, so their spread is bounded by it, not known to be zero."""
    return float(np.spacing(np.float32(abs(x[0])))) if len(x) > 1 and np.ptp(x) == 0 else None


class Replicated(dict):
    """``{arm: state}`` (with ``collect``: ``{arm: (state, history)}``), every leaf with a leading replica
    axis, as :func:`nondet_jax.replicate` always returned; and, when it was given ``score=``:

    Attributes:
      scores: ``scores[arm][metric]``, the (R,) scores of the final states, in replica order.
      identical: ``{arm: bool}``, whether the arm's replicas ended bitwise identical (the report says so); a
        score tied over replicas whose states differ gets the interval of a float32 score tied at its spacing.
      diverged: ``{arm: {score: [replica, ...]}}``, the replicas whose score is NaN or infinite, left out of that
        score's table row, comparison and decomposition (its other scores keep them); the report names them.
      table: one row (a dict) per arm and metric: mean, std with its 95% interval, the std ratio to the
        ``all`` arm with its interval and the permutation spread test's p, raw and Holm-adjusted over
        the arms that vary something (``control`` gets none: it varies nothing). The columns of
        ``to_frame("arms")``.
    """

    def __init__(self, states: dict, scores: dict[str, dict[str, np.ndarray]], varied: dict[str, list[str]],
                 curves: dict[str, dict[str, np.ndarray]], own: tuple[str, ...] = ()):
        super().__init__(states)
        self.scores, self.varied, self._curves, self._own = scores, varied, curves, own
        self.metrics = list(next(iter(scores.values()), {}))
        self.identical = {arm: _identical(state) for arm, state in states.items()}
        self.diverged = {arm: {m: [int(r) for r in np.flatnonzero(~np.isfinite(x))] for m, x in s.items()}
                         for arm, s in scores.items()}
        self._vs, self._dec = {}, {}
        for q in (Quantity(m, m, "", 1.0, m) for m in self.metrics):  # each score leaves out its own non-finite
            records = self._records(q.name)
            for arm, vs in compare_arms(records, quantities=(q,)).items():
                self._vs.setdefault(arm, {}).update(vs)
            self._dec.update(decompose(records, quantities=(q,), own=own))
        self.table = [self._row(arm, m) for arm in scores for m in self.metrics]

    def _records(self, metric: str) -> dict[str, dict]:
        """Arm records of one score, a replica whose score is not finite marked as diverged."""
        return {arm: {"varied": self.varied[arm],
                      "rows": [{"replica": r, metric: float(x), "diverged_at_step": 0 if not np.isfinite(x) else -1}
                               for r, x in enumerate(s[metric])]}
                for arm, s in self.scores.items()}

    def _finite(self, arm: str, metric: str) -> np.ndarray:
        """The arm's ``metric`` without its non-finite replicas."""
        x = self.scores[arm][metric]
        return x[np.isfinite(x)]

    def _row(self, arm: str, metric: str) -> dict:
        x = self._finite(arm, metric)
        step = None if self.identical[arm] or not self.varied[arm] else _float_step(x)
        st = S.spread(x, resolution=step) if len(x) > 1 else \
            {"mean": float(x[0]) if len(x) else np.nan, "std": np.nan, "std_ci": [np.nan, np.nan]}
        vs = self._vs.get(arm, {}).get(metric, {})
        lo, hi = vs.get("ratio_ci") or [None, None]
        return {"arm": arm, "varied": "+".join(self.varied[arm]) or "none", "replicas": len(x), "metric": metric,
                "mean": st["mean"], "std": st["std"], "std_ci_low": _nan(st["std_ci"][0]),
                "std_ci_high": _nan(st["std_ci"][1]), "std_ratio_vs_all": _nan(vs.get("ratio")),
                "ratio_ci_low": _nan(lo), "ratio_ci_high": _nan(hi), "spread_p": _nan(vs.get("spread_p")),
                "spread_p_holm": _nan(vs.get("spread_p_holm"))}

    def _need_scores(self, what: str) -> None:
        if not self.metrics:
            raise UsageError(f"{what} needs scores: pass replicate(..., score=lambda state: {{'loss': ...}}), a "
                             "function of one replica's final state returning a number or a dict of numbers")

    def rows(self, kind: str) -> list[dict]:
        """The rows of a table (:data:`COLUMNS`): ``arms``, ``replicas``, ``curves`` (the history's
        scalar leaves per step), ``decomposition``."""
        if kind not in COLUMNS:
            raise UsageError(f"to_frame({kind!r}): choose one of {', '.join(map(repr, COLUMNS))}")
        if kind == "curves":
            if not self._curves:
                raise UsageError("to_frame('curves') needs a history of numbers: pass replicate(..., collect=lambda "
                                 "state, keys: {'loss': ...}), a number (or dict of numbers) per step")
            return [{"arm": arm, "replica": r, "step": t, "metric": m, "value": float(v)}
                    for arm, c in self._curves.items() for m, a in c.items() for r in range(a.shape[0])
                    for t, v in enumerate(a[r])]
        self._need_scores(f"to_frame({kind!r})")
        if kind == "arms":
            return self.table
        if kind == "replicas":
            return [{"arm": arm, "replica": r, "metric": m, "value": float(v)}
                    for arm, s in self.scores.items() for m, x in s.items() for r, v in enumerate(x)]
        return [row for name, d in self._dec.items() for row in (
            [{"metric": name, "term": a, "value": s["share"], "ci_low": s["ci"][0], "ci_high": s["ci"][1],
              "replicas": s["replicas"]} for a, s in d["shares"].items()]
            + [{"metric": name, "term": t, "value": d[t], "ci_low": d[f"{t}_ci"][0], "ci_high": d[f"{t}_ci"][1],
                "replicas": d["reference_replicas"]} for t in ("sum", "non_additivity")])]

    def to_frame(self, kind: str = "arms"):
        """A table as a pandas DataFrame (``arms``, ``replicas``, ``curves``, ``decomposition``; columns
        :data:`COLUMNS`, long but for ``arms``). Needs pandas."""
        rows = self.rows(kind)
        try:
            import pandas as pd
        except ImportError:
            raise UsageError('to_frame needs pandas, which nondet_jax does not require; pip install '
                             '"nondet_jax[frame]" (or pandas)') from None
        return pd.DataFrame(rows, columns=list(COLUMNS[kind]))

    def decompose(self) -> dict:
        """The variance decomposition (:func:`nondet_jax.decompose`'s form) of every score: each one-source
        arm's share of the ``all`` arm's variance, the sum and the non-additivity, with intervals; empty
        without an ``all`` arm and a one-source arm."""
        self._need_scores("decompose()")
        return self._dec

    def compare(self, a: str, b: str, metric: str | None = None, higher_is_better: bool = True,
                paired: bool = True) -> dict:
        """Arm ``b`` against arm ``a`` on ``metric`` (default: the first score), as ``compare`` does two
        methods: paired by replica (replica r of every arm shares each key the arms do not vary), or
        unpaired (``paired=False``). :func:`nondet_jax.analysis.stats.compare_paired` / ``compare_means``."""
        self._need_scores("compare()")
        metric = metric or self.metrics[0]
        for what, name, known in (("arm", a, self.scores), ("arm", b, self.scores), ("score", metric, self.metrics)):
            if name not in known:
                raise UsageError(f"{what} {name!r} is not in this result ({what}s: {', '.join(map(repr, known))}); "
                                 "pick one of those")
        xa, xb = self.scores[a][metric], self.scores[b][metric]
        if paired:  # a seed whose replica's score is not finite in either arm leaves its pair
            keep = np.flatnonzero(np.isfinite(xa) & np.isfinite(xb))
            return S.compare_paired(xa[keep], xb[keep], higher_is_better=higher_is_better)
        return S.compare_means(self._finite(a, metric), self._finite(b, metric), higher_is_better=higher_is_better)

    def report(self) -> str:
        """The per-arm table in plain text, with the sentences a study's report gives where the numbers
        cannot carry a conclusion."""
        self._need_scores("report()")
        head = f"{'arm':<14}{'R':>3} {'metric':<14}{'mean':>11} {'std [95% CI]':>30} {'ratio vs all':>12} {'Holm p':>8}"
        lines = [head, "-" * len(head)]
        g = lambda v: "—" if v is None or not np.isfinite(v) else f"{v:.4g}"  # noqa: E731
        for row in self.table:
            ci = "" if not np.isfinite(row["std_ci_low"]) else f" [{g(row['std_ci_low'])}, {g(row['std_ci_high'])}]"
            spread = "bitwise identical" if self.identical[row["arm"]] and row["replicas"] > 1 else g(row["std"]) + ci
            lines.append(f"{row['arm']:<14}{row['replicas']:>3} {row['metric']:<14}{g(row['mean']):>11} "
                         f"{spread:>30} {g(row['std_ratio_vs_all']):>12} {g(row['spread_p_holm']):>8}")
        lines.append(f"std: sample std over replicas (ddof=1), 95% CI: {S.METHODS['std'].split(':')[0]} (a float32 score "
                     "tied over replicas whose states differ: up to the largest std that ties them at its spacing); "
                     "ratio: std / "
                     "the all arm's; Holm p: permutation spread test, Holm-adjusted over the arms that vary something")
        few = min((row["replicas"] for row in self.table if row["varied"] != "none"), default=0)
        if few < S.SPREAD_TEST_MIN and any(row["varied"] != "none" for row in self.table):
            lines.append(f"— : n/a with {few} replicas in an arm (the std's interval needs {S.MIN_REPLICAS['std']}, the "
                         f"ratio and the spread test {S.SPREAD_TEST_MIN} per arm).")
        if 2 <= few <= 5 and len({row["arm"] for row in self.table if row["varied"] != "none"}) > 1:
            span = [row["std_ci_high"] / row["std_ci_low"] for row in self.table
                    if row["varied"] != "none" and np.isfinite(row["std_ci_high"]) and row["std_ci_low"] > 0]
            lines.append(f"Too few replicas to rank the sources: with {few} replicas in an arm the std's 95% intervals "
                         + (f"span a factor of {min(span):.0f} to {max(span):.0f}" if span else "are n/a")
                         + f"; a factor of 2 needs {S.replicas_for_std_factor(2.0)} replicas per arm (in 80% of "
                         "simulated studies of normal data).")
        for arm, by in self.diverged.items():
            for metric, bad in by.items():
                if bad:
                    lines.append(f"{arm} {metric}: replica(s) {', '.join(map(str, bad))} of {len(self.scores[arm][metric])}"
                                 f" scored NaN or infinity (diverged?) and are left out of its numbers above.")
        for row in self.table:
            x = self._finite(row["arm"], row["metric"])
            if np.isfinite(row["std_ci_low"]) and row["std_ci_high"] - row["std_ci_low"] > np.ptp(x) > 0:
                lines.append(f"{row['arm']} {row['metric']}: the std's 95% interval is wider than the whole range of "
                             f"its replicas' values ({g(x.min())} to {g(x.max())}): it cannot say how large the spread is.")
        return "\n".join(lines)


# A pytree as the plain dict it extends (jax.tree.map over replicate's result kept working): its states are the
# leaves, the tables are not carried (a mapped result is a plain dict).
jax.tree_util.register_pytree_with_keys(
    Replicated, lambda r: ([(jax.tree_util.DictKey(k), r[k]) for k in r], tuple(r)),
    lambda keys, values: dict(zip(keys, values)))
