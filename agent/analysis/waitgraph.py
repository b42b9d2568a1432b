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
from typing import Any

from ..model import ProcessSample, Snapshot, ThreadSample, candidates, derived


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


@dataclass(frozen=True)
class _Waiters:
    """The threads of one process waiting on one word."""

    first: ThreadSample  # the first of them, in the process's order
    tids: tuple[int, ...]  # sorted
    since_ns: int | None  # the earliest start of their waits (ThreadSample.wait_start_ns)


def _waiters_by_word(p: ProcessSample) -> dict[tuple, _Waiters]:
    """The process's waiting threads by word: (shared, dev, inode, offset) for a word in
    shared memory, (private, pid, uaddr) otherwise. Kept on its Threads with the word
    identities it was built with (a quiet process keeps both)."""
    kept: dict[str, Any] = derived(p.threads, "waiters_by_word", lambda _ts: {})
    if kept.get("word_ids") is p.word_ids and kept.get("pid") == p.pid:
        groups: dict[tuple, _Waiters] = kept["groups"]
        return groups
    members: dict[tuple, list[ThreadSample]] = {}
    for t in p.threads:
        if t.wait is None:
            continue
        uaddr = t.refused.uaddr if t.refused else t.wait.uaddr
        key = p.word_ids.get(uaddr) or ("private", p.pid, uaddr)
        members.setdefault(key, []).append(t)
    groups = {}
    for key, ts in members.items():
        starts = [s for t in ts if (s := t.wait_start_ns)]
        groups[key] = _Waiters(
            ts[0], tuple(sorted(t.tid for t in ts)), min(starts) if starts else None
        )
    kept.update(word_ids=p.word_ids, pid=p.pid, groups=groups)
    return groups


class WaitForGraph:
    """Edges of one snapshot, its cycles, and its waiters grouped by word."""

    def __init__(self, snapshot: Snapshot) -> None:
        self.snapshot = snapshot
        where = snapshot.tid_to_pid()
        self.edges: dict[int, WaitEdge] = {}
        joins: dict[int, tuple[int, int] | None] | None = None
        for p in snapshot.processes.values():
            for tid, c in candidates(p.threads):
                if c.owner not in where:
                    continue  # an owner that is not a live thread
                if c.kind == "join":
                    if joins is None:  # the stacks, only where a join names an owner
                        joins = {
                            t.tid: t.stack for q in snapshot.processes.values() for t in q.threads
                        }
                    stack = joins.get(c.owner)
                    if stack is None or not stack[0] <= c.uaddr < stack[1]:
                        continue  # a word that merely equals a TID
                self.edges[tid] = WaitEdge(tid, c.owner, c.kind, c.uaddr, p.pid, where[c.owner])

    def cycles(self) -> list[tuple[int, ...]]:
        """Each cycle as its TIDs in wait order, from the smallest; sorted. Edges are keyed
        by waiter, so each thread waits for one owner at most: cycles are walks."""
        return owner_cycles({w: e.owner for w, e in self.edges.items()})

    def cycle_signature(self, cycle: tuple[int, ...]) -> frozenset:
        """What must be unchanged for a cycle to count as stable: its edges, words included."""
        return frozenset((t, self.edges[t].owner, self.edges[t].uaddr) for t in cycle)

    def groups(self) -> list[WordGroup]:
        # Per process, then merged: a word in shared memory is one group across processes.
        by_word: dict[tuple, list[tuple[int, _Waiters]]] = {}
        for p in self.snapshot.processes.values():
            for key, waiters in _waiters_by_word(p).items():
                by_word.setdefault(key, []).append((p.pid, waiters))
        out = []
        for key, members in by_word.items():
            t0 = members[0][1].first
            edge = self.edges.get(t0.tid)
            tids = members[0][1].tids
            if len(members) > 1:
                tids = tuple(sorted(tid for _, w in members for tid in w.tids))
            starts = [w.since_ns for _, w in members if w.since_ns is not None]
            out.append(
                WordGroup(
                    key=key,
                    uaddr=t0.refused.uaddr if t0.refused else t0.wait.uaddr,  # type: ignore[union-attr]
                    op_name="LOCK_PI (refused: EDEADLK)" if t0.refused else t0.wait.op_name,  # type: ignore[union-attr]
                    tids=tids,
                    pids=tuple(sorted({pid for pid, _ in members})),
                    owner=edge.owner if edge else None,
                    owner_kind=edge.kind if edge else None,
                    since_ns=min(starts) if starts else None,
                )
            )
        out.sort(key=lambda g: (-len(g.tids), g.key))
        return out
