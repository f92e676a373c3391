"""``python -m nondet_jax.sweep``: train R replicas per arm and write the run folder.

Thin CLI over :mod:`nondet_jax.study.runner` (parse, presets, resume, then :func:`~nondet_jax.study.runner.run`). Every bad input exits with status 2 and a
one-line error naming the problem and the fix; nothing already written is touched.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from importlib import resources
from pathlib import Path
from typing import Callable

from nondet_jax import config as cfg
from nondet_jax.arms import IMPLEMENTED
from nondet_jax.cli import prog_name, sweep_entry
from nondet_jax.config import Config
from nondet_jax.errors import OneLineParser, UsageError
from nondet_jax.machine.determinism import CACHE_ENV, DETERMINISM_ON, start_check, with_flags
from nondet_jax.store.paths import RunPaths, arm_name
from nondet_jax.study import methods

# JAX, flax and scipy (through the study, the report and TensorBoard's export) are imported only once the
# arguments and the config have passed their checks: a refused argument costs the interpreter and the config,
# not JAX's start (benchmarks/cli_startup.py).

FLAGS = cfg.FLAG_KEYS  # CLI flag -> dotted config key


DEFAULT_PRESET = "sources"


def preset_names() -> list[str]:
    """The presets shipped inside the package (``nondet_jax/presets/*.yaml``, package data)."""
    folder = resources.files("nondet_jax") / "presets"
    return sorted(p.name.removesuffix(".yaml") for p in folder.iterdir() if p.name.endswith(".yaml"))


def preset_path(name: str) -> Path:
    """The preset file ``nondet_jax/presets/<name>.yaml``; UsageError naming the presets when absent."""
    if name not in preset_names():  # a name, not a path ('../presets/sources' found a file and ran it)
        hint = "; a file of your own is --config FILE" if "/" in name or name.endswith(".yaml") else ""
        raise UsageError(f"unknown preset '{name}'; choose one of: {', '.join(preset_names())}{hint}")
    return Path(str(resources.files("nondet_jax") / "presets" / f"{name}.yaml"))


def build_parser(prog: str = "python -m nondet_jax.sweep") -> argparse.ArgumentParser:

    p = OneLineParser(prog=prog,
                description="Train R replicas per arm, varying only the arm's randomness sources, and write a run "
                            f"folder. Defaults shown are the {DEFAULT_PRESET} preset's; --preset and --config change "
                            "them, flags and --set override both.")
    p.add_argument("--arms", help=f"comma list: control (nothing varies), a source ({', '.join(IMPLEMENTED)}, "
                                  "hardware: the backend's own nondeterminism), a+b combination, all (every seeded "
                                  "source), all+hardware; ARM@snapshotK (K >= 2) trains ARM as a K-cycle snapshot "
                                  "ensemble")
    p.add_argument("--replicas", type=int, help="replicas per arm (R)")
    p.add_argument("--epochs", type=int, help="training epochs")
    p.add_argument("--model", help="mlp, resnet8/14/20/32/56, resnet18, resnet18_imagenet, resnet50, resnet29v2, "
                                   "vgg11, shufflenetv2, or your own Flax module as PACKAGE.MODULE:ATTR (a class or "
                                   "factory taking num_classes=, imported from PYTHONPATH; see docs/api.md)")
    p.add_argument("--width", type=float, help="width multiplier")
    p.add_argument("--dropout", type=float, help="dropout rate before the classifier")
    p.add_argument("--dataset", help="digits (embedded), cifar10, mnist, fashion_mnist, imagenette, imagenet2012 (TFDS, "
                                     "prepared in --data-dir; see docs/data.md), or your own arrays as PATH.npz "
                                     "holding x_train, y_train, x_test, y_test (images NHWC or (N, features))")
    p.add_argument("--data-dir", help="TFDS data directory")
    p.add_argument("--augment", help="auto (on for cifar10), on, off, or your own (key, x_batch) -> x_batch function "
                                     "as PACKAGE.MODULE:ATTR")
    p.add_argument("--batch-size", type=int, help="mini-batch size per replica and step")
    p.add_argument("--optimizer", help="sgd, adamw, or your own optax optimiser as PACKAGE.MODULE:ATTR (a "
                                       "GradientTransformation, or a function of no arguments returning one; its "
                                       "learning rate is its own, --lr and optim.* do not apply)")
    p.add_argument("--loss", help="default (softmax cross-entropy; squared error for regression) or your own "
                                  "per-example (outputs, labels) -> losses function as PACKAGE.MODULE:ATTR")
    p.add_argument("--init-from", help="fine-tuning: a .npz of parameters every replica starts from (PATH.npz, or "
                                       "PATH.npz@R: replica R of a run folder's weights/<arm>.npz); the init source "
                                       "draws only the parameters it does not hold")
    p.add_argument("--features", help="your model's submodule whose output CKA compares, when it has no "
                                      "return_features (default: the logits)")
    p.add_argument("--lr", type=float, help="peak learning rate")
    p.add_argument("--seed", type=int, help="study seed (root of every key)")
    p.add_argument("--instruments", help="Cockpit's quantities per step and replica: economy, business, full, or "
                                         "quantity names (e.g. Loss,HessMaxEV); see instruments.every/schedule")
    p.add_argument("--strategy", help="auto, vmap, sequential, unrolled (the replicas in one program) or sharded (replicas over the devices)")
    p.add_argument("--out", help="run folder (default: runs/<dataset>-<model>-<config hash>)")
    p.add_argument("--preset", help=f"a study shipped with the package: {', '.join(preset_names())} (default: "
                                    f"{DEFAULT_PRESET})")
    p.add_argument("--config", help="YAML or JSON file of config keys (sections or dotted keys), applied after the preset")
    p.add_argument("--set", action="append", default=[], nargs="+", metavar="KEY=VALUE",
                   help="override any config key, e.g. --set optim.nesterov=true or --set optim.lr 0.1 "
                        "(repeatable; keys: docs/cli.md)")
    p.add_argument("--method", action="append", default=[], metavar="NAME:KEY=VALUE[,KEY=VALUE...]",
                   help="a method of a study of methods (repeatable; at least two): config keys replacing the study's "
                        "for that method, e.g. --method base: --method lr2:optim.lr=0.2. Every method runs the same "
                        "arms, replicas and seed, so replica r of each is paired with replica r of the others; OUT "
                        "holds methods/NAME/ per method and a report comparing each with the baseline")
    p.add_argument("--batch-methods", action="store_true",
                   help="train the methods that differ only in optim.lr, optim.momentum or optim.weight_decay together, "
                        "the hyper-parameters per replica, in one program per arm (results equal to each method alone "
                        "up to float rounding; no mid-arm checkpoints)")
    p.add_argument("--baseline", metavar="NAME", help="the method the others are compared with (default: the first "
                   "--method)")
    p.add_argument("--until", metavar="decided|decided=D|width=X",
                   help="a sequential study of methods: train --replicas per method, then 4 more at each look, until "
                        "every method's difference from the baseline is decided (its interval at the look's level excludes 0; "
                        "decided=D: or lies inside ±D) or every interval is at most X wide (width=X), in the score's "
                        "units; a difference that is not there is decided in at most 5%% of studies (calibrated by simulation)")
    p.add_argument("--max-replicas", type=int, metavar="N",
                   help="with --until: the most replicas per method (default: 4x --replicas, at most 1024)")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue the study in RUN_DIR with the config stored there "
                   "(finished arms are kept, an arm in training continues from its last checkpoint)")
    p.add_argument("--recompute", metavar="ARMS", help="comma list of arms whose results (and checkpoints) are "
                   "deleted and trained again, e.g. after a corrupt-file error")
    p.add_argument("--compile-cache", metavar="DIR", help="JAX's persistent compilation cache: a folder, or 'off' "
                   f"(default: ${CACHE_ENV} or {default_cache_dir()})")
    p.add_argument("--coordinator", metavar="HOST:PORT", help="multi-process run: address of process 0 "
                   "(with --num-processes and --process-id; see nondet_jax.study.multihost)")
    p.add_argument("--num-processes", type=int, help="multi-process run: number of processes")
    p.add_argument("--process-id", type=int, help="multi-process run: this process's index, 0 .. N-1")
    p.add_argument("--distributed", choices=["auto"], help="multi-process run with the cluster's settings detected "
                   "by jax.distributed.initialize (Slurm, Open MPI, Cloud TPU)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar even on a terminal")
    p.add_argument("--log", choices=["tensorboard"], help="also write TensorBoard event files, one run per replica, "
                   "into OUT/tensorboard as each arm finishes (needs tensorboardX: pip install "
                   "\"nondet_jax[tensorboard]\"); view with tensorboard --logdir OUT/tensorboard")
    p.add_argument("--child-arm", help=argparse.SUPPRESS)
    _show_defaults(p)
    return p


def _show_defaults(parser: argparse.ArgumentParser) -> None:
    """Append the default preset's value to the help of each flag that sets a config key."""
    flat = cfg.to_dict(cfg.from_flat(cfg.load_file(preset_path(DEFAULT_PRESET))))
    for action in parser._actions:
        key = FLAGS.get(action.dest)
        if key is None:
            continue
        section, name = key.split(".")
        value = flat[section][name]
        if value is None:
            continue
        shown = ", ".join(value) if isinstance(value, list) else value
        action.help = f"{action.help + ' ' if action.help else ''}(default: {shown})"


def set_pairs(groups: list[list[str]]) -> list[str]:
    """``--set`` words as ``KEY=VALUE`` items: each ``--set`` takes ``KEY=VALUE`` items or ``KEY VALUE`` pairs."""
    out = []
    for words in groups:
        words = list(words)
        while words:
            word = words.pop(0)
            if "=" in word:
                out.append(word)
            elif words and "=" not in words[0]:
                out.append(f"{word}={words.pop(0)}")
            else:
                raise UsageError(f"--set {word} has no value; write --set {word}=VALUE or --set {word} VALUE")
    return out


def _preset_keys(args: argparse.Namespace) -> dict:
    """The keys of the preset (default: sources unless --config is given)."""
    preset = args.preset or (None if args.config else DEFAULT_PRESET)
    return cfg.load_file(preset_path(preset)) if preset else {}


def _file_keys(args: argparse.Namespace) -> dict:
    """The keys of the preset (default: sources unless --config is given), then --config."""
    flat = _preset_keys(args)
    if args.config:
        flat.update(cfg.load_file(args.config))
    return flat


# a preset's flips are chosen for its own data set (digits: none, a mirrored digit is another symbol); for another
# data set they are that set's default (CIFAR-10: flips). Its crops stay on: its arms include `augmentation`
DATA_BOUND_KEYS = ("data.flip",)


def _data_bound(preset: dict, flat: dict, chosen: set) -> dict:
    """``flat`` without the preset's :data:`DATA_BOUND_KEYS` when the study's data set is not the preset's and
    nothing but the preset chose them."""
    name = cfg.from_flat({k: v for k, v in preset.items() if k == "data.name"}).data.name
    if flat.get("data.name", name) == name:
        return flat
    return {k: v for k, v in flat.items() if k not in DATA_BOUND_KEYS or k in chosen}


def config_from_args(args: argparse.Namespace) -> Config:
    """Preset (default: sources unless --config is given), then --config, then flags, then --set (a file's
    ``methods:`` and ``baseline:`` are :func:`methods_from_args`'s)."""
    preset, from_file = _preset_keys(args), cfg.load_file(args.config) if args.config else {}
    flat = {**preset, **from_file}
    methods.from_file(flat)
    overrides = cfg.parse_overrides(set_pairs(args.set))
    for flag, key in FLAGS.items():
        value = getattr(args, flag)
        if value is None:
            continue
        if key in overrides and not cfg.same_setting(key, value, overrides[key]):
            raise UsageError(f"--{flag.replace('_', '-')} {value} and --set {key}={overrides[key]} disagree; give one")
        flat[key] = value
    flat.update(overrides)
    given = {key: f"--{flag.replace('_', '-')}" for flag, key in FLAGS.items() if getattr(args, flag) is not None}
    flat = _data_bound(preset, flat, set(from_file) | set(given) | set(overrides))
    name = flat.get("data.name")
    if isinstance(name, str) and name.endswith(".npz") and not os.path.isabs(name):
        flat["data.name"] = os.path.abspath(name)  # config.json's path then resumes from any directory
    config = cfg.from_flat(flat)
    cfg.refuse_optim_settings({k: h for k, h in {**given, **{k: "--set" for k in overrides}}.items()
                               if k != "optim.name"}, config.optim)  # the name chooses the optimizer: not ignored
    return config


def methods_from_args(args: argparse.Namespace, config: Config) -> tuple[list, str] | None:
    """The study's methods, checked (:func:`nondet_jax.study.methods.plan`): the ``--method`` flags, else the
    preset's or --config file's ``methods:`` section; ``--baseline`` or the file's ``baseline:``. None for a
    study of one method."""
    named, file_baseline = methods.from_file(_file_keys(args)) if not args.resume else ({}, None)
    if args.method:
        parsed = [methods.parse_method(spec) for spec in args.method]
        methods.duplicate_check([name for name, _ in parsed])
        named = dict(parsed)
    baseline = args.baseline or (file_baseline if not args.method else None)
    if not named:
        if args.baseline or args.batch_methods or args.until or args.max_replicas is not None:
            option = (f"--baseline {args.baseline}" if args.baseline else "--batch-methods" if args.batch_methods
                      else f"--until {args.until}" if args.until else f"--max-replicas {args.max_replicas}")
            raise UsageError(f"{option} is for a study of methods, and there are none; add --method NAME:KEY=VALUE for "
                             f"each (at least two), or drop {option.split()[0]}")
        return None
    for option, given in (("--resume", args.resume), ("--recompute", args.recompute),
                          ("--num-processes", args.num_processes), ("--distributed", args.distributed)):
        if given:
            fix = {"--resume": "rerun the same command to resume a study of methods",
                   "--recompute": "to train arms of one method again, run --resume OUT/methods/NAME --recompute ARMS"
                   }.get(option, "train the methods one by one, each with its own --out")
            raise UsageError(f"{option} cannot be combined with --method (a study of methods); {fix}")
    return methods.plan(config, named, baseline)


def until_from_args(args: argparse.Namespace, config: Config):
    """The sequential design of a study of methods (:func:`nondet_jax.analysis.sequential.parse`), checked
    before JAX starts; None without ``--until``."""
    if args.until is None:
        if args.max_replicas is not None:
            raise UsageError(f"--max-replicas {args.max_replicas} is for a sequential study; add --until decided (or "
                             "width=X), or drop --max-replicas")
        return None
    if args.batch_methods:
        raise UsageError("--batch-methods trains every method's replicas at once, which a sequential study (--until) "
                         "adds look by look; drop one of them")
    from nondet_jax.until import check_arms, parse

    design = parse(args.until, args.max_replicas, config.study.replicas)
    check_arms(config.study.arms)
    return design


# Config keys whose PACKAGE.MODULE:ATTR value is imported (and run), by the flag that sets each.
REFERENCES = {"model": "model.name", "optimizer": "optim.name", "loss": "train.loss", "augment": "data.augment"}


def config_for_resume(args: argparse.Namespace, log=print) -> Config:
    """The config stored in ``--resume RUN_DIR``; settings given with it would change the study. The
    flags naming code (``--model``, ``--optimizer``, ``--loss``, ``--augment``) may repeat the folder's
    own value: that is how a user vouches for code the folder names (see :func:`check_references`)."""
    given = [f"--{f.replace('_', '-')}" for f in (*FLAGS, "preset", "config", "out")
             if getattr(args, f) is not None and f not in REFERENCES]
    if given or args.set:
        raise UsageError(f"--resume takes its settings from the run folder, so {(given or ['--set'])[0]} cannot be "
                         "combined with it; drop it, or start a new study with --out")
    path = RunPaths(args.resume).config
    try:
        if path.exists() and not path.is_file():  # a FIFO would block the read; a folder is no config
            raise ValueError("not a file")
        stored = cfg.loads_json(path.read_text(), path)
    except FileNotFoundError:
        if RunPaths(args.resume).methods_json.exists():
            raise UsageError(f"--resume {args.resume} is a study of methods; rerun the command that made it (its "
                             "methods resume one by one), or --resume one method's folder "
                             f"{RunPaths(args.resume).root / 'methods' / 'NAME'}") from None
        raise UsageError(f"--resume {args.resume} is not a nondet_jax run folder (no config.json); pass the --out "
                         "folder of an earlier sweep") from None
    except (OSError, ValueError):  # JSONDecodeError and UnicodeDecodeError (a binary file) are ValueErrors
        raise UsageError(f"{path} is unreadable or corrupt; start a new study with --out") from None
    if not isinstance(stored, dict):
        raise UsageError(f"{path} holds a JSON {type(stored).__name__}, not a study's config; start a new study "
                         "with --out")
    for section, values in stored.items():
        if not isinstance(values, dict):
            raise UsageError(f"{path} section {section!r} holds a JSON {type(values).__name__}, not a table of "
                             "settings; restore the file, or start a new study with --out")
    arms = stored.get("study", {}).get("arms") if isinstance(stored.get("study"), dict) else None
    if isinstance(arms, list):  # named by the folder: checked as the folder's, before the config's own checks
        for arm in arms:
            arm_name(arm, f"{path} study.arms")
    config = cfg.from_dict(stored)
    for line in check_references(config, Path(args.resume), {f: getattr(args, f) for f in REFERENCES}):
        log(line)
    return config


def _module_places(top: str) -> list[Path]:
    """Where ``import top`` would load from (its file, or a package's folders), located without importing
    it (``importlib.util.find_spec`` of a top-level name runs no code); [] when it is not importable."""
    import importlib.util

    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return []
    if spec is None:
        return []
    places = [spec.origin] if spec.origin and spec.origin not in ("built-in", "frozen") else []
    places += list(spec.submodule_search_locations or [])
    return [Path(p).resolve() for p in places]


def check_references(config: Config, run: Path, given: dict[str, str | None]) -> list[str]:
    """``--resume`` imports nothing the folder's config names (``PACKAGE.MODULE:ATTR`` in
    :data:`REFERENCES`) unless the user gave the same reference on the command line, or its module is
    importable from an installed package outside the run folder and the current directory (resumed
    from inside a shared folder, the current directory is on ``sys.path``, and a ``module.py`` planted
    there would be imported and run). Located without importing. Returns one line per reference saying
    which of the two let it be imported; UsageError for any other."""
    lines = []
    root, here = run.resolve(), Path.cwd().resolve()
    for flag, key in REFERENCES.items():
        section, name = key.split(".")
        value = getattr(getattr(config, section), name)
        option = f"--{flag}"
        if given.get(flag) is not None and given[flag] != value:
            raise UsageError(f"{option} {given[flag]} differs from the run folder's {key} {value}; --resume takes "
                             f"its settings from the folder: drop {option}, or start a new study with --out")
        if not cfg.imported(value):
            continue
        if given.get(flag) == value:
            lines.append(f"--resume: {key} {value} is imported because you gave {option} {value}")
            continue
        top = value.partition(":")[0].split(".")[0]
        places = _module_places(top) if top.isidentifier() else []
        inside = next((p for p in places if p == root or root in p.parents), None)
        local = next((p for p in places if p.parent == here), None)  # here/top.py or the package here/top/
        if inside is not None or local is not None or not places:
            where = (f"would be imported from inside the run folder ({inside})" if inside is not None else
                     f"would be imported from the current directory ({local})" if local is not None else
                     "is not an installed package")
            raise UsageError(f"{RunPaths(run).config} names {key} {value}, whose module '{top}' {where}; --resume "
                             "imports code a run folder names only from an installed package outside the folder and "
                             f"the current directory, or when you give the same reference: add {option} {value} "
                             "if you trust it")
        lines.append(f"--resume: {key} {value} is imported from {places[0]} (installed outside the run folder and "
                     "the current directory)")
    return lines


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "nondet_jax" / "jax"


def enable_compile_cache(setting: str | None) -> Path | None:
    """Turn on JAX's persistent compilation cache (every program, however quick to compile), so a
    second identical run, or an arm's child process, compiles nothing new. Returns the folder."""
    setting = setting or os.environ.get(CACHE_ENV) or str(default_cache_dir())
    if setting.lower() == "off":
        return None
    folder = Path(setting).expanduser()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"cannot create the compilation cache folder {folder}: {e.strerror}; pass "
                         "--compile-cache DIR with a writable folder, or --compile-cache off") from None
    import jax

    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    os.environ[CACHE_ENV] = str(folder)  # the processes started for hardware arms use it too
    return folder


def cpu_strategy(config: Config, planned: tuple[list, str] | None = None) -> str | None:
    """The strategy the study runs where its backend is the CPU (``auto`` resolved by the CPU's measured rule),
    for the CPU flags' rule (:func:`nondet_jax.machine.xla_flags.cpu_defaults`), which is process-wide: with
    methods (``planned``) that resolve to different strategies, None (no strategy's rule may hold for all)."""
    from nondet_jax.replicas.rule import resolve_strategy

    configs = [config, *(cfg.from_flat(m.settings, config) for m in (planned[0] if planned else []))]
    chosen = {resolve_strategy(c.study.strategy, c.study.replicas, "cpu")[0] for c in configs}
    return chosen.pop() if len(chosen) == 1 else None


def main(argv: list[str] | None = None, prog: str | None = None) -> int:

    prog = prog or prog_name("nondet_jax.sweep", "nondet-jax-sweep")
    args = build_parser(prog).parse_args(argv)
    progress = False if args.no_progress else None
    try:
        if args.child_arm:  # the parent's choice of CPU flags arrives in the XLA_FLAGS it inherits
            enable_compile_cache(args.compile_cache)
            from nondet_jax.study import child

            return child.train_arm_child(args.out, args.child_arm, progress if progress is not None else sys.stderr.isatty())
        if args.resume:
            config = config_for_resume(args)
            args.out = args.resume
        else:
            config = config_from_args(args)
        planned = methods_from_args(args, config)
        until = until_from_args(args, config)
        # this CPU type's measured flags for the strategy the study runs, before JAX starts (environment.json says)
        from nondet_jax.machine import xla_flags

        xla_flags.apply_cpu_defaults(strategy=cpu_strategy(config, planned))
        enable_compile_cache(args.compile_cache)  # JAX starts here, once the arguments and the config are good
        # the determinism flags are checked in a child process while this one imports the study (not starting JAX's
        # backend); they are set once they are known good
        determinism = set_determinism_flags() if config.study.xla_determinism else (lambda: None)
        command = prog + "".join(f" {os.fsencode(a).decode('utf-8', 'backslashreplace')}"  # as UTF-8 text
                                 for a in (argv if argv is not None else sys.argv[1:]))
        t0 = time.perf_counter()
        recompute = tuple(a.strip() for a in (args.recompute or "").split(",") if a.strip())
        from nondet_jax.study import multihost, runner

        determinism()
        after_arm = tensorboard_logger() if args.log == "tensorboard" else None
        procs = multihost.initialize(args.coordinator, args.num_processes, args.process_id, args.distributed == "auto")
        if planned is not None:
            def run_one(m, folder, replicas=None):
                own = cfg.from_flat(m.settings, config)
                if replicas is not None:
                    own = cfg.from_flat({"study.replicas": replicas}, own)
                return runner.run(own, folder, progress=progress, command=f"{command}  (method {m.name})",
                                  after_arm=after_arm, grow=replicas is not None)

            def batch(out):
                from nondet_jax.study.batched import train_batched

                train_batched({m.name: cfg.from_flat(m.settings, config) for m in planned[0]},
                              {m.name: m.parts for m in planned[0]}, out, command=command)

            methods.run_methods(config, *planned, args.out, run_one=run_one, command=command,
                                batch=batch if args.batch_methods else None, until=until)
        else:
            runner.run(config, args.out, progress=progress, command=command, recompute=recompute, after_arm=after_arm,
                       procs=procs)
        print(f"done in {time.perf_counter() - t0:.0f} s")
    except UsageError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: finished arms are kept in the run folder; rerun the same command to resume",
              file=sys.stderr)
        return 130
    except RuntimeError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 1
    return 0


def tensorboard_logger():
    """``after_arm`` for ``--log tensorboard``: exports each stored arm; UsageError now (before any training)
    when tensorboardX is missing."""
    from nondet_jax.report import tensorboard

    tensorboard.writer_class()

    def after_arm(out, arm: str) -> None:
        print(f"arm {arm}: TensorBoard event files in {tensorboard.export_arm(out, arm)}")

    return after_arm


def set_determinism_flags() -> Callable[[], None]:
    """Start checking XLA's determinism flags against the installed jaxlib (:func:`start_check`); the returned
    call waits for the check and puts them into this process's XLA_FLAGS, so that arms run here are deterministic
    on GPU too (only ``hardware`` arms run without them). Call it before JAX's backend starts."""
    flags = with_flags(DETERMINISM_ON)
    if flags == os.environ.get("XLA_FLAGS", ""):
        return lambda: None
    wait = start_check(DETERMINISM_ON)

    def apply() -> None:  # importing the study starts no backend (tests/test_determinism.py), so they hold here
        wait()
        os.environ["XLA_FLAGS"] = flags

    return apply


def entry() -> int:
    """``python -m nondet_jax.sweep`` (see :func:`nondet_jax.cli.sweep_entry`)."""
    return sweep_entry()


if __name__ == "__main__":
    sys.exit(entry())
