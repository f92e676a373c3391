"""``report.md``: the summary's numbers and figures as Markdown, with the findings in words."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np

from nondet_jax.analysis import stats as S
from nondet_jax.analysis.mitigations import mitigation_table
from nondet_jax.analysis.stats import METHODS, TESTS, format_ci, na_reason, replicas_for_std_factor
from nondet_jax.analysis.task import QUANTITIES, task_of
from nondet_jax.errors import UsageError
from nondet_jax.instruments.dashboard import long_rows
from nondet_jax.report.figures import make_figures
from nondet_jax.report.frames import COLUMNS, FRAMES, csv_bytes
from nondet_jax.report.optimizer import format_optimizer
from nondet_jax.report.summary import (
    _ci,
    _fmt,
    _write_csv,
    arm_rows,
    build_summary,
    fmt_p,
    format_table,
    model_record,
    unfinished_line,
)
from nondet_jax.store.io import atomic_write_bytes, atomic_write_json, guarded, read_arrays, strict_json
from nondet_jax.store.paths import TABLES, RunPaths
from nondet_jax.store.run import check_layout

_TESTS_LINE = ("Spread p: " + TESTS["spread_p"] + "; Holm p: " + TESTS["spread_p_holm"] + " (read this one); F-test p: "
               + TESTS["f_test_p"] + ".")


def _comparison_md(summary: dict) -> list[str]:
    vs = summary["vs_all"]
    if not vs:
        return ["(No `all` arm in this study: no ratios to it.)", ""]
    q1, q2 = QUANTITIES[task_of(summary)]
    lines = [f"| arm | {q1.label} std ratio [95% CI] | spread p | Holm p | F-test p (normal) "
             f"| {q2.label} std ratio [95% CI] | spread p | Holm p | F-test p (normal) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for arm, c in vs.items():
        same = summary["arms"].get(arm, {}).get("replicas_bitwise_identical")  # a spread exactly 0: not estimated
        cells = [f"{'0 (bitwise identical)' if same else _fmt(a['ratio'], 2) + _ci(a['ratio_ci'], 2)} | "
                 f"{fmt_p(a.get('spread_p'))} | {fmt_p(a.get('spread_p_holm'))} | {fmt_p(a['f_test_p'])}"
                 for a in (c[q1.name], c[q2.name])]
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    lines += ["", "Ratio interval: " + METHODS["ratio"] + ". " + _TESTS_LINE]
    needed = next(iter(vs.values()))[q1.name].get("replicas_for_ratio", {})
    if needed:
        lines.append("Design (not a power computed from the observed ratio): to detect a true std ratio of "
                     + ", ".join(f"{k} ({n} replicas per arm)" for k, n in needed.items())
                     + " with 80% power (the printed 95% ratio interval excludes 1 in 80% of simulated studies of normal data; the "
                     "F-test alone would need fewer, but it is not what is printed); a std interval spanning at most a factor 2 needs "
                     f"{replicas_for_std_factor(2.0)} replicas (80% of simulated studies of normal data). Other ratios: "
                     "rerun the sweep with `--set metrics.power_ratios=0.5,0.75` (finished arms are reused, only the report "
                     "is rebuilt).")
    return lines + [""]


def _provenance_md(summary: dict) -> list[str]:
    """A line naming each setting the arms were trained under differently (each arm record keeps its own
    ``provenance``; ``environment.json`` holds the latest run's only)."""
    prov = {a: r["provenance"] for a, r in summary["arms"].items() if isinstance(r.get("provenance"), dict)}
    lines = []
    for key in sorted({k for p in prov.values() for k in p}):
        values = {a: p.get(key) for a, p in prov.items()}
        if len({json.dumps(v, sort_keys=True) for v in values.values()}) > 1:
            lines.append(f"- **Arms trained under different {key}**: " + "; ".join(
                f"`{a}`: {v!r}" for a, v in values.items()) + ". Their comparison mixes settings, not only sources.")
    return lines


def _dynamics_md(summary: dict) -> list[str]:
    rows = [(a, r["dynamics"]) for a, r in summary["arms"].items() if "dynamics" in r]
    if not rows:
        return []
    lines = ["## Divergence dynamics", "",
             "Replicas 0 and 1 of each arm, watched while they trained, every k steps; growth rate λ of the weight distance fitted as "
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
        q = QUANTITIES[task_of(summary)][0]
        a = c[q.name]
        # the findings read the interval at level 1 − 0.05/m over the m arms (family-wise error ≤ 5%), paired
        # where the two arms share seeds; older summaries have only the 95% one
        lo, hi = (np.nan if v is None else v for v in a.get("family_ci", a["ratio_ci"]))
        if a["ratio"] is None or not np.isfinite(a["ratio"]):
            continue
        where = ("" if not np.isfinite(lo) else
                 "includes 1: not distinguishable from all sources together" if lo <= 1 <= hi else
                 "lies below 1: less spread than all sources together" if hi < 1 else
                 "lies above 1: more spread than all sources together")
        used = min(summary["arms"][x].get("replicas_used", summary["arms"][x]["replicas"]) for x in (arm, "all"))
        ci = f"[{lo:.2f}, {hi:.2f}]" if np.isfinite(lo) else f"is {na_reason('ratio', used) or 'n/a'}"
        family = sum(1 for x in vs if summary["arms"].get(x, {}).get("varied", True))  # control: not tested
        kind = "95% CI"
        if "family_ci" in a:  # its z, widened as the method's (stats.PAIRED_TAIL / SPREAD_TAIL), named with it
            tail = S.PAIRED_TAIL if a.get("paired") else S.SPREAD_TAIL
            z_at = 100 * (1 - tail * (1 - a["family_level"]) / 2)
            kind = (f"{100 * a['family_level']:.1f}% " + (f"paired (the arms share seeds: {a.get('pairs')} pairs)"
                                                         if a.get("paired") else "independent-arms")
                    + f" interval (Bonferroni over {family} arms; z at {z_at:.2f}%, widened)")
        out.append(f"- `{arm}`: {q.label} std is {a['ratio']:.2f}× the `all` arm's; the {kind} "
                   f"{ci} {where} (permutation spread test p = {fmt_p(a.get('spread_p'))}, Holm-adjusted over "
                   f"{family} arms {fmt_p(a.get('spread_p_holm'))}"
                   + (f"; the paired interval's p = {fmt_p(a.get('paired_p'))}" if a.get("paired") else "") + ").")
        failed = a.get("failed_replicas")
        if failed:
            w = a["without_failed"]
            named = "; ".join(f"`{arm if side == 'arm' else 'all'}` replica{'s' if len(ix) > 1 else ''} "
                              + ", ".join(map(str, ix)) for side, ix in failed.items() if ix)
            out.append(f"  - **Failed replicas named** ({q.label} more than {S.FAILED_THRESHOLD:g} robust stds from their arm's "
                       f"median): {named}. Without them the std ratio is "
                       f"{'n/a' if w['ratio'] is None else format(w['ratio'], '.2f')}, 95% CI"
                       f"{format_ci(w['ratio_ci'], 2)} (paired{format_ci(w['paired_ratio_ci'], 2)}); the numbers above "
                       "include them.")
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


FEW_TO_RANK = 5  # at 3-5 replicas per arm a std's interval spans a factor of 10 to 100


def _span(summary: dict, q, arms) -> str:
    """How many times its lower end the upper end of the arms' std intervals is, in words."""
    cis = [(summary["arms"][a].get("metrics") or {}).get(q.name, {}).get("std_ci") or [None, None] for a in arms]
    factors = [hi / lo for lo, hi in cis if lo is not None and hi is not None and np.isfinite(hi) and lo > 0]
    if not factors:
        return "the std intervals are n/a or reach down to 0"
    lo, hi = min(factors), max(factors)
    return f"the {q.label} std's 95% intervals span a factor of {lo:.0f}" + (f" to {hi:.0f}" if hi >= lo + 0.5 else "")


def _caveats(summary: dict, records: dict[str, dict]) -> list[str]:
    """Sentences where the numbers cannot carry a conclusion: too few replicas to rank the sources, and
    a std whose interval is wider than the whole range of the replicas' scores."""
    q = QUANTITIES[task_of(summary)][0]
    out = []
    used = {a: r.get("replicas_used", r["replicas"]) for a, r in summary["arms"].items() if r.get("varied")}
    if len(used) > 1 and 2 <= min(used.values()) <= FEW_TO_RANK:
        out.append(f"- **Too few replicas to rank the sources**: with {min(used.values())} replicas in an arm, "
                   f"{_span(summary, q, used)}, so which source moves the {q.label} most is not read off these "
                   f"numbers; a std interval spanning at most a factor 2 needs {replicas_for_std_factor(2.0)} replicas "
                   "per arm (in 80% of simulated studies of normal data).")
    for arm, rec in records.items():
        st = (summary["arms"][arm].get("metrics") or {}).get(q.name, {})
        values = [row[q.row] for row in rec["rows"] if row.get("diverged_at_step", -1) < 0]
        lo, hi = (np.nan if v is None else v for v in (st.get("std_ci") or [None, None]))
        if len(values) > 1 and np.isfinite(lo) and np.isfinite(hi) and hi - lo > np.ptp(values) > 0:
            out.append(f"- `{arm}`: the 95% interval of the {q.label} std, [{_fmt(lo * q.scale, 3)}, "
                       f"{_fmt(hi * q.scale, 3)}], is wider than the whole range of its replicas' {q.label} "
                       f"({_fmt(min(values) * q.scale, 3)} to {_fmt(max(values) * q.scale, 3)}): it cannot say how "
                       "large this arm's spread is.")
    return out


def _mitigations_md(summary: dict) -> list[str]:
    if not summary.get("mitigations"):
        return []

    return ["## Mitigations: single models, test-time augmentation, snapshot ensembles", "",
            "Same replicas (paired by key) evaluated as variants: `single` is the trained arm; `tta:<views>` the "
            "same models averaged over test-time views; `snapshotK` the arm retrained with K cosine cycles in the "
            "same epochs (equal training cost), its K cycle-end logits averaged; `snapshotK last` that run's final "
            "snapshot alone. The std ratio is to `single` (permutation spread-test p, n/a below 5 replicas).", "",
            mitigation_table(summary["mitigations"]), ""]


def _paired_level() -> str:
    """The paired ratio interval's level as scipy would state it, with its widened z (stats.PAIRED_TAIL)."""
    q = 1 - S.PAIRED_TAIL * (1 - S.LEVEL) / 2
    return f"{100 * (2 * q - 1):.0f}%: z at {100 * q:.0f}%, widened from 95%"


def _decomposition_md(summary: dict) -> list[str]:
    """Each one-source arm's share of the all arm's variance, their sum and the non-additivity."""
    dec = summary.get("decomposition") or {}
    if not dec:
        return []
    labels = {q.name: q.label for q in QUANTITIES[task_of(summary)]}
    out = ["## Variance decomposition", "",
           "Each source's share of the `all` arm's variance, σ²(arm) / σ²(all), with its 95% CI (the std ratio's, "
           "squared), and the non-additivity 1 − Σ shares: 0 if the sources' effects added up independently, "
           "negative when each source alone already produces much of the total (their effects overlap), positive "
           "when sources produce spread only together. The design (one source per arm, the others at one shared "
           "draw, plus `all`) cannot say which sources interact. Method: " + METHODS["decomposition"] + ".", ""]
    for name, d in dec.items():
        shares, n = d["shares"], lambda x: "n/a" if x is None or not np.isfinite(x) else f"{x:.3f}"  # 1 replica: NaN
        out += [f"**{labels.get(name, name)}** (`all`: R={d['reference_replicas']})", "",
                f"| source arm | R | share of Var(all) | 95% CI | CI paired by seed ({_paired_level()}) |",
                "|---|---|---|---|---|"]
        out += [f"| {a} | {s['replicas']} | {n(s['share'])} | {format_ci(s['ci'], 3).strip()} | "
                f"{format_ci(s.get('paired_ci'), 3).strip()} |" for a, s in shares.items()]
        out += [f"| sum of shares | | {n(d['sum'])} | {format_ci(d['sum_ci'], 3).strip()} | — |",
                f"| non-additivity 1 − sum | | {n(d['non_additivity'])} | "
                f"{format_ci(d['non_additivity_ci'], 3).strip()} | — |", ""]
        if d.get("unmeasured"):
            out += [f"`all` also varies {', '.join(d['unmeasured'])}, which no one-source arm here measures: the spread "
                    "they add is in Var(all) and in no share, so it counts in the non-additivity (a positive value may "
                    "be theirs, not sources acting together); add an arm per source to measure it.", ""]
    return out


def _over_training_md(records: dict[str, dict]) -> list[str]:
    """The best test score and best epoch of each arm's replicas (``study.eval_every``)."""
    rows = {a: r["over_training"] for a, r in records.items() if r.get("over_training")}
    if not rows:
        return []
    first = next(iter(rows.values()))
    what = {"test_accuracy": "test accuracy", "test_mse": "test MSE"}[first["metric"]]
    scale, unit = (100, "%") if first["metric"] == "test_accuracy" else (1, "")

    def cell(s, k=scale, digits=2):
        return (f"{k * s['mean']:.{digits}f} {format_ci(s['mean_ci'], digits, k).strip()}, std {k * s['std']:.{digits}f} "
                f"{format_ci(s['std_ci'], digits, k).strip()}")

    out = ["## Test scores over training", "",
           f"Every replica was tested after epochs {', '.join(map(str, first['epochs']))} (`study.eval_every`): its best "
           f"{what} and the first epoch reaching it (what early stopping on the test curve picks), mean and std over "
           "replicas with 95% CIs (" + METHODS["mean"] + "; " + METHODS["std"] + "). Curves: `history/<arm>.npz` "
           "(`test_epochs`, and the scores per replica and epoch), figure `test_curves`.", "",
           f"| arm | best {what}{' (' + unit + ')' if unit else ''} | best epoch |", "|---|---|---|"]
    out += [f"| {a} | {cell(r['best'])} | {cell(r['best_epoch'], 1, 1)} |" for a, r in rows.items()]
    return out + [""]


def _trained_md(model: dict) -> list[str]:
    """What was trained, from ``model.json``: each part by name, what it computes and its fingerprint."""
    ident = model.get("identity")
    if not isinstance(ident, dict):
        return []
    d, m, o = (ident.get(k) if isinstance(ident.get(k), dict) else {} for k in ("data", "model", "optimizer"))
    lines = ["## What was trained", "",
             f"- data: {d.get('name')} (sha256 {str(d.get('sha256'))[:12]}; test split {str(d.get('test_sha256'))[:12]}); "
             + (f"regression, {d.get('classes')} output(s) per example" if d.get("task") == "regression"
                else f"classification, {d.get('classes')} classes"),
             f"- model: {m.get('name')}, {m.get('parameters')} parameters"
             f"{', BatchNorm' if model.get('batch_norm') else ', no BatchNorm'}"
             f"{', dropout' if model.get('dropout') else ', no dropout'} (fingerprint {str(m.get('sha256'))[:12]})",
             f"- optimizer: {o.get('name')}: {format_optimizer(o.get('transforms') or [])} (fingerprint "
             f"{str(o.get('sha256'))[:12]}; schedules at the steps shown)",
             f"- loss: {ident.get('loss', {}).get('name')}; augmentation: {ident.get('augment', {}).get('name')}",
             f"- platform: jaxlib {ident.get('platform', {}).get('jaxlib')} on {ident.get('platform', {}).get('backend')}"
             f" ({ident.get('platform', {}).get('cpu_type')}); study identity {str(model.get('identity_sha256'))[:12]}"]
    if model.get("dropout") and not model.get("dropout_follows_examples"):
        lines.append("- batch_order: this model draws one dropout mask per batch position, so permuting the batch "
                     "also re-pairs masks with examples: the batch_order arm measures reduction order *and* dropout "
                     "masks here (the catalogue's models key masks by example, which keeps it pure)")
    return lines + [""]


def _write_instruments_csv(paths: RunPaths, records: dict) -> None:
    """``instruments.csv``: every arm's instruments in one long table (arm, replica, step, quantity, value)."""
    rows = []
    for arm, rec in records.items():
        path = paths.listed_file("instruments", arm, rec)
        if path is not None:
            rows += long_rows(arm, read_arrays(path))
    if rows:
        _write_csv(paths.instruments_csv, rows, root=paths.root)
    elif paths.instruments_csv.is_file():  # no arm lists instruments: one left (or planted) there would be read
        guarded("unlink", paths.root, paths.instruments_csv)


def write_report(run: str | Path, command: str | None = None) -> dict:
    """Rebuild ``summary.json``, ``arms.csv``, figures and ``report.md`` from stored results."""
    run = Path(run)
    paths = RunPaths(run)

    with warnings.catch_warnings():  # zero-spread arms (control) make scipy's tests divide by 0: reported as n/a
        warnings.simplefilter("ignore", RuntimeWarning)
        summary, records = build_summary(run)
    if paths.figures.exists() and not paths.figures.is_dir():
        raise UsageError(f"{paths.figures} is a file, but the report writes its figures into a folder of that name; "
                         "move the file away and rebuild the report")
    check_layout(run, list(records))  # nothing written before every output is known to be writable
    atomic_write_json(paths.summary, strict_json(summary), root=paths.root)
    _write_csv(paths.arms_csv, [strict_json(row) for row in arm_rows(summary)], root=paths.root)
    _write_instruments_csv(paths, records)
    for kind in TABLES:  # the long tables (nondet_jax.report.frames); a kind with no rows: its header alone
        atomic_write_bytes(paths.table(kind), csv_bytes(strict_json(FRAMES[kind](run, summary, records)),
                                                        COLUMNS[kind]), root=paths.root)
    figures = make_figures(run, summary, records)
    model = model_record(paths)
    if command is None and paths.command.is_file():
        command = paths.command.read_text(errors="replace").strip()  # the bytes a shell or editor left: shown
    md = [f"# Variability study: {summary['model']} on {summary['dataset']}", ""]
    if command:
        md += ["Made by:", "", "```", command, "```", ""]
    md += [f"{len(summary['arms'])} arms, {summary['epochs']} epoch{'s' if summary['epochs'] != 1 else ''}, seed {summary['seed']}, backend "
           f"{summary['backend']} ({summary['device_kind']}). Every number below is read from this folder's "
           "stored results (`python -m nondet_jax.report` rebuilds this page).", "",
           *([f"**{unfinished_line(summary)}**", ""] if unfinished_line(summary) else []),
           "## Per-arm table", "", "```", format_table(summary), "```", "",
           "Full per-arm table: `arms.csv`; long tables (one number a row): `replicas.csv`, `curves.csv`, `best.csv`, "
           "`decomposition.csv`, `pairs.csv` (columns: docs/api.md).", "",
           "## Spread relative to the `all` arm", "", *_comparison_md(summary),
           *_decomposition_md(summary),
           "## What the numbers say", "",
           *(_findings(summary) + _caveats(summary, records) or ["- (nothing to compare)"]), "",
           *_dynamics_md(summary),
           *_over_training_md(records),
           *_mitigations_md(summary),
           *_trained_md(model),
           "## Figures", ""]
    md += [f"![{Path(f).stem}]({f})" for f in figures]
    features = {"model": "the features the model returns (return_features)", "logits": "the logits (the model "
                "exposes no features)"}.get(model.get("features"), f"the output of submodule "
                                           f"{str(model.get('features', '')).partition(':')[2] or '?'}")
    bn = ("BatchNorm statistics recomputed on training data at each point (the endpoints too, so their error can "
          "differ from the table's, which uses the stored running averages)" if model.get("batch_norm", True)
          else "the model has no BatchNorm, so nothing is recomputed")
    if task_of(summary) == "regression":
        md += ["", "## Definitions", "",
               "- Regression: each replica's test MSE and MAE over every test example and output; std over replicas "
               "(ddof=1), 95% CI: " + METHODS["std"] + "; mean: " + METHODS["mean"] + ". The std's interval is n/a below R=3, the mean's below R=2.",
               "- Pairwise metrics (prediction distance: the RMS difference of two replicas' test predictions; "
               "Pearson/Spearman of their flattened predictions; 2-model ensemble gain in MSE: the members' mean "
               f"MSE minus the MSE of the pair's averaged predictions, positive when averaging helps; linear CKA of "
               f"{features} on the test set; weight distance ||θa−θb||/||θa||): mean over the R(R−1)/2 pairs; 95% "
               "CI: " + METHODS["pairwise"] + "; n/a below R=3.",
               "- Not computed for a regression: accuracy, disagreement, cross-entropy, the independent-errors "
               "baseline and the LMC barrier (each needs classes or a test error).",
               "- Ratio vs all: std(arm)/std(all) of the test MSE (and MAE); 95% CI: " + METHODS["ratio"]
               + "; n/a below 5 replicas per arm. " + _TESTS_LINE, *_provenance_md(summary), ""]
        atomic_write_bytes(paths.report, "\n".join(md).encode(), root=paths.root)
        return summary
    md += ["", "## Definitions", "",
           "- std: sample standard deviation over replicas (ddof=1); 95% CI: " + METHODS["std"] + "; mean: "
           + METHODS["mean"] + ". The std's interval is n/a below R=3, the mean's below R=2.",
           "- Pairwise metrics (disagreement, Pearson/Spearman of flattened logits, 2-model ensemble gain (positive "
           "when the pair's averaged logits beat its members' mean), linear CKA "
           f"of {features} on the test set, weight distance ||θa−θb||/||θa||): mean over the R(R−1)/2 pairs; 95% CI: "
           + METHODS["pairwise"] + "; n/a below R=3.",
           f"- LMC barrier: max over α of test error at θb+α(θa−θb), {bn}, minus the mean endpoint error; on "
           "disjoint pairs (0,1), (2,3), ...",
           "- Independent-errors baseline: sqrt(Σ p_i(1−p_i)·R/(R−1))/n, the accuracy std that test-set sampling "
           "alone explains (Jordan 2023), p_i example i's error rate over the R replicas (R/(R−1) makes the "
           "variance unbiased).",
           "- Ratio vs all: std(arm)/std(all); 95% CI: " + METHODS["ratio"] + "; n/a below 5 replicas per arm. "
           + _TESTS_LINE, *_provenance_md(summary), ""]
    atomic_write_bytes(paths.report, "\n".join(md).encode(), root=paths.root)
    return summary
