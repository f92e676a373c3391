"""The run folder: paths, atomic writes, the lock and resume, checkpoints."""
