"""The package's floor plan (docs/architecture.md): imports point down the layers, and no module
imports itself back through others. Every import counts, at module level or inside a function."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

import nondet_jax
from nondet_jax.store.paths import ARM_EXT, RunPaths

PKG = Path(nondet_jax.__file__).parent

# Bottom to top: a module may import from its own layer and from the layers before it.
LAYERS = ("errors", "machine", "models", "arms", "until", "sources", "data", "instruments", "config", "store", "train", "analysis",
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


def test_the_graph_sees_function_local_imports(tmp_path):
    # a check of the scanner itself, on modules of its own: an import inside a function is an edge, and so
    # is one inside a class body or a conditional; a module that imports nothing has none
    (tmp_path / "a.py").write_text("def f():\n    from nondet_jax.b import g\n    return g\n")
    (tmp_path / "b.py").write_text("class C:\n    if True:\n        import nondet_jax.c\n")
    (tmp_path / "c.py").write_text("x = 1\n")
    edges = imports({f"nondet_jax.{n}": tmp_path / f"{n}.py" for n in "abc"})
    assert edges == {"nondet_jax.a": {"nondet_jax.b"}, "nondet_jax.b": {"nondet_jax.c"}, "nondet_jax.c": set()}


def test_every_module_is_in_the_layer_table():
    """docs/architecture.md's table names every module: a top-level module has its row, a package's module
    is named in backticks in its package's row."""
    rows = {}
    for line in (PKG.parent / "docs" / "architecture.md").read_text().splitlines():
        m = re.match(r"\| `([a-z_]+)/?` \| (.*) \|$", line)
        if m:
            rows[m.group(1)] = set(re.findall(r"`([a-z_.]+)`", m.group(2)))
    missing = []
    for mod in sorted(set(modules()) - ENTRY):
        top, *sub = mod.split(".")[1:]
        if top not in rows or (sub and sub[0] not in rows[top]):
            missing.append(mod)
    assert set(rows) == set(LAYERS) - {"entry"}, sorted(set(rows) ^ (set(LAYERS) - {"entry"}))
    assert missing == [], f"name these modules in docs/architecture.md's layer table: {missing}"


MAX_FUNCTION_LINES = 120


def long_functions(source: str) -> list[tuple[str, int, int]]:
    """``(name, line, lines)`` of every function (nested ones too) longer than MAX_FUNCTION_LINES."""
    return [(n.name, n.lineno, n.end_lineno - n.lineno + 1) for n in ast.walk(ast.parse(source))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > MAX_FUNCTION_LINES]


def test_no_function_is_longer_than_120_lines():
    body = "    x = 0\n"  # the counter itself: a 121-line function is found, a 120-line one is not
    assert [f[0] for f in long_functions("def ok():\n" + body * 119 + "def long():\n" + body * 120)] == ["long"]
    long = [f"{m}:{line} {name} ({n} lines)" for m, f in sorted(modules().items())
            for name, line, n in long_functions(f.read_text())]
    assert long == [], f"split these functions (at most {MAX_FUNCTION_LINES} lines each): {long}"


def spelled_paths(source: str) -> list[tuple[int, str]]:
    """``(line, text)`` of every string (docstrings aside) that spells a run folder's path: ends in one of
    :class:`RunPaths`' file names, or starts with one of its folders and a ``/``."""
    p = RunPaths("/run")
    files = sorted(v.name for v in vars(p).values() if isinstance(v, Path) and v.suffix)
    folders = sorted({*ARM_EXT, "checkpoints", "parts", "tensorboard", p.figures.name})
    pattern = re.compile(r"(^|/)(%s)$|^(%s)/" % ("|".join(map(re.escape, files)), "|".join(folders)))
    tree = ast.parse(source)
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    return [(n.lineno, n.value) for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and id(n) not in docs and pattern.search(n.value.strip())]


# (module, string): why it is not a path spelled by hand
NOT_PATHS = {("nondet_jax.report.tensorboard", "instruments/"): "a TensorBoard tag"}


def test_run_folder_paths_are_spelled_only_in_store_paths():
    """docs/architecture.md: a file of the run folder has its path in store/paths, the only place paths are
    spelled; everything else asks RunPaths."""
    found = spelled_paths('"""config.json"""\nx = root / "config.json"\ny = f"logits/{arm}.npy"\nz = "a.json"\n')
    assert [text for _, text in found] == ["config.json", "logits/"]  # the scanner itself
    spelled = [f"{m}:{line} {text!r}" for m, f in sorted(modules().items()) if m != "nondet_jax.store.paths"
               for line, text in spelled_paths(f.read_text()) if (m, text) not in NOT_PATHS]
    assert spelled == [], f"ask nondet_jax.store.paths.RunPaths for these paths: {spelled}"


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
