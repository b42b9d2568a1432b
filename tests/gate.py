"""The tests of one folder that need something a machine may lack (root and bcc, the cached
real-software venv): marked, skipped when it is missing, but failed under ``CI=true``: a CI
runner that quietly lost its privileges or its software must not pass."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest


def under_ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


class Gate:
    def __init__(
        self, folder: Path, marker: str, cannot: str, missing: Callable[[], str | None]
    ) -> None:
        self.folder = folder
        self.marker = marker
        self.cannot = cannot  # "a privileged test cannot run"
        self.missing = missing  # the precondition that fails, in words, or None
        self.reason: str | None = None

    def _mine(self, item: pytest.Item) -> bool:
        return self.folder in Path(item.path).parents

    def collect(self, items: list[pytest.Item]) -> None:
        """At collection (tryfirst: the marker must be there before `-m` deselection)."""
        mine = [item for item in items if self._mine(item)]
        if not mine:
            return
        self.reason = self.missing()
        for item in mine:
            item.add_marker(getattr(pytest.mark, self.marker))

    def skip_unless_ci(self) -> None:
        """In an autouse fixture: skip locally when the precondition fails."""
        if self.reason and not under_ci():
            pytest.skip(self.reason)

    def fail_under_ci(self, item: pytest.Item) -> None:
        """In the call phase, not a fixture: CI shows FAILED, not a setup ERROR."""
        if self.reason and under_ci() and self._mine(item):
            pytest.fail(f"CI=true and {self.cannot}: {self.reason}", pytrace=False)


def require(reason: str | None, cannot: str) -> None:
    """In a test or a fixture: skip when ``reason`` (what is missing, in words) is not None,
    but fail under ``CI=true``; ``cannot`` says what then cannot run ("real vLLM cannot run")."""
    if reason is None:
        return
    if under_ci():
        pytest.fail(f"CI=true and {cannot}: {reason}", pytrace=False)
    pytest.skip(reason)
