"""deploy/grafana/hangwatch.json against a real daemon: every metric it queries is exported,
and every query returns data from a real Prometheus scraping that daemon and evaluating
deploy/prometheus/hangwatch-rules.yml (the Jobs row reads the job rules' records).

The daemon watches a server that listens, writes, accepts and waits on a futex
(fixtures/listen_write) and a parked condition-variable pool (fixtures/condvar_pool), which
between them make every non-GPU series exist, and, for the Jobs row, three ranks of one job, one
short of their WORLD_SIZE: two stalled thread pools (fixtures/py_pool.py) waiting at one site and
a rank waiting at another (fixtures/rank_waits.py, with a helper child that inherits its RANK).
GPU series need NVML and a process holding GPU memory: they are listed below and checked against
tests/golden/metrics.txt instead when the host cannot produce them (tests/test_deploy.py checks
every dashboard name against it too).
"""

from __future__ import annotations

import os
import re
import socket
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
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
    RULES,
    dashboard_metric_names,
    exprs,
    golden,
    metric_selectors,
    variable_queries,
)

# serial: its daemon selects fixture programs by name, so it would watch other tests' copies too
pytestmark = pytest.mark.serial

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
  - name: job
    cmdline: "fixtures/(py_pool|rank_waits)\\\\.py"
"""
ACCEPTS = 2
# The Jobs row's job: ranks 0 to 2 run (each its own service root, as on three hosts), rank 3
# never does.
JOB_ID = "dashboard-job"
JOB_RANKS = 3
JOB_WORLD_SIZE = 4

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


def _sites(s: Samples) -> dict[str, str]:
    """pid -> site of every process that waits somewhere."""
    return {
        dict(ls)["pid"]: dict(ls)["site"]
        for (name, ls), v in s.items()
        if name == "hangwatch_process_waiting_at" and v == 1
    }


@contextmanager
def stalled_job(daemon: Daemon) -> Iterator[Samples]:
    """A stalled job for the Jobs row: ranks 0 and 1, thread pools that nothing will wake but
    from outside (stalled), wait at one site, and rank 2 at another (deadlocked: its helper
    child waits on an event nobody sets, which proves no waker); WORLD_SIZE is one more than
    the ranks that run. Rank 2 is a straggler at another site, one rank is missing. Yields the
    scrape."""
    env = {**os.environ, "WORLD_SIZE": str(JOB_WORLD_SIZE), "TORCHELASTIC_RUN_ID": JOB_ID}
    with ExitStack() as stack:
        pools = [
            stack.enter_context(Fixture.py("py_pool", "2", env={**env, "RANK": str(r)}))
            for r in range(JOB_RANKS - 1)
        ]
        odd = stack.enter_context(Fixture.py("rank_waits", env={**env, "RANK": str(JOB_RANKS - 1)}))
        pids = [str(p.pid) for p in pools]

        def ready(s: Samples) -> bool:
            sites = _sites(s)
            common = {sites.get(p) for p in pids}
            return (
                len(common) == 1
                and None not in common
                and sites.get(str(odd.pid)) not in common | {None}
                and all(
                    value(s, "hangwatch_process_state", pid=p, state="stalled") == 1 for p in pids
                )
            )

        yield wait_until(daemon, ready, "the job's ranks stalled at two sites")


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
    prom = Prometheus(tmp_path, daemon.port, [RULES])
    try:
        with busy_host(daemon) as s, stalled_job(daemon):
            # Enough scrapes of the settled state for every rate window, and the job rules'
            # verdict on the job.
            deadline = time.monotonic() + 60
            settled = [
                f'count_over_time(up{{job="hangwatch"}}[{RATE_INTERVAL}]) >= 8',
                f'hangwatch:job_rank_straggler{{job_key="rdzv:{JOB_ID}"}}',
            ]
            while time.monotonic() < deadline and not all(prom.results(q) for q in settled):
                assert prom.proc.poll() is None, prom.log_path.read_text()
                time.sleep(1)
            assert all(prom.results(q) for q in settled), prom.log_path.read_text()
            (odd,) = prom.results(settled[1]) or []
            assert odd["metric"]["rank"] == str(JOB_RANKS - 1), odd
            assert odd["metric"]["reason"] == "other site", odd
            instance = grafana_regex(f"127.0.0.1:{daemon.port}")
            subs = {
                "$__rate_interval": RATE_INTERVAL,
                "$instance": instance,
                "$service": "(srv|pool|job)",
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
