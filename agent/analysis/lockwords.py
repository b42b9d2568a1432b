"""The futex words of a verdict's lock cycles, named: the classifier works on numbers alone,
and what a word is ("`abba_a` in libabba.so+0x40a0") is read from the process's memory at
report time (agent.observe.enrich), then given to the records here."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import replace

from ..model import Snapshot
from . import evidence as ev
from .verdict import ServiceVerdict


def _links(facts: Iterable[ev.Fact]) -> Iterator[ev.CycleLink]:
    """The links of lock cycles among ``facts`` that have no name yet."""
    for f in facts:
        for x in f.links if isinstance(f, ev.LockCycle) else (f,):
            if isinstance(x, ev.CycleLink) and x.word is None:
                yield x


def name_words(
    facts: Iterable[ev.Fact],
    pid_of: Callable[[int], int | None],
    describe: Callable[[int, int], str | None],
) -> list[ev.Fact]:
    """The records, with the futex words of lock cycles named where ``describe`` (pid,
    address -> what it is) knows them, each word asked once. ``pid_of``: a waiting TID ->
    its process."""
    seen: dict[tuple[int, int], str | None] = {}

    def word(pid: int | None, uaddr: int) -> str | None:
        if pid is None:
            return None
        if (pid, uaddr) not in seen:
            seen[(pid, uaddr)] = describe(pid, uaddr)
        return seen[(pid, uaddr)]

    def link(x: ev.CycleLink) -> ev.CycleLink:
        return x if x.word is not None else replace(x, word=word(pid_of(x.tid), x.uaddr))

    def named(f: ev.Fact) -> ev.Fact:
        if isinstance(f, ev.CycleLink):
            return link(f)
        if isinstance(f, ev.LockCycle):
            return replace(f, links=tuple(link(x) for x in f.links))
        return f

    return [named(f) for f in facts]


def _pid_of(snap: Snapshot) -> Callable[[int], int | None]:
    """A waiting TID -> its process, among the watched processes (not foreign owners)."""
    return {t.tid: p.pid for p in snap.processes.values() for t in p.threads}.get


def _facts(verdicts: Iterable[ServiceVerdict]) -> Iterator[ev.Fact]:
    for v in verdicts:
        yield from v.reasons
        for p in v.processes:
            yield from p.reasons


def words_wanted(verdicts: Iterable[ServiceVerdict], snap: Snapshot) -> set[tuple[int, int]]:
    """(pid, address) of every word ``named_verdicts`` would name."""
    pid_of = _pid_of(snap)
    wanted = set()
    for x in _links(_facts(verdicts)):
        pid = pid_of(x.tid)
        if pid is not None:
            wanted.add((pid, x.uaddr))
    return wanted


def named_verdicts(
    verdicts: list[ServiceVerdict], snap: Snapshot, words: Mapping[tuple[int, int], str | None]
) -> list[ServiceVerdict]:
    """The verdicts with the futex words of their lock cycles named: ``words`` is (pid,
    address) -> what the memory there is ("`abba_a` in libabba.so+0x40a0")."""
    pid_of = _pid_of(snap)

    def describe(pid: int, uaddr: int) -> str | None:
        return words.get((pid, uaddr))

    return [
        replace(
            v,
            reasons=name_words(v.reasons, pid_of, describe),
            processes=[
                replace(p, reasons=name_words(p.reasons, pid_of, describe)) for p in v.processes
            ],
        )
        for v in verdicts
    ]
