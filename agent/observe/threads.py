"""A watched process's threads, read again each tick only where they ran: ThreadReads.

It keeps each thread's last read of /proc and each process's last sample, and turns the reads
into ThreadSamples (their waits, lock words and stacks), for the Sampler.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, replace
from typing import NamedTuple

from ..model import (
    FUTEX_CMD_MASK,
    FUTEX_WAIT_BITSET,
    WAIT_OPS,
    FutexWait,
    ProbeReading,
    ProcessSample,
    Refusal,
    SyscallLine,
    Threads,
    ThreadSample,
    is_blocked,
)
from ..sources.glibc import LockWords
from ..sources.procfs import ProcFS
from ..sources.schedclock import SchedClock
from ..syscalls import (
    BY_NR,
    EPOLL,
    FUTEX,
    SYS_FUTEX,
    SYS_FUTEX_WAIT,
    futex_private,
    syscall_wait,
    wait_kind,
)

log = logging.getLogger(__name__)


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


@dataclass(frozen=True)
class ThreadRead:
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


@dataclass(frozen=True)
class Kept:
    """A process's last sample and what it was read from: reused whole, but for its sockets
    and its words in shared memory, while the process stays quiet (see ThreadReads)."""

    key: tuple[int, str]  # (start time, comm): a reused PID or an exec is another process
    tids: tuple[int, ...]
    reads: Mapping[int, ThreadRead]  # tid -> its read
    sample: ProcessSample
    sockets: Mapping[int, int]  # its sockets, inode -> fd (an fd walk)
    # (TID, start) of the threads read in a futex wait the probe saw begin; the others
    proven: frozenset[tuple[int, int]] = frozenset()
    others: frozenset[int] = frozenset()
    # Of the others, those read in a wait seen from /proc whose mark was made (seed), and
    # the rest: while every mark stands, only the rest are read
    marked: frozenset[int] = frozenset()
    unmarked: frozenset[int] = frozenset()


class ProcessReads(NamedTuple):
    """This tick's reads of a process's threads (tid -> its read), its last Kept (None for a
    process new, reused or exec'd), and whether it is quiet: none of its threads ran and they
    are the kept ones, so its last sample stands but for what others change."""

    reads: Mapping[int, ThreadRead]
    kept: Kept | None
    quiet: bool


class ThreadReads:
    """Reads the threads of the watched processes, reading what can have changed.

    A thread that did not run since the last tick shows the same stat, syscall and sched
    files, so its last read is reused. Whether it ran: where the probe saw the futex wait it
    was read in begin and has not seen it end (the same start time in its in-flight map),
    it never left the syscall, and nothing is read; else its schedstat (run time in ns,
    which moves on every run) says, one read. A process none of whose threads ran, with the
    same threads and the same start time and comm, is quiet: nothing it could change has
    changed (its memory maps, its private lock words, its fds, its write counter), so its
    last sample is reused (Kept). A wait /proc showed that began before the probe was
    attached costs no more once marked (seed): the probe clears the mark when the thread
    leaves the wait, so while it stands the read is reused as a probed wait's is. Lock words
    in shared mappings are read again (another process may take them); lock words are read
    once per word per tick, however many threads wait on it.

    A tick: begin, read (and samples or shared_words_again, then keep) per process, end,
    finish; seed after it.
    """

    def __init__(self, proc: ProcFS, clock_ns: Callable[[], int] = time.monotonic_ns) -> None:
        self.proc = proc
        self.clock_ns = clock_ns
        self.sched_clock = SchedClock(proc, clock_ns)  # dates se.exec_start
        self._kept: dict[int, Kept] = {}  # pid -> its last sample, to reuse while quiet
        # tgid -> (TID, start) of the probe's in-flight waits, this snapshot's
        self._waiting: Mapping[int, frozenset[tuple[int, int]]] = {}
        self._next_kept: dict[int, Kept] = {}
        self._maps_cut: set[int] = set()  # processes whose maps read was cut, and logged
        # tid -> (pid, CPU ns of its read) of threads read in a futex wait the probe did not
        # see begin, whose mark (seed) was made while they were still in it
        self._seeds: dict[int, tuple[int, int]] = {}
        self._seeded_from: frozenset[int] | None = None  # the probe's marks _seeds was kept to
        # tid -> (pid, CPU ns of its read): this tick's reads in such a wait, not marked yet
        self._unmarked: dict[int, tuple[int, int]] = {}
        self._asked: set[tuple[int, int]] = set()  # (pid, tid) the probe would not mark

    def begin(self, probe: ProbeReading) -> None:
        """Start a tick's reads, with the probe's reading of it."""
        self._next_kept = {}
        self._waiting = probe.waiting_by_process()
        if probe.seeded is not self._seeded_from:  # the probe hands the same set while unchanged
            self._seeds = {t: v for t, v in self._seeds.items() if t in probe.seeded}
            self._seeded_from = probe.seeded
        self._unmarked = {}
        self.sched_clock.begin()

    def end(self) -> None:
        """End the tick's reads, whether or not they all succeeded."""
        self.sched_clock.end()  # back on the CPUs it had, if a CPU's clock was read

    def finish(self, live: Collection[int]) -> None:
        """Keep this tick's reads for the next, of the processes that are still there."""
        self._kept = self._next_kept
        self._maps_cut = {p for p in self._maps_cut if p in live}
        self._asked = {(p, t) for p, t in self._asked if p in live}

    def read(
        self, pid: int, key: tuple[int, str], num_threads: int, probe: ProbeReading
    ) -> ProcessReads | None:
        """This tick's reads of the process's threads (``key``: its (start time, comm);
        ``num_threads``: as its stat counts them); None if it has none left."""
        kept = self._kept.get(pid)
        if kept is not None and kept.key != key:
            kept = None  # the PID was reused, or the process exec'd: another process
        got = self._reads_if_unlisted(pid, num_threads, kept, probe)
        unlisted = got is not None
        if got is None:
            got = self._reads_listed(pid, probe, kept.reads if kept else {})
        reads, quiet = got
        if not reads:
            return None
        quiet = quiet and kept is not None and (unlisted or kept.tids == tuple(reads))
        return ProcessReads(reads, kept, quiet)

    def keep(
        self,
        pid: int,
        key: tuple[int, str],
        got: ProcessReads,
        sample: ProcessSample,
        sockets: Mapping[int, int],
    ) -> None:
        """Keep the process's sample and what it was read from (``got``: read's answer;
        ``sockets``: inode -> fd) for the next tick."""
        reads, kept, quiet = got
        if quiet and kept is not None and reads is kept.reads:  # not one read changed
            self._next_kept[pid] = replace(kept, sample=sample, sockets=sockets)
            return
        tids = tuple(reads)
        proven = frozenset((t, r.wait_since_ns) for t, r in reads.items() if r.wait_since_ns)
        others = frozenset(t for t, r in reads.items() if not r.wait_since_ns)
        seeds = self._seeds
        marked = frozenset(t for t in others if seeds.get(t) == (pid, reads[t].cpu_ns))
        self._next_kept[pid] = Kept(
            key, tids, reads, sample, sockets, proven, others, marked, others - marked
        )

    def epoll_fds(self, pid: int) -> list[int]:
        """The epoll fds that the process's blocked threads wait in, as the tick begun last
        read them (one per such thread)."""
        kept = self._next_kept.get(pid)
        out = []
        for r in kept.reads.values() if kept is not None else ():
            sc = r.syscall
            entry = BY_NR.get(sc.nr) if r.blocked and sc is not None and sc.args else None
            if entry is not None and entry.fds == EPOLL and sc is not None:
                out.append(sc.args[0])
        return out

    def _reads_listed(
        self, pid: int, probe: ProbeReading, before: Mapping[int, ThreadRead]
    ) -> tuple[Mapping[int, ThreadRead], bool]:
        """The reads of every thread /proc/PID/task lists (``before``: the last tick's), and
        whether none of them ran."""
        reads: dict[int, ThreadRead] = {}
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
        self, pid: int, num_threads: int, kept: Kept | None, probe: ProbeReading
    ) -> tuple[Mapping[int, ThreadRead], bool] | None:
        """The threads' reads without listing them, where the last tick's threads are
        provably all there is: as many as the process counts now, those read in a futex
        wait still in it (the probe's in-flight waits hold the same starts: not one of them
        left it, so none exited or started a thread), the others read again. None where
        that does not hold (then they are listed)."""
        if kept is None or num_threads != len(kept.tids):
            return None
        if kept.proven and not kept.proven <= self._waiting.get(pid, frozenset()):
            return None
        changed: dict[int, ThreadRead] = {}
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

    def samples(
        self, pid: int, reads: Mapping[int, ThreadRead], probe: ProbeReading
    ) -> tuple[tuple[ThreadSample, ...], Mapping[int, tuple]]:
        """The process's threads from this tick's reads, their lock words read and their
        stacks and words placed in its memory maps."""
        with LockWords(self.proc, pid) as words:
            threads = []
            stack_ptrs = {}
            for tid, read in reads.items():
                t, sp = self._thread(pid, tid, read, probe, words)
                threads.append(t)
                if sp:
                    stack_ptrs[tid] = sp
            placed, word_ids = self._place_in_maps(pid, threads, stack_ptrs)
            return Threads(placed), word_ids

    def shared_words_again(
        self, pid: int, sample: ProcessSample
    ) -> tuple[tuple[ThreadSample, ...], Mapping[int, tuple]]:
        """A quiet process's last threads, with the lock words it waits on in shared
        mappings read again: another process may have taken or released them."""
        shared = {a for a, ident in sample.word_ids.items() if ident[0] == "shared"}
        if not shared:
            return sample.threads, sample.word_ids
        with LockWords(self.proc, pid) as lock_words:
            words = {a: lock_words.at(a) for a in shared}
        threads = []
        for t in sample.threads:
            if t.wait is not None and t.wait.uaddr in words and not t.wait.vector:
                t = replace(t, lock=words[t.wait.uaddr])
            if t.refused is not None and t.refused.uaddr in words:
                t = replace(t, refused=replace(t.refused, lock=words[t.refused.uaddr]))
            threads.append(t)
        return Threads(threads), sample.word_ids

    def _read_thread(
        self, pid: int, tid: int, probe: ProbeReading, before: ThreadRead | None
    ) -> tuple[ThreadRead, bool] | None:
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
        read = ThreadRead(cpu, st.comm, st.state, sc, last_ran, since if in_futex else None)
        self._note_unmarked(pid, tid, read)
        return read, False

    def _note_unmarked(self, pid: int, tid: int, read: ThreadRead) -> None:
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
        read: ThreadRead,
        probe: ProbeReading,
        words: LockWords,
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
        lock = words.at(wait.uaddr) if wait is not None and not wait.vector else None
        refused = None
        r = probe.refusals.get(tid)
        if r is not None and r[0] == pid and wait is not None:
            refused = Refusal(uaddr=r[1], ts_ns=r[2], lock=words.at(r[1]))
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
