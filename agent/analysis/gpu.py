"""GPU evidence for verdicts: activity as progress, and the GPU-shaped hang.

Two shapes matter on a GPU host. A service whose host threads are all parked but whose GPUs
still work (SM utilisation above zero, or memory that changes: weights loading) is
progressing. The opposite, a hung collective, shows host threads parked past the threshold
while the service's GPUs sit at high utilisation the whole time: an NCCL kernel spinning on a
peer that never comes. That is a stall, whatever the GPU counters say.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ..model import GpuProcessUse, GpuReading
from . import evidence as ev

HIGH_UTILIZATION = 0.9  # "sits at high utilisation": a spinning kernel shows ~100%
MEMORY_CHANGE_BYTES = 1 << 20  # below 1 MiB is allocator noise, not loading


@dataclass(frozen=True)
class ProcessGpu:
    """One process's GPU facts at a tick, with how long each condition has held."""

    uses: tuple[GpuProcessUse, ...]
    active: bool  # SM utilisation above zero, or memory changed in the window
    memory_change: int  # bytes, over the window (signed)
    high_for_s: float  # how long every GPU of the process has stayed >= HIGH_UTILIZATION
    idle_for_s: float  # how long since it was last active (0 if active now)

    @property
    def memory_bytes(self) -> int:
        return sum(u.memory_bytes or 0 for u in self.uses)

    @property
    def max_utilization(self) -> float:
        return max((u.sm_utilization for u in self.uses), default=0.0)


def _memory(uses: Iterable[GpuProcessUse]) -> int:
    return sum(u.memory_bytes or 0 for u in uses)


class GpuHistory:
    """Per process: since when its GPUs are idle, and since when they are pegged high."""

    def __init__(self) -> None:
        self._active_ns: dict[int, int] = {}
        self._high_since_ns: dict[int, int] = {}
        self._first_ns: dict[int, int] = {}

    def update(self, reading: GpuReading | None, old: GpuReading | None, now_ns: int) -> None:
        if reading is None or not reading.ok:
            return  # no evidence either way: keep what we knew
        live = set(reading.processes)
        for pid, uses in reading.processes.items():
            self._first_ns.setdefault(pid, now_ns)
            util = max((u.sm_utilization for u in uses), default=0.0)
            before = old.processes.get(pid) if old is not None and old.ok else None
            changed = (
                before is not None and abs(_memory(uses) - _memory(before)) >= MEMORY_CHANGE_BYTES
            )
            if util > 0 or changed:
                self._active_ns[pid] = now_ns
            if util >= HIGH_UTILIZATION and all(u.sm_utilization >= HIGH_UTILIZATION for u in uses):
                self._high_since_ns.setdefault(pid, now_ns)
            else:
                self._high_since_ns.pop(pid, None)
        for d in (self._active_ns, self._high_since_ns, self._first_ns):
            for pid in [p for p in d if p not in live]:
                del d[pid]  # released its GPU or exited: bounded by GPU processes now

    def facts(
        self, pid: int, reading: GpuReading | None, window_old: GpuReading | None, now_ns: int
    ) -> ProcessGpu | None:
        """GPU facts of a process, or None when NVML did not answer or it holds no GPU."""
        if reading is None or not reading.ok or pid not in reading.processes:
            return None
        uses = reading.processes[pid]
        before = window_old.processes.get(pid) if window_old is not None and window_old.ok else None
        change = _memory(uses) - _memory(before) if before is not None else 0
        util = max((u.sm_utilization for u in uses), default=0.0)
        active = util > 0 or abs(change) >= MEMORY_CHANGE_BYTES
        high = self._high_since_ns.get(pid)
        last_active = self._active_ns.get(pid, self._first_ns.get(pid, now_ns))
        return ProcessGpu(
            uses=uses,
            active=active,
            memory_change=change,
            high_for_s=(now_ns - high) / 1e9 if high is not None else 0.0,
            idle_for_s=0.0 if active else (now_ns - last_active) / 1e9,
        )


def gpu_active(g: ProcessGpu) -> ev.GpuActive:
    return ev.GpuActive(tuple(u.gpu for u in g.uses), g.max_utilization, g.memory_change)


def gpu_idle(gpus: Mapping[int, ProcessGpu]) -> ev.GpuIdle | None:
    """Processes holding GPUs but not using them, or None."""
    held = [g for g in gpus.values() if g.memory_bytes and not g.active]
    if not held:
        return None
    uses = [u for g in held for u in g.uses]
    per_gpu = [u.memory_bytes or 0 for u in uses]
    each = per_gpu[0] if len(set(per_gpu)) == 1 and len(per_gpu) > 1 else None
    return ev.GpuIdle(
        tuple(u.gpu for u in uses), min(g.idle_for_s for g in held), each, sum(per_gpu)
    )


def gpu_spin(gpus: Iterable[ProcessGpu]) -> ev.GpuSpin:
    gs = list(gpus)
    uses = [u for g in gs for u in g.uses]
    return ev.GpuSpin(
        tuple(u.gpu for u in uses),
        min(u.sm_utilization for u in uses),
        min(g.high_for_s for g in gs),
    )
