"""The x86-64 syscalls threads block in: the one table of what hangwatch knows of each.

Pure data, like agent.abi, for every layer: each syscall's number (raw, as
/proc/PID/task/TID/syscall reports it), name, kind of wait, the argument that holds its
timeout and how it reads, and where its arguments name the fds it waits on; any other shows as
its number, of kind OTHER. The kind says who can end the wait: another thread (a futex wait
without a timeout), data or a peer (an I/O wait), or time (a sleep or timed wait).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from .model import SyscallLine

# Kinds of wait.
FUTEX, IO, SLEEP, CHILD, SIGNAL, OTHER = "futex", "io", "sleep", "child", "signal", "other"
KINDS = frozenset({FUTEX, IO, SLEEP, CHILD, SIGNAL, OTHER})

# How a timeout argument reads: PTR a pointer, NULL means none; MS an int of milliseconds,
# negative means none; ALWAYS: the call is a timed wait by nature (a sleep), no argument read.
PTR, MS, ALWAYS = "ptr", "ms", "always"

# Where the fds a call waits on are in its arguments (agent.observe.fdwaits reads them):
ONE_FD = "fd"  # args[0] is the fd
EPOLL = "epoll"  # args[0] is an epoll fd: its set is in /proc/PID/fdinfo
POLL = "poll"  # args[0] points to struct pollfd[args[1]]
SELECT = "select"  # args[0] is nfds, args[1] points to the read set (a bitmap)
FD_LAYOUTS = frozenset({ONE_FD, EPOLL, POLL, SELECT})

FUTEX_PRIVATE_FLAG = 128  # futex(2) op flag; futex_wait(2)'s FUTEX2_PRIVATE has the same value


@dataclass(frozen=True)
class Syscall:
    nr: int
    name: str
    kind: str  # one of KINDS
    timeout_arg: int | None = None  # index of the argument that holds its timeout
    timeout_reads: str | None = None  # PTR or MS for timeout_arg; ALWAYS for a sleep
    fds: str | None = None  # one of FD_LAYOUTS: where the fds it waits on are
    flags_arg: int | None = None  # a futex wait: the argument with FUTEX_PRIVATE_FLAG


SYS_FUTEX = 202
SYS_FUTEX_WAITV = 449
SYS_FUTEX_WAIT = 455  # futex_wait(2), Linux 6.7+ (454 is futex_wake)

_S = Syscall
TABLE: tuple[Syscall, ...] = (
    _S(0, "read", IO, fds=ONE_FD),
    _S(1, "write", IO, fds=ONE_FD),
    _S(7, "poll", IO, 2, MS, fds=POLL),
    _S(17, "pread64", IO, fds=ONE_FD),
    _S(19, "readv", IO, fds=ONE_FD),
    _S(23, "select", IO, 4, PTR, fds=SELECT),
    _S(34, "pause", SIGNAL),
    _S(35, "nanosleep", SLEEP, timeout_reads=ALWAYS),
    _S(43, "accept", IO, fds=ONE_FD),
    _S(45, "recvfrom", IO, fds=ONE_FD),
    _S(47, "recvmsg", IO, fds=ONE_FD),
    _S(61, "wait4", CHILD),
    _S(72, "fcntl", OTHER),  # F_SETLKW: a file lock
    _S(73, "flock", OTHER),
    _S(128, "rt_sigtimedwait", SIGNAL, 2, PTR),
    _S(130, "rt_sigsuspend", SIGNAL),
    # futex(uaddr, op, val, timeout, uaddr2, val3): the op carries the flags
    _S(SYS_FUTEX, "futex", FUTEX, 3, PTR, flags_arg=1),
    _S(230, "clock_nanosleep", SLEEP, timeout_reads=ALWAYS),
    _S(232, "epoll_wait", IO, 3, MS, fds=EPOLL),
    _S(247, "waitid", CHILD),
    _S(270, "pselect6", IO, 4, PTR, fds=SELECT),
    _S(271, "ppoll", IO, 2, PTR, fds=POLL),
    _S(281, "epoll_pwait", IO, 3, MS, fds=EPOLL),
    _S(288, "accept4", IO, fds=ONE_FD),
    _S(299, "recvmmsg", IO, 4, PTR, fds=ONE_FD),
    _S(426, "io_uring_enter", IO),
    _S(441, "epoll_pwait2", IO, 3, PTR, fds=EPOLL),
    # futex_waitv(waiters, nr, flags, timeout, clockid): flags are per word, in user memory
    _S(SYS_FUTEX_WAITV, "futex_waitv", FUTEX, 3, PTR),
    # futex_wait(uaddr, val, mask, flags, timeout, clockid)
    _S(SYS_FUTEX_WAIT, "futex_wait", FUTEX, 4, PTR, flags_arg=3),
)
BY_NR: Mapping[int, Syscall] = MappingProxyType({s.nr: s for s in TABLE})
BY_NAME: Mapping[str, Syscall] = MappingProxyType({s.name: s for s in TABLE})
# The calls that block reading one fd, args[0], for input: a thread in one on a socket has
# asked for more of what its peer sends (not pread64: a file; not poll, select or epoll: they
# name no fd in a register, and an event loop waits in them for every connection alike).
INPUT_READS = frozenset(BY_NAME[n].nr for n in ("read", "readv", "recvfrom", "recvmsg", "recvmmsg"))


@dataclass(frozen=True)
class SyscallWait:
    nr: int
    name: str  # "futex", "epoll_wait", ...; "syscall 999" when not in the table
    kind: str  # FUTEX, IO, SLEEP, CHILD, SIGNAL or OTHER
    timed: bool | None  # True: it ends by itself; False: it has no timeout; None: unknown


def syscall_name(nr: int) -> str:
    entry = BY_NR.get(nr)
    return entry.name if entry else f"syscall {nr}"


def wait_kind(nr: int | None) -> str:
    entry = BY_NR.get(nr) if nr is not None else None
    return entry.kind if entry else OTHER


def kind_by_name(name: str) -> str:
    """The kind of wait of a syscall named as ``syscall_name`` names it; OTHER if unknown."""
    entry = BY_NAME.get(name)
    return entry.kind if entry else OTHER


def fd_layout(nr: int) -> str | None:
    """Where the fds syscall ``nr`` waits on are in its arguments (FD_LAYOUTS); None: no fd."""
    entry = BY_NR.get(nr)
    return entry.fds if entry else None


def syscall_wait(sc: SyscallLine | None) -> SyscallWait | None:
    """The wait a thread is blocked in, from its syscall line; None when it is in none."""
    if sc is None or sc.nr < 0:
        return None
    entry = BY_NR.get(sc.nr)
    if entry is None:
        return SyscallWait(sc.nr, f"syscall {sc.nr}", OTHER, None)
    at, how = entry.timeout_arg, entry.timeout_reads
    timed: bool | None = None
    if how == ALWAYS:
        timed = True
    elif at is None:
        timed = False
    elif at < len(sc.args):
        arg = sc.args[at]
        # PTR: none when NULL; MS: a C int in a 64-bit register, negative waits forever
        timed = arg != 0 if how == PTR else not arg & 0x80000000
    return SyscallWait(sc.nr, entry.name, entry.kind, timed)


def futex_private(sc: SyscallLine | None) -> bool | None:
    """Whether a futex wait is process-private, from its raw arguments; None when not a
    futex wait or unknown (futex_waitv keeps its flags per word, in user memory)."""
    if sc is None or len(sc.args) < 4:
        return None
    entry = BY_NR.get(sc.nr)
    if entry is None or entry.flags_arg is None:
        return None
    return bool(sc.args[entry.flags_arg] & FUTEX_PRIVATE_FLAG)
