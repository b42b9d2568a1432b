"""The web config (TLS and basic auth for /metrics): parsing, the auth check, the server.

No root needed: a throwaway certificate from openssl, a server on a free loopback port.
"""

from __future__ import annotations

import base64
import contextlib
import shutil
import socket
import ssl
import struct
import subprocess
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import bcrypt
import pytest

from agent.errors import UsageError
from agent.export.webconfig import (
    HTTP_WORKERS,
    BasicAuth,
    _Server,
    listen_backlog,
    load,
    parse,
    serve,
    with_basic_auth,
)

PASSWORD = b"s3cret-scrape"
HASH = bcrypt.hashpw(PASSWORD, bcrypt.gensalt(rounds=4)).decode()


def basic(user: str, password: bytes) -> str:
    return "Basic " + base64.b64encode(user.encode() + b":" + password).decode()


OPENSSL_REQ = [
    "openssl",
    "req",
    "-x509",
    "-newkey",
    "rsa:2048",
    "-nodes",
    "-days",
    "1",
    "-subj",
    "/CN=localhost",
]


def make_cert(d: Path) -> tuple[Path, Path]:
    """A throwaway self-signed certificate for 127.0.0.1 and localhost, and its key."""
    cert, key = d / "tls.crt", d / "tls.key"
    san = "subjectAltName=IP:127.0.0.1,DNS:localhost"
    cmd = [*OPENSSL_REQ, "-addext", san, "-keyout", str(key), "-out", str(cert)]
    subprocess.run(cmd, check=True, capture_output=True)
    return cert, key


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    d = tmp_path_factory.mktemp("certs")
    make_cert(d)
    return d


# --- parsing --------------------------------------------------------------------------------


def test_a_full_web_config_loads(certs: Path) -> None:
    path = certs / "web.yml"
    path.write_text(
        "tls_server_config:\n  cert_file: tls.crt\n  key_file: tls.key\n"
        "  min_version: TLS13\n"
        f"basic_auth_users:\n  prometheus: '{HASH}'\n"
    )
    web = load(str(path))
    assert web.tls is not None and web.tls.cert_file == str(certs / "tls.crt")  # relative
    assert web.tls.min_version == ssl.TLSVersion.TLSv1_3
    assert web.users == {"prometheus": HASH.encode()}


def test_a_key_file_others_may_write_is_refused_and_named(certs: Path, tmp_path: Path) -> None:
    """The key the agent serves with, and the web config naming it, are root's alone."""
    shutil.copy(certs / "tls.crt", tmp_path / "tls.crt")
    shutil.copy(certs / "tls.key", tmp_path / "tls.key")
    path = tmp_path / "web.yml"
    path.write_text("tls_server_config:\n  cert_file: tls.crt\n  key_file: tls.key\n")
    (tmp_path / "tls.key").chmod(0o662)
    with pytest.raises(UsageError) as e:
        load(str(path))
    assert "tls_server_config.key_file" in str(e.value)
    assert f"{tmp_path / 'tls.key'} is writable by others" in str(e.value)
    (tmp_path / "tls.key").chmod(0o600)
    path.chmod(0o646)
    with pytest.raises(UsageError, match=r"web config .*web\.yml is writable by others"):
        load(str(path))
    path.chmod(0o644)
    assert load(str(path)).tls is not None


def test_an_empty_web_config_is_plain_http() -> None:
    web = parse("", "web.yml")
    assert web.tls is None and not web.users


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("tls_server_config: {cert_file: tls.crt, key_file: tls.key}\nbasic_auth: {}", "basic_auth: unknown key (did you mean 'basic_auth_users'?)"),
        ("tls_server_config: {cert: tls.crt, key_file: tls.key}", "tls_server_config.cert: unknown key (did you mean 'cert_file'?)"),
        ("tls_server_config: {key_file: tls.key}", "tls_server_config.cert_file: want a file name"),
        ("tls_server_config: {cert_file: nope.crt, key_file: tls.key}", "cert_file: 'nope.crt' is not a readable file"),
        ("tls_server_config: {cert_file: tls.crt, key_file: tls.crt}", "cannot load cert_file"),
        ("tls_server_config: {cert_file: tls.key, key_file: tls.key}", "cannot load cert_file"),
        ("tls_server_config: {cert_file: tls.crt, key_file: tls.key, client_auth_type: Maybe}", "client_auth_type: 'Maybe' is not one of"),
        ("tls_server_config: {cert_file: tls.crt, key_file: tls.key, client_auth_type: RequireAndVerifyClientCert}", "client_ca_file: RequireAndVerifyClientCert needs"),
        ("tls_server_config: {cert_file: tls.crt, key_file: tls.key, client_ca_file: tls.crt}", "client certificates are not checked"),
        ("tls_server_config: {cert_file: tls.crt, key_file: tls.key, client_auth_type: RequireAndVerifyClientCert, client_ca_file: tls.key}", "client_ca_file: cannot load"),
        ("tls_server_config: {cert_file: tls.crt, key_file: tls.key, min_version: TLS10}", "min_version: 'TLS10' is not one of"),
        ("tls_server_config: {cert_file: tls.crt, key_file: tls.key, cipher_suites: [x]}", "cipher_suites: not supported by hangwatch"),
        ("http_server_config: {http2: false}", "http_server_config: not supported"),
        ("tls_server_config: [a]", "tls_server_config: want a mapping"),
        ("basic_auth_users: {}", "basic_auth_users: empty"),
        ("basic_auth_users: {prometheus: hunter2}", "basic_auth_users.prometheus: want a bcrypt hash"),
        ("basic_auth_users: {prometheus: '$2y$31$abcdefghijklmnopqrstuuabcdefghijklmnopqrstuvwxyzABCDE'}", "want a bcrypt hash of cost 4-15"),
        ("basic_auth_users: {'a:b': x}", "'a:b' is not a user name"),
        ("- a list", "(top level): want a mapping"),
        ("basic_auth_users: {a: [1", "not valid YAML"),
    ],
)  # fmt: skip
def test_bad_web_config_names_the_key(certs: Path, text: str, names: str) -> None:
    with pytest.raises(UsageError) as e:
        parse(text, "web.yml", str(certs))
    msg = str(e.value)
    assert msg.startswith("web config web.yml: "), msg
    assert names in msg, msg
    assert "\n" not in msg and e.value.exit_code == 2


def test_an_encrypted_key_is_refused_without_a_prompt(certs: Path) -> None:
    key, encrypted = str(certs / "tls.key"), str(certs / "enc.key")
    cmd = ["openssl", "pkey", "-in", key, "-aes256", "-passout", "pass:x", "-out", encrypted]
    subprocess.run(cmd, check=True, capture_output=True)
    with pytest.raises(UsageError, match="cannot load cert_file"):
        parse("tls_server_config: {cert_file: tls.crt, key_file: enc.key}", "w", str(certs))


def test_a_missing_file_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="cannot read it"):
        load(str(tmp_path / "nope.yml"))


# --- basic auth -----------------------------------------------------------------------------


def test_basic_auth_checks_user_and_password() -> None:
    auth = BasicAuth({"prometheus": HASH.encode()})
    assert auth.allowed(basic("prometheus", PASSWORD))
    assert auth.allowed(basic("prometheus", PASSWORD))  # the cached path
    assert not auth.allowed(basic("prometheus", b"wrong"))
    assert not auth.allowed(basic("grafana", PASSWORD))
    assert not auth.allowed(basic("prometheus", PASSWORD + b"x"))
    for header in [None, "", "Basic", "Basic !!!", "Bearer abc", "Basic " + "eA==", "Basic /w=="]:
        assert not auth.allowed(header), header
    assert not auth.allowed("Basic " + base64.b64encode(b"prometheus:\0").decode())


def test_unknown_user_costs_a_bcrypt_round_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """No shortcut that would tell an unknown user from a wrong password by timing: each
    costs one bcrypt check at the users' cost. Counted, not timed, so a busy machine cannot
    fail it and a shortcut cannot hide in the noise."""
    slow = bcrypt.hashpw(PASSWORD, bcrypt.gensalt(rounds=10))
    auth = BasicAuth({"prometheus": slow})
    costs: list[bytes] = []
    real = bcrypt.checkpw

    def checkpw(password: bytes, hashed: bytes) -> bool:
        costs.append(hashed[:7])  # "$2b$10$": the variant and the cost
        return real(password, hashed)

    monkeypatch.setattr(bcrypt, "checkpw", checkpw)
    assert not auth.allowed(basic("prometheus", b"nope"))
    assert not auth.allowed(basic("nobody", b"nope"))
    assert costs == [slow[:7], slow[:7]], costs


def test_the_wsgi_wrapper_answers_401_with_a_challenge() -> None:
    calls = []

    def app(environ, start_response):
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"metrics\n"]

    def start_response(status, headers):
        calls.append((status, dict(headers)))

    wrapped = with_basic_auth(app, BasicAuth({"prometheus": HASH.encode()}))
    assert wrapped({"HTTP_AUTHORIZATION": basic("prometheus", PASSWORD)}, start_response) == [
        b"metrics\n"
    ]
    assert calls[-1][0] == "200 OK"
    body = wrapped({}, start_response)
    status, headers = calls[-1]
    assert status == "401 Unauthorized" and b"metrics" not in b"".join(body)
    assert headers["WWW-Authenticate"].startswith('Basic realm="hangwatch"')


# --- the server -----------------------------------------------------------------------------


def _app(environ, start_response):
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"hangwatch_up 1\n"]


TCP_LISTEN = 10


def kernel_backlog(port: int) -> int:
    """The backlog the kernel keeps for the TCP socket listening on 127.0.0.1:``port``, read
    back as `ss -ltn` reads it (its Send-Q): sock_diag's idiag_wqueue, which for a listening
    socket is sk_max_ack_backlog. /proc/net/tcp does not show it (its tx_queue is 0 there)."""
    netlink_sock_diag, sock_diag_by_family, nlmsg_done, nlmsg_error = 4, 20, 3, 2
    # struct inet_diag_req_v2: all IPv4 TCP sockets in LISTEN (a dump ignores its sockid).
    req = struct.pack("=BBBxI48x", socket.AF_INET, socket.IPPROTO_TCP, 0, 1 << TCP_LISTEN)
    flags = 0x1 | 0x300  # NLM_F_REQUEST | NLM_F_DUMP
    msg = struct.pack("=IHHII", 16 + len(req), sock_diag_by_family, flags, 1, 0) + req
    found: list[int] = []
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, netlink_sock_diag) as nl:
        nl.sendall(msg)
        while True:
            data, at = nl.recv(1 << 16), 0
            while at + 16 <= len(data):
                length, kind = struct.unpack_from("=IH", data, at)
                if kind == nlmsg_done:
                    assert found, f"no socket listens on 127.0.0.1:{port}"
                    return found[0]
                assert kind != nlmsg_error and length >= 16, f"sock_diag answered type {kind}"
                # struct inet_diag_msg: family, state, timer, retrans; sockid (sport, dport
                # big-endian, src[16], dst[16], if, cookie[2]); expires, rqueue, wqueue, ...
                body = at + 16
                sport, _dport, src = struct.unpack_from(">HH4s", data, body + 4)
                (wqueue,) = struct.unpack_from("=I", data, body + 60)
                if sport == port and src == socket.inet_aton("127.0.0.1"):
                    found.append(wqueue)
                at += (length + 3) & ~3


def test_the_backlog_is_the_kernels_somaxconn(tmp_path: Path) -> None:
    """Go's rule (node_exporter's): net.core.somaxconn, capped at 16 bits, never 5."""
    f = tmp_path / "somaxconn"
    for text, want in [
        ("4096\n", 4096),
        ("128", 128),
        ("100000\n", 0xFFFF),
        ("0\n", socket.SOMAXCONN),
        ("", socket.SOMAXCONN),
        ("lots\n", socket.SOMAXCONN),
    ]:
        f.write_text(text)
        assert listen_backlog(str(f)) == want, text
    assert listen_backlog(str(tmp_path / "missing")) == socket.SOMAXCONN


def test_the_server_listens_with_the_kernels_backlog() -> None:
    """Read back from the kernel: a burst of concurrent scrapes waits in this queue. The
    standard library's 5 overflowed at 200 concurrent scrapes (SYN cookies, then scrapes
    that never got an answer): a regression shows here, not as a flaky storm test."""
    somaxconn = int(Path("/proc/sys/net/core/somaxconn").read_text())
    httpd, _ = serve("127.0.0.1", 0, _app)
    try:
        port = httpd.server_address[1]
        assert listen_backlog() == min(somaxconn, 0xFFFF)
        assert kernel_backlog(port) == listen_backlog(), (kernel_backlog(port), somaxconn)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            assert r.read() == b"hangwatch_up 1\n"  # and it serves
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_server_with_tls_and_basic_auth(certs: Path) -> None:
    web = parse(
        f"tls_server_config: {{cert_file: tls.crt, key_file: tls.key}}\n"
        f"basic_auth_users: {{prometheus: '{HASH}'}}\n",
        "web.yml",
        str(certs),
    )
    httpd, _ = serve("127.0.0.1", 0, _app, web)
    port = httpd.server_address[1]
    ctx = ssl.create_default_context(cafile=str(certs / "tls.crt"))
    url = f"https://127.0.0.1:{port}/metrics"
    try:
        req = urllib.request.Request(url, headers={"Authorization": basic("prometheus", PASSWORD)})
        with urllib.request.urlopen(req, context=ctx, timeout=5) as r:
            assert r.read() == b"hangwatch_up 1\n"
        for headers in ({}, {"Authorization": basic("prometheus", b"wrong")}):
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(
                    urllib.request.Request(url, headers=headers), context=ctx, timeout=5
                )
            assert e.value.code == 401
        with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
        # A client that connects and never says anything does not block the next scrape.
        import socket

        with socket.create_connection(("127.0.0.1", port)):
            req = urllib.request.Request(
                url, headers={"Authorization": basic("prometheus", PASSWORD)}
            )
            with urllib.request.urlopen(req, context=ctx, timeout=5) as r:
                assert r.status == 200
    finally:
        httpd.shutdown()
        httpd.server_close()


# --- the server's caps: threads, connections, a deadline per connection ----------------------


@contextlib.contextmanager
def capped_server(
    monkeypatch: pytest.MonkeyPatch, app=_app, deadline_s: float = 30.0, max_connections: int = 256
) -> Iterator[tuple[_Server, int]]:
    monkeypatch.setattr(_Server, "deadline_s", deadline_s)
    monkeypatch.setattr(_Server, "max_connections", max_connections)
    httpd, _ = serve("127.0.0.1", 0, app)
    try:
        yield httpd, httpd.server_address[1]
    finally:
        httpd.shutdown()
        httpd.server_close()


def scrape_body(port: int) -> bytes:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read()


def trickling(port: int, n: int) -> list[socket.socket]:
    """``n`` connections that each sent the first byte of a request and nothing more."""
    out = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(b"G")
        out.append(s)
    return out


def closed_by_server(s: socket.socket, timeout: float = 5) -> bool:
    s.settimeout(timeout)
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_held_connections_cost_no_thread_and_scrapes_get_through(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The answering threads start with the server; 100 connections that never finish their
    request start none, and a scrape among them is answered."""
    before = set(threading.enumerate())
    with capped_server(monkeypatch) as (httpd, port):
        started = set(threading.enumerate()) - before
        assert len(started) == HTTP_WORKERS + 1  # and the accept loop
        held = trickling(port, 100)
        try:
            assert scrape_body(port) == b"hangwatch_up 1\n"
            assert set(threading.enumerate()) - before == started
        finally:
            for s in held:
                s.close()
        assert httpd.dropped_total() == {"deadline": 0, "evicted": 0, "full": 0}


def test_a_client_that_trickles_its_request_is_dropped_at_its_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The deadline is the connection's, not each receive's: a byte every 0.1 s does not
    keep a 1 s connection open."""
    with capped_server(monkeypatch, deadline_s=1.0) as (httpd, port):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        request = b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 1000
        closed = False
        for i in range(100):  # 10 s of trickling if it were never dropped
            try:
                s.sendall(request[i : i + 1])
            except OSError:
                closed = True
                break
            if closed_by_server(s, timeout=0.1):
                closed = True
                break
        s.close()
        assert closed and httpd.dropped_total()["deadline"] == 1


def test_at_the_cap_the_oldest_connection_still_sending_makes_room(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with capped_server(monkeypatch, max_connections=3) as (httpd, port):
        held = trickling(port, 3)
        try:
            assert scrape_body(port) == b"hangwatch_up 1\n"  # the fourth: the oldest goes
            assert closed_by_server(held[0])
            assert httpd.dropped_total()["evicted"] == 1
        finally:
            for s in held:
                s.close()


def test_at_the_cap_with_every_request_sent_a_newcomer_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Requests already sent are answered first: the connection beyond the cap is closed at
    once, and counted."""
    release, answering = threading.Event(), threading.Event()

    def slow_app(environ, start_response):
        answering.set()
        release.wait(10)
        return _app(environ, start_response)

    with capped_server(monkeypatch, app=slow_app, max_connections=1) as (httpd, port):
        first = socket.create_connection(("127.0.0.1", port), timeout=5)
        first.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
        try:
            assert answering.wait(5)
            with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                assert closed_by_server(s)
            assert httpd.dropped_total() == {"deadline": 0, "evicted": 0, "full": 1}
        finally:
            release.set()
            first.settimeout(5)
            assert first.makefile("rb").read().endswith(b"hangwatch_up 1\n")
            first.close()


def test_a_port_in_use_is_an_oserror_and_leaves_no_thread() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        before = set(threading.enumerate())
        with pytest.raises(OSError):
            serve("127.0.0.1", taken.getsockname()[1], _app)
        assert not set(threading.enumerate()) - before
