"""The machine a study runs on: XLA determinism flags, per-CPU flags, measured tables, signals."""
