"""One `diagnose` report as data: what the text (agent.report.text) and the JSON
(agent.report.as_json) are both written from."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ..analysis.verdict import ServiceVerdict
from ..analysis.waitgraph import WaitForGraph
from ..model import Enrichment, GpuReading, ProbeEvent, Snapshot
from .sentences import clock

ISO = "%Y-%m-%dT%H:%M:%S%z"
NO_HISTORY = "no daemon history: requests or streams begun before diagnose attached are not seen"


@dataclass(frozen=True)
class History:
    """Whether a daemon's history of a service was had: the daemon's pid, or why not."""

    daemon_pid: int | None  # None: not had
    socket: str
    why: str | None = None  # no daemon answers, refused, not watched


@dataclass(frozen=True)
class Report:
    """The verdicts and what they were judged on: the last tick's snapshot, wait-for graph,
    probe counters and GPU reading, the probe's events for the services asked about, and
    what was read at report time (``inputs``)."""

    verdicts: Sequence[ServiceVerdict]
    snapshot: Snapshot
    graph: WaitForGraph
    counters: Mapping[str, int]
    gpu: GpuReading | None  # None: no GPU source
    events: Sequence[ProbeEvent]
    threshold_s: float
    duration_s: float
    observed_s: float | None = None  # how long it watched (longer: watched on to the threshold)
    labels: Mapping[int, Mapping[str, str]] = field(default_factory=dict)  # by pid: RANK, ...
    inputs: Enrichment = field(default_factory=Enrichment)
    # root -> whether the daemon's history of it was had (empty: the daemon was not asked)
    history: Mapping[int, History] = field(default_factory=dict)


def since(snap: Snapshot, ns: int | None, fmt: str = "%H:%M:%S") -> str:
    """Wall-clock time of a CLOCK_MONOTONIC instant of this snapshot; '' when not dated."""
    if not ns:
        return ""
    return clock(snap.wall_of(ns), fmt)


def probe_summary(r: Report) -> dict:
    """What the kernel side saw: counters (drops included) and the EDEADLK refusals."""
    return {
        "counters": dict(r.counters),
        "edeadlk": [
            {"tid": e.tid, "pid": e.tgid, "uaddr": hex(e.uaddr)}
            for e in r.events
            if e.kind == "edeadlk"
        ],
        "long_waits": sum(1 for e in r.events if e.kind == "long-wait"),
    }
