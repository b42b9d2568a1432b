"""Builders of synthetic snapshots for the pure tests (no root, no BPF)."""

from __future__ import annotations

from agent.model import (
    FUTEX_LOCK_PI,
    FUTEX_WAIT,
    FUTEX_WAITERS,
    FutexWait,
    Listener,
    LockRead,
    ProcessSample,
    Refusal,
    Snapshot,
    ThreadSample,
)

S = 1_000_000_000


def parked(
    tid: int,
    uaddr: int = 0x1000,
    val: int = 0,
    lock: LockRead | None = None,
    op: int = FUTEX_WAIT,
    cpu: int = 0,
    name: str = "worker",
    since: int | None = None,
    refused: Refusal | None = None,
) -> ThreadSample:
    """A thread blocked in a futex wait; by default on a word with no owner (a condvar)."""
    return ThreadSample(
        tid=tid,
        name=name,
        state="S",
        cpu_ns=cpu,
        last_ran_ns=since,
        syscall=202,
        wait=FutexWait(uaddr, op, val, since_ns=since),
        lock=lock if lock is not None else LockRead(val),
        refused=refused,
    )


def on_mutex(tid: int, uaddr: int, owner: int, **kw) -> ThreadSample:
    """Blocked on a glibc mutex that ``owner`` holds: word 2 (contended), __owner at +8."""
    return parked(tid, uaddr, val=2, lock=LockRead(2, owner, 0, users_field=1), **kw)


def on_pi(tid: int, uaddr: int, owner: int, **kw) -> ThreadSample:
    return parked(tid, uaddr, op=FUTEX_LOCK_PI, lock=LockRead(owner | FUTEX_WAITERS), **kw)


def running(tid: int, cpu: int = 0, name: str = "busy") -> ThreadSample:
    return ThreadSample(tid=tid, name=name, state="R", cpu_ns=cpu)


def process(
    pid: int,
    *threads: ThreadSample,
    ppid: int = 1,
    comm: str = "proc",
    write_bytes: int | None = 0,
    listeners: tuple[Listener, ...] = (),
    word_ids: dict | None = None,
    start: int = 100,
) -> ProcessSample:
    return ProcessSample(
        pid=pid,
        ppid=ppid,
        comm=comm,
        start_ticks=start,
        threads=tuple(threads),
        write_bytes=write_bytes,
        listeners=listeners,
        word_ids=word_ids or {},
    )


def snapshot(*procs: ProcessSample, at: int = 100 * S, foreign: dict | None = None) -> Snapshot:
    return Snapshot(
        at, 1_700_000_000.0 + at / S, {p.pid: p for p in procs}, foreign_owners=foreign or {}
    )
