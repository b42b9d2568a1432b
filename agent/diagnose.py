"""`hangwatch diagnose`: attach, observe for a few seconds, report each service once."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TextIO

from . import session as session_mod
from .analysis.daemonview import merge
from .analysis.evidence import UnderThreshold
from .analysis.verdict import PROGRESSING, ServiceVerdict
from .config import DEFAULT_STATUS_SOCKET
from .errors import UsageError
from .explain import explain
from .export.statusproto import ProtocolError, sight_of
from .observe.discovery import process_labels
from .observe.observer import Observer, Scope
from .report import as_json as json_report
from .report import notices
from .report import text as text_report
from .report.diagnosis import History, Report
from .session import Session
from .settings import DURATION, PARK_THRESHOLD, Settings
from .sources.procfs import ProcFS
from .status import sighting


@dataclass(frozen=True)
class DiagnoseOptions:
    pids: Sequence[int]
    threshold_s: float = PARK_THRESHOLD.default
    duration_s: float = DURATION.default
    as_json: bool = False
    stacks: bool = True  # Python stacks of every process, read without stopping it
    socket_path: str = DEFAULT_STATUS_SOCKET  # the daemon's, asked for its history

    @property
    def settings(self) -> Settings:
        return Settings.diagnose(self.threshold_s)


def validate(opts: DiagnoseOptions, proc: ProcFS) -> None:
    """Bad input is an error before anything is attached."""
    if not opts.pids:
        raise UsageError("no --pid given", "name at least one process: --pid PID")
    for setting, value in ((PARK_THRESHOLD, opts.threshold_s), (DURATION, opts.duration_s)):
        setting.check(value, setting.flag or setting.key)
    for pid in opts.pids:
        if pid <= 0 or proc.stat(pid) is None:
            raise UsageError(f"no such process: --pid {pid}")
        tgid = proc.tgid_of(pid)
        if tgid is not None and tgid != pid:
            raise UsageError(f"--pid {pid} is a thread of process {tgid}", f"give --pid {tgid}")


def unsettled(verdicts: Sequence[ServiceVerdict]) -> list[ServiceVerdict]:
    """Services that did nothing in the window but whose time without progress is still
    under the threshold: what the window saw cannot say yet whether they are stalled."""
    return [
        v
        for v in verdicts
        if v.state == PROGRESSING and any(isinstance(r, UnderThreshold) for r in v.reasons)
    ]


def observe(
    session: Session, scope: Callable[[], Scope], opts: DiagnoseOptions, log: TextIO
) -> list[ServiceVerdict]:
    """Tick for the duration; at least two ticks, so a cycle can be confirmed. Then, while
    a service did nothing but its evidence is younger than the threshold (a heartbeat
    rewrote its log a moment before the window, say), watch on until the threshold, so
    the verdict rests on what was watched. Returns the verdicts."""
    interval = session.settings.interval_s
    start = time.monotonic()
    n = 0
    longest = opts.duration_s
    told = False
    while True:
        session.observe(scope(), session.read_gpu())
        n += 1
        elapsed = time.monotonic() - start
        if elapsed >= longest and n >= 2:
            verdicts = session.verdicts()
            ticks = session.observer.ticks
            watched = (ticks[-1].snapshot.mono_ns - ticks[0].snapshot.mono_ns) / 1e9
            # What the verdict weighs is the reads' span, a little less than `elapsed`.
            waiting = unsettled(verdicts) if watched < opts.threshold_s else []
            if not waiting:
                break
            if not told:
                print(
                    notices.watching_on(len(waiting), elapsed, opts.threshold_s),
                    file=log,
                    flush=True,
                )
                told = True
            longest = opts.threshold_s
        time.sleep(max(0.0, min(interval, longest - elapsed)) or interval)
    print(notices.observed(time.monotonic() - start, n), file=log)
    return verdicts


def run(opts: DiagnoseOptions, out: TextIO = sys.stdout, log: TextIO = sys.stderr) -> int:
    proc = ProcFS()
    validate(opts, proc)

    def scope() -> Scope:  # the processes asked about and, each tick, their descendants
        return Scope.of_roots(proc, opts.pids)

    def notice(line: str) -> None:
        print(f"hangwatch: {line}", file=log)

    with session_mod.start(opts.settings, remember_gone=True, proc=proc, notice=notice) as session:
        probe = session.probe
        assert probe is not None  # start() always attaches one
        watched = session.observer.discover(
            scope()
        )  # before "attached": from here on, waits are seen
        attached = notices.attached(
            probe.programs, probe.load_seconds, len(watched), len(opts.pids), opts.duration_s
        )
        print(attached, file=log, flush=True)
        verdicts = observe(session, scope, opts, log)
        ticks = session.observer.ticks
        observed = (ticks[-1].snapshot.mono_ns - ticks[0].snapshot.mono_ns) / 1e9
        verdicts, history = with_daemon(verdicts, opts.socket_path, observed)
    write_report(opts, proc, session.observer, verdicts, out, log, history)
    return 0


def with_daemon(
    verdicts: Sequence[ServiceVerdict], path: str, observed_s: float
) -> tuple[list[ServiceVerdict], dict[int, History]]:
    """Each verdict judged with what the daemon at ``path`` saw of its service, where one
    watches it (agent.analysis.daemonview); and, per service, whose history it had."""
    out, history = [], {}
    for v in verdicts:
        seen = sighting(path, v.pid)
        sight = None
        if seen.service is not None and seen.daemon_pid is not None:
            try:
                sight = sight_of(seen.service, seen.daemon_pid)
            except ProtocolError as e:
                seen = replace(seen, why=f"the daemon at {path} answered badly: {e}")
        out.append(merge(v, sight, observed_s))
        history[v.pid] = History(seen.daemon_pid if sight else None, path, seen.why)
    return out, history


def write_report(
    opts: DiagnoseOptions,
    proc: ProcFS,
    observer: Observer,
    verdicts: list[ServiceVerdict],
    out: TextIO,
    log: TextIO,
    history: Mapping[int, History] | None = None,
) -> None:
    """Read what the report shows beyond the last tick (agent.explain), then write it, as
    text or JSON (agent.report)."""
    tick = observer.ticks[-1]
    # The probe reports EDEADLK for every process; show those of the services asked about.
    ours = {p for pids in observer.members.values() for p in pids}
    snap = tick.snapshot
    base = Report(
        verdicts=verdicts,
        snapshot=snap,
        graph=tick.graph,
        counters=tick.reading.counters,
        gpu=tick.gpu,
        events=[e for e in observer.events if e.tgid in ours],
        threshold_s=opts.threshold_s,
        duration_s=opts.duration_s,
        observed_s=(snap.mono_ns - observer.ticks[0].snapshot.mono_ns) / 1e9,
        labels={pid: process_labels(proc, pid) for pid in snap.processes},
        history=history or {},
    )
    pids = [p.pid for v in verdicts for p in v.processes if not p.gone] if opts.stacks else []
    told = explain(
        proc,
        snap,
        verdicts,
        pids,
        (lambda _: json_report.wanted(base))
        if opts.as_json
        else (lambda stacks: text_report.wanted(base, stacks)),
    )
    if opts.stacks:
        took = sum(r.seconds for r in told.inputs.stacks.values())
        print(notices.stacks_read(len(told.inputs.stacks), took), file=log)
    report = replace(base, verdicts=told.verdicts, inputs=told.inputs)
    if opts.as_json:
        json.dump(json_report.to_json(report), out, indent=2)
        out.write("\n")
    else:
        out.write(text_report.render_text(report))
