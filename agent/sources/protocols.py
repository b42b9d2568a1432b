"""What an observation needs of its sources, as typed protocols.

``agent.sources.probe.KernelProbes`` and ``agent.sources.nvml.NvmlSource`` are the real
ones; tests pass stand-ins (tests/fakeprobe.py, a fake NVML). mypy checks every method the
agent calls on them against these protocols, so a method a caller needs cannot go missing
from a source.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Protocol

from ..model import GpuReading, ProbeReading, ProgramStats


class ProbeSource(Protocol):
    """The kernel side: which processes to watch, and what it saw of them."""

    programs: int  # tracepoints attached
    load_seconds: float  # how long compiling and loading took

    def watch(self, tgids: Iterable[int]) -> None:
        """Watch exactly these processes from now on."""

    def read(self) -> ProbeReading:
        """What the kernel holds now, and the events since the last read."""

    def drain(self, seconds: float) -> None:
        """Move pending events into memory, waiting up to ``seconds`` for the first."""

    def take_execs(self) -> list[int] | None:
        """PIDs that exec'd or were renamed since the last call, or None where some may be
        missing; those taken are not in the next read()."""

    def seed(self, threads: Mapping[int, int]) -> set[int]:
        """Mark these threads (TID -> tgid), read in futex waits the probe did not see
        begin, so that ProbeReading.seeded says which are still in them; returns those
        marked."""

    def forget(self, tids: Iterable[int]) -> None:
        """Drop what is kept for these threads (gone)."""

    def forget_processes(self, tgids: Iterable[int]) -> None:
        """Drop what is kept for these processes (gone, or no longer watched)."""

    def program_stats(self) -> dict[str, ProgramStats]:
        """Run time and count per attached program (zero unless stats are on)."""

    def enable_stats(self) -> Callable[[], None] | None:
        """Turn the kernel's run-time accounting on; returns how to turn it off, or None."""

    def close(self) -> None:
        """Detach everything."""


class GpuSource(Protocol):
    """NVML, or a fake of it."""

    def read(self) -> GpuReading:
        """One reading (never raises: ``ok`` False says why not)."""

    def pids(self) -> set[int]:
        """Processes that held GPU memory at the last reading."""

    def close(self) -> None:
        """Let go of the library."""
