"""The wait-for graph: which thread waits for a lock that which thread holds.

An edge waiter -> owner is drawn only where the owner can be read from memory
without uprobes (see docs/how-it-works.md): a glibc mutex's ``__owner``, a PI
futex word, a ``pthread_join`` on a TID word, or a PI lock the kernel refused
with EDEADLK. A wait with no readable owner (condition variables, barriers,
semaphores, Python locks) is a parked wait, never a guessed edge.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
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


def strongly_connected(nodes: Iterable[int], succ: Mapping[int, Iterable[int]]) -> list[list[int]]:
    """Tarjan's algorithm, iterative (thousands of threads must not hit the recursion limit)."""
    index: dict[int, int] = {}
    low: dict[int, int] = {}
    on_stack: set[int] = set()
    stack: list[int] = []
    out: list[list[int]] = []
    counter = 0
    for root in nodes:
        if root in index:
            continue
        work = [(root, iter(succ.get(root, ())))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            advanced = False
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(succ.get(w, ()))))
                    advanced = True
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                out.append(comp)
    return out


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
        """Each cycle as its TIDs, rotated to start at the smallest; sorted."""
        succ = {w: (e.owner,) for w, e in self.edges.items()}
        found = []
        for comp in strongly_connected(sorted(succ), succ):
            if len(comp) > 1 or (comp[0] in self.edges and self.edges[comp[0]].owner == comp[0]):
                found.append(_cycle_order(comp, self.edges))
        return sorted(found)

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
            starts = [s for _, t in members if (s := _wait_start(t))]
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


def _wait_start(t: ThreadSample) -> int | None:
    """When the wait began: seen by the probe, or (seeded) when the thread last ran."""
    if t.wait is not None and t.wait.since_ns:
        return t.wait.since_ns
    return t.last_ran_ns


def _cycle_order(comp: list[int], edges: Mapping[int, WaitEdge]) -> tuple[int, ...]:
    """The cycle in wait order (each waits for the next), starting at its smallest TID."""
    start = min(comp)
    order = [start]
    nxt = edges[start].owner
    while nxt != start and len(order) <= len(comp):
        order.append(nxt)
        nxt = edges[nxt].owner
    return tuple(order)
