"""Every Python example in README.md and docs/*.md runs as written.

A ```python block is run in a fresh interpreter, in a scratch folder (so ``runs/`` starts empty). A block may be skipped
only when the line before it says ``<!-- docs-test: skip (reason) -->``, with the reason.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"(?P<before>[^\n]*)\n```python\n(?P<code>.*?)```", re.S)
SKIP = re.compile(r"<!-- docs-test: skip \((?P<reason>[^)]+)\) -->")


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def blocks() -> list:
    out = []
    for path in doc_files():
        text = path.read_text()
        for m in BLOCK.finditer(text):
            line = text[:m.start("code")].count("\n") + 1
            skip = SKIP.search(m.group("before"))
            marks = [pytest.mark.skip(reason=skip.group("reason"))] if skip else []
            out.append(pytest.param(m.group("code"), id=f"{path.relative_to(ROOT)}:{line}", marks=marks))
    return out


def test_skip_markers_give_a_reason():
    for path in doc_files():
        for m in re.finditer(r"<!-- docs-test:[^>]*-->", path.read_text()):
            assert SKIP.fullmatch(m.group(0)), f"{path.name}: {m.group(0)} needs the form <!-- docs-test: skip (reason) -->"


def test_there_are_examples():
    assert len(blocks()) >= 5


@pytest.mark.slow
@pytest.mark.parametrize("code", blocks())
def test_example_runs(code, tmp_path):
    env = {**os.environ, "JAX_DISABLE_MOST_OPTIMIZATIONS": "true", "MPLBACKEND": "Agg",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "NONDET_JAX_DOCS_TMP": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, f"example failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
