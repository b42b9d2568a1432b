"""Verdicts: deadlocked, stalled, idle or progressing, with the reasons in words.

Precedence (docs/how-it-works.md): a stable lock cycle wins over everything;
then any work in the window; then a fully parked process or service is idle
when it listens with nothing queued (or has been parked for less than the
threshold), and stalled otherwise.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from .gpuverdict import ProcessGpu, describe_idle, describe_spin
from .model import Connection, Listener, ProcessSample, plural
from .progress import ProcessProgress
from .waitgraph import WaitEdge, WordGroup

DEADLOCKED = "deadlocked"
STALLED = "stalled"
IDLE = "idle"
PROGRESSING = "progressing"
STATES = (DEADLOCKED, STALLED, IDLE, PROGRESSING)


@dataclass
class ProcessVerdict:
    pid: int
    comm: str
    threads: int
    parked_threads: int
    parked_seconds: float  # how long every thread has been parked; 0 if any works
    state: str
    reasons: list[str]
    cycles: list[tuple[int, ...]] = field(default_factory=list)
    listening_ports: tuple[int, ...] = ()
    gone: bool = False
    gpu_spin: bool = False  # host parked past the threshold while its GPUs stay pegged
    worked: bool = False  # did work of its own in the window (not merely under the threshold)


@dataclass
class ServiceVerdict:
    pid: int
    state: str
    reasons: list[str]
    cycles: list[tuple[int, ...]]
    processes: list[ProcessVerdict]
    gone: bool = False
    gpu_spin: bool = False
    # The parked evidence its verdict used (0 when it works): requests on its front doors
    # waiting for an answer, and its time without progress (the longer of its parked time
    # and its oldest unanswered request's age).
    unanswered_requests: int = 0
    seconds_since_progress: float = 0.0


@dataclass(frozen=True)
class Evidence:
    """The lock and I/O evidence of a service, in words, gathered before it is classified:
    the classifier puts the part that explains its verdict into the reasons."""

    cycles: Sequence[str] = ()  # each stable lock cycle (for a deadlock)
    parked: Sequence[str] = ()  # the largest parked groups, listen times, last writes


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


def _all_threads(n: int) -> str:
    return "its only thread" if n == 1 else f"all {n} threads"


def _fmt_s(s: float) -> str:
    return f"{s:.0f} s" if s >= 10 else f"{s:.1f} s"


def describe_cycle(
    cycle: tuple[int, ...], edges: Mapping[int, WaitEdge], names: Mapping[int, str]
) -> str:
    parts = []
    for tid in cycle:
        e = edges.get(tid)
        if e is None:
            continue
        parts.append(
            f"{tid} ({names.get(tid, '?')}) waits for {e.kind} {e.uaddr:#x} held by {e.owner}"
        )
    return f"lock cycle of {plural(len(cycle), 'thread')}: " + "; ".join(parts)


def describe_group(g: WordGroup, now_ns: int) -> str:
    if g.owner_kind == "join":
        owner = f"joining thread {g.owner}"
    elif g.owner:
        owner = f"{g.owner_kind} held by {g.owner}"
    else:
        owner = "no owner"
    since = f" for {_fmt_s((now_ns - g.since_ns) / 1e9)}" if g.since_ns else ""
    where = f" across {len(g.pids)} processes" if len(g.pids) > 1 else ""
    return f"{plural(len(g.tids), 'thread')} parked on one word {g.uaddr:#x} ({g.op_name}){where}, {owner}{since}"


def front_doors(sample: ProcessSample, ports: frozenset[int] | None) -> list[Listener]:
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


def unanswered_requests(sample: ProcessSample, ports: frozenset[int] | None) -> list[Connection]:
    """The process's accepted connections on a front door (``ports``: the service's front-door
    ports; None: its own listening ports) that wait for an answer, oldest first."""
    if ports is None:
        ports = frozenset(lst.port for lst in sample.listeners)
    waiting = [c for c in sample.connections if c.local_port in ports and waiting_for_answer(c)]
    return sorted(waiting, key=lambda c: -(c.last_recv_ms or 0))


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
    )
    if facts.cycles:
        v.state = DEADLOCKED
        v.reasons.append(f"{plural(len(facts.cycles), 'lock cycle')} among its threads")
        return v
    gpu = facts.gpu
    host_work = bool(prog.working_tids or prog.write_bytes)
    if (
        gpu is not None
        and not host_work
        and facts.parked_threads == n
        and min(facts.parked_seconds, gpu.high_for_s) >= threshold_s
    ):
        v.state, v.gpu_spin = STALLED, True
        v.reasons.append(f"{_all_threads(n)} parked for {_fmt_s(facts.parked_seconds)}")
        v.reasons.append(describe_spin([gpu]))
        return v
    if prog.did_work:
        v.worked = True
        v.reasons.extend(prog.signals())
        return v
    if facts.parked_threads < n:
        v.worked = True
        v.reasons.append(f"{n - facts.parked_threads} of {plural(n, 'thread')} not parked")
        return v
    v.state, why, _ = _parked_state(
        facts.parked_seconds,
        threshold_s,
        front_doors(s, facts.front_door_ports),
        s.unread_bytes,
        _all_threads(n),
        unanswered_requests(s, facts.front_door_ports),
    )
    v.reasons.extend(why)
    idle_gpu = describe_idle({s.pid: gpu}) if gpu is not None else None
    if idle_gpu:
        v.reasons.append(idle_gpu)
    return v


def _parked_state(
    parked_s: float,
    threshold_s: float,
    doors: Iterable[Listener],
    unread: int,
    who: str,
    unanswered: Sequence[Connection] = (),
) -> tuple[str, list[str], float]:
    """Nothing progresses: idle when a front door has nothing waiting at it; otherwise
    stalled once past the threshold, and still progressing under it. ``unanswered``: accepted
    connections on its front doors that wait for an answer (see waiting_for_answer); they
    carry their own age, so the oldest of them counts as time without progress even when
    its threads ran more recently (DESIGN: evidence carries its own age). Returns the state,
    its reasons, and that time without progress (seconds)."""
    doors = list(doors)
    queued = sum(lst.queued for lst in doors)
    ports = ", ".join(str(p) for p in sorted({lst.port for lst in doors}))
    oldest_s = max((c.last_recv_ms or 0 for c in unanswered), default=0) / 1000
    stuck_s = max(parked_s, oldest_s)
    reasons = [f"{who} parked for {_fmt_s(parked_s)}, no progress in the window"]
    under = f"no progress for {_fmt_s(stuck_s)}, under the {_fmt_s(threshold_s)} threshold"
    if doors and not (queued or unread or unanswered):
        reasons.append(
            f"listening on port {ports} with an empty accept queue: waiting for requests"
        )
        return IDLE, reasons, stuck_s
    pend = []
    if queued:
        pend.append(f"{plural(queued, 'connection')} waiting in the accept queue")
    if unread:
        pend.append(f"{plural(unread, 'byte')} of requests unread")
    if unanswered:
        pend.append(f"{plural(len(unanswered), 'request')} unanswered for {_fmt_s(oldest_s)}")
    if doors:
        reasons.append(f"listening on port {ports}: " + " and ".join(pend))
    elif unanswered:
        # Accepted connections without the listener (another process of the service holds it).
        on = ", ".join(str(p) for p in sorted({c.local_port for c in unanswered}))
        reasons.append(f"connections accepted on port {on}: " + " and ".join(pend))
    else:
        reasons.append("no front door: nothing outside the service is waiting to be served")
    if stuck_s >= threshold_s:
        past = f"past the {_fmt_s(threshold_s)} threshold"
        if oldest_s > parked_s:
            past = f"no progress for {_fmt_s(oldest_s)} (the oldest unanswered request), {past}"
        reasons.append(past)
        return STALLED, reasons, stuck_s
    reasons.append(under)
    return PROGRESSING, reasons, stuck_s


def classify_service(
    root: int,
    procs: Sequence[ProcessFacts],
    threshold_s: float,
    gone: Sequence[int] = (),
    root_gone: bool = False,
    evidence: Evidence | None = None,
) -> ServiceVerdict:
    """The service's verdict, its reasons ending with the evidence that explains it."""
    v = _classify_service(root, procs, threshold_s, gone, root_gone)
    if evidence is not None and v.state == DEADLOCKED:
        v.reasons.extend(evidence.cycles)
    elif evidence is not None and v.state in (STALLED, IDLE):
        v.reasons.extend(evidence.parked)
    return v


def _classify_service(
    root: int,
    procs: Sequence[ProcessFacts],
    threshold_s: float,
    gone: Sequence[int],
    root_gone: bool,
) -> ServiceVerdict:
    verdicts = [classify_process(f, threshold_s) for f in procs]
    for pid in gone:
        verdicts.append(
            ProcessVerdict(pid, "?", 0, 0, 0.0, PROGRESSING, ["exited while watched"], gone=True)
        )
    cycles = sorted({c for v in verdicts for c in v.cycles})
    if root_gone:
        return ServiceVerdict(
            root, PROGRESSING, [f"process {root} exited while watched"], cycles, verdicts, True
        )
    if cycles:
        reasons = [f"{plural(len(cycles), 'lock cycle')} stable across two reads"]
        return _waiters_take(ServiceVerdict(root, DEADLOCKED, reasons, cycles, verdicts))
    spinning = [f for f, v in zip(procs, verdicts) if v.gpu_spin]
    working = [v for v in verdicts if v.worked and not v.gone]
    if spinning and not working:
        reasons = [describe_spin(f.gpu for f in spinning if f.gpu is not None)]
        # Its host threads' parked time is its time without progress (the GPUs only spin).
        stuck_s = min(f.parked_seconds for f in spinning)
        return _waiters_take(
            ServiceVerdict(
                root,
                STALLED,
                reasons,
                cycles,
                verdicts,
                gpu_spin=True,
                seconds_since_progress=stuck_s,
            )
        )
    if working:
        reasons = [f"process {v.pid} ({v.comm}): {'; '.join(v.reasons)}" for v in working]
        parked = [v for v in verdicts if not v.worked and not v.gone]
        if parked:
            reasons.append(
                f"{plural(len(parked), 'other process', 'other processes')} parked while a peer "
                "works: not a stall"
            )
        return _waiters_take(ServiceVerdict(root, PROGRESSING, reasons, cycles, verdicts))
    if not procs:
        return ServiceVerdict(root, PROGRESSING, ["nothing left to watch"], cycles, verdicts, True)
    parked_s = min(f.parked_seconds for f in procs)
    threads = sum(len(f.sample.threads) for f in procs)
    who = _all_threads(threads)
    if len(procs) > 1:
        who += f" of {len(procs)} processes"
    unanswered = sorted(
        (c for f in procs for c in unanswered_requests(f.sample, f.front_door_ports)),
        key=lambda c: -(c.last_recv_ms or 0),
    )
    state, reasons, stuck_s = _parked_state(
        parked_s,
        threshold_s,
        [lst for f in procs for lst in front_doors(f.sample, f.front_door_ports)],
        sum(f.sample.unread_bytes for f in procs),
        who,
        unanswered,
    )
    idle_gpu = describe_idle({f.sample.pid: f.gpu for f in procs if f.gpu is not None})
    if idle_gpu:
        reasons.append(idle_gpu)
    v = ServiceVerdict(root, state, reasons, cycles, verdicts)
    v.unanswered_requests, v.seconds_since_progress = len(unanswered), stuck_s
    return _waiters_take(v)


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
            p.reasons = [*p.reasons[:1], f"waits with its service, which is {v.state}"]
    return v
