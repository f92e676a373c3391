"""Where each file of a run folder lives: the one place these paths are spelled."""

from __future__ import annotations

from pathlib import Path

# The per-replica scores a run folder holds for `compare`, and whether higher is better for each.
RUN_METRICS = {"test_accuracy": True, "test_loss": False, "train_loss": False, "train_accuracy": True}
ARM_FILES = ("arms/{}.json", "logits/{}.npy", "features/{}.npy", "history/{}.npz", "weights/{}.npz", "pairs/{}.npz")


class RunPaths:
    """Where each file of a run folder lives: the one place these paths are spelled (the sweep
    writes through :class:`RunStore`, the report reads through this)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.config = self.root / "config.json"
        self.environment = self.root / "environment.json"
        self.model = self.root / "model.json"  # what was imported and its parameter-shape fingerprint
        self.test_labels = self.root / "test_labels.npy"
        self.command = self.root / "command.txt"
        self.replicas_csv = self.root / "replicas.csv"
        self.summary = self.root / "summary.json"
        self.arms_csv = self.root / "arms.csv"
        self.report = self.root / "report.md"
        self.figures = self.root / "figures"

    @staticmethod
    def rel(kind: str, arm: str, ext: str | None = None) -> str:
        """``'logits', 'init'`` -> ``'logits/init.npy'``: the path of an arm's file inside the folder."""
        return f"{kind}/{arm}{ext or ARM_EXT[kind]}"

    def arm_file(self, kind: str, arm: str, ext: str | None = None) -> Path:
        """An arm's file of ``kind`` (``arms``, ``logits``, ``pairs``, ``tta``, ...; see :data:`ARM_EXT`)."""
        return self.root / self.rel(kind, arm, ext)

    def checkpoints(self, arm: str) -> Path:
        return self.root / "checkpoints" / arm

    def parts(self, arm: str | None = None) -> Path:
        """Per-process results of a multi-process run, before process 0 merges them."""
        return self.root / "parts" if arm is None else self.root / "parts" / arm


# The extension of each kind of per-arm file.
ARM_EXT = {"arms": ".json", "logits": ".npy", "features": ".npy", "history": ".npz", "weights": ".npz",
           "pairs": ".npz", "dynamics": ".npz", "environments": ".json", "instruments": ".npz", "tta": ".npz",
           "snapshots": ".npy"}
