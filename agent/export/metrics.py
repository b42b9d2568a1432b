"""Prometheus metrics: the daemon's latest ``Exposition`` as metric families, on every scrape.

``HangwatchCollector`` keeps nothing between scrapes: each ``collect()`` builds fresh families
from the latest exposition, so cardinality stays bounded by what is watched now. A family's
samples share one set of label names ("" where a process lacks an environment label), and
none is a TID: per-thread series would grow with every thread ever seen (docs/how-it-works.md,
"Labels").
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.utils import floatToGoString

from .. import __version__
from ..analysis.verdict import STATES
from .exposition import EXPOSITION, AgentStatus, Exposition, ProcessStatus, ServiceStatus

log = logging.getLogger(__name__)

# Bucket bounds of hangwatch_futex_wait_seconds: 2^10, 2^12, ... 2^36 ns (1.024 us to 68.7 s),
# the same for every process. Each bound is an edge of the probe's log2 slots, so the
# cumulative counts are exact, not interpolated; powers of 4 rather than 2 halve the series per
# process (14 bounds + Inf). Waits under ~1 us never really slept (the word had changed), and a
# wait parked for good never ends, so it shows in parked_seconds, not here.
BUCKET_LOG2_NS: tuple[int, ...] = tuple(range(10, 37, 2))
BUCKET_BOUNDS_SECONDS: tuple[float, ...] = tuple(2**b / 1e9 for b in BUCKET_LOG2_NS)
_BUCKET_LE: tuple[str, ...] = (*(floatToGoString(b) for b in BUCKET_BOUNDS_SECONDS), "+Inf")

# Label names a process family uses itself; an environment label must not shadow them (and
# "tid" is reserved so that an allow-listed TID variable can never become a per-thread label).
_PROCESS_LABELS = ("service", "service_pid", "pid", "comm")
_RESERVED = frozenset({*_PROCESS_LABELS, "state", "gpu", "le", "tid", "site"})
_NOT_LABEL_CHAR = re.compile(r"[^a-z0-9_]")


def bucket_index(slot: int) -> int:
    """Index in the bucket bounds (len(BUCKET_LOG2_NS) for +Inf) that takes log2 slot ``slot``.

    Slot s counts waits in [2^s, 2^(s+1)) ns: the smallest bound >= 2^(s+1) ns holds them all.
    """
    edge = slot + 1
    first, last = BUCKET_LOG2_NS[0], BUCKET_LOG2_NS[-1]
    if edge <= first:
        return 0
    if edge > last:
        return len(BUCKET_LOG2_NS)
    return (edge - first + 1) // 2


def futex_buckets(slots: Mapping[int, int]) -> tuple[list[tuple[str, float]], float]:
    """Cumulative ``(le, count)`` buckets and the approximate sum in seconds of log2 slots.

    The probe keeps counts only, so the sum counts each wait at its slot's midpoint,
    1.5 * 2^s ns: within a factor of 1.5 of the truth, wait by wait.
    """
    counts = [0] * len(_BUCKET_LE)
    total_ns = 0.0
    for slot, n in slots.items():
        counts[bucket_index(slot)] += n
        total_ns += n * 1.5 * 2.0**slot
    buckets = []
    running = 0
    for le, n in zip(_BUCKET_LE, counts):
        running += n
        buckets.append((le, float(running)))
    return buckets, total_ns / 1e9


def label_name(key: str) -> str:
    """An environment variable's name as a valid label name that cannot shadow ours."""
    name = _NOT_LABEL_CHAR.sub("_", key.lower())
    if not name or name[0].isdigit() or name.startswith("__") or name in _RESERVED:
        name = "env_" + name
    return name


def _gpu_order(gpu: str) -> tuple[int, int, str]:
    # Numeric indices in numeric order ("2" before "10"), anything else after them.
    return (0, int(gpu), gpu) if gpu.isdigit() else (1, 0, gpu)


# In a row's labels: the process labels, service..comm and then this scrape's environment labels.
_P = "<process>"
GAUGE, COUNTER, HISTOGRAM = "gauge", "counter", "histogram"


class _Family(NamedTuple):
    """One metric family: the key ``_Families`` files it under, its kind, name, help, labels."""

    key: str
    kind: str  # GAUGE, COUNTER or HISTOGRAM
    name: str
    help: str
    labels: tuple[str, ...]


# Every family hangwatch exports. The text prints them sorted by name, not in this order.
FAMILIES: tuple[_Family, ...] = (
    _Family(
        "service_state",
        GAUGE,
        "hangwatch_service_state",
        "Verdict for a service (a watched process and its descendants; pid is its root): "
        "1 for its current state (deadlocked, stalled, idle or progressing), 0 for the "
        "other three.",
        ("service", "pid", "state"),
    ),
    _Family(
        "process_state",
        GAUGE,
        "hangwatch_process_state",
        "Verdict for one process of a service: 1 for its current state (deadlocked, "
        "stalled, idle or progressing), 0 for the other three.",
        (_P, "state"),
    ),
    _Family("threads", GAUGE, "hangwatch_process_threads", "Threads of the process.", (_P,)),
    _Family(
        "parked_threads",
        GAUGE,
        "hangwatch_process_parked_threads",
        "Threads of the process that are parked: blocked and doing no CPU work (timer "
        "wake-ups are not work).",
        (_P,),
    ),
    _Family(
        "parked_seconds",
        GAUGE,
        "hangwatch_process_parked_seconds",
        "How long every thread of the process has been parked (blocked with no CPU work); "
        "0 if any thread works.",
        (_P,),
    ),
    _Family(
        "waiting_at",
        GAUGE,
        "hangwatch_process_waiting_at",
        "Always 1; where the process waits while every thread is parked: the call its main "
        "thread waits in and the line of the program's own code it came from, or its first "
        "native caller. Read once per park; absent while it works, before half the park "
        "threshold, and for a rank's helper processes (DataLoader workers).",
        (_P, "site"),
    ),
    _Family(
        "world_size",
        GAUGE,
        "hangwatch_process_world_size",
        "The process's world size as a number (its world_size label: WORLD_SIZE, else the MPI "
        "launcher's): how many ranks its job should have, for rules that look for missing ones.",
        (_P,),
    ),
    _Family(
        "lock_cycles",
        GAUGE,
        "hangwatch_process_lock_cycles",
        "Lock cycles (each thread waits for a lock the next one holds), stable across two "
        "reads, that include threads of this process; above 0 means deadlocked.",
        (_P,),
    ),
    _Family(
        "no_waker",
        GAUGE,
        "hangwatch_process_no_waker",
        "1 when no thread of the process can be woken but by a signal (every thread in an "
        "untimed wait on a process-private futex, none woken across two reads): deadlocked "
        "with no lock cycle to show.",
        (_P,),
    ),
    _Family(
        "futex_wait",
        HISTOGRAM,
        "hangwatch_futex_wait_seconds",
        "How long the process's futex waits (lock, condition variable, barrier) lasted, "
        "counted when each wait ended, since the process was watched; a wait still going "
        "on is not counted. _sum is approximate: from log2 buckets, each wait counted at "
        "the middle of its power-of-2 interval.",
        (_P,),
    ),
    _Family(
        "write_bytes",
        COUNTER,
        "hangwatch_process_write_bytes",
        "Bytes the process wrote (files, pipes, sockets) since it was watched.",
        (_P,),
    ),
    _Family(
        "last_write_age",
        GAUGE,
        "hangwatch_process_last_write_age_seconds",
        "Seconds since the process last wrote anything (a log line, a response); absent "
        "until a write is seen.",
        (_P,),
    ),
    _Family(
        "accepts",
        COUNTER,
        "hangwatch_process_accepts",
        "Connections the process accepted since it was watched.",
        (_P,),
    ),
    _Family(
        "bpf_entries_refused",
        COUNTER,
        "hangwatch_process_bpf_entries_refused",
        "Threads, written fds and lock refusals of the process the BPF programs did not "
        "keep because it held its share of a map every process shares: its own evidence "
        "is incomplete, no other's. Absent while 0.",
        (_P,),
    ),
    _Family(
        "bpf_events_dropped",
        COUNTER,
        "hangwatch_process_bpf_events_dropped",
        "Long-wait and deadlock-refusal events of the process not sent: over its rate "
        "(256 a second) or the ring buffer full. Absent while 0.",
        (_P,),
    ),
    _Family(
        "listening_ports",
        GAUGE,
        "hangwatch_process_listening_ports",
        "TCP ports the process listens on.",
        (_P,),
    ),
    _Family(
        "gpu_memory",
        GAUGE,
        "hangwatch_process_gpu_memory_bytes",
        "GPU memory the process holds on each GPU (gpu is the device index).",
        (_P, "gpu"),
    ),
    _Family(
        "process_gpu_utilization",
        GAUGE,
        "hangwatch_process_gpu_utilization_ratio",
        "Share of the GPU's SMs (0 to 1) the process kept busy since the last read, from "
        "NVML's per-process samples; 0 when the driver has no sample for it.",
        (_P, "gpu"),
    ),
    _Family(
        "gpu_utilization",
        GAUGE,
        "hangwatch_gpu_utilization_ratio",
        "Fraction of the last sample period (0 to 1) in which the GPU ran a kernel, from NVML.",
        ("gpu",),
    ),
    _Family(
        "gpu_memory_used",
        GAUGE,
        "hangwatch_gpu_memory_used_bytes",
        "GPU memory in use on the device, all processes together, from NVML.",
        ("gpu",),
    ),
    _Family(
        "gpu_memory_total",
        GAUGE,
        "hangwatch_gpu_memory_total_bytes",
        "GPU memory on the device, from NVML.",
        ("gpu",),
    ),
    _Family(
        "gpu_info",
        GAUGE,
        "hangwatch_gpu_info",
        "Always 1; names each GPU index: its UUID and model.",
        ("gpu", "uuid", "name"),
    ),
    _Family(
        "gpu_errors",
        COUNTER,
        "hangwatch_gpu_errors",
        "NVML calls that failed since the agent started (a lost GPU, a driver reload); "
        "the GPU collector backs off and retries, and no verdict uses a failed read.",
        (),
    ),
    _Family(
        "gpu_spin",
        GAUGE,
        "hangwatch_service_gpu_spin",
        "1 when the service is stalled with its GPUs at high utilisation while every host "
        "thread is parked past the threshold (a collective spinning on the GPU), else 0.",
        ("service", "pid"),
    ),
    _Family(
        "unanswered_requests",
        GAUGE,
        "hangwatch_service_unanswered_requests",
        "Requests on the service's front doors (accepted connections) waiting for an "
        "answer, as its verdict saw them while every thread was parked; 0 while it works.",
        ("service", "pid"),
    ),
    _Family(
        "seconds_since_progress",
        GAUGE,
        "hangwatch_service_seconds_since_progress",
        "Seconds without progress its verdict used: how long every thread has been parked, "
        "or the age of its oldest unanswered request if longer; 0 while it works.",
        ("service", "pid"),
    ),
    _Family(
        "events_dropped",
        COUNTER,
        "hangwatch_bpf_events_dropped",
        "Events the BPF programs could not send to the agent because the ring buffer was "
        "full; above 0 means some long waits or deadlock refusals were missed.",
        (),
    ),
    _Family(
        "host_events_dropped",
        COUNTER,
        "hangwatch_bpf_host_events_dropped",
        "Bind and listen events of any process lost because their ring buffer was full "
        "(the futex events of watched processes have their own).",
        (),
    ),
    _Family(
        "maps_full",
        COUNTER,
        "hangwatch_bpf_map_full",
        "Updates refused because a BPF map was full (in-flight waits, wait histograms, "
        "refusals); above 0 means some waits were not seen or not counted.",
        (),
    ),
    _Family(
        "program_seconds",
        COUNTER,
        "hangwatch_bpf_program_run_seconds",
        "CPU time spent in each of hangwatch's BPF programs (counted only while sysctl "
        "kernel.bpf_stats_enabled is 1).",
        ("program",),
    ),
    _Family(
        "program_runs",
        COUNTER,
        "hangwatch_bpf_program_runs",
        "Times each of hangwatch's BPF programs ran (counted only while sysctl "
        "kernel.bpf_stats_enabled is 1).",
        ("program",),
    ),
    _Family(
        "services_excess",
        GAUGE,
        "hangwatch_services_excess",
        "Services a target (service is its name) selects beyond its max_services or the "
        "global max_services: not watched, only counted here. The processes kept are the "
        "ones started outside users' sessions, then the oldest.",
        ("service",),
    ),
    _Family(
        "collector_success",
        GAUGE,
        "hangwatch_collector_success",
        "1 if the agent's collector succeeded on its last run, 0 if it failed (its "
        f'metrics may be missing or stale). collector="{EXPOSITION}" is this scrape reading '
        "the agent's latest results.",
        ("collector",),
    ),
    _Family(
        "last_tick",
        GAUGE,
        "hangwatch_last_tick_timestamp_seconds",
        "Unix time at which the agent last completed a tick (discovery, sampling, verdicts). "
        "Verdicts older than a few intervals are stale: the agent's loop is stuck.",
        (),
    ),
    _Family(
        "park_threshold",
        GAUGE,
        "hangwatch_park_threshold_seconds",
        "The park threshold the agent judges by (park_threshold_seconds): a service parked "
        "this long without progress, and not idle, is stalled. The job rules compare ranks' "
        "parks with it.",
        (),
    ),
    _Family(
        "collector_duration",
        GAUGE,
        "hangwatch_collector_duration_seconds",
        "How long the agent's collector took on its last run, in seconds.",
        ("collector",),
    ),
    _Family(
        "tick_errors",
        COUNTER,
        "hangwatch_tick_errors",
        "Ticks of the agent's loop that failed with an unexpected error (logged, its "
        "traceback at most once a minute); the loop goes on, and the verdicts exported are "
        "those of the last tick that completed.",
        (),
    ),
    _Family(
        "http_dropped",
        COUNTER,
        "hangwatch_http_connections_dropped",
        'Connections to /metrics the agent ended without an answer: reason="deadline" '
        '(not done within 10 s), "evicted" (still sending its request when 256 were open), '
        '"full" (refused: 256 were open, each with its request sent).',
        ("reason",),
    ),
    _Family(
        "build_info",
        GAUGE,
        "hangwatch_build_info",
        "Always 1; the version and commit labels say which hangwatch is running (commit: the "
        'git commit it was built from, "unknown" if that was not recorded).',
        ("version", "commit"),
    ),
)


def _label_names(spec: Sequence[str], extra: Sequence[str]) -> list[str]:
    return [n for s in spec for n in ((*_PROCESS_LABELS, *extra) if s == _P else (s,))]


class _Families:
    """One scrape's families, with one fixed set of process label names, by ``FAMILIES`` key
    and kind (typed apart, since each kind's ``add_metric`` takes different values)."""

    def __init__(self, extra_labels: Sequence[str] = ()) -> None:
        self.extra = tuple(extra_labels)
        self.gauge: dict[str, GaugeMetricFamily] = {}
        self.counter: dict[str, CounterMetricFamily] = {}
        self.histogram: dict[str, HistogramMetricFamily] = {}
        for f in FAMILIES:
            labels = _label_names(f.labels, self.extra)
            if f.kind == GAUGE:
                self.gauge[f.key] = GaugeMetricFamily(f.name, f.help, labels=labels)
            elif f.kind == COUNTER:
                self.counter[f.key] = CounterMetricFamily(f.name, f.help, labels=labels)
            else:
                self.histogram[f.key] = HistogramMetricFamily(f.name, f.help, labels=labels)

    def all(self) -> list[Metric]:
        # Sorted by name, as Go exporters print them: easy to find one in a golden file.
        fams: list[Metric] = [*self.gauge.values(), *self.counter.values()]
        fams += self.histogram.values()
        return sorted(fams, key=lambda m: m.name)

    def populated(self) -> list[Metric]:
        # An empty family would print HELP and TYPE with no sample: noise, so leave it out.
        return [m for m in self.all() if m.samples]

    def add_service(self, svc: ServiceStatus, unknown_state: Callable[[str], None]) -> None:
        if svc.state not in STATES:
            unknown_state(svc.state)
        g, lv = self.gauge, [svc.service, str(svc.pid)]
        for state in STATES:
            g["service_state"].add_metric([*lv, state], 1.0 if svc.state == state else 0.0)
        g["gpu_spin"].add_metric(lv, 1.0 if svc.gpu_spin else 0.0)
        g["unanswered_requests"].add_metric(lv, svc.unanswered_requests)
        g["seconds_since_progress"].add_metric(lv, svc.seconds_since_progress)

    def add_process(
        self, svc: ServiceStatus, p: ProcessStatus, unknown_state: Callable[[str], None]
    ) -> None:
        env = {label_name(k): v for k, v in p.labels.items()}
        # The enclosing service's name and root, so process series join its service_state.
        lv = [svc.service, str(svc.pid), str(p.pid), p.comm]
        lv += [env.get(name, "") for name in self.extra]
        if p.state not in STATES:
            unknown_state(p.state)
        for state in STATES:
            self.gauge["process_state"].add_metric([*lv, state], 1.0 if p.state == state else 0.0)
        self.gauge["threads"].add_metric(lv, p.threads)
        self.gauge["parked_threads"].add_metric(lv, p.parked_threads)
        self.gauge["parked_seconds"].add_metric(lv, p.parked_seconds)
        self.gauge["lock_cycles"].add_metric(lv, p.lock_cycles)
        if p.waiting_at is not None:
            self.gauge["waiting_at"].add_metric([*lv, p.waiting_at], 1.0)
        if p.world_size is not None:
            self.gauge["world_size"].add_metric(lv, p.world_size)
        self.gauge["no_waker"].add_metric(lv, 1.0 if p.no_waker else 0.0)
        buckets, sum_s = futex_buckets(p.futex_wait_slots)
        self.histogram["futex_wait"].add_metric(lv, buckets, sum_s)
        if p.write_bytes_total is not None:
            self.counter["write_bytes"].add_metric(lv, p.write_bytes_total)
        if p.last_write_age_seconds is not None:
            self.gauge["last_write_age"].add_metric(lv, p.last_write_age_seconds)
        if p.accepts_total is not None:
            self.counter["accepts"].add_metric(lv, p.accepts_total)
        if p.bpf_entries_refused_total:
            self.counter["bpf_entries_refused"].add_metric(lv, p.bpf_entries_refused_total)
        if p.bpf_events_dropped_total:
            self.counter["bpf_events_dropped"].add_metric(lv, p.bpf_events_dropped_total)
        self.gauge["listening_ports"].add_metric(lv, p.listening_ports)
        for gpu in sorted(p.gpu_memory_bytes, key=_gpu_order):
            self.gauge["gpu_memory"].add_metric([*lv, gpu], p.gpu_memory_bytes[gpu])
        for gpu in sorted(p.gpu_utilization, key=_gpu_order):
            self.gauge["process_gpu_utilization"].add_metric([*lv, gpu], p.gpu_utilization[gpu])

    def add_agent(self, agent: AgentStatus) -> None:
        self.counter["events_dropped"].add_metric([], agent.events_dropped_total)
        self.counter["host_events_dropped"].add_metric([], agent.host_events_dropped_total)
        self.counter["maps_full"].add_metric([], agent.maps_full_total)
        self.gauge["last_tick"].add_metric([], agent.last_tick_seconds)
        self.counter["tick_errors"].add_metric([], agent.tick_errors_total)
        for reason in sorted(agent.http_connections_dropped):
            n = agent.http_connections_dropped[reason]
            self.counter["http_dropped"].add_metric([reason], n)
        for name in sorted(agent.services_excess):
            self.gauge["services_excess"].add_metric([name], agent.services_excess[name])
        if agent.park_threshold_seconds is not None:
            self.gauge["park_threshold"].add_metric([], agent.park_threshold_seconds)
        for name in sorted(agent.programs):
            stats = agent.programs[name]
            self.counter["program_seconds"].add_metric([name], stats.run_seconds)
            self.counter["program_runs"].add_metric([name], stats.run_count)
        for name in sorted(agent.collectors):
            if name == EXPOSITION:
                continue  # ours, added by the collector; a second sample would be a duplicate
            c = agent.collectors[name]
            self.add_collector(name, c.success, c.duration_seconds)
        for d in sorted(agent.gpus, key=lambda d: d.index):
            gpu = str(d.index)
            self.gauge["gpu_info"].add_metric([gpu, d.uuid, d.name], 1.0)
            self.gauge["gpu_memory_used"].add_metric([gpu], d.memory_used)
            self.gauge["gpu_memory_total"].add_metric([gpu], d.memory_total)
            if d.utilization is not None:
                self.gauge["gpu_utilization"].add_metric([gpu], d.utilization)
        if agent.gpus or agent.gpu_errors_total:
            self.counter["gpu_errors"].add_metric([], agent.gpu_errors_total)

    def add_collector(self, name: str, success: bool, duration_s: float) -> None:
        self.gauge["collector_success"].add_metric([name], 1.0 if success else 0.0)
        self.gauge["collector_duration"].add_metric([name], duration_s)


def _extra_label_names(exposition: Exposition) -> list[str]:
    names = {label_name(k) for s in exposition.services for p in s.processes for k in p.labels}
    return sorted(names)


def _families_of(exposition: Exposition, unknown_state: Callable[[str], None]) -> _Families:
    fams = _Families(_extra_label_names(exposition))
    seen_services: set[tuple[str, int]] = set()
    seen_processes: set[tuple[str, int, int]] = set()
    for svc in sorted(exposition.services, key=lambda s: (s.service, s.pid)):
        # A repeated series would make Prometheus drop the sample: first one wins.
        if (svc.service, svc.pid) in seen_services:
            continue
        seen_services.add((svc.service, svc.pid))
        fams.add_service(svc, unknown_state)
        for p in sorted(svc.processes, key=lambda p: p.pid):
            if (svc.service, svc.pid, p.pid) in seen_processes:
                continue
            seen_processes.add((svc.service, svc.pid, p.pid))
            fams.add_process(svc, p, unknown_state)
    fams.add_agent(exposition.agent)
    return fams


class HangwatchCollector(Collector):
    """Turns the daemon's latest exposition into metric families, fresh on every scrape.

    ``source`` returns the latest ``Exposition``, or None before the daemon's first tick
    (then only build info and this collector's own success are exported). A scrape never
    raises: if ``source`` or the conversion fails, the scrape still has build info and
    ``hangwatch_collector_success{collector="exposition"} 0``, and the error is logged once
    until a scrape succeeds again.
    """

    def __init__(
        self,
        source: Callable[[], Exposition | None],
        *,
        commit: str,
        version: str = __version__,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._source = source
        self._version = version
        self._commit = commit  # the command asks git or the stamp; export starts no process
        self._clock = clock  # injectable so a golden /metrics text has a fixed duration
        self._lock = threading.Lock()  # scrapes run on the HTTP server's threads
        self._failing = False
        self._unknown_states: set[str] = set()

    def describe(self) -> list[Metric]:
        # The names without samples: register() checks them for clashes and never calls
        # collect(), which would read the source before the daemon's first tick.
        return _Families().all()

    def collect(self) -> list[Metric]:
        start = self._clock()
        try:
            exposition = self._source()
            fams = (
                _families_of(exposition, self._unknown_state)
                if exposition is not None
                else _Families()
            )
            ok = True
        except Exception:
            fams, ok = _Families(), False  # drop any half-built families
            self._log_failure()
        else:
            self._log_recovery()
        fams.add_collector(EXPOSITION, ok, self._clock() - start)
        fams.gauge["build_info"].add_metric([self._version, self._commit], 1.0)
        return fams.populated()

    def _log_failure(self) -> None:
        with self._lock:
            first, self._failing = not self._failing, True
        if first:
            log.exception("/metrics: cannot export the latest results; serving build info only")

    def _log_recovery(self) -> None:
        with self._lock:
            recovered, self._failing = self._failing, False
        if recovered:
            log.info("/metrics: exporting the latest results again")

    def _unknown_state(self, state: str) -> None:
        with self._lock:
            first = state not in self._unknown_states
            self._unknown_states.add(state)
        if first:
            log.warning("/metrics: unknown state %r exported as 0 for all of %s", state, STATES)


def registry_for(
    source: Callable[[], Exposition | None],
    *,
    commit: str,
    version: str = __version__,
    clock: Callable[[], float] = time.perf_counter,
) -> CollectorRegistry:
    """A fresh registry holding only a ``HangwatchCollector`` (no process_/python_ metrics)."""
    # auto_describe only matters for collectors without describe(); ours has one.
    registry = CollectorRegistry(auto_describe=False)
    registry.register(HangwatchCollector(source, version=version, commit=commit, clock=clock))
    return registry
