"""Before training: the config's parts resolved, the data loaded, the model checked."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import jax
import numpy as np

from nondet_jax import config as cfg
from nondet_jax.analysis.tta import view_grid
from nondet_jax.config import Config
from nondet_jax.data import load_data
from nondet_jax.errors import UsageError
from nondet_jax.models import pretrained
from nondet_jax.models.parts import (
    Parts,
    fingerprint_diff,
    import_object,
    label_of,
    shape_fingerprint,
)
from nondet_jax.replicas.choice import strategy_epoch_shape
from nondet_jax.sources import Arm, abstract_keys, parse_arm, perturbations
from nondet_jax.store.paths import RunPaths
from nondet_jax.store.run import config_changes, different_config
from nondet_jax.study.identity import (
    check_identity,
    identity_sha256,
    model_facts,
    part_identities,
    reads_argument,
    step_update,
)
from nondet_jax.study.memory import check_fits
from nondet_jax.train import DataSpec, augmentation_settings, carry_change, make_train


def default_out(config: Config, identity: str = "") -> Path:
    """``runs/<dataset>-<model>-<hash>``, the hash over the config without its arms and the study's
    ``identity`` (:func:`nondet_jax.study.identity.identity_sha256`): the same study, the same folder;
    another learning rate, model body or data file, another folder."""
    d = cfg.to_dict(config)
    d["study"].pop("arms")
    d["data"]["name"] = cfg.comparable_data_name(d["data"]["name"])
    digest = hashlib.sha256((json.dumps(d, sort_keys=True) + identity).encode()).hexdigest()[:8]
    name = lambda s: re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(s).stem if s.endswith(".npz") else s)  # noqa: E731
    return Path("runs") / f"{name(config.data.name)}-{name(config.model.name)}-{digest}"


def check_arms_active(config: Config, arms: list[Arm], fns) -> None:
    """Refuse an arm that varies only sources this study does not have (its replicas would equal
    the control arm's): augmentation switched off, ``dropout`` with model.dropout = 0, and, traced
    from the user's own parts, a model whose training pass never reads its dropout input or an
    ``augment`` that never reads its key."""
    parts, inactive = fns.parts, set()
    if parts.init_params is not None and pretrained.covers_all(parts.init_params, _variables_shape(fns)["params"]):
        inactive.add(("init", "drawing nothing: init_params holds every parameter",
                      "leave a layer (the head) out of init_params"))
    if fns.augment is None:
        inactive.add(("augmentation", "off in this config", "turn it on with --augment on" if len(fns.spec.image_shape) == 3
                      else "pass an augmentation of your own, --augment PACKAGE.MODULE:ATTR or augment=(key, x) -> x (the "
                           "built-in crops and flips need images)"))
    elif parts.augment is not None:
        xb = jax.ShapeDtypeStruct((fns.batch_size, *fns.spec.image_shape), fns.spec.x_dtype)
        if not reads_argument(fns.augment, (jax.random.key(0), xb), 0):
            inactive.add(("augmentation", "never drawn by your augment function (it ignores its key)",
                          "use the key in augment(key, x)"))
    if parts.model is not None:
        x1 = jax.ShapeDtypeStruct((1, *fns.spec.image_shape), fns.spec.x_dtype)
        if not reads_argument(fns.model.init, (jax.random.key(0), x1), 0):  # e.g. constant initialisers
            inactive.add(("init", "never drawn by your model's initialisation (it ignores the key it is given)",
                          "initialise from the key flax passes (self.param with a random initializer)"))
        if not model_facts(fns, fns.spec.x_dtype)["dropout"]:
            inactive.add(("dropout", "absent from your model (its training pass never reads a dropout key)",
                          "add dropout to the model (flax.linen.Dropout)"))
    elif config.model.dropout == 0:
        inactive.add(("dropout", "off in this config", "turn it on with --dropout 0.1 (say)"))
    if fns.batch_size == 1:  # it permutes the examples inside each minibatch
        inactive.add(("batch_order", "the identity at batch size 1 (one example has one order)",
                      "use --batch-size 2 or more"))
    for arm in arms:
        off = [(src, why, fix) for src, why, fix in sorted(inactive) if src in arm.varied]
        if arm.name not in ("control", "all") and arm.varied and len(off) == len(arm.varied):
            raise UsageError(f"arm '{arm.name}' varies only {', '.join(s for s, _, _ in off)}, which is {off[0][1]}, "
                             f"so its replicas would equal control's; {off[0][2]} or drop the arm")


def _data_shape(spec) -> str:
    """The training inputs' shape as a message shows it: ``(400, 8, 8)``."""
    return str((spec.n_train, *spec.image_shape))


def _first_line(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}".strip()


def _model_name(fns, name: str | None) -> str:
    """The model as a message names it: the config's name (``resnet8``, ``mypkg.nets:Net``), else the user's part."""
    return name or (label_of(fns.parts.model) if fns.parts is not None and fns.parts.model is not None else "the model")


def check_model_input(config: Config, spec, parts: Parts = Parts()) -> None:
    """Refuse a catalogue model other than the MLP on data that are not images (N, H, W, C): its convolutions
    failed on (N, H, W) or (N, features) arrays deep in Flax (a ScopeParamShapeError, a numpy broadcast)."""
    if parts.model is not None or cfg.imported(config.model.name) or config.model.name == "mlp" \
            or len(spec.image_shape) == 3:
        return
    name, shape = config.model.name, _data_shape(spec)
    if len(spec.image_shape) == 2:
        fix = "give the images a channel axis (x[..., None] for one channel), or use --model mlp"
    elif len(spec.image_shape) == 1:
        fix = "use --model mlp, or a model of your own for (N, features) arrays (--model PACKAGE.MODULE:ATTR)"
    else:
        fix = "use --model mlp, or bring the arrays to images (N, H, W, C)"
    raise UsageError(f"model {name} needs images (N, H, W, C); this data is {shape}: {fix}")


def _variables_shape(fns, name: str | None = None):
    """The model's variables as shapes (traced, not run); UsageError naming the model and the data's shape
    when its init fails on them (the user's model, or a catalogue one on inputs it cannot take)."""
    x1 = jax.ShapeDtypeStruct((1, *fns.spec.image_shape), fns.spec.x_dtype)
    try:
        return jax.eval_shape(lambda x: fns.model.init(jax.random.key(0), x), x1)
    except UsageError:
        raise
    except Exception as e:  # noqa: BLE001 (the model's init on this data: any error, named)
        if isinstance(e, KeyError) and e.args == ("params",):  # not a shape problem: nothing to train
            raise UsageError(f"model {_model_name(fns, name)} has no parameters (its init returns no 'params'); a "
                             "study trains parameters: give it at least one layer with weights") from None
        raise UsageError(f"model {_model_name(fns, name)}'s init fails on data of shape {_data_shape(fns.spec)} (called "
                         f"on one example, shape {x1.shape}: {_first_line(e)}); make the model take inputs of this "
                         "shape, or reshape the data (images are (N, H, W, C))") from None


def check_init_params(fns, name: str | None = None, source: str | None = None) -> None:
    """Refuse, before anything trains, ``init_params`` that are not a subset of the model's parameters
    (``source``: the ``--init-from`` they were read from)."""
    if fns.parts.init_params is not None:
        pretrained.check(fns.parts.init_params, _variables_shape(fns, name)["params"], source)


def check_augment(fns) -> None:
    """Refuse, before anything trains, a user's ``augment`` that does not return a batch of the shape it
    got: one that drops, adds or reorders axes would misalign the labels (or fail mid-epoch); traced, not run."""
    if fns.parts.augment is None:
        return
    spec, b = fns.spec, fns.batch_size
    x = jax.ShapeDtypeStruct((b, *spec.image_shape), spec.x_dtype)
    try:
        out = jax.eval_shape(fns.parts.augment, jax.eval_shape(lambda: jax.random.key(0)), x)
    except Exception as e:  # noqa: BLE001 (the user's function: any error, named)
        raise UsageError(f"augment(key, x) fails on a batch of shape {x.shape} ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''}); it must take a key and a batch of inputs") from None
    shape = getattr(out, "shape", None)
    if shape != x.shape:
        raise UsageError(f"augment(key, x) returns {f'shape {tuple(shape)}' if shape is not None else type(out).__name__} "
                         f"for a batch of shape {x.shape}; it must return the batch in the same shape, example i "
                         "still example i, or the labels no longer match")


def check_outputs(fns, name: str | None = None) -> None:
    """Refuse, before anything trains, a model whose init or forward pass fails on the data's shape (named with
    the error's first line), or whose outputs do not fit the data: one score per class (classification) or
    as many outputs as the targets have (regression); traced, not run. ``name``: the model as the config names it."""
    spec, b = fns.spec, fns.batch_size
    variables = _variables_shape(fns, name)
    xb = jax.ShapeDtypeStruct((b, *spec.image_shape), spec.x_dtype)
    try:
        out = jax.eval_shape(fns.model.evaluate, variables, xb)[0]
    except UsageError:
        raise
    except Exception as e:  # noqa: BLE001 (the model on this data: any error, named)
        raise UsageError(f"model {_model_name(fns, name)} fails on a batch of shape {xb.shape} of data of shape "
                         f"{_data_shape(spec)} ({_first_line(e)}); make the model take inputs of this shape, or "
                         "reshape the data (images are (N, H, W, C))") from None
    if not hasattr(out, "shape"):  # a tuple or dict of outputs failed deep in JAX ("'tuple' has no attribute shape")
        leaves = jax.tree.leaves(out)
        raise UsageError(f"the model returns a {type(out).__name__} of {len(leaves)} array(s) for a batch, but must "
                         "return one array of outputs (logits, or predictions for a regression); return that alone "
                         "(CKA's features: accept return_features=True and return (logits, features) only then)")
    shape = tuple(out.shape)
    if spec.task == "regression":
        if len(shape) < 1 or shape[0] != b or int(np.prod(shape[1:])) != spec.num_classes:
            raise UsageError(f"the model returns outputs of shape {shape} for a batch of {b}, but the targets have "
                             f"{spec.num_classes} value(s) per example; build its last layer with num_classes="
                             f"{spec.num_classes} outputs")
    elif shape != (b, spec.num_classes):
        raise UsageError(f"the model returns outputs of shape {shape} for a batch of {b}, but the data has "
                         f"{spec.num_classes} classes; build its last layer with num_classes outputs (shape "
                         f"({b}, {spec.num_classes}))")
    if not jax.numpy.issubdtype(out.dtype, jax.numpy.floating):
        raise UsageError(f"the model returns {out.dtype} outputs; return floating-point logits or predictions")


def check_loss(fns, data) -> None:
    """Refuse, before anything trains, a loss of your own that does not return one loss per example: a
    ``(B, 3)`` loss was averaged over everything without a word, and one that fails failed deep in JAX.
    Traced on the model's outputs and a batch of labels, not run."""
    if fns.parts.loss is None:
        return
    spec, b = fns.spec, fns.batch_size
    out = jax.eval_shape(fns.model.evaluate, _variables_shape(fns),
                         jax.ShapeDtypeStruct((b, *spec.image_shape), spec.x_dtype))[0]
    y = jax.ShapeDtypeStruct((b, *np.shape(data.y_train)[1:]), np.asarray(data.y_train[:1]).dtype)
    try:
        losses = jax.eval_shape(fns.example_loss, out, y)
    except Exception as e:  # noqa: BLE001 (the user's function: any error, named)
        raise UsageError(f"loss(outputs, labels) fails on outputs of shape {tuple(out.shape)} and labels of shape "
                         f"{y.shape} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); it must take "
                         "them and return one loss per example") from None
    shape = getattr(losses, "shape", None)
    if shape != (b,):
        raise UsageError(f"loss(outputs, labels) returns {f'shape {tuple(shape)}' if shape is not None else type(losses).__name__} "
                         f"for a batch of {b}; it must return one loss per example, shape ({b},) (the study averages "
                         "them): reduce the other axes in the loss, e.g. .sum(-1)")


def check_optimizer(fns) -> None:
    """Refuse, before anything trains, an optimizer of your own whose init or update fails on the model's
    parameters, whose update returns updates not shaped as the parameters, or whose state changes structure, shape
    or dtype from step to step (the training step carries it): each failed deep in JAX, naming its internals.
    Traced, not run."""
    if fns.parts.optimizer is None:
        return
    params = _variables_shape(fns)["params"]
    try:
        state = jax.eval_shape(fns.tx.init, params)
        updates, new = jax.eval_shape(lambda g, s, w: step_update(fns.tx, g, s, w), params, state, params)
    except UsageError:
        raise
    except Exception as e:  # noqa: BLE001 (the user's optimizer: any error, named)
        raise UsageError(f"your optimizer fails on the model's parameters ({_first_line(e)}); give an "
                         "optax.GradientTransformation whose init(params) returns a pytree of arrays and whose "
                         "update(grads, state, params) returns (updates, state)") from None
    change = carry_change(params, updates, dtypes=False)
    if change:
        where, was, now = change
        raise UsageError(f"your optimizer's update returns updates{where} {now} for parameters{where} {was}; return "
                         "one update per parameter, shaped as it is")
    change = carry_change(state, new)
    if change:
        where, was, now = change
        raise UsageError(f"your optimizer's update turns its state{where} from {was} into {now}; keep every leaf of "
                         "the state at the structure, shape and dtype its init gave (the training step carries it "
                         "from step to step)")


def parse_arms(config: Config) -> list[Arm]:
    """The study's arms, each parsed once (UsageError for unknown names)."""
    return [parse_arm(a) for a in config.study.arms]


def resolve_parts(config: Config, parts: Parts = Parts()) -> Parts:
    """``parts`` with what the config's ``PACKAGE.MODULE:ATTR`` names import (the CLI's ``--model``,
    ``--optimizer``, ``--loss``, ``--augment``; ``model.features``), for each part not passed in memory;
    UsageError when the config names a part that was not passed or an import is not what it should be."""
    if parts.model is None and cfg.imported(config.model.name):
        parts = parts._replace(model=import_object(config.model.name))
    if config.optim.name == cfg.CUSTOM and parts.optimizer is None:
        raise UsageError("optim.name 'custom' means an optax optimiser passed to nondet_jax.run_study(optimizer=...); "
                         "from the command line use --optimizer sgd, adamw or PACKAGE.MODULE:ATTR")
    if parts.optimizer is None and cfg.imported(config.optim.name):
        parts = parts._replace(optimizer=_imported_optimizer(config.optim.name))
    if parts.loss is None and cfg.imported(config.train.loss):
        parts = parts._replace(loss=_imported_function(config.train.loss, "--loss", "(outputs, labels) -> losses"))
    if parts.augment is None and cfg.imported(config.data.augment):
        parts = parts._replace(augment=_imported_function(config.data.augment, "--augment", "(key, x) -> x"))
    if parts.features is None and config.model.features:
        parts = parts._replace(features=config.model.features)
    if parts.init_params is None and config.model.init_from:
        path, at, r = config.model.init_from.rpartition("@")
        if not at:  # PATH.npz alone (the documented form): no replica axis to pick from
            path, r = config.model.init_from, ""
        elif not (r.isascii() and r.isdigit()):
            raise UsageError(f"--init-from {config.model.init_from}: after @ comes a replica number, e.g. "
                             "runs/pretrain/weights/control.npz@0")
        parts = parts._replace(init_params=pretrained.load_params(path, int(r) if r else None))
    return parts  # make_train holds init_params by content (pretrained.as_given)


def _imported_optimizer(spec: str):
    """An optax ``GradientTransformation`` named ``PACKAGE.MODULE:ATTR``: the object, or what a function of no
    arguments returns."""
    obj = import_object(spec, "--optimizer", "mypkg.opt:tx")
    if callable(obj) and not hasattr(obj, "update"):
        try:
            obj = obj()
        except TypeError as e:
            raise UsageError(f"--optimizer {spec} is a function that cannot be called without arguments ({e}); name "
                             "an optax.GradientTransformation or a function of no arguments returning one") from None
    if not (hasattr(obj, "init") and hasattr(obj, "update")):
        raise UsageError(f"--optimizer {spec} is a {type(obj).__name__}, not an optax.GradientTransformation; name one "
                         "(e.g. tx = optax.adamw(1e-3)) or a function of no arguments returning one")
    return obj


def _imported_function(spec: str, flag: str, signature: str):
    obj = import_object(spec, flag, "mypkg.parts:fn")
    if not callable(obj):
        raise UsageError(f"{flag} {spec} is a {type(obj).__name__}, not a function; name a function {signature}")
    return obj


def prepare(config: Config, parts: Parts = Parts(), data=None):
    """Validate against the data and build the training functions: (data, fns). Writes nothing.

    ``parts`` are the user's own (None for what the config names); ``data`` a
    :class:`nondet_jax.data.Dataset` given in memory (None: load what ``config.data`` names)."""
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
    if config.metrics.tta:
        for name in config.metrics.tta:
            view_grid(name, augmentation_settings(config, data.name, data.x_train.shape[1])[2])
    spec = DataSpec(n_train, tuple(data.x_train.shape[1:]), data.num_classes, data.name, np.dtype(data.x_train.dtype),
                    getattr(data, "task", "classification"))
    check_model_input(config, spec, parts)
    fns = make_train(config, spec, parts)
    check_init_params(fns, config.model.name, config.model.init_from or None)
    check_outputs(fns, config.model.name)  # the user's parts, each traced on its own first: a misuse is named, not found deep in JAX
    check_loss(fns, data)
    check_optimizer(fns)
    check_augment(fns)
    check_arms_active(config, parse_arms(config), fns)
    check_fits(config, spec, len(data.x_test), fns=fns)  # before anything is allocated or written
    return data, fns


def model_record(config: Config, data, fns) -> dict:
    """What ``model.json`` records: the parts that were used (what was imported), the fingerprint
    of the model's parameter shapes, and every part's identity by content
    (:func:`nondet_jax.study.identity.part_identities`) with their combined ``identity_sha256``."""
    keys = abstract_keys()
    x = jax.ShapeDtypeStruct((1, *fns.spec.image_shape), np.asarray(data.x_train[:1]).dtype)
    params = jax.eval_shape(fns.init, keys, perturbations(frozenset()), x).params
    parts = part_identities(config, data, fns)
    return {"model": parts["model"]["name"], "optimizer": parts["optimizer"]["name"], "loss": parts["loss"]["name"],
            "augment": parts["augment"]["name"],
            **model_facts(fns, np.asarray(data.x_train[:1]).dtype), **shape_fingerprint(params),
            "identity": parts, "identity_sha256": identity_sha256(parts)}


def stored_model(paths) -> dict | None:
    """The folder's ``model.json`` (None when there is none yet); UsageError when it is unreadable."""
    if not paths.model.exists():
        return None
    try:
        old = json.loads(paths.model.read_text())
        if not isinstance(old, dict):
            raise ValueError("not a record")
        # the parts a resume compares, in the form model_record writes them (edited to strings: a traceback)
        for key, kind in (("param_shapes", dict), ("identity", dict), ("fingerprint", str), ("identity_sha256", str)):
            if key in old and not isinstance(old[key], kind):
                raise ValueError(f"{key} is not a {kind.__name__}")
    except (OSError, ValueError):
        raise UsageError(f"{paths.model} is unreadable or corrupt; choose another --out") from None
    return old


def holds_results(paths) -> bool:
    """Whether a run folder holds a finished arm (its record): results a changed model must not join."""
    arms = paths.root / "arms"
    return arms.is_dir() and any(p.is_file() for p in arms.glob("*.json"))


def check_epoch_shape(paths, shape: str, recompute=()) -> None:
    """Refuse to add to a folder whose finished arms ran their epochs in another shape than ``shape`` (what
    ``environment.json`` recorded; folders from before the shape was recorded ran a scan): the programs differ, so
    the new arms' last bits would not be those the old ones' version computes. Arms in ``recompute`` are
    trained again, so they do not count."""
    kept = {p.stem for p in (paths.root / "arms").glob("*.json") if p.is_file()} - set(recompute)
    if not kept or not paths.environment.is_file():
        return
    try:
        env = json.loads(paths.environment.read_text())
        if not isinstance(env, dict) or "backend" not in env:  # not a record any version wrote ({} by hand): it
            return  # says nothing of how the arms ran (read as an older version's, a costly retraining was advised)
        old = env.get("epoch_shape", "scan")
        why = "train.epoch_shape when they ran" if "epoch_shape" in env else "an older nondet_jax"
    except (OSError, ValueError):
        return  # unreadable: the arms' own records and checks stand
    if isinstance(old, str) and old != shape:
        raise UsageError(f"--out {paths.root} holds arms whose epochs ran as '{old}' ({why}), and this run runs "
                         f"them as '{shape}' (train.epoch_shape), which changes results in their last bits; keep "
                         f"--set train.epoch_shape={old}, choose another --out, or retrain every finished arm with "
                         "--recompute ARM")


def check_model(paths, record: dict, config: Config | None = None) -> None:
    """Refuse to continue a study whose stored ``model.json`` names another model or parameter
    shapes, or whose parts differ by content (each changed part named). A folder without a finished
    arm holds no results to protect (a study that stopped before storing one, say with a model whose
    outputs CKA could not take): the corrected model may take it over; an arm's checkpoints of the
    other model are still refused by their own identity, naming ``--recompute ARM``."""
    old = stored_model(paths)
    if old is None or not holds_results(paths):
        return
    if old.get("fingerprint") != record["fingerprint"] or old.get("model") != record["model"]:
        diff = fingerprint_diff(old, record)
        if old.get("model") != record["model"]:
            diff.insert(0, f"model {old.get('model')} -> {record['model']}")
        raise UsageError(f"--out {paths.root} holds results of another model ({'; '.join(diff)}); choose another "
                         "--out or use the model the study started with")
    try:
        check_identity(paths.root, old, record["identity"])
    except UsageError:
        # a changed setting (train.batch_size) changes the parts' traces too: name the setting, not the parts; the
        # keys naming a part are said better by the identity's words (what in the data or loss differs)
        changed = [d for d in (config_changes(paths.root, cfg.to_dict(config)) if config is not None else [])
                   if d.split(" ")[0] not in cfg.PART_KEYS | {"data.name"}]
        if changed:
            raise different_config(paths.root, changed) from None
        raise


def check_watchable(config: Config, fns, strategy: str) -> None:
    """``study.dynamics_every`` watches replicas 0 and 1 between training steps (:mod:`nondet_jax.replicas.watch`):
    refused, before anything is written, where the strategy runs an epoch as one program."""
    if config.study.dynamics_every and strategy_epoch_shape(fns, strategy) != "step":
        fix = "--set train.epoch_shape=step" + ("" if strategy in ("sequential", "vmap") else " --strategy sequential")
        raise UsageError(f"study.dynamics_every watches replicas 0 and 1 between training steps, but the {strategy} "
                         f"strategy runs each epoch as one program here (train.epoch_shape {config.train.epoch_shape}); "
                         f"add {fix}, or drop study.dynamics_every")


def prepare_child(out) -> tuple[Config, object, object, str]:
    """A child process's study (an arm or replica the parent hands off): the folder's config, its data
    and functions, checked to be the study the parent holds (``model.json``); returns (config, data,
    fns, identity_sha256)."""
    paths = RunPaths(out)
    config = cfg.from_dict(json.loads(paths.config.read_text()))
    data, fns = prepare(config)
    record = model_record(config, data, fns)
    check_model(paths, record)
    return config, data, fns, record["identity_sha256"]
