"""When a quiet service last made progress, from evidence that carries its own age.

A hang is often older than the observation: ``diagnose`` watches for 5 s a service that
stopped minutes ago. What the service did in the window cannot say for how long it has done
nothing; what the kernel kept can. For a service that did nothing in the window, the most
recent of these dates its last progress:

* a file, terminal or pipe it holds open for writing, out of the service (its log): the
  mtime, which every write moves; except where a process of the service was seen writing
  heartbeats to it (agent.analysis.progress): then the mtime dates the last status line, not the
  last work (vLLM's EngineCore logs its warning to the stdout it shares with the API server);
* a TCP connection to a peer outside the service: when data was last sent on it, and, on
  connections that are not requests at a front door, when data was last received
  (tcp_info: weights streamed in, a peer rank's data);
* a process's main thread in a futex wait without a timeout that has not run since before
  the window: when it last ran (se.exec_start); it stopped then to wait for another thread
  of its process. Other threads say nothing of when work was last done, so they are left
  out: one that waits with a timeout ticks (gloo's loop, a monitor's sleep, with periods
  longer than the window), one that waits on a file descriptor is woken by the service's
  own chatter (torch's store answering its own client, zmq's I/O threads), and a runtime's
  pool threads wake on periods of their own: a Ray worker's gRPC event-engine thread last
  ran 10 s before, in a window of 10 s, while the actor's main thread had waited 41 s on
  the Event that hung it.

What it cannot see: CPU work before the window by a thread that now wakes on a timer. A
service that computed silently until just before the observation and then parked is dated
from its last output instead (docs/how-it-works.md, "What hangwatch cannot see").
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
