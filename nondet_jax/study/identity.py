"""A study's identity by content: what decides whether a run folder's results can be reused.

Every part that can change a result is fingerprinted by what it computes, never by its name:

* ``data``: sha256 of the four arrays' shapes, dtypes and bytes (and of the test split alone, which
  ``compare`` uses to tell whether two studies were scored on one test set).
* ``model``: sha256 of the jaxprs of its initialisation, training forward pass and evaluation at
  the study's shapes, with their constants: a changed layer, activation, initialiser or width
  changes it; a renamed class does not.
* ``optimizer``: the jaxprs of the optax transformation's ``init`` and ``update`` on the model's
  parameter tree: learning rate, momentum, schedule (all its steps: the schedule is part of the
  computation), clipping, weight decay.
* ``loss`` and ``augment``: their jaxprs on a batch of the study's shapes.
* ``platform``: jaxlib, the backend and device kind, the CPU type (bitwise results depend on them).

Tracing costs a fraction of a second on the default study (nothing is compiled or run). The
readable side, ``describe_optimizer``, lists the optax transformations of a chain with their
settings and the schedules' values at a few steps (:mod:`nondet_jax.report.optimizer`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from importlib.metadata import version
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from nondet_jax import config as cfg
from nondet_jax.errors import UsageError
from nondet_jax.machine import xla_flags
from nondet_jax.models import pretrained
from nondet_jax.models.parts import label_of
from nondet_jax.report.optimizer import describe_optimizer, format_optimizer

PARTS = ("data", "model", "optimizer", "loss", "augment", "init_params", "platform")
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")  # a function's repr inside a jaxpr parameter: not its content
_DATA_CACHE: dict[tuple, dict] = {}  # (real path, size, mtime_ns) of a .npz -> its data identity


def _update_with_array(h, a) -> None:
    a = np.asarray(a)
    if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
        a = np.asarray(jax.random.key_data(a))
    a = np.ascontiguousarray(a)
    h.update(f"{a.shape}{a.dtype.str};".encode())
    h.update(a.view(np.uint8).reshape(-1).data if a.size else b"")


def arrays_sha256(arrays) -> str:
    """sha256 over arrays' shapes, dtypes and bytes, in order."""
    h = hashlib.sha256()
    for a in arrays:
        _update_with_array(h, a)
    return h.hexdigest()


def data_identity(data) -> dict:
    """``{"sha256", "test_sha256", "classes", "shapes"}`` of a :class:`nondet_jax.data.Dataset`. For a
    ``.npz`` file it is computed once per process and file version (path, size, modification time)."""
    key = None
    if str(data.name).endswith(".npz"):
        try:
            st = os.stat(data.name)
            key = (os.path.realpath(data.name), st.st_size, st.st_mtime_ns)
        except OSError:
            key = None
        if key in _DATA_CACHE:
            return _DATA_CACHE[key]
    arrays = (data.x_train, data.y_train, data.x_test, data.y_test)
    task = getattr(data, "task", "classification")
    out = {"sha256": hashlib.sha256((arrays_sha256(arrays) + f"classes={data.num_classes};task={task}").encode()
                                    ).hexdigest(),
           "test_sha256": arrays_sha256(arrays[2:]), "classes": int(data.num_classes), "task": task,
           "shapes": {n: [list(np.shape(a)), str(np.asarray(a).dtype)]
                      for n, a in zip(("x_train", "y_train", "x_test", "y_test"), arrays)}}
    if key is not None:
        _DATA_CACHE[key] = out
    return out


def jaxpr_sha256(fn: Callable, *args) -> str:
    """sha256 of ``fn``'s jaxpr at ``args`` (arrays or ``jax.ShapeDtypeStruct``) and of its constants."""
    closed = jax.make_jaxpr(fn)(*args)
    h = hashlib.sha256(_ADDRESS.sub("", str(closed)).encode())
    for c in closed.consts:
        _update_with_array(h, c)
    return h.hexdigest()


def reads_argument(fn: Callable, args: tuple, index: int) -> bool:
    """Whether ``fn(*args)`` reads argument ``index`` at all (any leaf of it enters a computation or
    the output of its jaxpr): e.g. whether a model consumes its dropout key."""
    closed = jax.make_jaxpr(fn)(*args)
    counts = [len(jax.tree.leaves(a)) for a in args]
    start = sum(counts[:index])
    wanted = {id(v) for v in closed.jaxpr.invars[start:start + counts[index]]}  # Literals are not hashable
    return any(id(v) in wanted for e in closed.jaxpr.eqns for v in e.invars) or any(
        id(v) in wanted for v in closed.jaxpr.outvars)


def model_facts(fns, x_dtype) -> dict:
    """What the report must know of the model: whether it has BatchNorm statistics, whether its
    training pass reads its dropout input, whether dropout masks follow their examples, and where
    CKA's features come from."""
    model, b = fns.model, fns.batch_size
    key = jax.random.key(0)
    x1 = jax.ShapeDtypeStruct((1, *fns.spec.image_shape), x_dtype)
    xb = jax.ShapeDtypeStruct((b, *fns.spec.image_shape), x_dtype)
    variables = jax.eval_shape(model.init, key, x1)
    dropout = jax.eval_shape(lambda k, perm: model.dropout_input(k, b, perm), key, jnp.arange(b))
    uses_dropout = dropout is not None and reads_argument(model.train_apply, (variables, xb, dropout), 2)
    return {"batch_norm": bool(jax.tree.leaves(variables.get("batch_stats", {}))), "dropout": uses_dropout,
            "dropout_follows_examples": bool(model.per_example_dropout), "features": model.features}


def step_update(tx, grads, state, params):
    """``tx.update`` as a study's training step calls it, (grads, state, params): an optimiser whose update needs
    more (optax.lbfgs's line search: value, grad, value_fn; contrib.reduce_on_plateau: value) is refused in one
    line here, where it is first traced, before anything is written."""
    try:
        return tx.update(grads, state, params)
    except TypeError as e:
        if "required keyword-only argument" not in str(e):
            raise
        needs = str(e).split(":", 1)[-1].strip()
        raise UsageError(f"your optimizer's update needs {needs}, which a study's training step does not pass (a line "
                         "search such as optax.lbfgs, or contrib.reduce_on_plateau); use an optimizer whose update "
                         "takes (grads, state, params)") from None


def part_identities(config, data, fns) -> dict[str, dict]:
    """The fingerprint of every part of a study (see the module docstring): part -> record with a
    ``sha256`` and what a reader needs (the part's name, readable settings)."""
    p, model = fns.parts, fns.model
    b = fns.batch_size
    x_dtype = np.asarray(data.x_train[:1]).dtype
    x1 = jax.ShapeDtypeStruct((1, *fns.spec.image_shape), x_dtype)
    xb = jax.ShapeDtypeStruct((b, *fns.spec.image_shape), x_dtype)
    yb = jax.ShapeDtypeStruct((b, *np.shape(data.y_train)[1:]), np.asarray(data.y_train[:1]).dtype)
    key = jax.random.key(0)
    variables = jax.eval_shape(model.init, key, x1)
    dropout = jax.eval_shape(lambda k, perm: model.dropout_input(k, b, perm), key, jnp.arange(b))
    logits = jax.eval_shape(model.train_apply, variables, xb, dropout)[0]
    params = variables["params"]
    h = hashlib.sha256()
    for fn, args in ((model.init, (key, x1)), (model.train_apply, (variables, xb, dropout)),
                     (model.evaluate, (variables, xb))):
        h.update(jaxpr_sha256(fn, *args).encode())
    n_params = int(sum(np.prod(a.shape) for a in jax.tree.leaves(params)))
    user_model = p.model is not None
    opt_state = jax.eval_shape(fns.tx.init, params)
    opt = hashlib.sha256((jaxpr_sha256(fns.tx.init, params)
                          + jaxpr_sha256(lambda g, s, w: step_update(fns.tx, g, s, w), params, opt_state, params)).encode())
    total = config.train.epochs * fns.steps_per_epoch
    aug = "none" if fns.augment is None else jaxpr_sha256(fns.augment, key, xb)
    return {
        "data": {"name": data.name, **data_identity(data)},
        "model": {"name": config.model.name if not user_model or ":" in config.model.name else label_of(p.model),
                  "sha256": h.hexdigest(), "parameters": n_params,
                  "shapes": {jax.tree_util.keystr(k, simple=True, separator="/"): list(a.shape)
                             for k, a in jax.tree_util.tree_leaves_with_path(params)}},
        "optimizer": {"name": config.optim.name if p.optimizer is None or cfg.imported(config.optim.name)
                      else label_of(type(p.optimizer)) + " (user's)",
                      "sha256": opt.hexdigest(), "transforms": describe_optimizer(fns.tx, total)},
        "loss": {"name": label_of(p.loss) if p.loss is not None else "squared_error"
                 if getattr(data, "task", "classification") == "regression"
                 else "softmax_cross_entropy_with_integer_labels",
                 "sha256": jaxpr_sha256(fns.example_loss, logits, yb)},
        "augment": {"name": "none" if fns.augment is None else "config" if p.augment is None else label_of(p.augment),
                    "sha256": hashlib.sha256(aug.encode()).hexdigest()},
        "platform": platform_identity(),
        # fine-tuning only (a study without keeps the identity it always had)
        **({} if p.init_params is None else {"init_params": {
            "name": config.model.init_from or "in memory", "sha256": pretrained.fingerprint(p.init_params),
            "parameters": len(pretrained.flat(p.init_params))}}),
    }


def platform_identity() -> dict:
    """jaxlib, backend, device kind and CPU type: what bitwise results depend on beyond the study."""
    rec = {"jaxlib": version("jaxlib"), "backend": jax.default_backend(), "device_kind": jax.devices()[0].device_kind,
           "cpu_type": xla_flags.cpu_type()}
    return {**rec, "sha256": hashlib.sha256(json.dumps(rec, sort_keys=True).encode()).hexdigest()}


def identity_sha256(parts: dict[str, dict]) -> str:
    """One sha256 over every part's fingerprint: a study's identity."""
    return hashlib.sha256(json.dumps({k: parts[k]["sha256"] for k in sorted(parts)}).encode()).hexdigest()


def identity_diff(old: dict[str, dict], new: dict[str, dict]) -> list[str]:
    """Lines naming each part whose fingerprint differs, with what a reader can see changed."""
    out = []
    for part in PARTS:
        a, b = (r.get(part) if isinstance(r.get(part), dict) else {} for r in (old, new))
        if a.get("sha256") == b.get("sha256"):
            continue
        shown = _readable_diff(part, a, b)
        out.append(f"the {part} differs ({shown})" if shown else f"the {part} differs (the same name, another "
                   f"computation: fingerprint {str(a.get('sha256'))[:8]} -> {str(b.get('sha256'))[:8]})")
    return out


def _readable_diff(part: str, a: dict, b: dict) -> str:
    if part == "platform":
        return ", ".join(f"{k} {a.get(k)} -> {b.get(k)}" for k in ("jaxlib", "backend", "device_kind", "cpu_type")
                         if a.get(k) != b.get(k))
    if a.get("name") != b.get("name"):
        return f"was {a.get('name')}, now {b.get('name')}"
    if part == "data":
        return (f"{b.get('name')} holds other arrays: sha256 {str(a.get('sha256'))[:8]} -> {str(b.get('sha256'))[:8]}"
                + _data_detail(a, b))
    if part == "model" and isinstance(a.get("shapes"), dict) and a.get("shapes") == b.get("shapes"):
        return (f"the same name, another computation with the same {b.get('parameters')} parameters in the same "
                f"shapes: fingerprint {str(a.get('sha256'))[:8]} -> {str(b.get('sha256'))[:8]}")
    if part == "optimizer" and a.get("transforms") != b.get("transforms"):
        return _transforms_diff(a.get("transforms") or [], b.get("transforms") or [])
    return ""


def _data_detail(a: dict, b: dict) -> str:
    """What changed in the data, in words: an array's shape or dtype, or which split holds other values."""
    sa, sb = a.get("shapes") or {}, b.get("shapes") or {}
    changed = [f"{k} {tuple(sa[k][0])} {sa[k][1]} -> {tuple(sb[k][0])} {sb[k][1]}" for k in sb if k in sa and sa[k] != sb[k]]
    if changed:
        return "; " + ", ".join(changed)
    if not sa or not sb:
        return ""
    if a.get("classes") != b.get("classes"):
        return f"; {a.get('classes')} -> {b.get('classes')} classes"
    test_same = a.get("test_sha256") == b.get("test_sha256")
    return f"; same shapes, other values in the {'training' if test_same else 'test'} arrays" + (
        "" if test_same else " (the training arrays may differ too)")


def _num(v) -> str:
    return f"{v:.6g}" if isinstance(v, float) else repr(v)


def _transforms_diff(a: list[dict], b: list[dict]) -> str:
    """The settings that differ between two optimiser descriptions, or both in full."""
    if [t.get("transform") for t in a] != [t.get("transform") for t in b]:
        return f"was {format_optimizer(a)}, now {format_optimizer(b)}"
    out = []
    for ta, tb in zip(a, b):
        for k in [k for k in {**ta, **tb} if ta.get(k) != tb.get(k)]:
            va, vb = ta.get(k), tb.get(k)
            if isinstance(va, dict) and isinstance(vb, dict):  # a schedule: its first step that differs
                step = next((s for s in vb if va.get(s) != vb.get(s)), None)
                out.append(f"{ta['transform']} {k} at step {step}: {_num(va.get(step))} -> {_num(vb.get(step))}")
            else:
                out.append(f"{ta['transform']} {k} {_num(va)} -> {_num(vb)}")
    return "; ".join(out[:3]) or "its computation changed"


def check_identity(root: Path, stored: dict | None, parts: dict[str, dict]) -> None:
    """Refuse to continue a study whose stored identity differs from this one, naming each part."""
    if stored is None:
        return
    old = stored.get("identity")
    if not isinstance(old, dict):
        raise UsageError(f"--out {root} was written without part fingerprints (by an older nondet_jax), so it cannot "
                         "be told whether it is this study; choose another --out")
    diff = identity_diff(old, parts)
    if diff:
        raise UsageError(f"--out {root} holds results of another study: {'; '.join(diff[:3])}; choose another --out "
                         "(the default --out gives every study its own folder) or use the parts it started with")
