"""The watched processes' TCP sockets, asked for by the ports they hold (agent.observe.sockets):
what a tick reads of a namespace's table, on a fixture tree, and the same sockets as
/proc/net/tcp lists them, on the real kernel (no root needed: one's own namespace)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterable

import pytest

from agent.analysis.requests import waiting_for_answer
from agent.observe import sockets as sockets_module
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


QUIET_SERVER = """
import socket, sys, time
srv = socket.socket()
srv.bind(("127.0.0.1", 0))
srv.listen(64)
print(srv.getsockname()[1], flush=True)
conns = [srv.accept()[0] for _ in range(int(sys.argv[1]))]
print("ready", flush=True)
time.sleep(600)  # quiet: no thread of it runs, nothing it holds is read or written
"""


@contextlib.contextmanager
def quiet_server(n: int):
    """A server process holding ``n`` accepted connections, asleep; the clients' ends."""
    with server_process(QUIET_SERVER, n) as got:
        yield got


@contextlib.contextmanager
def server_process(script: str, n: int, *args: str):
    """``script`` run with ``n`` and ``args``: a server that prints its port, accepts ``n``
    connections and prints ``ready``; its PID, its port and the clients' ends."""
    p = subprocess.Popen(
        [sys.executable, "-c", script, str(n), *args], stdout=subprocess.PIPE, text=True
    )
    try:
        assert p.stdout is not None
        port = int(p.stdout.readline())
        with contextlib.ExitStack() as stack:
            clients = [
                stack.enter_context(socket.create_connection(("127.0.0.1", port))) for _ in range(n)
            ]
            assert p.stdout.readline().strip() == "ready"
            yield p.pid, port, clients
    finally:
        p.kill()
        p.wait()


@pytest.mark.parametrize("lookups", [True, False], ids=["looked-up", "dumped"])
def test_a_quiet_servers_connections_keep_their_tcp_info_until_a_queue_moves(
    monkeypatch: pytest.MonkeyPatch, lookups: bool
) -> None:
    """While no thread of the server runs, its connections' tcp_info is not read again: the
    kept one, its times moved on, reads as the kernel's would. A request the server has not
    read grows its receive queue: that connection's tcp_info is read, and it waits for an
    answer."""
    if not lookups:
        monkeypatch.setattr(sockets_module, "MAX_LOOKUPS", 0)  # one dump by port instead
    with quiet_server(12) as (pid, port, clients):
        sampler = Sampler(ProcFS())
        sampler.snapshot([pid])
        sampler.snapshot([pid])  # the first tick it is known: read, then kept
        before = sampler.infos_read
        time.sleep(0.3)
        conns = {c.inode: c for c in sampler.snapshot([pid]).processes[pid].connections}
        kernel = read_tcp_info([("tcp", port)])
        assert sampler.infos_read == before, "a quiet server's tcp_info was read again"
        assert len(conns) == 12 and set(conns) <= set(kernel)
        for inode_, c in conns.items():
            k = kernel[inode_]
            assert (c.bytes_received, c.bytes_acked) == (k.bytes_received, k.bytes_acked)
            # jiffy granular (4 ms at HZ=250), read a moment apart: within a few jiffies
            assert c.last_recv_ms is not None and abs(c.last_recv_ms - k.last_data_recv_ms) <= 12
            assert c.last_sent_ms is not None and abs(c.last_sent_ms - k.last_data_sent_ms) <= 12
            assert c.last_recv_ms >= 300 and not waiting_for_answer(c)
        clients[0].sendall(b"GET / HTTP/1.1\r\n\r\n")
        time.sleep(0.05)
        got = sampler.snapshot([pid]).processes[pid].connections
        asked = [c for c in got if c.rx_queue]
        assert len(asked) == 1 and asked[0].bytes_received == 18 and waiting_for_answer(asked[0])
        assert sampler.infos_read == before + 1  # that one connection's, no other


# An event loop holding idle keep-alive connections: every socket in one epoll set for input
# (but the last connection, with "leave-one"), answering each request.
EPOLL_SERVER = """
import select, socket, sys
srv = socket.socket()
srv.bind(("127.0.0.1", 0))
srv.listen(64)
print(srv.getsockname()[1], flush=True)
conns = [srv.accept()[0] for _ in range(int(sys.argv[1]))]
ep = select.epoll()
byfd = {c.fileno(): c for c in conns[: -1 if sys.argv[2] == "leave-one" else None]}
for fd in [srv.fileno(), *byfd]:
    ep.register(fd, select.EPOLLIN)
print("ready", flush=True)
while True:
    for fd, _ in ep.poll():
        if fd == srv.fileno():
            c = srv.accept()[0]
            byfd[c.fileno()] = c
            ep.register(c.fileno(), select.EPOLLIN)
        elif byfd[fd].recv(4096):
            byfd[fd].sendall(b"ok")
        else:
            ep.unregister(fd)
            byfd.pop(fd).close()
"""


class CountingTables(ProcFS):
    """Counts the reads of socket tables (dumps, lookups, listener lists)."""

    def __init__(self) -> None:
        super().__init__()
        self.table_reads = 0

    def tcp_sockets(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        self.table_reads += 1
        return super().tcp_sockets(*args, **kwargs)

    def tcp_lookup(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        self.table_reads += 1
        return super().tcp_lookup(*args, **kwargs)


@pytest.mark.parametrize("n", [12, 500], ids=["looked-up", "dumped"])
def test_an_idle_event_loop_s_table_is_not_read_until_something_wakes_it(n: int) -> None:
    """An event loop asleep in epoll_wait on every socket it holds: while it sleeps, nothing
    can have arrived (an arrival wakes it), so its table is not read at all, and its sockets
    read as they did, their times aged. A request wakes it: it runs, and is read again."""
    with server_process(EPOLL_SERVER, n, "all") as (pid, _port, clients):
        proc = CountingTables()
        sampler = Sampler(proc)
        first = sampler.snapshot([pid]).processes[pid]
        sampler.snapshot([pid])
        reads, skipped = proc.table_reads, sampler.tables_skipped
        time.sleep(0.2)
        again = sampler.snapshot([pid]).processes[pid]
        assert proc.table_reads == reads and sampler.tables_skipped == skipped + 1
        assert len(again.connections) == n and again.listeners == first.listeners
        assert [c.inode for c in again.connections] == [c.inode for c in first.connections]
        assert all((c.last_recv_ms or 0) >= 200 for c in again.connections)
        clients[0].sendall(b"GET / HTTP/1.1\r\n\r\n")
        assert clients[0].recv(2) == b"ok"
        sampler.snapshot([pid])
        assert proc.table_reads > reads  # it ran: read


def test_a_socket_no_sleeping_thread_awaits_keeps_the_table_read() -> None:
    """The same loop with one connection outside its epoll set: a request on that one would
    wake no one, so the table is read every tick, and the request is seen waiting."""
    with server_process(EPOLL_SERVER, 4, "leave-one") as (pid, _port, clients):
        sampler = Sampler(ProcFS())
        for _ in range(3):
            sampler.snapshot([pid])
        clients[-1].sendall(b"GET / HTTP/1.1\r\n\r\n")
        time.sleep(0.05)
        got = sampler.snapshot([pid]).processes[pid].connections
        assert sampler.tables_skipped == 0
        assert sum(waiting_for_answer(c) for c in got) == 1


def test_a_quiet_namespace_handed_out_again_reads_as_built_afresh() -> None:
    """While nothing in the namespace moved, the last tick's sockets are handed out again,
    their kept tcp_info aged: the same as building them from the table again would give."""
    now = [10**12]
    with quiet_server(6) as (pid, _port, clients):
        clients[0].sendall(b"GET / HTTP/1.1\r\n\r\n")  # one request waits, unread
        time.sleep(0.05)
        sampler = Sampler(ProcFS(), clock_ns=lambda: now[0])
        for _ in range(3):
            now[0] += 1_000_000_000
            sampler.snapshot([pid])
        reused = sampler.tables_reused
        now[0] += 2_500_000_000
        again = sampler.snapshot([pid]).processes[pid]
        assert sampler.tables_reused == reused + 1
        sampler.socket_reads._ns_reads.clear()  # as if never read: built from the table
        built = sampler.snapshot([pid]).processes[pid]
        assert sampler.tables_reused == reused + 1
    assert again.connections == built.connections and again.listeners == built.listeners
    assert (
        len(again.connections) == 6 and sum(waiting_for_answer(c) for c in again.connections) == 1
    )
    assert min(c.last_recv_ms or 0 for c in again.connections) >= 4_500  # aged by the clock


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
