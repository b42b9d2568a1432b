"""A real `hangwatch run` for tests: start it, scrape it, wait for what it says, stop it."""

from __future__ import annotations

import contextlib
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.fixturelib import REPO_ROOT

INTERVAL = 0.5

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Daemon:
    def __init__(self, config: Path, port: int) -> None:
        self.port = port
        self.log = config.with_suffix(".log")
        self._log_f = self.log.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "agent", "run", "--config", str(config)],
            cwd=REPO_ROOT,
            stdout=self._log_f,
            stderr=subprocess.STDOUT,
        )

    def scrape(self) -> Samples | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5) as r:
                text = r.read().decode()
        except OSError:
            return None
        out: Samples = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return out

    def output(self) -> str:
        if not self._log_f.closed:
            self._log_f.flush()
        return self.log.read_text()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=30)
        finally:
            self._log_f.close()


def value(samples: Samples, name: str, **labels: str) -> float | None:
    """The one sample of ``name`` whose labels include ``labels``."""
    hits = [v for (n, ls), v in samples.items() if n == name and labels.items() <= dict(ls).items()]
    assert len(hits) <= 1, (name, labels, hits)
    return hits[0] if hits else None


def wait_until(daemon: Daemon, check: Callable[[Samples], bool], what: str, timeout: float = 20):
    deadline = time.monotonic() + timeout
    last: Samples | None = None
    while time.monotonic() < deadline:
        assert daemon.proc.poll() is None, f"daemon exited:\n{daemon.output()}"
        last = daemon.scrape()
        if last is not None and check(last):
            return last
        time.sleep(INTERVAL)
    shown = "\n".join(
        f"{n}{dict(ls)} {v}"
        for (n, ls), v in sorted((last or {}).items())
        if n.startswith("hangwatch_service_state") and v
    )
    pytest.fail(f"timed out waiting for {what}\nservice states:\n{shown}\nlog:\n{daemon.output()}")


def rss_bytes(pid: int) -> int:
    """Resident set size of ``pid`` now, from /proc/PID/status."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def pids_in(samples: Samples) -> set[int]:
    """Every process (pid label) /metrics names."""
    return {int(dict(ls)["pid"]) for (_, ls) in samples if "pid" in dict(ls)}


def wait_for_log(daemon: Daemon, pattern: str, what: str, timeout: float = 20) -> re.Match[str]:
    """Wait for a line of the daemon's log matching ``pattern`` (no scrape involved)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert daemon.proc.poll() is None, f"daemon exited:\n{daemon.output()}"
        m = re.search(pattern, daemon.output(), re.M)
        if m:
            return m
        time.sleep(0.1)
    pytest.fail(f"timed out waiting for {what} in the log:\n{daemon.output()}")


def first_tick(daemon: Daemon, timeout: float = 20) -> Samples:
    """Wait for the daemon's first tick. /metrics answers before the probes attach (the port
    is bound first); a first tick means they are attached."""
    return wait_until(
        daemon,
        lambda s: value(s, "hangwatch_collector_success", collector="proc") == 1,
        "the daemon's first tick",
        timeout=timeout,
    )


@contextlib.contextmanager
def running_daemon(config: Path, port: int) -> Iterator[Daemon]:
    """A daemon past its first tick; on exit, SIGTERM, exit 0, and none of the BPF programs
    it added left in the kernel."""
    from tests.privileged.bpfobjs import leaked, prog_ids

    before = prog_ids()
    d = Daemon(config, port)
    try:
        first_tick(d, timeout=120)
        added = prog_ids() - before
        yield d
    finally:
        rc = d.stop()
    assert rc == 0, f"daemon exit {rc}\n{d.output()}"
    assert added, "the daemon loaded no BPF program?"
    left = leaked(added)
    assert not left, f"BPF programs left after SIGTERM: {sorted(left)}"
