"""The package's floor plan (docs/architecture.md): imports point down the layers, and no module
imports itself back through others. Every import counts, at module level or inside a function."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import nondet_jax

PKG = Path(nondet_jax.__file__).parent

# Bottom to top: a module may import from its own layer and from the layers before it.
LAYERS = ("errors", "machine", "models", "arms", "sources", "data", "instruments", "config", "store", "train", "analysis",
          "replicas", "report", "study", "api", "cli", "entry")
ENTRY = {"nondet_jax", "nondet_jax.__main__", "nondet_jax.sweep", "nondet_jax.report.__main__"}  # what users run


def modules() -> dict[str, Path]:
    out = {}
    for f in PKG.rglob("*.py"):
        parts = f.relative_to(PKG.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def layer(module: str) -> str:
    return "entry" if module in ENTRY else module.split(".")[1]


def imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (``from nondet_jax.a import b`` names module ``a.b`` when
    ``b`` is a module, else ``a``)."""
    edges = {}
    for m, f in mods.items():
        targets = set()
        for node in ast.walk(ast.parse(f.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [f"{node.module}.{a.name}" for a in node.names]
            assert not (isinstance(node, ast.ImportFrom) and node.level), f"{f}: relative import"
            for n in names:
                while n and n not in mods:
                    n = n.rpartition(".")[0]
                if n and n != m and n.startswith("nondet_jax") and not m.startswith(n + "."):
                    targets.add(n)
        edges[m] = targets
    return edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    assert circles(imports(modules())) == []


def test_circle_finder_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_every_module_has_a_layer():
    assert {layer(m) for m in modules()} <= set(LAYERS)


def test_imports_point_down_the_layers():
    rank = {name: i for i, name in enumerate(LAYERS)}
    upward = sorted(f"{m} -> {t}" for m, ts in imports(modules()).items() for t in ts
                    if rank[layer(t)] > rank[layer(m)])
    assert upward == []


def test_the_graph_sees_function_local_imports():
    # a sanity check of the scanner itself: study.arm imports the strategies inside a function
    edges = imports(modules())
    assert "nondet_jax.replicas.choice" in edges["nondet_jax.study.arm"]


def test_the_linter_passes():
    # ruff with the project's configuration (pyproject.toml): every file that imports the package
    ruff = Path(sys.executable).with_name("ruff")
    ruff = str(ruff) if ruff.exists() else shutil.which("ruff")
    assert ruff, "ruff is part of the test extra: pip install -e '.[test]'"
    proc = subprocess.run([ruff, "check", "--no-cache", "."], cwd=PKG.parent, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-1000:]


def test_a_refused_argument_never_starts_jax():
    """Every command checks its arguments and config before it imports JAX, flax or scipy (their start is most
    of a refusal's cost: benchmarks/cli_startup.py)."""
    probe = ("import runpy, sys; sys.argv = {argv!r}\n"
             "try:\n    runpy.run_module({module!r}, run_name='__main__')\nexcept SystemExit as e:\n    code = e.code\n"
             "print(sorted(m for m in ('jax', 'flax', 'scipy') if m in sys.modules)); sys.exit(code)")
    cases = [("nondet_jax.sweep", ["--arms", "control,nosuch"]), ("nondet_jax.sweep", ["--set", "train.epochs=0"]),
             ("nondet_jax", ["report", "/nonexistent/run"]), ("nondet_jax", ["audit", "--steps", "0"]),
             ("nondet_jax", ["compare", "a.csv", "b.csv", "--plot", "x.txt"])]
    for module, argv in cases:
        proc = subprocess.run([sys.executable, "-c", probe.format(argv=[module, *argv], module=module)],
                              capture_output=True, text=True, cwd=PKG.parent)
        assert proc.returncode == 2, (argv, proc.stderr[-1000:])
        assert proc.stdout.strip().splitlines()[-1] == "[]", (argv, proc.stdout)
        assert "error:" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
