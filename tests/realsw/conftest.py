"""Tests against real software (PyTorch under torchrun with gloo on CPU; a uvicorn + FastAPI +
pyzmq serving stack) in its hang and healthy shapes.

Every test in this directory is marked ``realsw``. They run the jobs with the cached venv that
``make setup-tests`` (and so ``make test``) installs outside the checkout (``scripts/realsw.py``).
When that venv is missing or stale they are skipped locally, but fail under ``CI=true``: a CI
runner that quietly lost the real software must not pass.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from scripts import realsw
from tests import gate
from tests.gate import Gate
from tests.privileged.conftest import missing_precondition

HERE = Path(__file__).resolve().parent
GATE = Gate(HERE, "realsw", "the real software cannot run", realsw.missing)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "realsw: runs real software from the cached venv (fails, not skips, under CI=true)",
    )


# tryfirst: the marker must be there before `-m` deselection runs.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    GATE.collect(items)


@pytest.fixture(autouse=True)
def _preconditions() -> None:
    GATE.skip_unless_ci()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item: pytest.Item) -> None:
    GATE.fail_under_ci(item)


@pytest.fixture
def needs_bpf() -> None:
    """For the tests here that run hangwatch on the real software: root and bcc, as
    tests/privileged. Skipped locally without them, failed under CI=true."""
    gate.require(missing_precondition(), "hangwatch cannot attach")
