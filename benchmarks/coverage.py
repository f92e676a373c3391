"""Simulated coverage of every interval nondet_jax prints, at R=3, 4, 5, 8 and 16 (nominal 95%), and the
false-alarm rates of its spread tests.

For each case of :data:`nondet_jax.analysis.coverage.CASES` (an interval, its method and a data model with a
known true value), draws ``--trials`` seeded simulated studies per replica count and prints the
fraction whose interval contains the truth ("n/a" where the tool prints no interval at that R; a study
printing n/a counts as a miss). Then, with
every arm drawn from one scenario, how often each spread test says "different" at p < 0.05, alone and
(Holm) over 5 arms; last, the methods these replaced (percentile bootstrap, chi-square and F intervals,
the disagreement's jackknife alone) on the same data; last, what an n/a for arms that look strongly skewed
would do to the strong-skew case (:func:`skew_flag`). Writes benchmarks/results/coverage.json.

``--sequential-grid`` sets the sequential design's boundary shapes and futility thresholds side by side
(:data:`GRID`, 2000 studies per cell with ``--trials 2000``, into power.json's ``sequential_grid``).

``--power`` instead measures power beside coverage (:mod:`nondet_jax.analysis.power`: std ratios of independent
arms and of arms sharing seeds, paired compare on 360 images, the failed-replica rule's false alarms, the
findings' family-wise error over 6 arms, the sequential design) into benchmarks/results/power.json: ``python
benchmarks/coverage.py --power --trials 2000 --replicas 8 16`` (about 8 minutes on a loaded
2-core box; ``--quick``: 300 studies at R=8, what the test runs); ``--power --markdown`` prints its tables.

Run ``python benchmarks/coverage.py [--trials 4000] [--test-trials 300]`` (about 15 minutes on 2 cores,
most of it the exact permutation tests at R=8); ``--markdown`` prints docs/statistics.md's coverage table from
the JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from scipy import stats as sps

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from nondet_jax.analysis import coverage, power, sequential  # noqa: E402  (after the checkout is put on sys.path)
from nondet_jax.analysis import stats as S  # noqa: E402
from nondet_jax.analysis.stats import METHODS, MIN_REPLICAS  # noqa: E402
from nondet_jax.store.io import atomic_write_json  # noqa: E402


def percentile_bootstrap(statistic: str, replicas: int, trials: int, seed: int, resamples: int = 1000) -> float:
    """Coverage of the percentile bootstrap the report used before (replaced): normal data, 95% nominal."""
    rng = np.random.default_rng(seed)
    x = rng.normal(0.0, 1.0, (trials, replicas))
    idx = rng.integers(0, replicas, (resamples, replicas))
    boot = x[:, idx]  # (trials, resamples, R)
    values = boot.std(-1, ddof=1) if statistic == "std" else boot.mean(-1)
    lo, hi = np.quantile(values, [0.025, 0.975], axis=1)
    truth = 1.0 if statistic == "std" else 0.0
    return float(np.mean((lo <= truth) & (truth <= hi)))


def normal_theory(kind: str, sc, replicas: int, trials: int, seed: int) -> float:
    """Coverage of the normal-theory interval the report printed before (chi-square for a std, F for a
    ratio) on scenario ``sc`` of :data:`nondet_jax.analysis.coverage.SCENARIOS`."""
    rng = np.random.default_rng(seed)
    x = sc.draw(rng, (trials, replicas))
    if kind == "std":
        lo, hi = S.std_ci_normal(x)
        return float(np.mean((lo <= sc.std) & (sc.std <= hi)))
    lo, hi = S.std_ratio_ci_normal(x, sc.reference(rng, (trials, replicas)))
    truth = sc.std / sc.reference_std
    return float(np.mean((lo <= truth) & (truth <= hi)))


def skew_flag(replicas, trials: int, threshold: float = 2.0) -> list:
    """Would printing n/a for arms that look strongly skewed (|sample skewness| > ``threshold``) rescue the
    strong-skew stress case? Prints and returns, per scenario and R, the share flagged and the coverage of
    the mean's and the std's intervals among the arms left (the misses are arms that drew no large value,
    which look the least skewed: the flag makes the printed intervals worse, not better)."""
    out = []
    print(f"\nan n/a for |sample skewness| > {threshold}: share flagged, then mean / std coverage of the rest "
          "(all arms in brackets)")
    for name in ("normal", "skewed", "bad seeds", "strong skew (stress)"):
        sc, line = coverage.SCENARIOS[name], []
        for r in replicas:
            x = sc.draw(np.random.default_rng(r), (trials, r))
            flagged = np.abs(sps.skew(x, axis=-1, bias=False)) > threshold
            hits = {}
            for kind, (lo, hi), truth in (("mean", S.mean_ci(x), sc.mean), ("std", S.std_ci(x), sc.std)):
                hit = (lo <= truth) & (truth <= hi)
                hits[kind] = {"all": float(hit.mean()), "rest": float(hit[~flagged].mean())}
            out.append({"scenario": name, "replicas": r, "flagged": float(flagged.mean()), **hits})
            line.append(f"R={r} {100 * flagged.mean():.0f}%: {100 * hits['mean']['rest']:.1f}% "
                        f"({100 * hits['mean']['all']:.1f}) / {100 * hits['std']['rest']:.1f}% ({100 * hits['std']['all']:.1f})")
        print(f"{name:<22}" + "  ".join(line))
    return out


def markdown(stored: dict) -> str:
    """The coverage table of docs/statistics.md, from the stored JSON (``--markdown``)."""
    rs = list(stored["rows"][0]["coverage"])
    lines = ["| interval | data model | " + " | ".join(f"R={r}" for r in rs) + " |", "|---|---|" + "---|" * len(rs)]
    for row in stored["rows"]:
        lines.append(f"| {row['interval']} | {row['data_model']} | " + " | ".join(
            "n/a" if c is None else f"{100 * c:.1f}%" for c in row["coverage"].values()) + " |")
    return "\n".join(lines)


def cells(cov: dict) -> str:
    return "".join(f"{'n/a':>8}" if c is None or c != c else f"{100 * c:>7.1f}%" for c in cov.values())


THRESHOLDS = (5.0, 6.0, 8.0, 10.0, 12.0)


def power_tables(trials: int, replicas: list) -> dict:
    """Power beside coverage (:mod:`nondet_jax.analysis.power`): prints each table and returns them for the JSON."""
    out: dict = {"trials": trials, "replicas": replicas}
    pct = lambda v: f"{100 * v:>6.1f}%"  # noqa: E731
    print(f"\nstd ratio of independent arms, true ratio 2: coverage / power (interval excludes 1); at ratio 1: "
          f"false alarms ({trials} studies per cell)")
    rows = []
    for sc in power.RATIO_SCENARIOS:
        for r in replicas:
            cell = power.ratio_cell(sc, r, trials, seed=r)
            rows.append({"scenario": sc, "realistic": power.RATIO_SCENARIOS[sc].realistic, "replicas": r, **cell})
            print(f"{sc:<34} R={r:<3}" + "".join(f"  {m}: {pct(c['coverage'])} / {pct(c['power'])} fa {pct(c['false_alarm'])}"
                                                 for m, c in cell.items()))
    out["ratio"] = rows
    out["spread_test"] = []
    print("\npermutation spread tests (every split up to R=8): false alarms / power at a true std ratio of 2")
    for sc, scenario in power.RATIO_SCENARIOS.items():
        for r in sorted({6, *replicas}) if not scenario.failed else ():
            cell = power.spread_test_cell(sc, r, trials, seed=r)
            out["spread_test"].append({"scenario": sc, "realistic": scenario.realistic, "replicas": r, **cell})
            print(f"{sc:<34} R={r:<3}" + "".join(f"  {t}: {pct(c['false_alarm'])} / {pct(c['power'])}"
                                                 for t, c in cell.items()))
    print("\none arm's std (and mean) interval as R grows, on the scenarios above")
    rows = []
    for sc in power.RATIO_SCENARIOS:
        cov = {str(r): power.std_cell(sc, r, trials, seed=r) for r in sorted({*replicas, 32})}
        rows.append({"scenario": sc, "realistic": power.RATIO_SCENARIOS[sc].realistic, "coverage": cov})
        print(f"{sc:<34}" + "".join(f"  R={r}: std {pct(c['std'])} mean {pct(c['mean'])}" for r, c in cov.items()))
    out["std_by_r"] = rows
    print("\nstd ratio of arms sharing seeds (a = u, b = u + w), true ratio 0.5: coverage / power; ratio 1: coverage / "
          "false alarms")
    rows = []
    for sc in power.PAIRED_SCENARIOS:
        for r in replicas:
            cell = power.paired_spread_cell(sc, r, trials, seed=r)
            rows.append({"scenario": sc, "realistic": power.PAIRED_SCENARIOS[sc].realistic, "replicas": r, **cell})
            print(f"{sc:<28} R={r:<3}" + "".join(f"  {m}: {pct(c['coverage'])}/{pct(c['power'])} null {pct(c['coverage_null'])}"
                                                 for m, c in cell.items()))
    out["paired_ratio"] = rows
    print(f"\npaired compare on 360 images, gain {power.COMPARE_GAIN} (in images: truth below): coverage / power / mean width")
    rows = []
    for r in replicas:
        cell = power.compare_cell(r, trials, seed=r)
        rows.append({"replicas": r, **cell})
        print(f"R={r:<3} gain {cell['truth_images']:.2f} images  " + "  ".join(
            f"{m}: " + " / ".join(f"{k} {v:.4f}" for k, v in c.items()) for m, c in cell.items() if isinstance(c, dict)))
    out["compare"] = rows
    print("\nfailed-replica rule (median ± t·1.4826·MAD): share of healthy arms with a replica named; for the failing "
          "scenario, arms whose failed runs are not exactly the ones named")
    rows = []
    for sc in power.RATIO_SCENARIOS:
        for r in replicas:
            rates = {str(t): power.failed_alarms(sc, r, t, trials, seed=r) for t in THRESHOLDS}
            rows.append({"scenario": sc, "replicas": r, "rate": rates})
            print(f"{sc:<34} R={r:<3}" + "".join(f"  t={t}: {pct(v)}" for t, v in rates.items()))
    out["failed_rule"] = rows
    print("\nfamily-wise error of the findings over 6 arms with the reference's spread (ratio interval excludes 1)")
    rows = []
    for sc in ("normal", "skewed", "near ceiling 99.4%", "bad seeds"):
        for r in replicas:
            raw, adj = (power.family_error(sc, r, 6, trials, seed=r, adjust=a) for a in (False, True))
            paired = power.family_error_paired(sc, r, 6, trials, seed=r) if sc in power.COMPONENTS else None
            rows.append({"scenario": sc, "replicas": r, "unadjusted": raw, "bonferroni": adj, "paired_bonferroni": paired})
            print(f"{sc:<34} R={r:<3} 95% each: {pct(raw)}  at 1 − 0.05/6 each: {pct(adj)}"
                  + ("" if paired is None else f"  paired (arms sharing seeds), 1 − 0.05/6: {pct(paired)}"))
    out["family"] = rows
    print("\nsequential paired compare (nondet_jax.analysis.sequential: looks every 4 replicas per method from 8 to 32; "
          "differences in std units): share deciding a difference (the error at effect 0), mean replicas at the stop, "
          "coverage of the interval printed there, share stopped inside ±D, fixed replicas for the same power")
    rows = []
    scenarios = {"normal": None, "360 images": power.paired_accuracy_differences}
    for spec in ("decided", "decided=0.5", "width=1"):
        rule, _, value = spec.partition("=")
        design = sequential.Until(rule, float(value) if value else None, 8, 32)
        for sc, gen in scenarios.items():
            for effect in (0.0, 0.5, 0.7, 1.0):
                cell = {"scenario": sc, **sequential.simulate(design, effect, trials, seed=1, differences=gen)}
                rows.append(cell)
                print(f"{spec:<12} {sc:<11} effect {effect:<4} decided {pct(cell['decided'])}  mean replicas "
                      f"{cell['mean_replicas']:.1f}  coverage {pct(cell['coverage'])}"
                      + (f"  within ±D {pct(cell['within'])}" if cell["within"] is not None else "")
                      + (f"  futile {pct(cell['futile'])}" if cell["futile"] is not None else "")
                      + f"  saved against {design.max_replicas}: {pct(cell['saved_against_max'])}"
                      + (f"  fixed {cell['fixed_same_power']}, saved {pct(cell['saved'])}"
                         if cell.get("fixed_same_power") else ""))
    out["sequential"] = rows
    return out


GRID = [(0.5, 0.1, False, 8, 4), (0.5, 0.1, True, 8, 4), (0.5, 0.3, True, 8, 4), (0.4, 0.1, True, 8, 4),
        (0.4, 0.2, True, 8, 4), (0.4, 0.3, True, 8, 4), (0.3, 0.2, True, 8, 4), (0.3, 0.3, True, 8, 4),
        (0.4, 0.2, True, 8, 2), (0.3, 0.3, True, 8, 2), (0.3, 0.3, True, 6, 2), (0.3, 0.3, True, 4, 2)]
# (boundary shape, futility, futility counted in the calibration, first look's replicas, replicas added per look);
# every design looks last at 32 replicas per method


def sequential_grid(trials: int) -> list[dict]:
    """The sequential design's choice (``--sequential-grid``): for each boundary shape and futility threshold of
    :data:`GRID` (the first row the design before: Pocock's level, 10%, not counted), the error where there is
    no difference and, at standardised differences 0.5, 0.7 and 1, the power, mean replicas and the share saved
    against the fixed paired t design of the same power, on normal and 360-image differences (the last look at 32
    replicas; the first and the spacing of the looks as the row says)."""
    scenarios = {"normal": None, "360 images": power.paired_accuracy_differences}
    pct = lambda v: "—" if v is None else f"{100 * v:.1f}%"  # noqa: E731
    rows = []
    for shape, futility, binding, first, step in GRID:
        boundary = {"shape": shape, "futility": futility, "futility_counted": binding}
        design = sequential.Until("decided", None, first, 32, step)
        for sc, gen in scenarios.items():
            for effect in (0.0, 0.5, 0.7, 1.0):
                cell = sequential.simulate(design, effect, trials, seed=1, differences=gen, boundary=boundary)
                rows.append({"shape": shape, "futility": futility, "binding": binding, "round": step, "scenario": sc,
                             **cell})
            got = rows[-4:]
            print(f"looks {first}+{step}k shape {shape} futility {futility:.0%} {'binding' if binding else 'not counted'}"
                  f"  {sc:<10} error {pct(got[0]['decided'])}  " + "  ".join(f"{r['effect']:g}: power {pct(r['decided'])} replicas "
                                                            f"{r['mean_replicas']:.1f} saved {pct(r['saved'])}"
                                                            for r in got[1:]), flush=True)
    return rows


def grid_markdown(rows: list[dict]) -> str:
    lines = ["| looks (replicas per method) | boundary shape | futility | counted in the calibration | scenario | error | "
             "power 0.5 / 0.7 / 1 | mean replicas 0.5 / 0.7 / 1 | saved against the same power 0.5 / 0.7 / 1 |", "|---|---|---|---|---|---|---|---|---|"]
    for i in range(0, len(rows), 4):
        null, *real = rows[i:i + 4]
        lines.append(f"| {null['first']}, {null['first'] + null['round']}, …, 32 | {null['shape']:g} | "
                     f"{100 * null['futility']:.0f}% | {'yes' if null['binding'] else 'no'} | {null['scenario']} | {100 * null['decided']:.1f}% | "
                     + " / ".join(f"{100 * r['decided']:.0f}%" for r in real) + " | "
                     + " / ".join(f"{r['mean_replicas']:.1f}" for r in real) + " | "
                     + " / ".join("—" if r["saved"] is None else f"{100 * r['saved']:.0f}%" for r in real) + " |")
    return "\n".join(lines)


def power_markdown(stored: dict) -> str:
    """docs/statistics.md's power tables, from the stored power JSON (``--power --markdown``)."""
    lines = ["| std ratio 2, independent arms | R | " + " | ".join(power.RATIO_METHODS.values()) + " |",
             "|---|---|" + "---|" * len(power.RATIO_METHODS)]
    for row in stored["ratio"]:
        lines.append(f"| {row['scenario']}{'' if row['realistic'] else ' (stress)'} | {row['replicas']} | " + " | ".join(
            f"{100 * row[m]['coverage']:.1f}% / {100 * row[m]['power']:.1f}%" for m in power.RATIO_METHODS) + " |")
    lines += ["", "| std ratio 0.5, arms sharing seeds | R | " + " | ".join(power.PAIRED_METHODS.values()) + " |",
              "|---|---|" + "---|" * len(power.PAIRED_METHODS)]
    for row in stored["paired_ratio"]:
        lines.append(f"| {row['scenario']} | {row['replicas']} | " + " | ".join(
            f"{100 * row[m]['coverage']:.1f}% / {100 * row[m]['power']:.1f}% (null {100 * row[m]['coverage_null']:.1f}%)"
            for m in power.PAIRED_METHODS) + " |")
    lines += ["", "| paired compare, 360 images | R | gain (images) | " + " | ".join(power.COMPARE_METHODS.values()) + " |",
              "|---|---|---|" + "---|" * len(power.COMPARE_METHODS)]
    for row in stored["compare"]:
        cells = []
        for m in power.COMPARE_METHODS:
            c = row.get(m)
            cells.append("n/a" if c is None else " / ".join(
                f"{100 * c[k]:.1f}%" for k in ("coverage", "power") if k in c) + (
                f", width {360 * c['width']:.2f} images" if "width" in c else ""))
        lines.append(f"| paired compare | {row['replicas']} | {row['truth_images']:.2f} | " + " | ".join(cells) + " |")
    rs = list(stored["std_by_r"][0]["coverage"])
    lines += ["", "| one arm's std / mean interval | " + " | ".join(f"R={r}" for r in rs) + " |", "|---|" + "---|" * len(rs)]
    for row in stored["std_by_r"]:
        lines.append(f"| {row['scenario']}{'' if row['realistic'] else ' (stress)'} | " + " | ".join(
            f"{100 * c['std']:.1f}% / {100 * c['mean']:.1f}%" for c in row["coverage"].values()) + " |")
    lines += ["", "| permutation spread test: false alarms / power at a true ratio of 2 | R | "
              + " | ".join(power.SPREAD_TESTS.values()) + " |", "|---|---|" + "---|" * len(power.SPREAD_TESTS)]
    lines += [f"| {row['scenario']}{'' if row['realistic'] else ' (stress)'} | {row['replicas']} | " + " | ".join(
        f"{100 * row[t]['false_alarm']:.1f}% / {100 * row[t]['power']:.1f}%" for t in power.SPREAD_TESTS) + " |"
        for row in stored["spread_test"]]
    ts = list(stored["failed_rule"][0]["rate"])
    lines += ["", "| failed-replica rule: arms with a replica named | R | " + " | ".join(f"{float(t):g} robust stds" for t in ts)
              + " |", "|---|---|" + "---|" * len(ts)]
    for row in stored["failed_rule"]:
        what = " (a failed run not named)" if row["scenario"].startswith("1 in 8") else ""
        lines.append(f"| {row['scenario']}{what} | {row['replicas']} | "
                     + " | ".join(f"{100 * v:.1f}%" for v in row["rate"].values()) + " |")
    lines += ["", "| findings over 6 arms: a difference found that is not there | R | 95% each | 1 − 0.05/6 each | "
              "paired, 1 − 0.05/6 each |", "|---|---|---|---|---|"]
    for row in stored["family"]:
        paired = row.get("paired_bonferroni")
        lines.append(f"| {row['scenario']} | {row['replicas']} | {100 * row['unadjusted']:.1f}% | "
                     f"{100 * row['bonferroni']:.1f}% | {'—' if paired is None else f'{100 * paired:.1f}%'} |")
    lines += ["", "| sequential paired compare (8 to 32 replicas per method, 4 per look) | scenario | standardised effect "
              "| decided a difference | inside ±D | given up | mean replicas | coverage at the stop | saved against 32 "
              "| fixed replicas, same power | saved against it |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    share = lambda v: "—" if v is None else f"{100 * v:.1f}%"  # noqa: E731
    for row in stored.get("sequential", []):
        fixed, saved = row.get("fixed_same_power"), row.get("saved")
        lines.append(f"| {row['rule']} | {row['scenario']} | {row['effect']:g} | {share(row['decided'])} | "
                     f"{share(row['within'])} | {share(row['futile'])} | {row['mean_replicas']:.1f} | "
                     f"{share(row['coverage'])} | {100 * row['saved_against_max']:.0f}% | {fixed or '—'} | "
                     f"{'—' if saved is None else f'{100 * saved:.0f}%'} |")
    if stored.get("sequential_grid"):
        lines += ["", grid_markdown(stored["sequential_grid"])]
    return "\n".join(lines)



def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=4000)
    p.add_argument("--replicas", type=int, nargs="+", default=[3, 4, 5, 8, 16])
    p.add_argument("--test-trials", type=int, default=300)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "coverage.json")
    p.add_argument("--only", nargs="+", metavar="PREFIX",
                   help="recompute only the interval rows whose name starts with a PREFIX (and the skewness-flag "
                        "check) and put them into the existing --out (its other rows, false alarms and replaced "
                        "methods are kept)")
    p.add_argument("--markdown", action="store_true",
                   help="print the coverage table of docs/statistics.md from --out and exit (no simulation)")
    p.add_argument("--power", action="store_true",
                   help="power beside coverage (nondet_jax.analysis.power) instead, written to --power-out; with "
                        "--markdown, its tables from --power-out")
    p.add_argument("--power-out", type=Path, default=ROOT / "benchmarks" / "results" / "power.json")
    p.add_argument("--sequential-grid", action="store_true",
                   help="the sequential design's boundary shapes and futility thresholds side by side, into --power-out")
    p.add_argument("--quick", action="store_true",
                   help="with --power: 300 studies per cell at R=8 only (about a minute; what the test runs)")
    args = p.parse_args(argv)
    if args.power and args.markdown:
        print(power_markdown(json.loads(args.power_out.read_text())))
        return 0
    if args.markdown:
        print(markdown(json.loads(args.out.read_text())))
        return 0
    if args.sequential_grid:
        stored = json.loads(args.power_out.read_text()) if args.power_out.exists() else {}
        stored["sequential_grid"] = sequential_grid(args.trials)
        atomic_write_json(args.power_out, stored)
        print(f"{args.trials} simulated studies per cell; wrote {args.power_out}")
        return 0
    if args.power:
        trials, reps = (300, [8]) if args.quick else (args.trials, args.replicas)
        result = power_tables(trials, reps)
        if args.power_out.exists():  # the design grid (--sequential-grid) is kept
            grid = json.loads(args.power_out.read_text()).get("sequential_grid")
            result.update({"sequential_grid": grid} if grid else {})
        atomic_write_json(args.power_out, result)
        print(f"{trials} simulated studies per cell; wrote {args.power_out}")
        return 0
    rows = []
    print(f"{'interval: scenario':<50}" + "".join(f"{'R=' + str(r):>8}" for r in args.replicas) + "  data model")
    for name, (kind, model, _) in coverage.CASES.items():
        if args.only and not name.startswith(tuple(args.only)):
            continue
        cov = {str(r): coverage.simulate(name, r, args.trials, seed=r) if r >= MIN_REPLICAS[kind] else None
               for r in args.replicas}
        rows.append({"interval": name, "kind": kind, "method": METHODS[kind], "data_model": model, "coverage": cov})
        print(f"{name:<50}{cells(cov)}  {model}")
    if args.only:  # merged into the stored table, in CASES order
        stored = json.loads(args.out.read_text())
        new = {r["interval"]: r for r in rows}
        old = {r["interval"]: r for r in stored["rows"]}
        stored["rows"] = [new.get(n) or old[n] for n in coverage.CASES if n in new or n in old]
        stored["skew_flag"] = skew_flag(args.replicas, args.trials)  # cheap, and it rests on the intervals
        atomic_write_json(args.out, stored)
        print(f"{args.trials} simulated studies per cell; put {len(rows)} rows into {args.out}")
        return 0
    alarms = []
    print(f"\nfalse alarms at p < 0.05, every arm from one scenario ({args.test_trials} studies; 5 arms: at least one)")
    print(f"{'test':<18}{'scenario':<26}" + "".join(f"{'R=' + str(r):>8}" for r in args.replicas) + f"{'5 arms R=8':>12}")
    for test in ("spread_p", "f_test_p", "brown_forsythe_p"):
        for sc in ("normal", "skewed", "heavy tails", "bad seeds", "counts, 360 images", "near ties, 360 images"):
            rate = {str(r): coverage.false_alarm(test, sc, r, args.test_trials, seed=r) for r in args.replicas}
            family = coverage.false_alarm(test, sc, 8, args.test_trials // 2, seed=1, arms=5)
            holm = coverage.false_alarm("spread_p_holm", sc, 8, args.test_trials // 2, seed=1, arms=5) \
                if test == "spread_p" else None
            alarms.append({"test": test, "scenario": sc, "false_alarm": rate, "five_arms": family, "five_arms_holm": holm})
            print(f"{test:<18}{sc:<26}" + "".join(f"{100 * v:>7.1f}%" for v in rate.values()) + f"{100 * family:>11.1f}%"
                  + ("" if holm is None else f"  Holm {100 * holm:.1f}%"))
    before = []
    print("\nreplaced methods, on the same scenarios")
    for statistic in ("std", "mean"):
        cov = {str(r): percentile_bootstrap(statistic, r, args.trials, seed=r) for r in args.replicas}
        before.append({"interval": statistic, "method": "percentile bootstrap, 1000 resamples (replaced)",
                       "data_model": "normal", "coverage": cov})
        print(f"{statistic + ': normal (percentile bootstrap)':<50}{cells(cov)}")
    for name, sc in coverage.SCENARIOS.items():
        for kind, method in (("std", "chi-square interval (normal theory)"), ("ratio", "F interval (normal theory)")):
            cov = {str(r): normal_theory(kind, sc, r, args.trials, seed=r) for r in args.replicas}
            before.append({"interval": kind, "method": method + " (replaced)", "data_model": sc.description,
                           "coverage": cov})
            print(f"{kind + ': ' + name + ' (' + method.split(' ')[0] + ')':<50}{cells(cov)}")
    for name, args_ in coverage.BORDERLINE.items():
        cov, printed = {}, {}
        for r in args.replicas:
            values, _, truth = coverage.borderline_draws(np.random.default_rng(r), r, args.trials, *args_)
            # the jackknife alone, as it was replaced: t's 97.5% quantile (level chosen to undo stats.MEAN_TAIL)
            lo, hi = S.pairwise_mean_ci(values, r, level=1 - 0.05 / S.MEAN_TAIL, bounds=(0.0, 1.0), scale="log")
            shown = np.isfinite(lo)
            printed[str(r)] = float(shown.mean())
            cov[str(r)] = float(np.mean(((lo <= truth) & (truth <= hi))[shown])) if shown.any() else None
        before.append({"interval": "pairwise", "method": "log-scale replica jackknife alone (replaced): coverage "
                       "among the studies that print an interval", "data_model": name, "coverage": cov,
                       "printed": printed})
        print(f"{name + ' (jackknife alone)':<50}{cells(cov)}  printed in "
              + ", ".join(f"{100 * v:.0f}%" for v in printed.values()))
    flag = skew_flag(args.replicas, args.trials)
    atomic_write_json(args.out, {"nominal": 0.95, "trials": args.trials, "rows": rows, "false_alarms": alarms,
                                 "replaced": before, "skew_flag": flag})
    print(f"{args.trials} simulated studies per cell; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
