"""Builds a Snapshot from /proc and the probe's reading: the one place that joins them.

Every read of /proc a tick makes is here: the snapshot, and the few reads the Observer asks
for only when it needs them (an fd's link, the pipes a service reads, the fds of a quiet
service to date it, a proven process's POSIX timers), so the analysis is handed data only.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import NamedTuple

from ..model import (
    FUTEX_CMD_MASK,
    FUTEX_WAIT_BITSET,
    WAIT_OPS,
    Connection,
    Connections,
    FutexWait,
    Listener,
    LockRead,
    Plumbing,
    ProbeReading,
    ProcessSample,
    Refusal,
    Snapshot,
    SyscallLine,
    TcpInfo,
    Threads,
    ThreadSample,
    WrittenFd,
    candidates,
    endpoint,
    is_blocked,
    thread_ids,
)
from ..sources.procfs import ProcessMemory, ProcFS, TcpSocket
from ..sources.schedclock import SchedClock
from ..sources.tcpinfo import TCP_ESTABLISHED, TCP_LISTEN
from ..syscalls import (
    BY_NR,
    EPOLL,
    FUTEX,
    INPUT_READS,
    SYS_FUTEX,
    SYS_FUTEX_WAIT,
    futex_private,
    syscall_wait,
    wait_kind,
)
from . import launchers
from .sockets import SocketTables

log = logging.getLogger(__name__)

CLK_TCK = os.sysconf("SC_CLK_TCK")  # /proc/PID/stat counts starttime in these
# The ephemeral port range is a sysctl an administrator sets once: read again this often.
EPHEMERAL_READ_NS = 30_000_000_000


def owner_candidates(processes: Iterable[ProcessSample]) -> set[int]:
    """TIDs that lock words name as owners: the snapshot checks which of them are alive."""
    return {c.owner for p in processes for _, c in candidates(p.threads)}


def seeded_wait(sc: SyscallLine | None) -> FutexWait | None:
    """A futex wait as /proc/PID/task/TID/syscall shows it, for threads blocked before we attached."""
    if sc is None or wait_kind(sc.nr) != FUTEX or len(sc.args) < 3:
        return None
    if sc.nr == SYS_FUTEX:
        op = sc.args[1] & FUTEX_CMD_MASK
        if op not in WAIT_OPS:
            return None
        return FutexWait(sc.args[0], op, sc.args[2] & 0xFFFFFFFF, source="proc")
    if sc.nr == SYS_FUTEX_WAIT:
        return FutexWait(sc.args[0], FUTEX_WAIT_BITSET, sc.args[1] & 0xFFFFFFFF, source="proc")
    return FutexWait(0, 0, 0, vector=True, source="proc")  # futex_waitv: words are in a vector


def _lock_read(mem: ProcessMemory | None, uaddr: int) -> LockRead | None:
    if mem is None or not uaddr:
        return None
    # glibc pthread_mutex_t: __lock, __count, __owner, __nusers, __kind
    ints = mem.ints(uaddr, 5)
    if ints is None:
        ints = mem.ints(uaddr, 1)  # the word may sit at the end of a mapping
        return LockRead(ints[0]) if ints else None
    return LockRead(ints[0], owner_field=ints[2], kind_field=_signed(ints[4]), users_field=ints[3])


def _signed(v: int) -> int:
    return v - (1 << 32) if v & 0x80000000 else v


@dataclass(frozen=True)
class _ThreadRead:
    """What one read of a thread's stat, syscall and sched files said."""

    cpu_ns: int
    name: str
    state: str
    syscall: SyscallLine | None
    last_ran_ns: int | None
    # The start of the probe's in-flight futex wait the thread was read in, if it was in one
    wait_since_ns: int | None = None

    @property
    def blocked(self) -> bool:
        return is_blocked(self.state)


def sockets_read(reads: Mapping[int, _ThreadRead], sockets: Mapping[int, int]) -> frozenset[int]:
    """Inodes of the process's sockets (``sockets``: inode -> fd) that one of its threads
    (``reads``) is blocked reading: the fd in the registers of its read or recv."""
    if not sockets:
        return frozenset()  # a rank, a worker: no socket, no thread to look at
    fds = {
        r.syscall.args[0]
        for r in reads.values()
        if r.syscall is not None and r.syscall.nr in INPUT_READS and r.syscall.args
    }
    if not fds:
        return frozenset()
    return frozenset(inode for inode, fd in sockets.items() if fd in fds)


class _KeptInfo(NamedTuple):
    """A connection's tcp_info as last read from the kernel, to carry while nothing can
    have moved it."""

    queues: tuple[int, int]  # (rx_queue, tx_queue) at that read
    read_ns: int  # the snapshot it was read in
    info: TcpInfo


def _aged(k: _KeptInfo, now: int) -> TcpInfo:
    """The kept tcp_info as a read at ``now`` would give it: its last-data times older by
    the time since it was read, its byte counts the same."""
    ms = (now - k.read_ns) // 1_000_000
    i = k.info
    return TcpInfo(
        i.last_data_recv_ms + ms, i.last_data_sent_ms + ms, i.bytes_received, i.bytes_acked
    )


def _aged_connections(kept: list[tuple[_KeptInfo | None, Connection]], now: int) -> Connections:
    """The kept connections as a read at ``now`` would give them (as _aged): those with
    tcp_info kept, their last-data times older by the time since it was read. One loop for
    a front-end's thousand, every tick, most of them read in the same snapshot (one age)."""
    out: list[Connection] = []
    add = out.append
    ages: dict[int, int] = {}
    for k, c in kept:
        if k is None:
            add(c)
            continue
        ms = ages.get(k.read_ns)
        if ms is None:
            ms = ages[k.read_ns] = (now - k.read_ns) // 1_000_000
        i = k.info
        add(c.with_times(i.last_data_recv_ms + ms, i.last_data_sent_ms + ms))
    return Connections(out)


_NO_INFO = (None, None, None, None)


def _times_and_bytes(i: TcpInfo) -> tuple[int, int, int, int]:
    """A Connection's tcp_info fields, in its order."""
    return i.last_data_recv_ms, i.last_data_sent_ms, i.bytes_received, i.bytes_acked


class _NsRead(NamedTuple):
    """A network namespace's sockets as the last tick read them and handed them out."""

    held_by: dict[int, Mapping[int, int]]  # pid -> socket inode -> fd
    table: list[TcpSocket]
    listeners: dict[int, tuple[Listener, ...]]  # pid -> its listeners
    # pid -> its connections, each with the tcp_info kept for it (None: it has none)
    connections: dict[int, list[tuple[_KeptInfo | None, Connection]]]
    infos: dict[int, _KeptInfo]  # inode -> the tcp_info kept for it
    complete: bool  # every connection that should carry tcp_info does


@dataclass(frozen=True)
class _Kept:
    """A process's last sample and what it was read from: reused whole, but for its sockets
    and its words in shared memory, while the process stays quiet (see Sampler)."""

    key: tuple[int, str]  # (start time, comm): a reused PID or an exec is another process
    tids: tuple[int, ...]
    reads: Mapping[int, _ThreadRead]  # tid -> its read
    sample: ProcessSample
    sockets: Mapping[int, int]  # its sockets, inode -> fd (an fd walk)
    # (TID, start) of the threads read in a futex wait the probe saw begin; the others
    proven: frozenset[tuple[int, int]] = frozenset()
    others: frozenset[int] = frozenset()
    # Of the others, those read in a wait seen from /proc whose mark was made (seed), and
    # the rest: while every mark stands, only the rest are read
    marked: frozenset[int] = frozenset()
    unmarked: frozenset[int] = frozenset()


class Sampler:
    """Takes snapshots of a set of processes, reading what can have changed.

    A thread that did not run since the last tick shows the same stat, syscall and sched
    files, so its last read is reused. Whether it ran: where the probe saw the futex wait it
    was read in begin and has not seen it end (the same start time in its in-flight map),
    it never left the syscall, and nothing is read; else its schedstat (run time in ns,
    which moves on every run) says, one read. A process none of whose threads ran, with the
    same threads and the same start time and comm, is quiet: nothing it could change has
    changed (its memory maps, its private lock words, its fds, its write counter), so its
    last sample is reused. A wait /proc showed that began before the probe was attached
    costs no more once marked (seed): the probe clears the mark when the thread leaves the
    wait, so while it stands the read is reused as a probed wait's is. What others change
    is read again: lock words in shared mappings
    (another process may take them) and its sockets' queues and tcp_info (clients send
    without the server running: that is how a hung server is found). Lock words are read
    once per word per tick, however many threads wait on it.
    """

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
        # pid -> ((start time, comm), its plumbing hints): read once per process, and again
        # when the PID is reused or the process execs (its comm changes)
        self.sched_clock = SchedClock(self.proc, clock_ns)  # dates se.exec_start
        self._plumbing: dict[int, tuple[tuple[int, str], Plumbing]] = {}
        self._next_plumbing: dict[int, tuple[tuple[int, str], Plumbing]] = {}
        self._kept: dict[int, _Kept] = {}  # pid -> its last sample, to reuse while quiet
        # tgid -> (TID, start) of the probe's in-flight waits, this snapshot's
        self._waiting: Mapping[int, frozenset[tuple[int, int]]] = {}
        self._next_kept: dict[int, _Kept] = {}
        self.sockets = SocketTables(self.proc)
        self._pipes: dict[int, frozenset[int]] = {}  # pid -> pipes_read, while it is quiet
        # pid -> its writable_fds, while it is quiet
        self._writable: dict[int, tuple[tuple[int, str], ...]] = {}
        self._infos: dict[int, _KeptInfo] = {}  # socket inode -> its last tcp_info read
        # pid -> inodes of the sockets a thread of it sleeps waiting on for input, while quiet
        self._inputs: dict[int, frozenset[int]] = {}
        self._ephemeral: tuple[int, int] | None = None  # (when read, the range's first port)
        self.tables_skipped = 0  # namespaces whose table was not read at all (tests, the bench)
        self._ns_reads: dict[str, _NsRead] = {}  # network namespace -> its last read
        self.infos_read = 0  # how many tcp_info were read from the kernel (tests, the bench)
        self.tables_reused = 0  # namespaces handed out as the last tick read them (tests)
        self._maps_cut: set[int] = set()  # processes whose maps read was cut, and logged
        # tid -> (pid, CPU ns of its read) of threads read in a futex wait the probe did not
        # see begin, whose mark (seed) was made while they were still in it
        self._seeds: dict[int, tuple[int, int]] = {}
        self._seeded_from: frozenset[int] | None = None  # the probe's marks _seeds was kept to
        # tid -> (pid, CPU ns of its read): this tick's reads in such a wait, not marked yet
        self._unmarked: dict[int, tuple[int, int]] = {}
        self._asked: set[tuple[int, int]] = set()  # (pid, tid) the probe would not mark

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
        self._next_kept = {}
        self._waiting = probe.waiting_by_process()
        if probe.seeded is not self._seeded_from:  # the probe hands the same set while unchanged
            self._seeds = {t: v for t, v in self._seeds.items() if t in probe.seeded}
            self._seeded_from = probe.seeded
        self._unmarked = {}
        self.sched_clock.begin()
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
            self.sched_clock.end()  # back on the CPUs it had, if a CPU's clock was read
        self._read_sockets(processes, fds, ran, now)
        self._pipes = {p: v for p, v in self._pipes.items() if p in processes and p not in ran}
        self._writable = {
            p: v for p, v in self._writable.items() if p in processes and p not in ran
        }
        self._plumbing = self._next_plumbing
        self._kept = self._next_kept
        self._maps_cut &= processes.keys()
        self._asked = {(p, t) for p, t in self._asked if p in processes}
        known = {tid for p in processes.values() for tid in thread_ids(p.threads)}
        foreign = {}
        for tid in owner_candidates(processes.values()) - known:
            tgid = self.proc.tgid_of(tid)
            if tgid is not None:
                foreign[tid] = tgid
        if self._ephemeral is None or now - self._ephemeral[0] >= EPHEMERAL_READ_NS:
            self._ephemeral = (now, self.proc.ephemeral_from())
        return Snapshot(now, wall, processes, frozenset(gone), foreign, self._ephemeral[1])

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
        kept = self._kept.get(pid)
        if kept is not None and kept.key != key:
            kept = None  # the PID was reused, or the process exec'd: another process
        got = self._reads_if_unlisted(pid, st.num_threads, kept, probe)
        unlisted = got is not None
        if got is None:
            got = self._reads_listed(pid, probe, kept.reads if kept else {})
        reads, quiet = got
        if not reads:
            return None
        if quiet and kept is not None and (unlisted or kept.tids == tuple(reads)):
            threads, word_ids = self._shared_words_again(pid, kept.sample)
            write_bytes, read_bytes = kept.sample.write_bytes, kept.sample.read_bytes
            sockets = kept.sockets
        else:
            quiet = False
            threads, word_ids = self._threads(pid, reads, probe)
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
        if quiet and kept is not None and reads is kept.reads:  # not one read changed
            self._next_kept[pid] = replace(kept, sample=sample, sockets=sockets)
        else:
            tids = tuple(reads)
            proven = frozenset((t, r.wait_since_ns) for t, r in reads.items() if r.wait_since_ns)
            others = frozenset(t for t, r in reads.items() if not r.wait_since_ns)
            seeds = self._seeds
            marked = frozenset(t for t in others if seeds.get(t) == (pid, reads[t].cpu_ns))
            self._next_kept[pid] = _Kept(
                key, tids, reads, sample, sockets, proven, others, marked, others - marked
            )
        return sample, sockets, quiet

    def _reads_listed(
        self, pid: int, probe: ProbeReading, before: Mapping[int, _ThreadRead]
    ) -> tuple[Mapping[int, _ThreadRead], bool]:
        """The reads of every thread /proc/PID/task lists (``before``: the last tick's), and
        whether none of them ran."""
        reads: dict[int, _ThreadRead] = {}
        quiet = True
        for tid in self.proc.tids(pid):
            got = self._read_thread(pid, tid, probe, before.get(tid))
            if got is None:
                quiet = False  # it exited between the listing and the read
                continue
            read, same = got
            reads[tid] = read
            quiet = quiet and same
        return reads, quiet

    def _reads_if_unlisted(
        self, pid: int, num_threads: int, kept: _Kept | None, probe: ProbeReading
    ) -> tuple[Mapping[int, _ThreadRead], bool] | None:
        """The threads' reads without listing them, where the last tick's threads are
        provably all there is: as many as the process counts now, those read in a futex
        wait still in it (the probe's in-flight waits hold the same starts: not one of them
        left it, so none exited or started a thread), the others read again. None where
        that does not hold (then they are listed)."""
        if kept is None or num_threads != len(kept.tids):
            return None
        if kept.proven and not kept.proven <= self._waiting.get(pid, frozenset()):
            return None
        changed: dict[int, _ThreadRead] = {}
        quiet = True
        # Threads whose marks all stand are in their waits: only the rest are read.
        for tid in kept.unmarked if kept.marked <= probe.seeded else kept.others:
            before = kept.reads[tid]
            got = self._read_thread(pid, tid, probe, before)
            if got is None:
                return None  # exited: list them
            read, same = got
            quiet = quiet and same
            if read is not before:
                changed[tid] = read
        if not changed:
            return kept.reads, quiet  # the same reads, the same object
        return {tid: changed.get(tid, r) for tid, r in kept.reads.items()}, quiet

    def _threads(
        self, pid: int, reads: Mapping[int, _ThreadRead], probe: ProbeReading
    ) -> tuple[tuple[ThreadSample, ...], Mapping[int, tuple]]:
        """The process's threads from this tick's reads, their lock words read and their
        stacks and words placed in its memory maps."""
        mem = self.proc.open_memory(pid)
        try:
            threads = []
            stack_ptrs = {}
            words: dict[int, LockRead | None] = {}
            for tid, read in reads.items():
                t, sp = self._thread(pid, tid, read, probe, mem, words)
                threads.append(t)
                if sp:
                    stack_ptrs[tid] = sp
            placed, word_ids = self._place_in_maps(pid, threads, stack_ptrs)
            return Threads(placed), word_ids
        finally:
            if mem is not None:
                mem.close()

    def _shared_words_again(
        self, pid: int, sample: ProcessSample
    ) -> tuple[tuple[ThreadSample, ...], Mapping[int, tuple]]:
        """A quiet process's last threads, with the lock words it waits on in shared
        mappings read again: another process may have taken or released them."""
        shared = {a for a, ident in sample.word_ids.items() if ident[0] == "shared"}
        if not shared:
            return sample.threads, sample.word_ids
        mem = self.proc.open_memory(pid)
        try:
            words = {a: _lock_read(mem, a) for a in shared}
        finally:
            if mem is not None:
                mem.close()
        threads = []
        for t in sample.threads:
            if t.wait is not None and t.wait.uaddr in words and not t.wait.vector:
                t = replace(t, lock=words[t.wait.uaddr])
            if t.refused is not None and t.refused.uaddr in words:
                t = replace(t, refused=replace(t.refused, lock=words[t.refused.uaddr]))
            threads.append(t)
        return Threads(threads), sample.word_ids

    def _plumbing_of(self, pid: int, key: tuple[int, str]) -> Plumbing:
        known = self._plumbing.get(pid)
        hints = (
            known[1]
            if known is not None and known[0] == key
            else launchers.parse_plumbing(self.proc.environ(pid), self.proc.argv(pid) or [])
        )
        self._next_plumbing[pid] = (key, hints)
        return hints

    def _read_thread(
        self, pid: int, tid: int, probe: ProbeReading, before: _ThreadRead | None
    ) -> tuple[_ThreadRead, bool] | None:
        """The thread's read (``before``: its last), and whether it is the last tick's (it
        has not run since)."""
        hit = probe.inflight.get(tid)
        since = hit.wait.since_ns if hit is not None and hit.tgid == pid else None
        if before is not None and since is not None and before.wait_since_ns == since:
            return before, True  # still in the futex wait it was read in: not a byte changed
        if (
            before is not None
            and since is None
            and tid in probe.seeded
            and self._seeds.get(tid) == (pid, before.cpu_ns)
        ):
            return before, True  # still in the wait /proc showed: its mark stands
        proc = self.proc
        cpu = proc.thread_cpu_ns(pid, tid)
        if cpu is None:
            return None
        if before is not None and before.blocked and before.cpu_ns == cpu:
            # Has not run since: nothing it shows can have changed. Dated by the wait the
            # probe now sees, if it began before the thread last ran (seen from /proc
            # before the probe was attached, or by a read that came in mid-syscall).
            read = before if before.wait_since_ns == since else replace(before, wait_since_ns=since)
            self._note_unmarked(pid, tid, read)
            return read, True
        st = proc.thread_stat(pid, tid)
        if st is None or st.state in ("Z", "X"):
            return None
        blocked = is_blocked(st.state)
        sc = proc.thread_syscall(pid, tid) if blocked else None
        last_ran = None
        if blocked:
            ms = proc.thread_exec_start_ms(pid, tid)
            # On the task clock of the CPU it last ran on: moved to monotonic by that CPU's
            # offset (agent.sources.schedclock), and clamped so that the offset's own error
            # never puts it in the future.
            if ms is not None:
                last_ran = min(self.sched_clock.to_monotonic(ms, st.cpu), self.clock_ns())
        in_futex = blocked and sc is not None and wait_kind(sc.nr) == FUTEX
        read = _ThreadRead(cpu, st.comm, st.state, sc, last_ran, since if in_futex else None)
        self._note_unmarked(pid, tid, read)
        return read, False

    def _note_unmarked(self, pid: int, tid: int, read: _ThreadRead) -> None:
        """Keep ``read`` for seed() if it is of a futex wait the probe did not see begin."""
        if (
            read.wait_since_ns is None
            and read.blocked
            and read.syscall is not None
            and wait_kind(read.syscall.nr) == FUTEX
            and (pid, tid) not in self._asked
        ):
            self._unmarked[tid] = (pid, read.cpu_ns)

    def seed(self, mark: Callable[[Mapping[int, int]], Collection[int]]) -> None:
        """Have the probe mark this tick's threads read in futex waits it did not see begin
        (``mark``: TID -> tgid to those marked; ProbeSource.seed), and reuse their reads
        while the marks stand. A mark counts only where the thread did not run between its
        read and the mark (its CPU time the same after): then it was made while the thread
        was in the wait read, and its sys_exit clears it. One read per thread, once.
        Asked once per thread: one the probe did not mark (its entry exists, or the room
        for marks is taken) is read each tick, as before."""
        if not self._unmarked:
            return
        marked = mark({tid: pid for tid, (pid, _) in self._unmarked.items()})
        made: dict[int, set[int]] = {}  # pid -> its threads marked now
        for tid, (pid, cpu) in self._unmarked.items():
            if tid in marked and self.proc.thread_cpu_ns(pid, tid) == cpu:
                self._seeds[tid] = (pid, cpu)
                made.setdefault(pid, set()).add(tid)
            else:
                self._asked.add((pid, tid))
        self._unmarked = {}
        for pid, tids in made.items():
            kept = self._kept.get(pid)
            if kept is not None:
                ours = {
                    t
                    for t in tids
                    if t in kept.unmarked and kept.reads[t].cpu_ns == self._seeds[t][1]
                }
                self._kept[pid] = replace(
                    kept, marked=kept.marked | ours, unmarked=kept.unmarked - ours
                )

    def _thread(
        self,
        pid: int,
        tid: int,
        read: _ThreadRead,
        probe: ProbeReading,
        mem: ProcessMemory | None,
        words: dict[int, LockRead | None],
    ) -> tuple[ThreadSample, int | None]:
        sc = read.syscall
        wait = None
        if sc is not None and wait_kind(sc.nr) == FUTEX:
            # The probe saw the wait begin (start time, exact op); /proc only says where it is.
            # A probe entry without /proc agreement is stale: the thread died or moved on.
            hit = probe.inflight.get(tid)
            fresh = hit is not None and hit.tgid == pid
            if fresh and hit is not None and sc.nr == SYS_FUTEX:
                fresh = sc.args[0] == hit.wait.uaddr
            wait = hit.wait if fresh and hit is not None else seeded_wait(sc)

        def lock_at(uaddr: int) -> LockRead | None:
            if uaddr not in words:  # many threads wait on one word: read it once
                words[uaddr] = _lock_read(mem, uaddr)
            return words[uaddr]

        lock = lock_at(wait.uaddr) if wait is not None and not wait.vector else None
        refused = None
        r = probe.refusals.get(tid)
        if r is not None and r[0] == pid and wait is not None:
            refused = Refusal(uaddr=r[1], ts_ns=r[2], lock=lock_at(r[1]))
        sample = ThreadSample(
            tid=tid,
            name=read.name,
            state=read.state,
            cpu_ns=read.cpu_ns,
            last_ran_ns=read.last_ran_ns,
            syscall=sc.nr if sc is not None else None,
            timed=w.timed if (w := syscall_wait(sc)) is not None else None,
            private_futex=futex_private(sc),
            wait=wait,
            lock=lock,
            refused=refused,
        )
        return sample, sc.sp if sc is not None else None

    def _place_in_maps(
        self, pid: int, threads: list[ThreadSample], stack_ptrs: dict[int, int]
    ) -> tuple[list[ThreadSample], dict[int, tuple]]:
        """The mappings that hold its waits' words and its blocked threads' stack pointers,
        for processes with waits, give two things: each blocked thread's stack mapping
        (validates pthread_join edges), and the identity of futex words in shared mappings,
        as (device, inode, offset), so that one barrier in shared memory is one word in
        every process that maps it. Only those mappings are asked for (ProcFS.mappings_at:
        a process that runs between ticks is asked again each tick, and its maps may hold
        62,000 lines); a read of the maps cut short is logged once per process."""
        addrs = {t.wait.uaddr for t in threads if t.wait and not t.wait.vector}
        addrs |= {t.refused.uaddr for t in threads if t.refused}
        if not addrs:
            return threads, {}
        at = self.proc.mappings_at(pid, addrs | set(stack_ptrs.values()))
        if at.cut is not None and pid not in self._maps_cut:
            self._maps_cut.add(pid)
            log.warning(
                "process %d: %s; its waits and stacks past that are not placed", pid, at.cut
            )
        word_ids = {}
        for a in addrs:
            m = at.found.get(a)
            if m is not None and "s" in m.perms:
                word_ids[a] = ("shared", m.dev, m.inode, m.offset + (a - m.start))
        placed = []
        for t in threads:
            sp = stack_ptrs.get(t.tid)
            stack = at.found.get(sp) if sp is not None else None
            placed.append(replace(t, stack=(stack.start, stack.end)) if stack else t)
        return placed, word_ids

    def _read_sockets(
        self,
        processes: dict[int, ProcessSample],
        fds: Mapping[int, Mapping[int, int]],
        ran: Collection[int],
        now: int,
    ) -> None:
        """Give each process its listeners and established connections (with their queues):
        one read of its network namespace's table per tick, for the ports its watched
        processes hold (agent.observe.sockets).

        Connections get the kernel's tcp_info (last data received and sent, bytes) where it
        is evidence: those a process accepted on a listening port of the snapshot's
        processes (the candidates for a front door; which are is decided later, per
        service), where a request received and not answered is work waiting; and those whose
        peer is outside the snapshot's processes, where data received is progress (weights
        streamed in) and the last data moved dates a hang. Loopback chatter between the
        snapshot's own processes is left without. The table's read carries the tcp_info of
        the ports it asks for; where it did not (a whole table read, /proc/net/tcp), one
        more netlink read per namespace gets it, filtered by local port.

        Where none of a namespace's processes ran since the last tick, the table is read
        without tcp_info, and a connection whose queues are as they were keeps the one last
        read, its times moved on by the time since: with no thread of its holders running,
        nothing was written to it or read from it, so no data left it and none arrived (an
        arrival would sit in its receive queue), and its byte counts and last-data times
        stand. A client's request to a hung server shows as a receive queue that grew, and
        that connection's tcp_info is read. A holder that runs between the tick's reads of
        its threads and of its sockets is seen running the next tick, and read then.

        Where, besides, every socket of the last read is one a thread of its holder sleeps
        waiting on for input (an epoll set's EPOLLIN, a blocked read), the table is not read
        at all (_nothing_arrived): a request, a new connection or a peer's close would have
        woken that thread. An idle front-end's event loop is that shape; a hung server's is
        not (its loop is blocked elsewhere), and its table is read each tick as above."""
        by_ns: dict[str, dict[int, Mapping[int, int]]] = {}
        kept_infos: dict[int, _KeptInfo] = {}
        ns_reads: dict[str, _NsRead] = {}
        for pid, held in fds.items():
            if held:
                ns = self.proc.net_namespace(pid) or f"pid:{pid}"
                by_ns.setdefault(ns, {})[pid] = held
        self._inputs = {p: v for p, v in self._inputs.items() if p in processes and p not in ran}
        for ns, held_by in by_ns.items():
            quiet = not any(pid in ran for pid in held_by)
            last = self._ns_reads.get(ns)
            if (
                quiet
                and last is not None
                and last.complete
                and last.held_by == held_by
                and self._nothing_arrived(last)
            ):
                table = last.table  # what a read would give: not read
                self.tables_skipped += 1
            else:
                table = self.sockets.read(ns, held_by, ran, info=not quiet)
            if (
                quiet
                and last is not None
                and last.complete
                and last.table == table
                and last.held_by == held_by
            ):
                # The same sockets in the same states with the same queues, held by the same
                # quiet processes: what the code below would give, its kept tcp_info aged,
                # without building it again (a front-end's thousand idle connections).
                for pid in held_by:
                    aged = _aged_connections(last.connections[pid], now)
                    processes[pid] = replace(
                        processes[pid], listeners=last.listeners[pid], connections=aged
                    )
                kept_infos.update(last.infos)
                ns_reads[ns] = last
                self.tables_reused += 1
                continue
            # A socket two processes hold (inherited across a fork) is each one's.
            owners: dict[int, list[int]] = {}
            for pid, held in held_by.items():
                for inode in held:
                    owners.setdefault(inode, []).append(pid)
            listening = {s.port for s in table if s.state == TCP_LISTEN}
            conns = [s for s in table if s.state == TCP_ESTABLISHED]
            ours = {endpoint(s.address, s.port) for s in conns}
            accepted = {
                s.inode: (s.family, s.port)
                for s in conns
                if s.port in listening or endpoint(s.remote_address, s.remote_port) not in ours
            }
            infos = {s.inode: s.info for s in conns if s.info and s.inode in accepted}
            self.infos_read += len(infos)
            if quiet:
                for s in conns:
                    k = self._infos.get(s.inode)
                    if (
                        k is not None
                        and s.inode in accepted
                        and k.queues == (s.rx_queue, s.tx_queue)
                    ):
                        infos[s.inode] = _aged(k, now)
                        kept_infos[s.inode] = k
            unread = {where for inode, where in accepted.items() if inode not in infos}
            if unread:
                got = self.proc.tcp_info(next(iter(held_by)), sorted(unread))
                got = {i: info for i, info in got.items() if i in accepted and i not in infos}
                infos.update(got)
                self.infos_read += len(got)
            for s in conns:
                info = infos.get(s.inode)
                if info is not None and s.inode not in kept_infos:
                    kept_infos[s.inode] = _KeptInfo((s.rx_queue, s.tx_queue), now, info)
            listeners: dict[int, list[Listener]] = {pid: [] for pid in held_by}
            connections: dict[int, list[tuple[_KeptInfo | None, Connection]]] = {
                pid: [] for pid in held_by
            }
            for s in table:
                if s.state == TCP_LISTEN:
                    lst = Listener(s.family, s.address, s.port, s.rx_queue, s.tx_queue)
                    for pid in owners[s.inode]:
                        listeners[pid].append(lst)
                elif s.state == TCP_ESTABLISHED:
                    info = infos.get(s.inode)
                    # Built once, with its tcp_info if it has one (a front-end's thousand).
                    conn = Connection(
                        s.address,
                        s.port,
                        s.remote_address,
                        s.remote_port,
                        s.inode,
                        s.rx_queue,
                        s.tx_queue,
                        *(_NO_INFO if info is None else _times_and_bytes(info)),
                    )
                    entry = (kept_infos.get(s.inode), conn)
                    for pid in owners[s.inode]:
                        connections[pid].append(entry)
            theirs = {pid: tuple(listeners[pid]) for pid in held_by}
            for pid in held_by:
                processes[pid] = replace(
                    processes[pid],
                    listeners=theirs[pid],
                    connections=Connections(c for _, c in connections[pid]),
                )
            ns_reads[ns] = _NsRead(
                held_by,
                table,
                theirs,
                connections,
                {i: kept_infos[i] for i in accepted if i in kept_infos},
                all(i in infos for i in accepted),
            )
        self._infos = kept_infos
        self._ns_reads = ns_reads
        self.sockets.forget(by_ns, {i for held in fds.values() for i in held})

    def _input_awaited(self, pid: int) -> frozenset[int]:
        """Inodes of the process's sockets that one of its threads sleeps waiting on for
        input: in an epoll set it waits in (EPOLLIN), or the socket of its read or recv.
        Read once while the process stays quiet (its threads and epoll sets cannot change
        unless it runs)."""
        got = self._inputs.get(pid)
        if got is None:
            kept = self._next_kept.get(pid)
            inodes = set(kept.sample.reading) if kept is not None else set()
            for r in kept.reads.values() if kept is not None else ():
                sc = r.syscall
                entry = BY_NR.get(sc.nr) if r.blocked and sc is not None and sc.args else None
                if entry is not None and entry.fds == EPOLL and sc is not None:
                    inodes |= self.proc.epoll_inputs(pid, sc.args[0])
            got = self._inputs[pid] = frozenset(inodes)
        return got

    def _nothing_arrived(self, last: _NsRead) -> bool:
        """Whether none of the sockets ``last`` read can have changed since: each one is
        awaited for input by a thread of its quiet holder that has slept since (an arrival,
        a new connection on a listener, a close or a reset by the peer would have woken it,
        and it would have run), and each connection had nothing in flight (an ACK moves a
        send queue without waking anyone)."""
        awaited: set[int] = set()
        for pid in last.held_by:
            awaited |= self._input_awaited(pid)
        return all(
            s.inode in awaited and (s.state == TCP_LISTEN or s.tx_queue == 0) for s in last.table
        )

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
