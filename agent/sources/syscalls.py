"""What a blocked thread waits in: its syscall by name, the kind of wait, and whether it has
a timeout, from the numbers and raw arguments of /proc/PID/task/TID/syscall (x86-64).

Only the syscalls that threads block in are named; any other shows as its number. The kind
says who can end the wait: a futex wait without a timeout ends only when another thread
wakes it (or a signal); an I/O wait when data or a peer arrives; a sleep or a timed wait
when its time is up, whatever else happens.
"""

from __future__ import annotations

from dataclasses import dataclass

from .procfs import SyscallLine

FUTEX, IO, SLEEP, CHILD, SIGNAL, OTHER = "futex", "io", "sleep", "child", "signal", "other"

# nr -> (name, kind, index of its timeout argument or None, how that argument reads):
# "ptr": a pointer, 0 means none; "ms": an int of milliseconds, negative means none;
# "always": the call is a timed wait by nature (a sleep).
_TABLE: dict[int, tuple[str, str, int | None, str]] = {
    0: ("read", IO, None, ""),
    1: ("write", IO, None, ""),
    7: ("poll", IO, 2, "ms"),
    17: ("pread64", IO, None, ""),
    19: ("readv", IO, None, ""),
    23: ("select", IO, 4, "ptr"),
    34: ("pause", SIGNAL, None, ""),
    35: ("nanosleep", SLEEP, None, "always"),
    43: ("accept", IO, None, ""),
    45: ("recvfrom", IO, None, ""),
    47: ("recvmsg", IO, None, ""),
    61: ("wait4", CHILD, None, ""),
    72: ("fcntl", OTHER, None, ""),  # F_SETLKW: a file lock
    73: ("flock", OTHER, None, ""),
    128: ("rt_sigtimedwait", SIGNAL, 2, "ptr"),
    130: ("rt_sigsuspend", SIGNAL, None, ""),
    202: ("futex", FUTEX, 3, "ptr"),
    230: ("clock_nanosleep", SLEEP, None, "always"),
    232: ("epoll_wait", IO, 3, "ms"),
    247: ("waitid", CHILD, None, ""),
    270: ("pselect6", IO, 4, "ptr"),
    271: ("ppoll", IO, 2, "ptr"),
    281: ("epoll_pwait", IO, 3, "ms"),
    288: ("accept4", IO, None, ""),
    299: ("recvmmsg", IO, 4, "ptr"),
    426: ("io_uring_enter", IO, None, ""),
    441: ("epoll_pwait2", IO, 3, "ptr"),
    449: ("futex_waitv", FUTEX, 3, "ptr"),
    455: ("futex_wait", FUTEX, 4, "ptr"),
}


@dataclass(frozen=True)
class SyscallWait:
    nr: int
    name: str  # "futex", "epoll_wait", ...; "syscall 999" when not in the table
    kind: str  # FUTEX, IO, SLEEP, CHILD, SIGNAL or OTHER
    timed: bool | None  # True: it ends by itself; False: it has no timeout; None: unknown


def syscall_name(nr: int) -> str:
    entry = _TABLE.get(nr)
    return entry[0] if entry else f"syscall {nr}"


def wait_kind(nr: int | None) -> str:
    entry = _TABLE.get(nr) if nr is not None else None
    return entry[1] if entry else OTHER


def syscall_wait(sc: SyscallLine | None) -> SyscallWait | None:
    """The wait a thread is blocked in, from its syscall line; None when it is in none."""
    if sc is None or sc.nr < 0:
        return None
    entry = _TABLE.get(sc.nr)
    if entry is None:
        return SyscallWait(sc.nr, f"syscall {sc.nr}", OTHER, None)
    name, kind, at, how = entry
    timed: bool | None = None
    if how == "always":
        timed = True
    elif at is None:
        timed = False
    elif at < len(sc.args):
        arg = sc.args[at]
        # "ptr": none when NULL; "ms": a C int in a 64-bit register, negative waits forever
        timed = arg != 0 if how == "ptr" else not arg & 0x80000000
    return SyscallWait(sc.nr, name, kind, timed)


FUTEX_PRIVATE_FLAG = 128  # futex(2) op flag; futex_wait(2)'s FUTEX2_PRIVATE has the same value


def futex_private(sc: SyscallLine | None) -> bool | None:
    """Whether a futex wait is process-private, from its raw arguments; None when not a
    futex wait or unknown (futex_waitv keeps its flags per word, in user memory)."""
    if sc is None or len(sc.args) < 4:
        return None
    if sc.nr == 202:
        return bool(sc.args[1] & FUTEX_PRIVATE_FLAG)
    if sc.nr == 455:
        return bool(sc.args[3] & FUTEX_PRIVATE_FLAG)
    return None
