"""`diagnose`'s report in words: each service, its reasons, and each of its processes by its
Python stacks (line by line of its code), its futex words and what its other threads wait in.

Everything it shows was read before (agent.observe.enrich, asked by ``wanted``): rendering
reads nothing."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from ..analysis.evidence import NoPythonStack, ParkedGroup
from ..analysis.lockwords import words_wanted
from ..analysis.stacks import in_futex, native_asks, stack_facts, wait_of
from ..analysis.verdict import ProcessVerdict, ServiceVerdict
from ..analysis.waitgraph import WordGroup
from ..analysis.waits import parked_group
from ..model import ProcessSample, StackRead, ThreadSample, Wanted, plural
from .diagnosis import NO_HISTORY, Report, probe_summary, since
from .fds import fds_words
from .sentences import EXITED, clock, labels_text, reasons, render, wait_words, who


@dataclass(frozen=True)
class Layout:
    """How one process is shown: the futex word groups it is shown by (with their TIDs of
    it), and the threads neither its stacks nor those groups show."""

    groups: tuple[tuple[WordGroup, tuple[int, ...]], ...]
    others: tuple[ThreadSample, ...]


def layout(sample: ProcessSample, read: StackRead | None, groups: Sequence[WordGroup]) -> Layout:
    """A Python process is shown by its stacks; its futex words only where they name an
    owner, and its threads without Python frames (native helpers, I/O threads) by what they
    wait in. Any other process by all its words, and its other threads by what they wait in."""
    python = set(read.threads) if read is not None and read.error is None else set()
    own = {x.tid for x in sample.threads}
    shown_groups = []
    shown = set(python)
    for g in groups:
        if sample.pid not in g.pids or (python and not g.owner):
            continue
        tids = tuple(t for t in g.tids if t in own)
        shown.update(tids)
        shown_groups.append((g, tids))
    others = tuple(t for t in sample.threads if t.tid not in shown)
    return Layout(tuple(shown_groups), others)


def wanted(r: Report, stacks: Mapping[int, StackRead]) -> Wanted:
    """What the text shows beyond the snapshot, given the stacks: the native callers of the
    threads its lines tell them of, the names of the futex words it shows, and the fds of
    every thread blocked on fds."""
    snap, groups = r.snapshot, r.graph.groups()
    natives: list[tuple[int, int]] = []
    words = words_wanted(r.verdicts, snap)
    for p in _live(r):
        sample, read = snap.processes[p.pid], stacks.get(p.pid)
        if read is not None:
            natives.extend(native_asks(sample, read))
        shown = layout(sample, read, groups)
        words.update((p.pid, g.uaddr) for g, _ in shown.groups)
        natives.extend((p.pid, t.tid) for t in shown.others if in_futex(t))
    return Wanted(natives=natives, words=words, fds=list(snap.processes))


def _live(r: Report) -> list[ProcessVerdict]:
    return [p for v in r.verdicts for p in v.processes if not p.gone]


def render_text(r: Report) -> str:
    """The report in words: a process that has Python stacks is shown by them, line by line
    of its code, rather than by futex words and syscalls."""
    snap = r.snapshot
    observed = f"{r.duration_s:g} s"
    if r.observed_s is not None and r.observed_s > r.duration_s + 1:
        observed = f"{r.observed_s:.0f} s (watched on to the threshold)"
    lines = [
        f"hangwatch diagnose: {plural(len(r.verdicts), 'service')}, threshold "
        f"{r.threshold_s:g} s, observed {observed}, at "
        f"{clock(snap.wall)}",
        "",
    ]
    groups = r.graph.groups()
    names = {t.tid: t.name for p in snap.processes.values() for t in p.threads}
    for v in r.verdicts:
        lines.extend(_service(r, v, groups, names))
        lines.append("")
    lines.extend(gpu_lines(r))
    lines.extend(_probe_lines(r))
    return "\n".join(lines) + "\n"


def _service(
    r: Report, v: ServiceVerdict, groups: Sequence[WordGroup], names: Mapping[int, str]
) -> list[str]:
    root = r.snapshot.processes.get(v.pid)
    lines = [f"service {v.pid} ({root.comm if root else 'gone'}): {v.state.upper()}"]
    # Futex words with no owner say less than the stacks below, which show every one of
    # those threads at its line: in the text they give way (--json keeps them).
    stacks = r.inputs.stacks
    reads = [stacks.get(p.pid) for p in v.processes if not p.gone]
    shown_by_stacks = bool(reads) and all(x is not None and x.error is None for x in reads)
    facts = [
        f for f in v.reasons if not (shown_by_stacks and isinstance(f, ParkedGroup) and not f.owner)
    ]
    lines.extend(f"  - {x}" for x in reasons(facts))
    h = r.history.get(v.pid)
    if h is not None and h.daemon_pid is None:
        lines.append(f"  ({NO_HISTORY}; {h.why})" if h.why else f"  ({NO_HISTORY})")
    for p in sorted(v.processes, key=lambda x: x.pid):
        if p.gone:
            lines.append(f"  process {p.pid}: {EXITED}")
        else:
            lines.extend(_process(r, v, p, groups, names))
    return lines


def _process(
    r: Report,
    v: ServiceVerdict,
    p: ProcessVerdict,
    groups: Sequence[WordGroup],
    names: Mapping[int, str],
) -> list[str]:
    snap, inputs = r.snapshot, r.inputs
    sample = snap.processes[p.pid]
    park = f", all parked for {p.parked_seconds:.1f} s" if p.parked_seconds else ""
    ports = f", listening on {', '.join(map(str, p.listening_ports))}" if p.listening_ports else ""
    labels = labels_text(sorted(r.labels.get(p.pid, {}).items()))
    lines = [
        f"  process {p.pid} {p.comm}{labels}: {p.state}, {plural(p.threads, 'thread')}, "
        f"{p.parked_threads} parked{park}{ports}"
    ]
    if p.state != v.state:  # otherwise the service's reasons already say it
        lines.extend(f"      {x}" for x in reasons(p.reasons))
    read = inputs.stacks.get(p.pid)
    if read is not None:
        lines.extend(_stack_lines(r, sample, read))
    shown = layout(sample, read, groups)
    for g, tids in shown.groups:
        at = since(snap, g.since_ns)
        group = replace(parked_group(g, snap.mono_ns), word=inputs.words.get((p.pid, g.uaddr)))
        lines.append(
            f"    {render(group)}"
            + (f", since {at}" if at else "")
            + f": {who([(t, names.get(t, '?')) for t in tids])}"
        )
    lines.extend(_other_lines(r, sample, shown.others, names))
    return lines


def _stack_lines(r: Report, sample: ProcessSample, read: StackRead) -> list[str]:
    snap, inputs = r.snapshot, r.inputs
    facts = stack_facts(
        sample, read, snap.wall, snap.mono_ns, natives=inputs.natives, fds=inputs.fds
    )
    lines = []
    if read.error is None:
        lines.append(f"    Python stacks (read in {read.seconds:.2f} s without stopping it):")
        facts = [f for f in facts if not isinstance(f, NoPythonStack)]
    lines.extend(f"    - {x}" for x in reasons(facts))
    return lines


def _other_lines(
    r: Report, sample: ProcessSample, others: Sequence[ThreadSample], names: Mapping[int, str]
) -> list[str]:
    """The threads nothing else showed, by what they wait in: its syscall, the native code
    that called into a futex wait, the fds of an I/O wait."""
    by_what: dict[str, list[int]] = {}
    for t in others:
        w = wait_of(t)
        what = wait_words(w)
        if w.status == "syscall":
            caller = r.inputs.natives.get((sample.pid, t.tid)) if in_futex(t) else None
            if caller:
                what += f", called from {caller}"
            fds = r.inputs.fds.get((sample.pid, t.tid))
            if fds is not None:
                what += f" on {fds_words(fds)}"
        by_what.setdefault(what, []).append(t.tid)
    return [
        f"    {plural(len(tids), 'thread')} {what}: {who([(t, names.get(t, '?')) for t in tids])}"
        for what, tids in sorted(by_what.items())
    ]


def gpu_lines(r: Report) -> list[str]:
    g = r.gpu
    if g is None:
        return []
    if not g.ok:
        return [f"GPU: not read ({g.error})"]
    lines = [
        f"GPU {d.index} {d.name}: {d.memory_used / 1e9:.1f} of {d.memory_total / 1e9:.0f} GB used"
        + (f", {d.utilization:.0%} busy" if d.utilization is not None else "")
        for d in g.devices
    ]
    for pid, uses in sorted(g.processes.items()):
        p = r.snapshot.processes.get(pid)
        if p is None:
            continue
        for u in uses:
            held = f"{u.memory_bytes / 1e9:.1f} GB" if u.memory_bytes is not None else "? GB"
            lines.append(
                f"  pid {pid} ({p.comm}) on GPU {u.gpu}: {held}, {u.sm_utilization:.0%} SM"
            )
    return lines or ["GPU: NVML answered; no GPU on this host"]


def _probe_lines(r: Report) -> list[str]:
    probe = probe_summary(r)
    c = probe["counters"]
    lost = sum(
        c.get(k, 0) for k in ("inflight_full", "hist_full", "refusals_full", "events_dropped")
    )
    lines = [
        f"probe: {c.get('waits_started', 0)} futex waits began while attached, {lost} lost to "
        f"full maps or ring buffer, {probe['long_waits']} long waits ended"
    ]
    lines.extend(
        f"probe: the kernel refused PI lock {x['uaddr']} to thread {x['tid']} (EDEADLK)"
        for x in probe["edeadlk"]
    )
    return lines
