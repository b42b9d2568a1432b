"""Evidence in words: the one place where records of agent.analysis.evidence become sentences.

`diagnose`, the daemon's log and the ``reasons`` of ``--json`` all read what this module
writes, so a phrase is changed here or nowhere.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ..analysis import evidence as ev
from ..model import plural

NS = 1_000_000_000


def seconds(s: float) -> str:
    """Truncated, not rounded: 59.6 s under a 60 s threshold must not read "60 s"."""
    return f"{int(s)} s" if s >= 10 else f"{math.floor(s * 10) / 10:.1f} s"


def size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def gb(n: float) -> str:
    return f"{n / 1e9:.0f} GB" if n >= 10e9 else f"{n / 1e9:.1f} GB"


def gpu_list(indices: Iterable[int]) -> str:
    """'GPU 0', 'GPU 0-7', 'GPU 0,2,5': ranges where they are contiguous."""
    xs = sorted(set(indices))
    if not xs:
        return "no GPU"
    parts, start, prev = [], xs[0], xs[0]
    for x in xs[1:]:
        if x != prev + 1:
            parts.append(f"{start}-{prev}" if prev > start else str(start))
            start = x
        prev = x
    parts.append(f"{start}-{prev}" if prev > start else str(start))
    return "GPU " + ",".join(parts)


def _ports(ports: Sequence[int]) -> str:
    return ", ".join(str(p) for p in sorted(set(ports)))


def _all_threads(n: int, processes: int = 1) -> str:
    who = "its only thread" if n == 1 else f"all {n} threads"
    return who + (f" of {processes} processes" if processes > 1 else "")


def _labels(labels: Sequence[tuple[str, str]]) -> str:
    return " [" + " ".join(f"{k}={v}" for k, v in labels) + "]" if labels else ""


_SINCE = {
    "request": "the oldest unanswered request",
    "write": "the last write out of the service",
    "sent": "the last data sent out of the service",
    "received": "the last data received from outside",
    "ran": "when its last thread to run stopped",
}


def render(f: ev.Fact) -> str:
    if isinstance(f, ev.CpuWork):
        return f"{plural(f.threads, 'thread')} used CPU ({f.cpu_s:.2f} CPU-s in {f.window_s:.1f} s)"
    if isinstance(f, ev.WroteOut):
        return f"wrote {size(f.bytes)} to files or clients in {f.window_s:.1f} s"
    if isinstance(f, ev.Heartbeat):
        return (
            f"wrote only {size(f.bytes)} to {f.to} in {f.window_s:.1f} s and did nothing else: "
            "a status write, not progress"
        )
    if isinstance(f, ev.ReceivedIn):
        return f"received {size(f.bytes)} from outside the service in {f.window_s:.1f} s"
    if isinstance(f, ev.Accepted):
        return f"accepted {plural(f.connections, 'connection')}"
    if isinstance(f, ev.GpuActive):
        if f.utilization > 0:
            return f"{gpu_list(f.gpus)}: {f.utilization:.0%} SM utilisation"
        verb = "grew" if f.memory_change > 0 else "shrank"
        return f"GPU memory {verb} by {gb(abs(f.memory_change))} (loading?)"
    if isinstance(f, ev.NotParked):
        return f"{f.running} of {plural(f.threads, 'thread')} not parked"
    if isinstance(f, ev.ProcessWorks):
        return f"process {f.pid} ({f.comm}): {'; '.join(render(x) for x in f.facts)}"
    if isinstance(f, ev.PeersParked):
        return (
            f"{plural(f.processes, 'other process', 'other processes')} parked while a "
            "peer works: not a stall"
        )
    if isinstance(f, ev.AllParked):
        return (
            f"{_all_threads(f.threads, f.processes)} parked for {seconds(f.seconds)}, "
            "no progress in the window"
        )
    if isinstance(f, ev.WaitingForRequests):
        return (
            f"listening on port {_ports(f.ports)} with an empty accept queue: waiting for requests"
        )
    if isinstance(f, ev.WorkWaiting):
        pend = []
        if f.queued:
            pend.append(f"{plural(f.queued, 'connection')} waiting in the accept queue")
        if f.unread:
            pend.append(f"{plural(f.unread, 'byte')} of requests unread")
        if f.unanswered:
            pend.append(f"{plural(f.unanswered, 'request')} unanswered for {seconds(f.oldest_s)}")
        where = "connections accepted on port" if f.accepted_only else "listening on port"
        return f"{where} {_ports(f.ports)}: " + " and ".join(pend)
    if isinstance(f, ev.WorkWaited):
        return (
            f"listening on port {_ports(f.ports)}: a request waited {seconds(f.age_s)} ago "
            "and went unanswered (a client that gave up or retries), not idle"
        )
    if isinstance(f, ev.NoFrontDoor):
        return "no front door: nothing outside the service is waiting to be served"
    if isinstance(f, ev.PastThreshold):
        past = f"past the {seconds(f.threshold_s)} threshold"
        if f.since in _SINCE:
            return f"no progress for {seconds(f.stuck_s)} (since {_SINCE[f.since]}), {past}"
        return past
    if isinstance(f, ev.UnderThreshold):
        return f"no progress for {seconds(f.stuck_s)}, under the {seconds(f.threshold_s)} threshold"
    if isinstance(f, ev.LastProgress):
        verb = {
            "write": "last write out of the service",
            "sent": "last data sent",
            "received": "last data received",
            "ran": "last thread to run stopped",
        }.get(f.what, f.what)
        to = {"write": "to", "sent": "to", "received": "from", "ran": ":"}.get(f.what, "")
        target = progress_target(f.target)
        return f"{verb} {seconds(f.age_s)} ago {to} {target} (pid {f.pid})".replace(" : ", ": ")
    if isinstance(f, ev.ParkedGroup):
        if f.owner_kind == "join":
            owner = f"joining thread {f.owner}"
        elif f.owner:
            owner = f"{f.owner_kind} held by {f.owner}"
        else:
            owner = "no owner"
        since = f" for {seconds(f.age_s)}" if f.age_s is not None else ""
        where = f" across {f.processes} processes" if f.processes > 1 else ""
        return (
            f"{plural(f.threads, 'thread')} parked on one word {_word(f.uaddr, f.word)} ({f.op})"
            f"{where}, {owner}{since}"
        )
    if isinstance(f, ev.CycleLink):
        return (
            f"{f.tid} ({f.name}) waits for {f.lock_kind} {_word(f.uaddr, f.word)} held by {f.owner}"
        )
    if isinstance(f, ev.LockCycle):
        links = "; ".join(render(x) for x in f.links)
        return f"lock cycle of {plural(len(f.links), 'thread')}: {links}"
    if isinstance(f, ev.NoWaker):
        since = f" for {seconds(f.age_s)}" if f.age_s is not None else ""
        return (
            f"process {f.pid} ({f.comm}): {_all_threads(f.threads)} wait{'s' if f.threads == 1 else ''}"
            f"{since} on {plural(f.words, 'process-private futex word')} with no timeout, the "
            "same in two reads: no thread of it can wake another and no other process can "
            "reach them; only a signal can end it"
        )
    if isinstance(f, ev.MoreNoWaker):
        return f"and {plural(f.processes, 'other process', 'other processes')} like them"
    if isinstance(f, ev.CyclesStable):
        where = "among its threads" if f.among_threads else "stable across two reads"
        return f"{plural(f.cycles, 'lock cycle')} {where}"
    if isinstance(f, ev.Doors):
        if not (f.front or f.plumbing):
            return "no listener"
        parts = []
        if f.front:
            s = "s" if len(f.front) > 1 else ""
            parts.append(f"front door{s} " + ", ".join(f"{p} ({door_why(w)})" for p, w in f.front))
        if f.plumbing:
            parts.append(
                "not front doors: " + ", ".join(f"{p} ({door_why(w)})" for p, w in f.plumbing)
            )
        return "; ".join(parts)
    if isinstance(f, ev.ListeningSince):
        return f"port {f.port} listening since {clock(f.at)}"
    if isinstance(f, ev.LastWrite):
        return f"last write {f.age_s:.0f} s ago, to {f.target} (pid {f.pid})"
    if isinstance(f, ev.GpuIdle):
        each = (
            f"{gb(f.memory_each)} held each"
            if f.memory_each is not None
            else f"{gb(f.memory_total)} held"
        )
        return f"{gpu_list(f.gpus)}: 0% for {f.idle_s:.0f} s, {each}"
    if isinstance(f, ev.GpuSpin):
        return (
            f"{gpu_list(f.gpus)} at {f.utilization:.0%} or more for {f.seconds:.0f} s while "
            "every host thread is parked: a collective spinning on the GPU?"
        )
    if isinstance(f, ev.WaitsWithService):
        return f"waits with its service, which is {f.state}"
    if isinstance(f, ev.Exited):
        return "exited while watched" if f.pid is None else f"process {f.pid} exited while watched"
    if isinstance(f, ev.NothingLeft):
        return "nothing left to watch"
    if isinstance(f, ev.Culprit):
        return f"held up by process {f.pid} ({f.comm}){_labels(f.labels)}: {culprit_why(f)}"
    if isinstance(f, ev.ProcessWaits):
        return process_waits(f)
    if isinstance(f, ev.StackGroup):
        return stack_group(f)
    if isinstance(f, ev.NoPythonStack):
        what = ", ".join(f"{n} {w}" for w, n in f.waits)
        return f"{plural(f.threads, 'thread')} with no Python frames ({what})"
    if isinstance(f, ev.StacksUnread):
        return f"Python stacks of process {f.pid} not read: {f.why}"
    if isinstance(f, ev.PyLockHint):
        return lock_hint(f)
    if isinstance(f, ev.LockAt):
        return f"thread {f.tid} at {_lock_site(f)}"
    if isinstance(f, ev.MoreStackGroups):
        return f"and {plural(f.groups, 'other stack')} ({plural(f.threads, 'thread')})"
    return f.kind.replace("_", " ")


def _word(uaddr: int, word: str | None) -> str:
    """ "0x7f3a...40a0 (`abba_a` in libabba.so+0x40a0)": the address, and what it is."""
    return f"{uaddr:#x} ({word})" if word else f"{uaddr:#x}"


def _at(code: str | None, fallback: str) -> str:
    return f"`{code}`" if code else fallback


SHOWN_THREADS = 8  # named in a line about threads; the rest are counted


def who(threads: Sequence[tuple[int, str]]) -> str:
    """ "11 (sched), 12 (io) and 3 more": (TID, name) pairs, the first few by name."""
    named = ", ".join(f"{t} ({n})" if n else str(t) for t, n in threads[:SHOWN_THREADS])
    rest = len(threads) - SHOWN_THREADS
    return named + (f" and {rest} more" if rest > 0 else "")


def _lock_site(w: ev.LockAt) -> str:
    """ "`with self.b:` (sched.py:154)": the line that takes the lock, else its function."""
    return f"{_at(w.code, f'`{w.function}`')} ({w.file}:{w.line})"


def stack_group(f: ev.StackGroup) -> str:
    """ "14 threads at `Queue.get` (scheduler.py:212) in `event_loop`, in futex WAIT_BITSET
    with no timeout": the line of the program's own code, and what it called there."""
    what = f"`{f.callee}`" if f.callee else _at(f.code, f"`{f.function}`")
    on = f" on {f.on}" if f.on else ""
    native = f" (native: {f.native})" if f.native else ""
    gil = f", thread {f.gil} holds the GIL" if f.gil is not None else ""
    return (
        f"{plural(f.threads, 'thread')} at {what} ({f.file}:{f.line}) in `{f.function}`, "
        f"{f.wait}{on}{native}{gil}: {who(list(zip(f.tids, f.names)))}"
    )


def lock_hint(f: ev.PyLockHint) -> str:
    """ "2 threads of process 9 wait with no timeout at `with self.b:` (sched.py:154) and
    `with self.a:` (sched.py:160) on 2 lock words, all since 05:13:06: a Python lock cycle?" """
    sites: list[str] = []
    for w in f.waits:
        if _lock_site(w) not in sites:
            sites.append(_lock_site(w))
    where = " and ".join(sites) if len(sites) <= 2 else ", ".join(sites[:-1]) + f" and {sites[-1]}"
    since = ""
    if f.since_wall is not None:
        since = ", all since " + time.strftime("%H:%M:%S", time.localtime(f.since_wall))
    return (
        f"{plural(len(f.waits), 'thread')} of process {f.pid} wait with no timeout at {where} "
        f"on {plural(f.words, 'lock word')}{since}: a Python lock cycle? "
        "(Python locks record no owner, so this is a hint, not a proof)"
    )


def culprit_why(f: ev.Culprit) -> str:
    if f.why == "cycle":
        return "its threads are in the lock cycle"
    if f.why == "no waker":
        return "every thread of it waits for another of its own threads, and none can run"
    since = f", the oldest for {seconds(f.age_s)}" if f.age_s is not None else ""
    return (
        f"{plural(f.threads, 'thread')} {'waits' if f.threads == 1 else 'wait'} with no timeout "
        "on locks or events of its own"
        f"{since}, while the other processes wait on I/O or with timeouts"
    )


def process_waits(f: ev.ProcessWaits) -> str:
    """'waits: 3 threads on futex with no timeout (the oldest 95 s), 1 in epoll_wait, ...'"""
    parts = []
    for name, timed, n in f.waits:
        how = "" if timed is None else (" with a timeout" if timed else " with no timeout")
        parts.append(f"{plural(n, 'thread')} in {name}{how}")
    if f.running:
        parts.append(f"{f.running} running")
    oldest = (
        f" (the oldest untimed futex wait began {seconds(f.oldest_untimed_s)} ago)"
        if f.oldest_untimed_s is not None
        else ""
    )
    return "waits: " + ", ".join(parts) + oldest


def reasons(facts: Iterable[ev.Fact]) -> list[str]:
    return [render(f) for f in facts]


# --- typed fields of records, in words ------------------------------------------------------


def clock(wall: float) -> str:
    """A wall-clock time (time.time()) as the local clock shows it: '05:13:06'."""
    return time.strftime("%H:%M:%S", time.localtime(wall))


def progress_target(target: str | ev.Thread) -> str:
    """What a LastProgress was seen on: a file or a peer as it is, a thread by TID and name."""
    if isinstance(target, ev.Thread):
        return f"thread {target.tid} ({target.name})"
    return target


def _holder(h: ev.Holder) -> str:
    """'rank pid 123', 'torchrun pid 77', 'pid 9 (python3)'."""
    if h.launcher is not None:
        return f"{h.launcher} pid {h.pid}"
    if h.rank:
        return f"rank pid {h.pid}"
    return f"pid {h.pid} ({h.comm})"


_DOOR_RULES = {
    ev.DoorRule.DECLARED: "declared in the config",
    ev.DoorRule.NOT_DECLARED: "not among the config's front doors",
    ev.DoorRule.NONE_DECLARED: "the config says it has no front door",
    ev.DoorRule.KERNEL_CHOSEN: "bound to port 0: the kernel chose it, no client knows it",
    ev.DoorRule.NAMED: (
        "named on the command line, no connection yet: a front door until shown otherwise"
    ),
    ev.DoorRule.BY_NUMBER: (
        "asked for by number, no connection yet: a front door until shown otherwise"
    ),
}


def door_why(w: ev.DoorWhy) -> str:
    """Why a port is a front door or not (agent.analysis.frontdoor's rules), in words."""
    if w.rule in _DOOR_RULES:
        return _DOOR_RULES[w.rule]
    holder = _holder(w.holder) if w.holder is not None else "?"
    if w.rule == ev.DoorRule.PLUMBING:
        what = "rendezvous endpoint" if w.flag == "--rdzv-endpoint" else w.flag
        return f"{what} of {holder}"
    if w.rule == ev.DoorRule.JOB_EPHEMERAL:
        launched = w.holder is not None and w.holder.launcher
        what = "an auto-assigned store" if launched else "a collective library"
        return f"ephemeral port of {holder}: {what}'s listener"
    if w.rule == ev.DoorRule.UNNAMED_EPHEMERAL:
        return (
            f"a port in the kernel's ephemeral range (from {w.ephemeral_from}) that the command "
            "line does not name, with no connection: chosen by the kernel or a runtime"
        )
    if w.rule == ev.DoorRule.CLIENTS and w.peer is not None:
        more = f" and {w.more} more" if w.more > 0 else ""
        return f"clients from outside connect to it: from {w.peer[0]}:{w.peer[1]}{more}"
    ps = sorted(set(w.pids))
    pids = f"pid{'s' if len(ps) > 1 else ''} " + ", ".join(map(str, ps))
    return f"every peer is a process of the service ({pids})"


def _said(f: ev.Fact) -> Mapping[str, Any]:
    """The fields of a record that ``--json`` gives in words, as the sentences say them."""
    if isinstance(f, ev.Doors):
        return {
            "front": [[p, door_why(w)] for p, w in f.front],
            "plumbing": [[p, door_why(w)] for p, w in f.plumbing],
        }
    if isinstance(f, ev.ListeningSince):
        return {"at": clock(f.at)}
    if isinstance(f, ev.LastProgress):
        return {"target": progress_target(f.target)}
    return {}


def evidence_json(f: ev.Fact) -> dict[str, Any]:
    """A record for ``--json``: its fields as they are (agent.analysis.evidence.as_json), and
    the typed ones that stand for words (a front door's why, a clock time, a thread) in the
    words the reasons use."""
    return ev.as_json(f, _said)
