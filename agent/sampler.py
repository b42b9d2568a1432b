"""Builds a Snapshot from /proc and the probe's reading: the one place that joins them."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import replace

from .model import (
    FUTEX_CMD_MASK,
    WAIT_OPS,
    FutexWait,
    Listener,
    LockRead,
    ProbeReading,
    ProcessSample,
    Refusal,
    Snapshot,
    ThreadSample,
)
from .procfs import (
    SYS_FUTEX,
    SYS_FUTEX_WAIT,
    SYS_FUTEX_WAITV,
    TCP_ESTABLISHED,
    TCP_LISTEN,
    ProcessMemory,
    ProcFS,
    SyscallLine,
)
from .waitgraph import owner_candidates

FUTEX_SYSCALLS = frozenset({SYS_FUTEX, SYS_FUTEX_WAIT, SYS_FUTEX_WAITV})


def descendants(proc: ProcFS, roots: Iterable[int]) -> dict[int, list[int]]:
    """root -> [root, its descendants...] from one pass over /proc's ppids."""
    children: dict[int, list[int]] = {}
    for pid in proc.pids():
        st = proc.stat(pid)
        if st is not None:
            children.setdefault(st.ppid, []).append(pid)
    out = {}
    for root in roots:
        members, todo = [], [root]
        while todo:
            pid = todo.pop()
            members.append(pid)
            todo.extend(children.get(pid, ()))
        out[root] = members
    return out


def seeded_wait(sc: SyscallLine | None) -> FutexWait | None:
    """A futex wait as /proc/PID/task/TID/syscall shows it, for threads blocked before we attached."""
    if sc is None or sc.nr not in FUTEX_SYSCALLS or len(sc.args) < 3:
        return None
    if sc.nr == SYS_FUTEX:
        op = sc.args[1] & FUTEX_CMD_MASK
        if op not in WAIT_OPS:
            return None
        return FutexWait(sc.args[0], op, sc.args[2] & 0xFFFFFFFF, source="proc")
    if sc.nr == SYS_FUTEX_WAIT:
        return FutexWait(sc.args[0], 9, sc.args[1] & 0xFFFFFFFF, source="proc")
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


class Sampler:
    """Takes snapshots of a set of processes."""

    def __init__(
        self,
        proc: ProcFS | None = None,
        clock_ns: Callable[[], int] = time.monotonic_ns,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.proc = proc or ProcFS()
        self.clock_ns = clock_ns
        self.wall = wall

    def snapshot(self, pids: Iterable[int], probe: ProbeReading | None = None) -> Snapshot:
        probe = probe or ProbeReading()
        now = self.clock_ns()
        wall = self.wall()
        processes: dict[int, ProcessSample] = {}
        gone = set()
        net_cache: dict[str, list] = {}
        for pid in pids:
            p = self._process(pid, probe, net_cache)
            if p is None:
                gone.add(pid)
            else:
                processes[pid] = p
        known = {t.tid for p in processes.values() for t in p.threads}
        foreign = {}
        for tid in owner_candidates(processes.values()) - known:
            tgid = self.proc.tgid_of(tid)
            if tgid is not None:
                foreign[tid] = tgid
        return Snapshot(now, wall, processes, frozenset(gone), foreign)

    def _process(self, pid: int, probe: ProbeReading, net_cache: dict) -> ProcessSample | None:
        proc = self.proc
        st = proc.stat(pid)
        if st is None or st.state in ("Z", "X"):
            return None
        mem = proc.open_memory(pid)
        try:
            threads = []
            stack_ptrs = {}
            for tid in proc.tids(pid):
                t, sp = self._thread(pid, tid, probe, mem)
                if t is not None:
                    threads.append(t)
                    if sp:
                        stack_ptrs[tid] = sp
            threads, word_ids = self._place_in_maps(pid, threads, stack_ptrs)
        finally:
            if mem is not None:
                mem.close()
        if not threads:
            return None
        listeners, unread = self._sockets(pid, net_cache)
        return ProcessSample(
            pid=pid,
            ppid=st.ppid,
            comm=st.comm,
            start_ticks=st.start_ticks,
            threads=tuple(threads),
            write_bytes=proc.io_wchar(pid),
            listeners=listeners,
            unread_bytes=unread,
            word_ids=word_ids,
        )

    def _thread(
        self, pid: int, tid: int, probe: ProbeReading, mem: ProcessMemory | None
    ) -> tuple[ThreadSample | None, int | None]:
        proc = self.proc
        st = proc.thread_stat(pid, tid)
        cpu = proc.thread_cpu_ns(pid, tid)
        if st is None or cpu is None or st.state in ("Z", "X"):
            return None, None
        blocked = st.state not in ("R",)
        sc = proc.thread_syscall(pid, tid) if blocked else None
        last_ran = None
        if blocked:
            ms = proc.thread_exec_start_ms(pid, tid)
            # se.exec_start is in ms of the scheduler clock, which on Linux tracks
            # CLOCK_MONOTONIC; clamp so a skew never puts it in the future.
            last_ran = min(int(ms * 1e6), self.clock_ns()) if ms is not None else None
        wait = None
        in_futex = sc is not None and sc.nr in FUTEX_SYSCALLS
        if in_futex:
            # The probe saw the wait begin (start time, exact op); /proc only says where it is.
            # A probe entry without /proc agreement is stale: the thread died or moved on.
            hit = probe.inflight.get(tid)
            fresh = hit is not None and hit.tgid == pid
            if fresh and hit is not None and sc is not None and sc.nr == SYS_FUTEX:
                fresh = sc.args[0] == hit.wait.uaddr
            wait = hit.wait if fresh and hit is not None else seeded_wait(sc)
        lock = _lock_read(mem, wait.uaddr) if wait is not None and not wait.vector else None
        refused = None
        r = probe.refusals.get(tid)
        if r is not None and r[0] == pid and wait is not None:
            refused = Refusal(uaddr=r[1], ts_ns=r[2], lock=_lock_read(mem, r[1]))
        sample = ThreadSample(
            tid=tid,
            name=st.comm,
            state=st.state,
            cpu_ns=cpu,
            last_ran_ns=last_ran,
            syscall=sc.nr if sc is not None else None,
            wait=wait,
            lock=lock,
            refused=refused,
        )
        return sample, sc.sp if sc is not None else None

    def _place_in_maps(
        self, pid: int, threads: list[ThreadSample], stack_ptrs: dict[int, int]
    ) -> tuple[list[ThreadSample], dict[int, tuple]]:
        """One read of /proc/PID/maps, for processes with waits, gives two things:
        each blocked thread's stack mapping (validates pthread_join edges), and the
        identity of futex words in shared mappings, as (device, inode, offset), so that
        one barrier in shared memory is one word in every process that maps it."""
        addrs = {t.wait.uaddr for t in threads if t.wait and not t.wait.vector}
        addrs |= {t.refused.uaddr for t in threads if t.refused}
        if not addrs:
            return threads, {}
        maps = self.proc.maps(pid)
        word_ids = {}
        for m in maps:
            if "s" not in m.perms:
                continue
            for a in addrs:
                if m.start <= a < m.end:
                    word_ids[a] = ("shared", m.dev, m.inode, m.offset + (a - m.start))
        placed = []
        for t in threads:
            sp = stack_ptrs.get(t.tid)
            stack = next((m for m in maps if sp is not None and m.start <= sp < m.end), None)
            placed.append(replace(t, stack=(stack.start, stack.end)) if stack else t)
        return placed, word_ids

    def _sockets(self, pid: int, net_cache: dict) -> tuple[tuple[Listener, ...], int]:
        inodes = self.proc.socket_inodes(pid)
        if not inodes:
            return (), 0
        ns = self.proc.net_namespace(pid) or f"pid:{pid}"
        if ns not in net_cache:
            net_cache[ns] = self.proc.tcp_sockets(pid)
        listeners, unread = [], 0
        for s in net_cache[ns]:
            if s.inode not in inodes:
                continue
            if s.state == TCP_LISTEN:
                listeners.append(Listener(s.family, s.address, s.port, s.rx_queue, s.tx_queue))
            elif s.state == TCP_ESTABLISHED:
                unread += s.rx_queue
        return tuple(listeners), unread
