"""The progress bar says what an arm waits for before its first epoch: XLA compiling (from JAX's own
compile events) or programs loaded from the persistent compilation cache."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from nondet_jax.study.progress import Progress


def _note(bar: Progress, task: int = 0) -> str:
    return bar._bar.tasks[task].fields["note"]


def test_an_arm_waiting_for_its_first_epoch_shows_the_compile_then_the_bar_alone():
    bar = Progress(True)
    with bar:
        advance = bar.arm("control", 4)
        assert _note(bar).startswith("compiling")
        x = jnp.arange(7.0)  # a shape no other test compiles, so XLA compiles it now
        jax.jit(lambda v: jnp.sin(v) * 3.25 + v.sum())(x).block_until_ready()
        note = _note(bar)
        assert note.startswith("compiling: ") and "programs" in note, note
        advance(1)
        assert _note(bar) == ""  # training: the bar and its ETA say the rest
        jax.jit(lambda v: jnp.cos(v) * 1.75)(x).block_until_ready()  # a compile after epoch 1 leaves it alone
        assert _note(bar) == ""
        bar.arm("init", 4)
        assert _note(bar, 1) == ""  # later arms reuse the first one's programs: no claim of compiling
        counted = bar._compiled
    bar._waiting = 1  # as if an arm still waited: a compile event after the bar closed is not heard
    jax.monitoring.record_event_duration_secs(Progress.COMPILE_EVENT, 1.0)
    assert bar._compiled == counted


def test_a_disabled_bar_registers_nothing():
    with Progress(False) as bar:
        bar.arm("control", 2)
        jax.monitoring.record_event_duration_secs(Progress.COMPILE_EVENT, 1.0)  # a compile while waiting
        assert bar._compiled == 0  # not listening
        bar.arm("control", 2)(1)


def test_without_a_terminal_the_wait_and_the_progress_are_logged():
    lines = []
    with Progress(False, log=lines.append, every=0.0) as bar:
        advance = bar.arm("control", 3)
        # what JAX reports for two programs compiled or loaded in 2.5 s, one of them found in the cache
        # (the compile event times the cache lookup too)
        jax.monitoring.record_event_duration_secs(Progress.COMPILE_EVENT, 2.0)
        jax.monitoring.record_event(Progress.CACHE_HIT_EVENT)
        jax.monitoring.record_event_duration_secs(Progress.COMPILE_EVENT, 0.5)
        for _ in range(3):
            advance(1)
        jax.monitoring.record_event_duration_secs(Progress.COMPILE_EVENT, 9.0)  # after epoch 1: not the wait
    assert lines[0] == ("arm control: 1 XLA program compiled, 1 loaded from the compilation cache in 2 s before "
                        "epoch 1")
    assert [line.split(",")[0] for line in lines[1:]] == ["arm control: 1/3 replica-epochs", "arm control: 2/3 replica-epochs"]
    with Progress(False, log=lines.append, every=0.0) as bar:
        bar.arm("init", 2)(1)  # nothing compiled before its first epoch: no compile line
    assert lines[3:] == [lines[3]] and lines[3].startswith("arm init: 1/2 replica-epochs")


def test_a_quiet_progress_logs_nothing(capsys):
    with Progress(False) as bar:
        bar.arm("control", 2)(1)
        bar.arm("init", 2)(2)
    out = capsys.readouterr()
    assert out.out == "" and out.err == ""


@pytest.mark.parametrize("strategy", ["sequential", "vmap"])
def test_the_arms_of_a_study_share_its_compiled_programs(tmp_path, strategy):
    """Arms differ only in keys and perturbation switches passed at call time, so a 4-arm study compiles
    what a 1-arm study compiles (training, evaluation, metrics, LMC), give or take one trivial program; and
    that is few programs."""
    import jax

    import nondet_jax as nj

    compiled = []

    def count(event, seconds, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiled.append(seconds)

    jax.clear_caches()  # programs earlier tests of this process compiled would not be compiled again
    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        counts = []
        for arms in ("control", "control,init,data_order,all"):
            compiled.clear()  # run_study releases its compiled programs at the end: the next one compiles anew
            nj.run_study(model="mlp", data="digits", epochs=1, batch_size=128, arms=arms, replicas=2,
                         out=tmp_path / str(len(counts)), settings={"metrics.lmc_pairs": 1, "study.strategy": strategy},
                         log=lambda *a, **k: None)
            counts.append(len(compiled))
    finally:
        jax.monitoring.unregister_event_duration_listener(count)
    assert counts[0] > 10 and counts[1] <= counts[0] + 1, counts
    # whole pytrees are stacked, sliced and interpolated in one program or on the host, never leaf by leaf; keys
    # and schedules are one program each; epochs are stepped on CPU (on jax 0.10.2 this 1-arm study compiled 71
    # programs, then 43, then 16 sequential and 12 vmap; with replicas stacked on the host 15 and 14 on jax 0.10.2)
    assert counts[0] <= 20, counts


def test_replicas_are_stacked_and_sliced_on_the_host_on_a_cpu_and_by_one_program_otherwise():
    """On a CPU, stacking replicas' states and taking one back compile nothing and give the bits the compiled
    programs give; typed PRNG keys (no numpy dtype) and host-only trees take the compiled programs."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from nondet_jax.replicas import loop

    compiled = []

    def count(event, seconds, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiled.append(seconds)

    rng = np.random.default_rng(0)
    trees = [{"w": jnp.asarray(rng.normal(size=(3, 4)).astype(np.float32)), "n": jnp.asarray(np.int32(r)),
              "b": (jnp.asarray(rng.normal(size=5).astype(np.float32)),)} for r in range(3)]
    jax.block_until_ready(trees)
    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        stacked = loop._stack(trees)
        taken = loop._take(stacked, 1)
        jax.block_until_ready((stacked, taken))
    finally:
        jax.monitoring.unregister_event_duration_listener(count)
    assert compiled == []
    reference = loop._stack_trees(trees)
    for got, want in zip(jax.tree.leaves(stacked), jax.tree.leaves(reference)):
        assert isinstance(got, jax.Array) and got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    for got, want in zip(jax.tree.leaves(taken), jax.tree.leaves(trees[1])):
        assert isinstance(got, jax.Array)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert loop._host_device(jax.tree.leaves(trees)) == jax.devices("cpu")[0]
    keys = [jax.random.key(r) for r in range(3)]
    assert loop._host_device(keys) is None  # keys: the compiled program
    np.testing.assert_array_equal(jax.random.key_data(loop._take(loop._stack(keys), 2)), jax.random.key_data(keys[2]))
    assert loop._host_device([np.zeros(2)]) is None  # nothing on a device: nothing to say where to put it
    assert loop._host_device([jnp.asarray(1.0), trees[0]["w"]]) is None  # weakly typed: numpy would make it strong
    assert not stacked["w"].weak_type and stacked["w"].committed == trees[0]["w"].committed


def test_an_arm_s_line_gives_accuracy_in_percent_as_the_table_does():
    """The line after each arm gave accuracy as a fraction (0.7900 +- 0.0000) beside a table in %."""
    from nondet_jax.sources import parse_arm
    from nondet_jax.study.runner import log_accuracy

    lines = []
    record = {"metrics": {"accuracy": {"mean": 0.79, "std": 0.0123}}, "seconds": 2.71}
    log_accuracy(lines.append, parse_arm("init"), record)
    assert lines == ["arm init: test accuracy 79.00% (std 1.23), 2.7 s"]
    log_accuracy(lines.append, parse_arm("init"), {**record, "task": "regression",
                                                   "metrics": {"mse": {"mean": 0.25, "std": 0.0125}}})
    assert lines[1] == "arm init: test MSE 0.25 (std 0.0125), 2.7 s"
