"""One tick of observation, shared by `diagnose` and the daemon.

Each tick: find the services' processes, point the probe at them, take a
snapshot, build its wait-for graph, confirm cycles against the previous tick,
and update park times. Verdicts are then computed over a window of ticks.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from .classify import (
    DEADLOCKED,
    IDLE,
    STALLED,
    ProcessFacts,
    ServiceVerdict,
    classify_service,
    describe_cycle,
    describe_group,
)
from .gpuverdict import GpuHistory, describe_active
from .model import GpuReading, ProbeEvent, ProbeReading, Snapshot, SocketEvent
from .procfs import ProcFS
from .progress import ParkSettings, ParkTracker, window_progress
from .sampler import Sampler, descendants
from .waitgraph import WaitForGraph, WordGroup


class ProbeSource(Protocol):
    """What the observer needs of a probe (agent.probe.KernelProbes, or a test's stand-in)."""

    def watch(self, tgids: Iterable[int]) -> None: ...
    def read(self) -> ProbeReading: ...
    def forget(self, tids: Iterable[int]) -> None: ...


class GpuSourceLike(Protocol):
    """What diagnose and the daemon need of agent.gpu.GpuSource (tests inject a fake NVML)."""

    def read(self) -> GpuReading: ...
    def pids(self) -> set[int]: ...
    def close(self) -> None: ...


@dataclass(frozen=True)
class Tick:
    snapshot: Snapshot
    graph: WaitForGraph
    cycles: tuple[tuple[int, ...], ...]  # stable: seen with the same edges in the previous tick
    reading: ProbeReading
    gpu: GpuReading | None = None  # None: no GPU source


def describe_fd(target: str | None, fd: int) -> str:
    """What an fd is, in words, from its /proc/PID/fd link."""
    if target is None:
        return f"fd {fd}"
    if target.startswith("socket:"):
        return f"a socket (fd {fd})"
    if target.startswith("pipe:"):
        return f"a pipe (fd {fd})"
    if target.startswith(("/dev/pts/", "/dev/tty")):
        return f"the terminal {target}"
    return target


class ListenHistory:
    """When each port started listening, from the probe's bind and listen events.

    Events arrive for every process, watched or not (a server may listen before discovery
    reaches it). Kept per (pid, port); pruned when the pid is gone.
    """

    def __init__(self, proc: ProcFS) -> None:
        self.proc = proc
        self._bound: dict[tuple[int, int], int] = {}  # (pid, fd) -> port asked for at bind
        self.since: dict[tuple[int, int], int] = {}  # (pid, port) -> CLOCK_MONOTONIC of listen

    def update(self, events: Iterable[SocketEvent]) -> None:
        for e in events:
            if e.kind == "bind" and e.port:
                self._bound[(e.tgid, e.fd)] = e.port
            elif e.kind == "listen":
                # A bind to port 0 lets the kernel choose: then ask /proc which port it chose.
                port = self._bound.get((e.tgid, e.fd)) or self._port_now(e.tgid, e.fd)
                if port:
                    self.since[(e.tgid, port)] = e.ts_ns

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

    def describe(self, pids: set[int], snap: Snapshot) -> list[str]:
        out = []
        for pid in sorted(pids):
            p = snap.processes.get(pid)
            for port in sorted({lst.port for lst in p.listeners} if p else ()):
                ns = self.since.get((pid, port))
                if ns is not None:
                    at = time.strftime("%H:%M:%S", time.localtime(snap.wall_of(ns)))
                    out.append(f"port {port} listening since {at}")
        return out


class Observer:
    def __init__(
        self,
        sampler: Sampler,
        probe: ProbeSource | None = None,
        threshold_s: float = 60.0,
        park: ParkSettings | None = None,
        keep_ticks: int = 600,
        membership: Callable[[], Mapping[int, Sequence[int]]] | None = None,
        remember_gone: bool = True,
    ) -> None:
        """``membership`` gives root -> pids each tick (the daemon's discovery); without it,
        the roots given to ``set_roots`` and their descendants. ``remember_gone`` keeps
        exited processes in the verdicts as gone (diagnose); the daemon drops them."""
        self.sampler = sampler
        self.probe = probe
        self.threshold_s = threshold_s
        self.park = park or ParkSettings()
        self.tracker = ParkTracker(self.park)
        self.membership = membership
        self.remember_gone = remember_gone
        self.roots: list[int] = []
        self.members: dict[int, list[int]] = {}
        self._seen: dict[int, set[int]] = {}  # root -> every pid ever in the service
        self._prev_sigs: set[frozenset] = set()
        self.ticks: deque[Tick] = deque(maxlen=keep_ticks)
        self.events: deque[ProbeEvent] = deque(maxlen=1000)  # ring-buffer events, newest last
        self.sockets = ListenHistory(self.sampler.proc)
        self.gpu_history = GpuHistory()
        self._fd_names: dict[tuple[int, int], str] = {}  # (pid, fd) -> link when last written
        self._fd_seen: dict[tuple[int, int], int] = {}  # (pid, fd) -> last_ns when named

    def set_roots(self, roots: Iterable[int]) -> None:
        self.roots = list(dict.fromkeys(roots))

    def discover(self) -> list[int]:
        """Find the services' processes now and point the probe at them."""
        if self.membership is not None:
            self.members = {root: list(pids) for root, pids in self.membership().items()}
            self.roots = list(self.members)
        else:
            self.members = descendants(self.sampler.proc, self.roots)
        if self.remember_gone:
            for root, pids in self.members.items():
                self._seen.setdefault(root, set()).update(pids)
        pids = sorted({p for ps in self.members.values() for p in ps})
        if self.probe is not None:
            self.probe.watch(pids)
        return pids

    def tick(self, gpu: GpuReading | None = None) -> Tick:
        """One observation; ``gpu`` is this interval's NVML reading, when there is a source."""
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
        self.tracker.update(snap)
        self.sockets.prune()
        self.gpu_history.update(gpu, self.ticks[-1].gpu if self.ticks else None, snap.mono_ns)
        tick = Tick(snap, graph, stable, reading, gpu)
        self.ticks.append(tick)
        return tick

    def window_start(self, window_s: float | None) -> Tick:
        """The oldest kept tick no older than ``window_s`` (all of them if None)."""
        latest = self.ticks[-1]
        if window_s is None:
            return self.ticks[0]
        limit = latest.snapshot.mono_ns - int(window_s * 1e9)
        for t in self.ticks:
            if t.snapshot.mono_ns >= limit:
                return t
        return latest

    def verdicts(self, window_s: float | None = None) -> list[ServiceVerdict]:
        latest = self.ticks[-1]
        old_tick = self.window_start(window_s)
        old = old_tick.snapshot
        snap = latest.snapshot
        groups = latest.graph.groups()
        window_ns = snap.mono_ns - old.mono_ns
        out = []
        for root in self.roots:
            facts = []
            for pid in self.members.get(root, [root]):
                sample = snap.processes.get(pid)
                if sample is None:
                    continue
                tids = {t.tid for t in sample.threads}
                parks = self.tracker.parks.get(pid, {})
                progress = window_progress(old.processes.get(pid), sample, window_ns, self.park)
                if pid in latest.reading.accepts:  # counted by the probe since watched
                    progress.accepts = latest.reading.accepts[pid] - old_tick.reading.accepts.get(
                        pid, 0
                    )
                gpu = self.gpu_history.facts(pid, latest.gpu, old_tick.gpu, snap.mono_ns)
                if gpu is not None and gpu.active:
                    progress.gpu_active, progress.gpu_detail = True, describe_active(gpu)
                facts.append(
                    ProcessFacts(
                        sample=sample,
                        progress=progress,
                        parked_threads=sum(1 for x in parks.values() if x.parked),
                        parked_seconds=self.tracker.parked_seconds(pid, snap.mono_ns),
                        cycles=[c for c in latest.cycles if tids.intersection(c)],
                        gpu=gpu,
                    )
                )
            live = {f.sample.pid for f in facts}
            gone = sorted(self._seen.get(root, set()) - live)  # empty unless remember_gone
            v = classify_service(
                root, facts, self.threshold_s, gone=gone, root_gone=root not in live
            )
            v.reasons.extend(self._evidence(v, live, latest, groups))
            out.append(v)
        return out

    def _evidence(
        self, v: ServiceVerdict, pids: set[int], tick: Tick, groups: list[WordGroup]
    ) -> list[str]:
        """The lock evidence behind a verdict, in words: its cycles, or its largest parked groups."""
        graph = tick.graph
        if v.state == DEADLOCKED:
            names = {t.tid: t.name for p in tick.snapshot.processes.values() for t in p.threads}
            return [describe_cycle(c, graph.edges, names) for c in v.cycles]
        if v.state in (STALLED, IDLE):
            now = tick.snapshot.mono_ns
            mine = [g for g in groups if pids.intersection(g.pids)]
            out = [describe_group(g, now) for g in mine[:3]]
            out.extend(self.sockets.describe(pids, tick.snapshot))
            out.extend(self._last_writes(pids, tick.reading, now))
            return out
        return []

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

    def _last_writes(self, pids: set[int], reading: ProbeReading, now: int) -> list[str]:
        """The most recent write, and the most recent to a file (a log) if that was not it."""
        writes = sorted(
            ((w.last_ns, pid, w.fd) for pid in pids for w in reading.writes.get(pid, {}).values()),
            reverse=True,
        )
        out = []
        for i, (ns, pid, fd) in enumerate(writes):
            target = self._fd_names.get((pid, fd))
            is_file = (
                target is not None and target.startswith("/") and not target.startswith("/dev/")
            )
            if i == 0 or is_file:
                what = describe_fd(target, fd)
                out.append(f"last write {(now - ns) / 1e9:.0f} s ago, to {what} (pid {pid})")
            if is_file:
                break
        return out
