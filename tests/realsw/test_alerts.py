"""The shipped alert HangwatchAllThreadsParked in a real Prometheus server, on real software.

One daemon watches, at the same time, a torchrun job whose rank 1 left an all_reduce
(``allreduce_peer_gone``: rank 0 waits forever), the serving stack in its ``abba`` shape (the
front-end parked behind a hung scheduler, a client's request waiting) and the same stack in its
``idle`` shape (parked, listening, nothing waiting). Prometheus (Debian's package) scrapes it
every second and evaluates deploy/prometheus's rules every second, as
``tests/privileged/test_prometheus.py`` does; only the alert's ``for: 5m`` is shortened (in a
copy of the rules), since a test cannot wait five minutes.

HangwatchAllThreadsParked must be firing for the two hangs (each process of a stalled service,
its waiters included, is stalled with it), and never active for the idle server over the same
time. The new evidence is on /metrics too: the abba service's waiting request and its time
without progress.

Needs root and bcc (as ``tests/privileged``) and the real-software venv: skipped locally without
them, failed under ``CI=true``.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from scripts import realsw
from scripts.fixturelib import REPO_ROOT, wait_until
from tests.privileged import daemonlib
from tests.privileged.daemonlib import INTERVAL, Daemon, free_port, running_daemon, value
from tests.privileged.promlib import Prometheus
from tests.realsw.servinglib import serving_stack

# hangwatch attaches: root and bcc, as tests/privileged (conftest.needs_bpf)
# serial: 'never active for the idle server' is a timing check
pytestmark = [pytest.mark.privileged, pytest.mark.usefixtures("needs_bpf"), pytest.mark.serial]

ALERT = "HangwatchAllThreadsParked"
FOR = "3s"  # instead of the shipped 5m
THRESHOLD = 2.0
FIRING_TIMEOUT_S = 60.0  # from Prometheus's start: stalled verdicts, then FOR, then firing
SYS_FUTEX = 202


def short_rules(tmp: Path) -> list[Path]:
    """deploy/prometheus's rule files, copied with ALERT's ``for`` shortened to FOR."""
    out = []
    shortened = 0
    for src in sorted((REPO_ROOT / "deploy" / "prometheus").glob("*.yml")):
        doc = yaml.safe_load(src.read_text())
        for group in doc.get("groups", []):
            for rule in group.get("rules", []):
                if rule.get("alert") == ALERT:
                    rule["for"] = FOR
                    shortened += 1
        dst = tmp / src.name
        dst.write_text(json.dumps(doc))  # JSON is YAML: no template escaping to get wrong
        out.append(dst)
    assert shortened == 1, f"want one {ALERT} rule in deploy/prometheus, found {shortened}"
    return out


@contextlib.contextmanager
def daemon_watching(
    tmp: Path, targets: dict[str, str], threshold: float = THRESHOLD
) -> Iterator[Daemon]:
    """A daemon (past its first tick) watching ``targets``: name -> cmdline regex."""
    port = free_port()
    cfg = tmp / "hangwatch.yaml"
    cfg.write_text(
        json.dumps(
            {
                "listen": f"127.0.0.1:{port}",
                "interval_seconds": INTERVAL,
                "park_threshold_seconds": threshold,
                "targets": [{"name": n, "cmdline": c} for n, c in targets.items()],
            }
        )
    )
    with running_daemon(cfg, port) as d:
        yield d


def test_all_threads_parked_fires_for_real_hangs_and_never_for_the_idle_server(
    tmp_path: Path,
) -> None:
    rules = short_rules(tmp_path)
    abba_dir, idle_dir = tmp_path / "abba", tmp_path / "idle"
    abba_dir.mkdir()
    idle_dir.mkdir()
    with contextlib.ExitStack() as stack:
        job = stack.enter_context(realsw.torchrun_job("allreduce_peer_gone"))
        waiter = job.ranks(2)[0].get_int("pid")
        wait_until(
            lambda: realsw.main_thread_in(waiter, SYS_FUTEX), 10, "rank 0 parked in all_reduce"
        )
        abba = stack.enter_context(serving_stack("abba", abba_dir, client=["--mode", "once"]))
        idle = stack.enter_context(serving_stack("idle", idle_dir))
        # Root command lines only (the ranks' and the spawned children's differ).
        daemon = stack.enter_context(
            daemon_watching(
                tmp_path,
                {
                    "torch": rf"bin/torchrun .*--master_port={job.port}\b",
                    "abba": rf"serving\.server --shape abba .*{re.escape(str(abba_dir))}",
                    "idle": rf"serving\.server --shape idle .*{re.escape(str(idle_dir))}",
                },
            )
        )
        prom = Prometheus(tmp_path, daemon.port, rules)
        stack.callback(prom.stop)

        want = {("torch", str(job.pid)), ("abba", str(abba.pid))}
        deadline = time.monotonic() + FIRING_TIMEOUT_S
        firing: set[tuple[str, str]] = set()
        seen_for_idle: list[dict] = []
        alerts: list[dict] = []
        while time.monotonic() < deadline:
            alerts, firing = prom.firing(ALERT)
            seen_for_idle += [
                a
                for a in alerts
                if a["labels"].get("service") == "idle" and a["state"] in ("pending", "firing")
            ]
            if want <= firing:
                break
            time.sleep(1)
        shown = json.dumps(alerts, indent=1)
        assert want <= firing, (
            f"want {ALERT} firing for {sorted(want)}, firing for {sorted(firing)}\n"
            f"alerts: {shown}\ndaemon log:\n{daemon.output()}"
        )
        assert not seen_for_idle, json.dumps(seen_for_idle, indent=1)
        # The idle server is idle in the daemon's eyes, and stays alert-free a few more
        # evaluations (idle once its start-up is out of the progress window: waited for).
        daemonlib.wait_until(
            daemon,
            lambda s: value(s, "hangwatch_service_state", service="idle", state="idle") == 1,
            "the idle server to be idle",
        )
        time.sleep(3)
        for a in prom.alerts():
            assert a["labels"].get("service") != "idle", json.dumps(a, indent=1)
            assert a["labels"].get("pid") != str(idle.pid), json.dumps(a, indent=1)
        # The evidence an operator's dashboard shows, in the same scrape as the stall.
        s = daemon.scrape()
        assert s is not None
        svc = {"service": "abba", "pid": str(abba.pid)}
        assert value(s, "hangwatch_service_state", state="stalled", **svc) == 1
        assert (value(s, "hangwatch_service_unanswered_requests", **svc) or 0) >= 1, s
        assert (value(s, "hangwatch_service_seconds_since_progress", **svc) or 0) >= THRESHOLD
        idle_svc = {"service": "idle", "pid": str(idle.pid)}
        assert value(s, "hangwatch_service_unanswered_requests", **idle_svc) == 0
