"""The serving stack of tests/realsw/serving really is in the shape each scenario claims.

Checked from /proc and simple probes, not with hangwatch: which syscall each thread sleeps in,
whether parked threads stayed on the same futex word without running, how the accept queue
looks, whether requests are answered, whether the log grows. hangwatch is judged against these
shapes later; this only makes sure they are what they say. No root needed (a parent may read
its children's /proc files), no BPF. Runs under the real-software venv (conftest.py).
"""

from __future__ import annotations

import http.client
import socket
import sys
import time
from pathlib import Path

import pytest

from scripts.fixturelib import (
    FUTEX_CMD_MASK,
    FUTEX_WAIT,
    FUTEX_WAIT_BITSET,
    FixtureLine,
    blocked_in,
    futex_wait,
    mutex_word_and_owner,
    parent_pid,
    tasks,
    wait_until,
)
from tests.realsw.servinglib import (
    Stack,
    build_abba,
    futex_parked,
    listen_queue,
    serving_stack,
    weight_server,
)

pytestmark = [
    pytest.mark.skipif(
        not sys.platform.startswith("linux"), reason="the shapes are read from Linux /proc"
    ),
    pytest.mark.xdist_group("serving-shapes"),  # one worker: the abba library is built once
]

SYS_READ, SYS_POLL, SYS_RECVFROM, SYS_EPOLL_WAIT = 0, 7, 45, 232
MIB = 1 << 20


# --- probes -------------------------------------------------------------------------------


def syscall_args(pid: int, tid: int) -> list[int]:
    """The syscall number and arguments a sleeping thread is blocked in; [] if it is not."""
    if blocked_in(pid, tid) is None:
        return []
    with open(f"/proc/{pid}/task/{tid}/syscall") as f:
        return [int(w, 0) for w in f.read().split()[:7]]


def sleeps_in(pid: int, tid: int, call: int, timeout_arg: int | None = None) -> bool:
    """Whether the thread is seen asleep in syscall ``call`` (and, if given, with that timeout
    as its third argument) within 2 s: one that wakes now and then is caught between wakes."""

    def seen() -> bool:
        args = syscall_args(pid, tid)
        return args[:1] == [call] and (timeout_arg is None or args[3] == timeout_arg)

    try:
        wait_until(seen, 2, f"thread {tid} of {pid} in syscall {call}")
    except AssertionError:
        return False
    return True


def thread_names(pid: int) -> dict[int, str]:
    names = {}
    for tid in tasks(pid):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                names[tid] = f.read().strip()
        except FileNotFoundError:  # the thread ended after it was listed (a start-up helper)
            continue
    return names


def process_cpu_ticks(pid: int) -> int:
    """utime + stime of the whole process, exited threads included, in clock ticks."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return int(fields[11]) + int(fields[12])


def rss_bytes(pid: int) -> int:
    """Resident memory now (/proc/PID/status VmRSS). Received weights are kept in memory: the
    growth shows them arriving. (/proc/PID/io rchar would not: recvfrom(2) is not counted.)"""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def health(port: int, timeout: float = 5.0) -> int:
    """``GET /health`` on a new connection: the status code (socket.timeout if none comes)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status
    finally:
        conn.close()


def accepts(port: int) -> bool:
    """Connect, and see the listener take the connection off its accept queue."""
    with socket.create_connection(("127.0.0.1", port), timeout=5):
        return bool(wait_until(lambda: listen_queue(port) == 0, 5, "the accept"))


def log_lines(stack: Stack, text: str) -> int:
    return sum(text in line for line in stack.log.read_text().splitlines())


def assert_parked_for(pid: int, tids: list[int], window: float) -> tuple[tuple[str, str], ...]:
    """The threads sleep in futex and stay on the same words, without running, ``window`` s."""
    before = futex_parked(pid, tids)
    assert before is not None, f"threads {tids} of {pid} are not all in futex wait"
    time.sleep(window)
    after = futex_parked(pid, tids)
    assert after == before, f"threads {tids} of {pid} moved: {before} -> {after}"
    return after


def expect_idle_process(pid: int, main_call: int) -> None:
    """A stack process whose main thread sleeps in ``main_call`` and whose zmq threads epoll."""
    assert sleeps_in(pid, pid, main_call)
    zmq_threads = [t for t, name in thread_names(pid).items() if name.startswith("ZMQbg/")]
    assert len(zmq_threads) == 3, thread_names(pid)  # zmq.Context(2): 2 I/O threads + reaper
    for tid in zmq_threads:
        assert sleeps_in(pid, tid, SYS_EPOLL_WAIT)


@pytest.fixture(scope="module")
def abba_lib() -> Path:
    """Compile abba.c once, up front, so no READY timeout includes gcc."""
    return build_abba()


# --- the shapes ---------------------------------------------------------------------------


def test_loading(tmp_path: Path) -> None:
    """[progressing] The scheduler receives its weights at ~2 MiB/s and logs each MiB; the
    front-end already answers."""
    with weight_server(rate_mib=2) as ws:
        weights = f"tcp:127.0.0.1:{ws.info.get_int('port')}"
        with serving_stack("loading", tmp_path, server_args=["--weights", weights]) as st:
            assert health(st.port) == 200
            lines, got = log_lines(st, "Loading weights:"), rss_bytes(st.scheduler)
            calls = set()
            for _ in range(15):  # 1.5 s: mostly waiting for the next bytes in recvfrom
                calls.add(blocked_in(st.scheduler, st.scheduler))
                time.sleep(0.1)
            assert log_lines(st, "Loading weights:") >= lines + 2
            assert rss_bytes(st.scheduler) - got >= 2 * MIB
            assert SYS_RECVFROM in calls, calls
            assert log_lines(st, "Load weight end") == 0


def test_idle(tmp_path: Path) -> None:
    """[idle] Everything up, nothing asked: an empty accept queue, no log lines, little CPU."""
    with serving_stack("idle", tmp_path) as st:
        procs = [st.pid, st.scheduler, st.detokenizer]
        assert listen_queue(st.port) == 0
        size, ticks = st.log.stat().st_size, sum(map(process_cpu_ticks, procs))
        time.sleep(2)
        assert st.log.stat().st_size == size
        assert sum(map(process_cpu_ticks, procs)) - ticks <= 20  # 0.2 s of CPU in 2 s, at most
        assert listen_queue(st.port) == 0
        # uvicorn's loop in epoll_wait (it ticks every 0.1 s); the scheduler in SGLang's idle
        # zmq poll(1000); the detokenizer in a blocking recv, i.e. poll(-1) on zmq's eventfd.
        assert sleeps_in(st.pid, st.pid, SYS_EPOLL_WAIT)
        assert sleeps_in(st.scheduler, st.scheduler, SYS_POLL, timeout_arg=1000)
        assert sleeps_in(st.detokenizer, st.detokenizer, SYS_POLL, timeout_arg=0xFFFFFFFF)  # -1
        for pid, call in ((st.scheduler, SYS_POLL), (st.detokenizer, SYS_POLL)):
            expect_idle_process(pid, call)
        tracker = [p for p in children(st.pid) if p not in procs]  # multiprocessing's
        assert len(tracker) == 1 and sleeps_in(tracker[0], tracker[0], SYS_READ)


def test_serving(tmp_path: Path) -> None:
    """[progressing] A client's requests go front-end -> scheduler -> detokenizer -> front-end."""
    with serving_stack("serving", tmp_path, client=["--mode", "continuous"]) as st:
        assert st.client is not None
        st.client.wait_for("READY")
        first = st.client.wait_for("STATS").get_int("answered")
        ticks, size = process_cpu_ticks(st.scheduler), st.log.stat().st_size
        time.sleep(1.5)
        st.client.seen("STATS")  # takes in what the client printed meanwhile
        latest = [line for line in st.client.lines if line.startswith("STATS ")][-1]
        assert FixtureLine(latest).get_int("answered") - first >= 5
        assert process_cpu_ticks(st.scheduler) > ticks
        assert st.log.stat().st_size > size  # uvicorn's access log, the scheduler's decode log
        assert listen_queue(st.port) == 0


def test_abba(tmp_path: Path) -> None:
    """[stalled, later deadlocked] Two scheduler threads hold one threading.Lock each and wait
    for the other's; the main thread joins them; one request waits; the front-end answers."""
    with serving_stack("abba", tmp_path, client=["--mode", "once"]) as st:
        tids, joiner = st.info.get_ints("tids"), st.info.get_int("joiner")
        assert joiner == st.scheduler and st.info.get_int("waiting") == 1
        parked = assert_parked_for(st.scheduler, [*tids, joiner], window=3)
        assert parked[0][0] != parked[1][0], "the two workers wait on different locks"
        for tid in [*tids, joiner]:
            wait = futex_wait(st.scheduler, tid)
            assert wait is not None and wait[1] & FUTEX_CMD_MASK in (FUTEX_WAIT, FUTEX_WAIT_BITSET)
        assert accepts(st.port)
        assert health(st.port) == 200
        assert st.client is not None and not st.client.seen("ANSWER")
        expect_idle_process(st.detokenizer, SYS_POLL)


def test_abba_retry(tmp_path: Path) -> None:
    """[stalled] The same deadlock, and a client that retries on a new connection every
    second; each attempt times out."""
    client = ["--mode", "retry", "--timeout", "1"]
    with serving_stack("abba-retry", tmp_path, client=client) as st:
        assert st.client is not None
        tids, joiner = st.info.get_ints("tids"), st.info.get_int("joiner")
        before = futex_parked(st.scheduler, [*tids, joiner])
        first = st.client.wait_for("TIMEOUT", timeout=10).get_int("attempt")
        later = st.client.wait_for("TIMEOUT", timeout=10).get_int("attempt")
        assert later > first
        assert before is not None and futex_parked(st.scheduler, [*tids, joiner]) == before
        assert not st.client.seen("ANSWER")


def test_native_abba(tmp_path: Path, abba_lib: Path) -> None:
    """[deadlocked] Two scheduler threads inside a C library each hold one pthread mutex and
    wait for the other's; the front-end still listens and answers."""
    args = ["--native-lib", str(abba_lib)]
    with serving_stack("native-abba", tmp_path, client=["--mode", "once"], server_args=args) as st:
        tids, words = st.info.get_ints("tids"), st.info.get_ints("words")
        parked = assert_parked_for(st.scheduler, tids, window=2)
        # kernel-0 (abba_ab) holds A and waits for B; kernel-1 (abba_ba) the reverse.
        assert [int(word, 16) for word, _ in parked] == [words[1], words[0]]
        for word, owner in zip(words, tids):
            assert mutex_word_and_owner(st.scheduler, word)[1] == owner
        assert accepts(st.port)
        assert health(st.port) == 200


def test_blocked_loop(tmp_path: Path) -> None:
    """[stalled] A handler blocks uvicorn's event loop on a threading.Lock that a weight update
    holds forever; clients queue until the accept queue is full; nothing answers."""
    args, client = ["--backlog", "4"], ["--mode", "queue", "--connections", "8"]
    with serving_stack("blocked-loop", tmp_path, client=client, server_args=args) as st:
        wait_until(  # the weight-update thread that holds the lock is parked too
            lambda: [t for t in tasks(st.pid) if t != st.pid and futex_wait(st.pid, t)],
            5,
            f"a second parked thread in {thread_names(st.pid)}",
        )
        assert_parked_for(st.pid, [st.pid], window=1)  # the loop thread: no 0.1 s ticks any more
        full = wait_until(lambda: (listen_queue(st.port) or 0) > 4, 10, "a full accept queue")
        assert full
        with pytest.raises((socket.timeout, ConnectionError)):
            health(st.port, timeout=1)


def test_fork_lock(tmp_path: Path) -> None:
    """[stalled, later deadlocked] The scheduler forked a helper while another thread held a
    lock; the helper waits for it forever; the scheduler waits for the helper in 5 s polls."""
    with serving_stack("fork-lock", tmp_path, client=["--mode", "once"]) as st:
        child = st.info.get_int("child")
        assert parent_pid(child) == st.scheduler and tasks(child) == [child]
        assert_parked_for(child, [child], window=2)
        # join(5): poll(2) on the child's sentinel pipe, 5000 ms at a time
        assert sleeps_in(st.scheduler, st.scheduler, SYS_POLL, timeout_arg=5000)
        # main, 3 zmq threads, the watchdog: the thread that held the lock has exited
        assert len(tasks(st.scheduler)) == 5, thread_names(st.scheduler)
        assert health(st.port) == 200
        assert st.client is not None and not st.client.seen("ANSWER")
