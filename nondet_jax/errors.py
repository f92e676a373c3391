"""The exceptions shared across nondet_jax (a leaf module: it imports nothing from the package)."""

from __future__ import annotations

import argparse


class UsageError(ValueError):
    """Bad input from the user: the message is one line naming the problem and the fix."""


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (the problem, then "see --help") with exit status 2,
    like every other bad input, instead of the usage block followed by the error."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}; see --help\n")
