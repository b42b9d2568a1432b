"""The fixture programs really are in the state they announce.

No BPF and no root needed (reading a child's /proc/PID/mem and syscall files only needs
ptrace access to it, which a parent has): this runs anywhere Linux x86-64 runs. The
privileged end-to-end tests trust these states, so they are checked here from /proc.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from scripts.fixturelib import (
    FUTEX_CMD_MASK,
    FUTEX_LOCK_PI,
    FUTEX_LOCK_PI2,
    FUTEX_TID_MASK,
    FUTEX_WAIT,
    FUTEX_WAIT_BITSET,
    FUTEX_WAITERS,
    SYS_ACCEPT,
    SYS_ACCEPT4,
    SYS_WAIT4,
    Fixture,
    FixtureError,
    blocked_in,
    build,
    futex_wait,
    mutex_word_and_owner,
    parent_pid,
    read_u32,
    tasks,
    thread_cpu_ticks,
    thread_state,
    wait_until,
)

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="fixtures use Linux futexes and /proc"
)

C_FIXTURES = [
    "deadlock_mutex",
    "ring_mutex",
    "pshared_deadlock",
    "pi_deadlock",
    "condvar_pool",
    "barrier_ranks",
    "busy",
    "exits_soon",
]
WAIT_OPS = (FUTEX_WAIT, FUTEX_WAIT_BITSET)


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    """Compile every C fixture once, up front, so no test's READY timeout includes gcc."""
    for name in C_FIXTURES:
        build(name)


def sleeping_on(pid: int, tid: int, timeout: float = 2.0) -> tuple[int, int, int]:
    """``(uaddr, op, val)`` of a thread asleep in futex; a clear failure otherwise.

    Waits a little: a main thread announces READY just before it blocks (join, waitpid).
    """
    deadline = time.monotonic() + timeout
    while (wait := futex_wait(pid, tid)) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert wait is not None, f"thread {tid} of {pid} is not asleep in futex: {describe(pid)}"
    return wait


def syscall_blocked_in(pid: int, tid: int, timeout: float = 2.0) -> int | None:
    """The syscall a thread sleeps in, waiting a little for it to get there."""
    deadline = time.monotonic() + timeout
    while (nr := blocked_in(pid, tid)) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    return nr


def describe(pid: int) -> str:
    lines = []
    for tid in tasks(pid):
        try:
            with open(f"/proc/{pid}/task/{tid}/syscall") as f:
                syscall = f.read().strip()
        except OSError as e:
            syscall = str(e)
        lines.append(f"  {tid} {thread_state(pid, tid)} {syscall}")
    return "\n" + "\n".join(lines)


def cpu_grows(pid: int, tid: int, timeout: float = 5.0) -> None:
    start = thread_cpu_ticks(pid, tid)
    wait_until(lambda: thread_cpu_ticks(pid, tid) > start + 2, timeout, f"CPU time of {tid}")


def gone(pid: int) -> bool:
    """Gone or a zombie (its parent, init, may not have reaped it yet)."""
    return thread_state(pid, pid) in ("-", "Z")


# --- fixturelib itself ---------------------------------------------------------------------


def test_build_is_cached_and_reports_gcc_errors(tmp_path: Path) -> None:
    (tmp_path / "ok.c").write_text("int main(void) { return 3; }\n")
    (tmp_path / "bad.c").write_text("int main(void) { return undeclared; }\n")
    out = build("ok", src_dir=tmp_path, out_dir=tmp_path / "build")
    assert subprocess.run([out], check=False).returncode == 3
    mtime = out.stat().st_mtime_ns
    assert build("ok", src_dir=tmp_path, out_dir=tmp_path / "build") == out
    assert out.stat().st_mtime_ns == mtime, "an up-to-date binary was rebuilt"
    with pytest.raises(FixtureError, match="undeclared"):
        build("bad", src_dir=tmp_path, out_dir=tmp_path / "build")
    assert not list((tmp_path / "build").glob(".*.tmp")), "a failed build left its temp file"


def test_concurrent_builds_do_not_collide(tmp_path: Path) -> None:
    (tmp_path / "same.c").write_text("int main(void) { return 5; }\n")
    errors: list[BaseException] = []

    def one() -> None:
        try:
            build("same", src_dir=tmp_path, out_dir=tmp_path / "build")
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert subprocess.run([tmp_path / "build" / "same"], check=False).returncode == 5


def test_fixture_timeout_reports_stderr() -> None:
    cmd = [sys.executable, "-c", "import sys, time; print('boom', file=sys.stderr); time.sleep(30)"]
    with pytest.raises(FixtureError, match="boom"), Fixture(cmd, timeout=1.0):
        pass


def test_fixture_early_exit_is_reported() -> None:
    cmd = [sys.executable, "-c", "print('NOT READY'); raise SystemExit(4)"]
    with pytest.raises(FixtureError, match=r"exit status: 4|stdout closed"), Fixture(cmd):
        pass


def test_fixture_kills_its_whole_process_group() -> None:
    script = (
        "import subprocess\n"
        "p = subprocess.Popen(['sleep', '60'])\n"
        "print(f'READY child={p.pid}', flush=True)\n"
        "p.wait()\n"
    )
    with Fixture([sys.executable, "-c", script]) as fx:
        child = fx.info.get_int("child")
        assert not gone(child)
    wait_until(lambda: gone(child), 5, "the fixture's child to die with its group")


# --- the fixtures --------------------------------------------------------------------------


def check_mutex_cycle(pid: int, tids: list[int], locks: list[int]) -> None:
    """Thread i holds locks[i] (glibc __owner at +8) and sleeps on locks[i+1]'s word."""
    n = len(tids)
    for i, tid in enumerate(tids):
        uaddr, op, val = sleeping_on(pid, tid)
        assert uaddr == locks[(i + 1) % n], f"thread {tid} sleeps on {uaddr:#x}, not the next lock"
        assert op & FUTEX_CMD_MASK == FUTEX_WAIT and val == 2, f"op {op:#x} val {val}"
        word, owner = mutex_word_and_owner(pid, locks[i])
        assert (word, owner) == (2, tid), f"lock {i}: word {word} (2 = contended), owner {owner}"


@pytest.mark.parametrize("busy", [False, True], ids=["plain", "busy"])
def test_deadlock_mutex(busy: bool) -> None:
    with Fixture.c("deadlock_mutex", *(["--busy"] if busy else [])) as fx:
        tids, locks = fx.info.get_ints("tids"), fx.info.get_ints("locks")
        assert len(tids) == 2
        check_mutex_cycle(fx.pid, tids, locks)
        # The main thread sits in pthread_join: a futex wait on the first thread's TID word.
        _, _, val = sleeping_on(fx.pid, fx.pid)
        assert val == tids[0]
        if busy:
            assert thread_state(fx.pid, fx.info.get_int("busy_tid")) == "R"
            cpu_grows(fx.pid, fx.info.get_int("busy_tid"))
        assert len(tasks(fx.pid)) == 3 + busy


@pytest.mark.parametrize("n", [3, 5])
def test_ring_mutex(n: int) -> None:
    with Fixture.c("ring_mutex", str(n)) as fx:
        tids = fx.info.get_ints("tids")
        assert len(tids) == n
        check_mutex_cycle(fx.pid, tids, fx.info.get_ints("locks"))


def test_pshared_deadlock_spans_two_processes_and_child_dies_with_parent() -> None:
    with Fixture.c("pshared_deadlock") as fx:
        pid, child = fx.pid, fx.info.get_int("child")
        assert fx.info.get_ints("tids") == [pid, child]
        assert parent_pid(child) == pid
        lock_a, lock_b = fx.info.get_ints("locks")
        # The monitor thread exits after READY: one thread per process, both in the cycle.
        wait_until(lambda: tasks(pid) == [pid], 5, "the parent's monitor thread to exit")
        assert tasks(child) == [child]
        assert sleeping_on(pid, pid)[0] == lock_b
        assert sleeping_on(child, child)[0] == lock_a
        # Process-shared: a shared futex (no FUTEX_PRIVATE_FLAG), __owner still a TID.
        assert sleeping_on(pid, pid)[1] == FUTEX_WAIT
        assert mutex_word_and_owner(pid, lock_a) == (2, pid)
        assert mutex_word_and_owner(pid, lock_b) == (2, child)
        # Kill only the parent: PR_SET_PDEATHSIG must take the child down too.
        fx.proc.kill()  # type: ignore[union-attr]
        wait_until(lambda: gone(child), 5, "the child to die with its parent")


def check_pi_cycle(pid: int, ready: dict[str, str], tids: list[int], locks: list[int]) -> None:
    lockpi = [int(t) for t in ready["lockpi_tids"].split(",") if t]
    parked = [int(t) for t in ready["parked_tids"].split(",") if t]
    assert len(lockpi) == 1 and len(parked) == 1, f"want one LOCK_PI waiter, one EDEADLK: {ready}"
    for i, tid in enumerate(tids):
        word, owner = mutex_word_and_owner(pid, locks[i])
        assert word & FUTEX_TID_MASK == tid == owner, f"PI word {word:#x} owner {owner}"
    i = tids.index(lockpi[0])
    uaddr, op, _ = sleeping_on(pid, lockpi[0])
    assert uaddr == locks[1 - i] and op & FUTEX_CMD_MASK in (FUTEX_LOCK_PI, FUTEX_LOCK_PI2)
    assert read_u32(pid, locks[1 - i])[0] & FUTEX_WAITERS, "the contended PI word lacks WAITERS"
    # The EDEADLK thread: glibc parks it forever on a private dummy word, not on a lock.
    uaddr, op, val = sleeping_on(pid, parked[0])
    assert uaddr not in locks and op & FUTEX_CMD_MASK in WAIT_OPS and val == 0


def test_pi_deadlock() -> None:
    with Fixture.c("pi_deadlock") as fx:
        check_pi_cycle(fx.pid, fx.info, fx.info.get_ints("tids"), fx.info.get_ints("locks"))


def test_pi_deadlock_waits_for_go() -> None:
    with Fixture.c("pi_deadlock", "--wait-for-go", ready="HOLDING") as fx:
        tids, locks = fx.info.get_ints("tids"), fx.info.get_ints("locks")
        time.sleep(0.2)
        assert not fx.seen("READY"), "the cycle formed before go"
        for i, tid in enumerate(tids):
            assert sleeping_on(fx.pid, tid)[0] not in locks, "a thread already wants a lock"
            assert mutex_word_and_owner(fx.pid, locks[i])[1] == tid
        fx.send("go")
        ready = fx.wait_for("READY")
        assert ready.get_ints("tids") == tids
        check_pi_cycle(fx.pid, ready, tids, locks)


def test_condvar_pool() -> None:
    with Fixture.c("condvar_pool", "8") as fx:
        tids = fx.info.get_ints("tids")
        assert len(tids) == 8 and len(tasks(fx.pid)) == 9
        words = {sleeping_on(fx.pid, tid)[0] for tid in tids}
        assert len(words) == 1, "workers should share one condvar word"
        sleeping_on(fx.pid, fx.pid)  # main, in pthread_join


@pytest.mark.parametrize("parks", [False, True], ids=["last-busy", "last-parks"])
def test_barrier_ranks(parks: bool) -> None:
    with Fixture.c("barrier_ranks", "4", *(["--last-rank-parks"] if parks else [])) as fx:
        ranks, last = fx.info.get_ints("ranks"), fx.info.get_int("last")
        assert len(ranks) == 4 and ranks[-1] == last
        assert all(parent_pid(r) == fx.pid for r in ranks)
        assert syscall_blocked_in(fx.pid, fx.pid) == SYS_WAIT4
        words = {sleeping_on(r, r)[0] for r in ranks[:-1]}
        assert len(words) == 1, "ranks should share one barrier word"
        if parks:
            uaddr, _, _ = sleeping_on(last, last)
            assert uaddr not in words
            start = thread_cpu_ticks(last, last)
            time.sleep(0.3)
            assert thread_cpu_ticks(last, last) <= start + 1, "the parked last rank uses CPU"
        else:
            cpu_grows(last, last)


def test_busy() -> None:
    with Fixture.c("busy", "2") as fx:
        tids = fx.info.get_ints("tids")
        assert len(tids) == 2
        for tid in tids:
            cpu_grows(fx.pid, tid)


def test_exits_soon() -> None:
    with Fixture.c("exits_soon", "1") as fx:
        tids = fx.info.get_ints("tids")
        assert len(tids) == 3
        for tid in tids:
            sleeping_on(fx.pid, tid)
        assert fx.wait_exit(timeout=5) == 0


def test_exits_soon_waits_for_go() -> None:
    with Fixture.c("exits_soon", "0", "--wait-for-go") as fx:
        time.sleep(0.3)
        assert not gone(fx.pid), "exited before go"
        fx.send("go")
        assert fx.wait_exit(timeout=5) == 0


@pytest.mark.parametrize("load", [("--load-seconds", "1"), ("--until-go",)], ids=["1s", "go"])
def test_loader(tmp_path: Path, load: tuple[str, ...]) -> None:
    log = tmp_path / "load.log"
    with Fixture.py("loader", *load, "--log", log, ready="LOADING") as fx:
        workers = fx.info.get_ints("workers")
        loader_tid = fx.info.get_int("loader_tid")
        assert len(workers) == 4
        wait_until(lambda: log.exists() and log.stat().st_size > 0, 2, "log lines")
        ticks = {w: thread_cpu_ticks(fx.pid, w) for w in workers}
        if load == ("--until-go",):
            size = log.stat().st_size
            wait_until(lambda: log.stat().st_size > size, 5, "the log to grow while loading")
            fx.send("go")
        listening = fx.wait_for("LISTENING", timeout=5)
        # One line per write (a shard's number and digest), 50 ms apart, then "ready".
        lines = log.read_text().splitlines()
        assert len(lines) >= 2 and lines[-1] == "ready", lines
        shards = [line.rsplit(" ", 1)[0] for line in lines[:-1]]
        assert shards == [f"loaded shard {i}" for i in range(len(lines) - 1)], lines
        assert all(thread_cpu_ticks(fx.pid, w) == t for w, t in ticks.items()), "workers spin"
        for w in workers:
            sleeping_on(fx.pid, w)
        assert syscall_blocked_in(fx.pid, loader_tid) in (SYS_ACCEPT, SYS_ACCEPT4)
        size = log.stat().st_size
        with socket.create_connection(("127.0.0.1", listening.get_int("port")), timeout=2):
            pass
        time.sleep(0.1)
        assert log.stat().st_size == size, "the log grows after loading"


def test_idle_http_answers() -> None:
    with Fixture.py("idle_http") as fx:
        base = f"http://127.0.0.1:{fx.info.get_int('port')}"
        with urllib.request.urlopen(base + "/", timeout=5) as resp:
            assert resp.status == 200 and resp.read() == b"ok\n"
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(base + "/nope", timeout=5)
        assert err.value.code == 404


@pytest.mark.parametrize("how", [(), ("--from-thread",)])
def test_exec_launcher_execs_the_target_in_place(how: tuple[str, ...]) -> None:
    with Fixture.py("exec_launcher", *how, ready="STARTED") as fx:
        comm = Path(f"/proc/{fx.pid}/comm").read_text()
        assert b"--target" not in Path(f"/proc/{fx.pid}/cmdline").read_bytes()
        fx.send("go")
        assert fx.wait_for("TARGET").get_int("pid") == fx.pid
        assert Path(f"/proc/{fx.pid}/cmdline").read_bytes().endswith(b"--target\0")
        assert Path(f"/proc/{fx.pid}/comm").read_text() == comm  # python execs python
        assert tasks(fx.pid) == [fx.pid]


def test_pylocks() -> None:
    with Fixture.py("pylocks") as fx:
        tids = fx.info.get_ints("tids")
        assert len(tids) == 2 and len(tasks(fx.pid)) == 3
        words = {sleeping_on(fx.pid, tid)[0] for tid in tids}
        assert len(words) == 2, "each lock thread should sleep on its own lock's semaphore"
        time.sleep(0.2)
        assert {sleeping_on(fx.pid, tid)[0] for tid in tids} == words
