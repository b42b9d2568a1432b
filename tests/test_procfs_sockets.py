"""The evidence for front doors from /proc: connections, plumbing hints, the ephemeral range."""

from __future__ import annotations

import os
import socket
import struct
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.model import Connection, Plumbing
from agent.observe.launchers import parse_plumbing
from agent.observe.sampler import Sampler
from agent.sources.procfs import ProcFS, parse_net_tcp, parse_port_range
from tests.test_procfs import TCP_HEADER, stat_line, write


def _hex(addr: str, v6: bool) -> str:
    if v6:
        raw = socket.inet_pton(socket.AF_INET6, addr)
        return "".join(f"{w:08X}" for w in struct.unpack("<4I", raw))
    return f"{struct.unpack('<I', socket.inet_aton(addr))[0]:08X}"


def tcp_line(
    i: int, local: tuple[str, int], remote: tuple[str, int], st_: int, inode: int, v6=False
) -> str:
    (la, lp), (ra, rp) = local, remote
    return (
        f"{i:4d}: {_hex(la, v6)}:{lp:04X} {_hex(ra, v6)}:{rp:04X} {st_:02X} 00000000:00000003 "
        f"00:00000000 00000000     0        0 {inode} 1 0000000000000000 100 0 0 10 0\n"
    )


@given(
    st.lists(
        st.tuples(
            st.ip_addresses(v=4).map(str),
            st.integers(0, 65535),
            st.ip_addresses(v=4).map(str),
            st.integers(0, 65535),
            st.integers(1, 2**31),
        ),
        max_size=6,
    )
)
def test_net_tcp_remote_round_trip(rows):
    text = TCP_HEADER + "".join(
        tcp_line(i, (la, lp), (ra, rp), 1, ino) for i, (la, lp, ra, rp, ino) in enumerate(rows)
    )
    got = [
        (s.address, s.port, s.remote_address, s.remote_port, s.inode)
        for s in parse_net_tcp(text, "tcp")
    ]
    assert got == [tuple(r) for r in rows]


def test_net_tcp6_remote_v4_mapped():
    text = TCP_HEADER + tcp_line(
        0, ("::ffff:127.0.0.1", 29611), ("::ffff:127.0.0.1", 47386), 1, 9, v6=True
    )
    (s,) = parse_net_tcp(text, "tcp6")
    assert (s.address, s.remote_address, s.remote_port) == (
        "::ffff:127.0.0.1",
        "::ffff:127.0.0.1",
        47386,
    )


def test_a_line_with_a_broken_remote_is_skipped():
    good = tcp_line(0, ("127.0.0.1", 80), ("127.0.0.1", 5), 1, 9)
    bad = good.replace(f"{_hex('127.0.0.1', False)}:0005", "0100007G:0005")
    assert len(parse_net_tcp(TCP_HEADER + bad + good, "tcp")) == 1


def test_parse_port_range():
    assert parse_port_range("32768\t60999\n") == (32768, 60999)
    assert parse_port_range("1024 65535") == (1024, 65535)
    for bad in ("", "32768", "0 100", "5 4", "x y", "1 70000", "1 2 3"):
        assert parse_port_range(bad) is None, bad


@given(st.text(max_size=30))
def test_parse_port_range_any_text(text):
    got = parse_port_range(text)
    assert got is None or 0 < got[0] <= got[1] < 1 << 16


# --- the sampler, on a fixture /proc tree ----------------------------------------------------


def make_job(tmp_path: Path) -> Path:
    """An agent (10, torchrun, listening on 29611) and its rank (11, MASTER_PORT=29611, a gloo
    listener on 35293) in one network namespace; the rank's store client is connected."""
    root = tmp_path / "proc"
    write(root / "sys/net/ipv4/ip_local_port_range", "40000\t60999\n")
    for pid, comm, ppid in ((10, "pt_elastic", 1), (11, "python3", 10)):
        write(root / f"{pid}/stat", stat_line(pid, comm, ppid=ppid))
        write(root / f"{pid}/task/{pid}/stat", stat_line(pid, comm, state="S", ppid=ppid))
        write(root / f"{pid}/task/{pid}/schedstat", "1000 0 3\n")
        (root / f"{pid}/ns").mkdir(parents=True)
        os.symlink("net:[4026531840]", root / f"{pid}/ns/net")
        (root / f"{pid}/fd").mkdir()
    write(
        root / "10/cmdline", b"/venv/bin/python3\0/venv/bin/torchrun\0--master_port=29611\0x.py\0"
    )
    write(root / "10/environ", b"PATH=/bin\0")
    write(root / "11/cmdline", b"/venv/bin/python3\0-u\0x.py\0")
    write(root / "11/environ", b"PATH=/bin\0MASTER_PORT=29611\0RANK=0\0")
    L6 = "::ffff:127.0.0.1"
    tcp = TCP_HEADER + "".join(
        [
            tcp_line(0, ("127.0.0.1", 35293), ("0.0.0.0", 0), 0x0A, 501),  # rank's gloo
            tcp_line(1, ("127.0.0.1", 55555), ("127.0.0.1", 80), 0x06, 502),  # TIME_WAIT
        ]
    )
    tcp6 = TCP_HEADER + "".join(
        [
            tcp_line(0, ("::", 29611), ("::", 0), 0x0A, 401, v6=True),  # agent's store
            tcp_line(1, (L6, 29611), (L6, 47414), 0x01, 402, v6=True),  # accepted by the agent
            tcp_line(2, (L6, 47414), (L6, 29611), 0x01, 403, v6=True),  # the rank's client
            tcp_line(3, (L6, 29611), (L6, 47999), 0x01, 0, v6=True),  # queued, not accepted
        ]
    )
    for pid in (10, 11):  # each process sees its namespace's tables
        write(root / f"{pid}/net/tcp", tcp)
        write(root / f"{pid}/net/tcp6", tcp6)
    os.symlink("socket:[401]", root / "10/fd/3")
    os.symlink("socket:[402]", root / "10/fd/4")
    os.symlink("socket:[501]", root / "11/fd/3")
    os.symlink("socket:[403]", root / "11/fd/4")
    os.symlink("socket:[502]", root / "11/fd/5")
    return root


class CountingProcFS(ProcFS):
    def __init__(self, root: str) -> None:
        super().__init__(root, tcp_info=None)  # a fixture tree has no kernel to ask
        self.net_reads = 0
        self.plumbing_reads: list[int] = []  # command lines read, for plumbing

    def tcp_sockets(self, pid, ports=None, listening=False, families=("tcp", "tcp6"), info=True):
        self.net_reads += 1
        return super().tcp_sockets(pid, ports, listening, families, info)

    def argv(self, pid):
        self.plumbing_reads.append(pid)
        return super().argv(pid)


def test_sampler_gives_connections_plumbing_and_the_ephemeral_range(tmp_path):
    from agent.analysis.frontdoor import front_doors
    from tests.test_frontdoor import door, why

    proc = CountingProcFS(str(make_job(tmp_path)))
    snap = Sampler(proc, clock_ns=lambda: 6_000_000_000).snapshot([10, 11])
    agent, rank = snap.processes[10], snap.processes[11]
    assert snap.ephemeral_from == 40000
    assert proc.net_reads == 1  # one read of the tables per network namespace per tick
    L6 = "::ffff:127.0.0.1"
    assert agent.connections == (Connection(L6, 29611, L6, 47414, 402, 3, 0),)
    assert rank.connections == (Connection(L6, 47414, L6, 29611, 403, 3, 0),)
    assert agent.plumbing == Plumbing(
        launcher="torchrun", flag_ports=(("--master-port", 29611),), named_ports=(29611,)
    )
    assert rank.plumbing == Plumbing(master_port=29611)
    assert rank.plumbing.ports == {29611}
    fd = front_doors(list(snap.processes.values()), None, snap.ephemeral_from)
    assert why(fd, 29611) == "--master-port of torchrun pid 10"
    # 35293 is below this range's start: plumbing by the ephemeral rule only with the
    # kernel's default range; here, a rank's listener nobody connected to is a front door.
    assert door(fd, 35293).front
    assert not door(front_doors(list(snap.processes.values()), None, 32768), 35293).front


def test_plumbing_is_read_once_per_process_and_again_after_exec(tmp_path):
    root = make_job(tmp_path)
    proc = CountingProcFS(str(root))
    sampler = Sampler(proc, clock_ns=lambda: 6_000_000_000)
    sampler.snapshot([10, 11])
    sampler.snapshot([10, 11])
    assert sorted(proc.plumbing_reads) == [10, 11]
    # Rank 11 execs something else (its comm changes): read again.
    write(root / "11/stat", stat_line(11, "other", ppid=10))
    write(root / "11/environ", b"PATH=/bin\0")
    assert sampler.snapshot([10, 11]).processes[11].plumbing == Plumbing()
    # PID 10 is reused (another start time): read again.
    write(root / "10/stat", stat_line(10, "pt_elastic", ppid=1, start=9999))
    sampler.snapshot([10, 11])
    assert sorted(proc.plumbing_reads) == [10, 10, 11, 11]
    # A process that left is forgotten.
    sampler.snapshot([10])
    assert set(sampler._plumbing) == {10}


def test_no_range_file_gives_the_kernels_default(tmp_path):
    root = make_job(tmp_path)
    (root / "sys/net/ipv4/ip_local_port_range").write_text("garbage\n")
    assert ProcFS(str(root)).ephemeral_from() == 32768
    (root / "sys/net/ipv4/ip_local_port_range").unlink()
    assert ProcFS(str(root)).ephemeral_from() == 32768
    # Unreadable environment and command line: no hints, not an error.
    (root / "11/environ").unlink()
    (root / "11/cmdline").unlink()
    proc = ProcFS(str(root))
    assert proc.environ(11) is None and proc.argv(11) is None
    assert parse_plumbing(proc.environ(11), proc.argv(11) or []) == Plumbing()


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=80), st.binary(max_size=80), st.binary(max_size=30))
def test_procfs_hints_never_raise_on_any_bytes(tmp_path_factory, cmdline, environ, port_range):
    root = tmp_path_factory.mktemp("proc")
    write(root / "7/cmdline", cmdline)
    write(root / "7/environ", environ)
    write(root / "sys/net/ipv4/ip_local_port_range", port_range)
    proc = ProcFS(str(root))
    assert all(
        0 < port < 1 << 16 for port in parse_plumbing(proc.environ(7), proc.argv(7) or []).ports
    )
    assert 0 < proc.ephemeral_from() < 1 << 16
    assert all(isinstance(a, str) for a in proc.argv(7) or [])
