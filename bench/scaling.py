"""The scaling part of the benchmark suite: what the daemon costs as the host grows.

One daemon at interval 1 s watches the bench workloads; each row adds a host shape (parked
threads in rank-like processes of 200, a front-end holding idle keep-alive connections, both,
or processes the daemon does not watch, as a node's agents, runtimes and shells) and measures the daemon's CPU over a period with nothing scraping it, then its tick
time from a few scrapes. The first row is the same daemon watching nothing, in the same run:
every other row's cost is read against it, and divided by the threads or connections added,
is the growth per unit (what a tick spends on a thread or a connection that did nothing).
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from bench.lib import SMOKE, Daemon, Workload, cpu_seconds, memory_kib, progress, workload_argv
from scripts.daemonproc import value

INTERVAL = 1.0
THREADS_PER_RANK = 200
THREAD_ROWS = (200, 1_600, 6_400)
CONN_ROWS = (100, 1_000, 10_000)
OTHERS_ROW = 500  # processes that are not watched: what a node runs besides the engine
TARGET = (1_600, 1_000)  # the shape of a loaded 8-GPU node the target is set on
TARGET_CPU_PCT = 2.0  # of one core, for TARGET at interval 1 s
RSS_TARGET_MB = 150.0

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
    threads: int
    conns: int
    others: int = 0  # processes not watched

    @property
    def label(self) -> str:
        parts = []
        if self.threads:
            ranks = -(-self.threads // THREADS_PER_RANK)
            parts.append(f"{self.threads:,} parked threads ({ranks} x {THREADS_PER_RANK})")
        if self.conns:
            parts.append(f"{self.conns:,} idle connections")
        if self.others:
            parts.append(f"{self.others:,} other processes (not watched)")
        return " + ".join(parts) or "watching nothing"


@dataclass(frozen=True)
class Measured:
    cpu_pct: float
    tick_ms: float  # median of the proc stage's duration over a few ticks
    tick_max_ms: float
    rss_mb: float
    burst_max_ms: float = float("nan")  # the longest tick while the shape came up


def rows(quick: bool) -> list[Row]:
    threads, conns = (THREAD_ROWS[:1], CONN_ROWS[:1]) if quick else (THREAD_ROWS, CONN_ROWS)
    return [
        Row(0, 0),
        *(Row(n, 0) for n in threads),
        *(Row(0, n) for n in conns),
        Row(0, 0, OTHERS_ROW if not quick else 50),
        Row(*TARGET),
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


@contextlib.contextmanager
def shape(exe: Path, d: Daemon, row: Row, burst: list[float]) -> Iterator[None]:
    """The row's workloads, up and seen by the daemon, for the block; ``burst`` gets the
    tick times seen while they came up (all threads parking, all clients connecting)."""
    procs: list[Workload] = []
    clients: subprocess.Popen[str] | None = None
    others: subprocess.Popen[str] | None = None
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
        remaining = row.threads
        while remaining > 0:
            n = min(THREADS_PER_RANK, remaining)
            procs.append(Workload(workload_argv(exe, "park", n)))
            remaining -= n
        server = None
        if row.conns:
            server = Workload(workload_argv(exe, "serve", row.conns))
            procs.append(server)
        for w in procs:
            d.wait_watching(w.pid, timeout=60)
            w.go()
        for w in procs:
            if w is not server:
                w.readline()  # PARKED n
        if server is not None:
            port = int(server.readline().split()[1])
            clients = subprocess.Popen(
                [sys.executable, "-c", CLIENTS, str(port), str(row.conns)],
                stdout=subprocess.PIPE,
                text=True,
            )
            assert clients.stdout is not None
            clients.stdout.readline()
            assert server.readline().startswith("SERVING")
        for w in procs:
            want = (THREADS_PER_RANK if w is not server else 0) + 1
            d.wait_for(
                lambda s, pid=w.pid, want=want: (
                    value(s, "hangwatch_process_threads", pid=str(pid)) == want
                ),
                f"pid {w.pid}'s threads in /metrics",
                60,
            )
        end = time.monotonic() + 3 * INTERVAL  # past the ticks that first read them
        while time.monotonic() < end:
            ms = tick_ms(d)
            if ms is not None:
                burst.append(ms)
            time.sleep(INTERVAL / 4)
        yield
    finally:
        if others is not None:
            os.killpg(others.pid, signal.SIGKILL)
            others.wait()
        if clients is not None:
            clients.kill()
            clients.wait()
        for w in procs:
            w.kill()


def measure(d: Daemon, period: float, ticks: int) -> Measured:
    c0, t0 = cpu_seconds(d.pid), time.monotonic()
    time.sleep(period)  # nothing scrapes it meanwhile: the CPU is the ticks'
    c1, t1 = cpu_seconds(d.pid), time.monotonic()
    durations = []
    for _ in range(ticks):
        time.sleep(INTERVAL)
        ms = tick_ms(d)
        if ms is not None:
            durations.append(ms)
    mem = memory_kib(d.pid)
    return Measured(
        100 * (c1 - c0) / (t1 - t0),
        statistics.median(durations) if durations else float("nan"),
        max(durations, default=float("nan")),
        mem["VmRSS"] * 1024 / 1e6,
    )


def run(
    exe: Path, quick: bool, watch: Sequence[dict[str, str]]
) -> tuple[list[Row], list[Measured]]:
    period = 1.0 if SMOKE[0] else 3.0 if quick else 30.0
    ticks = 1 if SMOKE[0] else 2 if quick else 8
    todo = rows(quick)
    raise_nofile(max(r.conns for r in todo) + 100)
    got = []
    with Daemon(watch, INTERVAL) as d:
        d.wait_ready()
        time.sleep(2 * INTERVAL)
        for row in todo:
            progress(f"scaling: {row.label}, {period:g} s")
            burst: list[float] = []
            with shape(exe, d, row, burst):
                m = measure(d, period, ticks)
            got.append(replace(m, burst_max_ms=max(burst, default=float("nan"))))
    return todo, got


def per_unit_us(row: Row, m: Measured, base: Measured) -> str:
    """CPU per tick per thread or connection added, in microseconds, over the idle row."""
    units = row.threads + row.conns + row.others
    if not units:
        return ""
    extra_s = (m.cpu_pct - base.cpu_pct) / 100 * INTERVAL
    return f"{max(0.0, extra_s) / units * 1e6:.2f}"


def table(todo: Sequence[Row], got: Sequence[Measured]) -> tuple[str, list[str], list[list[str]]]:
    base = got[0]
    out = []
    for row, m in zip(todo, got):
        target, ok = "", None
        if (row.threads, row.conns) == TARGET:
            target = f"CPU <= {TARGET_CPU_PCT:g}%, RSS <= {RSS_TARGET_MB:g} MB"
            ok = m.cpu_pct <= TARGET_CPU_PCT and m.rss_mb <= RSS_TARGET_MB
        out.append([
            row.label, f"{m.cpu_pct:.2f}", f"{m.cpu_pct - base.cpu_pct:+.2f}",
            per_unit_us(row, m, base), f"{m.tick_ms:.1f}", f"{m.tick_max_ms:.1f}",
            f"{m.burst_max_ms:.1f}", f"{m.rss_mb:.1f}", target,
            "" if ok is None else ("met" if ok else "NOT met"),
        ])  # fmt: skip
    headers = [
        "host", "CPU % of a core", "over idle", "us per unit per tick", "tick ms (median)",
        "tick ms (max)", "tick ms coming up (max)", "VmRSS MB", "target", "result",
    ]  # fmt: skip
    return (
        f"How the daemon's cost grows (interval {INTERVAL:g} s, one daemon, one run)",
        headers,
        out,
    )
