"""Helpers for the benchmark suite: the workloads, a real daemon, /proc and bpf(2) readings."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from scripts.bpfobjs import map_names
from scripts.daemonproc import DaemonProcess, free_port, value

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent
BUILD = REPO_ROOT / ".build" / "bench"
WORKLOADS_SRC = HERE / "workloads.c"
GIL_SCRIPT = HERE / "gil_workload.py"
# What a watching daemon's target matches: the workload binary and the GIL script.
WORKLOAD_REGEX = r"\.build/bench/workloads |bench/gil_workload\.py"

CLK_TCK = os.sysconf("SC_CLK_TCK")


def progress(msg: str) -> None:
    print(f"bench: {msg}", file=sys.stderr, flush=True)


def build_workloads() -> Path:
    """Compile bench/workloads.c unless the binary is newer than the source."""
    exe = BUILD / "workloads"
    if exe.exists() and exe.stat().st_mtime_ns >= WORKLOADS_SRC.stat().st_mtime_ns:
        return exe
    BUILD.mkdir(parents=True, exist_ok=True)
    tmp = BUILD / f".workloads.{os.getpid()}.tmp"
    cmd = ["gcc", "-O2", "-pthread", "-Wall", "-Werror", "-o", str(tmp), str(WORKLOADS_SRC)]
    try:
        subprocess.run(cmd, check=True)
        os.replace(tmp, exe)  # atomic: a concurrent run never sees half a binary
    finally:
        tmp.unlink(missing_ok=True)
    return exe


# --- which hangwatch BPF objects are loaded, from bpf(2) -----------------------------------

# Each hangwatch object has one map of each of these names; other tools rarely do.
HANGWATCH_MAPS = ("watched", "threads", "wait_hist")


def hangwatch_objects() -> int:
    """How many hangwatch BPF objects are loaded now, anyone's (needs CAP_SYS_ADMIN)."""
    names = map_names()
    return max(names.count(n) for n in HANGWATCH_MAPS)


def wait_no_hangwatch(timeout: float) -> bool:
    """Wait until no hangwatch BPF object is loaded; False if one still is after ``timeout``."""
    deadline = time.monotonic() + timeout
    while hangwatch_objects():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


# --- /proc --------------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """utime + stime of the whole process, in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def memory_kib(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM from /proc/PID/status, in KiB."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(rest.split()[0])
    return out


# --- the daemon -----------------------------------------------------------------------------

# Extra top-level config lines for every daemon the bench starts (--bpf-stats).
DAEMON_CONFIG: list[str] = []
# --smoke (what the test suite runs): --quick with its periods and sizes cut to the least that
# still runs every part and prints every row. Its figures say only that the bench works.
SMOKE: list[bool] = [False]


class Daemon(DaemonProcess):
    """A real `hangwatch run` on a config of our own, both it and the log in a temporary
    directory that stop() removes."""

    def __init__(self, targets: Sequence[Mapping[str, str]], interval: float = 1.0) -> None:
        port = free_port()
        self._dir = tempfile.TemporaryDirectory(prefix="hangwatch-bench-")
        config = Path(self._dir.name) / "config.yaml"
        lines = [
            f'listen: "127.0.0.1:{port}"',
            f"interval_seconds: {interval}",
            # its own: the default, /run/hangwatch/status.sock, is the host daemon's
            f"status_socket: {str(Path(self._dir.name) / 'status.sock')!r}",
            *DAEMON_CONFIG,
            "targets:",
        ]
        for t in targets:
            first = True
            for k, v in t.items():
                lines.append(f"  {'- ' if first else '  '}{k}: {json.dumps(v)}")
                first = False
        config.write_text("\n".join(lines) + "\n")
        super().__init__(config, port)

    def wait_ready(self, timeout: float = 60) -> float:
        """Seconds from exec to the first scrape that has the daemon's first tick."""
        self.first_tick(timeout, poll=0.02)
        return time.monotonic() - self.started

    def wait_watching(self, pid: int, timeout: float = 20) -> None:
        self.wait_for(
            lambda s: value(s, "hangwatch_process_threads", pid=str(pid)) is not None,
            f"the daemon to watch pid {pid}",
            timeout,
        )

    def stop(self, timeout: float = 30) -> int:
        try:
            return super().stop(timeout)
        finally:
            self._dir.cleanup()


# --- workloads ------------------------------------------------------------------------------


@dataclass
class Workload:
    """One workload process, started and waiting for its go line."""

    argv: list[str]

    def __post_init__(self) -> None:
        self.proc = subprocess.Popen(
            self.argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,  # its own group: killpg reaches strace's child too
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def go(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def readline(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline().strip()

    def finish(self, timeout: float = 300) -> str:
        """Close stdin and wait for it to exit; its whole stdout."""
        out, _ = self.proc.communicate(timeout=timeout)
        if self.proc.returncode != 0:
            raise RuntimeError(f"{' '.join(self.argv)} exited {self.proc.returncode}")
        return out.strip()

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                if f is not None:
                    f.close()


def workload_argv(exe: Path, mode: str, *args: object) -> list[str]:
    if mode == "gil":
        return [sys.executable, str(GIL_SCRIPT), *map(str, args)]
    return [str(exe), mode, *map(str, args)]
