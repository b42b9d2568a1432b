"""agent.report.text and agent.observe.enrich: the report is written from data read once, before
it renders; what is read is what the report asks for. Pure: synthetic snapshots, stand-in reads."""

from __future__ import annotations

import os
import time
from dataclasses import replace

import pytest

from agent.analysis import evidence as ev
from agent.analysis.verdict import ProcessVerdict, ServiceVerdict
from agent.analysis.waitgraph import WaitForGraph
from agent.explain import explain
from agent.model import (
    Enrichment,
    FdLink,
    FdWait,
    PyFrame,
    PyThread,
    SocketPeer,
    StackRead,
    ThreadSample,
    Wanted,
)
from agent.observe import enrich
from agent.report import as_json, text
from agent.report.diagnosis import Report
from agent.sources.procfs import ProcFS
from tests.synth import S, on_mutex, parked, process, running, snapshot

APP = "/srv/app"
LOOP = PyFrame("event_loop", f"{APP}/scheduler.py", "scheduler.py", 212, "item = q.get()")


def untimed(tid: int, uaddr: int, name: str = "worker") -> ThreadSample:
    return replace(parked(tid, uaddr, since=90 * S, name=name), timed=False)


def in_read(tid: int, name: str = "reader") -> ThreadSample:
    return ThreadSample(tid, name, "S", 0, last_ran_ns=S, syscall=0, timed=False)


# A Python process (10): two workers at one line, an owned mutex wait, a reader with no
# Python frames; a native one (20): a pool on one word and a thread in read.
SNAP = snapshot(
    process(
        10,
        untimed(11, 0x1100),
        untimed(12, 0x1200),
        replace(on_mutex(13, 0x1300, 14), timed=False),
        running(14, name="holder"),
        in_read(15),
        comm="python3",
    ),
    process(20, parked(21, 0x2000, name="pool"), parked(22, 0x2000, name="pool"), in_read(23)),
)
STACKS = {10: StackRead(10, {t: PyThread(t, None, False, (LOOP,)) for t in (11, 12, 13, 14)})}
VERDICT = ServiceVerdict(
    10,
    "stalled",
    [ev.AllParked(4, 2, 61.0)],
    [],
    [
        ProcessVerdict(10, "python3", 5, 4, 61.0, "stalled", []),
        ProcessVerdict(20, "proc", 3, 3, 61.0, "stalled", []),
        ProcessVerdict(30, "gone", 0, 0, 0.0, "stalled", [], gone=True),
    ],
)


def report(inputs: Enrichment | None = None) -> Report:
    graph = WaitForGraph(SNAP)
    return Report([VERDICT], SNAP, graph, {}, None, [], 60.0, 5.0, 5.2, {}, inputs or Enrichment())


def test_the_text_asks_for_what_it_shows() -> None:
    asks = text.wanted(report(), STACKS)
    # Threads of a group in futex (a few of each), and the futex waits nothing else shows.
    assert sorted(asks.natives) == [(10, 11), (10, 12), (10, 13)]
    # The Python process's words only where they name an owner; all the native process's.
    assert sorted(asks.words) == [(10, 0x1300), (20, 0x2000)]
    assert sorted(asks.fds) == [10, 20]


def test_the_text_is_written_from_what_was_read() -> None:
    inputs = Enrichment(
        STACKS,
        natives={(10, 11): "`wait_a` in liba.so+0x10", (10, 12): "`wait_a` in liba.so+0x10"},
        fds={
            (10, 15): FdWait((FdLink(3, "a pipe (fd 3)"),)),
            (20, 23): FdWait((FdLink(7, "a socket (fd 7)", SocketPeer("tcp", 5000, "10.0.0.2")),)),
        },
        words={(20, 0x2000): "the heap"},
    )
    lines = text.render_text(report(inputs)).splitlines()
    at = time.strftime("%H:%M:%S", time.localtime(SNAP.wall))
    assert lines[0] == f"hangwatch diagnose: 1 service, threshold 60 s, observed 5 s, at {at}"
    assert "(native: `wait_a` in liba.so+0x10)" in next(x for x in lines if "3 threads at" in x)
    assert "    1 thread in read with no timeout on a pipe (fd 3): 15 (reader)" in lines
    assert any(
        x.startswith("    2 threads parked on one word 0x2000 (the heap) (WAIT), no owner")
        for x in lines
    )
    assert (
        "    1 thread in read with no timeout on a socket to 10.0.0.2:5000 (fd 7): 23 (reader)"
        in lines
    )
    assert "  process 30: exited while watched" in lines


def test_the_json_asks_only_for_the_names_of_cycle_words() -> None:
    link = ev.CycleLink(13, "w", "mutex", 0x1300, 14)
    v = replace(VERDICT, reasons=[ev.LockCycle((link,))])
    assert as_json.wanted(replace(report(), verdicts=[v])) == Wanted(words={(10, 0x1300)})


def test_explain_reads_the_stacks_then_what_is_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    order: list[object] = []

    def read_many(pids, budget_s, proc, source=None, starts=None):
        order.append(("stacks", list(pids), budget_s))
        return {p: STACKS[p] for p in pids if p in STACKS}

    def wanted(stacks):
        order.append(("asked", sorted(stacks)))
        return Wanted(natives=[(10, 11), (10, 12)], words=[(20, 0x2000)], fds=[10, 99])

    monkeypatch.setattr(enrich, "read_many", read_many)
    monkeypatch.setattr(
        enrich, "native_caller", lambda proc, pid, tid: "`f` in a.so+0x1" if tid == 11 else None
    )
    monkeypatch.setattr(enrich, "describe_address", lambda pid, addr, proc=None: "the heap")
    monkeypatch.setattr(
        enrich, "waits_on", lambda proc, samples: {(s.pid, 0): FdWait(()) for s in samples}
    )
    got = explain(ProcFS(os.devnull), SNAP, [], [10, 20], wanted, 2.0).inputs
    assert order == [("stacks", [10, 20], 2.0), ("asked", [10])]
    assert got.natives == {(10, 11): "`f` in a.so+0x1"}  # a thread with no answer is left out
    assert got.words == {(20, 0x2000): "the heap"}
    assert set(got.fds) == {(10, 0)}  # a process no longer in the snapshot is not asked


def test_explain_with_no_stacks_to_read_reads_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(enrich, "read_many", lambda *a: pytest.fail("read"))
    got = explain(ProcFS(os.devnull), SNAP, [], [], lambda stacks: Wanted()).inputs
    assert got == Enrichment()
