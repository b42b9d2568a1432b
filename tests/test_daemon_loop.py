"""The daemon's loop without root (a recording probe, a fixture /proc): its stages are exported
under their names, a failing one is logged and retried, and the wait between steps drains the
probe's ring buffer."""

from __future__ import annotations

import json
import logging
import signal
import socket
import threading
import time
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from agent import daemon as daemon_mod
from agent.analysis.verdict import ProcessVerdict, ServiceVerdict
from agent.config import validate
from agent.daemon import DRAIN_SLICE_S, Daemon
from agent.errors import HangwatchError
from agent.export.exposition import STAGES
from agent.observe import enrich
from agent.observe.sitebook import SiteBook
from agent.sources.procfs import ProcFS
from tests import synth
from tests.fakeprobe import FakeClock, RecordingProbe


def make(tmp_path: Path, probe: RecordingProbe | None, clock: FakeClock | None = None) -> Daemon:
    cfg = validate({"targets": [{"name": "x", "cmdline": "^nothing$"}]}, "test")
    if clock is None:
        return Daemon.with_sources(cfg, ProcFS(str(tmp_path)), probe)
    return Daemon.with_sources(cfg, ProcFS(str(tmp_path)), probe, clock=clock)


def test_the_exported_stage_names_are_the_contract() -> None:
    # Alerts (deploy/prometheus) and docs/deploy.md name these collector="..." values.
    assert STAGES == ("gpu", "discovery", "proc", "judge", "bpf_stats", "exposition")


def test_a_step_exports_its_stages_and_a_failing_one_is_logged_and_retried(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    d = make(tmp_path, RecordingProbe())
    d.cfg = replace(d.cfg, bpf_stats=True)
    d.step()
    assert set(d.collectors) == {"discovery", "proc", "judge", "bpf_stats"}  # no GPU here
    assert all(c.success for c in d.collectors.values())
    first = d.exposition
    assert first is not None and first.agent.collectors == d.collectors

    def boom() -> None:
        raise RuntimeError("boom")

    d.discovery.scan = boom  # type: ignore[method-assign]
    with caplog.at_level(logging.ERROR, logger="agent.daemon"):
        d.step()
    assert not d.collectors["discovery"].success and d.collectors["proc"].success
    assert "collector discovery failed; retrying next interval" in caplog.text
    assert d.exposition is not first  # the other stages went on


def test_the_wait_between_ticks_drains_in_short_slices(tmp_path: Path) -> None:
    """On a clock that only the drains move: the wait is cut into slices of at most
    DRAIN_SLICE_S that end exactly at the deadline, however slow the machine."""
    clock = FakeClock()
    probe = RecordingProbe(clock=clock)
    d = make(tmp_path, probe, clock)
    t0 = clock()
    wait = 3.5 * DRAIN_SLICE_S
    d._wait_until(t0 + wait)
    assert clock() - t0 == pytest.approx(wait)
    assert probe.slices == pytest.approx([DRAIN_SLICE_S] * 3 + [DRAIN_SLICE_S / 2]), probe.slices


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


def test_stacks_are_read_only_when_a_service_turns_stalled_or_deadlocked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The flight record costs nothing while services are healthy or stay hung: stacks are
    read once, at the change to stalled or deadlocked, and with ``stacks: false`` never."""
    reads: list[list[int]] = []

    def read_many(
        pids: Iterable[int],
        budget_s: float,
        proc: object,
        source: object = None,
        starts: object = None,
    ) -> dict:
        reads.append(list(pids))
        return {}

    monkeypatch.setattr(enrich, "read_many", read_many)
    d = make(tmp_path, None)
    tick = SimpleNamespace(snapshot=synth.snapshot(synth.process(10, synth.parked(10, 0xA0))))

    def verdict(state: str) -> ServiceVerdict:
        p = ProcessVerdict(10, "python", 1, 1, 5.0, state, [])
        return ServiceVerdict(10, state, [], [], [p])

    for state in ("progressing", "progressing", "idle", "stalled", "stalled", "deadlocked"):
        d._log_changes([verdict(state)], tick)  # type: ignore[arg-type]
    assert d.flight.flush(10)
    assert reads == [[10], [10]]  # at -> stalled and at -> deadlocked, not while it stayed

    reads.clear()
    d.cfg = replace(d.cfg, stacks=False)
    d.states.clear()
    for state in ("progressing", "stalled", "deadlocked"):
        d._log_changes([verdict(state)], tick)  # type: ignore[arg-type]
    assert d.flight.flush(10)
    assert reads == []


def test_the_tick_does_not_wait_for_the_stacks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stacks are read beside the loop: _log_changes returns while they are still being
    read, and the change's line comes once they are."""
    reading = threading.Event()
    release = threading.Event()

    def read_many(
        pids: Iterable[int],
        budget_s: float,
        proc: object,
        source: object = None,
        starts: object = None,
    ) -> dict:
        reading.set()
        assert release.wait(10)
        return {}

    monkeypatch.setattr(enrich, "read_many", read_many)
    d = make(tmp_path, None)
    tick = SimpleNamespace(snapshot=synth.snapshot(synth.process(10, synth.parked(10, 0xA0))))
    p = ProcessVerdict(10, "python", 1, 1, 5.0, "stalled", [])
    d._log_changes([ServiceVerdict(10, "stalled", [], [], [p])], tick)  # type: ignore[arg-type]
    assert reading.wait(10)  # still reading: the loop is back already
    assert d.states[("unknown", 10)] == "stalled"
    release.set()
    assert d.flight.flush(10)


def test_a_site_is_read_once_per_park_from_half_the_threshold_and_only_for_a_rank_s_own(
    tmp_path: Path,
) -> None:
    """Where a parked process waits costs one read per park, not one per tick: none before
    the park has lasted half the threshold, one then, none while it stays parked, one again
    for its next park; none for a helper that inherits its parent's rank, or with
    ``stacks: false``."""
    reads: list[int] = []
    d = make(tmp_path, None)
    d.sites = SiteBook(lambda park: reads.append(park.pid) or f"at (p{park.pid}.py:1)")
    d.sites.start()
    half = d.cfg.park_threshold_seconds / 2
    rank = synth.process(10, synth.parked(10), comm="python")
    helper = synth.process(11, synth.parked(11), ppid=10, comm="pt_data_worker")
    labels = {10: {"rank": "2"}, 11: {"rank": "2"}}

    def tick_at(t: float, parked_s: float) -> dict[int, str]:
        snap = synth.snapshot(rank, helper, at=int(t * 1e9))
        procs = [ProcessVerdict(p, "python", 1, 1, parked_s, "stalled", []) for p in (10, 11)]
        out = d._sites_of(
            [ServiceVerdict(10, "stalled", [], [], procs)],
            SimpleNamespace(snapshot=snap),  # type: ignore[arg-type]
            labels,
        )
        assert d.sites.flush(10)
        return out

    assert tick_at(100, half - 1) == {} and reads == []  # parked since 100 - (half - 1)
    assert tick_at(101, half) == {} and reads == [10]  # due: read (the next tick shows it)
    for t in range(102, 110):
        assert tick_at(t, half + t - 101) == {10: "at (p10.py:1)"}
    assert reads == [10]
    assert tick_at(110, 0.0) == {}  # a thread worked: the park ended
    assert tick_at(110 + half, half) == {} and reads == [10, 10]  # the next park, read anew
    d.cfg = replace(d.cfg, stacks=False)
    assert tick_at(200 + half, half) == {} and reads == [10, 10]


def _tick_failures(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.getMessage().startswith("tick failed")]


def test_a_tick_that_raises_is_counted_logged_once_and_the_loop_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rule that raises (here the verdicts of every tick) ends neither the tick's caller
    nor the loop: each is counted and exported at once with the last verdicts, the first is
    logged with its traceback and the next ones not within TICK_ERROR_LOG_S; once the rule
    works again, so do the ticks."""
    d = make(tmp_path, RecordingProbe())
    d.step()
    first = d.exposition
    assert first is not None and first.agent.tick_errors_total == 0
    assert d.session is not None
    working = d.session.verdicts
    calls: list[int] = []

    def broken_rule() -> list[ServiceVerdict]:
        calls.append(1)
        raise ZeroDivisionError("a rule divided by zero")

    monkeypatch.setattr(d.session, "verdicts", broken_rule)
    with caplog.at_level(logging.ERROR, logger="agent.daemon"):
        for _ in range(3):
            d.tick()
    assert d.tick_errors == 3 and len(calls) == 3
    logged = _tick_failures(caplog)
    assert len(logged) == 1 and logged[0].exc_info is not None
    assert logged[0].exc_info[0] is ZeroDivisionError
    assert d.exposition is not None and d.exposition.agent.tick_errors_total == 3
    assert d.exposition.services == first.services  # the last verdicts, still served
    assert d.exposition.agent.last_tick_seconds == first.agent.last_tick_seconds  # and dated

    monkeypatch.setattr("agent.daemon.TICK_ERROR_LOG_S", 0.0)
    with caplog.at_level(logging.ERROR, logger="agent.daemon"):
        d.tick()
    assert len(_tick_failures(caplog)) == 2 and "2 not logged since" in caplog.text

    # The loop itself: ticks that raise, then a stop; it returns, no exception.
    d.cfg = replace(d.cfg, interval_seconds=0.01)
    d.session.probe = None

    def broken_then_stop() -> list[ServiceVerdict]:
        if len(calls) >= 6:
            d.stop.set()
        return broken_rule()

    monkeypatch.setattr(d.session, "verdicts", broken_then_stop)
    d.loop()
    assert d.tick_errors == 4 + 3

    monkeypatch.setattr(d.session, "verdicts", working)
    d.stop.clear()
    d.tick()
    assert d.tick_errors == 7 and d.exposition.agent.tick_errors_total == 7
    assert d.exposition.agent.last_tick_seconds > first.agent.last_tick_seconds


def test_a_rule_that_raises_in_the_judgement_is_a_failed_stage_and_metrics_go_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rule that raises inside the pure judgement: the judge stage is exported as failed,
    the tick is counted and logged, /metrics goes on serving the last verdicts with the
    failure, and the next tick with a working rule succeeds again."""
    from prometheus_client import generate_latest

    from agent.analysis import judge as judge_mod
    from agent.export.metrics import registry_for

    d = make(tmp_path, RecordingProbe())
    d.step()
    registry = registry_for(lambda: d.exposition, commit="abc1234")
    assert b'hangwatch_collector_success{collector="judge"} 1.0' in generate_latest(registry)
    working = judge_mod.judge

    def broken(*args: object, **kwargs: object) -> object:
        raise KeyError("a rule looked up a port it never saw")

    monkeypatch.setattr("agent.observe.observer.judge", broken)
    with caplog.at_level(logging.ERROR, logger="agent.daemon"):
        d.tick()
    assert d.tick_errors == 1 and not d.collectors["judge"].success
    assert "a rule looked up a port" in caplog.text
    text = generate_latest(registry)
    assert b'hangwatch_collector_success{collector="judge"} 0.0' in text
    assert b"hangwatch_tick_errors_total 1.0" in text
    assert b'hangwatch_collector_success{collector="exposition"} 1.0' in text

    monkeypatch.setattr("agent.observe.observer.judge", working)
    d.tick()
    assert d.tick_errors == 1 and d.collectors["judge"].success
    assert b'collector="judge"} 1.0' in generate_latest(registry)


def test_a_judgement_failing_before_any_verdict_still_exports_the_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = make(tmp_path, RecordingProbe())

    def broken(*args: object, **kwargs: object) -> object:
        raise RuntimeError("first tick")

    monkeypatch.setattr("agent.observe.observer.judge", broken)
    d.tick()
    assert d.exposition is not None and d.exposition.services == ()
    assert not d.exposition.agent.collectors["judge"].success
    assert d.exposition.agent.last_tick_seconds == 0.0  # no verdict yet: nothing to date


def test_a_drain_that_raises_is_counted_and_the_wait_still_waits(tmp_path: Path) -> None:
    probe = RecordingProbe()

    def drain(timeout_s: float) -> None:
        raise OSError("the ring buffer is gone")

    probe.drain = drain  # type: ignore[method-assign]
    d = make(tmp_path, probe)
    t0 = time.monotonic()
    d._wait_until(t0 + 0.2)
    assert time.monotonic() - t0 >= 0.2 and d.tick_errors >= 1


def test_the_workers_start_at_start_up_and_a_loop_without_them_still_closes(
    tmp_path: Path,
) -> None:
    """No thread is started by a change: a daemon whose workers were never started (a
    start-up that failed) refuses the change instead, counted as a failed tick, and its loop
    still ends cleanly (close() joins no thread that never ran)."""
    cfg = validate({"targets": [{"name": "x", "cmdline": "^nothing$"}]}, "test")
    d = Daemon(cfg, ProcFS(str(tmp_path)))
    tick = SimpleNamespace(snapshot=synth.snapshot(synth.process(10, synth.parked(10, 0xA0))))
    verdict = ServiceVerdict(10, "stalled", [], [], [])
    before = threading.active_count()
    with pytest.raises(RuntimeError, match="before start"):
        d._log_changes([verdict], tick)  # type: ignore[arg-type]
    assert threading.active_count() == before
    d.stop.set()
    d.loop()  # returns: nothing to join


def test_a_thread_that_cannot_start_is_a_clear_start_up_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Out of tasks at start-up: `hangwatch run` says so and exits 1 before it binds or
    attaches anything, rather than failing later in a tick."""
    cfg = tmp_path / "hangwatch.yaml"
    with socket.socket() as s:  # a free port: the run must fail before it binds one
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg.write_text(f'listen: "127.0.0.1:{port}"\ntargets:\n  - name: x\n    cmdline: "^nothing$"\n')
    cfg.chmod(0o600)

    def cannot_start(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    monkeypatch.setattr(threading.Thread, "start", cannot_start)
    # The build's commit is asked of git (tests/host/test_buildinfo.py); this tier starts no git.
    monkeypatch.setattr(daemon_mod.buildinfo, "commit", lambda: "abc1234")
    try:
        with pytest.raises(HangwatchError, match="cannot start the daemon's threads") as e:
            daemon_mod.run(str(cfg), None)
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    assert e.value.exit_code == 1 and "TasksMax" in str(e.value)


def test_a_reload_keeps_what_is_set_at_start_and_takes_the_rest(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """SIGHUP: the status socket, its group and bpf_stats were set up at start, so a new value
    of each is named as needing a restart and the running one kept; the targets change."""
    first = {
        "status_socket": str(tmp_path / "a.sock"),
        "status_group": "hw-a",
        "bpf_stats": False,
        "targets": [{"name": "x", "cmdline": "^nothing$"}],
    }
    d = Daemon(validate(first, "test"), ProcFS(str(tmp_path)))
    path = tmp_path / "hangwatch.yaml"
    path.write_text(
        json.dumps(
            {
                **first,
                "status_socket": str(tmp_path / "b.sock"),
                "status_group": "hw-b",
                "bpf_stats": True,
                "targets": [{"name": "y", "cmdline": "^other$"}],
            }
        )
    )
    path.chmod(0o600)
    d.config_path = str(path)
    with caplog.at_level(logging.WARNING, logger="agent.daemon"):
        d.reload()
    assert (d.cfg.status_socket, d.cfg.status_group, d.cfg.bpf_stats) == (
        str(tmp_path / "a.sock"),
        "hw-a",
        False,
    )
    assert [t.name for t in d.cfg.targets] == ["y"]
    for said in (
        f"status_socket {tmp_path / 'b.sock'} needs a restart; keeping {tmp_path / 'a.sock'}",
        "status_group hw-b needs a restart; keeping hw-a",
        "bpf_stats True needs a restart; keeping False",
    ):
        assert said in caplog.text, caplog.text
