"""The ``sharded`` strategy (nondet_jax.replicas.sharded) on 1, 2 and 4 forced host devices.

The device count of XLA:CPU is fixed when the backend starts, and this process already started
it with one device, so each device count runs in a child process (this file run as a script,
``XLA_FLAGS=--xla_force_host_platform_device_count=N``) that trains the tiny MLP arm and saves
its results; the tests compare them here with ``run_replicas`` in this process.

Equalities asserted (XLA:CPU is deterministic):

* bitwise, where the computation is the same: ``inner="sequential"`` (and any width-1 layout)
  against ``sequential``, for every device count; each device's block of ``inner="vmap"`` against
  ``vmap`` on that block's replicas (same width);
* within ``ATOL`` where only the vmap width differs (``inner="vmap"`` across device counts and
  against ``sequential``): the rounding of a batched program.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from nondet_jax.replicas.sharded import plan
from nondet_jax.sources import arm_keys, arm_sources, perturbations

DEVICE_COUNTS = (1, 2, 4)
R = 4
ATOL = 1e-4  # |logit| and |weight| difference allowed where only the vmap width differs
ARM = "all"


def _setup(data):
    from conftest import spec_of, tiny_config

    from nondet_jax.train import make_train

    fns = make_train(tiny_config(), spec_of(data))
    varied = arm_sources(ARM)
    return fns, arm_keys(0, varied, R), perturbations(varied)


def _flat_params(result) -> np.ndarray:
    leaves = jax.tree.leaves(result.state.params)
    return np.concatenate([np.asarray(a).reshape(a.shape[0], -1) for a in leaves], axis=1)


def _record(result) -> dict:
    return {"logits": result.logits, "params": _flat_params(result), "loss": result.train_loss,
            "distance": result.weight_distance}


def child(n_devices: int, out: Path) -> None:
    """Body of one child process: train the arm every way the tests compare; save the results."""
    jax.config.update("jax_disable_most_optimizations", True)  # as conftest: compile time dominates
    from nondet_jax.data import load_dataset
    from nondet_jax.replicas.choice import make_strategy
    from nondet_jax.replicas.loop import train_replicas
    from nondet_jax.replicas.sharded import sharded_strategy

    assert len(jax.devices()) == n_devices, jax.devices()
    d = load_dataset("digits")  # as conftest's small_digits
    data = d._replace(x_train=d.x_train[:256], y_train=d.y_train[:256], x_test=d.x_test[:100], y_test=d.y_test[:100])
    fns, keys, perturb = _setup(data)
    arrays, meta = {}, {}
    strategies = {inner: sharded_strategy(fns, inner=inner) for inner in ("vmap", "sequential")}
    for name, strategy in strategies.items():
        res = train_replicas(strategy, keys, perturb, data, 2)
        arrays.update({f"{name}/{k}": v for k, v in _record(res).items()})
        leaf = jax.tree.leaves(res.state.params)[0]
        meta[name] = {"strategy": res.strategy, "spec": list(leaf.sharding.spec),
                      "shards": [list(s.data.shape) for s in leaf.addressable_shards],
                      "devices": len({s.device for s in leaf.addressable_shards})}
    if n_devices > 1:  # R = 3 does not divide 2 or 4 devices: padded (2) or fewer devices used (4)
        three = jax.tree.map(lambda k: k[:3], keys)
        res = train_replicas(strategies["vmap"], three, perturb, data, 2)  # 2 devices: same programs
        arrays.update({f"three/{k}": v for k, v in _record(res).items()})
    # The reference for each device's block of inner="vmap": vmap on just those replicas.
    w = plan(R, n_devices, "vmap")[1]
    if w > 1:
        vmap = make_strategy(fns, "vmap")  # one strategy: its programs compile once for all blocks
        blocks = [train_replicas(vmap, jax.tree.map(lambda k: k[b:b + w], keys), perturb, data, 2)
                  for b in range(0, R, w)]
        arrays.update({f"blocks/{k}": np.concatenate([_record(b)[k] for b in blocks]) for k in ("logits", "params")})
    np.savez(out, **arrays)
    out.with_suffix(".json").write_text(json.dumps(meta))


@pytest.fixture(scope="module")
def children(tmp_path_factory) -> dict:
    """Results of the children for every device count (run concurrently)."""
    root = tmp_path_factory.mktemp("sharded")
    procs = {}
    for n in DEVICE_COUNTS:
        env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} "
                                          f"--xla_force_host_platform_device_count={n}".strip(),
                   JAX_PLATFORMS="cpu")
        procs[n] = subprocess.Popen([sys.executable, __file__, str(n), str(root / f"d{n}.npz")], env=env,
                                    cwd=Path(__file__).parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True)
    out = {}
    for n, p in procs.items():
        log, _ = p.communicate(timeout=600)
        assert p.returncode == 0, f"child with {n} devices failed:\n{log[-4000:]}"
        out[n] = (dict(np.load(root / f"d{n}.npz")), json.loads((root / f"d{n}.json").read_text()))
    return out


@pytest.fixture(scope="module")
def reference(small_digits) -> dict:
    """``sequential`` in this process (one device): the single-replica programs."""
    from nondet_jax.replicas.choice import run_replicas

    fns, keys, perturb = _setup(small_digits)
    return _record(run_replicas(fns, keys, perturb, small_digits, 2, "sequential"))


def _equal(a: dict, prefix: str, b: dict, keys=("logits", "params", "loss")) -> list[str]:
    """Names of the fields of ``a[prefix/...]`` that are not bitwise equal to ``b``."""
    return [k for k in keys if not np.array_equal(a[f"{prefix}/{k}"], b[k])]


@pytest.mark.parametrize("n", DEVICE_COUNTS)
def test_sequential_inner_is_bitwise_sequential_for_any_device_count(children, reference, n):
    arrays, meta = children[n]
    assert meta["sequential"]["strategy"] == "sharded"
    assert _equal(arrays, "sequential", reference) == []


@pytest.mark.parametrize("n", DEVICE_COUNTS)
def test_vmap_inner_matches_vmap_on_each_devices_block(children, reference, n):
    arrays, _ = children[n]
    w = plan(R, n, "vmap")[1]
    if w > 1:  # the same vmap width: the same computation
        assert _equal(arrays, "vmap", {k: arrays[f"blocks/{k}"] for k in ("logits", "params")},
                      ("logits", "params")) == []
    else:  # one replica per device runs the single-replica program itself
        assert _equal(arrays, "vmap", reference) == []
    np.testing.assert_allclose(arrays["vmap/logits"], reference["logits"], rtol=0, atol=ATOL)
    np.testing.assert_allclose(arrays["vmap/params"], reference["params"], rtol=0, atol=ATOL)


def test_vmap_inner_independent_of_device_count(children):
    base = children[1][0]
    for n in DEVICE_COUNTS[1:]:
        arrays = children[n][0]
        for k in ("logits", "params", "loss"):
            np.testing.assert_allclose(arrays[f"vmap/{k}"], base[f"vmap/{k}"], rtol=0, atol=ATOL,
                                       err_msg=f"{n} devices, {k}")


@pytest.mark.parametrize("n", DEVICE_COUNTS)
def test_state_leading_axis_is_sharded_over_the_devices(children, n):
    meta = children[n][1]
    for name in ("vmap", "sequential"):  # R = 4 divides every device count: R / n per device
        m = meta[name]
        assert m["spec"] == ["replicas"]
        assert m["devices"] == n
        assert [s[0] for s in m["shards"]] == [R // n] * n
        assert len({tuple(s[1:]) for s in m["shards"]}) == 1  # only the replica axis is split


@pytest.mark.parametrize("n", DEVICE_COUNTS[1:])
def test_replica_count_not_divisible_by_devices(children, reference, n):
    arrays = children[n][0]
    assert arrays["three/logits"].shape == (3,) + reference["logits"].shape[1:]
    # replicas 0..2 are the first three of the R = 4 arm: padding never changes a real replica
    np.testing.assert_allclose(arrays["three/logits"], reference["logits"][:3], rtol=0, atol=ATOL)
    np.testing.assert_allclose(arrays["three/params"], reference["params"][:3], rtol=0, atol=ATOL)
    assert arrays["three/distance"].shape == (3, 3)  # epochs + 1, pairs of 3 replicas


@pytest.mark.parametrize("replicas,devices,inner,per_device,expected", [
    (4, 2, "vmap", None, (2, 2, 1)),
    (3, 2, "vmap", None, (2, 2, 1)),        # one padded replica
    (3, 4, "vmap", None, (3, 1, 1)),        # fewer devices than 4: no padding
    (5, 2, "sequential", None, (2, 1, 3)),  # rounds of one replica per device; one padded
    (8, 2, "vmap", 2, (2, 2, 2)),           # fixed width: the same computation for any device count
])
def test_plan(replicas, devices, inner, per_device, expected):
    assert plan(replicas, devices, inner, per_device) == expected


def test_plan_rejects_bad_arguments():
    with pytest.raises(ValueError, match="inner"):
        plan(4, 2, "scan")
    with pytest.raises(ValueError, match="per_device"):
        plan(4, 2, "vmap", 0)


def test_one_device_in_process_equals_vmap(small_digits):
    """No subprocess: on this process's single device, sharded with inner vmap is vmap."""
    from nondet_jax.replicas.choice import run_replicas
    from nondet_jax.replicas.sharded import run_sharded

    fns, keys, perturb = _setup(small_digits)
    keys = jax.tree.map(lambda k: k[:2], keys)
    a = run_sharded(fns, keys, perturb, small_digits, 2)
    b = run_replicas(fns, keys, perturb, small_digits, 2, "vmap")
    assert a.strategy == "sharded"
    assert np.array_equal(a.logits, b.logits) and np.array_equal(_flat_params(a), _flat_params(b))
    np.testing.assert_array_equal(a.train_loss, b.train_loss)



def test_per_example_and_curvature_instruments_run_sharded(small_digits):
    """The instruments whose loops start from zeros (histograms, the GGN diagonal, Lanczos, GSNR) run inside the
    sharded strategy's shard_map (a JAX carry-type traceback before: `--strategy sharded --instruments economy`,
    outside review) and measure what vmap measures."""
    from conftest import spec_of

    from nondet_jax.replicas.choice import run_replicas
    from nondet_jax.replicas.sharded import run_sharded
    from nondet_jax.train import make_train

    config = tiny_config_with("GradHist1d,GradHist2d,HessTrace,HessMaxEV,TICDiag,MeanGSNR")
    fns = make_train(config, spec_of(small_digits))
    _, keys, perturb = _setup(small_digits)
    keys = jax.tree.map(lambda k: k[:2], keys)
    a = run_sharded(fns, keys, perturb, small_digits, 1)
    b = run_replicas(fns, keys, perturb, small_digits, 1, "vmap")
    assert np.array_equal(a.logits, b.logits)
    got, want = a.steps["instruments"], b.steps["instruments"]
    assert {"GradHist1d", "GradHist2d", "HessTrace", "HessMaxEV", "TICDiag", "MeanGSNR"} <= set(want) == set(got)
    for k in want:
        np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=1e-5, atol=1e-6, err_msg=k)


def tiny_config_with(instruments: str):
    from conftest import tiny_config

    return tiny_config(**{"instruments.config": instruments, "train.epochs": 1})


if __name__ == "__main__":
    child(int(sys.argv[1]), Path(sys.argv[2]))
