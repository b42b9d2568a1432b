"""TLS and basic auth for /metrics, from a web config file in the Prometheus exporter format.

    tls_server_config:
      cert_file: /etc/hangwatch/tls.crt
      key_file: /etc/hangwatch/tls.key
      client_auth_type: RequireAndVerifyClientCert   # optional
      client_ca_file: /etc/hangwatch/clients-ca.crt  # with a client_auth_type that verifies
      min_version: TLS12                             # optional: TLS12 (default) or TLS13
    basic_auth_users:
      prometheus: $2y$10$...                         # bcrypt hash (htpasswd -nBC 10 "" | tr -d ':')

The file is validated completely, certificates and keys loaded and hashes checked, before the
daemon binds or attaches anything: a bad one is a UsageError (exit 2) that names the key.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import re
import socket
import ssl
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import yaml

from ..config import check_trusted, unknown_key
from ..errors import UsageError, show

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
REQUEST_TIMEOUT_S = 30.0  # a client that stalls in the handshake or the request is dropped
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
    timeout = REQUEST_TIMEOUT_S  # per connection: a stalled client cannot hold a thread

    def log_message(self, format: str, *args: Any) -> None:
        """No access log: scrapes every few seconds would drown the state changes."""


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    tls: ssl.SSLContext | None = None

    def finish_request(self, request: Any, client_address: Any) -> None:
        # The TLS handshake runs here, in the connection's own thread, not in the accept
        # loop: a client that never completes it cannot block every other scrape.
        if self.tls is None:
            super().finish_request(request, client_address)
            return
        request.settimeout(REQUEST_TIMEOUT_S)
        try:
            conn = self.tls.wrap_socket(request, server_side=True)
        except (OSError, ssl.SSLError):
            return  # plain HTTP, a client certificate refused, a reset: drop it
        try:
            super().finish_request(conn, client_address)
        finally:
            conn.close()


def serve(
    host: str, port: int, app: WsgiApp, web: WebConfig | None = None
) -> tuple[WSGIServer, threading.Thread]:
    """Bind ``host:port`` and serve ``app`` (behind TLS and basic auth if ``web`` says so)
    from a daemon thread. OSError when the address does not resolve or cannot be bound."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, sockaddr = infos[0]

    class Server(_Server):
        address_family = family
        request_queue_size = listen_backlog()  # what server_activate passes to listen(2)

    if web is not None and web.users:
        app = with_basic_auth(app, BasicAuth(web.users))
    httpd = make_server(str(sockaddr[0]), port, app, Server, handler_class=_Handler)
    if web is not None and web.tls is not None:
        Server.tls = web.tls.context()
    thread = threading.Thread(target=httpd.serve_forever, name="metrics-http", daemon=True)
    thread.start()
    return httpd, thread
