"""End to end: a request accepted and never answered makes a quiet server stalled, not idle.

The hung_http fixture answers ``GET /`` on a keep-alive connection and blocks forever on
``GET /hang``. This test process is the client (outside the service, so the port is a front
door). Evidence: the server socket's tcp_info (data received after the last data sent),
read by the agent over inet_diag netlink.
"""

from __future__ import annotations

import re
import socket
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from scripts.fixturelib import AS_NOBODY, Fixture, tasks, thread_state, thread_syscall
from tests.limits import HANG_S
from tests.privileged.daemonlib import INTERVAL, free_port, running_daemon, value, wait_until
from tests.privileged.harness import Diagnosis, RunningDiagnose

Diagnose = Callable[..., Diagnosis]
StartDiagnose = Callable[..., RunningDiagnose]


def _get(sock: socket.socket, path: str) -> None:
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())


def test_unanswered_request_is_stalled_not_idle(diagnose: Diagnose) -> None:
    with Fixture.py("hung_http") as fx:
        port = fx.info.get_int("port")
        with socket.create_connection(("127.0.0.1", port)) as hung:
            _get(hung, "/hang")
            fx.wait_for("HANGING")
            d = diagnose(fx.pid, threshold=1, duration=3)
    svc = d.service(fx.pid)
    assert svc.get("state") == "stalled", d.explain("want stalled: a request waits for an answer")
    words = " ".join(svc.get("reasons", []))
    assert re.search(r"1 request unanswered for \d", words), d.explain("no unanswered request")


def test_answered_keep_alive_connection_stays_idle(diagnose: Diagnose) -> None:
    with Fixture.py("hung_http") as fx:
        port = fx.info.get_int("port")
        with socket.create_connection(("127.0.0.1", port)) as kept:
            _get(kept, "/")
            assert b"200" in kept.recv(4096)
            d = diagnose(fx.pid, threshold=1, duration=3)
    svc = d.service(fx.pid)
    assert svc.get("state") == "idle", d.explain("want idle: its only connection was answered")
    assert "unanswered" not in " ".join(svc.get("reasons", [])), d.explain("no request waits")


def _read_events(sock: socket.socket, count: int) -> bytes:
    got = b""
    while got.count(b"data: ") < count:
        data = sock.recv(4096)
        assert data, got
        got += data
    return got


def test_a_stream_hung_mid_answer_is_stalled_not_idle(start_diagnose: StartDiagnose) -> None:
    """``"stream": true``: the headers and two events went out after the request, so
    tcp_info alone calls it answered; the answer's framing, which the write probe keeps,
    says it is not finished. The stream starts once diagnose watches: the probe sees only
    the writes made since (a stream that hung before is the daemon's to see)."""
    with Fixture.py("hung_http") as fx:
        port = fx.info.get_int("port")
        run = start_diagnose(fx.pid, threshold=1, duration=3)
        run.wait_stderr("watching", HANG_S)
        with socket.create_connection(("127.0.0.1", port)) as client:
            _get(client, "/stream")
            fx.wait_for("HANGING")
            _read_events(client, 2)
            d = run.finish(60)
    svc = d.service(fx.pid)
    assert svc.get("state") == "stalled", d.explain("want stalled: a stream waits for its end")
    words = " ".join(svc.get("reasons", []))
    assert re.search(r"1 request unanswered for \d", words), d.explain("the stream not waiting")


def test_a_finished_stream_leaves_the_server_idle(diagnose: Diagnose) -> None:
    with Fixture.py("hung_http") as fx:
        port = fx.info.get_int("port")
        with socket.create_connection(("127.0.0.1", port)) as client:
            _get(client, "/streamed")
            assert b"data: [DONE]" in _read_events(client, 3)
            d = diagnose(fx.pid, threshold=1, duration=3)
    svc = d.service(fx.pid)
    assert svc.get("state") == "idle", d.explain("want idle: the stream ended")


# A client, run as nobody, that opens a connection, sends the start of a request and holds the
# connection open without ever finishing it (the blank line that ends the headers never comes).
HALF_CLIENT = """
import socket, sys
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
s.sendall(sys.argv[2].encode())
print("READY", flush=True)
sys.stdin.read()
"""
HALF_REQUEST = "GET / HTTP/1.1\r\nHost: x\r\n"
NOBODY = AS_NOBODY


def _half_client(port: int) -> Fixture:
    """The tenant's client: the system's Python as nobody (the tests' own may be out of its
    reach), holding a half-sent request until the test ends."""
    return Fixture([*NOBODY, "/usr/bin/python3", "-c", HALF_CLIENT, port, HALF_REQUEST])


def _reading(pid: int, timeout: float = 10) -> None:
    """Wait until one of the server's threads sleeps in recvfrom (45): it has read the
    half request and waits for the rest."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for tid in tasks(pid):
            try:
                if thread_state(pid, tid) == "S" and thread_syscall(pid, tid).split()[0] == "45":
                    return
            except OSError:
                continue  # a thread that ended between the listing and the read
        time.sleep(0.05)
    raise AssertionError(f"server {pid}: no thread reading the half-sent request")


def test_a_half_sent_request_is_the_clients_wait_not_a_stall(diagnose: Diagnose) -> None:
    """An idle server that read half a request waits for its client: it cannot answer what
    it has not been sent. Idle, with the incomplete request as a reason, never stalled."""
    with Fixture.py("idle_http") as fx, _half_client(fx.info.get_int("port")):
        _reading(fx.pid)
        d = diagnose(fx.pid, threshold=1, duration=3)
    svc = d.service(fx.pid)
    words = " ".join(svc.get("reasons", []))
    assert svc.get("state") == "idle", d.explain("want idle: the request is the client's to end")
    assert re.search(r"1 request incomplete from the client for \d", words), d.explain("no reason")
    assert "unanswered" not in words, d.explain("a half request counted as unanswered")


def test_a_whole_request_beside_a_half_one_still_stalls(diagnose: Diagnose) -> None:
    """The same half request, to a server that also holds a whole request it never answers:
    stalled, on the whole request alone."""
    with Fixture.py("hung_http") as fx:
        port = fx.info.get_int("port")
        with _half_client(port), socket.create_connection(("127.0.0.1", port)) as hung:
            _reading(fx.pid)
            _get(hung, "/hang")
            fx.wait_for("HANGING")
            d = diagnose(fx.pid, threshold=1, duration=3)
    svc = d.service(fx.pid)
    words = " ".join(svc.get("reasons", []))
    assert svc.get("state") == "stalled", d.explain("want stalled: a whole request waits")
    assert re.search(r"1 request unanswered for \d", words), d.explain("not the one request")


@pytest.mark.serial  # its daemon selects idle_http.py by name: every copy on the host
def test_the_daemon_keeps_a_server_with_a_half_sent_request_idle(tmp_path: Path) -> None:
    """The daemon, threshold 1 s: the same half request, held past the threshold by a
    client run as nobody. The service stays idle with nothing unanswered; before, it turned
    stalled once the request was older than the threshold."""
    port = free_port()
    cfg = tmp_path / "hangwatch.yaml"
    cfg.write_text(
        f'listen: "127.0.0.1:{port}"\ninterval_seconds: {INTERVAL}\n'
        "park_threshold_seconds: 1\ntargets:\n"
        '  - name: idle-http\n    cmdline: "fixtures/idle_http\\\\.py"\n'
    )
    svc = {"service": "idle-http"}
    with (
        running_daemon(cfg, port) as d,
        Fixture.py("idle_http") as fx,
        _half_client(fx.info.get_int("port")),
    ):
        _reading(fx.pid)
        # Well past the threshold: the half request is older, the server parked longer.
        s = wait_until(
            d,
            lambda s: (value(s, "hangwatch_service_seconds_since_progress", **svc) or 0) > 3,
            "the server parked for 3 s with the half request held",
        )
        assert value(s, "hangwatch_service_state", state="idle", **svc) == 1, d.output()[-3000:]
        assert value(s, "hangwatch_service_unanswered_requests", **svc) == 0
