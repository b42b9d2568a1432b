"""The shipped alert rules in a real Prometheus server, scraping a real daemon.

The daemon watches a deadlocked process, two hangs proven without a lock cycle (a Python-lock
ABBA and a child forked while a lock was held), a parked pool and an idle Python HTTP server;
Prometheus (Debian's package) evaluates deploy/prometheus's rules every second. Through its
HTTP API: HangwatchDeadlock is pending or firing for the deadlocked pid, HangwatchNoWaker for
the ABBA's pid and the forked child's, HangwatchAllThreadsParked for the pool's pid, and nothing
at all for the idle server.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from scripts.fixturelib import REPO_ROOT, Fixture
from tests.privileged.daemonlib import INTERVAL, Daemon, first_tick, free_port, value, wait_until
from tests.privileged.promlib import Prometheus

# serial: its daemon selects fixture programs by name, so it would watch other tests' copies too
pytestmark = pytest.mark.serial

RULES = sorted((REPO_ROOT / "deploy" / "prometheus").glob("*.yml"))
CONFIG = f"""
listen: "127.0.0.1:{{port}}"
interval_seconds: {INTERVAL}
park_threshold_seconds: 2
targets:
  - name: mutex-cycle
    cmdline: "fixtures/build/deadlock_mutex"
  - name: pool
    cmdline: "fixtures/build/condvar_pool"
  - name: http
    cmdline: "fixtures/idle_http\\\\.py"
  - name: pylocks
    cmdline: "fixtures/pylocks\\\\.py"
  - name: fork-locked
    cmdline: "fixtures/fork_locked\\\\.py"
"""
ACTIVE = ("pending", "firing")


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[tuple[Daemon, Prometheus]]:
    assert RULES, "no rule files in deploy/prometheus"
    port = free_port()
    cfg = tmp_path / "hangwatch.yaml"
    cfg.write_text(CONFIG.format(port=port))
    d = Daemon(cfg, port)
    prom = None
    try:
        first_tick(d)
        prom = Prometheus(tmp_path, port, RULES)
        yield d, prom
    finally:
        if prom is not None:
            prom.stop()
        assert d.stop() == 0, d.output()


def test_alerts_fire_for_the_hangs_and_never_for_the_idle_server(stack) -> None:
    daemon, prom = stack
    with (
        Fixture.c("deadlock_mutex") as mutex,
        Fixture.c("condvar_pool", "4") as pool,
        Fixture.py("idle_http", "--port", free_port()) as http,
        Fixture.py("pylocks") as abba,
        Fixture.py("fork_locked") as forked,
    ):
        want = {
            ("HangwatchDeadlock", str(mutex.pid)),
            ("HangwatchAllThreadsParked", str(pool.pid)),
            ("HangwatchNoWaker", str(abba.pid)),
            ("HangwatchNoWaker", forked.info["child"]),
        }
        deadline = time.monotonic() + 90  # generous: a loaded CI machine ticks late
        active: list[dict] = []
        while time.monotonic() < deadline:
            active = [a for a in prom.alerts() if a["state"] in ACTIVE]
            got = {(a["labels"]["alertname"], a["labels"].get("pid")) for a in active}
            if want <= got:
                break
            time.sleep(1)
        shown = json.dumps(active, indent=1)
        got = {(a["labels"]["alertname"], a["labels"].get("pid")) for a in active}
        assert want <= got, f"alerts active: {shown}\ndaemon log:\n{daemon.output()}"
        for a in active:
            if a["labels"]["alertname"] in ("HangwatchDeadlock", "HangwatchAllThreadsParked"):
                assert a["labels"].get("service") in ("mutex-cycle", "pool"), shown
            if a["labels"]["alertname"] == "HangwatchNoWaker":
                assert a["labels"].get("service") in ("pylocks", "fork-locked"), shown
                assert a["annotations"].get("runbook_url"), shown
        # The idle server is idle in the daemon's eyes, and in Prometheus: nothing is active
        # for it, now and after a few more evaluations. (Idle once its start-up is out of the
        # progress window, which can be after the pool's stall fired: waited for, not raced.)
        wait_until(
            daemon,
            lambda s: value(s, "hangwatch_service_state", service="http", state="idle") == 1,
            "the idle server to be idle",
        )
        time.sleep(3)
        for a in prom.alerts():
            assert a["labels"].get("pid") != str(http.pid), json.dumps(a, indent=1)
            assert a["labels"].get("service") != "http", json.dumps(a, indent=1)
