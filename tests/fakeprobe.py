"""A probe that needs no kernel: it implements the whole ProbeSource protocol (mypy checks
this file against it), records what it is asked, and reads back what a test sets."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping

from agent.model import ProbeReading, ProgramStats
from agent.sources.protocols import ProbeSource


class FakeClock:
    """A monotonic clock that moves only when told."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class RecordingProbe:
    programs = 0
    load_seconds = 0.0

    def __init__(self, reading: ProbeReading | None = None, clock: FakeClock | None = None) -> None:
        self.reading = reading or ProbeReading()
        self.clock = clock  # drain() advances it instead of sleeping, if given
        self.watched: set[int] = set()
        self.forgotten: list[int] = []
        self.forgotten_processes: list[int] = []
        self.slices: list[float] = []  # every drain(), in seconds asked
        self.closed = False
        self.seed_asked: dict[int, int] = {}  # every seed(), TID -> tgid

    def watch(self, tgids: Iterable[int]) -> None:
        self.watched = set(tgids)

    def read(self) -> ProbeReading:
        return self.reading

    def drain(self, seconds: float) -> None:
        """Waits as long as asked, like a ring buffer that receives no record."""
        self.slices.append(seconds)
        if self.clock is not None:
            self.clock.now += seconds
        else:
            time.sleep(seconds)

    def take_execs(self) -> list[int] | None:
        return None  # as a kernel without the tracepoints: discovery reads every process

    def seed(self, threads: Mapping[int, int]) -> set[int]:
        """Marks nothing, as a kernel whose threads map has no room."""
        self.seed_asked.update(threads)
        return set()

    def forget(self, tids: Iterable[int]) -> None:
        self.forgotten.extend(tids)

    def forget_processes(self, tgids: Iterable[int]) -> None:
        self.forgotten_processes.extend(tgids)

    def program_stats(self) -> dict[str, ProgramStats]:
        return {}

    def enable_stats(self) -> Callable[[], None] | None:
        return None

    def close(self) -> None:
        self.closed = True


_conforms: type[ProbeSource] = RecordingProbe  # mypy: the fake keeps up with the protocol
