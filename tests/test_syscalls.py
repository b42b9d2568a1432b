"""What a blocked thread waits in (agent.syscalls): the table checked against itself, from
synthetic syscall lines, and end to end from real lines of /proc/self/task/TID/syscall of
this test process's own threads."""

from __future__ import annotations

import os
import platform
import threading
import time
from collections.abc import Callable

import pytest

from agent import syscalls
from agent.model import SyscallLine
from agent.sources.procfs import parse_stat, parse_syscall
from agent.syscalls import (
    BY_NAME,
    BY_NR,
    CHILD,
    EPOLL,
    FD_LAYOUTS,
    FUTEX,
    FUTEX_PRIVATE_FLAG,
    IO,
    KINDS,
    ONE_FD,
    OTHER,
    POLL,
    SELECT,
    SIGNAL,
    SLEEP,
    SYS_FUTEX,
    SYS_FUTEX_WAIT,
    SYS_FUTEX_WAITV,
    TABLE,
    SyscallWait,
    fd_layout,
    futex_private,
    kind_by_name,
    syscall_name,
    syscall_wait,
    wait_kind,
)

U32_MINUS_1 = 0xFFFFFFFF  # an int -1 as the kernel shows a 64-bit register holding it
U64_MINUS_1 = 0xFFFFFFFFFFFFFFFF  # the same, sign-extended
PTR = 0x7F0000001000  # any non-NULL user pointer


def line(nr: int, *args: int) -> SyscallLine:
    """A syscall line with its six arguments (missing ones 0)."""
    full = (*args, *([0] * (6 - len(args))))
    return SyscallLine(nr, tuple(full), sp=0x7FFC00000000)


def wait(nr: int, *args: int) -> SyscallWait:
    w = syscall_wait(line(nr, *args))
    assert w is not None
    return w


# --- the table itself ------------------------------------------------------------------------


def test_every_entry_of_the_table_is_consistent() -> None:
    assert len(BY_NR) == len(TABLE) and len(BY_NAME) == len(TABLE)  # numbers, names unique
    for s in TABLE:
        assert 0 <= s.nr < 1 << 16 and s.name and s.kind in KINDS, s
        # A timeout argument says how it reads; a sleep is timed with no argument to read.
        if s.timeout_arg is not None:
            assert 0 <= s.timeout_arg < 6 and s.timeout_reads in (syscalls.PTR, syscalls.MS), s
        else:
            assert s.timeout_reads in (None, syscalls.ALWAYS), s
        assert (s.timeout_reads == syscalls.ALWAYS) == (s.kind == SLEEP), s
        # Every syscall with an fd layout waits for I/O, and its timeout is not an fd argument.
        if s.fds is not None:
            assert s.fds in FD_LAYOUTS and s.kind == IO, s
            fd_args = {0} if s.fds in (ONE_FD, EPOLL) else {0, 1}
            assert s.timeout_arg not in fd_args, s
        # Only a futex wait has futex flags, never in its timeout's argument.
        if s.flags_arg is not None:
            assert s.kind == FUTEX and 0 <= s.flags_arg < 6 and s.flags_arg != s.timeout_arg, s


def test_the_futex_syscalls_are_named_once() -> None:
    futexes = {s.nr for s in TABLE if s.kind == FUTEX}
    assert futexes == {SYS_FUTEX, SYS_FUTEX_WAITV, SYS_FUTEX_WAIT} == {202, 449, 455}
    assert {s.name for s in TABLE if s.kind == FUTEX} == {"futex", "futex_waitv", "futex_wait"}
    assert all(kind_by_name(s.name) == s.kind for s in TABLE)
    assert kind_by_name("syscall 999") == OTHER and kind_by_name("no syscall") == OTHER


def test_fd_layouts() -> None:
    assert {nr for nr in BY_NR if fd_layout(nr) == ONE_FD} == {0, 1, 17, 19, 43, 45, 47, 288, 299}
    assert {nr for nr in BY_NR if fd_layout(nr) == EPOLL} == {232, 281, 441}
    assert {nr for nr in BY_NR if fd_layout(nr) == POLL} == {7, 271}
    assert {nr for nr in BY_NR if fd_layout(nr) == SELECT} == {23, 270}
    assert fd_layout(202) is None and fd_layout(426) is None and fd_layout(12345) is None


def test_futex_private_reads_each_calls_flags() -> None:
    assert futex_private(line(202, PTR, 0x80, 0)) is True  # FUTEX_WAIT_PRIVATE
    assert futex_private(line(202, PTR, 0, 0)) is False  # FUTEX_WAIT: shared
    # futex_wait(2): FUTEX2_SIZE_U32 | FUTEX2_PRIVATE in its flags, args[3]
    assert futex_private(line(455, PTR, 0, U32_MINUS_1, 2 | FUTEX_PRIVATE_FLAG)) is True
    assert futex_private(line(455, PTR, 0, U32_MINUS_1, 2)) is False
    assert futex_private(line(449, PTR, 2, 0, 0)) is None  # per word, in user memory
    assert futex_private(line(232, 5, PTR, 64, U32_MINUS_1)) is None  # not a futex
    assert futex_private(SyscallLine(202, (PTR, 0x80, 0))) is None  # too short to tell
    assert futex_private(None) is None


# --- futex ----------------------------------------------------------------------------------


def test_futex_with_a_null_timeout_is_untimed() -> None:
    # futex(uaddr, FUTEX_WAIT_PRIVATE, val, NULL, ...): only another thread can end it.
    assert wait(202, PTR, 0x80, 0, 0) == SyscallWait(202, "futex", FUTEX, False)


def test_futex_with_a_timeout_pointer_is_timed() -> None:
    assert wait(202, PTR, 0x89, 0, PTR + 0x40) == SyscallWait(202, "futex", FUTEX, True)


def test_futex_timeout_is_the_fourth_argument_only() -> None:
    # Garbage in the other arguments says nothing of the timeout.
    untimed = wait(202, PTR, 0x189, U32_MINUS_1, 0, PTR, U32_MINUS_1)
    assert untimed.timed is False
    assert wait(202, 0, 0, 0, PTR, 0, 0).timed is True


def test_futex_wait_2_reads_its_fifth_argument() -> None:
    # futex_wait(uaddr, val, mask, flags, timeout, clockid): timeout is args[4].
    assert wait(455, PTR, 0, U32_MINUS_1, 2, 0, 1) == SyscallWait(455, "futex_wait", FUTEX, False)
    assert wait(455, PTR, 0, U32_MINUS_1, 2, PTR, 1).timed is True
    # A non-NULL args[3] (the flags) is not a timeout.
    assert wait(455, PTR, 0, U32_MINUS_1, 0x82, 0, 1).timed is False


def test_futex_waitv_reads_its_fourth_argument() -> None:
    assert wait(449, PTR, 2, 0, 0, 1) == SyscallWait(449, "futex_waitv", FUTEX, False)
    assert wait(449, PTR, 2, 0, PTR, 1).timed is True


# --- I/O waits with a millisecond timeout ---------------------------------------------------


@pytest.mark.parametrize("timeout", [U32_MINUS_1, U64_MINUS_1, 0xFFFFFFFB, 0x80000000])
def test_epoll_wait_with_a_negative_timeout_is_untimed(timeout: int) -> None:
    assert wait(232, 5, PTR, 64, timeout) == SyscallWait(232, "epoll_wait", IO, False)


@pytest.mark.parametrize("timeout", [10, 0, 5000, 0x7FFFFFFF])
def test_epoll_wait_with_a_timeout_of_zero_or_more_is_timed(timeout: int) -> None:
    assert wait(232, 5, PTR, 64, timeout) == SyscallWait(232, "epoll_wait", IO, True)


def test_epoll_pwait_reads_the_same_argument() -> None:
    assert wait(281, 5, PTR, 64, U32_MINUS_1, PTR, 8).timed is False
    assert wait(281, 5, PTR, 64, 100, PTR, 8).timed is True


def test_epoll_pwait2_takes_a_timespec_pointer() -> None:
    assert wait(441, 5, PTR, 64, 0, 0, 8).timed is False
    assert wait(441, 5, PTR, 64, PTR, 0, 8).timed is True


def test_poll_reads_its_third_argument() -> None:
    assert wait(7, PTR, 3, U32_MINUS_1) == SyscallWait(7, "poll", IO, False)
    assert wait(7, PTR, 3, U64_MINUS_1).timed is False
    assert wait(7, PTR, 3, 5000).timed is True
    assert wait(7, PTR, 3, 0).timed is True
    # A negative value in args[3] is not poll's timeout.
    assert wait(7, PTR, 3, 10, U32_MINUS_1).timed is True


@pytest.mark.parametrize(
    ("nr", "name", "at"),
    [(23, "select", 4), (270, "pselect6", 4), (271, "ppoll", 2), (128, "rt_sigtimedwait", 2)],
)
def test_pointer_timeouts(nr: int, name: str, at: int) -> None:
    null = [1, 1, 1, 1, 1, 1]
    null[at] = 0
    given = [0, 0, 0, 0, 0, 0]
    given[at] = PTR
    assert wait(nr, *null).name == name
    assert wait(nr, *null).timed is False
    assert wait(nr, *given).timed is True


# --- sleeps, plain I/O, children, signals ---------------------------------------------------


def test_clock_nanosleep_is_always_timed() -> None:
    # CLOCK_MONOTONIC, TIMER_ABSTIME, as CPython's time.sleep calls it.
    assert wait(230, 1, 1, PTR, 0) == SyscallWait(230, "clock_nanosleep", SLEEP, True)
    assert wait(230).timed is True  # whatever its arguments say
    assert wait(35, PTR, 0) == SyscallWait(35, "nanosleep", SLEEP, True)


def test_read_has_no_timeout() -> None:
    assert wait(0, 3, PTR, 4096) == SyscallWait(0, "read", IO, False)
    assert wait(0, 3, PTR, 4096, PTR, PTR, PTR).timed is False  # arguments are not read


def test_children_and_signals() -> None:
    assert wait(61, U64_MINUS_1, PTR, 0, 0) == SyscallWait(61, "wait4", CHILD, False)
    assert wait(247, 0, 0, PTR, 4) == SyscallWait(247, "waitid", CHILD, False)
    assert wait(34) == SyscallWait(34, "pause", SIGNAL, False)
    assert wait(130, PTR, 8) == SyscallWait(130, "rt_sigsuspend", SIGNAL, False)


def test_an_unknown_syscall_is_other_with_its_number() -> None:
    assert wait(999, 1, 2, 3) == SyscallWait(999, "syscall 999", OTHER, None)
    assert wait(3) == SyscallWait(3, "syscall 3", OTHER, None)  # close: not a wait


def test_no_line_or_no_syscall_is_no_wait() -> None:
    assert syscall_wait(None) is None
    assert syscall_wait(SyscallLine(-1, (), 0x7FFC00000000)) is None


def test_a_short_argument_list_leaves_the_timeout_unknown() -> None:
    w = syscall_wait(SyscallLine(202, (PTR, 0x80, 0)))
    assert w == SyscallWait(202, "futex", FUTEX, None)
    # A call that needs no argument to judge is still judged.
    assert syscall_wait(SyscallLine(230, ())) == SyscallWait(230, "clock_nanosleep", SLEEP, True)


def test_syscall_name_and_wait_kind() -> None:
    assert syscall_name(202) == "futex"
    assert syscall_name(232) == "epoll_wait"
    assert syscall_name(230) == "clock_nanosleep"
    assert syscall_name(12345) == "syscall 12345"
    assert wait_kind(202) == FUTEX
    assert wait_kind(455) == FUTEX
    assert wait_kind(449) == FUTEX
    assert wait_kind(0) == IO
    assert wait_kind(35) == SLEEP
    assert wait_kind(61) == CHILD
    assert wait_kind(34) == SIGNAL
    assert wait_kind(73) == OTHER  # flock: in the table, of kind other
    assert wait_kind(12345) == OTHER
    assert wait_kind(None) == OTHER
    assert wait_kind(-1) == OTHER


# --- end to end: real lines of this process's own threads ----------------------------------

needs_x86_64 = pytest.mark.skipif(
    platform.machine() != "x86_64" or not os.path.exists("/proc/self/task"),
    reason="syscall numbers are x86-64's; needs Linux /proc",
)


def _blocked_line(block: Callable[[], object]) -> str:
    """The /proc/self/task/TID/syscall line of a helper thread once it sleeps in ``block``
    for good: in state S, and the same line across a pause in which this thread holds no
    GIL (a thread still waiting for the GIL would have taken it and moved on)."""
    box: dict[str, int] = {}

    def run() -> None:
        box["tid"] = threading.get_native_id()
        block()

    threading.Thread(target=run, daemon=True).start()
    deadline = time.monotonic() + 5
    while "tid" not in box:
        assert time.monotonic() < deadline, "helper thread did not start"
        time.sleep(0.001)
    task = f"/proc/self/task/{box['tid']}"
    while time.monotonic() < deadline:
        with open(f"{task}/stat") as f:
            stat = parse_stat(f.read())
        assert stat is not None
        if stat.state == "S":
            with open(f"{task}/syscall") as f:
                first = f.read()
            time.sleep(0.02)
            with open(f"{task}/syscall") as f:
                second = f.read()
            if first == second:
                return second
        time.sleep(0.005)
    raise AssertionError(f"thread {box['tid']} never settled in its wait")


@needs_x86_64
def test_a_thread_in_event_wait_is_in_an_untimed_futex() -> None:
    event = threading.Event()
    try:
        text = _blocked_line(event.wait)
    finally:
        event.set()
    sc = parse_syscall(text)
    assert sc is not None, text
    assert len(sc.args) == 6 and sc.sp
    w = syscall_wait(sc)
    assert w is not None, text
    assert (w.kind, w.timed) == (FUTEX, False), text
    assert w.name in ("futex", "futex_wait"), text


@needs_x86_64
def test_a_thread_in_time_sleep_is_in_a_timed_clock_nanosleep() -> None:
    # The daemon thread sleeps on after the test: it holds nothing and ends with pytest.
    text = _blocked_line(lambda: time.sleep(30))
    sc = parse_syscall(text)
    assert sc is not None, text
    assert syscall_wait(sc) == SyscallWait(230, "clock_nanosleep", SLEEP, True), text
