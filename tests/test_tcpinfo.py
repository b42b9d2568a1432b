"""Unanswered requests as evidence: tcp_info over inet_diag netlink, and what it decides.

Pure tests of the decision (classify.waiting_for_answer and the verdicts it feeds), then the
reader against real loopback connections of this test process (no root needed: the
kernel's sock_diag dump of one's own network namespace is open to every user), and the
sampler's use of it. tests/host/test_tcpinfo.py judges the hung_http fixture from another
process and reads another network namespace.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.analysis import requests as requests_module
from agent.analysis.classify import classify_process, classify_service
from agent.analysis.progress import ProcessProgress
from agent.analysis.requests import (
    incomplete_requests,
    unanswered_requests,
    unread_requests,
    waiting_for_answer,
)
from agent.analysis.verdict import IDLE, PROGRESSING, STALLED, ProcessFacts
from agent.model import Connection, Connections, Listener, TcpInfo
from agent.observe.sampler import Sampler
from agent.report.sentences import reasons
from agent.sources import tcpinfo
from agent.sources.procfs import ProcFS
from agent.sources.tcpinfo import read_tcp_info
from tests.synth import parked, process
from tests.test_procfs_sockets import CountingProcFS, make_job

LISTEN = Listener("tcp", "127.0.0.1", 8000, queued=0, backlog=128)
# Longer than a jiffy at any HZ (10 ms at HZ=100): two events this far apart get two times.
JIFFY_S = 0.025


def conn(
    recv: int | None = 95_000,
    sent: int | None = 300_000,
    got: int | None = 120,
    acked: int | None = 0,
    port: int = 8000,
    inode: int = 7,
) -> Connection:
    return Connection("127.0.0.1", port, "127.0.0.1", 51000, inode, 0, 0, recv, sent, got, acked)


# --- the decision ------------------------------------------------------------------------


def test_a_request_received_after_the_last_send_waits_for_an_answer():
    assert waiting_for_answer(conn(recv=95_000, sent=300_000, acked=4096))


def test_an_answered_keep_alive_connection_does_not_wait():
    """Answered, then quiet: it sent last."""
    assert not waiting_for_answer(conn(recv=300_000, sent=299_990, acked=4096))


def test_a_fresh_connection_with_its_first_request_unanswered_waits():
    """The handshake sets both times; a request right after it lands in the same jiffy, and
    nothing was sent: equal times with nothing acknowledged (seen on this kernel)."""
    assert waiting_for_answer(conn(recv=4000, sent=4000, acked=0))
    assert not waiting_for_answer(conn(recv=4000, sent=4000, acked=19))  # answered at once


def test_no_data_or_unknown_times_is_no_evidence():
    assert not waiting_for_answer(conn(recv=100, sent=100, got=0))  # connected, said nothing
    assert not waiting_for_answer(conn(recv=None))
    assert not waiting_for_answer(conn(sent=None))
    assert not waiting_for_answer(conn(got=None))
    assert not waiting_for_answer(Connection("127.0.0.1", 8000, "127.0.0.1", 51000, 7, 0, 0))


def test_only_connections_on_front_doors_count_oldest_first():
    plumbing = conn(port=29500, inode=1)
    young, old = conn(recv=2000, inode=2), conn(recv=95_000, inode=3)
    answered = conn(recv=300_000, sent=1000, inode=4)
    sample = _sample(listeners=(LISTEN,), connections=(plumbing, young, answered, old))
    assert unanswered_requests(sample, frozenset({8000})) == [old, young]
    assert unanswered_requests(sample, frozenset()) == []  # the service has no front door
    assert unanswered_requests(sample, None) == [old, young]  # None: its own listeners


def _sample(listeners=(), connections=(), pid=10, n=2, kind=tuple):
    p = process(pid, *(parked(pid * 100 + i) for i in range(n)), listeners=listeners)
    return p.__class__(**{**p.__dict__, "connections": kind(connections)})


def test_a_samples_connections_are_judged_once_per_question(monkeypatch):
    """A sample's Connections keep each answer: the observer and two judges ask the same of
    a front-end's thousand each tick. The answers are those a plain tuple gets."""
    plumbing, young, old = conn(port=29500, inode=1), conn(recv=2000, inode=2), conn(inode=3)
    answered, streaming = conn(recv=300_000, sent=1000, inode=4), conn(recv=9, sent=5, inode=5)
    held = (plumbing, young, answered, old, streaming)
    kept = _sample(listeners=(LISTEN,), connections=held, kind=Connections)
    plain = _sample(listeners=(LISTEN,), connections=held)
    asked = []
    judge = requests_module.waiting_for_answer
    monkeypatch.setattr(
        requests_module, "waiting_for_answer", lambda c: asked.append(c) or judge(c)
    )
    questions = [
        (frozenset({8000}), frozenset()),
        (None, frozenset({5})),
        (frozenset(), frozenset()),
    ]
    for ports, streams in questions:
        want = unanswered_requests(plain, ports, streams)
        assert unanswered_requests(kept, ports, streams) == want
        n = len(asked)
        assert unanswered_requests(kept, ports, streams) == want and len(asked) == n
        assert unread_requests(kept, ports) == unread_requests(plain, ports)
    assert unanswered_requests(kept, None, frozenset({5})) == [old, young, streaming]


def _facts(sample, parked_s=5.0, doors=frozenset({8000})) -> ProcessFacts:
    prog = ProcessProgress(pid=sample.pid, window_ns=3 * 10**9)
    return ProcessFacts(sample, prog, len(sample.threads), parked_s, front_door_ports=doors)


def test_unanswered_requests_make_a_quiet_server_stalled_not_idle():
    waiting = [conn(recv=95_000, inode=i) for i in (1, 2)] + [conn(recv=40_000, inode=3)]
    f = _facts(_sample((LISTEN,), waiting), parked_s=5.0)
    v = classify_process(f, 60)
    # Its threads last ran 5 s ago, but the oldest request has waited 95 s: past 60 s.
    assert v.state == STALLED, reasons(v.reasons)
    assert "listening on port 8000: 3 requests unanswered for 95 s" in reasons(v.reasons)
    assert any(
        "no progress for 95 s" in r and "past the 60 s threshold" in r for r in reasons(v.reasons)
    )
    s = classify_service(10, [f], 60)
    assert s.state == STALLED and "3 requests unanswered for 95 s" in " ".join(reasons(s.reasons))
    # The evidence /metrics exports: 3 requests waiting, 95 s without progress (not 5 s).
    assert (s.unanswered_requests, s.seconds_since_progress) == (3, 95.0)


def test_a_young_unanswered_request_is_under_the_threshold_not_idle():
    v = classify_process(_facts(_sample((LISTEN,), [conn(recv=2500)]), parked_s=1.0), 60)
    assert v.state == PROGRESSING
    assert "no progress for 2.5 s, under the 60 s threshold" in reasons(v.reasons)


def test_answered_keep_alive_connections_leave_the_server_idle():
    idle = [conn(recv=300_000, sent=299_000, acked=100, inode=i) for i in range(5)]
    f = _facts(_sample((LISTEN,), idle), parked_s=300.0)
    assert classify_process(f, 60).state == IDLE
    s = classify_service(10, [f], 60)
    assert s.state == IDLE
    assert (s.unanswered_requests, s.seconds_since_progress) == (0, 300.0)


def test_a_request_on_a_plumbing_port_is_not_work_waiting():
    store = Listener("tcp", "0.0.0.0", 29500, queued=0, backlog=128)
    chatter = conn(port=29500, recv=95_000)
    f = _facts(_sample((LISTEN, store), [chatter]), parked_s=300.0, doors=frozenset({8000}))
    assert classify_process(f, 60).state == IDLE


def test_the_service_sees_requests_held_by_a_process_without_the_listener():
    """A front-end listens; a worker holds the accepted connection (fd passing)."""
    front = _facts(_sample((LISTEN,), pid=10), parked_s=300.0)
    worker = _facts(_sample((), [conn(recv=70_000)], pid=11), parked_s=300.0)
    v = classify_service(10, [front, worker], 60)
    assert v.state == STALLED
    assert "1 request unanswered for 70 s" in " ".join(reasons(v.reasons))
    assert (v.unanswered_requests, v.seconds_since_progress) == (1, 300.0)  # parked longer
    w = classify_process(worker, 60)
    assert w.state == STALLED
    assert "connections accepted on port 8000: 1 request unanswered for 70 s" in reasons(w.reasons)


def _reading(sample, *inodes):
    """The sample with a thread of it blocked reading each of ``inodes`` (the sampler's
    ProcessSample.reading)."""
    return replace(sample, reading=frozenset(inodes))


def test_a_request_the_server_is_still_reading_is_the_clients_wait():
    """Half a request: the server read it all (nothing queued) and a thread of it is blocked
    reading that connection for the rest. It cannot answer what it has not been sent: idle,
    the client's wait said, not stalled however old."""
    half = conn(recv=95_000, inode=1)
    f = _facts(_reading(_sample((LISTEN,), [half]), 1), parked_s=300.0)
    assert unanswered_requests(f.sample, frozenset({8000})) == []
    assert incomplete_requests(f.sample, frozenset({8000})) == [half]
    v = classify_process(f, 60)
    assert v.state == IDLE, reasons(v.reasons)
    s = classify_service(10, [f], 60)
    assert s.state == IDLE
    said = reasons(s.reasons)
    assert "1 request incomplete from the client for 95 s" in " ".join(said), said
    assert (s.unanswered_requests, s.oldest_request_s) == (0, 0.0)


def test_a_whole_request_beside_a_half_one_still_stalls():
    half, whole = conn(recv=95_000, inode=1), conn(recv=70_000, inode=2)
    f = _facts(_reading(_sample((LISTEN,), [half, whole]), 1), parked_s=5.0)
    s = classify_service(10, [f], 60)
    assert s.state == STALLED, reasons(s.reasons)
    assert "1 request unanswered for 70 s" in " ".join(reasons(s.reasons))
    assert (s.unanswered_requests, s.seconds_since_progress) == (1, 70.0)


def test_reading_is_no_evidence_where_bytes_wait_or_an_answer_is_streaming():
    """Bytes still queued: the server has not read what came, so nothing says the request is
    short. A stream in flight: the request was whole, its answer began. Neither is the
    client's wait, whatever thread reads the connection."""
    queued = Connection("127.0.0.1", 8000, "127.0.0.1", 51000, 1, 40, 0, 95_000, 300_000, 120, 0)
    streaming = conn(recv=9_000, sent=5_000, inode=2)
    sample = _reading(_sample((LISTEN,), [queued, streaming]), 1, 2)
    assert incomplete_requests(sample, frozenset({8000})) == []
    got = unanswered_requests(sample, frozenset({8000}), frozenset({2}))
    assert got == [queued, streaming]


def test_an_answered_connection_being_read_is_simply_idle():
    """A thread-per-connection server blocked reading a keep-alive connection it answered:
    waiting for the next request, nothing incomplete."""
    kept = conn(recv=300_000, sent=299_000, acked=100, inode=1)
    f = _facts(_reading(_sample((LISTEN,), [kept]), 1), parked_s=300.0)
    s = classify_service(10, [f], 60)
    assert s.state == IDLE
    assert "incomplete" not in " ".join(reasons(s.reasons))


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 3),  # inode
            st.sampled_from([8000, 29500]),  # a front door or plumbing
            st.integers(0, 2),  # rx_queue
            st.integers(0, 5),  # last recv (s)
            st.integers(0, 5),  # last sent (s)
            st.integers(0, 2),  # bytes acked
        ),
        max_size=6,
    ),
    st.frozensets(st.integers(0, 3)),
    st.frozensets(st.integers(0, 3)),
)
def test_reading_only_moves_requests_from_unanswered_to_incomplete(rows, reading, streams):
    """Whatever the connections, the threads reading and the streams: the requests a reading
    thread takes out of the unanswered ones are the incomplete ones, no more, no less; it
    never adds an unanswered request."""
    cs = [
        Connection("127.0.0.1", port, "127.0.0.1", 51000, i, rx, 0, r * 1000, s * 1000, 10, a)
        for i, port, rx, r, s, a in rows
    ]
    plain = _sample((LISTEN,), cs)
    read = _reading(plain, *reading)
    doors = frozenset({8000})
    before = unanswered_requests(plain, doors, streams)
    after = unanswered_requests(read, doors, streams)
    incomplete = incomplete_requests(read, doors, streams)
    assert all(c in before for c in after)
    assert sorted(map(id, before)) == sorted(map(id, after + incomplete))
    assert all(c.inode in reading and c.inode not in streams for c in incomplete)


def test_dumps_asked_for_per_family_with_their_ports():
    assert tcpinfo._requests(None) == [(socket.AF_INET, ()), (socket.AF_INET6, ())]
    got = tcpinfo._requests([("tcp6", 8000), ("tcp", 9000), ("tcp", 8000), ("udp", 53)])
    assert got == [(socket.AF_INET, (8000, 9000)), (socket.AF_INET6, (8000,))]
    many = [("tcp", p) for p in range(1000, 1000 + tcpinfo.MAX_FILTERED_PORTS + 1)]
    assert tcpinfo._requests(many) == [(socket.AF_INET, ())]
    assert tcpinfo._requests([("tcp", 0), ("tcp", 70000)]) == []


def test_port_filter_is_the_kernels_bytecode():
    """Two ports, as ss(8) writes an OR: S_EQ 8000 (yes on to the JMP, no over it to the next
    S_EQ), its port in the second op's ``no``; the JMP to the end (20 - 8 = 12); S_EQ 9000,
    yes to the end, no 4 past it."""
    assert tcpinfo.port_filter([8000, 9000]) == struct.pack(
        "=BBHBBHBBHBBHBBH", 11, 8, 12, 0, 0, 8000, 1, 4, 12, 11, 8, 12, 0, 0, 9000
    )


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400))
def test_dump_parser_is_total(data: bytes):
    """Whatever a read holds, the parser adds what it can and never raises but for the
    kernel's error message (an OSError, as the reader's callers expect)."""
    out: dict[int, TcpInfo] = {}
    with contextlib.suppress(OSError):
        tcpinfo.parse_dump(data, out)
    assert all(isinstance(v, TcpInfo) for v in out.values())
    listed: list[tcpinfo.TcpSocket] = []
    with contextlib.suppress(OSError):
        tcpinfo.parse_sockets(data, listed)
    assert all(0 <= s.port < 1 << 16 and s.inode for s in listed)


def test_dump_parser_skips_a_short_tcp_info_and_stops_at_the_end():
    info = bytes(tcpinfo.TCPI_NEEDED - 8)  # a kernel before bytes_received
    msg = bytearray(tcpinfo.DIAG_MSG_LEN)
    struct.pack_into("=I", msg, tcpinfo.DIAG_INODE_AT, 77)
    attr = struct.pack("=HH", 4 + len(info), tcpinfo.INET_DIAG_INFO) + info
    body = bytes(msg) + attr
    one = struct.pack("=IHHII", 16 + len(body), tcpinfo.SOCK_DIAG_BY_FAMILY, 2, 1, 0) + body
    done = struct.pack("=IHHII", 20, tcpinfo.NLMSG_DONE, 2, 1, 0) + bytes(4)
    out: dict[int, TcpInfo] = {}
    assert tcpinfo.parse_dump(one + done, out) and out == {}
    assert not tcpinfo.parse_dump(one, out)  # more to read


# --- the reader, against the kernel -------------------------------------------------------


def inode(s: socket.socket) -> int:
    return os.fstat(s.fileno()).st_ino


@contextlib.contextmanager
def pair(family: int = socket.AF_INET) -> Iterator[tuple[socket.socket, socket.socket, int]]:
    """(the server's accepted socket, the client's socket, the listening port)."""
    host = "127.0.0.1" if family == socket.AF_INET else "::1"
    with socket.socket(family) as srv:
        srv.bind((host, 0))
        srv.listen()
        port = srv.getsockname()[1]
        with socket.socket(family) as client:
            client.connect((host, port))
            accepted, _ = srv.accept()
            with accepted:
                yield accepted, client, port


def judged(s: socket.socket, port: int, fam: str = "tcp") -> Connection:
    infos = read_tcp_info([(fam, port)])
    assert inode(s) in infos, f"socket {inode(s)} not in the dump: {infos}"
    return conn(port=port, inode=inode(s)).with_tcp_info(infos[inode(s)])


@pytest.mark.parametrize("family", [socket.AF_INET, socket.AF_INET6], ids=["v4", "v6"])
def test_reader_sees_a_request_wait_and_its_answer_end_the_wait(family):
    fam = "tcp" if family == socket.AF_INET else "tcp6"
    with pair(family) as (server, client, port):
        c = judged(server, port, fam)
        assert c.bytes_received == 0 and not waiting_for_answer(c)  # connected, said nothing
        client.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert server.recv(4096)  # read: nothing unread, yet unanswered
        time.sleep(JIFFY_S)
        c = judged(server, port, fam)
        assert c.bytes_received == 27 and c.bytes_acked == 0
        assert c.last_recv_ms is not None and c.last_recv_ms >= 20
        assert waiting_for_answer(c), c
        server.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
        assert client.recv(4096)
        time.sleep(JIFFY_S)
        c = judged(server, port, fam)
        assert c.bytes_acked == 38 and not waiting_for_answer(c), c  # keep-alive, answered
        client.sendall(b"GET /2 HTTP/1.1\r\n\r\n")  # the next request on the connection
        time.sleep(JIFFY_S)
        assert waiting_for_answer(judged(server, port, fam))
    # The client side of a connection is no server's: a port filter leaves it out.
    with pair(family) as (server, client, port):
        assert inode(client) not in read_tcp_info([(fam, port)])
        assert inode(client) in read_tcp_info(None)


def test_the_kernel_keeps_the_ports_asked_for_and_no_other():
    with contextlib.ExitStack() as stack:
        pairs = [stack.enter_context(pair()) for _ in range(4)]
        asked = [port for _, _, port in pairs[:3]]
        got = read_tcp_info([("tcp", port) for port in asked])
        assert all(inode(server) in got for server, _, _ in pairs[:3])
        assert all(inode(client) not in got for _, client, _ in pairs)
        server, _, port = pairs[3]
        assert inode(server) not in got
        assert inode(server) in read_tcp_info([("tcp", port)])


def test_reader_failures_give_nothing(monkeypatch):
    assert read_tcp_info(None, netns="/proc/does-not-exist/ns/net") == {}
    assert read_tcp_info([("sctp", 80)]) == {}

    def refused(*_args: object) -> socket.socket:
        raise PermissionError(1, "netlink refused")

    with pair() as (_, _, port):
        monkeypatch.setattr(tcpinfo.socket, "socket", refused)
        assert read_tcp_info([("tcp", port)]) == {}


def test_procfs_reads_the_real_kernel_by_default():
    with pair() as (server, client, port):
        client.sendall(b"x")
        assert inode(server) in ProcFS().tcp_info(os.getpid(), [("tcp", port)])
        assert ProcFS().tcp_info(2**22 + 1, [("tcp", port)]) == {}  # no such process


def test_procfs_asks_its_reader_in_the_process_namespace(tmp_path):
    """A fixture tree has no kernel behind it: it is given a stand-in reader, or none. The
    reader is asked in the process's namespace, as the tree names it, where it is not ours."""
    for pid, ns in (("self", "net:[4026531840]"), (10, "net:[4026531840]"), (11, "net:[99]")):
        (tmp_path / str(pid) / "ns").mkdir(parents=True)
        os.symlink(ns, tmp_path / str(pid) / "ns" / "net")
    asked = []

    def reader(ports, netns):
        asked.append((list(ports) if ports is not None else None, netns))
        return {7: TcpInfo(1, 2, 3, 4)}

    proc = ProcFS(str(tmp_path), tcp_info=reader)
    assert proc.tcp_info(10, [("tcp", 80)]) == {7: TcpInfo(1, 2, 3, 4)}
    assert proc.tcp_info(11, None) == {7: TcpInfo(1, 2, 3, 4)}
    assert proc.tcp_info(12, None) == {}  # no namespace: gone, not asked
    assert asked == [([("tcp", 80)], None), (None, str(tmp_path / "11" / "ns" / "net"))]
    assert ProcFS(str(tmp_path), tcp_info=None).tcp_info(10, None) == {}


def test_sampler_fills_tcp_info_of_accepted_connections_only():
    with pair() as (server, client, port):
        client.sendall(b"GET / HTTP/1.1\r\n\r\n")
        time.sleep(JIFFY_S)
        p = Sampler().snapshot([os.getpid()]).processes[os.getpid()]
        by_inode = {c.inode: c for c in p.connections}
        assert waiting_for_answer(by_inode[inode(server)]), by_inode[inode(server)]
        # The client end is on an ephemeral port nobody listens on: not read (cost).
        assert by_inode[inode(client)].last_recv_ms is None
        assert unanswered_requests(p, frozenset({port})) == [by_inode[inode(server)]]


def _blocked_in_recv(tid: int, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(f"/proc/self/task/{tid}/syscall") as f:
            if f.read().split()[0] == "45":  # recvfrom
                return
        time.sleep(0.005)
    raise AssertionError(f"thread {tid} never blocked in recvfrom")


def test_sampler_sees_the_thread_that_reads_a_half_request():
    """This process as the server: a thread reads the accepted connection, gets half a
    request and blocks in recv for the rest. The sampler names that connection as read (the
    fd in its registers), and the request is the client's to finish, not unanswered."""
    with pair() as (server, client, port):
        got: list[bytes] = []
        tids: list[int] = []

        def serve() -> None:
            tids.append(threading.get_native_id())
            while not b"".join(got).endswith(b"\r\n\r\n"):
                got.append(server.recv(4096))

        t = threading.Thread(target=serve)
        t.start()
        try:
            client.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")
            while not got:
                time.sleep(0.005)
            _blocked_in_recv(tids[0])
            p = Sampler().snapshot([os.getpid()]).processes[os.getpid()]
        finally:
            client.sendall(b"\r\n")
            t.join(5)
        assert p.reading == {inode(server)}
        (half,) = [c for c in p.connections if c.inode == inode(server)]
        assert incomplete_requests(p, frozenset({port})) == [half]
        assert unanswered_requests(p, frozenset({port})) == []


class TcpInfoProcFS(CountingProcFS):
    def __init__(self, root: str, answer: dict[int, TcpInfo]) -> None:
        super().__init__(root)
        self.answer = answer
        self.asked: list[tuple[int, list]] = []

    def tcp_info(self, pid, ports):
        self.asked.append((pid, list(ports) if ports is not None else None))
        return self.answer


def test_sampler_asks_once_per_namespace_for_listening_ports_only(tmp_path):
    """The torchrun job of test_procfs_sockets: the agent (pid 10) listens on 29611 and
    accepted the rank's connection (inode 402); the rank's end (403) is on no listening port."""
    info = TcpInfo(1200, 5000, 40, 0)
    proc = TcpInfoProcFS(str(make_job(tmp_path)), {402: info, 403: info})
    snap = Sampler(proc, clock_ns=lambda: 6_000_000_000).snapshot([10, 11])
    assert proc.asked == [(10, [("tcp6", 29611)])]
    (accepted,) = snap.processes[10].connections
    assert (accepted.last_recv_ms, accepted.last_sent_ms) == (1200, 5000)
    assert (accepted.bytes_received, accepted.bytes_acked) == (40, 0)
    (rank_end,) = snap.processes[11].connections
    assert rank_end.last_recv_ms is None  # answered for 403, but not asked for: left alone


def test_sampler_reads_a_connection_to_outside_by_its_local_port(tmp_path):
    """The rank alone: its store connection's peer (the agent) is outside this snapshot, so
    its tcp_info is read (data received from outside is progress; the last data moved dates
    a hang), asked for by the connection's own local port. With the agent in the snapshot
    (the test above) the same connection is chatter inside, and not read."""
    proc = TcpInfoProcFS(str(make_job(tmp_path)), {})
    snap = Sampler(proc, clock_ns=lambda: 6_000_000_000).snapshot([11])  # the rank alone
    (conn,) = snap.processes[11].connections
    assert [(pid, [p for _, p in ports]) for pid, ports in proc.asked] == [(11, [conn.local_port])]
