"""Verdicts: deadlocked, stalled, idle or progressing, with the evidence for each.

Precedence (docs/how-it-works.md): a stable lock cycle wins over everything;
then any work in the window; then a fully parked process or service is idle
when it listens with nothing queued (or has been parked for less than the
threshold), and stalled otherwise.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace

from ..model import Connection, Listener, ProcessSample
from . import evidence as ev
from .culprit import find_culprit
from .gpu import gpu_idle, gpu_spin
from .progress import ProcessProgress
from .requests import (
    door_listeners,
    incomplete_requests,
    oldest_request_s,
    unanswered_requests,
    unread_requests,
)
from .verdict import (
    DEADLOCKED,
    IDLE,
    PROGRESSING,
    STALLED,
    ProcessFacts,
    ProcessVerdict,
    ServiceFacts,
    ServiceVerdict,
)

MAX_NAMED = 3  # processes with no waker named one by one in a service's reasons


def classify_process(facts: ProcessFacts, threshold_s: float) -> ProcessVerdict:
    s, prog = facts.sample, facts.progress
    n = len(s.threads)
    ports = tuple(sorted({lst.port for lst in s.listeners}))
    v = ProcessVerdict(
        pid=s.pid,
        comm=s.comm,
        threads=n,
        parked_threads=facts.parked_threads,
        parked_seconds=facts.parked_seconds,
        state=PROGRESSING,
        reasons=[],
        cycles=list(facts.cycles),
        listening_ports=ports,
        waits=facts.waits,
    )
    if facts.cycles:
        v.state = DEADLOCKED
        v.reasons.append(ev.CyclesStable(len(facts.cycles), among_threads=True))
        return v
    if facts.no_waker:
        v.state, v.no_waker = DEADLOCKED, True
        v.reasons.append(no_waker(s, facts.waits))
        return v
    gpu = facts.gpu
    host_work = prog.host_work
    if (
        gpu is not None
        and not host_work
        and facts.parked_threads == n
        and min(facts.parked_seconds, gpu.high_for_s) >= threshold_s
    ):
        v.state, v.gpu_spin = STALLED, True
        v.reasons.append(ev.AllParked(n, 1, facts.parked_seconds))
        v.reasons.append(gpu_spin([gpu]))
        return v
    if prog.did_work:
        v.worked = True
        v.reasons.extend(prog.signals())
        return v
    if facts.parked_threads < n:
        v.worked = True
        v.reasons.append(ev.NotParked(n - facts.parked_threads, n))
        return v
    v.state, why, _ = _parked_state(
        ev.AllParked(n, 1, facts.parked_seconds),
        threshold_s,
        door_listeners(s, facts.front_door_ports),
        unread_requests(s, facts.front_door_ports),
        unanswered_requests(s, facts.front_door_ports, facts.streams),
        incomplete=incomplete_requests(s, facts.front_door_ports, facts.streams),
    )
    v.reasons.extend(why)
    if prog.heartbeat:
        v.reasons.append(heartbeat(prog))
    idle_gpu = gpu_idle({s.pid: gpu}) if gpu is not None else None
    if idle_gpu:
        v.reasons.append(idle_gpu)
    return v


def heartbeat(prog: ProcessProgress) -> ev.Heartbeat:
    return ev.Heartbeat(prog.logged_bytes, prog.written_to or "a file", prog.window_ns / 1e9)


def no_waker(s: ProcessSample, waits: ev.ProcessWaits | None) -> ev.NoWaker:
    words = {t.wait.uaddr for t in s.threads if t.wait is not None}
    age = waits.oldest_untimed_s if waits is not None else None
    return ev.NoWaker(s.pid, s.comm, len(s.threads), len(words), age)


def _parked_state(
    parked: ev.AllParked,
    threshold_s: float,
    doors: Iterable[Listener],
    unread: int,
    unanswered: Sequence[Connection] = (),
    last_progress: ev.LastProgress | None = None,
    demand_age_s: float | None = None,
    incomplete: Sequence[Connection] = (),
) -> tuple[str, list[ev.Fact], float]:
    """Nothing progresses: idle when a front door has nothing waiting at it; otherwise
    stalled once past the threshold, and still progressing under it. ``unanswered``: accepted
    connections on its front doors that wait for an answer (see waiting_for_answer). Evidence
    carries its own age (DESIGN): the oldest unanswered request, and ``last_progress``, the
    most recent dated progress before the window, date a hang older than the observation.
    ``incomplete``: connections whose request the client has not finished sending
    (client_turn): the client's wait, said beside an idle verdict, never the service's.
    Returns the state, its reasons, and that time without progress (seconds)."""
    doors = list(doors)
    queued = sum(lst.queued for lst in doors)
    ports = tuple(sorted({lst.port for lst in doors}))
    oldest_s = oldest_request_s(unanswered)
    reasons: list[ev.Fact] = [parked]
    waited = demand_age_s is not None and not (queued or unread or unanswered)
    if doors and not (queued or unread or unanswered or waited):
        reasons.append(ev.WaitingForRequests(ports))
        if incomplete:
            reasons.append(ev.RequestIncomplete(len(incomplete), oldest_request_s(incomplete)))
        return IDLE, reasons, max(parked.seconds, oldest_s)
    dated = [(parked.seconds, "parked"), (oldest_s, "request")]
    if last_progress is not None:
        dated.append((last_progress.age_s, last_progress.what))
    stuck_s, since = max(dated, key=lambda x: x[0])
    if waited and demand_age_s is not None:
        reasons.append(ev.WorkWaited(ports, demand_age_s))
    elif doors:
        reasons.append(ev.WorkWaiting(ports, queued, unread, len(unanswered), oldest_s))
    elif unanswered:
        # Accepted connections without the listener (another process of the service holds it).
        on = tuple(sorted({c.local_port for c in unanswered}))
        reasons.append(ev.WorkWaiting(on, 0, unread, len(unanswered), oldest_s, True))
    else:
        reasons.append(ev.NoFrontDoor())
    if last_progress is not None and since == last_progress.what:
        reasons.append(last_progress)
    if stuck_s >= threshold_s:
        reasons.append(ev.PastThreshold(stuck_s, threshold_s, since))
        return STALLED, reasons, stuck_s
    reasons.append(ev.UnderThreshold(stuck_s, threshold_s))
    return PROGRESSING, reasons, stuck_s


def classify_service(
    root: int,
    procs: Sequence[ProcessFacts],
    threshold_s: float,
    gone: Sequence[int] = (),
    root_gone: bool = False,
    evidence: ServiceFacts | None = None,
) -> ServiceVerdict:
    """The service's verdict, its reasons ending with the evidence that explains it, and
    led by the process that holds it up when one is known (agent.analysis.culprit)."""
    evidence = evidence or ServiceFacts()
    v = _classify_service(
        root, procs, threshold_s, gone, root_gone, evidence.last_progress, evidence.demand_age_s
    )
    if v.state == DEADLOCKED:
        v.reasons.extend(evidence.cycles)
    elif v.state in (STALLED, IDLE):
        v.reasons.extend(evidence.parked)
        v.reasons.extend(heartbeat(f.progress) for f in procs if f.progress.heartbeat)
    if v.state in (STALLED, DEADLOCKED):
        v.culprit = find_culprit(v, procs)
        if v.culprit is not None:
            v.reasons.insert(0, v.culprit)
    # Whatever the verdict: it rests on less than the process did (its own doing).
    for f, pv in zip(procs, v.processes):
        if f.incomplete is not None:
            v.reasons.append(f.incomplete)
            pv.reasons.append(f.incomplete)
    return v


def rests_on_time(v: ServiceVerdict) -> bool:
    """Whether the service's verdict was judged by its time without progress: quiet, not
    idle, nothing proven. Only then can progress dated before the window (ServiceFacts'
    last_progress) change it, so only then is it worth an fd walk to date."""
    return any(isinstance(r, (ev.PastThreshold, ev.UnderThreshold)) for r in v.reasons)


def _classify_service(
    root: int,
    procs: Sequence[ProcessFacts],
    threshold_s: float,
    gone: Sequence[int],
    root_gone: bool,
    last_progress: ev.LastProgress | None,
    demand_age_s: float | None = None,
) -> ServiceVerdict:
    verdicts = [classify_process(f, threshold_s) for f in procs]
    for pid in gone:
        verdicts.append(ProcessVerdict(pid, "?", 0, 0, 0.0, PROGRESSING, [ev.Exited()], gone=True))
    cycles = sorted({c for v in verdicts for c in v.cycles})
    if root_gone:
        return ServiceVerdict(root, PROGRESSING, [ev.Exited(root)], cycles, verdicts, True)
    stuck = [f for f in procs if f.no_waker and not f.cycles]
    if cycles or stuck:
        reasons: list[ev.Fact] = [ev.CyclesStable(len(cycles))] if cycles else []
        # Name a few (a pool of 100 workers with no waker is one finding, not 100 reasons)
        reasons += [no_waker(f.sample, f.waits) for f in stuck[:MAX_NAMED]]
        if len(stuck) > MAX_NAMED:
            reasons.append(ev.MoreNoWaker(len(stuck) - MAX_NAMED))
        return _waiters_take(ServiceVerdict(root, DEADLOCKED, reasons, cycles, verdicts))
    spinning = [f for f, v in zip(procs, verdicts) if v.gpu_spin]
    working = [v for v in verdicts if v.worked and not v.gone]
    if spinning and not working:
        # Its host threads' parked time is its time without progress (the GPUs only spin).
        return _waiters_take(
            ServiceVerdict(
                root,
                STALLED,
                [gpu_spin(f.gpu for f in spinning if f.gpu is not None)],
                cycles,
                verdicts,
                gpu_spin=True,
                seconds_since_progress=min(f.parked_seconds for f in spinning),
            )
        )
    spin_idle = _spinning_idle(root, procs, verdicts, demand_age_s)
    if spin_idle is not None:
        return _waiters_take(spin_idle)
    if working:
        reasons = [ev.ProcessWorks(v.pid, v.comm, tuple(v.reasons)) for v in working]
        parked = [v for v in verdicts if not v.worked and not v.gone]
        if parked:
            reasons.append(ev.PeersParked(len(parked)))
        return _waiters_take(ServiceVerdict(root, PROGRESSING, reasons, cycles, verdicts))
    if not procs:
        return ServiceVerdict(root, PROGRESSING, [ev.NothingLeft()], cycles, verdicts, True)
    v = _parked_service(root, procs, threshold_s, last_progress, demand_age_s)
    v.processes = verdicts
    return _waiters_take(v)


def _spinning_idle(
    root: int,
    procs: Sequence[ProcessFacts],
    verdicts: list[ProcessVerdict],
    demand_age_s: float | None,
) -> ServiceVerdict | None:
    """CPU that serves no one is not progress: a service whose only work in the window was
    threads spinning (their polls found nothing, many times a second), with front doors and
    nothing waiting at them (no connection queued, no request unread or unanswered, none in
    the window), is idle however much CPU it burns, as a heartbeat is a write that serves no
    one. Where a request waits, a spinning thread may be the one serving it, and where there
    is no front door the work is the job's own: then the CPU counts. None unless idle so."""
    worked = [(f, v) for f, v in zip(procs, verdicts) if v.worked and not v.gone]
    if not worked or not all(f.progress.only_spins for f, _ in worked):
        return None
    doors = [lst for f in procs for lst in door_listeners(f.sample, f.front_door_ports)]
    if not doors or demand_age_s is not None:
        return None
    if any(lst.queued for lst in doors) or any(
        unread_requests(f.sample, f.front_door_ports)
        or unanswered_requests(f.sample, f.front_door_ports, f.streams)
        for f in procs
    ):
        return None
    reasons: list[ev.Fact] = [ev.WaitingForRequests(tuple(sorted({lst.port for lst in doors})))]
    for f, v in worked:
        spins = f.progress.spin()
        reasons.append(ev.ProcessSpins(v.pid, v.comm, spins))
        v.worked, v.state, v.reasons = False, IDLE, [spins]
    incomplete = [
        c for f in procs for c in incomplete_requests(f.sample, f.front_door_ports, f.streams)
    ]
    if incomplete:
        reasons.append(ev.RequestIncomplete(len(incomplete), oldest_request_s(incomplete)))
    return ServiceVerdict(root, IDLE, reasons, [], verdicts)


def _parked_service(
    root: int,
    procs: Sequence[ProcessFacts],
    threshold_s: float,
    last_progress: ev.LastProgress | None,
    demand_age_s: float | None,
) -> ServiceVerdict:
    """A service none of whose processes works: idle, stalled, or under the threshold, by
    what waits at its front doors and its time without progress (_parked_state)."""
    parked_s = min(f.parked_seconds for f in procs)
    threads = sum(len(f.sample.threads) for f in procs)
    unanswered = sorted(
        (c for f in procs for c in unanswered_requests(f.sample, f.front_door_ports, f.streams)),
        key=lambda c: -(c.last_recv_ms or 0),
    )
    state, reasons, stuck_s = _parked_state(
        ev.AllParked(threads, len(procs), parked_s),
        threshold_s,
        [lst for f in procs for lst in door_listeners(f.sample, f.front_door_ports)],
        sum(unread_requests(f.sample, f.front_door_ports) for f in procs),
        unanswered,
        last_progress,
        demand_age_s,
        [c for f in procs for c in incomplete_requests(f.sample, f.front_door_ports, f.streams)],
    )
    idle_gpu = gpu_idle({f.sample.pid: f.gpu for f in procs if f.gpu is not None})
    if idle_gpu:
        reasons.append(idle_gpu)
    v = ServiceVerdict(root, state, reasons, [], [])
    v.unanswered_requests, v.seconds_since_progress = len(unanswered), stuck_s
    v.oldest_request_s = oldest_request_s(unanswered)
    return v


def _waiters_take(v: ServiceVerdict) -> ServiceVerdict:
    """Processes that did nothing of their own but wait (not in a cycle, not gone) take the
    service's state: a healthy idle server's scheduler is idle, not stalled; a rank parked in
    a collective behind a computing peer is progressing; the front-end of a scheduler in a
    lock cycle is deadlocked with it. Returns the verdict with those processes' verdicts
    replaced; ``v`` and its process verdicts are left as they were."""
    return replace(v, processes=[_takes(p, v.state) for p in v.processes])


def _takes(p: ProcessVerdict, state: str) -> ProcessVerdict:
    """``p``, or where it only waits, a copy that takes the service's ``state``."""
    if p.worked or p.gone or p.state == DEADLOCKED or p.gpu_spin:
        return p
    # Its own reasons judged it alone ("no front door", "under the threshold"): keep what it
    # did (parked since when), and say whose state it takes.
    return replace(p, state=state, reasons=[*p.reasons[:1], ev.WaitsWithService(state)])
