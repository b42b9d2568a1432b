"""`hangwatch job`: a job's ranks from Prometheus series (agent.jobs.ranks, pure), the text and
JSON it prints (agent.jobs.render), and the command against a local HTTP server that answers
like the Prometheus API (agent.jobs.prom, through agent.cli.main)."""

from __future__ import annotations

import json
import socket
import string
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable
from urllib.parse import parse_qs, urlsplit

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from agent.cli import main
from agent.errors import EXIT_UNAVAILABLE, EXIT_USAGE, HangwatchError, UsageError
from agent.jobs import ranks, render
from agent.jobs.command import QUERIES
from agent.jobs.prom import Endpoint, _origin, redacted
from agent.jobs.ranks import (
    GONE,
    NEVER_SEEN,
    NOT_PARKED,
    OTHER_SITE,
    Inputs,
    JobKey,
    JobView,
    Sample,
    jobs,
    select,
)

ALL_REDUCE = "all_reduce (train.py:57)"
NEXT = "__next__ (train.py:60)"
STATES = ("deadlocked", "stalled", "idle", "progressing")


@dataclass(frozen=True)
class Rank:
    """One rank as its host's hangwatch exports it: a leading process and its workers."""

    rank: int | str
    host: str
    parked: float = 125.0
    state: str = "stalled"
    site: str | None = ALL_REDUCE
    workers: int = 0  # DataLoader workers: the same rank label, no site
    service_pid: str = "100"
    extra: Mapping[str, str] = field(default_factory=dict)  # a federation's labels


# A job with torchrun's --rdzv_id: its key and the run id label beside it.
RUN_7 = {"job_key": "rdzv:run-7", "torchelastic_run_id": "run-7"}


def processes(r: Rank, job: Mapping[str, str]) -> Iterator[dict[str, str]]:
    base = 1000 + 10 * int(str(r.rank)) if str(r.rank).isdigit() else 5000
    for i in range(1 + r.workers):
        yield {
            "service": "torchrun",
            "service_pid": r.service_pid,
            "pid": str(base + i),
            "comm": "python3" if i == 0 else "pt_data_worker",
            "rank": str(r.rank),
            "local_rank": "0",
            "instance": r.host,
            "job": "hangwatch",
            **job,
            **r.extra,
        }


def inputs(
    rs: Sequence[Rank],
    *,
    job: Mapping[str, str] | None = None,
    world: int | None = None,
    gone: Sequence[tuple[int | str, str, float]] = (),
) -> Inputs:
    """The raw per-process series of these ranks: what `hangwatch_process_*{rank!=""}` gives
    (every state series, 0 or 1); `gone`: (rank, host, seconds ago) seen before, not now."""
    job = RUN_7 if job is None else job
    parked, states, sites, worlds, seen = [], [], [], [], []
    for r in rs:
        for i, labels in enumerate(processes(r, job)):
            parked.append((labels, r.parked))
            states += [({**labels, "state": s}, float(s == r.state)) for s in STATES]
            if i == 0 and r.site is not None:
                sites.append(({**labels, "site": r.site}, 1.0))
            if world is not None:
                worlds.append(({**labels, "world_size": str(world)}, float(world)))
            seen.append((labels, 0.0))
    for rank, host, ago in gone:
        for labels in processes(Rank(rank, host), job):
            seen.append((labels, ago))
    return Inputs(parked, states, sites, worlds, seen)


def one(inp: Inputs) -> JobView:
    (view,) = jobs(inp)
    return view


def by_rank(v: JobView) -> dict[str, ranks.RankView]:
    return {r.rank: r for r in v.ranks}


FOUR = [
    Rank(0, "node-a:9817"),
    Rank(1, "node-a:9817"),
    Rank(2, "node-b:9817"),
    Rank(3, "node-b:9817"),
]


# -- ranks: the rules' semantics -------------------------------------------------------------


def test_a_healthy_stalled_job_has_no_odd_rank():
    v = one(inputs([replace(r, parked=100.0 + int(r.rank)) for r in FOUR], world=4))
    assert v.stalled and v.stalled_seconds == 103.0
    assert v.odd == () and v.missing == ()
    assert [r.rank for r in v.ranks] == ["0", "1", "2", "3"]
    assert v.sites == ((ALL_REDUCE, 4),) and v.top_site == (ALL_REDUCE, 4)
    assert v.key == JobKey("torchrun", "rdzv:run-7") and v.world_size == 4


def test_a_job_that_works_is_not_stalled_and_names_nobody():
    rs = [replace(r, parked=0.0, state="progressing", site=None) for r in FOUR]
    rs[2] = replace(rs[2], parked=3.0, state="progressing", site=NEXT)
    v = one(inputs(rs))
    assert not v.stalled and v.stalled_seconds == 0.0 and v.odd == ()


def test_the_rank_that_is_not_parked_is_the_odd_one_out():
    rs = list(FOUR)
    rs[2] = replace(rs[2], parked=0.0, state="progressing", site=None)
    v = one(inputs(rs))
    assert v.stalled
    assert [(r.rank, r.reason) for r in v.odd] == [("2", NOT_PARKED)]
    assert v.ranks[0].rank == "2" and v.ranks[0].state == "progressing"


def test_a_rank_at_another_site_is_the_odd_one_out():
    rs = list(FOUR)
    rs[2] = replace(rs[2], parked=125.0, site=NEXT)
    v = one(inputs(rs))
    assert [(r.rank, r.reason, r.site) for r in v.odd] == [("2", OTHER_SITE, NEXT)]
    assert v.sites == ((ALL_REDUCE, 3), (NEXT, 1))


def test_a_tie_for_the_top_site_names_nobody_by_site():
    rs = [*FOUR[:2], *(replace(r, site=NEXT) for r in FOUR[2:])]
    v = one(inputs(rs))
    assert v.stalled and v.odd == () and v.top_site is None


def test_a_three_way_split_with_a_tie_on_top_names_nobody_either():
    rs = [*FOUR, Rank(4, "node-c:9817", site="barrier (train.py:70)")]
    rs[2], rs[3] = replace(rs[2], site=NEXT), replace(rs[3], site=NEXT)
    assert one(inputs(rs)).odd == ()


def test_ranks_without_a_site_are_not_counted():
    rs = [replace(r, site=None) for r in FOUR]
    rs[1] = replace(rs[1], site=NEXT)
    v = one(inputs(rs))  # one site, held by one rank: it is the top, nobody is at another
    assert v.odd == () and v.sites == ((NEXT, 1),)


def test_a_rank_seen_before_and_gone_now_is_missing_with_its_last_host():
    v = one(inputs(FOUR[:3], gone=[(3, "node-b:9817", 200.0), (3, "node-c:9817", 700.0)]))
    (m,) = v.missing
    assert (m.rank, m.reason, m.instances, m.last_seen_seconds) == (
        "3",
        GONE,
        ("node-b:9817",),
        200.0,
    )
    assert m.state == "missing" and m.parked_seconds is None
    assert v.ranks[0] is m  # odd ones first
    assert len(v.visible) == 3


def test_a_rank_seen_but_not_when_is_missing_without_an_age():
    v = one(inputs(FOUR[:3], gone=[(3, "node-b:9817", float("nan"))]))
    (m,) = v.missing
    assert (m.rank, m.reason, m.instances, m.last_seen_seconds) == (
        "3",
        GONE,
        ("node-b:9817",),
        None,
    )
    assert render.not_visible_text(v) == "rank 3 (last seen on node-b:9817)"


def test_an_age_the_query_cannot_give_is_unknown_not_a_rank_dropped():
    # An engine whose timestamp() in a subquery gives 0 makes every age "56 years".
    v = one(inputs(FOUR[:3], gone=[(3, "node-b:9817", 1.7e9)]))
    assert [(r.rank, r.reason, r.last_seen_seconds) for r in v.missing] == [("3", GONE, None)]


def test_a_rank_that_restarted_elsewhere_is_not_missing():
    v = one(inputs(FOUR, gone=[(3, "node-z:9817", 100.0)]))
    assert v.missing == () and by_rank(v)["3"].instances == ("node-b:9817",)


def test_the_world_size_names_the_ranks_never_seen():
    v = one(inputs(FOUR, world=8, gone=[(5, "node-c:9817", 60.0)]))
    assert [(r.rank, r.reason) for r in v.missing] == [
        ("4", NEVER_SEEN),
        ("5", GONE),
        ("6", NEVER_SEEN),
        ("7", NEVER_SEEN),
    ]
    assert by_rank(v)["4"].instances == ()


def test_an_implausible_world_size_is_ignored():
    v = one(inputs(FOUR, world=ranks.MAX_WORLD + 1))
    assert v.world_size is None and v.missing == ()


def test_a_job_without_an_id_is_its_ranks_on_one_host():
    no_id = {"job_key": "", "torchelastic_run_id": "none"}
    vs = jobs(
        inputs(
            [*FOUR[:2], replace(FOUR[2], service_pid="200"), replace(FOUR[3], service_pid="200")],
            job=no_id,
            world=4,
        )
    )
    assert [v.key for v in vs] == [
        JobKey("torchrun", instance="node-a:9817", service_pid="100"),
        JobKey("torchrun", instance="node-b:9817", service_pid="200"),
    ]
    assert [[r.rank for r in v.ranks] for v in vs] == [["0", "1"], ["2", "3"]]
    # A host's ranks are not the whole job: its world size names no rank as never seen.
    assert all(v.missing == () for v in vs)
    assert vs[0].key.names() == ["torchrun@node-a:9817/100"]


def test_the_job_is_its_key_and_the_id_labels_beside_it_do_not_split_or_merge_it():
    # torchrun's default invocation: run id "none" on every rank, the key its endpoint.
    tcp = {"job_key": "tcp:10.0.0.1:29500/4", "torchelastic_run_id": "none"}
    v = one(inputs(FOUR, job=tcp, world=4))
    assert v.key == JobKey("torchrun", "tcp:10.0.0.1:29500/4") and v.missing == ()
    assert v.key.names()[:2] == ["10.0.0.1:29500/4", "tcp:10.0.0.1:29500/4"]
    v = one(inputs(FOUR, job={"job_key": "slurm:81234.0", "slurm_job_id": "81234"}))
    assert v.key.names()[:3] == ["81234", "81234.0", "slurm:81234.0"]


def test_a_tcp_job_over_two_hosts_names_its_odd_rank():
    tcp = {"job_key": "tcp:10.0.0.1:29500/4", "torchelastic_run_id": "none"}
    rs = list(FOUR)
    rs[3] = replace(rs[3], parked=0.0, state="progressing", site=None)
    v = one(inputs(rs, job=tcp, world=4))
    assert v.stalled and [(r.rank, r.instances, r.reason) for r in v.odd] == [
        ("3", ("node-b:9817",), NOT_PARKED)
    ]


def test_two_endpoints_on_the_same_hosts_are_two_jobs():
    a = inputs(FOUR, job={"job_key": "tcp:10.0.0.1:29500/4"}, world=4)
    b = inputs(
        [replace(r, service_pid="300", parked=0.0, state="progressing", site=None) for r in FOUR],
        job={"job_key": "tcp:10.0.0.1:29501/4"},
        world=4,
    )
    vs = merged(a, b)
    assert [(v.key.key, len(v.visible), v.stalled, v.odd) for v in vs] == [
        ("tcp:10.0.0.1:29500/4", 4, True, ()),
        ("tcp:10.0.0.1:29501/4", 4, False, ()),
    ]


def test_loopback_keys_of_two_hosts_are_two_jobs():
    rs = [Rank(0, "node-a:9817"), Rank(1, "node-a:9817")]
    a = inputs(rs, job={"job_key": "tcp:127.0.0.1:29500/2@node-a"}, world=2)
    b = inputs(
        [replace(r, host="node-b:9817", parked=0.0, state="idle") for r in rs],
        job={"job_key": "tcp:127.0.0.1:29500/2@node-b"},
        world=2,
    )
    vs = merged(a, b)
    assert [(v.key.key, v.visible[0].instances, v.stalled) for v in vs] == [
        ("tcp:127.0.0.1:29500/2@node-a", ("node-a:9817",), True),
        ("tcp:127.0.0.1:29500/2@node-b", ("node-b:9817",), False),
    ]
    assert ranks.labels_for(vs) == {
        vs[0].key: "127.0.0.1:29500/2@node-a",
        vs[1].key: "127.0.0.1:29500/2@node-b",
    }


def test_a_job_without_the_id_labels_at_all_is_grouped_per_host():
    vs = jobs(inputs(FOUR, job={}))
    assert [v.key.names() for v in vs] == [
        ["torchrun@node-a:9817/100"],
        ["torchrun@node-b:9817/100"],
    ]


def test_federated_series_with_a_cluster_label_are_one_job():
    east = [replace(r, extra={"cluster": "east"}) for r in FOUR[:2]]
    west = [replace(r, extra={"cluster": "west"}) for r in FOUR[2:]]
    # The same rank reached through two federation paths counts once.
    twice = [replace(FOUR[0], extra={"cluster": "global"})]
    v = one(inputs([*east, *west, *twice]))
    assert [r.rank for r in v.ranks] == ["0", "1", "2", "3"] and v.odd == ()
    assert v == one(inputs(FOUR))


def test_dataloader_workers_do_not_change_the_answer():
    rs = list(FOUR)
    rs[2] = replace(rs[2], site=NEXT)
    with_workers = one(inputs([replace(r, workers=4) for r in rs]))
    alone = one(inputs(rs))

    def no_pids(v: JobView) -> JobView:
        return replace(v, ranks=tuple(replace(r, pids=()) for r in v.ranks))

    assert no_pids(with_workers) == no_pids(alone)
    assert [(r.rank, r.reason) for r in with_workers.odd] == [("2", OTHER_SITE)]
    assert by_rank(with_workers)["0"].pids == ("1000", "1001", "1002", "1003", "1004")
    assert by_rank(with_workers)["0"].pid == "1000"


def test_a_rank_s_pid_is_its_own_process_s_even_below_its_workers_pids():
    inp = inputs([Rank(0, "node-a:9817", workers=1)])
    # PIDs wrapped: the worker got a lower one than the rank's own process.
    low = {"1000": "1001", "1001": "999"}
    inp = replace(inp, parked=[({**lb, "pid": low[lb["pid"]]}, v) for lb, v in inp.parked])
    inp = replace(inp, sites=[({**lb, "pid": low[lb["pid"]]}, v) for lb, v in inp.sites])
    (r,) = one(inp).ranks
    assert (r.pid, r.pids) == ("1001", ("999", "1001"))
    (r,) = one(replace(inp, sites=[])).ranks  # without a site: the lowest PID
    assert r.pid == "999"


def test_a_rank_is_stalled_only_when_every_process_of_it_is():
    # Rank 1's worker is idle: the rank is not stalled, but the job is (ranks 0, 2, 3).
    inp = inputs(FOUR)
    extra = {**next(processes(FOUR[1], RUN_7)), "pid": "9"}
    inp = replace(
        inp,
        parked=[*inp.parked, (extra, 300.0)],
        states=[*inp.states, ({**extra, "state": "idle"}, 1.0)],
    )
    v = one(inp)
    assert by_rank(v)["1"].state == "idle" and v.stalled
    assert by_rank(v)["1"].parked_seconds == 125.0  # the smallest of its processes'


def _aggregate(
    samples: Sequence[Sample], by: Sequence[str], op: Callable[[list[float]], float]
) -> list[Sample]:
    """What `OP by (BY) (...)` answers, for the queries agent.jobs.command sends."""
    groups: dict[tuple[tuple[str, str], ...], list[float]] = {}
    for labels, value in samples:
        key = tuple((k, labels[k]) for k in by if labels.get(k, ""))
        groups.setdefault(key, []).append(value)
    return [(dict(k), op(vs)) for k, vs in groups.items()]


def test_the_aggregating_queries_give_the_answer_the_raw_series_give():
    job = ["service", "job_key", "instance", "service_pid"]
    rs = [replace(r, workers=2, extra={"cluster": "c1"}) for r in FOUR]
    rs[2] = replace(rs[2], site=NEXT)
    raw = inputs(rs, world=6, gone=[(4, "node-c:9817", 90.0)])
    agg = Inputs(
        parked=_aggregate(raw.parked, [*job, "rank", "pid"], min),
        states=_aggregate([s for s in raw.states if s[1] == 1], [*job, "rank", "state"], len),
        sites=_aggregate(raw.sites, [*job, "rank", "pid", "site"], len),
        world_sizes=_aggregate(raw.world_sizes, job, max),
        last_seen=_aggregate(raw.last_seen, [*job, "rank"], min),
    )
    assert jobs(agg) == jobs(raw)
    assert [(r.rank, r.reason) for r in jobs(agg)[0].odd] == [
        ("2", OTHER_SITE),
        ("4", GONE),
        ("5", NEVER_SEEN),
    ]


def test_odd_ranks_come_first_then_ranks_by_number():
    rs = [Rank(n, "node-a:9817") for n in (10, 2, 1, 0)]
    rs[0] = replace(rs[0], site=NEXT)
    v = one(inputs(rs))
    assert [r.rank for r in v.ranks] == ["10", "0", "1", "2"]


def test_non_finite_values_and_rankless_series_are_ignored():
    inp = inputs(FOUR[:2])
    rankless = {"service": "torchrun", "rank": "", "instance": "x"}
    nan = {**inp.parked[0][0], "rank": "9"}
    v = one(replace(inp, parked=[*inp.parked, (rankless, 5.0), (nan, float("nan"))]))
    assert [r.rank for r in v.ranks] == ["0", "1"]


# -- selection -------------------------------------------------------------------------------

RUN7 = inputs(FOUR)
IDLE = inputs(
    [Rank(0, "node-c:9817", parked=0.0, state="progressing", site=None)],
    job={"job_key": "slurm:81234.0", "slurm_job_id": "81234"},
)
STALLED_TOO = inputs([Rank(0, "node-d:9817")], job={"job_key": "rdzv:run-9"})


def merged(*inps: Inputs) -> list[JobView]:
    return jobs(joined(*inps))


def joined(*inps: Inputs) -> Inputs:
    fields = Inputs.__dataclass_fields__
    return Inputs(**{f: [s for i in inps for s in getattr(i, f)] for f in fields})


def test_the_only_job_is_shown():
    assert select(jobs(IDLE), None, "P").key.key == "slurm:81234.0"


def test_of_several_jobs_the_only_stalled_one_is_shown():
    assert select(merged(RUN7, IDLE), None, "P").key.key == "rdzv:run-7"


def test_several_stalled_jobs_ask_for_one():
    with pytest.raises(UsageError, match=r"2 jobs in P, 2 of them stalled.*--job"):
        select(merged(RUN7, STALLED_TOO), None, "P")
    with pytest.raises(UsageError, match="3 jobs in P, 2 of them stalled"):
        select(merged(RUN7, STALLED_TOO, IDLE), None, "P")


def test_no_job_at_all_is_an_error_with_exit_1():
    with pytest.raises(HangwatchError, match="no job has ranks visible in P") as e:
        select([], None, "P")
    assert e.value.exit_code == 1


def test_job_picks_by_id_key_or_the_per_host_name():
    no_id = inputs([Rank(0, "node-e:9817")], job={})
    tcp = inputs([Rank(0, "node-g:9817")], job={"job_key": "tcp:[fd00::1]:29500/2"})
    vs = merged(RUN7, IDLE, STALLED_TOO, no_id, tcp)
    for name in ("run-9", "rdzv:run-9", "torchrun@run-9", "torchrun@rdzv:run-9"):
        assert select(vs, name, "P").key.key == "rdzv:run-9"
    for name in ("81234", "81234.0", "slurm:81234.0", "torchrun@81234"):
        assert select(vs, name, "P").key.key == "slurm:81234.0"
    for name in ("[fd00::1]:29500/2", "tcp:[fd00::1]:29500/2", "torchrun@[fd00::1]:29500/2"):
        assert select(vs, name, "P").key.instance == "" and select(vs, name, "P").ranks
    assert select(vs, "torchrun@node-e:9817/100", "P").key.instance == "node-e:9817"
    with pytest.raises(UsageError, match=r"no job 'run-8' in P: known jobs: .*run-7") as e:
        select(vs, "run-8", "P")
    assert e.value.exit_code == EXIT_USAGE


def test_a_slurm_job_of_two_steps_is_picked_by_its_step():
    step = inputs([Rank(0, "node-h:9817")], job={"job_key": "slurm:81234.1"})
    vs = merged(IDLE, step)
    assert sorted(ranks.labels_for(vs).values()) == ["81234.0", "81234.1"]
    assert select(vs, "81234.1", "P").key.key == "slurm:81234.1"
    with pytest.raises(UsageError, match=r"'81234' names 2 jobs in P: 81234.0, 81234.1"):
        select(vs, "81234", "P")


def test_a_job_gone_entirely_is_still_found_by_its_id():
    gone = inputs([], gone=[(0, "node-a:9817", 120.0), (1, "node-b:9817", 120.0)])
    v = select(jobs(gone), "run-7", "P")
    assert v.visible == () and [r.rank for r in v.missing] == ["0", "1"]
    with pytest.raises(HangwatchError, match="seen in the last 15 minutes"):
        select(jobs(gone), None, "P")


def test_an_id_shared_by_two_services_is_shown_with_its_service():
    other = inputs([Rank(0, "node-f:9817")])
    other = replace(
        other,
        parked=[({**labels, "service": "trainer"}, value) for labels, value in other.parked],
    )
    vs = merged(RUN7, other)
    assert sorted(ranks.labels_for(vs).values()) == ["torchrun@run-7", "trainer@run-7"]
    with pytest.raises(UsageError, match="'run-7' names 2 jobs"):
        select(vs, "run-7", "P")
    assert select(vs, "trainer@run-7", "P").key.service == "trainer"


# -- render ----------------------------------------------------------------------------------


def straggler() -> JobView:
    rs = list(FOUR)
    rs[2] = replace(rs[2], parked=124.0, site=NEXT)
    rs[0] = replace(rs[0], parked=126.0)
    return one(inputs(rs, world=4))


def test_the_text_puts_the_odd_rank_first_and_says_why():
    text = render.job_text(straggler(), "run-7")
    lines = text.splitlines()
    assert lines[0] == "job run-7 (service torchrun): 4 ranks of 4, stalled for 2m 06s"
    assert lines[1] == (
        f"odd one out: rank 2 on node-b:9817 waits at {NEXT} while 3 ranks wait at {ALL_REDUCE}"
    )
    assert lines[3].split() == ["RANK", "HOST", "PID", "STATE", "FOR", "SITE", "WHY"]
    assert lines[4].split()[:6] == ["2", "node-b:9817", "1020", "stalled", "2m", "04s"]
    assert lines[4].endswith("other site")
    assert [ln.split()[0] for ln in lines[5:]] == ["0", "1", "3"]


def test_the_text_of_missing_and_not_parked_ranks():
    rs = list(FOUR[:3])
    rs[1] = replace(rs[1], parked=0.0, state="progressing", site=None)
    text = render.job_text(one(inputs(rs, world=5, gone=[(3, "node-b:9817", 250.0)])), "run-7")
    assert "3 ranks of 5" in text
    assert "rank 1 on node-a:9817 is not parked (it works) while 2 ranks wait" in text
    assert "not visible: rank 3 (last seen on node-b:9817 4m 10s ago), rank 4 (never seen" in text
    rows = [ln.split()[0] for ln in text.splitlines()[-5:]]
    assert rows == ["1", "3", "4", "0", "2"]
    assert "missing, last seen 4m 10s ago" in text and "never seen" in text


def test_ranks_gone_with_their_host_read_as_one():
    v = one(inputs(FOUR[:2], world=4, gone=[(2, "node-b:9817", 75.0), (3, "node-b:9817", 75.0)]))
    assert render.not_visible_text(v) == "ranks 2-3 (last seen on node-b:9817 1m 15s ago)"


def test_the_text_of_a_tie_and_of_a_job_not_stalled():
    rs = [*FOUR[:2], *(replace(r, site=NEXT) for r in FOUR[2:])]
    assert "no odd one out by site, a tie: 2 ranks at" in render.job_text(one(inputs(rs)), "run-7")
    calm = [replace(r, parked=0.0, state="progressing", site=None) for r in FOUR]
    assert "4 ranks, not stalled (4 progressing)" in render.job_text(one(inputs(calm)), "run-7")


def test_with_ranks_missing_nobody_visible_is_called_the_odd_one():
    text = render.job_text(one(inputs(FOUR[:3], gone=[(3, "node-b:9817", 30.0)])), "run-7")
    assert (
        f"no odd one out among the visible ranks: every rank with a site waits at {ALL_REDUCE}"
        in text
    )


def test_the_list_of_jobs_without_an_id():
    vs = jobs(inputs(FOUR, job={}, world=4))
    lines = render.jobs_text(vs, ranks.labels_for(vs)).splitlines()
    assert lines[1].split()[:3] == ["torchrun@node-a:9817/100", "torchrun", "2"]
    assert render.headline(vs[0], "torchrun@node-a:9817/100") == (
        "job torchrun@node-a:9817/100 (service torchrun, no job key: the ranks on one host): "
        "2 ranks, stalled for 2m 05s"
    )


def test_label_values_cannot_drive_the_terminal():
    rs = list(FOUR)
    rs[2] = replace(rs[2], site="evil\x1b[2J\x1b]0;pwned\x07 (x.py:1)\n", host="h\u202e:9817")
    text = render.job_text(one(inputs(rs)), "run-7\r")
    assert not any(c in text for c in "\x1b\x07\r\u202e")
    assert "evil?[2J?]0;pwned? (x.py:1)?" in text
    assert len(text.splitlines()) == 8  # the newline in the site made no line of its own


def test_the_json_round_trips_with_its_documented_keys():
    v = one(inputs(FOUR[:3], world=4, gone=[(3, "node-b:9817", 42.0)]))
    names = ranks.labels_for([v])
    doc = render.document("http://prom:9090", [v], names, v)
    assert json.loads(json.dumps(doc)) == doc
    assert set(doc) == {"prometheus", "jobs", "job"}
    job = doc["job"]
    assert set(job) == {
        "job", "service", "job_key", "torchelastic_run_id", "slurm_job_id", "instance", "service_pid",
        "world_size", "ranks_visible", "ranks_missing", "stalled", "stalled_seconds", "ranks", "sites",
    }  # fmt: skip
    assert (job["job"], job["ranks_visible"], job["ranks_missing"]) == ("run-7", 3, ["3"])
    assert (job["job_key"], job["torchelastic_run_id"], job["slurm_job_id"]) == (
        "rdzv:run-7",
        "run-7",
        "",
    )
    assert job["ranks"][0] == {
        "rank": "3",
        "instances": ["node-b:9817"],
        "pid": None,
        "pids": [],
        "state": "missing",
        "site": None,
        "parked_seconds": None,
        "reason": "missing",
        "last_seen_seconds_ago": 42.0,
        "waits": False,
    }
    assert job["ranks"][1]["site"] == ALL_REDUCE and job["ranks"][1]["reason"] is None
    assert job["sites"] == [{"site": ALL_REDUCE, "ranks": 3}]


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0.0, "<1s"),
        (0.4, "<1s"),
        (59.9, "59s"),
        (125.0, "2m 05s"),
        (3725.0, "1h 02m"),
        (90061.0, "1d 01h"),
    ],
)
def test_durations(seconds: float, text: str):
    assert render.duration(seconds) == text


def test_rank_ranges():
    assert render.rank_ranges(["5", "0", "1", "2", "9", "10", "x"]) == "0-2, 5, 9-10, x"


def test_the_list_of_jobs():
    vs = merged(RUN7, IDLE, STALLED_TOO)
    text = render.jobs_text(vs, ranks.labels_for(vs))
    assert text.splitlines()[0].split() == ["JOB", "SERVICE", "RANKS", "STATE"]
    assert [ln.split()[0] for ln in text.splitlines()[1:]] == ["run-7", "run-9", "81234"]
    assert "not stalled (1 progressing)" in text


# -- the command against a server that answers like the Prometheus API ------------------------


class FakeProm:
    """A Prometheus API on localhost: `answers` maps each query to its samples, or `respond`
    answers every request (status, content type, body)."""

    def __init__(self) -> None:
        self.answers: dict[str, Sequence[Sample]] = {}
        self.respond: Callable[[], tuple[int, str, bytes]] | None = None
        self.requests: list[tuple[str, Mapping[str, str]]] = []
        self.release = threading.Event()
        # A request under /moved is sent on, with a 302, to this URL and the rest of its path.
        self.moved_to: str | None = None
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                fake.requests.append((self.path, dict(self.headers)))
                if fake.moved_to is not None and self.path.startswith("/moved/"):
                    self.send_response(302)
                    self.send_header("Location", fake.moved_to + self.path[len("/moved") :])
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                status, ctype, body = fake.respond() if fake.respond else fake.answer(self.path)
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def serve(self, inp: Inputs) -> None:
        self.answers = {expr: getattr(inp, name) for name, expr in QUERIES.items()}

    def answer(self, path: str) -> tuple[int, str, bytes]:
        parts = urlsplit(path)
        expr = parse_qs(parts.query).get("query", [""])[0]
        if not parts.path.endswith("/api/v1/query") or expr not in self.answers:
            body = {"status": "error", "errorType": "bad_data", "error": f"unknown {expr!r}"}
            return 400, "application/json", json.dumps(body).encode()
        result = [
            {"metric": dict(labels), "value": [1796178141.0, repr(float(value))]}
            for labels, value in self.answers[expr]
        ]
        doc = {"status": "success", "data": {"resultType": "vector", "result": result}}
        return 200, "application/json", json.dumps(doc).encode()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def prom() -> Iterator[FakeProm]:
    p = FakeProm()
    yield p
    p.close()


def job(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["job", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_the_command_shows_the_stalled_job(prom: FakeProm, capsys: pytest.CaptureFixture[str]):
    prom.serve(inputs([*FOUR[:2], replace(FOUR[2], site=NEXT), FOUR[3]], world=4))
    code, out, err = job(capsys, "--prometheus", prom.url)
    assert (code, err) == (0, "")
    assert out.startswith("job run-7 (service torchrun): 4 ranks of 4, stalled for 2m 05s\n")
    assert "odd one out: rank 2 on node-b:9817" in out
    assert len(prom.requests) == len(QUERIES)


def test_the_command_prints_json(prom: FakeProm, capsys: pytest.CaptureFixture[str]):
    prom.serve(inputs(FOUR))
    code, out, _ = job(capsys, "--prometheus", prom.url + "/", "--job", "run-7", "--json")
    doc = json.loads(out)
    assert code == 0 and doc["prometheus"] == prom.url
    assert [r["rank"] for r in doc["job"]["ranks"]] == ["0", "1", "2", "3"]


def test_missing_ranks_exit_1_and_say_so_on_stderr(
    prom: FakeProm, capsys: pytest.CaptureFixture[str]
):
    prom.serve(inputs(FOUR[:3], world=6, gone=[(3, "node-b:9817", 200.0)]))
    code, out, err = job(capsys, "--prometheus", prom.url)
    assert code == 1
    assert "3 ranks of 6" in out and "missing, last seen 3m 20s ago" in out
    assert err.startswith("hangwatch: job run-7: 3 of 6 ranks not visible in Prometheus at ")
    assert "rank 3 (last seen on node-b:9817 3m 20s ago), ranks 4-5 (never seen" in err
    assert "hangwatch may be down or not scraped" in err


def test_several_jobs_are_listed_to_pick_from(prom: FakeProm, capsys: pytest.CaptureFixture[str]):
    prom.serve(joined(RUN7, STALLED_TOO))
    code, out, err = job(capsys, "--prometheus", prom.url)
    assert code == EXIT_USAGE
    assert [ln.split()[0] for ln in out.splitlines()] == ["JOB", "run-7", "run-9"]
    assert "2 jobs in Prometheus at" in err and "--job" in err


def test_an_unknown_job_names_the_value_and_the_known_ones(
    prom: FakeProm, capsys: pytest.CaptureFixture[str]
):
    prom.serve(inputs(FOUR))
    code, out, err = job(capsys, "--prometheus", prom.url, "--job", "run-8")
    assert code == EXIT_USAGE
    assert f"no job 'run-8' in Prometheus at {prom.url}: known jobs: run-7" in err
    assert "run-7" in out


def test_no_ranks_at_all(prom: FakeProm, capsys: pytest.CaptureFixture[str]):
    prom.serve(Inputs())
    code, out, err = job(capsys, "--prometheus", prom.url)
    assert code == 1 and out == ""
    assert "no job has ranks visible in Prometheus at" in err


def test_an_api_error_names_the_url_and_what_prometheus_said(
    prom: FakeProm, capsys: pytest.CaptureFixture[str]
):
    body = {"status": "error", "errorType": "bad_data", "error": "1:5: parse error"}
    prom.respond = lambda: (400, "application/json", json.dumps(body).encode())
    code, _, err = job(capsys, "--prometheus", prom.url)
    assert code == EXIT_UNAVAILABLE
    assert f"Prometheus at {prom.url} answered HTTP 400: bad_data: 1:5: parse error" in err


def test_a_non_json_error_page(prom: FakeProm, capsys: pytest.CaptureFixture[str]):
    prom.respond = lambda: (503, "text/html", b"<html><body>Service\x1b Unavailable</body></html>")
    code, _, err = job(capsys, "--prometheus", prom.url)
    assert code == EXIT_UNAVAILABLE
    assert f"Prometheus at {prom.url} answered HTTP 503: '<html><body>Service? Unavailable" in err


def test_a_page_that_is_not_the_api(prom: FakeProm, capsys: pytest.CaptureFixture[str]):
    prom.respond = lambda: (200, "text/html", b"<html>Grafana</html>")
    code, _, err = job(capsys, "--prometheus", prom.url)
    assert code == EXIT_UNAVAILABLE
    assert "answered HTTP 200 with something other than JSON (text/html" in err


def test_an_error_status_in_a_200(prom: FakeProm, capsys: pytest.CaptureFixture[str]):
    body = {"status": "error", "errorType": "timeout", "error": "query timed out"}
    prom.respond = lambda: (200, "application/json", json.dumps(body).encode())
    code, _, err = job(capsys, "--prometheus", prom.url)
    assert code == EXIT_UNAVAILABLE and "answered an error: timeout: query timed out" in err


def test_warnings_are_passed_on(prom: FakeProm, capsys: pytest.CaptureFixture[str]):
    doc = {
        "status": "success",
        "warnings": ["partial response"],
        "data": {"resultType": "vector", "result": []},
    }
    prom.respond = lambda: (200, "application/json", json.dumps(doc).encode())
    _, _, err = job(capsys, "--prometheus", prom.url)
    assert err.count("Prometheus warns: partial response") == 1


def test_a_closed_port_is_connection_refused(capsys: pytest.CaptureFixture[str]):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code, _, err = job(capsys, "--prometheus", f"http://127.0.0.1:{port}")
    assert code == EXIT_UNAVAILABLE
    assert f"cannot reach Prometheus at http://127.0.0.1:{port}: connection refused" in err


def test_no_answer_in_time(prom: FakeProm, capsys: pytest.CaptureFixture[str]):
    def slow() -> tuple[int, str, bytes]:
        prom.release.wait(5)
        return 200, "application/json", b"{}"

    prom.respond = slow
    code, _, err = job(capsys, "--prometheus", prom.url, "--timeout", "0.2")
    assert code == EXIT_UNAVAILABLE
    assert f"Prometheus at {prom.url} did not answer within 0.2 s" in err and "--timeout" in err


def test_credentials_and_a_path_prefix(prom: FakeProm, capsys: pytest.CaptureFixture[str]):
    prom.serve(inputs(FOUR))
    url = prom.url.replace("http://", "http://ops:s%3Acret@") + "/prometheus/"
    code, _, _ = job(capsys, "--prometheus", url)
    assert code == 0
    path, headers = prom.requests[0]
    assert path.startswith("/prometheus/api/v1/query?query=")
    assert headers["Authorization"] == "Basic b3BzOnM6Y3JldA=="  # ops:s:cret
    prom.respond = lambda: (401, "text/plain", b"Unauthorized")
    code, _, err = job(capsys, "--prometheus", url)
    assert code == EXIT_UNAVAILABLE and "cret" not in err and "ops" not in err
    assert "Prometheus at http://***@127.0.0.1:" in err and "HTTP 401" in err


@pytest.fixture
def other_prom() -> Iterator[FakeProm]:
    """A second server, on another port: another origin."""
    p = FakeProm()
    yield p
    p.close()


def test_a_redirect_to_another_origin_gets_no_credentials(
    prom: FakeProm, other_prom: FakeProm, capsys: pytest.CaptureFixture[str]
):
    """A proxy that answers 302 to another port: the job is read there, without the
    Authorization the URL gave for the first (urllib would copy it into every redirect)."""
    other_prom.serve(inputs(FOUR))
    prom.moved_to = other_prom.url
    url = prom.url.replace("http://", "http://ops:s3cret@") + "/moved"
    code, out, err = job(capsys, "--prometheus", url)
    assert (code, err) == (0, ""), err
    assert out.startswith("job run-7 (service torchrun)")
    assert all(headers["Authorization"] for _, headers in prom.requests)
    assert other_prom.requests, "the redirect was not followed"
    assert all("Authorization" not in headers for _, headers in other_prom.requests)


def test_a_redirect_within_the_origin_keeps_the_credentials(
    prom: FakeProm, capsys: pytest.CaptureFixture[str]
):
    prom.serve(inputs(FOUR))
    prom.moved_to = prom.url  # /moved/api/v1/query -> /api/v1/query, same scheme, host, port
    url = prom.url.replace("http://", "http://ops:s3cret@") + "/moved"
    code, _, err = job(capsys, "--prometheus", url)
    assert (code, err) == (0, ""), err
    moved = [h for path, h in prom.requests if not path.startswith("/moved/")]
    assert moved and all(h["Authorization"] == "Basic b3BzOnMzY3JldA==" for h in moved)


def test_a_redirect_to_neither_http_nor_https_is_not_followed(
    prom: FakeProm, capsys: pytest.CaptureFixture[str]
):
    prom.moved_to = "ftp://127.0.0.1:21"
    code, _, err = job(capsys, "--prometheus", prom.url.replace("//", "//ops:s3cret@") + "/moved")
    assert code == EXIT_UNAVAILABLE and "HTTP 302" in err and "s3cret" not in err, err


@pytest.mark.parametrize(
    "url",
    [
        "http://ops:s3cret@prom:99999",  # a port out of range
        "http://ops:s3cret@prom:90x",  # a port that is not a number
        "http://ops:s3c/ret@prom:9090",  # a "/" in the password: it parses as a path
        "ftp://ops:s3cret@prom:21",  # not http
        "ops:s3cret@prom:9090",  # no scheme
        "http://ops:s3cret@prom:9090/?x=1",  # a query
        "http://ops:s3cret@[::1:9090",  # a broken IPv6 address
        "http://ops:s3cret@:9090",  # no host
    ],
)
def test_a_bad_url_is_named_without_its_userinfo(capsys: pytest.CaptureFixture[str], url: str):
    code, out, err = job(capsys, "--prometheus", url)
    assert code == EXIT_USAGE and "--prometheus" in err, err
    for secret in ("s3c", "ret", "ops"):
        assert secret not in out + err, err
    assert "***@" in err, err


def test_an_unreachable_url_is_named_without_its_userinfo(capsys: pytest.CaptureFixture[str]):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code, _, err = job(capsys, "--prometheus", f"http://ops:s3cret@127.0.0.1:{port}", "--json")
    assert code == EXIT_UNAVAILABLE
    assert f"cannot reach Prometheus at http://***@127.0.0.1:{port}: connection refused" in err
    assert "s3cret" not in err and "ops" not in err


@given(
    st.sampled_from(["http://", "https://", "", "//", "HTTP://"]),
    st.text(alphabet=string.ascii_letters + string.digits + ".-_~%", max_size=8),
    st.text(alphabet=st.characters(exclude_characters="@"), max_size=12),
    st.text(max_size=16),
)
def test_redacted_never_keeps_the_password(scheme: str, user: str, password: str, rest: str):
    """Whatever follows the userinfo (another "@", a path, nothing a parser accepts), the
    password in it is not in what is shown."""
    secret = "Zq" + password
    assume(secret not in rest)
    shown = redacted(f"{scheme}{user}:{secret}@{rest}")
    assert secret not in shown and shown.endswith(rest.rpartition("@")[2])  # the host kept


def test_origins_differ_by_scheme_host_or_port():
    assert _origin("http://prom/api") == _origin("HTTP://PROM:80/other") == ("http", "prom", 80)
    assert _origin("https://prom") == ("https", "prom", 443)
    assert _origin("https://prom") != _origin("http://prom:443")  # https to http: another
    assert _origin("http://prom:9090") != _origin("http://prom:9091")
    assert _origin("http://prom:99999") is None and _origin("ftp://prom") is None


@pytest.mark.parametrize(
    ("args", "names"),
    [
        (["--prometheus", "prometheus:9090"], "--prometheus 'prometheus:9090': not an http"),
        (["--prometheus", "ftp://prom:21"], "--prometheus 'ftp://prom:21': not an http"),
        (["--prometheus", "http://:9090"], "--prometheus 'http://:9090': not an http"),
        (["--prometheus", "http://prom:90x"], "--prometheus 'http://prom:90x':"),
        (["--prometheus", "http://prom:9090/?x=1"], "no ?query"),
        (["--prometheus", "http://prom:9090", "--timeout", "0"], "--timeout 0: out of range"),
        (["--prometheus", "http://prom:9090", "--job", " "], "--job ''"),
    ],
)
def test_bad_input_exits_2_naming_it(
    capsys: pytest.CaptureFixture[str], args: list[str], names: str
):
    code, _, err = job(capsys, *args)
    assert code == EXIT_USAGE and names in err, err


def test_an_ipv6_url_keeps_its_brackets():
    e = Endpoint.parse("http://[::1]:9090/p/")
    assert (e.base, e.shown, e.authorization) == (
        "http://[::1]:9090/p",
        "http://[::1]:9090/p",
        None,
    )


# -- the queries, in Prometheus's own engine (promtool test rules) ---------------------------


# -- the park threshold: a rank waits for the job once parked past its host's, and not idle --


def with_thresholds(inp: Inputs, **by_host: float) -> Inputs:
    return replace(inp, thresholds=[({"instance": h}, t) for h, t in by_host.items()])


def test_ranks_parked_past_the_threshold_wait_even_where_their_host_calls_them_progressing():
    """One host, four ranks, rank 2 computing: the daemon calls the whole service (and each of
    its processes) progressing, but for the job the three others have waited past the
    threshold, so rank 2 is the one they wait for, as it would be were it on another host."""
    rs = [Rank(r, "node-a:9817", parked=90.0, state="progressing") for r in (0, 1, 3)]
    rs.append(Rank(2, "node-a:9817", parked=0.0, state="progressing", site=None))
    view = one(with_thresholds(inputs(rs), **{"node-a:9817": 60.0}))
    assert view.stalled and view.stalled_seconds == 90.0
    assert [(r.rank, r.reason) for r in view.ranks if r.reason] == [("2", NOT_PARKED)]
    assert by_rank(view)["0"].state == "progressing"  # the host's word, as it says it


def test_under_the_threshold_nobody_is_named():
    rs = [Rank(r, "node-a:9817", parked=30.0, state="progressing") for r in (0, 1, 3)]
    rs.append(Rank(2, "node-a:9817", parked=0.0, state="progressing", site=None))
    view = one(with_thresholds(inputs(rs), **{"node-a:9817": 60.0}))
    assert not view.stalled and not any(r.reason for r in view.ranks)


def test_an_idle_server_s_ranks_at_different_sites_are_no_straggler():
    """An inference server launched with ranks, waiting for requests: rank 0 (the front end)
    waits elsewhere than the workers, parked for hours, and its host calls it idle."""
    rs = [Rank(0, "node-a:9817", parked=7200.0, state="idle", site="serve (server.py:40)")]
    rs += [Rank(r, "node-a:9817", parked=7200.0, state="idle") for r in (1, 2, 3)]
    view = one(with_thresholds(inputs(rs), **{"node-a:9817": 60.0}))
    assert not view.stalled and not any(r.reason for r in view.ranks)


def test_each_host_s_own_threshold_counts():
    rs = [Rank(0, "node-a:9817", parked=90.0), Rank(1, "node-a:9817", parked=90.0)]
    rs += [Rank(2, "node-b:9817", parked=90.0, site=NEXT), Rank(3, "node-b:9817", parked=90.0)]
    short = with_thresholds(inputs(rs), **{"node-a:9817": 60.0, "node-b:9817": 60.0})
    assert [(r.rank, r.reason) for r in one(short).ranks if r.reason] == [("2", OTHER_SITE)]
    # Node a judges by 300 s, node b by 120 s: nobody has waited past their host's threshold.
    long = with_thresholds(inputs(rs), **{"node-a:9817": 300.0, "node-b:9817": 120.0})
    assert not one(long).stalled
