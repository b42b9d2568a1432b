"""The judgement driven with plain data: a window of hand-made ticks and the reads made for it.

No process, no /proc: ``judge`` is a function of what it is handed, and these tests hand it
windows the observer would build, then check what it says and what it asks to read.
"""

from __future__ import annotations

import builtins
import os
import socket
from collections.abc import Mapping, Sequence

import pytest

from agent.analysis import evidence as ev
from agent.analysis.frontdoor import FrontDoors
from agent.analysis.gpu import GpuHistory
from agent.analysis.judge import goes_to_pipe, judge, written_targets
from agent.analysis.progress import ParkTracker
from agent.analysis.verdict import DEADLOCKED, PROGRESSING, STALLED
from agent.analysis.waitgraph import WaitForGraph
from agent.analysis.window import Rules, ServiceReads, Tick, Window
from agent.model import FdWrites, ProbeReading, Snapshot, WrittenFd
from agent.observe.observer import park_settings
from agent.settings import Settings
from tests.synth import S, on_mutex, parked, process, snapshot

RULES = Rules(threshold_s=10.0, park=park_settings(Settings()))
PIPE = "pipe:[777]"
LOG = "/var/log/worker.log"


def _tick(snap: Snapshot, reading: ProbeReading, stable: bool = True) -> Tick:
    graph = WaitForGraph(snap)
    cycles = tuple(sorted(graph.cycles())) if stable else ()
    return Tick(snap, graph, cycles, reading, doors={1: FrontDoors()})


def window(
    snaps: Sequence[Snapshot],
    readings: Sequence[ProbeReading] | None = None,
    fd_names: Mapping[tuple[int, int], str] | None = None,
    heartbeats: Mapping[tuple[int, int], frozenset[str]] | None = None,
) -> Window:
    """The window an observer would hand over after ticking over ``snaps`` (one service,
    root 1, with every process of the snapshots)."""
    readings = readings or [ProbeReading() for _ in snaps]
    parks = ParkTracker()
    for snap in snaps:
        parks.update(snap, RULES.park)
    ticks = [_tick(s, r) for s, r in zip(snaps, readings)]
    members = {1: sorted(snaps[-1].processes)}
    return Window(
        latest=ticks[-1],
        old=ticks[0],
        members=members,
        seen={},
        fd_names=fd_names or {},
        demand_ns={},
        heartbeat_files=heartbeats or {},
        listen_since={},
        parks=parks,
        gpu=GpuHistory(),
        probed=True,
    )


def _parked_for(seconds: int) -> list[Snapshot]:
    """One process, every thread parked since t=0, seen at the start and ``seconds`` later."""
    proc = process(1, parked(1, since=1), parked(2, since=1))
    return [snapshot(proc, at=S), snapshot(proc, at=(1 + seconds) * S)]


def test_a_lock_cycle_is_deadlocked_from_the_window_alone() -> None:
    a = on_mutex(11, 0x10, owner=12)
    b = on_mutex(12, 0x20, owner=11)
    snaps = [snapshot(process(1, a, b), at=S), snapshot(process(1, a, b), at=3 * S)]
    j = judge(window(snaps), {}, RULES)
    assert j.verdicts[1].state == DEADLOCKED
    assert j.to_date == frozenset()  # proven: no time to date


def test_a_verdict_on_time_asks_for_its_dating_read_and_takes_it() -> None:
    w = window(_parked_for(30))
    first = judge(w, {}, RULES)
    assert first.verdicts[1].state == STALLED
    assert first.to_date == {1}
    assert not any(isinstance(r, ev.LastProgress) for r in first.verdicts[1].reasons)

    wall = w.latest.snapshot.wall
    written = {1: (WrittenFd(3, LOG, wall - 300.0),)}
    dated = judge(w, {1: ServiceReads(written=written)}, RULES, first.to_date)
    assert dated.to_date == frozenset()
    (last,) = [r for r in dated.verdicts[1].reasons if isinstance(r, ev.LastProgress)]
    assert (last.what, last.target, last.pid) == ("write", LOG, 1)
    assert last.age_s == pytest.approx(300.0)


def test_a_heartbeat_file_dates_nothing() -> None:
    w = window(_parked_for(30), heartbeats={(1, 100): frozenset({LOG})})
    wall = w.latest.snapshot.wall
    written = {1: (WrittenFd(3, LOG, wall - 1.0),)}
    dated = judge(w, {1: ServiceReads(written=written)}, RULES)
    assert not any(isinstance(r, ev.LastProgress) for r in dated.verdicts[1].reasons)


def _writing_to_pipe() -> Window:
    """A parked process that wrote 4 KiB to a pipe in the window."""
    snaps = _parked_for(30)
    w0 = FdWrites(fd=5, bytes=100, calls=1, last_ns=snaps[0].mono_ns)
    w1 = FdWrites(fd=5, bytes=4196, calls=2, last_ns=snaps[1].mono_ns - S)
    readings = [ProbeReading(writes={1: {5: w0}}), ProbeReading(writes={1: {5: w1}})]
    return window(snaps, readings, fd_names={(1, 5): PIPE})


def test_where_a_pipe_write_goes_is_decided_by_the_pipes_read_handed_in() -> None:
    w = _writing_to_pipe()
    assert goes_to_pipe(written_targets(w, 1))  # the observer reads pipes for this service
    # Nobody in the service reads the pipe: the write left it. One small write by a parked
    # process is a heartbeat, returned so that its file never dates progress.
    out = judge(w, {1: ServiceReads(pipes_read=frozenset())}, RULES)
    assert any(isinstance(r, ev.Heartbeat) for r in out.verdicts[1].reasons)
    assert out.heartbeats == {(1, 100): frozenset({PIPE})}
    # Its own process reads the pipe: the write stayed inside, and told nothing.
    inside = judge(w, {1: ServiceReads(pipes_read=frozenset({777}))}, RULES)
    assert not any(isinstance(r, ev.Heartbeat) for r in inside.verdicts[1].reasons)
    assert inside.heartbeats == {}
    assert inside.verdicts[1].state == STALLED


def test_a_write_that_leaves_in_volume_is_progress() -> None:
    snaps = _parked_for(30)
    w0 = FdWrites(fd=5, bytes=0, calls=0, last_ns=snaps[0].mono_ns)
    w1 = FdWrites(fd=5, bytes=50_000_000, calls=20_000, last_ns=snaps[1].mono_ns - S)
    readings = [ProbeReading(writes={1: {5: w0}}), ProbeReading(writes={1: {5: w1}})]
    w = window(snaps, readings, fd_names={(1, 5): "/data/out.bin"})
    assert judge(w, {}, RULES).verdicts[1].state == PROGRESSING


def test_nothing_goes_to_a_pipe_without_a_pipe_link() -> None:
    assert not goes_to_pipe([LOG, "socket:[5]", None])
    assert goes_to_pipe([LOG, PIPE])


def test_the_judgement_reads_nothing_from_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every way of reading the host raises while it judges; its answers do not change."""
    w = _writing_to_pipe()
    reads = {1: ServiceReads(pipes_read=frozenset({777}), written={1: ()})}
    expected = judge(w, reads, RULES)

    def refuse(*_a: object, **_k: object) -> None:
        raise AssertionError("the judgement read the host")

    for mod, name in [
        (builtins, "open"),
        (os, "open"),
        (os, "listdir"),
        (os, "scandir"),
        (os, "readlink"),
        (os, "stat"),
        (socket, "socket"),
    ]:
        monkeypatch.setattr(mod, name, refuse)
    again = judge(w, reads, RULES)
    monkeypatch.undo()
    assert [(v.state, v.reasons) for v in again.verdicts.values()] == [
        (v.state, v.reasons) for v in expected.verdicts.values()
    ]


def test_only_the_roots_asked_are_judged() -> None:
    w = window(_parked_for(30))
    assert set(judge(w, {}, RULES, roots=[]).verdicts) == set()
    assert set(judge(w, {}, RULES).verdicts) == {1}
