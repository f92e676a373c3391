"""A run folder is untrusted input (issue 41): nothing outside it is touched, no code it names runs, every
refusal is one line.

Someone hands you a run folder (a shared disk, an archive, a colleague's results) and you rerun or resume
the command. Every name read from the folder (arms in ``config.json``, files an arm record lists, module
references) passes the command line's grammar before any file operation; every delete or replace goes
through ``store.io.guarded``, which refuses a target outside the folder; ``--resume`` imports only code
the user vouches for (the same reference on the command line) or an installed package outside the folder
and the current directory.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from nondet_jax.errors import UsageError
from nondet_jax.store.io import guarded
from nondet_jax.store.paths import RunPaths, arm_name, contained
from nondet_jax.store.run import record_digest

ROOT = Path(__file__).resolve().parent.parent
FAST = ["--model", "mlp", "--epochs", "1", "--replicas", "2", "--batch-size", "256", "--no-progress"]
ENV = {**os.environ, "JAX_DISABLE_MOST_OPTIMIZATIONS": "1", "JAX_PLATFORMS": "cpu",
       "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


@pytest.fixture(autouse=True)
def _restore_xla_flags(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # sweep.main sets determinism flags


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """A finished 2-arm run folder (control, init) to copy."""
    from nondet_jax.cli import sweep

    out = tmp_path_factory.mktemp("template") / "run"
    assert sweep.main([*FAST, "--arms", "control,init", "--out", str(out)]) == 0
    return out


def state(folder: Path, skip: Path | None = None) -> dict[str, str]:
    """Every entry under ``folder`` (files by content, links by target, folders by name), ``skip`` left out."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(folder):
        here = Path(dirpath)
        if skip is not None and (here == skip or skip in here.parents):
            continue
        for name in dirnames + filenames:
            p = here / name
            if (skip is not None and p == skip) or name == ".lock":  # the lock holds the last holder's pid
                continue
            key = str(p.relative_to(folder))
            if p.is_symlink():
                out[key] = "link:" + os.readlink(p)
            elif p.is_file():
                out[key] = hashlib.sha256(p.read_bytes()).hexdigest()
            else:
                out[key] = "dir"
    return out


def plant_record(run: Path, name: str, like: str = "init") -> None:
    """A record at ``arms/<name>.json`` that passes every record check (a copy of a real arm's)."""
    dest = run / f"arms/{name}.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(run / f"arms/{like}.json", dest)


def add_arm(run: Path, name) -> None:
    config = json.loads((run / "config.json").read_text())
    config["study"]["arms"].append(name)
    (run / "config.json").write_text(json.dumps(config, indent=2))


def one_line(capsys) -> str:
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip() and not ln.startswith("WARNING:")]
    assert len(err) == 1, err
    return err[0]


# --- defect 1: an arm name from config.json deleted a folder outside ------------------------------------------

@pytest.mark.parametrize("how", ["absolute", "dotdot"])
def test_an_arm_name_from_the_folder_never_deletes_outside_it(template, tmp_path, capsys, how):
    """An absolute path in study.arms plus a record planted at arms/<path>.json made the rerun rmtree that
    path (root / "checkpoints" / arm drops the prefix), then exit 2 with "unknown arm". Now the name is
    refused by the arm grammar before anything is deleted, by the sweep, --recompute and the report."""
    from nondet_jax.cli import report, sweep

    run = tmp_path / "run"
    shutil.copytree(template, run)
    victim = tmp_path / "victim"
    (victim / "sub").mkdir(parents=True)
    (victim / "sub" / "precious.txt").write_text("not yours\n")
    name = str(victim) if how == "absolute" else "../../victim"
    add_arm(run, name)
    plant_record(run, name)  # absolute: inside (arms//abs.json); '..': beside the folder, as an archive may hold it
    (run / "checkpoints").mkdir(exist_ok=True)
    before, outside = state(run), state(tmp_path, skip=run)
    capsys.readouterr()
    for argv in ([*FAST, "--arms", "control,init", "--out", str(run)],
                 [*FAST, "--arms", "control,init", "--out", str(run), "--recompute", "init"]):
        assert sweep.main(argv) == 2
        assert "study.arms names arm" in one_line(capsys)
    assert report.main([str(run), "--tensorboard"]) == 2
    assert "study.arms names arm" in one_line(capsys)
    assert state(tmp_path, skip=run) == outside and (victim / "sub" / "precious.txt").exists()
    assert state(run) == before


def test_guarded_refuses_every_target_outside_the_folder(tmp_path):
    run, outside = tmp_path / "run", tmp_path / "outside"
    (run / "checkpoints").mkdir(parents=True)
    outside.mkdir()
    (outside / "f").write_text("x")
    (run / "link").symlink_to(outside)
    for target in (outside, run / ".." / "outside", run / "link" / "f", run, Path("/tmp"), run / "checkpoints" / ".."):
        for op in ("unlink", "rmtree", "rmdir"):
            with pytest.raises(UsageError, match="outside the run folder"):
                guarded(op, run, target)
        with pytest.raises(UsageError, match="outside the run folder"):
            contained(run, target)
    with pytest.raises(UsageError, match="outside the run folder"):
        guarded("replace", run, run / "x", outside / "f")
    assert (outside / "f").read_text() == "x"
    guarded("rmtree", run, run / "checkpoints")  # inside: done
    assert not (run / "checkpoints").exists()


@pytest.mark.parametrize("name", ["/etc", "../x", "init/../../x", "", ".", "init/", 7, None, "a" * 300, "init\0"])
def test_arm_names_from_a_folder_pass_the_command_lines_grammar(name):
    with pytest.raises(UsageError, match="config.json study.arms names arm"):
        arm_name(name, "run/config.json study.arms")
    with pytest.raises(UsageError):
        RunPaths("run").checkpoints(name)


def test_every_destructive_operation_goes_through_the_guarded_helper():
    """rmtree, unlink, rmdir, os.replace, os.remove and rename are called in one place in the package:
    store.io.guarded (and the compilation-cache marker of machine.determinism.check_flags, which writes
    outside any run folder under a name no folder gives, in a layer below the store)."""
    allowed = {("store/io.py", "guarded"), ("machine/determinism.py", "check_flags")}
    methods = {"rmtree", "unlink", "rmdir", "rename", "removedirs"}
    found = set()

    class Visitor(ast.NodeVisitor):
        def __init__(self, where):
            self.where, self.stack = where, ["<module>"]

        def visit_FunctionDef(self, node):
            self.stack.append(node.name)
            self.generic_visit(node)
            self.stack.pop()

        def visit_Call(self, node):
            f = node.func
            if isinstance(f, ast.Attribute) and (f.attr in methods or (
                    f.attr in ("replace", "remove") and isinstance(f.value, ast.Name) and f.value.id == "os")):
                found.add((self.where, self.stack[-1]))
            self.generic_visit(node)

    for path in sorted((ROOT / "nondet_jax").rglob("*.py")):
        Visitor(str(path.relative_to(ROOT / "nondet_jax"))).visit(ast.parse(path.read_text()))
    assert found - allowed == set(), f"destructive operations outside store.io.guarded: {sorted(found - allowed)}"
    assert ("store/io.py", "guarded") in found


def test_a_record_naming_a_file_elsewhere_is_refused(template, tmp_path, capsys):
    """A record's files are hashed on every rerun: a planted one listing ../outside or /dev/zero (its
    own sha256 recomputed, as anyone can) made the sweep read files outside the folder."""
    from nondet_jax.cli import sweep

    for i, listed in enumerate(["../outside.txt", str(tmp_path / "outside.txt"), "logits/../../outside.txt",
                                "logits/control.npy", "/dev/zero"]):
        run = tmp_path / f"run{i}"
        shutil.copytree(template, run)
        (tmp_path / "outside.txt").write_text("x")
        record = json.loads((run / "arms" / "init.json").read_text())
        record["files"][listed] = hashlib.sha256(b"x").hexdigest()
        record["record_sha256"] = record_digest(record)
        (run / "arms" / "init.json").write_text(json.dumps(record))
        before = state(run)
        capsys.readouterr()
        assert sweep.main([*FAST, "--arms", "control,init", "--out", str(run)]) == 2
        assert "which is not one of arm 'init''s files; rerun with --recompute init" in one_line(capsys)
        assert state(run) == before
