"""What the daemon exports, as plain data: the metrics collectors read only this.

The daemon builds one ``Exposition`` per tick from its verdicts, snapshots and probe
readings; the collectors in ``agent.export.metrics`` turn the latest one into metric families on
each scrape. Tests build these by hand to check the exposition (a golden /metrics text).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from ..model import GpuDevice, ProgramStats

# The agent's stages, as hangwatch_collector_success{collector} and _duration_seconds name them
# (alerts and dashboards match these values). The daemon runs the first five in this order
# every tick; the last is the /metrics collector reading the latest exposition, on each scrape.
GPU = "gpu"  # NVML, before discovery: the gpu selector needs it
DISCOVERY = "discovery"  # the services to watch, from /proc
# The whole observation (Observer.tick): the probe's reading, the /proc snapshot, the wait-for
# graph. Its failure means stale verdicts (docs/deploy.md), and a scale test reads its duration
# as the cost of a tick.
PROC = "proc"
# The verdicts over the window (agent.analysis.judge) with the reads they ask for, the log of
# state changes and this exposition. Its failure keeps the last verdicts on /metrics.
JUDGE = "judge"
BPF_STATS = "bpf_stats"  # the BPF programs' run time (only with bpf_stats: true)
EXPOSITION = "exposition"
STAGES = (GPU, DISCOVERY, PROC, JUDGE, BPF_STATS, EXPOSITION)


@dataclass(frozen=True)
class ProcessStatus:
    service: str  # the target's name from the config
    root_pid: int  # the service's root process
    pid: int
    comm: str
    state: str  # deadlocked | stalled | idle | progressing
    threads: int
    parked_threads: int
    parked_seconds: float  # how long every thread has been parked; 0 if any works
    lock_cycles: int  # confirmed wait-for cycles that include its threads
    # 1 when no thread of it can be woken but by a signal (agent.analysis.nowaker): a deadlock that
    # shows no lock cycle. lock_cycles and this tell the two proofs apart.
    no_waker: bool = False
    # Extra identity labels from an allow-list of environment variables (RANK, LOCAL_RANK...)
    labels: Mapping[str, str] = field(default_factory=dict)
    # Where it waits while parked, as read for its park (agent.observe.sitebook); None: not parked, not
    # read yet, or a DataLoader-like helper of a rank (only the rank's own process has one).
    waiting_at: str | None = None
    world_size: int | None = None  # its WORLD_SIZE label as a number, where it is one
    write_bytes_total: int | None = None  # bytes written since watched (probe); None: unknown
    last_write_age_seconds: float | None = None  # None: no write seen since watched
    accepts_total: int | None = None  # connections accepted since watched (probe)
    listening_ports: int = 0
    # futex wait durations since watched: log2(ns) slot -> count, from the probe's histogram
    futex_wait_slots: Mapping[int, int] = field(default_factory=dict)
    # GPU index -> bytes this process holds there, and its SM utilisation there (0..1)
    gpu_memory_bytes: Mapping[str, int] = field(default_factory=dict)
    gpu_utilization: Mapping[str, float] = field(default_factory=dict)
    # What the probe did not keep of it beyond its share of the maps every process shares
    # (agent.model.ProbeShare): its evidence is incomplete, and no one else's is
    bpf_entries_refused_total: int = 0
    bpf_events_dropped_total: int = 0


@dataclass(frozen=True)
class ServiceStatus:
    service: str
    pid: int  # root pid
    state: str
    processes: tuple[ProcessStatus, ...] = ()
    gpu_spin: bool = False  # stalled with its GPUs pegged while every host thread is parked
    unanswered_requests: int = 0  # requests on its front doors waiting for an answer
    # Time without progress its verdict used (parked time, or its oldest unanswered request's
    # age if longer); 0 while it works.
    seconds_since_progress: float = 0.0


@dataclass(frozen=True)
class CollectorStatus:
    success: bool
    duration_seconds: float


@dataclass(frozen=True)
class AgentStatus:
    version: str
    events_dropped_total: int = 0  # ring-buffer reserves that failed
    host_events_dropped_total: int = 0  # bind and listen events lost (their ring full)
    maps_full_total: int = 0  # updates refused by a full map (in-flight, histogram, ...)
    programs: Mapping[str, ProgramStats] = field(default_factory=dict)  # by program name
    # by stage name (STAGES; the exposition stage is the scrape's own, added by the collector)
    collectors: Mapping[str, CollectorStatus] = field(default_factory=dict)
    gpus: tuple[GpuDevice, ...] = ()  # from the last good NVML reading
    gpu_errors_total: int = 0  # NVML errors since start
    # Wall-clock time (Unix seconds) the last tick completed: a loop that hangs keeps serving
    # its last verdicts, and only this says how old they are. 0: no tick completed.
    last_tick_seconds: float = 0.0
    # The park threshold its verdicts use: job rules compare parks with it (deploy/prometheus).
    park_threshold_seconds: float | None = None
    tick_errors_total: int = 0  # ticks of the loop that raised (logged; the loop went on)
    # Connections /metrics ended before answering, by reason (agent.export.webconfig)
    http_connections_dropped: Mapping[str, int] = field(default_factory=dict)
    # Per target: the services its selectors match beyond its max_services, not watched.
    services_excess: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Exposition:
    services: tuple[ServiceStatus, ...]
    agent: AgentStatus
