"""Soak: the daemon under process churn for N minutes, its RSS, CPU and fds sampled over time.

    sudo .venv/bin/python -m scripts.soak [--minutes 30] [--sample-seconds 10]

Starts `hangwatch run` watching two cmdline targets, then keeps short-lived processes coming:
deadlocks (deadlock_mutex), parked pools (condvar_pool), processes that exit by themselves
(exits_soon) and a shell that forks and execs in a loop, each living a few seconds; half are
started from a directory the targets select (watched), half from one they do not (unwatched).
Every ~10 s it samples the daemon's RSS, CPU % (since the last sample) and open fds, and
scrapes /metrics. At the end it prints the table, a start / max / end summary, and exits 1 if
the daemon died, a scrape failed, or RSS or fds grew without bound: the end value above 1.5 x
the value at 5 minutes (a third of the run, for runs under 15 minutes). Not part of `make test`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from scripts.daemonproc import DaemonError, DaemonProcess, free_port
from scripts.fixturelib import build

CONFIG = """
listen: "127.0.0.1:{port}"
interval_seconds: 1
park_threshold_seconds: 2
targets:
  - name: soak-deadlock
    cmdline: "soak-watched/deadlock_mutex"
  - name: soak-other
    cmdline: "soak-watched/(condvar_pool|exits_soon|forker)"
"""
CLK_TCK = os.sysconf("SC_CLK_TCK")
CONCURRENT = 12  # processes alive at once, watched and unwatched together
FDS_SLACK = 8  # scrape connections come and go: a few fds are noise, not growth


@dataclass
class Sample:
    t: float
    rss_kib: int
    cpu_pct: float
    fds: int
    services: int  # services in /metrics; -1: the scrape failed
    deadlocks_logged: int


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return int(fields[11]) + int(fields[12])


def scrape_services(daemon: DaemonProcess) -> int:
    """How many services /metrics names (one state of each is 1); -1 if the scrape failed."""
    samples = daemon.scrape(timeout=10)
    if samples is None:
        return -1
    return sum(1 for (n, _), v in samples.items() if n == "hangwatch_service_state" and v == 1)


class Churn:
    """Keeps CONCURRENT short-lived processes alive, each killed (with its group) when due."""

    def __init__(self, work: Path) -> None:
        self.live: list[tuple[float, subprocess.Popen[bytes]]] = []
        self.started = 0
        self.dirs = {}
        for side in ("soak-watched", "soak-unwatched"):
            d = work / side
            d.mkdir()
            for name in ("deadlock_mutex", "condvar_pool", "exits_soon"):
                shutil.copy(build(name), d / name)
            forker = d / "forker"
            forker.write_text("#!/bin/sh\nwhile :; do /bin/true; sleep 0.1; done\n")
            forker.chmod(0o755)
            self.dirs[side] = d

    def _start(self) -> None:
        side = random.choice(list(self.dirs))
        kind = random.choice(
            ["deadlock_mutex", "deadlock_mutex", "condvar_pool", "exits_soon", "forker"]
        )
        argv = [str(self.dirs[side] / kind)]
        if kind == "condvar_pool":
            argv.append(str(random.randint(1, 32)))
        elif kind == "exits_soon":
            argv.append(str(random.randint(1, 4)))
        p = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True
        )
        self.live.append((time.monotonic() + random.uniform(2, 8), p))
        self.started += 1

    def step(self) -> None:
        now = time.monotonic()
        keep = []
        for due, p in self.live:
            if p.poll() is not None:
                continue
            if now >= due:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
                continue
            keep.append((due, p))
        self.live = keep
        while len(self.live) < CONCURRENT:
            self._start()

    def stop(self) -> None:
        for _, p in self.live:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        self.live = []


def summary(name: str, values: list[float], unit: str) -> str:
    return f"{name:>8}: start {values[0]:.1f} {unit}, max {max(values):.1f}, end {values[-1]:.1f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=30)
    ap.add_argument("--sample-seconds", type=float, default=10)
    args = ap.parse_args()
    duration = args.minutes * 60
    baseline_at = 300.0 if duration >= 900 else duration / 3

    work = Path(tempfile.mkdtemp(prefix="hangwatch-soak-"))
    port = free_port()
    cfg = work / "soak.yaml"
    cfg.write_text(CONFIG.format(port=port))
    churn = Churn(work)
    daemon = DaemonProcess(cfg, port, log=work / "daemon.log")
    print(f"soak: {args.minutes:g} min, daemon pid {daemon.pid} on :{port}, log {daemon.log}")
    try:
        daemon.first_tick(timeout=120, poll=1)  # /metrics answers first; the probes compile
    except DaemonError as e:
        daemon.stop()
        print(f"{e}\n{daemon.output()}")
        return 1

    samples: list[Sample] = []
    failures: list[str] = []
    t0 = time.monotonic()
    last_ticks, last_t = cpu_ticks(daemon.pid), t0
    next_sample = t0
    print(f"{'t (s)':>7} {'RSS MiB':>8} {'CPU %':>6} {'fds':>4} {'svcs':>5} {'deadlocks':>9}")
    try:
        while True:
            now = time.monotonic()
            if not daemon.running():
                failures.append(f"the daemon exited with {daemon.proc.returncode}")
                break
            churn.step()
            if now >= next_sample:
                ticks = cpu_ticks(daemon.pid)
                cpu = 100.0 * (ticks - last_ticks) / CLK_TCK / max(now - last_t, 1e-9)
                last_ticks, last_t = ticks, now
                s = Sample(
                    t=now - t0,
                    rss_kib=rss_kib(daemon.pid),
                    cpu_pct=cpu,
                    fds=len(os.listdir(f"/proc/{daemon.pid}/fd")),
                    services=scrape_services(daemon),
                    deadlocks_logged=daemon.output().count("-> deadlocked"),
                )
                samples.append(s)
                if s.services < 0:
                    failures.append(f"a scrape failed at t={s.t:.0f} s")
                print(
                    f"{s.t:7.0f} {s.rss_kib / 1024:8.1f} {s.cpu_pct:6.1f} {s.fds:4d} "
                    f"{s.services:5d} {s.deadlocks_logged:9d}",
                    flush=True,
                )
                next_sample += args.sample_seconds
                if now - t0 >= duration:
                    break
            time.sleep(0.2)
    finally:
        churn.stop()
        rc = daemon.stop(timeout=60)
    if rc != 0:
        failures.append(f"the daemon exited {rc} on SIGTERM")
    if len(samples) < 3:
        failures.append("too few samples")
    else:
        base = next((s for s in samples if s.t >= baseline_at), samples[-1])
        end = samples[-1]
        print(f"\nprocesses started: {churn.started}; deadlocks logged: {end.deadlocks_logged}")
        print(summary("RSS", [s.rss_kib / 1024 for s in samples], "MiB"))
        print(summary("CPU", [s.cpu_pct for s in samples], "%"))
        print(summary("fds", [float(s.fds) for s in samples], ""))
        print(f"baseline at t={base.t:.0f} s: RSS {base.rss_kib / 1024:.1f} MiB, {base.fds} fds")
        if end.rss_kib > 1.5 * base.rss_kib:
            failures.append(f"RSS grew: {base.rss_kib} KiB at {base.t:.0f} s, {end.rss_kib} at end")
        if end.fds > 1.5 * base.fds and end.fds - base.fds > FDS_SLACK:
            failures.append(f"fds grew: {base.fds} at {base.t:.0f} s, {end.fds} at end")
    errors = [ln for ln in daemon.output().splitlines() if " ERROR " in ln]
    if errors:
        failures.append(f"{len(errors)} ERROR lines in the log, first: {errors[0]}")
    for f in failures:
        print(f"FAIL: {f}")
    print("soak: " + ("FAILED" if failures else "passed"))
    if failures:
        print(f"kept for a look: {work}")
        return 1
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
