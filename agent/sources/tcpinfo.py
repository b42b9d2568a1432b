"""The kernel's tcp_info of established TCP sockets, over inet_diag netlink.

/proc/PID/net/tcp says which connections a process holds and what sits in their queues, not
when data last went each way; tcp_info does (``tcpi_last_data_recv``/``_sent``, bytes
received and acked), which tells a request not yet answered from an idle keep-alive
connection (requests.waiting_for_answer). The kernel filters (ESTABLISHED, by local port, as
ss(8) builds it), and this reader decodes only the inode and four fields at their fixed uapi
offsets: a front-end's thousands of connections are read every tick. Another network
namespace is read through ``NETNS``. Every failure gives an empty answer, never an exception:
the verdict then does without this evidence.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import logging
import os
import queue
import socket
import struct
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import NamedTuple, TypeVar

from ..model import TcpInfo

log = logging.getLogger(__name__)

# The kernel's TCP states (include/net/tcp_states.h), as both inet_diag and /proc/net/tcp
# report them.
TCP_ESTABLISHED = 0x01
TCP_LISTEN = 0x0A
INET_DIAG_INFO = 2  # include/uapi/linux/inet_diag.h: the tcp_info extension
CLONE_NEWNET = 0x40000000
FAMILIES = {"tcp": socket.AF_INET, "tcp6": socket.AF_INET6}
FAMILY_NAMES: dict[int, str] = {int(af): name for name, af in FAMILIES.items()}
ALL_STATES = (1 << 12) - 2  # TCP_ESTABLISHED (1) .. TCP_CLOSING (11): a bit per state
# Beyond this many ports of one family the filter (8 bytes and one test per port, run by the
# kernel on every socket of the namespace) is dropped for one unfiltered dump.
MAX_FILTERED_PORTS = 64

# The netlink protocol of sock_diag (include/uapi/linux/{netlink,sock_diag,inet_diag}.h).
NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST = 0x01
NLM_F_DUMP = 0x300
NLMSG_ERROR = 0x2
NLMSG_DONE = 0x3
NLMSG_HDRLEN = 16  # struct nlmsghdr
NLA_HDRLEN = 4  # struct nlattr
NLA_TYPE_MASK = 0x3FFF  # the type bits; the top two are flags
SOCKID_LEN = 48  # struct inet_diag_sockid
INET_DIAG_REQ_BYTECODE = 1
INET_DIAG_BC_JMP = 1
INET_DIAG_BC_S_EQ = 11  # since 4.16
DIAG_MSG_LEN = 72  # struct inet_diag_msg: family..retrans, the sockid, expires..inode
DIAG_INODE_AT = 68
# inet_diag_msg: family, state, (timer, retrans), the sockid's ports (network order: read
# native here, turned with ntohs) and addresses, (if, cookie, expires), rqueue, wqueue,
# (uid), inode
DIAG_MSG = struct.Struct("=BB2xHH16s16s12x4xII4xI")
DIAG_ATTR = struct.Struct("=HH")  # struct nlattr: length, type
_INFO_TAIL = 0  # the length of the last tcp_info attribute seen, when it ended its message
# struct tcp_info: the offsets of the fields read, and how long it must be to hold them
TCPI_LAST_DATA_SENT = 44  # then last_ack_sent, last_data_recv
TCPI_BYTES_ACKED = 120  # then bytes_received
TCPI_NEEDED = 136
RECV_BYTES = 1 << 16  # one read takes what the kernel put in one batch of the dump
# Exact lookups sent in one datagram: their answers must fit the socket's receive buffer
# before they are read. Each is a buffer of its own in the kernel (about 2 KiB counted,
# for 360 bytes of answer): 256 at once overran the default 212,992 bytes here (ENOBUFS).
LOOKUPS_PER_SEND = 64
NETNS_TIMEOUT_S = 5.0

T = TypeVar("T")


class TcpSocket(NamedTuple):
    """A TCP socket as /proc/net/tcp lists it (and sock_diag, read_sockets). A tuple: a
    tick builds one per socket held, thousands on a front-end."""

    family: str
    address: str
    port: int
    state: int
    tx_queue: int
    rx_queue: int
    inode: int
    remote_address: str = ""
    remote_port: int = 0
    info: TcpInfo | None = None  # its tcp_info, where the read carried it (read_sockets)


# How a namespace's tcp_info is read: (ports, netns path or None for our own) -> by inode.
TcpInfoRead = Callable[[Iterable[tuple[str, int]] | None, str | None], dict[int, TcpInfo]]
# How a namespace's sockets are listed (read_sockets): None when it cannot be.
SocketsRead = Callable[
    [Iterable[tuple[str, int]] | None, str | None, int, bool], "list[TcpSocket] | None"
]
# How known sockets are looked up again (lookup_sockets): None when they cannot be.
SocketsLookup = Callable[[Sequence[TcpSocket], str | None, bool], "list[TcpSocket] | None"]


def read_tcp_info(
    ports: Iterable[tuple[str, int]] | None = None, netns: str | None = None
) -> dict[int, TcpInfo]:
    """Socket inode -> TcpInfo of the ESTABLISHED TCP sockets (IPv4 and IPv6) of a network
    namespace. ``ports``: (family "tcp" or "tcp6", local port) pairs to read; None: every
    established socket of both families. ``netns``: the path of the namespace to read
    (``/proc/PID/ns/net``); None: the caller's own. Empty on any failure."""
    try:
        return _read(ports, netns)
    except (OSError, TimeoutError) as e:
        log.debug("tcp_info not read (netns %s): %r", netns, e)
        return {}


def _requests(ports: Iterable[tuple[str, int]] | None) -> list[tuple[int, tuple[int, ...]]]:
    """(address family, local ports to keep or () for all) for each dump to ask for: one
    per family, the ports filtered by the kernel (an inet_diag bytecode)."""
    if ports is None:
        return [(socket.AF_INET, ()), (socket.AF_INET6, ())]
    by_family: dict[int, set[int]] = {}
    for family, port in ports:
        if family in FAMILIES and 0 < port < 65536:
            by_family.setdefault(FAMILIES[family], set()).add(port)
    return [
        (af, tuple(sorted(wanted)) if len(wanted) <= MAX_FILTERED_PORTS else ())
        for af, wanted in sorted(by_family.items())
    ]


def port_filter(ports: Sequence[int]) -> bytes:
    """An inet_diag bytecode that keeps the sockets whose local port is one of ``ports``.

    Each op is {u8 code, u8 yes, u16 no}: the kernel runs them in turn, moving ``yes`` or
    ``no`` bytes on from the op, and keeps the socket if it lands exactly on the end (4 past
    it rejects). An S_EQ op carries its port in a second op's ``no``. The kernel's audit
    follows the ``yes`` moves alone to find where ops begin, so every op's yes is the next
    op, as ss(8) builds an OR: S_EQ port, yes on to a JMP that jumps to the end (keep), no
    over the JMP to the next port's S_EQ; the last S_EQ's no lands 4 past the end."""
    out = bytearray()
    total = 12 * (len(ports) - 1) + 8
    for i, port in enumerate(ports):
        out += struct.pack("=BBHBBH", INET_DIAG_BC_S_EQ, 8, 12, 0, 0, port)
        if i < len(ports) - 1:
            out += struct.pack("=BBH", INET_DIAG_BC_JMP, 4, total - len(out))
    return bytes(out)


def _request(af: int, states: int, ext: int, ports: Sequence[int]) -> bytes:
    """The SOCK_DIAG_BY_FAMILY dump request: inet_diag_req_v2, then the filter if any."""
    # inet_diag_req_v2: family, protocol, ext, pad, states, then an all-zero sockid
    body = struct.pack("=BBBxI", af, socket.IPPROTO_TCP, ext, states) + bytes(SOCKID_LEN)
    if ports:
        bc = port_filter(ports)
        body += struct.pack("=HH", NLA_HDRLEN + len(bc), INET_DIAG_REQ_BYTECODE) + bc
    flags = NLM_F_REQUEST | NLM_F_DUMP
    return struct.pack("=IHHII", NLMSG_HDRLEN + len(body), SOCK_DIAG_BY_FAMILY, flags, 1, 0) + body


def _messages(data: bytes) -> tuple[list[tuple[int, int]], bool]:
    """(start, end) of the sock_diag message body of each socket in one netlink read of a
    dump, and whether the dump ended there. Messages too short for their kind are left
    out, never misread; the kernel's error ends the read as an OSError."""
    found: list[tuple[int, int]] = []
    pos, end = 0, len(data)
    while pos + NLMSG_HDRLEN <= end:
        length, kind = struct.unpack_from("=IH", data, pos)
        if length < NLMSG_HDRLEN or pos + length > end:
            return found, True  # malformed: stop here rather than read past it
        if kind == NLMSG_DONE:
            return found, True
        if kind == NLMSG_ERROR:
            (err,) = struct.unpack_from("=i", data, pos + NLMSG_HDRLEN)
            raise OSError(-err, os.strerror(-err) if err else "netlink error")
        if kind == SOCK_DIAG_BY_FAMILY and length >= NLMSG_HDRLEN + DIAG_MSG_LEN:
            found.append((pos + NLMSG_HDRLEN, pos + length))
        pos += (length + 3) & ~3
    return found, False


def parse_dump(data: bytes, out: dict[int, TcpInfo]) -> bool:
    """Add each socket of one netlink read of a dump to ``out`` (inode -> its tcp_info);
    True once the dump's end is read."""
    found, done = _messages(data)
    for msg, end in found:
        (inode,) = struct.unpack_from("=I", data, msg + DIAG_INODE_AT)
        info = _tcp_info(data, msg, end)
        if inode and info is not None:
            out[inode] = info
    return done


def _tcp_info(data: bytes, msg: int, end: int) -> TcpInfo | None:
    """The tcp_info a message carries, if it does; None too where it is shorter than the
    fields read (kernels before 4.1)."""
    # The kernel puts tcp_info last, and it is as long in every message: where the last
    # message's was, it is looked for first, before walking the attributes.
    global _INFO_TAIL
    at = end - _INFO_TAIL
    info = None
    if (
        _INFO_TAIL
        and at >= msg + DIAG_MSG_LEN
        and DIAG_ATTR.unpack_from(data, at) == (_INFO_TAIL, INET_DIAG_INFO)
    ):
        info = (at + NLA_HDRLEN, _INFO_TAIL - NLA_HDRLEN)
    else:
        info = _attr(data, msg + DIAG_MSG_LEN, end, INET_DIAG_INFO)
        if info is not None and info[0] + info[1] == end:
            _INFO_TAIL = info[1] + NLA_HDRLEN
    if info is None or info[1] < TCPI_NEEDED:
        return None
    at = info[0]
    sent, _, recv = struct.unpack_from("=III", data, at + TCPI_LAST_DATA_SENT)
    acked, received = struct.unpack_from("=QQ", data, at + TCPI_BYTES_ACKED)
    return TcpInfo(recv, sent, received, acked)


def parse_sockets(data: bytes, out: list[TcpSocket], info: bool = True) -> bool:
    """Add each socket of one netlink read of a dump to ``out``, as /proc/net/tcp would list
    it, with its tcp_info where the dump carries it (``info``: whether it was asked for,
    else not looked for); True once the dump's end is read. Sockets without an inode
    (TIME_WAIT: no process holds them) are left out."""
    found, done = _messages(data)
    for msg, end in found:
        s = _socket_at(data, msg, end, info)
        if s is not None:
            out.append(s)
    return done


def _socket_at(data: bytes, msg: int, end: int, info: bool) -> TcpSocket | None:
    """The socket of the message at data[msg:end]; None for one without an inode."""
    af, state, sport, dport, src, dst, rqueue, wqueue, inode = DIAG_MSG.unpack_from(data, msg)
    if not inode or af not in FAMILY_NAMES:
        return None
    size = 4 if af == socket.AF_INET else 16
    # As /proc/net/tcp: a connection's tx_queue and rx_queue are its bytes not yet
    # acknowledged and not yet read; a listener's rx_queue is its accept queue, and its
    # tx_queue 0 there (sock_diag gives its backlog instead: left out, to read the same).
    tx = 0 if state == TCP_LISTEN else wqueue
    tcpi = _tcp_info(data, msg, end) if info and state == TCP_ESTABLISHED else None
    return TcpSocket(
        FAMILY_NAMES[af],
        _address(af, src[:size]),
        socket.ntohs(sport),
        state,
        tx,
        rqueue,
        inode,
        _address(af, dst[:size]),
        socket.ntohs(dport),
        tcpi,
    )


# A dump without tcp_info, by (netns, states, whether by port) -> the last one's sockets by
# their sockid (ports, addresses, interface, cookie: one socket) -> (the message's state
# byte, its queues, uid and inode, the socket): a socket whose message reads as it did is
# the same TcpSocket, not decoded again. Only the timer's countdown is left out of the
# comparison (a keep-alive timer moves it on every dump). A few namespaces' worth.
_BARE_LAST: dict[tuple[str | None, int, bool], dict[bytes, tuple[int, bytes, TcpSocket]]] = {}
_BARE_KEPT = 64  # dumps kept, the oldest dropped first
SOCKID_AT, QUEUES_AT = 4, 56  # offsets in struct inet_diag_msg


def _bare_parser(
    last: Mapping[bytes, tuple[int, bytes, TcpSocket]],
    seen: dict[bytes, tuple[int, bytes, TcpSocket]],
) -> Callable[[bytes, list[TcpSocket]], bool]:
    def parse(data: bytes, out: list[TcpSocket]) -> bool:
        found, done = _messages(data)
        for msg, end in found:
            ident = data[msg + SOCKID_AT : msg + SOCKID_AT + SOCKID_LEN]
            rest = data[msg + QUEUES_AT : msg + DIAG_MSG_LEN]
            kept = last.get(ident)
            if kept is not None and kept[0] == data[msg + 1] and kept[1] == rest:
                seen[ident] = kept
                out.append(kept[2])
                continue
            s = _socket_at(data, msg, end, False)
            if s is not None:
                seen[ident] = (data[msg + 1], rest, s)
                out.append(s)
        return done

    return parse


@functools.lru_cache(maxsize=4096)
def _address(af: int, raw: bytes) -> str:
    """An address in text: a front-end's connections come from a few addresses."""
    return socket.inet_ntop(af, raw)


def _attr(data: bytes, pos: int, end: int, kind: int) -> tuple[int, int] | None:
    """(offset, length) of the payload of the first netlink attribute ``kind`` in
    data[pos:end], or None."""
    while pos + NLA_HDRLEN <= end:
        length, t = struct.unpack_from("=HH", data, pos)
        if length < NLA_HDRLEN or pos + length > end:
            return None
        if t & NLA_TYPE_MASK == kind:
            return pos + NLA_HDRLEN, length - NLA_HDRLEN
        pos += (length + 3) & ~3
    return None


def _read(ports: Iterable[tuple[str, int]] | None, netns: str | None) -> dict[int, TcpInfo]:
    out: dict[int, TcpInfo] = {}
    info = 1 << (INET_DIAG_INFO - 1)
    _dump(_requests(ports), 1 << TCP_ESTABLISHED, info, parse_dump, out, netns)
    return out


def read_sockets(
    ports: Iterable[tuple[str, int]] | None = None,
    netns: str | None = None,
    states: int = ALL_STATES,
    info: bool = True,
) -> list[TcpSocket] | None:
    """The TCP sockets of a network namespace (IPv4 and IPv6, every state but those no
    process holds), as /proc/net/tcp{,6} lists them, from one sock_diag dump per family.
    ``ports`` ((family, local port) pairs) are filtered by the kernel, and the established
    ones then carry their tcp_info (one dump for both: a caller asks for its own ports)
    unless ``info`` is False; None: the whole table, without tcp_info. ``netns``: as
    read_tcp_info. ``states``: a bit per TCP state to list. None on any failure (the caller
    reads /proc/net/tcp)."""
    out: list[TcpSocket] = []
    ext = 0 if ports is None or not info else 1 << (INET_DIAG_INFO - 1)
    # Without tcp_info asked, it is not looked for in each message (the attribute walk), and
    # a socket as it was at the last such dump is not decoded again (_BARE_LAST).
    memo = (netns, states, ports is None)
    seen: dict[bytes, tuple[int, bytes, TcpSocket]] = {}
    parse = parse_sockets if ext else _bare_parser(_BARE_LAST.get(memo, {}), seen)
    try:
        _dump(_requests(ports), states, ext, parse, out, netns)
    except (OSError, TimeoutError) as e:
        log.debug("sockets not read over netlink (netns %s): %r", netns, e)
        return None
    if not ext:
        _BARE_LAST.pop(memo, None)
        _BARE_LAST[memo] = seen
        while len(_BARE_LAST) > _BARE_KEPT:
            del _BARE_LAST[next(iter(_BARE_LAST))]
    return out


def _dump(
    requests: Sequence[tuple[int, tuple[int, ...]]],
    states: int,
    ext: int,
    parse: Callable[[bytes, T], bool],
    out: T,
    netns: str | None = None,
) -> None:
    """Ask for each dump of ``requests`` in turn and ``parse`` each read into ``out``."""
    if not requests:
        return
    with _netlink(netns) as nl:
        nl.settimeout(NETNS_TIMEOUT_S)  # the kernel answers at once; never hang a tick on it
        for af, wanted in requests:
            nl.send(_request(af, states, ext, wanted))
            while not parse(nl.recv(RECV_BYTES), out):
                pass


def lookup_sockets(
    sockets: Sequence[TcpSocket], netns: str | None = None, info: bool = True
) -> list[TcpSocket] | None:
    """``sockets`` (established ones, from an earlier read) as they are now, with their
    tcp_info unless ``info`` is False, by an exact lookup of each 4-tuple: the kernel finds
    each in its hash table, where a dump walks every bucket of it (about 1 ms per family
    however few sockets match: docs/performance.md). Those no longer there are left out. None
    on any failure."""
    out: list[TcpSocket] = []
    try:
        _lookups(sockets, out, info, netns)
    except (OSError, TimeoutError, ValueError) as e:
        log.debug("sockets not looked up (netns %s): %r", netns, e)
        return None
    return out


def _lookup_request(s: TcpSocket, seq: int, info: bool = True) -> bytes:
    """The exact SOCK_DIAG_BY_FAMILY request for one socket (no dump), tcp_info asked if
    ``info``."""
    af = FAMILIES[s.family]
    size = 16
    src = socket.inet_pton(af, s.address).ljust(size, b"\0")
    dst = socket.inet_pton(af, s.remote_address).ljust(size, b"\0")
    sockid = struct.pack("!HH", s.port, s.remote_port) + src + dst
    sockid += struct.pack("=III", 0, 0xFFFFFFFF, 0xFFFFFFFF)  # any interface, no cookie
    ext = 1 << (INET_DIAG_INFO - 1) if info else 0
    body = struct.pack("=BBBxI", af, socket.IPPROTO_TCP, ext, ALL_STATES) + sockid
    return (
        struct.pack("=IHHII", NLMSG_HDRLEN + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST, seq, 0)
        + body
    )


def _lookups(
    sockets: Sequence[TcpSocket], out: list[TcpSocket], info: bool, netns: str | None = None
) -> None:
    """Each lookup is answered by one message, the socket or an error (ENOENT: gone):
    asked LOOKUPS_PER_SEND at a time, so that the answers fit the receive buffer."""
    with _netlink(netns) as nl:
        nl.settimeout(NETNS_TIMEOUT_S)
        for at in range(0, len(sockets), LOOKUPS_PER_SEND):
            batch = sockets[at : at + LOOKUPS_PER_SEND]
            nl.send(b"".join(_lookup_request(s, at + i + 1, info) for i, s in enumerate(batch)))
            answered = 0
            while answered < len(batch):
                data = nl.recv(RECV_BYTES)
                answered += _answers(data, out, info)


def _answers(data: bytes, out: list[TcpSocket], info: bool) -> int:
    """Add the sockets one read of lookups' answers holds to ``out``; how many answers
    (sockets and errors) it held."""
    n, pos, end = 0, 0, len(data)
    while pos + NLMSG_HDRLEN <= end:
        length, kind = struct.unpack_from("=IH", data, pos)
        if length < NLMSG_HDRLEN or pos + length > end:
            raise ValueError("a malformed answer")
        if kind == NLMSG_ERROR:
            n += 1  # this one socket is gone (or never was): left out
        elif kind == SOCK_DIAG_BY_FAMILY:
            n += 1
            parse_sockets(data[pos : pos + length], out, info)
        pos += (length + 3) & ~3
    return n


def _setns(fd: int, nstype: int) -> None:
    setns = getattr(os, "setns", None)  # Python 3.12+
    if setns is not None:
        setns(fd, nstype)
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, nstype) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _netlink(netns: str | None) -> socket.socket:
    """A sock_diag socket of the namespace at path ``netns`` (None: our own)."""
    if netns is None:
        return socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG)
    return NETNS.socket(netns)


class _Job:
    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.done = threading.Event()
        self.sock: socket.socket | None = None
        self.error: BaseException | None = None
        self.abandoned = False  # the caller stopped waiting: a socket made late is closed


class NetnsSockets:
    """Sock_diag sockets made in other network namespaces by one thread of its own: it
    joins the namespace, makes the socket, and goes back to its own (setns(CLONE_NEWNET)
    affects the calling thread only, and a socket reads the namespace it was made in). Making
    a socket never blocks, so one thread serves every read; the reads run in the caller's
    thread, under the socket's timeout. The daemon starts it at start-up (``start()``), so
    that no tick starts a thread; a one-shot command's first use starts it."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        """Start the thread; RuntimeError if it cannot start."""
        with self._lock:
            if self._thread is not None:
                return
            thread = threading.Thread(target=self._run, name="hangwatch-netns", daemon=True)
            thread.start()
            self._thread = thread

    def socket(self, path: str) -> socket.socket:
        """A sock_diag socket of the namespace at ``path``; OSError when it cannot be made."""
        try:
            self.start()
        except RuntimeError as e:  # no task left for it: this read fails, not the caller
            raise OSError(errno.EAGAIN, f"no thread to enter {path}: {e}") from None
        job = _Job(os.open(path, os.O_RDONLY | os.O_CLOEXEC))  # a missing one raises here
        self._jobs.put(job)
        if not job.done.wait(NETNS_TIMEOUT_S):
            with self._lock:
                job.abandoned = True
                late = job.sock
            if late is not None:
                late.close()
            raise TimeoutError(f"no socket in {path} within {NETNS_TIMEOUT_S} s")
        if job.error is not None:
            raise job.error
        assert job.sock is not None
        return job.sock

    def _run(self) -> None:
        home = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        while True:
            job = self._jobs.get()
            try:
                _setns(job.fd, CLONE_NEWNET)
                try:
                    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG)
                finally:
                    # Back home, so that no namespace is kept alive by this thread.
                    with contextlib.suppress(OSError):
                        _setns(home, CLONE_NEWNET)
                with self._lock:
                    if job.abandoned:
                        sock.close()
                    else:
                        job.sock = sock
            except Exception as e:
                job.error = e
            finally:
                os.close(job.fd)
                job.done.set()


NETNS = NetnsSockets()
