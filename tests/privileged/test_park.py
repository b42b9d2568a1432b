"""Park times of a real process whose threads wake on timers or get stopped by a debugger.

A thread counts as working only when it used CPU above the floor in the window, never
because one read caught it running: a 10 ms timer loop (gloo's tcp_loop) is sometimes read in
state R, and a debugger or ``py-spy dump`` stopping the process makes every thread run for a
moment. Neither may reset how long it has been parked.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from agent.observe.observer import park_settings
from agent.settings import DIAGNOSE_INTERVAL_S, Settings
from scripts.fixturelib import Fixture, tasks, thread_state
from tests.privileged.harness import DIAGNOSE_LIMIT_S, Diagnosis, RunningDiagnose

ATTACH_TIMEOUT_S = DIAGNOSE_LIMIT_S  # BPF compile and load included: see the harness
PARK = park_settings(Settings())  # the floor diagnose judges work by

# Stops every thread of a process with ptrace (as gdb or py-spy would), holds it, lets go.
# Run in its own process: a tracer's children report ptrace stops to every waiter in the
# tracer's process, and the fixture's reaper thread waits on the fixture.
PTRACE_STOP = r"""
import ctypes, os, sys, time
PTRACE_SEIZE, PTRACE_INTERRUPT, PTRACE_DETACH, WALL = 0x4206, 0x4207, 17, 0x40000000
libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.restype = ctypes.c_long
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
pid, hold = int(sys.argv[1]), float(sys.argv[2])
tids = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))
def call(req, tid):
    if libc.ptrace(req, tid, None, None) != 0:
        err = ctypes.get_errno()
        sys.exit(f"ptrace({req:#x}, {tid}): {os.strerror(err)}")
for tid in tids:
    call(PTRACE_SEIZE, tid)
for tid in tids:
    call(PTRACE_INTERRUPT, tid)
    os.waitpid(tid, WALL)
print("STOPPED", flush=True)
time.sleep(hold)
for tid in tids:
    call(PTRACE_DETACH, tid)
print("DETACHED", flush=True)
"""


class CpuWatch:
    """Samples the CPU time (schedstat) of a process's threads every 50 ms in the
    background, to tell whether the machine kept the fixture's promise: its timer threads
    use well under the CPU floor in every read. A loaded VM now and then charges a
    sleeping timer thread several ms at once; a read that sees that counts it as work."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.series: dict[int, list[tuple[float, int]]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-watch", daemon=True)

    def __enter__(self) -> CpuWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            now = time.monotonic()
            for tid in tasks(self.pid):
                try:
                    with open(f"/proc/{self.pid}/task/{tid}/schedstat") as f:
                        cpu = int(f.read().split()[0])
                except (OSError, ValueError, IndexError):
                    continue
                self.series.setdefault(tid, []).append((now, cpu))

    def most_in(self, span_s: float) -> int:
        """The most CPU (ns) any thread used within about ``span_s`` (over, never under)."""
        most = 0
        for points in self.series.values():
            j = 0
            for i, (t, cpu) in enumerate(points):
                j = max(j, i)
                while j + 1 < len(points) and points[j][0] - t < span_s:
                    j += 1
                most = max(most, points[j][1] - cpu)
        return most


def observe(run: Callable[[], Diagnosis], pid: int) -> tuple[Diagnosis, dict[str, Any], str]:
    """Run ``diagnose`` and return the fixture's process entry and a note on the fixture's
    CPU use. A run whose every thread did not stay parked is tried again (3 runs at most)
    only where a thread used more than the floor within one read: the test's premise was
    broken by the machine, not by the tool."""
    floor = max(PARK.cpu_floor_min_ns, int(DIAGNOSE_INTERVAL_S * 1e9 * PARK.cpu_floor_ratio))
    for _ in range(3):
        with CpuWatch(pid) as cpu:
            d = run()
        svc = d.service(pid)
        proc = d.process(svc, pid)
        most = cpu.most_in(DIAGNOSE_INTERVAL_S)
        note = (
            f"the fixture's busiest thread used {most / 1e6:.1f} ms of CPU within one "
            f"{DIAGNOSE_INTERVAL_S:g} s read (the floor is {floor / 1e6:.1f} ms)"
        )
        if proc.get("parked_threads") == proc.get("threads") or most <= floor:
            break
    assert proc.get("threads") == 3, d.explain("want the fixture's 3 threads")
    assert proc.get("parked_threads") == 3, d.explain(
        f"want every thread parked: a timer wake-up caught in state R is not work; {note}"
    )
    assert svc.get("state") == "stalled", d.explain("want stalled: parked past the threshold")
    return d, proc, note


def test_timer_wakeups_are_parked_and_their_park_time_grows(
    diagnose: Callable[..., Diagnosis],
) -> None:
    with Fixture.c("timer_wakeups") as fx:
        d, proc, note = observe(lambda: diagnose(fx.pid, threshold=1, duration=3), fx.pid)
    # At least the 3 s from the first read to the last (more where the first read's
    # estimate reaches back): a reset at any later read would leave less than 2.75 s.
    assert proc["parked_seconds"] > 2.75, d.explain(
        f"want parked_seconds > 2.75: parked since the first read, 3 s before the last; {note}"
    )


def test_a_ptrace_stop_does_not_reset_the_park_time(
    start_diagnose: Callable[..., RunningDiagnose],
) -> None:
    with Fixture.c("timer_wakeups") as fx:

        def run() -> Diagnosis:
            running = start_diagnose(fx.pid, threshold=1, duration=5)
            running.wait_stderr(r"\battached\b", timeout=ATTACH_TIMEOUT_S)
            time.sleep(1)
            stop_with_ptrace(fx.pid, hold_s=1.5)
            return running.finish()

        d, proc, note = observe(run, fx.pid)
    assert proc["parked_seconds"] > 4.75, d.explain(
        "want parked_seconds > 4.75: parked since the first read, 5 s before the last, "
        f"through a 1.5 s ptrace stop; {note}"
    )


def stop_with_ptrace(pid: int, hold_s: float) -> None:
    """Stop every thread of ``pid`` for ``hold_s`` (checked: all in state t), then go on."""
    stopper = subprocess.Popen(
        [sys.executable, "-c", PTRACE_STOP, str(pid), str(hold_s)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert stopper.stdout is not None
        line = stopper.stdout.readline().strip()
        states = {tid: thread_state(pid, tid) for tid in tasks(pid)}
        out, err = stopper.communicate(timeout=30)
    finally:
        if stopper.poll() is None:
            stopper.kill()
            stopper.wait()
    assert line == "STOPPED" and stopper.returncode == 0, f"ptrace helper: {line} {out} {err}"
    assert set(states.values()) == {"t"}, f"want every thread in tracing stop: {states}"
