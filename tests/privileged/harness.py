"""Run ``python -m agent diagnose`` as a user would and keep everything it said.

Used through the fixtures in ``conftest.py``; every assertion message built here carries
the command, its exit status, the JSON report and stderr, so a failure explains itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from scripts.fixturelib import REPO_ROOT
from tests.limits import HANG_S

# No daemon answers here: a test judges diagnose's window alone unless it names a daemon's
# socket (a daemon running on the host, or another test's, would otherwise lend its history).
NO_DAEMON_SOCKET = "/nonexistent/hangwatch-tests/status.sock"

# How long a diagnose run may take before the harness kills it: the harness's one bound
# (tests/limits.py).
DIAGNOSE_LIMIT_S = HANG_S


def diagnose_argv(
    pids: Iterable[int],
    *,
    threshold: float = 1,
    duration: float = 2,
    json_out: bool = True,
    socket: str = NO_DAEMON_SOCKET,
) -> list[str]:
    argv = [sys.executable, "-m", "agent", "diagnose"]
    for pid in pids:
        argv += ["--pid", str(pid)]
    if json_out:
        argv.append("--json")
    return [
        *argv,
        "--threshold",
        f"{threshold:g}",
        "--duration",
        f"{duration:g}",
        "--socket",
        socket,
    ]


@dataclass
class Diagnosis:
    """One finished ``diagnose`` run."""

    argv: list[str]
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    @property
    def report(self) -> dict[str, Any] | None:
        try:
            value = json.loads(self.stdout)
        except ValueError:
            return None
        return value if isinstance(value, dict) else None

    def explain(self, what: str) -> str:
        """``what`` followed by everything needed to see why."""
        report = self.report
        shown = json.dumps(report, indent=2) if report is not None else self.stdout or "(empty)"
        return (
            f"{what}\ncommand: {' '.join(self.argv)}\n"
            f"exit status: {self.returncode} after {self.seconds:.1f} s\n"
            f"stdout (JSON report):\n{shown}\nstderr:\n{self.stderr or '(empty)'}"
        )

    def service(self, pid: int) -> dict[str, Any]:
        """The service rooted at ``pid`` from a clean run (exit 0, JSON, no traceback)."""
        assert self.returncode == 0, self.explain("diagnose did not exit 0")
        assert "Traceback" not in self.stderr, self.explain("diagnose printed a traceback")
        report = self.report
        assert report is not None, self.explain("stdout is not one JSON object")
        services = report.get("services")
        assert isinstance(services, list), self.explain("no 'services' list in the report")
        found = [s for s in services if isinstance(s, dict) and s.get("pid") == pid]
        assert len(found) == 1, self.explain(f"want exactly one service with pid {pid}")
        return found[0]

    def process(self, service: dict[str, Any], pid: int) -> dict[str, Any]:
        found = [p for p in service.get("processes", []) if p.get("pid") == pid]
        assert len(found) == 1, self.explain(f"want exactly one process entry with pid {pid}")
        return found[0]


class RunningDiagnose:
    """A ``diagnose`` still running: wait for a stderr line (e.g. "attached"), then finish."""

    def __init__(self, argv: list[str]) -> None:
        self.argv = argv
        self.started = time.monotonic()
        self._stdout: list[str] = []
        self._stderr: list[str] = []
        self._changed = threading.Condition()
        self.proc = subprocess.Popen(
            argv,
            cwd=REPO_ROOT,  # `-m agent` resolves against the checkout under test
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self._readers = [
            threading.Thread(target=self._pump, args=(self.proc.stdout, self._stdout), daemon=True),
            threading.Thread(target=self._pump, args=(self.proc.stderr, self._stderr), daemon=True),
        ]
        for r in self._readers:
            r.start()

    def _pump(self, stream: Any, sink: list[str]) -> None:
        for line in stream:
            with self._changed:
                sink.append(line)
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def wait_stderr(self, pattern: str, timeout: float) -> str:
        """The first stderr line matching ``pattern`` (regex, case-insensitive)."""
        rx = re.compile(pattern, re.IGNORECASE)
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for line in self._stderr:
                    if rx.search(line):
                        return line
                remaining = deadline - time.monotonic()
                if self.proc.poll() is not None or remaining <= 0:
                    break
                self._changed.wait(min(remaining, 0.1))
        result = self.finish(timeout=5)
        raise AssertionError(
            result.explain(f"diagnose printed no stderr line matching {pattern!r} in {timeout} s")
        )

    def finish(self, timeout: float = DIAGNOSE_LIMIT_S) -> Diagnosis:
        """Wait for the run to end (killing it after ``timeout`` s) and collect it."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            self._stderr.append(f"\n[test harness: killed after {timeout} s]\n")
        for r in self._readers:
            r.join(timeout=5)
        with self._changed:
            return Diagnosis(
                argv=self.argv,
                returncode=self.proc.returncode,
                stdout="".join(self._stdout),
                stderr="".join(self._stderr),
                seconds=time.monotonic() - self.started,
            )

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class Untouched:
    """Whether processes were stopped or signalled while a block ran: their TracerPid, read
    every millisecond (a blocking stack dump holds a process for tens of ms), and every
    signal generated for any of their threads, from the signal_generate tracepoint in a
    tracefs instance of our own (it does not touch the global trace buffer)."""

    TRACEFS = "/sys/kernel/tracing"

    def __init__(self, pids: Iterable[int]) -> None:
        self.pids = list(pids)
        self.tracers: list[tuple[int, int]] = []  # (pid, TracerPid) seen nonzero
        self.signals: list[tuple[int, int]] = []  # (signal, tid)
        self._stop = threading.Event()
        self._poll = threading.Thread(target=self._watch, name="untouched", daemon=True)
        self._dir = f"{self.TRACEFS}/instances/hangwatch-test-{os.getpid()}"

    def _tids(self) -> set[int]:
        out = set(self.pids)
        for pid in self.pids:
            with contextlib.suppress(OSError):
                out.update(int(t) for t in os.listdir(f"/proc/{pid}/task"))
        return out

    def _watch(self) -> None:
        while not self._stop.is_set():
            for pid in self.pids:
                try:
                    with open(f"/proc/{pid}/status") as f:
                        tracer = next(int(x.split()[1]) for x in f if x.startswith("TracerPid:"))
                except (OSError, StopIteration):
                    continue
                if tracer:
                    self.tracers.append((pid, tracer))
            time.sleep(0.001)

    def __enter__(self) -> Untouched:
        self.tids = self._tids()
        os.mkdir(self._dir)
        with open(f"{self._dir}/events/signal/signal_generate/enable", "w") as f:
            f.write("1")
        self._poll.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._poll.join()
        tids = self.tids | self._tids()
        try:
            with open(f"{self._dir}/trace") as f:
                for line in f:
                    m = re.search(r"sig=(\d+) .*? pid=(\d+)", line)
                    if m and int(m.group(2)) in tids:
                        self.signals.append((int(m.group(1)), int(m.group(2))))
        finally:
            with open(f"{self._dir}/events/signal/signal_generate/enable", "w") as f:
                f.write("0")
            os.rmdir(self._dir)

    @property
    def touched(self) -> str | None:
        """What touched them, or None."""
        if self.tracers:
            return f"ptrace-attached: {sorted(set(self.tracers))}"
        if self.signals:
            return f"signalled (signal, tid): {sorted(set(self.signals))}"
        return None


def line_of(path: str, text: str) -> int:
    """The number of the first line of ``path`` (relative to the repository) holding
    ``text``: tests name a fixture's line by what it says, not by a number."""
    source = (REPO_ROOT / path).read_text().splitlines()
    return next(n for n, line in enumerate(source, 1) if text in line)
