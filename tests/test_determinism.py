"""ulp distances on hand-made cases, XLA flag handling, provenance."""

import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

from nondet_jax.errors import UsageError
from nondet_jax.machine import determinism as D

f32 = np.float32


def ulp(a, b, dtype=f32):
    return int(D.ulp_distance(np.array([a], dtype), np.array([b], dtype))[0])


def test_adjacent_floats_are_one_ulp_apart():
    x = f32(1.0)
    assert ulp(x, np.nextafter(x, f32(2))) == 1
    assert ulp(x, np.nextafter(np.nextafter(x, f32(2)), f32(2))) == 2
    assert ulp(-x, np.nextafter(-x, f32(-2))) == 1
    assert ulp(x, x) == 0


def test_signed_zeros_and_crossing_zero():
    assert ulp(0.0, -0.0) == 0
    tiny = np.nextafter(f32(0), f32(1))  # smallest subnormal
    assert ulp(tiny, -tiny) == 2 and ulp(-0.0, tiny) == 1


def test_subnormals_count_like_any_step():
    smallest_normal = np.finfo(f32).tiny
    largest_subnormal = np.nextafter(smallest_normal, f32(0))
    assert ulp(largest_subnormal, smallest_normal) == 1
    assert ulp(0.0, smallest_normal) == 2 ** 23


def test_infinities_and_nan_policy():
    big = np.finfo(f32).max
    assert ulp(big, np.inf) == 1 and ulp(-np.inf, -big) == 1 and ulp(np.inf, np.inf) == 0
    assert ulp(np.nan, np.nan) == 0  # two NaNs count as equal, whatever their payloads
    assert ulp(np.nan, 1.0) == D.NAN_MISMATCH and ulp(1.0, np.nan) == D.NAN_MISMATCH


def test_float64_and_bfloat16():
    assert ulp(1.0, np.nextafter(1.0, 2.0), np.float64) == 1
    assert ulp(-np.finfo(np.float64).max, np.finfo(np.float64).max, np.float64) > 2 ** 63
    b = np.array([1.0], ml_dtypes.bfloat16)
    nxt = (b.view(np.uint16) + 1).view(ml_dtypes.bfloat16)
    assert int(D.ulp_distance(b, nxt)[0]) == 1


def test_ulp_distance_rejects_mismatches():
    with pytest.raises(ValueError):
        D.ulp_distance(np.zeros(2, f32), np.zeros(2, np.float64))
    with pytest.raises(TypeError):
        D.ulp_distance(np.zeros(2, np.int32), np.zeros(2, np.int32))


def test_tree_ulp_diff_reports_per_tensor():
    a = {"layer": {"kernel": np.ones((2, 3), f32), "bias": np.zeros(3, f32)}}
    b = {"layer": {"kernel": np.ones((2, 3), f32).copy(), "bias": np.zeros(3, f32)}}
    b["layer"]["kernel"][1, 2] = np.nextafter(f32(1), f32(0))
    b["layer"]["kernel"][0, 0] = np.nextafter(np.nextafter(f32(1), f32(2)), f32(2))
    out = D.tree_ulp_diff(a, b)
    assert out["layer/kernel"] == {"elements": 6, "differ": 2, "max_ulp": 2}
    assert out["layer/bias"] == {"elements": 3, "differ": 0, "max_ulp": 0}


def test_with_flags_replaces_same_named_flags():
    base = "--xla_gpu_deterministic_ops=false --xla_dump_to=/tmp/x"
    got = D.with_flags(D.DETERMINISM_ON, base)
    assert "--xla_dump_to=/tmp/x" in got and "--xla_gpu_deterministic_ops=true" in got
    assert "--xla_gpu_deterministic_ops=false" not in got


def test_determinism_off_restores_xla_defaults_for_every_flag_on_sets():
    """The "hardware" arm's child must not inherit autotune level 0 from a deterministic parent
    (seen on an H200: its flags still held --xla_gpu_autotune_level=0)."""
    got = D.with_flags(D.DETERMINISM_OFF, D.with_flags(D.DETERMINISM_ON, "--xla_dump_to=/tmp/x")).split()
    assert got == ["--xla_dump_to=/tmp/x", *D.DETERMINISM_OFF]


def test_known_flags_pass_and_unknown_flag_is_a_clear_error():
    D.check_flags(D.DETERMINISM_ON + D.DETERMINISM_OFF)
    with pytest.raises(UsageError, match="XLA flag --xla_no_such_flag=1 is not known to the installed jaxlib"):
        D.check_flags(["--xla_no_such_flag=1"])


def test_environment_records_what_changes_bits():
    env = D.environment()
    for key in ("xla_flags", "prng_impl", "jax_threefry_partitionable", "backend", "device_kind", "versions"):
        assert key in env
    assert env["versions"]["jax"]


def test_check_flags_asks_once_per_flag_set_and_jaxlib(tmp_path, monkeypatch):
    """An accepted flag set is remembered in the process and beside the compilation cache, keyed by the whole
    XLA_FLAGS string and the installed jaxlib; another flag set or a refusal is asked afresh."""
    monkeypatch.setenv(D.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv("XLA_FLAGS", "")
    monkeypatch.setattr(D, "_KNOWN", set())
    calls = []
    real_popen = D.subprocess.Popen
    monkeypatch.setattr(D.subprocess, "Popen", lambda *a, **k: calls.append(k["env"]["XLA_FLAGS"]) or real_popen(*a, **k))
    D.check_flags(D.DETERMINISM_ON)
    D.check_flags(D.DETERMINISM_ON)
    assert len(calls) == 1
    stored = list((tmp_path / "nondet_jax_xla_flags").glob("*.ok"))
    assert len(stored) == 1 and stored[0].read_text().strip() == D.with_flags(D.DETERMINISM_ON)
    monkeypatch.setattr(D, "_KNOWN", set())  # a new process: the file answers
    D.check_flags(D.DETERMINISM_ON)
    assert len(calls) == 1
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")  # another XLA_FLAGS string: another key
    D.check_flags(D.DETERMINISM_ON)
    assert len(calls) == 2
    for _ in range(2):  # never remembered as accepted
        with pytest.raises(UsageError, match="--xla_no_such_flag=1"):
            D.check_flags(["--xla_no_such_flag=1"])
    assert len(calls) == 4 and len(list((tmp_path / "nondet_jax_xla_flags").glob("*.ok"))) == 2
    # the key follows jaxlib: a jaxlib of another version (or another build) is asked again
    monkeypatch.setattr(D, "_KNOWN", set())
    monkeypatch.setattr(D, "_version", lambda pkg: "0.0.0-other" if pkg == "jaxlib" else None)
    D.check_flags(D.DETERMINISM_ON)
    assert len(calls) == 5


def test_sweep_sets_determinism_flags_only_once_checked(monkeypatch):
    """The CLI starts the flags' check, imports while the child runs, and sets XLA_FLAGS only when the wait says
    the flags are known: an unknown one is a UsageError and XLA_FLAGS stays as it was."""
    from nondet_jax.cli import sweep

    monkeypatch.setenv(D.CACHE_ENV, "off")
    monkeypatch.setenv("XLA_FLAGS", "")
    monkeypatch.setattr(D, "_KNOWN", set())
    apply = sweep.set_determinism_flags()
    assert os.environ["XLA_FLAGS"] == ""
    apply()
    assert os.environ["XLA_FLAGS"] == D.with_flags(D.DETERMINISM_ON)
    monkeypatch.setenv("XLA_FLAGS", "")
    monkeypatch.setattr(sweep, "DETERMINISM_ON", ["--xla_no_such_flag=1"])
    apply = sweep.set_determinism_flags()
    with pytest.raises(UsageError, match="--xla_no_such_flag=1"):
        apply()
    assert os.environ["XLA_FLAGS"] == ""


def test_importing_the_study_starts_no_backend():
    """The CLI sets the determinism flags after importing the study (their check runs meanwhile): XLA reads them
    when the backend starts, so no import on the way may start it."""
    code = ("import nondet_jax.cli.sweep, nondet_jax.study.runner, nondet_jax.study.multihost, nondet_jax.study.batched;"
            "from nondet_jax.machine.xla_flags import backend_started; print(backend_started())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr[-2000:]
