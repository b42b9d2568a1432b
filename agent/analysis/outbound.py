"""Which writes leave the service: the only writes that count as progress.

Progress is work for someone outside the service. A write reaches outside when it goes to a
file, a terminal, a pipe read outside the service (a log), or a TCP peer that is not one of
the service's own sockets. Chatter between its own processes and threads (eventfds, pipes it
reads itself, unix sockets, loopback TCP between its processes) and writes to /dev/null reach
nobody (docs/how-it-works.md, "Progress and park time").
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping

from ..model import Connection, FdWrites, PortWrites, ProcessSample

FILE = "file"
TERMINAL = "terminal"
CLIENT = "client"  # a TCP peer outside the service
UNKNOWN = "unknown"  # closed before it could be named: counted, so a real write is never lost
LEAVES = frozenset({FILE, TERMINAL, CLIENT, UNKNOWN})
SERVICE = "service"  # eventfd, a pipe read inside, a unix socket, TCP to a service socket
NOWHERE = "nowhere"  # /dev/null


class ServiceEnds:
    """The service's own ends of its connections and pipes, to tell where a write goes."""

    def __init__(self, connections: Iterable[Connection], pipes_read: Collection[int]) -> None:
        """``pipes_read``: inodes of the pipes the service's processes hold open for reading
        (the caller may leave them out when no write it asks about goes to a pipe)."""
        self.by_inode = {c.inode: c for c in connections}
        self._locals: set[tuple[str, int]] | None = None  # built at the first socket asked
        self.pipes_read = pipes_read

    @property
    def locals(self) -> set[tuple[str, int]]:
        """The service's own ends of its connections."""
        if self._locals is None:
            self._locals = {c.local for c in self.by_inode.values()}
        return self._locals

    def destination(self, target: str | None) -> str:
        """Where a write to an fd pointing at ``target`` (its /proc/PID/fd link) goes."""
        if target is None:
            return UNKNOWN
        if target == "/dev/null":
            return NOWHERE
        if target.startswith(("/dev/pts/", "/dev/tty")):
            return TERMINAL
        if target.startswith("/"):
            return FILE
        if target.startswith("socket:["):
            return self.socket_destination(inode_of(target))
        if target.startswith("pipe:["):
            return SERVICE if inode_of(target) in self.pipes_read else FILE
        return SERVICE  # anon_inode:[eventfd], [eventpoll], [timerfd], ...

    def socket_destination(self, inode: int) -> str:
        """Where a write to the socket ``inode`` goes: to a client (a TCP peer outside the
        service), or inside it."""
        c = self.by_inode.get(inode)
        if c is None:
            return SERVICE  # unix, netlink, or a TCP socket already closed
        return SERVICE if c.remote in self.locals else CLIENT


def inode_of(target: str) -> int:
    """'socket:[1234]' -> 1234 (0 if it does not parse)."""
    inner = target[target.find("[") + 1 : -1]
    return int(inner) if inner.isdigit() else 0


def received_from_outside(
    old: ProcessSample | None,
    new: ProcessSample,
    ends: ServiceEnds,
    front_ports: frozenset[int],
) -> int:
    """Bytes the process received in the window from peers outside the service, on
    connections that are not requests at a front door (tcp_info's byte counts; a
    connection opened in the window counts whole)."""
    before = {c.inode: c.bytes_received for c in old.connections} if old is not None else {}
    total = 0
    for c in new.connections:
        if c.bytes_received is None or c.local_port in front_ports:
            continue
        if ends.socket_destination(c.inode) != CLIENT:
            continue
        if c.inode in before and before[c.inode] is None:
            continue  # not read at the window's start: its count says nothing of the window
        total += max(0, c.bytes_received - (before.get(c.inode) or 0))
    return total


def door_answers(
    latest: Mapping[int, PortWrites],
    old: Mapping[int, PortWrites],
    front_ports: Collection[int],
    listening: Collection[int],
) -> tuple[int, int]:
    """A process's writes in the window on connections it accepted, placed by the port they
    were accepted on (counted by the probe when written, whatever became of the connection):
    (answers to clients, at a front door; bytes not placed, at a port that no longer
    listens). An internal door's (every peer a process of the service) stay inside."""
    answered = unplaced = 0
    for port, pw in latest.items():
        prev = old.get(port)
        delta = pw.bytes - (prev.bytes if prev is not None else 0)
        if delta <= 0:
            continue
        if port in front_ports:
            answered += delta
        elif port not in listening:
            unplaced += delta
    return answered, unplaced


def fd_rest(latest: FdWrites, old: FdWrites | None) -> int:
    """Bytes written to an fd in the window that are placed by its name: all but those on
    connections accepted at a counted port (``door_answers`` places those) and those the
    kernel saw go to a unix socket (inside the service, whatever the fd names now)."""
    delta = latest.bytes - latest.door_bytes - latest.unix_bytes
    if old is not None:
        delta -= old.bytes - old.door_bytes - old.unix_bytes
    return delta


def closed_file(latest: FdWrites, old: FdWrites | None, rest: int) -> str | None:
    """What to call a file the kernel saw written through this fd when its name could not be
    read (opened, written and closed within a tick): "a file (inode N)", if all of ``rest``
    (the fd's bytes placed by name, ``fd_rest``) went to regular files; else None."""
    to_files = latest.file_bytes - (old.file_bytes if old is not None else 0)
    if latest.file_ino and rest > 0 and to_files >= rest:
        return f"a file (inode {latest.file_ino})"
    return None
