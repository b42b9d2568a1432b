"""What a thread blocked on file descriptors waits for, as data: the socket and its peer, the
pipe, the eventfd or file behind each fd of its read, accept, poll, select or epoll_wait.

Read at report time from /proc (the syscall's arguments, /proc/PID/fd links, an epoll set's
fdinfo, and for poll and select the fd lists in the thread's memory, read-only): a report
asks once per waiting thread, never per tick. Bounded: at most MAX_FDS fds kept per wait.
agent.report.fds says it in words.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping

from ..model import FdLink, FdWait, ProcessSample, SocketPeer
from ..sources.procfs import ProcFS
from ..sources.tcpinfo import TCP_LISTEN
from ..syscalls import EPOLL, FUTEX, ONE_FD, POLL, SELECT, fd_layout, wait_kind

MAX_FDS = 4  # named per wait; the rest are counted
MAX_POLL = 64  # pollfd entries read from a poll(2) list
MAX_SELECT_BYTES = 128  # of a select(2) read set: fds up to 1024, FD_SETSIZE


def fd_name(target: str | None, fd: int) -> str:
    """An fd by its /proc/PID/fd link, as evidence names it: "a pipe (fd 3)", "the terminal
    /dev/pts/1", "/var/log/x.log (fd 3)"; a socket, whose peer the link does not say, as
    "a socket (fd 3)"."""
    if target is None:
        return f"fd {fd}"
    if target.startswith("socket:["):
        return f"a socket (fd {fd})"
    if target.startswith("pipe:"):
        return f"a pipe (fd {fd})"
    if target == "anon_inode:[eventfd]":
        return f"an eventfd (fd {fd})"
    if target == "anon_inode:[eventpoll]":
        return f"an epoll set (fd {fd})"
    if target.startswith("anon_inode:"):
        return f"{target[11:].strip('[]')} (fd {fd})"
    if target.startswith(("/dev/pts/", "/dev/tty")):
        return f"the terminal {target}"
    return f"{target} (fd {fd})"


def sockets(proc: ProcFS, pid: int) -> dict[int, SocketPeer]:
    """Inode -> what each socket of the process's network namespace is: TCP by peer or
    listening port, unix sockets by their bound path (the side that connected has none)."""
    out: dict[int, SocketPeer] = {}
    for s in proc.tcp_sockets(pid):
        if s.state == TCP_LISTEN:
            out[s.inode] = SocketPeer("listening", port=s.port)
        elif s.remote_port:
            out[s.inode] = SocketPeer("tcp", port=s.remote_port, address=s.remote_address)
    for inode, path in proc.unix_socket_paths(pid).items():
        out[inode] = SocketPeer("unix", path=path)
    return out


def fd_link(target: str | None, fd: int, known: Mapping[int, SocketPeer] | None = None) -> FdLink:
    """One fd, with its socket's peer where ``known`` (inode -> peer, see sockets) has it."""
    peer = None
    if target is not None and target.startswith("socket:["):
        inner = target[8:-1]
        peer = (known or {}).get(int(inner)) if inner.isdigit() else None
    return FdLink(fd, fd_name(target, fd), peer)


def _read(proc: ProcFS, pid: int, addr: int, size: int) -> bytes | None:
    mem = proc.open_memory(pid)
    if mem is None:
        return None
    with mem:
        return mem.read(addr, size)


def poll_fds(proc: ProcFS, pid: int, addr: int, nfds: int) -> list[int]:
    """The fds of a poll(2) list: struct pollfd {int fd; short events, revents;}."""
    n = min(nfds, MAX_POLL)
    data = _read(proc, pid, addr, 8 * n) if n > 0 else None
    if data is None or len(data) < 8 * n:
        return []
    return [fd for (fd, _e, _r) in struct.iter_unpack("<ihh", data) if fd >= 0]


def select_fds(proc: ProcFS, pid: int, nfds: int, readfds: int) -> list[int]:
    """The fds of a select(2) read set (a bitmap, fd i at bit i)."""
    size = min((nfds + 7) // 8, MAX_SELECT_BYTES)
    data = _read(proc, pid, readfds, size) if readfds and size > 0 else None
    if not data:
        return []
    return [i for i in range(len(data) * 8) if data[i // 8] >> (i % 8) & 1 and i < nfds]


def waited_on(
    proc: ProcFS,
    pid: int,
    tid: int,
    known: Mapping[int, SocketPeer] | None = None,
) -> FdWait | None:
    """What the thread's blocking syscall waits on; None when it waits on no fd or nothing
    could be read. ``known``: the process's sockets (``sockets``), read once."""
    sc = proc.thread_syscall(pid, tid)
    if sc is None or not sc.args:
        return None
    layout, args = fd_layout(sc.nr), sc.args
    if layout == ONE_FD:
        fds = [args[0]]
    elif layout == EPOLL:
        fds = proc.epoll_fds(pid, args[0])
    elif layout == POLL and len(args) > 1:
        fds = poll_fds(proc, pid, args[0], args[1])
    elif layout == SELECT and len(args) > 1:
        fds = select_fds(proc, pid, args[0], args[1])
    else:
        return None
    fds = [fd for fd in fds if 0 <= fd < 1 << 31]
    if not fds:
        return None
    links = tuple(fd_link(proc.fd_target(pid, fd), fd, known) for fd in fds[:MAX_FDS])
    return FdWait(links, max(0, len(fds) - MAX_FDS))


def waits_on(proc: ProcFS, samples: Iterable[ProcessSample]) -> dict[tuple[int, int], FdWait]:
    """(pid, tid) -> what each thread blocked on fds waits on, for every thread of
    ``samples`` that is (a futex wait has no fd)."""
    out = {}
    for p in samples:
        known: dict[int, SocketPeer] | None = None
        for t in p.threads:
            if t.blocked and t.syscall is not None and wait_kind(t.syscall) != FUTEX:
                if known is None:
                    known = sockets(proc, p.pid)  # once per process, and only if needed
                what = waited_on(proc, p.pid, t.tid, known)
                if what is not None:
                    out[(p.pid, t.tid)] = what
    return out
