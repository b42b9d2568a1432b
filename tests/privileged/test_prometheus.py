"""The shipped alert rules in a real Prometheus server, scraping a real daemon.

The daemon watches a deadlocked process, a parked pool and an idle Python HTTP server;
Prometheus (Debian's package) evaluates deploy/prometheus's rules every second. Through its
HTTP API: HangwatchDeadlock is pending or firing for the deadlocked pid, HangwatchAllThreadsParked
for the pool's pid, and nothing at all for the idle server.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fixturelib import REPO_ROOT, Fixture
from tests.privileged.daemonlib import INTERVAL, Daemon, free_port, value, wait_until

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
"""
ACTIVE = ("pending", "firing")


def prometheus_binary() -> str:
    found = shutil.which("prometheus")
    if found is None:
        msg = "the prometheus server is not installed (make setup installs Debian's package)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(msg)
        pytest.skip(msg)
    return found


class Prometheus:
    def __init__(self, tmp: Path, target_port: int) -> None:
        self.port = free_port()
        cfg = tmp / "prometheus.yml"
        cfg.write_text(
            json.dumps(  # JSON is YAML: no template escaping to get wrong
                {
                    "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                    "rule_files": [str(p) for p in RULES],
                    "scrape_configs": [
                        {
                            "job_name": "hangwatch",
                            "static_configs": [{"targets": [f"127.0.0.1:{target_port}"]}],
                        }
                    ],
                }
            )
        )
        self.log = (tmp / "prometheus.log").open("w")
        self.proc = subprocess.Popen(
            [
                prometheus_binary(),
                f"--config.file={cfg}",
                f"--storage.tsdb.path={tmp / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self.log_path = tmp / "prometheus.log"

    def api(self, path: str) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/api/v1/{path}", timeout=5) as r:
            return json.loads(r.read())["data"]

    def alerts(self) -> list[dict]:
        try:
            return self.api("alerts")["alerts"]
        except OSError:
            return []

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self.log.close()


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[tuple[Daemon, Prometheus]]:
    assert RULES, "no rule files in deploy/prometheus"
    port = free_port()
    cfg = tmp_path / "hangwatch.yaml"
    cfg.write_text(CONFIG.format(port=port))
    d = Daemon(cfg, port)
    prom = None
    try:
        wait_until(
            d,
            lambda s: value(s, "hangwatch_collector_success", collector="proc") == 1,
            "the daemon's first tick",
        )
        prom = Prometheus(tmp_path, port)
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
        Fixture.py("idle_http") as http,
    ):
        want = {("HangwatchDeadlock", str(mutex.pid)), ("HangwatchAllThreadsParked", str(pool.pid))}
        deadline = time.monotonic() + 60
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
                assert a["annotations"].get("runbook_url"), shown
        # The idle server is idle in the daemon's eyes, and in Prometheus: nothing is active
        # for it, now and after a few more evaluations.
        s = daemon.scrape() or {}
        assert value(s, "hangwatch_service_state", service="http", state="idle") == 1
        time.sleep(3)
        for a in prom.alerts():
            assert a["labels"].get("pid") != str(http.pid), json.dumps(a, indent=1)
            assert a["labels"].get("service") != "http", json.dumps(a, indent=1)
