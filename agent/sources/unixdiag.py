"""The bound names of unix sockets, looked up by inode over sock_diag netlink (unix_diag).

/proc/net/unix prints each name raw, and a name is its owner's to choose: an abstract name
may hold a newline and a forged record after it. Asked by inode (an exact lookup with
UDIAG_SHOW_NAME), the kernel answers with the name as a length-counted attribute, at the same
cost whatever the namespace holds. A socket gone or in another namespace is left out; a read
that fails as a whole gives None, and the caller reads /proc/PID/net/unix instead.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import struct
from collections.abc import Callable, Collection

from .tcpinfo import (
    NETNS_TIMEOUT_S,
    NLA_HDRLEN,
    NLA_TYPE_MASK,
    NLM_F_REQUEST,
    NLMSG_ERROR,
    NLMSG_HDRLEN,
    SOCK_DIAG_BY_FAMILY,
    _netlink,
)

log = logging.getLogger(__name__)

# include/uapi/linux/unix_diag.h
UDIAG_SHOW_NAME = 0x01
UNIX_DIAG_NAME = 0
NO_COOKIE = 0xFFFFFFFF  # INET_DIAG_NOCOOKIE: the lookup is by inode alone
ALL_STATES = 0xFFFFFFFF
# unix_diag_req: family, protocol, pad, states, inode, show, cookie[2]
UNIX_DIAG_REQ = struct.Struct("=BBHIII2I")
# unix_diag_msg: family, type, state, pad, inode, cookie[2]
UNIX_DIAG_MSG = struct.Struct("=BBBxI2I")
NAME_MAX = 108  # sizeof(sun_path)
RECV_BYTES = 1 << 12  # one answer: the message, a name of at most 108 bytes, a few attributes
MAX_LOOKUPS = 64  # inodes asked per read: a report asks for a few fds of a few threads

# (inodes, netns path or None for our own) -> inode -> name ("@..." for an abstract one);
# None when the kernel cannot be asked.
UnixPathsRead = Callable[[Collection[int], "str | None"], "dict[int, str] | None"]


def read_unix_paths(inodes: Collection[int], netns: str | None = None) -> dict[int, str] | None:
    """Inode -> bound name of those of the unix sockets ``inodes`` (at most MAX_LOOKUPS of
    them) of a network namespace that have one: a path, or an abstract name as
    /proc/net/unix writes it (``@`` first, and for each NUL in it). ``netns``: the path of
    the namespace (``/proc/PID/ns/net``); None: the caller's own. None on any failure."""
    wanted = [i for i in inodes if 0 < i < 1 << 32][:MAX_LOOKUPS]
    try:
        return _lookups(wanted, netns)
    except (OSError, TimeoutError) as e:
        log.debug("unix sockets not looked up (netns %s): %r", netns, e)
        return None


def lookup_request(inode: int, seq: int) -> bytes:
    """The exact SOCK_DIAG_BY_FAMILY request for the unix socket ``inode``, its name asked."""
    body = UNIX_DIAG_REQ.pack(
        socket.AF_UNIX, 0, 0, ALL_STATES, inode, UDIAG_SHOW_NAME, NO_COOKIE, NO_COOKIE
    )
    return (
        struct.pack("=IHHII", NLMSG_HDRLEN + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST, seq, 0)
        + body
    )


def _lookups(inodes: Collection[int], netns: str | None = None) -> dict[int, str]:
    out: dict[int, str] = {}
    # A socket made in the namespace reads it from any thread (tcpinfo.NETNS: no thread a read).
    with _netlink(netns) as nl:
        nl.settimeout(NETNS_TIMEOUT_S)  # the kernel answers at once; never hang on it
        for seq, inode in enumerate(inodes, 1):
            nl.send(lookup_request(inode, seq))
            got = parse_answer(nl.recv(RECV_BYTES), inode)
            if got is not None:
                out[inode] = got
    return out


def parse_answer(data: bytes, inode: int) -> str | None:
    """The name in the kernel's answer about the socket ``inode``: None where it has none,
    is gone (ENOENT), or the answer is about another socket or does not parse. Any other
    error the kernel gives is raised (OSError): the lookups stop there."""
    if len(data) < NLMSG_HDRLEN:
        return None
    length, kind = struct.unpack_from("=IH", data)
    if length < NLMSG_HDRLEN or length > len(data):
        return None
    if kind == NLMSG_ERROR:
        (err,) = (
            struct.unpack_from("=i", data, NLMSG_HDRLEN) if length >= NLMSG_HDRLEN + 4 else (0,)
        )
        if -err in (0, errno.ENOENT):
            return None
        raise OSError(-err, os.strerror(-err))
    if kind != SOCK_DIAG_BY_FAMILY or length < NLMSG_HDRLEN + UNIX_DIAG_MSG.size:
        return None
    family, _, _, ino, _, _ = UNIX_DIAG_MSG.unpack_from(data, NLMSG_HDRLEN)
    if family != socket.AF_UNIX or ino != inode:
        return None  # not the socket asked about: believed for no other
    pos = NLMSG_HDRLEN + UNIX_DIAG_MSG.size
    while pos + NLA_HDRLEN <= length:
        size, t = struct.unpack_from("=HH", data, pos)
        if size < NLA_HDRLEN or pos + size > length:
            return None
        if t & NLA_TYPE_MASK == UNIX_DIAG_NAME:
            return _name(data[pos + NLA_HDRLEN : pos + size])
        pos += (size + 3) & ~3
    return None


def _name(raw: bytes) -> str | None:
    """A sun_path as /proc/net/unix prints it: a path up to its NUL, an abstract name (a
    NUL first) as ``@`` and its bytes, each NUL as ``@``."""
    raw = raw[:NAME_MAX]
    if not raw:
        return None
    if raw[0] == 0:
        return "@" + raw[1:].replace(b"\0", b"@").decode(errors="replace")
    return raw.split(b"\0", 1)[0].decode(errors="replace") or None
