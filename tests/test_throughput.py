"""Replica throughput settings: the auto rule reads the measured table, the XLA:CPU flag defaults,
and mixed precision (model.dtype)."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import spec_of, tiny_config

from nondet_jax.config import from_flat
from nondet_jax.errors import UsageError
from nondet_jax.machine import measured, xla_flags
from nondet_jax.replicas.choice import run_replicas
from nondet_jax.replicas.rule import resolve_strategy
from nondet_jax.sources import arm_keys, arm_sources, perturbations
from nondet_jax.train import make_train


def test_every_measured_entry_names_its_source():
    t = measured.tables()
    for section in ("strategy", "vmap_conv", "xla_cpu"):
        for backend, entry in t[section].items():
            assert entry.get("source"), (section, backend)


def test_auto_rule_reads_the_measured_table(monkeypatch):
    rules = {"gpu": {"vmap_min_replicas": 4, "source": "a measurement"}, "cpu": {"vmap_min_replicas": None,
                                                                                 "source": "another"}}
    monkeypatch.setattr(measured, "strategy_rule", lambda backend: rules.get(measured._backend_key(backend), {}))
    assert resolve_strategy("auto", 4, "cuda") == ("vmap", "auto: on cuda vmap beat a loop from 4 replicas on "
                                                          "(a measurement)")
    strategy, reason = resolve_strategy("auto", 2, "gpu")
    assert strategy == "sequential" and "a measurement" in reason
    strategy, reason = resolve_strategy("auto", 64, "cpu")
    assert strategy == "sequential" and "another" in reason
    assert resolve_strategy("auto", 8, "tpu")[0] == "vmap"  # no rule: vmap


def test_cpu_defaults_land_in_xla_flags_and_the_environment_record(monkeypatch):
    flag = "--xla_cpu_experimental_ynn_fusion_type="
    monkeypatch.setattr(measured, "xla_cpu_rule", lambda kind: {"flags": [flag], "source": "test"})
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    assert xla_flags.apply_cpu_defaults(env) == [flag]
    assert env["XLA_FLAGS"] == f"--xla_force_host_platform_device_count=2 {flag}"
    assert env[xla_flags.APPLIED] == flag
    # the user's own value of the same flag wins, and so does opting out
    env = {"XLA_FLAGS": "--xla_cpu_experimental_ynn_fusion_type=+individual_convolution"}
    assert xla_flags.apply_cpu_defaults(env) == [] and "=+individual" in env["XLA_FLAGS"]
    env = {xla_flags.OPT_OUT: "0"}
    assert xla_flags.apply_cpu_defaults(env) == [] and "XLA_FLAGS" not in env
    # the record environment.json stores
    monkeypatch.setenv(xla_flags.APPLIED, flag)
    from nondet_jax.machine.determinism import environment

    rec = environment()["xla_cpu_defaults"]
    assert rec["added"] == [flag] and rec["rule"]["source"] == "test" and rec["cpu_type"] == xla_flags.cpu_type()


def test_cpu_defaults_are_not_set_once_jax_started(monkeypatch):
    """In a process whose JAX backend already runs (an in-process sweep), the rule's flags could reach only the
    processes it starts, which would then run other kernels than it: nothing is set, with a warning."""
    jnp.zeros(1).block_until_ready()  # the backend runs
    flag = "--xla_cpu_experimental_ynn_fusion_type="
    monkeypatch.setattr(measured, "xla_cpu_rule", lambda kind: {"flags": [flag], "source": "test"})
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
    monkeypatch.delenv(xla_flags.OPT_OUT, raising=False)
    with pytest.warns(UserWarning, match="already started.*not set"):
        assert xla_flags.apply_cpu_defaults() == []
    assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=1"


def test_cpu_type_is_a_table_key():
    kind = xla_flags.cpu_type()
    assert kind and " " not in kind
    assert isinstance(xla_flags.cpu_defaults(kind), list)


def test_mixed_precision_keeps_float32_state_and_trains(small_digits):
    """model.dtype=bfloat16: bfloat16 convolutions, float32 parameters, optimiser state, statistics and logits."""
    config = tiny_config(**{"model.name": "resnet8", "model.width": 0.5, "model.dtype": "bfloat16", "train.epochs": 1})
    fns = make_train(config, spec_of(small_digits))
    x = jnp.asarray(small_digits.x_train[:4])
    varied = arm_sources("all")
    keys, perturb = arm_keys(0, varied, 2), perturbations(varied)
    jaxpr = str(jax.make_jaxpr(lambda s: fns.evaluate(s, x))(jax.eval_shape(
        lambda: fns.init(jax.tree.map(lambda k: k[0], keys), perturb, x))))
    assert "bf16" in jaxpr
    res = run_replicas(fns, keys, perturb, small_digits, 1, "sequential")
    for leaf in jax.tree.leaves((res.state.params, res.state.batch_stats, res.state.opt_state)):
        if jnp.issubdtype(leaf.dtype, jnp.floating):
            assert leaf.dtype == jnp.float32
    assert res.logits.dtype == np.float32 and np.isfinite(res.train_loss).all()
    f32 = run_replicas(make_train(tiny_config(**{"model.name": "resnet8", "model.width": 0.5, "train.epochs": 1}),
                                  spec_of(small_digits)), keys, perturb, small_digits, 1, "sequential")
    assert not np.array_equal(f32.logits, res.logits)  # the setting changes the numbers a study measures


def test_mixed_precision_study_records_its_dtype(tmp_path):
    from nondet_jax.study.runner import run

    config = from_flat({"model.name": "mlp", "model.dtype": "bfloat16", "train.epochs": 1, "study.arms": "control",
                        "study.replicas": 2, "metrics.lmc_pairs": 0})
    run(config, tmp_path, progress=False, log=lambda *a, **k: None)
    assert json.loads((tmp_path / "config.json").read_text())["model"]["dtype"] == "bfloat16"


def test_unknown_dtype_is_a_usage_error():
    from nondet_jax.config import validate

    with pytest.raises(UsageError, match="model.dtype"):
        validate(from_flat({"model.dtype": "float16"}))


@pytest.mark.parametrize("vendor, flags, kind", [
    ("GenuineIntel", "fpu avx2 avx512f", "x86_64-avx512-intel"),
    ("AuthenticAMD", "fpu avx2 avx512f", "x86_64-avx512-amd"),
    ("HygonGenuine", "fpu avx2 avx512f", "x86_64-avx512"),
    ("AuthenticAMD", "fpu avx2", "x86_64-avx2"),
])
def test_cpu_type_tells_avx512_vendors_apart_and_the_table_follows_their_measurements(monkeypatch, vendor, flags,
                                                                                       kind):
    """The two vendors' AVX-512 machines were measured apart (docs/performance.md), so they are two types: both
    turn YNNPACK's convolutions off, as AVX2 does, and AMD's also takes XLA:CPU's older loop emitters (faster to
    compile); an unmeasured vendor gets nothing. Every rule holds for the sequential strategy (under vmap the
    first flag broke replicas' bitwise equality on AVX2); AVX2's also for unrolled (checked there)."""
    monkeypatch.setattr(xla_flags.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(xla_flags, "_cpuinfo", lambda: {"vendor_id": vendor, "flags": flags})
    assert xla_flags.cpu_type() == kind
    off = ["--xla_cpu_experimental_ynn_fusion_type=-individual_convolution"]
    legacy = [*off, "--xla_cpu_use_fusion_emitters=false"]
    expected = {"x86_64-avx512-intel": off, "x86_64-avx512-amd": legacy, "x86_64-avx512": [], "x86_64-avx2": off}[kind]
    assert xla_flags.cpu_defaults(strategy="sequential") == expected
    env = {}
    assert xla_flags.apply_cpu_defaults(env, strategy="sequential") == expected
    for other in ("vmap", "sharded", None):  # batched replicas, or a strategy the caller does not know
        assert xla_flags.cpu_defaults(strategy=other) == []
    # checked there; on AMD AVX-512 the older emitters made unrolled differ from sequential
    assert xla_flags.cpu_defaults(strategy="unrolled") == (off if kind == "x86_64-avx2" else [])


def test_the_cli_asks_the_cpu_rule_for_the_strategy_it_will_run():
    from nondet_jax.cli.sweep import cpu_strategy
    from nondet_jax.study.methods import Method

    assert cpu_strategy(from_flat({"study.replicas": 8})) == "sequential"  # auto on a CPU (measured.json)
    assert cpu_strategy(from_flat({"study.strategy": "vmap"})) == "vmap"
    same = ([Method("a", {}, {}), Method("b", {"optim.lr": "0.2"}, {})], "a")
    assert cpu_strategy(from_flat({}), same) == "sequential"
    mixed = ([Method("a", {}, {}), Method("v", {"study.strategy": "vmap"}, {})], "a")
    assert cpu_strategy(from_flat({}), mixed) is None  # the flags are process-wide: no rule holds for both
