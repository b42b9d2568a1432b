"""Readers of /proc, rooted anywhere so tests can point them at a fixture tree.

The parse_* functions are pure (text in, values out), total and fuzzed: text that is not the
format gives None (or skips the line), never an exception. The ProcFS methods add the I/O
and turn "the process went away mid-read" into None too. A comm is whatever bytes a process
chose (prctl PR_SET_NAME), so nothing here may trust a file to be UTF-8 or well formed.
"""

from __future__ import annotations

import bisect
import errno
import fcntl
import os
import re
import socket
import struct
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass

from ..model import (
    DEFAULT_EPHEMERAL_FROM,
    NAME_SHOWN_MAX,
    PID_MAX_LIMIT,
    SyscallLine,
    TcpInfo,
    WrittenFd,
    printable,
)
from .tcpinfo import (
    ALL_STATES,
    TCP_LISTEN,
    SocketsLookup,
    SocketsRead,
    TcpInfoRead,
    TcpSocket,
    lookup_sockets,
    read_sockets,
    read_tcp_info,
)
from .unixdiag import UnixPathsRead, read_unix_paths

U64 = 1 << 64

# What one read of a file a target controls may cost (docs/security.md, "Every read
# bounded"). A process chooses how long its maps, its command line and environment, its
# epoll sets and timers and its namespace's socket tables are; these caps keep each read's
# time and memory bounded whatever it chooses.
READ_MAX_BYTES = 1 << 20  # any whole-file read (cmdline, environ, an epoll set's fdinfo)
# /proc/PID/maps: past the default vm.max_map_count (65,530) lines of 256 bytes each.
MAPS_MAX_BYTES = 16 << 20
MAPS_MAX_LINES = 1 << 17  # mappings: twice the default vm.max_map_count
# One line of maps: PATH_MAX and the fixed fields. The kernel prints a path longer than
# PATH_MAX whole (nested directories); such a line is kept with PATH_TOO_LONG as its path.
MAPS_LINE_MAX = 4096 + 128
PATH_TOO_LONG = "[path too long]"
# A namespace's /proc/net/{tcp,tcp6,unix} where sock_diag cannot be asked: 100,000 sockets.
NET_TABLE_MAX_BYTES = 16 << 20
READ_CHUNK = 1 << 16  # bytes a streamed read asks for at a time
NET_LINE_MAX = 512  # a TCP line is 150 bytes, a unix one 50 and a path of at most 108
FDS_WALKED_MAX = 1 << 16  # fds of one process looked at per walk (RLIMIT_NOFILE may be 1M)
# PROCMAP_QUERY (Linux 6.11, include/uapi/linux/fs.h): the mapping that holds an address,
# asked of /proc/PID/maps by ioctl, with no text.
PROCMAP_QUERY = 0xC0686611  # _IOWR('f', 17, struct procmap_query), 104 bytes
PROCMAP_QUERY_ARG = struct.Struct("=9Q4I2Q")
PROCMAP_READ, PROCMAP_WRITE, PROCMAP_EXEC, PROCMAP_SHARED = 1, 2, 4, 8


def _uint(text: str, base: int = 10, limit: int = U64) -> int | None:
    """A non-negative integer below ``limit``, or None."""
    try:
        value = int(text, base)
    except ValueError:
        return None
    return value if 0 <= value < limit else None


@dataclass(frozen=True)
class ProcStat:
    pid: int
    comm: str
    state: str
    ppid: int
    start_ticks: int
    num_threads: int = 0  # of the process (a thread's own stat repeats its process's)
    cpu: int | None = None  # the CPU it last ran on (field 39, processor)
    # Major faults (field 12): waits for a page of a mapped file (or swap) to come from
    # storage; in /proc/PID/stat, summed over every thread of the process.
    major_faults: int | None = None


@dataclass(frozen=True)
class MemMap:
    start: int
    end: int
    perms: str
    offset: int
    dev: str
    inode: int
    path: str = ""  # the mapped file, or [stack], [heap], ... ; "" for anonymous memory


def parse_stat(text: str) -> ProcStat | None:
    """/proc/PID/stat; comm may hold spaces and parentheses, so split at the last ')'."""
    lp, rp = text.find("("), text.rfind(")")
    if lp < 0 or rp < lp:
        return None
    rest = text[rp + 1 :].split()
    if len(rest) < 20 or len(rest[0]) != 1:
        return None
    pid, ppid, start = _uint(text[:lp].strip(), limit=1 << 31), _uint(rest[1]), _uint(rest[19])
    if not pid or ppid is None or ppid >= 1 << 31 or start is None:
        return None
    comm = printable(text[lp + 1 : rp], limit=64)
    threads = _uint(rest[17], limit=1 << 31) or 0
    cpu = _uint(rest[36], limit=1 << 20) if len(rest) > 36 else None
    return ProcStat(pid, comm, rest[0], ppid, start, threads, cpu, _uint(rest[9]))


def parse_cgroup_path(text: str) -> str | None:
    """The process's cgroup v2 path from /proc/PID/cgroup (the ``0::`` line), or on a host
    with only cgroup v1, systemd's own hierarchy (``name=systemd``: the same paths)."""
    v1 = None
    # Lines end at "\n" only, which the kernel refuses in a cgroup's name; a user names the
    # cgroups it was delegated, and \r, \x1c or \u2028 in one must not start a line.
    for line in text.split("\n"):
        hid, _, rest = line.partition(":")
        controllers, sep, path = rest.partition(":")
        if not sep or not path.startswith("/"):
            continue
        if hid == "0" and controllers == "":
            return path
        if controllers == "name=systemd" and v1 is None:
            v1 = path
    return v1


def parse_real_uid(text: str) -> int | None:
    """The real uid (the first field of ``Uid:``) from /proc/PID/status: who started the
    process; a setuid image changes only the effective one."""
    # Split at "\n" only: the Name line above holds the comm, escaped by the kernel for
    # "\n" but not for \x1c or U+2028, where str.splitlines() would start a forged line.
    for line in text.split("\n"):
        if line.startswith("Uid:"):
            fields = line.split()
            return _uint(fields[1], limit=1 << 32) if len(fields) > 1 else None
    return None


def parse_syscall(text: str) -> SyscallLine | None:
    """/proc/PID/task/TID/syscall: 'running', '-1 sp pc', or 'nr a1..a6 sp pc' (hex args)."""
    parts = text.split()
    if not parts or parts[0] == "running":
        return None
    if parts[0] == "-1":
        if len(parts) < 3:
            return SyscallLine(-1, ())
        return SyscallLine(-1, (), _uint(parts[-2], 16), _uint(parts[-1], 16))
    nr = _uint(parts[0], limit=1 << 16)
    if nr is None or len(parts) != 9:  # nr, six arguments, sp, pc
        return None
    args = tuple(_uint(a, 16) for a in parts[1:9])
    if any(a is None for a in args):
        return None
    return SyscallLine(nr, tuple(a for a in args[:6] if a is not None), args[6], args[7])


def parse_exec_start_ms(text: str) -> float | None:
    for line in text.splitlines():
        if line.startswith("se.exec_start"):
            try:
                value = float(line.split(":", 1)[1])
            except (IndexError, ValueError):
                return None
            return value if 0 <= value < float(U64) else None  # also NaN
    return None


def parse_schedstat(text: str) -> int | None:
    parts = text.split()
    return _uint(parts[0]) if parts else None


def parse_io_wchar(text: str) -> int | None:
    return parse_io_field(text, "wchar")


def parse_io_field(text: str, name: str) -> int | None:
    """One counter of /proc/PID/io (``wchar``, ``read_bytes``), None where absent."""
    for line in text.splitlines():
        if line.startswith(f"{name}:"):
            parts = line.split()
            return _uint(parts[1]) if len(parts) == 2 else None
    return None


def _addr(hexaddr: str, family: str) -> str | None:
    try:
        raw = bytes.fromhex(hexaddr)
    except ValueError:
        return None
    if len(raw) != (4 if family == "tcp" else 16):
        return None
    if family == "tcp":
        return socket.inet_ntop(socket.AF_INET, struct.pack("<I", struct.unpack(">I", raw)[0]))
    # IPv6: four 32-bit words, each in host (little-endian) order
    words = struct.unpack(">4I", raw)
    return socket.inet_ntop(socket.AF_INET6, struct.pack("<4I", *words))


def parse_net_tcp(text: str, family: str) -> list[TcpSocket]:
    """/proc/PID/net/tcp{,6}. For a LISTEN socket rx_queue is the accept queue's length."""
    return list(parse_net_tcp_lines(text.splitlines(), family))


def parse_net_tcp_lines(lines: Iterable[str], family: str) -> Iterator[TcpSocket]:
    """parse_net_tcp, one line at a time (the header, or any line not of the format, is
    skipped)."""
    for line in lines:
        f = line.split()
        if len(f) < 10:
            continue
        host, _, port_hex = f[1].rpartition(":")
        rhost, _, rport_hex = f[2].rpartition(":")
        tx_hex, _, rx_hex = f[4].partition(":")
        addr, raddr = _addr(host, family), _addr(rhost, family)
        port, rport = _uint(port_hex, 16, 1 << 16), _uint(rport_hex, 16, 1 << 16)
        st = _uint(f[3], 16, 1 << 8)
        tx, rx, inode = _uint(tx_hex, 16, 1 << 32), _uint(rx_hex, 16, 1 << 32), _uint(f[9])
        if addr is None or port is None or st is None or tx is None or rx is None:
            continue  # not a line of this format: skip it, keep the rest
        if inode is None or raddr is None or rport is None:
            continue
        yield TcpSocket(family, addr, port, st, tx, rx, inode, raddr, rport)


# A record of /proc/net/unix (net/unix/af_unix.c, unix_seq_show): the socket's address (%pK,
# zeros for most readers), refcount, protocol, flags, type, state, inode, and its bound name
# if it has one, printed raw: the last field, and the only one a process chooses.
_UNIX_RECORD = re.compile(
    r"[0-9a-f]{8,16}: [0-9A-F]{8} [0-9A-F]{8} [0-9A-F]{8} [0-9A-F]{4} [0-9A-F]{2} +([0-9]{1,10})"
    r"(?: (.{1,108}))?"
)


def parse_net_unix(lines: Iterable[str], inodes: Collection[int] | None = None) -> dict[int, str]:
    """/proc/PID/net/unix: inode -> bound path of the unix sockets that have one (an
    abstract name without its leading @), those of ``inodes`` only if given; the side that
    connected has none. The kernel prints a name's bytes raw, newlines included, so a name
    can hold a line that reads as a record of another socket: an inode listed twice (the
    socket's own record and a forged one) is believed in neither, and a line that is not a
    whole record is skipped."""
    out: dict[int, str] = {}
    seen: set[int] = set()
    twice: set[int] = set()
    for line in lines:
        m = _UNIX_RECORD.fullmatch(line.rstrip("\n"))
        if m is None:
            continue
        inode = int(m.group(1))
        if inode in seen:
            twice.add(inode)
        seen.add(inode)
        if m.group(2) and (inodes is None or inode in inodes):
            out[inode] = printable(m.group(2).removeprefix("@"), NAME_SHOWN_MAX)
    for inode in twice:
        out.pop(inode, None)
    return out


def parse_epoll_fds(fdinfo: str) -> list[int]:
    """The fds in an epoll set, from its /proc/PID/fdinfo/FD (one ``tfd:`` line each)."""
    out = []
    for line in fdinfo.splitlines():
        if line.startswith("tfd:"):
            parts = line.split()
            if len(parts) > 1 and parts[1].isdigit():
                out.append(int(parts[1]))
    return out


EPOLLIN = 0x001


def parse_epoll_inputs(fdinfo: str) -> set[int]:
    """Inodes of the files an epoll set waits on for input (EPOLLIN in its events now: a
    one-shot entry that fired has it no longer), from its /proc/PID/fdinfo/FD: one line
    ``tfd: FD events: HEX data: HEX pos:N ino:HEX sdev:HEX`` each. A line it cannot read is
    left out: what it leaves out is read another way, never assumed."""
    out = set()
    for line in fdinfo.splitlines():
        if not line.startswith("tfd:"):
            continue
        parts = line.split()
        fields = dict(p.split(":", 1) for p in parts if ":" in p and not p.endswith(":"))
        at = parts.index("events:") + 1 if "events:" in parts else len(parts)
        events = _uint(parts[at], 16, 1 << 32) if at < len(parts) else None
        inode = _uint(fields.get("ino", ""), 16)
        if events is not None and inode is not None and events & EPOLLIN:
            out.add(inode)
    return out


def parse_port_range(text: str) -> tuple[int, int] | None:
    """/proc/sys/net/ipv4/ip_local_port_range: 'FIRST\tLAST'."""
    parts = text.split()
    if len(parts) != 2:
        return None
    first, last = _uint(parts[0], limit=1 << 16), _uint(parts[1], limit=1 << 16)
    if not first or last is None or last < first:
        return None
    return first, last


def parse_maps_line(line: str) -> MemMap | None:
    """One line of /proc/PID/maps; None where it is not one."""
    f = line.split(maxsplit=5)
    if len(f) < 5:
        return None
    start_hex, _, end_hex = f[0].partition("-")
    start, end, offset, inode = (
        _uint(start_hex, 16),
        _uint(end_hex, 16),
        _uint(f[2], 16),
        _uint(f[4]),
    )
    if start is None or end is None or end < start or offset is None or inode is None:
        return None
    return MemMap(start, end, f[1], offset, f[3], inode, f[5].strip() if len(f) > 5 else "")


@dataclass(frozen=True)
class MapsRead:
    """What one read of /proc/PID/maps kept, and why it stopped short if it did."""

    maps: list[MemMap]
    cut: str | None = None  # a reason to show: the read stopped before the end of the file


@dataclass(frozen=True)
class MappingsAt:
    """The mappings that hold some addresses of a process: address -> its mapping (an
    address in none is absent), and why some could not be looked for if so."""

    found: dict[int, MemMap]
    cut: str | None = None


class BoundedLines:
    """The lines of a file a target controls, read a chunk at a time and never whole: at
    most ``max_bytes`` in all (the read's time), a line kept to its first ``line_max``
    bytes (the rest skipped: the read's memory). Iterates (line without its newline,
    whether it was longer); ``cut`` says afterwards whether the read stopped at
    ``max_bytes`` before the file's end (the unfinished line there is dropped). A file that
    cannot be opened, or fails mid-read (the process exited), gives what was read."""

    def __init__(self, path: str, max_bytes: int, line_max: int) -> None:
        self.path, self.max_bytes, self.line_max = path, max_bytes, line_max
        self.cut = False

    def __iter__(self) -> Iterator[tuple[str, bool]]:
        head, long = b"", False  # the line read so far (at most line_max), and if longer
        try:
            with open(self.path, "rb", buffering=0) as f:
                total = 0
                while total < self.max_bytes:
                    chunk = f.read(min(READ_CHUNK, self.max_bytes - total))
                    if not chunk:
                        break
                    total += len(chunk)
                    pieces = chunk.split(b"\n")
                    for piece in pieces[:-1]:
                        if not long:
                            head += piece
                        # Not UTF-8 strict: a path may hold any bytes.
                        yield (
                            head[: self.line_max].decode(errors="replace"),
                            long or len(head) > self.line_max,
                        )
                        head, long = b"", False
                    if not long:
                        head += pieces[-1]
                        if len(head) > self.line_max:
                            head, long = head[: self.line_max + 1], True
                if total >= self.max_bytes and f.read(1):
                    self.cut = True
                    return
        except OSError:
            return  # ESRCH and the like: the process is exiting
        if head:  # a last line without its newline
            yield head[: self.line_max].decode(errors="replace"), long or len(head) > self.line_max


def maps_cut_reason(lines: int | None = None) -> str:
    """Why a read of the maps stopped short (at ``lines`` mappings, else at its bytes), in
    words a log line can show."""
    if lines is not None:
        size = f"{lines:,} mappings"
    elif MAPS_MAX_BYTES >= 1 << 20:
        size = f"{MAPS_MAX_BYTES >> 20} MiB"
    else:
        size = f"{MAPS_MAX_BYTES} bytes"
    return f"its memory map (/proc/PID/maps) is larger than {size}: read to there"


class ProcFS:
    """Reads one /proc tree. Every method returns None (or empty) when the entry vanished.

    ``tcp_info`` reads the kernel's tcp_info of a network namespace (agent.sources.tcpinfo);
    None where there is no kernel to ask (a fixture tree) or a test stands in for it."""

    def __init__(
        self,
        root: str = "/proc",
        tcp_info: TcpInfoRead | None = read_tcp_info,
        sockets: SocketsRead | None = None,
        unix_paths: UnixPathsRead | None = None,
    ) -> None:
        """``tcp_info`` reads the kernel's sock_diag (None: not at all). ``sockets`` lists a
        namespace's sockets; by default, the kernel's sock_diag where ``root`` is the real
        /proc, and none elsewhere (a fixture tree lists its own in net/tcp). ``unix_paths``
        looks unix sockets up by inode, the same way (agent.sources.unixdiag)."""
        self.root = root
        self._tcp_info = tcp_info
        if sockets is None and root == "/proc":
            sockets = read_sockets
        self._sockets = sockets
        self._lookup: SocketsLookup | None = lookup_sockets if sockets is read_sockets else None
        if unix_paths is None and root == "/proc":
            unix_paths = read_unix_paths
        self._unix_paths = unix_paths
        self._procmap_query = True  # until the kernel says it has no PROCMAP_QUERY (ENOTTY)
        self.maps_cut = 0  # reads of maps stopped at MAPS_MAX_BYTES (tests, the bench)
        self.fd_walks_cut = 0  # fd walks stopped at FDS_WALKED_MAX

    def _path(self, *parts: object) -> str:
        return os.path.join(self.root, *map(str, parts))

    def _read(self, *parts: object) -> str | None:
        """The file's text, its whole lines within its first READ_MAX_BYTES; None where it
        cannot be read."""
        raw = self._read_bytes(*parts, sep=b"\n")
        # Not UTF-8 strict: a comm or a path may hold any bytes.
        return raw.decode(errors="replace") if raw is not None else None

    def pids(self) -> list[int]:
        return [int(n) for n in os.listdir(self.root) if n.isascii() and n.isdigit()]

    def pid_inodes(self) -> dict[int, int]:
        """PID -> the inode of its /proc entry, from one directory read: a process keeps its
        entry's inode for its life, and a new process on a reused PID gets another."""
        with os.scandir(self.root) as entries:
            return {
                int(e.name): e.inode() for e in entries if e.name.isascii() and e.name.isdigit()
            }

    def stat(self, pid: int) -> ProcStat | None:
        text = self._read(pid, "stat")
        return parse_stat(text) if text else None

    def main_stat(self, pid: int) -> ProcStat | None:
        """The process's stat as its main thread's (``task/PID/stat``) gives it: the same
        state, comm, parent, start and thread count, without the process-wide sums the
        kernel walks every thread for (page faults, CPU time: 11.5 against 7.2 us at 200
        threads here). ``PID/stat`` where there is no task directory (a fixture tree)."""
        text = self._read(pid, "task", pid, "stat") or self._read(pid, "stat")
        return parse_stat(text) if text else None

    def cmdline(self, pid: int) -> str | None:
        """The command line, arguments joined by spaces (the NULs that separate them)."""
        raw = self._read_bytes(pid, "cmdline")
        return raw.rstrip(b"\0").replace(b"\0", b" ").decode(errors="replace") if raw else None

    def argv(self, pid: int) -> list[str] | None:
        """The command line's arguments, as the process was exec'd (or rewrote them)."""
        raw = self._read_bytes(pid, "cmdline")
        if not raw:
            return None
        return [a.decode(errors="replace") for a in raw.rstrip(b"\0").split(b"\0")]

    def environ(self, pid: int) -> bytes | None:
        return self._read_bytes(pid, "environ")

    def cgroup(self, pid: int) -> str | None:
        """The process's cgroup path (see parse_cgroup_path), as this agent's cgroup
        namespace shows it."""
        text = self._read(pid, "cgroup")
        return parse_cgroup_path(text) if text else None

    def real_uid(self, pid: int) -> int | None:
        text = self._read(pid, "status")
        return parse_real_uid(text) if text else None

    def ephemeral_from(self) -> int:
        """The first port of net.ipv4.ip_local_port_range (the kernel's default where unread)."""
        text = self._read("sys", "net", "ipv4", "ip_local_port_range")
        got = parse_port_range(text) if text else None
        return got[0] if got else DEFAULT_EPHEMERAL_FROM

    def _read_bytes(
        self, *parts: object, limit: int = READ_MAX_BYTES, sep: bytes = b"\0"
    ) -> bytes | None:
        """The file's first ``limit`` bytes at most (a command line, an environment, an epoll
        set's fdinfo are as long as the process makes them), up to the last ``sep`` in them
        where the file is longer: a record cut in two would read as another (a port of 80
        for 8000); None where it cannot be read (gone: ESRCH and the like)."""
        try:
            with open(os.path.join(self.root, *map(str, parts)), "rb") as f:
                data = f.read(limit + 1)
        except OSError:
            return None
        if len(data) <= limit:
            return data
        return data[: data.rfind(sep, 0, limit) + 1]

    def tids(self, pid: int) -> list[int]:
        try:
            names = os.listdir(os.path.join(self.root, str(pid), "task"))
            return sorted(int(n) for n in names if n.isascii() and n.isdigit())
        except OSError:
            return []

    def thread_stat(self, pid: int, tid: int) -> ProcStat | None:
        text = self._read(pid, "task", tid, "stat")
        return parse_stat(text) if text else None

    def thread_cpu_ns(self, pid: int, tid: int) -> int | None:
        text = self._read(pid, "task", tid, "schedstat")
        return parse_schedstat(text) if text else None

    def thread_exec_start_ms(self, pid: int, tid: int) -> float | None:
        text = self._read(pid, "task", tid, "sched")
        return parse_exec_start_ms(text) if text else None

    def own_exec_start_ms(self) -> float | None:
        """se.exec_start of the calling thread (running now: the scheduler clock's 'now')."""
        text = self._read("thread-self", "sched")
        return parse_exec_start_ms(text) if text else None

    def thread_syscall(self, pid: int, tid: int) -> SyscallLine | None:
        text = self._read(pid, "task", tid, "syscall")
        return parse_syscall(text) if text else None

    def thread_exists(self, pid: int, tid: int) -> bool:
        return os.path.exists(os.path.join(self.root, str(pid), "task", str(tid)))

    def pid_max(self) -> int:
        """kernel.pid_max: PIDs are below it (the ceiling where it cannot be read)."""
        text = self._read("sys", "kernel", "pid_max")
        value = _uint(text.strip(), limit=PID_MAX_LIMIT + 1) if text else None
        return value or PID_MAX_LIMIT

    def fdinfo(self, pid: int | str, fd: int) -> dict[str, str]:
        """/proc/PID/fdinfo/FD as keys and values (a BPF program's run time and count)."""
        text = self._read(pid, "fdinfo", fd) or ""
        return dict(
            (k.strip(), v.strip())
            for k, _, v in (line.partition(":") for line in text.splitlines())
        )

    def tgid_of(self, tid: int) -> int | None:
        text = self._read(tid, "status")
        if text is None:
            return None
        for line in text.split("\n"):  # as parse_real_uid: a thread's name cannot add a line
            if line.startswith("Tgid:"):
                parts = line.split()
                return (_uint(parts[1], limit=1 << 31) or None) if len(parts) == 2 else None
        return None

    def io_wchar(self, pid: int) -> int | None:
        text = self._read(pid, "io")
        return parse_io_wchar(text) if text else None

    def io_counts(self, pid: int) -> tuple[int | None, int | None]:
        """(wchar, read_bytes) of /proc/PID/io from one read: what the process wrote, and
        what it read from block devices (O_DIRECT, page-cache misses, mapped-file page-ins
        that went to the disk); (None, None) where unreadable."""
        text = self._read(pid, "io")
        if not text:
            return None, None
        return parse_io_wchar(text), parse_io_field(text, "read_bytes")

    def _fd_names(self, pid: int) -> list[str]:
        """The process's fds, the first FDS_WALKED_MAX of them (a process may hold a
        million); a walk stopped there is counted in ``fd_walks_cut``."""
        names: list[str] = []
        try:
            with os.scandir(os.path.join(self.root, str(pid), "fd")) as entries:
                for e in entries:
                    if len(names) >= FDS_WALKED_MAX:
                        self.fd_walks_cut += 1
                        break
                    names.append(e.name)
        except OSError:
            pass
        return names

    def _fd_inodes(self, pid: int, kind: str) -> Iterator[tuple[str, int]]:
        """(fd, inode) of each fd of the process whose link reads 'KIND:[inode]'."""
        fd_dir = os.path.join(self.root, str(pid), "fd")
        names = self._fd_names(pid)
        prefix = f"{kind}:["
        for name in names:
            try:
                link = os.readlink(os.path.join(fd_dir, name))
            except OSError:
                continue
            inode = _uint(link[len(prefix) : -1]) if link.startswith(prefix) else None
            if inode is not None:
                yield name, inode

    def socket_inodes(self, pid: int) -> set[int]:
        return {inode for _, inode in self._fd_inodes(pid, "socket")}

    def socket_fds(self, pid: int) -> dict[int, int]:
        """Inode -> fd of each socket the process holds (one fd for a socket held twice)."""
        return {inode: int(fd) for fd, inode in self._fd_inodes(pid, "socket")}

    def socket_protocol(self, pid: int, fd: int) -> str | None:
        """The protocol of the process's socket ``fd``, as the kernel names it ("TCP",
        "TCPv6", "UNIX-STREAM", "UDP", ...: the inode's system.sockprotoname); None where
        it cannot be read (the fd closed, or a tree that is not the real /proc)."""
        try:
            raw = os.getxattr(self._path(pid, "fd", fd), "system.sockprotoname")
        except OSError:
            return None
        return raw.rstrip(b"\0").decode("ascii", "replace")

    def pipes_read(self, pid: int) -> set[int]:
        """Inodes of the pipes the process holds open for reading (an fd and its fdinfo
        flags per pipe): whose writes stay in the service when a process of it reads them."""
        out: set[int] = set()
        for fd, inode in self._fd_inodes(pid, "pipe"):
            info = self._read(pid, "fdinfo", fd) or ""
            flags = next((ln.split()[1] for ln in info.splitlines() if ln.startswith("flags:")), "")
            mode = _uint(flags, 8)
            if mode is not None and mode & 3 in (os.O_RDONLY, os.O_RDWR):
                out.add(inode)
        return out

    def written_fds(self, pid: int) -> list[WrittenFd]:
        """The fds the process holds open for writing that lead to a file, a pipe or a
        terminal, with when each was last modified: a file's or a terminal's mtime moves on
        every write, and a pipe's too (pipe_write updates it). Sockets, eventfds and the
        like are left out: connections are dated by tcp_info."""
        return self.modified(pid, self.writable_fds(pid))

    def writable_fds(self, pid: int) -> list[tuple[int, str]]:
        """(fd, its target) of the fds written_fds reports: the fd walk, which only the
        process itself can change."""
        fd_dir = os.path.join(self.root, str(pid), "fd")
        out = []
        for name in self._fd_names(pid):
            try:
                link = os.readlink(os.path.join(fd_dir, name))
            except OSError:
                continue
            if not (link.startswith("/") or link.startswith("pipe:[")):
                continue
            info = self._read(pid, "fdinfo", name) or ""
            flags = next((ln.split()[1] for ln in info.splitlines() if ln.startswith("flags:")), "")
            mode = _uint(flags, 8)
            if mode is None or mode & 3 not in (os.O_WRONLY, os.O_RDWR):
                continue
            out.append((int(name), link))
        return out

    def modified(self, pid: int, fds: Iterable[tuple[int, str]]) -> list[WrittenFd]:
        """``fds`` (from writable_fds) with their files' mtimes now, those still open; others
        (another writer of the same file or pipe) move them."""
        out = []
        for fd, link in fds:
            try:
                # follows the link to the open file itself
                mtime = os.stat(os.path.join(self.root, str(pid), "fd", str(fd))).st_mtime
            except OSError:
                continue
            out.append(WrittenFd(fd, printable(link, NAME_SHOWN_MAX), mtime))
        return out

    def has_posix_timers(self, pid: int) -> bool:
        """Whether the process holds a POSIX timer (/proc/PID/timers lists one per timer):
        one could send it a signal and end a wait that nothing else can. Only the start of
        the file is read: a process may hold many thousands."""
        return bool((self._read_bytes(pid, "timers", limit=64, sep=b"\n") or b"").strip())

    def exe(self, pid: int) -> str | None:
        """The path of the process's executable (its /proc/PID/exe link)."""
        try:
            return os.readlink(os.path.join(self.root, str(pid), "exe"))
        except OSError:
            return None

    def fd_target(self, pid: int, fd: int) -> str | None:
        """What an fd points to: a path, 'socket:[inode]', 'pipe:[inode]', ..."""
        try:
            return printable(
                os.readlink(os.path.join(self.root, str(pid), "fd", str(fd))), NAME_SHOWN_MAX
            )
        except OSError:
            return None

    def net_namespace(self, pid: int | str) -> str | None:
        try:
            return os.readlink(os.path.join(self.root, str(pid), "ns", "net"))
        except OSError:
            return None

    def tcp_info(self, pid: int, ports: Iterable[tuple[str, int]] | None) -> dict[int, TcpInfo]:
        """Socket inode -> the kernel's tcp_info, for the established sockets on ``ports``
        ((family, local port); None: all) of the process's network namespace: read by the
        ``tcp_info`` reader, in that namespace where it is not ours. Empty when it cannot be
        read, or without a reader."""
        if self._tcp_info is None:
            return {}
        theirs = self.net_namespace(pid)
        if theirs is None:
            return {}
        own = theirs == self.net_namespace("self")
        return self._tcp_info(
            ports, None if own else os.path.join(self.root, str(pid), "ns", "net")
        )

    def unix_socket_paths(self, pid: int, inodes: Collection[int]) -> dict[int, str]:
        """Inode -> bound path of those of the unix sockets ``inodes`` of the process's
        network namespace that have one. Looked up by inode with sock_diag (no text: a name
        cannot pass for another socket's record) where this reads the real /proc, else,
        or where that fails, from /proc/PID/net/unix, streamed and capped (parse_net_unix
        says how a forged line is told)."""
        if not inodes:
            return {}
        if self._unix_paths is not None:
            theirs = self.net_namespace(pid)
            if theirs is None:
                return {}
            netns = None if theirs == self.net_namespace("self") else self._path(pid, "ns", "net")
            got = self._unix_paths(inodes, netns)
            if got is not None:
                return {i: printable(p.removeprefix("@"), NAME_SHOWN_MAX) for i, p in got.items()}
        lines = BoundedLines(self._path(pid, "net", "unix"), NET_TABLE_MAX_BYTES, NET_LINE_MAX)
        return parse_net_unix((line for line, long in lines if not long), set(inodes))

    def epoll_inputs(self, pid: int, epfd: int) -> set[int]:
        """Inodes of the files the process's epoll set ``epfd`` waits on for input."""
        return parse_epoll_inputs(self._read(pid, "fdinfo", epfd) or "")

    def epoll_fds(self, pid: int, epfd: int) -> list[int]:
        """The fds in the process's epoll set ``epfd``."""
        return parse_epoll_fds(self._read(pid, "fdinfo", epfd) or "")

    def tcp_sockets(
        self,
        pid: int,
        ports: Iterable[int] | None = None,
        listening: bool = False,
        families: Collection[str] = ("tcp", "tcp6"),
        info: bool = True,
    ) -> list[TcpSocket]:
        """TCP sockets of the process's network namespace (containers have their own), those
        on the local ``ports`` only if given, listeners only if ``listening``, of ``families``
        only where ports are given (each family's dump walks the kernel's whole table):
        from the kernel's sock_diag (the kernel filters, no text to parse) where this reads
        the real /proc, else, or where that fails, from /proc/PID/net/tcp{,6}. Those on
        ``ports`` carry their tcp_info from sock_diag unless ``info`` is False."""
        wanted = None if ports is None else set(ports)
        if self._sockets is not None:
            theirs = self.net_namespace(pid)
            if theirs is None:
                return []
            asked = None if wanted is None else [(f, p) for f in families for p in wanted]
            netns = None if theirs == self.net_namespace("self") else self._path(pid, "ns", "net")
            states = 1 << TCP_LISTEN if listening else ALL_STATES
            got = self._sockets(asked, netns, states, info)
            if got is not None:
                return got
        out: list[TcpSocket] = []
        for family in ("tcp", "tcp6"):
            # Streamed, capped, and only the sockets asked for kept: 100,000 of them are the
            # process's namespace's to open.
            path = self._path(pid, "net", family)
            lines = BoundedLines(path, NET_TABLE_MAX_BYTES, NET_LINE_MAX)
            for s in parse_net_tcp_lines((line for line, long in lines if not long), family):
                if (wanted is None or s.port in wanted) and (
                    not listening or s.state == TCP_LISTEN
                ):
                    out.append(s)
        return out

    def tcp_lookup(
        self, pid: int, sockets: Sequence[TcpSocket], info: bool = True
    ) -> list[TcpSocket] | None:
        """``sockets`` of the process's network namespace as they are now (those gone left
        out), each looked up by its 4-tuple, with its tcp_info unless ``info`` is False; None
        where that cannot be done (a tree that is not the real /proc, netlink refused): read
        the table instead."""
        if self._lookup is None:
            return None
        theirs = self.net_namespace(pid)
        if theirs is None:
            return None
        netns = None if theirs == self.net_namespace("self") else self._path(pid, "ns", "net")
        return self._lookup(sockets, netns, info)

    def maps(self, pid: int | str) -> list[MemMap]:
        """The process's mappings, in address order: ``maps_read``'s, cut at
        MAPS_MAX_BYTES (counted in ``maps_cut``)."""
        return self.maps_read(pid).maps

    def maps_read(self, pid: int | str, holding: Sequence[int] | None = None) -> MapsRead:
        """/proc/PID/maps streamed, never whole: at most MAPS_MAX_BYTES and MAPS_MAX_LINES
        read (a target that maps one file 62,000 times under a 4,000-character path makes
        it 250 MB), a line of at most MAPS_LINE_MAX kept (a longer one's path is
        PATH_TOO_LONG), only the mappings that hold one of ``holding`` (sorted addresses)
        if given, and a path held once however many mappings name it."""
        lines = BoundedLines(self._path(pid, "maps"), MAPS_MAX_BYTES, MAPS_LINE_MAX)
        paths: dict[str, str] = {}
        out: list[MemMap] = []
        for n, (line, long) in enumerate(lines):
            if n >= MAPS_MAX_LINES:
                self.maps_cut += 1
                return MapsRead(out, maps_cut_reason(MAPS_MAX_LINES))
            if holding is not None and not _holds_one(line, holding):
                continue  # told from its first field alone: most lines, most of the time
            m = parse_maps_line(line)
            if m is None:
                continue
            path = PATH_TOO_LONG if long else m.path
            known = paths.setdefault(path, path)
            if known is not m.path:
                m = MemMap(m.start, m.end, m.perms, m.offset, m.dev, m.inode, known)
            out.append(m)
        if lines.cut:
            self.maps_cut += 1
        return MapsRead(out, maps_cut_reason() if lines.cut else None)

    def mappings_at(self, pid: int, addrs: Collection[int]) -> MappingsAt:
        """The mapping that holds each of ``addrs`` (those in none left out), without the
        maps' text where the kernel can be asked (PROCMAP_QUERY, Linux 6.11: one ioctl per
        mapping, whatever the maps hold; their paths are not asked for, and are ""), else
        from ``maps_read`` keeping only those mappings (then ``cut`` says if it stopped
        short: an address past the cut is not found)."""
        if not addrs:
            return MappingsAt({})
        if self._procmap_query:
            got = self._query_mappings(pid, addrs)
            if got is not None:
                return got
        wanted = sorted(addrs)
        read = self.maps_read(pid, wanted)
        starts = [m.start for m in read.maps]
        found = {}
        for a in wanted:
            i = bisect.bisect_right(starts, a) - 1
            if i >= 0 and a < read.maps[i].end:
                found[a] = read.maps[i]
        return MappingsAt(found, read.cut)

    def _query_mappings(self, pid: int, addrs: Collection[int]) -> MappingsAt | None:
        """``mappings_at`` by PROCMAP_QUERY; None where the kernel (or a fixture tree's
        plain file) does not know the ioctl."""
        try:
            fd = os.open(self._path(pid, "maps"), os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return MappingsAt({})
        found: dict[int, MemMap] = {}
        last: MemMap | None = None
        try:
            for a in sorted(addrs):
                if last is not None and last.start <= a < last.end:
                    found[a] = last  # many waits in one mapping: asked once
                    continue
                arg = bytearray(PROCMAP_QUERY_ARG.pack(PROCMAP_QUERY_ARG.size, 0, a, *[0] * 12))
                try:
                    fcntl.ioctl(fd, PROCMAP_QUERY, arg, True)
                except OSError as e:
                    if e.errno == errno.ENOTTY:
                        self._procmap_query = False
                        return None
                    if e.errno == errno.ENOENT:
                        continue  # nothing mapped there
                    return MappingsAt(found)  # ESRCH: gone
                except OverflowError:
                    continue  # not an address
                last = _queried_mapping(arg)
                found[a] = last
        finally:
            os.close(fd)
        return MappingsAt(found)

    def open_memory(self, pid: int) -> ProcessMemory | None:
        try:
            return ProcessMemory(os.open(os.path.join(self.root, str(pid), "mem"), os.O_RDONLY))
        except OSError:
            return None


def _holds_one(line: str, addrs: Sequence[int]) -> bool:
    """Whether the maps line's range (its first field) holds one of ``addrs`` (sorted)."""
    start_hex, _, rest = line.partition("-")
    start, end = _uint(start_hex, 16), _uint(rest.partition(" ")[0], 16)
    if start is None or end is None:
        return False
    i = bisect.bisect_left(addrs, start)
    return i < len(addrs) and addrs[i] < end


def _queried_mapping(arg: bytearray) -> MemMap:
    """The mapping a PROCMAP_QUERY answered, as its maps line reads (without its path)."""
    _, _, _, start, end, flags, _, offset, inode, major, minor, _, _, _, _ = (
        PROCMAP_QUERY_ARG.unpack(arg)
    )
    perms = "".join(
        c if flags & bit else "-"
        for c, bit in (("r", PROCMAP_READ), ("w", PROCMAP_WRITE), ("x", PROCMAP_EXEC))
    ) + ("s" if flags & PROCMAP_SHARED else "p")
    return MemMap(start, end, perms, offset, f"{major:02x}:{minor:02x}", inode)


class ProcessMemory:
    """Reads small words of a target's memory. Read-only: we never write to a target."""

    def __init__(self, fd: int) -> None:
        self._fd = fd

    def ints(self, addr: int, count: int) -> tuple[int, ...] | None:
        """``count`` 32-bit ints at ``addr``; None if unmapped or unreadable."""
        try:
            data = os.pread(self._fd, 4 * count, addr)
        except (OSError, OverflowError):
            return None
        if len(data) < 4 * count:
            return None
        return struct.unpack(f"<{count}I", data)

    def read(self, addr: int, size: int) -> bytes | None:
        """``size`` bytes at ``addr`` (fewer at the end of a mapping); None if unreadable."""
        try:
            return os.pread(self._fd, size, addr)
        except (OSError, OverflowError):
            return None

    def close(self) -> None:
        os.close(self._fd)

    def __enter__(self) -> ProcessMemory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
