"""Attacks by a tenant on what hangwatch reads of its processes in /proc: files it makes huge,
and text it forges.

* **A huge /proc/PID/maps.** A watched target, run as ``nobody``, maps one file 62,000 times
  (one page each, protections alternating so that the kernel merges none) under a path of
  about 4,000 characters (nested directories in a temporary directory it owns): its maps
  are 250 MB of text. Its one thread loops in a timed futex wait shorter than the daemon's
  interval, so the process runs between every two ticks and is read again each tick. The
  real daemon must stay alive and answering /metrics, its peak memory (VmHWM) well under
  the shipped unit's MemoryMax, and each tick within its interval.
* **/proc/net/unix injection.** A tenant binds an abstract unix socket whose name holds a
  newline and, after it, a line that reads as the record of another process's socket (its
  inode, which /proc/net/unix shows anyone) bound to a path the tenant chose. ``diagnose``
  of that other process, blocked on the socket, must not name the tenant's path.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from scripts.fixturelib import FIXTURES_DIR, REPO_ROOT, Fixture
from tests.limits import HANG_S
from tests.privileged.daemonlib import (
    INTERVAL,
    Daemon,
    free_port,
    running_daemon,
    value,
    wait_until,
)
from tests.privileged.harness import RunningDiagnose, diagnose_argv
from tests.privileged.test_confinement import NOBODY, PYTHON

pytestmark = pytest.mark.serial  # serial: each tick within its interval, the daemon's peak memory

MAPPINGS = 62_000
PATH_CHARS = 4_000
HUGE_MAPS = FIXTURES_DIR / "huge_maps.py"


def unit_memory_max() -> int:
    """MemoryMax= of the shipped systemd unit, in bytes."""
    text = (REPO_ROOT / "deploy/systemd/hangwatch.service").read_text()
    m = re.search(r"^MemoryMax=(\d+)([KMG])$", text, re.M)
    assert m, "no MemoryMax=N[KMG] in deploy/systemd/hangwatch.service"
    return int(m.group(1)) << {"K": 10, "M": 20, "G": 30}[m.group(2)]


def vm_hwm(pid: int) -> int:
    """Peak resident set size of ``pid`` so far (VmHWM in /proc/PID/status), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM for {pid}")


@pytest.fixture
def owned_dir() -> Iterator[Path]:
    """A temporary directory that ``nobody`` owns (the tenant's)."""
    d = Path(tempfile.mkdtemp(prefix="hangwatch-tenant-"))
    os.chown(d, 65534, 65534)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def ticks(daemon: Daemon, count: int, timeout: float) -> list[dict]:
    """Wait for ``count`` more ticks of the daemon; each one's proc collector duration and
    the time it finished."""
    seen: list[dict] = []
    last = None
    deadline = time.monotonic() + timeout
    while len(seen) < count:
        assert daemon.running(), f"the daemon exited:\n{daemon.output()}"
        assert time.monotonic() < deadline, f"only {len(seen)} ticks in {timeout} s: {seen}"
        s = daemon.scrape()
        assert s is not None, f"/metrics did not answer\n{daemon.output()}"
        at = value(s, "hangwatch_last_tick_timestamp_seconds")
        if at is not None and at != last:
            if last is not None:
                took = value(s, "hangwatch_collector_duration_seconds", collector="proc")
                seen.append({"at": at, "proc_s": took})
            last = at
        time.sleep(INTERVAL / 2)
    return seen


def test_a_huge_maps_costs_the_daemon_bounded_memory_and_it_ticks_on(
    owned_dir: Path, tmp_path: Path
) -> None:
    port = free_port()
    cfg = tmp_path / "hangwatch.yaml"
    cfg.write_text(
        f'listen: "127.0.0.1:{port}"\ninterval_seconds: {INTERVAL}\nstacks: false\n'
        "park_threshold_seconds: 2\ntargets:\n  - name: huge-maps\n    cmdline: 'huge_maps[.]py'\n"
    )
    limit = unit_memory_max()
    # Its text, not its path: nobody may not be able to search the checkout's directories.
    code = HUGE_MAPS.read_text()  # names huge_maps.py: the command line the selector matches
    argv = [*NOBODY, PYTHON, "-c", code, str(owned_dir), str(MAPPINGS), str(PATH_CHARS)]
    target = Fixture(argv, timeout=HANG_S)
    with running_daemon(cfg, port) as d, target as t:
        with open(f"/proc/{t.pid}/maps", "rb") as f:
            maps = sum(1 for _ in f)
        assert maps >= MAPPINGS, f"the target has {maps} mappings, not {MAPPINGS}"
        wait_until(
            d,
            lambda s: value(s, "hangwatch_process_threads", pid=str(t.pid)) is not None,
            f"the target {t.pid} to be watched",
            timeout=HANG_S,
        )
        seen = ticks(d, 6, timeout=HANG_S)
        peak = vm_hwm(d.pid)
        s = d.scrape()
    assert s is not None, d.output()
    assert peak < limit // 2, (
        f"the daemon peaked at {peak >> 20} MiB watching {maps} mappings, "
        f"not well under MemoryMax={limit >> 20} MiB"
    )
    # Each tick was read, and what it took is shown: how long a tick takes is a bench figure
    # (make bench), not a test's bound (tests/limits.py)
    assert all(x["proc_s"] is not None for x in seen), seen
    print(f"ticks watching {maps} mappings: {[x['proc_s'] for x in seen]} s")


FORGED_PATH = "/tmp/tenant-chose-this-path"
VICTIM = """
import os, select, socket, sys
a, b = socket.socketpair()  # connected: no bound name
named = socket.socket(socket.AF_UNIX)
named.bind(sys.argv[1])
named.listen()
ep = select.epoll()
ep.register(a.fileno(), select.EPOLLIN)
ep.register(named.fileno(), select.EPOLLIN)
print(os.fstat(a.fileno()).st_ino, a.fileno(), named.fileno(), flush=True)
ep.poll()
"""
FORGER = """
import socket, sys, time
inode, path = sys.argv[1], sys.argv[2]
line = f"0000000000000000: 00000002 00000000 00010000 0001 01 {inode} {path}"
s = socket.socket(socket.AF_UNIX)
s.bind("\\0x\\n" + line)  # the name: "x", a newline, and a record of the victim's socket
print("READY", flush=True)
time.sleep(600)
"""


def test_a_unix_socket_name_cannot_forge_another_sockets_path(tmp_path: Path) -> None:
    named_path = tmp_path / "victim.sock"
    victim = subprocess.Popen(
        [PYTHON, "-c", VICTIM, str(named_path)], stdout=subprocess.PIPE, text=True
    )
    forger = None
    try:
        assert victim.stdout is not None
        inode, pair_fd, named_fd = victim.stdout.readline().split()
        forger = subprocess.Popen(
            [*NOBODY, PYTHON, "-c", FORGER, inode, FORGED_PATH], stdout=subprocess.PIPE, text=True
        )
        assert forger.stdout is not None and forger.stdout.readline().strip() == "READY"
        table = Path("/proc/net/unix").read_text(errors="replace")
        assert f" {inode} {FORGED_PATH}\n" in table, "the forged line is not in /proc/net/unix"
        argv = diagnose_argv([victim.pid], threshold=1, duration=1, json_out=False)
        run = RunningDiagnose(argv).finish(timeout=HANG_S)
    finally:
        for p in (victim, forger):
            if p is not None:
                p.kill()
                p.wait()
    assert run.returncode == 0, run.explain("diagnose failed")
    out = run.stdout + run.stderr
    assert FORGED_PATH not in out, run.explain("the tenant's path names the victim's socket")
    # The waits are read: the bound socket by its own path, the connected one by no path.
    assert f"the unix socket {named_path} (fd {named_fd})" in out, run.explain("no named socket")
    assert f"a socket (fd {pair_fd})" in out, run.explain("the connected socket is not shown")
