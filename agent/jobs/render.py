"""`hangwatch job` output: a table for the terminal, or one JSON document.

Label values come from the watched programs (a site is made of their file and function names)
and from whoever configures Prometheus: text shows them with every non-printable character
replaced by "?", so a value can neither move the cursor nor pass for another; JSON keeps them
exact. The JSON's keys are an interface, added to, never renamed (README.md, "`hangwatch job`:
which rank holds a job up", lists them).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from ..model import plural
from .ranks import (
    GONE,
    MISSING,
    NEVER_SEEN,
    NOT_PARKED,
    OTHER_SITE,
    JobKey,
    JobView,
    RankView,
    clean,
    rank_order,
)

MAX_ODD_LINES = 6


def duration(seconds: float) -> str:
    """Truncated, like the daemon's: 59.9 s parked is not yet "1m 00s"."""
    s = int(seconds)
    if s < 1:
        return "<1s"
    if s < 60:
        return f"{s}s"
    m, s = divmod(s, 60)
    if m < 60:
        return f"{m}m {s:02d}s"
    h, m = divmod(m, 60)
    if h < 24:
        return f"{h}h {m:02d}m"
    d, h = divmod(h, 24)
    return f"{d}d {h:02d}h"


def rank_ranges(ranks: Sequence[str]) -> str:
    """Runs of rank numbers ("0-3, 5, 9-10"), then any rank that is not a number."""
    numbers = sorted({int(r) for r in ranks if r.isdigit()})
    parts: list[str] = []
    i = 0
    while i < len(numbers):
        j = i
        while j + 1 < len(numbers) and numbers[j + 1] == numbers[j] + 1:
            j += 1
        parts.append(str(numbers[i]) if i == j else f"{numbers[i]}-{numbers[j]}")
        i = j + 1
    parts.extend(clean(r) for r in sorted({r for r in ranks if not r.isdigit()}))
    return ", ".join(parts)


def _ranks_word(ranks: Sequence[str]) -> str:
    return f"{'rank' if len(ranks) == 1 else 'ranks'} {rank_ranges(ranks)}"


def _host(r: RankView) -> str:
    return clean(",".join(r.instances)) if any(r.instances) else "?"


def _total(v: JobView) -> int:
    return max(v.world_size or 0, len(v.ranks)) if v.key.has_id else len(v.ranks)


def count_text(v: JobView) -> str:
    """The ranks visible, of as many as the job has (its world size, or those seen):
    "4 ranks of 8"."""
    n, total = len(v.visible), _total(v)
    if total > n or (v.key.has_id and v.world_size):
        return f"{n} {'rank' if total == 1 else 'ranks'} of {total}"
    return plural(n, "rank")


def state_text(v: JobView) -> str:
    if v.stalled:
        return f"stalled for {duration(v.stalled_seconds)}"
    if not v.visible:
        return "no rank visible"
    counts = Counter(r.state for r in v.visible)
    return "not stalled (" + ", ".join(f"{n} {clean(s)}" for s, n in sorted(counts.items())) + ")"


def headline(v: JobView, name: str) -> str:
    service = f"service {clean(v.key.service)}"
    if not v.key.has_id:
        service += ", no job key: the ranks on one host"
    return f"job {clean(name)} ({service}): {count_text(v)}, {state_text(v)}"


def _odd_line(v: JobView, r: RankView) -> str:
    who = f"rank {clean(r.rank)} on {_host(r)}"
    top = v.top_site
    if r.reason == OTHER_SITE and top is not None:
        others = plural(top[1], "rank")
        return f"{who} waits at {clean(r.site)} while {others} wait at {clean(top[0])}"
    if r.reason == NOT_PARKED:
        n = sum(1 for x in v.visible if x.waits)
        where = f" at {clean(top[0])}" if top is not None else ""
        verb = "waits" if n == 1 else "wait"
        return f"{who} is not parked (it works) while {plural(n, 'rank')} {verb}{where}"
    return f"{who}: {r.reason}"


def _no_odd_line(v: JobView) -> str:
    # Said of the visible ranks only: a missing one may be the rank they wait for.
    nobody = "no odd one out among the visible ranks" if v.missing else "no odd one out"
    if not v.sites:
        return f"{nobody}: every one is parked, and no site was read (stacks off, or unreadable)"
    if v.top_site is None:
        tied = [f"{plural(n, 'rank')} at {clean(s)}" for s, n in v.sites[:3]]
        return f"{nobody} by site, a tie: " + ", ".join(tied)
    return f"{nobody}: every rank with a site waits at {clean(v.sites[0][0])}"


def not_visible_text(v: JobView) -> str:
    """The missing ranks in one line: which, where last seen and when, which never seen."""
    # Ranks gone together (a host's hangwatch down) read as one: "ranks 8-15 (last seen...)".
    gone: dict[str, list[str]] = {}
    for r in v.missing:
        if r.reason == GONE:
            ago = f" {duration(r.last_seen_seconds)} ago" if r.last_seen_seconds is not None else ""
            gone.setdefault(f"last seen on {_host(r)}{ago}", []).append(r.rank)
    parts = [f"{_ranks_word(rs)} ({where})" for where, rs in list(gone.items())[:5]]
    rest = [r for rs in list(gone.values())[5:] for r in rs]
    if rest:
        parts.append(f"{_ranks_word(rest)} (seen in the last 15 minutes)")
    never = [r.rank for r in v.missing if r.reason == NEVER_SEEN]
    if never:
        parts.append(f"{_ranks_word(never)} (never seen; world size {v.world_size})")
    return ", ".join(parts)


def job_text(v: JobView, name: str) -> str:
    lines = [headline(v, name)]
    present_odd = [r for r in v.odd if r.state != MISSING]
    if present_odd:
        said = [_odd_line(v, r) for r in present_odd[:MAX_ODD_LINES]]
        if len(present_odd) > MAX_ODD_LINES:
            said.append(f"and {len(present_odd) - MAX_ODD_LINES} more (the table lists them)")
        lines += (
            ["odd one out: " + said[0]]
            if len(said) == 1
            else ["odd ones out:", *("  " + s for s in said)]
        )
    elif v.stalled:
        lines.append(_no_odd_line(v))
    if v.missing:
        lines.append("not visible: " + not_visible_text(v))
    lines += ["", *table(v)]
    return "\n".join(lines) + "\n"


def _why(r: RankView) -> str:
    if r.reason == GONE and r.last_seen_seconds is not None:
        return f"missing, last seen {duration(r.last_seen_seconds)} ago"
    return r.reason


def _for(r: RankView) -> str:
    return duration(r.parked_seconds) if r.parked_seconds else "-"


def table(v: JobView) -> list[str]:
    rows = [("RANK", "HOST", "PID", "STATE", "FOR", "SITE", "WHY")]
    rows += [
        (
            clean(r.rank),
            _host(r),
            clean(r.pid) or "-",
            clean(r.state),
            _for(r),
            clean(r.site) or "-",
            _why(r),
        )
        for r in v.ranks
    ]
    return _columns(rows)


def _columns(rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    return [
        "  ".join([*(c.ljust(w) for c, w in zip(row, widths)), row[-1]]).rstrip() for row in rows
    ]


def jobs_text(views: Sequence[JobView], names: dict[JobKey, str]) -> str:
    """The jobs to pick from with --job: name, service, ranks, state."""
    rows = [("JOB", "SERVICE", "RANKS", "STATE")]
    for v in sorted(views, key=lambda v: (not v.stalled, not v.visible, names[v.key])):
        n, total = len(v.visible), _total(v)
        ranks = f"{n}/{total}" if total > n or (v.key.has_id and v.world_size) else str(n)
        rows.append((clean(names[v.key]), clean(v.key.service), ranks, state_text(v)))
    return "\n".join(_columns(rows)) + "\n"


def job_summary(v: JobView, name: str) -> dict[str, Any]:
    return {
        "job": name,
        "service": v.key.service,
        "job_key": v.key.key,
        "torchelastic_run_id": v.key.run_id,
        "slurm_job_id": v.key.slurm_job_id,
        "instance": v.key.instance,
        "service_pid": v.key.service_pid,
        "world_size": v.world_size,
        "ranks_visible": len(v.visible),
        "ranks_missing": sorted((r.rank for r in v.missing), key=rank_order),
        "stalled": v.stalled,
        "stalled_seconds": round(v.stalled_seconds, 3),
    }


def rank_json(r: RankView) -> dict[str, Any]:
    return {
        "rank": r.rank,
        "instances": list(r.instances),
        "pid": r.pid or None,
        "pids": list(r.pids),
        "state": r.state,
        "waits": r.waits,
        "site": r.site or None,
        "parked_seconds": None if r.parked_seconds is None else round(r.parked_seconds, 3),
        "reason": r.reason or None,
        "last_seen_seconds_ago": (
            None if r.last_seen_seconds is None else round(r.last_seen_seconds, 3)
        ),
    }


def document(
    url: str, views: Sequence[JobView], names: dict[JobKey, str], shown: JobView | None
) -> dict[str, Any]:
    job = None
    if shown is not None:
        job = {
            **job_summary(shown, names[shown.key]),
            "ranks": [rank_json(r) for r in shown.ranks],
            "sites": [{"site": s, "ranks": n} for s, n in shown.sites],
        }
    return {
        "prometheus": url,
        "jobs": [job_summary(v, names[v.key]) for v in views],
        "job": job,
    }
