"""The plotting layer: a Cockpit-style dashboard of one arm (replicas overlaid) and tidy rows.

Input (what the run folder stores per arm): ``{"step": (T,), "<quantity>": (R, T, ...)}`` with NaN
where a quantity was not tracked, plus optional ``"loss"``, ``"accuracy"``, ``"lr"`` arrays of
shape (R, T) or (T,). Layout, after Cockpit's: a step-size column (Alpha, Distance, UpdateSize), a
gradient column (GradNorm; NormTest / InnerTest / OrthoTest; GradHist1d), a curvature column
(HessMaxEV with 2 / learning rate, HessTrace, TICTrace); loss, accuracy and learning rate beneath.
A shaded band around a line is its stated error: HessMaxEV up to ``HessMaxEVError`` above it (its
Ritz value is a lower bound), HessTrace and TICTrace +- 1.96 ``...SE`` where they are estimates.

Example::

    values = {"step": steps, **{k: v for k, v in arm_npz.items()}}
    fig = dashboard(values, title="arm init")
    fig.savefig("figures/instruments_init.png", dpi=120)
    rows = tidy_rows("init", values)   # [{"step": 0, "arm": "init", "replica": 0, "quantity": "Loss", ...}]
"""

from __future__ import annotations

import numpy as np

from nondet_jax.instruments.histograms import HIST1D_RANGE

PANELS = [  # (row, column, title, quantities)
    (0, 0, "Alpha (0 = step to the minimum)", ("Alpha",)),
    (1, 0, "Distance from init", ("Distance",)),
    (2, 0, "UpdateSize", ("UpdateSize",)),
    (0, 1, "GradNorm", ("GradNorm",)),
    (1, 1, "Gradient tests", ("NormTest", "InnerTest", "OrthoTest")),
    (2, 1, "GradHist1d (last tracked step)", ("GradHist1d",)),
    (0, 2, "HessMaxEV", ("HessMaxEV",)),
    (1, 2, "HessTrace", ("HessTrace",)),
    (2, 2, "TICTrace", ("TICTrace",)),
]
COLORS = {"NormTest": "C0", "InnerTest": "C1", "OrthoTest": "C2"}


def _per_replica(a, steps: int) -> np.ndarray:
    a = np.asarray(a, dtype=float)
    if a.ndim == 1:
        a = a[None]
    if a.shape[1] != steps:
        raise ValueError(f"expected a leading (R, T={steps}) shape, got {a.shape}")
    return a


LINESTYLES = ("-", "--", ":", "-.")  # replicas of one quantity: told apart by line style
MARKERS = {"NormTest": "o", "InnerTest": "s", "OrthoTest": "^"}


def _lines(ax, step, arr, label=None, color=None, marker=None, zorder=2):
    """One line per replica: its own colour when ``color`` is None (a one-quantity panel), else the
    quantity's colour with a line style per replica."""
    for r, row in enumerate(arr):
        ok = np.isfinite(row)
        dense = ok.sum() >= 60
        ax.plot(step[ok], row[ok], ls=LINESTYLES[r % len(LINESTYLES)] if color else "-",
                marker=None if dense else (marker or "."), ms=4 if marker else 3, mfc="none" if marker else None,
                lw=1, alpha=0.8, color=color or f"C{r % 10}", label=label if r == 0 else None, zorder=zorder)


# quantity -> (its error's key, the band's ends from value v and error e)
BANDS = {"HessMaxEV": ("HessMaxEVError", lambda v, e: (v, v + e)),
         "HessTrace": ("HessTraceSE", lambda v, e: (v - 1.96 * e, v + 1.96 * e)),
         "TICTrace": ("TICTraceSE", lambda v, e: (v - 1.96 * e, v + 1.96 * e))}


def _bands(ax, step, values: dict, q: str, t: int) -> None:
    """Shade each replica's stated error around its line (its own colour)."""
    key, ends = BANDS[q]
    lo, hi = ends(_per_replica(values[q], t), _per_replica(values[key], t))
    for r in range(lo.shape[0]):
        ok = np.isfinite(lo[r]) & np.isfinite(hi[r])
        ax.fill_between(step[ok], lo[r][ok], hi[r][ok], color=f"C{r % 10}", alpha=0.2, lw=0)


def _replica_legend(ax, r: int) -> None:
    from matplotlib.lines import Line2D

    ax.legend([Line2D([], [], color=f"C{i % 10}") for i in range(r)], [f"replica {i}" for i in range(r)],
              fontsize=7, ncol=2)


def dashboard(values: dict, title: str = "", hist_range=HIST1D_RANGE):
    """A matplotlib figure for one arm; replicas drawn as overlaid lines."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    if "step" not in values:
        raise ValueError("values needs a 'step' array (T,)")
    step = np.asarray(values["step"])
    t = len(step)
    fig, axes = plt.subplots(4, 3, figsize=(13, 11), constrained_layout=True)
    for row, col, name, qs in PANELS:
        ax = axes[row, col]
        ax.set_title(name, fontsize=10)
        present = [q for q in qs if q in values]
        if not present:
            ax.text(0.5, 0.5, "not tracked", ha="center", va="center", transform=ax.transAxes, color="0.5")
            ax.set_xticks([]), ax.set_yticks([])
            continue
        if qs == ("GradHist1d",):
            h = np.asarray(values["GradHist1d"], dtype=float)
            h = h[None] if h.ndim == 2 else h
            edges = np.linspace(hist_range[0], hist_range[1], h.shape[-1] + 1)
            centres = 0.5 * (edges[1:] + edges[:-1])
            for r, hr in enumerate(h):
                tracked = np.where(np.all(np.isfinite(hr), -1))[0]
                if len(tracked):
                    ax.semilogy(centres, np.maximum(hr[tracked[-1]], 0.5), lw=1, alpha=0.75,
                                label=f"step {step[tracked[-1]]}" if r == 0 else None)
            ax.set_xlabel("individual gradient element")
            ax.legend(fontsize=7)
            continue
        several = len(present) > 1  # colour = quantity, line style = replica; else colour = replica
        for z, q in enumerate(present):  # NormTest (first) on top: it often nearly equals OrthoTest
            _lines(ax, step, _per_replica(values[q], t), q if several else None, COLORS.get(q) if several else None,
                   MARKERS.get(q) if several else None, zorder=3 + len(present) - z)
        if not several and qs[0] in BANDS and BANDS[qs[0]][0] in values:
            _bands(ax, step, values, qs[0], t)
        if several:
            ax.legend(fontsize=7)
            ax.set_yscale("log")
        if qs == ("Alpha",):
            ax.axhline(0, color="k", lw=0.8, ls="--")
            ax.set_ylim(-1.5, 3)
        if qs == ("HessMaxEV",) and "lr" in values:
            lr = _per_replica(values["lr"], t)[0]
            ok = lr > 0
            ax.plot(step[ok], 2 / lr[ok], "k--", lw=1, label="2 / lr")
            ax.set_yscale("log")
            ax.legend(fontsize=7)
    ax = axes[3, 0]
    if "loss" in values:
        _lines(ax, step, _per_replica(values["loss"], t))
    elif "Loss" in values:
        _lines(ax, step, _per_replica(values["Loss"], t))
    ax.set_title("training loss", fontsize=10)
    ax = axes[3, 1]
    if "accuracy" in values:
        _lines(ax, step, _per_replica(values["accuracy"], t))
    ax.set_title("training accuracy", fontsize=10)
    ax = axes[3, 2]
    if "lr" in values:
        _lines(ax, step, _per_replica(values["lr"], t), color="k")
    ax.set_title("learning rate", fontsize=10)
    for ax in axes[3]:
        ax.set_xlabel("step")
    r = next((np.asarray(v).shape[0] for k, v in values.items() if k != "step" and np.ndim(v) >= 2), 1)
    if r > 1:
        _replica_legend(axes[3, 0], r)
    fig.suptitle(f"{title}  ({r} replica{'s' if r != 1 else ''} overlaid)".strip(), fontsize=12)
    return fig


def tidy_rows(arm: str, values: dict) -> list[dict]:
    """One row per finite scalar measurement: step, arm, replica, quantity, layer ('' = total), value.

    Histograms (arrays with more than the (R, T) axes) and the loss/accuracy/lr extras are skipped.
    """
    step = np.asarray(values["step"])
    rows = []
    for key, arr in values.items():
        if key in ("step", "loss", "accuracy", "lr"):
            continue
        a = np.asarray(arr, dtype=float)
        if a.ndim == 1:
            a = a[None]
        if a.ndim != 2:
            continue
        quantity, _, layer = key.partition("/")
        for r, t in zip(*np.nonzero(np.isfinite(a))):
            rows.append({"step": int(step[t]), "arm": arm, "replica": int(r), "quantity": quantity, "layer": layer,
                         "value": float(a[r, t])})
    return rows
