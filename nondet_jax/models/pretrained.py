"""Starting every replica from given weights (fine-tuning): ``init_params``.

A study's replicas normally draw all their weights from their ``init`` key. With ``init_params`` (a
nested dict of arrays, a subset of the model's params: a pre-trained body without its head, say) every
replica starts from those values, and the ``init`` key draws only the parameters ``init_params`` does not
hold; ``bitflip`` then moves one weight of the result, so within the given weights too.

Example::

    pre = load_params("runs/pretrain/weights/control.npz", replica=0)   # a run folder's weights file
    pre.pop("head")                                                      # a new head for the new task
    nj.run_study(model=..., init_params=pre, arms="control,init,data_order")
"""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from nondet_jax.errors import UsageError
from nondet_jax.machine.memory import check_npz_sizes


class Given:
    """``init_params`` as a study holds them: the tree and its :func:`fingerprint`, hashable and equal by
    content (the training functions are cached by their parts)."""

    __slots__ = ("tree", "sha256")

    def __init__(self, tree: dict):
        self.tree, self.sha256 = tree, fingerprint(tree)

    def __hash__(self) -> int:
        return hash(self.sha256)

    def __eq__(self, other) -> bool:
        return isinstance(other, Given) and other.sha256 == self.sha256

    def __repr__(self) -> str:
        return f"Given({len(flat(self.tree))} parameters, sha256 {self.sha256[:12]})"


def as_given(init_params) -> Given | None:
    """``init_params`` (None, a params tree, a ``.npz`` path, or :class:`Given`) as a :class:`Given`."""
    if init_params is None or isinstance(init_params, Given):
        return init_params
    if isinstance(init_params, (str, Path)):
        return Given(load_params(init_params))
    return Given(init_params)


def _tree(x):
    return x.tree if isinstance(x, Given) else x


def flat(tree) -> dict[str, np.ndarray]:
    """``'/'``-joined leaf paths of a nested dict of arrays (or of a :class:`Given`'s)."""
    tree = _tree(tree)
    if not isinstance(tree, dict):
        raise UsageError(f"init_params must be a nested dict of arrays (a params tree), got {type(tree).__name__}")
    return traverse_util.flatten_dict(tree, sep="/")


def load_params(path: str | Path, replica: int | None = None) -> dict:
    """A params tree from a ``.npz`` of ``'/'``-joined keys (a leading ``params/`` is dropped; other
    collections, ``batch_stats/...``, are left out) or from an orbax checkpoint folder (a saved params
    tree, or a tree holding one under ``params``): a run folder's ``weights/<arm>.npz`` holds every
    replica along a leading axis, so name one with ``replica``."""
    path = Path(path)
    if path.is_dir():
        return _orbax_params(path, replica)
    params = load_collection(path, "params", replica)
    if not params:
        raise UsageError(f"{path} holds no parameters (keys like params/Dense_0/kernel); pass a params .npz")
    return params


def load_collection(path: Path, collection: str, replica: int | None = None) -> dict:
    """One collection (``params``, ``batch_stats``) of a ``.npz`` of ``'/'``-joined keys as a tree ({} when it
    holds none); keys without a collection prefix count as ``params`` when no key has the prefix. With
    ``replica``: that index of every array's leading axis (a run folder's weights file)."""
    check_npz_sizes(str(path), f"parameters file {path}")  # a header claiming terabytes: MemoryError in np.load
    try:
        z = np.load(path, allow_pickle=False)
        if not isinstance(z, np.lib.npyio.NpzFile):  # one array (a .npy named .npz): no names, no context manager
            raise ValueError("it holds one unnamed array (a .npy file), not named parameters")
        with z:
            arrays = {k: z[k] for k in z.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:  # a truncated zip is a BadZipFile
        raise UsageError(f"cannot read parameters from {path}: {e or type(e).__name__}; pass a .npz of '/'-joined "
                         "parameter names") from None
    prefix = collection + "/"
    if any(k.startswith(prefix) for k in arrays):
        tree = {k.removeprefix(prefix): a for k, a in arrays.items() if k.startswith(prefix)}
    elif collection == "params":
        tree = {k: a for k, a in arrays.items() if not k.startswith("batch_stats/")}
    else:
        tree = {}
    if replica is not None and tree:
        n = {a.shape[0] if a.ndim else 0 for a in tree.values()}
        if len(n) != 1 or not 0 <= replica < n.pop():
            raise UsageError(f"{path}: replica {replica} is not on the leading axis of its arrays; pick one of "
                             f"0 .. {min(a.shape[0] if a.ndim else 0 for a in tree.values()) - 1}")
        tree = {k: a[replica] for k, a in tree.items()}
    return traverse_util.unflatten_dict(tree, sep="/")


def _orbax_params(path: Path, replica: int | None) -> dict:
    import orbax.checkpoint as ocp

    try:
        tree = ocp.StandardCheckpointer().restore(path.resolve())
    except Exception as e:  # orbax raises many kinds for a folder that is not its checkpoint
        raise UsageError(f"cannot read init params {path}: not an orbax checkpoint ({type(e).__name__}: "
                         f"{str(e).splitlines()[0][:120] if str(e) else 'no detail'}); pass a checkpoint folder or a "
                         ".npz") from None
    tree = tree.get("params", tree) if isinstance(tree, dict) else tree
    if replica is not None:
        tree = jax.tree.map(lambda a: np.asarray(a)[replica], tree)
    return jax.tree.map(np.asarray, tree)


def check(given: dict, params_shape, source: str | None = None) -> None:
    """UsageError unless every leaf of ``given`` is a parameter of the model with its shape. ``source``: the
    ``--init-from`` file they were read from (the fix is then said for a file), else ``init_params`` in memory."""
    want, have = flat(params_shape), flat(given)
    where = f"--init-from {source}" if source else "init_params"
    drop = "write a .npz without that array" if source else "drop it from init_params"
    for name, a in have.items():
        if name not in want:
            if not source and name.startswith("params/") and name.removeprefix("params/") in want:
                raise UsageError(f"init_params holds the whole variables ('{name}'), not the parameters; pass "
                                 "variables['params'] (load_replica returns every collection)")
            close = sorted(want)[:6]
            raise UsageError(f"{where} holds '{name}', which the model has no parameter of (it has "
                             f"{', '.join(close)}{', ...' if len(want) > 6 else ''}); {drop} or rename it")
        if tuple(np.shape(a)) != tuple(want[name].shape):
            raise UsageError(f"{where} '{name}' has shape {tuple(np.shape(a))}, the model's is "
                             f"{tuple(want[name].shape)} (weights trained on other inputs or classes?); {drop} to "
                             "draw that layer from the init key")


def covers_all(given: dict, params_shape) -> bool:
    """Whether ``given`` holds every parameter (then the ``init`` key draws nothing)."""
    return set(flat(given)) >= set(flat(params_shape))


def overlay(params, given: dict):
    """``params`` with every leaf ``given`` holds replaced by it (in the model's dtype)."""
    have = flat(given)
    out = {k: (jnp.asarray(have[k], v.dtype) if k in have else v) for k, v in flat(params).items()}
    return traverse_util.unflatten_dict(out, sep="/")


def fingerprint(given: dict) -> str:
    """sha256 over every leaf's name, shape, dtype and bytes: what the study's identity records."""
    if isinstance(given, Given):
        return given.sha256
    h = hashlib.sha256()
    for name, a in sorted(flat(given).items()):
        a = np.asarray(jax.device_get(a))
        h.update(f"{name}{a.shape}{a.dtype.str}".encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()
