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
)
from agent.model import Connection
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
