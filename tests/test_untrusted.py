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
import random
import shutil
import subprocess
import sys
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
                 [*FAST, "--arms", "control,init", "--out", str(run), "--recompute", "init"],
                 ["--resume", str(run)]):
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
    store.io.guarded (and the compilation-cache marker of machine.determinism.check_flags (``_remember``), which writes
    outside any run folder under a name no folder gives, in a layer below the store)."""
    allowed = {("store/io.py", "guarded"), ("machine/determinism.py", "_remember")}
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


def test_a_resealed_record_in_another_form_is_refused(template, tmp_path, capsys):
    """An arm record edited and its sha256 recomputed (as anyone can) with rows, a metric or the diverged replicas
    in another form crashed the resume and the report; its form is checked with its checksum now."""
    from nondet_jax.cli import sweep
    from nondet_jax.store.run import read_arm_record

    # ... and a score, the varied sources or the replica count as text (an outside review: tracebacks after
    # summary.json was rewritten; 'init' written as i+n+i+t)
    edits = {"rows": ["x", "y"], "metrics": {"accuracy": [1, 2]}, "diverged": {"a": 1},
             "test_accuracy": "high", "varied": "init", "replicas": "two"}
    for i, (key, value) in enumerate(edits.items()):
        run = tmp_path / f"run{i}"
        shutil.copytree(template, run)
        record = json.loads((run / "arms" / "init.json").read_text())
        if key == "test_accuracy":
            record["rows"][0][key] = value
        else:
            record[key] = value if key != "metrics" else {**record["metrics"], **value}
        record["record_sha256"] = record_digest(record)
        (run / "arms" / "init.json").write_text(json.dumps(record))
        with pytest.raises(UsageError, match="is not an arm record .its rows, metrics or diverged replicas"):
            read_arm_record(run, "init")
    before = state(run)
    capsys.readouterr()
    assert sweep.main([*FAST, "--arms", "control,init", "--out", str(run)]) == 2
    assert "is not an arm record (its rows, metrics or diverged replicas are not in their form)" in one_line(capsys)
    assert state(run) == before



@pytest.mark.parametrize("edit", ["no accuracy", "mean as text", "object history", "row without accuracy"])
def test_a_resealed_record_without_its_scores_is_refused_before_the_report_writes(template, tmp_path, capsys, edit):
    """A record resealed without its task's scores as numbers, or a history file resealed with an object array,
    ended the report in a KeyError, TypeError or ValueError after summary.json, arms.csv or a figure had been
    rewritten (an outside review): one line, and nothing written."""
    import hashlib

    import numpy as np

    from nondet_jax.cli.report import main as report

    run = tmp_path / "run"
    shutil.copytree(template, run)
    record = json.loads((run / "arms" / "init.json").read_text())
    if edit == "no accuracy":
        del record["metrics"]["accuracy"]
    elif edit == "mean as text":
        record["metrics"]["cross_entropy"]["mean"] = "x"
    elif edit == "row without accuracy":  # compare read it too: a KeyError
        del record["rows"][0]["test_accuracy"]
    else:
        history = run / "history" / "init.npz"
        arrays = dict(np.load(history))
        np.savez(history, **{**arrays, "train_loss": np.array([["a"] * 2] * 2)})
        record["files"]["history/init.npz"] = hashlib.sha256(history.read_bytes()).hexdigest()
    record["record_sha256"] = record_digest(record)
    (run / "arms" / "init.json").write_text(json.dumps(record))
    before = state(run)
    assert report([str(run)]) == 2
    err = one_line(capsys)
    assert ("does not hold its" if edit != "object history" else "holds <U1 values, not numbers") in err, err
    assert state(run) == before
    if edit == "row without accuracy":
        from nondet_jax.analysis.compare import run_scores

        with pytest.raises(UsageError, match="holds a replica without its test_accuracy as a number"):
            run_scores(run, "init")


# --- defect 2: --resume imported code the folder names through keys other than model.name ----------------------

REFERENCE_FLAGS = {"model.name": "--model", "optim.name": "--optimizer", "train.loss": "--loss",
                   "data.augment": "--augment"}


def planted_folder(tmp_path: Path, key: str, where: str) -> tuple[Path, Path, Path]:
    """(run folder, current directory, marker): the run folder's config names ``planted_mod:thing`` for
    ``key``; ``planted_mod.py`` (it writes the marker when imported) lies in the run folder or in the
    current directory."""
    from nondet_jax.config import from_flat, to_dict

    run, here, marker = tmp_path / "shared", tmp_path / "here", tmp_path / "ran"
    run.mkdir()
    here.mkdir()
    section, name = key.split(".")
    config = to_dict(from_flat({"model.name": "mlp"}))
    config[section][name] = "planted_mod:thing"
    (run / "config.json").write_text(json.dumps(config))
    folder = run if where == "run folder" else here
    (folder / "planted_mod.py").write_text(f"open({str(marker)!r}, 'w').write('imported')\nthing = None\n")
    return run, here, marker


@pytest.mark.parametrize("where", ["run folder", "current directory"])
@pytest.mark.parametrize("key", list(REFERENCE_FLAGS))
def test_resume_imports_no_code_the_folder_names(tmp_path, key, where):
    """The turn-3 fix checked model.name only: a module named by optim.name, train.loss or data.augment,
    planted in the folder (or in the current directory), was imported and ran. Now refused in one line
    naming the key and how to vouch for it, before any import."""
    run, here, marker = planted_folder(tmp_path, key, where)
    proc = subprocess.run([sys.executable, "-m", "nondet_jax.sweep", "--resume", str(run)],  # cd run: on sys.path
                          cwd=run if where == "run folder" else here, env=ENV, capture_output=True, text=True,
                          timeout=120)
    err = proc.stderr.strip()
    assert proc.returncode == 2 and len(err.splitlines()) == 1, err
    assert f"names {key} planted_mod:thing" in err and f"add {REFERENCE_FLAGS[key]} planted_mod:thing" in err
    assert ("inside the run folder" if where == "run folder" else "from the current directory") in err
    assert not marker.exists()


def test_resume_imports_a_reference_the_user_gives_and_says_so(tmp_path):
    run, here, marker = planted_folder(tmp_path, "optim.name", "current directory")
    proc = subprocess.run([sys.executable, "-m", "nondet_jax.sweep", "--resume", str(run), "--optimizer",
                           "planted_mod:thing"], cwd=here, env=ENV, capture_output=True, text=True, timeout=300)
    assert "optim.name planted_mod:thing is imported because you gave --optimizer planted_mod:thing" in proc.stdout
    assert marker.exists()  # vouched for: imported (and then refused, `thing` being no optimiser)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_resume_refuses_a_reference_that_differs_from_the_folders(tmp_path):
    run, here, marker = planted_folder(tmp_path, "train.loss", "run folder")
    proc = subprocess.run([sys.executable, "-m", "nondet_jax.sweep", "--resume", str(run), "--loss", "other:fn"],
                          cwd=here, env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--loss other:fn differs from the run folder's train.loss" in proc.stderr
    assert not marker.exists()


def test_resume_says_an_installed_package_is_imported_from_where(tmp_path, monkeypatch):
    from nondet_jax.cli.sweep import check_references
    from nondet_jax.config import from_flat

    monkeypatch.chdir(tmp_path)
    lines = check_references(from_flat({"model.name": "mlp", "train.loss": "json:loads"}), tmp_path / "run", {})
    assert len(lines) == 1 and "train.loss json:loads is imported from" in lines[0] and "installed" in lines[0]


# --- the property: hostile folders leave everything outside them alone and import nothing ----------------------

def _hostile(rng: random.Random, run: Path, sandbox: Path, marker: Path) -> list[str]:
    """Make ``run`` hostile with 1-3 of: names outside (absolute, '..') in study.arms with planted records and
    checkpoints, a record listing files elsewhere, links out of the folder, planted modules named by the
    config. Returns what was done (for the failure message)."""
    victim = sandbox / "victim"
    kinds = rng.sample(["arm", "record", "link", "module", "junk"], k=rng.randint(1, 3))
    done = []
    for kind in kinds:
        if kind == "arm":
            name = rng.choice([str(victim), "../../victim", "../victim", "init/../../../victim", str(sandbox / "here")])
            add_arm(run, name)
            plant_record(run, name)
            done.append(f"arm {name}")
        elif kind == "record":
            listed = rng.choice(["../../victim/precious.txt", str(victim / "precious.txt"), "logits/../../x"])
            record = json.loads((run / "arms" / "init.json").read_text())
            record["files"][listed] = hashlib.sha256(b"x").hexdigest()
            record["record_sha256"] = record_digest(record)
            (run / "arms" / "init.json").write_text(json.dumps(record))
            done.append(f"record lists {listed}")
        elif kind == "link":
            where = rng.choice(["checkpoints", "parts", "tensorboard", "figures", "arms/bitflip.json"])
            target = run / where
            if target.is_dir():
                shutil.rmtree(target)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.symlink_to(victim if not where.endswith(".json") else victim / "precious.txt")
            done.append(f"link {where}")
        elif kind == "module":
            key = rng.choice(list(REFERENCE_FLAGS))
            section, name = key.split(".")
            config = json.loads((run / "config.json").read_text())
            config[section][name] = "planted_mod:thing"
            (run / "config.json").write_text(json.dumps(config))
            for folder in (run, sandbox / "here"):
                (folder / "planted_mod.py").write_text(f"open({str(marker)!r}, 'w').write('x')\nthing = None\n")
            done.append(f"module via {key}")
        else:
            config = json.loads((run / "config.json").read_text())
            config["study"]["arms"].append(rng.choice([7, None, {"a": 1}, "", "init\0", "x" * 300]))
            (run / "config.json").write_text(json.dumps(config))
            done.append("junk arm")
    return done


def test_hostile_run_folders_touch_nothing_outside_and_import_nothing(template, tmp_path, capsys, monkeypatch):
    """Seeded random hostile folders; each is rerun, resumed (from outside and from inside), recomputed and
    reported. Every command ends in 0 or a one-line refusal (exit 2); nothing outside the run folder
    changes; no planted module is imported."""
    from nondet_jax.cli import report, sweep

    rng = random.Random(41)
    for trial in range(10):
        sandbox = tmp_path / f"t{trial}"
        run, here, marker = sandbox / "run", sandbox / "here", sandbox / "ran"
        shutil.copytree(template, run)
        here.mkdir()
        (sandbox / "victim").mkdir()
        (sandbox / "victim" / "precious.txt").write_text("not yours\n")
        done = _hostile(rng, run, sandbox, marker)
        outside = state(sandbox, skip=run)
        monkeypatch.chdir(here)
        monkeypatch.syspath_prepend(str(here))  # python -m puts the current directory first on sys.path
        commands = [("sweep", [*FAST, "--arms", "control,init", "--out", str(run)]),
                    ("sweep", ["--resume", str(run)]),
                    ("sweep", [*FAST, "--arms", "control,init", "--out", str(run), "--recompute", "init"]),
                    ("report", [str(run), "--tensorboard"])]
        for command, argv in commands:
            capsys.readouterr()
            status = (sweep if command == "sweep" else report).main(argv)
            err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip() and not ln.startswith("WARNING:")]
            assert status in (0, 2) and (status == 0 or len(err) == 1), (done, argv, status, err)
            assert state(sandbox, skip=run) == outside, (done, argv)
            assert not marker.exists() and "planted_mod" not in sys.modules, (done, argv)
        monkeypatch.chdir(run)  # resumed from inside the shared folder
        monkeypatch.syspath_prepend(str(run))
        capsys.readouterr()
        assert sweep.main(["--resume", "."]) in (0, 2)
        assert state(sandbox, skip=run) == outside and not marker.exists(), done


@pytest.mark.parametrize("name", ["model.json", "logits/init.npy"])
def test_a_fifo_in_a_run_folder_is_refused_not_read(template, tmp_path, name):
    """Reading a FIFO waits for a writer forever: model.json is read before the folder is opened, an arm's
    files when its checksums are verified. Every special file in a run folder is refused by name."""
    run = tmp_path / "run"
    shutil.copytree(template, run)
    (run / name).unlink()
    os.mkfifo(run / name)
    proc = subprocess.run([sys.executable, "-m", "nondet_jax.sweep", *FAST, "--arms", "control,init", "--out",
                           str(run)], env=ENV, capture_output=True, text=True, timeout=120)
    err = proc.stderr.strip()
    assert proc.returncode == 2 and len(err.splitlines()) == 1, err
    assert f"{run / name} is a FIFO, which a run folder never holds" in err


@pytest.mark.parametrize("ratios", [5, "abc", float("nan"), [-1.0], [0.6, 1.5]])
def test_report_only_keys_edited_in_config_json_are_checked(template, tmp_path, capsys, ratios):
    """metrics.power_ratios is report-only, so no arm record's digest covers it: 5 or 'abc' ended the report in a
    traceback and NaN or -1 were printed into arms.csv (outside review). Checked as the command line checks it;
    a valid edit is the documented way to change it. command.txt in another encoding is shown, not a crash."""
    from nondet_jax.cli.report import main as report

    run = tmp_path / "run"
    shutil.copytree(template, run)
    config = json.loads((run / "config.json").read_text())
    config["metrics"]["power_ratios"] = ratios
    (run / "config.json").write_text(json.dumps(config))
    (run / "command.txt").write_bytes(b"python -m nondet_jax.sweep --out r\xe9sultats\n")
    before = state(run)
    code, err = report([str(run)]), capsys.readouterr().err.strip()
    if ratios == [0.6, 1.5]:
        assert code == 0 and "r\ufffdsultats" in (run / "report.md").read_text()
        return
    assert code == 2 and len(err.splitlines()) == 1 and "holds a value the report cannot use" in err, err
    assert "metrics.power_ratios" in err and state(run) == before


@pytest.mark.parametrize("edit", ["model strings", "environment empty"])
def test_a_hand_edited_model_or_environment_record(template, tmp_path, capsys, edit):
    """model.json's values edited to strings crashed a resume (AttributeError in the shapes' comparison): refused
    as corrupt in one line, nothing written. environment.json emptied to {} was read as an older version's
    record and a retraining of every arm advised: it says nothing, so the arms' own checks stand and they are
    reused (outside review)."""
    from nondet_jax.cli import sweep

    run = tmp_path / "run"
    shutil.copytree(template, run)
    name = "model.json" if edit == "model strings" else "environment.json"
    record = json.loads((run / name).read_text())
    (run / name).write_text(json.dumps({k: "zzz" for k in record} if edit == "model strings" else {}))
    before = state(run)
    logits = (run / "logits" / "init.npy").read_bytes()
    code, err = sweep.main(["--resume", str(run), "--no-progress"]), capsys.readouterr().err.strip()
    if edit == "model strings":
        assert code == 2 and err.endswith("model.json is unreadable or corrupt; choose another --out"), err
        assert state(run) == before
    else:
        assert code == 0, err
        assert (run / "logits" / "init.npy").read_bytes() == logits and "backend" in (run / name).read_text()


@pytest.mark.parametrize("planted", ["tta/init.npz", "dynamics/init.npz", "instruments/init.npz",
                                     "instruments/init.csv", "instruments.csv"])
def test_files_no_record_lists_are_never_read(template, tmp_path, capsys, planted):
    """A tta/<arm>.npz planted in a study without test-time augmentation put a Mitigations row of invented
    numbers in the report; planted dynamics or instruments files of another form ended it in a traceback
    (outside review). The report reads an arm's files only where its record lists them (checked by digest)."""
    import numpy as np

    from nondet_jax.cli.report import main as report

    run = tmp_path / "run"
    shutil.copytree(template, run)
    (run / planted).parent.mkdir(exist_ok=True)
    if planted.endswith(".csv"):
        (run / planted).write_text("arm,replica,step,quantity,value\ninit,0,0,Loss,1e9\n")
    else:
        np.savez(run / planted, flip=np.full((2, 360, 10), 50.0, np.float32), step=np.zeros(3), weight_distance=7)
    assert report([str(run)]) == 0, capsys.readouterr().err
    text = (run / "report.md").read_text()
    assert "tta:flip" not in text and "Mitigations" not in text and "1e+09" not in text and "Instruments" not in text
    assert not (run / "instruments.csv").exists()


# --- defect 5: --init-from PATH.npz without @R --------------------------------------------------------------

def test_init_from_a_params_file_without_a_replica(tmp_path):
    """The documented form --init-from PARAMS.npz crashed in rpartition (int('params.npz'))."""
    import numpy as np

    from nondet_jax.config import from_flat
    from nondet_jax.study.prepare import resolve_parts

    np.savez(tmp_path / "params.npz", **{"params/dense1/bias": np.ones(3, np.float32)})
    parts = resolve_parts(from_flat({"model.name": "mlp", "model.init_from": str(tmp_path / "params.npz")}))
    assert parts.init_params["dense1"]["bias"].tolist() == [1.0, 1.0, 1.0]
    with pytest.raises(UsageError, match="after @ comes a replica number"):
        resolve_parts(from_flat({"model.name": "mlp", "model.init_from": f"{tmp_path / 'params.npz'}@x"}))


def test_hand_edited_records_found_by_fuzzing_are_refused_in_one_line(tmp_path, capsys):
    """Records edited by hand that gave tracebacks (or a resume from the wrong epoch) before: a checkpoint
    manifest that is a JSON list, a checkpoint step folder renamed to another epoch (the resume started from
    the name's epoch and its new steps pushed the good ones out), model.json identity parts that are not tables,
    a config.json section that is not a table; each is one line now, or read as missing."""
    from nondet_jax.cli import sweep
    from nondet_jax.report.markdown import _trained_md
    from nondet_jax.store.checkpoint import CorruptCheckpoint, _manifest, verify_latest, verify_step
    from nondet_jax.study.identity import identity_diff

    root = tmp_path / "checkpoints" / "control"
    (root / "orbax" / "8" / "meta").mkdir(parents=True)
    (root / "sha256").mkdir()
    (root / "orbax" / "8" / "meta" / "metadata").write_text(json.dumps({"epoch": 7}))  # saved after epoch 7
    (root / "sha256" / "8.json").write_text('["a"]')
    with pytest.raises(CorruptCheckpoint, match="sha256 manifest that is not a table of files"):
        verify_step(root, 8)
    (root / "sha256" / "8.json").write_text(json.dumps(_manifest(root / "orbax" / "8")))
    with pytest.raises(CorruptCheckpoint, match="holds the state after epoch 7, not after epoch 8"):
        verify_latest(root)
    assert identity_diff({"data": [1]}, {"data": {"sha256": "abc"}})[0].startswith("the data differs")
    assert _trained_md({"identity": {"data": [1], "model": "m", "optimizer": None}})[0] == "## What was trained"
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"train": "x"}))
    assert sweep.main(["--resume", str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "section 'train' holds a JSON str, not a table of settings" in err


@pytest.mark.parametrize("edit", ["method", "baseline", "list"])
def test_a_methods_record_with_a_method_that_is_not_a_table_is_refused(tmp_path, edit):
    """methods.json with a method's entry that is not a table (report crashed) or a baseline that is none of
    its methods (report wrote an empty comparison) is refused in one line."""
    from nondet_jax.analysis.methods import read_record

    record = {"baseline": "base", "config": {}, "methods": {"base": {"settings": {}, "parts": [], "folder": "methods/base"},
                                                           "lr2": {"settings": {}, "parts": [], "folder": "methods/lr2"}}}
    (tmp_path / "methods.json").write_text(json.dumps(record))
    assert read_record(tmp_path)["baseline"] == "base"
    if edit == "method":
        record["methods"]["base"] = ["settings"]
    elif edit == "baseline":
        record["baseline"] = "nobody"
    else:
        record["methods"] = ["base", "lr2"]
    (tmp_path / "methods.json").write_text(json.dumps(record))
    with pytest.raises(UsageError, match="is unreadable or not a methods record"):
        read_record(tmp_path)
