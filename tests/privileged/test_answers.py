"""Answers to clients are progress, whatever becomes of the connection after.

Python's own ``python -m http.server`` answers a client every 0.2 s: with a new connection
per request (as curl and health checkers do; the fd is closed before the next tick can name
it) and with one kept-alive connection. Both must read progressing, from ``diagnose`` and
from the daemon; the same server with no client reads idle. Its access log (a line on stderr
per request) is the only other write it makes: without the answers counted when they are
written, that log looks like a heartbeat and the server reads idle.
"""

from __future__ import annotations

import http.client
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from scripts.daemonproc import free_port
from tests.privileged.daemonlib import Samples, running_daemon, value, wait_until
from tests.privileged.harness import Diagnosis

# one worker: its daemon selects servers by names this module's other test uses
pytestmark = pytest.mark.xdist_group("privileged-answers")

Diagnose = Callable[..., Diagnosis]
PERIOD_S = 0.2  # a request every 0.2 s
THRESHOLD = 2
DURATION = 3


@contextmanager
def http_server(root: Path, name: str) -> Iterator[tuple[int, int]]:
    """``python -m http.server`` on 127.0.0.1, serving a directory named ``name`` (how a
    daemon target tells the twins apart), HTTP/1.1 so a client may keep its connection.
    Its access log goes to a pipe the test drains: a log out of the service. Yields
    (pid, port)."""
    served = root / name
    served.mkdir()
    (served / "index.html").write_text("ok\n")
    port = free_port()
    argv = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"]
    argv += ["--directory", str(served), "--protocol", "HTTP/1.1"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    assert proc.stderr is not None
    err = proc.stderr
    drain = threading.Thread(target=lambda: [None for _ in iter(lambda: err.read(4096), b"")])
    drain.start()
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "no http.server"
                time.sleep(0.05)
        yield proc.pid, port
    finally:
        proc.kill()
        proc.wait()
        drain.join()


@contextmanager
def client(port: int, keep_alive: bool) -> Iterator[list[int]]:
    """GET / every PERIOD_S: a new connection per request (urllib sends ``Connection:
    close``), or one connection kept alive. Yields the count of answers received."""
    answers = [0]
    stop = threading.Event()

    def loop() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5) if keep_alive else None
        while not stop.wait(PERIOD_S):
            if conn is not None:
                conn.request("GET", "/")
                conn.getresponse().read()
            else:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5) as r:
                    r.read()
            answers[0] += 1
        if conn is not None:
            conn.close()

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    try:
        yield answers
    finally:
        stop.set()
        t.join(timeout=10)


def state(d: Diagnosis, pid: int) -> str:
    return str(d.service(pid).get("state"))


def test_diagnose_sees_answers_on_short_and_kept_connections(
    diagnose: Diagnose, tmp_path: Path
) -> None:
    with (
        http_server(tmp_path, "short") as (short, short_port),
        http_server(tmp_path, "kept") as (kept, kept_port),
        http_server(tmp_path, "nobody") as (idle, _),
        client(short_port, keep_alive=False) as short_answers,
        client(kept_port, keep_alive=True) as kept_answers,
    ):
        d = diagnose(short, kept, idle, threshold=THRESHOLD, duration=DURATION)
    assert short_answers[0] and kept_answers[0], "the clients got no answer"
    for pid, want in ((short, "progressing"), (kept, "progressing"), (idle, "idle")):
        assert state(d, pid) == want, d.explain(f"http.server {pid}: want {want}")
    # Progressing for its answers, counted as answers when they were written (not as
    # writes to an fd that could not be named by the time it was looked at).
    for pid in (short, kept):
        words = " ".join(
            str(r) for p in d.service(pid).get("processes", []) for r in p.get("reasons", [])
        )
        assert "of it answers to clients" in words, d.explain(f"{pid}: answers not counted")


def test_daemon_sees_answers_on_short_and_kept_connections(tmp_path: Path) -> None:
    port = free_port()
    cfg = tmp_path / "hangwatch.yaml"
    targets = "".join(
        f'  - name: {n}\n    cmdline: "http\\\\.server .*/{n} "\n'
        for n in ("short", "kept", "nobody")
    )
    cfg.write_text(
        f'listen: "127.0.0.1:{port}"\ninterval_seconds: 0.5\n'
        f"park_threshold_seconds: {THRESHOLD}\ntargets:\n{targets}"
    )

    def states(*want: tuple[str, str]) -> Callable[[Samples], bool]:
        return lambda s: all(
            value(s, "hangwatch_service_state", service=n, state=st) == 1 for n, st in want
        )

    with (
        running_daemon(cfg, port) as daemon,
        http_server(tmp_path, "short") as (_, short_port),
        http_server(tmp_path, "kept") as (_, kept_port),
        http_server(tmp_path, "nobody"),
        client(short_port, keep_alive=False),
        client(kept_port, keep_alive=True),
    ):
        want = (("short", "progressing"), ("kept", "progressing"), ("nobody", "idle"))
        wait_until(daemon, states(*want), "answered servers progressing, the idle one idle")
        # And it holds: a later window, still all answers.
        time.sleep(2 * THRESHOLD)
        wait_until(daemon, states(*want), "the same a few windows later")
