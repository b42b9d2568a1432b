"""One tick of observation, shared by `diagnose` and the daemon.

Each tick: find the services' processes (the Scope says which), point the probe at them,
take a snapshot, build its wait-for graph, confirm cycles against the previous tick, and
update park times. Verdicts are then computed over a window of ticks.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from ..analysis import evidence as ev
from ..analysis.answers import stream_in_flight
from ..analysis.classify import (
    Evidence,
    ProcessFacts,
    ServiceVerdict,
    classify_service,
    lock_cycle,
    parked_group,
    process_waits,
    unanswered_requests,
    unread_requests,
)
from ..analysis.frontdoor import FrontDoorConfig, FrontDoors, front_doors
from ..analysis.gpu import GpuHistory, gpu_active
from ..analysis.last_progress import last_progress
from ..analysis.nowaker import hopeless
from ..analysis.outbound import CLIENT, LEAVES, ServiceEnds, inode_of, received_from_outside
from ..analysis.progress import ParkSettings, ParkTracker, window_progress
from ..analysis.waitgraph import WaitForGraph, WordGroup
from ..model import GpuReading, ProbeEvent, ProbeReading, ProcessSample, Snapshot, SocketEvent
from ..settings import Settings
from ..sources.procfs import ProcFS
from ..sources.protocols import ProbeSource
from . import fdwaits as fdwords
from .discovery import descendants
from .sampler import Sampler


@dataclass(frozen=True)
class Scope:
    """Which services an observation watches: the difference between `diagnose` and `run`,
    as data. ``members`` is asked once per tick for root -> the service's PIDs (root first);
    ``remember_gone`` keeps processes that exited in the verdicts, marked gone (diagnose
    reports on what it was asked about; the daemon drops them)."""

    members: Callable[[], Mapping[int, Sequence[int]]]
    remember_gone: bool
    # The front doors a service's target declares (root -> config; None: decide from what
    # connects to its listeners).
    declared_doors: Callable[[int], FrontDoorConfig | None] = lambda _root: None

    @classmethod
    def of_roots(cls, proc: ProcFS, roots: Iterable[int]) -> Scope:
        """Fixed roots and, each tick, their descendants as /proc shows them."""
        fixed = list(dict.fromkeys(roots))
        return cls(lambda: descendants(proc, fixed), remember_gone=True)


@dataclass(frozen=True)
class Tick:
    snapshot: Snapshot
    graph: WaitForGraph
    cycles: tuple[tuple[int, ...], ...]  # stable: seen with the same edges in the previous tick
    reading: ProbeReading
    gpu: GpuReading | None = None  # None: no GPU source
    hopeless: frozenset[int] = frozenset()  # processes no thread can wake (agent.analysis.nowaker)
    # pid -> inodes of its sockets whose streamed answer is unfinished (agent.analysis.answers)
    streams: Mapping[int, frozenset[int]] = field(default_factory=dict)


def describe_fd(target: str | None, fd: int) -> str:
    """What an fd is, in words, from its /proc/PID/fd link: a file by its path alone."""
    if target is not None and target.startswith("/") and not target.startswith("/dev/"):
        return target
    return fdwords.describe_fd(target, fd)


@dataclass(frozen=True)
class Written:
    """A process's writes in a window that left the service: in all (None: no probe), to
    clients, and the file (or terminal, or pipe out) written most."""

    total: int | None
    answered: int = 0
    most_to: str | None = None
    files: tuple[str, ...] = ()  # the fd links written, not to clients


class ListenHistory:
    """When each port started listening, from the probe's bind and listen events.

    Events arrive for every process, watched or not (a server may listen before discovery
    reaches it). Kept per (pid, port); pruned when the pid is gone.
    """

    def __init__(self, proc: ProcFS) -> None:
        self.proc = proc
        # (pid, fd) -> port asked for at bind; 0 for a bind to port 0 (the kernel chooses)
        self._bound: dict[tuple[int, int], int] = {}
        self.since: dict[tuple[int, int], int] = {}  # (pid, port) -> CLOCK_MONOTONIC of listen
        self.kernel_chosen: set[tuple[int, int]] = set()  # (pid, port) bound to port 0

    def update(self, events: Iterable[SocketEvent]) -> None:
        for e in events:
            if e.kind == "bind" and (e.port or e.family):
                self._bound[(e.tgid, e.fd)] = e.port
            elif e.kind == "listen":
                # A bind to port 0 lets the kernel choose: then ask /proc which port it chose.
                asked = self._bound.get((e.tgid, e.fd))
                port = asked or self._port_now(e.tgid, e.fd)
                if port:
                    self.since[(e.tgid, port)] = e.ts_ns
                    if asked == 0:
                        self.kernel_chosen.add((e.tgid, port))

    def _port_now(self, pid: int, fd: int) -> int | None:
        target = self.proc.fd_target(pid, fd)
        if not target or not target.startswith("socket:["):
            return None
        inode = int(target[8:-1])
        return next((s.port for s in self.proc.tcp_sockets(pid) if s.inode == inode), None)

    def prune(self) -> None:
        """Drop entries of processes that are gone: a stat per pid held (few: binders and
        listeners), not a listing of all of /proc per tick."""
        held = {k[0] for k in self._bound} | {k[0] for k in self.since}
        live = {pid for pid in held if self.proc.stat(pid) is not None}
        self._bound = {k: v for k, v in self._bound.items() if k[0] in live}
        self.since = {k: v for k, v in self.since.items() if k[0] in live}
        self.kernel_chosen = {k for k in self.kernel_chosen if k[0] in live}

    def chosen_by_kernel(self, pids: Iterable[int]) -> frozenset[int]:
        """The ports of ``pids`` that the probe saw bound to port 0."""
        mine = set(pids)
        return frozenset(port for pid, port in self.kernel_chosen if pid in mine)

    def describe(self, pids: set[int], snap: Snapshot) -> list[ev.ListeningSince]:
        out = []
        for pid in sorted(pids):
            p = snap.processes.get(pid)
            for port in sorted({lst.port for lst in p.listeners} if p else ()):
                ns = self.since.get((pid, port))
                if ns is not None:
                    at = time.strftime("%H:%M:%S", time.localtime(snap.wall_of(ns)))
                    out.append(ev.ListeningSince(port, at))
        return out


class Observer:
    """Ticks (snapshot, wait-for graph, stable cycles, park times) and verdicts over them.

    Settings are inputs of each call, so a reload changes them without reaching inside."""

    def __init__(
        self,
        sampler: Sampler,
        probe: ProbeSource | None,
        scope: Scope,
        park: ParkSettings | None = None,
    ) -> None:
        self.sampler = sampler
        self.probe = probe
        self.scope = scope
        self.park = park or ParkSettings()
        self.tracker = ParkTracker(self.park)
        self.members: dict[int, list[int]] = {}
        self._seen: dict[int, set[int]] = {}  # root -> every pid ever in the service
        self._prev_sigs: set[frozenset] = set()
        self.ticks: deque[Tick] = deque()  # the progress window's ticks: see _trim
        self.events: deque[ProbeEvent] = deque(maxlen=1000)  # ring-buffer events, newest last
        self.sockets = ListenHistory(self.sampler.proc)
        self.gpu_history = GpuHistory()
        self._fd_names: dict[tuple[int, int], str] = {}  # (pid, fd) -> link when last written
        self._fd_seen: dict[tuple[int, int], int] = {}  # (pid, fd) -> last_ns when named
        self._demand_ns: dict[int, int] = {}  # root -> when work last waited at its doors
        # (pid, start) -> fd links it wrote heartbeats to (agent.analysis.progress): not dated from.
        self._heartbeat_files: dict[tuple[int, int], set[str]] = {}

    def discover(self) -> list[int]:
        """Find the services' processes now and point the probe at them."""
        self.members = {root: list(pids) for root, pids in self.scope.members().items()}
        if self.scope.remember_gone:
            for root, pids in self.members.items():
                self._seen.setdefault(root, set()).update(pids)
        pids = sorted({p for ps in self.members.values() for p in ps})
        if self.probe is not None:
            self.probe.watch(pids)
        return pids

    def tick(self, gpu: GpuReading | None = None, window_s: float | None = None) -> Tick:
        """One observation; ``gpu`` is this interval's NVML reading, when there is a source.
        Ticks older than the progress window ``window_s`` are let go."""
        pids = self.discover()
        reading = ProbeReading()
        if self.probe is not None:
            reading = self.probe.read()
            self.events.extend(reading.events)
        self.sockets.update(reading.socket_events)
        self._name_written_fds(reading)
        snap = self.sampler.snapshot(pids, reading)
        live = {t.tid for p in snap.processes.values() for t in p.threads}
        if self.probe is not None:
            kept = {*reading.inflight, *reading.refusals, *reading.threads}
            stale = [tid for tid in kept if tid not in live]
            if stale:
                self.probe.forget(stale)
        graph = WaitForGraph(snap)
        sigs = {graph.cycle_signature(c): c for c in graph.cycles()}
        stable = tuple(sorted(c for sig, c in sigs.items() if sig in self._prev_sigs))
        self._prev_sigs = set(sigs)
        prev = self.ticks[-1].snapshot if self.ticks else None
        stuck = frozenset(
            pid
            for pid, p in snap.processes.items()
            if prev is not None
            and hopeless(prev.processes.get(pid), p)
            and not self.sampler.proc.has_posix_timers(pid)
        )
        self.tracker.update(snap)
        self._heartbeat_files = {
            k: v
            for k, v in self._heartbeat_files.items()
            if (p := snap.processes.get(k[0])) is not None and p.start_ticks == k[1]
        }
        streams = {pid: s for pid in reading.writes if (s := self._streams(pid, reading))}
        self._note_demand(snap, streams)
        self.sockets.prune()
        self.gpu_history.update(gpu, self.ticks[-1].gpu if self.ticks else None, snap.mono_ns)
        tick = Tick(snap, graph, stable, reading, gpu, stuck, streams)
        self.ticks.append(tick)
        self._trim(window_s)
        return tick

    def _streams(self, pid: int, reading: ProbeReading) -> frozenset[int]:
        """Inodes of the process's sockets whose last write left a streamed answer
        unfinished (agent.analysis.answers)."""
        out = set()
        for fd, w in reading.writes.get(pid, {}).items():
            name = self._fd_names.get((pid, fd))
            if name and name.startswith("socket:[") and stream_in_flight(w.tail):
                out.add(inode_of(name))
        return frozenset(out)

    def _note_demand(self, snap: Snapshot, streams: Mapping[int, frozenset[int]]) -> None:
        """Remember, per service, when work last waited at its front doors: a client that
        retries (each try times out, then connects again) leaves moments with nothing
        waiting, and a service is idle only when nothing waited in the whole window."""
        for root, members in self.members.items():
            samples = [snap.processes[p] for p in members if p in snap.processes]
            doors = self._doors(root, samples, snap)
            ports = doors.ports
            waiting = sum(
                lst.queued for p in samples for lst in p.listeners if lst.port in ports
            ) + sum(
                len(unanswered_requests(p, ports, streams.get(p.pid, frozenset())))
                + unread_requests(p, ports)
                for p in samples
            )
            if waiting:
                self._demand_ns[root] = snap.mono_ns
        live = set(self.members)
        self._demand_ns = {r: ns for r, ns in self._demand_ns.items() if r in live}

    def _doors(self, root: int, samples: Sequence[ProcessSample], snap: Snapshot) -> FrontDoors:
        return front_doors(
            samples,
            self.scope.declared_doors(root),
            snap.ephemeral_from,
            self.sockets.chosen_by_kernel(p.pid for p in samples),
        )

    def _trim(self, window_s: float | None) -> None:
        """Keep what a verdict reads: the window's ticks (the daemon), or the first and the
        latest (diagnose's window is the whole observation). Memory stays bounded either way."""
        ticks = self.ticks
        if window_s is None:
            while len(ticks) > 2:
                del ticks[1]
            return
        limit = ticks[-1].snapshot.mono_ns - int(window_s * 1e9)
        while len(ticks) > 1 and ticks[0].snapshot.mono_ns < limit:
            ticks.popleft()

    def verdicts(self, settings: Settings) -> list[ServiceVerdict]:
        latest, old_tick = self.ticks[-1], self.ticks[0]  # the window: see _trim
        old = old_tick.snapshot
        snap = latest.snapshot
        groups = latest.graph.groups()
        window_ns = snap.mono_ns - old.mono_ns
        names = {t.tid: t.name for p in snap.processes.values() for t in p.threads}
        out = []
        for root, members in self.members.items():
            samples = [snap.processes[p] for p in members if p in snap.processes]
            doors = self._doors(root, samples, snap)
            ends = ServiceEnds(
                (c for p in samples for c in p.connections), self._pipes_read_by(samples)
            )
            facts = []
            for pid in members:
                sample = snap.processes.get(pid)
                if sample is None:
                    continue
                tids = {t.tid for t in sample.threads}
                parks = self.tracker.parks.get(pid, {})
                accepts = None
                if pid in latest.reading.accepts:  # counted by the probe since watched
                    accepts = latest.reading.accepts[pid] - old_tick.reading.accepts.get(pid, 0)
                gpu = self.gpu_history.facts(pid, latest.gpu, old_tick.gpu, snap.mono_ns)
                old_sample = old.processes.get(pid)
                written = self._written_out(pid, latest.reading, old_tick.reading, ends)
                progress = window_progress(
                    old_sample,
                    sample,
                    window_ns,
                    self.park,
                    accepts=accepts,
                    gpu=gpu_active(gpu) if gpu is not None and gpu.active else None,
                    written_out=written.total,
                    received=received_from_outside(old_sample, sample, ends, doors.ports),
                    answered=written.answered,
                    written_to=written.most_to,
                )
                if progress.heartbeat:
                    # Its mtimes tell of the heartbeat, not of work: never date from them.
                    key = (pid, sample.start_ticks)
                    self._heartbeat_files.setdefault(key, set()).update(written.files)
                facts.append(
                    ProcessFacts(
                        sample=sample,
                        progress=progress,
                        parked_threads=sum(1 for x in parks.values() if x.parked),
                        parked_seconds=self.tracker.parked_seconds(pid, snap.mono_ns),
                        cycles=[c for c in latest.cycles if tids.intersection(c)],
                        gpu=gpu,
                        front_door_ports=doors.ports,
                        waits=process_waits(sample, snap.mono_ns),
                        hopeless=pid in latest.hopeless,
                        streams=latest.streams.get(pid, frozenset()),
                    )
                )
            live = {f.sample.pid for f in facts}
            gone = sorted(self._seen.get(root, set()) - live)  # empty unless remember_gone
            cycles = sorted({c for f in facts for c in f.cycles})
            quiet = not any(f.progress.did_work for f in facts)
            demand_ns = self._demand_ns.get(root)
            evidence = Evidence(
                cycles=[lock_cycle(c, latest.graph.edges, names) for c in cycles],
                parked=self._parked_evidence(live, latest, groups, doors),
                # Dated only for a service that did nothing in the window: the fds of its
                # processes are walked then, not every tick for every service.
                last_progress=(
                    self._dater(samples, ends, doors.ports, snap, old.mono_ns)
                    if quiet and facts and not cycles
                    else None
                ),
                demand_age_s=(
                    (snap.mono_ns - demand_ns) / 1e9
                    if demand_ns is not None and demand_ns >= old.mono_ns
                    else None
                ),
            )
            out.append(
                classify_service(
                    root,
                    facts,
                    settings.park_threshold_s,
                    gone=gone,
                    root_gone=root not in live,
                    evidence=evidence,
                )
            )
        return out

    def _parked_evidence(
        self, pids: set[int], tick: Tick, groups: list[WordGroup], doors: FrontDoors
    ) -> list[ev.Fact]:
        """What a parked service waits on: its largest parked groups, which of its listeners
        are front doors, since when its ports listen, and its last writes."""
        now = tick.snapshot.mono_ns
        mine = [g for g in groups if pids.intersection(g.pids)]
        out: list[ev.Fact] = [parked_group(g, now) for g in mine[:3]]
        if doors.doors:
            out.append(doors.evidence())
        out.extend(self.sockets.describe(pids, tick.snapshot))
        out.extend(self._last_writes(pids, tick.reading, now))
        return out

    def _dater(
        self,
        samples: Sequence[ProcessSample],
        ends: ServiceEnds,
        front_ports: frozenset[int],
        snap: Snapshot,
        window_start_ns: int,
    ) -> Callable[[], ev.LastProgress | None]:
        """Dates the service's last progress (agent.analysis.last_progress) when the classifier asks: only
        for a quiet service that is not idle, so an idle server costs no fd walk a tick."""
        beats = set().union(
            *(self._heartbeat_files.get((p.pid, p.start_ticks), ()) for p in samples)
        )
        return lambda: last_progress(
            self.sampler.proc,
            samples,
            ends,
            front_ports,
            snap.mono_ns,
            snap.wall,
            window_start_ns,
            beats,
        )

    def _pipes_read_by(self, samples: Sequence[ProcessSample]) -> Callable[[int], bool]:
        """Whether a pipe's reading end is held in the service: the fds of its processes are
        listed only if a pipe was written in the window, and then once."""
        held: set[int] | None = None

        def read_inside(inode: int) -> bool:
            nonlocal held
            if held is None:
                held = set().union(*(self.sampler.proc.pipes_read(p.pid) for p in samples))
            return inode in held

        return read_inside

    def _written_out(
        self, pid: int, latest: ProbeReading, old: ProbeReading, ends: ServiceEnds
    ) -> Written:
        """What the process wrote in the window that left the service (agent.analysis.outbound), by the
        probe's count per fd (total None without a probe)."""
        if self.probe is None:
            return Written(None)
        before = old.writes.get(pid, {})
        total = answered = 0
        files: dict[str, int] = {}
        links: list[str] = []
        for fd, w in latest.writes.get(pid, {}).items():
            prev = before.get(fd)
            delta = w.bytes - (prev.bytes if prev is not None else 0)
            name = self._fd_names.get((pid, fd))
            where = ends.destination(name)
            if delta <= 0 or where not in LEAVES:
                continue
            total += delta
            if where == CLIENT:
                answered += delta
            else:
                key = describe_fd(name, fd)
                files[key] = files.get(key, 0) + delta
                if name is not None:
                    links.append(name)
        most = max(files, key=lambda k: files[k]) if files else None
        return Written(total, answered, most, tuple(links))

    def _name_written_fds(self, reading: ProbeReading) -> None:
        """Name each fd when it is written (a log closed later is still named), and only
        then: a readlink per fd that changed, not per fd per tick."""
        names = {}
        for pid, fds in reading.writes.items():
            for fd, w in fds.items():
                key = (pid, fd)
                old = self._fd_names.get(key)
                if old is None or self._fd_seen.get(key) != w.last_ns:
                    old = self.sampler.proc.fd_target(pid, fd) or old
                    self._fd_seen[key] = w.last_ns
                if old is not None:
                    names[key] = old
        self._fd_names = names  # bounded by the fds the probe still reports
        self._fd_seen = {k: v for k, v in self._fd_seen.items() if k in names}

    def _last_writes(self, pids: set[int], reading: ProbeReading, now: int) -> list[ev.Fact]:
        """The most recent write, and the most recent to a file (a log) if that was not it."""
        writes = sorted(
            ((w.last_ns, pid, w.fd) for pid in pids for w in reading.writes.get(pid, {}).values()),
            reverse=True,
        )
        out: list[ev.Fact] = []
        for i, (ns, pid, fd) in enumerate(writes):
            target = self._fd_names.get((pid, fd))
            is_file = (
                target is not None and target.startswith("/") and not target.startswith("/dev/")
            )
            if i == 0 or is_file:
                what = describe_fd(target, fd)
                out.append(ev.LastWrite(what, pid, (now - ns) / 1e9))
            if is_file:
                break
        return out
