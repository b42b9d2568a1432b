"""Progress: did a process do work in the window, and since when is each thread parked.

Progress is work, not wake-ups: a thread that wakes on a timer and parks again uses almost no
CPU, so it stays parked. Each signal is one field of ``ProcessProgress`` (CPU, writes out of
the service, answers, data received or read from storage, GPU), so the classifier has one
place to look. A write is progress unless it is proven a heartbeat: no other work in the
window, and the shape of a status write (small, few calls, to a few named destinations). A
write to a destination that could not be named counts: an unseen answer must never read as
idle (docs/how-it-works.md, "Progress and park time").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..model import ProcessSample, Snapshot, ThreadSample
from . import evidence as ev

NS = 1_000_000_000
# Most a process may write to files in one window, with no other work, and still be taken
# for a heartbeat: a status file rewritten whole is tens of KB; a log line, a few hundred
# bytes. More than this is data, whatever else the process did.
HEARTBEAT_MAX_BYTES = 256 * 1024
# Least a process must read from storage, per second of the window, for the reading to be
# work: a loader reads MBs a second even from network storage, while a config file, a
# tokenizer's vocabulary read once, /etc/hosts or a status file re-read on a timer are KBs.
STORAGE_READ_MIN_BYTES_PER_S = 1 << 20
# Least major faults per second of the window that are loading: each is a wait for a page
# of a mapped file (weights mapped with mmap) to come from storage. Readahead brings up to
# its window (MBs) in one fault, so a mapped load at 20 MB/s may fault only 5 times a
# second; a waiting process touching now and then a page the kernel evicted, less often.
MAJOR_FAULTS_MIN_PER_S = 1
# Most write calls in one window: a status write is a line or a file rewritten now and then;
# a process writing more often than this is logging work.
HEARTBEAT_MAX_CALLS = 64
# Least polls that found nothing, per second of the window, for a thread's CPU to be a spin
# (ProcessProgress.spinning_tids): a thread that waits with a timeout finds nothing once per
# timeout, so a hundred a second is a wait of 10 ms or less, over and over: a loop asking for
# input that is not there, not a timer. An idle poll loop asks thousands of times a second.
SPIN_MIN_EMPTY_POLLS_PER_S = 100
# Most named files in one window: a status writer reports to its own logs (its log file, an
# event log, a copy on stdout or stderr), the same few every time; work that writes files
# (a checkpoint's shards, an export) names more, and writes more.
HEARTBEAT_MAX_FILES = 4


@dataclass(frozen=True)
class ParkSettings:
    """The CPU floor of work: a thread did work in a tick (or a window) when it used more
    CPU than ``cpu_floor_ratio`` of it, and more than ``cpu_floor_min_ns``. The values are
    agent.settings.Settings', where they are explained."""

    cpu_floor_ratio: float
    cpu_floor_min_ns: int

    def floor_ns(self, span_ns: int) -> int:
        return max(self.cpu_floor_min_ns, int(span_ns * self.cpu_floor_ratio))


@dataclass(frozen=True)
class ThreadPark:
    tid: int
    parked: bool
    last_work_ns: int  # CLOCK_MONOTONIC; parked for (now - last_work_ns)


@dataclass(frozen=True)
class ProcessProgress:
    """What one process did between two snapshots."""

    pid: int
    window_ns: int
    cpu_ns: int = 0
    working_tids: tuple[int, ...] = ()  # threads above the CPU floor
    # Of those, the threads whose polls found nothing at least SPIN_MIN_EMPTY_POLLS_PER_S
    # times a second (the probe's count): their CPU went to asking for input that was not
    # there. What it served depends on the service (agent.analysis.classify): with nothing
    # waiting at its front doors, no one.
    spinning_tids: tuple[int, ...] = ()
    spin_cpu_ns: int = 0  # the CPU of the spinning threads in the window
    empty_polls: int = 0  # their polls that found nothing in the window
    # Bytes written to files, terminals and clients outside the service (agent.analysis.outbound);
    # None: not measurable.
    write_bytes: int | None = None
    # Of those, the bytes sent to clients (TCP peers outside the service): answers.
    answered_bytes: int = 0
    # The file written most in the window, as its fd link names it (for a heartbeat's words).
    written_to: str | None = None
    # Of ``logged_bytes``: those whose destination could not be named (the fd closed, or no
    # probe to place them), how many named destinations the rest went to, and in how many
    # calls (None: not counted).
    unplaced_bytes: int = 0
    logged_to: int = 0
    logged_calls: int | None = None
    # Data received from outside the service, not requests at a front door (tcp_info of its
    # other connections: weights streamed from storage, a peer rank on another host).
    received_bytes: int = 0
    # Connections accepted: context, not progress (a connection accepted and never
    # answered serves nobody; an answer is a write to a client).
    accepts: int | None = None
    gpu: ev.GpuActive | None = None  # what its GPUs did, when they were active
    # Read from storage in the window, each at the source that cannot miss its kind: bytes
    # the block layer read for it (/proc/PID/io read_bytes: O_DIRECT, page-cache misses,
    # mapped pages brought in; None: unreadable), bytes its read calls took from regular
    # files (the probe: the page cache, network and FUSE file systems, where no block I/O
    # is done), and its major faults (page-ins of mapped files, block device or not).
    block_read_bytes: int | None = None
    file_read_bytes: int = 0
    major_faults: int = 0

    @property
    def storage_read_bytes(self) -> int:
        """Bytes read from storage in the window: a read that misses the page cache is in
        both counts, so the larger of the two, a lower bound of what was read."""
        return max(self.block_read_bytes or 0, self.file_read_bytes)

    @property
    def read_storage(self) -> bool:
        """Read from storage at a loader's rate in the window (the floors above)."""
        secs = self.window_ns / NS
        return self.storage_read_bytes >= max(
            1, STORAGE_READ_MIN_BYTES_PER_S * secs
        ) or self.major_faults >= max(1, MAJOR_FAULTS_MIN_PER_S * secs)

    @property
    def logged_bytes(self) -> int:
        """What it wrote to files, terminals and pipes out of the service: not to clients."""
        return (self.write_bytes or 0) - self.answered_bytes

    @property
    def computing_tids(self) -> tuple[int, ...]:
        """Threads above the CPU floor that were not seen spinning."""
        spinning = set(self.spinning_tids)
        return tuple(t for t in self.working_tids if t not in spinning)

    @property
    def other_work(self) -> bool:
        """Work of any kind but writes to files, terminals and pipes: what a heartbeat must
        be alone with. Every kind of work the accounting sees belongs here; a spin is not
        work for anyone by itself (a heartbeat beside a poll loop is still a heartbeat)."""
        return bool(
            self.computing_tids
            or self.answered_bytes
            or self.received_bytes
            or self.gpu
            or self.read_storage
        )

    @property
    def heartbeat_shaped(self) -> bool:
        """Its writes look like a status write: small, few, all to a few named logs."""
        return (
            0 < self.logged_bytes <= HEARTBEAT_MAX_BYTES
            and not self.unplaced_bytes
            and 1 <= self.logged_to <= HEARTBEAT_MAX_FILES
            and self.logged_calls is not None
            and self.logged_calls <= HEARTBEAT_MAX_CALLS
        )

    @property
    def heartbeat(self) -> bool:
        """Proven a status write on a timer (see the module docstring), not progress: the
        shape of one, and no other work in the window."""
        return self.heartbeat_shaped and not self.other_work

    @property
    def wrote_out(self) -> bool:
        """Wrote outside the service in the window, heartbeats aside."""
        return bool(self.write_bytes) and not self.heartbeat

    @property
    def host_work(self) -> bool:
        """Work on the host's side: every kind but the GPU's (an answer is a write out)."""
        return bool(self.working_tids or self.wrote_out or self.received_bytes or self.read_storage)

    @property
    def did_work(self) -> bool:
        return self.host_work or bool(self.gpu)

    @property
    def only_spins(self) -> bool:
        """Its only work in the window was the CPU of threads that spun: nothing computed,
        written out, received, read from storage or done on a GPU. Whether that served
        anyone is the service's question (classify: CPU that serves no one)."""
        return bool(self.spinning_tids) and not (
            self.computing_tids
            or self.wrote_out
            or self.received_bytes
            or self.read_storage
            or self.gpu
        )

    def spin(self) -> ev.Spins:
        return ev.Spins(
            len(self.spinning_tids), self.spin_cpu_ns / NS, self.empty_polls, self.window_ns / NS
        )

    def signals(self) -> list[ev.Fact]:
        """The evidence of each progress signal seen."""
        out: list[ev.Fact] = []
        secs = self.window_ns / NS
        if self.working_tids:
            out.append(ev.CpuWork(len(self.working_tids), self.cpu_ns / NS, secs))
        if self.wrote_out:
            out.append(ev.WroteOut(self.write_bytes or 0, secs, self.answered_bytes))
        if self.received_bytes:
            out.append(ev.ReceivedIn(self.received_bytes, secs))
        if self.read_storage:
            block = self.block_read_bytes or 0
            out.append(ev.ReadStorage(block, self.file_read_bytes, self.major_faults, secs))
        if self.accepts:
            out.append(ev.Accepted(self.accepts))
        if self.gpu:
            out.append(self.gpu)
        return out


class ParkTracker:
    """Remembers, per thread, when it last did work, across snapshots.

    A thread did work in a tick when its CPU time grew by more than the floor since the
    previous snapshot, and only then: its state letter never counts. A thread that wakes on
    a timer (a 10 ms epoll loop, a heartbeat) is now and then caught in state R, and a
    debugger or ``py-spy dump`` stopping the process makes every thread run for a moment
    (R, or t while stopped); none of that is work, so none of it resets a park time. A
    thread that wants a CPU and gets none (R on a starved CPU, t under ptrace) is parked.

    A thread first seen has no CPU history. If it is blocked, it is taken to have last
    worked when its current wait began (seen by the probe) or when it last ran
    (se.exec_start), whichever is earlier: a lower bound on how long it has been parked.
    """

    def __init__(self) -> None:
        self._prev: Snapshot | None = None
        # (pid, start) -> tid -> when it last worked, in ns
        self._last_work: dict[tuple[int, int], dict[int, int]] = {}
        self.parks: dict[int, dict[int, ThreadPark]] = {}  # pid -> tid -> park
        # pid -> (its threads parked, when the last of them worked if all are parked)
        self._summary: dict[int, tuple[int, int | None]] = {}

    def update(self, snap: Snapshot, settings: ParkSettings) -> None:
        prev = self._prev
        now = snap.mono_ns
        floor = settings.floor_ns(now - prev.mono_ns if prev else 0)
        seen: dict[tuple[int, int], dict[int, int]] = {}
        old_parks, old_summary = self.parks, self._summary
        self.parks, self._summary = {}, {}
        for p in snap.processes.values():
            old = prev.processes.get(p.pid) if prev else None
            if old is not None and old.start_ticks != p.start_ticks:
                old = None  # the PID was reused
            key = (p.pid, p.start_ticks)
            known = self._last_work.get(key, {})
            summary = old_summary.get(p.pid)
            if (
                old is not None
                and p.threads is old.threads
                and summary is not None
                and summary[1] is not None
                and p.pid in old_parks
            ):
                # The very threads of the last snapshot (the sampler's quiet process: none
                # of them ran), all parked already: their parks stand as they were.
                seen[key] = known
                self.parks[p.pid] = old_parks[p.pid]
                self._summary[p.pid] = summary
                continue
            old_cpu = {t.tid: t.cpu_ns for t in old.threads} if old else {}
            # When the process last worked, as of the previous snapshot (None: new to us).
            quiet_since = max((known[tid] for tid in old_cpu if tid in known), default=None)
            parks = {}
            last_work: dict[int, int] = {}
            for t in p.threads:
                last = known.get(t.tid)
                if t.tid in old_cpu and last is not None:
                    worked = t.cpu_ns - old_cpu[t.tid] > floor
                elif old is not None:
                    # Born since the previous snapshot: all its CPU time was used in this
                    # tick. Starting a thread that then does nothing is no work (a
                    # threading.Timer heartbeat starts one each time), so unless it worked
                    # it has been quiet as long as the rest of its process.
                    worked = t.cpu_ns > floor
                    last = quiet_since if quiet_since is not None else _last_ran(t, now)
                else:
                    # First sight of its process: no CPU history, so it has not been seen
                    # working, whatever its state. A blocked thread has been parked at
                    # least since it last ran. One caught running (R) has no last-ran
                    # time, and it is on or waiting for a CPU now, so now is the only
                    # lower bound that holds: its park time starts at first sight, which
                    # loses nothing (there is no earlier estimate to reset), and a busy
                    # thread shows its CPU by the next tick.
                    worked = False
                    last = _last_ran(t, now)
                if worked:
                    last = now
                last_work[t.tid] = last
                parks[t.tid] = ThreadPark(t.tid, not worked, last)
            seen[key] = last_work
            self.parks[p.pid] = parks
            n = sum(1 for x in parks.values() if x.parked)
            latest = max(last_work.values()) if parks and n == len(parks) else None
            self._summary[p.pid] = (n, latest)
        self._last_work = seen  # forget exited threads: bounded by live threads
        self._prev = snap

    def parked_threads(self, pid: int) -> int:
        """How many of the process's threads are parked."""
        summary = self._summary.get(pid)
        return summary[0] if summary else 0

    def parked_seconds(self, pid: int, now_ns: int) -> float:
        """How long every thread of the process has been parked; 0 if any works."""
        summary = self._summary.get(pid)
        if summary is None or summary[1] is None:
            return 0.0
        return max(0.0, (now_ns - summary[1]) / NS)


def _last_ran(t: ThreadSample, now_ns: int) -> int:
    """When a thread first seen last did anything: since its wait is known to reach back
    (ThreadSample.quiet_since_ns); ``now_ns`` for a running thread, or when that is not
    known."""
    if not t.blocked:
        return now_ns
    since = t.quiet_since_ns
    return now_ns if since is None else min(now_ns, since)


def window_progress(
    old: ProcessSample | None,
    new: ProcessSample,
    window_ns: int,
    settings: ParkSettings,
    accepts: int | None = None,
    gpu: ev.GpuActive | None = None,
    written_out: int | None = None,
    received: int = 0,
    answered: int = 0,
    written_to: str | None = None,
    file_read: int = 0,
    unplaced: int = 0,
    logged_to: int = 0,
    logged_calls: int | None = None,
    empty_polls: Mapping[int, int] | None = None,
) -> ProcessProgress:
    """Progress of one process between two snapshots ``window_ns`` apart. ``accepts`` is
    what the probe counted in the window; ``gpu`` says what the GPU did, if it was active;
    ``written_out`` is what it wrote outside the service in the window, by the probe's
    writes per fd (without a probe: /proc/PID/io, which counts every write), ``answered``
    the part of it sent to clients and ``written_to`` the file written most; ``unplaced``,
    ``logged_to`` and ``logged_calls`` describe the rest (see ProcessProgress);
    ``received`` what it received from outside (see ProcessProgress.received_bytes);
    ``file_read`` what the probe saw it read from regular files in the window;
    ``empty_polls`` the polls that found nothing in the window, per TID (None: not counted)."""
    if old is not None and old.start_ticks != new.start_ticks:
        old = None  # the PID was reused: all of the new process is new
    if old is None:
        # Started within the window: everything it did so far was done in it.
        old = ProcessSample(new.pid, new.ppid, new.comm, new.start_ticks, (), 0)
    floor = settings.floor_ns(window_ns)
    spin_floor = max(1, int(SPIN_MIN_EMPTY_POLLS_PER_S * window_ns / NS))
    polls = empty_polls or {}
    cpu_ns = spin_cpu_ns = spun = 0
    working = []
    spinning = []
    if new.threads is not old.threads:  # the same: the sampler saw none of them run since
        old_cpu = {t.tid: t.cpu_ns for t in old.threads}
        for t in new.threads:
            delta = t.cpu_ns - old_cpu.get(t.tid, 0)  # a new thread's CPU time is all new work
            cpu_ns += max(0, delta)
            if delta > floor:
                working.append(t.tid)
                if polls.get(t.tid, 0) >= spin_floor:
                    spinning.append(t.tid)
                    spin_cpu_ns += delta
                    spun += polls[t.tid]
    written = written_out
    if written is None and old.write_bytes is not None and new.write_bytes is not None:
        written = max(0, new.write_bytes - old.write_bytes)
    # A process started in the window read all its counts in it (old is then empty).
    block_read = _grown(old.read_bytes, new.read_bytes, old.threads)
    faults = _grown(old.major_faults, new.major_faults, old.threads)
    return ProcessProgress(
        pid=new.pid,
        window_ns=window_ns,
        cpu_ns=cpu_ns,
        working_tids=tuple(working),
        spinning_tids=tuple(spinning),
        spin_cpu_ns=spin_cpu_ns,
        empty_polls=spun,
        write_bytes=written,
        received_bytes=received,
        answered_bytes=answered,
        written_to=written_to,
        unplaced_bytes=unplaced,
        logged_to=logged_to,
        logged_calls=logged_calls,
        accepts=accepts,
        gpu=gpu,
        block_read_bytes=block_read,
        file_read_bytes=file_read,
        major_faults=faults or 0,
    )


def _grown(old: int | None, new: int | None, old_threads: tuple[ThreadSample, ...]) -> int | None:
    """How much a process's counter grew in the window: all of it for a process new in the
    window (no threads sampled before), None where either end is unknown."""
    if new is None:
        return None
    if old is None:
        return new if not old_threads else None
    return max(0, new - old)
