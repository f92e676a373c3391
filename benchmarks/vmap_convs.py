"""Replica-batched convolutions: each formulation of nondet_jax.models.convs per conv shape, per role.

For every distinct convolution of the models given (traced from ``model.apply`` at the batch and
image size given: input shape, kernel, stride, padding), and each role (``fwd`` the forward,
``lhs`` the input gradient, ``rhs`` the weight gradient), times each formulation
(``nondet_jax.models.convs.FORMULATIONS``: grouped = what ``vmap`` does by itself, map, im2col, shifted)
on R replicas' operands (random, float32 or the dtype given): one jitted call, ``--reps`` timed
calls after one warm-up, median milliseconds. The JSON is rewritten after every row, so a run cut
short keeps what it measured; ``--budget-s`` stops starting new shapes after that many seconds.

``--write-table`` turns the result into ``nondet_jax/measured.json``'s ``vmap_conv`` entry for this
backend: per shape family (``role/kernel/stride/channels``) the fastest formulation, kept only when
it beats ``grouped`` by ``--min-gain`` (default 1.1x: below that the loaded-machine noise decides),
else ``grouped``. Per-role winners need not compose into a faster training step (on CPU they did
not: see nondet_jax/measured.json); confirm a table with whole steps (``gpu_bench.py`` rows ``vmap``
against ``vmap_grouped``) before committing it.

    python benchmarks/vmap_convs.py --cpu                         # CPU table: ResNet-14 shapes, R=4, batch 32
    python benchmarks/vmap_convs.py --cpu --write-table           # ... and make it the CPU table
    python benchmarks/vmap_convs.py --models resnet14,resnet18 --replicas 16 --batch 128   # GPU (device_checks.sh)
    python benchmarks/vmap_convs.py --quick                       # smoke test: two tiny shapes, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from nondet_jax.models import convs
from nondet_jax.store.io import atomic_write_json

RESULTS = Path(__file__).resolve().parent / "results"


def model_convs(name: str, batch: int, image: int, dtype: str) -> list[dict]:
    """The distinct forward convolutions of model ``name`` (nondet_jax's primitive, role fwd) on
    (batch, image, image, 3) inputs, in the order the model runs them."""
    from nondet_jax.models import make_model

    model = make_model(name, 10, dtype=dtype)
    x = jnp.zeros((batch, image, image, 3), jnp.float32)
    variables = jax.eval_shape(lambda: model.init(jax.random.key(0), x[:1], train=False))
    jaxpr = jax.make_jaxpr(lambda v: model.apply(v, x, train=True, mutable=["batch_stats"]))(variables)
    seen, out = set(), []

    def walk(jx):
        for eqn in jx.eqns:
            if eqn.primitive is convs.conv_p and eqn.params["role"] == "fwd":
                key = (eqn.params["conv"], eqn.params["lhs_shape"], eqn.params["rhs_shape"])
                if key not in seen:
                    seen.add(key)
                    out.append({"conv": eqn.params["conv"], "lhs_shape": eqn.params["lhs_shape"],
                                "rhs_shape": eqn.params["rhs_shape"], "dtype": str(eqn.invars[0].aval.dtype)})
            for sub in jax.core.jaxprs_in_params(eqn.params) if hasattr(jax.core, "jaxprs_in_params") else []:
                walk(sub)

    walk(jaxpr.jaxpr)
    return out


def operands(role: str, c: dict, replicas: int, rng) -> tuple:
    """Random batched operands of ``role`` for conv ``c``: (x, w), (g, w) or (x, g)."""
    params = dict(role="fwd", conv=c["conv"], lhs_shape=c["lhs_shape"], rhs_shape=c["rhs_shape"], barrier=False)
    y = jax.eval_shape(lambda a, b: convs.conv_p.bind(a, b, **params),
                       jax.ShapeDtypeStruct(c["lhs_shape"], c["dtype"]), jax.ShapeDtypeStruct(c["rhs_shape"], c["dtype"]))
    make = lambda shape: jnp.asarray(rng.standard_normal((replicas, *shape), dtype=np.float32), c["dtype"])  # noqa: E731
    x, w, g = make(c["lhs_shape"]), make(c["rhs_shape"]), make(y.shape)
    return {"fwd": (x, w), "lhs": (g, w), "rhs": (x, g)}[role]


def time_call(fn, args, reps: int) -> tuple[float, float]:
    """(compile + first call seconds, median ms of ``reps`` calls)."""
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    first = time.perf_counter() - t0
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(1e3 * (time.perf_counter() - t0))
    return first, statistics.median(times)


def measure(models, replicas, batch, image, dtype, forms, reps, budget_s, out_path, record, log=print) -> dict:
    rng = np.random.default_rng(0)
    t_start = time.perf_counter()
    for name in models:
        for c in model_convs(name, batch, image, dtype):
            if time.perf_counter() - t_start > budget_s:
                record["stopped_early"] = True
                return record
            for role in convs.ROLES:
                args = operands(role, c, replicas, rng)
                fam = convs.family(role, c["conv"], c["rhs_shape"])
                for form in forms:
                    params = dict(role=role, conv=c["conv"], lhs_shape=c["lhs_shape"], rhs_shape=c["rhs_shape"])
                    fn = jax.jit(lambda a, b, form=form, params=params: convs.batched_role(form, a, b, **params))
                    row = {"model": name, "family": fam, "role": role, "form": form, "lhs_shape": c["lhs_shape"],
                           "rhs_shape": c["rhs_shape"], "strides": dict(c["conv"])["window_strides"]}
                    try:
                        row["first_s"], row["ms"] = time_call(fn, args, reps)
                    except Exception as e:  # noqa: BLE001  (a formulation that fails on a backend is a result)
                        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    record["rows"].append(row)
                    log(f"[{time.perf_counter() - t_start:6.1f} s] {name} {fam:<22} {form:<8} "
                        + (f"{row['ms']:9.3f} ms" if "ms" in row else row["error"][:80]))
                    atomic_write_json(out_path, record)
    return record


def best_per_family(rows: list[dict], min_gain: float) -> dict[str, str]:
    """Family -> the fastest formulation (summed over the models' shapes of that family), if it beats
    grouped by ``min_gain``; else grouped."""
    totals: dict[str, dict[str, float]] = {}
    for r in rows:
        if "ms" in r:
            totals.setdefault(r["family"], {}).setdefault(r["form"], 0.0)
            totals[r["family"]][r["form"]] += r["ms"]
    choices = {}
    for fam, t in totals.items():
        best = min(t, key=t.get)
        grouped = t.get("grouped")
        choices[fam] = best if grouped is None or grouped >= min_gain * t[best] else "grouped"
    return choices


def write_table(record: dict, choices: dict, min_gain: float, out_path: Path) -> None:
    from nondet_jax.machine.measured import PATH, _backend_key

    tables = json.loads(PATH.read_text())
    tables["vmap_conv"][_backend_key(record["backend"])] = {
        "source": f"{' '.join(record['command'])} -> benchmarks/results/{out_path.name}",
        "device": record["device_kind"], "replicas": record["replicas"], "batch": record["batch"],
        "dtype": record["dtype"], "min_gain": min_gain, "choices": choices}
    PATH.write_text(json.dumps(tables, indent=2) + "\n")


def format_table(rows: list[dict]) -> str:
    by = {}
    for r in rows:
        by.setdefault((r["model"], r["family"], str(r["lhs_shape"])), {})[r["form"]] = r.get("ms")
    forms = [f for f in convs.FORMULATIONS if any(f in v for v in by.values())]
    lines = [f"{'model':<9} {'family':<22} {'input':<20} " + " ".join(f"{f:>9}" for f in forms) + "  best/grouped"]
    for (m, fam, shape), v in by.items():
        cells = [f"{v[f]:9.2f}" if v.get(f) is not None else f"{'-':>9}" for f in forms]
        ok = {f: ms for f, ms in v.items() if ms is not None}
        gain = (v["grouped"] / min(ok.values())) if v.get("grouped") and ok else float("nan")
        lines.append(f"{m:<9} {fam:<22} {shape:<20} " + " ".join(cells) + f"  {gain:5.2f}x {min(ok, key=ok.get) if ok else ''}")
    lines.append("ms: median of the timed calls (R replicas' operands in one call)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="resnet14,resnet18")
    p.add_argument("--replicas", type=int, default=16)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--image", type=int, default=32)
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 (the model's compute dtype)")
    p.add_argument("--forms", default=",".join(convs.FORMULATIONS))
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--budget-s", type=float, default=1e9, help="start no new conv shape after this many seconds")
    p.add_argument("--cpu", action="store_true", help="CPU settings: resnet14 shapes, R=4, batch 32, 3 reps")
    p.add_argument("--quick", action="store_true", help="smoke test: resnet8 at 8x8, R=2, batch 4, 1 rep")
    p.add_argument("--write-table", action="store_true", help="make the result this backend's table in "
                   "nondet_jax/measured.json")
    p.add_argument("--min-gain", type=float, default=1.1)
    p.add_argument("--table-from", type=Path, help="write the table from this earlier result instead of measuring")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if args.cpu:
        args.models, args.replicas, args.batch, args.reps = "resnet14", 4, 32, 3
    if args.quick:
        args.models, args.replicas, args.batch, args.image, args.reps = "resnet8", 2, 4, 8, 1
    if args.table_from:
        record = json.loads(args.table_from.read_text())
        choices = best_per_family(record["rows"], args.min_gain)
        write_table(record, choices, args.min_gain, args.table_from.resolve())
        print(json.dumps(choices, indent=1))
        return 0
    backend = jax.default_backend()
    out = args.out or RESULTS / f"vmap_convs-{backend}{'-quick' if args.quick else ''}.json"
    forms = [f for f in args.forms.split(",") if f]
    unknown = [f for f in forms if f not in convs.FORMULATIONS]
    if unknown:
        p.error(f"unknown formulations {unknown}; use {','.join(convs.FORMULATIONS)}")
    record = {"benchmark": "vmap_convs", "backend": backend, "device_kind": jax.devices()[0].device_kind,
              "jax": jax.__version__, "models": args.models.split(","), "replicas": args.replicas,
              "batch": args.batch, "image": args.image, "dtype": args.dtype, "forms": forms, "reps": args.reps,
              "xla_flags": os.environ.get("XLA_FLAGS", ""), "load_average": [os.getloadavg()],
              "command": ["python", "benchmarks/vmap_convs.py", *(argv if argv is not None else sys.argv[1:])],
              "rows": []}
    measure(record["models"], args.replicas, args.batch, args.image, args.dtype, forms, args.reps, args.budget_s,
            out, record)
    record["load_average"].append(os.getloadavg())
    record["choices"] = best_per_family(record["rows"], args.min_gain)
    atomic_write_json(out, record)
    print(format_table(record["rows"]))
    print("choices (family -> formulation):", json.dumps(record["choices"], indent=1))
    if args.write_table:
        write_table(record, record["choices"], args.min_gain, out)
        print("wrote the table into nondet_jax/measured.json")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
