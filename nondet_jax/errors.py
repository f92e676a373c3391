"""The exceptions shared across nondet_jax (a leaf module: it imports nothing from the package)."""

from __future__ import annotations


class UsageError(ValueError):
    """Bad input from the user: the message is one line naming the problem and the fix."""
