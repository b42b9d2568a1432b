"""Run ``python -m agent diagnose`` as a user would and keep everything it said.

Used through the fixtures in ``conftest.py``; every assertion message built here carries
the command, its exit status, the JSON report and stderr, so a failure explains itself.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from scripts.fixturelib import REPO_ROOT


def diagnose_argv(
    pids: Iterable[int], *, threshold: float = 1, duration: float = 2, json_out: bool = True
) -> list[str]:
    argv = [sys.executable, "-m", "agent", "diagnose"]
    for pid in pids:
        argv += ["--pid", str(pid)]
    if json_out:
        argv.append("--json")
    return [*argv, "--threshold", f"{threshold:g}", "--duration", f"{duration:g}"]


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

    def finish(self, timeout: float = 60) -> Diagnosis:
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
