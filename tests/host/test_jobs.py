"""`hangwatch job`'s queries answered by Prometheus's own engine (promtool's rule tests on
series of a job); the rest of tests/test_jobs.py needs no process."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import yaml

from agent.jobs.command import QUERIES
from tests.conftest import run_promtool
from tests.test_jobs import ALL_REDUCE, RUN_7, STATES


def _series(name: str, values: str, **labels: str) -> dict[str, str]:
    inner = ",".join(f"{k}={json.dumps(v)}" for k, v in sorted(labels.items()))
    return {"series": f"{name}{{{inner}}}", "values": values}


def test_the_queries_answer_in_prometheus_s_own_engine(promtool: str, tmp_path: Path):
    """Every 5 s for 5 minutes: rank 0 (and a DataLoader worker) parked on node-a, rank 1
    working on node-b, rank 2 on node-c gone after 2 minutes, rank 3 scraped once between two
    of the last-seen subquery's steps; the series federated, with a `cluster` label."""
    job = {"service": "torchrun", **RUN_7, "slurm_job_id": "", "job": "hw"}
    job |= {"service_pid": "100", "cluster": "east"}
    r0 = {**job, "rank": "0", "instance": "node-a:9817", "pid": "1000", "comm": "python3"}
    r0w = {**r0, "pid": "1001", "comm": "pt_data_worker"}
    r1 = {**job, "rank": "1", "instance": "node-b:9817", "pid": "2000", "comm": "python3"}
    r2 = {**job, "rank": "2", "instance": "node-c:9817", "pid": "3000", "comm": "python3"}
    r3 = {**job, "rank": "3", "instance": "node-d:9817", "pid": "4000", "comm": "python3"}
    parked = "hangwatch_process_parked_seconds"
    series = [
        _series(parked, "60+5x60", **r0),
        _series(parked, "90+5x60", **r0w),
        _series(parked, "0x60", **r1),
        _series(parked, "60+5x24 stale", **r2),
        _series(parked, "_ 10 stale", **r3),
        _series("hangwatch_process_waiting_at", "1x60", **r0, site=ALL_REDUCE),
        _series("hangwatch_process_world_size", "4x60", **r0),
    ]
    for labels, state in ((r0, "stalled"), (r0w, "stalled"), (r1, "progressing")):
        for s in STATES:
            series.append(
                _series("hangwatch_process_state", f"{int(s == state)}x60", **labels, state=s)
            )

    def kept(labels: Mapping[str, str], *names: str) -> str:
        by = ("service", "job_key", "instance", "service_pid", *names)
        return "{" + ",".join(f"{k}={json.dumps(labels[k])}" for k in by if labels.get(k)) + "}"

    expect = {
        QUERIES["parked"]: [
            (kept(r0, "rank", "pid"), 360.0),
            (kept(r0w, "rank", "pid"), 390.0),
            (kept(r1, "rank", "pid"), 0.0),
        ],
        QUERIES["states"]: [
            (kept({**r0, "state": "stalled"}, "rank", "state"), 2.0),
            (kept({**r1, "state": "progressing"}, "rank", "state"), 1.0),
        ],
        QUERIES["sites"]: [(kept({**r0, "site": ALL_REDUCE}, "rank", "pid", "site"), 1.0)],
        QUERIES["world_sizes"]: [(kept(r0), 4.0)],
        # Ages: NaN where the subquery missed the rank (a comparison drops NaN).
        f"({QUERIES['last_seen']}) >= 0": [
            (kept(r0, "rank"), 0.0),
            (kept(r1, "rank"), 0.0),
            (kept(r2, "rank"), 180.0),
        ],
        f"count by (rank) ({QUERIES['last_seen']})": [(f'{{rank="{n}"}}', 1.0) for n in range(4)],
    }
    tests = [
        {
            "expr": expr,
            "eval_time": "5m",
            "exp_samples": [{"labels": labels, "value": value} for labels, value in samples],
        }
        for expr, samples in expect.items()
    ]
    doc = {
        "rule_files": [],
        "evaluation_interval": "10s",
        "tests": [{"interval": "5s", "input_series": series, "promql_expr_test": tests}],
    }
    path = tmp_path / "queries.test.yml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    run_promtool(promtool, "test", "rules", str(path))
