"""Instruments against brute force: explicit per-example gradients in a Python loop, exact Hessians
(``jax.hessian`` + ``eigvalsh``) on tiny models in float64, and a quadratic with a known alpha."""

from __future__ import annotations

import functools
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from nondet_jax import instruments
from nondet_jax.config import from_flat
from nondet_jax.errors import UsageError
from nondet_jax.instruments import configurations, curvature, formulas, histograms
from nondet_jax.sources import arm_keys, arm_sources, perturbations
from nondet_jax.train import make_train
from tests.conftest import one_replica, spec_of, tiny_config


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


# A tiny two-layer tanh network, softmax cross-entropy: 6 inputs, 7 hidden, 3 classes (73 parameters).
def init_params(key, dtype):
    k1, k2 = jax.random.split(key)
    return {"layer1": {"w": jax.random.normal(k1, (6, 7), dtype) * 0.8, "b": jnp.full((7,), 0.1, dtype)},
            "layer2": {"w": jax.random.normal(k2, (7, 3), dtype) * 0.8}}


def example_loss(params, example, context):
    x, y = example
    h = jnp.tanh(x @ params["layer1"]["w"] + params["layer1"]["b"])
    logits = h @ params["layer2"]["w"]
    return jax.nn.logsumexp(logits) - logits[y]


def batch_of(key, n, dtype):
    kx, ky = jax.random.split(key)
    return jax.random.normal(kx, (n, 6), dtype), jax.random.randint(ky, (n,), 0, 3)


def flat(tree):
    return np.concatenate([np.asarray(a).ravel() for a in jax.tree.leaves(tree)])


def explicit_per_example(params, batch):
    """Per-example gradients one example at a time (Python loop), flattened: (B, P)."""
    x, y = batch
    return np.stack([flat(jax.grad(example_loss)(params, (x[i], y[i]), None)) for i in range(len(y))])


def test_configurations_match_cockpit():
    assert set(configurations.ECONOMY) == {"Alpha", "Distance", "GradHist1d", "GradNorm", "InnerTest", "Loss",
                                           "NormTest", "OrthoTest", "UpdateSize"}
    assert set(configurations.BUSINESS) - set(configurations.ECONOMY) == {"TICDiag", "HessTrace"}
    assert set(configurations.FULL) - set(configurations.BUSINESS) == {"HessMaxEV", "GradHist2d"}
    assert instruments.resolve("economy,MeanGSNR") == tuple(q for q in instruments.QUANTITIES
                                                            if q in configurations.ECONOMY + ("MeanGSNR",))
    assert instruments.resolve("none") == ()
    with pytest.raises(ValueError, match="did you mean 'HessMaxEV'"):
        instruments.resolve("hessmaxev")


def test_every_quantity_is_one_record_and_names_match():
    from nondet_jax.instruments.quantities import QUANTITIES

    assert configurations.QUANTITIES is QUANTITIES  # the names the config checks are the records' own
    known = {"norms", "elements", "grad_sq", "hist1d", "hist2d", "mean_projection", "alpha", "loss", "hvp",
             "diagonal", "updates", "lr"}
    assert all(r.needs <= known for r in QUANTITIES.values())


def test_a_new_quantity_is_one_record(monkeypatch, x64):
    """docs/instruments.md's recipe: one record, and nothing else, gives a quantity the config accepts, make
    computes from the shared pass and the dashboard draws."""
    from nondet_jax.instruments import quantities
    from nondet_jax.instruments.dashboard import dashboard

    record = quantities.Quantity(lambda p: {"GradMax": max(jnp.max(jnp.abs(g)) for g in jax.tree.leaves(p.gbar))},
                                 frozenset({"norms"}))
    with pytest.raises(UsageError, match="GradMax"):
        from_flat({"instruments.config": "GradMax"})
    monkeypatch.setitem(quantities.QUANTITIES, "GradMax", record)
    assert from_flat({"instruments.config": "GradMax"}).instruments.config == "GradMax"
    params = init_params(jax.random.key(0), jnp.float64)
    batch = batch_of(jax.random.key(1), 8, jnp.float64)
    inst = instruments.make("GradMax,NormTest", example_loss)
    assert inst.value_names(params) == ["NormTest", "GradMax"]
    _, v = inst.update(inst.init(params), params, batch, step=0)
    np.testing.assert_allclose(v["GradMax"], np.abs(explicit_per_example(params, batch).mean(0)).max(), rtol=1e-12)
    assert np.isfinite(v["NormTest"])
    panels = {a.get_title(): a for a in dashboard({"step": np.arange(3), "GradMax": np.ones((2, 3))}).axes}
    assert len(panels["GradMax"].lines) == 2  # drawn, one line per replica, in the panel of the newer records


def test_schedules():
    lin = instruments.linear(4, offset=1)
    assert [bool(lin(s)) for s in range(10)] == [s >= 1 and (s - 1) % 4 == 0 for s in range(10)]
    log = instruments.logarithmic(0, 2, steps=5)
    expected = {0} | {int(np.floor(v + 1e-9)) for v in np.logspace(0, 2, 5)}
    assert {s for s in range(120) if bool(log(s))} == expected
    assert all(lin(s) is (s >= 1 and (s - 1) % 4 == 0) for s in range(10))  # a Python step: a Python bool
    assert [log(s) for s in range(120)] == [bool(log(jnp.int32(s))) for s in range(120)]
    run = instruments.log_over_run(1000, points=20)
    hit = [s for s in range(1000) if bool(run(s))]
    assert hit[0] == 0 and hit[1] == 1 and max(hit) == 999 and len(hit) <= 21


def test_gradient_noise_quantities_match_explicit_per_example_gradients(x64):
    params = init_params(jax.random.key(0), jnp.float64)
    init = jax.tree.map(lambda a: a * 0.9, params)
    batch = batch_of(jax.random.key(1), 12, jnp.float64)
    names = "Loss,GradNorm,Distance,UpdateSize,NormTest,InnerTest,OrthoTest,MeanGSNR,EarlyStopping,CABS,GradHist1d,GradHist2d"
    hist2 = {"bins": (6, 5), "value_range": ((-0.3, 0.3), (-1.0, 1.0))}
    updates = jax.tree.map(lambda a: -0.01 * jnp.ones_like(a), params)
    g_loop = explicit_per_example(params, batch)  # (B, P)
    b = len(g_loop)
    g = g_loop.mean(0)
    losses = np.array([float(example_loss(params, (batch[0][i], batch[1][i]), None)) for i in range(b)])
    for chunk in (3, 12):  # a scanned loop over 4 chunks, and one chunk
        inst = instruments.make(names, example_loss, chunk=chunk, hist1d={"bins": 8, "value_range": (-0.5, 0.5)},
                                hist2d=hist2)
        state = inst.init(init)
        _, v = jax.jit(lambda s, p, bt: inst.update(s, p, bt, step=0, updates=updates, lr=0.1))(state, params, batch)
        v = {k: np.asarray(a) for k, a in v.items()}
        np.testing.assert_allclose(v["Loss"], losses.mean(), rtol=1e-12)
        np.testing.assert_allclose(v["GradNorm"], np.linalg.norm(g), rtol=1e-10)
        np.testing.assert_allclose(v["GradNorm/layer1/w"], np.linalg.norm(g[7:7 + 42]), rtol=1e-10)  # leaves: b, w
        np.testing.assert_allclose(v["Distance/layer2/w"], np.linalg.norm(0.1 * np.asarray(params["layer2"]["w"])),
                                   rtol=1e-10)
        np.testing.assert_allclose(v["UpdateSize"], 0.01 * np.sqrt(g.size), rtol=1e-10)
        sq = np.sum(g_loop ** 2, 1)
        proj = g_loop @ g
        gg = g @ g
        norm = np.sqrt((sq.sum() - b * gg) / (b - 1) / b / gg)  # Byrd et al. (2012) eq. 3.9
        inner = np.sqrt(np.var(proj, ddof=1) / b / gg ** 2)  # Bollapragada et al. (2017) eq. 2.6
        ortho_var = np.sum((g_loop - np.outer(proj / gg, g)) ** 2) / (b - 1)  # eq. 3.3: orthogonal parts
        np.testing.assert_allclose(v["NormTest"], norm, rtol=1e-9)
        np.testing.assert_allclose(v["InnerTest"], inner, rtol=1e-9)
        np.testing.assert_allclose(v["OrthoTest"], np.sqrt(ortho_var / b / gg), rtol=1e-9)
        var_elem = g_loop.var(0, ddof=1)
        np.testing.assert_allclose(v["MeanGSNR"], np.mean(g ** 2 / ((g_loop ** 2).mean(0) - g ** 2 + 1e-5)), rtol=1e-9)
        np.testing.assert_allclose(v["EarlyStopping"], 1 - b * np.mean(g ** 2 / (var_elem + 1e-5)), rtol=1e-9)
        np.testing.assert_allclose(v["CABS"], 0.1 * np.sum(var_elem) * (b - 1) / b / losses.mean(), rtol=1e-9)
        clipped = np.clip(g_loop.ravel(), -0.5, 0.5)
        np.testing.assert_array_equal(v["GradHist1d"], np.histogram(clipped, bins=8, range=(-0.5, 0.5))[0])
        pvals = np.tile(flat(params), b)
        ref2 = np.histogram2d(np.clip(g_loop.ravel(), -0.3 + 0.05, 0.3 - 0.05), np.clip(pvals, -0.8, 0.8),
                              bins=(6, 5), range=((-0.3, 0.3), (-1.0, 1.0)))[0]
        np.testing.assert_array_equal(v["GradHist2d"], ref2)


def test_hess_max_ev_matches_exact_eigenvalues(x64):
    params = init_params(jax.random.key(2), jnp.float64)
    batch = batch_of(jax.random.key(3), 16, jnp.float64)
    inst = instruments.make("HessMaxEV", example_loss, hess_iters=40)
    _, v = jax.jit(lambda s, p: inst.update(s, p, batch, step=0))(inst.init(params), params)
    flat0, unravel = jax.flatten_util.ravel_pytree(params)
    loss = lambda f: jnp.mean(jax.vmap(example_loss, (None, 0, None))(unravel(f), batch, None))  # noqa: E731
    exact = np.linalg.eigvalsh(np.asarray(jax.hessian(loss)(flat0)))
    np.testing.assert_allclose(v["HessMaxEV"], exact[-1], rtol=1e-8)


@pytest.mark.parametrize("iters", [30, 73])
def test_hess_max_ev_when_the_hessian_has_lower_rank_than_its_lanczos_steps(x64, iters):
    """A ReLU network on 3 examples: its Hessian (the GGN) has rank <= 3 x 2 < hess_iters, so the Krylov space
    runs out after a few steps. What the reorthogonalisation then left of H v was rounding noise, normalised
    into vectors repeating earlier ones: HessMaxEV came out far above the largest eigenvalue (3.4 for 2.0 on a
    network like this). It must stop at the breakdown and give the largest eigenvalue, with or without hess_tol."""
    out, oloss = _outputs_of(jax.nn.relu)
    eloss = lambda p, ex, ctx: oloss(out(p, ex, ctx), ex)  # noqa: E731
    params = init_params(jax.random.key(8), jnp.float64)
    batch = batch_of(jax.random.key(9), 3, jnp.float64)
    flat0, unravel = jax.flatten_util.ravel_pytree(params)
    loss = lambda f: jnp.mean(jax.vmap(eloss, (None, 0, None))(unravel(f), batch, None))  # noqa: E731
    exact = np.linalg.eigvalsh(np.asarray(jax.hessian(loss)(flat0)))[-1]
    for tol in (None, 1e-12):
        inst = instruments.make("HessMaxEV", eloss, hess_iters=iters, hess_tol=tol)
        _, v = jax.jit(lambda s, p, i=inst: i.update(s, p, batch, step=0))(inst.init(params), params)
        np.testing.assert_allclose(v["HessMaxEV"], exact, rtol=1e-9)
        assert float(v["HessMaxEVResidual"]) < 1e-9


def test_lanczos_finds_largest_algebraic_eigenvalue_not_largest_magnitude(x64):
    q, _ = np.linalg.qr(np.random.default_rng(0).normal(size=(30, 30)))
    eigs = np.linspace(-10.0, 3.0, 30)
    a = jnp.asarray(q @ np.diag(eigs) @ q.T)
    params = jnp.zeros(30)
    hvp = curvature.hvp_operator(lambda p: 0.5 * p @ a @ p + p.sum(), params)
    ev, vec = curvature.lanczos_top(hvp, params, jax.random.key(0), 30)[:2]
    np.testing.assert_allclose(ev, 3.0, rtol=1e-10)
    np.testing.assert_allclose(abs(float(vec @ q[:, -1])), 1.0, rtol=1e-8)  # the Ritz vector is the eigenvector


def test_hess_trace_hutchinson_within_its_standard_error(x64):
    params = init_params(jax.random.key(4), jnp.float64)
    batch = batch_of(jax.random.key(5), 16, jnp.float64)
    probes = 400
    inst = instruments.make("HessTrace,TICTrace", example_loss, hess_probes=probes)
    _, v = jax.jit(lambda s, p: inst.update(s, p, batch, step=3))(inst.init(params), params)
    flat0, unravel = jax.flatten_util.ravel_pytree(params)
    loss = lambda f: jnp.mean(jax.vmap(example_loss, (None, 0, None))(unravel(f), batch, None))  # noqa: E731
    h = np.asarray(jax.hessian(loss)(flat0))
    # Rademacher probes: var(v.Hv) = 2 * sum_{i != j} H_ij^2; allow 4 standard errors.
    se = np.sqrt(2 * (np.sum(h ** 2) - np.sum(np.diag(h) ** 2)) / probes)
    assert abs(float(v["HessTrace"]) - np.trace(h)) < 4 * se
    sizes = [a.size for a in jax.tree.leaves(params)]  # per-layer traces: diagonal blocks
    start = 0
    for name, n in zip(instruments.layer_names(params), sizes):
        block = h[start:start + n, start:start + n]
        se_l = np.sqrt(2 * (np.sum(block ** 2) - np.sum(np.diag(block) ** 2)) / probes) + 1e-12
        assert abs(float(v[f"HessTrace/{name}"]) - np.trace(block)) < 4 * se_l
        start += n
    g_loop = explicit_per_example(params, batch)
    np.testing.assert_allclose(v["TICTrace"], np.sum(g_loop ** 2) / 16 / (float(v["HessTrace"]) + 1e-7), rtol=1e-9)


def _outputs_of(act):
    def example_output(params, example, context):
        x, _ = example
        return act(x @ params["layer1"]["w"] + params["layer1"]["b"]) @ params["layer2"]["w"]

    def output_loss(logits, example):
        return jax.nn.logsumexp(logits) - logits[example[1]]

    return example_output, output_loss


def test_output_factors_do_not_hang_in_replica_threads():
    """Two threads running the GGN's output factors at once (a study's replica threads with HessTrace or TICDiag
    on): on XLA:CPU a batched eigh next to other work hung both for good on the second arm (outside review). In a
    child, so a hang is a timeout, not a stuck test run."""
    script = textwrap.dedent("""
        import time
        from concurrent.futures import ThreadPoolExecutor
        import jax, jax.numpy as jnp
        from nondet_jax.instruments import curvature
        y = jnp.arange(128) % 10
        f = jax.jit(lambda x: curvature.output_factors(lambda o, t: jax.nn.logsumexp(o) - o[t],
                                                       jax.random.normal(jax.random.key(1), (128, 10)) + x, y).sum())
        x = jnp.zeros((128, 10))
        jax.block_until_ready(f(x))
        end = time.monotonic() + 5
        with ThreadPoolExecutor(2) as pool:
            while time.monotonic() < end:
                list(pool.map(lambda k: jax.block_until_ready(f(x + k)), (0, 1)))
        print("finished")
    """)
    try:
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=90)
    except subprocess.TimeoutExpired:
        pytest.fail("two threads computing output factors at once hung")
    assert out.returncode == 0 and "finished" in out.stdout, out.stderr[-2000:]


@pytest.mark.parametrize("act", ["relu", "tanh"])
def test_ggn_diagonal_is_exact_and_feeds_hess_trace_and_tic(x64, act):
    """HessTrace, TICDiag and TICTrace from the exact GGN diagonal: equal to diag(sum_i J_i^T H_i J_i) / B
    formed densely, and for a ReLU network (piecewise linear) to the Hessian's own diagonal, which is
    what Cockpit's BackPACK DiagHessian gives; no standard error is reported for an exact value."""
    out, oloss = _outputs_of(jax.nn.relu if act == "relu" else jnp.tanh)
    eloss = lambda p, ex, ctx: oloss(out(p, ex, ctx), ex)  # noqa: E731
    params = init_params(jax.random.key(6), jnp.float64)
    batch = batch_of(jax.random.key(7), 16, jnp.float64)
    flat0, unravel = jax.flatten_util.ravel_pytree(params)
    jac = jax.vmap(lambda ex: jax.jacobian(lambda f: out(unravel(f), ex, None))(flat0))(batch)  # (B, C, P)
    h_out = jax.vmap(jax.hessian(oloss))(jax.vmap(out, (None, 0, None))(params, batch, None), batch)
    ggn = np.einsum("bcp,bcd,bdp->p", jac, h_out, jac) / 16
    diag = flat(curvature.ggn_diagonal(out, oloss, params, batch, None, chunk=5))
    np.testing.assert_allclose(diag, ggn, rtol=1e-10, atol=1e-14)
    hess = np.asarray(jax.hessian(lambda f: jnp.mean(jax.vmap(eloss, (None, 0, None))(unravel(f), batch, None)))(flat0))
    if act == "relu":
        np.testing.assert_allclose(diag, np.diag(hess), rtol=1e-10, atol=1e-14)
    else:  # a smooth activation: the GGN leaves out the term the loss gradient weights
        assert not np.allclose(diag, np.diag(hess), rtol=1e-3)
    inst = instruments.make("HessTrace,TICDiag,TICTrace", eloss, example_output=out, output_loss=oloss, chunk=4)
    assert not any(n.endswith("SE") for n in inst.value_names(params))
    _, v = jax.jit(lambda s, p: inst.update(s, p, batch, step=0))(inst.init(params), params)
    np.testing.assert_allclose(v["HessTrace"], ggn.sum(), rtol=1e-10)
    start = 0
    for name, leaf in zip(instruments.layer_names(params), jax.tree.leaves(params)):
        np.testing.assert_allclose(v[f"HessTrace/{name}"], ggn[start:start + leaf.size].sum(), rtol=1e-10, atol=1e-14)
        start += leaf.size
    g2 = np.sum(np.stack([flat(jax.grad(eloss)(params, (batch[0][i], batch[1][i]), None)) for i in range(16)]) ** 2, 0)
    np.testing.assert_allclose(v["TICDiag"], np.sum(g2 / 16 / (ggn + 1e-7)), rtol=1e-9)
    np.testing.assert_allclose(v["TICTrace"], g2.sum() / 16 / (ggn.sum() + 1e-7), rtol=1e-9)


def test_hutchinson_standard_error_covers_its_error(x64):
    """With one probe (the default), the reported HessTraceSE is an upper-bound estimate of the
    standard error: over 2000 probe seeds its root mean square is at least the estimates' spread, and
    the estimate is within 1.96 SE of the exact trace in >= 95% of them (96.2% here).
    TICDiag is refused: it would divide by a diagonal estimate that can be negative."""
    params = init_params(jax.random.key(4), jnp.float64)
    batch = batch_of(jax.random.key(5), 16, jnp.float64)
    loss = lambda p: jnp.mean(jax.vmap(example_loss, (None, 0, None))(p, batch, None))  # noqa: E731
    flat0, unravel = jax.flatten_util.ravel_pytree(params)
    exact = np.trace(np.asarray(jax.hessian(lambda f: loss(unravel(f)))(flat0)))
    hvp = curvature.hvp_operator(loss, params)
    traces, _, se = jax.jit(jax.vmap(lambda k: curvature.hutchinson(hvp, params, k, 1)))(
        jax.random.split(jax.random.key(0), 2000))
    est, se = sum(np.asarray(t) for t in jax.tree.leaves(traces)), np.asarray(se)
    assert np.sqrt(np.mean(se ** 2)) >= np.std(est)
    assert np.mean(np.abs(est - exact) <= 1.96 * se) >= 0.95
    inst = instruments.make("HessTrace,TICTrace", example_loss)
    assert {"HessTraceSE", "TICTraceSE"} <= set(inst.value_names(params))
    _, v = jax.jit(lambda s, p: inst.update(s, p, batch, step=0))(inst.init(params), params)
    assert float(v["HessTraceSE"]) > 0 and float(v["TICTraceSE"]) > 0
    with pytest.raises(ValueError, match="TICDiag needs the exact curvature diagonal"):
        instruments.make("business", example_loss)
    with pytest.raises(UsageError, match="instruments.curvature=hutchinson cannot give TICDiag"):
        from_flat({"instruments.config": "business", "instruments.curvature": "hutchinson"})
    with pytest.raises(UsageError, match="unknown instruments.curvature"):
        from_flat({"instruments.config": "HessTrace", "instruments.curvature": "exact"})


def test_alpha_formula_equals_cockpits_normal_equations():
    rng = np.random.default_rng(0)
    for _ in range(20):
        t = rng.uniform(0.01, 2)
        fs, dfs = rng.normal(size=2), rng.normal(size=2)
        var_fs, var_dfs = rng.uniform(0.1, 2, 2), rng.uniform(0.1, 2, 2)
        phi = np.array([[1, 0, 0], [1, t, t ** 2], [0, 1, 0], [0, 1, 2 * t]]).T  # Cockpit's _fit_quadratic
        lam = np.linalg.inv(np.diag(np.concatenate([var_fs, var_dfs])))
        mu = np.linalg.inv(phi @ lam @ phi.T) @ phi @ lam @ np.concatenate([fs, dfs])
        expected = -1 if mu[2] < 0 else 2 * t / (-mu[1] / mu[2]) - 1
        with jax.enable_x64(True):
            got = formulas.alpha(jnp.float64(t), fs, dfs, var_fs, var_dfs)
        np.testing.assert_allclose(got, expected, rtol=1e-8)


@pytest.mark.parametrize("eta_h", [0.5, 1.0, 1.5, 2.5])
def test_alpha_on_a_quadratic_is_eta_h_minus_one(x64, eta_h):
    # l_i(theta) = h/2 ||theta - c_i||^2; SGD with lr eta on the full data: alpha = eta * h - 1.
    h = 2.0
    centres = jax.random.normal(jax.random.key(0), (10, 4), jnp.float64)
    loss_i = lambda p, c, _: 0.5 * h * jnp.sum((p["theta"] - c) ** 2)  # noqa: E731
    inst = instruments.make("Alpha", loss_i)
    params = {"theta": jnp.array([3.0, -1.0, 2.0, 0.5])}
    state = inst.init(params)
    update = jax.jit(lambda s, p, u, t: inst.update(s, p, centres, step=t, updates=u))
    lr = eta_h / h
    values = []
    for t in range(3):
        grad = jax.grad(lambda p: jnp.mean(jax.vmap(loss_i, (None, 0, None))(p, centres, None)))(params)
        updates = jax.tree.map(lambda g: -lr * g, grad)
        state, v = update(state, params, updates, t)
        values.append(float(v["Alpha"]))
        params = jax.tree.map(jnp.add, params, updates)
    assert np.isnan(values[0])  # reported one call late (Cockpit's SAVE_SHIFT)
    checked = values[1:2] if eta_h == 1.0 else values[1:]  # eta h = 1 lands on the minimum: no second step
    np.testing.assert_allclose(checked, eta_h - 1, atol=1e-8)


def test_update_compiles_once_and_skips_work_at_untracked_steps():
    params = init_params(jax.random.key(0), jnp.float32)
    batch = batch_of(jax.random.key(1), 8, jnp.float32)
    traces = []

    def counted_loss(p, ex, c):
        traces.append(1)
        return example_loss(p, ex, c)

    inst = instruments.make("economy", counted_loss, schedule=instruments.linear(3))
    update = jax.jit(lambda s, p, t, u: inst.update(s, p, batch, step=t, updates=u))
    state = inst.init(params)
    upd = jax.tree.map(lambda a: 0.01 * jnp.ones_like(a), params)
    state, v0 = update(state, params, 0, upd)
    n_traces = len(traces)
    state, v1 = update(state, jax.tree.map(lambda a: a + 0.01, params), 1, upd)
    state, v2 = update(state, params, 2, upd)
    assert len(traces) == n_traces  # neither the step nor the values traced again
    assert np.isfinite(v0["NormTest"]) and np.isnan(v2["NormTest"]) and np.isnan(v2["Alpha"])
    assert np.isnan(v1["NormTest"]) and np.isfinite(v1["Alpha"])  # step 1 finishes step 0's alpha only
    assert v0["GradHist1d"].shape == (100,) and set(v0) == set(inst.value_names(params))
    jaxpr = str(jax.make_jaxpr(lambda s, p: inst.update(s, p, batch, step=5, updates=upd))(state, params))
    assert "cond" in jaxpr  # the work sits in a branch, not in straight-line code


def test_bad_inputs_raise_clear_errors():
    params = init_params(jax.random.key(0), jnp.float32)
    batch = batch_of(jax.random.key(1), 8, jnp.float32)
    with pytest.raises(ValueError, match="unknown instruments configuration or quantity 'cheap'"):
        instruments.make("cheap", example_loss)
    with pytest.raises(ValueError, match="no quantities"):
        instruments.make("none", example_loss)
    with pytest.raises(ValueError, match="chunk must be"):
        instruments.make("Loss", example_loss, chunk=0)
    inst = instruments.make("economy", example_loss)
    with pytest.raises(ValueError, match="pass updates="):
        inst.update(inst.init(params), params, batch, step=0)
    with pytest.raises(ValueError, match="leading batch axis"):
        inst.update(inst.init(params), params, (batch[0], batch[1][:3]), step=0, updates=params)
    one = (batch[0][:1], batch[1][:1])  # Alpha's variances over one example were a silent NaN
    alpha = instruments.make("Alpha,Loss", example_loss)
    with pytest.raises(ValueError, match="Alpha need a batch of at least 2 examples"):
        alpha.update(alpha.init(params), params, one, step=0, updates=params)
    assert alpha.update(alpha.init(params), params, batch, step=0, updates=params)[1]["Loss"] > 0
    with pytest.raises(UsageError, match="NormTest, Alpha need a batch of at least 2 examples.*--batch-size 2"):
        from_flat({"instruments.config": "Loss,NormTest,Alpha", "train.batch_size": 1})
    assert from_flat({"instruments.config": "Loss,GradNorm,HessMaxEV", "train.batch_size": 1}).train.batch_size == 1
    cabs = instruments.make("CABS", example_loss)
    with pytest.raises(ValueError, match="pass lr="):
        cabs.update(cabs.init(params), params, batch, step=0)
    with pytest.raises(UsageError, match="unknown instruments configuration or quantity 'cheap'"):
        from_flat({"instruments.config": "cheap"})
    with pytest.raises(UsageError, match="optim.momentum=0"):
        from_flat({"instruments.config": "economy,EarlyStopping"})  # sgd with momentum 0.9 by default
    with pytest.raises(UsageError, match="CABS assumes plain SGD"):
        from_flat({"instruments.config": "CABS", "optim.name": "adamw"})
    with pytest.raises(UsageError, match="instruments.every must be >= 1"):
        from_flat({"instruments.config": "economy", "instruments.every": 0})
    with pytest.raises(UsageError, match="instruments.schedule"):
        from_flat({"instruments.config": "economy", "instruments.schedule": "sometimes"})
    ok = from_flat({"instruments.config": "EarlyStopping,CABS", "optim.momentum": 0, "optim.weight_decay": 0})
    assert ok.instruments.config == "EarlyStopping,CABS"
    # an empty configuration ran JAX and the data before a traceback; a list of names read as its text
    for spec in ("", ",", " ", " none "):
        with pytest.raises(UsageError, match="names no quantity; use none"):
            from_flat({"instruments.config": spec})
    assert from_flat({"instruments.config": ["NormTest", "Loss"]}).instruments.config == "NormTest,Loss"
    with pytest.raises(UsageError, match="did you mean 'economy'"):
        from_flat({"instruments.config": "Economy"})
    with pytest.raises(UsageError, match="hess_iters must be at most 200"):
        from_flat({"instruments.config": "HessMaxEV", "instruments.hess_iters": 100_000})
    with pytest.raises(ValueError, match="hess_iters must be at most 200"):
        instruments.make("HessMaxEV", example_loss, hess_iters=201)
    # histogram settings: an empty, mirrored or zero-width histogram was silent or failed inside JAX
    for h1, why in (({"bins": 0}, "bins must be an int >= 1"), ({"bins": -3}, "bins must be"),
                    ({"value_range": (2.0, -2.0)}, "low < high"), ({"value_range": (1.0, 1.0)}, "low < high"),
                    ({"range": (-1, 1)}, "takes bins and value_range, got 'range'"),
                    ({"value_range": 3.0}, "must be \\(low, high\\)")):
        with pytest.raises(ValueError, match=why):
            instruments.make("GradHist1d", example_loss, hist1d=h1)
    with pytest.raises(ValueError, match="two ints >= 1"):
        instruments.make("GradHist2d", example_loss, hist2d={"bins": 40})
    with pytest.raises(ValueError, match="low < high"):
        instruments.make("GradHist2d", example_loss, hist2d={"value_range": ((-1.0, 1.0), (2.0, 2.0))})
    assert instruments.make("GradHist1d", example_loss, hist1d={"bins": 7, "value_range": [-1, 1]}).quantities == ("GradHist1d",)


def test_histogram_bins_clip_outliers_into_edge_bins():
    counts = histograms.hist1d({"a": jnp.array([[-9.0, -2.0, -1.99, 0.0, 1.999, 2.0, 7.0]])}, bins=4,
                               value_range=(-2.0, 2.0))
    np.testing.assert_array_equal(counts, [3, 0, 1, 3])


def _tracked_run(config, data, strategy, replicas=2):
    from nondet_jax.replicas.choice import run_replicas

    varied = arm_sources("init")
    return run_replicas(make_train(config, spec_of(data)), arm_keys(0, varied, replicas), perturbations(varied), data,
                        config.train.epochs, strategy)


@pytest.fixture(scope="module")
def instrumented(small_digits):
    config = tiny_config(**{"instruments.config": "economy,MeanGSNR", "instruments.every": 3, "train.epochs": 2})
    return config, small_digits


def test_train_epoch_reports_instruments_and_leaves_training_unchanged(instrumented):
    config, data = instrumented
    plain = tiny_config(**{"train.epochs": 2})
    spec = spec_of(data)
    keys, perturb = one_replica("init", 1)
    x, y = jnp.asarray(data.x_train), jnp.asarray(data.y_train)
    out = {}
    for name, cfg in (("on", config), ("off", plain)):
        fns = make_train(cfg, spec)
        state = jax.jit(fns.init)(keys, perturb, x[:1])
        traces = []

        def counted(*args, fns=fns):
            traces.append(1)
            return fns.train_epoch(*args)

        epoch = jax.jit(counted)
        ms = []
        for e in range(2):
            state, m = epoch(state, x, y, keys, perturb, e)
            ms.append(m)
        assert len(traces) == 1  # the second epoch reuses the program
        out[name] = (state, ms)
    (s_on, m_on), (s_off, m_off) = out["on"], out["off"]
    assert "instruments" not in m_off[0] and "tracked" not in m_off[0]
    for a, b in zip(jax.tree.leaves(s_on.params), jax.tree.leaves(s_off.params)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)  # measuring does not change training
    steps = len(m_on[0]["loss"])
    tracked = np.concatenate([np.asarray(m["tracked"]) for m in m_on])
    np.testing.assert_array_equal(tracked, np.arange(2 * steps) % 3 == 0)
    inst = np.concatenate([np.asarray(m["instruments"]["NormTest"]) for m in m_on])
    assert np.all(np.isfinite(inst[tracked])) and np.all(np.isnan(inst[~tracked]))
    loss = np.concatenate([np.asarray(m["instruments"]["Loss"]) for m in m_on])
    np.testing.assert_allclose(loss[tracked], np.concatenate([np.asarray(m["loss"]) for m in m_on])[tracked])
    alpha = np.concatenate([np.asarray(m["instruments"]["Alpha"]) for m in m_on])
    after = np.roll(tracked, 1) & (np.arange(2 * steps) > 0)
    assert np.all(np.isfinite(alpha[after])) and np.all(np.isnan(alpha[~after]))  # incl. across the epoch boundary
    h = m_on[0]["instruments"]["GradHist1d"]
    assert h.shape == (steps, 100)
    assert set(k.split("/")[0] for k in m_on[0]["instruments"]) == set(instruments.resolve("economy,MeanGSNR"))
    assert {"GradNorm/dense1/kernel", "Distance/head/classifier/bias"} <= set(m_on[0]["instruments"])


def test_instruments_under_vmap_and_sequential_strategies_agree(instrumented):
    config, data = instrumented
    vm = _tracked_run(config, data, "vmap")
    seq = _tracked_run(config, data, "sequential")
    assert vm.strategy == "vmap" and seq.strategy == "sequential"
    iv, iseq = vm.steps["instruments"], seq.steps["instruments"]
    assert iv["Loss"].shape[0] == 2 and iv["GradHist1d"].shape[::2] == (2, 100)
    for k in ("Loss", "NormTest", "InnerTest", "Alpha", "GradNorm", "MeanGSNR"):
        np.testing.assert_allclose(iv[k], iseq[k], rtol=2e-3, atol=1e-5, err_msg=k)
    np.testing.assert_array_equal(vm.steps["tracked"], seq.steps["tracked"])


def test_batchnorm_per_example_gradients_hold_batch_statistics_fixed():
    """The trainer adaptor on a tiny BatchNorm model: per-example losses average to the training loss,
    and per-example gradients are those of the inference-mode loss with the batch's statistics."""
    import flax.linen as nn
    import optax

    from nondet_jax.instruments.trainer import for_model
    from nondet_jax.models.common import Head

    class TinyBN(nn.Module):
        num_classes: int = 3
        bn_momentum: float = 0.9
        dropout: float = 0.0

        @nn.compact
        def __call__(self, x, train=False, dropout_keys=None, return_features=False):
            x = nn.Dense(5)(x.reshape(x.shape[0], -1))
            x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=self.bn_momentum)(x))
            logits, feats = Head(self.num_classes, self.dropout)(x, train, dropout_keys)
            return (logits, feats) if return_features else logits

    model = TinyBN()
    x, y = batch_of(jax.random.key(0), 8, jnp.float32)
    v = model.init(jax.random.key(1), x, train=False)

    def train_loss(params, stats, xb, yb, dk):
        logits, _ = model.apply({"params": params, "batch_stats": stats}, xb, train=True, mutable=["batch_stats"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean(), None

    def stats_of(params, stats, xb):
        _, upd = model.clone(bn_momentum=0.0).apply({"params": params, "batch_stats": stats}, xb, train=True,
                                                    mutable=["batch_stats"])
        return upd["batch_stats"]

    cfg = from_flat({"instruments.config": "Loss,NormTest"}).instruments
    inst = for_model(cfg, model, train_loss, stats_of, total_steps=10)
    params = v["params"]
    _, vals = inst.update(inst.init(params), params, (x, y, None), step=0, context=v["batch_stats"])
    fixed = stats_of(params, v["batch_stats"], x)

    def eval_loss_i(p, i):
        logits = model.apply({"params": p, "batch_stats": fixed}, x[i:i + 1], train=False)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y[i:i + 1])[0]

    losses = np.array([float(eval_loss_i(params, i)) for i in range(8)])
    np.testing.assert_allclose(losses.mean(), float(train_loss(params, v["batch_stats"], x, y, None)[0]), rtol=1e-5)
    g = np.stack([flat(jax.grad(eval_loss_i)(params, i)) for i in range(8)])
    gm = g.mean(0)
    norm = np.sqrt((np.sum(g ** 2) - 8 * gm @ gm) / 7 / 8 / (gm @ gm))
    np.testing.assert_allclose(vals["NormTest"], norm, rtol=1e-4)


def test_dashboard_and_tidy_rows(tmp_path):
    from nondet_jax.instruments.dashboard import dashboard, tidy_rows

    t, r = 6, 2
    nan = np.nan
    values = {"step": np.arange(t), "Loss": np.array([[2.0, nan, 1.5, nan, 1.2, nan]] * r),
              "GradNorm/dense1/kernel": np.full((r, t), 0.5), "GradHist1d": np.ones((r, t, 100)),
              "HessMaxEV": np.full((r, t), 3.0), "lr": np.full(t, 0.1)}
    rows = tidy_rows("init", values)
    assert len(rows) == r * 3 + 2 * r * t  # Loss at 3 tracked steps; the layer value, HessMaxEV at every step
    assert {"step": 2, "arm": "init", "replica": 1, "quantity": "Loss", "layer": "", "value": 1.5} in rows
    assert any(row["quantity"] == "GradNorm" and row["layer"] == "dense1/kernel" for row in rows)
    fig = dashboard(values, title="init")
    fig.savefig(tmp_path / "d.png", dpi=40)
    assert (tmp_path / "d.png").stat().st_size > 1000
    bands = {**values, "HessMaxEVError": np.full((r, t), 0.2), "HessTrace": np.full((r, t), 5.0),
             "HessTraceSE": np.full((r, t), 1.0)}
    fig = dashboard(bands, title="init")  # the stated errors shaded, one band per replica
    panels = {a.get_title(): a for a in fig.axes}
    assert len(panels["HessMaxEV"].collections) == r and len(panels["HessTrace"].collections) == r
    assert panels["HessTrace"].get_ylim()[0] <= 5.0 - 1.96 and panels["HessTrace"].get_ylim()[1] >= 5.0 + 1.96
    with pytest.raises(ValueError, match="step"):
        dashboard({"Loss": values["Loss"]})


def test_dashboard_draws_every_quantity_the_instruments_compute():
    from nondet_jax.instruments.dashboard import PANELS, dashboard

    drawn = {q for *_, qs in PANELS for q in qs} | {"Loss"}  # Loss: the training-loss panel (the step's own loss)
    assert drawn == set(configurations.QUANTITIES)  # a quantity without a panel would be computed and never shown
    t, r = 5, 2
    values = {"step": np.arange(t), "TICDiag": np.full((r, t), 0.7), "TICTrace": np.full((r, t), 0.4),
              "GradHist2d": np.ones((r, t, *histograms.HIST2D_BINS)), "MeanGSNR": np.full((r, t), 2.0),
              "EarlyStopping": np.full((r, t), -0.5), "CABS": np.full((r, t), 0.01)}
    panels = {a.get_title(): a for a in dashboard(values).axes}
    assert len(panels["TIC"].get_lines()) == 2 * r and len(panels["Gradient signal to noise"].get_lines()) == 2 * r
    assert len(panels["CABS (suggested batch size)"].get_lines()) == r
    assert len(panels["GradHist2d (last tracked step, replica 0)"].get_images()) == 1
    assert [x.get_text() for x in panels["learning rate"].texts] == ["not recorded\n(your own optimiser)"]
    # the line styles of several replicas of one quantity are named (outside review: only colour was)
    assert {"replica 0", "replica 1"} <= {x.get_text() for x in panels["TIC"].get_legend().get_texts()}


def test_dashboard_histogram_draws_every_replica_and_no_empty_bin_as_a_count():
    """Empty bins were drawn as a count of 0.5 on the log axis and the legend named one of two replicas (outside
    review): an empty bin is a gap, each replica has its entry."""
    from nondet_jax.instruments.dashboard import dashboard

    counts = np.zeros((2, 3, 100))
    counts[:, :, 40:60] = 7.0
    panel = next(a for a in dashboard({"step": np.arange(3), "GradHist1d": counts}).axes
                 if a.get_title().startswith("GradHist1d"))
    lines = panel.get_lines()
    assert len(lines) == 2 and all(np.nanmin(np.asarray(line.get_ydata(), float)) == 7.0 for line in lines)
    assert [x.get_text() for x in panel.get_legend().get_texts()] == ["replica 0, step 2", "replica 1, step 2"]


def test_mixed_float32_and_float64_parameters(x64):
    """One float32 leaf beside float64 leaves (a user layer's own param under x64): every quantity runs,
    comes out in float64 and equals the all-float64 values to float32 precision (the sums used to take
    the first leaf's dtype and crash the scan carry)."""
    p64 = init_params(jax.random.key(0), jnp.float64)
    mixed = {**p64, "layer1": {"w": p64["layer1"]["w"], "b": p64["layer1"]["b"].astype(jnp.float32)}}
    batch = batch_of(jax.random.key(1), 12, jnp.float64)
    names = "Loss,GradNorm,Distance,NormTest,InnerTest,OrthoTest,MeanGSNR,Alpha,HessMaxEV,HessTrace,GradHist1d"
    inst = instruments.make(names, example_loss, chunk=3)
    values = []
    for params in (p64, mixed):
        updates = jax.tree.map(lambda a: -0.01 * jnp.ones_like(a), params)
        step = jax.jit(lambda s, p, bt, i: inst.update(s, p, bt, step=i, updates=updates, lr=0.1))
        state, _ = step(inst.init(params), params, batch, 0)
        _, v = step(state, jax.tree.map(lambda a, u: a + u, params, updates), batch, 1)
        values.append({k: np.asarray(x) for k, x in v.items()})
    ref, got = values
    assert set(ref) == set(got)
    for k in ref:
        if k.startswith("GradHist"):
            continue
        assert got[k].dtype == np.float64, k
        np.testing.assert_allclose(got[k], ref[k], rtol=2e-5, atol=1e-7, err_msg=k)
    assert np.isfinite(got["Alpha"]) and np.isfinite(got["HessTrace"])


def test_track_read_in_python_measures_what_the_device_switch_measures():
    """``update(track=bool(schedule(t)))`` (two programs, no lax.switch) gives the values the on-device
    schedule gives, NaN where untracked included, and Alpha's end point at the step after a tracked one."""
    params = init_params(jax.random.key(0), jnp.float32)
    inst = instruments.make("economy,HessMaxEV", example_loss, schedule=instruments.linear(3))
    tx = optax.sgd(0.1)

    def run(python_reads):
        @functools.partial(jax.jit, static_argnames="track")
        def step(p, o, s, batch, t, track=None):
            loss, grads = jax.value_and_grad(lambda q: jnp.mean(jax.vmap(example_loss, (None, 0, None))(q, batch,
                                                                                                      None)))(p)
            updates, o = tx.update(grads, o, p)
            s, v = inst.update(s, p, batch, step=t, updates=updates, lr=0.1, grads=grads, loss=loss, track=track)
            return optax.apply_updates(p, updates), o, s, v

        p, o, s, out = params, tx.init(params), inst.init(params), []
        for t in range(7):
            kw = {"track": bool(inst.schedule(t))} if python_reads else {}
            p, o, s, v = step(p, o, s, batch_of(jax.random.key(t), 12, jnp.float32), t, **kw)
            out.append({k: np.asarray(a) for k, a in v.items()})
        return out

    device, python = run(False), run(True)
    for t in range(7):
        assert np.isnan(python[t]["Loss"]) == (t % 3 != 0)
        assert np.isnan(python[t]["Alpha"]) == (t % 3 != 1), t  # finished at the step after a tracked one
        for k in device[t]:
            np.testing.assert_allclose(python[t][k], device[t][k], rtol=1e-5, atol=1e-7, err_msg=f"{k} at {t}")
