"""The listen history: which listens leave their port to /proc, and what it keeps."""

from __future__ import annotations

import socket

from agent.model import SocketEvent
from agent.observe.listens import ListenHistory


def bind(pid: int, fd: int, port: int, at: int = 1) -> SocketEvent:
    return SocketEvent("bind", at, pid, pid, fd, socket.AF_INET, port, 0)


def listen(pid: int, fd: int, at: int = 2) -> SocketEvent:
    return SocketEvent("listen", at, pid, pid, fd, 0, 0, 128)


def test_only_a_listen_whose_port_the_probe_did_not_see_is_left_to_proc() -> None:
    h = ListenHistory()
    events = [bind(10, 3, 8000), listen(10, 3), bind(11, 4, 0), listen(11, 4), listen(12, 5)]
    assert h.unresolved(events) == [(11, 4), (12, 5)]  # kernel-chosen, and bound unseen
    h.update(events, {(11, 4): 41234, (12, 5): None})
    assert h.since == {(10, 8000): 2, (11, 41234): 2}
    assert h.chosen_by_kernel([11]) == frozenset({41234}) and h.chosen_by_kernel([10]) == set()


def test_a_bind_seen_in_an_earlier_batch_resolves_a_later_listen() -> None:
    h = ListenHistory()
    h.update([bind(10, 3, 9000)], {})
    assert h.unresolved([listen(10, 3, at=5)]) == []
    h.update([listen(10, 3, at=5)], {})
    assert h.since == {(10, 9000): 5}
    h.prune([])
    assert h.pids() == set()
