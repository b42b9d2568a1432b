"""The PyTorch jobs really are in the shape they claim, judged from /proc alone.

hangwatch will be tested against these jobs (tests/realsw/README.md has the table of shapes and
their truth); this file makes sure the truth holds first: a hang shape is parked (its processes
use next to no CPU over a window, every thread sleeps in a wait syscall) and a healthy one works
(CPU time grows, ``STEP`` lines arrive). No BPF, no root: reading a child's
/proc/PID/task/TID/syscall only needs ptrace access to it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from functools import partial

from scripts import realsw
from scripts.fixturelib import tasks, thread_cpu_ticks, thread_state, thread_syscall, wait_until

CLK_TCK = os.sysconf("SC_CLK_TCK")
HANG_WINDOW = 3.0  # seconds a hang shape is watched for CPU use
WORK_WINDOW = 1.5  # seconds a healthy shape is watched
PARKED_CPU = 0.05  # a parked process uses at most this share of one CPU (gloo's loop: ~0.3 %)
BUSY_CPU = 0.25  # a computing one at least this share (alone it takes ~100 %)
BUSY_PATIENCE = 10.0  # seconds it may take to get that much CPU on a loaded host

# x86-64 syscall numbers of the waits a parked thread may sit in.
WAITS = {
    7: "poll",
    35: "nanosleep",
    202: "futex",
    219: "restart_syscall",
    230: "clock_nanosleep",
    232: "epoll_wait",
    271: "ppoll",
    281: "epoll_pwait",
    441: "epoll_pwait2",
}
SYS_POLL, SYS_FUTEX, SYS_CLOCK_NANOSLEEP = 7, 202, 230


def comm(pid: int, tid: int) -> str:
    try:
        with open(f"/proc/{pid}/task/{tid}/comm") as f:
            return f.read().strip()
    except (FileNotFoundError, ProcessLookupError):
        return "-"


def syscall_of(pid: int, tid: int) -> tuple[int, list[int]] | None:
    """``(nr, args)`` of a sleeping thread's syscall; None when it runs or is gone."""
    try:
        if thread_state(pid, tid) not in ("S", "D"):
            return None
        words = thread_syscall(pid, tid).split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    if len(words) < 7 or not words[0].isdigit():
        return None
    return int(words[0]), [int(w, 16) for w in words[1:7]]


def describe_threads(pids: Iterable[int]) -> str:
    rows = []
    for pid in pids:
        for tid in tasks(pid):
            sc = syscall_of(pid, tid)
            what = "running" if sc is None else WAITS.get(sc[0], f"syscall {sc[0]}")
            rows.append(f"  {pid}/{tid} {comm(pid, tid)}: {thread_state(pid, tid)} {what}")
    return "\n".join(rows)


def all_waiting(pid: int) -> bool:
    """Every thread of ``pid`` sleeps in one of :data:`WAITS` right now."""
    tids = tasks(pid)
    return bool(tids) and all((sc := syscall_of(pid, t)) and sc[0] in WAITS for t in tids)


def main_thread_in(pid: int, nr: int) -> bool:
    sc = syscall_of(pid, pid)
    return sc is not None and sc[0] == nr


def _ticks(pids: Iterable[int]) -> dict[tuple[int, int], int]:
    out = {}
    for pid in pids:
        for tid in tasks(pid):
            try:
                out[pid, tid] = thread_cpu_ticks(pid, tid)
            except (FileNotFoundError, ProcessLookupError):
                continue
    return out


def cpu_over(pids: list[int], window: float) -> dict[int, dict[int, int]]:
    """Clock ticks each thread of ``pids`` used during ``window`` seconds: {pid: {tid: ticks}}."""
    before = _ticks(pids)
    time.sleep(window)
    return used_since(before, pids)


def used_since(before: dict[tuple[int, int], int], pids: list[int]) -> dict[int, dict[int, int]]:
    """Clock ticks each thread of ``pids`` used since ``before`` (a ``_ticks`` read)."""
    used: dict[int, dict[int, int]] = {pid: {} for pid in pids}
    for (pid, tid), ticks in _ticks(pids).items():
        used[pid][tid] = ticks - before.get((pid, tid), 0)
    return used


def report(used: dict[int, dict[int, int]]) -> str:
    return "\n".join(
        f"  {pid}/{tid} {comm(pid, tid)}: {ticks} ticks"
        for pid, threads in used.items()
        for tid, ticks in threads.items()
    )


def assert_parked(job: realsw.Job, pids: list[int], window: float = HANG_WINDOW) -> None:
    """Each process in ``pids`` used at most PARKED_CPU of a CPU and then sleeps in a wait."""
    used = cpu_over(pids, window)
    limit = PARKED_CPU * window * CLK_TCK
    for pid in pids:
        assert sum(used[pid].values()) <= limit, (
            f"{job.shape}: process {pid} used more than {limit:.0f} ticks in {window} s; "
            f"not parked:\n{report(used)}"
        )
    for pid in pids:
        try:
            wait_until(partial(all_waiting, pid), 5, f"every thread of {pid} sleeping in a wait")
        except AssertionError as e:
            raise AssertionError(f"{job.shape}: {e}; now:\n{describe_threads(pids)}") from None
    assert not job.seen("UNEXPECTED"), job.describe("the hang ended")


def assert_computing(
    job: realsw.Job, pids: list[int], window: float = WORK_WINDOW, patience: float = BUSY_PATIENCE
) -> None:
    """Each process in ``pids`` used BUSY_CPU of one CPU's ``window`` seconds, within
    ``patience`` seconds: the suite runs side by side on few cores, so a computing rank may
    get its share later; a parked one never uses it."""
    floor = BUSY_CPU * window * CLK_TCK
    before = _ticks(pids)
    deadline = time.monotonic() + patience
    while True:
        time.sleep(0.25)
        used = used_since(before, pids)
        slow = [pid for pid in pids if sum(used[pid].values()) < floor]
        if not slow:
            return
        assert time.monotonic() < deadline, (
            f"{job.shape}: process {slow} used less than {floor:.0f} ticks in {patience} s; "
            f"not computing:\n{report(used)}"
        )


# --- hang shapes: stalled ----------------------------------------------------------------------


def test_allreduce_peer_gone_is_parked() -> None:
    with realsw.torchrun_job("allreduce_peer_gone") as job:
        ranks = job.ranks(2)
        waiter, gone = ranks[0].get_int("pid"), ranks[1].get_int("pid")
        # READY comes just before the call; the main thread then parks inside all_reduce.
        wait_until(lambda: main_thread_in(waiter, SYS_FUTEX), 10, "rank 0 parked in all_reduce")
        assert_parked(job, [job.pid, waiter, gone])
        # C++ work.wait() without a timeout; the process group timeout is on gloo's side.
        sc = syscall_of(waiter, waiter)
        assert sc is not None and sc[0] == SYS_FUTEX and sc[1][3] == 0, (
            f"rank 0 not in futex without a timeout:\n{describe_threads([waiter])}"
        )
        assert main_thread_in(gone, SYS_FUTEX), describe_threads([gone])


def test_rendezvous_peer_missing_is_parked() -> None:
    with realsw.direct_job("rendezvous_peer_missing") as job:
        (line,) = job.ready_lines(1)
        pid = line.get_int("pid")
        wait_until(lambda: realsw.listening(job.port), 30, f"the TCPStore on port {job.port}")
        # The store's master polls for its workers: check + get on its own store, then 10 ms
        # of clock_nanosleep, over and over. Parked, but never for long.
        wait_until(lambda: main_thread_in(pid, SYS_CLOCK_NANOSLEEP), 10, "the rendezvous poll")
        assert_parked(job, [pid])


def test_torchrun_missing_node_is_parked() -> None:
    with realsw.missing_node_job() as job:
        wait_until(lambda: realsw.listening(job.port), realsw.START_TIMEOUT, "torchrun's store")
        assert_parked(job, [job.pid])
        assert realsw.descendants(job.pid) == [], "torchrun started workers without node 1"


def test_dataloader_worker_stuck_is_parked() -> None:
    with realsw.direct_job("dataloader_worker_stuck") as job:
        lines = {line["role"]: line.get_int("pid") for line in job.ready_lines(2)}
        main, worker = lines["main"], lines["worker"]
        assert worker in realsw.descendants(main)
        # The main process polls the worker's result pipe with a 5 s timeout (then checks that
        # the worker lives and polls again); the worker sits in our Event.
        wait_until(lambda: main_thread_in(main, SYS_POLL), 10, "main waiting for the batch")
        # The worker prints READY just before it blocks: give it the moment to get there.
        wait_until(lambda: main_thread_in(worker, SYS_FUTEX), 10, "the worker in our Event")
        assert_parked(job, [main, worker])


# --- healthy shapes: progressing --------------------------------------------------------------


def test_compute_before_collective_progresses() -> None:
    with realsw.torchrun_job("compute_before_collective") as job:
        ranks = job.ranks(2)
        assert_computing(job, [ranks[0].get_int("pid"), ranks[1].get_int("pid")])


def test_barrier_behind_compute_progresses() -> None:
    compute_s = 2.0
    with realsw.torchrun_job("barrier_behind_compute", "--compute-seconds", str(compute_s)) as job:
        ranks = job.ranks(2)
        waiter, computer = ranks[0].get_int("pid"), ranks[1].get_int("pid")
        wait_until(lambda: main_thread_in(waiter, SYS_FUTEX), 10, "rank 0 parked in barrier")
        used = cpu_over([waiter, computer], 1.0)
        assert sum(used[waiter].values()) <= PARKED_CPU * CLK_TCK, report(used)
        assert sum(used[computer].values()) >= BUSY_CPU * CLK_TCK, report(used)
        # The barrier lets rank 0 through once rank 1 is done: a wait, not a hang.
        step = job.wait_for("STEP", timeout=compute_s + 30)
        assert float(step["waited"]) >= compute_s * 0.5, step.line


def test_training_loop_progresses() -> None:
    with realsw.torchrun_job("training_loop") as job:
        ranks = job.ranks(2)
        # The first step builds gloo's pairs: slow on a loaded host
        first = job.wait_for("STEP", timeout=120)
        second = job.wait_for("STEP", timeout=60)
        assert second.get_int("step") > first.get_int("step")
        assert_computing(job, [ranks[0].get_int("pid"), ranks[1].get_int("pid")])
