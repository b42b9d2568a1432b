"""se.exec_start dated per CPU (agent.sources.schedclock): the rules against injected clocks
(tests/host/test_schedclock.py dates a real blocked thread on each CPU from the other)."""

from __future__ import annotations

import pytest

from agent.sources import schedclock
from agent.sources.schedclock import SchedClock


class Cpus:
    """A machine whose CPUs' task clocks lag monotonic by ``lag_ns[cpu]``; the calling thread
    runs on ``here`` until moved."""

    def __init__(self, lag_ns: dict[int, int], here: int, allowed: set[int] | None = None):
        self.lag_ns, self.here, self.now = lag_ns, here, 1_000_000_000_000
        self.allowed = set(lag_ns) if allowed is None else allowed
        self.pins: list[set[int]] = []
        self.refuse: set[int] = set()

    def own_exec_start_ms(self) -> float:
        return (self.now - self.lag_ns[self.here]) / 1e6

    def get_affinity(self, _pid: int) -> set[int]:
        return set(self.allowed)

    def set_affinity(self, _pid: int, cpus) -> None:
        cpus = set(cpus)
        if cpus & self.refuse:
            raise OSError(22, "Invalid argument")
        self.pins.append(cpus)
        if self.here not in cpus:
            self.here = min(cpus)

    def clock(self) -> SchedClock:
        return SchedClock(self, lambda: self.now, self.get_affinity, self.set_affinity)  # type: ignore[arg-type]


def stamp_ms(cpus: Cpus, cpu: int, ago_ns: int) -> float:
    """The exec_start a thread that stopped ``ago_ns`` ago on ``cpu`` shows."""
    return (cpus.now - ago_ns - cpus.lag_ns[cpu]) / 1e6


def test_each_cpu_is_dated_by_its_own_clock_and_the_thread_goes_home():
    cpus = Cpus({0: 13_289_000_000, 1: 20_418_000_000}, here=1)
    clock = cpus.clock()
    clock.begin()
    for cpu in (0, 1):
        got = clock.to_monotonic(stamp_ms(cpus, cpu, 40_000_000_000), cpu)
        assert abs(got - (cpus.now - 40_000_000_000)) < 1_000  # within rounding of a us
    clock.end()
    assert cpus.pins == [{0}, {1}, {0, 1}] and clock.reads == 2


def test_one_offset_for_all_would_be_off_by_what_the_cpus_lost_apart():
    """What the per-CPU read replaces: the agent's own CPU's offset for another CPU's stamp."""
    cpus = Cpus({0: 13_289_000_000, 1: 20_418_000_000}, here=1)
    own = cpus.now - int(cpus.own_exec_start_ms() * 1e6)
    wrong = int(stamp_ms(cpus, 0, 40_000_000_000) * 1e6) + own
    assert (cpus.now - wrong) / 1e9 == pytest.approx(40 - 7.129)
    clock = cpus.clock()
    clock.begin()
    right = clock.to_monotonic(stamp_ms(cpus, 0, 40_000_000_000), 0)
    assert (cpus.now - right) / 1e9 == pytest.approx(40, abs=1e-6)


def test_a_cpu_is_read_again_only_once_its_offset_is_stale():
    cpus = Cpus({0: 5_000_000_000, 1: 9_000_000_000}, here=0)
    clock = cpus.clock()
    clock.begin()
    clock.to_monotonic(1.0, 1)
    clock.end()
    cpus.lag_ns[1] += 300_000_000  # CPU 1 lost 0.3 s more
    cpus.now += schedclock.REFRESH_NS - 1
    clock.begin()
    stale = clock.to_monotonic(stamp_ms(cpus, 1, 0), 1)
    assert clock.reads == 1 and cpus.now - stale == 300_000_000  # dated early, by the loss
    cpus.now += 1
    clock.begin()  # the next snapshot: stale by then
    fresh = clock.to_monotonic(stamp_ms(cpus, 1, 0), 1)
    assert clock.reads == 2 and fresh == cpus.now


def test_cpus_it_may_not_run_on_fall_back_to_its_own_and_are_not_pinned():
    """An agent confined to CPUs 0 and 2 (CPUAffinity=) stays there; a CPU the kernel refuses (gone
    offline, or out of the cpuset) is not asked again before its offset would be stale."""
    cpus = Cpus({0: 5_000_000_000, 1: 9_000_000_000, 2: 1_000_000_000}, here=0, allowed={0, 2})
    cpus.refuse = {2}
    clock = cpus.clock()
    clock.begin()
    own = cpus.now - 1_000_000  # dated by CPU 0, its own: right for CPU 0 alone
    assert clock.to_monotonic(stamp_ms(cpus, 0, 1_000_000), None) == own
    assert clock.to_monotonic(stamp_ms(cpus, 0, 1_000_000), 1) == own  # outside: own offset
    for _ in range(3):
        assert clock.to_monotonic(stamp_ms(cpus, 0, 1_000_000), 2) == own
    clock.end()
    assert cpus.pins == [] and clock.reads == 0  # refused once, never moved, nothing to undo


def test_a_snapshot_reads_few_stale_offsets_again_but_every_new_cpu(monkeypatch):
    """A busy host's tick waits up to a time slice per CPU it visits: stale offsets are read
    again a few per snapshot (the rest keep theirs a tick longer); a CPU never read is read."""
    monkeypatch.setattr(schedclock, "REFRESH_PER_SNAPSHOT", 2)
    cpus = Cpus({c: 1_000_000_000 * (c + 1) for c in range(6)}, here=0)
    clock = cpus.clock()
    clock.begin()
    for c in range(4):
        clock.to_monotonic(1.0, c)
    assert clock.reads == 4  # all new: no cap
    cpus.now += schedclock.REFRESH_NS
    cpus.lag_ns[3] += 500_000_000
    clock.begin()
    got = [clock.to_monotonic(stamp_ms(cpus, c, 0), c) for c in (0, 1, 2, 3, 4, 5)]
    assert clock.reads == 4 + 2 + 2  # CPUs 0 and 1 again, 4 and 5 new; 2 and 3 wait
    assert cpus.now - got[3] == 500_000_000  # its stale offset: dated early by what it lost since
    clock.begin()
    assert clock.to_monotonic(stamp_ms(cpus, 3, 0), 3) == cpus.now and clock.reads == 9
