"""The process that holds a stalled or deadlocked service up, when the evidence singles it out
(find_culprit, for agent.analysis.classify). The criteria, in order, and why each holds for any
engine, are in docs/how-it-works.md ("The culprit, and what each process waits for")."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from ..syscalls import FUTEX, kind_by_name
from . import evidence as ev
from .verdict import ProcessFacts, ServiceVerdict

# How far from the service's stop a wait may have begun and still be part of the hang: the
# stop is dated by tcp_info or a log's mtime, a wait by se.exec_start, on its CPU's task
# clock, which leaves out the steal and IRQ time of the wait itself, through an offset up to
# agent.sources.schedclock.REFRESH_NS old.
CULPRIT_BAND_MIN_S = 2.0
CULPRIT_BAND_RATIO = 0.1


@dataclass(frozen=True, order=True)
class Score:
    """What a process's own waits say against the others'. Ordered by its compared fields, in
    this order: the first that differs decides, and the process named must lead every other
    by it (an equal score names no one)."""

    waits: int  # its untimed futex waits that count (less its timed waits when undated)
    made_last_progress: bool  # its work dates the stop: the others' threads react to it
    main_stopped: bool  # its main thread began an untimed futex wait at the stop
    pid: int = field(compare=False)
    threads: int = field(compare=False)  # its untimed futex waits, as reported
    age_s: float | None = field(compare=False)  # the oldest of them


def find_culprit(v: ServiceVerdict, procs: Sequence[ProcessFacts]) -> ev.Culprit | None:
    """The process that holds a stalled or deadlocked service up, by the first criterion that
    singles one out; None where none does (a wrong culprit sends the engineer the wrong way):

    1. lock cycle: the process holding most threads of a stable lock cycle;
    2. no waker: a process no thread can wake (the lowest PID of several);
    3. the request's holder: where the oldest unanswered request dates the stop, the one
       process it was seen to reach last, over connections inside the service, if one of its
       untimed futex waits began then;
    4. waits begun at the stop: the most untimed futex waits that began then, but in the
       request's client and those that passed it on (they wait for its answer), a process
       whose main thread stopped with the request first; a stop dated
       by a write or a send, not by a main thread's stop: only in the process that made it and
       whose main thread stopped then, or, where that names no one, at the date of the one
       main thread stopped;
    5. undated: the most untimed futex waits less timed waits.
    """
    if not procs:
        return None
    comm = {f.sample.pid: f.sample.comm for f in procs}
    if v.cycles:
        # A cycle can span processes (shared-memory mutexes): the one holding most of its
        # threads, the lowest PID among equals, so the answer never depends on list order.
        in_cycle = {tid for c in v.cycles for tid in c}
        held = [
            (len(in_cycle.intersection(t.tid for t in f.sample.threads)), -f.sample.pid)
            for f in procs
        ]
        n, neg_pid = max(held)
        return ev.Culprit(-neg_pid, comm[-neg_pid], "cycle") if n else None
    stuck = sorted(f.sample.pid for f in procs if f.no_waker)
    if stuck:
        return ev.Culprit(stuck[0], comm[stuck[0]], "no waker")
    got = _by_dated_waits(v, procs) if _dated(v, procs) else _leader(_undated(procs))
    if got is None:
        return None
    return ev.Culprit(got.pid, comm[got.pid], "own waits", threads=got.threads, age_s=got.age_s)


def _dated(v: ServiceVerdict, procs: Sequence[ProcessFacts]) -> bool:
    """Whether the stop is known and the waits are dated: then only when they began counts."""
    stop = v.oldest_request_s or v.seconds_since_progress
    return stop > 0 and any(f.waits is not None and f.waits.untimed_ages_s for f in procs)


def _by_dated_waits(v: ServiceVerdict, procs: Sequence[ProcessFacts]) -> Score | None:
    """Criteria 3 and 4, where the stop and the waits are dated."""
    last = _last_progress(v)
    if v.oldest_request_s:
        stop = v.oldest_request_s
        senders, holder = _request_path(stop, procs)
        if holder is not None:
            return holder
        # Those that sent the request on wait for its answer: their waits are not the hang's.
        # A main thread that stopped with the request leads a count: it carries its process's
        # loop, and a process whose loop goes on (an event loop) parked only the pool threads
        # the request left, having passed it on where no connection shows (a unix socket).
        return _leader(
            (s for s in _began_at(stop, procs, last) if s.pid not in senders), main_first=True
        )
    stop = v.seconds_since_progress
    dated_by = next((r.what for r in v.reasons if isinstance(r, ev.LastProgress)), None)
    # A main thread's stop in an untimed wait ("ran") dates the hang itself: every process
    # counts. Any other date (a write, a send) may be a status line's, after the hang.
    got = _leader(_began_at(stop, procs, last, writer_only=dated_by != "ran"))
    if got is not None or dated_by == "ran":
        return got
    # A write by a process whose main thread did not stop with it (a status line) may date
    # the stop after the hang; one main thread stopped in an untimed wait dates it instead.
    # Two or more: which began the hang is unknown.
    mains = [m for f in procs if f.waits and (m := f.waits.main_untimed_s) is not None]
    if len(mains) != 1:
        return None
    return _leader(_began_at(mains[0], procs, last))


def _band(stop: float) -> float:
    return max(CULPRIT_BAND_MIN_S, CULPRIT_BAND_RATIO * stop)


def _last_progress(v: ServiceVerdict) -> int | None:
    """The process whose work dates the stop (its log's last line, its last send), if one."""
    return next((r.pid for r in v.reasons if isinstance(r, ev.LastProgress)), None)


def _began_at(
    stop: float, procs: Sequence[ProcessFacts], last: int | None, writer_only: bool = False
) -> list[Score]:
    """Per process, its untimed futex waits that began at ``stop`` (within _band of it).
    ``writer_only``: a write dates ``stop``, and they count only in the process that made it
    (``last``) and whose main thread stopped then, as a hang there would: near a write, a
    count alone is chance (pool threads re-park on shared timers), and so is a write alone (a
    status writer's thread parks again after each line) or a main thread alone (one that
    parked again as another process blocked and gave its CPU back)."""
    band = _band(stop)
    scored = []
    for f in procs:
        if f.waits is None:
            continue
        began = [a for a in f.waits.untimed_ages_s if abs(a - stop) <= band]
        main = f.waits.main_untimed_s
        main_then = main is not None and abs(main - stop) <= band
        wrote = f.sample.pid == last
        counted = len(began) if not writer_only or (wrote and main_then) else 0
        scored.append(
            Score(counted, wrote, main_then, f.sample.pid, len(began), max(began, default=None))
        )
    return scored


def _undated(procs: Sequence[ProcessFacts]) -> list[Score]:
    """Criterion 5, per process: its untimed futex waits (on a lock or an event only another
    of its threads can release) less its timed waits (on time, a peer, a child)."""
    scored = []
    for f in procs:
        if f.waits is None:
            continue
        waits = f.waits.waits
        untimed = sum(
            n for name, timed, n in waits if kind_by_name(name) == FUTEX and timed is False
        )
        timed = sum(n for _name, timed, n in waits if timed)
        scored.append(
            Score(untimed - timed, False, False, f.sample.pid, untimed, f.waits.oldest_untimed_s)
        )
    return scored


def _leader(scored: Iterable[Score], main_first: bool = False) -> Score | None:
    """The process whose score is above every other's, with at least one wait; else None.
    ``main_first``: whether its main thread stopped then is compared before the rest."""

    def key(s: Score) -> tuple[bool, Score]:
        return (main_first and s.main_stopped, s)

    ranked = sorted(scored, key=key, reverse=True)
    if not ranked or ranked[0].waits < 1 or (len(ranked) > 1 and key(ranked[1]) == key(ranked[0])):
        return None
    return ranked[0]


def _request_path(stop: float, procs: Sequence[ProcessFacts]) -> tuple[set[int], Score | None]:
    """Criterion 3: the processes the oldest unanswered request (``stop`` old) was seen to
    pass through (its client's among them), and the one it reached last, if one of that
    one's untimed futex waits began then. The request is followed from the process that
    read it, along connections inside the service that carried data then and none since
    (tcp_info of either end): a process that passed it on waits for the one it passed it to.
    Several reached last, or none beyond the first: no holder."""
    band = _band(stop)
    owner = {c.local: f.sample.pid for f in procs for c in f.sample.connections}
    doors = {
        port
        for f in procs
        for port in (
            f.front_door_ports
            if f.front_door_ports is not None
            else {lst.port for lst in f.sample.listeners}
        )
    }
    # The process that read the request, and its client where that is one of the service's:
    # what the request's process sends back to the client is its answer, not the request.
    start: set[int] = set()
    client: set[int] = set()
    for f in procs:
        for c in f.sample.connections:
            read_it = c.last_recv_ms is not None and abs(c.last_recv_ms / 1000 - stop) < 1e-3
            if c.local_port in doors and read_it:
                start.add(f.sample.pid)
                if c.remote in owner:
                    client.add(owner[c.remote])
    passed: dict[int, set[int]] = {}  # sender -> receivers, at the request's date
    for f in procs:
        me = f.sample.pid
        for c in f.sample.connections:
            peer = owner.get(c.remote)
            if peer is None or peer == me:
                continue
            if c.last_recv_ms is not None and abs(c.last_recv_ms / 1000 - stop) <= band:
                passed.setdefault(peer, set()).add(me)
            if c.last_sent_ms is not None and abs(c.last_sent_ms / 1000 - stop) <= band:
                passed.setdefault(me, set()).add(peer)
    # Breadth first from the process that read it: each that passed it on is a sender; those
    # reached that passed it to no one new are where it ended.
    seen, layer, senders = start | client, set(start), set(client)
    reached: set[int] = set()
    while layer:
        nxt: set[int] = set()
        for p in layer:
            new = passed.get(p, set()) - seen
            if new:
                senders.add(p)
                nxt |= new
        seen |= nxt
        reached |= nxt
        layer = nxt
    last = reached - senders
    if len(last) != 1:
        return senders, None
    (pid,) = last
    f = next(f for f in procs if f.sample.pid == pid)
    began = [a for a in f.waits.untimed_ages_s if abs(a - stop) <= band] if f.waits else []
    if not began:
        return senders, None
    return senders, Score(len(began), False, False, pid, len(began), max(began))
