"""What the daemon knows that one window does not: since when each service is in its state,
its recent changes, and the evidence the observer carries across ticks (when work last waited,
answers begun and not finished). Pure: the loop hands it verdicts and times, and takes back
immutable records, which `hangwatch status` and `diagnose` read from another thread.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from . import evidence as ev
from .outbound import inode_of
from .verdict import ServiceVerdict
from .window import Window

# Changes kept per service: enough to see a flap or the road to a hang, bounded whatever
# a service does (a flapping one costs the same as a quiet one).
MAX_CHANGES = 20

Key = tuple[str, int]  # (service name, root pid)


@dataclass(frozen=True)
class StateChange:
    wall: float  # time.time() of the tick that saw it
    old: str | None  # None: the service was new
    new: str
    reasons: tuple[ev.Fact, ...]


@dataclass(frozen=True)
class ServiceHistory:
    """One service's state, since when the daemon has seen it in it, and its last changes
    (oldest first, at most MAX_CHANGES)."""

    name: str
    root: int
    state: str
    since_wall: float
    changes: tuple[StateChange, ...]


class StateHistory:
    """Each service's state and changes, updated by the loop once per tick. ``view()`` is an
    immutable copy of references: a reader in another thread never sees one half-updated."""

    def __init__(self, limit: int = MAX_CHANGES) -> None:
        self.limit = limit
        self._services: dict[Key, ServiceHistory] = {}

    def update(self, verdicts: Iterable[tuple[Key, ServiceVerdict]], wall: float) -> None:
        """The tick's verdicts, by (name, root). A service absent from them is forgotten: a
        root that comes back later starts a new history, as it logs "new"."""
        now: dict[Key, ServiceHistory] = {}
        for key, v in verdicts:
            old = self._services.get(key)
            if old is not None and old.state == v.state:
                now[key] = old
                continue
            change = StateChange(wall, old.state if old else None, v.state, tuple(v.reasons))
            kept = (*old.changes, change)[-self.limit :] if old else (change,)
            now[key] = ServiceHistory(key[0], key[1], v.state, wall, kept)
        self._services = now

    def view(self) -> Mapping[Key, ServiceHistory]:
        return dict(self._services)


@dataclass(frozen=True)
class OpenStream:
    """A streamed answer begun and not finished on one of the service's connections."""

    pid: int
    inode: int
    last_sent_s: float  # since its last data went out


@dataclass(frozen=True)
class Carried:
    """The evidence the observer carries across ticks for one service, as of its last tick:
    what a window opened now would not see."""

    last_demand_s: float | None  # since work last waited at its front doors (None: never seen)
    streams: tuple[OpenStream, ...]  # answers begun and not finished (any age)
    unanswered_requests: int
    oldest_unanswered_s: float
    seconds_since_progress: float
    parked_s: float  # the longest time every thread of one of its processes has been parked
    last_progress: ev.LastProgress | None  # the dated progress its verdict rests on, if any


def carried(window: Window, v: ServiceVerdict) -> Carried:
    """What ``window`` carries for the service rooted at ``v.pid``."""
    latest = window.latest
    now = latest.snapshot.mono_ns
    demand = window.demand_ns.get(v.pid)
    streams: list[OpenStream] = []
    members: Sequence[int] = window.members.get(v.pid, ())
    for pid in members:
        open_inodes = latest.streams.get(pid, frozenset())
        if not open_inodes:
            continue
        for fd, w in latest.reading.writes.get(pid, {}).items():
            name = window.fd_names.get((pid, fd), "")
            if name.startswith("socket:[") and inode_of(name) in open_inodes:
                age = max(0.0, (now - w.last_ns) / 1e9)
                streams.append(OpenStream(pid, inode_of(name), age))
    last = next((f for f in v.reasons if isinstance(f, ev.LastProgress)), None)
    return Carried(
        last_demand_s=(now - demand) / 1e9 if demand is not None else None,
        streams=tuple(sorted(streams, key=lambda s: -s.last_sent_s)),
        unanswered_requests=v.unanswered_requests,
        oldest_unanswered_s=v.oldest_request_s,
        seconds_since_progress=v.seconds_since_progress,
        parked_s=max((p.parked_seconds for p in v.processes if not p.gone), default=0.0),
        last_progress=last,
    )
