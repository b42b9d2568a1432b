"""Tests against real software (PyTorch under torchrun with gloo on CPU; a uvicorn + FastAPI +
pyzmq serving stack) in its hang and healthy shapes.

Every test in this directory is marked ``realsw``. They run the jobs with the cached venv that
``make setup-tests`` (and so ``make test``) installs outside the checkout (``scripts/realsw.py``).
When that venv is missing or stale they are skipped locally, but fail under ``CI=true``: a CI
runner that quietly lost the real software must not pass.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from scripts import realsw

HERE = Path(__file__).resolve().parent
_missing: list[str] = []  # the precondition that fails, filled at collection


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "realsw: runs real software from the cached venv (fails, not skips, under CI=true)",
    )


# tryfirst: the marker must be there before `-m` deselection runs.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    mine = [item for item in items if HERE in Path(item.path).parents]
    if not mine:
        return
    reason = realsw.missing()
    if reason:
        _missing.append(reason)
    for item in mine:
        item.add_marker(pytest.mark.realsw)


def _under_ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


@pytest.fixture(autouse=True)
def _preconditions() -> None:
    if _missing and not _under_ci():
        pytest.skip(_missing[0])


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item: pytest.Item) -> None:
    # Fail in the call phase, not in a fixture: CI shows FAILED, not a setup ERROR.
    if _missing and _under_ci() and HERE in Path(item.path).parents:
        pytest.fail(f"CI=true and the real software cannot run: {_missing[0]}", pytrace=False)
