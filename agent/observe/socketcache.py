"""The watched processes' TCP listeners and connections each tick, with tcp_info kept while
nothing can have moved it: SocketReads.

Apart from agent.observe.sockets on purpose: that module finds which of the kernel's sockets
are ours and reads them cheaply, kept by what never changes (an inode, a local port). This one
decides whether to read a namespace at all and what its sockets say of each process, kept by
time: tcp_info and whole tables stand while their holders are quiet.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import replace
from typing import NamedTuple

from ..model import Connection, Connections, Listener, ProcessSample, TcpInfo, endpoint
from ..sources.procfs import ProcFS, TcpSocket
from ..sources.tcpinfo import TCP_ESTABLISHED, TCP_LISTEN
from ..syscalls import INPUT_READS
from .sockets import SocketTables
from .threads import ThreadRead

# The ephemeral port range is a sysctl an administrator sets once: read again this often.
EPHEMERAL_READ_NS = 30_000_000_000


def sockets_read(reads: Mapping[int, ThreadRead], sockets: Mapping[int, int]) -> frozenset[int]:
    """Inodes of the process's sockets (``sockets``: inode -> fd) that one of its threads
    (``reads``) is blocked reading: the fd in the registers of its read or recv."""
    if not sockets:
        return frozenset()  # a rank, a worker: no socket, no thread to look at
    fds = {
        r.syscall.args[0]
        for r in reads.values()
        if r.syscall is not None and r.syscall.nr in INPUT_READS and r.syscall.args
    }
    if not fds:
        return frozenset()
    return frozenset(inode for inode, fd in sockets.items() if fd in fds)


class _KeptInfo(NamedTuple):
    """A connection's tcp_info as last read from the kernel, to carry while nothing can
    have moved it."""

    queues: tuple[int, int]  # (rx_queue, tx_queue) at that read
    read_ns: int  # the snapshot it was read in
    info: TcpInfo


def _aged(k: _KeptInfo, now: int) -> TcpInfo:
    """The kept tcp_info as a read at ``now`` would give it: its last-data times older by
    the time since it was read, its byte counts the same."""
    ms = (now - k.read_ns) // 1_000_000
    i = k.info
    return TcpInfo(
        i.last_data_recv_ms + ms, i.last_data_sent_ms + ms, i.bytes_received, i.bytes_acked
    )


def _aged_connections(kept: list[tuple[_KeptInfo | None, Connection]], now: int) -> Connections:
    """The kept connections as a read at ``now`` would give them (as _aged): those with
    tcp_info kept, their last-data times older by the time since it was read. One loop for
    a front-end's thousand, every tick, most of them read in the same snapshot (one age)."""
    out: list[Connection] = []
    add = out.append
    ages: dict[int, int] = {}
    for k, c in kept:
        if k is None:
            add(c)
            continue
        ms = ages.get(k.read_ns)
        if ms is None:
            ms = ages[k.read_ns] = (now - k.read_ns) // 1_000_000
        i = k.info
        add(c.with_times(i.last_data_recv_ms + ms, i.last_data_sent_ms + ms))
    return Connections(out)


_NO_INFO = (None, None, None, None)


def _times_and_bytes(i: TcpInfo) -> tuple[int, int, int, int]:
    """A Connection's tcp_info fields, in its order."""
    return i.last_data_recv_ms, i.last_data_sent_ms, i.bytes_received, i.bytes_acked


class _NsRead(NamedTuple):
    """A network namespace's sockets as the last tick read them and handed them out."""

    held_by: dict[int, Mapping[int, int]]  # pid -> socket inode -> fd
    table: list[TcpSocket]
    listeners: dict[int, tuple[Listener, ...]]  # pid -> its listeners
    # pid -> its connections, each with the tcp_info kept for it (None: it has none)
    connections: dict[int, list[tuple[_KeptInfo | None, Connection]]]
    infos: dict[int, _KeptInfo]  # inode -> the tcp_info kept for it
    complete: bool  # every connection that should carry tcp_info does


class SocketReads:
    """Per tick, the listeners and connections of the watched processes (see ``read``), and
    the host's ephemeral port range. What others change is read again even for a quiet
    process: its sockets' queues and tcp_info (clients send without the server running: that
    is how a hung server is found)."""

    def __init__(self, proc: ProcFS) -> None:
        self.proc = proc
        self.tables = SocketTables(proc)
        self._infos: dict[int, _KeptInfo] = {}  # socket inode -> its last tcp_info read
        # pid -> inodes of the sockets a thread of it sleeps waiting on for input, while quiet
        self._inputs: dict[int, frozenset[int]] = {}
        self._ephemeral: tuple[int, int] | None = None  # (when read, the range's first port)
        self._ns_reads: dict[str, _NsRead] = {}  # network namespace -> its last read
        self.tables_skipped = 0  # namespaces whose table was not read at all (tests, the bench)
        self.infos_read = 0  # how many tcp_info were read from the kernel (tests, the bench)
        self.tables_reused = 0  # namespaces handed out as the last tick read them (tests)

    def ephemeral_from(self, now: int) -> int:
        """The first port of the host's ephemeral range, read again every EPHEMERAL_READ_NS."""
        if self._ephemeral is None or now - self._ephemeral[0] >= EPHEMERAL_READ_NS:
            self._ephemeral = (now, self.proc.ephemeral_from())
        return self._ephemeral[1]

    def read(
        self,
        processes: dict[int, ProcessSample],
        fds: Mapping[int, Mapping[int, int]],
        ran: Collection[int],
        now: int,
        epoll_fds: Callable[[int], Iterable[int]],
    ) -> None:
        """Give each process its listeners and established connections (with their queues):
        one read of its network namespace's table per tick, for the ports its watched
        processes hold (agent.observe.sockets). ``fds``: pid -> socket inode -> fd;
        ``ran``: the processes that ran since the last tick; ``epoll_fds``: pid -> the epoll
        fds its blocked threads wait in.

        Connections get the kernel's tcp_info (last data received and sent, bytes) where it
        is evidence: those a process accepted on a listening port of the snapshot's
        processes (the candidates for a front door; which are is decided later, per
        service), where a request received and not answered is work waiting; and those whose
        peer is outside the snapshot's processes, where data received is progress (weights
        streamed in) and the last data moved dates a hang. Loopback chatter between the
        snapshot's own processes is left without. The table's read carries the tcp_info of
        the ports it asks for; where it did not (a whole table read, /proc/net/tcp), one
        more netlink read per namespace gets it, filtered by local port.

        Where none of a namespace's processes ran since the last tick, the table is read
        without tcp_info, and a connection whose queues are as they were keeps the one last
        read, its times moved on by the time since: with no thread of its holders running,
        nothing was written to it or read from it, so no data left it and none arrived (an
        arrival would sit in its receive queue), and its byte counts and last-data times
        stand. A client's request to a hung server shows as a receive queue that grew, and
        that connection's tcp_info is read. A holder that runs between the tick's reads of
        its threads and of its sockets is seen running the next tick, and read then.

        Where, besides, every socket of the last read is one a thread of its holder sleeps
        waiting on for input (an epoll set's EPOLLIN, a blocked read), the table is not read
        at all (_nothing_arrived): a request, a new connection or a peer's close would have
        woken that thread. An idle front-end's event loop is that shape; a hung server's is
        not (its loop is blocked elsewhere), and its table is read each tick as above."""
        by_ns: dict[str, dict[int, Mapping[int, int]]] = {}
        kept_infos: dict[int, _KeptInfo] = {}
        ns_reads: dict[str, _NsRead] = {}
        for pid, held in fds.items():
            if held:
                ns = self.proc.net_namespace(pid) or f"pid:{pid}"
                by_ns.setdefault(ns, {})[pid] = held
        self._inputs = {p: v for p, v in self._inputs.items() if p in processes and p not in ran}

        def awaited(pid: int) -> frozenset[int]:
            return self._input_awaited(pid, processes[pid].reading, epoll_fds)

        for ns, held_by in by_ns.items():
            quiet = not any(pid in ran for pid in held_by)
            last = self._ns_reads.get(ns)
            if (
                quiet
                and last is not None
                and last.complete
                and last.held_by == held_by
                and self._nothing_arrived(last, awaited)
            ):
                table = last.table  # what a read would give: not read
                self.tables_skipped += 1
            else:
                table = self.tables.read(ns, held_by, ran, info=not quiet)
            if (
                quiet
                and last is not None
                and last.complete
                and last.table == table
                and last.held_by == held_by
            ):
                # The same sockets in the same states with the same queues, held by the same
                # quiet processes: what the code below would give, its kept tcp_info aged,
                # without building it again (a front-end's thousand idle connections).
                for pid in held_by:
                    aged = _aged_connections(last.connections[pid], now)
                    processes[pid] = replace(
                        processes[pid], listeners=last.listeners[pid], connections=aged
                    )
                kept_infos.update(last.infos)
                ns_reads[ns] = last
                self.tables_reused += 1
                continue
            # A socket two processes hold (inherited across a fork) is each one's.
            owners: dict[int, list[int]] = {}
            for pid, held in held_by.items():
                for inode in held:
                    owners.setdefault(inode, []).append(pid)
            listening = {s.port for s in table if s.state == TCP_LISTEN}
            conns = [s for s in table if s.state == TCP_ESTABLISHED]
            ours = {endpoint(s.address, s.port) for s in conns}
            accepted = {
                s.inode: (s.family, s.port)
                for s in conns
                if s.port in listening or endpoint(s.remote_address, s.remote_port) not in ours
            }
            infos = {s.inode: s.info for s in conns if s.info and s.inode in accepted}
            self.infos_read += len(infos)
            if quiet:
                for s in conns:
                    k = self._infos.get(s.inode)
                    if (
                        k is not None
                        and s.inode in accepted
                        and k.queues == (s.rx_queue, s.tx_queue)
                    ):
                        infos[s.inode] = _aged(k, now)
                        kept_infos[s.inode] = k
            unread = {where for inode, where in accepted.items() if inode not in infos}
            if unread:
                got = self.proc.tcp_info(next(iter(held_by)), sorted(unread))
                got = {i: info for i, info in got.items() if i in accepted and i not in infos}
                infos.update(got)
                self.infos_read += len(got)
            for s in conns:
                info = infos.get(s.inode)
                if info is not None and s.inode not in kept_infos:
                    kept_infos[s.inode] = _KeptInfo((s.rx_queue, s.tx_queue), now, info)
            listeners: dict[int, list[Listener]] = {pid: [] for pid in held_by}
            connections: dict[int, list[tuple[_KeptInfo | None, Connection]]] = {
                pid: [] for pid in held_by
            }
            for s in table:
                if s.state == TCP_LISTEN:
                    lst = Listener(s.family, s.address, s.port, s.rx_queue, s.tx_queue)
                    for pid in owners[s.inode]:
                        listeners[pid].append(lst)
                elif s.state == TCP_ESTABLISHED:
                    info = infos.get(s.inode)
                    # Built once, with its tcp_info if it has one (a front-end's thousand).
                    conn = Connection(
                        s.address,
                        s.port,
                        s.remote_address,
                        s.remote_port,
                        s.inode,
                        s.rx_queue,
                        s.tx_queue,
                        *(_NO_INFO if info is None else _times_and_bytes(info)),
                    )
                    entry = (kept_infos.get(s.inode), conn)
                    for pid in owners[s.inode]:
                        connections[pid].append(entry)
            theirs = {pid: tuple(listeners[pid]) for pid in held_by}
            for pid in held_by:
                processes[pid] = replace(
                    processes[pid],
                    listeners=theirs[pid],
                    connections=Connections(c for _, c in connections[pid]),
                )
            ns_reads[ns] = _NsRead(
                held_by,
                table,
                theirs,
                connections,
                {i: kept_infos[i] for i in accepted if i in kept_infos},
                all(i in infos for i in accepted),
            )
        self._infos = kept_infos
        self._ns_reads = ns_reads
        self.tables.forget(by_ns, {i for held in fds.values() for i in held})

    def _input_awaited(
        self, pid: int, reading: frozenset[int], epoll_fds: Callable[[int], Iterable[int]]
    ) -> frozenset[int]:
        """Inodes of the process's sockets that one of its threads sleeps waiting on for
        input: in an epoll set it waits in (EPOLLIN), or the socket of its read or recv
        (``reading``). Read once while the process stays quiet (its threads and epoll sets
        cannot change unless it runs)."""
        got = self._inputs.get(pid)
        if got is None:
            inodes = set(reading)
            for epfd in epoll_fds(pid):
                inodes |= self.proc.epoll_inputs(pid, epfd)
            got = self._inputs[pid] = frozenset(inodes)
        return got

    def _nothing_arrived(self, last: _NsRead, awaited: Callable[[int], frozenset[int]]) -> bool:
        """Whether none of the sockets ``last`` read can have changed since: each one is
        awaited for input (``awaited``: pid -> those inodes) by a thread of its quiet holder
        that has slept since (an arrival, a new connection on a listener, a close or a reset
        by the peer would have woken it, and it would have run), and each connection had
        nothing in flight (an ACK moves a send queue without waking anyone)."""
        inputs: set[int] = set()
        for pid in last.held_by:
            inputs |= awaited(pid)
        return all(
            s.inode in inputs and (s.state == TCP_LISTEN or s.tx_queue == 0) for s in last.table
        )
