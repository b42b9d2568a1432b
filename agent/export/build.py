"""The exposition of one tick, built from its verdicts and readings: what /metrics serves."""

from __future__ import annotations

from collections.abc import Mapping

from ..analysis.verdict import ProcessVerdict, ServiceVerdict
from ..analysis.window import Tick
from ..model import GpuReading, ProbeReading
from .exposition import AgentStatus, Exposition, ProcessStatus, ServiceStatus


def build_exposition(
    verdicts: list[ServiceVerdict],
    names: Mapping[int, str],
    tick: Tick,
    labels: Mapping[int, Mapping[str, str]],
    agent: AgentStatus,
    sites: Mapping[int, str] | None = None,
) -> Exposition:
    """Plain data for the collectors, from one tick's verdicts, probe and GPU readings;
    ``names``: each service's name by its root pid; ``sites``: where each parked process
    waits, by pid."""
    sites = sites or {}
    gpu = tick.gpu if tick.gpu is not None and tick.gpu.ok else None
    out = []
    for v in verdicts:
        name = names.get(v.pid, "unknown")
        procs = tuple(
            _process_status(name, v.pid, p, tick, labels.get(p.pid, {}), gpu, sites.get(p.pid))
            for p in v.processes
            if not p.gone and p.pid in tick.snapshot.processes
        )
        out.append(
            ServiceStatus(
                name,
                v.pid,
                v.state,
                procs,
                gpu_spin=v.gpu_spin,
                unanswered_requests=v.unanswered_requests,
                seconds_since_progress=v.seconds_since_progress,
            )
        )
    return Exposition(tuple(out), agent)


def _count(text: str | None) -> int | None:
    """A label value that is a decimal count (WORLD_SIZE), as a number; None otherwise."""
    return int(text) if text is not None and text.isdigit() and len(text) <= 9 else None


def _process_status(
    service: str,
    root: int,
    p: ProcessVerdict,
    tick: Tick,
    labels: Mapping[str, str],
    gpu: GpuReading | None,
    site: str | None = None,
) -> ProcessStatus:
    """One live process of a service: its verdict, what the probe counted, its GPU use."""
    reading: ProbeReading = tick.reading
    sample = tick.snapshot.processes[p.pid]
    writes = reading.writes.get(p.pid, {})
    last = max((w.last_ns for w in writes.values()), default=None)
    uses = gpu.processes.get(p.pid, ()) if gpu is not None else ()
    share = reading.shares.get(p.pid)
    return ProcessStatus(
        service=service,
        root_pid=root,
        pid=p.pid,
        comm=p.comm,
        state=p.state,
        threads=p.threads,
        parked_threads=p.parked_threads,
        parked_seconds=p.parked_seconds,
        lock_cycles=len(p.cycles),
        no_waker=p.no_waker,
        labels=dict(labels),
        waiting_at=site,
        world_size=_count(labels.get("world_size")),
        write_bytes_total=sum(w.bytes for w in writes.values()),
        last_write_age_seconds=max(0.0, (tick.snapshot.mono_ns - last) / 1e9) if last else None,
        accepts_total=reading.accepts.get(p.pid, 0),
        listening_ports=len({lst.port for lst in sample.listeners}),
        futex_wait_slots=dict(reading.wait_histogram.get(p.pid, {})),
        gpu_memory_bytes={str(u.gpu): u.memory_bytes for u in uses if u.memory_bytes is not None},
        gpu_utilization={str(u.gpu): u.sm_utilization for u in uses},
        bpf_entries_refused_total=share.entries_refused if share else 0,
        bpf_events_dropped_total=share.events_dropped if share else 0,
    )
