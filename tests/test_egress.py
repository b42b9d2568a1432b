"""Which writes leave the service (pure): only those count as progress."""

from __future__ import annotations

import os
from pathlib import Path

from agent.analysis.outbound import (
    CLIENT,
    FILE,
    LEAVES,
    NOWHERE,
    SERVICE,
    TERMINAL,
    UNKNOWN,
    ServiceEnds,
    closed_file,
    door_answers,
    fd_rest,
)
from agent.model import Connection, FdWrites, PortWrites
from agent.sources.procfs import ProcFS

# The torch store: rank 0's client (port 40001) polls its own server (29500) over loopback.
STORE_CLIENT = Connection("127.0.0.1", 40001, "127.0.0.1", 29500, 101, 0, 0)
STORE_SERVER = Connection("::ffff:127.0.0.1", 29500, "::ffff:127.0.0.1", 40001, 102, 0, 0)
# A client outside the service, answered by the front-end on 8000.
CLIENT_CONN = Connection("10.0.0.5", 8000, "10.0.0.9", 51000, 103, 0, 0)


def ends(pipes_read: frozenset[int] = frozenset()) -> ServiceEnds:
    return ServiceEnds([STORE_CLIENT, STORE_SERVER, CLIENT_CONN], pipes_read)


def test_each_kind_of_fd_goes_where_it_says() -> None:
    e = ends(pipes_read=frozenset({7}))
    assert e.destination("/var/log/server.log") == FILE
    assert e.destination("/dev/pts/3") == TERMINAL
    assert e.destination("/dev/null") == NOWHERE
    assert e.destination("anon_inode:[eventfd]") == SERVICE  # zmq waking its I/O thread
    assert e.destination("socket:[101]") == SERVICE  # the store client, to its own server
    assert e.destination("socket:[102]") == SERVICE  # and the server's reply (IPv4-mapped)
    assert e.destination("socket:[103]") == CLIENT  # an answer to a client outside
    assert e.destination("socket:[999]") == SERVICE  # a unix socket (zmq ipc://)
    assert e.destination("pipe:[7]") == SERVICE  # a pipe the service reads
    assert e.destination("pipe:[8]") == FILE  # stdout to journald: a log
    assert e.destination(None) == UNKNOWN
    assert {FILE, TERMINAL, CLIENT, UNKNOWN} == LEAVES


def test_pipes_read_tells_reading_ends_from_writing_ones(tmp_path: Path) -> None:
    """From /proc/PID/fd links and fdinfo flags (octal, O_ACCMODE in the low bits)."""
    fd = tmp_path / "10/fd"
    info = tmp_path / "10/fdinfo"
    fd.mkdir(parents=True)
    info.mkdir()
    for n, link, flags in ((3, "pipe:[7]", "0"), (4, "pipe:[8]", "01"), (5, "socket:[9]", "02")):
        os.symlink(link, fd / str(n))
        (info / str(n)).write_text(f"pos:\t0\nflags:\t{flags}\nmnt_id:\t15\n")
    assert ProcFS(str(tmp_path)).pipes_read(10) == {7}
    assert ProcFS(str(tmp_path)).pipes_read(11) == set()  # gone: nothing, no error


def test_writes_on_accepted_connections_are_placed_by_their_port() -> None:
    """Counted by the probe per port they were accepted on, when written: a front door's are
    answers even though every connection closed before the tick; an internal door's (the
    torch store on 29500) stay inside; a port no longer listening is not placed, and counts."""
    old = {8000: PortWrites(8000, 1000, 10, 1), 29500: PortWrites(29500, 50, 5, 1)}
    new = {
        8000: PortWrites(8000, 4000, 40, 2),
        29500: PortWrites(29500, 9000, 90, 2),
        9100: PortWrites(9100, 300, 3, 2),  # accepted on, closed since: nobody's door now
    }
    answered, unplaced = door_answers(new, old, front_ports={8000}, listening={8000, 29500})
    assert (answered, unplaced) == (3000, 300)
    # A port counted only since this window counts whole; nothing new, nothing
    assert door_answers({8000: PortWrites(8000, 70, 1, 2)}, {}, {8000}, {8000}) == (70, 0)
    assert door_answers(old, old, {8000}, {8000, 29500}) == (0, 0)


def test_an_fd_keeps_only_the_bytes_its_name_places() -> None:
    """fd 5 was reused by short connections (counted by port) and once by a log file."""
    before = FdWrites(5, bytes=1000, calls=10, last_ns=1, door_bytes=900)
    after = FdWrites(5, bytes=4200, calls=40, last_ns=2, door_bytes=4000)
    assert fd_rest(after, before) == 100  # the log's 100 bytes, not the 3100 answers
    assert fd_rest(after, None) == 200
    # A unix socket accepted and closed since: the kernel said so when it was written
    plumbing = FdWrites(6, bytes=500, calls=5, last_ns=2, unix_bytes=500)
    assert fd_rest(plumbing, FdWrites(6, bytes=100, calls=1, last_ns=1, unix_bytes=100)) == 0


def test_a_file_closed_before_its_name_was_read_is_still_a_file() -> None:
    """The raylet rewrites debug_state.txt through a new fd each time: the kernel saw a
    regular file (inode 77) at the write, so it is one named destination, not unplaced."""
    before = FdWrites(9, bytes=100, calls=1, last_ns=1, file_bytes=100, file_ino=70)
    after = FdWrites(9, bytes=19_900, calls=2, last_ns=2, file_bytes=19_900, file_ino=77)
    assert closed_file(after, before, fd_rest(after, before)) == "a file (inode 77)"
    # Some of it went elsewhere (a socket since closed): not all placed, so not named
    mixed = FdWrites(9, bytes=19_900, calls=3, last_ns=2, file_bytes=10_000, file_ino=77)
    assert closed_file(mixed, before, fd_rest(mixed, before)) is None
    assert closed_file(FdWrites(9, 5, 1, 1), None, 5) is None  # never a file
