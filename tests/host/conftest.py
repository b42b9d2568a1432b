"""Fixtures shared by the unprivileged tests that start processes."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest


@pytest.fixture
def execer() -> Iterator[subprocess.Popen[bytes]]:
    """A Python process that execs `sleep` on SIGUSR1 (and dies on SIGUSR2): what a target
    that runs a setuid image after its dump, or exits and leaves its PID, looks like."""
    code = (
        "import os, signal, time\n"
        "signal.signal(signal.SIGUSR1, lambda *a: os.execv('/bin/sleep', ['sleep', '30']))\n"
        "print(flush=True)\n"
        "time.sleep(30)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"\n"
        yield proc
    finally:
        proc.kill()
        proc.wait()
