"""Orchestration: preparing a study, training its arms (in one process, child processes or several hosts)."""
