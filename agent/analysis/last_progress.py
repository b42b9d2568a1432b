"""When a quiet service last made progress, from evidence that carries its own age.

A hang is often older than the observation, and what the service did in the window cannot say
for how long it has done nothing; what the kernel kept can. The most recent of these dates it:
the mtime of a file, terminal or pipe it writes out of the service (not one it was seen
writing heartbeats to: that dates a status line), when data last went each way on a TCP
connection outside the service (received only off a front door), and when a main thread in a
futex wait without a timeout last ran. Other threads wake on timers, the service's own chatter
or a runtime's periods, not work, so they date nothing (docs/how-it-works.md, "Time without
progress, dated by evidence with its own age").
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from ..model import ProcessSample, WrittenFd
from ..syscalls import FUTEX, wait_kind
from . import evidence as ev
from .outbound import CLIENT, LEAVES, ServiceEnds


def last_progress(
    samples: Sequence[ProcessSample],
    written: Mapping[int, Sequence[WrittenFd]],
    ends: ServiceEnds,
    front_ports: frozenset[int],
    now_ns: int,
    wall: float,
    window_start_ns: int,
    heartbeats: Collection[str] = (),
) -> ev.LastProgress | None:
    """The most recent dated progress of the service's processes, or None if nothing is
    dated. ``written``: pid -> the fds it holds open for writing (the sampler's
    written_files); ``now_ns``/``wall``: the snapshot's monotonic and wall clocks;
    ``heartbeats``: the fd links (/proc/PID/fd text) the service's processes were seen writing
    heartbeats to."""
    found: list[ev.LastProgress] = []
    for s in samples:
        for w in written.get(s.pid, ()):
            if w.target in heartbeats:
                continue
            if ends.destination(w.target) in LEAVES:
                found.append(ev.LastProgress("write", w.target, s.pid, max(0.0, wall - w.mtime)))
        for c in s.connections:
            if ends.socket_destination(c.inode) != CLIENT:
                continue
            peer = f"{c.remote_address}:{c.remote_port}"
            if c.last_sent_ms is not None and c.bytes_acked:
                found.append(ev.LastProgress("sent", peer, s.pid, c.last_sent_ms / 1000))
            if c.local_port not in front_ports and c.last_recv_ms is not None and c.bytes_received:
                found.append(ev.LastProgress("received", peer, s.pid, c.last_recv_ms / 1000))
        for t in s.threads:
            if (
                t.tid == s.pid
                and t.blocked
                and t.timed is False
                and wait_kind(t.syscall) == FUTEX
                and t.last_ran_ns is not None
                and t.last_ran_ns < window_start_ns
            ):
                age = (now_ns - t.last_ran_ns) / 1e9
                found.append(ev.LastProgress("ran", ev.Thread(t.tid, t.name), s.pid, age))
    return min(found, key=lambda x: x.age_s, default=None)
