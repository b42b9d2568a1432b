"""Helpers for the benchmark suite: the workloads, a real daemon, /proc and bpf(2) readings."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from prometheus_client.parser import text_string_to_metric_families

from tests.privileged.bpfobjs import map_names

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --- the daemon -----------------------------------------------------------------------------

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]

# Published with the first tick's results, never before: the daemon is attached and working.
READY_METRIC = "hangwatch_bpf_events_dropped_total"


def find(samples: Samples, name: str, **labels: str) -> float | None:
    want = set(labels.items())
    for (n, ls), v in samples.items():
        if n == name and want <= ls:
            return v
    return None


class DaemonError(RuntimeError):
    pass


# Extra top-level config lines for every daemon the bench starts (--bpf-stats).
DAEMON_CONFIG: list[str] = []


class Daemon:
    """A real `hangwatch run` on a config of our own, its log in a temporary file."""

    def __init__(self, targets: Sequence[Mapping[str, str]], interval: float = 1.0) -> None:
        self.port = free_port()
        self._dir = tempfile.TemporaryDirectory(prefix="hangwatch-bench-")
        self.config = Path(self._dir.name) / "config.yaml"
        lines = [
            f'listen: "127.0.0.1:{self.port}"',
            f"interval_seconds: {interval}",
            *DAEMON_CONFIG,
            "targets:",
        ]
        for t in targets:
            first = True
            for k, v in t.items():
                lines.append(f"  {'- ' if first else '  '}{k}: {json.dumps(v)}")
                first = False
        self.config.write_text("\n".join(lines) + "\n")
        self._log: IO[bytes] = (Path(self._dir.name) / "daemon.log").open("wb")
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "agent", "run", "--config", str(self.config)],
            cwd=REPO_ROOT,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_text(self) -> str:
        self._log.flush()
        return (Path(self._dir.name) / "daemon.log").read_text(errors="replace")

    def scrape(self) -> Samples | None:
        try:
            url = f"http://127.0.0.1:{self.port}/metrics"
            with urllib.request.urlopen(url, timeout=5) as r:
                text = r.read().decode()
        except OSError:
            return None
        out: Samples = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                out[(s.name, frozenset(s.labels.items()))] = s.value
        return out

    def wait_for(
        self, check: Callable[[Samples], bool], what: str, timeout: float, poll: float = 0.05
    ) -> Samples:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise DaemonError(f"daemon exited ({self.proc.returncode}):\n{self.log_text()}")
            samples = self.scrape()
            if samples is not None and check(samples):
                return samples
            if time.monotonic() > deadline:
                raise DaemonError(f"timed out after {timeout} s waiting for {what}")
            time.sleep(poll)

    def wait_ready(self, timeout: float = 60) -> float:
        """Seconds from exec to the first scrape that has the daemon's own metrics."""
        self.wait_for(lambda s: find(s, READY_METRIC) is not None, "first tick", timeout, 0.02)
        return time.monotonic() - self.started

    def wait_watching(self, pid: int, timeout: float = 20) -> None:
        self.wait_for(
            lambda s: find(s, "hangwatch_process_threads", pid=str(pid)) is not None,
            f"the daemon to watch pid {pid}",
            timeout,
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        self._dir.cleanup()

    def __enter__(self) -> Daemon:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


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
