"""Which listeners of a service are front doors: pure, from the sampled processes alone.

A listener is a front door when clients from outside the service connect to it; a
distributed job's plumbing is not. A service is idle only when it has a front door with
nothing waiting at it (docs/how-it-works.md, "Front doors and work waiting"): plumbing taken
for a front door would call a stalled job idle. Per listening port of the service, in this
order:

1. The target's config decides when it declares: ``front_door_ports`` are exactly the front
   doors, ``front_door: false`` means none.
2. A port that a process of the service names as plumbing is not: its ``MASTER_PORT`` (the
   TCPStore of rank 0, or of the torchrun agent), torchrun's ``--master-port`` or
   ``--rdzv-endpoint`` (the agent hosts the store there).
3. A listener on an ephemeral port (at or above ip_local_port_range's start) held by a
   process of a distributed job (a rank: it has MASTER_PORT; or the torchrun agent) is a
   collective library's listener (gloo) or an auto-assigned store (``--standalone``), whatever
   connects to it: across nodes its peers are ranks on other hosts, outside this host's view
   of the service, so "from outside" cannot tell them from clients.
4. Otherwise its accepted connections (the service's established sockets on that local
   port) decide: every peer a socket of the service (the other end of the loopback pair is
   held by a process of the service) makes it plumbing; one peer from outside makes it a front
   door.
5. A listener with no connection is a front door until shown otherwise when it is an address
   clients can know: a port the service's root names on its command line (the engine's
   ``--port``), or one below the kernel's ephemeral range (8000, 30000: asked for by number).
   It is not when the probe saw it bound to port 0 (the kernel chose it), nor when it lies in
   the ephemeral range unnamed by the root: a port the kernel or a runtime chose. vLLM's
   Worker opens a gloo listener per process group on kernel-chosen ports even at world size
   1, with no torchrun variables around; Ray picks free ports for its raylet, workers,
   agents and metrics exporters and hands them to each child on its command line (so the
   root's command line is the one that counts, not the holder's). An idle server on a port
   it was given has no connection and stays a front door: an idle server has none.

What the real thing looks like (torch 2.14.1, gloo on CPU, 2 ranks; checked by hand with
tests/realsw/torch_jobs.py and the serving stack of tests/realsw/serving):

* ``torchrun --master_port=29611``: the agent (comm ``pt_elastic``, no MASTER_PORT of its
  own) listens on ``:::29611`` (rule 2, its flag); its own client and each rank connect to it
  over ``::ffff:127.0.0.1``. Each rank has MASTER_PORT=29611 and one gloo listener on
  ``127.0.0.1:<ephemeral>`` (35293, 38653); rank 1 connects to rank 0's, nothing to rank 1's
  (rule 3; rule 4 would also call rank 0's plumbing, but rank 1's has no connection).
* ``torchrun --standalone``: the agent listens on two ephemeral ports, the c10d rendezvous
  store (localhost:0, named nowhere; only the agent connects to it) and the ranks'
  MASTER_PORT (rule 2 through the ranks' environment); both also fall under rule 3.
* ``--rdzv-backend=c10d --rdzv-endpoint 127.0.0.1:29633``: the agent listens on 29633 (its
  flag) and on an ephemeral port that is the ranks' MASTER_PORT.
* ``torchrun --nnodes=2`` with node 1 missing: the agent listens on its --master_port, only
  its own client connected. A rank run directly with MASTER_PORT=29621 (rendezvous_peer_missing)
  listens on :::29621, only itself connected.
* The serving stack (uvicorn front-end, zmq over ipc:// to its spawned children): one listener,
  the front-end's port (ephemeral with ``--port 0``; no process of it has MASTER_PORT), its
  peers the client's sockets, outside the service: a front door; with no client, still one
  (rule 4). Its children hold no TCP socket.

Environment hints are what the process was exec'd with (/proc/PID/environ): a script that sets
``os.environ["MASTER_PORT"]`` itself shows it only in the children it starts; declare the
ports in the config when the rules guess wrong.
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
