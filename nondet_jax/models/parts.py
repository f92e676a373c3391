"""A model, however it was written, as the pure functions single-replica training needs.

:func:`model_fns` turns a Flax Linen module (an instance, or a class / factory called with
``num_classes=``) or a Flax NNX module class / factory (called with ``num_classes=`` and ``rngs=``)
into :class:`ModelFns`. The catalogue's models (:mod:`nondet_jax.models`) go through the same
function; what they expose beyond the plain convention is detected from ``__call__``'s signature:

* ``__call__(x, train)`` is all a model needs. BatchNorm is used when the module has a
  ``batch_stats`` collection; dropout draws from the ``dropout`` rng stream, fed one key per step
  from the ``dropout`` source.
* ``dropout_keys`` (the catalogue's convention): one dropout key per example, so that the
  ``batch_order`` source permutes masks together with their examples. With the plain convention a
  permuted batch meets the step's masks in another order (documented in docs/api.md).
* ``return_features``: ``(logits, penultimate features)`` for CKA. Without it, CKA falls back to a
  named intermediate (``features="Dense_0"``: the output of the submodule with that name, captured
  with ``capture_intermediates``) or, by default, to the logits. Never a crash.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import json
import re
from typing import Any, Callable, NamedTuple

import flax.errors
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, traverse_util

from nondet_jax.errors import UsageError


class Parts(NamedTuple):
    """The user's own parts of a study; ``None`` takes the part the config names (the catalogue)."""

    model: Any = None  # Linen module / class / factory, or NNX class / factory; None: config.model
    optimizer: Any = None  # an optax.GradientTransformation; None: config.optim
    loss: Callable | None = None  # per-example (logits, labels) -> loss; None: softmax cross-entropy
    augment: Callable | None = None  # (key, x_batch) -> x_batch; None: config.data.augment (crop, flip)
    features: str | None = None  # submodule whose output CKA uses when the model has no return_features
    init_params: Any = None  # a params subtree every replica starts from (nondet_jax.models.pretrained)


class ModelFns(NamedTuple):
    """One replica's model as pure functions over Flax variables ``{"params": ..., "batch_stats": ...}``."""

    init: Callable  # (key, x_sample) -> variables
    train_apply: Callable  # (variables, x, dropout) -> (logits, batch_stats after the step)
    evaluate: Callable  # (variables, x) -> (logits, features)
    dropout_input: Callable  # (step_key, batch_size, permutation) -> what train_apply takes as ``dropout``
    recompute_batch_stats: Callable  # (variables, x) -> batch statistics of x at these weights ({} without BN)
    module: Any  # the Linen module (None for NNX)
    features: str  # where CKA's features come from: "model", "logits" or "intermediate:<name>"
    per_example_dropout: bool  # dropout keys tied to examples (the catalogue's convention)
    bn_momenta: Callable = lambda x_sample: ()  # (x_sample) -> the momentum of every BatchNorm layer, in call order


def _accepts(fn, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _apply(module, *args, **kwargs):
    """``module.apply``, the two things a user's Linen module can ask for that a study does not give said in one
    line (flax said them in its own words, from deep inside a trace)."""
    try:
        return module.apply(*args, **kwargs)
    except flax.errors.InvalidRngError as e:
        stream = (re.findall(r'PRNG for "([^"]+)"', str(e)) or ["another"])[0]
        raise UsageError(f"model {label_of(module)} draws random numbers from the rng stream '{stream}', which a study "
                         "does not give: it gives one, 'dropout' (the dropout source, its own key per replica where "
                         "an arm varies it); draw with self.make_rng('dropout')") from None
    except flax.errors.ScopeCollectionNotFound as e:
        found = (re.findall(r'collection "([^"]+)"', str(e)) or ["another"])[0]
        raise UsageError(f"model {label_of(module)} keeps variables in the collection '{found}', which a study does "
                         "not carry from step to step (it carries params and batch_stats); keep running state in "
                         "batch_stats, or drop it") from None


def _takes_any_keyword(fn) -> bool:
    try:
        return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return True  # unknown: let the call say


def _required_beyond_input(fn) -> list[str]:
    """The parameters of ``fn(self, x, ...)`` after the input that have no default (NNX's __call__ gets x only)."""
    try:
        params = list(inspect.signature(fn).parameters.values())[2:]
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.default is inspect.Parameter.empty
            and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def label_of(obj) -> str:
    """``module:qualname`` of a class or function, the class's for an instance."""
    if isinstance(obj, str):
        return obj
    target = obj if inspect.isclass(obj) or inspect.isfunction(obj) else type(obj)
    return f"{getattr(target, '__module__', '?')}:{getattr(target, '__qualname__', type(target).__name__)}"


def import_object(spec: str, flag: str = "--model", example: str = "mypkg.nets:SmallCNN"):
    """``package.module:Attr`` -> the object, imported from the user's PYTHONPATH; UsageError otherwise
    (naming ``flag``, the option that gave ``spec``)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise UsageError(f"{flag} {spec!r} is neither a catalogue name nor PACKAGE.MODULE:ATTR; write e.g. "
                         f"{flag} {example}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise UsageError(f"{flag} {spec}: cannot import module '{module_name}' ({e}); put its folder on "
                         "PYTHONPATH") from None
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = [n for n in dir(module) if not n.startswith("_")]
            raise UsageError(f"{flag} {spec}: module '{module_name}' has no attribute '{attr}'; it has "
                             f"{', '.join(names[:12]) or 'no public names'}")
        obj = getattr(obj, part)
    return obj


def model_fns(model, num_classes: int, catalogue_kwargs: dict | None = None, features: str | None = None) -> ModelFns:
    """The :class:`ModelFns` of ``model`` (see the module docstring).

    Args:
      model: a Linen module instance, a Linen module class or factory (called with ``num_classes=``,
        plus ``catalogue_kwargs``), or an NNX module class or factory (called with ``num_classes=``
        and ``rngs=``).
      num_classes: classes of the data set.
      catalogue_kwargs: extra factory arguments (the catalogue's ``width`` and ``dropout``).
      features: name of the submodule whose output CKA uses when the model has no ``return_features``.
    """
    if isinstance(model, nnx.Module):
        raise UsageError(f"model is an NNX module instance ({label_of(model)}); pass its class or a factory "
                         "taking num_classes= and rngs=, so that each replica builds its own weights from its init key")
    target = model.func if isinstance(model, functools.partial) else model
    if inspect.isclass(target) and issubclass(target, nnx.Module):
        return nnx_model_fns(model, num_classes, features)
    if not isinstance(model, nn.Module):
        if not callable(model):
            raise UsageError(f"model {label_of(model)} is not a Flax module, module class or factory; pass a "
                             "flax.linen.Module (or a class / function building one from num_classes=)")
        try:
            model = model(num_classes=num_classes, **(catalogue_kwargs or {}))
        except TypeError as e:
            fix = ("give it a num_classes argument" if "num_classes" in str(e) or "unexpected keyword" in str(e) else
                   "give its other arguments defaults, or pass functools.partial(Model, name=value)")  # a required field
            raise UsageError(f"model {label_of(model)} could not be built with num_classes={num_classes} ({e}); "
                             f"{fix}, or pass a module instance") from None
        if not isinstance(model, nn.Module):
            raise UsageError(f"model factory returned {type(model).__name__}, not a Flax module; return a "
                             "flax.linen.Module or flax.nnx.Module")
    return linen_model_fns(model, features)


def linen_model_fns(module, features: str | None = None) -> ModelFns:
    """:class:`ModelFns` of a Linen module (the catalogue's and any user's)."""
    call = type(module).__call__
    if not _accepts(call, "train") and not _takes_any_keyword(call):
        raise UsageError(f"model {label_of(module)}'s __call__ takes no train argument; a Linen model is called as "
                         "model(x, train=True) in training and train=False in evaluation (for dropout and BatchNorm): "
                         "add train: bool to its __call__")
    per_example = _accepts(call, "dropout_keys")
    exposes = _accepts(call, "return_features")
    if exposes and features:  # it used to be ignored without a word, CKA computed on the model's own features
        raise UsageError(f"features={features!r} (--features, model.features) does not apply: the model returns its "
                         "own features for CKA (its __call__ takes return_features); drop it")
    dropout_rate = getattr(module, "dropout", None)
    uses_keys = per_example and isinstance(dropout_rate, (int, float)) and dropout_rate > 0

    def variables_of(v):
        return {k: v[k] for k in ("params", "batch_stats") if k in v and (k == "params" or v[k])}

    def init(key, x):
        v = module.init(key, x[:1], train=False)
        return {"params": v["params"], "batch_stats": v.get("batch_stats", {})}

    if per_example:
        def train_apply(v, x, dropout):
            logits, updates = _apply(module, variables_of(v), x, train=True, dropout_keys=dropout,
                                           mutable=["batch_stats"])
            return logits, updates.get("batch_stats", {})

        def dropout_input(step_key, b, perm):
            if not uses_keys:
                return None
            return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(step_key, jnp.arange(b))[perm]
    else:
        def train_apply(v, x, dropout):
            logits, updates = _apply(module, variables_of(v), x, train=True, rngs={"dropout": dropout},
                                           mutable=["batch_stats"])
            return logits, updates.get("batch_stats", {})

        def dropout_input(step_key, b, perm):
            return step_key

    if exposes:
        source = "model"

        def evaluate(v, x):
            return _apply(module, variables_of(v), x, train=False, return_features=True)
    elif features:
        source = f"intermediate:{features}"

        def evaluate(v, x):
            logits, state = _apply(module, variables_of(v), x, train=False,
                                         capture_intermediates=lambda mdl, _: mdl.name == features)
            found = [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(state.get("intermediates", {}))
                     if any(getattr(p, "key", None) == features for p in path)]
            if not found:
                raise UsageError(f"features={features!r}: the model has no submodule named '{features}'; name one "
                                 "of its submodules (e.g. Dense_0), or leave features unset for the logits")
            return logits, found[0].reshape(x.shape[0], -1)
    else:
        source = "logits"

        def evaluate(v, x):
            logits = _apply(module, variables_of(v), x, train=False)
            return logits, logits

    if "bn_momentum" in getattr(module, "__dataclass_fields__", {}):
        # The catalogue's models: momentum 0 stores the exact statistics of the one batch passed.
        bn_module = module.clone(bn_momentum=0.0, dropout=0.0)

        def recompute_batch_stats(v, x):
            if not v.get("batch_stats"):
                return v.get("batch_stats", {})
            kwargs = {"dropout_keys": None} if per_example else {}
            _, updates = bn_module.apply(variables_of(v), x, train=True, mutable=["batch_stats"], **kwargs)
            return updates["batch_stats"]
    else:
        def recompute_batch_stats(v, x):
            """BatchNorm's running averages are ``m * old + (1 - m) * batch``: one update from old = 0 gives
            ``(1 - m) * batch``, divided by the ``1 - m`` each ``nn.BatchNorm`` multiplied by (read from the
            module as it runs: exact to an ulp). Statistics of another layer: a second update from old = 1 gives
            its m (to about 1e-5 relative, less where the statistics are large: s1 - s0 cancels)."""
            if not v.get("batch_stats"):
                return v.get("batch_stats", {})
            rngs = {"dropout": jax.random.key(0)}
            run = lambda old: module.apply({"params": v["params"], "batch_stats": old}, x, train=True,  # noqa: E731
                                           rngs=rngs, mutable=["batch_stats"])[1]["batch_stats"]
            momenta = {}

            def spy(next_fun, args, kwargs, context):
                if isinstance(context.module, nn.BatchNorm) and context.method_name == "__call__":
                    momenta[tuple(context.module.scope.path)] = context.module.momentum
                return next_fun(*args, **kwargs)

            with nn.intercept_methods(spy):
                s0 = traverse_util.flatten_dict(run(jax.tree.map(jnp.zeros_like, v["batch_stats"])))
            other = [k for k in s0 if k[:-1] not in momenta]
            s1 = traverse_util.flatten_dict(run(jax.tree.map(jnp.ones_like, v["batch_stats"]))) if other else {}
            return traverse_util.unflatten_dict({k: a / (1.0 - momenta[k[:-1]]) if k[:-1] in momenta
                                                 else a / (1.0 - (s1[k] - a)) for k, a in s0.items()})

    def bn_momenta(x):
        found = []

        def spy(next_fun, args, kwargs, context):
            if isinstance(context.module, nn.BatchNorm) and context.method_name == "__call__":
                found.append(float(context.module.momentum))
            return next_fun(*args, **kwargs)

        with nn.intercept_methods(spy):
            jax.eval_shape(lambda: module.init(jax.random.key(0), x[:1], train=False))
        return tuple(found)

    return ModelFns(init, train_apply, evaluate, dropout_input, recompute_batch_stats, module, source, per_example,
                    bn_momenta)


def shape_fingerprint(params) -> dict:
    """The model's parameter shapes and dtypes, and their sha256: what a resume compares."""
    flat = {"/".join(str(getattr(p, "key", p)) for p in path): [list(np.shape(leaf)), str(np.dtype(leaf.dtype))]
            for path, leaf in jax.tree_util.tree_leaves_with_path(params)}
    digest = hashlib.sha256(json.dumps(flat, sort_keys=True).encode()).hexdigest()
    return {"param_shapes": flat, "fingerprint": digest}


def fingerprint_diff(old: dict, new: dict, limit: int = 3) -> list[str]:
    """Lines naming how two :func:`shape_fingerprint` results differ."""
    a, b = old.get("param_shapes", {}), new.get("param_shapes", {})
    fmt = lambda v: "absent" if v is None else f"{tuple(v[0])} {v[1]}"  # noqa: E731
    out = [f"{k}: {fmt(a.get(k))} -> {fmt(b.get(k))}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    return out[:limit]


def _build_nnx(factory, num_classes: int, key):
    """``factory(num_classes=, rngs=)`` with the params and dropout streams seeded from ``key``."""
    from flax import nnx

    try:
        return factory(num_classes=num_classes, rngs=nnx.Rngs(params=key, dropout=key))
    except TypeError as e:
        raise UsageError(f"NNX model {label_of(factory)} could not be built with num_classes={num_classes} and "
                         f"rngs= ({e}); give it those arguments") from None


def nnx_module(factory, num_classes: int, variables: dict):
    """An NNX module built by ``factory`` (as a study builds it) holding ``variables`` (``{"params": ...,
    "batch_stats": ...}`` pure dicts, a stored replica's), in eval mode."""
    from flax import nnx

    target = factory.func if isinstance(factory, functools.partial) else factory
    if not (inspect.isclass(target) and issubclass(target, nnx.Module)):
        raise UsageError(f"load_replica(model=...) builds NNX modules; {label_of(factory)} is not an NNX class or "
                         "factory (for a Linen module, leave model out and apply the variables it returns)")
    module = _build_nnx(factory, num_classes, jax.random.key(0))
    graphdef, params, stats, rest = nnx.split(module, nnx.Param, nnx.BatchStat, ...)
    nnx.replace_by_pure_dict(params, variables["params"])
    if variables.get("batch_stats"):
        nnx.replace_by_pure_dict(stats, variables["batch_stats"])
    module = nnx.merge(graphdef, params, stats, rest)
    module.eval()
    return module


def nnx_model_fns(factory, num_classes: int, features: str | None = None) -> ModelFns:
    """:class:`ModelFns` of a Flax NNX module class or factory (``factory(num_classes=, rngs=)``),
    through ``nnx.split`` / ``nnx.merge``: its ``Param`` variables are the params, its
    ``BatchStat`` variables the batch statistics; the module is built from the replica's ``init``
    key and its ``dropout`` stream reseeded from the ``dropout`` source at every step. Training
    mode is NNX's own (``model.train()`` / ``model.eval()``); ``__call__(x)`` returns logits.
    CKA's features are the logits (NNX modules have no ``capture_intermediates``)."""
    from flax import nnx

    if features:
        raise UsageError(f"features={features!r} (--features, model.features) does not apply: an NNX model's CKA "
                         "features are its logits (NNX has no capture_intermediates); drop it")

    def build(key):
        return _build_nnx(factory, num_classes, key)

    target = factory.func if isinstance(factory, functools.partial) else factory
    extra = _required_beyond_input(target.__call__) if inspect.isclass(target) else []
    if extra:
        raise UsageError(f"model {label_of(factory)}'s __call__ requires {', '.join(extra)} besides its input; an NNX "
                         "model is called as model(x), training and evaluation set by model.train() / model.eval() "
                         f"(nnx.Dropout and nnx.BatchNorm follow them): give {extra[0]} a default or drop it")

    graphdef, _, _, rest_shape = nnx.split(nnx.eval_shape(lambda: build(jax.random.key(0))),
                                           nnx.Param, nnx.BatchStat, ...)

    def rest_like(key):  # the module's other state (its rng streams), filled in and reseeded per call
        def fill(s):
            if jax.dtypes.issubdtype(s.dtype, jax.dtypes.prng_key):
                return key
            return jnp.zeros(s.shape, s.dtype)
        return jax.tree.map(fill, rest_shape)

    def merged(v, key, train: bool):
        m = nnx.merge(graphdef, v["params"], v["batch_stats"] or nnx.State({}), rest_like(key))
        m.train() if train else m.eval()
        return m

    def init(key, x):
        _, params, stats, _ = nnx.split(build(key), nnx.Param, nnx.BatchStat, ...)
        return {"params": nnx.to_pure_dict(params), "batch_stats": nnx.to_pure_dict(stats)}

    def as_state(v):
        _, p_shape, s_shape, _ = nnx.split(nnx.eval_shape(lambda: build(jax.random.key(0))),
                                           nnx.Param, nnx.BatchStat, ...)
        nnx.replace_by_pure_dict(p_shape, v["params"])
        if v["batch_stats"]:
            nnx.replace_by_pure_dict(s_shape, v["batch_stats"])
        return {"params": p_shape, "batch_stats": s_shape}

    def call(m, x):  # a stream the study does not give, said as for a Linen module (NNX: an AttributeError)
        try:
            return m(x)
        except AttributeError as e:
            stream = re.findall(r"No RngStream named '([^']+)'", str(e))
            if not stream:
                raise
            raise UsageError(f"model {label_of(factory)} draws random numbers from the rng stream '{stream[0]}', which a "
                             "study does not give: it gives 'dropout' (the dropout source, its own key per replica "
                             "where an arm varies it); draw with rngs.dropout()") from None

    def train_apply(v, x, dropout):
        m = merged(as_state(v), dropout, True)
        logits = call(m, x)
        _, stats = nnx.split(m, nnx.BatchStat, ...)[:2]
        return logits, nnx.to_pure_dict(stats)

    def evaluate(v, x):
        logits = call(merged(as_state(v), jax.random.key(0), False), x)
        return logits, logits

    def recompute_batch_stats(v, x):
        return v["batch_stats"]  # NNX BatchNorm momentum is not reachable here: stored statistics kept

    def bn_momenta(x):
        module = nnx.eval_shape(lambda: build(jax.random.key(0)))
        return tuple(float(node.momentum) for _, node in nnx.iter_graph(module) if isinstance(node, nnx.BatchNorm))

    return ModelFns(init, train_apply, evaluate, lambda step_key, b, perm: step_key, recompute_batch_stats, None,
                    "logits", False, bn_momenta)
