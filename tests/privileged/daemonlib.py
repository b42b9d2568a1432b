"""A real `hangwatch run` for tests: start it, scrape it, wait for what it says, stop it.

Starting, scraping and stopping are ``scripts/daemonproc.py``'s (shared with the benchmark and
the demo and soak scripts); this adds the pytest parts: waits that fail the test with the
daemon's log, and a daemon that must leave no BPF program behind.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

from agent.config import DEFAULT_STATUS_SOCKET
from scripts.bpfobjs import leaked, prog_ids
from scripts.daemonproc import (
    DaemonError,
    DaemonProcess,
    DaemonTimeout,
    Samples,
    first_tick_done,
    free_port,
    value,
)
from tests.limits import HANG_S

__all__ = [
    "INTERVAL",
    "Daemon",
    "Samples",
    "first_tick",
    "free_port",
    "own_status_socket",
    "pids_in",
    "rss_bytes",
    "running_daemon",
    "value",
    "wait_for_log",
    "wait_until",
]

INTERVAL = 0.5


def own_status_socket(config: Path) -> Path:
    """Make ``config`` name a status socket of its own, beside it (CONFIG with the suffix
    .sock), unless it names one already: the built-in default, /run/hangwatch/status.sock, is
    the host's. A test's daemon there would outlive a SIGKILL in /run, take the path from a
    host daemon or a test's daemon on the next worker, and answer another test's `diagnose`
    (which asks the default socket for the daemon's history). A config that does not parse is
    left as it is, for the daemon to refuse."""
    sock = config.with_suffix(".sock")
    try:
        text = config.read_text()
        raw = yaml.safe_load(text)
    except (OSError, yaml.YAMLError):
        return sock
    if not isinstance(raw, dict) or raw.get("status_socket", DEFAULT_STATUS_SOCKET) != (
        DEFAULT_STATUS_SOCKET
    ):
        return sock
    if "status_socket" not in raw and not text.lstrip().startswith(("{", "---", "%")):
        # a block mapping: the key as its first line, the rest as the test wrote it (a test
        # may append to its last key, the targets, later)
        config.write_text(f"status_socket: {str(sock)!r}\n{text}")
    else:  # JSON, a document marker, or the default named: the mapping written anew
        config.write_text(json.dumps({**raw, "status_socket": str(sock)}))
    return sock


class Daemon(DaemonProcess):
    """A test's daemon: ``scripts/daemonproc.py``'s, serving status on a socket of its own
    (:func:`own_status_socket`)."""

    def __init__(self, config: Path, port: int, log: Path | None = None) -> None:
        own_status_socket(config)
        super().__init__(config, port, log)


def wait_until(
    daemon: Daemon, check: Callable[[Samples], bool], what: str, timeout: float = HANG_S
):
    """Scrape every INTERVAL until ``check`` holds; fail the test, with the service states of
    the last scrape and the daemon's log, if the daemon exits, or if it does not hold within
    ``timeout`` s (the harness's bound against a hang, tests/limits.py: not a bound on how fast
    the daemon reacts)."""
    try:
        return daemon.wait_for(check, what, timeout, poll=INTERVAL)
    except DaemonTimeout as e:
        shown = "\n".join(
            f"{n}{dict(ls)} {v}"
            for (n, ls), v in sorted((e.last or {}).items())
            if n.startswith("hangwatch_service_state") and v
        )
        pytest.fail(
            f"timed out waiting for {what}\nservice states:\n{shown}\nlog:\n{daemon.output()}"
        )
    except DaemonError as e:
        pytest.fail(str(e))


def rss_bytes(pid: int) -> int:
    """Resident set size of ``pid`` now, from /proc/PID/status."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def pids_in(samples: Samples) -> set[int]:
    """Every process (pid label) /metrics names."""
    return {int(dict(ls)["pid"]) for (_, ls) in samples if "pid" in dict(ls)}


def wait_for_log(daemon: Daemon, pattern: str, what: str, timeout: float = HANG_S) -> re.Match[str]:
    """Wait for a line of the daemon's log matching ``pattern`` (no scrape involved)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert daemon.proc.poll() is None, f"daemon exited:\n{daemon.output()}"
        m = re.search(pattern, daemon.output(), re.M)
        if m:
            return m
        time.sleep(0.1)
    pytest.fail(f"timed out waiting for {what} in the log:\n{daemon.output()}")


def first_tick(daemon: Daemon, timeout: float = HANG_S) -> Samples:
    """Wait for the daemon's first tick (the probes are attached then); fail the test if not."""
    return wait_until(daemon, first_tick_done, "the daemon's first tick", timeout=timeout)


@contextlib.contextmanager
def running_daemon(config: Path, port: int) -> Iterator[Daemon]:
    """A daemon past its first tick; on exit, SIGTERM, exit 0, and none of the BPF programs
    it added left in the kernel."""
    before = prog_ids()
    d = Daemon(config, port)
    try:
        first_tick(d)
        added = prog_ids() - before
        yield d
    finally:
        rc = d.stop()
    assert rc == 0, f"daemon exit {rc}\n{d.output()}"
    assert added, "the daemon loaded no BPF program?"
    left = leaked(added)
    assert not left, f"BPF programs left after SIGTERM: {sorted(left)}"
