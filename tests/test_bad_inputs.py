"""Every row of docs/bad_inputs.md, run: the exact one-line message, exit status 2, nothing damaged.

The table in the docs is generated from CASES by ``python tests/test_bad_inputs.py`` and this test
checks that each documented message is still, exactly, what the code says. Paths under the test's
temporary folder print as ``<tmp>``, process ids as ``<pid>``.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shlex
import sys
from pathlib import Path

import conftest
import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "bad_inputs.md"
FAST = " ".join(conftest.FAST)  # the suite's one small study (tests/conftest.py)

# (where, input as shown in the docs, setup key or None)
CASES: list[tuple[str, str]] = [
    ("CLI", "--arms control,nosuch"),
    ("CLI", "--arms init+cosmic_rays"),
    ("CLI", "--arms control,bitlfip"),
    ("CLI", "--arms control,control"),
    ("CLI", "--arms control,dropout"),
    ("CLI", "--augment off --arms augmentation"),
    ("CLI", "--model resnet99"),
    ("CLI", "--dataset nosuch"),
    ("CLI", "--dataset cifar10 --data-dir <tmp>/empty"),
    ("CLI", "--batch-size 5000"),
    ("CLI", "--replicas 0"),
    ("CLI", "--replicas 1"),
    ("CLI", "--epochs two"),
    ("CLI", "--strategy fast"),
    ("CLI", "--preset nosuch"),
    ("CLI", "--preset ../presets/sources"),  # a path is not a preset's name
    ("CLI", "--width 0"),
    ("CLI", "--set train.epoch=3"),
    ("CLI", "--set optim.lr"),
    ("CLI", "--set optim.lr=-1"),
    ("CLI", "--set model.dropout=1.5"),
    ("CLI", "--set optim.name=lbfgs"),
    ("CLI", "--set optim.schedule=linear"),
    ("CLI", "--set data.augment=sometimes"),
    ("CLI", "--set study.xla_determinism=maybe"),
    ("CLI", "--set train.checkpoint_every=-1"),
    ("CLI", "--arms init@snap"),
    ("CLI", "--arms init,init@snapshot5"),
    ("CLI", "--set metrics.tta=crop9"),
    ("CLI", "--instruments nosuch"),
    ("CLI", "--instruments CABS"),
    ("CLI", "--instruments business --set instruments.curvature=hutchinson"),
    ("CLI", "--instruments HessTrace --set instruments.curvature=exact"),
    ("CLI", "--compile-cache /proc/nondet_jax_cache"),
    ("CLI", "--resume <tmp>/nothing"),
    ("CLI", "--resume <run> --epochs 3"),
    ("CLI", "--out <run> --recompute nosuch"),
    ("CLI", "--model nosuchpkg.nets:Net"),
    ("CLI", "--model json:NoSuchNet"),
    ("CLI", "--model json:dumps"),
    ("CLI", "--model nets"),
    ("CLI", "--dataset <tmp>/missing.npz"),
    ("CLI", "--dataset <tmp>/names.npz  (arrays x, y)"),
    ("CLI", "--dataset <tmp>/shapes.npz  (x_train 20x8x8x1, x_test 10x64)"),
    ("CLI", "--dataset <tmp>/labels.npz  (a label -1 in y_train)"),
    ("CLI", "--dataset <tmp>/length.npz  (19 labels for 20 training examples)"),
    ("CLI", "--dataset <tmp>/features.npz --augment on  ((N, features) arrays)"),
    ("config file", "--config <tmp>/missing.yaml"),
    ("config file", "--config <tmp>/broken.yaml  (contains `train: [1, 2`)"),
    ("config file", "--config <tmp>/list.yaml  (contains `- 1`)"),
    ("config file", "--config <tmp>/c.json  (contains `{\"optim\": {\"lr\": \"fast\"}}`)"),
    ("config file", "--config <tmp>/c.yaml  (contains `trian: {epochs: 3}`)"),
    ("run folder", "--out <tmp>/afile  (a file)"),
    ("run folder", "--out <tmp>/foreign  (a folder holding other files)"),
    ("run folder", "--out <run> --seed 1  (a folder of another config)"),
    ("run folder", "--out <run>  (while another process holds the folder's lock)"),
    ("run folder", "--out <run>  (config.json corrupted)"),
    ("run folder", "--out <run>  (logits/init.npy truncated)"),
    ("run folder", "--out <run>  (arms/init.json corrupted)"),
    ("run folder", "--out <run>  (an arm's checkpoint corrupted mid-training)"),
    ("run folder", "--out <run>  (an arm's checkpoint manifests, sha256, replaced by a file)"),
    ("report", "python -m nondet_jax.report <tmp>/empty"),
    ("run folder", "--dataset <tmp>/good.npz --batch-size 8 --out <tmp>/npzrun  (good.npz rewritten with other arrays since)"),
    ("run folder", "--out <tmp>/ckpt_run --epochs 2 --arms init  (its checkpoint copied from a study with --lr 0.5)"),
    ("CLI", "--lr nan"),
    ("CLI", "--lr inf"),
    ("CLI", "--lr 1e400"),
    ("CLI", "--set optim.weight_decay=inf"),
    ("CLI", "--set optim.warmup_epochs=nan"),
    ("CLI", "--width 1e400"),
    ("CLI", "--set optim.momentum=1.5"),
    ("CLI", "--set optim.step_factor=0"),
    ("CLI", "--epochs 99999999999"),
    ("CLI", "--seed 4294967296"),
    ("CLI", "--seed -1"),
    ("CLI", "--seed 9223372036854775808"),
    ("CLI", "--arms init@snapshot²"),
    ("CLI", "--coordinator bad --num-processes 2 --process-id 0"),
    ("CLI", "--loss huber"),
    ("CLI", "--optimizer nosuchpkg.opt:tx"),
    ("config file", "--config <tmp>/c.json  (contains `{\"optim\": {\"lr\": NaN}}`)"),
    ("config file", "--config <tmp>/c.yaml  (contains `optim: {weight_decay: .inf}`)"),
    ("config file", "--config <tmp>/c.yaml  (contains `study: {seed: 18446744073709551617}`)"),
    ("config file", "--config <tmp>/latin1.yaml  (Latin-1 text `model: {name: résnet8}`)"),
    ("config file", "--config <tmp>/bomb.yaml  (a 400-byte YAML alias bomb)"),
    ("config file", "--config <tmp>/big.yaml  (2 MiB)"),
    ("run folder", "--out <run>  (.lock a symbolic link to a file outside)"),
    ("run folder", "--out <run>  (figures a symbolic link to a folder outside)"),
    ("run folder", "--out <run>  (arms/init.json edited: a test accuracy changed)"),
    ("run folder", "--out <run>  (arms/init.json without its files list)"),
    ("run folder", "--out <run>  (arms/init.json a list)"),
    ("run folder", "--out <run> --lr 0.1  (config.json edited to lr 0.1)"),
    ("run folder", "--out <run>  (test_labels.npy replaced by an object array)"),
    ("run folder", "--out <run>  (disk full: writes fail with ENOSPC)"),
    ("run folder", "--out <run>  (read-only: writes fail with EROFS)"),
    ("report", "python -m nondet_jax.report <run>  (figures a file)"),
    ("report", "python -m nondet_jax.report <run>  (environment.json not JSON)"),
    ("report", "python -m nondet_jax.report <run>  (arms/init.json lacks rows)"),
    ("audit", "python -m nondet_jax audit --json <tmp>/empty"),
    ("audit", "python -m nondet_jax audit --seed 18446744073709551617"),
    ("audit", "python -m nondet_jax audit --steps x"),
    ("report", "python -m nondet_jax.report"),
    ("compare", "python -m nondet_jax compare <tmp>/empty"),
    ("compare", "python -m nondet_jax compare <tmp>/a.csv <tmp>/b.csv --plot <tmp>/nosuch/compare.png"),
    ("API", "config.from_flat({'model.nam': 'resnet8'})"),
    ("API", "sources.arm_sources('nosuch')"),
    ("API", "data.load_dataset('nosuch')"),
    ("API", "train.make_train(from_flat({'train.batch_size': 5000}), digits_spec)"),
    ("API", "metrics.accuracy(np.zeros((2, 5, 10)), np.zeros(4, int))"),
    ("API", "replicate(lambda keys: 0.0, lambda s, b, keys: s, steps=2, arms='control,dropout')"),
    ("API", "replicate(lambda keys: 0.0, lambda s, b, keys: s, steps=2, seed=2**32)"),
    ("API", "replicate(lambda keys: 0.0, lambda s, b, keys: s, steps=2, arms='init,init')"),
    ("API", "run_study(Linear, TWO_CLASSES, batch_size=4, arms='control,dropout')"),
    ("API", "run_study(Linear, TWO_CLASSES, batch_size=4, arms='control,augmentation', augment=lambda key, x: x)"),
    ("API", "run_study(lambda num_classes: Linear(5), TWO_CLASSES, batch_size=4)"),
    ("API", "memory.check_fits(from_flat({'study.replicas': 10**7, 'model.name': 'mlp'}), digits_spec, 360, "
            "available=16 * 2**30, where='host memory')"),
    ("config file", "--config <tmp>/digits.yaml  (a seed of 5000 digits)"),
    ("CLI", "--set metrics.power_ratios=1"),
    ("run folder", "--out <tmp>/<256-byte-name>"),
    ("run folder", "--out <tmp>/<byte-0xff>  (a name that is not UTF-8)"),
    ("CLI", "--dataset <tmp>/ids.npz  (labels 0 and 10^8)"),
    ("CLI", "--dataset <tmp>/header.npz  (x_train's header claims 10^8 examples, its data holds 20)"),
    ("audit", "python -m nondet_jax audit --model mlp --steps 1 --no-child --json <tmp>/audit.json  "
              "(read-only: writes fail with EROFS)"),
    ("compare", "python -m nondet_jax compare <tmp>/a.csv <tmp>/b.csv --plot <tmp>/compare.png  "
                "(read-only: writes fail with EROFS)"),
    ("API", "run_study(Linear, TWO_CLASSES, batch_size=4, arms='control,augmentation', "
            "augment=lambda key, x: (x + jax.random.normal(key, x.shape))[:-1])"),
    ("API", "memory.check_program_fits(jax.jit(lambda: jnp.zeros((10**5, 10**5))).lower().compile().memory_analysis(), "
            "'4 replicas', 'use fewer', available=16 * 2**30, where='host memory')"),
    ("compare", "python -m nondet_jax compare <tmp>/a.csv <tmp>/b.csv --column accuracy,accuracy"),
    ("compare", "python -m nondet_jax compare <tmp>/a.csv <tmp>/b.csv --column accuracy,loss --plot <tmp>/compare.png"),
    ("compare", "python -m nondet_jax compare <run> <run> --arm init,all --arm-b all"),
    # issue 41: a run folder is untrusted input; duplicate keys; files and FIFOs where outputs go
    ("config file", "--config <tmp>/twice.yaml  (section train given twice: epochs, then batch_size)"),
    ("config file", "--config <tmp>/c.json  (contains `{\"train\": {\"epochs\": 3}, \"train\": {\"batch_size\": 8}}`)"),
    ("config file", "--config <tmp>/c.json  (contains `{\"train\": {\"epochs\": 3}, \"train.epochs\": 5}`)"),
    ("config file", "--config <tmp>/c.yaml  (contains `study: {seed: yes}`)"),
    ("config file", "--config <tmp>/c.yaml  (contains `train: null`)"),
    ("config file", "--config <tmp>/fifo.yaml  (a FIFO)"),
    ("config file", "--config <tmp>/deep.json  (arrays nested 100,000 deep)"),
    ("CLI", "--features nosuch"),
    ("CLI", "--set metrics.tta=crop3,crop3"),
    ("CLI", "--set train.eval_batch_size=0"),
    ("CLI", "--coordinator node0:12345 --num-processes 0 --process-id 0"),
    ("CLI", "--arms control,data_order --init-from <tmp>/trunc.npz  (a truncated zip)"),
    ("CLI", "--arms control,data_order --init-from <tmp>/claims.npz  (a header claiming 10^12 weights)"),
    ("CLI", "--dataset <tmp>/array.npz  (a .npy file named .npz)"),
    ("CLI", "--dataset <tmp>/unseen.npz  (a test label no training example has)"),
    ("run folder", "--out <run>  (config.json's study.arms given the path <tmp>/outside, a record planted for it)"),
    ("run folder", "--out <run>  (a planted arms/init.json listing ../outside/precious.txt, its checksum redone)"),
    ("run folder", "--resume <run>  (config.json names optim.name planted_mod:tx, a module installed nowhere)"),
    ("run folder", "--out <run>  (replicas.csv a folder)"),
    ("run folder", "--out <run>  (summary.json a FIFO)"),
    ("run folder", "--out <run>  (arms a file)"),
    ("run folder", "--out <run>  (.lock a folder)"),
    ("run folder", "--out <tmp>/dangling  (a symbolic link to a folder that does not exist)"),
    ("report", "python -m nondet_jax.report <run>  (figures/accuracy.png a folder)"),
    # issue 41, defect 10: misuse of the API named before it fails deep in JAX
    ("API", "run_study(Linear, TWO_CLASSES, batch_size=4, optimizer='adam')"),
    ("API", "run_study(Pair, TWO_CLASSES, batch_size=4)"),
    ("API", "run_study(Linear, TWO_CLASSES, batch_size=4, loss=lambda out, y: jnp.stack([out[:, 0]] * 3, 1))"),
    ("API", "replicate(lambda keys: {'w': jnp.zeros(3)}, lambda s, b, keys: {'w': s['w'], 'extra': 1.0}, steps=2)"),
    ("API", "replicate(lambda keys: {'w': jnp.zeros(3)}, lambda s, b, keys: {'w': s['w'].astype(jnp.int32)}, steps=2)"),
    ("API", "replicate(lambda keys: {'w': jnp.zeros(3)}, lambda s, b, keys: {'w': jnp.zeros(4)}, steps=2)"),
    ("CLI", "--arms control,augmentation --augment os:system"),
    # issue 45: replicate's scores
    ("API", "replicate(lambda keys: 0.0, lambda s, b, keys: s, steps=2, arms='control', score='loss')"),
    ("API", "replicate(lambda keys: jnp.zeros(3), lambda s, b, keys: s, steps=2, arms='control', score=lambda s: s)"),
    ("API", "replicate(lambda keys: jnp.zeros(()), lambda s, b, keys: s, steps=2, arms='control').to_frame()"),
    ("API", "replicate(lambda keys: jnp.zeros(()), lambda s, b, keys: s, steps=2, arms='control', "
            "score=lambda s: s).compare('control', 'init')"),
    # issue 44: a study of methods
    ("CLI", "--method base: --method base:optim.lr=0.1"),
    ("CLI", "--method base: --method 2x:optim.lr=0.1"),
    ("CLI", "--method base: --method lr2:optim.lrr=0.2"),
    ("CLI", "--method base: --method s1:study.seed=1"),
    ("CLI", "--method base: --method lr2:optim.lr=0.2 --baseline lr3"),
    ("CLI", "--method base"),
    ("CLI", "--method base: --baseline base"),
    ("API", "run_study(model='mlp', methods={'base': {}, 'lr2': {'lr': 0.2}})"),
    ("CLI", "--batch-methods"),
    ("CLI", "--method base: --method lr2:optim.lr=0.2 --recompute all"),
    ("CLI", "--method base: --method lr2:optim.lr=0.2 --num-processes 2"),
    # issue 42: epochs stepped on CPU at every length
    ("run folder", "--out <run>  (its arms' epochs ran as one scan: an older nondet_jax)"),
    # issue 46: the audit's internal flag, typed by hand
    ("audit", "python -m nondet_jax audit --child-json"),
    # issue 43: a sequential study of methods
    ("CLI", "--method base: --method lr2:optim.lr=0.2 --until decided"),
    ("CLI", "--method base: --method lr2:optim.lr=0.2 --replicas 4 --until sure"),
    ("CLI", "--method base: --method lr2:optim.lr=0.2 --replicas 4 --until width=-1"),
    ("CLI", "--method base: --method lr2:optim.lr=0.2 --replicas 4 --until decided --max-replicas 4"),
    ("CLI", "--method base: --method lr2:optim.lr=0.2 --replicas 4 --max-replicas 8"),
    ("CLI", "--until decided"),
    ("CLI", "--method base: --method lr2:optim.lr=0.2 --replicas 4 --until decided --batch-methods"),
    ("CLI", "--method base: --method lr2:optim.lr=0.2 --replicas 4 --until decided --arms control,hardware"),
    ("API", "run_study(model='mlp', until='decided')"),
    ("CLI", "--set study.dynamics_every=2 --set train.epoch_shape=scan"),
    ("CLI", "--set train.replica_threads=-1"),
    # settings your own optimizer would ignore, and replicate's batches against its steps
    ("CLI", "--optimizer mypkg.opt:adam --lr 0.7"),
    ("API", "run_study(Linear, TWO_CLASSES, batch_size=4, optimizer=optax.sgd(0.1), settings={'optim.lr': 0.2})"),
    ("API", "run_study(Linear, TWO_CLASSES, batch_size=4, optimizer=optax.lbfgs())"),
    # a setting that only another of the config's optimizers or schedules reads
    ("CLI", "--set optim.name=adamw --set optim.momentum=0.5"),
    ("API", "run_study(Linear, TWO_CLASSES, batch_size=4, settings={'optim.schedule': 'step', 'optim.warmup_epochs': 2})"),
    # an optimizer of your own whose state changes dtype, or whose updates are another tree: named before training
    ("API", "run_study(Linear, TWO_CLASSES, batch_size=4, optimizer=optax.GradientTransformation("
            "lambda p: jnp.zeros((), jnp.int32), lambda g, s, p=None: (g, s + 0.5)))"),
    ("API", "run_study(Linear, TWO_CLASSES, batch_size=4, optimizer=optax.GradientTransformation("
            "lambda p: optax.EmptyState(), lambda g, s, p=None: ({'x': 1.0}, s)))"),
    # a fix that names the real problem: a model factory's other required argument, weights wrapped in 'params'
    ("API", "run_study(lambda num_classes, hidden: Linear(num_classes), TWO_CLASSES, batch_size=4)"),
    ("API", "run_study(Linear, TWO_CLASSES, batch_size=4, init_params={'params': {'Dense_0': {'bias': jnp.zeros(2)}}})"),
    # a keyword and a setting that disagree (one settings dict reused across calls): neither silently wins
    ("API", "run_study(Linear, TWO_CLASSES, batch_size=4, settings={'train.batch_size': 8})"),
    ("API", "replicate(lambda keys: jnp.zeros(3), lambda s, b, keys: s, (jnp.ones((8, 2)),), steps=4)"),
    # compare reads a run folder as report does
    ("compare", "python -m nondet_jax compare <run> <run> --arm init  (arms/init.json edited: a test accuracy changed)"),
    ("compare", "python -m nondet_jax compare <run> <run> --arm init  (arms/init.json a list)"),
    ("compare", "python -m nondet_jax compare <run> <run> --arm init  (model.json a FIFO)"),
    ("compare", "python -m nondet_jax compare <run> <run> --arm init  (logits/init.npy a symbolic link to a copy outside)"),
    ("compare", "python -m nondet_jax compare <run> <run> --arm init  (model.json not JSON)"),
    # a sequential study's first look beyond the most replicas it plans for (it named the default --max-replicas)
    ("CLI", "--method base: --method lr2:optim.lr=0.2 --replicas 2000 --until decided"),
    # refused before the first look trained every method (compare_methods then found no arm to compare)
    ("CLI", "--method base: --method lr2:optim.lr=0.2 --replicas 4 --until decided --arms control"),
    ("CLI", "--batch-size 1 --instruments economy"),  # their variances divide by B - 1: a traceback once
    ("CLI", "--replicas 1 --set metrics.pairwise=false study.dynamics_every=1"),  # traced nothing, silently
    ("CLI", "--arms init,data_order --set metrics.decomposition=true"),  # trained, then left the decomposition out
]

class Linear:  # a user's model without dropout (built lazily: flax is imported by the cases that use it)
    def __new__(cls, num_classes: int = 2):
        import flax.linen as nn

        class Dense(nn.Module):
            num_classes: int = 2

            @nn.compact
            def __call__(self, x, train: bool):
                return nn.Dense(self.num_classes)(x)

        return Dense(num_classes)


class Pair:  # a user's model returning a tuple (built lazily, as Linear)
    def __new__(cls, num_classes: int = 2):
        import flax.linen as nn

        class Two(nn.Module):
            num_classes: int = 2

            @nn.compact
            def __call__(self, x, train: bool):
                h = nn.Dense(self.num_classes)(x)
                return h, h

        return Two(num_classes)


ALIAS_BOMB = "".join(f"{b}: &{b} [{','.join([f'*{a}'] * 9) if a else ','.join(['x'] * 9)}]\n"
                     for a, b in zip(["", *"abcdefgh"], "abcdefghi"))


PROSE = "<!-- generated table ends; the rest is written by hand -->"


def _npz_arrays(name: str) -> dict:
    """The arrays of the --dataset files the cases write (see CASES)."""
    import numpy as np

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(20, 8, 8, 1)).astype(np.float32), np.arange(20) % 3
    good = {"x_train": x, "y_train": y, "x_test": x[:10], "y_test": y[:10]}
    return {"names.npz": {"x": x, "y": y},
            "shapes.npz": {**good, "x_test": x[:10].reshape(10, 64)},
            "labels.npz": {**good, "y_train": np.where(np.arange(20) == 3, -1, y)},
            "length.npz": {**good, "y_train": y[:19]},
            "features.npz": {**good, "x_train": x.reshape(20, 64), "x_test": x[:10].reshape(10, 64)},
            "ids.npz": {**good, "y_train": np.where(np.arange(20) == 3, 10**8, y % 2), "y_test": y[:10] % 2},
            "unseen.npz": {**good, "y_test": np.where(np.arange(10) == 0, 3, y[:10])},
            "good.npz": good}[name]


def _write_claiming_npz(path: Path, arrays: dict, claims: dict) -> None:
    """A .npz whose members' headers claim the shapes in ``claims`` but hold ``arrays``' data."""
    import io
    import zipfile

    import numpy as np

    with zipfile.ZipFile(path, "w") as z:
        for name, a in arrays.items():
            buf = io.BytesIO()
            np.lib.format.write_array_header_1_0(buf, {"descr": np.lib.format.dtype_to_descr(a.dtype),
                                                      "fortran_order": False, "shape": claims.get(name, a.shape)})
            z.writestr(f"{name}.npy", buf.getvalue() + a.tobytes())


def _normalize(message: str, tmp: Path) -> str:
    message = message.replace(str(tmp), "<tmp>")
    message = re.sub(r"/[0-9a-f]{32}\b", "/<hash>", message)  # orbax's data file names
    return re.sub(r"pid \d+", "pid <pid>", message)


def _snapshot(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != ".lock"} if folder.is_dir() else {}


class Context:
    """A temporary folder and, made once, a finished 2-arm run folder to copy."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self._run: Path | None = None

    def finished_run(self) -> Path:
        import shutil

        from nondet_jax.cli import sweep

        if self._run is None:
            self._run = self.tmp / "template"
            assert sweep.main([*FAST.split(), "--arms", "control,init", "--out", str(self._run)]) == 0
        run = self.tmp / "run"
        shutil.rmtree(run, ignore_errors=True)
        shutil.copytree(self._run, run)
        return run


def run_case(where: str, text: str, ctx: Context, capsys) -> tuple[str, int, bool]:
    """(normalised message, exit status, whether the touched folder was left byte-for-byte as it was)."""
    import numpy as np

    from nondet_jax import config, data, sources, train
    from nondet_jax.analysis import metrics
    from nondet_jax.api import replicate, run_study
    from nondet_jax.cli import sweep
    from nondet_jax.config import from_flat
    from nondet_jax.errors import UsageError
    from nondet_jax.study import memory

    tmp = ctx.tmp
    if where == "API":
        spec = train.DataSpec(1437, (8, 8, 1), 10, "digits")
        try:
            import jax
            import jax.numpy as jnp
            import optax

            eval(text, {"jax": jax, "jnp": jnp, "optax": optax, "config": config, "sources": sources,  # noqa: S307
                        "data": data, "train": train,
                        "from_flat": from_flat, "digits_spec": spec, "np": np, "metrics": metrics, "memory": memory,
                        "replicate": replicate, "run_study": run_study, "Linear": Linear, "Pair": Pair,
                        "TWO_CLASSES": (np.zeros((8, 3), np.float32), np.arange(8) % 2, np.zeros((4, 3), np.float32),
                                        np.arange(4) % 2)})
        except UsageError as e:
            return _normalize(str(e), tmp), 2, True
        raise AssertionError(f"{text} raised nothing")
    command, _, note = text.partition("  (")
    folder = None
    if "<run>" in command:
        folder = ctx.finished_run()
        command = command.replace("<run>", str(folder))
    command = command.replace("<tmp>", str(tmp))
    content = re.search(r"contains `(.*)`", note)
    args = [a.replace("<256-byte-name>", "n" * 256).replace("<byte-0xff>", os.fsdecode(b"\xff"))
            for a in shlex.split(command)]
    if note.startswith("a seed of 5000 digits"):
        Path(args[args.index("--config") + 1]).write_text(f"study: {{seed: {'9' * 5000}}}\n")
    if "compare" in args:
        for name, values in (("a.csv", "0.91\n0.92\n0.90\n"), ("b.csv", "0.93\n0.92\n0.94\n")):
            (tmp / name).write_text(f"accuracy\n{values}")
    if "--config" in args:
        path = Path(args[args.index("--config") + 1])
        if content:
            path.write_text(content.group(1))
    if note.startswith(("a truncated zip", "a .npy file named")):
        import io

        buf = io.BytesIO()
        np.savez(buf, **_npz_arrays("good.npz")) if note.startswith("a truncated") else np.save(buf, np.zeros(3))
        data = buf.getvalue()
        flag = "--init-from" if "--init-from" in args else "--dataset"
        Path(args[args.index(flag) + 1]).write_bytes(data[:len(data) // 2] if note.startswith("a truncated") else data)
    elif note.startswith("a header claiming"):  # np.load raised MemoryError, a traceback
        import numpy as np

        _write_claiming_npz(Path(args[args.index("--init-from") + 1]),
                            {"params/dense1/kernel": np.zeros((2, 2), np.float32)}, {"params/dense1/kernel": (10**6, 10**6)})
    elif "--dataset" in args and Path(args[args.index("--dataset") + 1]).name != "missing.npz" and \
            args[args.index("--dataset") + 1].endswith(".npz"):
        import numpy as np

        path = Path(args[args.index("--dataset") + 1])
        if path.name == "header.npz":
            _write_claiming_npz(path, _npz_arrays("good.npz"), {"x_train": (10**8, 8, 8, 1)})
        else:
            np.savez(path, **_npz_arrays(path.name))
    if note.startswith("a file"):
        Path(args[args.index("--out") + 1]).write_text("x")
    if note.startswith("a folder holding"):
        folder = Path(args[args.index("--out") + 1])
        folder.mkdir(exist_ok=True)
        (folder / "thesis.tex").write_text("x")
    (tmp / "empty").mkdir(exist_ok=True)
    if note.startswith("Latin-1"):
        path.write_bytes("model: {name: résnet8}\n".encode("latin-1"))
    if note.startswith("a 400-byte"):
        path.write_text(ALIAS_BOMB)
    if note.startswith("2 MiB"):
        path.write_text("# padding\n" * (2 * 2**20 // 10 + 1))
    outside = tmp / "outside"
    outside.mkdir(exist_ok=True)
    (outside / "precious.txt").write_text("not yours\n")
    if note.startswith(".lock a symbolic link"):
        (folder / ".lock").unlink()
        (folder / ".lock").symlink_to(outside / "precious.txt")
    if note.startswith("figures a symbolic link"):
        import shutil

        shutil.rmtree(folder / "figures")
        (folder / "figures").symlink_to(outside)
    if note.startswith("figures a file"):
        import shutil

        shutil.rmtree(folder / "figures")
        (folder / "figures").write_text("x")
    if note.startswith("its arms' epochs ran as one scan"):
        env = json.loads((folder / "environment.json").read_text())
        env.pop("epoch_shape", None)  # an older version recorded none: its epochs ran as one scan
        (folder / "environment.json").write_text(json.dumps(env, indent=2) + "\n")
    if note.startswith("environment.json not JSON"):
        (folder / "environment.json").write_text("{ not json")
    if note.startswith("arms/init.json") and not note.startswith("arms/init.json corrupted"):
        record = json.loads((folder / "arms" / "init.json").read_text())
        if "test accuracy changed" in note:
            record["rows"][0]["test_accuracy"] += 0.01
        if "without its files" in note:
            del record["files"]
        if "lacks rows" in note:
            del record["rows"]
        if "a list" in note:
            record = [record]
        (folder / "arms" / "init.json").write_text(json.dumps(record, indent=2) + "\n")
    if note.startswith("config.json edited"):
        saved = json.loads((folder / "config.json").read_text())
        saved["optim"]["lr"] = 0.1
        (folder / "config.json").write_text(json.dumps(saved, indent=2) + "\n")
    if note.startswith("test_labels.npy replaced"):
        np.save(folder / "test_labels.npy", np.array([{"x": 1}, None], dtype=object), allow_pickle=True)
    _untrusted_setup(note, args, folder, tmp, outside)
    refuse = {"disk full": 28, "read-only": 30}.get(note.split(":")[0]) if note else None
    lock_fd = None
    if note.startswith("while another process"):
        lock_fd = os.open(folder / ".lock", os.O_RDWR)
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.pwrite(lock_fd, f"{os.getpid()}\n".encode(), 0)
    if note.startswith("config.json corrupted"):
        (folder / "config.json").write_text("{ not json")
    if note.startswith("logits/init.npy truncated"):
        p = folder / "logits" / "init.npy"
        p.write_bytes(p.read_bytes()[:100])
    if note.startswith("arms/init.json corrupted"):
        (folder / "arms" / "init.json").write_text('{"arm": "init", "files": ')
    if note.startswith("an arm's checkpoint"):
        folder = _folder_with_corrupt_checkpoint(ctx)
        args = [*FAST.split(), "--epochs", "2", "--arms", "init", "--out", str(folder)]
    if note.startswith("an arm's checkpoint manifests"):  # every step looked unfinished and was deleted
        import shutil

        folder = _folder_with_checkpoint(ctx, "ckpt_sha_run", [])
        shutil.rmtree(folder / "checkpoints" / "init" / "sha256")
        (folder / "checkpoints" / "init" / "sha256").write_text("")
        args = [*FAST.split(), "--epochs", "2", "--arms", "init", "--out", str(folder)]
    if note.startswith("its checkpoint copied"):
        import shutil

        folder = _folder_with_checkpoint(ctx, "ckpt_run", [])
        other = _folder_with_checkpoint(ctx, "lr_run", ["--lr", "0.5"])
        shutil.rmtree(folder / "checkpoints" / "init")
        shutil.copytree(other / "checkpoints" / "init", folder / "checkpoints" / "init")
    if note.startswith("good.npz rewritten"):
        folder = Path(args[args.index("--out") + 1])
        assert sweep.main([*FAST.split(), "--arms", "control", *args]) == 0
        np.savez(path, **{**_npz_arrays("good.npz"), "x_train": np.random.default_rng(1).normal(
            size=(20, 8, 8, 1)).astype(np.float32)})
    before = _snapshot(folder) if folder else {}
    outside_before = _snapshot(outside)
    capsys.readouterr()
    import tempfile

    real_mkstemp = tempfile.mkstemp
    if refuse:  # the file system refuses every new file from here on (ENOSPC, EROFS)
        def mkstemp(*a, **k):
            raise OSError(refuse, os.strerror(refuse))

        tempfile.mkstemp = mkstemp
    cli_args = args[4:] if args[:3] == ["python", "-m", "nondet_jax"] else args[3:]  # python -m nondet_jax audit ... / nondet_jax.report
    try:
        if where == "report":
            from nondet_jax.cli import report

            status = report.main(cli_args)
        elif where == "audit":
            from nondet_jax.cli import audit

            status = audit.main(cli_args)
        elif where == "compare":
            from nondet_jax.cli import compare

            status = compare.main(cli_args)
        else:
            status = sweep.main([*FAST.split(), *args] if "--resume" not in args else args)
    except SystemExit as e:  # argparse
        status = e.code
    finally:
        tempfile.mkstemp = real_mkstemp
        if lock_fd is not None:
            os.close(lock_fd)
    err = [ln for ln in capsys.readouterr().err.splitlines()
           if ln.strip() and "Location" not in ln and not ln.startswith("WARNING:")]  # absl logging lines
    assert len(err) == 1, err
    message = re.sub(r"^python -m nondet_jax[. ](sweep|report|audit|compare): error: ", "", err[0])
    untouched = (_snapshot(folder) == before if folder else True) and _snapshot(outside) == outside_before
    return _normalize(message, tmp), status, untouched


def _untrusted_setup(note: str, args: list[str], folder: Path | None, tmp: Path, outside: Path) -> None:
    """The setups of issue 41's rows: hostile run folders, duplicate keys, FIFOs and folders where files go."""
    import shutil

    note = note.removesuffix(")")
    if note.startswith("section train given twice"):
        Path(args[args.index("--config") + 1]).write_text("train: {epochs: 3}\nstudy: {seed: 1}\ntrain: {batch_size: 8}\n")
    if note == "a FIFO":
        os.mkfifo(args[args.index("--config") + 1])
    if note.startswith("arrays nested"):
        Path(args[args.index("--config") + 1]).write_text("[" * 100_000 + "]" * 100_000)
    if note.startswith("config.json's study.arms given the path"):
        config = json.loads((folder / "config.json").read_text())
        config["study"]["arms"].append(str(outside))
        (folder / "config.json").write_text(json.dumps(config, indent=2))
        planted = folder / f"arms/{outside}.json"  # arms//abs/path.json: inside the folder, and a valid record
        planted.parent.mkdir(parents=True)
        shutil.copy(folder / "arms" / "init.json", planted)
    if note.startswith("a planted arms/init.json listing"):
        from nondet_jax.store.run import record_digest

        record = json.loads((folder / "arms" / "init.json").read_text())
        record["files"]["../outside/precious.txt"] = hashlib.sha256(b"not yours\n").hexdigest()
        record["record_sha256"] = record_digest(record)  # anyone can redo it
        (folder / "arms" / "init.json").write_text(json.dumps(record, indent=2))
    if note.startswith("config.json names optim.name"):
        config = json.loads((folder / "config.json").read_text())
        config["optim"]["name"] = "planted_mod:tx"
        (folder / "config.json").write_text(json.dumps(config, indent=2))
    if note.startswith("model.json not JSON"):
        (folder / "model.json").write_text("{ not json")
    if note.startswith("logits/init.npy a symbolic link to a copy outside"):
        shutil.copy(folder / "logits" / "init.npy", outside / "init.npy")
        (folder / "logits" / "init.npy").unlink()
        (folder / "logits" / "init.npy").symlink_to(outside / "init.npy")
    for name, what in (("replicas.csv", "a folder"), ("summary.json", "a FIFO"), ("arms", "a file"),
                       (".lock", "a folder"), ("figures/accuracy.png", "a folder"), ("model.json", "a FIFO")):
        if note == f"{name} {what}":
            shutil.rmtree(folder / name) if (folder / name).is_dir() else (folder / name).unlink()
            (folder / name).mkdir() if what == "a folder" else os.mkfifo(folder / name) if what == "a FIFO" else \
                (folder / name).write_text("x")
    if note.startswith("a symbolic link to a folder that does not exist"):
        Path(args[args.index("--out") + 1]).symlink_to(tmp / "nowhere")


def _folder_with_corrupt_checkpoint(ctx: Context) -> Path:
    """A run folder whose arm 'init' stopped after epoch 1 of 2, its checkpoint then damaged."""
    folder = _folder_with_checkpoint(ctx, "ckpt_run", [])
    latest = max((p for p in (folder / "checkpoints" / "init" / "orbax").iterdir() if p.name.isdigit()),
                 key=lambda p: int(p.name))
    data = max((p for p in latest.rglob("*") if p.is_file()),
               key=lambda p: p.stat().st_size)
    data.write_bytes(b"\0" * data.stat().st_size)
    return folder


def _folder_with_checkpoint(ctx: Context, name: str, extra: list[str]) -> Path:
    """A run folder whose arm 'init' stopped after epoch 1 of 2, its checkpoint kept."""
    from nondet_jax.cli import sweep

    folder = ctx.tmp / name
    # Stop after epoch 1 the honest way: a 1-epoch study with checkpoints leaves none (they are deleted
    # when the arm finishes), so train 2 epochs and keep the checkpoint by failing the metrics step.
    from nondet_jax.study import arm as analysis  # the name finish_arm calls

    original = analysis.arm_metrics

    def crash(*a, **k):
        raise KeyboardInterrupt

    analysis.arm_metrics = crash
    try:
        sweep.main([*FAST.split(), "--epochs", "2", "--arms", "init", "--set", "train.checkpoint_seconds=0", "--out",
                    str(folder), *extra])
    finally:
        analysis.arm_metrics = original
    return folder


def _code(text: str) -> str:
    return "`` " + text.replace("|", "\\|") + " ``"


def _uncode(cell: str) -> str:
    return cell.removeprefix("`` ").removesuffix(" ``").replace("\\|", "|")


def documented() -> dict[tuple[str, str], str]:
    rows = {}
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].isdigit():
            rows[(cells[1], _uncode(cells[2]))] = _uncode(cells[3])
    return rows


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    return Context(tmp_path_factory.mktemp("bad"))


@pytest.fixture(autouse=True)
def _restore_xla_flags(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # sweep.main sets determinism flags


def test_the_table_has_every_case_and_at_least_25():
    assert len(CASES) >= 25 and len(set(CASES)) == len(CASES)
    assert set(documented()) == set(CASES), "regenerate docs/bad_inputs.md: python tests/test_bad_inputs.py"


@pytest.mark.parametrize("where,text", CASES, ids=[f"{i + 1}" for i in range(len(CASES))])
def test_bad_input_gets_its_documented_message(where, text, ctx, capsys):
    message, status, untouched = run_case(where, text, ctx, capsys)
    assert status == 2
    assert message == documented()[(where, text)]
    assert untouched, "a refused command changed the run folder"


def main() -> None:
    """Regenerate docs/bad_inputs.md from CASES (run the cases, record their messages)."""
    import tempfile

    sys.path.insert(0, str(Path(__file__).parent))
    import jax

    jax.config.update("jax_disable_most_optimizations", True)

    class Capsys:
        def readouterr(self):
            import io

            out, err = sys.stdout.getvalue(), sys.stderr.getvalue()
            sys.stdout, sys.stderr = io.StringIO(), io.StringIO()
            return type("R", (), {"out": out, "err": err})()

    import io

    real = sys.stdout, sys.stderr
    lines = ["# Bad input: what each gets", "",
             "Every row is run by `tests/test_bad_inputs.py`, which checks the exact message, exit status 2 and that "
             "the run folder involved is byte-for-byte unchanged. CLI rows run `python -m nondet_jax.sweep` with "
             f"`{FAST}` plus the input; `<tmp>` is a scratch folder, `<run>` a finished 2-arm run folder. "
             "Regenerate with `python tests/test_bad_inputs.py`.", "",
             "| # | where | input | message (exit status 2) |", "|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as d:
        ctx = Context(Path(d))
        sys.stdout, sys.stderr = io.StringIO(), io.StringIO()
        try:
            for i, (where, text) in enumerate(CASES, 1):
                print(i, text, file=real[1], flush=True)
                message, status, untouched = run_case(where, text, ctx, Capsys())
                assert status == 2 and untouched, (text, status)
                lines.append(f"| {i} | {where} | {_code(text)} | {_code(message)} |")
        finally:
            sys.stdout, sys.stderr = real
    DOC.parent.mkdir(exist_ok=True)
    kept = DOC.read_text().partition(PROSE)[2] if DOC.exists() else ""  # the hand-written part after the table
    DOC.write_text("\n".join(lines) + "\n\n" + PROSE + kept)
    print(f"wrote {DOC} ({len(CASES)} rows)")


if __name__ == "__main__":
    main()


def test_docs_list_every_config_key():  # the unknown-key message points there
    from nondet_jax.config import valid_keys

    readme = (ROOT / "docs" / "cli.md").read_text()
    for key in valid_keys():
        section, name = key.split(".")
        assert re.search(rf"`{section}\.\{{[^`]*\b{name}\b", readme), key
