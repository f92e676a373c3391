"""Blocks of an arm's replicas trained apart, kept as parts and merged into one arm.

Three things train an arm's replicas in blocks: the processes of a multi-process run (one block
each, :mod:`nondet_jax.study.multihost`), a ``hardware`` arm trained one fresh process per replica
(:mod:`nondet_jax.study.hardware`), and a sequential study of methods, whose every look adds a block
(``grow`` in :func:`nondet_jax.study.runner.run`). Each block is one part,
``parts/<arm>/<first replica>.npz``: the block's :class:`~nondet_jax.replicas.loop.ArmResult` as plain
arrays (no pickles) with the block's replicas, its keys' fingerprint, the study's identity and the XLA flags
it trained under. A part is read back only when those match the block this study would train there, so a
part another study left (or one planted) is never merged, nor one whose kernels differ (XLA_FLAGS, or the
flags the sweep sets for the CPU type, changed between looks: an arm would mix two arithmetics). Replica r's
training does not depend on its block (its keys are ``fold_in`` of its index), so a merged arm equals one
trained whole under the same strategy; the per-epoch weight distances between replicas need every replica's
state at every epoch, so a merged arm has them at initialisation and at the end only (NaN in between).
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
from flax import traverse_util

from nondet_jax.errors import UsageError
from nondet_jax.machine.xla_flags import kernel_flags
from nondet_jax.replicas.choice import make_strategy
from nondet_jax.replicas.loop import ArmResult, _distances
from nondet_jax.sources import Arm, arm_keys, perturbations
from nondet_jax.store.checkpoint import key_fingerprint
from nondet_jax.store.io import atomic_write_bytes, npz_bytes
from nondet_jax.train import Health, TrainState

SEP = "::"  # key separator in part files ('/' occurs inside instrument names)
META = ("first", "stop", "keys_sha256", "identity_sha256", "xla_flags")


def _flat(prefix: str, tree) -> dict[str, np.ndarray]:
    if tree is None:
        return {}
    if isinstance(tree, dict):
        return {SEP.join((prefix,) + k): np.asarray(v) for k, v in traverse_util.flatten_dict(tree).items()}
    return {prefix: np.asarray(tree)}


def _tree(arrays: dict[str, np.ndarray], prefix: str):
    sub = {tuple(k.split(SEP)[1:]): v for k, v in arrays.items() if k.split(SEP)[0] == prefix}
    return traverse_util.unflatten_dict(sub) if sub else {}


def block_meta(seed: int, arm: Arm, block: range, identity: str, flags: str | None = None) -> dict:
    """What a part of ``block`` must carry to be merged into ``arm`` of the study ``identity``: with the
    ``XLA_FLAGS`` it trains under (default: this process's), as :func:`~nondet_jax.machine.xla_flags.kernel_flags`."""
    return {"first": block.start, "stop": block.stop, "identity_sha256": identity,
            "keys_sha256": key_fingerprint(arm_keys(seed, arm.varied, block.stop, first=block.start)),
            "xla_flags": kernel_flags(flags)}


def part_bytes(result, meta: dict) -> bytes:
    """The parts of an ArmResult the merge needs, with ``meta`` (:func:`block_meta`), as npz bytes."""
    arrays = {**_flat("params", result.state.params), **_flat("batch_stats", result.state.batch_stats),
              "diverged_at": np.asarray(result.state.health.diverged_at),
              "last_loss": np.asarray(result.state.health.last_loss),
              "train_loss": result.train_loss, "train_accuracy": result.train_accuracy, "logits": result.logits,
              "features": result.features, "snapshots": result.snapshots, **_flat("steps", result.steps),
              "seconds": np.float64(result.seconds), "strategy": np.array(result.strategy),
              **{f"meta{SEP}{k}": np.array(v) for k, v in meta.items()}}
    return npz_bytes(arrays)


def write_part(store, arm: Arm, result, meta: dict) -> Path:
    """Store a trained block of ``arm`` as ``parts/<arm>/<first>.npz`` (atomically)."""
    path = store.paths.part(arm.name, meta["first"])
    atomic_write_bytes(path, part_bytes(result, meta), root=store.root)
    return path


def _fix(arm: str, path: Path) -> str:
    return (f"rerun with --recompute {arm} (in a study of methods: delete {path.parent}) to train arm '{arm}' "
            "again")


def _read(path: Path, expect: dict, arm: str, meta_only: bool = False) -> dict[str, np.ndarray]:
    """The part's arrays (``meta_only``: none, only the check), refused in one line unless its metadata is
    ``expect``."""
    fix = _fix(arm, path)
    try:
        with np.load(path, allow_pickle=False) as f:
            names = [k for k in f.files if not meta_only or k.startswith(f"meta{SEP}")]
            arrays = {k: f[k] for k in names}
        meta = {k: arrays.pop(f"meta{SEP}{k}").item() for k in META if k != "xla_flags"}
        # a part written before parts carried their flags has none: unknown flags, refused below
        meta["xla_flags"] = arrays.pop(f"meta{SEP}xla_flags").item() if f"meta{SEP}xla_flags" in arrays else None
    except (OSError, ValueError, KeyError, EOFError):
        raise UsageError(f"part {path} is unreadable, truncated or not a part of a block of replicas; {fix}") from None
    differs = {k for k in META if meta[k] != expect[k]}
    if differs == {"xla_flags"}:
        was = "unrecorded flags" if meta["xla_flags"] is None else f"XLA flags '{meta['xla_flags']}'"
        also = "" if meta["xla_flags"] is None else ", or run under the part's flags"
        raise UsageError(f"part {path} (replicas {meta['first']}..{meta['stop'] - 1} of arm '{arm}') was trained "
                         f"under {was}, this run under '{expect['xla_flags']}' (XLA_FLAGS, or the flags the sweep "
                         f"sets for this CPU type and strategy): its kernels differ; {fix}{also}")
    if differs:
        raise UsageError(f"part {path} holds replicas {meta['first']}..{meta['stop'] - 1} of another study or arm "
                         f"(its keys or identity differ from replicas {expect['first']}..{expect['stop'] - 1} of "
                         f"this one); {fix}")
    return arrays


def check_blocks(store, seed: int, arm: Arm, blocks: list[range], flags: str | None = None) -> None:
    """Refuse, before anything is trained, a kept part of ``blocks`` that :func:`merge_blocks` would refuse
    (another study's, or trained under other XLA flags: ``flags`` as in :func:`block_meta`)."""
    for b in blocks:
        _read(store.paths.part(arm.name, b.start), block_meta(seed, arm, b, store.identity, flags), arm.name,
              meta_only=True)


def merge(paths: list[Path], expect: list[dict], arm: str, init_params, parallel: bool = False) -> ArmResult:
    """One ArmResult from the parts at ``paths`` (in replica order), each checked against its ``expect``
    (:func:`block_meta`). ``init_params``: every replica's initial parameters, stacked, for the weight
    distance at initialisation. ``parallel``: the blocks trained at the same time (processes of one run), so
    the arm took the longest block's seconds, not their sum."""
    parts = [_read(p, e, arm) for p, e in zip(paths, expect)]
    cat = {k: np.concatenate([p[k] for p in parts]) for k in parts[0] if k not in ("seconds", "strategy")}
    state = TrainState(_tree(cat, "params"), _tree(cat, "batch_stats"), None,
                       Health(cat["diverged_at"], cat["last_loss"]))
    epochs = cat["train_loss"].shape[1]
    first, last = _distances(init_params), _distances(state.params)
    distances = np.full((epochs + 1, len(first)), np.nan)
    distances[0], distances[-1] = first, last
    return ArmResult(state, cat["train_loss"], cat["train_accuracy"], cat["logits"], cat["features"], distances,
                     str(parts[0]["strategy"]), (max if parallel else sum)(float(p["seconds"]) for p in parts), _tree(cat, "steps"),
                     cat["snapshots"])


def merge_blocks(config, data, fns, store, arm: Arm, blocks: list[range], strategy_name: str,
                 parallel: bool = False, flags: str | None = None) -> ArmResult:
    """The arm whose replicas ``blocks`` (in order, covering ``0..study.replicas-1``) trained as parts
    (:func:`merge`); ``fns``: the arm's own (:func:`nondet_jax.study.arm.arm_setup`); ``flags``: the
    ``XLA_FLAGS`` the blocks trained under, when not this process's (:func:`block_meta`)."""
    study = config.study
    init = make_strategy(fns, strategy_name).init(arm_keys(study.seed, arm.varied, study.replicas),
                                                  perturbations(arm.varied), jax.numpy.asarray(data.x_train[:1]))
    return merge([store.paths.part(arm.name, b.start) for b in blocks],
                 [block_meta(study.seed, arm, b, store.identity, flags) for b in blocks], arm.name, init.params,
                 parallel)


def trained_blocks(store, arm: Arm) -> list[range]:
    """The blocks of ``arm`` already kept as parts, contiguous from replica 0 (a sequential study's looks so
    far), each checked against this study (:func:`block_meta`)."""
    out: list[range] = []
    while (path := store.paths.part(arm.name, out[-1].stop if out else 0)).is_file():
        start = out[-1].stop if out else 0
        try:
            with np.load(path, allow_pickle=False) as f:
                stop = int(f[f"meta{SEP}stop"])
        except (OSError, ValueError, KeyError, EOFError):
            raise UsageError(f"part {path} is unreadable, truncated or not a part of a block of replicas; "
                             f"{_fix(arm.name, path)}") from None
        if stop <= start:
            raise UsageError(f"part {path} claims replicas {start}..{stop - 1}; {_fix(arm.name, path)}")
        out.append(range(start, stop))
    return out
