"""``python -m nondet_jax.report RUN_DIR``: summary, per-arm table, figures and ``report.md``
from the stored results of a run folder, without training.

Writes ``summary.json``, ``arms.csv``, ``figures/*.png`` and ``report.md``.
"""

from __future__ import annotations

import csv
import io
import json
import sys
from pathlib import Path

import numpy as np

from nondet_jax.errors import UsageError
from nondet_jax.store import RunPaths

LINESTYLES = ("-", "--", ":", "-.")  # arms with equal curves (init and all, say) stay visible
MARKERS = ("o", "s", "^", "v", "D", "P", "X", "*", "<", ">")  # hollow, one per arm: overlapping curves show both


def _fmt(x, digits=4) -> str:
    return "—" if x is None or (isinstance(x, float) and not np.isfinite(x)) else f"{x:.{digits}f}"


def _pct(x) -> str:
    """A fraction as a percentage with 2 decimals; "—" when missing."""
    return _fmt(None if x is None else x * 100, 2)


def _ci(ci, digits=4, scale=1.0) -> str:
    from nondet_jax.stats import format_ci

    return format_ci(ci, digits, scale)


def load_records(run: Path) -> tuple[dict, dict[str, dict]]:
    """The run's config and the records of its finished arms, in the config's arm order."""
    from nondet_jax.store import check_no_links, read_arm_record, verify_arm_files

    paths = RunPaths(run)
    cfg_path = paths.config
    if not run.is_dir() or not cfg_path.exists():
        raise UsageError(f"{run} is not a nondet_jax run folder (no config.json); pass the --out folder of a sweep")
    check_no_links(run)
    try:
        config = json.loads(cfg_path.read_text())
        arms = config["study"]["arms"]
    except (OSError, json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise UsageError(f"{cfg_path} is unreadable or corrupt ({type(e).__name__}); rerun the sweep into a new "
                         "--out") from None
    records = {a: verify_arm_files(run, a, read_arm_record(run, a)) for a in arms
               if paths.arm_file("arms", a).exists()}
    if not records:
        raise UsageError(f"{run} has no finished arms yet; run the sweep to completion first")
    return config, records


def build_summary(run: Path) -> tuple[dict, dict[str, dict]]:
    """Per-arm metrics plus each arm's spread relative to the ``all`` arm; and the arm records."""
    from nondet_jax.analysis import compare_arms
    from nondet_jax.stats import METHODS

    config, records = load_records(run)
    env_path = RunPaths(run).environment
    try:
        env = json.loads(env_path.read_text()) if env_path.exists() else {}
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        env = None
    if not isinstance(env, dict):
        raise UsageError(f"{env_path} is unreadable or not a JSON object; rerun the sweep on the same --out, which "
                         "writes it again")
    return {
        "study": str(run),
        "dataset": config["data"]["name"], "model": config["model"]["name"],
        "epochs": config["train"]["epochs"], "seed": config["study"]["seed"],
        "backend": env.get("backend"), "device_kind": env.get("device_kind"),
        "std_ddof": 1, "ci_level": 0.95, "ci_methods": METHODS,
        "arms": {a: {k: v for k, v in rec.items() if k != "rows"} for a, rec in records.items()},
        "vs_all": compare_arms(records),
        "mitigations": mitigation_results(run, records),
    }, records


def _healthy(record: dict) -> set[int]:
    return {row["replica"] for row in record["rows"] if row.get("diverged_at_step", -1) < 0}


def _load(path: Path) -> np.ndarray:
    """A stored array (never unpickled); UsageError naming the file when it is not a plain .npy array."""
    try:
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise UsageError(f"{path} is not a readable array file ({str(e).splitlines()[0][:80]}); rerun the sweep on "
                         "the same --out to write it again") from None


def mitigation_results(run: Path, records: dict[str, dict]) -> dict[str, dict]:
    """Per plain arm with a mitigation stored: its variants' metrics (nondet_jax.mitigations).

    Variants: ``single`` (the arm's logits), ``tta:<views>`` (same models, test-time augmentation),
    ``snapshotK`` (arm@snapshotK: the mean of each replica's K cycle-end logits, same training
    epochs) and ``snapshotK last`` (its final snapshot alone). Replica r of the two arms shares
    every key, so the comparison is paired; replicas that diverged in either are left out.
    """
    from nondet_jax.mitigations import mitigation_metrics, snapshot_ensemble
    from nondet_jax.sources import split_variant

    paths = RunPaths(run)
    if not paths.test_labels.exists():
        return {}
    labels = _load(paths.test_labels)
    out = {}
    for arm, rec in records.items():
        if split_variant(arm)[1]:
            continue
        snaps = {other: split_variant(other)[1] for other in records
                 if split_variant(other)[0] == arm and split_variant(other)[1]}
        keep = sorted(_healthy(rec).intersection(*(_healthy(records[o]) for o in snaps)))
        if not keep:
            continue
        variants = {"single": _load(paths.arm_file("logits", arm))[keep]}
        if paths.arm_file("tta", arm).exists():
            with np.load(paths.arm_file("tta", arm), allow_pickle=False) as f:
                variants.update({f"tta:{name}": f[name][keep] for name in f.files})
        for other, k in snaps.items():
            variants[f"snapshot{k}"] = snapshot_ensemble(_load(paths.arm_file("snapshots", other))[keep])
            variants[f"snapshot{k} last"] = _load(paths.arm_file("logits", other))[keep]
        if len(variants) > 1:
            out[arm] = mitigation_metrics(variants, labels)
    return out


def _x100(x):
    """A fraction as a percentage (None stays None)."""
    return None if x is None else 100 * x


def _ci_cols(name: str, ci, unit: str = "", scale=lambda v: v) -> dict:
    """``name_ci_low<unit>``, ``name_ci_high<unit>`` of a [low, high] interval; empty cells where n/a."""
    lo, hi = (ci or [None, None])
    return {f"{name}_ci_low{unit}": scale(_finite(lo)), f"{name}_ci_high{unit}": scale(_finite(hi))}


# Units of the tables (arms.csv, replicas.csv, StudyResult.table/.rows): accuracy-like quantities in %, as
# in the report and the figures, cross-entropy in nats; the unit ends the column name (_pct, _nats), and a
# name without one is a ratio, correlation, similarity or p-value.
_PAIR_COLUMNS = {"disagreement": "_pct", "pearson": "", "spearman": "", "ensemble_gain_accuracy": "_pct",
                 "ensemble_gain_cross_entropy": "_nats", "cka": "", "weight_distance": "", "lmc_barrier": "_pct"}


def arm_rows(summary: dict) -> list[dict]:
    """One flat row per arm (the ``arms.csv`` table); units in the column names (see ``_PAIR_COLUMNS``)."""
    rows = []
    for arm, a in summary["arms"].items():
        m = a["metrics"]  # empty when every replica diverged: the row says so, its numbers are empty (n/a)
        row = {"arm": arm, "varied": "+".join(a["varied"]) or "none", "replicas": a["replicas"],
               "diverged": len(a.get("diverged", [])),
               "diverged_at_steps": " ".join(f"{d['replica']}@{d['step']}" for d in a.get("diverged", []))}
        for q, unit, scale in (("accuracy", "_pct", _x100), ("cross_entropy", "_nats", lambda v: v)):
            s = m.get(q, {})
            row.update({f"{q}_mean{unit}": scale(s.get("mean")), f"{q}_std{unit}": scale(s.get("std")),
                        **_ci_cols(f"{q}_std", s.get("std_ci"), unit, scale)})
        row["independent_errors_std_pct"] = _x100(m.get("independent_errors_std"))
        vs = summary["vs_all"].get(arm)
        for q in ("accuracy", "cross_entropy"):
            c = vs[q] if vs else {}
            row.update({f"{q}_std_ratio_vs_all": c.get("ratio"), **_ci_cols(f"{q}_ratio", c.get("ratio_ci")),
                        f"{q}_f_test_p": c.get("f_test_p"), f"{q}_brown_forsythe_p": c.get("brown_forsythe_p"),
                        f"{q}_replicas_for_80pct_power": c.get("replicas_for_80pct_power")})
        for name, unit in _PAIR_COLUMNS.items():
            scale = _x100 if unit == "_pct" else (lambda v: v)
            row[f"{name}{unit}"] = scale(m[name]["mean"]) if name in m else None
            if name != "lmc_barrier":  # same units as the mean; empty where "n/a" (R < 3)
                row.update(_ci_cols(name, (m.get(name) or {}).get("ci"), unit, scale))
        row.update({"strategy": a["strategy"], "seconds": a["seconds"]})
        rows.append(row)
    return rows


def replica_rows(rows: list[dict]) -> list[dict]:
    """The stored per-replica rows (fractions, as in ``arms/<arm>.json``) in the tables' units: the
    ``replicas.csv`` table and ``StudyResult.rows``."""
    units = {"test_accuracy": "_pct", "train_accuracy": "_pct", "test_loss": "_nats", "train_loss": "_nats"}
    return [{k + units.get(k, ""): (_x100(v) if units.get(k) == "_pct" else v) for k, v in row.items()}
            for row in rows]


def _finite(x):
    """x, or None where it is NaN or infinite (strict JSON has no NaN; CSV shows an empty cell)."""
    return None if isinstance(x, float) and not np.isfinite(x) else x


def strict_json(obj):
    """``obj`` with every non-finite float replaced by None, so ``json.dumps(allow_nan=False)`` holds."""
    if isinstance(obj, dict):
        return {k: strict_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict_json(v) for v in obj]
    if isinstance(obj, (np.floating, np.integer)):
        obj = obj.item()
    return _finite(obj)


def _write_csv(path: Path, rows: list[dict]) -> None:
    from nondet_jax.store import atomic_write_bytes

    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(rows[0]), lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    atomic_write_bytes(path, buf.getvalue().encode())


def format_table(summary: dict) -> str:
    """The main per-arm table (plain text): printed by the sweep, embedded in the report."""
    head = (f"{'arm':<13}{'R':>3} {'accuracy %':>10} {'acc std % [95% CI]':>22} {'ratio vs all':>12} {'p(F)':>6}"
            f" {'CE std [95% CI]':>24} {'disagree %':>10} {'CKA':>6} {'LMC bar. %':>10}")
    lines = [head, "-" * len(head)]
    for arm, a in summary["arms"].items():
        m = a["metrics"]
        vs = summary["vs_all"].get(arm, {}).get("accuracy", {})
        if not m:
            lines.append(f"{arm:<13}{0:>3} {'n/a':>10}  every replica diverged, nothing left to measure (see below)")
            continue
        acc, ce = m["accuracy"], m["cross_entropy"]
        lines.append(
            f"{arm:<13}{a.get('replicas_used', a['replicas']):>3} {acc['mean'] * 100:>10.2f} "
            f"{acc['std'] * 100:>6.2f}{_ci(acc['std_ci'], 2, 100):<16} {_fmt(vs.get('ratio'), 2):>12} "
            f"{_fmt(vs.get('f_test_p'), 3):>6} {ce['std']:>7.4f}{_ci(ce['std_ci']):<17} "
            f"{_pct(m.get('disagreement', {}).get('mean')):>10} {_fmt(m.get('cka', {}).get('mean'), 3):>6} "
            f"{_pct(m.get('lmc_barrier', {}).get('mean')):>10}")
    lines.append("std: sample std over replicas (ddof=1), chi-square 95% CI (normal data; n/a below R=2); ratio: "
                 "accuracy std / the all arm's, two-sided F-test p; CE in nats; disagreement and LMC barrier "
                 "(test error) in %, mean over pairs")
    diverged = {arm: a["diverged"] for arm, a in summary["arms"].items() if a.get("diverged")}
    if diverged:
        lines.append("diverged (left out of every metric; R counts the rest): " + "; ".join(
            f"{arm} {len(d)} of {summary['arms'][arm]['replicas']} (replica "
            + ", ".join(f"{x['replica']} at step {x['step']}" + (" with non-finite outputs" if x.get("cause") == "outputs"
                        else "") for x in d) + ")" for arm, d in diverged.items()))
    return "\n".join(lines)


def _stored(run: Path, arms: list[str], folder: str, key: str):
    """(index, arm, arrays) for each arm whose ``folder/<arm>.npz`` holds ``key``."""
    for i, arm in enumerate(arms):
        path = RunPaths(run).arm_file(folder, arm, ".npz")
        if path.exists():
            with np.load(path) as f:
                if key in f.files:
                    yield i, arm, {k: f[k] for k in f.files}


def make_figures(run: Path, summary: dict, records: dict[str, dict]) -> list[str]:
    """Write the report's figures; returns their paths relative to the run folder."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker  # noqa: F401 - matplotlib.ticker.MaxNLocator below

    figdir = RunPaths(run).figures
    figdir.mkdir(exist_ok=True)
    arms = list(summary["arms"])
    x = np.arange(len(arms))
    made = []

    def save(fig, name):
        from nondet_jax.store import atomic_write_bytes

        import warnings

        buf = io.BytesIO()
        if fig.get_layout_engine() is None:  # the dashboard brings its own (constrained) layout
            with warnings.catch_warnings():  # matplotlib's layout notes are not the user's business
                warnings.simplefilter("ignore")
                fig.tight_layout()
        fig.savefig(buf, format="png", dpi=110)
        plt.close(fig)
        atomic_write_bytes(figdir / f"{name}.png", buf.getvalue())
        made.append(f"figures/{name}.png")

    # 1. accuracy of every replica, per arm (strip + violin)
    fig, ax = plt.subplots(figsize=(1.3 * len(arms) + 2, 4))
    healthy = [sorted(_healthy(records[a])) for a in arms]
    accs = [np.array([r["test_accuracy"] for r in records[a]["rows"] if r["replica"] in h], float) * 100
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
    ax.set_ylabel("test accuracy (%)")
    ax.set_title("Test accuracy of each replica (line: mean)")
    save(fig, "accuracy")

    # 2. std with CI bars, accuracy and cross-entropy, with the independent-errors baseline
    fig, axes = plt.subplots(1, 2, figsize=(2 * (0.8 * len(arms) + 2), 4))
    for ax, q, scale, label in ((axes[0], "accuracy", 100, "std of test accuracy (%)"),
                                (axes[1], "cross_entropy", 1, "std of test cross-entropy (nats)")):
        spread = [summary["arms"][a]["metrics"].get(q, {}) for a in arms]  # {} for an arm that fully diverged
        s = np.array([m.get("std", np.nan) for m in spread], dtype=float) * scale
        ci = np.array([m.get("std_ci", [np.nan, np.nan]) for m in spread], dtype=float) * scale
        base = np.array([summary["arms"][a]["metrics"].get("independent_errors_std", np.nan) for a in arms],
                        dtype=float) * scale if q == "accuracy" else np.full(len(arms), np.nan)
        # Few replicas give upper CI ends many times the std (32x at R=2): the axis stops at 3x the largest
        # std, and a whisker that goes on is cut there with its end written above it.
        top = 3 * np.nanmax(np.concatenate([s, base, [0.0]]))
        cut = ci[:, 1] > top if top > 0 else np.zeros(len(arms), bool)
        high = np.where(cut, top, ci[:, 1])
        err = np.clip(np.abs(np.stack([s - ci[:, 0], high - s])), 0, None)
        ax.bar(x, s, yerr=err, capsize=4, color="C1")  # no bar where the CI is n/a (NaN), never a 0-width one
        for i in np.flatnonzero(cut):
            ax.annotate(f"↑ {ci[i, 1]:.3g}", (i, top), ha="center", va="bottom", fontsize=8, xytext=(0, 2),
                        textcoords="offset points")
        if cut.any():
            ax.set_ylim(0, top * 1.12)
        for i in np.flatnonzero(np.isnan(s)):
            ax.text(i, 0, "n/a", ha="center", va="bottom", fontsize=8, color="C3")
        if q == "accuracy":
            ax.scatter(x, base, marker="D", s=36, facecolor="white", edgecolor="k", zorder=3,
                       label="test-set sampling alone (independent-errors baseline)")
            ax.legend(fontsize=8, loc="lower left", bbox_to_anchor=(0, 1.0), frameon=False)
        ax.set_xticks(x, arms, rotation=30, ha="right")
        ax.set_ylabel(label)
    fig.suptitle("Spread across replicas, with 95% chi-square CIs")
    save(fig, "spread")

    # 3. pairwise diversity per arm
    names = [("disagreement", "pairwise disagreement (%)", 100), ("cka", "linear CKA of features (0 to 1)", 1),
             ("ensemble_gain_accuracy", "2-model ensemble gain in accuracy (pp)", 100)]
    if any("disagreement" in summary["arms"][a]["metrics"] for a in arms):
        fig, axes = plt.subplots(1, 3, figsize=(3 * (0.7 * len(arms) + 1.8), 4))
        for ax, (key, label, scale) in zip(axes, names):
            vals = np.array([summary["arms"][a]["metrics"].get(key, {}).get("mean", np.nan) for a in arms],
                            dtype=float) * scale
            ci = np.array([summary["arms"][a]["metrics"].get(key, {}).get("ci", [np.nan, np.nan]) for a in arms],
                          dtype=float) * scale
            err = np.clip(np.abs(np.stack([vals - ci[:, 0], ci[:, 1] - vals])), 0, None)  # NaN (n/a): no bar
            ax.bar(x, vals, yerr=err, capsize=4, color="C2")
            ax.set_xticks(x, arms, rotation=30, ha="right")
            ax.set_title(label, fontsize=10)
        few = [a for a in arms if 0 < summary["arms"][a].get("replicas_used", summary["arms"][a]["replicas"]) < 3]
        fig.suptitle("Diversity between replicas (mean over pairs, replica-jackknife 95% CI"
                     + ("; no CI below 3 replicas: " + ", ".join(few) if few else "") + ")")
        save(fig, "diversity")

    # 4. weight divergence over training
    fig, ax = plt.subplots(figsize=(6.5, 4))
    plotted = False
    for i, a, h in _stored(run, arms, "history", "weight_distance"):
        wd = h["weight_distance"]
        if wd.shape[1] == 0:
            continue
        mean = wd.mean(1)
        if (mean > 0).any():
            ax.plot(np.arange(len(mean)), np.where(mean > 0, mean, np.nan), marker=MARKERS[i % len(MARKERS)],
                    ms=4 + 1.5 * (i % 3), mfc="none", label=a, color=f"C{i}", ls=LINESTYLES[i % len(LINESTYLES)])
            plotted = True
    if plotted:
        _value_axis(ax)
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        ax.set_xlabel("epoch (0 = initial weights)")
        ax.set_ylabel("||θa − θb|| / ||θa||, mean over pairs")
        ax.set_title("Weight-space divergence (arms at 0 are not drawn)")
        ax.legend(fontsize=8)
        save(fig, "divergence")
    else:
        plt.close(fig)

    # 5. divergence dynamics of replicas 0 and 1, every k steps
    traces = list(_stored(run, arms, "dynamics", "weight_distance"))
    if traces:
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
        for i, a, t in traces:
            step, wd, dis = t["step"], t["weight_distance"], t["disagreement"]
            style = {"color": f"C{i}", "ls": LINESTYLES[i % len(LINESTYLES)], "label": a}
            ax1.plot(step, np.where(wd > 0, wd, np.nan), **style)
            ax2.plot(step, dis * 100, **style)
        ax1.set_yscale("log")
        ax1.set_xlabel("training step")
        ax1.set_ylabel("||θ0 − θ1|| / ||θ0||")
        ax1.set_title("Weight distance of replicas 0 and 1")
        ax2.set_xlabel("training step")
        ax2.set_ylabel("prediction disagreement on probe images (%)")
        ax2.set_title("Disagreement of replicas 0 and 1")
        ax1.legend(fontsize=8)
        save(fig, "dynamics")

    # 6. LMC error curves; arms whose barrier is tiny next to the largest get a zoomed panel of their own
    lmc = [(i, a, p["lmc_alphas"], p["lmc_curves"].mean(0) * 100) for i, a, p in _stored(run, arms, "pairs", "lmc_curves")]
    if lmc:
        barrier = {a: float(np.max(c - np.interp(al, [al[0], al[-1]], [c[0], c[-1]]))) for _, a, al, c in lmc}
        top = max(barrier.values())
        small = [a for a in barrier if barrier[a] < 0.1 * top] if top > 0 else []
        panels = [("all arms", [a for _, a, _, _ in lmc])]
        if 0 < len(small) < len(lmc):
            panels.append((f"zoom: arms with a barrier under {0.1 * top:.2g} pp", small))
        fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4), squeeze=False)
        for ax, (title, show) in zip(axes[0], panels):
            for i, a, alphas, curve in lmc:
                if a in show:
                    ax.plot(alphas, curve, marker=MARKERS[i % len(MARKERS)], ms=4 + 1.5 * (i % 3), mfc="none",
                            label=a, color=f"C{i}", ls=LINESTYLES[i % len(LINESTYLES)])
            ax.set_xlabel("α (weights θb + α(θa − θb); BatchNorm recomputed)")
            ax.set_ylabel("test error (%), mean over pairs")
            ax.set_title(title, fontsize=10)
            ax.legend(fontsize=8)
        fig.suptitle("Linear interpolation between replicas")
        save(fig, "lmc")
    for arm in records:  # Cockpit-style dashboards of the arms trained with instruments
        path = RunPaths(run).arm_file("instruments", arm)
        if path.exists():
            from nondet_jax.instruments.dashboard import dashboard

            with np.load(path, allow_pickle=False) as f:
                values = {k: f[k] for k in f.files}
            save(dashboard(values, title=f"arm {arm}: instruments"), f"instruments_{arm}")
    return made


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


def _comparison_md(summary: dict) -> list[str]:
    vs = summary["vs_all"]
    if not vs:
        return ["(No `all` arm in this study: no ratios to it.)", ""]
    lines = ["| arm | accuracy std ratio [95% CI] | F-test p | Brown–Forsythe p | R for 80% power "
             "| CE std ratio [95% CI] | F-test p | Brown–Forsythe p |", "|---|---|---|---|---|---|---|---|"]
    for arm, c in vs.items():
        a, l_ = c["accuracy"], c["cross_entropy"]
        lines.append(f"| {arm} | {_fmt(a['ratio'], 2)}{_ci(a['ratio_ci'], 2)} | {_fmt(a['f_test_p'], 3)} | "
                     f"{_fmt(a['brown_forsythe_p'], 3)} | {a['replicas_for_80pct_power'] or '—'} | "
                     f"{_fmt(l_['ratio'], 2)}{_ci(l_['ratio_ci'], 2)} | {_fmt(l_['f_test_p'], 3)} | "
                     f"{_fmt(l_['brown_forsythe_p'], 3)} |")
    return lines + [""]


def _dynamics_md(summary: dict) -> list[str]:
    rows = [(a, r["dynamics"]) for a, r in summary["arms"].items() if "dynamics" in r]
    if not rows:
        return []
    lines = ["## Divergence dynamics", "",
             "Replicas 0 and 1 of each arm, traced every k steps; growth rate λ of the weight distance fitted as "
             "log d = log d0 + λ·step over the early phase (until half the largest distance), ± its standard error.",
             "", "| arm | every k steps | λ per step ± s.e. | fitted steps | points |", "|---|---|---|---|---|"]
    for a, d in rows:
        w = d["window"]
        lines.append(f"| {a} | {d['every']} | {_fmt(d['rate_per_step'], 4)} ± {_fmt(d['stderr'], 4)} | "
                     f"{_fmt(w[0], 0) if w[0] is not None else '—'}–{_fmt(w[1], 0) if w[1] is not None else '—'} | "
                     f"{d['points']} |")
    return lines + [""]


def _findings(summary: dict) -> list[str]:
    """Plain statements read off the numbers (no tuning, no interpretation beyond the CI)."""
    vs = summary["vs_all"]
    out = []
    for arm, c in vs.items():
        if arm == "control":
            continue
        a = c["accuracy"]
        lo, hi = a["ratio_ci"]
        if not np.isfinite(a["ratio"]):
            continue
        where = ("includes 1: not distinguishable from all sources together" if lo <= 1 <= hi else
                 "lies below 1: less spread than all sources together" if hi < 1 else
                 "lies above 1: more spread than all sources together")
        out.append(f"- `{arm}`: accuracy std is {a['ratio']:.2f}× the `all` arm's; the 95% CI "
                   f"[{lo:.2f}, {hi:.2f}] {where} (F-test p = {a['f_test_p']:.3f}).")
    for arm in ("control", "hardware"):
        rec = summary["arms"].get(arm)
        if rec:
            same = rec.get("replicas_bitwise_identical")
            what = "nothing varies" if arm == "control" else "seeds fixed, XLA determinism flags off"
            out.append(f"- `{arm}` ({what}): replicas {'are' if same else 'are NOT'} bitwise identical "
                       f"on {summary.get('backend')}.")
    if "hardware" in summary["arms"] and summary["arms"]["hardware"].get("replicas_bitwise_identical"):
        out.append(f"- {summary.get('backend')} gave no hardware nondeterminism to measure: `batch_order` (the order "
                   "of examples, hence of floating-point reductions, inside each minibatch) is its simulated stand-in.")
    return out


def _mitigations_md(summary: dict) -> list[str]:
    if not summary.get("mitigations"):
        return []
    from nondet_jax.mitigations import mitigation_table

    return ["## Mitigations: single models, test-time augmentation, snapshot ensembles", "",
            "Same replicas (paired by key) evaluated as variants: `single` is the trained arm; `tta:<views>` the "
            "same models averaged over test-time views; `snapshotK` the arm retrained with K cosine cycles in the "
            "same epochs (equal training cost), its K cycle-end logits averaged; `snapshotK last` that run's final "
            "snapshot alone. The std ratio is to `single` (F-test p).", "",
            mitigation_table(summary["mitigations"]), ""]


def write_report(run: str | Path, command: str | None = None) -> dict:
    """Rebuild ``summary.json``, ``arms.csv``, figures and ``report.md`` from stored results."""
    from nondet_jax.store import atomic_write_bytes, atomic_write_json

    from nondet_jax.stats import METHODS

    run = Path(run)
    paths = RunPaths(run)
    import warnings

    with warnings.catch_warnings():  # zero-spread arms (control) make scipy's tests divide by 0: reported as n/a
        warnings.simplefilter("ignore", RuntimeWarning)
        summary, records = build_summary(run)
    if paths.figures.exists() and not paths.figures.is_dir():
        raise UsageError(f"{paths.figures} is a file, but the report writes its figures into a folder of that name; "
                         "move the file away and rebuild the report")
    atomic_write_json(paths.summary, strict_json(summary))
    _write_csv(paths.arms_csv, [strict_json(row) for row in arm_rows(summary)])
    figures = make_figures(run, summary, records)
    if command is None and paths.command.exists():
        command = paths.command.read_text().strip()
    md = [f"# Variability study: {summary['model']} on {summary['dataset']}", ""]
    if command:
        md += ["Made by:", "", "```", command, "```", ""]
    md += [f"{len(summary['arms'])} arms, {summary['epochs']} epochs, seed {summary['seed']}, backend "
           f"{summary['backend']} ({summary['device_kind']}). Every number below is read from this folder's "
           "stored results (`python -m nondet_jax.report` rebuilds this page).", "",
           "## Per-arm table", "", "```", format_table(summary), "```", "",
           "Full per-arm table: `arms.csv`; one row per replica: `replicas.csv`.", "",
           "## Spread relative to the `all` arm", "", *_comparison_md(summary),
           "## What the numbers say", "", *(_findings(summary) or ["- (nothing to compare)"]), "",
           *_dynamics_md(summary),
           *_mitigations_md(summary),
           "## Figures", ""]
    md += [f"![{Path(f).stem}]({f})" for f in figures]
    md += ["", "## Definitions", "",
           "- std: sample standard deviation over replicas (ddof=1); 95% CI: " + METHODS["std"] + "; mean: "
           + METHODS["mean"] + ". Both n/a below R=2.",
           "- Pairwise metrics (disagreement, Pearson/Spearman of flattened logits, 2-model ensemble gain, linear CKA "
           "of penultimate features, weight distance ||θa−θb||/||θa||): mean over the R(R−1)/2 pairs; 95% CI: "
           + METHODS["pairwise"] + "; n/a below R=3.",
           "- LMC barrier: max over α of test error at θb+α(θa−θb), BatchNorm statistics recomputed on training "
           "data at each point, minus the mean endpoint error; on disjoint pairs (0,1), (2,3), ...",
           "- Independent-errors baseline: sqrt(Σ p_i(1−p_i)·R/(R−1))/n, the accuracy std that test-set sampling "
           "alone explains (Jordan 2023), p_i example i's error rate over the R replicas (R/(R−1) makes the "
           "variance unbiased).",
           "- Ratio vs all: std(arm)/std(all) with an F-distribution CI, two-sided F-test and Brown–Forsythe "
           "p-values, and the replicas per arm the F-test needs for 80% power at the observed ratio.", ""]
    atomic_write_bytes(paths.report, "\n".join(md).encode())
    return summary


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    from nondet_jax.__main__ import prog_name

    prog = prog or prog_name("nondet_jax.report", "nondet-jax-report")
    from nondet_jax.errors import OneLineParser

    p = OneLineParser(prog=prog,
                                description="Rebuild the report of a run folder from its stored results.")
    p.add_argument("run_dir")
    p.add_argument("--tensorboard", action="store_true",
                   help="also write TensorBoard event files, one run per replica, into RUN_DIR/tensorboard "
                        "(needs tensorboardX: pip install \"nondet_jax[tensorboard]\")")
    args = p.parse_args(argv)
    try:
        summary = write_report(args.run_dir)
        if args.tensorboard:
            from nondet_jax.tensorboard import export_run

            print(f"tensorboard: {export_run(args.run_dir, list(summary['arms']))}")
    except UsageError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    print(format_table(summary))
    print(f"report: {RunPaths(args.run_dir).report}")
    return 0


if __name__ == "__main__":
    from nondet_jax.__main__ import run_command

    sys.exit(run_command("report"))
