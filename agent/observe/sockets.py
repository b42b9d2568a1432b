"""The TCP sockets of the watched processes, read from their network namespaces each tick by
the local ports they are known to hold, so that a tick costs what the watched processes hold,
not what the host holds.

A namespace's table (sock_diag, or /proc/net/tcp where that cannot be read) lists every
socket in it: on a host shared with other tenants, or with the clients of a front-end on the
same host, most of them are not ours. So the kernel is asked only for the local ports of
our sockets, as learned from earlier ticks (a socket's local port never changes once it has
one). A socket it cannot place that way is new (an outbound connection on a port the kernel
chose): then the whole table is read once, and the port learned. Sockets that are not TCP
(unix, UDP, netlink: most of a Ray or vLLM process's) are told apart once per socket by the
protocol name the kernel gives each socket inode, and never asked for.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from ..sources.procfs import ProcFS, TcpSocket

TCP_PROTOCOLS = ("TCP", "TCPv6")


class SocketTables:
    """Per network namespace, the TCP sockets the watched processes hold (see the module)."""

    def __init__(self, proc: ProcFS) -> None:
        self.proc = proc
        self._tcp: dict[int, bool] = {}  # socket inode -> whether it is TCP (or may be)
        self._ports: dict[str, dict[int, int]] = {}  # ns -> our TCP inode -> its local port
        # ns -> our TCP inodes that even the whole table did not list (not yet bound, or
        # connecting): asked for again once their process has run
        self._unlisted: dict[str, frozenset[int]] = {}
        self.whole_reads = 0  # how many times a whole table was read (tests, the bench)

    def read(
        self, ns: str, fds: Mapping[int, Mapping[int, int]], ran: Collection[int]
    ) -> list[TcpSocket]:
        """The TCP sockets of namespace ``ns`` that the processes of ``fds`` (pid -> socket
        inode -> fd) hold; ``ran``: those of them that ran since the last tick (only they
        can have bound, listened or connected a socket)."""
        owner = {inode: (pid, fd) for pid, held in fds.items() for inode, fd in held.items()}
        tcp = {inode for inode, (pid, fd) in owner.items() if self._is_tcp(inode, pid, fd)}
        pid = next(iter(fds))
        known = self._ports.get(ns, {})
        ports = {known[i] for i in tcp if i in known}
        table = self.proc.tcp_sockets(pid, ports) if ports else []
        missing = tcp - {s.inode for s in table}
        unlisted = self._unlisted.get(ns, frozenset())
        if missing - unlisted or any(owner[i][0] in ran for i in missing):
            table = self.proc.tcp_sockets(pid)
            self.whole_reads += 1
            missing = tcp - {s.inode for s in table}
        mine = [s for s in table if s.inode in owner]
        self._ports[ns] = {s.inode: s.port for s in mine}
        self._unlisted[ns] = frozenset(missing)
        return mine

    def forget(self, live_namespaces: Collection[str], live_inodes: Collection[int]) -> None:
        """Drop what is kept of namespaces and sockets no watched process holds any more (a
        socket's inode number can be handed out again once it is closed)."""
        self._tcp = {i: v for i, v in self._tcp.items() if i in live_inodes}
        self._ports = {ns: v for ns, v in self._ports.items() if ns in live_namespaces}
        self._unlisted = {ns: v for ns, v in self._unlisted.items() if ns in live_namespaces}

    def _is_tcp(self, inode: int, pid: int, fd: int) -> bool:
        known = self._tcp.get(inode)
        if known is None:
            name = self.proc.socket_protocol(pid, fd)
            known = self._tcp[inode] = name is None or name in TCP_PROTOCOLS  # unknown: may be
        return known
