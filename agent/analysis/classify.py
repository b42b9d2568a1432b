"""Verdicts: deadlocked, stalled, idle or progressing, with the evidence for each.

Precedence (docs/how-it-works.md): a stable lock cycle wins over everything;
then any work in the window; then a fully parked process or service is idle
when it listens with nothing queued (or has been parked for less than the
threshold), and stalled otherwise.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from ..model import Connection, Listener, ProbeShare, ProcessSample, ThreadSample, derived
from ..syscalls import FUTEX, syscall_name, wait_kind
from . import evidence as ev
from .culprit import find_culprit
from .gpu import ProcessGpu
from .progress import ProcessProgress
from .waitgraph import WaitEdge, WordGroup

DEADLOCKED = "deadlocked"
STALLED = "stalled"
IDLE = "idle"
PROGRESSING = "progressing"
STATES = (DEADLOCKED, STALLED, IDLE, PROGRESSING)
MAX_NAMED = 3  # processes with no waker named one by one in a service's reasons
# A thread that has waited since the process's first seconds is parked since start-up (Ray's
# gRPC threads, gloo's run loops, a C++ daemon's main thread joining its workers), not the
# hang.
STARTUP_S = 5.0


@dataclass
class ProcessVerdict:
    pid: int
    comm: str
    threads: int
    parked_threads: int
    parked_seconds: float  # how long every thread has been parked; 0 if any works
    state: str
    reasons: list[ev.Fact]
    cycles: list[tuple[int, ...]] = field(default_factory=list)
    listening_ports: tuple[int, ...] = ()
    gone: bool = False
    gpu_spin: bool = False  # host parked past the threshold while its GPUs stay pegged
    worked: bool = False  # did work of its own in the window (not merely under the threshold)
    waits: ev.ProcessWaits | None = None  # what its threads wait in
    no_waker: bool = (
        False  # deadlocked because no thread of it can be woken (agent.analysis.nowaker)
    )


@dataclass
class ServiceVerdict:
    pid: int
    state: str
    reasons: list[ev.Fact]
    cycles: list[tuple[int, ...]]
    processes: list[ProcessVerdict]
    gone: bool = False
    gpu_spin: bool = False
    # The parked evidence its verdict used (0 when it works): requests on its front doors
    # waiting for an answer, and its time without progress (the longest of its parked time,
    # its oldest unanswered request's age and the age of its last dated progress).
    unanswered_requests: int = 0
    seconds_since_progress: float = 0.0
    oldest_request_s: float = 0.0  # how long its oldest unanswered request has waited
    culprit: ev.Culprit | None = None  # the process that holds it up, when one is known


@dataclass(frozen=True)
class ServiceFacts:
    """The lock and I/O evidence of a service, gathered before it is classified: the
    classifier puts the part that explains its verdict into the reasons."""

    cycles: Sequence[ev.LockCycle] = ()  # each stable lock cycle (for a deadlock)
    parked: Sequence[ev.Fact] = ()  # the largest parked groups, listen times, last writes
    # The most recent progress dated before the window (None: nothing dated, or not looked
    # for): a parked service that is not idle has made none for at least that long. The
    # caller dates only where it counts (see rests_on_time).
    last_progress: ev.LastProgress | None = None
    # How long ago work last waited at its front doors, when that was within the window
    # (None: not in the window): a service is idle only if nothing waited in all of it.
    demand_age_s: float | None = None


@dataclass(frozen=True)
class ProcessFacts:
    """Everything the classifier needs about one process, gathered by the caller."""

    sample: ProcessSample
    progress: ProcessProgress
    parked_threads: int
    parked_seconds: float
    cycles: Sequence[tuple[int, ...]] = ()
    gpu: ProcessGpu | None = None  # None: NVML did not answer, or it holds no GPU
    # The service's listening ports that outside clients connect to; None: all of them.
    front_door_ports: frozenset[int] | None = None
    waits: ev.ProcessWaits | None = None  # what its threads wait in (process_waits)
    no_waker: bool = (
        False  # no thread of it can ever be woken but by a signal (agent.analysis.nowaker)
    )
    # Inodes of its connections whose streamed answer is still being sent (agent.analysis.answers)
    streams: frozenset[int] = frozenset()
    # What the kernel side did not keep of it beyond its share of the shared maps; None: nothing
    incomplete: ev.EvidenceIncomplete | None = None


def incomplete(pid: int, share: ProbeShare | None) -> ev.EvidenceIncomplete | None:
    """The fact that the kernel side kept less of ``pid`` than it did, where it did."""
    if share is None or not (share.entries_refused or share.events_dropped):
        return None
    return ev.EvidenceIncomplete(pid, share.entries_refused, share.events_dropped)


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


def door_listeners(sample: ProcessSample, ports: frozenset[int] | None) -> list[Listener]:
    """The process's listeners that clients outside the service connect to (``ports``: the
    service's front-door ports; None: every listener counts, as when nothing is known)."""
    return [lst for lst in sample.listeners if ports is None or lst.port in ports]


def waiting_for_answer(c: Connection) -> bool:
    """The connection holds a request the service has not answered: it received data more
    recently than it sent any (tcp_info, both times known, some data received). An idle
    keep-alive connection sent last (its answer), so it does not wait. A fresh connection
    whose first request is unanswered has sent nothing since the handshake, which set both
    times at once: equal times (jiffy granular) with nothing of its own acknowledged are the
    same case, checked on this kernel with a request sent right after connect()."""
    recv, sent = c.last_recv_ms, c.last_sent_ms
    if recv is None or sent is None or not c.bytes_received:
        return False
    return recv < sent or (recv == sent and c.bytes_acked == 0)


def client_turn(c: Connection, reading: frozenset[int]) -> bool:
    """The connection holds a request the server has not been sent in full: it looks
    unanswered (waiting_for_answer), the server has read every byte of it (nothing in its
    receive queue) and a thread of the server is blocked reading more of it (``reading``:
    ProcessSample.reading). The server cannot answer what it has not received: the client
    owes the rest, so the wait is the client's. What this cannot see (event loops, a reader
    that hands requests off) is in docs/how-it-works.md."""
    return c.inode in reading and c.rx_queue == 0 and waiting_for_answer(c)


def incomplete_requests(
    sample: ProcessSample, ports: frozenset[int] | None, streams: frozenset[int] = frozenset()
) -> list[Connection]:
    """The process's accepted connections on a front door (``ports`` and ``streams`` as for
    unanswered_requests) whose request the client has not finished sending (client_turn),
    oldest first. An answer being streamed on one says its request was whole: not one."""
    if not sample.reading:
        return []
    if ports is None:
        ports = frozenset(lst.port for lst in sample.listeners)
    reading = sample.reading
    return sorted(
        (
            c
            for c in sample.connections
            if c.local_port in ports and c.inode not in streams and client_turn(c, reading)
        ),
        key=lambda c: -(c.last_recv_ms or 0),
    )


def unread_requests(sample: ProcessSample, ports: frozenset[int] | None) -> int:
    """Bytes received and not yet read on the process's accepted connections on a front door
    (``ports`` as for unanswered_requests): requests not read. Its other connections' unread
    bytes are chatter caught in flight: a Ray cluster's ~95 loopback gRPC messages a second
    left 218 bytes queued on some connection of an idle Serve app now and then."""
    if ports is None:
        ports = frozenset(lst.port for lst in sample.listeners)
    return derived(
        sample.connections,
        ("unread", ports),
        lambda cs: sum(c.rx_queue for c in cs if c.local_port in ports),
    )


def unanswered_requests(
    sample: ProcessSample, ports: frozenset[int] | None, streams: frozenset[int] = frozenset()
) -> list[Connection]:
    """The process's accepted connections on a front door (``ports``: the service's front-door
    ports; None: its own listening ports) that wait for an answer, oldest first: not answered
    at all, or (``streams``: their inodes) a streamed answer still being sent. A request the
    server is still reading from its client (client_turn) is not one: it waits on the client."""
    if ports is None:
        ports = frozenset(lst.port for lst in sample.listeners)
    reading = sample.reading
    return list(
        derived(
            sample.connections,
            ("unanswered", ports, streams, reading),
            lambda cs: tuple(
                sorted(
                    (
                        c
                        for c in cs
                        if c.local_port in ports
                        and (
                            c.inode in streams
                            or (waiting_for_answer(c) and not client_turn(c, reading))
                        )
                    ),
                    key=lambda c: -(c.last_recv_ms or 0),
                )
            ),
        )
    )


def oldest_request_s(unanswered: Iterable[Connection]) -> float:
    """How long the oldest of these unanswered requests has waited (0 for none)."""
    return max((c.last_recv_ms or 0 for c in unanswered), default=0) / 1000


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


def gpu_idle(gpus: Mapping[int, ProcessGpu]) -> ev.GpuIdle | None:
    """Processes holding GPUs but not using them, or None."""
    held = [g for g in gpus.values() if g.memory_bytes and not g.active]
    if not held:
        return None
    uses = [u for g in held for u in g.uses]
    per_gpu = [u.memory_bytes or 0 for u in uses]
    each = per_gpu[0] if len(set(per_gpu)) == 1 and len(per_gpu) > 1 else None
    return ev.GpuIdle(
        tuple(u.gpu for u in uses), min(g.idle_for_s for g in held), each, sum(per_gpu)
    )


def gpu_spin(gpus: Iterable[ProcessGpu]) -> ev.GpuSpin:
    gs = list(gpus)
    uses = [u for g in gs for u in g.uses]
    return ev.GpuSpin(
        tuple(u.gpu for u in uses),
        min(u.sm_utilization for u in uses),
        min(g.high_for_s for g in gs),
    )


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
    lock cycle is deadlocked with it."""
    for p in v.processes:
        if not (p.worked or p.gone or p.state == DEADLOCKED or p.gpu_spin):
            # Its own reasons judged it alone ("no front door", "under the threshold"):
            # keep what it did (parked since when), and say whose state it takes.
            p.state = v.state
            p.reasons = [*p.reasons[:1], ev.WaitsWithService(v.state)]
    return v
