"""Real Ray in the shapes of ``ray_jobs.py`` really is in the shape each claims.

From /proc alone (and HTTP requests where the shape says the proxy answers), never with
hangwatch: which processes make up the cluster, which syscall the stuck threads sleep in and
that they do not run, which TCP connections wait for an answer, what the workers printed to
their log files, how much CPU the processes use. hangwatch is judged against these shapes in
``test_ray_verdicts.py``. Needs the Ray venv (``raylib.missing``): skipped locally without it,
failed under ``CI=true``. Every cluster is killed, and swept, at the end of its test.
"""

from __future__ import annotations

import ast
import http.client
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from scripts.fixturelib import (
    SYS_FUTEX,
    blocked_in,
    futex_wait,
    tasks,
    thread_cpu_ticks,
    wait_until,
)
from scripts.realsw import cpu_ticks
from tests.realsw import raylib
from tests.realsw.raylib import RayJob

# One worker for every Ray test: a cluster's dashboard agent binds port 52365, and
# test_engine_alerts.py's daemon selects any serve_idle or serve_event driver.
pytestmark = pytest.mark.xdist_group("ray")

STILL_S = 2.0  # how long a stuck thread must stay in its wait without running
# The shape, checked from /proc, needs no idle time before its hang (the verdicts do).
QUICK = ("--idle-before", "0")

# The processes of every local cluster (the driver is the root), by their command line.
CLUSTER = ("gcs_server", "raylet", "ray::RuntimeEnvAgent")
SERVE = ("ray::ProxyActor", "ray::ServeController", "ray::ServeReplica:hw:")


@pytest.fixture(autouse=True)
def _ray() -> None:
    raylib.require()


def get(port: int, path: str, timeout: float = 10.0) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read().decode(errors="replace")
    finally:
        conn.close()


def has_processes(job: RayJob, *prefixes: str) -> None:
    """Exactly one process of the tree starts with each of ``prefixes``."""
    found = {p: job.find(p) for p in prefixes}
    wrong = {p: pids for p, pids in found.items() if len(pids) != 1}
    assert not wrong, job.describe(f"want one process each of {prefixes}, found {found}")


def parked_still(pid: int, tids: list[int], seconds: float = STILL_S) -> None:
    """Each of ``tids`` sleeps in futex on one word for ``seconds`` and uses no CPU."""
    before = {t: (futex_wait(pid, t), thread_cpu_ticks(pid, t)) for t in tids}
    assert all(w is not None for w, _ in before.values()), f"not all in futex: {before}"
    time.sleep(seconds)
    after = {t: (futex_wait(pid, t), thread_cpu_ticks(pid, t)) for t in tids}
    assert after == before, f"threads moved: before {before}, after {after}"


def cluster_cores(job: RayJob, seconds: float = 3.0) -> float:
    return sum(raylib.cpu_share(job.tree(), seconds).values())


def no_leftovers(job: RayJob) -> None:
    """After close: nothing holds the job's Ray temp dir any more."""
    assert not raylib.holding(job.temp_dir), f"left running: {raylib.holding(job.temp_dir)}"


# --- Serve: idle, then loaded (one cluster) ---------------------------------------------------


@pytest.fixture(scope="class")
def serve_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayJob]:
    raylib.require()
    with raylib.ray_job("serve_idle", tmp_path_factory.mktemp("rs")) as job:
        yield job
    no_leftovers(job)
    assert not job.swept, f"killing the tree left {job.swept} holding {job.temp_dir}"


class TestServeCluster:
    """One serve_idle cluster, idle then loaded; it ends (checked clean) with the class, so
    its load does not run on beside the clusters of the tests after it."""

    def test_serve_idle_answers_nothing_and_sleeps(self, serve_cluster: RayJob) -> None:
        job = serve_cluster
        has_processes(job, *CLUSTER, *SERVE)
        replica = job.pid_of("replica")
        assert replica in job.find("ray::ServeReplica:hw:Hello"), job.describe("the replica")
        assert not raylib.connections(job.port), "a client is connected to the idle proxy"
        # The replica has answered nothing (its log says so) and it barely wakes.
        shares = raylib.cpu_share(job.tree(), 3.0)
        assert shares[replica] < 0.05, f"the idle replica uses {shares[replica]:.2f} cores"
        assert sum(shares.values()) < 0.5, f"the idle cluster uses {sum(shares.values()):.2f} cores"
        assert "CALL __call__" not in raylib.worker_log(job, replica, "err")
        # Idle, not dead: the proxy listens.
        assert cpu_ticks(job.pid_of("proxy")) > 0

    def test_serve_load_is_answered_continuously(self, serve_cluster: RayJob) -> None:
        job = serve_cluster
        if not job.seen("LOADING"):
            job.send("load")
            job.wait_for("LOADING", timeout=60)
        replica, proxy = job.pid_of("replica"), job.pid_of("proxy")
        before = cpu_ticks(replica)
        shares = raylib.cpu_share([replica, proxy], 3.0)
        assert shares[replica] > 0.05 and shares[proxy] > 0.05, f"not working: {shares}"
        assert cpu_ticks(replica) > before
        assert len(raylib.connections(job.port)) >= 2, "want the outside client connected"
        status, body = get(job.port, "/")
        assert (status, body) == (200, "hello\n")


# --- Serve: hangs ---------------------------------------------------------------------------


def test_serve_abba_replica_threads_hold_each_others_lock(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    with raylib.ray_job("serve_abba", tmp_path_factory.mktemp("rs"), *QUICK) as job:
        has_processes(job, *CLUSTER, *SERVE)
        replica, tids = job.pid_of("replica"), job.info.get_ints("tids")
        assert len(tids) == 2 and set(tids) <= set(tasks(replica)), job.describe("the two tids")
        parked_still(replica, tids)
        # Two requests wait: each a connection from a client outside the driver's tree to the
        # proxy, unanswered.
        assert len(raylib.connections(job.port)) == 4, raylib.connections(job.port)
        assert not job.seen("CLIENT_ERROR")
        # The replica's other threads are alive: the proxy answers its own health check.
        assert get(job.port, "/-/healthz")[0] == 200
    no_leftovers(job)


def test_serve_event_replica_waits_forever(tmp_path_factory: pytest.TempPathFactory) -> None:
    with raylib.ray_job("serve_event", tmp_path_factory.mktemp("rs"), *QUICK) as job:
        has_processes(job, *CLUSTER, *SERVE)
        replica, tids = job.pid_of("replica"), job.info.get_ints("tids")
        assert len(tids) == 1, job.describe("want the waiting thread's tid")
        parked_still(replica, tids)
        assert len(raylib.connections(job.port)) == 2, raylib.connections(job.port)
        assert get(job.port, "/-/healthz")[0] == 200  # the proxy still answers
        assert raylib.cpu_share([replica], 2.0)[replica] < 0.1
    no_leftovers(job)


# --- core Ray -----------------------------------------------------------------------------


def worker_said(job: RayJob, pid: int, token: str, timeout: float = 30.0) -> str:
    """The line ``token ...`` that worker ``pid`` printed to its log."""

    def line() -> str | None:
        found = [ln for ln in raylib.worker_log(job, pid).splitlines() if ln.startswith(token)]
        return found[0] if found else None

    return str(wait_until(line, timeout, f"{token} in worker {pid}'s log"))


def tid_of(line: str) -> int:
    return int(dict(kv.split("=", 1) for kv in line.split()[1:])["tid"])


def test_get_stuck_actor_blocks_in_its_event(tmp_path_factory: pytest.TempPathFactory) -> None:
    with raylib.ray_job("get_stuck_actor", tmp_path_factory.mktemp("rs"), *QUICK) as job:
        has_processes(job, *CLUSTER)
        actor = job.pid_of("actor")
        tid = tid_of(worker_said(job, actor, "BLOCKING"))
        wait_until(lambda: blocked_in(actor, tid) == SYS_FUTEX, 10, "the actor in its Event")
        parked_still(actor, [tid])
        assert raylib.cpu_share([actor], 2.0)[actor] < 0.1
        assert not job.seen("DONE")
    no_leftovers(job)


def test_actor_self_call_never_runs_the_inner_call(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    with raylib.ray_job("actor_self_call", tmp_path_factory.mktemp("rs"), *QUICK) as job:
        actor = job.pid_of("actor")
        tid = tid_of(worker_said(job, actor, "OUTER"))
        wait_until(lambda: blocked_in(actor, tid) is not None, 10, "outer() waiting in ray.get")
        time.sleep(STILL_S)
        assert "INNER" not in raylib.worker_log(job, actor), "inner() ran: no self-deadlock"
        assert raylib.cpu_share([actor], 2.0)[actor] < 0.1
    no_leftovers(job)


UNMET = re.compile(r"No available node types can fulfill resource request (\{[^}]*\})")


def unmet_requests(log: str) -> list[dict[str, float]]:
    """The resource requests the autoscaler's monitor reports it cannot meet, in ``log``."""
    return [ast.literal_eval(m) for m in UNMET.findall(log)]


def test_unmet_requests_are_read_in_either_key_order() -> None:
    log = (
        "No available node types can fulfill resource request {'GPU': 1.0, 'CPU': 1.0}. Add\n"
        "No available node types can fulfill resource request {'CPU': 1.0, 'GPU': 1.0}. Add\n"
    )
    assert unmet_requests(log) == [{"CPU": 1.0, "GPU": 1.0}] * 2
    assert unmet_requests("no such line") == []


def test_infeasible_task_is_never_scheduled(tmp_path_factory: pytest.TempPathFactory) -> None:
    with raylib.ray_job("infeasible_task", tmp_path_factory.mktemp("rs"), *QUICK) as job:
        has_processes(job, *CLUSTER)
        # The autoscaler's monitor reports the demand it cannot meet (every 5 s). The request
        # is a protobuf map printed as a dict: its keys come in either order from run to run.
        monitor = job.logs() / "monitor.log"
        wait_until(
            lambda: {"CPU": 1.0, "GPU": 1.0} in unmet_requests(monitor.read_text()),
            90,  # the monitor's first report can take a minute on a loaded 2-CPU machine
            "the infeasible GPU demand in monitor.log",
        )
        assert not job.find("ray::needs_gpu"), "a worker runs the task"
        assert cluster_cores(job) < 0.5
    no_leftovers(job)


def test_tasks_computing_use_the_cpus(tmp_path_factory: pytest.TempPathFactory) -> None:
    with raylib.ray_job("tasks_computing", tmp_path_factory.mktemp("rs")) as job:
        wait_until(lambda: len(job.find("ray::compute")) == 2, 30, "two compute workers")
        workers = job.find("ray::compute")
        shares = raylib.cpu_share(workers, 3.0)
        # > 0.1: the 2 cores here are shared with other tests; an idle worker uses < 0.01
        assert all(s > 0.1 for s in shares.values()), f"the tasks do not compute: {shares}"
        assert not job.seen("DONE")
    no_leftovers(job)


def test_temp_dir_is_under_the_test(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Logs are per test, and the path is short enough for Ray's unix sockets."""
    base = tmp_path_factory.mktemp("rs")
    assert raylib.temp_dir_for(base).parent == base
    with pytest.raises(Exception, match="too long"):
        raylib.temp_dir_for(Path("/tmp") / ("x" * 60))
