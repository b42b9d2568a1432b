"""What threads wait on: the census of a process's waits by syscall and timeout
(process_waits), and the facts that describe a lock cycle's links and a group parked on one
word, built from the wait-for graph."""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Mapping, Sequence

from ..model import ProcessSample, ThreadSample, derived
from ..syscalls import FUTEX, syscall_name, wait_kind
from . import evidence as ev
from .waitgraph import WaitEdge, WordGroup

# A thread that has waited since the process's first seconds is parked since start-up (Ray's
# gRPC threads, gloo's run loops, a C++ daemon's main thread joining its workers), not the
# hang.
STARTUP_S = 5.0


def process_waits(s: ProcessSample, now_ns: int) -> ev.ProcessWaits:
    """What the threads of a process wait in, counted by syscall and timeout; with the age
    of its oldest untimed futex wait (from ThreadSample.quiet_since_ns), and of each untimed
    futex wait but those of pools parked since start-up (ProcessWaits)."""
    waits, running, began, by_tid = derived(s.threads, "waits", _waits_of)
    main_ns = by_tid.get(s.pid)
    if not began:
        return ev.ProcessWaits(waits, running, None, (), None)
    oldest = max(0.0, (now_ns - began[0]) / 1e9)
    # Those of the first STARTUP_S of the process are left out: they begin at the cut.
    cut = 0
    if s.age_s is not None:
        cut = bisect.bisect_left(began, now_ns - (s.age_s - STARTUP_S) * 1e9)
    ages = tuple(max(0.0, (now_ns - ns) / 1e9) for ns in began[cut:])  # oldest first
    main = None
    if main_ns is not None and (s.age_s is None or main_ns >= now_ns - (s.age_s - STARTUP_S) * 1e9):
        main = max(0.0, (now_ns - main_ns) / 1e9)
    return ev.ProcessWaits(waits, running, oldest, ages, main)


def _waits_of(
    threads: Sequence[ThreadSample],
) -> tuple[tuple[tuple[str, bool | None, int], ...], int, list[int], dict[int, int]]:
    """Of process_waits, what the threads alone say: the waits counted, the threads not
    blocked, when each untimed futex wait began (in order), and the same by TID."""
    counts: Counter[tuple[str, bool | None]] = Counter()
    running = 0
    by_tid: dict[int, int] = {}
    for t in threads:
        if not t.blocked:
            running += 1
            continue
        name = syscall_name(t.syscall) if t.syscall is not None and t.syscall >= 0 else "no syscall"
        counts[(name, t.timed)] += 1
        if wait_kind(t.syscall) == FUTEX and t.timed is False:
            ns = t.quiet_since_ns
            if ns is not None:
                by_tid[t.tid] = ns
    waits = tuple(
        (name, timed, n) for (name, timed), n in sorted(counts.items(), key=lambda x: -x[1])
    )
    return waits, running, sorted(by_tid.values()), by_tid


def lock_cycle(
    cycle: tuple[int, ...], edges: Mapping[int, WaitEdge], names: Mapping[int, str]
) -> ev.LockCycle:
    return ev.LockCycle(
        tuple(
            ev.CycleLink(tid, names.get(tid, "?"), e.kind, e.uaddr, e.owner)
            for tid in cycle
            if (e := edges.get(tid)) is not None
        )
    )


def parked_group(g: WordGroup, now_ns: int) -> ev.ParkedGroup:
    return ev.ParkedGroup(
        threads=len(g.tids),
        uaddr=g.uaddr,
        op=g.op_name,
        processes=len(g.pids),
        owner_kind=(g.owner_kind or "") if g.owner else "",
        owner=g.owner or 0,
        age_s=(now_ns - g.since_ns) / 1e9 if g.since_ns else None,
    )
