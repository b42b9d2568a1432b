"""Builds a Snapshot from /proc and the probe's reading: the one place that joins them.

Every read of /proc a tick makes is here or in the parts it composes (the threads,
agent.observe.threads; the sockets, agent.observe.socketcache), and so are the few reads the
Observer asks for only when it needs them, so the analysis is handed data only.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Collection, Iterable, Mapping

from ..model import (
    Plumbing,
    ProbeReading,
    ProcessSample,
    Snapshot,
    WrittenFd,
    candidates,
    thread_ids,
)
from ..sources.procfs import ProcFS
from ..sources.schedclock import SchedClock
from . import launchers
from .socketcache import SocketReads, sockets_read
from .sockets import SocketTables
from .threads import ThreadReads

CLK_TCK = os.sysconf("SC_CLK_TCK")  # /proc/PID/stat counts starttime in these


def owner_candidates(processes: Iterable[ProcessSample]) -> set[int]:
    """TIDs that lock words name as owners: the snapshot checks which of them are alive."""
    return {c.owner for p in processes for _, c in candidates(p.threads)}


class Sampler:
    """Takes snapshots of a set of processes, reading what can have changed: their threads
    (ThreadReads: a quiet process's last sample is reused), their sockets (SocketReads: what
    others change is read again, kept while it cannot have moved), and per process its
    stat, I/O counters, socket fds and plumbing hints."""

    def __init__(
        self,
        proc: ProcFS | None = None,
        clock_ns: Callable[[], int] = time.monotonic_ns,
        wall: Callable[[], float] = time.time,
        uptime: Callable[[], float] = lambda: time.clock_gettime(time.CLOCK_BOOTTIME),
    ) -> None:
        self.proc = proc or ProcFS()
        self.clock_ns = clock_ns
        self.wall = wall
        self.uptime = uptime  # the clock /proc/PID/stat's starttime counts on, in seconds
        self._uptime_s = 0.0
        self.thread_reads = ThreadReads(self.proc, clock_ns)
        self.socket_reads = SocketReads(self.proc)
        # pid -> ((start time, comm), its plumbing hints): read once per process, and again
        # when the PID is reused or the process execs (its comm changes)
        self._plumbing: dict[int, tuple[tuple[int, str], Plumbing]] = {}
        self._next_plumbing: dict[int, tuple[tuple[int, str], Plumbing]] = {}
        self._pipes: dict[int, frozenset[int]] = {}  # pid -> pipes_read, while it is quiet
        # pid -> its writable_fds, while it is quiet
        self._writable: dict[int, tuple[tuple[int, str], ...]] = {}

    # The parts' clock and counters, as the tests and the bench reach them.

    @property
    def sched_clock(self) -> SchedClock:
        """Dates se.exec_start (agent.sources.schedclock)."""
        return self.thread_reads.sched_clock

    @sched_clock.setter
    def sched_clock(self, clock: SchedClock) -> None:
        self.thread_reads.sched_clock = clock

    @property
    def sockets(self) -> SocketTables:
        return self.socket_reads.tables

    @property
    def tables_skipped(self) -> int:
        return self.socket_reads.tables_skipped

    @property
    def infos_read(self) -> int:
        return self.socket_reads.infos_read

    @property
    def tables_reused(self) -> int:
        return self.socket_reads.tables_reused

    def snapshot(self, pids: Iterable[int], probe: ProbeReading | None = None) -> Snapshot:
        probe = probe or ProbeReading()
        now = self.clock_ns()
        wall = self.wall()
        self._uptime_s = self.uptime()
        processes: dict[int, ProcessSample] = {}
        gone = set()
        fds: dict[int, Mapping[int, int]] = {}  # pid -> socket inode -> fd
        ran = set()
        self._next_plumbing = {}
        threads = self.thread_reads
        threads.begin(probe)
        try:
            for pid in pids:
                got = self._process(pid, probe)
                if got is None:
                    gone.add(pid)
                    continue
                processes[pid], fds[pid], quiet = got
                if not quiet:
                    ran.add(pid)
        finally:
            threads.end()
        self.socket_reads.read(processes, fds, ran, now, threads.epoll_fds)
        threads.finish(processes.keys())
        self._pipes = {p: v for p, v in self._pipes.items() if p in processes and p not in ran}
        self._writable = {
            p: v for p, v in self._writable.items() if p in processes and p not in ran
        }
        self._plumbing = self._next_plumbing
        known = {tid for p in processes.values() for tid in thread_ids(p.threads)}
        foreign = {}
        for tid in owner_candidates(processes.values()) - known:
            tgid = self.proc.tgid_of(tid)
            if tgid is not None:
                foreign[tid] = tgid
        ephemeral = self.socket_reads.ephemeral_from(now)
        return Snapshot(now, wall, processes, frozenset(gone), foreign, ephemeral)

    def seed(self, mark: Callable[[Mapping[int, int]], Collection[int]]) -> None:
        """Have the probe mark this tick's threads read in futex waits it did not see begin
        (ThreadReads.seed)."""
        self.thread_reads.seed(mark)

    def _process(
        self, pid: int, probe: ProbeReading
    ) -> tuple[ProcessSample, Mapping[int, int], bool] | None:
        """The process's sample but for its sockets, its sockets (inode -> fd), and whether
        it was quiet (none of its threads ran since the last tick); None if it is gone."""
        proc = self.proc
        st = proc.stat(pid)
        if st is None or st.state in ("Z", "X"):
            return None
        key = (st.start_ticks, st.comm)
        got = self.thread_reads.read(pid, key, st.num_threads, probe)
        if got is None:
            return None
        reads, kept, quiet = got
        if quiet and kept is not None:
            threads, word_ids = self.thread_reads.shared_words_again(pid, kept.sample)
            write_bytes, read_bytes = kept.sample.write_bytes, kept.sample.read_bytes
            sockets = kept.sockets
        else:
            threads, word_ids = self.thread_reads.samples(pid, reads, probe)
            write_bytes, read_bytes = proc.io_counts(pid)  # one read of /proc/PID/io
            sockets = proc.socket_fds(pid)
        sample = ProcessSample(
            pid=pid,
            ppid=st.ppid,
            comm=st.comm,
            start_ticks=st.start_ticks,
            threads=threads,
            write_bytes=write_bytes,
            read_bytes=read_bytes,
            major_faults=st.major_faults,
            word_ids=word_ids,
            plumbing=self._plumbing_of(pid, key),
            age_s=max(0.0, self._uptime_s - st.start_ticks / CLK_TCK),
            reading=(
                kept.sample.reading
                if kept is not None and reads is kept.reads and sockets is kept.sockets
                else sockets_read(reads, sockets)
            ),
        )
        self.thread_reads.keep(pid, key, got, sample, sockets)
        return sample, sockets, quiet

    def _plumbing_of(self, pid: int, key: tuple[int, str]) -> Plumbing:
        known = self._plumbing.get(pid)
        hints = (
            known[1]
            if known is not None and known[0] == key
            else launchers.parse_plumbing(self.proc.environ(pid), self.proc.argv(pid) or [])
        )
        self._next_plumbing[pid] = (key, hints)
        return hints

    # --- reads asked for between snapshots --------------------------------------------------
    # What the Observer needs only sometimes (a pipe written, a quiet service to date, a
    # process proven to have no waker): read here, on its request, so that every /proc read of a
    # tick is the sampler's and the analysis is handed data only.

    def fd_targets(self, fds: Iterable[tuple[int, int]]) -> dict[tuple[int, int], str]:
        """(pid, fd) -> what the fd points to now, for those still open."""
        return {k: t for k in fds if (t := self.proc.fd_target(*k)) is not None}

    def pipes_read(self, pids: Iterable[int]) -> frozenset[int]:
        """Inodes of the pipes that any of ``pids`` holds open for reading: an fd walk of
        each, kept while it stays quiet (its fds cannot change if none of its threads runs)."""
        out: set[int] = set()
        for pid in pids:
            if pid not in self._pipes:
                self._pipes[pid] = frozenset(self.proc.pipes_read(pid))
            out |= self._pipes[pid]
        return frozenset(out)

    def written_files(self, pids: Iterable[int]) -> dict[int, tuple[WrittenFd, ...]]:
        """pid -> the fds it holds open for writing to a file, a pipe or a terminal, with
        their mtimes: an fd walk per process, kept while it stays quiet (as pipes_read's),
        and a stat per fd (other writers move the mtimes)."""
        out = {}
        for pid in pids:
            if pid not in self._writable:
                self._writable[pid] = tuple(self.proc.writable_fds(pid))
            out[pid] = tuple(self.proc.modified(pid, self._writable[pid]))
        return out

    def with_posix_timers(self, pids: Iterable[int]) -> frozenset[int]:
        """Those of ``pids`` that hold a POSIX timer (agent.analysis.nowaker)."""
        return frozenset(pid for pid in pids if self.proc.has_posix_timers(pid))

    def listening_port(self, pid: int, fd: int) -> int | None:
        """The TCP port of the process's socket ``fd`` (one the kernel chose at bind)."""
        target = self.proc.fd_target(pid, fd)
        if not target or not target.startswith("socket:["):
            return None
        inode = int(target[8:-1])
        listeners = self.proc.tcp_sockets(pid, listening=True)  # few, whatever the host holds
        return next((s.port for s in listeners if s.inode == inode), None)

    def alive(self, pids: Iterable[int]) -> frozenset[int]:
        """Those of ``pids`` that still exist (a stat each)."""
        return frozenset(pid for pid in pids if self.proc.stat(pid) is not None)
