"""The TCP sockets of the watched processes, read from their network namespaces each tick by
the local ports they are known to hold, so that a tick costs what the watched processes hold,
not what the host holds.

A namespace's table (sock_diag, or /proc/net/tcp where that cannot be read) lists every
socket in it: on a host shared with other tenants, or with the clients of a front-end on the
same host, most of them are not ours. So the kernel is asked only for our sockets, as
learned from earlier ticks: while every socket the watched processes hold is known, each
connection is looked up by its 4-tuple (a hash lookup in the kernel; a dump walks every
bucket of the table, about 1 ms here however few sockets it returns) and the listeners are
listed from their own short table; with many connections, or a socket new or gone, the
table is dumped for the local ports held (a socket's local port never changes once it has
one). A socket it cannot place that way is new (an outbound connection on a port the kernel
chose): then the whole table is read once, and the port learned. Sockets that are not TCP
(unix, UDP, netlink: most of a Ray or vLLM process's) are told apart once per socket by the
protocol name the kernel gives each socket inode, and never asked for.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from ..sources.procfs import ProcFS, TcpSocket
from ..sources.tcpinfo import TCP_LISTEN

TCP_PROTOCOLS = ("TCP", "TCPv6")
# Up to this many connections are looked up one by one; beyond, one walk of the kernel's
# table (262,144 buckets here: about 1 ms per family, then about 2 us a socket) costs less
# than the lookups (about 4.4 us each). Measured on this machine's kernel, 6.18.
MAX_LOOKUPS = 400


class SocketTables:
    """Per network namespace, the TCP sockets the watched processes hold (see the module)."""

    def __init__(self, proc: ProcFS) -> None:
        self.proc = proc
        self._tcp: dict[int, bool] = {}  # socket inode -> whether it is TCP (or may be)
        self._known: dict[str, dict[int, TcpSocket]] = {}  # ns -> our TCP inode -> last read
        # ns -> our TCP inodes that even the whole table did not list (not yet bound, or
        # connecting): asked for again once their process has run
        self._unlisted: dict[str, frozenset[int]] = {}
        # ns -> the fds last asked for, who holds each socket inode, and which are TCP
        self._held: dict[
            str, tuple[dict[int, Mapping[int, int]], dict[int, tuple[int, int]], set[int]]
        ] = {}
        self.whole_reads = 0  # how many times a whole table was read (tests, the bench)
        self.dumps = 0  # how many reads walked the kernel's established table

    def read(
        self,
        ns: str,
        fds: Mapping[int, Mapping[int, int]],
        ran: Collection[int],
        info: bool = True,
    ) -> list[TcpSocket]:
        """The TCP sockets of namespace ``ns`` that the processes of ``fds`` (pid -> socket
        inode -> fd) hold; ``ran``: those of them that ran since the last tick (only they
        can have bound, listened or connected a socket). Their connections carry their
        tcp_info unless ``info`` is False (a whole table read never does)."""
        held = self._held.get(ns)
        if held is not None and held[0] == fds:
            # The same processes hold the same sockets (quiet ones always do): no walk.
            owner, tcp = held[1], held[2]
        else:
            owner = {inode: (pid, fd) for pid, got in fds.items() for inode, fd in got.items()}
            tcp = {inode for inode, (pid, fd) in owner.items() if self._is_tcp(inode, pid, fd)}
            self._held[ns] = (dict(fds), owner, tcp)
        pid = next(iter(fds))
        known = self._known.get(ns, {})
        table = self._looked_up(pid, tcp, known, info)
        if table is None:
            ports = {known[i].port for i in tcp if i in known}
            families = {known[i].family for i in tcp if i in known}
            table = self.proc.tcp_sockets(pid, ports, families=families, info=info) if ports else []
            self.dumps += bool(ports)
            missing = tcp - {s.inode for s in table}
            unlisted = self._unlisted.get(ns, frozenset())
            if missing - unlisted or any(owner[i][0] in ran for i in missing):
                table = self.proc.tcp_sockets(pid)
                self.whole_reads += 1
                self.dumps += 1
        mine = [s for s in table if s.inode in owner]
        if ns not in self._known or mine != list(known.values()):
            self._known[ns] = {s.inode: s for s in mine}
        self._unlisted[ns] = frozenset(tcp - self._known[ns].keys())
        return mine

    def _looked_up(
        self, pid: int, tcp: set[int], known: Mapping[int, TcpSocket], info: bool
    ) -> list[TcpSocket] | None:
        """Our sockets read again without walking the kernel's table of established
        sockets, where every one is known and few enough: each connection looked up by
        its 4-tuple, the listeners listed (a short table). None where that cannot give
        them all (a socket new, or gone: then the table is read)."""
        if not tcp or not tcp <= known.keys():
            return None
        conns = [known[i] for i in tcp if known[i].state != TCP_LISTEN]
        if len(conns) > MAX_LOOKUPS:
            return None  # one walk of the table costs less than this many lookups
        listening = {known[i].port for i in tcp if known[i].state == TCP_LISTEN}
        table = []
        if conns:
            got = self.proc.tcp_lookup(pid, conns, info)
            if got is None:
                return None
            table += got
        if listening:
            families = {known[i].family for i in tcp if known[i].state == TCP_LISTEN}
            table += self.proc.tcp_sockets(pid, listening, listening=True, families=families)
        if not tcp <= {s.inode for s in table}:
            return None
        order = {inode: i for i, inode in enumerate(known)}  # as the last read listed them
        return sorted(table, key=lambda s: order.get(s.inode, len(order)))

    def forget(self, live_namespaces: Collection[str], live_inodes: Collection[int]) -> None:
        """Drop what is kept of namespaces and sockets no watched process holds any more (a
        socket's inode number can be handed out again once it is closed)."""
        self._tcp = {i: v for i, v in self._tcp.items() if i in live_inodes}
        self._known = {ns: v for ns, v in self._known.items() if ns in live_namespaces}
        self._unlisted = {ns: v for ns, v in self._unlisted.items() if ns in live_namespaces}
        self._held = {ns: v for ns, v in self._held.items() if ns in live_namespaces}

    def _is_tcp(self, inode: int, pid: int, fd: int) -> bool:
        known = self._tcp.get(inode)
        if known is None:
            name = self.proc.socket_protocol(pid, fd)
            known = self._tcp[inode] = name is None or name in TCP_PROTOCOLS  # unknown: may be
        return known
