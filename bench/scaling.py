"""The scaling part of the benchmark suite: what the daemon costs as the host grows, beside
node_exporter.

Each row is a host shape: parked threads in rank-like processes of 200, a front-end holding
idle keep-alive connections, one answering many short connections a second, a service that
turns deadlocked during the period, processes the daemon does not watch (a node's agents,
runtimes and shells), and the shape of a loaded 8-GPU node. The shapes of parked threads and
idle connections come twice: up after the daemon attached (the probe sees every wait begin),
and up before it started (every restart, upgrade or late rollout of the agent: waits /proc
shows, that the probe never saw begin). Rows of the first kind share one daemon at interval
1 s; each of the second gets a daemon of its own, started once the shape is up.

Over each row's period node_exporter (Debian's prometheus-node-exporter, its default
collectors, one process for the whole part) is scraped once a second and the daemon every
15 s (docs/deploy.md's scrape interval), and their CPU is measured over the same seconds:
node_exporter is what a node agent is judged against. After the period, the daemon's CPU
per scrape is measured apart (back-to-back scrapes), so that its cost at any scrape
interval can be read off the row. The first row is the daemon watching nothing, in the same run: every other row's
cost is read against it, and divided by the threads, connections or processes added, is the
growth per unit (what a tick spends on one that did nothing).
"""

from __future__ import annotations

import contextlib
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from bench.lib import SMOKE, Daemon, Workload, cpu_seconds, memory_kib, progress, workload_argv
from scripts.daemonproc import free_port, value

INTERVAL = 1.0
DAEMON_SCRAPE_S = 15.0  # docs/deploy.md's scrape_interval for the daemon
EXPORTER_SCRAPE_S = 1.0  # node_exporter, as the node the target is set on was scraped
SCRAPES = 50  # back-to-back scrapes the CPU per scrape is measured over (5 in --smoke)
THREADS_PER_RANK = 200
THREAD_ROWS = (200, 1_600, 6_400)
CONN_ROWS = (100, 1_000, 10_000)
SHORT_ROWS = (20, 200)  # short connections a second
OTHERS_ROW = 500  # processes that are not watched: what a node runs besides the engine
TARGET = (1_600, 1_000)  # the shape of a loaded 8-GPU node the target is set on
# Without node_exporter to compare with: the bound of one core the target had before.
TARGET_CPU_PCT = 2.0
RSS_TARGET_MB = 150.0
# Where scripts/setup.sh puts node_exporter's binary (--tests, --bench), else the PATH's.
NODE_EXPORTER = os.environ.get(
    "HANGWATCH_NODE_EXPORTER", "/var/cache/hangwatch/node-exporter/prometheus-node-exporter"
)

# The clients: a process of their own that the daemon does not watch (its command line is
# not a workload's), as a front-end's clients are; stdlib only.
CLIENTS = """
import resource, socket, sys, time
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
port, n = int(sys.argv[1]), int(sys.argv[2])
conns = [socket.create_connection(("127.0.0.1", port)) for _ in range(n)]
print("CONNECTED", len(conns), flush=True)
time.sleep(1e9)
"""

# Short connections: RATE a second, each a request, its answer and a close, paced.
SHORT_CLIENTS = """
import socket, sys, time
port, rate = int(sys.argv[1]), float(sys.argv[2])
print("STARTED", flush=True)
t = time.monotonic()
while True:
    with socket.create_connection(("127.0.0.1", port)) as c:
        c.sendall(b"GET / HTTP/1.0\\r\\n\\r\\n")
        c.recv(16)
    t += 1 / rate
    time.sleep(max(0.0, t - time.monotonic()))
"""

# The other processes: one that forks them, each asleep in pause(); its own process group,
# so that one kill ends them all.
OTHERS = """
import os, signal, sys
for _ in range(int(sys.argv[1])):
    if os.fork() == 0:
        signal.pause()
        os._exit(0)
print("FORKED", flush=True)
signal.pause()
"""


@dataclass(frozen=True)
class Row:
    threads: int = 0  # parked threads, in processes of THREADS_PER_RANK
    conns: int = 0  # idle keep-alive connections to one front-end
    others: int = 0  # processes not watched
    short: int = 0  # short connections a second to one front-end
    turns: bool = False  # a service that turns deadlocked halfway through the period
    before: bool = False  # the shape is up before the daemon starts

    @property
    def label(self) -> str:
        parts = []
        if self.threads:
            ranks = -(-self.threads // THREADS_PER_RANK)
            parts.append(f"{self.threads:,} parked threads ({ranks} x {THREADS_PER_RANK})")
        if self.conns:
            parts.append(f"{self.conns:,} idle connection{'s' if self.conns > 1 else ''}")
        if self.short:
            parts.append(f"{self.short:,} short connections/s")
        if self.turns:
            parts.append("a service turning deadlocked")
        if self.others:
            parts.append(f"{self.others:,} other processes (not watched)")
        text = " + ".join(parts) or "watching nothing"
        return text + (", up before the daemon" if self.before else "")

    @property
    def units(self) -> int:
        """What the row adds that does nothing (a short connection counts as one)."""
        return self.threads + self.conns + self.others + self.short


@dataclass(frozen=True)
class Measured:
    cpu_pct: float
    tick_ms: float  # median of the proc stage's duration over the period's scrapes
    tick_max_ms: float
    rss_mb: float
    exporter_pct: float | None = None  # node_exporter's CPU over the same seconds
    scrape_ms: float = float("nan")  # the daemon's CPU per scrape of /metrics
    burst_max_ms: float = float("nan")  # the longest tick while the shape came up


def rows(quick: bool) -> list[Row]:
    """The rows, those of one daemon (after) first, then those each with a daemon of its
    own (before); --quick keeps the smallest of each size."""
    threads, conns = (THREAD_ROWS[:1], CONN_ROWS[:1]) if quick else (THREAD_ROWS, CONN_ROWS)
    short = SHORT_ROWS[:1] if quick else SHORT_ROWS
    return [
        Row(),
        *(Row(threads=n) for n in threads),
        *(Row(conns=n) for n in conns),
        *(Row(conns=1, short=n) for n in short),
        Row(turns=True),
        Row(others=OTHERS_ROW if not quick else 50),
        Row(*TARGET),
        *(Row(threads=n, before=True) for n in threads),
        *(Row(conns=n, before=True) for n in conns),
        Row(*TARGET, before=True),
    ]


def raise_nofile(need: int) -> None:
    """The soft limit on fds up to the hard one (the workloads inherit it); an error naming
    both numbers if even the hard limit is short of what a row needs."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < need:
        raise SystemExit(
            f"bench: scaling needs {need:,} fds per process, the hard limit is {hard:,}"
        )
    if soft != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def tick_ms(d: Daemon) -> float | None:
    """The last tick's proc stage (the observation), from a scrape, in ms."""
    s = d.scrape()
    v = value(s, "hangwatch_collector_duration_seconds", collector="proc") if s else None
    return v * 1000 if v is not None else None


class NodeExporter:
    """node_exporter on a free loopback port, its default collectors, for the whole part;
    absent (``pid`` None) where its binary is not installed."""

    def __init__(self) -> None:
        exe = NODE_EXPORTER if os.access(NODE_EXPORTER, os.X_OK) else None
        exe = exe or shutil.which("prometheus-node-exporter") or shutil.which("node_exporter")
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = free_port()
        if exe is None:
            progress("scaling: node_exporter not found (make bench installs it): no comparison")
            return
        self.proc = subprocess.Popen(
            [exe, f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 30
        while not self.scrape():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"bench: node_exporter ({exe}) did not answer on {self.port}")
            time.sleep(0.1)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def scrape(self) -> bool:
        try:
            url = f"http://127.0.0.1:{self.port}/metrics"
            with urllib.request.urlopen(url, timeout=5) as r:
                r.read()
            return True
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()


def started(script: str, *args: object) -> subprocess.Popen[str]:
    """A client process running ``script``, once it has printed its first line."""
    p = subprocess.Popen(
        [sys.executable, "-c", script, *map(str, args)], stdout=subprocess.PIPE, text=True
    )
    assert p.stdout is not None
    p.stdout.readline()
    return p


@contextlib.contextmanager
def shape(exe: Path, d: Daemon | None, row: Row, period: float) -> Iterator[list[tuple[int, int]]]:
    """The row's workloads, up for the block: (pid, threads) of each that a daemon watches.
    With ``d``, each is watched by it before it starts (every wait seen begin); without,
    they start at once, the daemon to come."""
    procs: list[Workload] = []
    clients: list[subprocess.Popen[str]] = []
    others: subprocess.Popen[str] | None = None

    def go(w: Workload) -> None:
        if d is not None:
            d.wait_watching(w.pid, timeout=60)
        w.go()

    try:
        if row.others:
            others = subprocess.Popen(
                [sys.executable, "-c", OTHERS, str(row.others)],
                stdout=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
            assert others.stdout is not None
            assert others.stdout.readline().startswith("FORKED")
        watched: list[tuple[int, int]] = []
        remaining = row.threads
        while remaining > 0:
            n = min(THREADS_PER_RANK, remaining)
            procs.append(Workload(workload_argv(exe, "park", n)))
            watched.append((procs[-1].pid, n + 1))
            remaining -= n
        parked = list(procs)
        for w in parked:
            go(w)
        for w in parked:
            assert w.readline().startswith("PARKED")
        if row.conns:
            server = Workload(workload_argv(exe, "serve", row.conns))
            procs.append(server)
            watched.append((server.pid, 1))
            port = int(server.readline().split()[1])
            go(server)
            clients.append(started(CLIENTS, port, row.conns))
            assert server.readline().startswith("SERVING")
            if row.short:
                clients.append(started(SHORT_CLIENTS, port, row.short))
        if row.turns:
            # Deadlocked halfway through the period: past the ticks that first read it (3
            # intervals) and half the period after.
            secs = 3 * INTERVAL + period / 2
            turner = Workload(workload_argv(exe, "turn", 100, f"{secs:g}"))
            procs.append(turner)
            watched.append((turner.pid, 3))
            go(turner)
        yield watched
    finally:
        if others is not None:
            os.killpg(others.pid, signal.SIGKILL)
            others.wait()
        for c in clients:
            c.kill()
            c.wait()
        for w in procs:
            w.kill()


def seen(d: Daemon, watched: Sequence[tuple[int, int]], burst: list[float]) -> None:
    """Wait until the daemon counts every thread of the watched workloads, then keep the tick
    times of the next few ticks (those that read them first) in ``burst``."""
    for pid, want in watched:
        d.wait_for(
            lambda s, pid=pid, want=want: (
                value(s, "hangwatch_process_threads", pid=str(pid)) == want
            ),
            f"pid {pid}'s threads in /metrics",
            60,
        )
    end = time.monotonic() + 3 * INTERVAL  # past the ticks that first read them
    while time.monotonic() < end:
        ms = tick_ms(d)
        if ms is not None:
            burst.append(ms)
        time.sleep(INTERVAL / 4)


def measure(d: Daemon, exporter: NodeExporter, period: float) -> Measured:
    """The daemon's and node_exporter's CPU over ``period``, scraped meanwhile as deployed
    (node_exporter every EXPORTER_SCRAPE_S, the daemon every DAEMON_SCRAPE_S, from the
    start), then the daemon's CPU per scrape and its tick times (a few scrapes)."""
    durations: list[float] = []
    stop = threading.Event()

    def scrape() -> None:
        start = at = time.monotonic()
        next_daemon = start
        while not stop.is_set():
            if at >= next_daemon:
                ms = tick_ms(d)
                if ms is not None:
                    durations.append(ms)
                next_daemon += DAEMON_SCRAPE_S
            if exporter.pid is not None:
                exporter.scrape()
            at += EXPORTER_SCRAPE_S
            stop.wait(max(0.0, at - time.monotonic()))

    scraper = threading.Thread(target=scrape, daemon=True)
    ne = exporter.pid
    c0, n0, t0 = cpu_seconds(d.pid), cpu_seconds(ne) if ne else 0.0, time.monotonic()
    scraper.start()
    time.sleep(period)
    c1, n1, t1 = cpu_seconds(d.pid), cpu_seconds(ne) if ne else 0.0, time.monotonic()
    stop.set()
    scraper.join()
    s0 = cpu_seconds(d.pid)
    n = 5 if SMOKE[0] else SCRAPES
    for _ in range(n):
        ms = tick_ms(d)
        if ms is not None:
            durations.append(ms)
    scrape_ms = (cpu_seconds(d.pid) - s0) / n * 1000  # with a tick's share, if one came
    mem = memory_kib(d.pid)
    return Measured(
        100 * (c1 - c0) / (t1 - t0),
        statistics.median(durations) if durations else float("nan"),
        max(durations, default=float("nan")),
        mem["VmRSS"] * 1024 / 1e6,
        100 * (n1 - n0) / (t1 - t0) if ne else None,
        scrape_ms,
    )


def run(
    exe: Path, quick: bool, watch: Sequence[dict[str, str]]
) -> tuple[list[Row], list[Measured]]:
    period = 1.0 if SMOKE[0] else 3.0 if quick else 30.0
    todo = rows(quick)
    raise_nofile(max(r.conns for r in todo) + 100)
    got = []
    exporter = NodeExporter()
    try:
        with Daemon(watch, INTERVAL) as d:  # the rows whose shape comes up after it
            d.wait_ready()
            time.sleep(2 * INTERVAL)
            for row in (r for r in todo if not r.before):
                progress(f"scaling: {row.label}, {period:g} s")
                burst: list[float] = []
                with shape(exe, d, row, period) as watched:
                    seen(d, watched, burst)
                    m = measure(d, exporter, period)
                got.append(replace(m, burst_max_ms=max(burst, default=float("nan"))))
        for row in (r for r in todo if r.before):
            progress(f"scaling: {row.label}, {period:g} s")
            burst = []
            with shape(exe, None, row, period) as watched, Daemon(watch, INTERVAL) as d:
                d.wait_ready()
                seen(d, watched, burst)
                m = measure(d, exporter, period)
            got.append(replace(m, burst_max_ms=max(burst, default=float("nan"))))
    finally:
        exporter.stop()
    return [r for r in todo if not r.before] + [r for r in todo if r.before], got


def per_unit_us(row: Row, m: Measured, base: Measured) -> str:
    """CPU per tick per thread, connection or process added (per short connection, for a
    row of them), in microseconds, over the idle row."""
    if not row.units:
        return ""
    extra_s = (m.cpu_pct - base.cpu_pct) / 100 * INTERVAL
    return f"{max(0.0, extra_s) / row.units * 1e6:.2f}"


def table(todo: Sequence[Row], got: Sequence[Measured]) -> tuple[str, list[str], list[list[str]]]:
    base = got[0]
    out = []
    for row, m in zip(todo, got):
        target, ok = "", None
        if (row.threads, row.conns) == TARGET:
            if m.exporter_pct is not None:
                target = f"CPU < node_exporter's, RSS <= {RSS_TARGET_MB:g} MB"
                ok = m.cpu_pct < m.exporter_pct and m.rss_mb <= RSS_TARGET_MB
            else:
                target = f"CPU <= {TARGET_CPU_PCT:g}%, RSS <= {RSS_TARGET_MB:g} MB"
                ok = m.cpu_pct <= TARGET_CPU_PCT and m.rss_mb <= RSS_TARGET_MB
        ne = m.exporter_pct
        out.append([
            row.label, f"{m.cpu_pct:.2f}", f"{m.cpu_pct - base.cpu_pct:+.2f}",
            per_unit_us(row, m, base), "n/a" if ne is None else f"{ne:.2f}",
            "n/a" if not ne else f"{m.cpu_pct / ne:.2f}", f"{m.scrape_ms:.1f}", f"{m.tick_ms:.1f}",
            f"{m.tick_max_ms:.1f}", f"{m.burst_max_ms:.1f}", f"{m.rss_mb:.1f}", target,
            "" if ok is None else ("met" if ok else "NOT met"),
        ])  # fmt: skip
    headers = [
        "host", "CPU % of a core", "over idle", "us per unit per tick",
        "node_exporter CPU %", "daemon / node_exporter", "CPU ms per scrape",
        "tick ms (median)", "tick ms (max)",
        "tick ms coming up (max)", "VmRSS MB", "target", "result",
    ]  # fmt: skip
    return (
        f"How the daemon's cost grows, beside node_exporter (interval {INTERVAL:g} s, scraped "
        f"every {DAEMON_SCRAPE_S:g} s; node_exporter scraped every {EXPORTER_SCRAPE_S:g} s; "
        "one run)",
        headers,
        out,
    )
