"""Power beside coverage: for each interval and test the report prints about a comparison, how often it
contains the truth (coverage) and how often it decides (power: the interval excludes "no difference", or
p < 0.05), on the same seeded simulated studies, vectorised over studies.

Three families, each on the scenarios studies produce (:data:`RATIO_SCENARIOS`, :data:`PAIRED_SCENARIOS`,
:data:`COMPARE_SCENARIOS`): the std ratio of two independent arms (a true ratio of 2 for power, 1 for
false alarms), the std ratio of two arms that share seeds (replica r of both arms has the same key for the
sources the first does not vary: ``a = u + e``, ``b = u + w``, a true ratio of 0.5), and the difference of two
methods' means under shared seeds (accuracies on 360 images). :func:`failed_alarms` measures how often
:func:`nondet_jax.analysis.stats.failed_replicas` names a replica of a healthy arm, :func:`spread_test_cell`
the permutation spread tests' false alarms and power at R=8, and :func:`family_error`
the family-wise error of the findings over 6 arms, and :func:`paired_accuracy_differences` the realistic
scenario of the sequential design (:mod:`nondet_jax.analysis.sequential`).
``benchmarks/coverage.py --power`` prints the tables.

Example::

    from nondet_jax.analysis import power
    power.ratio_cell("normal", replicas=8, trials=2000)["bonett_published"]   # {'coverage': .., 'power': ..}
"""

from __future__ import annotations

import contextlib
import itertools
import math
from typing import Callable, NamedTuple

import numpy as np
from scipy import stats as sps

from nondet_jax.analysis import stats as S


@contextlib.contextmanager
def spread_tail(tail: float):
    """Bonett's intervals at another tail share (:data:`nondet_jax.analysis.stats.SPREAD_TAIL`; 1.0: as
    published, z at 97.5% for a 95% interval), for comparing the printed widening with the original."""
    old, S.SPREAD_TAIL = S.SPREAD_TAIL, tail
    try:
        yield
    finally:
        S.SPREAD_TAIL = old


@contextlib.contextmanager
def paired_tail(tail: float):
    """:func:`nondet_jax.analysis.stats.paired_ratio_ci` at another tail share (:data:`~nondet_jax.analysis.stats.PAIRED_TAIL`)."""
    old, S.PAIRED_TAIL = S.PAIRED_TAIL, tail
    try:
        yield
    finally:
        S.PAIRED_TAIL = old


def _cover(lo, hi, truth):
    return (np.asarray(lo) <= truth) & (truth <= np.asarray(hi))


def _decides(lo, hi, null=1.0):
    return (np.asarray(lo) > null) | (np.asarray(hi) < null)


class RatioScenario(NamedTuple):
    """``draw(rng, shape)``: per-replica scores of one arm whose spread is the unit; an arm ``k`` times as
    spread is ``k·draw`` about the same centre (``scale``), ``resolution`` the step of a count. ``realistic``:
    a scenario the 93% target holds for (else a stress case, recorded)."""
    description: str
    draw: Callable
    centre: float
    resolution: float | None = None
    realistic: bool = True
    failed: bool = False  # replicas named by stats.failed_replicas are left out before the interval


def _ceiling(rng, shape, n_test=10_000, error=0.006, k=4.0):
    """Accuracy near a 99.4% ceiling: each replica's error rate is 0.6% times a gamma(4)/4 factor (std 0.3%,
    skewed towards worse runs), its errors binomial on 10,000 images."""
    rate = error * rng.gamma(k, 1 / k, shape)
    return 1 - rng.binomial(n_test, np.minimum(rate, 1.0)) / n_test


def _failing(rng, shape, share=1 / 8):
    """1 in 8 runs fails to train: 40% accuracy against 92% ± 0.5% (no NaN)."""
    healthy = rng.normal(0.92, 0.005, shape)
    return np.where(rng.random(shape) < share, rng.normal(0.40, 0.02, shape), healthy)


RATIO_SCENARIOS = {
    "normal": RatioScenario("normal", lambda rng, sh: rng.normal(0.0, 1.0, sh), 0.0),
    "skewed": RatioScenario("lognormal(0, 0.5): skewness 1.8", lambda rng, sh: rng.lognormal(0.0, 0.5, sh),
                            math.exp(0.125)),
    "heavy tails": RatioScenario("Student t, 5 df", lambda rng, sh: rng.standard_t(5, sh), 0.0),
    "t(3) losses": RatioScenario("Student t, 3 df (infinite kurtosis)", lambda rng, sh: rng.standard_t(3, sh), 0.0,
                                 realistic=False),
    "bad seeds": RatioScenario("10% of seeds 4 std below the rest",
                               lambda rng, sh: np.where(rng.random(sh) < 0.1, -4.0, 0.0) + rng.normal(0, 1, sh), -0.4),
    "counts, 360 images": RatioScenario("accuracy on 360 images, binomial, p = 0.95",
                                        lambda rng, sh: rng.binomial(360, 0.95, sh) / 360, 0.95, 1 / 360),
    "near ceiling 99.4%": RatioScenario("accuracy ~99.4% on 10,000 images, gamma error rates", _ceiling, 0.994,
                                        1 / 10_000),
    "near ceiling, harsh": RatioScenario("accuracy ~99.4% on 10,000 images, exponential error rates (skewness 2)",
                                         lambda rng, sh: _ceiling(rng, sh, k=1.0), 0.994, 1 / 10_000, realistic=False),
    "1 in 8 failed, named and left out": RatioScenario("92% ± 0.5%, 1 run in 8 at 40%", _failing, 0.92, failed=True),
}


def _arm(sc: RatioScenario, rng, shape, k: float):
    x = sc.draw(rng, shape)
    if sc.failed:  # a failed run stays a failed run: only the healthy spread is scaled
        return np.where(x < 0.7, x, 0.92 + k * (x - 0.92))
    return sc.centre + k * (x - sc.centre)


def _true_std(sc: RatioScenario) -> float:
    x = sc.draw(np.random.default_rng(99), (400_000,))
    return float(x[x >= 0.7].std() if sc.failed else x.std())


def _drop_failed(x, resolution):
    """Studies (T, R) -> list of (rows, values without the named replicas), grouped by how many are named."""
    mask = S.failed_replicas(x, resolution=resolution)
    out = []
    for k in np.unique(mask.sum(-1)):
        rows = np.flatnonzero(mask.sum(-1) == k)
        out.append((rows, x[rows][~mask[rows]].reshape(len(rows), x.shape[-1] - k)))
    return out


def _ratio_methods(a, b, resolution):
    """name -> (low, high) of each std-ratio interval, and name -> p of each test, for studies (T, R)."""
    intervals = {"bonett_printed": S.std_ratio_ci(a, b, resolution=resolution)}
    for name, tail in (("bonett_98", 0.8), ("bonett_published", 1.0)):
        with spread_tail(tail):
            intervals[name] = S.std_ratio_ci(a, b, resolution=resolution)
    intervals["f_interval"] = S.std_ratio_ci_normal(a, b)
    return intervals


RATIO_METHODS = {"bonett_printed": "Bonett, z at 98.75% (printed: widened, = Bonett's 97.5% interval)",
                 "bonett_98": "Bonett, z at 98% (= Bonett's 96% interval)",
                 "bonett_published": "Bonett as published, z at 97.5% (95% interval)",
                 "f_interval": "F interval (= F-test; exact for normal data)"}


def ratio_cell(scenario: str, replicas: int, trials: int = 2000, seed: int = 0, effect: float = 2.0) -> dict:
    """Independent arms: per method, coverage of the true ratio ``effect`` (a's std over b's) and power (the
    interval excludes 1) at it, and the false-alarm rate (the interval excludes 1) when the ratio is 1."""
    sc, rng = RATIO_SCENARIOS[scenario], np.random.default_rng(seed)
    out = {m: {"coverage": 0.0, "power": 0.0, "false_alarm": 0.0, "coverage_null": 0.0} for m in RATIO_METHODS}
    for k, cov_key, dec_key in ((effect, "coverage", "power"), (1.0, "coverage_null", "false_alarm")):
        a, b = _arm(sc, rng, (trials, replicas), k), _arm(sc, rng, (trials, replicas), 1.0)
        groups = [(np.arange(trials), a, b)]
        if sc.failed:  # each arm's named replicas left out: studies grouped by the count left in each arm
            groups = []
            for rows_a, a_k in _drop_failed(a, sc.resolution):
                for rows_b, b_k in _drop_failed(b[rows_a], sc.resolution):
                    groups.append((rows_a[rows_b], a_k[rows_b], b_k))
        for _, ga, gb in groups:
            for m, (lo, hi) in _ratio_methods(ga, gb, sc.resolution).items():
                out[m][cov_key] += float(_cover(lo, hi, k).sum()) / trials
                out[m][dec_key] += float(_decides(lo, hi).sum()) / trials
    return out


def std_cell(scenario: str, replicas: int, trials: int = 2000, seed: int = 0) -> dict:
    """Coverage of one arm's std interval (:func:`nondet_jax.analysis.stats.std_ci`) and mean interval on
    ``scenario`` (named failed replicas left out first, for the failing scenario): how the std's coverage moves
    as R grows."""
    sc = RATIO_SCENARIOS[scenario]
    x = sc.draw(np.random.default_rng(seed), (trials, replicas))
    big = sc.draw(np.random.default_rng(99), (400_000,))
    big = big[big >= 0.7] if sc.failed else big
    hits = {"std": 0, "mean": 0}
    for _, xk in (_drop_failed(x, sc.resolution) if sc.failed else [(None, x)]):
        lo, hi = S.std_ci(xk, resolution=sc.resolution)
        hits["std"] += int(_cover(lo, hi, big.std()).sum())
        lo, hi = S.mean_ci(xk, resolution=sc.resolution)
        hits["mean"] += int(_cover(lo, hi, big.mean()).sum())
    return {k: v / trials for k, v in hits.items()}


SPREAD_TESTS = {"printed": "Brown–Forsythe (printed): deviations from each arm's median",
                "hines": "the same, an even arm's two equal middle deviations merged (Hines & O'Hara Hines 2000)",
                "levene": "Levene: deviations from each arm's mean",
                "fligner": "Fligner–Killeen: normal scores of the ranks of the deviations from each arm's median",
                "klotz": "Klotz: squared normal scores of the ranks of the values centred on each arm's median",
                "trimmed": "deviations from each arm's 25% trimmed mean",
                "variance": "the variance ratio itself, each arm centred on its mean (Boos & Brownie 1989)"}
RANK_TESTS = ("fligner", "klotz")  # tests of a sum of rank scores (asymptotically as efficient as the F-test for
# normal data, Klotz), permuted over the same splits


def _split_masks(n: int, draws: int = 4000, seed: int = 0) -> np.ndarray:
    """(splits, 2n) booleans, True where a pooled value goes to the first arm: every split of 2n values into two
    arms of n when there are at most 20,000 (as :func:`scipy.stats.permutation_test` enumerates them), else the
    observed one and ``draws`` seeded random ones."""
    if math.comb(2 * n, n) <= 20_000:
        rows = np.array(list(itertools.combinations(range(2 * n), n)))
    else:
        rng = np.random.default_rng(seed)
        rows = np.concatenate([np.arange(n)[None], np.argsort(rng.random((draws, 2 * n)), -1)[:, :n]])
    mask = np.zeros((len(rows), 2 * n), bool)
    mask[np.arange(len(rows))[:, None], rows] = True
    return mask


def _spread_deviations(x, test: str) -> np.ndarray:
    """Each study's absolute deviations (T, R) -> (T, R') that ``test`` of :data:`SPREAD_TESTS` permutes."""
    if test == "levene":
        return np.abs(x - x.mean(-1, keepdims=True))
    if test == "trimmed":
        return np.abs(x - sps.trim_mean(x, 0.25, axis=-1)[..., None])
    z = np.sort(np.abs(x - np.median(x, -1, keepdims=True)), -1)
    if test == "printed":
        return z
    if x.shape[-1] % 2:  # odd: the median's own deviation is a structural zero
        return z[..., 1:]
    return np.concatenate([math.sqrt(2) * z[..., :1], z[..., 2:]], -1)  # (d, d) -> (√2·d, 0), the 0 dropped


def _split_pvalues(za, zb) -> np.ndarray:
    """Two-sided permutation p of the pooled t of ``za`` against ``zb`` (studies (T, n) each), over the splits
    of :func:`_split_masks`: :func:`nondet_jax.analysis.stats.spread_test`'s p for a whole batch of studies."""
    n = za.shape[-1]
    mask = _split_masks(n).astype(np.float64)
    out = []
    for i in range(0, len(za), 64):
        z = np.concatenate([za[i:i + 64], zb[i:i + 64]], -1)
        ma, mb = z @ mask.T / n, z @ (1 - mask).T / n
        ss = (z ** 2) @ mask.T - n * ma ** 2 + (z ** 2) @ (1 - mask).T - n * mb ** 2
        sp = np.sqrt(np.maximum(ss, 0.0) / (2 * n - 2) * (2 / n))
        with np.errstate(divide="ignore", invalid="ignore"):
            t = np.where(sp > 0, np.abs(ma - mb) / np.where(sp > 0, sp, 1.0), np.where(ma == mb, 0.0, np.inf))
        observed = t[:, :1]  # the first split is the arms as drawn
        out.append(np.mean(t >= observed - np.abs(observed) * np.finfo(np.float64).eps * 100, -1))
    return np.concatenate(out)


def _rank_pvalues(a, b, test: str) -> np.ndarray:
    """Two-sided permutation p of a sum of rank scores over the first arm's values (studies (T, n) each), over the
    splits of :func:`_split_masks`: Fligner–Killeen's (Conover, Johnson & Johnson 1981) or Klotz's (1962)."""
    n = a.shape[-1]
    if test == "fligner":
        z = np.abs(np.concatenate([a - np.median(a, -1, keepdims=True), b - np.median(b, -1, keepdims=True)], -1))
        scores = sps.norm.ppf(0.5 + sps.rankdata(z, axis=-1) / (2 * (2 * n + 1)))
    else:
        z = np.concatenate([a - np.median(a, -1, keepdims=True), b - np.median(b, -1, keepdims=True)], -1)
        scores = sps.norm.ppf(sps.rankdata(z, axis=-1) / (2 * n + 1)) ** 2
    mask = _split_masks(n).astype(np.float64)
    out = []
    for i in range(0, len(scores), 64):
        part = scores[i:i + 64]
        centred = np.abs(part @ mask.T - part.sum(-1, keepdims=True) / 2)
        out.append(np.mean(centred >= centred[:, :1] * (1 - 1e-12), -1))
    return np.concatenate(out)


def _variance_pvalues(a, b) -> np.ndarray:
    """Two-sided permutation p of the variance ratio (studies (T, n) each): each arm's values centred on its mean
    and pooled, every split's two variances recomputed; the statistic |s_a² / (s_a² + s_b²) − ½| orders splits as
    max(F, 1/F) does and is 0 when both arms are constant."""
    n = a.shape[-1]
    z_all = np.concatenate([a - a.mean(-1, keepdims=True), b - b.mean(-1, keepdims=True)], -1)
    mask = _split_masks(n).astype(np.float64)
    out = []
    for i in range(0, len(z_all), 64):
        z = z_all[i:i + 64]
        qa = (z ** 2) @ mask.T - (z @ mask.T) ** 2 / n
        qb = (z ** 2) @ (1 - mask).T - (z @ (1 - mask).T) ** 2 / n
        total = qa + qb
        s = np.abs(np.divide(qa, total, out=np.full_like(total, 0.5), where=total > 0) - 0.5)
        out.append(np.mean(s >= s[:, :1] * (1 - 1e-12), -1))
    return np.concatenate(out)


def spread_test_cell(scenario: str, replicas: int, trials: int = 2000, seed: int = 0, effect: float = 2.0) -> dict:
    """Per test of :data:`SPREAD_TESTS` (a permutation test of a pooled t of deviations, as
    :func:`nondet_jax.analysis.stats.spread_test`), its false alarms (p < 0.05 when both arms are drawn alike)
    and its power at a true std ratio ``effect``, on the same studies. Every split is enumerated up to 20,000
    (R ≤ 8), else 4,000 seeded ones."""
    sc, rng = RATIO_SCENARIOS[scenario], np.random.default_rng(seed)
    out = {t: {} for t in SPREAD_TESTS}
    for k, key in ((1.0, "false_alarm"), (effect, "power")):
        a, b = _arm(sc, rng, (trials, replicas), k), _arm(sc, rng, (trials, replicas), 1.0)
        for t in SPREAD_TESTS:
            if t == "variance":
                p = _variance_pvalues(a, b)
            elif t in RANK_TESTS:
                p = _rank_pvalues(a, b, t)
            else:
                p = _split_pvalues(_spread_deviations(a, t), _spread_deviations(b, t))
            out[t][key] = float(np.mean(p < 0.05))
    return out


class PairedScenario(NamedTuple):
    """Two arms sharing seeds: ``draw(rng, shape, null)`` -> (a, b), a the arm varying one source (``u``, the
    part its seed shares with b), b the arm varying all (``u + w``); ``truth`` their std ratio (``null``:
    a drawn as b, ratio 1)."""
    description: str
    draw: Callable
    truth: float
    realistic: bool = True


def _shared(component):
    """a = u, b = u + w with var(w) = 3·var(u): std ratio 0.5, correlation 0.5; with ``null``, a = u + w' (w'
    independent of w, as w): ratio 1, correlation 0.25."""
    def draw(rng, shape, null=False):
        u, w = component(rng, shape), math.sqrt(3) * component(rng, shape)
        a = u + math.sqrt(3) * component(rng, shape) if null else u
        return a, u + w
    return draw


def _std(f):  # a unit-variance, zero-mean version of a sampler
    big = f(np.random.default_rng(7), (400_000,))
    m, s = big.mean(), big.std()
    return lambda rng, shape: (f(rng, shape) - m) / s


def _ceiling_shared(rng, shape, null=False, n_test=10_000, error=0.006):
    """Accuracy near a 99.4% ceiling: error rate 0.6% × (a gamma factor of the shared source, and in b a second
    of the other sources): b's replicas are skewed towards worse runs; counts binomial on 10,000 images."""
    g_u = rng.gamma(2.0, 0.5, shape)
    rate_a = error * (0.5 * g_u + 0.5 * (rng.gamma(2.0, 0.5, shape) if null else 1.0))
    rate_b = error * (0.5 * g_u + 0.5 * rng.gamma(2.0, 0.5, shape))
    return (1 - rng.binomial(n_test, rate_a) / n_test, 1 - rng.binomial(n_test, rate_b) / n_test)


def _latent_accuracy(rng, latent, n_test=360, gain=0.0, noise=0.35):
    """Accuracies on ``n_test`` images from a per-replica latent (the seeds' effect, shared by runs that share
    them): image j is right when ``α_j + 0.6·latent + noise > 0``, noise one per run and image (the
    run's own nondeterminism); ``gain`` shifts every α by a constant (method B)."""
    alpha = np.random.default_rng(1234).normal(2.2, 1.2, n_test)
    own = rng.normal(0.0, noise, latent.shape + (n_test,))
    return ((alpha + gain + 0.6 * latent[..., None] + own) > 0).mean(-1)


def _latent_shared(rng, shape, null=False):
    u, w = rng.normal(size=shape), math.sqrt(3) * rng.normal(size=shape)
    a = u + (math.sqrt(3) * rng.normal(size=shape) if null else 0.0)
    return _latent_accuracy(rng, a), _latent_accuracy(rng, u + w)


def _truth(draw, null=False) -> float:
    a, b = draw(np.random.default_rng(4321), (100_000,), null)
    return float(a.std() / b.std())


COMPONENTS = {"normal": lambda rng, sh: rng.normal(size=sh),
              "skewed": _std(lambda rng, sh: rng.lognormal(0.0, 0.5, sh)),
              "heavy tails": _std(lambda rng, sh: rng.standard_t(5, sh)),
              "bad seeds": _std(lambda rng, sh: np.where(rng.random(sh) < 0.1, -4.0, 0.0) + rng.normal(size=sh))}


PAIRED_SCENARIOS = {
    "normal": PairedScenario("a = u, b = u + w, normal, var(w) = 3·var(u)", _shared(COMPONENTS["normal"]), 0.5),
    "skewed": PairedScenario("the same, lognormal(0, 0.5) components", _shared(COMPONENTS["skewed"]), 0.5),
    "heavy tails": PairedScenario("the same, Student t (5 df) components", _shared(COMPONENTS["heavy tails"]), 0.5),
    "bad seeds": PairedScenario("the same, 10% of u's seeds 4 std below", _shared(COMPONENTS["bad seeds"]), 0.5),
    "near ceiling 99.4%": PairedScenario("accuracy ~99.4% on 10,000 images, shared gamma error rate",
                                         _ceiling_shared, float("nan")),
    "shared latent, 360 images": PairedScenario("accuracy on 360 images, image right when α_j + 0.6·latent + "
                                                "noise > 0", _latent_shared, float("nan")),
}

PAIRED_METHODS = {"bonett_printed": "independent arms' Bonett, z at 98.75% (ignores the pairing)",
                  "pitman_morgan": "Pitman-Morgan (paired, normal theory: correlation of sums and differences)",
                  "pitman_morgan_ranks": "Pitman-Morgan by ranks (Kendall's tau of sums and differences, its permutation "
                                         "p; not printed)",
                  "paired_bonett_97.5": "paired Bonett (co-kurtosis), z at 97.5% (as published)",
                  "paired_bonett_98": "paired Bonett, z at 98% (widened)",
                  "paired_bonett_98.75": "paired Bonett, z at 98.75% (widened as the std's)"}
PAIRED_TAILS = {"paired_bonett_97.5": 1.0, "paired_bonett_98": 0.8, "paired_bonett_98.75": 0.5}


def paired_spread_cell(scenario: str, replicas: int, trials: int = 2000, seed: int = 0) -> dict:
    """Arms sharing seeds: per method, coverage of the true ratio and power (the interval excludes 1) at it,
    and coverage and false alarms when the ratio is 1."""
    sc, rng = PAIRED_SCENARIOS[scenario], np.random.default_rng(seed)
    out = {m: {} for m in PAIRED_METHODS}
    for null, cov_key, dec_key in ((False, "coverage", "power"), (True, "coverage_null", "false_alarm")):
        truth = _truth(sc.draw, null) if not np.isfinite(sc.truth) else 1.0 if null else sc.truth
        a, b = sc.draw(rng, (trials, replicas), null)
        res = 1 / 10_000 if "ceiling" in scenario else 1 / 360 if "360" in scenario else None
        cis = {"bonett_printed": S.std_ratio_ci(a, b, resolution=res), "pitman_morgan": S.pitman_morgan(a, b)["ci"]}
        for m, tail in PAIRED_TAILS.items():
            with paired_tail(tail):
                cis[m] = S.paired_ratio_ci(a, b)
        for m, (lo, hi) in cis.items():
            out[m][cov_key] = float(_cover(lo, hi, truth).mean())
            out[m][dec_key] = float(_decides(lo, hi).mean())
        out["pitman_morgan_ranks"][cov_key] = float(1 - (_kendall_pitman_morgan_p(a, b, truth) < 0.05).mean())
        out["pitman_morgan_ranks"][dec_key] = float((_kendall_pitman_morgan_p(a, b, 1.0) < 0.05).mean())
    return out


def _kendall_pitman_morgan_p(a, b, ratio: float) -> np.ndarray:
    """Per study (T, n): the two-sided p of Kendall's tau between ``a + ratio·b`` and ``a − ratio·b`` (scipy's
    ``kendalltau``: its exact permutation p without ties), which tests std(a)/std(b) = ratio as Pitman-Morgan's
    correlation does, by ranks. NaN (a tied side) counts as not rejecting."""
    return np.array([sps.kendalltau(s, d).pvalue for s, d in zip(a + ratio * b, a - ratio * b)])


def _paired_counts(rng, shape, gain=0.0):
    """Methods A and B under shared seeds on 360 images: the seed's latent is shared, each run has its own
    per-image noise, B's images are ``gain`` easier (in the latent's units)."""
    latent = rng.normal(size=shape)
    return _latent_accuracy(rng, latent, noise=0.05), _latent_accuracy(rng, latent, gain=gain, noise=0.05)


COMPARE_GAIN = 0.014  # about +0.44 images of 360 (the real gain); the truth by a large simulation

COMPARE_METHODS = {"joined": "paired t at t(96.5%) joined with Garwood (replaced)",
                   "paired_t": "paired t interval, 95% (printed: scipy's ttest_rel confidence_interval)",
                   "sign_flip": "sign-flip test, p < 0.05 (the p printed before; now the paired t's own)"}


def _sign_flip_p(d):
    """Exact two-sided sign-flip p for studies (T, n): every sign pattern (n ≤ 16)."""
    n = d.shape[-1]
    signs = 1 - 2 * ((np.arange(2 ** n)[:, None] >> np.arange(n)) & 1)  # (2^n, n)
    obs = np.abs(d.mean(-1))
    out = np.empty(len(d))
    for i in range(0, len(d), 64):
        means = np.abs(d[i:i + 64] @ signs.T / n)  # (chunk, 2^n)
        out[i:i + 64] = (means >= obs[i:i + 64, None] - 1e-12).mean(-1)
    return out


def compare_cell(replicas: int, trials: int = 2000, seed: int = 0, gain: float = COMPARE_GAIN) -> dict:
    """Paired compare on 360 images: coverage of the true gain and power (excludes 0 / p < 0.05) of the interval
    printed before, the paired t interval (printed, with its own p) and the sign-flip test (printed before); the
    truth in images."""
    big_a, big_b = _paired_counts(np.random.default_rng(55), (100_000,), gain)
    truth = float((big_b - big_a).mean())
    a, b = _paired_counts(np.random.default_rng(seed), (trials, replicas), gain)
    d = b - a
    lo, hi = S.mean_ci(d, resolution=1 / 360)  # the interval paired compare printed before
    half = sps.t.ppf(0.975, replicas - 1) * np.asarray(S.std(d)) / math.sqrt(replicas)
    half = np.where(np.ptp(d, -1) > 0, half, np.asarray(S.paired_difference(a, b, resolution=1 / 360)["ci"][1])
                    - d.mean(-1))  # the printed paired t, with its tie bound where every difference ties
    out = {"joined": {"coverage": float(_cover(lo, hi, truth).mean()), "power": float(_decides(lo, hi, 0.0).mean()),
                       "width": float(np.mean(np.asarray(hi) - np.asarray(lo)))},
           "paired_t": {"coverage": float(_cover(d.mean(-1) - half, d.mean(-1) + half, truth).mean()),
                        "power": float(_decides(d.mean(-1) - half, d.mean(-1) + half, 0.0).mean()),
                        "width": float(np.mean(2 * half))}}
    if replicas <= 16:
        out["sign_flip"] = {"power": float((_sign_flip_p(d) < 0.05).mean())}
    return {"truth_images": truth * 360, **out}


def failed_alarms(scenario: str, replicas: int, threshold: float, trials: int = 4000, seed: int = 0) -> float:
    """Share of healthy arms (no failed run) in which :func:`nondet_jax.analysis.stats.failed_replicas` names
    a replica at ``threshold``; for the failing scenario, the share of arms holding a failed run in which it is
    not named."""
    sc = RATIO_SCENARIOS[scenario]
    x = sc.draw(np.random.default_rng(seed), (trials, replicas))
    named = S.failed_replicas(x, threshold=threshold, resolution=sc.resolution)
    if sc.failed:
        bad = x < 0.7
        has = bad.any(-1) & (bad.sum(-1) < replicas / 2)
        return float(((named != bad).any(-1) & has).sum() / max(has.sum(), 1))
    return float(named.any(-1).mean())


def family_error_paired(scenario: str, replicas: int, arms: int = 6, trials: int = 2000, seed: int = 0) -> float:
    """:func:`family_error` as the findings run it in a study: every arm shares its seeds with the reference
    (each arm ``u + w_k``, the reference ``u + w``, all ``w`` alike), read by the paired interval at level
    1 − 0.05/arms. ``scenario``: a key of :data:`COMPONENTS`."""
    component, rng = COMPONENTS[scenario], np.random.default_rng(seed)
    u = component(rng, (trials, replicas))
    ref = u + math.sqrt(3) * component(rng, (trials, replicas))
    found = np.zeros(trials, bool)
    for _ in range(arms):
        lo, hi = S.paired_ratio_ci(u + math.sqrt(3) * component(rng, (trials, replicas)), ref, level=1 - 0.05 / arms)
        found |= _decides(lo, hi)
    return float(found.mean())


def family_error(scenario: str, replicas: int, arms: int = 6, trials: int = 2000, seed: int = 0,
                 adjust: bool = True) -> float:
    """Share of studies in which at least one of ``arms`` arms, each with the reference arm's spread, is
    found different from it by the findings' interval (the printed ratio interval at level
    1 − 0.05/arms with ``adjust``: Bonferroni, which Holm's first step is; at 95% without)."""
    sc, rng = RATIO_SCENARIOS[scenario], np.random.default_rng(seed)
    ref = _arm(sc, rng, (trials, replicas), 1.0)
    level = 1 - 0.05 / arms if adjust else 0.95
    found = np.zeros(trials, bool)
    for _ in range(arms):
        lo, hi = S.std_ratio_ci(_arm(sc, rng, (trials, replicas), 1.0), ref, level=level, resolution=sc.resolution)
        found |= _decides(lo, hi)
    return float(found.mean())


def paired_accuracy_differences(rng, shape, effect: float) -> tuple[np.ndarray, float]:
    """Differences of 360-image accuracies under shared seeds (:func:`_paired_counts`), the gain scaled to
    ``effect`` standard deviations of the differences, and their true mean: :func:`nondet_jax.analysis.sequential.simulate`'s
    realistic scenario."""
    a0, b0 = _paired_counts(np.random.default_rng(77), (20_000,), 0.0)
    sd = float((b0 - a0).std())
    gain = 0.0
    if effect:
        big_a, big_b = _paired_counts(np.random.default_rng(78), (20_000,), 0.03)
        gain = 0.03 * effect * sd / float((big_b - big_a).mean())
    a, b = _paired_counts(rng, shape, gain)
    big_a, big_b = _paired_counts(np.random.default_rng(79), (50_000,), gain)
    return (b - a) / sd, float((big_b - big_a).mean()) / sd
