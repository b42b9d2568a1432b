"""End to end: `hangwatch status` reads a real daemon's verdicts and history from its status
socket (root, a member of its group, and nobody else), survives clients that send nothing,
too much or too often, and `diagnose` judges with the daemon's history of a stream that hung
before it attached.
"""

from __future__ import annotations

import contextlib
import grp
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from scripts.daemonproc import free_port
from scripts.fixturelib import AS_NOBODY, REPO_ROOT, Fixture
from tests.limits import HANG_S
from tests.privileged.daemonlib import INTERVAL, Samples, running_daemon, value, wait_until
from tests.privileged.harness import Diagnosis


@contextlib.contextmanager
def temp_group() -> Iterator[tuple[str, int]]:
    """A system group made for the test, and removed after it."""
    name = "hwt" + uuid.uuid4().hex[:8]
    subprocess.run(["groupadd", "--system", name], check=True)
    try:
        yield name, grp.getgrnam(name).gr_gid
    finally:
        subprocess.run(["groupdel", name], check=False)


@contextlib.contextmanager
def socket_dir() -> Iterator[Path]:
    """A directory others may pass through (pytest's tmp_path is 0700: nobody could reach
    the socket at all, whatever its mode)."""
    d = Path(tempfile.mkdtemp(prefix="hw-status-"))
    d.chmod(0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _config(path: Path, port: int, sock: Path, group: str, targets: str) -> Path:
    path.write_text(
        f'listen: "127.0.0.1:{port}"\ninterval_seconds: {INTERVAL}\n'
        f"park_threshold_seconds: 1\nstatus_socket: {str(sock)!r}\n"
        f"status_group: {group}\ntargets:\n{targets}"
    )
    return path


def status(*args: str, wrap: tuple[str, ...] = (), timeout: float = 30):
    return subprocess.run(
        [*wrap, sys.executable, "-m", "agent", "status", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
    )


def _explain(r: subprocess.CompletedProcess[str], log: str = "") -> str:
    return f"exit {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}\nlog:\n{log[-4000:]}"


def _targets(**pids: int) -> str:
    """Targets by pid: the host may run the same fixtures for another test meanwhile."""
    return "".join(f"  - name: {name}\n    pids: [{pid}]\n" for name, pid in pids.items())


def test_status_from_a_real_daemon(tmp_path: Path) -> None:
    port = free_port()
    with temp_group() as (group, gid), socket_dir() as d:
        sock = d / "status.sock"
        with (
            Fixture.c("deadlock_mutex") as abba,
            Fixture.py("idle_http", "--port", free_port()) as idle,
        ):
            targets = _targets(abba=abba.pid, **{"idle-http": idle.pid})
            cfg = _config(tmp_path / "hangwatch.yaml", port, sock, group, targets)
            with running_daemon(cfg, port) as daemon:
                _check_status(daemon, sock, group, gid, abba.pid, idle.pid)
        assert not sock.exists(), "the socket file outlives the daemon"
    r = status("--socket", str(sock))
    assert r.returncode == 4, _explain(r)
    assert f"no hangwatch daemon answers at {sock}" in r.stderr, r.stderr
    assert "systemctl start hangwatch" in r.stderr


def _check_status(daemon, sock: Path, group: str, gid: int, abba: int, idle: int) -> None:
    wait_until(
        daemon,
        lambda s: (
            value(s, "hangwatch_service_state", service="abba", state="deadlocked") == 1
            and value(s, "hangwatch_service_state", service="idle-http", state="idle") == 1
        ),
        "the ABBA fixture deadlocked and the server idle",
        timeout=30,
    )
    st = sock.stat()
    assert stat.S_ISSOCK(st.st_mode) and st.st_mode & 0o777 == 0o660
    assert (st.st_uid, st.st_gid) == (0, gid)
    assert sock.parent.stat().st_mode & 0o777 == 0o755

    # Root: every service, with since when and how it got there.
    r = status("--json", "--socket", str(sock))
    assert r.returncode == 0, _explain(r, daemon.output())
    doc = json.loads(r.stdout)
    assert doc["version"] == 1 and doc["daemon"]["pid"] == daemon.pid
    by = {s["service"]: s for s in doc["services"]}
    assert by["abba"]["state"] == "deadlocked" and by["abba"]["pid"] == abba
    assert by["idle-http"]["state"] == "idle" and by["idle-http"]["pid"] == idle
    for s in by.values():
        assert s["since"] and s["seconds_in_state"] >= 0 and s["reasons"]
        assert s["changes"] and s["changes"][-1]["new"] == s["state"]
    assert by["abba"]["cycles"], _explain(r)

    # Text, one service by a pid of it.
    r = status("--pid", str(abba), "--socket", str(sock))
    assert r.returncode == 0, _explain(r)
    assert f"service abba (pid {abba}): DEADLOCKED since " in r.stdout, r.stdout
    assert "changes (last" in r.stdout and "-> deadlocked" in r.stdout, r.stdout

    # A pid the daemon does not watch: named, with what it watches.
    r = status("--pid", str(os.getpid()), "--socket", str(sock))
    assert r.returncode == 2, _explain(r)
    assert f"pid {os.getpid()} is not watched" in r.stderr
    assert f"service abba pid {abba}" in r.stderr, r.stderr

    # nobody, outside the group: refused, with the fix.
    r = status("--socket", str(sock), wrap=tuple(AS_NOBODY))
    assert r.returncode == 3, _explain(r)
    assert f"{sock} refused access to uid 65534" in r.stderr, r.stderr
    assert f"usermod -aG {group} " in r.stderr, r.stderr

    # nobody in the group: it works without root.
    member = ("setpriv", "--reuid=65534", "--regid=65534", f"--groups={gid}")
    r = status("--json", "--socket", str(sock), wrap=member)
    assert r.returncode == 0, _explain(r, daemon.output())
    assert {s["service"] for s in json.loads(r.stdout)["services"]} == {"abba", "idle-http"}

    _bad_clients_stall_nothing(daemon, sock)


def _last_tick(daemon) -> float:
    s = daemon.scrape()
    assert s is not None
    return value(s, "hangwatch_last_tick_timestamp_seconds") or 0.0


def _bad_clients_stall_nothing(daemon, sock: Path) -> None:
    """Clients that connect and say nothing, one that sends 1 MB, and more connections than
    the server serves at once: the loop ticks on and a well-behaved client is answered."""
    silent = []
    for _ in range(20):
        c = socket.socket(socket.AF_UNIX)
        c.connect(str(sock))
        silent.append(c)

    def greedy() -> None:
        with socket.socket(socket.AF_UNIX) as c, contextlib.suppress(OSError):
            c.settimeout(10)
            c.connect(str(sock))
            c.sendall(b"x" * (1 << 20))
            c.recv(4096)

    g = threading.Thread(target=greedy)
    g.start()
    before = _last_tick(daemon)

    def ticked(s: Samples) -> bool:
        return (value(s, "hangwatch_last_tick_timestamp_seconds") or 0.0) > before

    wait_until(daemon, ticked, "a tick while clients misbehave")
    # The server's own signal that the silent ones and the greedy one are past their deadline:
    # it closes them (those past its cap are told busy and closed at once). Then a client is
    # answered.
    for c in silent:
        c.settimeout(HANG_S)
        with contextlib.suppress(ConnectionResetError):
            while c.recv(4096):
                pass
    g.join(HANG_S)
    r = status("--json", "--socket", str(sock), "--timeout", "5")
    assert r.returncode == 0, _explain(r, daemon.output())
    for c in silent:
        c.close()
    assert daemon.running()


def test_diagnose_takes_the_daemons_history_of_a_stream_hung_before_it(tmp_path: Path) -> None:
    """A streamed answer hangs mid-way while only the daemon watches: diagnose, attached
    after, sees no write of it and the socket's counters call it answered (idle); with the
    daemon's socket it reports stalled, naming the daemon as the source. Without it, it
    says what it could not see."""
    port, door = free_port(), free_port()
    # Its own fixture, by its port: other tests run hung_http beside this one.
    targets = f'  - name: hung-http\n    cmdline: "fixtures/hung_http\\\\.py --port {door}$"\n'
    with temp_group() as (group, _gid), socket_dir() as d:
        sock = d / "status.sock"
        cfg = _config(tmp_path / "hangwatch.yaml", port, sock, group, targets)
        with running_daemon(cfg, port) as daemon, Fixture.py("hung_http", "--port", door) as fx:
            svc = {"service": "hung-http"}
            wait_until(
                daemon,
                lambda s: value(s, "hangwatch_service_state", state="idle", **svc) == 1,
                "the server watched, idle",
            )
            with socket.create_connection(("127.0.0.1", door)) as client:
                client.sendall(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
                fx.wait_for("HANGING")
                got = b""
                while got.count(b"data: ") < 2:
                    got += client.recv(4096)
                wait_until(
                    daemon,
                    lambda s: value(s, "hangwatch_service_state", state="stalled", **svc) == 1,
                    "the daemon calls the hung stream stalled",
                )
                with_daemon = _diagnose(fx.pid, str(sock))
                alone = _diagnose(fx.pid, str(d / "none.sock"))
    s = with_daemon.service(fx.pid)
    assert s["state"] == "stalled", with_daemon.explain("want the daemon's stall")
    assert s["reasons"][0].startswith(f"the daemon (pid {daemon.pid}) saw 1 streamed answer")
    assert s["evidence"][0]["source"] == "daemon" and s["evidence"][0]["judged"] is True
    assert all(e["source"] == "window" for e in s["evidence"][1:])
    assert s["daemon_history"]["seen"] is True

    a = alone.service(fx.pid)
    assert a["state"] == "idle", alone.explain("the window alone sees no stream")
    assert a["daemon_history"]["seen"] is False
    assert a["daemon_history"]["note"].startswith("no daemon history: requests or streams")


def _diagnose(pid: int, sock: str) -> Diagnosis:
    argv = [sys.executable, "-m", "agent", "diagnose", "--pid", str(pid), "--json"]
    argv += ["--threshold", "1", "--duration", "2", "--socket", sock, "--no-stacks"]
    t0 = time.monotonic()
    r = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=HANG_S)
    return Diagnosis(argv, r.returncode, r.stdout, r.stderr, time.monotonic() - t0)
