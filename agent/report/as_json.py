"""`diagnose --json`: the report as one JSON document. Its keys are an interface: scripts
and tests read them, so a key is added here, never renamed."""

from __future__ import annotations

from typing import Any

from ..analysis import evidence as ev
from ..analysis.lockwords import words_wanted
from ..analysis.stacks import group_stacks, lock_cycle_hint, lock_waiters
from ..analysis.verdict import ProcessVerdict, ServiceVerdict
from ..model import ProcessSample, StackRead, Wanted
from .diagnosis import ISO, NO_HISTORY, Report, probe_summary, since
from .sentences import clock, evidence_json, reasons, wait_words


def wanted(r: Report) -> Wanted:
    """What the JSON shows beyond the snapshot: the names of its lock cycles' words."""
    return Wanted(words=words_wanted(r.verdicts, r.snapshot))


def to_json(r: Report) -> dict[str, Any]:
    observed = r.duration_s if r.observed_s is None else r.observed_s
    return {
        "threshold_seconds": r.threshold_s,
        "duration_seconds": r.duration_s,
        # Longer than the duration where a quiet service had to be watched to the threshold.
        "observed_seconds": round(observed, 3),
        "observed_at": clock(r.snapshot.wall, ISO),
        "services": [_service(r, v) for v in r.verdicts],
        "probe": probe_summary(r),
        "gpu": gpu_summary(r),
    }


def _service(r: Report, v: ServiceVerdict) -> dict[str, Any]:
    pids = {p.pid for p in v.processes}
    return {
        "pid": v.pid,
        "state": v.state,
        "cycles": [list(c) for c in v.cycles],
        "reasons": reasons(v.reasons),
        # The same reasons as records: each kind's fields, ages in seconds, and whose they
        # are: this window's, or the daemon's history (source "daemon")
        "evidence": [{**evidence_json(f), "source": source_of(f)} for f in v.reasons],
        "daemon_history": history_json(r, v.pid),
        "culprit": evidence_json(v.culprit) if v.culprit is not None else None,
        "seconds_since_progress": round(v.seconds_since_progress, 3),
        "unanswered_requests": v.unanswered_requests,
        "gone": v.gone,
        "processes": [_process(r, p) for p in v.processes],
        "edges": [
            {
                "waiter": e.waiter,
                "owner": e.owner,
                "kind": e.kind,
                "uaddr": hex(e.uaddr),
                "waiter_pid": e.waiter_pid,
                "owner_pid": e.owner_pid,
            }
            for e in r.graph.edges.values()
            if e.waiter_pid in pids
        ],
        "parked_groups": [
            {
                "uaddr": hex(g.uaddr),
                "op": g.op_name,
                "tids": list(g.tids),
                "pids": list(g.pids),
                "owner": g.owner,
                "since": since(r.snapshot, g.since_ns, ISO) or None,
            }
            for g in r.graph.groups()
            if pids.intersection(g.pids)
        ],
    }


def source_of(f: ev.Fact) -> str:
    daemon = isinstance(f, ev.DaemonSaw) or (isinstance(f, ev.Culprit) and f.daemon_pid is not None)
    return "daemon" if daemon else "window"


def history_json(r: Report, root: int) -> dict[str, Any] | None:
    """Whether the daemon's history of the service was had (None: the daemon not asked)."""
    h = r.history.get(root)
    if h is None:
        return None
    if h.daemon_pid is not None:
        return {"seen": True, "daemon_pid": h.daemon_pid, "socket": h.socket}
    return {"seen": False, "note": NO_HISTORY, "why": h.why, "socket": h.socket}


def process_verdict_json(p: ProcessVerdict) -> dict[str, Any]:
    """A process's verdict, the keys `diagnose --json` and `hangwatch status` share."""
    return {
        "pid": p.pid,
        "comm": p.comm,
        "threads": p.threads,
        "parked_threads": p.parked_threads,
        "parked_seconds": round(p.parked_seconds, 3),
        "state": p.state,
        "reasons": reasons(p.reasons),
    }


def _process(r: Report, p: ProcessVerdict) -> dict[str, Any]:
    read = r.inputs.stacks.get(p.pid)
    sample = r.snapshot.processes.get(p.pid)
    return {
        **process_verdict_json(p),
        "evidence": [evidence_json(f) for f in p.reasons],
        "waits": evidence_json(p.waits) if p.waits is not None else None,
        "listening_ports": list(p.listening_ports),
        # RANK, LOCAL_RANK, WORLD_SIZE, ...: the daemon's allow-listed labels
        "labels": dict(r.labels.get(p.pid, {})),
        "gone": p.gone,
        # Python stacks by group (None: not a Python process, or not read)
        "stacks": stacks_json(sample, read) if read is not None and sample is not None else None,
    }


def stacks_json(sample: ProcessSample, read: StackRead) -> dict[str, object]:
    """Every group with its whole stack (innermost first), and how the read went."""
    if read.error is not None:
        return {"error": read.error, "seconds": round(read.seconds, 3)}
    groups, native = group_stacks(sample, read.threads)
    return {
        "seconds": round(read.seconds, 3),
        "groups": [
            {
                "tids": list(g.tids),
                "wait": wait_words(g.wait),
                "gil": g.gil,
                "frames": [
                    {
                        "function": f.function,
                        "file": f.file,
                        "line": f.line,
                        "code": f.code,
                        **({"code_withheld": f.code_withheld} if f.code is None else {}),
                    }
                    for f in g.thread.frames
                ],
            }
            for g in groups
        ],
        "no_python_frames": native,
        # Threads at lock lines on two or more words: a Python lock cycle's shape (a hint)
        "lock_hint": [
            {"tid": w.tid, "function": w.frame.function, "file": w.frame.file, "line": w.frame.line}
            for w in lock_cycle_hint(lock_waiters(sample, read.threads))
        ],
    }


def gpu_summary(r: Report) -> dict[str, Any]:
    """The GPU section: what NVML said, or why it said nothing."""
    g = r.gpu
    if g is None:
        return {"ok": False, "error": "no GPU source"}
    if not g.ok:
        return {"ok": False, "error": g.error}
    return {
        "ok": True,
        "devices": [
            {
                "index": d.index,
                "uuid": d.uuid,
                "name": d.name,
                "memory_used": d.memory_used,
                "memory_total": d.memory_total,
                "utilization": d.utilization,
            }
            for d in g.devices
        ],
        "processes": {
            str(pid): [
                {"gpu": u.gpu, "memory_bytes": u.memory_bytes, "sm_utilization": u.sm_utilization}
                for u in uses
            ]
            for pid, uses in g.processes.items()
            if pid in r.snapshot.processes
        },
    }
