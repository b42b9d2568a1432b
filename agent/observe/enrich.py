"""The reads a report makes beyond its snapshot, all in one place: Python stacks, native
callers, what blocked fds wait on, what futex words are.

`diagnose` and the daemon's flight record read through here once per report and hand the
result on as plain data (agent.model.Enrichment): nothing past this step reads /proc. The
stacks are read first (``read_stacks``), since which threads and words matter depends on them,
then what the report asks given them (``read_asked``); agent.explain runs the two in order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..model import Enrichment, ProcessSample, StackRead, Wanted
from ..settings import STACKS_BUDGET_S
from ..sources.procfs import ProcFS
from ..sources.pystacks import SourceLines, read_many
from ..sources.symbols import NativeFrame, caller_outside_libc, describe_address
from .fdwaits import waits_on


def native_frame(proc: ProcFS, pid: int, tid: int) -> NativeFrame | None:
    """The first native caller outside libc, unless it is the Python interpreter itself
    (every Python lock and GIL wait comes from there: the Python stack says more)."""
    frame = caller_outside_libc(pid, tid, proc)
    if frame is None or frame.object.startswith(("python", "libpython")):
        return None
    return frame


def native_caller(proc: ProcFS, pid: int, tid: int) -> str | None:
    """``native_frame`` by its names and offset, as the reports show it."""
    frame = native_frame(proc, pid, tid)
    return str(frame) if frame is not None else None


def read_stacks(
    proc: ProcFS,
    samples: Mapping[int, ProcessSample],
    pids: Sequence[int],
    budget_s: float = STACKS_BUDGET_S,
    source: SourceLines | None = None,
) -> dict[int, StackRead]:
    """The Python stacks of ``pids``, within ``budget_s``; ``samples``: the snapshot's
    processes by pid (a PID reused since is not read for its verdict)."""
    starts = {pid: s.start_ticks for pid, s in samples.items()}
    return read_many(pids, budget_s, proc, source, starts) if pids else {}


def read_asked(
    proc: ProcFS,
    samples: Mapping[int, ProcessSample],
    stacks: Mapping[int, StackRead],
    asks: Wanted,
) -> Enrichment:
    """What a report asks for beyond the stacks: native callers, lock words, fd waits (only
    of processes in ``samples``: one gone since has no fds to ask about)."""
    natives: dict[tuple[int, int], str] = {}
    for pid, tid in asks.natives:
        caller = native_caller(proc, pid, tid)
        if caller:
            natives[(pid, tid)] = caller
    words = {(pid, addr): describe_address(pid, addr, proc) for pid, addr in asks.words}
    fds = waits_on(proc, (samples[pid] for pid in asks.fds if pid in samples))
    return Enrichment(dict(stacks), natives, fds, words)
