"""The public API's first two levels (the third is :mod:`nondet_jax.analysis.metrics` and :mod:`nondet_jax.analysis.stats`).

* :func:`run_study`: a whole study on your own model, data, optimiser, loss and augmentation,
  through the same study core, run folder, resume and report as ``python -m nondet_jax sweep``.
* :func:`replicate`: your own single-replica ``init(keys)`` and ``step(state, batch, keys)``;
  nondet_jax hands each replica its per-source keys by the key rule of :mod:`nondet_jax.sources`
  and adds the replica axis.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import re
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from nondet_jax import config as cfg
from nondet_jax.analysis.replicated import Replicated
from nondet_jax.data import ARRAY_NAMES, DATASETS, Dataset, check_dataset, data_notes, from_arrays
from nondet_jax.errors import UsageError
from nondet_jax.models.parts import Parts, label_of
from nondet_jax.replicas.rule import resolve_strategy
from nondet_jax.report.frames import COLUMNS as FRAME_COLUMNS
from nondet_jax.report.frames import FRAMES
from nondet_jax.report.summary import arm_rows
from nondet_jax.sources import StepKeys, arm_keys, check_own_sources, own_keys, parse_arm, switches
from nondet_jax.store.paths import RunPaths
from nondet_jax.store.run import read_arm_record
from nondet_jax.study import runner
from nondet_jax.study.memory import check_program_fits, release_compiled
from nondet_jax.train import carry_change
from nondet_jax.until import check_arms
from nondet_jax.until import parse as parse_until

DEFAULT_ARMS = ("control", "init", "all")


class StudyResult:
    """What :func:`run_study` made, read back from its run folder.

    Attributes:
      out: the run folder.
      summary: the study's summary (also ``summary.json``).
      report: path of ``report.md``.
      logits: ``logits[arm]``, (R, n_test, classes) test logits in replica order (loaded on access).
      table: one row (a dict) per arm, the columns of ``arms.csv`` (:meth:`to_frame` as a pandas DataFrame).
        The unit ends the column name: ``_pct`` (accuracy-like, in %), ``_nats`` (cross-entropy); a name
        without one is a ratio, correlation, similarity or p-value.
      rows: the final scores, one row (a dict) per arm, replica and score: ``arm, replica, metric, value, unit,
        diverged_at_step`` (``replicas.csv``; ``metric`` as ``compare --metric`` names it, ``value`` in ``unit``).
    """

    def __init__(self, out: Path, summary: dict):

        self.out = Path(out)
        self._paths = RunPaths(out)
        self.summary = summary
        self.report = self._paths.report
        self.table = arm_rows(summary)
        self.rows = self._long("replicas")
        self.logits = _LazyArrays(lambda arm: np.load(self._paths.arm_file("logits", arm), allow_pickle=False),
                                  list(summary["arms"]))

    def _record(self, arm: str) -> dict:
        """The arm's record, checked to be unedited (:func:`~nondet_jax.store.run.read_arm_record`)."""
        return read_arm_record(self.out, arm)

    def __repr__(self) -> str:
        return f"StudyResult(out={str(self.out)!r}, arms={list(self.summary['arms'])})"

    def load_replica(self, arm: str, replica: int, model=None):
        """Replica ``replica`` of ``arm`` as trained: its Flax variables ``{"params": ..., "batch_stats": ...}``
        (for ``model.apply(variables, x, train=False)`` of a Linen module), or, given the NNX class or
        factory the study trained (``model=``), that module with the trained state in it (in eval mode).
        Read from ``weights/<arm>.npz``."""
        if arm not in self.summary["arms"] or not self._paths.arm_file("weights", arm).exists():  # name checked first
            raise UsageError(f"arm '{arm}' has no stored weights in {self.out} (arms: "
                             f"{', '.join(self.summary['arms'])}); pick one of those")
        path = self._paths.arm_file("weights", arm)
        count = len(self._record(arm)["rows"])
        if isinstance(replica, bool) or not isinstance(replica, (int, np.integer)) or not 0 <= replica < count:
            raise UsageError(f"arm '{arm}' has replicas 0 .. {count - 1}; got replica={replica!r}")
        from nondet_jax.models.pretrained import load_collection

        variables = {c: load_collection(path, c, int(replica)) for c in ("params", "batch_stats")}
        if model is None:
            return variables
        from nondet_jax.models.parts import nnx_module

        return nnx_module(model, self._classes(), variables)

    def _classes(self) -> int:
        return int(np.load(self._paths.arm_file("logits", next(iter(self.summary["arms"]))), mmap_mode="r").shape[-1])

    def to_frame(self, kind: str = "arms"):
        """A table of the study as a pandas DataFrame: ``"arms"`` (:attr:`table`, one row per arm, indexed by
        arm) or a long table, one number a row, with the columns docs/api.md lists: ``"replicas"`` (final
        scores), ``"curves"`` (scores per replica and epoch), ``"best"`` (best test score and its epoch,
        ``study.eval_every``), ``"decomposition"`` (variance shares), ``"pairs"`` (pairwise metrics per pair
        of replicas), ``"instruments"`` (the instruments' values per step). The same tables are the run
        folder's ``<kind>.csv``. Needs pandas (``pip install "nondet_jax[frame]"``)."""
        kinds = ("arms", *FRAMES)
        if kind not in kinds:
            hint = "; 'methods' is for a study of methods (run_study(methods=...))" if kind == "methods" else ""
            raise UsageError(f"to_frame({kind!r}): choose one of {', '.join(map(repr, kinds))}{hint}")
        pd = _pandas()
        if kind == "arms":
            return pd.DataFrame(self.table).set_index("arm")
        return pd.DataFrame(self._long(kind), columns=list(FRAME_COLUMNS[kind]))

    def _long(self, kind: str) -> list[dict]:
        return FRAMES[kind](self.out, self.summary, {a: self._record(a) for a in self.summary["arms"]})


class MethodsResult(StudyResult):
    """What :func:`run_study` with ``methods=`` made: a study of methods, read back from its folder.

    Attributes:
      out, report: the folder and its ``report.md`` (across methods).
      methods: ``methods[name]``, each method's own :class:`StudyResult` (its folder ``methods/<name>``).
      baseline: the method the others are compared with.
      comparisons: each method against the baseline on each arm whose replicas vary, paired by seed
        (:func:`nondet_jax.analysis.methods.compare_methods`: difference, ``difference_ci``, ``p``,
        ``p_holm`` over the methods, ``probability_of_improvement``: the share of seeds where it wins).
      table, rows: :class:`StudyResult`'s, with a ``method`` column first, over every method.
      summary: the report's summary; ``summary["until"]`` a sequential study's design and looks (``None`` else).
      logits, load_replica: the baseline's (``result.methods[name].logits`` for another method's).
    """

    def __init__(self, out: Path):  # noqa: D107 - StudyResult's, read from a study of methods

        from nondet_jax.report.methods import methods_summary, methods_table

        self.out = Path(out)
        self._paths = RunPaths(out)
        self.summary, _, self.comparisons = methods_summary(self.out)
        self.report = self._paths.report
        self.baseline = self.summary["baseline"]
        self.methods = {n: StudyResult(self._paths.method(n), s) for n, s in _finished(self.out).items()}
        self.table = methods_table({n: r.summary for n, r in self.methods.items()}, self.comparisons)
        self.rows = [{"method": n, **row} for n, r in self.methods.items() for row in r.rows]
        if self.baseline not in self.methods:
            raise UsageError(f"the baseline '{self.baseline}' of {self.out} has not finished; rerun the study")
        base = self.methods[self.baseline]
        self.logits, self._record, self._classes = base.logits, base._record, base._classes

    def __repr__(self) -> str:
        return f"MethodsResult(out={str(self.out)!r}, methods={list(self.methods)}, baseline={self.baseline!r})"

    def load_replica(self, arm: str, replica: int, model=None, method: str | None = None):
        """:meth:`StudyResult.load_replica` of ``method`` (default: the baseline)."""
        name = self.baseline if method is None else method
        if name not in self.methods:
            raise UsageError(f"method '{name}' is not in this study (methods: {', '.join(self.methods)}); pick one")
        return self.methods[name].load_replica(arm, replica, model)

    def to_frame(self, what: str = "methods"):
        """``"methods"`` (also ``"arms"``): :attr:`table`, one row per method and arm with the paired comparison
        with the baseline, indexed by method and arm; ``"replicas"``: :attr:`rows`, the long ``replicas`` table
        of every method with ``method`` first (one number a row). Needs pandas."""
        if what not in ("methods", "arms", "replicas"):
            raise UsageError(f"to_frame('{what}'): choose 'methods' (one row per method and arm) or 'replicas'")
        pd = _pandas()
        if what == "replicas":
            return pd.DataFrame(self.rows)
        return pd.DataFrame(self.table).set_index(["method", "arm"])


def _finished(out: Path) -> dict:
    from nondet_jax.analysis.methods import finished

    return finished(out)


def _pandas():
    try:
        import pandas as pd
    except ImportError:
        raise UsageError('to_frame needs pandas, which nondet_jax does not require; pip install '
                         '"nondet_jax[frame]" (or pandas)') from None
    return pd


class _LazyArrays(dict):
    def __init__(self, load: Callable[[str], np.ndarray], keys: list[str]):
        super().__init__()
        self._load, self._keys = load, keys

    def __missing__(self, key):
        if key not in self._keys:
            raise KeyError(f"no arm '{key}' in this study; arms: {', '.join(self._keys)}")
        self[key] = value = self._load(key)
        return value

    def keys(self):
        return list(self._keys)

    def __iter__(self):
        return iter(self._keys)

    def __len__(self):
        return len(self._keys)

    def __contains__(self, key):
        return key in self._keys

    def items(self):
        return [(k, self[k]) for k in self._keys]


def _dataset(data, task: str | None = None) -> tuple[Any, str | None]:
    """(Dataset or None, data.name): arrays, a Dataset, a catalogue name or a .npz path."""
    if data is None:
        return None, None
    if isinstance(data, (str, Path)):
        return None, str(data)
    if isinstance(data, Dataset):  # checked as from_arrays checks arrays; named by the arrays as given
        name = data.name if data.name in _catalogue_data() else _arrays_name(data[1:5])
        return check_dataset(data), name
    if isinstance(data, dict):
        missing = [k for k in ARRAY_NAMES if k not in data]
        if missing:
            raise UsageError(f"data is missing {', '.join(missing)}; pass x_train, y_train, x_test, y_test")
        data = tuple(data[k] for k in ARRAY_NAMES)
    if not isinstance(data, (tuple, list)) or len(data) != 4:
        raise UsageError("data must be (x_train, y_train, x_test, y_test), a dict of those four arrays, a "
                         "nondet_jax.data.Dataset, a catalogue data set name or a PATH.npz")
    name = _arrays_name(data)
    return from_arrays(name, *data, task=task), name


def _catalogue_data() -> tuple[str, ...]:

    return DATASETS


def _arrays_name(arrays) -> str:
    """``arrays-<sha256 prefix>``: the data's identity in config.json, so that a resume with other
    arrays is refused like any other change of config."""
    h = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(str((a.shape, a.dtype.str)).encode())
        h.update(a.tobytes())
    return cfg.ARRAYS_PREFIX + h.hexdigest()[:12]


def study_config(*, model=None, data_name: str | None = None, optimizer=None, epochs: int | None = None,
                 batch_size: int | None = None, arms: Sequence[str] | str = DEFAULT_ARMS, replicas: int = 4,
                 seed: int = 0, strategy: str = "auto", settings: dict | None = None,
                 base: cfg.Config | None = None) -> cfg.Config:
    """The :class:`~nondet_jax.config.Config` a :func:`run_study` call stands for."""
    flat: dict[str, Any] = {"study.arms": arms, "study.replicas": replicas, "study.seed": seed,
                            "study.strategy": strategy}
    if isinstance(model, str):
        flat["model.name"] = model
    elif model is not None:
        flat["model.name"] = label_of(model)
    if data_name is not None:
        flat["data.name"] = data_name
    if optimizer is not None:
        flat["optim.name"] = cfg.CUSTOM
    if epochs is not None:
        flat["train.epochs"] = epochs
    if batch_size is not None:
        flat["train.batch_size"] = batch_size
    given = {"study.arms": ("arms", arms, DEFAULT_ARMS), "study.replicas": ("replicas", replicas, 4),
             "study.seed": ("seed", seed, 0), "study.strategy": ("strategy", strategy, "auto"),
             "train.epochs": ("epochs", epochs, None), "train.batch_size": ("batch_size", batch_size, None)}
    for key, (word, value, default) in given.items():  # a keyword given and a setting must not disagree
        if key in (settings or {}) and value is not None and value != default \
                and not cfg.same_setting(key, value, settings[key]):
            raise UsageError(f"{word}={value!r} and settings['{key}']={settings[key]!r} disagree; give one")
    flat.update(settings or {})
    config = cfg.from_flat(flat, base)
    # the optimizer passed is the one that trains, whatever optim.* says; else the config's reads only its own keys
    cfg.refuse_optim_settings({str(k): "settings=" for k in settings or {}},
                              cfg.OptimConfig(name=cfg.CUSTOM) if optimizer is not None else config.optim)
    return config


def run_study(model=None, data=None, optimizer=None, loss: Callable | None = None, augment: Callable | None = None,
              *, epochs: int | None = None, batch_size: int | None = None, arms: Sequence[str] | str = DEFAULT_ARMS,
              replicas: int = 4, seed: int = 0, out: str | Path | None = None, strategy: str = "auto",
              features: str | None = None, task: str | None = None, settings: dict | None = None,
              init_params: dict | str | Path | None = None,
              config: cfg.Config | None = None, progress: bool = False, log: Callable = print,
              methods: dict[str, dict] | None = None, baseline: str | None = None,
              batch_methods: bool = False, until: str | None = None, max_replicas: int | None = None) -> StudyResult:
    """Train ``replicas`` replicas per arm of your own parts and write a run folder and report.

    Args:
      model: a Flax Linen module (``__call__(x, train)``; BatchNorm through ``batch_stats`` and
        dropout through the ``dropout`` rng, both optional), a Linen class or factory called with
        ``num_classes=``, a Flax NNX module class or factory (called with ``num_classes=`` and
        ``rngs=``), ``"package.module:Attr"``, or a catalogue name (``"resnet8"``). Default: the config's.
      data: ``(x_train, y_train, x_test, y_test)`` (images NHWC or (N, features), integer labels),
        a dict of those names, a :class:`nondet_jax.data.Dataset`, ``"PATH.npz"`` or a catalogue
        name (``"digits"``). Default: the config's (digits).
      optimizer: any ``optax.GradientTransformation``. Default: the config's (SGD, cosine schedule).
      loss: per-example ``(logits, labels) -> loss``. Default: softmax cross-entropy, integer labels.
      augment: ``(key, x_batch) -> x_batch``, drawn from the ``augmentation`` source. Default: the
        config's crop/flip for images when ``data.augment`` is on, else none.
      epochs, batch_size, arms, replicas, seed, strategy: the study (``arms`` a list or ``"a,b"``).
      out: run folder (default ``runs/<data>-<model>-<hash>``, the hash over the config and every
        part's fingerprint by content, so another learning rate, model body, loss or data gets its own
        folder). An existing folder of the same study is resumed: finished arms are reused; a folder
        whose data, model, optimiser, loss or augmentation differ by content is refused, naming the part.
      features: submodule whose output CKA uses when the model has no ``return_features`` (default:
        the logits).
      init_params: fine-tuning: a params tree (nested dict of arrays, a subset of the model's: a
        pre-trained body without its head) or a ``.npz`` of one (:func:`load_params`) that every replica
        starts from; the ``init`` source then draws only the parameters it does not hold, and ``bitflip``
        moves one weight of the result. Identified by content, like the other parts.
      task: ``"classification"`` or ``"regression"`` for arrays; default: recognised from the targets
        (floating-point targets are a regression: the model's outputs are shaped like the targets, the
        default loss is the squared error, and the report gives test MSE and MAE, the distance and
        correlation of replicas' predictions, in place of accuracy, disagreement and LMC).
      settings: further config keys, dotted (``{"optim.lr": 0.1, "metrics.lmc_pairs": 0}``); one that a keyword
        above also gives must agree with it.
      config: a base :class:`~nondet_jax.config.Config` the above apply on top of.
      progress, log: a progress bar; where messages go (``log=lambda *a: None`` for silence).
      methods: several methods in one study, paired by seed: ``{name: overrides}``, each value a dict of
        run_study's own parts (``model``, ``optimizer``, ``loss``, ``augment``, ``init_params``) and config
        keys (dotted) replacing the study's for that method (``{}``: the study's own). Every method runs
        the same arms, replicas and seed, so replica r of every method gets the same keys for every
        source. One folder: ``methods/<name>/`` per method (an ordinary run folder, reused and resumed per
        method: adding a method to a finished study trains only the new one), ``methods.json`` and a
        report across methods. Returns a :class:`MethodsResult`.
      baseline: the method the others are compared with (default: the first).
      batch_methods: train the methods that differ only in ``optim.lr``, ``optim.momentum`` or
        ``optim.weight_decay`` (no part of their own) together, the hyper-parameters per replica in one
        program per arm (:mod:`nondet_jax.study.batched`); equal to each trained alone up to float rounding.
      until, max_replicas: a sequential study of methods (:mod:`nondet_jax.analysis.sequential`): ``replicas``
        per method first, then 4 more at each look up to ``max_replicas`` (default 4x ``replicas``, at most 1024), until
        every method's difference from the baseline is decided (``"decided"``: its interval at the look's level excludes
        0; ``"decided=D"``: or lies inside ±D) or every interval is at most X wide (``"width=X"``), in the
        score's units. The looks are in ``methods.json``; a rerun resumes at the last one.

    Returns:
      A :class:`StudyResult`: ``result.logits[arm]`` (R, n_test, classes), ``result.table`` (one row
      per arm), ``result.rows`` (one per replica), ``result.report`` (path of ``report.md``).

    Example::

        result = nj.run_study(model=MyCNN, data=(x_tr, y_tr, x_te, y_te), optimizer=optax.adam(1e-3),
                              epochs=3, batch_size=64, arms="control,init,all", replicas=3, out="runs/mine")
    """
    _check_parts(optimizer, loss, augment)
    dataset, data_name = _dataset(data, task)
    if dataset is not None:  # a .npz path is loaded, and noted, by the study
        for line in data_notes(dataset, "task='classification'" if task is None else None):
            log(line)
    if methods is not None or baseline is not None:
        with api_words():
            return _run_methods(methods, baseline, dict(model=model, optimizer=optimizer, loss=loss, augment=augment,
                                                        init_params=init_params), dataset, data_name,
                                dict(epochs=epochs, batch_size=batch_size, arms=arms, replicas=replicas, seed=seed,
                                     strategy=strategy), settings, config, out, features, progress, log, batch_methods,
                                (until, max_replicas))
    if until is not None or max_replicas is not None:
        raise UsageError("until= and max_replicas= run a sequential study of methods; pass methods={name: overrides, "
                         "...} too (at least two), or drop them")
    with api_words():
        config = study_config(model=model, data_name=data_name, optimizer=optimizer, epochs=epochs,
                              batch_size=batch_size, arms=arms, replicas=replicas, seed=seed, strategy=strategy,
                              settings=settings, base=config)
    parts = Parts(model=None if model is None or isinstance(model, str) else model, optimizer=optimizer,
                  loss=loss, augment=augment, features=features, init_params=init_params)
    try:
        with api_words():
            summary = runner.run(config, out, progress=progress, log=log, parts=parts, data=dataset,
                                 command=f"nondet_jax.run_study(model={config.model.name}, data={config.data.name}, ...)")
    finally:  # a notebook running study after study must not pile up compiled programs
        release_compiled()
    return StudyResult(Path(summary.pop("out")), summary)


@contextlib.contextmanager
def api_words():
    """The run folder's refusals in the words of the Python API: the layers below speak the command line's
    (``--out``), a ``run_study`` caller passed ``out=``."""
    try:
        yield
    except UsageError as e:
        text = re.sub(r"--set ([\w.]+)=([^\s;,)]+)", lambda m: f"settings={{'{m.group(1)}': {_py(m.group(2))}}}", str(e))
        text = re.sub(r"--(until|baseline) ([\w.=+-]+)", r"\1='\2'", text).replace("--batch-methods", "batch_methods=True")
        # words, not numbers or paths: quoted (it read "arms= control,init,all")
        text = re.sub(r"--(arms|strategy) ([a-z][\w.+@-]*(?:,[\w.+@-]+)*)", r"\1='\2'", text)
        text = re.sub(r"--(out|arms|replicas|epochs|seed|strategy|batch-size|max-replicas|until)( (?=[\d/.~]))?",
                      lambda m: m.group(1).replace("-", "_") + "=", text)
        text = re.sub(r"--([a-z][\w-]*) ([^\s;,)]+)", lambda m: _flag_words(m.group(0), m.group(1), m.group(2)), text)
        raise UsageError(text.replace("rerun the sweep", "rerun the study")) from None


def _py(value: str) -> str:
    """A command line's value as Python writes it: True, 0.05, 'sgd'."""
    if value in ("true", "false"):
        return value.title()
    try:
        float(value)
        return value
    except ValueError:
        return repr(value)


def _flag_words(text: str, flag: str, value: str) -> str:
    """``--augment off`` as a ``run_study`` caller writes it (``model='mlp'``, ``data='digits'``, else
    ``settings={'data.augment': 'off'}``); ``text`` unchanged when the flag sets no config key."""
    key = cfg.FLAG_KEYS.get(flag.replace("-", "_"))
    if key is None:
        return text
    word = {"model.name": "model", "data.name": "data"}.get(key)
    return f"{word}={_py(value)}" if word else f"settings={{'{key}': {_py(value)}}}"


def _run_methods(methods, baseline, parts: dict, dataset, data_name, study: dict, settings, config, out, features,
                 progress, log, batch_methods: bool = False, sequential=(None, None)) -> "MethodsResult":
    """:func:`run_study` with ``methods=``: each method checked (:func:`nondet_jax.study.methods.plan`) before
    anything is trained, then trained into its own folder of the study."""
    from nondet_jax.study import methods as M

    if methods is None:
        raise UsageError("baseline= names one of methods=; pass methods={name: overrides, ...} too")
    base = study_config(model=parts["model"], data_name=data_name, optimizer=parts["optimizer"], settings=settings,
                        base=config, **study)
    planned, baseline = M.plan(base, methods, baseline, api=True)
    until = None
    if sequential[0] is None and sequential[1] is not None:
        raise UsageError(f"max_replicas={sequential[1]} is for a sequential study; add until='decided' (or "
                         "'decided=D', 'width=X'), or drop max_replicas")
    if sequential[0] is not None:
        until = parse_until(sequential[0], sequential[1], base.study.replicas,
                      where="until=")
        check_arms(base.study.arms)
    for m in planned:
        own = {**parts, **m.parts}
        _check_parts(own["optimizer"], own["loss"], own["augment"])

    def run_one(m, folder, replicas=None):
        own = {**parts, **m.parts}
        model = own["model"]
        method_config = config_of(m)
        if replicas is not None:
            method_config = cfg.from_flat({"study.replicas": replicas}, method_config)
        try:
            return runner.run(method_config, folder, progress=progress, log=log, data=dataset, grow=replicas is not None,
                              parts=Parts(model=None if model is None or isinstance(model, str) else model,
                                          optimizer=own["optimizer"], loss=own["loss"], augment=own["augment"],
                                          features=features, init_params=own["init_params"]),
                              command=f"nondet_jax.run_study(..., methods={list(methods)}) method {m.name}")
        finally:
            release_compiled()

    def config_of(m):
        own = {**parts, **m.parts}
        return study_config(model=own["model"], data_name=data_name, optimizer=own["optimizer"],
                            settings={**(settings or {}), **m.settings}, base=config, **study)

    for m in planned:  # every method's own configuration checked before the first trains
        try:
            if {**parts, **m.parts}["optimizer"] is not None:
                cfg.refuse_optim_settings({str(k): "the method" for k in m.settings}, cfg.OptimConfig(name=cfg.CUSTOM))
            config_of(m)
        except UsageError as e:
            raise UsageError(f"method '{m.name}': {e}") from None

    def batch(folder):
        from nondet_jax.study.batched import train_batched

        model = parts["model"]
        try:
            train_batched({m.name: config_of(m) for m in planned}, {m.name: m.parts for m in planned}, folder,
                          Parts(model=None if model is None or isinstance(model, str) else model,
                                optimizer=parts["optimizer"], loss=parts["loss"], augment=parts["augment"],
                                features=features, init_params=parts["init_params"]), dataset, log)
        finally:
            release_compiled()

    folder = M.run_methods(base, planned, baseline, out, run_one=run_one, log=log,
                           batch=batch if batch_methods else None, until=until,
                           command=f"nondet_jax.run_study(..., methods={list(methods)})")
    return MethodsResult(folder)


def _check_parts(optimizer, loss, augment) -> None:
    """run_study's parts of the right kind before anything is traced: ``optimizer='adam'`` (a string)
    failed deep in optax with "'str' object has no attribute 'init'"."""
    if optimizer is not None and not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
        hint = (f"; for the config's own optimiser leave optimizer out and pass settings={{'optim.name': "
                f"'{optimizer}'}}" if optimizer in cfg.OPTIMIZERS else "") if isinstance(optimizer, str) else ""
        raise UsageError(f"optimizer={optimizer!r} is a {type(optimizer).__name__}, not an optax.GradientTransformation; "
                         f"pass one, e.g. optimizer=optax.adam(1e-3){hint}")
    for name, fn, signature in (("loss", loss, "(outputs, labels) -> per-example losses"),
                                ("augment", augment, "(key, x_batch) -> x_batch")):
        if fn is not None and not callable(fn):
            raise UsageError(f"{name}={fn!r} is a {type(fn).__name__}, not a function; pass a function {signature}")


def _traced(signature: str, fn: Callable, *args):
    """``fn(*args)`` while ``replicate`` traces it. A function that cannot take these arguments, JAX's own tracing
    errors (a Python ``if``/``float()``/``np.asarray`` on a traced value) and a returned value that is not a JAX
    type become one line naming the function, the original chained beneath it; any other error is the user's
    code's own, raised as it is."""
    try:
        inspect.signature(fn).bind(*args)
    except TypeError as e:
        raise UsageError(f"{signature} cannot be called as {getattr(fn, '__name__', 'it')}"
                         f"{inspect.signature(fn)} ({e}); give it that signature") from e
    except ValueError:  # a builtin without a signature
        pass
    try:
        return fn(*args)
    except TypeError as e:
        tracing = isinstance(e, jax.errors.JAXTypeError) or "is not a valid JAX type" in str(e)
        if not tracing:
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise UsageError(f"{signature} failed while JAX traced it ({type(e).__name__}: {first}); keep it jittable: "
                         "jnp/lax on traced values (jnp.where or lax.cond, not a Python if, float() or np.asarray), "
                         "JAX arrays (or pytrees of them) out") from e


def _check_carry(before, after) -> None:
    """Refuse a ``replicate`` step whose state differs from the one it got in structure, or a leaf in
    shape or dtype: ``lax.scan`` said so deep in JAX, in its own words."""
    change = carry_change(before, after)
    if change is None:
        return
    where, was, now = change
    if not where:
        raise UsageError(f"step(state, batch, keys) returns a state shaped {now} for a state shaped {was} (from init); "
                         "return the state with the same keys and nesting (lax.scan carries it from step to step)")
    raise UsageError(f"step(state, batch, keys) turns state{where} from {was} into {now}; return every leaf with the "
                     "shape and dtype init gave it (cast with .astype, keep shapes fixed: lax.scan carries the state "
                     "from step to step)")


def decompose(run: "str | Path | StudyResult") -> dict:
    """The variance decomposition of a study's finished arms (a run folder or a :class:`StudyResult`):
    per score, each one-source arm's share of the ``all`` arm's variance with its 95% interval, the sum
    of the shares and the non-additivity 1 − sum with theirs (:mod:`nondet_jax.analysis.decomposition`).
    UsageError naming what is missing without a finished ``all`` arm or one-source arm."""
    from nondet_jax.analysis.decomposition import decompose as from_records
    from nondet_jax.arms import decomposition_gap
    from nondet_jax.report.summary import load_records, unused_sources

    if not isinstance(run, (str, Path, StudyResult)):
        raise UsageError(f"decompose takes a run folder or a StudyResult, got a {type(run).__name__}; for replicate's "
                         "result call its own .decompose()")
    folder = run.out if isinstance(run, StudyResult) else Path(run)
    if not RunPaths(folder).config.is_file():
        raise UsageError(f"{folder} is not a nondet_jax run folder (no config.json); pass a study's out= folder")
    with api_words():
        config, records = load_records(folder)
    gap = decomposition_gap(list(records))
    if gap:  # an empty result ended a user's nj.decompose(folder)["accuracy"] in a KeyError
        raise UsageError(f"{folder} lacks {gap} among its finished arms ({', '.join(records)}), so there is nothing to "
                         "decompose; train a study with e.g. arms='init,data_order,all', or finish its arms (run the "
                         "same study again: finished arms are kept)")
    return from_records(records, inactive=unused_sources(folder, config))


def _check_callables(init, step, collect, score) -> None:
    """:func:`replicate`'s functions are functions (what they take and return is checked as they are traced)."""
    for name, fn, signature in (("init", init, "keys -> state"), ("step", step, "(state, batch, keys) -> state")):
        if not callable(fn):
            raise UsageError(f"{name} must be a function {signature}, got {type(fn).__name__}")
    if collect is not None and not callable(collect):
        raise UsageError(f"collect must be a function (state, keys) -> pytree, got {type(collect).__name__}")
    if score is not None and not callable(score):
        raise UsageError(f"score={score!r} is a {type(score).__name__}, not a function; pass a function of one replica's "
                         "final state returning a number or a dict of numbers, e.g. score=lambda s: {'loss': s['loss']}")


def _replicate_counts(batches, steps, replicas, seed) -> int:
    """:func:`replicate`'s seed, replicas, and steps against its batches, checked; returns the steps."""
    lo, hi = cfg.SEED_RANGE
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not lo <= seed <= hi:
        raise UsageError(f"seed must be an integer in {lo} .. {hi} (jax.random.key keeps only 32 bits), got {seed!r}; "
                         "pass a seed in that range")
    if isinstance(replicas, bool) or not isinstance(replicas, (int, np.integer)) or replicas < 1:
        raise UsageError(f"replicas must be an integer >= 1, got {replicas!r}")
    if batches is None and steps is None:
        raise UsageError("replicate needs batches (leading axis = steps) or steps=")
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 1):
        raise UsageError(f"steps must be an integer >= 1, got {steps!r}")
    if batches is None:
        return steps
    for path, leaf in jax.tree_util.tree_leaves_with_path(batches):
        if not _real(leaf if hasattr(leaf, "dtype") else np.asarray(leaf)):
            raise UsageError(f"batches{jax.tree_util.keystr(path)} holds {np.asarray(leaf).dtype} values; batches must "
                             "be numbers (arrays of them, one slice per step)")
    lengths = {np.shape(leaf)[0] if np.ndim(leaf) else None for leaf in jax.tree.leaves(batches)}
    if None in lengths or len(lengths) != 1:
        raise UsageError(f"every leaf of batches needs the same leading step axis (one slice per step), got "
                         f"{sorted(lengths, key=str)}; stack each step's batch along axis 0")
    if steps is not None and steps != next(iter(lengths)):
        raise UsageError(f"steps={steps} but batches holds {next(iter(lengths))} steps (its leading axis); leave "
                         f"steps out, or pass batches of {steps} steps")
    return next(iter(lengths))


def replicate(init: Callable, step: Callable, batches=None, *, steps: int | None = None,
              arms: Sequence[str] | str = ("control", "init"), replicas: int = 4, seed: int = 0,
              strategy: str = "auto", collect: Callable | None = None, sources: Sequence[str] = (),
              score: Callable | None = None) -> dict[str, Any]:
    """Run your own single-replica functions for R replicas per arm.

    You write one replica's ``init(keys) -> state`` and ``step(state, batch, keys) -> state``;
    ``keys`` is a :class:`nondet_jax.sources.StepKeys`: ``keys.init``, ``keys.data_order``,
    ``keys.augmentation``, ``keys.dropout``, ``keys.bitflip``, ``keys.batch_order``, each the
    replica's own key where the arm varies that source and one key shared by every replica
    otherwise, and ``keys.varies("bitflip")``, a boolean array saying whether the arm varies a
    source. ``step`` gets the keys folded with the step index (the per-step rule of
    :mod:`nondet_jax.sources`), so ``jax.random.permutation(keys.data_order, n)`` is a fresh draw per
    step. ``nondet_jax.sources.bitflip(params, keys)`` nudges one weight by one ulp in arms that
    vary ``bitflip`` only. Both functions must be jittable.

    An arm none of whose sources your functions read (``dropout`` when neither reads
    ``keys.dropout``) would return R copies of control: it is refused, naming the source.

    Args:
      init, step: the single-replica functions.
      batches: a pytree whose leaves have a leading step axis T, the same for every replica
        (``step`` gets one slice); None passes ``batch=None`` and needs ``steps``.
      steps: number of steps: T with ``batches`` (may be left out), required without.
      arms, replicas, seed: as in :func:`run_study` (seed in 0 .. 2**32-1, arms named once each).
      strategy: ``vmap`` (one program over the replica axis), ``sequential`` (one replica's program,
        compiled once, in a loop: replica r's result does not depend on R), or ``auto``.
      collect: ``collect(state, keys) -> pytree``, called after every step (``keys.step`` is its
        index): what to keep of the run, e.g. ``lambda s, k: {"loss": s.loss}``; jittable.
      sources: names of randomness sources of your own (e.g. ``("env", "policy")`` for an RL agent's
        environment noise and action sampling): ``keys.env`` is a key stream under the same rule as the
        built-in ones (its stream index :func:`nondet_jax.sources.source_id`, stable across versions),
        arms may name them (``"env"``, ``"policy+init"``), and ``all`` varies them too.
      score: ``score(state) -> number`` or ``-> {name: number}``, of one replica's final state (jittable),
        e.g. ``lambda s: {"return": s.total_reward}``: what the tables, report, comparison and
        decomposition of the result measure (nested names joined by ``/``: ``{"a": {"b": x}}`` is ``a/b``);
        a replica whose score is NaN or infinite is left out of that score's numbers and named.

    Returns:
      A :class:`nondet_jax.analysis.replicated.Replicated`: ``{arm: state}``, every leaf with a leading
      replica axis R (with ``collect``, ``{arm: (state, history)}``, the history's leaves shaped
      (R, steps, ...)), as a dict; with ``score``, also ``.scores[arm][name]`` (R,), ``.table``,
      ``.to_frame("arms" | "replicas" | "curves" | "decomposition")``, ``.report()``,
      ``.compare(arm_a, arm_b)`` and ``.decompose()``, by the statistics of a study's report.
    """
    _check_callables(init, step, collect, score)
    arm_list = [a.strip() for a in arms.split(",") if a.strip()] if isinstance(arms, str) else list(arms)
    if not arm_list:
        raise UsageError("replicate needs at least one arm, e.g. arms=('control', 'init')")
    duplicates = sorted({a for a in arm_list if arm_list.count(a) > 1})
    if duplicates:
        raise UsageError(f"arm '{duplicates[0]}' is named twice in arms; name each arm once")
    own = check_own_sources(sources)
    parsed = [parse_arm(a, own) for a in arm_list]
    for a in parsed:
        if "hardware" in a.varied or a.cycles:
            raise UsageError(f"arm '{a.name}' needs the study runner (a child process or a schedule); replicate takes "
                             "arms of seeded sources: control, all, init, data_order, ... or their + combinations")
    steps = _replicate_counts(batches, steps, replicas, seed)
    batches = jax.device_put(batches)  # once: every arm's (and replica's) call takes them from the device
    chosen, _ = resolve_strategy(strategy, replicas)
    if chosen not in ("vmap", "sequential"):
        raise UsageError(f"replicate runs strategy vmap or sequential, not '{chosen}'")
    reads: set[str] = set()  # the sources init and step read, recorded while they are traced

    def one(keys, on, own_k, own_on, batches):  # batches an argument: closed over, XLA would embed them
        state = _traced("init(keys) -> state", init, StepKeys(keys, on, None, reads, own_k, own_on))

        def body(state, xs):
            t, batch = xs
            step_keys = StepKeys(keys, on, t, reads, own_k, own_on)
            new = _traced("step(state, batch, keys) -> state", step, state, batch, step_keys)
            _check_carry(state, new)
            state = new
            return state, (None if collect is None else _traced("collect(state, keys) -> pytree", collect, state,
                                                                 step_keys))

        xs = (jnp.arange(steps), batches if batches is not None else jnp.zeros(steps))
        if batches is None:
            state, history = jax.lax.scan(lambda s, x: body(s, (x[0], None)), state, xs)
        else:
            state, history = jax.lax.scan(body, state, xs)
        return state if collect is None else (state, history)

    def arm_inputs(varied: frozenset[str]):
        return (arm_keys(seed, varied, replicas), switches(varied, replicas), own_keys(seed, own, varied, replicas),
                {n: jnp.full((replicas,), n in varied) for n in own})

    batched = jax.vmap(one, in_axes=(0, 0, 0, 0, None))  # every replica reads the same batches
    shapes = _traced("init(keys) -> state, step(state, batch, keys) -> state and collect(state, keys) -> pytree "
                     "(pytrees of JAX arrays)", jax.eval_shape, batched, *arm_inputs(frozenset()), batches)
    if score is not None:  # checked before anything trains
        said = "score(state) -> number or {name: number}"
        _check_scores(_traced(said, jax.eval_shape, jax.vmap(lambda s: _traced(said, score, s)),
                              shapes if collect is None else shapes[0]))
    for a in parsed:
        unread = sorted(a.varied - reads)
        if a.varied and len(unread) == len(a.varied):
            raise UsageError(f"arm '{a.name}' varies {', '.join(unread)}, which neither init nor step reads (keys."
                             f"{unread[0]}), so its replicas would equal control's; use that key or drop the arm")
    inputs = arm_inputs(frozenset())
    if chosen == "vmap":
        program = jax.jit(batched).lower(*inputs, batches).compile()
        check_program_fits(program.memory_analysis(), f"{replicas} replicas", "use fewer replicas, a smaller state or strategy='sequential'")

        def run(*inputs):
            return program(*inputs, batches)
    else:
        single = jax.jit(one).lower(*jax.tree.map(lambda k: k[0], inputs), batches).compile()
        check_program_fits(single.memory_analysis(), f"{replicas} replicas one at a time", "use fewer replicas or a smaller state",
                           copies=replicas)

        def run(*inputs):
            states = [single(*jax.tree.map(lambda k: k[r], inputs), batches) for r in range(replicas)]
            return jax.tree.map(lambda *xs: jnp.stack(xs), *states)
    states = {a.name: run(*arm_inputs(a.varied)) for a in parsed}
    return _replicated(states, {a.name: sorted(a.varied) for a in parsed}, score, collect is not None, own)


def _named_leaves(tree, default: str) -> dict:
    """A score's or history's leaves by name: ``default`` for a bare leaf, nested keys joined by ``/``."""
    if not isinstance(tree, dict):
        tree = {default: tree}
    return {jax.tree_util.keystr(path, simple=True, separator="/"): v
            for path, v in jax.tree_util.tree_leaves_with_path(tree)}


def _real(v) -> bool:
    """A real number's dtype, bfloat16 and bool included (JAX's lattice; numpy's leaves out bfloat16): not complex,
    not a PRNG key."""
    return (jnp.issubdtype(v.dtype, jnp.number) or jnp.issubdtype(v.dtype, jnp.bool_)) \
        and not jnp.issubdtype(v.dtype, jnp.complexfloating)


def _check_scores(shapes) -> None:
    """``score``'s output for R replicas (abstract): one real number per name and replica."""
    for name, v in _named_leaves(shapes, "score").items():
        if not _real(v) or len(v.shape) != 1:
            what = f"a {v.dtype} value" if not _real(v) else f"shape {tuple(v.shape[1:])} per replica"
            raise UsageError(f"score returns {name!r} as {what}; return one real number per name (e.g. lambda s: "
                             "{'loss': s.loss.mean()})")


def _replicated(states: dict, varied: dict, score: Callable | None, collected: bool, own) -> Any:
    """replicate's result: the states, with their ``score``s and the history's numbers per step as tables (a
    history leaf that is not a number per step, a PRNG key say, stays in the states only)."""
    scores, curves = {}, {}
    for arm, out in states.items():
        final, history = out if collected else (out, None)
        if score is not None:
            scores[arm] = {k: np.asarray(v, np.float64) for k, v in _named_leaves(jax.vmap(score)(final), "score").items()}
        if history is not None:
            curves[arm] = {k: np.asarray(v, np.float64) for k, v in _named_leaves(history, "value").items()
                           if v.ndim == 2 and _real(v)}
    return Replicated(states, scores, varied, {a: c for a, c in curves.items() if c}, tuple(own))
