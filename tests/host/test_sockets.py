"""The TCP sockets of a server process asleep (agent.observe.sockets): what a tick reads of its
namespace's table while it stays quiet, and when something wakes it. tests/test_sockets.py
holds the fixture trees and this process's own sockets."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time

import pytest

from agent.analysis.requests import waiting_for_answer
from agent.observe import sockets as sockets_module
from agent.observe.sampler import Sampler
from agent.sources.procfs import ProcFS
from agent.sources.tcpinfo import read_tcp_info

# --- the real kernel -------------------------------------------------------------------------


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
        asleep(got[0])
        yield got


def asleep(pid: int, timeout: float = 30.0) -> None:
    """Wait until ``pid``'s one thread sleeps: on a loaded host it may print ``ready`` and
    only get the CPU again to enter its sleep a while later, a run after the test's ticks
    began that the sampler rightly sees."""
    deadline = time.monotonic() + timeout
    while True:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        if state == "S":
            return
        assert time.monotonic() < deadline, f"server {pid} still {state} after {timeout} s"
        time.sleep(0.01)


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
        took = []  # each tick's time: a kept tcp_info is dated by its tick's clock
        for _ in range(2):  # the first tick it is known: read, then kept
            t = time.monotonic()
            sampler.snapshot([pid])
            took.append(time.monotonic() - t)
        before = sampler.infos_read
        time.sleep(0.3)
        t = time.monotonic()
        conns = {c.inode: c for c in sampler.snapshot([pid]).processes[pid].connections}
        kernel = read_tcp_info([("tcp", port)])
        apart = time.monotonic() - t
        assert sampler.infos_read == before, "a quiet server's tcp_info was read again"
        assert len(conns) == 12 and set(conns) <= set(kernel)
        # jiffy granular (4 ms at HZ=250), and read apart by up to a tick and the time from
        # the last tick's clock to the kernel's read (tens of ms on a loaded host)
        slack = 12 + 1000 * (max(took) + apart)
        for inode_, c in conns.items():
            k = kernel[inode_]
            assert (c.bytes_received, c.bytes_acked) == (k.bytes_received, k.bytes_acked)
            assert c.last_recv_ms is not None
            assert abs(c.last_recv_ms - k.last_data_recv_ms) <= slack, (c, k, slack)
            assert c.last_sent_ms is not None
            assert abs(c.last_sent_ms - k.last_data_sent_ms) <= slack, (c, k, slack)
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
