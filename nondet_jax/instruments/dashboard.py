"""The plotting layer: a Cockpit-style dashboard of one arm (replicas overlaid) and tidy rows.

Input (what the run folder stores per arm): ``{"step": (T,), "<quantity>": (R, T, ...)}`` with NaN
where a quantity was not tracked, plus optional ``"loss"``, ``"accuracy"``, ``"lr"`` arrays of
shape (R, T) or (T,). Layout, after Cockpit's: a step-size column (Alpha, Distance, UpdateSize), a
gradient column (GradNorm; NormTest / InnerTest / OrthoTest; GradHist1d), a curvature column
(HessMaxEV with 2 / learning rate, HessTrace, TICTrace and TICDiag), a column of the rest (GradHist2d;
MeanGSNR and EarlyStopping; CABS); loss, accuracy and learning rate beneath. Every quantity the
instruments compute is drawn: a record that :data:`PANELS` does not name (one added since) is drawn in
the last panel.
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

from nondet_jax.instruments.histograms import HIST1D_RANGE, HIST2D_RANGE
from nondet_jax.instruments.quantities import QUANTITIES

PANELS = [  # (row, column, title, quantities)
    (0, 0, "Alpha (0 = step to the minimum)", ("Alpha",)),
    (1, 0, "Distance from init", ("Distance",)),
    (2, 0, "UpdateSize", ("UpdateSize",)),
    (0, 1, "GradNorm", ("GradNorm",)),
    (1, 1, "Gradient tests", ("NormTest", "InnerTest", "OrthoTest")),
    (2, 1, "GradHist1d (last tracked step)", ("GradHist1d",)),
    (0, 2, "HessMaxEV", ("HessMaxEV",)),
    (1, 2, "HessTrace", ("HessTrace",)),
    (2, 2, "TIC", ("TICTrace", "TICDiag")),
    (0, 3, "GradHist2d (last tracked step, replica 0)", ("GradHist2d",)),
    (1, 3, "Gradient signal to noise", ("MeanGSNR", "EarlyStopping")),
    (2, 3, "CABS (suggested batch size)", ("CABS",)),
]
COLORS = {"NormTest": "C0", "InnerTest": "C1", "OrthoTest": "C2", "TICTrace": "C0", "TICDiag": "C1", "MeanGSNR": "C0",
          "EarlyStopping": "C1"}


def _per_replica(a, steps: int) -> np.ndarray:
    a = np.asarray(a, dtype=float)
    if a.ndim == 1:
        a = a[None]
    if a.shape[1] != steps:
        raise ValueError(f"expected a leading (R, T={steps}) shape, got {a.shape}")
    return a


LINESTYLES = ("-", "--", ":", "-.")  # replicas of one quantity: told apart by line style
MARKERS = {"NormTest": "o", "InnerTest": "s", "OrthoTest": "^", "TICTrace": "o", "TICDiag": "s", "MeanGSNR": "o",
           "EarlyStopping": "s"}
LOG_SCALE = ("NormTest", "InnerTest", "OrthoTest", "TICTrace", "TICDiag", "MeanGSNR")  # positive by construction


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


def _hist1d(ax, step, values: dict, hist_range) -> None:
    h = np.asarray(values["GradHist1d"], dtype=float)
    h = h[None] if h.ndim == 2 else h
    edges = np.linspace(hist_range[0], hist_range[1], h.shape[-1] + 1)
    centres = 0.5 * (edges[1:] + edges[:-1])
    for r, hr in enumerate(h):
        tracked = np.where(np.all(np.isfinite(hr), -1))[0]
        if len(tracked):  # an empty bin is a gap in the line (a log axis has no 0), not a count drawn at 0.5
            last = hr[tracked[-1]]
            ax.semilogy(centres, np.where(last > 0, last, np.nan), lw=1, alpha=0.75, color=f"C{r % 10}",
                        label=f"replica {r}, step {step[tracked[-1]]}")
    ax.set_xlabel("individual gradient element")
    ax.legend(fontsize=7)


def _hist2d(ax, step, values: dict, hist_range) -> None:
    """Replica 0's last tracked 2-D histogram: parameter value across, gradient element up, log counts."""
    h = np.asarray(values["GradHist2d"], dtype=float)
    h = h[None] if h.ndim == 3 else h
    tracked = np.where(np.all(np.isfinite(h[0]), (-2, -1)))[0]
    if not len(tracked):
        ax.text(0.5, 0.5, "no tracked step", ha="center", va="center", transform=ax.transAxes, color="0.5")
        return
    (g_lo, g_hi), (p_lo, p_hi) = hist_range
    image = ax.imshow(np.log10(1 + h[0, tracked[-1]]), origin="lower", aspect="auto", cmap="viridis",
                      extent=(p_lo, p_hi, g_lo, g_hi))
    ax.set_xlabel(f"parameter (step {step[tracked[-1]]})")
    ax.set_ylabel("gradient element")
    ax.figure.colorbar(image, ax=ax, label="log10(1 + count)")


def _quantity_lines(ax, step, values: dict, qs: tuple, present: list, t: int) -> None:
    several = len(present) > 1  # colour = quantity, line style = replica; else colour = replica
    for z, q in enumerate(present):  # NormTest (first) on top: it often nearly equals OrthoTest
        _lines(ax, step, _per_replica(values[q], t), q if several else None, COLORS.get(q) if several else None,
               MARKERS.get(q) if several else None, zorder=3 + len(present) - z)
    if not several and qs[0] in BANDS and BANDS[qs[0]][0] in values:
        _bands(ax, step, values, qs[0], t)
    if several:
        from matplotlib.lines import Line2D

        handles, labels = ax.get_legend_handles_labels()
        replicas = _per_replica(values[present[0]], t).shape[0]
        if replicas > 1:  # colour is the quantity here: say which line style is which replica
            handles += [Line2D([], [], color="0.3", lw=1, ls=LINESTYLES[r % len(LINESTYLES)])
                        for r in range(min(replicas, len(LINESTYLES)))]
            labels += [f"replica {r}" + ("" if replicas <= len(LINESTYLES) else f", {r + len(LINESTYLES)}, …")
                       for r in range(min(replicas, len(LINESTYLES)))]
        ax.legend(handles, labels, fontsize=7)
        if all(q in LOG_SCALE for q in present):
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


def _others(ax, step, values: dict, t: int) -> None:
    """The scalar quantities no panel of :data:`PANELS` names (a record added since), together in the last panel."""
    named = {q for *_, qs in PANELS for q in qs} | {"Loss"}
    others = [q for q in QUANTITIES if q not in named and q in values and np.ndim(values[q]) <= 2]
    if not others:
        ax.axis("off")
        return
    ax.set_title(", ".join(others), fontsize=10)
    _quantity_lines(ax, step, values, tuple(others), others, t)
    ax.set_xlabel("step")


def dashboard(values: dict, title: str = "", hist_range=HIST1D_RANGE, hist2d_range=HIST2D_RANGE):
    """A matplotlib figure for one arm; replicas drawn as overlaid lines."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    if "step" not in values:
        raise ValueError("values needs a 'step' array (T,)")
    step = np.asarray(values["step"])
    t = len(step)
    fig, axes = plt.subplots(4, 4, figsize=(17, 11), constrained_layout=True)
    for row, col, name, qs in PANELS:
        ax = axes[row, col]
        ax.set_title(name, fontsize=10)
        present = [q for q in qs if q in values]
        if not present:
            ax.text(0.5, 0.5, "not tracked", ha="center", va="center", transform=ax.transAxes, color="0.5")
            ax.set_xticks([]), ax.set_yticks([])
        elif qs == ("GradHist1d",):
            _hist1d(ax, step, values, hist_range)
        elif qs == ("GradHist2d",):
            _hist2d(ax, step, values, hist2d_range)
        else:
            _quantity_lines(ax, step, values, qs, present, t)
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
    ax.set_title("learning rate", fontsize=10)
    if "lr" in values:
        _lines(ax, step, _per_replica(values["lr"], t), color="k")
    else:  # your own optimiser: its learning rate is not the config's schedule, and is not recorded
        ax.text(0.5, 0.5, "not recorded\n(your own optimiser)", ha="center", va="center", transform=ax.transAxes,
                color="0.5")
        ax.set_xticks([]), ax.set_yticks([])
    _others(axes[3, 3], step, values, t)
    for ax in axes[3, :3]:
        ax.set_xlabel("step")
    r = next((np.asarray(v).shape[0] for k, v in values.items() if k != "step" and np.ndim(v) >= 2), 1)
    if r > 1:
        _replica_legend(axes[3, 0], r)
    fig.suptitle(f"{title}  ({r} replica{'s' if r != 1 else ''} overlaid)".strip(), fontsize=12)
    return fig


def long_rows(arm: str, values: dict) -> list[dict]:
    """:func:`tidy_rows` in the long format of a run folder's ``instruments.csv``: ``arm, replica, step, quantity,
    value``, a per-layer value's quantity its full name (``GradNorm/<parameter path>``)."""
    return [{"arm": row["arm"], "replica": row["replica"], "step": row["step"],
             "quantity": f"{row['quantity']}/{row['layer']}" if row["layer"] else row["quantity"], "value": row["value"]}
            for row in tidy_rows(arm, values)]


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
