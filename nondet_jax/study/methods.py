"""Methods in a study: "is method B really better than A, or was it the seed?" as one run folder.

A multi-method study is a folder holding ``methods.json`` (the methods, in order, their settings, the
baseline and the study's base config) and one ordinary run folder per method, ``methods/<name>/``. Every
method runs the same arms, replicas and ``study.seed``, so replica r of every method trains under the same
keys for every source: methods are paired seed by seed by construction. Reuse, resume and the refusals of a
changed config or changed parts work per method exactly as for one study (:func:`nondet_jax.study.runner.run`
on each folder), so adding a method to a finished study trains only the new one.

Checked before JAX starts (no JAX at module level): the command line refuses a bad ``--method`` before
training anything.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, NamedTuple

from nondet_jax import config as cfg
from nondet_jax.errors import UsageError
from nondet_jax.store.io import atomic_write_json, check_no_links, check_path_name, guarded
from nondet_jax.store.paths import RunPaths, method_name
from nondet_jax.until import number

# run_study's own parts a method may replace (the others are config keys, dotted).
PART_KEYS = ("model", "optimizer", "loss", "augment", "init_params")
# What pairs the methods: every method runs the study's arms, replicas and seed.
SHARED_KEYS = ("study.seed", "study.replicas", "study.arms")


class Method(NamedTuple):
    """One method of a study: its name, its config keys (dotted, on top of the study's config) and the
    parts it replaces (``run_study``'s ``model``, ``optimizer``, ...; empty on the command line)."""

    name: str
    settings: dict
    parts: dict


def parse_method(spec: str) -> tuple[str, dict[str, str]]:
    """``--method NAME:KEY=VALUE[,KEY=VALUE...]`` -> ``(NAME, {KEY: VALUE})``. A value may hold commas
    (``metrics.tta=flip,crop5``): items split only before a ``section.key=``."""
    name, colon, rest = spec.partition(":")
    if not colon:
        raise UsageError(f"--method {spec!r} has no ':'; write --method NAME:KEY=VALUE[,KEY=VALUE...] "
                         "(--method base: for the study's own settings)")
    method_name(name.strip())
    settings: dict[str, str] = {}
    for item in re.split(r",(?=\s*[A-Za-z_][A-Za-z0-9_]*\.[A-Za-z_][A-Za-z0-9_]*\s*=)", rest) if rest.strip() else []:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise UsageError(f"--method {spec!r}: {item!r} is not KEY=VALUE; write e.g. --method "
                             f"{name.strip()}:optim.lr=0.2")
        if key.strip() in settings:
            raise UsageError(f"--method {spec!r} sets {key.strip()} twice; set it once")
        settings[key.strip()] = value.strip()
    return name.strip(), settings


def from_file(flat: dict[str, Any]) -> tuple[dict[str, dict], str | None]:
    """The ``methods:`` section (``{NAME: {KEY: VALUE}}``, keys dotted or in sections) and ``baseline:`` of a
    preset or config file, taken out of its flattened keys (:func:`nondet_jax.config.load_file`), which
    keep the rest. Returns ``(methods, baseline)``."""
    methods: dict[str, dict] = {}
    for key in [k for k in flat if k.startswith("methods.")]:
        name, value = key.removeprefix("methods."), flat.pop(key)
        if value is None:
            value = {}
        if not isinstance(value, dict):
            raise UsageError(f"methods: {name} holds {value!r}, not a mapping of config keys; write e.g. "
                             f"methods: {{{name}: {{optim.lr: 0.2}}}} (or {{}} for the study's own settings)")
        settings = {}
        for k, v in value.items():
            for k2, v2 in (v.items() if isinstance(v, dict) else [(None, v)]):
                settings[f"{k}.{k2}" if k2 is not None else str(k)] = v2
        methods[name] = settings
    if "methods" in flat:
        raise UsageError(f"methods: holds {flat['methods']!r}, not a mapping of method names; write e.g. "
                         "methods: {base: {}, lr2: {optim.lr: 0.2}}")
    baseline = flat.pop("baseline", None)
    return methods, None if baseline is None else str(baseline)


def plan(base: cfg.Config, methods: dict, baseline: str | None = None, *, api: bool = False) -> tuple[list[Method], str]:
    """The methods checked, before anything is built or trained: names (:func:`method_name`), at least
    two, each method's keys (config keys, or with ``api`` also :data:`PART_KEYS`), none of
    :data:`SHARED_KEYS`, each method's config valid on top of ``base``, and the baseline one of them
    (default: the first). Returns ``(methods, baseline)``."""
    where = "methods=" if api else "--method"
    if not isinstance(methods, dict) or len(methods) < 2:
        raise UsageError(f"a study of methods needs at least two methods (the baseline and one to compare with it), "
                         f"got {len(methods) if isinstance(methods, dict) else methods!r}; add one, e.g. "
                         + ('methods={"base": {}, "lr2": {"optim.lr": 0.2}}' if api else
                            "--method base: --method lr2:optim.lr=0.2"))
    out = []
    for name, over in methods.items():
        method_name(name)
        if over is None:
            over = {}
        if not isinstance(over, dict):
            raise UsageError(f"{where} method '{name}' holds a {type(over).__name__}; give a dict of overrides, e.g. "
                             f"{{'optim.lr': 0.2}} or {{}} for the study's own settings")
        parts = {k: v for k, v in over.items() if api and k in PART_KEYS}
        settings = {str(k): v for k, v in over.items() if k not in parts}
        for key in settings:
            if key in SHARED_KEYS:
                raise UsageError(f"method '{name}' sets {key}, which every method shares (the study's arms, replicas "
                                 f"and seed pair the methods seed by seed); set it for the whole study, not per method")
            if key not in cfg.valid_keys() and api:
                import difflib

                keys = [*PART_KEYS, *cfg.valid_keys()]
                close = [k for k in cfg.valid_keys() if k.split(".")[-1] == key] or difflib.get_close_matches(key, keys, 1)
                raise UsageError(f"method '{name}' sets '{key}', which is neither one of run_study's parts "
                                 f"({', '.join(PART_KEYS)}) nor a config key; "
                                 + (f"did you mean '{close[0]}'?" if close else "config keys are listed in docs/cli.md"))
        try:
            own = cfg.from_flat(settings, base)
            cfg.refuse_optim_settings({k: "the method" for k in settings if k != "optim.name"}, own.optim)
        except UsageError as e:
            raise UsageError(f"method '{name}': {e}") from None
        out.append(Method(name, settings, parts))
    names = [m.name for m in out]
    baseline = names[0] if baseline is None else baseline
    if baseline not in names:
        raise UsageError(f"baseline '{baseline}' is not one of the methods ({', '.join(names)}); name one of those")
    return out, baseline


def duplicate_check(names: list[str]) -> None:
    """A method named twice (the command line's repeated ``--method``; a dict cannot hold one twice)."""
    twice = next((n for n in names if names.count(n) > 1), None)
    if twice is not None:
        raise UsageError(f"method '{twice}' is named twice; name each method once")


def default_out(base: cfg.Config) -> Path:
    """``runs/<dataset>-<model>-methods-<hash>``, the hash over the study's base config: the same
    study, the same folder, so a method added later joins it."""
    from nondet_jax.store.run import config_digest

    name = lambda s: re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(s).stem if s.endswith(".npz") else s)  # noqa: E731
    return Path("runs") / f"{name(base.data.name)}-{name(base.model.name)}-methods-{config_digest(cfg.to_dict(base))[:8]}"


def check_folder(root: Path) -> None:
    """Refuse a folder that is an ordinary (single-method) run folder as a multi-method study's ``--out``."""
    if RunPaths(root).config.exists():
        raise UsageError(f"{root} holds a single study (config.json), not a study of methods; choose another --out "
                         "for the methods")


def write_methods(root: Path, base: cfg.Config, methods: list[Method], baseline: str, until=None) -> dict:
    """``methods.json``: the methods of earlier runs of this folder kept (in their order), this run's
    added or updated, its baseline; a sequential study's design (``until``) from the start, with no look yet,
    so a study interrupted before its first look resumes as the sequential study it is. A method's folder trained
    under other settings than the record would now give it is refused before anything is written (the record
    said the refused settings, and the report then refused the folder as edited)."""
    from nondet_jax.analysis.methods import read_record, settings_changes
    from nondet_jax.analysis.sequential import design_record
    from nondet_jax.store.run import different_config

    old = read_record(root) if RunPaths(root).methods_json.exists() else {"methods": {}}
    state = old.get("until") or (None if until is None else {"design": design_record(until), "looks": []})
    record = {"baseline": baseline, "config": cfg.to_dict(base), "methods": dict(old["methods"]),
              **({"until": state} if state is not None else {})}
    for m in methods:
        entry = {"settings": {k: str(v) for k, v in m.settings.items()}, "parts": sorted(m.parts),
                 "folder": f"methods/{m.name}"}
        before = record["methods"].get(m.name)
        if isinstance(before, dict) and "identity_sha256" in before and all(before.get(k) == v for k, v in entry.items()):
            entry["identity_sha256"] = before["identity_sha256"]  # the same method: its trained identity stands
        record["methods"][m.name] = entry
    for name in record["methods"]:
        try:
            diff = settings_changes(root, record, name)
        except (KeyError, TypeError, AttributeError, UsageError):
            diff = []  # a damaged entry or folder config: refused where it is read
        if diff:
            raise different_config(RunPaths(root).method(name), diff)
    atomic_write_json(RunPaths(root).methods_json, record, root=root)
    return record


def run_methods(base: cfg.Config, methods: list[Method], baseline: str, out: str | Path | None, *,
                run_one, log=print, command: str | None = None, batch=None, until=None) -> Path:
    """Train every method into ``out/methods/<name>`` (``run_one(method, folder, replicas)`` runs one ordinary
    study there and returns its summary; ``replicas`` None: the study's own, else a look of a sequential study,
    whose run grows the folder to that many), record ``methods.json``, then write the report across methods.
    ``batch(out)``, when given, first trains the methods that can train together
    (:mod:`nondet_jax.study.batched`); ``run_one`` then finds their arms finished. ``until``
    (:class:`nondet_jax.analysis.sequential.Until`): train in looks until every comparison is answered
    (:func:`run_looks`). Returns the folder."""
    out = Path(out) if out is not None else default_out(base)
    check_path_name(out, "--out")
    check_no_links(out)
    check_folder(out)
    out.mkdir(parents=True, exist_ok=True)
    if until is not None and batch is not None:
        raise UsageError("--batch-methods trains every method's replicas at once, which a sequential study (--until) "
                         "adds look by look; drop one of them")
    replicas = check_design(out, until, [m.name for m in methods], baseline)
    write_methods(out, base, methods, baseline, until)
    if batch is not None:
        batch(out)
    if until is None:
        train_methods(out, methods, run_one, None, log)
    else:
        run_looks(out, methods, until, replicas, run_one, log)
    from nondet_jax.report.methods import write_methods_report

    write_methods_report(out, command=command, log=log)
    return out


def train_methods(out: Path, methods: list[Method], run_one, replicas: int | None, log) -> None:
    """Every method's study (at ``replicas`` per method: a look), its identity recorded in ``methods.json``."""
    for m in methods:
        log(f"method {m.name}" + (f" ({', '.join(f'{k}={v}' for k, v in m.settings.items())}"
                                  f"{', ' if m.settings and m.parts else ''}{', '.join(m.parts)})"
                                  if m.settings or m.parts else " (the study's own settings)")
            + ("" if replicas is None else f", {replicas} replicas"))
        folder = RunPaths(out).method(m.name)
        try:
            run_one(m, folder, replicas)
        except UsageError as e:  # an arm's fix, said for one study, as a study of methods takes it
            fixed = method_fix(str(e), folder)
            if fixed == str(e):
                raise
            raise UsageError(fixed) from None
        record = json.loads(RunPaths(out).methods_json.read_text())
        record["methods"][m.name]["identity_sha256"] = _identity(out, m.name)
        atomic_write_json(RunPaths(out).methods_json, record, root=out)


def method_fix(text: str, folder: str | Path | None = None) -> str:
    """An arm's fix said for one study (``rerun with --recompute ARM``) as a study of methods takes it, whose
    command refuses ``--recompute``: ``--resume`` the method's ``folder`` (default: the ``methods/NAME`` folder the
    message names) with ``--recompute ARM``, then the command again. ``text`` unchanged where it names neither."""
    if folder is None:
        found = re.search(r"(\S*/methods/[^/\s]+)/", text)
        if found is None:
            return text
        folder = found.group(1)
    return re.sub(r"rerun (?:the sweep |its study )?with --recompute (\S+)",
                  lambda m: f"rerun with --resume {folder} --recompute {m.group(1)}, then this command again,", text)


def check_design(out: Path, until, names: list[str], baseline: str | None = None) -> int | None:
    """Where a sequential study resumes: the replicas of its last look (``methods.json``'s ``until``) where it
    stopped there, else of the look after it (the one an interrupted study was training), the first look's for a
    new one, None without ``until``. A folder of a fixed-size study of methods, or of a sequential one run with
    another design, other methods (``names``) or another ``baseline``, is refused before anything is written."""
    path = RunPaths(out).methods_json
    if not path.exists():
        grown = RunPaths(out).method(names[0]).parent if names else None
        if until is not None and grown is not None and grown.is_dir() and any(grown.iterdir()):
            raise UsageError(f"{out} holds the folders of methods ({grown}) but no methods.json, which records a "
                             "sequential study's design and looks; restore it, or choose another --out")
        return None if until is None else until.first
    from nondet_jax.analysis.methods import read_record

    record = read_record(out)
    state = record.get("until")
    if until is None and state is not None:
        raise UsageError(f"{out} is a sequential study of methods (--until {state['design']['spec']} --max-replicas "
                         f"{state['design']['max_replicas']}); rerun it with those, or choose another --out")
    if until is None:
        return None
    if state is None:
        if not any(next(RunPaths(out).method(n).joinpath("arms").glob("*.json"), None) for n in names):
            return until.first  # nothing finished yet: an earlier version wrote methods.json before the first look
        raise UsageError(f"{out} holds a study of methods with a fixed number of replicas, which a sequential study "
                         "(--until) cannot grow; choose another --out")
    from nondet_jax.analysis.sequential import design_record

    design = design_record(until)
    old = state.get("design") or {}
    if old.get("rule") == "decided" == design["rule"] and old.get("boundary") != design.get("boundary"):
        def words(b):
            return (f"Wang & Tsiatis' boundary of shape {b.get('shape')}, giving up below {100 * b['futility']:g}% "
                    f"({'counted' if b.get('futility_counted') else 'not counted'} in its calibration)"
                    if isinstance(b, dict) else "Pocock's constant level")
        raise UsageError(f"{out} is a sequential study whose looks were read at {words(old.get('boundary'))}, not this "
                         f"version's {words(design.get('boundary'))}; finish it with the version that started it (a "
                         "changed design would not keep its error rate), or choose another --out")
    if baseline is not None and state["looks"] and record["baseline"] != baseline:
        raise UsageError(f"{out} is a sequential study whose looks compared every method with the baseline "
                         f"{record['baseline']}; rerun it with --baseline {record['baseline']} (a baseline chosen after "
                         "the looks would not keep the design's error rate), or choose another --out")
    if old != design:
        raise UsageError(f"{out} is a sequential study run with --until {old.get('spec')} --max-replicas "
                         f"{old.get('max_replicas')} from {old.get('first')} replicas; rerun it with those (a changed "
                         "design would not keep its error rate), or choose another --out")
    taken = [k["replicas"] for k in state["looks"]]  # the record's form is checked by read_record
    for n in taken:
        if n not in until.looks():
            raise UsageError(f"{path} records a look at {n!r} replicas, which its design never takes; restore it, or "
                             "choose another --out")
    compared = {name for c in (state["looks"][0]["comparisons"] if state["looks"] else ())
                for name in (c["method_a"], c["method_b"])}
    if compared and compared != set(names):  # another family: every look's level and answers would change
        raise UsageError(f"{out} is a sequential study of the methods {', '.join(sorted(compared))}, whose looks "
                         f"compared those; rerun it with the same --method flags (adding or dropping one changes every "
                         "look's family and level), or choose another --out")
    if not state["looks"]:
        return until.first
    last = max(state["looks"], key=lambda k: k["replicas"])
    # the look after the last one recorded, where an interrupted study was training (its folders may have grown to it)
    return last["replicas"] if last["stop"] else min(last["replicas"] + until.round, until.max_replicas)


def run_looks(out: Path, methods: list[Method], until, replicas: int, run_one, log) -> dict:
    """A sequential study (:mod:`nondet_jax.analysis.sequential`): train the methods to ``replicas`` per method,
    assess every comparison with the baseline, and add :attr:`~nondet_jax.until.Until.round` replicas per
    method until each is answered or ``until.max_replicas`` are trained. A method whose comparisons are all
    answered trains no more (its answer stands: the levels are calibrated for a design in which it stops); the
    baseline trains while any other does. Each look is recorded in ``methods.json`` (``until``) as it ends,
    so a rerun of the same command resumes at the last look (whose arms it finds finished). Returns the
    last look."""
    from nondet_jax.analysis import sequential
    from nondet_jax.analysis.methods import compare_methods, read_record

    paths = RunPaths(out)
    baseline = read_record(out)["baseline"]
    while True:
        state = read_record(out).get("until") or {
            "design": sequential.design_record(until), "looks": []}
        earlier = sequential.answered([k for k in state["looks"] if k["replicas"] < replicas])
        last = [c for k in state["looks"][-1:] for c in k["comparisons"]]  # every comparison, named at each look
        done = {c["method_b"] for c in last} - {c["method_b"] for c in last if sequential.key(c) not in earlier}
        train_methods(out, [m for m in methods if m.name == baseline or m.name not in done], run_one, replicas, log)
        # an answered method trains no more, but its folder must hold what its answer read: a folder or arm deleted
        # since is trained again to the replicas it was answered at (the same keys: the same scores), so the
        # family and every level stay the design's
        for m in methods:
            if m.name in done and m.name != baseline:
                at = max(c["replicas"] for c in earlier.values() if c["method_b"] == m.name)
                if not _finished(paths.method(m.name), at):
                    train_methods(out, [m], run_one, at, log)
        compared = compare_methods(out)
        if replicas == until.first and until.rule == "decided" and (until.value or 0) >= 1 and \
                any("accuracy" in str(r["a"].get("metric")) for r in compared):
            log(f"note: --until {until.spec} on accuracy, a fraction: every difference lies within ±1, so a "
                f"comparison not decided is 'within ±{number(until.value)}' as soon as its interval fits inside ±1; D is in "
                "the score's units (0.02 is two points)")
        look = sequential.assess(until, compared, earlier, replicas)
        record = json.loads(paths.methods_json.read_text())
        state["looks"] = [k for k in state["looks"] if k["replicas"] < look["replicas"]] + [look]
        record["until"] = state
        atomic_write_json(paths.methods_json, record, root=out)
        for line in sequential.look_lines(look):
            log(line)
        if look["stop"]:
            log(f"sequential study: stopped at {look['replicas']} of at most {until.max_replicas} replicas per method: "
                f"{look['why']}")
            for m in methods:  # every arm is stored whole and no look follows: the blocks it grew from go
                guarded("rmtree", out, RunPaths(paths.method(m.name)).parts())
            return look
        replicas = min(replicas + until.round, until.max_replicas)


def _finished(folder: Path, replicas: int) -> bool:
    """Whether a method's folder holds every arm of its study finished at ``replicas`` (a cheap look at its arm
    records; the study itself checks every file when it runs)."""
    paths = RunPaths(folder)
    try:
        arms = json.loads(paths.config.read_text())["study"]["arms"]
        return all(json.loads(paths.arm_file("arms", a).read_text())["replicas"] == replicas for a in arms)
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _identity(root: Path, name: str) -> str | None:
    try:
        return json.loads(RunPaths(RunPaths(root).method(name)).model.read_text()).get("identity_sha256")
    except (OSError, ValueError):
        return None
