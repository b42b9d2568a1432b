"""TLS and basic auth for /metrics, from a web config file in the Prometheus exporter format
(``tls_server_config``, ``basic_auth_users``: docs/security.md, "Protecting /metrics").

The file is validated completely, certificates and keys loaded and hashes checked, before the
daemon binds or attaches anything: a bad one is a UsageError (exit 2) that names the key.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import errno
import hashlib
import hmac
import io
import logging
import os
import queue
import re
import resource
import selectors
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

import yaml

from ..config import check_trusted, unknown_key
from ..errors import UsageError, show

log = logging.getLogger(__name__)

TOP_KEYS = ("tls_server_config", "basic_auth_users")
TLS_KEYS = ("cert_file", "key_file", "client_auth_type", "client_ca_file", "min_version")
# The exporter format's keys that hangwatch does not implement: refused by name, never ignored.
UNSUPPORTED = {
    "http_server_config": "HTTP/2 and response headers",
    "max_version": "a TLS maximum version",
    "cipher_suites": "a cipher list (Python's defaults are used)",
    "curve_preferences": "a curve list",
    "prefer_server_cipher_suites": "cipher order",
    "client_allowed_sans": "client SAN filters",
}
CLIENT_AUTH = {
    "NoClientCert": ssl.CERT_NONE,
    "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
    "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
}
TLS_VERSIONS = {"TLS12": ssl.TLSVersion.TLSv1_2, "TLS13": ssl.TLSVersion.TLSv1_3}
# Cost at most 15: every check costs 2**cost rounds, and a scrape must not wait seconds.
_BCRYPT = re.compile(r"\$2[aby]\$(0[4-9]|1[0-5])\$[./A-Za-z0-9]{53}")
# A connection's whole life, TLS handshake to the answer's last byte (a scrape takes
# milliseconds; Prometheus gives up after its scrape_timeout, 10 s by default).
CONNECTION_DEADLINE_S = 10.0
# Open at once, each a socket and a request head (MAX_HEAD_BYTES); at most a quarter of the
# file descriptors the process may open (systemd's default soft limit, 1024, allows 256).
MAX_CONNECTIONS = 256
MAX_HEAD_BYTES = 16 << 10  # request line and headers: a scrape sends a few hundred bytes
CLOSE_JOIN_S = 1.0  # how long closing the server waits for each answering thread to end
ACCEPT_BACKOFF_S = 0.05  # out of file descriptors: wait this long before accepting again
HTTP_WORKERS = 4  # threads answering requests whose head has arrived, started with the server
# Why the server ended a connection: past its deadline; dropped, still sending its request,
# for a newer one at MAX_CONNECTIONS; refused, every open one having sent its request.
DROP_REASONS = ("deadline", "evicted", "full")
SOMAXCONN_PATH = "/proc/sys/net/core/somaxconn"
CACHE_SIZE = 64  # verified credentials kept, so a scrape costs no bcrypt round after the first


@dataclass(frozen=True)
class TlsConfig:
    cert_file: str
    key_file: str
    client_auth: ssl.VerifyMode = ssl.CERT_NONE
    client_ca_file: str | None = None
    min_version: ssl.TLSVersion = ssl.TLSVersion.TLSv1_2

    def context(self) -> ssl.SSLContext:
        """A server context with the certificate loaded; a UsageError names what is wrong."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = self.min_version
        try:
            # No password prompt on a terminal: an encrypted key fails here instead.
            ctx.load_cert_chain(self.cert_file, self.key_file, password=lambda: b"")
        except (OSError, ssl.SSLError) as e:
            raise UsageError(
                f"web config: tls_server_config: cannot load cert_file {self.cert_file!r} "
                f"with key_file {self.key_file!r}: {_reason(e)}",
                "want PEM files, the key unencrypted and matching the certificate",
            ) from None
        if self.client_ca_file is not None:
            try:
                ctx.load_verify_locations(cafile=self.client_ca_file)
            except (OSError, ssl.SSLError) as e:
                raise UsageError(
                    f"web config: tls_server_config.client_ca_file: cannot load "
                    f"{self.client_ca_file!r}: {_reason(e)}"
                ) from None
        ctx.verify_mode = self.client_auth
        return ctx


@dataclass(frozen=True)
class WebConfig:
    tls: TlsConfig | None = None
    users: Mapping[str, bytes] = field(default_factory=dict)  # user -> bcrypt hash
    source: str = ""


def _reason(e: BaseException) -> str:
    text = getattr(e, "strerror", None) or getattr(e, "reason", None) or str(e)
    return " ".join(str(text).split())


def _err(key: str, what: str) -> UsageError:
    return UsageError(f"web config: {key}: {what}")


def _mapping(raw: object, key: str) -> dict[Any, Any]:
    if not isinstance(raw, dict):
        raise _err(key, f"want a mapping, got {show(raw)}")
    return raw


def _check_keys(raw: Mapping[Any, Any], known: tuple[str, ...], where: str) -> None:
    for k in raw:
        if isinstance(k, str) and k in UNSUPPORTED:
            raise _err(f"{where}{k}", f"not supported by hangwatch ({UNSUPPORTED[k]})")
    bad = unknown_key(raw, known)
    if bad:
        raise _err(f"{where}{bad[0]}", bad[1])


def _file(raw: Mapping[Any, Any], key: str, base: str) -> str:
    value = raw.get(key)
    if not isinstance(value, str) or not value or "\0" in value:
        raise _err(f"tls_server_config.{key}", f"want a file name, got {show(value)}")
    path = os.path.join(base, value)  # relative to the web config file, as Prometheus does
    if not os.path.isfile(path):
        raise _err(f"tls_server_config.{key}", f"{show(value)} is not a readable file")
    check_trusted(path, f"web config: tls_server_config.{key}")
    return path


def _tls(raw: object, base: str) -> TlsConfig:
    tls = _mapping(raw, "tls_server_config")
    _check_keys(tls, TLS_KEYS, "tls_server_config.")
    cert, key = _file(tls, "cert_file", base), _file(tls, "key_file", base)
    mode_name = tls.get("client_auth_type", "NoClientCert")
    if mode_name not in CLIENT_AUTH:
        raise _err(
            "tls_server_config.client_auth_type",
            f"{show(mode_name)} is not one of {', '.join(CLIENT_AUTH)}",
        )
    mode = CLIENT_AUTH[mode_name]
    ca = _file(tls, "client_ca_file", base) if "client_ca_file" in tls else None
    if mode != ssl.CERT_NONE and ca is None:
        raise _err("tls_server_config.client_ca_file", f"{mode_name} needs the clients' CA file")
    if mode == ssl.CERT_NONE and ca is not None:
        raise _err(
            "tls_server_config.client_auth_type",
            "client_ca_file is given but client certificates are not checked: "
            "set RequireAndVerifyClientCert",
        )
    version = tls.get("min_version", "TLS12")
    if version not in TLS_VERSIONS:
        raise _err("tls_server_config.min_version", f"{show(version)} is not one of TLS12, TLS13")
    cfg = TlsConfig(cert, key, mode, ca, TLS_VERSIONS[version])
    cfg.context()  # load now: a wrong key or certificate must fail before anything starts
    return cfg


def _users(raw: object) -> dict[str, bytes]:
    users = _mapping(raw, "basic_auth_users")
    if not users:
        raise _err("basic_auth_users", "empty: remove it, or name at least one user")
    out = {}
    for user, hashed in users.items():
        if not isinstance(user, str) or not user or ":" in user or not user.isprintable():
            raise _err("basic_auth_users", f"{show(user)} is not a user name (no ':')")
        where = f"basic_auth_users.{user}"
        if not isinstance(hashed, str) or not _BCRYPT.fullmatch(hashed):
            raise _err(
                where,
                "want a bcrypt hash of cost 4-15 ($2y$10$ and 53 characters, from "
                "htpasswd -nBC 10 USER)",
            )
        try:
            _bcrypt().checkpw(b"", hashed.encode())  # parses it: a malformed hash fails here
        except ValueError as e:
            raise _err(where, f"not a valid bcrypt hash ({e})") from None
        out[user] = hashed.encode()
    return out


def _bcrypt() -> Any:
    try:
        import bcrypt
    except ImportError:
        raise UsageError(
            "web config: basic_auth_users needs the bcrypt module",
            "install python3-bcrypt (make setup does)",
        ) from None
    return bcrypt


def parse(text: str, source: str, base: str = ".") -> WebConfig:
    """The web config in ``text``; file names in it are relative to ``base``."""
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise UsageError(
            f"web config {source}: not valid YAML: {' '.join(str(e).split())}"
        ) from None
    except RecursionError:
        raise UsageError(f"web config {source}: not valid YAML: nested too deeply") from None
    if raw is None:
        raw = {}
    try:
        doc = _mapping(raw, "(top level)")
        _check_keys(doc, TOP_KEYS, "")
        tls = _tls(doc["tls_server_config"], base) if "tls_server_config" in doc else None
        users = _users(doc["basic_auth_users"]) if "basic_auth_users" in doc else {}
    except UsageError as e:
        # Say which file: "web config web.yml: tls_server_config.cert_file: ..."
        e.what = e.what.replace("web config:", f"web config {source}:", 1)
        raise
    return WebConfig(tls, users, source)


def load(path: str) -> WebConfig:
    check_trusted(path, "web config")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read(1 << 20)
    except OSError as e:
        raise UsageError(f"web config {path}: cannot read it: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise UsageError(f"web config {path}: not UTF-8 text (byte {e.start})") from None
    return parse(text, path, os.path.dirname(os.path.abspath(path)))


# --- basic auth -----------------------------------------------------------------------------


class BasicAuth:
    """Checks an Authorization header against bcrypt hashes, in time that does not say which
    part was wrong: an unknown user costs the same bcrypt round as a wrong password."""

    def __init__(self, users: Mapping[str, bytes]) -> None:
        self._bcrypt = _bcrypt()
        self.users = dict(users)
        # The same cost as a real hash, so an unknown user takes as long as a known one.
        rounds = max((int(h[4:6]) for h in self.users.values() if h[4:6].isdigit()), default=10)
        self._dummy = self._bcrypt.hashpw(b"unknown user", self._bcrypt.gensalt(rounds=rounds))
        self._ok: dict[bytes, None] = {}  # digests of verified credentials, oldest first
        self._lock = threading.Lock()
        self._key = os.urandom(32)  # the cache keeps keyed digests, never passwords

    def allowed(self, header: str | None) -> bool:
        creds = _basic_credentials(header)
        if creds is None:
            return False
        user, password = creds
        hashed = self.users.get(user)
        digest = hmac.new(
            self._key, user.encode() + b"\0" + password + b"\0" + (hashed or b""), hashlib.sha256
        ).digest()
        with self._lock:
            if hashed is not None and digest in self._ok:
                return True
        try:
            ok = self._bcrypt.checkpw(password, hashed if hashed is not None else self._dummy)
        except ValueError:  # a NUL in the password, say
            ok = False
        ok = ok and hashed is not None
        if ok:
            with self._lock:
                self._ok[digest] = None
                while len(self._ok) > CACHE_SIZE:
                    del self._ok[next(iter(self._ok))]
        return ok


def _basic_credentials(header: str | None) -> tuple[str, bytes] | None:
    if not header:
        return None
    scheme, _, value = header.strip().partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        raw = base64.b64decode(value.strip(), validate=True)
    except (binascii.Error, ValueError):
        return None
    user, sep, password = raw.partition(b":")
    if not sep:
        return None
    try:
        return user.decode("utf-8"), password
    except UnicodeDecodeError:
        return None


WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


def with_basic_auth(app: WsgiApp, auth: BasicAuth, realm: str = "hangwatch") -> WsgiApp:
    """``app`` behind basic auth: 401 with a challenge unless the credentials check out."""

    def wrapped(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if auth.allowed(environ.get("HTTP_AUTHORIZATION")):
            return app(environ, start_response)
        body = b"Unauthorized\n"
        start_response(
            "401 Unauthorized",
            [
                ("WWW-Authenticate", f'Basic realm="{realm}", charset="UTF-8"'),
                ("Content-Type", "text/plain; charset=utf-8"),
                ("Content-Length", str(len(body))),
            ],
        )
        return [body]

    return wrapped


# --- the server -----------------------------------------------------------------------------


def listen_backlog(path: str = SOMAXCONN_PATH) -> int:
    """The listen(2) backlog of /metrics: the kernel's own limit, net.core.somaxconn (4096
    since Linux 5.4), as Go's net package, and so node_exporter, uses; socket.SOMAXCONN where
    it cannot be read. Not the standard library's 5: connections that arrive faster than the
    accept loop takes them wait in this queue, and a burst that overflows it is answered with
    SYN cookies or dropped, its scrapes left to retransmissions that back off for a minute."""
    try:
        with open(path, encoding="ascii") as f:
            n = int(f.read(32).split()[0])
    except (OSError, ValueError, IndexError):
        return socket.SOMAXCONN
    if n <= 0:
        return socket.SOMAXCONN
    return min(n, 0xFFFF)  # kernels before 4.1 keep it in 16 bits: more would wrap (Go caps too)


class _Handler(WSGIRequestHandler):
    """Answers one request whose head the server has already read (``head``)."""

    timeout = None  # the server set the socket's timeout from the connection's deadline

    def __init__(self, request: Any, client_address: Any, server: Any, head: bytes) -> None:
        self.head = head
        super().__init__(request, client_address, server)

    def setup(self) -> None:
        super().setup()
        self.rfile.close()
        # The request line and headers, read by the accept loop; a GET has no body to follow.
        self.rfile = io.BytesIO(self.head)

    def log_message(self, format: str, *args: Any) -> None:
        """No access log: scrapes every few seconds would drown the state changes."""


class _Connection:
    """One accepted connection: its socket (an SSLSocket once wrapped), the bytes of its
    request head so far, the monotonic time it must be done by, and where it stands."""

    def __init__(self, sock: socket.socket, address: Any, deadline: float) -> None:
        self.sock = sock
        self.address = address
        self.deadline = deadline
        self.head = bytearray()
        self.handshaking = False
        self.answering = False  # its head is read: queued for a worker, or being answered
        self.dropped = False
        self.closed = False


def _head_complete(head: bytearray, before: int) -> bool:
    at = max(0, before - 3)  # only the new bytes and the three before them: no rescans
    return head.find(b"\r\n\r\n", at) >= 0 or head.find(b"\n\n", at) >= 0


class _Server(WSGIServer):
    """/metrics without a thread per connection: the accept loop reads every request head
    (and does the TLS handshake) without blocking, in one thread; HTTP_WORKERS threads,
    started with the server, answer the requests whose head has arrived, in order. A
    connection that trickles its request costs a socket and a buffer, never a thread, and is
    dropped at its deadline; at MAX_CONNECTIONS the oldest still sending is dropped for the
    newcomer. ``dropped`` counts connections ended by the server, by reason."""

    tls: ssl.SSLContext | None = None
    max_connections = MAX_CONNECTIONS
    deadline_s = CONNECTION_DEADLINE_S
    workers = HTTP_WORKERS

    def __init__(self, address: tuple[str, int], handler: Any) -> None:
        # Before binding: a bind that fails calls server_close(), which must find it all.
        self._lock = threading.Lock()
        self._conns: set[_Connection] = set()
        self._answers: queue.Queue[_Connection | None] = queue.Queue()
        self._selector = selectors.DefaultSelector()
        self._stopping = False
        self._stopped = threading.Event()
        self._stopped.set()
        self.dropped = dict.fromkeys(DROP_REASONS, 0)
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and soft > 0:  # a quarter of the fds, at most
            self.max_connections = min(self.max_connections, max(1, soft // 4))
        self._threads: list[threading.Thread] = []
        super().__init__(address, handler)

    def dropped_total(self) -> dict[str, int]:
        """Connections the server ended, by reason (DROP_REASONS), since it started."""
        with self._lock:
            return dict(self.dropped)

    def start_workers(self) -> None:
        """Start the answering threads: at start-up, so that none is needed later."""
        for i in range(self.workers):
            t = threading.Thread(target=self._work, name=f"metrics-http-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def serve_forever(self, poll_interval: float = 0.5) -> None:
        self._stopped.clear()
        self._selector.register(self.socket, selectors.EVENT_READ, None)
        try:
            while not self._stopping:
                for key, _ in self._selector.select(poll_interval):
                    try:
                        if key.data is None:
                            self._accept()
                        elif not key.data.closed:  # not evicted earlier in this round
                            self._advance(key.data)
                    except Exception:  # a fault of ours: this connection goes, /metrics stays
                        log.exception("/metrics: a connection dropped on an internal error")
                        if key.data is not None:
                            with self._lock:
                                self._close(key.data)
                self._reap(time.monotonic())
        finally:
            self._selector.unregister(self.socket)
            with self._lock:
                for conn in [c for c in self._conns if not c.answering]:
                    self._close(conn)
            self._stopped.set()

    def shutdown(self) -> None:
        self._stopping = True
        self._stopped.wait()

    def server_close(self) -> None:
        super().server_close()
        with self._lock:  # answers still being written end now, not at their deadline
            for conn in self._conns:
                if conn.answering:
                    with contextlib.suppress(OSError):
                        socket.socket.shutdown(conn.sock, socket.SHUT_RDWR)
        for _ in self._threads:
            self._answers.put(None)
        for t in self._threads:
            t.join(CLOSE_JOIN_S)
        self._threads = []
        self._selector.close()

    def _accept(self) -> None:
        try:
            sock, address = self.socket.accept()
        except OSError as e:
            if e.errno in (errno.EMFILE, errno.ENFILE):
                time.sleep(ACCEPT_BACKOFF_S)  # the connection stays queued: do not spin on it
            return
        sock.setblocking(False)
        with self._lock:
            if len(self._conns) >= self.max_connections:
                waiting = (c for c in self._conns if not c.answering)
                oldest = min(waiting, key=lambda c: c.deadline, default=None)
                if oldest is None:  # every one has sent its request: they are served first
                    self.dropped["full"] += 1
                    sock.close()
                    return
                self._drop(oldest, "evicted")
            conn = _Connection(sock, address, time.monotonic() + self.deadline_s)
            self._conns.add(conn)
        if self.tls is not None:
            try:
                conn.sock = self.tls.wrap_socket(
                    sock, server_side=True, do_handshake_on_connect=False
                )
            except (OSError, ValueError):
                with self._lock:
                    self._close(conn)
                return
            conn.handshaking = True
        self._selector.register(conn.sock, selectors.EVENT_READ, conn)

    def _advance(self, conn: _Connection) -> None:
        """The handshake and the request head, as far as the bytes that came allow."""
        try:
            if conn.handshaking:
                conn.sock.do_handshake()  # type: ignore[attr-defined]
                conn.handshaking = False
            while True:
                before = len(conn.head)
                data = conn.sock.recv(MAX_HEAD_BYTES + 1 - before)
                if not data:
                    raise ConnectionResetError("closed before its request ended")
                conn.head += data
                if _head_complete(conn.head, before) or len(conn.head) > MAX_HEAD_BYTES:
                    break  # too long: the handler answers it with an error
        except ssl.SSLWantReadError:
            self._selector.modify(conn.sock, selectors.EVENT_READ, conn)
            return
        except ssl.SSLWantWriteError:
            self._selector.modify(conn.sock, selectors.EVENT_WRITE, conn)
            return
        except BlockingIOError:
            return
        except (OSError, ValueError):  # a reset, plain HTTP on TLS, a refused certificate
            with self._lock:
                self._close(conn)
            return
        self._selector.unregister(conn.sock)
        with self._lock:
            conn.answering = True
        self._answers.put(conn)

    def _reap(self, now: float) -> None:
        with self._lock:
            late = [c for c in self._conns if c.deadline <= now and not c.dropped]
            for conn in late:
                self._drop(conn, "deadline")

    def _drop(self, conn: _Connection, reason: str) -> None:
        """End ``conn`` for the server's reason (under the lock, in the accept loop): one still
        sending is closed here; one being answered is shut down, its worker then closes it."""
        self.dropped[reason] += 1
        conn.dropped = True
        if not conn.answering:
            self._close(conn)
            return
        # The socket's own shutdown: SSLSocket's would tear its TLS state from the writer.
        with contextlib.suppress(OSError):
            socket.socket.shutdown(conn.sock, socket.SHUT_RDWR)

    def _close(self, conn: _Connection) -> None:
        """Close ``conn`` once (under the lock)."""
        if conn.closed:
            return
        conn.closed = True
        self._conns.discard(conn)
        if not conn.answering:
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(conn.sock)
        conn.sock.close()

    def _work(self) -> None:
        while True:
            conn = self._answers.get()
            if conn is None:
                return
            try:
                self._answer(conn)
            finally:
                with self._lock:
                    self._close(conn)

    def _answer(self, conn: _Connection) -> None:
        left = conn.deadline - time.monotonic()
        if left <= 0 or conn.dropped:
            with self._lock:  # it waited for a worker past its deadline
                if not conn.dropped:
                    conn.dropped = True
                    self.dropped["deadline"] += 1
            return
        try:
            conn.sock.settimeout(left)  # each send bounded; the reaper bounds them all
            _Handler(conn.sock, conn.address, self, bytes(conn.head))
            conn.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the client went away, or was too slow to take the answer
        except Exception:
            self.handle_error(conn.sock, conn.address)


def serve(
    host: str, port: int, app: WsgiApp, web: WebConfig | None = None
) -> tuple[_Server, threading.Thread]:
    """Bind ``host:port`` and serve ``app`` (behind TLS and basic auth if ``web`` says so)
    from a daemon thread, its HTTP_WORKERS threads started now. OSError when the address does
    not resolve or cannot be bound; RuntimeError when a thread cannot start."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, sockaddr = infos[0]

    class Server(_Server):
        address_family = family
        request_queue_size = listen_backlog()  # what server_activate passes to listen(2)

    if web is not None and web.users:
        app = with_basic_auth(app, BasicAuth(web.users))
    httpd = Server((str(sockaddr[0]), port), WSGIRequestHandler)  # unused: _work answers
    httpd.set_app(app)
    if web is not None and web.tls is not None:
        Server.tls = web.tls.context()
    thread = threading.Thread(target=httpd.serve_forever, name="metrics-http", daemon=True)
    try:
        httpd.start_workers()
        thread.start()
    except BaseException:
        httpd.server_close()
        raise
    return httpd, thread
