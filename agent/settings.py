"""The settings that shape an observation, each with one default and one allowed range.

Two kinds of constants live here, so that a default or a range is written once:

* the settings a user sets with a flag or a config key (the park threshold, the daemon's
  interval, diagnose's duration). The CLI, the config and the observer all read them from
  here; a value is checked where it enters, and the error names that flag or key;
* the tunables no flag sets yet that still shape what a verdict or a report can see: how
  long a wait must last before the probe reports it, the progress window's floor, the CPU a
  thread must use to count as working, how often diagnose reads, the time stacks may take.
  Each is needed by more than one module (the session and the probe, the observer and
  progress, diagnose and the daemon): they take it from here, and a copy elsewhere is a bug.

What stays beside its code: a limit of one reader (a subprocess timeout, a cache's lifetime,
a byte cap: pystacks.READ_TIMEOUT_S, nvml.CACHE_S, tcpinfo.NETNS_TIMEOUT_S), which only
bounds how that reader does its I/O, needs its reason next to the call it bounds and has one
user; and a rule's own calibration in analysis/ (waits.STARTUP_S), which is part of what
the rule means, measured on the software it was written for, not a choice of the caller.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

from .errors import UsageError, show

_EXPONENT = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)[eE][-+]?\d{1,3}")


@dataclass(frozen=True)
class Bounded:
    """A number with one default and one allowed range. ``key`` is its config key, or for a
    tunable that no config sets, the name it would have there; ``flag`` its CLI flag, if any."""

    key: str
    flag: str | None
    default: float
    lo: float
    hi: float
    unit: ClassVar[str] = ""

    def check(self, value: object, where: str) -> float:
        """``value`` as a float, or a UsageError that starts with ``where`` (a flag or a
        config location) and names the bad value and the allowed range."""
        given = value
        if isinstance(value, str) and _EXPONENT.fullmatch(value.strip()):
            value = float(value)  # YAML 1.1 reads 1e3 (no dot, no sign) as a string
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            want = f"a number of {self.unit}" if self.unit else "a number"
            raise UsageError(f"{where}: want {want}, got {show(value)}")
        if not self.lo <= value <= self.hi:  # also NaN
            shown = given[:60] if isinstance(given, str) else show(given)
            raise UsageError(f"{where}: {shown} is out of range {self.range_text}")
        return float(value)

    @property
    def range_text(self) -> str:
        return f"{self.lo:g}-{self.hi:g} {self.unit}".rstrip()


class Seconds(Bounded):
    """A setting in seconds."""

    unit = "seconds"


DAY = 86400.0
# How long every thread must be parked, with no progress, before a service is stalled.
PARK_THRESHOLD = Seconds("park_threshold_seconds", "--threshold", 60.0, 1.0, 7 * DAY)
# The daemon's tick.
INTERVAL = Seconds("interval_seconds", None, 1.0, 0.1, 3600.0)
# How long `diagnose` observes.
DURATION = Seconds("duration_seconds", "--duration", 5.0, 0.5, DAY)

# The tunables no flag sets. Each ``*_S`` name is its default, for the code that uses it.

# diagnose reads this often: a cycle needs two reads, so even the shortest --duration has two.
DIAGNOSE_INTERVAL = Seconds("diagnose_interval_seconds", None, 0.5, 0.05, DURATION.lo)
DIAGNOSE_INTERVAL_S = DIAGNOSE_INTERVAL.default
# Waits longer than this go through the ring buffer. Compiled into the programs; at most the
# smallest threshold, so every wait that matters to a verdict is reported.
LONG_WAIT = Seconds("long_wait_seconds", None, 1.0, 0.01, PARK_THRESHOLD.lo)
LONG_WAIT_S = LONG_WAIT.default
# Progress is judged over at least this much history (the daemon): a log line every few
# seconds is progress even at a short interval.
MIN_WINDOW = Seconds("min_window_seconds", None, 5.0, 1.0, 3600.0)
MIN_WINDOW_S = MIN_WINDOW.default
# A thread "did work" in a tick when it used more CPU than this share of the tick: an idle
# poll loop (Python's serve_forever wakes twice a second) uses ~0.01%; a torch rank polling
# its own store every 10 ms while it waits for a peer, 1-2.5%.
CPU_FLOOR_RATIO = Bounded("cpu_floor_ratio", None, 0.05, 0.0, 1.0)
# ... and never less than this, the floor at the default 1 s interval: a shorter tick
# (diagnose reads every 0.5 s) must not count as work what a default tick leaves out. Ray's
# dashboard agent, idle, runs its event loop for 17-28 ms every 10 s: a 0.5 s tick's 25 ms
# caught it now and then, and an idle Serve app read progressing for that tick. A thread
# asleep on a 10 ms timer was seen charged 3-14 ms at once. Below the shortest interval, or
# no thread could ever work.
CPU_FLOOR_MIN = Seconds("cpu_floor_min_seconds", None, 0.050, 0.0, INTERVAL.lo)
# The Python stacks of one diagnose report, or of one daemon step's state changes, are read
# within this in all: a server of 2,000 threads reads in well under a second, and a reader
# that hangs must hold neither the engineer at the terminal nor the daemon's loop.
STACKS_BUDGET = Seconds("stacks_budget_seconds", None, 5.0, 0.1, 60.0)
STACKS_BUDGET_S = STACKS_BUDGET.default

# Every number above, for the test that each default lies in its range.
TUNABLES: tuple[Bounded, ...] = (
    PARK_THRESHOLD,
    INTERVAL,
    DURATION,
    DIAGNOSE_INTERVAL,
    LONG_WAIT,
    MIN_WINDOW,
    CPU_FLOOR_RATIO,
    CPU_FLOOR_MIN,
    STACKS_BUDGET,
)


@dataclass(frozen=True)
class Settings:
    """One observation's settings, as the observer uses them.

    ``window_s`` is how much history progress is judged over: the daemon's sliding window,
    or None for `diagnose`, whose window is the whole observation.
    """

    park_threshold_s: float = PARK_THRESHOLD.default
    interval_s: float = INTERVAL.default
    window_s: float | None = None
    # The CPU a thread must use in a tick to count as working (CPU_FLOOR_* above, for why).
    cpu_floor_ratio: float = CPU_FLOOR_RATIO.default
    cpu_floor_min_ns: int = round(CPU_FLOOR_MIN.default * 1e9)

    @classmethod
    def daemon(cls, park_threshold_s: float, interval_s: float) -> Settings:
        return cls(park_threshold_s, interval_s, max(MIN_WINDOW_S, 2 * interval_s))

    @classmethod
    def diagnose(cls, park_threshold_s: float) -> Settings:
        return cls(park_threshold_s, DIAGNOSE_INTERVAL_S, None)
