"""The daemon's book of where each parked process waits: the ``site`` of
``hangwatch_process_waiting_at`` (agent.analysis.sites says how a site is told).

A site is read once per park, not per tick: while every thread of a process stays parked,
none of them ran code, so where it waits cannot have moved. A park is known by when its
threads last worked (agent.analysis.progress); a thread that works ends it, and the next park
is read anew. The read (py-spy --nonblocking, or a scan of the main thread's native stack)
waits until the park has lasted half the park threshold, so that a server parked between
requests is not read each time it pauses, and the site is there before the threshold turns
the process stalled. Reads run on a thread of their own (agent.worker), a few at a time: the
tick never waits for them, and a read that finds the queue full is asked again next tick.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ..analysis.sites import native_site, process_site
from ..sources.confined import Target
from ..sources.procfs import ProcFS
from ..sources.pystacks import READ_TIMEOUT_S, read_stacks
from ..sources.symbols import short_name
from ..worker import BoundedWorker
from .enrich import native_frame

MAX_PENDING_READS = 4
# Two reads of one park differ by the rounding of parked_seconds, far under a tick.
SAME_PARK_NS = 5_000_000


@dataclass(frozen=True)
class Park:
    """One park of one process: every thread parked since ``since_ns`` (monotonic)."""

    pid: int
    start_ticks: int  # tells a reused PID apart
    since_ns: int

    def same(self, other: Park) -> bool:
        return (
            self.pid == other.pid
            and self.start_ticks == other.start_ticks
            and abs(self.since_ns - other.since_ns) <= SAME_PARK_NS
        )


def read_site(proc: ProcFS, park: Park) -> str | None:
    """Where the process of ``park`` waits now: its Python stacks' site, else its main
    thread's first native caller outside libc and the interpreter. None when neither tells,
    or when the PID is no longer the process the tick saw (reused, or it exec'd meanwhile)."""
    pid = park.pid
    read = read_stacks(pid, proc, timeout_s=READ_TIMEOUT_S, start=park.start_ticks)
    site = process_site(read, pid)
    if site is not None:
        return site
    target = Target.take(pid, proc.root, park.start_ticks)
    if isinstance(target, str):
        return None
    with target:  # a frame read from another process is nobody's site
        frame = native_frame(proc, pid, pid)
        if frame is None or target.changed() is not None:
            return None
    return native_site(short_name(frame.symbol) if frame.symbol else None, frame.object)


class SiteBook:
    """Sites by process, each for the park it was read in. ``update`` each tick with the
    parks now and which of them are due a read; ``site(park)`` then says what was read."""

    def __init__(
        self, read: Callable[[Park], str | None], max_pending: int = MAX_PENDING_READS
    ) -> None:
        self._read = read
        self._lock = threading.Lock()  # the reader's thread writes, the loop reads
        self._sites: dict[int, tuple[Park, str | None]] = {}
        self._asked: dict[int, Park] = {}
        self.reads = 0  # sites read (tests and the benchmark count them)
        self._reader: BoundedWorker[Park] = BoundedWorker(
            self._record, self._skipped, max_pending, name="hangwatch-sites", what="site read"
        )

    def update(self, parks: Iterable[Park], due: Callable[[Park], bool]) -> None:
        """Forget what no longer holds (the process works, or is gone), and ask a read for
        each park that is due one and has none, read or asked."""
        now = {p.pid: p for p in parks}
        with self._lock:
            self._sites = {pid: v for pid, v in self._sites.items() if _holds(v[0], now.get(pid))}
            self._asked = {pid: p for pid, p in self._asked.items() if _holds(p, now.get(pid))}
            wanted = [
                p
                for p in now.values()
                if p.pid not in self._sites and p.pid not in self._asked and due(p)
            ]
            for p in wanted:
                self._asked[p.pid] = p
        for p in wanted:
            self._reader.submit(p)

    def site(self, park: Park) -> str | None:
        with self._lock:
            known = self._sites.get(park.pid)
        return known[1] if known is not None and known[0].same(park) else None

    def start(self) -> None:
        """Start the reading thread (at start-up: agent.worker says why)."""
        self._reader.start()

    def flush(self, timeout: float) -> bool:
        return self._reader.flush(timeout)

    def close(self, timeout: float) -> None:
        self._reader.close(timeout)

    def _record(self, park: Park) -> None:
        site = None  # a read that raises counts as one that told nothing: not retried
        try:
            site = self._read(park)
        finally:
            with self._lock:
                self.reads += 1
                asked = self._asked.pop(park.pid, None)
                if asked is not None and asked.same(park):  # still the park it was asked for
                    self._sites[park.pid] = (park, site)

    def _skipped(self, park: Park) -> None:
        with self._lock:  # the reader is full: asked again next tick
            self._asked.pop(park.pid, None)


def _holds(park: Park, now: Park | None) -> bool:
    return now is not None and park.same(now)
