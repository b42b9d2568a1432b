"""The rule of the pure tier (tests/*.py, `make check`): a test there starts no process. Tests
that start one (a fixture program, a compiler, promtool, a server in a child, a daemon) live in
tests/host/ (or tests/privileged/, tests/realsw/) and run only in `make test`.

While a pure test runs (its fixtures' setup and teardown included), every way Python starts a
process raises ``ProcessStarted``, and the attempt is recorded so that code which swallows the
error still fails its test."""

from __future__ import annotations

import _posixsubprocess
import os
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

RULE = (
    "tests/*.py is the pure tier (`make check`): its tests start no process (no subprocess, "
    "fork, spawn, compiler or fixture program). Move a test that needs one to tests/host/, "
    "which `make test` runs"
)

# Every door a process comes through, as (owner, attribute, name in the message): subprocess
# (and so os.popen and asyncio) starts its child in Popen._execute_child; multiprocessing's
# spawn and forkserver call _posixsubprocess.fork_exec; its fork, pty and os.spawn* call
# os.fork or os.forkpty; os.system forks in C.
DOORS: list[tuple[Any, str, str]] = [
    (subprocess.Popen, "_execute_child", "subprocess.Popen"),
    (_posixsubprocess, "fork_exec", "_posixsubprocess.fork_exec"),
    (os, "fork", "os.fork"),
    (os, "forkpty", "os.forkpty"),
    (os, "posix_spawn", "os.posix_spawn"),
    (os, "posix_spawnp", "os.posix_spawnp"),
    (os, "system", "os.system"),
]


class ProcessStarted(BaseException):
    """A BaseException, so that ``except Exception`` or ``except OSError`` in the code under
    test (which may treat a failed start as a missing tool) does not hide it."""


@contextmanager
def no_processes(attempts: list[str]) -> Iterator[None]:
    """Within: starting a process raises ProcessStarted and appends its door to ``attempts``."""

    def closed(door: str) -> Callable[..., Any]:
        def refuse(*args: object, **kwargs: object) -> Any:
            attempts.append(door)
            raise ProcessStarted(f"{door}() called. {RULE}")

        return refuse

    here = [
        (owner, name, door, getattr(owner, name))
        for owner, name, door in DOORS
        if hasattr(owner, name)
    ]
    for owner, name, door, _ in here:
        setattr(owner, name, closed(door))
    try:
        yield
    finally:
        for owner, name, _, original in here:
            setattr(owner, name, original)
