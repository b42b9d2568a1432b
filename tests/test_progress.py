"""Park times and progress: work, not wake-ups."""

from __future__ import annotations

from agent.model import Snapshot
from agent.progress import ParkSettings, ParkTracker, window_progress
from tests.synth import S, parked, process, running

MS = 1_000_000


def snap_at(t_s: float, *procs) -> Snapshot:
    return Snapshot(int(t_s * S), 1e9 + t_s, {p.pid: p for p in procs})


def test_timer_wakeups_keep_a_thread_parked_and_its_park_time_grows():
    tracker = ParkTracker()
    # A poll loop: last ran 0.2 s before first sight, then 50 us of CPU every second.
    for i in range(10):
        t = parked(11, cpu=i * 50_000, since=int((i + 99.8) * S))
        tracker.update(snap_at(100 + i, process(10, t)))
    assert tracker.parks[10][11].parked
    assert 9 < tracker.parked_seconds(10, int(109 * S)) < 10


def test_work_resets_park_time_and_a_running_thread_is_not_parked():
    tracker = ParkTracker()
    tracker.update(snap_at(100, process(10, parked(11, cpu=0, since=50 * S))))
    assert tracker.parked_seconds(10, 100 * S) == 50
    tracker.update(snap_at(101, process(10, parked(11, cpu=500 * MS, since=100 * S))))
    assert not tracker.parks[10][11].parked
    assert tracker.parked_seconds(10, 101 * S) == 0
    tracker.update(snap_at(103, process(10, parked(11, cpu=500 * MS, since=101 * S))))
    assert tracker.parked_seconds(10, 103 * S) == 2
    tracker.update(snap_at(104, process(10, parked(11), running(12))))
    assert tracker.parked_seconds(10, 104 * S) == 0


def test_reused_pid_starts_afresh():
    tracker = ParkTracker()
    tracker.update(snap_at(100, process(10, parked(11, since=10 * S), start=1)))
    tracker.update(snap_at(101, process(10, parked(11, since=int(100.9 * S)), start=2)))
    assert abs(tracker.parked_seconds(10, 101 * S) - 0.1) < 1e-6


def test_window_progress_counts_cpu_above_the_floor_and_bytes_written():
    settings = ParkSettings(cpu_floor_ratio=0.01, cpu_floor_min_ns=2 * MS)
    old = process(10, parked(11, cpu=0), parked(12, cpu=0), write_bytes=100)
    new = process(10, parked(11, cpu=1 * MS), parked(12, cpu=300 * MS), write_bytes=100)
    p = window_progress(old, new, 5 * S, settings)
    assert p.working_tids == (12,) and p.did_work and p.write_bytes == 0
    new2 = process(10, parked(11, cpu=1 * MS), parked(12, cpu=10 * MS), write_bytes=612)
    p2 = window_progress(old, new2, 5 * S, settings)
    assert p2.working_tids == () and p2.write_bytes == 512 and p2.did_work


def test_unreadable_io_is_not_progress():
    old = process(10, parked(11), write_bytes=None)
    new = process(10, parked(11), write_bytes=None)
    assert not window_progress(old, new, S, ParkSettings()).did_work
