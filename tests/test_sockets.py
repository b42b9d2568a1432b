"""The watched processes' TCP sockets, asked for by the ports they hold (agent.observe.sockets):
what a tick reads of a namespace's table, on a fixture tree, and the same sockets as
/proc/net/tcp lists them, on the real kernel (no root needed: one's own namespace)."""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Iterable

from agent.observe.sampler import Sampler
from agent.observe.sockets import SocketTables
from agent.sources.procfs import ProcFS, TcpSocket
from agent.sources.tcpinfo import lookup_sockets, read_sockets, read_tcp_info
from tests.test_procfs_sockets import make_job

NS = "net:[1]"


class Table(ProcFS):
    """A namespace's table of our own making; records what each read asked for."""

    def __init__(self, sockets: Iterable[TcpSocket], protocols: dict[int, str] | None = None):
        super().__init__("/nonexistent", tcp_info=None, sockets=lambda *_: None)
        self.table = list(sockets)
        self.protocols = protocols or {}
        self.asked: list[set[int] | None] = []

    def tcp_sockets(
        self,
        pid: int,
        ports: Iterable[int] | None = None,
        listening: bool = False,
        families: Iterable[str] = ("tcp", "tcp6"),
        info: bool = True,
    ) -> list[TcpSocket]:
        wanted = None if ports is None else set(ports)
        self.asked.append(wanted)
        return [s for s in self.table if wanted is None or s.port in wanted]

    def socket_protocol(self, pid: int, fd: int) -> str | None:
        return self.protocols.get(fd, "TCP")


def tcp(inode: int, port: int, state: int = 1, peer: int = 0) -> TcpSocket:
    return TcpSocket("tcp", "127.0.0.1", port, state, 0, 0, inode, "127.0.0.1", peer)


def test_after_the_first_tick_only_the_ports_held_are_asked_for():
    """A server listening on 8000 with one accepted connection, among a thousand sockets of
    others in the namespace (its clients, other tenants)."""
    others = [tcp(1000 + i, 40000 + i, peer=8000) for i in range(1000)]
    proc = Table([tcp(1, 8000, state=0x0A), tcp(2, 8000, peer=40000), *others])
    tables = SocketTables(proc)
    held = {10: {1: 3, 2: 4}}
    first = tables.read(NS, held, ran={10})
    assert {s.inode for s in first} == {1, 2} and proc.asked == [None]
    # Nothing new: one read, by the one port held; what others hold is never asked for.
    again = tables.read(NS, held, ran={10})
    assert again == first and proc.asked[1:] == [{8000}] and tables.whole_reads == 1
    # A new connection accepted on 8000 is found by that port, with no whole read.
    proc.table.append(tcp(3, 8000, peer=40001))
    got = tables.read(NS, {10: {1: 3, 2: 4, 3: 5}}, ran={10})
    assert {s.inode for s in got} == {1, 2, 3} and tables.whole_reads == 1
    # An outbound connection on a port the kernel chose: read whole once, then by its port.
    proc.table.append(tcp(4, 51234, peer=443))
    held = {10: {1: 3, 2: 4, 3: 5, 4: 6}}
    assert {s.inode for s in tables.read(NS, held, ran={10})} == {1, 2, 3, 4}
    assert proc.asked[-1] is None and tables.whole_reads == 2
    tables.read(NS, held, ran={10})
    assert proc.asked[-1] == {8000, 51234} and tables.whole_reads == 2


def test_sockets_that_are_not_tcp_are_never_asked_for():
    """Unix sockets (most of a Ray or vLLM process's) are told apart once, by protocol."""
    proc = Table([tcp(1, 8000, state=0x0A)], protocols={7: "UNIX-STREAM", 8: "UDP"})
    tables = SocketTables(proc)
    held = {10: {1: 3, 70: 7, 80: 8}}
    for _ in range(3):
        assert [s.inode for s in tables.read(NS, held, ran={10})] == [1]
    assert proc.asked == [None, {8000}, {8000}]


def test_a_tcp_socket_not_yet_listed_is_asked_for_again_only_after_its_process_ran():
    """socket() before connect(): TCP, but in no table yet. Its process must run to bind,
    listen or connect it; until then the table is not read whole for it again."""
    proc = Table([tcp(1, 8000, state=0x0A)])
    tables = SocketTables(proc)
    held = {10: {1: 3, 9: 9}}
    tables.read(NS, held, ran={10})
    tables.read(NS, held, ran=set())
    assert proc.asked == [None, {8000}]
    proc.table.append(tcp(9, 52000, state=2))  # it connected (SYN_SENT): its port is known
    assert {s.inode for s in tables.read(NS, held, ran={10})} == {1, 9}
    assert proc.asked[-1] is None


def test_what_no_process_holds_any_more_is_forgotten():
    proc = Table([tcp(1, 8000, state=0x0A)], protocols={7: "UNIX-STREAM"})
    tables = SocketTables(proc)
    tables.read(NS, {10: {1: 3, 70: 7}}, ran={10})
    tables.forget([], [])
    assert not tables._known and not tables._tcp and not tables._unlisted


def test_a_fixture_tree_reads_its_own_tables(tmp_path):
    """Where ProcFS is not the real /proc, its net/tcp files are the table: filtered by port
    as the kernel would."""
    proc = ProcFS(str(make_job(tmp_path)), tcp_info=None)
    every = proc.tcp_sockets(10)
    assert {s.port for s in every} >= {29611}
    assert {s.port for s in proc.tcp_sockets(10, [29611])} == {29611}
    assert proc.tcp_sockets(10, []) == []


# --- the real kernel -------------------------------------------------------------------------


def inode(s: socket.socket) -> int:
    return os.fstat(s.fileno()).st_ino


@contextlib.contextmanager
def server_with_clients(n: int):
    with contextlib.ExitStack() as stack:
        srv = stack.enter_context(socket.socket())
        srv.bind(("127.0.0.1", 0))
        srv.listen(n)
        port = srv.getsockname()[1]
        clients = [
            stack.enter_context(socket.create_connection(("127.0.0.1", port))) for _ in range(n)
        ]
        accepted = [stack.enter_context(srv.accept()[0]) for _ in range(n)]
        yield srv, clients, accepted


def test_the_kernels_sockets_read_as_proc_net_tcp_lists_them():
    with server_with_clients(3) as (srv, clients, accepted):
        clients[0].sendall(b"hello")  # unread by the server: its rx_queue
        time.sleep(0.05)
        ours = {inode(s) for s in (srv, *clients, *accepted)}
        diag = {s.inode: s for s in read_sockets() or [] if s.inode in ours}
        files = ProcFS(sockets=lambda *_: None)  # the fallback: /proc/net/tcp{,6}
        text = {s.inode: s for s in files.tcp_sockets(os.getpid()) if s.inode in ours}
        assert diag == text and len(diag) == 7
        assert diag[inode(accepted[0])].rx_queue == 5


def test_a_socket_dumped_as_it_was_is_not_decoded_again():
    """Without tcp_info, a socket whose message reads as at the last such dump is the same
    TcpSocket; one whose queue moved is decoded afresh, as a full read lists it."""
    with server_with_clients(4) as (srv, clients, accepted):
        port = srv.getsockname()[1]
        first = {s.inode: s for s in read_sockets([("tcp", port)], info=False) or []}
        again = {s.inode: s for s in read_sockets([("tcp", port)], info=False) or []}
        assert len(first) == 5 and all(again[i] is s for i, s in first.items())
        clients[0].sendall(b"hello")
        time.sleep(0.05)
        moved = {s.inode: s for s in read_sockets([("tcp", port)], info=False) or []}
        full = {s.inode: s._replace(info=None) for s in read_sockets([("tcp", port)]) or []}
        assert moved == full
        assert moved[inode(accepted[0])].rx_queue == 5
        assert [i for i, s in moved.items() if s is not again[i]] == [inode(accepted[0])]


def accepted_conns(p, srv: socket.socket) -> list:
    return [c for c in p.connections if c.local_port == srv.getsockname()[1]]


def test_the_sampler_reads_the_namespace_by_the_ports_it_holds():
    with server_with_clients(20) as (srv, clients, accepted):
        uds = socket.socket(socket.AF_UNIX)
        with uds:
            asked = []

            def tcp_info(ports, netns):  # the second dump: only for what the first lacked
                asked.append(ports)
                return read_tcp_info(ports, netns)

            sampler = Sampler(ProcFS(tcp_info=tcp_info))
            first = sampler.snapshot([os.getpid()]).processes[os.getpid()]
            assert len(asked) == 1  # the whole table, read once: no tcp_info in it
            for _ in range(3):
                again = sampler.snapshot([os.getpid()]).processes[os.getpid()]
            assert sampler.sockets.whole_reads == 1 and len(asked) == 1
            # Every socket known: looked up one by one, the kernel's table not walked again.
            assert sampler.sockets.dumps == 1
            served = accepted_conns(again, srv)  # with tcp_info, from the one dump
            assert len(served) == 20 and all(c.bytes_received == 0 for c in served)
            assert {c.inode for c in again.connections} == {inode(s) for s in clients + accepted}
            assert [lst.port for lst in again.listeners] == [srv.getsockname()[1]]

            def ends(p):  # tcp_info's times move on: the rest must not
                return [(c.inode, c.local_port, c.remote_port, c.rx_queue) for c in p.connections]

            assert ends(again) == ends(first)


def test_known_connections_are_looked_up_by_their_4_tuples():
    with server_with_clients(5) as (srv, clients, accepted):
        port = srv.getsockname()[1]
        table = [s for s in read_sockets([("tcp", port)]) or [] if s.state == 1]
        clients[0].sendall(b"hello")
        time.sleep(0.05)
        got = {s.inode: s for s in lookup_sockets(table) or []}
        assert set(got) == {inode(a) for a in accepted}
        first = got[inode(accepted[0])]
        assert first.rx_queue == 5 and first.info is not None and first.info.bytes_received == 5
        accepted[1].close()  # gone: left out, the others still found
        clients[1].close()
        time.sleep(0.05)
        again = {s.inode for s in lookup_sockets(table) or []}
        assert inode(accepted[0]) in again and len(again) == 4


def test_without_tcp_info_the_same_sockets_are_read():
    with server_with_clients(4) as (srv, clients, _accepted):
        port = srv.getsockname()[1]
        clients[0].sendall(b"hello")
        time.sleep(0.05)
        full = read_sockets([("tcp", port)]) or []
        bare = read_sockets([("tcp", port)], info=False) or []
        assert [s._replace(info=None) for s in full] == bare and len(bare) == 5
        assert all(s.info is not None for s in full if s.state == 1)
        table = [s for s in full if s.state == 1]
        looked = lookup_sockets(table, info=False) or []
        assert sorted(looked) == sorted(s._replace(info=None) for s in table)
