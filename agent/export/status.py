"""The status socket: the daemon's verdicts and history for `hangwatch status` and `diagnose`,
on a unix socket of the host, never on the metrics port (its answers hold Python stacks and
source lines, which stay on the host).

Who may ask is decided by the file's permissions, like any local admin socket: owned by root
and the status group, mode 0660 (0600 when the group does not exist). The peer's credentials
(SO_PEERCRED) are checked as well, so a socket made reachable by mistake (a bind mount, a
mode changed by hand) still answers only root and the group's members.

Every client is untrusted: one thread serves them all with non-blocking sockets, so a client
that sends nothing, too much or reads slowly stalls no one; each has a deadline, a request
is one line of at most 4 KiB, at most MAX_CONNECTIONS are served at once (more are told
"busy"), and the answer is built from the loop's last immutable view: the loop never waits.
"""

from __future__ import annotations

import contextlib
import errno
import grp
import logging
import os
import selectors
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import UsageError
from . import statusproto as proto

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 8
READ_TIMEOUT_S = 2.0  # to send the request line
WRITE_TIMEOUT_S = 5.0  # to take the answer
_POLL_S = 0.5  # how soon a stop is seen
_CREDS = struct.Struct("3i")  # struct ucred: pid, uid, gid
_TAKEN = (
    "status socket %s: another hangwatch daemon answers there; "
    "not serving status (set status_socket to another path)"
)


@dataclass(frozen=True)
class Peer:
    pid: int
    uid: int
    gid: int


Answer = Callable[[proto.Request, Peer], Mapping[str, Any]]


@dataclass
class _Conn:
    sock: socket.socket
    peer: Peer
    deadline: float
    buf: bytearray = field(default_factory=bytearray)
    out: bytes | None = None
    sent: int = 0


def groups_of(pid: int) -> set[int]:
    """The supplementary groups a process has now, from /proc/PID/status (empty if unread)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("Groups:"):
                    return {int(g) for g in line.split()[1:] if g.isdigit()}
    except OSError:
        pass
    return set()


class StatusServer:
    """``bind()`` at start-up (before the probes attach, like the metrics port), ``start()``
    with the daemon's workers, ``close()`` on the way out (removes the socket file)."""

    def __init__(self, path: str, group: str, answer: Answer) -> None:
        self.path = path
        self.group = group
        self._answer = answer
        self.gid: int | None = None  # the group's gid, when it exists
        self._sock: socket.socket | None = None
        self._ino: int | None = None  # the socket file bound, removed on close if still ours
        self._made_dir = False  # its directory was made here: removed on close if left empty
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.refused = 0  # peers neither root nor in the group
        self.busy = 0  # connections beyond MAX_CONNECTIONS

    def bind(self) -> bool:
        """Make the socket file. False (logged) when another daemon answers there; UsageError
        naming the key when the path cannot be a socket."""
        path = self.path
        parent = os.path.dirname(path) or "."
        try:
            if not os.path.isdir(parent):
                os.makedirs(parent, mode=0o755, exist_ok=True)
                os.chmod(parent, 0o755)  # whatever the umask: clients must reach the socket
                self._made_dir = True
            if os.path.lexists(path):
                if not stat.S_ISSOCK(os.lstat(path).st_mode):
                    raise UsageError(
                        f"status_socket {path}: exists and is not a socket",
                        "remove it, or set status_socket to another path",
                    )
                if _answers(path):
                    log.warning(_TAKEN, path)
                    return False
                os.unlink(path)  # left by a daemon that did not exit cleanly
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            old = os.umask(0o177)  # never a moment more open than 0600
            try:
                sock.bind(path)
            except OSError as e:
                sock.close()
                if e.errno != errno.EADDRINUSE:
                    raise
                # Another daemon bound it between the look above and this bind.
                log.warning(_TAKEN, path)
                return False
            finally:
                os.umask(old)
            self._ino = os.lstat(path).st_ino
            self._set_access(path)
            sock.listen(16)
            sock.setblocking(False)
        except OSError as e:
            raise UsageError(f"status_socket {path}: {e.strerror or e}") from None
        self._sock = sock
        return True

    def _set_access(self, path: str) -> None:
        try:
            self.gid = grp.getgrnam(self.group).gr_gid
        except KeyError:
            log.info(
                "status socket %s: no group %r, so only root may ask; to let others: "
                "groupadd --system %s; usermod -aG %s USER; systemctl restart hangwatch",
                path,
                self.group,
                self.group,
                self.group,
            )
            return  # 0600, as bound
        os.chown(path, os.geteuid(), self.gid)
        os.chmod(path, 0o660)

    def allowed(self, peer: Peer) -> bool:
        if peer.uid in (0, os.geteuid()):
            return True
        if self.gid is None:
            return False
        return peer.gid == self.gid or self.gid in groups_of(peer.pid)

    def start(self) -> None:
        if self._sock is None or self._thread is not None:
            return
        thread = threading.Thread(target=self._run, name="hangwatch-status", daemon=True)
        thread.start()
        self._thread = thread

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2 * _POLL_S + 1)
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        try:  # only the file this daemon made: another may have taken the path since
            if self._ino is not None and os.lstat(self.path).st_ino == self._ino:
                os.unlink(self.path)
        except OSError:
            pass
        if self._made_dir:  # nothing left behind where no service manager cleans up
            with contextlib.suppress(OSError):
                os.rmdir(os.path.dirname(self.path))

    # --- the serving thread ------------------------------------------------------------------

    def _run(self) -> None:
        assert self._sock is not None
        sel = selectors.DefaultSelector()
        sel.register(self._sock, selectors.EVENT_READ, None)
        conns: dict[int, _Conn] = {}
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                soonest = min((c.deadline for c in conns.values()), default=now + _POLL_S)
                for key, _ in sel.select(max(0.0, min(_POLL_S, soonest - now))):
                    if key.data is None:
                        self._accept(sel, conns)
                    else:
                        self._serve(sel, conns, key.data)
                now = time.monotonic()
                for c in [c for c in conns.values() if c.deadline <= now]:
                    self._drop(sel, conns, c)  # too slow to ask, or to take the answer
        except Exception:
            log.exception("status socket: the server stopped; status is not served")
        finally:
            for c in list(conns.values()):
                self._drop(sel, conns, c)
            sel.close()

    def _accept(self, sel: selectors.BaseSelector, conns: dict[int, _Conn]) -> None:
        assert self._sock is not None
        for _ in range(64):  # a burst at once, and back to the others
            try:
                sock, _addr = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # EMFILE and the like: the others go on
                if e.errno not in (errno.ECONNABORTED, errno.EPROTO):
                    log.warning("status socket: accept failed: %s", e.strerror or e)
                return
            sock.setblocking(False)
            pid, uid, gid = _CREDS.unpack(
                sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDS.size)
            )
            peer = Peer(pid, uid, gid)
            if len(conns) >= MAX_CONNECTIONS:
                self.busy += 1
                _try_send(sock, proto.encode_answer(proto.error(proto.BUSY, "too many clients")))
                sock.close()
                continue
            # A refused peer's request is read too, then refused: closing with its request
            # unread would reset the connection before it reads why.
            c = _Conn(sock, peer, time.monotonic() + READ_TIMEOUT_S)
            conns[sock.fileno()] = c
            sel.register(sock, selectors.EVENT_READ, c)

    def _refusal(self, peer: Peer) -> str:
        return f"uid {peer.uid} is neither root nor in group {self.group}"

    def _serve(self, sel: selectors.BaseSelector, conns: dict[int, _Conn], c: _Conn) -> None:
        if c.out is not None:
            self._write(sel, conns, c)
            return
        try:
            data = c.sock.recv(proto.MAX_REQUEST_BYTES + 1 - len(c.buf))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(sel, conns, c)
            return
        c.buf += data
        end = c.buf.find(b"\n")
        if end < 0 and data and len(c.buf) <= proto.MAX_REQUEST_BYTES:
            return  # more to come
        if end < 0 and not data and not c.buf:
            self._drop(sel, conns, c)  # connected and left without asking
            return
        if not self.allowed(c.peer):
            self.refused += 1
            self._reply(sel, c, proto.error(proto.REFUSED, self._refusal(c.peer)))
            return
        line = bytes(c.buf if end < 0 else c.buf[:end])
        try:
            if end < 0 and data:
                raise proto.ProtocolError(f"request longer than {proto.MAX_REQUEST_BYTES} bytes")
            req = proto.decode_request(line)
        except proto.ProtocolError as e:
            self._reply(sel, c, proto.error(proto.BAD_REQUEST, str(e)))
            return
        try:
            doc = self._answer(req, c.peer)
        except Exception:
            log.exception("status socket: building an answer failed")
            doc = proto.error(proto.INTERNAL, "the daemon failed to build its answer; see its log")
        self._reply(sel, c, doc)

    @staticmethod
    def _reply(sel: selectors.BaseSelector, c: _Conn, doc: Mapping[str, Any]) -> None:
        c.out = proto.encode_answer(doc)
        c.deadline = time.monotonic() + WRITE_TIMEOUT_S
        sel.modify(c.sock, selectors.EVENT_WRITE, c)

    def _write(self, sel: selectors.BaseSelector, conns: dict[int, _Conn], c: _Conn) -> None:
        assert c.out is not None
        try:
            c.sent += c.sock.send(c.out[c.sent : c.sent + 65536])
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(sel, conns, c)
            return
        if c.sent >= len(c.out):
            self._drop(sel, conns, c)

    @staticmethod
    def _drop(sel: selectors.BaseSelector, conns: dict[int, _Conn], c: _Conn) -> None:
        conns.pop(c.sock.fileno(), None)
        with contextlib.suppress(KeyError, ValueError):
            sel.unregister(c.sock)
        c.sock.close()


def _try_send(sock: socket.socket, data: bytes) -> None:
    with contextlib.suppress(OSError):
        sock.send(data)


def _answers(path: str) -> bool:
    """Whether something accepts connections at the socket ``path`` now."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        try:
            s.connect(path)
        except OSError:
            return False
    return True
