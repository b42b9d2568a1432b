"""The verdict's types: the four states, what the classifier is given (ProcessFacts,
ServiceFacts) and what it returns (ProcessVerdict, ServiceVerdict). Apart from the ladder
(agent.analysis.classify) so that the culprit and the reports import them without it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..model import ProbeShare, ProcessSample
from . import evidence as ev
from .gpu import ProcessGpu
from .progress import ProcessProgress

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
