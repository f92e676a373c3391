"""Each method of a multi-method study against the baseline, seed by seed (:mod:`nondet_jax.study.methods`).

Every method trained replica r under the same keys for every source, so the comparison is
:func:`nondet_jax.analysis.compare.compare` with ``paired=True`` on two methods' folders, and the p-values
of the methods compared with one baseline on one arm are Holm-adjusted over that family
(:func:`nondet_jax.analysis.stats.holm`). No statistics of its own.
"""

from __future__ import annotations

import json
from pathlib import Path

from nondet_jax.analysis import stats as S
from nondet_jax.analysis.compare import compare
from nondet_jax.analysis.task import QUANTITIES, run_metric, task_of
from nondet_jax.errors import UsageError
from nondet_jax.store.io import check_no_links, strict_json
from nondet_jax.store.paths import RunPaths, arm_name, method_name
from nondet_jax.store.run import read_arm_record
from nondet_jax.until import check_state


def read_record(root: str | Path) -> dict:
    """``methods.json`` of a multi-method study, its names checked; UsageError where there is none."""
    path = RunPaths(root).methods_json
    if path.exists() or path.is_symlink():  # as report: a link would read files outside the folder, a FIFO block
        check_no_links(root)                # the read forever (the methods' folders too: they are read next)
    try:
        record = json.loads(path.read_text())
        names, baseline = list(record["methods"]), record["baseline"]
    except FileNotFoundError:
        raise UsageError(f"{root} is not a study of methods (no methods.json); pass the --out folder of a sweep "
                         "with --method") from None
    except (OSError, ValueError, KeyError, TypeError):
        raise UsageError(f"{path} is unreadable or not a methods record; restore it, or start a new study with "
                         "another --out") from None
    for n in names:
        method_name(n, str(path))
    method_name(baseline, f"{path} baseline")
    if not isinstance(record["methods"], dict) or not all(isinstance(v, dict) for v in record["methods"].values()) \
            or (names and baseline not in names):
        raise UsageError(f"{path} is unreadable or not a methods record (each method a table, the baseline one of "
                         "them); restore it, or start a new study with another --out")
    if record.get("until") is not None:
        check_state(record["until"], str(path))
    return record


def finished(root: str | Path, record: dict | None = None) -> dict[str, dict]:
    """``{method: summary}`` of every method whose folder holds a finished study (``summary.json``), in the
    order of ``methods.json``."""
    record = record or read_record(root)
    out = {}
    for name in record["methods"]:
        path = RunPaths(RunPaths(root).method(name)).summary
        if path.is_file():
            out[name] = read_summary(RunPaths(root).method(name))
            _check_settings(root, record, name)
    return out


def read_summary(folder: Path) -> dict:
    """A finished method's ``summary.json`` (no checksum of its own: the report rebuilds it), checked to be a
    summary whose arms are its folder's arm records, each read through
    :func:`~nondet_jax.store.run.read_arm_record` (its own sha256 and form), and whose tables the report reads;
    UsageError naming the file and the report command that rebuilds it otherwise (an edited summary crashed the
    comparison, or made it look for another task's metric)."""
    path = RunPaths(folder).summary
    fix = f"rebuild it with python -m nondet_jax report {folder}"
    try:
        summary = json.loads(path.read_text())
        if not isinstance(summary, dict) or not isinstance(summary.get("arms"), dict) or not summary["arms"] \
                or task_of(summary) not in QUANTITIES or not _tables_in_form(summary):
            raise ValueError("not a summary")
        for arm in summary["arms"]:  # before any file is named after one
            arm_name(arm)
    except (OSError, ValueError, TypeError, AttributeError, UsageError):
        raise UsageError(f"{path} is unreadable or not a study's summary; {fix}") from None
    for arm, entry in summary["arms"].items():
        if not RunPaths(folder).arm_file("arms", arm).is_file():
            continue  # a record gone: compare_methods names the method and arm it lacks
        record = read_arm_record(folder, arm)
        if strict_json({k: v for k, v in record.items() if k != "rows"}) != entry or task_of(record) != task_of(summary):
            raise UsageError(f"{path} does not match {RunPaths(folder).arm_file('arms', arm)} (the summary was edited "
                             f"or is stale); {fix}")
    return summary


def _tables_in_form(summary: dict) -> bool:
    """A summary's tables beside its arms in the form the report's tables read them: ``vs_all`` a table per arm of
    a table per score (``replicas_for_ratio`` a table), ``decomposition`` a table."""
    vs_all = summary.get("vs_all")
    return isinstance(vs_all, dict) and isinstance(summary.get("decomposition") or {}, dict) and all(
        isinstance(v, dict) and all(isinstance(c, dict) and isinstance(c.get("replicas_for_ratio", {}), dict)
                                    for c in v.values()) for v in vs_all.values())


def settings_changes(root, record: dict, name: str) -> list[str]:
    """What differs between the configuration ``record`` (``methods.json``'s: the study's config and the method's
    settings) gives method ``name`` and the one its folder trained under (none where it holds no config), the
    replicas aside; the keys a method's own parts set are its folder's."""
    from nondet_jax import config as cfg
    from nondet_jax.store.run import config_changes

    entry = record["methods"][name]
    said = cfg.to_dict(cfg.from_flat(entry.get("settings", {}), cfg.from_dict(record["config"])))
    skip = cfg.PART_KEYS if entry.get("parts") else set()  # a method's own parts set these in its folder
    return [d for d in config_changes(RunPaths(root).method(name), said) if d.split(" ")[0] not in skip]


def _check_settings(root, record: dict, name: str) -> None:
    """A finished method's settings in ``methods.json`` against the configuration its folder trained under (a run
    folder is untrusted input: an edited record put settings in the report that no replica trained with)."""
    where = RunPaths(root).methods_json
    try:
        diff = settings_changes(root, record, name)
    except (KeyError, TypeError, AttributeError, UsageError):
        raise UsageError(f"{where} is unreadable or not a methods record (method '{name}''s settings or the study's "
                         "config); restore it, or start a new study with another --out") from None
    if diff:
        raise UsageError(f"{where} says method '{name}' trained under settings its folder did not ({'; '.join(diff[:2])}, "
                         f"trained vs recorded); restore {where.name}, or start a new study with another --out")


def compared_arms(summaries: dict[str, dict]) -> list[str]:
    """The arms every method has whose replicas differ (not ``control``: its replicas are all one run)."""
    first = next(iter(summaries.values()))
    return [a for a, s in first["arms"].items() if s.get("varied") and all(a in m["arms"] for m in summaries.values())]


def default_metric(summaries: dict[str, dict]) -> str:
    """The score compared: the task's test score (test accuracy; a regression's test MSE)."""
    return run_metric(task_of(next(iter(summaries.values()))), None)


def compare_methods(root: str | Path, a: str | None = None, b: str | None = None, arms: list[str] | None = None,
                    metric: str | None = None, detect: float | None = None) -> list[dict]:
    """Method ``b`` against ``a`` (default: every method against the baseline), paired by seed, on each of
    ``arms`` (default: :func:`compared_arms`). Each result is :func:`nondet_jax.analysis.compare.compare`'s,
    plus ``method_a``, ``method_b``, ``arm``, ``p_holm`` (Holm over the methods compared with ``a`` on that
    arm) and ``holm_family``."""
    root = Path(root)
    record = read_record(root)
    summaries = finished(root, record)
    names = list(record["methods"])
    for option, n in (("--method-a", a), ("--method-b", b)):
        if n is not None and n not in names:
            raise UsageError(f"{option} {n} is not a method of {root} (methods: {', '.join(names)}); name one of those")
        if n is not None and n not in summaries:
            raise UsageError(f"method '{n}' has no finished study in {root}; rerun the sweep to finish it")
    a = a or record["baseline"]
    if a not in summaries:
        raise UsageError(f"the baseline '{a}' has no finished study in {root}; rerun the sweep to finish it")
    others = [b] if b is not None else [n for n in summaries if n != a]
    if not others or others == [a]:
        raise UsageError(f"nothing to compare method '{a}' with in {root}; name another with --method-b")
    metric = run_metric(task_of(summaries[a]), metric)
    arms = arms or compared_arms({n: summaries[n] for n in (a, *others)})
    varied = arms or [arm for arm, s in summaries[a]["arms"].items() if s.get("varied")]
    lacking = [f"{n} lacks arm {arm}" for n in (a, *others) for arm in varied
               if not RunPaths(RunPaths(root).method(n)).arm_file("arms", arm).is_file()]
    if lacking:  # a finished arm's record gone from a method's folder (the compare CLI's "pick one with --arm" misled)
        raise UsageError(f"in {root}, method {'; '.join(lacking)} (its arms/<arm>.json is gone); rerun the study's "
                         "command to train it again")
    if not arms:
        raise UsageError(f"the methods of {root} share no arm whose replicas vary (control's are one run); train an "
                         "arm such as all")
    results = []
    for arm in arms:
        family = [compare(RunPaths(root).method(a), RunPaths(root).method(n), arm=arm, metric=metric, detect=detect,
                          paired=True) for n in others]
        for n, r, q in zip(others, family, S.holm([r["p"] for r in family])):
            r.update(method_a=a, method_b=n, arm=arm, p_holm=q, holm_family=len(family))
        results += family
    return results
