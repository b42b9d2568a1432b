"""The kernel probes on their own: real BPF on this kernel, fixture programs, exact figures.

Each test loads a fresh ``KernelProbes`` (in the test body, so a missing privilege fails the
call phase like the rest of this directory), points it at fixture processes and reads what
the kernel side kept. Map contents are checked per PID: other processes on the host may use
the same syscalls meanwhile.
"""

from __future__ import annotations

import ctypes
import shutil
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agent.errors import KernelFeatureError
from agent.model import PI_LOCK_OPS, ExecEvent, FdWrites, ProbeEvent, ProbeReading, SocketEvent
from agent.sources.probe import BPF_DIR, BPF_SOURCES, KernelProbes
from scripts.fixturelib import SYS_FUTEX, Fixture
from tests.limits import HANG_S

EDEADLK = 35
FUTEX_WAKE = 1
OpenProbes = Callable[[], KernelProbes]


@pytest.fixture
def open_probes() -> Iterator[OpenProbes]:
    """Load the probes on demand; whatever was loaded is detached at teardown."""
    opened: list[KernelProbes] = []

    def open_() -> KernelProbes:
        probes = KernelProbes()
        opened.append(probes)
        return probes

    yield open_
    for probes in opened:
        probes.close()


class Seen:
    """Every reading's ring-buffer events kept across reads (each read drains them)."""

    def __init__(self, probes: KernelProbes) -> None:
        self.probes = probes
        self.events: list[ProbeEvent] = []
        self.socket_events: list[SocketEvent] = []
        self.execs: list[ExecEvent] = []
        self.last = ProbeReading()

    def read(self) -> ProbeReading:
        self.last = self.probes.read()
        self.events += self.last.events
        self.socket_events += self.last.socket_events
        self.execs += self.last.execs
        return self.last

    def until(self, predicate: Callable[[Seen], object], what: str, timeout: float = 5) -> None:
        deadline = time.monotonic() + timeout
        while True:
            self.read()
            if predicate(self):
                return
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"no {what} within {timeout} s; events {self.events}, socket events "
                    f"{self.socket_events}, last reading {self.last}"
                )
            time.sleep(0.02)


def assert_nothing_lost(r: ProbeReading) -> None:
    lost = {k: v for k, v in r.counters.items() if k.endswith("_full") or k == "events_dropped"}
    assert lost and not any(lost.values()), f"maps full or ring buffer drops: {lost}"


def start_server(fx: Fixture) -> tuple[int, int, int]:
    """Let a started listen_write fixture run: (port, listening fd, file fd)."""
    fx.send("go")
    info = fx.wait_for("LISTENING")
    return info.get_int("port"), info.get_int("fd"), info.get_int("file_fd")


def connect(port: int, times: int) -> None:
    for _ in range(times):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


# --- bind and listen: every process --------------------------------------------------------


def test_bind_and_listen_reported_for_unwatched_process(open_probes: OpenProbes) -> None:
    probes = open_probes()
    seen = Seen(probes)
    with Fixture.c("listen_write", "0", ready="STARTED") as fx:
        port, fd, _ = start_server(fx)
        fx.wait_for("READY")
        pid = fx.pid
        seen.until(
            lambda s: any(e.tgid == pid and e.kind == "listen" for e in s.socket_events),
            f"listen event from unwatched pid {pid}",
        )
    mine = [e for e in seen.socket_events if e.tgid == pid]
    # The port asked for: the probing bind to port 0, then the real one to the port it found.
    binds = [(e.family, e.port, e.tid) for e in mine if e.kind == "bind"]
    assert binds == [(socket.AF_INET, 0, pid), (socket.AF_INET, port, pid)], mine
    assert [e.fd for e in mine if e.kind == "bind"][-1] == fd, mine
    listens = [(e.fd, e.backlog, e.family, e.port) for e in mine if e.kind == "listen"]
    assert listens == [(fd, 17, 0, 0)], mine
    r = seen.last
    assert pid not in r.accepts and pid not in r.writes and pid not in r.wait_histogram, r
    assert_nothing_lost(r)


# --- exec: every process ----------------------------------------------------------------


def test_exec_reported_for_every_process(open_probes: OpenProbes) -> None:
    """Each launcher execs twice: when started (fork, exec python), and when told to (python
    execs python: same comm, same PID). The second one from a thread that is not the leader."""
    probes = open_probes()
    seen = Seen(probes)
    with (
        Fixture.py("exec_launcher", ready="STARTED") as unwatched,
        Fixture.py("exec_launcher", "--from-thread", ready="STARTED") as watched,
    ):
        probes.watch([watched.pid])
        pids = (unwatched.pid, watched.pid)
        seen.until(
            lambda s: all(sum(e.tgid == p for e in s.execs) == 1 for p in pids), "the first execs"
        )
        t0 = time.monotonic_ns()
        for fx in (unwatched, watched):
            fx.send("go")
            fx.wait_for("TARGET")
        seen.until(
            lambda s: all(sum(e.tgid == p for e in s.execs) == 2 for p in pids), "the second execs"
        )
    for pid in pids:
        first, second = (e.ts_ns for e in seen.execs if e.tgid == pid)
        assert first < t0 <= second, (pid, first, t0, second)
    assert_nothing_lost(seen.last)


@pytest.mark.parametrize("how", ["prctl", "comm-file"])
def test_renames_and_execs_are_taken_before_the_read(open_probes: OpenProbes, how: str) -> None:
    """A process that renames itself (no exec) is reported by its PID, as an exec is, so that
    discovery knows it changed; what take_execs took is not in the next reading."""
    probes = open_probes()
    assert probes.take_execs() is not None, "a tracepoint missing: sched_process_exec, task_rename"
    args = ["hw-renamed"] + (["--from-thread"] if how == "comm-file" else [])
    with Fixture.py("renamer", *args, ready="STARTED") as fx:
        taken: list[int] = []
        deadline = time.monotonic() + 5
        while fx.pid not in taken:  # its own exec, at start
            assert time.monotonic() < deadline, f"no exec of {fx.pid} taken: {taken}"
            taken += probes.take_execs() or []
            time.sleep(0.02)
        fx.send("go")
        fx.wait_for("RENAMED")
        assert Path(f"/proc/{fx.pid}/comm").read_text().strip() == "hw-renamed"
        deadline = time.monotonic() + 5
        renamed: list[int] = []
        while fx.pid not in renamed:
            assert time.monotonic() < deadline, f"no rename of {fx.pid} taken: {renamed}"
            renamed += probes.take_execs() or []
            time.sleep(0.02)
        r = probes.read()
    assert fx.pid not in [e.tgid for e in r.execs], r.execs
    assert_nothing_lost(r)


# --- accepts and writes: watched processes only --------------------------------------------


def test_accepts_counted_for_watched_process_only(open_probes: OpenProbes) -> None:
    probes = open_probes()
    with (
        Fixture.c("listen_write", "5", ready="STARTED") as watched,
        Fixture.c("listen_write", "5", ready="STARTED") as other,
    ):
        probes.watch([watched.pid])
        for fx in (watched, other):
            port, _, _ = start_server(fx)
            connect(port, 5)  # accept 2, accept4 3
            fx.wait_for("READY")
        r = probes.read()
    assert r.accepts.get(watched.pid) == 5, r.accepts
    assert other.pid not in r.accepts, r.accepts
    assert_nothing_lost(r)


def test_writes_counted_per_fd_for_watched_process_only(open_probes: OpenProbes) -> None:
    probes = open_probes()
    seen = Seen(probes)
    with (
        Fixture.c("listen_write", "0", ready="STARTED") as watched,
        Fixture.c("listen_write", "0", ready="STARTED") as other,
    ):
        probes.watch([watched.pid])
        t0 = time.monotonic_ns()
        _, _, file_fd = start_server(watched)
        watched.wait_for("READY")
        start_server(other)
        other.wait_for("READY")
        # stdout is written too: the LISTENING and READY lines (STARTED came before the
        # watch). The test can read READY before that write(2) reaches sys_exit: wait for it.
        seen.until(
            lambda s: s.last.writes.get(watched.pid, {}).get(1, FdWrites(1, 0, 0, 0)).calls == 2,
            "the second stdout write",
        )
        t1 = time.monotonic_ns()
        printed = [ln for ln in watched.lines if ln.split()[0] in ("LISTENING", "READY")]
    r = seen.last
    mine = r.writes[watched.pid]
    f = mine.get(file_fd)
    assert f is not None, mine
    # write 100, writev 30 + 20, pwrite64 7
    assert (f.fd, f.bytes, f.calls) == (file_fd, 157, 3), f
    assert t0 <= f.last_ns <= mine[1].last_ns <= t1, (t0, mine, t1)
    assert mine[1].bytes == sum(len(ln) + 1 for ln in printed), (printed, mine)
    assert other.pid not in r.writes, r.writes
    assert_nothing_lost(r)


def test_answers_without_write_counted_per_fd(open_probes: OpenProbes) -> None:
    """send (sendto), sendall, sendmsg, sendfile and splice count as writes to their fd:
    servers answer with them (Python's socket.send, asyncio transports, static files)."""
    probes = open_probes()
    seen = Seen(probes)
    with Fixture.py("send_calls") as fx:
        probes.watch([fx.pid])
        fx.send("go")
        fx.wait_for("DONE")
        fds = {k: fx.info.get_int(k) for k in ("send", "sendmsg", "sendfile", "splice")}
        seen.until(
            lambda s: (
                fds["splice"] in s.last.writes.get(fx.pid, {})
                and 1 in s.last.writes.get(fx.pid, {})
            ),
            "the splice and the DONE line",
        )
    mine = seen.last.writes[fx.pid]
    got = {k: (mine[fd].bytes, mine[fd].calls) for k, fd in fds.items() if fd in mine}
    # send 100 + sendall 50 (one call each here); sendmsg 7 + 9 in one call; sendfile 13;
    # splice 11
    assert got == {
        "send": (150, 2),
        "sendmsg": (16, 1),
        "sendfile": (13, 1),
        "splice": (11, 1),
    }, mine
    assert_nothing_lost(seen.last)


# --- PI deadlocks: every process -----------------------------------------------------------


def test_edeadlk_of_unwatched_process_is_kept_in_pi_ops_only(open_probes: OpenProbes) -> None:
    """An unwatched process's refusal takes no entry in the refusals map (any process could
    fill it) and sends no event; its LOCK_PI's pi_ops entry keeps it, so a cycle that formed
    before discovery reached the process is known once it does."""
    probes = open_probes()
    seen = Seen(probes)
    with Fixture.c("pi_deadlock", "--wait-for-go", ready="HOLDING") as fx:
        pid = fx.pid
        tids = set(fx.info.get_ints("tids"))
        locks = set(fx.info.get_ints("locks"))
        t0 = time.monotonic_ns()
        fx.send("go")
        ready = fx.wait_for("READY")
        t1 = time.monotonic_ns()
        (parked,) = ready.get_ints("parked_tids")  # refused with EDEADLK, parked on a dummy word
        (lockpi,) = ready.get_ints("lockpi_tids")  # still in FUTEX_LOCK_PI
        r = seen.read()
        assert not [e for e in seen.events if e.tgid == pid], seen.events
        assert not {tid for tid, _ in probes._rows("refusals")} & tids, probes._rows("refusals")
        assert not (set(r.inflight) | set(r.refusals)) & tids, r
        assert pid not in r.wait_histogram and r.counters["waits_started"] == 0, r

        # Discovery reaches it later: the refusal, and the LOCK_PI still in flight, are there.
        probes.watch([pid])
        r = probes.read()
        tgid, uaddr, ts_ns = r.refusals[parked]
        assert tgid == pid and uaddr in locks and t0 <= ts_ns <= t1, r.refusals
        assert lockpi in r.inflight and r.inflight[lockpi].wait.op in PI_LOCK_OPS, r.inflight
        assert r.inflight[lockpi].wait.uaddr in locks - {uaddr}, r.inflight
        probes.watch([])
    # Gone while unwatched: a read drops what was kept for its threads.
    probes.read()
    probes.watch([pid])
    r = probes.read()
    assert not (set(r.inflight) | set(r.refusals)) & tids, r
    assert_nothing_lost(r)


def test_a_wait_refused_at_once_is_counted_in_the_first_slot(open_probes: OpenProbes) -> None:
    """A futex wait the kernel refuses at once (EAGAIN) never slept: the first histogram slot,
    with no clock read; one that slept for its 50 ms timeout goes to its log2 slot."""
    probes = open_probes()
    with Fixture.py("futex_calls", "500", ready="STARTED") as fx:
        probes.watch([fx.pid])
        fx.send("go")
        fx.wait_for("DONE")
        r = probes.read()
    slots = r.wait_histogram.get(fx.pid, {})
    assert slots.get(0, 0) >= 500, slots
    # 50 ms or a little more (a late timer): [2^25, 2^26) ns, or the next slot
    assert sum(n for slot, n in slots.items() if slot >= 10) == 1, slots
    assert slots.get(25, 0) + slots.get(26, 0) == 1, slots
    assert not any(n for slot, n in slots.items() if 0 < slot < 10), slots  # none under 1 us
    assert_nothing_lost(r)


# --- waits that began before the process was watched -----------------------------------------


def test_a_wait_seen_from_proc_costs_no_read_until_it_ends(open_probes: OpenProbes) -> None:
    """Threads parked before the probe was attached: once marked, a tick reads none of them
    (not even a schedstat), and each one's mark goes when it leaves its wait: one woken into
    another futex wait is then the probe's own wait, one woken into a sleep is read again."""
    from agent.observe.sampler import Sampler
    from tests.test_procfs import CountingProcFS

    with Fixture.py("event_pool", "3") as fx:
        tids = fx.info.get_ints("tids")
        probes = open_probes()
        probes.watch([fx.pid])
        proc = CountingProcFS("/proc")
        sampler = Sampler(proc)
        first = sampler.snapshot([fx.pid], probes.read()).processes[fx.pid]
        seeded = {tid: first.thread(tid).wait for tid in tids}
        assert all(w is not None and w.source == "proc" for w in seeded.values()), seeded
        sampler.seed(probes.seed)
        r = probes.read()
        assert set(tids) <= r.seeded, (tids, r.seeded)
        proc.reads.clear()
        again = sampler.snapshot([fx.pid], r).processes[fx.pid]
        # The main thread (reading stdin) is the only one read: one schedstat.
        assert proc.reads.get("schedstat") == 1 and "syscall" not in proc.reads, proc.reads
        assert [again.thread(t).wait for t in tids] == [seeded[t] for t in tids]

        fx.send("wait 0")
        fx.wait_for("MOVED")
        fx.send("sleep 1")
        fx.wait_for("MOVED")
        r = probes.read()
        assert tids[0] not in r.seeded and tids[1] not in r.seeded, r.seeded
        assert tids[2] in r.seeded and tids[0] in r.inflight, r
        moved = sampler.snapshot([fx.pid], r).processes[fx.pid]
        woken, slept, still = (moved.thread(t) for t in tids)
        assert woken.wait is not None and woken.wait.source == "bpf", woken
        assert woken.wait.uaddr != seeded[tids[0]].uaddr  # type: ignore[union-attr]
        assert slept.wait is None and slept.syscall not in (None, SYS_FUTEX), slept
        assert still.wait == seeded[tids[2]]
        assert_nothing_lost(r)


# --- bookkeeping ---------------------------------------------------------------------------


def test_forget_processes_empties_per_process_maps(open_probes: OpenProbes) -> None:
    probes = open_probes()
    seen = Seen(probes)
    with Fixture.c("listen_write", "2", ready="STARTED") as fx:
        pid = fx.pid
        probes.watch([pid])
        port, _, _ = start_server(fx)
        connect(port, 2)
        tid = fx.wait_for("READY").get_int("tid")
        # After READY it parks in a futex wait: in flight, after one timed wait (histogram).
        seen.until(lambda s: tid in s.last.inflight, f"in-flight wait of {tid}")
        r = seen.last
        assert r.accepts.get(pid) == 2 and pid in r.writes and pid in r.wait_histogram, r
        probes.forget_processes([pid])
        r = probes.read()
        assert pid not in r.accepts and pid not in r.writes and pid not in r.wait_histogram, r
        assert tid not in r.inflight, r.inflight
    assert_nothing_lost(r)


def test_full_per_process_maps_are_counted() -> None:
    """accepts, fd_writes and wait_hist at one entry each, taken by a process that is
    not there: every accept, write and ended wait of the fixture is counted as lost."""
    probes = KernelProbes(
        map_sizes={
            "MAX_ACCEPTS": 1,
            "MAX_FD_WRITES": 1,
            "MAX_HIST": 1,
            "MAX_FD_WRITES_PER_PROCESS": 16,  # the map full, not the process's share
        }
    )
    try:
        for name, key in ((b"accepts", (0,)), (b"fd_writes", (0, 0)), (b"wait_hist", (0, 0))):
            table = probes._bpf[name]
            table[table.Key(*key)] = table.Leaf()
        seen = Seen(probes)
        with Fixture.c("listen_write", "2", ready="STARTED") as fx:
            probes.watch([fx.pid])
            port, _, _ = start_server(fx)
            connect(port, 2)
            fx.wait_for("READY")
            # write 3 to the file; LISTENING and READY to stdout (READY may still be in flight)
            seen.until(lambda s: s.last.counters["fd_writes_full"] == 5, "5 writes lost")
        r = seen.last
        assert (r.counters["accepts_full"], r.counters["hist_full"]) == (2, 1), r.counters
        assert fx.pid not in r.accepts and fx.pid not in r.writes, r
        assert fx.pid not in r.wait_histogram, r.wait_histogram
    finally:
        probes.close()


def test_program_stats_count_runs_once_enabled(open_probes: OpenProbes) -> None:
    probes = open_probes()
    names = set(probes.program_stats())
    for syscall in ("futex", "bind", "listen", "write", "writev", "pwrite64", "sendto"):
        assert {f"sys_enter_{syscall}", f"sys_exit_{syscall}"} <= names, names
    assert {"sys_exit_accept", "sys_exit_accept4"} <= names, names
    restore = probes.enable_stats()
    assert callable(restore), "enable_stats() could not turn stats on as root"
    try:
        # One futex call of our own runs both futex programs at least once.
        word = ctypes.c_uint32(0)
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall(SYS_FUTEX, ctypes.byref(word), FUTEX_WAKE, 1, None, None, 0)
        stats = probes.program_stats()
    finally:
        restore()
    for name in ("sys_enter_futex", "sys_exit_futex"):
        assert stats[name].run_count > 0 and stats[name].run_seconds > 0, stats


def test_compile_errors_name_the_real_file(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    for name in (*BPF_SOURCES, "hangwatch.h"):
        shutil.copy(BPF_DIR / name, tmp_path / name)
    io = tmp_path / "io.bpf.c"
    io.write_text("static int hw_broken(void) { return not_declared_anywhere; }\n" + io.read_text())
    with pytest.raises(KernelFeatureError):
        KernelProbes(bpf_dir=tmp_path)
    err = capfd.readouterr().err
    assert f"{io}:1:" in err and "not_declared_anywhere" in err, err


# --- many writes: counted exactly (their cost is measured by `make bench`) -----------------


def write_loop_reading(probes: KernelProbes, calls: int, watch: bool) -> ProbeReading:
    """The reading after a fresh write_loop's ``calls`` one-byte writes to /dev/null;
    asserts the probe kept exactly its writes when watched, and nothing otherwise."""
    with Fixture.c("write_loop", str(calls), ready="STARTED") as fx:
        if watch:
            probes.watch([fx.pid])
        fx.send("go")
        fx.wait_for("READY", timeout=HANG_S)
        r = probes.read()
        probes.watch([])
        probes.forget_processes([fx.pid])
        devnull = fx.info.get_int("fd")
        got = r.writes.get(fx.pid, {}).get(devnull)
        if watch:
            assert got is not None and (got.bytes, got.calls) == (calls, calls), got
        else:
            assert got is None, got
    return r


def test_many_writes_counted_exactly_when_watched_only(open_probes: OpenProbes) -> None:
    probes = open_probes()
    write_loop_reading(probes, 20_000, watch=False)
    assert_nothing_lost(write_loop_reading(probes, 20_000, watch=True))
