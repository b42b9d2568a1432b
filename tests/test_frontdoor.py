"""Front doors from synthetic snapshots: each rule, and the real jobs as /proc showed them."""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st

from agent.analysis import evidence as ev
from agent.analysis.frontdoor import Door, FrontDoors, front_doors
from agent.model import (
    Connection,
    FrontDoorConfig,
    Listener,
    Plumbing,
    ProbeReading,
    ProcessSample,
    Snapshot,
    ThreadSample,
)
from agent.observe.observer import Observer, Scope
from agent.observe.sampler import Sampler
from agent.report.sentences import door_why, render
from agent.sources.procfs import ProcFS

RANK = Plumbing(master_port=29500)
NONE = Plumbing()


def proc(
    pid: int,
    listen: Iterable[int | tuple[str, int]] = (),
    conns: Iterable[tuple[str, int, str, int]] = (),
    plumbing: Plumbing = NONE,
    comm: str = "python3",
) -> ProcessSample:
    """``listen``: ports (on 0.0.0.0) or (address, port); ``conns``: (local address, local
    port, remote address, remote port) of its established connections."""
    listeners = tuple(
        Listener("tcp", *(x if isinstance(x, tuple) else ("0.0.0.0", x)), 0, 128) for x in listen
    )
    connections = tuple(
        Connection(la, lp, ra, rp, inode=1000 + i, rx_queue=0, tx_queue=0)
        for i, (la, lp, ra, rp) in enumerate(conns)
    )
    return ProcessSample(
        pid,
        1,
        comm,
        4242,
        (ThreadSample(pid, comm, "S", 0),),
        listeners=listeners,
        connections=connections,
        plumbing=plumbing,
    )


def door(fd: FrontDoors, port: int) -> Door:
    """The door of a listening port: every listening port has exactly one."""
    (d,) = [d for d in fd.doors if d.port == port]
    return d


def why(fd: FrontDoors, port: int) -> str:
    """Why the port is a front door or not, in the words of the report."""
    return door_why(door(fd, port).why)


def declared(fd: FrontDoors) -> bool:
    """The config decided every door."""
    config = {ev.DoorRule.DECLARED, ev.DoorRule.NOT_DECLARED, ev.DoorRule.NONE_DECLARED}
    return bool(fd.doors) and all(d.why.rule in config for d in fd.doors)


def pair(a: tuple[str, int], b: tuple[str, int]) -> tuple[tuple, tuple]:
    """Both ends of one loopback connection from ``a`` to the listener at ``b``: the
    client's socket and the accepted one."""
    return (*a, *b), (*b, *a)


def test_no_listener_no_door():
    fd = front_doors([proc(1)])
    assert fd.doors == () and fd.ports == frozenset() and render(fd.evidence()) == "no listener"


def test_an_idle_server_is_a_front_door_until_shown_otherwise():
    fd = front_doors([proc(1, [8000])])
    (d,) = fd.doors
    assert (d.port, d.pids, d.front, d.connections) == (8000, (1,), True, 0)
    assert (
        door_why(d.why)
        == "asked for by number, no connection yet: a front door until shown otherwise"
    )
    assert fd.ports == {8000}
    assert render(fd.evidence()).startswith("front door 8000 (asked for by number")


def test_an_unconnected_port_the_kernel_or_a_runtime_chose_is_no_front_door():
    """vLLM's Worker: a gloo listener per process group on a kernel-chosen port; Ray: ports
    it picked for its children and handed them on their command lines."""
    ray_child = Plumbing(named_ports=(41234,))
    fd = front_doors([proc(1), proc(2, [41234], plumbing=ray_child)])
    (d,) = fd.doors
    assert not d.front and "ephemeral range (from 32768)" in door_why(d.why), d
    # The root naming it (the engine's --port 41234) makes it an address clients know
    root = Plumbing(named_ports=(41234,))
    fd = front_doors([proc(1, [41234], plumbing=root)])
    assert fd.ports == {41234} and "named on the command line" in door_why(fd.doors[0].why)
    # Seen bound to port 0 by the probe: never, even below the ephemeral range
    fd = front_doors([proc(1, [8000])], kernel_chosen=frozenset({8000}))
    assert fd.ports == frozenset() and "the kernel chose it" in door_why(fd.doors[0].why)
    # An outside client on an ephemeral port: a front door, whoever chose it
    fd = front_doors([proc(1, [41234], [("127.0.0.1", 41234, "10.0.0.9", 50000)])])
    assert fd.ports == {41234}


def test_a_client_from_outside_makes_a_front_door():
    # The client's socket (127.0.0.1:51000) is no process of the service.
    fd = front_doors([proc(1, [8000], [("127.0.0.1", 8000, "127.0.0.1", 51000)])])
    d = door(fd, 8000)
    assert d is not None and d.front and d.connections == 1
    assert door_why(d.why) == "clients from outside connect to it: from 127.0.0.1:51000"


def test_one_outside_peer_among_inside_ones_is_enough():
    client, accepted = pair(("127.0.0.1", 40000), ("127.0.0.1", 8000))
    outside = ("10.0.0.9", 8000, "10.0.0.7", 52000)
    fd = front_doors(
        [
            proc(1, [8000], [accepted, outside, ("10.0.0.9", 8000, "10.0.0.8", 1)]),
            proc(2, [], [client]),
        ]
    )
    d = door(fd, 8000)
    assert d is not None and d.front and d.connections == 3
    assert door_why(d.why) == "clients from outside connect to it: from 10.0.0.7:52000 and 1 more"


def test_a_listener_whose_peers_are_the_services_own_processes_is_plumbing():
    client, accepted = pair(("127.0.0.1", 40000), ("127.0.0.1", 5000))
    fd = front_doors([proc(1, [5000], [accepted]), proc(2, [], [client])])
    d = door(fd, 5000)
    assert d is not None and not d.front
    assert door_why(d.why) == "every peer is a process of the service (pid 2)"
    assert fd.ports == frozenset()
    # The process's own client counts too (torchrun's agent talks to its own store).
    fd = front_doors([proc(1, [5000], [accepted, client])])
    assert why(fd, 5000) == "every peer is a process of the service (pid 1)"


def test_peers_match_across_ipv4_and_ipv4_mapped_ipv6():
    # The listener is on ::, so its accepted socket shows in tcp6; the client used AF_INET.
    fd = front_doors(
        [
            proc(1, [("::", 5000)], [("::ffff:127.0.0.1", 5000, "::ffff:127.0.0.1", 40000)]),
            proc(2, [], [("127.0.0.1", 40000, "127.0.0.1", 5000)]),
        ]
    )
    assert not door(fd, 5000).front


def test_a_peer_is_matched_by_both_ends_not_by_a_coincidence():
    # A service socket has 127.0.0.1:40000 as its local end, but it talks to someone else:
    # the connection to 5000 comes from outside (another network namespace, say).
    fd = front_doors(
        [
            proc(1, [5000], [("127.0.0.1", 5000, "127.0.0.1", 40000)]),
            proc(2, [], [("127.0.0.1", 40000, "127.0.0.1", 6000)]),
        ]
    )
    assert door(fd, 5000).front


def test_master_port_is_plumbing_whoever_connects():
    # The store lives in the launcher; MASTER_PORT is in the ranks' environment. Ranks of
    # other nodes connect from outside this host's view of the service.
    agent = proc(10, [29500], [("10.0.0.1", 29500, "10.0.0.2", 41000)], comm="pt_elastic")
    fd = front_doors([agent, proc(12, plumbing=RANK), proc(11, plumbing=RANK)])
    d = door(fd, 29500)
    assert d is not None and not d.front
    assert door_why(d.why) == "MASTER_PORT of rank pid 11"


def test_torchrun_flags_are_plumbing():
    agent = Plumbing(
        launcher="torchrun", flag_ports=(("--master-port", 29611), ("--rdzv-endpoint", 29400))
    )
    fd = front_doors([proc(10, [29611, 29400], plumbing=agent, comm="pt_elastic")])
    assert why(fd, 29611) == "--master-port of torchrun pid 10"
    assert why(fd, 29400) == "rendezvous endpoint of torchrun pid 10"
    assert fd.ports == frozenset()


def test_a_ranks_ephemeral_listener_is_a_collective_librarys():
    gloo = ("127.0.0.1", 38653)
    fd = front_doors([proc(11, [gloo], plumbing=RANK)])
    d = door(fd, 38653)
    assert d is not None and not d.front
    assert door_why(d.why) == "ephemeral port of rank pid 11: a collective library's listener"
    # A peer rank on another node connects from outside: still gloo's.
    fd = front_doors([proc(11, [gloo], [("10.0.0.1", 38653, "10.0.0.2", 50000)], plumbing=RANK)])
    assert not door(fd, 38653).front
    # The same port held by a process of no distributed job that names it: a server given
    # --port 38653. Not named, it is a port the kernel or a runtime chose (rule 5).
    served = proc(11, [gloo], plumbing=Plumbing(named_ports=(38653,)))
    assert door(front_doors([served]), 38653).front
    assert not door(front_doors([proc(11, [gloo])]), 38653).front


def test_the_ephemeral_range_is_the_kernels():
    # Below the range's start, a rank's listener without connections is a front door
    # (a rank that serves HTTP on 8000, say); the range comes from the snapshot.
    assert door(front_doors([proc(11, [8000], plumbing=RANK)]), 8000).front
    assert door(front_doors([proc(11, [38653], plumbing=RANK)], None, 40000), 38653).front
    assert not door(front_doors([proc(11, [38653], plumbing=RANK)], None, 30000), 38653).front


def test_torchruns_auto_assigned_store_is_plumbing():
    agent = Plumbing(launcher="torchrun")  # --standalone: localhost:0
    d = door(front_doors([proc(10, [42723], plumbing=agent, comm="pt_elastic")]), 42723)
    assert d is not None and not d.front
    assert door_why(d.why) == "ephemeral port of torchrun pid 10: an auto-assigned store's listener"


def test_declared_ports_win():
    fd = front_doors(
        [proc(1, [8000, 8001, 29500], plumbing=RANK), proc(2, [38000])],
        FrontDoorConfig(frozenset({8000, 29500, 9999})),
    )
    assert declared(fd) and fd.ports == {8000, 29500}  # 9999: declared, not listening
    assert why(fd, 29500) == "declared in the config"
    assert why(fd, 8001) == "not among the config's front doors"
    assert not door(fd, 38000).front


def test_declared_none_means_none():
    fd = front_doors(
        [proc(1, [8000], [("127.0.0.1", 8000, "127.0.0.1", 51000)])], FrontDoorConfig()
    )
    assert declared(fd) and fd.ports == frozenset()
    assert why(fd, 8000) == "the config says it has no front door"
    assert render(fd.evidence()) == "not front doors: 8000 (the config says it has no front door)"


def test_one_port_held_by_several_processes_is_one_door():
    # uvicorn workers share the listener they inherited; a worker accepted the connection.
    fd = front_doors(
        [
            proc(1, [8000]),
            proc(2, [8000], [("127.0.0.1", 8000, "127.0.0.1", 51000)]),
            proc(3, [8000]),
        ]
    )
    (d,) = fd.doors
    assert d.pids == (1, 2, 3) and d.front and d.connections == 1


# --- the real jobs, as /proc showed them (torch 2.14.1; see the module docstring) ------------


def test_torchrun_job_as_seen_has_no_front_door():
    """``torchrun --nproc_per_node=2 --master_port=29611``, training_loop, two ranks."""
    L6 = "::ffff:127.0.0.1"
    agent = proc(
        2803,
        [("::", 29611)],
        [
            (L6, 47386, L6, 29611),  # the agent's own store client
            (L6, 29611, L6, 47400),
            (L6, 29611, L6, 47386),
            (L6, 29611, L6, 47414),
        ],
        Plumbing(launcher="torchrun", flag_ports=(("--master-port", 29611),)),
        comm="pt_elastic",
    )
    rank0 = proc(
        2848,
        [("127.0.0.1", 35293)],
        [("127.0.0.1", 35293, "127.0.0.1", 34138), (L6, 47414, L6, 29611)],
        Plumbing(master_port=29611),
    )
    rank1 = proc(
        2849,
        [("127.0.0.1", 38653)],
        [("127.0.0.1", 34138, "127.0.0.1", 35293), (L6, 47400, L6, 29611)],
        Plumbing(master_port=29611),
    )
    fd = front_doors([agent, rank0, rank1], None, 32768)
    assert [d.port for d in fd.doors] == [29611, 35293, 38653]
    assert fd.ports == frozenset(), render(fd.evidence())
    assert door(fd, 29611).connections == 3
    # Without the ephemeral rule, rank 0's gloo listener is still plumbing by its peers;
    # rank 1's, which nobody connected to, is why the rule exists.
    fd = front_doors([agent, rank0, rank1], None, 65536)
    assert why(fd, 35293) == "every peer is a process of the service (pid 2849)"
    assert fd.ports == {38653}


def test_serving_stack_as_seen_has_its_front_end_as_front_door():
    """server.py --shape serving --port 43359: uvicorn on a port in the ephemeral range that
    its command line names, children on ipc://."""
    children = [proc(pid) for pid in (10095, 10096, 10097)]
    named = Plumbing(named_ports=(43359,))
    idle = proc(10090, [("127.0.0.1", 43359)], comm="python", plumbing=named)
    assert front_doors([idle, *children]).ports == {43359}
    served = proc(10090, [("127.0.0.1", 43359)], [("127.0.0.1", 43359, "127.0.0.1", 35578)])
    fd = front_doors([served, *children])
    assert fd.ports == {43359}
    assert why(fd, 43359) == "clients from outside connect to it: from 127.0.0.1:35578"


# --- any input ------------------------------------------------------------------------------

_addr = st.sampled_from(["127.0.0.1", "::ffff:127.0.0.1", "10.0.0.1", "::", "0.0.0.0", "::1"])
_port = st.integers(1, 65535) | st.sampled_from([8000, 29500, 38653])
_conn = st.tuples(_addr, _port, _addr, _port)
_plumbing = st.builds(
    Plumbing,
    master_port=st.none() | _port,
    launcher=st.none() | st.just("torchrun"),
    flag_ports=st.lists(
        st.tuples(st.sampled_from(["--master-port", "--rdzv-endpoint"]), _port), max_size=2
    ).map(tuple),
)
_proc = st.builds(
    proc,
    pid=st.integers(1, 50),
    listen=st.lists(st.tuples(_addr, _port), max_size=3),
    conns=st.lists(_conn, max_size=4),
    plumbing=_plumbing,
)


@given(
    st.lists(_proc, max_size=4),
    st.none() | st.frozensets(_port, max_size=3).map(FrontDoorConfig),
    st.integers(1, 65536),
)
def test_every_listening_port_gets_one_door_with_a_reason(procs, declared, ephemeral_from):
    fd = front_doors(procs, declared, ephemeral_from)
    ports = sorted({lst.port for p in procs for lst in p.listeners})
    assert [d.port for d in fd.doors] == ports
    assert all(door_why(d.why) and d.pids for d in fd.doors)
    assert fd.ports <= set(ports)
    if declared is not None:
        assert fd.ports == declared.ports & set(ports)
    assert isinstance(render(fd.evidence()), str)


class _Scripted(Sampler):
    """The snapshots given, one per tick, of a service of processes 1 and 2."""

    def __init__(self, snaps: list[dict[int, ProcessSample]]) -> None:
        super().__init__(ProcFS("/nonexistent", tcp_info=None, sockets=lambda *_: None))
        self.snaps = snaps

    def snapshot(self, pids: Iterable[int], probe: ProbeReading | None = None) -> Snapshot:
        procs = self.snaps.pop(0)
        return Snapshot(10**9, 1e9, procs, ephemeral_from=40000)


def test_the_observer_keeps_a_services_doors_only_while_what_they_are_read_from_stands():
    """The observer reads a service's doors again only when a process, a listener, a
    connection or a hint changed (a socket's ends never change): the doors it gives are
    front_doors' own, tick after tick, over random changes of each of those."""
    rng = random.Random(21)
    listen = [8000, 41234]
    conns = [
        ("127.0.0.1", 8000, "10.0.0.9", 50000),
        ("127.0.0.1", 8000, "127.0.0.1", 51000),
        ("127.0.0.1", 51000, "127.0.0.1", 8000),
        ("127.0.0.1", 41234, "127.0.0.1", 52000),
    ]
    snaps = []
    for _ in range(200):
        a = proc(1, rng.sample(listen, rng.randint(0, 2)), rng.sample(conns, rng.randint(0, 3)))
        b = proc(2, [], rng.sample(conns, rng.randint(0, 2)), comm=rng.choice(["python3", "x"]))
        # Queues move while the rules' inputs stand: the doors must not be read again
        a = replace(a, listeners=tuple(replace(x, queued=rng.randint(0, 3)) for x in a.listeners))
        snaps += [{1: a, 2: b}] * rng.randint(1, 3)
    want = [front_doors([s[1], s[2]], None, 40000) for s in snaps]
    obs = Observer(_Scripted(list(snaps)), None)  # type: ignore[arg-type]
    for i, w in enumerate(want):
        assert obs.observe(Scope({1: [1, 2]})).doors[1] == w, i
