"""What one judgement reads, as plain data: the ticks of a window and the reads asked for it.

The observer builds these; ``agent.analysis.judge`` takes them and touches nothing else, so
a verdict is a function of its inputs and a test can hand it any window it likes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ..model import GpuReading, ProbeReading, Snapshot, WrittenFd
from .frontdoor import FrontDoors
from .gpu import GpuHistory
from .progress import ParkSettings, ParkTracker
from .waitgraph import WaitForGraph


@dataclass(frozen=True)
class Tick:
    """One observation: the snapshot, its wait-for graph, and what the probe and NVML read."""

    snapshot: Snapshot
    graph: WaitForGraph
    cycles: tuple[tuple[int, ...], ...]  # stable: seen with the same edges in the previous tick
    reading: ProbeReading
    gpu: GpuReading | None = None  # None: no GPU source
    no_waker: frozenset[int] = frozenset()  # processes no thread can wake (agent.analysis.nowaker)
    # pid -> inodes of its sockets whose streamed answer is unfinished (agent.analysis.answers)
    streams: Mapping[int, frozenset[int]] = field(default_factory=dict)
    # root -> its service's listeners, front doors or not (agent.analysis.frontdoor)
    doors: Mapping[int, FrontDoors] = field(default_factory=dict)


@dataclass(frozen=True)
class Window:
    """The latest tick against the first of the window, and what the observer carries across
    ticks that a verdict reads. The trackers are read, never updated, by the judgement."""

    latest: Tick
    old: Tick
    members: Mapping[int, Sequence[int]]  # root -> its service's pids, root first
    seen: Mapping[int, frozenset[int]]  # root -> every pid ever in it (diagnose keeps the gone)
    fd_names: Mapping[tuple[int, int], str]  # (pid, fd) -> /proc/PID/fd link when last written
    demand_ns: Mapping[int, int]  # root -> when work last waited at its front doors
    # (pid, start ticks) -> fd links it wrote heartbeats to: their mtimes date no work
    heartbeat_files: Mapping[tuple[int, int], frozenset[str]]
    listen_since: Mapping[tuple[int, int], int]  # (pid, port) -> CLOCK_MONOTONIC of its listen
    parks: ParkTracker
    gpu: GpuHistory
    probed: bool  # a probe counted writes and accepts (False: /proc alone)


@dataclass(frozen=True)
class ServiceReads:
    """Reads of one service made for a judgement beyond its snapshots. None: not read (the
    judgement did not need it)."""

    pipes_read: frozenset[int] | None = None  # inodes of pipes its processes read
    written: Mapping[int, tuple[WrittenFd, ...]] | None = None  # pid -> fds open for writing


@dataclass(frozen=True)
class Rules:
    """The settings a judgement applies."""

    threshold_s: float
    park: ParkSettings
