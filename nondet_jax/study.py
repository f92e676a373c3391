"""The study core: arms -> train -> metrics -> run folder -> report, in one process or several.

Both ways in reach it: the CLI (:mod:`nondet_jax.sweep` parses, then calls :func:`run` or
:func:`run_distributed`) and the Python API (:func:`nondet_jax.run_study`). Arms are parsed once,
into :class:`nondet_jax.sources.Arm` values; the run folder's files are written through
:class:`nondet_jax.store.RunStore`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import time
from pathlib import Path

import numpy as np

from nondet_jax import config as cfg
from nondet_jax.config import Config
from nondet_jax.errors import UsageError
from nondet_jax.parts import Parts, fingerprint_diff, import_object, label_of, shape_fingerprint
from nondet_jax.sources import Arm, parse_arm

CHILD_ENV = "NONDET_JAX_CHILD"  # set by the sweep in the processes it starts for an arm


def default_out(config: Config) -> Path:
    """``runs/<dataset>-<model>-<hash of the config without its arms>``: same settings, same folder."""
    d = cfg.to_dict(config)
    d["study"].pop("arms")
    digest = hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:8]
    name = lambda s: re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(s).stem if s.endswith(".npz") else s)  # noqa: E731
    return Path("runs") / f"{name(config.data.name)}-{name(config.model.name)}-{digest}"


def arm_record(arm: Arm, result, strategy_reason: str, arm_metrics: dict, acc: np.ndarray, nll: np.ndarray) -> dict:
    """The JSON record of a finished arm: per-replica rows (test accuracy ``acc`` and cross-entropy
    ``nll``), metrics, and how it was trained."""
    from nondet_jax.health import bitwise_identical

    rows = [{"arm": arm.name, "replica": r, "test_accuracy": float(acc[r]), "test_loss": float(nll[r]),
             "train_loss": float(result.train_loss[r, -1]), "train_accuracy": float(result.train_accuracy[r, -1]),
             "diverged_at_step": int(result.diverged_at[r]), "strategy": result.strategy} for r in range(len(acc))]
    return {
        "arm": arm.name,
        "varied": sorted(arm.varied),
        "replicas": len(acc),
        "replicas_used": int((result.diverged_at < 0).sum()),  # the metrics leave diverged replicas out
        "strategy": result.strategy,
        "strategy_reason": strategy_reason,
        "seconds": round(result.seconds, 3),
        "replicas_bitwise_identical": bitwise_identical(result.logits, result.diverged_at),
        "metrics": arm_metrics,
        "rows": rows,
    }


def check_arms_active(config: Config, arms: list[Arm], dataset: str, image_size: int, dropout_known: bool = True,
                      augment_given: bool = False) -> None:
    """Refuse an arm that varies only sources switched off in this config (its replicas would
    equal the control arm's): e.g. ``dropout`` with model.dropout = 0. A user's model may use
    dropout or not (``dropout_known`` False): not checked."""
    from nondet_jax.train import augmentation_settings

    inactive = set()
    if not augment_given and not augmentation_settings(config, dataset, image_size)[0]:
        inactive.add(("augmentation", "--augment on"))
    if dropout_known and config.model.dropout == 0:
        inactive.add(("dropout", "--dropout 0.1 (say)"))
    for arm in arms:
        off = [(src, fix) for src, fix in sorted(inactive) if src in arm.varied]
        if arm.name not in ("control", "all") and arm.varied and len(off) == len(arm.varied):
            raise UsageError(f"arm '{arm.name}' varies only {', '.join(s for s, _ in off)}, which is off in this config, "
                             f"so its replicas would equal control's; turn it on with {off[0][1]} or drop the arm")


class Progress:
    """Progress of the arms in replica-epochs: a rich bar per arm (with ETA) on a terminal, else a log
    line every ``every`` seconds (batch jobs, Slurm logs), or nothing at all (``log=None``).

    Until an arm's first epoch is done the bar says what it waits for: XLA compiling (seconds and
    programs so far, from JAX's compile events as they come) and programs loaded from the persistent
    compilation cache, which lets the next identical run skip the compile. Without a bar, the
    compile is summarised in one line once the first epoch is done."""

    COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
    CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"

    def __init__(self, enabled: bool, log=None, every: float = 30.0):
        self.enabled, self.log, self.every = enabled, log, every
        self._bar = None
        self._listening = False
        self._waiting = None  # the task still before its first epoch
        self._tasks = 0
        self._compiled, self._seconds, self._cached = 0, 0.0, 0

    def __enter__(self):
        if self.enabled or self.log is not None:
            import jax

            jax.monitoring.register_event_duration_secs_listener(self._on_duration)
            jax.monitoring.register_event_listener(self._on_event)
            self._listening = True
        if self.enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as Bar, TextColumn, TimeElapsedColumn, \
                TimeRemainingColumn

            self._bar = Bar(TextColumn("{task.description:<14}"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("replica-epochs"), TimeElapsedColumn(), TimeRemainingColumn(),
                            TextColumn("[dim]{task.fields[note]}"), transient=False)
            self._bar.__enter__()
        return self

    def __exit__(self, *exc):
        if self._listening:
            import jax

            jax.monitoring.unregister_event_duration_listener(self._on_duration)
            jax.monitoring.unregister_event_listener(self._on_event)
            self._listening = False
        if self._bar is not None:
            self._bar.__exit__(*exc)

    def _on_duration(self, event: str, duration_secs: float, **kwargs):
        if event == self.COMPILE_EVENT and self._waiting is not None:
            self._compiled, self._seconds = self._compiled + 1, self._seconds + duration_secs
            self._note()

    def _on_event(self, event: str, **kwargs):
        if event == self.CACHE_HIT_EVENT and self._waiting is not None:
            self._cached += 1
            self._note()

    def _counts(self) -> str:
        """'N XLA programs compiled, M loaded from the compilation cache' so far. JAX's compile event times
        each program's compile-or-load, so programs found in the cache are counted there too."""
        fresh = max(self._compiled - self._cached, 0)
        parts = [f"{fresh} compiled"] if fresh else []
        parts += [f"{self._cached} loaded from the compilation cache"] if self._cached else []
        first = fresh or self._cached
        return f"{first} XLA program{'s' * (first != 1)} " + ", ".join(parts).removeprefix(f"{first} ")

    def compile_note(self) -> str:
        """What the arm waited for before its first epoch, so far ('' when nothing was compiled or loaded)."""
        return f"compiling: {self._seconds:.0f} s, {self._counts()}" if self._compiled else ""

    def _note(self):
        if self._bar is not None:
            self._bar.update(self._waiting, note=self.compile_note())

    @staticmethod
    def first_note() -> str:
        import jax

        cache = jax.config.jax_compilation_cache_dir if jax.config.jax_enable_compilation_cache else None
        return "compiling" + (" (once: the compilation cache keeps it for later runs)" if cache else "")

    def arm(self, name: str, total: int):
        """The callback that advances arm ``name`` by n replica-epochs (of ``total``)."""
        if self._bar is None and self.log is None:
            return lambda n: None
        first = self._tasks == 0  # later arms mostly reuse the programs the first one compiled
        self._tasks += 1
        self._compiled, self._seconds, self._cached = 0, 0.0, 0
        task = self._waiting = (self._bar.add_task(name, total=total, note=self.first_note() if first else "")
                                if self._bar is not None else name)
        done, t0 = [0], time.perf_counter()
        last = [t0]

        def advance(n: int):
            if self._waiting == task:
                self._waiting = None
                if self._bar is not None:
                    self._bar.update(task, note="")
                elif self._seconds >= 1:  # worth a line: the wait the user just had
                    self.log(f"arm {name}: {self._counts()} in {self._seconds:.0f} s before epoch 1")
            done[0] += n
            if self._bar is not None:
                self._bar.advance(task, n)
            elif time.perf_counter() - last[0] >= self.every and done[0] < total:
                last[0] = time.perf_counter()
                self.log(f"arm {name}: {done[0]}/{total} replica-epochs, {last[0] - t0:.0f} s")

        return advance


def parse_arms(config: Config) -> list[Arm]:
    """The study's arms, each parsed once (UsageError for unknown names)."""
    return [parse_arm(a) for a in config.study.arms]


def resolve_parts(config: Config, parts: Parts = Parts()) -> Parts:
    """``parts`` with the model a ``PACKAGE.MODULE:ATTR`` model name imports (the CLI's ``--model``);
    UsageError when the config names a part that was not passed."""
    if parts.model is None and ":" in config.model.name:
        parts = parts._replace(model=import_object(config.model.name))
    if config.optim.name == cfg.CUSTOM and parts.optimizer is None:
        raise UsageError("optim.name 'custom' means an optax optimiser passed to nondet_jax.run_study(optimizer=...); "
                         "from the command line use --optimizer sgd or adamw")
    return parts


def prepare(config: Config, parts: Parts = Parts(), data=None):
    """Validate against the data and build the training functions: (data, fns). Writes nothing.

    ``parts`` are the user's own (None for what the config names); ``data`` a
    :class:`nondet_jax.data.Dataset` given in memory (None: load what ``config.data`` names)."""
    from nondet_jax.data import load_data
    from nondet_jax.train import DataSpec, augmentation_settings, make_train

    cfg.validate(config)
    parts = resolve_parts(config, parts)
    if data is None:
        if config.data.name.startswith(cfg.ARRAYS_PREFIX):
            raise UsageError(f"data '{config.data.name}' are arrays passed to nondet_jax.run_study; pass them again "
                             "(data=...) to continue this study")
        data = load_data(config.data)
    image_size = data.x_train.shape[1]
    if parts.augment is None and data.x_train.ndim != 4 and augmentation_settings(config, data.name, image_size)[0]:
        raise UsageError(f"data.augment=on crops and flips images, but {data.name} holds (N, features) arrays; "
                         "use --augment off, or pass your own augment=(key, x) -> x")
    n_train = len(data.x_train)
    if config.train.batch_size > n_train:
        raise UsageError(f"batch size {config.train.batch_size} is larger than the {n_train} training examples of "
                         f"{data.name}; use --batch-size {n_train} or less")
    check_arms_active(config, parse_arms(config), data.name, data.x_train.shape[1],
                      dropout_known=parts.model is None, augment_given=parts.augment is not None)
    if config.metrics.tta:
        from nondet_jax.train import augmentation_settings
        from nondet_jax.tta import view_grid

        for name in config.metrics.tta:
            view_grid(name, augmentation_settings(config, data.name, data.x_train.shape[1])[2])
    spec = DataSpec(n_train, tuple(data.x_train.shape[1:]), data.num_classes, data.name)
    fns = make_train(config, spec, parts)
    from nondet_jax.memory import check_fits

    check_fits(config, spec, len(data.x_test), fns=fns)  # before anything is allocated or written
    return data, fns


def model_record(config: Config, fns) -> dict:
    """What ``model.json`` records: the parts that were used (what was imported) and the
    fingerprint of the model's parameter shapes."""
    import jax

    from nondet_jax.sources import arm_keys, perturbations, replica_slice

    p = fns.parts
    keys = replica_slice(arm_keys(0, frozenset(), 1), 0)
    x = jax.ShapeDtypeStruct((1, *fns.spec.image_shape), jax.numpy.float32)
    params = jax.eval_shape(fns.init, keys, perturbations(frozenset()), x).params
    return {"model": config.model.name if p.model is None or ":" in config.model.name else label_of(p.model),
            "optimizer": config.optim.name if p.optimizer is None else label_of(type(p.optimizer)) + " (user's)",
            "loss": "softmax_cross_entropy_with_integer_labels" if p.loss is None else label_of(p.loss),
            "augment": "config" if p.augment is None else label_of(p.augment),
            "features": fns.model.features, **shape_fingerprint(params)}


def check_model(paths, record: dict) -> None:
    """Refuse to continue a study whose stored ``model.json`` names another model or parameter shapes."""
    if not paths.model.exists():
        return
    try:
        old = json.loads(paths.model.read_text())
    except (OSError, json.JSONDecodeError):
        raise UsageError(f"{paths.model} is unreadable or corrupt; choose another --out") from None
    if old.get("fingerprint") != record["fingerprint"] or old.get("model") != record["model"]:
        diff = fingerprint_diff(old, record)
        if old.get("model") != record["model"]:
            diff.insert(0, f"model {old.get('model')} -> {record['model']}")
        raise UsageError(f"--out {paths.root} holds results of another model ({'; '.join(diff)}); choose another "
                         "--out or use the model the study started with")


FAULT_ENV = "NONDET_JAX_INJECT_FAULT"  # "arm:replica:epoch": NaN weights before that epoch (fault tests)


def injected_fault(arm: Arm) -> tuple[int, int] | None:
    """(replica, epoch) of a fault to inject into ``arm``, from ``$NONDET_JAX_INJECT_FAULT``."""
    spec = os.environ.get(FAULT_ENV, "")
    parts = spec.split(":")
    if len(parts) == 3 and parts[0] == arm.name:
        return int(parts[1]), int(parts[2])
    return None


def arm_setup(config: Config, fns, arm: Arm):
    """(config, fns) an arm trains under: ``arm@snapshotK`` swaps in the snapshot schedule."""
    from nondet_jax.train import make_train

    if arm.cycles:  # the same arm under the snapshot schedule, logits kept at each cycle end
        config = cfg.arm_config(config, arm)
        fns = make_train(config, fns.spec, fns.parts)
    return config, fns


def fit_arm(config: Config, data, fns, store, arm: Arm, progress, log=print, block: range | None = None):
    """Train replicas ``block`` (default: all) of an arm, continuing from their latest checkpoint and
    checkpointing every ``train.checkpoint_every`` epochs. Returns (ArmResult, strategy reason)."""
    import jax

    from nondet_jax.checkpoint import ArmCheckpoints, CorruptCheckpoint, key_fingerprint
    from nondet_jax.mitigations import snapshot_epochs
    from nondet_jax.replicas import Progress, make_strategy, resolve_strategy, train_replicas
    from nondet_jax.sources import arm_keys, perturbations

    study = config.study
    config, fns = arm_setup(config, fns, arm)
    block = block or range(study.replicas)
    strategy_name, reason = resolve_strategy(study.strategy, len(block))
    strategy = make_strategy(fns, strategy_name)
    keys = jax.tree.map(lambda k: k[block.start:block.stop], arm_keys(study.seed, arm.varied, study.replicas))
    perturb = perturbations(arm.varied)
    folder = store.paths.checkpoints(arm.name)
    if len(block) != study.replicas:
        folder = folder / f"replicas{block.start}-{block.stop - 1}"
    ckpt = ArmCheckpoints(folder, config.train.checkpoint_every)
    meta = {"arm": arm.name, "keys_sha256": key_fingerprint(keys), "strategy": strategy_name}
    try:
        restored = ckpt.restore_latest(jax.eval_shape(strategy.init, keys, perturb, data.x_train[:1]),
                                       {"keys_sha256": meta["keys_sha256"], "strategy": strategy_name})
    except CorruptCheckpoint as e:
        ckpt.close()
        raise UsageError(f"{e}; rerun with --recompute {arm.name} to train arm '{arm.name}' again from scratch") from None
    start = None
    if restored is not None:
        start = Progress(*restored)
        log(f"arm {arm.name}: resuming from its checkpoint after epoch {start.epoch}")
        progress(start.epoch * len(block))
    result = train_replicas(strategy, keys, perturb, data, config.train.epochs, progress, start=start,
                            on_epoch=lambda p: ckpt.save(p, meta), fault=injected_fault(arm),
                            eval_epochs=snapshot_epochs(config.train.epochs, arm.cycles) if arm.cycles else ())
    ckpt.close()
    return result, reason


def train_arm(config: Config, data, fns, store, arm: Arm, progress, log=print) -> dict:
    """Train one arm in this process (continuing from its latest checkpoint), then :func:`finish_arm`."""
    result, reason = fit_arm(config, data, fns, store, arm, progress, log)
    return finish_arm(config, data, fns, store, arm, result, reason, log)


def finish_arm(config: Config, data, fns, store, arm: Arm, result, reason: str, log=print) -> dict:
    """Compute an arm's metrics on the replicas that did not diverge, store everything, delete its
    checkpoints; returns its record."""
    from nondet_jax.analysis import arm_metrics
    from nondet_jax.health import divergence_records, healthy_subset
    from nondet_jax.metrics import accuracy, cross_entropy
    from nondet_jax.sources import arm_keys, perturbations
    from nondet_jax.store import RunPaths, flatten_tree, npy_bytes, npz_bytes

    study = config.study
    config, fns = arm_setup(config, fns, arm)
    labels = np.asarray(data.y_test)
    used = healthy_subset(result)
    diverged = divergence_records(result)
    for d in diverged:
        why = "its test outputs are not finite" if d["cause"] == "outputs" else "its training loss stopped being finite"
        log(f"arm {arm.name}: replica {d['replica']} diverged at step {d['step']} ({why}; last finite loss "
            f"{d['last_finite_loss']:.4g}); it is frozen there and left out of the metrics")
    if len(used.logits):
        metrics, pair_arrays = arm_metrics(used, data, fns, config.metrics)
    else:
        metrics, pair_arrays = {}, {}
    record = arm_record(arm, result, reason, metrics, accuracy(result.logits, labels),
                        cross_entropy(result.logits, labels))
    record["diverged"] = diverged
    trace = None
    if study.dynamics_every and arm.name != "control" and study.replicas >= 2:
        from nondet_jax.dynamics import divergence_trace, fit_growth_rate

        trace = divergence_trace(fns, arm_keys(study.seed, arm.varied, 2), perturbations(arm.varied), data,
                                 config.train.epochs, study.dynamics_every)
        record["dynamics"] = {"every": study.dynamics_every,
                              **fit_growth_rate(trace["step"], trace["weight_distance"])}
    extra = {}
    if "instruments" in result.steps:
        values = instrument_values(config, fns, result)
        extra[RunPaths.rel("instruments", arm.name)] = npz_bytes(values)
        extra[RunPaths.rel("instruments", arm.name, ".csv")] = tidy_csv(arm.name, values)
    if arm.cycles:
        extra[RunPaths.rel("snapshots", arm.name)] = npy_bytes(result.snapshots.astype(np.float32))
    elif config.metrics.tta:
        extra[RunPaths.rel("tta", arm.name)] = npz_bytes(tta_outputs(config, data, fns, result.state))
    store.save_arm(arm.name, record, result.logits.astype(np.float32), result.features.astype(np.float32),
                   {"train_loss": result.train_loss, "train_accuracy": result.train_accuracy,
                    "weight_distance": result.weight_distance, "step_loss": result.steps["loss"],
                    "diverged_at": result.diverged_at},
                   {**{f"params/{k}": v for k, v in flatten_tree(result.state.params).items()},
                    **{f"batch_stats/{k}": v for k, v in flatten_tree(result.state.batch_stats).items()}},
                   pair_arrays, trace, extra)
    store.remove_checkpoints(arm.name)
    return record


def instrument_values(config: Config, fns, result) -> dict[str, np.ndarray]:
    """The instruments' values at the tracked steps: ``step`` (T,), each quantity (R, T, ...), and
    the training ``loss``, ``accuracy`` and learning rate ``lr`` at those steps (for the dashboard)."""
    from nondet_jax.train import make_schedule

    steps = np.flatnonzero(np.asarray(result.steps["tracked"])[0])
    lr = make_schedule(config.optim, config.train.epochs, fns.steps_per_epoch)
    return {"step": steps, **{k: np.asarray(v)[:, steps] for k, v in result.steps["instruments"].items()},
            "loss": np.asarray(result.steps["loss"])[:, steps], "accuracy": np.asarray(result.steps["accuracy"])[:, steps],
            "lr": np.asarray([float(lr(int(t))) for t in steps])}


def tidy_csv(arm: str, values: dict) -> bytes:
    """The tidy table (step, arm, replica, quantity, layer, value) of the scalar instruments."""
    import csv
    import io

    from nondet_jax.instruments.dashboard import tidy_rows

    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=["step", "arm", "replica", "quantity", "layer", "value"], lineterminator="\n")
    w.writeheader()
    w.writerows(tidy_rows(arm, values))
    return buf.getvalue().encode()


def tta_outputs(config: Config, data, fns, state) -> dict[str, np.ndarray]:
    """Each replica's test logits under every view set of ``metrics.tta``: name -> (R, N, C)."""
    import jax

    from nondet_jax.train import augmentation_settings
    from nondet_jax.tta import tta_logits, view_grid

    padding = augmentation_settings(config, data.name, data.x_train.shape[1])[2]
    x = jax.numpy.asarray(data.x_test)
    out = {}
    for name in config.metrics.tta:
        views = view_grid(name, padding)
        fn = jax.jit(lambda st: tta_logits(fns.evaluate, st, x, views, padding))
        r_count = len(np.asarray(state.health.diverged_at))
        out[name] = np.stack([np.asarray(fn(jax.tree.map(lambda a: a[r], state))) for r in range(r_count)])
    return out


def run_in_child(out: Path, arm: Arm, flags) -> None:
    """Train ``arm`` in a fresh process whose XLA_FLAGS carry ``flags`` (read at backend start);
    it writes into the same run folder, under the lock this process holds."""
    import subprocess

    from nondet_jax.determinism import with_flags

    env = {**os.environ, "XLA_FLAGS": with_flags(flags), CHILD_ENV: "1"}
    proc = subprocess.run([sys.executable, "-m", "nondet_jax.sweep", "--out", str(out), "--child-arm", arm.name],
                          env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"the child process training arm '{arm.name}' failed with exit status {proc.returncode}; "
                           "its output is above; finished arms are kept")


def child_main(out: str, arm_name: str, progress: bool) -> int:
    """Entry of a child process: train one arm of the run folder's config under this process's flags."""
    from nondet_jax.determinism import environment
    from nondet_jax.store import RunPaths, RunStore

    if os.environ.get(CHILD_ENV) != "1":
        raise UsageError("--child-arm is internal: the sweep starts such processes itself")
    arm = parse_arm(arm_name)
    config = cfg.from_dict(json.loads(RunPaths(out).config.read_text()))
    data, fns = prepare(config)
    with RunStore(out, config, locked_by_parent=True) as store:
        env = environment()
        env["arm"] = arm.name
        store.write_json(RunPaths.rel("environments", arm.name), env)
        with Progress(progress, None if progress else print) as bar:
            train_arm(config, data, fns, store, arm, bar.arm(arm.name, config.study.replicas * config.train.epochs))
    return 0


def write_run_files(store, config: Config, data, fns, command: str | None, model: dict,
                    processes: int = 1) -> tuple[str, str]:
    """What every study writes before training, single- or multi-process alike: ``environment.json``
    (with the strategy and why), ``model.json`` (:func:`model_record`), the test labels, the
    command. Returns (strategy, reason)."""
    from nondet_jax.determinism import environment
    from nondet_jax.replicas import resolve_strategy
    from nondet_jax.store import atomic_write_bytes, npy_bytes

    study = config.study
    strategy, reason = resolve_strategy(study.strategy, study.replicas)
    env = environment()
    env["strategy"] = {"requested": study.strategy, "chosen": strategy, "reason": reason}
    env["scan_unroll"] = fns.unroll
    env["processes"] = processes
    store.write_json(store.paths.environment.name, env)
    store.write_json(store.paths.model.name, model)
    if command:
        atomic_write_bytes(store.paths.command, (command + "\n").encode())
    atomic_write_bytes(store.paths.test_labels, npy_bytes(np.asarray(data.y_test)))
    return strategy, reason


def finish_study(store, log) -> dict:
    """After the arms: ``replicas.csv`` over every finished arm of the folder, then the report."""
    from nondet_jax.report import format_table, replica_rows, write_report

    store.write_rows(replica_rows([row for a in store.arms if store.arm_done(a) for row in store.load_arm(a)["rows"]]))
    summary = write_report(store.root)
    log(format_table(summary))
    log(f"report: {store.paths.report}")
    return summary


def log_accuracy(log, arm: Arm, record: dict) -> None:
    if record["metrics"]:
        acc = record["metrics"]["accuracy"]
        log(f"arm {arm.name}: test accuracy {acc['mean']:.4f} +- {acc['std']:.4f}, {record['seconds']:.1f} s")


def run(config: Config, out: str | Path | None = None, progress: bool | None = None, log=print,
        command: str | None = None, recompute: tuple[str, ...] = (), parts: Parts = Parts(), data=None,
        after_arm=None) -> dict:
    """Run a study: train every arm not yet finished in ``out``, then write the report.

    Arms that vary ``hardware`` run in a child process with XLA's determinism flags off; the
    others run here, under this process's flags. Returns the summary (also in ``summary.json``).
    Arms named in ``recompute`` are deleted (results and checkpoints) and trained again.
    ``parts`` and ``data`` are the user's own (see :func:`prepare`). ``after_arm(out, arm_name)``, when
    given, runs once each arm is stored (or found finished), e.g. to export it to TensorBoard.
    Raises UsageError on bad input before anything is written.
    """
    import jax

    from nondet_jax.determinism import DETERMINISM_OFF, NONDETERMINISTIC_BACKENDS, check_flags
    from nondet_jax.store import RunPaths, RunStore

    in_memory = parts != Parts() or data is not None
    data, fns = prepare(config, parts, data)
    study = config.study
    arms = parse_arms(config)
    unknown = [a for a in recompute if a not in study.arms]
    if unknown:
        raise UsageError(f"--recompute names arm '{unknown[0]}', which is not in this study's arms "
                         f"({', '.join(study.arms)}); name one of those")
    hardware_arms = [a.name for a in arms if "hardware" in a.varied]
    if hardware_arms and in_memory:
        raise UsageError(f"arm '{hardware_arms[0]}' trains in a child process that rebuilds the study from the run "
                         "folder, so it cannot use parts passed in memory; run it with the CLI (--model "
                         "PACKAGE.MODULE:ATTR --dataset PATH.npz) on the same --out, or drop it")
    if hardware_arms:
        check_flags(DETERMINISM_OFF)
    out = Path(out) if out is not None else default_out(config)
    model = model_record(config, fns)
    check_model(RunPaths(out), model)
    if progress is None:
        progress = sys.stderr.isatty()
    backend = jax.default_backend()

    with RunStore(out, config, recompute=recompute) as store:
        strategy, _ = write_run_files(store, config, data, fns, command, model)
        log(f"nondet_jax: {len(arms)} arms x {study.replicas} replicas of {config.model.name} on {data.name} "
            f"({len(data.x_train)} train / {len(data.x_test)} test), {config.train.epochs} epochs, strategy "
            f"{strategy} on {backend} -> {out}")
        if hardware_arms and backend not in NONDETERMINISTIC_BACKENDS:
            log(f"note: {backend} reductions are deterministic, so arm(s) {', '.join(hardware_arms)} check that "
                "(replicas must come out bitwise identical even with XLA's determinism flags off); batch_order is "
                "the simulated counterpart of hardware nondeterminism here")
        for name in recompute:
            log(f"arm {name}: deleting its results and checkpoints to train it again (--recompute)")
            store.remove_arm(name)
        with Progress(progress, None if progress else log) as bar:
            for arm in arms:
                if store.arm_done(arm.name):
                    log(f"arm {arm.name}: already finished in {out}, reusing it")
                    if after_arm is not None:
                        after_arm(out, arm.name)
                    continue
                if arm.name in hardware_arms and study.hardware_processes == "replica":
                    from nondet_jax.hardware import train_arm_per_process

                    record = train_arm_per_process(config, data, fns, store, arm, DETERMINISM_OFF, log)
                elif arm.name in hardware_arms:
                    log(f"arm {arm.name}: training in a child process with XLA_FLAGS {' '.join(DETERMINISM_OFF)}")
                    run_in_child(out, arm, DETERMINISM_OFF)
                    record = store.load_arm(arm.name)
                else:
                    record = train_arm(config, data, fns, store, arm,
                                       bar.arm(arm.name, study.replicas * config.train.epochs), log)
                if not progress:
                    log_accuracy(log, arm, record)
                if after_arm is not None:
                    after_arm(out, arm.name)
        summary = finish_study(store, log)
    control = summary["arms"].get("control")
    if control and not control["replicas_bitwise_identical"] and backend == "cpu":
        log("WARNING: the control arm's replicas are not bitwise identical on CPU: the backend or the "
            "strategy is not deterministic here (see environment.json)")
    return summary


def run_distributed(config: Config, out: str | Path | None, procs, progress: bool | None = None, log=print,
                    command: str | None = None) -> dict | None:
    """:func:`run` across several processes (see :mod:`nondet_jax.multihost`): each trains its block
    of every arm's replicas; process 0 holds the folder's lock, merges, stores and reports. Returns
    the summary on process 0, None elsewhere."""
    import shutil

    import jax

    from nondet_jax import multihost as mh
    from nondet_jax.replicas import make_strategy
    from nondet_jax.sources import arm_keys, perturbations
    from nondet_jax.store import RunPaths, RunStore, atomic_write_bytes

    data, fns = prepare(config)
    study = config.study
    arms = parse_arms(config)
    if any("hardware" in a.varied for a in arms):
        raise UsageError("hardware arms train in a child process of their own, which a multi-process run cannot "
                         "start; run them in a single-process sweep on the same --out")
    if study.replicas < procs.count:
        raise UsageError(f"{study.replicas} replicas cannot be split over {procs.count} processes; use --replicas "
                         f"{procs.count} or more")
    out = Path(out) if out is not None else default_out(config)
    model = model_record(config, fns)
    check_model(RunPaths(out), model)
    log = log if procs.leader else (lambda *a, **k: None)
    store = RunStore(out, config, locked_by_parent=not procs.leader)
    error, strategy = None, None
    try:
        store.open()
        if procs.leader:
            strategy = write_run_files(store, config, data, fns, command, model, procs.count)[0]
    except UsageError as e:
        error = e
    if not mh.agree(error is None):
        store.close()
        raise error or UsageError(f"process 0 could not open the run folder {out}; see its error")
    block = mh.replica_block(study.replicas, procs.index, procs.count)
    log(f"nondet_jax: {len(arms)} arms x {study.replicas} replicas over {procs.count} processes -> {out}")
    try:
        with Progress(bool(progress) and procs.leader) as bar:
            for arm in arms:
                if store.arm_done(arm.name):
                    log(f"arm {arm.name}: already finished in {out}, reusing it")
                    continue
                result, reason = fit_arm(config, data, fns, store, arm,
                                         bar.arm(arm.name, len(block) * config.train.epochs), log, block)
                atomic_write_bytes(store.paths.parts(arm.name) / f"{procs.index}.npz", mh.part_bytes(result))
                mh.barrier(f"trained {arm.name}")
                if procs.leader:
                    _, arm_fns = arm_setup(config, fns, arm)
                    init = make_strategy(arm_fns, strategy).init(
                        arm_keys(study.seed, arm.varied, study.replicas), perturbations(arm.varied),
                        jax.numpy.asarray(data.x_train[:1]))
                    merged = mh.merge_parts([store.paths.parts(arm.name) / f"{i}.npz" for i in range(procs.count)],
                                            init.params)
                    record = finish_arm(config, data, fns, store, arm, merged, reason, log)
                    shutil.rmtree(store.paths.parts(arm.name), ignore_errors=True)
                    log_accuracy(log, arm, record)
                mh.barrier(f"stored {arm.name}")
        if not procs.leader:
            return None
        if store.paths.parts().is_dir() and not any(store.paths.parts().iterdir()):
            store.paths.parts().rmdir()
        return finish_study(store, log)
    finally:
        store.close()
