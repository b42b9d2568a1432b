"""`hangwatch job`: ask Prometheus for a job's ranks and print them side by side.

Six instant queries over the daemon's raw series (not the recording rules: the command must
work against a Prometheus that does not load them). Each aggregates to the labels that
agent.jobs.ranks reads (the job key, `instance`, `service_pid`, `rank`, and `pid` where it
shows them), which drops a federation's extra labels and duplicate series; ranks.py gives the
same answer for the raw per-process series.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import TextIO

from ..errors import HangwatchError, UsageError
from ..model import JOB_KEY_LABEL
from . import ranks, render
from .prom import Endpoint, Prometheus, check_timeout

_BY = f"service, {JOB_KEY_LABEL}, instance, service_pid"
_PARKED = 'hangwatch_process_parked_seconds{rank!=""}'
_RECENT = f"{ranks.RECENT_S // 60}m"
QUERIES = {
    "parked": f"min by ({_BY}, rank, pid) ({_PARKED})",
    "states": f'count by ({_BY}, rank, state) (hangwatch_process_state{{rank!=""}} == 1)',
    "sites": f'count by ({_BY}, rank, pid, site) (hangwatch_process_waiting_at{{rank!=""}})',
    "world_sizes": f'max by ({_BY}) (hangwatch_process_world_size{{rank!=""}})',
    "thresholds": "max by (instance) (hangwatch_park_threshold_seconds)",
    # How long ago each rank was last scraped in the last 15 minutes, and on which instance:
    # the latest sample's own timestamp (timestamp() in a subquery, off by at most its step).
    # A rank the subquery's steps missed (it lived between two) is still seen: age NaN.
    "last_seen": f"min by ({_BY}, rank) (time() - max_over_time("
    f"timestamp({_PARKED})[{_RECENT}:10s]))"
    f" or min by ({_BY}, rank) (last_over_time({_PARKED}[{_RECENT}]) * 0 + NaN)",
}


@dataclass(frozen=True)
class JobOptions:
    prometheus: str
    job: str | None = None
    as_json: bool = False
    timeout_s: float = 10.0


def read(client: Prometheus) -> ranks.Inputs:
    return ranks.Inputs(**{field: client.query(expr) for field, expr in QUERIES.items()})


def run(opts: JobOptions, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """0: the job's ranks are all visible (stalled or not); 1: some are not; 2: no job picked;
    4: Prometheus unavailable (an UnavailableError, as the CLI prints it)."""
    out = out or sys.stdout
    err = err or sys.stderr
    endpoint = Endpoint.parse(opts.prometheus)
    if opts.job is not None and not opts.job.strip():
        raise UsageError("--job ''", "give a job's name, as the list without --job prints it")
    client = Prometheus(endpoint, check_timeout(opts.timeout_s))
    views = ranks.jobs(read(client))
    for w in dict.fromkeys(client.warnings):
        print(f"hangwatch: Prometheus warns: {render.clean(w, 300)}", file=err)
    names = ranks.labels_for(views)
    where = f"Prometheus at {endpoint.shown}"
    try:
        shown = ranks.select(views, opts.job, where)
    except HangwatchError:  # none picked: the jobs to pick from, then the reason (stderr)
        if opts.as_json:
            out.write(json.dumps(render.document(endpoint.shown, views, names, None)) + "\n")
        elif views:
            out.write(render.jobs_text(views, names))
        raise
    name = names[shown.key]
    if opts.as_json:
        out.write(json.dumps(render.document(endpoint.shown, views, names, shown)) + "\n")
    else:
        out.write(render.job_text(shown, name))
    if not shown.missing:
        return 0
    print(
        f"hangwatch: job {render.clean(name)}: {len(shown.missing)} of {len(shown.ranks)} ranks "
        f"not visible in {where}: {render.not_visible_text(shown)}; their hosts' hangwatch may be "
        "down or not scraped by this Prometheus (see `up` for their targets)",
        file=err,
    )
    return 1
