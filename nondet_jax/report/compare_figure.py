"""The figure ``compare --plot`` draws."""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np

from nondet_jax.analysis import stats as S
from nondet_jax.analysis.compare import verdict


def method_name(w: dict) -> str:
    """A method's short name in a figure: its run folder's or CSV file's name, with the arm or column."""
    base = Path(str(w.get("source", "?"))).name or str(w.get("source", "?"))
    return f"{base} ({w['arm']})" if w.get("kind") == "run" else f"{base} ({w.get('column', '?')})"


def plot_result(r: dict):
    """The comparison as a figure (returned, not saved): each method's per-seed scores with the mean and
    its t interval; the difference of means with its Welch interval against 0; the probability of
    improvement with its interval against ½ (no difference). Methods are named (their folder's or file's
    name), and every title names its interval as a reader would check it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker  # noqa: F401 - matplotlib.ticker.MaxNLocator below

    fig, (ax, ad, ap) = plt.subplots(1, 3, figsize=(10, 3.6), gridspec_kw={"width_ratios": [1.2, 1, 1]})
    what = r["a"].get("metric") or r["a"].get("column") or "score"
    paired, op = bool(r.get("paired")), ">" if r["higher_is_better"] else "<"
    rng = np.random.default_rng(0)
    for i, (_name, w) in enumerate((("A", r["a"]), ("B", r["b"]))):
        x = np.asarray(w["scores"])
        lo, hi = S.mean_ci(x)
        ax.scatter(i + (np.zeros(len(x)) if paired else rng.uniform(-0.1, 0.1, len(x))), x, s=16, alpha=0.8,
                   color=f"C{i}")
        ax.errorbar(i + 0.25, x.mean(), yerr=[[x.mean() - lo], [hi - x.mean()]], fmt="o", color="k", capsize=4)
    if paired:  # one line per seed: A's score to B's
        for ya, yb in zip(r["a"]["scores"], r["b"]["scores"]):
            ax.plot([0, 1], [ya, yb], color="0.6", lw=0.8, zorder=0)
    a_name, b_name = method_name(r["a"]), method_name(r["b"])
    ax.set_xticks([0, 1], [f"A: {a_name}\nn={r['n_a']}", f"B: {b_name}\nn={r['n_b']}"], fontsize=8)
    ax.set_xlim(-0.5, 1.6)
    ax.set_ylabel(what)
    t_level = f"{100 * (1 - S.MEAN_TAIL * (1 - S.LEVEL) / 2):.2f}%"  # the widened t's quantile
    as_scipy = f"{100 * (1 - S.MEAN_TAIL * (1 - S.LEVEL)):.1f}%"  # the level scipy's t.interval gives it at
    ax.set_title(f"per-seed scores; mean, {as_scipy} t interval (t at {t_level}: widened from 95%)", fontsize=9)
    b_minus_a = f"{b_name} − {a_name}"
    for axis, value, (lo, hi), null, title, unit in (
            (ad, r["difference"], r["difference_ci"], 0.0,
             f"mean difference over seed pairs\n{b_minus_a}\n(95% CI: paired t, scipy's ttest_rel)" if paired else
             f"difference of means\n{b_minus_a}\n(Welch 95% CI)", f"{what}, B − A"),
            (ap, r["probability_of_improvement"], r["probability_of_improvement_ci"], 0.5,
             f"share of seeds with B {op} A\n(B: {b_name})\n(Wilson 95% CI)" if paired else
             f"P(B {op} A), one run each\n(B: {b_name})\n(Newcombe 95% CI)", "probability")):
        axis.errorbar([value], [0], xerr=[[value - lo], [hi - value]], fmt="o", color="k", capsize=5)
        axis.axvline(null, color="C3", lw=1, ls="--", label="no difference")
        left, right = min(lo, null), max(hi, null)
        pad = 0.1 * (right - left) or 0.01
        axis.set_xlim(left - pad, right + pad)
        axis.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(4))
        axis.set_yticks([])
        axis.set_title(title, fontsize=9)
        axis.set_xlabel(unit, fontsize=8)
    ap.set_xlim(-0.02, 1.02)
    ap.legend(fontsize=8, loc="lower left")
    fig.suptitle(textwrap.fill(verdict(r), 150), fontsize=9)  # a long verdict on lines, not cut at the edges
    fig.tight_layout()
    return fig
