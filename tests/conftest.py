"""Hypothesis profiles: CI replays the same examples every run, so a landing is never decided
by the luck of a random draw; runs elsewhere explore new ones (and keep what fails in
.hypothesis/ to replay it)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
from hypothesis import settings

settings.register_profile("ci", derandomize=True, deadline=None)
if os.environ.get("CI") == "true":
    settings.load_profile("ci")


@pytest.fixture(scope="module")
def promtool() -> str:
    """Prometheus's promtool (the rules' tests and the queries of `hangwatch job` and the
    dashboard run in its engine); a failure under CI=true, not a skip."""
    path = shutil.which("promtool")
    if path is None:
        reason = "promtool is not installed (Debian package `prometheus`; `make setup`)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true and {reason}", pytrace=False)
        pytest.skip(reason)
    return path


def run_promtool(promtool: str, *args: str, timeout: float = 120) -> None:
    """``promtool ARGS``, failing the test with its output unless it exits 0."""
    done = subprocess.run(
        [promtool, *args], capture_output=True, text=True, check=False, timeout=timeout
    )
    assert done.returncode == 0, (
        f"promtool {' '.join(args)} exited {done.returncode}:\n{done.stdout}{done.stderr}"
    )
