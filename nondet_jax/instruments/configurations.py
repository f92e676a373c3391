"""Quantity names and Cockpit's configurations (``economy``, ``business``, ``full``).

Membership is Cockpit's (``cockpit/utils/configuration.py``): economy = Alpha, Distance,
GradHist1d, GradNorm, InnerTest, Loss, NormTest, OrthoTest, UpdateSize; business adds TICDiag and
HessTrace; full adds HessMaxEV and GradHist2d. MeanGSNR, TICTrace, EarlyStopping and CABS are in no
configuration (as in Cockpit) and are asked for by name.

The quantities are :data:`.quantities.QUANTITIES`, their records by name (in their order): that module
imports JAX only when a record computes, so ``config.validate`` uses this one before JAX starts.
"""

from __future__ import annotations

from nondet_jax.instruments.quantities import QUANTITIES

ECONOMY = ("Alpha", "Distance", "GradHist1d", "GradNorm", "InnerTest", "Loss", "NormTest", "OrthoTest", "UpdateSize")
BUSINESS = ECONOMY + ("TICDiag", "HessTrace")
FULL = BUSINESS + ("HessMaxEV", "GradHist2d")
CONFIGURATIONS = {"economy": ECONOMY, "business": BUSINESS, "full": FULL}

CURVATURES = ("ggn", "hutchinson")  # where HessTrace, TICDiag and TICTrace come from (instruments.make)
PLAIN_SGD_ONLY = ("EarlyStopping", "CABS")  # Cockpit refuses them unless SGD has default arguments


def over_examples(names) -> list[str]:
    """The quantities of ``names`` that are sample statistics over a batch's examples (variances with ``B - 1``:
    the gradient tests, histograms, TIC, GSNR, EarlyStopping, CABS, Alpha): a batch of one example gives them none."""
    return [q for q in names if QUANTITIES[q].needs & {"norms", "elements", "grad_sq", "alpha"}]


MAX_HESS_ITERS = 200  # Lanczos keeps every vector: memory grows as hess_iters x parameters, and CPU unrolls it


def resolve(spec: str | tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """Quantity names (in :data:`QUANTITIES` order) of a configuration name, a quantity name, or a
    comma-separated mix of both (``"economy,HessMaxEV"``). ``"none"`` or ``""`` gives ``()``.

    Raises ValueError naming the unknown entry.
    """
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    chosen: set[str] = set()
    for item in (i.strip() for i in items):
        if item in ("", "none"):
            continue
        if item in CONFIGURATIONS:
            chosen.update(CONFIGURATIONS[item])
        elif item in QUANTITIES:
            chosen.add(item)
        else:
            lower = {q.lower(): q for q in (*QUANTITIES, *CONFIGURATIONS)}
            hint = f"did you mean '{lower[item.lower()]}'? " if item.lower() in lower else ""
            raise ValueError(f"unknown instruments configuration or quantity '{item}'; {hint}use none, "
                             f"{', '.join(CONFIGURATIONS)} or quantities from: {', '.join(QUANTITIES)}")
    return tuple(q for q in QUANTITIES if q in chosen)
