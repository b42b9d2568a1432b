"""The judgement: each service's verdict over a window, as a pure function of plain data.

``judge`` reads nothing: what a verdict needs beyond the snapshots comes in ``ServiceReads``.
Where a verdict rests on time without progress and its last progress is not dated yet, the
judgement says so (``Judgement.to_date``) and the observer reads the service's open files
and asks again; a working or idle service never costs that read.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace

from ..model import ProbeReading, ProcessSample, Snapshot, WrittenFd, fd_name, thread_ids
from . import evidence as ev
from .classify import classify_service, rests_on_time
from .frontdoor import FrontDoors
from .gpu import gpu_active
from .last_progress import last_progress
from .outbound import (
    CLIENT,
    LEAVES,
    ServiceEnds,
    closed_file,
    door_answers,
    fd_rest,
    received_from_outside,
)
from .progress import window_progress
from .verdict import ProcessFacts, ServiceFacts, ServiceVerdict, incomplete
from .waitgraph import WordGroup
from .waits import lock_cycle, parked_group, process_waits
from .window import Rules, ServiceReads, Window

HeartbeatFiles = Mapping[tuple[int, int], frozenset[str]]


@dataclass(frozen=True)
class Judgement:
    verdicts: Mapping[int, ServiceVerdict]  # root -> verdict
    # Roots whose verdict rests on time and was judged without its last progress dated: read
    # their open files (ServiceReads.written) and judge them again.
    to_date: frozenset[int]
    heartbeats: HeartbeatFiles  # (pid, start) -> fd links seen written with heartbeats


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


def describe_fd(target: str | None, fd: int) -> str:
    """What an fd is, in words, from its /proc/PID/fd link: a file by its path alone."""
    if target is not None and target.startswith("/") and not target.startswith("/dev/"):
        return target
    return fd_name(target, fd)


def goes_to_pipe(targets: Iterable[str | None]) -> bool:
    """Whether placing writes to these fd links needs the pipes the service reads."""
    return any(t is not None and t.startswith("pipe:[") for t in targets)


def samples_of(window: Window, root: int) -> list[ProcessSample]:
    """The service's live processes in the latest snapshot, root first."""
    procs = window.latest.snapshot.processes
    return [procs[p] for p in window.members[root] if p in procs]


def written_targets(window: Window, root: int) -> list[str | None]:
    """The fd links of what the service's processes wrote, as the probe counted them."""
    writes = window.latest.reading.writes
    return [
        window.fd_names.get((p.pid, fd))
        for p in samples_of(window, root)
        for fd in writes.get(p.pid, {})
    ]


def beats_of(window: Window, samples: Iterable[ProcessSample]) -> frozenset[str]:
    """The fd links the processes were seen writing heartbeats to."""
    out: set[str] = set()
    for p in samples:
        out.update(window.heartbeat_files.get((p.pid, p.start_ticks), ()))
    return frozenset(out)


def dating_targets(
    written: Mapping[int, Sequence[WrittenFd]], beats: Collection[str]
) -> list[str | None]:
    """The fd links dating reads: what the processes hold open for writing, heartbeats aside."""
    return [f.target for fds in written.values() for f in fds if f.target not in beats]


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


def judge(
    window: Window,
    reads: Mapping[int, ServiceReads],
    rules: Rules,
    roots: Iterable[int] | None = None,
) -> Judgement:
    """Each service's verdict (``roots``: these only; all by default), from the window and
    the reads made for it (a service absent from ``reads`` had none)."""
    j = _Judging(window, rules)
    verdicts = {}
    to_date = set()
    for root in window.members if roots is None else roots:
        v, undated = j.service(root, reads.get(root, ServiceReads()))
        verdicts[root] = v
        if undated:
            to_date.add(root)
    beats = {k: frozenset(v) for k, v in j.heartbeats.items()}
    return Judgement(verdicts, frozenset(to_date), beats)


class _Judging:
    """One judge call: what is computed once for all services, and the heartbeats seen."""

    def __init__(self, window: Window, rules: Rules) -> None:
        self.w = window
        self.rules = rules
        self.groups: list[WordGroup] = window.latest.graph.groups()  # largest first
        self.names = _ThreadNames(window.latest.snapshot)
        self.heartbeats: dict[tuple[int, int], set[str]] = {}

    def service(self, root: int, reads: ServiceReads) -> tuple[ServiceVerdict, bool]:
        """One service's verdict, and whether it rests on time with its progress undated."""
        w = self.w
        snap = w.latest.snapshot
        samples = samples_of(w, root)
        doors = w.latest.doors[root]
        conns = [c for p in samples for c in p.connections]
        ends = ServiceEnds(conns, reads.pipes_read or frozenset())
        facts = [self._facts(s, ends, doors) for s in samples]
        live = {f.sample.pid for f in facts}
        gone = sorted(w.seen.get(root, frozenset()) - live)  # empty unless diagnose's
        cycles = sorted({c for f in facts for c in f.cycles})
        demand_ns = w.demand_ns.get(root)
        evidence = ServiceFacts(
            cycles=[lock_cycle(c, w.latest.graph.edges, self.names) for c in cycles],
            parked=self._parked_evidence(live, doors),
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
                self.rules.threshold_s,
                gone=gone,
                root_gone=root not in live,
                evidence=evidence,
            )

        v = classify(evidence)
        if not rests_on_time(v):
            return v, False
        if reads.written is None:
            return v, True
        dated = self._date(samples, reads.written, ends, doors)
        return classify(replace(evidence, last_progress=dated)), False

    def _facts(self, sample: ProcessSample, ends: ServiceEnds, doors: FrontDoors) -> ProcessFacts:
        """What the classifier needs of one process over the window; heartbeat files noted."""
        w = self.w
        latest, old_tick = w.latest, w.old
        snap, pid = latest.snapshot, sample.pid
        accepts = None
        if pid in latest.reading.accepts:  # counted by the probe since watched
            accepts = latest.reading.accepts[pid] - old_tick.reading.accepts.get(pid, 0)
        gpu = w.gpu.facts(pid, latest.gpu, old_tick.gpu, snap.mono_ns)
        old_sample = old_tick.snapshot.processes.get(pid)
        written = self._written_out(pid, ends, doors)
        progress = window_progress(
            old_sample,
            sample,
            snap.mono_ns - old_tick.snapshot.mono_ns,
            self.rules.park,
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
            self.heartbeats.setdefault(key, set()).update(written.files)
        return ProcessFacts(
            sample=sample,
            progress=progress,
            parked_threads=w.parks.parked_threads(pid),
            parked_seconds=w.parks.parked_seconds(pid, snap.mono_ns),
            cycles=[c for c in latest.cycles if not set(thread_ids(sample.threads)).isdisjoint(c)],
            gpu=gpu,
            front_door_ports=doors.ports,
            waits=process_waits(sample, snap.mono_ns),
            no_waker=pid in latest.no_waker,
            streams=latest.streams.get(pid, frozenset()),
            incomplete=incomplete(pid, latest.reading.shares.get(pid)),
        )

    def _parked_evidence(self, pids: set[int], doors: FrontDoors) -> list[ev.Fact]:
        """What a parked service waits on: its largest parked groups, which of its listeners
        are front doors, since when its ports listen, and its last writes."""
        tick = self.w.latest
        now = tick.snapshot.mono_ns
        mine = [g for g in self.groups if pids.intersection(g.pids)]
        out: list[ev.Fact] = [parked_group(g, now) for g in mine[:3]]
        if doors.doors:
            out.append(doors.evidence())
        out.extend(self._listening_since(pids, tick.snapshot))
        out.extend(self._last_writes(pids, tick.reading, now))
        return out

    def _listening_since(self, pids: set[int], snap: Snapshot) -> list[ev.Fact]:
        out: list[ev.Fact] = []
        for pid in sorted(pids):
            p = snap.processes.get(pid)
            for port in sorted({lst.port for lst in p.listeners} if p else ()):
                ns = self.w.listen_since.get((pid, port))
                if ns is not None:
                    out.append(ev.ListeningSince(port, snap.wall_of(ns)))
        return out

    def _date(
        self,
        samples: Sequence[ProcessSample],
        written: Mapping[int, tuple[WrittenFd, ...]],
        ends: ServiceEnds,
        doors: FrontDoors,
    ) -> ev.LastProgress | None:
        """The service's last progress before the window (agent.analysis.last_progress), from
        the fds its processes hold open for writing."""
        snap = self.w.latest.snapshot
        beats = beats_of(self.w, samples)
        for p in samples:  # heartbeats seen in this very judgement count too
            beats |= self.heartbeats.get((p.pid, p.start_ticks), set())
        return last_progress(
            samples,
            written,
            ends,
            doors.ports,
            snap.mono_ns,
            snap.wall,
            self.w.old.snapshot.mono_ns,
            beats,
        )

    def _written_out(self, pid: int, ends: ServiceEnds, doors: FrontDoors) -> Written:
        """What the process wrote in the window that left the service (agent.analysis.outbound),
        by the probe's count per fd and, for connections it accepted, per local port: an
        answer at a front door counts as one whatever became of its connection, one at an
        internal door stays inside (total None without a probe)."""
        w = self.w
        if not w.probed:
            return Written(None)
        latest, old = w.latest.reading, w.old.reading
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
        for fd, wr in latest.writes.get(pid, {}).items():
            prev = before.get(fd)
            delta = fd_rest(wr, prev)
            name = w.fd_names.get((pid, fd))
            where = ends.destination(name)
            if delta <= 0 or where not in LEAVES:
                continue
            total += delta
            closed = closed_file(wr, prev, delta) if name is None else None
            if where == CLIENT:
                answered += delta
            elif name is None and closed is None:
                unplaced += delta
            else:
                key = closed or describe_fd(name, fd)
                files[key] = files.get(key, 0) + delta
                if name is not None:
                    links.append(name)
                calls += wr.calls - (prev.calls if prev is not None else 0)
        most = max(files, key=lambda k: files[k]) if files else None
        return Written(total, answered, most, tuple(links), unplaced, len(files), calls)

    def _last_writes(self, pids: set[int], reading: ProbeReading, now: int) -> list[ev.Fact]:
        """The most recent write, and the most recent to a file (a log) if that was not it."""
        writes = sorted(
            ((w.last_ns, pid, w.fd) for pid in pids for w in reading.writes.get(pid, {}).values()),
            reverse=True,
        )
        out: list[ev.Fact] = []
        for i, (ns, pid, fd) in enumerate(writes):
            target = self.w.fd_names.get((pid, fd))
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
