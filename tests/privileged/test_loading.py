"""Loading is work: a server reading its weights, every other thread parked, no port yet.

One program (tests/fixtures/storage_load.c) loads one 4 MiB shard every 200 ms in one way
per mode, logging a line per shard while 16 workers wait on a barrier: buffered reads whose
pages were dropped from the page cache, O_DIRECT reads, page-ins of a mapped file, readahead
into the page cache, reads of a file on tmpfs (no block I/O, as on a network or FUSE file
system), and a TCP stream from a peer outside it. Each must read ``progressing``, from
``diagnose --threshold 2 --duration 3`` and from the daemon, with its kind of read named in
the evidence as the source that counts it saw it; the twin that sleeps instead of reading,
logging the same line, must not. All modes run side by side, against one diagnose and one
daemon.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.sources.probe import KernelProbes
from scripts.fixturelib import Fixture
from tests.limits import HANG_S
from tests.privileged.daemonlib import Daemon, free_port, running_daemon, value, wait_until
from tests.privileged.harness import Diagnosis, RunningDiagnose, diagnose_argv

# one worker: the module's loaders, diagnose and daemon start once
pytestmark = pytest.mark.xdist_group("privileged-loading")

SHARD = 4 << 20
WEIGHTS_BYTES = 16 * SHARD
THRESHOLD = 2
# mode -> (the evidence kind that must name it, the field of it its own source fills)
LOADS = {
    "buffered": ("read_storage", "block_bytes"),
    "direct": ("read_storage", "block_bytes"),
    "mmap": ("read_storage", "major_faults"),
    "prefetch": ("read_storage", "block_bytes"),
    "cached": ("read_storage", "file_bytes"),
    "tcp": ("received_in", "bytes"),
}
MODES = [*LOADS, "timer"]
SHM = Path("/dev/shm")


def _weights(path: Path) -> Path:
    with open(path, "wb") as f:
        for _ in range(WEIGHTS_BYTES // SHARD):
            f.write(os.urandom(SHARD))
        f.flush()
        os.fsync(f.fileno())  # clean pages: the fixture can drop them from the page cache
    return path


class Streamer:
    """A peer outside the loaders: streams bytes to every connection, as an object store or
    a peer rank sending weights does."""

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.server.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._stream, args=(conn,), daemon=True).start()

    @staticmethod
    def _stream(conn: socket.socket) -> None:
        chunk = os.urandom(1 << 20)
        with conn:
            try:
                while True:
                    conn.sendall(chunk)
            except OSError:
                return

    def close(self) -> None:
        self.server.close()


@pytest.fixture(scope="module")
def loaders(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Fixture]]:
    """Every mode running, by mode."""
    tmp = tmp_path_factory.mktemp("loading")
    weights = _weights(tmp / "weights.bin")  # on a file system with block I/O
    cached = _weights(Path(SHM if SHM.is_dir() else tmp) / f"hangwatch-test-{os.getpid()}.bin")
    streamer = Streamer()
    sources = {m: weights for m in ("buffered", "direct", "mmap", "prefetch")}
    sources |= {"cached": cached, "tcp": streamer.address, "timer": weights}
    running: dict[str, Fixture] = {}
    try:
        for mode in MODES:
            fx = Fixture.c("storage_load", mode, sources[mode], tmp / f"{mode}.log")
            running[mode] = fx.__enter__()
        yield running
    finally:
        for fx in running.values():
            fx.close()
        streamer.close()
        cached.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def diagnosed(loaders: dict[str, Fixture]) -> Diagnosis:
    """One ``diagnose --threshold 2 --duration 3`` of every mode, each its own service."""
    pids = [fx.pid for fx in loaders.values()]
    return RunningDiagnose(diagnose_argv(pids, threshold=THRESHOLD, duration=3)).finish(90)


def _evidence(svc: Any, kind: str) -> list[dict[str, Any]]:
    """Every evidence record of ``kind`` anywhere in a service's report."""
    if isinstance(svc, dict):
        here = [svc] if svc.get("kind") == kind else []
        return here + [e for v in svc.values() for e in _evidence(v, kind)]
    if isinstance(svc, list):
        return [e for v in svc for e in _evidence(v, kind)]
    return []


@pytest.mark.parametrize("mode", list(LOADS))
def test_diagnose_calls_each_kind_of_loading_progressing(
    mode: str, loaders: dict[str, Fixture], diagnosed: Diagnosis
) -> None:
    pid = loaders[mode].pid
    svc = diagnosed.service(pid)
    assert svc.get("state") == "progressing", diagnosed.explain(f"{mode} (pid {pid})")
    kind, field = LOADS[mode]
    seen = [e for e in _evidence(svc, kind) if e.get(field)]
    assert seen, diagnosed.explain(f"{mode}: no {kind} evidence with {field} in pid {pid}")


def test_diagnose_does_not_call_the_timer_twin_progressing(
    loaders: dict[str, Fixture], diagnosed: Diagnosis
) -> None:
    pid = loaders["timer"].pid
    svc = diagnosed.service(pid)
    assert svc.get("state") in ("stalled", "idle"), diagnosed.explain(f"the timer twin ({pid})")
    assert not _evidence(svc, "read_storage"), diagnosed.explain("the twin read nothing")


def test_a_native_server_loading_with_o_direct_is_progressing_not_stalled(
    loaders: dict[str, Fixture], diagnosed: Diagnosis
) -> None:
    """The issue's shape: a loader thread reads 4 MiB of its weights with O_DIRECT per
    shard and logs a line per shard, 16 workers parked on a barrier, nothing listening."""
    pid = loaders["direct"].pid
    svc = diagnosed.service(pid)
    threads = [p for p in svc.get("processes", []) if p.get("pid") == pid]
    # The main thread joining the loader, the loader, 16 workers: all parked (the loader
    # waits on its reads and its pauses, with no CPU to speak of).
    assert threads and threads[0].get("threads") == 18, diagnosed.explain("18 threads")
    assert threads[0].get("parked_threads") == 18, diagnosed.explain("every thread parked")
    assert not svc.get("listening_ports"), diagnosed.explain("nothing listens yet")
    assert svc.get("state") == "progressing", diagnosed.explain("loading is progress")
    assert svc.get("culprit") is None, diagnosed.explain("no culprit while it loads")


CONFIG = """
listen: "127.0.0.1:{port}"
interval_seconds: 0.5
park_threshold_seconds: {threshold}
targets:
{targets}
"""


@pytest.fixture(scope="module")
def daemon(
    loaders: dict[str, Fixture], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Daemon]:
    """One daemon watching every mode, each as the service load-MODE; ready once the timer
    twin reads stalled (its threads parked past the threshold), so that every window
    scraped from then on is a real one, not a first sight's."""
    port = free_port()
    targets = "\n".join(f'  - name: load-{m}\n    cmdline: "storage_load {m} "' for m in loaders)
    cfg = tmp_path_factory.mktemp("loading-daemon") / "hangwatch.yaml"
    cfg.write_text(CONFIG.format(port=port, threshold=THRESHOLD, targets=targets))
    with running_daemon(cfg, port) as d:
        wait_until(
            d,
            lambda s: (
                value(s, "hangwatch_service_state", service="load-timer", state="stalled") == 1
            ),
            "the timer twin to read stalled",
            timeout=HANG_S,
        )
        yield d


@pytest.mark.parametrize("mode", list(LOADS))
def test_daemon_calls_each_kind_of_loading_progressing(
    mode: str, loaders: dict[str, Fixture], daemon: Daemon
) -> None:
    """Progressing with every thread parked past the threshold: by the reads, not by the
    grace a service gets before its park time reaches the threshold."""
    pid = str(loaders[mode].pid)

    def progressing_by_its_reads(s: Any) -> bool:
        state = "hangwatch_service_state"
        parked = value(s, "hangwatch_process_parked_seconds", pid=pid)
        return (
            value(s, state, service=f"load-{mode}", state="progressing") == 1
            and parked is not None
            and parked > THRESHOLD
            and value(s, state, service="load-timer", state="progressing") == 0
        )

    wait_until(daemon, progressing_by_its_reads, f"load-{mode} progressing, all parked")


# --- the read probe itself ------------------------------------------------------------------


@pytest.fixture(scope="module")
def probes() -> Iterator[KernelProbes]:
    with KernelProbes() as k:
        yield k


@pytest.mark.parametrize("watch", [True, False])
def test_the_read_probe_counts_regular_files_only_and_watched_processes_only(
    probes: KernelProbes, tmp_path: Path, watch: bool
) -> None:
    """Exactly the bytes read from a regular file (read, pread64, readv, preadv); nothing of
    /proc, sysfs or a pipe; nothing at all for a process not watched."""
    assert probes.counts_file_reads, "no read probe: the kernel's BTF lacks an offset?"
    data = tmp_path / "data.bin"
    data.write_bytes(os.urandom(300_000))
    with Fixture.py("file_reads", data, ready="STARTED") as fx:
        probes.watch([fx.pid] if watch else [])
        fx.send("go")
        want = fx.wait_for("READY").get_int("file_bytes")
        got = (probes.read().file_reads or {}).get(fx.pid)
        probes.watch([])
        probes.forget_processes([fx.pid])
    assert want == 300_000 + 3 * 4096
    assert got == (want if watch else None)
