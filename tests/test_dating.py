"""When a quiet service last made progress (agent.analysis.last_progress) and what it received from outside
in the window (agent.analysis.outbound.received_from_outside), from synthetic samples; and the /proc
reader both stand on, ProcFS.written_fds, on this process's own fds."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import pytest

from agent.analysis import evidence as ev
from agent.analysis.last_progress import last_progress
from agent.analysis.outbound import ServiceEnds, received_from_outside
from agent.model import Connection, ProcessSample, ThreadSample, WrittenFd
from agent.sources.procfs import ProcFS
from tests.synth import S, parked, process, running

NOW = 1000 * S  # the snapshot's monotonic clock
WALL = 1_700_000_000.0  # and its wall clock
WINDOW_START = NOW - 5 * S
FRONT = frozenset({8000})


def conn(
    local_port: int,
    remote: str,
    remote_port: int,
    inode: int,
    *,
    local: str = "10.0.0.5",
    recv_ms: int | None = None,
    sent_ms: int | None = None,
    received: int | None = None,
    acked: int | None = None,
) -> Connection:
    return Connection(
        local,
        local_port,
        remote,
        remote_port,
        inode,
        0,
        0,
        last_recv_ms=recv_ms,
        last_sent_ms=sent_ms,
        bytes_received=received,
        bytes_acked=acked,
    )


def with_conns(p: ProcessSample, *conns: Connection) -> ProcessSample:
    return ProcessSample(p.pid, p.ppid, p.comm, p.start_ticks, p.threads, connections=conns)


def ends_of(samples: Iterable[ProcessSample], pipes_inside: frozenset[int] = frozenset()):
    return ServiceEnds((c for s in samples for c in s.connections), pipes_inside)


def date(
    samples: Sequence[ProcessSample],
    written: Mapping[int, Sequence[WrittenFd]] | None = None,
    front: frozenset[int] = FRONT,
    pipes_inside: frozenset[int] = frozenset(),
) -> ev.LastProgress | None:
    return last_progress(
        samples, written or {}, ends_of(samples, pipes_inside), front, NOW, WALL, WINDOW_START
    )


def untimed(tid: int, last_ran_s_ago: float, name: str = "worker") -> ThreadSample:
    """A thread in a futex wait with no timeout that last ran that long before NOW."""
    t = parked(tid, name=name, since=NOW - int(last_ran_s_ago * S))
    return ThreadSample(**{**t.__dict__, "timed": False})


def thread(tid: int, syscall: int, timed: bool | None, last_ran_s_ago: float) -> ThreadSample:
    return ThreadSample(
        tid, "t", "S", 0, last_ran_ns=NOW - int(last_ran_s_ago * S), syscall=syscall, timed=timed
    )


# Outside peers: an object store streaming weights, a client at the front door.
STORE = "10.0.0.50"
CLIENT = "10.0.0.9"


# --- last_progress ---------------------------------------------------------------------------


def test_the_most_recent_of_several_wins() -> None:
    """Sent 20 s ago, received 35 s ago, a log written 50 s ago, a thread that ran 80 s ago:
    each dates the service once the more recent ones are taken away."""
    log = {10: [WrittenFd(1, "/var/log/server.log", WALL - 50)]}
    waiter = untimed(10, 80)  # the main thread
    both = conn(40100, STORE, 443, 501, sent_ms=20_000, acked=100, recv_ms=35_000, received=9)
    recv_only = conn(40100, STORE, 443, 501, sent_ms=20_000, acked=0, recv_ms=35_000, received=9)
    assert date([with_conns(process(10, waiter), both)], log) == ev.LastProgress(
        "sent", f"{STORE}:443", 10, 20.0
    )
    assert date([with_conns(process(10, waiter), recv_only)], log) == ev.LastProgress(
        "received", f"{STORE}:443", 10, 35.0
    )
    assert date([process(10, waiter)], log) == ev.LastProgress(
        "write", "/var/log/server.log", 10, 50.0
    )
    assert date([process(10, waiter)]) == ev.LastProgress("ran", ev.Thread(10, "worker"), 10, 80.0)


def test_candidates_from_several_processes() -> None:
    a, b = process(10, untimed(10, 200)), process(20, untimed(20, 40, name="rank"))
    assert date([a, b]) == ev.LastProgress("ran", ev.Thread(20, "rank"), 20, 40.0)
    assert date([b, a]) == ev.LastProgress("ran", ev.Thread(20, "rank"), 20, 40.0)


def test_a_file_write_older_than_a_thread_last_ran_loses_to_it() -> None:
    p = process(10, untimed(10, 30))
    got = date([p], {10: [WrittenFd(2, "/var/log/server.log", WALL - 100)]})
    assert got == ev.LastProgress("ran", ev.Thread(10, "worker"), 10, 30.0)


def test_a_write_from_the_future_is_dated_now() -> None:
    got = date([process(10)], {10: [WrittenFd(1, "/dev/pts/0", WALL + 3)]})
    assert got == ev.LastProgress("write", "/dev/pts/0", 10, 0.0)


def test_writes_that_stay_in_the_service_or_reach_nobody_are_not_progress() -> None:
    written = {
        10: [
            WrittenFd(1, "/dev/null", WALL - 1),
            WrittenFd(5, "pipe:[77]", WALL - 2),  # read by the service itself
        ]
    }
    assert date([process(10)], written, pipes_inside=frozenset({77})) is None
    # A pipe read outside (stdout to journald) is a log.
    got = date([process(10)], written, pipes_inside=frozenset())
    assert got == ev.LastProgress("write", "pipe:[77]", 10, 2.0)


def test_threads_in_timed_futex_waits_or_in_epoll_are_ignored() -> None:
    # All of them last ran well before the window.
    p = process(
        10,
        thread(11, 202, True, 30),  # gloo's loop: a futex wait with a timeout
        thread(12, 232, False, 40),  # zmq's I/O thread in epoll_wait with no timeout
        thread(13, 7, False, 50),  # poll
        thread(14, 230, True, 60),  # a monitor's sleep
        thread(15, 202, None, 70),  # a futex wait whose timeout is unknown
    )
    assert date([p]) is None
    # The same, with one untimed futex wait among them: only it dates the service.
    q = process(10, *p.threads, untimed(10, 120))
    assert date([q]) == ev.LastProgress("ran", ev.Thread(10, "worker"), 10, 120.0)


def test_only_a_main_thread_dates_the_service() -> None:
    """A runtime's pool thread wakes on a period of its own: a Ray worker's gRPC event-engine
    thread last ran 10 s ago while the actor's main thread had waited 41 s on its Event."""
    actor = process(10, untimed(10, 41, name="ray::Stuck"), untimed(11, 10, name="event_engine"))
    assert date([actor]) == ev.LastProgress("ran", ev.Thread(10, "ray::Stuck"), 10, 41.0)
    assert date([process(10, untimed(11, 10, name="event_engine"))]) is None


def test_futex_wait_2_counts_like_futex() -> None:
    assert date([process(10, thread(10, 455, False, 70))]) == ev.LastProgress(
        "ran", ev.Thread(10, "t"), 10, 70.0
    )


def test_a_thread_that_ran_inside_the_window_is_ignored() -> None:
    assert date([process(10, untimed(10, 2))]) is None  # ran 2 s ago, the window is 5 s
    assert date([process(10, untimed(10, 5))]) is None  # at the window's start: inside it
    assert date([process(10, untimed(10, 5.001))]) is not None


def test_running_threads_and_undated_ones_are_ignored() -> None:
    t = ThreadSample(12, "x", "S", 0, last_ran_ns=None, syscall=202, timed=False)
    assert date([process(10, running(11), t)]) is None


def test_a_connection_to_a_peer_inside_the_service_is_ignored() -> None:
    # torch's store: rank 0's client polls its own server on 29500 over loopback.
    client = conn(
        40001,
        "127.0.0.1",
        29500,
        101,
        local="127.0.0.1",
        sent_ms=10,
        acked=9,
        recv_ms=10,
        received=9,
    )
    server = conn(
        29500, "::ffff:127.0.0.1", 40001, 102, local="::ffff:127.0.0.1", sent_ms=10, acked=9
    )
    a = with_conns(process(10), client)
    b = with_conns(process(20), server)
    assert date([a, b]) is None
    # The client alone (its server not in the service) is a peer outside.
    assert date([a]) == ev.LastProgress("sent", "127.0.0.1:29500", 10, 0.01)


def test_received_data_at_a_front_door_is_a_request_not_received_progress() -> None:
    request = conn(8000, CLIENT, 51000, 103, recv_ms=1_000, received=300, sent_ms=90_000, acked=50)
    p = with_conns(process(10), request)
    # The answer sent 90 s ago dates it; the request received 1 s ago does not.
    assert date([p]) == ev.LastProgress("sent", f"{CLIENT}:51000", 10, 90.0)
    # On a port that is not a front door the same data is received progress.
    assert date([p], front=frozenset()) == ev.LastProgress("received", f"{CLIENT}:51000", 10, 1.0)


def test_times_without_bytes_are_not_dated() -> None:
    # tcp_info keeps last_data_* at the handshake for a connection that never carried data.
    p = with_conns(process(10), conn(40100, STORE, 443, 501, recv_ms=3, sent_ms=3, received=0))
    assert date([p]) is None
    q = with_conns(process(10), conn(40100, STORE, 443, 501, recv_ms=3, received=None))
    assert date([q]) is None


def test_none_when_nothing_is_dated() -> None:
    assert date([]) is None
    assert date([process(10, running(11))]) is None


# --- received_from_outside -------------------------------------------------------------------


def received(old: ProcessSample | None, new: ProcessSample, front=FRONT) -> int:
    return received_from_outside(old, new, ends_of([new]), front)


def test_received_counts_the_delta_of_each_connection_by_inode() -> None:
    old = with_conns(
        process(10),
        conn(40100, STORE, 443, 501, received=1000),
        conn(40101, STORE, 443, 502, received=50),
    )
    new = with_conns(  # in another order, as /proc lists them
        process(10),
        conn(40101, STORE, 443, 502, received=80),
        conn(40100, STORE, 443, 501, received=1500),
    )
    assert received(old, new) == 530


def test_a_new_connection_counts_whole() -> None:
    old = with_conns(process(10), conn(40100, STORE, 443, 501, received=1000))
    new = with_conns(
        process(10),
        conn(40100, STORE, 443, 501, received=1000),
        conn(40102, STORE, 443, 503, received=4096),
    )
    assert received(old, new) == 4096
    assert received(None, new) == 5096  # no old sample: every connection is new


def test_a_connection_not_read_at_the_window_start_is_skipped() -> None:
    old = with_conns(process(10), conn(40100, STORE, 443, 501, received=None))
    new = with_conns(process(10), conn(40100, STORE, 443, 501, received=7000))
    assert received(old, new) == 0
    unread_now = with_conns(process(10), conn(40100, STORE, 443, 501, received=None))
    assert received(None, unread_now) == 0


def test_a_count_that_went_down_counts_nothing() -> None:
    old = with_conns(process(10), conn(40100, STORE, 443, 501, received=9000))
    new = with_conns(process(10), conn(40100, STORE, 443, 501, received=100))
    assert received(old, new) == 0


def test_received_skips_front_doors_and_the_service_itself() -> None:
    request = conn(8000, CLIENT, 51000, 103, received=300)
    client = conn(40001, "127.0.0.1", 29500, 101, local="127.0.0.1", received=64)
    server = conn(29500, "127.0.0.1", 40001, 102, local="127.0.0.1", received=64)
    new = with_conns(process(10), request, client, server)
    assert received(None, new) == 0
    assert received(None, new, front=frozenset()) == 300


# --- ProcFS.written_fds on this process -----------------------------------------------------


@pytest.mark.skipif(not os.path.isdir("/proc/self/fdinfo"), reason="needs Linux /proc")
def test_written_fds_lists_files_open_for_writing_with_their_mtime(tmp_path: Path) -> None:
    log, data = tmp_path / "out.log", tmp_path / "in.dat"
    data.write_bytes(b"weights")
    then = time.time() - 100
    with open(log, "w") as w, open(data, "rb") as r:
        w.write("hello\n")
        w.flush()
        os.utime(log, (then, then))
        os.utime(data, (then, then))
        fds = ProcFS().written_fds(os.getpid())
        by_target = {x.target: x for x in fds}
        assert str(log) in by_target, fds
        assert by_target[str(log)].fd == w.fileno()
        assert by_target[str(log)].mtime == pytest.approx(then, abs=1e-3)
        assert str(data) not in by_target  # open read-only
        assert all(x.target.startswith(("/", "pipe:[")) for x in fds)
        assert r.fileno() not in {x.fd for x in fds}
    assert ProcFS(str(tmp_path)).written_fds(os.getpid()) == []  # no such /proc: nothing
