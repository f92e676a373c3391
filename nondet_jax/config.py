"""Study configuration: frozen dataclasses, validation with one-line errors, file and override loading.

A configuration is a tree of frozen dataclasses. Its flat form uses dotted keys
(``model.name``, ``train.epochs``), which is what ``--set key=value`` and config files use.
Every problem is raised as :class:`UsageError` whose message names the problem and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import re
import stat
from pathlib import Path
from typing import Any

import yaml

from nondet_jax import arms, models
from nondet_jax.data import DATASETS, NEEDS_TRAIN_CAP
from nondet_jax.errors import (
    UsageError,  # re-exported: ``config.UsageError`` stays importable
)
from nondet_jax.instruments import configurations


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    name: str = "resnet8"
    width: float = 1.0  # multiplier on every layer's channel count
    dropout: float = 0.0  # rate of the dropout before the classifier (0 = none)
    dtype: str = "float32"  # compute dtype: float32 | bfloat16 (mixed precision: float32 weights and optimiser)
    # a user model's submodule whose output CKA uses when the model has no return_features ("" = the logits)
    features: str = ""
    # fine-tuning: a .npz of parameters every replica starts from (PATH.npz, or PATH.npz@R for replica R of a run
    # folder's weights/<arm>.npz); the init key draws only the parameters it does not hold ("" = none)
    init_from: str = ""


@dataclasses.dataclass(frozen=True)
class DataConfig:
    name: str = "digits"
    data_dir: str | None = None  # TFDS data directory (None = TFDS default)
    augment: str = "auto"  # auto (on for CIFAR, off otherwise) | on | off | PACKAGE.MODULE:ATTR ((key, x) -> x)
    flip: str = "auto"  # horizontal flips when augmenting: auto (on for CIFAR, off for digits/MNIST) | on | off
    crop_padding: int = 0  # 0 = 4 pixels for 32x32 inputs, 1 for 8x8 ones
    image_size: int = 0  # TFDS sets: square side on loading (0 = 224 for imagenette/imagenet2012, else native)
    max_train_examples: int = 0  # TFDS sets: a fixed random subset of the training split (0 = all)
    max_test_examples: int = 0  # TFDS sets: likewise for the test (validation) split (0 = all)


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    name: str = "sgd"  # sgd | adamw | PACKAGE.MODULE:ATTR (an optax.GradientTransformation, or a function of no arguments returning one)
    lr: float = 0.05
    momentum: float = 0.9  # sgd only
    nesterov: bool = False  # sgd only
    weight_decay: float = 5e-4
    schedule: str = "cosine"  # constant | step | cosine | snapshot (cycles cosine restarts)
    warmup_epochs: float = 1.0  # linear warm-up before cosine (cosine; snapshot: before each cycle)
    step_every_epochs: float = 0.0  # step schedule: multiply by step_factor every N epochs (0 = at 50% and 75%)
    step_factor: float = 0.1
    cycles: int = 1  # snapshot schedule: cosine cycles, each ending at lr 0 (train.epochs divisible by it)
    bias_bn_lr_scale: float = 1.0  # lr multiplier of biases and BatchNorm scales (Summers & Dinneen: 0.1)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    epochs: int = 12
    batch_size: int = 128
    eval_batch_size: int = 500
    unroll: int = 0  # training steps unrolled per scan iteration (0 = auto: see train.scan_unroll)
    epoch_shape: str = "auto"  # scan (one program per epoch) | step (one step program driven from Python) | auto
    # replicas the sequential strategy trains at once, each dispatched from its own Python thread (0 = auto: the
    # CPU cores this process may use, on CPU; 1 elsewhere); results are bitwise the same whatever it is
    replica_threads: int = 0
    checkpoint_every: int = 1  # epochs between orbax checkpoints of an arm in training (0 = none)
    checkpoint_seconds: float = 30.0  # ... and at least this much training since the last one (0 = every due epoch)
    # default (softmax cross-entropy; squared error for regression) | PACKAGE.MODULE:ATTR (per-example (outputs, labels) -> losses)
    loss: str = "default"


@dataclasses.dataclass(frozen=True)
class StudyConfig:
    arms: tuple[str, ...] = ("control", "init", "data_order", "bitflip", "batch_order", "all")
    replicas: int = 6
    seed: int = 0
    strategy: str = "auto"  # auto | vmap | sequential | sharded
    xla_determinism: bool = True  # CLI: XLA's determinism flags on (hardware arms run without them)
    hardware_processes: str = "replica"  # hardware arms: one fresh process per replica, caches off | "arm": one child
    dynamics_every: int = 0  # > 0: trace replicas 0 and 1 of each arm every k steps (nondet_jax.analysis.dynamics)
    eval_every: int = 0  # > 0: test every replica every k epochs (and after the last): test curves, best epochs


@dataclasses.dataclass(frozen=True)
class MetricsConfig:
    pairwise: bool = True  # pairwise diversity metrics (need R >= 2)
    lmc_pairs: int = 3  # disjoint replica pairs whose LMC barrier is measured (0 = none)
    lmc_points: int = 11  # interpolation points from one endpoint to the other
    bn_examples: int = 2048  # training examples that BatchNorm statistics are recomputed on
    tta: tuple[str, ...] = ()  # test-time augmentation view sets evaluated per arm (nondet_jax.analysis.tta), e.g. flip,crop5
    decomposition: bool = False  # the report's variance decomposition over the one-source arms and all
    # std ratios (an arm's std / the all arm's) for which the report gives the replicas per arm a study needs
    # to detect them (80% power, two-sided 5%); report only: changing them never retrains anything
    power_ratios: tuple[float, ...] = (0.5, 0.75)


@dataclasses.dataclass(frozen=True)
class InstrumentsConfig:
    """Cockpit's quantities per step and replica (nondet_jax.instruments)."""

    config: str = "none"  # none | economy | business | full | quantity names, comma-separated (e.g. Loss,HessMaxEV)
    every: int = 1  # linear schedule: track every k-th step (from step 0)
    schedule: str = "linear"  # linear | log (log_points log-spaced steps over the run, plus step 0)
    log_points: int = 50
    chunk: int = 32  # examples per per-example-gradient chunk (memory ~ chunk x parameters)
    hess_iters: int = 20  # Lanczos steps for HessMaxEV (warm-started from the last tracked step)
    # HessTrace, TICDiag, TICTrace from: ggn (the exact diagonal of the generalised Gauss-Newton matrix, about
    # one per-example pass per class) | hutchinson (hess_probes probes of the Hessian, with standard errors; no TICDiag)
    curvature: str = "ggn"
    hess_probes: int = 1  # Hutchinson probes (curvature = hutchinson)
    # stop HessMaxEV's Lanczos steps once ||Hv - lambda v|| / |lambda| is below this (0 = off: hess_iters steps)
    hess_tol: float = 0.0
    # NormTest/InnerTest/OrthoTest alone: auto (ghost norms per layer where cheaper) | ghost | materialise
    norms: str = "auto"
    # train_pass: per-example contributions from the training backward pass (BatchNorm in training mode;
    # they sum to the batch gradient); frozen_bn: gradients of per-example losses with the batch's
    # BatchNorm statistics held fixed, from a second pass. See docs/instruments.md.
    per_example: str = "train_pass"


@dataclasses.dataclass(frozen=True)
class Config:
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    optim: OptimConfig = OptimConfig()
    train: TrainConfig = TrainConfig()
    study: StudyConfig = StudyConfig()
    metrics: MetricsConfig = MetricsConfig()
    instruments: InstrumentsConfig = InstrumentsConfig()


STRATEGIES = ("auto", "vmap", "sequential", "unrolled", "sharded")
EPOCH_SHAPES = ("auto", "scan", "step")  # train.epoch_shape (nondet_jax.train.epoch_shape says what each does)
HARDWARE_PROCESSES = ("replica", "arm")
CUSTOM = "custom"  # optim.name of a study whose optimiser the user passed (nondet_jax.run_study)


def imported(name: str) -> bool:
    """Whether a config value names the user's own part, ``PACKAGE.MODULE:ATTR`` (the CLI imports it)."""
    return ":" in name


def user_optimizer(o: "OptimConfig") -> bool:
    """The study trains with the user's own optax optimiser (passed in memory, or imported by name)."""
    return o.name == CUSTOM or imported(o.name)


# the command line's flags that set one config key each (--batch-size: batch_size): flag -> dotted key
FLAG_KEYS = {
    "arms": "study.arms",
    "replicas": "study.replicas",
    "seed": "study.seed",
    "strategy": "study.strategy",
    "epochs": "train.epochs",
    "batch_size": "train.batch_size",
    "model": "model.name",
    "width": "model.width",
    "dropout": "model.dropout",
    "dataset": "data.name",
    "data_dir": "data.data_dir",
    "augment": "data.augment",
    "optimizer": "optim.name",
    "loss": "train.loss",
    "features": "model.features",
    "init_from": "model.init_from",
    "lr": "optim.lr",
    "instruments": "instruments.config",
}


# optim.* keys each of the config's optimizers or schedules reads alone: set explicitly under another, it would do
# nothing (each key -> (the config's field it depends on, the values that read it))
OPTIM_KEY_USERS = {"optim.momentum": ("name", ("sgd",)), "optim.nesterov": ("name", ("sgd",)),
                   "optim.warmup_epochs": ("schedule", ("cosine", "snapshot")),
                   "optim.step_every_epochs": ("schedule", ("step",)), "optim.step_factor": ("schedule", ("step",))}


def refuse_optim_settings(given: dict[str, str], o: "OptimConfig") -> None:
    """Settings of the config's optimiser (``given``: each key set explicitly, with how it was set, e.g.
    ``{"optim.lr": "--lr"}``; its ``optim.*`` ones) that ``o`` would silently ignore: any, where the study trains
    with the user's own optimiser, whose learning rate and schedule are its own; else one that only another of
    the config's optimizers or schedules reads (:data:`OPTIM_KEY_USERS`: ``optim.momentum`` under adamw,
    ``optim.warmup_epochs`` under the step schedule). Refused."""
    keys = sorted(k for k in given if k.startswith("optim."))
    if keys and user_optimizer(o):
        raise UsageError(f"{keys[0]} (set by {given[keys[0]]}) does not apply: the study trains with your own "
                         "optimizer, whose learning rate and schedule are its own, so it would be ignored; build it into "
                         "your optimizer (e.g. optax.sgd(0.2)), or leave yours out to use the config's")
    for key in keys:
        field, users = OPTIM_KEY_USERS.get(key, (None, ()))
        if field and getattr(o, field) not in users:
            what = "optimizer" if field == "name" else "schedule"
            raise UsageError(f"{key} (set by {given[key]}) does nothing under the {getattr(o, field)} {what}: only "
                             f"{' and '.join(users)} read{'s' if len(users) == 1 else ''} it; drop it, or choose --set optim.{field}={users[0]}")


# config keys that name one of run_study's own parts (model, optimizer, loss, augment, init_params): what differs
# in a part is said by its identity (nondet_jax.study.identity), and a part passed in memory sets its key
PART_KEYS = frozenset({"model.name", "optim.name", "train.loss", "data.augment", "model.init_from"})
ARRAYS_PREFIX = "arrays-"  # data.name of arrays passed to nondet_jax.run_study: arrays-<sha256 prefix>
NPZ_BY_CONTENT = "<a .npz file, identified by its contents>"  # data.name of any .npz, where configs are compared


def comparable_data_name(name: str) -> str:
    """``data.name`` as configs are compared: a ``.npz`` file is identified by its arrays' bytes (the
    study's identity), not by how its path is spelled, so every path compares equal here."""
    return NPZ_BY_CONTENT if isinstance(name, str) and name.endswith(".npz") else name


SEED_RANGE = (0, 2**32 - 1)  # jax.random.key keeps the low 32 bits of a seed (without jax_enable_x64)
INT_MAX = 2**31 - 1  # steps, epochs and sizes are int32 inside the compiled programs
MAX_CONFIG_BYTES = 1 << 20  # a config file is a few hundred bytes; refuse anything near a megabyte
MAX_YAML_NODES = 100_000  # YAML nodes after expanding aliases (a 400-byte alias bomb expands to ~10^8)
OPTIMIZERS = ("sgd", "adamw")
SCHEDULES = ("constant", "step", "cosine", "snapshot")
AUGMENT = ("auto", "on", "off")


def _sections() -> dict[str, type]:
    return {f.name: type(getattr(Config(), f.name)) for f in dataclasses.fields(Config)}


def valid_keys() -> list[str]:
    """All dotted keys a config file or ``--set`` may use."""
    return [f"{s}.{f.name}" for s, cls in _sections().items() for f in dataclasses.fields(cls)]


def _coerce(key: str, value: Any, default: Any) -> Any:
    """Convert ``value`` (possibly a string from the command line) to the type of ``default``."""
    try:
        if isinstance(default, bool):
            if isinstance(value, str):
                if value.lower() in ("1", "true", "yes", "on"):
                    return True
                if value.lower() in ("0", "false", "no", "off"):
                    return False
                raise ValueError
            return bool(value)
        if isinstance(default, int):
            if isinstance(value, bool):  # YAML reads yes/no/on/off/true/false as booleans: seed: yes was seed 1
                raise UsageError(f"config key '{key}' got {value!r} (YAML reads yes, no, on, off, true and false as "
                                 "booleans), which is not an integer; write a number")
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        if isinstance(default, float):
            if isinstance(value, bool):
                raise ValueError
            number = float(value)
            if not math.isfinite(number):  # nan, inf, 1e400: never a meaningful setting
                raise UsageError(f"config key '{key}' got {value!r}, which is not a finite number; fix the value")
            return number
        if isinstance(default, tuple):
            if isinstance(value, str) and value.strip().startswith("[") and value.strip().endswith("]"):
                value = value.strip()[1:-1]  # a YAML list typed on the command line: [control, init]
            items = tuple(v.strip() for v in value.split(",") if v.strip()) if isinstance(value, str) else tuple(value)
            if default and all(isinstance(v, float) for v in default):  # a list of numbers
                if any(isinstance(v, bool) for v in items):
                    raise ValueError
                numbers = tuple(float(v) for v in items)
                if not all(math.isfinite(v) for v in numbers):
                    raise UsageError(f"config key '{key}' got {value!r}, which holds a number that is not finite; "
                                     "fix the value")
                return numbers
            return tuple(str(v) for v in items)
        if default is None or isinstance(default, str):
            if value is None or (isinstance(value, str) and value.lower() in ("", "none", "null")):
                return None if default is None else value
            if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
                return ",".join(value)  # a list of names, as the command line's comma-separated text
            if not isinstance(value, (str, int, float)):
                raise TypeError
            return str(value)
    except UsageError:
        raise
    except (TypeError, ValueError, OverflowError):
        pass
    shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
    raise UsageError(f"config key '{key}' got {shown}, which is not {'an' if type(default).__name__[0] in 'aeiou' else 'a'} {type(default).__name__}; fix the value")


def from_flat(flat: dict[str, Any], base: Config | None = None) -> Config:
    """Build a validated Config from dotted keys applied on top of ``base`` (default: defaults)."""
    base = base or Config()
    keys = valid_keys()
    updates: dict[str, dict[str, Any]] = {}
    for key, value in flat.items():
        if key not in keys:
            close = [k for k in keys if k.split(".")[-1] == key.split(".")[-1]] or difflib.get_close_matches(key, keys, 1)
            sections = sorted({k.split(".")[0] for k in keys})
            hint = (f"did you mean '{close[0]}'?" if close else
                    f"keys are section.name with section one of {', '.join(sections)}; the full list is in docs/cli.md")
            raise UsageError(f"unknown config key '{key}'; {hint}")
        section, name = key.split(".")
        default = getattr(getattr(base, section), name)
        updates.setdefault(section, {})[name] = _coerce(key, value, default)
    new = {s: dataclasses.replace(getattr(base, s), **u) for s, u in updates.items()}
    config = dataclasses.replace(base, **new)
    validate(config)
    return config


class _Duplicate(Exception):
    """A key given twice in one mapping of a config file: (key, line of the first, line of the second)."""


class _StrictLoader(yaml.SafeLoader):
    """:class:`yaml.SafeLoader` that refuses a key given twice in one mapping (PyYAML keeps the last, so
    ``train: {epochs: 3}`` followed by another ``train:`` section lost the epochs without a word)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # <<: *anchor, whose keys the mapping may override
                    continue
                key = self.construct_object(key_node, deep=True)
                line = (key_node.start_mark.line + 1, key_node.start_mark.column + 1)
                try:
                    if key in seen:
                        raise _Duplicate(key, seen[key], line)
                    seen[key] = line
                except TypeError:  # an unhashable key: construct_mapping names it
                    continue
        return super().construct_mapping(node, deep)


def _json_pairs(pairs):
    out = {}
    for k, v in pairs:
        if k in out:
            raise _Duplicate(k, None, None)
        out[k] = v
    return out


def _duplicate_message(path, text: str, e: _Duplicate, json_: bool) -> str:
    """Both places a key is given: (line, column) pairs from YAML's marks; for JSON, whose hook knows no
    positions, the first two places the key is written as a key."""
    key, first, second = e.args
    if json_:
        places = [(text.count("\n", 0, m.start()) + 1, m.start() - text.rfind("\n", 0, m.start()))
                  for m in re.finditer(re.escape(json.dumps(key)) + r"\s*:", text)]
        first, second = (places + [None, None])[:2]
    if first and second and first[0] != second[0]:
        where = f" (lines {first[0]} and {second[0]})"
    elif first and second:
        where = f" (line {first[0]}, columns {first[1]} and {second[1]})"
    else:
        where = ""
    return f"{path} gives key {str(key)!r} twice in one mapping{where}, and only one can hold; keep one"


def loads_json(text: str, path) -> Any:
    """``json.loads`` refusing a key given twice in one object (a UsageError naming both places); a
    document nested deeper than Python can read is a UsageError too."""
    try:
        return json.loads(text, object_pairs_hook=_json_pairs)
    except _Duplicate as e:
        raise UsageError(_duplicate_message(path, text, e, True)) from None
    except RecursionError:
        raise UsageError(f"{path} nests deeper than Python reads; fix the file") from None


def read_regular(path: Path, limit: int) -> bytes:
    """Up to ``limit + 1`` bytes of the regular file ``path``: a FIFO, device or folder is refused before
    it is read (opening a FIFO for reading waits for a writer forever); OSError when it cannot be opened."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            what = "a folder" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "a device or socket"
            raise UsageError(f"config file {path} is {what}, not a regular file; pass a YAML or JSON file")
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read(limit + 1)
    finally:
        os.close(fd)


def load_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML or JSON config file into dotted keys (nested sections are flattened). A key given
    twice (in one mapping, or both dotted and nested) is refused, naming both places."""
    path = Path(path)
    try:
        raw = read_regular(path, MAX_CONFIG_BYTES)
    except OSError as e:
        raise UsageError(f"cannot read config file {path}: {e.strerror}; check the path") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise UsageError(f"config file {path} is larger than {MAX_CONFIG_BYTES // 2**20} MiB, too large for a config; "
                         "pass a file of config keys")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"config file {path} is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}); "
                         "save it as UTF-8") from None
    try:
        if path.suffix == ".json":
            data = loads_json(text, f"config file {path}")
        else:
            _check_yaml_size(path, text)
            data = yaml.load(text, Loader=_StrictLoader)  # noqa: S506 (a SafeLoader)
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        raise UsageError(f"config file {path} is not valid {'JSON' if path.suffix == '.json' else 'YAML'}: "
                         f"{str(e).splitlines()[0]}; fix the file") from None
    except _Duplicate as e:
        raise UsageError(_duplicate_message(f"config file {path}", text, e, False)) from None
    except UsageError:
        raise
    except RecursionError:
        raise UsageError(f"config file {path} nests deeper than Python reads; fix the file") from None
    except ValueError as e:  # an integer of more than sys.get_int_max_str_digits() digits
        raise UsageError(f"config file {path} holds a number Python will not read ({str(e).split(';')[0]}); "
                         "no config value needs that many digits: fix the file") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UsageError(f"config file {path} must hold a mapping of sections or dotted keys; fix the file")
    sections = set(_sections())
    flat: dict[str, Any] = {}
    written: dict[str, str] = {}  # key -> how the file wrote it (for a key given twice)

    def put(key: str, value, how: str) -> None:
        if key in flat:
            raise UsageError(f"config file {path} sets {key} twice, as {written[key]} and as {how}, and only one can "
                             "hold; keep one")
        flat[key], written[key] = value, how

    for k, v in data.items():
        if isinstance(v, dict):
            for k2, v2 in v.items():
                put(f"{k}.{k2}", v2, f"'{k2}' under section '{k}'")
        elif str(k) in sections:
            shown = "nothing (null)" if v is None else repr(v) if len(repr(v)) <= 40 else repr(v)[:37] + "..."
            raise UsageError(f"config file {path}: section '{k}' holds {shown}, not a mapping of keys; write e.g. "
                             f"{k}: {{KEY: VALUE}}, or remove the line")
        else:
            put(str(k), v, f"'{k}'")
    return flat


def _check_yaml_size(path: Path, text: str) -> None:
    """Refuse a YAML document whose aliases expand to more than :data:`MAX_YAML_NODES` nodes (or
    refer to themselves) before it is constructed: a few hundred bytes of nested aliases would
    otherwise become gigabytes once the values are turned into strings."""
    node = yaml.compose(text, Loader=yaml.SafeLoader)
    sizes: dict[int, int] = {}

    def size(n, depth=0) -> int:
        if id(n) in sizes:
            if sizes[id(n)] < 0:
                raise UsageError(f"config file {path} holds a YAML alias that refers to itself; write the values out")
            return sizes[id(n)]
        if depth > 100:
            raise UsageError(f"config file {path} nests deeper than 100 levels; fix the file")
        sizes[id(n)] = -1
        children = [c for pair in n.value for c in pair] if isinstance(n, yaml.MappingNode) else \
            n.value if isinstance(n, yaml.SequenceNode) else []
        total = 1
        for c in children:
            total += size(c, depth + 1)
            if total > MAX_YAML_NODES:
                break
        sizes[id(n)] = min(total, MAX_YAML_NODES + 1)
        return sizes[id(n)]

    if node is not None and size(node) > MAX_YAML_NODES:
        raise UsageError(f"config file {path} expands to more than {MAX_YAML_NODES:,} values through YAML aliases "
                         "(&anchor / *alias); write the values out")


def parse_overrides(items: list[str]) -> dict[str, str]:
    """Parse ``key=value`` strings from ``--set``."""
    out = {}
    for item in items:
        if "=" not in item:
            raise UsageError(f"--set expects key=value, got '{item}'; write e.g. --set optim.lr=0.1")
        k, v = item.split("=", 1)
        out[k.strip()] = v.strip()
    return out


def same_setting(key: str, a, b) -> bool:
    """Whether two values of config key ``key`` are one setting (``--lr 0.05`` and ``--set optim.lr=5e-2``,
    ``replicas=4`` and ``settings={"study.replicas": "4"}``): each read as the config reads it, or, where one alone
    is not a valid config, as written."""
    try:
        return to_dict(from_flat({key: a})) == to_dict(from_flat({key: b}))
    except UsageError:
        return str(a) == str(b)


def to_dict(config: Config) -> dict[str, Any]:
    """The nested plain-dict form written to ``config.json``."""
    d = dataclasses.asdict(config)
    return {section: {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}
            for section, values in d.items()}


def from_dict(d: dict[str, Any]) -> Config:
    """Inverse of :func:`to_dict`."""
    flat = {f"{s}.{k}": v for s, sec in d.items() for k, v in sec.items()}
    return from_flat(flat)


def arm_config(config: Config, arm) -> Config:
    """The configuration an arm (a :class:`nondet_jax.sources.Arm`) trains under: ``config`` itself,
    or with the snapshot schedule of K cycles for an ``arm@snapshotK`` variant (same epochs, so the
    same training cost)."""
    k = arm.cycles
    if not k:
        return config
    if user_optimizer(config.optim):
        raise UsageError(f"arm '{arm.name}' trains with the config's snapshot schedule (learning-rate restarts), which "
                         "your own optimizer does not follow, so its snapshots would not be a snapshot ensemble; drop "
                         "the arm, or leave your optimizer out to use the config's")
    optim = dataclasses.replace(config.optim, schedule="snapshot", cycles=k)
    variant = dataclasses.replace(config, optim=optim)
    try:
        validate(dataclasses.replace(variant, study=dataclasses.replace(config.study, arms=("control",))))
    except UsageError as e:
        raise UsageError(f"arm '{arm.name}': {e}") from None
    return variant


def validate(config: Config) -> None:
    """Check values that do not depend on the data set; raise UsageError naming the fix."""
    # Imported here: models and sources import nothing from config, config names their registries.

    m, d, o, t, s = config.model, config.data, config.optim, config.train, config.study
    _validate_numbers(config)
    if m.name not in models.MODEL_NAMES and ":" not in m.name:
        raise UsageError(f"unknown model '{m.name}'; choose one of: {', '.join(models.MODEL_NAMES)}, or your own as "
                         "PACKAGE.MODULE:ATTR")
    if m.width <= 0:
        raise UsageError(f"model width must be > 0, got {m.width}; use e.g. --set model.width=1")
    if not 0 <= m.dropout < 1:
        raise UsageError(f"dropout rate must be in [0, 1), got {m.dropout}; fix --set model.dropout")
    if m.dtype not in models.PRECISION_NAMES:
        raise UsageError(f"unknown model dtype '{m.dtype}'; use --set model.dtype=float32 or bfloat16")
    ratios = config.metrics.power_ratios
    if not 1 <= len(ratios) <= 4 or any(r <= 0 or r == 1 for r in ratios):
        raise UsageError(f"metrics.power_ratios must be 1 to 4 std ratios > 0 other than 1, got "
                         f"{', '.join(map(str, ratios)) or 'none'}; e.g. --set metrics.power_ratios=0.5,0.75")

    if d.name not in DATASETS and not d.name.endswith(".npz") and not d.name.startswith(ARRAYS_PREFIX):
        raise UsageError(f"unknown dataset '{d.name}'; choose one of: {', '.join(DATASETS)}, or your own arrays as "
                         "PATH.npz")
    if d.augment not in AUGMENT and not imported(d.augment):
        raise UsageError(f"data.augment must be one of {', '.join(AUGMENT)}, got '{d.augment}'")
    if d.flip not in AUGMENT:
        raise UsageError(f"data.flip must be one of {', '.join(AUGMENT)}, got '{d.flip}'")
    if d.crop_padding < 0:
        raise UsageError(f"data.crop_padding must be >= 0, got {d.crop_padding}")
    if d.image_size < 0 or d.max_train_examples < 0 or d.max_test_examples < 0:
        raise UsageError("data.image_size, data.max_train_examples and data.max_test_examples must be >= 0 "
                         "(0 = default / all); fix the value")
    if d.name == "digits" and (d.image_size not in (0, 8) or d.max_train_examples or d.max_test_examples):
        raise UsageError("data.image_size and data.max_*_examples apply to TFDS data sets, not digits; leave them at 0")

    if d.name in NEEDS_TRAIN_CAP and d.max_train_examples == 0:
        raise UsageError(f"{d.name}'s training split does not fit in memory; set a subset size with "
                         "--set data.max_train_examples=50000 (say)")
    if t.loss != "default" and not imported(t.loss):
        raise UsageError(f"train.loss must be default or PACKAGE.MODULE:ATTR (a function (outputs, labels) -> "
                         f"per-example losses), got '{t.loss}'; write e.g. --loss mypkg.losses:smooth_ce")
    if o.name not in OPTIMIZERS and not user_optimizer(o):
        raise UsageError(f"unknown optimizer '{o.name}'; choose one of: {', '.join(OPTIMIZERS)}")
    if o.schedule not in SCHEDULES:
        raise UsageError(f"unknown schedule '{o.schedule}'; choose one of: {', '.join(SCHEDULES)}")
    if o.lr <= 0:
        raise UsageError(f"learning rate must be > 0, got {o.lr}; use e.g. --lr 0.05")
    if o.weight_decay < 0 or o.warmup_epochs < 0 or o.step_every_epochs < 0:
        raise UsageError("weight_decay, warmup_epochs and step_every_epochs must be >= 0; fix the value")
    if o.bias_bn_lr_scale <= 0:
        raise UsageError(f"optim.bias_bn_lr_scale must be > 0, got {o.bias_bn_lr_scale}; use 1 for no scaling")
    if not 0 <= o.momentum < 1:
        raise UsageError(f"optim.momentum must be in [0, 1), got {o.momentum}; use e.g. --set optim.momentum=0.9")
    if not 0 < o.step_factor <= 1:
        raise UsageError(f"optim.step_factor must be in (0, 1], got {o.step_factor}; use e.g. --set optim.step_factor=0.1")
    if o.cycles < 1:
        raise UsageError(f"optim.cycles must be >= 1, got {o.cycles}; use e.g. --set optim.cycles=3")
    if o.cycles > 1 and o.schedule != "snapshot":
        raise UsageError(f"optim.cycles={o.cycles} needs the snapshot schedule; add --set optim.schedule=snapshot "
                         "or set optim.cycles=1")
    if o.schedule == "snapshot":
        # the fewest epochs at least as many as asked that both checks below pass: whole cycles longer than the warm-up
        fits = o.cycles * max(1, t.epochs // o.cycles, math.floor(o.warmup_epochs) + 1)
        if t.epochs % o.cycles:
            raise UsageError(f"the snapshot schedule needs train.epochs divisible by optim.cycles, got {t.epochs} "
                             f"epochs and {o.cycles} cycles; use e.g. --epochs {fits}")
        if o.warmup_epochs >= t.epochs // o.cycles:
            raise UsageError(f"optim.warmup_epochs={o.warmup_epochs} leaves no cosine decay in cycles of "
                             f"{t.epochs // o.cycles} epoch(s); make it smaller than train.epochs / optim.cycles, "
                             f"or use e.g. --epochs {fits}")
    if t.epochs < 1:
        raise UsageError(f"epochs must be >= 1, got {t.epochs}; use e.g. --epochs 10")
    if t.checkpoint_every < 0:
        raise UsageError(f"train.checkpoint_every must be >= 0 (0 = no checkpoints), got {t.checkpoint_every}")
    if not t.checkpoint_seconds >= 0:
        raise UsageError(f"train.checkpoint_seconds must be >= 0 (0 = every due epoch), got {t.checkpoint_seconds}")
    if t.unroll < 0:
        raise UsageError(f"train.unroll must be >= 0 (0 = auto), got {t.unroll}")
    if t.replica_threads < 0:
        raise UsageError(f"train.replica_threads must be >= 0 (0 = auto: one per CPU core), got {t.replica_threads}; "
                         "use e.g. --set train.replica_threads=2")
    if t.epoch_shape not in EPOCH_SHAPES:
        raise UsageError(f"unknown train.epoch_shape '{t.epoch_shape}'; use auto, scan or step")
    if t.batch_size < 1:
        raise UsageError(f"batch sizes must be >= 1, got {t.batch_size}; use e.g. --batch-size 128")
    if t.eval_batch_size < 1:  # it used to say "got <train.batch_size>; use --batch-size"
        raise UsageError(f"train.eval_batch_size must be >= 1, got {t.eval_batch_size}; use e.g. "
                         "--set train.eval_batch_size=500")
    if s.replicas < 1:
        raise UsageError(f"replicas must be >= 1, got {s.replicas}; use e.g. --replicas 8")
    if not SEED_RANGE[0] <= s.seed <= SEED_RANGE[1]:
        raise UsageError(f"study.seed must be in {SEED_RANGE[0]} .. {SEED_RANGE[1]} (jax.random.key keeps only a "
                         f"seed's low 32 bits), got {s.seed}; use a seed in that range")
    if s.eval_every < 0:
        raise UsageError(f"study.eval_every must be >= 0 (0 = off), got {s.eval_every}; fix --set study.eval_every")
    if s.dynamics_every < 0:
        raise UsageError(f"study.dynamics_every must be >= 0 (0 = off), got {s.dynamics_every}")
    if s.strategy not in STRATEGIES:
        raise UsageError(f"unknown strategy '{s.strategy}'; choose one of: {', '.join(STRATEGIES)}")
    if s.hardware_processes not in HARDWARE_PROCESSES:
        raise UsageError(f"study.hardware_processes must be one of {', '.join(HARDWARE_PROCESSES)}, got "
                         f"'{s.hardware_processes}'; use --set study.hardware_processes=replica")
    mc = config.metrics
    if len(set(mc.tta)) != len(mc.tta):  # as duplicate arms are refused: the report would list it twice
        twice = next(v for v in mc.tta if mc.tta.count(v) > 1)
        raise UsageError(f"metrics.tta lists '{twice}' twice in {','.join(mc.tta)}; list each view set once")
    _validate_pairs(config)
    if mc.lmc_pairs < 0 or mc.lmc_points < 2 or mc.bn_examples < 1:
        raise UsageError("metrics.lmc_pairs must be >= 0, metrics.lmc_points >= 2 and metrics.bn_examples >= 1")
    if not s.arms:
        raise UsageError("no arms given; use e.g. --arms control,init,all")
    if len(set(s.arms)) != len(s.arms):
        raise UsageError(f"arm listed twice in {','.join(s.arms)}; list each arm once")
    for arm in s.arms:
        parsed = arms.parse_arm(arm)  # raises UsageError for unknown names
        if parsed.cycles:
            arm_config(config, parsed)  # the variant's schedule must fit, e.g. epochs divisible by K
    _validate_decomposition(config)
    _validate_instruments(config)


def _validate_pairs(config: Config) -> None:
    """What compares replicas two at a time needs two of them."""
    s = config.study
    if config.metrics.pairwise and s.replicas < 2:
        raise UsageError(f"pairwise metrics need at least 2 replicas, got {s.replicas}; use --replicas 2 or more "
                         "or --set metrics.pairwise=false")
    if s.dynamics_every and s.replicas < 2:  # it watches replicas 0 and 1: with one, nothing was traced, silently
        raise UsageError(f"study.dynamics_every watches replicas 0 and 1 of each arm, which needs at least 2 replicas, "
                         f"got {s.replicas}; use --replicas 2 or more or --set study.dynamics_every=0")


def _validate_decomposition(config: Config) -> None:
    """metrics.decomposition needs the all arm and a one-source arm: without them the report left it out, silently."""
    gap = config.metrics.decomposition and arms.decomposition_gap(config.study.arms)
    if gap:
        raise UsageError(f"metrics.decomposition needs {gap} in study.arms, got {','.join(config.study.arms)}; use e.g. "
                         "--arms init,data_order,all, or leave metrics.decomposition off")


def _validate_numbers(config: Config) -> None:
    """Every numeric key finite (floats) and representable in int32 (ints): checked for configs
    built from any source (flags, files, ``config.json``, the API's dataclasses)."""
    for section in dataclasses.fields(config):
        values = getattr(config, section.name)
        for f in dataclasses.fields(values):
            v, key = getattr(values, f.name), f"{section.name}.{f.name}"
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                continue
            if isinstance(v, float) and not math.isfinite(v):
                raise UsageError(f"config key '{key}' got {v!r}, which is not a finite number; fix the value")
            if key != "study.seed" and abs(v) > INT_MAX:
                raise UsageError(f"config key '{key}' got {v!r}, beyond the largest supported value {INT_MAX}; "
                                 "fix the value")


def _validate_instruments(config: Config) -> None:

    ic, o = config.instruments, config.optim
    try:
        names = configurations.resolve(ic.config)
    except ValueError as e:
        raise UsageError(f"{e} (--instruments / instruments.config)") from None
    if not names and ic.config != "none":  # the trainers read exactly "none" as off
        raise UsageError(f"--instruments / instruments.config {ic.config!r} names no quantity; use none to track "
                         "nothing, or a configuration (economy, business, full) or quantity names")
    one = configurations.over_examples(names) if config.train.batch_size < 2 else []
    if one:
        raise UsageError(f"{', '.join(one)} need a batch of at least 2 examples (variances over its examples), got "
                         f"--batch-size {config.train.batch_size}; use --batch-size 2 or more, or drop them from "
                         "instruments.config")
    if ic.schedule not in ("linear", "log"):
        raise UsageError(f"unknown instruments.schedule '{ic.schedule}'; choose linear (every k steps) or log")
    if ic.curvature not in configurations.CURVATURES:
        raise UsageError(f"unknown instruments.curvature '{ic.curvature}'; choose ggn or hutchinson")
    if ic.curvature == "hutchinson" and "TICDiag" in names:
        raise UsageError("instruments.curvature=hutchinson cannot give TICDiag (it would divide by an estimate that "
                         "can be <= 0); use instruments.curvature=ggn or leave TICDiag out")
    if ic.per_example not in ("train_pass", "frozen_bn"):
        raise UsageError(f"unknown instruments.per_example '{ic.per_example}'; choose train_pass or frozen_bn")
    for key in ("every", "log_points", "chunk", "hess_iters", "hess_probes"):
        if getattr(ic, key) < 1:
            raise UsageError(f"instruments.{key} must be >= 1, got {getattr(ic, key)}; fix --set instruments.{key}")
    if ic.hess_iters > configurations.MAX_HESS_ITERS:
        raise UsageError(f"instruments.hess_iters must be at most {configurations.MAX_HESS_ITERS} (Lanczos keeps every "
                         f"vector: memory grows as hess_iters x parameters), got {ic.hess_iters}; lower --set "
                         "instruments.hess_iters and read HessMaxEVResidual for the error")
    if ic.norms not in ("auto", "ghost", "materialise"):
        raise UsageError(f"unknown instruments.norms '{ic.norms}'; choose auto, ghost or materialise")
    if ic.hess_tol < 0:
        raise UsageError(f"instruments.hess_tol must be >= 0 (0 = off), got {ic.hess_tol}; fix --set instruments.hess_tol")
    plain = [q for q in names if q in configurations.PLAIN_SGD_ONLY]
    if plain and user_optimizer(o):  # a chain's learning rate and plainness cannot be read off it
        raise UsageError(f"{' and '.join(plain)} assume{'s' * (len(plain) == 1)} plain SGD with the config's learning rate, which your own "
                         "optimizer does not give; drop them from instruments.config or use the config's optimiser")
    if plain and (o.name != "sgd" or o.momentum != 0 or o.nesterov or o.weight_decay != 0):
        raise UsageError(f"{' and '.join(plain)} assume{'s' * (len(plain) == 1)} plain SGD, as in Cockpit; use --set optim.name=sgd "
                         "--set optim.momentum=0 --set optim.weight_decay=0, or drop them from instruments.config")
