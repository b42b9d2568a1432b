"""The wait-for graph: which thread waits for a lock that which thread holds.

An edge waiter -> owner is drawn only where the owner can be read from memory
without uprobes (see docs/how-it-works.md): a glibc mutex's ``__owner``, a PI
futex word, a ``pthread_join`` on a TID word, or a PI lock the kernel refused
with EDEADLK. A wait with no readable owner (condition variables, barriers,
semaphores, Python locks) is a parked wait, never a guessed edge.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..model import ProcessSample, Snapshot, ThreadSample, owner_candidate


@dataclass(frozen=True)
class WaitEdge:
    waiter: int  # TID
    owner: int  # TID
    kind: str  # "mutex", "robust-mutex", "pi", "pi-refused", "join"
    uaddr: int
    waiter_pid: int
    owner_pid: int


def owner_cycles(owner: Mapping[int, int]) -> list[tuple[int, ...]]:
    """The cycles of a wait-for graph in which each waiter waits for one owner (``owner``:
    waiter -> owner), each in wait order (each waits for the next) from its smallest TID;
    sorted. A walk from each thread along its owners ends at a thread that waits for none,
    at one an earlier walk passed (whose cycle, if any, that walk found), or back on its
    own path: a cycle. Iterative, and each thread is passed once."""
    walked: dict[int, int] = {}  # thread -> the walk (its first thread) that passed it
    found = []
    for start in sorted(owner):
        path: list[int] = []
        tid: int | None = start
        while tid is not None and tid not in walked:
            walked[tid] = start
            path.append(tid)
            tid = owner.get(tid)
        if tid is not None and walked[tid] == start:
            cycle = path[path.index(tid) :]
            i = cycle.index(min(cycle))
            found.append(tuple(cycle[i:] + cycle[:i]))
    return sorted(found)


@dataclass(frozen=True)
class WordGroup:
    """Threads parked on one futex word."""

    key: tuple  # identity of the word (shared mappings unify across processes)
    uaddr: int
    op_name: str
    tids: tuple[int, ...]
    pids: tuple[int, ...]
    owner: int | None  # TID, when the word names a live owner
    owner_kind: str | None  # the edge kind ("mutex", "join", ...) when there is an owner
    since_ns: int | None  # earliest known start of these waits (or last run, when seeded)


class WaitForGraph:
    """Edges of one snapshot, its cycles, and its waiters grouped by word."""

    def __init__(self, snapshot: Snapshot) -> None:
        self.snapshot = snapshot
        where = snapshot.tid_to_pid()
        stacks = {t.tid: t.stack for p in snapshot.processes.values() for t in p.threads}
        self.edges: dict[int, WaitEdge] = {}
        for p in snapshot.processes.values():
            for t in p.threads:
                c = owner_candidate(t)
                if c is None or c.owner not in where:
                    continue  # no owner, or an owner that is not a live thread
                if c.kind == "join":
                    stack = stacks.get(c.owner)
                    if stack is None or not stack[0] <= c.uaddr < stack[1]:
                        continue  # a word that merely equals a TID
                self.edges[t.tid] = WaitEdge(t.tid, c.owner, c.kind, c.uaddr, p.pid, where[c.owner])

    def cycles(self) -> list[tuple[int, ...]]:
        """Each cycle as its TIDs in wait order, from the smallest; sorted. Edges are keyed
        by waiter, so each thread waits for one owner at most: cycles are walks."""
        return owner_cycles({w: e.owner for w, e in self.edges.items()})

    def cycle_signature(self, cycle: tuple[int, ...]) -> frozenset:
        """What must be unchanged for a cycle to count as stable: its edges, words included."""
        return frozenset((t, self.edges[t].owner, self.edges[t].uaddr) for t in cycle)

    def groups(self) -> list[WordGroup]:
        by_word: dict[tuple, list[tuple[ProcessSample, ThreadSample]]] = {}
        for p in self.snapshot.processes.values():
            for t in p.threads:
                if t.wait is None:
                    continue
                uaddr = t.refused.uaddr if t.refused else t.wait.uaddr
                key = p.word_ids.get(uaddr) or ("private", p.pid, uaddr)
                by_word.setdefault(key, []).append((p, t))
        out = []
        for key, members in by_word.items():
            _p0, t0 = members[0]
            edge = self.edges.get(t0.tid)
            starts = [s for _, t in members if (s := t.wait_start_ns)]
            out.append(
                WordGroup(
                    key=key,
                    uaddr=t0.refused.uaddr if t0.refused else t0.wait.uaddr,  # type: ignore[union-attr]
                    op_name="LOCK_PI (refused: EDEADLK)" if t0.refused else t0.wait.op_name,  # type: ignore[union-attr]
                    tids=tuple(sorted(t.tid for _, t in members)),
                    pids=tuple(sorted({p.pid for p, _ in members})),
                    owner=edge.owner if edge else None,
                    owner_kind=edge.kind if edge else None,
                    since_ns=min(starts) if starts else None,
                )
            )
        out.sort(key=lambda g: (-len(g.tids), g.key))
        return out
