"""The report's figures, one function per figure (matplotlib, imported when drawing)."""

from __future__ import annotations

import io
import json
import warnings
from pathlib import Path

import numpy as np

from nondet_jax.analysis.stats import METHODS
from nondet_jax.analysis.task import QUANTITIES, task_of
from nondet_jax.report.summary import _healthy
from nondet_jax.store.io import atomic_write_bytes, read_arrays
from nondet_jax.store.paths import RunPaths

LINESTYLES = ("-", "--", ":", "-.")  # arms with equal curves (init and all, say) stay visible


MARKERS = ("o", "s", "^", "v", "D", "P", "X", "*", "<", ">")  # hollow, one per arm: overlapping curves show both


def _stored(c: "_Context", folder: str, key: str):
    """(index, arm, arrays) for each arm whose ``folder/<arm>.npz``, listed by its record, holds ``key``."""
    for i, arm in enumerate(c.arms):
        path = RunPaths(c.run).listed_file(folder, arm, c.records.get(arm, {}), ".npz")
        if path is not None:
            arrays = read_arrays(path)
            if key in arrays:
                yield i, arm, arrays


def _has_batch_norm(run: Path) -> bool:
    """``model.json``'s record of BatchNorm (True when a folder does not say: the catalogue's ResNets have it)."""
    try:
        return bool(json.loads(RunPaths(run).model.read_text()).get("batch_norm", True))
    except (OSError, ValueError, AttributeError):
        return True


def make_figures(run: Path, summary: dict, records: dict[str, dict]) -> list[str]:
    """Write the report's figures (:func:`draw_figures`); returns their paths relative to the run folder."""
    import matplotlib.pyplot as plt

    figdir = RunPaths(run).figures
    figdir.mkdir(exist_ok=True)
    made = []
    for name, fig in draw_figures(run, summary, records):
        buf = io.BytesIO()
        if fig.get_layout_engine() is None:  # the dashboard brings its own (constrained) layout
            with warnings.catch_warnings():  # matplotlib's layout notes are not the user's business
                warnings.simplefilter("ignore")
                fig.tight_layout()
        fig.savefig(buf, format="png", dpi=110)
        plt.close(fig)
        atomic_write_bytes(figdir / f"{name}.png", buf.getvalue(), root=run)
        made.append((figdir / f"{name}.png").relative_to(run).as_posix())
    return made


def draw_figures(run: Path, summary: dict, records: dict[str, dict]):
    """(name, matplotlib figure) of each of the report's figures, in the report's order, drawn one at a
    time (the caller saves and closes each before the next is drawn)."""
    import matplotlib

    matplotlib.use("Agg")
    ctx = _Context(run, summary, records)
    for draw in (_accuracy, _spread, _diversity, _divergence, _decomposition, _test_curves, _dynamics, _lmc):
        drawn = draw(ctx)
        if drawn is not None:
            yield drawn
    yield from _instrument_dashboards(ctx)


class _Context:
    """What every figure reads: the run folder, its summary and records, the arms and their positions."""

    def __init__(self, run: Path, summary: dict, records: dict[str, dict]):
        self.run, self.summary, self.records = run, summary, records
        self.arms = list(summary["arms"])
        self.x = np.arange(len(self.arms))
        self.classes = task_of(summary) == "classification"
        self.q1, self.q2 = QUANTITIES[task_of(summary)]

    def metric(self, arm: str, key: str) -> dict:
        return self.summary["arms"][arm]["metrics"].get(key, {})  # {} for an arm that fully diverged


def interval_name(kind: str) -> str:
    """The short name of an interval method (:data:`nondet_jax.analysis.stats.METHODS`), as a title gives it."""
    head, _, rest = METHODS[kind].partition(": ")
    name = head if "interval" in head or "jackknife" in head else rest  # "sum of ...: Bonett's ... interval ..."
    return name.split(" (leave")[0].split(" (delta")[0].strip()


def _unit_label(q) -> str:
    """A score's axis label with its unit: % (accuracy), nats (cross-entropy), the targets' units (regression)."""
    return {"accuracy": "test accuracy (%)", "cross_entropy": "test cross-entropy (nats)", "mse": "test MSE (targets' units²)",
            "mae": "test MAE (targets' units)"}.get(q.name, q.label)


def _accuracy(c: _Context):
    """Accuracy (a regression: test MSE) of every replica, per arm (strip + violin)."""
    import matplotlib.pyplot as plt

    arms, x, q1, summary = c.arms, c.x, c.q1, c.summary
    fig, ax = plt.subplots(figsize=(1.3 * len(arms) + 2, 4))
    healthy = [sorted(_healthy(c.records[a])) for a in arms]
    accs = [np.array([r[q1.row] for r in c.records[a]["rows"] if r["replica"] in h], float) * q1.scale
            for a, h in zip(arms, healthy)]
    if all(len(v) > 1 and np.ptp(v) > 0 for v in accs):
        ax.violinplot(accs, positions=x, showextrema=False)
    rng = np.random.default_rng(0)
    low = min([v.min() for v in accs if len(v)], default=0.0)
    marked = False
    for i, (a, v) in enumerate(zip(arms, accs)):
        ax.scatter(i + rng.uniform(-0.12, 0.12, len(v)), v, s=14, alpha=0.8, color="C0")
        if len(v):
            ax.hlines(v.mean(), i - 0.25, i + 0.25, color="k", lw=1.5)
        gone = summary["arms"][a].get("diverged", [])
        if gone:  # diverged replicas: a red x under the arm, labelled with replica@step
            ax.scatter([i] * len(gone), [low] * len(gone), marker="x", color="C3", s=30, zorder=3,
                       label=None if marked else "diverged (replica@step), left out")
            ax.annotate(", ".join(f"{d['replica']}@{d['step']}" for d in gone)[:40], (i, low), fontsize=7,
                        color="C3", ha="center", va="top", xytext=(0, -6), textcoords="offset points")
            marked = True
    if marked:
        ax.legend(fontsize=8)
    ax.set_xticks(x, arms, rotation=30, ha="right")
    ax.set_xlabel("arm")
    ax.set_ylabel(_unit_label(q1))
    ax.set_title(f"{'Test accuracy' if c.classes else q1.label} of each replica, per arm (line: mean)")
    return ("accuracy" if c.classes else q1.name), fig


def _spread(c: _Context):
    """Std over replicas with its interval, of both scores, with the independent-errors baseline."""
    import matplotlib.pyplot as plt

    arms, x = c.arms, c.x
    fig, axes = plt.subplots(1, 2, figsize=(2 * (0.8 * len(arms) + 2), 4))
    drawn = False  # any interval drawn (none below 3 replicas: the title says so)
    for ax, q in zip(axes, (c.q1, c.q2)):
        spread = [c.metric(a, q.name) for a in arms]
        s = np.array([m.get("std", np.nan) for m in spread], dtype=float) * q.scale
        ci = np.array([m.get("std_ci", [np.nan, np.nan]) for m in spread], dtype=float) * q.scale
        base = np.array([c.summary["arms"][a]["metrics"].get("independent_errors_std", np.nan) for a in arms],
                        dtype=float) * q.scale if q.name == "accuracy" else np.full(len(arms), np.nan)
        # Few replicas give upper CI ends many times the std (32x at R=2): the axis stops at 3x the largest
        # std, and a whisker that goes on is cut there with its end written above it.
        top = 3 * np.nanmax(np.concatenate([s, base, [0.0]]))
        cut = ci[:, 1] > top if top > 0 else np.zeros(len(arms), bool)
        high = np.where(cut, top, ci[:, 1])
        err = np.clip(np.abs(np.stack([s - ci[:, 0], high - s])), 0, None)
        drawn = drawn or bool(np.isfinite(ci).all(axis=1).any())
        ax.bar(x, s, yerr=err, capsize=4, color="C1")  # no bar where the CI is n/a (NaN), never a 0-width one
        for i in np.flatnonzero(cut):
            ax.annotate(f"↑ {ci[i, 1]:.3g}", (i, top), ha="center", va="bottom", fontsize=8, xytext=(0, 2),
                        textcoords="offset points")
        if cut.any():
            ax.set_ylim(0, top * 1.12)
        for i in np.flatnonzero(np.isnan(s)):
            ax.text(i, 0, "n/a", ha="center", va="bottom", fontsize=8, color="C3")
        if q.name == "accuracy":
            ax.scatter(x, base, marker="D", s=36, facecolor="white", edgecolor="k", zorder=3,
                       label="test-set sampling alone (independent-errors baseline)")
            ax.legend(fontsize=8, loc="lower left", bbox_to_anchor=(0, 1.0), frameon=False)
        ax.set_xticks(x, arms, rotation=30, ha="right")
        ax.set_xlabel("arm")
        ax.set_ylabel(f"std of {_unit_label(q)}")
    fig.suptitle(f"Spread across replicas (std, ddof=1), with 95% CIs: {interval_name('std')}" if drawn else
                 "Spread across replicas (std, ddof=1); no 95% CI below 3 replicas per arm")
    return "spread", fig


def _diversity(c: _Context):
    """Pairwise diversity per arm: mean over pairs with the jackknife interval."""
    import matplotlib.pyplot as plt

    arms, x = c.arms, c.x
    names = [("disagreement", "pairwise disagreement (%)", 100), ("cka", "linear CKA of features (0 to 1)", 1),
             ("ensemble_gain_accuracy", "2-model ensemble gain in accuracy (pp)", 100)] if c.classes else \
        [("prediction_distance", "RMS distance of predictions (targets' units)", 1),
         ("cka", "linear CKA of features (0 to 1)", 1),
         ("ensemble_gain_mse", "2-model ensemble gain in MSE (positive: better)", 1)]
    if not any(names[0][0] in c.summary["arms"][a]["metrics"] for a in arms):
        return None
    fig, axes = plt.subplots(1, 3, figsize=(3 * (0.7 * len(arms) + 1.8), 4))
    for ax, (key, label, scale) in zip(axes, names):
        vals = np.array([c.metric(a, key).get("mean", np.nan) for a in arms], dtype=float) * scale
        ci = np.array([c.metric(a, key).get("ci", [np.nan, np.nan]) for a in arms], dtype=float) * scale
        err = np.clip(np.abs(np.stack([vals - ci[:, 0], ci[:, 1] - vals])), 0, None)  # NaN (n/a): no bar
        ax.bar(x, vals, yerr=err, capsize=4, color="C2")
        ax.set_xticks(x, arms, rotation=30, ha="right")
        ax.set_xlabel("arm")
        ax.set_ylabel(label)
        ax.set_title(label, fontsize=10)
    few = [a for a in arms if 0 < c.summary["arms"][a].get("replicas_used", c.summary["arms"][a]["replicas"]) < 3]
    fig.suptitle(f"Diversity between replicas (mean over pairs, 95% CI: {interval_name('pairwise')}"
                 + ("; no CI below 3 replicas: " + ", ".join(few) if few else "") + ")")
    return "diversity", fig


def _divergence(c: _Context):
    """Weight divergence over training (the mean over pairs after every epoch)."""
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(6.5, 4))
    plotted = False
    for i, a, h in _stored(c, "history", "weight_distance"):
        wd = h["weight_distance"]
        if wd.shape[1] == 0:
            continue
        mean = wd.mean(1)
        if (mean > 0).any():
            ax.plot(np.arange(len(mean)), np.where(mean > 0, mean, np.nan), marker=MARKERS[i % len(MARKERS)],
                    ms=4 + 1.5 * (i % 3), mfc="none", label=a, color=f"C{i}", ls=LINESTYLES[i % len(LINESTYLES)])
            plotted = True
    if not plotted:
        plt.close(fig)
        return None
    _value_axis(ax)
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_xlabel("epoch (0 = initial weights)")
    ax.set_ylabel("||θa − θb|| / ||θa|| (relative), mean over pairs")
    ax.set_title("Weight-space divergence per arm (arms at 0 are not drawn)")
    ax.legend(fontsize=8, title="arm", title_fontsize=8)
    return "divergence", fig


def _decomposition(c: _Context):
    """Variance decomposition: each source's share of Var(all), stacked, per score."""
    import matplotlib.pyplot as plt

    dec = c.summary.get("decomposition") or {}
    if not dec:
        return None
    labels = {q.name: _unit_label(q) for q in (c.q1, c.q2)}
    fig, axes = plt.subplots(1, len(dec), figsize=(4.5 * len(dec), 4), squeeze=False)
    for ax, (name, d) in zip(axes[0], dec.items()):
        bottom = 0.0
        for j, (a, sh) in enumerate(d["shares"].items()):
            v = max(sh["share"], 0.0) if np.isfinite(sh["share"]) else 0.0
            ax.bar(0, v, bottom=bottom, color=f"C{c.arms.index(a) if a in c.arms else j}", label=f"arm {a}", width=0.5)
            bottom += v
        lo, hi = (np.nan if v is None else v for v in d["sum_ci"])
        top = 1.4 * max(1.0, bottom)  # a wide interval is cut at the top, its end written there
        if np.isfinite(lo) and np.isfinite(hi):
            ax.errorbar(0, d["sum"], yerr=[[d["sum"] - lo], [min(hi, top) - d["sum"]]], color="k", capsize=6,
                        label="sum, 95% CI")
            if hi > top:
                ax.annotate(f"CI up to {hi:.3g}", (0, top), xytext=(6, -12), textcoords="offset points", fontsize=8)
        ax.set_ylim(0, top * 1.02)
        ax.axhline(1.0, color="k", ls="--", lw=1, label="Var(all)")  # C3 is an arm's colour (augmentation's)
        ax.set_xticks([])
        ax.set_xlim(-0.8, 0.8)
        ax.set_xlabel("one-source arms, stacked")
        ax.set_ylabel("share of Var(all) (fraction)")
        ax.set_title(f"{labels.get(name, name)}: sum {d['sum']:.2f}, non-additivity {d['non_additivity']:+.2f}",
                     fontsize=9)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.suptitle("Variance decomposition: each source alone, as a share of all sources together\n95% CI of the "
                 f"sum: {interval_name('decomposition')}", fontsize=9, wrap=True)  # one line overran the figure
    return "decomposition", fig


def _test_curves(c: _Context):
    """Test scores over training (``study.eval_every``): every replica's curve, one panel per arm."""
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    curves = list(_stored(c, "history", "test_epochs"))
    if not curves:
        return None
    name = "test_accuracy" if "test_accuracy" in curves[0][2] else "test_mse"
    cols = min(4, len(curves))
    rows = -(-len(curves) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 3 * rows), squeeze=False, sharey=True)
    for ax, (i, a, h) in zip(axes.ravel(), curves):
        ep, v = h["test_epochs"], h[name] * (100 if name == "test_accuracy" else 1)
        for r in range(len(v)):
            ax.plot(ep, v[r], color=f"C{i}", lw=0.8, alpha=0.6)
        ax.plot(ep, np.nanmean(v, 0), color="k", lw=1.8, label="mean over replicas")
        ax.set_title(f"arm {a}", fontsize=10)
        ax.set_xlabel("epoch")
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    for ax in axes.ravel()[len(curves):]:
        ax.axis("off")
    for ax in axes[:, 0]:
        ax.set_ylabel("test accuracy (%)" if name == "test_accuracy" else "test MSE (targets' units²)")
    axes[0, 0].legend(fontsize=8)
    fig.suptitle("Test scores over training, one line per replica")
    return "test_curves", fig


def _dynamics(c: _Context):
    """Divergence dynamics of replicas 0 and 1, every k steps."""
    import matplotlib.pyplot as plt

    traces = list(_stored(c, "dynamics", "weight_distance"))
    if not traces:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    for i, a, t in traces:
        step, wd, dis = t["step"], t["weight_distance"], t["disagreement"]
        style = {"color": f"C{i}", "ls": LINESTYLES[i % len(LINESTYLES)], "label": a}
        ax1.plot(step, np.where(wd > 0, wd, np.nan), **style)
        ax2.plot(step, dis * 100, **style)
    ax1.set_yscale("log")
    ax1.set_xlabel("training step")
    ax1.set_ylabel("||θ0 − θ1|| / ||θ0|| (relative)")
    ax1.set_title("Weight distance of replicas 0 and 1, per arm")
    ax2.set_xlabel("training step")
    ax2.set_ylabel("prediction disagreement on probe images (%)")
    ax2.set_title("Disagreement of replicas 0 and 1, per arm")
    ax1.legend(fontsize=8, title="arm", title_fontsize=8)
    return "dynamics", fig


def _lmc(c: _Context):
    """LMC error curves; arms whose barrier is tiny next to the largest get a zoomed panel of their own."""
    import matplotlib.pyplot as plt

    lmc = [(i, a, p["lmc_alphas"], p["lmc_curves"].mean(0) * 100) for i, a, p in _stored(c, "pairs", "lmc_curves")]
    if not lmc:
        return None
    barrier = {a: float(np.max(v - np.interp(al, [al[0], al[-1]], [v[0], v[-1]]))) for _, a, al, v in lmc}
    top = max(barrier.values())
    small = [a for a in barrier if barrier[a] < 0.1 * top] if top > 0 else []
    panels = [("all arms", [a for _, a, _, _ in lmc])]
    bn = "; BatchNorm recomputed" if _has_batch_norm(c.run) else ""
    if 0 < len(small) < len(lmc):
        panels.append((f"zoom: arms with a barrier under {0.1 * top:.2g} pp", small))
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4), squeeze=False)
    for ax, (title, show) in zip(axes[0], panels):
        for i, a, alphas, curve in lmc:
            if a in show:
                ax.plot(alphas, curve, marker=MARKERS[i % len(MARKERS)], ms=4 + 1.5 * (i % 3), mfc="none",
                        label=a, color=f"C{i}", ls=LINESTYLES[i % len(LINESTYLES)])
        ax.set_xlabel(f"α (weights θb + α(θa − θb){bn})")
        ax.set_ylabel("test error (%), mean over pairs")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8, title="arm", title_fontsize=8)
    fig.suptitle("Linear interpolation between replicas")
    return "lmc", fig


def _instrument_dashboards(c: _Context):
    """Cockpit-style dashboards of the arms trained with instruments."""
    for arm, rec in c.records.items():
        path = RunPaths(c.run).listed_file("instruments", arm, rec)
        if path is not None:
            from nondet_jax.instruments.dashboard import dashboard

            values = read_arrays(path)
            yield f"instruments_{arm}", dashboard(values, title=f"arm {arm}: instruments")


def _value_axis(ax) -> None:
    """Log scale with plain decade labels where the values span a decade or more; otherwise linear
    with plain numbers (a log axis over a narrow range labels ticks like 1.0746×10^0)."""
    import matplotlib.ticker as mt

    ys = np.concatenate([ln.get_ydata() for ln in ax.get_lines()]).astype(float)
    ys = ys[np.isfinite(ys) & (ys > 0)]
    if len(ys) and ys.max() / ys.min() >= 10:
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(mt.LogLocator(base=10))
        ax.yaxis.set_minor_formatter(mt.NullFormatter())
    else:
        ax.yaxis.set_major_formatter(mt.ScalarFormatter(useOffset=False))
