"""Real SGLang (``sglanglib.py``) is in the shape each verdict test claims: checked from /proc
alone, no hangwatch. One default server is shared, in file order (a start takes 30 s to
several minutes here): idle, serving, an Event hang (released), a stream hang (released), and
last the detokenizer killed; --sleep-on-idle, the lock cycle and loading get servers of their
own."""

from __future__ import annotations

import http.client
import select
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from scripts.fixturelib import parent_pid, thread_cpu_ticks, wait_until
from scripts.realsw import alive, descendants
from tests.limits import HANG_S
from tests.realsw import sglanglib
from tests.realsw.serving.procview import futex_parked
from tests.realsw.sglanglib import SglangServer, sglang_ready

__all__ = ["sglang_ready"]  # the fixture, imported to be used here

# one worker: the module's servers start once
pytestmark = [pytest.mark.usefixtures("sglang_ready"), pytest.mark.xdist_group("sglang-shapes")]

SPIN_TICKS = 45  # of 300 in 3 s: the idle default scheduler's main thread, at least 15% of a CPU
# ... within this long: on a host running the suite side by side a spinning thread gets its
# share later (it got 20 ticks in 3 s once); one asleep in poll(2) uses a tick or two in that
SPIN_PATIENCE_S = 10.0
SLEEP_TICKS = 15  # of 300 in 3 s: --sleep-on-idle, at most 5%


@pytest.fixture(scope="module")
def run_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("sglang-shapes")


@pytest.fixture(scope="module")
def default(run_root: Path) -> Iterator[SglangServer]:
    with sglanglib.sglang_server(run_root / "default") as s:
        yield s


def assert_tree(s: SglangServer) -> None:
    """Main process -> sglang::scheduler and sglang::detokenizer, found by parent links; only
    the main process listens on the port we gave it."""
    assert parent_pid(s.scheduler) == s.pid and parent_pid(s.detokenizer) == s.pid
    assert s.port in sglanglib.listening_ports(s.pid)
    assert s.port not in sglanglib.listening_ports(s.scheduler)


def main_thread_ticks(pid: int, seconds: float = 3.0) -> int:
    before = thread_cpu_ticks(pid, pid)
    time.sleep(seconds)
    return thread_cpu_ticks(pid, pid) - before


def test_idle_default_scheduler_spins_then_serves(default: SglangServer) -> None:
    s = default
    assert_tree(s)
    # idle: no request of ours yet, only SGLang's own warm-up; its main thread polls its
    # sockets without sleeping
    before = thread_cpu_ticks(s.scheduler, s.scheduler)
    deadline = time.monotonic() + SPIN_PATIENCE_S
    while (spun := thread_cpu_ticks(s.scheduler, s.scheduler) - before) < SPIN_TICKS:
        assert time.monotonic() < deadline, (
            f"the idle scheduler's main thread ran only {spun} ticks in {SPIN_PATIENCE_S} s"
        )
        time.sleep(0.25)
    assert sglanglib.thread_names(s.scheduler)[s.scheduler].startswith("sglang::")
    with sglanglib.Continuous(s) as client:
        client.wait_answers(5)
    answer = sglanglib.generate(s, max_tokens=8)
    assert answer["meta_info"]["completion_tokens"] == 8, answer


def test_sleep_on_idle_sleeps(run_root: Path) -> None:
    with sglanglib.sglang_server(run_root / "sleep", sleep_on_idle=True) as s:
        assert_tree(s)
        ran = main_thread_ticks(s.scheduler)
        assert ran <= SLEEP_TICKS, f"--sleep-on-idle, yet its main thread ran {ran} ticks in 3 s"
        # it sleeps in zmq's poll(2), a second at a time
        wait_until(
            lambda: sglanglib.in_syscall(s.scheduler, sglanglib.SYS_POLL), 10, "poll(2)", 0.05
        )
        assert sglanglib.generate(s)["meta_info"]["completion_tokens"] == 16


def _hung(s: SglangServer, tid: int) -> None:
    """The thread sleeps in futex without a timeout and stays there."""
    wait_until(lambda: sglanglib.in_untimed_futex(s.scheduler, tid), 10, "the step parked")
    first = futex_parked(s.scheduler, [tid])
    time.sleep(2)
    assert first is not None and futex_parked(s.scheduler, [tid]) == first, "it ran"


def test_event_hang_then_release(default: SglangServer) -> None:
    s = default
    with sglanglib.pending(s) as client:
        s.hang()
        hung = s.wait_hung()
        assert hung.get_int("pid") == s.scheduler
        assert hung.get_int("tid") == s.scheduler, "the forward runs on the main thread"
        _hung(s, s.scheduler)
        assert client.conn.sock is not None
        # no answer while it hangs: nothing to read on the connection
        assert select.select([client.conn.sock], [], [], 1)[0] == []
        s.release()
        assert client.drain() == 200, "the released request was not answered"


def test_stream_hang_then_release(default: SglangServer) -> None:
    s = default
    s.hang(after=3)
    with sglanglib.pending(s, stream=True) as client:
        s.wait_hung()
        chunks = client.read_chunks(1)  # one: several steps' tokens may come as one chunk
        assert all(c["meta_info"]["finish_reason"] is None for c in chunks), chunks
        _hung(s, s.scheduler)
        # the connection is open and nothing more comes
        assert client.resp is not None and not client.resp.isclosed()
        s.release()
        client.read_chunks(3)  # the stream goes on
        assert client.drain() == 200
    assert sglanglib.generate(s)["meta_info"]["completion_tokens"] == 16


def test_native_abba(run_root: Path) -> None:
    with sglanglib.sglang_server(run_root / "abba", hang="abba") as s, sglanglib.pending(s):
        s.hang()
        tids = s.wait_hung().get_ints("tids")
        assert len(tids) == 2
        _hung(s, s.scheduler)  # the main thread joins the two
        wait_until(lambda: futex_parked(s.scheduler, tids), 10, "both threads in futex")
        first = futex_parked(s.scheduler, tids)
        time.sleep(2)
        assert futex_parked(s.scheduler, tids) == first, "a thread of the cycle ran"
        assert all(sglanglib.in_untimed_futex(s.scheduler, t) for t in tids)


def test_loading_reads_storage_before_the_port_opens(run_root: Path) -> None:
    """The big model (4.7 GB), its pages dropped from the page cache first and its reads capped
    (``loading_server``): the scheduler reads it from storage while the port is still closed,
    for as long as the cap holds it; lifted, the load ends and the server serves."""
    with sglanglib.loading_server(run_root / "loading") as (s, size, cap):
        assert size > 2_000_000_000, size
        assert s.scheduler, "no scheduler while loading"
        read0 = sglanglib.read_bytes(s.scheduler)
        wait_until(
            lambda: sglanglib.read_bytes(s.scheduler) > read0, HANG_S, "reads from storage", 0.5
        )
        assert s.port not in sglanglib.listening_ports(s.pid)
        assert sglanglib.LOAD_END not in s.log_text(), "the load ended with the cap on"
        cap.release()
        wait_until(lambda: sglanglib.LOAD_END in s.log_text(), HANG_S, "the load's end", 0.1)
        read = sglanglib.read_bytes(s.scheduler) - read0
        print(f"the scheduler read {read} B from storage")
        assert read > size // 2, f"it read only {read} B of {size} from storage"
        s.wait_healthy()


def test_detokenizer_killed_tears_the_server_down(default: SglangServer) -> None:
    """SIGKILL the detokenizer with a request in flight: the main process's SubprocessWatchdog
    sees it within a second and sends itself SIGQUIT; SGLang then tears the server down (a
    crash dump attempt, then a wait of up to a minute for CUDA core dumps first). Not a hang:
    the server exits, and with it the open request. Runs last: it ends the shared server."""
    s = default
    with sglanglib.pending(s, max_tokens=200) as client:
        time.sleep(0.2)
        s.kill_detokenizer()
        killed = time.monotonic()
        wait_until(lambda: "Subprocess detokenizer" in s.log_text(), 30, "the watchdog's note")
        assert s.proc is not None
        wait_until(lambda: s.proc is not None and s.proc.poll() is not None, HANG_S, "its exit", 1)
        gone = time.monotonic() - killed
        print(f"the server exited {gone:.0f} s after its detokenizer was killed")
        wait_until(lambda: not alive(s.scheduler), HANG_S, "the scheduler's exit", 0.5)
        assert descendants(s.pid) == []
        assert client.conn.sock is not None
        client.conn.sock.settimeout(5)
        try:
            status: int | None = client.conn.getresponse().status
        except (http.client.HTTPException, OSError):
            status = None  # closed with no answer
        assert status != 200, "the request was answered after all"
