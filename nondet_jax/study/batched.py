"""Batched methods: methods of a study that differ only in the optimiser's learning rate, momentum or weight
decay, trained together, in one set of programs per arm.

The optimiser is the config's (SGD or AdamW, the same schedule) built under ``optax.inject_hyperparams`` with the
peak learning rate, the momentum and the weight decay as state: every replica's optimiser state carries its
method's values, so one compiled program serves every method (the schedule is the config's at peak 1, scaled
by the replica's learning rate). Replica r of method m trains under replica r's keys, exactly as alone; the
k x R replicas are split back into k arm results, each stored in its method's own run folder by the same
:func:`nondet_jax.study.arm.finish_arm` a study uses, and the per-method studies then find those arms finished.
The results equal each method's trained alone up to float rounding (the learning rate is a traced value times
the unit schedule instead of a constant schedule), not bitwise; each arm record says ``batched`` in its strategy
reason. Batched arms are not checkpointed mid-arm: an interrupted batched arm is trained again.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax

from nondet_jax import config as cfg
from nondet_jax.models.parts import Parts
from nondet_jax.replicas.choice import make_strategy
from nondet_jax.replicas.loop import EpochState, _distances, train_replicas
from nondet_jax.replicas.rule import resolve_study
from nondet_jax.replicas.watch import pair_watcher
from nondet_jax.sources import arm_keys, perturbations
from nondet_jax.store.paths import RunPaths
from nondet_jax.store.run import RunStore
from nondet_jax.study.arm import finish_arm, watched
from nondet_jax.study.prepare import check_model, check_watchable, model_record, parse_arms, prepare
from nondet_jax.train import bias_bn_mask, make_schedule, steps_per_epoch

# config key -> the injected hyper-parameter it sets
HYPER = {"optim.lr": "lr", "optim.momentum": "momentum", "optim.weight_decay": "weight_decay"}


def batchable(config: cfg.Config) -> str | None:
    """Why a method's config cannot train batched (a line), or None when it can."""
    study = config.study
    if config.optim.name not in cfg.OPTIMIZERS:
        return f"optim.name {config.optim.name} is not the config's sgd or adamw"
    if config.instruments.config != "none":
        return "instruments are on"
    if study.eval_every:
        return "study.eval_every is set"
    if any(a.cycles or "hardware" in a.varied for a in parse_arms(config)):
        return "an arm is a snapshot ensemble or varies hardware"
    return None


def groups(configs: dict[str, cfg.Config], parts: dict[str, dict]) -> list[list[str]]:
    """Methods (by name, in order) that can train together: no part of their own, a batchable config, and
    configs equal but for :data:`HYPER`'s keys. Groups of one are left out."""
    out: dict[str, list[str]] = {}
    for name, c in configs.items():
        if parts.get(name) or batchable(c) is not None:
            continue
        d = cfg.to_dict(c)
        for key in HYPER:
            section, k = key.split(".")
            d[section][k] = None
        out.setdefault(repr(sorted((s, sorted(v.items())) for s, v in d.items())), []).append(name)
    return [g for g in out.values() if len(g) > 1]


def injected_optimizer(o: cfg.OptimConfig, epochs: int, steps: int) -> optax.GradientTransformation:
    """The config's optimiser (:func:`nondet_jax.train.make_optimizer`) with its peak learning rate, momentum
    and weight decay as state (``opt_state.hyperparams``), so that they can differ between replicas."""
    unit = make_schedule(dataclasses.replace(o, lr=1.0), epochs, steps)

    def factory(lr, momentum, weight_decay):
        schedule = lambda count: lr * unit(count)  # noqa: E731
        if o.name == "adamw":
            tx = optax.adamw(schedule, weight_decay=weight_decay)
        else:  # momentum 0: a trace with decay 0 is the plain gradient
            tx = optax.chain(optax.add_decayed_weights(weight_decay),
                             optax.sgd(schedule, momentum=momentum, nesterov=o.nesterov))
        if o.bias_bn_lr_scale != 1.0:
            tx = optax.chain(tx, optax.masked(optax.scale(o.bias_bn_lr_scale), bias_bn_mask))
        return tx

    return optax.inject_hyperparams(factory)(lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay)


def _with_hyper(state, values: dict[str, np.ndarray]):
    """The stacked state with each replica's hyper-parameters in its optimiser state."""
    hyper = dict(state.opt_state.hyperparams)
    for name, v in values.items():
        hyper[name] = jnp.asarray(v, hyper[name].dtype)
    return state._replace(opt_state=state.opt_state._replace(hyperparams=hyper))


def train_group(configs: dict[str, cfg.Config], folders: dict[str, object], parts: Parts = Parts(), data=None,
                log=print, command: str | None = None) -> list[str]:
    """Train every arm not finished in all of the group's method folders, the methods together, and store each
    method's share in its folder. Returns the arms trained."""
    names = list(configs)
    first = configs[names[0]]
    study, k = first.study, len(names)
    data, _ = prepare(first, parts, data)
    tx = injected_optimizer(first.optim, first.train.epochs, steps_per_epoch(len(data.x_train), first.train.batch_size))
    _, fns = prepare(first, parts._replace(optimizer=tx), data)
    own = {}
    for n in names:
        _, f = prepare(configs[n], parts, data)
        model = model_record(configs[n], data, f)
        check_model(RunPaths(folders[n]), model, configs[n])
        own[n] = (f, model)
    strategy_name, why = resolve_study(study, k * study.replicas)
    if strategy_name not in ("sequential", "vmap"):
        strategy_name, why = "sequential", f"batched methods run sequential or vmap, not {strategy_name}"
    check_watchable(first, fns, strategy_name)
    strategy = make_strategy(fns, strategy_name)
    values = {h: np.repeat([getattr(configs[n].optim, key.split(".")[1]) for n in names], study.replicas)
              for key, h in HYPER.items()}
    trained = []
    for arm in parse_arms(first):
        if all(RunPaths(folders[n]).arm_file("arms", arm.name).is_file() for n in names):
            continue
        log(f"arm {arm.name}: {k} methods ({', '.join(names)}) batched, {k} x {study.replicas} replicas in one "
            f"program ({strategy_name})")
        one = arm_keys(study.seed, arm.varied, study.replicas)
        keys = jax.tree.map(lambda a: jnp.concatenate([a] * k), one)  # replica r of every method: r's keys
        perturb = perturbations(arm.varied)
        state = _with_hyper(strategy.init(keys, perturb, jnp.asarray(data.x_train[:1])), values)
        sl = [slice(i * study.replicas, (i + 1) * study.replicas) for i in range(k)]
        dist = {n: [_distances(jax.tree.map(lambda a, s=s: a[s], state.params))] for n, s in zip(names, sl)}

        def on_epoch(p: EpochState):
            for n, s in zip(names, sl):
                dist[n].append(_distances(jax.tree.map(lambda a, s=s: a[s], p.state.params)))

        watcher = None
        if watched(first, arm):  # each method's replicas 0 and 1
            watcher = pair_watcher(fns, data.x_test, study.dynamics_every, tuple(s.start for s in sl))
        result = train_replicas(strategy, keys, perturb, data, first.train.epochs,
                                start=EpochState(0, state, {}, _distances(state.params)[None]), on_epoch=on_epoch,
                                watcher=watcher)
        for n, s in zip(names, sl):
            part = result._replace(
                state=jax.tree.map(lambda a, s=s: a[s], result.state), train_loss=result.train_loss[s],
                train_accuracy=result.train_accuracy[s], logits=result.logits[s], features=result.features[s],
                weight_distance=np.stack(dist[n]), seconds=result.seconds / k,
                steps=jax.tree.map(lambda a, s=s: a[s], result.steps), snapshots=result.snapshots[s])
            f, model = own[n]
            with RunStore(folders[n], configs[n], identity=model["identity_sha256"]) as store:
                if store.arm_done(arm.name):
                    continue
                from nondet_jax.study.runner import write_run_files

                write_run_files(store, configs[n], data, f, command, model, log=lambda *a: None)
                finish_arm(configs[n], data, f, store, arm, part,
                           f"batched with {k} methods ({', '.join(names)}) in one program: {why}", log)
        trained.append(arm.name)
    return trained


def train_batched(configs: dict[str, cfg.Config], own_parts: dict[str, dict], root, parts: Parts = Parts(), data=None,
                  log=print, command: str | None = None) -> list[list[str]]:
    """Every group of :func:`groups` among a study's methods trained together (:func:`train_group`) into
    ``root/methods/<name>``; the others are left to train alone. Returns the groups."""
    found = groups(configs, own_parts)
    for g in found:
        train_group({n: configs[n] for n in g}, {n: RunPaths(root).method(n) for n in g}, parts, data, log, command)
    return found
