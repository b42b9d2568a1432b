"""`hangwatch status`: the daemon's verdicts in the words and JSON shape of `diagnose`, with
what only the daemon knows (since when, its changes, the evidence it carries across ticks,
where the threads waited at its last hang). ``answer`` builds the status socket's answer in
the daemon; ``render_text`` writes it for a person, in the client, from that JSON alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..analysis.history import Carried, ServiceHistory
from ..analysis.verdict import ProcessVerdict, ServiceVerdict
from ..model import plural
from .as_json import process_verdict_json
from .diagnosis import ISO
from .sentences import clock, evidence_json, reasons, seconds

# The flight record kept per service: its lines of stacks, each cut to a line's width.
MAX_FLIGHT_LINES = 64
MAX_LINE_CHARS = 400
MAX_PIDS_LISTED = 64  # per service, in the list of what is watched


@dataclass(frozen=True)
class Flight:
    """Where a service's threads waited at its last change to stalled or deadlocked, as the
    flight recorder logged it (rendered stack facts)."""

    wall: float
    state: str
    lines: tuple[str, ...]

    @classmethod
    def of(cls, wall: float, state: str, lines: Sequence[str]) -> Flight:
        cut = tuple(x[:MAX_LINE_CHARS] for x in lines[:MAX_FLIGHT_LINES])
        return cls(wall, state, cut)


@dataclass(frozen=True)
class ServiceStatus:
    name: str
    verdict: ServiceVerdict
    pids: tuple[int, ...]
    history: ServiceHistory | None
    carried: Carried


@dataclass(frozen=True)
class StatusView:
    """The daemon as of its last tick: built by the loop, read whole by the status server."""

    daemon_pid: int
    version: str
    wall: float  # the last tick's time.time()
    threshold_s: float
    interval_s: float
    services: tuple[ServiceStatus, ...]
    flights: Mapping[tuple[str, int], Flight] = field(default_factory=dict)


def answer(view: StatusView, pid: int | None, now: float) -> dict[str, Any]:
    """The answer to a request for ``pid``'s service (None: all of them). A pid the daemon
    does not watch gets no service and the list of what it watches."""
    chosen = [s for s in view.services if pid is None or pid in s.pids]
    return {
        "version": 1,
        "ok": True,
        "daemon": {"pid": view.daemon_pid, "version": view.version},
        "at": clock(now, ISO),
        "last_tick": clock(view.wall, ISO),
        "last_tick_seconds": round(max(0.0, now - view.wall), 3),
        "threshold_seconds": view.threshold_s,
        "interval_seconds": view.interval_s,
        "pid": pid,
        "watched": [
            {"service": s.name, "pid": s.verdict.pid, "pids": list(s.pids[:MAX_PIDS_LISTED])}
            for s in view.services
        ],
        "services": [
            _service(s, view.flights.get((s.name, s.verdict.pid)), now - view.wall, now)
            for s in chosen
        ],
    }


def _service(s: ServiceStatus, flight: Flight | None, lag: float, now: float) -> dict[str, Any]:
    v, h, c = s.verdict, s.history, s.carried
    since = h.since_wall if h is not None else now
    return {
        "service": s.name,
        "pid": v.pid,
        "state": v.state,
        "cycles": [list(x) for x in v.cycles],
        "reasons": reasons(v.reasons),
        "evidence": [evidence_json(f) for f in v.reasons],
        "culprit": evidence_json(v.culprit) if v.culprit is not None else None,
        "seconds_since_progress": round(v.seconds_since_progress, 3),
        "unanswered_requests": v.unanswered_requests,
        "processes": [_process(p) for p in v.processes],
        "since": clock(since, ISO),
        "since_unix": round(since, 3),
        "seconds_in_state": round(max(0.0, now - since), 3),
        "changes": [
            {
                "at": clock(x.wall, ISO),
                "unix": round(x.wall, 3),
                "old": x.old,
                "new": x.new,
                "reasons": reasons(x.reasons),
            }
            for x in (h.changes if h is not None else ())
        ],
        "carried": _carried(c, lag),
        "flight": {
            "at": clock(flight.wall, ISO),
            "state": flight.state,
            "lines": list(flight.lines),
        }
        if flight is not None
        else None,
    }


def _process(p: ProcessVerdict) -> dict[str, Any]:
    return {**process_verdict_json(p), "listening_ports": list(p.listening_ports)}


def _carried(c: Carried, lag: float) -> dict[str, Any]:
    """Ages as of now: the tick's ages and the time since it."""

    def age(s: float) -> float:
        return round(s + lag, 3)

    return {
        "last_demand_seconds": age(c.last_demand_s) if c.last_demand_s is not None else None,
        "streams": [
            {"pid": x.pid, "inode": x.inode, "last_sent_seconds": age(x.last_sent_s)}
            for x in c.streams
        ],
        "unanswered_requests": c.unanswered_requests,
        "oldest_unanswered_seconds": age(c.oldest_unanswered_s) if c.unanswered_requests else 0,
        "seconds_since_progress": age(c.seconds_since_progress) if c.seconds_since_progress else 0,
        "parked_seconds": age(c.parked_s) if c.parked_s else 0,
        "last_progress": evidence_json(c.last_progress) if c.last_progress is not None else None,
    }


# --- the client's text, from the answer's JSON ----------------------------------------------


def _when(doc: Mapping[str, Any], key: str) -> str:
    """'10:42:07' from an ISO time of the answer ('' when absent)."""
    v = doc.get(key)
    return v[11:19] if isinstance(v, str) and len(v) >= 19 else ""


def render_text(doc: Mapping[str, Any]) -> str:
    services = doc.get("services") or []
    daemon = doc.get("daemon") or {}
    lines = [
        f"hangwatch status: {plural(len(services), 'service')} of "
        f"{len(doc.get('watched') or [])} watched by the daemon (pid {daemon.get('pid')}, "
        f"hangwatch {daemon.get('version')}), threshold {doc.get('threshold_seconds'):g} s, "
        f"last tick at {_when(doc, 'last_tick')} ({seconds(doc.get('last_tick_seconds', 0))} "
        "ago)",
        "",
    ]
    for s in services:
        lines.extend(_service_lines(s))
        lines.append("")
    return "\n".join(lines).rstrip("\n") + "\n"


def _service_lines(s: Mapping[str, Any]) -> list[str]:
    lines = [
        f"service {s['service']} (pid {s['pid']}): {str(s['state']).upper()} since "
        f"{_when(s, 'since')} ({seconds(s.get('seconds_in_state', 0))})"
    ]
    lines.extend(f"  - {x}" for x in s.get("reasons", []))
    for p in s.get("processes", []):
        park = f", all parked for {p['parked_seconds']:.1f} s" if p.get("parked_seconds") else ""
        ports = p.get("listening_ports") or []
        listening = f", listening on {', '.join(map(str, ports))}" if ports else ""
        lines.append(
            f"  process {p['pid']} {p['comm']}: {p['state']}, "
            f"{plural(p['threads'], 'thread')}, {p['parked_threads']} parked{park}{listening}"
        )
        if p["state"] != s["state"]:
            lines.extend(f"      {x}" for x in p.get("reasons", []))
    carried = _carried_words(s.get("carried") or {})
    if carried:
        lines.append("  carried across ticks:")
        lines.extend(f"    {x}" for x in carried)
    changes = s.get("changes") or []
    if changes:
        lines.append(f"  changes (last {len(changes)}, oldest first):")
        for x in changes:
            why = "; ".join(x.get("reasons", []))
            lines.append(
                f"    {_when(x, 'at')} {x.get('old') or 'new'} -> {x['new']}"
                + (f": {why}" if why else "")
            )
    flight = s.get("flight")
    if flight:
        lines.append(
            f"  where its threads waited when it turned {flight['state']} at {_when(flight, 'at')}:"
        )
        lines.extend(f"    {x}" for x in flight.get("lines", []))
    return lines


def _carried_words(c: Mapping[str, Any]) -> list[str]:
    out = []
    if c.get("last_demand_seconds") is not None:
        out.append(f"work last waited at its front doors {seconds(c['last_demand_seconds'])} ago")
    streams = c.get("streams") or []
    if streams:
        oldest = max(x["last_sent_seconds"] for x in streams)
        out.append(
            f"{plural(len(streams), 'streamed answer')} begun and not finished, the oldest "
            f"last sent {seconds(oldest)} ago"
        )
    if c.get("unanswered_requests"):
        out.append(
            f"{plural(c['unanswered_requests'], 'request')} unanswered, the oldest for "
            f"{seconds(c['oldest_unanswered_seconds'])}"
        )
    if c.get("seconds_since_progress"):
        out.append(f"no progress for {seconds(c['seconds_since_progress'])}")
    return out
