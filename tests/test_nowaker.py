"""agent.analysis.nowaker: a process no thread of which can ever be woken, proven from two reads."""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import replace

from agent.analysis.classify import classify_service
from agent.analysis.nowaker import no_waker
from agent.analysis.progress import ProcessProgress
from agent.analysis.verdict import DEADLOCKED, STALLED, ProcessFacts, ServiceFacts
from agent.model import FutexWait, ProbeReading, Snapshot, ThreadSample
from agent.observe.observer import Observer, Scope
from agent.observe.sampler import Sampler
from agent.report.sentences import reasons
from tests.synth import parked, process

EPOLL, CLOCK_NANOSLEEP, READ = 232, 230, 0


def forever(tid: int, uaddr: int, cpu: int = 0) -> ThreadSample:
    """Blocked in futex, no timeout, process-private: what a Python lock acquire looks like."""
    return replace(parked(tid, uaddr, cpu=cpu), timed=False, private_futex=True)


def abba(pid: int = 10, cpu: int = 0):
    """Main joining two workers, each waiting for the lock the other holds."""
    return process(pid, forever(pid, 0x100), forever(pid + 1, 0x200, cpu), forever(pid + 2, 0x300))


def test_a_python_lock_cycle_with_the_main_thread_joining_has_no_waker():
    assert no_waker(abba(), abba())


def test_one_read_is_not_a_proof():
    assert not no_waker(None, abba())


def test_a_child_forked_with_a_lock_held_has_no_waker():
    child = process(20, forever(20, 0x100))
    assert no_waker(child, child)


def test_any_thread_that_can_be_woken_from_outside_breaks_the_proof():
    base = abba()
    ways = {
        "timed futex": replace(base.threads[1], timed=True),
        "unknown flag and mapping": replace(base.threads[1], private_futex=None),
        "epoll": replace(base.threads[1], syscall=EPOLL, wait=None, timed=False),
        "read": replace(base.threads[1], syscall=READ, wait=None, timed=False),
        "sleep": replace(base.threads[1], syscall=CLOCK_NANOSLEEP, wait=None, timed=True),
        "running": ThreadSample(11, "w", "R", 0),
        "traced": replace(base.threads[1], state="t"),
        "futex_waitv": replace(
            base.threads[1], wait=FutexWait(0, 0, 0, vector=True), private_futex=None
        ),
    }
    for what, t in ways.items():
        p = replace(base, threads=(base.threads[0], t, base.threads[2]))
        assert not no_waker(p, p), what


def test_a_thread_that_ran_or_moved_between_the_reads_breaks_the_proof():
    assert not no_waker(abba(cpu=0), abba(cpu=1_000))  # it used CPU: something woke it
    moved = process(10, forever(10, 0x100), forever(11, 0x999), forever(12, 0x300))
    assert not no_waker(abba(), moved)
    fewer = process(10, forever(10, 0x100), forever(11, 0x200))
    assert not no_waker(fewer, abba())
    reused = replace(abba(), start_ticks=999)  # the PID now names another process
    assert not no_waker(reused, abba())


class _TimersOf:
    """Only what the observer reads of a proven process: whether it holds a POSIX timer."""

    def __init__(self, pids: set[int]) -> None:
        self.pids = pids

    def has_posix_timers(self, pid: int) -> bool:
        return pid in self.pids


class _Frozen(Sampler):
    """Always the same snapshot: the lock cycle of abba(), as process 10."""

    def snapshot(self, pids: Iterable[int], probe: ProbeReading | None = None) -> Snapshot:
        return Snapshot(10**9, 1e9, {10: abba()})


def test_a_posix_timer_could_send_a_signal():
    for timers, want in ((set(), {10}), ({10}, set())):
        obs = Observer(_Frozen(_TimersOf(timers)), None)  # type: ignore[arg-type]
        obs.observe(Scope({10: [10]}))
        assert obs.observe(Scope({10: [10]})).no_waker == want, timers


def test_random_processes_have_no_waker_exactly_when_every_thread_waits_forever_privately():
    """Property, over random processes: no waker iff every thread is a private, untimed futex
    wait that is the same in both reads; never when any thread is anything else."""
    rng = random.Random(13)
    kinds = ["forever", "timed", "shared", "epoll", "running", "sleep"]
    seen = {True: 0, False: 0}
    for case in range(500):
        n = rng.randint(1, 6)
        picks = [rng.choice(kinds) if rng.random() < 0.5 else "forever" for _ in range(n)]
        threads = []
        for i, kind in enumerate(picks):
            t = forever(100 + i, 0x1000 + 8 * rng.randint(0, 3))
            if kind == "timed":
                t = replace(t, timed=True)
            elif kind == "shared":  # no private flag, and the word in a shared mapping
                t = replace(t, private_futex=False, wait=replace(t.wait, uaddr=0x9000 + i))
            elif kind == "epoll":
                t = replace(t, syscall=EPOLL, wait=None)
            elif kind == "running":
                t = ThreadSample(t.tid, "r", "R", 0)
            elif kind == "sleep":
                t = replace(t, syscall=CLOCK_NANOSLEEP, wait=None, timed=True)
            threads.append(t)
        p = process(100, *threads, word_ids={0x9000 + i: ("shared", "0:5", 1, i) for i in range(6)})
        want = all(k == "forever" for k in picks)
        assert no_waker(p, p) == want, (case, picks)
        seen[want] += 1
        if want:  # the same process, one thread having run in between: no proof
            i = rng.randrange(n)
            ran = list(threads)
            ran[i] = replace(ran[i], cpu_ns=ran[i].cpu_ns + 1)
            assert not no_waker(p, replace(p, threads=tuple(ran))), case
    assert seen[True] > 50 and seen[False] > 50, seen


def test_a_process_with_no_waker_makes_its_service_deadlocked_at_once():
    """Parked for 0.5 s, far under the threshold: the proof needs no waiting."""
    server = process(10, parked(10, 0x50))  # the front-end, waiting on the scheduler
    stuck = abba(pid=20)
    prog = ProcessProgress(pid=0, window_ns=5 * 10**9)
    facts = [
        ProcessFacts(server, replace(prog, pid=10), 1, 0.5),
        ProcessFacts(stuck, replace(prog, pid=20), 3, 0.5, no_waker=True),
    ]
    v = classify_service(10, facts, 60, evidence=ServiceFacts())
    assert v.state == DEADLOCKED, reasons(v.reasons)
    assert v.culprit is not None and v.culprit.pid == 20 and v.culprit.why == "no waker"
    assert any("only a signal can end it" in r for r in reasons(v.reasons))
    assert [p.state for p in v.processes] == [DEADLOCKED, DEADLOCKED]
    calm = [replace(f, no_waker=False) for f in facts]
    assert classify_service(10, calm, 60).state != DEADLOCKED
    assert classify_service(10, calm, 0.4).state == STALLED


def test_a_join_without_the_private_flag_counts_only_in_a_private_mapping():
    """pthread_join waits on the TID word without FUTEX_PRIVATE_FLAG; in a private mapping
    no other process can reach it, in a shared one another process could wake it."""
    joining = replace(forever(10, 0x100), private_futex=False)
    p = process(10, joining, forever(11, 0x200))
    assert no_waker(p, p)
    shared = replace(p, word_ids={0x100: ("shared", "00:05", 7, 0)})
    assert not no_waker(shared, shared)
