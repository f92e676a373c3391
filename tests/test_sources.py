"""The key rule (docs/metrics.md) and the perturbation sources."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nondet_jax import sources
from nondet_jax.errors import UsageError
from nondet_jax.models import make_model
from nondet_jax.sources import (
    arm_keys,
    arm_sources,
    bitflip,
    replica_key,
    replica_slice,
    stream,
)


def key_data(k):
    return np.asarray(jax.random.key_data(k))


def test_source_ids_are_stable():
    # Reordering or renumbering would silently change every stored study.
    assert sources.SOURCE_ID == {"init": 1, "data_order": 2, "augmentation": 3, "dropout": 4, "bitflip": 5,
                                 "batch_order": 6, "hardware": 7}


def test_key_rule_matches_design():
    root = jax.random.key(7)
    s = jax.random.fold_in(root, sources.SOURCE_ID["data_order"])
    assert np.array_equal(key_data(stream(7, "data_order")), key_data(s))
    assert np.array_equal(key_data(replica_key(7, "data_order", 2, True)), key_data(jax.random.fold_in(s, 3)))
    assert np.array_equal(key_data(replica_key(7, "data_order", 2, False)), key_data(jax.random.fold_in(s, 0)))
    keys = arm_keys(7, frozenset({"data_order"}), 4)
    for r in range(4):
        assert np.array_equal(key_data(keys.data_order[r]), key_data(replica_key(7, "data_order", r, True)))
        assert np.array_equal(key_data(keys.init[r]), key_data(replica_key(7, "init", r, False)))


def test_varied_keys_differ_frozen_keys_shared():
    keys = arm_keys(0, arm_sources("init"), 5)
    init = key_data(keys.init)
    assert len({tuple(k) for k in init}) == 5
    for source in ("data_order", "augmentation", "dropout", "bitflip", "batch_order"):
        k = key_data(getattr(keys, source))
        assert all(np.array_equal(k[0], k[r]) for r in range(5)), source


def test_freezing_one_source_changes_no_other():
    all_keys = arm_keys(3, arm_sources("all"), 4)
    no_init = arm_keys(3, arm_sources("all") - {"init"}, 4)
    for source in sources.IMPLEMENTED:
        same = np.array_equal(key_data(getattr(all_keys, source)), key_data(getattr(no_init, source)))
        assert same == (source != "init"), source


def test_replica_keys_do_not_depend_on_replica_count():
    k4, k9 = arm_keys(1, arm_sources("all"), 4), arm_keys(1, arm_sources("all"), 9)
    for r in range(4):
        assert jax.tree.all(jax.tree.map(lambda a, b: np.array_equal(key_data(a), key_data(b)),
                                         replica_slice(k4, r), replica_slice(k9, r)))


def test_arm_names():
    assert arm_sources("control") == frozenset()
    assert arm_sources("all") == frozenset(sources.IMPLEMENTED)
    assert arm_sources("init+dropout") == frozenset({"init", "dropout"})
    with pytest.raises(UsageError, match="unknown arm or source 'nosuch'"):
        arm_sources("nosuch")
    assert arm_sources("hardware") == frozenset({"hardware"})
    assert arm_sources("all+hardware") == frozenset(sources.SOURCES)
    with pytest.raises(UsageError, match="unknown arm or source 'dataorder'; did you mean 'data_order'"):
        arm_sources("init+dataorder")
    with pytest.raises(UsageError, match="unknown arm or source 'cosmic_rays'"):
        arm_sources("init+cosmic_rays")


@pytest.mark.parametrize("seed", range(6))
def test_bitflip_moves_exactly_one_scalar_by_one_ulp(seed):
    model = make_model("resnet8", 10)
    params = model.init(jax.random.key(0), jnp.zeros((1, 8, 8, 1)))["params"]
    flipped = jax.jit(bitflip)(params, jax.random.key(seed))
    a = np.concatenate([np.asarray(x).ravel() for x in jax.tree.leaves(params)])
    b = np.concatenate([np.asarray(x).ravel() for x in jax.tree.leaves(flipped)])
    assert a.dtype == b.dtype == np.float32
    diff = np.flatnonzero(a != b)
    assert diff.size == 1
    i = diff[0]
    assert b[i] in (np.nextafter(a[i], np.float32(np.inf)), np.nextafter(a[i], np.float32(-np.inf)))
    assert abs(int(a.view(np.int32)[i]) - int(b.view(np.int32)[i])) == 1  # one ulp: adjacent bit patterns


def test_bitflip_draws_differ_by_key():
    model = make_model("mlp", 10)
    params = model.init(jax.random.key(0), jnp.zeros((1, 8, 8, 1)))["params"]
    where = set()
    for seed in range(8):
        flipped = bitflip(params, jax.random.key(seed))
        flat = jax.tree.leaves(jax.tree.map(lambda x, y: np.flatnonzero(np.asarray(x) != np.asarray(y)), params, flipped))
        where.add(tuple(tuple(f) for f in flat))
    assert len(where) > 1


def test_one_replica_is_that_replica_of_its_arm():
    keys, perturb = sources.one_replica("data_order", replica=2, seed=5)
    varied = arm_sources("data_order")
    expected = replica_slice(arm_keys(5, varied, 3), 2)
    for a, b in zip(jax.tree.leaves(keys), jax.tree.leaves(expected)):
        assert (jax.random.key_data(a) == jax.random.key_data(b)).all()
    for a, b in zip(jax.tree.leaves(perturb), jax.tree.leaves(sources.perturbations(varied)), strict=True):
        assert np.array_equal(a, b)


def test_own_sources_get_stable_streams_under_the_key_rule():
    # stored studies depend on these: a source of your own keeps its stream index in every version
    assert (sources.source_id("env"), sources.source_id("policy")) == (2528874108, 4088871418)
    assert sources.source_id("init") == 1 and all(sources.source_id(n) >= 2 ** 31 for n in ("env", "policy"))
    varied = sources.own_keys(3, ("env",), frozenset({"env"}), 2)["env"]
    shared = sources.own_keys(3, ("env",), frozenset(), 2)["env"]
    stream = jax.random.fold_in(jax.random.key(3), 2528874108)
    for r in range(2):  # replica r's own key, r + 1; the shared key, 0 (the rule of the built-in sources)
        assert np.array_equal(jax.random.key_data(varied[r]), jax.random.key_data(jax.random.fold_in(stream, r + 1)))
        assert np.array_equal(jax.random.key_data(shared[r]), jax.random.key_data(jax.random.fold_in(stream, 0)))
    assert sources.parse_arm("all", ("env",)).varied == set(sources.IMPLEMENTED) | {"env"}
    assert sources.parse_arm("env+init", ("env",)).varied == {"env", "init"}
    for bad, msg in [(("init",), "taken"), (("all",), "taken"), (("my env",), "identifier"),
                     (("env", "env"), "named twice")]:
        with pytest.raises(UsageError, match=msg):
            sources.check_own_sources(bad)
    with pytest.raises(UsageError, match="did you mean 'env'"):
        sources.parse_arm("evn", ("env",))
