"""Where a ResNet-14 training step spends its time on the CPU: the 3x3 convolutions, split into
forward, input gradient and weight gradient, for several conv implementations, XLA:CPU flag sets
and PyTorch, side by side.

Shapes: every 3x3 convolution of ResNet-14 (CIFAR stem, widths 16/32/64, batch 128, 32x32x3
input), with its multiplicity in the network (the 1x1 shortcut convolutions are ~3% of the FLOPs
and left out). For each (implementation, part, shape) the best of ``--repeats`` timed calls of a
jitted function, after a warm-up call; GFLOP/s counts 2*N*H'*W'*Cin*Cout*9 per part (each of
the three parts has the FLOPs of the forward). ``network ms`` weights each shape by how often it
occurs in ResNet-14: the time one training step spends in that part of the 3x3 convolutions.

Implementations (jax, each as one function ``conv(x, w)`` and its ``jax.vjp``):

* ``lax``: ``lax.conv_general_dilated``, NHWC/HWIO (what flax's ``nn.Conv`` emits);
* ``lax_nchw``: the same convolution with NCHW/OIHW dimension numbers (the caller keeps NHWC:
  transposes around it, which XLA may fold into its layout assignment);
* ``shift9``: nine shifted slices of the padded input, each a ``dot_general`` with one tap of
  the kernel, summed (a conv written as matmuls: it vmaps into batched GEMMs instead of grouped
  convolutions). Its autodiff weight gradient is nine GEMMs contracting N*H*W;
* ``im2col``: the nine slices concatenated on the channel axis and one ``dot_general``;
* ``lax_dw_im2col``: ``lax`` forward and input gradient, with a ``custom_vjp`` whose weight
  gradient is im2col(x)^T @ dy (one GEMM contracting N*H*W), since the weight gradient is the
  part XLA:CPU does worst (docs/benchmarks.md).

``torch``: ``torch.nn.functional.conv2d`` (NCHW, oneDNN) with ``torch.autograd.grad`` for one
input at a time, same shapes, ``torch.set_num_threads(--threads)``.

XLA flag sets run in child processes (an XLA flag is read when the backend starts, and an unknown
flag aborts the process, so each set is first checked in a throw-away child): see ``FLAG_SETS``.

    python benchmarks/cpu_profile.py                       # every flag set, impl and torch
    python benchmarks/cpu_profile.py --flags none,ynn_conv --impls lax,shift9 --repeats 5
    python benchmarks/cpu_profile.py --quick               # one shape, 2 repeats

Writes ``benchmarks/results/cpu_profile.json``; prints one table per flag set.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from nondet_jax.store.io import atomic_write_json

RESULTS = Path(__file__).resolve().parent / "results"
BATCH = 128

# (H, W, Cin, Cout, stride, count in ResNet-14): stem, stage 1 (2 blocks x 2 convs), stage 2 and 3
# (first conv strided from the previous width, then 3 convs at the new width).
SHAPES = [
    (32, 32, 3, 16, 1, 1),
    (32, 32, 16, 16, 1, 4),
    (32, 32, 16, 32, 2, 1),
    (16, 16, 32, 32, 1, 3),
    (16, 16, 32, 64, 2, 1),
    (8, 8, 64, 64, 1, 3),
]
QUICK_SHAPES = [(32, 32, 16, 16, 1, 4)]

# XLA:CPU flag sets of jaxlib 0.10.2 (names from the flags the library registers; values checked
# in a child before use). Empty string: the defaults.
FLAG_SETS = {
    "none": "",
    "ynn_conv": "--xla_cpu_experimental_ynn_fusion_type=+individual_convolution",
    "ynn_conv_dot": "--xla_cpu_experimental_ynn_fusion_type=+individual_convolution,+individual_dot",
    "onednn": "--xla_cpu_use_onednn=true --xla_cpu_experimental_onednn_custom_call=true",
    "onednn_custom_call": "--xla_cpu_experimental_onednn_custom_call=true",
    "fast_math": "--xla_cpu_enable_fast_math=true",
    "no_ynn": "--xla_cpu_experimental_ynn_fusion_type=",
}
IMPLS = ("lax", "lax_nchw", "shift9", "im2col", "lax_dw_im2col")
PARTS = ("forward", "input_grad", "weight_grad")


def flops(h: int, w: int, cin: int, cout: int, stride: int) -> float:
    return 2.0 * BATCH * (h // stride) * (w // stride) * cin * cout * 9


# ---------------------------------------------------------------------------- jax conv variants


def conv_impls():
    """name -> conv(x NHWC, w HWIO, stride) in jax; imported lazily (the parent never imports jax)."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    dn = ("NHWC", "HWIO", "NHWC")

    def lax_conv(x, w, stride):
        return lax.conv_general_dilated(x, w, (stride, stride), "SAME", dimension_numbers=dn)

    def lax_nchw(x, w, stride):
        y = lax.conv_general_dilated(x.transpose(0, 3, 1, 2), w.transpose(3, 2, 0, 1), (stride, stride), "SAME",
                                     dimension_numbers=("NCHW", "OIHW", "NCHW"))
        return y.transpose(0, 2, 3, 1)

    def taps(x, stride):
        """The nine (dy, dx) shifted, strided views of the SAME-padded input: (N, H', W', C) each."""
        n, h, w_, c = x.shape
        ho, wo = -(-h // stride), -(-w_ // stride)
        # SAME padding as lax: total pad = max((out-1)*stride + 3 - in, 0), low = total // 2
        ph, pw = max((ho - 1) * stride + 3 - h, 0), max((wo - 1) * stride + 3 - w_, 0)
        xp = jnp.pad(x, ((0, 0), (ph // 2, ph - ph // 2), (pw // 2, pw - pw // 2), (0, 0)))
        return [lax.slice(xp, (0, i, j, 0), (n, i + (ho - 1) * stride + 1, j + (wo - 1) * stride + 1, c),
                          (1, stride, stride, 1)) for i in range(3) for j in range(3)]

    def shift9(x, w, stride):
        out = None
        for t, xs in enumerate(taps(x, stride)):
            y = lax.dot_general(xs, w[t // 3, t % 3], (((3,), (0,)), ((), ())))
            out = y if out is None else out + y
        return out

    def im2col(x, w, stride):
        patches = jnp.concatenate(taps(x, stride), axis=-1)  # (N, H', W', 9C), tap-major
        return lax.dot_general(patches, w.reshape(-1, w.shape[-1]), (((3,), (0,)), ((), ())))

    @jax.custom_vjp
    def _dw_im2col(x, w, stride_arr):
        return lax_conv(x, w, stride_arr.shape[0])

    def _fwd(x, w, stride_arr):
        return lax_conv(x, w, stride_arr.shape[0]), (x, w, stride_arr)

    def _bwd(res, dy):
        x, w, stride_arr = res
        stride = stride_arr.shape[0]
        _, vjp_x = jax.vjp(lambda a: lax_conv(a, w, stride), x)
        patches = jnp.concatenate(taps(x, stride), axis=-1)
        dw = lax.dot_general(patches, dy, (((0, 1, 2), (0, 1, 2)), ((), ()))).reshape(w.shape)
        return vjp_x(dy)[0], dw, jnp.zeros_like(stride_arr)

    _dw_im2col.defvjp(_fwd, _bwd)

    def lax_dw_im2col(x, w, stride):
        return _dw_im2col(x, w, jnp.zeros((stride,), x.dtype))  # the stride rides as a static shape

    return {"lax": lax_conv, "lax_nchw": lax_nchw, "shift9": shift9, "im2col": im2col,
            "lax_dw_im2col": lax_dw_im2col}


def best_of(fn, args, repeats: int) -> float:
    import jax

    jax.block_until_ready(fn(*args))  # compile + warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return min(times)


def profile_jax(impls: list[str], shapes: list[tuple], repeats: int) -> list[dict]:
    """Rows (impl, shape, part, seconds, GFLOP/s) for the jax conv implementations in this process."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    available = conv_impls()
    rng = np.random.default_rng(0)
    rows = []
    for h, w, cin, cout, stride, count in shapes:
        x = jnp.asarray(rng.standard_normal((BATCH, h, w, cin), dtype=np.float32))
        k = jnp.asarray(rng.standard_normal((3, 3, cin, cout), dtype=np.float32) * 0.1)
        dy = jnp.asarray(rng.standard_normal((BATCH, h // stride, w // stride, cout), dtype=np.float32))
        ref = None
        for name in impls:
            conv = available[name]
            f = jax.jit(lambda a, b, c=conv: c(a, b, stride))
            out = f(x, k)
            ref = out if ref is None else ref
            err = float(jnp.abs(out - ref).max())  # every impl computes the same convolution
            parts = {
                "forward": (f, (x, k)),
                "input_grad": (jax.jit(lambda a, b, g, c=conv: jax.vjp(lambda a_: c(a_, b, stride), a)[1](g)[0]),
                               (x, k, dy)),
                "weight_grad": (jax.jit(lambda a, b, g, c=conv: jax.vjp(lambda b_: c(a, b_, stride), b)[1](g)[0]),
                                (x, k, dy)),
            }
            for part, (fn, args) in parts.items():
                s = best_of(fn, args, repeats)
                rows.append({"impl": name, "shape": [h, w, cin, cout, stride], "count": count, "part": part,
                             "seconds": s, "gflops": flops(h, w, cin, cout, stride) / s / 1e9,
                             "max_abs_diff_vs_lax": err})
    return rows


def profile_torch(shapes: list[tuple], repeats: int, threads: int) -> list[dict]:
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    rows = []
    for h, w, cin, cout, stride, count in shapes:
        x = torch.randn(BATCH, cin, h, w, generator=g)
        k = torch.randn(cout, cin, 3, 3, generator=g) * 0.1
        dy = torch.randn(BATCH, cout, h // stride, w // stride, generator=g)

        def part_fn(part):
            if part == "forward":
                return lambda: F.conv2d(x, k, stride=stride, padding=1)
            xr, kr = x.clone().requires_grad_(part == "input_grad"), k.clone().requires_grad_(part == "weight_grad")
            target = xr if part == "input_grad" else kr

            def run():
                y = F.conv2d(xr, kr, stride=stride, padding=1)
                return torch.autograd.grad(y, target, dy)[0]
            return run

        for part in PARTS:
            fn = part_fn(part)
            with torch.no_grad() if part == "forward" else torch.enable_grad():
                fn()
                times = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    fn()
                    times.append(time.perf_counter() - t0)
            # the input-grad and weight-grad runs also pay a forward: subtract it for the part alone
            rows.append({"impl": "torch", "shape": [h, w, cin, cout, stride], "count": count, "part": part,
                         "seconds": min(times), "gflops": flops(h, w, cin, cout, stride) / min(times) / 1e9})
    fwd = {tuple(r["shape"]): r["seconds"] for r in rows if r["part"] == "forward"}
    for r in rows:
        if r["part"] != "forward":
            r["seconds_including_forward"] = r["seconds"]
            # at the 3-channel stem the weight gradient costs less than the noise in the forward: the
            # difference can come out <= 0, recorded as 0 s and no GFLOP/s
            r["seconds"] = max(r["seconds"] - fwd[tuple(r["shape"])], 0.0)
            r["gflops"] = flops(*r["shape"]) / r["seconds"] / 1e9 if r["seconds"] > 0 else None
    return rows


# ---------------------------------------------------------------------------- processes


def flag_accepted(flags: str) -> tuple[bool, str]:
    """Whether XLA starts with ``flags`` (an unknown or malformed flag aborts the process)."""
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    code = "import jax, jax.numpy as jnp; print(float(jax.jit(lambda a: a @ a)(jnp.ones((4, 4))).sum()))"
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    return p.returncode == 0, (p.stderr or p.stdout)[-500:]


def run_child(args: list[str], flags: str, timeout: int = 1800) -> dict:
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    p = subprocess.run([sys.executable, __file__] + args, env=env, capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode != 0 or not lines:
        raise RuntimeError(f"child {args} with XLA_FLAGS={flags!r} failed:\n{p.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def summarise(rows: list[dict]) -> dict:
    """impl -> part -> network milliseconds (each shape weighted by its count in ResNet-14)."""
    out: dict = {}
    for r in rows:
        out.setdefault(r["impl"], {}).setdefault(r["part"], 0.0)
        out[r["impl"]][r["part"]] += 1e3 * r["seconds"] * r["count"]
    return out


def format_tables(record: dict) -> str:
    lines = []
    for flag_name, block in record["flag_sets"].items():
        if "error" in block:
            lines.append(f"[{flag_name}] skipped: {block['error'][:200]}")
            continue
        lines.append(f"[{flag_name}] XLA_FLAGS={block['flags']!r}")
        lines.append(_table(block["rows"]))
    if record.get("torch"):
        lines.append(f"[torch {record['torch_version']}, {record['threads']} threads]")
        lines.append(_table(record["torch"]))
    return "\n".join(lines)


def _table(rows: list[dict]) -> str:
    shapes = []
    for r in rows:
        if r["shape"] not in shapes:
            shapes.append(r["shape"])
    head = f"{'impl':<14} {'part':<12} " + " ".join(f"{'x'.join(map(str, s[:4])) + '/' + str(s[4]):>14}"
                                                     for s in shapes) + f" {'network ms':>11}"
    lines = [head + "   (GFLOP/s per shape)", "-" * len(head)]
    totals = summarise(rows)
    keyed = {(r["impl"], r["part"], tuple(r["shape"])): r for r in rows}
    for impl in dict.fromkeys(r["impl"] for r in rows):
        for part in PARTS:
            vals = [keyed.get((impl, part, tuple(s))) for s in shapes]
            cells = " ".join(f"{v['gflops']:>14.1f}" if v and v["gflops"] else f"{'-':>14}" for v in vals)
            lines.append(f"{impl:<14} {part:<12} {cells} {totals[impl][part]:>11.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--flags", default=",".join(FLAG_SETS), help="flag sets to run (names of FLAG_SETS)")
    p.add_argument("--impls", default=",".join(IMPLS))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--no-torch", action="store_true")
    p.add_argument("--quick", action="store_true", help="one shape, 2 repeats")
    p.add_argument("--out", type=Path)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--torch-child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    shapes = QUICK_SHAPES if args.quick else SHAPES
    repeats = 2 if args.quick else args.repeats
    if args.child:
        print("RESULT " + json.dumps(profile_jax(args.impls.split(","), shapes, repeats)))
        return 0
    if args.torch_child:
        print("RESULT " + json.dumps(profile_torch(shapes, repeats, args.threads)))
        return 0
    record = {"benchmark": "cpu_profile", "batch": BATCH, "shapes": shapes, "repeats": repeats,
              "threads": args.threads, "cpu_count": os.cpu_count(), "load_average_before": os.getloadavg(),
              "flag_sets": {}}
    child_args = ["--child", "--impls", args.impls, "--repeats", str(repeats)] + ["--quick"] * args.quick
    for name in args.flags.split(","):
        flags = FLAG_SETS[name]
        ok, log = flag_accepted(flags)
        if not ok:
            record["flag_sets"][name] = {"flags": flags, "error": log}
            print(f"[{name}] rejected by XLA: {log[-200:]}", flush=True)
            continue
        rows = run_child(child_args, flags)
        record["flag_sets"][name] = {"flags": flags, "rows": rows}
        print(f"[{name}] done", flush=True)
    if not args.no_torch:
        try:
            import torch
            record["torch_version"] = torch.__version__
            record["torch"] = run_child(["--torch-child", "--repeats", str(repeats), "--threads", str(args.threads)]
                                        + ["--quick"] * args.quick, "")
        except ImportError:
            print("torch not installed (pip install -e '.[bench]'): no torch rows")
    record["load_average_after"] = os.getloadavg()
    print(format_tables(record))
    out = args.out or RESULTS / ("cpu_profile-quick.json" if args.quick else "cpu_profile.json")
    atomic_write_json(out, record)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
