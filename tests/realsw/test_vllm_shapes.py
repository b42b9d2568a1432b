"""Real vLLM (``vllmlib.py``) is in the shape each verdict test claims: checked from /proc
alone, no hangwatch. One server per case group (a start takes ~30-45 s here)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from scripts.fixturelib import parent_pid, wait_until
from scripts.realsw import alive, cpu_ticks
from tests.realsw import vllmlib
from tests.realsw.serving.procview import futex_parked
from tests.realsw.vllmlib import SYS_POLL, VllmServer, vllm_ready

__all__ = ["vllm_ready"]  # the fixture, imported to be used here

# one worker: the module's servers start once
pytestmark = [pytest.mark.usefixtures("vllm_ready"), pytest.mark.xdist_group("vllm-shapes")]

SHM_WARNING = "No available shared memory broadcast block found"


@pytest.fixture(scope="module")
def run_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm-shapes")


def assert_tree(s: VllmServer) -> None:
    """API server -> EngineCore -> Worker, found by parent links; only the API server
    listens on the port we gave it."""
    assert parent_pid(s.engine) == s.pid and parent_pid(s.worker) == s.engine
    assert s.port in vllmlib.listening_ports(s.pid)
    assert vllmlib.listening_ports(s.engine) == []


def test_idle_then_serving(run_root: Path) -> None:
    with vllmlib.vllm_server(run_root / "healthy") as s:
        assert_tree(s)
        # idle: the Worker's main thread waits for work in poll(2); nothing runs for long
        wait_until(lambda: vllmlib.in_syscall(s.worker, SYS_POLL), 10, "the Worker waiting")
        ticks = [cpu_ticks(p) for p in (s.pid, s.engine, s.worker)]
        time.sleep(3)
        used = [cpu_ticks(p) - t for p, t in zip((s.pid, s.engine, s.worker), ticks)]
        assert sum(used) < 60, f"idle, yet the three processes used {used} ticks in 3 s"
        assert vllmlib.metric(vllmlib.metrics(s), "vllm:request_success_total") == 0
        # serving: answers come, and the server counts them
        with vllmlib.Continuous(s) as client:
            client.wait_answers(5)
        assert vllmlib.metric(vllmlib.metrics(s), "vllm:request_success_total") >= 5


def _hung(s: VllmServer) -> None:
    """The Worker's main thread sleeps in futex without a timeout and stays there."""
    wait_until(lambda: vllmlib.in_untimed_futex(s.worker), 10, "the Worker's main thread parked")
    first = futex_parked(s.worker, [s.worker])
    time.sleep(2)
    assert first is not None and futex_parked(s.worker, [s.worker]) == first, "it ran"


@pytest.fixture(scope="module")
def event_hang(run_root: Path) -> Iterator[VllmServer]:
    with vllmlib.vllm_server(run_root / "event") as s, vllmlib.pending(s):
        s.hang()
        s.wait_hung()
        yield s


def test_event_hang(event_hang: VllmServer) -> None:
    s = event_hang
    assert_tree(s)
    _hung(s)
    assert vllmlib.http_get(s.port, "/health")[0] == 200, "the front-end answers /health"
    hung = vllmlib.metric(vllmlib.metrics(s), "vllm:request_success_total")
    time.sleep(2)
    assert vllmlib.metric(vllmlib.metrics(s), "vllm:request_success_total") == hung


def test_event_hang_logs_shm_warning(event_hang: VllmServer) -> None:
    s = event_hang
    wait_until(lambda: SHM_WARNING in s.log_text(), 100, "the 60 s shared-memory warning", 1)
    lines = [ln for ln in s.log_text().splitlines() if SHM_WARNING in ln]
    assert any("EngineCore" in ln for ln in lines), lines
    _hung(s)


def test_event_hang_orphaned_worker(event_hang: VllmServer) -> None:
    s = event_hang
    s.kill_engine()
    wait_until(lambda: parent_pid(s.worker) != s.engine, 10, "the Worker orphaned")
    time.sleep(2)  # its death-pipe thread has seen EOF by now
    assert alive(s.worker)
    _hung(s)


def test_native_abba(run_root: Path) -> None:
    with vllmlib.vllm_server(run_root / "abba", hang="abba") as s, vllmlib.pending(s):
        s.hang()
        tids = s.wait_hung().get_ints("tids")
        assert len(tids) == 2
        _hung(s)  # the main thread joins the two
        wait_until(lambda: futex_parked(s.worker, tids), 10, "both threads in futex")
        first = futex_parked(s.worker, tids)
        time.sleep(2)
        assert futex_parked(s.worker, tids) == first, "a thread of the cycle ran"
        assert all(vllmlib.in_untimed_futex(s.worker, t) for t in tids)


def test_stream_hang(run_root: Path) -> None:
    with vllmlib.vllm_server(run_root / "stream") as s:
        s.hang(after=3)
        with vllmlib.pending(s, stream=True) as client:
            s.wait_hung()
            chunks = client.read_chunks(1)  # one: several steps' tokens may come as one chunk
            assert all(c["choices"][0]["finish_reason"] is None for c in chunks)
            _hung(s)
            # the connection is open and nothing more comes
            assert client.resp is not None and not client.resp.isclosed()
