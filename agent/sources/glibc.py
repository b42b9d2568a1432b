"""Lock words read from a process's memory (/proc/PID/mem), as glibc lays them out.

A futex word is read with the pthread_mutex_t fields beside it (its owner's TID, its users,
its kind), so that the analysis can tell a mutex's owner without uprobes. Read-only: a
target's memory is never written.
"""

from __future__ import annotations

from ..model import LockRead
from .procfs import ProcessMemory, ProcFS


def lock_read(mem: ProcessMemory | None, uaddr: int) -> LockRead | None:
    """The lock word at ``uaddr`` and, where they can be read, the mutex fields after it."""
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


class LockWords:
    """One process's lock words, each read once however many threads wait on it; the
    process's memory is open from construction until close (or the end of a with)."""

    def __init__(self, proc: ProcFS, pid: int) -> None:
        self._mem = proc.open_memory(pid)
        self._read: dict[int, LockRead | None] = {}

    def at(self, uaddr: int) -> LockRead | None:
        read = self._read
        if uaddr not in read:
            read[uaddr] = lock_read(self._mem, uaddr)
        return read[uaddr]

    def close(self) -> None:
        if self._mem is not None:
            self._mem.close()

    def __enter__(self) -> LockWords:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
