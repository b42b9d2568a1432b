"""agent.sources.pystacks: Python stacks read with py-spy --nonblocking; agent.analysis.stacks: grouped
by the line of the program's own code where threads wait, and the Python lock-cycle hint. Pure: synthetic
samples and a hard-coded dump in py-spy's own JSON shape. tests/host/test_stacks.py runs
stand-in readers (shell scripts) for the ways a real py-spy fails, and
tests/privileged/test_stacks.py the real one."""

from __future__ import annotations

import json
import os
import re
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.analysis import evidence as ev
from agent.analysis.stacks import (
    group_stacks,
    lock_cycle_hint,
    lock_waiters,
    stack_facts,
    wait_of,
)
from agent.model import NAME_SHOWN_MAX, ProcessSample, ThreadSample, printable
from agent.report.sentences import reasons, wait_words
from agent.sources import pystacks
from agent.sources.procfs import ProcFS
from agent.sources.pystacks import (
    MAX_FRAMES,
    PyFrame,
    PyThread,
    StackRead,
    is_python,
    parse_dump,
)
from tests.synth import S, parked, process, running

PROC = ProcFS()
EPOLL_WAIT = 232
LIB = "/usr/lib/python3.11"  # where Debian's CPython keeps its standard library
APP = "/srv/app"


def frame(function: str, file: str, line: int, code: str | None = None) -> PyFrame:
    return PyFrame(function, file, os.path.basename(file), line, code)


# A worker parked in Queue.get, innermost first, as py-spy shows it.
COND_WAIT = frame("Condition.wait", f"{LIB}/threading.py", 320, "waiter.acquire()")
QUEUE_GET = frame("Queue.get", f"{LIB}/queue.py", 171, "self.not_empty.wait()")
EVENT_LOOP = frame("event_loop", f"{APP}/scheduler.py", 212, "item = self.queue.get()")
BOOTSTRAP = (
    frame("Thread.run", f"{LIB}/threading.py", 975, "self._target(*self._args, **self._kwargs)"),
    frame("Thread._bootstrap_inner", f"{LIB}/threading.py", 1038, "self.run()"),
    frame("Thread._bootstrap", f"{LIB}/threading.py", 995, "self._bootstrap_inner()"),
)
QUEUE_STACK = (COND_WAIT, QUEUE_GET, EVENT_LOOP, *BOOTSTRAP)

# Two threads of an ABBA cycle, each at the line that takes its second lock.
EVICT = frame("Scheduler.evict", f"{APP}/sched.py", 154, "with self.b:")
UPDATE = frame("Scheduler.update", f"{APP}/sched.py", 160, "with self.a:")
CALLER = frame("Scheduler.step", f"{APP}/sched.py", 120, "self.evict()")


def py(tid: int, *frames: PyFrame, name: str | None = None, gil: bool = False) -> PyThread:
    return PyThread(tid, name, gil, tuple(frames))


def untimed(tid: int, uaddr: int, since: int = 100 * S, name: str = "worker") -> ThreadSample:
    """Parked in futex with no timeout, process-private: a Python lock or condition wait."""
    return replace(parked(tid, uaddr, since=since, name=name), timed=False, private_futex=True)


def in_epoll(tid: int, name: str = "io") -> ThreadSample:
    return ThreadSample(tid, name, "S", 0, last_ran_ns=S, syscall=EPOLL_WAIT, timed=False)


# --- PyFrame.stdlib and PyThread.site ---------------------------------------------------------


def test_the_site_of_a_queue_wait_is_the_programs_own_line_and_what_it_called():
    worker = py(11, *QUEUE_STACK)
    assert worker.site() == ("Queue.get", EVENT_LOOP)


def test_a_lock_taken_straight_from_the_programs_code_has_no_callee():
    assert py(21, EVICT, CALLER, *BOOTSTRAP).site() == (None, EVICT)


def test_all_standard_library_gives_the_innermost_frame_and_no_frames_give_none():
    assert py(1, COND_WAIT, *BOOTSTRAP).site() == (None, COND_WAIT)
    assert py(1).site() is None


def test_third_party_code_is_the_programs_own_not_the_standard_library():
    torch = frame("Work.wait", "/srv/venv/lib/python3.11/site-packages/torch/dist.py", 40)
    debian = frame("Pool.get", "/usr/lib/python3/dist-packages/redis/pool.py", 9)
    for f in (torch, debian, EVENT_LOOP):
        assert not f.stdlib, f.file
    assert py(5, COND_WAIT, torch, *BOOTSTRAP).site() == ("Condition.wait", torch)


@pytest.mark.parametrize(
    "path",
    [
        f"{LIB}/threading.py",
        "/usr/local/lib/python3.12/queue.py",
        "/root/.pyenv/versions/3.11.7/lib/python3.11/threading.py",
        "/opt/conda/lib/python3.10/concurrent/futures/thread.py",
        "<frozen importlib._bootstrap>",
    ],
)
def test_standard_library_files_are_told(path: str):
    assert frame("f", path, 1).stdlib


def test_a_lib64_standard_library_is_the_standard_library():
    threading_py = "/usr/lib64/python3.12/threading.py"
    assert frame("Condition.wait", threading_py, 355, "waiter.acquire()").stdlib
    # What it costs: two idle Queue.get workers there, parked on their own waiter locks (each
    # waiter has its own word) at `waiter.acquire()`, read as a Python lock cycle.
    cond = frame("Condition.wait", threading_py, 355, "waiter.acquire()")
    get = frame("Queue.get", "/usr/lib64/python3.12/queue.py", 180, "self.not_empty.wait()")
    sample = process(10, untimed(11, 0x1100), untimed(12, 0x1200))
    stacks = {t: py(t, cond, get, EVENT_LOOP) for t in (11, 12)}
    assert lock_cycle_hint(lock_waiters(sample, stacks)) == []


# --- parse_dump -------------------------------------------------------------------------------

# The shape of `py-spy dump --nonblocking --json --pid P` (py-spy 0.4.3), cut down: a Queue.get
# worker, a thread at a `with` line, the main thread holding the GIL, and a thread py-spy
# could not tie to an OS thread.
DUMP = """[
  {"pid": 4242, "thread_id": 140443338618560, "thread_name": "worker-0",
   "os_thread_id": 4244, "active": false, "owns_gil": false,
   "frames": [
     {"name": "Condition.wait", "filename": "/usr/lib/python3.11/threading.py", "module": null,
      "short_filename": "threading.py", "line": 327, "locals": null, "is_entry": false,
      "is_shim_entry": false},
     {"name": "Queue.get", "filename": "/usr/lib/python3.11/queue.py", "module": null,
      "short_filename": "queue.py", "line": 171, "locals": null, "is_entry": false,
      "is_shim_entry": false},
     {"name": "serve_forever", "filename": "/srv/app/server.py", "module": null,
      "short_filename": "server.py", "line": 4, "locals": null, "is_entry": true,
      "is_shim_entry": false},
     {"name": "Thread._bootstrap", "filename": "/usr/lib/python3.11/threading.py",
      "module": null, "short_filename": "threading.py", "line": 1002, "locals": null,
      "is_entry": true, "is_shim_entry": true}
   ], "process_info": null},
  {"pid": 4242, "thread_id": 140443330209472, "thread_name": "Thread-1 (take)",
   "os_thread_id": 4245, "active": false, "owns_gil": false,
   "frames": [
     {"name": "take", "filename": "/srv/app/server.py", "module": null,
      "short_filename": "server.py", "line": 8, "locals": null, "is_entry": true,
      "is_shim_entry": false}
   ], "process_info": null},
  {"pid": 4242, "thread_id": 140443352664960, "thread_name": "MainThread",
   "os_thread_id": 4242, "active": true, "owns_gil": true,
   "frames": [
     {"name": "<module>", "filename": "/srv/app/server.py", "module": null,
      "short_filename": "server.py", "line": 12, "locals": null, "is_entry": true,
      "is_shim_entry": true}
   ], "process_info": null},
  {"pid": 4242, "thread_id": 140443000000000, "thread_name": null,
   "os_thread_id": null, "active": false, "owns_gil": false, "frames": [],
   "process_info": null}
]"""


def test_a_dump_is_read_by_os_thread_id_innermost_first():
    threads = parse_dump(4242, DUMP)
    assert sorted(threads) == [4242, 4244, 4245]  # the one with no OS thread id is left out
    worker = threads[4244]
    assert worker.name == "worker-0" and not worker.owns_gil
    assert [(f.function, f.short, f.line) for f in worker.frames] == [
        ("Condition.wait", "threading.py", 327),
        ("Queue.get", "queue.py", 171),
        ("serve_forever", "server.py", 4),
        ("Thread._bootstrap", "threading.py", 1002),
    ]
    assert worker.frames[2].file == "/srv/app/server.py"
    assert worker.site() == ("Queue.get", worker.frames[2])
    assert threads[4242].owns_gil and threads[4242].name == "MainThread"
    assert all(f.code is None for t in threads.values() for f in t.frames)  # no SourceLines


def test_a_thread_without_an_os_thread_id_key_is_left_out():
    text = json.dumps([{"thread_name": "x", "owns_gil": False, "frames": []}])
    assert parse_dump(1, text) == {}


def test_frames_are_capped():
    deep = [
        {"name": f"f{i}", "filename": f"/srv/app/m{i}.py", "short_filename": f"m{i}.py", "line": i}
        for i in range(MAX_FRAMES + 5)
    ]
    text = json.dumps(
        [{"os_thread_id": 7, "thread_name": "deep", "owns_gil": False, "frames": deep}]
    )
    frames = parse_dump(1, text)[7].frames
    assert len(frames) == MAX_FRAMES
    assert frames[0].function == "f0" and frames[-1].function == f"f{MAX_FRAMES - 1}"


# --- group_stacks -----------------------------------------------------------------------------


def test_threads_with_the_same_stack_and_wait_are_one_group():
    sample = process(10, *(untimed(t, 0x1000 + t) for t in (11, 12, 13)))
    stacks = {t: py(t, *QUEUE_STACK, name=f"worker-{t}") for t in (11, 12, 13)}
    groups, bare = group_stacks(sample, stacks)
    assert bare == []
    assert [g.tids for g in groups] == [(11, 12, 13)]
    assert groups[0].wait == UNTIMED_FUTEX
    assert wait_words(groups[0].wait) == "in futex WAIT with no timeout"
    assert groups[0].names == ("worker-11", "worker-12", "worker-13")
    assert groups[0].thread.frames == QUEUE_STACK


def test_the_same_stack_with_a_timed_and_an_untimed_wait_splits():
    sample = process(10, untimed(11, 0x1100), replace(untimed(12, 0x1200), timed=True))
    stacks = {t: py(t, *QUEUE_STACK) for t in (11, 12)}
    groups, _ = group_stacks(sample, stacks)
    assert sorted((g.tids, wait_words(g.wait)) for g in groups) == [
        ((11,), "in futex WAIT with no timeout"),
        ((12,), "in futex WAIT with a timeout"),
    ]


def test_threads_without_python_stacks_are_returned_apart():
    sample = process(10, untimed(11, 0x1100), in_epoll(30), in_epoll(31))
    groups, bare = group_stacks(sample, {11: py(11, *QUEUE_STACK)})
    assert [g.tids for g in groups] == [(11,)]
    assert bare == [30, 31]


def test_the_gil_holder_comes_first_then_the_larger_groups():
    busy = frame("tokenize", f"{APP}/model.py", 88, "ids = self.tok(text)")
    sample = process(
        10,
        *(untimed(t, 0x1000 + t) for t in (11, 12, 13)),
        untimed(21, 0xB0),
        untimed(22, 0xB0),
        running(40),
    )
    stacks = {t: py(t, *QUEUE_STACK) for t in (11, 12, 13)}
    stacks |= {21: py(21, EVICT, CALLER), 22: py(22, EVICT, CALLER), 40: py(40, busy, gil=True)}
    groups, _ = group_stacks(sample, stacks)
    assert [g.tids for g in groups] == [(40,), (11, 12, 13), (21, 22)]
    assert [g.gil for g in groups] == [40, None, None]
    assert groups[0].wait == ev.ThreadWait("running")


def test_thread_names_come_from_py_spy_else_from_the_sample():
    sample = process(10, untimed(11, 0x1100, name="comm-11"), untimed(12, 0x1200))
    groups, _ = group_stacks(sample, {11: py(11, EVICT), 12: py(12, EVICT, name="evictor")})
    assert groups[0].names == ("comm-11", "evictor")


UNTIMED_FUTEX = ev.ThreadWait("syscall", "futex", "futex", "WAIT", False)
UNTIMED_EPOLL = ev.ThreadWait("syscall", "epoll_wait", "io", None, False)


def test_wait_words():
    def said(t: ThreadSample | None) -> str:
        return wait_words(wait_of(t))

    assert said(None) == "gone"
    assert said(running(1)) == "running"
    assert said(ThreadSample(1, "w", "S", 0)) == "blocked"
    assert said(untimed(1, 0x10)) == "in futex WAIT with no timeout"
    assert said(parked(1)) == "in futex WAIT"  # timed unknown
    assert said(in_epoll(1)) == "in epoll_wait with no timeout"
    assert wait_of(untimed(1, 0x10)) == UNTIMED_FUTEX
    assert wait_of(in_epoll(1)) == UNTIMED_EPOLL


# --- lock_waiters and lock_cycle_hint ---------------------------------------------------------

# What a thread can be, for the property tests: only LOCK is a lock waiter.
LOCK, TIMED, UNKNOWN_TIMEOUT, EPOLL, RUNNING = "lock", "timed", "unknown", "epoll", "running"
STDLIB, NOT_A_LOCK_LINE, NO_CODE, NO_STACK, NO_FRAMES, UNDATED = (
    "stdlib",
    "line",
    "nocode",
    "nostack",
    "noframes",
    "undated",
)
KINDS = [
    LOCK,
    TIMED,
    UNKNOWN_TIMEOUT,
    EPOLL,
    RUNNING,
    STDLIB,
    NOT_A_LOCK_LINE,
    NO_CODE,
    NO_STACK,
    NO_FRAMES,
    UNDATED,
]
LOCK_LINES = ["with self.a:", "with cache_lock:", "async with self.b:", "self.lock.acquire()"]


def build(
    spec: list[tuple[str, int, int, str]],
) -> tuple[ProcessSample, dict[int, PyThread], set[int]]:
    """A process from (kind, word, last ran, lock line) per thread; the TIDs of its LOCKs."""
    threads, stacks, locks = [], {}, set()
    for i, (kind, word, ran, code) in enumerate(spec):
        tid = 100 + i
        t = untimed(tid, word, since=ran)
        inner = frame("Store.put", f"{APP}/store.py", 40 + i, code)
        if kind == TIMED:
            t = replace(t, timed=True)
        elif kind == UNKNOWN_TIMEOUT:
            t = replace(t, timed=None)
        elif kind == EPOLL:
            t = replace(t, syscall=EPOLL_WAIT, wait=None)
        elif kind == RUNNING:
            t = replace(t, state="R", syscall=None)
        elif kind == STDLIB:
            inner = frame("Condition.wait", f"{LIB}/threading.py", 320, "waiter.acquire()")
        elif kind == NOT_A_LOCK_LINE:
            inner = replace(inner, code="item = self.queue.get()")
        elif kind == NO_CODE:
            inner = replace(inner, code=None)
        elif kind == UNDATED:
            t = replace(t, last_ran_ns=None)
        threads.append(t)
        if kind != NO_STACK:
            stacks[tid] = py(tid) if kind == NO_FRAMES else py(tid, inner, CALLER)
        if kind == LOCK:
            locks.add(tid)
    return process(10, *threads), stacks, locks


specs = st.lists(
    st.tuples(
        st.sampled_from(KINDS),
        st.sampled_from([0xA0, 0xB0, 0xC0]),
        st.integers(0, 10 * S),
        st.sampled_from(LOCK_LINES),
    ),
    max_size=10,
)


@given(specs)
def test_lock_waiters_are_exactly_the_untimed_futex_waits_at_lock_lines(spec):
    """Never a timed wait, a wait of unknown timeout, one not in futex, a running thread, one
    whose innermost frame is the standard library's or a line that takes no lock."""
    sample, stacks, locks = build(spec)
    waiters = lock_waiters(sample, stacks)
    assert {w.tid for w in waiters} == locks
    for w in waiters:
        t = sample.thread(w.tid)
        assert t is not None and t.wait is not None
        assert w.word == t.wait.uaddr and w.last_ran_ns == t.last_ran_ns
        assert w.frame == stacks[w.tid].frames[0]


@given(specs)
def test_a_hint_names_two_words_or_more_and_only_lock_waiters(spec):
    sample, stacks, locks = build(spec)
    waiters = lock_waiters(sample, stacks)
    hint = lock_cycle_hint(waiters)
    if hint:
        assert len({w.word for w in hint}) >= 2
        assert {w.tid for w in hint} <= locks
        assert all(w in waiters for w in hint)
    # Whenever two lock waiters wait on distinct words, there is a hint, and it has them all.
    if len({w.word for w in waiters}) >= 2:
        assert sorted(w.tid for w in hint) == sorted(locks)
    else:
        assert hint == []


@given(
    st.lists(st.integers(0, 100 * S), min_size=1, max_size=20),
    st.sampled_from([0xA0, 0xB0]),
    specs,
)
def test_waiters_on_a_single_word_never_make_a_hint(moments, word, others):
    """However many threads wait at lock lines on one word, at whatever moments, alone or
    beside threads that are not lock waiters."""
    lone = [(LOCK, word, ran, "with self.a:") for ran in moments]
    rest = [(kind, w, ran, code) for kind, w, ran, code in others if kind != LOCK]
    sample, stacks, _ = build(lone + rest)
    assert lock_cycle_hint(lock_waiters(sample, stacks)) == []


def test_a_hint_needs_two_words():
    sample, stacks, _ = build([(LOCK, 0xA0, S, "with self.a:"), (LOCK, 0xB0, S, "with self.b:")])
    assert len(lock_cycle_hint(lock_waiters(sample, stacks))) == 2
    assert lock_cycle_hint([]) == []


# --- stack_facts and their words --------------------------------------------------------------

WALL = 1_700_000_000.0
MONO = 200 * S
BUSY = frame("generate", f"{APP}/model.py", 88, "out = self.model(batch)")


def scheduler() -> tuple[ProcessSample, StackRead]:
    """Three queue workers, a thread holding the GIL, two threads of an ABBA cycle on two
    words, a native I/O thread with no Python frames."""
    sample = process(
        10,
        running(14, name="MainThread"),
        *(untimed(t, 0x1000 + t, name=f"worker-{t - 11}") for t in (11, 12, 13)),
        untimed(21, 0xB0, since=100 * S, name="evict"),
        untimed(22, 0xA0, since=100 * S + S // 5, name="update"),
        in_epoll(30, name="zmq-io"),
    )
    threads = {t: py(t, *QUEUE_STACK, name=f"worker-{t - 11}") for t in (11, 12, 13)}
    threads[14] = py(14, BUSY, name="MainThread", gil=True)
    threads[21] = py(21, EVICT, CALLER, *BOOTSTRAP, name="evict")
    threads[22] = py(22, UPDATE, CALLER, *BOOTSTRAP, name="update")
    return sample, StackRead(10, threads, seconds=0.02)


def test_stack_facts_are_the_groups_the_native_threads_and_the_lock_hint():
    sample, read = scheduler()
    facts = stack_facts(sample, read, WALL, MONO)
    kinds = [type(f).__name__ for f in facts]
    assert kinds == ["StackGroup"] * 4 + ["NoPythonStack", "PyLockHint"]
    gil, workers, evict, update = facts[:4]
    assert gil == ev.StackGroup(
        pid=10,
        threads=1,
        tids=(14,),
        wait=ev.ThreadWait("running"),
        function="generate",
        file="model.py",
        line=88,
        callee=None,
        code="out = self.model(batch)",
        gil=14,
        names=("MainThread",),
    )
    assert workers == ev.StackGroup(
        pid=10,
        threads=3,
        tids=(11, 12, 13),
        wait=UNTIMED_FUTEX,
        function="event_loop",
        file="scheduler.py",
        line=212,
        callee="Queue.get",
        code="item = self.queue.get()",
        names=("worker-0", "worker-1", "worker-2"),
    )
    assert (evict.tids, evict.function, evict.line, evict.callee, evict.code) == (
        (21,),
        "Scheduler.evict",
        154,
        None,
        "with self.b:",
    )
    assert (update.tids, update.line, update.code) == ((22,), 160, "with self.a:")
    assert facts[4] == ev.NoPythonStack(10, 1, ((UNTIMED_EPOLL, 1),))
    hint = facts[5]
    assert isinstance(hint, ev.PyLockHint)
    assert hint.pid == 10 and hint.words == 2
    assert hint.waits == (
        ev.LockAt(21, "Scheduler.evict", "sched.py", 154, "with self.b:"),
        ev.LockAt(22, "Scheduler.update", "sched.py", 160, "with self.a:"),
    )
    # Dated by the sample's pair of clocks: the later of the two waits, 99.8 s before it.
    assert hint.since_wall == pytest.approx(WALL - 99.8)


def test_the_words_of_stack_facts():
    sample, read = scheduler()
    lines = reasons(stack_facts(sample, read, WALL, MONO))
    assert lines[1].startswith(
        "3 threads at `Queue.get` (scheduler.py:212) in `event_loop`, in futex WAIT with no timeout"
    )
    assert "11 (worker-0), 12 (worker-1), 13 (worker-2)" in lines[1]
    assert "`with self.b:` (sched.py:154) in `Scheduler.evict`" in lines[2]
    assert "thread 14 holds the GIL" in lines[0]
    assert lines[4] == "1 thread with no Python frames (1 in epoll_wait with no timeout)"
    at = time.strftime("%H:%M:%S", time.localtime(WALL - 99.8))
    assert re.fullmatch(
        r"2 threads of process 10 wait .*at `with self\.b:` \(sched\.py:154\) and "
        r"`with self\.a:` \(sched\.py:160\) on 2 lock words.* since (\d\d:\d\d:\d\d).*"
        r"a Python lock cycle\?.*",
        lines[5],
    ), lines[5]
    assert f"since {at}" in lines[5]


def test_groups_past_the_limit_are_counted():
    sample, read = scheduler()
    facts = stack_facts(sample, read, WALL, MONO, max_groups=2)
    assert [type(f).__name__ for f in facts] == [
        "StackGroup",
        "StackGroup",
        "MoreStackGroups",
        "NoPythonStack",
        "PyLockHint",
    ]
    assert facts[2] == ev.MoreStackGroups(2, 2)
    assert reasons(facts)[2] == "and 2 other stacks (2 threads)"


def test_a_read_that_failed_gives_exactly_one_record():
    sample, _ = scheduler()
    read = StackRead(10, error="py-spy timed out after 3 s", seconds=3.0)
    assert stack_facts(sample, read, WALL, MONO) == [
        ev.StacksUnread(10, "py-spy timed out after 3 s")
    ]
    assert reasons(stack_facts(sample, read, WALL, MONO)) == [
        "Python stacks of process 10 not read: py-spy timed out after 3 s"
    ]


def test_no_hint_for_one_thread_at_a_lock_line():
    sample, read = scheduler()
    threads = dict(read.threads)
    threads[22] = py(22, frame("Scheduler.update", f"{APP}/sched.py", 161, "self.a = None"))
    facts = stack_facts(sample, StackRead(10, threads), WALL, MONO)
    assert not any(isinstance(f, ev.PyLockHint) for f in facts)


@given(specs)
def test_every_thread_is_told_once(spec):
    """StackGroup, MoreStackGroups and NoPythonStack together count every thread of the
    sample once (threads py-spy showed with frames)."""
    spec = [s for s in spec if s[0] != NO_FRAMES]
    sample, stacks, _ = build(spec)
    facts = stack_facts(sample, StackRead(10, stacks), WALL, MONO, max_groups=3)
    told = [f.threads for f in facts if isinstance(f, (ev.StackGroup, ev.NoPythonStack))]
    told += [f.threads for f in facts if isinstance(f, ev.MoreStackGroups)]
    assert sum(told) == len(sample.threads)


def test_a_thread_py_spy_shows_with_no_frames_is_still_told():
    sample, read = scheduler()
    sample = replace(sample, threads=(*sample.threads, untimed(50, 0x5000, name="c-ext")))
    read = StackRead(10, {**read.threads, 50: py(50, name="c-ext")})
    facts = stack_facts(sample, read, WALL, MONO)
    told = sum(f.threads for f in facts if isinstance(f, (ev.StackGroup, ev.NoPythonStack)))
    assert told == len(sample.threads)


# --- SourceLines ------------------------------------------------------------------------------


def test_names_a_target_chose_are_made_printable():
    text = json.dumps(
        [
            {
                "os_thread_id": 7,
                "thread_name": "evil\x1b]0;owned\x07",
                "owns_gil": False,
                "frames": [
                    {"name": "f\nhangwatch: fake line", "filename": "/a\u202eb.py", "line": 1}
                ],
            }
        ]
    )
    t = parse_dump(1, text)[7]
    f = t.frames[0]
    # Each character that is not printable shown as "?" (agent.model.printable).
    assert t.name == "evil?]0;owned?"
    assert f.function == "f?hangwatch: fake line" and "\n" not in f.function
    assert f.file == "/a?b.py" and f.short == "a?b.py"


@given(st.text(max_size=300), st.integers(min_value=1, max_value=200) | st.none())
def test_printable_is_one_bounded_line_and_leaves_printable_text_alone(text, limit):
    out = printable(text, limit)
    assert out.isprintable()
    assert limit is None or len(out) <= limit
    if text.isprintable() and (limit is None or len(text) <= limit):
        assert out == text
    assert len(printable("x" * 5000, NAME_SHOWN_MAX)) == NAME_SHOWN_MAX


# --- read_stacks with a stand-in reader -------------------------------------------------------


def test_our_own_interpreter_is_python():
    assert os.path.basename(sys.executable).startswith("python")
    assert is_python(os.getpid(), PROC)


def test_python_is_told_from_the_tree_it_is_given(tmp_path: Path):
    """By its executable's name, else by a mapped libpython (an embedded interpreter)."""
    lib = "7f0000000000-7f0000001000 r-xp 00000000 fe:00 7 /usr/lib/libpython3.11.so.1.0\n"
    for pid, exe, maps in ((1, "/usr/bin/python3.11", ""), (2, "/opt/app/server", lib)):
        (tmp_path / str(pid)).mkdir()
        os.symlink(exe, tmp_path / str(pid) / "exe")
        (tmp_path / str(pid) / "maps").write_text(maps)
    (tmp_path / "3").mkdir()
    os.symlink("/usr/bin/sleep", tmp_path / "3" / "exe")
    tree = ProcFS(str(tmp_path))
    assert is_python(1, tree) and is_python(2, tree)
    assert not is_python(3, tree)  # no maps to read: not Python
    assert not is_python(4, tree)  # gone


# --- the target fixed before the dump, checked after it ---------------------------------------


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.dictionaries(st.sampled_from(["os_thread_id", "frames"]), st.integers(), max_size=2)
        | st.lists(st.text(max_size=3), max_size=2),
        max_size=4,
    ),
    st.sampled_from(["", " ", "\n  "]),
)
def test_a_dump_is_decoded_a_thread_at_a_time_as_a_whole(threads, space):
    text = json.dumps(threads, indent=2 if space else None) + space
    assert list(pystacks._elements(space + text)) == threads
