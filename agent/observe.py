"""One tick of observation, shared by `diagnose` and the daemon.

Each tick: find the services' processes, point the probe at them, take a
snapshot, build its wait-for graph, confirm cycles against the previous tick,
and update park times. Verdicts are then computed over a window of ticks.
"""

from __future__ import annotations

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
from .model import ProbeEvent, ProbeReading, Snapshot
from .progress import ParkSettings, ParkTracker, window_progress
from .sampler import Sampler, descendants
from .waitgraph import WaitForGraph, WordGroup


class ProbeSource(Protocol):
    """What the observer needs of a probe (agent.probe.FutexProbe, or a test's stand-in)."""

    def watch(self, tgids: Iterable[int]) -> None: ...
    def read(self) -> ProbeReading: ...
    def forget(self, tids: Iterable[int]) -> None: ...


@dataclass(frozen=True)
class Tick:
    snapshot: Snapshot
    graph: WaitForGraph
    cycles: tuple[tuple[int, ...], ...]  # stable: seen with the same edges in the previous tick
    reading: ProbeReading


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

    def tick(self) -> Tick:
        pids = self.discover()
        reading = ProbeReading()
        if self.probe is not None:
            reading = self.probe.read()
            self.events.extend(reading.events)
        snap = self.sampler.snapshot(pids, reading)
        live = {t.tid for p in snap.processes.values() for t in p.threads}
        if self.probe is not None:
            stale = [tid for tid in (*reading.inflight, *reading.refusals) if tid not in live]
            if stale:
                self.probe.forget(stale)
        graph = WaitForGraph(snap)
        sigs = {graph.cycle_signature(c): c for c in graph.cycles()}
        stable = tuple(sorted(c for sig, c in sigs.items() if sig in self._prev_sigs))
        self._prev_sigs = set(sigs)
        self.tracker.update(snap)
        tick = Tick(snap, graph, stable, reading)
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
                facts.append(
                    ProcessFacts(
                        sample=sample,
                        progress=progress,
                        parked_threads=sum(1 for x in parks.values() if x.parked),
                        parked_seconds=self.tracker.parked_seconds(pid, snap.mono_ns),
                        cycles=[c for c in latest.cycles if tids.intersection(c)],
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
            mine = [g for g in groups if pids.intersection(g.pids)]
            return [describe_group(g, tick.snapshot.mono_ns) for g in mine[:3]]
        return []
