"""Privileged end-to-end tests: the real ``python -m agent diagnose`` against the fixtures.

Every test in this directory is marked ``privileged``. They load BPF programs, so they need
euid 0 and a working ``import bcc`` (Debian's python3-bpfcc) in the interpreter running
pytest. When that is missing they are skipped locally, but fail under ``CI=true``: a CI
runner that quietly lost its privileges must not pass.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.gate import Gate
from tests.privileged.harness import (
    DIAGNOSE_LIMIT_S,
    NO_DAEMON_SOCKET,
    Diagnosis,
    RunningDiagnose,
    diagnose_argv,
)

HERE = Path(__file__).resolve().parent


def missing_precondition() -> str | None:
    if not sys.platform.startswith("linux"):
        return "privileged tests need Linux"
    if os.geteuid() != 0:
        return f"privileged tests need root to load BPF programs (euid is {os.geteuid()})"
    # In a child: bcc loads libbcc and can fail with more than ImportError.
    probe = subprocess.run(
        [sys.executable, "-c", "import bcc"], capture_output=True, text=True, check=False
    )
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        return (
            f"`import bcc` fails in {sys.executable} ({last}); install python3-bpfcc and run "
            "pytest with /usr/bin/python3 or a venv made with --system-site-packages"
        )
    return None


GATE = Gate(HERE, "privileged", "a privileged test cannot run", missing_precondition)


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
def start_diagnose() -> Iterator[Callable[..., RunningDiagnose]]:
    """Start ``diagnose --json`` in the background; runs left over are killed at teardown."""
    runs: list[RunningDiagnose] = []

    def start(
        *pids: int, threshold: float = 1, duration: float = 2, socket: str = NO_DAEMON_SOCKET
    ) -> RunningDiagnose:
        run = RunningDiagnose(
            diagnose_argv(pids, threshold=threshold, duration=duration, socket=socket)
        )
        runs.append(run)
        return run

    yield start
    for run in runs:
        run.kill()


@pytest.fixture
def diagnose(start_diagnose: Callable[..., RunningDiagnose]) -> Callable[..., Diagnosis]:
    """Run ``diagnose --json --threshold 1 --duration 2`` to completion (DIAGNOSE_LIMIT_S)."""

    def run(
        *pids: int,
        threshold: float = 1,
        duration: float = 2,
        timeout: float = DIAGNOSE_LIMIT_S,
        socket: str = NO_DAEMON_SOCKET,
    ) -> Diagnosis:
        started = start_diagnose(*pids, threshold=threshold, duration=duration, socket=socket)
        return started.finish(timeout)

    return run
