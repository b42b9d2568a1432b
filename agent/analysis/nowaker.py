"""Hangs proven without an owner: a process that no thread of its own, and no other process,
can ever wake.

Python locks, condition variables and events record no owner, so the wait-for graph cannot
draw their cycles. But when every thread of a process is blocked in a futex wait with no
timeout, on a process-private word, the same in two reads a tick apart with no CPU used in
between, no thread of it can run to wake another and nothing outside can: it has no waker
now, whatever the threshold. Any thread that can be woken from outside, or a timer that can
send a signal, breaks the proof (docs/how-it-works.md, "Hangs proven without an owner").
"""

from __future__ import annotations

from collections.abc import Mapping

from ..model import ProcessSample, ThreadSample
from ..syscalls import FUTEX, wait_kind


def _waits_forever_privately(t: ThreadSample, shared: Mapping[int, object]) -> bool:
    """A futex wait with no timeout on a word no other process can reach: one waited on
    with FUTEX_PRIVATE_FLAG, or one in a private mapping (the kernel keys a futex there by
    this process's memory, whatever the flag: pthread_join waits on a thread's TID word
    without the flag, since the kernel's wake at thread exit is a shared one). ``shared``:
    the process's futex words in shared mappings (ProcessSample.word_ids)."""
    return (
        t.blocked
        and t.state != "t"  # stopped by a tracer: a debugger holds it, not a lock
        and wait_kind(t.syscall) == FUTEX
        and t.timed is False
        and t.wait is not None
        and not t.wait.vector
        and (t.private_futex is True or (t.private_futex is False and t.wait.uaddr not in shared))
    )


def no_waker(prev: ProcessSample | None, now: ProcessSample) -> bool:
    """Whether no thread of ``now`` can ever be woken but by a signal, confirmed against
    ``prev``, the same process one read earlier. A POSIX timer could send one: the caller
    leaves out the processes that hold one (the Observer, from the sampler's read)."""
    if prev is None or prev.start_ticks != now.start_ticks or not now.threads:
        return False
    if not all(_waits_forever_privately(t, now.word_ids) for t in now.threads):
        return False
    before = {t.tid: t for t in prev.threads}
    if set(before) != {t.tid for t in now.threads}:
        return False
    for t in now.threads:
        b = before[t.tid]
        if not _waits_forever_privately(b, prev.word_ids) or b.cpu_ns != t.cpu_ns:
            return False
        if b.wait is None or t.wait is None or b.wait.uaddr != t.wait.uaddr:
            return False
    return True
