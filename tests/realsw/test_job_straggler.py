"""One real job over two "hosts": which rank holds the others up, and where it waits.

A torchrun job of 4 ranks runs as two nodes on this machine (``torchrun --nnodes=2
--nproc_per_node=2`` twice, static rendezvous: node 0 has ranks 0 and 1, node 1 ranks 2 and 3).
Two daemons watch one node each, as two hosts' agents would: each one's config matches only its
node's torchrun agent (by ``--node_rank``), and the workers come with it as its descendants.
One real Prometheus (Debian's package) scrapes both as two targets of job "hangwatch" and
evaluates the shipped rules, unchanged (deploy/prometheus).

For each hang shape the odd rank is rank 2, on the second daemon's instance; the alert
HangwatchJobStraggler and ``hangwatch job --prometheus URL --job ID --json`` must both name it,
its instance and its site (or why it has none), within the park threshold plus two scrape
intervals of the moment the hang formed (plus one rule evaluation and one daemon tick, the
chain's own steps). A healthy training loop over the same two nodes must name nobody. One rank
computing for minutes is no hang until the threshold says so: nobody is named before it.

Needs root and bcc (as ``tests/privileged``) and the real-software venv: skipped locally without
them, failed under ``CI=true``.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from scripts import realsw
from scripts.fixturelib import REPO_ROOT
from tests.privileged.daemonlib import INTERVAL, Daemon
from tests.privileged.harness import line_of
from tests.privileged.promlib import Prometheus
from tests.realsw.test_alerts import daemon_watching

pytestmark = [pytest.mark.privileged, pytest.mark.usefixtures("needs_bpf")]

ALERT = "HangwatchJobStraggler"
THRESHOLD = 10.0  # the daemons' park threshold: a rank turns stalled past it
SCRAPE_S = 2
EVAL_S = 1.0  # Prometheus's rule evaluation interval (promlib)
# The done-criterion: threshold + two scrapes, and the chain's own steps (a daemon tick that
# sees the park pass the threshold, one rule evaluation after the scrape that brings it).
NAMED_WITHIN_S = THRESHOLD + 2 * SCRAPE_S + EVAL_S + INTERVAL
JOBS = "tests/realsw/torch_jobs.py"
ODD = 2


def job_line(text: str) -> str:
    return f"torch_jobs.py:{line_of(JOBS, text)}"


@dataclass
class Cluster:
    nodes: tuple[Daemon, Daemon]
    prom: Prometheus

    def instance(self, node: int) -> str:
        return f"127.0.0.1:{self.nodes[node].port}"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("job-straggler")
    with contextlib.ExitStack() as stack:
        nodes = tuple(
            stack.enter_context(
                daemon_watching(
                    _mkdirs(tmp / f"node{n}"),
                    {"torchrun": rf"torchrun .*--node_rank={n}\b"},
                    threshold=THRESHOLD,
                )
            )
            for n in (0, 1)
        )
        rules = sorted((REPO_ROOT / "deploy" / "prometheus").glob("*.yml"))
        prom = Prometheus(tmp, [d.port for d in nodes], rules, scrape_s=SCRAPE_S)
        stack.callback(prom.stop)
        c = Cluster(nodes, prom)  # type: ignore[arg-type]
        until(lambda: len(prom.results("up == 1") or []) == 2, "both daemons scraped", 60)
        yield c


def until(check: Callable[[], bool], what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.25)


def _mkdirs(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def two_node_job(shape: str, run_id: str, *args: str) -> Iterator[dict[int, int]]:
    """The job's ranks in place: rank -> pid, from their READY lines."""
    node0, node1 = realsw.node_jobs(shape, run_id, *args)
    with node0, node1:
        ranks = {**node0.ranks(2), **node1.ranks(2)}
        assert sorted(ranks) == [0, 1, 2, 3], ranks
        yield {r: line.get_int("pid") for r, line in ranks.items()}


def stragglers(prom: Prometheus, run_id: str) -> set[tuple[str, str, str, str]] | None:
    """(rank, rank_instance, site, reason) of the firing alerts for the job; None when
    Prometheus did not answer."""
    alerts = prom.alerts()
    return {
        (
            a["labels"].get("rank", ""),
            a["labels"].get("rank_instance", ""),
            a["labels"].get("site", ""),
            a["labels"].get("reason", ""),
        )
        for a in alerts
        if a["labels"].get("alertname") == ALERT
        and a["labels"].get("torchelastic_run_id") == run_id
        and a["state"] == "firing"
    }


def hangwatch_job(prom: Prometheus, run_id: str, *flags: str) -> subprocess.CompletedProcess[str]:
    """``hangwatch job`` for the job, as the engineer at the terminal runs it."""
    argv = ["-m", "agent", "job", "--prometheus", prom.url, "--job", run_id, *flags]
    return subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, timeout=60, cwd=REPO_ROOT
    )


def job_cli(prom: Prometheus, run_id: str) -> tuple[int, dict]:
    out = hangwatch_job(prom, run_id, "--json")
    assert out.stdout, f"hangwatch job printed nothing (exit {out.returncode}): {out.stderr}"
    return out.returncode, json.loads(out.stdout)


def wait_named(
    c: Cluster, run_id: str, since: float, within: float
) -> tuple[float, set[tuple[str, str, str, str]]]:
    """Seconds from ``since`` until the alert fires for the job, and what it names."""
    deadline = since + within + 30  # past the bound: to report how late, not just that
    while time.monotonic() < deadline:
        named = stragglers(c.prom, run_id)
        if named:
            return time.monotonic() - since, named
        time.sleep(0.25)
    records: dict[str, object] = {
        expr: c.prom.results(f'{expr}{{torchelastic_run_id="{run_id}"}}')
        for expr in (
            "hangwatch:job_rank_instance",
            "hangwatch:job_rank_gone",
            "hangwatch:job_rank_site",
            "hangwatch:job_rank_stalled",
            "hangwatch:job_parked_seconds:max",
        )
    }
    hosts = c.prom.results("hangwatch_build_info")
    for expr in (
        f'count_over_time(hangwatch_process_parked_seconds{{torchelastic_run_id="{run_id}"}}[10m])',
        f'count_over_time(hangwatch:job_rank_instance:timestamp{{torchelastic_run_id="{run_id}"}}[10m])',
        f'count_over_time(hangwatch:job_rank_instance{{torchelastic_run_id="{run_id}"}}[10m])',
        "count_over_time(up[10m])",
        "count by (instance, rank) (count_over_time(hangwatch_process_threads[10m]))",
    ):
        records[expr] = [(r["metric"], r["value"][1]) for r in c.prom.results(expr) or []]
    logs = "\n".join(d.output()[-3000:] for d in c.nodes)
    pytest.fail(f"{ALERT} never fired for {run_id}; records: {records}; hosts: {hosts}\n{logs}")


HANGS = {
    # shape: (reason, the odd rank's site, the others' site)
    "job_dataloader_stuck": (
        "other site",
        job_line("the odd rank waits here for its batch"),
        job_line("the others wait here for the odd rank"),
    ),
    "job_other_collective": (
        "other site",
        job_line("where the others all-reduce"),
        job_line("the collective the odd rank never calls"),
    ),
    "job_rank_killed": ("missing", "", job_line("dist.new_group(backend=")),
    "job_long_compute": ("not parked", "", job_line("the others wait here while the odd")),
}


@pytest.mark.parametrize("shape", list(HANGS))
def test_the_rank_the_others_wait_for_is_named_with_its_host_and_site(
    cluster: Cluster, shape: str
) -> None:
    reason, odd_at, others_at = HANGS[shape]
    run_id = f"e2e-{shape.removeprefix('job_').replace('_', '-')}"
    odd_host = cluster.instance(1)
    with two_node_job(shape, run_id) as pids:
        formed = time.monotonic()
        if shape == "job_rank_killed":
            # A rank the rules never saw cannot be named: first, every rank in Prometheus.
            until(
                lambda: (
                    len(
                        cluster.prom.results(
                            f'hangwatch:job_rank_instance{{torchelastic_run_id="{run_id}"}}'
                        )
                        or []
                    )
                    == 4
                ),
                "the 4 ranks in Prometheus",
                30,
            )
            realsw.kill_tree(pids[ODD])  # its node's agent then tears down rank 3 too
            formed = time.monotonic()
        if shape == "job_long_compute":
            # Computing is work: nobody is named while the waiting ranks are under the threshold.
            while time.monotonic() < formed + THRESHOLD - 1:
                assert not stragglers(cluster.prom, run_id), "named before the threshold"
                time.sleep(0.5)
        took, named = wait_named(cluster, run_id, formed, NAMED_WITHIN_S)
        print(f"{shape}: {ALERT} fired {took:.1f} s after the hang formed: {sorted(named)}")
        if shape == "job_rank_killed":
            # Rank 3 was torn down by its agent with it: both are gone, both from node 1.
            assert {(r, h, reason) for r, h, _, reason in named} >= {(str(ODD), odd_host, reason)}
            assert {r for r, *_ in named} <= {"2", "3"}, named
            assert all(h == odd_host and rs == reason for _, h, _, rs in named), named
        else:
            assert len(named) == 1, named
            ((rank, host, site, why),) = named
            assert (rank, host, why) == (str(ODD), odd_host, reason), named
            assert site.endswith(f"({odd_at})") if odd_at else site == "", site
        assert took <= NAMED_WITHIN_S, f"named {took:.1f} s after, past {NAMED_WITHIN_S:g} s"
        rc, view = job_cli(cluster.prom, run_id)
        check_cli(view, named, others_at)
        text = hangwatch_job(cluster.prom, run_id)
        print(f"$ hangwatch job --prometheus {cluster.prom.url} --job {run_id}")  # -rA: real output
        print(text.stdout + text.stderr)
        rows = [ln.split()[:2] for ln in text.stdout.splitlines()]
        assert [str(ODD), odd_host] in rows, text.stdout  # the table names it and its host
        assert rc == (1 if shape == "job_rank_killed" else 0), (rc, view)


def check_cli(view: dict, named: set[tuple[str, str, str, str]], others_at: str) -> None:
    """The command names what the alert named, odd ranks first, and where the rest wait."""
    ranks = view["job"]["ranks"]
    odd = [r for r in ranks if r["reason"]]
    got = {(r["rank"], (r["instances"] or [""])[0], r["site"] or "", r["reason"]) for r in odd}
    assert got == named, view
    assert ranks[: len(odd)] == odd, "odd ranks first"
    rest = [r for r in ranks if not r["reason"]]
    sites = [r["site"] for r in rest]
    assert rest and all((s or "").endswith(f"({others_at})") for s in sites), (sites, view)


def test_a_healthy_training_loop_over_two_nodes_names_nobody(cluster: Cluster) -> None:
    run_id = "e2e-training-loop"
    with two_node_job("training_loop", run_id, "--log-seconds", "2"):
        watched = time.monotonic()
        while time.monotonic() < watched + THRESHOLD + 3 * SCRAPE_S:
            assert not stragglers(cluster.prom, run_id), cluster.prom.alerts()
            time.sleep(0.5)
        rc, view = job_cli(cluster.prom, run_id)
    assert rc == 0, view
    ranks = view["job"]["ranks"]
    assert len(ranks) == 4 and not any(r["reason"] for r in ranks), view
