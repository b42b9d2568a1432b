"""A real `hangwatch run` in a child process: start it, scrape its /metrics, stop it.

The one copy shared by the privileged tests (``tests/privileged/daemonlib.py`` adds their
pytest parts), the benchmark (``bench/lib.py``), ``scripts/demo.py`` and ``scripts/soak.py``.

A scrape is a :data:`Samples` dict: ``(sample name, labels as a sorted tuple of (name,
value) pairs) -> value``; :func:`value` looks one sample up by name and some of its labels.
"""

from __future__ import annotations

import itertools
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import IO

from prometheus_client.parser import text_string_to_metric_families

from agent.sources.procfs import ProcFS

REPO_ROOT = Path(__file__).resolve().parent.parent

Labels = tuple[tuple[str, str], ...]
Samples = dict[tuple[str, Labels], float]


# Ports handed to a child that binds them later. Below the kernel's ephemeral range, which
# outbound connections draw from: a port there can be taken between the choice and the child's
# bind by any connection on the host (it was, more than once). Each process takes its ports
# from a slice of its own (a pytest-xdist worker by its number, anything else the first), in
# turn, so the workers of one run never hand out the same port.
PORT_LOW = 20000
PORT_SLICE = 1000
_next_port = itertools.count()


def port_slice(worker: str | None, top: int) -> range:
    """This process's ports: worker "gwN" gets slice N + 1, anything else slice 0; slices
    past the ephemeral range's start wrap around."""
    slices = max(1, (top - PORT_LOW) // PORT_SLICE)
    index = 0
    if worker and worker.startswith("gw") and worker[2:].isdigit():
        index = (int(worker[2:]) + 1) % slices
    start = PORT_LOW + index * PORT_SLICE
    return range(start, min(start + PORT_SLICE, top))


def free_port() -> int:
    """A TCP port, below the ephemeral range and in this process's slice, that nobody has
    bound now (on any address; one a closed connection holds in TIME_WAIT is passed over)."""
    ports = port_slice(os.environ.get("PYTEST_XDIST_WORKER"), ProcFS().ephemeral_from())
    for _ in range(len(ports)):
        port = ports[next(_next_port) % len(ports)]
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
        return port
    raise OSError(f"no free port in {ports.start}-{ports.stop - 1}")


def parse(text: str) -> Samples:
    """Prometheus text exposition as :data:`Samples`."""
    out: Samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float | None:
    """The one sample of ``name`` whose labels include ``labels``; None if there is none.

    More than one match is a mistake of the caller (too few labels): ValueError."""
    want = labels.items()
    hits = [v for (n, ls), v in samples.items() if n == name and want <= dict(ls).items()]
    if len(hits) > 1:
        raise ValueError(f"{len(hits)} samples of {name} with labels {labels}: {hits}")
    return hits[0] if hits else None


def first_tick_done(samples: Samples) -> bool:
    """Whether the daemon has finished a tick. /metrics answers before the probes attach
    (the port is bound first); the proc collector's success comes with the first tick's
    results, so the probes are attached and working."""
    return value(samples, "hangwatch_collector_success", collector="proc") == 1


class DaemonError(RuntimeError):
    """The daemon exited, or what we waited for did not come in time."""

    def __init__(self, message: str, last: Samples | None = None) -> None:
        super().__init__(message)
        self.last = last  # the last successful scrape, if any


class DaemonExited(DaemonError):
    pass


class DaemonTimeout(DaemonError):
    pass


class DaemonProcess:
    """``python -m agent run --config CONFIG`` (run from the repository root), its stdout and
    stderr going to ``log`` (default: CONFIG with the suffix .log). Listens where the config
    says; ``port`` is where we scrape it. A context manager: stop() on exit."""

    def __init__(self, config: Path, port: int, log: Path | None = None) -> None:
        self.config = config
        self.port = port
        self.log = config.with_suffix(".log") if log is None else log
        self._log_f: IO[bytes] = self.log.open("wb")
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "agent", "run", "--config", str(config)],
            cwd=REPO_ROOT,
            stdout=self._log_f,
            stderr=subprocess.STDOUT,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def running(self) -> bool:
        return self.proc.poll() is None

    def output(self) -> str:
        """Everything the daemon has logged so far."""
        if not self._log_f.closed:
            self._log_f.flush()
        return self.log.read_text(errors="replace")

    def scrape(self, timeout: float = 5.0) -> Samples | None:
        """GET /metrics, parsed; None when it does not answer."""
        try:
            url = f"http://127.0.0.1:{self.port}/metrics"
            with urllib.request.urlopen(url, timeout=timeout) as r:
                text = r.read().decode()
        except OSError:
            return None
        return parse(text)

    def wait_for(
        self, check: Callable[[Samples], bool], what: str, timeout: float, poll: float = 0.05
    ) -> Samples:
        """Scrape every ``poll`` s until ``check`` holds; that scrape. DaemonExited if the
        daemon exits first, DaemonTimeout after ``timeout`` s (``.last``: the last scrape)."""
        deadline = time.monotonic() + timeout
        last: Samples | None = None
        while True:
            if not self.running():
                raise DaemonExited(
                    f"daemon exited ({self.proc.returncode}) while waiting for {what}:\n"
                    f"{self.output()}",
                    last,
                )
            samples = self.scrape()
            if samples is not None:
                last = samples
                if check(samples):
                    return samples
            if time.monotonic() > deadline:
                raise DaemonTimeout(f"timed out after {timeout} s waiting for {what}", last)
            time.sleep(poll)

    def first_tick(self, timeout: float = 60, poll: float = 0.05) -> Samples:
        """Wait for the daemon's first tick (see :func:`first_tick_done`)."""
        return self.wait_for(first_tick_done, "the daemon's first tick", timeout, poll)

    def stop(self, timeout: float = 30) -> int:
        """SIGTERM, and its exit status. SIGKILL if it has not exited after ``timeout`` s
        (the status is then -9). Safe to call again."""
        try:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
            return self.proc.returncode
        finally:
            self._log_f.close()

    def __enter__(self) -> DaemonProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
