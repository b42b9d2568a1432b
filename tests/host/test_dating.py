"""ProcFS.written_fds on another process: a quiet process's fds are walked once and their
mtimes read each tick (tests/test_dating.py holds the rest, on this process's own fds)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agent.observe.sampler import Sampler
from agent.sources.procfs import ProcFS

# --- ProcFS.written_fds on this process -----------------------------------------------------


WRITER = """
import sys, time
a = open(sys.argv[1], "w")
print("ready", flush=True)
sys.stdin.readline()
b = open(sys.argv[2], "w")
print("opened", flush=True)
sys.stdin.readline()
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/fdinfo"), reason="needs Linux /proc")
def test_a_quiet_process_fds_are_walked_once_and_their_mtimes_read_each_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While no thread of it runs, a process cannot open or close an fd: its fd walk is
    kept, and only the mtimes are read again (another writer moves them). Once it ran, it
    is walked again."""
    first, second = tmp_path / "a.log", tmp_path / "b.log"
    p = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(first), str(second)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert p.stdin is not None and p.stdout is not None
    try:
        assert p.stdout.readline().strip() == "ready"
        time.sleep(0.1)  # asleep in its read of stdin
        proc = ProcFS()
        walks = []
        walk = proc.writable_fds
        monkeypatch.setattr(proc, "writable_fds", lambda pid: walks.append(pid) or walk(pid))
        sampler = Sampler(proc)
        sampler.snapshot([p.pid])
        sampler.snapshot([p.pid])  # quiet from here on
        then = time.time() - 100
        os.utime(first, (then, then))
        got = {f.target: f for f in sampler.written_files([p.pid])[p.pid]}
        assert got[str(first)].mtime == pytest.approx(then, abs=1e-3)
        with open(first, "a") as other:  # another writer of the same file
            other.write("x")
        sampler.snapshot([p.pid])
        got = {f.target: f for f in sampler.written_files([p.pid])[p.pid]}
        assert got[str(first)].mtime > then + 50 and str(second) not in got
        assert walks == [p.pid]
        p.stdin.write("open\n")
        p.stdin.flush()
        assert p.stdout.readline().strip() == "opened"
        sampler.snapshot([p.pid])  # it ran
        got = {f.target: f for f in sampler.written_files([p.pid])[p.pid]}
        assert str(second) in got and walks == [p.pid, p.pid]
    finally:
        p.kill()
        p.wait()
