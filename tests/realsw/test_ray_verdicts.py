"""hangwatch's verdicts on real Ray (``ray_jobs.py``): ``diagnose`` rooted at the driver, and
the daemon, on each shape, against the TRUTH of the shape (``test_ray_shapes.py`` checks it
from /proc), not against what hangwatch says today.

As ``test_verdicts.py``: the hangs get ``--threshold 10 --duration 5`` once they are HANG_AGE
old, and where one process holds the service up its PID must be the culprit; the healthy shapes
get ``--threshold 2``. A local Ray cluster is 11-12 processes and ~290 threads even when idle,
most of them parked, and its daemons write all the time without doing any work: the raylet
rewrites ``logs/debug_state.txt`` (~19 KiB) every 10 s, the autoscaler's monitor appends to
``monitor.log`` every 5 s, every process sends metrics to the dashboard agent and the Serve
controller polls the GCS ~30 times a second. None of that is progress of the service.

Needs root and bcc and the Ray venv: skipped locally without them, failed under ``CI=true``.
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from scripts.fixturelib import wait_until
from tests.privileged import daemonlib
from tests.privileged.daemonlib import running_daemon
from tests.privileged.harness import Diagnosis
from tests.realsw import raylib
from tests.realsw.raylib import RayJob
from tests.realsw.test_verdicts import (
    HANG_THRESHOLD,
    HOLD_S,
    answers_counted,
    culprit_is,
    diagnose,
    expect,
    hold,
    states_of,
    targets_config,
)

# hangwatch attaches: root and bcc, as tests/privileged (conftest.needs_bpf)
# One worker for every Ray test: a cluster's dashboard agent binds port 52365, and
# test_engine_alerts.py's daemon selects any serve_idle or serve_event driver.
pytestmark = [
    pytest.mark.privileged,
    pytest.mark.usefixtures("needs_bpf"),
    pytest.mark.xdist_group("ray"),
]

HANG_AGE = 30.0  # a Ray hang is diagnosed once this old (its evidence must carry its age)


@pytest.fixture(autouse=True)
def _ray() -> None:
    raylib.require()


def diagnose_hang(job: RayJob, began: float) -> Diagnosis:
    """``diagnose --threshold 10 --duration 5`` on the driver once the hang is HANG_AGE old."""
    time.sleep(max(0.0, began + HANG_AGE - time.monotonic()))
    return diagnose(job.driver, threshold=HANG_THRESHOLD)


@contextlib.contextmanager
def hang(shape: str, base: Path) -> Iterator[tuple[RayJob, Diagnosis]]:
    """Start the shape, diagnose it HANG_AGE after READY; the cluster lives in the block."""
    with raylib.ray_job(shape, base) as job:
        yield job, diagnose_hang(job, time.monotonic())


# --- Serve: idle, then loaded (one cluster) ---------------------------------------------------


@pytest.fixture(scope="class")
def serve_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayJob]:
    raylib.require()
    with raylib.ray_job("serve_idle", tmp_path_factory.mktemp("rv")) as job:
        yield job


class TestServeCluster:
    """One serve_idle cluster for these, idle first, then loaded; it ends with the class, so
    its load does not run on beside the clusters of the tests after it."""

    def test_serve_idle_is_idle(self, serve_cluster: RayJob) -> None:
        """Proxy, controller and one replica up, no request ever: idle. The raylet's and the
        monitor's periodic log writes are not progress."""
        job = serve_cluster
        if job.seen("LOADING"):
            pytest.skip("the shared cluster is already loaded (test order)")
        d = diagnose(job.driver)
        expect(d, job.driver, "serve_idle", "idle")

    def test_daemon_serve_idle_holds_idle(self, serve_cluster: RayJob, tmp_path: Path) -> None:
        """The daemon (2 s threshold) on the idle Serve driver: idle, scrape after scrape. On the
        shared cluster, before anything loads it."""
        job = serve_cluster
        if job.seen("LOADING"):
            pytest.skip("the shared cluster is already loaded (test order)")
        daemon_holds(job, tmp_path, "idle")

    def test_serve_short_connections_is_progressing(self, serve_cluster: RayJob) -> None:
        """Requests from outside, each on a new connection (as curl and health checkers), about
        25 a second: every connection closes before a tick can name its fd. The proxy's answers
        are its progress, counted when written; not "all threads parked"."""
        job = serve_cluster
        if job.seen("LOADING"):
            pytest.skip("the shared cluster is already loaded (test order)")
        answered, stop = [0], threading.Event()

        def ask() -> None:
            while not stop.wait(0.04):
                with urllib.request.urlopen(f"http://127.0.0.1:{job.port}/", timeout=10) as r:
                    r.read()
                answered[0] += 1

        client = threading.Thread(target=ask, daemon=True)
        client.start()
        try:
            wait_until(lambda: answered[0] >= 5, 60, "the first answers through the proxy")
            d = diagnose(job.driver)
        finally:
            stop.set()
            client.join(timeout=15)
        svc = expect(d, job.driver, "serve_short", "progressing")
        assert answers_counted(svc), d.explain("the proxy's answers were not counted")

    def test_serve_load_is_progressing(self, serve_cluster: RayJob) -> None:
        """A driver thread sends requests back to back (~1 k/s) through proxy and replica."""
        job = serve_cluster
        if not job.seen("LOADING"):
            job.send("load")
            job.wait_for("LOADING", timeout=60)
        d = diagnose(job.driver)
        expect(d, job.driver, "serve_load", "progressing")


# --- Serve: hangs ---------------------------------------------------------------------------


def test_serve_abba_is_stalled(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Two replica threads, each holding one threading.Lock and waiting for the other's; two
    requests wait at the proxy. A deadlock, but Python locks are semaphores (futex words with
    no owner), so no kernel-visible cycle: stalled at least, deadlocked if proven."""
    with hang("serve_abba", tmp_path_factory.mktemp("rv")) as (job, d):
        replica = job.pid_of("replica")
    svc = expect(d, job.driver, job.shape, "stalled", "deadlocked")
    culprit_is(d, svc, replica, "the Serve replica whose threads are in the lock cycle")


def test_serve_event_is_stalled(tmp_path_factory: pytest.TempPathFactory) -> None:
    """A replica thread waits on an Event nobody sets; the request waits at the proxy, which
    still answers its health checks."""
    with hang("serve_event", tmp_path_factory.mktemp("rv")) as (job, d):
        replica = job.pid_of("replica")
    svc = expect(d, job.driver, job.shape, "stalled")
    culprit_is(d, svc, replica, "the Serve replica waiting on its Event")


# --- core Ray -----------------------------------------------------------------------------


def test_get_stuck_actor_is_stalled(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The driver in ray.get on an actor method that waits on an Event forever."""
    with hang("get_stuck_actor", tmp_path_factory.mktemp("rv")) as (job, d):
        actor = job.pid_of("actor")
    svc = expect(d, job.driver, job.shape, "stalled")
    culprit_is(d, svc, actor, "the actor's worker, blocked in its method")


def test_actor_self_call_is_stalled(tmp_path_factory: pytest.TempPathFactory) -> None:
    """An actor with one slot ray.get()s a call to itself: a deadlock the kernel cannot see
    (it is in Ray's task queue), so stalled; deadlocked would also be true. The actor waits in
    ``ray.get`` with a timeout, as its caller does, and its one untimed wait began with the
    log monitor's (woken by the line it logged): the evidence singles it out only when its
    log line dates the stop. So the culprit is the actor or nobody, never another process."""
    with hang("actor_self_call", tmp_path_factory.mktemp("rv")) as (job, d):
        actor = job.pid_of("actor")
    svc = expect(d, job.driver, job.shape, "stalled", "deadlocked")
    named = (svc.get("culprit") or {}).get("pid")
    assert named in (None, actor), d.explain(f"want the actor ({actor}) or no culprit: {named}")


def test_infeasible_task_is_stalled(tmp_path_factory: pytest.TempPathFactory) -> None:
    """A num_gpus=1 task on a CPU-only node is never scheduled; the driver waits in ray.get.
    No process holds it up (no worker runs it), so no culprit is required."""
    with hang("infeasible_task", tmp_path_factory.mktemp("rv")) as (job, d):
        pass
    expect(d, job.driver, job.shape, "stalled")


# --- core Ray: healthy ------------------------------------------------------------------------


def test_tasks_computing_is_progressing(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Two tasks in pure Python loops; the driver waits in ray.get for them."""
    with raylib.ray_job("tasks_computing", tmp_path_factory.mktemp("rv")) as job:
        wait_until(lambda: len(job.find("ray::compute")) == 2, 30, "two compute workers")
        d = diagnose(job.driver)
    expect(d, job.driver, job.shape, "progressing")


# --- the daemon ----------------------------------------------------------------------------


def driver_regex(job: RayJob) -> str:
    """The driver's command line only: Ray's other processes rewrite theirs."""
    return rf"ray_jobs\.py --shape {job.shape} --temp-dir {re.escape(str(job.temp_dir))}"


def daemon_holds(job: RayJob, base: Path, state: str) -> None:
    """The daemon (2 s threshold) on ``job``'s driver reaches ``state`` and every scrape says
    it for HOLD_S. The clusters are the diagnose tests' own: a start each saved."""
    cfg, port = targets_config(base, {"ray": driver_regex(job)})
    with running_daemon(cfg, port) as d:
        daemonlib.wait_until(
            d,
            lambda s: states_of(s, "ray", job.driver) == [state],
            f"the Ray driver {job.driver} ({job.shape}) to be {state}",
            timeout=40,
        )
        hold(d, "ray", job.driver, state, HOLD_S)


def test_daemon_get_stuck_actor_holds_stalled(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The daemon (2 s threshold) on the stuck actor's driver, started as the hang begins:
    stalled, scrape after scrape. A cluster of its own: a daemon first started on the hang
    diagnose left (~60 s old) once said progressing on its second tick (stalled, then
    "no progress for 1.0 s, under the 2.0 s threshold"), so sharing waits for that fix."""
    base = tmp_path_factory.mktemp("rd")
    with raylib.ray_job("get_stuck_actor", base) as job:
        daemon_holds(job, base, "stalled")
