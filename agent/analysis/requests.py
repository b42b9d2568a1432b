"""Requests at a service's front doors, from tcp_info and the queues: which wait for an
answer, which the client has not finished sending, and how old the oldest is. The ladder
(agent.analysis.classify) and the observer ask the same questions of the same connections."""

from __future__ import annotations

from collections.abc import Iterable

from ..model import Connection, Listener, ProcessSample, derived


def door_listeners(sample: ProcessSample, ports: frozenset[int] | None) -> list[Listener]:
    """The process's listeners that clients outside the service connect to (``ports``: the
    service's front-door ports; None: every listener counts, as when nothing is known)."""
    return [lst for lst in sample.listeners if ports is None or lst.port in ports]


def waiting_for_answer(c: Connection) -> bool:
    """The connection holds a request the service has not answered: it received data more
    recently than it sent any (tcp_info, both times known, some data received). An idle
    keep-alive connection sent last (its answer), so it does not wait. A fresh connection
    whose first request is unanswered has sent nothing since the handshake, which set both
    times at once: equal times (jiffy granular) with nothing of its own acknowledged are the
    same case, checked on this kernel with a request sent right after connect()."""
    recv, sent = c.last_recv_ms, c.last_sent_ms
    if recv is None or sent is None or not c.bytes_received:
        return False
    return recv < sent or (recv == sent and c.bytes_acked == 0)


def client_turn(c: Connection, reading: frozenset[int]) -> bool:
    """The connection holds a request the server has not been sent in full: it looks
    unanswered (waiting_for_answer), the server has read every byte of it (nothing in its
    receive queue) and a thread of the server is blocked reading more of it (``reading``:
    ProcessSample.reading). The server cannot answer what it has not received: the client
    owes the rest, so the wait is the client's. What this cannot see (event loops, a reader
    that hands requests off) is in docs/how-it-works.md."""
    return c.inode in reading and c.rx_queue == 0 and waiting_for_answer(c)


def incomplete_requests(
    sample: ProcessSample, ports: frozenset[int] | None, streams: frozenset[int] = frozenset()
) -> list[Connection]:
    """The process's accepted connections on a front door (``ports`` and ``streams`` as for
    unanswered_requests) whose request the client has not finished sending (client_turn),
    oldest first. An answer being streamed on one says its request was whole: not one."""
    if not sample.reading:
        return []
    if ports is None:
        ports = frozenset(lst.port for lst in sample.listeners)
    reading = sample.reading
    return sorted(
        (
            c
            for c in sample.connections
            if c.local_port in ports and c.inode not in streams and client_turn(c, reading)
        ),
        key=lambda c: -(c.last_recv_ms or 0),
    )


def unread_requests(sample: ProcessSample, ports: frozenset[int] | None) -> int:
    """Bytes received and not yet read on the process's accepted connections on a front door
    (``ports`` as for unanswered_requests): requests not read. Its other connections' unread
    bytes are chatter caught in flight: a Ray cluster's ~95 loopback gRPC messages a second
    left 218 bytes queued on some connection of an idle Serve app now and then."""
    if ports is None:
        ports = frozenset(lst.port for lst in sample.listeners)
    return derived(
        sample.connections,
        ("unread", ports),
        lambda cs: sum(c.rx_queue for c in cs if c.local_port in ports),
    )


def unanswered_requests(
    sample: ProcessSample, ports: frozenset[int] | None, streams: frozenset[int] = frozenset()
) -> list[Connection]:
    """The process's accepted connections on a front door (``ports``: the service's front-door
    ports; None: its own listening ports) that wait for an answer, oldest first: not answered
    at all, or (``streams``: their inodes) a streamed answer still being sent. A request the
    server is still reading from its client (client_turn) is not one: it waits on the client."""
    if ports is None:
        ports = frozenset(lst.port for lst in sample.listeners)
    reading = sample.reading
    return list(
        derived(
            sample.connections,
            ("unanswered", ports, streams, reading),
            lambda cs: tuple(
                sorted(
                    (
                        c
                        for c in cs
                        if c.local_port in ports
                        and (
                            c.inode in streams
                            or (waiting_for_answer(c) and not client_turn(c, reading))
                        )
                    ),
                    key=lambda c: -(c.last_recv_ms or 0),
                )
            ),
        )
    )


def oldest_request_s(unanswered: Iterable[Connection]) -> float:
    """How long the oldest of these unanswered requests has waited (0 for none)."""
    return max((c.last_recv_ms or 0 for c in unanswered), default=0) / 1000
