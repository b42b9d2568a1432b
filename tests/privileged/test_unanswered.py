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
from tests.privileged.harness import Diagnosis

Diagnose = Callable[..., Diagnosis]


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
