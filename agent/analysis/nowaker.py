"""Hangs proven without an owner: a process that no thread of its own, and no other process,
can ever wake.

A set of threads is deadlocked when each waits for an event that only another thread of the
set can cause. Python locks, condition variables and events record no owner, so the wait-for
graph cannot draw their cycles. But when **every** thread of a process is blocked in a futex
wait that

* has no timeout (it does not end by itself),
* is process-private (``FUTEX_PRIVATE_FLAG``, or a word in a private mapping: no other
  process can reach it), and
* is the same wait in two reads a tick apart, with no CPU used in between,

then no thread of it runs to wake another, and nothing outside can: the process has no waker
now, whatever the threshold. That covers a cycle of Python locks with the main thread joining
the workers, a child forked while another thread held a lock (the child has only the thread
that forked), and an event that no remaining thread can set.

What breaks the proof, by design: any thread that can be woken from outside. A timed wait, a
sleep, ``poll``/``epoll``/``read`` on a file descriptor, a shared futex, a thread that ran: a
server waiting on sockets, a rank waiting for a peer (gloo's loop polls with a timeout), a
pool waiting for work while an I/O thread polls always have one. What could still end
such a wait is a signal: a handler that runs (Python's run on the main thread) or a timer armed to
send one (``alarm``, ``setitimer``, POSIX timers). A process with a POSIX timer (listed in
``/proc/PID/timers``) is left out; ``alarm`` and ``setitimer`` cannot be seen from outside.
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
