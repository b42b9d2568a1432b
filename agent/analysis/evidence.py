"""Evidence: one typed record per kind of fact a verdict rests on.

The classifier and the observer build these records; ``agent.report.sentences`` turns them into the
sentences of ``diagnose``, the daemon's log and the reasons of ``--json``, in one place, and
``as_json`` gives each record's fields to ``--json`` as they are. A record says what was
seen, with its numbers and, where it has one, its age (``age_s``: how long before the
snapshot it happened or began), never how to phrase it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, is_dataclass
from enum import Enum
from typing import Any

from ..model import FdWait


@dataclass(frozen=True)
class Fact:
    """Base of every record: ``kind`` names it in JSON (CpuWork -> "cpu_work")."""

    @property
    def kind(self) -> str:
        return re.sub(r"(?<!^)(?=[A-Z])", "_", type(self).__name__).lower()


def _as_they_are(_f: Fact) -> Mapping[str, Any]:
    return {}


def as_json(f: Fact, said: Callable[[Fact], Mapping[str, Any]] = _as_they_are) -> dict[str, Any]:
    """The record's fields for ``--json``, floats rounded, nested records included. ``said``
    gives, by field name, the fields the report writes in words instead (a front door's why,
    a clock time: agent.report.sentences.evidence_json)."""
    out: dict[str, Any] = {"kind": f.kind}
    words = said(f)
    for fl in fields(f):
        v = getattr(f, fl.name)
        if fl.name in words:
            v = words[fl.name]
        elif isinstance(v, float):
            v = round(v, 3)
        elif isinstance(v, tuple):
            v = [_nested(x, said) for x in v]
        elif isinstance(v, Fact):
            v = as_json(v, said)
        elif is_dataclass(v) and not isinstance(v, type):
            v = _nested(v, said)
        out[fl.name] = v
    return out


def _nested(v: Any, said: Callable[[Fact], Mapping[str, Any]] = _as_they_are) -> Any:
    """A value inside a record's field: records and plain data as dicts, numbers as they are."""
    if isinstance(v, Fact):
        return as_json(v, said)
    if isinstance(v, tuple):
        return tuple(_nested(x, said) for x in v)
    if is_dataclass(v) and not isinstance(v, type):
        return {fl.name: _nested(getattr(v, fl.name), said) for fl in fields(v)}
    return v


# --- progress in the window ----------------------------------------------------------------


@dataclass(frozen=True)
class CpuWork(Fact):
    threads: int  # threads above the CPU floor
    cpu_s: float
    window_s: float


@dataclass(frozen=True)
class Spins(Fact):
    """Threads whose CPU went to asking for input that was not there: their polls found
    nothing, many times a second (agent.analysis.progress, SPIN_MIN_EMPTY_POLLS_PER_S)."""

    threads: int
    cpu_s: float
    empty_polls: int  # polls that found nothing in the window
    window_s: float


@dataclass(frozen=True)
class ProcessSpins(Fact):
    """A process of an idle service whose only work was a spin: CPU that serves no one,
    with nothing waiting at the service's front doors."""

    pid: int
    comm: str
    spins: Spins


@dataclass(frozen=True)
class WroteOut(Fact):
    """Bytes written to files, terminals or peers outside the service."""

    bytes: int
    window_s: float
    answered: int = 0  # of ``bytes``, answers to clients


@dataclass(frozen=True)
class Heartbeat(Fact):
    """Small writes to files by a process that did nothing else in the window (no CPU above
    the floor, no data in, no answer to a client, no GPU work): a status line on a timer,
    not progress (agent.analysis.progress)."""

    bytes: int
    to: str  # the file written most, as its fd link names it
    window_s: float


@dataclass(frozen=True)
class ReceivedIn(Fact):
    """Data received from outside the service (not requests on a front door): weights, a
    peer rank on another host."""

    bytes: int
    window_s: float


@dataclass(frozen=True)
class ReadStorage(Fact):
    """Data read from storage at a loader's rate (agent.analysis.progress): block reads or
    reads of regular files (bytes), or page-ins of mapped files (major faults), each as its
    own source counted it."""

    block_bytes: int  # read by the block layer for it (/proc/PID/io read_bytes)
    file_bytes: int  # taken from regular files by its read calls (the read probe)
    major_faults: int  # page-ins of mapped files
    window_s: float

    @property
    def bytes(self) -> int:
        """What it read: a read that misses the page cache is in both byte counts."""
        return max(self.block_bytes, self.file_bytes)


@dataclass(frozen=True)
class Accepted(Fact):
    """Connections accepted in the window: context, never progress on its own."""

    connections: int


@dataclass(frozen=True)
class GpuActive(Fact):
    gpus: tuple[int, ...]
    utilization: float  # the highest SM utilisation of its GPUs
    memory_change: int  # bytes over the window (signed)


@dataclass(frozen=True)
class NotParked(Fact):
    running: int  # threads not parked
    threads: int


@dataclass(frozen=True)
class ProcessWorks(Fact):
    """A process of the service that works, and what it did."""

    pid: int
    comm: str
    facts: tuple[Fact, ...]


@dataclass(frozen=True)
class PeersParked(Fact):
    """Processes parked while a peer works: not a stall."""

    processes: int


# --- parked -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class AllParked(Fact):
    threads: int
    processes: int  # 1: the process itself
    seconds: float  # parked for this long, as observed


@dataclass(frozen=True)
class WaitingForRequests(Fact):
    """Front doors with nothing waiting at them: what makes a service idle."""

    ports: tuple[int, ...]


@dataclass(frozen=True)
class RequestIncomplete(Fact):
    """Requests the clients have not finished sending: the server read what came and waits
    for the rest (a thread of it blocked reading the connection), so the wait is theirs."""

    requests: int
    oldest_s: float  # since the oldest of them last received data


@dataclass(frozen=True)
class WorkWaiting(Fact):
    """Work waiting for the service at its front doors (or on connections it accepted)."""

    ports: tuple[int, ...]
    queued: int  # connections in accept queues
    unread: int  # bytes of requests not read
    unanswered: int  # requests received and not answered
    oldest_s: float  # the oldest unanswered request's age
    accepted_only: bool = False  # the listener is another process's: seen on connections


@dataclass(frozen=True)
class WorkWaited(Fact):
    """Nothing waits at the front doors now, but work did within the window: a client that
    gave up, or retries (each try times out, then it connects again)."""

    ports: tuple[int, ...]
    age_s: float  # since work was last seen waiting


@dataclass(frozen=True)
class NoFrontDoor(Fact):
    pass


@dataclass(frozen=True)
class PastThreshold(Fact):
    stuck_s: float  # time without progress
    threshold_s: float
    since: str  # what dates it: "parked", "request", or a LastProgress kind


@dataclass(frozen=True)
class UnderThreshold(Fact):
    stuck_s: float
    threshold_s: float


@dataclass(frozen=True)
class LastProgress(Fact):
    """The most recent dated sign of progress before the observation: a file written (its
    mtime), data sent to or received from outside (tcp_info), a thread that last ran (a
    wait that began then and has not woken since)."""

    what: str  # "write" | "sent" | "received" | "ran"
    # The fd link of the file, the peer's "address:port", or the thread that ran
    target: str | Thread
    pid: int
    age_s: float


@dataclass(frozen=True)
class Thread:
    """A thread, by TID and name (its comm)."""

    tid: int
    name: str


@dataclass(frozen=True)
class ParkedGroup(Fact):
    threads: int
    uaddr: int
    op: str
    processes: int
    owner_kind: str  # "mutex", "pi", "join", ... or "" when no owner is known
    owner: int  # 0: none
    age_s: float | None  # since its oldest wait began, when known
    word: str | None = None  # what the word is (agent.sources.symbols.describe_address), when read


@dataclass(frozen=True)
class CycleLink(Fact):
    tid: int
    name: str
    lock_kind: str
    uaddr: int
    owner: int
    word: str | None = None  # what the word is (agent.sources.symbols.describe_address), when read


@dataclass(frozen=True)
class LockCycle(Fact):
    links: tuple[CycleLink, ...]


@dataclass(frozen=True)
class NoWaker(Fact):
    """Every thread of a process waits, with no timeout, on a process-private futex, the
    same in two reads: no thread of it can wake another and no other process can reach the
    words (agent.analysis.nowaker). Only a signal can end it."""

    pid: int
    comm: str
    threads: int
    words: int  # distinct futex words waited on
    age_s: float | None  # since the newest of those waits began, when known


@dataclass(frozen=True)
class MoreNoWaker(Fact):
    """More processes of the service proven to have no waker than are named."""

    processes: int


@dataclass(frozen=True)
class CyclesStable(Fact):
    cycles: int
    among_threads: bool = False  # a process's own view: "among its threads"


class DoorRule(Enum):
    """The rule of agent.analysis.frontdoor that decided whether a port is a front door."""

    DECLARED = "declared"  # among the config's front doors
    NOT_DECLARED = "not declared"  # the config names others
    NONE_DECLARED = "none declared"  # the config says the service has none
    PLUMBING = "plumbing"  # named by a process's MASTER_PORT or a launcher's flag
    JOB_EPHEMERAL = "job ephemeral"  # an ephemeral port held by a rank or a launcher
    KERNEL_CHOSEN = "kernel chosen"  # bound to port 0, no connection
    NAMED = "named"  # named on the root's command line, no connection yet
    BY_NUMBER = "by number"  # below the ephemeral range, no connection yet
    UNNAMED_EPHEMERAL = "unnamed ephemeral"  # in the ephemeral range, unnamed, no connection
    CLIENTS = "clients"  # a peer from outside the service connects to it
    PEERS_INSIDE = "peers inside"  # every peer is a process of the service


@dataclass(frozen=True)
class Holder:
    """A process of a distributed job, as the front-door rules name it."""

    pid: int
    comm: str
    launcher: str | None = None  # "torchrun": torch's launcher (an elastic agent)
    rank: bool = False  # a torch.distributed rank (it has MASTER_PORT)


@dataclass(frozen=True)
class DoorWhy:
    """Why a port is a front door or not: the rule, with what it saw."""

    rule: DoorRule
    holder: Holder | None = None  # PLUMBING, JOB_EPHEMERAL: the process that names or holds it
    flag: str | None = None  # PLUMBING: "MASTER_PORT", "--master-port", "--rdzv-endpoint"
    peer: tuple[str, int] | None = None  # CLIENTS: the first client from outside
    more: int = 0  # CLIENTS: how many other connections from outside
    pids: tuple[int, ...] = ()  # PEERS_INSIDE: the processes at the other ends
    ephemeral_from: int | None = None  # UNNAMED_EPHEMERAL: the range's start


@dataclass(frozen=True)
class Doors(Fact):
    """Which listeners are front doors, and why (see agent.analysis.frontdoor)."""

    front: tuple[tuple[int, DoorWhy], ...]  # (port, why)
    plumbing: tuple[tuple[int, DoorWhy], ...]


@dataclass(frozen=True)
class ListeningSince(Fact):
    port: int
    at: float  # wall-clock seconds (time.time()) of the listen


@dataclass(frozen=True)
class LastWrite(Fact):
    """The probe's most recent write, and the most recent to a file if that was not it."""

    target: str
    pid: int
    age_s: float


@dataclass(frozen=True)
class GpuIdle(Fact):
    gpus: tuple[int, ...]
    idle_s: float
    memory_each: int | None  # bytes per GPU when all hold the same; else None
    memory_total: int


@dataclass(frozen=True)
class GpuSpin(Fact):
    gpus: tuple[int, ...]
    utilization: float  # the lowest of them
    seconds: float


@dataclass(frozen=True)
class WaitsWithService(Fact):
    state: str


@dataclass(frozen=True)
class Exited(Fact):
    pid: int | None = None  # None: the process itself


@dataclass(frozen=True)
class NothingLeft(Fact):
    pass


@dataclass(frozen=True)
class EvidenceIncomplete(Fact):
    """The kernel side kept less of a process than it did: it held its share of the maps
    every process shares (agent.model.ProbeShare), so its waits, writes or events beyond it
    were not recorded; by its own doing, and no other process's evidence is touched."""

    pid: int
    entries_refused: int  # threads, written fds or refusals not kept
    events_dropped: int  # long-wait and EDEADLK events not sent


@dataclass(frozen=True)
class Culprit(Fact):
    """The process that holds the service up, and why it is taken to."""

    pid: int
    comm: str
    why: str  # "cycle" | "no waker" | "own waits" (see agent.analysis.culprit)
    # Its job labels (rank=1): never filled yet, and kept, empty, for the key of --json
    labels: tuple[tuple[str, str], ...] = ()
    threads: int = 0  # its threads in untimed futex waits
    age_s: float | None = None  # the oldest of those waits
    # The daemon that named it, where diagnose took the daemon's verdict (else the window's)
    daemon_pid: int | None = None


@dataclass(frozen=True)
class ProcessWaits(Fact):
    """What a process's threads wait in: (syscall name, timed, threads) by count."""

    waits: tuple[tuple[str, bool | None, int], ...]
    running: int
    oldest_untimed_s: float | None  # the oldest untimed futex wait, when dated
    # How long ago each dated untimed futex wait began, oldest first, less those that began
    # in the process's first seconds (pools parked since start-up): what may have begun
    # when the service stopped.
    untimed_ages_s: tuple[float, ...] = ()
    main_untimed_s: float | None = None  # of those, the main thread's (tid = pid), if one


# --- where threads wait: Python stacks (agent.analysis.stacks) -------------------------------


@dataclass(frozen=True)
class ThreadWait(Fact):
    """What a thread waits in, as threads are grouped by it: not the fd or the futex word
    (each waiter of a condition has its own)."""

    status: str  # "gone", "running", "blocked" (in no syscall that was read) or "syscall"
    syscall: str | None = None  # its name: "futex", "epoll_wait"
    syscall_kind: str | None = None  # its kind in the syscall table: "futex", "io", ...
    op: str | None = None  # a futex wait's operation: "WAIT_BITSET"
    timed: bool | None = None  # its wait ends by itself; None: not known


@dataclass(frozen=True)
class StackGroup(Fact):
    """Threads of one process parked at the same Python line with the same wait."""

    pid: int
    threads: int
    tids: tuple[int, ...]
    wait: ThreadWait
    function: str  # the function of the program's own code where they wait
    file: str  # py-spy's short name: "scheduler.py", "uvicorn/server.py"
    line: int
    callee: str | None  # what it called there ("Queue.get"); None: a call into C
    code: str | None  # the source line
    gil: int | None = None  # the TID among them that holds the GIL
    names: tuple[str, ...] = ()
    native: str | None = None  # the first native caller outside libc, where it says more
    on: FdWait | None = None  # the fds they all wait on, when they wait on the same


@dataclass(frozen=True)
class NoPythonStack(Fact):
    """Threads of a Python process with no Python frames: native helpers, I/O threads."""

    pid: int
    threads: int
    waits: tuple[tuple[ThreadWait, int], ...]  # (what they wait in, threads)


@dataclass(frozen=True)
class StacksUnread(Fact):
    pid: int
    why: str


@dataclass(frozen=True)
class LockAt(Fact):
    tid: int
    function: str
    file: str
    line: int
    code: str | None


@dataclass(frozen=True)
class PyLockHint(Fact):
    """Threads waiting, with no timeout, at lines that take locks, on two or more lock
    words: a Python lock cycle's shape, not its proof."""

    pid: int
    waits: tuple[LockAt, ...]
    words: int
    since_wall: float | None  # when the last of them last ran: all wait since (wall clock)


@dataclass(frozen=True)
class MoreStackGroups(Fact):
    groups: int
    threads: int


# --- what the daemon saw (agent.analysis.daemonview) -------------------------------------------


@dataclass(frozen=True)
class DaemonSaw(Fact):
    """What a daemon watching the same service saw that one window cannot: answers begun
    before the window and never finished, requests older than it, and its state since when."""

    daemon_pid: int
    state: str
    in_state_s: float  # how long the daemon has seen it in that state
    streams: int  # streamed answers whose last data went out before the window, unfinished
    stream_age_s: float  # since the oldest of them last sent
    unanswered: int  # requests the daemon counts unanswered, older than the window
    unanswered_age_s: float
    last_progress_s: float  # the daemon's time since the service's last progress
    judged: bool  # the verdict is the daemon's: the window alone called it idle
