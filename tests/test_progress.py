"""Park times and progress: work, not wake-ups."""

from __future__ import annotations

from dataclasses import replace

from agent.analysis import evidence as ev
from agent.analysis.evidence import ReadStorage
from agent.analysis.progress import (
    HEARTBEAT_MAX_BYTES,
    HEARTBEAT_MAX_CALLS,
    HEARTBEAT_MAX_FILES,
    ParkSettings,
    ParkTracker,
    ProcessProgress,
    window_progress,
)
from agent.model import FutexWait, ProcessSample, Snapshot, ThreadSample
from agent.observe.observer import park_settings
from agent.report.sentences import render
from agent.settings import Settings
from tests.synth import S, parked, process, running

MS = 1_000_000

PARK = park_settings(Settings())  # the floor the observer judges work by


def snap_at(t_s: float, *procs) -> Snapshot:
    return Snapshot(int(t_s * S), 1e9 + t_s, {p.pid: p for p in procs})


def test_timer_wakeups_keep_a_thread_parked_and_its_park_time_grows():
    tracker = ParkTracker()
    # A poll loop: last ran 0.2 s before first sight, then 50 us of CPU every second.
    for i in range(10):
        t = parked(11, cpu=i * 50_000, since=int((i + 99.8) * S))
        tracker.update(snap_at(100 + i, process(10, t)), PARK)
    assert tracker.parks[10][11].parked
    assert 9 < tracker.parked_seconds(10, int(109 * S)) < 10


def test_work_resets_park_time_and_a_thread_using_cpu_is_not_parked():
    tracker = ParkTracker()
    tracker.update(snap_at(100, process(10, parked(11, cpu=0, since=50 * S))), PARK)
    assert tracker.parked_seconds(10, 100 * S) == 50
    tracker.update(snap_at(101, process(10, parked(11, cpu=500 * MS, since=100 * S))), PARK)
    assert not tracker.parks[10][11].parked
    assert tracker.parked_seconds(10, 101 * S) == 0
    tracker.update(snap_at(103, process(10, parked(11, cpu=500 * MS, since=101 * S))), PARK)
    assert tracker.parked_seconds(10, 103 * S) == 2
    # A thread born in this tick that used CPU above the floor worked.
    tracker.update(
        snap_at(104, process(10, parked(11, cpu=500 * MS), running(12, cpu=80 * MS))), PARK
    )
    assert not tracker.parks[10][12].parked
    assert tracker.parked_seconds(10, 104 * S) == 0


def timer_thread(tid: int, cpu: int, caught_running: bool, last_ran: int) -> ThreadSample:
    """A thread that wakes on a 10 ms timer: now and then a read catches it in state R."""
    if caught_running:
        return running(tid, cpu=cpu, name="tcp_loop")
    return ThreadSample(tid, "tcp_loop", "S", cpu, last_ran_ns=last_ran, syscall=232)


def test_a_timer_thread_caught_running_stays_parked_and_its_park_time_grows():
    tracker = ParkTracker()
    seen = []
    for i in range(60):
        now = 100 + i
        timer = timer_thread(12, i * MS, caught_running=i % 2 == 1, last_ran=int((now - 0.005) * S))
        tracker.update(snap_at(now, process(10, parked(11, since=10 * S), timer)), PARK)
        parks = tracker.parks[10]
        assert parks[11].parked and parks[12].parked, f"tick {i}: {parks}"
        seen.append(tracker.parked_seconds(10, int(now * S)))
    assert all(b > a for a, b in zip(seen[1:], seen[2:])), seen
    assert seen[-1] > 59  # from the timer thread's first sight (it last ran 5 ms before)


def test_a_thread_using_80ms_per_tick_is_working_whether_seen_running_or_not():
    """8% of a CPU: above the floor (5% of the tick), whatever state a read catches."""
    tracker = ParkTracker()
    for i in range(10):
        busy = timer_thread(12, i * 80 * MS, caught_running=i % 3 == 0, last_ran=(100 + i) * S)
        tracker.update(snap_at(100 + i, process(10, parked(11, since=10 * S), busy)), PARK)
        if i:
            assert not tracker.parks[10][12].parked
            assert tracker.parked_seconds(10, (100 + i) * S) == 0
    assert tracker.parks[10][11].parked


def test_a_short_tick_keeps_its_floor():
    # The daemon may tick every 0.1 s: 1 ms of CPU per tick is still a wake-up.
    tracker = ParkTracker()
    for i in range(20):
        now = 100 + i / 10
        timer = timer_thread(12, i * MS, caught_running=True, last_ran=0)
        tracker.update(snap_at(now, process(10, timer)), PARK)
        assert tracker.parks[10][12].parked
    assert abs(tracker.parked_seconds(10, int(101.9 * S)) - 1.9) < 1e-6


def test_a_half_second_tick_leaves_out_the_bursts_a_one_second_tick_does():
    """Real Ray, idle: the dashboard agent's event loop runs 17-28 ms every 10 s. Diagnose
    reads every 0.5 s: a burst that the default 1 s tick's floor (50 ms) leaves out is no
    work in a shorter tick either, and a thread at 20% of a CPU still is."""
    for tick_s in (0.5, 1.0):
        tracker = ParkTracker()
        cpu, t = 0, 100.0
        for i in range(int(20 / tick_s)):
            t += tick_s
            cpu += 28 * MS if i % int(10 / tick_s) == 3 else 0
            loop = timer_thread(12, cpu, caught_running=False, last_ran=int(t * S))
            tracker.update(snap_at(t, process(10, parked(11, since=10 * S), loop)), PARK)
            assert tracker.parks[10][12].parked, f"a {tick_s} s tick, tick {i}"
        busy = replace(loop, cpu_ns=cpu + int(0.2 * tick_s * S))
        tracker.update(snap_at(t + tick_s, process(10, parked(11, since=10 * S), busy)), PARK)
        assert not tracker.parks[10][12].parked


def test_a_ptrace_stopped_process_keeps_growing_its_park_time():
    """A debugger or ``py-spy dump`` stops every thread (state t) and lets it go: they run
    for a moment, show R or t, and use next to no CPU. None of that is work."""
    tracker = ParkTracker()
    seen = []
    for i in range(20):
        now = 100 + i
        state = "t" if 5 <= i < 8 else ("R" if i == 8 else "S")
        cpu = i * 100_000 if i < 9 else 900_000
        threads = [
            replace(parked(tid, cpu=cpu, since=int(70 * S)), state=state) for tid in (11, 12, 13)
        ]
        tracker.update(snap_at(now, process(10, *threads)), PARK)
        assert all(x.parked for x in tracker.parks[10].values()), f"tick {i}"
        seen.append(tracker.parked_seconds(10, now * S))
    assert seen == [30 + i for i in range(20)]


def test_a_thread_stopped_under_ptrace_at_first_sight_keeps_its_wait_age():
    # Stopping it made it run (exec_start 10 ms ago), but the probe saw its wait begin.
    t = ThreadSample(
        11, "w", "t", 0, last_ran_ns=int(99.99 * S), wait=FutexWait(0x1000, 0, 0, since_ns=40 * S)
    )
    tracker = ParkTracker()
    tracker.update(snap_at(100, process(10, t)), PARK)
    assert tracker.parked_seconds(10, 100 * S) == 60


def test_one_burst_resets_the_park_time_and_it_grows_again():
    tracker = ParkTracker()
    cpu = 0
    seen = []
    for i in range(10):
        cpu += 80 * MS if i == 4 else 200_000
        tracker.update(snap_at(100 + i, process(10, parked(11, cpu=cpu, since=90 * S))), PARK)
        assert tracker.parks[10][11].parked == (i != 4)
        seen.append(tracker.parked_seconds(10, (100 + i) * S))
    assert seen == [10, 11, 12, 13, 0, 1, 2, 3, 4, 5]


def test_a_thread_running_at_first_sight_is_not_working_until_it_uses_cpu():
    tracker = ParkTracker()
    tracker.update(snap_at(100, process(10, running(11, cpu=5 * S))), PARK)
    assert tracker.parks[10][11].parked  # no CPU history yet: not seen working
    assert tracker.parked_seconds(10, 100 * S) == 0  # parked since first sight, no earlier
    tracker.update(snap_at(101, process(10, running(11, cpu=5 * S + MS))), PARK)
    assert tracker.parked_seconds(10, 101 * S) == 1
    tracker.update(snap_at(102, process(10, running(11, cpu=6 * S))), PARK)
    assert not tracker.parks[10][11].parked
    assert tracker.parked_seconds(10, 102 * S) == 0


def test_a_thread_started_and_idle_does_not_reset_its_process():
    # A threading.Timer heartbeat starts a thread each time; starting one is no work.
    tracker = ParkTracker()
    tracker.update(snap_at(100, process(10, parked(11, since=50 * S))), PARK)
    for i, tid in enumerate((12, 13, 14), start=1):
        heartbeat = timer_thread(tid, 300_000, caught_running=True, last_ran=0)
        tracker.update(snap_at(100 + i, process(10, parked(11, since=50 * S), heartbeat)), PARK)
        assert tracker.parks[10][tid].parked
        assert tracker.parked_seconds(10, (100 + i) * S) == 50 + i


def test_reused_pid_starts_afresh():
    tracker = ParkTracker()
    tracker.update(snap_at(100, process(10, parked(11, since=10 * S), start=1)), PARK)
    tracker.update(snap_at(101, process(10, parked(11, since=int(100.9 * S)), start=2)), PARK)
    assert abs(tracker.parked_seconds(10, 101 * S) - 0.1) < 1e-6


def test_window_progress_counts_cpu_above_the_floor_and_bytes_written():
    settings = ParkSettings(cpu_floor_ratio=0.01, cpu_floor_min_ns=2 * MS)
    old = process(10, parked(11, cpu=0), parked(12, cpu=0), write_bytes=100)
    new = process(10, parked(11, cpu=1 * MS), parked(12, cpu=300 * MS), write_bytes=100)
    p = window_progress(old, new, 5 * S, settings)
    assert p.working_tids == (12,) and p.did_work and p.write_bytes == 0
    new2 = process(10, parked(11, cpu=1 * MS), parked(12, cpu=10 * MS), write_bytes=612)
    # /proc/PID/io alone (no probe) cannot name where 512 bytes went: progress, not a heartbeat
    p2 = window_progress(old, new2, 5 * S, settings)
    assert p2.working_tids == () and p2.write_bytes == 512 and not p2.heartbeat and p2.did_work
    # The same 512 bytes in 2 calls to one named log and nothing else: a heartbeat
    log = {"written_out": 512, "written_to": "/var/log/x.log", "logged_to": 1, "logged_calls": 2}
    p2 = window_progress(old, new2, 5 * S, settings, **log)  # type: ignore[arg-type]
    assert p2.heartbeat and not p2.did_work
    new3 = process(10, parked(11, cpu=1 * MS), parked(12, cpu=300 * MS), write_bytes=612)
    p3 = window_progress(old, new3, 5 * S, settings, **log)  # type: ignore[arg-type]
    assert p3.write_bytes == 512 and not p3.heartbeat and p3.did_work
    # Answers to clients always count
    p4 = window_progress(old, new2, 5 * S, settings, written_out=512, answered=512)
    assert not p4.heartbeat and p4.did_work


def _beat(**kw: object) -> ProcessProgress:
    """A process that wrote one small status line to one named log and did nothing else,
    changed by ``kw``."""
    base: dict[str, object] = {
        "pid": 10,
        "window_ns": 3 * S,
        "write_bytes": 200,
        "written_to": "/var/log/engine.log",
        "logged_to": 1,
        "logged_calls": 1,
    }
    return ProcessProgress(**{**base, **kw})  # type: ignore[arg-type]


def test_a_heartbeat_is_proven_by_its_shape_and_the_absence_of_any_other_work():
    assert _beat().heartbeat and not _beat().did_work
    # Any other work makes the same write progress: each kind of the accounting
    for other in (
        {"working_tids": (11,)},
        {"answered_bytes": 100, "write_bytes": 300},
        {"received_bytes": 4096},
        {"gpu": ev.GpuActive((0,), 50.0, 0)},
    ):
        assert _beat(**other).other_work and not _beat(**other).heartbeat, other
        assert _beat(**other).did_work, other


def test_a_write_not_shaped_like_a_heartbeat_is_progress():
    # Its destination unnamed (an answer on a connection closed before it was read)
    assert not _beat(unplaced_bytes=200).heartbeat and _beat(unplaced_bytes=200).did_work
    assert not _beat(logged_to=0, written_to=None).heartbeat  # nothing named at all
    # A log and an event log (a status writer's own few logs), but not a checkpoint's shards
    assert _beat(logged_to=2).heartbeat
    assert _beat(logged_to=HEARTBEAT_MAX_FILES).heartbeat
    assert not _beat(logged_to=HEARTBEAT_MAX_FILES + 1).heartbeat
    assert not _beat(logged_calls=HEARTBEAT_MAX_CALLS + 1).heartbeat  # too many calls
    assert not _beat(logged_calls=None).heartbeat  # calls not counted: not proven
    assert not _beat(write_bytes=HEARTBEAT_MAX_BYTES + 1).heartbeat  # data, not a line
    assert _beat(logged_calls=HEARTBEAT_MAX_CALLS).heartbeat


def test_unreadable_io_is_not_progress():
    old = process(10, parked(11), write_bytes=None)
    new = process(10, parked(11), write_bytes=None)
    assert not window_progress(old, new, S, PARK).did_work


MIB = 1 << 20


def _loading(**counts: int | None) -> tuple[ProcessSample, ProcessSample]:
    """A parked process before and after a window in which its counters grew by ``counts``
    (read_bytes, major_faults), having written a 30-byte log line."""
    old = replace(process(10, parked(11), write_bytes=0), read_bytes=0, major_faults=0)
    grown = {k: (None if v is None else getattr(old, k) + v) for k, v in counts.items()}
    return old, replace(process(10, parked(11), write_bytes=30), **grown)


def test_block_reads_at_a_loaders_rate_are_work_and_not_a_heartbeat():
    old, new = _loading(read_bytes=60 * MIB)
    p = window_progress(old, new, 3 * S, PARK, logged_to=1, logged_calls=1)
    assert p.block_read_bytes == 60 * MIB and p.read_storage and p.did_work
    assert p.heartbeat_shaped and not p.heartbeat  # its log line is the log of a load
    [fact] = [f for f in p.signals() if isinstance(f, ReadStorage)]
    assert (fact.block_bytes, fact.bytes, fact.window_s) == (60 * MIB, 60 * MIB, 3.0)
    assert render(fact) == "read 60.0 MiB from storage in 3.0 s"


def test_reading_a_config_file_is_not_loading():
    """Below the floor of 1 MiB a second: the log line alone (one call, to one named file)
    is a heartbeat."""
    old, new = _loading(read_bytes=64 * 1024, major_faults=2)
    p = window_progress(old, new, 3 * S, PARK, file_read=200 * 1024, logged_to=1, logged_calls=1)
    assert not p.read_storage and not p.did_work and p.heartbeat
    assert not any(isinstance(f, ReadStorage) for f in p.signals())


def test_reads_of_regular_files_the_block_layer_does_not_see_are_work():
    """The page cache, network and FUSE file systems: only the probe's count sees them."""
    old, new = _loading(read_bytes=0)
    p = window_progress(old, new, 3 * S, PARK, file_read=12 * MIB)
    assert p.file_read_bytes == 12 * MIB and p.read_storage and p.did_work
    # A read that misses the cache is in both counts: the larger, not the sum
    old, new = _loading(read_bytes=12 * MIB)
    assert window_progress(old, new, 3 * S, PARK, file_read=12 * MIB).storage_read_bytes == (
        12 * MIB
    )


def test_page_ins_of_mapped_files_are_work():
    old, new = _loading(major_faults=15)
    p = window_progress(old, new, 3 * S, PARK)
    assert p.major_faults == 15 and p.read_storage and p.did_work
    [fact] = [f for f in p.signals() if isinstance(f, ReadStorage)]
    assert render(fact) == (
        "read 0 B from storage and paged in mapped files (15 major faults) in 3.0 s"
    )


def test_unreadable_storage_counters_are_not_progress():
    old, new = _loading(read_bytes=None, major_faults=None)
    p = window_progress(old, new, 3 * S, PARK)
    assert p.block_read_bytes is None and p.major_faults == 0 and not p.read_storage


def test_a_process_new_in_the_window_read_all_its_counts_in_it():
    _, new = _loading(read_bytes=8 * MIB)
    p = window_progress(None, new, 3 * S, PARK)
    assert p.block_read_bytes == 8 * MIB and p.read_storage


def test_a_thread_above_the_floor_whose_polls_find_nothing_spins():
    """Its CPU is told a spin by the probe's count of polls that found nothing: 100 a second
    of the window or more (a wait of 10 ms or less, over and over); fewer are a timer's."""
    settings = ParkSettings(cpu_floor_ratio=0.01, cpu_floor_min_ns=2 * MS)
    old = process(10, parked(11, cpu=0), parked(12, cpu=0))
    new = process(10, parked(11, cpu=4900 * MS), parked(12, cpu=300 * MS))
    p = window_progress(old, new, 5 * S, settings, empty_polls={11: 500, 12: 499})
    assert p.working_tids == (11, 12) and p.spinning_tids == (11,)
    assert p.computing_tids == (12,) and p.spin_cpu_ns == 4900 * MS and p.empty_polls == 500
    assert not p.only_spins  # thread 12 computed
    alone = process(10, parked(11, cpu=4900 * MS), parked(12, cpu=0))
    p = window_progress(old, alone, 5 * S, settings, empty_polls={11: 57660, 12: 10**6})
    assert p.spinning_tids == (11,) and p.only_spins and p.did_work  # 12 polled, used no CPU
    assert render(p.spin()) == (
        "1 thread spun (4.90 CPU-s in 5.0 s, 57660 polls that found nothing): "
        "CPU that serves no one"
    )
    # No count (no probe): no thread is told spinning; its CPU is work
    p = window_progress(old, alone, 5 * S, settings)
    assert p.spinning_tids == () and not p.only_spins and p.did_work


def test_a_spin_beside_any_other_work_is_not_only_a_spin():
    spin = {"working_tids": (11,), "spinning_tids": (11,), "window_ns": 5 * S, "pid": 10}
    assert ProcessProgress(**spin).only_spins  # type: ignore[arg-type]
    for other in (
        {"working_tids": (11, 12)},
        {"write_bytes": 2**20, "logged_to": 9, "logged_calls": 900},
        {"write_bytes": 512, "answered_bytes": 512},
        {"received_bytes": 4096},
        {"file_read_bytes": 50 * 2**20},
        {"gpu": ev.GpuActive((0,), 0.9, 0)},
    ):
        p = ProcessProgress(**{**spin, **other})  # type: ignore[arg-type]
        assert not p.only_spins, other


def test_a_heartbeat_beside_a_spin_is_still_a_heartbeat():
    """A spin is not work by itself: a status line written beside a poll loop proves nothing."""
    p = _beat(working_tids=(11,), spinning_tids=(11,))
    assert p.heartbeat and not p.wrote_out and p.only_spins
    assert not _beat(working_tids=(11, 12), spinning_tids=(11,)).heartbeat
