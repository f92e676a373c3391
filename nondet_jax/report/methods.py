"""The report of a study of methods (:mod:`nondet_jax.study.methods`): one table per method and arm, each
method against the baseline paired by seed (:mod:`nondet_jax.analysis.methods`), a figure per method with
the methods named. Written into the study's folder: ``report.md``, ``methods.csv``, ``summary.json``,
``figures/method-<name>.png``; each method's own report stays in ``methods/<name>/report.md``."""

from __future__ import annotations

import io
import warnings
from pathlib import Path

from nondet_jax.analysis import sequential
from nondet_jax.analysis import stats as S
from nondet_jax.analysis.compare import verdict
from nondet_jax.analysis.methods import compare_methods, compared_arms, default_metric, finished, read_record
from nondet_jax.analysis.sequential import POWER_CAP, key, saving
from nondet_jax.analysis.task import QUANTITIES, task_of
from nondet_jax.errors import UsageError
from nondet_jax.report.summary import _write_csv, arm_rows
from nondet_jax.store.io import atomic_write_bytes, atomic_write_json, strict_json
from nondet_jax.store.paths import RunPaths
from nondet_jax.until import Until

COMPARISON_COLUMNS = ("difference", "difference_ci_low", "difference_ci_high", "p", "p_holm", "holm_family",
                      "probability_of_improvement", "probability_of_improvement_ci_low",
                      "probability_of_improvement_ci_high", "n_pairs")


def methods_table(summaries: dict[str, dict], comparisons: list[dict]) -> list[dict]:
    """One row per method and arm: the arm's row of the method's own ``arms.csv`` with ``method`` first and,
    for a method compared with the baseline on that arm, the paired comparison (``vs``, the method compared
    with, then :data:`COMPARISON_COLUMNS`; the difference in the metric's stored units, accuracy a fraction)."""
    by = {(r["method_b"], r["arm"]): r for r in comparisons}
    rows = []
    for name, summary in summaries.items():
        for row in arm_rows(summary):
            c = by.get((name, row["arm"]))
            extra = {"vs": c["method_a"] if c else None, "metric": c["a"]["metric"] if c else None}
            for k in COMPARISON_COLUMNS:
                base = k.removesuffix("_low").removesuffix("_high")
                extra[k] = None if c is None else (c[base][0 if k.endswith("_low") else 1] if base != k else c[k])
            rows.append({"method": name, **row, **extra})
    return rows


def methods_summary(root: str | Path) -> tuple[dict, dict[str, dict], list[dict]]:
    """(summary, {method: its summary}, comparisons) of a study of methods, from its folders."""
    root = Path(root)
    record = read_record(root)
    summaries = finished(root, record)
    comparisons: list[dict] = []
    note = None
    if len(summaries) >= 2 and record["baseline"] in summaries:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            try:
                comparisons = compare_methods(root)
            except UsageError as e:  # too few replicas, no arm whose replicas vary: said in the report
                note = str(e)
    else:
        note = "fewer than two methods (or no baseline) have finished; rerun the sweep to finish them"
    first = next(iter(summaries.values()), {})
    summary = {"baseline": record["baseline"], "methods": {n: record["methods"][n] for n in record["methods"]},
               "finished": list(summaries), "model": first.get("model"), "dataset": first.get("dataset"),
               "seed": first.get("seed"), "epochs": first.get("epochs"), "task": task_of(first) if first else None,
               "metric": default_metric(summaries) if summaries else None,
               "arms_compared": compared_arms(summaries) if len(summaries) >= 2 else [],
               "comparisons": [{k: v for k, v in c.items() if k not in ("a", "b")} |
                               {"scores_a": c["a"]["scores"], "scores_b": c["b"]["scores"]} for c in comparisons],
               "note": note, "until": record.get("until")}
    return summary, summaries, comparisons


def _md_table(summaries: dict[str, dict]) -> list[str]:
    q1, q2 = QUANTITIES[task_of(next(iter(summaries.values())))]
    lines = [f"| method | arm | R | {q1.label} mean | {q1.label} std [95% CI] | {q2.label} mean | {q2.label} std |",
             "|---|---|---|---|---|---|---|"]
    # accuracy in % and cross-entropy in nats at fixed decimals; a regression's errors in the targets' own units,
    # whatever their scale, to 4 significant digits
    f = lambda v, d=2: "n/a" if v is None else f"{v:.{d}f}" if q1.unit else f"{v:.4g}"  # noqa: E731
    for name, summary in summaries.items():
        for row in arm_rows(summary):
            u1, u2 = q1.unit, q2.unit
            ci = (f" [{f(row.get(f'{q1.name}_std_ci_low{u1}'))}, {f(row.get(f'{q1.name}_std_ci_high{u1}'))}]"
                  if row.get(f"{q1.name}_std_ci_low{u1}") is not None else "")
            lines.append(f"| {name} | {row['arm']} | {row['replicas']} | {f(row.get(f'{q1.name}_mean{u1}'))} | "
                         f"{f(row.get(f'{q1.name}_std{u1}'))}{ci} | {f(row.get(f'{q2.name}_mean{u2}'), 4)} | "
                         f"{f(row.get(f'{q2.name}_std{u2}'), 4)} |")
    return lines


def _md_comparisons(comparisons: list[dict], decisions: dict | None = None) -> list[str]:
    """The comparisons' table and one sentence each: :func:`verdict`'s, or for a sequential study its
    ``decisions`` (``{(method_b, method_a, arm): row}`` of the last look), the answers it stopped on."""
    g = lambda x: f"{x:.4g}"  # noqa: E731
    lines = ["| method | vs | arm | mean (method) | mean (vs) | difference [95% CI] | paired t p | Holm p | "
             "share of seeds it wins [95% CI] | pairs |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in comparisons:
        lo, hi = r["difference_ci"]
        plo, phi = r["probability_of_improvement_ci"]
        lines.append(f"| {r['method_b']} | {r['method_a']} | {r['arm']} | {g(r['mean_b'])} | {g(r['mean_a'])} | "
                     f"{r['difference']:+.4g} [{g(lo)}, {g(hi)}] | {r['p']:.3g} | {r['p_holm']:.3g} | "
                     f"{r['probability_of_improvement']:.2f} [{plo:.2f}, {phi:.2f}] | {r['n_pairs']} |")
    lines += ["", "In words (A is the baseline, B the method):", ""]
    lines += [f"- **{r['method_b']}** vs {r['method_a']}, arm `{r['arm']}`: "
              + (verdict(r) if decisions is None or key(r) not in decisions else _sequential_words(decisions[key(r)]))
              for r in comparisons]
    return lines


def write_methods_report(root: str | Path, command: str | None = None, log=print) -> dict:
    """Rebuild ``report.md``, ``methods.csv``, ``summary.json`` and the figures of a study of methods from
    its method folders. Returns the summary."""
    root = Path(root)
    paths = RunPaths(root)
    summary, summaries, comparisons = methods_summary(root)
    atomic_write_json(paths.summary, strict_json(summary), root=root)
    if summaries:
        _write_csv(paths.methods_csv, [strict_json(r) for r in methods_table(summaries, comparisons)], root=root)
    if summary["until"] and not summary["until"]["looks"]:  # interrupted before its first look: no answer to read
        comparisons = []
        summary = {**summary, "note": "this sequential study has taken no look yet; rerun its command to go on"}
    figures = _figures(root, comparisons)
    if command:
        atomic_write_bytes(paths.command, (command + "\n").encode(), root=root)
    elif paths.command.is_file():
        command = paths.command.read_text().strip()
    baseline, names = summary["baseline"], list(summary["methods"])
    md = [f"# Methods compared: {summary['model']} on {summary['dataset']}", ""]
    if command:
        md += ["Made by:", "", "```", command, "```", ""]
    md += [f"{len(names)} methods ({', '.join(f'`{n}`' for n in names)}), baseline `{baseline}`; seed "
           f"{summary['seed']}, {summary['epochs']} epoch{'s' if summary['epochs'] != 1 else ''}. Replica r of every method trained under the same keys "
           "for every randomness source, so the methods are compared seed by seed (paired by construction). "
           "Every number below is read from the method folders `methods/<name>/` (each an ordinary run folder with "
           "its own report); `python -m nondet_jax report` rebuilds this page.", ""]
    md += ["## Methods", "", "| method | settings | parts replaced |", "|---|---|---|"]
    for n, m in summary["methods"].items():
        settings = ", ".join(f"`{k}={v}`" for k, v in m.get("settings", {}).items()) or "the study's own"
        md.append(f"| {n}{' (baseline)' if n == baseline else ''} | {settings} | {', '.join(m.get('parts', [])) or '-'} |")
    md += [""]
    missing = [n for n in names if n not in summaries]
    if missing:
        md += [f"Not finished yet: {', '.join(missing)} (rerun the same command to train them).", ""]
    if summaries:
        md += ["## Per method and arm", "", *_md_table(summaries), "",
               "One row per method, arm and replica: `methods/<name>/replicas.csv`; this table with the comparisons: "
               "`methods.csv`.", ""]
    metric = summary["metric"]
    md += [f"## Each method against `{baseline}`, paired by seed ({metric})", ""]
    if summary["until"] and comparisons:
        md += [("This study stopped sequentially: its answers" if summary["until"]["looks"][-1]["stop"] else
                "This sequential study has not stopped yet (rerun its command to go on): its answers so far")
               + ", in words below, are the looks' intervals' (section *Sequential design*). The 95% CI and paired t p "
               "in the table read the replicas as if their number had been fixed in advance.", ""]
    if comparisons:
        decisions = {key(c): c for c in summary["until"]["looks"][-1]["comparisons"]} if summary["until"] else None
        md += [*_md_comparisons(comparisons, decisions), "",
               f"Difference: {S.METHODS['paired_difference']}. Share of seeds: "
               f"{S.METHODS['paired_probability_of_improvement']}. p: {S.TESTS['paired_t_p']}. Holm: over the "
               f"{max(c['holm_family'] for c in comparisons)} methods compared with `{baseline}` on each arm (the "
               "finished ones). Differences and means are in the "
               f"metric's stored units ({'a fraction: 0.01 = 1 point of accuracy' if 'accuracy' in metric else metric}).",
               ""]
    else:
        md += [f"(No comparison: {summary['note']}.)", ""]
    if summary["until"] and comparisons:
        md += _md_sequential(summary["until"], comparisons)
    if figures:
        md += ["## Figures", "", *[f"![{n} vs {baseline}](figures/{p.name})" for n, p in figures.items()], ""]
    atomic_write_bytes(paths.report, "\n".join(md).encode(), root=root)
    if comparisons:
        log(format_comparisons(comparisons))
        if summary["until"]:
            log("(a sequential study: its answers are the looks' intervals above; this table's 95% CI and p "
                "read the replicas as if their number had been fixed)")
    if missing:  # report.md says it too
        log(f"not finished yet: method(s) {', '.join(missing)} (rerun the same command to train them)")
    log(f"report: {paths.report}")
    return summary


def _sequential_words(row: dict) -> str:
    lo, hi = row["interval"]
    said = {"futile": "given up (futile: too unlikely to be decided by the last look)"}.get(row["decision"], row["decision"])
    if row.get("better"):
        said += f", and {row['better']} is better (the interval excludes 0)"
    return (f"{said} at {row['replicas']} replicas per method (sequential study: the look's interval of the "
            f"difference [{lo:+.4g}, {hi:+.4g}]).")


def _levels_sentence(design: Until, last: dict, boundary: dict) -> str:
    m, k = len(last["comparisons"]), len(design.looks())
    if design.rule == "width":
        return (f"Pocock's constant level, at which the intervals of all {m} comparison(s) over all {k} possible looks "
                "miss the truth in at most 5% of studies (calibrated by simulation): repeated intervals, so they hold "
                "wherever the study stops.")
    if boundary is sequential.EARLIER:
        return (f"Pocock's constant level (this folder predates recorded boundaries), at which the intervals of all {m} "
                f"comparison(s) over all {k} possible looks miss the truth in at most 5% of studies (calibrated by "
                f"simulation); a comparison under {boundary['futility']:.0%} chance of a decision by the last look was "
                "given up.")
    return (f"levels on Wang & Tsiatis' boundary (shape {boundary['shape']:g}: stricter at early looks), "
            f"calibrated by simulation so that the {m} comparison(s) over all {k} possible looks, stopped by the "
            f"design's own rules (a comparison under {boundary['futility']:.0%} chance of a decision by the last look "
            "is given up), decide a difference that is not there in at most 5% of studies.")


def _md_sequential(state: dict, comparisons: list[dict]) -> list[str]:
    """The looks of a sequential study (``methods.json``'s ``until``), its stop and what the stop saved."""
    design = Until(**{k: v for k, v in state["design"].items() if k not in ("spec", "boundary")})
    boundary = sequential.boundary_of(design, state["design"])
    looks = state["looks"]
    last = looks[-1]
    md = ["## Sequential design", "",
          f"`--until {design.spec}`: {design.first} replicas per method, then {design.round} more at each look up to "
          f"{design.max_replicas}. Each look reads every comparison's paired t interval at its look's level "
          f"({100 * (1 - last['level']):.2f}% at the last look taken): " + _levels_sentence(design, last, boundary), "",
          "| replicas | method | vs | arm | difference | interval at the look's level | answer |", "|---|---|---|---|---|---|---|"]
    for look in looks:
        for c in look["comparisons"]:
            if c.get("replicas", look["replicas"]) != look["replicas"]:
                continue  # answered at an earlier look, which lists it
            lo, hi = c["interval"]
            md.append(f"| {look['replicas']} | {c['method_b']} | {c['method_a']} | {c['arm']} | {c['difference']:+.4g} | "
                      f"[{lo:+.4g}, {hi:+.4g}] | {c['decision']} |")
    md += ["", f"Stopped at {last['replicas']} of at most {design.max_replicas} replicas per method: {last['why']}."
           if last["stop"] else f"Not stopped yet: the last look taken was at {last['replicas']} of at most "
           f"{design.max_replicas} replicas per method (rerun the same command to go on)."]
    if last["stop"]:
        for row in saving(design, last, comparisons, boundary=boundary):
            if row.get("fixed_same_power"):
                md.append(f"- {row['method_b']} on `{row['arm']}`: at the difference found ({row['effect']:.2f} standard "
                          f"deviations of the paired differences) this design decides in {100 * row['power']:.0f}% of "
                          f"studies with {row['expected_replicas']:.1f} replicas per method on average; a fixed number "
                          f"of replicas with that power (at most {100 * POWER_CAP:.0f}%) is {row['fixed_same_power']}, "
                          f"so this stop at {row['replicas']} " + (f"saved {100 * row['saved']:.0f}% of them." if
                                                                    row["saved"] >= 0 else
                                                                    f"used {-100 * row['saved']:.0f}% more."))
            elif design.rule == "decided" and row.get("decision") and not str(row["decision"]).endswith(" is better"):
                why = {"futile": "given up: its chance of being decided by the last look, were the difference what it "
                                 f"was, fell under {100 * boundary['futility']:.0f}%"}.get(row["decision"], row["decision"])
                md.append(f"- {row['method_b']} on `{row['arm']}`: {why}, at {row['replicas']} replicas per method "
                          f"({design.max_replicas - row['replicas']} fewer than `--max-replicas`); no difference was "
                          "decided, so there is no design of the same power to compare with.")
    return md + [""]


def _figures(root: Path, comparisons: list[dict]) -> dict[str, Path]:
    """One figure per method against the baseline on the first compared arm (``all`` where there is one), the
    methods named by their folders (:func:`nondet_jax.report.compare_figure.method_name`)."""
    if not comparisons:
        return {}
    arms = [r["arm"] for r in comparisons]
    arm = "all" if "all" in arms else arms[0]
    from nondet_jax.report.compare_figure import plot_result

    paths, out = RunPaths(root), {}
    paths.figures.mkdir(exist_ok=True)
    import matplotlib.pyplot as plt

    for r in (r for r in comparisons if r["arm"] == arm):
        fig = plot_result(r)
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=100)
        plt.close(fig)
        path = paths.method_figure(r["method_b"])
        atomic_write_bytes(path, buf.getvalue(), root=root)
        out[r["method_b"]] = path
    return out


def format_comparisons(comparisons: list[dict]) -> str:
    """The comparisons as a plain-text table, printed at the end of a sweep of methods."""
    wide = {k: max([len(r[k]) for r in comparisons] + [len(title), 10]) + 2  # names as long as they come
            for k, title in (("method_b", "method"), ("method_a", "vs"), ("arm", "arm"))}
    head = (f"{'method':<{wide['method_b']}}{'vs':<{wide['method_a']}}{'arm':<{wide['arm']}}{'difference':>11}  "
            f"{'95% CI':<22}{'p':>10}{'Holm p':>10}{'wins':>6}")
    rows = [head, "-" * len(head)]
    for r in comparisons:
        lo, hi = r["difference_ci"]
        rows.append(f"{r['method_b']:<{wide['method_b']}}{r['method_a']:<{wide['method_a']}}{r['arm']:<{wide['arm']}}"
                    f"{r['difference']:>+11.4f}  {f'[{lo:+.4f}, {hi:+.4f}]':<22}{r['p']:>10.3g}{r['p_holm']:>10.3g}"
                    f"{r['probability_of_improvement']:>6.2f}")
    return "\n".join(rows)
