"""The process that holds a stalled or deadlocked service up, when the evidence singles one
out: find_culprit, for agent.analysis.classify."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..syscalls import FUTEX, kind_by_name
from . import evidence as ev

if TYPE_CHECKING:  # the classifier imports this module: its types only, for annotations
    from .classify import ProcessFacts, ServiceVerdict

# How far from the service's stop a wait may have begun and still be part of the hang: the
# stop is dated by tcp_info or a log's mtime, a wait by se.exec_start, on its CPU's task
# clock, which leaves out the steal and IRQ time of the wait itself, through an offset up to
# agent.sources.schedclock.REFRESH_NS old.
CULPRIT_BAND_MIN_S = 2.0
CULPRIT_BAND_RATIO = 0.1

# Per process: (its lead, its untimed waits counted, the oldest one's age, its PID).
Score = tuple[tuple[int, bool, bool], int, float | None, int]
Scored = list[Score]


def find_culprit(v: ServiceVerdict, procs: Sequence[ProcessFacts]) -> ev.Culprit | None:
    """The process that holds a stalled or deadlocked service up, when the evidence singles
    one out (None otherwise: naming a wrong one would send the engineer the wrong way).

    1. A process whose threads are in a stable lock cycle (of a cycle across processes, the
       one holding most of its threads), or else one that no thread can wake
       (agent.analysis.nowaker; the lowest PID if several).
    2. Otherwise the one process that waits on itself: the most threads in futex waits
       without a timeout (a lock or an event that only another thread of it can release)
       less its threads in timed waits or sleeps (waiting for time, a peer, a child: waiting
       on someone else). It must lead by at least one: a DataLoader worker blocked in
       ``__getitem__`` against its main process polling it every 5 s; a rank that stopped
       taking part (its gloo threads idle on their work queues) against the rank in the
       collective (one gloo thread waiting, with the collective's timeout, for its data); a
       child forked with a lock held against the parent joining it 5 s at a time.
       Where the waits are dated and the service's stop is known (when its oldest unanswered
       request came, else its time without progress), only the untimed waits that began when it
       stopped count (within CULPRIT_BAND_* of it; classify.process_waits has left out those of
       each process's first STARTUP_S), and no timed wait is taken off. Where a write dates the
       stop, they count only in the process that made it and whose main thread stopped then, as
       a hang there would: near a write, a count singles out chance (pool threads re-park on
       shared timers), and so does a write alone (a status writer's thread parks again after
       each line) or a main thread alone (a Ray idle worker's re-parked as an actor blocked).
       Among as many, the process that made the last progress leads, then the one whose main
       thread stopped then. Thread pools parked since start-up are background, not evidence
       (every Ray process carries 6-10 gRPC threads in untimed waits since it started, 10-20
       more in timed waits on gRPC timers), and the age quoted is the hang's, not the process's
       uptime. So vLLM's Worker (its main thread and the 26 gloo run-loop threads its step had
       woken) is named, not the API server with its 4 request threads; a Serve replica, not
       Ray's autoscaler monitor. Where that singles out no one (another process's status write
       dated the stop) and exactly one main thread stopped in an untimed wait, that stop dates
       the hang and the waits are counted again; among as many, the process that made the last
       progress leads, then that main thread's (a Ray actor blocked on an Event, against an
       idle worker whose pool thread parked with it).
    """
    if not procs:
        return None
    comm = {f.sample.pid: f.sample.comm for f in procs}
    if not v.cycles:
        stuck = sorted(f.sample.pid for f in procs if f.no_waker)
        if stuck:
            return ev.Culprit(stuck[0], comm[stuck[0]], "no waker")
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
    stop = v.oldest_request_s or v.seconds_since_progress
    scored, dated = _scored_by_own_waits(v, procs, stop, by_write=not v.oldest_request_s)
    got = _leader(scored)
    if got is None and dated and not v.oldest_request_s:
        # The latest dated progress may be a status write that no thread stopped with (Ray's
        # GCS dumps its event stats every 60 s: one that fell between the hang and the
        # observation dated the stop, and the threads of every process it woke parked again
        # with it). One main thread that stopped in an untimed wait dates the hang instead;
        # with two or more, which began it is unknown: none named.
        mains = [
            f.waits.main_untimed_s
            for f in procs
            if f.waits is not None and f.waits.main_untimed_s is not None
        ]
        if len(mains) == 1:
            got = _leader(_scored_by_own_waits(v, procs, mains[0], by_write=False)[0])
    if got is None:
        return None
    _lead, untimed, age, pid = got
    return ev.Culprit(pid, comm[pid], "own waits", threads=untimed, age_s=age)


def _leader(scored: Scored) -> Score | None:
    """The process that leads the others by at least one wait, or None."""
    ranked = sorted(scored, key=lambda x: x[0], reverse=True)
    if not ranked or ranked[0][0][0] < 1 or (len(ranked) > 1 and ranked[1][0] >= ranked[0][0]):
        return None
    return ranked[0]


def _scored_by_own_waits(
    v: ServiceVerdict, procs: Sequence[ProcessFacts], stop: float, by_write: bool
) -> tuple[Scored, bool]:
    """Rule 2 of find_culprit, per process: (its lead, its untimed waits, the oldest's age,
    its PID), dated against ``stop`` where the waits are (see find_culprit); and whether
    they were dated. ``by_write``: whether the last write out of the service dates ``stop``
    (else a request's arrival, or a main thread's stop): then only the process that wrote,
    and whose main thread stopped then, counts its waits."""
    scored: Scored = []
    band = max(CULPRIT_BAND_MIN_S, CULPRIT_BAND_RATIO * stop)
    dated = stop > 0 and any(f.waits is not None and f.waits.untimed_ages_s for f in procs)
    # The process whose work dates the stop (its log's last line) made the last progress.
    last = next((r.pid for r in v.reasons if isinstance(r, ev.LastProgress)), None)
    for f in procs:
        if f.waits is None:
            continue
        if dated:
            began = [a for a in f.waits.untimed_ages_s if abs(a - stop) <= band]
            # Among as many, the one that made the last progress, then the one whose main
            # thread stopped then: pools and runtime threads react to what the others do
            # (Ray's log monitor wakes on each line an actor logs; an idle worker's main
            # thread wakes and parks again as the actor blocks and gives its CPU back).
            main = f.waits.main_untimed_s
            main_then = main is not None and abs(main - stop) <= band
            wrote = f.sample.pid == last
            # Against a write, waits count only in the process that wrote and whose main
            # thread stopped then: what a hang there looks like. Each alone is chance in
            # Ray: every worker's pool threads re-park on shared timers (an idle worker's
            # within 0.2 s of a blocked actor's, at 1, 5 and 15 s ago), a status writer's
            # thread parks again after each line (a driver's, after its event stats), and
            # an idle worker's main thread re-parked as an actor blocked.
            counted = len(began) if not by_write or (wrote and main_then) else 0
            lead = (counted, wrote, main_then)
            scored.append((lead, len(began), max(began, default=None), f.sample.pid))
            continue
        untimed = sum(
            n for name, timed, n in f.waits.waits if kind_by_name(name) == FUTEX and timed is False
        )
        timed = sum(n for _name, timed, n in f.waits.waits if timed)
        lead = (untimed - timed, False, False)
        scored.append((lead, untimed, f.waits.oldest_untimed_s, f.sample.pid))
    return scored, dated
