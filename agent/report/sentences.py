"""Evidence in words: the one place where records of agent.analysis.evidence become sentences.

`diagnose`, the daemon's log and the ``reasons`` of ``--json`` all read what this module
writes, so a phrase is changed here or nowhere.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ..analysis import evidence as ev
from ..model import plural
from .fds import fds_words


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


def labels_text(labels: Sequence[tuple[str, str]]) -> str:
    """' [rank=1 world_size=2]' for a rank's job labels; '' for a process without them."""
    return " [" + " ".join(f"{k}={v}" for k, v in labels) + "]" if labels else ""


_SINCE = {
    "request": "the oldest unanswered request",
    "write": "the last write out of the service",
    "sent": "the last data sent out of the service",
    "received": "the last data received from outside",
    "ran": "when its last thread to run stopped",
}


@functools.singledispatch
def render(f: ev.Fact) -> str:
    """A record in words: each kind of record has its function below, registered for its
    type; a kind with none is told by its name ("brand new thing")."""
    return f.kind.replace("_", " ")


@render.register
def _(f: ev.CpuWork) -> str:
    return f"{plural(f.threads, 'thread')} used CPU ({f.cpu_s:.2f} CPU-s in {f.window_s:.1f} s)"


@render.register
def _(f: ev.Spins) -> str:
    return (
        f"{plural(f.threads, 'thread')} spun ({f.cpu_s:.2f} CPU-s in {f.window_s:.1f} s, "
        f"{f.empty_polls} polls that found nothing): CPU that serves no one"
    )


@render.register
def _(f: ev.ProcessSpins) -> str:
    return f"process {f.pid} ({f.comm}): {render(f.spins)}"


@render.register
def _(f: ev.WroteOut) -> str:
    if f.answered:
        return (
            f"wrote {size(f.bytes)} to files or clients in {f.window_s:.1f} s, "
            f"{size(f.answered)} of it answers to clients"
        )
    return f"wrote {size(f.bytes)} to files or clients in {f.window_s:.1f} s"


@render.register
def _(f: ev.Heartbeat) -> str:
    return (
        f"wrote only {size(f.bytes)} to {f.to} in {f.window_s:.1f} s and did nothing else: "
        "a status write, not progress"
    )


@render.register
def _(f: ev.ReceivedIn) -> str:
    return f"received {size(f.bytes)} from outside the service in {f.window_s:.1f} s"


@render.register
def _(f: ev.ReadStorage) -> str:
    read = f"read {size(f.bytes)} from storage"
    if f.major_faults:
        read += f" and paged in mapped files ({plural(f.major_faults, 'major fault')})"
    return f"{read} in {f.window_s:.1f} s"


@render.register
def _(f: ev.Accepted) -> str:
    return f"accepted {plural(f.connections, 'connection')}"


@render.register
def _(f: ev.GpuActive) -> str:
    if f.utilization > 0:
        return f"{gpu_list(f.gpus)}: {f.utilization:.0%} SM utilisation"
    verb = "grew" if f.memory_change > 0 else "shrank"
    return f"GPU memory {verb} by {gb(abs(f.memory_change))} (loading?)"


@render.register
def _(f: ev.NotParked) -> str:
    return f"{f.running} of {plural(f.threads, 'thread')} not parked"


@render.register
def _(f: ev.ProcessWorks) -> str:
    return f"process {f.pid} ({f.comm}): {'; '.join(render(x) for x in f.facts)}"


@render.register
def _(f: ev.PeersParked) -> str:
    return (
        f"{plural(f.processes, 'other process', 'other processes')} parked while a "
        "peer works: not a stall"
    )


@render.register
def _(f: ev.AllParked) -> str:
    return (
        f"{_all_threads(f.threads, f.processes)} parked for {seconds(f.seconds)}, "
        "no progress in the window"
    )


@render.register
def _(f: ev.WaitingForRequests) -> str:
    return f"listening on port {_ports(f.ports)} with an empty accept queue: waiting for requests"


@render.register
def _(f: ev.RequestIncomplete) -> str:
    return (
        f"{plural(f.requests, 'request')} incomplete from the client for {seconds(f.oldest_s)}: "
        "the client's wait (the server read what came and waits for the rest)"
    )


def _present(*counted: tuple[int, str]) -> list[str]:
    """The phrases whose count is not zero, in order."""
    return [phrase for n, phrase in counted if n]


@render.register
def _(f: ev.WorkWaiting) -> str:
    pend = _present(
        (f.queued, f"{plural(f.queued, 'connection')} waiting in the accept queue"),
        (f.unread, f"{plural(f.unread, 'byte')} of requests unread"),
        (f.unanswered, f"{plural(f.unanswered, 'request')} unanswered for {seconds(f.oldest_s)}"),
    )
    where = "connections accepted on port" if f.accepted_only else "listening on port"
    return f"{where} {_ports(f.ports)}: " + " and ".join(pend)


@render.register
def _(f: ev.WorkWaited) -> str:
    return (
        f"listening on port {_ports(f.ports)}: a request waited {seconds(f.age_s)} ago "
        "and went unanswered (a client that gave up or retries), not idle"
    )


@render.register
def _(f: ev.NoFrontDoor) -> str:
    return "no front door: nothing outside the service is waiting to be served"


@render.register
def _(f: ev.PastThreshold) -> str:
    past = f"past the {seconds(f.threshold_s)} threshold"
    if f.since in _SINCE:
        return f"no progress for {seconds(f.stuck_s)} (since {_SINCE[f.since]}), {past}"
    return past


@render.register
def _(f: ev.UnderThreshold) -> str:
    return f"no progress for {seconds(f.stuck_s)}, under the {seconds(f.threshold_s)} threshold"


_LAST = {
    "write": "last write out of the service",
    "sent": "last data sent",
    "received": "last data received",
    "ran": "last thread to run stopped",
}
_LAST_TO = {"write": "to", "sent": "to", "received": "from", "ran": ":"}


@render.register
def _(f: ev.LastProgress) -> str:
    verb, to = _LAST.get(f.what, f.what), _LAST_TO.get(f.what, "")
    target = progress_target(f.target)
    return f"{verb} {seconds(f.age_s)} ago {to} {target} (pid {f.pid})".replace(" : ", ": ")


@render.register
def _(f: ev.ParkedGroup) -> str:
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


@render.register
def _(f: ev.CycleLink) -> str:
    return f"{f.tid} ({f.name}) waits for {f.lock_kind} {_word(f.uaddr, f.word)} held by {f.owner}"


@render.register
def _(f: ev.LockCycle) -> str:
    links = "; ".join(render(x) for x in f.links)
    return f"lock cycle of {plural(len(f.links), 'thread')}: {links}"


@render.register
def _(f: ev.NoWaker) -> str:
    since = f" for {seconds(f.age_s)}" if f.age_s is not None else ""
    return (
        f"process {f.pid} ({f.comm}): {_all_threads(f.threads)} wait{'s' if f.threads == 1 else ''}"
        f"{since} on {plural(f.words, 'process-private futex word')} with no timeout, the "
        "same in two reads: no thread of it can wake another and no other process can "
        "reach them; only a signal can end it"
    )


@render.register
def _(f: ev.MoreNoWaker) -> str:
    return f"and {plural(f.processes, 'other process', 'other processes')} like them"


@render.register
def _(f: ev.CyclesStable) -> str:
    where = "among its threads" if f.among_threads else "stable across two reads"
    return f"{plural(f.cycles, 'lock cycle')} {where}"


@render.register
def _(f: ev.Doors) -> str:
    if not (f.front or f.plumbing):
        return "no listener"
    parts = []
    if f.front:
        s = "s" if len(f.front) > 1 else ""
        parts.append(f"front door{s} " + ", ".join(f"{p} ({door_why(w)})" for p, w in f.front))
    if f.plumbing:
        parts.append("not front doors: " + ", ".join(f"{p} ({door_why(w)})" for p, w in f.plumbing))
    return "; ".join(parts)


@render.register
def _(f: ev.ListeningSince) -> str:
    return f"port {f.port} listening since {clock(f.at)}"


@render.register
def _(f: ev.LastWrite) -> str:
    return f"last write {f.age_s:.0f} s ago, to {f.target} (pid {f.pid})"


@render.register
def _(f: ev.GpuIdle) -> str:
    each = (
        f"{gb(f.memory_each)} held each"
        if f.memory_each is not None
        else f"{gb(f.memory_total)} held"
    )
    return f"{gpu_list(f.gpus)}: 0% for {f.idle_s:.0f} s, {each}"


@render.register
def _(f: ev.GpuSpin) -> str:
    return (
        f"{gpu_list(f.gpus)} at {f.utilization:.0%} or more for {f.seconds:.0f} s while "
        "every host thread is parked: a collective spinning on the GPU?"
    )


@render.register
def _(f: ev.WaitsWithService) -> str:
    return f"waits with its service, which is {f.state}"


EXITED = "exited while watched"


@render.register
def _(f: ev.EvidenceIncomplete) -> str:
    lost = _present(
        (f.entries_refused, f"{plural(f.entries_refused, 'thread, fd or refusal')} not recorded"),
        (f.events_dropped, f"{plural(f.events_dropped, 'wait event')} dropped"),
    )
    what = " and ".join(lost) or "some of its evidence not recorded"
    return (
        f"process {f.pid}: evidence incomplete, {what}: it held its share of the kernel "
        "maps every process shares"
    )


@render.register
def _(f: ev.Exited) -> str:
    return EXITED if f.pid is None else f"process {f.pid} {EXITED}"


@render.register
def _(f: ev.NothingLeft) -> str:
    return "nothing left to watch"


@render.register
def _(f: ev.Culprit) -> str:
    by = f", as the daemon (pid {f.daemon_pid}) named it" if f.daemon_pid is not None else ""
    return f"held up by process {f.pid} ({f.comm}){labels_text(f.labels)}{by}: {culprit_why(f)}"


@render.register
def _(f: ev.ThreadWait) -> str:
    return wait_words(f)


@render.register
def _(f: ev.NoPythonStack) -> str:
    # In the order of their words, as the waits were once keyed by them.
    what = ", ".join(f"{n} {w}" for w, n in sorted((wait_words(w), n) for w, n in f.waits))
    return f"{plural(f.threads, 'thread')} with no Python frames ({what})"


@render.register
def _(f: ev.StacksUnread) -> str:
    return f"Python stacks of process {f.pid} not read: {f.why}"


@render.register
def _(f: ev.LockAt) -> str:
    return f"thread {f.tid} at {_lock_site(f)}"


@render.register
def _(f: ev.MoreStackGroups) -> str:
    return f"and {plural(f.groups, 'other stack')} ({plural(f.threads, 'thread')})"


def wait_words(w: ev.ThreadWait) -> str:
    """ "in futex WAIT_BITSET with no timeout", "in epoll_wait", "running", "gone": what a
    thread waits in, as a group of threads is told by it."""
    if w.status != "syscall":
        return w.status
    how = "" if w.timed is None else " with a timeout" if w.timed else " with no timeout"
    op = f" {w.op}" if w.op else ""
    return f"in {w.syscall}{op}{how}"


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


@render.register
def stack_group(f: ev.StackGroup) -> str:
    """ "14 threads at `Queue.get` (scheduler.py:212) in `event_loop`, in futex WAIT_BITSET
    with no timeout": the line of the program's own code, and what it called there."""
    what = f"`{f.callee}`" if f.callee else _at(f.code, f"`{f.function}`")
    on = f" on {fds_words(f.on)}" if f.on is not None else ""
    native = f" (native: {f.native})" if f.native else ""
    gil = f", thread {f.gil} holds the GIL" if f.gil is not None else ""
    return (
        f"{plural(f.threads, 'thread')} at {what} ({f.file}:{f.line}) in `{f.function}`, "
        f"{wait_words(f.wait)}{on}{native}{gil}: {who(list(zip(f.tids, f.names)))}"
    )


@render.register
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
        since = ", all since " + clock(f.since_wall)
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


@render.register
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


@render.register
def _(f: ev.DaemonSaw) -> str:
    seen = []
    if f.streams:
        seen.append(
            f"{plural(f.streams, 'streamed answer')} begun before diagnose attached and not "
            f"finished, the last data sent {seconds(f.stream_age_s)} ago"
        )
    if f.unanswered:
        seen.append(
            f"{plural(f.unanswered, 'request')} unanswered for {seconds(f.unanswered_age_s)}"
        )
    state = f"has called it {f.state} for {seconds(f.in_state_s)}"
    if f.last_progress_s > 0:
        state += f", its last progress {seconds(f.last_progress_s)} ago"
    who = f"the daemon (pid {f.daemon_pid})"
    if not seen:
        return f"{who} {state}"
    return f"{who} saw {'; '.join(seen)}: {state}"


def reasons(facts: Iterable[ev.Fact]) -> list[str]:
    return [render(f) for f in facts]


# --- typed fields of records, in words ------------------------------------------------------


def clock(wall: float, fmt: str = "%H:%M:%S") -> str:
    """A wall-clock time (time.time()) as the local clock shows it: '05:13:06'."""
    return time.strftime(fmt, time.localtime(wall))


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
