"""`hangwatch diagnose`: attach, observe for a few seconds, report each service once."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TextIO

from . import session as session_mod
from .analysis.classify import PROGRESSING, ServiceVerdict, parked_group
from .analysis.evidence import NoPythonStack, ParkedGroup, UnderThreshold
from .errors import UsageError
from .model import ProbeEvent, plural
from .observe.discovery import env_labels
from .observe.fdwaits import waits_on
from .observe.observer import Scope, Tick
from .report.sentences import evidence_json, reasons, render, who
from .session import Session
from .settings import DURATION, PARK_THRESHOLD, Settings
from .sources.procfs import ProcFS
from .sources.pystacks import StackRead, read_many, stack_facts, stacks_json, wait_words
from .sources.symbols import describe_address, named_verdicts, native_caller
from .sources.syscalls import FUTEX, wait_kind

# Stacks of all the processes of a report, in all: a server of 2,000 threads reads in well
# under a second; a reader that hangs must not hold the engineer at the terminal.
STACKS_BUDGET_S = 5.0


@dataclass(frozen=True)
class DiagnoseOptions:
    pids: Sequence[int]
    threshold_s: float = PARK_THRESHOLD.default
    duration_s: float = DURATION.default
    as_json: bool = False
    stacks: bool = True  # Python stacks of every process, read without stopping it

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


def observe(session: Session, opts: DiagnoseOptions, log: TextIO) -> list[ServiceVerdict]:
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
        session.tick(session.read_gpu())
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
                    f"hangwatch: {plural(len(waiting), 'service')} did nothing in "
                    f"{elapsed:.1f} s, with no evidence yet as old as the "
                    f"{opts.threshold_s:g} s threshold: watching until it",
                    file=log,
                    flush=True,
                )
                told = True
            longest = opts.threshold_s
        time.sleep(max(0.0, min(interval, longest - elapsed)) or interval)
    print(f"hangwatch: observed for {time.monotonic() - start:.1f} s ({n} reads)", file=log)
    return verdicts


def _labels_text(labels: Mapping[str, str] | None) -> str:
    """' [rank=1 world_size=2]' for a rank; '' for a process without job labels."""
    if not labels:
        return ""
    return " [" + " ".join(f"{k}={v}" for k, v in sorted(labels.items())) + "]"


def _since(tick: Tick, ns: int | None, fmt: str = "%H:%M:%S") -> str:
    """Wall-clock time of a CLOCK_MONOTONIC instant of this tick."""
    if not ns:
        return ""
    return time.strftime(fmt, time.localtime(tick.snapshot.wall_of(ns)))


ISO = "%Y-%m-%dT%H:%M:%S%z"


def probe_summary(tick: Tick, events: Sequence[ProbeEvent]) -> dict:
    """What the kernel side saw: counters (drops included) and the EDEADLK refusals."""
    return {
        "counters": dict(tick.reading.counters),
        "edeadlk": [
            {"tid": e.tid, "pid": e.tgid, "uaddr": hex(e.uaddr)}
            for e in events
            if e.kind == "edeadlk"
        ],
        "long_waits": sum(1 for e in events if e.kind == "long-wait"),
    }


def gpu_summary(tick: Tick) -> dict:
    """The GPU section: what NVML said, or why it said nothing."""
    g = tick.gpu
    if g is None:
        return {"ok": False, "error": "no GPU source"}
    if not g.ok:
        return {"ok": False, "error": g.error}
    return {
        "ok": True,
        "devices": [
            {
                "index": d.index,
                "uuid": d.uuid,
                "name": d.name,
                "memory_used": d.memory_used,
                "memory_total": d.memory_total,
                "utilization": d.utilization,
            }
            for d in g.devices
        ],
        "processes": {
            str(pid): [
                {"gpu": u.gpu, "memory_bytes": u.memory_bytes, "sm_utilization": u.sm_utilization}
                for u in uses
            ]
            for pid, uses in g.processes.items()
            if pid in tick.snapshot.processes
        },
    }


def gpu_lines(tick: Tick) -> list[str]:
    g = tick.gpu
    if g is None:
        return []
    if not g.ok:
        return [f"GPU: not read ({g.error})"]
    lines = [
        f"GPU {d.index} {d.name}: {d.memory_used / 1e9:.1f} of {d.memory_total / 1e9:.0f} GB used"
        + (f", {d.utilization:.0%} busy" if d.utilization is not None else "")
        for d in g.devices
    ]
    for pid, uses in sorted(g.processes.items()):
        p = tick.snapshot.processes.get(pid)
        if p is None:
            continue
        for u in uses:
            held = f"{u.memory_bytes / 1e9:.1f} GB" if u.memory_bytes is not None else "? GB"
            lines.append(
                f"  pid {pid} ({p.comm}) on GPU {u.gpu}: {held}, {u.sm_utilization:.0%} SM"
            )
    return lines or ["GPU: NVML answered; no GPU on this host"]


def to_json(
    verdicts: list[ServiceVerdict],
    tick: Tick,
    opts: DiagnoseOptions,
    events: Sequence[ProbeEvent],
    labels: Mapping[int, Mapping[str, str]] | None = None,
    stacks: Mapping[int, StackRead] | None = None,
    observed_s: float | None = None,
) -> dict:
    snap, graph = tick.snapshot, tick.graph
    groups = graph.groups()
    services = []
    for v in verdicts:
        pids = {p.pid for p in v.processes}
        services.append(
            {
                "pid": v.pid,
                "state": v.state,
                "cycles": [list(c) for c in v.cycles],
                "reasons": reasons(v.reasons),
                # The same reasons as records: each kind's fields, ages in seconds
                "evidence": [evidence_json(f) for f in v.reasons],
                "culprit": evidence_json(v.culprit) if v.culprit is not None else None,
                "seconds_since_progress": round(v.seconds_since_progress, 3),
                "unanswered_requests": v.unanswered_requests,
                "gone": v.gone,
                "processes": [
                    {
                        "pid": p.pid,
                        "comm": p.comm,
                        "threads": p.threads,
                        "parked_threads": p.parked_threads,
                        "parked_seconds": round(p.parked_seconds, 3),
                        "state": p.state,
                        "reasons": reasons(p.reasons),
                        "evidence": [evidence_json(f) for f in p.reasons],
                        "waits": evidence_json(p.waits) if p.waits is not None else None,
                        "listening_ports": list(p.listening_ports),
                        # RANK, LOCAL_RANK, WORLD_SIZE, ...: the daemon's allow-listed labels
                        "labels": dict((labels or {}).get(p.pid, {})),
                        "gone": p.gone,
                        # Python stacks by group (None: not a Python process, or not read)
                        "stacks": (
                            stacks_json(snap.processes[p.pid], (stacks or {})[p.pid])
                            if p.pid in (stacks or {}) and p.pid in snap.processes
                            else None
                        ),
                    }
                    for p in v.processes
                ],
                "edges": [
                    {
                        "waiter": e.waiter,
                        "owner": e.owner,
                        "kind": e.kind,
                        "uaddr": hex(e.uaddr),
                        "waiter_pid": e.waiter_pid,
                        "owner_pid": e.owner_pid,
                    }
                    for e in graph.edges.values()
                    if e.waiter_pid in pids
                ],
                "parked_groups": [
                    {
                        "uaddr": hex(g.uaddr),
                        "op": g.op_name,
                        "tids": list(g.tids),
                        "pids": list(g.pids),
                        "owner": g.owner,
                        "since": _since(tick, g.since_ns, ISO) or None,
                    }
                    for g in groups
                    if pids.intersection(g.pids)
                ],
            }
        )
    return {
        "threshold_seconds": opts.threshold_s,
        "duration_seconds": opts.duration_s,
        # Longer than the duration where a quiet service had to be watched to the threshold.
        "observed_seconds": round(opts.duration_s if observed_s is None else observed_s, 3),
        "observed_at": time.strftime(ISO, time.localtime(snap.wall)),
        "services": services,
        "probe": probe_summary(tick, events),
        "gpu": gpu_summary(tick),
    }


def render_text(
    verdicts: list[ServiceVerdict],
    tick: Tick,
    opts: DiagnoseOptions,
    events: Sequence[ProbeEvent],
    labels: Mapping[int, Mapping[str, str]] | None = None,
    on: Mapping[tuple[int, int], str] | None = None,
    stacks: Mapping[int, StackRead] | None = None,
    observed_s: float | None = None,
) -> str:
    """The report in words; ``on``: (pid, tid) -> what it waits on (waits_on); ``stacks``: the
    Python stacks by PID: a process that has them is shown by them, line by line of its
    code, rather than by futex words and syscalls; ``observed_s``: how long it watched."""
    snap, graph = tick.snapshot, tick.graph
    observed = f"{opts.duration_s:g} s"
    if observed_s is not None and observed_s > opts.duration_s + 1:
        observed = f"{observed_s:.0f} s (watched on to the threshold)"
    names = {t.tid: t.name for p in snap.processes.values() for t in p.threads}
    groups = graph.groups()
    lines = [
        f"hangwatch diagnose: {plural(len(verdicts), 'service')}, threshold {opts.threshold_s:g} s, "
        f"observed {observed}, at {time.strftime('%H:%M:%S', time.localtime(snap.wall))}",
        "",
    ]
    for v in verdicts:
        root = snap.processes.get(v.pid)
        comm = root.comm if root else "gone"
        lines.append(f"service {v.pid} ({comm}): {v.state.upper()}")
        # Futex words with no owner say less than the stacks below, which show every one of
        # those threads at its line: in the text they give way (--json keeps them).
        reads = [(stacks or {}).get(p.pid) for p in v.processes if not p.gone]
        shown_by_stacks = bool(reads) and all(r is not None and r.error is None for r in reads)
        facts = [
            f
            for f in v.reasons
            if not (shown_by_stacks and isinstance(f, ParkedGroup) and not f.owner)
        ]
        lines.extend(f"  - {r}" for r in reasons(facts))
        for p in sorted(v.processes, key=lambda x: x.pid):
            if p.gone:
                lines.append(f"  process {p.pid}: exited while watched")
                continue
            sample = snap.processes[p.pid]
            park = f", all parked for {p.parked_seconds:.1f} s" if p.parked_seconds else ""
            ports = (
                f", listening on {', '.join(map(str, p.listening_ports))}"
                if p.listening_ports
                else ""
            )
            lines.append(
                f"  process {p.pid} {p.comm}{_labels_text((labels or {}).get(p.pid))}: "
                f"{p.state}, {plural(p.threads, 'thread')}, "
                f"{p.parked_threads} parked{park}{ports}"
            )
            if p.state != v.state:  # otherwise the service's reasons already say it
                lines.extend(f"      {r}" for r in reasons(p.reasons))
            # A Python process is shown by its stacks, line by line of its code; its futex
            # words only where they name an owner, and its threads without Python frames
            # (native helpers, I/O threads) by what they wait in.
            read = (stacks or {}).get(p.pid)
            python: set[int] = set()
            if read is not None:
                facts = stack_facts(
                    sample,
                    read,
                    snap.wall,
                    snap.mono_ns,
                    native=native_caller,
                    on=on,
                )
                if read.error is None:
                    python = set(read.threads)
                    lines.append(
                        f"    Python stacks (read in {read.seconds:.2f} s without stopping it):"
                    )
                    facts = [f for f in facts if not isinstance(f, NoPythonStack)]
                lines.extend(f"    - {r}" for r in reasons(facts))
            shown: set[int] = set(python)
            own = {x.tid for x in sample.threads}
            for g in groups:
                if p.pid not in g.pids or (python and not g.owner):
                    continue
                tids = [t for t in g.tids if t in own]
                shown.update(tids)
                since = _since(tick, g.since_ns)
                group = replace(
                    parked_group(g, snap.mono_ns), word=describe_address(p.pid, g.uaddr)
                )
                lines.append(
                    f"    {render(group)}"
                    + (f", since {since}" if since else "")
                    + f": {who([(t, names.get(t, '?')) for t in tids])}"
                )
            others: dict[str, list[int]] = {}
            for t in sample.threads:
                if t.tid in shown:
                    continue
                what = wait_words(t)
                if t.blocked and t.syscall is not None and t.syscall >= 0:
                    caller = native_caller(p.pid, t.tid) if wait_kind(t.syscall) == FUTEX else None
                    if caller:
                        what += f", called from {caller}"
                    fds = (on or {}).get((p.pid, t.tid))
                    if fds:
                        what += f" on {fds}"
                others.setdefault(what, []).append(t.tid)
            for what, tids in sorted(others.items()):
                named = who([(t, names.get(t, "?")) for t in tids])
                lines.append(f"    {plural(len(tids), 'thread')} {what}: {named}")
        lines.append("")
    lines.extend(gpu_lines(tick))
    probe = probe_summary(tick, events)
    c = probe["counters"]
    lost = sum(
        c.get(k, 0) for k in ("inflight_full", "hist_full", "refusals_full", "events_dropped")
    )
    lines.append(
        f"probe: {c.get('waits_started', 0)} futex waits began while attached, {lost} lost to full maps or "
        f"ring buffer, {probe['long_waits']} long waits ended"
    )
    for r in probe["edeadlk"]:
        lines.append(
            f"probe: the kernel refused PI lock {r['uaddr']} to thread {r['tid']} (EDEADLK)"
        )
    return "\n".join(lines) + "\n"


def run(opts: DiagnoseOptions, out: TextIO = sys.stdout, log: TextIO = sys.stderr) -> int:
    proc = ProcFS()
    validate(opts, proc)
    scope = Scope.of_roots(proc, opts.pids)

    def notice(line: str) -> None:
        print(f"hangwatch: {line}", file=log)

    with session_mod.start(opts.settings, scope, proc=proc, notice=notice) as session:
        probe = session.probe
        assert probe is not None  # start() always attaches one
        watched = session.observer.discover()  # before "attached": from here on, waits are seen
        print(
            f"hangwatch: attached probes ({probe.programs} tracepoints) in "
            f"{probe.load_seconds:.1f} s; watching {plural(len(watched), 'process', 'processes')} of "
            f"{plural(len(opts.pids), 'service')} for {opts.duration_s:g} s",
            file=log,
            flush=True,
        )
        verdicts = observe(session, opts, log)
        observer = session.observer
        tick = observer.ticks[-1]
    verdicts = named_verdicts(verdicts, tick.snapshot)
    stacks: dict[int, StackRead] = {}
    if opts.stacks:
        pids = [p.pid for v in verdicts for p in v.processes if not p.gone]
        stacks = read_many(pids, STACKS_BUDGET_S)
        took = sum(r.seconds for r in stacks.values())
        print(
            f"hangwatch: read the Python stacks of {plural(len(stacks), 'process', 'processes')} "
            f"in {took:.2f} s (py-spy --nonblocking: not stopped)",
            file=log,
        )
    # The probe reports EDEADLK for every process; show those of the services asked about.
    ours = {p for pids in observer.members.values() for p in pids}
    events = [e for e in observer.events if e.tgid in ours]
    labels = {pid: env_labels(proc.environ(pid) or b"") for pid in tick.snapshot.processes}
    observed_s = (tick.snapshot.mono_ns - observer.ticks[0].snapshot.mono_ns) / 1e9
    if opts.as_json:
        json.dump(to_json(verdicts, tick, opts, events, labels, stacks, observed_s), out, indent=2)
        out.write("\n")
    else:
        out.write(
            render_text(
                verdicts,
                tick,
                opts,
                events,
                labels,
                waits_on(proc, tick.snapshot.processes.values()),
                stacks,
                observed_s,
            )
        )
    return 0
