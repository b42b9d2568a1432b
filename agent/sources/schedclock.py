"""Each CPU's scheduler clock against CLOCK_MONOTONIC, so that a thread's se.exec_start (when
it last ran) can be dated: SchedClock, for agent.observe.threads.

se.exec_start is on the task clock of the CPU the thread ran on, which leaves out the steal
(and interrupt) time that CPU lost, and CPUs lose different amounts: one offset for all would
date a wait on another CPU seconds wrong. The only exact reading user space has is to run on
that CPU for a moment and read its own exec_start, "now" on that clock (docs/how-it-works.md,
"Progress and park time").
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Collection

from .procfs import ProcFS

# How long a CPU's offset is used before it is read again. It grows by the time the CPU
# loses, so a thread that ran after the read can be dated up to that much early (at 10%
# steal, 0.5 s). One read is a migration and a /proc read, most of it waiting to run there
# (docs/performance.md, `--only schedclock`), up to a time slice where the CPU is busy.
REFRESH_NS = 5_000_000_000
# Stale offsets read again per snapshot, at most (a CPU never read is read at once): what a
# tick can wait on a host whose 200 busy CPUs all have blocked threads to date. The others
# keep their stale offset till a later tick.
REFRESH_PER_SNAPSHOT = 16


class SchedClock:
    """Moves a CPU's task-clock time (se.exec_start, ms) to CLOCK_MONOTONIC (ns).

    ``begin`` once per snapshot reads the calling thread's own offset (the fallback, for a CPU
    outside the agent's affinity or one the kernel refuses); ``to_monotonic`` reads a CPU's own
    offset when it has none fresh (REFRESH_*), moving the calling thread there; ``end`` puts the thread
    back on the CPUs it was created on. Only those are visited: an operator who confined the
    agent (systemd CPUAffinity=, a cpuset) keeps it there.
    """

    def __init__(
        self,
        proc: ProcFS,
        clock_ns: Callable[[], int] = time.monotonic_ns,
        get_affinity: Callable[[int], Collection[int]] = os.sched_getaffinity,
        set_affinity: Callable[[int, Collection[int]], None] = os.sched_setaffinity,
    ) -> None:
        self.proc = proc
        self.clock_ns = clock_ns
        self._set_affinity = set_affinity
        self._now = 0  # when this snapshot began: what offsets are judged stale against
        self._own_ns = 0  # the calling thread's CPU's offset, this snapshot's
        self._refreshes = 0  # stale offsets read again this snapshot
        self._by_cpu: dict[int, tuple[int, int | None]] = {}  # cpu -> (read at, offset or None)
        try:  # the CPUs it was started on: the ones it visits, and goes back to
            self._home = frozenset(get_affinity(0))
        except OSError:
            self._home = frozenset()
        self._moved = False
        self.reads = 0  # CPUs visited (tests, the bench)

    def begin(self) -> None:
        self._now = self.clock_ns()
        self._own_ns = self._offset_here() or 0
        self._refreshes = 0

    def to_monotonic(self, exec_start_ms: float, cpu: int | None) -> int:
        """``exec_start_ms``, stamped on ``cpu``'s task clock, as CLOCK_MONOTONIC ns."""
        return int(exec_start_ms * 1e6) + self._offset_of(cpu)

    def end(self) -> None:
        if self._moved:
            self._moved = False
            # A CPU of ours went offline: the kernel has moved us already.
            with contextlib.suppress(OSError):
                self._set_affinity(0, self._home)

    def _offset_of(self, cpu: int | None) -> int:
        if cpu is None or cpu not in self._home:
            return self._own_ns
        known = self._by_cpu.get(cpu)
        if known is None or (
            self._now - known[0] >= REFRESH_NS and self._refreshes < REFRESH_PER_SNAPSHOT
        ):
            if known is not None:
                self._refreshes += 1
            known = (self._now, self._visit(cpu))
            self._by_cpu[cpu] = known
        return self._own_ns if known[1] is None else known[1]

    def _visit(self, cpu: int) -> int | None:
        try:
            self._set_affinity(0, {cpu})
        except OSError:
            return None  # offline, or outside our cpuset since begin: not asked again soon
        self._moved = True
        self.reads += 1
        return self._offset_here()

    def _offset_here(self) -> int | None:
        ms = self.proc.own_exec_start_ms()
        now = self.clock_ns()
        return None if ms is None else now - int(ms * 1e6)
