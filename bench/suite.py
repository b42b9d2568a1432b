"""hangwatch's benchmark suite: what the daemon costs the processes on its host, and itself.

Parts (``--only PART``, or ``--only WORKLOAD`` for one row group of the overhead table):

  overhead   ns per operation of small workloads with no agent, with a daemon that watches
             nothing ("unwatched": what every process on the host pays) and with one that
             watches the workload; interleaved in rounds, medians, ratios to no agent
  resources  the daemon's CPU and memory: idle, watching ~1M futex calls/s, 2,000 parked threads
  ringbuf    the highest bind+listen event rate the ring buffer sustains without drops
  startup    exec of `hangwatch run` to the first /metrics scrape with the daemon's results
  detection  a two-mutex lock cycle forming to /metrics saying deadlocked
  stacks     reading the Python stacks of a pool of 100 and 2,000 parked threads (py-spy
             --nonblocking), against one /proc sample of the same process (a tick's read)
  slowclients  /metrics scrape latency alone and while 140 slow clients (uid nobody) hold
             connections open, and the daemon's threads and file descriptors meanwhile
  maps       placing a process's waits and stacks in its memory maps (the sampler, each tick
             the process ran): the whole file read and parsed (before), streamed keeping
             only the mappings asked for, and asked of the kernel (PROCMAP_QUERY), for a
             pool of 200 threads and for 62,000 mappings under a 4,000-character path
  programs   ns per run of each of hangwatch's BPF programs a workload runs (the kernel's
             run-time accounting, on for this part only): the futex and write paths of a
             watched process, the rename path of any; rounds, medians
  procio     what the storage counters cost a tick, per process: /proc/PID/io read for
             wchar alone (before) and for wchar and read_bytes (now), and /proc/PID/stat
             parsed with its major faults; against getppid(2) in the same run
  scaling    the daemon's CPU and tick time as the host grows: 200 / 1,600 / 6,400 parked
             threads, 100 / 1,000 / 10,000 idle connections, 1,600 threads + 1,000
             connections, each against the same daemon watching nothing in the same run

Needs root. Usage: python -m bench [--quick] [--markdown] [--only NAME] [--rounds N]
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench import scaling
from bench.lib import (
    DAEMON_CONFIG,
    WORKLOAD_REGEX,
    Daemon,
    Workload,
    build_workloads,
    cpu_seconds,
    hangwatch_objects,
    memory_kib,
    progress,
    wait_no_hangwatch,
    workload_argv,
)
from scripts.daemonproc import Samples, value
from scripts.fixturelib import Fixture

INTERVAL = 1.0
NOTHING = [{"name": "nothing", "cmdline": "^hangwatch-bench-matches-nothing$"}]
WATCH_WORKLOADS = [{"name": "bench", "cmdline": WORKLOAD_REGEX}]

PARTS = (
    "overhead",
    "resources",
    "ringbuf",
    "startup",
    "detection",
    "stacks",
    "reads",
    "schedclock",
    "maps",
    "scaling",
    "slowclients",
    "programs",
    "procio",
)
# Programs that return at once on the same tracepoints, no daemon: what the tracepoints
# themselves cost, the floor under any program attached there.
EMPTY = "empty programs"


@dataclass(frozen=True)
class Bench:
    key: str
    title: str
    ops: int
    quick_ops: int
    modes: tuple[str, ...]  # besides "none": "empty programs", "unwatched", "watched"
    strace_ops: int = 0  # > 0: also run under `strace -f`, with this many ops

    def argv(self, exe: Path, quick: bool, ops: int | None = None) -> list[str]:
        n = ops if ops is not None else (self.quick_ops if quick else self.ops)
        return workload_argv(exe, self.key, n)


BENCHES = (
    Bench(
        "futex-wait", "futex WAIT returning at once (EAGAIN)", 1_000_000, 20_000,
        (EMPTY, "unwatched", "watched"),
    ),
    Bench(
        "futex-wake", "futex WAKE, nobody waiting", 1_000_000, 20_000,
        (EMPTY, "unwatched", "watched"),
    ),
    Bench(
        "pingpong", "mutex+condvar ping-pong, per hand-off", 50_000, 2_000, (EMPTY, "watched"),
        strace_ops=5_000,
    ),
    Bench("mutex", "uncontended pthread mutex lock+unlock", 100_000_000, 1_000_000, ("watched",)),
    Bench("getppid", "getppid(2)", 3_000_000, 20_000, (EMPTY, "unwatched")),
    Bench("write", "write(2) of 1 byte to /dev/null", 1_000_000, 20_000,
          (EMPTY, "unwatched", "watched")),
    Bench("send", "send(2) of 1 byte on a unix socketpair, and its recv(2)", 1_000_000, 20_000,
          (EMPTY, "unwatched", "watched")),
    Bench("poll", "poll(2) of an empty pipe with a timeout of 0 (finds nothing)", 1_000_000,
          20_000, (EMPTY, "unwatched", "watched")),
    Bench("pread", "pread(2) of 64 bytes of a cached regular file", 1_000_000, 20_000,
          (EMPTY, "unwatched", "watched")),
    Bench("read-dev", "read(2) of 1 byte of /dev/zero (not a regular file)", 1_000_000, 20_000,
          (EMPTY, "unwatched", "watched")),
    Bench("answer", "send(2) of 1 byte on an accepted loopback TCP connection, and its recv(2)",
          1_000_000, 20_000, (EMPTY, "unwatched", "watched")),
    Bench("rename", "prctl(PR_SET_NAME), any process", 1_000_000, 20_000, ("unwatched",)),
    Bench("gil", "Python, 4 threads contending for the GIL, per step", 20_000_000, 200_000,
          ("watched",)),
)  # fmt: skip

# Upper bounds on the ratio to no agent, by (workload, mode).
RATIO_TARGETS = {
    ("futex-wait", "watched"): 1.8,
    ("futex-wait", "unwatched"): 1.6,
    ("pingpong", "watched"): 1.10,
    ("getppid", "unwatched"): 1.10,
    ("mutex", "watched"): 1.05,
}
RSS_TARGET_MB = 150.0  # watching 2,000 threads
IDLE_CPU_TARGET = 2.0  # % of one core
PARK_THREADS = 2000
FUTEX_RATE = 1_000_000


@dataclass
class Report:
    markdown: bool
    sections: list[str] = field(default_factory=list)

    def table(self, title: str, headers: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
        if self.markdown:
            lines = [f"### {title}", "", "| " + " | ".join(headers) + " |"]
            lines.append("| " + " | ".join("---" for _ in headers) + " |")
            lines += ["| " + " | ".join(r) + " |" for r in rows]
        else:
            widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
            # Text columns left-aligned, figures right-aligned.
            right = [i > 0 and all(_numeric(r[i]) for r in rows) for i in range(len(headers))]

            def fmt(cells: Sequence[str]) -> str:
                out = [c.rjust(w) if rt else c.ljust(w) for c, w, rt in zip(cells, widths, right)]
                return "  ".join(out).rstrip()

            lines = [title, fmt(headers), *(fmt(r) for r in rows)]
        self.sections.append("\n".join(lines))

    def note(self, text: str) -> None:
        self.sections.append(text)

    def print(self) -> None:
        print("\n\n".join(self.sections))


def _numeric(cell: str) -> bool:
    return cell == "" or cell[:1].isdigit()


def verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"


# --- overhead --------------------------------------------------------------------------------


@dataclass
class Overhead:
    results: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    tainted: int = 0  # no-agent runs during which someone else's hangwatch object was loaded
    baseline_runs: int = 0

    def add(self, key: str, mode: str, ns: float) -> None:
        self.results.setdefault((key, mode), []).append(ns)


def run_one(argv: list[str], daemon: Daemon | None = None) -> float:
    w = Workload(argv)
    try:
        if daemon is not None:
            daemon.wait_watching(w.pid)
        w.go()
        return float(w.finish().split()[-1])
    finally:
        w.kill()


def overhead(exe: Path, benches: Sequence[Bench], rounds: int, quick: bool) -> Overhead:
    res = Overhead()
    clean_wait = 5.0 if quick else 60.0
    from agent import preflight
    from agent.sources.probe import KernelProbes
    from bench.empty import EmptyPrograms

    preflight.check()
    with KernelProbes() as probes:
        tracepoints = probes.tracepoints()
    for r in range(rounds):
        progress(f"overhead round {r + 1}/{rounds}: no agent")
        if not wait_no_hangwatch(clean_wait):
            progress("a hangwatch BPF object of another process is still loaded; going on")
        for b in benches:
            before = hangwatch_objects()
            res.add(b.key, "none", run_one(b.argv(exe, quick)))
            if b.strace_ops:
                n = max(b.quick_ops // 4, 200) if quick else b.strace_ops
                res.add(b.key, "strace -f", run_one(["strace", "-f", "-qq", "-o", os.devnull,
                                                     *b.argv(exe, quick, n)]))  # fmt: skip
            res.baseline_runs += 1
            res.tainted += bool(before or hangwatch_objects())
        todo = [b for b in benches if EMPTY in b.modes]
        if todo:
            progress(f"overhead round {r + 1}/{rounds}: {EMPTY}")
            with EmptyPrograms(tracepoints) as _:
                for b in todo:
                    res.add(b.key, EMPTY, run_one(b.argv(exe, quick)))
        for mode, targets in (("unwatched", NOTHING), ("watched", WATCH_WORKLOADS)):
            todo = [b for b in benches if mode in b.modes]
            if not todo:
                continue
            progress(f"overhead round {r + 1}/{rounds}: {mode}")
            with Daemon(targets, INTERVAL) as d:
                d.wait_ready()
                for b in todo:
                    res.add(b.key, mode, run_one(b.argv(exe, quick), d if mode == "watched" else None))  # fmt: skip
    return res


def report_overhead(rep: Report, res: Overhead, benches: Sequence[Bench], rounds: int) -> None:
    rows = []
    for b in benches:
        base_runs = res.results.get((b.key, "none"), [])
        base = statistics.median(base_runs)
        modes = ["none", *(["strace -f"] if b.strace_ops else []), *b.modes]
        for mode in modes:
            med = statistics.median(res.results[(b.key, mode)])
            ratio = med / base
            target = RATIO_TARGETS.get((b.key, mode))
            rows.append([
                b.title, mode, f"{med:.1f}", f"{ratio:.2f}x",
                f"<= {target:.2f}x" if target else "", verdict(ratio <= target) if target else "",
            ])  # fmt: skip
    rep.table(
        f"Overhead per operation (median of {rounds} round(s); ratio to no agent)",
        ["workload", "mode", "ns/op", "ratio", "target", "result"],
        rows,
    )
    rep.note(
        f"no-agent runs while another process had a hangwatch BPF object loaded: "
        f"{res.tainted} of {res.baseline_runs}"
    )


# --- resources -------------------------------------------------------------------------------


@dataclass
class Usage:
    cpu_pct: float
    rss_mb: float
    hwm_mb: float


def measure(pid: int, period: float) -> Usage:
    c0, t0 = cpu_seconds(pid), time.monotonic()
    time.sleep(period)
    c1, t1 = cpu_seconds(pid), time.monotonic()
    mem = memory_kib(pid)
    return Usage(100 * (c1 - c0) / (t1 - t0), mem["VmRSS"] * 1024 / 1e6, mem["VmHWM"] * 1024 / 1e6)


def resources(rep: Report, exe: Path, quick: bool) -> None:
    period = 2.0 if quick else 20.0
    threads = 200 if quick else PARK_THREADS
    rows: list[tuple[str, Usage, str, bool | None]] = []
    with Daemon(WATCH_WORKLOADS, INTERVAL) as d:
        d.wait_ready()
        time.sleep(2 * INTERVAL)  # past start-up work
        progress(f"resources: daemon idle, {period:g} s")
        idle = measure(d.pid, period)
        rows.append(("idle (watching nothing)", idle, "CPU <= 2%", idle.cpu_pct <= IDLE_CPU_TARGET))

        progress(f"resources: watching ~{FUTEX_RATE:,} futex calls/s, {period:g} s")
        w = Workload(workload_argv(exe, "futex-rate", FUTEX_RATE, period + 2 * INTERVAL + 1))
        try:
            d.wait_watching(w.pid)
            w.go()
            time.sleep(INTERVAL)
            busy = measure(d.pid, period)
            rate = float(w.finish().split()[-1])
        finally:
            w.kill()
        rows.append((f"watching {rate:,.0f} futex calls/s", busy, "", None))

        progress(f"resources: watching {threads:,} parked threads, {period:g} s")
        w = Workload(workload_argv(exe, "park", threads))
        try:
            d.wait_watching(w.pid)
            w.go()
            w.readline()
            d.wait_for(
                lambda s: value(s, "hangwatch_process_threads", pid=str(w.pid)) == threads + 1,
                f"{threads} threads in /metrics",
                60,
            )
            parked = measure(d.pid, period)
        finally:
            w.kill()
        ok = parked.rss_mb <= RSS_TARGET_MB
        rows.append((f"watching {threads:,} parked threads", parked, "RSS <= 150 MB", ok))
    rep.table(
        f"The daemon's own cost (interval {INTERVAL:g} s; CPU over {period:g} s)",
        ["daemon", "CPU % of a core", "VmRSS MB", "VmHWM MB", "target", "result"],
        [
            [what, f"{u.cpu_pct:.2f}", f"{u.rss_mb:.1f}", f"{u.hwm_mb:.1f}", target,
             "" if ok is None else verdict(ok)]
            for what, u, target, ok in rows
        ],
    )  # fmt: skip


# --- the programs' own run time ----------------------------------------------------------------

# workload -> (watched, the programs it runs)
PROGRAM_PATHS = {
    "futex-wait": (True, ("sys_enter_futex", "sys_exit_futex")),
    "write": (True, ("sys_enter_write", "sys_exit_write")),
    "pread": (True, ("sys_enter_pread64", "sys_exit_pread64")),
    "read-dev": (True, ("sys_enter_read", "sys_exit_read")),
    "poll": (True, ("sys_exit_poll",)),
    # The same exit program on a unix socket (the fd walk stops at the family) and on an
    # accepted TCP connection (the walk to its port, the per-port count): the answer's cost.
    "send": (True, ("sys_enter_sendto", "sys_exit_sendto")),
    "answer": (True, ("sys_enter_sendto", "sys_exit_sendto")),
    "rename": (False, ("task_rename",)),
}


def programs(rep: Report, exe: Path, rounds: int, quick: bool) -> None:
    """ns per run of the programs each workload runs, from the kernel's run-time accounting
    (two clock reads a run, the same for every tree): what a change to a program costs, read
    apart from the tracepoint and from the load of a shared host."""
    from agent.sources.probe import KernelProbes

    runs: dict[tuple[str, str], list[float]] = {}
    with KernelProbes() as probes:
        restore = probes.enable_stats()
        if restore is None:
            raise RuntimeError("cannot turn on BPF run-time accounting")
        try:
            for r in range(rounds):
                progress(f"programs round {r + 1}/{rounds}")
                for key, (watched, progs) in PROGRAM_PATHS.items():
                    w = Workload(workload_argv(exe, key, 20_000 if quick else 1_000_000))
                    try:
                        probes.watch([w.pid] if watched else [])
                        before = probes.program_stats()
                        w.go()
                        w.finish()
                        after = probes.program_stats()
                    finally:
                        w.kill()
                    probes.read()  # empties what the run left (the changes map)
                    for prog in progs:
                        n = after[prog].run_count - before[prog].run_count
                        t = after[prog].run_seconds - before[prog].run_seconds
                        runs.setdefault((key, prog), []).append(t / n * 1e9 if n else 0.0)
        finally:
            restore()
            probes.watch([])
    rows = [
        [key, "watched" if PROGRAM_PATHS[key][0] else "any", prog, f"{statistics.median(v):.1f}"]
        for (key, prog), v in runs.items()
    ]
    rep.table(
        f"BPF programs' own run time (median of {rounds} round(s))",
        ["workload", "process", "program", "ns/run"],
        rows,
    )


# --- the storage counters' reads -------------------------------------------------------------


def procio(rep: Report, quick: bool) -> None:
    """What reading the storage counters costs a tick, per process: one /proc/PID/io read,
    parsed for wchar alone (before) and for wchar and read_bytes (now), and the
    /proc/PID/stat read the sampler makes anyway, now parsed for major faults too; the
    reads interleaved in rounds, so that a shared host's load falls on each alike."""
    from agent.sources.procfs import ProcFS

    proc = ProcFS()
    pid = os.getpid()
    reps = 2_000 if quick else 20_000
    reads: dict[str, Callable[[], object]] = {
        "getppid(2) (a floor)": os.getppid,
        "/proc/PID/io: wchar (before)": lambda: proc.io_wchar(pid),
        "/proc/PID/io: wchar + read_bytes": lambda: proc.io_counts(pid),
        "/proc/PID/stat, majflt parsed": lambda: proc.stat(pid),
    }
    runs: dict[str, list[float]] = {name: [] for name in reads}
    for _ in range(9):
        for name, fn in reads.items():
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            runs[name].append((time.perf_counter() - t0) / reps)
    floor = statistics.median(runs["getppid(2) (a floor)"])
    rows = [
        [name, f"{statistics.median(v) * 1e9:.0f}", f"{statistics.median(v) / floor:.2f}x"]
        for name, v in runs.items()
    ]
    rep.table(
        f"Storage counters per process and tick (median of 9 interleaved runs of {reps:,} calls)",
        ["read", "ns/call", "ratio to getppid"],
        rows,
    )


# --- ring buffer -----------------------------------------------------------------------------


def dropped(d: Daemon) -> float:
    # Wait for a tick that read the counters after the load: two intervals is always enough.
    time.sleep(2 * INTERVAL + 0.2)
    # Binds and listens have their own ring buffer (the futex events of watched processes the other).
    name = "hangwatch_bpf_host_events_dropped_total"
    s = d.wait_for(lambda s: value(s, name) is not None, "", 10)
    return value(s, name) or 0.0


def ringbuf(rep: Report, exe: Path, quick: bool) -> None:
    # Events per second: each bind+listen pair sends two. A doubling ladder up to the first
    # rate with drops, then (full runs) a few bisection steps between the last two rates.
    ladder = [2_000, 50_000] if quick else [1_000 * 2**i for i in range(8)]
    refine = 0 if quick else 3
    secs = 1.5 if quick else 5.0
    rows: list[list[str]] = []
    best: int | None = None
    bad: int | None = None
    with Daemon(NOTHING, INTERVAL) as d:
        d.wait_ready()
        base = dropped(d)

        def step(rate: int) -> bool:
            nonlocal base
            progress(f"ringbuf: {rate:,} bind+listen events/s for {secs:g} s")
            w = Workload(workload_argv(exe, "bind-listen", rate // 2, secs))
            try:
                w.go()
                got = 2 * float(w.finish().split()[-1])
            finally:
                w.kill()
            now = dropped(d)
            lost, base = now - base, now
            rows.append([f"{rate:,}", f"{got:,.0f}", f"{lost:.0f}"])
            return lost == 0

        for rate in ladder:
            if not step(rate):
                bad = rate
                break
            best = rate
        for _ in range(refine if best is not None and bad is not None else 0):
            assert best is not None and bad is not None
            mid = round((best * bad) ** 0.5, -2)
            if not best < mid < bad:
                break
            if step(int(mid)):
                best = int(mid)
            else:
                bad = int(mid)
    rows.sort(key=lambda r: int(r[0].replace(",", "")))
    rep.table(
        f"Ring buffer: bind+listen events, {secs:g} s per step (interval {INTERVAL:g} s)",
        ["asked events/s", "achieved events/s", "dropped"],
        rows,
    )
    if best is None:
        summary = f"highest sustained rate with 0 drops: below {ladder[0]:,} events/s"
    else:
        summary = f"highest sustained rate with 0 drops: {best:,} events/s"
        if bad is None:
            summary += " (no drops at any rate tried)"
        else:
            summary += f" (drops at {bad:,} events/s)"
    rep.note(summary)


# --- startup and detection -------------------------------------------------------------------


def startup(rep: Report, quick: bool) -> None:
    times = []
    for i in range(1 if quick else 3):
        progress(f"startup {i + 1}")
        wait_no_hangwatch(5)
        with Daemon(NOTHING, INTERVAL) as d:
            times.append(d.wait_ready())
    rep.table(
        "Startup: exec of `hangwatch run` to the first /metrics scrape with its results",
        ["runs", "median s", "max s"],
        [[str(len(times)), f"{statistics.median(times):.2f}", f"{max(times):.2f}"]],
    )


def deadlocked(pid: int) -> Callable[[Samples], bool]:
    def check(s: Samples) -> bool:
        return value(s, "hangwatch_service_state", pid=str(pid), state="deadlocked") == 1

    return check


def detection(rep: Report, quick: bool) -> None:
    reps = 1 if quick else 5
    lat = []
    target = INTERVAL + 1.0
    with Daemon([{"name": "deadlock", "cmdline": "fixtures/build/deadlock_mutex"}], INTERVAL) as d:
        d.wait_ready()
        for i in range(reps):
            progress(f"detection {i + 1}/{reps}")
            # Start at a random point of the tick: right after a detection (or the first
            # tick) every run would otherwise start just after a tick, the worst case.
            time.sleep(random.uniform(0, INTERVAL))
            with Fixture.c("deadlock_mutex") as fx:
                formed = time.monotonic()  # READY: both threads blocked on the other's mutex
                d.wait_for(deadlocked(fx.pid), "deadlocked", 30)
                lat.append(time.monotonic() - formed)
    rep.table(
        f"Deadlock detection latency: cycle formed to /metrics saying deadlocked ({reps} runs)",
        ["interval s", "median s", "max s", "target", "result"],
        [[f"{INTERVAL:g}", f"{statistics.median(lat):.2f}", f"{max(lat):.2f}",
          f"max <= {target:g} s", verdict(max(lat) <= target)]],
    )  # fmt: skip


# --- stacks ----------------------------------------------------------------------------------


def stacks(rep: Report, quick: bool) -> None:
    """What a flight record costs, per process: read only at a change to stalled or
    deadlocked and in diagnose, so a healthy host pays nothing for it."""
    from agent.observe.sampler import Sampler
    from agent.sources.procfs import ProcFS
    from agent.sources.pystacks import SourceLines, read_stacks

    reps = 3 if quick else 15
    proc = ProcFS()
    rows = []
    for n in (100,) if quick else (100, 2000):
        with Fixture.py("py_pool", str(n), timeout=90) as fx:
            progress(f"stacks: {n} parked threads, {reps} reads")
            sampler = Sampler()
            base, bare, read = [], [], []
            for _ in range(reps):
                t0 = time.perf_counter()
                sampler.snapshot([fx.pid])
                base.append(time.perf_counter() - t0)
                # Without source lines: what the child that reads them as the target costs.
                t0 = time.perf_counter()
                read_stacks(fx.pid, proc, source=None)
                bare.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                got = read_stacks(fx.pid, proc, source=SourceLines(proc))
                read.append(time.perf_counter() - t0)
                if got is None or got.error is not None or len(got.threads) < n:
                    raise SystemExit(f"bench: stacks of {n} threads not read: {got}")
                if not any(f.code for t in got.threads.values() for f in t.frames):
                    raise SystemExit(f"bench: stacks of {n} threads read without a source line")
        b, s, r = (statistics.median(x) for x in (base, bare, read))
        rows.append(
            [f"{n:,} threads", f"{b * 1e3:.1f}", f"{s * 1e3:.1f}", f"{r * 1e3:.1f}", f"{r / b:.2f}"]
        )
    rep.table(
        f"Python stacks of one process (py-spy --nonblocking, median of {reps}), against one "
        "/proc sample of it",
        ["parked pool", "/proc sample ms", "stacks, no lines ms", "stacks ms", "ratio"],
        rows,
    )


# --- reads on a target's behalf --------------------------------------------------------------

PARSE_SYMBOLS = r"""
import os, sys, time
from agent.sources import symbols
def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) << 10
fd = os.open(sys.argv[1], os.O_RDONLY)
before = hwm()
t0 = time.perf_counter()
elf = symbols._parse(fd)
took = time.perf_counter() - t0
print(took, hwm() - before, len(elf.symbols) if elf else -1)
"""


def reads(rep: Report, exe: Path, quick: bool) -> None:
    """What the bounds on the reads made on a target's behalf cost: its identity fixed (once
    a stack read or a symbol lookup) and checked (after each read that depends on it), and a
    symbol table parsed into arrays, up to the cap (time and peak memory, in a process of
    its own so that nothing else is counted)."""
    import subprocess
    import tempfile

    from agent.sources import confined
    from scripts.elfbomb import symbol_bomb

    reps = 200 if quick else 2000
    target = subprocess.Popen(["sleep", "600"])
    try:
        progress(f"reads: {reps} identities taken and checked")
        take, check = [], []
        for _ in range(reps):
            t0 = time.perf_counter()
            t = confined.Target.take(target.pid)
            take.append(time.perf_counter() - t0)
            assert isinstance(t, confined.Target), t
            with t:
                t0 = time.perf_counter()
                why = t.changed()
                check.append(time.perf_counter() - t0)
                assert why is None, why
    finally:
        target.kill()
        target.wait()
    tk, ck = statistics.median(take) * 1e6, statistics.median(check) * 1e6
    rep.table(
        f"A target's identity (median of {reps}): taken once a read, checked after each "
        "read that depends on it (a stack read: one take, two checks)",
        ["take us", "check us", "a stack read's us"],
        [[f"{tk:.0f}", f"{ck:.0f}", f"{tk + 2 * ck:.0f}"]],
    )
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for count in (100_000,) if quick else (100_000, 1_000_000, 2_000_000):
            progress(f"reads: a symbol table of {count:,} symbols")
            bomb = Path(tmp) / f"bomb-{count}"
            symbol_bomb(exe, bomb, count)
            out = subprocess.run(
                [sys.executable, "-c", PARSE_SYMBOLS, str(bomb)],
                capture_output=True,
                text=True,
                check=True,
                cwd=Path(__file__).resolve().parent.parent,
            ).stdout.split()
            took, grew, kept = float(out[0]), int(out[1]), int(out[2])
            rows.append(
                [f"{count:,}", f"{bomb.stat().st_size >> 20}", f"{kept:,}",
                 f"{took:.2f}", f"{grew / (1 << 20):.0f}"]
            )  # fmt: skip
    rep.table(
        "A symbol table parsed (one object; the cap is 48 MiB of table, 2M 64-bit symbols)",
        ["symbols", "file MiB", "kept", "parse s", "peak growth MiB"],
        rows,
    )


# --- schedclock ------------------------------------------------------------------------------


def schedclock(rep: Report, quick: bool) -> None:
    """What dating se.exec_start by each CPU's own clock costs: a first sample of a parked
    pool (every thread's exec_start read, as diagnose and a new service get), its CPUs'
    offsets each read by running there, against the same sample with the agent's own CPU's
    offset for all (no CPU visited)."""
    from agent.observe.sampler import Sampler
    from agent.sources.procfs import ProcFS
    from agent.sources.schedclock import SchedClock

    reps = 5 if quick else 25
    proc = ProcFS()
    with Fixture.py("py_pool", "200", timeout=90) as fx:
        progress(f"schedclock: first samples of 200 parked threads, {reps} of each")
        base, per_cpu, visits = [], [], []
        for _ in range(reps):
            plain = Sampler(proc)
            plain.sched_clock = SchedClock(proc, get_affinity=lambda _pid: ())
            t0 = time.perf_counter()
            plain.snapshot([fx.pid])
            base.append(time.perf_counter() - t0)
            sampler = Sampler(proc)
            t0 = time.perf_counter()
            sampler.snapshot([fx.pid])
            per_cpu.append(time.perf_counter() - t0)
            visits.append(sampler.sched_clock.reads)
    b, p, n = statistics.median(base), statistics.median(per_cpu), statistics.median(visits)
    each = f"{(p - b) / n * 1e6:.0f}" if n else ""
    rep.table(
        f"Dating se.exec_start per CPU (median of {reps} first samples of 200 parked threads)",
        ["one offset ms", "per-CPU offsets ms", "CPUs visited", "us per CPU", "ratio"],
        [[f"{b * 1e3:.2f}", f"{p * 1e3:.2f}", f"{n:g}", each, f"{p / b:.3f}"]],
    )


# --- slow /metrics clients -------------------------------------------------------------------


SLOW_CLIENTS = 140  # past the unit's TasksMax (128), as in the attack test


def _scrape_ms(port: int, seconds: float) -> list[float]:
    """Latencies (ms) of back-to-back scrapes of /metrics for ``seconds``, by a client that
    sends its request at once; a scrape that fails ends the bench."""
    out = []
    url = f"http://127.0.0.1:{port}/metrics"
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.perf_counter()
        with urllib.request.urlopen(url, timeout=30) as r:
            r.read()
        out.append((time.perf_counter() - t0) * 1e3)
        time.sleep(0.02)
    return out


def _threads_and_fds(pid: int) -> tuple[int, int]:
    status = Path(f"/proc/{pid}/status").read_text()
    threads = int(next(ln.split()[1] for ln in status.splitlines() if ln.startswith("Threads:")))
    return threads, len(os.listdir(f"/proc/{pid}/fd"))


def slowclients_part(rep: Report, quick: bool) -> None:
    """What slow clients cost a scraper: back-to-back scrapes alone, then while 140 clients
    trickle a byte every 2 s (dropped at their deadline, they open again), over 12 s so that
    the deadline's drops and reconnects fall inside."""
    from scripts import slowclients

    seconds = 3.0 if quick else 12.0
    rows = []
    with Daemon(NOTHING, INTERVAL) as d:
        d.wait_ready()
        progress("slowclients: alone")
        alone = _scrape_ms(d.port, seconds)
        rows.append(["alone", *_latency_cells(alone), *map(str, _threads_and_fds(d.pid))])
        with Fixture(slowclients.argv(d.port, SLOW_CLIENTS, 2.0), timeout=30):
            progress(f"slowclients: {SLOW_CLIENTS} slow clients")
            held = _scrape_ms(d.port, seconds)
            counts = _threads_and_fds(d.pid)
            s = d.scrape() or {}
        dropped = value(s, "hangwatch_http_connections_dropped_total", reason="deadline")
        rows.append([f"{SLOW_CLIENTS} slow clients", *_latency_cells(held), *map(str, counts)])
    rep.table(
        f"/metrics scrapes back to back for {seconds:g} s: alone, and while {SLOW_CLIENTS} slow "
        f"clients hold connections ({dropped or 0:g} dropped at their deadline meanwhile)",
        ["clients", "scrapes", "median ms", "p99 ms", "max ms", "daemon threads", "daemon fds"],
        rows,
    )


# --- maps ------------------------------------------------------------------------------------


def _wait_addresses(pid: int) -> set[int]:
    """What the sampler asks the maps about: each blocked thread's stack pointer and the
    first argument of its syscall (a futex word, for a futex wait)."""
    from agent.sources.procfs import ProcFS

    proc = ProcFS()
    out = set()
    for tid in proc.tids(pid):
        sc = proc.thread_syscall(pid, tid)
        if sc is not None and sc.sp:
            out.add(sc.sp)
            if sc.args:
                out.add(sc.args[0])
    return out


def _whole_file(pid: int, addrs: set[int]) -> int:
    """The sampler's read before: the whole file in one string, every line parsed."""
    import bisect

    from agent.sources.procfs import parse_maps_line

    with open(f"/proc/{pid}/maps", errors="replace") as f:
        text = f.read()
    maps = sorted((m for m in map(parse_maps_line, text.splitlines()) if m), key=lambda m: m.start)
    starts = [m.start for m in maps]
    return sum(
        1 for a in addrs if (i := bisect.bisect_right(starts, a) - 1) >= 0 and a < maps[i].end
    )


def _timed_and_peak(fn: Callable[[], object], reps: int) -> tuple[float, float]:
    """Median seconds of ``reps`` calls, and the peak of Python memory one call allocates (MiB)."""
    import tracemalloc

    took = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        took.append(time.perf_counter() - t0)
    tracemalloc.start()
    try:
        fn()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return statistics.median(took), peak / (1 << 20)


def _maps_rows(name: str, pid: int, reps: int) -> list[list[str]]:
    from agent.sources.procfs import ProcFS

    addrs = _wait_addresses(pid)
    deadline = time.monotonic() + 10
    while not addrs and time.monotonic() < deadline:  # READY is printed before its first wait
        time.sleep(0.1)
        addrs = _wait_addresses(pid)
    with open(f"/proc/{pid}/maps", "rb") as f:
        lines = sum(1 for _ in f)
    streamed = ProcFS()
    streamed._procmap_query = False  # as on a kernel before 6.11
    progress(f"maps: {name}, {lines} mappings, {len(addrs)} addresses, {reps} reps")
    ways = (
        ("whole file (before)", lambda: _whole_file(pid, addrs)),
        ("streamed, capped", lambda: streamed.mappings_at(pid, addrs)),
        ("PROCMAP_QUERY", lambda: ProcFS().mappings_at(pid, addrs)),
    )
    rows = []
    for way, fn in ways:
        took, peak = _timed_and_peak(fn, reps)
        rows.append([name, f"{lines}", f"{len(addrs)}", way, f"{took * 1e3:.2f}", f"{peak:.1f}"])
    return rows


def maps(rep: Report, quick: bool) -> None:
    """What placing waits in the maps costs, three ways, for a pool of 200 parked threads
    and for a target whose maps are 62,000 lines of a 4,000-character path."""
    import tempfile

    rows = []
    with Fixture.py("py_pool", "200", timeout=90) as fx:
        rows += _maps_rows("pool of 200 threads", fx.pid, 5 if quick else 25)
    with (
        tempfile.TemporaryDirectory(prefix="hangwatch-bench-maps-") as d,
        Fixture.py("huge_maps", d, timeout=90) as fx,
    ):
        rows += _maps_rows("62,000 mappings", fx.pid, 1 if quick else 3)
    rep.table(
        "Placing waits in the memory maps (median; peak Python memory of one read)",
        ["target", "mappings", "addresses", "read", "ms", "peak MiB"],
        rows,
    )


def _latency_cells(ms: Sequence[float]) -> list[str]:
    ordered = sorted(ms)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return [str(len(ms)), f"{statistics.median(ms):.2f}", f"{p99:.2f}", f"{max(ms):.2f}"]


# --- main ------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="few calls, 1 round, short periods")
    ap.add_argument("--markdown", action="store_true", help="print the tables as markdown")
    names = [*PARTS, *(b.key for b in BENCHES)]
    ap.add_argument(
        "--only", metavar="NAME[,NAME...]", help=", ".join(names) + "; several: one run"
    )
    ap.add_argument("--rounds", type=int, help="overhead rounds (default 5, 1 with --quick)")
    ap.add_argument(
        "--bpf-stats",
        action="store_true",
        help="run the daemons with bpf_stats: true (the kernel's BPF run-time accounting),\n"
        "to measure what that accounting costs",
    )
    args = ap.parse_args(argv)
    only = set(args.only.split(",")) if args.only else None
    if only is not None and not only <= set(names):
        ap.error(f"--only: unknown {', '.join(sorted(only - set(names)))}")
    if args.bpf_stats:
        DAEMON_CONFIG.append("bpf_stats: true")
    if os.geteuid() != 0:
        print("bench: needs root (BPF, /proc of other processes)", file=sys.stderr)
        return 3
    rounds = args.rounds or (1 if args.quick else 5)
    benches = [b for b in BENCHES if only is None or only & {"overhead", b.key}]
    parts = [p for p in PARTS if only is None or p in only] or ["overhead"]
    exe = build_workloads()
    rep = Report(args.markdown)
    rep.note(
        f"hangwatch bench{' --quick' if args.quick else ''}"
        f"{' --bpf-stats' if args.bpf_stats else ''}: {platform.node()}, "
        f"{os.cpu_count()} CPUs, Linux {platform.release()}, {time.strftime('%Y-%m-%d %H:%M')}"
    )
    steps: dict[str, Callable[[], None]] = {
        "overhead": lambda: report_overhead(
            rep, overhead(exe, benches, rounds, args.quick), benches, rounds
        ),
        "resources": lambda: resources(rep, exe, args.quick),
        "ringbuf": lambda: ringbuf(rep, exe, args.quick),
        "startup": lambda: startup(rep, args.quick),
        "detection": lambda: detection(rep, args.quick),
        "stacks": lambda: stacks(rep, args.quick),
        "reads": lambda: reads(rep, exe, args.quick),
        "schedclock": lambda: schedclock(rep, args.quick),
        "slowclients": lambda: slowclients_part(rep, args.quick),
        "maps": lambda: maps(rep, args.quick),
        "programs": lambda: programs(rep, exe, rounds, args.quick),
        "procio": lambda: procio(rep, args.quick),
        "scaling": lambda: rep.table(
            *scaling.table(*scaling.run(exe, args.quick, WATCH_WORKLOADS))
        ),
    }
    for part in parts:
        steps[part]()
    rep.print()
    return 0
