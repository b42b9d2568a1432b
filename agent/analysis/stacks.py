"""What the Python stacks of a process show, as evidence records: pure, from a snapshot's
process sample and its stacks as read (agent.model.StackRead).

Threads with the same Python stack and the same wait form one group, told by the line where
the program's own code waits: the innermost frame outside the standard library ("at
`Queue.get` (scheduler.py:212) in `event_loop`"), not ``threading.py:320``, where every
condition wait looks alike. Threads at lines that take locks, on two or more lock words,
give the shape of a Python lock cycle (a hint: Python locks record no owner).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..model import FdWait, ProcessSample, PyFrame, PyThread, StackRead, ThreadSample
from ..syscalls import FUTEX, syscall_name, wait_kind
from . import evidence as ev

MAX_GROUPS = 12  # per process in words; --json has them all
NATIVE_PER_GROUP = 8  # threads of a group whose native caller is read (a stack scan each)


def wait_of(t: ThreadSample | None) -> ev.ThreadWait:
    """What a thread waits in, as a group is keyed by it."""
    if t is None:
        return ev.ThreadWait("gone")
    if not t.blocked:
        return ev.ThreadWait("running")
    if t.syscall is None or t.syscall < 0:
        return ev.ThreadWait("blocked")
    kind = wait_kind(t.syscall)
    op = t.wait.op_name if t.wait is not None and kind == FUTEX else None
    return ev.ThreadWait("syscall", syscall_name(t.syscall), kind, op, t.timed)


def in_futex(t: ThreadSample) -> bool:
    """Blocked in a futex wait: where a native caller says which C code waits."""
    return t.blocked and t.syscall is not None and t.syscall >= 0 and wait_kind(t.syscall) == FUTEX


@dataclass(frozen=True)
class SharedStack:
    """Threads of one process with the same Python stack and the same wait (the grouping
    behind an ev.StackGroup record, with the whole stack they share)."""

    tids: tuple[int, ...]
    names: tuple[str, ...]
    wait: ev.ThreadWait
    thread: PyThread  # one of them: the stack they share
    gil: int | None = None  # the TID among them that holds the GIL


def group_stacks(
    sample: ProcessSample, stacks: Mapping[int, PyThread]
) -> tuple[list[SharedStack], list[int]]:
    """Groups, largest first, and the TIDs of the process py-spy did not show with frames
    (threads that run no Python: native helpers, zmq's I/O threads)."""
    by_tid = {t.tid: t for t in sample.threads}
    keyed: dict[tuple[ev.ThreadWait, tuple[tuple[str, int], ...]], list[PyThread]] = {}
    for tid in sorted(stacks):
        py = stacks[tid]
        if not py.frames:  # listed without frames: told with the threads py-spy did not show
            continue
        key = (wait_of(by_tid.get(tid)), tuple((f.file, f.line) for f in py.frames))
        keyed.setdefault(key, []).append(py)
    groups = []
    for (wait, _), members in keyed.items():
        gil = next((m.tid for m in members if m.owns_gil), None)
        groups.append(
            SharedStack(
                tids=tuple(m.tid for m in members),
                names=tuple(
                    m.name or (by_tid[m.tid].name if m.tid in by_tid else "?") for m in members
                ),
                wait=wait,
                thread=members[0],
                gil=gil,
            )
        )
    # The GIL holder first (everyone else may wait for it), then the largest groups.
    groups.sort(key=lambda g: (g.gil is None, -len(g.tids), g.tids[0]))
    shown = {tid for tid, py in stacks.items() if py.frames}
    return groups, sorted(set(by_tid) - shown)


# --- hints -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class LockWaiter:
    tid: int
    frame: PyFrame  # the line that takes the lock
    word: int
    last_ran_ns: int


def _takes_a_lock(f: PyFrame) -> bool:
    """The source line acquires a lock: ``with x:`` or ``x.acquire(...)``. Python locks are
    semaphores that record no owner, so the line is the only witness of what is held."""
    code = f.code or ""
    return code.startswith(("with ", "async with ")) or ".acquire(" in code


def lock_waiters(sample: ProcessSample, stacks: Mapping[int, PyThread]) -> list[LockWaiter]:
    """Threads parked, with no timeout, in a futex wait taken straight from a line of the
    program's own code that acquires a lock."""
    out = []
    for t in sample.threads:
        py = stacks.get(t.tid)
        if (
            py is None
            or not py.frames
            or not t.blocked
            or wait_kind(t.syscall) != FUTEX
            or t.timed is not False
            or t.wait is None
            or t.last_ran_ns is None
        ):
            continue
        inner = py.frames[0]
        if inner.stdlib or not _takes_a_lock(inner):
            continue
        out.append(LockWaiter(t.tid, inner, t.wait.uaddr, t.last_ran_ns))
    return out


def lock_cycle_hint(waiters: Sequence[LockWaiter]) -> list[LockWaiter]:
    """The waiters, when they wait on two or more distinct lock words: the shape of a lock
    cycle, not a proof of one (Python locks have no owner to draw the cycle with). Empty
    otherwise. Their waits need not begin together: on a real server one side of a cycle
    was seen to reach its second lock seconds after the other (it waited for the GIL)."""
    return list(waiters) if len({w.word for w in waiters}) >= 2 else []


# --- as evidence -----------------------------------------------------------------------------


def native_asks(
    sample: ProcessSample, read: StackRead, max_groups: int = MAX_GROUPS
) -> list[tuple[int, int]]:
    """(pid, tid) of the threads whose native caller ``stack_facts`` tells: a few of each
    group shown that waits in futex (a C extension's lock says where it is only there)."""
    if read.error is not None:
        return []
    groups, _ = group_stacks(sample, read.threads)
    return [
        (sample.pid, t)
        for g in groups[:max_groups]
        if g.thread.site() is not None and g.wait.syscall_kind == FUTEX
        for t in g.tids[:NATIVE_PER_GROUP]
    ]


def stack_facts(
    sample: ProcessSample,
    read: StackRead,
    wall: float,
    mono_ns: int,
    max_groups: int = MAX_GROUPS,
    natives: Mapping[tuple[int, int], str] | None = None,
    fds: Mapping[tuple[int, int], FdWait] | None = None,
) -> list[ev.Fact]:
    """What the stacks of one process show, as records for agent.report.sentences: the groups (GIL
    holder and largest first), the threads with no Python frames, and a lock-cycle hint.
    ``natives``: (pid, tid) -> its first native caller outside libc, read for the threads
    ``native_asks`` names. ``fds``: (pid, tid) -> the fds it waits on (agent.observe.fdwaits),
    told for a group whose threads all wait on the same."""
    if read.error is not None:
        return [ev.StacksUnread(read.pid, read.error)]
    groups, bare = group_stacks(sample, read.threads)
    facts: list[ev.Fact] = []
    for g in groups[:max_groups]:
        site = g.thread.site()
        if site is None:
            continue
        callee, frame = site
        facts.append(
            ev.StackGroup(
                pid=sample.pid,
                threads=len(g.tids),
                tids=g.tids,
                wait=g.wait,
                function=frame.function,
                file=frame.short,
                line=frame.line,
                callee=callee,
                code=frame.code,
                gil=g.gil,
                names=g.names,
                native=_natives(sample.pid, g, natives),
                on=_same_fds(sample.pid, g, fds),
            )
        )
    rest = groups[max_groups:]
    if rest:
        facts.append(ev.MoreStackGroups(len(rest), sum(len(g.tids) for g in rest)))
    if bare:
        facts.append(_no_python_stack(sample, bare))
    hint = _lock_hint(sample, read, wall, mono_ns)
    if hint is not None:
        facts.append(hint)
    return facts


def _no_python_stack(sample: ProcessSample, bare: Sequence[int]) -> ev.NoPythonStack:
    by_tid = {t.tid: t for t in sample.threads}
    waits: dict[ev.ThreadWait, int] = {}
    for tid in bare:
        w = wait_of(by_tid.get(tid))
        waits[w] = waits.get(w, 0) + 1
    return ev.NoPythonStack(sample.pid, len(bare), tuple(waits.items()))  # by first TID


def _lock_hint(
    sample: ProcessSample, read: StackRead, wall: float, mono_ns: int
) -> ev.PyLockHint | None:
    cycle = lock_cycle_hint(lock_waiters(sample, read.threads))
    if not cycle:
        return None
    last = max(w.last_ran_ns for w in cycle)  # since then, all of them wait
    return ev.PyLockHint(
        pid=sample.pid,
        waits=tuple(
            ev.LockAt(w.tid, w.frame.function, w.frame.short, w.frame.line, w.frame.code)
            for w in cycle
        ),
        words=len({w.word for w in cycle}),
        since_wall=wall - (mono_ns - last) / 1e9,
    )


def _natives(pid: int, g: SharedStack, natives: Mapping[tuple[int, int], str] | None) -> str | None:
    """The distinct native callers of a few of the group's threads (threads with one Python
    stack can sit in different C functions: two ctypes calls from one Thread.run)."""
    if natives is None or g.wait.syscall_kind != FUTEX:
        return None
    asked = (natives.get((pid, t)) for t in g.tids[:NATIVE_PER_GROUP])
    seen = [c for c in dict.fromkeys(asked) if c]
    return "; ".join(seen) or None


def _same_fds(
    pid: int, g: SharedStack, fds: Mapping[tuple[int, int], FdWait] | None
) -> FdWait | None:
    if fds is None:
        return None
    seen = {fds.get((pid, t)) for t in g.tids[:NATIVE_PER_GROUP]}
    return seen.pop() if len(seen) == 1 else None
