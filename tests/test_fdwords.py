"""agent.observe.fdwaits: what a thread blocked on fds waits on, read from /proc of real threads of
this test process (read, poll, select, epoll_wait on real pipes, eventfds and sockets), and
its words (agent.report.fds)."""

from __future__ import annotations

import ctypes
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from agent.model import SocketPeer
from agent.observe import fdwaits
from agent.observe.fdwaits import MAX_FDS, fd_link, poll_fds, select_fds, sockets
from agent.report.fds import fd_words, fds_words
from agent.sources.procfs import ProcFS

PROC = ProcFS()


def waited_on(
    proc: ProcFS, pid: int, tid: int, known: dict[int, SocketPeer] | None = None
) -> str | None:
    """What the thread waits on, as read and then said in words."""
    wait = fdwaits.waited_on(proc, pid, tid, known)
    return fds_words(wait) if wait is not None else None


@contextmanager
def blocked(call: Callable[[], object], syscalls: set[int]) -> Iterator[int]:
    """A thread of ours blocked in ``call``; its TID once /proc shows it asleep in one of
    ``syscalls``. The caller wakes it (by writing to what it waits on) before leaving."""
    tid: list[int] = []

    def run() -> None:
        tid.append(threading.get_native_id())
        call()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    deadline = time.monotonic() + 5
    while True:
        sc = PROC.thread_syscall(os.getpid(), tid[0]) if tid else None
        if sc is not None and sc.nr in syscalls:
            break
        assert time.monotonic() < deadline, f"the thread did not block in {syscalls}"
        time.sleep(0.01)
    try:
        yield tid[0]
    finally:
        t.join(5)


def test_read_on_a_pipe() -> None:
    r, w = os.pipe()
    try:
        with blocked(lambda: os.read(r, 1), {0}) as tid:
            assert waited_on(PROC, os.getpid(), tid) == f"a pipe (fd {r})"
            os.write(w, b"x")
    finally:
        os.close(r)
        os.close(w)


def test_poll_on_an_eventfd_and_a_pipe() -> None:
    efd = os.eventfd(0)
    r, w = os.pipe()
    p = select.poll()
    p.register(efd, select.POLLIN)
    p.register(r, select.POLLIN)
    try:
        with blocked(lambda: p.poll(), {7, 271}) as tid:
            assert waited_on(PROC, os.getpid(), tid) == f"an eventfd (fd {efd}), a pipe (fd {r})"
            os.eventfd_write(efd, 1)
    finally:
        for fd in (efd, r, w):
            os.close(fd)


def test_select_names_the_read_set() -> None:
    r, w = os.pipe()
    try:
        with blocked(lambda: select.select([r], [], []), {23, 270}) as tid:
            assert waited_on(PROC, os.getpid(), tid) == f"a pipe (fd {r})"
            os.write(w, b"x")
    finally:
        os.close(r)
        os.close(w)


def test_epoll_names_its_members_and_a_tcp_peer(tmp_path: Path) -> None:
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    conn, _ = server.accept()
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(str(tmp_path / "sched.sock"))
    unix.listen()
    ep = select.epoll()
    for s in (client, server, unix):
        ep.register(s.fileno(), select.EPOLLIN)
    try:
        with blocked(lambda: ep.poll(), {232, 281, 441}) as tid:
            what = waited_on(PROC, os.getpid(), tid, sockets(PROC, os.getpid()))
            port = server.getsockname()[1]
            assert what is not None
            assert f"a socket to 127.0.0.1:{port} (fd {client.fileno()})" in what
            assert f"the listening socket on port {port} (fd {server.fileno()})" in what
            assert f"the unix socket {tmp_path / 'sched.sock'} (fd {unix.fileno()})" in what
            conn.send(b"x")
    finally:
        for s in (client, conn, server, unix):
            s.close()
        ep.close()


def test_many_fds_are_counted_past_the_first_few() -> None:
    pipes = [os.pipe() for _ in range(MAX_FDS + 2)]
    p = select.poll()
    for r, _ in pipes:
        p.register(r, select.POLLIN)
    try:
        with blocked(lambda: p.poll(), {7, 271}) as tid:
            what = waited_on(PROC, os.getpid(), tid)
            assert what is not None and what.endswith(" and 2 more fds"), what
            assert what.count("a pipe") == MAX_FDS
            os.write(pipes[0][1], b"x")
    finally:
        for r, w in pipes:
            os.close(r)
            os.close(w)


def test_a_thread_in_no_fd_wait_and_a_gone_thread_give_none() -> None:
    ev = threading.Event()
    with blocked(lambda: ev.wait(), {202}) as tid:
        assert waited_on(PROC, os.getpid(), tid) is None  # a futex: no fd
        ev.set()
    assert waited_on(PROC, os.getpid(), 1 << 30) is None


def test_poll_and_select_lists_read_from_memory() -> None:
    entries = [(5, 1, 0), (-1, 1, 0), (9, 1, 0)]  # fd -1: poll(2) skips it, and so do we
    buf = ctypes.create_string_buffer(b"".join(struct.pack("<ihh", *e) for e in entries))
    assert poll_fds(PROC, os.getpid(), ctypes.addressof(buf), 3) == [5, 9]
    bits = ctypes.create_string_buffer(bytes([0b10000010, 0b1]))  # fds 1, 7, 8
    assert select_fds(PROC, os.getpid(), 9, ctypes.addressof(bits)) == [1, 7, 8]
    assert select_fds(PROC, os.getpid(), 8, ctypes.addressof(bits)) == [1, 7]  # nfds bounds
    assert poll_fds(PROC, os.getpid(), 8, 3) == []  # unmapped


@pytest.mark.parametrize(
    ("target", "want"),
    [
        (None, "fd 3"),
        ("pipe:[77]", "a pipe (fd 3)"),
        ("anon_inode:[eventfd]", "an eventfd (fd 3)"),
        ("anon_inode:[eventpoll]", "an epoll set (fd 3)"),
        ("anon_inode:[timerfd]", "timerfd (fd 3)"),
        ("socket:[42]", "a socket to 10.0.0.2:5000 (fd 3)"),
        ("socket:[43]", "a socket (fd 3)"),
        ("/dev/pts/1", "the terminal /dev/pts/1"),
        ("/var/log/x.log", "/var/log/x.log (fd 3)"),
    ],
)
def test_fd_words(target: str | None, want: str) -> None:
    peer = SocketPeer("tcp", port=5000, address="10.0.0.2")
    assert fd_words(fd_link(target, 3, {42: peer})) == want
