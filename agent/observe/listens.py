"""When each port of a watched process started listening, from the probe's bind and listen
events: the evidence that says since when an idle server has waited for its first client."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence

from ..model import SocketEvent


class ListenHistory:
    """When each port started listening, from the probe's bind and listen events.

    Events arrive for every process, watched or not (a server may listen before discovery
    reaches it). Kept per (pid, port); pruned when the pid is gone.
    """

    def __init__(self) -> None:
        # (pid, fd) -> port asked for at bind; 0 for a bind to port 0 (the kernel chooses)
        self._bound: dict[tuple[int, int], int] = {}
        self.since: dict[tuple[int, int], int] = {}  # (pid, port) -> CLOCK_MONOTONIC of listen
        self.kernel_chosen: set[tuple[int, int]] = set()  # (pid, port) bound to port 0

    def unresolved(self, events: Sequence[SocketEvent]) -> list[tuple[int, int]]:
        """The (pid, fd) sockets whose port a listen among ``events`` leaves to /proc: bound
        to port 0 (the kernel chose) or bound before the probe saw it."""
        bound = dict(self._bound)
        out = []
        for e in events:
            if e.kind == "bind" and (e.port or e.family):
                bound[(e.tgid, e.fd)] = e.port
            elif e.kind == "listen" and not bound.get((e.tgid, e.fd)):
                out.append((e.tgid, e.fd))
        return out

    def update(
        self, events: Iterable[SocketEvent], ports_now: Mapping[tuple[int, int], int | None]
    ) -> None:
        """Take the probe's events; ``ports_now``: the port of each socket ``unresolved``
        named, read from /proc after the listen."""
        for e in events:
            if e.kind == "bind" and (e.port or e.family):
                self._bound[(e.tgid, e.fd)] = e.port
            elif e.kind == "listen":
                # A bind to port 0 lets the kernel choose: then /proc says which port it chose.
                asked = self._bound.get((e.tgid, e.fd))
                port = asked or ports_now.get((e.tgid, e.fd))
                if port:
                    self.since[(e.tgid, port)] = e.ts_ns
                    if asked == 0:
                        self.kernel_chosen.add((e.tgid, port))

    def pids(self) -> set[int]:
        """The processes it holds entries of (few: binders and listeners)."""
        return {k[0] for k in self._bound} | {k[0] for k in self.since}

    def prune(self, live: Collection[int]) -> None:
        """Drop entries of processes that are gone (``live``: those of pids() that are not)."""
        self._bound = {k: v for k, v in self._bound.items() if k[0] in live}
        self.since = {k: v for k, v in self.since.items() if k[0] in live}
        self.kernel_chosen = {k for k in self.kernel_chosen if k[0] in live}

    def chosen_by_kernel(self, pids: Iterable[int]) -> frozenset[int]:
        """The ports of ``pids`` that the probe saw bound to port 0."""
        mine = set(pids)
        return frozenset(port for pid, port in self.kernel_chosen if pid in mine)
