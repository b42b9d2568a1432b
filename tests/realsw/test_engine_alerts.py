"""The shipped alert rules in a real Prometheus, on real vLLM and real Ray Serve.

One daemon (10 s threshold, as a user would set it: Ray's monitor writes every 5 s) watches a
real vLLM server and a real Ray Serve app; Prometheus (Debian's package) scrapes it and
evaluates deploy/prometheus's rules every second, ``HangwatchAllThreadsParked``'s ``for: 5m``
shortened as in ``test_alerts.py``. First both are idle, and no alert may be active for either.
Then the vLLM server hangs mid-stream (two SSE chunks sent, its client waiting for the rest)
and the Serve app is replaced by one whose replica blocks on an Event with a request pending
at the proxy: the alert must fire for both, each service by its root PID.

Needs root and bcc, the vLLM and the Ray venvs: skipped locally without them, failed under
``CI=true``.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from pathlib import Path

import pytest

from tests.privileged import daemonlib
from tests.privileged.daemonlib import Daemon, value
from tests.privileged.promlib import Prometheus
from tests.realsw import raylib, vllmlib
from tests.realsw.test_alerts import ALERT, daemon_watching, short_rules
from tests.realsw.vllmlib import vllm_ready

__all__ = ["vllm_ready"]  # the fixture, imported to be used here

# One worker for every Ray test: a cluster's dashboard agent binds port 52365, and
# test_engine_alerts.py's daemon selects any serve_idle or serve_event driver.
pytestmark = [
    pytest.mark.privileged,
    pytest.mark.usefixtures("needs_bpf", "vllm_ready"),
    pytest.mark.xdist_group("ray"),
]

THRESHOLD = 10.0
IDLE_HOLD_S = 15.0  # both idle, no alert active, this long
FIRING_TIMEOUT_S = 120.0  # from the hangs: past the threshold, then FOR, then firing
ACTIVE = ("pending", "firing")


def state(daemon: Daemon, service: str) -> str | None:
    s = daemon.scrape()
    if s is None:
        return None
    for st in ("deadlocked", "stalled", "idle", "progressing"):
        if value(s, "hangwatch_service_state", service=service, state=st) == 1:
            return st
    return None


def active_for(prom: Prometheus, service: str) -> list[dict]:
    return [
        a for a in prom.alerts() if a["labels"].get("service") == service and a["state"] in ACTIVE
    ]


def test_alerts_fire_for_a_vllm_stream_hang_and_a_hung_serve_replica_never_when_idle(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    raylib.require()
    rules = short_rules(tmp_path)
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(vllmlib.vllm_server(tmp_path / "vllm", hang="event"))
        idle_app = stack.enter_context(raylib.ray_job("serve_idle", tmp_path_factory.mktemp("ea")))
        daemon = stack.enter_context(
            daemon_watching(
                tmp_path,
                {
                    "vllm": rf"openai\.api_server .*--port {server.port}\b",
                    "ray": r"ray_jobs\.py --shape serve_(idle|event) ",
                },
                threshold=THRESHOLD,
            )
        )
        prom = Prometheus(tmp_path, daemon.port, rules)
        stack.callback(prom.stop)

        # Idle: both, in the daemon's eyes, and no alert for either over IDLE_HOLD_S
        for service in ("vllm", "ray"):
            daemonlib.wait_until(
                daemon,
                lambda s, n=service: (
                    value(s, "hangwatch_service_state", service=n, state="idle") == 1
                ),
                f"{service} to be idle",
                timeout=60,
            )
        end = time.monotonic() + IDLE_HOLD_S
        while time.monotonic() < end:
            for service in ("vllm", "ray"):
                assert state(daemon, service) == "idle", daemon.output()
                assert not active_for(prom, service), json.dumps(prom.alerts(), indent=1)
            time.sleep(1)

        # The hangs
        idle_app.close()
        # Ray's hung replica first: its start took 5 minutes on a loaded host once, and 300 s
        # into the vLLM hang the engine wrote and answered again (vLLM's own timeout), so
        # the alert that had been pending went away.
        hung_app = stack.enter_context(raylib.ray_job("serve_event", tmp_path_factory.mktemp("eb")))
        server.hang(after=3)
        client = stack.enter_context(vllmlib.pending(server, stream=True))
        server.wait_hung()
        client.read_chunks(1)  # one: several steps' tokens may come as one chunk
        want = {("vllm", str(server.pid)), ("ray", str(hung_app.driver))}
        firing: set[tuple[str, str]] = set()
        alerts: list[dict] = []
        deadline = time.monotonic() + FIRING_TIMEOUT_S
        while time.monotonic() < deadline:
            alerts, firing = prom.firing(ALERT)
            if want <= firing:
                break
            time.sleep(1)
        changes = [ln for ln in daemon.output().splitlines() if re.search(r" -> ", ln)]
        assert want <= firing, (
            f"want {ALERT} firing for {sorted(want)}, firing for {sorted(firing)}\n"
            f"alerts: {json.dumps(alerts, indent=1)}\nstate changes:\n" + "\n".join(changes)
        )
        for a in alerts:
            if a["labels"]["alertname"] == ALERT:
                assert a["labels"].get("severity") == "critical", a
