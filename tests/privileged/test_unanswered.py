"""End to end: a request accepted and never answered makes a quiet server stalled, not idle.

The hung_http fixture answers ``GET /`` on a keep-alive connection and blocks forever on
``GET /hang``. This test process is the client (outside the service, so the port is a front
door). Evidence: the server socket's tcp_info (data received after the last data sent),
read by the agent over inet_diag netlink.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Callable

from scripts.fixturelib import Fixture
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
        run.wait_stderr("watching", 60)
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
