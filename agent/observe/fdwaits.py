"""What a thread blocked on file descriptors waits for, as data: the socket and its peer, the
pipe, the eventfd or file behind each fd of its read, accept, poll, select or epoll_wait.

Read at report time from /proc (the syscall's arguments, /proc/PID/fd links, an epoll set's
fdinfo, and for poll and select the fd lists in the thread's memory, read-only): a report
asks once per waiting thread, never per tick. Bounded: at most MAX_FDS fds kept per wait.
agent.report.fds says it in words.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator, Mapping

from ..model import FdLink, FdWait, ProcessSample, SocketPeer, fd_name
from ..sources.procfs import ProcFS
from ..sources.tcpinfo import TCP_LISTEN
from ..syscalls import EPOLL, FUTEX, ONE_FD, POLL, SELECT, fd_layout, wait_kind

MAX_FDS = 4  # named per wait; the rest are counted
MAX_POLL = 64  # pollfd entries read from a poll(2) list
MAX_SELECT_BYTES = 128  # of a select(2) read set: fds up to 1024, FD_SETSIZE


class SocketPeers(Mapping[int, SocketPeer]):
    """Inode -> what a socket of a process's network namespace is: TCP by peer or listening
    port (the namespace's table, read once), a unix socket by its bound path (the side that
    connected has none), looked up by inode when first asked: a namespace may hold 100,000
    unix sockets, and a report asks about a few."""

    def __init__(self, proc: ProcFS, pid: int) -> None:
        self.proc, self.pid = proc, pid
        self.tcp: dict[int, SocketPeer] = {}
        for s in proc.tcp_sockets(pid):
            if s.state == TCP_LISTEN:
                self.tcp[s.inode] = SocketPeer("listening", port=s.port)
            elif s.remote_port:
                self.tcp[s.inode] = SocketPeer("tcp", port=s.remote_port, address=s.remote_address)
        self.unix: dict[int, SocketPeer | None] = {}

    def look_up(self, inodes: Iterable[int]) -> None:
        """Look up the unix paths of ``inodes`` not yet known, in one read."""
        new = {i for i in inodes if i not in self.tcp and i not in self.unix}
        if not new:
            return
        paths = self.proc.unix_socket_paths(self.pid, new)
        for i in new:
            self.unix[i] = SocketPeer("unix", path=paths[i]) if i in paths else None

    def __getitem__(self, inode: int) -> SocketPeer:
        self.look_up([inode])
        peer = self.tcp.get(inode) or self.unix.get(inode)
        if peer is None:
            raise KeyError(inode)
        return peer

    def __iter__(self) -> Iterator[int]:
        yield from self.tcp
        yield from (i for i, p in self.unix.items() if p is not None and i not in self.tcp)

    def __len__(self) -> int:
        return sum(1 for _ in self)


def sockets(proc: ProcFS, pid: int) -> SocketPeers:
    """What the sockets of the process's network namespace are (SocketPeers)."""
    return SocketPeers(proc, pid)


def _socket_inode(target: str | None) -> int | None:
    if target is None or not target.startswith("socket:["):
        return None
    inner = target[8:-1]
    return int(inner) if inner.isascii() and inner.isdigit() else None


def fd_link(target: str | None, fd: int, known: Mapping[int, SocketPeer] | None = None) -> FdLink:
    """One fd, with its socket's peer where ``known`` (inode -> peer, see sockets) has it."""
    inode = _socket_inode(target)
    peer = known.get(inode) if known is not None and inode is not None else None
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
    targets = [(fd, proc.fd_target(pid, fd)) for fd in fds[:MAX_FDS]]
    if isinstance(known, SocketPeers):  # the unix sockets among them, in one lookup
        known.look_up(i for _, t in targets if (i := _socket_inode(t)) is not None)
    links = tuple(fd_link(target, fd, known) for fd, target in targets)
    return FdWait(links, max(0, len(fds) - MAX_FDS))


def waits_on(proc: ProcFS, samples: Iterable[ProcessSample]) -> dict[tuple[int, int], FdWait]:
    """(pid, tid) -> what each thread blocked on fds waits on, for every thread of
    ``samples`` that is (a futex wait has no fd)."""
    out = {}
    for p in samples:
        known: SocketPeers | None = None
        for t in p.threads:
            if t.blocked and t.syscall is not None and wait_kind(t.syscall) != FUTEX:
                if known is None:
                    known = sockets(proc, p.pid)  # once per process, and only if needed
                what = waited_on(proc, p.pid, t.tid, known)
                if what is not None:
                    out[(p.pid, t.tid)] = what
    return out
