"""Errors that end a command, each with its exit code (the CLI contract)."""

from __future__ import annotations

EXIT_USAGE = 2
EXIT_PRIVILEGE = 3
EXIT_UNAVAILABLE = 4


class HangwatchError(Exception):
    exit_code = 1

    def __init__(self, what: str, fix: str = "") -> None:
        super().__init__(what)
        self.what = what
        self.fix = fix

    def __str__(self) -> str:
        return f"{self.what}: {self.fix}" if self.fix else self.what


class UsageError(HangwatchError):
    """Bad input: a flag, a PID, a config key. Exit 2, nothing attached."""

    exit_code = EXIT_USAGE


class KernelFeatureError(HangwatchError):
    """Missing privilege or kernel feature. Exit 3, saying which and how to fix it."""

    exit_code = EXIT_PRIVILEGE


class UnavailableError(HangwatchError):
    """A service the command reads from (Prometheus) cannot be reached or answers an error.
    Exit 4, naming its URL and what to check: the fault is there, not in the input."""

    exit_code = EXIT_UNAVAILABLE


def show(value: object, limit: int = 60) -> str:
    """repr() cut to one short line: error messages name the bad value, not a whole document."""
    try:
        text = repr(value)
    except (ValueError, RecursionError):  # an int too long to print, a nested structure
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."
