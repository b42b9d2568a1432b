"""The daemon's wait between ticks drains the probe's ring buffer (no root: a recording probe)."""

from __future__ import annotations

import time
from pathlib import Path

from agent.config import validate
from agent.daemon import DRAIN_SLICE_S, Daemon
from agent.procfs import ProcFS
from tests.fakeprobe import RecordingProbe


def make(tmp_path: Path, probe: RecordingProbe | None) -> Daemon:
    cfg = validate({"targets": [{"name": "x", "cmdline": "^nothing$"}]}, "test")
    return Daemon.with_sources(cfg, ProcFS(str(tmp_path)), probe)


def test_the_wait_between_ticks_drains_in_short_slices(tmp_path: Path) -> None:
    probe = RecordingProbe()
    d = make(tmp_path, probe)
    t0 = time.monotonic()
    d._wait_until(t0 + 0.35)
    waited = time.monotonic() - t0
    assert 0.35 <= waited < 0.35 + DRAIN_SLICE_S + 0.2, waited
    assert len(probe.slices) >= 3 and all(0 < s <= DRAIN_SLICE_S for s in probe.slices), (
        probe.slices
    )


def test_a_stop_ends_the_wait_within_a_slice(tmp_path: Path) -> None:
    probe = RecordingProbe()
    d = make(tmp_path, probe)
    d.stop.set()
    t0 = time.monotonic()
    d._wait_until(t0 + 30)
    assert time.monotonic() - t0 < 1 and probe.slices == []


def test_without_a_drain_the_wait_is_a_plain_sleep(tmp_path: Path) -> None:
    d = make(tmp_path, None)
    t0 = time.monotonic()
    d._wait_until(t0 + 0.2)
    assert time.monotonic() - t0 >= 0.2
