"""Reads of /proc files a target controls are bounded (agent.sources.procfs): its maps are
streamed and capped, or not read as text at all (PROCMAP_QUERY); whole-file reads, fd walks
and socket tables are capped; a unix socket's name cannot pass for another socket's record
(agent.sources.unixdiag, and parse_net_unix where sock_diag cannot be asked).

The attacks themselves, as a tenant against the real daemon and diagnose, are in
tests/privileged/test_tenant_bounds.py.
"""

from __future__ import annotations

import os
import socket
import struct
import tempfile
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.observe.launchers import parse_plumbing
from agent.sources import procfs, unixdiag
from agent.sources.procfs import (
    MAPS_LINE_MAX,
    PATH_TOO_LONG,
    READ_MAX_BYTES,
    MemMap,
    ProcFS,
    parse_net_unix,
)

LIB = "/usr/lib/x86_64-linux-gnu/libfoo.so.1"


def maps_line(start: int, end: int, perms: str = "r--s", inode: int = 77, path: str = LIB) -> str:
    return f"{start:08x}-{end:08x} {perms} 00000000 fe:00 {inode}    {path}\n"


def tree(tmp_path: Path, files: dict[str, str | bytes]) -> ProcFS:
    for name, data in files.items():
        p = tmp_path / "7" / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data if isinstance(data, bytes) else data.encode())
    return ProcFS(str(tmp_path), tcp_info=None)


# --- /proc/PID/maps -------------------------------------------------------------------------


def test_the_kernels_answer_for_an_address_is_its_maps_line() -> None:
    """mappings_at (PROCMAP_QUERY where the kernel has it) gives each mapping of our own
    process as its maps line reads, but for the path, which it does not ask for."""
    proc = ProcFS()
    lines = proc.maps("self")
    # The mappings of the maps read that no allocation since can have moved: files' and the stack.
    stable = [m for m in lines if m.inode or m.path == "[stack]"]
    assert stable
    addrs = {m.start: m for m in stable} | {(m.start + m.end) // 2: m for m in stable}
    got = proc.mappings_at(os.getpid(), addrs)
    assert got.cut is None
    for a, m in addrs.items():
        assert got.found[a].start == m.start and got.found[a].end == m.end, hex(a)
        assert (got.found[a].perms, got.found[a].offset) == (m.perms, m.offset), m
        assert (got.found[a].dev, got.found[a].inode) == (m.dev, m.inode), m
    assert proc.mappings_at(os.getpid(), {8}).found == {}  # nothing is mapped at page 0


def test_only_the_mappings_asked_for_are_kept(tmp_path: Path) -> None:
    proc = tree(
        tmp_path,
        {"maps": "".join(maps_line(0x1000 * i, 0x1000 * (i + 1)) for i in range(1, 100))},
    )
    got = proc.mappings_at(7, {0x5008, 0x9000, 0x200000})
    assert set(got.found) == {0x5008, 0x9000} and got.cut is None
    assert got.found[0x5008] == MemMap(0x5000, 0x6000, "r--s", 0, "fe:00", 77, LIB)
    assert got.found[0x9000].start == 0x9000


def test_maps_past_the_cap_are_cut_and_say_so(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(procfs, "MAPS_MAX_BYTES", 1 << 16)
    n = (1 << 16) // len(maps_line(0x1000, 0x2000)) * 2  # twice what the cap lets through
    proc = tree(tmp_path, {"maps": "".join(maps_line(i << 12, (i + 1) << 12) for i in range(1, n))})
    read = proc.maps_read(7)
    assert 0 < len(read.maps) < n - 1 and read.cut is not None and "larger than" in read.cut
    assert proc.maps_cut == 1
    last = read.maps[-1].end
    got = proc.mappings_at(7, {0x1000, last + 0x1000})
    assert set(got.found) == {0x1000} and got.cut == read.cut  # past the cut: not found, said


def test_maps_past_the_line_cap_are_cut_and_say_so(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(procfs, "MAPS_MAX_LINES", 100)
    proc = tree(
        tmp_path, {"maps": "".join(maps_line(i << 12, (i + 1) << 12) for i in range(1, 300))}
    )
    read = proc.maps_read(7)
    assert len(read.maps) == 100 and read.cut is not None and "100 mappings" in read.cut
    assert proc.maps_cut == 1


def test_a_line_past_path_max_keeps_its_mapping_not_its_path(tmp_path: Path) -> None:
    long_path = "/" + "d" * 200 + ("/" + "d" * 200) * 30
    assert len(long_path) > MAPS_LINE_MAX
    proc = tree(
        tmp_path,
        {"maps": maps_line(0x1000, 0x2000, path=long_path) + maps_line(0x3000, 0x4000)},
    )
    first, second = proc.maps(7)
    assert first == MemMap(0x1000, 0x2000, "r--s", 0, "fe:00", 77, PATH_TOO_LONG)
    assert second.path == LIB and second.start == 0x3000  # the line after it is whole


def test_one_file_mapped_many_times_holds_its_path_once(tmp_path: Path) -> None:
    proc = tree(
        tmp_path, {"maps": "".join(maps_line(i << 12, (i + 1) << 12) for i in range(1, 2000))}
    )
    maps = proc.maps(7)
    assert len(maps) == 1999 and len({id(m.path) for m in maps}) == 1


@given(st.binary(max_size=3000), st.integers(1, 200), st.integers(1, 4000))
def test_bounded_lines_never_read_past_their_caps(data: bytes, line_max: int, max_bytes: int):
    """No line longer than its cap; the whole file where it fits the byte cap, each line as
    it is or cut to its cap and said to be; cut, and said to be, where it does not fit."""
    with tempfile.NamedTemporaryFile() as f:
        f.write(data)
        f.flush()
        lines = procfs.BoundedLines(f.name, max_bytes, line_max)
        got = list(lines)
    assert all(len(line) <= line_max for line, _ in got)
    if len(data) <= max_bytes:
        assert not lines.cut
        want = data.split(b"\n")
        if want[-1] == b"":
            want.pop()  # the newline ending the last line
        assert [long for _, long in got] == [len(w) > line_max for w in want]
        assert [line for line, _ in got] == [w[:line_max].decode(errors="replace") for w in want]
    if len(data) > max_bytes:
        assert lines.cut


# --- whole-file reads, fd walks, tables ----------------------------------------------------


def test_a_command_line_is_read_up_to_the_cap_in_whole_arguments(tmp_path: Path) -> None:
    """Past READ_MAX_BYTES the argument cut in two is dropped: "8000" cut to "80" would be
    another port."""
    k = READ_MAX_BYTES - len(b"srv\0") - len(b"\0--port\0") - 2  # the cap falls after "80"
    data = b"srv\0" + b"x" * k + b"\0--port\08000\0" + b"y" * READ_MAX_BYTES
    proc = tree(tmp_path, {"cmdline": data})
    assert proc.argv(7) == ["srv", "x" * k, "--port"]
    assert parse_plumbing(proc.environ(7), proc.argv(7) or []).named_ports == ()


def test_an_fd_walk_stops_at_its_cap_and_counts_it(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(procfs, "FDS_WALKED_MAX", 8)
    proc = tree(tmp_path, {"stat": ""})
    (tmp_path / "7" / "fd").mkdir()
    for fd in range(20):
        os.symlink(f"socket:[{1000 + fd}]", tmp_path / "7" / "fd" / str(fd))
    assert len(proc.socket_inodes(7)) == 8 and proc.fd_walks_cut == 1


def test_timers_are_told_from_the_files_start(tmp_path: Path) -> None:
    entry = "ID: 0\nsignal: 14/0000000000000000\nnotify: signal/pid.7\nClockID: 1\n"
    assert tree(tmp_path, {"timers": entry * 50_000}).has_posix_timers(7)
    assert not tree(tmp_path, {"timers": ""}).has_posix_timers(7)


def test_a_tcp_table_past_the_cap_is_read_to_there(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(procfs, "NET_TABLE_MAX_BYTES", 1 << 14)
    head = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
    line = (
        "   0: 0100007F:{port:04X} 00000000:0000 0A 00000000:00000000 00:00000000 00000000"
        "     0        0 {inode} 1 0000000000000000 100 0 0 10 0\n"
    )
    rows = "".join(line.format(port=1000 + i, inode=5000 + i) for i in range(1000))
    proc = tree(tmp_path, {"net/tcp": head + rows, "net/tcp6": head})
    got = proc.tcp_sockets(7)
    assert 0 < len(got) < 1000 and got[0].port == 1000
    assert [s.port for s in proc.tcp_sockets(7, ports=[1001])] == [1001]


# --- unix socket names: no line forged -----------------------------------------------------

RECORD = "0000000000000000: 00000002 00000000 00010000 0001 01 {inode}{path}"


def _record(inode: int, path: str = "") -> str:
    return RECORD.format(inode=inode, path=f" {path}" if path else "")


def test_a_forged_record_is_believed_for_no_socket() -> None:
    victim, tenant = 4242, 777
    for real in ("", "/run/victim.sock"):
        forged = "x\n" + _record(victim, "/tmp/tenant-chose")
        lines = [
            "Num       RefCount Protocol Flags    Type St Inode Path",
            _record(victim, real),
            *(_record(tenant, "@" + forged)).split("\n"),
        ]
        for order in (lines, [lines[0], *lines[:0:-1]]):
            got = parse_net_unix(order)
            assert victim not in got, (real, order)  # neither record believed: listed twice
            assert got[tenant] == "x"  # the tenant's own record, up to its newline


@given(st.text(max_size=108))
def test_no_name_gives_another_socket_a_path(name: str) -> None:
    """Whatever name the tenant binds, the victim's socket (bound or not) is given its own
    path or none."""
    victim, tenant = 4242, 777
    for real in ("", "/run/victim.sock"):
        text = "\n".join(["Num ...", _record(victim, real), _record(tenant, "@" + name)])
        got = parse_net_unix(text.split("\n"), {victim})
        assert got.get(victim) in (None, real or None)


@pytest.fixture
def forged_sockets():
    """A connected socket (no name) and an abstract one whose name forges a record giving
    the first one a path; and a socket bound to a path of its own."""
    a, b = socket.socketpair()
    victim = os.fstat(a.fileno()).st_ino
    forger = socket.socket(socket.AF_UNIX)
    forger.bind("\0x\n" + _record(victim, "/tmp/tenant-chose"))
    yield victim, os.fstat(forger.fileno()).st_ino
    for s in (a, b, forger):
        s.close()


def test_sock_diag_gives_each_socket_its_own_name(forged_sockets, tmp_path: Path) -> None:
    victim, forger = forged_sockets
    with socket.socket(socket.AF_UNIX) as named:
        named.bind(str(tmp_path / "s"))
        ino = os.fstat(named.fileno()).st_ino
        got = unixdiag.read_unix_paths([victim, forger, ino, 1])
        if got is None:
            pytest.skip("no unix_diag in this kernel: the text is read (next test)")
        assert got == {
            forger: "@x\n" + _record(victim, "/tmp/tenant-chose"),
            ino: str(tmp_path / "s"),
        }
        paths = ProcFS().unix_socket_paths(os.getpid(), [victim, forger, ino])
        assert victim not in paths and paths[ino] == str(tmp_path / "s")
        assert "\n" not in paths[forger]  # escaped: shown, never a line of its own


def test_the_text_read_believes_no_forged_record(forged_sockets, tmp_path: Path) -> None:
    victim, forger = forged_sockets
    assert f" {victim} /tmp/tenant-chose\n" in Path("/proc/net/unix").read_text(errors="replace")
    with socket.socket(socket.AF_UNIX) as named:
        named.bind(str(tmp_path / "s"))
        ino = os.fstat(named.fileno()).st_ino
        proc = ProcFS(unix_paths=lambda inodes, netns: None)  # sock_diag cannot be asked
        paths = proc.unix_socket_paths(os.getpid(), [victim, forger, ino])
    assert victim not in paths and paths[ino] == str(tmp_path / "s") and paths[forger] == "x"


def _answer(kind: int, body: bytes) -> bytes:
    return struct.pack("=IHHII", 16 + len(body), kind, 0, 1, 0) + body


def test_an_answer_about_another_socket_is_not_believed() -> None:
    name = b"\0abc\0d"
    attr = struct.pack("=HH", 4 + len(name), unixdiag.UNIX_DIAG_NAME) + name
    msg = unixdiag.UNIX_DIAG_MSG.pack(socket.AF_UNIX, 1, 1, 99, 0, 0)
    data = _answer(unixdiag.SOCK_DIAG_BY_FAMILY, msg + attr + b"\0" * (-len(attr) % 4))
    assert unixdiag.parse_answer(data, 99) == "@abc@d"
    assert unixdiag.parse_answer(data, 98) is None  # an answer about 99 is not 98's
    gone = _answer(unixdiag.NLMSG_ERROR, struct.pack("=i", -2) + bytes(16))
    assert unixdiag.parse_answer(gone, 99) is None
    with pytest.raises(OSError):
        unixdiag.parse_answer(_answer(unixdiag.NLMSG_ERROR, struct.pack("=i", -13)), 99)


@given(st.binary(max_size=300), st.integers(0, 1 << 32))
def test_any_answer_parses_or_is_refused(data: bytes, inode: int) -> None:
    try:
        got = unixdiag.parse_answer(data, inode)
    except OSError:
        return
    assert got is None or len(got) <= unixdiag.NAME_MAX * 3
