"""deploy/grafana/hangwatch.json against a real daemon: every metric it queries is exported,
and every query returns data from a real Prometheus scraping that daemon.

The daemon watches a server that listens, writes, accepts and waits on a futex
(fixtures/listen_write) and a parked condition-variable pool (fixtures/condvar_pool), which
between them make every non-GPU series exist. GPU series need NVML and a process holding GPU
memory: they are listed below and checked against tests/golden/metrics.txt instead when the
host cannot produce them (tests/test_deploy.py checks every dashboard name against it too).
"""

from __future__ import annotations

import re
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from scripts.fixturelib import Fixture
from tests.privileged.daemonlib import (
    INTERVAL,
    Daemon,
    Samples,
    first_tick,
    free_port,
    value,
    wait_until,
)
from tests.privileged.promlib import Prometheus
from tests.test_deploy import (
    dashboard_metric_names,
    exprs,
    golden,
    metric_selectors,
    variable_queries,
)

CONFIG = f"""
listen: "127.0.0.1:{{port}}"
interval_seconds: {INTERVAL}
park_threshold_seconds: 2
bpf_stats: true  # the dashboard's BPF cost panels read it
targets:
  - name: srv
    cmdline: "fixtures/build/listen_write"
  - name: pool
    cmdline: "fixtures/build/condvar_pool"
"""
ACCEPTS = 2

# Exported only where NVML answers (an NVIDIA driver and at least one GPU). Without it the
# daemon says hangwatch_collector_success{collector="gpu"} 0 and leaves these out;
# hangwatch_gpu_errors_total too, until a GPU has been seen or an NVML call failed.
NVML_DEVICE_FAMILIES = {
    "hangwatch_gpu_utilization_ratio",
    "hangwatch_gpu_info",
    "hangwatch_gpu_memory_used_bytes",
    "hangwatch_gpu_memory_total_bytes",
    "hangwatch_gpu_errors_total",
}
# Exported per watched process that holds GPU memory: none of the fixtures does, GPU or not.
GPU_PROCESS_FAMILIES = {
    "hangwatch_process_gpu_memory_bytes",
    "hangwatch_process_gpu_utilization_ratio",
}


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    port = free_port()
    cfg = tmp_path / "hangwatch.yaml"
    cfg.write_text(CONFIG.format(port=port))
    d = Daemon(cfg, port)
    try:
        first_tick(d)
        yield d
    finally:
        rc = d.stop()
    assert rc == 0, d.output()


@contextmanager
def busy_host(daemon: Daemon) -> Iterator[Samples]:
    """Fixtures in the states that make every non-GPU series exist; yields the scrape."""
    with (
        Fixture.c("listen_write", str(ACCEPTS), ready="STARTED") as srv,
        Fixture.c("condvar_pool", "2") as pool,
    ):
        srv_pid, pool_pid = str(srv.pid), str(pool.pid)
        # Watched before it binds, writes, accepts and waits, so the probes count all of it.
        wait_until(
            daemon,
            lambda s: value(s, "hangwatch_process_threads", pid=srv_pid) is not None,
            "the server to be watched",
        )
        srv.send("go")
        port = srv.wait_for("LISTENING").get_int("port")
        for _ in range(ACCEPTS):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
        srv.wait_for("READY")

        def ready(s: Samples) -> bool:
            return (
                value(s, "hangwatch_process_accepts_total", pid=srv_pid) == ACCEPTS
                and value(s, "hangwatch_process_last_write_age_seconds", pid=srv_pid) is not None
                and (value(s, "hangwatch_futex_wait_seconds_count", pid=srv_pid) or 0) >= 1
                and (value(s, "hangwatch_process_listening_ports", pid=srv_pid) or 0) >= 1
                and value(s, "hangwatch_service_state", pid=pool_pid, state="stalled") == 1
                and value(s, "hangwatch_process_parked_threads", pid=pool_pid) == 3
            )

        yield wait_until(daemon, ready, "the server's evidence and the pool's stall")


def nvml_works(s: Samples) -> bool:
    return value(s, "hangwatch_collector_success", collector="gpu") == 1


def test_every_metric_the_dashboard_queries_is_exported(daemon: Daemon) -> None:
    with busy_host(daemon) as s:
        exported = {name for name, _ in s}
        services = {dict(ls).get("service") for n, ls in s if n == "hangwatch_service_state"}
    queried = dashboard_metric_names() - {"up"}  # `up` is Prometheus's, per scrape target
    assert queried, "the dashboard queries nothing?"
    may_be_absent = set(GPU_PROCESS_FAMILIES)
    if not nvml_works(s):
        may_be_absent |= NVML_DEVICE_FAMILIES
    missing = queried - exported
    assert missing <= may_be_absent, (
        f"the dashboard queries {sorted(missing - may_be_absent)}, which the daemon does not "
        f"export\nexported: {sorted(exported)}\nlog:\n{daemon.output()}"
    )
    # What this host could not produce must at least be what the daemon documents.
    assert missing <= set(golden()), sorted(missing - set(golden()))
    # The $service variable lists these.
    assert {"srv", "pool"} <= services, services


# --- the same queries in a real Prometheus ----------------------------------------------------


def grafana_regex(value: str) -> str:
    """A variable's value as Grafana writes it into a Prometheus query: regex-escaped, then
    escaped again for the PromQL string."""
    return re.sub(r"([\\^$.|?*+()\[\]{}])", r"\\\\\1", value)


# The rate window Grafana's $__rate_interval becomes: four scrape intervals at least.
RATE_INTERVAL = "10s"


def test_every_dashboard_query_returns_data_in_prometheus(daemon: Daemon, tmp_path: Path) -> None:
    prom = Prometheus(tmp_path, daemon.port)
    try:
        with busy_host(daemon) as s:
            # Enough scrapes of the settled state for every rate window.
            deadline = time.monotonic() + 60
            settled = f'count_over_time(up{{job="hangwatch"}}[{RATE_INTERVAL}]) >= 8'
            while time.monotonic() < deadline and not prom.results(settled):
                assert prom.proc.poll() is None, prom.log_path.read_text()
                time.sleep(1)
            assert prom.results(settled), prom.log_path.read_text()
            instance = grafana_regex(f"127.0.0.1:{daemon.port}")
            subs = {
                "$__rate_interval": RATE_INTERVAL,
                "$instance": instance,
                "$service": "(srv|pool)",
            }
            gpu_only = GPU_PROCESS_FAMILIES | (set() if nvml_works(s) else NVML_DEVICE_FAMILIES)
            empty, failed = [], []
            for title, expr in exprs() + variable_queries():
                q = expr
                for k, v in subs.items():
                    q = q.replace(k, v)
                answer = prom.query(q)
                if answer.get("status") != "success":
                    failed.append(f"{title}: {answer.get('error')}\n  {q}")
                elif not answer["data"]["result"]:
                    names = {name for name, _ in metric_selectors(expr)}
                    if not names & gpu_only:
                        empty.append(f"{title}\n  {q}")
    finally:
        prom.stop()
    assert not failed, "queries Prometheus refused:\n" + "\n".join(failed)
    assert not empty, "queries with no data for a busy host:\n" + "\n".join(empty)
