"""The pure tier's rule (tests/noprocess.py): every way Python starts a process raises, names
the rule, and is recorded even where the code under test swallows the error."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pty
import subprocess
from collections.abc import Callable

import pytest

from tests.noprocess import ProcessStarted, no_processes

# Lambdas: each door is looked up when called, inside the test, not at import.
STARTS: dict[str, Callable[[], object]] = {
    "subprocess.run": lambda: subprocess.run(["true"], check=False),
    "os.popen": lambda: os.popen("true"),
    "os.system": lambda: os.system("true"),
    "os.fork": lambda: os.fork(),
    "pty.fork": lambda: pty.fork(),
    "os.posix_spawn": lambda: os.posix_spawn("/bin/true", ["true"], {}),
    "os.spawnv": lambda: os.spawnv(os.P_WAIT, "/bin/true", ["true"]),
    "multiprocessing fork": lambda: multiprocessing.get_context("fork").Process().start(),
    "multiprocessing spawn": lambda: multiprocessing.get_context("spawn").Process().start(),
}


@pytest.mark.parametrize("start", STARTS.values(), ids=STARTS.keys())
def test_every_way_to_start_a_process_fails_and_names_the_rule(start: Callable[[], object]):
    attempts: list[str] = []
    with no_processes(attempts), pytest.raises(ProcessStarted, match="tests/host/"):
        start()
    assert attempts


def test_a_start_the_code_swallows_is_still_recorded():
    attempts: list[str] = []
    # contextlib.suppress: what careless code under test might do
    with no_processes(attempts), contextlib.suppress(BaseException):
        subprocess.run(["true"], check=False)
    assert attempts == ["subprocess.Popen"]


def test_the_doors_open_again_after():
    before = (os.fork, subprocess.Popen._execute_child)
    with no_processes([]):
        assert os.fork is not before[0]
    assert (os.fork, subprocess.Popen._execute_child) == before
