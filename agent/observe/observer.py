"""Observation, shared by `diagnose` and the daemon: ticks, and the reads verdicts need.

Each tick: find the services' processes (the Scope says which), point the probe at them,
take a snapshot, build its wait-for graph, confirm cycles against the previous tick, and
update park times. Verdicts are judged over a window of ticks by agent.analysis.judge, a
pure function; the Observer makes the reads it asks for before it judges.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from ..analysis.answers import stream_in_flight
from ..analysis.frontdoor import FrontDoors, front_doors
from ..analysis.gpu import GpuHistory
from ..analysis.judge import (
    beats_of,
    dating_targets,
    goes_to_pipe,
    judge,
    samples_of,
    written_targets,
)
from ..analysis.nowaker import no_waker
from ..analysis.outbound import inode_of
from ..analysis.progress import ParkSettings, ParkTracker
from ..analysis.requests import unanswered_requests, unread_requests
from ..analysis.verdict import ServiceVerdict
from ..analysis.waitgraph import WaitForGraph
from ..analysis.window import Rules, ServiceReads, Tick, Window
from ..model import (
    FrontDoorConfig,
    GpuReading,
    ProbeEvent,
    ProbeReading,
    Snapshot,
    thread_ids,
)
from ..settings import Settings
from ..sources.procfs import ProcFS
from ..sources.protocols import ProbeSource
from .discovery import descendants
from .listens import ListenHistory
from .sampler import Sampler


@dataclass(frozen=True)
class Scope:
    """Which services a tick watches, as data: root -> the service's PIDs (root first), and
    the front doors each service's target declares (absent: decided from what connects to
    its listeners). The daemon builds it from discovery; `diagnose` from the PIDs asked."""

    members: Mapping[int, Sequence[int]]
    declared_doors: Mapping[int, FrontDoorConfig] = field(default_factory=dict)

    @classmethod
    def of_roots(cls, proc: ProcFS, roots: Iterable[int]) -> Scope:
        """Fixed roots and their descendants as /proc shows them now."""
        return cls(descendants(proc, list(dict.fromkeys(roots))))


def park_settings(settings: Settings) -> ParkSettings:
    """The CPU floor work is judged by, as the progress analysis takes it."""
    return ParkSettings(settings.cpu_floor_ratio, settings.cpu_floor_min_ns)


_DEFAULTS = Settings()


class Observer:
    """Ticks (snapshot, wait-for graph, stable cycles, park times) and verdicts over them.

    Settings are inputs of each call, so a reload changes them without reaching inside. The
    Observer reads nothing itself: the sampler does every read of /proc, and the judgement
    is handed what it returned."""

    def __init__(
        self, sampler: Sampler, probe: ProbeSource | None, remember_gone: bool = False
    ) -> None:
        """``remember_gone``: keep processes that exited in the verdicts, marked gone
        (`diagnose` reports on what it was asked about; the daemon drops them)."""
        self.sampler = sampler
        self.probe = probe
        self.remember_gone = remember_gone
        self.declared: Mapping[int, FrontDoorConfig] = {}
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

    def discover(self, scope: Scope) -> list[int]:
        """Take the services' processes now and point the probe at them."""
        self.members = {root: list(pids) for root, pids in scope.members.items()}
        self.declared = scope.declared_doors
        if self.remember_gone:
            for root, pids in self.members.items():
                self._seen.setdefault(root, set()).update(pids)
        pids = sorted({p for ps in self.members.values() for p in ps})
        if self.probe is not None:
            self.probe.watch(pids)
        return pids

    def observe(
        self, scope: Scope, gpu: GpuReading | None = None, settings: Settings = _DEFAULTS
    ) -> Tick:
        """One observation of ``scope``; ``gpu`` is this interval's NVML reading, when there
        is a source. Ticks older than the progress window (``settings.window_s``) are let go."""
        pids = self.discover(scope)
        reading = ProbeReading()
        if self.probe is not None:
            reading = self.probe.read()
            self.events.extend(reading.events)
        unresolved = self.sockets.unresolved(reading.socket_events)
        ports = {(pid, fd): self.sampler.listening_port(pid, fd) for pid, fd in unresolved}
        self.sockets.update(reading.socket_events, ports)
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
        declared = self.declared.get(root)
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

    def window(self) -> Window:
        """The window a judgement reads: its first and latest ticks, and what is carried."""
        return Window(
            latest=self.ticks[-1],
            old=self.ticks[0],  # the window: see _trim
            members=self.members,
            seen={root: frozenset(pids) for root, pids in self._seen.items()},
            fd_names=self._fd_names,
            demand_ns=self._demand_ns,
            heartbeat_files={k: frozenset(v) for k, v in self._heartbeat_files.items()},
            listen_since=self.sockets.since,
            parks=self.tracker,
            gpu=self.gpu_history,
            probed=self.probe is not None,
        )

    def verdicts(self, settings: Settings) -> list[ServiceVerdict]:
        """Each service's verdict over the window: its latest tick against its first. The
        reads a judgement needs are made before it; a verdict that rests on time is judged
        again with its service's open files read (never for a working or idle one)."""
        rules = Rules(settings.park_threshold_s, park_settings(settings))
        window = self.window()
        reads = {
            root: ServiceReads(pipes_read=self._pipes(root))
            for root in self.members
            if goes_to_pipe(written_targets(window, root))
        }
        first = judge(window, reads, rules)
        self._note_heartbeats(first.heartbeats)
        verdicts = dict(first.verdicts)
        if first.to_date:
            window = self.window()  # with the heartbeats just seen: never dated from
            for root in first.to_date:
                reads[root] = self._dating_reads(window, root, reads.get(root))
            dated = judge(window, reads, rules, first.to_date)
            self._note_heartbeats(dated.heartbeats)
            verdicts.update(dated.verdicts)
        return [verdicts[root] for root in self.members]

    def _pipes(self, root: int) -> frozenset[int]:
        """Inodes of the pipes the service's live processes read (an fd walk of each)."""
        snap = self.ticks[-1].snapshot
        return self.sampler.pipes_read(p for p in self.members[root] if p in snap.processes)

    def _dating_reads(self, window: Window, root: int, reads: ServiceReads | None) -> ServiceReads:
        """What dating a service's last progress reads: the fds its processes hold open for
        writing, and the pipes they read if a write to place goes to one."""
        samples = samples_of(window, root)
        written = self.sampler.written_files(p.pid for p in samples)
        pipes = reads.pipes_read if reads is not None else None
        if pipes is None and goes_to_pipe(dating_targets(written, beats_of(window, samples))):
            pipes = self._pipes(root)
        return ServiceReads(pipes, written)

    def _note_heartbeats(self, found: Mapping[tuple[int, int], frozenset[str]]) -> None:
        for key, files in found.items():
            self._heartbeat_files.setdefault(key, set()).update(files)

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
