"""Judging with a daemon's history: what `diagnose` does with what the daemon watching the
same service saw before diagnose attached.

The rule: a window sees only what happens in it. A streamed answer begun before it and
never finished sends nothing in it, and a request read before it may look answered to
the socket's own counters; whoever watched the service before the window saw them begin.
So when the window alone finds nothing waiting (idle) and the daemon, which watched, saw
such work left waiting and calls the service stalled or deadlocked, the daemon's verdict is
taken, with a reason that names it, and so is the process it found holding the service up.
Never the other way: a window that saw work done, or a
hang of its own, speaks for the present, and the daemon's older view does not overrule it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from . import evidence as ev
from .verdict import DEADLOCKED, IDLE, STALLED, ServiceVerdict


@dataclass(frozen=True)
class DaemonSight:
    """One service as the daemon answered for it (decoded from its status answer)."""

    daemon_pid: int
    service: str
    root: int
    state: str
    in_state_s: float
    stream_ages_s: tuple[float, ...]  # per unfinished streamed answer: since it last sent
    unanswered: int
    oldest_unanswered_s: float
    last_progress_s: float
    culprit: ev.Culprit | None = None  # the process the daemon found holds it up, if one


def saw(sight: DaemonSight, observed_s: float, judged: bool = False) -> ev.DaemonSaw:
    """The daemon's evidence that the window of ``observed_s`` seconds could not see."""
    old_streams = [a for a in sight.stream_ages_s if a >= observed_s]
    old_requests = sight.unanswered if sight.oldest_unanswered_s >= observed_s else 0
    return ev.DaemonSaw(
        daemon_pid=sight.daemon_pid,
        state=sight.state,
        in_state_s=sight.in_state_s,
        streams=len(old_streams),
        stream_age_s=max(old_streams, default=0.0),
        unanswered=old_requests,
        unanswered_age_s=sight.oldest_unanswered_s if old_requests else 0.0,
        last_progress_s=sight.last_progress_s,
        judged=judged,
    )


def unseen_work(fact: ev.DaemonSaw) -> bool:
    """Positive evidence of work left waiting that the window could not see."""
    return fact.streams > 0 or fact.unanswered > 0


def merge(v: ServiceVerdict, sight: DaemonSight | None, observed_s: float) -> ServiceVerdict:
    """The verdict with what the daemon saw: its state where the rule above takes it, and
    always the daemon's record among the reasons (last, unless it decided the state)."""
    if sight is None:
        return v
    fact = saw(sight, observed_s)
    if v.state == IDLE and sight.state in (STALLED, DEADLOCKED) and unseen_work(fact):
        fact = replace(fact, judged=True)
        # Its verdict taken, the process it found holding the service up goes with it, while
        # that process is still one of the service's (a PID can be reused).
        held = sight.culprit
        if held is not None and held.pid not in {p.pid for p in v.processes}:
            held = None
        return replace(
            v,
            state=sight.state,
            culprit=held,
            reasons=[fact, *([held] if held else []), *v.reasons],
            unanswered_requests=max(v.unanswered_requests, fact.unanswered + fact.streams),
            seconds_since_progress=max(v.seconds_since_progress, sight.last_progress_s),
            oldest_request_s=max(v.oldest_request_s, fact.unanswered_age_s, fact.stream_age_s),
            processes=[
                replace(p, state=sight.state) if p.state == IDLE else p for p in v.processes
            ],
        )
    return replace(v, reasons=[*v.reasons, fact])
