"""The exceptions shared across nondet_jax (a leaf module: it imports nothing from the package)."""

from __future__ import annotations

import argparse

MAX_MESSAGE = 1000  # characters: a message quoting a user's value never floods the terminal


class UsageError(ValueError):
    """Bad input from the user: the message is one line naming the problem and the fix.

    Kept to one line of at most :data:`MAX_MESSAGE` characters whatever it quotes: line breaks become
    spaces and an overlong middle (a huge value from a config file) is cut, keeping the start (the
    problem) and the end (the fix)."""

    def __init__(self, message: object = "") -> None:
        text = " ".join(str(message).split("\n"))
        if len(text) > MAX_MESSAGE:
            keep = MAX_MESSAGE // 2 - 20
            text = f"{text[:keep]} ... [{len(text) - 2 * keep:,} characters cut] ... {text[-keep:]}"
        super().__init__(text)


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (the problem, then "see --help") with exit status 2,
    like every other bad input, instead of the usage block followed by the error."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}; see --help\n")
