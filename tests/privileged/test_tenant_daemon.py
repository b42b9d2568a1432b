"""Attacks on the daemon's life: a tenant that cannot read anything through the agent may still
try to kill it, or to keep it from answering.

Slow /metrics clients: 140 connections from ``nobody``, each sending one byte of a request
that never ends every few seconds, and reconnecting when dropped, against the daemon held to
the unit's ``TasksMax=128`` (a pids cgroup). A thread per connection would take every task
the unit has, and the next state change could not start the flight recorder's thread. While
they hold on, a watched target (also ``nobody``'s) turns deadlocked: the daemon must stay
alive, answer /metrics to a well-behaved client, report the change (its metric and its
flight-record line), and drop the slow clients at their deadline.
"""

from __future__ import annotations

import contextlib
import re
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

from scripts import slowclients
from scripts.fixturelib import REPO_ROOT, Fixture
from scripts.slowclients import NOBODY, PYTHON
from tests.privileged.daemonlib import (
    INTERVAL,
    Samples,
    free_port,
    running_daemon,
    value,
    wait_for_log,
    wait_until,
)

UNIT = REPO_ROOT / "deploy/systemd/hangwatch.service"
TASKS_MAX = int(re.search(r"^TasksMax=(\d+)$", UNIT.read_text(), re.M).group(1))  # type: ignore[union-attr]
SLOW_CLIENTS = 140
BYTE_EVERY_S = 2.0
MARK = "hangwatch-tenant-daemon-target"

TARGET = f"""
# {MARK}
import threading
lock = threading.Lock()
lock.acquire()
t = threading.Thread(target=lock.acquire, name="parked")
t.start()
print("READY", flush=True)
t.join()
"""


def _pids_cgroup_root() -> Path:
    """Where a pids cgroup can be made: the v1 pids hierarchy, or the v2 root."""
    v1 = Path("/sys/fs/cgroup/pids")
    if (v1 / "cgroup.procs").exists():
        return v1
    v2 = Path("/sys/fs/cgroup")
    controllers = v2 / "cgroup.controllers"
    if controllers.exists() and "pids" in controllers.read_text().split():
        with contextlib.suppress(OSError):
            (v2 / "cgroup.subtree_control").write_text("+pids")
        return v2
    pytest.fail("no pids cgroup controller: cannot hold the daemon to a tasks limit")


@contextlib.contextmanager
def tasks_limited(pid: int, limit: int) -> Iterator[Path]:
    """Process ``pid`` (all its threads, and what it starts) in a pids cgroup of its own
    with ``pids.max`` = ``limit``, as systemd's TasksMax does; moved back out on exit."""
    root = _pids_cgroup_root()
    group = root / f"hangwatch-test-{secrets.token_hex(4)}"
    group.mkdir()
    try:
        (group / "pids.max").write_text(str(limit))
        (group / "cgroup.procs").write_text(str(pid))
        yield group
    finally:
        with contextlib.suppress(OSError):
            for left in (group / "cgroup.procs").read_text().split():
                with contextlib.suppress(OSError):
                    (root / "cgroup.procs").write_text(left)
        group.rmdir()


def dropped(samples: Samples, reason: str) -> float:
    return value(samples, "hangwatch_http_connections_dropped_total", reason=reason) or 0


def test_slow_metrics_clients_under_tasks_max_neither_kill_nor_silence_the_daemon(
    tmp_path: Path,
) -> None:
    port = free_port()
    cfg = tmp_path / "hangwatch.yaml"
    cfg.write_text(
        f'listen: "127.0.0.1:{port}"\ninterval_seconds: {INTERVAL}\n'
        f"park_threshold_seconds: 2\ntargets:\n  - name: tenant\n    cmdline: {MARK!r}\n"
    )
    slow = slowclients.argv(port, SLOW_CLIENTS, BYTE_EVERY_S)
    with (
        running_daemon(cfg, port) as d,
        tasks_limited(d.pid, TASKS_MAX) as group,
        Fixture(slow, timeout=30) as clients,
    ):
        assert clients.info.get_int("held") == SLOW_CLIENTS
        with Fixture([*NOBODY, PYTHON, "-c", TARGET], timeout=30) as target:
            pid = str(target.pid)
            s = wait_until(
                d,
                lambda s: value(s, "hangwatch_process_state", pid=pid, state="deadlocked") == 1,
                f"the target {pid} to be deadlocked while the slow clients hold on",
                timeout=40,
            )
            wait_for_log(d, rf"service tenant pid {pid}: \S+ -> deadlocked", "its change line")
            # The slow clients still there, dropped at their deadline, and opening again.
            s = wait_until(
                d,
                lambda s: (
                    dropped(s, "deadline") >= 1
                    and dropped(s, "deadline") + dropped(s, "evicted") >= SLOW_CLIENTS
                ),
                "the slow clients dropped (at their deadline, or for newer ones at the cap)",
                timeout=30,
            )
            assert clients.proc.poll() is None, "the slow clients gave up"
            assert value(s, "hangwatch_tick_errors_total") == 0, d.output()
            tasks = int((group / "pids.current").read_text())
            assert tasks < TASKS_MAX, f"{tasks} tasks"
    assert "Traceback" not in d.output(), d.output()
