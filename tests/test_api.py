"""The public API on the user's own parts: run_study, the CLI's --model/--dataset, replicate, examples."""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import nondet_jax as nj
from nondet_jax.errors import UsageError

ROOT = Path(__file__).resolve().parent.parent
QUIET = {"log": lambda *a, **k: None}


class OwnNet(nn.Module):
    """A user's module: BatchNorm, dropout through the 'dropout' rng, no return_features."""

    num_classes: int = 3
    hidden: int = 16

    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.relu(nn.Dense(self.hidden)(x.reshape(x.shape[0], -1)))
        x = nn.BatchNorm(use_running_average=not train)(x)
        x = nn.Dropout(0.2, deterministic=not train)(x)
        return nn.Dense(self.num_classes)(x)


class NNXNet(nnx.Module):
    """The same as an NNX module: BatchNorm, dropout through its own Rngs stream."""

    def __init__(self, num_classes, rngs):
        self.l1, self.bn = nnx.Linear(6, 16, rngs=rngs), nnx.BatchNorm(16, rngs=rngs)
        self.do, self.l2 = nnx.Dropout(0.2, rngs=rngs), nnx.Linear(16, num_classes, rngs=rngs)

    def __call__(self, x):
        return self.l2(self.do(self.bn(nnx.relu(self.l1(x)))))


def own_arrays():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(160, 6)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64) + (x[:, 1] > 0.5)
    return x[:128], y[:128], x[128:], y[128:]


def test_run_study_on_own_module_optimizer_and_arrays(tmp_path):
    result = nj.run_study(model=OwnNet, data=own_arrays(), optimizer=optax.adam(1e-2), epochs=2, batch_size=32,
                          arms="control,init,all", replicas=3, out=tmp_path / "run", **QUIET)
    control, init = result.logits["control"], result.logits["init"]
    assert control.shape == (3, 32, 3)
    assert all(np.array_equal(control[0], c) for c in control)  # nothing varies: bitwise identical
    assert not np.array_equal(init[0], init[1])
    assert result.report.exists() and {r["arm"] for r in result.table} == {"control", "init", "all"}
    assert len(result.rows) == 9 * 4  # 9 replicas x 4 scores (test and train accuracy and loss), one a row
    frame, per_replica = result.to_frame(), result.to_frame("replicas")  # pandas: the test extra has it
    assert list(frame.index) == [r["arm"] for r in result.table] and per_replica.shape[0] == 9 * 4
    assert frame.loc["init", "accuracy_std_pct"] == next(r for r in result.table if r["arm"] == "init")["accuracy_std_pct"]
    with pytest.raises(UsageError, match="choose one of 'arms', 'replicas', 'curves'"):
        result.to_frame("pair")
    model = (tmp_path / "run" / "model.json").read_text()
    assert "OwnNet" in model and '"features": "logits"' in model  # the CKA fallback is recorded
    # The same study again: every arm reused; a changed model is refused before anything is written.
    nj.run_study(model=OwnNet, data=own_arrays(), optimizer=optax.adam(1e-2), epochs=2, batch_size=32,
                 arms="control,init,all", replicas=3, out=tmp_path / "run", **QUIET)
    before = sorted(p.name for p in (tmp_path / "run").rglob("*"))
    with pytest.raises(UsageError, match=r"another model \(BatchNorm_0/bias: \(16,\) float32 -> \(32,\) float32"):
        nj.run_study(model=OwnNet(num_classes=3, hidden=32), data=own_arrays(), optimizer=optax.adam(1e-2),
                     epochs=2, batch_size=32, arms="control,init,all", replicas=3, out=tmp_path / "run", **QUIET)
    assert sorted(p.name for p in (tmp_path / "run").rglob("*")) == before


def test_features_from_model_named_intermediate_or_logits(digits):
    from conftest import one_replica, spec_of, tiny_config

    from nondet_jax.models.parts import Parts
    from nondet_jax.train import make_train

    config, spec = tiny_config(), spec_of(digits)
    keys, perturb = one_replica()
    for parts, width in [(Parts(), 64), (Parts(model=OwnNet), 10), (Parts(model=OwnNet, features="Dense_0"), 16)]:
        fns = make_train(config, spec, parts)
        state = fns.init(keys, perturb, digits.x_train[:1])
        logits, feats = fns.evaluate(state, digits.x_test[:5])
        assert logits.shape == (5, 10) and feats.shape == (5, width)


def test_custom_loss_and_augment_are_used(tmp_path):
    calls = []

    def loss(logits, labels):
        calls.append("loss")
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels)

    def augment(key, x):
        calls.append("augment")
        return x + 0.01 * jax_normal(key, x.shape)

    result = nj.run_study(model=OwnNet, data=own_arrays(), optimizer=optax.sgd(0.05), loss=loss, augment=augment,
                          epochs=1, batch_size=64, arms="control,augmentation", replicas=2,
                          settings={"metrics.lmc_pairs": 0}, out=tmp_path / "run", **QUIET)
    assert {"loss", "augment"} <= set(calls)
    aug = result.logits["augmentation"]
    assert not np.array_equal(aug[0], aug[1])  # the augmentation source reaches the user's function


def jax_normal(key, shape):
    import jax

    return jax.random.normal(key, shape)


def test_replicate_hands_each_replica_its_keys():
    import jax
    import jax.numpy as jnp

    def init(keys):
        return {"w": jax.random.normal(keys.init, (4,)), "seen": jnp.zeros(())}

    def step(state, batch, keys):
        return {"w": state["w"] - 0.1 * batch * jax.random.normal(keys.data_order, (4,)), "seen": state["seen"] + batch}

    batches = jnp.ones(5)
    out = nj.replicate(init, step, batches, arms="control,init,data_order", replicas=3, strategy="sequential")
    assert out["control"]["w"].shape == (3, 4) and float(out["control"]["seen"][0]) == 5
    assert all(np.array_equal(out["control"]["w"][0], w) for w in out["control"]["w"])
    assert not np.array_equal(out["init"]["w"][0], out["init"]["w"][1])
    assert not np.array_equal(out["data_order"]["w"][0], out["data_order"]["w"][1])
    fewer = nj.replicate(init, step, batches, arms="init", replicas=2, strategy="sequential")
    assert np.array_equal(fewer["init"]["w"], out["init"]["w"][:2])  # replica r does not depend on R
    vm = nj.replicate(init, step, batches, arms="init", replicas=3, strategy="vmap")
    np.testing.assert_allclose(vm["init"]["w"], out["init"]["w"], rtol=1e-6)
    with pytest.raises(UsageError, match="arm 'hardware'"):
        nj.replicate(init, step, batches, arms="hardware")


def test_replicate_passes_the_step_index_and_collects_a_history():
    import jax
    import jax.numpy as jnp

    def init(keys):
        assert keys.step is None
        return {"w": jax.random.normal(keys.init, (2,)), "t": jnp.zeros((), jnp.int32)}

    def step(state, batch, keys):  # a schedule of one's own: the step size halves every 2 steps
        lr = 0.5 * 0.5 ** (keys.step // 2)
        return {"w": state["w"] - lr * state["w"], "t": state["t"] + 1}

    for strategy in ("vmap", "sequential"):
        out = nj.replicate(init, step, steps=5, arms="init", replicas=3, strategy=strategy,
                           collect=lambda s, k: {"step": k.step, "norm": jnp.linalg.norm(s["w"])})
        state, history = out["init"]
        assert history["step"].shape == (3, 5) and np.array_equal(history["step"][1], np.arange(5))
        factors = np.cumprod([1 - 0.5 * 0.5 ** (t // 2) for t in range(5)])  # (1 - lr_t) per step
        start = history["norm"][:, 0] / factors[0]
        np.testing.assert_allclose(history["norm"], start[:, None] * factors[None], rtol=1e-5)
        np.testing.assert_allclose(np.linalg.norm(state["w"], axis=1), history["norm"][:, -1], rtol=1e-6)
        assert int(state["t"][0]) == 5
    with pytest.raises(UsageError, match="collect must be a function"):
        nj.replicate(init, step, steps=2, arms="init", collect=3)


@pytest.mark.parametrize("strategy", ["vmap", "sequential"])
def test_replicate_takes_sources_of_your_own(strategy):
    """An RL-like step with two sources of its own: each arm varies what it names, control none, all both."""
    def init(keys):
        return jnp.zeros(2)

    def step(s, batch, keys):
        return s + jnp.stack([jax.random.normal(keys.env), jax.random.normal(keys.policy)])

    out = nj.replicate(init, step, steps=3, arms="control,env,policy,all", replicas=3, sources=("env", "policy"),
                       strategy=strategy)
    spread = {a: np.ptp(np.asarray(v), axis=0) > 0 for a, v in out.items()}  # which coordinate differs
    assert [spread[a].tolist() for a in ("control", "env", "policy", "all")] == [
        [False, False], [True, False], [False, True], [True, True]]
    np.testing.assert_array_equal(np.asarray(out["env"])[:, 1], np.asarray(out["control"])[:, 1])
    with pytest.raises(UsageError, match="arm 'unused' varies unused, which neither init nor step reads"):
        nj.replicate(init, step, steps=2, arms="unused", sources=("env", "policy", "unused"))
    with pytest.raises(UsageError, match="source name 'dropout' is taken"):
        nj.replicate(init, step, steps=2, sources=("dropout",))


NET_MODULE = '''
import flax.linen as nn
import jax
import jax.numpy as jnp


class Net(nn.Module):
    num_classes: int

    @nn.compact
    def __call__(self, x, train: bool):
        return nn.Dense(self.num_classes)(nn.relu(nn.Dense(16)(x.reshape(x.shape[0], -1))))
'''


PARTS_MODULE = NET_MODULE + '''
import jax, jax.numpy as jnp, optax

tx = optax.adam(3e-3)  # the user's own optimiser


def smooth_ce(logits, labels):  # per-example label-smoothed cross-entropy
    onehot = optax.smooth_labels(jax.nn.one_hot(labels, logits.shape[-1]), 0.1)
    return optax.softmax_cross_entropy(logits, onehot)


def noise(key, x):  # the user's own augmentation
    return x + 0.1 * jax.random.normal(key, x.shape, x.dtype)
'''


@pytest.mark.slow
def test_cli_takes_the_same_parts_as_run_study(tmp_path):
    """--optimizer/--loss/--augment/--features import the user's parts by name: the run folder records them,
    the hardware arm's child processes import them again, and the study is the one run_study runs on the
    same parts in memory (the same fingerprints, the same logits up to rounding)."""
    (tmp_path / "myparts.py").write_text(PARTS_MODULE)
    np.savez(tmp_path / "mine.npz", **dict(zip(("x_train", "y_train", "x_test", "y_test"), own_arrays())))
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    cmd = [sys.executable, "-m", "nondet_jax", "sweep", "--model", "myparts:Net", "--optimizer", "myparts:tx",
           "--loss", "myparts:smooth_ce", "--augment", "myparts:noise", "--features", "Dense_0", "--dataset",
           str(tmp_path / "mine.npz"), "--arms", "control,augmentation,hardware", "--replicas", "2", "--epochs", "2",
           "--batch-size", "32", "--no-progress", "--set", "metrics.lmc_pairs=0", "--out", str(tmp_path / "cli")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ident = json_of(tmp_path / "cli" / "model.json")["identity"]
    assert (ident["optimizer"]["name"], ident["loss"]["name"], ident["augment"]["name"]) == (
        "myparts:tx", "myparts:smooth_ce", "myparts:noise")
    assert json_of(tmp_path / "cli" / "config.json")["train"]["loss"] == "myparts:smooth_ce"
    assert (tmp_path / "cli" / "arms" / "hardware.json").exists()  # trained in child processes
    aug = np.load(tmp_path / "cli" / "logits" / "augmentation.npy")
    assert not np.array_equal(aug[0], aug[1])  # the user's augmentation draws from each replica's key
    sys.path.insert(0, str(tmp_path))
    try:
        import myparts
        data = np.load(tmp_path / "mine.npz")
        nj.run_study(model=myparts.Net, data=tuple(data[k] for k in ("x_train", "y_train", "x_test", "y_test")),
                     optimizer=myparts.tx, loss=myparts.smooth_ce, augment=myparts.noise, features="Dense_0",
                     epochs=2, batch_size=32, arms="control,augmentation", replicas=2, out=tmp_path / "api",
                     settings={"metrics.lmc_pairs": 0}, **QUIET)
    finally:
        sys.path.remove(str(tmp_path))
    api = json_of(tmp_path / "api" / "model.json")["identity"]
    for part in ("model", "optimizer", "loss", "augment"):
        assert api[part]["sha256"] == ident[part]["sha256"], part
    # the same training up to rounding: the CLI runs under the CPU type's measured XLA flags, this process not
    np.testing.assert_allclose(np.load(tmp_path / "api" / "logits" / "augmentation.npy"), aug, rtol=1e-3, atol=1e-5)
    # --init-from: fine-tune from replica 0 of that run's weights, the first layer only (a new head)
    w = np.load(tmp_path / "cli" / "weights" / "control.npz")
    np.savez(tmp_path / "body.npz", **{k: w[k] for k in w.files if k.startswith("params/Dense_0/")})
    fine = subprocess.run(cmd[:cmd.index("--arms")] + ["--arms", "control,init", "--replicas", "2", "--epochs", "1",
                                                       "--init-from", str(tmp_path / "body.npz@0"), "--no-progress",
                                                       "--out", str(tmp_path / "fine")],
                          capture_output=True, text=True, env=env, cwd=tmp_path)
    assert fine.returncode == 0, fine.stderr[-3000:]
    assert json_of(tmp_path / "fine" / "model.json")["identity"]["init_params"]["name"] == str(tmp_path / "body.npz@0")
    bad = subprocess.run(cmd[:4] + ["--optimizer", "myparts:noise", "--out", str(tmp_path / "bad")],
                         capture_output=True, text=True, env=env, cwd=tmp_path)
    assert bad.returncode == 2 and "cannot be called without arguments" in bad.stderr, bad.stderr
    assert not (tmp_path / "bad").exists()


@pytest.mark.slow
def test_cli_takes_model_and_dataset(tmp_path):
    (tmp_path / "mynets.py").write_text(NET_MODULE)
    np.savez(tmp_path / "mine.npz", **dict(zip(("x_train", "y_train", "x_test", "y_test"), own_arrays())))
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    cmd = [sys.executable, "-m", "nondet_jax", "sweep", "--model", "mynets:Net", "--dataset",
           str(tmp_path / "mine.npz"), "--arms", "control,init,all", "--replicas", "3", "--epochs", "2",
           "--batch-size", "32", "--augment", "off", "--instruments", "economy", "--no-progress",
           "--out", str(tmp_path / "run")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    values = np.load(tmp_path / "run" / "instruments" / "init.npz")  # the instruments on your own model
    assert values["NormTest"].shape == (3, 8) and np.isfinite(values["NormTest"]).all()
    assert (tmp_path / "run" / "figures" / "instruments_init.png").stat().st_size > 10_000
    control = np.load(tmp_path / "run" / "logits" / "control.npy")
    init = np.load(tmp_path / "run" / "logits" / "init.npy")
    assert all(np.array_equal(control[0], c) for c in control) and not np.array_equal(init[0], init[1])
    assert (tmp_path / "run" / "report.md").exists()
    assert '"model": "mynets:Net"' in (tmp_path / "run" / "model.json").read_text()
    # The module changes under the same name: the resume is refused with the diff, exit 2. The module lies in
    # the current directory, so --resume imports it only when the user names it again (issue 41).
    (tmp_path / "mynets.py").write_text(NET_MODULE.replace("Dense(16)", "Dense(8)"))
    proc = subprocess.run([sys.executable, "-m", "nondet_jax", "sweep", "--resume", str(tmp_path / "run"),
                           "--no-progress"], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert proc.returncode == 2 and "add --model mynets:Net if you trust it" in proc.stderr, proc.stderr
    proc = subprocess.run([sys.executable, "-m", "nondet_jax", "sweep", "--resume", str(tmp_path / "run"),
                           "--model", "mynets:Net", "--no-progress"], capture_output=True, text=True, env=env,
                          cwd=tmp_path)
    assert "model.name mynets:Net is imported because you gave --model mynets:Net" in proc.stdout
    assert proc.returncode == 2 and "another model (" in proc.stderr and "(6, 16) float32 -> (6, 8) float32" in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("script", ["digits_cnn.py", "wine_mlp.py", "own_step.py", "finetune.py", "methods.py"])
def test_examples_run(script, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / script), str(tmp_path / "run")],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "control" in proc.stdout


class HeadNet(nn.Module):
    num_classes: int = 3

    @nn.compact
    def __call__(self, x, train: bool):
        return nn.Dense(self.num_classes, name="head")(nn.relu(nn.Dense(8, name="body")(x)))


def _body(seed=0):
    rng = np.random.default_rng(seed)
    return {"body": {"kernel": rng.normal(size=(6, 8)).astype(np.float32), "bias": np.zeros(8, np.float32)}}


def test_init_params_start_every_replica_from_the_given_weights():
    """The given body in every replica of every arm, bitwise; the init key draws only the head; bitflip
    moves one weight of the result."""
    from conftest import one_replica

    from nondet_jax.config import from_flat
    from nondet_jax.train import DataSpec, make_train

    body = _body()
    fns = make_train(from_flat({"train.batch_size": 32}), DataSpec(128, (6,), 3, "arrays"),
                     nj.Parts(model=HeadNet, optimizer=optax.sgd(0.1), init_params=body))
    x = jnp.zeros((1, 6))
    states = [fns.init(*one_replica("init", r), x) for r in range(2)]
    for st in states:
        np.testing.assert_array_equal(st.params["body"]["kernel"], body["body"]["kernel"])
    assert not np.array_equal(states[0].params["head"]["kernel"], states[1].params["head"]["kernel"])
    flipped = fns.init(*one_replica("bitflip"), x)
    moved = sum(int((np.asarray(a) != np.asarray(b)).sum()) for a, b in
                zip(jax.tree.leaves(flipped.params), jax.tree.leaves(states[0].params)))
    assert moved >= 1


def test_init_params_are_part_of_the_study_by_content(tmp_path):
    data = own_arrays()
    run = dict(model=HeadNet, data=data, optimizer=optax.sgd(0.05), epochs=1, batch_size=32, arms="control,init",
               replicas=2, out=tmp_path / "run", settings={"metrics.lmc_pairs": 0}, **QUIET)
    nj.run_study(init_params=_body(), **run)
    ident = json_of(tmp_path / "run" / "model.json")["identity"]["init_params"]
    assert ident["name"] == "in memory" and ident["parameters"] == 2
    with pytest.raises(UsageError, match="the init_params differs"):
        nj.run_study(init_params=_body(seed=1), **run)  # one weight set for another: not this folder's study
    np.savez(tmp_path / "body.npz", **{"params/body/kernel": _body()["body"]["kernel"],
                                       "params/body/bias": _body()["body"]["bias"]})
    nj.run_study(init_params=tmp_path / "body.npz", **run)  # the same weights from a file: the same study, reused
    import orbax.checkpoint as ocp

    ck = ocp.StandardCheckpointer()
    ck.save(tmp_path / "orbax", {"params": _body()})
    ck.wait_until_finished()
    nj.run_study(init_params=tmp_path / "orbax", **run)  # and from an orbax checkpoint folder
    with pytest.raises(UsageError, match="not an orbax checkpoint"):
        nj.load_params(tmp_path / "run")
    with pytest.raises(UsageError, match=r"init_params 'body/kernel' has shape \(6, 4\), the model's is \(6, 8\)"):
        nj.run_study(init_params={"body": {"kernel": np.zeros((6, 4), np.float32)}}, **{**run, "out": tmp_path / "b"})
    with pytest.raises(UsageError, match="init_params holds 'neck/kernel', which the model has no parameter of"):
        nj.run_study(init_params={"neck": {"kernel": np.zeros(3)}}, **{**run, "out": tmp_path / "c"})
    whole = {**_body(), "head": {"kernel": np.zeros((8, 3), np.float32), "bias": np.zeros(3, np.float32)}}
    with pytest.raises(UsageError, match="arm 'init' varies only init, which is drawing nothing"):
        nj.run_study(init_params=whole, **{**run, "out": tmp_path / "d"})
    assert not any((tmp_path / n).exists() for n in "bcd")


@pytest.mark.parametrize("model", [OwnNet, NNXNet])
def test_load_replica_gives_the_trained_model_back(tmp_path, model):
    data = own_arrays()
    r = nj.run_study(model=model, data=data, optimizer=optax.adam(1e-2), epochs=2, batch_size=32, arms="control,init",
                     replicas=2, out=tmp_path / "run", settings={"metrics.lmc_pairs": 0}, **QUIET)
    x_test = jnp.asarray(data[2])
    for rep in range(2):
        if model is OwnNet:
            variables = r.load_replica("init", rep)
            assert set(variables) == {"params", "batch_stats"} and variables["batch_stats"]
            logits = OwnNet().apply(variables, x_test, train=False)
        else:
            logits = r.load_replica("init", rep, model=NNXNet)(x_test)
        np.testing.assert_allclose(logits, r.logits["init"][rep], rtol=1e-5, atol=1e-6)
    with pytest.raises(UsageError, match="has replicas 0 .. 1; got replica=2"):
        r.load_replica("init", 2)
    with pytest.raises(UsageError, match="arm 'nosuch' has no stored weights"):
        r.load_replica("nosuch", 0)


def test_python_m_nondet_jax_lists_its_commands():
    proc = subprocess.run([sys.executable, "-m", "nondet_jax", "--help"], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0 and "sweep" in proc.stdout and "report" in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "nondet_jax", "nosuch"], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2 and "unknown command 'nosuch'" in proc.stderr


def test_nnx_module_through_split_and_merge(tmp_path):
    r = nj.run_study(model=NNXNet, data=own_arrays(), optimizer=optax.adam(1e-2), epochs=1, batch_size=32,
                     arms="control,init,dropout", replicas=2, settings={"metrics.lmc_pairs": 0},
                     out=tmp_path / "run", **QUIET)
    control = r.logits["control"]
    assert np.array_equal(control[0], control[1])
    assert not np.array_equal(r.logits["init"][0], r.logits["init"][1])
    assert not np.array_equal(r.logits["dropout"][0], r.logits["dropout"][1])  # the dropout source reaches NNX


def test_replicate_bitflip_on_any_tree_only_where_the_arm_varies_it():
    import jax
    import jax.numpy as jnp

    from nondet_jax.sources import bitflip

    def init(keys):  # no 'kernel' leaf: a hand-written parameter tree
        params = {"w": jax.random.normal(jax.random.key(7), (3, 4)), "b": jnp.zeros(4)}
        return bitflip(params, keys)

    def step(state, batch, keys):
        return state

    out = nj.replicate(init, step, steps=1, arms="control,bitflip", replicas=3)
    # the weights as the program computes them (an eager jax.random.normal may differ from the compiled one in a
    # last bit under another XLA:CPU emitter, the CPU rule's, which a study run earlier in this process sets)
    base = np.asarray(out["control"]["w"][0])
    assert np.allclose(base, jax.random.normal(jax.random.key(7), (3, 4)), rtol=1e-6, atol=0)
    assert all(np.array_equal(w, base) for w in out["control"]["w"])  # control is never flipped: one set of weights
    ulps = [np.abs(w.view(np.int32) - np.asarray(base).view(np.int32)) for w in np.asarray(out["bitflip"]["w"])]
    assert [int(u.sum()) for u in ulps] == [1, 1, 1] and not np.array_equal(ulps[0], ulps[1])
    assert not np.any(out["bitflip"]["b"])  # zeros are never the flipped weight


def test_replicate_refuses_arms_whose_sources_are_never_read_and_bad_seeds():
    import jax

    def init(keys):
        return jax.random.normal(keys.init, (2,))

    def step(state, batch, keys):
        return state + 0.0 * jax.numpy.where(keys.varies("dropout"), 1.0, 0.0)  # asks, never draws

    with pytest.raises(UsageError, match=r"arm 'dropout' varies dropout, which neither init nor step reads"):
        nj.replicate(init, step, steps=2, arms="control,dropout")
    out = nj.replicate(init, step, steps=2, arms="control,all", replicas=2)  # all: init is read
    assert not np.array_equal(out["all"][0], out["all"][1])
    for kwargs, message in [({"seed": 2**32}, "seed must be an integer in 0 .. 4294967295"),
                            ({"seed": -1}, "seed must be an integer"),
                            ({"arms": "init,init"}, "arm 'init' is named twice"),
                            ({"steps": -3}, "steps must be an integer >= 1, got -3"),
                            ({"steps": 2.5}, "steps must be an integer >= 1, got 2.5")]:
        with pytest.raises(UsageError, match=message):
            nj.replicate(init, step, **{"steps": 2, **kwargs})
    for batches, steps, message in [((np.ones((8, 4)),), 4, r"steps=4 but batches holds 8 steps"),
                                    ((np.ones((8, 4)), np.ones((5, 4))), None, r"the same leading step axis .* \[5, 8\]")]:
        with pytest.raises(UsageError, match=message):  # lax.scan said so deep in JAX, in its own words
            nj.replicate(init, step, batches, steps=steps, arms="control,init")


class NoDropout(nn.Module):
    num_classes: int = 3

    @nn.compact
    def __call__(self, x, train: bool):
        return nn.Dense(self.num_classes)(x)


def test_run_study_refuses_sources_the_users_parts_do_not_have(tmp_path):
    kwargs = dict(data=own_arrays(), optimizer=optax.sgd(0.05), epochs=1, batch_size=32, replicas=2,
                  out=tmp_path / "run", **QUIET)
    with pytest.raises(UsageError, match=r"arm 'dropout' varies only dropout, which is absent from your model"):
        nj.run_study(model=NoDropout, arms="control,dropout", **kwargs)
    with pytest.raises(UsageError, match=r"never drawn by your augment function"):
        nj.run_study(model=NoDropout, arms="control,augmentation", augment=lambda key, x: x * 1.0, **kwargs)
    with pytest.raises(UsageError, match=r"pass an augmentation of your own, .*the built-in crops and flips need images"):
        nj.run_study(model=NoDropout, arms="control,augmentation", **kwargs)  # (N, features): not --augment on
    assert not (tmp_path / "run").exists()
    result = nj.run_study(model=OwnNet, arms="control,dropout", settings={"metrics.lmc_pairs": 0}, **kwargs)
    assert not np.array_equal(result.logits["dropout"][0], result.logits["dropout"][1])  # OwnNet has dropout
    report = result.report.read_text()
    assert "batch_order: this model draws one dropout mask per batch position" in report
    assert "linear CKA of the logits (the model exposes no features)" in report


class Tokens(nn.Module):
    num_classes: int = 2

    @nn.compact
    def __call__(self, x, train: bool):
        return nn.Dense(self.num_classes)(nn.Embed(50, 8)(x).mean(1))


def test_integer_inputs_keep_their_dtype_for_embeddings(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.integers(0, 50, size=(96, 7))
    y = (x[:, 0] > 25).astype(int)
    result = nj.run_study(model=Tokens, data=(x[:64], y[:64], x[64:], y[64:]), optimizer=optax.adam(1e-2),
                          epochs=2, batch_size=16, arms="control,init", replicas=2, out=tmp_path / "run",
                          settings={"metrics.lmc_pairs": 0}, **QUIET)
    assert result.logits["init"].shape == (2, 32, 2)
    assert "the model has no BatchNorm, so nothing is recomputed" in result.report.read_text()
    assert json_of(tmp_path / "run" / "model.json")["identity"]["data"]["shapes"]["x_train"] == [[64, 7], "int32"]


def json_of(path):
    import json

    return json.loads(path.read_text())


class PlainMLP(nn.Module):
    """A user's module with neither BatchNorm nor dropout: both per-example modes see the same gradients."""

    num_classes: int = 3

    @nn.compact
    def __call__(self, x, train: bool):
        return nn.Dense(self.num_classes)(nn.tanh(nn.Dense(8)(x.reshape(x.shape[0], -1))))


INSTRUMENTED = {"instruments.config": "economy,HessTrace,TICTrace", "metrics.lmc_pairs": 0}


def _instrumented(model, out, **settings):
    r = nj.run_study(model=model, data=own_arrays(), optimizer=optax.sgd(0.05), epochs=1, batch_size=32,
                     arms="control", replicas=2, settings={**INSTRUMENTED, **settings}, out=out, **QUIET)
    return r, dict(np.load(out / "instruments" / "control.npz"))


def test_instruments_on_own_linen_module_with_batchnorm_and_dropout(tmp_path):
    """Instruments on the user's own parts (their Linen module, optax chain, arrays): every quantity is
    finite at every tracked step, the two control replicas measure the same, and curvature is positive."""
    _, values = _instrumented(OwnNet, tmp_path / "run")
    np.testing.assert_array_equal(values["step"], [0, 1, 2, 3])
    for k in ("Loss", "GradNorm", "NormTest", "InnerTest", "HessTrace", "TICTrace", "Distance", "UpdateSize"):
        assert np.isfinite(values[k]).all(), k
        np.testing.assert_array_equal(values[k][0], values[k][1], err_msg=k)  # control: bitwise identical
    np.testing.assert_allclose(values["Loss"], values["loss"], rtol=1e-5)  # the instrument sees the step's loss
    assert (values["HessTrace"] > 0).all() and (values["TICTrace"] > 0).all()


def test_instruments_on_own_nnx_module(tmp_path):
    _, values = _instrumented(NNXNet, tmp_path / "run")
    for k in ("Loss", "GradNorm", "NormTest", "HessTrace", "TICTrace"):
        assert np.isfinite(values[k]).all(), k
    assert (values["HessTrace"] > 0).all()


def test_own_model_without_batchnorm_or_dropout_measures_the_same_in_both_per_example_modes(tmp_path):
    """train_pass (per-example gradients from the training pass's own backward) and frozen_bn (a
    separate pass through the model's evaluate) agree where the two passes are the same function."""
    got = {mode: _instrumented(PlainMLP, tmp_path / mode, **{"instruments.per_example": mode})[1]
           for mode in ("train_pass", "frozen_bn")}
    for k in ("Loss", "GradNorm", "NormTest", "InnerTest", "OrthoTest", "HessTrace", "TICTrace"):
        np.testing.assert_allclose(got["train_pass"][k], got["frozen_bn"][k], rtol=2e-4, atol=1e-7, err_msg=k)


class LayerNormNet(nn.Module):
    """A layer the per-example recorder does not take: the instruments go through vmap(grad)."""

    num_classes: int = 3

    @nn.compact
    def __call__(self, x, train: bool):
        return nn.Dense(self.num_classes)(nn.LayerNorm()(nn.Dense(8)(x.reshape(x.shape[0], -1))))


def test_instruments_path_is_said_once_in_the_log_and_environment_json(tmp_path):
    lines = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        nj.run_study(model=LayerNormNet, data=own_arrays(), optimizer=optax.sgd(0.05), epochs=1, batch_size=32,
                     arms="control", replicas=2, settings=INSTRUMENTED, out=tmp_path / "run", log=lines.append)
    said = [ln for ln in lines if "vmap(grad)" in ln]
    assert len(said) == 1 and "LayerNorm" in said[0], lines
    assert not [w for w in caught if "vmap(grad)" in str(w.message)]  # not again as a warning while training
    path = json_of(tmp_path / "run" / "environment.json")["instruments_path"]
    assert path["per_example"] == "vmap(grad)" and path["why"] == said
    assert np.isfinite(np.load(tmp_path / "run" / "instruments" / "control.npz")["NormTest"]).all()
    _instrumented(PlainMLP, tmp_path / "plain")  # layers the recorder takes: the recorded pass, nothing said
    assert json_of(tmp_path / "plain" / "environment.json")["instruments_path"] == {"per_example": "recorded pass",
                                                                                      "why": []}


class BNNet(nn.Module):
    num_classes: int = 3
    momentum: float = 0.99  # Flax's default

    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.BatchNorm(use_running_average=not train, momentum=self.momentum)(nn.Dense(8)(x))
        return nn.Dense(self.num_classes)(nn.relu(x))


class NNXBN(nnx.Module):
    def __init__(self, num_classes, rngs):
        self.l1, self.bn = nnx.Linear(6, 8, rngs=rngs), nnx.BatchNorm(8, momentum=0.95, rngs=rngs)
        self.l2 = nnx.Linear(8, num_classes, rngs=rngs)

    def __call__(self, x):
        return self.l2(self.bn(self.l1(x)))


@pytest.mark.parametrize("model, says", [(BNNet, "momentum 0.99 over this study's 8 training steps leaves 92%"),
                                         (functools.partial(BNNet, momentum=0.5), None),
                                         (NNXBN, "momentum 0.95 over this study's 8 training steps leaves 66%")])
def test_batchnorm_that_cannot_converge_in_the_study_is_said(tmp_path, model, says):
    lines = []
    nj.run_study(model=model, data=own_arrays(), epochs=2, batch_size=32, arms="control", replicas=1,
                 out=tmp_path / "run", settings={"metrics.lmc_pairs": 0, "metrics.pairwise": False}, log=lines.append)
    notes = [ln for ln in lines if "BatchNorm momentum" in ln]
    assert (notes and says in notes[0] and "use momentum <= 0.69" in notes[0]) if says else not notes, lines


class HalfNet(nn.Module):
    """A user's module computing in bfloat16 (its history and outputs come back in bfloat16)."""

    num_classes: int = 3

    @nn.compact
    def __call__(self, x, train: bool):
        return nn.Dense(self.num_classes, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)(x)


def test_a_bfloat16_model_is_stored_and_reported(tmp_path):
    """.npz has no bfloat16: the run folder stores such arrays as float32 (exactly), so the report reads them."""
    result = nj.run_study(model=HalfNet, data=own_arrays(), optimizer=optax.sgd(0.1), epochs=1, batch_size=32,
                          arms="control,init", replicas=2, out=tmp_path / "run",
                          settings={"metrics.lmc_pairs": 0}, **QUIET)
    assert result.report.exists() and (tmp_path / "run" / "curves.csv").exists()
    with np.load(tmp_path / "run" / "history" / "init.npz") as h:
        assert h["train_loss"].dtype == np.float32 and np.isfinite(h["train_loss"]).all()
    with np.load(tmp_path / "run" / "weights" / "init.npz") as w:
        assert all(w[k].dtype == np.float32 for k in w.files)


def test_settings_your_own_optimizer_would_ignore_are_refused(tmp_path):
    """With your own optimizer, its learning rate and schedule are its own: optim.* settings, a method's optim.*
    overrides and snapshot arms were silently ignored (a methods study compared a method with itself)."""
    from nondet_jax.cli import sweep

    study = dict(model=OwnNet, data=own_arrays(), optimizer=optax.adam(1e-2), epochs=1, batch_size=32, replicas=2,
                 out=tmp_path / "run", **QUIET)
    with pytest.raises(UsageError, match=r"optim.lr \(set by settings=\) does not apply: .* your own optimizer"):
        nj.run_study(arms="init", settings={"optim.lr": 5.0}, **study)
    with pytest.raises(UsageError, match=r"method 'lr10x': optim.lr \(set by the method\) does not apply"):
        nj.run_study(arms="init", methods={"base": {}, "lr10x": {"optim.lr": 0.5}}, **study)
    with pytest.raises(UsageError, match=r"method 'b': optim.momentum \(set by the method\)"):
        nj.run_study(**{**study, "optimizer": None}, arms="init",
                     methods={"a": {}, "b": {"optimizer": optax.sgd(0.1), "optim.momentum": 0.5}})
    with pytest.raises(UsageError, match=r"arm 'init@snapshot2' .* your own optimizer does not follow"):
        nj.run_study(**{**study, "epochs": 2}, arms="init@snapshot2")
    assert not (tmp_path / "run").exists()
    for argv, flag in ((["--lr", "0.7"], "--lr"), (["--set", "optim.momentum=0.5"], "--set")):
        with pytest.raises(UsageError, match=f"optim.(lr|momentum) \\(set by {flag}\\) does not apply"):
            sweep.config_from_args(sweep.build_parser().parse_args(["--optimizer", "mypkg.opt:adam", *argv]))
    assert sweep.config_from_args(sweep.build_parser().parse_args(["--set", "optim.name=mypkg.opt:adam"])).optim.name \
        == "mypkg.opt:adam"  # the name chooses the optimizer: that one applies


def test_optimizers_a_step_cannot_drive_are_refused_and_typed_keys_are_counted(tmp_path):
    """optax.lbfgs (a line search) and contrib.reduce_on_plateau need value= in update, which a study's step does
    not pass: one line before anything is written. noisy_sgd keeps a typed PRNG key in its state, which the memory
    check could not size."""
    from nondet_jax.study.memory import _bytes

    for tx, needs in ((optax.lbfgs(), "'value', 'grad', and 'value_fn'"),
                      (optax.chain(optax.adam(1e-2), optax.contrib.reduce_on_plateau()), "'value'")):
        with pytest.raises(UsageError, match=f"your optimizer's update needs {needs}, which a study's training step"):
            nj.run_study(model=OwnNet, data=own_arrays(), optimizer=tx, epochs=1, batch_size=32, arms="control",
                         replicas=2, out=tmp_path / "run", **QUIET)
    assert not (tmp_path / "run").exists()
    assert _bytes({"key": jax.random.key(0), "w": jnp.ones(3)}) == 8 + 12


def test_bool_labels_are_classes_and_float_labels_read_as_a_regression_are_said(tmp_path):
    """Labels from pandas or a CSV: bools were refused as "not whole numbers"; float 0/1 labels became a regression
    without a word (the float dtype asks for one: said in the log, with the fix)."""
    x_tr, y_tr, x_te, y_te = own_arrays()
    study = dict(model=OwnNet, optimizer=optax.sgd(0.05), epochs=1, batch_size=32, arms="control", replicas=2,
                 settings={"metrics.lmc_pairs": 0})
    result = nj.run_study(data=(x_tr, y_tr > 0, x_te, y_te > 0), out=tmp_path / "bool", **study, **QUIET)
    assert result.logits["control"].shape[-1] == 2 and "accuracy_mean_pct" in result.table[0]
    lines: list[str] = []
    result = nj.run_study(data=(x_tr, y_tr.astype(np.float32), x_te, y_te.astype(np.float32)), out=tmp_path / "float",
                          **study, log=lines.append)
    assert "mse_mean" in result.table[0]
    assert any("whole numbers (3 distinct values), read as a regression" in ln and "task='classification'" in ln
               for ln in lines), lines
    lines.clear()
    one_hot = [np.eye(3, dtype=np.float32)[y] for y in (y_tr, y_te)]
    nj.run_study(data=(x_tr, one_hot[0], x_te, one_hot[1]), out=tmp_path / "onehot", **study, log=lines.append)
    assert any("looks one-hot" in ln and "y.argmax(1) (task='classification')" in ln for ln in lines), lines


class NoTrainArg(nn.Module):
    num_classes: int = 3

    @nn.compact
    def __call__(self, x, deterministic: bool = True):
        return nn.Dense(self.num_classes)(x)


class NoiseStream(nn.Module):
    num_classes: int = 3

    @nn.compact
    def __call__(self, x, train: bool):
        x = x + 0.1 * jax.random.normal(self.make_rng("noise"), x.shape) if train else x
        return nn.Dense(self.num_classes)(x)


class Counter(nn.Module):
    num_classes: int = 3

    @nn.compact
    def __call__(self, x, train: bool):
        n = self.variable("counter", "n", lambda: jnp.zeros((), jnp.int32))
        if train and not self.is_initializing():
            n.value += 1
        return nn.Dense(self.num_classes)(x)


class NNXTrainArg(nnx.Module):
    def __init__(self, num_classes, rngs):
        self.l = nnx.Linear(6, num_classes, rngs=rngs)

    def __call__(self, x, train: bool):
        return self.l(x)


class NNXOwnRngs(nnx.Module):  # ignores the rngs it is given: every replica starts from the same weights
    def __init__(self, num_classes, rngs):
        self.l = nnx.Linear(6, num_classes, rngs=nnx.Rngs(0))

    def __call__(self, x):
        return self.l(x)


@pytest.mark.parametrize("model,says", [
    (NoTrainArg, "__call__ takes no train argument; a Linen model is called as model(x, train=True)"),
    (NNXTrainArg, "__call__ requires train besides its input; an NNX model is called as model(x)"),
    (NoiseStream, "draws random numbers from the rng stream 'noise', which a study does not give"),
    (Counter, "keeps variables in the collection 'counter', which a study does not carry"),
    (NNXOwnRngs, "arm 'init' varies only init, which is never drawn by your model's initialisation")])
def test_models_a_study_cannot_drive_are_refused_in_one_line(tmp_path, model, says):
    """Each was a TypeError or a flax error from deep inside a trace (or, the last, R copies of control)."""
    with pytest.raises(UsageError, match=re.escape(says)):
        nj.run_study(model=model, data=own_arrays(), optimizer=optax.sgd(0.05), epochs=1, batch_size=32,
                     arms="control,init", replicas=2, out=tmp_path / "run", **QUIET)
    assert not (tmp_path / "run").exists()


def test_cabs_and_early_stopping_refused_with_own_optimizer(tmp_path):
    with pytest.raises(UsageError, match="CABS assumes plain SGD.*your own optimizer"):
        _instrumented(PlainMLP, tmp_path / "run", **{"instruments.config": "Loss,CABS"})
    assert not (tmp_path / "run").exists()


def test_dir_lists_the_api_for_tab_completion():
    """The API's names load on first use, yet dir(nondet_jax) (what IPython and Jupyter complete from) lists them."""
    import subprocess
    import sys

    code = ("import nondet_jax as nj, sys; names = dir(nj); print(sorted(set(nj.__all__) - set(names)), "
            "'jax' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.split()
    assert out == ["[]", "False"], out  # every API name listed, and listing them started no JAX


@pytest.fixture(scope="module")
def decomposed(tmp_path_factory):
    """A small study with every table: test curves (study.eval_every), a decomposition, pairs and an LMC pair."""
    out = tmp_path_factory.mktemp("decomposed") / "run"
    return nj.run_study(model="mlp", data="digits", epochs=2, batch_size=128, arms="control,init,data_order,all",
                        replicas=3, out=out, settings={"study.eval_every": 1, "metrics.decomposition": True,
                                                       "metrics.lmc_pairs": 1}, **QUIET)


def test_every_table_in_one_naming_scheme(decomposed):
    """to_frame's kinds, the run folder's CSVs, the arm records and `compare --metric` name a score alike, with the
    same values (the tables in their unit column's unit); control, which varies nothing, gets no test's p-value."""
    import csv

    from nondet_jax.analysis.compare import run_scores
    from nondet_jax.analysis.task import RUN_METRICS as BY_TASK
    from nondet_jax.report.frames import COLUMNS

    RUN_METRICS = BY_TASK["classification"]

    r, tmp_path = decomposed, decomposed.out.parent
    frames = {kind: r.to_frame(kind) for kind in COLUMNS if kind != "instruments"}
    for kind, frame in frames.items():
        assert list(frame.columns) == list(COLUMNS[kind]) and len(frame), kind
        with open(tmp_path / "run" / f"{kind}.csv", newline="") as f:  # the CSV holds the same table
            on_disk = list(csv.DictReader(f))
        assert len(on_disk) == len(frame) and list(on_disk[0]) == list(COLUMNS[kind]), kind
        cells = [["" if v is None or v != v else str(v) for v in row] for row in frame.itertuples(index=False)]
        assert cells == [[row[c] for c in COLUMNS[kind]] for row in on_disk], kind  # every cell, NaN empty
    reps = frames["replicas"]
    assert set(reps.metric) == set(RUN_METRICS)  # the names compare --metric takes, and no other
    for metric in RUN_METRICS:
        scores, _ = run_scores(tmp_path / "run", "init", metric)
        values = reps.query("arm == 'init' and metric == @metric")
        scale = 100.0 if values.unit.iloc[0] == "%" else 1.0
        np.testing.assert_allclose(values.value.to_numpy() / scale, scores, rtol=1e-12)
    record = __import__("json").loads((tmp_path / "run" / "arms" / "init.json").read_text())
    assert set(RUN_METRICS) <= set(record["rows"][0])
    curves, best = frames["curves"], frames["best"]
    assert set(curves.metric) == set(RUN_METRICS) and set(curves.epoch) == {1, 2}
    last = curves.query("arm == 'init' and metric == 'test_accuracy' and epoch == 2").value.to_numpy()
    np.testing.assert_allclose(last, reps.query("arm == 'init' and metric == 'test_accuracy'").value, rtol=1e-12)
    assert set(best.metric) == {"test_accuracy"} and (best.value >= 0).all() and set(best.epoch) <= {1, 2}
    dec = frames["decomposition"]
    assert set(dec.metric) == {"test_accuracy", "test_loss"}
    assert set(dec.term) == {"init", "data_order", "sum", "non_additivity"}
    share = r.summary["decomposition"]["accuracy"]["shares"]["init"]["share"]
    assert dec.query("metric == 'test_accuracy' and term == 'init'").value.item() == pytest.approx(share)
    pairs = frames["pairs"]
    assert len(pairs.query("arm == 'init' and metric == 'disagreement'")) == 3  # R(R-1)/2 pairs of 3 replicas
    mean = r.summary["arms"]["init"]["metrics"]["disagreement"]["mean"]
    assert pairs.query("arm == 'init' and metric == 'disagreement'").value.mean() == pytest.approx(100 * mean)
    with pytest.raises(UsageError, match="no instruments.*instruments.config"):
        r.to_frame("instruments")
    control = r.summary["vs_all"]["control"]["accuracy"]
    assert control["spread_p"] is control["f_test_p"] is control["brown_forsythe_p"] is control["spread_p_holm"] is None
    assert r.summary["vs_all"]["init"]["accuracy"]["f_test_p"] is not None
    # 3 replicas: the report says the numbers cannot rank the sources, and where an interval outgrows the range
    report = r.report.read_text()
    assert "**Too few replicas to rank the sources**: with 3 replicas" in report
    wide = [a for a in r.summary["arms"] if a != "control"
            and np.diff(r.summary["arms"][a]["metrics"]["accuracy"]["std_ci"])[0]
            > np.ptp(reps.query("arm == @a and metric == 'test_accuracy'").value) / 100 > 0]
    assert wide and all(f"- `{a}`: the 95% interval of the accuracy std" in report for a in wide)
    assert "Holm-adjusted over 2 arms" in report  # init and data_order: not control (untested), not all (the reference)


def test_api_errors_name_the_parameter_not_the_option(tmp_path):
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(UsageError) as e:
        nj.run_study(model="mlp", data="digits", epochs=1, arms="control", replicas=1, out=tmp_path / "run", **QUIET)
    assert "use replicas=2 or more or settings={'metrics.pairwise': False}" in str(e.value), str(e.value)
    with pytest.raises(UsageError) as e:
        nj.run_study(model="mlp", data="digits", epochs=1, arms="control", replicas=2, out=tmp_path / "file", **QUIET)
    assert "out=" in str(e.value) and "--" not in str(e.value), str(e.value)
    with pytest.raises(UsageError, match="pass a study's out= folder"):
        nj.decompose(tmp_path)


def test_figures_name_what_they_show(decomposed):
    """Each figure of the report, read from the figure objects: a title, every drawn panel's axes labelled (units
    in the value axis), the arms by name, and the interval's method named where the figure draws intervals."""
    import matplotlib.pyplot as plt

    from nondet_jax.report.figures import draw_figures, interval_name
    from nondet_jax.report.summary import load_records

    arms = list(decomposed.summary["arms"])
    seen = {}
    for name, fig in draw_figures(decomposed.out, decomposed.summary, load_records(decomposed.out)[1]):
        title = fig._suptitle.get_text() if fig._suptitle else ""
        axes = [ax for ax in fig.axes if ax.get_visible() and ax.axison]
        texts = []
        for ax in axes:
            shared = ax.get_shared_y_axes().get_siblings(ax)  # panels sharing a y axis: labelled once, on the left
            assert ax.get_xlabel() and any(other.get_ylabel() for other in shared), (name, ax.get_title())
            texts += [ax.get_title(), *(t.get_text() for t in ax.get_xticklabels())]
            if ax.get_legend():
                texts += [t.get_text() for t in ax.get_legend().get_texts()]
        assert title or all(ax.get_title() for ax in axes), name
        seen[name] = (title, " ".join(texts), [ax.get_ylabel() for ax in axes])
        plt.close(fig)
    assert set(seen) == {"accuracy", "spread", "diversity", "divergence", "decomposition", "test_curves", "lmc"}
    for name in ("accuracy", "spread", "diversity"):  # one position per arm, named
        assert all(a in seen[name][1] for a in arms), name
    assert "arm init" in seen["decomposition"][1] and "arm data_order" in seen["decomposition"][1]
    assert all(f"arm {a}" in seen["test_curves"][1] for a in arms)
    assert interval_name("std") == "Bonett (2006) robust interval" and interval_name("std") in seen["spread"][0]
    assert interval_name("pairwise") in seen["diversity"][0]
    assert interval_name("decomposition") in seen["decomposition"][0]
    assert seen["spread"][2] == ["std of test accuracy (%)", "std of test cross-entropy (nats)"]
    assert seen["accuracy"][2] == ["test accuracy (%)"] and seen["test_curves"][2][0] == "test accuracy (%)"


def test_replicate_gives_tables_a_report_a_comparison_and_a_decomposition():
    """replicate's result is still {arm: (state, history)}; with score= it has a study's table (std, intervals,
    ratio to all; control untested), long frames, a report with its caveats, a paired comparison and the
    variance decomposition, each equal to the statistics computed on the scores directly."""
    from nondet_jax.analysis import stats as S

    def init(keys):
        return {"w": jax.random.normal(keys.init, (4,)), "loss": jnp.zeros(())}

    def step(state, batch, keys):
        noise = jax.random.normal(keys.data_order, (4,))
        w = state["w"] - 0.1 * (state["w"] - 1.0) + 0.05 * noise
        return {"w": w, "loss": jnp.sum((w - 1.0) ** 2)}

    arms = "control,init,data_order,all"
    r = nj.replicate(init, step, steps=6, arms=arms, replicas=5, strategy="sequential",
                     collect=lambda s, k: {"loss": s["loss"]}, score=lambda s: {"loss": s["loss"], "w0": s["w"][0]})
    assert set(r) == set(arms.split(",")) and r["init"][0]["w"].shape == (5, 4)  # the dict it always was
    means = jax.tree.map(lambda x: x.mean(0), r)  # a pytree as that dict, states as its leaves
    assert type(means) is dict and means["init"][0]["w"].shape == (4,)
    loss = np.asarray(r["init"][0]["loss"], np.float64)
    np.testing.assert_array_equal(r.scores["init"]["loss"], loss)
    table = r.to_frame("arms").set_index(["arm", "metric"])
    assert table.loc[("init", "loss"), "std"] == pytest.approx(S.std(loss))
    ratio = S.compare_spread(loss, np.asarray(r["all"][0]["loss"], np.float64))
    assert table.loc[("init", "loss"), "std_ratio_vs_all"] == pytest.approx(ratio["ratio"])
    assert table.loc[("init", "loss"), "spread_p"] == pytest.approx(ratio["spread_p"])
    assert np.isnan(table.loc[("control", "loss"), "spread_p"])  # control varies nothing: not tested
    assert table.loc[("control", "loss"), "std"] == 0.0
    curves = r.to_frame("curves")
    assert len(curves) == 4 * 5 * 6 and set(curves.metric) == {"loss"}
    last = curves.query("arm == 'init' and step == 5").value.to_numpy()
    np.testing.assert_array_equal(last, loss)  # the history's last step is the final state
    assert len(r.to_frame("replicas")) == 4 * 5 * 2
    dec = r.decompose()["loss"]
    assert dec["shares"]["init"]["share"] == pytest.approx(S.std(loss) ** 2 / S.std(r.scores["all"]["loss"]) ** 2)
    assert set(r.to_frame("decomposition").term) == {"init", "data_order", "sum", "non_additivity"}
    paired = r.compare("init", "data_order", "loss", higher_is_better=False)
    assert paired == S.compare_paired(loss, r.scores["data_order"]["loss"], higher_is_better=False)
    report = r.report()
    assert "Too few replicas to rank the sources" in report and "init" in report
    with pytest.raises(UsageError, match="arm 'nosuch' is not in this result"):
        r.compare("init", "nosuch")
    bare = nj.replicate(init, step, steps=2, arms="control,init", replicas=2, strategy="sequential")
    with pytest.raises(UsageError, match="needs scores: pass replicate"):
        bare.to_frame("arms")


def test_each_figure_is_a_function_of_its_own():
    """report/figures.py draws each figure in a function of its own, none over 120 lines (make_figures was 235)."""
    import ast

    tree = ast.parse((ROOT / "nondet_jax" / "report" / "figures.py").read_text())
    lengths = {n.name: n.end_lineno - n.lineno + 1 for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    assert max(lengths.values()) <= 120, max(lengths.items(), key=lambda kv: kv[1])
    assert {"_accuracy", "_spread", "_diversity", "_decomposition", "_test_curves", "_lmc"} <= set(lengths)


class _RunningMean(nn.Module):
    """A statistics layer that is not nn.BatchNorm: its momentum is read from two updates."""

    @nn.compact
    def __call__(self, x, train: bool):
        ra = self.variable("batch_stats", "mean", jnp.zeros, x.shape[-1:])
        if train and not self.is_initializing():
            ra.value = 0.9 * ra.value + 0.1 * x.mean(0)
        return x - ra.value


class _BigBN(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Dense(16)(x) * 3000.0  # large activations: variance ~1e7
        x = nn.BatchNorm(use_running_average=not train, momentum=0.99)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.999, name="slow")(x * 50.0)
        return nn.Dense(3)(_RunningMean()(x, train))


def test_batch_statistics_recomputed_exactly_for_own_batchnorm():
    """LMC and the instruments recompute the BatchNorm statistics of a user's module. They were read from two
    running-average updates (m = s1 - s0 cancelled at large statistics: 15% error at variance 4e6); now each
    nn.BatchNorm's own momentum divides the update from 0, and another statistics layer keeps the two updates."""
    from nondet_jax.models.parts import linen_model_fns

    x = jnp.asarray(np.random.default_rng(0).normal(size=(64, 6)), jnp.float32)
    v = _BigBN().init(jax.random.key(0), x, train=False)
    got = jax.jit(linen_model_fns(_BigBN()).recompute_batch_stats)(v, x)
    dense = v["params"]["Dense_0"]
    h = (np.asarray(x, np.float64) @ np.asarray(dense["kernel"], np.float64) + np.asarray(dense["bias"])) * 3000.0
    want = {}
    for layer, scale in (("BatchNorm_0", 1.0), ("slow", 50.0)):
        h = h * scale
        want[layer] = {"mean": h.mean(0), "var": h.var(0)}
        h = (h - h.mean(0)) / np.sqrt(h.var(0) + 1e-5)  # scale 1, bias 0 at initialisation
    assert want["BatchNorm_0"]["var"].max() > 1e6
    for layer in want:
        for k in ("mean", "var"):
            np.testing.assert_allclose(got[layer][k], want[layer][k], rtol=2e-5, atol=1e-6 * want[layer]["var"].max())
    np.testing.assert_allclose(got["_RunningMean_0"]["mean"], h.mean(0), atol=1e-4)


def test_replicate_leaves_out_and_names_replicas_whose_score_is_not_finite():
    """A replica that blows up to infinity is left out of every number, as a study's diverged replicas are, and
    the report names it (it gave one arm a Holm p of 1 and another of 0 from an infinite score)."""
    def init(keys):
        return jax.random.normal(keys.init, (2,))

    def step(w, batch, keys):  # blows up where the init drew w[0] > 1
        w = w + 0.01 * jax.random.normal(keys.data_order, (2,))
        return jnp.where(w[0] > 1.0, w * 1e30, w)

    r = nj.replicate(init, step, steps=3, arms="control,init,data_order,all", replicas=6,
                     score=lambda w: {"loss": jnp.sum(w ** 2), "never": jnp.where(w[1] > 9, 1.0, jnp.inf)})
    bad = [int(i) for i in np.flatnonzero(~np.isfinite(r.scores["init"]["loss"]))]
    assert bad and r.diverged["init"]["loss"] == bad and r.diverged["data_order"]["loss"] == []
    # a score infinite by its meaning ("never reached") leaves the other scores' replicas alone
    assert r.diverged["data_order"]["never"] == list(range(6))
    assert next(t for t in r.table if t["arm"] == "data_order" and t["metric"] == "loss")["replicas"] == 6
    row = next(t for t in r.table if t["arm"] == "init" and t["metric"] == "loss")
    kept = np.delete(r.scores["init"]["loss"], bad)
    assert row["replicas"] == 6 - len(bad) and row["std"] == pytest.approx(kept.std(ddof=1))
    assert np.isfinite(row["spread_p"]) and f"init loss: replica(s) {', '.join(map(str, bad))} of 6 scored NaN" in r.report()
    paired = r.compare("data_order", "init")
    assert paired["n_pairs"] == 6 - len(bad)


def test_replicate_names_the_function_that_cannot_be_traced_before_training():
    """init, step, collect and score are traced (abstractly) before anything trains: a wrong signature, a Python
    if on a traced value or a score that is not a number gets one line naming the function (they were JAX
    tracebacks, the score's after every arm had trained); a PRNG key in the history stays in the states, and
    nested score names read a/b."""
    from nondet_jax.errors import UsageError

    def init(keys):
        return {"w": jax.random.normal(keys.init, (3,)), "key": keys.init}

    def step(s, batch, keys):
        return {"w": s["w"] * 0.9, "key": s["key"]}

    run = functools.partial(nj.replicate, steps=2, replicas=2, arms="control,init")
    for kwargs, match in (
            ({"init": lambda: {}}, r"^init\(keys\) -> state cannot be called as <lambda>\(\) \(too many positional"),
            ({"step": lambda s, keys: s}, r"^step\(state, batch, keys\) -> state cannot be called as <lambda>\(s, keys\)"),
            ({"step": lambda s, b, k: {"w": s["w"] if s["w"][0] > 0 else -s["w"], "key": s["key"]}},
             r"^step\(state, batch, keys\).*\(TracerBoolConversionError: .*not a Python if"),
            ({"collect": lambda s: s}, r"^collect\(state, keys\) -> pytree cannot be called as <lambda>\(s\)"),
            ({"score": lambda s, k: s}, r"^score\(state\) -> number or \{name: number\} cannot be called as "
                                        r"<lambda>\(s, k\) \(missing a required argument: 'k'\)"),
            ({"score": lambda s: {"b": jnp.bfloat16(1.0), "f": s["w"][0] > 0}}, None),  # bfloat16 and bool are numbers
            ({"batches": {"ids": np.array(["a", "b"])}, "steps": None},
             r"^batches\['ids'\] holds <U1 values; batches must be numbers"),
            ({"score": lambda s: "x"}, r"^score\(state\).*is not a valid JAX type"),
            ({"score": lambda s: {"w": s["w"]}}, r"^score returns 'w' as shape \(3,\) per replica"),
            ({"init": {"w": 1}}, r"^init must be a function keys -> state, got dict$")):
        if match is None:
            assert run(**{"init": init, "step": step, **kwargs}).metrics == ["b", "f"]
            continue
        with pytest.raises(UsageError, match=match):
            run(**{"init": init, "step": step, **kwargs})
    r = run(init=init, step=step, collect=lambda s, k: {"w0": s["w"][0], "key": s["key"]},
            score=lambda s: {"a": {"b": s["w"][0]}, "c": [s["w"][1]]})
    assert r.metrics == ["a/b", "c/0"] and [row["metric"] for row in r.rows("curves")] == ["w0"] * 8
    assert "— : n/a with 2 replicas in an arm (the std's interval needs 3, the ratio and the spread test 5" in r.report()


def test_replicate_a_score_tied_over_differing_states_is_no_zero_width_interval():
    """Replicas one ulp apart (bitflip) can tie on a score rounded to float32: their std interval reaches the
    largest std that ties them at the score's spacing (it was [0, 0]); bitwise identical replicas say so."""
    import jax
    import jax.numpy as jnp

    from nondet_jax.analysis.stats import tie_rate
    from nondet_jax.sources import bitflip

    def init(keys):
        return bitflip({"w": jax.random.normal(jax.random.key(7), (3, 4))}, keys)

    r = nj.replicate(init, lambda s, b, k: s, steps=1, arms="control,bitflip", replicas=4,
                     score=lambda s: {"n": jnp.round(s["w"].sum())})
    rows = {row["arm"]: row for row in r.table}
    assert r.identical == {"control": True, "bitflip": False}
    assert np.ptp(r.scores["bitflip"]["n"]) == 0 and rows["bitflip"]["std_ci_low"] == 0
    step = np.spacing(np.float32(abs(r.scores["bitflip"]["n"][0])))
    assert rows["bitflip"]["std_ci_high"] == pytest.approx(np.sqrt(tie_rate(4)) * step)
    assert "bitwise identical" in next(line for line in r.report().splitlines() if line.startswith("control"))


def test_an_init_from_file_of_other_shapes_is_named_with_the_fix_for_a_file():
    """Digits weights (1 input channel) given to a CIFAR model by --init-from were explained in the API's words,
    'drop it from init_params', which a CLI user has no way to do (outside review)."""
    from nondet_jax.models import pretrained

    want = {"stem": {"kernel": jax.ShapeDtypeStruct((3, 3, 3, 16), np.float32)}}
    given = {"stem": {"kernel": np.zeros((3, 3, 1, 16), np.float32)}}
    with pytest.raises(UsageError, match=r"--init-from w.npz@0 'stem/kernel' has shape \(3, 3, 1, 16\), the model's "
                                         r"is \(3, 3, 3, 16\) .*; write a .npz without that array"):
        pretrained.check(given, want, "w.npz@0")
    with pytest.raises(UsageError, match="; drop it from init_params"):
        pretrained.check(given, want)


def test_the_spread_figure_does_not_promise_intervals_it_cannot_draw(tmp_path):
    """With 2 replicas no std interval exists (n/a in the table); spread.png's title still said 'with 95% CIs'
    (outside review)."""
    from nondet_jax.report.figures import draw_figures
    from nondet_jax.report.summary import load_records

    r = nj.run_study(model="mlp", data="digits", epochs=1, batch_size=512, arms="control,init", replicas=2,
                     out=tmp_path / "run", **QUIET)
    figs = dict(draw_figures(r.out, r.summary, load_records(r.out)[1]))
    assert figs["spread"]._suptitle.get_text() == "Spread across replicas (std, ddof=1); no 95% CI below 3 replicas per arm"


def test_refusals_name_arms_as_a_run_study_caller_writes_them(tmp_path):
    """A refusal's --arms VALUE reads arms='VALUE' (it read "arms= control,init,all")."""
    r = np.random.default_rng(0)
    data = dict(x_train=r.random((32, 4), dtype=np.float32), y_train=r.integers(0, 2, 32),
                x_test=r.random((16, 4), dtype=np.float32), y_test=r.integers(0, 2, 16))
    with pytest.raises(UsageError, match=re.escape("use e.g. arms='control,init,all'")):
        nj.run_study("mlp", data, replicas=2, epochs=1, batch_size=8, arms="", out=tmp_path / "a")
    with pytest.raises(UsageError, match=re.escape("use e.g. arms='init,data_order,all', or leave")):
        nj.run_study("mlp", data, replicas=2, epochs=1, batch_size=8, arms="init,data_order", out=tmp_path / "b",
                     settings={"metrics.decomposition": True})
