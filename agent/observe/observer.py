"""One tick of observation, shared by `diagnose` and the daemon.

Each tick: find the services' processes (the Scope says which), point the probe at them,
take a snapshot, build its wait-for graph, confirm cycles against the previous tick, and
update park times. Verdicts are then computed over a window of ticks.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace

from ..analysis import evidence as ev
from ..analysis.answers import stream_in_flight
from ..analysis.classify import classify_service, rests_on_time
from ..analysis.frontdoor import FrontDoorConfig, FrontDoors, front_doors
from ..analysis.gpu import GpuHistory, gpu_active
from ..analysis.last_progress import last_progress
from ..analysis.nowaker import no_waker
from ..analysis.outbound import (
    CLIENT,
    LEAVES,
    ServiceEnds,
    closed_file,
    door_answers,
    fd_rest,
    inode_of,
    received_from_outside,
)
from ..analysis.progress import ParkSettings, ParkTracker, window_progress
from ..analysis.requests import unanswered_requests, unread_requests
from ..analysis.verdict import ProcessFacts, ServiceFacts, ServiceVerdict, incomplete
from ..analysis.waitgraph import WaitForGraph, WordGroup
from ..analysis.waits import lock_cycle, parked_group, process_waits
from ..model import (
    GpuReading,
    ProbeEvent,
    ProbeReading,
    ProcessSample,
    Snapshot,
    SocketEvent,
    thread_ids,
)
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
    no_waker: frozenset[int] = frozenset()  # processes no thread can wake (agent.analysis.nowaker)
    # pid -> inodes of its sockets whose streamed answer is unfinished (agent.analysis.answers)
    streams: Mapping[int, frozenset[int]] = field(default_factory=dict)
    # root -> its service's listeners, front doors or not (agent.analysis.frontdoor)
    doors: Mapping[int, FrontDoors] = field(default_factory=dict)


def describe_fd(target: str | None, fd: int) -> str:
    """What an fd is, in words, from its /proc/PID/fd link: a file by its path alone."""
    if target is not None and target.startswith("/") and not target.startswith("/dev/"):
        return target
    return fdwords.fd_name(target, fd)


@dataclass(frozen=True)
class Written:
    """A process's writes in a window that left the service: in all (None: no probe), to
    clients, and the file (or terminal, or pipe out) written most."""

    total: int | None
    answered: int = 0
    most_to: str | None = None
    files: tuple[str, ...] = ()  # the fd links written, not to clients
    unplaced: int = 0  # of total: to an fd that could not be named, or a port of nobody's
    destinations: int = 0  # named files, terminals and pipes out written to
    calls: int | None = None  # write calls to those (None: no probe)


class _ThreadNames(Mapping[int, str]):
    """TID -> thread name in a snapshot, built at the first question: only a lock cycle's
    reasons ask (a node's thousands of parked threads, every tick, would not)."""

    def __init__(self, snap: Snapshot) -> None:
        self._snap = snap
        self._names: dict[int, str] | None = None

    def _built(self) -> dict[int, str]:
        if self._names is None:
            procs = self._snap.processes.values()
            self._names = {t.tid: t.name for p in procs for t in p.threads}
        return self._names

    def __getitem__(self, tid: int) -> str:
        return self._built()[tid]

    def __iter__(self) -> Iterator[int]:
        return iter(self._built())

    def __len__(self) -> int:
        return len(self._built())


@dataclass(frozen=True)
class _Window:
    """The ticks a verdict compares, and what is read once per verdicts call."""

    latest: Tick
    old: Tick
    groups: list[WordGroup]  # the latest tick's waiters by word, largest first
    names: Mapping[int, str]  # tid -> thread name, in the latest snapshot


class _PipesRead:
    """Where a service's writes go (agent.analysis.outbound): the pipes its processes read
    are listed (an fd walk of each) once, and only when a write to place goes to a pipe."""

    def __init__(self, sampler: Sampler, samples: Sequence[ProcessSample]) -> None:
        self.sampler = sampler
        self.samples = samples
        self._read: frozenset[int] | None = None

    def ends(self, targets: Iterable[str | None]) -> ServiceEnds:
        """The service's ends, enough to place writes to ``targets`` (fd links)."""
        if self._read is None and any(t is not None and t.startswith("pipe:[") for t in targets):
            self._read = self.sampler.pipes_read(p.pid for p in self.samples)
        conns = (c for p in self.samples for c in p.connections)
        return ServiceEnds(conns, self._read or frozenset())


def park_settings(settings: Settings) -> ParkSettings:
    """The CPU floor work is judged by, as the progress analysis takes it."""
    return ParkSettings(settings.cpu_floor_ratio, settings.cpu_floor_min_ns)


_DEFAULTS = Settings()


class ListenHistory:
    """When each port started listening, from the probe's bind and listen events.

    Events arrive for every process, watched or not (a server may listen before discovery
    reaches it). Kept per (pid, port); pruned when the pid is gone.
    """

    def __init__(self) -> None:
        # (pid, fd) -> port asked for at bind; 0 for a bind to port 0 (the kernel chooses)
        self._bound: dict[tuple[int, int], int] = {}
        self.since: dict[tuple[int, int], int] = {}  # (pid, port) -> CLOCK_MONOTONIC of listen
        self.kernel_chosen: set[tuple[int, int]] = set()  # (pid, port) bound to port 0

    def update(
        self, events: Iterable[SocketEvent], port_now: Callable[[int, int], int | None]
    ) -> None:
        """Take the probe's events; ``port_now`` reads the port of a (pid, fd) socket now
        (Sampler.listening_port), asked only of a listen after a bind to port 0."""
        for e in events:
            if e.kind == "bind" and (e.port or e.family):
                self._bound[(e.tgid, e.fd)] = e.port
            elif e.kind == "listen":
                # A bind to port 0 lets the kernel choose: then ask /proc which port it chose.
                asked = self._bound.get((e.tgid, e.fd))
                port = asked or port_now(e.tgid, e.fd)
                if port:
                    self.since[(e.tgid, port)] = e.ts_ns
                    if asked == 0:
                        self.kernel_chosen.add((e.tgid, port))

    def pids(self) -> set[int]:
        """The processes it holds entries of (few: binders and listeners)."""
        return {k[0] for k in self._bound} | {k[0] for k in self.since}

    def prune(self, live: Collection[int]) -> None:
        """Drop entries of processes that are gone (``live``: those of pids() that are not)."""
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
                    out.append(ev.ListeningSince(port, snap.wall_of(ns)))
        return out


class Observer:
    """Ticks (snapshot, wait-for graph, stable cycles, park times) and verdicts over them.

    Settings are inputs of each call, so a reload changes them without reaching inside. The
    Observer reads nothing itself: the sampler does every read of /proc, and the analysis
    is handed what it returned."""

    def __init__(self, sampler: Sampler, probe: ProbeSource | None, scope: Scope) -> None:
        self.sampler = sampler
        self.probe = probe
        self.scope = scope
        self.tracker = ParkTracker()
        self.members: dict[int, list[int]] = {}
        self._seen: dict[int, set[int]] = {}  # root -> every pid ever in the service
        self._prev_sigs: set[frozenset] = set()
        self.ticks: deque[Tick] = deque()  # the progress window's ticks: see _trim
        self.events: deque[ProbeEvent] = deque(maxlen=1000)  # ring-buffer events, newest last
        self.sockets = ListenHistory()
        self.gpu_history = GpuHistory()
        self._fd_names: dict[tuple[int, int], str] = {}  # (pid, fd) -> link when last written
        self._fd_seen: dict[tuple[int, int], int] = {}  # (pid, fd) -> last_ns when named
        self._demand_ns: dict[int, int] = {}  # root -> when work last waited at its doors
        # (pid, start) -> fd links it wrote heartbeats to (agent.analysis.progress): not dated from.
        self._heartbeat_files: dict[tuple[int, int], set[str]] = {}
        self._doors_kept: dict[int, tuple[tuple, FrontDoors]] = {}  # root -> (inputs, doors)

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

    def observe(self, gpu: GpuReading | None = None, settings: Settings = _DEFAULTS) -> Tick:
        """One observation; ``gpu`` is this interval's NVML reading, when there is a source.
        Ticks older than the progress window (``settings.window_s``) are let go."""
        pids = self.discover()
        reading = ProbeReading()
        if self.probe is not None:
            reading = self.probe.read()
            self.events.extend(reading.events)
        self.sockets.update(reading.socket_events, self.sampler.listening_port)
        self._name_written_fds(reading)
        snap = self.sampler.snapshot(pids, reading)
        if self.probe is not None:
            self.sampler.seed(self.probe.seed)
        self._forget_stale(snap, reading)
        graph = WaitForGraph(snap)
        sigs = {graph.cycle_signature(c): c for c in graph.cycles()}
        stable = tuple(sorted(c for sig, c in sigs.items() if sig in self._prev_sigs))
        self._prev_sigs = set(sigs)
        stuck = self._no_waker(snap)
        self.tracker.update(snap, park_settings(settings))
        self._heartbeat_files = {
            k: v
            for k, v in self._heartbeat_files.items()
            if (p := snap.processes.get(k[0])) is not None and p.start_ticks == k[1]
        }
        streams = {pid: s for pid in reading.writes if (s := self._streams(pid, reading))}
        self.sockets.prune(self.sampler.alive(self.sockets.pids()))
        doors = {root: self._doors(root, snap) for root in self.members}
        self._note_demand(snap, streams, doors)
        self.gpu_history.update(gpu, self.ticks[-1].gpu if self.ticks else None, snap.mono_ns)
        tick = Tick(snap, graph, stable, reading, gpu, stuck, streams, doors)
        self.ticks.append(tick)
        self._trim(settings.window_s)
        return tick

    def _forget_stale(self, snap: Snapshot, reading: ProbeReading) -> None:
        """Tell the probe to drop its entries of threads that are gone."""
        if self.probe is None:
            return
        live: set[int] = set()
        for p in snap.processes.values():
            live.update(thread_ids(p.threads))  # kept on a quiet process's threads
        kept = {*reading.inflight, *reading.refusals, *reading.threads}
        stale = [tid for tid in kept if tid not in live] if not kept <= live else []
        if stale:
            self.probe.forget(stale)

    def _no_waker(self, snap: Snapshot) -> frozenset[int]:
        """The processes no thread of which can be woken (agent.analysis.nowaker), confirmed
        against the previous tick; /proc/PID/timers is read of those alone."""
        prev = self.ticks[-1].snapshot if self.ticks else None
        if prev is None:
            return frozenset()
        proven = [pid for pid, p in snap.processes.items() if no_waker(prev.processes.get(pid), p)]
        return frozenset(proven) - self.sampler.with_posix_timers(proven)

    def _streams(self, pid: int, reading: ProbeReading) -> frozenset[int]:
        """Inodes of the process's sockets whose last write left a streamed answer
        unfinished (agent.analysis.answers)."""
        out = set()
        for fd, w in reading.writes.get(pid, {}).items():
            name = self._fd_names.get((pid, fd))
            if name and name.startswith("socket:[") and stream_in_flight(w.tail):
                out.add(inode_of(name))
        return frozenset(out)

    def _note_demand(
        self,
        snap: Snapshot,
        streams: Mapping[int, frozenset[int]],
        doors: Mapping[int, FrontDoors],
    ) -> None:
        """Remember, per service, when work last waited at its front doors: a client that
        retries (each try times out, then connects again) leaves moments with nothing
        waiting, and a service is idle only when nothing waited in the whole window."""
        for root, members in self.members.items():
            samples = [snap.processes[p] for p in members if p in snap.processes]
            ports = doors[root].ports
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
        self._doors_kept = {r: v for r, v in self._doors_kept.items() if r in live}

    def _doors(self, root: int, snap: Snapshot) -> FrontDoors:
        """The service's listeners, front doors or not: once per tick, for the tick's demand
        and for the verdicts over it."""
        samples = [snap.processes[p] for p in self.members[root] if p in snap.processes]
        declared = self.scope.declared_doors(root)
        chosen = self.sockets.chosen_by_kernel(p.pid for p in samples)
        # What the rules read, and no more: a socket's ends never change once it is
        # connected, so its inode stands for them, and a listener's queue is not read.
        # A front-end's thousand idle connections are not walked again each tick.
        key = (
            tuple(
                (
                    p.pid,
                    p.comm,
                    p.plumbing,
                    tuple(lst.port for lst in p.listeners),
                    tuple(c.inode for c in p.connections),
                )
                for p in samples
            ),
            declared,
            snap.ephemeral_from,
            chosen,
        )
        kept = self._doors_kept.get(root)
        if kept is not None and kept[0] == key:
            return kept[1]
        doors = front_doors(samples, declared, snap.ephemeral_from, chosen)
        self._doors_kept[root] = (key, doors)
        return doors

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
        """Each service's verdict over the window: its latest tick against its first."""
        latest, old = self.ticks[-1], self.ticks[0]  # the window: see _trim
        window = _Window(
            latest,
            old,
            latest.graph.groups(),
            _ThreadNames(latest.snapshot),
        )
        return [self._verdict(root, window, settings) for root in self.members]

    def _verdict(self, root: int, w: _Window, settings: Settings) -> ServiceVerdict:
        """One service: its processes' facts, the evidence of the service, the classifier;
        and, for a verdict that rests on its time without progress, the same again with its
        last progress dated (an fd walk of its processes: never for a working or idle one)."""
        snap = w.latest.snapshot
        samples = [snap.processes[p] for p in self.members[root] if p in snap.processes]
        doors = w.latest.doors[root]
        pipes = _PipesRead(self.sampler, samples)
        ends = pipes.ends(
            self._fd_names.get((p.pid, fd))
            for p in samples
            for fd in w.latest.reading.writes.get(p.pid, {})
        )
        park = park_settings(settings)
        facts = [self._facts(s, w, ends, doors, park) for s in samples]
        live = {f.sample.pid for f in facts}
        gone = sorted(self._seen.get(root, set()) - live)  # empty unless remember_gone
        cycles = sorted({c for f in facts for c in f.cycles})
        demand_ns = self._demand_ns.get(root)
        evidence = ServiceFacts(
            cycles=[lock_cycle(c, w.latest.graph.edges, w.names) for c in cycles],
            parked=self._parked_evidence(live, w.latest, w.groups, doors),
            demand_age_s=(
                (snap.mono_ns - demand_ns) / 1e9
                if demand_ns is not None and demand_ns >= w.old.snapshot.mono_ns
                else None
            ),
        )

        def classify(evidence: ServiceFacts) -> ServiceVerdict:
            return classify_service(
                root,
                facts,
                settings.park_threshold_s,
                gone=gone,
                root_gone=root not in live,
                evidence=evidence,
            )

        v = classify(evidence)
        if rests_on_time(v):
            v = classify(replace(evidence, last_progress=self._date(samples, pipes, doors, w)))
        return v

    def _facts(
        self,
        sample: ProcessSample,
        w: _Window,
        ends: ServiceEnds,
        doors: FrontDoors,
        park: ParkSettings,
    ) -> ProcessFacts:
        """What the classifier needs of one process over the window; heartbeat files noted."""
        latest, old_tick = w.latest, w.old
        snap, pid = latest.snapshot, sample.pid
        accepts = None
        if pid in latest.reading.accepts:  # counted by the probe since watched
            accepts = latest.reading.accepts[pid] - old_tick.reading.accepts.get(pid, 0)
        gpu = self.gpu_history.facts(pid, latest.gpu, old_tick.gpu, snap.mono_ns)
        old_sample = old_tick.snapshot.processes.get(pid)
        written = self._written_out(pid, latest.reading, old_tick.reading, ends, doors)
        progress = window_progress(
            old_sample,
            sample,
            snap.mono_ns - old_tick.snapshot.mono_ns,
            park,
            accepts=accepts,
            gpu=gpu_active(gpu) if gpu is not None and gpu.active else None,
            written_out=written.total,
            received=received_from_outside(old_sample, sample, ends, doors.ports),
            answered=written.answered,
            written_to=written.most_to,
            file_read=_file_read(pid, latest.reading, old_tick.reading),
            unplaced=written.unplaced,
            logged_to=written.destinations,
            logged_calls=written.calls,
            empty_polls=_empty_polls(sample, latest.reading, old_tick.reading),
        )
        if progress.heartbeat:
            # Its mtimes tell of the heartbeat, not of work: never date from them.
            key = (pid, sample.start_ticks)
            self._heartbeat_files.setdefault(key, set()).update(written.files)
        return ProcessFacts(
            sample=sample,
            progress=progress,
            parked_threads=self.tracker.parked_threads(pid),
            parked_seconds=self.tracker.parked_seconds(pid, snap.mono_ns),
            cycles=[c for c in latest.cycles if not set(thread_ids(sample.threads)).isdisjoint(c)],
            gpu=gpu,
            front_door_ports=doors.ports,
            waits=process_waits(sample, snap.mono_ns),
            no_waker=pid in latest.no_waker,
            streams=latest.streams.get(pid, frozenset()),
            incomplete=incomplete(pid, latest.reading.shares.get(pid)),
        )

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

    def _date(
        self,
        samples: Sequence[ProcessSample],
        pipes: _PipesRead,
        doors: FrontDoors,
        w: _Window,
    ) -> ev.LastProgress | None:
        """The service's last progress before the window (agent.analysis.last_progress), from
        the fds its processes hold open for writing, read now."""
        snap = w.latest.snapshot
        beats = set().union(
            *(self._heartbeat_files.get((p.pid, p.start_ticks), ()) for p in samples)
        )
        written = self.sampler.written_files(p.pid for p in samples)
        ends = pipes.ends(
            f.target for fds in written.values() for f in fds if f.target not in beats
        )
        return last_progress(
            samples,
            written,
            ends,
            doors.ports,
            snap.mono_ns,
            snap.wall,
            w.old.snapshot.mono_ns,
            beats,
        )

    def _written_out(
        self,
        pid: int,
        latest: ProbeReading,
        old: ProbeReading,
        ends: ServiceEnds,
        doors: FrontDoors,
    ) -> Written:
        """What the process wrote in the window that left the service (agent.analysis.outbound),
        by the probe's count per fd and, for connections it accepted, per local port: an
        answer at a front door counts as one whatever became of its connection, one at an
        internal door stays inside (total None without a probe)."""
        if self.probe is None:
            return Written(None)
        before = old.writes.get(pid, {})
        calls = 0
        files: dict[str, int] = {}
        links: list[str] = []
        answered, unplaced = door_answers(
            latest.door_writes.get(pid, {}),
            old.door_writes.get(pid, {}),
            doors.ports,
            {d.port for d in doors.doors},
        )
        total = answered + unplaced
        for fd, w in latest.writes.get(pid, {}).items():
            prev = before.get(fd)
            delta = fd_rest(w, prev)
            name = self._fd_names.get((pid, fd))
            where = ends.destination(name)
            if delta <= 0 or where not in LEAVES:
                continue
            total += delta
            closed = closed_file(w, prev, delta) if name is None else None
            if where == CLIENT:
                answered += delta
            elif name is None and closed is None:
                unplaced += delta
            else:
                key = closed or describe_fd(name, fd)
                files[key] = files.get(key, 0) + delta
                if name is not None:
                    links.append(name)
                calls += w.calls - (prev.calls if prev is not None else 0)
        most = max(files, key=lambda k: files[k]) if files else None
        return Written(total, answered, most, tuple(links), unplaced, len(files), calls)

    def _name_written_fds(self, reading: ProbeReading) -> None:
        """Name each fd when it is written (a log closed later is still named), and only
        then: a readlink per fd that changed, not per fd per tick."""
        changed = {
            (pid, fd): w.last_ns
            for pid, fds in reading.writes.items()
            for fd, w in fds.items()
            if (pid, fd) not in self._fd_names or self._fd_seen.get((pid, fd)) != w.last_ns
        }
        read = self.sampler.fd_targets(changed)
        self._fd_seen.update(changed)
        names = {}
        for pid, fds in reading.writes.items():
            for fd in fds:
                name = read.get((pid, fd)) or self._fd_names.get((pid, fd))
                if name is not None:
                    names[(pid, fd)] = name
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


def _file_read(pid: int, latest: ProbeReading, old: ProbeReading) -> int:
    """Bytes the probe saw the process read from regular files in the window (0 without
    the count: no probe, or a kernel where it cannot tell a regular file)."""
    now = (latest.file_reads or {}).get(pid)
    if now is None:
        return 0
    return max(0, now - (old.file_reads or {}).get(pid, 0))


def _empty_polls(
    sample: ProcessSample, latest: ProbeReading, old: ProbeReading
) -> dict[int, int] | None:
    """Per thread of the process, its polls that found nothing in the window (None without
    the count). A thread without an entry at the window's start made it in the window; a
    count below the last one is a new entry (the TID's thread gone and the TID reused), so
    all of it is new. A wrap of the u32 (weeks at thousands a second) reads as that too."""
    now, before = latest.empty_polls, old.empty_polls or {}
    if now is None:
        return None
    out = {}
    for t in sample.threads:
        n = now.get(t.tid)
        if n:
            last = before.get(t.tid, 0)
            out[t.tid] = n - last if n >= last else n
    return out
