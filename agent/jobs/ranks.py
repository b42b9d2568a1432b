"""A distributed job's ranks, from the series of its processes: pure, no I/O.

The semantics are those of the shipped rules (deploy/prometheus/hangwatch-rules.yml, group
hangwatch.jobs; docs/deploy.md), computed here from the daemon's raw series so that the
command works against a Prometheus that does not load the rules: jobs keyed by ``service,
job_key`` (per host without a key), the ranks that wait, a stalled job and its odd ranks out,
ranks missing or never seen. Labels other than those and ``pid`` are ignored, so series per
process or already aggregated give the same answer.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ..errors import HangwatchError, UsageError, show
from ..model import JOB_KEY_LABEL, printable

Sample = tuple[Mapping[str, str], float]

RECENT_S = 15 * 60  # a rank seen this recently and gone now is missing
# A world size past this is a wrong label, not a job: its "never seen" rows would fill screens.
MAX_WORLD = 1 << 20

STALLED = "stalled"
MISSING = "missing"  # the state of a rank that is not visible
# States by how much they say, for a rank whose processes differ: what keeps it from stalled.
STATE_ORDER = ("deadlocked", "progressing", "idle", STALLED)

NOT_PARKED = "not parked"
OTHER_SITE = "other site"
GONE = "missing"
NEVER_SEEN = "never seen"


@dataclass(frozen=True)
class Inputs:
    """What the queries answered (agent.jobs.command.QUERIES says which query fills which)."""

    parked: Sequence[Sample] = ()  # hangwatch_process_parked_seconds
    states: Sequence[Sample] = ()  # hangwatch_process_state == 1 (or a count of them), `state`
    sites: Sequence[Sample] = ()  # hangwatch_process_waiting_at, `site`
    world_sizes: Sequence[Sample] = ()  # hangwatch_process_world_size
    last_seen: Sequence[Sample] = ()  # seconds since a rank was last scraped (15 m), NaN: unknown
    thresholds: Sequence[Sample] = ()  # hangwatch_park_threshold_seconds, by `instance`


@dataclass(frozen=True, order=True)
class JobKey:
    service: str
    key: str = ""  # the ranks' job_key; "" for none
    instance: str = ""  # only for ranks without a key: those of one host
    service_pid: str = ""

    @property
    def has_id(self) -> bool:
        return bool(self.key)

    @property
    def bare(self) -> str:
        """The key without its kind (agent.observe.jobkey's rdzv, slurm, tcp, mpi): the run
        id, the Slurm job and step, the endpoint."""
        return self.key.partition(":")[2]

    @property
    def run_id(self) -> str:
        """torchrun's --rdzv_id where the key is one, else ""."""
        return self.bare if self.key.startswith("rdzv:") else ""

    @property
    def slurm_job_id(self) -> str:
        """The Slurm job, without its step, where the key is one, else ""."""
        return self.bare.partition(".")[0] if self.key.startswith("slurm:") else ""

    def names(self) -> list[str]:
        """What --job accepts for this job, the shortest first: its id as the user gave or
        read it (run-7, 81234.0 or 81234, 10.0.0.1:29500/4), its key, each after SERVICE@."""
        if not self.has_id:
            return [f"{self.service}@{self.instance}/{self.service_pid}"]
        job = self.slurm_job_id  # a Slurm step's job alone, as squeue shows it
        ids = [*([job] if job and job != self.bare else []), self.bare, self.key]
        return ids + [f"{self.service}@{i}" for i in ids]


def job_key(labels: Mapping[str, str]) -> JobKey:
    service, key = labels.get("service", ""), labels.get(JOB_KEY_LABEL, "")
    if key:
        return JobKey(service, key)
    return JobKey(
        service, instance=labels.get("instance", ""), service_pid=labels.get("service_pid", "")
    )


@dataclass(frozen=True)
class RankView:
    rank: str
    instances: tuple[str, ...]  # where it runs; for a missing rank, where it was last seen
    state: str  # a process state, "missing" when not visible, "unknown" without one
    site: str = ""  # where it waits; "" when not parked or not read
    parked_seconds: float | None = None  # None when not visible
    reason: str = ""  # why it is an odd one out; "" when it is not
    last_seen_seconds: float | None = None  # for a missing rank seen before: how long ago
    pid: str = ""  # its own process (not a DataLoader worker's); "" when not visible
    pids: tuple[str, ...] = ()  # all its processes, by PID
    # It waits, for the job: parked past its host's threshold and not idle (its host may still
    # call it progressing, while a peer there computes).
    waits: bool = False


@dataclass(frozen=True)
class JobView:
    key: JobKey
    ranks: tuple[RankView, ...]  # odd ones first, then by rank number
    world_size: int | None = None
    stalled: bool = False
    stalled_seconds: float = 0.0  # the longest park among its stalled ranks
    sites: tuple[tuple[str, int], ...] = ()  # each site and its ranks, most first

    @property
    def visible(self) -> tuple[RankView, ...]:
        return tuple(r for r in self.ranks if r.state != MISSING)

    @property
    def missing(self) -> tuple[RankView, ...]:
        return tuple(r for r in self.ranks if r.state == MISSING)

    @property
    def odd(self) -> tuple[RankView, ...]:
        return tuple(r for r in self.ranks if r.reason)

    @property
    def top_site(self) -> tuple[str, int] | None:
        return top_site(self.sites)


def top_site(sites: Sequence[tuple[str, int]]) -> tuple[str, int] | None:
    """The site most ranks wait at, unless another ties with it; ``sites`` most first."""
    if not sites or (len(sites) > 1 and sites[1][1] == sites[0][1]):
        return None
    return sites[0]


def clean(text: str, limit: int = 120) -> str:
    """A label value to print: each character that is not printable (an escape sequence, a
    newline, a bidirectional override) shown as "?", and at most `limit` characters. Label
    values come from the watched programs (a site is their file and function names) and from
    whoever relabels the targets."""
    return printable(text, limit)


def rank_order(rank: str) -> tuple[int, int, str]:
    """Rank numbers numerically (2 before 10), anything else after them."""
    return (0, int(rank), "") if rank.isdigit() else (1, 0, rank)


def _where(labels: Mapping[str, str]) -> tuple[JobKey, str] | None:
    rank = labels.get("rank", "")
    return (job_key(labels), rank) if rank else None


def _pid_order(pid: str) -> tuple[int, str]:
    return (int(pid), "") if pid.isdigit() else (1 << 62, pid)


@dataclass
class _Now:
    """What the series say of one rank now, over all its processes."""

    parked: float = math.inf  # the smallest of its processes'
    instances: set[str] = field(default_factory=set)
    pids: set[str] = field(default_factory=set)
    states: set[str] = field(default_factory=set)
    sites: dict[str, set[str]] = field(default_factory=dict)  # each site, the PIDs at it
    past_threshold: bool | None = True  # every process parked past its host's; None: unknown

    def waits(self) -> bool:
        """Stalled for the job: every process parked past the threshold, none idle."""
        if self.past_threshold is None:
            return self.states == {STALLED}
        return self.past_threshold and "idle" not in self.states

    def state(self) -> str:
        if not self.states:
            return "unknown"
        if self.states == {STALLED}:  # every process of the rank is stalled
            return STALLED
        return next((s for s in STATE_ORDER if s in self.states), min(self.states))

    def site(self) -> str:
        # Only a rank's leading process has a site. Should two lead one rank, the first site
        # by name stands for it, so that each rank counts once.
        return min(self.sites, default="")

    def pid(self) -> str:
        """The rank's own process: the one with its site, else its lowest PID (its DataLoader
        workers are forked after it)."""
        at = self.sites.get(self.site(), set())
        return min(at or self.pids, key=_pid_order, default="")


def jobs(inp: Inputs) -> list[JobView]:
    """Every job with a rank visible now or seen in the last 15 minutes, by key."""
    now: dict[JobKey, dict[str, _Now]] = {}
    thresholds = {
        labels.get("instance", ""): value
        for labels, value in inp.thresholds
        if math.isfinite(value) and value > 0
    }
    for labels, value in inp.parked:
        at = _where(labels)
        if at is None or not math.isfinite(value):
            continue
        rank = now.setdefault(at[0], {}).setdefault(at[1], _Now())
        rank.parked = min(rank.parked, max(value, 0.0))
        threshold = thresholds.get(labels.get("instance", ""))
        if threshold is None:
            rank.past_threshold = None
        elif rank.past_threshold is not None:
            rank.past_threshold = rank.past_threshold and value >= threshold
        rank.instances.add(labels.get("instance", ""))
        if labels.get("pid"):
            rank.pids.add(labels["pid"])
    # States and sites count only for ranks with a park (the one query that defines a rank
    # as present); a value of 0 is a state the process is not in.
    for labels, value in inp.states:
        at = _where(labels)
        if at is not None and value > 0 and labels.get("state") and at[1] in now.get(at[0], {}):
            now[at[0]][at[1]].states.add(labels["state"])
    for labels, value in inp.sites:
        at = _where(labels)
        if at is not None and value > 0 and labels.get("site") and at[1] in now.get(at[0], {}):
            at_site = now[at[0]][at[1]].sites.setdefault(labels["site"], set())
            if labels.get("pid"):
                at_site.add(labels["pid"])
    world: dict[JobKey, int] = {}
    for labels, value in inp.world_sizes:
        if math.isfinite(value) and 1 <= value <= MAX_WORLD:
            k = job_key(labels)
            world[k] = max(world.get(k, 0), int(value))
    # Each rank's latest sighting: how long ago, on which instance. The query reaches 15
    # minutes back, so each series it answers was seen; an age it cannot have (NaN where its
    # subquery missed the rank, or an engine whose timestamp() gives no sample's time) is
    # unknown, not a reason to drop the rank.
    seen: dict[JobKey, dict[str, tuple[float, str]]] = {}
    for labels, value in inp.last_seen:
        at = _where(labels)
        if at is None:
            continue
        ranks_seen = seen.setdefault(at[0], {})
        age = value if 0 <= value <= RECENT_S + 60 else math.inf  # NaN fails the comparison
        last = (age, labels.get("instance", ""))
        ranks_seen[at[1]] = min(ranks_seen.get(at[1], last), last)
    return [
        _view(k, now.get(k, {}), world.get(k), seen.get(k, {}))
        for k in sorted(set(now) | set(seen))
    ]


def _view(
    key: JobKey,
    now: Mapping[str, _Now],
    world_size: int | None,
    seen: Mapping[str, tuple[float, str]],
) -> JobView:
    state = {r: n.state() for r, n in now.items()}
    site = {r: n.site() for r, n in now.items()}
    stalled = [r for r in now if now[r].waits()]
    counts = Counter(s for s in site.values() if s)
    sites = tuple(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
    top = top_site(sites)
    sole_top = top[0] if top is not None else None
    rows = []
    for r, n in now.items():
        reason = ""
        if stalled and n.parked == 0:
            reason = NOT_PARKED
        elif stalled and sole_top is not None and site[r] and site[r] != sole_top:
            reason = OTHER_SITE
        rows.append(
            RankView(
                rank=r,
                instances=tuple(sorted(n.instances)),
                state=state[r],
                site=site[r],
                parked_seconds=n.parked,
                reason=reason,
                pid=n.pid(),
                pids=tuple(sorted(n.pids, key=_pid_order)),
                waits=n.waits(),
            )
        )
    gone = {r: last for r, last in seen.items() if r not in now}
    for r, (ago, instance) in gone.items():
        known = ago if math.isfinite(ago) else None
        rows.append(RankView(r, (instance,), MISSING, reason=GONE, last_seen_seconds=known))
    if key.has_id and world_size:
        rows.extend(
            RankView(str(i), (), MISSING, reason=NEVER_SEEN)
            for i in range(world_size)
            if str(i) not in now and str(i) not in gone
        )
    rows.sort(key=lambda v: (not v.reason, rank_order(v.rank)))
    return JobView(
        key=key,
        ranks=tuple(rows),
        world_size=world_size,
        stalled=bool(stalled),
        stalled_seconds=max((now[r].parked for r in stalled), default=0.0),
        sites=sites,
    )


def labels_for(views: Sequence[JobView]) -> dict[JobKey, str]:
    """The name each job is shown by: its shortest name that picks it alone with --job."""
    taken = Counter(n for v in views for n in set(v.key.names()))
    out = {}
    for v in views:
        names = v.key.names()
        out[v.key] = next((n for n in names if taken[n] == 1), names[-1])
    return out


def matching(views: Sequence[JobView], wanted: str) -> list[JobView]:
    return [v for v in views if wanted in v.key.names()]


def select(views: Sequence[JobView], wanted: str | None, where: str) -> JobView:
    """The job to show: the one --job names; without it the only job with ranks visible,
    else the only stalled one. Anything else is an error that says how to pick
    (UsageError: the caller lists the jobs beside it)."""
    if wanted is not None:
        found = matching(views, wanted)
        if len(found) == 1:
            return found[0]
        names = labels_for(views)
        if found:
            raise UsageError(
                f"--job {show(wanted)} names {len(found)} jobs in {where}: "
                + ", ".join(clean(names[v.key]) for v in found),
                "pick one with the name the list shows",
            )
        known = ", ".join(clean(names[v.key]) for v in views[:10]) + (
            ", ..." if len(views) > 10 else ""
        )
        raise UsageError(
            f"no job {show(wanted)} in {where}",
            f"known jobs: {known}" if views else "it has no job with ranks (processes with RANK)",
        )
    current = [v for v in views if v.visible]
    if len(current) == 1:
        return current[0]
    stalled = [v for v in current if v.stalled]
    if len(stalled) == 1:
        return stalled[0]
    if not current:
        raise HangwatchError(
            f"no job has ranks visible in {where}: no hangwatch_process_parked_seconds series "
            "with a rank label"
            + (
                f" (the ranks of {len(views)} jobs were seen in the last 15 minutes)"
                if views
                else ""
            ),
            "check that Prometheus scrapes hangwatch on the job's hosts and that hangwatch "
            "watches the job's processes (its targets)",
        )
    raise UsageError(
        f"{len(current)} jobs in {where}, {len(stalled)} of them stalled",
        "pick one with --job NAME (the list shows their names)",
    )
