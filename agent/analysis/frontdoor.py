"""Which listeners of a service are front doors: pure, from the sampled processes alone.

A listener is a front door when clients from outside the service connect to it; a
distributed job's plumbing is not. Per listening port, the first rule that applies decides:
(1) the target's config; (2) a port a process names as plumbing (``MASTER_PORT``, torchrun's
``--master-port`` and ``--rdzv-endpoint``); (3) an ephemeral port held by a rank or its
launcher; (4) its accepted connections: every peer a socket of the service, or one outside;
(5) with no connection, whether clients can know the address (named on the root's command
line, or below the ephemeral range). Why each, and real jobs under them: docs/how-it-works.md,
"Front doors and work waiting".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..model import DEFAULT_EPHEMERAL_FROM, Connection, FrontDoorConfig, ProcessSample
from . import evidence as ev


@dataclass(frozen=True)
class Door:
    """One listening port of the service, and whether it is a front door."""

    port: int
    pids: tuple[int, ...]  # the processes that hold a listener on it
    front: bool
    why: ev.DoorWhy
    connections: int = 0  # accepted connections (established sockets on this local port)


@dataclass(frozen=True)
class FrontDoors:
    doors: tuple[Door, ...] = ()  # by port

    @property
    def ports(self) -> frozenset[int]:
        """The ports of the front doors (empty: the service has none listening)."""
        return frozenset(d.port for d in self.doors if d.front)

    def evidence(self) -> ev.Doors:
        """Its front doors and its plumbing, each port with why (agent.report.sentences says it)."""
        return ev.Doors(
            tuple((d.port, d.why) for d in self.doors if d.front),
            tuple((d.port, d.why) for d in self.doors if not d.front),
        )


def _local(c: Connection) -> tuple[str, int]:
    return c.local


def _remote(c: Connection) -> tuple[str, int]:
    return c.remote


def _holder(p: ProcessSample) -> ev.Holder:
    return ev.Holder(p.pid, p.comm, p.plumbing.launcher, p.plumbing.master_port is not None)


def _unconnected(
    port: int,
    pids: tuple[int, ...],
    named: frozenset[int],
    kernel_chosen: frozenset[int],
    ephemeral_from: int,
) -> Door:
    """A listener nobody is connected to: rule 5."""
    if port in kernel_chosen:
        return Door(port, pids, False, ev.DoorWhy(ev.DoorRule.KERNEL_CHOSEN))
    if port in named:
        return Door(port, pids, True, ev.DoorWhy(ev.DoorRule.NAMED))
    if port < ephemeral_from:
        return Door(port, pids, True, ev.DoorWhy(ev.DoorRule.BY_NUMBER))
    why = ev.DoorWhy(ev.DoorRule.UNNAMED_EPHEMERAL, ephemeral_from=ephemeral_from)
    return Door(port, pids, False, why)


def _plumbing_reasons(processes: Sequence[ProcessSample]) -> dict[int, ev.DoorWhy]:
    """Port -> what names it as plumbing: the first process (by PID) whose hints do."""
    out: dict[int, ev.DoorWhy] = {}
    for p in sorted(processes, key=lambda p: p.pid):
        for port in sorted(p.plumbing.ports):
            flag = p.plumbing.why(port)
            if port not in out and flag is not None:
                out[port] = ev.DoorWhy(ev.DoorRule.PLUMBING, holder=_holder(p), flag=flag)
    return out


def _declared(port: int, pids: tuple[int, ...], declared: FrontDoorConfig, n: int) -> Door:
    """Rule 1: the config decides."""
    if port in declared.ports:
        return Door(port, pids, True, ev.DoorWhy(ev.DoorRule.DECLARED), n)
    if declared.ports:
        return Door(port, pids, False, ev.DoorWhy(ev.DoorRule.NOT_DECLARED), n)
    return Door(port, pids, False, ev.DoorWhy(ev.DoorRule.NONE_DECLARED), n)


def front_doors(
    processes: Sequence[ProcessSample],
    declared: FrontDoorConfig | None = None,
    ephemeral_from: int = DEFAULT_EPHEMERAL_FROM,
    kernel_chosen: frozenset[int] = frozenset(),
) -> FrontDoors:
    """Each listening port of the service (``processes``: all of its processes, its root
    first), decided by the rules of the module docstring. ``ephemeral_from``: the snapshot's
    start of ip_local_port_range; ``kernel_chosen``: its ports the probe saw bound to port 0."""
    named = frozenset(processes[0].plumbing.named_ports) if processes else frozenset()
    holders: dict[int, dict[int, ProcessSample]] = {}  # port -> pid -> process
    for p in processes:
        for lst in p.listeners:
            holders.setdefault(lst.port, {})[p.pid] = p
    # Every connection of the service, by port, and the endpoints it holds.
    accepted: dict[int, list[Connection]] = {}
    owner: dict[tuple[tuple[str, int], tuple[str, int]], int] = {}  # (local, remote) -> pid
    for p in processes:
        for c in p.connections:
            owner[(_local(c), _remote(c))] = p.pid
            if c.local_port in holders:
                accepted.setdefault(c.local_port, []).append(c)
    plumbing = _plumbing_reasons(processes)
    doors = []
    for port in sorted(holders):
        hs = [holders[port][pid] for pid in sorted(holders[port])]
        pids = tuple(p.pid for p in hs)
        conns = accepted.get(port, [])
        n = len(conns)
        if declared is not None:
            doors.append(_declared(port, pids, declared, n))
            continue
        if port in plumbing:
            doors.append(Door(port, pids, False, plumbing[port], n))
            continue
        dist = [p for p in hs if p.plumbing.distributed]
        if port >= ephemeral_from and dist:
            why = ev.DoorWhy(ev.DoorRule.JOB_EPHEMERAL, holder=_holder(dist[0]))
            doors.append(Door(port, pids, False, why, n))
            continue
        if not conns:
            doors.append(_unconnected(port, pids, named, kernel_chosen, ephemeral_from))
            continue
        peers = [owner.get((_remote(c), _local(c))) for c in conns]
        outside = [c for c, peer in zip(conns, peers) if peer is None]
        if outside:
            why = ev.DoorWhy(ev.DoorRule.CLIENTS, peer=_remote(outside[0]), more=len(outside) - 1)
            doors.append(Door(port, pids, True, why, n))
        else:
            inside = tuple(sorted({p for p in peers if p}))
            doors.append(
                Door(port, pids, False, ev.DoorWhy(ev.DoorRule.PEERS_INSIDE, pids=inside), n)
            )
    return FrontDoors(tuple(doors))
